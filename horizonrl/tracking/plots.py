"""The report's learning-curve figures: one panel per variant on shared axes (matplotlib, Agg)."""

from __future__ import annotations

import math

import numpy as np

from horizonrl.tracking.report import X_AXES, Curve


def plot(curve_list: list[Curve], x: str):
    """Success against ``x`` (a key of ``X_AXES``), one panel per variant on shared axes: each seed thin
    (label ``_seed``), the mean thick with its band (labelled with the variant), and the other variants'
    means in grey behind (``_context``), so eleven overlapping curves stay readable. The y axis spans the
    data (inside [0, 1]): a study's differences of a few points vanish on a 0-1 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ncols = min(4, len(curve_list))
    nrows = -(-len(curve_list) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows + 0.4), dpi=100, sharex=True, sharey=True, squeeze=False
    )
    colours = plt.get_cmap("tab10").colors
    means = [(np.asarray(getattr(c, x), dtype=float), c.mean) for c in curve_list]
    ys = [
        v
        for c in curve_list
        for v in [*c.mean, *c.low, *c.high, *(y for s in c.seeds for y in s["success"])]
        if not math.isnan(v)
    ]
    for k, (ax, c) in enumerate(zip(axes.flat, curve_list)):
        colour = colours[k % 10]
        for j, (xs, mean) in enumerate(means):
            if j != k:
                ax.plot(xs, mean, color="0.8", linewidth=0.8, label="_context", zorder=1)
        for seed in c.seeds:
            ax.plot(seed[x], seed["success"], color=colour, linewidth=0.6, alpha=0.5, label="_seed", zorder=2)
        xs = means[k][0]
        if c.low and not all(math.isnan(v) for v in c.low):
            ax.fill_between(xs, c.low, c.high, color=colour, alpha=0.2, linewidth=0, zorder=2)
        ax.plot(xs, c.mean, color=colour, linewidth=2.0, marker="o", markersize=3, label=c.variant, zorder=3)
        ax.set_title(c.variant.replace(" ", "\n", 1) if len(c.variant) > 30 else c.variant, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, linewidth=0.5)
    for k, ax in enumerate(axes.flat):
        if k >= len(curve_list):
            ax.set_visible(False)
        elif k + ncols >= len(curve_list):  # nothing drawn below it: its own x tick labels
            ax.xaxis.set_tick_params(labelbottom=True)
    if ys:
        margin = max(0.01, 0.05 * (max(ys) - min(ys)))
        axes[0, 0].set_ylim(max(0.0, min(ys) - margin), min(1.0, max(ys) + margin))
    if x == "iterations":
        axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.supxlabel(X_AXES[x], fontsize=9)
    fig.supylabel("held-out success rate", fontsize=9)
    fig.tight_layout()
    return fig
