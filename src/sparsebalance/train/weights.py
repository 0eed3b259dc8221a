"""Trained weights for evaluation: a model named by a built-in config, a Hugging Face directory, a
trainer checkpoint folder or a trainer run folder, with the vocabulary map a compact-vocabulary
model was trained with (tokenizer id -> model id)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .checkpoint import find_checkpoint, load_weights
from .shards import has_weights


def load_trained_model(
    model: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    base: str | None = None,
    vocab_map: str | None = None,
) -> tuple[torch.nn.Module, dict[int, int] | None]:
    """``(model, vocab_map or None)``.

    Args:
        model: ``--model``: a built-in name or Hugging Face directory (see
            :func:`sparsebalance.models.hf.build_model`), a checkpoint folder (``model.pt`` or a
            pipeline's stage files, merged here; its base model from ``meta.json``'s ``model`` or
            ``base``) or a run folder (its ``checkpoints/latest``).
        base: ``--base``: the base model of a checkpoint whose ``meta.json`` does not name it.
        vocab_map: ``--vocab-map``: a JSON ``{tokenizer id: model id}`` file; default: the
            checkpoint's ``vocab_map.json``, else the run folder's; for a Hugging Face folder
            (e.g. ``benchmarks/accuracy_pretrain.py``'s output) its own; else none.
    """
    from ..models.hf import build_model

    path = Path(model)
    ckpt = find_weights(path) if path.is_dir() else None
    if ckpt is None:  # a built-in name, or a Hugging Face folder (its own map, if it has one)
        here = [path / "vocab_map.json"] if path.is_dir() else []
        return build_model(model, device, dtype), read_vocab_map(vocab_map, here)
    if ckpt == path:  # a checkpoint folder, named
        try:
            return _from_checkpoint(ckpt, device, dtype, base, vocab_map)
        except (ValueError, OSError) as err:
            if not has_weights(ckpt):
                raise ValueError(
                    f"--model {ckpt}: the checkpoint was removed while it was read (pruned by a "
                    "run still training?): retry, or give the run folder to read its newest one"
                ) from None
            raise _one_line(ckpt, err) from None
    # A run folder: the run may still be training, saving a checkpoint and pruning the oldest
    # while this reads. A checkpoint that fails to read is looked for again: pruned (or replaced)
    # meanwhile, the look gives a newer one, read instead; the same one: the failure is its own.
    for _ in range(_RELOOKS):
        try:
            return _from_checkpoint(ckpt, device, dtype, base, vocab_map)
        except (ValueError, OSError) as err:
            again = find_weights(path)
            if again == ckpt:
                raise _one_line(ckpt, err) from None
            if again is None:
                raise ValueError(
                    f"--model {path}: {ckpt.name} was removed while it was read, and the run "
                    "folder holds no other checkpoint"
                ) from None
            ckpt = again
    raise ValueError(
        f"--model {path}: its newest checkpoint was pruned while it was read, {_RELOOKS} times "
        "in a row (the run saves and prunes faster than it can be read): retry"
    )


_RELOOKS = 5
"""Checkpoints of a run folder read in a row before giving up (each pruned while read)."""


def _from_checkpoint(
    ckpt: Path, device, dtype, base: str | None, vocab_map: str | None
) -> tuple[torch.nn.Module, dict[int, int] | None]:
    """The model and vocabulary map of the checkpoint folder ``ckpt``, every file read once."""
    from ..models.hf import build_model

    meta_file = ckpt / "meta.json"
    try:
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {meta_file}: unreadable ({err})") from None
    base = base or meta.get("model")
    if base is None:
        raise ValueError(f"--model {ckpt}: a trainer checkpoint; give its base model with --base")
    candidates = [ckpt / "vocab_map.json", ckpt.parent.parent / "vocab_map.json"]
    vmap = read_vocab_map(vocab_map, candidates)
    state = load_weights(ckpt, device)  # checksums first: a damaged file is never evaluated
    net = build_model(base, device, dtype)
    try:
        net.load_state_dict(state)
    except RuntimeError as err:  # other shapes or names: the --base is not its model
        first = str(err).strip().splitlines()[0]
        raise ValueError(f"--model {ckpt}: its weights do not fit the base model {base!r} ({first})") from None
    return net, vmap


def _one_line(ckpt: Path, err: BaseException) -> ValueError:
    """``err`` as the one line ``eval`` prints (an ``OSError`` of a file named in it)."""
    if isinstance(err, ValueError):
        return err
    return ValueError(f"checkpoint {ckpt}: unreadable ({err})")


def find_weights(path: Path) -> Path | None:
    """The checkpoint folder ``path`` names (itself, or the newest intact checkpoint of a run
    folder, with a line on stderr for each damaged one skipped), or None when ``path`` holds no
    checkpoint (a Hugging Face folder). A run folder whose checkpoints are all damaged is
    refused in one line."""
    if has_weights(path):  # model.pt, or a pipeline's stage files
        return path
    ckpt, notes = find_checkpoint(path, ("model.pt",))
    if ckpt is None and notes:
        raise ValueError(f"--model {path}: no intact checkpoint ({notes[-1]})")
    for note in notes:
        print(f"sparsebalance: {note}", file=sys.stderr)
    return ckpt


def read_vocab_map(explicit: str | None, candidates: list[Path]) -> dict[int, int] | None:
    """The map in ``explicit`` (``--vocab-map``), else in the first existing candidate file."""
    files = [Path(explicit)] if explicit else [c for c in candidates if c.is_file()]
    if not files:
        return None
    try:
        raw = json.loads(files[0].read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--vocab-map {files[0]}: not a readable JSON object ({err})") from None
    return {int(k): int(v) for k, v in raw.items()}
