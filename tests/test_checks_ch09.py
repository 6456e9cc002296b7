"""Chapter 9's checkers: right answers written differently pass, and typical
mistakes fail with a message that names them."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_utils.checks import ch09
from course_utils.checks.ch09 import (
    check_fsdp_collectives,
    check_reshard_checkpoint,
    check_sharded_linear,
)
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    text = str(e.value)
    for w in words:
        assert w in text, text


# ------------------------------------------------------------------ 9.1


def pad(t, n):
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % n)])


def gather(shard, shape):
    full = shard.new_empty(shard.numel() * dist.get_world_size())
    dist.all_gather_single(full, shard)
    return full[:math.prod(shape)].view(shape)


def scatter_mean(grad, like):
    out = torch.empty_like(like)
    dist.reduce_scatter_single(out, pad(grad, dist.get_world_size()))
    return out / dist.get_world_size()


class Solution(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        return x @ gather(ws, ctx.shape).T + gather(bs, (out_f,))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        w = gather(ws, ctx.shape)
        return (g @ w, scatter_mean(g.T @ x, ws), scatter_mean(g.sum(0), bs),
                None, None)


class WithLists(torch.autograd.Function):
    """dist.all_gather / dist.reduce_scatter with lists, F.linear, ctx attributes."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        n = dist.get_world_size()
        ctx.x, ctx.ws, ctx.bs, ctx.dims = x, ws, bs, (out_f, in_f)
        pieces = [torch.empty_like(ws) for _ in range(n)]
        dist.all_gather(pieces, ws)
        w = torch.cat(pieces)[:out_f * in_f].view(out_f, in_f)
        pieces = [torch.empty_like(bs) for _ in range(n)]
        dist.all_gather(pieces, bs)
        return F.linear(x, w, torch.cat(pieces)[:out_f])

    @staticmethod
    def backward(ctx, g):
        n = dist.get_world_size()
        out_f, in_f = ctx.dims
        pieces = [torch.empty_like(ctx.ws) for _ in range(n)]
        dist.all_gather(pieces, ctx.ws)
        w = torch.cat(pieces)[:out_f * in_f].view(out_f, in_f)
        grads = []
        for full, shard in ((g.T @ ctx.x, ctx.ws), (g.sum(0), ctx.bs)):
            out = torch.empty_like(shard)
            dist.reduce_scatter(out, list(pad(full, n).chunk(n)))
            grads.append(out / n)
        return g @ w, grads[0], grads[1], None, None


class AllReduceThenSlice(torch.autograd.Function):
    """All-reduce the whole gradient, keep this rank's slice: more traffic, right."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        return torch.addmm(gather(bs, (out_f,)), x, gather(ws, ctx.shape).T)

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        n, r = dist.get_world_size(), dist.get_rank()
        out = []
        for full in (g.T @ x, g.sum(0)):
            full = pad(full, n)
            dist.all_reduce(full)
            out.append((full / n).chunk(n)[r])
        return g @ gather(ws, ctx.shape), out[0], out[1], None, None


class MatmulVariant(torch.autograd.Function):
    """torch.mm and torch.add, the gradients gathered in a loop over the shards."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.dims = out_f, in_f
        w = gather(ws, (out_f, in_f))
        return torch.add(torch.mm(x, w.t()), gather(bs, (out_f,)))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        w = gather(ws, ctx.dims)
        shards = [scatter_mean(full, shard)
                  for full, shard in ((torch.mm(g.t(), x), ws), (g.sum(dim=0), bs))]
        return (torch.mm(g, w), *shards, None, None)


class OldNames(torch.autograd.Function):
    """The deprecated names, and the mean taken before the reduce-scatter."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.of, ctx.inf = out_f, in_f
        n = dist.get_world_size()
        w = torch.empty(ws.numel() * n)
        dist.all_gather_into_tensor(w, ws)
        b = torch.empty(bs.numel() * n)
        dist.all_gather_into_tensor(b, bs)
        return x @ w[:out_f * in_f].reshape(out_f, in_f).t() + b[:out_f]

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        n = dist.get_world_size()
        w = torch.empty(ws.numel() * n)
        dist.all_gather_into_tensor(w, ws)
        w = w[:ctx.of * ctx.inf].reshape(ctx.of, ctx.inf)
        gw, gb = torch.empty_like(ws), torch.empty_like(bs)
        dist.reduce_scatter_tensor(gw, pad(torch.einsum("ro,ri->oi", g, x) / n, n))
        dist.reduce_scatter_tensor(gb, pad(g.sum(0) / n, n))
        return g @ w, gw, gb, None, None


RIGHT_LINEAR = [Solution, WithLists, AllReduceThenSlice, MatmulVariant, OldNames]


def _with_backward(body):
    """A ShardedLinear whose forward is the solution's and backward is `body`."""
    class Wrong(torch.autograd.Function):
        forward = staticmethod(Solution.forward)
        backward = staticmethod(body)
    return Wrong


def sums(ctx, g):
    x, ws, bs = ctx.saved_tensors
    n = dist.get_world_size()
    return (g @ gather(ws, ctx.shape), scatter_mean(g.T @ x, ws) * n,
            scatter_mean(g.sum(0), bs) * n, None, None)


def own_gradient(ctx, g):
    x, ws, bs = ctx.saved_tensors
    n, r = dist.get_world_size(), dist.get_rank()
    return (g @ gather(ws, ctx.shape), pad(g.T @ x, n).chunk(n)[r],
            pad(g.sum(0), n).chunk(n)[r], None, None)


def two_ranks_only(ctx, g):
    x, ws, bs = ctx.saved_tensors
    n = dist.get_world_size()
    return (g @ gather(ws, ctx.shape), scatter_mean(g.T @ x, ws) * n / 2,
            scatter_mean(g.sum(0), bs) * n / 2, None, None)


def unpadded(ctx, g):
    x, ws, bs = ctx.saved_tensors
    n = dist.get_world_size()
    out = []
    for full, shard in ((g.T @ x, ws), (g.sum(0), bs)):
        o = torch.empty_like(shard)
        dist.reduce_scatter_single(o, full.reshape(-1).contiguous())
        out.append(o / n)
    return g @ gather(ws, ctx.shape), out[0], out[1], None, None


def full_size(ctx, g):
    x, ws, bs = ctx.saved_tensors
    n = dist.get_world_size()
    gw, gb = g.T @ x, g.sum(0)
    dist.all_reduce(gw)
    dist.all_reduce(gb)
    return g @ gather(ws, ctx.shape), gw / n, gb / n, None, None


def no_input_gradient(ctx, g):
    x, ws, bs = ctx.saved_tensors
    return None, scatter_mean(g.T @ x, ws), scatter_mean(g.sum(0), bs), None, None


def mean_over_rows(ctx, g):
    x, ws, bs = ctx.saved_tensors
    return (g @ gather(ws, ctx.shape), scatter_mean(g.T @ x, ws),
            scatter_mean(g.mean(0), bs), None, None)


def swapped(ctx, g):
    x, ws, bs = ctx.saved_tensors
    return (g @ gather(ws, ctx.shape), scatter_mean(g.sum(0), bs),
            scatter_mean(g.T @ x, ws), None, None)


def double_mean(ctx, g):
    x, ws, bs = ctx.saved_tensors
    n = dist.get_world_size()
    return (g @ gather(ws, ctx.shape), scatter_mean(g.T @ x, ws) / n,
            scatter_mean(g.sum(0), bs) / n, None, None)


class KeepsWeight(torch.autograd.Function):
    """Saves the gathered weight for backward: ZeRO-3 without its saving."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        w = gather(ws, (out_f, in_f))
        ctx.save_for_backward(x, w, ws, bs)
        return x @ w.T + gather(bs, (out_f,))

    @staticmethod
    def backward(ctx, g):
        x, w, ws, bs = ctx.saved_tensors
        return g @ w, scatter_mean(g.T @ x, ws), scatter_mean(g.sum(0), bs), None, None


class StashesWeight(torch.autograd.Function):
    """Keeps the gathered weight as a ctx attribute, out of the hooks' sight."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.w = gather(ws, (out_f, in_f))
        return F.linear(x, ctx.w, gather(bs, (out_f,)))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        return (g @ ctx.w, scatter_mean(g.T @ x, ws), scatter_mean(g.sum(0), bs),
                None, None)


class NoGather(torch.autograd.Function):
    """Uses the rank's shard as if it were the weight."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        return x.sum(1, keepdim=True) * ws[:out_f].view(1, -1)[:, :1]

    @staticmethod
    def backward(ctx, g):
        return None, None, None, None, None


class Placeholder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        raise NotImplementedError("Exercise 9.1")

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError("Exercise 9.1")


WRONG_LINEAR = [  # (answer, words its message must contain)
    (_with_backward(sums), ["divide by the world size"]),
    (_with_backward(own_gradient), ["not averaged"]),
    (_with_backward(two_ranks_only), ["3 ranks", "not a fixed number"]),
    (_with_backward(unpadded), ["pad"]),
    (_with_backward(full_size), ["shard's shape"]),
    (_with_backward(no_input_gradient), ["gradient of x"]),
    (_with_backward(mean_over_rows), ["bias"]),
    (_with_backward(swapped), ["shard's shape"]),
    (_with_backward(double_mean), ["another number"]),
    (KeepsWeight, ["keep only x and the shards"]),
    (StashesWeight, ["keep only x and the shards"]),
    (NoGather, ["all-gather the full weight"]),
]


@pytest.fixture(scope="module")
def linear_runs():
    """Every answer of 9.1 run in one launch (a launch of 5 ranks per answer
    would take a minute); each check below judges its answer's results."""
    ch09.run_sharded_linear(RIGHT_LINEAR + [cls for cls, _ in WRONG_LINEAR])


@pytest.mark.parametrize("cls", RIGHT_LINEAR)
def test_right_sharded_linear_pass(cls, linear_runs):
    check_sharded_linear(cls)


@pytest.mark.parametrize("cls, words", WRONG_LINEAR,
                         ids=[getattr(c, "__name__", "") + str(i)
                              for i, (c, _) in enumerate(WRONG_LINEAR)])
def test_wrong_sharded_linear_fail(cls, words, linear_runs):
    fails(check_sharded_linear, cls, *words)


def test_sharded_linear_placeholder_fails_at_once():
    fails(check_sharded_linear, Placeholder, "placeholder")


def test_sharded_linear_alone_launches_its_own_run():
    fails(check_sharded_linear, _with_backward(sums), "divide by the world size")


# ------------------------------------------------------------------ 9.2


def reshard_solution(shards, shapes, m):
    new = [{} for _ in range(m)]
    for name in shards[0]:
        if name not in shapes:
            for d in new:
                d[name] = shards[0][name].clone()
            continue
        flat = torch.cat([s[name] for s in shards])[:math.prod(shapes[name])]
        for r, piece in enumerate(pad(flat, m).chunk(m)):
            new[r][name] = piece.clone()
    return new


def reshard_with_fpad(shards, shapes, new_world_size):
    out = [dict() for _ in range(new_world_size)]
    for key, first in shards[0].items():
        if key in shapes:
            n = math.prod(shapes[key])
            whole = torch.cat([s[key] for s in shards]).narrow(0, 0, n)
            size = -(-n // new_world_size)
            whole = F.pad(whole, (0, size * new_world_size - n))
            for r in range(new_world_size):
                out[r][key] = whole[r * size:(r + 1) * size].clone()
        else:
            for d in out:
                d[key] = first.detach().clone()
    return out


def reshard_by_split(shards, shapes, m):
    full = {k: torch.cat([s[k] for s in shards]) for k in shapes}
    result = []
    for r in range(m):
        d = {k: v.clone() for k, v in shards[0].items() if k not in shapes}
        for k, v in full.items():
            n = math.prod(shapes[k])
            size = math.ceil(n / m)
            piece = v[:n][r * size:(r + 1) * size]
            d[k] = torch.cat([piece, piece.new_zeros(size - piece.numel())])
        result.append(d)
    return result


class Resharder:
    def __call__(self, shards, shapes, new_world_size):
        return [self.rank(shards, shapes, new_world_size, r)
                for r in range(new_world_size)]

    @staticmethod
    def rank(shards, shapes, m, r):
        d = {}
        for k in shards[0]:
            if k not in shapes:
                d[k] = shards[0][k].clone()
                continue
            n = math.prod(shapes[k])
            flat = torch.zeros(math.ceil(n / m) * m, dtype=shards[0][k].dtype)
            flat[:n] = torch.cat([s[k] for s in shards])[:n]
            d[k] = flat.view(m, -1)[r].clone()
        return d


def reshard_numpy_free_loop(shards, shapes, m):
    out = [{} for _ in range(m)]
    for k in shards[0]:
        if k not in shapes:
            for d in out:
                d[k] = shards[0][k].clone()
            continue
        values = [v for s in shards for v in s[k]][:math.prod(shapes[k])]
        size = math.ceil(len(values) / m)
        for r in range(m):
            part = values[r * size:(r + 1) * size]
            t = torch.zeros(size, dtype=shards[0][k].dtype)
            if part:
                t[:len(part)] = torch.stack(part)
            out[r][k] = t
    return out


@pytest.mark.parametrize("fn", [reshard_solution, reshard_with_fpad, reshard_by_split,
                                Resharder(), reshard_numpy_free_loop])
def test_right_reshard_pass(fn):
    check_reshard_checkpoint(fn)


def test_wrong_reshard_fail():
    def placeholder(shards, shapes, m):
        raise NotImplementedError("Exercise 9.2")

    def keeps_old_padding(shards, shapes, m):
        new = [{} for _ in range(m)]
        for k in shards[0]:
            flat = torch.cat([s[k] for s in shards]) if k in shapes else None
            for r in range(m):
                new[r][k] = shards[0][k].clone() if flat is None else \
                    pad(flat, m).chunk(m)[r].clone()
        return new

    def chunk_unpadded(shards, shapes, m):
        new = [{} for _ in range(m)]
        for k in shards[0]:
            if k not in shapes:
                for d in new:
                    d[k] = shards[0][k].clone()
                continue
            flat = torch.cat([s[k] for s in shards])[:math.prod(shapes[k])]
            for r, piece in enumerate(flat.chunk(m)):
                new[r][k] = piece.clone()
        for d in new:  # chunk may make fewer pieces than ranks
            for k in shapes:
                d.setdefault(k, shards[0][k][:0].clone())
        return new

    def old_world_size(shards, shapes, m):
        return reshard_solution(shards, shapes, len(shards))

    def drops_step(shards, shapes, m):
        return [{k: v for k, v in d.items() if k in shapes}
                for d in reshard_solution(shards, shapes, m)]

    def all_float32(shards, shapes, m):
        return [{k: v.float() for k, v in d.items()}
                for d in reshard_solution(shards, shapes, m)]

    def mutates_input(shards, shapes, m):
        out = reshard_solution(shards, shapes, m)
        for s in shards:
            for k in shapes:
                s[k].zero_()
        return out

    def step_as_number(shards, shapes, m):
        out = reshard_solution(shards, shapes, m)
        for d in out:
            d["step"] = float(d["step"])
        return out

    def ranks_reversed(shards, shapes, m):
        return reshard_solution(shards, shapes, m)[::-1]

    def old_slice_size(shards, shapes, m):
        new = [{} for _ in range(m)]
        for k in shards[0]:
            if k not in shapes:
                for d in new:
                    d[k] = shards[0][k].clone()
                continue
            size = shards[0][k].numel()
            flat = pad(torch.cat([s[k] for s in shards]), m * size)
            for r in range(m):
                new[r][k] = flat[r * size:(r + 1) * size].clone()
        return new

    def padded_with_ones(shards, shapes, m):
        out = reshard_solution(shards, shapes, m)
        for k in shapes:
            n = math.prod(shapes[k])
            size = out[0][k].numel()
            if size * m > n:
                out[-1][k][n - size * (m - 1):] = 1
        return out

    def one_dict(shards, shapes, m):
        return reshard_solution(shards, shapes, m)[0]

    fails(check_reshard_checkpoint, placeholder, "placeholder")
    fails(check_reshard_checkpoint, keeps_old_padding, "old padding")
    fails(check_reshard_checkpoint, chunk_unpadded, "torch.chunk")
    fails(check_reshard_checkpoint, old_world_size, "new_world_size")
    fails(check_reshard_checkpoint, drops_step, "'step'")
    fails(check_reshard_checkpoint, all_float32, "dtype")
    fails(check_reshard_checkpoint, mutates_input, "left as they were")
    fails(check_reshard_checkpoint, step_as_number, "as a tensor")
    fails(check_reshard_checkpoint, ranks_reversed, "rank r gets elements")
    fails(check_reshard_checkpoint, old_slice_size, "Exercise 9.2")
    fails(check_reshard_checkpoint, padded_with_ones, "rank r gets elements")
    fails(check_reshard_checkpoint, one_dict, "one per new rank")


# ------------------------------------------------------------------ 9.3


def predict_solution(blocks, root_params, reshard):
    units = blocks + (1 if root_params else 0)
    again = blocks if reshard is None else (units if reshard else 0)
    return units + again, units


def predict_table(blocks, root_params, reshard):
    forward = blocks + int(root_params)
    backward = {True: forward, False: 0, None: blocks}[reshard]
    return [forward + backward, forward]


class Predictor:
    def __call__(self, blocks, root_params, reshard_after_forward):
        gathers = 0
        for unit in range(blocks + bool(root_params)):
            is_root = unit == blocks
            gathers += 1
            if reshard_after_forward or (reshard_after_forward is None and
                                         not is_root):
                gathers += 1
        return gathers, blocks + bool(root_params)


def predict_numpy(blocks, root_params, reshard):
    units = np.int64(blocks + root_params)
    extra = np.int64(blocks) if reshard is None else units * int(bool(reshard))
    return (units + extra, units)


def predict_dict_keys(blocks, root_params, reshard):
    again = {"blocks": blocks if reshard in (True, None) else 0,
             "root": int(root_params and reshard is True)}
    units = blocks + int(root_params)
    return tuple(int(v) for v in (units + sum(again.values()), units))


@pytest.mark.parametrize("fn", [predict_solution, predict_table, Predictor(),
                                predict_numpy, predict_dict_keys])
def test_right_collectives_pass(fn):
    check_fsdp_collectives(fn)


def test_wrong_collectives_fail():
    def placeholder(*args):
        raise NotImplementedError("Exercise 9.3")

    def always_twice(blocks, root_params, reshard):
        units = blocks + root_params
        return 2 * units, units

    def ignores_reshard(blocks, root_params, reshard):
        units = blocks + root_params
        return units, units

    def none_as_false(blocks, root_params, reshard):
        return predict_solution(blocks, root_params, bool(reshard))

    def none_as_true(blocks, root_params, reshard):
        return predict_solution(blocks, root_params, reshard is not False)

    def forgets_root_reduce(blocks, root_params, reshard):
        return predict_solution(blocks, root_params, reshard)[0], blocks

    def reduce_twice(blocks, root_params, reshard):
        ag, rs = predict_solution(blocks, root_params, reshard)
        return ag, 2 * rs

    def root_never_gathered(blocks, root_params, reshard):
        return predict_solution(blocks, False, reshard)[0], blocks + root_params

    def swapped_pair(blocks, root_params, reshard):
        return predict_solution(blocks, root_params, reshard)[::-1]

    def a_word(blocks, root_params, reshard):
        return "eight and four"

    def one_number(blocks, root_params, reshard):
        return sum(predict_solution(blocks, root_params, reshard))

    def root_not_regathered_when_true(blocks, root_params, reshard):
        units = blocks + root_params
        return units + (blocks if reshard in (True, None) else 0), units

    fails(check_fsdp_collectives, placeholder, "placeholder")
    fails(check_fsdp_collectives, always_twice, "nothing is freed")
    fails(check_fsdp_collectives, ignores_reshard, "freed after forward")
    fails(check_fsdp_collectives, none_as_false, "left out")
    fails(check_fsdp_collectives, none_as_true, "left out")
    fails(check_fsdp_collectives, forgets_root_reduce, "the root counts")
    fails(check_fsdp_collectives, reduce_twice, "reduce-scatter")
    fails(check_fsdp_collectives, root_never_gathered, "Exercise 9.3")
    fails(check_fsdp_collectives, swapped_pair, "Exercise 9.3")
    fails(check_fsdp_collectives, a_word, "a pair")
    fails(check_fsdp_collectives, one_number, "a pair")
    fails(check_fsdp_collectives, root_not_regathered_when_true, "the root too")


def test_measured_collectives_are_cached():
    first = ch09.measured_collectives()
    assert ch09.measured_collectives() is first
    assert first[(3, False, True)] == (6, 3)
