"""Draws docs/window.png (``python docs/window_figure.py``): which output row and window slot reads each kv/score element."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle
from PIL import Image

RATIO, SEQLEN = 4, 14
COLORS = ["#4c78a8", "#f58518", "#54a24b"]
GREY = "#d9d9d9"


def panel(ax, coff):
    groups = SEQLEN // RATIO
    halves = ["first d columns", "last d columns"] if coff == 2 else ["d columns"]
    for t in range(SEQLEN):
        g = t // RATIO
        k = t % RATIO
        for h in range(len(halves)):
            if g >= groups:
                color, text = GREY, "tail (grad 0)"
            elif coff == 1:
                color, text = COLORS[g], f"row {g}, s={k}"
            elif h == 1:
                color, text = COLORS[g], f"row {g}, s={RATIO + k}"
            elif g + 1 < groups:
                color, text = COLORS[g + 1], f"row {g + 1}, s={k}"
            else:
                color, text = GREY, "not read (grad 0)"
            ax.add_patch(Rectangle((h, SEQLEN - 1 - t), 1, 1, facecolor=color, edgecolor="white", linewidth=1.5))
            ax.text(
                h + 0.5,
                SEQLEN - 0.5 - t,
                text,
                ha="center",
                va="center",
                fontsize=7,
                color="black" if color == GREY else "white",
            )
    for g in range(1, groups + 1):
        ax.axhline(SEQLEN - g * RATIO, color="black", linewidth=0.8)
    ax.set_xlim(0, len(halves))
    ax.set_ylim(0, SEQLEN)
    ax.set_xticks([h + 0.5 for h in range(len(halves))])
    ax.set_xticklabels(halves, fontsize=8)
    ax.set_yticks([SEQLEN - 0.5 - t for t in range(SEQLEN)])
    ax.set_yticklabels([f"t={t}" for t in range(SEQLEN)], fontsize=7)
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)


fig, axes = plt.subplots(1, 2, figsize=(8.2, 5.2), gridspec_kw={"width_ratios": [2, 1.15]})
panel(axes[0], 2)
axes[0].set_title("coff = 2 (overlapping), ratio 4: window of 8 slots", fontsize=9)
panel(axes[1], 1)
axes[1].set_title("coff = 1, ratio 4: window of 4 slots", fontsize=9)
handles = [Patch(color=COLORS[g], label=f"output row {g}") for g in range(3)]
handles.append(Patch(color=GREY, label="consumed by no slot (gradient is exactly 0)"))
fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
fig.suptitle("One segment of 14 tokens (3 groups + a tail of 2): who reads each kv/score element", fontsize=10)
fig.text(
    0.5,
    0.075,
    "coff = 2: row 0 has no previous group, so its slots 0-3 hold value 0 and logit -inf.",
    ha="center",
    fontsize=8,
)
fig.tight_layout(rect=(0, 0.1, 1, 0.95))
out = Path(__file__).resolve().parent / "window.png"
fig.savefig(out, dpi=90)
# A 16-colour palette keeps the file small (the figure has 5 colours and grey text); zopfli, where installed
# (pip install zopfli), recompresses the same pixels about a fifth smaller.
Image.open(out).convert("RGB").quantize(colors=16).save(out, optimize=True)
try:
    import zopfli.png
except ImportError:
    pass
else:
    out.write_bytes(zopfli.png.optimize(out.read_bytes()))
