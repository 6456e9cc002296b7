"""Chapter 7's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import functools
import itertools
import time

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
# Each answer runs in two real processes; they import what they use inside.


def step_batched(stage, rank, x, y, m, hidden):
    """GPipe with batch_isend_irecv and tensor_split."""
    import torch
    import torch.distributed as dist
    for p in stage.parameters():
        p.grad = None
    xs, ys = x.tensor_split(m), y.tensor_split(m)
    kept, total = [], 0.0
    for xi, yi in zip(xs, ys, strict=True):
        if rank == 0:
            out = stage(xi)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out.detach(), 1)]):
                w.wait()
            kept.append(out)
        else:
            h = torch.zeros(yi.shape[0], hidden, dtype=y.dtype)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, h, 0)]):
                w.wait()
            h.requires_grad_(True)
            loss = ((stage(h) - yi) ** 2).sum() / y.numel()
            kept.append((h, loss))
            total += float(loss)
    for item in kept:
        if rank == 0:
            g = torch.zeros_like(item)
            dist.recv(g, src=1)
            item.backward(g)
        else:
            h, loss = item
            loss.backward()
            dist.send(h.grad, dst=0)
    return total if rank == 1 else None


def step_async(stage, rank, x, y, m, hidden):
    """isend/irecv with waits; the loss returned as a tensor."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    stage.zero_grad(set_to_none=False)
    outs, inputs, losses = [], [], []
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        if rank == 0:
            o = stage(xi)
            dist.isend(o.detach().clone(), 1).wait()
            outs.append(o)
        else:
            h = torch.empty((len(yi), hidden), dtype=x.dtype, device=x.device)
            dist.irecv(h, 0).wait()
            inputs.append(h.requires_grad_())
            losses.append(F.mse_loss(stage(h), yi, reduction="sum") / y.numel())
    if rank == 0:
        for o in outs:
            g = torch.empty_like(o)
            dist.irecv(g, 1).wait()
            torch.autograd.backward(o, g)
        return "done"
    for h, loss in zip(inputs, losses, strict=True):
        loss.backward()
        dist.isend(h.grad, 0).wait()
    return torch.stack(losses).sum().detach()


class OneFOneBStep:
    """A class; 1F1B on two stages, each send posted with the next receive."""

    def __call__(self, stage, rank, x, y, m, hidden):
        import torch
        import torch.distributed as tdist
        stage.zero_grad()
        xs, ys = list(x.chunk(m)), list(y.chunk(m))
        if rank == 0:
            outs = {}
            for i in range(m):
                outs[i] = stage(xs[i])
                ops = [tdist.P2POp(tdist.isend, outs[i].detach(), 1)]
                g = None
                if i >= 1:  # the gradient of micro-batch i - 1 comes back now
                    g = torch.empty_like(outs[i - 1])
                    ops.append(tdist.P2POp(tdist.irecv, g, 1))
                for w in tdist.batch_isend_irecv(ops):
                    w.wait()
                if g is not None:
                    outs.pop(i - 1).backward(g)
            g = torch.empty_like(outs[m - 1])
            tdist.recv(g, 1)
            outs.pop(m - 1).backward(g)
            return None
        total = torch.zeros((), dtype=x.dtype)
        for i in range(m):
            h = torch.empty(len(ys[i]), hidden, dtype=x.dtype)
            tdist.recv(h, 0)
            h.requires_grad_()
            loss = torch.nn.functional.mse_loss(stage(h), ys[i], reduction="sum")
            loss = loss / y.numel()
            loss.backward()
            total = total + loss.detach()
            tdist.send(h.grad, 0)
        return total.item()


def step_shape_first(stage, rank, x, y, m, hidden):
    """Sends each activation's shape first (extra, harmless messages)."""
    import torch
    import torch.distributed as dist
    for p in stage.parameters():
        if p.grad is not None:
            p.grad.zero_()
    pairs = list(zip(torch.chunk(x, m), torch.chunk(y, m), strict=True))
    saved = []
    for xi, yi in pairs:
        if rank == 0:
            a = stage(xi)
            dist.send(torch.tensor(a.shape), 1)
            dist.send(a.detach().contiguous(), 1)
            saved.append(a)
        else:
            shape = torch.zeros(2, dtype=torch.long)
            dist.recv(shape, 0)
            h = torch.empty(*shape.tolist(), dtype=x.dtype)
            dist.recv(h, 0)
            h.requires_grad = True
            saved.append((h, stage(h), yi))
    loss_value = 0.0
    for item in saved:
        if rank == 0:
            g = torch.empty_like(item)
            dist.recv(g, 1)
            item.backward(gradient=g)
        else:
            h, out, yi = item
            loss = torch.nn.functional.mse_loss(out, yi, reduction="sum") / y.numel()
            loss.backward()
            loss_value += loss.item()
            dist.send(h.grad, 0)
    return loss_value if rank == 1 else 0.0


def step_backward_reversed(stage, rank, x, y, m, hidden):
    """Backwards in reverse micro-batch order, the same on both ranks."""
    import torch
    import torch.distributed as dist
    stage.zero_grad()
    xs, ys = x.chunk(m), y.chunk(m)
    n = y.numel()
    kept = []
    for i in range(len(xs)):
        if rank == 0:
            kept.append(stage(xs[i]))
            dist.send(kept[-1].detach(), 1)
        else:
            h = torch.empty(ys[i].shape[0], hidden, dtype=ys[i].dtype).requires_grad_()
            dist.recv(h.data, 0)
            kept.append((h, ((stage(h) - ys[i]) ** 2).sum() / n))
    total = 0.0
    for item in reversed(kept):
        if rank == 0:
            g = torch.empty_like(item)
            dist.recv(g, 1)
            item.backward(g)
        else:
            item[1].backward()
            total += item[1].item()
            dist.send(item[0].grad, 0)
    return total


@pytest.mark.parametrize("fn", [step_batched, step_async, OneFOneBStep(),
                                step_shape_first, step_backward_reversed])
def test_right_two_stage_steps_pass(fn):
    ch07.check_two_stage_step(fn)


def gpipe_with(loss_fn=None, zero=True, boundary="grad", micro=True, dtype=None,
               need_grad=True, returned="total", width=None, keep_detached=False):
    """A GPipe step with one mistake switched on."""
    def step(stage, rank, x, y, m, hidden):
        import torch
        import torch.distributed as dist
        if zero:
            stage.zero_grad()
        k = m if micro else 1
        saved, parts = [], []
        for xi, yi in zip(x.chunk(k), y.chunk(k), strict=True):
            if rank == 0:
                out = stage(xi if dtype is None else xi.to(dtype))
                dist.send(out.detach(), 1)
                saved.append(out.detach() if keep_detached else out)
            else:
                h = torch.empty(len(yi), width or hidden, dtype=dtype or x.dtype)
                dist.recv(h, 0)
                if need_grad:
                    h.requires_grad_()
                out = stage(h)
                loss = (loss_fn(out, yi, y, k) if loss_fn else
                        torch.nn.functional.mse_loss(out, yi, reduction="sum")
                        / y.numel())
                saved.append(h)
                parts.append(loss)
        for i, item in enumerate(saved):
            if rank == 0:
                if boundary == "none":
                    continue
                g = torch.empty_like(item)
                dist.recv(g, 1)
                item.backward(torch.ones_like(item) if boundary == "ones" else g)
            else:
                parts[i].backward()
                if boundary != "none":
                    dist.send(item.grad, 0)
        if rank == 1:
            return parts[-1].item() if returned == "last" else sum(
                q.item() for q in parts)
        return None
    return step


def mean_per_micro_batch(out, yi, y, k):
    import torch
    return torch.nn.functional.mse_loss(out, yi)


def mean_of_means(out, yi, y, k):
    import torch
    return torch.nn.functional.mse_loss(out, yi) / k


def one_f_one_b_blocking(stage, rank, x, y, m, hidden):
    """1F1B with blocking sends: stage 1 sends a gradient while stage 0 sends
    the next activation - both wait for ever."""
    import torch
    import torch.distributed as dist
    stage.zero_grad()
    xs, ys = x.chunk(m), y.chunk(m)
    if rank == 0:
        outs = [stage(xi) for xi in xs]
        for o in outs:
            dist.send(o.detach(), 1)
        for o in outs:
            g = torch.empty_like(o)
            dist.recv(g, 1)
            o.backward(g)
        return None
    total = 0.0
    for yi in ys:
        h = torch.empty(len(yi), hidden, dtype=x.dtype, requires_grad=True)
        dist.recv(h.data, 0)
        loss = torch.nn.functional.mse_loss(stage(h), yi, reduction="sum") / y.numel()
        loss.backward()
        dist.send(h.grad, 0)  # rank 0 is still sending activations
        total += loss.item()
    return total


class KeepsTotal:
    """Keeps the running loss in the object: the second step returns the sum
    of both steps' losses."""

    def __init__(self):
        self.total = 0.0

    def __call__(self, stage, rank, x, y, m, hidden):
        import torch
        import torch.distributed as dist
        stage.zero_grad()
        kept = []
        for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
            if rank == 0:
                kept.append(stage(xi))
                dist.send(kept[-1].detach(), 1)
            else:
                h = torch.empty(len(yi), hidden, dtype=x.dtype).requires_grad_()
                dist.recv(h.data, 0)
                kept.append((h, torch.nn.functional.mse_loss(
                    stage(h), yi, reduction="sum") / y.numel()))
        for item in kept:
            if rank == 0:
                g = torch.empty_like(item)
                dist.recv(g, 1)
                item.backward(g)
            else:
                item[1].backward()
                self.total += item[1].item()
                dist.send(item[0].grad, 0)
        return self.total


def _float32_only():
    import torch
    return gpipe_with(dtype=torch.float32)


WRONG_STEPS = {  # name: (answer, words its failure must contain)
    "never zeroes the gradients": (gpipe_with(zero=False),
                                   ("zero_grad", "added to the first")),
    "mean loss per micro-batch": (gpipe_with(loss_fn=mean_per_micro_batch),
                                  ("sum of means",)),
    "means divided by m": (gpipe_with(loss_fn=mean_of_means),
                           ("mean of means", "not all the same size")),
    "backward with ones": (gpipe_with(boundary="ones"), ("ones_like",)),
    "no boundary backward": (gpipe_with(boundary="none"),
                             ("stage 0 never ran its backward",)),
    "float32 only": (_float32_only(), ("same dtype",)),
    "whole batch at once": (gpipe_with(micro=False), ("whole batch",)),
    "received activation without grad": (gpipe_with(need_grad=False),
                                         ("requires_grad_",)),
    "returns the last micro-batch's loss": (gpipe_with(returned="last"),
                                            ("returned",)),
    "hard-coded width": (gpipe_with(width=7), ("width",)),
    "loss kept across steps": (KeepsTotal(), ("second step",)),
    "keeps a detached output": (gpipe_with(keep_detached=True), ("out.detach()",)),
}


@pytest.mark.parametrize("name", list(WRONG_STEPS))
def test_wrong_two_stage_steps_fail(name):
    fn, words = WRONG_STEPS[name]
    fails(ch07.check_two_stage_step, fn, *words)


def test_blocking_sends_in_1f1b_order_fail(monkeypatch):
    fails(ch07.check_two_stage_step, one_f_one_b_blocking, "both ranks to finish",
          "blocking send", "waiting in")  # where each rank was


def test_placeholder_two_stage_step_fails_at_once():
    def two_stage_step(stage, rank, x, y, m, hidden):
        raise NotImplementedError("Exercise 7.1")

    fails(ch07.check_two_stage_step, two_stage_step, "placeholder")


# ---------------------------------------------------------------- 7.2


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


def gpipe_reversed(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m - 1, -1, -1)]
            for _ in range(p)]


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


class OneFOneBPlanner:  # a class; queues of pending work; tuples out
    def __call__(self, p, m):
        from collections import deque
        out = []
        for s in range(p):
            forwards, backwards = deque(range(m)), deque(range(m))
            ops, held = [], 0
            while backwards:
                if forwards and held < p - s:
                    ops.append(("F", forwards.popleft()))
                    held += 1
                else:
                    ops.append(("B", backwards.popleft()))
                    held -= 1
            out.append(tuple(ops))
        return tuple(out)


def one_f_one_b_torch_ints(p, m):  # micro-batch numbers as 0-d tensors
    import torch
    return [[(k, torch.tensor(i)) for k, i in ops] for ops in one_f_one_b_ref(p, m)]


@pytest.mark.parametrize("fn", [one_f_one_b_from_slots, one_f_one_b_warmup_minus_one,
                                one_f_one_b_generator, OneFOneBPlanner(),
                                one_f_one_b_torch_ints])
def test_right_one_f_one_b_pass(fn):
    ch07.check_one_f_one_b(fn)


def test_wrong_one_f_one_b_fail(monkeypatch):
    monkeypatch.setattr(ch07, "_call_limit", lambda ex: 2.0)

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

    def lower_case(p, m):
        return [[(k.lower(), i) for k, i in ops] for ops in one_f_one_b_ref(p, m)]

    def never_ends(p, m):  # a lazy list of lists that never ends (slowly)
        def stage():
            for i in itertools.count():
                time.sleep(0.01)
                yield ("F", i)
        return (stage() for _ in range(p))

    state = {}

    def first_call_cached(p, m):  # answers every call with the first call's orders
        state.setdefault("first", (p, m))
        return one_f_one_b_ref(*state["first"])

    fails(ch07.check_one_f_one_b, gpipe, "in flight")
    fails(ch07.check_one_f_one_b, same_warmup_everywhere, "Exercise 7.2")
    fails(ch07.check_one_f_one_b, no_warmup, "Exercise 7.2")
    fails(ch07.check_one_f_one_b, warmup_too_long, "in flight")
    fails(ch07.check_one_f_one_b, two_stages, "stage lists")
    fails(ch07.check_one_f_one_b, reversed_backwards, "in flight")
    fails(ch07.check_one_f_one_b, drops_a_micro_batch, "once on stage")
    fails(ch07.check_one_f_one_b, last_stage_swapped, "backward before its forward")
    fails(ch07.check_one_f_one_b, lower_case, "once on stage")
    fails(ch07.check_one_f_one_b, never_ends, "once on stage")  # read 2m + 1 ops
    fails(ch07.check_one_f_one_b, first_call_cached, "stage lists")


def test_one_f_one_b_runs_on_real_processes(monkeypatch):
    """The real run compares gradients: orders that the simulator accepts but
    that give another gradient cannot exist, so check the runner itself."""
    from course_utils.dist import launch

    p, m = ch07.REAL_CASE
    ranks = [r.value for r in launch(ch07._schedule_rank, p,
                                     args=(one_f_one_b_ref(p, m), m), backend="gloo")]
    want = ch07._one_process_grads(p, m)
    got = [g for _, grads in ranks for g in grads]
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(got, want, strict=True))
    assert [most for most, _ in ranks] == [min(p - s, m) for s in range(p)]


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


def split_recursive(costs, p):  # memoised recursion on (first layer, stages left)
    costs = tuple(costs)

    @functools.cache
    def best(start, k):
        if k == 1:
            return sum(costs[start:]), (len(costs),)
        options = []
        for cut in range(start + 1, len(costs) - k + 2):
            rest, cuts = best(cut, k - 1)
            options.append((max(sum(costs[start:cut]), rest), (cut, *cuts)))
        return min(options)

    edges = (0, *best(0, p)[1])
    return [list(range(a, b)) for a, b in itertools.pairwise(edges)]


def split_bisect_real(costs, p):  # bisection over real limits, then greedy cuts
    def greedy(limit):
        stages, run = [[]], 0.0
        for i, c in enumerate(costs):
            left_layers, left_stages = len(costs) - i, p - len(stages)
            if stages[-1] and (run + c > limit or left_layers == left_stages):
                stages.append([])
                run = 0.0
            stages[-1].append(i)
            run += c
        return stages

    lo, hi = max(costs), sum(costs)
    for _ in range(200):
        mid = (lo + hi) / 2
        if len(greedy(mid)) <= p:
            hi = mid
        else:
            lo = mid
    return greedy(hi)


@pytest.mark.parametrize("fn", [split_binary_search, split_brute_force,
                                StageSplitter(), split_recursive, split_bisect_real])
def test_right_splits_pass(fn):
    ch07.check_split_stages(fn)


def test_wrong_splits_fail(monkeypatch):
    monkeypatch.setattr(ch07, "_call_limit", lambda ex: 2.0)

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
        return split_dp(costs, p - 1) if p > 1 else [[], *split_dp(costs, p)]

    def empty_stage(costs, p):
        return [*split_dp(costs, p - 1), []] if p > 1 else [[]]

    def last_layer_dropped(costs, p):
        stages = split_dp(costs, p)
        stages[-1] = stages[-1][:-1]
        return stages

    def two_stages_always(costs, p):
        return split_dp(costs, 2)

    def balances_the_fastest(costs, p):  # maximises the cheapest stage instead
        n, best = len(costs), None
        for cuts in itertools.combinations(range(1, n), p - 1):
            edges = [0, *cuts, n]
            pairs = zip(edges, edges[1:], strict=False)
            cheapest = min(sum(costs[a:b]) for a, b in pairs)
            if best is None or cheapest > best[0]:
                best = (cheapest, edges)
        return [list(range(a, b)) for a, b in zip(best[1], best[1][1:], strict=False)]

    def whole_number_search(costs, p):  # bisects over whole numbers only
        def stages_for(limit):
            out, run = [[]], 0.0
            for i, c in enumerate(costs):
                if stages_for_run(run, c, limit) and out[-1]:
                    out.append([])
                    run = 0.0
                out[-1].append(i)
                run += c
            return out

        def stages_for_run(run, c, limit):
            return run + c > limit

        lo, hi = int(max(costs)), int(sum(costs)) + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if len(stages_for(mid)) <= p:
                hi = mid
            else:
                lo = mid + 1
        stages = stages_for(lo)
        while len(stages) < p:  # split the longest to reach p stages
            k = max(range(len(stages)), key=lambda j: len(stages[j]))
            stages[k:k + 1] = [stages[k][:1], stages[k][1:]]
        return stages

    def sorts_the_costs(costs, p):  # changes the caller's list
        stages = split_dp(costs, p)
        costs.sort()
        return stages

    def never_ends(costs, p):  # a lazy list that never ends (slowly)
        for _ in itertools.count():
            time.sleep(0.01)
            yield list(range(len(costs)))

    fails(ch07.check_split_stages, equal_layers, "slowest stage costing")
    fails(ch07.check_split_stages, greedy_average, "stage")
    fails(ch07.check_split_stages, by_cost_round_robin, "consecutive layers")
    fails(ch07.check_split_stages, cut_points, "a list of stages")
    fails(ch07.check_split_stages, one_stage_too_few, "stages")
    fails(ch07.check_split_stages, empty_stage, "no empty stage")
    fails(ch07.check_split_stages, last_layer_dropped, "every layer")
    fails(ch07.check_split_stages, two_stages_always, "stages")
    fails(ch07.check_split_stages, balances_the_fastest, "slowest stage costing")
    fails(ch07.check_split_stages, whole_number_search, "not only whole ones")
    fails(ch07.check_split_stages, sorts_the_costs, "costs left as they were")
    fails(ch07.check_split_stages, never_ends, "more than")  # read p + 1 stages
    fails(ch07.check_split_stages, placeholder, "placeholder")


# ---------------------------------------------------------------- more answers
# 7.1: one step written with switches, each a right or a wrong way to do a part.


def step_with(stage, rank, x, y, m, hidden, *, extra_no_grad=False, width="hidden",
              loss_div="numel", zero="always", one_buffer=False, loss_as="float",
              barrier=False, wait_twice=False, equal_rows=False, cache_loss=False,
              grads_reversed_on_1=False):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    if zero == "always" or not getattr(stage, "_zeroed", False):
        stage.zero_grad()
        stage._zeroed = True
    kept, seen, loss, buf = [], [], 0.0, None
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        if rank == 0:
            out = stage(xi)
            dist.send(out.detach(), 1)
            kept.append(out)
            continue
        w = {"hidden": hidden, "model": stage[0].in_features, "seven": 7}[width]
        if one_buffer:  # one buffer for every micro-batch
            buf = torch.empty(len(x), w, dtype=x.dtype) if buf is None else buf
            h = buf[:len(yi)]
        else:
            h = torch.empty(len(yi), w, dtype=x.dtype)
        work = dist.irecv(h, 0)
        work.wait()
        if wait_twice:
            work.wait()
        h.requires_grad_()
        out = stage(h)
        if equal_rows:  # a mean weighed as if every micro-batch had len(x) // m rows
            part = F.mse_loss(out, yi) * (len(x) // m) / len(x)
        else:
            part = F.mse_loss(out, yi, reduction="sum") / (
                y.numel() if loss_div == "numel" else y.shape[0])
        kept.append((h, part))
        seen.append(h.detach())
        loss = loss + (part if loss_as == "tensor" else part.item())
    if barrier:
        dist.barrier()
    if rank == 1 and grads_reversed_on_1:
        kept.reverse()
    for item in kept:
        if rank == 0:
            g = torch.empty_like(item)
            dist.recv(g, 1)
            item.backward(g)
        else:
            item[1].backward()
            dist.send(item[0].grad, 0)
    if rank == 0:
        return None
    if extra_no_grad:  # the loss again, from a whole-batch forward without a graph
        with torch.no_grad():
            loss = F.mse_loss(stage(torch.cat(seen)), y).item()
    if cache_loss:
        return stage.__dict__.setdefault("_loss", float(loss))
    return loss


@pytest.mark.parametrize("kw", [dict(extra_no_grad=True), dict(width="model"),
                                dict(loss_as="tensor", barrier=True),
                                dict(zero="always", loss_as="tensor", width="model")])
def test_more_right_two_stage_steps_pass(kw):
    ch07.check_two_stage_step(functools.partial(step_with, **kw))


MORE_WRONG_STEPS = {  # name: (switches, words its failure must contain)
    "divides by the rows, not the elements": (dict(loss_div="rows"),
                                             ("stage 1's gradients",)),
    "zeroes the gradients only once": (dict(zero="once"), ("added to the first",)),
    "one receive buffer for every micro-batch": (dict(one_buffer=True),
                                                 ("new buffer of its own",)),
    "mean weighed as equal micro-batches": (dict(equal_rows=True),
                                            ("stage 1's gradients",)),
    "returns the first step's loss again": (dict(cache_loss=True),
                                            ("first step's loss", "no state")),
    "gradients sent back in reverse order": (dict(grads_reversed_on_1=True),
                                             ("order",)),
    "hard-coded width 7": (dict(width="seven"), ("width",)),
}


@pytest.mark.parametrize("name", list(MORE_WRONG_STEPS))
def test_more_wrong_two_stage_steps_fail(name):
    kw, words = MORE_WRONG_STEPS[name]
    fails(ch07.check_two_stage_step, functools.partial(step_with, **kw), *words)


def test_receive_waited_twice_fails_by_timeout(monkeypatch):
    fails(ch07.check_two_stage_step, functools.partial(step_with, wait_twice=True),
          "both ranks to finish", "once")


# 7.2


def one_f_one_b_slots(p, m):  # a stage runs a forward while it holds fewer than p - s
    out = []
    for s in range(p):
        fwd, bwd, ops = list(range(m)), list(range(m)), []
        while fwd or bwd:
            if fwd and len(ops) - 2 * (m - len(bwd)) < p - s:
                ops.append(["F", fwd.pop(0)])
            else:
                ops.append(["B", bwd.pop(0)])
        out.append(ops)
    return tuple(out)


def one_f_one_b_numpy(p, m):  # numpy micro-batch numbers, stages as a generator
    import numpy as np
    for ops in one_f_one_b_ref(p, m):
        yield iter([(k, np.int64(i)) for k, i in ops])


@pytest.mark.parametrize("fn", [one_f_one_b_slots, one_f_one_b_numpy])
def test_more_right_one_f_one_b_pass(fn):
    ch07.check_one_f_one_b(fn)


def test_more_wrong_one_f_one_b_fail(monkeypatch):
    monkeypatch.setattr(ch07, "_call_limit", lambda ex: 2.0)
    known = [(2, 4), (3, 5), (4, 8), (3, 3), (4, 2), (1, 3), (5, 7), (2, 1), (6, 1),
             (8, 3), (6, 13)]

    def table(p, m):  # right for the cases it has seen, GPipe elsewhere
        if (p, m) in known:
            return one_f_one_b_ref(p, m)
        return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)]
                for _ in range(p)]

    def forward_first(p, m):  # after the warm-up, F before B: one too many held
        order = []
        for s in range(p):
            warm = min(p - s, m)
            ops, f = [("F", i) for i in range(warm)], warm
            for b in range(m):
                if f < m:
                    ops.append(("F", f))
                    f += 1
                ops.append(("B", b))
            order.append(ops)
        return order

    def warmup_without_min(p, m):  # p - s forwards even when m is smaller
        order = []
        for s in range(p):
            ops, f = [("F", i) for i in range(p - s)], p - s
            for b in range(m):
                ops.append(("B", b))
                if f < m:
                    ops.append(("F", f))
                    f += 1
            order.append(ops)
        return order

    def endless_stages(p, m):  # every stage an endless iterator
        return [itertools.cycle([("F", 0)]) for _ in range(p)]

    def endless_lists(p, m):  # endless stage lists
        return itertools.repeat([("F", 0), ("B", 0)])

    def three_stages(p, m):  # the world size of the real run, hard-coded
        return one_f_one_b_ref(3, m)

    for _ in range(3):  # the drawn cases differ every time
        fails(ch07.check_one_f_one_b, table, "in flight")
    fails(ch07.check_one_f_one_b, forward_first, "in flight")
    fails(ch07.check_one_f_one_b, warmup_without_min, "once on stage")
    fails(ch07.check_one_f_one_b, endless_stages, "once on stage")
    fails(ch07.check_one_f_one_b, endless_lists, "more than")
    fails(ch07.check_one_f_one_b, three_stages, "stage lists")


# 7.3


def split_lru(costs, p):  # memoised recursion, stages as ranges in a tuple
    pre = list(itertools.accumulate(costs, initial=0.0))
    n = len(costs)

    @functools.lru_cache(None)
    def best(i, q):
        if q == 1:
            return pre[n] - pre[i], (n,)
        return min((max(pre[j] - pre[i], best(j, q - 1)[0]), (j, *best(j, q - 1)[1]))
                   for j in range(i + 1, n - q + 2))

    cuts = (0, *best(0, p)[1])
    return tuple(range(a, b) for a, b in itertools.pairwise(cuts))


def split_fractions(costs, p):  # exact arithmetic on Fractions
    from fractions import Fraction
    return split_lru([Fraction(c) for c in costs], p)


class NumpySplitter:  # every choice of cuts, numpy arrays of layer indices
    def __call__(self, costs, p):
        import numpy as np
        c, n, best = np.asarray(costs, dtype=np.float64), len(costs), None
        for cuts in itertools.combinations(range(1, n), p - 1):
            parts = np.split(np.arange(n), cuts)
            worst = max(c[q].sum() for q in parts)
            if best is None or worst < best[0]:
                best = (worst, parts)
        return best[1]


def split_generator(costs, p):  # a lazy answer, read to its end
    return (list(stage) for stage in split_lru(list(costs), p))


@pytest.mark.parametrize("fn", [split_lru, split_fractions, NumpySplitter(),
                                split_generator])
def test_more_right_splits_pass(fn):
    for _ in range(3):  # the drawn cases differ every time
        ch07.check_split_stages(fn)


def test_more_wrong_splits_fail(monkeypatch):
    monkeypatch.setattr(ch07, "_call_limit", lambda ex: 2.0)

    def every_split(costs, p, score):
        n, best = len(costs), None
        for cuts in itertools.combinations(range(1, n), p - 1):
            edges = [0, *cuts, n]
            sums = [sum(costs[a:b]) for a, b in itertools.pairwise(edges)]
            if best is None or score(sums) < best[0]:
                best = (score(sums), edges)
        return [list(range(a, b)) for a, b in itertools.pairwise(best[1])]

    def least_squares(costs, p):  # the least sum of squared stage costs
        return every_split(costs, p, lambda sums: sum(s * s for s in sums))

    def least_spread(costs, p):  # the least gap between the slowest and the fastest
        return every_split(costs, p, lambda sums: max(sums) - min(sums))

    def loose_bisection(costs, p):  # bisection over real limits, stopped at 1e-2
        def stages_for(limit):
            out, run = [[]], 0.0
            for i, c in enumerate(costs):
                if run + c > limit and out[-1]:
                    out.append([])
                    run = 0.0
                out[-1].append(i)
                run += c
            return out
        lo, hi = max(costs), sum(costs)
        while hi - lo > 1e-2:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if len(stages_for(mid)) <= p else (mid, hi)
        stages = stages_for(hi)
        while len(stages) < p:
            k = max(range(len(stages)), key=lambda j: len(stages[j]))
            stages[k:k + 1] = [stages[k][:1], stages[k][1:]]
        return stages

    def prefix_cuts(costs, p):  # layer i goes to stage prefix / (total / p)
        total, stages, run = sum(costs), [[] for _ in range(p)], 0.0
        for i, c in enumerate(costs):
            stages[min(p - 1, int(run / (total / p)))].append(i)
            run += c
        return stages

    def halving(costs, p):  # the best single cut, then each half again
        def go(lo, hi, q):
            if q == 1:
                return [list(range(lo, hi))]
            a, b = q // 2, q - q // 2
            cut = min(range(lo + a, hi - b + 1), key=lambda c: abs(
                sum(costs[lo:c]) / a - sum(costs[c:hi]) / b))
            return go(lo, cut, a) + go(cut, hi, b)
        return go(0, len(costs), p)

    remembered = {}

    def first_answer_kept(costs, p):  # answers every call with the first answer
        return remembered.setdefault("first", split_lru(list(costs), p))

    def endless_stages(costs, p):
        return itertools.repeat([0])

    fails(ch07.check_split_stages, least_squares, "slowest stage costing 11")
    fails(ch07.check_split_stages, least_spread, "slowest stage costing 13")
    fails(ch07.check_split_stages, loose_bisection, "slowest stage costing 1.504")
    fails(ch07.check_split_stages, prefix_cuts, "no empty stage")
    fails(ch07.check_split_stages, halving, "slowest stage costing")
    fails(ch07.check_split_stages, first_answer_kept, "no state")
    fails(ch07.check_split_stages, endless_stages, "more than")


def test_an_order_from_the_chapters_policy_is_refused(monkeypatch):
    import sys

    def one_f_one_b_policy(op, rank, done, p, m, v):  # the chapter's, in __main__
        return True

    monkeypatch.setattr(sys.modules["__main__"], "one_f_one_b_policy",
                        one_f_one_b_policy, raising=False)

    def through_the_chapter(p, m):
        one_f_one_b_policy(None, 0, set(), p, m, 1)
        return one_f_one_b_slots(p, m)

    fails(ch07.check_one_f_one_b, through_the_chapter, "write yourself",
          "one_f_one_b_policy")
    ch07.check_one_f_one_b(one_f_one_b_slots)  # the same order, written anew


def step_one_micro_batch_at_a_time(stage, rank, x, y, m, hidden):
    """Right: each micro-batch's forward, then at once its backward (no list kept)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    for p in stage.parameters():
        p.grad = None
    total = 0.0
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        if rank == 0:
            h = stage(xi)
            dist.send(h.detach(), 1)
            g = torch.empty_like(h)
            dist.recv(g, 1)
            h.backward(g)
        else:
            h = torch.empty(len(yi), hidden, dtype=x.dtype)
            dist.recv(h, 0)
            out = stage(h.requires_grad_())
            part = F.mse_loss(out, yi, reduction="sum") / y.numel()
            part.backward()
            dist.send(h.grad, 0)
            total += part.item()
    return total if rank == 1 else None


def step_recomputed_on_rank_0(stage, rank, x, y, m, hidden):
    """Right: stage 0 sends from forwards without a graph, and recomputes each
    one with a graph when its gradient arrives."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    stage.zero_grad()
    if rank == 0:
        for xi in x.chunk(m):
            with torch.no_grad():
                dist.send(stage(xi), 1)
        for xi in x.chunk(m):
            g = torch.empty(len(xi), hidden, dtype=x.dtype)
            dist.recv(g, 1)
            stage(xi).backward(g)
        return None
    parts = []
    for yi in y.chunk(m):
        h = torch.empty(len(yi), hidden, dtype=x.dtype)
        dist.recv(h, 0)
        parts.append((h, F.mse_loss(stage(h.requires_grad_()), yi,
                                    reduction="sum") / y.numel()))
    for h, part in parts:
        part.backward()
        dist.send(h.grad, 0)
    return sum(part.item() for _, part in parts)


@pytest.mark.parametrize("fn", [step_one_micro_batch_at_a_time,
                                step_recomputed_on_rank_0])
def test_two_stage_steps_in_other_orders_pass(fn):
    ch07.check_two_stage_step(fn)


def test_loss_divided_by_the_rows_is_named():
    fails(ch07.check_two_stage_step, functools.partial(step_with, loss_div="rows"),
          "stage 1's gradients", "number of rows", "y.numel()")


def test_split_cached_on_the_list_id_fails():
    cache = {}

    def split_cached_by_id(costs, p):  # stale once the same list changes in place
        key = (id(costs), len(costs), p)
        if key not in cache:
            cache[key] = split_lru(costs, p)
        return cache[key]

    fails(ch07.check_split_stages, split_cached_by_id, "changed in place", "no state")
