"""`shardwise.deepspeed` clients in DeepSpeedExamples' pipeline and GAN style, on 2 gloo ranks.

Each script in examples/deepspeed/ is run unchanged (only its imports name shardwise) and compared
with the same model trained by hand with torch in one process, with DeepSpeed's defaults spelled
out (gradient clipping at 1.0, Adam without weight decay, the pipeline's data in order). fp32
throughout: losses and weights within 1e-5 (only the order of a few sums differs). The same launch
checks a Megatron-style tied embedding pipeline and a stage whose first layer works in place.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "deepspeed"
ATOL = 1e-5


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_ds_client_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=ATOL, rtol=0, msg=what)


# ------------------------------------------------------------------ one-process references


def _pipeline_reference(steps: int, samples: int, seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The pipeline script's model as one sequential module: 4 micro-batches of 4 per step, in order,
    the loss averaged over them, clipped to norm 1.0 (DeepSpeed's default), Adam without decay."""
    script = _load("train_pipeline")
    torch.manual_seed(seed)
    net = script.AlexNet(num_classes=10, dropout=0.0)
    layers = script.join_layers(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-8)
    data = script.synthetic_cifar(samples)
    order = [i % samples for i in range(steps * 16)]
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(4):
            index = order[(step * 4 + micro) * 4:(step * 4 + micro + 1) * 4]
            x = data.tensors[0][index]
            for layer in layers:
                x = layer(x)
            loss = F.cross_entropy(x, data.tensors[1][index])
            (loss / 4).backward()
            total += loss.item() / 4
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    names = [f"{i}.{n}" for i, layer in enumerate(layers) if isinstance(layer, nn.Module)
             for n, _ in layer.named_parameters()]
    values = [p for layer in layers if isinstance(layer, nn.Module) for p in layer.parameters()]
    return losses, {n: p.detach().clone() for n, p in zip(names, values)}


def _gan_reference(args: list[str]) -> dict[str, Any]:
    """The GAN script's loop by hand: both backwards of D summed, each step clipped to norm 1.0."""
    script = _load("train_gan")
    opts = script.get_argument_parser().parse_args(args)
    script.set_seed(opts.manualSeed)
    loader = torch.utils.data.DataLoader(script.synthetic_images(opts.samples), batch_size=opts.batchSize, shuffle=True)
    netG = script.Generator(opts.ngf, 3, opts.nz)
    netG.apply(script.weights_init)
    netD = script.Discriminator(opts.ndf, 3)
    netD.apply(script.weights_init)
    optD = torch.optim.Adam(netD.parameters(), lr=opts.lr, betas=(opts.beta1, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=opts.lr, betas=(opts.beta1, 0.999))
    losses = []
    for _ in range(opts.epochs):
        for (real,) in loader:
            netD.zero_grad()
            ones, zeros = torch.ones(real.size(0)), torch.zeros(real.size(0))
            err_real = F.binary_cross_entropy(netD(real), ones)
            err_real.backward()
            fake = netG(torch.randn(real.size(0), opts.nz, 1, 1))
            err_fake = F.binary_cross_entropy(netD(fake.detach()), zeros)
            err_fake.backward()
            torch.nn.utils.clip_grad_norm_(netD.parameters(), 1.0)
            optD.step()
            netG.zero_grad()
            err_g = F.binary_cross_entropy(netD(fake), ones)
            err_g.backward()
            torch.nn.utils.clip_grad_norm_(netG.parameters(), 1.0)
            optG.step()
            losses.append(((err_real + err_fake).item(), err_g.item()))
    return {"losses": losses, "D": netD.state_dict(), "G": netG.state_dict()}


# ------------------------------------------------------------------ Megatron-style ties, in-place stage


VOCAB, DIM, POSITIONS = 16, 8, 6


class EmbeddingPipe(nn.Module):
    """Megatron-DeepSpeed's pattern: word embedding (tied with the head) plus a position table."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.3)
        self.pos = nn.Parameter(torch.randn(POSITIONS, DIM) * 0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids] + self.pos[: ids.size(1)]


def _head(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.mean(1), embedding.weight)


def _megatron_layers() -> list[Any]:
    return [TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr="weight"), LayerSpec(nn.Linear, DIM, DIM),
            torch.tanh, LayerSpec(nn.Linear, DIM, DIM),
            TiedLayerSpec("embed", EmbeddingPipe, forward_fn=_head, tied_weight_attr="weight")]


def _inplace_layers() -> list[Any]:
    return [LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.ReLU, inplace=True), LayerSpec(nn.Linear, DIM, 4)]


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (4, POSITIONS), generator=gen), torch.randint(0, VOCAB, (4,), generator=gen)


def _floats(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, DIM, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def _pipe_vs_sequential(layers: list[Any], batch: Any, partition: Any) -> dict[str, Any]:
    """3 SGD steps of the 2-stage pipeline (gradient_accumulation 1) and of `to_sequential()` by hand."""
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    engine = shardwise.initialize(PipelineModule(layers, num_stages=2, loss_fn=F.cross_entropy, seed_layers=True,
                                                 partition_method=partition), config=config)
    piped = [float(engine.train_batch(iter([batch(step)]))) for step in range(3)]
    weights = engine.full_state_dict()
    engine.destroy()
    model = PipelineModule(layers, num_stages=1, loss_fn=F.cross_entropy, seed_layers=True).to_sequential()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    alone = []
    for step in range(3):
        loss = F.cross_entropy(model(batch(step)[0]), batch(step)[1])
        loss.backward()
        sgd.step()
        sgd.zero_grad()
        alone.append(loss.item())
    return {"piped": piped, "alone": alone, "weights": weights, "reference": model.state_dict()}


# ------------------------------------------------------------------ the launch


def _run(out: str) -> dict[str, Any]:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardwise").addHandler(handler)
    logging.getLogger("shardwise").setLevel(logging.INFO)
    results = {
        "pipeline": _load("train_pipeline").main(["--deepspeed_config", str(EXAMPLES / "pipeline.json"),
                                                  "--dropout", "0", "--steps", "4"]),
        "gan": _load("train_gan").main(["--deepspeed_config", str(EXAMPLES / "gan.json")]),
        "megatron": _pipe_vs_sequential(_megatron_layers(), _tokens, "uniform"),
        "inplace": _pipe_vs_sequential(_inplace_layers(), _floats, [0, 1, 3]),
    }
    results["lines"] = [line for line in lines if line.startswith("deepspeed dialect")]
    return results


def test_pipeline_and_gan_clients_train_as_deepspeed_does(tmp_path: Path) -> None:
    ranks = run_distributed(_run, world_size=2, args=(str(tmp_path),), timeout=300)
    pipeline = ranks[0]["pipeline"]
    # DeepSpeed's balancing: the first stage runs up to the first Linear (layer 16), not layer 11.
    assert pipeline["parts"] == [0, 16, 22] and ranks[1]["pipeline"]["stage"] == 1
    assert pipeline["loader"] == "RepeatingLoader"
    losses, weights = _pipeline_reference(steps=4, samples=40, seed=1138)
    _close(pipeline["losses"], losses, "pipeline losses")
    assert pipeline["losses"] == ranks[1]["pipeline"]["losses"]  # on every rank
    assert pipeline["weights"].keys() == weights.keys()
    for name, value in weights.items():
        _close(pipeline["weights"][name], value, f"pipeline {name}")
    gan = _gan_reference([])
    for rank in ranks:
        _close(rank["gan"]["losses"], gan["losses"], "GAN losses")
    for net in ("D", "G"):
        for name, value in gan[net].items():
            _close(ranks[0]["gan"][net][name], value, f"GAN {net} {name}")
    for case in ("megatron", "inplace"):
        got = ranks[0][case]
        _close(got["piped"], got["alone"], f"{case} losses")
        for name, value in got["reference"].items():
            _close(got["weights"][name], value, f"{case} {name}")
    # The position table trains on the first stage only; the saved copy is that one.
    assert not torch.equal(ranks[0]["megatron"]["weights"]["tied_modules.embed.pos"],
                           PipelineModule(_megatron_layers(), num_stages=1, seed_layers=True).tied_modules.embed.pos.detach())
    lines = ranks[0]["lines"]
    assert ranks[1]["lines"] == []
    assert any("`gradient_clipping` is not set, so gradients are clipped to norm 1.0" in line for line in lines)
    assert any("reads `training_data` in order" in line for line in lines)
    assert any("several `backward` calls before one `step` add up" in line for line in lines)
    assert any("config's `optimizer` section (`Adam`) is ignored" in line for line in lines)
