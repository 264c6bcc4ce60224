"""The Trainer as Hugging Face / Lightning users expect it, on 2 gloo ranks: a model + config builds the engine
(`total_num_steps: auto` resolved), a metrics record every 10 steps whatever `steps_per_print` says,
`compute_metrics`, the best checkpoint kept, early stopping, resuming with nothing left, and
`engine.save_pretrained` at stage 3 loaded back by `from_pretrained`."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _trainer_common import config, dataset, full_weights
from torch import nn

from shardwise.testing import run_distributed, run_subtests
from shardwise.trainer import EarlyStopping, Trainer, read_metrics

QUIET: dict[str, Any] = dict(progress=False)


def _mse(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(output, batch[-1])


class LrSeen:
    """The lr each step trained with: the engine's lr before the step."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_start(self, trainer: Trainer) -> None:
        self.lrs.append(trainer.engine.get_lr()[0])

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.lrs.append(metrics["lr"])


def _reference_linear(data: Any, lrs: list[float], global_batch: int, seed: int) -> dict[str, torch.Tensor]:
    """Plain torch, one process: the same Linear, data order (DistributedSampler's permutation) and lrs."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.01)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    for step, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data[order[step * global_batch:(step + 1) * global_batch]]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _model_and_config(root: str) -> None:
    # `nn.Linear` takes x only: with a loss_fn, a batch (x, y) passes x and leaves y to the loss.
    data = dataset(48)
    cfg = config(2, accumulation=1, gradient_clipping=None, scheduler={
        "type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.01, "total_num_steps": "auto"}})
    torch.manual_seed(0)
    seen = LrSeen()
    trainer = Trainer(nn.Linear(6, 4), data, config=cfg, max_steps=6, loss_fn=_mse, callbacks=[seen], **QUIET)
    summary = trainer.fit()
    assert trainer.engine.lr_scheduler.total_num_steps == 6, trainer.engine.lr_scheduler.total_num_steps
    assert seen.lrs[-1] == 0.0 and summary.steps == 6, (seen.lrs, summary)  # decayed to 0 at step 6: auto = 6
    got = full_weights(trainer.engine)
    want = _reference_linear(data, seen.lrs[:-1], global_batch=4, seed=0)
    for name, value in want.items():
        diff = (got[name] - value).abs().max().item()
        assert diff < 1e-6, f"{name}: Trainer(model, config) on 2 ranks differs from one process by {diff:.2e} (tol 1e-6)"
    trainer.engine.destroy()


def _record_density(root: str) -> None:
    # The config quiets the engine (`steps_per_print: 1000`); the Trainer still writes a record every 10 steps.
    metrics = f"{root}/metrics.jsonl"
    summary = Trainer(nn.Linear(6, 4), dataset(200), config=config(0, steps_per_print=1000), max_steps=25,
                      loss_fn=_mse, metrics_file=metrics, **QUIET).fit()
    if dist.get_rank() != 0:
        return
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == [10, 20, 25], records
    for record in records:
        for key in ("loss", "lr", "grad_norm", "samples_per_s", "step_time", "memory"):
            assert record.get(key) is not None, f"record at step {record['step']} lacks {key}: {record}"
    assert summary.plot == str(Path(metrics).with_suffix(".png"))
    assert Path(summary.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class Scripted:
    """``compute_metrics`` giving ``score`` from a script (one value per evaluation) and the real MSE."""

    def __init__(self, scores: list[float]) -> None:
        self.scores, self.calls, self.sizes = scores, 0, []

    def __call__(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        self.sizes.append((predictions.shape[0], labels.shape[0]))
        score = self.scores[min(self.calls, len(self.scores) - 1)]
        self.calls += 1
        return {"score": score, "mse": float(F.mse_loss(predictions, labels))}


def _linear_trainer(root: str, scores: list[float], **kwargs: Any) -> tuple[Trainer, Scripted]:
    torch.manual_seed(0)
    metric = Scripted(scores)
    trainer = Trainer(nn.Linear(6, 4), dataset(64), config=config(1), eval_data=dataset(22, seed=2), eval_every=2,
                      compute_metrics=metric, loss_fn=_mse, checkpoint_dir=f"{root}/ckpt", **QUIET, **kwargs)
    return trainer, metric


def _compute_metrics_and_best(root: str) -> None:
    trainer, metric = _linear_trainer(root, [5.0, 9.0, 3.0, 2.0], max_steps=8, keep_last=1, save_every=100,
                                      best_metric="score", greater_is_better=True,
                                      metrics_file=f"{root}/metrics.jsonl")
    summary = trainer.fit()
    assert metric.sizes == [(22, 22)] * 4, metric.sizes  # the whole eval set, both ranks' shares, every rank
    weights = full_weights(trainer.engine)
    x, y = dataset(22, seed=2).tensors
    want = F.mse_loss(x @ weights["weight"].T + weights["bias"], y).item()
    records = [r for r in read_metrics(f"{root}/metrics.jsonl") if "eval_loss" in r] if dist.get_rank() == 0 else []
    trainer.engine.destroy()
    assert abs(summary.eval_loss - want) < 1e-6, (summary.eval_loss, want)  # 2 ranks vs one process, tol 1e-6
    assert summary.best_metric == 9.0 and summary.best_checkpoint == f"{root}/ckpt/global_step4", summary
    kept = sorted(p.name for p in Path(f"{root}/ckpt").glob("global_step*"))
    assert kept == ["global_step4", "global_step8"], kept  # keep_last=1 plus the best
    assert Path(f"{root}/ckpt/best").read_text().strip() == "global_step4"
    if dist.get_rank() == 0:
        assert [r["eval_score"] for r in records] == [5.0, 9.0, 3.0, 2.0], records
        assert abs(records[-1]["eval_mse"] - want) < 1e-6, (records[-1], want)


def _early_stop(root: str) -> None:
    stop = EarlyStopping(metric="score", patience=2, greater_is_better=True)
    trainer, _ = _linear_trainer(root, [1.0, 2.0, 2.0, 2.0, 9.0], max_steps=40, callbacks=[stop])
    summary = trainer.fit()
    trainer.engine.destroy()
    assert summary.steps == 8 and (summary.stopped or "").startswith("early stopping"), summary


def _nothing_left(root: str) -> None:
    trainer, _ = _linear_trainer(root, [1.0], max_steps=4, metrics_file=f"{root}/metrics.jsonl")
    trainer.fit()
    trainer.engine.destroy()
    before = Path(f"{root}/metrics.jsonl").read_text() if dist.get_rank() == 0 else ""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        trainer, metric = _linear_trainer(root, [1.0], max_steps=4, metrics_file=f"{root}/metrics.jsonl")
        summary = trainer.fit()
    trainer.engine.destroy()
    assert summary.trained_steps == 0 and summary.steps == 4 and metric.calls == 0, summary
    if dist.get_rank() == 0:
        assert Path(f"{root}/metrics.jsonl").read_text() == before  # no second eval record
        assert "nothing to train" in shown.getvalue() and "raise it" in shown.getvalue(), shown.getvalue()


def _cases(root: str) -> None:
    run_subtests(lambda fn, name: fn(f"{root}/{name}"), [
        {"fn": _model_and_config, "name": "build"},
        {"fn": _record_density, "name": "density"},
        {"fn": _compute_metrics_and_best, "name": "best"},
        {"fn": _early_stop, "name": "early"},
        {"fn": _nothing_left, "name": "nothing"},
    ])


def test_trainer_builds_engine_logs_densely_keeps_best_stops_early_and_resumes_idle(tmp_path: Path) -> None:
    run_distributed(_cases, 2, args=(str(tmp_path),), timeout=240)


# ------------------------------------------------------------ HF export at stage 3

def _tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def _hf_round_trip(root: str) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in ids]
    cfg = config(3, accumulation=1, scheduler=None)
    trainer = Trainer(_tiny_gpt2(), data, config=cfg, max_steps=3, **QUIET)
    trainer.fit()
    engine = trainer.engine
    engine.eval()
    with torch.no_grad():
        want = engine(input_ids=ids[:2]).logits
    path = engine.save_pretrained(f"{root}/hf")
    if dist.get_rank() == 0:
        assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "model.safetensors"]
        loaded = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            got = loaded(input_ids=ids[:2]).logits
        diff = (got - want).abs().max().item()
        assert diff < 1e-6, f"from_pretrained logits differ from the stage-3 engine's by {diff:.2e} (tol 1e-6)"
    _export_round_trip(engine, root, path, ids, want)
    # A write that fails leaves nothing behind, and every rank hears of it.
    Path(f"{root}/taken").touch()
    try:
        engine.save_pretrained(f"{root}/taken")
        raise AssertionError("save_pretrained onto a file did not fail")
    except (FileExistsError, RuntimeError) as error:
        assert dist.get_rank() == 0 or "failed on rank 0" in str(error), error
    dist.barrier()
    assert sorted(p.name for p in Path(root).iterdir()) == ["hf", "taken"]  # no staging folder left
    engine.destroy()


def _export_round_trip(engine: Any, root: str, hf_dir: str, ids: torch.Tensor, want: torch.Tensor) -> None:
    """`shardwise checkpoint export --hf` of a stage-3 checkpoint, in one process, loads with the same logits."""
    from transformers import AutoModelForCausalLM

    from shardwise.cli.commands import main

    engine.save_checkpoint(f"{root}/ckpt")
    if dist.get_rank() == 0:
        assert main(["checkpoint", "export", "--hf", f"{root}/ckpt", f"{root}/bare"]) == 0
        assert sorted(os.listdir(f"{root}/bare")) == ["model.safetensors"]  # no config found: weights, and a hint
        assert main(["checkpoint", "export", "--hf", f"{root}/ckpt", f"{root}/exported", "--config", hf_dir]) == 0
        shutil.copyfile(f"{hf_dir}/config.json", f"{root}/ckpt/config.json")  # found beside the checkpoint
        assert main(["checkpoint", "export", "--hf", f"{root}/ckpt", f"{root}/found"]) == 0
        for folder in ("exported", "found"):
            loaded = AutoModelForCausalLM.from_pretrained(f"{root}/{folder}").eval()
            with torch.no_grad():
                diff = (loaded(input_ids=ids[:2]).logits - want).abs().max().item()
            assert diff < 1e-6, f"{folder}: exported logits differ from the stage-3 engine's by {diff:.2e}"
        assert main(["checkpoint", "export", "--hf", f"{root}/nothing", f"{root}/x"]) == 2
        for folder in ("bare", "exported", "found", "ckpt"):
            shutil.rmtree(f"{root}/{folder}")
    dist.barrier()


def test_save_pretrained_at_stage3_loads_with_from_pretrained(tmp_path: Path) -> None:
    run_distributed(_hf_round_trip, 2, args=(str(tmp_path),), timeout=240)
