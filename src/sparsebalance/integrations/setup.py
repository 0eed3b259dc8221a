"""Building an integration's planner: the latency model (loaded or measured on rank 0, sent to
every rank so that all plan alike), the document lengths, the sampler and its data loader."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..engine import LatencyModel, check_global_batch, load_latency_model, profile_length, resolve_kernel
from ..models import ModelShapes
from .attach import AttachedRuntime
from .planner import PlannerConfig, StepPlanner
from .sampler import BalancedBatchSampler, dataset_lengths


def all_gather_fn():
    """``obj -> [obj of every rank]`` over the default process group (one process: ``[obj]``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return lambda obj: [obj]

    def gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return gather


def process_rank() -> tuple[int, int]:
    """(rank, world size) of the default process group, ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def latency_model(
    model: torch.nn.Module,
    config: PlannerConfig,
    profile: str | Path | None,
    lengths: np.ndarray,
    all_gather,
    device=None,
    precision: str = "auto",
) -> LatencyModel:
    """The engine's latency start-up (:func:`~sparsebalance.engine.load_latency_model`) for
    ``model`` on ``device`` (default: where its parameters are) computing in ``precision``
    (``auto``: the device's, bf16 on CUDA): the profile ``sparsebalance train`` would use for the
    same model, block size, backend, precision and budget kind."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    kernel = resolve_kernel(device, config.block_size, config.backend, precision)
    shapes = ModelShapes.from_hf_config(model.config.to_dict(), name=model.config.model_type)
    return load_latency_model(
        shapes,
        kernel,
        config.dst.budget,
        profile,
        profile_length(config.capacity, lengths, config.global_batch),
        all_gather is None or process_rank()[0] == 0,
        all_gather or (lambda o: [o]),
        flag="profile",
    )


def build_sampler(
    runtime: AttachedRuntime,
    dataset,
    config: PlannerConfig,
    profile: str | Path | None = None,
    lengths=None,
    sources=None,
    device=None,
    precision: str = "auto",
) -> BalancedBatchSampler:
    """The planner for ``runtime``'s model over ``dataset`` and its :class:`BalancedBatchSampler`
    (``runtime.planner`` is set to the planner). ``config.block_size`` None: the attached
    attention's; ``device``: where training runs (default: where the model is); ``precision``:
    what the forwards compute in (``auto``: the device's). Token ids outside the model's
    vocabulary are refused in one line naming the example: here when ``lengths`` is read from the
    dataset, else when the example is first drawn."""
    device = torch.device(device) if device is not None else next(runtime.model.parameters()).device
    if config.block_size is None:
        config = replace(config, block_size=runtime.block_size)
    if config.block_size != runtime.block_size:
        raise ValueError(
            f"the planner's block_size {config.block_size} differs from the attached attention's {runtime.block_size}"
        )
    if runtime.planner is not None:
        raise ValueError(
            "sparsebalance: this model already has a step planner (sparsebalance.hf.enable or "
            "balanced_loader was called for it): call it once per model and trainer; a second "
            "planner would leave the first one's callback without its steps"
        )
    # the embedding's rows bound the token ids; checked in the lengths' pass over the dataset,
    # and (lengths given, or every draw) by the collator
    vocab = int(runtime.model.get_input_embeddings().weight.shape[0])
    lengths = dataset_lengths(dataset, vocab) if lengths is None else np.asarray(lengths, np.int64)
    rank, world = process_rank()
    check_global_batch(config.global_batch, lengths.size, world, flag="global_batch")  # before any profiling
    gather = all_gather_fn()
    latency = latency_model(runtime.model, config, profile, lengths, gather, device, precision)
    planner = StepPlanner(lengths, config, latency, rank, world, gather, sources, device=device, precision=precision)
    runtime.planner = planner
    return BalancedBatchSampler(planner, vocab)
