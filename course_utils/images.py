"""The course's diagrams, drawn from code: ``python -m course_utils.images``.

Writes ``images/*.png`` (``make images``). Each diagram is drawn by one
function below from the same facts the chapters teach (a schedule is computed,
not drawn by hand), so it can be corrected and regenerated. The start page
and the chapters show them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

ROOT = Path(__file__).resolve().parent.parent
IMAGES_DIR = ROOT / "images"
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _save(fig, path: Path) -> Path:
    # no "Software" stamp: the same code draws the same bytes
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def _box(ax, x, y, w, h, text, color, fontsize=9, alpha=0.85):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black",
                           alpha=alpha, linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center",
            fontsize=fontsize)


def _arrow(ax, a, b, text="", color="black"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12,
                                 color=color, linewidth=1.2))
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.12, text,
                ha="center", fontsize=8, color=color)


# --- number formats (Chapter 8) ---------------------------------------------------

FORMATS = [  # name, sign, exponent, mantissa bits
    ("float32", 1, 8, 23),
    ("tf32 (in tensor cores)", 1, 8, 10),
    ("bfloat16", 1, 8, 7),
    ("float16", 1, 5, 10),
]


def number_formats(path: Path) -> Path:
    """Bit layouts of fp32, tf32, bf16 and fp16: sign, exponent, mantissa."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for row, (name, s, e, m) in enumerate(FORMATS):
        y = len(FORMATS) - 1 - row
        x = 0
        for bits, label, color in ((s, "sign", COLORS[3]),
                                   (e, "exponent", COLORS[0]),
                                   (m, "mantissa", COLORS[2])):
            _box(ax, x, y, bits, 0.7,
                 f"{label} {bits}" if bits > 3 else str(bits), color, 8)
            x += bits
        ax.text(-0.5, y + 0.35, f"{name}\n{s + e + m} bits", ha="right",
                va="center", fontsize=9)
    ax.set_xlim(-9, 33)
    ax.set_ylim(-0.3, len(FORMATS))
    ax.axis("off")
    ax.set_title("Exponent bits set the range, mantissa bits the precision "
                 "(bf16 keeps fp32's range; fp16 keeps more precision)",
                 fontsize=10)
    return _save(fig, path)


# --- pipeline schedules (Chapter 7) ------------------------------------------------


def gpipe_schedule(p: int, m: int) -> list[list[tuple[int, str, int]]]:
    """Per stage, ``(time slot, 'F' or 'B', micro-batch)``: all forwards, then
    all backwards (GPipe), one slot per micro-batch step, backward = forward."""
    stages = []
    for s in range(p):
        ops = [(s + i, "F", i) for i in range(m)]
        end_f = p - 1 + m  # the last stage finishes its forwards at this slot
        ops += [(end_f + (p - 1 - s) + i, "B", m - 1 - i) for i in range(m)]
        stages.append(ops)
    return stages


def one_f_one_b_schedule(p: int, m: int) -> list[list[tuple[int, str, int]]]:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate one forward and
    one backward, so at most ``p - s`` micro-batches are in flight on stage s.

    Simulated slot by slot: an op runs when its input is ready (the forward
    from the stage before, the backward from the stage after).
    """
    order = []
    for s in range(p):
        warm = min(p - s, m)
        ops = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            ops.append(("B", b))
            b += 1
            if f < m:
                ops.append(("F", f))
                f += 1
        order.append(ops)
    done: dict[tuple[int, str, int], int] = {}
    stages = [[] for _ in range(p)]
    pos = [0] * p
    free = [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(order[s]):
                continue
            kind, i = order[s][pos[s]]
            dep = (s - 1, "F", i) if kind == "F" else (s + 1, "B", i)
            if kind == "B" and s == p - 1:
                dep = (s, "F", i)
            if kind == "F" and s == 0:
                ready = 0
            elif dep in done:
                ready = done[dep] + 1
            else:
                continue
            slot = max(ready, free[s])
            stages[s].append((slot, kind, i))
            done[(s, kind, i)] = slot
            free[s] = slot + 1
            pos[s] += 1
            progressed = True
        if not progressed:  # pragma: no cover - a schedule bug, not a data case
            raise RuntimeError("1F1B schedule deadlocked")
    return stages


def in_flight(ops: list[tuple[int, str, int]]) -> int:
    """Most micro-batches a stage holds activations for (forwarded, not yet back)."""
    held = most = 0
    for _, kind, _ in sorted(ops):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def _draw_schedule(ax, stages, title):
    for s, ops in enumerate(stages):
        for slot, kind, i in ops:
            color = COLORS[0] if kind == "F" else COLORS[1]
            _box(ax, slot, len(stages) - 1 - s, 1, 0.8, f"{kind}{i}", color, 7)
    end = max(slot for ops in stages for slot, _, _ in ops) + 1
    busy = sum(len(ops) for ops in stages)
    held = max(in_flight(ops) for ops in stages)
    ax.set_xlim(0, end)
    ax.set_ylim(-0.2, len(stages))
    ax.set_yticks([len(stages) - 1 - s + 0.4 for s in range(len(stages))])
    ax.set_yticklabels([f"stage {s}" for s in range(len(stages))])
    ax.set_title(f"{title}: {end} slots, idle {1 - busy / (end * len(stages)):.0%}, "
                 f"at most {held} micro-batches' activations held on a stage",
                 fontsize=10)
    ax.set_xlabel("time slot (one forward or one backward of one micro-batch)")


def pipeline_schedules(path: Path, p: int = 4, m: int = 8) -> Path:
    """GPipe and 1F1B for p stages and m micro-batches, as timelines."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2))
    _draw_schedule(axes[0], gpipe_schedule(p, m), f"GPipe, p={p}, m={m}")
    _draw_schedule(axes[1], one_f_one_b_schedule(p, m), f"1F1B, p={p}, m={m}")
    fig.tight_layout()
    return _save(fig, path)


# --- DataParallel and ring all-reduce (Chapters 5 and 6) ----------------------------


def dataparallel_step(path: Path, n: int = 3) -> Path:
    """One nn.DataParallel step: scatter, replicate, parallel_apply, gather."""
    fig, ax = plt.subplots(figsize=(10, 3.8))
    cols = ["scatter: the batch\nin n chunks", "replicate the module\n(every step)",
            "parallel_apply\n(one thread each)",
            "gather outputs on\ndevice 0, loss there",
            "backward: grads\nsummed on device 0"]
    for c, text in enumerate(cols):
        ax.text(c * 2.2 + 0.8, n + 0.2, text, ha="center", fontsize=9)
    for d in range(n):
        y = n - 1 - d
        _box(ax, 0, y, 1.6, 0.7, f"chunk {d}\n-> device {d}", COLORS[0], 8)
        _box(ax, 2.2, y, 1.6, 0.7, f"module copy {d}", COLORS[2], 8)
        _box(ax, 4.4, y, 1.6, 0.7, f"forward {d}", COLORS[4], 8)
        _arrow(ax, (1.6, y + 0.35), (2.2, y + 0.35))
        _arrow(ax, (3.8, y + 0.35), (4.4, y + 0.35))
        _arrow(ax, (6.0, y + 0.35), (6.6, n - 1 + 0.35 - 0.1 * d))
    _box(ax, 6.6, n - 1, 1.6, 0.7, "outputs + loss\n(device 0)", COLORS[3], 8)
    _box(ax, 8.8, n - 1, 1.6, 0.7, "grads of the\noriginal module", COLORS[1], 8)
    _arrow(ax, (8.2, n - 1 + 0.35), (8.8, n - 1 + 0.35))
    ax.text(9.6, n - 1.5, "every replica's\ngradients flow back\nand add up here",
            ha="center", va="top", fontsize=8)
    ax.set_xlim(-0.2, 10.6)
    ax.set_ylim(-0.3, n + 0.7)
    ax.axis("off")
    ax.set_title("nn.DataParallel: one process, one thread per device; device 0 "
                 "does the extra work and holds the extra memory", fontsize=10)
    return _save(fig, path)


def ring_allreduce(path: Path, n: int = 4) -> Path:
    """Ring all-reduce: n - 1 reduce-scatter steps, then n - 1 all-gather steps."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, phase in zip(axes, ("reduce-scatter", "all-gather"), strict=True):
        for r in range(n):
            for k in range(n):
                owner = (r + 1) % n if phase == "reduce-scatter" else r
                full = k == owner
                _box(ax, r * 1.3, n - 1 - k, 1.0, 0.8,
                     "sum" if full else ("part" if phase == "reduce-scatter"
                                         else "sum"),
                     COLORS[1] if full or phase == "all-gather" else COLORS[0], 8)
            ax.text(r * 1.3 + 0.5, n + 0.05, f"rank {r}", ha="center", fontsize=9)
        ax.text(n * 0.65 - 0.2, -0.45, "each step: every rank sends one chunk to "
                "rank + 1 (mod n)", ha="center", fontsize=8)
        ax.set_xlim(-0.2, n * 1.3)
        ax.set_ylim(-0.8, n + 0.5)
        ax.axis("off")
        ax.set_title(f"after {phase} ({n - 1} steps of 1/{n} of the buffer)",
                     fontsize=10)
    fig.suptitle("Ring all-reduce: each rank sends 2(n-1)/n of the buffer, "
                 "whatever n is", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


DIAGRAMS = {
    "number_formats.png": number_formats,
    "pipeline_schedules.png": pipeline_schedules,
    "dataparallel_step.png": dataparallel_step,
    "ring_allreduce.png": ring_allreduce,
}


def draw_all(out: Path = IMAGES_DIR) -> list[Path]:
    """Draw every diagram into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    return [draw(out / name) for name, draw in DIAGRAMS.items()]


def main(argv: list[str] | None = None) -> int:
    matplotlib.use("Agg")  # from the command line: no screen needed
    out = Path(argv[0]) if argv else IMAGES_DIR
    for path in draw_all(out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
