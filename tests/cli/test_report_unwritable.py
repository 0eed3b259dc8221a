"""Issue 55 (bad): ``sparsebalance report`` on a run folder it cannot write crashed with two
tracebacks and no report. Now it is one line naming the folder and the way out (``--out DIR``),
and ``--out`` writes the report elsewhere."""

from __future__ import annotations

import builtins
import errno
import io
import os

import pytest

from sparsebalance.cli import main
from tests.test_report_files import _metrics


@pytest.fixture
def read_only(monkeypatch):
    """``read_only(folder)``: nothing can be created or written under ``folder`` (``EACCES``), as on
    a read-only mount; reading stays possible. Permission bits would not stop root."""

    def make(folder):
        inside = f"{folder}{os.sep}"
        real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

        def refuse(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))

        def opened(file, mode="r", *args, **kw):
            path = isinstance(file, (str, os.PathLike)) and os.fspath(file)
            if path and path.startswith(inside) and any(c in mode for c in "wxa+"):
                refuse(file)
            return real_open(file, mode, *args, **kw)

        def os_opened(path, flags, *args, **kw):
            writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT
            if os.fspath(path).startswith(inside) and flags & writes:
                refuse(path)
            return real_os_open(path, flags, *args, **kw)

        def made(path, *args, **kw):
            if os.fspath(path).startswith(inside):
                refuse(path)
            return real_mkdir(path, *args, **kw)

        for module, name, fn in ((builtins, "open", opened), (io, "open", opened), (os, "open", os_opened)):
            monkeypatch.setattr(module, name, fn)
        monkeypatch.setattr(os, "mkdir", made)

    return make


def test_an_unwritable_run_folder_is_one_line_naming_the_way_out(tmp_path, capsys, read_only):
    run = _metrics(tmp_path / "run")
    read_only(run)
    assert main(["report", str(run), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"sparsebalance report: error: the run folder {run} cannot be written (Permission denied")
    assert err.rstrip().endswith("pass --out DIR to write the report elsewhere")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_out_writes_the_report_elsewhere(tmp_path, capsys, read_only):
    run = _metrics(tmp_path / "run")
    read_only(run)
    out = tmp_path / "report"
    assert main(["report", str(run), "--no-plots", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out / 'report.md'}\n"
    assert sorted(p.name for p in out.iterdir()) == ["comparison.json", "report.md"]
    assert f"# Training report: {run}" in (out / "report.md").read_text()
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
