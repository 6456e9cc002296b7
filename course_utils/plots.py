"""The few plot kinds the chapters share, all matplotlib.

Each function draws on a new figure (or on ``ax`` when given) and returns the
axes, so a chapter can add a reference curve or a note before showing it.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from course_utils.bench import Sweep


def _axes(ax, figsize=(6.4, 4.0)):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def plot_time_vs_size(
    sweeps: Sequence[Sweep],
    xlabel: str = "size",
    ylabel: str = "time per call (s)",
    title: str = "",
    ax=None,
    logx: bool = True,
    logy: bool = True,
):
    """Time against size, one line per sweep, on log axes. Chapter 2.

    The shaded band spans the quartiles of the repeated runs when the sweep
    has them (``low``, ``high``), else an interquartile range centred on the
    median.
    """
    ax = _axes(ax)
    for s in sweeps:
        (line,) = ax.plot(s.sizes, s.median, marker="o", ms=3, label=s.label)
        if s.low is not None and s.high is not None:
            lo, hi = s.low, s.high
        else:
            lo = [m - q / 2 for m, q in zip(s.median, s.iqr, strict=True)]
            hi = [m + q / 2 for m, q in zip(s.median, s.iqr, strict=True)]
        ax.fill_between(s.sizes, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return ax


def plot_speedup_bars(
    labels: Sequence[str],
    seconds: Sequence[float],
    baseline: int = 0,
    title: str = "",
    ax=None,
):
    """Bars of speed-up over ``labels[baseline]`` (higher is faster). Chapter 4.

    Each bar is annotated with its speed-up and the time it stands for.
    """
    ax = _axes(ax)
    base = seconds[baseline]
    speedups = [base / s for s in seconds]
    bars = ax.bar(labels, speedups, color=plt.cm.tab10.colors[: len(labels)])
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    for bar, sp, s in zip(bars, speedups, seconds, strict=True):
        ax.annotate(
            f"{sp:.2f}x\n({s * 1e3:.3g} ms)",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel(f"speed-up over {labels[baseline]}")
    ax.set_ylim(0, max(speedups) * 1.25)
    if title:
        ax.set_title(title)
    return ax


def plot_timeline(
    spans: Sequence[tuple],
    title: str = "",
    unit: str = "ms",
    ax=None,
    lanes: Sequence[str] | None = None,
):
    """A Gantt chart: one row per lane (stream, thread, rank or stage). Chapter 3.

    ``spans`` holds ``(lane, start, end)`` or ``(lane, start, end, label)``
    tuples with times in seconds; they are drawn in ``unit`` ("s", "ms" or
    "us") from the earliest start. Overlap across rows is work done at once.
    """
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    t0 = min(s[1] for s in spans)
    lanes = list(lanes) if lanes else list(dict.fromkeys(s[0] for s in spans))
    ax = _axes(ax, figsize=(7.5, 0.6 * len(lanes) + 1.2))
    labels = list(dict.fromkeys(s[3] for s in spans if len(s) > 3))
    colors = {lab: plt.cm.tab20.colors[i % 20] for i, lab in enumerate(labels)}
    texts = []
    for span in spans:
        lane, start, end = span[:3]
        label = span[3] if len(span) > 3 else None
        y = lanes.index(lane)
        left, width = (start - t0) * scale, (end - start) * scale
        ax.barh(
            y,
            width,
            left=left,
            height=0.6,
            edgecolor="black",
            lw=0.5,
            color=colors.get(label, "tab:blue"),
        )
        if label and width > 0:
            texts.append((ax.text(left + width / 2, y, str(label), ha="center",
                                  va="center", fontsize=7, clip_on=True),
                          left, width))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    _drop_labels_wider_than_their_bar(ax, texts)
    return ax


def _drop_labels_wider_than_their_bar(ax, texts) -> None:
    """Remove each bar label that would spill out of its bar or overprint."""
    if not texts:
        return
    ax.autoscale_view()
    renderer = ax.figure.canvas.get_renderer()
    for text, left, width in texts:
        x0, x1 = ax.transData.transform([(left, 0), (left + width, 0)])[:, 0]
        if text.get_window_extent(renderer).width > 0.95 * abs(x1 - x0):
            text.remove()


# --- GPU figures of each kind (course_utils.reference) ---------------------------

# One look per kind, so that a plot never mixes them up: what ran here is solid
# with circles, a recording solid with squares, a publication dotted with
# diamonds, a prediction dashed with no markers (it is a model, not a point).
FIGURE_STYLE = {
    "measured": {"marker": "o", "linestyle": "-", "hatch": ""},
    "recorded": {"marker": "s", "linestyle": "-", "hatch": ".."},
    "published": {"marker": "D", "linestyle": ":", "hatch": "//"},
    "predicted": {"marker": "", "linestyle": "--", "hatch": "xx"},
}


def figure_style(kind: str) -> dict:
    """Line style for a figure's kind: ``ax.plot(x, y, **figure_style(k))``. Ch. 0."""
    style = FIGURE_STYLE[kind]
    return {"marker": style["marker"], "linestyle": style["linestyle"]}


def plot_figure_bars(figures, title: str = "", ylabel: str = "", ax=None,
                     logy: bool = True, fmt: str = "{:.3g}"):
    """One bar per scalar ``reference.Figure``, hatched and labelled by kind. Ch. 0.

    For comparing one number across devices and kinds: a CPU measured here
    beside a GPU's published, predicted and recorded figures.
    """
    figures = [f for f in figures if isinstance(f.value, (int, float))]
    ax = _axes(ax, figsize=(max(4.0, 1.6 * len(figures) + 1.5), 3.6))
    colors = plt.cm.tab10.colors
    for i, f in enumerate(figures):
        # a light grey hatch on a pale bar: the kind shows, the labels stay legible
        bar = ax.bar(i, f.value, color=colors[i % 10], edgecolor="0.45",
                     linewidth=0.8, hatch=FIGURE_STYLE[f.kind]["hatch"],
                     label=f.legend)
        ax.annotate(fmt.format(f.value), (i, f.value), ha="center", va="bottom",
                    fontsize=8, bbox={"boxstyle": "round,pad=0.15", "fc": "white",
                                      "ec": "none", "alpha": 0.85})
        bar[0].set_alpha(0.6)
    ax.set_xticks(range(len(figures)),
                  [f"{f.device}\n({f.kind})" for f in figures], fontsize=7)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel or (figures[0].unit if figures else ""))
    if title:
        ax.set_title(title)
    ax.legend(fontsize=7, loc="best")
    return ax


def plot_figure_curves(figures, xlabel: str = "", ylabel: str = "", title: str = "",
                       ax=None, logx: bool = True, logy: bool = True,
                       yscale: float = 1.0):
    """Curves ``{"x": [...], "y": [...]}`` from ``reference.Figure`` objects. Ch. 0.

    Each curve is styled by its kind (``FIGURE_STYLE``) and its legend entry
    names the device and the kind; ``yscale`` multiplies the y values.
    """
    ax = _axes(ax)
    for f in figures:
        v = f.value
        if not (isinstance(v, dict) and "x" in v and "y" in v):
            raise ValueError(f"{f.label}: a curve needs a value with 'x' and 'y'")
        ax.plot(v["x"], [y * yscale for y in v["y"]], ms=4, label=f.legend,
                **figure_style(f.kind))
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return ax
