"""The `shardwise` command: `config validate` in process, `run` through real torchrun launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from shardwise.cli.commands import COMMANDS, build_parser, main, torchrun_args

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))

GOOD = """\
train_micro_batch_size_per_gpu: 4
gradient_accumulation_steps: 2
optimizer: {type: AdamW, params: {lr: 0.001}}
zero_optimization: {stage: 2}
"""
BAD = """\
train_micro_batch_size_per_gpu: 4
zero_optimization: {stage: 2, reduce_bucket_sise: 1000}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------- config validate

def test_validate_good_file_prints_resolved_batch_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "good.yaml", GOOD)
    assert main(["config", "validate", str(path), "--world-size", "2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train_batch_size"] == 4 * 2 * 2
    assert printed["train_micro_batch_size_per_gpu"] == 4
    assert printed["gradient_accumulation_steps"] == 2
    assert printed["zero_optimization"]["stage"] == 2
    # Defaults are shown too: the output is the whole resolved config.
    assert printed["gradient_clipping"] == 0.0


def test_validate_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "good.json", json.dumps(yaml.safe_load(GOOD)))
    assert main(["config", "validate", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["train_batch_size"] == 8


def test_validate_bad_file_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "bad.yaml", BAD)
    assert main(["config", "validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "zero_optimization.reduce_bucket_sise" in captured.err
    assert "reduce_bucket_size" in captured.err  # the closest known key


def test_validate_batch_sizes_that_do_not_divide_the_world(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "odd.yaml", "train_batch_size: 6\ntrain_micro_batch_size_per_gpu: 2\n")
    assert main(["config", "validate", str(path), "--world-size", "2"]) == 2
    assert "train_batch_size" in capsys.readouterr().err


def test_validate_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_validate_named_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = "engines:\n  student: {train_batch_size: 8}\n  teacher: {train_micro_batch_size_per_gpu: 2}\n"
    assert main(["config", "validate", str(_write(tmp_path, "m.yaml", good)), "--world-size", "2"]) == 0
    engines = yaml.safe_load(capsys.readouterr().out)["engines"]
    assert engines["student"]["train_micro_batch_size_per_gpu"] == 4
    assert engines["teacher"]["train_batch_size"] == 4

    bad = "engines:\n  student: {train_batch_size: 8}\n  teacher: {zero_optimization: {stag: 1}}\n"
    assert main(["config", "validate", str(_write(tmp_path, "b.yaml", bad))]) == 2
    assert "engines.teacher.zero_optimization.stag" in capsys.readouterr().err


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_example_configs_are_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate", str(path), "--world-size", "2"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train_micro_batch_size_per_gpu"] == 16


def test_example_configs_cover_every_stage_and_bf16() -> None:
    names = {p.name for p in EXAMPLE_CONFIGS}
    assert {"stage0.yaml", "stage1.yaml", "stage2.yaml", "stage3.yaml"} <= names
    assert any("bf16" in n for n in names)


def test_command_registry() -> None:
    assert {"run", "config"} <= set(COMMANDS)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([])
    assert exit_info.value.code == 2


# ------------------------------------------------------------ run: arguments

def test_run_adds_standalone_on_one_node() -> None:
    assert torchrun_args(["--nproc-per-node", "2", "t.py", "--lr", "1"]) == [
        "--standalone", "--nproc-per-node", "2", "t.py", "--lr", "1"]
    # Options after the script belong to the script, not to torchrun.
    assert torchrun_args(["t.py", "--master-port", "5"])[0] == "--standalone"


@pytest.mark.parametrize(
    "args",
    [
        ["--standalone", "--nproc-per-node", "2", "t.py"],
        ["--rdzv-endpoint", "host:29400", "--rdzv-backend", "c10d", "t.py"],
        ["--rdzv_id=job7", "t.py"],
        ["--master-addr", "10.0.0.1", "--master-port", "29500", "t.py"],
        ["--nnodes", "2", "--nproc-per-node", "2", "t.py"],
        ["--nnodes", "1:3", "t.py"],
    ],
)
def test_run_passes_explicit_setups_through(args: list[str]) -> None:
    assert torchrun_args(args) == args


def test_run_respects_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "host:29400")
    assert torchrun_args(["t.py"]) == ["t.py"]


def test_run_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.cli.commands import _launch_environment

    for name in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(name, raising=False)
    _launch_environment(["--nproc-per-node", "2", "t.py"])
    assert int(os.environ["OMP_NUM_THREADS"]) >= 1  # set quietly: torchrun would print a warning block
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    _launch_environment(["--max-restarts", "3", "--nproc-per-node", "2", "t.py"])
    assert os.environ["OMP_NUM_THREADS"] == "7"  # the user's value wins
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # restarts get a fresh store


# ------------------------------------------------------------ run: launches

ALL_REDUCE = """\
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {value.item():g} args {sys.argv[1:]}", flush=True)
dist.destroy_process_group()
"""
FAIL_ON_RANK_1 = """\
import os
import sys
sys.exit(3 if os.environ["RANK"] == "1" else 0)
"""


def _shardwise(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run `python -m shardwise.cli ARGS` from the repo root with `src` importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_run_launches_two_ranks(tmp_path: Path) -> None:
    script = _write(tmp_path, "all_reduce.py", ALL_REDUCE)
    result = _shardwise("run", "--nproc-per-node", "2", str(script), "--flag", "x")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2: sum 3 args ['--flag', 'x']" in result.stdout


def test_run_exits_with_the_scripts_status(tmp_path: Path) -> None:
    script = _write(tmp_path, "fail.py", FAIL_ON_RANK_1)
    result = _shardwise("run", "--nproc-per-node", "2", str(script))
    assert result.returncode == 3
    assert "fail.py" in result.stderr


# The main example, end to end on 2 ranks: the default config (stage 2), stopped and
# resumed on re-run, and stage 3 in bf16, where the tied head and `engine.generate`
# read sharded weights. Then `shardwise generate` samples from what it saved.
def _example(run: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["run", "--nproc-per-node", "2", "examples/train_gpt.py", "--size", "tiny", "--steps", str(steps),
            "--run-dir", str(run), "--eval-every", "3", "--save-every", "3", "--log-every", "2",
            "--sample-tokens", "20", *extra]
    result = _shardwise(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == "", result.stderr  # no warning noise (torchrun's OMP banner, NumPy, ...)
    return result


def _losses(out: str) -> list[float]:
    return [float(line.split("loss")[1].split("|")[0]) for line in out.splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("config", [None, "stage3_bf16.yaml"], ids=str)
def test_train_gpt_example_on_two_ranks(config: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    out = _example(run, 6, *(["--config", f"examples/configs/{config}"] if config else [])).stdout
    assert "2 rank(s)" in out and "step 6/6" in out and "eval at step 6: loss" in out and "--- sample" in out
    losses = _losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert {"model.json", "metrics.jsonl", "metrics.png", "checkpoints"} <= {p.name for p in run.iterdir()}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["global_step3", "global_step6", "latest"]
    trusted = ["--trust-model-source", "--tokens", "12", "--temperature", "0"]  # model.json names examples/gpt.py
    assert main(["generate", str(run / "checkpoints"), *trusted]) == 0
    sampled = capsys.readouterr().out
    assert sampled.startswith("def ") and len(sampled.encode()) >= 12
    if config is not None:
        return
    # Re-run with more steps: resumes from the newest checkpoint.
    out = _example(run, 8).stdout
    assert f"resumed from {run / 'checkpoints' / 'global_step6'}: step 6, epoch 0 (step 6 of it)" in out
    assert "step 8/8" in out and "trained 2 step(s)" in out
    # A consolidated file samples the same as the sharded checkpoint it came from.
    file = run / "final.safetensors"  # model.json is found next to it
    assert main(["checkpoint", "consolidate", str(run / "checkpoints"), "--out", str(file)]) == 0
    capsys.readouterr()
    for source in (run / "checkpoints", file):
        assert main(["generate", str(source), *trusted]) == 0
    from_dir, from_file = capsys.readouterr().out.splitlines()[:2]
    assert from_dir == from_file


# ------------------------------------------------------------ env, plot, generate errors

def test_env_prints_versions_backends_and_cores(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "shardwise " in out
    assert "gloo yes" in out and "CPU cores:" in out and "GPUs:" in out


def test_plot_draws_loss_and_lr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": 3.0 / s, "lr": 1e-3 * s} for s in range(1, 6)] + [{"step": 5, "eval_loss": 0.9}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    assert main(["plot", str(metrics), "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(metrics)]) == 0 and (tmp_path / "metrics.png").is_file()
    capsys.readouterr()
    (tmp_path / "empty.jsonl").write_text("{}\n", encoding="utf-8")
    assert main(["plot", str(tmp_path / "empty.jsonl")]) == 2
    assert "no records with `step` and `loss`" in capsys.readouterr().err


def test_generate_errors_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "ck").mkdir()
    assert main(["generate", str(tmp_path / "ck")]) == 2
    assert "--model-json PATH" in capsys.readouterr().err
