"""Chapter 3's checkers: correct answers pass, typical mistakes fail by name."""

from __future__ import annotations

import collections
import math
import time

import pytest
import torch
from torch.utils.data import DataLoader

from course_utils.checks.ch03 import (
    StandInCuda,
    check_loader_config,
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
    """A queue two batches deep; waits after starting the next copy."""
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
                                prefetch_two_ahead])
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


MEASURED = [("thread 1", 100.0, 100.05, "x"), ("thread 2", 100.01, 100.06, "y")]


@pytest.mark.parametrize("fn", [overlap_sweep, overlap_grid, overlap_pieces,
                                overlap_tensor])
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
    (overlap_percent, "two spans running the whole time"),
    (overlap_three_tuples, "ValueError"),
    (lambda spans: NotImplementedError and (_ for _ in ()).throw(
        NotImplementedError("Exercise 3.2")), "placeholder"),
])
def test_overlap_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_overlap_fraction(fn)
    assert words in str(err.value)


# --- Exercise 3.3: a DataLoader that keeps the step fed --------------------------


def loader_ceil(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size,
                      num_workers=math.ceil(load_s / step_s),
                      pin_memory=device.type == "cuda", timeout=30)


def loader_spare(dataset, batch_size, load_s, step_s, device):
    """One spare worker; persistent workers; prefetch of 4 batches each."""
    k = int(load_s // step_s) + 1
    return DataLoader(dataset, batch_size, shuffle=True, num_workers=k,
                      pin_memory=torch.device(device).type == "cuda",
                      prefetch_factor=4, persistent_workers=True)


def loader_zero_when_cheap(dataset, batch_size, load_s, step_s, device):
    """No worker when loading is cheap; keyword-free positional batch size."""
    k = 0 if load_s <= 0.3 * step_s else -(-load_s // step_s)
    kwargs = {"prefetch_factor": 2} if k else {}
    return DataLoader(dataset, batch_size, num_workers=int(k),
                      pin_memory=str(device).startswith("cuda"), **kwargs)


def loader_ratio_plus_one(dataset, batch_size, load_s, step_s, device):
    from torch.utils import data as tud

    workers = math.ceil(load_s / step_s + 0.5)
    return tud.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                          pin_memory=(device.type == "cuda"),
                          multiprocessing_context="fork")


def loader_ceil_plus_one(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size,
                      num_workers=math.ceil(load_s / step_s) + 1,
                      pin_memory=device.type == "cuda")


def loader_no_workers(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=device.type == "cuda")


def loader_one_worker(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size, num_workers=1,
                      pin_memory=device.type == "cuda")


def loader_two_workers(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size, num_workers=2,
                      pin_memory=device.type == "cuda")


def loader_eight_workers(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size, num_workers=8,
                      pin_memory=device.type == "cuda")


def loader_floor(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size,
                      num_workers=int(load_s / step_s),
                      pin_memory=device.type == "cuda")


def loader_inverted_ratio(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size,
                      num_workers=math.ceil(step_s / load_s) if load_s else 0,
                      pin_memory=device.type == "cuda")


def loader_always_pinned(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size,
                      num_workers=math.ceil(load_s / step_s), pin_memory=True)


def loader_never_pinned(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size,
                      num_workers=math.ceil(load_s / step_s))


def loader_no_batch_size(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, num_workers=math.ceil(load_s / step_s),
                      pin_memory=device.type == "cuda")


def loader_drop_last(dataset, batch_size, load_s, step_s, device):
    return DataLoader(dataset, batch_size=batch_size, drop_last=True,
                      num_workers=math.ceil(load_s / step_s),
                      pin_memory=device.type == "cuda")


def loader_returns_config(dataset, batch_size, load_s, step_s, device):
    return {"num_workers": math.ceil(load_s / step_s), "pin_memory": False}


def loader_placeholder(dataset, batch_size, load_s, step_s, device):
    raise NotImplementedError("Exercise 3.3")


@pytest.mark.parametrize("fn", [loader_ceil, loader_spare, loader_zero_when_cheap,
                                loader_ratio_plus_one])
def test_loader_correct(fn, capsys):
    check_loader_config(fn, device="cpu")
    assert "Exercise 3.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (loader_no_workers, "k x step >= load"),
    (loader_one_worker, "k x step >= load"),
    (loader_two_workers, "num_workers=2"),
    (loader_ceil_plus_one, "the main process alone keeps up"),
    (loader_eight_workers, "num_workers=8"),
    (loader_floor, "k x step >= load"),
    (loader_inverted_ratio, "num_workers="),
    (loader_always_pinned, "pin_memory=False for device 'cpu'"),
    (loader_never_pinned, "pin_memory=True for device 'cuda'"),
    (loader_no_batch_size, "batch_size="),
    (loader_drop_last, "once per epoch"),
    (loader_returns_config, "a torch.utils.data.DataLoader"),
    (loader_placeholder, "placeholder"),
])
def test_loader_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_loader_config(fn, device="cpu")
    assert words in str(err.value)
