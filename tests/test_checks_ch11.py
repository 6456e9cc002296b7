"""Chapter 11's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course_utils.checks import ch11
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    for w in words:
        assert w in str(e.value), str(e.value)


# ---------------------------------------------------------------- 11.1


def _partial(q, k, v, mask):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def online_softmax(q, k, v, block, causal=False):  # flash style: running max
    s, scale = k.shape[2], q.shape[-1] ** -0.5
    m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)
    total = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    pos = torch.arange(q.shape[2])[:, None]
    for a in range(0, s, block):
        b = min(a + block, s)
        sc = torch.einsum("bhqd,bhkd->bhqk", q, k[:, :, a:b]) * scale
        if causal:
            sc = sc.masked_fill(pos < torch.arange(a, b)[None, :], float("-inf"))
        m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - safe)
        shrink = torch.exp(m - safe)
        total = total * shrink + p.sum(-1, keepdim=True)
        acc = acc * shrink + p @ v[:, :, a:b]
        m = m_new
    return acc / total


def lse_with_where(q, k, v, block, causal=False):
    out, lse = torch.zeros_like(q), None
    for a in range(0, k.shape[2], block):
        b = min(a + block, k.shape[2])
        mask = (torch.arange(q.shape[2])[:, None] >= torch.arange(a, b)) if causal \
            else None
        o, l2 = _partial(q, k[:, :, a:b], v[:, :, a:b], mask)
        o = torch.where(torch.isnan(o), torch.zeros_like(o), o)
        if lse is None:
            out, lse = o, l2
            continue
        new = torch.logaddexp(lse, l2)
        out = out * torch.exp(lse - new) + o * torch.exp(l2 - new)
        lse = new
    return out


def reverse_blocks(q, k, v, block, causal=False):  # the merge does not care
    starts = list(range(0, k.shape[2], block))[::-1]
    out = torch.zeros_like(q)
    lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)
    for a in starts:
        b = min(a + block, k.shape[2])
        mask = (torch.arange(q.shape[2])[:, None] >= torch.arange(a, b)) if causal \
            else None
        o, l2 = _partial(q, k[:, :, a:b], v[:, :, a:b], mask)
        new = torch.logaddexp(lse, l2)
        w_old = torch.exp(lse - new).nan_to_num(0.0)
        w_new = torch.exp(l2 - new).nan_to_num(0.0)
        out = out * w_old + o.nan_to_num(0.0) * w_new
        lse = new
    return out


class TiledAttention:  # query blocks too, as a class
    def __call__(self, q, k, v, block, causal=False):
        rows = [online_softmax(q[:, :, i:i + block], k, v, block, False)
                if not causal else self._causal(q, k, v, block, i)
                for i in range(0, q.shape[2], block)]
        return torch.cat(rows, dim=2)

    @staticmethod
    def _causal(q, k, v, block, i):
        qi = q[:, :, i:i + block]
        stop = i + qi.shape[2]
        # keys after the last query of this tile are never visible
        out = torch.zeros_like(qi)
        lse = torch.full((*qi.shape[:-1], 1), float("-inf"), dtype=q.dtype)
        for a in range(0, stop, block):
            b = min(a + block, stop)
            mask = (torch.arange(i, stop)[:, None] >= torch.arange(a, b))
            o, l2 = _partial(qi, k[:, :, a:b], v[:, :, a:b], mask)
            new = torch.logaddexp(lse, l2)
            out = out * torch.exp(lse - new) + o.nan_to_num(0.0) * torch.exp(l2 - new)
            lse = new
        return out


def via_split(q, k, v, block, causal=False):  # tensor.split, masks by offsets
    out = torch.zeros_like(q)
    lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    offset = 0
    for kb, vb in zip(k.split(block, dim=2), v.split(block, dim=2), strict=True):
        n = kb.shape[2]
        mask = None
        if causal:
            mask = torch.arange(q.shape[2]).unsqueeze(1) - offset >= torch.arange(n)
        o, l2 = _partial(q, kb, vb, mask)
        new = torch.logaddexp(lse, l2)
        out = out * (lse - new).exp() + o.nan_to_num(0.0) * (l2 - new).exp()
        lse, offset = new, offset + n
    return out


def via_index_select(q, k, v, block, causal=False):  # blocks copied out, not viewed
    out = torch.zeros_like(q)
    lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    for a in range(0, k.shape[2], block):
        keys = torch.arange(a, min(a + block, k.shape[2]))
        mask = torch.arange(q.shape[2])[:, None] >= keys if causal else None
        o, l2 = _partial(q, k.index_select(2, keys), v.index_select(2, keys), mask)
        new = torch.logaddexp(lse, l2)
        out = out * (lse - new).exp() + o.nan_to_num(0.0) * (l2 - new).exp()
        lse = new
    return out


def transposed_keys(q, k, v, block, causal=False):  # k transposed once, up front
    k_t = k.transpose(-2, -1).contiguous()
    out = torch.zeros_like(q)
    lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    pos = torch.arange(q.shape[2])[:, None]
    for a in range(0, k.shape[2], block):
        b = min(a + block, k.shape[2])
        scores = q @ k_t[..., a:b] / math.sqrt(q.shape[-1])
        if causal:
            scores = scores.masked_fill(pos < torch.arange(a, b), -math.inf)
        l2 = torch.logsumexp(scores, -1, keepdim=True)
        o = (torch.exp(scores - l2) @ v[:, :, a:b]).nan_to_num(0.0)
        new = torch.logaddexp(lse, l2)
        out = out * (lse - new).exp() + o * (l2 - new).exp()
        lse = new
    return out


def padded_keys(q, k, v, block, causal=False):  # k and v padded to whole blocks
    s = k.shape[2]
    extra = -s % block
    k, v = F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra))
    out = torch.zeros_like(q)
    lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
    pos = torch.arange(q.shape[2])[:, None]
    for a in range(0, s + extra, block):
        keys = torch.arange(a, a + block)
        mask = (keys < s) & (pos >= keys if causal else True)
        o, l2 = _partial(q, k[:, :, a:a + block], v[:, :, a:a + block], mask)
        new = torch.logaddexp(lse, l2)
        out = out * (lse - new).exp().nan_to_num(0.0) + o.nan_to_num(0.0) * (
            l2 - new).exp().nan_to_num(0.0)
        lse = new
    return out


@pytest.mark.parametrize("fn", [online_softmax, lse_with_where, reverse_blocks,
                                TiledAttention(), via_split, via_index_select,
                                transposed_keys, padded_keys])
def test_right_blockwise_pass(fn):
    ch11.check_blockwise_attention(fn)


def test_wrong_blockwise_fail():
    check = ch11.check_blockwise_attention

    def library(q, k, v, block, causal=False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def averaged(q, k, v, block, causal=False):
        outs = []
        for a in range(0, k.shape[2], block):
            b = min(a + block, k.shape[2])
            mask = (torch.arange(q.shape[2])[:, None] >= torch.arange(a, b)) if causal \
                else None
            outs.append(_partial(q, k[:, :, a:b], v[:, :, a:b], mask)[0].nan_to_num(0))
        return sum(outs) / len(outs)

    def unscaled(q, k, v, block, causal=False):
        return via_split(q * math.sqrt(q.shape[-1]), k, v, block, causal)

    def drops_last(q, k, v, block, causal=False):
        full = (k.shape[2] // block) * block or k.shape[2]
        return via_split(q, k[:, :, :full], v[:, :, :full], block, causal)

    def local_mask(q, k, v, block, causal=False):
        out = torch.zeros_like(q)
        lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
        for kb, vb in zip(k.split(block, 2), v.split(block, 2), strict=True):
            n = kb.shape[2]
            mask = (torch.ones(q.shape[2], n, dtype=torch.bool).tril()
                    if causal else None)
            o, l2 = _partial(q, kb, vb, mask)
            new = torch.logaddexp(lse, l2)
            out = out * (lse - new).exp() + o.nan_to_num(0.0) * (l2 - new).exp()
            lse = new
        return out

    def ignores_causal(q, k, v, block, causal=False):
        return via_split(q, k, v, block, False)

    def no_max(q, k, v, block, causal=False):  # exp of raw scores overflows
        num, den = torch.zeros_like(q), torch.zeros(*q.shape[:-1], 1, dtype=q.dtype)
        for a in range(0, k.shape[2], block):
            b = min(a + block, k.shape[2])
            sc = q @ k[:, :, a:b].mT / math.sqrt(q.shape[-1])
            if causal:
                sc = sc.masked_fill(torch.arange(q.shape[2])[:, None]
                                    < torch.arange(a, b), -math.inf)
            p = sc.exp()
            num, den = num + p @ v[:, :, a:b], den + p.sum(-1, keepdim=True)
        return num / den

    def nan_rows(q, k, v, block, causal=False):
        out = torch.zeros_like(q)
        lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
        for a in range(0, k.shape[2], block):
            b = min(a + block, k.shape[2])
            mask = (torch.arange(q.shape[2])[:, None] >= torch.arange(a, b)) if causal \
                else None
            o, l2 = _partial(q, k[:, :, a:b], v[:, :, a:b], mask)
            new = torch.logaddexp(lse, l2)
            out = out * (lse - new).exp() + o * (l2 - new).exp()
            lse = new
        return out

    def float32_only(q, k, v, block, causal=False):
        return via_split(q.float(), k.float(), v.float(), block, causal)

    def with_lse(q, k, v, block, causal=False):
        return via_split(q, k, v, block, causal), None

    def in_place(q, k, v, block, causal=False):
        q.mul_(1.0 / math.sqrt(q.shape[-1]))
        return via_split(q * math.sqrt(q.shape[-1]), k, v, block, causal)

    def full_causal_mask(q, k, v, block, causal=False):
        s = k.shape[2]
        big = torch.ones(s, s, dtype=torch.bool).tril()
        out = torch.zeros_like(q)
        lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=q.dtype)
        for a in range(0, s, block):
            b = min(a + block, s)
            o, l2 = _partial(q, k[:, :, a:b], v[:, :, a:b],
                             big[:, a:b] if causal else None)
            new = torch.logaddexp(lse, l2)
            out = out * (lse - new).exp() + o.nan_to_num(0.0) * (l2 - new).exp()
            lse = new
        return out

    cache = {}

    def reuses_state(q, k, v, block, causal=False):
        if "out" not in cache:
            cache["out"] = via_split(q, k, v, block, causal)
        return cache["out"]

    by_shape = {}

    def cached_by_shape(q, k, v, block, causal=False):
        key = (q.shape, q.dtype, block, causal)
        if key not in by_shape:
            by_shape[key] = via_split(q, k, v, block, causal)
        return by_shape[key]

    def query_blocks_all_keys(q, k, v, block, causal=False):
        rows = []
        for i in range(0, q.shape[2], block):
            qi = q[:, :, i:i + block]
            mask = None
            if causal:
                mask = torch.arange(i, i + qi.shape[2])[:, None] >= torch.arange(
                    k.shape[2])
            rows.append(_partial(qi, k, v, mask)[0])
        return torch.cat(rows, dim=2)

    def query_blocks_fused(q, k, v, block, causal=False):  # one kernel, every key
        rows = []
        for i in range(0, q.shape[2], block):
            qi = q[:, :, i:i + block]
            mask = None
            if causal:
                mask = torch.arange(i, i + qi.shape[2])[:, None] >= torch.arange(
                    k.shape[2])
            rows.append(F.scaled_dot_product_attention(qi, k, v, attn_mask=mask))
        return torch.cat(rows, dim=2)

    def keeps_every_block(q, k, v, block, causal=False):  # one softmax at the end
        pos, scores = torch.arange(q.shape[2])[:, None], []
        for a in range(0, k.shape[2], block):
            sc = q @ k[:, :, a:a + block].mT / math.sqrt(q.shape[-1])
            if causal:
                sc = sc.masked_fill(pos < torch.arange(a, a + sc.shape[-1]),
                                    float("-inf"))
            scores.append(sc)
        top = scores[0].amax(-1, keepdim=True)
        for sc in scores[1:]:
            top = torch.maximum(top, sc.amax(-1, keepdim=True))
        total = sum(torch.exp(sc - top).sum(-1, keepdim=True) for sc in scores)
        return sum(torch.exp(sc - top) @ v[:, :, a:a + block]
                   for sc, a in zip(scores, range(0, k.shape[2], block),
                                    strict=True)) / total

    def double_blocks(q, k, v, block, causal=False):  # twice the allowed keys
        return via_split(q, k, v, 2 * block, causal)

    def one_more_key(q, k, v, block, causal=False):
        return via_split(q, k, v, block + 1, causal)

    def float32_result(q, k, v, block, causal=False):  # bf16 in, float32 out
        out = via_split(q.double(), k.double(), v.double(), block, causal)
        return out.to(q.dtype) if q.dtype != torch.bfloat16 else out.float()

    def float32_inside(q, k, v, block, causal=False):  # float64 in and out
        return via_split(q.float(), k.float(), v.float(), block, causal).to(q.dtype)

    fails(check, float32_inside, "float32's rounding only")
    fails(check, library, "37 keys at once", "never (S x S)")
    fails(check, query_blocks_all_keys, "37 keys at once")
    fails(check, query_blocks_fused, "37 keys at once", "one block of at most")
    fails(check, keeps_every_block, "block 8", "alive at once", "let its scores go")
    fails(check, cached_by_shape, "equal to scaled_dot_product_attention")
    fails(check, double_blocks, "at most 8 keys at once", "(S x 2 block)")
    fails(check, one_more_key, "at most 8 keys at once")
    fails(check, float32_result, "dtype", "bfloat16")
    fails(check, averaged, "log-sum-exp rule")
    fails(check, unscaled, "1 / sqrt(d)")
    fails(check, drops_last, "keys are missing")
    fails(check, local_mask, "positions in the whole sequence")
    fails(check, ignores_causal, "use the causal argument")
    fails(check, no_max, "nan or inf", "maximum")
    fails(check, nan_rows, "nan or inf", "contribute nothing")
    fails(check, float32_only, "dtype", "float32-only")
    fails(check, with_lse, "one tensor")
    fails(check, in_place, "left unchanged")
    fails(check, full_causal_mask, "two dimensions")
    fails(check, reuses_state, "shape")


def test_placeholder_named():
    def stub(q, k, v, block, causal=False):
        raise NotImplementedError("Exercise 11.1")

    fails(ch11.check_blockwise_attention, stub, "placeholder")


# ---------------------------------------------------------------- 11.2


def plan_vectorised(expert_idx, n_experts, world_size, capacity):
    t, k = expert_idx.shape
    flat = expert_idx.flatten()
    number = torch.arange(t * k)
    priority = (number % k) * t + number // k  # choice first, then token
    by = torch.argsort(flat * (t * k) + priority)
    sorted_experts = flat[by]
    start = torch.searchsorted(sorted_experts, sorted_experts, right=False)
    position = torch.arange(t * k) - start
    kept = by[position < capacity]
    dest = flat[kept] // (n_experts // world_size)
    order = kept[torch.argsort(dest, stable=True)]
    return order, torch.bincount(dest, minlength=world_size)


def plan_lists(expert_idx, n_experts, world_size, capacity):
    rows = expert_idx.tolist()
    per_rank = n_experts // world_size
    queues = [[] for _ in range(n_experts)]
    for j in range(len(rows[0])):
        for t, chosen in enumerate(rows):
            queues[chosen[j]].append(t * len(chosen) + j)
    order, counts = [], []
    for r in range(world_size):
        group = [a for e in range(r * per_rank, (r + 1) * per_rank)
                 for a in queues[e][:capacity]]
        order += group
        counts.append(len(group))
    return order, counts


def plan_numpy(expert_idx, n_experts, world_size, capacity):
    idx = expert_idx.numpy()
    t, k = idx.shape
    taken = np.zeros(n_experts, dtype=int)
    keep = []
    for j in range(k):
        for i in range(t):
            e = idx[i, j]
            if taken[e] < capacity:
                taken[e] += 1
                keep.append(i * k + j)
    keep = np.array(keep, dtype=np.int64)
    dest = idx.reshape(-1)[keep] // (n_experts // world_size)
    order = keep[np.argsort(dest, kind="stable")]
    return torch.from_numpy(order), np.bincount(dest, minlength=world_size)


class Planner:  # a class; within a rank, assignments in reverse (allowed)
    def __call__(self, expert_idx, n_experts, world_size, capacity):
        order, counts = plan_lists(expert_idx, n_experts, world_size, capacity)
        out, start = [], 0
        for c in counts:
            out += order[start:start + c][::-1]
            start += c
        return torch.tensor(out, dtype=torch.int32), tuple(counts)


def plan_by_expert_sort(expert_idx, n_experts, world_size, capacity):
    order, counts = plan_numpy(expert_idx, n_experts, world_size, capacity)
    experts = expert_idx.flatten()[order]
    return order[torch.argsort(experts, stable=True)], list(counts)  # by expert


@pytest.mark.parametrize("fn", [plan_vectorised, plan_lists, plan_numpy, Planner(),
                                plan_by_expert_sort])
def test_right_plan_pass(fn):
    ch11.check_plan_dispatch(fn)


def test_wrong_plan_fail():
    check = ch11.check_plan_dispatch

    def no_capacity(expert_idx, n_experts, world_size, capacity):
        return plan_lists(expert_idx, n_experts, world_size, 10 ** 6)

    def token_order(expert_idx, n_experts, world_size, capacity):
        rows = expert_idx.tolist()
        per_rank, taken, kept = n_experts // world_size, [0] * n_experts, []
        for t, chosen in enumerate(rows):
            for j, e in enumerate(chosen):
                if taken[e] < capacity:
                    taken[e] += 1
                    kept.append((e // per_rank, t * len(chosen) + j))
        kept.sort()
        return ([a for _, a in kept],
                [sum(1 for r, _ in kept if r == d) for d in range(world_size)])

    def one_short(expert_idx, n_experts, world_size, capacity):
        return plan_lists(expert_idx, n_experts, world_size, capacity - 1)

    def not_grouped(expert_idx, n_experts, world_size, capacity):
        order, counts = plan_lists(expert_idx, n_experts, world_size, capacity)
        return sorted(order), counts

    def counts_per_expert(expert_idx, n_experts, world_size, capacity):
        order, _ = plan_lists(expert_idx, n_experts, world_size, capacity)
        return order, torch.bincount(expert_idx.flatten()[torch.tensor(order)],
                                     minlength=n_experts)

    def two_ranks(expert_idx, n_experts, world_size, capacity):
        order, _ = plan_lists(expert_idx, n_experts, 2, capacity)
        dest = expert_idx.flatten()[torch.tensor(order)] // (n_experts // 2)
        return order, torch.bincount(dest, minlength=world_size)

    def counts_before_dropping(expert_idx, n_experts, world_size, capacity):
        order, _ = plan_lists(expert_idx, n_experts, world_size, capacity)
        dest = expert_idx.flatten() // (n_experts // world_size)
        return order, torch.bincount(dest, minlength=world_size)

    def float_order(expert_idx, n_experts, world_size, capacity):
        order, counts = plan_lists(expert_idx, n_experts, world_size, capacity)
        return torch.tensor(order, dtype=torch.float32), counts

    def numbered_by_choice(expert_idx, n_experts, world_size, capacity):
        t, k = expert_idx.shape
        order, counts = plan_lists(expert_idx, n_experts, world_size, capacity)
        return [(a % k) * t + a // k for a in order], counts

    def capacity_per_rank(expert_idx, n_experts, world_size, capacity):
        per_rank = n_experts // world_size
        rows = expert_idx.tolist()
        taken, kept = [0] * world_size, []
        for j in range(len(rows[0])):
            for t, chosen in enumerate(rows):
                r = chosen[j] // per_rank
                if taken[r] < capacity * per_rank:
                    taken[r] += 1
                    kept.append((r, t * len(chosen) + j))
        kept.sort()
        return ([a for _, a in kept],
                [sum(1 for r, _ in kept if r == d) for d in range(world_size)])

    def twice(expert_idx, n_experts, world_size, capacity):
        order, counts = plan_lists(expert_idx, n_experts, world_size, capacity)
        return order + order[:1], [counts[0] + 1] + counts[1:]

    def token_ids(expert_idx, n_experts, world_size, capacity):
        order, counts = plan_lists(expert_idx, n_experts, world_size, capacity)
        return [a // expert_idx.shape[1] for a in order], counts

    def clears_choices(expert_idx, n_experts, world_size, capacity):
        plan = plan_lists(expert_idx, n_experts, world_size, capacity)
        expert_idx.zero_()  # the router's choices are gone for the combine
        return plan

    def sorts_choices(expert_idx, n_experts, world_size, capacity):
        expert_idx.copy_(expert_idx.sort(dim=1).values)
        return plan_lists(expert_idx, n_experts, world_size, capacity)

    taken_so_far = {}

    def remembers_counts(expert_idx, n_experts, world_size, capacity):
        taken = taken_so_far.setdefault((n_experts, world_size), [0] * n_experts)
        per_rank, kept = n_experts // world_size, []
        rows = expert_idx.tolist()
        for j in range(len(rows[0])):
            for t, chosen in enumerate(rows):
                if taken[chosen[j]] < capacity:
                    taken[chosen[j]] += 1
                    kept.append((chosen[j] // per_rank, t * len(chosen) + j))
        kept.sort()
        return ([a for _, a in kept],
                [sum(1 for r, _ in kept if r == d) for d in range(world_size)])

    def needs_int64(expert_idx, n_experts, world_size, capacity):
        torch.nn.functional.one_hot(expert_idx, n_experts)  # wants int64
        return plan_lists(expert_idx, n_experts, world_size, capacity)

    def three_ranks_at_most(expert_idx, n_experts, world_size, capacity):
        return plan_lists(expert_idx, n_experts, min(world_size, 3), capacity)

    fails(check, clears_choices, "expert_idx left unchanged", "copy")
    fails(check, sorts_choices, "expert_idx left unchanged")
    fails(check, remembers_counts, "asked twice", "no state")
    fails(check, needs_int64, "int64")
    fails(check, three_ranks_at_most, "4 send counts")
    fails(check, no_capacity, "beyond the capacity")
    fails(check, token_order, "first choices come before")
    fails(check, one_short, "capacity - 1")
    fails(check, not_grouped, "grouped by destination")
    fails(check, counts_per_expert, "send counts, one per rank")
    fails(check, two_ranks, "3 ranks")
    fails(check, counts_before_dropping, "adding up to")
    fails(check, float_order, "whole numbers")
    fails(check, numbered_by_choice, "assignments that fit")
    fails(check, capacity_per_rank, "beyond the capacity")
    fails(check, twice, "once")
    fails(check, token_ids, "once")


def test_real_exchange_catches_a_plan_that_lies_only_inside_ranks():
    calls = []

    def different_on_the_real_run(expert_idx, n_experts, world_size, capacity):
        calls.append(1)
        order, counts = plan_lists(expert_idx, n_experts, world_size, capacity)
        if len(calls) > len(ch11.DISPATCH_CASES) + 1:  # the real exchange's plans
            order = order[::-1]  # no longer grouped by rank: counts disagree
        return order, counts

    fails(ch11.check_plan_dispatch, different_on_the_real_run, "equal to one process")


# ---------------------------------------------------------------- 11.3


def scores_pairs(seq_len, layout):
    c = seq_len // sum(map(len, layout))
    every = sorted(x for chunks in layout for x in chunks)
    return [sum(c * c for q in mine for kc in every if kc <= q) for mine in layout]


def scores_rank_of_chunk(seq_len, layout):  # a chunk sees all chunks up to it
    n_chunks = sum(len(x) for x in layout)
    c = seq_len / n_chunks
    return [sum((q + 1) * c * c for q in mine) for mine in layout]  # chunks 0..n-1


def scores_numpy(seq_len, layout):
    held = np.array(layout)
    c = seq_len // held.size
    return ((held + 1) * c * c).sum(axis=1)


class ScorePredictor:
    def __call__(self, seq_len, layout):
        return tuple(int(v) for v in scores_pairs(seq_len, layout))


def scores_simulated(seq_len, layout):  # walks the ring's steps as it runs
    n = len(layout)
    c = seq_len // sum(map(len, layout))
    out = []
    for r in range(n):
        total = 0
        for step in range(n):
            src = (r - step) % n
            total += sum(c * c for q in layout[r] for kc in layout[src] if kc <= q)
        out.append(float(total))
    return out


@pytest.mark.parametrize("fn", [scores_pairs, scores_rank_of_chunk, scores_numpy,
                                ScorePredictor(), scores_simulated])
def test_right_scores_pass(fn):
    ch11.check_predict_scores(fn)


def test_wrong_scores_fail():
    check = ch11.check_predict_scores

    def _count(seq_len, layout, rule, diagonal=1.0, size=None):
        c = size or seq_len / sum(map(len, layout))
        every = [x for chunks in layout for x in chunks]
        return [sum(c * c * (diagonal if kc == q else 1.0)
                    for q in mine for kc in every if rule(kc, q)) for mine in layout]

    def half_diagonal(seq_len, layout):
        return _count(seq_len, layout, lambda kc, q: kc <= q, diagonal=0.5)

    def masked_triangle(seq_len, layout):
        c = seq_len / sum(map(len, layout))
        return _count(seq_len, layout, lambda kc, q: kc <= q,
                      diagonal=(c + 1) / (2 * c))

    def no_diagonal(seq_len, layout):
        return _count(seq_len, layout, lambda kc, q: kc < q)

    def not_causal(seq_len, layout):
        return _count(seq_len, layout, lambda kc, q: True)

    def future_keys(seq_len, layout):
        return _count(seq_len, layout, lambda kc, q: kc >= q)

    def rank_sized_chunks(seq_len, layout):
        return _count(seq_len, layout, lambda kc, q: kc <= q,
                      size=seq_len / len(layout))

    def contiguous_always(seq_len, layout):
        n = len(layout)
        return [(r + 1) * (seq_len // n) ** 2 for r in range(n)]

    def by_rank_number(seq_len, layout):
        c = seq_len // sum(map(len, layout))
        every = [x for chunks in layout for x in chunks]
        return [sum(c * c for kc in every if kc <= r) for r in range(len(layout))]

    def a_total(seq_len, layout):
        return sum(scores_pairs(seq_len, layout))

    def blocks_not_scores(seq_len, layout):
        c = seq_len // sum(map(len, layout))
        return [v // (c * c) for v in scores_pairs(seq_len, layout)]

    def reversed_ranks(seq_len, layout):
        return scores_pairs(seq_len, layout)[::-1]

    def zigzag_formula(seq_len, layout):
        n = len(layout)
        return [(2 * n + 1) * (seq_len // (2 * n)) ** 2] * n

    def sorts_layout(seq_len, layout):
        layout.sort()
        return scores_pairs(seq_len, layout)

    def per_chunk(seq_len, layout):
        c = seq_len // sum(map(len, layout))
        every = [x for chunks in layout for x in chunks]
        return [sum(c * c for kc in every if kc <= q) for mine in layout for q in mine]

    fails(check, half_diagonal, "computed whole", "not half")
    fails(check, masked_triangle, "computed whole", "c (c + 1) / 2")
    fails(check, no_diagonal, "diagonal block", "with a mask")
    fails(check, not_causal, "skipped")
    fails(check, future_keys, "BEFORE")
    fails(check, rank_sized_chunks, "number of chunks in the layout")
    fails(check, contiguous_always, "read the layout")
    fails(check, by_rank_number, "compare chunk numbers")
    fails(check, a_total, "a list of")
    fails(check, blocks_not_scores, "not the scale")
    fails(check, reversed_ranks, "scores per rank")
    fails(check, zigzag_formula, "scores per rank")
    def two_chunks_each(seq_len, layout):  # c from 2 chunks per rank, always
        c = seq_len // (2 * len(layout))
        every = [x for chunks in layout for x in chunks]
        return [sum(c * c for q in mine for kc in every if kc <= q) for mine in layout]

    fails(check, two_chunks_each, "chunks in the layout")
    fails(check, sorts_layout, "layout left unchanged")
    fails(check, per_chunk, "one number per rank")


def test_endless_loop_stopped_and_named(monkeypatch):
    monkeypatch.setattr(ch11, "answer_limit", lambda *a, **k: 1)

    def endless(expert_idx, n_experts, world_size, capacity):
        while True:
            pass

    fails(ch11.check_plan_dispatch, endless, "did not return")
