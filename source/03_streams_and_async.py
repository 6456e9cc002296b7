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
# queues when it can. This makes overlap possible (computing while copying,
# two devices at once, loading the next batch while the model trains on this
# one), and it makes wrong results possible, when one queue reads what
# another has not finished writing.
#
# **What you will learn**
#
# - what a stream is, the default stream, putting work on another one, and
#   asking a stream or an event whether it is done;
# - the race between two streams and its fixes (`wait_stream`, events,
#   `record_stream`), and finding hidden synchronisations;
# - when two streams make independent work faster, and what a timeline built
#   from events shows;
# - pinned memory and what pinning costs, `non_blocking` copies, overlapping
#   copies with compute, and a side-stream prefetcher;
# - overlapping data loading with training (`DataLoader(num_workers,
#   pin_memory)`).
#
# **Hardware.** With a GPU, every stream experiment runs for real. Without
# one, the chapter runs honest CPU analogues (threads, measured and drawn the
# same way, and a *stand-in GPU* whose streams run in simulated time) and
# shows each GPU experiment's figures labelled by kind: recorded on a real
# GPU, published, or predicted by a small model. The data-loading section
# runs the same everywhere. Plots, GPU figures and the longer GPU-only
# measurements live in `course_utils.transfers`.

# %%
import multiprocessing as mp
import queue
import threading
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

from course_utils import banner, bench, reference, transfers, try_all_gpus, try_gpu
from course_utils.checks.ch03 import (
    StandInCuda,
    check_load_ahead,
    check_overlap_fraction,
    check_prefetcher,
    host_batches,
)
from course_utils.compare import compare
from course_utils.devices import usable_cores

banner()
device = try_gpu()
HAS_CUDA = device.type == "cuda"
_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. Streams: the queues between the CPU and the GPU
#
# Chapter 2 showed that a CUDA operation returns as soon as it is *queued*.
# The queue is a **stream**: work in one stream runs in order; work in
# *different* streams has no order at all, and may run at once.
#
# Every operation goes to the **current stream**, by default the device's
# **default stream**. `torch.cuda.Stream()` makes a new one; inside
# `with torch.cuda.stream(s):` it is current. The CPU can wait for a whole
# device (`torch.cuda.synchronize(device)`; with no argument, only the
# *current* device), for a stream (`s.synchronize()`), or for a point in a
# stream (an `Event`'s `synchronize()`); `s.query()` and `event.query()`
# ask without waiting. (PyTorch makes side streams with CUDA's non-blocking
# flag: nothing orders them against the default stream unless you ask.)
#
# The CPU has nothing to queue: an eager CPU operation returns when its
# result is ready, and `torch.cpu.Stream` is a placeholder. To *see* queues
# at work anyway, the chapter uses a **stand-in GPU** (`StandInCuda`): an
# object with `torch.cuda`'s stream API whose copies and kernels run in
# *simulated* time. Below, a copy of 2 time units is queued on a side stream:
# the host gets control back at once, `query()` says "not yet", and only
# `synchronize()` makes the host wait.

# %%
if HAS_CUDA:
    side = torch.cuda.Stream()
    print("current stream:", torch.cuda.current_stream())
    with torch.cuda.stream(side):
        print("inside the block, current stream:", torch.cuda.current_stream())
        busy = torch.cuda.Event()
        torch.cuda._sleep(10_000_000)  # a long kernel (a private testing helper)
        busy.record()
    print("just queued - stream done?", side.query(), "event done?", busy.query())
    busy.synchronize()
    print("after event.synchronize() - stream done?", side.query())

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
# One of the seeds quotes this example from the PyTorch documentation as if
# it were a recipe for multi-GPU work:
#
# ```python
# A = torch.empty((100, 100), device="cuda").normal_(0.0, 1.0)
# with torch.cuda.stream(s):
#     B = torch.sum(A)   # may start before normal_() finishes!
# ```
#
# It is the documentation's example of a **bug**, on *one* GPU: `normal_`
# is queued on the default stream, `sum` on `s`, nothing orders them, and
# `sum` may read `A` half-written. With 100 x 100 elements the race is rarely
# *seen*, which is why such bugs survive. Below we make it visible: a long
# kernel (`torch.cuda._sleep`) holds the default stream, the fill waits
# behind it, and the side stream sums the tensor. The cell warms up first
# (a kernel's first launch may load its code and make the whole GPU wait)
# and uses one side stream for the chapter (freed memory is cached per
# stream, so a new `cudaMalloc`, which also waits, is avoided).
#
# The fixes: `side.wait_stream(main)` (later work on `side` waits for
# everything queued on `main` so far); an **event**, `ready.record(main)`
# then `side.wait_event(ready)` (waits for that point only); or
# `torch.cuda.synchronize()`, which is right too but stops the CPU until the
# GPU is idle, throwing away all overlap.

# %%
SLEEP_CYCLES = 50_000_000  # tens of milliseconds on any recent GPU
SIDE = torch.cuda.Stream() if HAS_CUDA else None  # the chapter's side stream


def stream_race(fix, n=2048):
    """Fill `a` on the default stream behind a long kernel; sum it on a side stream."""
    main = torch.cuda.current_stream()
    a = torch.zeros(n, n, device=device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(SLEEP_CYCLES)  # the default stream is busy...
    a.fill_(1.0)                     # ...so this fill waits in its queue
    if fix == "wait_stream":
        SIDE.wait_stream(main)
    elif fix == "event":
        ready = torch.cuda.Event()
        ready.record(main)
        SIDE.wait_event(ready)
    elif fix == "synchronize":
        torch.cuda.synchronize(device)
    with torch.cuda.stream(SIDE):
        total = a.sum()
    a.record_stream(SIDE)  # `a` is freed on return; see record_stream below
    torch.cuda.synchronize(device)
    return total.item()


race = None
if HAS_CUDA:
    stream_race("synchronize")  # warm-up: load every kernel first
    race = {"expected": 2048 * 2048}
    race.update({fix: stream_race(fix)
                 for fix in ("none", "wait_stream", "event", "synchronize")})
transfers.show_race(race, device)

# %% [markdown]
# **The CPU analogue, measured here.** Two threads play the two streams: a
# producer fills a buffer and sets a `threading.Event` (the CPU cousin of
# recording a CUDA event); a consumer sums it. The long kernel is a **gate**
# the producer waits on before it fills, opened only *after* the unordered
# read: that read always comes too early, however busy the machine is.

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
    total = buffer.sum().item()  # without waiting: the "kernel" is still running
    gate.set()
    worker.join(timeout=10)
    return total, values.sum().item()


(unordered, expected_sum), (ordered, _) = thread_race(False), thread_race(True)
print(f"expected {expected_sum:.4f}; read without waiting: {unordered:.4f}; "
      f"read after waiting on the event: {ordered:.4f}")

# %% [markdown]
# ### `record_stream`: the same race, through the memory allocator
#
# PyTorch's caching allocator remembers the stream each block was allocated
# on. When the tensor dies, its block goes back to the pool **for that
# stream** and can be handed out again at once. If *another* stream still
# has queued work reading it, the block can be overwritten under it.
# `x.record_stream(side)` tells the allocator that `side` uses `x`, so the
# block waits until `side`'s queued work is done. Whether the wrong sum
# *shows* depends on the allocator handing `x`'s block to the next tensor,
# an implementation detail (settings like
# `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` change it): read a right
# answer without `record_stream` as luck.

# %%
def allocator_race(use_record_stream, n=2048):
    x = torch.ones(n, n, device=device)
    SIDE.wait_stream(torch.cuda.current_stream())  # the first race is fixed
    with torch.cuda.stream(SIDE):
        torch.cuda._sleep(SLEEP_CYCLES)
        total = x.sum()
    if use_record_stream:
        x.record_stream(SIDE)
    del x                                        # back to the default stream's pool
    y = torch.full((n, n), 7.0, device=device)   # may get x's memory at once
    torch.cuda.synchronize(device)
    del y
    return total.item()


transfers.show_allocator_race(
    {"expected": 2048 * 2048, "without record_stream": allocator_race(False),
     "with record_stream": allocator_race(True)} if HAS_CUDA else None, device)

# %% [markdown]
# **On the stand-in GPU, run here.** Its allocator behaves like PyTorch's: `x`
# is copied in on the default stream, a long kernel on the side stream reads
# it, we drop `x` and copy another batch in.

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
    return gpu.read(read), y


for use in (False, True):
    (status, seen), _y = standin_allocator_race(use)
    what = (f"read x's values (sum {seen:.2f})" if status == "ok" else
            f"read batch {seen}'s values: x's block was refilled under it")
    print(f"{'with' if use else 'without':>7} record_stream: the side stream {what}")

# %% [markdown]
# ### Finding hidden synchronisations
#
# The opposite mistake is waiting where you did not mean to. Every read of a
# GPU value by the CPU waits for the GPU: `.item()`, `float(t)`, `print(t)`,
# `t.cpu()`, `if t > 0:`, and ops whose output size depends on the data
# (`nonzero()`, `t[t > 0]`, `torch.unique`). `torch.cuda.set_sync_debug_mode
# ("warn")` warns at each such wait (`"error"` raises), the quickest way to
# find the one that keeps a training loop from running ahead of the GPU.

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
    print("set_sync_debug_mode needs a CUDA build; on a GPU this cell reports the "
          "two waits in int((y > 0).sum()) and y[y > 0]")

# %% [markdown]
# ## 3. Two independent matmuls on two streams
#
# One seed times `E = A @ B; F = C @ D` on one stream against the same with
# `F` on a second stream, and reports 0.59 s against 0.30 s: twice as fast.
# Two things are wrong with that conclusion:
#
# - the timing has **no warm-up**: the first matmul of a process pays for
#   loading cuBLAS and creating its workspace, inside the one-stream time;
# - a large matmul already occupies every streaming multiprocessor (SM). A
#   second stream can only use SMs the first kernel leaves idle, so two
#   *large* matmuls cannot finish in half the time.
#
# Two streams help when each kernel leaves much of the GPU idle: small
# kernels, or kernels waiting on memory or a copy. The same seed suggests
# running a model's two independent branches (CLIP's text and image
# encoders) on two streams; that gains only what one branch leaves idle:
# something with small batches, little with large ones. On a GPU the cell
# sweeps the size, warmed up, timed with CUDA events (the side stream first
# waits for the default stream, where the inputs were made; the seed's code
# skips this and is saved only by an earlier `synchronize()`).

# %%
sweep = transfers.two_stream_sweep(SIDE, device) if HAS_CUDA else None

# %% [markdown]
# ### The CPU analogue: two matmuls in two threads
#
# Two Python threads each run a loop of matmuls. torch releases the GIL
# inside its operators, so two matmuls *can* run on two cores at once, if
# two cores are free. By default one matmul already uses every core (torch's
# intra-op threads): the "one kernel fills the GPU" case. With
# `torch.set_num_threads(1)` each matmul uses one core, like a kernel that
# leaves SMs idle. The comparison protocol measures wall time, CPU time and
# **busy cores = CPU time / wall time** (2.0: both cores worked all along),
# and prints the verdict.

# %%
def matmul_loop(x, reps, lane, label, spans):
    for _ in range(reps):
        t0 = time.perf_counter()
        x @ x
        spans.append((lane, t0, time.perf_counter(), label))


def run_two_loops(n, reps, threads):
    """Loops A and B of matmuls, one after the other or in two threads."""
    x1, x2 = torch.randn(n, n), torch.randn(n, n)
    spans, wall0 = [], time.perf_counter()
    loops = ((x1, "thread 1", "A"), (x2, "thread 2" if threads else "thread 1", "B"))
    if threads:
        workers = [threading.Thread(target=matmul_loop, args=(x, reps, lane, lab, spans))
                   for x, lane, lab in loops]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        for x, lane, lab in loops:
            matmul_loop(x, reps, lane, lab, spans)
    return {"wall": time.perf_counter() - wall0, "spans": spans}


n_cpu, reps_cpu = 320, 10
default_threads = torch.get_num_threads()
seq_runs, par_runs = [], []
try:
    torch.set_num_threads(1)
    two_loops = compare({
        "one after the other": lambda: seq_runs.append(
            run_two_loops(n_cpu, reps_cpu, threads=False)),
        "two threads at once": lambda: par_runs.append(
            run_two_loops(n_cpu, reps_cpu, threads=True))}, repeats=3)
finally:
    torch.set_num_threads(default_threads)  # restore for the rest of the notebook
print(two_loops)
seq, par = transfers.median_run(seq_runs), transfers.median_run(par_runs)
transfers.plot_runs(
    [(seq["spans"], "one thread: loop A, then loop B (one core per matmul)"),
     (par["spans"], "two threads: loops A and B at once")],
    kind_of=reference.measured(par["wall"], "s", "cpu"))

# %% [markdown]
# The bars are single matmuls, from a run of median length of each kind.
# Bars side by side show that both threads were *inside* a matmul at once
# (concurrency); whether both computed at once (parallelism) is what the
# busy-cores column says. Below, the GPU figures beside this point: the
# model's prediction for an H100 (dashed), the seed's published ratio
# (dotted, its size not stated), recorded GPU curves (squares) if any.

# %%
transfers.plot_two_streams(sweep, two_loops.ratio, n_cpu, device)

# %% [markdown]
# Read the sweep as: the speed-up of two streams is close to 1 for large
# sizes and clearly above 1 only where one matmul has too few output tiles to
# keep every SM busy; the smallest sizes may be limited by how fast Python
# queues kernels. The seed's 2x, with no warm-up and no stated size, is what
# the model says a *large* matmul cannot give.
#
# **What a timeline from events shows.** An event marks when its *stream
# reached* that point, not when a kernel ran: a bar can start before its
# kernel gets any SM. Bars overlapping in two rows mean both streams were
# *inside* their matmuls at once, close to, but not proof of, kernels
# running at once. `torch.profiler` records when each kernel really ran; on
# a GPU the cell draws those too. Without a GPU the timelines are the model's.

# %%
transfers.show_two_stream_timelines(SIDE, device)

# %% [markdown]
# ## 4. Pinned memory
#
# A host-to-device copy is done by the GPU's copy engine with DMA, which can
# only read host memory the operating system promises not to move or swap:
# **pinned** (page-locked) memory. From ordinary, **pageable** memory the
# driver first copies, chunk by chunk, into a pinned staging buffer of its
# own, with a CPU thread. So copies from pinned memory are faster, and only
# they can be truly asynchronous (`non_blocking=True` returns at once).
#
# Without a GPU there is no PCIe link to measure. The CPU can measure the
# extra step a pageable copy adds: a RAM-to-RAM copy, on **one** thread as the
# driver's staging copy is. (Measured with torch's default intra-op threads,
# a copy of a few hundred KiB is split across the cores, and on a machine
# where another program holds a core the split waits for a time slice:
# milliseconds for a copy of microseconds, a bandwidth below any memory's.)
# The plot shows it beside the link's published bandwidth and the predicted
# pinned and pageable curves.

# %%
def ram_copy_gbps(nbytes):
    """RAM-to-RAM copy bandwidth on one thread: the fastest of three medians."""
    src, dst = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)  # both touched
    return nbytes / min(bench(dst.copy_, src, min_run_time=0.01, num_threads=1).median
                        for _ in range(3)) / 1e9


ram_sizes = [2**k for k in range(16, 27, 2)]  # 64 KiB .. 64 MiB
ram_gbps = [ram_copy_gbps(b) for b in ram_sizes]
transfers.plot_h2d(device, ram_sizes, ram_gbps)
print(f"RAM to RAM here: {ram_gbps[-1]:.1f} GB/s at 64 MiB (smaller copies stay in "
      "the CPU's caches); a pageable copy adds a copy like this one to the link's")

# %% [markdown]
# ### What pinning costs: pin once, reuse
#
# To pin a buffer, the operating system must find physical pages, fill them
# in and lock them, and the CUDA driver maps them for the GPU. Pinned memory
# cannot be swapped, so it is scarce too. The rule: allocate pinned buffers
# once and copy into them, or let the `DataLoader` pin in its background
# thread (`pin_memory=True`), off the training loop's path. PyTorch's
# tutorial says `t.pin_memory().to(device, non_blocking=True)` on each batch
# can take up to twice as long as a plain `.to(device)`.
#
# Timing `pin_memory()` is a trap of its own: PyTorch keeps freed pinned
# blocks in a cache (its `CachingHostAllocator`), and a `pin_memory()` right
# after the last pinned tensor of that size died reuses its block. Timed in
# a loop, it is a plain copy. On a GPU the cell below times both: pinning
# while every earlier pinned copy is kept alive (each needs a **new** block
# from the driver) and pinning after it died (the cached block again),
# beside a copy into a buffer pinned once; `torch.cuda.host_memory_stats()`
# counts the new blocks. Look for: fresh pinning clearly slower than the
# copy, with one new block per call; cached pinning close to the copy, with
# one new block at most (the first). Without a GPU, `pin_memory()` raises;
# the cell measures the operating system's part, locking fresh pages
# (`mlock`; 4 MiB, which an unprivileged process may lock), against a copy
# into a buffer allocated once.

# %%
PIN_BYTES = 4 * 2**20
src = torch.ones(PIN_BYTES // 4)
reuse = torch.empty(PIN_BYTES // 4, pin_memory=HAS_CUDA)  # allocated (pinned) once
kept = []  # pinned copies kept alive: no block is freed, each pin needs a new one
copy_once = {"copy into a buffer allocated once": lambda: reuse.copy_(src)}
if HAS_CUDA:
    pins = {"pin_memory(), a new block each time": lambda: kept.append(src.pin_memory()),
            "pin_memory(), the cached block": lambda: src.pin_memory()}  # freed at once
elif transfers.lock_fresh_pages_seconds(PIN_BYTES) is not None:
    pins = {"lock fresh pages, then copy": lambda: (
        transfers.lock_fresh_pages_seconds(PIN_BYTES), reuse.copy_(src))}
else:
    pins = {}
    print("this system refused to lock even 4 MiB (or has no mlock): nothing to time")
for label, pin in pins.items():
    blocks0 = torch.cuda.host_memory_stats().get("num_host_alloc", 0) if HAS_CUDA else 0
    pin_cost = compare({**copy_once, label: pin}, repeats=7, number=1)
    print(pin_cost)
    if HAS_CUDA:
        blocks = torch.cuda.host_memory_stats().get("num_host_alloc", 0) - blocks0
        print(f"new pinned blocks from the driver during these runs: {blocks}\n")
        if "new block" in label and not pin_cost.disturbed:
            reference.record("03.pin_cost", 1 / pin_cost.ratio, "x", device)
kept.clear()
transfers.show_gpu("03.pin_cost", [
    reference.published("pt_pinmem_tutorial.pin_then_copy_slowdown_max")], unit="x");

# %% [markdown]
# ## 5. Overlapping compute with copies back to the CPU
#
# The d2l seed computes 50 matmuls on a GPU, copies the results to the CPU,
# then does the same with `non_blocking=True`, which came out faster. Two
# corrections:
#
# - it timed with `torch.cuda.synchronize()` **without a device** while the
#   work ran on `cuda:6`; that waits only for the *current* device
#   (`cuda:0`), so "run on GPU1" (under a millisecond) timed only the
#   launches, and the copy's 1.44 s paid for the rest: the first copy waited
#   for all 50 matmuls (the seed's correctly timed run takes 0.28 s), then
#   3.2 GB went into pageable memory. Pass the device, or use events.
# - on the **same** stream a copy cannot start before the matmuls queued
#   ahead of it have finished, so the `non_blocking` version overlaps
#   nothing. It is faster because `.to("cpu", non_blocking=True)` copies
#   into freshly *pinned* memory, and the CPU no longer waits after each copy.
#
# Real overlap needs a **second stream** for the copies, each waiting (with
# an event) only for the result it copies, into pinned buffers, with
# `record_stream` so each result lives until its copy is done
# (`transfers.compute_and_copy`). On a GPU the cell runs the three versions
# and checks every copy; everywhere it shows the model's times and
# timelines, and the model fed with the seed's workload beside the seed's
# figures (its "run" figure is the time to *queue* the work).

# %%
transfers.show_copy_compute(SIDE, device)
transfers.plot_seed_workload()

# %% [markdown]
# **The CPU analogue, measured here.** One thread computes matmuls; the
# "copy" of each result is a copy of a 16 MiB block of RAM (it stands for
# the slow link). One after the other, every copy waits for every matmul; on
# a second thread, fed by a queue, each copy starts as soon as its matmul is
# done, like the copy stream.

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

    wall0 = time.perf_counter()
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
    return {"wall": time.perf_counter() - wall0, "spans": spans}


pipe_runs = {False: [], True: []}
try:
    torch.set_num_threads(1)
    print(compare({
        "one thread": lambda: pipe_runs[False].append(
            cpu_copy_pipeline(8, 320, 2**22, False)),
        "copy thread": lambda: pipe_runs[True].append(
            cpu_copy_pipeline(8, 320, 2**22, True))}, repeats=3))
finally:
    torch.set_num_threads(default_threads)
transfers.plot_runs(
    [(transfers.median_run(pipe_runs[False])["spans"],
      "one thread: compute all, then copy all"),
     (transfers.median_run(pipe_runs[True])["spans"],
      "a copy thread: each copy as soon as its matmul is done")],
    kind_of=reference.measured(0.0, "s", "cpu"), lanes=["compute", "copy"])

# %% [markdown]
# **Try it: copy size against compute size.** The slider redraws the
# predicted timeline of 4 chunks (a matmul, then a copy of its result) for
# an H100 on PCIe 5.0. On one stream the time is the *sum* of all matmuls
# and copies; with a copy stream it approaches the *larger* total. Overlap
# hides the smaller of the two, never the larger: when copies dominate, only
# a faster link or fewer bytes help.

# %%
overlap_slider = transfers.overlap_slider()

# %% [markdown]
# ## 6. The device-to-host `non_blocking` trap
#
# `y.to("cpu", non_blocking=True)` returns a CPU tensor **before** the copy
# has happened. Reading it then (printing it, `numpy()`, a Python `if`)
# reads whatever the pinned memory held before, with no error. Wait first:
# an event recorded after the copy (`ev.synchronize()`), the stream, or the
# device. Host-to-device copies have the reverse trap: do not overwrite the
# pinned source on the CPU before the copy has run. The CPU analogue is the
# thread race of section 2.

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


trap = None
if HAS_CUDA:
    d2h_read(-1.0, wait=True)  # warm-up: the cached pinned block now holds -1s
    trap = {"read at once": d2h_read(3.0, wait=False),
            "read after event.synchronize()": d2h_read(5.0, wait=True)}
transfers.show_d2h_trap(trap, device)

# %% [markdown]
# ## 7. Prefetching the next batch on a side stream
#
# Training needs the other direction: the next batch should arrive *on* the
# GPU while the model trains on this one. From pinned memory,
# `batch.to(device, non_blocking=True)` frees the CPU, but on the default
# stream the copy still takes turns with the training kernels. A
# **prefetcher** overlaps them:
#
# 1. on a side stream, start copying batch *i + 1*;
# 2. make the compute stream wait for that copy **on the GPU**
#    (`main.wait_stream(side)` or an event) before batch *i + 1* is used,
#    not with `synchronize()`, which stops the CPU;
# 3. call `batch.record_stream(main)` on each batch you hand out: its memory
#    was allocated on the side stream, and without this the allocator hands
#    it to the *next* copy as soon as Python drops the tensor, while the
#    training kernels on `main` may still read it.
#
# The two mistakes are the two races of section 2, and the stand-in GPU shows
# each of them every time. Below, a prefetcher that forgets step 2, and one
# that copies on the current stream: right, but nothing overlaps. Exercise 3.1
# asks for the right one.

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


for prefetcher in (prefetch_without_waiting, prefetch_on_current_stream):
    gpu = StandInCuda(copy_s=2.0)
    with gpu:
        steps = [gpu.launch(lambda v: v.sum().item(), x, 1.0) for x in
                 prefetcher(iter(host_batches(6, (3, 4), seed=11)), gpu.device, gpu)]
        gpu.synchronize()
    print(f"{prefetcher.__name__}: steps read {[gpu.read(op)[0] for op in steps]}; "
          f"{max(op['end'] for op in gpu.ops):g} time units for 6 copies of 2 and "
          "6 steps of 1")
    transfers.plot_runs([([(lane, a, b, "batch " + lab.split()[-1])
                           for lane, a, b, lab in gpu.spans()],
                          f"stand-in GPU (simulated time): {prefetcher.__name__}")],
                        unit="s", xlabel="simulated time units")
transfers.show_prefetch_prediction()

# %% [markdown]
# In the first timeline, the steps on the default stream start while their
# copies still run on the side stream: each read a batch not there yet
# (`unwritten`). In the second, every step reads the right batch, but copies
# and steps take turns, and the time is the sum of both.
#
# ## 8. Streams and the backward pass
#
# Each backward CUDA op runs on the stream of the forward op it belongs to,
# so a forward that ran two branches on two streams gets the same
# parallelism in its backward. Towards the code around it, `loss.backward()`
# behaves like any op queued on the stream current when you call it: the
# gradients are ready *in that stream's order*, and using them on another
# stream needs the usual wait:
#
# ```python
# with torch.cuda.stream(s):
#     loss.backward()
# torch.cuda.current_stream().wait_stream(s)  # before optimizer.step() here
# ```
#
# On a GPU the cell runs a backward on the side stream, waits as above, and
# compares the gradient with one from the default stream. (Autograd on the
# CPU has no streams.)

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
# The d2l seed's point is right: without a synchronisation between two
# devices, each works through its own queue and both work at once. Two of
# its explanations need correcting:
#
# - Its "GPU1 & GPU2" timing again called `synchronize()` without a device,
#   so it did not wait for `cuda:6` and `cuda:7`. It reported 0.14 s for
#   both, *half* of either GPU alone (0.28 s), which no overlap can give: the
#   timer stopped while the GPUs still worked. Two equal jobs at once take
#   about as long as one; wait for each device you used.
# - It credits the overlap to the framework, which "builds a computation
#   graph" and "automatically schedules" the work. Eager PyTorch does
#   neither: Python runs the operations in program order, each queued on its
#   device's current stream. The two GPUs overlap only because queuing is
#   much faster than the work; put a `synchronize`, an `.item()` or a
#   `print(tensor)` between them and they run one after the other.
#   (`torch.compile` analyses dependencies within one device's program, not
#   across the devices of this example.)
#
# With one GPU, the second device is the CPU: queue GPU work, compute on the
# CPU meanwhile, then wait. With two GPUs the cell also runs the seed's
# two-GPU version, correctly timed. Without a GPU, the CPU analogue is the
# two threads of section 3, whose verdict stands as printed there.

# %%
timings = transfers.time_two_devices(device, try_all_gpus()) if HAS_CUDA else None
transfers.show_two_devices(timings, device)
print("CPU analogue (section 3):", two_loops.verdict)

# %% [markdown]
# **Seed 001's picture, drawn.** The seed ends with a two-layer MLP trained
# on a CPU and two GPUs, as a graph of dependencies: each box is work on one
# device, an arrow means "needs the result of", and boxes on one row with no
# arrow between them may run at once. In eager PyTorch nobody schedules this
# graph for you: you get the overlap by queuing each GPU's work with no
# synchronisation in between (this section), by copying gradients out on a
# side stream as soon as each is ready (section 5), and by summing on the
# CPU only what has arrived. Chapter 6's all-reduce replaces the CPU in the
# middle.

# %%
transfers.draw_mlp_graph()

# %% [markdown]
# ## 10. Overlapping data loading with training
#
# The GPU can only train as fast as batches arrive. If the training process
# also prepares every batch (decoding, augmenting, collating), the
# accelerator waits meanwhile. `DataLoader(num_workers=k)` prepares batches
# in `k` worker processes while the main process trains: a pipeline. With
# `pin_memory=True` (useful only with a GPU) a thread in the main process
# copies each finished batch into pinned memory, so that
# `batch.to(device, non_blocking=True)` is truly asynchronous.
#
# Each item of the dataset below is a whole batch, made with real CPU work
# (FFT filtering of random images, a stand-in for decoding), stamped with
# when and by which worker it was made. The training step is real compute
# on `device`: on a CPU it competes with the loading for the cores. The main
# process gets one intra-op thread, as a worker has, so a batch costs the
# same wherever it is made; every loader has a `timeout`, so a stuck worker
# raises instead of hanging.

# %%
class SyntheticBatches(Dataset):
    """Batch i: random images, FFT-filtered (real CPU work), with its timestamps."""

    def __init__(self, n_batches, batch_size=32, side=64, passes=12):
        self.n_batches, self.batch_size, self.side = n_batches, batch_size, side
        self.passes = passes
        self.mask = torch.rand(side, side // 2 + 1,
                               generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n_batches

    def __getitem__(self, i):
        start = time.perf_counter()
        x = torch.randn(self.batch_size, self.side, self.side,
                        generator=torch.Generator().manual_seed(i))
        for _ in range(self.passes):
            x = torch.fft.irfft2(torch.fft.rfft2(x) * self.mask, s=(self.side,) * 2)
        info = torch.utils.data.get_worker_info()
        stamp = [start, time.perf_counter(), info.id if info is not None else -1]
        return x, (x.mean(dim=(1, 2)) > 0).long(), torch.tensor(stamp,
                                                              dtype=torch.float64)


W = (torch.randn(64 * 64, 256) / 64).to(device)


def train_step(x):
    """Stands in for forward + backward: a fixed amount of real compute."""
    h = x.reshape(x.shape[0], -1)
    return (torch.tanh(h @ W) @ W.T).sum()


def run_epoch(loader, spans):
    """One epoch: each batch to the device, a training step; spans stamped."""
    for x, _y, stamp in loader:
        x = x.to(device, non_blocking=True)  # asynchronous from pinned memory
        s = time.perf_counter()
        train_step(x)
        if HAS_CUDA:  # only so that the span shows the GPU's work
            torch.cuda.synchronize(device)
        spans.append(("main: train", s, time.perf_counter(), ""))
        lane = "main: load" if stamp[2] < 0 else f"worker {int(stamp[2])}: load"
        spans.append((lane, stamp[0].item(), stamp[1].item(), ""))
    return spans


# %% [markdown]
# The comparison runs an epoch of 10 batches with 0, 1 and 2 workers and,
# first, an epoch on **preloaded** batches (made beforehand, not timed),
# interleaved as always. The workers are persistent, so the warm-up epoch
# pays for starting them; their CPU time counts in the busy cores. Every
# verdict compares with the preloaded epoch, which is the seed's claim.
#
# **Claim** (seed 003): loading and preprocessing in a pipeline while
# training takes "almost the same time" as loading everything first and then
# training.
#
# **Bound.** A pipeline hides the loading only under the training. With $n$
# batches, load time $L$ and step time $T$ per batch, and $k$ workers that
# really run at once, an epoch takes at least $n \max(L/k, T)$, never less
# than the total CPU work over the cores, $n(L+T)/\text{cores}$; preloaded,
# it takes $nT$. So the claim holds only when $L/k \le T$ and the cores are
# free: on a two-core CPU machine the training and two workers share two
# cores. Preloading has its own price, which the claim leaves out: all of
# $nL$ before the first step, and memory for every batch.

# %%
def preloaded_epoch():
    for x in preloaded:
        train_step(x.to(device, non_blocking=True))
    if HAS_CUDA:
        torch.cuda.synchronize(device)


N_BATCHES, FORK = 10, "fork" if "fork" in mp.get_all_start_methods() else None
data = SyntheticBatches(N_BATCHES)
loaders = {k: DataLoader(data, batch_size=None, pin_memory=HAS_CUDA, **(
    {"num_workers": k, "persistent_workers": True, "multiprocessing_context": FORK,
     "timeout": 60} if k else {})) for k in (0, 1, 2)}
preloaded = [data[i][0] for i in range(N_BATCHES)]
epoch_runs = {k: [] for k in loaders}
torch.set_num_threads(1)
try:
    load_s = min(bench(data.__getitem__, 0, min_run_time=0.05).median for _ in range(2))
    step_s = bench(train_step, preloaded[0].to(device), min_run_time=0.05).median
    epochs = compare({
        "preloaded": preloaded_epoch,
        **{f"num_workers={k}": lambda k=k: epoch_runs[k].append(
            run_epoch(loaders[k], [])) for k in loaders}},
        repeats=3, warmup=1, number=1)
finally:
    torch.set_num_threads(default_threads)
    loaders.clear()  # shuts the persistent workers down
print(epochs)
print(f"one batch: load L = {load_s * 1e3:.1f} ms, train T = {step_s * 1e3:.1f} ms; "
      f"{usable_cores()} usable cores")
epoch_spans = {k: transfers.median_run([{"wall": transfers.span_wall(sp), "spans": sp}
                                         for sp in runs])["spans"]
               for k, runs in epoch_runs.items()}
transfers.print_epochs(epoch_spans, transfers.loader_estimates(
    load_s, step_s, N_BATCHES, usable_cores()))

# %% [markdown]
# Read the verdicts against the bound: with no workers the epoch is slower
# than the preloaded one by about $nL$; with workers it can match it only
# where $L/k \le T$ and a core is free for each process. The estimates above
# come from $L$ and $T$ measured alone, a moment before; a batch handed from
# a worker also crosses shared memory. The timelines show when each batch was
# made (worker lanes) and trained on (main lane): with workers, the loading
# bars sit under the training bars.

# %%
transfers.plot_epochs(epoch_spans)

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
#   once and reuse (a fresh pin costs more than a copy; a `pin_memory()`
#   timed in a loop reuses PyTorch's cached block and times a copy); `non_blocking`
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
# The check runs your prefetcher under training loops on the stand-in GPU,
# with copies slower than steps and steps slower than copies, in loops that
# never wait and in loops that wait for each step (as `loss.item()` does):
# every step must read its own batch, unchanged, the host must never wait in
# the prefetcher (no `synchronize`), copies must overlap the steps, and at
# most a few batches may be on the device at once. With a GPU it then runs
# for real.

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
# never runs (but its time still counts for the first start and the last
# end); time when three run at once counts once; gaps count in the total.
# Leave `spans` as they were, in their order: the caller still needs them.
# The check uses hand-made cases and seeded random ones (integer and float
# times, negative and large offsets, spans as tuples or lists), asks each
# twice, and then takes the matmul spans of the two threads measured in
# section 3.

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
# ### Exercise 3.3: loading ahead, by hand
#
# Build the pipeline a `DataLoader` runs, with threads. Write
# `load_ahead(dataset, batch_size, workers)`: a generator that yields the
# batches of `dataset` in order, where batch *k* is `(x, y)`, the `x` and the
# `y` of samples `k * batch_size` onwards stacked (`torch.stack`; the last
# batch may be shorter), while `workers` threads load the next batches: at
# most `2 * workers` batches ahead of the one handed out (what
# `prefetch_factor=2` bounds), and at most `workers` loads at once. With
# `workers=0` the loop loads each batch itself. The dataset can be read only
# in this process (it stands for one holding an open file), so threads, not a
# `DataLoader`'s worker processes: loading (I/O, torch's operators) releases
# the GIL.
#
# The check trains on your batches with a step of fixed length and measures
# how long the loop waits for data in the second half of an epoch (at most
# 30 % of a step). It also stops a loop after 3 batches (the generator is
# closed: loading must stop and no thread may be left), feeds a dataset with
# a corrupt sample (its error must reach the loop, not hang it), and calls
# your function twice.

# %% tags=["exercise"] exercise="3.3"
def load_ahead(dataset, batch_size, workers):
    ### BEGIN SOLUTION
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    from itertools import islice

    def load(start):
        stop = min(start + batch_size, len(dataset))
        samples = [dataset[i] for i in range(start, stop)]
        return tuple(torch.stack(parts) for parts in zip(*samples, strict=True))

    starts = iter(range(0, len(dataset), batch_size))
    if workers == 0:
        yield from (load(start) for start in starts)
        return
    with ThreadPoolExecutor(workers) as pool:
        ahead = deque(pool.submit(load, s) for s in islice(starts, 2 * workers))
        try:
            while ahead:
                batch = ahead.popleft().result()  # waits; re-raises a load's error
                start = next(starts, None)
                if start is not None:
                    ahead.append(pool.submit(load, start))
                yield batch
        finally:  # the loop stopped early (close) or a load failed
            for future in ahead:
                future.cancel()
    ### END SOLUTION


# %% tags=["check"] exercise="3.3"
check_load_ahead(load_ahead)

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
