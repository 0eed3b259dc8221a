"""Document-length distributions for the simulator: built-in shapes and user files.

Built-ins (``--dist``), all clipped to ``[min_len, max_len]`` (defaults 128 and 32,768, the
Qwen2.5 context):

- ``heavy``: a long-context training mix, many short documents and a few very long ones. Lengths
  are log-uniform in three bands: 60 % in [128, 2K), 30 % in [2K, 8K), 10 % in [8K, max_len].
  Mean about 3.5K tokens at max_len 32K; the longest 10 % of documents hold about 50 % of the
  tokens and 83 % of the L^2 (dense attention) work. **An assumption**: the bands mimic the shape of
  long-context SFT mixes (LongAlign-style: most instructions short, a long tail of book / code /
  paper documents); they are not fitted to a particular dataset.
- ``longtail``: ``heavy`` with a book-length tail, for context parallelism: 60 % in [128, 2K),
  28 % in [2K, 8K), 10 % in [8K, 32K), 2 % in [32K, max_len] (log-uniform). Meant for a
  ``--max-len`` far above the capacity (e.g. 262,144 with ``--capacity 32768``): the tail is what
  ``sab-cp`` splits over several ranks. The same kind of assumption as ``heavy``.
- ``uniform``: uniform on ``[min_len, max_len]``.
- ``bimodal``: 80 % around 1K (log-normal, sigma 0.3) and 20 % around max_len / 2 (sigma 0.2): chat
  turns mixed with long documents.

A file (``--lengths FILE``) is read with :func:`sparsebalance.data.read_lengths`: one length per
line, or JSON with a ``lengths`` list (optionally ``densities`` of the same size, measured at the
default budget). Steps resample its entries with replacement (lengths and their densities stay
paired). Everything is drawn from a ``numpy.random.Generator``: deterministic under a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import flags
from ..data import read_lengths
from ..sizes import check_document_length

BUILTIN = ("heavy", "uniform", "bimodal", "longtail")

# (share of documents, low, high) bands of the heavy mix; log-uniform inside a band.
HEAVY_BANDS = ((0.6, 128, 2048), (0.3, 2048, 8192), (0.1, 8192, None))
LONGTAIL_BANDS = ((0.6, 128, 2048), (0.28, 2048, 8192), (0.1, 8192, 32768), (0.02, 32768, None))


@dataclass(frozen=True)
class LengthDistribution:
    """Where a step's document lengths come from (validated on construction)."""

    name: str = "heavy"
    """[--dist] ``heavy``, ``uniform``, ``bimodal`` or ``longtail`` (``BUILTIN``), or
    ``file`` when ``lengths`` is given."""
    min_len: int = 128
    """[--min-len] shortest document of the built-in shapes (tokens, >= 1)."""
    max_len: int = 32768
    """[--max-len] longest document of the built-in shapes (tokens, >= min_len)."""
    lengths: tuple[int, ...] | None = None
    """[--lengths] an empirical pool to resample (from a file)."""
    densities: tuple[float, ...] | None = None
    """Measured densities at gamma0 paired with ``lengths`` (from the same file), or None."""

    def __post_init__(self) -> None:
        flags.check_fields(self)  # types first (the Python API): one line naming the field
        if self.lengths is not None:
            if len(self.lengths) == 0:
                raise ValueError("--lengths: the file holds no lengths: nothing to simulate")
            if min(self.lengths) <= 0:
                raise ValueError("--lengths: lengths must be integers > 0")
            if self.densities is not None and len(self.densities) != len(self.lengths):
                raise ValueError("--lengths: densities and lengths differ in number")
            return
        if self.name not in BUILTIN:
            raise ValueError(f"--dist must be one of {', '.join(BUILTIN)}, got {self.name!r}")
        if self.min_len < 1:
            raise ValueError(f"--min-len must be >= 1, got {self.min_len}")
        if self.max_len < self.min_len:
            raise ValueError(f"--max-len ({self.max_len}) must be >= --min-len ({self.min_len})")
        check_document_length("--max-len", self.max_len)

    @classmethod
    def from_file(cls, path: str) -> LengthDistribution:
        """The empirical distribution of a lengths file (see the module docstring)."""
        samples, dens = read_lengths(path)
        lengths = tuple(s.num_tokens for s in samples)
        densities = None if dens is None else tuple(float(d) for d in dens)
        if densities is not None and not all(0.0 < d <= 1.0 for d in densities):
            raise ValueError(f"--lengths {path}: densities must lie in (0, 1]")
        return cls(name="file", lengths=lengths, densities=densities)

    @property
    def longest(self) -> int:
        """The longest length this distribution can produce."""
        return max(self.lengths) if self.lengths is not None else self.max_len

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``n`` lengths (int64 ``(n,)``) and, for a file with densities, their densities."""
        if self.lengths is not None:
            idx = rng.integers(0, len(self.lengths), size=n)
            dens = None if self.densities is None else np.asarray(self.densities)[idx]
            return np.asarray(self.lengths, dtype=np.int64)[idx], dens
        lo, hi = float(self.min_len), float(self.max_len)
        if self.name == "uniform":
            x = rng.uniform(lo, hi + 1.0, size=n)
        elif self.name == "bimodal":
            long = rng.random(n) < 0.2
            centre = np.where(long, max(hi / 2, lo), min(1024.0, hi))
            sigma = np.where(long, 0.2, 0.3)
            x = centre * np.exp(sigma * rng.standard_normal(n))
        else:
            bands = LONGTAIL_BANDS if self.name == "longtail" else HEAVY_BANDS
            band = rng.choice(len(bands), size=n, p=[b[0] for b in bands])
            low = np.array([b[1] for b in bands], dtype=np.float64)[band]
            high = np.array([b[2] or hi for b in bands], dtype=np.float64)[band]
            low, high = np.clip(low, lo, hi), np.clip(high, lo, hi)
            x = np.exp(rng.uniform(np.log(low), np.log(np.maximum(high, low))))
        return np.clip(np.floor(x), lo, hi).astype(np.int64), None

    def describe(self) -> str:
        if self.lengths is not None:
            extra = " with measured densities" if self.densities is not None else ""
            return f"file ({len(self.lengths)} lengths{extra}, resampled)"
        return f"{self.name} [{self.min_len}, {self.max_len}]"
