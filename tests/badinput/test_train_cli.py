"""``sparsebalance train``: bad flags, config files, models, devices and latency profiles are
refused in one line (exit 2) before anything is launched or profiled, and nothing is left in
``--out`` (a resumed run's folder is untouched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparsebalance.train.checkpoint import save_checkpoint
from sparsebalance.train.config import TrainConfig
from sparsebalance.train.config_io import to_dict
from tests.badinput.conftest import (
    ExpensiveStageReached,
    assert_refused,
    cli,
    gpt2_model,
    sliding_window_model,
    snapshot,
    write_profile,
)
from tests.train.harness import write_dataset

# a --config file's text -> what the one line must name (the key and the file)
CONFIG_FILES = [
    pytest.param("steps = 2.7\n", ["steps must be an integer", "2.7"], id="steps-float"),
    pytest.param("steps = true\n", ["steps must be an integer", "True"], id="steps-bool"),
    pytest.param('steps = "ten"\n', ["steps must be an integer", "'ten'"], id="steps-string"),
    pytest.param(
        "checkpoint_every = 1.5\n",
        ["checkpoint_every must be an integer"],
        id="checkpoint-every-float",
    ),
    pytest.param('lr = "1e-3"\n', ["lr must be a finite number", "'1e-3'"], id="lr-string"),
    pytest.param("grad_clip = nan\n", ["grad_clip must be a finite number", "nan"], id="grad-clip-nan"),
    pytest.param("out = 5\n", ["out must be a string"], id="out-int"),
    pytest.param("dst = 3\n", ["dst must be a table of DSTConfig fields"], id="dst-not-a-table"),
    pytest.param(
        "[dst]\nlayer_feedback = 1\n",
        ["[dst] layer_feedback must be true or false"],
        id="dst-bool-int",
    ),
    pytest.param("global_batch = [4]\n", ["global_batch must be an integer"], id="list"),
]


@pytest.mark.parametrize(("text", "culprits"), CONFIG_FILES)
def test_a_config_file_of_the_wrong_type_is_refused(tmp_path, capsys, text, culprits):
    config = tmp_path / "run.toml"
    config.write_text(text)
    out = tmp_path / "run"
    code, err = cli(capsys, "train", "--config", config, "--nproc", "1", "--out", out)
    assert_refused(code, err, "train", f"--config {config}", *culprits)
    assert not out.exists()


def test_a_json_config_that_is_not_a_table_is_refused(tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text("[1, 2]")
    code, err = cli(capsys, "train", "--config", config, "--nproc", "1", "--out", tmp_path / "r")
    assert_refused(code, err, "train", f"--config {config}", "expected a table")


# flags -> what the line must name; each flag passes argparse but not the config's checks
FLAGS = [
    pytest.param(["--grad-clip", "nan"], ["--grad-clip must be a finite number"], id="grad-clip"),
    pytest.param(
        ["--capacity", "auto", "--memory-budget", "nanGB"],
        ["--memory-budget"],
        id="memory-budget-nan",
    ),
    pytest.param(["--backend", "nope"], ["--backend nope"], id="backend"),
    pytest.param(["--backend", "flex"], ["--backend flex", "needs CUDA"], id="flex-on-cpu"),
    # range checks name the flag alone on the command line (the Python API adds the field)
    pytest.param(["--lr", "0"], ["--lr must be > 0, got 0.0"], id="lr-zero"),
    pytest.param(["--weight-decay", "-1"], ["--weight-decay must be >= 0"], id="weight-decay"),
]


@pytest.mark.parametrize(("argv", "culprits"), FLAGS)
def test_a_bad_flag_is_refused(tmp_path, capsys, argv, culprits):
    out = tmp_path / "run"
    code, err = cli(capsys, "train", "--device", "cpu", "--nproc", "1", "--out", out, *argv)
    assert_refused(code, err, "train", *culprits)
    assert not out.exists()


def _run_flags(tmp_path, *extra) -> list:
    """A small CPU run that passes every check but the one under test."""
    return [
        "train",
        "--data",
        write_dataset(tmp_path),
        "--block-size",
        "32",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--global-batch",
        "4",
        "--capacity",
        "512",
        "--out",
        tmp_path / "run",
        *extra,
    ]


def _device_type(data: dict) -> None:
    data["fingerprint"]["device_type"] = "cuda"  # a measured GPU profile


# another run's profile (written by the case) -> what the line must name
OTHER_RUNS = [
    pytest.param({"model": "qwen2.5-0.5b"}, ["num_layers 24 vs 4", "hidden_size"], id="model"),
    pytest.param({"block_size": 64}, ["block_size 64 vs 32"], id="block-size"),
    pytest.param({"edit": _device_type}, ["device 'cuda' vs 'cpu'"], id="device-kind"),
]


@pytest.mark.parametrize(
    "mode", [["--nproc", "1"], ["--nproc", "1", "--emulate-ranks", "2"]], ids=["ranks", "emulate-ranks"]
)
@pytest.mark.parametrize(("profile", "culprits"), OTHER_RUNS)
def test_a_profile_of_another_run_is_refused_before_launch(tmp_path, capsys, mode, profile, culprits):
    path = write_profile(tmp_path, "other.json", **profile)
    code, err = cli(capsys, *_run_flags(tmp_path, "--profile", path, *mode))
    assert_refused(code, err, "train", f"--profile {path}", "another run", *culprits)
    assert not (tmp_path / "run").exists()


def _saved_run(tmp_path, step: int = 1, steps: int = 2, ranks: int = 0, data=None) -> Path:
    """The folder of a run of ``--steps steps`` (the flags of :func:`_run_flags`) with its
    checkpoint at ``step`` (a stand-in model: nothing loads it before launch); ``ranks``: the
    RNG states it holds, one per rank (0: none, any world size); ``data``: its data identity."""
    run = tmp_path / "run"
    cfg = TrainConfig(
        data=str(tmp_path / "data.jsonl"),
        block_size=32,
        device="cpu",
        steps=steps,
        global_batch=4,
        capacity=512,
        out=str(run),
        strategy="sab",
    )
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = {"step": step, "config": to_dict(cfg)}
    if data is not None:
        state["data"] = {"identity": data}
    rngs = [{"torch": torch.get_rng_state()} for _ in range(ranks)]
    save_checkpoint(run, step, model, opt, sched, state, rngs, True, keep_last=0)
    (run / "config.json").write_text(json.dumps({"schema_version": 2, **to_dict(cfg)}))
    return run


def test_resume_refuses_a_profile_of_another_run(tmp_path, capsys):
    """``--profile`` may change on --resume, but only to one for this run: the folder of the
    run being resumed stays as it was."""
    argv = _run_flags(tmp_path, "--nproc", "1")
    run = _saved_run(tmp_path)
    before = snapshot(run)
    other = write_profile(tmp_path, "other.json", model="qwen2.5-0.5b")
    code, err = cli(capsys, *argv, "--resume", "--profile", other)
    assert_refused(code, err, "train", f"--profile {other}", "num_layers 24 vs 4")
    assert snapshot(run) == before


def test_resume_with_fewer_steps_than_trained_is_refused_before_launch(tmp_path, capsys):
    """``--resume --steps 6`` from step 10 trained nothing and exited 0 (its config then said 6
    steps of a 10-step run)."""
    argv = _run_flags(tmp_path, "--nproc", "1")
    run = _saved_run(tmp_path, step=10, steps=10)
    before = snapshot(run)
    code, err = cli(capsys, *argv, "--resume", "--steps", "6")
    assert_refused(
        code, err, "train", "--resume with --steps 6", "already has 10 steps", "checkpoints/step-000010", "--steps > 10"
    )
    assert snapshot(run) == before


def test_resume_of_a_complete_run_says_so_without_launching(tmp_path, capsys):
    argv = _run_flags(tmp_path, "--nproc", "1")
    run = _saved_run(tmp_path, step=10, steps=10)
    before = snapshot(run)
    code, err = cli(capsys, *argv, "--resume", "--steps", "10")
    lines = err.strip().splitlines()
    assert code == 0 and len(lines) == 1, err
    assert lines[0].startswith("sparsebalance train: --resume: the run in") and "complete" in err
    assert snapshot(run) == before  # no launch (the tripwire), no report rewritten


@pytest.mark.parametrize("nproc", ["1", "3"])
def test_resume_on_another_world_size_launches(tmp_path, capsys, nproc):
    """Issue 45: rank 2 died with ``IndexError`` at ``state["rng"][rank]``, every rank printing
    a traceback; it was then refused before launch. Issue 54: it launches (rank r restores saved
    rank r mod N's RNG state; rank 0 says so, ``tests/train/test_reshard_checks.py``)."""
    argv = _run_flags(tmp_path, "--nproc", nproc, "--strategy", "sab")  # auto: by the ranks
    run = _saved_run(tmp_path, step=1, steps=4, ranks=2)
    with pytest.raises(ExpensiveStageReached, match="training was launched"):
        cli(capsys, *argv, "--resume", "--steps", "4")
    assert (run / "checkpoints" / "step-000001").is_dir()


def test_resume_on_the_same_world_size_launches(tmp_path, capsys):
    argv = _run_flags(tmp_path, "--nproc", "1")
    run = _saved_run(tmp_path, step=1, steps=4, ranks=1)
    with pytest.raises(ExpensiveStageReached, match="training was launched"):
        cli(capsys, *argv, "--resume", "--steps", "4")
    assert (run / "checkpoints" / "step-000001").is_dir()


def test_a_truncated_meta_json_falls_back_to_the_checkpoint_before(tmp_path, capsys):
    """Issue 45: ``error: .../meta.json: unreadable`` (exit 2) blocked every resume; the launcher
    now passes it over as rank 0 does (rank 0 names it when it resumes from step 1)."""
    argv = _run_flags(tmp_path, "--nproc", "1")
    run = _saved_run(tmp_path, step=1, steps=4)
    _saved_run(tmp_path, step=2, steps=4)
    meta = run / "checkpoints" / "step-000002" / "meta.json"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(ExpensiveStageReached, match="training was launched"):
        cli(capsys, *argv, "--resume", "--steps", "4")


def _identity(tmp_path) -> dict:
    """The data identity a run of :func:`_run_flags` records (``data.jsonl`` as it is now)."""
    from sparsebalance.data import load_corpus, load_tokenizer

    corpus = load_corpus(str(write_dataset(tmp_path)), load_tokenizer(None))
    return {**corpus.identity(), "vocab_map_size": None}


def test_resume_on_changed_data_is_refused_before_launch(tmp_path, capsys):
    """Issue 45 (weak): rank 0 refused it after the ranks launched (36 s)."""
    argv = _run_flags(tmp_path, "--nproc", "1")
    run = _saved_run(tmp_path, step=1, steps=4, data=_identity(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text(data.read_text().replace("4821", "4822"))
    before = snapshot(run)
    code, err = cli(capsys, *argv, "--resume", "--steps", "4")
    assert_refused(
        code, err, "train", "belongs to a different run", "data content", "trained on other data", "content changed"
    )
    assert snapshot(run) == before


def test_resume_on_the_same_data_launches(tmp_path, capsys):
    _saved_run(tmp_path, step=1, steps=4, data=_identity(tmp_path))
    with pytest.raises(ExpensiveStageReached, match="training was launched"):
        cli(capsys, *_run_flags(tmp_path, "--nproc", "1"), "--resume", "--steps", "4")


@pytest.mark.parametrize("grace", ["0", "-5", "nan"])
def test_a_bad_stop_grace_is_refused(tmp_path, capsys, grace):
    out = tmp_path / "run"
    code, err = cli(capsys, "train", "--device", "cpu", "--nproc", "1", "--out", out, "--stop-grace", grace)
    assert_refused(code, err, "train", "--stop-grace must be a finite number of seconds > 0")
    assert not out.exists()


def _damage(checkpoint: Path) -> None:
    data = bytearray((checkpoint / "model.pt").read_bytes())
    data[-20] ^= 0xFF
    (checkpoint / "model.pt").write_bytes(bytes(data))


# (the run's own --steps, damage to its step-10 checkpoint): --resume --steps 10 launches
ENDS_THERE_BUT_NOT_COMPLETE = [
    pytest.param(20, None, id="a-longer-run-stopped-at-step-10"),
    pytest.param(10, _damage, id="its-last-checkpoint-damaged"),
]


@pytest.mark.parametrize(("steps", "damage"), ENDS_THERE_BUT_NOT_COMPLETE)
def test_resume_at_the_last_step_launches_unless_the_run_is_complete(tmp_path, capsys, steps, damage):
    """Equal steps launch when the run did not end there (it is ended: its config and metrics
    follow) or its checkpoint there is damaged (rank 0 resumes from an older one)."""
    argv = _run_flags(tmp_path, "--nproc", "1")
    run = _saved_run(tmp_path, step=10, steps=steps)
    if damage is not None:
        damage(run / "checkpoints" / "step-000010")
    with pytest.raises(ExpensiveStageReached, match="training was launched"):
        cli(capsys, *argv, "--resume", "--steps", "10")


# a model folder (made by the case) -> what the line must name besides --model
MODELS = [
    pytest.param(sliding_window_model, ["sliding-window"], id="sliding-window"),
    pytest.param(
        gpt2_model,
        ["model type 'gpt2' is not supported", "Qwen2/Qwen2.5", "Qwen3", "Llama", "Mistral without a sliding window"],
        id="gpt2",
    ),
]


@pytest.mark.parametrize(("make", "culprits"), MODELS)
def test_a_model_it_cannot_run_is_refused_before_it_is_profiled(tmp_path, capsys, make, culprits):
    model = make(tmp_path)
    code, err = cli(capsys, *_run_flags(tmp_path, "--model", model, "--nproc", "1"))
    assert_refused(code, err, "train", f"--model {model}", *culprits)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("nproc", [[], ["--nproc", "1"]], ids=["default-nproc", "nproc-1"])
def test_device_cuda_without_a_gpu_says_so(tmp_path, capsys, nproc):
    code, err = cli(capsys, "train", "--device", "cuda", "--out", tmp_path / "run", *nproc)
    assert_refused(code, err, "train", "--device cuda", "no CUDA device")
    assert not (tmp_path / "run").exists()
