"""Does a retrieval model fail on keys it never saw? (issue 29, the base model's MQAR)

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/accuracy_keys.py \\
        runs/retrieval-dense-2k runs/retrieval-dense-2k-untied

For each model folder of ``benchmarks/accuracy_pretrain.py``: dense MQAR exact match on
``--examples`` examples per length whose keys come from the training split (values fresh) and
from the eval split (keys never trained on: what the accuracy benchmark scores), and the mean
pairwise cosine of the input embeddings of the tokens found only in training-split words and only
in eval-split words (tokens that never occur in training keep their initialisation when the
embeddings are untied; tied, the output softmax moves them all). Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_pretrain import IMPLEMENTATION, register
from sparsebalance.data import load_tokenizer
from sparsebalance.data.tokenizer import make_codec
from sparsebalance.evaluation import HFRunner
from sparsebalance.evaluation.synthetic import score_examples
from sparsebalance.tasks import WORDS, generate
from sparsebalance.tasks.vocab import split_of


def mean_pairwise_cosine(rows: torch.Tensor) -> float:
    x = torch.nn.functional.normalize(rows.float(), dim=-1)
    n = len(x)
    return float(((x @ x.T).sum() - n) / (n * n - n))


def diagnose(folder: Path, lengths, examples: int, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    register()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=IMPLEMENTATION)
    vmap = {int(k): v for k, v in json.loads((folder / "vocab_map.json").read_text()).items()}
    tokenizer = load_tokenizer()
    encode, _, _ = make_codec(tokenizer, vmap, model.get_input_embeddings().num_embeddings)
    out: dict = {"model": str(folder)}
    ids: dict[str, set[int]] = {"train": set(), "eval": set()}
    for word in WORDS:
        ids[split_of(word)].update(vmap.get(t, 0) for t in tokenizer.encode(f" {word}"))
    table = model.get_input_embeddings().weight.detach()
    for split in ("train", "eval"):
        only = sorted(ids[split] - ids["eval" if split == "train" else "train"])
        out[f"cosine_{split}_only"] = mean_pairwise_cosine(table[only])
    runner = HFRunner(model, gamma=1.0, block_size=64, backend="torch")
    with torch.no_grad():
        for split in ("train", "eval"):
            for n in lengths:
                exs = generate("mqar", examples, n, encode, seed=seed, split=split)
                scores = score_examples(runner, exs, encode, pack_tokens=8192)
                out[f"mqar_{split}_keys_{n}"] = sum(s.correct for s in scores) / len(scores)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", type=Path, help="accuracy_pretrain.py output folders")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--examples", type=int, default=100, help="MQAR examples per length and split")
    p.add_argument("--seed", type=int, default=1000, help="the accuracy benchmark's test seed")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    for folder in args.models:
        print(json.dumps(diagnose(folder, lengths, args.examples, args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
