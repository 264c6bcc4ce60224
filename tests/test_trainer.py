"""shardwise.Trainer on 2 gloo ranks: exact resume at every stage, collective decisions, data sharding, errors."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from _trainer_common import TinyNet, config, dataset, engine, full_weights
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from shardwise.testing import run_distributed, run_subtests
from shardwise.trainer import BatchError, Callback, ResumeError, TensorBoardCallback, Trainer, read_metrics
from shardwise.trainer.progress import make_progress

QUIET = dict(progress=False, log_every=100)


class StopAt(Callback):
    """Asks for a stop at ``step``, on one rank only."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if trainer.rank == self.rank and metrics["step"] == self.step:
            trainer.request_stop("test stop")


# ------------------------------------------------------------ exact resume

def _resume_case(root: str, stage: int, extra: dict[str, Any]) -> None:
    # 44 samples, 2 ranks x micro 2 x accumulation 2: 5 steps per epoch (one micro-batch per rank dropped).
    data = dataset(44)
    reference = engine(stage, **extra)
    want = Trainer(reference, data, max_steps=12, checkpoint_dir=f"{root}/ref", **QUIET).fit()
    want_weights = full_weights(reference)
    reference.destroy()
    chain = f"{root}/chain"
    # Stopped mid epoch 0 (step 3) and mid epoch 1 (step 7), by rank 1 alone; later runs start from
    # other initial weights, so only the checkpoint can make them agree.
    for seed, stop in ((0, 3), (5, 7)):
        part = engine(stage, seed=seed, **extra)
        summary = Trainer(part, data, max_steps=12, checkpoint_dir=chain, callbacks=[StopAt(stop, rank=1)], **QUIET).fit()
        assert summary.stopped == "test stop" and summary.steps == stop, summary
        part.destroy()
    last = engine(stage, seed=9, **extra)
    got = Trainer(last, data, max_steps=12, checkpoint_dir=chain, **QUIET).fit()
    got_weights = full_weights(last)
    last.destroy()
    assert (got.steps, got.trained_steps, got.epoch) == (12, 5, 2), got
    assert got.final_loss == want.final_loss, (got.final_loss, want.final_loss)
    for name, value in want_weights.items():
        assert torch.equal(got_weights[name], value), f"stage {stage} {extra}: {name} differs after resuming"


def _resume_every_stage(root: str) -> None:
    cases = [{"stage": s, "extra": {}} for s in (0, 1, 2, 3)]
    cases.append({"stage": 1, "extra": {"fp16": {"enabled": True, "initial_scale_power": 12}}})
    for i, case in enumerate(cases):
        case["root"] = f"{root}/{i}"
    run_subtests(_resume_case, cases)


def test_resume_mid_epoch_is_bit_exact_at_every_stage(tmp_path: Path) -> None:
    """Stopped twice (mid-epoch, by one rank's callback) and resumed: the same weights and loss bit for bit."""
    run_distributed(_resume_every_stage, 2, args=(str(tmp_path),), timeout=240)


# ------------------------------------------------------------ callbacks, eval, metrics

class Recorder(Callback):
    """Records hook calls; rank 0 alone asks for a save at step 2."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_train_start(self, trainer: Trainer) -> None:
        self.calls.append(("start", trainer.global_step))

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.calls.append(("step", metrics["step"]))
        if metrics["step"] == 2 and trainer.rank == 0:
            trainer.request_save()

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.calls.append(("eval", metrics["step"]))

    def on_save(self, trainer: Trainer, path: str) -> None:
        self.calls.append(("save", Path(path).name))

    def on_train_end(self, trainer: Trainer, summary: Any) -> None:
        self.calls.append(("end", summary.steps))


def _eval_reference(weights: dict[str, torch.Tensor], data: Any) -> float:
    model = TinyNet()
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        return float(model(*data.tensors).item())


def _callbacks_eval_metrics(root: str) -> None:
    eval_data = dataset(13, seed=7)  # 7 samples on rank 0 (4 micro-batches), 6 on rank 1 (3): uneven on purpose
    e = engine(3)
    recorder = Recorder()
    metrics = f"{root}/metrics.jsonl"
    summary = Trainer(e, dataset(40), max_steps=5, eval_data=eval_data, eval_every=3, checkpoint_dir=f"{root}/ck",
                      keep_last=2, callbacks=[recorder], metrics_file=metrics, progress=False, log_every=2).fit()
    weights = full_weights(e)
    assert recorder.calls == [("start", 0), ("step", 1), ("step", 2), ("save", "global_step2"), ("eval", 3),
                              ("step", 3), ("step", 4), ("step", 5), ("save", "global_step5"), ("eval", 5), ("end", 5)]
    # Evaluated over all 13 samples exactly once, as one process would (fp32, summation order: 1e-6).
    assert summary.eval_loss == pytest.approx(_eval_reference(weights, eval_data), rel=1e-6, abs=1e-7)
    if dist.get_rank() == 0:
        records = read_metrics(metrics)
        assert [r["step"] for r in records if "loss" in r] == [2, 4, 5]
        assert [r["step"] for r in records if "eval_loss" in r] == [3, 5]
        step = records[0]
        assert len(step["memory"]) == 2 and step["memory"][1]["optimizer_state"] > 0
        assert step["loss_scale"] == 1.0 and step["grad_norm"] > 0 and step["samples_per_s"] > 0
        assert Path(metrics).with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    e.destroy()
    # Resumed with a save every step: keep_last=2 leaves the newest two.
    e = engine(3, seed=4)
    Trainer(e, dataset(40), max_steps=8, checkpoint_dir=f"{root}/ck", save_every=1, keep_last=2,
            metrics_file=metrics, progress=False, log_every=2).fit()
    dist.barrier()
    assert sorted(p.name for p in Path(root, "ck").iterdir()) == ["global_step7", "global_step8", "latest"]
    if dist.get_rank() == 0:  # the resumed run kept the first run's records up to step 5
        assert [r["step"] for r in read_metrics(metrics) if "loss" in r] == [2, 4, 5, 6, 8]
    e.destroy()


def test_callbacks_collective_save_eval_and_metrics(tmp_path: Path) -> None:
    run_distributed(_callbacks_eval_metrics, 2, args=(str(tmp_path),), timeout=240)


# ------------------------------------------------------------ data sharding

def _one_process_reference(data: Any, steps: int, global_batch: int, seed: int) -> dict[str, torch.Tensor]:
    """Plain torch, one process: each step takes the next `global_batch` of the epoch's seeded permutation."""
    torch.manual_seed(0)
    model = TinyNet(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    per_epoch = (len(data) // 2 * 2) // global_batch
    for step in range(steps):
        epoch, position = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
        x, y = data[order[position * global_batch:(position + 1) * global_batch]]
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


class Numbers(IterableDataset):  # type: ignore[type-arg]
    """``n`` samples whose x holds the index; records the epochs it was asked for."""

    def __init__(self, n: int) -> None:
        self.n, self.epochs = n, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n):
            yield torch.full((6,), float(i)), torch.zeros(4)


class SeenIndices(Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []


def _sharding_cases(seed: int) -> None:
    # Map-style: 36 samples, 2 ranks x 2 x accumulation 2 = 8 per step, 4 steps per epoch; 6 steps cross an epoch.
    data = dataset(36)
    e = engine(0, dropout=0.0, scheduler=None, gradient_clipping=None)
    Trainer(e, data, max_steps=6, seed=seed, **QUIET).fit()
    got = full_weights(e)
    e.destroy()
    want = _one_process_reference(data, 6, 8, seed)
    for name, value in want.items():
        diff = (got[name] - value).abs().max().item()
        assert diff < 1e-5, f"{name}: the 2-rank trainer differs from one process by {diff:.2e} (tolerance 1e-5)"

    # Iterable, dealt out in turn: 19 items give rank 0 five micro-batches, rank 1 four; they agree on 4 steps.
    numbers = Numbers(19)
    seen: list[float] = []
    e = engine(2, accumulation=1, dropout=0.0)
    summary = Trainer(e, numbers, epochs=2, loss_fn=lambda out, batch: seen.extend(batch[0][:, 0].tolist()) or out,
                      **QUIET).fit()
    e.destroy()
    assert (summary.steps, summary.epoch, numbers.epochs) == (8, 2, [0, 1])
    assert all(int(i) % 2 == dist.get_rank() for i in seen) and len(seen) == 16

    # A DataLoader the user built (and sharded) is used as is; its sampler's epoch is set.
    sampler = DistributedSampler(dataset(20), shuffle=True, seed=3)
    loader = DataLoader(dataset(20), batch_size=2, sampler=sampler)
    e = engine(1)
    summary = Trainer(e, loader, epochs=2, **QUIET).fit()  # 5 micro-batches per rank -> 2 steps per epoch
    e.destroy()
    assert (summary.steps, sampler.epoch) == (4, 1)


def test_data_sharding_matches_one_process_and_every_source_kind() -> None:
    run_distributed(_sharding_cases, 2, args=(11,), timeout=180)


# ------------------------------------------------------------ bad input

class TupleNet(TinyNet):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:  # type: ignore[override]
        return self.fc2(self.fc1(x)), None


def _bad_input() -> None:
    e = engine(2)
    with pytest.raises(ValueError, match=r"pass `max_steps=N`.*`epochs=N`"):
        Trainer(e, dataset(40))
    with pytest.raises(ValueError, match=r"7 samples, fewer than one global batch.*2 x accumulation 2 x 2 rank\(s\) = 8"):
        Trainer(e, dataset(7), max_steps=1)
    with pytest.raises(ValueError, match="`eval_every=2` without `eval_data`"):
        Trainer(e, dataset(40), max_steps=1, eval_every=2)
    with pytest.raises(ValueError, match="give them to the `DataLoader"):
        Trainer(e, DataLoader(dataset(40)), max_steps=1, collate_fn=list)
    with pytest.raises(TypeError, match="has none of the hooks"):
        Trainer(e, dataset(40), max_steps=1, callbacks=[object()])
    three = torch.utils.data.TensorDataset(*dataset(16).tensors, torch.zeros(16, 3))
    with pytest.raises(BatchError, match=r"list\[tensor\(2, 6\) float32, tensor\(2, 4\) float32, tensor\(2, 3\) float32\]"):
        Trainer(e, three, max_steps=1, **QUIET).fit()
    e.destroy()
    torch.manual_seed(0)
    import shardwise

    tuple_engine = shardwise.initialize(TupleNet(), config=config(2))
    with pytest.raises(BatchError, match=r"no scalar loss.*loss_fn="):
        Trainer(tuple_engine, dataset(16), max_steps=1, **QUIET).fit()
    tuple_engine.destroy()


def _other_models_checkpoint(root: str) -> None:
    e = engine(2)
    Trainer(e, dataset(16), max_steps=1, checkpoint_dir=root, **QUIET).fit()
    e.destroy()
    import shardwise

    torch.manual_seed(0)
    other = shardwise.initialize(TinyNet(hidden=10), config=config(2))
    with pytest.raises(ResumeError, match=r"(?s)cannot resume from `checkpoint_dir`.*fc1\.weight.*new `checkpoint_dir`"):
        Trainer(other, dataset(16), max_steps=2, checkpoint_dir=root, **QUIET).fit()
    other.destroy()


def _errors(root: str) -> None:
    run_subtests(_bad_input, [{}])
    run_subtests(_other_models_checkpoint, [{"root": root}])


def test_bad_input_gets_clear_errors_on_every_rank(tmp_path: Path) -> None:
    run_distributed(_errors, 2, args=(str(tmp_path),), timeout=180)


# ------------------------------------------------------------ display (one process, no group)

class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_and_bar() -> None:
    record = {"step": 10, "epoch": 0, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 12345.0, "step_time": 0.5}
    lines = io.StringIO()
    shown = make_progress(0, True, lines)  # not a terminal: plain lines
    shown.start(100, 0)
    shown.log(record)
    assert lines.getvalue().strip() == "step  10/100 | epoch 0 | loss 2.5000 | lr 1.00e-03 | 12,345 tokens/s | eta 0m45s"
    terminal = _Terminal()
    bar = make_progress(0, True, terminal)
    bar.start(100, 0)
    bar.log(record)
    bar.step(record)
    bar.message("saved somewhere")
    bar.close()
    out = terminal.getvalue()
    assert "loss=2.5000" in out and "lr=1.00e-03" in out and "12,345 tokens/s" in out and "saved somewhere" in out
    assert "1/100" in out
    silent = io.StringIO()
    make_progress(1, True, silent).message("rank 1 says nothing")
    assert silent.getvalue() == ""


def test_tensorboard_callback_writes_scalars() -> None:
    class Writer:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []
            self.closed = False

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

        def close(self) -> None:
            self.closed = True

    class FakeTrainer:
        rank = 0

    writer = Writer()
    callback = TensorBoardCallback(writer=writer)
    callback.on_train_start(FakeTrainer())  # type: ignore[arg-type]
    callback.on_step_end(FakeTrainer(), {"step": 3, "loss": 1.5, "lr": 0.1, "grad_norm": None})  # type: ignore[arg-type]
    callback.on_eval_end(FakeTrainer(), {"step": 3, "eval_loss": 1.25})  # type: ignore[arg-type]
    callback.on_train_end(FakeTrainer(), None)  # type: ignore[arg-type]
    assert writer.scalars == [("train/loss", 1.5, 3), ("train/lr", 0.1, 3), ("eval/loss", 1.25, 3)]
    assert writer.closed


def test_metrics_file_keeps_records_up_to_the_resumed_step(tmp_path: Path) -> None:
    from shardwise.trainer.metrics import MetricsFile

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (2, 4, 6)) + '{"step": 8, "lo', encoding="utf-8")
    MetricsFile(str(path), enabled=True).start(resumed_from=4)
    assert [r["step"] for r in read_metrics(path)] == [2, 4]
    MetricsFile(str(path), enabled=True).start(resumed_from=None)
    assert read_metrics(path) == []
