"""Checkers for Chapter 7 (model and pipeline parallelism).

7.1 runs the learner's two-stage training step in two real processes
(``course_utils.dist.launch``, gloo) on models of several widths, in float32
and float64, with 1 to 5 micro-batches (some of unequal sizes), twice in a
row on the same stages, the second time on other data; the loss and both
stages' gradients must equal one process's on the whole batch, and each stage
must see the batch as ``m`` micro-batches (forwards without a graph are extra
work and not counted). 7.2 runs the learner's 1F1B orders on a simulator
(complete, feasible, as short as a pipeline can be, within 1F1B's memory
bound) for fixed and freshly drawn ``(p, m)``, then on three real processes,
which count the micro-batches each stage holds and compare the gradients with
one process. 7.3 checks a stage split against the best possible one on seeded,
hand-made and freshly drawn layer costs, integers and floats of mixed
magnitudes, from one stage to one layer per stage. The learner's code runs
only under a timeout: inside the ranks' launch, or in a thread; a lazy answer
is read no further than one item past what a right answer holds.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
import threading
from collections.abc import Callable

import torch

from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import (
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
    stuck,
)


def _call_limit(ex: str) -> float:
    """Seconds one call of a schedule or a split may take (``answer_limit``)."""
    return answer_limit(ex)


def _guarded(ex: str, fn: Callable, convert: Callable, *args):
    """``convert(fn(*args))`` in a thread, so that a loop (or a lazy iterator
    that never ends) fails the check instead of hanging it."""
    out: dict = {}

    def target():
        try:
            out["value"] = convert(call_learner(ex, fn, *args))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    limit = _call_limit(ex)
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        fail(ex, f"your function to return within {limit:.0f} s",
             "it was still running", "look for a loop that never ends")
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---------------------------------------------------------------- exercise 7.1

# (what it tests, dtype, input width, boundary width, output width, rows, m)
STEP_CASES = [
    ("float32, 10 rows in 4 micro-batches of unequal sizes", torch.float32,
     5, 7, 3, 10, 4),
    ("float64 with inputs of mixed magnitudes, 7 rows in 3", torch.float64,
     6, 4, 2, 7, 3),
    ("float32, one micro-batch", torch.float32, 3, 3, 4, 6, 1),
    ("float64, 5 rows in 5 micro-batches of one row", torch.float64, 4, 8, 1, 5, 5),
]


def _case_data(k: int, call: int = 0):
    """The stages and (x, y) of case k, the same in every process; the second
    call of a step gets other data for the same stages. Stage 1 starts with a
    linear layer, which keeps its input for the backward: a receive buffer
    reused by the next micro-batch changes that input."""
    _, dtype, d_in, hidden, d_out, rows, _ = STEP_CASES[k]
    torch.manual_seed(70 + k)
    first = torch.nn.Sequential(torch.nn.Linear(d_in, 6), torch.nn.Tanh(),
                                torch.nn.Linear(6, hidden)).to(dtype)
    second = torch.nn.Sequential(torch.nn.Linear(hidden, 5), torch.nn.Tanh(),
                                 torch.nn.Linear(5, d_out)).to(dtype)
    if call:
        torch.manual_seed(170 + k)
    x = torch.randn(rows, d_in, dtype=dtype)
    y = torch.randn(rows, d_out, dtype=dtype)
    if dtype == torch.float64:  # columns from 1e-3 to 1e2: float32 would show
        x = x * torch.logspace(-3, 2, d_in, dtype=dtype)
        y = y * torch.logspace(-2, 1, d_out, dtype=dtype)
    return first, second, x, y


def _step_rank(rank: int, world_size: int, two_stage_step: Callable):
    """Each case twice on the same stage, the second time on other data: rows
    seen by the forwards that build a graph, gradients, returned loss."""
    seen = []
    for k, (name, _, _, hidden, _, _, m) in enumerate(STEP_CASES):
        stage = _case_data(k)[rank]
        rows: list[list[int]] = []
        stage.register_forward_hook(lambda mod, args, out, rows=rows: rows[-1].append(
            args[0].shape[0] if args and hasattr(args[0], "shape") else -1)
            if torch.is_grad_enabled() else None)  # a no_grad forward is extra work
        calls = []
        for call in range(2):
            x, y = _case_data(k, call)[2:]
            rows.append([])
            try:
                value = two_stage_step(stage, rank, x.clone(), y.clone(), m, hidden)
            except Exception as e:  # the case it failed in, with its own error
                raise RuntimeError(f"[{name}] {type(e).__name__}: {e}") from None
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            calls.append({"loss": value if isinstance(value, (int, float)) else None,
                          "kind": type(value).__name__,
                          "grads": [None if p.grad is None else p.grad.clone()
                                    for p in stage.parameters()]})
        seen.append({"rows": rows, "calls": calls})
    return seen


def _whole_batch(k: int, loss_kind: str = "mean", boundary: str = "right",
                 split: str = "chunk", call: int = 0):
    """Loss and gradients of case k (data of the given call) in one process;
    the other kinds are the typical mistakes, for the hint."""
    first, second, x, y = _case_data(k, call)
    m = STEP_CASES[k][6]
    cut = (lambda t: t.chunk(m)) if split == "chunk" else (
        lambda t: t.tensor_split(m))
    total = 0.0
    for xi, yi in zip(cut(x), cut(y), strict=True):
        h = first(xi)
        h_in = h.detach().requires_grad_()
        out = second(h_in)
        if loss_kind == "mean":  # each piece's share of the whole batch's mean
            loss = torch.nn.functional.mse_loss(out, yi, reduction="sum") / y.numel()
        elif loss_kind == "sum_of_means":
            loss = torch.nn.functional.mse_loss(out, yi)
        elif loss_kind == "per_row":  # divided by the rows, not every element
            loss = torch.nn.functional.mse_loss(out, yi, reduction="sum") / len(y)
        else:  # "mean_of_means"
            loss = torch.nn.functional.mse_loss(out, yi) / m
        loss.backward()
        h.backward(torch.ones_like(h) if boundary == "ones" else h_in.grad)
        total += loss.item()
    return total, [[p.grad for p in part.parameters()] for part in (first, second)]


def _close(got, want, dtype) -> bool:
    rtol, atol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-4, 1e-6)
    if got is None or want is None:
        return got is None and want is None
    return got.shape == want.shape and got.dtype == want.dtype and torch.allclose(
        got, want, rtol=rtol, atol=atol)


def _all_close(got, want, dtype) -> bool:
    return len(got) == len(want) and all(_close(a, b, dtype)
                                         for a, b in zip(got, want, strict=True))


def _judge_step(ex: str, k: int, ranks: list) -> None:
    name, dtype, _, _, _, rows_total, m = STEP_CASES[k]
    case = f"({name})"
    want_loss, want = _whole_batch(k)
    for rank in (0, 1):
        for rows in ranks[rank][k]["rows"]:
            if len(rows) == 1 and m > 1 and rows[0] == rows_total:
                fail(ex, f"stage {rank} to run {m} micro-batches {case}",
                     f"the whole batch of {rows_total} rows in one forward",
                     "cut x and y into m pieces (x.chunk(m)) and pass each through "
                     "the pipeline")
            if (len(rows) != m or sum(rows) != rows_total
                    or max(rows) > math.ceil(rows_total / m)):
                fail(ex, f"stage {rank} to run {m} micro-batches that together "
                     f"hold the {rows_total} rows {case}",
                     f"forwards of {rows} rows",
                     "one forward per micro-batch on each stage, every row once")
    calls1 = ranks[1][k]["calls"]
    loss = calls1[0]["loss"]
    if loss is None:
        fail(ex, f"stage 1 (rank 1) to return the step's loss, a number {case}",
             f"a {calls1[0]['kind']}", "return the sum of the micro-batches' "
             "losses on the last stage (a float or a one-element tensor)")
    grads1 = calls1[0]["grads"]
    if not _all_close(grads1, want[1], dtype) or not math.isclose(
            loss, want_loss, rel_tol=1e-4 if dtype == torch.float32 else 1e-9):
        if any(g is None for g in grads1):
            fail(ex, f"gradients on stage 1's parameters {case}",
                 ".grad None on rank 1", "call backward on each micro-batch's loss")
        for kind, hint in (
                ("sum_of_means", "each micro-batch's loss is its share of the whole "
                 "batch's mean: mse_loss(..., reduction='sum') / y.numel(), not the "
                 "mean over the micro-batch"),
                ("mean_of_means", "the micro-batches are not all the same size: "
                 "dividing their means by m weighs a short one too much; sum the "
                 "squared errors and divide by y.numel()")):
            for split in ("chunk", "tensor_split"):
                if _all_close(grads1, _whole_batch(k, kind, split=split)[1][1], dtype):
                    fail(ex, f"the gradients of the whole batch's mean loss {case}",
                         f"those of the {kind.replace('_', ' ')} of the "
                         "micro-batches", hint)
        if STEP_CASES[k][4] > 1 and _all_close(  # outputs of several columns
                grads1, _whole_batch(k, "per_row")[1][1], dtype):
            fail(ex, f"stage 1's gradients of the whole batch's mean loss {case}",
                 "those of the squared errors divided by the number of rows",
                 "the mean is over every element of y: divide the summed squared "
                 "errors by y.numel(), not by len(y)")
        if _all_close(grads1, want[1], dtype):
            fail(ex, f"the whole batch's mean loss, {want_loss:.6g}, returned {case}",
                 f"{loss:.6g}", "return the sum of every micro-batch's share of "
                 "the loss (the same numbers you call backward on), not the last one")
        fail(ex, f"stage 1's gradients equal to one process on the whole batch {case}",
             "other values", "receive each micro-batch's activation into a new "
             "buffer of its own, mark it requires_grad_(), run stage 1 and the "
             "loss, and backward each micro-batch once")
    grads0 = ranks[0][k]["calls"][0]["grads"]
    if not _all_close(grads0, want[0], dtype):
        if all(g is None for g in grads0):
            fail(ex, f"gradients on stage 0's parameters {case}",
                 ".grad None on rank 0: stage 0 never ran its backward",
                 "stage 0 receives the gradient of its output from stage 1 and "
                 "calls out.backward(grad) on the output it kept")
        if _all_close(grads0, _whole_batch(k, boundary="ones")[1][0], dtype):
            fail(ex, f"stage 0's gradients through the boundary {case}",
                 "those of out.backward(torch.ones_like(out))",
                 "pass the gradient received from stage 1 to out.backward(grad)")
        fail(ex, f"stage 0's gradients equal to one process on the whole batch {case}",
             "other values", "stage 1 sends back the gradient of its input "
             "(h.grad), in the order stage 0 expects, and stage 0 calls "
             "out.backward(grad) with it on the same micro-batch's output")
    again_want_loss, again_want = _whole_batch(k, call=1)
    again_loss = calls1[1]["loss"]
    if again_loss is None or not math.isclose(again_loss, again_want_loss,
                                              rel_tol=1e-4):
        fail(ex, f"the loss of the second step, on other data, {again_want_loss:.6g} "
             f"{case}", f"{again_loss!r:.12}" + (
                 " (the first step's loss)" if again_loss is not None
                 and math.isclose(again_loss, want_loss, rel_tol=1e-4) else ""),
             "keep no state between steps: the loss of a step is the sum of that "
             "step's micro-batch losses")
    for rank in (0, 1):
        again = ranks[rank][k]["calls"][1]["grads"]
        if _all_close(again, again_want[rank], dtype):
            continue
        summed = [None if a is None else a + b
                  for a, b in zip(want[rank], again_want[rank], strict=True)]
        if _all_close(again, summed, dtype):
            fail(ex, f"the second step's gradients, on other data, on the same "
                 f"stage {case}", f"the sum of both steps' gradients on rank {rank}: "
                 "the second step added to the first", "set the gradients to zero "
                 "at the start of the step (stage.zero_grad())")
        fail(ex, f"the second step's gradients, on other data, on the same stage "
             f"{case}", f"other values on rank {rank} the second time",
             "keep no state between steps: everything a step needs is local to it")


def check_two_stage_step(two_stage_step: Callable) -> None:
    """Exercise 7.1: a two-stage pipelined training step on two real ranks."""
    ex = "7.1"
    require_solution(ex, two_stage_step)
    known = {
        "doesn't match expected size": (
            "each receive buffer of the shape and dtype that was sent",
            "a receive of another size than the send",
            "a buffer of (rows of this micro-batch, hidden) in x.dtype on stage 1; "
            "like(out) for the gradient on stage 0; and each rank receives the "
            "messages in the order the other sends them (the gradients in the "
            "order of the kept outputs)"),
        "modified by an inplace operation": (
            "each micro-batch's activation to stay as it was received",
            "a receive that overwrote a tensor an earlier micro-batch's backward "
            "still needs", "give every micro-batch its own receive buffer "
            "(torch.empty(...) inside the loop)"),
        "NoneType": ("every tensor sent to exist", "None sent or used",
                     "mark the received activation requires_grad_() before "
                     "running stage 1, so that backward leaves h.grad to send back"),
        "same dtype": ("the step to keep the data's dtype",
                       "a tensor of another dtype than the stage's",
                       "float64 stages need float64 activations and buffers: "
                       "use x.dtype, never a fixed dtype"),
        "shapes cannot be multiplied": (
            "stage 1's input of width hidden", "an activation of another width",
            "the receive buffer is (rows of this micro-batch, hidden): take the "
            "width from the hidden argument, not a fixed number"),
        "does not require grad": (
            "the kept output to carry its graph", "a backward on a tensor without one",
            "keep stage 0's output itself for the backward, and send a detached "
            "copy (out.detach())"),
        "backward through the graph a second time": (
            "each micro-batch's backward to run once", "a second backward through "
            "the same graph", "keep nothing from an earlier step: every step builds "
            "its own lists"),
        "closed by peer": ("both ranks to send and receive the same messages",
                           "one rank ended while the other still waited",
                           "every send needs a receive on the other rank"),
        "reset by peer": ("both ranks to send and receive the same messages",
                          "one rank ended while the other still waited",
                          "every send needs a receive on the other rank"),
    }
    try:
        ranks = [r.value for r in launch(_step_rank, 2, args=(two_stage_step,),
                                         timeout=answer_limit(ex), backend="gloo")]
    except RankFailed as e:
        first = str(e).splitlines()[0]
        for key, (expected, seen, hint) in known.items():
            if key in str(e):
                fail(ex, expected, f"{seen} ({first[:200]})", hint)
        fail(ex, "both ranks to finish", first[:240],
             "read the rank's traceback above")
    except LaunchTimeout as e:
        fail(ex, "both ranks to finish", stuck(e),
             "a blocking send waits until the other rank receives: if both ranks "
             "send first, or receive first, both wait for ever. Post the receives "
             "in the order the other rank sends (all forwards, then all "
             "backwards), or use dist.batch_isend_irecv; and wait() on each "
             "request once (waiting again on a finished gloo receive never "
             "returns)")
    for k in range(len(STEP_CASES)):
        _judge_step(ex, k, ranks)
    passed(ex, f"{len(STEP_CASES)} models in float32 and float64, 1 to 5 "
               "micro-batches, twice each: the loss and both stages' gradients "
               "equal one process's on the whole batch.")


# ---------------------------------------------------------------- exercise 7.2

SCHEDULE_CASES = [(2, 4), (3, 5), (4, 8), (3, 3), (4, 2), (1, 3), (5, 7),
                  (2, 1), (6, 1), (8, 3), (6, 13)]
REAL_CASE = (3, 5)  # run on 3 processes
DRAWN_CASES = 3  # and this many other (p, m), drawn afresh for every check


def _schedule_cases() -> list[tuple[int, int]]:
    """The fixed cases, then cases no list of answers can know in advance."""
    rng = random.Random()
    others = [(p, m) for p in range(2, 9) for m in range(1, 17)
              if (p, m) not in SCHEDULE_CASES]
    return [*SCHEDULE_CASES, *rng.sample(others, DRAWN_CASES)]


def simulate(order: list[list[tuple[str, int]]], p: int, m: int):
    """Run per-stage op lists; return (finish time, start of each op).

    Raises ValueError when the lists deadlock."""
    when: dict[tuple[int, str, int], int] = {}
    pos, free = [0] * p, [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(order[s]):
                continue
            kind, i = order[s][pos[s]]
            if kind == "F":
                dep = None if s == 0 else (s - 1, "F", i)
            else:
                dep = (s, "F", i) if s == p - 1 else (s + 1, "B", i)
            if dep is not None and dep not in when:
                continue
            start = max(free[s], 0 if dep is None else when[dep] + 1)
            when[(s, kind, i)] = start
            free[s] = start + 1
            pos[s] += 1
            progressed = True
        if not progressed:
            waiting = {s: order[s][pos[s]] for s in range(p) if pos[s] < len(order[s])}
            raise ValueError(f"deadlock: each stage waits for an op that never runs "
                             f"({waiting})")
    return max(when.values()) + 1, when


def _as_order(got, p: int, m: int) -> list[list[tuple[str, int]]]:
    """The learner's result as plain lists (raises TypeError/ValueError); a lazy
    result is read no further than one stage and one operation too many."""
    return [[(str(k), int(i)) for k, i in itertools.islice(stage, 2 * m + 1)]
            for stage in itertools.islice(got, p + 1)]


def _validate(ex, fn, p, m):
    case = f"p={p} stages, m={m} micro-batches"
    try:
        order = _guarded(ex, fn, lambda got: _as_order(got, p, m), p, m)
    except (TypeError, ValueError) as e:
        fail(ex, "a list per stage of ('F' or 'B', micro-batch) pairs",
             f"{type(e).__name__}: {e}"[:100])
    if len(order) != p:
        fail(ex, f"{p} stage lists ({case})",
             f"{len(order)}" if len(order) <= p else f"more than {p}",
             "one list per stage, for any p")
    for s, ops in enumerate(order):
        want = sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        if sorted(ops) != want:
            fail(ex, f"each micro-batch's F and B once on stage {s} ({case})",
                 f"{sorted(ops)[:8]} ...", "every stage runs the forward and the "
                 "backward of every micro-batch")
        seen_f = set()
        for k, i in ops:
            if k == "F":
                seen_f.add(i)
            elif i not in seen_f:
                fail(ex, f"B{i} after F{i} on stage {s} ({case})",
                     "a backward before its forward", "a stage can only run the "
                     "backward of a micro-batch it has run forward")
    try:
        finish, _ = simulate(order, p, m)
    except ValueError as e:
        fail(ex, f"a schedule that can run ({case})", str(e),
             "the backward of a micro-batch flows from the last stage to the "
             "first: each stage must be ready to run what the next one sends")
    best = 2 * (m + p - 1)
    if finish > best:
        fail(ex, f"1F1B finishing in {best} time units ({case})",
             f"{finish} units", "do not make a stage wait for work it could "
             "already run: after the warm-up, run a backward as soon as it arrives")
    return order


def _schedule_rank(rank: int, world_size: int, order, m: int):
    """Run this rank's ops with real sends and receives; count what it holds."""
    import torch.distributed as dist

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4).double() for _ in range(world_size)]
    stage = torch.nn.Sequential(layers[rank], torch.nn.Tanh())
    torch.manual_seed(1)
    x, y = torch.randn(2 * m, 4).double(), torch.randn(2 * m, 4).double()
    xs, ys = x.chunk(m), y.chunk(m)
    last = rank == world_size - 1
    saved, outbox, works, most = {}, [], [], 0
    for kind, i in order[rank]:
        peer = rank - 1 if kind == "F" else rank + 1
        buf = None
        if 0 <= peer < world_size:
            buf = torch.empty(len(xs[i]), 4, dtype=torch.float64)
        ops = outbox + ([dist.P2POp(dist.irecv, buf, peer)] if buf is not None else [])
        outbox = []
        if ops:  # the last send goes with the next receive: neither waits for the other
            posted = dist.batch_isend_irecv(ops)
            if buf is not None:
                posted.pop().wait()
            works += posted
        if kind == "F":
            inp = xs[i] if rank == 0 else buf.requires_grad_()
            out = stage(inp)
            if last:
                out = torch.nn.functional.mse_loss(out, ys[i],
                                                   reduction="sum") / y.numel()
            else:
                outbox = [dist.P2POp(dist.isend, out.detach(), rank + 1)]
            saved[i] = (inp, out)
            most = max(most, len(saved))
        else:
            inp, out = saved.pop(i)
            if last:
                out.backward()
            else:
                out.backward(buf)
            if rank > 0:
                outbox = [dist.P2POp(dist.isend, inp.grad, rank - 1)]
    if outbox:
        works += dist.batch_isend_irecv(outbox)
    for w in works:
        w.wait()
    return most, [p.grad for p in stage.parameters()]


def _one_process_grads(p: int, m: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[mod for _ in range(p) for mod in (
        torch.nn.Linear(4, 4).double(), torch.nn.Tanh())])
    torch.manual_seed(1)
    x, y = torch.randn(2 * m, 4).double(), torch.randn(2 * m, 4).double()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [q.grad for q in model.parameters()]


def _calls_chapter_policy(ex: str, fn: Callable, p: int, m: int) -> bool:
    """Whether ``fn(p, m)`` runs the chapter's own ``one_f_one_b_policy`` (the
    simulator of section 3 that writes the order for it)."""
    policy = getattr(sys.modules.get("__main__"), "one_f_one_b_policy", None)
    code = getattr(policy, "__code__", None)
    if code is None:
        return False
    hits: list[bool] = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is code:
            hits.append(True)

    def watched(*args):
        sys.setprofile(watch)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)

    watched.__name__ = getattr(fn, "__name__", "one_f_one_b")
    _guarded(ex, watched, lambda order: order, p, m)
    return bool(hits)


def check_one_f_one_b(one_f_one_b: Callable) -> None:
    """Exercise 7.2: 1F1B orders, simulated, then run on 3 real processes."""
    ex = "7.2"
    require_solution(ex, one_f_one_b)
    if _calls_chapter_policy(ex, one_f_one_b, 4, 6):
        fail(ex, "a 1F1B order you write yourself",
             "the order of section 3's one_f_one_b_policy, run through its simulator",
             "write the rule for each stage: its warm-up forwards, then one backward "
             "and one forward in turn, then the remaining backwards")
    orders = {}
    for p, m in [*_schedule_cases(), SCHEDULE_CASES[1]]:  # the second case again
        order = _validate(ex, one_f_one_b, p, m)
        if orders.setdefault((p, m), order) != order:
            fail(ex, f"the same orders when called again with p={p}, m={m}",
                 "other orders the second time",
                 "keep no state between calls")
        for s, ops in enumerate(order):
            held = most = 0
            for k, _ in ops:
                held += 1 if k == "F" else -1
                most = max(most, held)
            bound = min(p - s, m)
            if most > bound:
                fail(ex, f"at most {bound} micro-batches in flight on stage {s} "
                     f"(p={p}, m={m})", f"{most}",
                     "after the warm-up forwards, alternate one backward and one "
                     "forward: that is what bounds 1F1B's memory")
    p, m = REAL_CASE
    try:
        ranks = [r.value for r in launch(_schedule_rank, p, args=(orders[(p, m)], m),
                                         timeout=answer_limit(ex), backend="gloo")]
    except (RankFailed, LaunchTimeout) as e:
        fail(ex, f"your orders to run on {p} processes",
             stuck(e) if isinstance(e, LaunchTimeout)
             else str(e).splitlines()[0][:200],
             "a schedule that passes the simulator should run: check every stage's "
             "list")
    want = _one_process_grads(p, m)
    got = [g for _, grads in ranks for g in grads]
    if not _all_close(got, want, torch.float64):
        fail(ex, f"gradients equal to one process ({p} processes, m={m})",
             "other gradients", "every micro-batch forward and backward once")
    held = [most for most, _ in ranks]
    if any(h > p - s for s, h in enumerate(held)):
        fail(ex, f"stage s to hold at most p - s micro-batches ({p} processes)",
             f"held {held}", "start each backward as early as it can run")
    passed(ex, f"GPipe's time with at most p - s micro-batches held on stage s; on "
               f"{p} real processes the stages held {held} micro-batches and the "
               "gradients equal one process's.")


# ---------------------------------------------------------------- exercise 7.3

def best_slowest_stage(costs: list[float], p: int) -> float:
    """The least possible cost of the slowest of p contiguous, non-empty stages."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: least slowest stage splitting the first j layers into k stages
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            best[k][j] = min(max(best[k - 1][i], prefix[j] - prefix[i])
                             for i in range(k - 1, j))
    return best[p][n]


def _split_cases() -> list[tuple[list[float], int]]:
    rng = random.Random(7)
    cases = [([3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0], 3),   # uneven layers
             ([1.0] * 10, 4),                             # equal, 10 on 4
             ([1.0, 1.0, 1.0, 12.0, 1.0, 1.0], 3),        # one heavy layer
             ([2.0, 3.0, 5.0], 3),                        # one layer per stage
             ([4.0, 1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 1.0], 2),
             ([0.3, 0.1, 0.2, 0.25, 0.15], 1),            # one stage: everything
             ([0.1, 0.7, 0.2, 0.4, 0.05, 0.3, 0.6], 3),    # fractions
             ([1e-3, 5e2, 2e-3, 1e3, 3.0, 0.5, 7e2, 4e-2], 4),  # mixed magnitudes
             ([2.5, 0.5, 0.5, 0.5, 0.5, 0.5, 2.5], 2),     # half-integers
             # the least sum of squares, or the least spread, is not the least max
             ([5.0, 7.0, 4.0, 2.0, 4.0, 5.0], 3),
             ([6.0, 2.0, 5.0, 9.0, 5.0], 3),
             # costs 1e-3 apart: a search that stops 1e-2 short cuts one layer late
             ([0.004, 1.0, 0.5, 0.002, 1.0, 0.003], 2)]
    for n, p in ((9, 3), (13, 4), (16, 5), (11, 2), (20, 3)):
        cases.append(([float(rng.randint(1, 9)) for _ in range(n)], p))
    for n, p in ((12, 4), (15, 3)):
        cases.append(([round(rng.uniform(0.05, 9.5), 3) for _ in range(n)], p))
    return cases


def _drawn_split_cases(k: int = 2) -> list[tuple[list[float], int]]:
    """Cases drawn afresh for every check: no list of answers knows them."""
    rng = random.Random()
    cases = []
    for _ in range(k):
        n = rng.randint(6, 14)
        cases.append(([round(rng.uniform(0.01, 9.0), 3) for _ in range(n)],
                      rng.randint(2, 5)))
    return cases


def _as_stages(got, p: int, n: int) -> list[list[int]]:
    """Plain lists; a lazy result is read no further than one stage and one
    layer too many."""
    return [[int(i) for i in itertools.islice(stage, n + 1)]
            for stage in itertools.islice(got, p + 1)]


def check_split_stages(split_stages: Callable) -> None:
    """Exercise 7.3: ``split_stages(costs, p)``: p contiguous stages, the slowest
    as cheap as possible."""
    ex = "7.3"
    require_solution(ex, split_stages)
    cases = [*_split_cases(), *_drawn_split_cases()]
    answers: list[list[list[int]]] = []
    for costs, p in [*cases, cases[0]]:  # the first case again at the end
        n = len(costs)
        case = f"costs {costs}, p={p}"
        given = list(costs)
        try:
            stages = _guarded(ex, split_stages,
                              lambda got, p=p, n=n: _as_stages(got, p, n),
                              given, p)
        except (TypeError, ValueError) as e:
            fail(ex, "a list of stages, each a list of layer indices",
                 f"{type(e).__name__}: {e}"[:100])
        flat = [i for stage in stages for i in stage]
        if stages in answers and (len(stages) != p or sorted(flat) != list(range(n))):
            fail(ex, f"a split of these {n} layers into {p} stages ({case})",
                 f"stages {stages}, an answer you returned for an earlier call",
                 "keep no state between calls: work from the costs and p given")
        answers.append(stages)
        if given != costs:
            fail(ex, f"the costs left as they were ({case})", f"costs {given}",
                 "work on a copy: the caller still needs its list")
        if len(stages) != p:
            fail(ex, f"{p} stages ({case})", f"{len(stages)} stages" if len(stages) <= p
                 else f"more than {p} stages",
                 "one list of layers per stage, p of them")
        if any(not stage for stage in stages):
            fail(ex, f"no empty stage ({case})", f"stages {stages}",
                 "a stage without layers is a device that only waits")
        flat = [i for stage in stages for i in stage]
        if sorted(flat) != list(range(n)):
            fail(ex, f"every layer 0..{n - 1} in exactly one stage ({case})",
                 f"layers {sorted(flat)}", "cover every layer once")
        if flat != list(range(n)):
            fail(ex, f"stages of consecutive layers, in order ({case})",
                 f"stages {stages}", "a pipeline stage is a run of consecutive "
                 "layers: the activation of layer i goes to layer i + 1")
        slowest = max(sum(costs[i] for i in stage) for stage in stages)
        best = best_slowest_stage(costs, p)
        if slowest > best * (1 + 1e-9) + 1e-12:
            fail(ex, f"the slowest stage costing {best:g} ({case})",
                 f"stages {stages}, the slowest costing {slowest:g}",
                 "every micro-batch waits for the slowest stage: balance the costs, "
                 "not the number of layers (try every place for each cut, or search "
                 "for the least feasible slowest cost - over real numbers, not only "
                 "whole ones)")
    # one list object, changed in place between two calls: an answer cached on
    # the list's id (or its length) is the split of its old contents
    costs, p = [3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0], 3
    _guarded(ex, split_stages, lambda got: _as_stages(got, p, 7), costs, p)
    costs[:] = [1.0, 1.0, 1.0, 12.0, 1.0, 1.0, 1.0]
    stages = _guarded(ex, split_stages, lambda got: _as_stages(got, p, 7), costs, p)
    flat = [i for stage in stages for i in stage]
    if (len(stages) != p or any(not stage for stage in stages)
            or flat != list(range(7)) or max(sum(costs[i] for i in stage)
                                             for stage in stages)
            > best_slowest_stage(costs, p) * (1 + 1e-9)):
        fail(ex, f"the best split of costs {costs}, p={p}: the list given, changed "
             "in place since the previous call", f"stages {stages}",
             "keep no state between calls: an answer kept for the list's id or "
             "length belongs to its old contents")
    passed(ex, f"{len(cases)} models, 1 to 5 stages, whole and fractional costs: "
               "every split as balanced as it can be.")
