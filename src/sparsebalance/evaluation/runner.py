"""The model interface evaluators use (``ModelRunner``) and its Hugging Face implementation.

Evaluators never touch a model directly: they ask a runner for next-token logits at chosen
positions of whole documents, or per-token negative log-likelihoods. A runner fixes one attention
setting (dense, or sparse at one budget), so the same evaluation can be repeated under each.

:class:`HFRunner` packs the documents of a call into one sequence with ``cu_seqlens`` and runs a
model built with the ``sparsebalance`` attention implementation
(:func:`sparsebalance.models.hf.build_model`): ``gamma = 1.0`` keeps every causal block, which is
exact (dense) attention through the same op; ``gamma < 1`` is the block-sparse attention. A
``budget`` (any :class:`~sparsebalance.ops.Budget`, e.g. top-k, or a function of the document's
length: a per-length budget such as DST's final per-length-bin k) replaces ``gamma``; documents
of different budgets run in separate packs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..ops import Budget


import torch
import torch.nn.functional as F


class ModelRunner(Protocol):
    """What an evaluator needs from a model under one attention setting."""

    def logits(self, docs: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For each document ``docs[i]`` (token ids), float ``(len(positions[i]), V)`` logits:
        row ``j`` predicts token ``positions[i][j] + 1`` from ``docs[i][: positions[i][j] + 1]``.
        Documents are independent (no attention across them)."""
        ...

    def token_nll(self, docs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For each document, float64 ``(len(doc) - 1,)``: ``-log p(doc[t + 1] | doc[: t + 1])``."""
        ...


class HFRunner:
    """A ``transformers`` causal LM (``sparsebalance`` attention) as a :class:`ModelRunner`.

    Args:
        model: built with ``attn_implementation="sparsebalance"``.
        gamma: attention budget in (0, 1]; 1.0 is dense (exact) attention.
        block_size, backend: passed to the op (see ``sparsebalance.ops``).
        budget: replaces ``gamma``: a :class:`~sparsebalance.ops.Budget` for every document, or
            ``length -> Budget`` (tokens of the document, answer included) for a per-document
            budget; the documents of one call are then packed by budget (one forward each).
    """

    def __init__(
        self,
        model,
        gamma: float = 1.0,
        *,
        block_size: int,
        backend: str = "auto",
        budget: Budget | Callable[[int], Budget] | None = None,
    ):
        from ..ops import Budget

        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"--gamma must be in (0, 1], got {gamma}")
        if budget is not None and not (isinstance(budget, Budget) or callable(budget)):
            raise TypeError(f"budget must be a Budget or length -> Budget, got {budget!r}")
        self.model = model.eval()
        self.gamma = float(gamma)
        self.budget = Budget(gamma=self.gamma) if budget is None else budget
        self.block_size = block_size
        self.backend = backend
        self.device = next(model.parameters()).device
        self.densities: list[float] = []
        """Mean attention density (over layers) of every forward so far."""

    def budget_for(self, length: int) -> Budget:
        """The budget a document of ``length`` tokens runs with."""
        return self.budget if not callable(self.budget) else self.budget(length)

    def _forward_hidden(self, docs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Final hidden states ``(T, hidden)`` of the documents (concatenated in order); one
        packed forward per distinct budget among them."""
        lengths = [len(d) for d in docs]
        if not docs or min(lengths) < 1:
            raise ValueError("every document needs at least one token")
        groups: dict[Budget, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(self.budget_for(n), []).append(i)
        if len(groups) == 1:
            return self._pack_hidden(docs, next(iter(groups)))
        parts: dict[int, torch.Tensor] = {}
        for budget, idx in groups.items():
            hidden = self._pack_hidden([docs[i] for i in idx], budget)
            for i, h in zip(idx, hidden.split([lengths[i] for i in idx]), strict=True):
                parts[i] = h
        return torch.cat([parts[i] for i in range(len(docs))])

    def _pack_hidden(self, docs: Sequence[Sequence[int]], budget: Budget) -> torch.Tensor:
        from ..models.attention import PackedAttention

        lengths = [len(d) for d in docs]
        ids = torch.tensor([t for d in docs for t in d], dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        ctx = PackedAttention(
            cu_seqlens=cu.to(self.device),
            budget=budget,
            block_size=self.block_size,
            backend=self.backend,
            lengths=tuple(lengths),
        )
        with torch.no_grad():
            out = self.model.get_decoder()(
                input_ids=ids[None], position_ids=pos[None], sb_attention=ctx, use_cache=False
            )
        self.densities.append(ctx.mean_density())
        return out.last_hidden_state[0]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model.get_output_embeddings()(hidden).float()

    def logits(self, docs: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        hidden = self._forward_hidden(docs)
        out, start = [], 0
        for doc, pos in zip(docs, positions, strict=True):
            idx = torch.as_tensor(list(pos), dtype=torch.long, device=hidden.device) + start
            out.append(self._head(hidden[idx]).cpu())
            start += len(doc)
        return out

    def token_nll(self, docs: Sequence[Sequence[int]], chunk: int = 2048) -> list[torch.Tensor]:
        hidden = self._forward_hidden(docs)
        out, start = [], 0
        for doc in docs:
            target = torch.as_tensor(list(doc[1:]), dtype=torch.long, device=hidden.device)
            parts = []
            for a in range(0, len(target), chunk):  # (chunk, V) logits at a time, not (T, V)
                logits = self._head(hidden[start + a : start + min(a + chunk, len(target))])
                parts.append(F.cross_entropy(logits, target[a : a + chunk], reduction="none"))
            out.append(torch.cat(parts).double().cpu() if parts else torch.zeros(0))
            start += len(doc)
        return out

    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos_id: int | None = None):
        """Greedy decoding, new ids only. No KV cache (the packed sparse path has none): every
        step re-runs the whole prefix, so cost is ``max_new_tokens`` forwards."""
        ids = list(prompt)
        new: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(self.logits([ids], [[len(ids) - 1]])[0][0].argmax())
            if eos_id is not None and nxt == eos_id:
                break
            new.append(nxt)
            ids.append(nxt)
        return new
