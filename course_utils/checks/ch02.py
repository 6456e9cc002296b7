"""Checkers for Chapter 2, "CPU vs GPU, and measuring it right".

Exercise 2.1 (``measure(fn, sync)``) is judged by what it returns for work
whose true cost the checker knows, on every machine:

- on a **stand-in device**, a background thread that runs the queued work in
  order: ``fn()`` queues a job and returns at once, as a CUDA launch does, and
  ``sync()`` waits until every queued job has run, as
  ``torch.cuda.synchronize()`` does. The first job takes 0.25 s (lazy
  initialisation), later ones a time the checker picks and changes between
  runs, so a constant cannot match. The jobs are sleeps: their cost does not
  depend on how busy the machine is, and the thread records how long each
  really took;
- on a GPU, also a real CUDA workload (an asynchronous matmul after the same
  slow first call), whose true time per call comes from CUDA events.

Each failure names one mistake: fewer than 3 calls; the total instead of the
time per call; the slow first call inside the measurement (no warm-up, or a
warm-up whose work was still running when the clock started); a result far
below the true time (the clock was read before the device finished: no
``sync()`` at the end, or only one at the start).

Exercise 2.2 (``run_epoch``) is checked by running it under a
``TorchFunctionMode`` that counts every read of tensor values by the host
(``.item()``, ``float()``, ``print``, ``.tolist()``, ``.cpu()``,
``.to("cpu")``, ``.numpy()``, ``numpy.asarray`` ...), with a loss function
that tags every step's autograd graph, so the checker sees how many graphs
are still alive at each step. Exercise 2.3 (``roofline_verdicts``) is given
points measured on this machine and seeded points for published GPU peaks,
including points exactly at the ridge.
"""

from __future__ import annotations

import copy
import math
import queue
import random
import statistics
import threading
import time
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from course_utils.devices import try_gpu
from course_utils.exercises import (
    call_learner,
    check_close,
    check_type,
    fail,
    passed,
    require_solution,
)

# --- Exercise 2.1: time this workload correctly ---------------------------------

FIRST_CALL_S = 0.25  # the slow first call (lazy initialisation)
CALLS_S = (0.012, 0.025)  # each later call, in the two stand-in runs
MIN_CALLS = 3
CPU_FACTOR = 1.3  # the stand-in's sleeps are precise: a right answer is close
GPU_FACTOR = 1.5  # a host timer adds launch and sync overhead to the event time


class StandInDevice:
    """A pretend asynchronous device: a worker thread runs queued jobs in order.

    ``launch`` (the ``fn`` a learner times) queues one job and returns at
    once; ``sync`` waits until every queued job has run. Records the true
    duration of every job, and the order of launches and syncs.
    """

    def __init__(self, first: float = FIRST_CALL_S, each: float = CALLS_S[0]):
        self.first, self.each = first, each
        self.durations: list[float] = []
        self.log: list[str] = []
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            seconds = self._jobs.get()
            if seconds is None:
                self._jobs.task_done()
                return
            start = time.perf_counter()
            time.sleep(seconds)
            self.durations.append(time.perf_counter() - start)
            self._jobs.task_done()

    def launch(self) -> None:
        self._jobs.put(self.first if "fn" not in self.log else self.each)
        self.log.append("fn")

    def sync(self, *args, **kwargs) -> None:
        self.log.append("sync")
        self._jobs.join()

    def true_durations(self) -> list[float]:
        self._jobs.join()
        return list(self.durations)

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=30)


class CudaMatmulWork:
    """A GPU workload: a slow first call, then one asynchronous matmul per call.

    CUDA events recorded around every launch give the true GPU time per call,
    read only after the learner's function has returned.
    """

    def __init__(self, device: torch.device, n: int = 4096,
                 first: float = FIRST_CALL_S):
        gen = torch.Generator(device=device).manual_seed(0)
        self.device = device
        self.a = torch.randn(n, n, device=device, generator=gen)
        self.out = torch.empty_like(self.a)
        self.first = first
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.log: list[str] = []
        torch.mm(self.a, self.a, out=self.out)  # the checker's own warm-up
        torch.cuda.synchronize(device)

    def launch(self) -> None:
        if not self.events:
            time.sleep(self.first)
        self.log.append("fn")
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(self.a, self.a, out=self.out)
        end.record()
        self.events.append((start, end))

    def sync(self, *args, **kwargs) -> None:
        self.log.append("sync")
        torch.cuda.synchronize(self.device)

    def true_durations(self) -> list[float]:
        torch.cuda.synchronize(self.device)
        gpu = [s.elapsed_time(e) / 1e3 for s, e in self.events]
        return [gpu[0] + self.first, *gpu[1:]] if gpu else []

    def close(self) -> None:
        pass


def _near(value: float, target: float, factor: float) -> bool:
    return target / factor <= value <= target * factor


def _waited_after_first(log: list[str]) -> bool:
    """Whether ``sync`` ran between the first launch and the second."""
    if "fn" not in log:
        return False
    rest = log[log.index("fn") + 1:]
    return "sync" in rest[:rest.index("fn")] if "fn" in rest else "sync" in rest


def _judge_measure(ex: str, seconds, work, where: str) -> float:
    """Fail with the mistake that explains ``seconds``; return the true time."""
    if isinstance(seconds, torch.Tensor) and seconds.numel() == 1:
        seconds = seconds.item()  # a one-number tensor of seconds is fine too
    if hasattr(seconds, "median"):
        fail(ex, "seconds per call, as a float",
             f"a {type(seconds).__name__} object",
             "return a number, e.g. the .median of your timings")
    check_type(ex, seconds, (float, int), "measure's return value")
    durations = work.true_durations()
    calls = len(durations)
    if calls < MIN_CALLS:
        fail(ex, f"fn called at least {MIN_CALLS} times (warm-up, then repeats)",
             f"fn called {calls} time(s) {where}",
             "one timed call measures noise and first-call costs: warm up, then "
             "time several calls and take the median (or the mean of a loop)")
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds <= 0:
        fail(ex, "a positive number of seconds", f"{seconds!r}")
    steady = statistics.median(durations[1:])
    factor = GPU_FACTOR if "GPU" in where else CPU_FACTOR
    if _near(seconds, steady, factor):
        return steady
    expected = f"about {steady * 1e3:.3g} ms per call {where}"
    total = sum(durations)
    warm_up_hint = "warm up: call fn() once, then sync(), before starting the clock"
    if seconds > steady * factor and not _waited_after_first(work.log):
        fail(ex, expected,
             f"{seconds * 1e3:.4g} ms: the slow first call "
             f"({durations[0] * 1e3:.0f} ms) was still running, or timed",
             warm_up_hint)
    if _near(seconds, total, 1.3) or _near(seconds, total - durations[0], 1.3):
        fail(ex, expected, f"{seconds * 1e3:.4g} ms, the total of all {calls} calls",
             "divide the time of a loop by the number of calls in it")
    if seconds < steady / factor:
        fail(ex, expected,
             f"{seconds * 1e3:.4g} ms: only the time to QUEUE the work",
             "the device runs fn's work after fn returns: call sync() after the "
             "last call, before reading the clock (and before starting it)")
    if seconds > steady * factor:
        if _near(seconds, total / calls, 1.3):
            fail(ex, expected, f"{seconds * 1e3:.4g} ms: the mean of every call, "
                 f"the slow first one ({durations[0] * 1e3:.0f} ms) included",
                 warm_up_hint)
        fail(ex, expected, f"{seconds * 1e3:.4g} ms: more than the work takes",
             "time only complete calls of fn (after a warm-up and a sync()) and "
             "divide by how many")
    fail(ex, expected, f"{seconds * 1e3:.4g} ms",
         "time only complete calls of fn (after a warm-up) and divide by how many")
    raise AssertionError("unreachable")


def _run_measure(ex: str, measure, work, where: str) -> float:
    try:
        seconds = call_learner(ex, measure, work.launch, work.sync)
        return _judge_measure(ex, seconds, work, where)
    finally:
        work.close()


def check_measure(measure) -> None:
    """Exercise 2.1: ``measure(fn, sync)`` returns seconds per call of ``fn``."""
    ex = "2.1"
    require_solution(ex, measure)
    for each in CALLS_S:
        _run_measure(ex, measure, StandInDevice(each=each),
                     f"on the stand-in device ({each * 1e3:.0f} ms of work per call)")
    note = "the stand-in device timed right, at two costs per call"
    device = try_gpu()
    if device.type == "cuda":  # a real asynchronous workload as well
        steady = _run_measure(ex, measure, CudaMatmulWork(device), "on the GPU")
        note += f"; a GPU matmul timed at {steady * 1e3:.3g} ms per call (CUDA events)"
    passed(ex, note + ".")


# --- Exercise 2.2: log the loss without a sync per step or a graph kept alive -----

HOST_READS = frozenset({"item", "__float__", "__int__", "__index__", "__bool__",
                        "__complex__", "tolist", "cpu", "numpy", "__array__",
                        "__format__", "__repr__", "__str__"})
READ_NAMES = {"item": ".item()", "__float__": "float()", "__int__": "int()",
              "__index__": "an index", "__bool__": "bool() or an if",
              "__complex__": "complex()", "tolist": ".tolist()", "cpu": ".cpu()",
              "numpy": ".numpy()", "__array__": "numpy.asarray/np.array",
              "__format__": "an f-string or format()", "__repr__": "print or repr()",
              "__str__": "print or str()", "to": ".to('cpu')"}
MAX_GRAPHS_ALIVE = 2  # the step's own graph and, at most, the previous one


class CountHostReads(TorchFunctionMode):
    """Counts operations that copy a tensor's value to Python (a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        # .to("cpu") copies to the host: a wait on a GPU, and the same code here
        # (a device spelled as a string: `.to(x.device)` keeps data where x is)
        moved_to_host = (name == "to" and isinstance(args[0], torch.Tensor) and any(
            isinstance(a, str) and a.startswith("cpu")
            for a in (*args[1:], *(kwargs or {}).values())))
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
    require_solution(ex, run_epoch)
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
        names = sorted({READ_NAMES.get(r, r) for r in counter.reads})
        fail(ex, "one read of the loss by Python per epoch (at the end)",
             f"{len(counter.reads)} reads ({', '.join(names)}) in {steps} steps",
             "each .item(), float(), print, .tolist(), .cpu(), .to('cpu') or "
             ".numpy() of a GPU tensor waits for the GPU: accumulate "
             "loss.detach() on the device and read it once at the end")
    check_type(ex, result, (float, int), "run_epoch's return value")
    check_close(ex, result, expected, rtol=1e-4, atol=1e-6,
                what="the mean loss of the epoch",
                hint="average the loss of every batch (each taken before its step)")
    passed(ex, f"{steps} steps on {device}, {len(counter.reads)} read(s) by the host, "
               f"at most {most_alive} graph(s) alive.")


# --- Exercise 2.3: which roof limits a measured kernel? --------------------------


def _verdicts(points, peak: float, bandwidth: float) -> list[tuple[str, float]]:
    ridge = peak / bandwidth
    out = []
    for flop, nbytes, seconds in points:
        bound = "compute" if flop >= ridge * nbytes else "memory"
        out.append((bound, max(flop / peak, nbytes / bandwidth) / seconds))
    return out


def _measured_points() -> list[tuple[float, float, float]]:
    """A matmul and an add timed on this machine (their true costs do not matter:
    the checker compares the learner's verdicts with its own on the same points)."""
    pts = []
    for n in (48, 160):
        a = torch.randn(n, n)
        start = time.perf_counter()
        for _ in range(5):
            torch.mm(a, a)
        pts.append((2.0 * n**3, 12.0 * n * n, (time.perf_counter() - start) / 5))
    x = torch.randn(1 << 16)
    start = time.perf_counter()
    for _ in range(5):
        torch.add(x, x)
    pts.append((float(1 << 16), 12.0 * (1 << 16), (time.perf_counter() - start) / 5))
    return pts


def _synthetic(peak: float, bandwidth: float, seed: int):
    """Seeded kernels on both sides of a device's ridge, and a copy."""
    rng = random.Random(seed)
    ridge = peak / bandwidth
    pts = []
    for intensity in (ridge / 40, ridge / 3, ridge * 3, ridge * 25):
        nbytes = float(rng.randrange(1 << 20, 1 << 30))
        flop = intensity * nbytes
        roof_t = max(flop / peak, nbytes / bandwidth)
        pts.append((flop, nbytes, roof_t / rng.uniform(0.05, 0.95)))
    pts.append((0.0, 2.0**28, 2.0**28 / bandwidth * 1.25))  # a copy: no FLOP
    rng.shuffle(pts)
    return pts


def check_roofline_verdicts(roofline_verdicts) -> None:
    """Exercise 2.3: ``roofline_verdicts(points, peak_flops, bandwidth)``."""
    ex = "2.3"
    require_solution(ex, roofline_verdicts)
    from course_utils import predict  # published peaks of named GPUs

    # a made-up CPU whose ridge, 2.5 FLOP/byte, is exact in binary, with a
    # kernel exactly on it (however the comparison is written, it is equal)
    on_ridge = (2.5 * 4096, 4096.0, 4096 / 20e9 * 2)
    cases = [("this CPU (measured points, made-up peaks)",
              [*_measured_points(), on_ridge], 50e9, 20e9)]
    for k, (gpu, math_mode) in enumerate((("h100_sxm", "fp32"), ("a100_sxm_80gb",
                                                                  "bf16"),
                                          ("t4", "fp32"))):
        peak, bw = predict.peak_flops(gpu, math_mode), predict.memory_bandwidth(gpu)
        cases.append((f"{predict.gpu_name(gpu)} {math_mode}",
                      _synthetic(peak, bw, seed=k), peak, bw))
    for name, points, peak, bw in cases:
        got = call_learner(ex, roofline_verdicts, list(points), peak, bw)
        want = _verdicts(points, peak, bw)
        if not isinstance(got, (list, tuple)) or len(got) != len(points):
            fail(ex, f"one (bound, fraction) pair per point ({len(points)})",
                 f"{type(got).__name__}: {got!r:.80}")
        for (flop, nbytes, seconds), g, (bound, fraction) in zip(points, got, want,
                                                                 strict=True):
            point = (f"{flop:.4g} FLOP, {nbytes:.4g} bytes in {seconds:.3g} s on "
                     f"{name} (peak {peak:.3g} FLOP/s, {bw:.3g} B/s)")
            if not isinstance(g, (list, tuple)) or len(g) != 2:
                fail(ex, "a pair (bound, fraction) for each point", f"{g!r:.60}")
            g_bound, g_fraction = g
            if g_bound not in ("compute", "memory"):
                fail(ex, 'bound "compute" or "memory"', f"{g_bound!r}")
            if g_bound != bound:
                on_ridge = math.isclose(flop, peak / bw * nbytes, rel_tol=1e-12)
                fail(ex, f"{bound}-bound for {point}", f"{g_bound}-bound",
                     "exactly at the ridge counts as compute-bound (intensity >= "
                     "ridge)" if on_ridge else
                     "compare the intensity (FLOP per byte moved) with the ridge "
                     "point, peak FLOP/s / bandwidth: above it, the FLOP roof "
                     "limits; below, the bandwidth roof")
            try:
                g_fraction = float(g_fraction)
            except (TypeError, ValueError):
                fail(ex, "a number for the fraction of the roof", f"{g_fraction!r}")
            if math.isclose(g_fraction, 1 / fraction, rel_tol=1e-6) and not (
                    math.isclose(fraction, 1.0, rel_tol=1e-6)):
                fail(ex, f"fraction {fraction:.4g} for {point}", f"{g_fraction:.4g}",
                     "the fraction is the time the roof allows over the measured "
                     "time (at most 1), not its inverse")
            check_close(ex, g_fraction, fraction, rtol=1e-6,
                        what=f"the fraction of the roof reached, for {point}",
                        hint="the roof at this intensity is min(peak, intensity x "
                             "bandwidth); equivalently the kernel needs at least "
                             "max(FLOP / peak, bytes / bandwidth) seconds: divide "
                             "that by the measured time")
    passed(ex, f"{sum(len(c[1]) for c in cases)} kernels on {len(cases)} devices, "
               "including one on the ridge and a copy with no FLOP.")
