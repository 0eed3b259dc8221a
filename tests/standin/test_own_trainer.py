"""Issue 53, item 1: ``sparsebalance train``'s step on the stand-in device with exactly the defaults
a CUDA run resolves (block 128, flex, bf16, DST top-k bidirectional, ``--loss auto`` as on CUDA):
two emulated data-parallel ranks (one cut by DST, one raised), and a ``--pp 2`` pipeline's two
stages. No device mixing, no host read inside a micro-batch (forward and backward, every layer),
and the step's reads after its one synchronize are the documented few.

What is not here: a context-parallel unit (its ring exchanges device tensors between processes;
the stand-in device has no values to send): its per-layer reads are counted on the CPU
(``tests/parallel/test_selection_reads.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.batching import PlanConfig
from sparsebalance.data import pack
from sparsebalance.engine import ExecutionConfig, RankExecutor, StepEngine
from sparsebalance.engine.kernel import resolve_kernel
from sparsebalance.engine.parallelize import parallelize
from sparsebalance.engine.runtime import Runtime
from sparsebalance.engine.stage import PipelineLayout, StageModel
from sparsebalance.latency import LatencyModel, load_profile
from sparsebalance.models.hf import build_model
from sparsebalance.precision import Precision
from sparsebalance.tuning import DSTConfig
from sparsebalance.workload import Sample

from . import device as sd
from .runs import CAPACITY, LENGTHS, cuda_loss, documents, model_dir, model_on_device, profile_file

pytestmark = [
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning"),
    pytest.mark.filterwarnings("ignore:User provided device_type of 'cuda'"),  # CUDA's autocast, off here
    pytest.mark.filterwarnings("ignore:CUDA is not available"),
]


@pytest.fixture
def cuda_engine(monkeypatch, tmp_path):
    """(kernels record, kernel, engine factory, documents): CUDA's defaults, stand-in kernels."""
    kernels = sd.install(monkeypatch)
    kernel = resolve_kernel("cuda")  # every flag at its default
    assert (kernel.block_size, kernel.backend, kernel.precision) == (128, "flex", "bf16")
    docs = documents()
    latency = LatencyModel(load_profile(profile_file(tmp_path)))

    def engine(**plan) -> StepEngine:
        config = PlanConfig(capacity=CAPACITY, **plan)
        sample = lambda i: Sample(i, len(docs[i]), "")  # noqa: E731
        return StepEngine(config, latency, DSTConfig(), sample, kernel=kernel, world_size=1)

    return kernels, kernel, engine, docs


def test_two_emulated_ranks_step_on_the_stand_in_device(cuda_engine, tmp_path):
    kernels, kernel, make_engine, docs = cuda_engine
    engine = make_engine(world_size=2)
    assert not engine.layer_times  # CUDA: no host layer times
    step = engine.begin([Sample(i, n, "") for i, n in enumerate(LENGTHS)])
    assert {r.role for r in step.decision.ranks} >= {"cut"}  # DST cuts a rank: the coverage bound
    model = model_on_device(build_model(str(model_dir(tmp_path)), seed=0))
    par = parallelize(model, Runtime(0, 1, torch.device("cpu")), "ddp", "overlap")
    executor = RankExecutor(
        par,
        docs,
        engine,
        ExecutionConfig(kernel.block_size, loss=cuda_loss()),
        sd.DEVICE,
        precision=Precision(kernel.precision, "cuda"),
    )
    guard = sd.StandIn()
    sync = executor.clock.synchronize
    executor.clock.synchronize = lambda: setattr(guard, "phase", "step end") or sync()
    nxt = []

    def plan_ahead():  # --plan-ahead (auto on CUDA): the next step, planned before the wait
        guard.phase = "planning ahead"
        nxt.append(engine.begin([Sample(i, n, "") for i, n in reversed(list(enumerate(LENGTHS)))]))

    floors, microbatches = [], 0
    with guard:
        for rank in range(2):
            guard.phase = f"micro-batch of rank {rank}"
            work = executor.run(step, rank, ahead=plan_ahead if rank == 1 else None)
            microbatches += len(work.records[0].microbatches)
            floors += [r.floor for c in engine._step_layers(step).of(rank) for r in c.records]
    sd.check_clean(guard, kernels)
    assert len(nxt) == 1 and not guard.project_reads("planning ahead")  # host work only
    assert kernels.sparse and kernels.dense  # the long document selected, the short ones dense
    assert any(f is not None for f in floors), "no layer decided the coverage bound on the device"
    # after the synchronize: one read per micro-batch (its layers' statistics and its loss) and
    # one per rank (its layer controller's device floors): docs/gpu.md, "Every front end on a
    # stand-in device"
    end = guard.project_reads("step end")
    assert len(end) == microbatches + 2, guard.summary(end)


@pytest.mark.parametrize("zero_bubble", [False, True])
def test_a_pipeline_of_two_stages_on_the_stand_in_device(cuda_engine, tmp_path, zero_bubble):
    """``--pp 2``: each stage builds its micro-batches' attention from the shared plan (the
    pipeline's budget per micro-batch, DST's layer controller) on the device; stage 0's
    activations go to stage 1 as NCCL would send them (device tensors), the loss on the last
    stage, the gradient back. The schedule and the sends are :mod:`sparsebalance.engine.
    pipeline`'s, tested on gloo (``tests/train/test_pipeline.py``). Zero bubble
    (``--pp-schedule zb-h1``): the backwards defer the linear layers' weight GEMMs, run after
    (:mod:`sparsebalance.engine.deferred_weights`), with no host read or device mixing either."""
    from sparsebalance.engine.deferred_weights import DeferredWeights

    kernels, kernel, make_engine, docs = cuda_engine
    engine = make_engine(world_size=1, pipeline_stages=2)
    step = engine.begin([Sample(i, n, "") for i, n in enumerate(LENGTHS)])
    stages = [
        StageModel(model_on_device(build_model(str(model_dir(tmp_path)), seed=0)), PipelineLayout.of(s, 2, 2))
        for s in (0, 1)
    ]
    precision, impl = Precision(kernel.precision, "cuda"), cuda_loss()
    stores = [DeferredWeights(s) for s in stages] if zero_bubble else []
    planned = step.planned
    guard = sd.StandIn()
    with guard:
        for m, u in enumerate(planned.rank_units[0]):
            guard.phase = f"micro-batch {m}"
            unit = planned.units[u]
            batch = pack(
                [docs[i][o : o + n] for i, o, n in zip(unit.sample_ids, unit.offsets, unit.lengths, strict=True)],
                sd.DEVICE,
            )
            contexts = [engine.attention(step, 0, m, batch.cu_seqlens, batch.lengths) for _ in stages]
            with precision.autocast():
                sent = stages[0](batch.input_ids, batch.position_ids, contexts[0])
                received = sent.detach().requires_grad_()
                hidden = stages[1](received, batch.position_ids, contexts[1])
                loss = stages[1].loss(hidden, batch, impl, uniform_weights=True)
            for store in stores:
                store.begin(m)
            (loss * step.loss_scale).backward()
            sent.backward(received.grad)
            for store in stores:
                store.end()
                store.run(m)
            for s, ctx in zip(stages, contexts, strict=True):
                assert [x.layer for x in ctx.stats] == list(s.span)
    sd.check_clean(guard, kernels)
    assert kernels.sparse  # the long document selected on both stages
    assert [n for s in stages for n, p in s.named_parameters() if p.grad is None] == []


def test_loss_auto_never_resolves_to_a_loss_that_reads_back_on_cuda():
    """Liger's fused linear cross-entropy reads its target count back (``.item()``, liger-kernel
    0.8.5 ``fused_linear_cross_entropy.py:132``) in every micro-batch; ``auto`` resolves to the
    chunked loss on CUDA too (``--loss liger`` still chooses Liger, with that read)."""
    assert cuda_loss() == "chunked"
    assert cuda_loss(uniform_weights=False) == "chunked"


def test_the_stand_in_device_sees_what_cuda_refuses():
    """The guard itself: a read of a device value, an op mixing a host tensor into device work
    (meta lets ``index_select`` with a host index through), an op sized by device values."""
    x = torch.zeros(4, device=sd.DEVICE)
    guard = sd.StandIn(phase="micro-batch 0")
    with guard:
        assert x.sum().item() == 0.0  # recorded, a stand-in value handed back
        x.index_select(0, torch.tensor([0, 1]))
        with pytest.raises(RuntimeError, match="sizes its output by device values"):
            x.nonzero()
        x.cpu()
    assert [e.what for e in guard.reads] == [
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten._to_copy.default",
    ]
    assert [e.what for e in guard.mixed] == ["mixed: aten.index_select.default"]
    assert all(e.site.startswith("standin/test_own_trainer.py:") for e in guard.reads)


@pytest.mark.parametrize("lengths", [(300, 40), (5000,)])
def test_pack_moves_to_the_queries_device_once(lengths):
    """A context built on the host (a collator) runs on the device: its first layer moves the
    offsets and the index (uploaded from the host's copy: no read), the other layers reuse it."""
    from sparsebalance.engine.layers import packed_attention
    from sparsebalance.ops import Budget

    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    ctx = packed_attention(cu, lengths, Budget(top_k=2), block_size=128, backend="torch")
    host_pack = ctx.pack
    ctx.to_device(sd.DEVICE)
    assert ctx.cu_seqlens.device == sd.DEVICE and ctx.pack.device == sd.DEVICE
    assert ctx.pack.lengths == host_pack.lengths and ctx.pack is host_pack.to(sd.DEVICE)
