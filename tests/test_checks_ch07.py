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

def placeholder(*args):
    raise NotImplementedError("Exercise 7.3")


def split_dp(costs, p):  # dynamic programming over the last cut
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = {(0, 0): (0.0, None)}
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            best[(k, j)] = min((max(best[(k - 1, i)][0], prefix[j] - prefix[i]), i)
                               for i in range(k - 1, j) if (k - 1, i) in best)
    cuts, j = [], n
    for k in range(p, 0, -1):
        i = best[(k, j)][1]
        cuts.append(list(range(i, j)))
        j = i
    return cuts[::-1]


def split_binary_search(costs, p):  # least feasible slowest stage, then cut greedily
    def stages_needed(limit):
        count, run = 1, 0.0
        for c in costs:
            if run + c > limit:
                count, run = count + 1, 0.0
            run += c
        return count

    lo = max(costs)
    candidates = sorted({sum(costs[i:j]) for i in range(len(costs))
                         for j in range(i + 1, len(costs) + 1)})
    limit = next(c for c in candidates if c >= lo and stages_needed(c) <= p)
    stages, run, left = [[]], 0.0, p - 1
    for i, c in enumerate(costs):
        # cut when the limit forces it, or when the layers left only just fill
        # the stages left
        if stages[-1] and (run + c > limit or len(costs) - i == left):
            stages.append([])
            run, left = 0.0, left - 1
        stages[-1].append(i)
        run += c
    return stages


def split_brute_force(costs, p):  # every choice of p - 1 cuts
    import itertools
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = [0, *cuts, n]
        slowest = max(sum(costs[a:b]) for a, b in zip(edges, edges[1:], strict=False))
        if best is None or slowest < best[0]:
            best = (slowest, edges)
    edges = best[1]
    return [range(a, b) for a, b in zip(edges, edges[1:], strict=False)]


class StageSplitter:  # a class, returning tuples
    def __call__(self, costs, p):
        return tuple(tuple(stage) for stage in split_dp(costs, p))


@pytest.mark.parametrize("fn", [split_dp, split_binary_search, split_brute_force,
                                StageSplitter()])
def test_right_splits_pass(fn):
    ch07.check_split_stages(fn)


def test_wrong_splits_fail():
    def equal_layers(costs, p):  # as many layers per stage, whatever they cost
        n = len(costs)
        return [list(range(k * n // p, (k + 1) * n // p)) for k in range(p)]

    def greedy_average(costs, p):  # cut once a stage reaches the average
        target, stages, run = sum(costs) / p, [[]], 0.0
        for i, c in enumerate(costs):
            if run >= target and len(stages) < p:
                stages.append([])
                run = 0.0
            stages[-1].append(i)
            run += c
        return stages

    def by_cost_round_robin(costs, p):  # balanced sums, but not contiguous
        order = sorted(range(len(costs)), key=lambda i: -costs[i])
        stages = [[] for _ in range(p)]
        for k, i in enumerate(order):
            stages[k % p].append(i)
        return [sorted(s) for s in stages]

    def cut_points(costs, p):  # the cuts, not the stages
        return [split[0] for split in split_dp(costs, p)[1:]]

    def one_stage_too_few(costs, p):
        return split_dp(costs, p - 1) if p > 1 else split_dp(costs, p)

    def empty_stage(costs, p):
        return [*split_dp(costs, p - 1), []]

    def last_layer_dropped(costs, p):
        stages = split_dp(costs, p)
        stages[-1] = stages[-1][:-1] or stages[-1]
        return stages if len(stages[-1]) < len(split_dp(costs, p)[-1]) else [
            *stages[:-1], stages[-1]]

    def two_stages_always(costs, p):
        return split_dp(costs, 2)

    def balances_the_fastest(costs, p):  # maximises the cheapest stage instead
        import itertools
        n, best = len(costs), None
        for cuts in itertools.combinations(range(1, n), p - 1):
            edges = [0, *cuts, n]
            pairs = zip(edges, edges[1:], strict=False)
            cheapest = min(sum(costs[a:b]) for a, b in pairs)
            if best is None or cheapest > best[0]:
                best = (cheapest, edges)
        return [list(range(a, b)) for a, b in zip(best[1], best[1][1:], strict=False)]

    fails(ch07.check_split_stages, equal_layers, "slowest stage costing")
    fails(ch07.check_split_stages, greedy_average, "stage")
    fails(ch07.check_split_stages, by_cost_round_robin, "consecutive layers")
    fails(ch07.check_split_stages, cut_points, "a list of stages")
    fails(ch07.check_split_stages, one_stage_too_few, "stages")
    fails(ch07.check_split_stages, empty_stage, "no empty stage")
    fails(ch07.check_split_stages, last_layer_dropped, "every layer")
    fails(ch07.check_split_stages, two_stages_always, "stages")
    fails(ch07.check_split_stages, balances_the_fastest, "slowest stage costing")
    fails(ch07.check_split_stages, placeholder, "placeholder")
