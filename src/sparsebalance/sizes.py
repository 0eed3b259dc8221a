"""What this machine can represent, checked before anything large is allocated.

- Token offsets are int32 (``cu_seqlens``, the flash-attn varlen convention), so one document
  holds at most :data:`INT32_MAX` tokens.
- A plan, or a simulated step, needs memory in proportion to its items (documents or split
  chunks), ranks and micro-batch slots (the ``(R, M)`` load tables); the estimate below is
  compared with the memory the operating system reports available, and a request that cannot
  fit is refused with one line naming the flags, instead of a ``MemoryError`` after minutes.
"""

from __future__ import annotations

import os

INT32_MAX = 2**31 - 1
"""The longest document (tokens): offsets into a packed buffer are int32."""

# Peak planner memory measured with tracemalloc (plan_batch, sab and sequential): ~640 B per item,
# ~400 B per rank, ~21 B per (rank, micro-batch) slot; the constants leave a 1.5x margin.
PLAN_BYTES_PER_ITEM = 1024
"""Planner memory per item (ids, lengths, densities, costs, rank lists)."""
PLAN_BYTES_PER_RANK = 512
"""Planner memory per rank (its item list, loads, times)."""
PLAN_BYTES_PER_SLOT = 32
"""Planner memory per (rank, micro-batch) slot: the float64 load tables."""
SIM_BYTES_PER_DOCUMENT = 64
"""Simulator memory per drawn document (length, density and the temporaries that draw them)."""
LAYOUT_BYTES_PER_PAIR = 96
"""``ring-balance``'s synthetic layouts: bytes per (head, query block, key block) of the dense
priority tensors they are drawn from (measured peak ~51 B at 1,024 blocks x 4 heads, RSS
high-water mark; ~2x margin)."""
_ALWAYS_FITS = 256 * 2**20  # below this, skip asking the operating system


def _proc_kib(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int:
    """Bytes this process may still allocate: the memory the operating system reports available
    (``MemAvailable``, else physical memory), less where an address-space limit (``ulimit -v``)
    leaves less."""
    have = _proc_kib("/proc/meminfo", "MemAvailable:")
    if have is None:
        try:
            have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            have = 2**63 - 1  # unknown: do not refuse
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            have = min(have, max(0, soft - (_proc_kib("/proc/self/status", "VmSize:") or 0)))
    except (ImportError, OSError, ValueError):
        pass
    return have


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def check_memory(flags: str, what: str, num_bytes: int) -> None:
    """``ValueError`` naming ``flags`` when ``num_bytes`` exceed the available memory."""
    if num_bytes <= _ALWAYS_FITS:
        return
    have = available_memory()
    if num_bytes > have:
        raise ValueError(
            f"{flags}: {what} would need about {_gib(num_bytes)} of memory; this machine has {_gib(have)} available"
        )


def check_device_memory(flags: str, what: str, num_bytes: float, device) -> None:
    """:func:`check_memory` against the memory of ``device`` (a ``torch.device``): a GPU's free
    memory on CUDA, the host's available memory otherwise."""
    if str(device).split(":")[0] != "cuda":  # a torch.device or its name
        check_memory(flags, what, int(num_bytes))
        return
    import torch

    free = torch.cuda.mem_get_info(device)[0]
    if num_bytes > free:
        raise ValueError(
            f"{flags}: {what} would need about {_gib(num_bytes)} of GPU memory; {device} has {_gib(free)} free"
        )


def check_document_length(flag: str, length: int) -> None:
    """``ValueError`` naming ``flag`` for a document longer than int32 offsets can address."""
    if length > INT32_MAX:
        raise ValueError(
            f"{flag}: a document of {length:,} tokens exceeds {INT32_MAX:,}, the most int32 "
            "token offsets (cu_seqlens) can address"
        )


def plan_bytes(num_items: int, world_size: int, micro_batches: int | None) -> int:
    """Estimated planner memory for ``num_items`` items over ``world_size`` ranks with
    ``micro_batches`` per rank (None: capacity-bound, at most one slot per item)."""
    slots = world_size * (micro_batches if micro_batches is not None else 1) + num_items
    return PLAN_BYTES_PER_ITEM * num_items + PLAN_BYTES_PER_RANK * world_size + PLAN_BYTES_PER_SLOT * slots
