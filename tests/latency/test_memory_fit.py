"""Measured memory coefficients: the fit recovers known coefficients, the record is versioned and
matched by fingerprint, and real probes (slow / gpu tiers) fit their own peaks."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from sparsebalance.cli import main
from sparsebalance.latency import fingerprint
from sparsebalance.latency import memory_fit as mf
from sparsebalance.latency.memory import GIB, MemoryConfig, MemoryModel, cpu_coefficients, device_coefficients
from sparsebalance.latency.memory_bound import auto_capacity
from sparsebalance.latency.memory_fit import (
    MemoryCalibration,
    MemoryProbe,
    find_calibration,
    fit_memory,
    memory_fingerprint,
    save_calibration,
)
from sparsebalance.models import load_shapes

SHAPES = load_shapes("tiny")
FP = memory_fingerprint(fingerprint(SHAPES, torch.device("cpu"), "fp32", "torch", 64), True)


def synthetic_probes(act_bytes, overhead, configs, noise=0.0, seed=0):
    """Probes whose peaks are exactly the memory model's at ``act_bytes`` + ``overhead`` (+ a
    relative noise), each with its own base."""
    rng = np.random.default_rng(seed)
    true = MemoryModel(SHAPES, replace(cpu_coefficients(0.0), act_bytes=act_bytes))
    out = []
    for i, (tokens, ckpt) in enumerate(configs):
        base = 350e6 + 1e6 * i
        peak = base + overhead + true.peak_bytes(tokens, MemoryConfig(ckpt, block_size=64))
        out.append(MemoryProbe(tokens, ckpt, "chunked", base, peak * (1 + noise * rng.normal())))
    return out


@pytest.mark.parametrize("act_bytes,overhead", [(3.1, 77e6), (7.4, -220e6), (2.5, 0.0)])
def test_fit_recovers_known_coefficients(act_bytes, overhead):
    probes = synthetic_probes(act_bytes, overhead, [(1024, "off"), (2048, "off"), (4096, "full")])
    cal = fit_memory(SHAPES, cpu_coefficients(0.0), probes, FP, block_size=64)
    assert cal.act_bytes == pytest.approx(act_bytes, rel=1e-4)
    assert cal.overhead_bytes == pytest.approx(overhead, abs=0.05e6)
    assert cal.max_error < 1e-5
    assert not cal.at_range_end
    if act_bytes != 4.0:  # the analytic coefficients (4 bytes, no overhead) are off
        assert max(abs(e) for e in cal.analytic_errors) > 0.01


def test_fit_with_noisy_probes_reports_its_error():
    probes = synthetic_probes(5.0, 50e6, [(512, "off"), (1024, "off"), (2048, "off"), (4096, "off")], noise=0.01)
    cal = fit_memory(SHAPES, cpu_coefficients(0.0), probes, FP, block_size=64)
    assert cal.act_bytes == pytest.approx(5.0, rel=0.15)
    assert 0 < cal.max_error < 0.05


def test_fit_needs_two_token_counts():
    probes = synthetic_probes(4.0, 0.0, [(1024, "off"), (1024, "full")])
    with pytest.raises(ValueError, match="2 different token counts"):
        fit_memory(SHAPES, cpu_coefficients(0.0), probes, FP, block_size=64)


def test_calibrated_coefficients_set_the_capacity():
    probes = synthetic_probes(8.0, 100e6, [(1024, "off"), (4096, "off")])
    cal = fit_memory(SHAPES, cpu_coefficients(0.0), probes, FP, block_size=64)
    base = 400e6
    analytic = cpu_coefficients(base)
    measured = cal.coefficients(analytic)
    assert measured.act_bytes == pytest.approx(8.0, rel=1e-4)
    assert measured.base_bytes == pytest.approx(base + 100e6, abs=0.05e6)
    assert "measured" in measured.name
    cfg = MemoryConfig(block_size=64)
    budget = 2 * GIB
    cap_measured = auto_capacity(MemoryModel(SHAPES, measured), budget, cfg)
    cap_analytic = auto_capacity(MemoryModel(SHAPES, analytic), budget, cfg)
    assert cap_measured < cap_analytic  # twice the bytes per element: a smaller micro-batch
    # the capacity is the largest that fits under the measured coefficients
    assert MemoryModel(SHAPES, measured).peak_bytes(cap_measured, cfg) <= budget
    assert MemoryModel(SHAPES, measured).peak_bytes(cap_measured + 64, cfg) > budget


def test_calibration_roundtrip_versioning_and_lookup(tmp_path):
    probes = synthetic_probes(4.5, 10e6, [(1024, "off"), (2048, "off")])
    cal = fit_memory(SHAPES, cpu_coefficients(0.0), probes, FP, 64)
    data = json.loads(json.dumps(cal.to_json()))
    assert data["schema"] == mf.SCHEMA
    assert MemoryCalibration.from_json(data) == cal
    with pytest.raises(ValueError, match="schema"):
        MemoryCalibration.from_json({**data, "schema": "sparsebalance.memory-calibration/0"})
    # nothing cached: analytic, and the line says how to measure
    found, line = find_calibration(FP, None, tmp_path)
    assert found is None and "profile --memory" in line
    # from a profile's meta, then from the cache
    found, line = find_calibration(FP, {"memory": data}, tmp_path)
    assert found == cal and "--profile" in line
    path = save_calibration(cal, tmp_path)
    assert path.parent == tmp_path
    found, line = find_calibration(FP, None, tmp_path)
    assert found == cal and str(path) in line
    # a fit measured in one checkpointing mode serves runs in that mode only
    assert find_calibration(FP, {"memory": data}, tmp_path, checkpointing="off")[0] == cal
    found, line = find_calibration(FP, {"memory": data}, tmp_path, checkpointing="full")
    assert found is None and "--activation-checkpointing off" in line
    # another setup's calibration (other block size) is ignored, never misread
    other = {**FP, "block_size": 128}
    assert find_calibration(other, {"memory": data}, tmp_path)[0] is None
    # an entry of an older schema at the cache key is ignored with a note
    path.write_text(json.dumps({**data, "schema": "sparsebalance.memory-calibration/0"}))
    found, line = find_calibration(FP, None, tmp_path)
    assert found is None and "schema" in line


def test_profile_memory_tokens_validation(capsys):
    for bad in ("1024", "a,b", "1024,1024", "1,2048", "1024,999999"):
        rc = main(["profile", "--model", "tiny", "--device", "cpu", "--memory-only", "--memory-tokens", bad])
        assert rc == 2 and "--memory-tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_memory_only_measures_and_caches(tmp_path, monkeypatch, capsys):
    """Two real fresh-process probes of the tiny model (CPU peak RSS): the fit reproduces them and
    the calibration lands in the cache under the running fingerprint."""
    monkeypatch.setattr(mf, "CACHE_DIR", tmp_path)
    assert (
        main(
            ["profile", "--model", "tiny", "--device", "cpu", "--memory-only", "--memory-tokens", "256,1024", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    mem = out["memory"]
    assert mem["tokens"] == [256, 1024] and mem["peak_bytes"][1] > mem["peak_bytes"][0]
    assert 0.25 < mem["act_bytes"] < 64
    assert max(abs(e) for e in mem["errors"]) < 1e-6  # two probes, two coefficients
    found, _ = find_calibration(FP, None, tmp_path)
    assert found is not None and found.act_bytes == pytest.approx(mem["act_bytes"])


@pytest.mark.gpu
def test_cuda_probes_fit_max_memory_allocated():
    from sparsebalance.ops import resolve_backend
    from sparsebalance.train.memory_probe import measure_memory

    dev = torch.device("cuda")
    backend = resolve_backend("auto", dev)
    fp = memory_fingerprint(fingerprint(SHAPES, dev, "bf16", backend, 128), True)
    cal = measure_memory("tiny", dev, fp, [512, 1024, 2048], block_size=128, backend=backend)
    assert all(p.source == "torch.cuda.max_memory_allocated" for p in cal.probes)
    assert all(p.base_bytes == 0 and p.peak_bytes > p.static_bytes > 0 for p in cal.probes)
    assert cal.probes[-1].peak_bytes > cal.probes[0].peak_bytes
    assert cal.max_error < 0.15  # three probes, two coefficients: the third checks the form
    assert device_coefficients(dev).device_bytes is not None
