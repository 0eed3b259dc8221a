"""Stage-only materialisation (``--pp``): no rank builds the whole model.

The model is built with every tensor on the ``meta`` device (no storage), under
:class:`InitRecorder`: the build runs the exact code a CPU build runs (the constructors'
initialisation, then ``transformers``' ``initialize_weights`` and the tying of the head), and every
in-place operation on a parameter is logged with the tensor it wrote (its storage and view).
Before each random fill the CPU generator's state is saved, then advanced exactly as the fill on a
real tensor would advance it (the same operation run on a scratch tensor of the same shape and
strides, reused in slices for very large tensors), so after the build the generator is where a
whole build leaves it.

:func:`materialise` then gives storage to the tensors the stage kept (the others were dropped with
their modules: :class:`~sparsebalance.engine.stage.StageModel`) and replays the log on them alone,
each random fill from its saved generator state: the stage holds exactly the values a whole-model
build gives for the seed, and a rank's host memory holds its stage, the log and one scratch slice.
:func:`load_stage_weights` reads a pretrained stage's tensors, and only them, from the model's
safetensors files instead.

Buffers computed by a constructor (the rotary embedding's frequencies) are not writes to a
parameter: the rotary embedding is built again on the host (it holds no parameters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

RANDOM_FILLS = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_")
"""In-place random fills: they read the CPU generator (the others are replayed as they are)."""

SCRATCH_BYTES = 64 << 20
"""Largest scratch tensor used to advance the generator past a tensor another stage holds; a
larger contiguous float32 ``normal_``/``uniform_`` is advanced in slices of this size."""

_FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "arange", "linspace", "scalar_tensor", "eye"}
_RANDOM_FACTORIES = {
    "rand",
    "randn",
    "randint",
    "randperm",
    "normal",
    "bernoulli",
    "multinomial",
    "rand_like",
    "randn_like",
}


@dataclass
class _Write:
    """One logged in-place write: which storage, the view written, the op and its other inputs,
    and the generator's state before it (random fills only)."""

    storage: object
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    func: object
    args: tuple
    kwargs: dict
    rng: torch.Tensor | None
    factory: bool = False
    """A factory's values (``ones``, ``arange``, ...): made on the host and copied in."""


@dataclass
class InitLog:
    """What :class:`InitRecorder` logged: the writes in order, and the generator's state at the
    end of the build (where a whole build leaves it)."""

    writes: list[_Write] = field(default_factory=list)
    final_rng: torch.Tensor | None = None


class InitRecorder(TorchDispatchMode):
    """Builds on ``meta`` and logs the initialisation (see the module docstring). Factory calls
    for the host (no device, or ``cpu``) are made on ``meta``; ``scratch_bytes``: the largest
    scratch tensor (:data:`SCRATCH_BYTES`)."""

    def __init__(self, scratch_bytes: int = SCRATCH_BYTES) -> None:
        super().__init__()
        self.log = InitLog()
        self.scratch_bytes = scratch_bytes

    def __exit__(self, *exc):
        self.log.final_rng = torch.get_rng_state()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func._schema.name.split("::")[-1]
        if name in _RANDOM_FACTORIES:  # values no write to a parameter carries: not replayable
            raise ValueError(f"--pp: the model's construction draws random values outside an initialisation ({name})")
        if name in _FACTORIES and kwargs.get("device") in (None, torch.device("cpu"), "cpu"):
            kwargs["device"] = torch.device("meta")
            out = func(*args, **kwargs)
            if name not in ("empty", "empty_strided"):  # its values: made again on the host at replay
                host = {**kwargs, "device": torch.device("cpu")}
                self.log.writes.append(
                    _Write(
                        out.untyped_storage(),
                        tuple(out.size()),
                        tuple(out.stride()),
                        out.storage_offset(),
                        func,
                        tuple(args),
                        host,
                        None,
                        factory=True,
                    )
                )
            return out
        schema_args = func._schema.arguments
        writes = bool(schema_args) and schema_args[0].alias_info is not None and schema_args[0].alias_info.is_write
        target = args[0] if args else None
        if writes and isinstance(target, torch.Tensor) and target.is_meta:
            rng = None
            if name in RANDOM_FILLS:
                if kwargs.get("generator") is not None:
                    raise ValueError(f"--pp: the model's initialisation draws from its own generator ({name})")
                rng = torch.get_rng_state()
                self._advance(func, target, args[1:], kwargs, name)
            self.log.writes.append(
                _Write(
                    target.untyped_storage(),  # kept alive: no later tensor reuses its identity
                    tuple(target.size()),
                    tuple(target.stride()),
                    target.storage_offset(),
                    func,
                    tuple(args[1:]),
                    kwargs,
                    rng,
                )
            )
        return func(*args, **kwargs)

    def _advance(self, func, target: torch.Tensor, args: tuple, kwargs: dict, name: str) -> None:
        """The CPU generator moved as ``func`` on a real ``target`` would move it."""
        nbytes = target.numel() * target.element_size()
        if nbytes <= self.scratch_bytes or not _sliceable(target, name):
            scratch = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype)
            func(scratch, *args, **kwargs)
            return
        # A contiguous float32 tensor of n >= 16 elements: normal_ draws n uniforms (then 16
        # more when n % 16 != 0), uniform_ n. Slices of a multiple of 16 elements draw their own
        # size and no more; the last slice keeps the residue (and is at least 16 elements long).
        n, step = target.numel(), max(16, (self.scratch_bytes // target.element_size()) // 16 * 16)
        scratch = torch.empty(2 * step, dtype=target.dtype)
        done = 0
        while n - done >= 2 * step:
            func(scratch[:step], *args, **kwargs)
            done += step
        func(scratch[: n - done], *args, **kwargs)


def _sliceable(target: torch.Tensor, name: str) -> bool:
    return name in ("normal_", "uniform_") and target.dtype == torch.float32 and target.is_contiguous()


def build_on_meta(build, scratch_bytes: int = SCRATCH_BYTES) -> tuple[nn.Module, InitLog]:
    """``build()`` (a function making the model on the host, e.g. ``from_config`` after
    ``torch.manual_seed``) run with every tensor on ``meta``; the model and its initialisation log."""
    recorder = InitRecorder(scratch_bytes)
    with recorder:
        model = build()
    return model, recorder.log


def materialise(model: nn.Module, log: InitLog | None, device: torch.device | str = "cpu") -> nn.Module:
    """Give the ``meta`` parameters and buffers ``model`` still holds storage on ``device``, tied
    ones staying tied, and fill them by replaying ``log`` (None: left empty, for weights read next);
    the rotary embedding is rebuilt. The generator ends where the logged build left it. Raises
    ``ValueError`` (one line) for a write it cannot replay."""
    decoder = model.get_decoder()
    rotary = decoder.rotary_emb
    with torch.device("cpu"):  # its frequencies, computed as the constructor computes them
        decoder.rotary_emb = type(rotary)(config=model.config).to(device)
    real: dict[int, torch.Tensor] = {}  # meta storage -> its real flat tensor
    made: dict[int, torch.Tensor] = {}  # meta tensor -> its replacement (tied weights share one)
    names: dict[int, str] = {}  # meta storage -> a name of a tensor in it
    for prefix, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            entries = getattr(module, kind)
            for key, t in list(entries.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    storage = t.untyped_storage()
                    flat = real.get(storage._cdata)
                    if flat is None:
                        flat = torch.empty(storage.nbytes() // t.element_size(), dtype=t.dtype, device=device)
                        real[storage._cdata] = flat
                        names[storage._cdata] = f"{prefix}.{key}" if prefix else key
                    view = flat.as_strided(t.size(), t.stride(), t.storage_offset())
                    made[id(t)] = nn.Parameter(view, requires_grad=t.requires_grad) if kind == "_parameters" else view
                entries[key] = made[id(t)]
    if log is None:
        return model
    end = torch.get_rng_state()
    written = set()
    for w in log.writes:
        flat = real.get(w.storage._cdata)
        if flat is None:  # another stage's tensor
            continue
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*w.args, *w.kwargs.values())):
            raise ValueError(
                f"--pp: the model's initialisation writes a computed tensor ({w.func}); train it with --pp 1"
            )
        if w.rng is not None:
            torch.set_rng_state(w.rng)
        target = flat.as_strided(w.size, w.stride, w.offset)
        with torch.no_grad():
            if w.factory:
                target.copy_(w.func(*w.args, **w.kwargs))
            else:
                w.func(target, *w.args, **w.kwargs)
        written.add(w.storage._cdata)
    torch.set_rng_state(log.final_rng if log.final_rng is not None else end)
    never = [names[k] for k in real if k not in written]
    if never:  # computed out of place by a constructor: its values cannot be replayed
        raise ValueError(
            f"--pp: {never[0]} is computed by the model's constructor, not initialised: train it with --pp 1"
        )
    return model


def load_stage_weights(
    model: nn.Module, folder: Path, names: list[str], dtype: torch.dtype = torch.float32
) -> list[str]:
    """Fill ``model``'s (materialised) tensors named ``names`` (a stage's state-dict keys) from the
    pretrained files in ``folder``, reading those tensors alone (safetensors, or a ``.bin`` file
    memory-mapped); a tied weight is read under whichever of its names the files hold. Returns the
    names read. ``ValueError`` (one line) when a tensor is missing or of another shape."""
    files = _weight_files(folder)
    where: dict[str, Path] = {}
    for f in files:
        for key in _keys(f):
            where.setdefault(key, f)
    entries = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(id(entries[n]), []).append(n)
    wanted: dict[Path, list[tuple[str, list[str]]]] = {}
    for group in groups.values():
        found = next((k for n in group for k in (n, n.removeprefix("model.")) if k in where), None)
        if found is None:
            raise ValueError(f"--model {folder}: its weight files lack {group[0]}, which this pipeline stage holds")
        wanted.setdefault(where[found], []).append((found, group))
    read = []
    with torch.no_grad():
        for f, items in wanted.items():
            for key, tensor in _read(f, [k for k, _ in items]):
                group = next(g for k, g in items if k == key)
                target = entries[group[0]]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"--model {folder}: {key} is {tuple(tensor.shape)} in its files, "
                        f"the model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(dtype))
                read.append(key)
    return read


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    found = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not found:
        raise ValueError(f"--model {folder}: no safetensors or .bin weight files")
    return found


def _keys(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    return list(_bin(path))


def _read(path: Path, keys: list[str]):
    """``(key, tensor)`` for ``keys`` of one weight file, one tensor at a time."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                yield key, f.get_tensor(key)
        return
    state = _bin(path)
    for key in keys:
        yield key, state[key]


def _bin(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a pickle the safe loader refuses, or a damaged file
        raise ValueError(f"--model {path}: unreadable ({type(err).__name__})") from None
