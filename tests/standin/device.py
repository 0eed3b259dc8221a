"""The stand-in device for CUDA (issue 53): ``meta`` tensors, and a dispatch mode that records what
CUDA would refuse or wait for.

CPU tests with CPU tensors cannot see a tensor left on the host nor a read of a device value:
both are free there. On ``meta`` every value lives "on the device" and has none, so

- a read of a device value (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``,
  ``nonzero`` ...) is what a CUDA run waits for. :class:`StandIn` records each one with its
  site (the innermost frame outside torch: this project's, transformers', TRL's ...), the
  attention layer it ran in, and the phase the test marked (a micro-batch's forward and
  backward, a step's end), and hands back a stand-in value (zeros; True for a flag) so the step
  goes on and every read is counted; an op whose output size depends on values (``nonzero``)
  cannot go on and raises, its site named;
- an op that mixes device tensors with host tensors of one element or more (CUDA refuses it;
  meta lets some through, e.g. ``index_select`` with a host index) is recorded the same way
  (explicit copies to the device are uploads, not mixing).

The kernels have stand-ins (flex's compiled kernel has no backward off CUDA; FlashAttention
varlen is CUDA's): they check that every tensor they are given (the ``BlockMask``'s indices, the
dense call's offsets) lives on the queries' device and count their calls. Everything else is what
a CUDA run resolves: ``flex_available`` says yes for the stand-in device, bf16 is "supported".
"""

from __future__ import annotations

import inspect
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
DEVICE = torch.device("meta")
VALUE_READS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default})
"""Reads that return a host scalar: a stand-in value is returned (0, or True for a flag)."""
SIZED_BY_VALUES = frozenset(
    {
        aten.nonzero.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.repeat_interleave.Tensor,
        aten.bincount.default,
        aten.histc.default,
    }
)
"""Reads whose output shape comes from the values (no stand-in possible: recorded, then raised)."""
TRANSFERS = frozenset({aten._to_copy.default, aten.copy_.default, aten.lift_fresh.default})


@dataclass(frozen=True)
class Event:
    what: str
    """The op (or ``mixed: op``)."""
    site: str
    """``package/file.py:line`` of the innermost frame outside torch."""
    layer: int | None
    """The attention layer (its ``layer_idx``) the event happened in, if any."""
    phase: str


@dataclass
class StandIn(TorchDispatchMode):
    """Records device reads and device mixing on :data:`DEVICE` (module docstring)."""

    phase: str = "setup"
    reads: list[Event] = field(default_factory=list)
    mixed: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device == DEVICE]
        if on_device:
            if func in VALUE_READS:
                self.reads.append(self._event(str(func)))
                return True if func is not aten._local_scalar_dense.default else _stand_in_value(on_device[0])
            if func is aten._to_copy.default and torch.device(kwargs.get("device") or DEVICE) != DEVICE:
                self.reads.append(self._event(str(func)))
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            if func in SIZED_BY_VALUES:
                event = self._event(str(func))
                self.reads.append(event)
                raise RuntimeError(f"stand-in device: {func} sizes its output by device values, at {event.site}")
            host = [t for t in tensors if t.device.type == "cpu" and t.numel() > 1]
            if host and func not in TRANSFERS:
                self.mixed.append(self._event(f"mixed: {func}"))
        return func(*args, **kwargs)

    def _event(self, what: str) -> Event:
        return Event(what, _site(), _layer(), self.phase)

    def project_reads(self, phase_prefix: str = "") -> list[Event]:
        """Reads made by this project's code (``sparsebalance/``) in phases starting with
        ``phase_prefix``."""
        return [e for e in self.reads if "sparsebalance/" in e.site and e.phase.startswith(phase_prefix)]

    def summary(self, events: list[Event]) -> str:
        return ", ".join(f"{n} x {e.what} at {e.site} (layer {e.layer}, {e.phase})" for e, n in Counter(events).items())


def _stand_in_value(t: torch.Tensor):
    """What a read of ``t`` hands back: True for a flag (an all-ones mask is all ones; a
    generation loop's "finished" stops it), 0 for a number."""
    return True if t.dtype == torch.bool else 0 if not t.is_floating_point() else 0.0


def _site() -> str:
    """The innermost frame that is not torch's or this module's: ``package/path.py:line``."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if "/torch/" in name or name == __file__:
            continue
        for root in ("site-packages/", "src/", "tests/"):
            if root in name:
                name = name.rsplit(root, 1)[-1]
                break
        return f"{name}:{frame.lineno}"
    return "?"


def _layer() -> int | None:
    """``layer_idx`` of the attention module whose ``sparsebalance_attention`` call is on the
    stack, if any."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "sparsebalance_attention" and "module" in frame.f_locals:
            layer = getattr(frame.f_locals["module"], "layer_idx", None)  # a transformers module's
            return None if layer is None else int(layer)
        frame = frame.f_back
    return None


@dataclass
class Kernels:
    """The stand-in kernels' calls and the devices they were handed."""

    sparse: int = 0
    dense: int = 0
    wrong_device: list[str] = field(default_factory=list)

    def check(self, what: str, q: torch.Tensor, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device != q.device:
                self.wrong_device.append(f"{what}: a {tuple(t.shape)} tensor on {t.device}, q on {q.device}")

    def flex(self, q, k, v, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
        self.sparse += 1
        self.check("flex BlockMask", q, block_mask.as_tuple())
        return q + (k.sum() + v.sum()) * 0.0

    def varlen(self, q, k, v, cu_seqlens, lengths, scale):
        self.dense += 1
        self.check("dense varlen offsets", q, (k, v, cu_seqlens))
        assert isinstance(lengths, tuple) and all(isinstance(n, int) for n in lengths), lengths
        return q + (k.sum() + v.sum()) * 0.0


def install(monkeypatch) -> Kernels:
    """The stand-in kernels and CUDA's capability answers for :data:`DEVICE` (see the module
    docstring); returns the kernels' record."""
    from sparsebalance.ops import attention as op_module
    from sparsebalance.ops import block_sparse_flex

    kernels = Kernels()
    monkeypatch.setattr(block_sparse_flex, "_compiled_flex", lambda: kernels.flex)
    monkeypatch.setattr(block_sparse_flex, "dense_attention", kernels.varlen)
    monkeypatch.setattr(op_module, "flex_available", lambda device: device.type in ("cuda", DEVICE.type))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3 (stand-in)")
    enabled = torch.is_autocast_enabled  # torch keeps no autocast state for meta (TRL asks)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: a[:1] != (DEVICE.type,) and enabled(*a))
    return kernels


def report(guard: StandIn, kernels: Kernels) -> str:
    return (
        f"project reads: {guard.summary(guard.project_reads())}; mixed: {guard.summary(guard.mixed)}; "
        f"kernels: {kernels.sparse} sparse, {kernels.dense} dense, wrong device: {kernels.wrong_device}"
    )


def check_clean(guard: StandIn, kernels: Kernels, phase_prefix: str = "micro-batch") -> None:
    """No device mixing anywhere, no read by this project's code in the marked phases, every
    kernel handed tensors on the queries' device."""
    assert not guard.mixed, f"device mixing: {guard.summary(guard.mixed)}"
    reads = guard.project_reads(phase_prefix)
    by_layer = Counter(e.layer for e in reads)
    assert not reads, f"host reads per layer {dict(by_layer)}: {guard.summary(reads)}"
    assert not kernels.wrong_device, kernels.wrong_device
    print(report(guard, kernels), file=sys.stderr)
