"""Checkers for Chapter 11 (context and expert parallelism).

11.1 runs the learner's block-by-block attention on odd sequence lengths,
causal and not, float64, float32 and bfloat16, large scores included, against
PyTorch's attention, and watches every tensor it creates (a dispatch mode) so
that computing with more than ``block`` keys at once, or keeping every block's
scores alive, is caught. 11.2 checks a
capacity-limited MoE dispatch plan against the checker's own rule on 2, 3 and
4 ranks with skewed routing (int64 and int32 choices, watched for changes,
asked twice), then runs the real exchange (``all_to_all_single``, uneven
splits) on 3 ranks with the learner's plans and compares the layer with one
process. 11.3 runs a causal ring attention on 2 and 3 ranks over layouts the
chapter never shows and compares the scores each rank computed with the
learner's prediction.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_utils.exercises import (
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
    time_limit,
)


def _call(ex, fn, *args):
    """The learner's function, within ``answer_limit(ex)``, failures made friendly.

    It runs with one intra-op thread: the checks use small tensors, for which
    a second thread only waits (16x slower on a busy 2-core machine).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with time_limit(answer_limit(ex)):
            return call_learner(ex, fn, *args, hints={
                "took longer than": "your function did not return: look for a "
                                    "loop whose condition never changes"})
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- exercise 11.1


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# operators that move keys about without computing with them
_MOVES_KEYS = {"index_select", "index", "gather", "take", "masked_select",
               "constant_pad_nd", "cat", "stack", "copy_", "copy", "new_empty",
               "new_zeros", "new_full", "new_ones", "empty_like", "zeros_like",
               "repeat", "repeat_interleave", "narrow_copy", "slice_copy",
               "split_with_sizes_copy", "unbind_copy", "detach"}


class _Watch(TorchDispatchMode):
    """Catches an operator that handles more than ``block`` keys at once.

    The cases keep batch, heads and the head size at most ``block``, so a
    created tensor with two dimensions above ``block`` holds more than a
    block's scores (the query rows times too many keys), and an operator that
    computes (not merely views, copies, pads or indexes) with more than
    ``block`` rows of k or v uses too many keys at once, as a fused attention
    kernel does, even on a block of queries only.
    """

    def __init__(self, block: int, keys: tuple[torch.Tensor, ...]):
        super().__init__()
        self.limit, self.keys, self.big = block + 1, {_storage(t) for t in keys}, None
        self.made, self.peak = [], 0  # tensors it made (held weakly), elements alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made = [r for r in self.made if r() is not None] + [
            weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        alive = {_storage(t): t.untyped_storage().nbytes() // t.element_size()
                 for t in (r() for r in self.made) if t is not None}
        self.peak = max(self.peak, sum(alive.values()))
        if self.big is not None:
            return out
        name = str(func).split(".")[1] if "." in str(func) else str(func)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        long = [t for t in tree_flatten((args, kwargs or {}))[0]
                if isinstance(t, torch.Tensor)
                and max(t.shape, default=0) >= self.limit]
        for t in long:
            if _storage(t) not in self.keys or any(
                    _storage(o) == _storage(t) for o in outs):
                continue  # not k or v, or a view of it
            if len(long) == 1 and all(sorted(o.shape) == sorted(t.shape)
                                      for o in outs):
                # a copy, a cast or a transposed copy of k or v: follow it
                self.keys |= {_storage(o) for o in outs}
            elif name in _MOVES_KEYS:
                # a block taken out of k or v (index_select, say), or k or v
                # padded or joined: follow what is still long
                self.keys |= {_storage(o) for o in outs
                              if max(o.shape, default=0) >= self.limit}
            else:  # it computes with every key: a fused attention on all of k
                self.big = (name, f"{max(t.shape)} keys at once, shape "
                                  f"{tuple(t.shape)}")
        for t in outs:
            if sum(1 for n in t.shape if n >= self.limit) >= 2:
                self.big = (name, f"a tensor of shape {tuple(t.shape)}")
        return out


# (batch, heads, S, d, block, causal, dtype, scale of the inputs); batch, heads
# and d never exceed block, so the watch can tell a key dimension by its size
ATTENTION_CASES = [
    (1, 2, 37, 8, 8, False, torch.float64, 1.0),
    (2, 3, 37, 8, 8, True, torch.float64, 1.0),
    (1, 1, 50, 4, 7, True, torch.float32, 1.0),
    (1, 2, 64, 16, 16, False, torch.float32, 1.0),
    (2, 1, 45, 8, 10, True, torch.float64, 1.0),
    (1, 2, 41, 8, 12, True, torch.float32, 8.0),  # scores of hundreds: exp overflows
    (1, 2, 33, 8, 9, True, torch.bfloat16, 1.0),
    (1, 1, 20, 8, 64, True, torch.float64, 1.0),  # one block holds every key
    (1, 2, 37, 8, 8, False, torch.float64, 1.0),  # the first case's shape, new data
    (1, 1, 200, 4, 8, True, torch.float64, 1.0),  # 25 blocks: keeping all scores shows
]
# elements alive at once, in units of one block's scores (S x max(block, d) per
# batch and head): a right answer keeps under 8 (q, k, v, the output, the
# log-sum-exp and a block's temporaries); every block's scores kept is S / block
ALIVE_BLOCKS = 12
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 4e-2}


def _attention_hint(q, k, v, got, causal, block):
    """Name the mistake from what the learner's result equals instead."""
    atol = 5e-2 if got.dtype == torch.bfloat16 else 1e-5
    if not torch.isfinite(got).all():
        return ("your result has nan or inf: subtract each row's maximum before exp "
                "(or merge with logaddexp), and let a row that sees no key of a "
                "block contribute nothing instead of nan")
    other = F.scaled_dot_product_attention(q, k, v, is_causal=not causal)
    if torch.allclose(got.double(), other.double(), atol=atol):
        return "use the causal argument: mask keys after the query only when causal"
    unscaled = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)
    if torch.allclose(got.double(), unscaled.double(), atol=atol):
        return "scale the scores by 1 / sqrt(d), as attention does"
    s = k.shape[2]
    full = (s // block) * block
    if 0 < full < s:
        mask = None
        if causal:
            mask = torch.arange(s)[:, None] >= torch.arange(full)[None, :]
        cut = F.scaled_dot_product_attention(q, k[:, :, :full], v[:, :, :full],
                                             attn_mask=mask)
        if torch.allclose(got.double(), cut.double(), atol=atol):
            return (f"the last {s - full} keys are missing: when S is not a multiple "
                    "of block, the last block is shorter")
    if q.dtype == torch.float64:
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if (got - want).abs().max() < TOLERANCE[torch.float32]:
            return ("right to float32's rounding only: compute in the inputs' dtype "
                    "(the running log-sum-exp too, not a float32 tensor)")
    if causal:
        per_block = torch.zeros(s, s, dtype=torch.bool)
        for start in range(0, s, block):
            stop = min(start + block, s)
            per_block[:, start:stop] = torch.ones(s, stop - start,
                                                  dtype=torch.bool).tril()
        local = F.scaled_dot_product_attention(q, k, v, attn_mask=per_block)
        if torch.allclose(got.double(), local.double(), atol=atol):
            return ("the causal mask must compare positions in the whole sequence: "
                    "key start + j is visible to query i when start + j <= i")
    return ("merge each block's result with the log-sum-exp rule: new lse = "
            "logaddexp(lse, lse_b), output = out * exp(lse - new) + out_b * "
            "exp(lse_b - new)")


def check_blockwise_attention(blockwise_attention) -> None:
    """Exercise 11.1: ``blockwise_attention(q, k, v, block, causal)``."""
    ex = "11.1"
    require_solution(ex, blockwise_attention)
    for i, (b, h, s, d, block, causal, dtype, scale) in enumerate(ATTENTION_CASES):
        gen = torch.Generator().manual_seed(100 + i)
        q, k, v = (scale * torch.randn(b, h, s, d, generator=gen, dtype=dtype)
                   for _ in range(3))
        copies = [t.clone() for t in (q, k, v)]
        case = (f"shape {(b, h, s, d)}, block {block}, causal={causal}, "
                f"{str(dtype).replace('torch.', '')}")
        watch = _Watch(block, (k, v))
        with watch:
            got = _call(ex, blockwise_attention, q, k, v, block, causal)
        if not isinstance(got, torch.Tensor):
            fail(ex, "the attention output, one tensor", f"a {type(got).__name__}",
                 "return only the output, shaped like q")
        if any(not torch.equal(a, c) for a, c in zip((q, k, v), copies, strict=True)):
            fail(ex, "q, k and v left unchanged", f"an input modified ({case})",
                 "work on new tensors: in-place operations on q, k or v change the "
                 "caller's data")
        if tuple(got.shape) != (b, h, s, d):
            fail(ex, f"an output of shape {(b, h, s, d)} ({case})",
                 f"shape {tuple(got.shape)}", "one output row per query, like q")
        if block < s and watch.big is not None:
            op, shape = watch.big
            fail(ex, f"at most {block} keys at once: no tensor with two dimensions "
                 f"above {block} ({case})", f"{op} handled {shape}",
                 "compute the scores of one block of at most `block` keys at a "
                 "time: (S x block), never (S x S) or (S x 2 block), not even for "
                 "a mask")
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                              is_causal=causal)
        if got.dtype != dtype:
            fail(ex, f"an output of dtype {dtype} ({case})", f"{got.dtype}",
                 "keep the inputs' dtype: no float32-only or float64-only code")
        alive = watch.peak / (b * h * s * max(block, d))
        if block < s and alive > ALIVE_BLOCKS:
            fail(ex, f"at most a few blocks' scores alive at once ({case})",
                 f"{alive:.0f} times a block's scores (S x block) alive at once",
                 "merge each block into the running output and log-sum-exp as you "
                 "go, and let its scores go: every block's scores kept is the S x S "
                 "matrix in pieces")
        tol = TOLERANCE[dtype]
        diff = (got.double() - want).abs().nan_to_num(float("inf")).max().item()
        if diff > tol * max(1.0, want.abs().max().item()):
            fail(ex, f"attention equal to scaled_dot_product_attention ({case})",
                 f"a largest difference of {diff:.3g}",
                 _attention_hint(q.double(), k.double(), v.double(), got, causal,
                                 block))
    passed(ex, f"{len(ATTENTION_CASES)} cases, causal and not, odd lengths, "
               "float64, float32 and bfloat16: exact to rounding, never more than "
               "a block of keys at once, nor every block's scores kept.")


# ---------------------------------------------------------------- exercise 11.2

# (tokens, k, experts, ranks, capacity, seed, dtype of expert_idx)
DISPATCH_CASES = [(13, 2, 4, 2, 4, 0, torch.int64), (17, 2, 6, 3, 3, 1, torch.int64),
                  (10, 1, 3, 3, 4, 2, torch.int32), (9, 3, 6, 2, 3, 3, torch.int64),
                  (8, 2, 6, 3, 16, 4, torch.int64), (21, 2, 6, 3, 5, 5, torch.int64),
                  (23, 2, 8, 4, 4, 6, torch.int32)]


def skewed_choices(tokens: int, k: int, experts: int, seed: int) -> torch.Tensor:
    """(tokens, k) distinct experts per token, low-numbered experts preferred."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(experts, 0, -1, dtype=torch.float64) ** 2
    return torch.stack([torch.multinomial(weights, k, generator=gen)
                        for _ in range(tokens)])


def kept_assignments(expert_idx: torch.Tensor, experts: int, capacity: int,
                     by_choice: bool = True) -> list[int]:
    """Assignment numbers t * k + j an expert accepts, at most capacity each."""
    t, k = expert_idx.shape
    order = ([(j, i) for j in range(k) for i in range(t)] if by_choice
             else [(j, i) for i in range(t) for j in range(k)])
    taken, kept = [0] * experts, []
    for j, i in order:
        e = int(expert_idx[i, j])
        if taken[e] < capacity:
            taken[e] += 1
            kept.append(i * k + j)
    return sorted(kept)


def _as_plan(ex, got, n_assign, world_size, case):
    try:
        order, counts = got
        order = torch.as_tensor(order)
        counts = [int(c) for c in torch.as_tensor(counts).flatten().tolist()]
    except (TypeError, ValueError, RuntimeError):
        fail(ex, "(order, send_counts)", f"{got!r:.80}",
             "return a tensor of assignment numbers and a list of counts per rank")
    if order.dim() != 1 or order.is_floating_point() or order.is_complex():
        fail(ex, f"order as a 1-D tensor of whole numbers ({case})",
             f"dtype {order.dtype}, shape {tuple(order.shape)}",
             "order lists assignment numbers t * k + j, one dimension")
    order = order.long()
    if len(counts) != world_size:
        fail(ex, f"{world_size} send counts, one per rank ({case})", f"{len(counts)}",
             "one count per destination rank, even for 3 ranks")
    if len(order) and (order.min() < 0 or order.max() >= n_assign):
        fail(ex, f"assignment numbers in 0..{n_assign - 1} ({case})",
             f"{order.min().item()}..{order.max().item()}",
             "number assignment (t, j) as t * k + j")
    if len(set(order.tolist())) != len(order):
        fail(ex, f"each kept assignment once ({case})", "a repeated number",
             "an assignment goes to its expert once")
    if any(c < 0 for c in counts) or sum(counts) != len(order):
        fail(ex, f"send_counts adding up to len(order) = {len(order)} ({case})",
             f"{counts}", "send_counts[r] is how many entries of order go to rank r")
    return order, counts


def check_plan_dispatch(plan_dispatch) -> None:
    """Exercise 11.2: ``plan_dispatch(expert_idx, n_experts, world_size, capacity)``."""
    ex = "11.2"
    require_solution(ex, plan_dispatch)
    first = None
    for tokens, k, experts, world_size, capacity, seed, dtype in DISPATCH_CASES:
        idx = skewed_choices(tokens, k, experts, seed).to(dtype)
        case = (f"{tokens} tokens, top-{k}, {experts} experts on {world_size} ranks, "
                f"capacity {capacity}, {str(dtype).replace('torch.', '')}")
        order, counts = _plan(ex, plan_dispatch, idx, experts, world_size, capacity,
                              case)
        if first is None:  # the same question again, at once
            first = _plan(ex, plan_dispatch, idx, experts, world_size, capacity, case)
            if first[0].tolist() != order.tolist() or first[1] != counts:
                fail(ex, f"the same plan when asked twice ({case})",
                     "a different plan the second time",
                     "keep no state between calls: each call plans its own "
                     "expert_idx")
        want = kept_assignments(idx, experts, capacity)
        mine = sorted(order.tolist())
        if mine != want:
            load = torch.bincount(idx.flatten()[order], minlength=experts)
            if load.max() > capacity:
                hint = (f"expert {int(load.argmax())} got {int(load.max())} "
                        f"assignments: drop those beyond the capacity")
            elif mine == kept_assignments(idx, experts, capacity, by_choice=False):
                hint = ("all first choices come before any second choice; token "
                        "order only breaks ties within a choice")
            elif mine == kept_assignments(idx, experts, capacity - 1):
                hint = "an expert accepts capacity assignments, not capacity - 1"
            else:
                hint = ("keep, per expert, the first capacity assignments in "
                        "priority order: choice j first, then token t")
            fail(ex, f"the {len(want)} assignments that fit ({case})",
                 f"{len(mine)} kept, {len(set(mine) ^ set(want))} differ", hint)
        per_rank = experts // world_size
        dest = idx.flatten()[order] // per_rank
        start = 0
        for r, c in enumerate(counts):
            if not bool((dest[start:start + c] == r).all()):
                fail(ex, f"order grouped by destination rank, rank 0 first ({case})",
                     f"entries {start}..{start + c - 1} (rank {r}'s) go to ranks "
                     f"{sorted(set(dest[start:start + c].tolist()))}",
                     f"expert e lives on rank e // {per_rank}: sort the kept "
                     "assignments by it and count each rank")
            start += c
    _real_exchange(ex, plan_dispatch)
    passed(ex, f"{len(DISPATCH_CASES)} skewed routings on 2, 3 and 4 ranks, int64 "
               "and int32; the real all-to-all on 3 ranks equals one process.")


def _plan(ex, plan_dispatch, idx, experts, world_size, capacity, case):
    """The learner's plan for ``idx`` (the real tensor, watched for changes)."""
    before = idx.clone()
    got = _call(ex, plan_dispatch, idx, experts, world_size, capacity)
    if idx.dtype != before.dtype or not torch.equal(idx, before):
        fail(ex, f"expert_idx left unchanged ({case})", "expert_idx modified",
             "work on a copy: the router's choices are still needed to combine the "
             "results")
    return _as_plan(ex, got, idx.numel(), world_size, case)


WIDTH = 8


def _experts(n: int) -> list[torch.nn.Linear]:
    torch.manual_seed(11)
    return [torch.nn.Linear(WIDTH, WIDTH) for _ in range(n)]


def _exchange_rank(rank, world_size, plans, x_all, idx_all, gate_all, experts):
    """The real dispatch and combine, with this rank's plan (order, counts)."""
    import torch.distributed as dist

    x, idx = x_all.chunk(world_size)[rank], idx_all.chunk(world_size)[rank]
    gate, (order, send) = gate_all.chunk(world_size)[rank], plans[rank]
    send_counts = torch.tensor(send)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)  # the counts first
    recv = recv_counts.tolist()
    k = idx.shape[1]
    x_recv = torch.empty(sum(recv), WIDTH)
    dist.all_to_all_single(x_recv, x[order // k].contiguous(), recv, send)
    e_recv = torch.empty(sum(recv), dtype=torch.long)
    dist.all_to_all_single(e_recv, idx.flatten()[order].contiguous(), recv, send)
    layers = _experts(experts)
    y_recv = torch.zeros_like(x_recv)
    per_rank = experts // world_size
    with torch.no_grad():
        for e in range(rank * per_rank, (rank + 1) * per_rank):  # this rank's only
            rows = e_recv == e
            y_recv[rows] = layers[e](x_recv[rows])
    y_back = torch.empty(len(order), WIDTH)
    dist.all_to_all_single(y_back, y_recv, send, recv)  # the splits swapped
    return torch.zeros_like(x).index_add(0, order // k,
                                         y_back * gate.flatten()[order, None])


def _real_exchange(ex, plan_dispatch) -> None:
    from course_utils.dist import LaunchTimeout, RankFailed, launch

    tokens, k, experts, world_size, capacity = 24, 2, 6, 3, 3
    idx = skewed_choices(tokens, k, experts, seed=9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, WIDTH, generator=gen)
    gate = torch.rand(tokens, k, generator=gen)
    layers = _experts(experts)
    want, plans = torch.zeros_like(x), []
    for rank, rows in enumerate(torch.arange(tokens).chunk(world_size)):
        plans.append(_plan(ex, plan_dispatch, idx[rows], experts, world_size,
                           capacity, f"rank {rank} of {world_size}"))
        for a in kept_assignments(idx[rows], experts, capacity):  # one process
            t, j = divmod(a, k)
            token = int(rows[t])
            with torch.no_grad():
                want[token] += gate[token, j] * layers[int(idx[token, j])](x[token])
    try:
        results = launch(_exchange_rank, world_size,
                         args=(plans, x, idx, gate, experts),
                         timeout=answer_limit(ex),
                         echo=False, backend="gloo")
    except (RankFailed, LaunchTimeout) as e:
        fail(ex, "the real exchange on 3 ranks to run", str(e).splitlines()[0],
             "order and send_counts must agree: send_counts[r] entries for rank r")
    got = torch.cat([r.value for r in results])
    if not torch.allclose(got, want, atol=1e-5):
        fail(ex, "the expert-parallel layer equal to one process (3 ranks)",
             f"a largest difference of {(got - want).abs().max().item():.3g}",
             "order and send_counts must describe the same kept assignments")


# ---------------------------------------------------------------- exercise 11.3

_MEASURED: dict[tuple, list[list[int]]] = {}


def _ring_rank(rank, world_size, seq_len, layouts):
    """Causal ring attention on tiny tensors: the scores each layout computes."""
    import torch.distributed as dist

    counts = []
    for chunks in layouts:
        torch.manual_seed(0)
        k = torch.randn(1, 1, seq_len, 4).chunk(sum(map(len, chunks)), dim=2)
        q_l = k_l = torch.cat([k[i] for i in chunks[rank]], 2)
        c, scores = k[0].shape[2], 0
        for step in range(world_size):
            src = (rank - step) % world_size
            if step < world_size - 1:
                nxt = torch.empty_like(k_l)
                reqs = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, k_l, (rank + 1) % world_size),
                    dist.P2POp(dist.irecv, nxt, (rank - 1) % world_size)])
            for i, qc in enumerate(chunks[rank]):
                for j, kc in enumerate(chunks[src]):
                    if kc <= qc:
                        rows = q_l[:, :, i * c:(i + 1) * c]
                        scores += (rows @ k_l[:, :, j * c:(j + 1) * c].mT).numel()
            if step < world_size - 1:
                for r in reqs:
                    r.wait()
                k_l = nxt
        counts.append(scores)
    return counts


def measured_scores(world_size: int, seq_len: int,
                    layouts: list[list[list[int]]]) -> list[list[int]]:
    """Scores per rank of the real causal ring, per layout (run once, cached)."""
    from course_utils.dist import launch

    key = (world_size, seq_len, repr(layouts))
    if key not in _MEASURED:
        results = launch(_ring_rank, world_size, args=(seq_len, layouts),
                         timeout=answer_limit("11.3"),
                         echo=False, backend="gloo")
        _MEASURED[key] = [[r.value[i] for r in results] for i in range(len(layouts))]
    return _MEASURED[key]


def score_layouts(world_size: int, seed: int) -> list[list[list[int]]]:
    """Layouts not shown in the chapter: chunks dealt out in shuffled orders."""
    gen = torch.Generator().manual_seed(seed)
    n = world_size
    striped = [[r, r + n] for r in range(n)]
    dealt = torch.randperm(2 * n, generator=gen).view(n, 2).tolist()
    three = torch.randperm(3 * n, generator=gen).view(n, 3).tolist()
    backwards = [[n - 1 - r] for r in range(n)]
    return [striped, dealt, three, backwards]


SCORE_CASES = [(2, 24, 7), (3, 36, 8)]  # (ranks, sequence length, seed)


def _score_variants(seq_len: int, layout: list[list[int]]) -> dict[str, list[float]]:
    """What typical mistakes predict, by name."""
    n_chunks = sum(map(len, layout))
    every = [x for chunks in layout for x in chunks]
    c = seq_len / n_chunks

    def count(rule, size=c, diagonal=1.0):
        return [sum(size * size * (diagonal if kc == qc else 1.0)
                    for qc in mine for kc in every if rule(kc, qc))
                for mine in layout]

    n = len(layout)
    return {
        "half": count(lambda kc, qc: kc <= qc, diagonal=0.5),
        "triangle": count(lambda kc, qc: kc <= qc, diagonal=(c + 1) / (2 * c)),
        "strict": count(lambda kc, qc: kc < qc),
        "all": count(lambda kc, qc: True),
        "later": count(lambda kc, qc: kc >= qc),
        "size": count(lambda kc, qc: kc <= qc, size=seq_len / n),
        "contiguous": [(r + 1) * (seq_len / n) ** 2 for r in range(n)],
        "rank": [sum(c * c for kc in every if kc <= r) for r in range(n)],
    }


_SCORE_HINTS = {
    "half": "the diagonal block is computed whole, masked half included: count "
            "c * c for it, not half",
    "triangle": "the diagonal block is computed whole (c * c scores), although the "
                "mask keeps only c (c + 1) / 2 of them",
    "strict": "the diagonal block (a chunk with itself) is computed too, with a mask",
    "all": "the ring is causal: a block whose keys all come after its queries is "
           "skipped",
    "later": "a query sees the keys at or BEFORE it: key chunk <= query chunk",
    "size": "a chunk holds seq_len / (number of chunks in the layout) tokens, not "
            "seq_len / ranks",
    "contiguous": "read the layout: rank r holds the chunks layout[r], not chunk r",
    "rank": "compare chunk numbers, not rank numbers: the chunks layout[r] that "
            "rank r holds",
}


def check_predict_scores(predict_scores) -> None:
    """Exercise 11.3: ``predict_scores(seq_len, layout)`` against the real ring."""
    ex = "11.3"
    require_solution(ex, predict_scores)
    for world_size, seq_len, seed in SCORE_CASES:
        layouts = score_layouts(world_size, seed)
        measured = measured_scores(world_size, seq_len, layouts)
        for layout, want in zip(layouts, measured, strict=True):
            case = f"S = {seq_len}, layout {layout}"
            shown = [list(chunks) for chunks in layout]
            got = _call(ex, predict_scores, seq_len, shown)
            if shown != layout:
                fail(ex, f"layout left unchanged ({case})", f"{shown}",
                     "read the layout; do not sort or modify it")
            try:
                got = [float(g) for g in got]
            except (TypeError, ValueError):
                fail(ex, f"a list of {world_size} numbers ({case})", f"{got!r:.80}",
                     "one number of scores per rank")
            if len(got) != world_size:
                fail(ex, f"{world_size} numbers, one per rank ({case})",
                     f"{len(got)}", "one number per rank: len(layout) of them")
            if all(math.isclose(g, w) for g, w in zip(got, want, strict=True)):
                continue
            hint = ("for each chunk a rank holds, count the chunks of the whole "
                    "layout at or before it, c * c scores each")
            for name, variant in _score_variants(seq_len, layout).items():
                if all(math.isclose(g, w) for g, w in zip(got, variant, strict=True)):
                    hint = _SCORE_HINTS[name]
                    break
            else:
                if all(g > 0 for g in got) and len(
                        {round(w / g, 6) for g, w in zip(got, want, strict=True)}) == 1:
                    hint = ("the proportions are right but not the scale: a chunk "
                            "holds c = seq_len / (chunks in the layout) tokens, and "
                            "a block of c queries and c keys is c * c scores")
            fail(ex, f"scores per rank {want} as measured ({case})",
                 f"{[int(g) if g.is_integer() else g for g in got]}", hint)
    passed(ex, "your prediction matches the real ring on 2 and 3 ranks, on "
               f"{sum(len(score_layouts(n, s)) for n, _, s in SCORE_CASES)} layouts "
               "you had not seen.")
