"""Chapter 14's checkers: right answers written differently pass, and typical
mistakes fail with a message that names them."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_utils.checks import ch14
from course_utils.exercises import ExerciseFailed


def rejected(judge, *args):
    with pytest.raises(ExerciseFailed) as e:
        judge(*args)
    return str(e.value)


# ------------------------------------------------------------------ 14.1

def _qkv(attn, x):
    b, s, _ = x.shape
    q = attn.wq(x).view(b, s, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.wk(x).view(b, s, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.wv(x).view(b, s, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    return q, k, v


def _write(cache, k, v, at=None):
    start = cache["len"] if at is None else at
    cache["k"][:, :, start:start + k.shape[2]] = k
    cache["v"][:, :, start:start + k.shape[2]] = v
    cache["len"] += k.shape[2]
    return start


def _finish(attn, out):
    b, _, s, _ = out.shape
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


def right_einsum(attn, x, cache):  # softmax by hand, -inf above the diagonal
    q, k, v = _qkv(attn, x)
    start = _write(cache, k, v)
    end, s = cache["len"], x.shape[1]
    g = attn.n_heads // attn.n_kv_heads
    keys = cache["k"][:, :, :end].repeat_interleave(g, 1)
    vals = cache["v"][:, :, :end].repeat_interleave(g, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, keys) / math.sqrt(attn.head_dim)
    pos_q = torch.arange(start, end).view(-1, 1)
    scores = scores.masked_fill(torch.arange(end).view(1, -1) > pos_q, float("-inf"))
    out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vals)
    assert out.shape[2] == s
    return _finish(attn, out)


def right_expand(attn, x, cache):  # expand + reshape instead of repeat_interleave
    q, k, v = _qkv(attn, x)
    start = _write(cache, k, v)
    end = cache["len"]
    b, kv, _, d = cache["k"].shape
    g = attn.n_heads // kv

    def grow(t):
        return t[:, :, :end].unsqueeze(2).expand(b, kv, g, end, d).reshape(b, kv * g,
                                                                           end, d)
    mask = torch.ones(x.shape[1], end, dtype=torch.bool).tril(start)
    return _finish(attn, F.scaled_dot_product_attention(q, grow(cache["k"]),
                                                        grow(cache["v"]), mask))


def right_grouped_queries(attn, x, cache):  # queries grouped per K/V head
    q, k, v = _qkv(attn, x)
    start = _write(cache, k, v)
    end = cache["len"]
    b, h, s, d = q.shape
    kv = attn.n_kv_heads
    qg = q.reshape(b, kv, h // kv * s, d)  # each K/V head's query heads, stacked
    mask = torch.ones(s, end, dtype=torch.bool).tril(start).repeat(h // kv, 1)
    out = F.scaled_dot_product_attention(qg, cache["k"][:, :, :end],
                                         cache["v"][:, :, :end], mask)
    return _finish(attn, out.reshape(b, h, s, d))


def right_token_by_token(attn, x, cache):  # one query at a time, no mask needed
    outs = []
    for i in range(x.shape[1]):
        q, k, v = _qkv(attn, x[:, i:i + 1])
        _write(cache, k, v)
        end, g = cache["len"], attn.n_heads // attn.n_kv_heads
        outs.append(F.scaled_dot_product_attention(
            q, cache["k"][:, :, :end].repeat_interleave(g, 1),
            cache["v"][:, :, :end].repeat_interleave(g, 1)))
    return _finish(attn, torch.cat(outs, 2))


class RightCopyInto:  # a callable object; narrow().copy_ and enable_gqa
    def __call__(self, attn, x, cache):
        q, k, v = _qkv(attn, x)
        start, s = cache["len"], x.shape[1]
        cache["k"].narrow(2, start, s).copy_(k)
        cache["v"].narrow(2, start, s).copy_(v)
        cache["len"] = start + s
        keys_at = torch.arange(start + s).view(1, -1)
        mask = keys_at <= torch.arange(start, start + s).view(-1, 1)
        out = F.scaled_dot_product_attention(
            q, cache["k"].narrow(2, 0, start + s), cache["v"].narrow(2, 0, start + s),
            attn_mask=mask, enable_gqa=True)
        return _finish(attn, out)


def right_static_mask(attn, x, cache):  # gpt-fast: the whole buffer, masked
    q, k, v = _qkv(attn, x)
    start = _write(cache, k, v)
    g = attn.n_heads // attn.n_kv_heads
    slots = torch.arange(cache["k"].shape[2]).view(1, -1)
    mask = slots <= torch.arange(start, cache["len"]).view(-1, 1)
    return _finish(attn, F.scaled_dot_product_attention(
        q, cache["k"].repeat_interleave(g, 1), cache["v"].repeat_interleave(g, 1),
        attn_mask=mask))


RIGHT_CACHE = [right_einsum, right_expand, right_grouped_queries, right_token_by_token,
               RightCopyInto(), right_static_mask]


def _sdpa(attn, q, cache, end, mask=None, causal=False, tile=False):
    g = attn.n_heads // attn.n_kv_heads
    if tile:
        k, v = (cache[n][:, :, :end].repeat(1, g, 1, 1) for n in ("k", "v"))
    else:
        k, v = (cache[n][:, :, :end].repeat_interleave(g, 1) for n in ("k", "v"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _wrong(mask_offset=0, causal=False, no_mask=False, swap=False, tile=False,
           write_at=0, keep_len=False):
    def fn(attn, x, cache):
        q, k, v = _qkv(attn, x)
        if swap:
            k, v = v, k
        start = cache["len"]
        _write(cache, k, v, at=start + write_at)
        end = start + x.shape[1]
        if keep_len:
            cache["len"] = start
        mask = None if (causal or no_mask) else torch.ones(
            x.shape[1], end, dtype=torch.bool).tril(start + mask_offset)
        return _finish(attn, _sdpa(attn, q, cache, end, mask, causal, tile))
    return fn


wrong_mask_one_early = _wrong(mask_offset=-1)  # a token does not see itself
wrong_mask_one_late = _wrong(mask_offset=1)  # a token sees the next one
wrong_is_causal = _wrong(causal=True)  # top-left aligned: ignores the cache
wrong_no_mask = _wrong(no_mask=True)
wrong_swapped = _wrong(swap=True)
wrong_tiled_heads = _wrong(tile=True)  # repeat: heads 0,1,0,1 instead of 0,0,1,1
wrong_write_one_late = _wrong(write_at=1)
wrong_len_not_advanced = _wrong(keep_len=True)


def wrong_recomputed(attn, x, cache):  # keeps the inputs and recomputes all keys
    cache["x"] = x if "x" not in cache else torch.cat([cache["x"], x], 1)
    start = cache["len"]
    q, k, v = _qkv(attn, cache["x"])
    cache["len"] = 0
    _write(cache, k, v)
    end = cache["len"]
    mask = torch.ones(end, end, dtype=torch.bool).tril()
    out = _finish(attn, _sdpa(attn, q, cache, end, mask))
    return out[:, start:]


def wrong_concatenated(attn, x, cache):  # grows a new tensor each call
    q, k, v = _qkv(attn, x)
    start = cache["len"]
    if start == 0:
        cache["k"], cache["v"] = k, v
    else:
        cache["k"] = torch.cat([cache["k"][:, :, :start], k], 2)
        cache["v"] = torch.cat([cache["v"][:, :, :start], v], 2)
    cache["len"] = end = start + x.shape[1]
    mask = torch.ones(x.shape[1], end, dtype=torch.bool).tril(start)
    return _finish(attn, _sdpa(attn, q, cache, end, mask))


_SHARED = {}


def wrong_shared_cache(attn, x, cache):  # one cache for every sequence
    q, k, v = _qkv(attn, x)
    start = cache["len"]
    _write(cache, k, v)
    if id(attn) not in _SHARED or start == 0 and _SHARED[id(attn)][0].shape[2] > 0 \
            and cache is _SHARED[id(attn)][2]:
        _SHARED[id(attn)] = [k, v, cache]
    else:
        s = _SHARED[id(attn)]
        s[0], s[1] = torch.cat([s[0], k], 2), torch.cat([s[1], v], 2)
    kk, vv = _SHARED[id(attn)][:2]
    end = kk.shape[2]
    g = attn.n_heads // attn.n_kv_heads
    mask = torch.ones(x.shape[1], end, dtype=torch.bool).tril(end - x.shape[1])
    out = F.scaled_dot_product_attention(q, kk.repeat_interleave(g, 1),
                                         vv.repeat_interleave(g, 1), mask)
    return _finish(attn, out)


def wrong_float32_only(attn, x, cache):
    attn32 = attn.float()  # float32 weights from here on (attn is changed too)
    q, k, v = _qkv(attn32, x.float())
    start = _write(cache, k.to(cache["k"].dtype), v.to(cache["v"].dtype))
    end = cache["len"]
    mask = torch.ones(x.shape[1], end, dtype=torch.bool).tril(start)
    g = attn.n_heads // attn.n_kv_heads
    out = F.scaled_dot_product_attention(
        q, cache["k"][:, :, :end].float().repeat_interleave(g, 1),
        cache["v"][:, :, :end].float().repeat_interleave(g, 1), mask)
    return _finish(attn32, out)


def wrong_reads_whole_buffer(attn, x, cache):  # no slice, no mask for the tail
    q, k, v = _qkv(attn, x)
    _write(cache, k, v)
    return _finish(attn, _sdpa(attn, q, cache, cache["k"].shape[2]))


def wrong_multi_head_only(attn, x, cache):  # K/V with the query heads' count
    b, s, _ = x.shape
    q = attn.wq(x).view(b, s, attn.n_heads, -1).transpose(1, 2)
    k = attn.wk(x).view(b, s, attn.n_heads, -1).transpose(1, 2)
    v = attn.wv(x).view(b, s, attn.n_heads, -1).transpose(1, 2)
    start = _write(cache, k, v)
    mask = torch.ones(s, cache["len"], dtype=torch.bool).tril(start)
    return _finish(attn, F.scaled_dot_product_attention(
        q, cache["k"][:, :, :cache["len"]], cache["v"][:, :, :cache["len"]], mask))


def wrong_no_cache_read(attn, x, cache):  # attends within the chunk only
    q, k, v = _qkv(attn, x)
    _write(cache, k, v)
    g = attn.n_heads // attn.n_kv_heads
    return _finish(attn, F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True))


def wrong_scales_input(attn, x, cache):  # normalises x in place first
    x /= x.norm(dim=-1, keepdim=True)
    q, k, v = _qkv(attn, x)
    start = _write(cache, k, v)
    mask = torch.ones(x.shape[1], cache["len"], dtype=torch.bool).tril(start)
    return _finish(attn, _sdpa(attn, q, cache, cache["len"], mask))


def wrong_attends_in_float32(attn, x, cache):  # float64 weights, float32 scores
    q, k, v = _qkv(attn, x)
    start = _write(cache, k, v)
    end, g = cache["len"], attn.n_heads // attn.n_kv_heads
    mask = torch.ones(x.shape[1], end, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(
        q.float(), cache["k"][:, :, :end].float().repeat_interleave(g, 1),
        cache["v"][:, :, :end].float().repeat_interleave(g, 1), mask)
    return _finish(attn, out.to(x.dtype))


def wrong_hangs(attn, x, cache):
    while True:
        pass


WRONG_CACHE = {
    wrong_mask_one_early: "recomputing attention",
    wrong_mask_one_late: "recomputing attention",
    wrong_is_causal: "recomputing attention",
    wrong_no_mask: "recomputing attention",
    wrong_swapped: "swapped",
    wrong_tiled_heads: "repeat_interleave",
    wrong_write_one_late: "empty (never written) slots",
    wrong_len_not_advanced: "cache['len']",
    wrong_recomputed: "do not recompute",
    wrong_concatenated: "write in place",
    wrong_shared_cache: "recomputing attention",
    wrong_float32_only: "float64",
    wrong_reads_whole_buffer: "past cache['len']",
    wrong_multi_head_only: "n_kv_heads K/V",
    wrong_no_cache_read: "recomputing attention",
    wrong_scales_input: "x changed in place",
    wrong_attends_in_float32: "the error of float32",
    wrong_hangs: "did not return",
}


@pytest.mark.parametrize("fn", RIGHT_CACHE, ids=lambda f: getattr(f, "__name__", "cls"))
def test_cache_right_answers_pass(fn):
    ch14.check_cached_attention(fn)


@pytest.mark.parametrize("fn", list(WRONG_CACHE), ids=lambda f: f.__name__)
def test_cache_wrong_answers_fail(fn):
    _SHARED.clear()
    message = rejected(ch14.check_cached_attention, fn)
    assert WRONG_CACHE[fn] in message, message


# ------------------------------------------------------------------ 14.2
# Every answer runs the same collectives on every rank (a wrong answer that
# waits on one rank only would hang the others until the launch's timeout).

def _shards(model, rank, world, contiguous=False):
    out = []
    for block in model.layers:
        if contiguous:
            qkv = block.attn.qkv.weight.chunk(world)[rank]
        else:
            qkv = torch.cat([w.chunk(world)[rank]
                             for w in block.attn.qkv.weight.chunk(3)])
        out.append((qkv, block.attn.wo.weight.chunk(world, 1)[rank],
                    block.mlp[0].weight.chunk(world)[rank],
                    block.mlp[0].bias.chunk(world)[rank],
                    block.mlp[2].weight.chunk(world, 1)[rank]))
    return out


def _tp_answer(contiguous=False, world_fixed=None, skip_attn_reduce=False,
               reduce_after_up=False, bias_every_rank=False, no_up_bias=False,
               gather_sum=False, no_cache=False, shift_logits=False,
               reduce_logits=False, extra_forward=False, last_only=False,
               functional=False, whole_wo=False, whole_down=False,
               head_on_rank0=False, kept=False):
    @torch.no_grad()
    def answer(model, prompt, steps):
        import torch.distributed as dist

        rank = dist.get_rank()
        world = world_fixed or dist.get_world_size()
        rank = rank % world
        shards = (_KEPT.setdefault("shards", _shards(model, rank, world))
                  if kept else _shards(model, rank, world, contiguous))

        def reduce(t):
            if functional:
                import torch.distributed._functional_collectives as funcol

                return funcol.all_reduce(t, "sum", dist.group.WORLD)
            if gather_sum:
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, t.contiguous())
                return sum(parts)
            dist.all_reduce(t)
            return t

        def forward(tokens, caches):
            h = model.embed(tokens)
            for block, (qkv_w, wo, up, up_b, down), cache in zip(
                    model.layers, shards, caches, strict=True):
                b, s, _ = h.shape
                hd = block.attn.head_dim
                q, k, v = (t.reshape(b, s, -1, hd).transpose(1, 2)
                           for t in F.linear(block.norm1(h), qkv_w).chunk(3, -1))
                if cache:
                    k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
                if not no_cache:
                    cache["k"], cache["v"] = k, v
                t = k.shape[2]
                mask = torch.ones(s, t, dtype=torch.bool).tril(t - s)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                out = out.transpose(1, 2).reshape(b, s, -1)
                if whole_wo:  # heads gathered by a zero-padded all-reduce
                    full = out.new_zeros(b, s, block.attn.wo.weight.shape[1])
                    full[..., rank * out.shape[-1]:(rank + 1) * out.shape[-1]] = out
                    part = block.attn.wo(reduce(full))
                else:
                    part = F.linear(out, wo)
                if not (skip_attn_reduce or whole_wo):
                    part = reduce(part)
                h = h + part
                mid = F.linear(block.norm2(h), up, None if no_up_bias else up_b)
                if reduce_after_up:
                    mid = reduce(mid)
                if whole_down:  # the hidden gathered, then the whole mlp.2
                    mid = block.mlp[1](mid)
                    full = mid.new_zeros(b, s, block.mlp[2].weight.shape[1])
                    full[..., rank * mid.shape[-1]:(rank + 1) * mid.shape[-1]] = mid
                    part = F.linear(reduce(full), block.mlp[2].weight)
                else:
                    part = F.linear(block.mlp[1](mid), down)
                if bias_every_rank:
                    part = part + block.mlp[2].bias
                if not (reduce_after_up or whole_down):
                    part = reduce(part)
                h = h + part + (0 if bias_every_rank else block.mlp[2].bias)
            if last_only:
                h = h[:, -1:]
            if head_on_rank0:  # rank 0 alone runs the head and sends the logits
                logits = (model.head(model.norm(h)) if rank == 0 else h.new_empty(
                    *h.shape[:-1], model.head.out_features))
                dist.broadcast(logits, 0)
                return logits
            logits = model.head(model.norm(h))
            return reduce(logits) if reduce_logits else logits

        caches = [{} for _ in model.layers]
        seq = prompt
        logits = forward(prompt, caches)[:, -1]
        tokens, chosen = [], []
        for i in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            seq = torch.cat([seq, nxt], 1)
            before = logits
            if i < steps - 1 or extra_forward:
                logits = forward(seq if no_cache else nxt,
                                 [{} for _ in model.layers] if no_cache else caches
                                 )[:, -1]
            chosen.append(logits if shift_logits and i < steps - 1 else before)
        return torch.cat(tokens, 1), torch.stack(chosen, 1)
    return answer


def right_modules(model, prompt, steps):  # sharded nn.Linear copies in place
    import copy

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    m = copy.deepcopy(model)
    with torch.no_grad():
        for block, (qkv, wo, up, up_b, down) in zip(m.layers, _shards(m, rank, world),
                                                     strict=True):
            block.attn.qkv = torch.nn.Linear(qkv.shape[1], qkv.shape[0], bias=False,
                                             dtype=qkv.dtype)
            block.attn.qkv.weight.copy_(qkv)
            block.attn.n_heads //= world
            block.attn.wo = _Reduced(wo)
            block.mlp[0] = torch.nn.Linear(up.shape[1], up.shape[0], dtype=up.dtype)
            block.mlp[0].weight.copy_(up)
            block.mlp[0].bias.copy_(up_b)
            block.mlp[2] = _Reduced(down, block.mlp[2].bias.clone())
    return m.generate(prompt, steps)


class _Reduced(torch.nn.Module):
    def __init__(self, w, bias=None):
        super().__init__()
        self.w, self.bias = w, bias

    def forward(self, x):
        import torch.distributed as dist

        out = F.linear(x, self.w)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


def right_index_select(model, prompt, steps):  # heads picked by index
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    a = model.layers[0].attn
    per = a.n_heads // world
    rows = torch.arange(rank * per * a.head_dim, (rank + 1) * per * a.head_dim)
    dim = a.n_heads * a.head_dim
    for block in model.layers:  # the same shards, taken by index into a copy
        assert block.attn.qkv.weight.index_select(0, torch.cat(
            [rows, rows + dim, rows + 2 * dim])).shape[0] == 3 * per * a.head_dim
    return _tp_answer()(model, prompt, steps)


class RightCallable:
    def __call__(self, model, prompt, steps):
        return _tp_answer(last_only=True)(model, prompt, steps)


RIGHT_TP = [_tp_answer(), right_modules, right_index_select, RightCallable(),
            _tp_answer(extra_forward=True), _tp_answer(functional=True)]
WRONG_TP = {
    "wrong_contiguous_qkv": (_tp_answer(contiguous=True), "one process"),
    "wrong_hard_coded_world": (_tp_answer(world_fixed=2), "one process"),
    "wrong_no_attention_reduce": (_tp_answer(skip_attn_reduce=True), "one process"),
    "wrong_reduce_after_column": (_tp_answer(reduce_after_up=True), "one process"),
    "wrong_bias_every_rank": (_tp_answer(bias_every_rank=True), "one process"),
    "wrong_no_up_bias": (_tp_answer(no_up_bias=True), "one process"),
    "wrong_all_gather_sum": (_tp_answer(gather_sum=True), "all-reduces per layer"),
    "wrong_recomputes": (_tp_answer(no_cache=True), "FLOPs"),
    "wrong_shifted_logits": (_tp_answer(shift_logits=True), "one process"),
    "wrong_reduced_logits": (_tp_answer(reduce_logits=True), "one process"),
    "wrong_whole_wo": (_tp_answer(whole_wo=True), "FLOPs"),
    "wrong_whole_down": (_tp_answer(whole_down=True), "FLOPs"),
}


def wrong_unsharded(model, prompt, steps):  # the whole model on every rank
    return model.generate(prompt, steps)


def wrong_fake_reduces(model, prompt, steps):  # unsharded, dummy all-reduces
    import torch.distributed as dist

    for _ in range(2 * len(model.layers) * steps):
        dist.all_reduce(torch.zeros(1))
    return model.generate(prompt, steps)


def wrong_rank0_broadcasts(model, prompt, steps):
    import torch.distributed as dist

    tokens, logits = model.generate(prompt, steps)
    dist.broadcast(tokens, 0)
    dist.broadcast(logits, 0)
    return tokens, logits


def wrong_float32(model, prompt, steps):
    return _tp_answer()(model.float(), prompt, steps)


_KEPT = {}  # what an answer keeps between calls, in each rank's process


WRONG_TP.update({"wrong_unsharded": (wrong_unsharded, "all-reduces per layer"),
                 "wrong_head_on_rank0": (_tp_answer(head_on_rank0=True),
                                         "no other collective"),
                 "wrong_shards_kept_between_calls": (
                     _tp_answer(kept=True), "keep nothing between calls"),
                 "wrong_fake_reduces": (wrong_fake_reduces, "FLOPs"),
                 "wrong_rank0_broadcasts": (wrong_rank0_broadcasts,
                                            "all-reduces per layer"),
                 "wrong_float32": (wrong_float32, "float64")})


@pytest.fixture(scope="module")
def tp_results():
    fns = RIGHT_TP + [fn for fn, _ in WRONG_TP.values()]
    return {w: ch14._run_tp(fns, w) for w in (2, 4)}


def _judge_both(results, i):
    for w in (2, 4):
        ch14.judge_tp(results[w][i])


@pytest.mark.parametrize("i", range(len(RIGHT_TP)))
def test_tp_right_answers_pass(tp_results, i):
    _judge_both(tp_results, i)


@pytest.mark.parametrize("name", list(WRONG_TP))
def test_tp_wrong_answers_fail(tp_results, name):
    i = len(RIGHT_TP) + list(WRONG_TP).index(name)
    message = rejected(_judge_both, tp_results, i)
    assert WRONG_TP[name][1] in message, message


def _extra_reduce(model, prompt, steps):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(1))  # the others never join
    return model.generate(prompt, steps)


def _deadlock(model, prompt, steps):
    import torch.distributed as dist

    dist.recv(torch.zeros(1), src=1 - dist.get_rank())  # both wait for the other
    return model.generate(prompt, steps)


@pytest.mark.parametrize("fn", [_extra_reduce, _deadlock])
def test_tp_hanging_answers_get_a_verdict(fn):
    def judged():
        ch14.judge_tp(ch14._run_tp([fn], 2)[0])

    message = rejected(judged)
    assert "never joined" in message or "every rank" in message, message


# ------------------------------------------------------------------ 14.3

from course_utils import planner, reference, serving  # noqa: E402


def _per_seq(model, context, tp, nbytes, kv=None, floor_heads=True):
    heads = (max(1, model.kv_heads // tp) if floor_heads else model.kv_heads / tp)
    return context * model.layers * 2 * (kv or heads) * model.head_dim * nbytes


def _plan(model, gpu, context, tp, nbytes, usable=None, weights=None, per_seq=None,
          rnd=math.floor, rate="right"):
    cap = reference.published(f"{gpu}.memory_gb").value * 2**30
    usable = cap * serving.memory_share() if usable is None else usable
    weights = model.params() * nbytes / tp if weights is None else weights
    per_seq = per_seq or _per_seq(model, context, tp, nbytes)
    batch = max(0, rnd((usable - weights) / per_seq))
    if batch == 0:
        return 0, 0.0
    t = serving.decode_seconds(model, gpu, batch, context, tp=tp).value
    return batch, {"right": batch / t, "one": 1 / t, "per_gpu": batch / t / tp,
                   "batch1": 1 / serving.decode_seconds(model, gpu, 1, context,
                                                        tp=tp).value}[rate]


def right_integer(model, gpu, context, tp, dtype_bytes):  # whole bytes, //
    cap = int(planner._capacity(gpu) * serving.memory_share())
    free = cap - model.params() * dtype_bytes // tp
    per = serving.kv_bytes_per_token(model, dtype_bytes) * max(
        1, model.kv_heads // tp) // model.kv_heads * context
    b = max(0, int(free // per))
    return (b, b / serving.decode_seconds(model, gpu, b, context, tp).value) if b \
        else (0, 0)


def right_loop(model, gpu, context, tp, dtype_bytes):  # grows until it overflows
    usable = reference.published(f"{gpu}.memory_gb").value * 2**30 * (
        serving.memory_share())
    weights = serving.weight_bytes(model, dtype_bytes) / tp
    per = _per_seq(model, context, tp, dtype_bytes)
    b = 0
    step = 1 << 20
    while step:  # a binary search, not a formula
        if weights + (b + step) * per <= usable:
            b += step
        else:
            step //= 2
    return b, (b / serving.decode_seconds(model, gpu, b, context, tp=tp).value
               if b else 0.0)


def right_list(model, gpu, context, tp, dtype_bytes):
    b, r = _plan(model, gpu, context, tp, dtype_bytes)
    return [b, r]


class RightPlanner:
    def __call__(self, model, gpu, context, tp, dtype_bytes):
        return _plan(model, gpu, context, tp, dtype_bytes)


def right_float_batch(model, gpu, context, tp, dtype_bytes):
    b, r = _plan(model, gpu, context, tp, dtype_bytes)
    return float(b), r


def right_numpy(model, gpu, context, tp, dtype_bytes):  # numpy's integers
    import numpy as np
    b, r = _plan(model, gpu, context, tp, dtype_bytes)
    return np.int64(b), np.float64(r)


RIGHT_PLAN = [right_integer, right_loop, right_list, RightPlanner(), right_float_batch,
              right_numpy]


def _cap(gpu):
    return reference.published(f"{gpu}.memory_gb").value


WRONG_PLAN = {
    "wrong_no_weights": (lambda m, g, c, t, n: _plan(m, g, c, t, n, weights=0),
                         "weights' share ignored"),
    "wrong_all_weights": (lambda m, g, c, t, n: _plan(m, g, c, t, n,
                                                      weights=m.params() * n),
                          "not 1 / tp"),
    "wrong_ignores_dtype": (lambda m, g, c, t, n: _plan(m, g, c, t, 2),
                            "16-bit bytes"),
    "wrong_whole_memory": (lambda m, g, c, t, n: _plan(m, g, c, t, n,
                                                       usable=_cap(g) * 2**30),
                           "serving engine's share"),
    "wrong_decimal_gb": (lambda m, g, c, t, n: _plan(
        m, g, c, t, n, usable=_cap(g) * 1e9 * serving.memory_share()), "decimal GB"),
    "wrong_fractional_heads": (lambda m, g, c, t, n: _plan(
        m, g, c, t, n, per_seq=_per_seq(m, c, t, n, floor_heads=False)),
        "below one per GPU"),
    "wrong_heads_not_split": (lambda m, g, c, t, n: _plan(
        m, g, c, t, n, per_seq=_per_seq(m, c, t, n, kv=m.kv_heads)), "not split"),
    "wrong_keys_only": (lambda m, g, c, t, n: _plan(
        m, g, c, t, n, per_seq=_per_seq(m, c, t, n) / 2), "only keys"),
    "wrong_rounds_up": (lambda m, g, c, t, n: _plan(m, g, c, t, n, rnd=math.ceil),
                        "round down"),
    "wrong_one_sequence_rate": (lambda m, g, c, t, n: _plan(m, g, c, t, n,
                                                            rate="batch1"),
                                "one sequence's tokens per second"),
    "wrong_rate_per_gpu": (lambda m, g, c, t, n: _plan(m, g, c, t, n, rate="per_gpu"),
                           "divided by the GPUs"),
    "wrong_step_rate": (lambda m, g, c, t, n: _plan(m, g, c, t, n, rate="one"),
                        "every sequence of the batch"),
}


def wrong_calls_helper(model, gpu, context, tp, dtype_bytes):
    b = serving.max_batch(model, gpu, context, tp=tp, dtype_bytes=dtype_bytes)
    return b, _plan(model, gpu, context, tp, dtype_bytes)[1]


def wrong_hangs_plan(model, gpu, context, tp, dtype_bytes):
    while True:
        pass


_PLANNED = {}


def wrong_kept_per_model(model, gpu, context, tp, dtype_bytes):  # context ignored
    key = (model.name, gpu, tp, dtype_bytes)
    if key not in _PLANNED:
        _PLANNED[key] = _plan(model, gpu, context, tp, dtype_bytes)
    return _PLANNED[key]


def wrong_rate_when_nothing_fits(model, gpu, context, tp, dtype_bytes):
    b, _ = _plan(model, gpu, context, tp, dtype_bytes)
    return b, b / serving.decode_seconds(model, gpu, max(b, 1), context, tp=tp).value


WRONG_PLAN["wrong_calls_helper"] = (wrong_calls_helper, "calls max_batch")
WRONG_PLAN["wrong_kept_per_model"] = (wrong_kept_per_model, "an earlier call")
WRONG_PLAN["wrong_rate_when_nothing_fits"] = (wrong_rate_when_nothing_fits,
                                              "return (0, 0.0)")
WRONG_PLAN["wrong_hangs_plan"] = (wrong_hangs_plan, "did not return")


@pytest.mark.parametrize("fn", RIGHT_PLAN, ids=lambda f: getattr(f, "__name__", "cls"))
def test_plan_right_answers_pass(fn):
    ch14.check_serving_plan(fn)


@pytest.mark.parametrize("name", list(WRONG_PLAN))
def test_plan_wrong_answers_fail(name):
    fn, words = WRONG_PLAN[name]
    _PLANNED.clear()
    message = rejected(ch14.check_serving_plan, fn)
    assert words in message, message
    for model, gpu, context, tp, nbytes in ch14.plan_cases():  # the answer unseen
        want = serving.max_batch(model, gpu, context, tp=tp, dtype_bytes=nbytes)
        if want > 9:
            assert f" {want} " not in f" {message} ".replace("(", " ").replace(")", " ")
