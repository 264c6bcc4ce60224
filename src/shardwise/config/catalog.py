"""DeepSpeed's config keys that shardwise does not implement, one entry each, and DeepSpeed's aliases.

The policy (DESIGN.md) in table form; a key shardwise implements is a field of a section model (`sections.py`) instead.
A *knob* (no `feature`) is accepted whatever its value: it tunes something with no meaning here, or asks for what
shardwise always does (its `reason` ends the info line). A *switch* (`feature` set) is accepted while `is_off(value)`
holds, and is an error naming `feature` and the `fix` otherwise. Learned from DeepSpeed's own schema (its
`runtime/config.py`, `constants.py` and the zero, offload, precision, monitor and profiler configs); wording ours.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ALIASES", "CATALOG", "OFFLOAD_KEYS", "Alias", "Entry", "is_auto"]


def is_auto(value: Any) -> bool:
    """Hugging Face's placeholder for "fill this in from what you know"."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def _false(value: Any) -> bool:
    """Off: false, 0, null, "none", or `auto` (DeepSpeed reads `auto` as its default, which is off)."""
    if is_auto(value) or value is None:
        return True
    if isinstance(value, str):
        return value.strip().lower() in ("", "none", "false", "0")
    return not value


def _disabled(value: Any) -> bool:
    """Off: a section whose `enabled` is false or absent (or no section at all)."""
    if isinstance(value, Mapping):
        return _false(value.get("enabled", False))
    return _false(value)


def _empty(value: Any) -> bool:
    """Off: a section that is absent, null or has nothing in it."""
    return _false(value) or (isinstance(value, Mapping) and not value)


def _all_false(value: Any) -> bool:
    """Off: every setting in the section is false, null, zero or empty."""
    if isinstance(value, Mapping):
        return all(_all_false(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return not value
    return _false(value)


def _at_most(limit: int) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if _false(value):
            return True
        try:
            return float(value) <= limit
        except (TypeError, ValueError):
            return False

    return check


def _checkpointing_off(value: Any) -> bool:
    """DeepSpeed's activation checkpointing is off when its switches are; `number_checkpoints` only tunes."""
    if not isinstance(value, Mapping):
        return _false(value)
    return all(_false(v) for k, v in value.items() if k != "number_checkpoints")


def _key_off(key: str, is_off: Callable[[Any], bool] = _false) -> Callable[[Any], bool]:
    """Off: a section whose `key` is off, absent, or no section at all."""
    return lambda value: not isinstance(value, Mapping) or is_off(value.get(key, 0))


@dataclass(frozen=True)
class Entry:
    """One DeepSpeed key shardwise does not implement (see the module docstring)."""

    reason: str
    feature: str | None = None
    is_off: Callable[[Any], bool] = _false  # a knob is never asked
    fix: str = "remove it"


def knob(reason: str) -> Entry:
    """A key accepted whatever its value: `reason` says why it changes nothing here."""
    return Entry(reason)


def switch(feature: str, is_off: Callable[[Any], bool] = _false, fix: str = "remove it or set it to false",
           reason: str = "") -> Entry:
    """A key accepted while it leaves `feature` off, and an error when it turns it on.

    `reason`, when given, replaces the generic "leaves FEATURE off" in the info line.
    """
    return Entry(reason, feature, is_off, fix)


def _section(feature: str, fix: str = "remove it or set `enabled: false`") -> Entry:
    return switch(feature, _disabled, fix)


_MONITOR_FIX = "remove it or set `enabled: false`; the `shardwise` logger reports lr, loss scale and grad norm"
_ALWAYS_FP32 = ("shardwise reduces gradients in fp32 after dividing them by the world size (folded into the loss "
                "scale, see docs/zero.md), so every setting gives the same average")
_BF16_NO_SCALING = "bf16 needs no loss scaling (older DeepSpeed read fp16's keys here and ignored them)"
_CASTS_INPUTS = ("shardwise always casts floating inputs to the compute dtype; `false` only means the caller "
                 "casts them, which still works")
_STAGE3_DETAIL = "a detail of DeepSpeed's stage-3 implementation with no counterpart in shardwise's"
_OFFLOAD_ONLY = ("it tunes how DeepSpeed's ZeRO-Offload moves and steps the state; shardwise copies each bucket "
                 "or unit to host memory as it lands (pinned with `offload_optimizer.pin_memory`) and steps it with "
                 "the torch optimizer given (docs/offload.md)")

#: dotted path (from the config's top level) -> entry.
CATALOG: dict[str, Entry] = {
    # ---- top level
    "prescale_gradients": knob(_ALWAYS_FP32),
    "gradient_predivide_factor": knob(_ALWAYS_FP32),
    "gradient_allreduce_op": switch(
        "summing gradients over ranks instead of averaging them",
        lambda value: _false(value) or str(value).strip().lower() == "mean",
        "remove it or set it to `mean`", "`mean` is what shardwise always does"),
    "zero_allow_untested_optimizer": knob(
        "a permission flag; shardwise shards any element-wise torch optimizer without one"),
    "zero_force_ds_cpu_optimizer": knob(_OFFLOAD_ONLY),
    "seq_parallel_communication_data_type": knob(
        "shardwise has no sequence parallelism (DeepSpeed-Ulysses), so no such communication to set a dtype for"),
    "sparse_gradients": switch("sparse gradient reduction for `nn.Embedding(sparse=True)`"),
    "disable_allgather": knob("a deprecated DeepSpeed flag that no longer does anything"),
    "dump_state": switch("DeepSpeed's dump of the engine state at start"),
    "memory_breakdown": switch(
        "DeepSpeed's memory printout", fix="remove it; `engine.memory_breakdown()` returns the per-rank bytes"),
    "vocabulary_size": knob("DeepSpeed uses it only for a tensor-core alignment warning"),
    "log_level": knob("set the level of the `shardwise` logger with Python's `logging` instead"),
    "use_data_before_expert_parallelism": knob("a mixture-of-experts group layout; shardwise has no expert parallelism"),
    "graph_harvesting": switch("CUDA graph harvesting"),
    "amp": _section("NVIDIA Apex AMP", "remove it and use `fp16` or `bf16`"),
    "torch_autocast": _section("torch.autocast mixed precision", "remove it and use `fp16` or `bf16`"),
    "activation_checkpointing": switch(
        "DeepSpeed's activation checkpointing (partitioned, CPU or contiguous activations)", _checkpointing_off,
        "remove it and checkpoint with `torch.utils.checkpoint` in the model"),
    "flops_profiler": _section("the FLOPs profiler"),
    "tensorboard": _section("the TensorBoard monitor", _MONITOR_FIX),
    "wandb": _section("the Weights & Biases monitor", _MONITOR_FIX),
    "csv_monitor": _section("the CSV monitor", _MONITOR_FIX),
    "comet": _section("the Comet monitor", _MONITOR_FIX),
    "comms_logger": _section(
        "the communication logger", "remove it or set `enabled: false`; `engine.comm.bytes_sent` counts every collective"),
    "hybrid_engine": _section("the RLHF hybrid engine"),
    "elasticity": _section("elastic training"),
    "autotuning": _section("the autotuner"),
    "eigenvalue": _section("eigenvalue computation"),
    "progressive_layer_drop": _section("progressive layer drop"),
    "curriculum_learning": _section("legacy curriculum learning"),
    "data_efficiency": _section("data efficiency (curriculum learning, random-LTD)"),
    "nebula": _section("Nebula checkpointing"),
    "compression_training": switch("compression training", _empty, "remove it"),
    "sparse_attention": switch("sparse attention", _empty, "remove it"),
    "weight_quantization": switch("weight quantization", _empty, "remove it"),
    "compile": switch("DeepCompile", _key_off("deepcompile"), "remove it or set `deepcompile: false`"),
    "tensor_parallel": switch(
        "tensor parallelism (AutoTP)", _key_off("autotp_size", _at_most(1)), "remove it or set `autotp_size` to 1"),
    "data_types": switch("choosing the gradient-accumulation, parameter or buffer dtype", _all_false, "remove it"),
    "pipeline": knob("settings of DeepSpeed's pipeline engine, which apply only to a DeepSpeed PipelineModule"),
    "aio": knob("it tunes DeepSpeed's async-I/O library; shardwise's NVMe offload reads ahead and writes behind "
                "with its own threads, `offload_optimizer.buffer_count` sub-groups and `offload_param.buffer_count` "
                "shards deep"),
    "timers": knob("DeepSpeed's throughput timers; `wall_clock_breakdown` times shardwise's phases"),
    # ---- checkpoint
    "checkpoint.tag_validation": knob(
        "shardwise always compares tags across ranks and fails on a mismatch (DeepSpeed's `Fail`)"),
    "checkpoint.load_universal": switch("loading DeepSpeed universal checkpoints (shardwise's own reshard as they load)"),
    "checkpoint.use_node_local_storage": switch("node-local checkpoint storage"),
    "checkpoint.parallel_write": switch(
        "parallel checkpoint writes per pipeline stage", _all_false, "remove it or set `pipeline_stage: false`"),
    # ---- fp16 / bf16
    "fp16.auto_cast": knob(_CASTS_INPUTS),
    "fp16.fp16_master_weights_and_grads": switch("fp16 master weights and gradients (shardwise keeps fp32 masters)"),
    "bf16.auto_cast": knob(_CASTS_INPUTS),
    "bf16.immediate_grad_update": knob("shardwise applies gradients at the accumulation boundary in one step"),
    "bf16.check_grad_overflow": knob(
        "shardwise always skips a step whose gradients hold inf or NaN; the check rides on the gradient norm"),
    "bf16.bf16_master_weights_and_grads": switch("bf16 master weights and gradients (shardwise keeps fp32 masters)"),
    "bf16.bf16_optimizer_states": switch("bf16 optimizer states"),
    **{f"bf16.{key}": knob(_BF16_NO_SCALING) for key in (
        "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
        "min_loss_scale")},
    # ---- zero_optimization
    "zero_optimization.allgather_partitions": knob("shardwise always all-gathers the updated partitions"),
    "zero_optimization.allgather_bucket_size": knob(
        "parameters are gathered back per reduce bucket (one layout), so `reduce_bucket_size` sets both"),
    "zero_optimization.overlap_comm": knob("reductions always overlap backward (asynchronous, launched from hooks)"),
    "zero_optimization.contiguous_gradients": knob("gradients always live in contiguous flat buffers"),
    "zero_optimization.use_multi_rank_bucket_allreduce": knob("a DeepSpeed bucketing detail"),
    "zero_optimization.load_from_fp32_weights": knob(
        "shardwise checkpoints always hold the fp32 master weights, and loading uses them"),
    "zero_optimization.elastic_checkpoint": knob("shardwise checkpoints always load at any world size and stage"),
    "zero_optimization.cpu_offload_use_pin_memory": knob(_OFFLOAD_ONLY),
    "zero_optimization.round_robin_gradients": knob(_OFFLOAD_ONLY),
    "zero_optimization.ignore_unused_parameters": knob(
        "shardwise reduces zeros for unused parameters at every stage and never fails on them"),
    "zero_optimization.legacy_stage1": knob("it picks between two DeepSpeed stage-1 implementations"),
    "zero_optimization.zero_hpz_partition_size": switch(
        "ZeRO++ hierarchical partitioning", _at_most(1), "remove it or set it to 1"),
    "zero_optimization.zero_quantized_weights": switch("ZeRO++ quantized weights"),
    "zero_optimization.zero_quantized_nontrainable_weights": switch("ZeRO++ quantized frozen weights"),
    "zero_optimization.zero_quantized_gradients": switch("ZeRO++ quantized gradients"),
    "zero_optimization.zeropp_loco_param": switch("LoCo-ZeRO++", _empty, "remove it"),
    "zero_optimization.mics_shard_size": switch("MiCS sharding", _at_most(0), "remove it or set it to -1"),
    "zero_optimization.mics_hierarchical_params_gather": switch("MiCS hierarchical gathering"),
    "zero_optimization.leaf_module": switch("ZeRO-3 leaf modules", _all_false, "remove it"),
    "zero_optimization.zenflow": switch("ZenFlow", _empty, "remove it"),
    **{f"zero_optimization.{key}": knob(_STAGE3_DETAIL) for key in (
        "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
        "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
        "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential")},
    "zero_optimization.stage3_model_persistence_threshold": knob(
        "shardwise decides persistence per unit with `stage3_param_persistence_threshold` alone"),
}

#: DeepSpeed's offload section settings; all but `device` tune the offload itself.
OFFLOAD_KEYS = frozenset({
    "device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory", "pipeline_read",
    "pipeline_write", "pipeline", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc",
})


def _offload_device(value: Any) -> dict[str, Any]:
    """DeepSpeed's deprecated `cpu_offload: true` / `cpu_offload_param: true` as the section they stand for."""
    return {"device": "none" if _false(value) else "cpu"}


@dataclass(frozen=True)
class Alias:
    """A legacy or alternative DeepSpeed name, read as `name` (with its value converted when needed)."""

    name: str
    convert: Callable[[Any], Any] | None = None


_STAGE3_SHORT = (
    "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "model_persistence_threshold", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)

#: (dotted path of the section, "" for the top level) -> {alias: canonical}.
ALIASES: dict[str, dict[str, Alias]] = {
    "": {"bfloat16": Alias("bf16")},
    "zero_optimization": {
        "stage3_gather_fp16_weights_on_model_save": Alias("stage3_gather_16bit_weights_on_model_save"),
        "gather_16bit_weights_on_model_save": Alias("stage3_gather_16bit_weights_on_model_save"),
        "cpu_offload": Alias("offload_optimizer", _offload_device),
        "cpu_offload_param": Alias("offload_param", _offload_device),
        # DeepSpeed's field names; its JSON keys carry the `stage3_` prefix.
        **{short: Alias(f"stage3_{short}") for short in _STAGE3_SHORT},
    },
}
