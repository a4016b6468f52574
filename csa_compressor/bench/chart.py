"""The bench's chart: cold kernel time over the DRAM floor per case, ours beside cudnn-frontend and torch.compile."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from .cases import TORCH_TAIL
from .report import _index, case_order, combined, cudnn_frontend, runs_of

__all__ = ["draw_chart"]

# One colour per series in every panel; the PNG is stored with a small palette so that it stays small.
_COLOURS = {
    "cute": "#1f77b4",
    "triton": "#6baed6",
    "cudnn-frontend (quoted)": "#ff7f0e",
    "torch.compile": "#7f7f7f",
    "cute" + TORCH_TAIL: "#2ca02c",
    "triton" + TORCH_TAIL: "#98df8a",
}
_Y_TICKS = (0.5, 1, 2, 5, 10, 20, 50)
_PANELS = (("forward", "fwd"), ("backward call", "bwd"), ("forward + backward", "fwd+bwd"))


def _ratio(rec: dict | None) -> float:
    return _over(rec.get("kernel_us_cold"), rec.get("floor_us")) if rec else 0.0


def _series(records: Sequence[dict], direction: str, tail: bool) -> tuple[list[str], dict[str, list[float]]]:
    """Cases and, per series, kernel time / floor (0: not measured) of one panel."""
    idx = _index(records)
    cases = [c for c in case_order(records) if c.endswith("-tail") == tail]
    present = {r["backend"] for r in records}
    series: dict[str, list[float]] = {}
    for backend in ("cute", "triton"):
        if backend in present:
            series[backend] = [_ratio(_lookup(idx, c, backend, direction)) for c in cases]
    if tail:
        for backend in ("cute" + TORCH_TAIL, "triton" + TORCH_TAIL):
            if backend in present:
                series[backend] = [_ratio(_lookup(idx, c, backend, direction)) for c in cases]
    else:
        floors = {(r["case"], r["direction"]): r.get("floor_us") for r in records}
        series["cudnn-frontend (quoted)"] = [
            _over(cudnn_frontend(c, direction), _floor(floors, c, direction)) for c in cases
        ]
    if direction != "bwd":
        series["torch.compile"] = [_ratio(_lookup(idx, c, "torch.compile", direction)) for c in cases]
    return cases, {k: v for k, v in series.items() if any(v)}


def _floor(floors: dict, case: str, direction: str) -> float | None:
    if floors.get((case, direction)):
        return floors[(case, direction)]
    if direction == "fwd+bwd" and floors.get((case, "fwd")) and floors.get((case, "bwd")):
        return floors[(case, "fwd")] + floors[(case, "bwd")]
    return None


def _over(num: float | None, den: float | None) -> float:
    return num / den if num and den else 0.0


def _lookup(idx: dict, case: str, backend: str, direction: str) -> dict | None:
    return combined(idx, case, backend) if direction == "fwd+bwd" else idx.get((case, backend, direction))


def _draw_panel(ax, title: str, cases: list[str], series: dict[str, list[float]]) -> None:
    from matplotlib.ticker import NullLocator

    width = 0.8 / max(len(series), 1)
    for i, (label, vals) in enumerate(series.items()):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(cases))]
        ax.bar(xs, [v or float("nan") for v in vals], width, label=label, color=_COLOURS.get(label))
    ax.set_yscale("log")
    ax.set_ylim(_Y_TICKS[0], _Y_TICKS[-1])
    ax.set_yticks(_Y_TICKS, [f"{t:g}" for t in _Y_TICKS])
    ax.yaxis.set_minor_locator(NullLocator())  # fixed ticks: the log axis' minor ones cost most of the drawing
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.removesuffix("-tail") for c in cases], rotation=35, ha="right", fontsize=7)
    ax.tick_params(axis="y", labelsize=7)


def draw_chart(records: Sequence[dict], path: Path) -> str | None:
    """PNG of cold kernel time / DRAM floor (log scale, 1 = at the floor) per case: our backends, cudnn-frontend's
    quoted figures and torch.compile, by direction, and the fused tail against the unfused chains when measured.
    Returns a message when it cannot draw. Of a record of several runs, the first run's (the report's tables')."""
    records = runs_of(records)[0]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; chart skipped (pip install matplotlib)"
    panels = [(title, *_series(records, d, tail=False)) for title, d in _PANELS]
    if any(r.get("tail") for r in records):
        panels.append(("with RMSNorm + RoPE, fwd + bwd", *_series(records, "fwd+bwd", tail=True)))
    panels = [p for p in panels if p[1] and p[2]]
    if not panels:
        return "nothing measured; chart skipped"
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels) + 0.6, 3.5), sharey=True, squeeze=False)
    for ax, (title, cases, series) in zip(axes[0], panels, strict=True):
        _draw_panel(ax, title, cases, series)
    axes[0][0].set_ylabel("cold kernel time / DRAM floor", fontsize=8)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="upper right", fontsize=7, ncol=len(labels))
    fig.suptitle("Lower is better; 1 = the DRAM floor", fontsize=9, x=0.12, ha="left")
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.3, top=0.8, wspace=0.08)
    _save_small_png(fig, path)
    plt.close(fig)
    return None


def _save_small_png(fig, path: Path) -> None:
    """The figure as a palette PNG (a few dozen colours) where Pillow is there, else as matplotlib writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    try:
        from PIL import Image
    except ImportError:
        path.write_bytes(buf.getvalue())
        return
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    image.quantize(colors=48, method=Image.Quantize.MEDIANCUT).save(path, format="png", optimize=True)
