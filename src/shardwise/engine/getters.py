"""DeepSpeed's engine getters and the pipeline calls a plain engine refuses: a part of :class:`~.Engine`.

Kept apart so that ``engine/engine.py`` reads as the training loop; every name here is DeepSpeed's, with its meaning.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm.distributed import Comm
from ..config import Config
from ..config.model import BatchSizes
from ..optim.precision import Precision, ZeroOptimizer

__all__ = ["DeepSpeedGetters"]


class DeepSpeedGetters:
    """Read-only facts about an engine, under DeepSpeed's names."""

    config: Config
    batch_sizes: BatchSizes
    precision: Precision
    optimizer: Optional[ZeroOptimizer]
    comm: Comm
    global_steps: int
    _step_applied: bool
    #: the DataLoader `shardwise.deepspeed.initialize` built over its `training_data` (None without one)
    training_dataloader: Optional[Any] = None

    @property
    def device(self) -> torch.device:
        """The device this rank trains on: ``cuda:<current device>`` under NCCL, else the CPU (a DeepSpeed script
        moves its batches with ``batch.to(engine.device)``)."""
        if self.comm.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks of this engine (its process group's size)."""
        return self.comm.world_size

    @property
    def global_samples(self) -> int:
        """Samples trained on over all ranks: optimizer steps × ``train_batch_size()``."""
        return self.global_steps * self.train_batch_size()

    def steps_per_print(self) -> int:
        """How often the engine logs its lr, loss scale and gradient norm (``steps_per_print``)."""
        return self.config.steps_per_print

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """The number of processes in the default process group."""
        return dist.get_world_size() if dist.is_initialized() else 1

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (micro batch × accumulation × data-parallel ranks)."""
        return self._batch_size("train_batch_size", self.batch_sizes.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward on one rank."""
        return self._batch_size("train_micro_batch_size_per_gpu", self.batch_sizes.micro_batch_size)

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches accumulated per optimizer step."""
        return self.batch_sizes.gradient_accumulation_steps

    def _batch_size(self, key: str, value: Optional[int]) -> int:
        if value is None:
            raise ValueError(
                f"`engine.{key}()` is unknown: the config sets no batch size; add "
                "`train_micro_batch_size_per_gpu` (or `train_batch_size`) to it"
            )
        return value

    def fp16_enabled(self) -> bool:
        return self.precision.dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.precision.dtype == torch.bfloat16

    def get_global_grad_norm(self) -> Optional[float]:
        """L2 norm of all (unscaled) gradients at the last step (inf on overflow); None before any step."""
        return self.optimizer.last_grad_norm if self.optimizer is not None else None

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage this engine runs (0-3), as DeepSpeed's getter."""
        return self.config.zero_optimization.stage

    def gradient_clipping(self) -> float:
        """The configured gradient-norm clip (0.0: off)."""
        return self.config.gradient_clipping

    def was_step_applied(self) -> bool:
        """Whether the last optimizer update at a boundary changed the weights (False after an fp16 overflow)."""
        return self._step_applied

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """A pipeline engine's call (``shardwise.pipe``); here an error naming the calls to use."""
        raise RuntimeError(_not_a_pipeline("train_batch"))

    def eval_batch(self, data_iter: Any = None) -> torch.Tensor:
        """A pipeline engine's call (``shardwise.pipe``); here an error naming the calls to use."""
        raise RuntimeError(_not_a_pipeline("eval_batch"))


def _not_a_pipeline(call: str) -> str:
    return (
        f"`engine.{call}(data_iter)` is for pipeline engines, and this is not a pipeline engine (its model is not "
        "a `shardwise.pipe.PipelineModule` with `num_stages > 1` on several ranks): train with "
        "`loss = engine(inputs, labels)`, `engine.backward(loss)`, `engine.step()`"
        + ("" if call == "train_batch" else "; evaluate with `engine.eval()` and `engine(inputs, labels)`")
    )
