"""What a region of code asks of the device: the operations that launch work, the elements they
write, and every read of a value back to the host. Counted on any device, so a CPU run shows
what a CUDA run would launch and where it would wait.

A :class:`LaunchCounter` is a ``TorchDispatchMode``: it sees every aten op the region dispatches
(forward and, if the region runs it, backward). An op *launches* unless it only makes a view or
an uninitialised allocation (no kernel runs for those). A *host read* is an op that needs a
tensor's values on the host (``.item()``, ``bool(t)``, ``nonzero``, ``unique``, ``bincount``,
``histc`` without a range, ``repeat_interleave`` without ``output_size``, ...), or one of the
tensor methods that read values without dispatching an op (``.tolist()``, ``.numpy()``,
``.cpu()``): on CUDA each one makes the host wait for the device. A read is counted once (a
method and the op it dispatches are one read). A tensor constructor given host data and a
``device`` (``torch.tensor(list, device=...)``) is a copy to the device that no op shows: it is
counted as a launch (``h2d_copy``) and listed in :attr:`LaunchCounter.constructor_copies` (on
CUDA from pageable memory: the host waits for it).

The attention kernels themselves are called through :func:`kernel`: inside a counted region it
runs them with the counter paused (their own work is the kernel, not what is around it) and
counts the call; outside one it is a plain call (one context-variable read).

    with LaunchCounter() as count:
        layer(q, k, v)
    count.num_ops, count.reads, count.kernels
"""

from __future__ import annotations

import traceback
from collections import Counter as _Tally
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten
HOST_READS = frozenset(
    {
        aten._local_scalar_dense,
        aten.nonzero,
        aten.masked_select,
        aten.equal,
        aten.is_nonzero,
        aten._unique,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
    }
)
"""Ops whose result depends on values only the host can size or return (a sync on CUDA)."""
HOST_READ_OVERLOADS = frozenset({aten.repeat_interleave.Tensor, aten.bincount.default, aten.histc.default})
"""Overloads that read the host unless told their output's size (:func:`_sized_by_values`):
``repeat_interleave`` without ``output_size``, ``bincount`` always (its length is the maximum
value), ``histc`` without a range (it reads the minimum and maximum)."""
CONSTRUCTORS = ("tensor", "as_tensor")
"""``torch`` functions that copy host data to ``device=`` without dispatching a copy."""
MASK_INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
"""Indexing ops that read the host when an index is a boolean mask (its ``nonzero`` runs inside
the op, unseen by a dispatch mode)."""
HOST_METHODS = ("tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__")
"""Tensor methods that read values on the host without (always) dispatching an aten op."""
NO_LAUNCH = frozenset(
    {
        aten.empty,
        aten.empty_like,
        aten.empty_strided,
        aten._unsafe_view,
        aten.lift_fresh,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
    }
)
"""Ops that allocate without writing, or only read metadata: no kernel runs."""

_ACTIVE: ContextVar[LaunchCounter | None] = ContextVar("sparsebalance_launch_counter", default=None)
T = TypeVar("T")


class LaunchCounter(TorchDispatchMode):
    """Counts a region's launches, host reads and written elements (see the module docstring)."""

    def __init__(self, trace: bool = False, run_kernels: bool = True) -> None:
        super().__init__()
        self.trace = trace
        self.run_kernels = run_kernels
        """False: :func:`kernel` returns an uninitialised output instead of running the kernel
        (counting at sizes the machine cannot compute, e.g. a GPU's on a CPU)."""
        """Keep where each host read came from (:attr:`read_sites`)."""
        self.read_sites: list[str] = []
        """With ``trace``: per read, the innermost project frame that made it (file:line)."""
        self.op_sites: list[str] = []
        """With ``trace``: the same for every launching op."""
        self.ops: list[str] = []
        """Every launching op, in order (its aten name)."""
        self.reads: list[str] = []
        """Every host read, in order."""
        self.writes: list[tuple[str, int]] = []
        """``(op, elements)`` for every op that wrote new storage."""
        self.kernels = 0
        """Calls made through :func:`kernel` (not counted in :attr:`ops`)."""
        self.constructor_copies: list[str] = []
        """``torch.tensor`` / ``torch.as_tensor`` calls with host data and a ``device``: the
        innermost project frame of each (``file:line``)."""
        self._paused = 0
        self._in_read = 0
        self._saved: dict[str, Any] = {}
        self._constructors: dict[str, Any] = {}
        self._token = None

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def tally(self) -> dict[str, int]:
        """Launches per op name, most frequent first."""
        return dict(_Tally(self.ops).most_common())

    def __enter__(self):
        for name in HOST_METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def read(tensor, *args, _name=name, _original=original, **kwargs):
                if not self._paused and not self._in_read:
                    self._read(f"Tensor.{_name}")
                self._in_read += 1  # the op the method dispatches is the same read
                try:
                    return _original(tensor, *args, **kwargs)
                finally:
                    self._in_read -= 1

            setattr(torch.Tensor, name, read)
        for name in CONSTRUCTORS:
            original = self._constructors[name] = getattr(torch, name)

            def construct(data, *args, _original=original, **kwargs):
                out = _original(data, *args, **kwargs)
                if kwargs.get("device") is not None and not isinstance(data, torch.Tensor) and not self._paused:
                    self.ops.append("h2d_copy")
                    self.writes.append(("h2d_copy", out.numel() * out.element_size()))
                    self.constructor_copies.append(_site())
                return out

            setattr(torch, name, construct)
        self._token = _ACTIVE.set(self)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in self._constructors.items():
            setattr(torch, name, original)
        _ACTIVE.reset(self._token)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        if (
            func.overloadpacket in HOST_READS
            or (func in HOST_READ_OVERLOADS and _sized_by_values(func, args, kwargs or {}))
            or (func.overloadpacket in MASK_INDEXING and _masked(args))
        ):
            if not self._in_read:
                self._read(str(func))
            return out
        if func.is_view or func.overloadpacket in NO_LAUNCH:
            return out
        self.ops.append(str(func.overloadpacket).removeprefix("aten."))
        if self.trace:
            self.op_sites.append(_site())
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        fresh = [t for t in _tensors(out) if t.untyped_storage().data_ptr() not in inputs]
        if fresh:
            self.writes.append((str(func), sum(t.numel() for t in fresh)))
        return out

    def _read(self, what: str) -> None:
        self.reads.append(what)
        if self.trace:
            self.read_sites.append(_site())


def _site() -> str:
    """``file:line`` of the innermost frame of this project outside this module."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if "sparsebalance" in name and not name.endswith("launches.py"):
            return f"{name.rsplit('sparsebalance/', 1)[-1]}:{frame.lineno}"
    return "?"


def _sized_by_values(func, args, kwargs: dict) -> bool:
    """Whether a :data:`HOST_READ_OVERLOADS` call reads values on the host to size its output."""
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten.histc.default:
        given = {**dict(zip(("self", "bins", "min", "max"), args, strict=False)), **kwargs}
        return given.get("min", 0) == given.get("max", 0)  # no range: CUDA reads the min and max
    return True  # bincount: its length is the largest value


def _masked(args) -> bool:
    """An ``index``/``index_put`` call whose indices include a boolean (or byte) mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def copied(num_bytes: int) -> None:
    """A copy to the device was queued (:mod:`sparsebalance.transfer`): inside a counted region
    it is a launch (``h2d_copy``), whatever the device (on the CPU the copy is skipped)."""
    counter = _ACTIVE.get()
    if counter is not None and not counter._paused:
        counter.ops.append("h2d_copy")
        counter.writes.append(("h2d_copy", num_bytes))


def _tensors(tree) -> list[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def kernel(fn: Callable[..., T], *args, like: torch.Tensor, **kwargs) -> T:
    """``fn(*args, **kwargs)``: an attention kernel whose output is shaped like ``like``. Inside a
    :class:`LaunchCounter` region the call is counted once and runs uncounted (and undisturbed:
    a compiled kernel sees no mode), or not at all (``run_kernels=False``)."""
    counter = _ACTIVE.get()
    if counter is None:
        return fn(*args, **kwargs)
    counter.kernels += 1
    counter._paused += 1
    try:
        with _disable_current_modes():
            if not counter.run_kernels:
                return torch.empty_like(like)
            return fn(*args, **kwargs)
    finally:
        counter._paused -= 1
