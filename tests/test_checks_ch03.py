"""Chapter 3's checkers: correct answers pass, typical mistakes fail by name."""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.utils.data import DataLoader

from course_utils.checks.ch03 import (
    StandInCuda,
    TracedSamples,
    check_load_ahead,
    check_overlap_fraction,
    check_prefetcher,
    host_batches,
    run_standin_prefetch,
)
from course_utils.exercises import ExerciseFailed

# --- the stand-in GPU itself ---------------------------------------------------------


def test_standin_orders_streams_and_events():
    gpu = StandInCuda(copy_s=2.0)
    side, main = gpu.Stream(), gpu.current_stream()
    (b,) = host_batches(1, (3,), seed=0)
    with gpu, gpu.stream(side):
        x = b.to(gpu.device, non_blocking=True)
    assert not side.query() and gpu.host_waits == ["query() in a loop"]
    ev = gpu.Event()
    ev.record(side)
    main.wait_event(ev)
    assert main.tail == 2.0 and gpu.host_t < 2.0
    op = gpu.launch(lambda v: float(v.sum()), x, 1.0)
    assert (op["start"], op["end"]) == (2.0, 3.0)
    assert gpu.read(op)[0] == "ok"
    gpu.synchronize()
    assert gpu.host_t == 3.0 and main.query() and ev.query()


def test_standin_allocator_reuses_a_freed_block_unless_recorded():
    for record, reused in ((False, True), (True, False)):
        gpu = StandInCuda()
        side, main = gpu.Stream(), gpu.current_stream()
        a, b = host_batches(2, (4,), seed=1)
        with gpu, gpu.stream(side):
            x = a.to(gpu.device, non_blocking=True)
        main.wait_stream(side)
        gpu.launch(lambda v: 0.0, x, 5.0)
        if record:
            x.record_stream(main)
        block = x.block
        del x
        with gpu.stream(side):
            y = b.to(gpu.device, non_blocking=True)
        assert (y.block is block) == reused


# --- Exercise 3.1: a side-stream prefetcher -------------------------------------------


def prefetch_apex(batches, device, cuda):
    """The solution's shape: one batch ahead, wait_stream, record_stream."""
    side, main = cuda.Stream(), cuda.current_stream()

    def load(b):
        with cuda.stream(side):
            return b.to(device, non_blocking=True)

    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    ahead = load(first)
    for b in it:
        main.wait_stream(side)
        ahead.record_stream(main)
        current, ahead = ahead, load(b)
        yield current
    main.wait_stream(side)
    ahead.record_stream(main)
    yield ahead


class PrefetchClass:
    """A class with __iter__/__next__, events instead of wait_stream, .cuda()."""

    def __init__(self, batches, device, gpu):
        self.it, self.gpu = iter(batches), gpu
        self.side = gpu.Stream(device=device)
        self._load()

    def _load(self):
        try:
            b = next(self.it)
        except StopIteration:
            self.next_batch = None
            return
        with self.gpu.stream(self.side):
            self.next_batch = b.cuda(non_blocking=True)
            self.ready = self.gpu.Event()
            self.ready.record()

    def __iter__(self):
        return self

    def __next__(self):
        if self.next_batch is None:
            raise StopIteration
        main = self.gpu.current_stream()
        main.wait_event(self.ready)
        batch = self.next_batch
        batch.record_stream(main)
        self._load()
        return batch


def prefetch_record_at_copy(batches, device, cuda):
    """record_stream right after the copy; `with side:`; keyword arguments."""
    side = cuda.Stream()
    main = cuda.current_stream()
    pending = None
    for b in batches:
        with side:
            x = b.pin_memory().to(device=device, non_blocking=True)
            x.record_stream(main)
            done = side.record_event()
        if pending is not None:
            main.wait_event(pending[1])
            yield pending[0]
        pending = (x, done)
    if pending is not None:
        pending[1].wait(main)
        yield pending[0]


def prefetch_two_ahead(batches, device, cuda):
    """A queue two batches deep, but wait_stream after starting the next copies:
    each step also waits for the copies of the batches after it (serial when the
    loop waits for each step)."""
    side = cuda.Stream()
    queue = collections.deque()
    for b in batches:
        with cuda.stream(side):
            queue.append(b.to(device, None, True))
        if len(queue) > 2:
            cuda.current_stream().wait_stream(side)
            x = queue.popleft()
            x.record_stream(cuda.current_stream())
            yield x
    while queue:
        cuda.current_stream().wait_stream(side)
        x = queue.popleft()
        x.record_stream(cuda.current_stream())
        yield x


def prefetch_events_alias(batches, device, cuda):
    """Another spelling: an alias for the module, one event per batch, a list as
    the one-batch buffer, and harmless extra bookkeeping."""
    gpu, pending, count = cuda, [], 0
    copy_stream = gpu.Stream()
    for b in batches:
        with gpu.stream(copy_stream):
            on_device = b.to(device, non_blocking=True)
            ready = gpu.Event()
            ready.record(copy_stream)
        pending.append((on_device, ready))
        count += 1
        if len(pending) == 2:
            x, ev = pending.pop(0)
            gpu.current_stream().wait_event(ev)
            x.record_stream(gpu.current_stream())
            yield x
    for x, ev in pending:
        ev.wait(gpu.current_stream())
        x.record_stream(gpu.current_stream())
        yield x


_KEPT = {}


def prefetch_global_stream(batches, device, cuda):
    """Keeps its side stream (and the compute stream) from the first call."""
    side = _KEPT.setdefault("side", cuda.Stream())
    main = _KEPT.setdefault("main", cuda.current_stream())
    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    with cuda.stream(side):
        ahead = first.to(device, non_blocking=True)
    for b in it:
        main.wait_stream(side)
        ahead.record_stream(main)
        current = ahead
        with cuda.stream(side):
            ahead = b.to(device, non_blocking=True)
        yield current
    main.wait_stream(side)
    ahead.record_stream(main)
    yield ahead


def prefetch_float32(batches, device, cuda):
    """Right streams, but every batch is converted to float32 on the way."""
    side, main = cuda.Stream(), cuda.current_stream()
    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    with cuda.stream(side):
        ahead = first.float().to(device, non_blocking=True)
    for b in it:
        main.wait_stream(side)
        ahead.record_stream(main)
        current = ahead
        with cuda.stream(side):
            ahead = b.float().to(device, non_blocking=True)
        yield current
    main.wait_stream(side)
    ahead.record_stream(main)
    yield ahead


def prefetch_no_wait(batches, device, cuda):
    side = cuda.Stream()
    for b in batches:
        with cuda.stream(side):
            x = b.to(device, non_blocking=True)
        x.record_stream(cuda.current_stream())
        yield x


def prefetch_no_record_stream(batches, device, cuda):
    side, main = cuda.Stream(), cuda.current_stream()
    it = iter(batches)
    with cuda.stream(side):
        ahead = next(it).to(device, non_blocking=True)
    for b in it:
        main.wait_stream(side)
        current = ahead
        with cuda.stream(side):
            ahead = b.to(device, non_blocking=True)
        yield current
    main.wait_stream(side)
    yield ahead


def prefetch_wrong_direction(batches, device, cuda):
    side, main = cuda.Stream(), cuda.current_stream()
    for b in batches:
        side.wait_stream(main)  # the side stream waits for compute: backwards
        with cuda.stream(side):
            x = b.to(device, non_blocking=True)
        x.record_stream(main)
        yield x


def prefetch_record_on_side(batches, device, cuda):
    side, main = cuda.Stream(), cuda.current_stream()
    it = iter(batches)
    with cuda.stream(side):
        ahead = next(it).to(device, non_blocking=True)
    for b in it:
        main.wait_stream(side)
        ahead.record_stream(side)  # the stream it was allocated on: no effect
        current = ahead
        with cuda.stream(side):
            ahead = b.to(device, non_blocking=True)
        yield current
    main.wait_stream(side)
    yield ahead


def prefetch_same_stream(batches, device, cuda):
    for b in batches:
        yield b.to(device, non_blocking=True)


def prefetch_host_sync(batches, device, cuda):
    side = cuda.Stream()
    it = iter(batches)
    with cuda.stream(side):
        ahead = next(it).to(device, non_blocking=True)
    for b in it:
        side.synchronize()  # the CPU waits for the copy
        current = ahead
        with cuda.stream(side):
            ahead = b.to(device, non_blocking=True)
        yield current
    side.synchronize()
    yield ahead


def prefetch_blocking_copy(batches, device, cuda):
    side, main = cuda.Stream(), cuda.current_stream()
    for b in batches:
        with cuda.stream(side):
            x = b.to(device)  # non_blocking forgotten
        main.wait_stream(side)
        x.record_stream(main)
        yield x


def prefetch_everything_first(batches, device, cuda):
    side, main = cuda.Stream(), cuda.current_stream()
    loaded = []
    for b in batches:
        with cuda.stream(side):
            x = b.to(device, non_blocking=True)
            ev = cuda.Event()
            ev.record()
        loaded.append((x, ev))
    for x, ev in loaded:
        main.wait_event(ev)
        x.record_stream(main)
        yield x


def prefetch_no_copy(batches, device, cuda):
    yield from batches


def prefetch_drops_last(batches, device, cuda):
    side, main = cuda.Stream(), cuda.current_stream()
    it = iter(batches)
    with cuda.stream(side):
        ahead = next(it).to(device, non_blocking=True)
    for b in it:
        main.wait_stream(side)
        ahead.record_stream(main)
        current = ahead
        with cuda.stream(side):
            ahead = b.to(device, non_blocking=True)
        yield current


def prefetch_yield_in_side(batches, device, cuda):
    side = cuda.Stream()
    with cuda.stream(side):
        for b in batches:
            x = b.to(device, non_blocking=True)
            yield x  # the caller's work now lands on the side stream too


def prefetch_torch_cuda(batches, device, cuda):
    side = torch.cuda.Stream()
    for b in batches:
        with torch.cuda.stream(side):
            x = b.to(device, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        yield x


def prefetch_wait_once(batches, device, cuda):
    side, main = cuda.Stream(), cuda.current_stream()
    main.wait_stream(side)  # before anything was queued: waits for nothing
    for b in batches:
        with cuda.stream(side):
            x = b.to(device, non_blocking=True)
        x.record_stream(main)
        yield x


def prefetch_polls(batches, device, cuda):
    side = cuda.Stream()
    for b in batches:
        with cuda.stream(side):
            x = b.to(device, non_blocking=True)
        while not side.query():
            pass
        yield x


def prefetch_placeholder(batches, device, cuda):
    raise NotImplementedError("Exercise 3.1")


@pytest.mark.parametrize("fn", [prefetch_apex, PrefetchClass, prefetch_record_at_copy,
                                prefetch_events_alias])
def test_prefetch_correct(fn, capsys):
    check_prefetcher(fn)
    assert "Exercise 3.1 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (prefetch_no_wait, "while the copy into it was still running"),
    (prefetch_no_record_stream, "record_stream(cuda.current_stream())"),
    (prefetch_wrong_direction, "wait in that direction"),
    (prefetch_record_on_side, "memory was handed to the copy of batch"),
    (prefetch_same_stream, "copies queued on the stream that runs the training"),
    (prefetch_host_sync, "stream 1.synchronize()"),
    (prefetch_blocking_copy, "a blocking copy"),
    (prefetch_everything_first, "batches on the device at once"),
    (prefetch_no_copy, "never copied to the device"),
    (prefetch_drops_last, "the last one too"),
    (prefetch_yield_in_side, "never `yield` inside that block"),
    (prefetch_torch_cuda, "not torch.cuda"),
    (prefetch_wait_once, "while the copy into it was still running"),
    (prefetch_polls, "query() in a loop"),
    (prefetch_placeholder, "placeholder"),
    (prefetch_global_stream, "a stream kept from an earlier call"),
    (prefetch_float32, "in its own dtype"),
    (prefetch_two_ahead, "waited for the copy of the batch after it"),
])
def test_prefetch_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_prefetcher(fn)
    assert words in str(err.value)


def test_prefetch_verdicts_do_not_depend_on_speed():
    """Simulated time: the same answer gives the same reads, however busy we are."""
    a = run_standin_prefetch(prefetch_no_record_stream, 7, (3, 5), 1.0, 3.0)
    time.sleep(0.01)
    b = run_standin_prefetch(prefetch_no_record_stream, 7, (3, 5), 1.0, 3.0)
    assert [a["gpu"].read(op)[0] for op in a["steps"]] == [
        b["gpu"].read(op)[0] for op in b["steps"]]


# --- Exercise 3.2: overlap fraction --------------------------------------------------


def overlap_sweep(spans):
    edges = sorted([(s[1], 1) for s in spans if s[2] > s[1]]
                   + [(s[2], -1) for s in spans if s[2] > s[1]])
    running, busy, last = 0, 0.0, None
    for t, step in edges:
        if running >= 2:
            busy += t - last
        running, last = running + step, t
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    return busy / total if total else 0.0


def overlap_grid(spans, steps=20_000):
    """Sample the time axis finely (midpoints): right, if slow."""
    t0, t1 = min(s[1] for s in spans), max(s[2] for s in spans)
    if t1 == t0:
        return 0.0
    dt = (t1 - t0) / steps
    hits = 0
    for i in range(steps):
        t = t0 + (i + 0.5) * dt
        hits += sum(s[1] <= t < s[2] for s in spans) >= 2
    return hits / steps


def overlap_pieces(spans):
    """Cut time at every edge, count the pieces with two or more spans."""
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = 0.0
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        if sum(s[1] < hi and s[2] > lo for s in spans) >= 2:
            busy += hi - lo
    return busy / (cuts[-1] - cuts[0]) if len(cuts) > 1 else 0.0


def overlap_tensor(spans):
    """A torch version: running count by cumulative sum over sorted edges."""
    starts = torch.tensor([float(s[1]) for s in spans], dtype=torch.float64)
    ends = torch.tensor([float(s[2]) for s in spans], dtype=torch.float64)
    keep = ends > starts
    t = torch.cat([starts[keep], ends[keep]])
    step = torch.cat([torch.ones(int(keep.sum())), -torch.ones(int(keep.sum()))])
    order = torch.argsort(t * 2 + 0 * step, stable=True)
    t, step = t[order], step[order]
    # ends before starts at equal times
    key = torch.stack([t, step]).T.tolist()
    key.sort()
    t = torch.tensor([k[0] for k in key], dtype=torch.float64)
    running = torch.cumsum(torch.tensor([k[1] for k in key]), 0)
    busy = ((t[1:] - t[:-1]) * (running[:-1] >= 2)).sum()
    total = ends.max() - starts.min()
    return busy / total if total > 0 else torch.tensor(0.0)


def overlap_pairwise_sum(spans):
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    busy = sum(max(0.0, min(a[2], b[2]) - max(a[1], b[1]))
               for i, a in enumerate(spans) for b in spans[i + 1:])
    return busy / total


def overlap_first_two(spans):
    a, b = spans[0], spans[1]
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    return max(0.0, min(a[2], b[2]) - max(a[1], b[1])) / total


def overlap_over_busy_time(spans):
    edges = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans])
    running, busy, union, last = 0, 0.0, 0.0, None
    for t, step in edges:
        if running >= 2:
            busy += t - last
        if running >= 1:
            union += t - last
        running, last = running + step, t
    return busy / union


def overlap_from_zero(spans):
    edges = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans])
    running, busy, last = 0, 0.0, None
    for t, step in edges:
        if running >= 2:
            busy += t - last
        running, last = running + step, t
    return busy / max(s[2] for s in spans)


def overlap_touching_counts(spans):
    """Counts a span as running in a piece it only touches (<= instead of <)."""
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = 0.0
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        if sum(s[1] <= hi and s[2] >= lo for s in spans) >= 2:
            busy += hi - lo
    return busy / (cuts[-1] - cuts[0])


def overlap_neighbours(spans):
    spans = sorted(spans, key=lambda s: s[1])
    busy = sum(max(0.0, min(a[2], b[2]) - max(a[1], b[1]))
               for a, b in zip(spans, spans[1:], strict=False))
    return busy / (max(s[2] for s in spans) - spans[0][1])


def overlap_lanes_only(spans):
    """Only counts overlap between different lanes."""
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = 0.0
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        lanes = {s[0] for s in spans if s[1] < hi and s[2] > lo}
        busy += (hi - lo) * (len(lanes) >= 2)
    return busy / (cuts[-1] - cuts[0])


def overlap_unsorted(spans):
    """Sweeps the spans in the order given."""
    busy, end = 0.0, spans[0][2]
    for s in spans[1:]:
        busy += max(0.0, min(end, s[2]) - s[1])
        end = max(end, s[2])
    return busy / (max(s[2] for s in spans) - min(s[1] for s in spans))


def overlap_percent(spans):
    return 100 * overlap_pieces(spans)


def overlap_three_tuples(spans):
    busy = 0.0
    for _lane, start, end in spans:  # breaks on labelled spans
        busy += 0 * (end - start)
    return overlap_pieces(spans)


class OverlapMeter:
    """A class whose instances are called: pieces between edges, via a dict."""

    def __call__(self, spans):
        spans = [tuple(s) for s in spans]
        cuts = sorted({float(t) for s in spans for t in s[1:3]})
        running = {(lo, hi): sum(1 for s in spans if s[1] < hi and s[2] > lo)
                   for lo, hi in zip(cuts, cuts[1:], strict=False)}
        busy = sum(hi - lo for (lo, hi), k in running.items() if k > 1)
        wall = cuts[-1] - cuts[0] if cuts else 0.0
        return 0.0 if wall == 0 else busy / wall


def overlap_pop_sorted(spans):
    """Sorts the caller's list in place: the caller's order is lost."""
    spans.sort(key=lambda s: s[1]) if isinstance(spans, list) else None
    return overlap_sweep(spans)


def overlap_consumes(spans):
    """Pops the spans off the caller's list while sweeping."""
    value = overlap_pieces(list(spans))
    if isinstance(spans, list):
        while spans:
            spans.pop()
    return value


_SEEN = []


def overlap_cached(spans):
    """Remembers every answer; returns the first one on later calls."""
    _SEEN.append(overlap_pieces(spans))
    return _SEEN[0]


def overlap_float32(spans):
    """Right sweep, but the times pass through float32 (perf_counter-sized
    times lose their digits)."""
    fixed = [(s[0], float(torch.tensor(s[1], dtype=torch.float32)),
              float(torch.tensor(s[2], dtype=torch.float32))) for s in spans]
    return overlap_sweep(fixed)


def overlap_integer_times(spans):
    """Rounds every time to a whole number."""
    return overlap_pieces([(s[0], round(s[1]), round(s[2])) for s in spans])


def overlap_list_result(spans):
    return [overlap_pieces(spans)]


def overlap_hangs(spans):
    while True:
        time.sleep(0.01)


MEASURED = [("thread 1", 100.0, 100.05, "x"), ("thread 2", 100.01, 100.06, "y")]


@pytest.mark.parametrize("fn", [overlap_sweep, overlap_grid, overlap_pieces,
                                overlap_tensor, OverlapMeter()])
def test_overlap_correct(fn, capsys):
    check_overlap_fraction(fn, measured_spans=MEASURED)
    assert "Exercise 3.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (overlap_pairwise_sum, "counts once"),
    (overlap_first_two, "compare all spans"),
    (overlap_over_busy_time, "gaps"),
    (overlap_from_zero, "first start, not from 0"),
    (lambda spans: 0.5, "two spans running the whole time"),
    (overlap_touching_counts, "only touch"),
    (overlap_neighbours, "not neighbours"),
    (overlap_lanes_only, "count spans, not lanes"),
    (overlap_unsorted, "sort"),
    (overlap_percent, "not a percentage"),
    (overlap_three_tuples, "ValueError"),
    (lambda spans: NotImplementedError and (_ for _ in ()).throw(
        NotImplementedError("Exercise 3.2")), "placeholder"),
    (overlap_consumes, "leave the spans it was given"),
    (overlap_pop_sorted, "in their order"),
    (overlap_cached, "no state kept between calls"),
    (overlap_float32, "= "),
    (overlap_integer_times, "= "),
    (overlap_list_result, "to return a number"),
    (overlap_hangs, "within 10 s"),
])
def test_overlap_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_overlap_fraction(fn)
    assert words in str(err.value)


# --- Exercise 3.3: loading ahead in threads ---------------------------------------


def _stack(dataset, start, batch_size):
    samples = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
    xs, ys = zip(*samples, strict=True)
    return torch.stack(xs), torch.stack(ys)


def ahead_threads_queue(dataset, batch_size, workers):
    """Plain threads: a task queue, results by batch number, a semaphore as the
    bound, a stop flag set on close."""
    starts = list(range(0, len(dataset), batch_size))
    if workers == 0:
        for s in starts:
            yield _stack(dataset, s, batch_size)
        return
    tasks, results = queue.Queue(), {}
    done = threading.Condition()
    room = threading.Semaphore(2 * workers)
    stop = threading.Event()

    def work():
        while not stop.is_set():
            try:
                k = tasks.get(timeout=0.01)
            except queue.Empty:
                continue
            if k is None:
                return
            try:
                out = ("ok", _stack(dataset, starts[k], batch_size))
            except Exception as e:  # handed to the loop
                out = ("error", e)
            with done:
                results[k] = out
                done.notify_all()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()

    def feed():
        for k in range(len(starts)):
            while not room.acquire(timeout=0.01):
                if stop.is_set():
                    return
            tasks.put(k)
        for _ in threads:
            tasks.put(None)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        for k in range(len(starts)):
            with done:
                done.wait_for(lambda k=k: k in results)
                kind, value = results.pop(k)
            if kind == "error":
                raise value
            room.release()
            yield value
    finally:
        stop.set()
        feeder.join()
        for t in threads:
            t.join()


class AheadIterator:
    """A class with __iter__/__next__/close over a thread pool."""

    def __init__(self, dataset, batch_size, workers):
        self.dataset, self.bs, self.workers = dataset, batch_size, workers
        self.starts = iter(range(0, len(dataset), batch_size))
        self.pool = ThreadPoolExecutor(workers) if workers else None
        self.pending = collections.deque()
        if self.pool:
            for s in itertools.islice(self.starts, 2 * workers):
                self.pending.append(self.pool.submit(_stack, dataset, s, batch_size))

    def __iter__(self):
        return self

    def __next__(self):
        if self.pool is None:
            s = next(self.starts)
            return _stack(self.dataset, s, self.bs)
        if not self.pending:
            self.close()
            raise StopIteration
        future = self.pending.popleft()
        try:
            batch = future.result()
        except Exception:
            self.close()
            raise
        s = next(self.starts, None)
        if s is not None:
            self.pending.append(self.pool.submit(_stack, self.dataset, s, self.bs))
        return batch

    def close(self):
        if self.pool is not None:
            for f in self.pending:
                f.cancel()
            self.pool.shutdown(wait=True)


def ahead_submit_after_yield(dataset, batch_size, workers):
    """Submits the next load after the yield; an alias for the executor; a
    list instead of a deque; extra harmless counting."""
    import concurrent.futures as cf

    starts = list(range(0, len(dataset), batch_size))
    handed = 0
    if not workers:
        for s in starts:
            handed += 1
            yield _stack(dataset, s, batch_size)
        return
    with cf.ThreadPoolExecutor(max_workers=workers) as ex:
        futures = [ex.submit(_stack, dataset, s, batch_size)
                   for s in starts[:2 * workers]]
        nxt = 2 * workers
        try:
            while futures:
                batch = futures.pop(0).result()
                handed += 1
                yield batch
                if nxt < len(starts):
                    futures.append(ex.submit(_stack, dataset, starts[nxt], batch_size))
                    nxt += 1
        finally:
            for f in futures:
                f.cancel()


def ahead_one_ahead(dataset, batch_size, workers):
    """Keeps only `workers` batches in flight (less than allowed): still fed."""
    starts = iter(range(0, len(dataset), batch_size))
    if workers == 0:
        yield from (_stack(dataset, s, batch_size) for s in starts)
        return
    with ThreadPoolExecutor(workers) as pool:
        flight = collections.deque(pool.submit(_stack, dataset, s, batch_size)
                                   for s in itertools.islice(starts, workers))
        try:
            while flight:
                done = flight.popleft().result()
                s = next(starts, None)
                if s is not None:
                    flight.append(pool.submit(_stack, dataset, s, batch_size))
                yield done
        finally:
            for f in flight:
                f.cancel()


def ahead_map_per_batch(dataset, batch_size, workers):
    """Each batch's samples loaded by the pool's map (at most `workers` at once),
    the next batch's map started before handing this one out."""
    starts = list(range(0, len(dataset), batch_size))
    if workers == 0:
        for s in starts:
            yield _stack(dataset, s, batch_size)
        return

    def sample_ids(s):
        return range(s, min(s + batch_size, len(dataset)))

    with ThreadPoolExecutor(workers) as pool:
        def start(s):
            return [pool.submit(dataset.__getitem__, i) for i in sample_ids(s)]

        queued = collections.deque(start(s) for s in starts[:2])
        nxt = 2
        try:
            while queued:
                samples = [f.result() for f in queued.popleft()]
                if nxt < len(starts):
                    queued.append(start(starts[nxt]))
                    nxt += 1
                xs, ys = zip(*samples, strict=True)
                yield torch.stack(xs), torch.stack(ys)
        finally:
            for fs in queued:
                for f in fs:
                    f.cancel()


# wrong answers -----------------------------------------------------------------


def ahead_sequential(dataset, batch_size, workers):
    """Ignores `workers`: loads in the loop."""
    for s in range(0, len(dataset), batch_size):
        yield _stack(dataset, s, batch_size)


def ahead_all_first(dataset, batch_size, workers):
    """Loads the whole epoch in the pool, then yields."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        batches = list(pool.map(lambda s: _stack(dataset, s, batch_size),
                                range(0, len(dataset), batch_size)))
    yield from batches


def ahead_unbounded(dataset, batch_size, workers):
    """Submits every batch at once (no bound), yields in order."""
    if workers == 0:
        yield from ahead_sequential(dataset, batch_size, 0)
        return
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(_stack, dataset, s, batch_size)
                   for s in range(0, len(dataset), batch_size)]
        for f in futures:
            yield f.result()


def ahead_completion_order(dataset, batch_size, workers):
    """Yields whichever batch finished first."""
    from concurrent.futures import FIRST_COMPLETED, wait

    starts = iter(range(0, len(dataset), batch_size))
    if workers == 0:
        yield from ahead_sequential(dataset, batch_size, 0)
        return
    with ThreadPoolExecutor(workers) as pool:
        running = {pool.submit(_stack, dataset, s, batch_size)
                   for s in itertools.islice(starts, 2 * workers)}
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                s = next(starts, None)
                if s is not None:
                    running.add(pool.submit(_stack, dataset, s, batch_size))
                yield f.result()


def _pipeline(dataset, batch_size, workers, load=_stack, starts=None, threads=None):
    """A right pipeline that the wrong answers below change in one place."""
    starts = iter(starts if starts is not None else range(0, len(dataset), batch_size))
    with ThreadPoolExecutor(threads or max(1, workers)) as pool:
        pend = collections.deque(pool.submit(load, dataset, s, batch_size)
                                 for s in itertools.islice(starts, 2 * max(1, workers)))
        try:
            while pend:
                f = pend.popleft()
                s = next(starts, None)
                if s is not None:
                    pend.append(pool.submit(load, dataset, s, batch_size))
                yield f
        finally:
            for f in pend:
                f.cancel()


def ahead_drop_last(dataset, batch_size, workers):
    full = range(0, len(dataset) // batch_size * batch_size, batch_size)
    for f in _pipeline(dataset, batch_size, workers, starts=full):
        yield f.result()


def ahead_samples_list(dataset, batch_size, workers):
    """Yields lists of samples, not stacked tensors."""
    for s in range(0, len(dataset), batch_size):
        yield [dataset[i] for i in range(s, min(s + batch_size, len(dataset)))]


def ahead_float32(dataset, batch_size, workers):
    for x, y in ahead_one_ahead(dataset, batch_size, workers):
        yield x.float(), y


def ahead_threads_when_zero(dataset, batch_size, workers):
    """Uses a pool thread even for workers=0."""
    for f in _pipeline(dataset, batch_size, workers):
        yield f.result()


def ahead_too_many_threads(dataset, batch_size, workers):
    """A pool twice as big as asked."""
    if workers == 0:
        yield from ahead_sequential(dataset, batch_size, 0)
        return
    for f in _pipeline(dataset, batch_size, workers, threads=2 * workers):
        yield f.result()


def ahead_swallows_errors(dataset, batch_size, workers):
    """Skips a batch whose load failed."""
    if workers == 0:
        yield from ahead_sequential(dataset, batch_size, 0)
        return
    for f in _pipeline(dataset, batch_size, workers):
        try:
            yield f.result()
        except ValueError:
            continue


def _safe_stack(dataset, start, batch_size):
    try:
        return _stack(dataset, start, batch_size)
    except Exception:
        return None  # the error dies here


def ahead_dies_silently(dataset, batch_size, workers):
    """A failed load gives None, and the loop waits for a batch that never comes."""
    if workers == 0:
        yield from ahead_sequential(dataset, batch_size, 0)
        return
    for f in _pipeline(dataset, batch_size, workers, load=_safe_stack):
        while f.result() is None:
            time.sleep(0.01)
        yield f.result()


def ahead_leaks_threads(dataset, batch_size, workers):
    """Worker threads and a bounded queue that nobody stops when the loop stops
    early: the threads wait for ever for room that never comes."""
    starts = list(range(0, len(dataset), batch_size))
    if workers == 0:
        yield from ahead_sequential(dataset, batch_size, 0)
        return
    tasks, results, done = queue.Queue(), {}, threading.Condition()
    room = threading.Semaphore(2 * workers)

    def work():
        while (k := tasks.get()) is not None:
            out = _stack(dataset, starts[k], batch_size)
            with done:
                results[k] = out
                done.notify_all()

    def feed():
        for k in range(len(starts)):
            room.acquire()
            tasks.put(k)
        for _ in range(workers):
            tasks.put(None)

    for target in [work] * workers + [feed]:
        threading.Thread(target=target, daemon=True).start()
    for k in range(len(starts)):
        with done:
            done.wait_for(lambda k=k: k in results)
            batch = results.pop(k)
        room.release()
        yield batch


_POOL = ThreadPoolExecutor(2)


def ahead_shared_pool(dataset, batch_size, workers):
    """One module-level pool for every call, shut down after the first."""
    starts = iter(range(0, len(dataset), batch_size))
    pend = collections.deque(_POOL.submit(_stack, dataset, s, batch_size)
                             for s in itertools.islice(starts, 2 * max(1, workers)))
    while pend:
        b = pend.popleft().result()
        s = next(starts, None)
        if s is not None:
            pend.append(_POOL.submit(_stack, dataset, s, batch_size))
        yield b
    _POOL.shutdown(wait=False)


def ahead_dataloader(dataset, batch_size, workers):
    """A DataLoader's worker processes: the dataset cannot be read there."""
    return iter(DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                           timeout=5, multiprocessing_context="fork"
                           if workers else None))


def ahead_placeholder(dataset, batch_size, workers):
    raise NotImplementedError("Exercise 3.3")


@pytest.mark.parametrize("fn", [ahead_threads_queue, AheadIterator,
                                ahead_submit_after_yield, ahead_one_ahead,
                                ahead_map_per_batch])
def test_load_ahead_correct(fn, capsys):
    check_load_ahead(fn)
    assert "Exercise 3.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (ahead_sequential, "waited"),
    (ahead_all_first, "loaded ahead of the one handed out"),
    (ahead_unbounded, "loaded ahead of the one handed out"),
    (ahead_completion_order, "in their order"),
    (ahead_drop_last, "the last one too"),
    (ahead_samples_list, "torch.stack"),
    (ahead_float32, "no dtype change"),
    (ahead_threads_when_zero, "workers=0"),
    (ahead_too_many_threads, "loading at once"),
    (ahead_swallows_errors, "sample 9 is corrupt"),
    (ahead_dies_silently, "still running"),
    (ahead_leaks_threads, "the threads end"),
    (ahead_shared_pool, "cannot schedule new futures"),
    (ahead_dataloader, "start threads"),
    (ahead_placeholder, "placeholder"),
])
def test_load_ahead_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_load_ahead(fn)
    assert words in str(err.value)


def test_traced_samples_refuse_other_processes():
    data = TracedSamples(4, 0.0)
    data._pid = -1  # as seen from a worker process
    with pytest.raises(RuntimeError, match="load in threads"):
        data[0]
