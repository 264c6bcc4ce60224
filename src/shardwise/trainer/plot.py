"""Loss and learning-rate curves from a metrics file, as a PNG (needs matplotlib: ``pip install 'shardwise[plot]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .metrics import read_metrics

__all__ = ["plot_metrics"]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in points], [float(p[1]) for p in points]


def plot_metrics(metrics_file: Any, out: Any) -> Path:
    """Draw train/eval loss and lr against step from ``metrics_file`` into ``out`` (a PNG); returns ``out``."""
    try:
        # here: matplotlib takes ~0.5 s to import, paid only when a plot is drawn
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            f"plotting needs matplotlib ({error}); install it with `pip install 'shardwise[plot]'`"
        ) from error
    records = read_metrics(metrics_file)
    steps, losses = _series(records, "loss")
    if not steps:
        raise ValueError(f"{metrics_file} has no records with `step` and `loss`; is it a shardwise metrics file?")
    # The object API (no pyplot): no global figure state, no display backend needed.
    figure = Figure(figsize=(9, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, lr_axes = figure.subplots(1, 2)
    loss_axes.plot(steps, losses, label="train")
    eval_steps, eval_losses = _series(records, "eval_loss")
    if eval_steps:
        loss_axes.plot(eval_steps, eval_losses, "o-", label="eval")
    loss_axes.set(xlabel="step", ylabel="loss", title="loss")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    lr_axes.plot(*_series(records, "lr"), color="tab:green")
    lr_axes.set(xlabel="step", ylabel="learning rate", title="learning rate")
    lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    lr_axes.grid(alpha=0.3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out
