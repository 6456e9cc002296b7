"""Checkers for Chapter 7 (model and pipeline parallelism).

7.1 and 7.2 run the learner's schedules on a small simulator: each stage
executes its list in order, one unit of time per forward or backward, an op
starting only when its input has arrived (the forward from the stage before,
the backward from the stage after). The checks are properties - complete,
feasible, as short as a pipeline can be, and (for 1F1B) within its memory
bound - for several stage and micro-batch counts, including 3 stages. 7.3
computes the idle fraction of timelines built by the checker.
"""

from __future__ import annotations

import random

from course_utils.exercises import call_learner, fail, passed, require_solution

SCHEDULE_CASES = [(2, 4), (3, 5), (4, 8), (3, 3), (4, 2), (1, 3), (5, 7)]


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
            stuck = {s: order[s][pos[s]] for s in range(p) if pos[s] < len(order[s])}
            raise ValueError(f"deadlock: each stage waits for an op that never runs "
                             f"({stuck})")
    return max(when.values()) + 1, when


def _validate(ex, fn, p, m, kind_name):
    got = call_learner(ex, fn, p, m)
    case = f"p={p} stages, m={m} micro-batches"
    try:
        order = [[(str(k), int(i)) for k, i in stage] for stage in got]
    except (TypeError, ValueError):
        fail(ex, "a list per stage of ('F' or 'B', micro-batch) pairs",
             f"{got!r:.80}")
    if len(order) != p:
        fail(ex, f"{p} stage lists ({case})", f"{len(order)}",
             "one list per stage, even for p = 3")
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
        finish, when = simulate(order, p, m)
    except ValueError as e:
        fail(ex, f"a schedule that can run ({case})", str(e),
             "the backward of a micro-batch flows from the last stage to the "
             "first: each stage must be ready to run what the next one sends")
    best = 2 * (m + p - 1)
    if finish > best:
        fail(ex, f"{kind_name} finishing in {best} time units ({case})",
             f"{finish} units", "do not make a stage wait for work it could "
             "already run")
    return order, when


def check_gpipe(gpipe_schedule) -> None:
    ex = "7.1"
    require_solution(ex, gpipe_schedule)
    for p, m in SCHEDULE_CASES:
        order, _ = _validate(ex, gpipe_schedule, p, m, "GPipe")
        for s, ops in enumerate(order):
            kinds = "".join(k for k, _ in ops)
            if kinds != "F" * m + "B" * m:
                fail(ex, f"all forwards before any backward on stage {s} "
                     f"(p={p}, m={m})",
                     kinds, "that is GPipe; alternating F and B is 1F1B (7.2)")
    passed(ex, "Complete, feasible and as short as a pipeline can be.")


def in_flight(ops) -> int:
    held = most = 0
    for k, _ in ops:
        held += 1 if k == "F" else -1
        most = max(most, held)
    return most


def check_one_f_one_b(one_f_one_b) -> None:
    ex = "7.2"
    require_solution(ex, one_f_one_b)
    for p, m in SCHEDULE_CASES:
        order, _ = _validate(ex, one_f_one_b, p, m, "1F1B")
        for s, ops in enumerate(order):
            bound = min(p - s, m)
            if in_flight(ops) > bound:
                fail(ex, f"at most {bound} micro-batches in flight on stage {s} "
                     f"(p={p}, m={m})", f"{in_flight(ops)}",
                     "after the warm-up forwards, alternate one backward and one "
                     "forward: that is what bounds 1F1B's memory")
    passed(ex, "GPipe's time with at most p - s micro-batches held on stage s.")


# ---------------------------------------------------------------- exercise 7.3


def _timelines():
    rng = random.Random(7)
    # two ranks, gaps between ops, and an unsorted order
    yield [("rank 0", 0.0, 1.0), ("rank 1", 1.0, 2.0), ("rank 0", 2.0, 2.5),
           ("rank 1", 2.5, 4.0)]
    # three lanes that start late: idle time is measured from the first start
    yield [("stage 0", 10.0, 11.0), ("stage 1", 11.0, 12.0), ("stage 2", 12.0, 13.0),
           ("stage 0", 11.0, 12.0), ("stage 1", 12.0, 13.0), ("stage 2", 13.0, 14.0)]
    # random spans with labels (4-tuples), none overlapping within a lane
    spans = []
    for lane in ("a", "b", "c", "d"):
        t = rng.uniform(0, 1)
        for k in range(5):
            d = rng.uniform(0.1, 1.0)
            spans.append((lane, t, t + d, f"op{k}"))
            t += d + rng.uniform(0, 0.5)
    rng.shuffle(spans)
    yield spans
    # one lane never used: it counts as idle
    yield [("x", 0.0, 2.0), ("y", 0.5, 1.0)]


def bubble_reference(spans, lanes=None) -> float:
    names = set(lanes or ()) | {s[0] for s in spans}
    start = min(s[1] for s in spans)
    end = max(s[2] for s in spans)
    busy = sum(s[2] - s[1] for s in spans)
    return 1 - busy / (len(names) * (end - start))


def check_idle_fraction(idle_fraction) -> None:
    ex = "7.3"
    require_solution(ex, idle_fraction)
    for spans in _timelines():
        lanes = sorted({s[0] for s in spans})
        if len(lanes) == 2 and lanes == ["x", "y"]:
            lanes = ["x", "y", "z"]  # a stage that did nothing
        want = bubble_reference(spans, lanes)
        got = call_learner(ex, idle_fraction, list(spans), lanes)
        try:
            got = float(got)
        except (TypeError, ValueError):
            fail(ex, "a fraction between 0 and 1", f"{got!r:.60}")
        if abs(got - want) > 1e-9:
            fail(ex, f"idle fraction {want:.4f} for {len(lanes)} lanes", f"{got:.4f}",
                 "1 - busy time / (lanes x (last end - first start)), counting every "
                 "lane given, even one that never worked")
    passed(ex, "The idle fraction of measured timelines, any lanes and labels.")
