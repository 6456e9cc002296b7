"""Checkers for Chapter 1, "The CUDA execution model".

The three exercises are kernels. They run on a deterministic simulator (below)
that takes a block's threads one at a time, from barrier to barrier, records
every memory access, and names races on shared memory, reads of shared memory
nobody wrote, indices outside an array and barriers some threads skip. The
global accesses it records go through ``course_utils.warps.trace_sectors``, so
a checker sees how many 32-byte sectors each warp request of the learner's
kernel touched. With a GPU (numba's CUDA target) the kernels also run for real.
"""

from __future__ import annotations

import math
import operator
import threading
import time
import types

import numba
import numpy as np

from course_utils.devices import kernel_target
from course_utils.exercises import (
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
)
from course_utils.warps import Trace, trace_sectors

MAX_THREADS_PER_BLOCK = 1024

# ---------------------------------------------------------------------------
# A deterministic block simulator with a race detector
# ---------------------------------------------------------------------------
#
# numba's simulator runs a block's threads as free-running Python threads, so a
# missing syncthreads shows up only on some runs. This one runs a block's
# threads one at a time, in order, from one barrier to the next (a "phase"),
# and records every shared-memory access: two threads touching the same element
# in one phase, one of them writing, is a race whatever the order would have
# been on a GPU. It also reports reads of shared memory nobody wrote, reads
# past the end of an array, and barriers that not every thread reaches.


class _Abort(BaseException):
    """Stops a simulated thread (BaseException: a learner's `except` passes it)."""


class KernelFault(Exception):
    """What went wrong in a simulated launch, said for a learner: ``hint`` too."""

    def __init__(self, seen: str, hint: str):
        super().__init__(seen)
        self.seen, self.hint = seen, hint


class _Dim3:
    __slots__ = ("x", "y", "z")

    def __init__(self, x: int, y: int = 1, z: int = 1):
        self.x, self.y, self.z = x, y, z


class _Array:
    """An array seen by a simulated kernel: every access is counted and checked."""

    def __init__(self, data: np.ndarray, name: str, sim: _Launch, shared: bool):
        self._data, self.name, self._sim, self._shared = data, name, sim, shared
        self.shape, self.size, self.ndim = data.shape, data.size, data.ndim
        self.dtype = data.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def _flat(self, index, verb: str) -> int:
        idx = index if isinstance(index, tuple) else (index,)
        try:
            idx = tuple(operator.index(i) for i in idx)
        except TypeError:
            raise KernelFault(
                f"{self._sim.who()} {verb} {self.name}[{index!r}]",
                "index arrays with whole numbers (use // for division)") from None
        if len(idx) != self.ndim or any(
                not 0 <= i < s for i, s in zip(idx, self.shape, strict=False)):
            where = "shared array" if self._shared else "array"
            raise KernelFault(
                f"{self._sim.who()} {verb} {self.name}[{index}], outside the "
                f"{where} of shape {self.shape}",
                "a GPU does not check: that thread would read or write "
                "whatever lies there. " + self._sim.hints.get(
                    "shared" if self._shared else self.name,
                    self._sim.hints.get("bounds", "guard the index with the "
                                                  "array's size")))
        flat = 0
        for i, s in zip(idx, self.shape, strict=True):
            flat = flat * s + i
        return flat

    def __getitem__(self, index):
        flat = self._flat(index, "reads")
        self._sim.access(self, flat, write=False)
        return self._data.flat[flat]

    def __setitem__(self, index, value):
        flat = self._flat(index, "writes")
        self._sim.access(self, flat, write=True)
        self._data.flat[flat] = value


class _Atomic:
    def __init__(self, sim: _Launch):
        self._sim = sim

    def _op(self, array, index, value, fn):
        if not isinstance(array, _Array):
            raise KernelFault("an atomic operation on something that is not one "
                              "of the kernel's arrays", "pass a kernel array")
        flat = array._flat(index, "updates")
        self._sim.access(array, flat, write=True, atomic=True)
        old = array._data.flat[flat]
        array._data.flat[flat] = fn(old, value)
        return old

    def add(self, array, index, value):
        return self._op(array, index, value, lambda a, b: a + b)

    def sub(self, array, index, value):
        return self._op(array, index, value, lambda a, b: a - b)

    def max(self, array, index, value):
        return self._op(array, index, value, max)

    def min(self, array, index, value):
        return self._op(array, index, value, min)


class _Shared:
    def __init__(self, sim: _Launch):
        self._sim = sim

    def array(self, shape, dtype):
        return self._sim.shared_array(shape, dtype)


class _Local:
    @staticmethod
    def array(shape, dtype):
        return np.zeros(shape, dtype=_np_dtype(dtype))


def _np_dtype(dtype) -> np.dtype:
    try:
        return np.dtype(str(dtype))  # numba's float32 prints as 'float32'
    except TypeError:
        return np.dtype(dtype)


class _FakeCuda:
    """The parts of numba.cuda a block-level kernel uses, for the current thread."""

    warpsize = 32

    def __init__(self, sim: _Launch):
        self._sim = sim
        self.shared, self.local, self.atomic = _Shared(sim), _Local(), _Atomic(sim)

    @property
    def threadIdx(self):
        t, bx = self._sim.current, self._sim.block_dim[0]
        return _Dim3(t % bx, t // bx)

    @property
    def blockIdx(self):
        b, gx = self._sim.block, self._sim.grid_dim[0]
        return _Dim3(b % gx, b // gx)

    @property
    def blockDim(self):
        return _Dim3(*self._sim.block_dim)

    @property
    def gridDim(self):
        return _Dim3(*self._sim.grid_dim)

    @property
    def laneid(self):
        return self._sim.current % 32

    def grid(self, ndim):
        b, t = self.blockIdx, self.threadIdx
        xy = (b.x * self._sim.block_dim[0] + t.x, b.y * self._sim.block_dim[1] + t.y)
        if ndim in (1, 2):
            return xy[0] if ndim == 1 else xy
        raise KernelFault(f"cuda.grid({ndim})", "this launch is 1-D or 2-D")

    def gridsize(self, ndim):
        g, d = self._sim.grid_dim, self._sim.block_dim
        if ndim in (1, 2):
            return g[0] * d[0] if ndim == 1 else (g[0] * d[0], g[1] * d[1])
        raise KernelFault(f"cuda.gridsize({ndim})", "this launch is 1-D or 2-D")

    def syncthreads(self):
        self._sim.barrier()

    def threadfence_block(self):
        self._sim.step()

    threadfence = threadfence_block

    def __getattr__(self, name):
        raise KernelFault(
            f"the kernel uses cuda.{name}",
            "the course's simulator runs cuda.grid, cuda.gridsize, the thread "
            "and block indices, shared memory, syncthreads and atomics: write "
            "the kernel with those")


class _FakeNumba:
    """``numba`` as a kernel sees it: ``numba.cuda`` is the simulated one."""

    def __init__(self, cuda):
        self.cuda = cuda

    def __getattr__(self, name):
        return getattr(numba, name)


def _python_function(kernel):
    """The Python function behind a ``@cuda.jit`` kernel (or a plain function)."""
    fn = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None) or kernel
    return fn if isinstance(fn, types.FunctionType) else None


def _rebind(fn: types.FunctionType, cuda, overrides: dict, seen=None):
    """``fn`` with numba.cuda (and device functions it calls) swapped for ``cuda``."""
    seen = {} if seen is None else seen
    if fn in seen:
        return seen[fn]
    env = dict(fn.__globals__)
    new = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    seen[fn] = new
    for name, value in fn.__globals__.items():
        if value is numba.cuda:
            env[name] = cuda
        elif value is numba:
            env[name] = _FakeNumba(cuda)
        elif name in fn.__code__.co_names and hasattr(value, "py_func") and (
                _python_function(value) is not None):
            env[name] = _rebind(_python_function(value), cuda, overrides, seen)
    env.update(overrides)
    return new


class _Launch:
    """Runs one launch block by block, each block's threads one at a time."""

    def __init__(self, fn, grid: tuple, block: tuple, max_steps: int,
                 hints: dict | None = None):
        self.grid_dim, self.block_dim = grid, block
        self.blocks, self.threads = grid[0] * grid[1], block[0] * block[1]
        self.max_steps, self.hints = max_steps, hints or {}
        self.log: dict[tuple[int, int], list] = {}  # global accesses per thread
        self.cuda = _FakeCuda(self)
        self.fn = fn
        self.block = self.current = 0
        self.shared_reads = [0] * self.threads  # per thread of the current block
        self.atomics_on = {"shared": 0, "global": 0}
        self.shared_used = False
        self.max_reads = 0
        self.max_barriers = 0

    def tn(self, t: int) -> str:
        """Thread number t of the block, as (x, y) in a 2-D block."""
        bx = self.block_dim[0]
        return str(t) if self.block_dim[1] == 1 else f"({t % bx}, {t // bx})"

    def bn(self) -> str:
        gx = self.grid_dim[0]
        return (str(self.block) if self.grid_dim[1] == 1
                else f"({self.block % gx}, {self.block // gx})")

    def who(self) -> str:
        t, b = self.cuda.threadIdx, self.cuda.blockIdx
        if self.block_dim[1] == 1 and self.grid_dim[1] == 1:
            return f"thread {t.x} of block {b.x}"
        return f"thread ({t.x}, {t.y}) of block ({b.x}, {b.y})"

    # --- memory ----------------------------------------------------------
    def step(self):
        if self.abort:
            raise _Abort
        self.steps += 1
        if self.steps > self.max_steps:
            raise KernelFault(
                f"more than {self.max_steps:,} memory accesses in block "
                f"{self.block}", self.hints.get(
                    "steps", "a loop that never ends? check that the loop "
                    "variable moves towards its end at every step"))

    def shared_array(self, shape, dtype):
        self.step()
        k = self.shared_calls[self.current]
        self.shared_calls[self.current] += 1
        if k == len(self.shared):
            dt = _np_dtype(dtype)  # garbage: NaN, or the most negative integer
            data = np.full(shape, np.nan if dt.kind in "fc" else np.iinfo(dt).min
                           if dt.kind in "iu" else 0, dtype=dt)
            self.shared.append(_Array(data, f"shared array {k}" if k else
                                      self.hints.get("shared_name", "sdata"),
                                      self, shared=True))
            self.written.append(set())
            self.shared_used = True
        return self.shared[k]

    def access(self, array: _Array, flat: int, write: bool, atomic: bool = False):
        self.step()
        if not array._shared:
            self.log.setdefault((self.block, self.current), []).append(
                (array.name, flat, write))
            if atomic:
                self.atomics_on["global"] += 1
            return
        if atomic:
            self.atomics_on["shared"] += 1
        k = self.shared.index(array)
        key = (k, flat)
        me = self.current
        writers, readers = self.phase_w.setdefault(key, set()), self.phase_r.setdefault(
            key, set())
        name = f"{array.name}[{flat}]"
        if write:
            other = (writers | readers) - {me}
            if other and not (atomic and key in self.phase_atomic):
                u = min(other)
                did = "wrote" if u in writers else "read"
                raise KernelFault(
                    f"a race in block {self.bn()}: thread {self.tn(me)} writes {name}, "
                    f"which thread {self.tn(u)} {did} since the last syncthreads",
                    self._race_hint(me, u, "on a GPU the two may run in either "
                                    "order: put cuda.syncthreads() between the step "
                                    "that writes shared memory and the step that "
                                    "reads it (and before it is written again)"))
            writers.add(me)
            if atomic:
                self.phase_atomic.add(key)
            self.written[k].add(flat)
        else:
            self.shared_reads[me] += 1
            other = writers - {me}
            if other:
                raise KernelFault(
                    f"a race in block {self.bn()}: thread {self.tn(me)} reads "
                    f"{name}, which thread {self.tn(min(other))} wrote since the "
                    "last syncthreads",
                    self._race_hint(me, min(other), "put cuda.syncthreads() "
                                    "between writing shared memory and reading "
                                    "what other threads wrote"))
            if flat not in self.written[k]:
                self.unwritten.setdefault(key, me)
            readers.add(me)

    def _race_hint(self, me: int, other: int, usual: str) -> str:
        most = max(self.barriers)

        def passed(t: int) -> int:  # a thread waiting at a barrier has not passed it
            return self.barriers[t] - (self.state[t] == "barrier")

        if passed(me) == passed(other) and not (
                self.state[other] == "done" and self.barriers[other] < most):
            return usual
        lagging = other if passed(other) <= passed(me) else me
        return (f"thread {self.tn(lagging)} passed {passed(lagging)} "
                f"syncthreads, other threads of the block {most}: a "
                "cuda.syncthreads() inside a branch that only some threads take "
                "does not separate them; call it where every thread of the "
                "block reaches it")

    # --- scheduling ------------------------------------------------------
    def barrier(self):
        self.step()
        self.state[self.current] = "barrier"
        self.barriers[self.current] += 1
        me = self.current
        self._pass_token()
        self.events[me].wait()
        self.events[me].clear()
        if self.abort:
            raise _Abort

    def _pass_token(self):
        if self.pending:
            self.current = self.pending.pop(0)
            self.events[self.current].set()
            return
        waiting = [t for t, s in enumerate(self.state) if s == "barrier"]
        done = [t for t, s in enumerate(self.state) if s == "done"]
        unwritten = {} if self.hints.get("unwritten") is None else self.unwritten
        for (k, flat), t in unwritten.items():  # a race would have raised
            self._fault(KernelFault(
                f"thread {self.tn(t)} of block {self.bn()} reads "
                f"{self.shared[k].name}[{flat}], which no thread wrote",
                self.hints["unwritten"]))
            return
        if waiting and done:
            self._fault(KernelFault(
                f"in block {self.bn()}, thread {self.tn(waiting[0])} waits at a "
                f"cuda.syncthreads() that thread {self.tn(done[0])} never reaches (it "
                "finished the kernel first)",
                "every thread of a block must reach every syncthreads: a thread "
                "outside the array must not return early; " + self.hints.get(
                    "early", "guard its loads and stores instead") + ", and keep "
                "syncthreads out of branches that only some threads take"))
            return
        if len({self.barriers[t] for t in waiting}) > 1:
            first = min(waiting, key=lambda t: self.barriers[t])
            last = max(waiting, key=lambda t: self.barriers[t])
            self._fault(KernelFault(
                f"in block {self.bn()}, thread {self.tn(first)} is at its "
                f"syncthreads number {self.barriers[first]} while thread "
                f"{self.tn(last)} is at number {self.barriers[last]}",
                "a cuda.syncthreads() inside an `if` that only some threads "
                "take: call it where every thread of the block reaches it"))
            return
        if not waiting:
            self.finished.set()
            return
        self.phase_w, self.phase_r, self.phase_atomic = {}, {}, set()
        self.unwritten = {}
        for t in waiting:
            self.state[t] = "run"
        self.pending = waiting[1:]
        self.current = waiting[0]
        self.events[self.current].set()

    def _fault(self, fault: BaseException):
        if self.error is None:
            self.error = fault
        self.abort = True
        for e in self.events:
            e.set()
        self.finished.set()

    def _thread(self, tid: int, args):
        self.events[tid].wait()
        self.events[tid].clear()
        try:
            if not self.abort:
                self.fn(*args)
        except _Abort:
            return
        except KernelFault as e:
            self._fault(e)
            return
        except Exception as e:  # the learner's code raised
            self._fault(e)
            return
        if not self.abort:
            self.state[tid] = "done"
            self._pass_token()

    def run_block(self, block: int, args, timeout: float = 20.0):
        self.block, self.steps, self.error, self.abort = block, 0, None, False
        self.shared, self.written = [], []
        self.shared_calls = [0] * self.threads
        self.shared_reads = [0] * self.threads
        self.state = ["run"] * self.threads
        self.barriers = [0] * self.threads
        self.phase_w, self.phase_r, self.phase_atomic = {}, {}, set()
        self.unwritten = {}
        self.events = [threading.Event() for _ in range(self.threads)]
        self.finished = threading.Event()
        workers = [threading.Thread(target=self._thread, args=(t, args), daemon=True)
                   for t in range(self.threads)]
        for w in workers:
            w.start()
        self.pending = list(range(1, self.threads))
        self.current = 0
        self.events[0].set()
        if not self.finished.wait(timeout):
            self._fault(KernelFault(
                f"block {block} did not finish in {timeout:.0f} s",
                self.hints.get("steps", "a loop that never ends?")))
        for w in workers:
            w.join(1.0)
        if self.error is not None:
            raise self.error
        self.max_reads = max(self.max_reads, max(self.shared_reads))
        self.max_barriers = max(self.max_barriers, max(self.barriers))


def simulate_block_kernel(kernel, args, blocks, threads,
                          overrides: dict | None = None, max_steps: int = 0,
                          names=("x", "out", "arg2", "arg3"),
                          hints: dict | None = None, limit: float = 20.0):
    """Run ``kernel[blocks, threads](*args)`` block by block, threads in turn.

    ``blocks`` and ``threads`` are ints or (x, y) pairs. Arrays in ``args`` are
    NumPy arrays, changed in place, called ``names`` in messages; ``hints``
    ("bounds", a name, "shared", "unwritten", "early", "steps") say what to do
    about each fault. Raises ``KernelFault`` for a race on shared memory, a
    read of unwritten shared memory (only when ``hints`` has "unwritten"), an
    index outside an array, or a barrier some threads skip; the learner's own
    exceptions pass through. Returns the launch: its counters (shared reads
    per thread, atomics) and ``log``, the global accesses of each (block,
    thread) in program order. All blocks together may take ``limit`` seconds.
    """
    fn = _python_function(kernel)
    if fn is None:
        raise TypeError("not a Python function or a @cuda.jit kernel")
    grid = (blocks, 1) if isinstance(blocks, int) else tuple(blocks)
    block = (threads, 1) if isinstance(threads, int) else tuple(threads)
    n = block[0] * block[1]
    launch = _Launch(None, grid, block, max_steps or 64 * n * max(8, n.bit_length()),
                     hints)
    launch.fn = _rebind(fn, launch.cuda, overrides or {})
    wrapped = [(_Array(a, nm, launch, shared=False) if isinstance(a, np.ndarray) else a)
               for a, nm in zip(args, names, strict=False)]
    deadline = time.monotonic() + limit  # all blocks together
    for b in range(launch.blocks):
        launch.run_block(b, wrapped, max(0.1, deadline - time.monotonic()))
    return launch


def traces(launch: _Launch, itemsize: int) -> dict[str, Trace]:
    """Sectors per warp request of a simulated launch: its reads, its writes."""
    gx, bx = launch.grid_dim[0], launch.block_dim[0]

    def of(write):
        def accesses(b, t):
            log = launch.log.get((b[1] * gx + b[0], t[1] * bx + t[0]), [])
            return [(name, flat) for name, flat, w in log if w == write]
        return trace_sectors(accesses, launch.grid_dim, launch.block_dim, itemsize)

    return {"reads": of(False), "writes": of(True)}


SUM_HINTS = {
    "x": "Threads past the end of x must not read it: let them store 0 instead "
         "(if i < x.size: ... else: 0)",
    "out": "out has one element per block: thread 0 writes out[cuda.blockIdx.x]",
    "shared": "keep shared indices below the block size (the stride starts at "
              "cuda.blockDim.x // 2)",
    "unwritten": "shared memory starts with garbage: every element the reduction "
                 "reads must be stored first (threads past the end of x store 0), "
                 "and the stride must start at half the block size",
    "early": "let it store 0 and take part in the reduction",
    "steps": "a loop that never ends? check that the stride shrinks each step and "
             "that the loop stops at 0",
}
SUM_CASES = ((32, 32), (64, 100), (32, 1), (128, 256), (64, 200))  # (threads, n)


def _block_sums(x: np.ndarray, threads: int) -> np.ndarray:
    blocks = -(-x.size // threads)
    padded = np.zeros(blocks * threads)
    padded[: x.size] = x
    return padded.reshape(blocks, threads).sum(axis=1)


def _sum_hint(out: np.ndarray, x: np.ndarray, threads: int) -> str:
    """Name the wrong sums, when they are a known mistake."""
    blocks = out.size
    x64 = x.astype(np.float64)
    first = np.array([x64[b * threads] for b in range(blocks)])
    if np.allclose(out, first, rtol=1e-4, atol=1e-5):
        return "out holds each block's first element: nothing was added"
    if np.allclose(out, _block_sums(np.trunc(x64), threads), rtol=1e-4, atol=1e-4):
        return ("the sums dropped every fraction: the shared array holds "
                "integers; declare it cuda.shared.array(THREADS, float32)")
    if np.allclose(out, x64.sum(), rtol=1e-4, atol=1e-4):
        return ("each block must sum only its own THREADS elements, "
                "x[blockIdx.x * THREADS] ... x[blockIdx.x * THREADS + THREADS - 1]")
    for part in (2, 4):
        sums = _block_sums(x, threads // part)[::part][:blocks] if threads % part == 0 \
            else None
        if sums is not None and np.allclose(out, sums, rtol=1e-4, atol=1e-4):
            return (f"only the first 1/{part} of each block was added: start the "
                    "stride at cuda.blockDim.x // 2 and halve it down to 1")
    return ("thread 0 of each block writes the block's sum, sdata[0] after the "
            "last step, to out[cuda.blockIdx.x]")


def check_block_sum(block_sum) -> None:
    """Exercise 1.2: a shared-memory tree reduction, one partial sum per block.

    Run on a deterministic block simulator (threads one at a time, from
    barrier to barrier) that reports races on shared memory, reads of
    unwritten shared memory, reads past the end of x and barriers some
    threads skip; sizes that are and are not multiples of the block size,
    several block sizes, seeded random data. On a GPU the kernel also runs for
    real.
    """
    ex = "1.2"
    fn = _python_function(block_sum)
    if fn is None:
        fail(ex, "a @cuda.jit kernel block_sum(x, out)",
             f"{type(block_sum).__name__} {block_sum!r:.60}",
             "run the exercise cell that defines it first")
    require_solution(ex, fn)
    rng = np.random.default_rng(12)
    for threads, n in SUM_CASES:
        # magnitudes from 1e-3 to 1e3, so no block's sum is a round number
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
             + 0.25).astype(np.float32)
        blocks = -(-n // threads)
        out = np.full(blocks, np.nan, dtype=np.float32)
        what = f"n = {n} in blocks of THREADS = {threads}"
        try:
            launch = simulate_block_kernel(block_sum, (x, out), blocks, threads,
                                           overrides={"THREADS": threads},
                                           hints=SUM_HINTS, limit=answer_limit(ex))
        except KernelFault as e:
            fail(ex, f"a correct, race-free launch for {what}", e.seen, e.hint)
        except Exception as e:  # the learner's code raised
            first = str(e).splitlines()[0] if str(e) else ""
            fail(ex, f"block_sum to run for {what}",
                 f"it raised {type(e).__name__}: {first}",
                 "fix that error and run the exercise cell again")
        if launch.atomics_on["shared"] > threads // 2 or \
                launch.atomics_on["global"] > blocks:
            fail(ex, "a tree of additions", "every thread adding into one "
                 "element with cuda.atomic.add",
                 "atomics on one address run one after another; halve the "
                 "number of active threads at each step instead")
        if not launch.shared_used:
            fail(ex, "the block's values summed in shared memory",
                 "no cuda.shared.array in the kernel",
                 "load each thread's element into cuda.shared.array(THREADS, "
                 "float32), then add pairs in a tree")
        writers: dict[int, set] = {}
        for (blk, thread), entries in launch.log.items():
            for name, flat, write in entries:
                if write and name == "out":
                    writers.setdefault(flat, set()).add((blk, thread))
        many = {f: w for f, w in writers.items() if len(w) > 1}
        if many:
            f = min(many)
            fail(ex, f"out[{f}] written by one thread, thread 0 of block {f} "
                     f"({what})", f"{len(many[f])} threads write out[{f}]",
                 "on a GPU those writes race (and each one is a global store): "
                 "only thread 0 writes the block's sum, under if "
                 "cuda.threadIdx.x == 0")
        if np.isnan(out).any():
            b = int(np.flatnonzero(np.isnan(out))[0])
            fail(ex, f"out[b] written for every block ({what})",
                 f"out[{b}] never written",
                 "thread 0 of each block writes the block's sum to "
                 "out[cuda.blockIdx.x]")
        want = _block_sums(x, threads)
        atol = 1e-5 * float(np.abs(x).sum()) + 1e-6
        if not np.allclose(out, want, rtol=1e-4, atol=atol):
            b = int(np.argmax(np.abs(out - want)))
            fail(ex, f"out[{b}] = {want[b]:.6g}, the sum of block {b}'s elements "
                     f"({what})", f"{float(out[b]):.6g}", _sum_hint(out, x, threads))
        steps = 2 * math.ceil(math.log2(threads)) + 4
        if launch.max_reads > steps:
            fail(ex, f"a tree: at most about log2({threads}) = "
                     f"{math.ceil(math.log2(threads))} additions per thread",
                 f"one thread read {launch.max_reads} shared values",
                 "one thread summing the block in a loop leaves the other "
                 "threads idle: halve the active threads at each step "
                 "(stride THREADS/2, THREADS/4, ..., 1)")
        # log2(threads) steps, a barrier after each and one after the loads
        # (and one more anywhere): more are steps for a larger block
        if launch.max_barriers > math.ceil(math.log2(threads)) + 2:
            fail(ex, f"log2({threads}) = {math.ceil(math.log2(threads))} steps for "
                     f"a block of {threads} threads ({what})",
                 f"{launch.max_barriers} syncthreads per thread",
                 "start the stride at the block's own half, cuda.blockDim.x // 2 "
                 "(or THREADS // 2), not at a number that fits one block size")
    note = "No races, no unwritten reads, every thread reaches every barrier."
    if kernel_target() == "GPU":
        note += " " + _run_block_sum_on_gpu(ex, block_sum, fn)
    passed(ex, note)


def _run_block_sum_on_gpu(ex: str, block_sum, fn) -> str:
    """Launch the learner's kernel for real, with the notebook's THREADS."""
    from numba import cuda

    threads = int(fn.__globals__.get("THREADS", 128))
    rng = np.random.default_rng(5)
    for n in (threads * 8, threads * 8 + 37):
        x = (rng.standard_normal(n) + 0.25).astype(np.float32)
        blocks = -(-n // threads)
        out = cuda.device_array(blocks, dtype=np.float32)
        call_learner(ex, block_sum[blocks, threads], cuda.to_device(x), out)
        cuda.synchronize()
        got = out.copy_to_host()
        want = _block_sums(x, threads)
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(x).sum()):
            fail(ex, f"the same sums on the GPU for n = {n}",
                 f"a largest error of {np.abs(got - want).max():.3g}",
                 "the simulator found no race; check the kernel's types "
                 "(float32 shared memory) and its THREADS")
    return f"It also ran on the GPU with THREADS = {threads}."


# ---------------------------------------------------------------------------
# Exercise 1.1: a grid-stride loop
# ---------------------------------------------------------------------------

# (blocks, threads per block, n): fewer threads than elements, more threads
# than elements, one block, one element
AXPY_LAUNCHES = ((1, 32, 100), (3, 64, 1000), (4, 64, 37), (2, 32, 64), (2, 64, 1))
AXPY_HINTS = {
    "bounds": "stop the loop at x.size: for i in range(start, x.size, stride)",
    "steps": "a loop that never ends, or a stride too small? Each step must "
             "move the index on by the number of threads in the whole grid, "
             "cuda.gridsize(1)",
}


def _axpy_data(rng, n: int, dtype) -> tuple:
    """Values of mixed magnitudes and a coefficient with many digits."""
    mags = 10.0 ** rng.integers(-6, 7, n)
    x = (rng.standard_normal(n) * mags).astype(dtype)
    y = (rng.standard_normal(n) * mags[::-1]).astype(dtype)
    return dtype(1 / 3 + 1e-9), x, y


def _axpy_hint(out, a, x, y) -> str:
    """Name the wrong values, when they are a known mistake."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    if x.dtype == np.float64:
        a32 = float(np.float32(a))
        low = (np.float32(a) * x.astype(np.float32) + y.astype(np.float32))
        if np.allclose(out, low, rtol=1e-6) or np.allclose(out, a32 * x64 + y64,
                                                           rtol=1e-12):
            return ("the float64 case lost digits: something went through "
                    "float32 (a float32(...) cast or a float32 local); compute "
                    "in the arrays' own type")
    if np.allclose(out, x64 + y64, rtol=1e-5):
        return "a was left out: out[i] = a * x[i] + y[i]"
    if np.allclose(out, a * (x64 + y64), rtol=1e-5):
        return "a multiplies x[i] only: out[i] = a * x[i] + y[i]"
    if np.allclose(out, a * y64 + x64, rtol=1e-5):
        return "x and y swapped: out[i] = a * x[i] + y[i]"
    return "out[i] = a * x[i] + y[i] for every i"


def check_axpy(axpy) -> None:
    """Exercise 1.1: ``out[i] = a * x[i] + y[i]`` with a grid-stride loop.

    Launched on the block simulator with grids that have fewer and more
    threads than elements, float32 and float64 data of mixed magnitudes; each
    element must be written exactly once, x and y left as they were, and each
    warp request must touch no more sectors than a coalesced loop's.
    """
    ex = "1.1"
    fn = _python_function(axpy)
    if fn is None:
        fail(ex, "a @cuda.jit kernel axpy(a, x, y, out)",
             f"{type(axpy).__name__} {axpy!r:.60}",
             "run the exercise cell that defines it first")
    require_solution(ex, fn)
    rng = np.random.default_rng(11)
    for dtype in (np.float32, np.float64):
        for blocks, threads, n in AXPY_LAUNCHES:
            a, x, y = _axpy_data(rng, n, dtype)
            x0, y0 = x.copy(), y.copy()
            out = np.full(n, np.nan, dtype=dtype)
            what = (f"n = {n} {np.dtype(dtype).name} elements, {blocks} blocks of "
                    f"{threads} threads")
            launch = _simulate(ex, axpy, (a, x, y, out), blocks, threads, what,
                               names=("a", "x", "y", "out"), hints=AXPY_HINTS,
                               max_steps=16 * n + 64 * threads)
            _check_inputs_kept(ex, what, x=(x, x0), y=(y, y0))
            writes = np.zeros(n, dtype=int)
            for entries in launch.log.values():
                for name, flat, write in entries:
                    if write and name == "out":
                        writes[flat] += 1
            n_threads = blocks * threads
            if (writes == 0).any():
                missing = np.flatnonzero(writes == 0)
                i = int(missing[0])
                fail(ex, f"every element of out written ({what})",
                     f"{missing.size} elements never written, the first out[{i}]",
                     "the loop runs up to x.size itself, not x.size - 1"
                     if missing.tolist() == [n - 1] else
                     f"the grid has {n_threads} threads; each must go on to "
                     "i + cuda.gridsize(1), i + 2 * cuda.gridsize(1), ... until "
                     "x.size" if i >= n_threads else
                     "the first index of a thread is its global index "
                     "cuda.grid(1) (blockIdx.x * blockDim.x + threadIdx.x)")
            if (writes > 1).any():
                i = int(np.flatnonzero(writes > 1)[0])
                twice = [t for t, entries in launch.log.items() if sum(
                    1 for nm, f, w in entries if w and nm == "out" and f == i) > 1]
                if twice:
                    fail(ex, f"every element of out written once ({what})",
                         f"out[{i}] written {writes[i]} times by one thread",
                         "compute a * x[i] + y[i] and store it with one write: "
                         "out[i] = ..., not out[i] = y[i] then out[i] += ...")
                fail(ex, f"every element of out written once ({what})",
                     f"out[{i}] written {writes[i]} times",
                     "the stride is the number of threads in the whole grid, "
                     "cuda.gridsize(1) (cuda.blockDim.x * cuda.gridDim.x), and "
                     "each thread starts at its global index cuda.grid(1)")
            want = a * x0.astype(np.float64) + y0
            scale = np.abs(a * x0.astype(np.float64)) + np.abs(y0)
            err = np.abs(out - want) / scale
            if not (err <= 4 * np.finfo(dtype).eps).all():
                fail(ex, f"out[i] = a * x[i] + y[i] ({what})",
                     f"an error of {err.max():.3g} relative to |a * x[i]| + |y[i]|",
                     _axpy_hint(out, a, x0, y0))
            itemsize = np.dtype(dtype).itemsize
            got = traces(launch, itemsize)
            for kind, trace in got.items():
                ideal = _ideal_1d(blocks, threads, n, itemsize, reads=kind == "reads")
                if trace.sectors_per_request > 1.05 * ideal.sectors_per_request + 0.1:
                    fail(ex, f"{ideal.sectors_per_request:.1f} sectors per warp "
                             f"request for the {kind} ({what}), as a coalesced loop",
                         f"{trace.sectors_per_request:.1f}",
                         "in each step, thread t + 1 must touch the element right "
                         "after thread t's: start at cuda.grid(1) and step by the "
                         "whole grid, instead of giving each thread a block of "
                         "neighbouring elements")
                _check_requests(ex, kind, trace, ideal, what)
    note = "Any grid covers any n, and each warp request stays coalesced."
    if kernel_target() == "GPU":
        note += " " + _run_axpy_on_gpu(ex, axpy)
    passed(ex, note)


def _simulate(ex, kernel, args, blocks, threads, what, **kw):
    """Run the learner's kernel on the block simulator; name what went wrong."""
    try:
        return simulate_block_kernel(kernel, args, blocks, threads,
                                     limit=answer_limit(ex), **kw)
    except KernelFault as e:
        fail(ex, f"a correct, race-free launch for {what}", e.seen, e.hint)
    except Exception as e:  # the learner's code raised
        first = str(e).splitlines()[0] if str(e) else ""
        fail(ex, f"the kernel to run for {what}",
             f"it raised {type(e).__name__}: {first}",
             "fix that error and run the exercise cell again")
    raise AssertionError("unreachable")


def _check_requests(ex, kind, trace: Trace, ideal: Trace, what) -> None:
    """Few threads doing the work of many issue many small warp requests."""
    if trace.total_sectors > 2 * ideal.total_sectors + 2:
        fail(ex, f"about {ideal.requests} warp requests for the global {kind}, "
                 f"moving {ideal.total_sectors} sectors ({what})",
             f"{trace.requests} requests moving {trace.total_sectors} sectors",
             "a few threads do the work of all: a warp request should serve "
             "32 elements, one per thread, so every thread of the grid takes "
             "its share")


def _check_inputs_kept(ex, what, **arrays) -> None:
    for name, (now, before) in arrays.items():
        if not np.array_equal(now, before, equal_nan=True):
            fail(ex, f"{name} left as it was ({what})", f"{name} was changed",
                 "write the results to out only")


def _ideal_1d(blocks, threads, n, itemsize, reads):
    """The trace of a coalesced grid-stride loop over n elements."""
    stride = blocks * threads

    def accesses(b, t):
        start = b[0] * threads + t[0]
        per = [("x", i) for i in range(start, n, stride)]
        if reads:
            return [acc for i in range(start, n, stride)
                    for acc in (("x", i), ("y", i))]
        return [("out", i) for _, i in per]
    return trace_sectors(accesses, blocks, threads, itemsize)


def _run_axpy_on_gpu(ex, axpy) -> str:
    from numba import cuda

    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        a, x, y = _axpy_data(rng, 100_003, dtype)
        out = cuda.device_array_like(x)
        call_learner(ex, axpy[40, 128], a, cuda.to_device(x), cuda.to_device(y), out)
        cuda.synchronize()
        scale = np.abs(a * x.astype(np.float64)) + np.abs(y)
        if not (np.abs(out.copy_to_host() - (a * x.astype(np.float64) + y))
                <= 8 * np.finfo(dtype).eps * scale).all():  # a fused multiply-add
            fail(ex, f"the same values on the GPU ({np.dtype(dtype).name})",
                 "different values", "the simulator passed it; check the types")
    return "It also ran on the GPU."


# ---------------------------------------------------------------------------
# Exercise 1.3: a tiled transpose through shared memory
# ---------------------------------------------------------------------------

# (dtype, TILE, rows, columns of a): square and not, multiples of TILE and not
TRANSPOSE_CASES = ((np.float32, 8, 16, 16), (np.float32, 8, 19, 17),
                   (np.float32, 16, 20, 16), (np.float32, 8, 5, 24),
                   (np.float32, 8, 1, 17), (np.float64, 8, 19, 17),
                   (np.float64, 8, 9, 12))
TRANSPOSE_HINTS = {
    "shared_name": "tile",
    "a": "guard the load: only threads with y < a.shape[0] and x < a.shape[1] "
         "read a (the others store nothing, but still reach syncthreads)",
    "out": "guard the store: out has a.shape[1] rows and a.shape[0] columns",
    "shared": "the tile is TILE x TILE: index it with threadIdx.x and threadIdx.y",
    # a read of a tile element nobody stored is harmless when the value is not
    # used (a thread outside out): the values of out show when it is
    "unwritten": None,
    "early": "guard the load and the store with an `if` instead",
    "steps": "a loop that never ends?",
}


def _transposes_within(a: np.ndarray, tile: int) -> np.ndarray:
    """out with tiles in transposed places but each tile's content not transposed."""
    h, w = a.shape
    out = np.full((w, h), np.nan)
    for r in range(w):
        for c in range(h):
            rr, cc = (c // tile) * tile + r % tile, (r // tile) * tile + c % tile
            if rr < h and cc < w:
                out[r, c] = a[rr, cc]
    return out


def _transpose_hint(out, a, tile) -> str:
    want = a.T.astype(np.float64)
    ok = ~np.isnan(out)
    if a.shape[0] == a.shape[1] and np.array_equal(out, a):
        return "out is a copy of a: out[r, c] must be a[c, r]"
    if a.dtype == np.float64 and np.allclose(out, want, rtol=1e-6) and \
            np.array_equal(out, want.astype(np.float32).astype(np.float64)):
        return ("the float64 values lost digits in a float32 tile: declare the "
                "tile float64, which holds float32 values exactly too")
    inner = _transposes_within(a, tile)
    if np.array_equal(out[ok], inner[ok]):
        return ("each tile lands in the right place but is not transposed "
                "inside: the thread that writes out[r, c] reads tile[threadIdx.x, "
                "threadIdx.y], the transpose of where it stored")
    return "out[r, c] = a[c, r] for every r < a.shape[1], c < a.shape[0]"


def check_transpose(transpose) -> None:
    """Exercise 1.3: ``out = a.T`` through a shared-memory tile, coalesced both ways.

    Launched on the block simulator over TILE x TILE blocks (TILE = 8 and 16,
    set for each launch) for square and rectangular matrices, with sizes that
    are and are not multiples of TILE, float32 and float64 data of mixed
    magnitudes; races, unwritten shared reads, skipped barriers and indices
    outside the arrays are named. The global reads and the global writes must
    each be as coalesced as a tiled transpose's.
    """
    ex = "1.3"
    fn = _python_function(transpose)
    if fn is None:
        fail(ex, "a @cuda.jit kernel transpose(a, out)",
             f"{type(transpose).__name__} {transpose!r:.60}",
             "run the exercise cell that defines it first")
    require_solution(ex, fn)
    rng = np.random.default_rng(13)
    for dtype, tile, h, w in TRANSPOSE_CASES:
        a = (rng.standard_normal((h, w)) * 10.0 ** rng.integers(-6, 7, (h, w))
             + 1 / 3).astype(dtype)
        a0 = a.copy()
        out = np.full((w, h), np.nan, dtype=dtype)
        grid = (-(-w // tile), -(-h // tile))
        what = (f"a of shape {h} x {w} ({np.dtype(dtype).name}), TILE = "
                f"{tile}, a grid of {grid[0]} x {grid[1]} blocks")
        launch = _simulate(ex, transpose, (a, out), grid, (tile, tile), what,
                           names=("a", "out"), hints=TRANSPOSE_HINTS,
                           overrides={"TILE": tile},
                           max_steps=16 * tile * tile)
        _check_inputs_kept(ex, what, a=(a, a0))
        if np.isnan(out).any():
            r, c = (int(v[0]) for v in np.nonzero(np.isnan(out)))
            stored = any(("out", r * h + c, True) in entries
                         for entries in launch.log.values())
            fail(ex, f"every element of out written ({what})",
                 f"out[{r}, {c}] " + ("holds a tile element no thread loaded"
                                      if stored else "never written"),
                 "shared memory starts with garbage: every tile position whose "
                 "transpose is written must be loaded first" if stored else
                 "each block writes the TILE x TILE tile of out at row "
                 "blockIdx.x * TILE, column blockIdx.y * TILE; use TILE (the "
                 "check sets it to 8 and 16), not a number")
        if not np.array_equal(out, a0.T):
            r, c = (int(v[0]) for v in np.nonzero(out != a0.T))
            fail(ex, f"out[{r}, {c}] = a[{c}, {r}] = {float(a0[c, r])!r} ({what})",
                 repr(float(out[r, c])), _transpose_hint(out, a0, tile))
        got = traces(launch, np.dtype(dtype).itemsize)
        ideal = _ideal_transpose(h, w, tile, np.dtype(dtype).itemsize)
        for kind, trace in got.items():
            if trace.sectors_per_request > 1.05 * ideal[kind].sectors_per_request:
                fail(ex, f"{ideal[kind].sectors_per_request:.1f} sectors per "
                         f"warp request for the global {kind} ({what}), as a "
                         "tiled transpose",
                     f"{trace.sectors_per_request:.1f}",
                     "the threads of a warp read a along a row (threadIdx.x "
                     "picks the column of a)" if kind == "reads" else
                     "the threads of a warp write out along a row: "
                     "threadIdx.x must pick the column of out, so the tile "
                     "is read transposed (tile[threadIdx.x, threadIdx.y]) "
                     "and the block's place in out swaps blockIdx.x and "
                     "blockIdx.y")
            _check_requests(ex, kind, trace, ideal[kind], what)
    note = "Reads and writes are both coalesced; the tile turns the corner."
    if kernel_target() == "GPU":
        note += " " + _run_transpose_on_gpu(ex, transpose, fn)
    passed(ex, note)


def _ideal_transpose(h, w, tile, itemsize) -> dict[str, Trace]:
    grid = (-(-w // tile), -(-h // tile))

    def of(write):
        def accesses(b, t):
            if write:
                r, c = b[0] * tile + t[1], b[1] * tile + t[0]
                return [("out", r * h + c)] if r < w and c < h else []
            y, x = b[1] * tile + t[1], b[0] * tile + t[0]
            return [("a", y * w + x)] if y < h and x < w else []
        return trace_sectors(accesses, grid, (tile, tile), itemsize)

    return {"reads": of(False), "writes": of(True)}


def _run_transpose_on_gpu(ex, transpose, fn) -> str:
    from numba import cuda

    tile = int(fn.__globals__.get("TILE", 16))
    a = np.random.default_rng(4).standard_normal((300, 170)).astype(np.float32)
    out = cuda.device_array((170, 300), dtype=np.float32)
    grid = (-(-170 // tile), -(-300 // tile))
    call_learner(ex, transpose[grid, (tile, tile)], cuda.to_device(a), out)
    cuda.synchronize()
    if not np.array_equal(out.copy_to_host(), a.T):
        fail(ex, "the same transpose on the GPU", "different values",
             "the simulator passed it; check the tile's type and TILE")
    return f"It also ran on the GPU with TILE = {tile}."
