"""Chapter 7's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import pytest

from course_utils import images
from course_utils.checks import ch07
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    for w in words:
        assert w in str(e.value), str(e.value)


# ---------------------------------------------------------------- 7.1


def gpipe_reversed(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m - 1, -1, -1)]
            for _ in range(p)]


def gpipe_in_order(p, m):  # backwards in forward order: also feasible and as fast
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            for _ in range(p)]


def gpipe_from_slots(p, m):
    return [[(k, i) for _, k, i in sorted(ops)] for ops in images.gpipe_schedule(p, m)]


def gpipe_tuples(p, m):
    fw = tuple(("F", i) for i in range(m))
    return tuple(fw + tuple(("B", m - 1 - i) for i in range(m)) for _ in range(p))


@pytest.mark.parametrize("fn", [gpipe_reversed, gpipe_in_order, gpipe_from_slots,
                                gpipe_tuples])
def test_right_gpipe_pass(fn):
    ch07.check_gpipe(fn)


def one_f_one_b_ref(p, m):
    order = []
    for s in range(p):
        warm = min(p - s, m)
        ops, f = [("F", i) for i in range(warm)], warm
        for b in range(m):
            ops.append(("B", b))
            if f < m:
                ops.append(("F", f))
                f += 1
        order.append(ops)
    return order


def test_wrong_gpipe_fail():
    def two_stages(p, m):
        return gpipe_reversed(2, m)

    def missing_last(p, m):
        return gpipe_reversed(p, m - 1) if m > 1 else [[] for _ in range(p)]

    def backward_first(p, m):
        return [[("B", i) for i in range(m)] + [("F", i) for i in range(m)]
                for _ in range(p)]

    def interleaved(p, m):
        return one_f_one_b_ref(p, m)

    def letters(p, m):
        return [["F" * m + "B" * m] for _ in range(p)]

    def first_stage_backward_early(p, m):  # stage 0 waits for B0 before F's end
        order = gpipe_in_order(p, m)
        if m > 1:
            order[0] = [("F", 0), ("B", 0)] + [("F", i) for i in range(1, m)] + \
                [("B", i) for i in range(1, m)]
        return order

    def deadlock(p, m):  # first and last stages wait on each other
        order = gpipe_reversed(p, m)
        order[-1] = [("F", 0), ("B", 0)] + order[-1][1:m] + order[-1][m:-1]
        return order

    def duplicated(p, m):
        return [ops + [("F", 0)] for ops in gpipe_reversed(p, m)]

    def stage_count_ignored(p, m):
        return [gpipe_reversed(1, m)[0]]

    fails(ch07.check_gpipe, two_stages, "stage lists")
    fails(ch07.check_gpipe, missing_last, "once on stage")
    fails(ch07.check_gpipe, backward_first, "backward before its forward")
    fails(ch07.check_gpipe, interleaved, "all forwards before any backward")
    fails(ch07.check_gpipe, letters, "Exercise 7.1")
    fails(ch07.check_gpipe, first_stage_backward_early, "Exercise 7.1")
    fails(ch07.check_gpipe, deadlock, "Exercise 7.1")
    fails(ch07.check_gpipe, duplicated, "once on stage")
    fails(ch07.check_gpipe, stage_count_ignored, "stage lists")


# ---------------------------------------------------------------- 7.2


def one_f_one_b_from_slots(p, m):
    return [[(k, i) for _, k, i in sorted(ops)]
            for ops in images.one_f_one_b_schedule(p, m)]


def one_f_one_b_warmup_minus_one(p, m):  # the textbook warm-up of p - s - 1
    order = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops, f, b = [("F", i) for i in range(warm)], warm, 0
        while b < m:
            if f < m:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
            b += 1
        order.append(ops)
    return order


def one_f_one_b_generator(p, m):
    def stage(s):
        warm = min(p - s, m)
        yield from (("F", i) for i in range(warm))
        for b in range(m):
            yield ("B", b)
            if warm + b < m:
                yield ("F", warm + b)
    return [list(stage(s)) for s in range(p)]


@pytest.mark.parametrize("fn", [one_f_one_b_ref, one_f_one_b_from_slots,
                                one_f_one_b_warmup_minus_one, one_f_one_b_generator])
def test_right_one_f_one_b_pass(fn):
    ch07.check_one_f_one_b(fn)


def test_wrong_one_f_one_b_fail():
    def gpipe(p, m):
        return gpipe_reversed(p, m)

    def same_warmup_everywhere(p, m):
        return [one_f_one_b_ref(p, m)[0] for _ in range(p)]

    def no_warmup(p, m):
        return [[op for i in range(m) for op in (("F", i), ("B", i))] for _ in range(p)]

    def warmup_too_long(p, m):
        order = []
        for s in range(p):
            warm = min(p - s + 1, m)
            ops, f = [("F", i) for i in range(warm)], warm
            for b in range(m):
                ops.append(("B", b))
                if f < m:
                    ops.append(("F", f))
                    f += 1
            order.append(ops)
        return order

    def two_stages(p, m):
        return one_f_one_b_ref(2, m)

    def reversed_backwards(p, m):
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)][::-1]
                for _ in range(p)]

    def drops_a_micro_batch(p, m):
        return [[op for op in ops if op[1] != m - 1] for ops in one_f_one_b_ref(p, m)]

    def last_stage_swapped(p, m):
        order = one_f_one_b_ref(p, m)
        order[-1] = [("B", 0)] + [op for op in order[-1] if op != ("B", 0)]
        return order

    fails(ch07.check_one_f_one_b, gpipe, "in flight")
    fails(ch07.check_one_f_one_b, same_warmup_everywhere, "Exercise 7.2")
    fails(ch07.check_one_f_one_b, no_warmup, "Exercise 7.2")
    fails(ch07.check_one_f_one_b, warmup_too_long, "in flight")
    fails(ch07.check_one_f_one_b, two_stages, "stage lists")
    fails(ch07.check_one_f_one_b, reversed_backwards, "in flight")
    fails(ch07.check_one_f_one_b, drops_a_micro_batch, "once on stage")
    fails(ch07.check_one_f_one_b, last_stage_swapped, "backward before its forward")


# ---------------------------------------------------------------- 7.3


def idle_ref(spans, lanes):
    start, end = min(s[1] for s in spans), max(s[2] for s in spans)
    return 1 - sum(s[2] - s[1] for s in spans) / (len(lanes) * (end - start))


def idle_per_lane(spans, lanes):
    start, end = min(s[1] for s in spans), max(s[2] for s in spans)
    idle = 0.0
    for lane in lanes:
        idle += (end - start) - sum(s[2] - s[1] for s in spans if s[0] == lane)
    return idle / (len(lanes) * (end - start))


def idle_unpacked(spans, lanes):
    starts = [s for _, s, *_ in spans]
    ends = [e for _, _, e, *_ in spans]
    busy = sum(e - s for s, e in zip(starts, ends, strict=True))
    return 1.0 - busy / ((max(ends) - min(starts)) * len(lanes))


def idle_sorted(spans, lanes):
    ordered = sorted(spans, key=lambda s: s[1])
    total = (max(s[2] for s in ordered) - ordered[0][1]) * len(lanes)
    return (total - sum(s[2] - s[1] for s in ordered)) / total


@pytest.mark.parametrize("fn", [idle_ref, idle_per_lane, idle_unpacked, idle_sorted])
def test_right_idle_fractions_pass(fn):
    ch07.check_idle_fraction(fn)


def test_wrong_idle_fractions_fail():
    def from_zero(spans, lanes):
        end = max(s[2] for s in spans)
        return 1 - sum(s[2] - s[1] for s in spans) / (len(lanes) * end)

    def lanes_from_spans(spans, lanes):
        return idle_ref(spans, sorted({s[0] for s in spans}))

    def busy_fraction(spans, lanes):
        return 1 - idle_ref(spans, lanes)

    def first_and_last_span(spans, lanes):
        start, end = spans[0][1], spans[-1][2]
        return 1 - sum(s[2] - s[1] for s in spans) / (len(lanes) * (end - start))

    def two_lanes(spans, lanes):
        return idle_ref(spans, ["a", "b"])

    def formula(spans, lanes):
        p = len(lanes)
        return (p - 1) / (len(spans) / p + p - 1)

    def percent(spans, lanes):
        return 100 * idle_ref(spans, lanes)

    def label_as_end(spans, lanes):
        return idle_ref([(s[0], s[1], s[-1] if isinstance(s[-1], float) else s[2])
                         for s in spans[:-1]], lanes)

    fails(ch07.check_idle_fraction, from_zero, "Exercise 7.3")
    fails(ch07.check_idle_fraction, lanes_from_spans, "every lane")
    fails(ch07.check_idle_fraction, busy_fraction, "Exercise 7.3")
    fails(ch07.check_idle_fraction, first_and_last_span, "Exercise 7.3")
    fails(ch07.check_idle_fraction, two_lanes, "Exercise 7.3")
    fails(ch07.check_idle_fraction, formula, "Exercise 7.3")
    fails(ch07.check_idle_fraction, percent, "Exercise 7.3")
    fails(ch07.check_idle_fraction, label_as_end, "Exercise 7.3")
