"""The rank side of tests/test_lightning.py: ShardwiseStrategy under Lightning's own Trainer on 2 gloo ranks.

Imported in the ranks only, so the pytest process never imports Lightning. Each part runs its cases with
`run_subtests`; :func:`run_parts` runs the parts one after another in one launch (Lightning's import
costs each rank several seconds, more than all the training here) and reports each part's outcome.

Lightning runs in the harness's already-launched ranks: `TORCHELASTIC_RUN_ID` (which torchrun sets) makes
it detect a torchelastic launch and use the ranks and the process group it finds; it spawns nothing.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _parity import ParityNet
from lightning.pytorch.callbacks import BaseFinetuning, Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardwise.lightning
from shardwise.lightning import ShardwiseStrategy, convert_zero_checkpoint_to_fp32_state_dict
from shardwise.optim.schedulers import build_scheduler
from shardwise.testing import run_subtests
from shardwise.zero.stage3.params import is_partitioned

LR = 1e-2
CLIP = 0.3
SAMPLES, BATCH = 40, 4  # 5 batches per rank and epoch: with accumulation 2, the last one steps alone


class ParityMethods:
    """ParityNet (tests/_parity.py) as a LightningModule, built in `configure_model` unless `eager`; a mixin,
    for `lightning.pytorch`'s LightningModule and for `pytorch_lightning`'s."""

    hparams: Any
    log: Any
    optimizers: Any
    manual_backward: Any

    def __init__(self, head_only: bool = False, scheduler: bool = True, eager: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()  # type: ignore[attr-defined]
        self.net: Optional[ParityNet] = None
        self.built_partitioned = False
        if eager:
            self.configure_model()

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            self.net = ParityNet()
            self.built_partitioned = is_partitioned(self.net.embed.weight)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.net(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.net(*batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.net(*batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad] if self.hparams.head_only else self.parameters()
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
        if not self.hparams.scheduler:
            return optimizer
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LitParity(ParityMethods, pl.LightningModule):
    pass


class LitManual(LitParity):
    """Manual optimization: two backwards, then one step."""

    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = self.net(*batch)
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
        return loss


class GradNorms(Callback):
    """The global gradient norm (before clipping) each optimizer step saw."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(trainer.strategy, ShardwiseStrategy):
            norm = trainer.strategy.engine.get_global_grad_norm()
            if norm is not None:
                self.norms.append(float(norm))


class UnfreezeBackbone(BaseFinetuning):
    """Freezes embed and fc1 before training, adds them (lr / 4) at epoch 1."""

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze([pl_module.net.embed, pl_module.net.fc1])

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group([pl_module.net.embed, pl_module.net.fc1], optimizer, initial_denom_lr=4.0)


def _dataset(samples: int = SAMPLES) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, 64, (samples, 6), generator=gen), torch.randn(samples, 8, generator=gen))


def _loader(samples: int = SAMPLES) -> DataLoader[Any]:
    return DataLoader(_dataset(samples), batch_size=BATCH)  # Lightning shards it: DistributedSampler, in order


def _trainer(strategy: Any, package: Any = pl, **options: Any) -> Any:
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and loggers
    settings: dict[str, Any] = dict(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                                    enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    return package.Trainer(strategy=strategy, **{**settings, **options})


def _params(trainer: Any, module: Any) -> dict[str, torch.Tensor]:
    """The trained weights on rank 0 ({} on the others; collective)."""
    if isinstance(trainer.strategy, ShardwiseStrategy):
        return trainer.strategy.engine.full_state_dict()
    state = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    return state if dist.get_rank() == 0 else {}


def _fit(strategy: Any, module: Any = None, ckpt_path: Optional[str] = None, package: Any = pl,
         **options: Any) -> tuple[Any, Any]:
    module = module if module is not None else LitParity()
    trainer = _trainer(strategy, package, **options)
    trainer.fit(module, _loader(), _loader(16), ckpt_path=ckpt_path)
    return trainer, module


# ----------------------------------------------------------------- against DDPStrategy
_RUN = dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=CLIP)


def _reference() -> dict[str, Any]:
    trainer, module = _fit(DDPStrategy(), **_RUN)
    return {"params": _params(trainer, module), "val": trainer.callback_metrics["val_loss"],
            "test": trainer.test(module, _loader(16))[0]["test_loss"],
            "predict": trainer.predict(module, _loader(8))}


def _parity_case(stage: int, reference: dict[str, Any]) -> None:
    norms = GradNorms()
    trainer, module = _fit(ShardwiseStrategy(stage=stage), callbacks=[norms], **_RUN)
    got = _params(trainer, module)
    if dist.get_rank() == 0:
        assert_close(got, reference["params"], atol=1e-5, rtol=0)
    assert_close(trainer.callback_metrics["val_loss"], reference["val"], atol=1e-5, rtol=0)
    assert trainer.global_step == 6, trainer.global_step  # 2 epochs of 5 batches: steps after 2, 4, 5
    assert max(norms.norms) > CLIP, f"clipping never acted (norms {norms.norms}); the case would not test it"
    assert module.built_partitioned == (stage == 3), "configure_model runs under zero.Init at stage 3 only"
    if stage in (1, 3):  # the other loops, on an inference engine built for each
        assert_close(trainer.test(module, _loader(16))[0]["test_loss"], reference["test"], atol=1e-5, rtol=0)
        assert_close(trainer.predict(module, _loader(8)), reference["predict"], atol=1e-5, rtol=0)


def _manual_case() -> None:
    want = _params(*_fit(DDPStrategy(), LitManual(), max_epochs=1))
    got = _params(*_fit(ShardwiseStrategy(stage=2), LitManual(), max_epochs=1))
    if dist.get_rank() == 0:
        assert_close(got, want, atol=1e-5, rtol=0)


_SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 4}}


class _ConfiguredHere(LitParity):
    """The optimizer and schedule the config below describes, built by hand."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        schedule = build_scheduler({**_SCHEDULE, "deepspeed_start": True}, optimizer)  # the DeepSpeed dialect's start
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class _ConfiguredThere(LitParity):
    def configure_optimizers(self) -> Any:
        return None  # as for DeepSpeedStrategy: the config's sections


def _config_sections_case() -> None:
    """`optimizer` and `scheduler` sections in the strategy's config train as the same objects built by hand."""
    want = _params(*_fit(DDPStrategy(), _ConfiguredHere(), **_RUN))
    config = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}, "scheduler": _SCHEDULE}
    got = _params(*_fit(ShardwiseStrategy(stage=2, config=config), _ConfiguredThere(), **_RUN))
    if dist.get_rank() == 0:
        assert_close(got, want, atol=1e-5, rtol=0)


class _TwoOptimizers(LitManual):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net.embed.parameters(), lr=LR), torch.optim.SGD(self.net.head.parameters(), lr=LR)]


class _OwnBackward(LitParity):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward()


def _refused_case(module: str, options: dict[str, Any], match: str) -> None:
    lit = {"two": _TwoOptimizers, "backward": _OwnBackward, "plain": LitParity}[module]()
    with pytest.raises(ValueError, match=match):
        _fit(ShardwiseStrategy(stage=2), lit, max_steps=1, **options)


def parity(root: Path) -> None:
    """fp32, accumulation 2 (the epoch's last batch steps alone), clipping, a step-interval LR schedule,
    validation and test logged with sync_dist, predict: stages 0-3 against Lightning's DDPStrategy; manual
    optimization; what the strategy refuses."""
    reference = _reference()
    run_subtests(_parity_case, [{"stage": s, "reference": reference} for s in (0, 1, 2, 3)])
    run_subtests(_manual_case, [{}])
    run_subtests(_config_sections_case, [{}])
    run_subtests(_refused_case, [
        {"module": "two", "options": {}, "match": "returned 2 optimizers"},
        {"module": "backward", "options": {}, "match": "backward` is overridden"},
        {"module": "plain", "options": {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
         "match": "clips by global norm"},
        {"module": "plain", "options": {"precision": "64-true"}, "match": "precision='64-true'"},
    ])


# ------------------------------------------------------- checkpoints: resume, rank 0 alone, consolidation
def _resume_case(root: str, save_stage: int, load_stage: int) -> None:
    where = Path(root) / f"{save_stage}-{load_stage}"
    straight, straight_module = _fit(ShardwiseStrategy(stage=save_stage), max_epochs=3, accumulate_grad_batches=2)
    want = _params(straight, straight_module)
    first, first_module = _fit(ShardwiseStrategy(stage=save_stage, config={"checkpoint": {"timeout": 4}}),
                               max_epochs=1, accumulate_grad_batches=2)
    first.save_checkpoint(where / "epoch1.ckpt")
    if save_stage == load_stage:
        _rank0_alone(first, where / "alone.ckpt")
    first_test = first.test(first_module, _loader(16))[0]["test_loss"]
    second, second_module = _fit(ShardwiseStrategy(stage=load_stage), max_epochs=3, accumulate_grad_batches=2,
                                 ckpt_path=str(where / "epoch1.ckpt"))
    got = _params(second, second_module)
    assert second.global_step == straight.global_step == 9, (second.global_step, straight.global_step)
    lr = [g["lr"] for g in second.optimizers[0].param_groups]
    assert lr == [g["lr"] for g in straight.optimizers[0].param_groups], lr
    if dist.get_rank() == 0:
        # the same stage reduces in the same order (bit-exact); another stage in another one
        assert_close(got, want, atol=0 if save_stage == load_stage else 1e-6, rtol=0)
        _consolidated(where / "epoch1.ckpt", where / "epoch1-fp32.ckpt")
    dist.barrier()  # the consolidated file is there for every rank
    # `test` from the directory and from the consolidated file, on an inference engine at the other stage
    tested = _trainer(ShardwiseStrategy(stage=load_stage))
    from_dir = tested.test(LitParity(), _loader(16), ckpt_path=str(where / "epoch1.ckpt"))[0]["test_loss"]
    from_file = tested.test(LitParity(), _loader(16), ckpt_path=str(where / "epoch1-fp32.ckpt"))[0]["test_loss"]
    assert_close([from_dir, from_file], [first_test] * 2, atol=1e-6, rtol=0)


def _rank0_alone(trainer: Any, path: Path) -> None:
    """`trainer.save_checkpoint` on rank 0 only fails there, naming rank 1, within `checkpoint.timeout` (4 s)."""
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not call it"):
            trainer.save_checkpoint(path)
    dist.barrier()
    trainer.save_checkpoint(path)  # both ranks again: the next call pairs up


def _consolidated(directory: Path, out: Path) -> None:
    """The consolidated file loads with `load_from_checkpoint` and holds what the run's engine held."""
    state = convert_zero_checkpoint_to_fp32_state_dict(directory, out)
    assert state["global_step"] == 3, state["global_step"]
    loaded = LitParity.load_from_checkpoint(out)
    assert loaded.hparams.scheduler is True and loaded.net is not None
    want = {k: v for k, v in torch.load(out, weights_only=True)["state_dict"].items()}
    assert_close({k: v.detach() for k, v in loaded.state_dict().items()}, want, atol=0, rtol=0)


def resume(root: Path) -> None:
    """`trainer.save_checkpoint` after one epoch and `fit(ckpt_path=...)` to epoch 3 equal 3 straight epochs, at
    one stage and resharded from stage 1 to 3; a save on rank 0 alone errors instead of hanging; the directory
    consolidates to a file `LightningModule.load_from_checkpoint` reads."""
    run_subtests(_resume_case, [{"root": str(root), "save_stage": 2, "load_stage": 2},
                                {"root": str(root), "save_stage": 1, "load_stage": 3}])


# ------------------------------------------------------------ BaseFinetuning against one process
def _one_process(epochs: int) -> dict[str, torch.Tensor]:
    """Both ranks' batches, in the order Lightning's DistributedSampler gives them (it shuffles a training
    loader, seed 0, a new order each epoch), in one process."""
    torch.manual_seed(0)
    net = ParityNet()
    backbone = [*net.embed.parameters(), *net.fc1.parameters()]
    for param in backbone:
        param.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    data = _dataset()
    samplers = [DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1)]
    for epoch in range(epochs):
        if epoch == 1:
            for param in backbone:
                param.requires_grad_(True)
            optimizer.add_param_group({"params": backbone, "lr": LR / 4})
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(torch.tensor(list(sampler)).split(BATCH))
        for step in range(len(orders[0])):
            loss = sum(net(*data[order[step]]) for order in orders) / 2
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def _finetuning(strategy: Any) -> dict[str, torch.Tensor]:
    module = LitParity(head_only=True, scheduler=False, eager=True)
    return _params(*_fit(strategy, module, max_epochs=3, callbacks=[UnfreezeBackbone()]))


def finetuning(root: Path) -> Optional[float]:
    """BaseFinetuning freezes the backbone and adds it as a param group at epoch 1: stages 2 and 3 train as one
    process over both ranks' batches. Lightning's DDPStrategy does not (it never reduces a parameter frozen when
    it wrapped the model); returns its largest distance to the one-process run (rank 0)."""
    want = _one_process(3)

    def case(stage: int) -> None:
        got = _finetuning(ShardwiseStrategy(stage=stage))
        if dist.get_rank() == 0:
            assert_close(got, want, atol=1e-5, rtol=0)

    run_subtests(case, [{"stage": 2}, {"stage": 3}])
    ddp = _finetuning(DDPStrategy())
    return max((ddp[k] - want[k]).abs().max().item() for k in want) if dist.get_rank() == 0 else None


# ------------------------------------------------------------------- the `pytorch_lightning` name
def pytorch_lightning(root: Path) -> None:
    """The same strategy for `pytorch_lightning`'s Trainer: by registry name (resolved in that package's own
    registry) and built for it explicitly, against that package's DDPStrategy; with both packages imported,
    a plain `ShardwiseStrategy(...)` asks which one."""
    import pytorch_lightning as ptl

    shardwise.lightning.register()  # imported after shardwise.lightning: its registry gets the names now
    module_class = type("PtlParity", (ParityMethods, ptl.LightningModule), {})
    options: dict[str, Any] = dict(package=ptl, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=CLIP)
    want = _params(*_fit(ptl.strategies.DDPStrategy(), module_class(), **options))

    def case(strategy: Any) -> None:
        trainer, module = _fit(strategy, module_class(), **options)
        assert isinstance(trainer.strategy, ShardwiseStrategy) and isinstance(trainer.strategy, ptl.strategies.Strategy)
        got = _params(trainer, module)
        if dist.get_rank() == 0:
            assert_close(got, want, atol=1e-5, rtol=0)

    run_subtests(case, [{"strategy": "shardwise_stage_3"},
                        {"strategy": ShardwiseStrategy.built_for("pytorch_lightning")(stage=2)}])
    with pytest.raises(RuntimeError, match="both `lightning` and `pytorch_lightning` are imported"):
        ShardwiseStrategy(stage=2)


PARTS: dict[str, Callable[[Path], Any]] = {
    "parity": parity, "resume": resume, "finetuning": finetuning, "pytorch_lightning": pytorch_lightning}


def run_parts(root: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Run the parts ``names`` in order; each one's return value, or the traceback it raised."""
    outcomes: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            outcomes[name] = {"value": PARTS[name](Path(root) / name), "error": None}
        except Exception:  # noqa: BLE001 - reported by the test of that part
            outcomes[name] = {"value": None, "error": traceback.format_exc()}
        dist.barrier()
    return outcomes
