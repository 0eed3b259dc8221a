"""No capability probes on the project's own types (STYLE.md, "Types, not probes"; issue 42 item 1,
issue 43 item 6): a ``getattr(obj, "name", default)`` or ``hasattr(obj, "name")`` asked of one of
our objects turns a rename into a silent change of behaviour (one made every layer on CUDA read
back to the host, and no test noticed). Our types say what they have: a Protocol, a declared
attribute, ``isinstance`` on a class.

Probing a third-party object (a transformers config that may lack a field, an HF Trainer's
arguments) is fine: every such probe left in the package is listed in
:data:`ALLOWED_BY_FILE` with the reason its default is right (and says so in a comment where it
stands). The calls are found with ``ast`` (a probe split over lines or nested in another is still
found); keys hold no line numbers, so unrelated edits leave the list alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sparsebalance

ROOT = Path(sparsebalance.__file__).parent

Key = tuple[str, str, str]
"""``(file under sparsebalance/, the probed object as written, the attribute)``."""

# file -> (object, attribute) -> why the object is third-party and a default is right.
ALLOWED_BY_FILE: dict[str, dict[tuple[str, str], str]] = {
    "engine/parallelize.py": {
        ("model", "_no_split_modules"): "transformers' PreTrainedModel field; none: refused",
    },
    "engine/step.py": {
        ("norm", "full_tensor"): "torch's grad norm: a DTensor under FSDP2, else a tensor",
    },
    "ops/block_sparse_flex.py": {
        ("config", "_make_closure_patcher"): "torch's private hot-path patcher; absent: config.patch",
    },
    "models/checkpointing.py": {
        ("model", "_no_split_modules"): "transformers' PreTrainedModel field; none: refused",
        ("layer", "mlp"): "a transformers decoder layer's MLP child; none: refused",
    },
    "models/head.py": {
        ("head", "weight"): "transformers' lm-head module; no weight: refused",
        ("head", "bias"): "transformers' lm-head module, with or without a bias",
    },
    "models/shapes.py": {
        ("config", "model_type"): "a transformers config may lack it: judged by its keys",
        ("config", "key"): "a transformers config has its own family's fields only",
    },
    "integrations/attach.py": {
        ("model", "config"): "any torch module may be passed; no HF config: refused",
        ("config", "model_type"): "a transformers config may lack it: refused",
        ("module", "layer_idx"): "transformers' attention modules (no common base class)",
        ("module", "q_proj"): "transformers' attention modules (no common base class)",
    },
    "integrations/inference.py": {
        ("cache", "get_seq_length"): "a transformers Cache has it; a legacy tuple has not",
    },
    "integrations/sampler.py": {
        ("dataset", "column_names"): "a datasets.Dataset has it; a plain sequence has not",
    },
    "hf/__init__.py": {
        ("args", "packing"): "TRL's SFTConfig has it; TrainingArguments has not",
        ("args", "activation_checkpointing"): "transformers' new name: a version may lack it",
        ("args", "gradient_checkpointing"): "transformers' old name: a version may lack it",
        ("trainer", "processing_class"): "an HF Trainer's tokenizer; may be absent",
        ("owner", "pad_token_id"): "a tokenizer or HF config may lack a pad token (then 0)",
    },
    "models/attention.py": {
        ("module", "layer_idx"): "a transformers attention module carries it; a bare one not",
    },
    "commands/eval.py": {
        ("config", "max_position_embeddings"): "a transformers config may lack it: no length check",
    },
    "evaluation/recall.py": {
        ("module", "layer_idx"): "a transformers attention module carries it; a bare one not",
    },
    "hf/callback.py": {
        ("self.trainer", "model_wrapped"): "an HF Trainer's DDP wrapper; no trainer: None",
    },
}
ALLOWED: set[Key] = {(f, *k) for f, entries in ALLOWED_BY_FILE.items() for k in entries}


def probes(source: str, name: str) -> list[tuple[Key, int]]:
    """Every ``getattr`` with a default and every ``hasattr`` in ``source`` (file ``name``), as
    ``(key, line)``."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        is_probe = (node.func.id == "getattr" and len(node.args) == 3) or (
            node.func.id == "hasattr" and len(node.args) == 2
        )
        if is_probe:
            attr = node.args[1]
            text = attr.value if isinstance(attr, ast.Constant) else ast.unparse(attr)
            found.append(((name, ast.unparse(node.args[0]), str(text)), node.lineno))
    return found


def _all_probes() -> list[tuple[Key, int]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):  # the whole package: every module is ours
        out += probes(path.read_text(), path.relative_to(ROOT).as_posix())
    return out


def test_no_probe_outside_the_allow_list():
    new = [
        f"sparsebalance/{file}:{line}: {attr!r} of {obj}"
        for (file, obj, attr), line in _all_probes()
        if (file, obj, attr) not in ALLOWED
    ]
    assert not new, (
        "getattr(obj, name, default) / hasattr probes: depend on the type (a Protocol, a declared "
        "attribute, isinstance) for the project's own objects; a third-party probe goes into "
        "ALLOWED with its reason:\n" + "\n".join(new)
    )


def test_every_allowed_probe_still_exists():
    """A probe removed from the code leaves the list too (the list names what remains)."""
    present = {key for key, _ in _all_probes()}
    assert present >= ALLOWED, sorted(ALLOWED - present)


def test_the_finder_sees_probes_and_skips_plain_getattr():
    source = (
        "def f(obj, cfg, self, field):\n"
        "    a = getattr(obj, 'curve', None)\n"
        "    b = getattr(\n        getattr(obj, 'inner', None), 'is_cuda', False)\n"
        "    if hasattr(cfg, 'table'):\n"
        "        return getattr(self, field), getattr(obj, 'curve')\n"
    )
    keys = sorted(key for key, _ in probes(source, "x.py"))
    assert keys == [
        ("x.py", "cfg", "table"),
        ("x.py", "getattr(obj, 'inner', None)", "is_cuda"),
        ("x.py", "obj", "curve"),
        ("x.py", "obj", "inner"),
    ]
