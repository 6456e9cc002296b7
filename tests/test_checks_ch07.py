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
    "never zeroes the gradients": (gpipe_with(zero=False), ("zero_grad", "twice")),
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
    "loss kept across steps": (KeepsTotal(), ("again",)),
    "keeps a detached output": (gpipe_with(keep_detached=True), ("out.detach()",)),
}


@pytest.mark.parametrize("name", list(WRONG_STEPS))
def test_wrong_two_stage_steps_fail(name):
    fn, words = WRONG_STEPS[name]
    fails(ch07.check_two_stage_step, fn, *words)


def test_blocking_sends_in_1f1b_order_fail(monkeypatch):
    monkeypatch.setattr(ch07, "TIMEOUT_S", 15.0)  # it waits for ever: not 45 s
    fails(ch07.check_two_stage_step, one_f_one_b_blocking, "both ranks to finish",
          "blocking send")


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
    monkeypatch.setattr(ch07, "CALL_S", 2.0)

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
    fails(ch07.check_one_f_one_b, never_ends, "return within")
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
    monkeypatch.setattr(ch07, "CALL_S", 2.0)

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
    fails(ch07.check_split_stages, never_ends, "return within")
    fails(ch07.check_split_stages, placeholder, "placeholder")
