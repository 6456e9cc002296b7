"""Checkers for Chapter 5 (DataParallel and its primitives).

5.1 takes the learner's ``make_replicas`` and runs its replicas the way
DataParallel would - on unequal pieces of a batch, in threads at once, float32
and float64 models, with BatchNorm - and compares outputs, gradients on the
original parameters and buffers with one device. 5.2 gives the learner's
``apply_in_threads`` functions that meet at a barrier (so they must run at
once), finish out of order, raise, or never finish. 5.3 compares a predicted
memory count per device with bytes counted on real tensors of a hand-made
DataParallel step. Every call of learner code runs inside a timeout.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections.abc import Iterator
from itertools import islice

import torch
from torch import nn
from torch.func import functional_call

from course_utils.exercises import (
    ExerciseFailed,
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
    slowdown,
)

_CALLER: list[int] = []  # the thread the guard ran the learner's code in


def _guarded(ex: str, fn, *args, timeout: float | None = None, raw: bool = False):
    """Call learner code in a thread; fail kindly if it does not return in time.

    ``raw`` returns ``("error", exception)`` instead of turning what the
    learner's code raised into a failure."""
    out: dict = {}

    def target():
        _CALLER[:] = [threading.get_ident()]
        try:
            value = fn(*args) if raw else call_learner(ex, fn, *args)
            # a lazy iterator runs the learner's code when read: read it here
            out["value"] = (list(islice(value, 10_000)) if isinstance(value, Iterator)
                            else value)
        except BaseException as e:  # noqa: BLE001 - reported in the caller's thread
            out["error"] = e

    timeout = timeout or answer_limit(ex)
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        fail(ex, f"your code to finish within {timeout:.0f} s",
             "it was still running", "join threads with a timeout; never wait for "
             "something that may not happen")
    if "error" in out:
        if raw and not isinstance(out["error"], ExerciseFailed):
            return "error", out["error"]
        raise out["error"]
    return ("value", out["value"]) if raw else out["value"]


def _first(e: BaseException) -> str:
    """The first line of an exception's message ("" when it has none)."""
    return (str(e).splitlines() or [""])[0]


class _Pause(nn.Module):
    """A layer that takes a while (a sleep lets the other threads run), so that
    replicas run in threads really overlap, however busy the machine. While
    the checker runs replicas in threads (``armed``), it counts how many are
    inside at once, and the first waits (up to ``wait_s``) for a second to
    arrive: replicas serialised behind a lock never overlap."""

    lock = threading.Lock()
    armed = False
    inside = most = 0
    wait_s = 2.0  # how long a replica waits for another (set from answer_limit)

    def forward(self, x):
        cls = _Pause
        with cls.lock:
            cls.inside += 1
            cls.most = max(cls.most, cls.inside)
        try:
            time.sleep(0.01)
            end = time.monotonic() + cls.wait_s
            while cls.armed and cls.most < 2 and time.monotonic() < end:
                time.sleep(0.005)
            if cls.armed and cls.most < 2:
                cls.wait_s = 0.0  # no other replica came: the next need not wait
        finally:
            with cls.lock:
                cls.inside -= 1
        return x



# ---------------------------------------------------------------- exercise 5.1

def _models():
    torch.manual_seed(11)
    yield "Linear-Tanh-Linear, float32", nn.Sequential(
        nn.Linear(5, 7), _Pause(), nn.Tanh(), nn.Linear(7, 3)), torch.float32
    m = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), _Pause(), nn.Linear(4, 3)).double()
    with torch.no_grad():  # mixed magnitudes: a float32 copy loses the small ones
        m[0].weight.mul_(torch.logspace(-6, 3, 5, dtype=torch.float64))
        m[3].bias.add_(1e8)
    yield "float64, mixed magnitudes", m, torch.float64
    yield "with BatchNorm", nn.Sequential(nn.Linear(5, 4), _Pause(),
                                          nn.BatchNorm1d(4), nn.Linear(4, 3)), \
        torch.float32


REPLICA_CASES = [(10, 3), (7, 2), (5, 1), (9, 4)]  # rows, devices: unequal pieces


def _run_replicas_in_threads(ex, replicas, pieces):
    outs = [None] * len(pieces)
    errors = []

    def run(i):
        try:
            outs[i] = replicas[i](pieces[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(len(pieces))]
    _Pause.most, _Pause.armed = 0, len(pieces) > 1
    try:
        for t in threads:
            t.start()
        limit = answer_limit(ex)
        for t in threads:
            t.join(limit)
    finally:
        _Pause.armed = False
    if any(t.is_alive() for t in threads):
        fail(ex, "each replica to return", "a replica still running after "
             f"{limit:.0f} s")
    if errors:
        e = errors[0]
        fail(ex, "replicas that run on their pieces, in threads at once",
             f"a replica raised {type(e).__name__}: {_first(e):.100}",
             "each replica: its own module object (a deepcopy) and its own copies "
             "of the module's current parameters, in the module's dtype")
    if len(pieces) > 1 and _Pause.most < 2:
        _Pause.wait_s = 0.0  # seen once: the other cases need not wait again
        _SERIAL.append(len(pieces))
    return outs


_SERIAL: list[int] = []  # replicas counts of the runs whose replicas never overlapped


def check_make_replicas(make_replicas) -> None:
    ex = "5.1"
    require_solution(ex, make_replicas)
    g = torch.Generator().manual_seed(4)
    cpu = torch.device("cpu")
    _SERIAL.clear()
    _Pause.wait_s = answer_limit(ex) / 2  # the other replica starts at once, if any
    for what, model, dtype in _models():
        for rows, n in REPLICA_CASES:
            case = f"{what}, {rows} rows on {n} devices"
            with torch.no_grad():  # another state each time: nothing may be cached
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
            x = torch.randn(rows, 5, generator=g, dtype=dtype) * 3
            ref = copy.deepcopy(model)
            ref.train()
            pieces = list(torch.chunk(x, n))
            # one device, piece by piece (BatchNorm sees pieces, as replicas do)
            ref_outs = [functional_call(ref, {k: b.clone() for k, b in
                                              ref.named_buffers()}, (p,)) if i
                        else ref(p) for i, p in enumerate(pieces)]
            weights = [float(i + 1) for i in range(len(pieces))]
            sum(w * o.square().sum() for w, o in zip(weights, ref_outs,
                                                     strict=True)).backward()
            mine = copy.deepcopy(model)
            mine.train()
            mine.zero_grad(set_to_none=True)
            before = [p.detach().clone() for p in mine.parameters()]
            params_before = list(mine.parameters())
            replicas = _guarded(ex, make_replicas, mine, [cpu] * n)
            try:
                replicas = list(replicas)
            except TypeError:
                fail(ex, f"a list of {n} replicas ({case})",
                     f"{type(replicas).__name__}")
            if len(replicas) != n:
                fail(ex, f"{n} replicas, one per device ({case})",
                     f"{len(replicas)}", "one replica per entry of `devices`")
            if not all(callable(r) for r in replicas):
                fail(ex, f"callable replicas: replica(x) ({case})",
                     f"{[type(r).__name__ for r in replicas]}",
                     "return modules, or functions of the input")
            if any(p.dtype != b.dtype for p, b in zip(mine.parameters(), before,
                                                      strict=True)):
                fail(ex, f"the module left in its dtype, {dtype} ({case})",
                     f"{next(mine.parameters()).dtype}", "no .float() or .to(dtype) "
                     "on the module: it converts the module in place")
            outs = _run_replicas_in_threads(ex, replicas, pieces)
            now = list(mine.parameters())
            if len(now) != len(params_before) or any(
                    a is not b for a, b in zip(now, params_before, strict=True)) or any(
                    not isinstance(p, nn.Parameter) for p in mine.parameters()):
                fail(ex, f"the module's own parameters left in place ({case})",
                     "parameters replaced", "copy the parameters for the replicas; "
                     "do not swap them into the original module")
            for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
                if not isinstance(o, torch.Tensor) or o.shape != r.shape:
                    fail(ex, f"replica {i}'s output of shape {tuple(r.shape)} ({case})",
                         f"{o!r:.60}")
                if o.dtype != r.dtype:
                    fail(ex, f"outputs in the model's dtype, {r.dtype} ({case})",
                         f"{o.dtype}", "copy the parameters as they are: no .float()")
                if not torch.allclose(o, r, rtol=1e-5, atol=1e-6):
                    fail(ex, f"replica {i}'s output equal to the module's ({case})",
                         f"differs by {(o - r).abs().max().item():.3g}",
                         "replicas running at once must not share one module object: "
                         "functional_call swaps tensors into the module it is given")
            if not all(o.requires_grad for o in outs):
                fail(ex, f"outputs that backward can follow ({case})",
                     "an output that does not require grad",
                     "copy the parameters with clone() (recorded by autograd), not "
                     "detach() or deepcopy")
            sum(w * o.square().sum() for w, o in zip(weights, outs,
                                                     strict=True)).backward()
            for (name, p), q in zip(mine.named_parameters(), ref.parameters(),
                                    strict=True):
                if p.grad is None:
                    fail(ex, f"a gradient on the original parameter {name} ({case})",
                         "none reached it", "replicas need differentiable copies "
                         "(p.clone() or p.to(device)), not a deepcopy or a detach, so "
                         "that backward flows back to the original")
                if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6):
                    ratio = (p.grad.norm() / q.grad.norm()).item()
                    fail(ex, f"the gradients of every replica summed on {name} "
                         f"({case})", f"a gradient {ratio:.3g}x as large",
                         "each replica's copy must come from the original parameter, "
                         "so that every replica's gradient adds up there; and no two "
                         "replicas may share one module object (functional_call swaps "
                         "its tensors into the module it is given)")
            if any(not torch.equal(p.detach(), b) for p, b in
                   zip(mine.parameters(), before, strict=True)):
                fail(ex, f"the parameters unchanged ({case})", "changed parameters")
            for (name, b), rb in zip(mine.named_buffers(), ref.buffers(), strict=True):
                if torch.equal(b, rb):
                    continue
                seen = ("the module's buffers not updated at all" if n > 1 and
                        name.endswith("num_batches_tracked") and b.item() == 0 else
                        f"{name} = {b.tolist()!s:.60} instead of {rb.tolist()!s:.60}")
                fail(ex, f"only replica 0's update of the buffers kept ({case})", seen,
                     "replica 0 runs with the module's own buffers, every other "
                     "replica with copies of its own (so no two threads update one "
                     "buffer, and the others' updates are dropped)")
            # called again once the parameters changed: replicas of the module now
            with torch.no_grad():
                for p in mine.parameters():
                    p.mul_(-0.5)
            again = list(_guarded(ex, make_replicas, mine, [cpu] * n))
            outs = _run_replicas_in_threads(ex, again, pieces)
            for i, o in enumerate(outs):
                with torch.no_grad():
                    want = functional_call(mine, {k: b.clone() for k, b in
                                                  mine.named_buffers()}, (pieces[i],))
                if not torch.allclose(o.detach(), want, rtol=1e-5, atol=1e-6):
                    fail(ex, f"replicas of the module as it is now ({case}, called "
                         "again after its parameters changed)", "replicas of an "
                         "older state", "make new copies at every call: DataParallel "
                         "replicates at every step, because the parameters change")
    if _SERIAL:
        fail(ex, f"{_SERIAL[0]} replicas running at the same time, in threads",
             "one replica at a time: they never overlapped",
             "give each replica its own module object and its own copies, so that "
             "they need no lock: DataParallel's threads run the replicas at once")
    passed(ex, "Equal to one device, forward and backward, run in threads at once; "
           "replica 0's buffers kept.")


# ---------------------------------------------------------------- exercise 5.2

class _Meeting:
    """Functions that meet at a barrier: they complete only when run at once."""

    def __init__(self, n):
        self.barrier = threading.Barrier(n, timeout=3)
        self.threads = []
        self.finished = []
        self.broken = False
        self.packed = False  # called with the input tuple itself
        self.called = []  # which function ran, once per call
        self.most = 0  # the most functions that waited at the barrier at once

    def make(self, i, slow=False):
        def fn(x, scale=1.0):
            self.threads.append(threading.get_ident())
            self.called.append(i)
            self.packed |= isinstance(x, (tuple, list))
            self.most = max(self.most, self.barrier.n_waiting + 1)
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                self.broken = True
                raise
            if slow:
                time.sleep(0.2)  # the first finishes last: order is not free
            self.finished.append(i)
            return x * scale + i
        return fn


def _apply(ex, fn, fns, inputs, timeout=None, guard=None):
    args = (fns, inputs) if timeout is None else (fns, inputs, timeout)
    return _guarded(ex, fn, *args, raw=True, timeout=guard)


def check_apply_in_threads(apply_in_threads) -> None:
    ex = "5.2"
    require_solution(ex, apply_in_threads)
    g = torch.Generator().manual_seed(2)
    # 40: more functions than a ThreadPoolExecutor's default pool has threads
    for n, kind in ((3, torch.float32), (1, torch.float64), (4, torch.float64),
                    (2, torch.float32), (40, torch.float32)):
        case = f"{n} functions"
        meet = _Meeting(n)
        fns = [meet.make(i, slow=i == 0) for i in range(n)]
        xs = [torch.randn(i + 2, 3, generator=g, dtype=kind) for i in range(n)]
        inputs = [(x,) if i % 2 == 0 else (x, 2.0) for i, x in enumerate(xs)]
        given = list(inputs)
        status, got = _apply(ex, apply_in_threads, fns, inputs)
        if meet.broken and 1 < meet.most < n:
            fail(ex, f"{n} functions running at once ({case})",
                 f"at most {meet.most} of them at once",
                 "a thread per function: a pool with fewer threads than functions "
                 "(a ThreadPoolExecutor's default has min(32, cores + 4)) runs the "
                 "rest only after the first have finished")
        if meet.broken:
            fail(ex, f"{n} functions running at once ({case})",
                 "they ran one after the other (they never all met)",
                 "start every thread first, then join them all")
        if meet.packed:
            fail(ex, f"fns[i] called with the items of inputs[i] ({case})",
                 "a function got the tuple itself", "unpack each input tuple: "
                 "fns[i](*inputs[i])")
        if len(inputs) != len(given) or any(
                a is not b for a, b in zip(inputs, given, strict=True)):
            fail(ex, f"the list `inputs` left as it was given ({case})",
                 "its items replaced", "keep the outputs in a list of your own: "
                 "the caller still needs its inputs")
        if status == "error":
            e = got
            if isinstance(e, TimeoutError):
                fail(ex, f"the outputs, with the default timeout of 60 s ({case})",
                     "TimeoutError after well under a second",
                     "`timeout` is in seconds, counted from the start")
            if isinstance(e, threading.BrokenBarrierError) or "Barrier" in repr(e):
                fail(ex, f"{n} functions running at once ({case})",
                     "they ran one after the other (they never all met)",
                     "start every thread first, then join them all")
            fail(ex, f"apply_in_threads to run ({case})",
                 f"it raised {type(e).__name__}: {_first(e):.80}")
        if sorted(meet.called) != list(range(n)):
            fail(ex, f"each of the {n} functions called once ({case})",
                 f"calls of functions {sorted(meet.called)}",
                 "a thread's target that reads the loop variable when it runs "
                 "(lambda: fns[i](...)) sees its last value: pass i as an argument "
                 "(Thread(target=run, args=(i,)))")
        if set(_CALLER) & set(meet.threads):
            fail(ex, f"each function in a thread of its own ({case})",
                 "one ran in the calling thread", "start a thread per function, "
                 "even for one function")
        want = [x * (1.0 if i % 2 == 0 else 2.0) + i for i, x in enumerate(xs)]
        try:
            got = list(got)
        except TypeError:
            fail(ex, f"a list of {n} outputs ({case})", f"{type(got).__name__}")
        if len(got) != n:
            fail(ex, f"{n} outputs ({case})", f"{len(got)}",
                 "one output per function; start from an empty list on every call")
        if any(o is None for o in got):
            fail(ex, f"every output filled in ({case})", "None among them",
                 "join every thread before reading the outputs")
        if any(not isinstance(o, torch.Tensor) or o.shape != w.shape
               for o, w in zip(got, want, strict=True)):
            fail(ex, f"outputs in the order of the functions ({case})",
                 f"shapes {[tuple(getattr(o, 'shape', ())) for o in got]}",
                 "store each output at its function's index, not in the order "
                 "the threads finish")
        for i, (o, w) in enumerate(zip(got, want, strict=True)):
            if o.dtype != w.dtype:
                fail(ex, f"output {i} as fns[{i}] returns it, {w.dtype} ({case})",
                     f"{o.dtype}", "pass the inputs and the outputs on unchanged")
            if not torch.equal(o, w):
                fail(ex, f"output {i} = fns[{i}](*inputs[{i}]) ({case})",
                     "another value", "unpack each input tuple: fns[i](*inputs[i])")
        if len(set(meet.threads)) != n:
            fail(ex, f"{n} threads, one per function ({case})",
                 f"{len(set(meet.threads))}")
    # a function that raises: its error reaches the caller, after every thread ended
    slow_done = []

    def slow(x):
        time.sleep(0.3)
        slow_done.append(True)
        return x

    def broken(x):
        raise ValueError("replica 1 failed on purpose")

    status, got = _apply(ex, apply_in_threads, [slow, broken],
                         [(torch.ones(2),), (torch.ones(2),)])
    if status != "error":
        fail(ex, "the error of a failing function raised in the caller",
             f"it returned {got!r:.60}", "keep each thread's exception and raise it "
             "after joining, as torch's parallel_apply does")
    chain = [got, got.__cause__,
             None if got.__suppress_context__ else got.__context__]
    if not any(isinstance(e, ValueError) or "replica 1 failed" in str(e)
               for e in chain if e is not None):
        fail(ex, "the failing function's own error (ValueError: replica 1 failed)",
             f"{type(got).__name__}: {got}", "raise the exception the thread caught, "
             "not a new one without it")
    if not slow_done:
        fail(ex, "every thread joined before the error is raised",
             "raised while another function was still running",
             "join all threads first, then raise")
    # a function that never finishes: give up after `timeout`
    stop = threading.Event()

    def stuck(x):
        stop.wait(30)
        return x

    t0 = time.perf_counter()
    try:  # six stuck: `timeout` for each thread in turn would wait 3 s
        status, got = _apply(ex, apply_in_threads, [stuck] * 6 + [slow],
                             [(torch.ones(1),)] * 7, 0.5, guard=8)
    except ExerciseFailed:
        fail(ex, "TimeoutError when a function is still running after `timeout` s",
             "still waiting after 8 s (timeout was 0.5 s)",
             "join each thread with the time left, then check is_alive()")
    finally:
        stop.set()
    took = time.perf_counter() - t0
    if status != "error" or not isinstance(got, TimeoutError):
        fail(ex, "TimeoutError when a function is still running after `timeout` s",
             f"{'it returned' if status == 'value' else 'it raised'} "
             f"{type(got).__name__} after {took:.1f} s",
             "join each thread with the time left, then check is_alive()")
    # 0.5 s and a busy machine's delay, below the 3 s of `timeout` for each
    if took > min(2.0 * max(1.0, slowdown()), 2.75):
        fail(ex, "to give up after about `timeout` = 0.5 s", f"{took:.1f} s",
             "one deadline for all threads, not `timeout` for each")
    passed(ex, "In order, in threads at once, errors raised, and never stuck.")


# ---------------------------------------------------------------- exercise 5.3

def counted_dp_bytes(model: nn.Module, n: int, optimizer: str) -> list[int]:
    """Bytes per device at the end of the backward of DataParallel's second step
    (parameters, gradients, optimizer state; activations left out), counted on
    the tensors of a hand-made DataParallel step on ``n`` CPU "devices"."""
    if sys._getframe(1).f_globals.get("__name__") != __name__:
        fail("5.3", "your own code", "a call to the checker's reference answer",
             "write the function yourself: the check compares with this reference")
    model = copy.deepcopy(model)
    params = list(model.parameters())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=1e-3),
           "momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
           "adam": lambda: torch.optim.Adam(params, lr=1e-3)}[optimizer]()
    first = params[0]
    x = torch.randn(2 * n, model[0].in_features, dtype=first.dtype)
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        held = [0] * n
        if n == 1:  # DataParallel with one device calls the module itself
            model(x).float().square().mean().backward()
        else:
            outs = []
            for i, piece in enumerate(torch.chunk(x, n)):
                copies = {k: p.clone() for k, p in model.named_parameters()}
                for t in copies.values():
                    held[i] += size(t) if i else 0  # replica 0: the originals
                    t.register_hook(lambda g, i=i, held=held: held.__setitem__(
                        i, held[i] + size(g)))
                outs.append(functional_call(model, copies, (piece,)))
            torch.cat(outs).float().square().mean().backward()
        if step == 0:
            opt.step()
    state = [v for s in opt.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]  # Adam's step counters left out
    held[0] += sum(size(p) + size(p.grad) for p in params) + sum(map(size, state))
    return held


def _memory_models():
    torch.manual_seed(0)
    yield "float32", nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 6))
    yield "float64", nn.Sequential(nn.Linear(12, 40), nn.ReLU(),
                                   nn.Linear(40, 3)).double()
    yield "bfloat16", nn.Sequential(nn.Linear(8, 50), nn.Linear(50, 8)).bfloat16()


MEMORY_CASES = [(4, "adam"), (3, "sgd"), (2, "momentum"), (1, "adam"), (8, "momentum")]


def _sgd_right(ex, predict_dp_bytes, model, n) -> bool:
    """Whether the learner's count for plain SGD (no state) is right: then a
    count one parameter size short with momentum or Adam misses a state."""
    status, got = _guarded(ex, predict_dp_bytes, copy.deepcopy(model), n, "sgd",
                           raw=True)
    try:
        return status == "value" and [float(v) for v in got] == counted_dp_bytes(
            model, n, "sgd")
    except (TypeError, ValueError):
        return False


def check_predict_dp_bytes(predict_dp_bytes) -> None:
    ex = "5.3"
    require_solution(ex, predict_dp_bytes)
    for what, model in _memory_models():
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for n, optimizer in MEMORY_CASES:
            case = (f"a {what} model of {nbytes} parameter bytes, {n} devices, "
                    f"{optimizer}")
            want = counted_dp_bytes(model, n, optimizer)
            got = _guarded(ex, predict_dp_bytes, copy.deepcopy(model), n, optimizer)
            try:
                got = [float(v) for v in got]
            except (TypeError, ValueError):
                fail(ex, f"a list of {n} byte counts ({case})", f"{got!r:.60}")
            if len(got) != n:
                fail(ex, f"{n} counts, one per device ({case})", f"{len(got)}")
            if got == want:
                continue
            per = [v / nbytes for v in got]
            wper = [v / nbytes for v in want]
            hint = "count on device 0: parameters, the gradient reaching replica 0, " \
                   "the summed .grad, the optimizer's state; on the others: a " \
                   "replica's parameters and the gradient reaching them"
            if max(got) < 1e-3 * max(want):
                hint = "in bytes, not GiB or MB"
            elif what != "float32" and all(
                    abs(a / b - 4 / model[0].weight.element_size()) < 0.01
                    for a, b in zip(got, want, strict=True)):
                hint = "count with the model's dtype: element_size(), not 4 bytes"
            elif got[::-1] == want and n > 1:
                hint = "device 0 first: it holds the most"
            elif n == 1 and abs(per[0] - wper[0] - 1) < 1e-9:
                hint = ("with one device DataParallel calls the module itself: no "
                        "replica, so no replica gradient")
            elif n > 1 and abs(per[1] - wper[1] + 1) < 1e-9:
                hint = "a replica also holds the gradient that reaches its parameters"
            elif optimizer == "adam" and got[1:] == want[1:] and got[0] - want[0] in {
                    k * len(list(model.parameters())) for k in (4, 8)}:
                hint = "leave out Adam's scalar step counters (one per parameter)"
            elif all(abs(a - 2 * b) < 1e-9 * b for a, b in zip(got, want,
                                                              strict=True)):
                hint = ("each parameter once: model.parameters() already holds the "
                        "submodules' parameters (no loop over model.modules())")
            elif n > 1 and abs(per[0] - wper[0] + 1) < 1e-9 and (
                    optimizer == "sgd" or not _sgd_right(ex, predict_dp_bytes,
                                                         model, n)):
                hint = ("device 0 holds replica 0's gradient and the summed .grad: "
                        "two gradients' worth")
            elif n > 1 and per[1] > wper[1] + 0.5:
                hint = "the optimizer's state lives on device 0 only"
            elif abs(per[0] - wper[0]) > 1e-9 and (
                    optimizer != "adam" or _sgd_right(ex, predict_dp_bytes, model, n)):
                hint = ("plain SGD keeps no state; momentum keeps one buffer per "
                        "parameter; Adam two")
            fail(ex, f"{[int(v) for v in want]} bytes ({case})",
                 f"{[round(v) for v in got]}", hint)
    passed(ex, "Your count matches the bytes counted on real tensors, for every "
           "dtype, optimizer and number of devices.")
