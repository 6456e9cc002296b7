"""Checkers for Chapter 7 (model and pipeline parallelism).

7.1 and 7.2 run the learner's schedules on a small simulator: each stage
executes its list in order, one unit of time per forward or backward, an op
starting only when its input has arrived (the forward from the stage before,
the backward from the stage after). The checks are properties - complete,
feasible, as short as a pipeline can be, and (for 1F1B) within its memory
bound - for several stage and micro-batch counts, including 3 stages. 7.3
checks a stage split against the best possible one (dynamic programming) on
seeded and hand-made layer costs.
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
             ([4.0, 1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 1.0], 2)]
    for n, p in ((9, 3), (13, 4), (16, 5), (11, 2), (20, 3)):
        cases.append(([float(rng.randint(1, 9)) for _ in range(n)], p))
    return cases


def check_split_stages(split_stages) -> None:
    """Exercise 7.3: ``split_stages(costs, p)``: p contiguous stages, the slowest
    as cheap as possible."""
    ex = "7.3"
    require_solution(ex, split_stages)
    for costs, p in _split_cases():
        n = len(costs)
        case = f"costs {costs}, p={p}"
        got = call_learner(ex, split_stages, list(costs), p)
        try:
            stages = [[int(i) for i in stage] for stage in got]
        except (TypeError, ValueError):
            fail(ex, "a list of stages, each a list of layer indices", f"{got!r:.80}")
        if len(stages) != p:
            fail(ex, f"{p} stages ({case})", f"{len(stages)} stages",
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
        if slowest > best + 1e-9:
            fail(ex, f"the slowest stage costing {best:g} ({case})",
                 f"stages {stages}, the slowest costing {slowest:g}",
                 "every micro-batch waits for the slowest stage: balance the costs, "
                 "not the number of layers (try every place for each cut, or search "
                 "for the least feasible slowest cost)")
    passed(ex, f"{len(_split_cases())} models, 2 to 5 stages: every split as balanced "
               "as it can be.")
