"""Plumbing for Chapter 1 ("The CUDA execution model"): figures, plots, GPU-only demos.

The chapter shows the kernels and the measurements it teaches; this module
holds what only draws, labels or prints them, and the demos that run only on a
real GPU (timing kernels with CUDA events, the copy sweep over block counts,
the CUDA C kernel through pycuda). Import it after ``course_utils`` (which
picks numba's GPU target or its simulator).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from course_utils import plots, predict, reference
from course_utils.devices import kernel_target

H100 = "h100_sxm"


def published_value(key: str, scale: float = 1.0) -> float:
    """The value of published figure ``key`` (see ``reference_data/published``)."""
    return reference.published_entry(key)["value"] * scale


# --- section 1: lanes ---------------------------------------------------------


def gpu_lanes(device: torch.device, lanes_per_sm: dict) -> dict:
    """SMs, FP32 lanes per SM and resident threads: probed, or the H100's published.

    ``lanes_per_sm`` maps a compute capability to FP32 lanes per SM.
    """
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"name": p.name, "sms": p.multi_processor_count,
                "lanes_per_sm": lanes_per_sm.get((p.major, p.minor)),
                "resident": p.multi_processor_count * p.max_threads_per_multi_processor,
                "how": f"probed, compute capability {p.major}.{p.minor}"}
    sms = published_value(f"{H100}.sm_count")
    return {"name": predict.gpu_name(H100), "sms": int(sms),
            "lanes_per_sm": int(published_value(f"{H100}.cuda_cores") / sms),
            "resident": int(sms * published_value(f"{H100}.max_resident_warps_per_sm")
                            * 32),
            "how": "published: " + reference.cite(
                reference.published_entry(f"{H100}.sm_count"))}


# --- section 3: the grid, drawn -----------------------------------------------


def plot_grid_ids(block_id, thread_id, gx, gy, grid_shape, block_shape) -> None:
    """Draw what ``record_ids`` wrote: block, thread and global (x, y) per cell."""
    import matplotlib.pyplot as plt

    h, w = block_id.shape
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.imshow(block_id, cmap="Pastel1", vmin=0, vmax=8)
    for y in range(h):
        for x in range(w):
            ax.text(x, y, f"b{block_id[y, x]} t{thread_id[y, x]}\n({gx[y, x]},"
                    f"{gy[y, x]})", ha="center", va="center", fontsize=7)
    for k in range(1, grid_shape[0]):
        ax.axvline(k * block_shape[0] - 0.5, color="black", lw=2)
    for k in range(1, grid_shape[1]):
        ax.axhline(k * block_shape[1] - 0.5, color="black", lw=2)
    ax.set_xticks(range(w))
    ax.set_yticks(range(h))
    ax.set_xlabel("global x = blockIdx.x * blockDim.x + threadIdx.x (column)")
    ax.set_ylabel("global y (row)")
    ax.set_title(f"A {grid_shape[0]} x {grid_shape[1]} grid of {block_shape[0]} x "
                 f"{block_shape[1]} blocks: block b, thread t, global (x, y)")
    plt.tight_layout()
    plt.show()


# --- GPU timing ---------------------------------------------------------------


def time_kernel(launch, repeats: int = 20) -> float:
    """Median seconds of ``launch()`` measured with CUDA events (numba's GPU target)."""
    from numba import cuda

    launch()  # warm-up: compilation and first-launch costs
    times = []
    for _ in range(repeats):
        start, end = cuda.event(), cuda.event()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


# --- section 6: the gather ----------------------------------------------------


def gather_prediction() -> reference.Figure:
    """Useful GB/s of a gather on an H100 by the sector model.

    Per element the index (8 bytes) and the output (4 bytes) are always
    coalesced; ``src`` costs 4 bytes when coalesced and a whole 32-byte sector
    when scattered, so 16 bytes are moved per element coalesced and 44
    scattered. Useful GB/s = achieved HBM bandwidth x 16 / bytes moved.
    """
    moved = {"coalesced": 16, "stride 8": 44, "random": 44}
    hbm = predict.achieved_memory_bandwidth(H100)
    return reference.predicted(
        {k: hbm * 16 / m / 1e9 for k, m in moved.items()}, "GB/s",
        predict.gpu_name(H100),
        "sector model: useful GB/s = achieved HBM bandwidth "
        f"({predict.memory_efficiency():.0%} of the datasheet's) x 16 useful / "
        "bytes moved per element (16 coalesced, 44 scattered)",
        [f"{H100}.memory_bandwidth_gbps", *predict.MEMORY_EFFICIENCY_INPUTS],
        caveat="not calibrated: the HBM rate is (a device-to-device copy), but no "
        "published measurement of a gather was found to check the sector counts")


def _scalar(fig: reference.Figure, value, unit: str) -> reference.Figure:
    return reference.Figure(fig.kind, value, unit, fig.device, fig.source)


def plot_gather(shown: list, n: int) -> None:
    """Print each figure's GB/s per pattern, then draw coalesced GB/s and the ratio."""
    import matplotlib.pyplot as plt

    for f in shown:
        print(f"  {f.legend}: " + ", ".join(f"{k} {v:,.1f}" for k, v in f.value.items())
              + " GB/s")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    plots.plot_figure_bars([_scalar(f, f.value["coalesced"], "GB/s") for f in shown],
                           ax=axes[0], ylabel="useful GB/s, coalesced gather",
                           title="Coalesced gather")
    plots.plot_figure_bars(
        [_scalar(f, f.value["coalesced"] / f.value["random"], "x") for f in shown],
        ax=axes[1], logy=False, ylabel="coalesced / random (times slower)",
        title="What scattering the reads costs", fmt="{:.2f}x")
    fig.suptitle(f"Gather of {n:,} floats: measured here and predicted for a GPU")
    plt.tight_layout()
    plt.show()


# --- section 7: divergence ----------------------------------------------------


def show_divergence(cpu_ratio: float, gpu_ratio: float | None, device) -> None:
    """Print and draw the CPU analogue beside the GPU figures of the split warp."""
    import matplotlib.pyplot as plt

    cpu = reference.measured(cpu_ratio, "x", "cpu")
    cpu.device += ", torch.where vs grouped"
    shown = reference.show(
        "01.divergence_ratio", unit="x (divergent time / uniform time)",
        local=gpu_ratio, local_device=device,
        figures=[reference.predicted(
            2.0, "x", "any NVIDIA GPU",
            "SIMT: a split warp runs both loops one after the other, and the loops "
            "are almost all of the work, so the divergent layout takes twice as "
            "long (uncalibrated: no published measurement of this kernel)")])
    ax = plots.plot_figure_bars([cpu] + shown, logy=False, fmt="{:.2f}x",
                                ylabel="divergent time / uniform time",
                                title="What a branch that splits the lanes costs")
    ax.axhline(1, color="grey", lw=1)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.4)
    ax.legend(fontsize=7, loc="upper right")
    plt.show()


# --- section 8: the memory hierarchy ------------------------------------------


def _in_bytes(n) -> str | None:
    if not n:
        return None
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return None


def print_memory_facts(device: torch.device) -> None:
    """What torch and numba report about this GPU's memory, or the H100's published."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        numba_gpu = None
        if kernel_target() == "GPU":
            from numba import cuda

            numba_gpu = cuda.get_current_device()
        bus = getattr(p, "memory_bus_width", 0)
        clock = getattr(p, "memory_clock_rate", 0)
        facts = {
            "device": p.name,
            "SMs": p.multi_processor_count,
            "32-bit registers per SM":
                getattr(numba_gpu, "MAX_REGISTERS_PER_MULTIPROCESSOR", None),
            "shared memory per SM":
                _in_bytes(getattr(p, "shared_memory_per_multiprocessor", 0)),
            "shared memory per block (default)":
                _in_bytes(getattr(p, "shared_memory_per_block", 0)),
            "L2 cache": _in_bytes(getattr(p, "L2_cache_size", 0)),
            "global memory": _in_bytes(p.total_memory),
            # memory_clock_rate is in kHz; DDR memory moves data twice per clock
            "peak DRAM bandwidth, 2 x clock x bus width":
                f"{2 * clock * 1e3 * bus / 8 / 1e12:.2f} TB/s" if bus and clock
                else None,
        }
        print("probed by torch and numba on this GPU (None: not reported here):")
    else:
        keys = {"SMs": "sm_count", "register file per SM": "register_file_per_sm_kb",
                "shared memory per SM (configurable with L1)":
                    "shared_memory_per_sm_kb",
                "L2 cache": "l2_cache_mb", "global memory (HBM3)": "memory_gb",
                "HBM3 bandwidth": "memory_bandwidth_gbps"}
        facts = {"device": predict.gpu_name(H100)}
        sources = set()
        for label, key in keys.items():
            e = reference.published_entry(f"{H100}.{key}")
            facts[label] = f"{e['value']:g} {e['unit']}"
            sources.add(reference.cite(e))
        print("no GPU: published figures, not measured here (sources: "
              + "; ".join(sorted(sources)) + ")")
    for k, v in facts.items():
        print(f"  {k:45} {v}")


def print_bandwidth_levels() -> dict:
    """The H100's published bandwidth per level, in bytes/s (None: not published)."""
    levels = {
        "HBM3": (published_value(f"{H100}.memory_bandwidth_gbps", 1e9), "datasheet"),
        "L2 cache": (None, "not published: see the copy sweep below"),
        "NVLink 4, to other GPUs": (
            published_value(f"{H100}.nvlink_bandwidth_total_gbps", 1e9),
            "both directions together"),
        "PCIe Gen5 x16, to the host": (
            published_value("pcie5_x16.bandwidth_per_direction_gbps", 1e9),
            "each direction"),
    }
    print(f"{predict.gpu_name(H100)}, published figures (not measured here):")
    for level, (bw, how) in levels.items():
        shown = "-" if bw is None else (f"{bw / 1e12:.3g} TB/s" if bw >= 1e12
                                        else f"{bw / 1e9:.0f} GB/s")
        print(f"  {level:28} {shown:>11}   {how}")
    return {k: v for k, (v, _) in levels.items()}


def copy_bandwidth_vs_blocks() -> dict:
    """GPU only: GB/s of a grid-stride copy of 64 MiB against the blocks launched."""
    from numba import cuda

    @cuda.jit
    def copy(src, dst):
        for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
            dst[i] = src[i]

    n = 2**24  # 64 MiB of float32, well beyond the L2 cache
    src = cuda.to_device(np.ones(n, dtype=np.float32))
    dst = cuda.device_array_like(src)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    blocks = [1, 4, 16, sms // 2, sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms, 64 * sms]
    curve = {"x": blocks, "y": []}
    for nb in blocks:
        t = time_kernel(lambda nb=nb: copy[nb, 256](src, dst), repeats=5)
        curve["y"].append(2 * 4 * n / t / 1e9)  # read + write
    for nb, gbs in zip(blocks, curve["y"], strict=True):
        print(f"{nb:6} blocks ({nb / sms:6.2f} per SM): {gbs:8.1f} GB/s")
    return curve


def _log2_axis(ax, axis: str = "x") -> None:
    from matplotlib.ticker import FuncFormatter

    getattr(ax, f"set_{axis}scale")("log", base=2)
    getattr(ax, f"{axis}axis").set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def plot_loads_in_flight(chains, loads_per_s, gpu_curves, hbm_peak) -> None:
    """This CPU's loads/s against chains; a GPU's copy GB/s against blocks, if any."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if gpu_curves else 1,
                             figsize=(11, 3.8) if gpu_curves else (6, 3.8))
    ax_cpu = axes[0] if gpu_curves else axes
    curve = reference.measured({"x": chains, "y": [r / 1e6 for r in loads_per_s]},
                               "M loads/s", "cpu")
    plots.plot_figure_curves([curve], ax=ax_cpu, logx=True, logy=True,
                             xlabel="independent chains (loads in flight)",
                             ylabel="million loads per second",
                             title="This CPU: more loads in flight")
    _log2_axis(ax_cpu)
    if gpu_curves:
        ax = axes[1]
        plots.plot_figure_curves(gpu_curves, ax=ax, xlabel="blocks of 256 threads",
                                 ylabel="copy bandwidth (GB/s, read + write)",
                                 title="A GPU: more warps in flight")
        _log2_axis(ax)
        ax.axhline(hbm_peak.value, color="grey", label=hbm_peak.legend + " (HBM peak)",
                   **plots.figure_style("published"))
        ax.legend(fontsize=7)
    else:
        print("no GPU curve measured or recorded yet: on a GPU the copy climbs with "
              f"the blocks in flight towards the HBM peak ({hbm_peak.label})")
    plt.tight_layout()
    plt.show()


def plot_copy_curve(shown: list, hbm_peak) -> None:
    """Copy bandwidth against buffer size, for every curve shown, and the HBM peak."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = plots.plot_figure_curves(
        [f for f in shown if isinstance(f.value, dict)],
        xlabel="buffer size (MiB)", ylabel="copy bandwidth (GB/s, read + write)",
        title="Copy bandwidth against working-set size")
    ax.axhline(hbm_peak.value, color="gray", label=hbm_peak.legend + " HBM peak",
               **plots.figure_style("published"))
    _log2_axis(ax)
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()


def time_matmuls(kernels: dict, tile: int, device, n: int = 2048) -> dict:
    """GPU only: ms per n x n float32 matmul of each numba kernel and torch.matmul."""
    from numba import cuda

    from course_utils import bench

    rng = np.random.default_rng(0)
    a = cuda.to_device(rng.standard_normal((n, n), dtype=np.float32))
    b = cuda.to_device(rng.standard_normal((n, n), dtype=np.float32))
    c = cuda.device_array((n, n), dtype=np.float32)
    grid = (n // tile, n // tile)
    ms = {name: 1e3 * time_kernel(lambda k=k: k[grid, (tile, tile)](a, b, c))
          for name, k in kernels.items()}
    at, bt = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    ms["torch.matmul"] = 1e3 * bench(torch.matmul, at, bt).median
    return ms


def matmul_floor(n: int = 2048) -> reference.Figure:
    """The roofline floor and the calibrated cuBLAS time of an fp32 matmul, H100."""
    floor = predict.roofline_seconds(2 * n**3, 3 * 4 * n**2, H100, "fp32")
    likely = predict.kernel_seconds(2 * n**3, 3 * 4 * n**2, H100, "fp32")
    return reference.predicted(
        {"any kernel, at best": floor.value * 1e3,
         "cuBLAS, calibrated": likely.value * 1e3}, "ms", floor.device,
        floor.measures + f"; calibrated: {predict.matmul_efficiency():.0%} of peak, "
        "what large bf16 matmuls reach (not checked for fp32)",
        [f"{H100}.fp32_tflops", f"{H100}.memory_bandwidth_gbps",
         *predict.MATMUL_EFFICIENCY_INPUTS])


# --- section 9: SIMD ----------------------------------------------------------


def l2_cache_bytes(default: int = 256 * 1024) -> int:
    """One core's L2 cache, from Linux's sysfs (a common minimum elsewhere)."""
    try:
        for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip()  # e.g. '1024K'
                return int(size[:-1]) * {"K": 1024, "M": 2**20}[size[-1]]
    except (OSError, ValueError, KeyError):
        pass
    return default


# --- section 10: Amdahl -------------------------------------------------------


def amdahl_slider(amdahl):
    """An interactive plot of ``amdahl(p, n)`` with sliders for p and n."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    def draw(p=0.9, n=8):
        procs = np.logspace(0, 12, 49, base=2)
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        ax.plot(procs, amdahl(p, procs), label=f"p = {p:.2f}")
        ax.axhline(1 / (1 - p) if p < 1 else procs[-1], ls="--", color="grey",
                   label="limit 1 / (1 - p)")
        ax.plot([n], [amdahl(p, n)], "o", color="tab:red",
                label=f"n = {n}: {amdahl(p, n):.2f}x")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="processors n", ylabel="speed-up S(n)",
               title="Amdahl's law: speed-up against processors")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        plt.show()

    return widgets.interact(
        draw, p=widgets.FloatSlider(0.9, min=0.0, max=0.99, step=0.01,
                                    continuous_update=False),
        n=widgets.SelectionSlider(options=[2**k for k in range(13)], value=8,
                                  description="n", continuous_update=False))


def plot_amdahl_measured(amdahl, p: float, speedup: float) -> None:
    """Amdahl's curve for the measured p, and the measured two-process point."""
    import matplotlib.pyplot as plt

    procs = np.arange(1, 9)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(procs, amdahl(p, procs), marker=".", label=f"Amdahl, p = {p:.2f}")
    ax.plot(procs, procs, ls=":", color="grey", label="perfect scaling")
    ax.plot([2], [speedup], "o", color="tab:red", ms=9, label="measured, 2 processes")
    ax.set(xlabel="processes n", ylabel="speed-up over 1 process",
           title="Measured speed-up against Amdahl's prediction")
    ax.grid(True, alpha=0.3)
    ax.legend()
    plt.show()


# --- section 11: CUDA C through pycuda ----------------------------------------


def run_cuda_c_vector_add(source: str, n: int = 1000) -> str:
    """Compile ``source`` with pycuda (nvcc), run its ``vector_add``, say what happened.

    Needs a GPU, the CUDA toolkit and pycuda; otherwise returns why it did not run.
    """
    if not torch.cuda.is_available():
        return "not run: there is no GPU"
    try:
        import pycuda.autoprimaryctx  # noqa: F401  (GPU 0's primary context, as torch's)
        import pycuda.driver as drv
        from pycuda.compiler import SourceModule
    except ImportError as e:
        return ("not run: pycuda is not installed (it needs the CUDA toolkit)"
                if (e.name or "").startswith("pycuda")
                else f"not run: pycuda could not load: {e}")
    except Exception as e:  # pycuda present, but no driver or no device
        return f"not run: pycuda could not start: {e}"
    try:
        vector_add = SourceModule(source).get_function("vector_add")  # runs nvcc
    except Exception as e:  # no nvcc on PATH, or it failed
        return f"not run: nvcc could not compile the kernel: {str(e)[:300]}"
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    c = np.empty_like(a)
    vector_add(drv.In(a), drv.In(b), drv.Out(c), np.int32(n),
               block=(256, 1, 1), grid=((n + 255) // 256, 1))
    return f"pycuda vector_add matches numpy: {np.allclose(c, a + b)}"
