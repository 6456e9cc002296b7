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
copy is overwriting, every time, whatever the machine's load. The training
loops include an empty epoch and loops that wait for each step (as
``loss.item()`` does), where only a copy started before the batch is handed
out overlaps a step; a batch must reach the device in its own dtype. On a
machine with a GPU the same answer then runs for real.

Exercise 3.2 (``overlap_fraction``) is checked against hand-made cases with
known answers and seeded random span sets (ties, touching and zero-length
spans, integer and float times, negative and perf_counter-sized offsets,
tuples and lists), each asked twice, within a time limit; the input must be
left as it was (order included), and a wrong number is matched against the
typical mistakes (a percentage, pairs summed, zero-length spans left out of the
wall-clock time, gaps left out, lanes instead of spans, touching spans counted,
times truncated or rounded, times from 0, state kept between calls), each
confirmed on a probe of its own, to name the one made. The checker's own
reference refuses to run inside the learner's function.

Exercise 3.3 (``load_ahead``, a loading pipeline in threads) is judged by
behaviour on a traced dataset whose loads and the loop's steps are sleeps (so
the verdict does not depend on the machine's load): the batches and their
order, the time the loop waits for data in the second half of an epoch, how
far ahead of the loop's requests and how many at once the threads load,
samples of other shapes (2-D) and the labels' dtype, no thread left when the
loop stops early, a corrupt sample's error reaching the loop, a second call.
The dataset refuses to be read in other processes, so a ``DataLoader`` with
worker processes is not an answer.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from course_utils.exercises import (
    ExerciseFailed,
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
)


def _run_with_timeout(exercise: str, fn: Callable, *args, timeout: float | None = None,
                      **kwargs):
    """Call ``fn`` in a thread; fail kindly if it does not return in time
    (``answer_limit(exercise)`` unless ``timeout`` is given)."""
    timeout = timeout or answer_limit(exercise)
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
        self.copy_op, self.dtype = copy_op, copy_op["payload"].dtype
        self.device = gpu.device
        self._used_by: set[StandInStream] = set()
        gpu._live += 1
        gpu.max_live = max(gpu.max_live, gpu._live)

    def record_stream(self, stream: StandInStream) -> None:
        self.gpu._check_stream(stream)
        self._used_by.add(stream)

    def to(self, *args, **kwargs):
        if _dtype_of(args, kwargs) is not None:
            self._dtype_changed()
        fail(self.gpu.exercise, "the batch used on the GPU as it is",
             "a batch that was already on the GPU copied again",
             "copy each CPU batch once: batch.to(device, non_blocking=True)")

    def _dtype_changed(self, *args, **kwargs):
        fail(self.gpu.exercise, "each batch on the device in its own dtype, unchanged",
             f"a {self.dtype} batch converted on the device",
             "copy the batch as it is; the training step decides its dtype")

    half = float = double = bfloat16 = _dtype_changed

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


def _dtype_of(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a ``.to(...)`` call asks for, if any."""
    found = [a for a in args if isinstance(a, torch.dtype)]
    return kwargs.get("dtype", found[0] if found else None)


class HostBatch(torch.Tensor):
    """A (pinned) CPU batch; ``.to(stand-in device)`` queues an asynchronous copy."""

    def to(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if args else None)
        if isinstance(device, StandInDevice):
            rest = [a for a in args[1:] if isinstance(a, bool)]
            non_blocking = kwargs.get("non_blocking", rest[0] if rest else False)
            return device.gpu._copy_in(self, bool(non_blocking),
                                       _dtype_of(args[1:], kwargs))
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
        self._waits: list[str] = []
        self.ops: list[dict] = []     # every queued copy and kernel, in queue order
        self._free: list[_Block] = []
        self._blocks = 0
        self._live = 0
        self.max_live = 0
        self._copies = 0

    @property
    def host_waits(self) -> list[str]:
        """Every host wait so far (a copy: clearing it changes nothing)."""
        return list(self._waits)

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
        if stream.gpu is not self:
            fail(self.exercise, "streams made in this call, from its `cuda` argument",
                 "a stream kept from an earlier call (another GPU, or another run)",
                 "make the side stream inside the function each time it is called; "
                 "do not keep it in a global or a default argument")

    def _check_event(self, event) -> None:
        if not isinstance(event, StandInEvent):
            fail(self.exercise, "an event made by `cuda.Event()`",
                 f"{type(event).__name__} {event!r:.60}",
                 "use the `cuda` argument's Event (torch.cuda's on a GPU)")
        if event.gpu is not self:
            fail(self.exercise, "events made in this call, from its `cuda` argument",
                 "an event kept from an earlier call (another GPU, or another run)",
                 "make events inside the function each time it is called")

    def _host_wait(self, until: float, what: str) -> None:
        if until > self.host_t:
            self._waits.append(what)
            self.host_t = until

    def _poll(self, until: float) -> bool:
        done = until <= self.host_t
        if not done:  # polling takes host time too, and it is time spent waiting
            self._waits.append("query() in a loop")
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

    def _copy_in(self, host: HostBatch, non_blocking: bool,
                 dtype: torch.dtype | None = None) -> DeviceBatch:
        index = getattr(host, "batch_index", self._copies)
        self._copies += 1
        payload = host.detach().as_subclass(torch.Tensor).clone()
        if dtype is not None:
            payload = payload.to(dtype)
        block = self._allocate(payload.numel() * payload.element_size())
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


def host_batches(n: int, shape: tuple, seed: int,
                 dtype: torch.dtype = torch.float32) -> list[HostBatch]:
    """``n`` seeded random CPU batches (no two alike), each knowing its index.

    float64 batches mix magnitudes (1e-6 to 1e6), so a copy that changes the
    dtype changes the values.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(shape, generator=g, dtype=torch.float64) + i
        if dtype == torch.float64:
            x = x * 10.0 ** torch.randint(-6, 7, shape, generator=g)
        b = x.to(dtype).as_subclass(HostBatch)
        b.batch_index = i
        out.append(b)
    return out


def batch_value(values: torch.Tensor) -> float:
    """What the checker's training step computes from a batch: a weighted sum."""
    w = torch.arange(1, values.numel() + 1, dtype=torch.float64)
    return float((values.double().flatten() * w).sum())


# --- Exercise 3.1: a side-stream prefetcher -------------------------------------

# (batches, batch shape, copy time, step time, dtype, epochs, the loop waits for
# each step): copy-bound and compute-bound runs, an empty epoch, a single batch,
# float64 of mixed magnitudes, one stand-in GPU used for two epochs in a row
# (state kept from the first), and loops that wait for each step as
# `loss.item()` does (then only a copy started before the batch is handed out
# can overlap a step)
_PREFETCH_CASES = [
    (7, (3, 5), 1.0, 3.0, torch.float32, 1, False),
    (6, (17,), 3.0, 1.0, torch.float64, 1, False),
    (0, (3,), 1.0, 1.0, torch.float32, 1, False),
    (1, (2, 3), 1.0, 2.0, torch.float32, 1, False),
    (9, (4, 4), 2.0, 2.0, torch.float64, 2, False),
    (5, (2, 1, 3), 0.5, 2.5, torch.float32, 1, False),
    (8, (2, 5), 1.0, 2.0, torch.float32, 1, True),
    (6, (7,), 2.0, 1.0, torch.float64, 1, True),
]


def _serial_and_ideal(n: int, copy_s: float, step_s: float) -> tuple[float, float]:
    serial = n * (copy_s + step_s)
    ideal = copy_s + (n - 1) * max(copy_s, step_s) + step_s
    return serial, ideal


def run_standin_prefetch(fn: Callable, n: int, shape: tuple, copy_s: float,
                         step_s: float, seed: int = 0, exercise: str = "3.1",
                         dtype: torch.dtype = torch.float32, epochs: int = 1,
                         loop_waits: bool = False) -> dict:
    """Run ``fn(batches, device, cuda)`` on the stand-in, with a training loop.

    The loop queues one step (reading the batch) on the current stream per
    batch it is given and synchronises once at the end; it never waits in
    between, unless ``loop_waits``: then it waits for each step to finish (as
    ``loss.item()`` does; not counted as the prefetcher's wait). With
    ``epochs`` > 1 it calls ``fn`` again on the same stand-in. Returns what
    the checker needs: the stand-in, what each step read, and the order.
    """
    gpu = StandInCuda(copy_s=copy_s, exercise=exercise)
    batches = host_batches(n, shape, seed, dtype)
    expected = [batch_value(torch.Tensor(b)) for b in batches] * epochs

    dtypes: set = set()

    def train():
        steps, given = [], []
        with gpu:
            for _ in range(epochs):
                try:
                    it = call_learner(exercise, fn, iter(batches), gpu.device, gpu)
                    if it is None:
                        fail(exercise, "an iterable of batches on the device",
                             "None", "return the generator (or use `yield`)")
                    for batch in it:
                        given.append(batch)
                        if isinstance(batch, DeviceBatch):
                            dtypes.add(batch.dtype)
                        steps.append(gpu.launch(batch_value, batch, step_s))
                        if loop_waits and "end" in steps[-1]:
                            gpu.host_t = max(gpu.host_t, steps[-1]["end"])
                        del batch
                        given[-1] = getattr(given[-1], "index", given[-1])
                        if len(steps) > 3 * n * epochs + 3:
                            break
                except ExerciseFailed:
                    raise
                except Exception as e:
                    _raised(exercise, e)
            waits = list(gpu.host_waits)
            gpu.synchronize()
        return steps, given, waits

    steps, given, waits = _run_with_timeout(exercise, train)
    return {"gpu": gpu, "steps": steps, "given": given, "expected": expected,
            "n": n * epochs, "per_epoch": n, "epochs": epochs, "host_waits": waits,
            "loop_waits": loop_waits, "dtypes": dtypes, "dtype": dtype}


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
    if run["loop_waits"]:
        setting += "; the loop waits for each step, as loss.item() does"
    for op in steps:
        if "not_on_device" in op:
            b = op["not_on_device"]
            fail(ex, "batches on the device (copied with "
                 "`batch.to(device, non_blocking=True)`)",
                 f"a {type(b).__name__} that was never copied to the device",
                 "copy each batch to `device` on the side stream")
    dtypes = run["dtypes"] - {run["dtype"]}
    if dtypes:
        fail(ex, f"each batch on the device in its own dtype, {run['dtype']} "
             f"({setting})",
             f"{', '.join(sorted(map(str, dtypes)))} on the device",
             "copy the batch as it is: batch.to(device, non_blocking=True), no dtype")
    if len(steps) != n:
        fail(ex, f"{n} batches, one per CPU batch ({setting})",
             f"{len(steps)} batches", "yield every batch once, the last one too")
    order, per_epoch = run["given"], run["per_epoch"]
    if order != list(range(per_epoch)) * run["epochs"]:
        again = " in each of two calls" if run["epochs"] > 1 else ""
        fail(ex, f"the batches in their order 0..{per_epoch - 1}{again}", f"{order}",
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
        if abs(what - expected[i]) > 1e-12 * (1 + abs(expected[i])):
            fail(ex, f"step {i} to read batch {i}'s values ({setting})",
                 f"other values (a weighted sum of {what:.10g} instead of "
                 f"{expected[i]:.10g})",
                 "copy the batch you were given, unchanged: same dtype and values")
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
    serial, ideal = _serial_and_ideal(per_epoch, copy_s, step_s)
    serial, ideal = serial * run["epochs"], ideal * run["epochs"]
    total = max((op["end"] for op in gpu.ops), default=0.0)
    if n > 2 and total > (serial + ideal) / 2:
        copies = [op for op in gpu.ops if op["kind"] == "copy"]
        waited_next = sum(steps[i]["start"] >= copies[i + 1]["end"]
                          for i in range(min(len(steps), len(copies)) - 1))
        hint = ("start the copy of the next batch before handing out the current "
                "one, and make the steps wait only for the copy they need")
        if waited_next >= (n - 1) / 2:
            hint = ("each step waited for the copy of the batch after it too: "
                    "wait_stream waits for everything queued on the side stream so "
                    "far, so call it before starting the next copy (or wait on an "
                    "event recorded right after this batch's copy)")
        elif run["loop_waits"]:
            hint = ("start copying batch i + 1 before handing out batch i: when the "
                    "loop waits for each step, a copy started only when the next "
                    "batch is asked for runs after the step, not under it")
        fail(ex, f"copies overlapping the training steps: about {ideal:g} time "
             f"units ({setting})",
             f"{total:g} time units (one after the other would take {serial:g})",
             hint)


def check_prefetcher(fn: Callable) -> None:
    """Exercise 3.1: ``prefetch(batches, device, cuda)`` on the stand-in, then a GPU."""
    ex = "3.1"
    require_solution(ex, fn)
    for seed, (n, shape, copy_s, step_s, dtype, epochs, loop_waits) in enumerate(
            _PREFETCH_CASES):
        run = run_standin_prefetch(fn, n, shape, copy_s, step_s, seed=seed, exercise=ex,
                                   dtype=dtype, epochs=epochs, loop_waits=loop_waits)
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
    ([("a", 0.25, 0.75), ("b", 0.5, 1.5)], 0.2,
     "times are seconds as floats: keep their fractions"),
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
    ([("a", 0.0, 4.0), ("b", 1.0, 3.0), ("c", 8.0, 8.0)], 0.25,
     "a span of zero length overlaps nothing, but its start and end still count: "
     "the wall-clock time runs from the first start to the last end of all spans"),
    ([("a", 5.0, 6.0), ("b", 0.0, 1.0), ("c", 0.5, 2.0), ("d", 5.5, 8.0)], 1 / 8,
     "sort the spans by start before sweeping; the input order means nothing"),
]


_IN_LEARNER = threading.local()  # set in the thread running the learner's code


def _reference_overlap(spans: Sequence[tuple]) -> float:
    """The fraction by cutting time at every edge (a slow, plain reference)."""
    if getattr(_IN_LEARNER, "on", False):
        fail("3.2", "overlap_fraction to compute the fraction itself",
             "it called the checker's own reference",
             "sweep over the spans' starts and ends yourself")
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = sum(hi - lo for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
               if sum(s[1] < hi and s[2] > lo for s in spans) >= 2)
    total = cuts[-1] - cuts[0] if cuts else 0.0
    return busy / total if total > 0 else 0.0


def random_span_cases(seed: int = 3) -> list[list[tuple]]:
    """Seeded random span sets: grid times (ties), offsets from negative to
    perf_counter-sized, integer times, microsecond spans, triples."""
    rng = random.Random(seed)
    cases = []
    for k in range(8):
        n = rng.randint(4, 12)
        offset = [0.0, 1e3, -7.25, 1.7e5, 3, 0.0, -40, 2.5e4][k]
        unit = [0.5, 0.5, 0.25, 1e-6, 1, 3.0, 1, 1e-3][k]  # 1: integer times
        spans = []
        for j in range(n):
            a = rng.randint(0, 30)
            b = a + rng.choice([0, 1, 2, 3, 5, 8, 13])
            lane = f"lane {rng.randint(0, 3)}"
            item = (lane, offset + a * unit, offset + b * unit)
            spans.append(item + (f"op{j}",) if (j + k) % 2 else item)
        if max(s[2] for s in spans) > min(s[1] for s in spans):
            cases.append(spans)
    return cases


def _pairwise_overlap(spans: Sequence[tuple]) -> float:
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    busy = sum(max(0.0, min(a[2], b[2]) - max(a[1], b[1]))
               for i, a in enumerate(spans) for b in spans[i + 1:])
    return busy / total if total > 0 else 0.0


def _over_busy_time(spans: Sequence[tuple]) -> float:
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    pieces = list(zip(cuts[:-1], cuts[1:], strict=True))
    running = [sum(s[1] < hi and s[2] > lo for s in spans) for lo, hi in pieces]
    two = sum(hi - lo for (lo, hi), r in zip(pieces, running, strict=True) if r >= 2)
    one = sum(hi - lo for (lo, hi), r in zip(pieces, running, strict=True) if r >= 1)
    return two / one if one > 0 else 0.0


def _lanes_only(spans: Sequence[tuple]) -> float:
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = sum(hi - lo for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
               if len({s[0] for s in spans if s[1] < hi and s[2] > lo}) >= 2)
    return busy / (cuts[-1] - cuts[0]) if cuts[-1] > cuts[0] else 0.0


def _zero_length_dropped(spans: Sequence[tuple]) -> float:
    real = [s for s in spans if s[2] > s[1]]
    return _reference_overlap(real) if real else 0.0


def _touching_counts(spans: Sequence[tuple]) -> float:
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = sum(hi - lo for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
               if sum(s[1] <= hi and s[2] >= lo for s in spans) >= 2)
    return busy / (cuts[-1] - cuts[0]) if cuts[-1] > cuts[0] else 0.0


def _truncated(spans: Sequence[tuple]) -> float:
    return _reference_overlap([(s[0], int(s[1]), int(s[2])) for s in spans])


def _rounded_ms(spans: Sequence[tuple]) -> float:
    return _reference_overlap([(s[0], round(s[1], 3), round(s[2], 3)) for s in spans])


def _from_zero(spans: Sequence[tuple]) -> float:
    end = max(s[2] for s in spans)
    return _reference_overlap(spans) * (end - min(s[1] for s in spans)) / end \
        if end > 0 else math.nan


# mistakes recognised by the number they give: (function, hint)
# mistakes recognised by the number they give: (function, probe, hint). A hint is
# shown only if the learner's answer for the probe (spans where that mistake
# stands out) is the mistake's number there too, so that two mistakes giving the
# same number on one case are told apart.
_OVERLAP_MISTAKES = [
    (lambda sp: 100 * _reference_overlap(sp), [("a", 0.0, 2.0), ("b", 1.0, 3.0)],
     "return a fraction between 0 and 1, not a percentage"),
    (_pairwise_overlap, [("a", 0.0, 4.0), ("b", 1.0, 2.0), ("c", 1.5, 3.0)],
     "time when three spans run at once counts once, not once per pair: sweep "
     "over the edges and count the spans running, instead of summing pairs"),
    (_zero_length_dropped, [("a", 0.0, 4.0), ("b", 1.0, 3.0), ("c", 8.0, 8.0)],
     "a span of zero length overlaps nothing, but its start and end still count: "
     "the wall-clock time runs from the first start to the last end of all spans"),
    (_over_busy_time, [("a", 0.0, 1.0), ("b", 0.5, 1.0), ("a", 3.0, 4.0)],
     "divide by the wall-clock time from the first start to the last end, gaps "
     "included, not by the time something was running"),
    (_lanes_only, [("a", 0.0, 4.0), ("a", 1.0, 3.0)],
     "two spans on the same lane that run at once overlap too: count spans, "
     "not lanes"),
    (_touching_counts, [("a", 0.0, 1.0), ("b", 1.0, 2.0)],
     "spans that only touch do not overlap: a span runs from its start up to, "
     "not including, its end (compare with < and >, not <= and >=)"),
    (_rounded_ms, [("a", 1e5 + 1e-4, 1e5 + 3e-4), ("b", 1e5 + 2e-4, 1e5 + 4e-4)],
     "keep the times' full precision (float64, no rounding): perf_counter spans "
     "can be microseconds long on a clock that reads 1e5 seconds or more"),
    (_truncated, [("a", 0.25, 0.75), ("b", 0.5, 1.5)],
     "times are seconds as floats: keep their fractions (no int())"),
    (_from_zero, [("a", 10.0, 12.0), ("b", 11.0, 13.0)],
     "times may come from any clock: measure from the first start, not from 0"),
]


def _shows(mistake: Callable, spans: Sequence[tuple], value: float | None) -> bool:
    """Whether ``value`` is the number ``mistake`` gives for ``spans`` (and not
    the right one)."""
    try:
        wrong = mistake(spans)
    except (ZeroDivisionError, ValueError):
        return False
    return (value is not None and math.isfinite(wrong)
            and abs(wrong - _reference_overlap(spans)) > 1e-6
            and abs(wrong - value) <= 1e-6 + 1e-4 * abs(wrong))


def _overlap_hint(spans: Sequence[tuple], value: float, case_hint: str,
                  ask: Callable | None = None) -> str:
    """The hint for the mistake the value shows, confirmed on that mistake's
    probe with ``ask`` (the learner's answer for other spans), else the case's
    own hint."""
    for mistake, probe, hint in _OVERLAP_MISTAKES:
        if _shows(mistake, spans, value) and (
                ask is None or _shows(mistake, probe, ask(probe))):
            return hint
    return case_hint


def _asker(ex: str, fn: Callable) -> Callable:
    """The learner's answer for a probe, or None if it fails there."""
    def ask(probe):
        try:
            return _call_overlap(ex, fn, probe, str(probe), probing=True)
        except ExerciseFailed:
            return None
    return ask


def _call_overlap(ex: str, fn: Callable, spans, shown: str,
                  probing: bool = False) -> float:
    """The learner's fraction for ``spans``, within a time limit, as a float."""
    given = [list(s) if isinstance(s, list) else tuple(s) for s in spans]
    arg = type(spans)(given) if isinstance(spans, tuple) else given

    def as_written(items) -> list:  # order, containers, values and their types
        return [(type(s).__name__, repr(tuple(s))) for s in items]

    before = as_written(given)

    def learner():
        _IN_LEARNER.on = True  # this thread is the learner's: no reference here
        try:
            return call_learner(ex, fn, arg)
        finally:
            _IN_LEARNER.on = False

    value = _run_with_timeout(ex, learner)
    if as_written(given) != before:
        fail(ex, f"overlap_fraction({shown}) to leave the spans it was given as "
             "they were", "the spans changed (reordered, removed, added or edited)",
             "work on a copy (sorted(spans) makes a new list); the caller still "
             "needs its spans, in their order")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1:
        value = value.item()  # a NumPy scalar or 0-d array
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(ex, f"overlap_fraction({shown}) to return a number",
             f"a {type(value).__name__}: {value!r:.60}",
             "return busy time / wall-clock time, a float")
    value = float(value)
    if not probing and not 0.0 <= value <= 1.0:
        fail(ex, f"a fraction between 0 and 1 for overlap_fraction({shown})",
             f"{value:g}", _overlap_hint(spans, value,
                                          "a fraction of the wall-clock time is "
                                          "never below 0 or above 1",
                                          None if probing else _asker(ex, fn)))
    return value


def _refuse_answers_kept(ex: str, fn: Callable) -> None:
    """Fail an answer that repeats an earlier one for other spans.

    A cache keyed on ``id(spans)`` fails the later cases only when CPython
    happens to reuse an address; asking with one living list, changed in
    between, finds it every time, and a fresh list finds a remembered answer.
    """
    spans = [("a", 0.0, 4.0), ("b", 1.0, 2.0), ("c", 3.0, 5.0)]  # overlap 0.4
    # as many spans: a cache keyed on (id(spans), len(spans)) is found too
    changed = [("a", 10.0, 12.0), ("b", 11.0, 13.0), ("c", 14.0, 16.0)]

    def ask(arg):
        _IN_LEARNER.on = True
        try:
            return float(call_learner(ex, fn, arg))
        finally:
            _IN_LEARNER.on = False

    try:
        first = _run_with_timeout(ex, lambda: ask(spans))
        spans[:] = changed
        second = _run_with_timeout(ex, lambda: ask(spans))
        fresh = _run_with_timeout(ex, lambda: ask(list(changed)))
    except Exception:  # any other mistake is named by the cases below
        return
    if abs(first - 0.4) <= 1e-6 and first in (second, fresh):
        fail(ex, f"overlap_fraction({changed}) = {_reference_overlap(changed):.6g}, "
             "asked after "
             f"{[('a', 0.0, 4.0), ('b', 1.0, 2.0), ('c', 3.0, 5.0)]} (0.4)",
             f"{second:.6g} for the same list changed in place, {fresh:.6g} for a "
             "new list", "the answer must come from the spans given (no state "
             "kept between calls, no cache keyed on the list object)")


def check_overlap_fraction(fn: Callable, measured_spans: Sequence[tuple] | None = None
                           ) -> None:
    """Exercise 3.2: the fraction of wall-clock time with two or more spans running.

    Hand-made cases name the trap each sets; seeded random ones vary offsets,
    integer and float times, float64 values of mixed magnitudes, tuples and
    lists; every call runs within a time limit, must leave its input as it
    was, and gives the same answer when repeated on the same spans.
    """
    ex = "3.2"
    require_solution(ex, fn)
    _refuse_answers_kept(ex, fn)
    cases = [(spans, expected, hint) for spans, expected, hint in _OVERLAP_CASES]
    for spans in random_span_cases():
        cases.append((spans, _reference_overlap(spans),
                      "a random case: times may repeat, spans may touch or have "
                      "zero length, and many may overlap at once"))
    previous = None  # (value, expected) of the case before
    for k, (spans, expected, hint) in enumerate(cases):
        given = tuple(spans) if k % 3 == 2 else [list(s) if k % 3 == 1 else s
                                                  for s in spans]
        shown = "[" + ", ".join(str(tuple(s)) for s in spans) + "]"
        value = _call_overlap(ex, fn, given, shown)
        if not abs(value - expected) <= 1e-6 + 1e-3 * abs(expected):
            hint = _overlap_hint(spans, value, hint, _asker(ex, fn))
            probe = [("p", 0.0, 1.0), ("q", 0.5, 1.0), ("r", 3.0, 4.0)]  # 0.125
            if (previous is not None and value == previous[0] != 0.125
                    and _call_overlap(ex, fn, probe, str(probe)) == value):
                hint = (f"it returned {value:.6g} here, for the spans before and for "
                        f"{probe}: the answer must come from the spans given (no "
                        "state kept between calls)")
            fail(ex, f"overlap_fraction({shown}) = {expected:.6g}", f"{value:.6g}",
                 hint)
        previous = (value, expected)
        again = _call_overlap(ex, fn, [list(s) for s in spans], shown)  # as lists
        if not abs(again - value) <= 1e-9 * (1 + abs(value)):
            fail(ex, f"the same answer when overlap_fraction is called again on "
                 f"{shown}", f"{value:.6g}, then {again:.6g}",
                 "keep no state between calls (no global lists, no default "
                 "arguments that grow)")
    note = ""
    if measured_spans:
        spans = [tuple(s) for s in measured_spans]
        value = _call_overlap(ex, fn, spans, "the spans measured above")
        expected = _reference_overlap(spans)
        if not abs(value - expected) <= 1e-6 + 1e-3 * abs(expected):
            fail(ex, f"{expected:.4g} for the spans measured above", f"{value:.4g}",
                 _overlap_hint(spans, value, "times from perf_counter are large "
                               "floats: subtract, do not round", _asker(ex, fn)))
        note = f"The matmuls measured above overlapped for {value:.0%} of their run."
    passed(ex, note)


# --- Exercise 3.3: loading ahead in threads --------------------------------------


class TracedSamples:
    """Sample i costs ``load_s`` seconds (a sleep, which releases the GIL like I/O
    and torch's operators) and is ``(x_i, i)``: float64 values of mixed
    magnitudes and its index. Every load is traced: (start, end, index, thread).

    It can be read only in the process that made it (like a dataset holding an
    open file or a GPU): loading in other processes raises. ``fail_at``: the
    index whose load raises ``ValueError`` (a corrupt sample).
    """

    def __init__(self, n: int, load_s: float, shape: tuple = (3,), seed: int = 0,
                 fail_at: int | None = None):
        self.n, self.load_s, self.fail_at = n, load_s, fail_at
        g = torch.Generator().manual_seed(seed)
        self.x = (torch.randn((n, *shape), generator=g, dtype=torch.float64)
                  * 10.0 ** torch.randint(-6, 7, (n, *shape), generator=g))
        self.trace: list[tuple] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if os.getpid() != self._pid:
            raise RuntimeError("this dataset can be read only in the process that "
                               "made it: load in threads, not in processes")
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = time.perf_counter()
        time.sleep(self.load_s)
        with self._lock:
            self.trace.append((start, time.perf_counter(), i, threading.get_ident()))
        if i == self.fail_at:
            raise ValueError(f"sample {i} is corrupt")
        return self.x[i].clone(), torch.tensor(i)


# (samples, batch size, workers, seconds to load a batch, seconds per step,
# the shape of a sample's x)
_AHEAD_CASES = [
    (40, 4, 2, 0.040, 0.025, (3,)),  # a batch takes 1.6 steps: two threads keep up
    (31, 3, 1, 0.012, 0.025, (2, 3)),  # one thread keeps up; the last batch is short
    (12, 3, 0, 0.003, 0.040, (3,)),  # no threads: the loop loads each batch itself
    (40, 4, 2, 0.040, 0.025, (3,)),  # the first case again: a second call
]
STARVED_FRACTION = 0.3  # the loop may wait for data at most this share of a step


def _drive(ex: str, fn: Callable, data: TracedSamples, bs: int, workers: int,
           step_s: float, stop_after: int | None = None) -> dict:
    """Train on ``fn(data, bs, workers)``: a step (a sleep) per batch; within a
    time limit. Returns the batches, the waits, when each was handed over,
    the error the loop received, and the threads left once it stopped."""
    n_batches = math.ceil(data.n / bs)

    def train():
        threads0 = threading.active_count()
        got, waits, handed, asked, error = [], [], [], [], None
        it = call_learner(ex, fn, data, bs, workers)
        if it is None:
            fail(ex, "an iterable of batches", "None",
                 "return the generator (or use `yield`)")
        try:
            iterator = iter(it)
            while len(got) <= 2 * n_batches + 2:
                t0 = time.perf_counter()
                asked.append(t0)
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                handed.append(time.perf_counter())
                waits.append(handed[-1] - t0)
                got.append(batch)
                if stop_after is not None and len(got) >= stop_after:
                    break
                time.sleep(step_s)  # the training step
        except ExerciseFailed:
            raise
        except Exception as e:  # the dataset's error, or the learner's own
            error = e
        close = getattr(it, "close", None)
        closed_at = time.perf_counter()
        if callable(close) and error is None:
            try:
                close()
            except Exception as e:
                error = e
        deadline = time.perf_counter() + 2.0 + 3 * data.load_s * bs
        while threading.active_count() > threads0 and time.perf_counter() < deadline:
            time.sleep(0.01)
        return {"batches": got, "waits": waits, "handed": handed, "asked": asked,
                "error": error, "closed_at": closed_at,
                "left": threading.active_count() - threads0,
                "loop_thread": threading.get_ident()}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _run_with_timeout(ex, train, timeout=10)


def _raised_in_loop(ex: str, e: Exception) -> None:
    first = str(e).splitlines()[0] if str(e) else ""
    hint = "fix that error and run the exercise cell again"
    if "process that made it" in str(e):
        hint = ("the dataset cannot be read in other processes (a DataLoader's "
                "workers are processes): start threads, e.g. a ThreadPoolExecutor")
    fail(ex, "your loader to run", f"it raised {type(e).__name__}: {first}", hint)


def _check_ahead_batches(ex: str, data: TracedSamples, bs: int, got: list,
                         setting: str) -> None:
    want = [list(range(s, min(s + bs, data.n))) for s in range(0, data.n, bs)]
    for k, batch in enumerate(got):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2
                and all(isinstance(t, torch.Tensor) for t in batch)):
            fail(ex, "each batch as (x, y): the samples' x stacked, their y stacked",
                 f"batch {k}: a {type(batch).__name__} {str(batch)[:60]}",
                 "torch.stack the x of the batch's samples, and their y")
        if k >= len(want):
            fail(ex, f"{len(want)} batches ({setting})", f"more than {len(want)}",
                 "stop when the dataset's samples run out")
        x, y = batch
        idx = want[k]
        shapes = (("x", x, tuple(data.x[idx].shape)), ("y", y, (len(idx),)))
        for name, t, shape in shapes:
            if tuple(t.shape) != shape:
                fail(ex, f"batch {k}'s {name} of shape {shape}: {len(idx)} samples "
                     f"stacked ({setting})", f"shape {tuple(t.shape)}",
                     "torch.stack keeps each sample's shape and adds the batch "
                     "dimension, also for a last batch of one sample: no reshape, "
                     "view, squeeze or cat")
        if y.tolist() != idx:
            seen = y.tolist()
            hint = ("hand the batches out in their order: batch k holds samples "
                    "k*batch_size onwards, whichever thread finished first")
            if y.tolist() not in want:
                hint = (f"batch k holds samples k*{bs} .. (k+1)*{bs}-1, the last one "
                        "possibly shorter; every sample once")
            fail(ex, f"batch {k} to hold samples {idx} in order ({setting})",
                 f"samples {seen}", hint)
        if y.dtype != torch.int64:
            fail(ex, f"batch {k}'s y to be its samples' y stacked, unchanged (int64)",
                 f"dtype {y.dtype}", "torch.stack the samples' y as they are")
        if x.dtype != torch.float64 or not torch.equal(x, data.x[idx]):
            fail(ex, f"batch {k}'s x to be its samples stacked, unchanged (float64)",
                 f"dtype {x.dtype}" if x.dtype != torch.float64 else "other values",
                 "torch.stack the samples as they are: no dtype change, no copy "
                 "into a buffer reused for the next batch")
    if len(got) != len(want):
        fail(ex, f"{len(want)} batches, the last one too ({setting})",
             f"{len(got)} batches", "hand out every batch, the short last one too")


def _check_ahead_trace(ex: str, data: TracedSamples, bs: int, workers: int,
                       run: dict, setting: str) -> None:
    trace = sorted(data.trace)
    for start, _end, i, thread in trace:
        if workers == 0 and thread != run["loop_thread"]:
            fail(ex, "with workers=0, every batch loaded by the loop itself",
                 "loads in another thread", "workers=0 means no thread: load each "
                 "batch when the loop asks for it")
        # while the loop asks for batch k (k + 1 requests so far), batches up to
        # k + 2 x workers may load: the one asked for and 2 x workers ahead of it
        asked = sum(a < start for a in run["asked"])
        if i // bs > asked - 1 + 2 * workers:
            fail(ex, f"at most {2 * workers} batches loaded ahead of the one handed "
                 f"out ({setting})",
                 f"batch {i // bs} started loading when the loop had asked for "
                 f"{asked} batch{'es' if asked != 1 else ''}",
                 "keep a bounded queue of 2 x workers batches: start loading a "
                 "batch when one is handed out, not all of them at once")
    edges = sorted([(s, 1) for s, _e, _i, _t in trace]
                   + [(e, -1) for _s, e, _i, _t in trace], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _t, step in edges:
        running += step
        peak = max(peak, running)
    if peak > max(1, workers):
        fail(ex, f"at most {max(1, workers)} samples loading at once ({setting})",
             f"{peak} at once", f"start {workers} threads (or a pool of {workers}), "
             "not one per batch")


def check_load_ahead(fn: Callable) -> None:
    """Exercise 3.3: ``load_ahead(dataset, batch_size, workers)``, a generator of
    batches loaded ahead by ``workers`` threads.

    Judged by behaviour: the batches and their order; the time the training
    loop waits for data in the second half of an epoch (loads and steps are
    sleeps, so the verdict does not depend on the machine's load); how far
    ahead and how many at once the threads load; no thread left after the
    loop stops early; a dataset's error reaching the loop; a second call.
    """
    ex = "3.3"
    require_solution(ex, fn)
    for case, (n, bs, workers, load_s, step_s, shape) in enumerate(_AHEAD_CASES):
        setting = (f"{n} samples in batches of {bs}, workers={workers}, a batch "
                   f"takes {load_s * 1e3:.0f} ms to load and a step "
                   f"{step_s * 1e3:.0f} ms")
        starved, runs = math.inf, 0
        while runs < 3:  # another run only while it starved a little
            runs += 1
            data = TracedSamples(n, load_s / bs, shape=shape, seed=case)
            run = _drive(ex, fn, data, bs, workers, step_s)
            if run["error"] is not None:
                _raised_in_loop(ex, run["error"])
            _check_ahead_batches(ex, data, bs, run["batches"], setting)
            _check_ahead_trace(ex, data, bs, workers, run, setting)
            if run["left"] > 0:
                fail(ex, f"no thread left once the epoch is over ({setting})",
                     f"{run['left']} thread(s) still alive",
                     "let the threads finish (a `with ThreadPoolExecutor(...)` "
                     "block, or join them) before the generator returns")
            if workers == 0:  # the loop loads in turn with its steps: nothing to hide
                starved = 0.0
                break
            half = run["waits"][len(run["waits"]) // 2:]
            starved = min(starved, sum(half) / (step_s * len(half)))
            if starved <= STARVED_FRACTION:
                break  # fed; a starved run is tried again (a busy machine)
        if starved > STARVED_FRACTION:
            need = 0 if load_s <= STARVED_FRACTION * step_s else math.ceil(
                load_s / step_s)
            fail(ex, f"the loop to wait for data at most {STARVED_FRACTION:.0%} of a "
                 f"step, in the second half of the epoch ({setting})",
                 f"it waited {starved * step_s * 1e3:.1f} ms per step (best of "
                 f"{runs} run{'s' if runs > 1 else ''})",
                 f"{workers} threads loading at once make {workers} batches per "
                 f"{load_s * 1e3:.0f} ms, enough for {need or 'no'} thread(s); "
                 "are they loading while the loop trains, all of them?")
    # the loop stops after 3 batches: loading stops, and no thread is left; 3
    # threads keep 3 batches loading and 3 queued, and a queued one must not start
    data = TracedSamples(60, 0.200 / 4, seed=7)  # slow loads, quick steps
    run = _drive(ex, fn, data, 4, 3, 0.005, stop_after=3)
    if run["error"] is not None:
        _raised_in_loop(ex, run["error"])
    first_load: dict[int, float] = {}
    for start, _e, i, _t in data.trace:
        first_load[i // 4] = min(start, first_load.get(i // 4, math.inf))
    after = sorted(b for b, t in first_load.items() if t > run["closed_at"])
    cancel = ("on close (GeneratorExit at the `yield`, or a `finally:`) cancel what "
              "is queued (future.cancel(), or shutdown(cancel_futures=True)) and let "
              "the threads end")
    if len(first_load) > 3 + 2 * 3 + 1 or run["left"] > 0:
        fail(ex, "when the loop stops after 3 batches (the generator is closed), "
             "loading stops and the threads end",
             f"{len(first_load)} of 15 batches loaded, {run['left']} thread(s) left",
             cancel)
    if len(after) > 1:  # one may start as the close arrives
        fail(ex, "when the loop stops after 3 batches (the generator is closed), "
             "no queued batch starts loading",
             f"{len(after)} batches (numbers {after}) started loading after the "
             "close: every queued load ran to its end",
             cancel + "; leaving a `with ThreadPoolExecutor` block waits for "
             "every queued load")
    # a corrupt sample: the error reaches the loop, which must not hang
    data = TracedSamples(40, 0.040 / 4, seed=8, fail_at=9)
    run = _drive(ex, fn, data, 4, 2, 0.025)
    if run["error"] is None or "corrupt" not in str(run["error"]):
        seen = ("the epoch ended normally after "
                f"{len(run['batches'])} batches" if run["error"] is None
                else f"{type(run['error']).__name__}: {run['error']}")
        fail(ex, "the dataset's error (sample 9 is corrupt) raised in the loop",
             seen, "a thread's error must reach the loop: future.result() "
                   "re-raises it; do not catch and drop it")
    passed(ex, "Every batch arrived in order, loaded ahead by at most "
               "2 x workers threads' worth, and the loop waited for data less than "
               f"{STARVED_FRACTION:.0%} of a step.")
