# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 3: Streams and asynchronous execution
#
# A GPU does not run your Python line by line. The CPU puts work into
# queues called **streams** and goes on; the GPU takes the work out of the
# queues when it can. This is what makes overlap possible (computing while
# copying, two devices working at once, loading the next batch while the
# model trains on this one), and it is also what makes wrong results
# possible, when one queue reads what another has not finished writing.
#
# **What you will learn**
#
# - what a CUDA stream is, the default stream, and how to put work on
#   another one; asking a stream or an event whether it is done;
# - the race between two streams, and its fixes: `wait_stream`, events, and
#   `record_stream` for memory; finding hidden synchronisations;
# - when two streams make independent work faster and when they cannot, and
#   what a timeline built from events does and does not show;
# - pinned memory and what pinning costs, `non_blocking` copies,
#   overlapping copies with compute, the device-to-host `non_blocking` trap,
#   and a side-stream prefetcher for the next batch;
# - overlapping data loading with training (`DataLoader(num_workers,
#   pin_memory)`), and how close that gets to having everything preloaded.
#
# **Hardware.** With a GPU, every stream experiment runs for real. Without
# one, the CPU has no streams, so the chapter runs honest CPU analogues
# (threads that work at once, measured and drawn the same way, and a
# *stand-in GPU* whose streams run in simulated time) and shows, for every
# GPU experiment, GPU figures labelled by kind: recorded on a real GPU,
# published, or predicted by a small model. The data-loading section runs
# the same everywhere.

# %%
import ctypes
import ctypes.util
import mmap
import multiprocessing as mp
import os
import queue
import textwrap
import threading
import time
import warnings

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyBboxPatch, Patch
from torch.utils.data import DataLoader, Dataset

from course_utils import banner, bench, predict, reference, try_all_gpus, try_gpu
from course_utils.checks.ch03 import (
    StandInCuda,
    check_loader_config,
    check_overlap_fraction,
    check_prefetcher,
    host_batches,
)
from course_utils.compare import DISTURBED, Meter, compare
from course_utils.devices import usable_cores
from course_utils.plots import FIGURE_STYLE, figure_style, plot_timeline

banner()
device = try_gpu()
HAS_CUDA = device.type == "cuda"
_ = torch.manual_seed(0)

# %% [markdown]
# A few helpers used all through the chapter. A **span** is one piece of
# work drawn as a bar: `(lane, start, end, label)` with times in seconds.
# `overlap_seconds` says how long two spans ran at the same time.
# `gpu_figures` gathers what there is to show for a GPU experiment: this
# run's result when there is a GPU here, results recorded on real GPUs, and
# the published or predicted figures the cell passes in, each printed with
# its kind. `mark_kind` hatches a timeline's bars by the kind of figure they
# show (a prediction is hatched `xx`, a publication `//`, a recording `..`,
# a measurement made here plain) and names the kind in a legend.

# %%
def overlap_seconds(a, b):
    """How long spans a and b (lane, start, end, ...) ran at the same time."""
    return max(0.0, min(a[2], b[2]) - max(a[1], b[1]))


def gpu_figures(name, local=None, figures=(), unit=""):
    """Every figure of GPU experiment `name`, printed with its kind (reference.show).

    `local` is this run's GPU result (only when there is a GPU here); recorded
    ones are looked up by name; `figures` are published or predicted ones.
    """
    here = device if local is not None else "cpu"
    return reference.show(name, local=local, unit=unit, local_device=here,
                          figures=list(figures))


def show_gpu(name, figures, print_value):
    """Print every GPU figure of `name` (recorded ones and `figures`) in detail."""
    for fig in gpu_figures(name, figures=figures):
        print_value(fig.value)


def mark_kind(ax, fig):
    """Hatch the bars on `ax` by the kind of `fig` and name it in a legend."""
    hatch = FIGURE_STYLE[fig.kind]["hatch"]
    for bar in ax.patches:
        bar.set_hatch(hatch)
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch=hatch,
                             label=fig.legend)], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)


H100 = predict.gpu_name("h100_sxm")
H100_SMS = reference.published_entry("h100_sxm.sm_count")["value"]


def matmul_seconds(n):
    """Roofline floor of one n x n float32 matmul on an H100."""
    return predict.roofline_seconds(2 * n**3, 3 * 4 * n * n, "h100_sxm").value


def two_stream_speedup(n, tile=128):
    """Speed-up of two concurrent matmuls over one after the other.

    A matmul kernel hands each SM tiles of the output (`tile` x `tile` is an
    assumed, typical size); one that has fewer tiles than SMs leaves SMs idle
    for a second stream to use.
    """
    tiles = max(1, (n // tile) ** 2)
    return min(2 * tiles, H100_SMS) / min(tiles, H100_SMS)


def show_timelines(name, local, panels, title, describe=None, figures=()):
    """For each figure of `name`: a timeline per (key, panel title), marked by kind.

    `describe(value)`, if given, returns a line printed under each figure.
    """
    for f in gpu_figures(name, local, figures):
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

# %% [markdown]
# ## 1. Streams: the queues between the CPU and the GPU
#
# Chapter 2 showed that a CUDA operation returns to Python as soon as it is
# *queued*. The queue is a **stream**: work in one stream runs in the order it
# was queued, one operation after the other. Work in *different* streams has
# no order at all: the GPU may run it at the same time, or in any order.
#
# Every operation goes to the **current stream**. Unless you change it, that
# is the **default stream** of the device. `torch.cuda.Stream()` makes a new
# one, and `with torch.cuda.stream(s):` makes `s` current inside the block.
# The CPU can wait for everything on a device
# (`torch.cuda.synchronize(device)`; with no argument it waits for the
# *current* device only), for one stream (`s.synchronize()`), or for one
# point in a stream (an `Event`'s `synchronize()`). It can also just *ask*,
# without waiting: `s.query()` and `event.query()` return `True` once the
# work queued before them has finished.
#
# (In plain CUDA the "legacy" default stream also waits for, and holds up,
# every other ordinary stream. PyTorch creates its side streams with the
# non-blocking flag, so nothing orders them against the default stream
# unless you ask for it, which is what the next section is about.)
#
# On the CPU there is nothing to queue: an eager CPU operation returns when
# its result is ready. torch has a `torch.cpu.Stream` class so that
# device-generic code runs, but it does nothing. To still *see* queues at
# work, this chapter uses a **stand-in GPU** (`StandInCuda`, from the
# course's checkers): an object with `torch.cuda`'s stream API whose copies
# and kernels run in *simulated* time, with durations we choose. Below, a
# copy that takes 2 time units is queued on a side stream: the host gets
# control back at once, `query()` says "not yet", and only a
# `synchronize()` makes the host wait.

# %%
if HAS_CUDA:
    side = torch.cuda.Stream()
    print("current stream:", torch.cuda.current_stream())
    print("default stream:", torch.cuda.default_stream())
    with torch.cuda.stream(side):
        print("inside the block, current stream:", torch.cuda.current_stream())
        busy = torch.cuda.Event()
        torch.cuda._sleep(10_000_000)  # a long kernel (a private testing helper)
        busy.record()
    print("just queued - stream done?", side.query(), "event done?", busy.query())
    busy.synchronize()
    print("after event.synchronize() - stream done?", side.query())
print("CPU stream object:", torch.cpu.current_stream(),
      "- a placeholder: CPU operations finish before they return")

gpu = StandInCuda(copy_s=2.0)
side_s = gpu.Stream()
(batch,) = host_batches(1, (4,), seed=0)
with gpu, gpu.stream(side_s):
    on_device = batch.to(gpu.device, non_blocking=True)
    copied = gpu.Event()
    copied.record()
print(f"stand-in: at time {gpu.host_t:g} the copy is queued; done? {copied.query()}")
copied.synchronize()
print(f"stand-in: after copied.synchronize() the host is at time {gpu.host_t:g}; "
      f"done? {copied.query()}")

# %% [markdown]
# ## 2. The race: a stream reads what another is still writing
#
# One of the seeds quotes this example from the PyTorch documentation as if it
# were a recipe for multi-GPU work:
#
# ```python
# A = torch.empty((100, 100), device="cuda").normal_(0.0, 1.0)
# with torch.cuda.stream(s):
#     B = torch.sum(A)   # may start before normal_() finishes!
# ```
#
# It is the documentation's example of a **bug**, and it is about two streams
# on *one* GPU, not about several GPUs. `normal_` is queued on the default
# stream, `sum` on stream `s`; nothing orders them, so `sum` may read `A`
# half-written. With 100 x 100 elements the race is rarely *seen* (the
# `normal_` kernel is over in microseconds), which is exactly why such bugs
# survive. Below we make it visible on purpose: a long kernel
# (`torch.cuda._sleep`, a private helper that keeps the GPU busy for a number
# of clock cycles) holds the default stream, the fill is queued behind it,
# and the side stream sums the tensor. The right answer is the number of
# elements. Without a fix the side stream will usually sum zeros (the fill is
# still waiting behind the long kernel), but "no order" guarantees nothing
# either way, so the cell prints whether the race showed.
#
# Two things could hide the race, and the code avoids both. The first
# launch of a kernel may load its code, and loading can make the whole GPU
# wait; so we run everything once before measuring. A new device allocation
# (`cudaMalloc`) can do the same; PyTorch keeps freed memory cached *per
# stream*, so we use one side stream for the whole chapter, and after the
# warm-up its cache already holds what the sum needs.
#
# The fixes:
#
# - `side.wait_stream(main)`: work queued on `side` from now on waits for
#   everything queued on `main` so far;
# - an **event**: `ready.record(main)` marks a point in `main`, and
#   `side.wait_event(ready)` makes `side` wait for that point only (finer:
#   `main` may go on with other work);
# - `torch.cuda.synchronize()` also gives the right answer, but it stops the
#   CPU until the whole GPU is idle, throwing away all overlap.
#
# The first two make only the side stream wait, on the GPU, and the CPU goes
# on queueing work; the last makes the CPU wait.

# %%
SLEEP_CYCLES = 50_000_000  # tens of milliseconds on any recent GPU
SIDE = torch.cuda.Stream() if HAS_CUDA else None  # the chapter's side stream


def stream_race(fix, n=2048):
    """Fill `a` on the default stream behind a long kernel; sum it on a side stream."""
    main, side = torch.cuda.current_stream(), SIDE
    a = torch.zeros(n, n, device=device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(SLEEP_CYCLES)  # the default stream is busy...
    a.fill_(1.0)                     # ...so this fill waits in its queue
    if fix == "wait_stream":
        side.wait_stream(main)
    elif fix == "event":
        ready = torch.cuda.Event()
        ready.record(main)
        side.wait_event(ready)
    elif fix == "synchronize":
        torch.cuda.synchronize(device)
    with torch.cuda.stream(side):
        total = a.sum()
    a.record_stream(side)  # `a` is freed on return; see record_stream below
    torch.cuda.synchronize(device)
    return total.item()


def race_verdict(value):
    v = value["none"] / value["expected"]
    if v == 1:
        return ("the unordered sum happened to be right: the race did not show "
                "this time (which is what makes such bugs survive)")
    return f"the unordered sum saw {v:.0%} of the ones: the race showed"


if HAS_CUDA:
    # Warm-up: the first launch of a kernel may load its code, and loading can
    # wait for the whole GPU, which would hide the race. Load every kernel first.
    stream_race("synchronize")
    race = {"expected": 2048 * 2048}
    for fix in ("none", "wait_stream", "event", "synchronize"):
        race[fix] = stream_race(fix)
    for k, v in race.items():
        print(f"{k:>12}: {v:,.0f}")
    print(race_verdict(race))
    reference.record("03.race", race, "sum of a 2048x2048 tensor of ones", device)
race_rule = reference.predicted(
    {"expected": 2048 * 2048, "none": "less (read while still being written)",
     "wait_stream": 2048 * 2048, "event": 2048 * 2048, "synchronize": 2048 * 2048},
    "sum of a 2048x2048 tensor of ones", "any CUDA GPU",
    "CUDA semantics: streams are unordered unless a wait_stream, an event or a "
    "synchronize orders them")


def print_race(value):
    print("  ", {k: f"{v:,.0f}" if isinstance(v, (int, float)) else v
                 for k, v in value.items()})
    if all(isinstance(v, (int, float)) for v in value.values()):
        print("  ", race_verdict(value))


show_gpu("03.race", [race_rule], print_race)

# %% [markdown]
# **The CPU analogue of the race, measured here.** Two Python threads play
# the two streams: a producer that fills a buffer with seeded random values
# and then sets a `threading.Event` (the CPU cousin of recording a CUDA
# event), and a consumer that sums the buffer. On a GPU the fill waits
# behind a long kernel; here the long kernel is a **gate**, another event
# that the producer waits on before it fills. We open the gate only *after*
# the unordered read, so that read always happens while the "kernel" is
# still running: the worst case, every time, whatever else the machine is
# doing. (A sleep in the producer would usually do the same, and on a busy
# machine sometimes not: a lesson that holds only usually is a poor one.)

# %%
def thread_race(wait, n=1000):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    buffer, ready, gate = torch.zeros(n), threading.Event(), threading.Event()

    def producer():
        gate.wait(timeout=10)  # the long kernel queued before the fill
        buffer.copy_(values)
        ready.set()            # like event.record(): "everything before is done"

    worker = threading.Thread(target=producer, daemon=True)
    worker.start()
    if wait:
        gate.set()
        ready.wait(timeout=10)  # like side.wait_event(ready)
        total = buffer.sum().item()
    else:
        total = buffer.sum().item()  # read at once: the "kernel" is still running
        gate.set()
    worker.join(timeout=10)
    return total, values.sum().item()


(unordered, expected_sum), (ordered, _) = thread_race(False), thread_race(True)
print(f"expected {expected_sum:.4f}; read without waiting: {unordered:.4f}; "
      f"read after waiting on the event: {ordered:.4f}")

# %% [markdown]
# ### `record_stream`: the same race, through the memory allocator
#
# The second kind of stream bug is subtler. PyTorch's caching allocator
# remembers which stream each block of memory was allocated on. When the
# Python tensor dies, its block goes back to the pool **for that stream**
# and can be handed out again at once, because in that stream's order every
# earlier use is finished. If *another* stream still has queued work that
# reads the tensor, the block can be overwritten under it. Below, the side
# stream sums `x` behind a long kernel, we drop `x`, and ask for a new tensor
# of the same size filled with 7s. `x.record_stream(side)` tells the
# allocator that `side` uses `x`, so the block is not reused until `side`'s
# queued work is done.
#
# Whether the wrong sum *shows* depends on the allocator handing `x`'s block
# to the new tensor. Today's caching allocator picks a free block by stream
# and size in a fixed order, so asking again for the size just freed, with
# nothing allocated in between, gets the same block back; but that is an
# implementation detail, and settings such as
# `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` change it. So read a
# right answer without `record_stream` as luck, not as safety; the cell
# prints which case happened.

# %%
def allocator_race(use_record_stream, n=2048):
    main, side = torch.cuda.current_stream(), SIDE
    x = torch.ones(n, n, device=device)
    side.wait_stream(main)  # the first race is fixed: x is ready
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        total = x.sum()
    if use_record_stream:
        x.record_stream(side)
    del x                                        # back to the default stream's pool
    y = torch.full((n, n), 7.0, device=device)   # may get x's memory at once
    torch.cuda.synchronize(device)
    del y
    return total.item()


def allocator_verdict(value):
    ratio = value["without record_stream"] / value["expected"]
    if ratio == 1:
        return ("without record_stream the sum was right this time: the block "
                "was not handed out again before the side stream read it")
    return (f"without record_stream the sum was {ratio:g}x the right one: "
            "x's memory was refilled with 7s before the side stream read it")


if HAS_CUDA:
    alloc = {"expected": 2048 * 2048,
             "without record_stream": allocator_race(False),
             "with record_stream": allocator_race(True)}
    for k, v in alloc.items():
        print(f"{k:>22}: {v:,.0f}")
    print(allocator_verdict(alloc))
    reference.record("03.allocator_race", alloc, "sum of a tensor of ones", device)
alloc_rule = reference.predicted(
    {"without record_stream": "may be less: the memory is reused while the side "
     "stream still reads it", "with record_stream": "always the full sum"},
    "sum of a tensor of ones", "any CUDA GPU",
    "PyTorch docs (Tensor.record_stream): the caching allocator reuses a freed "
    "block on its own stream unless the tensor is marked as used by another")


def print_alloc(value):
    print("  ", {k: f"{v:,.0f}" if isinstance(v, (int, float)) else v
                 for k, v in value.items()})
    if all(isinstance(v, (int, float)) for v in value.values()):
        print("  ", allocator_verdict(value))


show_gpu("03.allocator_race", [alloc_rule], print_alloc)

# %% [markdown]
# **The same on the stand-in GPU, run here.** The stand-in has a caching
# allocator that behaves like PyTorch's: a freed block goes back to the pool
# of the stream it was allocated on and is handed to the next copy on that
# stream at once, unless `record_stream` named another stream that must
# first finish. `x` is copied in on the default stream, a long kernel on the
# side stream reads it, we drop `x`, and copy another batch in.

# %%
def standin_allocator_race(use_record_stream):
    gpu = StandInCuda(copy_s=1.0)
    main, side = gpu.current_stream(), gpu.Stream()
    x_host, y_host = host_batches(2, (1000,), seed=5)
    with gpu:
        x = x_host.to(gpu.device, non_blocking=True)  # allocated on the default stream
        side.wait_stream(main)                         # x is ready before side reads it
        with gpu.stream(side):
            read = gpu.launch(lambda v: v.sum().item(), x, duration=5.0)
        if use_record_stream:
            x.record_stream(side)
        del x                                          # its block: back to the pool
        y = y_host.to(gpu.device, non_blocking=True)   # the next copy on the default
        gpu.synchronize()
    status, seen = gpu.read(read)
    return status, seen, y


for use in (False, True):
    status, seen, _y = standin_allocator_race(use)
    what = (f"read x's values (sum {seen:.2f})" if status == "ok" else
            f"read batch {seen}'s values: x's block was refilled under it")
    print(f"{'with' if use else 'without':>7} record_stream: the side stream {what}")

# %% [markdown]
# ### Finding hidden synchronisations
#
# The opposite mistake is waiting where you did not mean to. Every read of a
# GPU value by the CPU waits for the GPU: `.item()`, `float(t)`, `print(t)`,
# `t.cpu()`, `if t > 0:`, and also ops whose output size depends on the data
# (`nonzero()`, boolean indexing `t[t > 0]`, `torch.unique`), because the CPU
# must know the size before it can allocate the result.
# `torch.cuda.set_sync_debug_mode("warn")` makes PyTorch warn at each such
# wait (`"error"` raises instead; `"default"` switches it off), which is the
# quickest way to find the one that keeps a training loop from running
# ahead of the GPU. It needs a CUDA build of PyTorch.

# %%
if HAS_CUDA:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = torch.randn(10_000, device=device)
            n_positive = int((y > 0).sum())   # a read of a GPU value: waits
            positive = y[y > 0]               # size depends on the data: waits
            z = y * 2                         # queued: no wait
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"{len(caught)} synchronising operations were reported:")
    for w in caught:
        print("  ", str(w.message).splitlines()[0][:100])
else:
    print("torch.cuda.set_sync_debug_mode needs a CUDA build of PyTorch; on a GPU "
          "this cell reports the two waits in: int((y > 0).sum()) and y[y > 0]")

# %% [markdown]
# ## 3. Two independent matmuls on two streams
#
# One seed times `E = A @ B; F = C @ D` on one stream against the same with
# `F` on a second stream, and reports 0.59 s against 0.30 s: twice as fast.
# Two things are wrong with drawing that conclusion:
#
# - the timing has **no warm-up**: the first matmul of a process pays for
#   loading cuBLAS and creating its handles and workspace, and that was
#   inside the one-stream measurement;
# - a large matmul already occupies every streaming multiprocessor (SM).
#   A second stream lets the GPU run a second kernel only on SMs the first
#   one leaves idle, so two *large* matmuls cannot finish in half the time.
#
# Two streams help when each kernel leaves much of the GPU idle: small
# kernels (few thread blocks) or kernels waiting on memory or on a copy. The
# same seed suggests running a model's two independent branches (CLIP's text
# and image encoders) on two streams to speed up inference; that gains only
# what one branch leaves idle, so something with small batches, little with
# large ones.
#
# The measurement below sweeps the matrix size, warms up first, and times
# with CUDA events. (Note that the side stream first waits for the default
# stream: the inputs were made there. The seed's code skips this and is only
# saved by a `synchronize()` before it.)

# %%
def timed_event():
    return torch.cuda.Event(enable_timing=True)


def two_matmuls(n, reps, two_streams):
    """Queue `reps` x (A@B on the default stream, C@D on a side stream or the same).

    Returns the total time in seconds and, for every matmul, the span between
    events recorded just before and just after it on its stream.
    """
    a, b, c, d = (torch.randn(n, n, device=device) for _ in range(4))
    main = torch.cuda.current_stream()
    other = SIDE if two_streams else main
    lane = "side stream" if two_streams else "default stream"
    start, end, marks = timed_event(), timed_event(), []
    torch.cuda.synchronize(device)
    start.record(main)
    other.wait_stream(main)  # c and d were made on the default stream
    for _ in range(reps):
        for stream, name, x, y, label in ((main, "default stream", a, b, "A@B"),
                                          (other, lane, c, d, "C@D")):
            with torch.cuda.stream(stream):
                e0, e1 = timed_event(), timed_event()
                e0.record()
                x @ y
                e1.record()
            marks.append((name, e0, e1, label))
    main.wait_stream(other)
    end.record(main)
    torch.cuda.synchronize(device)
    spans = [(name, start.elapsed_time(e0) / 1e3, start.elapsed_time(e1) / 1e3, label)
             for name, e0, e1, label in marks]
    return start.elapsed_time(end) / 1e3, spans


stream_sizes = [256, 512, 1024, 2048, 4096, 8192]
if HAS_CUDA:
    sweep_result = {"sizes": stream_sizes, "one_stream_s": [], "two_streams_s": []}
    for n in stream_sizes:
        reps = int(min(50, max(5, 4e12 / (2 * n**3))))
        two_matmuls(n, 2, True)  # warm-up: cuBLAS, allocator, the kernel choice
        t1 = min(two_matmuls(n, reps, False)[0] for _ in range(3))
        t2 = min(two_matmuls(n, reps, True)[0] for _ in range(3))
        sweep_result["one_stream_s"].append(t1)
        sweep_result["two_streams_s"].append(t2)
        print(f"n={n:5d} x{reps:2d}: one stream {t1 * 1e3:8.2f} ms, "
              f"two streams {t2 * 1e3:8.2f} ms, speed-up {t1 / t2:.2f}x")
    reference.record("03.two_streams", sweep_result, "s", device)
    timelines = {"one_stream": two_matmuls(1024, 4, False)[1],
                 "two_streams": two_matmuls(1024, 4, True)[1]}
    reference.record("03.two_streams_timeline", timelines, "s", device)
predicted_sweep = reference.predicted(
    {"sizes": stream_sizes,
     "one_stream_s": [2 * matmul_seconds(n) * two_stream_speedup(n)
                      for n in stream_sizes],
     "two_streams_s": [2 * matmul_seconds(n) for n in stream_sizes]},
    "s", H100,
    "two matmuls at the roofline's pace; one stream runs them one after the "
    "other, two streams at once as far as SMs are free: speed-up = min(2 tiles, "
    "SMs) / min(tiles, SMs), 128 x 128 output tiles assumed",
    ["h100_sxm.sm_count", "h100_sxm.fp32_tflops"])
seed_streams = reference.published("seed003.matmul_one_vs_two_streams_seconds")
seed_runs = [r for r in seed_streams.value if r["one_stream_s"]]
seed_speedup = sum(r["one_stream_s"] / r["multiple_streams_s"]
                   for r in seed_runs) / len(seed_runs)
sweep_figures = gpu_figures("03.two_streams", sweep_result if HAS_CUDA else None,
                            [predicted_sweep, seed_streams])
print(f"the seed's runs: one stream / two streams = {seed_speedup:.2f}x on average "
      "(no warm-up; GPU and matrix sizes not stated)")

# %% [markdown]
# ### The CPU analogue: two matmuls in two threads
#
# Without a GPU we can still watch independent work run at once. Two
# Python threads each run a loop of matmuls. Threads share one interpreter,
# but torch releases Python's global interpreter lock (GIL) inside its
# operators, so two matmuls *can* run on two cores at once - if two cores
# are free. That "if" is the lesson: a laptop or a CI runner is rarely idle.
#
# By default a single torch matmul already uses all cores (torch's intra-op
# threads): that is the "one kernel fills the GPU" case. With
# `torch.set_num_threads(1)` each matmul uses one core, like a kernel that
# leaves SMs idle, and a second thread can use the other core. For each run
# the cell measures the wall time, the **CPU time** of each thread
# (`time.thread_time`) and of the process, and **busy cores = CPU time /
# wall time**: 2.0 means both cores worked all along, 1.0 means one did. It
# draws one bar per matmul, and prints its own verdict.

# %%
def matmul_loop(x, reps, lane, label, spans, cpu_seconds):
    """`reps` matmuls, one span each; this thread's CPU time in cpu_seconds[label]."""
    cpu0 = time.thread_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        x @ x
        spans.append((lane, t0, time.perf_counter(), label))
    cpu_seconds[label] = time.thread_time() - cpu0


def run_two_loops(n, reps, threads):
    """Loops A and B of matmuls, one after the other or in two threads."""
    x1, x2 = torch.randn(n, n), torch.randn(n, n)
    spans, cpu_seconds = [], {}
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if threads:
        workers = [threading.Thread(target=matmul_loop,
                                    args=(x, reps, lane, label, spans, cpu_seconds))
                   for x, lane, label in ((x1, "thread 1", "A"), (x2, "thread 2", "B"))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        matmul_loop(x1, reps, "thread 1", "A", spans, cpu_seconds)
        matmul_loop(x2, reps, "thread 1", "B", spans, cpu_seconds)
    wall = time.perf_counter() - wall0
    return {"wall": wall, "cpu": time.process_time() - cpu0, "threads": cpu_seconds,
            "spans": spans}


n_cpu, reps_cpu = 320, 10
default_threads = torch.get_num_threads()
seq_runs, par_runs = [], []
try:
    torch.set_num_threads(1)
    two_loops = compare({  # interleaved, with CPU seconds and busy cores (Chapter 4)
        "one after the other": lambda: seq_runs.append(
            run_two_loops(n_cpu, reps_cpu, threads=False)),
        "two threads at once": lambda: par_runs.append(
            run_two_loops(n_cpu, reps_cpu, threads=True))}, repeats=3)
    torch.set_num_threads(default_threads)
    wide = min((run_two_loops(n_cpu, reps_cpu, False) for _ in range(2)),
               key=lambda r: r["wall"])
finally:
    torch.set_num_threads(default_threads)  # restore for the rest of the notebook
print(two_loops)
# the pictures below show a run of each kind of median length
seq, par = (sorted(r, key=lambda r: r["wall"])[len(r) // 2] for r in (seq_runs, par_runs))
for name, r in (("one after the other", seq), ("two threads at once", par)):
    per_thread = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["threads"].items())
    print(f"drawn below, {name}: wall {r['wall'] * 1e3:.1f} ms (loops: {per_thread})")
print(f"one loop with torch's default {default_threads} intra-op threads kept "
      f"{wide['cpu'] / wide['wall']:.2f} cores busy (of {usable_cores()}): what one "
      "matmul leaves idle is all a second thread can use")

# %% [markdown]
# The bars below are single matmuls. With one thread they alternate A, then
# B; with two threads the two rows run side by side. Bars side by side show
# that both threads were *inside* a matmul at the same time (concurrency);
# whether both really computed at once (parallelism) is what the busy-cores
# figure above says. On a machine where another program holds a core, the
# two-thread bars simply get longer.

# %%
fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharex=True)
plot_timeline(seq["spans"], ax=axes[0],
              title="one thread: loop A, then loop B (one core per matmul)")
plot_timeline(par["spans"], ax=axes[1], title="two threads: loops A and B at once")
cpu_fig = reference.measured(par["wall"], "s", "cpu")
for ax in axes:
    mark_kind(ax, cpu_fig)
fig.tight_layout()
plt.show()

# %% [markdown]
# Now the GPU figures beside the CPU point. The dashed curve is the model's
# prediction for an H100 (one stream vs two as the matrix grows); the dotted
# line is the seed's published ratio (its matrix size is not stated, so it
# is drawn across the whole axis); the circle is the two threads measured
# here, at the CPU's matrix size. Recorded GPU curves, when there are any,
# have square markers.

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for f in sweep_figures:
    v = f.value
    if f is seed_streams:
        ax.axhline(seed_speedup, color="tab:red", label=f"{f.legend} (size not stated)",
                   **figure_style("published"))
    elif isinstance(v, dict) and "sizes" in v:
        speedup = [t1 / t2 for t1, t2 in zip(v["one_stream_s"], v["two_streams_s"],
                                             strict=True)]
        ax.plot(v["sizes"], speedup, label=f.legend, **figure_style(f.kind))
ax.plot([n_cpu], [two_loops.ratio], color="black", ms=8,
        label=f"{cpu_fig.legend} (two threads, one core each)",
        **figure_style("measured"))
ax.axhline(1.0, color="gray", lw=1)
ax.set_xscale("log", base=2)
ax.set_xticks(stream_sizes + [n_cpu], [str(n) for n in stream_sizes + [n_cpu]],
              fontsize=7)
ax.set_ylim(min(0.5, 0.8 * two_loops.ratio), max(2.3, 1.2 * two_loops.ratio))  # the point stays in view
ax.set_xlabel("matrix size n (n x n matmuls, log scale)")
ax.set_ylabel("one stream (thread) time / two")
ax.set_title("Two independent matmuls: speed-up of a second stream or thread",
             fontsize=10)
ax.grid(True, alpha=0.3)
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# Read the sweep as: the speed-up of two streams is close to 1 for the large
# sizes (one matmul fills the GPU) and can be clearly above 1 only where a
# single matmul has too few output tiles to keep every SM busy. For the
# smallest sizes both runs may be limited by how fast Python can queue
# kernels (a few microseconds each), and then streams cannot help either.
# The seed's 2x, with no warm-up and no stated size, is one of the things
# the model says a *large* matmul cannot give.
#
# **What a timeline from events shows.** On a GPU the cell above also
# recorded an event just before and just after each matmul. An event marks
# when its *stream reached* that point, not when a kernel ran: a bar starts
# when the work queued before it on its stream is done, so it can start
# before its kernel gets any SM, and end after the kernel finished. Bars
# overlapping in two rows mean the two streams were *inside* their matmuls
# at once - close to, but not proof of, kernels running at once.
# `torch.profiler` records when each kernel really ran on the GPU (from the
# driver's activity records); on a GPU the cell below draws those kernel
# times, one row per GPU stream, beside the event spans. Without a GPU the
# timelines are the model's.

# %%
def both_streams_busy(timelines):
    """The share of the run during which a matmul ran on each stream at once."""
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


def kernel_spans(run):
    """Run `run()` under torch.profiler; the GPU kernels it ran, one lane per stream."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA
               and not any(w in e.name.lower() for w in ("memcpy", "memset", "sleep"))]
    t0 = min(e.time_range.start for e in kernels)
    return [(f"GPU stream {e.device_resource_id}", (e.time_range.start - t0) / 1e6,
             (e.time_range.end - t0) / 1e6, "mm") for e in kernels]


def predicted_spans(n, reps, two_streams):
    """Spans (lane, start, end, label) of reps x (A@B, C@D) as the model runs them."""
    t = matmul_seconds(n)
    spans, clock = [], 0.0
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


predicted_timelines = reference.predicted(
    {"one_stream": predicted_spans(1024, 4, False),
     "two_streams": predicted_spans(1024, 4, True)},
    "s", H100, "the two-stream model above for n = 1024 (64 tiles, 132 SMs)",
    ["h100_sxm.sm_count", "h100_sxm.fp32_tflops"])
show_timelines("03.two_streams_timeline", timelines if HAS_CUDA else None,
               [("one_stream", "A@B and C@D on ONE stream"),
                ("two_streams", "A@B on the default stream, C@D on a side stream")],
               "4 x (A@B, C@D), 1024x1024 matmuls - event spans (or the model's)",
               describe=both_streams_busy, figures=[predicted_timelines])
if HAS_CUDA:
    kernels = {"one_stream": kernel_spans(lambda: two_matmuls(1024, 4, False)),
               "two_streams": kernel_spans(lambda: two_matmuls(1024, 4, True))}
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.4), sharex=True)
    for ax, (key, spans) in zip(axes, kernels.items(), strict=True):
        plot_timeline(spans, ax=ax, title=f"{key}: kernels as torch.profiler saw them")
        mark_kind(ax, reference.measured(0.0, "s", device))
    fig.tight_layout()
    plt.show()
    print(both_streams_busy(kernels).replace("matmuls", "kernels"))

# %% [markdown]
# ## 4. Pinned memory
#
# A host-to-device copy is done by the GPU's copy engine with DMA, which can
# only read host memory the operating system promises not to move or swap:
# **pinned** (page-locked) memory. From ordinary, **pageable** memory the
# driver first copies into a pinned staging buffer of its own, chunk by
# chunk, and the CPU takes part in that. So:
#
# - copies from pinned memory should be faster, especially large ones (the
#   sweep below measures by how much);
# - only a copy from pinned memory can be truly asynchronous
#   (`non_blocking=True` returns at once and the copy runs while the CPU and
#   the GPU's compute units do other things).
#
# Without a GPU there is no PCIe link to measure. What the CPU can measure
# is the extra step a pageable copy adds: a copy from RAM to RAM. The plot
# shows it beside the link's published bandwidth and the predicted pinned
# and pageable curves.

# %%
def h2d_gbps(nbytes, pinned):
    src = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pinned)
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    t = bench(dst.copy_, src, min_run_time=0.1)  # bench waits for the GPU
    return nbytes / t.median / 1e9


def ram_copy_gbps(nbytes):
    """RAM-to-RAM copy bandwidth here: the fastest of three short medians."""
    src, dst = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    return nbytes / min(bench(dst.copy_, src, min_run_time=0.01).median
                        for _ in range(3)) / 1e9


h2d_sizes = [2**k for k in range(16, 29, 2)]  # 64 KiB .. 256 MiB
if HAS_CUDA:
    bw = {"bytes": h2d_sizes,
          "pageable_GBps": [h2d_gbps(b, False) for b in h2d_sizes],
          "pinned_GBps": [h2d_gbps(b, True) for b in h2d_sizes]}
    reference.record("03.h2d_bandwidth", bw, "GB/s", device)
ram_sizes = [b for b in h2d_sizes if b <= 2**26]  # up to 64 MiB here
ram_gbps = [ram_copy_gbps(b) for b in ram_sizes]
pcie = predict.link_bandwidth("pcie4_x16") / 1e9
pinned_rate = predict.achieved_link_bandwidth("pcie4_x16") / 1e9
pageable_rate = 1 / predict.calibrated_copy_seconds(1e9, "pcie4_x16",
                                                    pinned=False).value
predicted_h2d = reference.predicted(
    {"bytes": h2d_sizes, "pinned_GBps": [pinned_rate] * len(h2d_sizes),
     "pageable_GBps": [pageable_rate] * len(h2d_sizes)},
    "GB/s", "a GPU on PCIe 4.0 x16",
    f"calibrated: pinned copies at {predict.pcie_efficiency():.0%} of the link's "
    "rate; pageable ones add the driver's copy into a pinned staging buffer, at "
    f"{predict.host_copy_rate() / 1e9:.3g} GB/s (both from bandwidthTest on a DGX "
    "A100); no latency, so small copies are slower",
    [*predict.PCIE_EFFICIENCY_INPUTS, *predict.PAGEABLE_INPUTS])
pcie_links = [reference.published("pcie4_x16.bandwidth_per_direction_gbps"),
              reference.published("pcie5_x16.bandwidth_per_direction_gbps")]
# bandwidthTest on another A100 PCIe server: the same setup, measured
measured_a100 = {k: reference.published(f"bwtest.a100_pcie_{k}_gbps")
                 for k in ("pinned_h2d", "pageable_h2d", "pinned_d2h", "pageable_d2h")}
h2d_figures = gpu_figures("03.h2d_bandwidth", bw if HAS_CUDA else None,
                          [predicted_h2d, *pcie_links, *measured_a100.values()],
                          unit="GB/s")
fig, ax = plt.subplots(figsize=(6.4, 4.0))
for f, color in zip(h2d_figures, plt.cm.tab10.colors, strict=False):
    if isinstance(f.value, dict):
        for key, word in (("pinned_GBps", "pinned"), ("pageable_GBps", "pageable")):
            ax.plot(f.value["bytes"], f.value[key], color=color,
                    alpha=1.0 if word == "pinned" else 0.55,
                    label=f"{f.legend}: {word}", **figure_style(f.kind))
    elif f.kind == "published" and f.extra["id"].startswith("bwtest."):
        ax.plot([32e6], [f.value], color=color, linestyle="none",
                marker="o" if "pinned" in f.extra["id"] else "s",
                label=f"A100 PCIe server, {f.extra['quantity']}: published")
    elif f.kind == "published":
        link = f.extra["id"].split(".")[0]  # pcie4_x16 -> PCIe 4.0 x16
        link = link.replace("pcie", "PCIe ").replace("_x", ".0 x")
        ax.axhline(f.value, color=color, label=f"{link} link, one way: published",
                   **figure_style("published"))
ax.plot(ram_sizes, ram_gbps, color="black",
        label=f"{reference.device_name('cpu')}, measured here: RAM to RAM copy",
        **figure_style("measured"))
ax.set_xscale("log", base=2)
ax.set_ylim(0, None)
ax.set_xticks(h2d_sizes, [f"{b // 1024} KiB" if b < 2**20 else f"{b // 2**20} MiB"
                          for b in h2d_sizes])
ax.set_xlabel("size of the copy (log scale)")
ax.set_ylabel("bandwidth (GB/s)")
ax.set_title("Host-to-device copies: pinned vs pageable, and a RAM copy here",
             fontsize=10)
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
plt.show()
print(f"RAM to RAM here: {ram_gbps[-1]:.1f} GB/s at {ram_sizes[-1] // 2**20} MiB "
      "(smaller copies stay in the CPU's caches and look faster); a pageable copy "
      f"adds a copy like this one to the {pcie:g} GB/s link's")
for key, pred in (("pinned_d2h", pinned_rate), ("pageable_d2h", pageable_rate),
                  ("pinned_h2d", pinned_rate), ("pageable_h2d", pageable_rate)):
    ratio = pred / measured_a100[key].value
    verdict = ("within 25 %" if 0.8 <= ratio <= 1.25 else "within 2x, not 25 %"
               if 0.5 <= ratio <= 2 else "caveat: not supported within 2x")
    print(f"{measured_a100[key].extra['quantity']}: predicted {pred:.3g} GB/s, "
          f"published {measured_a100[key].value:g} GB/s on an A100 PCIe server, "
          f"ratio {ratio:.2f} ({verdict})")
print("the host side sets the pageable rate (its memory copy), and on some servers "
      "the host-to-device rate too: take pageable predictions as a range, from "
      "several times below pinned to about half of it")

# %% [markdown]
# ### What pinning costs: pin once, reuse
#
# Pinning is not free. To pin a buffer, the operating system must find
# physical pages for it, fill them in, and lock them (`mlock`); the CUDA
# driver then also maps them for the GPU. Pinned memory cannot be swapped
# out, so it is a limited resource too. `tensor.pin_memory()` makes a *new*
# pinned copy every time it is called; calling it on each batch just before
# `.to(device, non_blocking=True)` pays for a pinning and a copy to gain a
# faster copy, and usually loses (PyTorch's own tutorial says it can be up
# to twice as slow as a plain `.to(device)`). The rule: allocate pinned
# buffers once and copy into them, or let the `DataLoader` pin in its
# background thread (`pin_memory=True`), off the training loop's path.
#
# Without a GPU, `pin_memory()` raises; what a CPU can measure is the
# operating system's part of pinning, `mlock` on a fresh buffer, against a
# copy into a buffer that was locked before. (Unprivileged processes may
# lock only a little memory, often 8 MiB, so the cell uses 4 MiB and says
# so if even that is refused.)

# %%
def lock_fresh_pages_seconds(nbytes):
    """mlock `nbytes` of fresh memory (what pinning asks of the OS): seconds or None."""
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


PIN_BYTES = 4 * 2**20
src = torch.ones(PIN_BYTES // 4)
if HAS_CUDA:
    pin_s = bench(src.pin_memory, min_run_time=0.05).median
    pinned_buf = torch.empty_like(src).pin_memory()
    reuse_s = min(bench(pinned_buf.copy_, src, min_run_time=0.02).median
                  for _ in range(3))
    pin_ratio = (pin_s + reuse_s) / reuse_s
    print(f"pin_memory() of 4 MiB: {pin_s * 1e3:.2f} ms; copying into a pinned "
          f"buffer made once: {reuse_s * 1e3:.2f} ms")
    reference.record("03.pin_cost", pin_ratio, "x", device)
else:
    lock_s = min(filter(None, (lock_fresh_pages_seconds(PIN_BYTES)
                               for _ in range(3))), default=None)
    locked = torch.empty(PIN_BYTES // 4)
    reuse_s = min(bench(locked.copy_, src, min_run_time=0.02).median
                  for _ in range(3))
    if lock_s is None:
        pin_ratio = None
        print("this system refused to lock even 4 MiB (or has no mlock): "
              "nothing measured here")
    else:
        pin_ratio = (lock_s + reuse_s) / reuse_s
        print(f"locking 4 MiB of fresh pages: {lock_s * 1e3:.2f} ms; copying 4 MiB "
              f"into a buffer allocated before: {reuse_s * 1e3:.2f} ms")
pin_figures = gpu_figures(
    "03.pin_cost", pin_ratio if HAS_CUDA else None,
    [reference.published("pt_pinmem_tutorial.pin_then_copy_slowdown_max")], unit="x")
if not HAS_CUDA and pin_ratio is not None:
    print(f"03.pin_cost: {pin_ratio:.3g} x  [measured here on "
          f"{reference.device_name('cpu')} (lock the pages, then copy, over the "
          "copy alone)]")
    verdict = ("pinning on the fly costs more than the copy it is meant to speed up"
               if pin_ratio > 1.5 else "locking was cheap here, for this size")
    print("verdict:", verdict, "- pin once, reuse")

# %% [markdown]
# ## 5. Overlapping compute with copies back to the CPU
#
# The d2l seed computes 50 matmuls on a GPU, then copies the results to the
# CPU, and then does the same with `non_blocking=True`, which came out
# faster. Two corrections:
#
# - it timed with `torch.cuda.synchronize()` **without a device** while the
#   work ran on `cuda:6`; with no argument it waits only for the *current*
#   device (`cuda:0`). That is why "run on GPU1" took under a millisecond:
#   only the launches were timed. The copy's 1.44 s then paid for the rest:
#   the first copy waited for all 50 matmuls (the seed's own correctly timed
#   run takes 0.28 s), and then 50 results of 64 MB each (3.2 GB) went into
#   pageable memory, which is slow (section 4). Pass the device to
#   `synchronize`, or use events on its streams.
# - queued on the **same** stream, a copy cannot start before every matmul
#   queued ahead of it has finished: the stream runs in order. So the
#   `non_blocking` version does not overlap copies with compute at all. It
#   is faster mostly because `.to("cpu", non_blocking=True)` copies into a
#   freshly *pinned* host tensor (faster than pageable, section 4), and the
#   CPU no longer waits after each copy.
#
# Real overlap needs a **second stream** for the copies, each copy waiting
# (with an event) only for the result it copies, into pinned buffers, with
# `record_stream` so the allocator keeps each result alive until its copy
# is done. We compare the three versions and draw their timelines.

# %%
def compute_and_copy(x, k, mode):
    """k matmuls, each result copied to the CPU: (seconds, spans, host results)."""
    main, copier = torch.cuda.current_stream(), SIDE
    pinned = mode != "pageable, one stream"
    host = [torch.empty(x.shape, pin_memory=pinned) for _ in range(k)]
    start, end, marks, ys = timed_event(), timed_event(), [], []
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    start.record(main)
    for i in range(k):
        e0, e1 = timed_event(), timed_event()
        e0.record(main)
        ys.append(x @ x)
        e1.record(main)
        marks.append(("compute", e0, e1, f"y{i}"))
        if mode == "copy stream":
            copier.wait_event(e1)  # copy y_i as soon as y_i is ready
            with torch.cuda.stream(copier):
                c0, c1 = timed_event(), timed_event()
                c0.record()
                host[i].copy_(ys[i], non_blocking=True)
                c1.record()
            ys[i].record_stream(copier)
            marks.append(("copy", c0, c1, f"y{i}"))
    if mode != "copy stream":  # the seed's order: every copy after every matmul
        for i in range(k):
            c0, c1 = timed_event(), timed_event()
            c0.record(main)
            host[i].copy_(ys[i], non_blocking=pinned)
            c1.record(main)
            marks.append(("copy", c0, c1, f"y{i}"))
    main.wait_stream(copier)
    end.record(main)
    torch.cuda.synchronize(device)  # name the device: never rely on the current one
    seconds = time.perf_counter() - t0
    spans = [(lane, start.elapsed_time(a) / 1e3, start.elapsed_time(b) / 1e3, lab)
             for lane, a, b, lab in marks]
    return seconds, spans, host


MODES = ("pageable, one stream", "pinned non_blocking, one stream", "copy stream")
if HAS_CUDA:
    x = torch.randn(4096, 4096, device=device)
    expected = (x @ x).cpu()
    copy_results, copy_timelines = {}, {}
    for mode in MODES:
        compute_and_copy(x, 8, mode)  # warm-up: also caches memory for 8 results
        seconds, spans, host = compute_and_copy(x, 8, mode)
        right = all(torch.allclose(h, expected, rtol=1e-4, atol=1e-3) for h in host)
        copy_results[mode], copy_timelines[mode] = seconds, spans
        print(f"{mode:>32}: {seconds * 1e3:7.1f} ms, every copy right: {right}")
    reference.record("03.copy_compute", copy_results, "s", device)
    reference.record("03.copy_compute_timeline", copy_timelines, "s", device)


def copy_model(k, n, link="pcie5_x16"):
    """Seconds of the three versions: k n x n matmuls and their copies to the CPU."""
    mm = matmul_seconds(n)
    cp = predict.calibrated_copy_seconds(4 * n * n, link).value
    cp_pageable = predict.calibrated_copy_seconds(4 * n * n, link, pinned=False).value
    return {"pageable, one stream": k * mm + k * cp_pageable,
            "pinned non_blocking, one stream": k * mm + k * cp,
            "copy stream": k * max(mm, cp) + min(mm, cp)}, mm, cp


COPY_MODEL = ("k matmuls at the roofline's pace and k copies of their results at "
              "the rate pinned copies reach (calibrated; pageable ones add the "
              "driver's staging copy); one stream adds them up, a copy stream "
              "overlaps each copy with the next matmul")
copy_pred, mm, cp = copy_model(8, 4096)
cp_pageable = predict.calibrated_copy_seconds(4 * 4096**2, "pcie5_x16",
                                              pinned=False).value
copy_rule = reference.predicted(
    copy_pred, "s", "an H100 SXM on PCIe 5.0 x16", COPY_MODEL + " (k = 8, n = 4096)",
    ["h100_sxm.fp32_tflops", "pcie5_x16.bandwidth_per_direction_gbps",
     *predict.PCIE_EFFICIENCY_INPUTS])
show_gpu("03.copy_compute", [copy_rule], lambda v: [
    print(f"  {mode:>32}: {sec * 1e3:7.1f} ms") for mode, sec in v.items()])

# %% [markdown]
# **The seed's own workload.** The same model, fed with the seed's sizes (50
# matmuls of 4000 x 4000, 50 copies of 64 MB), beside what the seed
# published. The gap is a lesson in itself: the seed's "run" figure is the
# time to *queue* the work (no wait on the right device), and its copies
# went to pageable memory on a GPU whose link it does not name.

# %%
seed_pred, mm50, cp50 = copy_model(50, 4000)
seed_rows = [  # (what, published figure or None, predicted seconds)
    ("compute only",
     reference.published("seed001.matmul50_single_gpu_seconds"), 50 * mm50),
    ("compute, then copy\n(pageable)",
     reference.published("seed001.copy_to_cpu_seconds"),
     seed_pred["pageable, one stream"]),
    ("compute, non_blocking\ncopies, one stream",
     reference.published("seed001.run_and_copy_nonblocking_seconds"),
     seed_pred["pinned non_blocking, one stream"]),
    ("compute, copies on\na copy stream", None, seed_pred["copy stream"]),
]
seed_model = reference.predicted(
    [pred for _, _, pred in seed_rows], "s", "an H100 SXM on PCIe 5.0 x16",
    COPY_MODEL + " (k = 50, n = 4000)",
    ["h100_sxm.fp32_tflops", "pcie5_x16.bandwidth_per_direction_gbps",
     *predict.PCIE_EFFICIENCY_INPUTS])
fig, ax = plt.subplots(figsize=(8, 3.8))
for i, (_what, pub, pred) in enumerate(seed_rows):
    bars = [(0, pred, seed_model)]
    if pub is not None:
        value = pub.value[0]["seconds"] if isinstance(pub.value, list) else pub.value
        bars.append((1, value, pub))
    for j, value, f in bars:
        ax.bar(i + 0.38 * j, value, width=0.36, color=plt.cm.tab10.colors[j],
               edgecolor="black", hatch=FIGURE_STYLE[f.kind]["hatch"],
               label=(f"{f.legend} (seed 001)" if j else f.legend) if i == 0 else None)
        ax.annotate(f"{value:.3g} s", (i + 0.38 * j, value), ha="center",
                    va="bottom", fontsize=7)
ax.set_xticks([i + 0.19 for i in range(len(seed_rows))],
              [what for what, _, _ in seed_rows], fontsize=8)
ax.set_ylabel("seconds")
ax.set_title("Seed 001's workload: 50 matmuls of 4000x4000 and 50 copies of 64 MB",
             fontsize=10)
ax.set_ylim(0, 1.25 * max(ax.get_ylim()))
ax.legend(fontsize=7, loc="upper left")
plt.show()
print(seed_model.label)
for what, pub, pred in seed_rows:
    if pub is None:
        seen = "not measured by the seed"
    else:
        value = pub.value[0]["seconds"] if isinstance(pub.value, list) else pub.value
        seen = f"published {value:.4g} s [{pub.label}]"
    print(f"  {what.replace(chr(10), ' '):>38}: predicted {pred:.3f} s, {seen}")

# %% [markdown]
# **The CPU analogue, measured here.** One thread computes matmuls; the
# "copy" of each result is a copy of a 16 MiB block of RAM (it stands for
# the slow link, and takes about as long as a matmul). One after the other,
# every copy waits for every matmul; on a second thread, fed by a queue,
# each copy starts as soon as its matmul is done, like the copy stream. The
# cell prints busy cores and its verdict.

# %%
def cpu_copy_pipeline(k, n, copy_floats, overlap):
    """k matmuls and k copies; with `overlap`, the copies run on a second thread."""
    x = torch.randn(n, n)
    src, dst = torch.randn(copy_floats), torch.zeros(copy_floats)  # touched: no faults
    spans, done = [], queue.Queue()

    def copier():
        for _ in range(k):
            i = done.get(timeout=10)
            t0 = time.perf_counter()
            dst.copy_(src)  # stands for copying result i over the link
            spans.append(("copy", t0, time.perf_counter(), f"y{i}"))

    wall0, cpu0 = time.perf_counter(), time.process_time()
    worker = threading.Thread(target=copier, daemon=True) if overlap else None
    if worker:
        worker.start()
    for i in range(k):
        t0 = time.perf_counter()
        x @ x
        spans.append(("compute", t0, time.perf_counter(), f"y{i}"))
        done.put(i)
    if worker:
        worker.join(timeout=10)
    else:
        copier()
    wall = time.perf_counter() - wall0
    return {"wall": wall, "busy": (time.process_time() - cpu0) / wall, "spans": spans}


saved_threads = torch.get_num_threads()
pipe_runs = {False: [], True: []}
try:
    torch.set_num_threads(1)
    print(compare({  # interleaved, CPU seconds and busy cores (Chapter 4)
        "one thread": lambda: pipe_runs[False].append(
            cpu_copy_pipeline(8, 320, 2**22, False)),
        "copy thread": lambda: pipe_runs[True].append(
            cpu_copy_pipeline(8, 320, 2**22, True))}, repeats=3))
finally:
    torch.set_num_threads(saved_threads)
# the timelines show a run of median length of each
pipe = {ov: sorted(r, key=lambda r: r["wall"])[len(r) // 2] for ov, r in pipe_runs.items()}
fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharex=True)
for ax, ov in zip(axes, (False, True), strict=True):
    plot_timeline(pipe[ov]["spans"], ax=ax, lanes=["compute", "copy"],
                  title="one thread: compute all, then copy all" if not ov else
                  "a copy thread: each copy as soon as its matmul is done")
    mark_kind(ax, reference.measured(pipe[ov]["wall"], "s", "cpu"))
fig.tight_layout()
plt.show()

# %% [markdown]
# And the GPU timelines: each copy on the copy stream runs under the next
# matmul (predicted for an H100 unless a GPU recorded its own).

# %%
def hidden_copy_time(timelines):
    """For each mode: the share of the copy time that ran under a matmul."""
    parts = []
    for mode, spans in timelines.items():
        compute = [sp for sp in spans if sp[0] == "compute"]
        copies = [sp for sp in spans if sp[0] == "copy"]
        hidden = sum(overlap_seconds(c, m) for c in copies for m in compute)
        parts.append(f"{mode}: {hidden / sum(c[2] - c[1] for c in copies):.0%}")
    return "copy time hidden under compute - " + "; ".join(parts)


def predicted_copy_spans(mode, k=8):
    spans = [("compute", i * mm, (i + 1) * mm, f"y{i}") for i in range(k)]
    cp_mode = cp_pageable if mode.startswith("pageable") else cp
    t = 0.0 if mode == "copy stream" else k * mm
    for i in range(k):
        if mode == "copy stream":  # each copy as soon as its matmul is done
            t = max(t, (i + 1) * mm)
        spans.append(("copy", t, t + cp_mode, f"y{i}"))
        t += cp_mode
    return spans


copy_timeline_rule = reference.predicted(
    {mode: predicted_copy_spans(mode) for mode in MODES}, "s",
    "an H100 SXM on PCIe 5.0 x16", "the copy model above, span by span",
    ["h100_sxm.fp32_tflops", "pcie5_x16.bandwidth_per_direction_gbps",
     *predict.PCIE_EFFICIENCY_INPUTS])
show_timelines("03.copy_compute_timeline", copy_timelines if HAS_CUDA else None,
               [(mode, mode) for mode in MODES],
               "8 matmuls (4096x4096) and their copies to the CPU",
               describe=hidden_copy_time, figures=[copy_timeline_rule])

# %% [markdown]
# **Try it: copy size against compute size.** The slider redraws the
# predicted timeline of 4 chunks, each a matmul followed by a copy of a
# result, for an H100 on PCIe 5.0. On one stream the time is the *sum* of
# all matmuls and copies; with a copy stream it approaches the *larger* of
# the two totals (plus one of the smaller at the end). Overlap can hide the
# smaller of the two, never the larger: when copies dominate, a faster link
# or fewer bytes is the only cure.

# %%
def draw_overlap(copy_mib=64.0, matmul_n=4096, chunks=4):
    mm_s = matmul_seconds(matmul_n)
    cp_s = predict.calibrated_copy_seconds(copy_mib * 2**20, "pcie5_x16").value
    one, two, t, c = [], [], 0.0, 0.0
    for i in range(chunks):
        one += [("compute", t, t + mm_s, f"c{i}"), ("copy", t + mm_s, t + mm_s + cp_s,
                                                      f"c{i}")]
        t += mm_s + cp_s
        two.append(("compute", i * mm_s, (i + 1) * mm_s, f"c{i}"))
        c = max(c, (i + 1) * mm_s)
        two.append(("copy", c, c + cp_s, f"c{i}"))
        c += cp_s
    pred = reference.predicted(
        c, "s", "an H100 SXM on PCIe 5.0 x16", "matmuls at the roofline's pace, "
        "pinned copies at the rate they reach (calibrated)",
        ["h100_sxm.fp32_tflops", "pcie5_x16.bandwidth_per_direction_gbps",
         *predict.PCIE_EFFICIENCY_INPUTS])
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.4), sharex=True)
    plot_timeline(one, ax=axes[0], lanes=["compute", "copy"],
                  title=f"one stream: sum = {t * 1e3:.2f} ms")
    plot_timeline(two, ax=axes[1], lanes=["compute", "copy"],
                  title=f"copy stream: {c * 1e3:.2f} ms; max of the totals = "
                        f"{max(chunks * mm_s, chunks * cp_s) * 1e3:.2f} ms")
    for ax in axes:
        mark_kind(ax, pred)
    fig.tight_layout()
    plt.show()
    bound = "copies" if cp_s > mm_s else "compute"
    print(f"matmul {mm_s * 1e3:.3f} ms, copy {cp_s * 1e3:.3f} ms per chunk: "
          f"{bound}-bound; the copy stream saves {(1 - c / t):.0%}")


overlap_slider = widgets.interact(
    draw_overlap,
    copy_mib=widgets.FloatLogSlider(value=64, base=2, min=0, max=10, step=1,
                                    description="copy MiB", continuous_update=False),
    matmul_n=widgets.SelectionSlider(options=[2**k for k in range(9, 15)], value=4096,
                                     description="matmul n", continuous_update=False),
    chunks=widgets.fixed(4))

# %% [markdown]
# ## 6. The device-to-host `non_blocking` trap
#
# `y.to("cpu", non_blocking=True)` returns a CPU tensor **before** the copy
# has happened. Reading it then (printing it, `numpy()`, a Python `if`) reads
# whatever the pinned memory held before: zeros, or values left from an
# earlier use. No error is raised. (How much of the tensor is stale depends
# on how far the GPU has got, so the cell prints the fraction that was
# right.) The fix is to wait before reading: an event recorded after the
# copy (`ev.synchronize()`), the stream, or the device. Host-to-device
# `non_blocking` copies do not have this trap, because later GPU work on the
# same stream is queued behind the copy; their trap is the reverse one: do
# not overwrite the pinned source on the CPU before the copy has run. The
# CPU analogue is the thread race of section 2: read without waiting, and
# the buffer holds what was there before.

# %%
def d2h_read(value, wait):
    torch.cuda._sleep(SLEEP_CYCLES)                 # the GPU is still busy...
    y = torch.full((1_000_000,), value, device=device)
    h = y.to("cpu", non_blocking=True)              # ...so this returns at once
    if wait:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()                          # wait for the copy only
    seen = (h == value).float().mean().item()       # the CPU reads h now
    torch.cuda.synchronize(device)
    return seen


if HAS_CUDA:
    # Warm-up: the first pinned buffer of this size comes from the driver (and
    # getting it may wait for the GPU); later ones come from torch's cache of
    # pinned blocks, here holding the -1s of this call: "values left over".
    d2h_read(-1.0, wait=True)
    trap = {"read at once": d2h_read(3.0, wait=False),
            "read after event.synchronize()": d2h_read(5.0, wait=True)}
    for k, v in trap.items():
        print(f"{k}: {v:.0%} of the host tensor holds the right value")
    reference.record("03.d2h_trap", trap, "fraction of correct values", device)
trap_rule = reference.predicted(
    {"read at once": "some or none (the copy has not run yet)",
     "read after event.synchronize()": 1.0},
    "fraction of correct values", "any CUDA GPU",
    "CUDA semantics: a device-to-host non_blocking copy returns before it runs")
show_gpu("03.d2h_trap", [trap_rule], lambda v: print("  ", {
    k: f"{x:.0%} correct" if isinstance(x, float) else x for k, x in v.items()}))
print(f"CPU analogue (section 2), measured here: read at once {unordered:.4f}, "
      f"after waiting {ordered:.4f}, expected {expected_sum:.4f}")

# %% [markdown]
# ## 7. Prefetching the next batch on a side stream
#
# Section 5 moved copies *off* the GPU beside the compute. Training needs
# the other direction: the next batch should arrive *on* the GPU while the
# model trains on this one. `batch.to(device, non_blocking=True)` from
# pinned memory frees the CPU, but queued on the default stream the copy
# still runs in order with the training kernels: the GPU copies, then
# trains, then copies. The pattern that overlaps them is a **prefetcher**:
#
# 1. on a side stream, start copying batch *i + 1*;
# 2. make the compute stream wait for that copy **on the GPU**
#    (`main.wait_stream(side)` or an event) before batch *i + 1* is used -
#    not `synchronize()`, which would stop the CPU;
# 3. call `batch.record_stream(main)` on each batch you hand out: its memory
#    was allocated on the side stream, and without this the allocator hands
#    it to the *next* copy on the side stream as soon as Python drops the
#    tensor, while the training kernels queued on `main` may still read it.
#    This is the textbook use of `record_stream`.
#
# The two mistakes are the two races of section 2, and the stand-in GPU
# makes each of them show every time. Below, a prefetcher that copies on a
# side stream but forgets step 2 (and a note on what step 3 would catch),
# and a "prefetcher" that copies on the current stream: right, but nothing
# overlaps. Exercise 3.1 asks you to write the right one; its checker runs
# it on the stand-in and, on a machine with a GPU, for real.

# %%
def prefetch_without_waiting(batches, device, cuda):
    side = cuda.Stream()
    for b in batches:
        with cuda.stream(side):
            x = b.to(device, non_blocking=True)
        x.record_stream(cuda.current_stream())
        yield x


def prefetch_on_current_stream(batches, device, cuda):
    for b in batches:
        yield b.to(device, non_blocking=True)


def standin_train(prefetch, n=6, copy_s=2.0, step_s=1.0):
    """Train on n batches through `prefetch` on the stand-in: what each step read."""
    gpu = StandInCuda(copy_s=copy_s)
    batches = host_batches(n, (3, 4), seed=11)
    steps = []
    with gpu:
        for x in prefetch(iter(batches), gpu.device, gpu):
            steps.append(gpu.launch(lambda v: v.sum().item(), x, step_s))
        gpu.synchronize()
    reads = [gpu.read(op)[0] for op in steps]
    return gpu, reads


for prefetch in (prefetch_without_waiting, prefetch_on_current_stream):
    gpu, reads = standin_train(prefetch)
    total = max(op["end"] for op in gpu.ops)
    print(f"{prefetch.__name__}: steps read {reads}; "
          f"{total:g} time units for 6 copies of 2 and 6 steps of 1")
    fig, ax = plt.subplots(figsize=(8, 1.9))
    spans = [(lane, a, b, "batch " + label.split()[-1])  # one colour per batch
             for lane, a, b, label in gpu.spans()]
    plot_timeline(spans, ax=ax, unit="s",
                  title=f"stand-in GPU (simulated time): {prefetch.__name__}")
    ax.set_xlabel("simulated time units")
    fig.tight_layout()
    plt.show()
step_h100 = matmul_seconds(4096)
copy_h100 = predict.calibrated_copy_seconds(64 * 2**20, "pcie5_x16").value
prefetch_rule = reference.predicted(
    {"serial": 8 * (step_h100 + copy_h100),
     "prefetched": copy_h100 + 7 * max(step_h100, copy_h100) + step_h100},
    "s", "an H100 SXM on PCIe 5.0 x16",
    "8 batches of 64 MiB, a 4096 matmul per step: on one stream copy + step add "
    "up; prefetched, each copy hides under the previous step",
    ["h100_sxm.fp32_tflops", "pcie5_x16.bandwidth_per_direction_gbps",
     *predict.PCIE_EFFICIENCY_INPUTS])
show_gpu("03.prefetch", [prefetch_rule], lambda v: print("  ", {
    k: f"{s * 1e3:.2f} ms" for k, s in v.items()}))

# %% [markdown]
# In the first timeline, the training steps on the default stream start
# while their copies are still running on the side stream: each step read
# a batch that was not there yet (`unwritten`). In the second, every step
# reads the right batch, but copies and steps take turns on one stream, and
# the time is the sum of both.
#
# ## 8. Streams and the backward pass
#
# Autograd follows the streams of the forward pass: each backward CUDA op
# runs on the same stream as the forward op it belongs to, so a forward that
# ran two branches on two streams gets the same parallelism in its backward.
# Towards the code around it, `loss.backward()` behaves like any other
# queued op on the stream that is current when you call it: the gradients
# are ready *in that stream's order*. So using them on another stream needs
# the same wait as any other cross-stream read, and so does an initial
# gradient made on another stream:
#
# ```python
# with torch.cuda.stream(s):
#     loss.backward()
# torch.cuda.current_stream().wait_stream(s)  # before optimizer.step() here
# ```
#
# On a GPU the cell below runs a forward and a backward on the side stream,
# waits as above, and checks the gradient against one computed on the
# default stream. (Autograd on the CPU has no streams: everything is in
# program order.)

# %%
if HAS_CUDA:
    layer = torch.nn.Linear(512, 512, device=device)
    inputs = torch.randn(256, 512, device=device)
    layer(inputs).square().mean().backward()
    reference_grad = layer.weight.grad.clone()
    layer.weight.grad = None
    SIDE.wait_stream(torch.cuda.current_stream())  # inputs and weights are ready
    with torch.cuda.stream(SIDE):
        layer(inputs).square().mean().backward()
    torch.cuda.current_stream().wait_stream(SIDE)  # the gradients are ready here
    same = torch.allclose(layer.weight.grad, reference_grad, rtol=1e-4, atol=1e-6)
    print(f"backward on a side stream, used after wait_stream: same gradient: {same}")
else:
    print("no GPU here: the rules above are PyTorch's documented stream semantics "
          "of backward passes (CUDA semantics notes)")

# %% [markdown]
# ## 9. Two devices at once
#
# The d2l seed's point is right: if you do not synchronise between two
# devices, each works through its own queue and both work at the same time.
# Two of its explanations need correcting:
#
# - Its timing of "GPU1 & GPU2" again called `synchronize()` without a
#   device, so it did not wait for `cuda:6` and `cuda:7`. It reported 0.14 s
#   for both, *half* of either GPU alone (0.28 s), which no amount of overlap
#   can give: the timer stopped while the GPUs were still working, so the
#   figure is not the time of the work. Done at once, two equal jobs take
#   about as long as one; wait for each device you used.
# - It credits the overlap to the framework, which "builds a computation
#   graph" and "automatically schedules" the work on both GPUs. PyTorch in
#   eager mode does neither: Python runs the operations in program order, and
#   each one is queued on the current stream of its tensors' device and
#   returns. The two GPUs overlap only because queuing is so much faster than
#   the work, so the second GPU's queue fills while the first is still busy.
#   Put a `synchronize`, an `.item()` or a `print(tensor)` between the two and
#   they run one after the other; nothing reorders them for you. (Graph
#   compilers such as `torch.compile` do analyse dependencies, but within one
#   device's program, not across the devices of this example.)
#
# With one GPU, the second device is the CPU: queue GPU work, do CPU work
# while the GPU runs, and only then wait for the GPU. With two or more GPUs
# the cell also runs the seed's two-GPU version, correctly timed. Without a
# GPU, the CPU analogue is the two threads of section 3.

# %%
def gpu_work(x, reps):
    for _ in range(reps):
        x @ x


def concurrency_summary(t):
    """Compare 'both' with the larger of the two alone and with their sum."""
    pairs = (("GPU alone", "CPU alone", "GPU then CPU, no sync between"),
             ("GPU 0 alone", "GPU 1 alone", "GPU 0 and GPU 1"))
    for a, b, both in pairs:
        if both in t and a in t and b in t:
            print(f"  {both}: {t[both] / max(t[a], t[b]):.2f}x the larger one alone, "
                  f"{t[both] / (t[a] + t[b]):.2f}x their sum")


if HAS_CUDA:
    xg, xc = torch.randn(4096, 4096, device=device), torch.randn(1024, 1024)
    gpu_work(xg, 2)  # warm-up
    gpu_work(xc, 1)
    timings = {}
    for name, on_gpu, on_cpu in (("GPU alone", True, False), ("CPU alone", False, True),
                                 ("GPU then CPU, no sync between", True, True)):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if on_gpu:
            gpu_work(xg, 40)   # queued: returns long before the GPU is done
        if on_cpu:
            gpu_work(xc, 10)   # the CPU computes meanwhile
        torch.cuda.synchronize(device)
        timings[name] = time.perf_counter() - t0
    gpus = try_all_gpus()
    if len(gpus) >= 2:
        xs = [torch.randn(4096, 4096, device=g) for g in gpus[:2]]
        for x_, g in zip(xs, gpus[:2], strict=True):
            gpu_work(x_, 2)
            torch.cuda.synchronize(g)
        for name, use in (("GPU 0 alone", [0]), ("GPU 1 alone", [1]),
                          ("GPU 0 and GPU 1", [0, 1])):
            t0 = time.perf_counter()
            for i in use:
                gpu_work(xs[i], 40)
            for i in use:
                torch.cuda.synchronize(gpus[i])  # wait for every device used
            timings[name] = time.perf_counter() - t0
    for k, v in timings.items():
        print(f"{k:>30}: {v * 1e3:7.1f} ms")
    concurrency_summary(timings)
    reference.record("03.two_devices", timings, "s", device)
gpu_40 = 40 * matmul_seconds(4096)
devices_rule = reference.predicted(
    {"GPU 0 alone": gpu_40, "GPU 1 alone": gpu_40, "GPU 0 and GPU 1": gpu_40},
    "s", "two H100s", "40 matmuls of 4096 at the roofline's pace on each; with no "
    "synchronize between them the two queues run at once: both take as long as one",
    ["h100_sxm.fp32_tflops"])
seed_alone = reference.published("seed001.matmul50_single_gpu_seconds")
seed_both = reference.published("seed001.matmul50_two_gpus_seconds")
seed_devices = [seed_alone, seed_both]


def print_devices(value):
    if isinstance(value, dict):
        for k, v in value.items():
            print(f"  {k:>30}: {v * 1e3:7.1f} ms")
        concurrency_summary(value)
    elif isinstance(value, list):
        print("  ", "; ".join(f"{r['label']} ({r['device']}): {r['seconds']} s"
                              for r in value))
    else:
        print(f"   both GPUs (timer stopped early): {value} s")


show_gpu("03.two_devices", [devices_rule, *seed_devices], print_devices)
loop_wall = {label: max(sp[2] for sp in seq["spans"] if sp[3] == label)
             - min(sp[1] for sp in seq["spans"] if sp[3] == label) for label in "AB"}
both = par["wall"] / max(loop_wall.values())
print("CPU analogue, measured here (section 3): loop A alone "
      f"{loop_wall['A'] * 1e3:.1f} "
      f"ms, loop B alone {loop_wall['B'] * 1e3:.1f} ms, both in two threads "
      f"{par['wall'] * 1e3:.1f} ms = {both:.2f}x the longer one alone")
print("verdict of section 3's comparison:", two_loops.verdict)

# %% [markdown]
# **Seed 001's picture, drawn.** The seed ends with a figure of a two-layer
# MLP trained on a CPU and two GPUs, as a graph of dependencies. Each box is
# one piece of work on one device; an arrow means "needs the result of".
# Boxes on the same row with no arrow between them may run at once; that is
# all the parallelism there is. In eager PyTorch nobody schedules this
# graph for you: you get the overlap by queuing each GPU's work without a
# synchronisation in between (this section), by copying gradients out on a
# side stream as soon as each is ready (section 5: the gradient of the
# second layer is ready before the first's), and by summing on the CPU only
# what has arrived. Chapter 6's all-reduce replaces the CPU in the middle.

# %%
def draw_mlp_graph():
    """Boxes (lane, x, row, text) and arrows of the seed's two-layer MLP step."""
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


draw_mlp_graph()

# %% [markdown]
# ## 10. Overlapping data loading with training
#
# The GPU can only train as fast as batches arrive. If the process that runs
# the training loop also prepares every batch (decoding, augmenting,
# collating), the accelerator waits during that time, and the CPU waits
# during training. `DataLoader(num_workers=k)` prepares batches in `k`
# worker processes while the main process trains: a pipeline. With
# `pin_memory=True` (useful only with a GPU) a thread in the main process
# also copies each finished batch into pinned memory, so that
# `batch.to(device, non_blocking=True)` is a true asynchronous copy.
#
# This section runs on every machine. Each item of the dataset below is a
# whole batch, made with real CPU work (FFT filtering of random images, a
# stand-in for decoding and augmentation), and it stamps when it was made
# and by which worker. The "training step" is real compute on `device`: on
# a CPU-only machine it competes with the loading for the same cores; on a
# GPU it is short, and the question becomes whether the loading keeps the
# GPU fed. We give the main process one intra-op thread, the same as a
# worker has (DataLoader sets that in its workers), so that a batch costs
# the same wherever it is made. Every loader has a `timeout`, so that a
# stuck worker raises an error instead of hanging the notebook.

# %%
class SyntheticBatches(Dataset):
    """Batch i: random images, FFT-filtered (real CPU work), with its timestamps."""

    def __init__(self, n_batches, batch_size=32, side=64, passes=16):
        self.n_batches, self.batch_size, self.side = n_batches, batch_size, side
        self.passes = passes
        g = torch.Generator().manual_seed(0)
        self.mask = torch.rand(side, side // 2 + 1, generator=g)

    def __len__(self):
        return self.n_batches

    def __getitem__(self, i):
        start = time.perf_counter()
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.batch_size, self.side, self.side, generator=g)
        for _ in range(self.passes):
            x = torch.fft.irfft2(torch.fft.rfft2(x) * self.mask,
                                 s=(self.side, self.side))
        y = (x.mean(dim=(1, 2)) > 0).long()
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else -1
        stamp = [start, time.perf_counter(), worker]
        return x, y, torch.tensor(stamp, dtype=torch.float64)


W = (torch.randn(64 * 64, 256) / 64).to(device)


def train_step(x):
    """Stands in for forward + backward: a fixed amount of real compute."""
    h = x.reshape(x.shape[0], -1)
    return (torch.tanh(h @ W) @ W.T).sum()


# Worker processes are started with fork where it exists, so they inherit the
# classes defined in this notebook (spawn would have to import them from a file).
FORK = "fork" if "fork" in mp.get_all_start_methods() else None

# %% [markdown]
# One epoch: iterate the loader, move each batch to the device, train on it,
# and stamp the training spans. With `persistent_workers=True` the workers
# stay alive between epochs, so we run three: the first pays for starting
# the workers (counted honestly, and printed), and the faster of the other
# two is the steady state (taking the faster of two keeps some of the noise
# of a shared machine out).

# %%
N_BATCHES = 20


def run_epochs(num_workers, n_batches=N_BATCHES, epochs=3):
    """Time `epochs` epochs: (first time, best later time, spans of that epoch)."""
    workers = {"num_workers": num_workers, "persistent_workers": True,
               "prefetch_factor": 2, "multiprocessing_context": FORK,
               "timeout": 60} if num_workers > 0 else {}
    loader = DataLoader(SyntheticBatches(n_batches), batch_size=None, shuffle=False,
                        pin_memory=HAS_CUDA, **workers)
    times, all_spans = [], []
    for _ in range(epochs):
        spans = []
        t0 = time.perf_counter()
        for x, _y, stamp in loader:
            x = x.to(device, non_blocking=True)  # asynchronous from pinned memory
            s = time.perf_counter()
            train_step(x)
            if HAS_CUDA:  # only so that the span shows the GPU's work; a real
                torch.cuda.synchronize(device)  # loop would not wait here
            spans.append(("main: train", s, time.perf_counter(), ""))
            lane = "main: load" if stamp[2] < 0 else f"worker {int(stamp[2])}: load"
            spans.append((lane, stamp[0].item(), stamp[1].item(), ""))
        times.append(time.perf_counter() - t0)
        all_spans.append(spans)
    del loader  # shuts the persistent workers down
    best = min(range(1, epochs), key=times.__getitem__)
    return times[0], times[best], all_spans[best]


def preloaded_epoch(n_batches=N_BATCHES):
    """Everything made first (not timed), then an epoch of training only."""
    data = SyntheticBatches(n_batches)
    batches = [data[i][0] for i in range(n_batches)]
    t0 = time.perf_counter()
    for x in batches:
        train_step(x.to(device, non_blocking=True))
    if HAS_CUDA:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


saved_threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    data = SyntheticBatches(8)
    load_s = min(bench(data.__getitem__, 0, min_run_time=0.05).median for _ in range(2))
    step_s = bench(train_step, data[0][0].to(device), min_run_time=0.05).median
    epoch_times, epoch_spans = {}, {}
    with Meter() as epochs_meter:  # did other programs use the cores meanwhile?
        for k in (0, 1, 2):
            first, epoch_times[k], epoch_spans[k] = run_epochs(k)
            print(f"num_workers={k}: first epoch {first:.3f} s (with worker start), "
                  f"steady epoch {epoch_times[k]:.3f} s")
        preloaded_s = min(preloaded_epoch() for _ in range(2))
finally:
    torch.set_num_threads(saved_threads)
print("while the epochs ran:", epochs_meter)
print(f"one batch: load {load_s * 1e3:.1f} ms, train {step_s * 1e3:.1f} ms "
      f"(load/train = {load_s / step_s:.1f}); everything preloaded: "
      f"{preloaded_s:.3f} s per epoch")

# %% [markdown]
# What to expect, from the two measured costs per batch (load $L$, train $T$)
# for $n$ batches:
#
# - `num_workers=0`: the main process loads, then trains: about $n(L+T)$.
# - `num_workers=1`: one worker loads while the main process trains: about
#   $n\max(L, T)$, if there is a free core for each.
# - `num_workers=2`: two workers load at once: about $n\max(L/2, T)$, but
#   never less than the total CPU work divided by the cores,
#   $n(L+T)/\text{cores}$; on a two-core machine three busy processes share
#   two cores, and that bound is the one that counts.
#
# These are estimates: $L$ and $T$ are measured alone, a moment before the
# epochs, and on a busy machine they drift, so read them as rough.
#
# Two costs are not in these estimates: a batch made in a worker must be
# handed to the main process (through shared memory), and a batch may take
# *longer* to make in a worker than in the main process when the processes
# share cores: with other programs, with each other, or with other virtual
# machines on the same host. The cell below prints the measured epoch times
# beside the estimates, the median time to make one batch in each setting
# (from the timelines), and a verdict.

# %%
n_batches, cores = N_BATCHES, usable_cores()
estimates = {0: n_batches * (load_s + step_s),
             1: n_batches * max(load_s, step_s, (load_s + step_s) / cores),
             2: n_batches * max(load_s / 2, step_s, (load_s + step_s) / cores)}
print(f"{cores} usable cores, {n_batches} batches per epoch")
for k in (0, 1, 2):
    loads = sorted(end - start for lane, start, end, _ in epoch_spans[k]
                   if lane.endswith("load"))
    print(f"num_workers={k}: measured {epoch_times[k]:.3f} s, "
          f"estimate {estimates[k]:.3f} s, speed-up over 0 workers "
          f"{epoch_times[0] / epoch_times[k]:.2f}x, median load per batch "
          f"{loads[len(loads) // 2] * 1e3:.1f} ms")
best_k = min(epoch_times, key=epoch_times.get)
print("verdict:", DISTURBED if epochs_meter.disturbed else
      f"workers helped here: {best_k} workers, "
      f"{epoch_times[0] / epoch_times[best_k]:.2f}x faster than none" if best_k
      and epoch_times[0] / epoch_times[best_k] >= 1.1 else
      "workers did not help here: loading and training share the same few busy "
      f"cores (load average {os.getloadavg()[0]:.1f}); on a GPU the step leaves the "
      "CPU free for the workers")

# %% [markdown]
# **Claim** (seed 003): loading and preprocessing in a pipeline while
# training takes "almost the same time" as loading and preprocessing
# everything first and then training.
#
# **Bound.** A pipeline can hide the loading only under the training. With
# $k$ workers that really run at once, an epoch takes at least
# $n \max(L/k, T)$ plus the first batch's $L$; an epoch on preloaded data
# takes $nT$. So the claim holds when $L/k \le T$: when loading one batch on
# the workers you have takes no longer than training on it. When loading is
# slower, the pipeline runs at the loading's pace, and only more workers (or
# cheaper loading) close the gap. Preloading has its own price, which the
# claim leaves out: all of $nL$ before the first step, and memory for every
# batch.
#
# **Measured here:**

# %%
def median(values):
    values = sorted(values)
    return values[len(values) // 2]


k_pipe = min((1, 2), key=epoch_times.get)  # the faster pipelined epoch
spans_k = epoch_spans[k_pipe]
load_k = median(b - a for lane, a, b, _ in spans_k if lane.endswith("load"))
train_k = median(b - a for lane, a, b, _ in spans_k if lane == "main: train")
ratio = epoch_times[k_pipe] / preloaded_s
print(f"preloaded epoch {preloaded_s:.3f} s; pipelined with {k_pipe} worker(s) "
      f"{epoch_times[k_pipe]:.3f} s = {ratio:.2f}x the preloaded one")
print(f"in that epoch: a batch took {load_k * 1e3:.1f} ms to make in a worker, "
      f"{train_k * 1e3:.1f} ms to train on; L/k = {load_k / k_pipe * 1e3:.1f} ms "
      f"against T = {train_k * 1e3:.1f} ms")
if epochs_meter.disturbed:
    verdict = DISTURBED
elif ratio <= 1.15:
    verdict = "as fast as preloading, within 15%: the loading hid under the training"
elif load_k / k_pipe > train_k:
    verdict = (f"{ratio:.1f}x slower than preloading: L/k > T, so the pipeline ran "
               "at the loading's pace, as the bound says it must")
else:
    verdict = (f"{ratio:.1f}x slower than preloading although L/k <= T: the "
               "workers and the training shared busy cores, or handing batches "
               "over cost more than the step")
print("verdict:", verdict)

# %% [markdown]
# The timelines show when each batch was made (worker lanes) and when it was
# trained on (main lane). With no workers, loading and training alternate in
# one process; with workers, the loading bars sit under the training bars.

# %%
fig, axes = plt.subplots(3, 1, figsize=(8, 6.2), sharex=True)
for ax, k in zip(axes, (0, 1, 2), strict=True):
    lanes = ["main: load"] if k == 0 else [f"worker {i}: load" for i in range(k)]
    plot_timeline(epoch_spans[k], ax=ax, lanes=lanes + ["main: train"],
                  title=f"DataLoader, num_workers={k}: steady epoch")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Summary
#
# - A stream is an in-order queue of GPU work; work in different streams has
#   no order, and the CPU runs ahead of both. `query()` asks whether a
#   stream or an event is done without waiting; `set_sync_debug_mode`
#   finds the hidden waits (`.item()`, `nonzero()`, printing).
# - A stream that reads what another writes must wait for it on the GPU:
#   `wait_stream` or an event (`record` + `wait_event`); a tensor used on a
#   stream other than the one it was allocated on needs `record_stream`
#   before it is freed. The documentation's `normal_` / `sum` example is the
#   bug, not the recipe. Backward ops run on their forward ops' streams.
# - Two streams speed up independent kernels only when each leaves the GPU
#   partly idle; warm up before timing, or the first call's one-time costs
#   look like a speed-up. Event spans show when a stream reached a point;
#   the profiler shows when kernels ran. The CPU analogue: two threads help
#   only when each matmul uses one core and a second core is free - busy
#   cores = CPU time / wall time says which.
# - Copies overlap compute only from pinned memory, on another stream; pin
#   once and reuse (pinning costs more than a copy); `non_blocking`
#   device-to-host copies must be waited for before the CPU reads them;
#   `synchronize()` without a device waits only for the current device.
# - A prefetcher copies the next batch on a side stream, makes the compute
#   stream wait for it on the GPU, and marks each batch with
#   `record_stream`.
# - `DataLoader(num_workers, pin_memory)` overlaps loading with training; an
#   epoch takes at least $n\max(L/k, T)$, so it matches preloaded data only
#   when the workers make batches as fast as the steps use them.
#
# ## Exercises
#
# ### Exercise 3.1: a side-stream prefetcher
#
# Write `prefetch(batches, device, cuda)`: a generator (or a class with
# `__iter__`/`__next__`) that yields each batch of `batches` (an iterable of
# pinned CPU tensors) on `device`, ready for work queued on the current
# stream, while the *next* batch is being copied on a side stream. `cuda` is
# `torch.cuda` on a GPU and the stand-in GPU here: take streams and events
# from it (`cuda.Stream()`, `cuda.current_stream()`, `cuda.stream(s)`,
# `cuda.Event()`), and copy with `batch.to(device, non_blocking=True)`.
#
# The check runs your prefetcher under a training loop on the stand-in GPU,
# with copies slower than steps and steps slower than copies: every step must
# read its own batch, the host must never wait (no `synchronize`), copies
# must overlap the steps, and at most a few batches may be on the device at
# once. With a GPU it then runs for real.

# %% tags=["exercise"] exercise="3.1"
def prefetch(batches, device, cuda):
    ### BEGIN SOLUTION
    side, main = cuda.Stream(), cuda.current_stream()

    def start_copy(batch):
        with cuda.stream(side):
            return batch.to(device, non_blocking=True)

    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    ahead = start_copy(first)
    for batch in it:
        main.wait_stream(side)       # the copy of `ahead` is done before use
        ahead.record_stream(main)    # its memory is used on `main` too
        current, ahead = ahead, start_copy(batch)
        yield current
    main.wait_stream(side)
    ahead.record_stream(main)
    yield ahead
    ### END SOLUTION


# %% tags=["check"] exercise="3.1"
check_prefetcher(prefetch)

# %% [markdown]
# ### Exercise 3.2: how much overlapped?
#
# Write `overlap_fraction(spans)`: given spans `(lane, start, end)` or
# `(lane, start, end, label)` in seconds, in any order and on any clock,
# return the fraction of the wall-clock time from the first start to the last
# end during which **at least two** spans were running (whatever their
# lanes). Two spans that only touch do not overlap; a span of zero length
# never runs; time when three run at once counts once; gaps count in the
# total. The check uses hand-made cases and seeded random ones, and then the
# matmul spans of the two threads measured in section 3.

# %% tags=["exercise"] exercise="3.2"
def overlap_fraction(spans):
    ### BEGIN SOLUTION
    edges = sorted([(s[1], 1) for s in spans if s[2] > s[1]]
                   + [(s[2], -1) for s in spans if s[2] > s[1]],
                   key=lambda e: (e[0], e[1]))  # an end before a start at a tie
    running, busy, last = 0, 0.0, None
    for t, step in edges:
        if running >= 2:
            busy += t - last
        running, last = running + step, t
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    return busy / total if total > 0 else 0.0
    ### END SOLUTION


# %% tags=["check"] exercise="3.2"
check_overlap_fraction(overlap_fraction, measured_spans=par["spans"])

# %% [markdown]
# ### Exercise 3.3: a DataLoader that keeps the training step fed
#
# Write `make_loader(dataset, batch_size, load_s, step_s, device)`: return a
# `DataLoader` over `dataset` that makes batches of `batch_size` samples,
# where making one batch takes `load_s` seconds and the training step that
# uses it takes `step_s` seconds. The training loop may wait for data at
# most 30 % of a step (the check measures this wait, in the second half of an
# epoch). Use the **fewest** worker processes that achieve it, plus one
# spare at most: each worker is a process with its own memory and a share of
# the cores. Pin the batches when `device` is a GPU, and only then.

# %% tags=["exercise"] exercise="3.3"
def make_loader(dataset, batch_size, load_s, step_s, device):
    ### BEGIN SOLUTION
    import math

    workers = 0 if load_s <= 0.3 * step_s else math.ceil(load_s / step_s)
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                      pin_memory=device.type == "cuda",
                      timeout=30 if workers else 0)
    ### END SOLUTION


# %% tags=["check"] exercise="3.3"
check_loader_config(make_loader, device)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | stream | 流 |
# | default stream | 默认流 |
# | asynchronous execution | 异步执行 |
# | synchronize | 同步 |
# | event | 事件 |
# | race condition | 竞争条件 |
# | caching allocator | 缓存分配器 |
# | pinned (page-locked) memory | 锁页内存 |
# | pageable memory | 可分页内存 |
# | overlap (of compute and copy) | (计算与传输的)重叠 |
# | prefetch | 预取 |
# | streaming multiprocessor (SM) | 流式多处理器 |
# | worker process | 工作进程 |
# | busy cores (CPU time / wall time) | 繁忙核心数(CPU 时间 / 墙钟时间) |
# | timeline | 时间线 |
