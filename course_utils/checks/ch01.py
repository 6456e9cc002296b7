"""Checkers for Chapter 1, "The CUDA execution model"."""

from __future__ import annotations

import math
import operator
import threading
import types
from collections.abc import Callable

import numba
import numpy as np

from course_utils.devices import kernel_target
from course_utils.exercises import call_learner, fail, passed, require_solution
from course_utils.warps import trace_sectors

MAX_THREADS_PER_BLOCK = 1024


def _as_int(exercise: str, value, what: str) -> int:
    try:
        if int(value) == value:
            return int(value)
    except (TypeError, ValueError):
        pass
    fail(exercise, f"{what} to be a whole number",
         f"{type(value).__name__} {value!r:.60}")
    raise AssertionError("unreachable")


def check_global_index_2d(fn: Callable) -> None:
    """Exercise 1.1: the row-major index of a thread's element in a 2-D grid."""
    ex = "1.1"
    for block_dim, grid_dim, width in (((8, 4), (3, 5), 24), ((16, 2), (2, 3), 32),
                                       ((4, 8), (5, 2), 19)):
        seen = set()
        for by in range(grid_dim[1]):
            for bx in range(grid_dim[0]):
                for ty in range(block_dim[1]):
                    for tx in range(block_dim[0]):
                        if bx * block_dim[0] + tx >= width:
                            continue  # past the right edge: the guard sends it home
                        got = call_learner(ex, fn, (bx, by), (tx, ty), block_dim, width)
                        got = _as_int(ex, got, "the index")
                        x, y = bx * block_dim[0] + tx, by * block_dim[1] + ty
                        want = y * width + x
                        if got != want:
                            _explain_index(ex, got, want, bx, by, tx, ty, block_dim,
                                           grid_dim, width)
                        seen.add(got)
        if len(seen) != width * block_dim[1] * grid_dim[1]:  # pragma: no cover
            fail(ex, "every thread a different element",
                 f"{len(seen)} distinct indices")
    passed(ex, "Neighbouring threads in x get neighbouring elements: that is what "
               "lets a warp's loads coalesce.")


def _explain_index(ex, got, want, bx, by, tx, ty, block_dim, grid_dim, width) -> None:
    x, y = bx * block_dim[0] + tx, by * block_dim[1] + ty
    height = block_dim[1] * grid_dim[1]
    wrong = {
        x * height + y: "you made x the row: in CUDA x is the column, the index "
                        "that moves fastest, so the element is y * width + x",
        x * width + y: "you swapped x and y: the element is y * width + x",
        ty * width + tx: "you left out the block offset: x = blockIdx.x * "
                         "blockDim.x + threadIdx.x (and the same for y)",
        (by * block_dim[0] + ty) * width + bx * block_dim[1] + tx:
            "you mixed up blockDim.x and blockDim.y",
        (by * grid_dim[1] + ty) * width + bx * grid_dim[0] + tx:
            "you multiplied blockIdx by the grid size; multiply by blockDim",
        y * height + x: "the row stride is the width of the matrix, not its height",
        y * block_dim[0] + x: "the row stride is the width of the matrix, not "
                              "blockDim.x",
        y * width + x + 1: "indices count from 0: the first thread's element is 0",
    }
    hint = wrong.get(got, "row = blockIdx.y * blockDim.y + threadIdx.y, "
                          "col = blockIdx.x * blockDim.x + threadIdx.x, "
                          "index = row * width + col")
    fail(ex, f"index {want} for block {(bx, by)}, thread {(tx, ty)}, blockDim "
             f"{block_dim}, width {width}", str(got), hint)


def check_coalesced_element(fn: Callable) -> None:
    """Exercise 1.3: thread t's element in step j, coalesced across a warp."""
    ex = "1.3"
    for blocks, threads, per_thread in ((2, 128, 8), (3, 64, 5), (2, 96, 3)):
        n_threads = blocks * threads
        n = n_threads * per_thread

        def accesses(b, t, n_threads=n_threads, per_thread=per_thread, threads=threads):
            g = b[0] * threads + t[0]
            return [call_learner(ex, fn, g, j, n_threads, per_thread)
                    for j in range(per_thread)]

        counts = [0] * n
        for g in range(n_threads):
            for j in range(per_thread):
                i = _as_int(ex, call_learner(ex, fn, g, j, n_threads, per_thread),
                            "the element index")
                if not 0 <= i < n:
                    fail(ex, f"indices in 0..{n - 1}", f"{i} for thread {g}, step {j}",
                         f"there are n_threads * per_thread = {n} elements")
                counts[i] += 1
        missed = [i for i, c in enumerate(counts) if c == 0]
        twice = sum(c > 1 for c in counts)
        if missed:
            fail(ex, "every element copied exactly once",
                 f"{len(missed)} elements never touched (first: {missed[0]}), "
                 f"{twice} touched more than once",
                 "with n_threads threads, step j covers elements j * n_threads "
                 "... j * n_threads + n_threads - 1")
        trace = trace_sectors(accesses, grid=blocks, block=threads)
        if trace.sectors_per_request > 4:
            if trace.sectors_per_request <= 5:
                hint = ("neighbouring threads read neighbouring elements, but a "
                        "warp's 32 floats straddle a 128-byte boundary: let each "
                        "warp start at a multiple of 32 elements")
            else:
                hint = ("neighbouring threads still read elements far apart; in "
                        "each step, thread t+1 must read the element right after "
                        "thread t's")
            fail(ex, "4 sectors per warp request (32 threads x 4 bytes = 128 bytes)",
                 f"{trace.sectors_per_request:.1f} sectors per request", hint)
    passed(ex, "Each warp request now moves 4 sectors, all of them used.")

# ---------------------------------------------------------------------------
# Exercise 1.2: a deterministic block simulator with a race detector
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
                "whatever lies there. " + {
                    "x": "Threads past the end of x must not read it: let them "
                         "store 0 instead (if i < x.size: ... else: 0)",
                    "out": "out has one element per block: thread 0 writes "
                           "out[cuda.blockIdx.x]",
                }.get(self.name, "keep shared indices below the block size (the "
                                 "stride starts at cuda.blockDim.x // 2)"))
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
        return _Dim3(self._sim.current)

    @property
    def blockIdx(self):
        return _Dim3(self._sim.block)

    @property
    def blockDim(self):
        return _Dim3(self._sim.threads)

    @property
    def gridDim(self):
        return _Dim3(self._sim.blocks)

    @property
    def laneid(self):
        return self._sim.current % 32

    def grid(self, ndim):
        if ndim != 1:
            raise KernelFault(f"cuda.grid({ndim})", "this launch is 1-D: cuda.grid(1)")
        return self._sim.block * self._sim.threads + self._sim.current

    def gridsize(self, ndim):
        if ndim != 1:
            raise KernelFault(f"cuda.gridsize({ndim})", "this launch is 1-D")
        return self._sim.blocks * self._sim.threads

    def syncthreads(self):
        self._sim.barrier()

    def threadfence_block(self):
        self._sim.step()

    threadfence = threadfence_block

    def __getattr__(self, name):
        raise KernelFault(
            f"the kernel uses cuda.{name}",
            "this exercise's simulator runs shared memory, syncthreads and "
            "atomics; write the reduction with those")


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

    def __init__(self, fn, blocks: int, threads: int, max_steps: int):
        self.blocks, self.threads, self.max_steps = blocks, threads, max_steps
        self.cuda = _FakeCuda(self)
        self.fn = fn
        self.block = self.current = 0
        self.shared_reads = [0] * threads  # per thread of the current block
        self.atomics_on = {"shared": 0, "global": 0}
        self.shared_used = False
        self.max_reads = 0

    def who(self) -> str:
        return f"thread {self.current} of block {self.block}"

    # --- memory ----------------------------------------------------------
    def step(self):
        if self.abort:
            raise _Abort
        self.steps += 1
        if self.steps > self.max_steps:
            raise KernelFault(
                f"more than {self.max_steps:,} memory accesses in block "
                f"{self.block}", "a loop that never ends? check that the "
                "stride shrinks each step and that the loop stops at 0")

    def shared_array(self, shape, dtype):
        self.step()
        k = self.shared_calls[self.current]
        self.shared_calls[self.current] += 1
        if k == len(self.shared):
            data = np.full(shape, np.nan, dtype=_np_dtype(dtype))
            self.shared.append(_Array(data, f"shared array {k}" if k else "sdata",
                                      self, shared=True))
            self.written.append(set())
            self.shared_used = True
        return self.shared[k]

    def access(self, array: _Array, flat: int, write: bool, atomic: bool = False):
        self.step()
        if not array._shared:
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
                    f"a race in block {self.block}: thread {me} writes {name}, "
                    f"which thread {u} {did} since the last syncthreads",
                    "on a GPU the two may run in either order: put "
                    "cuda.syncthreads() between the step that writes shared "
                    "memory and the step that reads it (and before it is "
                    "written again)")
            writers.add(me)
            if atomic:
                self.phase_atomic.add(key)
            self.written[k].add(flat)
        else:
            self.shared_reads[me] += 1
            other = writers - {me}
            if other:
                raise KernelFault(
                    f"a race in block {self.block}: thread {me} reads {name}, "
                    f"which thread {min(other)} wrote since the last syncthreads",
                    "put cuda.syncthreads() between writing shared memory and "
                    "reading what other threads wrote")
            if flat not in self.written[k]:
                self.unwritten.setdefault(key, me)
            readers.add(me)

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
        for (k, flat), t in self.unwritten.items():  # a race would have raised
            self._fault(KernelFault(
                f"thread {t} of block {self.block} reads "
                f"{self.shared[k].name}[{flat}], which no thread wrote",
                "shared memory starts with garbage: every element the "
                "reduction reads must be stored first (threads past the "
                "end of x store 0), and the stride must start at half "
                "the block size"))
            return
        if waiting and done:
            self._fault(KernelFault(
                f"in block {self.block}, thread {waiting[0]} waits at a "
                f"cuda.syncthreads() that thread {done[0]} never reaches (it "
                "finished the kernel first)",
                "every thread of a block must reach every syncthreads: a thread "
                "past the end of x must not return early; let it store 0 and "
                "take part in the reduction, and keep syncthreads out of "
                "branches that only some threads take"))
            return
        if len({self.barriers[t] for t in waiting}) > 1:
            first = min(waiting, key=lambda t: self.barriers[t])
            last = max(waiting, key=lambda t: self.barriers[t])
            self._fault(KernelFault(
                f"in block {self.block}, thread {first} is at its syncthreads "
                f"number {self.barriers[first]} while thread {last} is at number "
                f"{self.barriers[last]}",
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

    def run_block(self, block: int, args, timeout: float = 10.0):
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
                "a loop that never ends? check that the stride shrinks to 0"))
        for w in workers:
            w.join(1.0)
        if self.error is not None:
            raise self.error
        self.max_reads = max(self.max_reads, max(self.shared_reads))


def simulate_block_kernel(kernel, args, blocks: int, threads: int,
                          overrides: dict | None = None, max_steps: int = 0):
    """Run ``kernel[blocks, threads](*args)`` block by block, threads in turn.

    Arrays in ``args`` are NumPy arrays, changed in place. Raises
    ``KernelFault`` for a race on shared memory, a read of unwritten shared
    memory, an index outside an array, or a barrier some threads skip; the
    learner's own exceptions pass through. Returns the launch, whose counters
    (shared reads per thread, atomics) a checker can read.
    """
    fn = _python_function(kernel)
    if fn is None:
        raise TypeError("not a Python function or a @cuda.jit kernel")
    launch = _Launch(None, blocks, threads,
                     max_steps or 64 * threads * max(8, threads.bit_length()))
    launch.fn = _rebind(fn, launch.cuda, overrides or {})
    wrapped = [(_Array(a, n, launch, shared=False) if isinstance(a, np.ndarray) else a)
               for a, n in zip(args, ("x", "out", "arg2", "arg3"), strict=False)]
    for b in range(blocks):
        launch.run_block(b, wrapped)
    return launch


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
        x = (rng.standard_normal(n) + 0.25).astype(np.float32)
        blocks = -(-n // threads)
        out = np.full(blocks, np.nan, dtype=np.float32)
        what = f"n = {n} in blocks of THREADS = {threads}"
        try:
            launch = simulate_block_kernel(block_sum, (x, out), blocks, threads,
                                           overrides={"THREADS": threads})
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
