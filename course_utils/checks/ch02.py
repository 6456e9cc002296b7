"""Checkers for Chapter 2, "CPU vs GPU, and measuring it right".

Exercise 2.1 (``measure``) is checked with workloads whose true cost the
checker knows, so it means something on a CPU-only machine too:

- on every machine, a CPU workload whose first call is slow (0.3 s, like lazy
  initialisation or a cold cache) and whose later calls take about 10 ms;
- on a GPU, also a real CUDA workload (a large matmul launched
  asynchronously, after the same slow first call), whose true time per call
  the checker reads from CUDA events it records around every call.

Each failure names one mistake:

- ``fn`` called fewer than 3 times: a single run (or one warm-up and one run)
  measures noise and first-call costs, not the steady state;
- a result near the *total* time of all calls: it was not divided by the
  number of calls;
- a result near the *mean including the first call*: no warm-up;
- on a GPU, a result far *below* the true kernel time: the timer stopped
  before the GPU finished (no ``synchronize``, no events);
- on a CPU-only machine, a function that uses nothing that waits for a
  device: no ``synchronize`` (``torch.cuda``'s, ``torch.cpu``'s,
  ``torch.accelerator``'s or ``course_utils``'), no CUDA events, no
  ``torch.utils.benchmark``, ``bench`` or ``Benchmark``. On a CPU every timing
  is synchronous, so reading the code is the only way a CPU-only machine can
  catch the missing wait that a GPU would expose. The reading is of the names
  the function's *code* uses (not its comments or strings), including the
  learner's own helpers that it calls, so a wait hidden in ``def sync(d): ...``
  in another cell counts. On a GPU machine the CUDA workload is the judge and
  the code is not read.

Exercise 2.2 (``run_epoch``) is checked by running it under a
``TorchFunctionMode`` that counts reads of tensor values by the host
(``.item()``, ``float()``, ``print``, ``.cpu()`` ...), with a loss function
that tags every step's autograd graph, so the checker sees how many graphs
are still alive at each step. Exercise 2.3 (``roofline_point``) checks the
FLOP and byte counts of a matmul against their definitions.
"""

from __future__ import annotations

import copy
import functools
import math
import time
import types
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from course_utils.devices import try_gpu
from course_utils.exercises import (
    ExerciseFailed,
    call_learner,
    check_close,
    check_type,
    fail,
    passed,
)

# --- Exercise 2.1: time this workload correctly ---------------------------------

FIRST_CALL_S = 0.3  # the slow first call (lazy initialisation)
CALL_S = 0.01  # each later call of the CPU workload
MIN_CALLS = 3
CPU_FACTOR = 1.25  # sleeps are precise: a correct CPU answer is within a few %
GPU_FACTOR = 1.5  # a host timer adds launch and sync overhead to the event time
# Pieces of the names a measure function uses (directly, through the objects
# those names refer to, or through the learner's own helpers it calls) that
# show it waits for the device before reading the clock, or leaves the waiting
# to a tool that does: torch.cuda/cpu/accelerator.synchronize, a stream's
# synchronize, course_utils' synchronize/Benchmark/bench, CUDA events,
# torch.utils.benchmark (Timer, blocked_autorange), triton's do_bench.
WAIT_MARKS = ("synchronize", "Event", "elapsed_time", "bench", "blocked_autorange",
              "profiler")


class SlowFirstCall:
    """A CPU workload of known cost: the first call sleeps ``first`` seconds,
    every later one ``each`` seconds. Records how long each call really took.
    """

    def __init__(self, first: float = FIRST_CALL_S, each: float = CALL_S):
        self.first, self.each = first, each
        self.durations: list[float] = []

    def __call__(self) -> None:
        start = time.perf_counter()
        time.sleep(self.first if not self.durations else self.each)
        self.durations.append(time.perf_counter() - start)

    def true_durations(self) -> list[float]:
        return self.durations


class CudaMatmulWork:
    """A GPU workload: a slow first call, then one asynchronous matmul per call.

    CUDA events recorded around every launch give the true GPU time per call,
    read only after the learner's function has returned.
    """

    def __init__(self, device: torch.device, n: int = 4096,
                 first: float = FIRST_CALL_S):
        gen = torch.Generator(device=device).manual_seed(0)
        self.a = torch.randn(n, n, device=device, generator=gen)
        self.out = torch.empty_like(self.a)
        self.first = first
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        torch.mm(self.a, self.a, out=self.out)  # the checker's own warm-up
        torch.cuda.synchronize(device)

    def __call__(self) -> None:
        if not self.events:
            time.sleep(self.first)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(self.a, self.a, out=self.out)
        end.record()
        self.events.append((start, end))

    def true_durations(self) -> list[float]:
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) / 1e3 for s, e in self.events]
        return [gpu[0] + self.first, *gpu[1:]] if gpu else []


def _near(value: float, target: float, factor: float) -> bool:
    return target / factor <= value <= target * factor


def _judge_measure(ex: str, seconds, work, device: torch.device) -> float:
    """Fail with the mistake that explains ``seconds``; return the true time."""
    if isinstance(seconds, torch.Tensor) and seconds.numel() == 1:
        seconds = seconds.item()  # a one-number tensor of seconds is fine too
    if hasattr(seconds, "median"):
        fail(ex, "seconds per call, as a float",
             f"a {type(seconds).__name__} object",
             "return a number, e.g. the .median of what bench() gives you")
    check_type(ex, seconds, (float, int), "measure's return value")
    durations = work.true_durations()
    calls = len(durations)
    if calls < MIN_CALLS:
        fail(ex, f"fn called at least {MIN_CALLS} times (warm-up, then repeats)",
             f"fn called {calls} time(s)",
             "one timed call measures noise and first-call costs: warm up, then "
             "time several calls and take the median (or the mean of a loop)")
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds <= 0:
        fail(ex, "a positive number of seconds", f"{seconds!r}")
    steady = sorted(durations[1:])[(calls - 1) // 2]  # median of the later calls
    where = f"on {device}"
    factor = GPU_FACTOR if device.type == "cuda" else CPU_FACTOR
    if _near(seconds, steady, factor):
        return steady
    total, total_later = sum(durations), sum(durations[1:])
    if _near(seconds, total, 1.3) or _near(seconds, total_later, 1.3):
        fail(ex, f"about {steady * 1e3:.3g} ms per call {where}",
             f"{seconds * 1e3:.4g} ms, the total of all {calls} calls",
             "divide the time of a loop by the number of calls in it")
    if seconds > steady * factor and seconds >= 0.5 * (total / calls):
        fail(ex, f"about {steady * 1e3:.3g} ms per call {where}",
             f"{seconds * 1e3:.4g} ms: the slow first call "
             f"({durations[0] * 1e3:.0f} ms) is inside your measurement",
             "warm up: call fn once (or a few times) before you start timing")
    if seconds < steady / factor and device.type == "cuda":
        fail(ex, f"about {steady * 1e3:.3g} ms per call {where} (from CUDA events)",
             f"{seconds * 1e3:.4g} ms: only the time to LAUNCH the work",
             "CUDA work is asynchronous: call torch.cuda.synchronize(device) before "
             "reading the clock at the end (and the start), or use CUDA events")
    fail(ex, f"about {steady * 1e3:.3g} ms per call {where}",
         f"{seconds * 1e3:.4g} ms",
         "time only complete calls of fn (after a warm-up) and divide by how many")
    raise AssertionError("unreachable")


def _code_of(obj):
    """The Python code object behind a function, method, partial or callable."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)  # a bound method
    if not isinstance(obj, types.FunctionType) and callable(obj):
        obj = vars(type(obj)).get("__call__")
    return obj if isinstance(obj, types.FunctionType) else None


def _names_used(code: types.CodeType) -> set[str]:
    """Global and attribute names in ``code`` and the functions nested in it."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _qualified(obj) -> str:
    """``torch.utils.benchmark.utils.timer.Timer`` for an object, '' if unknown."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    kind = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', '')}"


def _waits_for_device(measure, depth: int = 3, seen=None) -> bool | None:
    """Whether ``measure`` uses something that waits for a device.

    Reads the names its code uses (never comments or strings), what those
    names refer to (``tub`` is ``torch.utils.benchmark``), and, ``depth``
    calls deep, the learner's own helpers that it calls. None when there is no
    Python code to read.
    """
    fn = _code_of(measure)
    if fn is None:
        return None
    seen = set() if seen is None else seen
    if fn in seen:
        return False
    seen.add(fn)
    names = _names_used(fn.__code__)
    scope = dict(fn.__globals__)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            scope[name] = cell.cell_contents
        except ValueError:  # a closure variable not assigned yet
            pass
    words = set(names)
    helpers = []
    for name in names & scope.keys():
        obj = scope[name]
        words.add(_qualified(obj))
        own = _code_of(obj)
        if own is not None and own.__module__ in (fn.__module__, "__main__"):
            helpers.append(own)
    if any(mark in word for word in words for mark in WAIT_MARKS):
        return True
    return depth > 0 and any(_waits_for_device(h, depth - 1, seen) for h in helpers)


def _seconds(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _call_measure(ex: str, measure, work, device: torch.device):
    try:
        return call_learner(ex, measure, work, device)
    except ExerciseFailed as e:
        no_cuda = ("not compiled with CUDA", "NVIDIA driver", "no CUDA GPUs",
                   "No CUDA GPUs", "accelerator device when none is available")
        if any(words in e.seen for words in no_cuda):
            fail(ex, e.expected, e.seen,
                 "you were given a CPU: synchronise only when device.type == 'cuda' "
                 "(or use bench(), which does it for you)")
        raise


def check_measure(measure) -> None:
    """Exercise 2.1: ``measure(fn, device)`` returns seconds per call of ``fn``."""
    ex = "2.1"
    cpu = torch.device("cpu")
    work = SlowFirstCall()
    seconds = _call_measure(ex, measure, work, cpu)
    _judge_measure(ex, seconds, work, cpu)
    device = try_gpu()
    if device.type == "cuda":  # a real asynchronous workload is the judge
        gpu_work = CudaMatmulWork(device)
        seconds = _call_measure(ex, measure, gpu_work, device)
        steady = _judge_measure(ex, seconds, gpu_work, device)
        note = (f"CPU workload timed correctly; GPU matmul "
                f"{_seconds(seconds) * 1e3:.3g} ms (CUDA events around each call: "
                f"{steady * 1e3:.3g} ms)")
    else:  # every CPU timing is synchronous: read the code for a wait
        if _waits_for_device(measure) is False:
            fail(ex, "a measurement that waits for the device before reading the "
                 "clock", "nothing in measure waits (no synchronize, CUDA events, "
                 "bench, Benchmark or torch.utils.benchmark)",
                 "on the CPU this gives the right number by luck; on a GPU it would "
                 "time only the launches: synchronise `device` (it does nothing on a "
                 "CPU), or use CUDA events, bench() or torch.utils.benchmark")
        note = ("CPU workload timed correctly, and measure waits for the device "
                "(on a GPU the checker also times a real CUDA matmul)")
    passed(ex, note + ".")


# --- Exercise 2.2: log the loss without a sync per step or a graph kept alive -----

HOST_READS = frozenset({"item", "__float__", "__int__", "__bool__", "tolist", "cpu",
                        "numpy", "__format__", "__repr__", "__str__"})
MAX_GRAPHS_ALIVE = 2  # the step's own graph and, at most, the previous one


class CountHostReads(TorchFunctionMode):
    """Counts operations that copy a tensor's value to Python (a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        moved_to_host = (name == "to" and isinstance(args[0], torch.Tensor)
                         and args[0].device.type != "cpu"
                         and "cpu" in map(str, (*args[1:], *(kwargs or {}).values())))
        if name in HOST_READS or moved_to_host:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class _GraphToken:
    """Lives exactly as long as the autograd graph it is attached to."""


class _Tag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token):
        ctx.token = token
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TaggedLoss:
    """Mean squared error that records how many earlier graphs are still alive."""

    def __init__(self):
        self.tokens: list[weakref.ref] = []
        self.alive_at_call: list[int] = []

    def __call__(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.alive_at_call.append(sum(r() is not None for r in self.tokens))
        token = _GraphToken()
        self.tokens.append(weakref.ref(token))
        return _Tag.apply(nn.functional.mse_loss(pred, target), token)


def _setup(device: torch.device, steps: int = 8):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    batches = [(torch.randn(64, 16, device=device), torch.randn(64, 1, device=device))
               for _ in range(steps)]
    return model, batches


def _reference_epoch(model, batches, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def check_run_epoch(run_epoch) -> None:
    """Exercise 2.2: ``run_epoch(model, optimizer, batches, loss_fn) -> float``."""
    ex = "2.2"
    device, lr = try_gpu(), 0.05
    model, batches = _setup(device)
    ref_model = copy.deepcopy(model)
    expected = _reference_epoch(ref_model, batches, lr)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = TaggedLoss()
    with CountHostReads() as counter:
        result = call_learner(ex, run_epoch, model, optimizer, batches, loss_fn)
    steps = len(batches)
    if len(loss_fn.alive_at_call) != steps:
        fail(ex, f"loss_fn called once per batch ({steps} times)",
             f"{len(loss_fn.alive_at_call)} calls",
             "compute loss = loss_fn(model(x), y) for every (x, y) in batches")
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=1e-4, atol=1e-6):
            fail(ex, "the model trained by one SGD step per batch",
                 "parameters that differ from that",
                 "each step: optimizer.zero_grad(), loss.backward(), optimizer.step()")
    if isinstance(result, torch.Tensor):
        fail(ex, "a Python float", f"a tensor ({result.device}, "
             f"grad_fn={type(result.grad_fn).__name__ if result.grad_fn else None})",
             "read the accumulated loss once, at the end, with .item()")
    most_alive = max(loss_fn.alive_at_call)
    if most_alive > MAX_GRAPHS_ALIVE:
        fail(ex, f"at most {MAX_GRAPHS_ALIVE} autograd graphs alive at a time",
             f"{most_alive} graphs alive at step "
             f"{loss_fn.alive_at_call.index(most_alive) + 1} of {steps}"
             " (every earlier step's graph is kept)",
             "accumulate loss.detach() (or a float), not loss itself: "
             "total += loss links each step's graph into the next")
    if len(counter.reads) > 2:
        names = sorted(set(counter.reads))
        fail(ex, "one read of the loss by Python per epoch (at the end)",
             f"{len(counter.reads)} reads ({', '.join(names)}) in {steps} steps",
             "each .item()/float()/print of a GPU tensor waits for the GPU: "
             "accumulate loss.detach() on the device and read it once at the end")
    check_type(ex, result, (float, int), "run_epoch's return value")
    check_close(ex, result, expected, rtol=1e-4, atol=1e-6,
                what="the mean loss of the epoch",
                hint="average the loss of every batch (each taken before its step)")
    passed(ex, f"{steps} steps on {device}, {len(counter.reads)} read(s) by the host, "
               f"at most {most_alive} graph(s) alive.")


# --- Exercise 2.3: a matmul's point on the roofline -----------------------------

CASES = [(64, 1e-5, torch.float32), (1024, 2e-3, torch.float16),
         (300, 7e-4, torch.float64), (4096, 0.12, torch.bfloat16)]


def check_roofline_point(roofline_point) -> None:
    """Exercise 2.3: ``roofline_point(n, seconds, dtype) -> (flop/s, flop/byte)``."""
    ex = "2.3"
    for n, seconds, dtype in CASES:
        out = call_learner(ex, roofline_point, n, seconds, dtype)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            fail(ex, "a pair (FLOP per second, FLOP per byte)", f"{out!r:.80}")
        rate, intensity = (float(v) for v in out)
        size = torch.empty((), dtype=dtype).element_size()
        flops, nbytes = 2 * n**3, 3 * n * n * size
        case = f"n={n}, {seconds} s, {str(dtype).replace('torch.', '')}"
        if math.isclose(rate, flops / 2 / seconds, rel_tol=1e-6):
            fail(ex, f"{flops / seconds:.4g} FLOP/s for {case}", f"{rate:.4g}",
                 "each of the n^3 multiply-adds is 2 floating-point operations")
        check_close(ex, rate, flops / seconds, rtol=1e-6, what=f"FLOP/s for {case}",
                    hint="an n x n @ n x n matmul does 2 n^3 FLOP")
        if math.isclose(intensity, flops / (3 * n * n), rel_tol=1e-6) and size != 1:
            fail(ex, f"{flops / nbytes:.4g} FLOP/byte for {case}", f"{intensity:.4g}",
                 "that is FLOP per element: multiply by the element size in bytes "
                 "(t.element_size(), or torch.finfo(dtype).bits // 8)")
        if math.isclose(intensity, flops / (2 * n * n * size), rel_tol=1e-6):
            fail(ex, f"{flops / nbytes:.4g} FLOP/byte for {case}", f"{intensity:.4g}",
                 "count the bytes of the output C too: A and B read, C written")
        check_close(ex, intensity, flops / nbytes, rtol=1e-6,
                    what=f"FLOP per byte for {case}",
                    hint="bytes = 3 n^2 x element size (read A and B, write C once)")
    passed(ex, f"{len(CASES)} sizes and dtypes.")
