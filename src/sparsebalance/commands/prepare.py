"""``sparsebalance prepare INPUT... --out STORE``: tokenize inputs once into a token store.

Inputs: jsonl, jsonl.gz, jsonl.zst, json, parquet, txt files, saved Hugging Face ``datasets``
folders, or folders of such files; read streaming and tokenized by ``--workers`` threads. The
store (a flat token file memory-mapped on read, document offsets, a source per document and a JSON
manifest) is written under a temporary name and renamed when complete: an interrupted prepare
leaves nothing that loads. Train on it with ``sparsebalance train --data STORE``.

``sparsebalance prepare --verify STORE`` checks every byte of a store against its manifest (sizes,
offsets, token ids, each shard's checksum, the content hash): one line per problem and exit 1
when it is damaged, exit 0 when intact.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..data.prepare import PrepareConfig, prepare
from ..data.readers import ON_BAD_RECORD
from ..data.store import verify_store
from ..data.tokenizer import load_tokenizer
from ..results import markdown_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files or folders to tokenize")
    p.add_argument("--out", metavar="STORE", help="store folder to write (required)")
    p.add_argument(
        "--verify",
        metavar="STORE",
        default=None,
        help="check every byte of an existing store instead (no INPUT, no --out); exit 1 when it is damaged",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local HF tokenizer folder (default: the Qwen2.5 vocabulary)",
    )
    p.add_argument("--text-field", default="text", help="field holding the text")
    p.add_argument(
        "--workers",
        type=int,
        default=max(1, os.cpu_count() or 1),
        help="tokenizer threads (default: the CPU count)",
    )
    p.add_argument(
        "--on-bad-record",
        choices=ON_BAD_RECORD,
        default="error",
        help="error: stop naming file and line; skip: skip and count per reason",
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=2,
        help="documents with fewer tokens are not stored, counted",
    )
    p.add_argument(
        "--max-record-bytes",
        default="64MiB",
        help="a record longer than this after decompression is a bad record (memory stays "
        "bounded whatever the input holds)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print only the manifest as JSON")


def record_bytes(text: str) -> int:
    """``--max-record-bytes`` (``64MiB``, ``1e8``, ...) -> bytes."""
    from ..latency.host_memory import parse_bytes

    try:
        return int(parse_bytes(text))
    except ValueError:
        raise ValueError(f"--max-record-bytes must be a size > 0 such as 64MiB, got {text!r}") from None


def verify(store: str) -> int:
    """``--verify STORE``: one line per problem on stderr and exit 1, or one line and 0."""
    t0 = time.perf_counter()
    problems, m = verify_store(store)
    if problems:
        for line in problems:
            print(f"sparsebalance prepare: damaged: {line}", file=sys.stderr)
        return 1
    print(
        f"{store}: intact: {m['num_documents']:,} documents, {m['num_tokens']:,} tokens, "
        f"content hash {m['content_hash']} (verified in {time.perf_counter() - t0:.1f} s)"
    )
    return 0


def main(args: argparse.Namespace) -> int:
    if args.verify is not None:
        if args.inputs or args.out:
            raise ValueError(f"--verify {args.verify} checks a store: give no INPUT and no --out")
        return verify(args.verify)
    if args.out is None:
        raise ValueError("--out STORE is required (or --verify STORE to check a store)")
    cfg = PrepareConfig(
        inputs=args.inputs,
        out=args.out,
        text_field=args.text_field,
        workers=args.workers,
        on_bad_record=args.on_bad_record,
        min_tokens=args.min_tokens,
        max_record_bytes=record_bytes(args.max_record_bytes),
        overwrite=args.overwrite,
        progress=not (args.no_progress or args.json),
    )
    m = prepare(cfg, load_tokenizer(args.tokenizer))
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    mb = m["prepare"]["input_bytes"] / 1e6
    secs = max(m["elapsed"], 1e-9)
    print(
        f"wrote {args.out}: {m['num_documents']:,} documents, {m['num_tokens']:,} tokens "
        f"({m['dtype']}), {mb:,.1f} MB in {secs:.1f} s ({m['num_documents'] / secs:,.0f} docs/s, "
        f"{mb / secs:,.1f} MB/s, {args.workers} workers)\ntokenizer: "
        f"{m['tokenizer']['identity']}; content hash {m['content_hash']}\n"
    )
    rows = [[s["name"], s["documents"], s["tokens"]] for s in m["sources"][:20]]
    print(markdown_table(["source", "documents", "tokens"], rows))
    if len(m["sources"]) > 20:
        print(f"... and {len(m['sources']) - 20} more sources (see the manifest)")
    short = m["skipped_short"]
    if short["documents"]:
        print(f"\nskipped {short['documents']} documents with < {cfg.min_tokens} tokens")
    for reason, info in m["bad_records"].items():
        print(f"skipped {info['count']} records: {reason} (first: {', '.join(info['first'])})")
    for tmp in m["swept"]:
        print(f"removed {tmp}: the temporary folder of an earlier, killed prepare")
    return 0
