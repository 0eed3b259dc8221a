"""One pipeline stage of a Hugging Face causal LM (``--pp P``): a contiguous run of its decoder
layers, the embedding with the first stage, the final norm, LM head and loss with the last.

Where a rank sits (:class:`PipelineLayout`): world rank ``r`` is stage ``r % P`` of data-parallel
pipeline ``r // P``, so a pipeline's stages are neighbouring ranks (one node's fast links carry the
activations). Layers are split by ``PipelineLayout.split``, the one split the planner, DST and the
simulator price (the trainer's is :func:`sparsebalance.batching.schedule.balanced_layers`: the last
stage, which holds the LM head, gets fewer layers when the head costs more than one); empty: the
even split (:func:`~sparsebalance.batching.schedule.stage_layers`).

:class:`StageModel` keeps the model's own modules and names: the layers of other stages are
replaced by parameterless ``Identity`` modules, so a stage's state dict has the whole model's keys
(``model.layers.5.mlp...``) for the parameters it holds, and stages assembled give the model's
full state dict (a pipeline checkpoint is an ordinary one). Its forward runs the same modules in
the same order as the model's own forward (embedding, rotary embedding, layers, norm), so a stage
computes what the whole model computes, bit for bit on CPU in fp32.

A model whose tied LM head is its embedding (``tie_word_embeddings``) holds that weight on both
the first and the last stage; the pipeline sums its two gradients (:mod:`.pipeline`) so both copies
take the same step.

Interleaved (``--pp-virtual V``, :mod:`sparsebalance.batching.interleaved`): the split has P V
entries (virtual stages, model order) and rank s holds virtual stages s, s + P, ..., V chunks of
non-adjacent layers (:meth:`PipelineLayout.chunks`); :meth:`StageModel.forward` runs one chunk.
The embedding runs in rank 0's first chunk, the norm, head and loss in rank P-1's last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..batching.interleaved import check_virtual, chunk_layers
from ..batching.schedule import resolve_layers, stage_layers
from ..models.head import tied_head
from ..ops.loss import linear_cross_entropy, weighted_cross_entropy
from ..precision import Precision

# Decoders whose forward is embed -> rotary -> layers -> norm with nothing else in between (no
# embedding scale, no sliding window): a stage can run it piece by piece.
PIPELINE_MODELS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class PipelineLayout:
    """Where a world rank sits in a DP x PP grid of ``dp_size`` pipelines of ``stages``."""

    stages: int
    stage: int
    dp: int
    dp_size: int
    split: tuple[int, ...] = ()
    """Decoder layers per stage (``stages`` entries summing to the model's layers; what
    ``PlanConfig.stage_layers`` holds; ``stages x virtual`` entries, per virtual stage, when
    interleaved); empty: the even split."""
    virtual: int = 1
    """Chunks of layers per rank (``--pp-virtual``); 1: one contiguous run of layers."""

    @classmethod
    def of(
        cls, rank: int, world_size: int, stages: int, split: tuple[int, ...] = (), virtual: int = 1
    ) -> PipelineLayout:
        if stages < 1 or world_size % stages:
            raise ValueError(f"--pp {stages} must divide the number of processes ({world_size})")
        check_virtual(stages, virtual)
        if split and len(split) != stages * virtual:
            raise ValueError(f"--pp {stages}: a split of {len(split)} stages {tuple(split)}")
        return cls(stages, rank % stages, rank // stages, world_size // stages, tuple(split), virtual)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank(self, dp: int, stage: int) -> int:
        """The world rank of ``stage`` of pipeline ``dp``."""
        return dp * self.stages + stage

    def layers(self, num_layers: int) -> range | list[int]:
        """The decoder layers this stage runs, in model order (``ValueError`` if :attr:`split` does
        not fit a model of ``num_layers``): a range, or with ``--pp-virtual`` its chunks' layers."""
        chunks = self.chunks(num_layers)
        return chunks[0] if len(chunks) == 1 else [i for chunk in chunks for i in chunk]

    def chunks(self, num_layers: int) -> list[range]:
        """This rank's chunks of decoder layers (one without interleaving), in model order."""
        check_virtual(self.stages, self.virtual, num_layers)
        counts = resolve_layers(num_layers, self.stages * self.virtual, self.split)
        return chunk_layers(counts, self.stages, self.stage)

    def first_chunk(self, chunk: int) -> bool:
        """Virtual stage 0 (runs the embedding)."""
        return self.first and chunk == 0

    def last_chunk(self, chunk: int) -> bool:
        """The last virtual stage (runs the norm, the LM head and the loss)."""
        return self.last and chunk == self.virtual - 1

    def peer(self, chunk: int, step: int) -> tuple[int, int]:
        """``(world rank, chunk)`` of the virtual stage ``step`` (+1 or -1) from this rank's
        ``chunk`` (rank P-1's chunk c feeds rank 0's chunk c + 1)."""
        k = chunk * self.stages + self.stage + step
        return self.rank(self.dp, k % self.stages), k // self.stages


def check_pipeline_model(config, stages: int) -> None:
    """Refuse, in one line, a model a pipeline of ``stages`` cannot split (``config``: its
    transformers config)."""
    kind = config.model_type
    if kind not in PIPELINE_MODELS:
        raise ValueError(
            f"--pp {stages}: {kind} models are not split into pipeline stages (supported: "
            f"{', '.join(PIPELINE_MODELS)}); train it with --pp 1"
        )
    stage_layers(config.num_hidden_layers, stages)  # more stages than layers: refused there


class StageModel(nn.Module):
    """This rank's stage of ``model`` (changed in place: other stages' layers are dropped)."""

    def __init__(self, model: nn.Module, layout: PipelineLayout):
        super().__init__()
        check_pipeline_model(model.config, layout.stages)
        self.model, self.layout = model, layout
        decoder = model.get_decoder()
        self.span = layout.layers(len(decoder.layers))
        self.split = tuple(resolve_layers(len(decoder.layers), layout.stages * layout.virtual, layout.split).tolist())
        """Layers per (virtual) stage of the whole pipeline (what a checkpoint records: its optimizer
        states are per stage)."""
        self.chunk_spans = layout.chunks(len(decoder.layers))
        """This rank's chunks of layers (one without ``--pp-virtual``)."""
        self.tied = tied_head(model)  # before other stages' modules are dropped
        self.hidden_dtype = decoder.norm.weight.dtype
        """The residual stream's dtype (the parameters'): what crosses between stages."""
        for i in range(len(decoder.layers)):
            if i not in self.span:
                decoder.layers[i] = nn.Identity()  # no parameters: freed, and not saved
        # the embedding, final norm and LM head of the stages that never run them: freed too
        if not (layout.first or (layout.last and self.tied)):
            decoder.embed_tokens = nn.Identity()
        if not layout.last:
            decoder.norm = nn.Identity()
            model.set_output_embeddings(nn.Identity())
        self.layers = [decoder.layers[i] for i in self.span]
        params = {id(p) for p in model.parameters()}  # this stage's only, now
        self.names = [n for n, t in model.state_dict(keep_vars=True).items() if id(t) in params]
        """This stage's entries of the model's state dict (a tied weight under both its names)."""
        self.sharded = False
        """``--parallel fsdp2``: :meth:`shard` split the parameters over the stage's DP peers."""

    @property
    def decoder(self) -> nn.Module:
        return self.model.get_decoder()

    def shard(self, mesh, precision: Precision | None = None) -> None:
        """``--parallel fsdp2``: ``fully_shard`` every decoder layer of this stage, then the stage
        (its embedding, norm and head), over ``mesh`` (this stage in every pipeline). Parameters
        stay gathered through a step's schedule (:meth:`gather`; ``reshard_after_forward`` off, as
        torchtitan does with pipelines) and reduce-scattered in its last backward, interleaved in each
        chunk's (:meth:`sync_in_next_backward`): one all-gather and one reduce-scatter per step,
        whatever the pipelines' micro-batch counts.
        Gathered in ``precision``'s compute dtype, reduced in float32
        (:func:`~.parallelize.mixed_precision`): the residual stream, what crosses between the
        stages, is then in that dtype too."""
        from torch.distributed.fsdp import fully_shard

        from .parallelize import mixed_precision

        policy = mixed_precision(precision)
        for layer in self.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(self, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        if policy.param_dtype is not None:
            self.hidden_dtype = policy.param_dtype
        self.layers = [self.decoder.layers[i] for i in self.span]
        self.sharded = True

    def gather(self) -> None:
        """FSDP2, before a step's schedule: all-gather every unit (the stage's own first), and let
        the schedule's backwards accumulate gradients gathered, with no reduce-scatter or reshard
        (:meth:`sync_in_next_backward` turns them back on)."""
        self._flags(False)
        for module in self.modules():
            if isinstance(module, FSDPModule):
                module.unshard()

    def sync_in_next_backward(self, chunk: int = 0, final: bool = True) -> None:
        """FSDP2, before chunk ``chunk``'s last backward of the step: in it, each of the chunk's
        FSDP units reduce-scatters its accumulated gradients in its post-backward, the stage's own
        unit (embedding, final norm, LM head) with the chunk holding them (:attr:`own_chunk`). The
        chunk's parameters without a gradient get zeros first, so the peers reduce the same
        tensors. ``final``: the stage's last backward of all (interleaved, chunk 0's, the last of
        the chunks' last backwards): every unit reshards in it too, the chunks reduced before it
        included (they reduce nothing more: their gradients were handed over), and FSDP waits for
        the step's reductions there. An earlier chunk's units stay gathered until then, so no
        later backward's prefetch all-gathers them again."""
        for p in self.chunk_parameters(chunk):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if final:
            self._flags(True)
            return
        units = [self.decoder.layers[i] for i in self.chunk_spans[chunk]]
        for unit in units + ([self] if chunk == self.own_chunk else []):
            unit.set_requires_gradient_sync(True, recurse=False)

    @property
    def own_chunk(self) -> int:
        """The chunk whose forward runs the parameters outside the decoder layers (the embedding on
        the first stage, the final norm and LM head, a tied one included, on the last)."""
        return self.layout.virtual - 1 if self.layout.last else 0

    def _flags(self, sync: bool) -> None:
        self.set_is_last_backward(sync)
        self.set_reshard_after_backward(sync)
        self.set_requires_gradient_sync(sync)

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """Chunk ``chunk``'s parameters in the order its forward uses them, each once: the
        embedding on the first virtual stage, its layers, the final norm and LM head on the last
        (a tied head, the embedding's weight, comes last there: its backward makes it first)."""
        decoder, layout = self.decoder, self.layout
        modules = [decoder.embed_tokens] if layout.first_chunk(chunk) else []
        modules += [decoder.layers[i] for i in self.chunk_spans[chunk]]
        if layout.last_chunk(chunk):
            modules += [decoder.norm, self.model.get_output_embeddings()]
        return list({id(p): p for m in modules for p in m.parameters()}.values())

    def parameters_owned(self) -> list[nn.Parameter]:
        """The parameters this stage holds and steps, in model order, each once (after
        :meth:`shard`, the sharded ones)."""
        return list(self.model.parameters())

    def tied_weight(self) -> nn.Parameter | None:
        """The embedding that is also the LM head, on the stages holding it (None elsewhere)."""
        if not self.tied or not (self.layout.first or self.layout.last) or self.layout.stages == 1:
            return None
        return self.decoder.embed_tokens.weight

    def state_dict_owned(self) -> dict[str, torch.Tensor]:
        """This stage's parameters under the whole model's names (detached, on the CPU); sharded
        ones gathered (collective over the stage's data-parallel peers)."""
        entries = self.model.state_dict(keep_vars=True)
        out = {}
        for n in self.names:
            t = entries[n].detach()
            out[n] = (t.full_tensor() if isinstance(t, DTensor) else t).cpu()
        return out

    def hidden_shape(self, tokens: int) -> tuple[int, int, int]:
        return (1, tokens, self.model.config.hidden_size)

    @property
    def rank_split(self) -> tuple[int, ...]:
        """Layers per rank (its chunks summed): what a rank holds, for the memory model."""
        p = self.layout.stages
        return tuple(sum(self.split[k] for k in range(s, len(self.split), p)) for s in range(p))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attention, chunk: int | None = None) -> torch.Tensor:
        """Token ids (first virtual stage) or the previous virtual stage's hidden states
        ``(1, T, H)`` through this rank's chunk ``chunk`` of layers (and the final norm on the last
        virtual stage); None: every chunk of this rank in turn (a pass that only has to reach
        every parameter, or the one chunk without interleaving)."""
        decoder, layout = self.decoder, self.layout
        first = layout.first if chunk is None else layout.first_chunk(chunk)
        last = layout.last if chunk is None else layout.last_chunk(chunk)
        spans = self.chunk_spans if chunk is None else [self.chunk_spans[chunk]]
        hidden = decoder.embed_tokens(x) if first else x
        rotary = decoder.rotary_emb(hidden, position_ids)
        for layer in (decoder.layers[i] for span in spans for i in span):
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=rotary,
                sb_attention=attention,
                use_cache=False,
            )
        return decoder.norm(hidden) if last else hidden

    def loss(self, hidden: torch.Tensor, batch, impl: str, uniform_weights: bool) -> torch.Tensor:
        """The last stage's weighted loss sum of a packed micro-batch (as :func:`.loss.packed_loss`)."""
        head = self.model.get_output_embeddings()
        labels, weights = batch.labels[0], batch.loss_weights[0]
        if impl == "plain":
            return weighted_cross_entropy(head(hidden)[0], labels, weights)
        return linear_cross_entropy(
            hidden[0], head.weight, labels, weights, head.bias, impl, None, uniform_weights=uniform_weights
        )
