"""Issue 45, the first hour: a wait of more than a few seconds is said first, in one line on
stderr: ``sparsebalance.hf.enable`` measuring a latency profile, tokenizing a large input, the
first compile of the flex kernel. Nothing slow runs: stand-ins replace the measuring, the
tokenizer's speed and the compiled kernel; what is checked is the line and when it comes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import sparsebalance.latency as latency
from sparsebalance.data import prepare as prepare_module
from sparsebalance.data.prepare import PrepareConfig, prepare
from sparsebalance.latency import fingerprint, measure
from sparsebalance.ops import Budget, block_sparse_flex, select_blocks
from tests.conftest import cu_from_lengths, make_qkv
from tests.latency.test_form import TRUE, profile_from


def test_hf_enable_says_it_measures_a_profile_before_it_waits(tmp_path, monkeypatch, capsys):
    datasets = pytest.importorskip("datasets")
    from transformers import Trainer, TrainingArguments

    import sparsebalance.hf
    from sparsebalance.models.hf import build_model

    before: list[str] = []

    def measure_profile(shapes, device, dtype, backend, block_size, max_len, budget_s, *a, **kw):
        kw["announce"](64.0)  # what its pilot would estimate, a few seconds in
        before.append(capsys.readouterr().err)
        p = profile_from(TRUE, layers=shapes.num_layers, block=block_size, max_len=max_len)
        p.fingerprint = fingerprint(shapes, device, dtype, backend, block_size, kw["threads"], kw["layout"])
        return p

    monkeypatch.setattr(measure, "measure_profile", measure_profile)
    monkeypatch.setattr(latency, "CACHE_DIR", tmp_path / "profiles")
    model = build_model("tiny")
    rng = np.random.default_rng(0)
    data = datasets.Dataset.from_dict(
        {"input_ids": [rng.integers(0, 1000, n).tolist() for n in rng.integers(16, 400, 32)]}
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        use_cpu=True,
        report_to=[],
    )
    sparsebalance.hf.enable(Trainer(model=model, args=args, train_dataset=data), capacity=1024, block_size=32)
    [err] = before  # measured once, and said before
    [line] = err.splitlines()
    assert line.startswith("sparsebalance: measuring a latency profile for qwen2 on cpu"), line
    assert "block size 32, top-k budgets, micro-batches up to 1,024 tokens: about" in line
    assert "pass profile=PATH to skip it" in line


class _Tokenizer:
    """Bytes as token ids: enough for ``prepare``."""

    name = identity = "bytes@1"
    vocab_size = 256
    eos_token_id = 0

    def encode_batch(self, texts):
        return [np.frombuffer(t.encode(), np.uint8).astype(np.int64) for t in texts]


def test_tokenizing_a_large_input_is_said_first(tmp_path, monkeypatch, capsys):
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(50)))
    # as if the input were huge: a rate that makes this one take minutes
    monkeypatch.setattr(prepare_module, "TOKENIZE_BYTES_PER_S", 100.0, raising=False)
    seen: list[str] = []
    encode = _Tokenizer.encode_batch

    def encode_batch(self, texts):
        seen.append(capsys.readouterr().err)
        return encode(self, texts)

    monkeypatch.setattr(_Tokenizer, "encode_batch", encode_batch)
    cfg = PrepareConfig([str(src)], str(tmp_path / "store"), workers=1, progress=False)
    prepare(cfg, _Tokenizer())
    [line] = seen[0].splitlines()  # before the first text is tokenized
    size = src.stat().st_size / 1e6
    assert line.startswith(
        f"sparsebalance: tokenizing {size:,.0f} MB of input (big.jsonl) into {cfg.out} with 1 thread: roughly "
    ), line
    assert capsys.readouterr().err == ""  # once


def test_a_small_input_is_tokenized_without_a_line(tmp_path, capsys):
    src = tmp_path / "small.jsonl"
    src.write_text(json.dumps({"text": "a short document"}) + "\n")
    prepare(PrepareConfig([str(src)], str(tmp_path / "store"), progress=False), _Tokenizer())
    assert capsys.readouterr().err == ""


def test_the_first_flex_compile_is_said_once_per_graph(monkeypatch, capsys):
    calls = []

    def stand_in(q, k, v, block_mask, scale, enable_gqa, kernel_options):
        calls.append(capsys.readouterr().err)
        return q + (k.sum() + v.sum()) * 0.0

    monkeypatch.setattr(block_sparse_flex, "_compiled_flex", lambda: stand_in)
    monkeypatch.setattr(block_sparse_flex, "_ANNOUNCED", set(), raising=False)  # a fresh process
    cu = cu_from_lengths((300, 200))
    q, k, v = make_qkv(500, 4, 2, 16, dtype=torch.float32, requires_grad=False, seed=6)
    layout = select_blocks(q, k, cu, Budget(top_k=2), block_size=64)
    with torch.no_grad():
        for _ in range(3):
            block_sparse_flex.flex_block_sparse_attention(q, k, v, layout, 0.25)
    [line] = calls[0].splitlines()
    assert line.startswith(
        "sparsebalance: compiling the block-sparse attention kernel (FlexAttention, float32, forward;"
    ), line
    assert calls[1:] == ["", ""]
    q.requires_grad_(True)  # training: the graph with a backward is another compile
    block_sparse_flex.flex_block_sparse_attention(q, k, v, layout, 0.25)
    assert "float32, forward and backward;" in calls[-1]
