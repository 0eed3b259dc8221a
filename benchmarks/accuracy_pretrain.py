"""Train a small model that solves retrieval with dense attention (issues 18 and 29, step 1).

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/accuracy_pretrain.py \\
        --config benchmarks/configs/accuracy-pretrain-2k-wide.toml \\
        --out runs/retrieval-dense-2k-wide --results benchmarks/results

The recipe (model shape, task mix, short-to-long curriculum, learning rate) lives in the TOML file
(fields of :class:`PretrainConfig`). Training documents are generated on the fly from the
synthetic tasks' train split (``sparsebalance.tasks``); each step packs documents of the current
curriculum stage's length range up to ``tokens_per_step`` tokens into one sequence (document-causal
attention through the ``sparsebalance`` op at gamma 1.0, i.e. dense). The loss is the mean
next-token loss over all tokens plus ``answer_weight`` times the mean over the answer tokens (the
only tokens a retrieval task scores; they are ~1% of a 1K-token document).

Every ``eval_every`` steps: teacher-forced exact match on ``eval_examples`` held-out *dev*
examples (eval split: keys and values never trained on; ``dev_seed``) of every task at
``eval_lengths`` (depths drawn uniformly); at the end, on ``test_examples`` *test* examples: the
examples ``benchmarks/accuracy.py`` evaluates (``test_seed``, its grid of needle depths), never
used to choose anything. Writes ``--out``: a
Hugging Face directory (``config.json`` + safetensors), ``vocab_map.json`` (tokenizer id -> model
id), ``curve.json`` (loss and exact match over steps) and ``recipe.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from accuracy_eval import DEPTHS
from sparsebalance import flags
from sparsebalance.evaluation import HFRunner
from sparsebalance.evaluation.synthetic import evaluate_task
from sparsebalance.models.attention import IMPLEMENTATION, PackedAttention, register
from sparsebalance.ops import Budget
from sparsebalance.tasks import TASKS, WORDS, generate


@dataclass
class PretrainConfig:
    """The dense retrieval recipe (TOML keys = field names)."""

    num_layers: int = 2
    """Decoder layers."""
    hidden_size: int = 128
    """Model width."""
    num_heads: int = 4
    """Query heads (head dim = hidden_size / num_heads)."""
    num_kv_heads: int = 4
    """Key/value heads (GQA when fewer than num_heads)."""
    intermediate_size: int = 384
    """MLP width."""
    vocab_size: int = 1024
    """Compact vocabulary (the synthetic tasks use ~700 tokenizer ids; the rest are unused)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head. Tied, the embeddings of tokens that
    never occur in training (the eval split's keys) still move: the head's softmax pushes every
    row down, so they drift towards one direction and become hard to tell apart, which MQAR
    needs (eight unseen keys); untied, they keep their random initialisation."""
    tasks: tuple[str, ...] = ("passkey", "niah1", "mqar")
    """Tasks of the training mix (drawn uniformly) and of the evaluation."""
    stages: tuple[tuple[float, ...], ...] = (
        (128, 512, 300),
        (512, 1024, 200),
        (1024, 2048, 100),
    )
    """Curriculum: ``(min_len, max_len, steps[, copy_fraction[, sparse_fraction]])`` per stage;
    lengths drawn uniformly in range; the optional fourth value overrides ``copy_fraction`` in
    that stage, the fifth is the share of its steps run with top-k attention (``sparse_top_k``;
    default 0: every step dense)."""
    edge_depth_fraction: float = 0.0
    """Share of task documents whose needle sits at depth 0 or 1 exactly (half each; the others
    draw it uniformly). Uniform depths rarely put the needle at the very start or end of the
    haystack, and the test grid (:data:`accuracy_eval.DEPTHS`) puts 2 of its 5 depths there."""
    task_weights: tuple[float, ...] = ()
    """Sampling weight of each of ``tasks`` in the training mix (default: uniform)."""
    sparse_top_k: tuple[int, ...] = (2, 4, 8, 16)
    """A sparse step (see ``stages``) runs top-k attention with k drawn uniformly from these
    (blocks): the model learns to retrieve through the gate at any budget DST may give it."""
    tokens_per_step: int = 4096
    """Tokens packed into one step's sequence (at least one document)."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 50
    """Linear warm-up; then cosine decay to 10% of lr over all stages."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    copy_fraction: float = 0.0
    """Share of extra "copy" documents: a random token segment (8-32 ids of the compact
    vocabulary) repeated to the document's length. Pure in-context copying is the densest signal
    for forming induction heads, which every retrieval task here needs."""
    copy_vocab: int = 0
    """Copy documents draw their ids from the first N model ids (0: the whole vocabulary)."""
    answer_weight: float = 1.0
    """Weight of the answer-token loss added to the all-token loss."""
    block_size: int = 64
    """Attention block size of the op."""
    seed: int = 0
    """Initialisation and data seed."""
    eval_lengths: tuple[int, ...] = (1024, 2048)
    """Prompt lengths of the held-out evaluation."""
    eval_examples: int = 16
    """Held-out dev examples per task and length at each curve point."""
    dev_seed: int = 5000
    """Seed of the curve's dev examples (eval split; disjoint from the test seed)."""
    test_examples: int = 100
    """Held-out test examples per task and length of the final evaluation (0: none)."""
    test_seed: int = 1000
    """Seed of the final test examples (the accuracy benchmark's evaluation seed)."""
    eval_every: int = 100
    """Evaluate every N steps (0: only at the end)."""
    max_minutes: float = 20.0
    """Stop (and evaluate) when training has run this long."""
    init_from: str = ""
    """Continue from this run's ``--out`` folder (its weights; its shape and vocabulary must be
    the recipe's) instead of a random initialisation: a recipe that adds steps to a model."""

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"tasks: unknown {unknown}; choose from {list(TASKS)}")
        if not 0.0 <= self.edge_depth_fraction <= 1.0:
            raise ValueError(f"edge_depth_fraction must be in [0, 1], got {self.edge_depth_fraction}")
        if self.dev_seed == self.test_seed:
            raise ValueError(f"dev_seed and test_seed must differ, both are {self.dev_seed}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        if self.task_weights and (len(self.task_weights) != len(self.tasks) or min(self.task_weights) < 0):
            raise ValueError("task_weights: one weight >= 0 per task")
        if not self.sparse_top_k or min(self.sparse_top_k) < 0:
            raise ValueError(f"sparse_top_k: need k values >= 0, got {self.sparse_top_k}")
        for stage in self.stages:
            lo, hi, steps = stage[:3]
            if len(stage) not in (3, 4, 5) or not 0 < lo <= hi or steps < 1:
                raise ValueError(f"stages: need 0 < min_len <= max_len, steps >= 1; got {lo, hi}")

    @property
    def total_steps(self) -> int:
        return int(sum(s[2] for s in self.stages))


def hf_config(cfg: PretrainConfig) -> dict:
    """A Qwen2 config.json for the recipe's model."""
    return {
        "model_type": "qwen2",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def build_vocab_map(tokenizer, tasks, vocab_size: int) -> dict[int, int]:
    """Tokenizer ids the synthetic tasks can emit -> 1..N (0 = unknown), sorted by tokenizer id so
    the map depends on nothing but the tokenizer and the task texts."""
    ids: set[int] = set()
    for task in sorted(set(tasks) | {"passkey", "niah", "niah1", "kv", "mqar"}):
        for split in ("train", "eval"):
            for ex in generate(task, 40, 256, tokenizer.encode, seed=12345, split=split):
                ids.update(tokenizer.encode(ex.text))
    for word in WORDS:
        for text in (f" {word}", word, f"-{word}", f"{{{word}", f'"{word}'):
            ids.update(tokenizer.encode(text))
    for d in range(10):
        ids.update(tokenizer.encode(f" {d}{d}"))
    if len(ids) + 1 > vocab_size:
        raise ValueError(f"vocab_size: the tasks use {len(ids)} ids, need >= {len(ids) + 1}")
    return {t: i + 1 for i, t in enumerate(sorted(ids))}


class Batcher:
    """Packs generated training documents of one length range into ``tokens`` tokens."""

    def __init__(self, cfg: PretrainConfig, encode, num_ids: int):
        self.cfg, self.encode, self.num_ids = cfg, encode, num_ids
        self.rng = np.random.default_rng(cfg.seed)
        self.index = 0
        w = np.asarray(cfg.task_weights or [1.0] * len(cfg.tasks), dtype=np.float64)
        self.weights = w / w.sum()

    def next(self, lo: int, hi: int, copy_fraction: float) -> tuple[list[list[int]], list[int]]:
        """``(docs, answer_lengths)``: token ids of each document and its answer's length."""
        docs, answers, total = [], [], 0
        while total < self.cfg.tokens_per_step or not docs:
            if self.rng.uniform() < copy_fraction:
                n = int(self.rng.integers(lo, hi + 1))
                top = self.cfg.copy_vocab or self.num_ids
                seg = self.rng.integers(1, top + 1, int(self.rng.integers(8, 33)))
                doc = np.resize(seg, n).tolist()
                if total and total + n > self.cfg.tokens_per_step:
                    break
                docs.append(doc)
                answers.append(0)
                total += n
                continue
            if self.cfg.task_weights:
                i = int(self.rng.choice(len(self.cfg.tasks), p=self.weights))
            else:  # uniform: the draw earlier recipes were trained with
                i = int(self.rng.integers(len(self.cfg.tasks)))
            task = self.cfg.tasks[i]
            n = int(self.rng.integers(lo, hi + 1))
            self.index += 1  # a fresh example every time (its own seeded stream)
            depth = None  # no extra draw without edge depths: earlier recipes replay exactly
            if self.cfg.edge_depth_fraction and self.rng.uniform() < self.cfg.edge_depth_fraction:
                depth = float(self.rng.integers(2))
            seed = self.cfg.seed * 1_000_003 + self.index
            ex = generate(task, 1, n, self.encode, seed=seed, depth=depth)[0]
            prompt, answer = self.encode(ex.prompt), self.encode(ex.answer)
            if total and total + len(prompt) + len(answer) > self.cfg.tokens_per_step:
                break
            docs.append(prompt + answer)
            answers.append(len(answer))
            total += len(docs[-1])
        return docs, answers


def step_loss(
    model, docs, answers, block_size: int, answer_weight: float, budget: Budget | None = None
) -> tuple[torch.Tensor, float]:
    """``(all-token loss + answer_weight x answer-token loss, answer-token loss)`` of one packed
    sequence."""
    lengths = [len(d) for d in docs]
    ids = torch.tensor([t for d in docs for t in d])
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    ctx = PackedAttention(cu, budget or Budget(gamma=1.0), block_size, "torch")
    logits = model(input_ids=ids[None], position_ids=pos[None], sb_attention=ctx, use_cache=False)
    logits = logits.logits[0]
    # target of position t is token t + 1 of the same document; the last token of each has none
    target = torch.cat([ids[1:], ids[:1]])
    valid = torch.ones(len(ids), dtype=torch.bool)
    is_answer = torch.zeros(len(ids), dtype=torch.bool)
    for end, n_ans in zip(cu[1:].tolist(), answers, strict=True):
        valid[end - 1] = False
        is_answer[end - 1 - n_ans : end - 1] = True
    nll = F.cross_entropy(logits, target, reduction="none")
    if not is_answer.any():  # only copy documents in this step
        return nll[valid].mean(), float("nan")
    answer_loss = nll[is_answer].mean()
    return nll[valid].mean() + answer_weight * answer_loss, float(answer_loss.detach())


def evaluate(
    model,
    cfg: PretrainConfig,
    encode,
    num: int | None = None,
    seed: int | None = None,
    depths: tuple[float, ...] | None = None,
    by_depth: dict | None = None,
) -> dict[str, dict[str, float]]:
    """Dense exact match per task and length on ``num`` held-out examples (eval split, ``seed``;
    default: the dev examples of the curve, depths drawn uniformly). ``depths``: ``num //
    len(depths)`` examples at each depth instead, as ``accuracy.py`` evaluates (the test row is
    then the benchmark's dense row of the pretrained model); ``by_depth`` (a dict) is filled with
    ``{task: {length: {depth: EM}}}``."""
    num = cfg.eval_examples if num is None else num
    seed = cfg.dev_seed if seed is None else seed
    per = max(1, num // len(depths)) if depths else num
    runner = HFRunner(model, gamma=1.0, block_size=cfg.block_size, backend="torch")
    out: dict[str, dict[str, float]] = {}
    for task in cfg.tasks:
        found = evaluate_task(runner, task, cfg.eval_lengths, encode, per, depths, seed=seed, pack_tokens=8192)
        out[task] = {str(n): float(np.mean([s.correct for s in found if s.length == n])) for n in cfg.eval_lengths}
        if depths and by_depth is not None:
            by_depth[task] = {
                str(n): {
                    str(d): float(np.mean([s.correct for s in found if s.length == n and s.depth == d])) for d in depths
                }
                for n in cfg.eval_lengths
            }
    model.train()
    return out


def lr_at(cfg: PretrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def init_from(model, folder: Path, vocab_map: dict[int, int]) -> None:
    """Load ``folder``'s weights into ``model``; refuse another shape or vocabulary in one line."""
    from safetensors.torch import load_file

    theirs = json.loads((folder / "vocab_map.json").read_text())
    if {int(k): v for k, v in theirs.items()} != vocab_map:
        raise ValueError(f"init_from {folder}: its vocab_map.json is not this recipe's")
    state = load_file(folder / "model.safetensors")
    if "lm_head.weight" not in state and "lm_head.weight" in model.state_dict():  # tied: once
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    mine = model.state_dict()
    wrong = [k for k in mine if k not in state or state[k].shape != mine[k].shape]
    if wrong:
        raise ValueError(f"init_from {folder}: another model shape ({wrong[0]} differs)")
    model.load_state_dict({k: state[k] for k in mine})


def pretrain(cfg: PretrainConfig, out: Path, log=print) -> dict:
    """Train, evaluate, save; returns the curve (also in ``out/curve.json``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparsebalance.data import load_tokenizer
    from sparsebalance.data.tokenizer import make_codec

    register()
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer()
    vocab_map = build_vocab_map(tokenizer, cfg.tasks, cfg.vocab_size)
    encode, _, _ = make_codec(tokenizer, vocab_map, cfg.vocab_size)
    config = AutoConfig.for_model(**hf_config(cfg))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=IMPLEMENTATION)
    if cfg.init_from:
        init_from(model, Path(cfg.init_from), vocab_map)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    batcher = Batcher(cfg, encode, len(vocab_map))
    sparse_rng = np.random.default_rng([cfg.seed, 29])
    curve: dict = {"steps": [], "loss": [], "answer_loss": [], "seconds": [], "evals": []}
    start, step, stopped = time.perf_counter(), 0, False
    for stage in cfg.stages:
        lo, hi, steps = (int(x) for x in stage[:3])
        copy_fraction = stage[3] if len(stage) >= 4 else cfg.copy_fraction
        sparse_fraction = stage[4] if len(stage) == 5 else 0.0
        for _ in range(steps):
            docs, answers = batcher.next(lo, hi, copy_fraction)
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step)
            budget = None  # dense, or top-k at a k drawn from sparse_top_k (own stream)
            if sparse_fraction and sparse_rng.uniform() < sparse_fraction:
                budget = Budget(top_k=int(sparse_rng.choice(cfg.sparse_top_k)))
            loss, answer_loss = step_loss(model, docs, answers, cfg.block_size, cfg.answer_weight, budget)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            elapsed = time.perf_counter() - start
            curve["steps"].append(step)
            curve["loss"].append(float(loss.detach()))
            curve["answer_loss"].append(answer_loss)
            curve["seconds"].append(elapsed)
            if step % 20 == 0:
                recent = [x for x in curve["answer_loss"][-20:] if x == x] or [float("nan")]
                log(
                    f"step {step:5d} [{lo}-{hi}] loss {float(loss):.3f} answer loss "
                    f"{sum(recent) / len(recent):.3f} {elapsed:6.0f}s",
                    flush=True,
                )
            if cfg.eval_every and step % cfg.eval_every == 0:
                em = evaluate(model, cfg, encode)
                curve["evals"].append({"step": step, "seconds": elapsed, "exact": em})
                log(f"step {step:5d} eval {json.dumps(em)}", flush=True)
            if elapsed > cfg.max_minutes * 60:
                log(f"stopping at step {step}: {cfg.max_minutes} minutes reached")
                stopped = True
                break
        if stopped:
            break
    train_s = time.perf_counter() - start
    if not curve["evals"] or curve["evals"][-1]["step"] != step:
        em = evaluate(model, cfg, encode)
        curve["evals"].append({"step": step, "seconds": train_s, "exact": em})
        log(f"final dev eval {json.dumps(em)}")
    curve.update(
        train_seconds=train_s,
        steps_done=step,
        stopped_early=stopped,
        threads=torch.get_num_threads(),
    )
    if cfg.test_examples:
        curve["test_by_depth"] = {}
        curve["test"] = evaluate(model, cfg, encode, cfg.test_examples, cfg.test_seed, DEPTHS, curve["test_by_depth"])
        curve["test_depths"] = list(DEPTHS)
        log(f"test eval ({cfg.test_examples} per task and length) {json.dumps(curve['test'])}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "vocab_map.json").write_text(json.dumps({str(k): v for k, v in vocab_map.items()}))
    (out / "curve.json").write_text(json.dumps(curve))
    (out / "recipe.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return curve


def write_curve_report(run: Path, results: str, name: str = "accuracy-pretrain", note: str = "") -> Path:
    """A dated results file (markdown + json) of a finished run's learning curve (dev examples),
    its final test evaluation and recipe; ``note`` is appended (e.g. the load it ran under)."""
    import subprocess

    from sparsebalance.results import markdown_table, write_results

    curve = json.loads((run / "curve.json").read_text())
    recipe = json.loads((run / "recipe.json").read_text())
    rows = []
    for ev in curve["evals"]:
        i = ev["step"] - 1
        window = [x for x in curve["answer_loss"][max(0, i - 49) : i + 1] if x == x]
        cells = [f"{v:.2f}" for task in ev["exact"].values() for v in task.values()]
        rows.append([ev["step"], f"{ev['seconds']:.0f}", f"{sum(window) / len(window):.3f}", *cells])
    if "test" in curve:
        cells = [f"**{v:.2f}**" for task in curve["test"].values() for v in task.values()]
        label = f"test ({recipe.get('test_examples')} per cell)"
        rows.append([label, f"{curve['train_seconds']:.0f}", "", *cells])
    first = curve["evals"][0]["exact"]
    head = ["step", "seconds", "answer loss (50-step mean)"]
    head += [f"{t} {n} EM" for t, by in first.items() for n in by]
    table = markdown_table(head, rows)
    if curve.get("test_by_depth"):  # where in the haystack the model fails
        depth_rows = [
            [task, n, *(f"{v:.2f}" for v in by.values())]
            for task, lens in curve["test_by_depth"].items()
            for n, by in lens.items()
        ]
        table += "\n\nTest EM by needle depth (share of the haystack before the needle):\n\n"
        table += markdown_table(["task", "length", *map(str, curve["test_depths"])], depth_rows)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    tested = (
        f"{len(curve['test_depths'])} depths {curve['test_depths']}: the accuracy benchmark's examples"
        if curve.get("test_depths")
        else "depths drawn uniformly; the accuracy benchmark's grid of depths differs"
    )
    notes = (
        f"Recipe: `{json.dumps(recipe)}`. Trained {curve['steps_done']} steps in "
        f"{curve['train_seconds']:.0f} s on {curve.get('threads', 1)} CPU thread(s) (stopped "
        f"early: {curve['stopped_early']}). EM = teacher-forced exact match on held-out examples "
        f"(eval split): the curve on {recipe.get('eval_examples')} dev examples per cell (seed "
        f"{recipe.get('dev_seed')}, depths drawn uniformly), the last row on the test examples "
        f"(seed {recipe.get('test_seed')}, {tested}). Answer loss: mean next-token "
        f"loss over answer tokens (ln 10 = 2.30 is a uniform guess over digits). Load when "
        f"written: `{load}` (shared 2-core machine). {note}"
    )
    md, _ = write_results(
        results,
        name,
        torch.device("cpu"),
        table,
        {"recipe": recipe, "curve": curve},
        notes,
    )
    return md


def load_config(path: str | None, overrides: dict) -> PretrainConfig:
    values = flags.load_file(path) if path else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    values = {
        k: (tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v)
        for k, v in values.items()
    }
    names = {f.name for f in dataclasses.fields(PretrainConfig)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {sorted(unknown)}")
    return PretrainConfig(**values)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="benchmarks/configs/accuracy-pretrain-2k-wide.toml")
    p.add_argument("--out", default="runs/retrieval-dense-2k-wide")
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--results", default=None, help="also write a dated learning-curve report here")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="write --results for the run in --out, no training",
    )
    p.add_argument("--note", default="", help="text appended to the report's notes")
    p.add_argument("--name", default="accuracy-pretrain", help="report: <date>-<name>-cpu.md")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for training (default 1, as the published recipes ran; the report names them)",
    )
    args = p.parse_args(argv)
    if args.threads < 1:
        raise ValueError(f"--threads {args.threads}: must be >= 1")
    torch.set_num_threads(args.threads)  # the report's machine line says what training ran with
    if args.report_only:
        if not args.results:
            raise ValueError("--report-only needs --results (where to write the report)")
        curve = Path(args.out) / "curve.json"
        if curve.is_file():  # the machine line names the threads the run trained on
            torch.set_num_threads(json.loads(curve.read_text()).get("threads", 1))
        print(f"wrote {write_curve_report(Path(args.out), args.results, args.name, args.note)}")
        return 0
    cfg = load_config(args.config, {"max_minutes": args.max_minutes, "seed": args.seed})
    curve = pretrain(cfg, Path(args.out))
    print(json.dumps(curve["evals"][-1]))
    if args.results:
        print(f"wrote {write_curve_report(Path(args.out), args.results, args.name, args.note)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
