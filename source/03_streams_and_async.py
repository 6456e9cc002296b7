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
#   another one;
# - the race between two streams, and its three fixes: `wait_stream`,
#   events, and `record_stream` for memory;
# - when two streams make independent work faster and when they cannot;
# - pinned memory, `non_blocking` copies, overlapping copies with compute,
#   and the device-to-host `non_blocking` trap;
# - overlapping data loading with training (`DataLoader(num_workers,
#   pin_memory)`), and reading all of this from a timeline.
#
# **Hardware.** With a GPU, every stream experiment runs for real and draws
# its timeline from CUDA event timestamps. Without one, the CPU has no
# streams, so the chapter runs an honest CPU analogue (threads that work at
# once, measured and drawn the same way) and shows the timelines recorded on
# a real GPU beside it. The data-loading section runs the same everywhere.

# %%
import multiprocessing as mp
import textwrap
import threading
import time

import matplotlib.pyplot as plt
import torch
from torch.utils.data import DataLoader, Dataset

from course_utils import banner, bench, predict, reference, try_all_gpus, try_gpu
from course_utils.checks.ch03 import (
    check_choose_num_workers,
    check_consume_when_ready,
    check_overlap_fraction,
)
from course_utils.devices import usable_cores
from course_utils.plots import plot_timeline

banner()
device = try_gpu()
HAS_CUDA = device.type == "cuda"
_ = torch.manual_seed(0)

# %% [markdown]
# Two small helpers used all through the chapter. A **span** is one piece of
# work drawn as a bar: `(lane, start, end, label)` with times in seconds.
# `overlap_seconds` says how long two spans ran at the same time.
# `gpu_results` gathers what there is to show for a GPU experiment: this
# run's result when there is a GPU here, and the results recorded on real
# GPUs (plain JSON data: numbers, lists, and timelines as lists of spans),
# so that every plot below is drawn the same way from either.

# %%
def overlap_seconds(a, b):
    """How long spans a and b (lane, start, end, ...) ran at the same time."""
    return max(0.0, min(a[2], b[2]) - max(a[1], b[1]))


def gpu_results(name, local=None, figures=()):
    """[(label, value)]: this run's GPU result, recorded ones, then `figures`.

    `figures` are published or predicted GPU figures (`reference.Figure`), so
    that a learner without a GPU always sees at least one, labelled by kind.
    Each is also printed, with its label, by `reference.show`.
    """
    here = device if local is not None else "cpu"
    return [(f.label, f.value) for f in reference.show(
        name, local=local, unit="", local_device=here, figures=list(figures))]


def show_gpu(name, figures, print_value):
    """Print every GPU figure of `name` (recorded ones and `figures`) in detail."""
    for fig in reference.show(name, figures=list(figures)):
        print_value(fig.value)


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
    """For each result of `name`: one figure, a timeline per (key, panel title).

    `describe(value)`, if given, returns a line printed under each figure.
    """
    for source, value in gpu_results(name, local, figures):
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.9 * len(panels) + 0.6),
                                 sharex=True, squeeze=False)
        for ax, (key, panel_title) in zip(axes[:, 0], panels, strict=True):
            plot_timeline(value[key], ax=ax, title=panel_title)
        fig.suptitle(f"{title}\n{textwrap.shorten(source, 110)}", fontsize=9)
        fig.tight_layout()
        plt.show()
        if describe is not None:
            print(describe(value))

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
# point in a stream (an `Event`'s `synchronize()`).
#
# (In plain CUDA the "legacy" default stream also waits for, and holds up,
# every other ordinary stream. PyTorch creates its side streams with the
# non-blocking flag, so nothing orders them against the default stream
# unless you ask for it, which is what the next section is about.)
#
# On the CPU there is nothing to queue: an eager CPU operation returns when
# its result is ready. torch has a `torch.cpu.Stream` class so that
# device-generic code runs, but it does nothing.

# %%
if HAS_CUDA:
    side = torch.cuda.Stream()
    print("current stream:", torch.cuda.current_stream())
    print("default stream:", torch.cuda.default_stream())
    with torch.cuda.stream(side):
        print("inside the block, current stream:", torch.cuda.current_stream())
else:
    print("CPU stream object:", torch.cpu.current_stream(),
          "- a placeholder: CPU operations finish before they return")

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
# **The CPU analogue of the race.** Two Python threads play the two streams:
# a producer that is busy for a while before it fills a buffer, and a
# consumer that sums the buffer. Read without waiting, the consumer sees
# zeros; waiting on a `threading.Event` (the CPU cousin of a CUDA event) fixes
# it. This runs here, for real.

# %%
def producer(buffer, ready, busy_s=0.05):
    time.sleep(busy_s)  # stands for a long kernel queued before the fill
    buffer.fill_(1.0)
    ready.set()         # like event.record(): "everything before this is done"


def thread_race(wait):
    buffer, ready = torch.zeros(1000), threading.Event()
    worker = threading.Thread(target=producer, args=(buffer, ready))
    worker.start()
    if wait:
        ready.wait()    # like side.wait_event(ready)
    total = buffer.sum().item()
    worker.join()
    return total


print("expected 1000; without waiting:", thread_race(wait=False),
      "; waiting on the event:", thread_race(wait=True))

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
# with CUDA events. Each kernel's start and end are also recorded as events,
# so we can draw what overlapped. (Note that the side stream first waits for
# the default stream: the inputs were made there. The seed's code skips this
# and is only saved by a `synchronize()` before it.)

# %%
def timed_event():
    return torch.cuda.Event(enable_timing=True)


def two_matmuls(n, reps, two_streams):
    """Queue `reps` x (A@B on the default stream, C@D on a side stream or the same).

    Returns the total time in seconds and the spans of every matmul.
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


if HAS_CUDA:
    sizes = [256, 512, 1024, 2048, 4096, 8192]
    sweep_result = {"sizes": sizes, "one_stream_s": [], "two_streams_s": []}
    for n in sizes:
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
stream_sizes = [256, 512, 1024, 2048, 4096, 8192]
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
print("the seed's runs (published, GPU and sizes not stated): "
      + "; ".join(f"one stream {r['one_stream_s']:.2f} s, two {r['multiple_streams_s']:.2f} s"
                  for r in seed_streams.value if r["one_stream_s"]))
for source, v in gpu_results("03.two_streams", sweep_result if HAS_CUDA else None,
                             [predicted_sweep]):
    speedup = [t1 / t2 for t1, t2 in zip(v["one_stream_s"], v["two_streams_s"],
                                         strict=True)]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(v["sizes"], speedup, marker="o")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_ylim(min(0.9, min(speedup) - 0.05), max(1.2, max(speedup) + 0.05))
    ax.set_xscale("log", base=2)
    ax.set_xticks(v["sizes"], [str(n) for n in v["sizes"]])
    ax.set_xlabel("matrix size n (n x n matmuls, log scale)")
    ax.set_ylabel("one stream time / two streams time")
    ax.set_title("Speed-up of two streams for two independent matmuls\n"
                 + textwrap.shorten(source, 110), fontsize=9)
    ax.grid(True, alpha=0.3)
    plt.show()

# %% [markdown]
# Read the sweep as: the speed-up of two streams is close to 1 for the large
# sizes (one matmul fills the GPU) and can be clearly above 1 only where a
# single matmul has too few output tiles to keep every SM busy. For the
# smallest sizes both runs may be limited by how fast Python can queue
# kernels (a few microseconds each), and then streams cannot help either.
# The timelines below show the same thing kernel by kernel - with a caveat
# about what a span is. Each bar runs from an event recorded just before a
# matmul to one recorded just after it: the times at which *that stream
# reached* those two points. A stream reaches the first event when the work
# queued before it is done, so a bar can start before its kernel gets any
# SM and end after it finished; overlapping bars in two rows mean the two
# streams were *inside* their matmuls at once, which is close to, but not
# proof of, kernels running at once. `torch.profiler` records when each
# kernel really ran on the GPU (and exports a trace to open in a browser):
# use it to settle a doubt. Without a GPU the timelines are the model's.

# %%
def both_streams_busy(timelines):
    """The share of the run during which a matmul ran on each stream at once."""
    parts = []
    for key, spans in timelines.items():
        main_ = [sp for sp in spans if sp[0] == "default stream"]
        side_ = [sp for sp in spans if sp[0] == "side stream"]
        both = sum(overlap_seconds(m, o) for m in main_ for o in side_)
        total = max(sp[2] for sp in spans) - min(sp[1] for sp in spans)
        parts.append(f"{key}: {both / total:.0%}")
    return "time with both streams running a matmul - " + "; ".join(parts)


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
               "4 x (A@B, C@D), 1024x1024 matmuls",
               describe=both_streams_busy, figures=[predicted_timelines])

# %% [markdown]
# ### The CPU analogue: two matmuls in two threads
#
# Without a GPU we can still watch independent work overlap. Two Python
# threads each run a loop of matmuls. Threads share one interpreter, but
# torch releases Python's global interpreter lock (GIL) inside its
# operators, so two matmuls really do run on two cores at once.
#
# One detail decides the result. By default a single torch matmul already
# uses **all** cores (torch's intra-op threads): that is the "one kernel fills
# the GPU" case, and a second thread only competes for the same cores. With
# `torch.set_num_threads(1)` each matmul uses one core, like a kernel that
# leaves SMs idle, and the second thread can use the idle core. We measure
# both and draw each thread's start and end.

# %%
def matmul_loop(x, reps, lane, spans):
    start = time.perf_counter()
    for _ in range(reps):
        x @ x
    spans.append((lane, start, time.perf_counter(), f"{reps} matmuls"))


def run_cpu_streams(n, reps, threads):
    """Two loops of matmuls, one after the other or in two threads: (seconds, spans)."""
    x1, x2 = torch.randn(n, n), torch.randn(n, n)
    spans = []
    begin = time.perf_counter()
    if threads:
        workers = [threading.Thread(target=matmul_loop, args=(x, reps, lane, spans))
                   for x, lane in ((x1, "thread 1"), (x2, "thread 2"))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        matmul_loop(x1, reps, "thread 1", spans)
        matmul_loop(x2, reps, "thread 1", spans)
    return time.perf_counter() - begin, spans


default_threads = torch.get_num_threads()
n_cpu, reps_cpu = 384, 15
cpu_results = {}
try:
    for intra in sorted({1, default_threads}):
        torch.set_num_threads(intra)
        run_cpu_streams(n_cpu, 2, threads=False)  # warm-up
        # alternate the two, so that a burst of other work on the machine hits both
        runs = [run_cpu_streams(n_cpu, reps_cpu, threads)
                for _ in range(4) for threads in (False, True)]
        seq, par = min(runs[0::2]), min(runs[1::2])
        cpu_results[intra] = (seq, par)
        print(f"{intra} intra-op thread(s) per matmul: one after the other "
              f"{seq[0] * 1e3:.1f} ms, two threads {par[0] * 1e3:.1f} ms, "
              f"speed-up {seq[0] / par[0]:.2f}x")
finally:
    torch.set_num_threads(default_threads)  # restore for the rest of the notebook
if default_threads > 1:
    fill = cpu_results[1][0][0] / cpu_results[default_threads][0][0]
    print(f"one matmul loop ran at {fill:.2f}x its one-thread speed with "
          f"{default_threads} intra-op threads ({default_threads}x would mean one "
          "matmul keeps every core busy; below 1x, something else holds a core)")

# %% [markdown]
# How to read these lines. With one intra-op thread per matmul, two threads
# can be up to 2x faster than one after the other, if two cores are free.
# With torch's default thread count, the last line says how much of the
# machine one matmul already fills: if it ran close to "thread count" times
# faster than with one thread, there is no idle core left and two Python
# threads only take turns (speed-up near 1); if it gained much less (small
# matrices, a core busy with other work), the second thread can use what
# one matmul leaves idle, just as a second stream can on a GPU. Each figure
# is the best of four runs, taken alternately; on a machine shared with
# other work (a CI runner, a virtual machine whose cores are shared with
# other guests) the numbers still jump from run to run, and torch's
# intra-op threads suffer most: they assume they own the cores, so when
# something else holds one, every multi-threaded matmul waits for its
# slowest thread. The timelines of the one-thread case show the overlap:

# %%
seq, par = cpu_results[1]
fig, axes = plt.subplots(2, 1, figsize=(7.5, 3.6), sharex=True)
plot_timeline(seq[1], ax=axes[0],
              title="CPU analogue of streams: one thread, then the other (1 core each)")
plot_timeline(par[1], ax=axes[1], title="CPU analogue of streams: two threads at once")
fig.tight_layout()
plt.show()
ov = overlap_seconds(*par[1])
print(f"the two threads overlapped for {ov * 1e3:.1f} ms of {par[0] * 1e3:.1f} ms")

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
# Pinned memory is a limited resource (it cannot be swapped), so pin the
# buffers you copy often (batches), not everything. The sweep below measures
# host-to-device bandwidth for both kinds over sizes.

# %%
def h2d_gbps(nbytes, pinned):
    src = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pinned)
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    t = bench(dst.copy_, src, min_run_time=0.1)  # bench waits for the GPU
    return nbytes / t.median / 1e9


if HAS_CUDA:
    nbytes = [2**k for k in range(16, 29, 2)]  # 64 KiB .. 256 MiB
    bw = {"bytes": nbytes,
          "pageable_GBps": [h2d_gbps(b, False) for b in nbytes],
          "pinned_GBps": [h2d_gbps(b, True) for b in nbytes]}
    reference.record("03.h2d_bandwidth", bw, "GB/s", device)
h2d_sizes = [2**k for k in range(16, 29, 2)]
pcie = predict.link_bandwidth("pcie4_x16") / 1e9
predicted_h2d = reference.predicted(
    {"bytes": h2d_sizes, "pinned_GBps": [pcie] * len(h2d_sizes),
     "pageable_GBps": [pcie / 2] * len(h2d_sizes)},
    "GB/s", "a GPU on PCIe 4.0 x16",
    "pinned copies at the link's bandwidth; pageable ones go through a pinned "
    "staging buffer, a second copy, so at most about half (no latency: small "
    "copies are slower)", ["pcie4_x16.bandwidth_per_direction_gbps"])
for source, v in gpu_results("03.h2d_bandwidth", bw if HAS_CUDA else None,
                             [predicted_h2d]):
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(v["bytes"], v["pageable_GBps"], marker="o", label="pageable")
    ax.plot(v["bytes"], v["pinned_GBps"], marker="o", label="pinned")
    ax.set_xscale("log", base=2)
    ax.set_xticks(v["bytes"], [f"{b // 1024} KiB" if b < 2**20 else f"{b // 2**20} MiB"
                               for b in v["bytes"]])
    ax.set_xlabel("size of the copy (log scale)")
    ax.set_ylabel("host-to-device bandwidth (GB/s)")
    ax.set_title("Pinned vs pageable host-to-device copies\n"
                 + textwrap.shorten(source, 110), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    plt.show()
    ratios = [p / q for p, q in zip(v["pinned_GBps"], v["pageable_GBps"], strict=True)]
    print(f"pinned / pageable: {ratios[0]:.2f}x at {v['bytes'][0] // 1024} KiB, "
          f"{ratios[-1]:.2f}x at {v['bytes'][-1] // 2**20} MiB")

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
    """k matmuls, each result copied to the CPU. Returns (seconds, spans, host results)."""
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
mm = matmul_seconds(4096)
cp = predict.copy_seconds(4 * 4096 * 4096, "pcie4_x16").value
copy_rule = reference.predicted(
    {"pageable, one stream": 8 * mm + 8 * 2 * cp,
     "pinned non_blocking, one stream": 8 * mm + 8 * cp,
     "copy stream": 8 * max(mm, cp) + min(mm, cp)},
    "s", "an H100 on PCIe 4.0 x16",
    "8 matmuls at the roofline's pace, 8 copies of 64 MiB at PCIe's pace (pageable "
    "at half); one stream adds them up, a copy stream overlaps each copy with the "
    "next matmul", ["h100_sxm.fp32_tflops", "pcie4_x16.bandwidth_per_direction_gbps"])
show_gpu("03.copy_compute", [copy_rule], lambda v: [
    print(f"  {mode:>32}: {sec * 1e3:7.1f} ms") for mode, sec in v.items()])
def hidden_copy_time(timelines):
    """For each mode: the share of the copy time that ran under a matmul."""
    parts = []
    for mode, spans in timelines.items():
        compute = [sp for sp in spans if sp[0] == "compute"]
        copies = [sp for sp in spans if sp[0] == "copy"]
        hidden = sum(overlap_seconds(c, m) for c in copies for m in compute)
        parts.append(f"{mode}: {hidden / sum(c[2] - c[1] for c in copies):.0%}")
    return "copy time hidden under compute - " + "; ".join(parts)


def predicted_copy_spans(mode):
    spans, t = [], 0.0
    cp_mode = 2 * cp if mode.startswith("pageable") else cp
    for i in range(8):
        spans.append(("compute", i * mm, (i + 1) * mm, f"y{i}"))
    if mode == "copy stream":  # each copy as soon as its matmul is done
        t = 0.0
        for i in range(8):
            t = max(t, (i + 1) * mm)
            spans.append(("copy", t, t + cp_mode, f"y{i}"))
            t += cp_mode
    else:  # the seed's order: every copy after every matmul
        t = 8 * mm
        for i in range(8):
            spans.append(("copy", t, t + cp_mode, f"y{i}"))
            t += cp_mode
    return spans


copy_timeline_rule = reference.predicted(
    {mode: predicted_copy_spans(mode) for mode in MODES}, "s",
    "an H100 on PCIe 4.0 x16", "the copy model above, span by span",
    ["h100_sxm.fp32_tflops", "pcie4_x16.bandwidth_per_direction_gbps"])
show_timelines("03.copy_compute_timeline", copy_timelines if HAS_CUDA else None,
               [(mode, mode) for mode in MODES],
               "8 matmuls (4096x4096) and their copies to the CPU",
               describe=hidden_copy_time, figures=[copy_timeline_rule])

# %% [markdown]
# Look for: in the two one-stream timelines the copy lane starts only when the
# compute lane has finished; with a copy stream each copy runs under the next
# matmul, and the total is close to the compute time plus one copy.
#
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
# not overwrite the pinned source on the CPU before the copy has run.

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

# %% [markdown]
# ## 7. Two devices at once
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
# the cell also runs the seed's two-GPU version, correctly timed.

# %%
def gpu_work(x, reps):
    for _ in range(reps):
        x @ x


def concurrency_summary(t):
    """Compare 'both' with the larger of the two alone and with their sum."""
    pairs = (("GPU alone", "CPU alone", "GPU then CPU, no sync between"),
             ("GPU 0 alone", "GPU 1 alone", "GPU 0 and GPU 1"))
    for a, b, both in pairs:
        if both in t:
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


def print_devices(value):
    for k, v in value.items():
        print(f"  {k:>30}: {v * 1e3:7.1f} ms")
    concurrency_summary(value)


show_gpu("03.two_devices", [devices_rule], print_devices)

# %% [markdown]
# Look for: the time for both is close to the larger of the two alone, not
# their sum. Any `synchronize()`, `.item()` or `print(tensor)` between the GPU
# work and the CPU work would make the CPU wait and turn that into the sum.
#
# ## 8. Overlapping data loading with training
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
# the same wherever it is made.

# %%
class SyntheticBatches(Dataset):
    """Batch i: random images, FFT-filtered (real CPU work), with its timestamps."""

    def __init__(self, n_batches, batch_size=32, side=64, passes=16):
        self.n_batches, self.batch_size, self.side = n_batches, batch_size, side
        self.passes = passes
        self.mask = torch.rand(side, side // 2 + 1, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n_batches

    def __getitem__(self, i):
        start = time.perf_counter()
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.batch_size, self.side, self.side, generator=g)
        for _ in range(self.passes):
            x = torch.fft.irfft2(torch.fft.rfft2(x) * self.mask, s=(self.side, self.side))
        y = (x.mean(dim=(1, 2)) > 0).long()
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else -1
        return x, y, torch.tensor([start, time.perf_counter(), worker], dtype=torch.float64)


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
N_BATCHES = 24


def run_epochs(num_workers, n_batches=N_BATCHES, epochs=3):
    """Time `epochs` epochs: (first time, best later time, spans of that epoch)."""
    loader = DataLoader(SyntheticBatches(n_batches), batch_size=None, shuffle=False,
                        num_workers=num_workers, pin_memory=HAS_CUDA,
                        persistent_workers=num_workers > 0, prefetch_factor=(
                            2 if num_workers > 0 else None),
                        multiprocessing_context=FORK if num_workers > 0 else None)
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


saved_threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    data = SyntheticBatches(8)
    load_s = min(bench(data.__getitem__, 0, min_run_time=0.05).median for _ in range(2))
    step_s = bench(train_step, data[0][0].to(device), min_run_time=0.05).median
    epoch_times, epoch_spans = {}, {}
    for k in (0, 1, 2):
        first, epoch_times[k], epoch_spans[k] = run_epochs(k)
        print(f"num_workers={k}: first epoch {first:.3f} s (with worker start), "
              f"steady epoch {epoch_times[k]:.3f} s")
finally:
    torch.set_num_threads(saved_threads)
print(f"one batch: load {load_s * 1e3:.1f} ms, train {step_s * 1e3:.1f} ms "
      f"(load/train = {load_s / step_s:.1f})")

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
# beside the estimates, and the median time to make one batch in each
# setting (from the timelines), so you can see which of these limits this
# machine.

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
#   no order, and the CPU runs ahead of both.
# - A stream that reads what another writes must wait for it on the GPU:
#   `wait_stream` or an event (`record` + `wait_event`); a tensor used on a
#   stream other than the one it was allocated on needs `record_stream`
#   before it is freed. The documentation's `normal_` / `sum` example is the
#   bug, not the recipe.
# - Two streams speed up independent kernels only when each leaves the GPU
#   partly idle; warm up before timing, or the first call's one-time costs
#   look like a speed-up. The CPU analogue: two threads help only when each
#   matmul uses one core.
# - Copies overlap compute only from pinned memory, on another stream;
#   `non_blocking` device-to-host copies must be waited for before the CPU
#   reads them; `synchronize()` without a device waits only for the current
#   device.
# - `DataLoader(num_workers, pin_memory)` overlaps loading with training; the
#   gain is bounded by the larger of load and train time and by the cores
#   the workers and the main process share. Count the workers' start-up, or
#   keep them with `persistent_workers=True`.
#
# ## Exercises
#
# ### Exercise 3.1: fix the race
#
# `consume_when_ready(buffer, ready)` is called while a producer thread is
# still busy; the producer fills `buffer` and then calls `ready.set()`.
# Return the sum of `buffer` as a number, read only once it is complete.
# The check runs producers that take different times, so waiting for a fixed
# time does not pass; neither does returning long after the buffer is ready.

# %% tags=["exercise"] exercise="3.1"
def consume_when_ready(buffer, ready):
    ### BEGIN SOLUTION
    ready.wait()
    return buffer.sum().item()
    ### END SOLUTION


# %% tags=["check"] exercise="3.1"
check_consume_when_ready(consume_when_ready)

# %% [markdown]
# ### Exercise 3.2: how much overlapped?
#
# Write `overlap_fraction(spans)`: given spans `(lane, start, end)` or
# `(lane, start, end, label)` in seconds, in any order and on any clock,
# return the fraction of the wall-clock time from the first start to the last
# end during which **at least two** spans were running. Two spans that only
# touch do not overlap; time when three run at once counts once; gaps count
# in the total.

# %% tags=["exercise"] exercise="3.2"
def overlap_fraction(spans):
    ### BEGIN SOLUTION
    edges = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans],
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
check_overlap_fraction(overlap_fraction, measured_spans=par[1])

# %% [markdown]
# ### Exercise 3.3: choose `num_workers`
#
# Every worker costs a process, its memory and a share of the cores. Write
# `choose_num_workers(epoch_times, tolerance=0.05)`: given a dict
# `{num_workers: epoch seconds}`, return the **smallest** number of workers
# whose epoch time is within `tolerance` (relative, 0.05 = 5 %) of the
# fastest one. The check also applies it to the epoch times measured above.

# %% tags=["exercise"] exercise="3.3"
def choose_num_workers(epoch_times, tolerance=0.05):
    ### BEGIN SOLUTION
    best = min(epoch_times.values())
    return min(k for k, t in epoch_times.items() if t <= best * (1 + tolerance))
    ### END SOLUTION


# %% tags=["check"] exercise="3.3"
check_choose_num_workers(choose_num_workers, measured=epoch_times)

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
# | streaming multiprocessor (SM) | 流式多处理器 |
# | worker process | 工作进程 |
# | timeline | 时间线 |
