"""Chapter 3's plumbing: GPU figures, plots, timelines and GPU-only demos.

Chapter 3 ("Streams and asynchronous execution") shows the code it teaches;
this module holds what it only needs to *show*: the GPU figures of each
experiment (recorded, published or predicted, each printed with its kind),
the plots and timelines, the models behind the predicted figures, and the
longer GPU-only measurements (events around every matmul, the copy-stream
demo, the two-device timing). Every GPU function here runs only when the
chapter has a GPU and is written against the pinned torch's stream API.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyBboxPatch, Patch

from course_utils import predict, reference
from course_utils.plots import FIGURE_STYLE, figure_style, plot_timeline

H100 = predict.gpu_name("h100_sxm")
H100_PCIE5 = "an H100 SXM on PCIe 5.0 x16"
COPY_INPUTS = ["h100_sxm.fp32_tflops", "pcie5_x16.bandwidth_per_direction_gbps",
               *predict.PCIE_EFFICIENCY_INPUTS]
MATMUL_INPUTS = ["h100_sxm.sm_count", "h100_sxm.fp32_tflops"]


# --- small helpers ---------------------------------------------------------------


def overlap_seconds(a: Sequence, b: Sequence) -> float:
    """How long spans a and b (lane, start, end, ...) ran at the same time."""
    return max(0.0, min(a[2], b[2]) - max(a[1], b[1]))


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time among ``runs`` (dicts with a "wall" key)."""
    return sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]


def matmul_seconds(n: int) -> float:
    """One n x n float32 matmul on an H100, by the course's kernel model.

    ``predict.kernel_seconds``, the model Chapter 2 prints for the same
    matmul, so the two chapters give one time for one setup.
    """
    return predict.kernel_seconds(2 * n**3, 3 * 4 * n * n, "h100_sxm", "fp32").value


def matmul_caveat(more: str = "") -> str:
    """The caveat of a prediction whose matmuls run at the kernel model's pace."""
    return (predict.kernel_caveat("compute", "fp32") or "not calibrated") + more


def h2d_caveat() -> str:
    """Host-to-device copies are out of the calibration's scope: how far off."""
    pub = reference.published_entry("bwtest.a100_pcie_pinned_h2d_gbps")["value"]
    model = predict.achieved_link_bandwidth("pcie4_x16") / 1e9
    return ("; host-to-device copies are not checked: a published A100 PCIe "
            f"server's pinned ones reached {pub / model:.2f}x this model's rate")


def two_stream_speedup(n: int, tile: int = 128) -> float:
    """Speed-up of two concurrent n x n matmuls over one after the other.

    A matmul kernel hands each SM tiles of the output (``tile`` x ``tile`` is
    an assumed, typical size); one with fewer tiles than SMs leaves SMs idle
    for a second stream to use.
    """
    sms = reference.published_entry("h100_sxm.sm_count")["value"]
    tiles = max(1, (n // tile) ** 2)
    return min(2 * tiles, sms) / min(tiles, sms)


def copy_seconds(nbytes: float, pinned: bool = True) -> float:
    """Calibrated time of one host-device copy over PCIe 5.0 x16."""
    return predict.calibrated_copy_seconds(nbytes, "pcie5_x16", pinned=pinned).value


def show_gpu(name: str, figures=(), print_value: Callable | None = None,
             local=None, device: torch.device | str = "cpu", unit: str = ""):
    """Every figure of GPU experiment ``name``, printed with its kind.

    ``local`` is this run's GPU result (only with a GPU here); recorded ones
    are looked up by name; ``figures`` are published or predicted ones.
    ``print_value(value)``, if given, prints each figure's value in detail.
    """
    here = device if local is not None else "cpu"
    shown = reference.show(name, local=local, unit=unit, local_device=here,
                           figures=list(figures))
    if print_value is not None:
        for fig in shown:
            print_value(fig.value)
    return shown


def mark_kind(ax, fig) -> None:
    """Hatch the bars on ``ax`` by the kind of ``fig`` and name it in a legend."""
    hatch = FIGURE_STYLE[fig.kind]["hatch"]
    for bar in ax.patches:
        bar.set_hatch(hatch)
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch=hatch,
                             label=fig.legend)], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)


def plot_runs(panels: Sequence[tuple], kind_of=None, lanes=None, unit: str = "ms",
              xlabel: str | None = None) -> None:
    """One timeline per (spans, title) panel, stacked; bars hatched by kind."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.8 * len(panels) + 0.4),
                             sharex=True, squeeze=False)
    for ax, (spans, title) in zip(axes[:, 0], panels, strict=True):
        plot_timeline(spans, ax=ax, lanes=lanes, title=title, unit=unit)
        if kind_of is not None:
            mark_kind(ax, kind_of)
        if xlabel:
            ax.set_xlabel(xlabel)
    fig.tight_layout()
    plt.show()


def show_timelines(name: str, local, panels, title: str, describe=None, figures=(),
                   device="cpu") -> None:
    """For each figure of ``name``: a timeline per (key, panel title), by kind."""
    for f in show_gpu(name, figures, local=local, device=device):
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.9 * len(panels) + 0.6),
                                 sharex=True, squeeze=False)
        for ax, (key, panel_title) in zip(axes[:, 0], panels, strict=True):
            plot_timeline(f.value[key], ax=ax, title=panel_title)
            mark_kind(ax, f)
        fig.suptitle(f"{title}\n{textwrap.shorten(f.label, 110)}", fontsize=9)
        fig.tight_layout()
        plt.show()
        if describe is not None:
            print(describe(f.value))


def _print_dict(value) -> None:
    print("  ", {k: f"{v:,.4g}" if isinstance(v, (int, float)) else v
                 for k, v in value.items()})


# --- section 2: the races -----------------------------------------------------------


def race_verdict(value: dict) -> str:
    """What the unordered sum of the stream race saw."""
    v = value["none"] / value["expected"]
    if v == 1:
        return ("the unordered sum happened to be right: the race did not show "
                "this time (which is what makes such bugs survive)")
    return f"the unordered sum saw {v:.0%} of the ones: the race showed"


def show_race(race: dict | None, device) -> None:
    """The stream race: this GPU's sums (if any), recorded ones, CUDA's rule."""
    if race is not None:
        for k, v in race.items():
            print(f"{k:>12}: {v:,.0f}")
        print(race_verdict(race))
        reference.record("03.race", race, "sum of a 2048x2048 tensor of ones", device)
    rule = reference.predicted(
        {"expected": 2048 * 2048, "none": "less (read while still being written)",
         "wait_stream": 2048 * 2048, "event": 2048 * 2048, "synchronize": 2048 * 2048},
        "sum of a 2048x2048 tensor of ones", "any CUDA GPU",
        "CUDA semantics: streams are unordered unless a wait_stream, an event or a "
        "synchronize orders them")

    def detail(value):
        _print_dict(value)
        if all(isinstance(v, (int, float)) for v in value.values()):
            print("  ", race_verdict(value))

    show_gpu("03.race", [rule], detail)


def show_allocator_race(alloc: dict | None, device) -> None:
    """The record_stream race: this GPU's sums (if any), recorded ones, the rule."""
    if alloc is not None:
        for k, v in alloc.items():
            print(f"{k:>22}: {v:,.0f}")
        reference.record("03.allocator_race", alloc, "sum of a tensor of ones", device)
    rule = reference.predicted(
        {"without record_stream": "may be less: the memory is reused while the side "
         "stream still reads it", "with record_stream": "always the full sum"},
        "sum of a tensor of ones", "any CUDA GPU",
        "PyTorch docs (Tensor.record_stream): the caching allocator reuses a freed "
        "block on its own stream unless the tensor is marked as used by another")
    show_gpu("03.allocator_race", [rule], _print_dict)


def show_d2h_trap(trap: dict | None, device) -> None:
    """The device-to-host non_blocking trap: fractions read right, and the rule."""
    if trap is not None:
        for k, v in trap.items():
            print(f"{k}: {v:.0%} of the host tensor holds the right value")
        reference.record("03.d2h_trap", trap, "fraction of correct values", device)
    rule = reference.predicted(
        {"read at once": "some or none (the copy has not run yet)",
         "read after event.synchronize()": 1.0},
        "fraction of correct values", "any CUDA GPU",
        "CUDA semantics: a device-to-host non_blocking copy returns before it runs")
    show_gpu("03.d2h_trap", [rule], lambda v: print("  ", {
        k: f"{x:.0%} correct" if isinstance(x, float) else x for k, x in v.items()}))


# --- section 3: two matmuls on two streams -----------------------------------------

STREAM_SIZES = [256, 512, 1024, 2048, 4096, 8192]


def _timed_event():
    return torch.cuda.Event(enable_timing=True)


def two_matmuls(n: int, reps: int, side, device) -> tuple[float, list[tuple]]:
    """Queue ``reps`` x (A@B on the default stream, C@D on ``side``) and time it.

    ``side`` may be the default stream itself (one stream). Returns the total
    seconds and, per matmul, the span between events recorded just before and
    just after it on its stream.
    """
    a, b, c, d = (torch.randn(n, n, device=device) for _ in range(4))
    main = torch.cuda.current_stream(device)
    lane = "default stream" if side == main else "side stream"
    start, end, marks = _timed_event(), _timed_event(), []
    torch.cuda.synchronize(device)
    start.record(main)
    side.wait_stream(main)  # c and d were made on the default stream
    for _ in range(reps):
        for stream, name, x, y, label in ((main, "default stream", a, b, "A@B"),
                                          (side, lane, c, d, "C@D")):
            with torch.cuda.stream(stream):
                e0, e1 = _timed_event(), _timed_event()
                e0.record()
                x @ y
                e1.record()
            marks.append((name, e0, e1, label))
    main.wait_stream(side)
    end.record(main)
    torch.cuda.synchronize(device)
    spans = [(name, start.elapsed_time(e0) / 1e3, start.elapsed_time(e1) / 1e3, lab)
             for name, e0, e1, lab in marks]
    return start.elapsed_time(end) / 1e3, spans


def two_stream_sweep(side, device) -> dict:
    """On a GPU: one stream vs two over STREAM_SIZES, warmed up; recorded."""
    main = torch.cuda.current_stream(device)
    out = {"sizes": STREAM_SIZES, "one_stream_s": [], "two_streams_s": []}
    for n in STREAM_SIZES:
        reps = int(min(50, max(5, 4e12 / (2 * n**3))))
        two_matmuls(n, 2, side, device)  # warm-up: cuBLAS, allocator, kernel choice
        t1 = min(two_matmuls(n, reps, main, device)[0] for _ in range(3))
        t2 = min(two_matmuls(n, reps, side, device)[0] for _ in range(3))
        out["one_stream_s"].append(t1)
        out["two_streams_s"].append(t2)
        print(f"n={n:5d} x{reps:2d}: one stream {t1 * 1e3:8.2f} ms, "
              f"two streams {t2 * 1e3:8.2f} ms, speed-up {t1 / t2:.2f}x")
    reference.record("03.two_streams", out, "s", device)
    return out


TWO_STREAM_CAVEAT = ("not calibrated: no published measurement of two concurrent "
                     "matmuls of a stated size was found; the tile size is assumed")


def plot_two_streams(sweep: dict | None, cpu_ratio: float, cpu_n: int,
                     device="cpu") -> None:
    """Speed-up of a second stream: this GPU, recorded, predicted, the seed's, CPU."""
    predicted = reference.predicted(
        {"sizes": STREAM_SIZES,
         "one_stream_s": [2 * matmul_seconds(n) * two_stream_speedup(n)
                          for n in STREAM_SIZES],
         "two_streams_s": [2 * matmul_seconds(n) for n in STREAM_SIZES]},
        "s", H100,
        "two matmuls at the kernel model's pace; one stream runs them one after the "
        "other, two streams at once as far as SMs are free: speed-up = min(2 tiles, "
        "SMs) / min(tiles, SMs), 128 x 128 output tiles assumed", MATMUL_INPUTS,
        caveat=TWO_STREAM_CAVEAT)
    seed = reference.published("seed003.matmul_one_vs_two_streams_seconds")
    runs = [r for r in seed.value if r["one_stream_s"]]
    seed_speedup = sum(r["one_stream_s"] / r["multiple_streams_s"]
                       for r in runs) / len(runs)
    figures = show_gpu("03.two_streams", [predicted, seed], local=sweep, device=device)
    print(f"the seed's runs: one stream / two streams = {seed_speedup:.2f}x on "
          "average (no warm-up; GPU and matrix sizes not stated)")
    fig, ax = plt.subplots(figsize=(7, 4))
    for f in figures:
        if f is seed:
            ax.axhline(seed_speedup, color="tab:red", **figure_style("published"),
                       label=f"{f.legend} (size not stated)")
        elif isinstance(f.value, dict):
            v = f.value
            ratios = [a / b for a, b in zip(v["one_stream_s"], v["two_streams_s"],
                                            strict=True)]
            ax.plot(v["sizes"], ratios, label=f.legend, **figure_style(f.kind))
    cpu = reference.measured(cpu_ratio, "x", "cpu")
    ax.plot([cpu_n], [cpu_ratio], color="black", ms=8,
            label=f"{cpu.legend} (two threads, one core each)",
            **figure_style("measured"))
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xscale("log", base=2)
    ticks = STREAM_SIZES + [cpu_n]
    ax.set_xticks(ticks, [str(n) for n in ticks], fontsize=7)
    ax.set_ylim(min(0.5, 0.8 * cpu_ratio), max(2.3, 1.2 * cpu_ratio))
    ax.set_xlabel("matrix size n (n x n matmuls, log scale)")
    ax.set_ylabel("one stream (thread) time / two")
    ax.set_title("Two independent matmuls: speed-up of a second stream or thread",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    plt.show()


def both_streams_busy(timelines: dict) -> str:
    """The share of each run during which a matmul ran on each stream at once."""
    parts = []
    for key, spans in timelines.items():
        lanes = list(dict.fromkeys(sp[0] for sp in spans))
        both = 0.0
        if len(lanes) == 2:
            first = [sp for sp in spans if sp[0] == lanes[0]]
            second = [sp for sp in spans if sp[0] == lanes[1]]
            both = sum(overlap_seconds(m, o) for m in first for o in second)
        total = max(sp[2] for sp in spans) - min(sp[1] for sp in spans)
        parts.append(f"{key}: {both / total:.0%}")
    return "time with two matmuls running at once - " + "; ".join(parts)


def kernel_spans(run: Callable, device) -> list[tuple]:
    """Run ``run()`` under torch.profiler: the GPU kernels, one lane per stream."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA
               and not any(w in e.name.lower() for w in ("memcpy", "memset", "sleep"))]
    t0 = min((e.time_range.start for e in kernels), default=0)  # none: []
    return [(f"GPU stream {e.device_resource_id}", (e.time_range.start - t0) / 1e6,
             (e.time_range.end - t0) / 1e6, "mm") for e in kernels]


def _predicted_matmul_spans(n: int, reps: int, two_streams: bool) -> list[tuple]:
    t, spans, clock = matmul_seconds(n), [], 0.0
    together = two_streams and two_stream_speedup(n) > 1.5
    for _ in range(reps):
        if together:
            spans += [("default stream", clock, clock + t, "A@B"),
                      ("side stream", clock, clock + t, "C@D")]
            clock += t
        else:
            lane = "side stream" if two_streams else "default stream"
            spans += [("default stream", clock, clock + t, "A@B"),
                      (lane, clock + t, clock + 2 * t, "C@D")]
            clock += 2 * t
    return spans


def show_two_stream_timelines(side, device) -> None:
    """Event spans of 4 x (A@B, C@D) at n = 1024 (this GPU's, recorded, predicted);
    on a GPU also the kernels as torch.profiler saw them."""
    local = None
    if device.type == "cuda":
        main = torch.cuda.current_stream(device)
        local = {"one_stream": two_matmuls(1024, 4, main, device)[1],
                 "two_streams": two_matmuls(1024, 4, side, device)[1]}
        reference.record("03.two_streams_timeline", local, "s", device)
    predicted = reference.predicted(
        {"one_stream": _predicted_matmul_spans(1024, 4, False),
         "two_streams": _predicted_matmul_spans(1024, 4, True)},
        "s", H100, "the two-stream model above for n = 1024 (64 tiles, 132 SMs)",
        MATMUL_INPUTS, caveat=TWO_STREAM_CAVEAT)
    show_timelines("03.two_streams_timeline", local,
                   [("one_stream", "A@B and C@D on ONE stream"),
                    ("two_streams", "A@B on the default stream, C@D on a side stream")],
                   "4 x (A@B, C@D), 1024x1024 matmuls - event spans (or the model's)",
                   describe=both_streams_busy, figures=[predicted], device=device)
    if device.type == "cuda":
        main = torch.cuda.current_stream(device)
        kernels = {"one_stream": kernel_spans(
                       lambda: two_matmuls(1024, 4, main, device), device),
                   "two_streams": kernel_spans(
                       lambda: two_matmuls(1024, 4, side, device), device)}
        if not all(kernels.values()):  # no CUPTI (some containers, some drivers)
            print("torch.profiler saw no GPU kernels here (its CUDA activity "
                  "tracing is unavailable): no kernel timeline")
            return
        plot_runs([(spans, f"{key}: kernels as torch.profiler saw them")
                   for key, spans in kernels.items()],
                  kind_of=reference.measured(0.0, "s", device))
        print(both_streams_busy(kernels).replace("matmuls", "kernels"))


# --- section 4: pinned memory ------------------------------------------------------

H2D_SIZES = [2**k for k in range(16, 29, 2)]  # 64 KiB .. 256 MiB


def h2d_gbps(nbytes: int, pinned: bool, device) -> float:
    """Host-to-device bandwidth from pinned or pageable memory (GPU only)."""
    from course_utils import bench

    src = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pinned)
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    t = bench(dst.copy_, src, min_run_time=0.1)  # bench waits for the GPU
    return nbytes / t.median / 1e9


def plot_h2d(device, ram_sizes: list[int], ram_gbps: list[float]) -> None:
    """Host-to-device bandwidth: this GPU's sweep (with a GPU), recorded ones, the
    calibrated prediction, the links' and a server's published figures, and the
    RAM-to-RAM copy measured here."""
    local = None
    if device.type == "cuda":
        local = {"bytes": H2D_SIZES,
                 "pageable_GBps": [h2d_gbps(b, False, device) for b in H2D_SIZES],
                 "pinned_GBps": [h2d_gbps(b, True, device) for b in H2D_SIZES]}
        reference.record("03.h2d_bandwidth", local, "GB/s", device)
    pinned_rate = predict.achieved_link_bandwidth("pcie4_x16") / 1e9
    pageable_rate = 1 / predict.calibrated_copy_seconds(1e9, "pcie4_x16",
                                                        pinned=False).value
    predicted = reference.predicted(
        {"bytes": H2D_SIZES, "pinned_GBps": [pinned_rate] * len(H2D_SIZES),
         "pageable_GBps": [pageable_rate] * len(H2D_SIZES)},
        "GB/s", "a GPU on PCIe 4.0 x16",
        f"calibrated: pinned copies at {predict.pcie_efficiency():.0%} of the link's "
        "rate; pageable ones add the driver's copy into a pinned staging buffer, at "
        f"{predict.host_copy_rate() / 1e9:.3g} GB/s (both from bandwidthTest on a "
        "DGX A100); no latency, so small copies are slower",
        [*predict.PCIE_EFFICIENCY_INPUTS, *predict.PAGEABLE_INPUTS])
    links = [reference.published("pcie4_x16.bandwidth_per_direction_gbps"),
             reference.published("pcie5_x16.bandwidth_per_direction_gbps")]
    server = {k: reference.published(f"bwtest.a100_pcie_{k}_gbps")
              for k in ("pinned_h2d", "pageable_h2d", "pinned_d2h", "pageable_d2h")}
    figures = show_gpu("03.h2d_bandwidth", [predicted, *links, *server.values()],
                       local=local, device=device, unit="GB/s")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for f, color in zip(figures, plt.cm.tab10.colors, strict=False):
        if isinstance(f.value, dict):
            for key, word in (("pinned_GBps", "pinned"), ("pageable_GBps", "pageable")):
                ax.plot(f.value["bytes"], f.value[key], color=color,
                        alpha=1.0 if word == "pinned" else 0.55,
                        label=f"{f.legend}: {word}", **figure_style(f.kind))
        elif f.extra["id"].startswith("bwtest."):
            ax.plot([32e6], [f.value], color=color, linestyle="none",
                    marker="o" if "pinned" in f.extra["id"] else "s",
                    label=f"A100 PCIe server, {f.extra['quantity']}: published")
        else:
            link = f.extra["id"].split(".")[0]  # pcie4_x16 -> PCIe 4.0 x16
            link = link.replace("pcie", "PCIe ").replace("_x", ".0 x")
            ax.axhline(f.value, color=color, label=f"{link} link, one way: published",
                       **figure_style("published"))
    ax.plot(ram_sizes, ram_gbps, color="black",
            label=f"{reference.device_name('cpu')}, measured here: RAM to RAM copy "
                  "(one thread)", **figure_style("measured"))
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, None)
    ax.set_xticks(H2D_SIZES, [f"{b // 1024} KiB" if b < 2**20 else f"{b // 2**20} MiB"
                              for b in H2D_SIZES])
    ax.set_xlabel("size of the copy (log scale)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title("Host-to-device copies: pinned vs pageable, and a RAM copy here",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    plt.show()
    for key, pred in (("pinned_h2d", pinned_rate), ("pageable_h2d", pageable_rate)):
        ratio = pred / server[key].value
        print(f"{server[key].extra['quantity']}: predicted {pred:.3g} GB/s, published "
              f"{server[key].value:g} GB/s on an A100 PCIe server (ratio {ratio:.2f})")
        print("  " + predict.caveat(f"bwtest.a100_pcie_{key}_gbps"))


def lock_fresh_pages_seconds(nbytes: int) -> float | None:
    """``mlock`` ``nbytes`` of fresh memory (what pinning asks of the OS).

    Seconds, or None where the system refuses (unprivileged processes may lock
    only a little memory) or has no ``mlock``.
    """
    import ctypes
    import ctypes.util
    import mmap

    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path, use_errno=True) if path else None
    if libc is None or not hasattr(libc, "mlock"):
        return None
    with mmap.mmap(-1, nbytes) as fresh:  # new pages from the OS, never touched
        buf = ctypes.c_char.from_buffer(fresh)
        addr, size = ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(nbytes)
        t0 = time.perf_counter()
        refused = libc.mlock(addr, size)
        seconds = time.perf_counter() - t0
        if not refused:
            libc.munlock(addr, size)
        del buf
    return None if refused else seconds


# --- section 5: copies back to the CPU ---------------------------------------------

COPY_MODES = ("pageable, one stream", "pinned non_blocking, one stream", "copy stream")


def compute_and_copy(x: torch.Tensor, k: int, mode: str, side, device):
    """k matmuls, each result copied to the CPU in one of COPY_MODES (GPU only).

    "copy stream": each copy waits (an event) only for its own result, runs
    on ``side`` into pinned memory, and ``record_stream`` keeps the result alive
    until it is copied. Returns (seconds, spans, host results).
    """
    main = torch.cuda.current_stream(device)
    pinned = mode != "pageable, one stream"
    host = [torch.empty(x.shape, pin_memory=pinned) for _ in range(k)]
    start, end, marks, ys = _timed_event(), _timed_event(), [], []
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    start.record(main)
    for i in range(k):
        e0, e1 = _timed_event(), _timed_event()
        e0.record(main)
        ys.append(x @ x)
        e1.record(main)
        marks.append(("compute", e0, e1, f"y{i}"))
        if mode == "copy stream":
            side.wait_event(e1)  # copy y_i as soon as y_i is ready
            with torch.cuda.stream(side):
                c0, c1 = _timed_event(), _timed_event()
                c0.record()
                host[i].copy_(ys[i], non_blocking=True)
                c1.record()
            ys[i].record_stream(side)
            marks.append(("copy", c0, c1, f"y{i}"))
    if mode != "copy stream":  # the seed's order: every copy after every matmul
        for i in range(k):
            c0, c1 = _timed_event(), _timed_event()
            c0.record(main)
            host[i].copy_(ys[i], non_blocking=pinned)
            c1.record(main)
            marks.append(("copy", c0, c1, f"y{i}"))
    main.wait_stream(side)
    end.record(main)
    torch.cuda.synchronize(device)  # name the device: never rely on the current one
    seconds = time.perf_counter() - t0
    spans = [(lane, start.elapsed_time(a) / 1e3, start.elapsed_time(b) / 1e3, lab)
             for lane, a, b, lab in marks]
    return seconds, spans, host


def copy_model(k: int, n: int) -> dict:
    """Predicted seconds of the three modes: k n x n matmuls and their copies."""
    mm, cp = matmul_seconds(n), copy_seconds(4 * n * n)
    return {"pageable, one stream": k * mm + k * copy_seconds(4 * n * n, False),
            "pinned non_blocking, one stream": k * mm + k * cp,
            "copy stream": k * max(mm, cp) + min(mm, cp)}


COPY_MODEL = ("k matmuls at the kernel model's pace and k copies of their results at "
              "the rate pinned copies reach (calibrated; pageable ones add the "
              "driver's staging copy); one stream adds them up, a copy stream "
              "overlaps each copy with the next matmul")


def _hidden_copy_time(timelines: dict) -> str:
    parts = []
    for mode, spans in timelines.items():
        compute = [sp for sp in spans if sp[0] == "compute"]
        copies = [sp for sp in spans if sp[0] == "copy"]
        hidden = sum(overlap_seconds(c, m) for c in copies for m in compute)
        parts.append(f"{mode}: {hidden / sum(c[2] - c[1] for c in copies):.0%}")
    return "copy time hidden under compute - " + "; ".join(parts)


def _predicted_copy_spans(mode: str, k: int = 8, n: int = 4096) -> list[tuple]:
    mm = matmul_seconds(n)
    cp = copy_seconds(4 * n * n, pinned=not mode.startswith("pageable"))
    spans = [("compute", i * mm, (i + 1) * mm, f"y{i}") for i in range(k)]
    t = 0.0 if mode == "copy stream" else k * mm
    for i in range(k):
        if mode == "copy stream":  # each copy as soon as its matmul is done
            t = max(t, (i + 1) * mm)
        spans.append(("copy", t, t + cp, f"y{i}"))
        t += cp
    return spans


def show_copy_compute(side, device) -> None:
    """The three modes on this GPU (if any, checked and recorded), the model's
    times and timelines, and the seed's workload beside the seed's figures."""
    local = timelines = None
    if device.type == "cuda":
        x = torch.randn(4096, 4096, device=device)
        expected = (x @ x).cpu()
        local, timelines = {}, {}
        for mode in COPY_MODES:
            compute_and_copy(x, 8, mode, side, device)  # warm-up; caches memory
            seconds, spans, host = compute_and_copy(x, 8, mode, side, device)
            right = all(torch.allclose(h, expected, rtol=1e-4, atol=1e-3)
                        for h in host)
            local[mode], timelines[mode] = seconds, spans
            print(f"{mode:>32}: {seconds * 1e3:7.1f} ms, every copy right: {right}")
        reference.record("03.copy_compute", local, "s", device)
        reference.record("03.copy_compute_timeline", timelines, "s", device)
    rule = reference.predicted(copy_model(8, 4096), "s", H100_PCIE5,
                               COPY_MODEL + " (k = 8, n = 4096)", COPY_INPUTS,
                               caveat=matmul_caveat("; the copies are calibrated"))
    show_gpu("03.copy_compute", [rule], lambda v: [
        print(f"  {mode:>32}: {sec * 1e3:7.1f} ms") for mode, sec in v.items()])
    spans_rule = reference.predicted(
        {mode: _predicted_copy_spans(mode) for mode in COPY_MODES}, "s", H100_PCIE5,
        "the copy model above, span by span", COPY_INPUTS)
    show_timelines("03.copy_compute_timeline", timelines,
                   [(mode, mode) for mode in COPY_MODES],
                   "8 matmuls (4096x4096) and their copies to the CPU",
                   describe=_hidden_copy_time, figures=[spans_rule], device=device)


def _seed_seconds(pub) -> float:
    return pub.value[0]["seconds"] if isinstance(pub.value, list) else pub.value


def plot_seed_workload() -> None:
    """Seed 001's workload (50 matmuls of 4000x4000, 50 copies of 64 MB): the
    copy model's times beside what the seed published."""
    pred = copy_model(50, 4000)
    rows = [  # (what, published figure or None, predicted seconds)
        ("compute only", reference.published("seed001.matmul50_single_gpu_seconds"),
         50 * matmul_seconds(4000)),
        ("compute, then copy\n(pageable)",
         reference.published("seed001.copy_to_cpu_seconds"),
         pred["pageable, one stream"]),
        ("compute, non_blocking\ncopies, one stream",
         reference.published("seed001.run_and_copy_nonblocking_seconds"),
         pred["pinned non_blocking, one stream"]),
        ("compute, copies on\na copy stream", None, pred["copy stream"]),
    ]
    model = reference.predicted([p for _, _, p in rows], "s", H100_PCIE5,
                                COPY_MODEL + " (k = 50, n = 4000)", COPY_INPUTS)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, (_what, pub, p) in enumerate(rows):
        bars = [(0, p, model)]
        if pub is not None:
            value = _seed_seconds(pub)
            bars.append((1, value, pub))
        for j, value, f in bars:
            ax.bar(i + 0.38 * j, value, width=0.36, color=plt.cm.tab10.colors[j],
                   edgecolor="black", hatch=FIGURE_STYLE[f.kind]["hatch"],
                   label=(f"{f.legend} (seed 001)" if j else f.legend) if i == 0
                   else None)
            ax.annotate(f"{value:.3g} s", (i + 0.38 * j, value), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks([i + 0.19 for i in range(len(rows))], [w for w, _, _ in rows],
                  fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("Seed 001's workload: 50 matmuls of 4000x4000 and 50 copies of "
                 "64 MB", fontsize=10)
    ax.set_ylim(0, 1.25 * max(ax.get_ylim()))
    ax.legend(fontsize=7, loc="upper left")
    plt.show()
    print(model.label)
    for what, pub, p in rows:
        seen = "not measured by the seed"
        if pub is not None:
            value = _seed_seconds(pub)
            seen = f"published {value:.4g} s [{pub.label}]"
        print(f"  {what.replace(chr(10), ' '):>38}: predicted {p:.3f} s, {seen}")


def draw_overlap(copy_mib: float = 64.0, matmul_n: int = 4096, chunks: int = 4) -> None:
    """Predicted timeline of ``chunks`` x (matmul, copy of a result) on an H100,
    on one stream and with a copy stream."""
    mm_s, cp_s = matmul_seconds(matmul_n), copy_seconds(copy_mib * 2**20)
    one, two, t, c = [], [], 0.0, 0.0
    for i in range(chunks):
        one += [("compute", t, t + mm_s, f"c{i}"),
                ("copy", t + mm_s, t + mm_s + cp_s, f"c{i}")]
        t += mm_s + cp_s
        two.append(("compute", i * mm_s, (i + 1) * mm_s, f"c{i}"))
        c = max(c, (i + 1) * mm_s)
        two.append(("copy", c, c + cp_s, f"c{i}"))
        c += cp_s
    pred = reference.predicted(c, "s", H100_PCIE5,
                               "matmuls at the kernel model's pace, pinned copies "
                               "at the rate they reach (calibrated)", COPY_INPUTS)
    plot_runs([(one, f"one stream: sum = {t * 1e3:.2f} ms"),
               (two, f"copy stream: {c * 1e3:.2f} ms; max of the totals = "
                     f"{max(chunks * mm_s, chunks * cp_s) * 1e3:.2f} ms")],
              kind_of=pred, lanes=["compute", "copy"])
    bound = "copies" if cp_s > mm_s else "compute"
    print(f"matmul {mm_s * 1e3:.3f} ms, copy {cp_s * 1e3:.3f} ms per chunk: "
          f"{bound}-bound; the copy stream saves {(1 - c / t):.0%}")
    print("caveat: " + matmul_caveat("; the copies are calibrated"))


def overlap_slider():
    """A slider over ``draw_overlap``'s copy size and matmul size."""
    import ipywidgets as widgets

    return widgets.interact(
        draw_overlap,
        copy_mib=widgets.FloatLogSlider(value=64, base=2, min=0, max=10, step=1,
                                        description="copy MiB",
                                        continuous_update=False),
        matmul_n=widgets.SelectionSlider(options=[2**k for k in range(9, 15)],
                                         value=4096, description="matmul n",
                                         continuous_update=False),
        chunks=widgets.fixed(4))


# --- section 7: the prefetcher -------------------------------------------------------


def show_prefetch_prediction() -> None:
    """Predicted: 8 batches of 64 MiB with a 4096 matmul per step, on an H100."""
    step, copy = matmul_seconds(4096), copy_seconds(64 * 2**20)
    rule = reference.predicted(
        {"serial": 8 * (step + copy), "prefetched": copy + 7 * max(step, copy) + step},
        "s", H100_PCIE5,
        "8 batches of 64 MiB, a 4096 matmul per step: on one stream copy + step add "
        "up; prefetched, each copy hides under the previous step", COPY_INPUTS,
        caveat=matmul_caveat(h2d_caveat()))
    show_gpu("03.prefetch", [rule], lambda v: print("  ", {
        k: f"{s * 1e3:.2f} ms" for k, s in v.items()}))


# --- section 9: two devices at once -------------------------------------------------


def _gpu_work(x: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        x @ x


def _concurrency_summary(t: dict) -> None:
    pairs = (("GPU alone", "CPU alone", "GPU then CPU, no sync between"),
             ("GPU 0 alone", "GPU 1 alone", "GPU 0 and GPU 1"))
    for a, b, both in pairs:
        if both in t and a in t and b in t:
            print(f"  {both}: {t[both] / max(t[a], t[b]):.2f}x the larger one alone, "
                  f"{t[both] / (t[a] + t[b]):.2f}x their sum")


def time_two_devices(device, gpus: Sequence[torch.device]) -> dict:
    """GPU work queued, CPU work meanwhile, then one wait; with two GPUs also
    both GPUs at once, waiting for each device used. Recorded."""
    xg, xc = torch.randn(4096, 4096, device=device), torch.randn(1024, 1024)
    _gpu_work(xg, 2)  # warm-up
    _gpu_work(xc, 1)
    timings = {}
    for name, on_gpu, on_cpu in (("GPU alone", True, False), ("CPU alone", False, True),
                                 ("GPU then CPU, no sync between", True, True)):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if on_gpu:
            _gpu_work(xg, 40)  # queued: returns long before the GPU is done
        if on_cpu:
            _gpu_work(xc, 10)  # the CPU computes meanwhile
        torch.cuda.synchronize(device)
        timings[name] = time.perf_counter() - t0
    if len(gpus) >= 2:
        xs = [torch.randn(4096, 4096, device=g) for g in gpus[:2]]
        for x, g in zip(xs, gpus[:2], strict=True):
            _gpu_work(x, 2)
            torch.cuda.synchronize(g)
        for name, use in (("GPU 0 alone", [0]), ("GPU 1 alone", [1]),
                          ("GPU 0 and GPU 1", [0, 1])):
            t0 = time.perf_counter()
            for i in use:
                _gpu_work(xs[i], 40)
            for i in use:
                torch.cuda.synchronize(gpus[i])  # wait for every device used
            timings[name] = time.perf_counter() - t0
    reference.record("03.two_devices", timings, "s", device)
    return timings


def show_two_devices(timings: dict | None, device) -> None:
    """This GPU's timings (if any), recorded ones, the model's and the seed's."""
    gpu_40 = 40 * matmul_seconds(4096)
    rule = reference.predicted(
        {"GPU 0 alone": gpu_40, "GPU 1 alone": gpu_40, "GPU 0 and GPU 1": gpu_40},
        "s", "two H100s", "40 matmuls of 4096 at the kernel model's pace on each; with "
        "no synchronize between them the two queues run at once: both take as long "
        "as one", ["h100_sxm.fp32_tflops"],
        caveat=matmul_caveat("; no published measurement of two GPUs at once was "
                             "found"))
    seeds = [reference.published("seed001.matmul50_single_gpu_seconds"),
             reference.published("seed001.matmul50_two_gpus_seconds")]

    def detail(value):
        if isinstance(value, dict):
            for k, v in value.items():
                print(f"  {k:>30}: {v * 1e3:7.1f} ms")
            _concurrency_summary(value)
        elif isinstance(value, list):
            print("  ", "; ".join(f"{r['label']} ({r['device']}): {r['seconds']} s"
                                  for r in value))
        else:
            print(f"   both GPUs (timer stopped early): {value} s")

    show_gpu("03.two_devices", [rule, *seeds], detail, local=timings, device=device)


def draw_mlp_graph() -> None:
    """Seed 001's two-layer MLP step on a CPU and two GPUs: what depends on what."""
    lane_x = {"GPU 0": 0.0, "CPU": 1.0, "GPU 1": 2.0}
    colors = {"GPU 0": "#9ecae1", "CPU": "#fdd0a2", "GPU 1": "#a1d99b"}
    boxes = {"batch": ("CPU", 0.0, 0, "batch"),
             "split": ("CPU", 0.0, 1, "split in two"),
             "sum": ("CPU", 0.0, 9, "sum gradients"),
             "update": ("CPU", 0.0, 10, "update W1, W2")}
    arrows = [("batch", "split"), ("sum", "update")]
    for g, toward_cpu in (("GPU 0", 0.27), ("GPU 1", -0.27)):
        k = g[-1]
        for name, dx, row, text in (
                ("x_in", 0, 2, f"copy x{k} in"), ("h", 0, 3, "h = relu(x W1)"),
                ("out", 0, 4, "out = h W2"), ("loss", 0, 5, "loss"),
                ("gW2", 0, 6, "grad W2"), ("gW1", -toward_cpu, 7, "grad W1"),
                ("gW2_out", toward_cpu, 7, "copy grad W2\nout"),
                ("gW1_out", -toward_cpu, 8, "copy grad W1\nout"),
                ("w_in", 0, 11, "copy W1, W2 in")):
            boxes[name + k] = (g, dx, row, text)
        chain = ["x_in", "h", "out", "loss", "gW2", "gW1", "gW1_out"]
        arrows += [("split", "x_in" + k), ("gW2" + k, "gW2_out" + k),
                   ("gW2_out" + k, "sum"), ("gW1_out" + k, "sum"),
                   ("update", "w_in" + k)]
        arrows += [(a + k, b + k) for a, b in zip(chain, chain[1:], strict=False)]
    fig, ax = plt.subplots(figsize=(8, 6.4))
    place = {}
    for name, (lane, dx, row, text) in boxes.items():
        x, y = lane_x[lane] + dx, -row
        place[name] = (x, y)
        copy = text.startswith("copy")
        ax.add_patch(FancyBboxPatch((x - 0.24, y - 0.3), 0.48, 0.6,
                                    boxstyle="round,pad=0.02", lw=1.0,
                                    ls="--" if copy else "-",
                                    facecolor="white" if copy else colors[lane],
                                    edgecolor="black"))
        ax.text(x, y, text, ha="center", va="center", fontsize=7)
    for a, b in arrows:
        (x0, y0), (x1, y1) = place[a], place[b]
        ax.annotate("", xy=(x1, y1 + 0.32), xytext=(x0, y0 - 0.32),
                    arrowprops={"arrowstyle": "->", "lw": 0.8, "color": "gray"})
    for lane, x in lane_x.items():
        ax.text(x, 0.8, lane, ha="center", fontsize=10, weight="bold")
    ax.set_xlim(-0.6, 2.6)
    ax.set_ylim(-11.6, 1.2)
    ax.axis("off")
    ax.set_title("A two-layer MLP on a CPU and two GPUs: what depends on what\n"
                 "(dashed boxes: copies between devices; boxes on one row may run "
                 "at once)", fontsize=9)
    plt.show()


# --- section 10: data loading ---------------------------------------------------------


def loader_estimates(load_s: float, step_s: float, n: int, cores: int) -> dict:
    """Expected epoch seconds with 0, 1 and 2 workers from one batch's load and
    step times: n(L+T), n max(L, T), n max(L/2, T), never below n(L+T)/cores."""
    floor = n * (load_s + step_s) / cores
    return {0: n * (load_s + step_s), 1: max(n * max(load_s, step_s), floor),
            2: max(n * max(load_s / 2, step_s), floor)}


def span_wall(spans: Sequence[tuple]) -> float:
    """Seconds from the first start to the last end of ``spans``."""
    return max(s[2] for s in spans) - min(s[1] for s in spans)


def print_epochs(epoch_spans: dict, estimates: dict) -> None:
    """Per num_workers: the estimated epoch time, and the median time to make
    one batch in the epoch drawn (from its spans)."""
    for k, est in estimates.items():
        spans = epoch_spans[k]
        loads = sorted(b - a for lane, a, b, _ in spans if lane.endswith("load"))
        print(f"num_workers={k}: estimate {est:.3f} s, median load per batch "
              f"{loads[len(loads) // 2] * 1e3:.1f} ms")


def plot_epochs(spans: dict) -> None:
    """The DataLoader timelines: who made each batch, and when it was trained on."""
    fig, axes = plt.subplots(len(spans), 1, figsize=(8, 2.1 * len(spans)), sharex=True)
    for ax, (k, sp) in zip(axes, spans.items(), strict=True):
        lanes = ["main: load"] if k == 0 else [f"worker {i}: load" for i in range(k)]
        plot_timeline(sp, ax=ax, lanes=[*lanes, "main: train"],
                      title=f"DataLoader, num_workers={k}: an epoch of median length")
    fig.tight_layout()
    plt.show()
