"""Schema versions of the files SparseBalance writes and reads back.

Every artefact that outlives a process carries a version: run configs (``config.json``,
``launch-config.json``, a checkpoint's ``meta.json``), checkpoints, latency profiles and token
stores. A file of a version this build does not read is refused with one line that says what to
do; it is never read under another meaning. When a field changes meaning, bump the artefact's
``version`` below (and its ``fix`` if the remedy changes): that one line is the whole change, the
refusal follows. Versions this build still reads (converting them on load) stay in ``readable``.
Each bump gets a line in ``CHANGELOG.md``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schema:
    """One artefact's version and what to do with a file of another one."""

    artefact: str
    """What the file is, as the refusal names it."""
    version: int
    """The version this build writes."""
    fix: str
    """What a user does with a file of a version this build cannot read."""
    readable: tuple[int, ...] = ()
    """Older versions this build still reads (and converts); ``version`` is always readable."""
    remade: bool = False
    """Whether ``fix`` (making the file again) also answers a file of a *newer* version."""

    def check(self, found: object, where: str) -> None:
        """Raise ``ValueError`` (one line) unless ``found`` is a version this build reads."""
        if found == self.version or found in self.readable:
            return
        newer = isinstance(found, int) and found > self.version
        why = "written by a newer SparseBalance" if newer else "written by an older SparseBalance"
        raise ValueError(
            f"{where}: {self.artefact} schema version {found} ({why}); this build reads "
            f"{', '.join(map(str, sorted({self.version, *self.readable})))}: "
            + (("upgrade SparseBalance" + (f", or {self.fix}" if self.remade else "")) if newer else self.fix)
        )


CONFIG = Schema(
    "run config",
    version=2,
    fix="write the config again for this version (see CHANGELOG.md for what changed)",
    readable=(1,),
)
"""``schema_version`` key of ``config.json``, ``launch-config.json`` and a checkpoint's config;
optional in a hand-written ``--config`` file (checked when present). 2: ``dst.p`` is the paper's
coverage bound (in 1 it was the time band, now ``dst.tolerance``), budgets are top-k by default;
a version-1 config is converted to what it meant (:func:`sparsebalance.train.config.upgrade`)."""

CHECKPOINT = Schema(
    "checkpoint",
    version=3,
    fix="if you trust the folder, convert it with `python -m sparsebalance.train.convert RUN_DIR` "
    "(it loads the old pickles, which can run code), else start a new run",
    readable=(2,),
)
"""``schema_version`` of a checkpoint's ``meta.json``. 1 (no version): ``state.pt`` held numpy's
RNG state as a pickled array, loadable only with ``weights_only=False``. 2: a pipeline
checkpoint's whole model in ``model.pt`` and every stage's optimizer state in ``state.pt`` (read
as before); 3: each stage's own files (:mod:`sparsebalance.train.shards`)."""

PROFILE = Schema(
    "latency profile",
    version=3,
    fix="measure it again with `sparsebalance profile`",
    readable=(1, 2),
    remade=True,
)
"""``schema`` of a profile JSON (``sparsebalance.profile/<version>``); 1: interpolated grids;
2: tables of a fitted form; 3: ``dense_from`` (the dense-path crossover), the attention table
flat from it (a version-2 profile has no crossover and means what it meant)."""

STORE = Schema(
    "token store",
    version=1,
    fix="prepare it again with `sparsebalance prepare` (a cached store: delete it, the next run prepares it)",
    remade=True,
)
"""``version`` of a token store's ``manifest.json``."""
