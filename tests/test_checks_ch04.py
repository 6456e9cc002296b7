"""Chapter 4's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import concurrent.futures as cf
import multiprocessing as mp
import os
import queue
import resource
import threading
import time

import psutil
import pytest
import torch
from conftest import machine_s

from course_utils.checks import ch04
from course_utils.exercises import ExerciseFailed

FORK = mp.get_context("fork")


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    text = str(e.value)
    for w in words:
        assert w in text, text
    return text


# ---------------------------------------------------------------- 4.1


def _worker_loop(fn, tasks, done):
    while True:
        task = tasks.get()
        if task is None:
            return
        i, x = task
        try:
            done.put((i, None, fn(x)))
        except Exception as e:  # noqa: BLE001
            done.put((i, e, None))


def map_queues(fn, items, processes, timeout=60):
    tasks, done = FORK.Queue(), FORK.Queue()
    ws = [FORK.Process(target=_worker_loop, args=(fn, tasks, done))
          for _ in range(processes)]
    for w in ws:
        w.start()
    for i, x in enumerate(items):
        tasks.put((i, x))
    for _ in ws:
        tasks.put(None)
    out, error = [None] * len(items), None
    for _ in items:
        i, e, v = done.get(timeout=timeout)
        error = error or e
        out[i] = v
    for w in ws:
        w.join(10)
    if error:
        raise error
    return out


def map_default_context(fn, items, processes, timeout=60):
    tasks, done = mp.Queue(), mp.Queue()
    ws = [mp.Process(target=_worker_loop, args=(fn, tasks, done))
          for _ in range(processes)]
    [w.start() for w in ws]
    try:
        [tasks.put(t) for t in enumerate(items)]
        [tasks.put(None) for _ in ws]
        got = dict()
        while len(got) < len(items):
            i, e, v = done.get(timeout=timeout)
            if e is not None:
                raise e
            got[i] = v
        return [got[k] for k in sorted(got)]
    finally:
        for w in ws:
            w.terminate()
            w.join(5)


class QueuePool:
    def __init__(self, processes):
        self.tasks, self.results = FORK.JoinableQueue(), FORK.SimpleQueue()
        self.n = processes

    def _serve(self, fn):
        for i, x in iter(self.tasks.get, None):
            try:
                self.results.put((i, "ok", fn(x)))
            except BaseException as e:  # noqa: BLE001
                self.results.put((i, "err", repr(e)))

    def map(self, fn, items, timeout):
        procs = [FORK.Process(target=self._serve, args=(fn,), daemon=True)
                 for _ in range(self.n)]
        for p in procs:
            p.start()
        for pair in enumerate(items):
            self.tasks.put(pair)
        for _ in procs:
            self.tasks.put(None)
        answers = {}
        end = time.monotonic() + timeout
        while len(answers) < len(items):
            if time.monotonic() > end:
                raise TimeoutError
            if self.results.empty():
                time.sleep(0.01)  # polls, but sleeps: it does not spin
                continue
            i, status, v = self.results.get()
            if status == "err":
                for p in procs:
                    p.kill()
                raise RuntimeError(v)
            answers[i] = v
        for p in procs:
            p.join(5)
        return [answers[i] for i in range(len(items))]


def map_class(fn, items, processes, timeout=60):
    return QueuePool(processes).map(fn, items, timeout)


def _pipe_worker(fn, conn):
    while (msg := conn.recv()) is not None:
        try:
            conn.send((msg[0], fn(msg[1]), None))
        except Exception as e:  # noqa: BLE001
            conn.send((msg[0], None, e))


def map_pipes(fn, items, processes, timeout=60):  # the parent hands out items
    from multiprocessing.connection import wait
    pairs = [FORK.Pipe() for _ in range(processes)]
    ws = [FORK.Process(target=_pipe_worker, args=(fn, child)) for _, child in pairs]
    for w in ws:
        w.start()
    todo = list(enumerate(items))[::-1]
    out, busy = {}, {}
    try:
        for parent, _ in pairs:
            if todo:
                parent.send(todo.pop())
                busy[parent] = True
        while len(out) < len(items):
            ready = wait([p for p in busy], timeout)
            if not ready:
                raise TimeoutError
            for conn in ready:
                i, v, e = conn.recv()
                if e is not None:
                    raise e
                out[i] = v
                if todo:
                    conn.send(todo.pop())
                else:
                    del busy[conn]
        return [out[i] for i in range(len(items))]
    finally:
        for parent, _ in pairs:
            try:
                parent.send(None)
            except OSError:
                pass
        for w in ws:
            w.join(2)
            if w.is_alive():
                w.kill()
                w.join(2)


def map_with_extra_work(fn, items, processes, timeout=60):
    items = list(items)
    assert processes >= 1
    results = map_queues(fn, items, processes, timeout)
    assert len(results) == len(items)
    return list(results)


@pytest.mark.parametrize("fn", [map_queues, map_default_context, map_class, map_pipes,
                                map_with_extra_work])
def test_right_process_maps_pass(fn):
    ch04.check_process_map(fn)


def test_wrong_process_maps_fail():
    def serial(fn, items, processes, timeout=60):
        return [fn(x) for x in items]

    def threads(fn, items, processes, timeout=60):
        with cf.ThreadPoolExecutor(processes) as ex:
            return list(ex.map(fn, items, timeout=timeout))

    def library_pool(fn, items, processes, timeout=60):
        with FORK.Pool(processes) as p:
            return p.map_async(fn, items, chunksize=1).get(timeout)

    def executor(fn, items, processes, timeout=60):
        with cf.ProcessPoolExecutor(processes, mp_context=FORK) as ex:
            return list(ex.map(fn, items, timeout=timeout))

    def static_chunks(fn, items, processes, timeout=60):
        n, done = len(items), FORK.Queue()
        bounds = [(k * n // processes, (k + 1) * n // processes)
                  for k in range(processes)]

        def run(a, b):
            for i in range(a, b):
                done.put((i, fn(items[i])))
        ws = [FORK.Process(target=run, args=b) for b in bounds]
        [w.start() for w in ws]
        got = dict(done.get(timeout=timeout) for _ in items)
        [w.join(5) for w in ws]
        return [got[i] for i in range(n)]

    def round_robin(fn, items, processes, timeout=60):
        done = FORK.Queue()

        def run(k):
            for i in range(k, len(items), processes):
                done.put((i, fn(items[i])))
        ws = [FORK.Process(target=run, args=(k,)) for k in range(processes)]
        [w.start() for w in ws]
        got = dict(done.get(timeout=timeout) for _ in items)
        [w.join(5) for w in ws]
        return [got[i] for i in range(len(items))]

    def completion_order(fn, items, processes, timeout=60):
        tasks, done = FORK.Queue(), FORK.Queue()
        ws = [FORK.Process(target=_worker_loop, args=(fn, tasks, done))
              for _ in range(processes)]
        [w.start() for w in ws]
        [tasks.put(t) for t in enumerate(items)]
        [tasks.put(None) for _ in ws]
        out = [done.get(timeout=timeout) for _ in items]
        [w.join(5) for w in ws]
        for _, e, _ in out:
            if e:
                raise e
        return [v for _, _, v in out]

    def two_workers(fn, items, processes, timeout=60):
        return map_queues(fn, items, 2, timeout)

    def one_process_per_item(fn, items, processes, timeout=60):
        return map_queues(fn, items, len(items), timeout)

    def workers_left_running(fn, items, processes, timeout=60):
        tasks, done = FORK.Queue(), FORK.Queue()
        ws = [FORK.Process(target=_worker_loop, args=(fn, tasks, done))
              for _ in range(processes)]
        [w.start() for w in ws]
        [tasks.put(t) for t in enumerate(items)]  # no stop signal, no join
        got = {}
        for _ in items:
            i, e, v = done.get(timeout=timeout)
            if e:
                raise e
            got[i] = v
        return [got[i] for i in range(len(items))]

    def error_ignored(fn, items, processes, timeout=60):
        def safe(x):
            try:
                return fn(x)
            except Exception:  # noqa: BLE001
                return None
        return map_queues(safe, items, processes, timeout)

    def drops_the_last(fn, items, processes, timeout=60):
        return map_queues(fn, items[:-1], processes, timeout)

    def hangs_on_error(fn, items, processes, timeout=60):
        def quiet(fn_, tasks, done):
            while (task := tasks.get()) is not None:
                try:
                    done.put((task[0], None, fn_(task[1])))
                except Exception:  # noqa: BLE001
                    pass  # nothing sent back: the parent waits for ever
        tasks, done = FORK.Queue(), FORK.Queue()
        ws = [FORK.Process(target=quiet, args=(fn, tasks, done), daemon=True)
              for _ in range(processes)]
        [w.start() for w in ws]
        [tasks.put(t) for t in enumerate(items)]
        [tasks.put(None) for _ in ws]
        got = {}
        for _ in items:
            i, _, v = done.get()
            got[i] = v
        return [got[i] for i in range(len(items))]

    fails(ch04.check_process_map, serial, "worker process")
    fails(ch04.check_process_map, threads, "worker process")
    fails(ch04.check_process_map, library_pool, "from Process and Queue")
    fails(ch04.check_process_map, executor, "from Process and Queue")
    fails(ch04.check_process_map, static_chunks, "shared")
    fails(ch04.check_process_map, round_robin, "shared")
    fails(ch04.check_process_map, completion_order, "order")
    fails(ch04.check_process_map, two_workers, "at once")
    fails(ch04.check_process_map, one_process_per_item, "one process per item")
    fails(ch04.check_process_map, workers_left_running, "still alive")
    fails(ch04.check_process_map, error_ignored, "error raised in the caller")
    fails(ch04.check_process_map, drops_the_last, "every item exactly once")
    fails(ch04.check_process_map, hangs_on_error, "within")


# ---------------------------------------------------------------- 4.2


def _bounds(n, parts):
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        out.append((start, start + base + (k < extra)))
        start = out[-1][1]
    return out


def _rows_worker(t, a, b, fn):
    t[a:b] = fn(t[a:b])


def apply_tensor_split(t, processes, fn):
    t.share_memory_()
    ps = []
    for piece in torch.tensor_split(torch.arange(t.shape[0]), processes):
        if len(piece):
            ps.append(FORK.Process(target=_rows_worker,
                                   args=(t, int(piece[0]), int(piece[-1]) + 1, fn)))
    [p.start() for p in ps]
    [p.join(30) for p in ps]


def _view_worker(view, fn):
    view.copy_(fn(view))


def _from_queue(q, fn):
    view = q.get(timeout=30)
    view.copy_(fn(view))


def apply_views_through_a_queue(t, processes, fn):  # torch.multiprocessing's Queue
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("fork")
    q = ctx.Queue()
    views = [t[a:b] for a, b in _bounds(t.shape[0], processes) if b > a]
    ps = [ctx.Process(target=_from_queue, args=(q, fn)) for _ in views]
    for p in ps:
        p.start()
    for v in views:
        q.put(v)  # moves t's storage to shared memory; the child maps it
    for p in ps:
        p.join(60)
    return t


def apply_pool_in_place(t, processes, fn):  # Pool: chunks travel through shm
    t.share_memory_()
    chunks = [t[a:b] for a, b in _bounds(t.shape[0], processes) if b > a]
    with FORK.Pool(len(chunks)) as pool:
        pool.starmap_async(_view_worker, [(c, fn) for c in chunks],
                           chunksize=1).get(60)


class InPlace:
    def __call__(self, t, processes, fn):
        t.share_memory_()
        self.procs = [FORK.Process(target=_rows_worker, args=(t, a, b, fn))
                      for a, b in _bounds(len(t), processes)[::-1] if b > a]
        for p in self.procs:
            p.start()
        for p in self.procs:
            p.join(timeout=30)
        return None


apply_class = InPlace()


def apply_formula_bounds(t, processes, fn):
    n = t.size(0)
    t.share_memory_()
    ps = [FORK.Process(target=_rows_worker,
                       args=(t, k * n // processes, (k + 1) * n // processes, fn))
          for k in range(processes) if (k + 1) * n // processes > k * n // processes]
    for p in ps:
        p.start()
    deadline = time.monotonic() + 60
    for p in ps:
        p.join(max(0, deadline - time.monotonic()))


@pytest.mark.parametrize("fn", [apply_tensor_split, apply_views_through_a_queue,
                                apply_pool_in_place, apply_class,
                                apply_formula_bounds])
def test_right_parallel_applies_pass(fn):
    ch04.check_parallel_apply_(fn)


def test_wrong_parallel_applies_fail():
    def not_shared(t, processes, fn):
        ps = [FORK.Process(target=_rows_worker, args=(t, a, b, fn))
              for a, b in _bounds(len(t), processes) if b > a]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def returns_new(t, processes, fn):  # computed in workers, sent back, not written
        chunks = [t[a:b].clone() for a, b in _bounds(len(t), processes) if b > a]
        with FORK.Pool(len(chunks)) as pool:
            return torch.cat(pool.map_async(fn, chunks, chunksize=1).get(60))

    def in_this_process(t, processes, fn):
        for a, b in _bounds(len(t), processes):
            if b > a:
                t[a:b] = fn(t[a:b])

    def in_threads(t, processes, fn):
        ts = [threading.Thread(target=_rows_worker, args=(t, a, b, fn))
              for a, b in _bounds(len(t), processes) if b > a]
        [x.start() for x in ts]
        [x.join(30) for x in ts]

    def remainder_on_last(t, processes, fn):
        t.share_memory_()
        size = len(t) // processes
        bounds = [(k * size, (k + 1) * size if k < processes - 1 else len(t))
                  for k in range(processes)]
        ps = [FORK.Process(target=_rows_worker, args=(t, a, b, fn))
              for a, b in bounds if b > a]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def torch_chunk(t, processes, fn):  # ceil-sized pieces: fewer, unbalanced
        t.share_memory_()
        start, ps = 0, []
        for piece in torch.chunk(t, processes):
            ps.append(FORK.Process(target=_rows_worker,
                                   args=(t, start, start + len(piece), fn)))
            start += len(piece)
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def one_after_the_other(t, processes, fn):
        t.share_memory_()
        for a, b in _bounds(len(t), processes):
            if b > a:
                p = FORK.Process(target=_rows_worker, args=(t, a, b, fn))
                p.start()
                p.join(30)

    def two_processes(t, processes, fn):
        apply_formula_bounds(t, 2, fn)

    def one_process_too_many(t, processes, fn):
        apply_formula_bounds(t, processes + 1, fn)

    def whole_tensor_each(t, processes, fn):
        t.share_memory_()
        src = t.clone()

        def run():
            t.copy_(fn(src))
        ps = [FORK.Process(target=run) for _ in range(min(processes, len(t)))]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def float32_copy(t, processes, fn):
        s = t.float().share_memory_()
        apply_formula_bounds(s, processes, fn)
        t.copy_(s)

    def last_dim(t, processes, fn):
        t.share_memory_()
        cols = t.shape[-1]

        def run(a, b):
            t[..., a:b] = fn(t[..., a:b])
        ps = [FORK.Process(target=run, args=ab) for ab in _bounds(cols, processes)
              if ab[1] > ab[0]]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def left_running(t, processes, fn):
        t.share_memory_()

        def run(a, b):
            t[a:b] = fn(t[a:b])
            time.sleep(30)  # lingers after its work
        ps = [FORK.Process(target=run, args=ab, daemon=True)
              for ab in _bounds(len(t), processes) if ab[1] > ab[0]]
        [p.start() for p in ps]
        time.sleep(1.5)  # waits a while, but never joins

    fails(ch04.check_parallel_apply_, not_shared, "share_memory_")
    fails(ch04.check_parallel_apply_, returns_new, "returned instead")
    fails(ch04.check_parallel_apply_, in_this_process, "worker process")
    fails(ch04.check_parallel_apply_, in_threads, "worker process")
    fails(ch04.check_parallel_apply_, remainder_on_last, "at most one")
    fails(ch04.check_parallel_apply_, torch_chunk, "at most one")
    fails(ch04.check_parallel_apply_, one_after_the_other, "one after the other")
    fails(ch04.check_parallel_apply_, two_processes, "chunks whose sizes")
    fails(ch04.check_parallel_apply_, one_process_too_many, "chunks whose sizes")
    fails(ch04.check_parallel_apply_, whole_tensor_each, "all the rows")
    fails(ch04.check_parallel_apply_, float32_copy, "dtype")
    fails(ch04.check_parallel_apply_, last_dim, "all the rows")
    fails(ch04.check_parallel_apply_, left_running, "still alive")


# ---------------------------------------------------------------- 4.3


def meter_rusage(fn):
    def cpu():
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    c0, w0 = cpu(), time.perf_counter()
    fn()
    return (cpu() - c0) / (time.perf_counter() - w0)


def meter_os_times(fn):
    t0, w0 = os.times(), time.monotonic()
    fn()
    t1, w1 = os.times(), time.monotonic()
    cpu = sum(t1[i] - t0[i] for i in range(4))  # user, system, children's both
    return cpu / (w1 - w0)


def meter_psutil(fn):
    me = psutil.Process()

    def cpu():
        t = me.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    c0, w0 = cpu(), time.perf_counter()
    fn()
    return (cpu() - c0) / (time.perf_counter() - w0)


def meter_ns(fn):
    kids = resource.RUSAGE_CHILDREN
    k0 = sum(resource.getrusage(kids)[:2])
    c0, w0 = time.process_time_ns(), time.perf_counter_ns()
    try:
        fn()
    finally:  # a try/finally lets fn's error through
        w1, c1 = time.perf_counter_ns(), time.process_time_ns()
    return ((c1 - c0) / 1e9 + sum(resource.getrusage(kids)[:2]) - k0) / (
        (w1 - w0) / 1e9)


class MeterClass:
    """A class whose instances are the meter; the result a numpy float."""

    def __new__(cls, fn):
        import numpy as np
        c0 = time.process_time() + sum(os.times()[2:4])
        w0 = time.perf_counter()
        fn()
        c1 = time.process_time() + sum(os.times()[2:4])
        return np.float64((c1 - c0) / (time.perf_counter() - w0))


RIGHT_METERS = [meter_rusage, meter_os_times, meter_psutil, meter_ns, MeterClass]


@pytest.mark.parametrize("meter", RIGHT_METERS)
def test_right_busy_cores_pass(meter, capsys):
    ch04.check_busy_cores(meter)
    out = capsys.readouterr().out
    assert "passed" in out and "measured" in out


def _wrong_meters():
    def threads_only(fn):
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        return (time.thread_time() - c0) / (time.perf_counter() - w0)

    def no_children(fn):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        return (time.process_time() - c0) / (time.perf_counter() - w0)

    def children_only(fn):
        k0, w0 = sum(os.times()[2:4]), time.perf_counter()
        fn()
        return (sum(os.times()[2:4]) - k0) / (time.perf_counter() - w0)

    def wall_time_thread_cpu(fn):
        c0, w0 = time.thread_time(), time.time()
        fn()
        return (time.thread_time() - c0) / (time.time() - w0)

    def cpu_seconds(fn):
        c0 = meter_cpu()
        fn()
        return meter_cpu() - c0

    def inverted(fn):
        c0, w0 = meter_cpu(), time.perf_counter()
        fn()
        return (time.perf_counter() - w0) / (meter_cpu() - c0)

    first = []

    def cached(fn):
        if not first:
            first.append(meter_rusage(fn))
        else:
            fn()
        return first[0]

    total = {"cpu": 0.0, "wall": 0.0}

    def accumulates(fn):
        c0, w0 = meter_cpu(), time.perf_counter()
        fn()
        total["cpu"] += meter_cpu() - c0
        total["wall"] += time.perf_counter() - w0
        return total["cpu"] / total["wall"]

    def calls_twice(fn):
        fn()  # a warm-up
        return meter_rusage(fn)

    def swallows(fn):
        try:
            return meter_rusage(fn)
        except Exception:  # noqa: BLE001 - the mistake under test
            return 0.0

    def rounded(fn):
        return round(meter_rusage(fn))

    def monotonic_cpu(fn):
        c0, w0 = time.monotonic(), time.perf_counter()
        fn()
        return (time.monotonic() - c0) / (time.perf_counter() - w0)

    def process_time_wall(fn):
        c0, w0 = meter_cpu(), time.process_time()
        fn()
        return (meter_cpu() - c0) / (time.process_time() - w0)

    def never_calls(fn):
        return 1.0

    def returns_text(fn):
        return f"{meter_rusage(fn):.2f} cores"

    def another_error(fn):
        try:
            return meter_rusage(fn)
        except Exception:  # noqa: BLE001 - the mistake under test
            raise ValueError("fn failed") from None

    def hangs(fn):
        fn()
        while True:
            time.sleep(0.1)

    return [
        (threads_only, "time.thread_time"),
        (no_children, "child processes' CPU missing"),
        (children_only, "own CPU missing"),
        (wall_time_thread_cpu, "only the calling thread's CPU"),
        (cpu_seconds, "not divided by the wall seconds"),
        (inverted, "inverted"),
        (cached, "cache nothing"),
        (accumulates, "counted from an earlier call"),
        (calls_twice, "2 calls"),
        (swallows, "let it propagate"),
        (rounded, "whole number"),
        (monotonic_cpu, "wall clock"),
        (process_time_wall, "wall time measured with process_time"),
        (never_calls, "call fn()"),
        (returns_text, "a number"),
        (another_error, "fn's own exception"),
        (hangs, "within"),
    ]


def meter_cpu():
    return time.process_time() + sum(os.times()[2:4])


@pytest.mark.parametrize("meter, words", _wrong_meters(),
                         ids=[m.__name__ for m, _ in _wrong_meters()])
def test_wrong_busy_cores_fail(meter, words):
    start = time.monotonic()
    fails(ch04.check_busy_cores, meter, words)
    assert time.monotonic() - start < machine_s(30)  # a verdict, whatever it does


# ------------------------------------------------- more answers, written apart


def _loop_answering(fn, tasks, done):
    while (task := tasks.get()) is not None:
        i, x = task
        try:
            done.put((i, True, fn(x)))
        except Exception as e:  # noqa: BLE001
            done.put((i, False, e))


def map_simple_queue_and_wait(fn, items, processes, timeout=60):  # Pipes' wait()
    from multiprocessing.connection import wait
    tasks, ends, ws = FORK.Queue(), [], []
    for _ in range(processes):
        parent, child = FORK.Pipe(duplex=False)

        def work(child=child):
            while (task := tasks.get()) is not None:
                i, x = task
                try:
                    child.send((i, True, fn(x)))
                except Exception as e:  # noqa: BLE001
                    child.send((i, False, e))
            child.send(None)
        ws.append(FORK.Process(target=work))
        ends.append(parent)
    [w.start() for w in ws]
    [tasks.put(t) for t in enumerate(items)]
    [tasks.put(None) for _ in ws]
    out, live, error = {}, list(ends), None
    try:
        while live:
            ready = wait(live, timeout)
            if not ready:
                raise TimeoutError("no result")
            for conn in ready:
                msg = conn.recv()
                if msg is None:
                    live.remove(conn)
                elif msg[1]:
                    out[msg[0]] = msg[2]
                else:
                    error = error or msg[2]
        if error:
            raise error
        return [out[i] for i in range(len(items))]
    finally:
        for w in ws:
            w.join(3)
            if w.is_alive():
                w.kill()
            w.join()


def map_torch_joinable(fn, items, processes, timeout=60.0):  # torch.multiprocessing
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("fork")
    tasks, done = ctx.JoinableQueue(), ctx.SimpleQueue()
    ws = [ctx.Process(target=_loop_answering, args=(fn, tasks, done), daemon=True)
          for _ in range(processes)]
    [w.start() for w in ws]
    for task in enumerate(items):
        tasks.put(task)
    [tasks.put(None) for _ in ws]
    results = [None] * len(items)
    try:
        deadline = time.monotonic() + timeout
        for _ in items:
            while done.empty():
                if time.monotonic() > deadline:
                    raise TimeoutError("no result")
                time.sleep(0.02)
            i, ok, v = done.get()
            if not ok:
                raise v
            results[i] = v
        return tuple(results)
    finally:
        for w in ws:
            w.join(2)
            if w.is_alive():
                w.terminate()
                w.join(2)


def map_error_chained(fn, items, processes, timeout=60):  # raise ... from the task's
    try:
        return map_queues(fn, items, processes, min(timeout, 10))
    except queue.Empty:
        raise
    except Exception as e:
        raise RuntimeError("a task failed") from e


def map_items_as_iterator(fn, items, processes, timeout=60):
    return map_queues(fn, list(iter(items)), processes, timeout)


@pytest.mark.parametrize("fn", [map_simple_queue_and_wait, map_torch_joinable,
                                map_error_chained, map_items_as_iterator])
def test_more_right_process_maps_pass(fn):
    ch04.check_process_map(fn)
    assert not ch04._left_children(0)


def test_more_wrong_process_maps_fail():
    def new_error(fn, items, processes, timeout=60):
        try:
            return map_queues(fn, items, processes, timeout)
        except Exception:
            raise RuntimeError("a task failed") from None

    def worker_dies_on_error(fn, items, processes, timeout=60):  # times out instead
        tasks, done = FORK.Queue(), FORK.Queue()

        def work():
            while (task := tasks.get()) is not None:
                done.put((task[0], fn(task[1])))
        ws = [FORK.Process(target=work) for _ in range(processes)]
        [w.start() for w in ws]
        [tasks.put(t) for t in enumerate(items)]
        [tasks.put(None) for _ in ws]
        try:
            got = dict(done.get(timeout=3) for _ in items)
            return [got[i] for i in range(len(items))]
        finally:
            for w in ws:
                w.join(1)
                w.terminate()
                w.join()

    def get_without_timeout(fn, items, processes, timeout=60):
        tasks, done = FORK.Queue(), FORK.Queue()
        ws = [FORK.Process(target=_loop_answering, args=(fn, tasks, done))
              for _ in range(processes)]
        [w.start() for w in ws]
        [tasks.put(t) for t in enumerate(items)]
        [tasks.put(None) for _ in ws]
        out, error = [None] * len(items), None
        for _ in items:
            i, ok, v = done.get()  # waits for ever if a worker died
            out[i] = v
            error = error or (None if ok else v)
        [w.join() for w in ws]
        if error:
            raise error
        return out

    def capped_at_two(fn, items, processes, timeout=60):
        return map_queues(fn, items, min(processes, 2), timeout)

    def one_queue_per_worker(fn, items, processes, timeout=60):  # dealt in advance
        qs, done = [FORK.Queue() for _ in range(processes)], FORK.Queue()
        ws = [FORK.Process(target=_worker_loop, args=(fn, q, done)) for q in qs]
        [w.start() for w in ws]
        for i, x in enumerate(items):
            qs[i % processes].put((i, x))
        [q.put(None) for q in qs]
        out = [None] * len(items)
        for _ in items:
            i, _, v = done.get(timeout=timeout)
            out[i] = v
        [w.join(5) for w in ws]
        return out

    def sorted_results(fn, items, processes, timeout=60):
        return sorted(map_queues(fn, items, processes, timeout))

    def results_in_float32(fn, items, processes, timeout=60):
        out = map_queues(fn, items, processes, timeout)
        return [(float(torch.tensor(r[0], dtype=torch.float32)), *r[1:]) for r in out]

    def a_process_per_batch(fn, items, processes, timeout=60):
        out, done = [None] * len(items), FORK.Queue()

        def one(i, x):
            done.put((i, fn(x)))
        for s in range(0, len(items), processes):
            ps = [FORK.Process(target=one, args=(i, items[i]))
                  for i in range(s, min(s + processes, len(items)))]
            [p.start() for p in ps]
            for _ in ps:
                i, v = done.get(timeout=timeout)
                out[i] = v
            [p.join(5) for p in ps]
        return out

    def error_returned(fn, items, processes, timeout=60):  # swallowed, None in place
        tasks, done = FORK.Queue(), FORK.Queue()
        ws = [FORK.Process(target=_worker_loop, args=(fn, tasks, done), daemon=True)
              for _ in range(processes)]
        [w.start() for w in ws]
        [tasks.put(t) for t in enumerate(items)]
        [tasks.put(None) for _ in ws]
        out = [None] * len(items)
        for _ in items:
            i, _, v = done.get(timeout=timeout)
            out[i] = v
        [w.join(5) for w in ws]
        return out

    fails(ch04.check_process_map, new_error, "own error")
    fails(ch04.check_process_map, worker_dies_on_error, "own error")
    fails(ch04.check_process_map, get_without_timeout, "worker dies", "timeout")
    fails(ch04.check_process_map, capped_at_two, "running at once")
    fails(ch04.check_process_map, one_queue_per_worker, "few other items")
    fails(ch04.check_process_map, sorted_results, "order of the items")
    fails(ch04.check_process_map, results_in_float32, "fn(item)")
    fails(ch04.check_process_map, a_process_per_batch, "at most 3 worker")
    fails(ch04.check_process_map, error_returned, "error raised in the caller")
    assert not ch04._left_children(0)


def _rows(n, k):
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def _fork_each(t, fn, bounds, join=True):
    def work(a, b):
        t[a:b] = fn(t[a:b])
    ps = [FORK.Process(target=work, args=ab) for ab in bounds if ab[1] > ab[0]]
    [p.start() for p in ps]
    if join:
        [p.join(30) for p in ps]
    return ps


def apply_floor_bounds(t, processes, fn):
    t.share_memory_()
    _fork_each(t, fn, _rows(t.shape[0], processes))


def apply_copy_into_split(t, processes, fn):
    t.share_memory_()

    def work(c):
        c.copy_(fn(c))
    ps = [FORK.Process(target=work, args=(c,))
          for c in torch.tensor_split(t, processes) if c.shape[0]]
    for p in ps:
        p.start()
    for p in ps:
        p.join(30)
        assert p.exitcode == 0


class NarrowApplier:  # torch.multiprocessing, narrow() views, a class
    def __init__(self, t, processes, fn):
        import torch.multiprocessing as tmp
        ctx = tmp.get_context("fork")
        t.share_memory_()
        sizes = [len(r) for r in torch.arange(t.shape[0]).tensor_split(processes)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        ps = [ctx.Process(target=self.work, args=(t, fn, s, z))
              for s, z in zip(starts, sizes, strict=True) if z]
        [p.start() for p in ps]
        [p.join() for p in ps]

    @staticmethod
    def work(t, fn, start, length):
        t.narrow(0, start, length).copy_(fn(t.narrow(0, start, length)))


def apply_with_identity_pass(t, processes, fn):  # extra harmless work
    apply_floor_bounds(t, processes, fn)
    apply_floor_bounds(t, processes, lambda c: c.clone())


@pytest.mark.parametrize("fn", [apply_floor_bounds, apply_copy_into_split,
                                NarrowApplier, apply_with_identity_pass])
def test_more_right_parallel_applies_pass(fn):
    ch04.check_parallel_apply_(fn)


def test_more_wrong_parallel_applies_fail():
    def float64_detour(t, processes, fn):  # exact for floats, not for big int64
        t.share_memory_()

        def work(a, b):
            t[a:b] = fn(t[a:b].double()).to(t.dtype)
        ps = [FORK.Process(target=work, args=ab)
              for ab in _rows(t.shape[0], processes) if ab[1] > ab[0]]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def every_nth_row(t, processes, fn):
        t.share_memory_()

        def work(k):
            t[k::processes] = fn(t[k::processes])
        ps = [FORK.Process(target=work, args=(k,))
              for k in range(min(processes, t.shape[0]))]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def never_joined(t, processes, fn):
        t.share_memory_()
        _fork_each(t, fn, _rows(t.shape[0], processes), join=False)

    def last_dim(t, processes, fn):
        t.share_memory_()
        n = t.shape[-1]

        def work(a, b):
            t[..., a:b] = fn(t[..., a:b])
        ps = [FORK.Process(target=work, args=ab)
              for ab in _rows(n, processes) if ab[1] > ab[0]]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def whole_then_sliced(t, processes, fn):
        t.share_memory_()

        def work(a, b):
            t[a:b] = fn(t)[a:b]
        ps = [FORK.Process(target=work, args=ab)
              for ab in _rows(t.shape[0], processes) if ab[1] > ab[0]]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def row_by_row(t, processes, fn):
        t.share_memory_()

        def work(a, b):
            for i in range(a, b):
                t[i:i + 1] = fn(t[i:i + 1])
        ps = [FORK.Process(target=work, args=ab)
              for ab in _rows(t.shape[0], processes) if ab[1] > ab[0]]
        [p.start() for p in ps]
        [p.join(30) for p in ps]

    def caller_takes_the_first(t, processes, fn):
        t.share_memory_()
        bounds = [ab for ab in _rows(t.shape[0], processes) if ab[1] > ab[0]]
        ps = _fork_each(t, fn, bounds[1:], join=False)
        t[bounds[0][0]:bounds[0][1]] = fn(t[bounds[0][0]:bounds[0][1]])
        [p.join(30) for p in ps]

    def remainder_to_the_last(t, processes, fn):
        t.share_memory_()
        n, b = t.shape[0], t.shape[0] // processes
        _fork_each(t, fn, [(i * b, n if i == processes - 1 else (i + 1) * b)
                           for i in range(processes)])

    def shared_copy_returned(t, processes, fn):
        u = t.clone().share_memory_()
        apply_floor_bounds(u, processes, fn)
        return u

    fails(ch04.check_parallel_apply_, float64_detour, "int64")
    fails(ch04.check_parallel_apply_, every_nth_row, "contiguous")
    fails(ch04.check_parallel_apply_, never_joined, "join every worker")
    fails(ch04.check_parallel_apply_, last_dim, "dim 0")
    fails(ch04.check_parallel_apply_, whole_then_sliced, "all the rows")
    fails(ch04.check_parallel_apply_, row_by_row, "differ by at most one")
    fails(ch04.check_parallel_apply_, caller_takes_the_first, "worker process")
    fails(ch04.check_parallel_apply_, remainder_to_the_last, "differ by at most one")
    fails(ch04.check_parallel_apply_, shared_copy_returned, "returned instead")
    assert not ch04._left_children(0)


# --- stray workers after an error, and the queue-join deadlock -------------------


def map_raises_at_once(fn, items, processes, timeout=60):
    """Raises the task's error at once: the other workers run on, unstopped."""
    tasks, done = FORK.Queue(), FORK.Queue()
    ws = [FORK.Process(target=_worker_loop, args=(fn, tasks, done), daemon=True)
          for _ in range(processes)]
    for w in ws:
        w.start()
    for i, x in enumerate(items):
        tasks.put((i, x))
    for _ in ws:
        tasks.put(None)
    out = [None] * len(items)
    for _ in items:
        i, e, v = done.get(timeout=timeout)
        if e is not None:
            raise e
        out[i] = v
    for w in ws:
        w.join(timeout)
    return out


def map_joins_first(fn, items, processes, timeout=60):
    """Joins the workers before reading the results: fine for small results."""
    tasks, done = FORK.Queue(), FORK.Queue()
    ws = [FORK.Process(target=_worker_loop, args=(fn, tasks, done), daemon=True)
          for _ in range(processes)]
    for w in ws:
        w.start()
    for i, x in enumerate(items):
        tasks.put((i, x))
    for _ in ws:
        tasks.put(None)
    for w in ws:
        w.join(timeout)
    out, error = [None] * len(items), None
    for _ in items:
        i, e, v = done.get(timeout=timeout)
        error = error or e
        out[i] = v
    for w in ws:
        if w.is_alive():
            w.terminate()
            w.join(1)
    if error:
        raise error
    return out


def map_terminates_on_error(fn, items, processes, timeout=60):
    """Right: on a task's error, terminate the workers and raise it."""
    tasks, done = FORK.Queue(), FORK.Queue()
    ws = [FORK.Process(target=_worker_loop, args=(fn, tasks, done), daemon=True)
          for _ in range(processes)]
    for w in ws:
        w.start()
    try:
        for i, x in enumerate(items):
            tasks.put((i, x))
        out = {}
        for _ in items:
            i, e, v = done.get(timeout=timeout)
            if e is not None:
                raise e
            out[i] = v
        for _ in ws:
            tasks.put(None)
        return [out[i] for i in range(len(items))]
    finally:
        for w in ws:
            w.join(0.2)
            if w.is_alive():
                w.terminate()
                w.join(5)


def test_process_map_names_workers_left_after_an_error():
    fails(ch04.check_process_map, map_raises_at_once, "a task that raises",
          "still alive")


def test_process_map_names_a_join_before_the_results():
    fails(ch04.check_process_map, map_joins_first, "512 KiB", "get every result first")


def test_process_map_accepts_terminating_on_error():
    ch04.check_process_map(map_terminates_on_error)


def _apply_in(t, bounds, fn):
    def work(a, b):
        t[a:b] = fn(t[a:b])
    ps = [FORK.Process(target=work, args=ab) for ab in bounds if ab[1] > ab[0]]
    [p.start() for p in ps]
    [p.join(30) for p in ps]


def test_parallel_apply_names_what_workers_did_instead_of_a_timeout():
    def ceil_chunks(t, processes, fn):  # torch.chunk's sizes: 2, 2, 1, 0 for 5 rows
        t.share_memory_()
        c = -(-t.shape[0] // processes)
        _apply_in(t, [(k * c, min((k + 1) * c, t.shape[0]))
                      for k in range(processes)], fn)

    def one_after_another(t, processes, fn):
        t.share_memory_()
        for ab in _rows(t.shape[0], processes):
            _apply_in(t, [ab], fn)

    def in_this_process(t, processes, fn):
        t[:] = fn(t)

    fails(ch04.check_parallel_apply_, ceil_chunks, "differ by at most one")
    fails(ch04.check_parallel_apply_, one_after_another, "one after the other")
    fails(ch04.check_parallel_apply_, in_this_process, "in a worker process")


def test_busy_cores_counts_system_time():
    def user_time_only(fn):
        t0, w0 = os.times(), time.perf_counter()
        fn()
        t1 = os.times()
        return (t1.user - t0.user + t1.children_user - t0.children_user) / (
            time.perf_counter() - w0)

    fails(ch04.check_busy_cores, user_time_only, "system time", "only the user time")
