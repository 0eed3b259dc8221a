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
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_context"):  # fmt: skip
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
            raise ValueError(f"model config {name!r} lacks the key {err.args[0]!r}") from None

    def layer_params(self) -> int:
        """Parameters of one decoder layer (projections + MLP + norms)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        bias = d * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate_size + 2 * h

    def to_dict(self) -> dict:
        return asdict(self)


def model_config(model: str) -> dict:
    """The ``config.json`` dict of a built-in model name, a ``config.json`` path, or a directory
    holding one (``ValueError`` naming ``--model`` when there is none or it is not JSON)."""
    if model in BUILTIN_MODELS:
        path = CONFIG_DIR / f"{model}.json"
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"--model {model!r}: not a built-in model {BUILTIN_MODELS} and no config.json there"
            )
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--model {model!r}: {path} is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {model!r}: {path} is not a model config (a JSON object)")
    return cfg


def load_shapes(model: str) -> ModelShapes:
    """Shapes of a built-in model name, a ``config.json`` path, or a directory holding one."""
    return ModelShapes.from_hf_config(model_config(model), name=model)


def unsupported_attention(config) -> str | None:
    """Why the block-sparse op cannot run this model's attention (a config dict or a
    transformers config), or None: it computes full document-causal attention, so a sliding
    window (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, ``sliding_attention``
    layers) or logit soft-capping would be silently computed wrong."""

    def get(key, default=None):
        return config.get(key, default) if isinstance(config, dict) else getattr(
            config, key, default)  # fmt: skip

    window = get("sliding_window")
    if (window is not None and get("use_sliding_window", True)) or "sliding_attention" in (
        get("layer_types") or ()
    ):
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


def check_trainable(model: str) -> ModelShapes:
    """The shapes of ``--model``, refused in one line before anything is built or profiled when
    the block-sparse attention cannot run it."""
    cfg = model_config(model)
    check_attention(cfg, f"--model {model}")
    return ModelShapes.from_hf_config(cfg, name=model)
