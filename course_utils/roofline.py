"""Plumbing of Chapter 2 (CPU vs GPU): GPU figures, peaks and plots.

The chapter measures; this module prints and draws what it measured beside the
GPU figures of other kinds, so that the chapter's cells stay about the lesson:

- ``show``: the recorded, published and predicted GPU figures of one
  experiment, one line each, **each source printed once** - in full the
  first time it is cited in the notebook, as ``[n]`` after that;
- ``doubling_seconds`` and ``seed_gpu_columns``: the seed's own GPU column
  and the calibrated prediction of the synchronised one (Section 2);
- ``plot_doubling_sweep`` and ``crossing``: the CPU/GPU sweep and where the
  curves cross (Section 3);
- ``gpu_peaks`` and ``plot_roofline``: a GPU's datasheet peaks from what it
  reports, and the roofline plot (Section 6);
- ``error_line``: run a script in a fresh interpreter and report the line its
  traceback points at (``CUDA_LAUNCH_BLOCKING``, Section 2).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from course_utils import plots, predict, reference
from course_utils.bench import Sweep, format_seconds

# --- figures, each source cited once ---------------------------------------------

_CITED: dict[str, int] = {}


def reset_sources() -> None:
    """Forget which sources were printed (a fresh notebook starts with none)."""
    _CITED.clear()


def cite_once(text: str) -> tuple[str, list[str]]:
    """``text`` with every published source in it replaced by ``[n]``.

    Returns the shortened text and the footnotes ``'[n] source'`` of the
    sources cited here for the first time; a source seen before keeps its
    number and is not printed again.
    """
    new = []
    cites = {reference.cite(e) for e in reference.published_entries().values()}
    for c in sorted(cites, key=len, reverse=True):  # longer first: no partial hits
        if c in text:
            if c not in _CITED:
                _CITED[c] = len(_CITED) + 1
                new.append(f"[{_CITED[c]}] {c}")
            text = text.replace(c, f"[{_CITED[c]}]")
    return text, new


def show(name: str, figures=(), unit: str = "", lines=None,
         fmt: str = "{:.4g}") -> list[reference.Figure]:
    """Print the GPU figures of experiment ``name``, recorded ones first.

    ``figures`` are published or predicted ``reference.Figure`` objects;
    ``lines(figure)`` may return more lines to print under a figure (a table).
    Sources are printed once (see ``cite_once``). Raises ``ValueError`` when
    there is no GPU figure at all, as ``reference.show`` does.
    """
    this_gpu = (torch.cuda.get_device_name() if torch.cuda.is_available()
                else None)
    shown = [f for f in reference.recorded(name)
             if not (reference.recording() and f.device == this_gpu)]
    shown += sorted(figures, key=lambda f: reference.KINDS.index(f.kind))
    if not shown:
        raise ValueError(f"{name}: no GPU figure to show; pass a published or "
                         "predicted figure")
    for f in shown:
        label, notes = cite_once(f.label)
        print(f"{name}: {f.format_value(fmt)} {f.unit or unit}".rstrip()
              + f"  [{label}]")
        for line in (lines(f) if lines else []) or []:
            print(f"    {line}")
        for note in notes:
            print(f"      {note}")
    return shown


def curve_xy(value) -> tuple[list, list]:
    """(sizes, seconds) of a recorded table or a published/predicted curve."""
    if "x" in value:
        return value["x"], value["y"]
    return value["sizes"], value.get("seconds") or value.get("median")


# --- Section 2: the seed's table ---------------------------------------------------


def doubling_seconds(size: int, steps: int = 1000,
                     gpu: str = "h100_sxm") -> reference.Figure:
    """Calibrated time of ``steps`` doublings of a size x size float32 tensor.

    Each step costs the larger of PyTorch's launch cost and the GPU's time to
    read and write the tensor at the bandwidth copies reach
    (``predict.kernel_seconds``).
    """
    return predict.kernel_seconds(size * size, 2 * 4 * size * size, gpu,
                                  launches=steps)


def seed_gpu_columns(sizes, gpu: str = "h100_sxm") -> reference.Figure:
    """Print the seed's GPU column and the predicted synchronised one.

    Returns the seed's published figure (a curve), which the sweep plot of
    Section 3 draws again.
    """
    seed = reference.published("seed000.gpu_add_loop_seconds")
    predicted = {s: doubling_seconds(s, gpu=gpu) for s in sizes}
    right = reference.predicted(
        {"x": list(predicted), "y": [f.value for f in predicted.values()]},
        "s", predict.gpu_name(gpu),
        "1000 x max(launch cost, time to read and write the tensor at "
        f"{predict.memory_efficiency():.0%} of the datasheet's "
        f"{predict.memory_bandwidth(gpu) / 1e9:,.0f} GB/s; that fraction is what a "
        "T4's device-to-device copy reaches of its own datasheet bandwidth)",
        [f"{gpu}.memory_bandwidth_gbps", *predict.LAUNCH_INPUTS,
         *predict.MEMORY_EFFICIENCY_INPUTS])

    def table(fig):
        pairs = zip(*curve_xy(fig.value), strict=True)
        return [", ".join(f"{s}: {format_seconds(t)}" for s, t in pairs)]

    for key, extra in (("gpu_seed", seed), ("gpu_right", right)):
        show(f"02.seed_table_{key}", figures=[extra], lines=table)
    small = predicted[min(sizes)].value
    print(f"caveat: the small sizes are launch-bound ({format_seconds(small)} for "
          f"1000 launches at {predict.launch_overhead() * 1e6:.1f} us each) and no "
          "published measurement supports that within 2x: the seed's own loop "
          f"took {seed.value['y'][0] / small:.0f} x as long, on a machine it does "
          "not name and with tensor creation inside its timer")
    return seed


def error_line(script: str, blocking: bool, timeout: float = 120) -> str:
    """Run ``script`` in a fresh interpreter; the line its traceback points at.

    ``CUDA_LAUNCH_BLOCKING`` is set to 1 or 0 for that process only (it must be
    set before CUDA initialises, and a device-side error leaves a process's
    CUDA context unusable: hence a fresh process each time).
    """
    with tempfile.TemporaryDirectory(prefix="ch02-") as folder:
        path = Path(folder) / "async_error.py"
        path.write_text(script)
        env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1" if blocking else "0"}
        proc = subprocess.run([sys.executable, str(path)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    lines = re.findall(r'File ".*async_error\.py", line (\d+)', proc.stderr)
    if proc.returncode == 0 or not lines:
        return f"no error reported (exit code {proc.returncode})"
    n = int(lines[-1])
    return f"line {n}: {script.splitlines()[n - 1].split('#')[0].strip()}"


# --- Section 3: the sweep ------------------------------------------------------------


def _times_1000(s: Sweep, label: str) -> Sweep:
    def scale(values):
        return None if values is None else [v * 1000 for v in values]
    return Sweep(label, list(s.sizes), scale(s.median), scale(s.iqr),
                 scale(s.low), scale(s.high))


def plot_doubling_sweep(sweeps, gpu_sizes, seed, seed_style=None,
                        gpu: str = "h100_sxm"):
    """The per-step sweeps x 1000 beside the GPU curves of other kinds.

    ``sweeps`` are measured here; ``seed`` is the seed's published curve;
    ``seed_style`` the seed's way (no sync) measured on this GPU, if any. The
    predicted curve and recorded GPU curves are added here. Returns the axes.
    """
    shown = [_times_1000(s, s.label) for s in sweeps]
    floor = reference.predicted(
        {"x": list(gpu_sizes), "y": [doubling_seconds(s, gpu=gpu).value
                                     for s in gpu_sizes]}, "s",
        predict.gpu_name(gpu),
        "1000 x max(launch cost, (read + write n x n float32) / achieved HBM "
        "bandwidth); small sizes uncalibrated",
        [*predict.LAUNCH_INPUTS, *predict.MEMORY_EFFICIENCY_INPUTS])
    for fig in show("02.doubling_sweep_gpu", unit="s", figures=[floor, seed]):
        if fig.kind == "recorded" and seed_style is None:
            v = fig.value
            shown.append(_times_1000(Sweep("", v["sizes"], v["median"], v["iqr"],
                                           v.get("low"), v.get("high")), fig.legend))
    ax = plots.plot_time_vs_size(shown, xlabel="tensor size n (n x n float32)",
                                 ylabel="time for 1000 doublings (s)",
                                 title="a += a, 1000 times: synchronised median x 1000")
    ax.plot(*curve_xy(floor.value), color="tab:green", label=floor.legend,
            **plots.figure_style("predicted"))
    ax.plot(*curve_xy(seed.value), color="black",
            label=seed.legend + " (the seed's way: no sync)",
            **plots.figure_style("published"))
    if seed_style is not None:
        ax.plot(gpu_sizes, seed_style, "k--", marker="x",
                label="GPU, seed's way (no sync)")
    else:
        for fig in reference.recorded("02.seed_style_sweep_gpu"):
            ax.plot(fig.value["sizes"], fig.value["seconds"], color="gray",
                    marker="x", label=f"{fig.legend}, seed's way (no sync)")
    ax.legend(fontsize=7, loc="upper left")
    return ax


def crossing(cpu: Sweep, gpu_curve=None, gpu: str = "h100_sxm") -> None:
    """Print where a GPU curve (measured or recorded) beats the CPU sweep.

    Without one, print the predicted ratio at the largest CPU size: the ratio
    of the two memory bandwidths, the most a larger size can give.
    """
    if gpu_curve is None:
        for e in reference.lookup("02.doubling_sweep_gpu"):
            gpu_curve = (e["value"]["sizes"], e["value"]["median"])
    cpu_at = dict(zip(cpu.sizes, cpu.median, strict=True))
    if gpu_curve is None:
        n = cpu.sizes[-1]
        gpu_s = doubling_seconds(n, steps=1, gpu=gpu).value
        print("no measured or recorded GPU curve: the crossing depends on a GPU's "
              "launch cost, which no published measurement pins down within 2x.")
        print(f"at n = {n}: CPU here {format_seconds(cpu_at[n])} per step, "
              f"{predict.gpu_name(gpu)} predicted {format_seconds(gpu_s)} "
              f"(memory-bound): {cpu_at[n] / gpu_s:.0f}x, the ratio of the two "
              "memory bandwidths")
        return
    gpu_at = dict(zip(*gpu_curve, strict=True))
    common = [s for s in cpu.sizes if s in gpu_at]
    faster = [s for s in common if gpu_at[s] < cpu_at[s]]
    print("CPU faster at n =", [s for s in common if s not in faster])
    print("GPU faster at n =", faster)
    if common:
        s = common[-1]
        print(f"at n = {s}: GPU {cpu_at[s] / gpu_at[s]:.1f}x faster than one CPU "
              "thread")


# --- Section 6: the roofline ---------------------------------------------------


def gpu_peaks(dev: torch.device) -> tuple[float | None, float | None, str]:
    """(peak float32 FLOP/s, peak bytes/s, where they come from) for GPU ``dev``.

    SMs x float32 lanes per SM (Chapter 1's table) x 2 x clock, and 2 (double
    data rate) x memory clock x bus width, from what the device reports
    (``torch.cuda.get_device_properties``; pycuda's attributes where an older
    torch lacks the clocks).
    """
    from course_utils.devices import FP32_LANES_PER_SM, pycuda_facts

    props = torch.cuda.get_device_properties(dev)
    clock_khz = getattr(props, "clock_rate", 0)
    mem_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    source = "torch.cuda.get_device_properties"
    if not (clock_khz and mem_khz and bus_bits):
        facts = pycuda_facts()
        if isinstance(facts, str):
            return None, None, facts
        attrs = facts[dev.index or 0]["attributes"]
        clock_khz, mem_khz = attrs.get("CLOCK_RATE"), attrs.get("MEMORY_CLOCK_RATE")
        bus_bits = attrs.get("GLOBAL_MEMORY_BUS_WIDTH")
        source = "pycuda device attributes"
    lanes = FP32_LANES_PER_SM.get((props.major, props.minor))
    sms = props.multi_processor_count
    flops = sms * lanes * 2 * clock_khz * 1e3 if lanes and clock_khz else None
    bw = 2 * mem_khz * 1e3 * bus_bits / 8 if mem_khz and bus_bits else None
    if flops is None and bw is None:
        return None, None, f"{source} gave no clock or bus width"
    return flops, bw, f"data-sheet peaks from {source}"


def _roof(ax, peak, bw, color, label, note, **style):
    if peak is None:  # the bandwidth roof alone, over the elementwise region
        xs = [2.0**k for k in range(-6, 3)]
        ys = [bw * x for x in xs]
    else:  # both roofs, through the ridge point where they meet
        xs = sorted([*(2.0**k for k in range(-6, 12)), peak / bw])
        ys = [min(peak, bw * x) for x in xs]
    ax.plot(xs, ys, color=color, lw=1.5, label=f"{label} roof ({note})", **style)


def _points(ax, points, color, label):
    for kind, marker in (("matmul", "o"), ("add", "s")):
        pts = points[kind]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color,
                   marker=marker, label=f"{kind}: {label}")
        for intensity, flops, n in pts:
            ax.annotate(f"{n}", (intensity, flops), fontsize=7, xytext=(4, -3),
                        textcoords="offset points", color=color)


def plot_roofline(cpu_peak, cpu_bw, cpu_points, gpu_roof=None,
                  published=None):
    """The roofline plot: this CPU's roofs and points, a GPU's, a datasheet's.

    ``cpu_points`` / ``gpu_roof["points"]``: ``{"matmul": [...], "add": [...]}``
    of ``[FLOP per byte, FLOP/s, n]``. ``gpu_roof`` (measured or recorded) has
    ``peak_flops``, ``peak_bw``, ``copy_bw``, ``peaks_from`` and ``label``;
    ``published`` is a (peak TFLOP/s, bandwidth GB/s) pair of Figures.
    """
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    _roof(ax, cpu_peak, cpu_bw, "tab:blue", "CPU",
          "peak estimated for 1 FMA unit, bandwidth measured")
    ax.hlines(2 * cpu_peak, 2 * cpu_peak / cpu_bw, 2.0**11, color="tab:blue", lw=1,
              linestyles="dashed", label="CPU peak if 2 FMA units (estimate)")
    _points(ax, cpu_points, "tab:blue", "CPU (here)")
    if gpu_roof is not None:
        peak = gpu_roof["peak_flops"]
        bw = gpu_roof["peak_bw"] or gpu_roof["copy_bw"]
        note = (gpu_roof["peaks_from"] if gpu_roof["peak_bw"] else
                "bandwidth: copy measured" + ("" if peak else "; peak unknown"))
        _roof(ax, peak, bw, "tab:green", "GPU", note)
        _points(ax, gpu_roof["points"], "tab:green", gpu_roof["label"])
    if published is not None:
        peak, bw = published
        _roof(ax, peak.value * 1e12, bw.value * 1e9, "tab:gray", peak.device,
              "published datasheet peaks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("achieved FLOP/s (float32)")
    ax.set_title("Roofline: measured matmul and add against the peaks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return ax
