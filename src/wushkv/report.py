"""Tables for the terminal and PNG plots (matplotlib, Agg backend, written atomically)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .io import atomic_write


def format_table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
    return "\n".join(out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    out = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _fmt(c) -> str:
    if isinstance(c, float):
        if c != c:
            return "nan"
        return f"{c:.4g}" if abs(c) < 1000 else f"{c:.1f}"
    return str(c)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    p = atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return p


def plot_lines(x, series: dict[str, Sequence[float]], path, xlabel: str, ylabel: str, title: str, logy: bool = False, hline: float | None = None, hlabel: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", ms=3, label=name, lw=2.2 if name.startswith("wush") else 1.2)
    if hline is not None:
        ax.axhline(hline, color="k", ls="--", lw=1, label=hlabel)
    if logy:
        ys = [y for v in series.values() for y in v if y == y]
        if any(y <= 0 for y in ys):  # a method below the reference: a log axis would hide it, symlog shows it
            small = min((abs(y) for y in ys if y != 0), default=1.0)
            ax.set_yscale("symlog", linthresh=max(min(small, 0.1), 1e-3))
            ax.axhline(0.0, color="k", lw=0.8)
        else:
            ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_bars(values: dict[str, float], path, xlabel: str, title: str, highlight: Sequence[str] = (), logx: bool = False):
    """One horizontal bar per name, top to bottom in ``values``' order (NaN: no bar); names in ``highlight`` drawn in
    another colour. For one measurement per name, where :func:`plot_lines` over a single x would stack every point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(values)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * len(names)))
    ys = range(len(names))[::-1]
    xs = [values[n] for n in names]
    ax.barh(list(ys), [x if x == x else 0.0 for x in xs], color=["tab:orange" if n in highlight else "tab:blue" for n in names])
    for y, x in zip(ys, xs):
        if x == x:
            ax.annotate(f"{x:+.2f}", (x, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(list(ys), names, fontsize=8)
    if logx and all(x > 0 for x in xs if x == x):
        ax.set_xscale("log")
    else:
        ax.axvline(0.0, color="k", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    return _save(fig, path)


def color_max(grids: dict[str, Sequence[Sequence[float]]]) -> float:
    """The largest finite value of all ``grids`` (NaN cells are runs not made), 1.0 if none is positive."""
    top = max((v for g in grids.values() for row in g for v in row if math.isfinite(v)), default=0.0)
    return top if top > 0 else 1.0


def plot_heatmaps(grids: dict[str, Sequence[Sequence[float]]], rows: Sequence, cols: Sequence, path, xlabel: str, ylabel: str, title: str,
                  vmax: float | None = 1.0):
    """One annotated heatmap (values in [0, 1], printed as %) per entry of ``grids``, side by side, on one
    colour scale from 0 to ``vmax`` (None: the largest finite value of all grids, for values far below 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vmax = color_max(grids) if vmax is None else vmax
    n = len(grids)
    fig, axes = plt.subplots(1, n, figsize=(2.4 * n + 1, 2.6), squeeze=False)
    for ax, (name, g) in zip(axes[0], grids.items()):
        ax.imshow(g, vmin=0, vmax=vmax, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(g):
            for j, v in enumerate(row):
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(cols)), [str(c) for c in cols], fontsize=7)
        ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
    axes[0][0].set_ylabel(ylabel, fontsize=8)
    fig.suptitle(title, fontsize=10, y=1.06)
    return _save(fig, path)
