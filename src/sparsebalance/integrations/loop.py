"""The plain-loop API (accelerate, hand-written PyTorch loops): one object per step.

```python
runtime = sparsebalance.attach(model)
loop = balanced_loader(runtime, dataset, PlannerConfig(global_batch=16, micro_batches=4,
                                                       capacity=4096))
for step in loop.steps(epoch=0):                 # LoopStep: this rank's micro-batches
    for i, batch in enumerate(step):             # exactly micro_batches of them, fillers included
        with (model.no_sync() if i < len(step) - 1 else nullcontext()):   # DDP: sync the last
            loss = model(**batch).loss * step.world_size   # DDP averages over ranks
            loss.backward()
    optimizer.step(); optimizer.zero_grad()
    step.finish()                                # feedback + telemetry (every rank)
```

Each micro-batch's time runs from its batch being handed out to the next request (the forward +
backward in between); the last one ends at :meth:`LoopStep.finish` (call it after the optimizer
step and the time includes it, before and it does not: either way every rank does the same).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from .attach import AttachedRuntime
from .planner import PlannerConfig
from .sampler import BalancedBatchSampler
from .setup import build_sampler


class LoopStep:
    """One step's micro-batches on this rank (iterate once), then :meth:`finish`."""

    def __init__(self, loop: BalancedLoop, batches: list) -> None:
        self.loop, self.batches = loop, batches
        self.seconds: list[float] = []
        self.telemetry: dict | None = None
        self._stamp: float | None = None

    @property
    def world_size(self) -> int:
        return self.loop.planner.world_size

    @property
    def work(self):
        """The planned step (:class:`~.planner.StepWork`: plan, hash, DST decision)."""
        return self.loop.planner.current

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict]:
        for batch in self.batches:
            self._lap()
            self._stamp = time.perf_counter()
            yield batch
        self._lap()

    def _lap(self) -> None:
        if self._stamp is not None:
            self.seconds.append(time.perf_counter() - self._stamp)
            self._stamp = None

    def finish(self) -> dict:
        """Feed the step back (latency model, density estimator) on every rank and return its
        telemetry (``sparsebalance/...`` values in :meth:`BalancedLoop.log_values`)."""
        if self.telemetry is not None:
            return self.telemetry
        self._lap()
        measured = self.seconds if len(self.seconds) == len(self.batches) else None
        self.telemetry = self.loop.planner.finish(self.loop.planner.current, measured)
        return self.telemetry


class BalancedLoop:
    """Planned steps over a data loader of :class:`BalancedBatchSampler` micro-batches."""

    def __init__(self, sampler: BalancedBatchSampler, dataset, pad_token_id: int = 0) -> None:
        self.sampler = sampler
        self.planner = sampler.planner
        self.loader = sampler.dataloader(dataset, pad_token_id)

    def steps(self, epoch: int = 0, max_steps: int | None = None) -> Iterator[LoopStep]:
        """The steps of ``epoch`` (from the position :meth:`load_state_dict` restored)."""
        self.sampler.set_epoch(epoch)
        group = self.planner.config.micro_batches
        batches, done = [], 0
        for batch in self.loader:
            batches.append(batch)
            if len(batches) == group:
                step = LoopStep(self, batches)
                yield step
                step.finish()  # no-op when the loop body called it
                batches, done = [], done + 1
                if max_steps is not None and done >= max_steps:
                    return

    def state_dict(self) -> dict:
        """Position and learned state (JSON-ready): save it with the model and optimizer."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def log_values(self, since: int = 0) -> dict:
        from ..engine import log_values

        return log_values(self.planner.history, since)


def balanced_loader(
    runtime: AttachedRuntime, dataset, config: PlannerConfig, *, profile=None, pad_token_id: int = 0, lengths=None
) -> BalancedLoop:
    """A :class:`BalancedLoop` for ``runtime``'s model (from :func:`~.attach.attach`) over the
    map-style ``dataset`` (examples with ``input_ids``). ``profile``: a latency profile JSON
    (default: the cached / measured one of this machine)."""
    sampler = build_sampler(runtime, dataset, config, profile, lengths)
    return BalancedLoop(sampler, dataset, pad_token_id)
