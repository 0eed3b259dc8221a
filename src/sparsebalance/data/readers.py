"""Streaming readers: input files -> (text, source) records, one at a time, never a whole file.

Formats: ``.jsonl`` (also ``.jsonl.gz`` and ``.jsonl.zst``), ``.parquet``, ``.txt`` (the file is
one document), ``.json`` (a list of records; read whole: use jsonl for large data) and saved
Hugging Face ``datasets`` folders (their Arrow files are streamed with pyarrow; ``datasets``
itself is not needed). A folder of such files is read in sorted order.

A record's source is its ``source`` (or ``task``) field when it has one, else the file's stem.
Bad records (invalid JSON, invalid UTF-8, a line that is not an object, no text field, text that
is not a string, a record over ``max_record_bytes``) raise ``ValueError`` naming file and line, or
with ``on_bad_record="skip"`` are counted per reason with the first few line numbers
(:class:`BadRecords`).

Memory is bounded by the record size limit (default 64 MiB, after decompression): a ``.jsonl``
line is read at most that far (a multi-GB line or a ``.jsonl.gz`` bomb is skipped as it streams
by), a ``.json`` or ``.txt`` file (read whole) must fit in it, and no longer text reaches the
tokenizer.

A compressed input is checked whole before its first record is read (:func:`check_compressed`:
a ``.jsonl.gz`` is decompressed once, output discarded, a few percent of what tokenising it costs;
a ``.jsonl.zst``'s frame and block headers are walked): a truncated or damaged file is refused in
one line naming it (``docs.jsonl.gz: truncated: ...``) before anything of it is tokenised,
whatever ``--on-bad-record`` says (the file is damaged, not a record).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from .store import MANIFEST, is_store

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet", ".txt", ".arrow")
REASONS = (
    "invalid JSON",
    "invalid UTF-8",
    "not a JSON object",
    "missing text field",
    "text is not a string",
    "record too large",
)
MAX_RECORD_BYTES = 64 * 2**20
"""Default bound on one record's bytes after decompression (``--max-record-bytes``)."""
ON_BAD_RECORD = ("error", "skip")
Progress = Callable[[int], None]  # called with the number of input bytes just consumed


class BadRecords:
    """Per-reason counts and the first ``keep`` locations of records that could not be read."""

    def __init__(self, on_bad_record: str = "error", keep: int = 5, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        if on_bad_record not in ON_BAD_RECORD:
            raise ValueError(f"--on-bad-record must be error or skip, got {on_bad_record!r}")
        if isinstance(max_record_bytes, bool) or not isinstance(max_record_bytes, int):
            raise ValueError(f"--max-record-bytes must be an integer, got {max_record_bytes!r}")
        if max_record_bytes < 1:
            raise ValueError(f"--max-record-bytes must be >= 1, got {max_record_bytes}")
        self.max_record_bytes = max_record_bytes
        self.policy = on_bad_record
        self.keep = keep
        self.counts: dict[str, int] = {}
        self.first: dict[str, list[str]] = {}

    def report(self, reason: str, where: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        if self.policy == "error":
            more = " or raise --max-record-bytes" if reason == "record too large" else ""
            raise ValueError(
                f"{where}: {reason}{f' ({detail})' if detail else ''}; "
                f"pass --on-bad-record skip to skip such records (they are counted){more}"
            )
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.first.setdefault(reason, [])) < self.keep:
            self.first[reason].append(where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict:
        return {r: {"count": n, "first": self.first[r]} for r, n in self.counts.items()}

    def describe(self) -> str:
        return "; ".join(f"{n} {r} (first: {', '.join(self.first[r])})" for r, n in self.counts.items())


def suffix(path: Path) -> str:
    name = path.name.lower()
    for s in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(s):
            return s
    return path.suffix


def source_stem(path: Path) -> str:
    s = suffix(path)
    return path.name[: -len(s)] if s and path.name.lower().endswith(s) else path.stem


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_info.json", "dataset_dict.json"))


def input_files(paths: list[str | Path], flag: str = "INPUT") -> list[Path]:
    """Every readable input (files, saved HF dataset folders), folders expanded in sorted order.
    A token store (or a folder holding one, or its manifest) is refused: it is already
    prepared, and its manifest would be read as a JSON record."""
    out: list[Path] = []
    for p in map(Path, paths):
        _refuse_store(p, flag)
        if is_hf_dataset(p):
            out.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and suffix(f) in SUFFIXES)
            if not found:
                raise ValueError(f"{flag} {p}: no {'/'.join(SUFFIXES)} files in the folder")
            for manifest in (f for f in found if f.name == MANIFEST):
                _refuse_store(manifest.parent, flag, within=p)
            out += found
        elif p.is_file():
            if suffix(p) not in SUFFIXES:
                raise ValueError(f"{flag} {p}: unknown format (expected one of {SUFFIXES})")
            if p.name == MANIFEST:
                _refuse_store(p.parent, flag, within=p)
            out.append(p)
        else:
            raise ValueError(f"{flag} {p}: no such file or directory")
    return out


def _refuse_store(path: Path, flag: str, within: Path | None = None) -> None:
    """One ``ValueError`` when ``path`` is a token store given where raw data is read."""
    if not is_store(path):
        return
    where = f"{flag} {within}: {path} is" if within else f"{flag} {path}:"
    raise ValueError(
        f"{where} a token store, already prepared, not raw data to tokenize: train on it with "
        f"`sparsebalance train --data {path}` (prepare reads {'/'.join(SUFFIXES)} files)"
    )


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes (of every file under a folder, in sorted order)."""
    h = hashlib.sha256()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
    return h.hexdigest()


class _Counting(io.RawIOBase):
    """A raw file that reports how many bytes were read from it (compressed bytes)."""

    def __init__(self, fh, progress: Progress | None) -> None:
        self.fh, self.progress = fh, progress

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.fh.readinto(b)
        if self.progress and n:
            self.progress(n)
        return n


def _zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise ValueError(
            f"{path}: .zst input needs the zstandard package (`pip install zstandard`, or the `data` extra)"
        ) from None
    return zstandard


def _open_lines(path: Path, progress: Progress | None):
    raw = _Counting(open(path, "rb"), progress)  # noqa: SIM115 (closed with the returned stream)
    s = suffix(path)
    if s == ".jsonl.gz":
        return gzip.open(io.BufferedReader(raw), "rb")
    if s == ".jsonl.zst":
        return io.BufferedReader(_zstandard(path).ZstdDecompressor().stream_reader(raw))
    return io.BufferedReader(raw, 1 << 20)


def _damaged(path: Path, err: BaseException) -> ValueError:
    """A compressed input that cannot be decompressed to its end, in one line naming it."""
    kind = "zstd" if suffix(path) == ".jsonl.zst" else "gzip"
    if isinstance(err, EOFError):
        return ValueError(
            f"{path}: truncated: the {kind} stream ends before its end marker "
            "(the file is incomplete: copy or download it again)"
        )
    detail = " ".join(str(err).split())[:200]
    return ValueError(f"{path}: not a readable {kind} file ({type(err).__name__}: {detail})")


def _stream_errors(path: Path) -> tuple[type[BaseException], ...]:
    """What decompressing ``path`` raises when the file is truncated or damaged."""
    if suffix(path) == ".jsonl.gz":
        return (EOFError, gzip.BadGzipFile, zlib.error)
    if suffix(path) == ".jsonl.zst":
        return (EOFError, _zstandard(path).ZstdError)
    return ()


def check_compressed(path: Path) -> None:
    """Refuse a truncated or damaged ``.jsonl.gz`` / ``.jsonl.zst`` (others: nothing to do) in
    one line (``ValueError`` naming it) before any of its records is tokenised. gzip: the file is
    decompressed to its end, 64 KiB of output at a time, discarded. zstd: its frames are walked
    (frame and block headers, no decompression), which finds a cut (zstandard's readers end a
    truncated frame without a word); damage inside a block is found when it is read."""
    s, errors = suffix(path), _stream_errors(path)
    try:
        if s == ".jsonl.gz":
            with gzip.open(path, "rb") as fh:
                while fh.read(1 << 16):
                    pass
        elif s == ".jsonl.zst":
            _walk_zstd_frames(path, _zstandard(path))
    except errors as err:
        raise _damaged(path, err) from None


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _walk_zstd_frames(path: Path, zstandard) -> None:
    """Every frame of a zstd file complete: headers read, block contents skipped (RFC 8878)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        while (at := fh.tell()) < size:
            head = fh.read(18)  # the longest frame header: magic + 14 bytes
            if len(head) >= 8 and head[1:4] == b"\x2a\x4d\x18" and head[0] & 0xF0 == 0x50:
                fh.seek(at + 8 + int.from_bytes(head[4:8], "little"))  # a skippable frame
            elif head[:4] == _ZSTD_MAGIC:
                try:
                    fh.seek(at + zstandard.frame_header_size(head))
                    checksum = zstandard.get_frame_parameters(head).has_checksum
                except zstandard.ZstdError:
                    raise EOFError("a frame header is cut") from None
                last = False
                while not last:
                    block = fh.read(3)
                    if len(block) < 3:
                        raise EOFError("a block header is cut")
                    header = int.from_bytes(block, "little")
                    last, kind, length = bool(header & 1), (header >> 1) & 3, header >> 3
                    if kind == 3:
                        raise zstandard.ZstdError(f"reserved block type at byte {fh.tell() - 3}")
                    fh.seek(1 if kind == 1 else length, 1)  # an RLE block holds one byte
                fh.seek(4 if checksum else 0, 1)
            else:
                raise zstandard.ZstdError(f"not a zstd frame at byte {at}")
            if fh.tell() > size:
                raise EOFError("the last frame is cut")


def _record(obj, where: str, field: str, stem: str, bad: BadRecords) -> tuple[str, str] | None:
    if not isinstance(obj, dict):
        bad.report("not a JSON object", where, f"a JSON {type(obj).__name__}")
        return None
    if field not in obj:
        bad.report("missing text field", where, f"no {field!r} (--text-field)")
        return None
    text = obj[field]
    if not isinstance(text, str):
        bad.report("text is not a string", where, f"{field!r} is a {type(text).__name__}")
        return None
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            bad.report("invalid UTF-8", where, "an unpaired surrogate escape")
            return None
    src = obj.get("source", obj.get("task"))
    return text, src if isinstance(src, str) and src else stem


def _too_large(bad: BadRecords, size: int) -> str:
    return f"{size:,} bytes > --max-record-bytes {bad.max_record_bytes:,}"


def _read_jsonl(path: Path, field: str, bad: BadRecords, progress) -> Iterator[tuple[str, str]]:
    stem = source_stem(path)
    limit = bad.max_record_bytes
    check_compressed(path)
    errors = _stream_errors(path)
    try:
        yield from _jsonl_lines(path, field, bad, progress, stem, limit)
    except errors as err:  # damaged since the check: still one line naming it
        raise _damaged(path, err) from None


def _jsonl_lines(path: Path, field: str, bad: BadRecords, progress, stem: str, limit: int):
    with _open_lines(path, progress) as fh:
        lineno = 0
        while raw := fh.readline(limit + 1):  # never more than the limit in memory
            lineno += 1
            if len(raw) > limit and not (len(raw) == limit + 1 and raw.endswith(b"\n")):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # the rest of the line streams by
                    raw = fh.readline(min(limit, 1 << 20))
                    size += len(raw)
                bad.report("record too large", f"{path}:{lineno}", _too_large(bad, size))
                continue
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad.report("invalid UTF-8", where, f"byte {err.start}")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                bad.report("invalid JSON", where, err.msg)
                continue
            rec = _record(obj, where, field, stem, bad)
            if rec is not None:
                yield rec


def _whole_file(path: Path, bad: BadRecords, progress) -> bytes | None:
    """A ``.json`` / ``.txt`` file's bytes, or None (reported) when it exceeds the bound."""
    size = path.stat().st_size
    if size > bad.max_record_bytes:
        if progress:
            progress(size)
        hint = "; use .jsonl for large data" if suffix(path) == ".json" else ""
        bad.report("record too large", str(path), _too_large(bad, size) + hint)
        return None
    raw = path.read_bytes()
    if progress:
        progress(len(raw))
    return raw


def _read_json(path: Path, field: str, bad: BadRecords, progress) -> Iterator[tuple[str, str]]:
    raw = _whole_file(path, bad, progress)
    if raw is None:
        return
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        bad.report("invalid UTF-8", f"{path}:{_line_of(raw, err.start)}")
        return
    except json.JSONDecodeError as err:
        bad.report("invalid JSON", f"{path}:{err.lineno}", err.msg)
        return
    for i, obj in enumerate(data if isinstance(data, list) else [data]):
        rec = _record(obj, f"{path} record {i}", field, source_stem(path), bad)
        if rec is not None:
            yield rec


def _read_txt(path: Path, bad: BadRecords, progress) -> Iterator[tuple[str, str]]:
    raw = _whole_file(path, bad, progress)  # the file is one document
    if raw is None:
        return
    try:
        yield raw.decode("utf-8"), source_stem(path)
    except UnicodeDecodeError as err:
        bad.report("invalid UTF-8", f"{path}:{_line_of(raw, err.start)}")


def _line_of(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


def _pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            f"{path}: parquet / Arrow input needs pyarrow (`pip install pyarrow`, or the `data` extra)"
        ) from None
    return pyarrow


def _read_batches(batches, path: Path, field: str, bad: BadRecords) -> Iterator[tuple[str, str]]:
    stem, row = source_stem(path), 0
    for batch in batches:
        names = batch.schema.names
        if field not in names:
            raise ValueError(f"{path}: no column {field!r} (--text-field; columns: {names})")
        texts = batch.column(field).to_pylist()
        key = "source" if "source" in names else "task" if "task" in names else None
        srcs = batch.column(key).to_pylist() if key else [None] * len(texts)
        limit = bad.max_record_bytes
        for text, src in zip(texts, srcs, strict=True):
            row += 1
            where = f"{path} row {row}"
            if isinstance(text, str) and len(text) > limit // 4:  # >= 1 byte per character
                size = len(text.encode("utf-8", "surrogatepass"))
                if size > limit:
                    bad.report("record too large", where, _too_large(bad, size))
                    continue
            rec = _record({field: text, "source": src}, where, field, stem, bad)
            if rec is not None:
                yield rec


def _unreadable(path: Path, what: str, err: Exception) -> ValueError:
    """A file pyarrow cannot read, named, in one line (pyarrow's own message names no file)."""
    detail = " ".join(str(err).split())
    return ValueError(f"{path}: not a readable {what} file ({type(err).__name__}: {detail})")


def _read_parquet(path: Path, field: str, bad: BadRecords, progress) -> Iterator[tuple[str, str]]:
    pa = _pyarrow(path)
    try:
        pf = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:  # garbage, truncated, not parquet
        raise _unreadable(path, "parquet", err) from None
    names = pf.schema_arrow.names
    cols = [c for c in (field, "source", "task") if c in names] or None
    size, groups = path.stat().st_size, max(1, pf.num_row_groups)

    def batches():
        try:
            for g in range(pf.num_row_groups):
                yield from pf.iter_batches(batch_size=1024, row_groups=[g], columns=cols)
                if progress:
                    progress(size // groups)
        except (pa.ArrowException, OSError) as err:  # a damaged row group
            raise _unreadable(path, "parquet", err) from None

    yield from _read_batches(batches(), path, field, bad)


def _arrow_files(folder: Path) -> list[Path]:
    if (folder / "dataset_dict.json").is_file():  # a DatasetDict: its train split
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"{folder}: a dataset dict without a 'train' split ({splits})")
        folder = folder / "train"
    state = folder / "state.json"
    if state.is_file():
        return [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    return sorted(folder.glob("*.arrow"))


def _read_arrow(path: Path, field: str, bad: BadRecords, progress) -> Iterator[tuple[str, str]]:
    pa = _pyarrow(path)
    for f in _arrow_files(path) if path.is_dir() else [path]:
        with pa.memory_map(str(f)) as source:
            try:
                try:
                    reader = pa.ipc.open_stream(source)
                except pa.ArrowInvalid:
                    reader = pa.ipc.open_file(source)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                else:
                    batches = iter(reader)
                yield from _read_batches(batches, f, field, bad)
            except (pa.ArrowException, OSError) as err:  # garbage, truncated, not Arrow
                raise _unreadable(f, "Arrow", err) from None
        if progress:
            progress(f.stat().st_size)


def read_records(
    path: Path, text_field: str, bad: BadRecords, progress: Progress | None = None
) -> Iterator[tuple[str, str]]:
    """``(text, source)`` of every good record of one input, streamed."""
    if is_hf_dataset(path):
        return _read_arrow(path, text_field, bad, progress)
    s = suffix(path)
    if s in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
        return _read_jsonl(path, text_field, bad, progress)
    if s == ".json":
        return _read_json(path, text_field, bad, progress)
    if s == ".txt":
        return _read_txt(path, bad, progress)
    if s == ".parquet":
        return _read_parquet(path, text_field, bad, progress)
    if s == ".arrow":
        return _read_arrow(path, text_field, bad, progress)
    raise ValueError(f"{path}: unknown format (expected one of {SUFFIXES})")
