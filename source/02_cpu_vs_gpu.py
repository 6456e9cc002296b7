# %% [markdown]
# # Chapter 2 - CPU vs GPU, and measuring it right
#
# **What you will learn**
#
# - why a plain `time.time()` around GPU code measures how fast Python *launches*
#   work, not how fast the GPU *does* it - and how to measure properly
#   (synchronize, CUDA events, warm-up, repeats, median);
# - where the CPU beats the GPU (small tensors) and where it loses (large ones),
#   measured, not guessed;
# - the two sync traps of training loops: `.item()` or `print` on every step,
#   and `total_loss += loss`, which keeps every step's autograd graph alive;
# - why a reduction over the last dimension is usually faster than over the
#   first: memory layout;
# - how close a matmul and a copy get to the hardware's peak (a roofline plot),
#   and what CPU threads change.
#
# **Hardware.** Every cell runs on a CPU. With a GPU, the GPU measurements run
# for real beside the CPU ones (and are recorded as reference results when
# `COURSE_RECORD=1`). Without one, the cells measure the CPU and show GPU
# figures of the other kinds, each labelled: *published* (the seed's own
# timings, datasheets, papers: each source cited once, then by its number),
# *predicted* (a calibrated model, named with its inputs), and *recorded* (a
# run of this chapter on a GPU, where one has been made). A GPU number is
# never printed as if this machine had measured it.

# %%
import copy
import queue
import statistics
import threading
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
import torch.utils.benchmark as tub
from IPython.display import display
from torch import nn

from course_utils import (
    Benchmark,
    banner,
    bench,
    check_fits,
    for_device,
    predict,
    reference,
    roofline,
    sweep,
    try_gpu,
)
from course_utils.bench import format_seconds, synchronize
from course_utils.compare import DISTURBED, Meter, compare
from course_utils.devices import cpu_facts, usable_physical_cores
from course_utils.errors import DoesNotFit

torch.manual_seed(0)
banner()
device = try_gpu()
on_gpu = device.type == "cuda"
print("measuring on:", "cpu" + (f" and {device}" if on_gpu else ""))

# %% [markdown]
# **One CPU thread, on purpose.** PyTorch splits large CPU operations over
# several threads. That is faster on an idle machine, but on a shared one
# (a 2-core CI runner, a laptop with a browser open) the threads must wait for
# cores another process holds, and the same line of code can take ten times
# longer from one run to the next. A timing that depends on what else the
# machine is doing is not a property of the code, so this chapter times the CPU
# with one thread and says so. Section 7 measures what more threads buy.

# %%
CPU_THREADS = 1
default_threads = torch.get_num_threads()
torch.set_num_threads(CPU_THREADS)
print(f"torch would use {default_threads} CPU threads; this chapter uses "
      f"{torch.get_num_threads()} (Section 7 compares)")

# %% [markdown]
# ## 1. The seed's experiment: `a += a`, a thousand times
#
# A popular blog post compares the CPU and the GPU by doubling a tensor of ones
# a thousand times, timing it with `time.time()`. It reports CPU times that grow
# with the size (about 38 s for a 4000 x 4000 tensor) and GPU times that stay
# at about **0.044 s for every size** from 4 x 4 to 4000 x 4000, and concludes
# that the GPU "hardly changes" as the work grows a million-fold. That
# conclusion is wrong, and finding out why is the point of this chapter.
#
# Here is the loop, written once and used for both devices:

# %%
def double_in_place(a, steps=1000):
    """The seed's workload: a += a, `steps` times, in place."""
    for _ in range(steps):
        a += a
    return a

# %% [markdown]
# First, a side question the seed never asks: what is in the tensor after a
# thousand doublings? Each step multiplies every element by 2, so after `k`
# steps it holds 2^k. float32 cannot hold numbers above about 3.4 x 10^38, a bit
# below 2^128.

# %%
a = torch.ones(4)
overflow_step = next(k for k in range(1, 1001)
                     if torch.isinf(double_in_place(a, steps=1)).all())
print(f"largest float32: {torch.finfo(torch.float32).max:.3e}")
print(f"every element is inf after step {overflow_step} of 1000")
print(f"after 1000 steps: {double_in_place(torch.ones(4)).tolist()}")

# %% [markdown]
# So for most of the seed's loop the GPU (and the CPU) were adding infinity to
# infinity. Does that change the timing? Some processors slow down on unusual
# numbers, so it is worth a measurement rather than a guess: the same addition
# on ordinary numbers, on infinities, and - the usual suspect for slow
# arithmetic - on *subnormal* numbers (tiny values below 1.2 x 10^-38 that
# float32 stores with reduced precision). Five rounds taken in turns, and the
# fastest of each: load from other programs can only add time, never remove it.

# %%
def value_cost(dev, n=1 << 16):
    """x + x on ordinary, infinite and subnormal values, through the protocol."""
    values = {"ordinary": 1.0, "inf": float("inf"), "subnormal": 1e-40}
    out = torch.empty(n, device=dev)

    def adds(x):
        def run():
            for _ in range(100):
                torch.add(x, x, out=out)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        return run
    return compare({k: adds(torch.full((n,), v, device=dev))
                    for k, v in values.items()}, repeats=5, number=25)


for dev in [torch.device("cpu")] + ([device] if on_gpu else []):
    print(f"{dev}: 100 x (x + x) on 65536 floats, per call")
    print(value_cost(dev))

# %% [markdown]
# "The same within noise" means those values cost nothing extra on that
# device; "slower" means the hardware takes a slow path for them, "faster" a
# fast one, and "disturbed" that another program spoiled the runs (rerun the
# cell). The inf verdict is the one that matters for the seed, whose loop runs on infinities from
# step 128 on: the overflow makes its *results* meaningless, and the verdict
# says whether it also bent its *timings*. We keep the seed's loop as it is.
#
# ### Try a size yourself
#
# Drag the slider: the cell times 1000 doublings (or fewer: `steps`) on the
# CPU, and on the GPU when there is one, measured the right way (Section 2
# explains how). A size that would not fit in memory is refused with one
# line instead of crashing the kernel; so is a run that would take minutes.

# %%
LIMIT_S = 30  # the longest run the slider starts


def one_step(size, dev):
    """A size x size tensor of ones, and the time of one warm doubling of it."""
    a = torch.ones(size, size, device=dev)
    double_in_place(a, steps=1)  # warm-up
    with Benchmark(device=dev, verbose=False) as step:
        double_in_place(a, steps=1)
    return a, step.elapsed


def too_slow(seconds, size, steps, dev):
    return DoesNotFit(f"{steps} steps at {size} x {size} would take about "
                      f"{seconds:.0f} s on {dev}: lower the size or the steps")


def time_doublings(size, steps, dev, probe=1024):
    """Seconds for `steps` doublings of a size x size tensor on `dev`."""
    if dev.type == "cpu" and size > probe:
        # A CPU step costs more per element once the tensor outgrows the caches,
        # so scaling up a small probe underestimates: enough to refuse what is
        # far too slow before allocating gigabytes for it.
        _, t = one_step(probe, dev)
        if t * (size / probe) ** 2 * steps > LIMIT_S:
            raise too_slow(t * (size / probe) ** 2 * steps, size, steps, dev)
    a, t = one_step(size, dev)
    if t * steps > LIMIT_S:
        raise too_slow(t * steps, size, steps, dev)
    with Benchmark(device=dev, verbose=False) as run:
        double_in_place(a, steps=steps)
    return run.elapsed


def seed_experiment(size=256, steps=1000):
    for dev in [torch.device("cpu")] + ([device] if on_gpu else []):
        try:
            check_fits((size, size), torch.float32, dev)
            t = time_doublings(size, steps, dev)
            print(f"{dev}: {steps} doublings of {size} x {size}: {format_seconds(t)}")
        except DoesNotFit as e:
            print(f"{dev}: refused - {e}")
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # else later check_fits see less free memory


sizes_slider = widgets.SelectionSlider(options=[2**k for k in range(2, 19)], value=256,
                                       description="size", continuous_update=False)
steps_slider = widgets.IntSlider(value=1000, min=1, max=2000, description="steps",
                                 continuous_update=False)
display(widgets.interactive(seed_experiment, size=sizes_slider, steps=steps_slider))

# %% [markdown]
# The slider's last stop, 2^18 x 2^18 float32, needs 256 GiB. This is what
# moving it there prints (the callback catches the refusal, so the cell does
# not fail):

# %%
seed_experiment(size=2**18, steps=1000)

# %% [markdown]
# A size that fits can still be too slow. 32768 x 32768 float32 is 4 GiB; on
# one CPU thread a thousand doublings of it take many minutes, which the cell
# estimates from a quick 1024 x 1024 probe and refuses before it allocates
# anything. On a GPU the same estimate decides, from one timed doubling: a GPU
# with HBM runs it in seconds, a T4, whose memory is far slower, may be
# refused too:

# %%
seed_experiment(size=2**15, steps=1000)

# %% [markdown]
# ## 2. The wrong measurement beside the right one
#
# ### Why the seed's GPU times were flat
#
# A CUDA operation called from Python does not run the work. It checks its
# arguments, puts a *kernel launch* on a queue (a CUDA stream), and returns;
# the GPU takes launches off the queue and runs them in order while Python
# carries on. Nothing waits for the GPU until something needs a result
# (`.item()`, `print`, `.cpu()`) or calls `torch.cuda.synchronize()`.
#
# The seed started its timer, launched 1000 additions and stopped the timer.
# The queue is deep enough (its depth is a driver detail) that the launches
# were accepted without waiting, and the timer measured **1000 launches**:
# some tens of microseconds each, whatever the size. That is the flat 0.044 s.
# The GPU was still working when the number was printed.
#
# The seed made three more mistakes that blur small sizes: it created the
# tensor and copied it to the GPU *inside* the timer, it measured one run only,
# and it did no warm-up (the first CUDA call in a process pays for context set-up,
# library loading and memory-pool growth).
#
# A CPU cannot show the launch queue with PyTorch, because CPU operators finish
# before they return. But the mechanism is ordinary Python: a worker thread that
# takes jobs off a queue is a faithful model of a stream. Here each job "runs" for
# 2 ms; we time 100 launches without and with waiting.

# %%
class ToyStream:
    """A worker thread running jobs in order, like a CUDA stream (a model)."""

    def __init__(self):
        self.jobs = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self):
        while True:
            job = self.jobs.get()
            job()
            self.jobs.task_done()

    def launch(self, job):
        self.jobs.put(job)  # returns at once, like a kernel launch

    def synchronize(self):
        self.jobs.join()  # waits until every launched job has run


stream, job = ToyStream(), lambda: time.sleep(0.002)
start = time.perf_counter()
for _ in range(100):
    stream.launch(job)
launched = time.perf_counter() - start
stream.synchronize()
finished = time.perf_counter() - start
print(f"100 launches returned after {launched * 1e3:.2f} ms; "
      f"the work finished after {finished * 1e3:.0f} ms "
      f"({finished / launched:.0f}x later)")

# %% [markdown]
# The unsynchronised timer is off by a large factor, and the factor grows with
# the work per job, exactly as the seed's GPU timer was. Stopping the clock
# after `synchronize()` gives the real time.
#
# ### The right way
#
# 1. **Warm up**: run the workload once before timing it.
# 2. **Synchronize** before starting and before stopping the clock
#    (`torch.cuda.synchronize(device)`), or let the GPU time itself with
#    **CUDA events**: `start.record()`, work, `end.record()`, then
#    `end.synchronize()` and `start.elapsed_time(end)` (milliseconds).
# 3. **Repeat** and take the **median**: one run is at the mercy of whatever
#    else the machine did at that moment; the median ignores the outliers.
#
# The two functions below are the seed's measurement and the careful one.

# %%
def seed_timing(size, dev, steps=1000):
    """The seed's measurement: one run, no warm-up, no synchronize."""
    start = time.time()
    a = torch.ones(size, size).to(dev)
    double_in_place(a, steps)
    return time.time() - start


def careful_timing(size, dev, steps=1000, repeats=3):
    """Warm-up, then the median of `repeats` synchronised runs."""
    dev = torch.device(dev)
    a = torch.ones(size, size, device=dev)
    double_in_place(a, steps)  # warm-up
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":  # the GPU times itself
            start, end = torch.cuda.Event(enable_timing=True), \
                torch.cuda.Event(enable_timing=True)
            start.record()
            double_in_place(a, steps)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            synchronize([dev])  # nothing to wait for on a CPU, kept for symmetry
            t0 = time.perf_counter()
            double_in_place(a, steps)
            synchronize([dev])
            times.append(time.perf_counter() - t0)
    return statistics.median(times)

# %% [markdown]
# Both measurements on the seed's sizes, side by side. The CPU runs sizes up to
# 400 (the seed's 4000 x 4000 took it 38 s); a GPU also runs 4000.

# %%
table_sizes = for_device(device, cpu=[4, 40, 400], gpu=[4, 40, 400, 4000])
rows = {}
print(f"{'size':>6} {'CPU seed':>10} {'CPU right':>10} {'GPU seed':>10} {'GPU right':>10}")
with Meter() as table_run:  # what other programs did while the table was timed
    for size in table_sizes:
        row = {}
        if size <= 400:
            row["cpu_seed"] = seed_timing(size, "cpu")
            row["cpu_right"] = careful_timing(size, "cpu")
        if on_gpu:
            torch.cuda.synchronize()
            row["gpu_seed"] = seed_timing(size, device)
            torch.cuda.synchronize()  # outside the timer: the next size starts clean
            row["gpu_right"] = careful_timing(size, device)
        rows[size] = row
        cells = [f"{format_seconds(row[k]):>10}" if k in row else f"{'-':>10}"
                 for k in ("cpu_seed", "cpu_right", "gpu_seed", "gpu_right")]
        print(f"{size:>6} " + " ".join(cells))
cpu_ratio = [rows[s]["cpu_seed"] / rows[s]["cpu_right"] for s in table_sizes if s <= 400]
print("CPU seed/right ratio per size:", ", ".join(f"{r:.2f}" for r in cpu_ratio))
print(table_run)
agree = 0.7 < cpu_ratio[-1] < 1.4
print("verdict at n = 400: " + (DISTURBED if table_run.disturbed else
      "the two CPU columns agree within noise (a CPU operator finishes before it "
      "returns)" if agree else f"the two CPU columns differ by {cpu_ratio[-1]:.2f}x"))

# %% [markdown]
# On the CPU the two columns should agree within noise for the larger sizes
# (the verdict above says whether they did): CPU operators are synchronous, so
# the seed's timer happened to be right there, apart from the tensor creation
# it included (visible only at tiny sizes). On a GPU, compare the two GPU
# columns: the "right" column grows with the work once the tensor is big
# enough to keep the GPU busy, while the "seed" column does not follow the
# work - it timed launches, plus the creation and copy of the tensor. Without
# a GPU, the cell shows the seed's own GPU column (*published*: flat from
# n = 4 to n = 4000 while the work grows a million-fold) and the *predicted*
# right column for an H100 (both *recorded* where a GPU has recorded them).

# %%
if on_gpu:
    for key in ("gpu_seed", "gpu_right"):
        reference.record(f"02.seed_table_{key}",
                         {"sizes": list(rows), "seconds": [rows[s][key] for s in rows]},
                         "s", device, note="1000 doublings of size x size float32")
seed_gpu = roofline.seed_gpu_columns([4, 40, 400, 4000])

# %% [markdown]
# ### How long the queue is
#
# On a GPU we can watch the queue fill: launch `n` additions on a large tensor
# and time how long the *launching* takes, then how long until they finish. While
# `n` is below the queue's depth, launching costs a few microseconds per
# kernel; beyond it, Python must wait for room, and launching slows to the
# GPU's pace.

# %%
if on_gpu:
    big = torch.ones(4096, 4096, device=device)
    big.add_(1.0)
    queue_rows = []
    for n in (10, 100, 1000, 3000):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            big.add_(1.0)
        t_launch = time.perf_counter() - t0
        torch.cuda.synchronize()
        t_total = time.perf_counter() - t0
        queue_rows.append([n, t_launch, t_total])
        print(f"{n:5d} launches: launching {t_launch / n * 1e6:7.1f} us each, "
              f"done after {t_total / n * 1e6:7.1f} us each")
    reference.record("02.launch_queue", queue_rows, "s", device,
                     note="[n, launch seconds, total seconds], add_ on 4096x4096")
add_time = predict.kernel_seconds(4096**2, 2 * 4 * 4096**2, "h100_sxm")
roofline.show("02.launch_queue", unit="s", figures=[add_time], lines=lambda f: [
    f"{n:5d} launches: launching {t / n * 1e6:7.1f} us each, done after "
    f"{done / n * 1e6:7.1f} us each" for n, t, done in f.value]
    if f.kind == "recorded" else ["one add_ on 4096 x 4096: once the queue is full, "
                                  "launching slows to this pace"]);

# %% [markdown]
# ### Timing the stages of a pipeline: whose time is it?
#
# A program rarely times one operation; it times its *stages* - the model,
# then a search over its output, say - to find the one worth speeding up. An
# unsynchronised stage timer does worse than shrink the GPU's time: it moves
# it. The first stage only queues its kernels and its timer stops early;
# the GPU's work is then paid for by whichever later stage first needs a
# result (`.cpu()`, `.item()`, a `print`), and that stage looks expensive.
#
# One of the seeds tells how this misled its authors: a translation model
# with a nearest-neighbour search over a large datastore (kNN-MT), timed stage
# by stage like this, made the search look far more expensive than the model,
# because part of the model's GPU time was charged to the search, which read
# the model's output first. It is their account, not the whole story:
# end-to-end timings, which a stage timer cannot distort, still find kNN-MT
# several times slower to decode than the model alone (published, printed
# below), since it searches for every generated token. Either way, a stage
# timer without synchronisation says which stage *waited*, not which *worked*.
#
# Below, stage 1 is "the model", stage 2 a real k-nearest-neighbour search on
# the CPU (`torch.cdist` and `topk` over a datastore of 20,000 vectors) of
# the model's output. Each is timed with `time.perf_counter()`, once as the
# seed's story did and once waiting for the device at the stage boundary.
# Without a GPU, the model runs on the `ToyStream` above (each job sleeps
# 3 ms, like a kernel the CPU does not wait for); with one, it is a chain of
# real matmuls on the GPU.

# %%
DATASTORE = torch.randn(20_000, 64)  # the search's datastore, on the CPU


def knn_search(queries, k=8):
    """Stage 2: the k nearest datastore rows of each query (on the CPU)."""
    return torch.cdist(queries, DATASTORE).topk(k, largest=False).indices


def time_stages(run_model, wait, read_output, sync_between, repeats=5):
    """Median seconds of each stage, timed with perf_counter around each."""
    times = {"model": [], "search": []}
    for _ in range(repeats + 1):  # the first round is a warm-up
        t0 = time.perf_counter()
        out = run_model()  # stage 1
        if sync_between:
            wait()  # the stage boundary: wait for the device
        t1 = time.perf_counter()
        knn_search(read_output(out))  # stage 2: reading the output waits, if needed
        t2 = time.perf_counter()
        times["model"].append(t1 - t0)
        times["search"].append(t2 - t1)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


toy = ToyStream()


def toy_model(jobs=10):
    """'Launch' jobs of 3 ms on the toy stream; the last one writes the output."""
    out = torch.empty(64, 64)
    for _ in range(jobs - 1):
        toy.launch(lambda: time.sleep(0.003))
    toy.launch(lambda: (time.sleep(0.003), out.copy_(torch.randn(64, 64))))
    return out


def toy_read(out):
    toy.synchronize()  # like .cpu() on a CUDA tensor: wait for what wrote it
    return out


stage_setups = {"cpu (toy stream)": (toy_model, toy.synchronize, toy_read)}
if on_gpu:
    weights = [torch.randn(4096, 4096, device=device) / 64 for _ in range(8)]

    def gpu_model():
        h = torch.randn(4096, 4096, device=device)
        for w in weights:
            h = torch.tanh(h @ w)
        return h

    stage_setups[str(device)] = (gpu_model, lambda: torch.cuda.synchronize(device),
                                 lambda out: out[:64, :64].cpu())
stage_times = {}
for name, (run_model, wait, read_output) in stage_setups.items():
    for sync_between in (False, True):
        t = time_stages(run_model, wait, read_output, sync_between)
        stage_times[(name, sync_between)] = t
        how = "waiting at the boundary" if sync_between else "no wait (the seed's)"
        print(f"{name:>17}, {how:<24}: model {t['model'] * 1e3:7.2f} ms, "
              f"search {t['search'] * 1e3:7.2f} ms")
if on_gpu:
    reference.record("02.stage_timing", {
        "no wait": stage_times[(str(device), False)],
        "waiting at the boundary": stage_times[(str(device), True)]},
        "s", device, note="8 chained 4096x4096 matmuls, then a CPU k-NN search")
model_floor = predict.kernel_seconds(2 * 4096**3, 3 * 4 * 4096**2, "h100_sxm",
                                     launches=8)
roofline.show("02.stage_timing", unit="s", figures=[
    model_floor, reference.published("martins2022_chunk_knnmt.knnmt_decoding_slowdown")],
    lines=lambda f: [f"{how:<24}: model {t['model'] * 1e3:7.2f} ms, search "
                     f"{t['search'] * 1e3:7.2f} ms" for how, t in f.value.items()]
    if f.kind == "recorded" else []);

# %% [markdown]
# The predicted line is the GPU time of the model stage (8 matmuls): a stage
# timer that shows less timed the launches. Compare the two lines of each
# device. Without the wait, the model looks almost free and the search carries
# the model's time as well; with it, each stage gets its own. The total is
# about the same: the naive timer charged the GPU's time to the wrong stage.
# To time stages without slowing the program down, record CUDA events between
# them (Exercise 2.3 builds that), or use `torch.profiler`, which reports each
# kernel's GPU time under the operation that launched it.
#
# ### An error that shows up lines later: `CUDA_LAUNCH_BLOCKING=1`
#
# Asynchrony also moves *errors*. A kernel that fails - an index out of range
# checked on the device, an illegal memory access - fails while the GPU runs
# it, long after Python has left the line that queued it. The error is
# reported by the next call that waits for the GPU or checks its status, so
# the traceback points at an innocent line. Setting the environment variable
# `CUDA_LAUNCH_BLOCKING=1` (before the process initialises CUDA) makes every
# launch wait for its kernel, so the error is raised at the line that caused
# it. It removes every overlap of CPU and GPU: it is for debugging, never for
# measuring. A device-side error also leaves the process's CUDA context
# unusable, so the demonstration below runs in a fresh Python process, once
# without and once with the variable.
#
# On a CPU the same mistake is an ordinary, synchronous error, raised at its
# line:

# %%
try:
    torch.zeros(10)[torch.tensor([20])]
except IndexError as e:
    print("on the CPU, at the indexing line: IndexError:", e)

# %%
ASYNC_ERROR = """\
import torch
x = torch.zeros(10, device="cuda")
bad = torch.tensor([20], device="cuda")  # index 20 of a 10-element tensor
torch.cuda._sleep(100_000_000)           # keep the GPU busy for a while
y = x[bad]                               # the bug: checked on the GPU, later
z = y * 2 + 1
print("sum:", z.sum().item())            # the first line that waits
"""


if on_gpu:
    reported = {f"CUDA_LAUNCH_BLOCKING={int(b)}": roofline.error_line(ASYNC_ERROR, b)
                for b in (False, True)}
    for k, v in reported.items():
        print(f"{k}: the error is reported at {v}")
    reference.record("02.launch_blocking", reported, "line of the traceback", device)
else:
    print("no GPU: the script that would run, in a fresh process each time:\n")
    print(ASYNC_ERROR)
documented = reference.predicted(
    {"CUDA_LAUNCH_BLOCKING=0": "a later line that waits for the GPU (the .item())",
     "CUDA_LAUNCH_BLOCKING=1": "the line that launched the faulty kernel"},
    "line of the traceback", "any CUDA GPU",
    "PyTorch docs, CUDA semantics (asynchronous execution): errors surface at the "
    "next synchronising call unless CUDA_LAUNCH_BLOCKING=1 makes launches wait")
roofline.show("02.launch_blocking", figures=[documented], lines=lambda f: [
    f"{k}: the error is reported at {v}" for k, v in f.value.items()]);

# %% [markdown]
# What to look for on a GPU: without the variable the traceback points at the
# last line, the `.item()` that first waited for the GPU, two lines after the
# bug; with it, at the indexing line itself.

# %% [markdown]
# ### The same tools, three ways
#
# `course_utils` has two timing helpers, both synchronising. (d2l's `Benchmark`,
# which one of the seed posts uses, only reads a clock: it is right only when
# the timed block itself ends with `torch.cuda.synchronize()`, as that post's
# blocks do.)
#
# - `Benchmark`, a context manager: times one block, waits for the devices on
#   entry and exit (`sync=False` shows the trap);
# - `bench(fn, *args)`: warm-up, then `torch.utils.benchmark.Timer`, which picks
#   how many calls make a run, repeats runs and reports the median and IQR.
#
# A helper is only worth trusting if it agrees with an independent measurement.
# Here all three time the same 256 x 256 matmul on the CPU (and a 2048 x 2048
# one on a GPU), taking turns for five rounds.

# %%
def compare_helpers(dev, n, calls=25, rounds=5):
    """Seconds per call of an n x n matmul by each tool, rounds taken in turns."""
    x = torch.randn(n, n, device=dev)
    torch.mm(x, x)  # warm-up
    timer = tub.Timer("torch.mm(x, x)", globals={"torch": torch, "x": x},
                      num_threads=torch.get_num_threads())
    times = {"Benchmark": [], "bench": [], "torch.utils.benchmark": []}
    for _ in range(rounds):
        with Benchmark(device=dev, verbose=False) as block:
            for _ in range(calls):
                torch.mm(x, x)
        times["Benchmark"].append(block.elapsed / calls)
        times["bench"].append(bench(torch.mm, x, x, min_run_time=0.05).median)
        times["torch.utils.benchmark"].append(
            timer.blocked_autorange(min_run_time=0.05).median)
    return times


for dev, n in [(torch.device("cpu"), 256)] + ([(device, 2048)] if on_gpu else []):
    times = compare_helpers(dev, n)
    ref = times["torch.utils.benchmark"]
    print(f"{dev}, {n} x {n} matmul: torch.utils.benchmark {min(ref) * 1e6:.1f} us "
          "per call (fastest round)")
    for name in ("Benchmark", "bench"):
        rounds = ", ".join(f"{a / b:.2f}" for a, b in zip(times[name], ref, strict=True))
        print(f"  {name:<9} / torch.utils.benchmark: {min(times[name]) / min(ref):.3f}"
              f" fastest round vs fastest round; round by round: {rounds}")

# %% [markdown]
# On a quiet machine every ratio is within a few percent of 1. On a loaded one
# single rounds wander, because a burst of load elsewhere hits one tool's turn
# and not the others'; the fastest round of each tool is the steadier
# comparison, since load can only add time. `Benchmark` - one block, so one
# mean - wanders most: that is why `bench` repeats runs and reports the
# median. With a GPU all three also wait for the GPU, so they agree there too.
#
# ## 3. Where the CPU wins and where the GPU wins
#
# Now the seed's sweep, measured properly. Instead of 1000 doublings per size we
# time *one* doubling with `bench` (median over many) and multiply by 1000 to
# plot on the seed's scale - the queue no longer hides anything because `bench`
# synchronises around every run. `sweep` runs the sizes with a progress line.

# %%
def per_step(size, dev):
    a = torch.ones(size, size, device=dev)
    return bench(double_in_place, a, 1, min_run_time=0.05)


cpu_sizes = [16, 32, 64, 128, 256, 512, 1024, 2048]
gpu_sizes = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
cpu_sweep = sweep(lambda s: per_step(s, "cpu"), cpu_sizes, label="CPU, measured here")
curves = [cpu_sweep]
if on_gpu:
    gpu_sweep = sweep(lambda s: per_step(s, device), gpu_sizes,
                      label=f"{torch.cuda.get_device_name(device)}, measured here")
    curves.append(gpu_sweep)
    seed_style = []
    for s in gpu_sizes:
        torch.cuda.synchronize()  # outside the timer: each size starts clean
        seed_style.append(seed_timing(s, device))
    reference.record("02.doubling_sweep_gpu", {"sizes": gpu_sizes,
                     "median": gpu_sweep.median, "iqr": gpu_sweep.iqr,
                     "low": gpu_sweep.low, "high": gpu_sweep.high},
                     "s", device, note="one a += a, median and quartiles over runs")
    reference.record("02.seed_style_sweep_gpu", {"sizes": gpu_sizes,
                     "seconds": seed_style}, "s", device,
                     note="1000 a += a, time.time(), no sync, no warm-up")

# %% [markdown]
# Beside the curves measured here, the plot draws the calibrated *prediction*
# for an H100 (the launch cost or the time the memory needs, whichever is
# larger) and the seed's own GPU measurement (*published*, taken the seed's
# way: `time.time()`, no synchronize), plus GPU curves *recorded* by this
# course where there are any. The seed's line does not follow the work: it
# timed launches.

# %%
ax = roofline.plot_doubling_sweep(curves, gpu_sizes, seed_gpu,
                                  seed_style if on_gpu else None)
plt.show()

# %% [markdown]
# Where the curves cross is where the GPU starts to pay off. Below it, a GPU step
# costs a roughly fixed launch overhead (microseconds) while the CPU finishes a
# small tensor faster than that; above it, the GPU's memory bandwidth - many times
# the CPU's - wins, by a factor that grows with the size and then levels off:
# once both are memory-bound, each step moves the same bytes, so the ratio
# tends to the ratio of the two memory bandwidths. The cell computes the
# crossing from a GPU curve measured here or recorded, and otherwise the
# bandwidth ratio from the prediction:

# %%
roofline.crossing(cpu_sweep, (gpu_sweep.sizes, gpu_sweep.median) if on_gpu else None)

# %% [markdown]
# ## 4. Sync traps in a training loop
#
# ### `.item()` (or `print(loss)`) on every step
#
# Reading a GPU value from Python - `loss.item()`, `float(loss)`, `print(loss)`,
# `loss.cpu()` - waits until the GPU has computed it. Once per epoch that costs
# nothing; once per step it stops Python from launching the next step's kernels
# while the GPU works on this one, so the two take turns instead of overlapping.
# The fix: accumulate `loss.detach()` on the device and read it once. (The
# idiom `total_loss += loss.item()`, often recommended in place of
# `total_loss += loss`, avoids the trap of the next section but still waits
# once per step. Seed 003 writes the fix as `batch_loss += loss.detach()`
# and, after some batches, `print(batch_loss.mean().item())`: but `batch_loss`
# is a single number, a running sum, and the mean of one number is itself, so
# that prints the *sum* of the losses. Divide by the number of batches.)

# %%
def make_problem(dev, steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1)).to(dev)
    data = [(torch.randn(128, 256, device=dev), torch.randn(128, 1, device=dev))
            for _ in range(steps)]
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), data


def epoch_item_every_step(model, opt, data):
    total = 0.0
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        total += loss.item()  # waits for this step to finish
    return total / len(data)


def epoch_sync_once(model, opt, data):
    total = torch.zeros((), device=data[0][0].device)
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        total += loss.detach()  # stays on the device: no wait
    return total.item() / len(data)  # one wait per epoch


def time_epochs(dev, steps, rounds=3):
    """Seconds per step of each loop: the fastest of rounds taken in turns."""
    loops = (epoch_item_every_step, epoch_sync_once)
    problems = {fn: make_problem(dev, steps) for fn in loops}
    times = {fn.__name__: [] for fn in loops}
    for _ in range(rounds):
        for fn in loops:
            times[fn.__name__].append(bench(fn, *problems[fn], min_run_time=0.1).median)
    return {name: min(ts) / steps for name, ts in times.items()}


cpu_problems = {fn: make_problem("cpu", 20) for fn in (epoch_item_every_step,
                                                        epoch_sync_once)}
print("cpu: one epoch of 20 steps")  # interleaved runs, the course's protocol
print(compare({fn.__name__: lambda fn=fn: fn(*cpu_problems[fn])
               for fn in cpu_problems}, repeats=3, tolerance=0.15))

# %% [markdown]
# On the CPU the two take about the same time (the verdict says whether they
# did, or that the machine was disturbed): each operator has finished when it
# returns, so `.item()` only
# copies one number that is already there - there is no queue to drain. On a
# GPU the per-step read removes the overlap between Python's launching and the
# GPU's work:

# %%
if on_gpu:
    gpu_epoch = time_epochs(device, steps=200)
    for name, t in gpu_epoch.items():
        print(f"{device}: {name:<22} {t * 1e6:8.1f} us per step")
    reference.record("02.item_per_step", gpu_epoch, "s/step", device,
                     note="MLP 256-512-1, batch 128, SGD")
overlap = reference.predicted(
    2.0, "x (at most)", "any CUDA GPU",
    "launching (CPU) and computing (GPU) overlap without the per-step read and "
    "add up with it: ratio = (launch + compute) / max(launch, compute), at most 2, "
    "reached when the two are equal",
    caveat="not calibrated: no published measurement of this ratio was found; the "
    "wait and the copy of .item() are left out, so a real ratio can pass 2")
roofline.show("02.item_per_step", figures=[overlap], lines=lambda f: [
    ".item() every step / sync once: "
    f"{f.value['epoch_item_every_step'] / f.value['epoch_sync_once']:.2f}"]
    if f.kind == "recorded" else []);

# %% [markdown]
# ### `total_loss += loss` keeps every graph alive
#
# The opposite mistake avoids the sync by accumulating the loss tensor itself.
# But `loss` carries its autograd history (`loss.grad_fn`), and `total + loss`
# creates a new node that points back to it: `total` ends up holding *every*
# step's graph. To see it, we walk the graph behind a tensor and count its nodes
# and the bytes of the tensors it saved for the backward pass.

# %%
def graph_size(t):
    """(nodes, bytes saved for backward) of the autograd graph behind `t`."""
    seen, todo, storages = set(), [t.grad_fn], {}
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed by backward()
                    continue
                if isinstance(value, torch.Tensor):
                    s = value.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
        todo.extend(next_node for next_node, _ in node.next_functions)
    return len(seen), sum(storages.values())

# %% [markdown]
# Four loops of 20 steps: training (with `backward`) and evaluation (no
# `backward`, but gradients still enabled), each accumulating `loss` or
# `loss.detach()`.

# %%
def accumulate(model, data, train, detach):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    total = 0
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        if train:
            opt.zero_grad()
            loss.backward()
            opt.step()
        total = total + (loss.detach() if detach else loss)
    return total


model, _, data = make_problem("cpu", steps=20)
for train in (True, False):
    for detach in (False, True):
        total = accumulate(copy.deepcopy(model), data, train, detach)
        nodes, saved = graph_size(total)
        print(f"{'train' if train else 'eval ':5} total += loss{'.detach()' * detach:9}"
              f" -> graph of {nodes:4d} nodes, {saved / 2**20:6.2f} MiB saved "
              f"({saved / len(data) / 2**10:7.1f} KiB per step)")

# %% [markdown]
# In training, `backward()` frees the saved activations, so the kept graph is
# "only" a chain of nodes that grows every step (a later `total.backward()` would
# fail: the tensors it needs were freed by the step's own backward). In an evaluation loop without
# `torch.no_grad()` nothing frees them: every step's activations stay in memory
# until `total` dies - the memory growth people see in validation loops. The
# fixes: accumulate `loss.detach()` (or `loss.item()` once in a while), and run
# evaluation under `torch.no_grad()`.
#
# ## 5. Memory layout: softmax over dim 0 vs dim -1
#
# A row-major (contiguous) `n x n` tensor stores each row as one block. Softmax
# over `dim=-1` reduces each row: it reads a contiguous block, which caches, SIMD
# units and (on a GPU) coalesced loads handle best. Over `dim=0` it reduces each
# column, whose elements are `n` floats apart. What matters is the *stride* of
# the reduced dimension in memory, not its number. A transposed view `X.t()`
# swaps the strides without copying, so `dim=0` of the view is a row of `X` -
# but that does not make it cheap, as the third timing shows. (The seed that
# raised this timed one call of each on a 50000 x 50000 tensor - 10 GB - with no
# warm-up; `bench` repeats and takes the median, and the sizes here fit a laptop.)

# %%
def softmax_times(X):
    return {
        "dim=0": bench(torch.softmax, X, 0, min_run_time=0.1).median,
        "dim=-1": bench(torch.softmax, X, -1, min_run_time=0.1).median,
        "X.t(), dim=0": bench(torch.softmax, X.t(), 0, min_run_time=0.1).median,
    }


X = torch.randn(1024, 1024)
print("X strides:", X.stride(), " X.t() strides:", X.t().stride())
cpu_soft = softmax_times(X)
print("cpu:", ", ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in cpu_soft.items()),
      f"| dim=0 / dim=-1 = {cpu_soft['dim=0'] / cpu_soft['dim=-1']:.2f}")
if on_gpu:
    n = 16384
    check_fits((n, n), torch.float32, device, copies=3)  # X, a copy, the output
    gpu_soft = softmax_times(torch.randn(n, n, device=device))
    print(f"{device}:", ", ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in gpu_soft.items()),
          f"| dim=0 / dim=-1 = {gpu_soft['dim=0'] / gpu_soft['dim=-1']:.2f}")
    reference.record("02.softmax_16384", gpu_soft, "s", device)
roofline.show("02.softmax_16384", figures=[
    reference.published("seed003.softmax_dim_seconds")], lines=lambda f: [
    "50000 x 50000 (the seed's runs): dim=0 / dim=-1 = "
    + ", ".join(f"{r['dim0_s'] / r['dim_last_s']:.2f}" for r in f.value)]
    if f.kind == "published" else
    [f"16384 x 16384: dim=0 / dim=-1 = {f.value['dim=0'] / f.value['dim=-1']:.2f}"]);

# %% [markdown]
# Read the printed ratio: above 1, the strided reduction is slower on that
# device (how much depends on the device and the size). The transposed view is
# no shortcut: softmax first makes a non-contiguous input contiguous - a copy -
# and then does the same strided reduction as `dim=0` on `X`. The seed's rule "reduce over the last dimension" is really a
# rule about memory: lay data out so the reduced dimension is the contiguous one
# (the last, for a tensor created normally), rather than transposing later.
#
# ## 6. Achieved throughput against the peak (roofline)
#
# How good is a measured time? Compare it with what the hardware could do. Two
# peaks bound every kernel: arithmetic (FLOP/s) and memory bandwidth (bytes/s). A
# kernel doing `I` FLOP per byte it moves (its *arithmetic intensity*) can reach
# at most `min(peak FLOP/s, I x bandwidth)`: that roof is the **roofline**.
#
# The CPU's arithmetic peak is not printed on the box; we **estimate** it from
# the probes: threads x (SIMD width / 32 floats per instruction) x 2 (a fused
# multiply-add is two FLOP) x clock, counting **one** FMA unit per core. Many
# cores have two (twice that), and turbo clocks run above the reported one, so
# treat it as an estimate within a factor of two: the plot draws the one-unit
# roof solid and the two-unit roof dashed, and a fast matmul may land between.
# The memory bandwidth has no probe at all, so we **measure** it with a large
# copy (reads and writes 64 MiB each way, far more than the caches hold). For a
# peak we keep the *fastest* run, not the median: a peak is what the machine
# does when nothing else gets in the way.

# %%
facts = cpu_facts()
clock_hz = (facts["clock_mhz"] or 0) * 1e6
lanes = facts["simd_bits"] // 32
cpu_peak = CPU_THREADS * lanes * 2 * clock_hz
print(f"{facts['model']}: {facts['simd']} ({lanes} float32 lanes), FMA: {facts['fma']},"
      f" {facts['clock_mhz']} MHz, {facts['usable_cores']} usable cores")
print(f"estimated float32 peak: {cpu_peak / 1e9:.0f} GFLOP/s with {CPU_THREADS} thread "
      f"({usable_physical_cores() * lanes * 2 * clock_hz / 1e9:.0f} GFLOP/s on all "
      f"{usable_physical_cores()} physical cores)")


def copy_bandwidth(dev, n_floats):
    src = torch.ones(n_floats, device=dev)
    dst = torch.empty_like(src)
    fastest = min(bench(dst.copy_, src, min_run_time=0.3).times)
    return 2 * src.nbytes / fastest  # read src + write dst, in the fastest run


cpu_bw = copy_bandwidth("cpu", 1 << 24)
print(f"measured copy bandwidth (fastest run): {cpu_bw / 1e9:.1f} GB/s")

# %% [markdown]
# The points: matmuls of several sizes (`2 n^3` FLOP over `3 n^2` floats, so the
# intensity grows with `n`) and an elementwise add (1 FLOP per 12 bytes: read two
# floats, write one), each timed with `bench`. In the plot each point is
# labelled with its size: `n` for a matmul, the number of floats for an add.

# %%
def roofline_points(dev, mm_sizes, add_sizes):
    points = {"matmul": [], "add": []}
    for n in mm_sizes:
        a = torch.randn(n, n, device=dev)
        t = bench(torch.mm, a, a, min_run_time=0.05).median
        points["matmul"].append([2 * n**3 / (12 * n * n), 2 * n**3 / t, n])
    for n in add_sizes:
        a, b = torch.randn(n, device=dev), torch.randn(n, device=dev)
        c = torch.empty_like(a)  # reused: a fresh output would time page faults too
        t = bench(torch.add, a, b, out=c, min_run_time=0.05).median
        points["add"].append([n / (12 * n), n / t, n])
    return points


cpu_points = roofline_points("cpu", [32, 64, 128, 256, 512], [1 << 12, 1 << 16, 1 << 24])
best = max(p[1] for p in cpu_points["matmul"])
print(f"best CPU matmul: {best / 1e9:.1f} GFLOP/s = {best / cpu_peak:.0%} of the "
      "estimated peak")
if best > 2 * cpu_peak:
    print("  above even the two-FMA-unit roof: the clock ran well above the reported "
          f"{facts['clock_mhz']} MHz (turbo) - the estimate is wrong, not the timing")
elif best > cpu_peak:
    print("  between the one- and two-FMA-unit roofs: this core does more per cycle "
          "than one FMA unit, or its turbo clock beats the reported one")
else:
    print("  under the one-FMA-unit estimate, as a measured point should be")
for _, flops, n in cpu_points["add"]:
    print(f"add of {n:>8} floats: {flops * 12 / 1e9:6.1f} GB/s = "
          f"{flops * 12 / cpu_bw:.0%} of the measured copy bandwidth")

# %% [markdown]
# On a GPU the same points are measured. Its peaks are data-sheet figures
# computed from what the device reports (SM count, clock, memory clock and bus
# width) and the float32 units per SM from the CUDA programming guide's
# throughput table (`roofline.gpu_peaks`); where they are unavailable, the
# measured copy bandwidth stands in. The compute roof is that of the ordinary
# float32 units: tensor cores (TF32, bf16) have far higher roofs, but PyTorch
# keeps float32 matmuls off them unless told otherwise
# (`torch.get_float32_matmul_precision()` is `'highest'` by default). The
# published H100 datasheet roofs are drawn in grey.

# %%
gpu_roof = None
if on_gpu:
    g_peak, g_bw_peak, g_how = roofline.gpu_peaks(device)
    g_bw = copy_bandwidth(device, 1 << 28)
    g_points = roofline_points(device, [256, 1024, 4096, 8192],
                               [1 << 16, 1 << 22, 1 << 28])
    gpu_roof = {"points": g_points, "copy_bw": g_bw, "peak_flops": g_peak,
                "peak_bw": g_bw_peak, "peaks_from": g_how}
    print(f"{device}: measured copy {g_bw / 1e9:.0f} GB/s; {g_how}:",
          "compute", "unknown" if g_peak is None else f"{g_peak / 1e12:.1f} TFLOP/s",
          "| memory", "unknown" if g_bw_peak is None else f"{g_bw_peak / 1e9:.0f} GB/s")
    reference.record("02.roofline_gpu", gpu_roof, "FLOP/s", device,
                     note="float32; points are [FLOP/byte, FLOP/s, n]")
    gpu_roof["label"] = torch.cuda.get_device_name(device)
h100 = (reference.published("h100_sxm.fp32_tflops"),
        reference.published("h100_sxm.memory_bandwidth_gbps"))
for fig in roofline.show("02.roofline_gpu", figures=h100):
    if fig.kind == "recorded" and gpu_roof is None:
        gpu_roof = dict(fig.value, label=fig.legend)
roofline.plot_roofline(cpu_peak, cpu_bw, cpu_points, gpu_roof, published=h100)
plt.show()

# %% [markdown]
# Small matmuls sit far below the roof: the work is too small to fill the
# machine, and fixed costs dominate. Small adds can land *above* the bandwidth
# roof, because their tensors stay in the caches, which are faster than main
# memory; the 64 MiB copy that set the roof does not fit in them. The add's
# intensity is the same at every size, so it can never climb to the flat part:
# it is limited by memory bandwidth, and a faster processor would not help it -
# only fewer bytes would (fusing operations, lower precision). On a GPU both
# roofs are far higher, but its small problems sit even further below them:
# fixed launch costs dominate there - the regime where Section 3 found the CPU
# faster.
#
# ## 7. CPU threads
#
# `torch.get_num_threads()` is how many threads PyTorch's CPU operators may use
# (by default, one per usable core). `torch.set_num_threads(n)` changes it for
# the whole process, so we restore the setting afterwards.

# %%
a = torch.randn(512, 512)
thread_counts = sorted({1, 2, facts["usable_cores"]})


def matmul_on(n):
    def run():
        torch.set_num_threads(n)
        torch.mm(a, a)
    return run


try:  # interleaved runs, CPU seconds and busy cores: the course's protocol
    print(compare({f"{n} thread{'s' if n > 1 else ''}": matmul_on(n)
                   for n in thread_counts}, repeats=3))
finally:
    torch.set_num_threads(CPU_THREADS)
print("restored:", torch.get_num_threads(), "thread(s)")

# %% [markdown]
# On an idle machine with at least two cores, two threads can come close to
# twice as fast on a matmul this size, with two busy cores. On a loaded machine
# the second thread must wait for a core that another process holds: the
# threads of one matmul wait for each other, so the one without a core sets
# the pace, and two threads can even be slower than one. The comparison then
# says "disturbed" rather than report that as the threads' doing. That is why
# every CPU timing in this course states its thread count, and why the printed
# verdict, not a claim in this text, is the answer for your machine.
#
# ## Summary
#
# - CUDA calls return before the work is done. A timer around them measures the
#   launches - which is why the seed's GPU times stayed flat at about 0.044 s.
# - The seed's tensor overflows to inf at step 128 of 1000; the inf verdict
#   says whether that bent the timings on your devices.
# - Measure right: warm up, synchronise (or use CUDA events), repeat, take the
#   median. `Benchmark` and `bench` do this and agree with
#   `torch.utils.benchmark`.
# - Timing stages without waiting at their boundaries charges the GPU's work
#   to whichever later stage first reads a result; wait at each boundary, or
#   record CUDA events between stages. `CUDA_LAUNCH_BLOCKING=1` moves a
#   kernel's error back to the line that caused it (for debugging only).
# - The CPU wins on small tensors (no launch overhead), the GPU on large ones
#   (bandwidth and FLOP/s); a measured GPU curve places the crossing, a model
#   without one cannot (the launch cost varies).
# - In training loops, read values with `.item()` once per epoch or per logging
#   interval, accumulate `loss.detach()`, and evaluate under `torch.no_grad()`.
# - Reductions are fastest over the contiguous dimension; the penalty for a
#   strided one depends on the device.
# - Compare achieved FLOP/s and bytes/s with the peaks: large matmuls approach
#   the compute roof, elementwise operations are bound by memory bandwidth.
# - State the thread count with every CPU timing.
#
# ## Exercises
#
# ### Exercise 2.1: time this workload correctly
#
# Write `measure(fn, sync)`: the time of one call of `fn()` in seconds, in the
# steady state. `fn` takes no arguments; it queues work on a device and
# returns at once, as a CUDA launch does, and its first call is slow. `sync()`
# waits until the device has finished everything queued (on a GPU you would
# pass `lambda: torch.cuda.synchronize(device)`). Any correct method passes: a
# loop, a median, a context-manager timer like `Benchmark`.
#
# The checker runs your function on a stand-in device like the `ToyStream`
# above - a thread that runs the queued work in order, for times the checker
# picks and changes between runs - and, on a machine with a GPU, on a real
# CUDA matmul. It names the mistakes of this chapter: a missing warm-up, a
# single run, a total instead of a per-call time, and a clock read before the
# device finished.

# %% tags=["exercise"] exercise="2.1"
def measure(fn, sync):
    ### BEGIN SOLUTION
    fn()
    sync()  # the warm-up call, and its work, are over before the clock starts
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        fn()
        sync()  # the work is done, not only queued
        times.append(time.perf_counter() - start)
    return statistics.median(times)
    ### END SOLUTION

# %% tags=["check"] exercise="2.1"
from course_utils.checks.ch02 import check_measure

check_measure(measure)

# %% [markdown]
# ### Exercise 2.2: log the loss without the traps
#
# Write `run_epoch(model, optimizer, batches, loss_fn)`: for each `(x, y)` in
# `batches`, take one training step with `loss = loss_fn(model(x), y)`, and
# return the mean loss of the epoch as a Python float. Read a value from the
# device only once, at the end, and do not keep earlier steps' graphs alive.

# %% tags=["exercise"] exercise="2.2"
def run_epoch(model, optimizer, batches, loss_fn):
    ### BEGIN SOLUTION
    total = 0.0
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total = total + loss.detach()
    return total.item() / len(batches)
    ### END SOLUTION

# %% tags=["check"] exercise="2.2"
from course_utils.checks.ch02 import check_run_epoch

check_run_epoch(run_epoch)

# %% [markdown]
# ### Exercise 2.3: time the stages with events, waiting once
#
# Section 2 timed the stages of a pipeline with the host's clock, which needs
# a wait at every stage boundary - and each wait stops Python from queueing
# the next stage while the device works. CUDA events avoid that: an event
# recorded between two stages is queued like a kernel and stamped by the
# device when it gets there, so the host can wait once and read every stage's
# time afterwards.
#
# Write `time_with_events(stages, new_event, sync, rounds=5)`. `stages` is a
# list of `(name, fn)` pairs to run in that order; each `fn()` queues its
# work on the device and returns at once, and its first call is slow.
# `new_event()` makes an event with `.record()` and `start.elapsed_time(end)`
# (milliseconds, and only once the device has reached both events);
# `sync()` waits for the device. Return `{name: seconds}`: each stage's own
# time per run, the median over `rounds` rounds after one warm-up round,
# waiting for the device at most twice per round. On a GPU you would call
# `time_with_events(stages, lambda: torch.cuda.Event(enable_timing=True),
# torch.cuda.synchronize)`.
#
# The checker runs pipelines of 2, 3 and 4 stages on a stand-in device whose
# worker thread stamps the events, with stage costs that change between calls
# and one slow round. It names the mistakes: a stage timed from the round's
# start, milliseconds as seconds, a total over rounds, no warm-up, a mean, a
# wait at every boundary, and events read too early.

# %% tags=["exercise"] exercise="2.3"
def time_with_events(stages, new_event, sync, rounds=5):
    ### BEGIN SOLUTION
    times = {name: [] for name, _ in stages}
    for r in range(rounds + 1):  # round 0 is the warm-up
        events = [new_event() for _ in range(len(stages) + 1)]
        events[0].record()
        for (_, fn), end in zip(stages, events[1:], strict=True):
            fn()
            end.record()  # queued behind the stage's work: no wait here
        sync()  # once per round
        if r > 0:
            for (name, _), start, end in zip(stages, events[:-1], events[1:],
                                             strict=True):
                times[name].append(start.elapsed_time(end) / 1e3)  # ms -> s
    return {name: statistics.median(ts) for name, ts in times.items()}
    ### END SOLUTION

# %% tags=["check"] exercise="2.3"
from course_utils.checks.ch02 import check_time_with_events

check_time_with_events(time_with_events)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | asynchronous execution | 异步执行 |
# | synchronize | 同步 |
# | kernel launch | 内核启动 |
# | stream (launch queue) | 流（启动队列） |
# | warm-up | 预热 |
# | median / interquartile range | 中位数 / 四分位距 |
# | CUDA event | CUDA 事件 |
# | pipeline stage | 流水线阶段 |
# | device-side assertion | 设备端断言 |
# | overflow / infinity | 溢出 / 无穷大 |
# | computation graph | 计算图 |
# | contiguous / stride | 连续 / 步长 |
# | throughput / peak | 吞吐量 / 峰值 |
# | arithmetic intensity | 计算强度（算术强度） |
# | memory bandwidth | 内存带宽 |
# | roofline model | 屋顶线模型 |
# | thread | 线程 |
