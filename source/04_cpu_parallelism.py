# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 4: Parallelism on the CPU
#
# **What you will learn**
#
# - What a process and a thread share, and what each costs to start; what it
#   costs to send data to another process (pickling).
# - The GIL, measured: which work runs in parallel in threads, and which does
#   not - read from CPU seconds against wall seconds, whatever the machine's load.
# - Seed 000's serial / `Pool` / `Process` experiment, with its timing bugs fixed,
#   and the one result that beats them all: a vectorised line.
# - `concurrent.futures`, chunk sizes, start methods (fork, spawn, forkserver) in
#   a notebook, and `torch.multiprocessing`: tensors shared, not copied.
# - torch's own threads (intra-op) against processes, and what happens when
#   processes x threads exceeds the cores.
#
# **Hardware.** None needed: everything here runs for real on the CPU you have.
# A 2-core laptop cannot show scaling to many cores; where that matters, the
# chapter adds a labelled prediction for a larger machine.

# %%
import concurrent.futures as cf
import importlib
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
import warnings

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils import banner, reference
from course_utils.bench import format_seconds
from course_utils.checks.ch04 import (
    check_busy_cores,
    check_parallel_apply_,
    check_process_map,
)
from course_utils.cleanup import scratch_folder, tidy_up
from course_utils.compare import compare
from course_utils.devices import usable_cores
from course_utils.dist import pool, pool_initializer

banner()
CORES = usable_cores()
print(f"usable cores: {CORES}")

# %% [markdown]
# ## 1. Processes and threads
#
# A **process** has its own memory: its own Python interpreter, its own
# objects. Two processes share nothing unless they ask (a pipe, a file, shared
# memory). A **thread** lives inside a process and shares all of its memory with
# the process's other threads: no copying, but also no protection - two threads
# can change the same object at once.
#
# Starting one costs something. On Linux a new process is usually **forked**:
# a copy of this one, made cheap by sharing memory pages until one side writes
# to them. A thread is cheaper still. A `Pool` starts several processes at once
# and keeps them for many tasks. We measure each with the course's comparison
# protocol, `compare` from `course_utils.compare`, which every timing in the
# course uses from here on: the options run in turns (A B A B ...), each run
# records its wall seconds and the CPU seconds of every process and thread
# that worked for it, and the machine's own counters tell how many cores
# *other* programs used meanwhile and whether any task had to wait for a core
# (Linux's CPU pressure). Its verdict is "faster", "slower", "the same within
# noise", or "disturbed: another program used the cores - run again" (other
# programs ran and some task waited); a disturbed timing is shown as a range,
# not one number.

# %%
def noop():
    pass


def fastest(make, tries=5):
    """The fastest of `tries` runs of make(): one cost, with less noise."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        make()
        best = min(best, time.perf_counter() - t0)
    return best


def start_thread():
    t = threading.Thread(target=noop)
    t.start()
    t.join()


def start_process():
    p = mp.get_context("fork").Process(target=noop)
    p.start()
    p.join(timeout=10)


def start_pool(workers):
    def create_map_close():
        with pool(workers, method="fork") as p:  # forked: children of this process
            p.map_async(abs, range(workers)).get(timeout=60)
    return create_map_close


startup = compare({"thread (start + join)": start_thread,
                   "forked process (start + join)": start_process}, repeats=3)
print(startup)
POOL_SIZES = [1, 2, 4]
pool_startup = compare({f"pool of {n} (create, map, close)": start_pool(n)
                        for n in POOL_SIZES}, repeats=3, number=1)
print(pool_startup)
start_s = np.array([o.median for o in pool_startup.options])
sizes_n = np.array(POOL_SIZES)
per_worker, fixed = np.polyfit(sizes_n, start_s, 1)  # a straight line
if fixed < 0:  # impossible: the noise is larger than the fixed part; fit b alone
    per_worker, fixed = sizes_n @ start_s / (sizes_n @ sizes_n), 0.0
if pool_startup.disturbed or per_worker <= 0:  # a line through noise says nothing
    fixed = per_worker = None
    print("no start-up line: the runs were disturbed, or the time did not grow "
          "with the workers - run this cell again")
else:
    print(f"a pool's start-up here: about {format_seconds(fixed)} + "
          f"{format_seconds(per_worker)} per worker")

# %% [markdown]
# Read the verdicts: a process is many times dearer than a thread (the first
# table says how many here, or that another program disturbed the runs). That
# is cheap for a task of a second, and ruinous for a task of a microsecond. A
# pool's start-up is no constant either: it forks every worker, so it grows
# with the number of workers, about linearly (the fitted line above).
#
# **Sending data** to a process can cost more than starting it: arguments and
# results cross the process boundary as bytes, made by `pickle`. The time
# grows with the payload, and both sides pay it (one to pickle, one to
# unpickle). A thread would just pass a reference.

# %%
payload_sizes = [10**3, 10**5, 10**6, 10**7]
pickling = []
for n in payload_sizes:
    arr = np.random.default_rng(0).integers(1, 7, n)
    t = fastest(lambda arr=arr: pickle.loads(pickle.dumps(arr)), tries=3)
    pickling.append(t)
    print(f"{arr.nbytes / 1e6:8.3f} MB: pickle + unpickle {format_seconds(t):>10} "
          f"({arr.nbytes / t / 1e9:.2f} GB/s)")

# %% [markdown]
# So a worker pays, per task, the pickling of its argument and of its result
# on top of the work. Torch tensors can avoid it: `tensor.share_memory_()`
# moves a tensor to shared memory, and a forked worker that writes into it
# writes where the parent reads - no copy in either direction:

# %%
shared = torch.zeros(8).share_memory_()


def fill(rank, out):
    out[rank * 4:(rank + 1) * 4] = rank + 1  # each worker writes its own half


workers = [mp.get_context("fork").Process(target=fill, args=(r, shared))
           for r in range(2)]
for w in workers:
    w.start()
for w in workers:
    w.join(timeout=10)
print("written by two processes, read here without a copy:", shared.tolist())

# %% [markdown]
# ## 2. The GIL, measured
#
# CPython runs Python bytecode in one thread at a time: a thread must hold the
# **global interpreter lock** (GIL) to run it. So threads that run Python code
# take turns. But a thread that waits (for I/O, a sleep, a lock) releases the
# GIL, and so do extensions that do long work in C without touching Python
# objects - torch's operators, most of numpy's. Three kinds of task, four of
# each, on 1 and on 2 threads. For each run the cell prints the wall time and
# the **CPU seconds** the process used: CPU seconds / wall seconds is how many
# cores were busy on average. That tells whether work ran in parallel at all,
# whatever else the machine was doing.

# %%
def python_loop():
    total = 0
    for i in range(300_000):
        total += i * i
    return total


A = torch.randn(256, 256)


def torch_matmuls():
    for _ in range(20):
        A @ A


def wait():
    time.sleep(0.05)


def run_in_threads(task, n_tasks, n_threads):
    """Run n_tasks calls of task on n_threads threads; (wall s, CPU s)."""
    per_thread = [n_tasks // n_threads + (i < n_tasks % n_threads)
                  for i in range(n_threads)]

    def worker(k):
        for _ in range(k):
            task()

    threads = [threading.Thread(target=worker, args=(k,)) for k in per_thread]
    w0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - w0, time.process_time() - c0


torch_threads = torch.get_num_threads()
torch.set_num_threads(1)  # one core per matmul: threads are the only parallelism
try:
    for name, task in (("pure-Python loop", python_loop),
                       ("torch matmul (releases the GIL)", torch_matmuls),
                       ("waiting (sleep)", wait)):
        print(f"4 tasks of: {name}")
        print(compare({"1 thread": lambda task=task: run_in_threads(task, 4, 1),
                       "2 threads": lambda task=task: run_in_threads(task, 4, 2)},
                      repeats=3), end="\n\n")
finally:
    torch.set_num_threads(torch_threads)

# %% [markdown]
# Read the *busy cores* column, not only the verdict. The pure-Python loop
# keeps about one core busy however many threads run it: the GIL lets one
# thread at a time run bytecode, so two threads cannot be faster, and
# switching between them can make them slower. The matmuls can keep two cores
# busy, as torch releases the GIL inside its operators - if a second core is
# free: when another program holds it, the verdict says "disturbed" rather
# than report a speed-up or a slow-down that the GIL did not cause. The sleeps
# use almost no CPU, and their waits overlap on any machine.
#
# Python 3.13 and 3.14 come in an optional **free-threaded** build
# (`python3.13t`) with no GIL, in which the pure-Python row would run in
# parallel too. It is new, slower for single-threaded code, and many
# extensions do not support it yet; the usual CPython has the GIL.
#
# ## 3. Seed 000's experiment, done right
#
# The seed squares every element of an array of dice rolls with a Python loop,
# and compares running it serially, in a `Pool`, and in one `Process` per
# chunk, for sizes up to a million. Its code has three timing bugs:
#
# 1. the `Pool` timer starts *inside* `with Pool(...)`: creating the workers,
#    a large part of the cost, is never timed;
# 2. its `Process` version throws the results away (a `Process` returns
#    nothing), so it times work whose results nobody can use;
# 3. `np.split(lst, sp)` raises unless the size divides evenly:
#    `np.array_split` (or the chunking of Exercise 4.2) handles any size.
#
# Below, every version returns its result, is checked equal to the serial
# one, and is timed with everything it needs, pool creation included (start-up
# alone was measured in section 1).

# %%
def square_loop(chunk):
    """The seed's workload: square each element with a Python loop."""
    out = np.zeros_like(chunk)
    for i in range(chunk.shape[0]):
        out[i] = chunk[i] ** 2
    return out


def run_serial(data, parts):
    return square_loop(data)


def run_pool(data, parts):
    with pool(parts, method="fork") as p:
        return np.concatenate(p.map_async(square_loop,
                                          np.array_split(data, parts)).get(60))


def _process_worker(index, chunk, results):
    results.put((index, square_loop(chunk)))


def run_processes(data, parts):
    """One Process per chunk; results come back through a queue."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=(i, c, results))
             for i, c in enumerate(np.array_split(data, parts))]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)  # read before join
    for p in procs:
        p.join(timeout=10)
    return np.concatenate([got[i] for i in range(parts)])


def run_vectorised(data, parts):
    return data ** 2


WAYS = {"serial": run_serial, "Pool": run_pool, "Process per chunk": run_processes,
        "vectorised (numpy)": run_vectorised}


def time_ways(n, parts=2, tries=2):
    data = np.random.default_rng(n).integers(1, 7, n)
    expected = data ** 2
    times = {}
    for way, run in WAYS.items():
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            out = run(data, parts)
            best = min(best, time.perf_counter() - t0)
            assert np.array_equal(out, expected), way  # same result, every way
        times[way] = best
    return times


sizes = [10**3, 10**4, 10**5, 10**6 + 3]  # the last does not split evenly
results = {}
for n in sizes[:-1]:
    results[n] = time_ways(n)
    print(f"n = {n:>9,}: " + ", ".join(f"{w} {format_seconds(t)}"
                                        for w, t in results[n].items()))
big_data = np.random.default_rng(0).integers(1, 7, sizes[-1])  # the largest size,
assert all(np.array_equal(run(big_data, 2), big_data ** 2) for run in WAYS.values())
big_run = compare({way: lambda run=run: run(big_data, 2) for way, run in WAYS.items()},
                  repeats=3, warmup=0)  # timed with the protocol
print(f"n = {sizes[-1]:,}:")
print(big_run)
results[sizes[-1]] = {o.label: o.median for o in big_run.options}

# %%
fig, ax = plt.subplots(figsize=(6.8, 4.0))
for way in WAYS:
    ax.plot(sizes, [results[n][way] for n in sizes], marker="o", label=way)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("array size n")
ax.set_ylabel("time, everything included (s)")
ax.set_title(f"Squaring n numbers, {CORES} usable cores, 2 workers")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
plt.show()

big = results[sizes[-1]]
small = results[sizes[0]]
print(f"n = {sizes[0]:,}: the Pool took {small['Pool'] / small['serial']:.0f}x the "
      "serial time (start-up dominates)")
print(f"at n = {sizes[-1]:,}, against the serial loop (at most {min(CORES, 2)}x is "
      "possible with 2 workers):", big_run.verdict, sep="\n")

# %% [markdown]
# The seed concludes that many light tasks call for `Process` and heavy ones
# for `Pool`. The measurement says something simpler. A `Pool` and a
# `Process` per chunk do the same thing here (start workers, send chunks,
# collect results), so they cost about the same; both lose to the serial loop
# for small sizes, where starting processes costs more than the work, and for
# large sizes they can win - at best by the number of workers, less the
# start-up and the pickling (the verdict above says what happened here). What
# really matters is the vectorised line: **tens to hundreds of times faster**
# than the serial loop (the line above says how much here), on one core. The
# bottleneck was never the number of cores, but the interpreter
# executing one bytecode after another for every element; numpy runs one
# compiled loop (with SIMD, Chapter 1). Parallelise *after* vectorising, and
# only work that is still slow.
#
# (Where a `Process` per task *is* the right tool: a few long-lived, different
# jobs - a data loader, a server - not many small pieces of the same work.)
#
# A 2-core laptop cannot show how the pool scales. A simple model can: the
# pool's time is its start-up, the pickling of the data, and the serial work
# divided among the workers. The start-up is not a constant: section 1
# measured it for 1, 2 and 4 workers and fitted a line, `a + b N`, so
# `t(N) = a + b N + t_pickle + t_serial / N`. More workers divide the work but
# cost more to start, so the time has a minimum, at `N = sqrt(t_serial / b)`.
# Every input is measured here, and the model is fitted only on quiet runs;
# the prediction is for a 16-core machine like this one (same speed per core,
# same start-up per worker).

# %%
t_serial = big["serial"]
t_pickle = pickling[-1] * (sizes[-1] * 8 / (payload_sizes[-1] * 8))  # data there and back
workers_axis = [1, 2, 4, 8, 16]
if per_worker is None or big_run.disturbed:  # a model of noise predicts noise
    print("no prediction: section 1 fitted no start-up line, or the serial time "
          "above was disturbed; run them again")
else:
    model = [fixed + per_worker * n + t_pickle + t_serial / n for n in workers_axis]
    pred = reference.predicted(
        {"x": workers_axis, "y": model}, "s", "a 16-core CPU like this one",
        "t(N) = a + b N (pool start-up, fitted in section 1) + pickling + serial "
        f"time / N, each measured here (a {format_seconds(fixed)}, b "
        f"{format_seconds(per_worker)} per worker, pickling "
        f"{format_seconds(t_pickle)}, serial {format_seconds(t_serial)})")
    print(f"{pred.legend}: " + ", ".join(
        f"{n} workers {format_seconds(t)}" for n, t in zip(workers_axis, model,
                                                           strict=True)))
    print(f"the model's best number of workers: about "
          f"{(t_serial / per_worker) ** 0.5:.0f}; with 16 workers at most "
          f"{t_serial / model[-1]:.1f}x the serial loop, while the vectorised line "
          f"was {t_serial / big['vectorised (numpy)']:.0f}x")

# %% [markdown]
# ### Try it: how big must the work be?
#
# Drag the slider to change the array size (powers of ten, from a thousand to
# half a million). The plot redraws serial, `Pool` and vectorised times at
# that size, measured now through the protocol: the bars are medians, the
# whiskers each option's range, and the verdicts compare each with serial.

# %%
def compare_at(exponent=4.0):
    n = int(10**exponent)
    data = np.random.default_rng(1).integers(1, 7, n)
    ways = ("serial", "Pool", "vectorised (numpy)")
    run = compare({w: lambda w=w: WAYS[w](data, 2) for w in ways}, repeats=3,
                  min_run_s=0.05)
    medians = [run[w].median for w in ways]
    spread = [[m - run[w].low for w, m in zip(ways, medians, strict=True)],
              [run[w].high - m for w, m in zip(ways, medians, strict=True)]]
    fig, ax = plt.subplots(figsize=(5.6, 2.8))
    ax.barh(ways, medians, xerr=spread, color=["tab:blue", "tab:orange", "tab:red"])
    ax.set_xscale("log")
    ax.set_xlabel("seconds per call (log scale)")
    ax.set_title(f"n = {n:,}")
    plt.tight_layout()
    plt.show()
    print(run.verdict)


widgets.interact(compare_at, exponent=widgets.FloatSlider(
    min=3, max=5.7, step=0.1, value=4.0, description="log10 n",
    continuous_update=False));

# %% [markdown]
# ## 4. `concurrent.futures` and the chunk size
#
# `concurrent.futures` offers the same two tools behind one interface:
# `ThreadPoolExecutor` and `ProcessPoolExecutor`, with `map` and `submit`
# (which returns a *future* whose `result(timeout=...)` waits for it). A
# process pool sends work in **chunks**: with `chunksize=1` every tiny task
# pays a round trip to a worker; larger chunks amortise it.

# %%
tiny = list(range(3000))


def time_map(executor, chunksize):
    t0 = time.perf_counter()
    out = list(executor.map(abs, tiny, chunksize=chunksize, timeout=60))
    assert out == tiny
    return time.perf_counter() - t0


fork = mp.get_context("fork")
with cf.ProcessPoolExecutor(2, mp_context=fork, initializer=pool_initializer,
                            initargs=(os.getpid(),)) as ex, \
        cf.ThreadPoolExecutor(2) as threads:
    time_map(ex, 1000)  # start the workers
    chunks = compare({f"processes, chunksize {c}": lambda c=c: time_map(ex, c)
                      for c in (1000, 100, 1)}
                     | {"threads (no pickling)": lambda: time_map(threads, 1)},
                     repeats=3)  # the workers' CPU seconds count too
print(chunks)

# %% [markdown]
# ## 5. Start methods, in a notebook
#
# A worker process starts in one of three ways:
#
# - **fork** (the Linux default up to Python 3.13): a copy of this process,
#   with everything defined in it - including functions defined in this
#   notebook. Fast. But a fork copies the state of libraries too: once this
#   process has run a multi-threaded torch operation, a forked child that runs
#   one may hang for ever (GNU OpenMP is not fork-safe). The fix for forked
#   workers: one torch thread each (`torch.set_num_threads(1)` in the
#   worker's initializer). From Python 3.12, `os.fork()` in a process that
#   runs several threads (a Jupyter kernel always does) emits a
#   `DeprecationWarning` saying the child may deadlock, for the same reason:
#   a lock held by another thread at the fork stays locked in the child for
#   ever. And a forked child cannot use CUDA once the parent has: the
#   driver's state does not survive a fork, and torch refuses with "Cannot
#   re-initialize CUDA in forked subprocess".
# - **spawn** (the default on macOS and Windows): a fresh Python that
#   *imports* what it must run. A function defined in a notebook lives in
#   `__main__`, which the fresh Python does not have: the worker fails to find
#   it.
# - **forkserver** (the Linux default from Python 3.14): workers forked from a
#   clean server process, started fresh, so nothing this notebook did reaches
#   them - but, like spawn, it cannot find a notebook function by name. The
#   course's `course_utils.dist.pool` and `launch` use a forkserver and send
#   the function itself, by value (`cloudpickle`), so notebook functions work
#   and workers may run several threads.
#
# Watch spawn fail, safely: `ProcessPoolExecutor` notices its workers dying
# and raises at once (a plain `Pool.map` would wait for ever). The red text
# under the cell is the dying worker's own traceback: it cannot find `cube`
# in its `__main__`.

# %%
def cube(x):
    return x**3


try:
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        print(ex.submit(cube, 3).result(timeout=60))
except Exception as e:  # noqa: BLE001 - we show whatever the platform raises
    print(f"spawn with a notebook function: {type(e).__name__}: {e}")

# %% [markdown]
# The fix is to put the function in a module, a `.py` file that the fresh
# Python can import:

# %%
module_dir = scratch_folder("ch04_")  # removed with the chapter, however it ends
(module_dir / "ch04_tasks.py").write_text(
    "import torch\n\n\ndef cube(x):\n    return x ** 3\n\n\ndef add_one_(t):\n"
    "    t += 1\n    if t.is_cuda:\n        torch.cuda.synchronize()\n")
sys.path.insert(0, str(module_dir))
ch04_tasks = importlib.import_module("ch04_tasks")
with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
    print("spawn with an imported function:", ex.submit(ch04_tasks.cube, 3).result(
        timeout=60))

# %% [markdown]
# Does this Python warn about forking a threaded process? It counts this
# process's threads and forks once, recording warnings:

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start_process()
fork_warnings = [str(w.message) for w in caught if w.category is DeprecationWarning]
print(f"Python {sys.version.split()[0]}, {threading.active_count()} Python threads "
      f"here: {fork_warnings[0] if fork_warnings else 'no warning from this fork'}")

# %% [markdown]
# ## 6. `torch.multiprocessing`: tensors in shared memory
#
# `torch.multiprocessing` is `multiprocessing` with one addition: a tensor
# sent to another process (a `Process` argument under spawn or forkserver, or
# a `Queue` item) is not pickled byte by byte. The sender moves its storage to
# shared memory, in place, and the receiver maps the same memory. So the
# copy costs nothing whatever the size, and a change the child makes in place
# is seen by the parent. A forked child takes a tensor from a
# `torch.multiprocessing` queue and adds one to it:

# %%
import torch.multiprocessing as tmp  # noqa: E402 - introduced here


def add_one_from(tensors):
    t = tensors.get(timeout=60)
    t += 1  # in place, in the child


counts = torch.zeros(4)
fork_ctx = tmp.get_context("fork")
tensors = fork_ctx.Queue()
child = fork_ctx.Process(target=add_one_from, args=(tensors,))
child.start()
tensors.put(counts)  # moves counts to shared memory; sends a handle to it
child.join(timeout=60)
print(f"after the child's `t += 1`, the parent reads {counts.tolist()} "
      f"(moved to shared memory: {counts.is_shared()})")

# %% [markdown]
# CUDA tensors travel the same way (CUDA IPC: the child maps the parent's GPU
# memory), with two rules from torch's documentation: the start method must
# be spawn or forkserver (never fork, see above), and the sender must keep the
# tensor alive for as long as the receiver uses it. With a GPU, a spawned
# child (running `add_one_` from the module above) adds one to a tensor in
# the parent's GPU memory:

# %%
if torch.cuda.is_available():
    on_gpu = torch.zeros(4, device="cuda")
    child = tmp.get_context("spawn").Process(target=ch04_tasks.add_one_,
                                             args=(on_gpu,))
    child.start()
    child.join(timeout=120)  # on_gpu stays alive here until the child has ended
    print(f"GPU tensor after the child: {on_gpu.tolist()} (child's exit code "
          f"{child.exitcode})")
else:
    print("no GPU here: the CUDA case is not run")

# %% [markdown]
# ## 7. torch's own threads, and processes x threads
#
# torch parallelises *inside* one operation (**intra-op** parallelism): a
# large matmul is split over `torch.get_num_threads()` threads. Processes are
# a second level on top. Each level wants the cores for itself: N processes
# with M threads each should keep `N x M` at or below the number of cores,
# or they fight over them (that is why the launcher and the pools here give
# each worker one thread). The matmul below runs with 1 to all usable cores.

# %%
M = torch.randn(768, 768)


def matmul_on(k):
    def run():
        torch.set_num_threads(k)
        M @ M
    return run


saved = torch.get_num_threads()
try:
    print(compare({f"{k} thread{'s' if k > 1 else ''}": matmul_on(k)
                   for k in range(1, CORES + 1)}, repeats=3))
finally:
    torch.set_num_threads(saved)

# %% [markdown]
# Now the two levels together. Two pool workers multiply matrices at once:
# first with `CORES / 2` torch threads each (processes x threads = the
# cores), then with 4 times as many (oversubscribed). Each worker reports the
# CPU seconds it used, so the table's busy cores count them.

# %%
def matmul_task(threads):
    torch.set_num_threads(threads)
    a = torch.randn(384, 384)
    for _ in range(12):
        a @ a


fit = max(1, CORES // 2)
with pool(2, threads=4 * fit) as workers:  # its workers' CPU seconds count as ours
    oversubscribed = compare({
        f"2 processes x {k} thread(s)": lambda k=k: workers.map_async(
            matmul_task, [k, k], chunksize=1).get(timeout=60)
        for k in (fit, 4 * fit)}, repeats=3)
print(oversubscribed)
print({"slower": "oversubscribed: slower, the threads fought over the cores",
       "same": "no difference measured here at this size",
       "faster": "oversubscribed ran faster here: the cores were not all busy"
       }.get(oversubscribed.outcome, "disturbed: no verdict, run again"))

# %% [markdown]
# Compare the busy cores of the two rows: both can keep at most the machine's
# cores busy, so four times the threads cannot add work done per second. What
# they add is waiting: torch's threads split each matmul and meet at the end
# of it, and a thread that the operating system has put aside holds up the
# others. The verdict above says whether that cost showed here.

# %% [markdown]
# ## Summary
#
# - Processes share nothing unless asked and cost milliseconds to start;
#   threads share everything and cost microseconds. Data sent to a process is
#   pickled both ways; shared memory avoids the copy.
# - The GIL lets one thread at a time run Python bytecode: threads speed up
#   waiting and C code that releases the GIL (torch, numpy), not Python loops.
#   CPU seconds / wall seconds tells which happened.
# - Time everything a method needs (pool creation included), keep the results,
#   and check them against the serial ones.
# - Vectorise first: for elementwise work it beats any number of processes.
# - In a notebook, fork works with notebook functions and spawn does not
#   (unless the function is sent by value, as the course's pools do); forked
#   workers should run one torch thread, and never CUDA. Python 3.12+ warns
#   when a threaded process forks.
# - `torch.multiprocessing` sends tensors through shared memory: a child's
#   in-place change is the parent's (CUDA tensors too, under spawn or
#   forkserver, while the sender keeps them alive).
# - Keep processes x threads at or below the cores: more threads add waiting,
#   not work.

# %% [markdown]
# ## Exercises
#
# ### Exercise 4.1: a process pool from primitives
#
# Write `process_map(fn, items, processes, timeout=60)`: `[fn(x) for x in
# items]`, computed by exactly `processes` worker processes that you start
# with `multiprocessing.Process` (not `Pool` or an executor), running at
# once. Each free worker takes the **next** item from one shared `Queue`, so
# a slow item does not hold up the others; results come back on another
# queue with their index, and are returned in the order of `items`. If `fn`
# raises, raise that error here. Never wait without a timeout, and leave no
# worker running when you return. The checker's `fn` reports the process
# that ran it; this process should block while it waits, not spin.

# %% tags=["exercise"] exercise="4.1"
def process_map(fn, items, processes, timeout=60):
    ### BEGIN SOLUTION
    ctx = mp.get_context("fork")
    tasks, done = ctx.Queue(), ctx.Queue()

    def work():
        while (task := tasks.get()) is not None:
            i, x = task
            try:
                done.put((i, True, fn(x)))
            except Exception as e:  # noqa: BLE001 - sent back to the caller
                done.put((i, False, e))

    workers = [ctx.Process(target=work, daemon=True) for _ in range(processes)]
    for w in workers:
        w.start()
    try:
        for task in enumerate(items):
            tasks.put(task)
        for _ in workers:
            tasks.put(None)  # one stop signal per worker
        results = {}
        for _ in range(len(items)):
            i, ok, value = done.get(timeout=timeout)
            if not ok:
                raise value
            results[i] = value
        return [results[i] for i in range(len(items))]
    finally:
        for w in workers:
            w.join(timeout=1)
            if w.is_alive():
                w.terminate()
                w.join(timeout=5)
    ### END SOLUTION


# %% tags=["check"] exercise="4.1"
check_process_map(process_map)

# %% [markdown]
# ### Exercise 4.2: a parallel update in shared memory
#
# Write `parallel_apply_(t, processes, fn)`: replace `t`, in place, by `fn`
# applied to `processes` contiguous chunks of its rows (dim 0), with sizes
# that differ by at most one (some empty when there are fewer rows than
# processes), each nonempty chunk computed by its own worker process, all at
# once. The workers write their results straight into `t`'s memory: nothing
# is sent back. `t` may be float64, float32 or int64, 1-D or 2-D.

# %% tags=["exercise"] exercise="4.2"
def parallel_apply_(t, processes, fn):
    ### BEGIN SOLUTION
    t.share_memory_()  # in place: forked workers now write where we read
    base, extra = divmod(t.shape[0], processes)
    bounds, start = [], 0
    for k in range(processes):
        stop = start + base + (k < extra)
        bounds.append((start, stop))
        start = stop

    def work(start, stop):
        t[start:stop] = fn(t[start:stop])

    ctx = mp.get_context("fork")
    workers = [ctx.Process(target=work, args=b) for b in bounds if b[1] > b[0]]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    if any(w.exitcode != 0 for w in workers):
        raise RuntimeError("a worker failed")
    ### END SOLUTION


# %% tags=["check"] exercise="4.2"
check_parallel_apply_(parallel_apply_)

# %% [markdown]
# ### Exercise 4.3: a busy-cores meter
#
# Every busy-cores figure in this chapter came from a meter. Write the small
# core of one: `busy_cores(fn)` calls `fn()` once and returns how many cores
# it kept busy on average while it ran, as a float: the CPU seconds this
# process used meanwhile (all its threads) plus those of the child processes
# it started and waited for, divided by the wall seconds of the call. Read
# the clocks just before and just after this call, keeping nothing from one
# call to the next. If `fn` raises, let its exception reach the caller. The
# checker gives your meter setups of its own (threads under the GIL, torch
# threads, sleeps, two processes) and compares with clocks it reads around
# `fn`; a setup whose answer is off while other programs held the cores runs
# again.

# %% tags=["exercise"] exercise="4.3"
def busy_cores(fn):
    ### BEGIN SOLUTION
    def cpu_s():  # this process's threads, and the children it waited for
        t = os.times()
        return time.process_time() + t.children_user + t.children_system

    cpu0, wall0 = cpu_s(), time.perf_counter()
    fn()
    return (cpu_s() - cpu0) / (time.perf_counter() - wall0)
    ### END SOLUTION


# %% tags=["check"] exercise="4.3"
check_busy_cores(busy_cores)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | process | 进程 |
# | thread | 线程 |
# | global interpreter lock (GIL) | 全局解释器锁 |
# | pool (of workers) | 进程池 |
# | pickling (serialisation) | 序列化（pickle） |
# | shared memory | 共享内存 |
# | start method (fork, spawn, forkserver) | 启动方式 |
# | chunk / chunk size | 分块 / 块大小 |
# | vectorisation | 向量化 |
# | intra-op parallelism | 算子内并行 |
# | CPU time / wall-clock time | CPU 时间 / 墙钟时间 |
# | free-threaded Python | 无 GIL 的 Python（自由线程） |

# %%
tidy_up()  # the last cell: the chapter's temporary folder goes
