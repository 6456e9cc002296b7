"""Chapter 9's checkers: right answers written differently pass, and typical
mistakes fail with a message that names them."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_utils.checks import ch09
from course_utils.checks.ch09 import (
    check_clip_sharded,
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
        w = ws.new_empty(ws.numel() * n)
        dist.all_gather_into_tensor(w, ws)
        b = bs.new_empty(bs.numel() * n)
        dist.all_gather_into_tensor(b, bs)
        return x @ w[:out_f * in_f].reshape(out_f, in_f).t() + b[:out_f]

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        n = dist.get_world_size()
        w = torch.empty(ws.numel() * n, dtype=ws.dtype)
        dist.all_gather_into_tensor(w, ws)
        w = w[:ctx.of * ctx.inf].reshape(ctx.of, ctx.inf)
        gw, gb = torch.empty_like(ws), torch.empty_like(bs)
        dist.reduce_scatter_tensor(gw, pad(torch.einsum("ro,ri->oi", g, x) / n, n))
        dist.reduce_scatter_tensor(gb, pad(g.sum(0) / n, n))
        return g @ w, gw, gb, None, None


class InFloat64(torch.autograd.Function):
    """Computes in float64 and casts back to the input's dtype."""
    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        w, b = gather(ws, ctx.shape).double(), gather(bs, (out_f,)).double()
        return (x.double() @ w.T + b).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        w, g64 = gather(ws, ctx.shape).double(), g.double()
        grad_w = (g64.T @ x.double()).to(ws.dtype)
        return ((g64 @ w).to(x.dtype), scatter_mean(grad_w, ws),
                scatter_mean(g64.sum(0).to(bs.dtype), bs), None, None)


class GatherIntoList(torch.autograd.Function):
    """dist.all_gather into a list and torch.addmm; the padding cut after cat."""
    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        n = dist.get_world_size()
        whole = []
        for shard, numel in ((ws, out_f * in_f), (bs, out_f)):
            parts = [torch.empty_like(shard) for _ in range(n)]
            dist.all_gather(parts, shard)
            whole.append(torch.cat(parts)[:numel])
        return torch.addmm(whole[1], x, whole[0].view(out_f, in_f).T)

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        return (torch.mm(g, gather(ws, ctx.shape)), scatter_mean(torch.mm(g.T, x), ws),
                scatter_mean(g.sum(dim=0), bs), None, None)


RIGHT_LINEAR = [Solution, WithLists, AllReduceThenSlice, MatmulVariant, OldNames,
                InFloat64, GatherIntoList]


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


def divides_grad_out(ctx, g):
    """Averages by dividing grad_out in place: another branch may share it."""
    x, ws, bs = ctx.saved_tensors
    n = dist.get_world_size()
    grad_x = g @ gather(ws, ctx.shape)
    g.div_(n)
    out = []
    for full, shard in ((g.T @ x, ws), (g.sum(0), bs)):
        o = torch.empty_like(shard)
        dist.reduce_scatter_single(o, pad(full, n))
        out.append(o)
    return grad_x, out[0], out[1], None, None


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


def gather_float32(shard, shape):
    full = torch.empty(shard.numel() * dist.get_world_size())  # float32 only
    dist.all_gather_single(full, shard)
    return full[:math.prod(shape)].view(shape)


class Float32Only(torch.autograd.Function):
    """Buffers made with torch.empty's default dtype: right for float32 only."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        return x @ gather_float32(ws, ctx.shape).T + gather_float32(bs, (out_f,))

    backward = staticmethod(Solution.backward)


class CachesWeight(torch.autograd.Function):
    """Gathers a shape's weight once and keeps it for every later call."""

    cache: dict = {}

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        key = (out_f, in_f, x.dtype)
        if key not in CachesWeight.cache:
            CachesWeight.cache[key] = (gather(ws, ctx.shape), gather(bs, (out_f,)))
        w, b = CachesWeight.cache[key]
        return x @ w.T + b

    backward = staticmethod(Solution.backward)


class SavesOutput(torch.autograd.Function):
    """Keeps the output for backward, which needs only x and the shards."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.shape = (out_f, in_f)
        y = x @ gather(ws, ctx.shape).T + gather(bs, (out_f,))
        ctx.save_for_backward(x, ws, bs, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, ws, bs, _ = ctx.saved_tensors
        return (g @ gather(ws, ctx.shape), scatter_mean(g.T @ x, ws),
                scatter_mean(g.sum(0), bs), None, None)


class KeepsSmallWeights(torch.autograd.Function):
    """Keeps the gathered weight when it is small (under 100 elements)."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        w = gather(ws, (out_f, in_f))
        ctx.shape = (out_f, in_f)
        ctx.w = w if w.numel() < 100 else None
        ctx.save_for_backward(x, ws, bs)
        return x @ w.T + gather(bs, (out_f,))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        w = ctx.w if ctx.w is not None else gather(ws, ctx.shape)
        return g @ w, scatter_mean(g.T @ x, ws), scatter_mean(g.sum(0), bs), None, None


class NoBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        return x @ gather(ws, ctx.shape).T

    backward = staticmethod(Solution.backward)


class BiasTwice(torch.autograd.Function):
    """The right shape, wrong values: the hint must say where, not the shape."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        b = gather(bs, (out_f,))
        return x @ gather(ws, ctx.shape).T + 2 * b

    backward = staticmethod(Solution.backward)


class IntoTheShards(torch.autograd.Function):
    """Reduce-scatters the gradients into the parameter shards themselves."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        ctx.shape = (out_f, in_f)
        return x @ gather(ws, ctx.shape).T + gather(bs, (out_f,))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        w, n = gather(ws, ctx.shape), dist.get_world_size()
        dist.reduce_scatter_single(ws, pad(g.T @ x, n))
        dist.reduce_scatter_single(bs, pad(g.sum(0), n))
        return g @ w, ws / n, bs / n, None, None


STASH: dict = {}


class StashesWeightGlobally(torch.autograd.Function):
    """Keeps the gathered weight in a module-level dict, out of ctx's sight."""

    @staticmethod
    def forward(ctx, x, ws, bs, out_f, in_f):
        ctx.save_for_backward(x, ws, bs)
        w = gather(ws, (out_f, in_f))
        STASH[id(ctx)] = w
        return F.linear(x, w, gather(bs, (out_f,)))

    @staticmethod
    def backward(ctx, g):
        x, ws, bs = ctx.saved_tensors
        return (g @ STASH.pop(id(ctx)), scatter_mean(g.T @ x, ws),
                scatter_mean(g.sum(0), bs), None, None)


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
    (_with_backward(divides_grad_out), ["changed grad_out", "another branch"]),
    (KeepsWeight, ["keep only x and the shards"]),
    (StashesWeight, ["keep only x and the shards"]),
    (NoGather, ["all-gather the full weight"]),
    (Float32Only, ["float64", "dtype"]),
    (CachesWeight, ["an earlier call's weight"]),
    (SavesOutput, ["the output", "keep only x and the shards"]),
    (KeepsSmallWeights, ["the gathered weight", "(5, 3)"]),
    (NoBias, ["the bias is missing"]),
    (BiasTwice, ["instead of"]),
    (IntoTheShards, ["inputs left as they were", "the weight shard"]),
    (StashesWeightGlobally, ["the gathered weight (outside ctx)",
                             "keep only x and the shards"]),
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


def test_a_wrong_value_of_the_right_shape_is_not_reported_as_a_shape():
    ch09.run_sharded_linear([BiasTwice])
    with pytest.raises(ExerciseFailed) as e:
        check_sharded_linear(BiasTwice)
    assert "shape (" not in str(e.value)


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

    def pops_step(shards, shapes, m):
        steps = [s.pop("step") for s in shards]  # the saved checkpoint loses it
        out = reshard_solution(shards, shapes, m)
        for d in out:
            d["step"] = steps[0].clone()
        return out

    def last_element_off(shards, shapes, m):  # differs only deep in the slice
        out = reshard_solution(shards, shapes, m)
        w = out[0]["w"]
        w[w.numel() - 1] += 1
        return out

    def step_by_name(shards, shapes, m):
        new = [{} for _ in range(m)]
        for name in shards[0]:
            if name == "step":
                for d in new:
                    d[name] = shards[0][name].clone()
                continue
            flat = torch.cat([s[name] for s in shards])[:math.prod(shapes[name])]
            for r, piece in enumerate(pad(flat, m).chunk(m)):
                new[r][name] = piece.clone()
        return new

    def strips_zeros(shards, shapes, m):  # the padding found as trailing zeros
        new = [{} for _ in range(m)]
        for name in shards[0]:
            if name not in shapes:
                for d in new:
                    d[name] = shards[0][name].clone()
                continue
            flat = torch.cat([s[name] for s in shards])
            flat = flat[:int(flat.nonzero().max()) + 1]
            for r, piece in enumerate(pad(flat, m).chunk(m)):
                new[r][name] = piece.clone()
        return new

    cache = {}

    def cached_by_world_sizes(shards, shapes, m):  # same sizes, same answer
        if (len(shards), m) not in cache:
            cache[len(shards), m] = reshard_solution(shards, shapes, m)
        return cache[len(shards), m]

    fails(check_reshard_checkpoint, placeholder, "placeholder")
    fails(check_reshard_checkpoint, cached_by_world_sizes, "2 ranks -> 3 ranks",
          "an earlier call")
    fails(check_reshard_checkpoint, step_by_name, "'betas'", "replicated")
    fails(check_reshard_checkpoint, strips_zeros, "zeros at the tensor's end")
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
    fails(check_reshard_checkpoint, pops_step, "lost ['step']")
    fails(check_reshard_checkpoint, last_element_off, "instead of")
    with pytest.raises(ExerciseFailed) as e:  # where the values differ, not
        check_reshard_checkpoint(last_element_off)  # two identical prefixes
    assert "seen:     at 8: " in str(e.value)


# ------------------------------------------------------------------ 9.3


def clip_solution(grad_shards, max_norm):
    squares = torch.stack([g.double().pow(2).sum() for g in grad_shards]).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def clip_vector_norm(grad_shards, max_norm):
    local = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grad_shards]))
    squared = local.double() ** 2
    dist.all_reduce(squared, op=dist.ReduceOp.SUM)
    total = squared.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grad_shards:
        g.mul_(coef.to(g.dtype))
    return total  # a tensor is a number too


def clip_python_floats(grad_shards, max_norm):
    local = sum(float((g.double() ** 2).sum()) for g in grad_shards)
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t)
    norm = math.sqrt(t.item())
    if norm > max_norm:
        for g in grad_shards:
            g *= max_norm / (norm + 1e-6)
    return norm


class ClipByGather:
    """all_gather of every rank's sum of squares, then the sum."""

    def __call__(self, grad_shards, max_norm):
        mine = sum((g.double().square().sum() for g in grad_shards),
                   torch.zeros((), dtype=torch.float64)).reshape(1)
        every = [torch.zeros(1, dtype=torch.float64)
                 for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        norm = float(torch.cat(every).sum().sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            torch._foreach_mul_(list(grad_shards), scale)
        return norm


def clip_get_total_norm(grad_shards, max_norm):
    local = torch.nn.utils.get_total_norm(grad_shards).double()
    sq = local * local
    dist.all_reduce(sq)
    norm = sq.sqrt()
    factor = min(1.0, max_norm / (norm.item() + 1e-6))
    for g in grad_shards:
        g.mul_(factor)
    return norm.item()


RIGHT_CLIP = [clip_solution, clip_vector_norm, clip_python_floats, ClipByGather(),
              clip_get_total_norm]


def _local_squares(grad_shards):
    return torch.stack([g.double().pow(2).sum() for g in grad_shards]).sum()


def clip_local_only(grad_shards, max_norm):
    norm = _local_squares(grad_shards).sqrt().item()
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def clip_sum_of_norms(grad_shards, max_norm):
    norm = _local_squares(grad_shards).sqrt()
    dist.all_reduce(norm)
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))
    return norm.item()


def clip_no_sqrt(grad_shards, max_norm):
    sq = _local_squares(grad_shards)
    dist.all_reduce(sq)
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (sq.item() + 1e-6)))
    return sq.item()


def clip_mean_over_ranks(grad_shards, max_norm):
    sq = _local_squares(grad_shards)
    dist.all_reduce(sq)
    norm = (sq / dist.get_world_size()).sqrt().item()
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def clip_largest_rank(grad_shards, max_norm):
    norm = _local_squares(grad_shards).sqrt()
    dist.all_reduce(norm, op=dist.ReduceOp.MAX)
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))
    return norm.item()


def clip_always(grad_shards, max_norm):
    sq = _local_squares(grad_shards)
    dist.all_reduce(sq)
    norm = sq.sqrt().item()
    for g in grad_shards:
        g.mul_(max_norm / (norm + 1e-6))
    return norm


def clip_inverted(grad_shards, max_norm):
    sq = _local_squares(grad_shards)
    dist.all_reduce(sq)
    norm = sq.sqrt().item()
    if norm > max_norm:
        for g in grad_shards:
            g.mul_(norm / max_norm)
    return norm


def clip_new_tensors(grad_shards, max_norm):
    norm = clip_solution([g.clone() for g in grad_shards], max_norm)
    grad_shards[:] = [g * min(1.0, max_norm / (norm + 1e-6)) for g in grad_shards]
    return norm


def clip_never_scales(grad_shards, max_norm):
    return clip_solution([g.clone() for g in grad_shards], max_norm)


def clip_float32(grad_shards, max_norm):
    sq = torch.stack([g.float().pow(2).sum() for g in grad_shards]).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt().item()
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


class ClipCached:
    """Computes the norm once per list of shapes and keeps it."""

    def __init__(self):
        self.norms = {}

    def __call__(self, grad_shards, max_norm):
        key = tuple((tuple(g.shape), g.dtype) for g in grad_shards)
        if key not in self.norms:
            self.norms[key] = clip_solution([g.clone() for g in grad_shards], max_norm)
        norm = self.norms[key]
        for g in grad_shards:
            g.mul_(min(1.0, max_norm / (norm + 1e-6)))
        return norm


def clip_rank0_scales(grad_shards, max_norm):
    norm = clip_solution([g.clone() for g in grad_shards], max_norm)
    if dist.get_rank() == 0:
        for g in grad_shards:
            g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def clip_rank0_reduces(grad_shards, max_norm):
    sq = _local_squares(grad_shards)
    if dist.get_rank() == 0:  # the others never join: a hang
        dist.all_reduce(sq)
    return sq.sqrt().item()


def clip_a_list(grad_shards, max_norm):
    clip_solution(grad_shards, max_norm)
    return [g.norm().item() for g in grad_shards]


def clip_by_one(grad_shards, max_norm):  # 1.0 written where max_norm belongs
    squares = torch.stack([g.double().pow(2).sum() for g in grad_shards]).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    for g in grad_shards:
        g.mul_(min(1.0, 1.0 / (norm + 1e-6)))
    return norm


def clip_above_one(grad_shards, max_norm):  # clips whenever the norm exceeds 1
    squares = torch.stack([g.double().pow(2).sum() for g in grad_shards]).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    if norm > 1:
        for g in grad_shards:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


WRONG_CLIP = [  # (answer, words its message must contain)
    (clip_by_one, ["max_norm 2.5", "never with 1"]),
    (clip_above_one, ["max_norm 5.0", "never with 1"]),
    (clip_local_only, ["this rank's slices only"]),
    (clip_sum_of_norms, ["norms do not add"]),
    (clip_no_sqrt, ["square root is missing"]),
    (clip_mean_over_ranks, ["not a mean"]),
    (clip_largest_rank, ["largest rank's norm"]),
    (clip_always, ["below max_norm", "leave the gradients"]),
    (clip_inverted, ["inverted"]),
    (clip_new_tensors, ["in place"]),
    (clip_never_scales, ["unchanged"]),
    (clip_float32, ["float64"]),
    (ClipCached(), ["an earlier call"]),
    (clip_rank0_scales, ["rank 1", "unchanged"]),
    (clip_rank0_reduces, ["Exercise 9.3"]),
    (clip_a_list, ["as a number"]),
]


@pytest.fixture(scope="module")
def clip_runs():
    """Every answer of 9.3 run in one launch; each test judges its own."""
    ch09.run_clip(RIGHT_CLIP + [fn for fn, _ in WRONG_CLIP])


@pytest.mark.parametrize("fn", RIGHT_CLIP)
def test_right_clip_pass(fn, clip_runs):
    check_clip_sharded(fn)


@pytest.mark.parametrize("fn, words", WRONG_CLIP,
                         ids=[getattr(f, "__name__", type(f).__name__)
                              for f, _ in WRONG_CLIP])
def test_wrong_clip_fail(fn, words, clip_runs):
    fails(check_clip_sharded, fn, *words)


def test_clip_placeholder_fails_at_once():
    def placeholder(grad_shards, max_norm):
        raise NotImplementedError("Exercise 9.3")

    fails(check_clip_sharded, placeholder, "placeholder")


def test_reshard_that_never_returns_is_stopped(monkeypatch):
    monkeypatch.setattr(ch09, "answer_limit", lambda *a, **k: 1.0)

    def reshard_endless(shards, shapes, m):  # a loop whose condition never changes
        rank = 0
        while rank < m:
            pass

    fails(ch09.check_reshard_checkpoint, reshard_endless, "did not return")
