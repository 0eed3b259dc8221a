"""benchmarks/accuracy*.py: the paired statistics, the variants' DST settings, the per-length-bin
budget, and the whole pipeline in --quick mode (slow tier)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import accuracy_stats as stats


@pytest.mark.parametrize("t, df", [(12.706, 1), (4.303, 2), (3.182, 3), (2.776, 4), (2.228, 10)])
def test_t_p_value_and_quantile_match_the_5_percent_table(t, df):
    assert stats.t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-3)
    assert stats.t_two_sided_p(0.0, df) == pytest.approx(1.0)
    assert stats.t_quantile(0.975, df) == pytest.approx(t, rel=1e-3)


def test_sign_flip_test_reaches_one_in_32_with_five_seeds():
    assert stats.sign_flip_p([-0.1, -0.2, -0.05, -0.3, -0.1], "less") == pytest.approx(1 / 32)
    assert stats.min_p(5) == pytest.approx(1 / 32) and stats.min_p(5) < 0.05
    # tested the other way: the observed sum is the smallest, every pattern is >= it
    assert stats.sign_flip_p([-0.1, -0.2, -0.05, -0.3, -0.1], "greater") == pytest.approx(1.0)
    # one seed against: the patterns with sum <= observed are 2 of 32 (flip the small one)
    assert stats.sign_flip_p([-0.1, -0.2, 0.05, -0.3, -0.1], "less") == pytest.approx(2 / 32)
    # all ties: every pattern sums to 0
    assert stats.sign_flip_p([0.0] * 5, "less") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="alternative"):
        stats.sign_flip_p([1.0], "two-sided")


def test_sign_flip_matches_brute_force_on_random_data():
    rng = np.random.default_rng(0)
    for _ in range(20):
        d = rng.normal(size=6).round(2).tolist()
        sums = [sum(x if (m >> i) & 1 else -x for i, x in enumerate(np.abs(d))) for m in range(2**6)]
        expected = np.mean([s <= sum(d) + 1e-9 for s in sums])
        assert stats.sign_flip_p(d, "less") == pytest.approx(expected)


def test_paired_difference_interval_and_counts():
    c = stats.paired([0.5, 0.7, 0.6, 0.4, 0.5], [0.6, 0.8, 0.6, 0.5, 0.7], "less")
    assert (c["wins"], c["losses"], c["ties"]) == (0, 4, 1)
    assert c["mean"] == pytest.approx(-0.1)
    lo, hi = c["ci95"]
    half = stats.t_quantile(0.975, 4) * c["std"] / 5**0.5
    assert lo == pytest.approx(-0.1 - half) and hi == pytest.approx(-0.1 + half)
    assert c["p_perm"] == pytest.approx(2 / 32)  # the tie flips either way
    assert 0 < c["p_t"] < 0.05
    assert c["p_perm_two_sided"] == pytest.approx(4 / 32)
    up = stats.paired([1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 5, "less")  # all seeds higher
    assert up["p_perm"] == 1.0 and up["p_perm_two_sided"] == pytest.approx(2 / 32)


def test_variants_dst_settings():
    import accuracy

    args = accuracy.parse_args(["--k-base", "8", "--out", "x"])
    cfg = {n: accuracy.dst_config(n, args) for n in accuracy.VARIANTS}
    assert cfg["fixed-K"].budget_tokens == 8 * 64 and cfg["fixed-K"].mode == "off"
    assert cfg["fixed-K/2"].budget_tokens == 4 * 64 and cfg["fixed-K/2"].mode == "off"
    for name, anchor, p in (
        ("dst-mean-p0.1", "mean", 0.1),
        ("dst-mean-p0.2", "mean", 0.2),
        ("dst-min-p0.1", "min", 0.1),
        ("sab-dst-mean-p0.1", "mean", 0.1),
    ):
        c = cfg[name]
        assert (c.budget, c.mode, c.anchor, c.p, c.budget_tokens) == (
            "top-k",
            "bidirectional",
            anchor,
            p,
            8 * 64,
        )
        assert (c.tolerance, c.raise_to) == (0.0, "anchor")  # the paper's rule
    g = cfg["gamma-rule"]  # issue 18's rule exactly
    assert (g.budget, g.gamma0, g.tolerance, g.raise_to, g.p) == ("gamma", 0.9, 0.1, "step", 1.0)
    assert accuracy.VARIANTS["sab-dst-mean-p0.1"]["strategy"] == "sab"
    assert accuracy.VARIANTS["dst-mean-p0.1"]["strategy"] == "tokens"
    assert accuracy.base_budget("fixed-K/2", args).top_k == 4
    assert accuracy.base_budget("gamma-rule", args).gamma == 0.9
    assert "dense" not in args.variants and len(args.variants) == 7
    with pytest.raises(ValueError, match="--k-base"):
        accuracy.parse_args(["--k-base", "3"])
    with pytest.raises(ValueError, match="--variants"):
        accuracy.parse_args(["--variants", "fixed-K,nope"])


def test_bin_budget_follows_the_estimators_bins():
    from accuracy_eval import BinBudget, analytic_density, bin_of
    from sparsebalance.batching.budget_ema import BudgetEMAEstimator

    lengths = [255, 256, 1023, 1024, 2050]
    assert [bin_of(n) for n in lengths] == BudgetEMAEstimator.bin_of(np.array(lengths)).tolist()
    spec = BinBudget({"9": 5.6, "10": 2.4}, base=4)
    assert [spec(n).top_k for n in (600, 1023, 1024, 2047, 2048)] == [6, 6, 2, 2, 4]
    # top-k density from lengths: a short document is dense, a long one is not
    assert analytic_density(spec, [300], 64) == pytest.approx(1.0)
    assert analytic_density(spec, [2047], 64) < 0.5


@pytest.mark.slow
def test_quick_run_writes_every_variant_and_comparison(tmp_path):
    """The whole pipeline (tiny pretrain, 7 variants x 2 seeds): ~3-4 min on the 2-core CPU."""
    import accuracy

    assert accuracy.main(["--quick", "--out", str(tmp_path)]) == 0
    md = next(tmp_path.glob("*-accuracy-topk-quick-cpu.md")).read_text()
    data = json.loads(next(tmp_path.glob("*-accuracy-topk-quick-cpu.json")).read_text())
    names = data["args"]["variants"]
    assert len(names) == 7 and all(f"| {v} |" in md for v in names)
    assert "Paired by seed" in md and "39.46" in md and "one-sided sign-flip" in md
    assert next(tmp_path.glob("*-accuracy-topk-quick.png")).stat().st_size > 0
    by = {(r["variant"], r["seed"]): r for r in data["records"]}
    for rec in data["records"]:
        assert rec["unknown_tokens"] == 0  # read through the pretraining vocabulary
        assert rec["chosen_step"] in (1, 2) and set(rec["dev_mean_em"]) == {"1", "2"}
        assert rec["run_wall_s"] >= rec["train_wall_s"] > 0
        tr = rec["train"]
        assert 0 < tr["density"] <= 1 and tr["predicted_step_s"] > 0
        for ev in rec["eval"].values():
            assert set(ev["recall"]) == {"0", "1"}  # the recipe's two layers
            assert all(0 < r <= 1 + 1e-9 for r in ev["recall"].values())
            assert ev["passkey"]["count"] == 5 and ev["ppl"] > 1
    for seed in (0, 1):
        fixed, half = by["fixed-K", seed]["train"], by["fixed-K/2", seed]["train"]
        assert fixed["budget_min"] == fixed["budget_max"] == 2
        assert half["budget_min"] == half["budget_max"] == 1
        assert fixed["roles"]["cut"] == fixed["roles"]["raised"] == 0
        dst = by["dst-mean-p0.1", seed]["train"]
        assert dst["roles"]["cut"] > 0 and dst["roles"]["raised"] > 0  # DST cuts and raises
        assert dst["budget_min"] < 2 < dst["budget_max"]
        assert by["dst-mean-p0.1", seed]["final_bins"]  # the per-length-bin k it ended with
        dense = by["fixed-K", seed]["eval"]["dense"]
        assert all(v == pytest.approx(1.0) for v in dense["recall"].values())
    cmp = {(c["a"], c["b"], c["setting"]) for c in data["comparisons"]}
    assert ("fixed-K/2", "fixed-K", "base") in cmp and ("dst-min-p0.1", "dst-mean-p0.1", "final") in cmp


def test_records_resume_only_with_the_same_arguments(tmp_path):
    import accuracy

    args = accuracy.parse_args(["--out", "x", "--records", str(tmp_path / "r.jsonl")])
    key = accuracy._run_key(args)
    rec = {"variant": "fixed-K", "seed": 3, "eval": {}}
    (tmp_path / "r.jsonl").write_text(json.dumps({"run_key": key, **rec}) + "\n")
    assert accuracy._load_records(args.records, key) == {("fixed-K", 3): rec}
    assert accuracy._run_key(accuracy.parse_args(["--out", "y", "--seeds", "7"])) == key
    assert accuracy._run_key(accuracy.parse_args(["--reverse"])) == key  # shares the grid
    other = accuracy._run_key(accuracy.parse_args(["--k-base", "4"]))
    with pytest.raises(SystemExit, match="other arguments"):
        accuracy._load_records(args.records, other)
    assert accuracy._load_records(tmp_path / "missing.jsonl", key) == {}


def test_records_of_other_pretrained_weights_are_refused(tmp_path):
    import accuracy

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights v1")
    (ckpt / "vocab_map.json").write_text("{}")
    first = accuracy._checkpoint_id(ckpt)
    args = accuracy.parse_args(["--records", str(tmp_path / "r.jsonl")])
    key = accuracy._run_key(args)
    rec = {"variant": "fixed-K", "seed": 0, "checkpoint": first, "eval": {}}
    old = {"variant": "fixed-K/2", "seed": 0, "eval": {}}  # written before fingerprints
    lines = [json.dumps({"run_key": key, **r}) for r in (rec, old)]
    args.records.write_text("\n".join(lines) + "\n")
    assert set(accuracy._load_records(args.records, key, first)) == {("fixed-K", 0), ("fixed-K/2", 0)}
    (ckpt / "model.safetensors").write_bytes(b"weights v2")  # retrained into the same folder
    second = accuracy._checkpoint_id(ckpt)
    assert second != first
    with pytest.raises(SystemExit, match="other pretrained weights"):
        accuracy._load_records(args.records, key, second)


def test_wall_note_says_when_the_grid_was_shared_or_resumed():
    from accuracy_report import _wall_note

    recs = [{}] * 35
    assert _wall_note({"records": recs, "wall_s": 2000.4, "runs_here": 35}) == "Wall 2000 s"
    shared = _wall_note({"records": recs, "wall_s": 2000.4, "runs_here": 5})
    assert shared.startswith("Wall 2000 s for the 5 of 35 runs") and "--records" in shared
    timed = [{"run_wall_s": 100.0}] * 35
    assert "3500 s in all" in _wall_note({"records": timed, "wall_s": 2000.4, "runs_here": 5})


def test_pretrain_init_from_continues_a_model_and_refuses_another_shape(tmp_path):
    """``init_from``: a recipe that adds steps starts from the saved weights, not a new init."""
    import dataclasses

    import torch
    from safetensors.torch import load_file

    from accuracy_pretrain import PretrainConfig, pretrain

    tiny = PretrainConfig(
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=32,
        vocab_size=768,
        stages=((128, 160, 2),),
        tokens_per_step=256,
        warmup_steps=1,
        eval_lengths=(160,),
        eval_examples=1,
        eval_every=0,
        test_examples=0,
    )
    curve = pretrain(tiny, tmp_path / "a", log=lambda *a, **k: None)
    assert curve["threads"] == torch.get_num_threads()  # the report names the threads it ran on
    more = dataclasses.replace(tiny, init_from=str(tmp_path / "a"), stages=((128, 160, 1),), seed=9, lr=0.0)
    pretrain(more, tmp_path / "b", log=lambda *a, **k: None)
    a, b = (
        load_file(tmp_path / "a" / "model.safetensors"),
        load_file(tmp_path / "b" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # lr 0: unchanged
    wider = dataclasses.replace(more, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="another model shape"):
        pretrain(wider, tmp_path / "c", log=lambda *a, **k: None)


def test_accuracy_keys_reports_both_splits(tmp_path, capsys):
    """``accuracy_keys.py``: MQAR with seen and unseen keys, and the embeddings' cosines."""
    import accuracy_keys
    from accuracy_pretrain import PretrainConfig, pretrain

    tiny = PretrainConfig(
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=32,
        vocab_size=768,
        tie_embeddings=False,
        stages=((128, 160, 1),),
        tokens_per_step=256,
        warmup_steps=1,
        eval_lengths=(160,),
        eval_examples=1,
        eval_every=0,
        test_examples=0,
    )
    pretrain(tiny, tmp_path / "m", log=lambda *a, **k: None)
    assert accuracy_keys.main([str(tmp_path / "m"), "--lengths", "160", "--examples", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"model", "cosine_train_only", "cosine_eval_only", "mqar_train_keys_160", "mqar_eval_keys_160"}
    assert -1 <= out["cosine_eval_only"] <= 1 and 0 <= out["mqar_eval_keys_160"] <= 1


def _tiny(**over):
    from accuracy_pretrain import PretrainConfig

    base = dict(
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=32,
        vocab_size=768,
        stages=((128, 160, 1),),
        tokens_per_step=256,
        warmup_steps=1,
        eval_lengths=(160,),
        eval_examples=1,
        eval_every=0,
        test_examples=0,
    )
    return PretrainConfig(**{**base, **over})


@pytest.mark.parametrize("fraction, expected", [(0.0, {None}), (1.0, {0.0, 1.0})])
def test_edge_depth_fraction_puts_needles_at_the_haystacks_ends(monkeypatch, fraction, expected):
    """``edge_depth_fraction``: that share of task documents has its needle at depth 0 or 1; with
    0 the depth stays the generator's uniform draw."""
    import accuracy_pretrain
    from sparsebalance.data.tokenizer import load_tokenizer, make_codec

    cfg = _tiny(edge_depth_fraction=fraction)
    tok = load_tokenizer()
    vmap = accuracy_pretrain.build_vocab_map(tok, cfg.tasks, cfg.vocab_size)
    encode, _, _ = make_codec(tok, vmap, cfg.vocab_size)
    batcher = accuracy_pretrain.Batcher(cfg, encode, len(vmap))
    seen, real = [], accuracy_pretrain.generate

    def spy(*args, depth=None, **kw):
        seen.append(depth)
        return real(*args, depth=depth, **kw)

    monkeypatch.setattr(accuracy_pretrain, "generate", spy)
    for _ in range(12):
        batcher.next(128, 160, 0.0)
    assert len(seen) >= 12 and set(seen) == expected
    with pytest.raises(ValueError, match="edge_depth_fraction"):
        _tiny(edge_depth_fraction=1.5)


def test_pretrain_test_row_scores_the_benchmarks_examples(tmp_path, monkeypatch):
    """The pretraining report's test row scores the examples ``accuracy.py`` scores (its depth
    grid, its test seed, its count per depth), so the two agree on the base model's dense EM."""
    import accuracy_eval
    import accuracy_pretrain
    from sparsebalance.data.tokenizer import load_tokenizer
    from sparsebalance.train.weights import load_trained_model

    calls = {"pretrain": set(), "benchmark": set()}

    def spy(who, real):
        def run(runner, task, lengths, encode, num, depths, seed=0, **kw):
            calls[who].add((task, tuple(lengths), num, tuple(depths or ()), seed))
            return real(runner, task, lengths, encode, num, depths, seed=seed, **kw)

        return run

    for who, mod in (("pretrain", accuracy_pretrain), ("benchmark", accuracy_eval)):
        monkeypatch.setattr(mod, "evaluate_task", spy(who, mod.evaluate_task))
    cfg = _tiny(test_examples=10)
    curve = accuracy_pretrain.pretrain(cfg, tmp_path / "m", log=lambda *a, **k: None)
    assert curve["test_depths"] == list(accuracy_eval.DEPTHS)
    test_calls = {c for c in calls["pretrain"] if c[4] == cfg.test_seed}
    model, vmap = load_trained_model(str(tmp_path / "m"), vocab_map=str(tmp_path / "m" / "vocab_map.json"))
    bench = accuracy_eval.scores(
        model, vmap, load_tokenizer(), accuracy_eval.DENSE, (160,), 10, accuracy_eval.TEST_SEED
    )
    assert test_calls and test_calls == calls["benchmark"]
    assert cfg.test_seed == accuracy_eval.TEST_SEED
    for task in cfg.tasks:
        assert curve["test"][task]["160"] == pytest.approx(bench[task]["by_length"]["160"])
        by_depth = curve["test_by_depth"][task]["160"]
        assert by_depth == pytest.approx(bench[task]["grid"]["160"])  # and where it fails
    md = accuracy_pretrain.write_curve_report(tmp_path / "m", str(tmp_path / "res"), "t")
    assert "Test EM by needle depth" in md.read_text() and "benchmark's examples" in md.read_text()
