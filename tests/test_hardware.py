"""bf16 on a CPU without native bf16 is said once, with the slowdown measured on the spot."""

from __future__ import annotations

import logging

import pytest
import torch

from shardwise.optim import hardware


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "shardwise"]


def test_slow_bf16_is_warned_once_with_the_measured_factor(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(hardware, "native_bf16", lambda: False)
    monkeypatch.setattr(hardware, "bf16_slowdown", lambda: 9.5)
    monkeypatch.setattr(hardware, "_WARNED", [])
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        hardware.warn_if_slow_bf16(torch.float32, cpu, rank=0)
        assert _warnings(caplog) == [], "fp32 is not bf16"
        hardware.warn_if_slow_bf16(torch.bfloat16, cpu, rank=0)
        hardware.warn_if_slow_bf16(torch.bfloat16, cpu, rank=0)
    (line,) = _warnings(caplog)
    assert "9.5x" in line and "bf16.enabled: false" in line


def test_no_warning_with_native_bf16_or_a_small_factor(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        monkeypatch.setattr(hardware, "_WARNED", [])
        monkeypatch.setattr(hardware, "native_bf16", lambda: True)
        hardware.warn_if_slow_bf16(torch.bfloat16, cpu, rank=0)
        monkeypatch.setattr(hardware, "_WARNED", [])
        monkeypatch.setattr(hardware, "native_bf16", lambda: False)
        monkeypatch.setattr(hardware, "bf16_slowdown", lambda: 1.2)
        hardware.warn_if_slow_bf16(torch.bfloat16, cpu, rank=0)
    assert _warnings(caplog) == []


def test_the_measurement_and_description_are_real() -> None:
    assert hardware.bf16_slowdown.__wrapped__(size=64, repeats=2) > 0  # type: ignore[attr-defined]
    description = hardware.cpu_description()
    assert "bf16" in description and len(description) > 10
