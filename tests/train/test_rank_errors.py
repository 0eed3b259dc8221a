"""A training rank's own error is said by that rank (rank 0 says everything else): a damaged
shard only rank 1 reads used to end the run with rank 1 silent and rank 0 waiting."""

from __future__ import annotations

import pytest

from sparsebalance.train import __main__ as entry


class _Trainer:
    def __init__(self, cfg, fail_in_run):
        self.fail_in_run = fail_in_run

    def run(self):
        if self.fail_in_run:
            raise ValueError("data/store: shard 7 of tokens.bin does not match its checksum")


@pytest.mark.parametrize(
    "rank, in_run, says",
    [
        ("1", True, "sparsebalance train: rank 1: error: data/store: shard 7"),
        ("0", True, "sparsebalance train: error: data/store: shard 7"),
        ("1", False, None),  # set-up errors are every rank's: rank 0 says them, once
    ],
)
def test_a_ranks_own_error_is_said_by_that_rank(tmp_path, monkeypatch, capsys, rank, in_run, says):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    def trainer(cfg):
        if not in_run:
            raise ValueError("data/store: shard 7 of tokens.bin does not match its checksum")
        return _Trainer(cfg, in_run)

    monkeypatch.setattr(entry, "Trainer", trainer)
    code = entry.main(["--out", str(tmp_path / "run"), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    if says is None:
        assert err == ""
    else:
        assert says in err and err.count("\n") == 1


def test_a_stalled_peer_is_one_line_from_the_rank_that_waited(tmp_path, monkeypatch, capsys):
    from sparsebalance.parallel.watch import CommTimeout

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    line = (
        "rank 1 waiting in the gradient sync, step 3: no message from rank 0 within 5 s "
        "(--comm-timeout): it is stalled or has died"
    )

    class Stalled(_Trainer):
        def run(self):
            raise CommTimeout(line)

    monkeypatch.setattr(entry, "Trainer", lambda cfg: Stalled(cfg, True))
    code = entry.main(["--out", str(tmp_path / "run"), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == f"sparsebalance train: {line}; the last checkpoint is intact\n"


@pytest.mark.parametrize("rank, says", [("0", True), ("1", False)])
def test_an_error_every_rank_agreed_on_is_said_by_rank_0_only(tmp_path, monkeypatch, capsys, rank, says):
    """A full disk while saving is raised on every rank (rank 0's outcome, broadcast): before,
    rank 1 said it as its own, and when rank 1 exited first torchrun stopped rank 0 unheard."""
    from sparsebalance.train.checkpoint import AgreedError

    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    line = "checkpoint step-000002: no space left in /x (disk full); its partial files are removed"

    class Full(_Trainer):
        def run(self):
            raise AgreedError(line)

    monkeypatch.setattr(entry, "Trainer", lambda cfg: Full(cfg, True))
    code = entry.main(["--out", str(tmp_path / "run"), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"sparsebalance train: error: {line}\n" if says else "")
