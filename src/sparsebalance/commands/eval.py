"""``sparsebalance eval``: accuracy of a model under one attention setting.

Tasks: ``passkey | niah | niah1 | vt | kv | mqar`` (teacher-forced greedy exact match on freshly
generated eval-split examples, by context length and needle depth; a heatmap PNG for niah/passkey
with ``--out``), ``ppl`` (perplexity per window length on ``--data`` text; default: the synthetic
eval split), ``longbench`` (local LongBench v1 jsonl under ``--data``, prompts middle-truncated to
each ``--lengths`` value (``--truncation``), greedy generation, official metrics;
``--code-sim-backend`` for lcc / repobench-p).

``--model`` (loaded by :func:`sparsebalance.train.weights.load_trained_model`): a built-in config
(``tiny``, ``qwen2.5-0.5b``, ``qwen2.5-3b``: random weights, for smoke tests), a local Hugging Face
model directory (``config.json`` + safetensors), a trainer checkpoint directory (``model.pt``, or a
pipeline's stage files, merged in this process; its base model from ``meta.json``'s ``model``
or ``--base``), or a trainer run directory (its ``checkpoints/latest``). A model whose
vocabulary is smaller than the tokenizer's needs the trainer's id map: ``vocab_map.json`` beside
``model.pt``, in the run directory or in the Hugging Face directory, or ``--vocab-map``. ``--attn sparse`` runs the
block-sparse op at one budget: ``--top-k K`` key blocks per query, ``--budget-tokens T`` (``T /
block size`` blocks: the trainer's unit and default, 8,192 tokens) or ``--gamma G`` (the threshold
rule); ``--attn dense`` is the same op at gamma 1.0 (exact attention).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine.kernel import add_block_size_argument, resolve_block_size, resolve_kernel
from ..evaluation.longbench import TRUNCATIONS
from ..evaluation.metrics import CODE_SIM_BACKENDS
from ..files import check_output_folder, write_text_atomic
from ..models.head import tied_head
from ..ops import Budget, resolve_backend
from ..results import markdown_table
from ..tasks import TASKS
from ..tuning.config import DEFAULT_BUDGET_TOKENS
from ..tuning.knob import knob_from_tokens

SYNTHETIC = tuple(TASKS)  # passkey, niah, vt, kv, niah1 (single needle), mqar
TASK_CHOICES = (*SYNTHETIC, "longbench", "ppl")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_lengths(text: str) -> list[int]:
    """``"1k,2k,4096"`` -> ``[1024, 2048, 4096]``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            value = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise ValueError(f"--lengths: {part!r} is not a length like 512, 1k or 4k") from None
        if value <= 0:
            raise ValueError(f"--lengths: lengths must be > 0, got {part!r}")
        out.append(value)
    return out


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--depths: expected numbers in [0, 1], got {text!r}") from None
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"--depths: every depth must be in [0, 1], got {text!r}")
    return depths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in name, HF dir, checkpoint or run dir")
    p.add_argument(
        "--task", required=True, choices=TASK_CHOICES, help="synthetic task, longbench (--data) or ppl (perplexity)"
    )
    p.add_argument(
        "--lengths", type=parse_lengths, default=[1024, 2048, 4096], help="e.g. 1k,2k,4k (longbench: max prompt tokens)"
    )
    p.add_argument(
        "--attn",
        choices=["dense", "sparse"],
        default="sparse",
        help="sparse: the block-sparse op at one budget; dense: gamma 1.0, exact attention",
    )
    _add_budget_arguments(p)
    _add_example_arguments(p)
    _add_data_arguments(p)
    p.add_argument("--base", default=None, help="base model of a trainer checkpoint")
    p.add_argument("--vocab-map", default=None, help="JSON {tokenizer id: model id}")
    p.add_argument("--tokenizer", default=None, help="local HF tokenizer dir (default: Qwen2.5's)")
    _add_kernel_arguments(p)
    p.add_argument("--out", default=None, help="folder for result JSON (+ heatmap PNG)")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def _add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """The sparse budget: at most one of --top-k, --budget-tokens, --gamma."""
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--top-k", type=int, default=None, help="sparse budget: key blocks per query (MoBA top-k)")
    budget.add_argument(
        "--budget-tokens",
        type=int,
        default=None,
        help="sparse budget in tokens attended: top-k with k = tokens / block "
        f"size (default: {DEFAULT_BUDGET_TOKENS}, the trainer's)",
    )
    budget.add_argument(
        "--gamma",
        type=float,
        default=None,
        help="sparse budget by the threshold rule: the fewest blocks whose estimated mass reaches gamma, in (0, 1]",
    )


def _add_example_arguments(p: argparse.ArgumentParser) -> None:
    """The generated examples of a synthetic task."""
    p.add_argument("--num-examples", type=int, default=20, help="examples per length (and depth)")
    p.add_argument(
        "--depths",
        type=parse_depths,
        default=None,
        help="needle depths, e.g. 0,0.25,0.5,0.75,1 (default: 5 for niah/passkey, random for vt/kv)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated examples")


def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    """LongBench's and perplexity's data, and how LongBench is truncated and scored."""
    p.add_argument("--data", default=None, help="longbench jsonl file/dir; ppl text/jsonl")
    p.add_argument("--prompts", default=None, help="longbench templates (dataset2prompt format)")
    p.add_argument(
        "--truncation",
        choices=TRUNCATIONS,
        default=TRUNCATIONS[0],
        help="longbench middle truncation: text = official (decode both halves, join, "
        "re-tokenize), tokens = keep the token ids",
    )
    p.add_argument(
        "--code-sim-backend",
        choices=CODE_SIM_BACKENDS,
        default=CODE_SIM_BACKENDS[0],
        help="longbench lcc / repobench-p fuzz.ratio: difflib = official requirements' "
        "fuzzywuzzy, rapidfuzz = fuzzywuzzy with python-Levenshtein",
    )
    p.add_argument("--max-windows", type=int, default=32, help="ppl windows per length")


def _add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """Where and how attention runs: block, backend, tokens per forward, device, dtype."""
    add_block_size_argument(p)
    p.add_argument("--backend", default="auto", help="attention backend: auto | torch | flex | reference")
    p.add_argument("--pack-tokens", type=int, default=16384, help="tokens per forward")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu | cuda (default: cuda when available, else cpu)",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="model dtype")


def check_args(args: argparse.Namespace) -> Budget:
    """Validate flag combinations; return the budget the runner uses."""
    if args.num_examples <= 0:
        raise ValueError(f"--num-examples must be > 0, got {args.num_examples}")
    if args.task == "longbench" and args.data is None:
        raise ValueError("--task longbench needs --data (a local LongBench jsonl file or folder)")
    if args.out:  # before the evaluation: its results are never lost to an output error
        check_output_folder(args.out, "--out")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible on this machine")
    resolve_block_size(args.device, args.block_size, backend=None)  # a bad --block-size is named first
    if args.backend != "auto":
        try:
            resolve_backend(args.backend, torch.device(args.device))
        except ValueError as err:
            raise ValueError(f"--backend {args.backend}: {err}") from None
    args.block_size = resolve_kernel(args.device, args.block_size, args.backend).block_size
    if args.attn == "dense":
        for flag, value in (("--top-k", args.top_k), ("--budget-tokens", args.budget_tokens), ("--gamma", args.gamma)):
            if value is not None and (flag, value) != ("--gamma", 1.0):
                raise ValueError(f"{flag} is for --attn sparse; --attn dense is exact attention")
        return Budget(gamma=1.0)
    if args.gamma is not None:
        if not 0.0 < args.gamma <= 1.0:
            raise ValueError(f"--gamma must be in (0, 1], got {args.gamma}")
        return Budget(gamma=args.gamma)
    if args.top_k is not None:
        if args.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 key blocks, got {args.top_k}")
        return Budget(top_k=args.top_k)
    tokens = DEFAULT_BUDGET_TOKENS if args.budget_tokens is None else args.budget_tokens
    if tokens < 0:
        raise ValueError(f"--budget-tokens must be >= 0, got {tokens}")
    return Budget(top_k=knob_from_tokens(tokens, args.block_size).base)  # the trainer's k


def check_sizes(args: argparse.Namespace, model) -> None:
    """Before the first example: ``--lengths`` within the model's context (positions it never
    saw would be evaluated for minutes, then mean nothing), and the largest forward's memory
    estimated and refused, with the estimate, where it cannot fit."""
    from ..latency.memory import MemoryModel, cpu_coefficients
    from ..models import ModelShapes
    from ..sizes import check_device_memory

    config = model.config
    # a transformers config may lack the field (no fixed context): no length check then
    longest, context = max(args.lengths), getattr(config, "max_position_embeddings", None)
    if context and longest > context:
        raise ValueError(
            f"--lengths {longest}: longer than the model's context of {context:,} tokens "
            "(max_position_embeddings): evaluate at lengths it was built for"
        )
    if args.pack_tokens < 1:
        raise ValueError(f"--pack-tokens must be >= 1, got {args.pack_tokens}")
    shapes = ModelShapes.from_hf_config(config.to_dict(), name=str(args.model))
    tied = tied_head(model)  # the weights say whether the head is the embedding
    memory = MemoryModel(shapes, cpu_coefficients(0.0), tied)
    tokens, size = max(longest, args.pack_tokens), DTYPES[args.dtype].itemsize
    need = memory.inference_peak_bytes(tokens, size, args.block_size)
    need -= memory.num_params() * size  # the weights are loaded already
    check_device_memory(
        "--lengths / --pack-tokens", f"a forward of {tokens:,} tokens", need, next(model.parameters()).device
    )


def describe(budget: Budget) -> str:
    """``"dense"``, ``"top-k 8"`` or ``"gamma 0.9"``."""
    if budget.gamma == 1.0:
        return "dense"
    return f"top-k {budget.top_k}" if budget.top_k is not None else f"gamma {budget.gamma:g}"


def run(args: argparse.Namespace) -> dict:
    """Evaluate; return the JSON-ready result."""
    budget = check_args(args)
    from ..data.tokenizer import load_tokenizer, make_codec
    from ..evaluation import HFRunner
    from ..train.weights import load_trained_model

    model, vocab_map = load_trained_model(args.model, args.device, DTYPES[args.dtype], args.base, args.vocab_map)
    check_sizes(args, model)
    vocab_size = model.get_input_embeddings().num_embeddings
    encode, decode, eos = make_codec(load_tokenizer(args.tokenizer), vocab_map, vocab_size)
    runner = HFRunner(model, block_size=args.block_size, backend=args.backend, budget=budget)
    result = {
        "model": args.model,
        "task": args.task,
        "attn": args.attn,
        "budget": describe(budget),
        "gamma": budget.gamma,
        "top_k": budget.top_k,
        "block_size": args.block_size,
        "lengths": args.lengths,
        "seed": args.seed,
    }
    show = not args.json and sys.stderr.isatty()
    if args.task in SYNTHETIC:
        result.update(_synthetic(args, runner, encode, show))
    elif args.task == "ppl":
        result.update(_ppl(args, runner, encode, eos, show))
    else:
        result.update(_longbench(args, runner, encode, decode, eos, show))
    result["mean_density"] = sum(runner.densities) / len(runner.densities) if runner.densities else None
    return result


def _synthetic(args, runner, encode, show) -> dict:
    from ..evaluation import evaluate_task, plot_heatmap, summarize

    depths = args.depths
    if depths is None and args.task in ("niah", "passkey"):
        depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    total = len(args.lengths) * len(depths or [None]) * args.num_examples
    with tqdm(total=total, desc=f"eval {args.task}", file=sys.stderr, disable=not show) as bar:
        scores = evaluate_task(
            runner, args.task, args.lengths, encode, args.num_examples, depths, args.seed, args.pack_tokens, bar.update
        )
    summary = summarize(scores, None if depths is not None else 5)[args.task]
    out = {"summary": summary}
    if args.out and depths is not None:
        png = Path(args.out) / f"eval-{args.task}-{args.attn}-heatmap.png"
        out["heatmap"] = str(plot_heatmap(summary, png, f"{args.task}, {args.attn}"))
    return out


def _ppl(args, runner, encode, eos, show) -> dict:
    from ..evaluation import perplexity, read_texts
    from ..tasks import synthetic_mix

    if args.data is not None:
        texts = read_texts(args.data)
    else:  # the synthetic eval split: held out from a model trained on the synthetic mix
        need = args.max_windows * max(args.lengths)
        mix = synthetic_mix(max(8, need // 600), encode, args.seed, split="eval")
        texts = [ex.text for ex in mix]
    total = len(args.lengths) * args.max_windows
    with tqdm(total=total, desc="eval ppl", file=sys.stderr, disable=not show) as bar:
        res = perplexity(runner, texts, encode, args.lengths, eos, args.max_windows, args.pack_tokens, bar.update)
    return {"perplexity": res}


def _longbench(args, runner, encode, decode, eos, show) -> dict:
    from ..evaluation import evaluate_longbench, load_templates, read_dir

    records = read_dir(args.data)
    templates = load_templates(args.prompts)
    per_length = {}
    for n in args.lengths:

        def gen(ids, max_new):
            return runner.generate(ids, max_new, eos)

        def bar(items, n=n):
            return tqdm(items, desc=f"longbench {n}", file=sys.stderr, disable=not show)

        res = evaluate_longbench(
            records,
            gen,
            encode,
            decode,
            n,
            templates,
            progress=bar,
            truncation=args.truncation,
            code_sim_backend=args.code_sim_backend,
        )
        per_length[str(n)] = res.to_dict()
    return {"longbench": per_length, "truncation": args.truncation, "code_sim_backend": args.code_sim_backend}


def format_table(result: dict) -> str:
    """A human-readable table of :func:`run`'s result."""
    head = f"{result['task']} | attn {result['attn']} ({result['budget']})"
    if "summary" in result:
        s = result["summary"]
        rows = [[n, v["accuracy"], v["token_accuracy"], v["count"]] for n, v in s["by_length"].items()]
        text = markdown_table(["length", "exact match", "token acc", "n"], rows)
        if s["by_depth"]:
            rows = [[d, v["accuracy"], v["count"]] for d, v in s["by_depth"].items()]
            text += "\n\n" + markdown_table(["depth bin", "exact match", "n"], rows)
        if "heatmap" in result:
            text += f"\n\nheatmap: {result['heatmap']}"
    elif "perplexity" in result:
        rows = [[n, v["ppl"], v["nll"], v["tokens"]] for n, v in result["perplexity"].items()]
        text = markdown_table(["length", "ppl", "nll", "tokens"], rows)
    else:
        rows = [
            [n, name, score]
            for n, r in result["longbench"].items()
            for name, score in [*r["scores"].items(), ("average", r["average"])]
        ]
        text = markdown_table(["max length", "dataset", "score"], rows)
    return f"{head}\n\n{text}"


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.out:
        write_text_atomic(Path(args.out) / f"eval-{args.task}-{args.attn}.json", json.dumps(result, indent=2))
    print(json.dumps(result) if args.json else format_table(result))
    return 0
