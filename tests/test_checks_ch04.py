"""Chapter 4's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import concurrent.futures as cf
import multiprocessing as mp
import os
import resource
import threading
import time

import numpy as np
import pytest

from course_utils.checks import ch04
from course_utils.dist import pool
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    text = str(e.value)
    for w in words:
        assert w in text, text
    return text


# ---------------------------------------------------------------- 4.1


def bounds_divmod(n, parts):
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + base + (k < extra)
        out.append((start, stop))
        start = stop
    return out


def bounds_array_split(n, parts):
    chunks = np.array_split(np.arange(n), parts)
    out, start = [], 0
    for c in chunks:
        out.append((start, start + len(c)))
        start += len(c)
    return out


def bounds_formula(n, parts):
    return [(k * n // parts, (k + 1) * n // parts) for k in range(parts)]


def bounds_extra_at_the_end(n, parts):  # the bigger chunks last: still balanced
    base, extra = divmod(n, parts)
    sizes = [base] * (parts - extra) + [base + 1] * extra
    edges = np.cumsum([0, *sizes])
    return list(zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True))


@pytest.mark.parametrize("fn", [bounds_divmod, bounds_array_split, bounds_formula,
                                bounds_extra_at_the_end])
def test_right_chunk_bounds_pass(fn):
    ch04.check_chunk_bounds(fn)


def test_wrong_chunk_bounds_fail():
    def remainder_dropped(n, parts):
        size = n // parts
        return [(k * size, (k + 1) * size) for k in range(parts)]

    def remainder_on_the_last(n, parts):
        size = n // parts
        return [(k * size, (k + 1) * size if k < parts - 1 else n)
                for k in range(parts)]

    def ceil_size(n, parts):  # the last chunks overrun n or come out negative
        size = -(-n // parts)
        return [(k * size, min(n, (k + 1) * size)) for k in range(parts)]

    def overlapping(n, parts):
        return [(max(0, a - 1), b) for a, b in bounds_divmod(n, parts)]

    def no_empty_chunks(n, parts):
        return [b for b in bounds_divmod(n, parts) if b[1] > b[0]]

    def two_parts_always(n, parts):
        return bounds_divmod(n, 2)

    def array_chunks(n, parts):
        return np.array_split(np.arange(n), parts)

    def sizes_only(n, parts):
        return [b - a for a, b in bounds_divmod(n, parts)]

    def inclusive_stop(n, parts):
        return [(a, b - 1) for a, b in bounds_divmod(n, parts)]

    fails(ch04.check_chunk_bounds, remainder_dropped, "stop at n")
    fails(ch04.check_chunk_bounds, remainder_on_the_last, "differ by at most 1")
    fails(ch04.check_chunk_bounds, ceil_size, "Exercise 4.1")
    fails(ch04.check_chunk_bounds, overlapping, "overlaps")
    fails(ch04.check_chunk_bounds, no_empty_chunks, "chunks for")
    fails(ch04.check_chunk_bounds, two_parts_always, "chunks for")
    fails(ch04.check_chunk_bounds, array_chunks, "(start, stop) pairs")
    fails(ch04.check_chunk_bounds, sizes_only, "(start, stop) pairs")
    fails(ch04.check_chunk_bounds, inclusive_stop, "gap")


def test_unsolved_chunk_bounds_says_so():
    def stub(n, parts):
        raise NotImplementedError("Exercise 4.1")

    fails(ch04.check_chunk_bounds, stub, "placeholder")


# ---------------------------------------------------------------- 4.2


def map_with_course_pool(fn, items, processes):
    with pool(processes) as p:
        return p.map_async(fn, items, chunksize=1).get(timeout=60)


def map_with_mp_pool(fn, items, processes):
    with mp.get_context("fork").Pool(processes) as p:
        return p.map_async(fn, items).get(60)


def map_with_executor(fn, items, processes):
    with cf.ProcessPoolExecutor(processes, mp_context=mp.get_context("fork")) as ex:
        return list(ex.map(fn, items, timeout=60))


def map_with_submit(fn, items, processes):
    with cf.ProcessPoolExecutor(max_workers=processes) as ex:
        futures = [ex.submit(fn, x) for x in items]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("fn", [map_with_course_pool, map_with_mp_pool,
                                map_with_executor, map_with_submit])
def test_right_parallel_maps_pass(fn):
    ch04.check_parallel_map(fn)


def test_wrong_parallel_maps_fail():
    def serial(fn, items, processes):
        return [fn(x) for x in items]

    def threads(fn, items, processes):
        with cf.ThreadPoolExecutor(processes) as ex:
            return list(ex.map(fn, items))

    def two_workers_always(fn, items, processes):
        return map_with_mp_pool(fn, items, 2)

    def unordered(fn, items, processes):
        with mp.get_context("fork").Pool(processes) as p:
            return list(p.imap_unordered(fn, items))

    def as_completed(fn, items, processes):
        with cf.ProcessPoolExecutor(processes) as ex:
            futures = [ex.submit(fn, x) for x in items]
            return [f.result() for f in cf.as_completed(futures)]

    def drops_the_last(fn, items, processes):
        return map_with_mp_pool(fn, items[:-1], processes)

    def processes_without_results(fn, items, processes):  # the seed's version
        ctx = mp.get_context("fork")
        chunks = np.array_split(np.array(items), processes)
        procs = [ctx.Process(target=lambda c=c: [fn(x) for x in c]) for c in chunks]
        for p in procs:
            p.start()
        for p in procs:
            p.join(10)

    def returns_the_pool(fn, items, processes):
        p = mp.get_context("fork").Pool(processes)
        p.map_async(fn, items).get(60)
        p.terminate()
        return p

    fails(ch04.check_parallel_map, serial, "worker processes", "notebook's process")
    fails(ch04.check_parallel_map, threads, "worker processes", "threads")
    fails(ch04.check_parallel_map, two_workers_always, "3 worker processes")
    fails(ch04.check_parallel_map, unordered, "order")
    fails(ch04.check_parallel_map, as_completed, "order")
    fails(ch04.check_parallel_map, drops_the_last, "every item exactly once")
    fails(ch04.check_parallel_map, processes_without_results, "fn(item) results")
    fails(ch04.check_parallel_map, returns_the_pool, "Exercise 4.2")


# ---------------------------------------------------------------- 4.3


def cpu_wall_process_time(task):
    c0, w0 = time.process_time(), time.perf_counter()
    task()
    return time.process_time() - c0, time.perf_counter() - w0


def cpu_wall_os_times(task):
    t0 = os.times()
    w0 = time.monotonic()
    task()
    t1 = os.times()
    return (t1.user - t0.user) + (t1.system - t0.system), time.monotonic() - w0


class CpuWallTimer:  # a context manager, used inside the function
    def __enter__(self):
        self.c, self.w = time.process_time_ns(), time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        self.cpu = (time.process_time_ns() - self.c) / 1e9
        self.wall = (time.perf_counter_ns() - self.w) / 1e9


def cpu_wall_class(task):
    with CpuWallTimer() as t:
        task()
    return t.cpu, t.wall


def cpu_wall_rusage(task):
    def used():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0, w0 = used(), time.time()
    task()
    return used() - c0, time.time() - w0


@pytest.mark.parametrize("fn", [cpu_wall_process_time, cpu_wall_os_times,
                                cpu_wall_class, cpu_wall_rusage])
def test_right_cpu_and_wall_pass(fn):
    ch04.check_cpu_and_wall(fn)


def test_wrong_cpu_and_wall_fail():
    def swapped(task):
        c, w = cpu_wall_process_time(task)
        return w, c

    def wall_twice(task):
        w0 = time.perf_counter()
        task()
        w = time.perf_counter() - w0
        return w, w

    def thread_time_only(task):
        c0, w0 = time.thread_time(), time.perf_counter()
        task()
        return time.thread_time() - c0, time.perf_counter() - w0

    def nanoseconds(task):
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        task()
        return time.process_time_ns() - c0, time.perf_counter_ns() - w0

    def constant(task):
        task()
        return 0.25, 0.3

    def process_time_for_both(task):
        c0 = time.process_time()
        task()
        c = time.process_time() - c0
        return c, c

    def rusage_thread(task):
        def used():
            r = resource.getrusage(resource.RUSAGE_THREAD)
            return r.ru_utime + r.ru_stime

        c0, w0 = used(), time.perf_counter()
        task()
        return used() - c0, time.perf_counter() - w0

    def never_runs_it(task):
        return 0.0, 0.0

    def wall_only(task):
        w0 = time.perf_counter()
        task()
        return time.perf_counter() - w0

    def in_a_thread_of_its_own(task):  # cpu of the wrong thread
        out = {}

        def run():
            c0 = time.thread_time()
            w0 = time.perf_counter()
            threading.Thread(target=task).start()
            out["r"] = (time.thread_time() - c0, time.perf_counter() - w0)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out["r"]

    fails(ch04.check_cpu_and_wall, swapped, "sleeps")
    fails(ch04.check_cpu_and_wall, wall_twice, "process_time")
    fails(ch04.check_cpu_and_wall, thread_time_only, "every thread")
    fails(ch04.check_cpu_and_wall, nanoseconds, "Exercise 4.3")
    fails(ch04.check_cpu_and_wall, constant, "Exercise 4.3")
    fails(ch04.check_cpu_and_wall, process_time_for_both, "wall time")
    fails(ch04.check_cpu_and_wall, rusage_thread, "every thread")
    fails(ch04.check_cpu_and_wall, never_runs_it, "wall time")
    fails(ch04.check_cpu_and_wall, wall_only, "two numbers")
    fails(ch04.check_cpu_and_wall, in_a_thread_of_its_own, "Exercise 4.3")
