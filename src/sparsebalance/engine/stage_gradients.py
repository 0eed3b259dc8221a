"""A pipeline stage's gradient reduction under ``--parallel ddp`` (issue 54, item 3): what is left
after the stage's last backward is kept small.

- Every parameter but the first stage's embedding is averaged over the stage's data-parallel peers
  while the last backward runs (:class:`~.parallelize.OverlappedAllReduce`); interleaved
  (``--pp-virtual``), each chunk's from its own last backward on, the later chunks' first (their
  last backwards come earlier), so the other chunks' backwards hide them too.
- The first stage's embedding gradient is the last one its backward makes, so it cannot overlap
  anything; but it is zero outside the rows of the tokens embedded this step, and every rank knows
  those tokens from the shared plan. So only those rows are averaged (``rows``: the token ids of
  every pipeline's micro-batches, the same on every rank): the same sums as a dense all-reduce,
  row for row, for a fraction of the bytes.
- A tied embedding (``tie_word_embeddings``: the first stage's embedding is the last stage's LM
  head) takes the sum of both copies' averages. The last stage finishes its schedule before the
  first (1F1B), sends its head's average then, and the first stage has posted the receive before
  its last backward, so the dense transfer overlaps that backward; the first stage adds it and
  sends back its embedding rows (the only part the head's copy lacks). Both copies then hold
  ``mean(embedding) + mean(head)``: the same floating-point sum on both ends.

Without peers and untied there is nothing to reduce.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .parallelize import OverlappedAllReduce
from .stage import StageModel


class StageGradients:
    """See the module docstring. ``groups``: the pipeline's
    :class:`~.pipeline.PipelineGroups` (``data`` for the peers, ``tied`` for the two ends)."""

    def __init__(self, stage: StageModel, groups) -> None:
        self.stage, self.groups = stage, groups
        layout = stage.layout
        self.peers = layout.dp_size if groups.data is not None else 1
        self.embedding = stage.decoder.embed_tokens.weight if layout.first else None
        self.tied = stage.tied_weight() if groups.tied is not None else None
        # in forward order, chunk after chunk: OverlappedAllReduce buckets them backwards, so the
        # first buckets are the first gradients made (a tied head's, on the last stage, among them:
        # in model order it is the embedding, and came last)
        ordered = {id(p): p for c in range(layout.virtual) for p in stage.chunk_parameters(c)}
        params = [p for p in ordered.values() if p is not self.embedding]
        self.buckets = OverlappedAllReduce(params, groups.data, self.peers) if self.peers > 1 else None
        self._head: tuple[object, torch.Tensor] | None = None

    @property
    def needed(self) -> bool:
        """Whether this stage reduces anything (peers, or a tied embedding's end)."""
        return self.peers > 1 or self.tied is not None

    def needs_rows(self) -> bool:
        """Whether :meth:`finish` takes the step's embedded token ids."""
        return (self.embedding is not None and self.peers > 1) or self.tied is not None

    def arm(self, chunk: int | None = None) -> None:
        """Before the stage's last backward of the step (``chunk``: before that chunk's last
        backward, interleaved 1F1B: its parameters' buckets reduce from then on; the stage's last
        backward of all is its first chunk's)."""
        if self.buckets is not None:
            self.buckets.arm(None if chunk is None else self.stage.chunk_parameters(chunk))
        if self.tied is not None and self.stage.layout.first and not chunk and self._head is None:
            self._receive_head()

    def ready(self, param: torch.nn.Parameter) -> None:
        """A gradient made outside autograd is final (zero bubble's last W,
        :mod:`.deferred_weights`): its bucket may reduce, as a hook would have said."""
        if self.buckets is not None:
            self.buckets.ready(param)

    def _receive_head(self) -> None:
        layout = self.stage.layout
        buf = torch.empty_like(self.tied)
        work = dist.irecv(buf, layout.rank(layout.dp, layout.stages - 1), group=self.groups.tied)
        self._head = (work, buf)

    def finish(self, rows: torch.Tensor | None) -> None:
        """After the schedule: every gradient its peers' mean (and a tied embedding's two copies'
        sum). ``rows``: the sorted token ids embedded this step by any pipeline (int64, on the
        stage's device; :func:`embedded_rows`); None when :meth:`needs_rows` is False."""
        if self.buckets is not None:
            self.buckets.finish()
        layout = self.stage.layout
        if self.embedding is not None:
            grad = _grad(self.embedding)
            if self.peers > 1 or self.tied is not None:
                part = grad.index_select(0, rows)
                if self.peers > 1:  # the other rows are zero on every peer: their mean is zero
                    dist.all_reduce(part, group=self.groups.data)
                    part /= self.peers
                    grad.index_copy_(0, rows, part)
                if self.tied is not None:
                    if self._head is None:  # no backward ran here this step
                        self._receive_head()
                    work, head = self._head
                    work.wait()
                    grad += head
                    dist.send(part, layout.rank(layout.dp, layout.stages - 1), group=self.groups.tied)
                    self._head = None
        elif self.tied is not None:  # the last stage's copy: send its mean, add the embedding's rows
            grad = _grad(self.tied)
            first = layout.rank(layout.dp, 0)
            dist.send(grad, first, group=self.groups.tied)
            part = torch.empty((len(rows), grad.shape[1]), dtype=grad.dtype, device=grad.device)
            dist.recv(part, first, group=self.groups.tied)
            grad.index_add_(0, rows, part)


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:  # a pipeline without micro-batches this step
        p.grad = torch.zeros_like(p)
    return p.grad


def embedded_rows(units, docs, vocab: int, device: torch.device) -> torch.Tensor:
    """The sorted token ids of every unit's documents (``units``: the step's plan units, every
    pipeline's; ``docs``: the corpus' token arrays), int64 on ``device``."""
    seen = np.zeros(vocab, dtype=bool)
    for unit in units:
        for i, o, n in zip(unit.sample_ids, unit.offsets, unit.lengths, strict=True):
            seen[docs[i][o : o + n]] = True
    return torch.from_numpy(np.flatnonzero(seen)).to(device)
