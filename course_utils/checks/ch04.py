"""Checkers for Chapter 4 (parallelism on the CPU).

4.1 runs the learner's ``process_map`` (a pool written from ``Process`` and
``Queue``) on tasks that report the process that ran them, only complete when
the asked number of workers run at once, and include one slow item (a pool
that hands out the next item to a free worker gives the slow item's worker
few others); it checks order, pids, a failing task, the notebook process's
own CPU seconds against the wall time, and that no worker is left. 4.2 runs
the learner's ``parallel_apply_`` on float64, float32 and int64 tensors and
checks that every chunk was written in place by its own worker process, the
chunks balanced. 4.3 runs the learner's ``busy_cores(fn)`` on setups it
builds (threads under the GIL, torch threads, sleeps, child processes, one
thread half busy) and compares with the clocks it reads around ``fn`` itself;
each wrong number is matched against the rules of typical mistakes (one
thread's CPU, no children, a wall clock as CPU, state kept between calls) to
name the one made. Every call of learner code runs inside a
timeout; processes left behind are killed and reported.
"""

from __future__ import annotations

import multiprocessing
import numbers
import os
import resource
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import psutil
import torch

from course_utils.exercises import (
    ExerciseFailed,
    answer_limit,
    fail,
    passed,
    require_solution,
    slowdown,
)

_BEFORE: set[int] = set()  # children that were there before the check began


def _left_children(timeout=3.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        # multiprocessing's own servers stay by design (resource tracker,
        # forkserver); the learner's workers must not
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid in _BEFORE or p.status() == psutil.STATUS_ZOMBIE or any(
                        server in " ".join(p.cmdline()) for server in
                        ("resource_tracker", "multiprocessing.forkserver")):
                    continue
            except psutil.Error:
                continue
            left.append(p)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _kill(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=3)


def _guarded(ex: str, fn, *args, timeout: float | None = None):
    """Call the learner's code in a thread; on a timeout kill its processes.

    Returns ``(status, value, cpu_s, wall_s)``: status ``"value"`` or
    ``"error"`` (what the learner's code raised), and this process's CPU
    seconds (all its threads) and the wall seconds of the call."""
    out: dict = {}

    def target():
        try:
            value = fn(*args)
            # a lazy iterator runs the learner's code when read: read it here
            out["value"] = (list(islice(value, 10_000)) if isinstance(value, Iterator)
                            else value)
        except BaseException as e:  # noqa: BLE001 - reported in the caller's thread
            out["error"] = e

    timeout = timeout or answer_limit(ex)
    worker = threading.Thread(target=target, daemon=True)
    c0, w0 = time.process_time(), time.perf_counter()
    worker.start()
    worker.join(timeout)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if worker.is_alive():
        left = _left_children(0)
        _kill(left)
        fail(ex, f"your code to finish within {timeout:.0f} s",
             f"it was still running ({len(left)} process(es) killed)",
             "wait with timeouts; a worker that raises must still answer, and "
             "every worker needs a way to stop")
    if "error" in out:
        if isinstance(out["error"], ExerciseFailed):
            raise out["error"]
        return "error", out["error"], cpu, wall
    return "value", out["value"], cpu, wall


def _no_orphans(ex: str, case: str, wait_s: float = 3.0) -> None:
    left = _left_children(wait_s)
    if left:
        _kill(left)
        fail(ex, f"no worker left running when your function returns ({case})",
             f"{len(left)} process(es) still alive (now killed)",
             "send each worker a stop signal (or terminate it), then join it")


def _start_check() -> None:
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in psutil.Process().children(recursive=True))


def _raised(ex: str, e: BaseException) -> None:
    first = str(e).splitlines()[0] if str(e) else ""
    fail(ex, "your function to run", f"it raised {type(e).__name__}: {first:.100}",
         "fix that error and run the exercise cell again")


def _meet(meet_dir: str, expected: int, wait_s: float = 5.0) -> bool:
    """The first call in each process: wait until `expected` processes came."""
    me = Path(meet_dir) / str(os.getpid())
    if me.exists():
        return True
    me.touch()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if len(list(Path(meet_dir).iterdir())) >= expected:
            return True
        time.sleep(0.01)
    return False


def _in_a_library_pool() -> bool:
    return any(("multiprocessing/pool.py" in f.filename or
                "concurrent/futures/process.py" in f.filename)
               for f in traceback.extract_stack())


# ---------------------------------------------------------------- exercise 4.1


def pool_task(item):
    """x * x, with the pid that computed it, whether its worker met the others,
    and whether it ran under multiprocessing.Pool or a ProcessPoolExecutor."""
    x, meet_dir, expected, delay = item
    if x == "boom":
        _write(os.path.join(meet_dir, "boom_at"), repr(time.time()))
        raise ValueError("task failed on purpose")
    if x == "die":  # the worker dies without a word: only a timeout notices
        os._exit(3)
    met = _meet(meet_dir, expected)
    if delay == HOLD:
        _held(meet_dir)
    else:
        time.sleep(delay)
    return x * x, os.getpid(), met, _in_a_library_pool()


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _held(meet_dir: str) -> None:
    """Wait while the checker holds the items after a failing one: until it has
    looked for workers left running, or HOLD_S after the error at most (an
    answer that lets every task finish before it raises then still returns)."""
    while os.path.exists(os.path.join(meet_dir, "hold")):
        try:
            with open(os.path.join(meet_dir, "boom_at")) as f:
                if time.time() > float(f.read()) + HOLD_S:
                    return
        except (OSError, ValueError):  # the failing task has not run yet
            pass
        time.sleep(0.02)


MAP_CASES = [  # values, processes
    ([i * 1.5 - 7.25 for i in range(24)], 3),
    ([1e-300, -3.0, 2.5e150, 7.0, -0.125, 1e10, 3.0, -2.0, 0.0], 2),
    ([0.5, -1.5, 2.0], 4),  # fewer items than processes
    ([float(i) for i in range(-6, 6)], 2),
]
SLOW_S = 1.0
HOLD = "hold"  # the items after a failing one wait until the checker has looked
HOLD_S = 5.0  # or this long after the error: stray workers are busy when it looks
STRAY_WAIT_S = 0.5  # a terminated or joined worker is gone by then (quiet)
BIG_BYTES = 512 * 1024  # a result larger than a pipe's buffer (64 KiB on Linux)


def big_task(x):
    """A result of BIG_BYTES: its worker cannot exit until someone reads it."""
    return bytes([int(x) % 256]) * BIG_BYTES, os.getpid()


def check_process_map(process_map) -> None:
    ex = "4.1"
    require_solution(ex, process_map)
    _start_check()
    cpu_total = wall_total = 0.0
    for values, processes in MAP_CASES:
        case = f"{len(values)} items, {processes} processes"
        expected_workers = min(processes, len(values))
        meet_dir = tempfile.mkdtemp(prefix="ch04_meet_")
        try:
            judged = len(values) >= 4 * processes  # is the scheduling judged?
            items = [(v, meet_dir, expected_workers,
                      SLOW_S if i == 0 and judged else 0.0)
                     for i, v in enumerate(values)]
            status, got, cpu, wall = _guarded(ex, process_map, pool_task, items,
                                              processes)
        finally:
            shutil.rmtree(meet_dir, ignore_errors=True)
        if status == "error":
            _no_orphans(ex, case)
            _raised(ex, got)
        try:
            got = list(got)
            results = [r[0] for r in got]
            pids = [r[1] for r in got]
        except (TypeError, IndexError, KeyError):
            fail(ex, f"a list of fn(item) results ({case})", f"{got!r:.80}")
        if any(r[3] for r in got):
            fail(ex, f"a pool you wrote from Process and Queue ({case})",
                 "the tasks ran in multiprocessing.Pool or a ProcessPoolExecutor",
                 "start `processes` multiprocessing.Process workers that take items "
                 "from a Queue and put results on another")
        if os.getpid() in pids:
            fail(ex, f"every item computed in a worker process ({case})",
                 "some ran in this process (serially, or in threads)",
                 "threads share this process and its GIL; start Processes")
        want = [v * v for v in values]
        if len(results) != len(want):
            fail(ex, f"{len(want)} results ({case})", f"{len(results)}",
                 "every item exactly once")
        if results != want:
            hint = ("results in the order of the items, not as they finish: send "
                    "each item's index with it" if sorted(results) == sorted(want)
                    else "each result must be fn(item), computed once")
            fail(ex, f"[fn(x) for x in items] ({case})", f"{results[:5]} ...", hint)
        workers = set(pids)
        if len(workers) > processes:
            fail(ex, f"at most {processes} worker processes ({case})",
                 f"{len(workers)} different processes",
                 "start `processes` workers and let each take many items, not one "
                 "process per item")
        if not all(r[2] for r in got) or len(workers) < expected_workers:
            fail(ex, f"{expected_workers} workers running at once ({case})",
                 f"{len(workers)} process(es), not all of them at the same time",
                 "start every worker before waiting for results; use `processes`, "
                 "not a number of your own")
        slow_worker = pids[0]
        took = pids.count(slow_worker)
        if judged and took > max(3, len(values) // (2 * processes)):
            fail(ex, f"the slow first item's worker to take few other items ({case})",
                 f"it ran {took} of {len(values)} items while it was busy",
                 "a fixed share per worker (chunks, or every n-th item) leaves the "
                 "others idle: workers should take the next item from one shared "
                 "queue when they are free")
        if judged:
            cpu_total, wall_total = cpu_total + cpu, wall_total + wall
        _no_orphans(ex, case)
    # a process that blocks uses a few percent of a core while its workers
    # sleep; a polling loop uses what it gets (a share, on a busy machine)
    if cpu_total > max(0.3, 0.15 * wall_total):
        fail(ex, "this process to wait, not to spin",
             f"{cpu_total:.2f} CPU s in {wall_total:.2f} s of wall time",
             "block on queue.get(timeout=...) instead of polling in a loop")
    # results larger than a pipe holds: a worker that put one cannot exit until
    # it is read, so joining the workers before reading every result deadlocks
    values = [3.0, 7.0, 11.0, 13.0, 17.0, 19.0]
    deadlock = ("a worker that put a large result on a queue cannot exit until it "
                "is read: get every result first, then join the workers")
    try:
        status, got, _, wall = _guarded(ex, process_map, big_task, values, 2, 3,
                                        timeout=12)
    except ExerciseFailed:
        fail(ex, "6 results of 512 KiB in well under timeout=3 s",
             "still waiting after 12 s: a deadlock", deadlock)
    if status == "error":
        _no_orphans(ex, "results of 512 KiB")
        _raised(ex, got)
    _no_orphans(ex, "results of 512 KiB")
    if [r[0][:1] for r in got] != [bytes([int(v)]) for v in values]:
        fail(ex, "[fn(x) for x in items] for results of 512 KiB each",
             "other results", "each result must be fn(item), in the order of items")
    if wall >= 3:
        fail(ex, "6 results of 512 KiB in well under timeout=3 s",
             f"{wall:.1f} s: a join timed out first", deadlock)
    # a task that raises: the error reaches the caller, and nothing hangs; the
    # items after it are slow, so workers nobody stopped are still running
    meet_dir = tempfile.mkdtemp(prefix="ch04_meet_")
    _write(os.path.join(meet_dir, "hold"), "")
    try:
        items = [(v, meet_dir, 1, 0.0 if i < 2 else HOLD)
                 for i, v in enumerate((1.0, "boom", 3.0, 4.0, 5.0, 6.0))]
        status, got, _, _ = _guarded(ex, process_map, pool_task, items, 2)
        if status != "error":
            _no_orphans(ex, "a task that raises")
            fail(ex, "an error raised in the caller when a task raises",
                 f"it returned {got!r:.60}", "catch the exception in the worker, "
                 "send it back with the item's index, and raise it in process_map")
        _no_orphans(ex, "a task that raises (the workers still had slow items)",
                    STRAY_WAIT_S * max(1.0, slowdown()))
    finally:  # releases the held items of workers nobody stopped (now killed)
        shutil.rmtree(meet_dir, ignore_errors=True)
    chain = [got, got.__cause__, None if got.__suppress_context__ else got.__context__]
    if not any(isinstance(e, ValueError) or "failed on purpose" in str(e)
               for e in chain if e is not None):
        fail(ex, "the task's own error (ValueError: task failed on purpose)",
             f"{type(got).__name__}: {str(got):.60}", "send the exception the worker "
             "caught back with the item's index and raise that one, not a new one "
             "without it")
    # a worker that dies: waiting without a timeout would wait for ever
    meet_dir = tempfile.mkdtemp(prefix="ch04_meet_")
    try:
        items = [(v, meet_dir, 1, 0.0) for v in (1.0, "die", 3.0, 4.0)]
        try:
            status, got, _, _ = _guarded(ex, process_map, pool_task, items, 2, 2,
                                         timeout=15)
        except ExerciseFailed:
            fail(ex, "an error within about `timeout` s when a worker dies",
                 "still waiting after 15 s (timeout was 2 s)",
                 "never wait without a timeout: queue.get(timeout=timeout), "
                 "join(timeout=...)")
    finally:
        shutil.rmtree(meet_dir, ignore_errors=True)
    _no_orphans(ex, "a worker that dies")
    if status != "error":
        fail(ex, "an error when a worker dies and a result never comes",
             f"it returned {got!r:.60}", "a missing result is an error: let "
             "queue.get(timeout=timeout) raise")
    passed(ex, "Results in order, from the asked number of workers taking items as "
           "they free up, errors raised, nothing left running.")


# ---------------------------------------------------------------- exercise 4.2


class ChunkTask:
    """chunk * 2 + 1; records which process got which rows, and meets the others."""

    def __init__(self, log_dir: str, expected: int, wait_s: float = 5.0):
        self.log_dir, self.expected, self.wait_s = log_dir, expected, wait_s

    def __call__(self, chunk):
        met = (_meet(self.log_dir + "/meet", self.expected, self.wait_s)
               if chunk.numel() else True)
        rows = chunk.shape[0] if chunk.dim() else 1
        # a chunk of consecutive rows of a contiguous t is contiguous; every
        # n-th row (t[k::n]) is not
        gaps = int(rows > 1 and not chunk.is_contiguous())
        with open(Path(self.log_dir) / f"log_{os.getpid()}", "a") as f:
            f.write(f"{rows if chunk.numel() else 0} {int(met)} {gaps}\n")
        return chunk * 2 + 1


APPLY_CASES = [  # shape, dtype, processes
    ((1001,), torch.float64, 3),
    ((7, 5), torch.float32, 2),
    ((5,), torch.int64, 4),
    ((3, 2), torch.float64, 4),  # fewer rows than processes
    ((10,), torch.float32, 1),
]


def _logged(log_dir: str):
    calls = []
    for path in Path(log_dir).glob("log_*"):
        pid = int(path.name.split("_")[1])
        for line in path.read_text().splitlines():
            rows, met, gaps = line.split()
            calls.append((pid, int(rows), met == "1", gaps == "1"))
    return calls


def check_parallel_apply_(parallel_apply_) -> None:
    ex = "4.2"
    require_solution(ex, parallel_apply_)
    _start_check()
    g = torch.Generator().manual_seed(4)
    for shape, dtype, processes in APPLY_CASES:
        kind = str(dtype).replace("torch.", "")
        case = f"shape {shape}, {kind}, {processes} processes"
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g, dtype=torch.float64)
            t = (t * torch.logspace(-8, 8, t.numel(), dtype=torch.float64
                                    ).reshape(shape)).to(dtype)
        else:
            # beyond 2**53: a float64 copy of the int64 values loses their last bits
            t = torch.randperm(t_numel := int(torch.tensor(shape).prod()),
                               generator=g).reshape(shape) * 10**17 - t_numel
        original = t.clone()
        want = original * 2 + 1
        rows = shape[0]
        nonempty = min(processes, rows)
        log_dir = tempfile.mkdtemp(prefix="ch04_apply_")
        try:  # removed once the stray workers that may still log are killed
            os.makedirs(log_dir + "/meet")
            # workers that never all run at once (one after another, too few,
            # in this process) each give up waiting well within the time
            # limit, so the verdict names what they did instead of a timeout
            task = ChunkTask(log_dir, nonempty,
                             min(5.0, answer_limit(ex) / (processes + 2)))
            status, got, _, _ = _guarded(ex, parallel_apply_, t, processes, task)
            running = _left_children(0)  # workers still at work when it returned
            calls = _logged(log_dir)
            if status == "error":
                _no_orphans(ex, case)
                _raised(ex, got)
            if running:
                _kill(running)
                fail(ex, f"every worker finished when your function returns ({case})",
                     f"{len(running)} process(es) still alive (now killed)",
                     "join every worker before returning: t is complete only then")
            _no_orphans(ex, case)
            if t.dtype != dtype or t.shape != original.shape:
                fail(ex, f"t itself, still {dtype} of shape {shape} ({case})",
                     f"{t.dtype} of shape {tuple(t.shape)}")
            if not calls:
                fail(ex, f"fn called on the chunks ({case})", "it was never called")
            pids = {pid for pid, r, *_ in calls if r}
            if os.getpid() in pids:
                fail(ex, f"each chunk computed in a worker process ({case})",
                     "fn ran in this process (serially, or in threads)",
                     "start a multiprocessing Process per chunk")
            if torch.equal(t, original):
                returned = (isinstance(got, torch.Tensor)
                            and got.shape == want.shape and torch.equal(got, want))
                fail(ex, f"t changed in place ({case})", "t unchanged" +
                     (" (the result was returned instead)" if returned else ""),
                     "a forked child writes to its own copy of t's pages: call "
                     "t.share_memory_() first, and have each worker write "
                     "t[start:stop] = fn(t[start:stop])")
            if not torch.equal(t, want):
                bad = (t != want).nonzero()[0].tolist()
                fail(ex, f"every row of t replaced by fn(row), exactly ({case})",
                     f"row {bad[0]} differs", "each chunk written once, in t's own "
                     "dtype (no float32 copy of a float64 tensor, no float copy of "
                     "an int64 one)")
            sizes = sorted((r for _, r, *_ in calls), reverse=True)
            if any(s == rows for s in sizes) and nonempty > 1:
                fail(ex, f"each worker given its chunk of the rows ({case})",
                     "a worker got all the rows", "split along dim 0 into `processes` "
                     "chunks")
            nonzero = [s for s in sizes if s]
            if sum(nonzero) != rows:
                fail(ex, f"chunks covering the {rows} rows once ({case})",
                     f"chunk sizes {nonzero}", "each row in exactly one chunk")
            if len(nonzero) != nonempty or max(nonzero) - min(nonzero) > 1:
                fail(ex, f"{nonempty} chunks whose sizes differ by at most one "
                     f"({case})", f"chunk sizes {nonzero}", "spread the remainder one "
                     "row at a time (the largest chunk sets the time); one chunk per "
                     "process")
            if len(pids) != nonempty:
                fail(ex, f"{nonempty} worker processes, one per chunk ({case})",
                     f"{len(pids)} processes")
            if any(gaps for *_, gaps in calls):
                fail(ex, f"contiguous chunks of rows, t[start:stop] ({case})",
                     "a chunk of rows with gaps between them (every n-th row?)",
                     "give each worker one block of consecutive rows: its pages are "
                     "its own, and a block is one view")
            if not all(met for _, _, met, _ in calls):
                fail(ex, f"the {nonempty} workers running at once ({case})",
                     "they ran one after the other", "start every worker, then join")
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)
    passed(ex, "Written in place, through shared memory, by one worker per "
           "balanced chunk, all at once.")


# ---------------------------------------------------------------- exercise 4.3


def _spin(n: int) -> None:
    total = 0
    for i in range(n):
        total += i * i


def _in_threads(work, n: int = 2) -> None:
    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _matmuls() -> None:
    a = torch.randn(256, 256)
    for _ in range(600):
        a @ a


def _two_processes() -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_spin, args=(2_000_000,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def _half_busy() -> None:
    _spin(1_500_000)
    time.sleep(0.15)


def _in_kernel() -> None:
    """Reads from /dev/zero: CPU time spent in the kernel (system time)."""
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        for _ in range(500):
            os.read(fd, 4 << 20)
    finally:
        os.close(fd)


class _Boom(RuntimeError):
    """What the checker's last ``fn`` raises: it must reach the caller."""


def _raise() -> None:
    _spin(100_000)
    raise _Boom("fn failed on purpose")


BUSY_CASES = [  # the first two probe state kept from one call to the next
    ("a Python loop in the calling thread", lambda: _spin(2_000_000)),
    ("2 sleeping threads", lambda: _in_threads(lambda: time.sleep(0.25))),
    ("a Python loop in 2 threads", lambda: _in_threads(lambda: _spin(1_000_000))),
    ("torch matmuls in 2 threads, 1 torch thread each",
     lambda: _in_threads(_matmuls)),
    ("2 processes started and joined", _two_processes),
    ("reads from /dev/zero: CPU time in the kernel (system time)", _in_kernel),
    ("a loop, then a sleep, in the calling thread", _half_busy),
]
# a case whose answer is off while other programs held the cores runs again:
# they may have paused this process between your clock and the checker's
BUSY_TRIES = 4


def _cpu_readings() -> tuple[float, float, float, float, float]:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = resource.getrusage(resource.RUSAGE_SELF)
    return (time.perf_counter(), time.process_time(),
            kids.ru_utime + kids.ru_stime, time.thread_time(),
            own.ru_utime + kids.ru_utime)


class _Timed:
    """``fn`` for the learner: runs ``work`` and records the clocks around it."""

    def __init__(self, work) -> None:
        self.work, self.calls, self.readings = work, 0, None

    def __call__(self):
        self.calls += 1
        start = _cpu_readings()
        try:
            self.work()
        finally:
            self.readings = start, _cpu_readings()


def _truths(timed: _Timed, first: tuple) -> dict[str, float]:
    """What this call's numbers would be under each rule, right or wrong."""
    (w0, own0, kids0, th0, u0), (w1, own1, kids1, th1, u1) = timed.readings
    wall, own, kids, thread = w1 - w0, own1 - own0, kids1 - kids0, th1 - th0
    since_w, since_c = w1 - first[0], own1 + kids1 - first[1] - first[2]
    return {"right": (own + kids) / wall, "thread": thread / wall,
            "own": own / wall, "kids": kids / wall, "cpu_s": own + kids,
            "inverted": wall / max(own + kids, 1e-9),
            "process_time wall": (own + kids) / max(own, 1e-9),
            "wall clock cpu": 1.0, "since first": since_c / since_w,
            "user only": (u1 - u0) / wall}


BUSY_HINTS = {  # rule -> the mistake it names; the first rule that explains wins
    "whole": "rounded to a whole number: return the ratio as a float",
    "user only": "only the user time: time in the kernel (system calls, page "
                 "faults) is CPU time too - add the system time (os.times() "
                 "system and children_system, or ru_stime)",
    "own": "child processes' CPU missing: add what os.times() gives as "
           "children_user + children_system, or resource.getrusage("
           "RUSAGE_CHILDREN)",
    "thread": "only the calling thread's CPU (time.thread_time): the other threads "
              "count too - time.process_time() adds up all of them",
    "kids": "this process's own CPU missing: only the children's was counted; "
            "add time.process_time() (or RUSAGE_SELF)",
    "cpu_s": "that is the CPU seconds, not divided by the wall seconds",
    "inverted": "the ratio is inverted: CPU seconds / wall seconds, not wall / CPU",
    "since first": "counted from an earlier call: read both clocks just before "
                   "and just after this call of fn, keep nothing between calls",
    "cached": "the same number as an earlier call: measure every call afresh, "
              "cache nothing",
    "wall clock cpu": "about 1 whatever fn did: the CPU seconds came from a wall "
                      "clock (time.time, time.monotonic, perf_counter); use "
                      "time.process_time() plus the children's CPU",
    "process_time wall": "wall time measured with process_time: it stops while "
                         "threads sleep or wait for children; use "
                         "time.perf_counter() for the wall seconds",
}


def _explains(rule: str, got: float, truths: dict, earlier: list, whole: bool,
              tol) -> bool:
    if rule == "cached":
        return any(got == g for g, _ in earlier)
    if rule == "whole":  # an int came back: round(), int() or math.floor()
        return whole
    if truths[rule] > 3:  # far beyond the cores any setup here keeps busy
        return got > 3
    return abs(got - truths[rule]) <= tol(truths[rule])


def check_busy_cores(busy_cores) -> None:
    from course_utils.compare import Meter

    ex = "4.3"
    require_solution(ex, busy_cores)
    # one call may take answer_limit; the time the answer spends beyond fn's
    # own work, over all calls (a setup runs again when the machine was busy),
    # may take as much again
    budget, spent = answer_limit(ex), [0.0]

    def call(fn):
        left = budget - spent[0]
        start = time.perf_counter()
        try:
            if left <= 0:
                raise ExerciseFailed(ex, "", "")
            return _guarded(ex, busy_cores, fn, timeout=budget)
        except ExerciseFailed:
            fail(ex, f"every call to return within {budget:.0f} s, and the time "
                 f"beyond fn's own within {budget:.0f} s in all",
                 "it was still running", "call fn() once, read the clocks before "
                 "and after, return: no waiting, no loop")
        finally:
            own = (fn.readings[1][0] - fn.readings[0][0]
                   if getattr(fn, "readings", None) else 0.0)
            spent[0] += time.perf_counter() - start - own

    def tol(want: float) -> float:
        return 0.15 + 0.1 * want

    first = None
    judged, earlier = [], []  # earlier: (got, truths) of each call
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for case, work in BUSY_CASES:
            for attempt in range(BUSY_TRIES):
                timed = _Timed(work)
                with Meter() as m:
                    status, got, _, _ = call(timed)
                if status == "error":
                    _raised(ex, got)
                if timed.calls != 1:
                    fail(ex, f"fn called once ({case})", f"{timed.calls} calls",
                         "call fn() exactly once and measure around that call"
                         if timed.calls else "call fn(): measure it while it runs")
                if isinstance(got, (str, bytes, bool)) or got is None:
                    fail(ex, f"a number: busy cores ({case})", f"{got!r:.40}",
                         "return CPU seconds / wall seconds")
                whole = isinstance(got, numbers.Integral)
                try:
                    got = float(got)
                except (TypeError, ValueError):
                    fail(ex, f"a number: busy cores ({case})", f"{got!r:.40}",
                         "return CPU seconds / wall seconds")
                first = first or timed.readings[0][:3]
                truths = _truths(timed, first)
                ok = abs(got - truths["right"]) <= tol(truths["right"])
                if ok or not m.disturbed or attempt == BUSY_TRIES - 1:
                    break
            judged.append((case, got, truths, list(earlier), whole))
            earlier.append((got, truths))
        # the last fn raises: its error reaches the caller, nothing is returned
        timed = _Timed(_raise)
        status, got, _, _ = call(timed)
    finally:
        torch.set_num_threads(saved)
    wrong = [j for j in judged if abs(j[1] - j[2]["right"]) > tol(j[2]["right"])]
    if wrong:
        case, got, truths, *_ = wrong[0]
        hint = next((BUSY_HINTS[rule] for rule in BUSY_HINTS if all(
            _explains(rule, g, t, e, w, tol) for _, g, t, e, w in wrong)),
            "CPU seconds of this process (all threads) and of its waited-for "
            "children, divided by the wall seconds of the one call of fn")
        fail(ex, f"about {truths['right']:.2f} busy cores ({case}: measured "
             "around fn here)", f"{got:.2f}", hint)
    if status != "error":
        fail(ex, "fn's exception to reach the caller", f"it returned {got!r:.40}",
             "do not catch what fn raises: let it propagate (a try/finally is "
             "fine)")
    chain = [got, got.__cause__,
             None if got.__suppress_context__ else got.__context__]
    if not any(isinstance(e, _Boom) for e in chain):
        fail(ex, "fn's own exception to reach the caller",
             f"{type(got).__name__}: {str(got):.60}",
             "let fn's exception propagate instead of raising another one")
    for case, got, truths, *_ in judged:
        print(f"  {case:50s} yours {got:4.2f}, measured {truths['right']:4.2f}")
    passed(ex, "Busy cores as CPU seconds (all threads, waited-for children) over "
           "wall seconds, one call at a time, errors passed on.")
