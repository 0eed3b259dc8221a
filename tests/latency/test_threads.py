"""The CPU thread count is part of a profile's identity: `profile` measures with the threads a
training rank runs with, the trainer's cache never reuses a profile made for another count."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.cli import main
from sparsebalance.latency import default_latency_model, fingerprint, measure
from sparsebalance.models import load_shapes
from sparsebalance.timing import torch_threads
from sparsebalance.train.launch import CPU_NPROC, rank_threads

CPU = torch.device("cpu")


def test_rank_threads_follow_torchrun():
    assert rank_threads(2, {}) == 1  # torchrun sets OMP_NUM_THREADS=1 for > 1 process
    assert rank_threads(CPU_NPROC, {}) == 1
    assert rank_threads(1, {}) == torch.get_num_threads()  # one process: torch's default
    assert rank_threads(4, {"OMP_NUM_THREADS": "3"}) == 3  # the user's choice wins
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        rank_threads(2, {"OMP_NUM_THREADS": "zero"})


def test_torch_threads_sets_and_restores():
    before = torch.get_num_threads()
    with torch_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"), torch_threads(0):
        pass


def _fake_measure(seen: list[int]):
    """A profile 'measured' instantly, recording the threads in force while measuring."""
    from tests.latency.test_form import TRUE, profile_from

    def fake(shapes, device, dtype, backend, block_size, *args, **kwargs):
        seen.append(torch.get_num_threads())
        p = profile_from(TRUE, layers=shapes.num_layers, block=block_size, max_len=512)
        p.fingerprint = fingerprint(shapes, device, dtype, backend, block_size)
        p.noise = {"cv_median": 0.05, "rounds": 3, "design_points": 10, "load_1min": 0.0}
        p.fit = {"loo_mape": 0.05}
        return p

    return fake


def test_measure_profile_runs_with_the_requested_threads(monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(measure, "_measure_profile", _fake_measure(seen))
    shapes = load_shapes("tiny")
    before = torch.get_num_threads()
    prof = measure.measure_profile(shapes, CPU, max_len=512, threads=1, block_size=64)
    assert seen == [1] and prof.fingerprint["threads"] == 1
    assert torch.get_num_threads() == before


def test_cache_key_holds_the_thread_count(tmp_path, monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(measure, "_measure_profile", _fake_measure(seen))
    shapes = load_shapes("tiny")
    one = default_latency_model(shapes, CPU, cache_dir=tmp_path, max_len=512, threads=1, block_size=64)
    two = default_latency_model(shapes, CPU, cache_dir=tmp_path, max_len=512, threads=2, block_size=64)
    assert seen == [1, 2]  # the 1-thread profile is not reused for 2 threads
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert one.profile.fingerprint["threads"] == 1 and two.profile.fingerprint["threads"] == 2
    default_latency_model(shapes, CPU, cache_dir=tmp_path, max_len=512, threads=1, block_size=64)
    assert seen == [1, 2]  # same threads: cached


def test_profile_cli_measures_with_the_rank_threads(tmp_path, monkeypatch, capsys):
    calls: list[dict] = []

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        calls.append(kwargs)
        raise Stop

    import sparsebalance.commands.profile as cmd

    monkeypatch.setattr(cmd, "measure_profile", capture)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = str(tmp_path / "p.json")
    with pytest.raises(Stop):
        main(["profile", "--model", "tiny", "--device", "cpu", "--out", out])
    assert calls[-1]["threads"] == 1  # what each of train's default 2 ranks runs with
    with pytest.raises(Stop):
        main(["profile", "--model", "tiny", "--device", "cpu", "--out", out, "--threads", "2"])
    assert calls[-1]["threads"] == 2
    assert main(["profile", "--model", "tiny", "--device", "cpu", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
