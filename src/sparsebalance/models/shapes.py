"""``ModelShapes``: the layer shapes that determine cost, read from HF-style ``config.json`` files.

Built-in names (``tiny``, ``qwen2.5-0.5b``, ``qwen2.5-3b``) resolve to configs shipped in
``models/configs/``; any other value is a path to a ``config.json`` or to a directory holding one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
BUILTIN_MODELS = tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
SUPPORTED_MODEL_TYPES = {
    "qwen2": "Qwen2/Qwen2.5",
    "qwen3": "Qwen3",
    "llama": "Llama",
    "mistral": "Mistral without a sliding window",
}
"""``config.json``'s ``model_type`` -> the family: decoders whose attention goes through
transformers' ``AttentionInterface`` as full causal attention, with the keys :class:`ModelShapes`
reads. Others (GPT-2's ``n_head``, ``n_layer``, ...) are refused before anything is built."""
SUPPORTED = ", ".join(f"{name} ({kind!r})" for kind, name in SUPPORTED_MODEL_TYPES.items())


@dataclass(frozen=True)
class ModelShapes:
    """Decoder-only transformer shapes (Qwen2 / Llama family)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_context",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"model config: {field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "custom") -> ModelShapes:
        """From a Hugging Face ``config.json`` dict (Qwen2/Qwen3/Llama keys)."""
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                name=name,
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                max_context=int(cfg.get("max_position_embeddings", 32768)),
                qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            )
        except KeyError as err:
            raise ValueError(
                f"model config {name!r} lacks the key {err.args[0]!r}, which the config of a "
                f"supported model has (supported: {SUPPORTED})"
            ) from None

    def layer_params(self) -> int:
        """Parameters of one decoder layer (projections + MLP + norms)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        bias = d * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate_size + 2 * h

    def to_dict(self) -> dict:
        return asdict(self)


def model_config(model: str, who: str | None = None) -> dict:
    """The ``config.json`` dict of a built-in model name, a ``config.json`` path, or a directory
    holding one, of a supported model type (:func:`check_model_type`). ``ValueError`` naming
    ``who`` (default ``--model M``) when there is none, it is not JSON or the type is not one."""
    who = who or f"--model {model}"
    if model in BUILTIN_MODELS:
        path = CONFIG_DIR / f"{model}.json"
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"{who}: not a built-in model {BUILTIN_MODELS} and no config.json there")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{who}: {path} is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{who}: {path} is not a model config (a JSON object)")
    check_model_type(cfg, who)
    return cfg


def check_model_type(config, who: str) -> None:
    """One ``ValueError`` naming ``who`` (``--model M``) when the config (a dict or a
    transformers config) declares a ``model_type`` outside :data:`SUPPORTED_MODEL_TYPES`; a
    hand-written config without one is judged by its keys (:meth:`ModelShapes.from_hf_config`)."""
    # a transformers config may lack model_type (a hand-made PretrainedConfig): judged by its keys
    kind = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if kind is not None and kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{who}: model type {kind!r} is not supported (supported: {SUPPORTED}): SparseBalance "
            "runs decoders whose attention it replaces as full document-causal attention"
        )


def load_shapes(model: str) -> ModelShapes:
    """Shapes of a built-in model name, a ``config.json`` path, or a directory holding one."""
    return ModelShapes.from_hf_config(model_config(model), name=model)


def unsupported_attention(config) -> str | None:
    """Why the block-sparse op cannot run this model's attention (a config dict or a
    transformers config), or None: it computes full document-causal attention, so a sliding
    window (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, ``sliding_attention``
    layers) or logit soft-capping would be silently computed wrong."""

    def get(key, default=None):
        # a transformers config defines only its own family's fields (Qwen2's use_sliding_window,
        # Gemma's softcapping): a field it lacks is a feature the model does not use
        return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

    window = get("sliding_window")
    if (window is not None and get("use_sliding_window", True)) or "sliding_attention" in (get("layer_types") or ()):
        return f"it uses sliding-window attention (sliding_window {window})"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(name):
            return f"it uses logit soft-capping ({name})"
    return None


def check_attention(config, who: str) -> None:
    """One ``ValueError`` naming ``who`` (``--model M``, ``sparsebalance.attach``) when the
    block-sparse attention cannot run this model (:func:`unsupported_attention`)."""
    why = unsupported_attention(config)
    if why is not None:
        raise ValueError(
            f"{who}: {why}, which the block-sparse attention does not implement (it computes "
            "full document-causal attention)"
        )


def check_trainable(model: str, who: str | None = None) -> ModelShapes:
    """The shapes of ``--model``, refused in one line naming ``who`` (default ``--model M``)
    before anything is built or profiled when it is not a supported model type or the
    block-sparse attention cannot run it."""
    who = who or f"--model {model}"
    cfg = model_config(model, who)
    check_attention(cfg, who)
    return ModelShapes.from_hf_config(cfg, name=model)
