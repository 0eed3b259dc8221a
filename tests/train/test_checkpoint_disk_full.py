"""A disk that fills while a checkpoint is written (issue 45): one line naming the folder and the
full disk, on every rank, the partial files removed, the previous checkpoint intact and
resumable. The disk is simulated, not mounted: every file a save opens for writing goes through
``Path.open``, and the one under test refuses bytes past a point with ``ENOSPC`` as a full
filesystem does; ``torch.save`` meets it inside its zip writer (which then fails a second time,
``unexpected pos``, as on a real full disk)."""

from __future__ import annotations

import errno
import os
import pickle
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint


def _model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt, sched


def _save(run: Path, step: int, is_main: bool = True):
    model, opt, sched = _model(step)
    rngs = [{"torch": torch.get_rng_state()}] * 2  # two ranks' states
    return save_checkpoint(run, step, model, opt, sched, {"step": step, "config": {"model": "m"}}, rngs, is_main)


class _FullDisk:
    """A file on a disk with ``room`` bytes left: a write past them raises ``ENOSPC``."""

    def __init__(self, f, room: int, path: Path) -> None:
        self._f, self._room, self._path = f, room, path

    def write(self, data) -> int:
        n = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if n > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def fill_disk(monkeypatch, step: int, name: str, room: int) -> None:
    """The disk fills after ``room`` more bytes of ``name`` (a file of step ``step``'s
    checkpoint, or ``latest``) are written."""
    real = Path.open

    def open_(path, mode="r", *args, **kwargs):
        f = real(path, mode, *args, **kwargs)
        ours = path.parent.name.startswith(f".step-{step:06d}.tmp") and path.name == name
        pointer = name == "latest" and path.name.startswith("latest.tmp")
        return _FullDisk(f, room, path) if "w" in mode and (ours or pointer) else f

    monkeypatch.setattr(Path, "open", open_)


# the file the disk fills in, and the bytes of it that still fit
WHERE = [
    pytest.param("model.pt", 100, id="model.pt"),
    pytest.param("state.pt", 1000, id="state.pt"),
    pytest.param("meta.json", 0, id="meta.json"),
    pytest.param("checksums.json", 10, id="checksums.json"),
    pytest.param("latest", 0, id="latest"),
]


@pytest.mark.parametrize(("name", "room"), WHERE)
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_resumes(tmp_path, monkeypatch, name, room):
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    fill_disk(monkeypatch, 2, name, room)
    with pytest.raises(ValueError) as err:
        _save(tmp_path, 2)
    monkeypatch.undo()
    line = str(err.value)
    assert "\n" not in line, line
    assert f"checkpoint step-000002: no space left in {root} (disk full" in line, line
    assert "step-000001 is intact" in line and "--resume" in line, line
    # nothing of step 2 is left (no temporary, no folder without its pointer)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert (root / "latest").read_text() == "step-000001\n"
    assert find_checkpoint(tmp_path) == (root / "step-000001", [])
    model, opt, sched = _model(0)
    state = load_checkpoint(root / "step-000001", model, opt, sched)
    assert state["trainer"]["step"] == 1


def test_a_full_disk_at_the_first_checkpoint_says_nothing_was_saved(tmp_path, monkeypatch):
    fill_disk(monkeypatch, 1, "model.pt", 0)
    with pytest.raises(ValueError, match="disk full") as err:
        _save(tmp_path, 1)
    assert "no earlier checkpoint was saved" in str(err.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def _rank(rank: int, world: int, tmp: str) -> None:
    """Both ranks save step 2 after step 1; rank 0's disk fills in ``model.pt``."""
    out = Path(tmp) / f"rank-{rank}.pkl"
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
        _save(Path(tmp) / "run", 1, rank == 0)
        if rank == 0:  # this process only, for the rest of its life
            fill_disk(pytest.MonkeyPatch(), 2, "model.pt", 100)
        try:
            _save(Path(tmp) / "run", 2, rank == 0)
            result = {"outcome": "saved"}
        except ValueError as err:
            result = {"outcome": "ValueError", "message": str(err)}
        dist.barrier()  # every rank still in step with the others
        dist.destroy_process_group()
    except BaseException:
        result = {"outcome": "crashed", "message": traceback.format_exc()}
    out.write_bytes(pickle.dumps(result))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_every_rank_gets_the_same_line_not_a_traceback(tmp_path):
    """Rank 0 writes; without the outcome broadcast rank 1 carried on as if saved while rank 0
    raised torch's ``unexpected pos``, and each rank ended in its own traceback."""
    world = 2
    mp.spawn(_rank, args=(world, str(tmp_path)), nprocs=world, join=True)
    results = [pickle.loads((tmp_path / f"rank-{r}.pkl").read_bytes()) for r in range(world)]
    assert [r["outcome"] for r in results] == ["ValueError", "ValueError"], results
    assert results[0]["message"] == results[1]["message"]
    assert "no space left" in results[0]["message"]
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
