"""ZeRO stages 1 and 2: parity with torch DDP, uneven sizes, overflow, and per-rank bytes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _parity import assert_close_params, batch, make_model, params_of
from torch import nn

import shardwise
from shardwise.testing import distributed_test, run_distributed, run_subtests


def _groups(model: nn.Module, split: bool) -> Any:
    if not split:
        return model.parameters()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "lr": 1e-2, "weight_decay": 0.1}, {"params": no_decay, "lr": 3e-3, "weight_decay": 0.0}]


def _opt(model: nn.Module, split: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_groups(model, split), lr=1e-2, weight_decay=0.1)


def _ddp_run(steps: int, micro: int, clip: float, split: bool) -> dict[str, torch.Tensor]:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = _opt(model, split)
    rank = dist.get_rank()
    for step in range(steps):
        for m in range(micro):
            idx, target = batch(step * micro + m, rank)
            if m < micro - 1:
                with ddp.no_sync():
                    (ddp(idx, target) / micro).backward()
            else:
                (ddp(idx, target) / micro).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return params_of(model)


def _engine_run(
    stage: int, steps: int, micro: int, clip: float, split: bool, bucket: int, reduce_scatter: bool = True
) -> dict[str, torch.Tensor]:
    model = make_model()
    config = {
        "gradient_accumulation_steps": micro,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "reduce_scatter": reduce_scatter},
    }
    engine = shardwise.initialize(model, _opt(model, split), config)
    rank = dist.get_rank()
    for step in range(steps * micro):
        idx, target = batch(step, rank)
        engine.backward(engine(idx, target))
        engine.step()
    engine.destroy()
    return params_of(model)


@distributed_test(world_size=2, timeout=240)
def test_stages_1_2_match_ddp() -> None:
    """fp32, AdamW, 5 steps: every stage equals torch DDP within atol 1e-6."""
    references: dict[tuple[int, float, bool], dict[str, torch.Tensor]] = {}

    def case(stage: int, micro: int, clip: float, split: bool, bucket: int, rs: bool) -> None:
        key = (micro, clip, split)
        if key not in references:
            references[key] = _ddp_run(5, micro, clip, split)
        got = _engine_run(stage, 5, micro, clip, split, bucket, reduce_scatter=rs)
        assert_close_params(got, references[key], atol=1e-6)

    cases = [
        {"stage": s, "micro": m, "clip": c, "split": g, "bucket": b, "rs": True}
        for s in (1, 2)
        for (m, c, g, b) in [(1, 0.0, False, 500), (3, 0.0, False, 500), (1, 0.05, False, 10**6), (3, 0.05, True, 300)]
    ]
    # `reduce_scatter: false` averages with all-reduce instead (DeepSpeed's meaning)
    cases += [{"stage": s, "micro": 3, "clip": 0.05, "split": True, "bucket": 300, "rs": False} for s in (1, 2)]
    run_subtests(case, cases)


class Uneven(nn.Module):
    """One large embedding and many small biases: the case that unbalances naive partitioning."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(997, 12)
        self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(7))
        self.out = nn.Linear(12, 3)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx).mean(1)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(self.out(h), target)


def _uneven_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(77 * step + rank)
    return torch.randint(0, 997, (6, 5), generator=gen), torch.randn(6, 3, generator=gen)


def _uneven_case() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    ref = Uneven()
    ddp = nn.parallel.DistributedDataParallel(ref) if world > 1 else ref
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    results = {}
    for stage in (1, 2):
        torch.manual_seed(3)
        model = Uneven()
        engine = shardwise.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2),
            {"zero_optimization": {"stage": stage, "reduce_bucket_size": 100}},
        )
        for step in range(4):
            engine.backward(engine(*_uneven_batch(step, rank)))
            engine.step()
        results[stage] = (params_of(model), engine.memory_breakdown(), engine.strategy.layout)
        engine.destroy()
    for step in range(4):
        ddp(*_uneven_batch(step, rank)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    want = params_of(ref)
    for got, _, _ in results.values():
        assert_close_params(got, want, atol=1e-6)
    layout = results[1][2]
    adam = results[1][1]["optimizer_state"] - 4 * len(layout.pieces)  # minus the scalar `step` tensors
    return {"stage1_adam": adam, "numel": layout.numel}


def test_uneven_sizes_world_1_2_3() -> None:
    """World sizes 1, 2 and 3 (3 needs padding): parity with DDP and balanced optimizer state.

    The embedding holds 94% of the elements; a per-tensor partition would give
    one rank nearly all of the state.
    """
    for world in (1, 2, 3):
        out = run_distributed(_uneven_case, world_size=world, timeout=240)
        per_rank = [r["stage1_adam"] for r in out]
        ideal = 8 * out[0]["numel"] / world  # exp_avg + exp_avg_sq, fp32
        for rank, nbytes in enumerate(per_rank):
            assert abs(nbytes - ideal) / ideal < 0.05, f"world {world} rank {rank}: {nbytes} vs ideal {ideal:.0f}"


@distributed_test(world_size=2, timeout=120)
def test_fp16_overflow_skips_on_all_ranks() -> None:
    def case(stage: int) -> None:
        model = make_model()
        engine = shardwise.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2),
            {"fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1}, "zero_optimization": {"stage": stage}},
        )
        before = params_of(model)
        idx, target = batch(0, dist.get_rank())
        loss = engine(idx, target)
        engine.backward(loss * float("nan") if dist.get_rank() == 1 else loss)
        assert not engine.step()
        assert engine.skipped_steps == 1 and engine.loss_scale == 2.0**9
        assert_close_params(params_of(model), before, atol=0.0)
        assert all(len(s) == 0 for s in engine.optimizer.state.values()) or not engine.optimizer.state
        engine.backward(engine(*batch(1, dist.get_rank())))
        assert engine.step()
        engine.destroy()

    run_subtests(case, [{"stage": 1}, {"stage": 2}])


@distributed_test(world_size=2, timeout=120)
def test_bf16_stages_close_to_fp32() -> None:
    def case(stage: int, rs: bool = True) -> None:
        model = make_model()
        engine = shardwise.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.5),
            {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, "reduce_scatter": rs}},
        )
        ref = make_model()
        ref_engine = shardwise.initialize(ref, torch.optim.SGD(ref.parameters(), lr=0.5), {})
        for step in range(4):
            for eng in (engine, ref_engine):
                eng.backward(eng(*batch(step, dist.get_rank())))
                eng.step()
        full = engine.full_state_dict()
        if dist.get_rank() == 0:
            assert_close_params({k: full[k] for k in params_of(ref)}, params_of(ref), atol=5e-3)
        engine.destroy()
        ref_engine.destroy()

    run_subtests(case, [{"stage": 1}, {"stage": 2}, {"stage": 1, "rs": False}, {"stage": 2, "rs": False}])


def _trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@distributed_test(world_size=2, timeout=120)
def test_per_rank_bytes_match_zero_theory() -> None:
    """Stage 1: Adam state ≈ 1/N; stage 2 (and stage 1 in bf16): gradients ≈ 1/N too (within 5%).

    In fp32 the master weights are this rank's slice of the parameters
    themselves (0 extra bytes), and stage 1's reduced gradients its slice of the
    full gradient buffer; in bf16 both are separate fp32 shards of Ψ/N.
    """
    world = dist.get_world_size()

    def near(got: float, want: float) -> bool:
        return abs(got - want) <= 0.05 * want

    def case(stage: int, frozen: bool, bf16: bool) -> None:
        model = make_model(vocab=512, dim=32, hidden=64)
        if frozen:
            model.fc2.requires_grad_(False)
        config: dict[str, Any] = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 2000}}
        config["bf16"] = {"enabled": bf16}
        engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
        engine.backward(engine(*batch(0, dist.get_rank(), vocab=512)))
        grads = engine.memory_breakdown()["gradients"]  # reduced, before the step frees anything
        engine.step()
        counts = engine.memory_breakdown()
        psi = _trainable_numel(model)
        full = sum(p.numel() for p in model.parameters())
        width = 2 if bf16 else 4
        pieces = len(engine.strategy.layout.pieces)
        adam = counts["optimizer_state"] - 4 * pieces  # exp_avg + exp_avg_sq; minus the scalar `step` tensors
        assert near(adam, 8 * psi / world), (counts, psi)
        assert counts["parameters"] == width * full
        if bf16:
            assert near(counts["master_weights"], 4 * psi / world), counts
        else:
            assert counts["master_weights"] == 0, counts
        shard = 4 * psi / world  # the fp32 reduced-gradient shard
        if stage == 2 or bf16:  # (bf16: staged at the boundary straight into fp32, no bf16 buffer kept)
            assert near(grads, shard), (grads, psi)
        else:  # fp32: the full-size buffer autograd writes into
            assert near(grads, width * psi), (grads, psi)
        if frozen:
            assert all(model.fc2.weight.data_ptr() != p.data_ptr() for g in engine.optimizer.param_groups for p in g["params"])
            assert model.fc2.weight.grad is None
        engine.destroy()

    run_subtests(case, [{"stage": s, "frozen": f, "bf16": b} for s in (1, 2) for f in (False, True) for b in (False, True)])


@distributed_test(world_size=2, timeout=120)
def test_collective_bytes_match_theory() -> None:
    """Per step, stages 1-2 send reduce-scatter + all-gather = 2·Ψ·(N-1)/N elements (fp32)."""
    world = dist.get_world_size()

    def case(stage: int, rs: bool = True) -> None:
        model = make_model()
        zero = {"stage": stage, "reduce_scatter": rs}
        engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_optimization": zero})
        engine.comm.reset_counters()
        engine.backward(engine(*batch(0, dist.get_rank())))
        engine.step()
        padded = engine.strategy.layout.padded_numel
        sent = engine.comm.bytes_sent
        theory = 4 * padded * (world - 1) / world
        # one fp32 flag per parameter tensor, all-reduced: which parameters had a gradient on any rank
        used = int(2 * 4 * len(engine.strategy.layout.params) * (world - 1) / world)
        # and at stages 1-2 one fp32 scalar all-reduce: the squared norm that also carries overflow
        norm = int(2 * 4 * (world - 1) / world)
        if stage == 0:
            assert sent["all_reduce"] == 2 * theory + used, dict(sent)
        elif not rs:  # all-reduce instead of reduce-scatter: twice the bytes for the reduction
            assert sent["all_reduce"] == 2 * theory + used + norm, dict(sent)
            assert sent["reduce_scatter"] == 0 and sent["all_gather"] == theory, dict(sent)
        else:
            assert sent["reduce_scatter"] == theory and sent["all_gather"] == theory, dict(sent)
            assert sent["all_reduce"] == used + norm, dict(sent)
        engine.destroy()

    run_subtests(case, [{"stage": s} for s in (0, 1, 2)] + [{"stage": s, "rs": False} for s in (1, 2)])



def _compute_copy_during_the_step(stage: int) -> None:
    """bf16 (fp32 masters apart) with one shard (stage 0, or one process): the flat bf16 parameter buffer has no
    memory while the inner optimizer steps, and every value is back afterwards, equal to the masters cast down; an
    optimizer that raises mid-step leaves the model holding the masters as the step left them, not freed memory.
    With shards on other ranks (stages 1-2, 2 ranks) the buffer stays: a failed step could not get their slices back."""
    model = make_model()
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    flat = engine.strategy.side.param_flat
    seen: list[int] = []
    inner = engine.optimizer.inner
    real = inner.step

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(flat.untyped_storage().nbytes())
        return real(*args, **kwargs)

    inner.step = watched
    rank = dist.get_rank()
    engine.backward(engine(*batch(0, rank)))
    engine.step()
    freed = stage == 0 or dist.get_world_size() == 1
    assert seen == [0 if freed else flat.numel() * flat.element_size()], seen
    masters = _gathered_masters(engine)
    for name, param in engine.module.named_parameters():
        assert torch.equal(param.detach(), masters[name].to(torch.bfloat16)), name

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("an optimizer that raises")

    inner.step = failing
    engine.backward(engine(*batch(1, rank)))
    try:
        engine.step()
    except RuntimeError as error:
        assert "an optimizer that raises" in str(error)
    else:
        raise AssertionError("the step did not raise")
    assert flat.untyped_storage().nbytes() == flat.numel() * flat.element_size()
    masters = _gathered_masters(engine)
    for name, param in engine.module.named_parameters():
        assert torch.equal(param.detach(), masters[name].to(torch.bfloat16)), name
    engine.destroy()


def _gathered_masters(engine: Any) -> dict[str, torch.Tensor]:
    masters = engine.strategy.full_master_weights()  # (collective: every rank gets every master)
    return {name: masters[id(param)] for name, param in engine.module.named_parameters()}


@distributed_test(world_size=2, timeout=120)
def test_bf16_flat_stages_free_the_compute_copy_while_the_optimizer_steps() -> None:
    run_subtests(_compute_copy_during_the_step, [{"stage": stage} for stage in (0, 1, 2)])


@distributed_test(world_size=1, timeout=120)
def test_bf16_flat_stages_in_one_process_free_the_compute_copy_while_the_optimizer_steps() -> None:
    run_subtests(_compute_copy_during_the_step, [{"stage": stage} for stage in (1, 2)])


def _staged_into_the_output(stage: int) -> None:
    """One shard (one process): a bucket's gradients are staged straight into this rank's fp32 reduced gradients,
    with no staging tensor beside them (same values: `benchmarks.same_math`)."""
    model = make_model()
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    grads = engine.strategy.grads
    for bucket in engine.strategy.layout.buckets:
        assert grads.comm_input(bucket).data_ptr() == grads.reduced.slices[bucket.index].data_ptr()
    engine.backward(engine(*batch(0, 0)))
    assert not grads._staging
    engine.step()
    engine.destroy()


@distributed_test(world_size=1, timeout=120)
def test_bf16_flat_stages_in_one_process_stage_into_the_reduced_gradients() -> None:
    run_subtests(_staged_into_the_output, [{"stage": stage} for stage in (0, 1, 2)])


def _reduced_per_bucket(stage: int) -> None:
    """One shard, bf16: each bucket's fp32 reduced gradients have memory from its first gradient in a reducing
    backward to the step (so they grow as backward goes, as FSDP2's), none between steps."""
    model = make_model()
    engine = shardwise.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage, "reduce_bucket_size": 300}, "bf16": {"enabled": True}})
    reduced = engine.strategy.grads.reduced
    buckets = len(reduced.slices)
    assert buckets > 2 and reduced.nbytes() == sum(g.numel() * 4 for g in reduced.slices)  # before any step: all
    live: list[int] = []
    for param in engine.module.parameters():  # after the engine's own hook: the bucket it just filled has memory
        param.register_post_accumulate_grad_hook(lambda _: live.append(sum(reduced._live)))
    for step in range(3):
        live.clear()
        engine.backward(engine(*batch(step, 0)))
        if step:  # (the first backward finds every bucket as initialize made it)
            assert live[0] < buckets and live == sorted(live) and live[-1] == buckets, live
        engine.step()
        assert reduced.nbytes() == 0  # released: no memory until the next reducing backward
    engine.destroy()


@distributed_test(world_size=1, timeout=120)
def test_bf16_flat_stages_in_one_process_hold_reduced_gradients_from_backward_to_step() -> None:
    run_subtests(_reduced_per_bucket, [{"stage": stage} for stage in (0, 2)])
