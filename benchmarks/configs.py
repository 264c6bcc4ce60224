"""What one benchmark run trains (:class:`Workload`) and with what (:class:`System`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "DTYPES",
    "FAMILIES",
    "System",
    "Workload",
    "available_stages",
    "comparison_systems",
    "peer_of",
]

DTYPES = ("fp32", "bf16")
#: ``shardwise`` is the engine under test; the others are its peers.
FAMILIES = ("shardwise", "ddp", "zero1", "fsdp2", "deepspeed")


@dataclass(frozen=True)
class System:
    """One configuration: an engine family at a ZeRO stage and a precision.

    ``stage`` is the ZeRO stage the system implements (for a torch peer: the
    shardwise stage it is the peer of), so ``family`` + ``stage`` + ``dtype``
    names a system uniquely.
    """

    family: str
    stage: int
    dtype: str

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown system family {self.family!r}; expected one of {FAMILIES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}")

    @property
    def name(self) -> str:
        if self.family in ("shardwise", "deepspeed"):
            return f"{self.family}-s{self.stage}-{self.dtype}"
        if self.family == "fsdp2":
            reshard = "reshard" if self.stage == 3 else "noreshard"
            return f"fsdp2-{reshard}-{self.dtype}"
        return f"{self.family}-{self.dtype}"

    @property
    def is_shardwise(self) -> bool:
        return self.family == "shardwise"


def peer_of(system: System) -> System:
    """The torch system a shardwise stage is compared against."""
    family = {0: "ddp", 1: "zero1", 2: "fsdp2", 3: "fsdp2"}[system.stage]
    return System(family, system.stage, system.dtype)


@dataclass(frozen=True)
class Workload:
    """The training job every system runs: model size, batch, steps, seed.

    ``micro_batch`` is per rank, so the global batch grows with the world size
    (weak scaling, as data parallel is used).  ``seq_len`` 0 means the model's
    ``block_size``.
    """

    size: str = "10m"
    world_size: int = 2
    micro_batch: int = 2
    seq_len: int = 0
    warmup: int = 2
    steps: int = 3
    seed: int = 1234
    lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.seq_len < 0:
            raise ValueError(f"`warmup` and `seq_len` must be >= 0, got {self.warmup}, {self.seq_len}")

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def available_stages() -> list[int]:
    """Every ZeRO stage shardwise has."""
    return [0, 1, 2, 3]


def comparison_systems(
    stages: list[int], dtypes: tuple[str, ...] = DTYPES, peers: bool = True, deepspeed: bool = False
) -> list[System]:
    """Every shardwise stage in ``stages`` × ``dtypes``, each followed by its peers."""
    systems: list[System] = []
    for dtype in dtypes:
        for stage in stages:
            mine = System("shardwise", stage, dtype)
            systems.append(mine)
            if peers:
                systems.append(peer_of(mine))
            if deepspeed:
                systems.append(System("deepspeed", stage, dtype))
    return systems
