"""Checkers for Chapter 6 (DistributedDataParallel).

Each runs the learner's function in real processes with
``course_utils.dist.launch`` (functions defined in the notebook travel by
value): 6.1 and 6.3 at world sizes 2 and 3, 6.2 at 2, 3 and 4. Each is judged
by what the function does - the gradients it leaves, the sums and the
messages each rank sends (counted at the process group and by a dispatch mode,
so any point-to-point API passes and a collective from any API is seen; and
each message must carry the ring's partial or finished sums, so messages sent
for show beside a sum got some other way fail), the weights every rank ends
with - not by which names it calls.
"""

from __future__ import annotations

import io
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import (
    answer_limit,
    fail,
    passed,
    require_solution,
    stuck,
)

LATE_S = 0.4  # at most how late one rank arrives in 6.3
HOLD_CAP_S = 12  # rank 0's write waits at most this for the others to wait for it


def _run(exercise: str, rank_fn: Callable, world_size: int, args: tuple,
         known: dict[str, tuple[str, str, str]], stuck_hint: str = ""):
    """Launch ``rank_fn`` on ``world_size`` ranks; a failure becomes a message.

    ``known`` maps a text in the failing rank's error to (expected, seen, hint).
    """
    try:
        # gloo on CPU ranks on any machine; forked, so notebook functions work
        return [r.value for r in launch(rank_fn, world_size, args=args,
                                        timeout=answer_limit(exercise), backend="gloo")]
    except RankFailed as e:
        first = str(e).splitlines()[0]
        # gloo's words when the other side went away ("Connection closed by
        # peer", or "Read error ... Connection reset by peer", by timing)
        unmatched = ("every rank to call the same collectives",
                     "a rank waited in a collective that another rank never called",
                     "every rank must call the same collectives, in the same order")
        known = {"closed by peer": unmatched, "reset by peer": unmatched, **known}
        for key, (expected, seen, hint) in known.items():
            if key in first:
                fail(exercise, expected, f"{seen} ({first[:160]})", hint)
        fail(exercise, "every rank to finish", first[:200],
             "read the rank's traceback above")
    except LaunchTimeout as e:
        fail(exercise, "every rank to finish", stuck(e),
             stuck_hint or "every rank must call the same collectives, in the "
             "same order")


# ---------------------------------------------------------------- exercise 6.1

class _Mixed(torch.nn.Module):
    """Parameters of odd shapes, a float64 layer, and a frozen bias (its .grad
    stays None)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 5)
        self.b = torch.nn.Linear(5, 2, dtype=torch.float64)
        self.c = torch.nn.Linear(2, 3)
        self.b.bias.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x)).double()))
        return self.c(h.float())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same model on every rank
    return _Mixed()


def _gradient_rank(rank: int, world_size: int, average_gradients: Callable):
    """Two steps with the same model (the function is called twice), on data
    of mixed magnitudes that differs between ranks and steps."""
    model = _model()
    rounds = []
    for step in range(2):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(7, 3) * 10.0 ** (step - rank)
        y = torch.randn(7, 3) * (rank + 1)
        model.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        local = [None if p.grad is None else p.grad.clone()
                 for p in model.parameters()]
        average_gradients(model)
        after = [None if p.grad is None else p.grad.clone()
                 for p in model.parameters()]
        rounds.append((local, after))
    return rounds


def _same(a, b, rtol: float | None = None) -> bool:
    """Equal to rounding: float32's or, for float64, float64's."""
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if rtol is None:
        rtol = 1e-5 if a.dtype == torch.float32 else 1e-12
    return torch.allclose(a, b, rtol=rtol, atol=rtol * 1e-2 * float(b.abs().max()))


def _judge_gradients(ex: str, ranks: list, world_size: int) -> None:
    for step in range(len(ranks[0])):
        _judge_step(ex, [r[step] for r in ranks], world_size, step)


def _judge_step(ex: str, ranks: list, world_size: int, step: int) -> None:
    names = [n for n, _ in _model().named_parameters()]
    locals_ = [r[0] for r in ranks]
    total = [None if g is None else sum(loc[i] for loc in locals_)
             for i, g in enumerate(locals_[0])]
    for rank, (local, after) in enumerate(ranks):
        for i, name in enumerate(names):
            got, mine, tot = after[i], local[i], total[i]
            if tot is None:  # the frozen parameter
                if got is not None:
                    fail(ex, f"parameter {name} (frozen, no gradient) to keep "
                         ".grad None", f"a .grad on rank {rank}",
                         "skip parameters whose .grad is None")
                continue
            mean = tot / world_size
            if _same(got, mean):
                continue
            where = (f"parameter {name} {tuple(mean.shape)} {mean.dtype} on rank "
                     f"{rank}, call {step + 1}")
            if got is None:
                fail(ex, f"{where}: the mean gradient", ".grad set to None")
            if _same(got, tot):
                fail(ex, f"{where}: the mean over the {world_size} ranks",
                     f"their sum, {world_size} x the mean",
                     "all_reduce sums: divide by dist.get_world_size()")
            for k in range(1, 5):
                if k != world_size and _same(got, tot / k):
                    fail(ex, f"{where}: the sum divided by the world size, "
                         f"{world_size}", f"the sum divided by {k}",
                         "divide by dist.get_world_size(), not a fixed number")
            if got.dtype != mean.dtype or (mean.dtype == torch.float64 and _same(
                    got.to(mean.dtype), mean, rtol=1e-5)):
                fail(ex, f"{where}: the mean, in the gradient's own dtype",
                     f"a {got.dtype} result rounded to float32's precision",
                     "keep each gradient's dtype: average p.grad in place, without "
                     ".float() or a float32 buffer")
            if all(_same(r[1][i], locals_[0][i]) for r in ranks):
                fail(ex, f"{where}: the mean over the ranks",
                     "rank 0's own gradient, on every rank",
                     "a broadcast copies one rank's gradient: all_reduce sums every "
                     "rank's, then divide by dist.get_world_size()")
            if _same(got, mine):
                fail(ex, f"{where}: the mean over the ranks",
                     "this rank's own gradient, unchanged",
                     "all_reduce p.grad itself (it overwrites its argument), not "
                     "a copy; and every parameter, not only some")
            fail(ex, f"{where}: the mean over the ranks",
                 "other values (not the mean, the sum or the rank's own)",
                 "dist.all_reduce(p.grad) sums across ranks; then divide by "
                 "dist.get_world_size()")


def check_average_gradients(average_gradients: Callable) -> None:
    """Exercise 6.1: each .grad becomes the mean of that gradient over the ranks."""
    ex = "6.1"
    require_solution(ex, average_gradients)
    none_hint = "a frozen parameter has no gradient: skip it when p.grad is None"
    known = {"NoneType": ("every parameter with a gradient averaged",
                          "an operation on a .grad that is None", none_hint),
             "of type torch.Tensor": ("a tensor for every collective",
                                      "something else, such as a .grad that is None",
                                      none_hint),
             "grad_dtype": ("each mean in the gradient's own dtype",
                            "a gradient of another dtype assigned to .grad",
                            "keep each gradient's dtype: average p.grad in place, "
                            "without .float() or a float32 buffer")}
    for world_size in (2, 3):
        ranks = _run(ex, _gradient_rank, world_size, (average_gradients,), known)
        _judge_gradients(ex, ranks, world_size)
    passed(ex, "On 2 and 3 ranks, every rank now holds the gradient of the whole "
               "batch's mean loss.")


# ---------------------------------------------------------------- exercise 6.2

# the ProcessGroup methods behind every collective but barrier: a ring built
# from point-to-point messages calls none of them
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "reduce", "broadcast",
                "allgather", "_allgather_base", "allgather_coalesced",
                "allgather_into_tensor_coalesced", "reduce_scatter",
                "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                "gather", "scatter", "alltoall", "alltoall_base")


def _ring_cases(n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes: sizes that do not divide by n (one of n + 1, where
    ``tensor.chunk(n)`` returns fewer than n pieces), a 2-D tensor, float64,
    and int64 beyond float64's 53 bits."""
    return [((3 * n + 1,), torch.float32), ((5, 3), torch.float64),
            ((n + 1,), torch.int64), ((2 * n - 1,), torch.float32)]


def _ring_input(rank: int, case: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:  # mixed magnitudes, both signs
        scale = 10.0 ** torch.randint(-3, 7, shape, generator=g)
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return torch.randint(-2**60, 2**60, shape, generator=g, dtype=dtype)


# point-to-point ops, and those that carry no data, that a ring may use; any
# other op of the distributed namespaces (dist.*, the functional collectives
# of torch.distributed._functional_collectives, torch.ops.c10d.*) is a collective
_P2P_OPS = {"send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_",
            "wait_tensor", "_wrap_tensor_autograd"}
_DIST_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional",
                    "_c10d_functional_autograd"}


def _ring_rank(rank: int, world_size: int, ring_all_reduce: Callable):
    """Run the learner's ring on this rank's inputs, watching every message.

    Each send and each collective is seen twice over: the ProcessGroup's
    Python methods are wrapped (seen from any thread), and a TorchDispatchMode
    sees every op of the distributed namespaces the learner's thread issues,
    whatever API issues it (the functional collectives, torch.ops.c10d).
    """
    import threading

    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup
    from torch.utils._python_dispatch import TorchDispatchMode

    cases = _ring_cases(world_size)
    inputs = [_ring_input(rank, i, *c) for i, c in enumerate(cases)]
    reference = [t.clone() for t in inputs]
    for t in reference:
        dist.all_reduce(t)  # what the ring must equal
    sent: list[list[tuple[int, int, list[torch.Tensor]]]] = []
    called: list[str] = []
    inside = threading.local()  # within a wrapper: the mode does not count twice
    saved = {name: getattr(ProcessGroup, name) for name in ("send", *_COLLECTIVES)
             if hasattr(ProcessGroup, name)}

    def record(tensors, dst):
        tensors = list(tensors)
        sent[-1].append((int(dst), sum(t.numel() * t.element_size() for t in tensors),
                         [t.detach().clone() for t in tensors]))

    def send(self, tensors, dst, *rest):
        record(tensors, dst)
        inside.on = True
        try:
            return saved["send"](self, tensors, dst, *rest)
        finally:
            inside.on = False

    def refuse(name):
        def collective(self, *args, **kwargs):
            called.append(name)
            inside.on = True
            try:
                return saved[name](self, *args, **kwargs)
            finally:
                inside.on = False
        return collective

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            space, _, name = func._schema.name.partition("::")
            if space in _DIST_NAMESPACES and not getattr(inside, "on", False):
                if name == "send":
                    record(args[0], args[2])
                elif name not in _P2P_OPS:
                    called.append(f"{space}.{name}")
            return func(*args, **kwargs)

    results = []
    try:
        ProcessGroup.send = send
        for name in _COLLECTIVES:
            if name in saved:
                setattr(ProcessGroup, name, refuse(name))
        given = []
        for t in inputs:
            sent.append([])
            mine = t.clone()
            with Watch():
                out = ring_all_reduce(mine)
            given.append(mine)
            results.append((mine.clone(), out.detach().clone()
                            if isinstance(out, torch.Tensor) else None))
    finally:
        for name, method in saved.items():
            setattr(ProcessGroup, name, method)
    # a call that wrote into an earlier call's tensor kept state between calls
    later = [i for i, (g, (r, _)) in enumerate(zip(given, results, strict=True))
             if not torch.equal(g, r)]
    return inputs, reference, results, sent, called + [f"later:{i}" for i in later]


def _judge_ring(ex: str, ranks: list, n: int) -> None:
    cases = _ring_cases(n)
    for rank, (_, _, _, _, called) in enumerate(ranks):
        later = [c for c in called if c.startswith("later:")]
        if later:
            fail(ex, "each call to work on the tensor it is given",
                 f"a later call on rank {rank} wrote into the tensor of an earlier "
                 f"call (call {int(later[0][6:]) + 1})",
                 "split the tensor you are given on every call; keep no views or "
                 "buffers from an earlier call")
        if called:
            fail(ex, "a ring built from send/recv (isend/irecv) messages only",
                 f"dist collective `{called[0]}` called on rank {rank}",
                 "send each chunk to the next rank and receive from the previous "
                 "one; no all_reduce, all_gather or reduce_scatter")
    for i, (shape, dtype) in enumerate(cases):
        wide = torch.float64 if dtype.is_floating_point else torch.int64
        exact = sum(r[0][i].to(wide) for r in ranks)
        sum_abs = sum(r[0][i].to(wide).abs() for r in ranks)
        size = math.prod(shape)
        setting = f"{n} ranks, a {dtype} tensor of shape {shape}"
        got = [r[2][i][0] for r in ranks]
        for rank, (inputs, reference, results, _, _) in enumerate(ranks):
            mine, out = results[i]
            if torch.equal(mine, inputs[i]):
                if out is not None and out.shape == mine.shape and bool(
                        _matches(out, exact, sum_abs, n).all()):
                    fail(ex, f"the sum written into the tensor given ({setting})",
                         f"the sum returned, the tensor on rank {rank} unchanged",
                         "work in place as dist.all_reduce does: tensor.copy_(...) "
                         "or write each received chunk into a view of it")
                fail(ex, f"the sum over the ranks in the tensor given ({setting})",
                     f"rank {rank}'s tensor unchanged",
                     "receive into views of the tensor (tensor.view(-1)"
                     ".tensor_split(n)) so the chunks you add to are the tensor")
            _judge_values(ex, mine, exact, sum_abs, reference[i], rank, n, setting)
        if dtype.is_floating_point and any(not torch.equal(g, got[0]) for g in got):
            fail(ex, f"every rank to end with the very same bits ({setting})",
                 "values that differ in their last digits between ranks",
                 "each chunk's sum is computed once, by one rank; the second phase "
                 "only passes the finished chunks round, without adding again")
        _judge_messages(ex, [r[3][i] for r in ranks], n, size,
                        ranks[0][0][i].element_size(), setting)
        _judge_contents(ex, [r[3][i] for r in ranks], [r[0][i] for r in ranks],
                        setting)


def _matches(got: torch.Tensor, exact: torch.Tensor, sum_abs: torch.Tensor,
             n: int) -> torch.Tensor:
    """Elementwise: ``got`` is the exact sum, to the rounding of n additions in
    its dtype (integers: exactly)."""
    if not got.dtype.is_floating_point:
        return got.to(torch.int64) == exact
    tol = 4 * n * torch.finfo(got.dtype).eps * sum_abs
    return (got.to(torch.float64) - exact).abs() <= tol


def _judge_values(ex, mine, exact, sum_abs, reference, rank, n, setting) -> None:
    dtype = reference.dtype
    where = f"rank {rank} ({setting})"
    if mine.dtype != dtype or mine.shape != reference.shape:
        fail(ex, f"a {dtype} tensor of shape {tuple(reference.shape)} ({setting})",
             f"{mine.dtype}, {tuple(mine.shape)} on rank {rank}")
    good = _matches(mine, exact, sum_abs, n)
    if bool(good.all()):
        return
    if dtype == torch.float64 and bool(_matches(mine.float(), exact, sum_abs, n).all()):
        fail(ex, f"the float64 sum on {where}", "a sum rounded to float32's precision",
             "keep the tensor's own dtype: add in place, never via .float()")
    if dtype.is_floating_point and bool(_matches(mine * n, exact, sum_abs, n).all()):
        fail(ex, f"the sum over the ranks on {where}", "the mean (sum / world size)",
             "dist.all_reduce's default is a sum: do not divide")
    if not dtype.is_floating_point and torch.equal(mine, exact.double().to(dtype)):
        fail(ex, f"the exact integer sum on {where}",
             "the sum rounded through floating point",
             "keep the tensor's own dtype: add in place, never via .float() or "
             ".double()")
    pieces = good.reshape(-1).tensor_split(n)
    right = [k for k, piece in enumerate(pieces) if bool(piece.all())]
    if right and len(right) < n:
        fail(ex, f"every chunk to hold the sum on {where}",
             f"only chunk(s) {right} of {n} hold it",
             "after the n - 1 reduce-scatter steps each rank owns one finished "
             "chunk; n - 1 more all-gather steps must pass the finished chunks round")
    fail(ex, f"the sum over the ranks on {where}",
         "other values (chunks added to the wrong chunks, or rounded through "
         "another dtype)",
         "at step s rank r sends chunk (r - s) mod n to rank r + 1 and adds what it "
         "receives from rank r - 1 to chunk (r - s - 1) mod n, in the tensor's "
         "own dtype")


def _judge_messages(ex, sent, n, size, itemsize, setting) -> None:
    steps = 2 * (n - 1)
    lo, hi = steps * (size // n) * itemsize, steps * -(-size // n) * itemsize
    nxt = {}
    for rank, messages in enumerate(sent):
        peers = sorted({dst for dst, _, _ in messages})
        total = sum(b for _, b, _ in messages)
        if len(messages) != 2 * (n - 1) or len(peers) != 1:
            fail(ex, f"2(n - 1) = {2 * (n - 1)} messages per rank, all to one "
                 f"neighbour ({setting})",
                 f"rank {rank} sent {len(messages)} message(s) to rank(s) {peers}",
                 "a ring: n - 1 steps of reduce-scatter, then n - 1 of all-gather, "
                 "each step one chunk to the next rank")
        if not lo <= total <= hi:
            fail(ex, f"each rank to send 2(n - 1)/n of the tensor: {lo}..{hi} bytes "
                 f"({setting})", f"{total} bytes from rank {rank}",
                 "send one chunk (1/n of the tensor, in its own dtype) per step, "
                 "not the whole tensor")
        nxt[rank] = peers[0]
    seen, r = set(), 0
    while r not in seen:
        seen.add(r)
        r = nxt[r]
    if len(seen) != n:
        fail(ex, f"the ranks to form one ring: each sends to its neighbour ({setting})",
             f"rank r sends to {nxt}", "send to (rank + 1) % n, receive from "
             "(rank - 1) % n")


def _judge_contents(ex, sent, inputs, setting) -> None:
    """Each message carries what a ring sends: at reduce-scatter step s, one
    chunk summed over s + 1 neighbouring ranks ending (or, for a ring the
    other way round, starting) at the sender; in the all-gather, a finished
    chunk. Messages of anything else (zeros, a rank's own tensor again) carry
    no part of the sum: the sum reached the ranks some other way."""
    n = len(inputs)
    wide = torch.float64 if inputs[0].dtype.is_floating_point else torch.int64
    chunks = [x.to(wide).reshape(-1).tensor_split(n) for x in inputs]

    def partial(c, members):
        total = sum(chunks[q][c] for q in members)
        return total, sum(chunks[q][c].abs() for q in members)

    for rank, messages in enumerate(sent):
        for k, (_, _, tensors) in enumerate(messages):
            got = torch.cat([t.reshape(-1) for t in tensors])
            if k < n - 1:
                sets = [[(rank - j) % n for j in range(k + 1)],
                        [(rank + j) % n for j in range(k + 1)]]
            else:
                sets = [list(range(n))]
            if any(got.numel() == chunks[0][c].numel() and bool(
                    _matches(got, *partial(c, m), n).all())
                    for c in range(n) for m in sets):
                continue
            what = ("a chunk summed over the sender and the ranks before it"
                    if k < n - 1 else "a finished chunk (summed over every rank)")
            fail(ex, f"message {k + 1} of rank {rank} to carry {what} ({setting})",
                 "other values: the messages do not carry the ring's sums",
                 "send views of the tensor itself: at reduce-scatter step s, the "
                 "chunk you have just added to; in the all-gather, the finished "
                 "chunks. The sum must travel round the ring in these messages")


def check_ring_all_reduce(ring_all_reduce: Callable) -> None:
    """Exercise 6.2: an all-reduce (sum, in place) from send/recv, as a ring."""
    ex = "6.2"
    require_solution(ex, ring_all_reduce)
    known = {
        "is invalid for input of size": (
            "sizes that do not divide by the world size to work",
            "a view of n equal rows", "split with tensor.view(-1).tensor_split(n): "
            "its chunks may differ in size by one"),
        "index out of range": (
            "n chunks for any size", "fewer chunks than ranks",
            "tensor.chunk(n) may return fewer than n pieces (5 elements, n = 4: "
            "3 pieces); tensor_split(n) always returns n"),
        "can't be cast to the desired output type": (
            "the sum, in the tensor's own dtype", "a division of an integer tensor",
            "dist.all_reduce's default is a sum: do not divide"),
        "Tensors must be contiguous": (
            "contiguous chunks to send", "a non-contiguous tensor sent",
            "split the flat tensor (tensor.view(-1)), not a column"),
    }
    never_came = ("a rank waited for a message that never came: with n = "
             "dist.get_world_size(), every rank sends to (rank + 1) % n and "
             "receives from (rank - 1) % n, and posts each receive (dist.irecv) "
             "before it waits on its send")
    gone = ("every rank to receive each message it waits for",
            "a rank waited for a message its peer never sent", never_came)
    known.update({"closed by peer": gone, "reset by peer": gone,
                  "Connection was likely closed": gone,
                  "SIGABRT": ("each message received into a buffer of its size",
                              "a rank aborted: gloo stops a process whose receive "
                              "buffer does not fit the message sent to it",
                              "at step s rank r receives from rank r - 1 what goes "
                              "into chunk (r - s - 1) mod n: allocate the buffer "
                              "like that chunk (chunks may differ in size by one)")})
    for world_size in (2, 3, 4):
        ranks = _run(ex, _ring_rank, world_size, (ring_all_reduce,), known,
                     stuck_hint=never_came)
        _judge_ring(ex, ranks, world_size)
    passed(ex, "On 2, 3 and 4 ranks, for float32, float64 and int64 tensors of "
               "sizes that do not divide: the sum of dist.all_reduce, with "
               "2(n - 1) messages of one chunk per rank, round a ring.")


# ---------------------------------------------------------------- exercise 6.3

def _others_done(flags: Path, rank: int, world_size: int) -> bool:
    return all((flags / f"done{q}").exists() for q in range(world_size) if q != rank)


def _holds_rank_0(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint of rank 0's starting weights."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        return all(torch.equal(state[k], v)
                   for k, v in _rank_model(0, 0, None).state_dict().items())
    except Exception:  # not there yet, or still being written
        return False


def _others_waiting(flags: Path, rank: int, world_size: int) -> bool:
    """Whether every other rank has finished or entered a collective (a wait)."""
    return all((flags / f"done{q}").exists() or (flags / f"waits{q}").exists()
               for q in range(world_size) if q != rank)


def _hold_back(flags: Path, rank: int, world_size: int, until=None,
               extend: bool = False) -> None:
    """Wait up to LATE_S, less if every other rank has finished (it did not
    wait for this one) or ``until()`` holds. With ``extend`` (rank 0, half its
    file written) it then waits on, up to HOLD_CAP_S, until every other rank
    has finished or entered a collective: a rank that sleeps a fixed time
    instead of waiting wakes before the file is complete, however long it
    sleeps (within the cap)."""
    start = time.monotonic()
    while time.monotonic() < start + LATE_S and not _others_done(
            flags, rank, world_size):
        if until is not None and until():
            return
        time.sleep(0.01)
    while extend and time.monotonic() < start + HOLD_CAP_S and not (
            _others_waiting(flags, rank, world_size)):
        time.sleep(0.01)


WAITS = ("barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
         "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
         "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
         "recv", "irecv", "batch_isend_irecv", "reduce_scatter")


def _mark_waits(flags: Path, rank: int) -> Callable[[], None]:
    """Mark ``flags/waits{rank}`` when this rank enters a collective; returns
    the function that puts torch.distributed back as it was."""
    import torch.distributed as dist

    real = {name: getattr(dist, name) for name in WAITS if hasattr(dist, name)}

    def marked(fn):
        def call(*args, **kwargs):
            (flags / f"waits{rank}").touch()
            return fn(*args, **kwargs)
        return call

    for name, fn in real.items():
        setattr(dist, name, marked(fn))

    def restore() -> None:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return restore


class _Model(torch.nn.Linear):
    """A small model whose ``state_dict`` takes a while on the writing rank,
    as a large checkpoint does: until the other ranks have finished, or LATE_S."""

    def __init__(self, slow: bool, flags: Path | None, world_size: int):
        super().__init__(4, 3)
        self.slow, self.flags, self.world_size = slow, flags, world_size

    def state_dict(self, *args, **kwargs):
        if self.slow:
            _hold_back(self.flags, 0, self.world_size)
        return super().state_dict(*args, **kwargs)


def _rank_model(rank: int, world_size: int, flags: Path | None,
                slow: bool = False) -> _Model:
    torch.manual_seed(rank)  # different weights on each rank
    return _Model(slow, flags, world_size)


def _checkpoint_rank(rank: int, world_size: int, save_then_load: Callable,
                     path: str, late_rank: int):
    """Run the learner's function with rank ``late_rank`` arriving late.

    Lateness follows the other ranks, not the clock, so a loaded machine does
    not change the verdict: a late rank 0 (and its slow ``state_dict``) waits
    until the others have finished or LATE_S has passed - a rank that does
    not wait for the file has failed by then; any other late rank waits until
    the file holds rank 0's complete weights, so a rank that also writes it
    writes last. Rank 0's tensors are marked as saved from a GPU this machine
    does not have, so only a load with ``map_location`` brings them back; an
    audit hook sees whether the full unpickler (``weights_only=False``) ran.
    """
    flags = Path(path).parent
    model = _rank_model(rank, world_size, flags,
                        slow=rank == 0 and late_rank == 0)
    before = [p.detach().clone() for p in model.parameters()]
    if rank == late_rank:
        _hold_back(flags, rank, world_size,
                   until=None if rank == 0 else lambda: _holds_rank_0(path))
    missing_gpu = f"cuda:{max(7, torch.cuda.device_count())}"
    ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
    torch.serialization.register_package(
        1, lambda storage: missing_gpu if storage.data_ptr() in ours else None,
        lambda obj, location: None)
    real_save, wrote = torch.serialization.save, []

    def save(obj, f, *args, **kwargs):
        """Rank 0's torch.save to ``path`` writes half the file, then waits as
        a large checkpoint's write takes a while: a rank that waits for the
        file to exist, not for rank 0, reads it incomplete."""
        if rank != 0 or str(f) != path:
            wrote.append(str(f) == path)
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(path, "wb") as out:
            out.write(data[:len(data) // 2])
            out.flush()
            _hold_back(flags, rank, world_size, extend=True)
            out.write(data[len(data) // 2:])
        return None

    real_load, loaded = torch.serialization.load, []

    def load(f, *args, **kwargs):
        loaded.append(True)
        return real_load(f, *args, **kwargs)

    torch.save = torch.serialization.save = save
    torch.load = torch.serialization.load = load
    restore = _mark_waits(flags, rank)
    unpickled = []
    sys.addaudithook(lambda event, args: unpickled.append(args[1])
                     if event == "pickle.find_class" else None)
    try:
        save_then_load(model, rank, path)
    finally:
        torch.save = torch.serialization.save = real_save
        torch.load = torch.serialization.load = real_load
        restore()
        (flags / f"done{rank}").touch()
    return (before, [p.detach().clone() for p in model.parameters()], bool(unpickled),
            any(wrote), any(loaded))


def check_save_then_load(save_then_load: Callable) -> None:
    """Exercise 6.3: rank 0 saves, every rank waits for it, then loads."""
    ex = "6.3"
    require_solution(ex, save_then_load)
    wait_hint = ("save on rank 0, then make every rank wait (dist.barrier()) "
                 "until the file is complete, then load")
    known = {
        "FileNotFoundError": ("every rank to read the checkpoint after rank 0 "
                              "has finished writing it",
                              "a rank read it before it existed", wait_hint),
        "PytorchStreamReader": ("every rank to read a complete checkpoint",
                                "a rank read it while it was being written, "
                                "or while several ranks wrote it",
                                "only rank 0 saves; every rank waits (dist.barrier()) "
                                "until the file is complete, then loads"),
        "EOFError": ("every rank to read a complete checkpoint",
                     "a rank read it while rank 0 was still writing it (a file that "
                     "exists is not yet complete)",
                     "wait on the other ranks (dist.barrier()), not on the file: "
                     "it exists before torch.save has finished writing it"),
        "Weights only load failed": (
            "a checkpoint of tensors only, loadable with weights_only=True",
            "a file holding a pickled module",
            "save model.state_dict(), not the model object"),
        "deserialize object on": (
            "every rank to load onto its model's device",
            "a load onto the device the tensors were saved from, a GPU this "
            "machine does not have",
            "pass map_location (the device of the model's parameters) to "
            "torch.load: a checkpoint saved on a GPU machine then loads anywhere"),
    }
    cases = [(2, 0), (3, 2)]  # (world size, the rank that arrives late)
    for world_size, late in cases:
        with tempfile.TemporaryDirectory(prefix="ch06_ckpt_") as tmp:
            path = str(Path(tmp) / "model.pt")
            ranks = _run(ex, _checkpoint_rank, world_size,
                         (save_then_load, path, late), known)
            written = Path(path).exists()
        setting = f"{world_size} ranks, rank {late} arriving late"
        starts = [r[0] for r in ranks]
        writers = [q for q, r in enumerate(ranks) if r[3]]
        for rank, (_, after, unpickled, _, _) in enumerate(ranks):
            if unpickled:
                fail(ex, "torch.load(..., weights_only=True)",
                     f"the full unpickler on rank {rank} (weights_only=False)",
                     "a checkpoint holds only tensors: weights_only=True refuses to "
                     "run code hidden in a file")
            if all(torch.equal(a, b) for a, b in zip(after, starts[0], strict=True)):
                continue
            same_as = [q for q, s in enumerate(starts) if all(
                torch.equal(a, b) for a, b in zip(after, s, strict=True))]
            if same_as == [rank]:
                fail(ex, f"rank {rank}'s model to hold rank 0's weights afterwards "
                     f"({setting})", "its own weights, unchanged",
                     "every rank loads the file: model.load_state_dict(torch.load("
                     "path, ...)) on every rank, rank 0 included")
            one_writer = ("only rank 0 saves (`if rank == 0:`); ranks writing one "
                          "file overwrite, or corrupt, each other's")
            if same_as:
                fail(ex, f"every rank to end with rank 0's weights ({setting})",
                     f"rank {rank} holds rank {same_as[0]}'s weights: rank "
                     f"{same_as[0]} wrote the file, after rank 0 or instead of it",
                     one_writer)
            if writers:
                fail(ex, f"every rank to end with rank 0's weights ({setting})",
                     f"other weights on rank {rank}, from a file that rank(s) "
                     f"{writers} wrote as well as rank 0", one_writer)
            fail(ex, f"every rank to end with rank 0's weights ({setting})",
                 f"other weights on rank {rank}", wait_hint)
        for rank, r in enumerate(ranks):
            if written and not r[4]:
                fail(ex, f"every rank to load the checkpoint, rank 0 included "
                     f"({setting})", f"rank {rank} never loaded it (torch.load)",
                     "every rank loads the file it will train from: "
                     "model.load_state_dict(torch.load(path, ...)) after the wait, "
                     "outside the `if rank == 0:`")
        if not written:
            fail(ex, f"the checkpoint file at `path` afterwards ({setting})",
                 "no file there", "torch.save(model.state_dict(), path) on rank 0")
    passed(ex, "One writer; every rank waited for the complete file, loaded it "
               "onto its own device and ended with rank 0's weights.")
