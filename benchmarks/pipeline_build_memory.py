"""Host memory of building a pipeline stage (issue 54, item 1): stage-only materialisation against
building the whole model and dropping the other stages.

    PYTHONPATH=src python benchmarks/pipeline_build_memory.py [--out benchmarks/results]

Measured: a model of Qwen2.5-3B's depth and vocabulary (36 layers, 151,936 tokens, tied head) at
a tiny width (hidden 256, MLP 768, 4 heads of 64, 2 KV heads), split as ``sparsebalance train
--pp 4`` splits it. For every stage, in a fresh process each: the peak resident size (``VmHWM``)
of ``build.checked_model`` + ``build.pipeline_stage`` (the trainer's build; the model on
``meta``, this stage alone materialised) and of the earlier build (the whole model on the host,
then ``StageModel`` dropping the other stages), each beside the process's resident size with
torch and transformers' Qwen2 code imported (``base``) and the stage's parameter bytes (fp32).
Target: peak <= the stage's parameters + 2 GiB.

Computed: the same two builds for Qwen2.5-3B and Qwen2.5-7B's shapes at ``--pp 4``: the stage's
and the whole model's fp32 parameters (counted on ``meta``), plus the base and the overhead the
measured stage-only build had over its stage (the initialisation log, the scratch slice,
allocator slack), which depends on the depth and not the width.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
QWEN3B = json.loads((ROOT / "src/sparsebalance/models/configs/qwen2.5-3b.json").read_text())
QWEN7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
TINY_WIDTH = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
}
PP = 4


def _config(shapes: dict) -> dict:
    return {k: v for k, v in shapes.items() if not k.startswith("_")}


def _measure(folder: str, rank: int, mode: str, queue) -> None:
    import torch
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (what the build imports)

    from sparsebalance.engine.runtime import Runtime
    from sparsebalance.engine.stage import StageModel
    from sparsebalance.latency.host_memory import current_rss_bytes, peak_rss_bytes
    from sparsebalance.train import TrainConfig, build

    torch.set_num_threads(1)
    base = current_rss_bytes()
    cfg = TrainConfig(model=folder, pp=PP, device="cpu", out=f"{folder}/run")
    rt = Runtime(rank, PP, torch.device("cpu"))
    if mode == "stage-only":
        model = build.checked_model(cfg, rt.device, "--model")
        stage = build.pipeline_stage(cfg, rt, model)
    else:  # the earlier build: the whole model on the host, the other stages then dropped
        from sparsebalance.batching.schedule import balanced_layers, head_layers
        from sparsebalance.engine.stage import PipelineLayout
        from sparsebalance.models import ModelShapes
        from sparsebalance.models.hf import build_model

        model = build_model(folder, "cpu", torch.float32, seed=cfg.seed)
        shapes = ModelShapes.from_hf_config(model.config.to_dict())
        split = tuple(balanced_layers(shapes.num_layers, PP, head_layers(shapes)).tolist())
        stage = StageModel(model, PipelineLayout.of(rank, PP, PP, split))
    params = {id(p): p.numel() * p.element_size() for p in stage.parameters()}
    peak, _ = peak_rss_bytes()
    queue.put(
        {
            "rank": rank,
            "mode": mode,
            "base": base,
            "peak": peak,
            "stage_bytes": sum(params.values()),
            "layers": len(stage.layers),
            "split": list(stage.split),
        }
    )


def _counted(shapes: dict) -> list[dict]:
    """Per stage at --pp 4: its fp32 parameter bytes, and the whole model's (counted on meta)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparsebalance.batching.schedule import balanced_layers, head_layers
    from sparsebalance.engine.stage import PipelineLayout, StageModel
    from sparsebalance.models import ModelShapes

    config = AutoConfig.for_model(**_config(shapes))
    out = []
    ms = ModelShapes.from_hf_config(config.to_dict())
    split = tuple(balanced_layers(ms.num_layers, PP, head_layers(ms)).tolist())
    for rank in range(PP):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        whole = sum(p.numel() for p in model.parameters()) * 4
        stage = StageModel(model, PipelineLayout.of(rank, PP, PP, split))
        mine = sum(p.numel() for p in stage.parameters()) * 4
        out.append({"stage": rank, "layers": split[rank], "stage_bytes": mine, "whole_bytes": whole})
    return out


def main() -> int:
    import tempfile

    import torch

    from sparsebalance.results import markdown_table, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(_config(QWEN3B) | TINY_WIDTH))
        for mode in ("stage-only", "whole-then-drop"):
            for rank in range(PP):
                queue = ctx.Queue()
                proc = ctx.Process(target=_measure, args=(str(folder), rank, mode, queue))
                proc.start()
                measured.append(queue.get())
                proc.join()
                print(json.dumps(measured[-1]), file=sys.stderr, flush=True)
    rows = []
    for m in measured:
        budget = m["stage_bytes"] + 2 * GIB
        rows.append(
            [
                m["mode"],
                m["rank"],
                m["layers"],
                m["stage_bytes"] / GIB,
                m["base"] / GIB,
                m["peak"] / GIB,
                (m["peak"] - m["base"] - m["stage_bytes"]) / GIB,
                "yes" if m["peak"] <= budget else "no",
            ]
        )
    only = [m for m in measured if m["mode"] == "stage-only"]
    overhead = max(m["peak"] - m["base"] - m["stage_bytes"] for m in only)
    base = max(m["base"] for m in only)
    computed = []
    for name, shapes in (("Qwen2.5-3B", QWEN3B), ("Qwen2.5-7B", QWEN7B)):
        for c in _counted(shapes):
            new = base + c["stage_bytes"] + overhead
            old = base + c["whole_bytes"]
            computed.append(
                [
                    name,
                    c["stage"],
                    c["layers"],
                    c["stage_bytes"] / GIB,
                    new / GIB,
                    old / GIB,
                    "yes" if new <= c["stage_bytes"] + 2 * GIB else "no",
                ]
            )
    headers = [
        "build",
        "stage",
        "layers",
        "stage GiB",
        "base GiB",
        "peak GiB",
        "peak - base - stage GiB",
        "peak <= stage + 2 GiB",
    ]
    table = markdown_table(headers, rows)
    headers2 = [
        "model (fp32)",
        "stage",
        "layers",
        "stage GiB",
        "stage-only peak GiB",
        "whole-then-drop peak GiB",
        "stage-only <= stage + 2 GiB",
    ]
    table2 = markdown_table(headers2, computed)
    text = f"Measured (tiny width, Qwen2.5-3B depth, --pp 4):\n\n{table}\n\nComputed at --pp 4:\n\n{table2}"
    payload = {
        "measured": measured,
        "computed": [dict(zip(headers2, c, strict=True)) for c in computed],
        "overhead_bytes": overhead,
        "base_bytes": base,
    }
    md, _ = write_results(
        args.out, "pipeline-build-memory", torch.device("cpu"), text, payload, __doc__.split("\n\n", 2)[2]
    )
    print(text)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
