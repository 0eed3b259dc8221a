"""The balanced batch sampler and packing collator for map-style datasets.

``BalancedBatchSampler`` yields, for every step, exactly ``micro_batches`` entries on every rank
(the trainer's fixed ``gradient_accumulation_steps`` lines up); each entry is a one-element list
holding a :class:`MicroBatchSlot` (epoch, step, index). :class:`PlannedDataset` turns a slot into
the planned documents (the step is planned, by :class:`~.planner.StepPlanner`, when its first
micro-batch is fetched: after the previous step's feedback), and :class:`PackedCollator` packs
them into one row::

    sampler = BalancedBatchSampler(planner)        # sampler.dataloader(dataset) builds:
    loader = DataLoader(PlannedDataset(dataset, planner), batch_sampler=sampler,
                        collate_fn=PackedCollator(planner))

A batch holds ``input_ids``, ``position_ids`` (restarting per document), ``labels`` (the
document's tokens, -100 on each document's first token and on masked prompt tokens: the
convention of ``DataCollatorWithFlattening``), ``shift_labels`` (the next-token targets, -100 at
each document's end: what HF's causal-LM loss and the Trainer's token count use as given),
``cu_seq_lens_q/k`` and ``max_length_q/k``, ``num_items_in_batch`` (target tokens of the whole
global batch: HF's loss normaliser) and ``sb_attention`` (the micro-batch's ticket). The loss the
model returns is the global token mean's share of this micro-batch; with DDP averaging gradients
over R ranks, multiply it by R before ``backward`` (the HF Trainer does so with
``average_tokens_across_devices=True``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .attach import MicroBatchTicket
from .planner import StepPlanner

IGNORE = -100
MASK_KEYS = ("completion_mask", "assistant_masks")
"""Per-token masks (1 = trained) that TRL / chat templates put in examples."""


@dataclass(frozen=True)
class MicroBatchSlot:
    """Micro-batch ``index`` of step ``step`` of ``epoch`` on this rank."""

    epoch: int
    step: int
    index: int


def example_tokens(example) -> tuple[np.ndarray, np.ndarray | None]:
    """``(ids (L,), mask (L,) or None)`` of one dataset example: a dict with ``input_ids`` (and
    optionally ``completion_mask`` / ``assistant_masks``), or the token ids themselves."""
    mask = None
    if isinstance(example, dict):
        if "input_ids" not in example:
            raise ValueError(f"a dataset example needs 'input_ids' (tokenized text); got keys {sorted(example)}")
        for key in MASK_KEYS:
            if example.get(key) is not None:
                mask = np.asarray(example[key], dtype=np.int64).reshape(-1)
                break
        example = example["input_ids"]
    if isinstance(example, torch.Tensor):
        example = example.cpu().numpy()
    ids = np.asarray(example, dtype=np.int64).reshape(-1)
    if mask is not None and mask.shape != ids.shape:
        raise ValueError(f"an example's mask has {mask.size} entries for {ids.size} tokens")
    return ids, mask


def check_ids(ids: np.ndarray, vocab_size: int | None, example: int) -> None:
    """Refuse, in one line naming the example, a token id outside ``[0, vocab_size)`` (the
    embedding's rows): the model would stop with a raw ``IndexError`` at its first forward."""
    if vocab_size is None or ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab_size):
        return
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    more = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
    raise ValueError(
        f"example {example} of the dataset holds token id {int(ids[bad[0]])} at position "
        f"{int(bad[0])}{more}, outside the model's vocabulary of {vocab_size} ids "
        f"(0..{vocab_size - 1}): tokenize with the model's tokenizer, or resize its embeddings "
        "(model.resize_token_embeddings)"
    )


def _arrow_ids(dataset):
    """The ``input_ids`` column of a ``datasets.Dataset`` as a pyarrow list array, or None (any
    other dataset, or a column that is not a list of integers without nulls)."""
    try:
        import datasets
        import pyarrow as pa
    except ImportError:  # the hf extra is optional: no datasets.Dataset can have been passed
        return None
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        return None
    column = dataset.with_format("arrow")["input_ids"]  # respects select / shuffle indices
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return None
    if not pa.types.is_integer(kind.value_type) or column.null_count:
        return None
    return column


def dataset_lengths(dataset, vocab_size: int | None = None) -> np.ndarray:
    """Tokens of every example (one pass over the dataset; a ``datasets.Dataset``'s
    ``input_ids`` column at once, in Arrow). With ``vocab_size`` every token id is checked in the
    same pass (:func:`check_ids`: one line naming the first example outside the vocabulary)."""
    column = _arrow_ids(dataset)
    if column is not None:
        import pyarrow.compute as pc

        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = pc.list_flatten(column)
        span = pc.min_max(flat)  # nulls for an empty column
        low, high = span["min"].as_py(), span["max"].as_py()
        if vocab_size is not None and low is not None and (low < 0 or high >= vocab_size):
            ids = flat.to_numpy(zero_copy_only=False)
            first = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
            example = int(np.searchsorted(np.cumsum(lengths), first, side="right"))
            start = int(lengths[:example].sum())
            check_ids(ids[start : start + lengths[example]], vocab_size, example)
        return lengths
    # another dataset with an input_ids column (column_names) reads it at once; a plain
    # sequence of examples is read one by one
    names = getattr(dataset, "column_names", None)
    if names is not None and "input_ids" in names:
        rows = dataset["input_ids"]
    else:
        rows = (example_tokens(dataset[i])[0] for i in range(len(dataset)))
    lengths = []
    for i, row in enumerate(rows):
        lengths.append(len(row))
        if vocab_size is not None:
            check_ids(np.asarray(row, dtype=np.int64).reshape(-1), vocab_size, i)
    return np.array(lengths, dtype=np.int64)


def targets_of(ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Next-token targets of one document chunk ``(n,)``: ``ids[t + 1]``, -100 at its end and
    where the target token is masked."""
    out = np.full(ids.size, IGNORE, dtype=np.int64)
    out[:-1] = ids[1:]
    if mask is not None:
        out[:-1][mask[1:] == 0] = IGNORE
    return out


class BalancedBatchSampler(Sampler):
    """Yields ``[MicroBatchSlot]`` for every micro-batch of every step of an epoch on this rank:
    ``steps_per_epoch x micro_batches`` entries, the same count on every rank."""

    def __init__(self, planner: StepPlanner, vocab_size: int | None = None) -> None:
        self.planner = planner
        self.vocab_size = vocab_size
        """The model's vocabulary (embedding rows): the collator refuses ids outside it."""
        self.epoch = 0
        self.start = 0
        """First step (in the epoch) of the next iteration (:meth:`load_state_dict`)."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.planner.steps_per_epoch * self.planner.config.micro_batches

    def __iter__(self):
        start, self.start = self.start, 0
        for step in range(start, self.planner.steps_per_epoch):
            for m in range(self.planner.config.micro_batches):
                yield [MicroBatchSlot(self.epoch, step, m)]

    def state_dict(self, steps_done: int | None = None) -> dict:
        """The position (epoch, next step) with the planner's learned state: JSON-ready.
        ``steps_done``: steps finished in this epoch (default: those the planner finished)."""
        if steps_done is None:
            done = self.planner.history[-1]["step"] + 1 if self.planner.history else 0
            steps_done = done - self.epoch * self.planner.steps_per_epoch
        return {"epoch": self.epoch, "step": int(steps_done), "planner": self.planner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where :meth:`state_dict` was taken."""
        self.epoch, self.start = int(state["epoch"]), int(state["step"])
        self.planner.load_state_dict(state["planner"])

    def dataloader(self, dataset, pad_token_id: int = 0) -> PlannedDataLoader:
        """A ``DataLoader`` over ``dataset`` with this sampler and a :class:`PackedCollator`."""
        collate = PackedCollator(self.planner, pad_token_id, self.vocab_size)
        return PlannedDataLoader(PlannedDataset(dataset, self.planner), batch_sampler=self, collate_fn=collate)


class PlannedDataLoader(DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` reaches the balanced sampler (the HF Trainer calls
    the loader's)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class PlannedDataset:
    """``dataset`` indexed by :class:`MicroBatchSlot`: the slot's spec and its examples."""

    def __init__(self, dataset, planner: StepPlanner) -> None:
        self.dataset, self.planner = dataset, planner

    def __len__(self) -> int:
        return len(self.dataset)

    def _target_count(self, index: int, offset: int, length: int) -> int:
        ids, mask = example_tokens(self.dataset[index])
        chunk = None if mask is None else mask[offset : offset + length]
        return int((targets_of(ids[offset : offset + length], chunk) != IGNORE).sum())

    def __getitem__(self, slot: MicroBatchSlot):
        # the dataset's masked prompts change the global batch's target count (HF's loss
        # normaliser): the planner counts with this dataset's, not n - 1 a chunk
        work = self.planner.work(slot.epoch, slot.step, self._target_count)
        spec = work.specs[slot.index]
        examples = [self.dataset[i] for i in spec.sample_ids]
        return work, spec, examples


class PackedCollator:
    """Packs one planned micro-batch (see the module docstring); ``pad_token_id`` fills the
    two-token filler micro-batches; with ``vocab_size`` a document holding an id outside the
    vocabulary is refused in one line naming it (:func:`check_ids`)."""

    def __init__(self, planner: StepPlanner, pad_token_id: int = 0, vocab_size: int | None = None) -> None:
        self.planner, self.pad_token_id = planner, int(pad_token_id)
        self.vocab_size = vocab_size

    def __call__(self, entries):
        if len(entries) != 1 or len(entries[0]) != 3:
            raise ValueError(
                "PackedCollator packs one planned micro-batch: use it with BalancedBatchSampler "
                "and PlannedDataset (sampler.dataloader(dataset) builds the three)"
            )
        work, spec, examples = entries[0]
        if spec.filler:
            ids = np.full(2, self.pad_token_id, dtype=np.int64)
            docs, masks, lengths = [ids], [np.zeros(2, np.int64)], [2]
        else:
            docs, masks = [], []
            for ex, i, o, n in zip(examples, spec.sample_ids, spec.offsets, spec.lengths, strict=True):
                ids, mask = example_tokens(ex)
                check_ids(ids, self.vocab_size, i)
                docs.append(ids[o : o + n])
                masks.append(None if mask is None else mask[o : o + n])
            lengths = list(spec.lengths)
        ids = np.concatenate(docs)
        shift = np.concatenate([targets_of(d, m) for d, m in zip(docs, masks, strict=True)])
        if spec.filler:
            shift[:] = IGNORE
        labels = np.full_like(ids, IGNORE)
        labels[1:] = shift[:-1]  # labels[t + 1] = target of t; each document's first is -100
        pos = np.concatenate([np.arange(n) for n in lengths])
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        ticket = self._ticket(work, spec, cu, tuple(int(n) for n in lengths))
        work.tickets.append(ticket)
        as_row = lambda a: torch.as_tensor(a, dtype=torch.long)[None]  # noqa: E731
        return {
            "input_ids": as_row(ids),
            "position_ids": as_row(pos),
            "labels": as_row(labels),
            "shift_labels": as_row(shift),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(lengths),
            "max_length_k": max(lengths),
            "num_items_in_batch": torch.tensor(work.target_tokens),
            "sb_attention": ticket,
        }

    def _ticket(self, work, spec, cu: torch.Tensor, lengths: tuple[int, ...]) -> MicroBatchTicket:
        """The micro-batch's attention from the engine: the rank's step budget, DST's per-layer
        choices and, when timings are fed back, the layer times of its closed loop (as
        ``sparsebalance train``'s); a filler's exact attention."""
        planner = self.planner
        index = None if spec.filler else spec.index
        ctx = planner.engine.attention(work.tuned, planner.rank, index, cu, lengths)
        return MicroBatchTicket(ctx, spec.step, spec.index, spec, filler=spec.filler)


def predicted_balance(planner: StepPlanner, steps: Sequence[int], epoch: int = 0) -> list[float]:
    """Predicted balance (mean / max rank time) of the plans of ``steps`` (no training)."""
    return [planner.work(epoch, s).tuned.planned.plan.metrics.efficiency for s in steps]
