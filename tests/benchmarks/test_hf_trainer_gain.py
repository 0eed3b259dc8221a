"""benchmarks/hf_trainer_gain.py: the length mixes, the per-device defaults, the attention timer
and the gathered summary, with a mocked device where there is no CUDA (the collectives must take
the trainer's device: NCCL gathers CUDA tensors only; one rank reports no balance); end to end on
CPU in the slow tier (2 gloo ranks, short mix; 1 process, the ChatQA2-like mix)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparsebalance.clock import Clock

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hf_trainer_gain as bench  # noqa: E402


def test_mixes_and_their_defaults_per_device():
    rng = np.random.default_rng(0)
    short, cut = bench.lengths(rng, "short", "cpu", 512, 2048)  # the first runs' mix, unchanged
    raw = np.random.default_rng(0).lognormal(np.log(256), 1.0, 512).astype(int)
    assert np.array_equal(short, np.clip(raw, 64, 2048)) and cut == int((raw > 2048).sum())
    long, cut = bench.lengths(np.random.default_rng(0), "chatqa2", "cuda", 256, 32768)
    assert long.min() >= 1024 and long.max() == 32768 and cut > 0  # the 16K..64K tail, cut
    assert int((long == 32768).sum()) >= cut
    scaled, _ = bench.lengths(np.random.default_rng(0), "chatqa2", "cpu", 256, 8192)
    assert scaled.max() <= 8192 and np.median(scaled) < 1024  # CPU: 1/8 of the paper's scale
    gpu = bench.parse(["--device", "cuda", "--mix", "chatqa2", "--batch", "1"])
    assert (gpu.max_len, gpu.capacity, gpu.block_size, gpu.liger) == (32768, 32768, 128, True)
    cpu = bench.parse(["--mix", "longalign"])
    assert (cpu.max_len, cpu.block_size, cpu.liger) == (8192, 64, False)
    assert bench.parse(["--device", "cuda"]).liger is False  # short mix: no Liger by default
    with pytest.raises(SystemExit):
        bench.parse(["--liger"])  # CPU


class FakeEvent:
    """A CUDA event stand-in: each record is one tick later; elapsed in ms (1 tick = 1 s)."""

    ticks = 0

    def record(self):
        FakeEvent.ticks += 1
        self.tick = FakeEvent.ticks

    def elapsed_time(self, end) -> float:
        return (end.tick - self.tick) * 1e3


def test_attention_timer_spans_forward_and_backward_on_device_events():
    FakeEvent.ticks = 0
    timer = bench.AttentionTimer(Clock("cuda", event_factory=FakeEvent, synchronize=lambda: None))
    module = torch.nn.Module()

    def attention(module, q, k, v, mask, **kwargs):
        return q * k + v, None

    timed = timer.wrap(attention)
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out, _ = timed(module, q, k, v, None)
    (out * 2).sum().backward()  # the product's backward runs before attention's
    ((fwd, bwd),) = timer.calls
    assert [m.event.tick for m in fwd] == [1, 2]
    assert [m.event.tick for m in bwd] == [3, 4, 5, 6]  # output's grad first, then q, k, v
    assert timer.take() == pytest.approx(1.0 + 3.0) and timer.calls == []
    module.eval()  # evaluation is not timed
    timed(module, q, k, v, None)
    assert timer.calls == []


def test_attention_timer_wraps_transformers_sdpa(monkeypatch):
    """The wrapper in a real model (tiny, CPU, SDPA): one timed call per layer, each with its
    backward marks."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from sparsebalance.models.hf import build_model

    model = build_model("tiny", "cpu", torch.float32, attn_implementation="sdpa")
    timer = bench.AttentionTimer(Clock("cpu"))
    wrapped = timer.wrap(ALL_ATTENTION_FUNCTIONS["sdpa"])
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", wrapped)
    ids = torch.randint(0, 100, (1, 40))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(timer.calls) == model.config.num_hidden_layers
    assert all(len(fwd) == 2 and len(bwd) >= 2 for fwd, bwd in timer.calls)
    assert timer.take() > 0


class FakeAccelerator:
    """A gather over ``rows`` ranks that, like NCCL, only takes tensors on the trainer's device
    (here ``meta``: CUDA's stand-in without a GPU) and returns every rank's row."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows, self.calls = rows, 0

    def gather(self, tensor):
        assert tensor.device.type == "meta", f"gathered a {tensor.device} tensor"
        assert tensor.dtype == torch.float64 and tensor.shape == (1, len(self.rows[0]))
        self.calls += 1
        return torch.tensor(self.rows, dtype=torch.float64)


def _trainer(rows, rank0=True):
    losses = [{"loss": 3.0 - 0.1 * i, "step": i + 1} for i in range(4)]
    return SimpleNamespace(
        args=SimpleNamespace(device=torch.device("meta")),
        accelerator=FakeAccelerator(rows),
        is_world_process_zero=lambda: rank0,
        state=SimpleNamespace(log_history=losses),
    )


ARGS = SimpleNamespace(warmup=1, variant="baseline")
CLOCK = SimpleNamespace(steps=[9.0, 1.0, 1.0, 2.0], attention=[5.0, 0.5, 0.5, 1.0], compute=[8.0, 0.8, 0.9, 1.5])


def test_summary_gathers_on_the_trainers_device_and_balances_two_ranks():
    # per rank: peak bytes, tokens, attention s and wall s of the timed steps, compute per step
    rows = [[4e9, 1000, 2.0, 4.0, 0.8, 0.9, 1.5], [6e9, 3000, 1.0, 4.0, 1.0, 0.6, 1.0]]
    trainer = _trainer(rows)
    out = bench.summarize(ARGS, trainer, CLOCK, seen=1000, peak=4_000_000_000, history=None)
    assert trainer.accelerator.calls == 1  # one collective
    assert out["tokens"] == 4000 and out["peak_bytes_max_rank"] == 6_000_000_000
    assert out["step_s"] == pytest.approx(4.0 / 3)
    assert out["tokens_per_s"] == pytest.approx(4000 * 3 / 4 / 4.0)
    assert out["attention_share"] == pytest.approx((2.0 / 4 + 1.0 / 4) / 2)
    per_step = np.array([[0.8, 0.9, 1.5], [1.0, 0.6, 1.0]])
    want = float(np.mean(per_step.mean(0) / per_step.max(0)))
    assert out["balance"] == pytest.approx(want) and out["loss_last"] == pytest.approx(2.7)
    # SparseBalance's balance is its own measured one; other ranks write nothing
    hist = [{"efficiency": 0.5}, {"efficiency": 0.9}, {"efficiency": 0.8}, {"efficiency": 1.0}]
    sb = bench.summarize(
        SimpleNamespace(warmup=1, variant="sparsebalance"), _trainer([r[:4] for r in rows]), CLOCK, 1000, 4, hist
    )
    assert sb["balance"] == pytest.approx(0.9)
    assert bench.summarize(ARGS, _trainer(rows, rank0=False), CLOCK, 1000, 4, None) is None


@pytest.mark.parametrize("history", [None, [{"efficiency": 1.0}] * 4], ids=["baseline", "sb"])
def test_one_rank_reports_no_balance(history):
    """One process: the baseline has no DDP (no compute stamps) and nothing is balanced."""
    clock = SimpleNamespace(steps=CLOCK.steps, attention=CLOCK.attention, compute=[])
    out = bench.summarize(ARGS, _trainer([[4e9, 1000, 2.0, 4.0]]), clock, 1000, 4, history)
    assert out["balance"] is None and out["tokens"] == 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, *flags: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "hf_trainer_gain.py"),
        "--steps",
        "3",
        "--warmup",
        "1",
        "--documents",
        "48",
        "--accum",
        "2",
        "--port",
        str(_free_port()),
        "--results",
        str(tmp_path),
        *flags,
    ]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, timeout=600)
    return json.loads(next(tmp_path.glob("*-hf-trainer-gain-*-cpu.json")).read_text())


@pytest.mark.slow  # ~1-2 min: two 2-rank torchrun jobs
def test_two_gloo_ranks_short_mix(tmp_path):
    """Both variants write their row (the baseline's DDP comm hook once broke on a changed
    constructor, unseen by any test)."""
    data = _run(tmp_path, "--max-len", "512")
    assert set(data["rows"]) == {"baseline", "sparsebalance"} and data["mix"] == "short"
    for row in data["rows"].values():
        assert row["steps"] == 3 and row["tokens_per_s"] > 0 and 0 < row["balance"] <= 1
        assert 0 < row["attention_share"] < 1 and len(row["losses"]) == 3


@pytest.mark.slow  # ~1 min: two 1-process torchrun jobs
def test_one_process_long_mix(tmp_path):
    data = _run(tmp_path, "--nproc", "1", "--mix", "chatqa2", "--max-len", "1024", "--batch", "1")
    assert data["mix"] == "chatqa2" and data["truncated"] > 0
    for row in data["rows"].values():
        assert row["balance"] is None and row["steps"] == 3 and row["tokens_per_s"] > 0
        assert 0 < row["attention_share"] < 1
