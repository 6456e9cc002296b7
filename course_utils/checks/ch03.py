"""Checkers for Chapter 3 ("Streams and asynchronous execution").

Exercise 3.1 (a side-stream prefetcher) is checked on every machine with a
**stand-in GPU**: an object with ``torch.cuda``'s stream API (``Stream``,
``Event``, ``stream``, ``current_stream``, ``wait_stream``, ``wait_event``,
``record_stream``, ``synchronize``, ``query``) whose queued work runs in
*simulated* time. A copy or a kernel takes the time the checker gives it, a
stream runs its work in order, two streams run at once unless an event or
``wait_stream`` orders them, and a caching allocator hands a freed block to
the next copy on its stream at once unless ``record_stream`` said another
stream still uses it. Because the clock is simulated, a missing wait reads an
unfinished copy, and a missing ``record_stream`` reads a block that the next
copy is overwriting, every time, whatever the machine's load. On a machine
with a GPU the same answer then runs for real.

Exercise 3.2 (``overlap_fraction``) is checked against hand-made cases with
known answers and against seeded random span sets (ties, touching spans,
zero-length spans, many spans at once), compared with a reference.

Exercise 3.3 (a DataLoader configuration) is judged by *measured starvation*:
the time the training loop waits for its next batch, in the second half of an
epoch, with a dataset whose loading cost and a training step whose cost the
checker sets (both are sleeps, so the verdict does not depend on how busy the
machine is), and by the number of worker processes it starts.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from course_utils.exercises import (
    ExerciseFailed,
    call_learner,
    check_close,
    check_type,
    fail,
    passed,
    require_solution,
)

TIMEOUT_S = 10.0


def _run_with_timeout(exercise: str, fn: Callable, *args, timeout: float = TIMEOUT_S,
                      **kwargs):
    """Call ``fn`` in a thread; fail kindly if it does not return in time."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        fail(exercise, f"your code to finish within {timeout:.0f} s",
             "it was still running (a loop that never ends, or a wait for "
             "something that never happens?)",
             "look for a `while` loop that polls, or a wait on the wrong thing")
    if "error" in out:
        raise out["error"]
    return out["value"]


# --- a stand-in GPU: torch.cuda's stream API in simulated time ------------------


class StandInDevice:
    """What ``batch.to(device)`` takes to copy onto the stand-in GPU."""

    type = "cuda"
    index = 0

    def __init__(self, gpu: StandInCuda):
        self.gpu = gpu

    def __repr__(self):
        return "device(type='cuda', index=0) [stand-in]"


class StandInStream:
    """An in-order queue of simulated work. ``tail``: when its queued work ends."""

    def __init__(self, gpu: StandInCuda, name: str):
        self.gpu, self.name, self.tail = gpu, name, 0.0

    def __repr__(self):
        return f"<stand-in stream {self.name!r}>"

    # ordering, on the (simulated) GPU: the host does not wait
    def wait_stream(self, stream: StandInStream) -> None:
        self.gpu._check_stream(stream)
        self.tail = max(self.tail, stream.tail)

    def wait_event(self, event: StandInEvent) -> None:
        self.gpu._check_event(event)
        if event.time is not None:  # waiting on an unrecorded event does nothing
            self.tail = max(self.tail, event.time)

    def record_event(self, event: StandInEvent | None = None) -> StandInEvent:
        event = event or StandInEvent(self.gpu)
        event.record(self)
        return event

    # the host
    def synchronize(self) -> None:
        self.gpu._host_wait(self.tail, f"{self.name}.synchronize()")

    def query(self) -> bool:
        return self.gpu._poll(self.tail)

    def __enter__(self):
        self._ctx = self.gpu.stream(self)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class StandInEvent:
    """A point in a stream: done once the work queued before it has run."""

    def __init__(self, gpu: StandInCuda, enable_timing: bool = False,
                 blocking: bool = False, interprocess: bool = False):
        self.gpu, self.time = gpu, None

    def record(self, stream: StandInStream | None = None) -> None:
        stream = stream or self.gpu.current_stream()
        self.gpu._check_stream(stream)
        self.time = max(stream.tail, self.gpu.host_t)

    def wait(self, stream: StandInStream | None = None) -> None:
        (stream or self.gpu.current_stream()).wait_event(self)

    def query(self) -> bool:
        return True if self.time is None else self.gpu._poll(self.time)

    def synchronize(self) -> None:
        if self.time is not None:
            self.gpu._host_wait(self.time, "event.synchronize()")

    def elapsed_time(self, end: StandInEvent) -> float:
        return (end.time - self.time) * 1e3


class _Block:
    """Device memory: who allocated it on which stream, and every write to it."""

    def __init__(self, number: int, stream: StandInStream, nbytes: int):
        self.number, self.stream, self.nbytes = number, stream, nbytes
        self.reusable_at = -math.inf  # host time after which another copy may take it


class DeviceBatch:
    """A batch on the stand-in GPU: its memory block and the streams that use it."""

    def __init__(self, gpu: StandInCuda, block: _Block, shape, index: int,
                 copy_op: dict):
        self.gpu, self.block, self.shape, self.index = gpu, block, shape, index
        self.copy_op = copy_op
        self.device = gpu.device
        self._used_by: set[StandInStream] = set()
        gpu._live += 1
        gpu.max_live = max(gpu.max_live, gpu._live)

    def record_stream(self, stream: StandInStream) -> None:
        self.gpu._check_stream(stream)
        self._used_by.add(stream)

    def to(self, *args, **kwargs):
        fail(self.gpu.exercise, "the batch used on the GPU as it is",
             "a batch that was already on the GPU copied again",
             "copy each CPU batch once: batch.to(device, non_blocking=True)")

    def __repr__(self):
        return f"<batch {self.index} on the stand-in GPU, block {self.block.number}>"

    def __del__(self):
        # Like PyTorch's caching allocator: the block goes back to the pool of the
        # stream it was allocated on. Streams named by record_stream (other than
        # that one) must first finish the work queued on them now.
        gpu = self.gpu
        gpu._live -= 1
        others = [s for s in self._used_by if s is not self.block.stream]
        self.block.reusable_at = max((s.tail for s in others), default=-math.inf)
        gpu._free.append(self.block)


class HostBatch(torch.Tensor):
    """A (pinned) CPU batch; ``.to(stand-in device)`` queues an asynchronous copy."""

    def to(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if args else None)
        if isinstance(device, StandInDevice):
            rest = [a for a in args[1:] if isinstance(a, bool)]
            non_blocking = kwargs.get("non_blocking", rest[0] if rest else False)
            return device.gpu._copy_in(self, bool(non_blocking))
        if isinstance(device, str) and device.startswith("cuda"):
            fail(_CURRENT[0].exercise if _CURRENT else "3.1",
                 "the copy to go to the `device` you were given",
                 f"batch.to({device!r})",
                 "use the `device` argument (it is the real GPU on a GPU machine)")
        return super().to(*args, **kwargs)

    def cuda(self, device=None, non_blocking: bool = False):
        if not _CURRENT:
            return super().cuda(device, non_blocking)
        return self.to(_CURRENT[0].device, non_blocking=non_blocking)

    def pin_memory(self, *args, **kwargs):
        return self

    def is_pinned(self, *args, **kwargs):
        return True


_CURRENT: list[StandInCuda] = []  # the stand-in that HostBatch.cuda() copies to


class StandInCuda:
    """A pretend GPU with ``torch.cuda``'s stream API; work runs in simulated time.

    ``copy_s`` is how long one batch's host-to-device copy takes; kernels
    queued with ``launch`` take the time they are given; queuing costs the host
    ``launch_s``. The host never waits unless something makes it
    (``synchronize``, a blocking copy, polling ``query``); every such wait is
    counted in ``host_waits``.
    """

    def __init__(self, copy_s: float = 1.0, launch_s: float = 0.0,
                 exercise: str = "3.1"):
        self.copy_s, self.launch_s, self.exercise = copy_s, launch_s, exercise
        self.device = StandInDevice(self)
        self._default = StandInStream(self, "default stream")
        self._current = self._default
        self._streams = [self._default]
        self.host_t = 0.0
        self.host_waits: list[str] = []
        self.ops: list[dict] = []     # every queued copy and kernel, in queue order
        self._free: list[_Block] = []
        self._blocks = 0
        self._live = 0
        self.max_live = 0
        self._copies = 0

    # torch.cuda's names
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def Stream(  # noqa: N802
            self, device=None, priority: int = 0, **kwargs) -> StandInStream:
        s = StandInStream(self, f"stream {len(self._streams)}")
        self._streams.append(s)
        return s

    def Event(self, enable_timing: bool = False, blocking: bool = False,  # noqa: N802
              interprocess: bool = False) -> StandInEvent:
        return StandInEvent(self, enable_timing, blocking, interprocess)

    def current_stream(self, device=None) -> StandInStream:
        return self._current

    def default_stream(self, device=None) -> StandInStream:
        return self._default

    def set_stream(self, stream: StandInStream) -> None:
        self._check_stream(stream)
        self._current = stream

    @contextlib.contextmanager
    def stream(self, stream: StandInStream | None):
        if stream is None:
            yield
            return
        self._check_stream(stream)
        before, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = before

    def synchronize(self, device=None) -> None:
        self._host_wait(max(s.tail for s in self._streams), "synchronize()")

    def current_device(self) -> int:
        return 0

    # plumbing
    def _check_stream(self, stream) -> None:
        if not isinstance(stream, StandInStream):
            fail(self.exercise, "a stream made by `cuda.Stream()` or "
                 "`cuda.current_stream()`", f"{type(stream).__name__} {stream!r:.60}",
                 "use the `cuda` argument's streams (torch.cuda's on a GPU)")

    def _check_event(self, event) -> None:
        if not isinstance(event, StandInEvent):
            fail(self.exercise, "an event made by `cuda.Event()`",
                 f"{type(event).__name__} {event!r:.60}",
                 "use the `cuda` argument's Event (torch.cuda's on a GPU)")

    def _host_wait(self, until: float, what: str) -> None:
        if until > self.host_t:
            self.host_waits.append(what)
            self.host_t = until

    def _poll(self, until: float) -> bool:
        done = until <= self.host_t
        if not done:  # polling takes host time too, and it is time spent waiting
            self.host_waits.append("query() in a loop")
            self.host_t = min(until, self.host_t + 0.01 * self.copy_s)
        return done

    def _enqueue(self, duration: float, kind: str, label: str, **info) -> dict:
        s = self._current
        start = max(s.tail, self.host_t)
        op = {"stream": s, "start": start, "end": start + duration, "kind": kind,
              "label": label, **info}
        s.tail = op["end"]
        self.host_t += self.launch_s
        self.ops.append(op)
        return op

    def _allocate(self, nbytes: int) -> _Block:
        s = self._current
        for block in reversed(self._free):  # the block freed last is handed out first
            if (block.stream is s and block.nbytes == nbytes
                    and block.reusable_at <= self.host_t):
                self._free.remove(block)
                return block
        self._blocks += 1
        return _Block(self._blocks, s, nbytes)

    def _copy_in(self, host: HostBatch, non_blocking: bool) -> DeviceBatch:
        index = getattr(host, "batch_index", self._copies)
        self._copies += 1
        block = self._allocate(host.numel() * host.element_size())
        payload = host.detach().as_subclass(torch.Tensor).clone()
        op = self._enqueue(self.copy_s, "copy", f"copy {index}", block=block,
                           payload=payload, index=index)
        if not non_blocking:
            self._host_wait(op["end"], "a blocking copy (non_blocking=False)")
        return DeviceBatch(self, block, tuple(host.shape), index, op)

    def launch(self, fn: Callable, batch, duration: float, label: str = "") -> dict:
        """Queue a kernel that reads ``batch`` on the current stream: ``fn(values)``."""
        if not isinstance(batch, DeviceBatch):
            return {"not_on_device": batch}
        return self._enqueue(duration, "kernel", label or f"step {batch.index}",
                             copy=batch.copy_op, fn=fn)

    def read(self, op: dict) -> tuple[str, object]:
        """What a kernel read: ('ok', value), ('unwritten', i) or ('overwritten', j).

        The kernel reads its batch from its start to its end. It read an
        unfinished copy if that copy ended after the kernel started; it read
        another batch if a later copy into the same block began before the
        kernel ended.
        """
        own, start, end = op["copy"], op["start"], op["end"]
        if own["end"] > start:
            return "unwritten", own["index"]
        for w in self.ops:
            if (w["kind"] == "copy" and w["block"] is own["block"] and w is not own
                    and w["start"] < end and w["end"] > own["start"]):
                return "overwritten", w["index"]
        return "ok", op["fn"](own["payload"])

    def spans(self) -> list[tuple]:
        """(lane, start, end, label) of every copy and kernel, for a timeline."""
        return [(op["stream"].name, op["start"], op["end"], op["label"])
                for op in self.ops]

    def __enter__(self):
        _CURRENT.append(self)
        return self

    def __exit__(self, *exc):
        _CURRENT.remove(self)


def host_batches(n: int, shape: tuple, seed: int) -> list[HostBatch]:
    """``n`` seeded random CPU batches (no two alike), each knowing its index."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = (torch.randn(shape, generator=g) + i).as_subclass(HostBatch)
        b.batch_index = i
        out.append(b)
    return out


def batch_value(values: torch.Tensor) -> float:
    """What the checker's training step computes from a batch: a weighted sum."""
    w = torch.arange(1, values.numel() + 1, dtype=torch.float64)
    return float((values.double().flatten() * w).sum())


# --- Exercise 3.1: a side-stream prefetcher -------------------------------------

# (batches, batch shape, copy time, step time): copy-bound and compute-bound runs
_PREFETCH_CASES = [
    (7, (3, 5), 1.0, 3.0),
    (6, (17,), 3.0, 1.0),
    (1, (2, 3), 1.0, 2.0),
    (9, (4, 4), 2.0, 2.0),
]


def _serial_and_ideal(n: int, copy_s: float, step_s: float) -> tuple[float, float]:
    serial = n * (copy_s + step_s)
    ideal = copy_s + (n - 1) * max(copy_s, step_s) + step_s
    return serial, ideal


def run_standin_prefetch(fn: Callable, n: int, shape: tuple, copy_s: float,
                         step_s: float, seed: int = 0, exercise: str = "3.1") -> dict:
    """Run ``fn(batches, device, cuda)`` on the stand-in, with a training loop.

    The loop queues one step (reading the batch) on the current stream per
    batch it is given, never waits, and synchronises once at the end. Returns
    what the checker needs: the stand-in, what each step read, and the order.
    """
    gpu = StandInCuda(copy_s=copy_s, exercise=exercise)
    batches = host_batches(n, shape, seed)
    expected = [batch_value(torch.Tensor(b)) for b in batches]

    def train():
        steps, given = [], []
        with gpu:
            it = call_learner(exercise, fn, iter(batches), gpu.device, gpu)
            if it is None:
                fail(exercise, "an iterable of batches on the device",
                     "None", "return the generator (or use `yield`)")
            try:
                for batch in it:
                    given.append(batch)
                    steps.append(gpu.launch(batch_value, batch, step_s))
                    del batch
                    given[-1] = getattr(given[-1], "index", given[-1])
                    if len(steps) > 3 * n + 3:
                        break
            except ExerciseFailed:
                raise
            except Exception as e:
                _raised(exercise, e)
            waits = list(gpu.host_waits)
            gpu.synchronize()
        return steps, given, waits

    steps, given, waits = _run_with_timeout(exercise, train)
    return {"gpu": gpu, "steps": steps, "given": given, "expected": expected, "n": n,
            "host_waits": waits}


def _raised(exercise: str, e: Exception) -> None:
    """Report an error raised while the learner's generator ran."""
    first = str(e).splitlines()[0] if str(e) else ""
    hint = "fix that error and run the exercise cell again"
    if "CUDA" in first or "cuda" in first:
        hint = ("use the `cuda` argument (torch.cuda on a GPU, a stand-in here) "
                "and the `device` argument, not torch.cuda or 'cuda' itself")
    if isinstance(e, StopIteration) or "StopIteration" in first:
        hint = "the batches may run out at any time, even before the first one"
    fail(exercise, "your prefetcher to run", f"it raised {type(e).__name__}: {first}",
         hint)


def _judge_prefetch(ex: str, run: dict, copy_s: float, step_s: float) -> None:
    gpu, steps, n, expected = run["gpu"], run["steps"], run["n"], run["expected"]
    setting = (f"{n} batches, a copy takes {copy_s:g} and a training step "
               f"{step_s:g} time units")
    for op in steps:
        if "not_on_device" in op:
            b = op["not_on_device"]
            fail(ex, "batches on the device (copied with "
                 "`batch.to(device, non_blocking=True)`)",
                 f"a {type(b).__name__} that was never copied to the device",
                 "copy each batch to `device` on the side stream")
    if len(steps) != n:
        fail(ex, f"{n} batches, one per CPU batch ({setting})",
             f"{len(steps)} batches", "yield every batch once, the last one too")
    order = run["given"]
    if order != list(range(n)):
        fail(ex, f"the batches in their order 0..{n - 1}", f"{order}",
             "yield the batch you copied earlier, then start the next copy")
    if run["host_waits"]:
        fail(ex, "the host never to wait for the GPU inside the prefetcher",
             f"the host waited: {', '.join(sorted(set(run['host_waits'])))}",
             "a host wait (synchronize, a blocking copy, polling query) stops "
             "the CPU from queuing the next work; order the streams on the GPU "
             "with wait_stream or an event instead")
    for i, op in enumerate(steps):
        status, what = gpu.read(op)
        if status == "unwritten":
            fail(ex, f"step {i} to read batch {i} after its copy finished ({setting})",
                 f"step {i} read batch {i}'s memory while the copy into it was "
                 "still running (or before it started)",
                 "make the compute stream wait for the copy on the GPU: "
                 "`cuda.current_stream().wait_stream(side)` (or an event) before "
                 "handing the batch out - and wait in that direction")
        if status == "overwritten":
            fail(ex, f"step {i} to read batch {i} ({setting})",
                 f"step {i} read batch {what}: batch {i}'s memory was handed to the "
                 f"copy of batch {what} while the step still used it",
                 "the block was allocated on the side stream and freed while the "
                 "compute stream still had queued work on it: call "
                 "`batch.record_stream(cuda.current_stream())` on each batch you "
                 "hand out")
        if abs(what - expected[i]) > 1e-6 * (1 + abs(expected[i])):
            fail(ex, f"step {i} to read batch {i}'s values",
                 "other values", "copy the batch you were given, unchanged")
    copy_streams = {op["stream"] for op in gpu.ops if op["kind"] == "copy"}
    step_streams = {op["stream"] for op in steps}
    if n > 1 and copy_streams & step_streams:
        fail(ex, "the copies on a side stream, the training steps on the current one",
             "copies queued on the stream that runs the training steps: each copy "
             "waits for the steps before it, nothing overlaps",
             "make a side stream once (`side = cuda.Stream()`), copy inside "
             "`with cuda.stream(side):`, and never `yield` inside that block "
             "(the training step would then run on the side stream too)")
    if gpu.max_live > 4:
        fail(ex, "a bounded prefetch: the batch in use and one or two ahead",
             f"{gpu.max_live} batches on the device at once",
             "copy the next batch while the current one trains, not all of them "
             "at the start (device memory is what you are short of)")
    serial, ideal = _serial_and_ideal(n, copy_s, step_s)
    total = max(op["end"] for op in gpu.ops)
    if n > 2 and total > (serial + ideal) / 2:
        fail(ex, f"copies overlapping the training steps: about {ideal:g} time "
             f"units ({setting})",
             f"{total:g} time units (one after the other would take {serial:g})",
             "start the copy of the next batch before handing out the current "
             "one, and make the steps wait only for the copy they need")


def check_prefetcher(fn: Callable) -> None:
    """Exercise 3.1: ``prefetch(batches, device, cuda)`` on the stand-in, then a GPU."""
    ex = "3.1"
    require_solution(ex, fn)
    for seed, (n, shape, copy_s, step_s) in enumerate(_PREFETCH_CASES):
        run = run_standin_prefetch(fn, n, shape, copy_s, step_s, seed=seed, exercise=ex)
        _judge_prefetch(ex, run, copy_s, step_s)
    note = ("On the stand-in GPU every batch was read after its copy and before "
            "its memory was reused, with copies under the training steps.")
    if torch.cuda.is_available():
        note += " " + _check_prefetcher_on_gpu(ex, fn)
    passed(ex, note)


def _check_prefetcher_on_gpu(ex: str, fn: Callable) -> str:
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(1024, 1024, generator=g).pin_memory() for _ in range(8)]
    expected = [float(b.double().sum()) for b in batches]
    w = torch.randn(1024, 1024, device=device)

    def train():
        sums = []
        try:
            for batch in call_learner(ex, fn, iter(batches), device, torch.cuda):
                for _ in range(4):  # enough work for a copy to hide under
                    (batch @ w).relu_()
                sums.append(batch.double().sum())
        except ExerciseFailed:
            raise
        except Exception as e:
            _raised(ex, e)
        torch.cuda.synchronize(device)
        return [float(s) for s in sums]

    got = _run_with_timeout(ex, train, timeout=60)
    if len(got) != len(expected):
        fail(ex, f"{len(expected)} batches on the GPU", f"{len(got)}")
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if abs(a - b) > 1e-3 * (1 + abs(b)):
            fail(ex, f"batch {i} on the GPU to hold its values (sum {b:.4g})",
                 f"sum {a:.4g}: the step read the batch before its copy finished, "
                 "or after its memory was reused",
                 "wait_stream (or an event) before use, record_stream on hand-out")
    return f"On {torch.cuda.get_device_name(device)} all 8 batches arrived intact."


# --- Exercise 3.2: overlap fraction ------------------------------------------------

# (spans, expected fraction, hint shown when this case is wrong)
_OVERLAP_CASES: list[tuple[list[tuple], float, str]] = [
    ([("a", 0.0, 2.0), ("b", 0.0, 2.0)], 1.0,
     "two spans running the whole time overlap for all of it"),
    ([("a", 0.0, 1.0), ("b", 1.0, 2.0)], 0.0,
     "spans that only touch (one ends when the next starts) do not overlap"),
    ([("a", 0.0, 1.0), ("a", 1.0, 2.0), ("a", 2.0, 3.0)], 0.0,
     "spans one after the other do not overlap"),
    ([("a", 10.0, 12.0), ("b", 11.0, 13.0)], 1 / 3,
     "times may come from any clock: measure from the first start, not from 0"),
    ([("b", 2.0, 5.0, "x"), ("a", 0.0, 3.0, "y")], 1 / 5,
     "spans come in any order (sort them) and may carry a label"),
    ([("a", 0.0, 10.0), ("b", 1.0, 2.0), ("c", 5.0, 6.0)], 0.2,
     "a long span can overlap several others: compare all spans, not neighbours "
     "or the first two"),
    ([("a", 0.0, 4.0), ("b", 1.0, 2.0), ("c", 1.5, 3.0)], 0.5,
     "time when three spans run at once counts once, not once per pair"),
    ([("a", 0.0, 1.0), ("b", 0.5, 1.0), ("a", 3.0, 4.0)], 0.125,
     "divide by the wall-clock time from the first start to the last end, gaps "
     "included, not by the time something was running"),
    ([("a", 0.0, 4.0), ("a", 1.0, 3.0)], 0.5,
     "two spans on the same lane that run at once overlap too: count spans, "
     "not lanes"),
    ([("a", 0.0, 4.0), ("b", 2.0, 2.0), ("c", 1.0, 1.0)], 0.0,
     "a span of zero length never runs, so it overlaps nothing"),
    ([("a", 5.0, 6.0), ("b", 0.0, 1.0), ("c", 0.5, 2.0), ("d", 5.5, 8.0)], 1 / 8,
     "sort the spans by start before sweeping; the input order means nothing"),
]


def _reference_overlap(spans: Sequence[tuple]) -> float:
    """The fraction by cutting time at every edge (a slow, plain reference)."""
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = sum(hi - lo for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
               if sum(s[1] < hi and s[2] > lo for s in spans) >= 2)
    total = cuts[-1] - cuts[0] if cuts else 0.0
    return busy / total if total > 0 else 0.0


def random_span_cases(seed: int = 3) -> list[list[tuple]]:
    """Seeded random span sets: integer grid times (ties), big offsets, triples."""
    rng = random.Random(seed)
    cases = []
    for k in range(6):
        n = rng.randint(4, 12)
        offset = rng.choice([0.0, 1e3, 7.25, 1.7e9])
        spans = []
        for j in range(n):
            a = rng.randint(0, 30)
            b = a + rng.choice([0, 1, 2, 3, 5, 8, 13])
            lane = f"lane {rng.randint(0, 3)}"
            item = (lane, offset + a * 0.5, offset + b * 0.5)
            spans.append(item + (f"op{j}",) if (j + k) % 2 else item)
        if max(s[2] for s in spans) > min(s[1] for s in spans):
            cases.append(spans)
    return cases


def check_overlap_fraction(fn: Callable, measured_spans: Sequence[tuple] | None = None
                           ) -> None:
    """Exercise 3.2: the fraction of wall-clock time with two or more spans running."""
    ex = "3.2"
    require_solution(ex, fn)
    for spans, expected, hint in _OVERLAP_CASES:
        seen = call_learner(ex, fn, [tuple(s) for s in spans])
        shown = ", ".join(str(s) for s in spans)
        check_close(ex, seen, expected, rtol=1e-3, atol=1e-6,
                    what=f"overlap_fraction([{shown}])", hint=hint)
    for spans in random_span_cases():
        expected = _reference_overlap(spans)
        given = tuple(tuple(s) for s in spans)  # a tuple of tuples is spans too
        seen = call_learner(ex, fn, given)
        shown = ", ".join(str(s) for s in spans)
        check_close(ex, seen, expected, rtol=1e-3, atol=1e-3,
                    what=f"overlap_fraction(({shown}))",
                    hint="a random case: times may repeat, spans may touch or have "
                         "zero length, and many may overlap at once")
    note = ""
    if measured_spans:
        value = float(check_type(ex, call_learner(ex, fn, list(measured_spans)),
                                 (float, int, torch.Tensor)))
        if not 0.0 <= value <= 1.0:
            fail(ex, "a fraction between 0 and 1 for the spans measured above",
                 f"{value:g}")
        note = (f"The matmuls measured above overlapped for {value:.0%} "
                "of their run.")
    passed(ex, note)


# --- Exercise 3.3: a DataLoader that keeps the training step fed -------------------


class SleepySamples(torch.utils.data.Dataset):
    """Sample i costs ``load_s`` seconds to "load" (a sleep) and holds seeded values.

    The cost is a sleep, not computation, so loading in several workers gets
    faster whatever else the machine is doing: the checker's verdict does not
    depend on the machine's load.
    """

    def __init__(self, n: int, load_s: float, width: int = 6, seed: int = 0):
        self.n, self.load_s, self.width, self.seed = n, load_s, width, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        time.sleep(self.load_s)
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return torch.randn(self.width, generator=g), torch.tensor(i)


# (samples, batch size, seconds to load one batch, seconds per training step)
_LOADER_CASES = [
    (48, 4, 0.040, 0.025),   # 1.6 steps: 2 workers (1 starves 60%)
    (58, 5, 0.0015, 0.025),  # nearly free: the main process can load it itself
    (36, 3, 0.0125, 0.025),  # half a step: 1 worker keeps up (0 starve 50%)
]
STARVED_FRACTION = 0.3  # the loop may wait for data at most this share of a step


def workers_needed(load_s: float, step_s: float) -> int:
    """Fewest workers that keep up: none when the main process can load in time."""
    return 0 if load_s <= STARVED_FRACTION * step_s else math.ceil(load_s / step_s)


def measure_starvation(loader, step_s: float, n_batches: int,
                       timeout: float = 20.0) -> dict:
    """Iterate ``loader`` with a training step of ``step_s`` (a sleep).

    Returns the batches seen and the seconds the loop waited for each batch.
    """
    waits, seen = [], []
    it = iter(loader)
    try:
        deadline = time.perf_counter() + timeout
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t0)
            seen.append(batch)
            time.sleep(step_s)  # the training step
            if len(seen) > 2 * n_batches + 2 or time.perf_counter() > deadline:
                break
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del it
    return {"waits": waits, "batches": seen}


def _measure(ex: str, loader, step_s: float, n_batches: int) -> dict:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run_with_timeout(ex, measure_starvation, loader, step_s,
                                     n_batches, timeout=40)
    except (RuntimeError, OSError) as e:
        fail(ex, "the loader to deliver every batch",
             f"{type(e).__name__}: {str(e).splitlines()[0][:120]}",
             "check the DataLoader's arguments")


def _check_batches(ex: str, batches: list, n: int, bs: int) -> None:
    ids: list[int] = []
    for b in batches:
        if not (isinstance(b, (list, tuple)) and len(b) == 2):
            fail(ex, "batches of (samples, indices) as the default collate makes",
                 f"a {type(b).__name__}", "keep the default collate_fn")
        if b[0].shape[0] != bs and len(ids) + b[0].shape[0] != n:
            fail(ex, f"batches of {bs} samples (batch_size={bs})",
                 f"a batch of {b[0].shape[0]} samples",
                 "pass batch_size to the DataLoader")
        ids += [int(i) for i in b[1]]
    if sorted(ids) != list(range(n)):
        fail(ex, f"every one of the {n} samples once per epoch",
             f"{len(ids)} samples, {len(set(ids))} distinct",
             "do not drop or repeat samples (drop_last, a sampler)")


def check_loader_config(fn: Callable, device: torch.device | str | None = None) -> None:
    """Exercise 3.3: ``make_loader(dataset, batch_size, load_s, step_s, device)``."""
    ex = "3.3"
    require_solution(ex, fn)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # pin_memory: asked of the configuration for a GPU and for a CPU, without
    # iterating (pinning needs a GPU build)
    for dev, want in ((torch.device("cuda"), True), (torch.device("cpu"), False)):
        loader = call_learner(ex, fn, SleepySamples(8, 0.0), 2, 0.01, 0.02, dev)
        if not isinstance(loader, torch.utils.data.DataLoader):
            fail(ex, "a torch.utils.data.DataLoader", f"a {type(loader).__name__}",
                 "return the DataLoader you configured")
        if bool(loader.pin_memory) != want:
            fail(ex, f"pin_memory={want} for device {dev.type!r}",
                 f"pin_memory={loader.pin_memory}",
                 "pinned batches make the copy to a GPU asynchronous; with no GPU "
                 "pinning does nothing (and needs a GPU build): "
                 "pin_memory=(device.type == 'cuda')")
    loaders = []
    for case, (n, bs, load_s, step_s) in enumerate(_LOADER_CASES):
        data = SleepySamples(n, load_s / bs, seed=case)
        loader = call_learner(ex, fn, data, bs, load_s, step_s, device)
        k = loader.num_workers
        need = workers_needed(load_s, step_s)
        setting = (f"loading a batch takes {load_s * 1e3:.1f} ms, a step "
                   f"{step_s * 1e3:.0f} ms")
        if k > need + 1:
            fail(ex, f"at most {need + 1} workers ({setting}: "
                 f"{need or 'the main process alone'} keep{'s' if not need else ''} "
                 "up)",
                 f"num_workers={k}",
                 "each worker is a process with its own memory and a share of the "
                 "cores: start as many as keep up with the step, plus one at most")
        if k > 0 and loader.timeout <= 0:
            loader.timeout = 20.0  # the checker never hangs on a stuck worker
        loaders.append((loader, k, setting))
    for (n, bs, load_s, step_s), (loader, k, setting) in zip(
            _LOADER_CASES, loaders, strict=True):
        n_batches = math.ceil(n / bs)
        starved = None
        runs = 0
        while runs < 3:  # another run only while it starved
            runs += 1
            run = _measure(ex, loader, step_s, n_batches)
            if starved is None:
                _check_batches(ex, run["batches"], n, bs)
            # the waits in the second half of the epoch (the first half includes
            # starting the workers), as a share of the steps' time
            half = run["waits"][len(run["waits"]) // 2:]
            share = sum(half) / (step_s * len(half))
            starved = share if starved is None else min(starved, share)
            # a busy machine can delay the workers of a right answer: up to three
            # runs, and the best counts; a wrong one starves in every run
            if not STARVED_FRACTION < starved < 2.5 * STARVED_FRACTION:
                break  # clearly fed, or clearly starved: no other run
        if starved > STARVED_FRACTION:
            fail(ex, f"the training loop to wait for data at most "
                 f"{STARVED_FRACTION:.0%} of its step time, in the second half of "
                 f"the epoch ({setting})",
                 f"it waited {starved * step_s * 1e3:.1f} ms per "
                 f"{step_s * 1e3:.0f} ms step with num_workers={k} (best of {runs} "
                 f"run{'s' if runs > 1 else ''})",
                 f"one worker makes a batch every {load_s * 1e3:.1f} ms; k workers "
                 f"make k batches in that time: you need k x step >= load")
    passed(ex, "The training loop waited for data less than "
               f"{STARVED_FRACTION:.0%} of a step in every setting.")
