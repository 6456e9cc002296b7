"""Checkers for Chapter 4 (parallelism on the CPU).

4.1 checks the chunks' property (contiguous, covering, sizes within one) on
uneven sizes; 4.2 runs the learner's ``parallel_map`` with a task that only
completes when exactly the asked number of worker processes run it at once,
and that finishes out of order; 4.3 feeds tasks whose CPU time is known
exactly (spinning on the thread's own CPU clock), so the verdicts do not
depend on how busy the machine is.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import psutil

from course_utils.exercises import call_learner, fail, passed, require_solution

# ---------------------------------------------------------------- exercise 4.1

CHUNK_CASES = [(10, 3), (100_003, 4), (12, 4), (7, 7), (101, 6), (5, 8), (1, 1),
               (0, 3), (1000, 1), (23, 5)]


def check_chunk_bounds(chunk_bounds) -> None:
    ex = "4.1"
    require_solution(ex, chunk_bounds)
    for n, parts in CHUNK_CASES:
        got = call_learner(ex, chunk_bounds, n, parts)
        try:
            bounds = [(int(a), int(b)) for a, b in got]
        except (TypeError, ValueError):
            fail(ex, "a list of (start, stop) pairs", f"{type(got).__name__}: "
                 f"{got!r:.80}", "return [(start, stop), ...], one pair per chunk")
        case = f"n={n}, parts={parts}"
        if len(bounds) != parts:
            fail(ex, f"{parts} chunks for {case}", f"{len(bounds)} chunks",
                 "one chunk per worker, even when some are empty (n < parts)")
        if bounds[0][0] != 0:
            fail(ex, f"the first chunk to start at 0 ({case})", str(bounds[0]))
        for k in range(1, parts):
            if bounds[k][0] != bounds[k - 1][1]:
                what = "overlaps" if bounds[k][0] < bounds[k - 1][1] else "leaves a gap"
                fail(ex, f"chunk {k} to start where chunk {k - 1} stops ({case})",
                     f"{bounds[k - 1]} then {bounds[k]}: it {what}",
                     "each element must be in exactly one chunk")
        if bounds[-1][1] != n:
            fail(ex, f"the last chunk to stop at n = {n} ({case})", str(bounds[-1]),
                 "the remainder n % parts must go somewhere")
        sizes = [b - a for a, b in bounds]
        if min(sizes) < 0:
            fail(ex, f"chunks with start <= stop ({case})", str(bounds))
        if max(sizes) - min(sizes) > 1:
            fail(ex, f"chunk sizes that differ by at most 1 ({case})",
                 f"sizes {sizes}",
                 "spread the remainder one element at a time, not all on one chunk: "
                 "the largest chunk sets the pool's time")
    passed(ex, "Contiguous, covering and balanced, down to n < parts.")


# ---------------------------------------------------------------- exercise 4.2

_BARRIER = None  # set by the checker before the call; inherited by forked workers
_PARENT = None
_MET = False  # per process: has this worker met the others yet?


def _square_in_a_worker(x):
    """x * x and this process's pid; the first call in each worker waits for
    the others, so it only completes with the asked number of workers."""
    global _MET
    if os.getpid() == _PARENT:
        raise RuntimeError("ran in the notebook's own process, not in a worker")
    if _BARRIER is not None and not _MET:
        _BARRIER.wait(timeout=5)
        _MET = True
    if x == 0:
        time.sleep(0.3)  # the first item finishes last: order is not free
    return x * x, os.getpid()


def _run_with_timeout(ex, fn, args, seconds):
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # reported below, in the notebook's thread
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fail(ex, f"parallel_map to finish within {seconds} s",
             "it is still running", "wait with a timeout, and close the pool")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _children_gone(timeout=5.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        # multiprocessing's own servers stay by design (the course's pools start
        # their workers from a forkserver); their workers must not
        left = [p for p in psutil.Process().children(recursive=True)
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and not any(server in " ".join(p.cmdline()) for server in
                            ("resource_tracker", "multiprocessing.forkserver"))]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def check_parallel_map(parallel_map) -> None:
    global _BARRIER, _PARENT, _MET
    ex = "4.2"
    require_solution(ex, parallel_map)
    for items, processes in ((list(range(23)), 3), (list(range(0, 40, 3)), 2)):
        _BARRIER = mp.get_context("fork").Barrier(processes)
        _PARENT, _MET = os.getpid(), False
        try:
            result = _run_with_timeout(
                ex, lambda items=items, processes=processes: call_learner(
                    ex, parallel_map, _square_in_a_worker, items, processes), (), 60)
        except AssertionError as e:  # call_learner's friendly failure
            text = str(e)
            if "BrokenBarrier" in text:
                fail(ex, f"{processes} worker processes working at once",
                     "fewer or more than that (the workers never all met)",
                     "start exactly `processes` workers, and give each some items")
            if "notebook's own" in text:
                fail(ex, "the work done in worker processes",
                     "it ran in the notebook's process (serially, or in threads)",
                     "threads share this process; use multiprocessing.Pool or a "
                     "ProcessPoolExecutor")
            raise
        finally:
            _BARRIER, _PARENT = None, None
        try:
            pairs = list(result)
            values = [v for v, _ in pairs]
        except (TypeError, ValueError):
            fail(ex, "a list of fn(item) results", f"{type(result).__name__}: "
                 f"{result!r:.80}", "return the results, not the pool or an iterator "
                 "of something else")
        expected = [x * x for x in items]
        if sorted(values) == sorted(expected) and values != expected:
            fail(ex, "the results in the order of the items", f"{values[:6]} ...",
                 "imap_unordered and as_completed give results as they finish; "
                 "map keeps the order")
        if values != expected:
            fail(ex, f"[fn(x) for x in items] = {expected[:6]} ...",
                 f"{values[:6]} ... ({len(values)} results for {len(items)} items)",
                 "every item exactly once: check the last chunk")
        left = _children_gone()
        if left:
            for p in left:
                p.kill()
            fail(ex, "no worker left running after parallel_map returns",
                 f"{len(left)} process(es) still alive",
                 "use `with Pool(...) as pool:` (or close and join it)")
    passed(ex, "The right results, in order, from the asked number of workers.")


# ---------------------------------------------------------------- exercise 4.3


def _spin(seconds: float) -> None:
    """Use `seconds` of this thread's CPU time, however busy the machine is."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _sleeps():
    time.sleep(0.3)


def _spins_here():
    _spin(0.25)


def _spins_in_a_thread():
    t = threading.Thread(target=_spin, args=(0.25,))
    t.start()
    t.join()


def _spins_in_two_threads():
    ts = [threading.Thread(target=_spin, args=(0.15,)) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


CPU_CASES = [  # task, cpu seconds it uses (at least), wall seconds it takes (at least)
    (_sleeps, 0.0, 0.3, "sleeps 0.3 s"),
    (_spins_here, 0.25, 0.25, "computes for 0.25 s in the calling thread"),
    (_spins_in_a_thread, 0.25, 0.25, "computes for 0.25 s in another thread"),
    (_spins_in_two_threads, 0.30, 0.15, "computes 0.15 s in each of two threads"),
]


def check_cpu_and_wall(cpu_and_wall) -> None:
    ex = "4.3"
    require_solution(ex, cpu_and_wall)
    for task, cpu_min, wall_min, what in CPU_CASES:
        got = call_learner(ex, cpu_and_wall, task)
        try:
            cpu, wall = (float(v) for v in got)
        except (TypeError, ValueError):
            fail(ex, "(cpu_seconds, wall_seconds), two numbers", f"{got!r:.80}")
        if not 0.95 * wall_min <= wall <= 30:
            fail(ex, f"wall time of at least {wall_min} s for a task that {what}",
                 f"{wall:.3g}", "wall time is a clock on the wall: time.perf_counter() "
                 "before and after (in seconds)")
        if cpu_min == 0 and cpu > 0.1:
            fail(ex, "about 0 CPU seconds for a task that sleeps",
                 f"{cpu:.3g}", "a sleeping thread uses no CPU: that clock is "
                 "time.process_time(), not a wall clock")
        if cpu_min and cpu < 0.9 * cpu_min:
            hint = ("count every thread of the process: time.process_time(), not "
                    "time.thread_time()" if "thread" in what else
                    "CPU seconds: time.process_time() before and after")
            fail(ex, f"at least {cpu_min} CPU seconds for a task that {what}",
                 f"{cpu:.3g}", hint)
        if cpu > 30:
            fail(ex, "CPU seconds, in seconds", f"{cpu:.3g}",
                 "convert nanoseconds to seconds")
    passed(ex, "CPU and wall time, measured whatever the machine's load.")
