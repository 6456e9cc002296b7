# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 11: Long sequences and many experts
#
# **What you will learn**
#
# - Why attention's memory grows with the sequence, and what ranks that split
#   the sequence must exchange: the keys and values.
# - Ring attention built by hand: K/V blocks passed around a ring with
#   `batch_isend_irecv`, partial softmaxes merged with the log-sum-exp rule,
#   equal to one process; the causal load imbalance and its zig-zag fix.
# - A trainable variant with an autograd all-gather, and a trap: one of
#   PyTorch's autograd all-gathers returns wrong gradients here, silently.
# - Expert parallelism: a top-2 mixture of experts whose tokens travel to their
#   experts' ranks by `all_to_all_single`, equal to one process forward and
#   backward; load balance, capacity factors and the balancing loss.
#
# **Hardware.** Every rank is a real process; collectives go through `gloo`
# on CPUs and `nccl` when there is a GPU per rank. PyTorch's own
# `context_parallel` API needs CUDA attention kernels (on a CPU it never
# returns), so this chapter builds both parallelisms by hand, runs the library
# API only when there are GPUs, and shows published and predicted GPU figures
# beside the CPU measurements.

# %%
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_utils import banner, predict, reference
from course_utils.checks.ch11 import (
    check_blockwise_attention,
    check_plan_dispatch,
    check_predict_scores,
)
from course_utils.devices import format_bytes, gpu_count
from course_utils.dist import launch

banner()
torch.set_num_threads(1)  # this process only computes small tensors: one thread
# is as fast, and does not fight other programs for the cores


def rank_device(rank):
    """This rank's GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device(f"cuda:{rank}")
    return torch.device("cpu")


# %% [markdown]
# ## 1. Attention's memory grows with the sequence
#
# Self-attention compares every position with every other: for a sequence of
# `S` tokens the scores form an `S x S` matrix per head. Written plainly, autograd
# keeps that matrix for the backward pass. We count what it keeps with a
# saved-tensors hook (each storage once), for the plain formula and for
# `F.scaled_dot_product_attention`, whose CPU kernel is a flash-attention
# kernel that keeps only its inputs, its output and one log-sum-exp per row:

# %%
def saved_bytes(fn, *args):
    """Bytes autograd keeps for the backward of fn(*args), each storage once."""
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total[0]


def plain_attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


HEADS, HEAD_DIM = 4, 32
memory = {}
for seq in (256, 512, 1024):
    q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, requires_grad=True)
               for _ in range(3))
    memory[seq] = (saved_bytes(plain_attention, q, k, v),
                   saved_bytes(F.scaled_dot_product_attention, q, k, v))
    print(f"S = {seq:4d}: plain {format_bytes(memory[seq][0]):>9}, "
          f"SDPA {format_bytes(memory[seq][1]):>9} kept for the backward")
grow = [memory[1024][i] / memory[512][i] for i in (0, 1)]
print(f"verdict: doubling S multiplied the plain formula's bytes by {grow[0]:.1f} "
      f"(the S x S matrices) and SDPA's by {grow[1]:.1f}")

# %% [markdown]
# A flash kernel removes the `S x S` term, but what is left still grows with
# `S` - activations, inputs, outputs, in every layer - and the compute grows as
# `S^2`. At the 128K-token contexts of today's large models (DeepSeek-V3's,
# for one, per its README) one GPU runs short of both. **Context parallelism**
# splits the sequence: rank `r` of `N` keeps its `S / N` rows of Q, K and V.
# Its queries still need *every* key and value, so the ranks must exchange K
# and V (the queries and outputs stay put). Two ways: pass K/V blocks around a
# ring (ring attention), or all-gather them.
#
# ## 2. Ring attention by hand
#
# Attention over a set of keys can be computed block by block. For a block of
# keys, a query row gets a partial output `o_b` (softmax over that block only)
# and the log-sum-exp `l_b` of its scores. Two partial results merge exactly:
#
# $$l = \log(e^{l_a} + e^{l_b}), \qquad o = e^{l_a - l}\, o_a + e^{l_b - l}\, o_b.$$
#
# Each weight is that block's share of the whole softmax denominator. Start
# with `o = 0`, `l = -inf` and merge blocks in any order.

# %%
def block_attention(q, k, v, mask=None):
    """Partial attention of q over one block of keys: (output, log-sum-exp)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def merge(out, lse, out_b, lse_b):
    """Merge two partial attention results with the log-sum-exp rule."""
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new) + out_b * torch.exp(lse_b - new), new


# %% [markdown]
# The ring: at step `s` rank `r` holds the K/V block that started on rank
# `r - s`. It starts sending that block to rank `r + 1` and receiving the next
# one from `r - 1` (`batch_isend_irecv`, non-blocking), computes with the block
# it has, then waits: on GPUs the transfer hides behind the computation. After
# `N` steps every query has met every key, and no rank ever held more than two
# K/V blocks.
#
# The sequence is cut into chunks, and `layout[r]` lists the chunks rank `r`
# holds. With causal attention a query may only see keys at or before it: a
# pair of chunks is fully visible (key chunk earlier), a diagonal pair gets a
# triangular mask, and a pair whose key chunk is later is skipped. Each rank
# counts the query-key scores it computed and the tensors it sent.

# %%
def contiguous(n):
    """Rank r holds chunk r of N."""
    return [[r] for r in range(n)]


def zigzag(n):
    """Rank r holds chunks r and 2N - 1 - r of 2N (see the causal imbalance)."""
    return [[r, 2 * n - 1 - r] for r in range(n)]


def ring_attention(rank, world_size, q, k, v, causal, layout):
    dev = rank_device(rank)
    chunks = layout(world_size)
    pieces = [t.chunk(sum(map(len, chunks)), dim=2) for t in (q, k, v)]
    q_l, k_l, v_l = (torch.cat([p[i] for i in chunks[rank]], 2).to(dev)
                     for p in pieces)
    c = pieces[0][0].shape[2]  # chunk length
    out = torch.zeros_like(q_l)
    lse = torch.full((*q_l.shape[:-1], 1), float("-inf"), device=dev)
    scores = sent = 0
    for step in range(world_size):
        src = (rank - step) % world_size  # the rank this K/V block started on
        if step < world_size - 1:
            k_next, v_next = torch.empty_like(k_l), torch.empty_like(v_l)
            after, before = (rank + 1) % world_size, (rank - 1) % world_size
            requests = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, k_l, after), dist.P2POp(dist.isend, v_l, after),
                dist.P2POp(dist.irecv, k_next, before),
                dist.P2POp(dist.irecv, v_next, before)])
            sent += 2
        for i, qc in enumerate(chunks[rank]):
            for j, kc in enumerate(chunks[src]):
                if causal and kc > qc:
                    continue  # every key in the future: nothing to compute
                mask = (torch.ones(c, c, dtype=torch.bool, device=dev).tril()
                        if causal and kc == qc else None)
                rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                o_b, lse_b = block_attention(q_l[:, :, rows], k_l[:, :, cols],
                                             v_l[:, :, cols], mask)
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows],
                                                         lse[:, :, rows], o_b, lse_b)
                scores += c * c
        if step < world_size - 1:
            for request in requests:
                request.wait()
            k_l, v_l = k_next, v_next
    return out.cpu(), scores, sent


def unshard(outs, layout, world_size):
    """Put each rank's chunks back in sequence order."""
    chunks = layout(world_size)
    n = sum(map(len, chunks))
    pieces = {}
    for r, out in enumerate(outs):
        for i, piece in zip(chunks[r], out.chunk(len(chunks[r]), dim=2), strict=True):
            pieces[i] = piece
    return torch.cat([pieces[i] for i in range(n)], dim=2)


# %% [markdown]
# Four ranks, a sequence of 512 (4 heads of 32), causal and not, against one
# process computing all of it with `F.scaled_dot_product_attention` (the same
# launch also runs a third layout, zig-zag, which we come back to):

# %%
N_RING, SEQ = 4, 512
torch.manual_seed(0)
q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM) for _ in range(3))


RUNS = ((False, contiguous), (True, contiguous), (True, zigzag))


def ring_runs(rank, world_size, q, k, v):
    return [ring_attention(rank, world_size, q, k, v, causal, layout)
            for causal, layout in RUNS]


results = launch(ring_runs, N_RING, args=(q, k, v), timeout=60, echo=False)
ring = {causal: [r.value[causal] for r in results] for causal in (False, True)}
zigzag_run = [r.value[2] for r in results]  # shown in the causal imbalance
for causal in (False, True):
    got = unshard([r[0] for r in ring[causal]], contiguous, N_RING)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    print(f"causal={causal!s:5}: largest difference from one process "
          f"{(got - want).abs().max().item():.1e}; tensors sent per rank "
          f"{[r[2] for r in ring[causal]]}")
block = q[:, :, :SEQ // N_RING].nelement() * q.element_size()
print(f"each message is one K or V block of {format_bytes(block)}: each rank sends "
      f"{2 * (N_RING - 1)} of them, {format_bytes(2 * (N_RING - 1) * block)} in all")

# %% [markdown]
# Exact, to rounding. Each rank sends `2 (N - 1)` blocks: all of K and V except
# its own, the same volume as an all-gather, spread over `N - 1` steps.
#
# ### The causal imbalance
#
# With causal attention, rank 0 holds the first queries, which see only the
# first keys; the last rank's queries see everything. The scores each rank
# computed:

# %%
def imbalance(per_rank):
    return max(per_rank) / (sum(per_rank) / len(per_rank))


work = [r[1] for r in ring[True]]
print(f"scores computed per rank (causal, contiguous chunks): {work}")
print(f"the busiest rank does {imbalance(work):.2f}x the average: every step waits "
      f"for it, so the ring runs at {1 / imbalance(work):.0%} of its capacity")

# %% [markdown]
# Rank 0 computes at the first step and then idles; the last rank computes at
# every step. The fix (zig-zag, or head-tail, sharding) cuts the sequence into
# `2N` chunks and gives rank `r` chunk `r` *and* chunk `2N - 1 - r`: one early
# and one late chunk each, so every rank gets the same mix. The ring code is
# unchanged; only the layout differs. The launch above already ran it, as its
# third run:

# %%
print("chunks per rank:", zigzag(N_RING))
outs, balanced, _ = zip(*zigzag_run, strict=True)
got = unshard(outs, zigzag, N_RING)
want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
print(f"zig-zag: largest difference from one process {(got - want).abs().max():.1e}")
print(f"scores per rank {list(balanced)}: busiest / average {imbalance(balanced):.2f} "
      f"(contiguous: {imbalance(work):.2f}); total {sum(balanced)} vs {sum(work)}")

# %% [markdown]
# Every rank now computes the same number of scores, and fewer in total: the
# smaller chunks make the diagonal blocks, where half the scores are masked
# but still computed, smaller. PyTorch's `context_parallel` does the same by
# default for causal attention (its head-tail load balancer), and Llama 3's
# context parallelism splits the sequence this way too.
#
# ## 3. A trainable variant: all-gather K/V
#
# The ring above has no backward: `isend`/`irecv` are not recorded by
# autograd. The simplest trainable form gathers K and V with an **autograd
# collective**: forward all-gathers the blocks, backward reduce-scatters their
# gradients back to the ranks that own them. Each rank then runs ordinary
# `F.scaled_dot_product_attention` of its queries against the whole K and V,
# with a causal mask shifted to its rows (the all-gather-based context
# parallelism of Llama 3). PyTorch has two autograd all-gathers; we try both and
# compare every gradient with one process:

# %%
def allgather_attention(rank, world_size, q, k, v, weight):
    import torch.distributed.nn.functional as dist_nn
    from torch.distributed._functional_collectives import all_gather_single_autograd

    warnings.simplefilter("ignore", FutureWarning)  # dist_nn's deprecation
    dev, group = rank_device(rank), dist.group.WORLD
    c = q.shape[2] // world_size
    rows = slice(rank * c, (rank + 1) * c)
    mask = ((torch.arange(c) + rank * c)[:, None]
            >= torch.arange(q.shape[2])[None, :]).to(dev)
    gathers = {
        "torch.distributed.nn.functional.all_gather":
            lambda t: torch.cat(dist_nn.all_gather(t), dim=2),
        "_functional_collectives.all_gather_single_autograd":
            lambda t: all_gather_single_autograd(t, 2, group),
    }
    found = {}
    for name, gather in gathers.items():
        q_l, k_l, v_l = (t[:, :, rows].to(dev).requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_l, gather(k_l), gather(v_l),
                                             attn_mask=mask)
        (out * weight[:, :, rows].to(dev)).sum().backward()
        found[name] = [t.cpu() for t in (out.detach(), q_l.grad, k_l.grad, v_l.grad)]
    return found


torch.manual_seed(1)
N_AG = 2
q, k, v, weight = (torch.randn(1, HEADS, 64, HEAD_DIM, dtype=torch.float64)
                   for _ in range(4))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
one = F.scaled_dot_product_attention(*leaves, is_causal=True)
(one * weight).sum().backward()
ranks = [r.value for r in launch(allgather_attention, N_AG,
                                 args=(q, k, v, weight), timeout=60, echo=False)]
for name in ranks[0]:
    worst = []
    for i, want in enumerate([one.detach()] + [t.grad for t in leaves]):
        got = torch.cat([r[name][i] for r in ranks], dim=2)
        worst.append((got - want).abs().max().item())
    print(f"{name}:\n   largest difference from one process: output {worst[0]:.0e}, "
          f"dQ {worst[1]:.0e}, dK {worst[2]:.0e}, dV {worst[3]:.0e} -> "
          + ("exact" if max(worst) < 1e-10 else "WRONG gradients"))

# %% [markdown]
# **Check your gradients.** On gloo the first one returns K and V gradients that
# are simply wrong - no error, no warning - while the output and the Q
# gradients are right. Without a reduce-scatter, its backward on gloo emulates
# one with an all-to-all into buffers made by `empty_like` of the incoming
# gradients. The CPU attention backward delivers the K and V gradients in a
# permuted memory layout (sequence before heads); `empty_like` keeps that
# layout, and gloo writes what it receives in plain storage order
# (pytorch/pytorch#192920, open in 2.13; the function is deprecated in
# favour of the functional collectives). Over `nccl` its backward is a real
# reduce-scatter and both lines print "exact": the bug is the emulation's.
# The functional collective `all_gather_single_autograd` is exact on both.
# A distributed layer that only compared losses, or the forward output,
# would never notice: compare the gradients with one process, once, for
# each parallel layout.
#
# ## 4. Expert parallelism
#
# A **mixture of experts** (MoE) layer replaces one feed-forward network by
# `E` of them and a router: for each token the router picks its top `k`
# experts and mixes their outputs with the router's weights. The parameters
# grow `E` times while the computation per token grows only `k` times. Expert
# parallelism puts different experts on different ranks, so each token must
# travel to the ranks of its experts and its results must come back: two
# all-to-alls per layer. First the one-process layer, the reference:

# %%
WIDTH, HIDDEN, N_EXPERTS, TOP_K = 16, 32, 6, 2


def make_moe(seed=0):
    torch.manual_seed(seed)
    router = nn.Linear(WIDTH, N_EXPERTS, bias=False)
    experts = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(),
                                          nn.Linear(HIDDEN, WIDTH))
                            for _ in range(N_EXPERTS))
    return router, experts


def route(x, router, skew=0.0):
    """Top-k experts per token and their weights (renormalised to sum to 1)."""
    logits = router(x)
    logits = logits + skew * torch.arange(N_EXPERTS, 0, -1, device=x.device) / N_EXPERTS
    gate, expert = logits.softmax(-1).topk(TOP_K, dim=-1)
    return gate / gate.sum(-1, keepdim=True), expert


def moe_one_process(x, router, experts, skew=0.0):
    gate, expert = route(x, router, skew)
    y = torch.zeros_like(x)
    for e in range(N_EXPERTS):
        token, slot = (expert == e).nonzero(as_tuple=True)
        y = y.index_add(0, token, experts[e](x[token]) * gate[token, slot, None])
    return y


# %% [markdown]
# The expert-parallel layer. Each of `N` ranks holds `E / N` experts and its
# own tokens. It sorts its `T x k` (token, expert) assignments by expert, which
# groups them by destination rank, and counts how many go to each rank. The
# receivers cannot know how much will arrive, so the **counts travel first**
# (an all-to-all of `N` integers); then the token vectors go with uneven splits,
# `all_to_all_single(output, input, output_split_sizes, input_split_sizes)`,
# together with the expert each is for. Each rank runs its experts on what it
# received, a second all-to-all sends the results back with the splits
# swapped, and each token sums its experts' results times the gates. For the
# backward, the token all-to-alls use the functional collective with autograd.

# %%
def moe_expert_parallel(rank, world_size, x_all, skew):
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    dev, group, per_rank = rank_device(rank), dist.group.WORLD, N_EXPERTS // world_size
    router, experts = (m.to(dev) for m in make_moe())
    x = x_all.chunk(world_size)[rank].to(dev).clone().requires_grad_()
    gate, expert = route(x, router, skew)
    flat = expert.flatten()
    order = flat.argsort(stable=True)  # assignments grouped by expert, so by rank
    send_counts = torch.bincount(flat // per_rank, minlength=world_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)  # the counts first
    send, recv = send_counts.tolist(), recv_counts.tolist()
    token = order // TOP_K
    x_recv = all_to_all_single_autograd(x[token], recv, send, group)
    e_recv = torch.empty(sum(recv), dtype=torch.long, device=dev)
    dist.all_to_all_single(e_recv, flat[order].contiguous(), recv, send)
    y_recv = torch.zeros_like(x_recv)
    for e in range(rank * per_rank, (rank + 1) * per_rank):
        rows = (e_recv == e).nonzero().squeeze(1)
        y_recv = y_recv.index_add(0, rows, experts[e](x_recv[rows]))
    y_back = all_to_all_single_autograd(y_recv, send, recv, group)  # splits swapped
    y = torch.zeros_like(x).index_add(0, token, y_back * gate.flatten()[order, None])
    (y ** 2).sum().backward()
    dist.all_reduce(router.weight.grad)  # the router is replicated: sum its gradient
    mine = {e: [p.grad for p in experts[e].parameters()]
            for e in range(rank * per_rank, (rank + 1) * per_rank)}
    return y.detach(), x.grad, router.weight.grad, mine, recv


def moe_runs(rank, world_size, x_all, skews):
    return [moe_expert_parallel(rank, world_size, x_all, skew) for skew in skews]


def compare_with_one_process(world_size, x, skews=(0.0,)):
    """Per skew: the largest difference from one process, and rows received."""
    ranks = [r.value for r in launch(moe_runs, world_size, args=(x, skews),
                                     timeout=60, echo=False)]
    found = []
    for i, skew in enumerate(skews):
        router, experts = make_moe()
        x1 = x.clone().requires_grad_()
        y1 = moe_one_process(x1, router, experts, skew)
        (y1 ** 2).sum().backward()
        run = [r[i] for r in ranks]
        y, dx = torch.cat([r[0] for r in run]), torch.cat([r[1] for r in run])
        diffs = [(y - y1).abs().max(), (dx - x1.grad).abs().max(),
                 (run[0][2] - router.weight.grad).abs().max()]
        for r in run:
            for e, grads in r[3].items():
                diffs += [(g - p.grad).abs().max() for g, p in
                          zip(grads, experts[e].parameters(), strict=True)]
        found.append((max(d.item() for d in diffs), [r[4] for r in run]))
    return found


torch.manual_seed(2)
tokens = torch.randn(30, WIDTH)
moe = {2: compare_with_one_process(2, tokens),
       3: compare_with_one_process(3, tokens, skews=(0.0, 3.0))}  # 3.0: see below
for n in (2, 3):
    worst, received = moe[n][0]
    print(f"{n} ranks, {N_EXPERTS // n} experts each: largest difference from one "
          f"process (output and every gradient) {worst:.1e}; token rows each rank "
          f"received from ranks 0..{n - 1}: {received}")

# %% [markdown]
# Equal to one process, forward and backward, with splits that differ from
# rank to rank (the lists above: no two ranks receive the same number of rows).
#
# ### Load balance: the problem
#
# Nothing forces the router to spread the tokens. A router that prefers some
# experts (here a bias towards the low-numbered ones, `skew`, as an untrained
# or collapsing router does) sends most tokens to one rank, which then
# computes for everyone while the others wait - and must hold buffers for
# however many arrive:

# %%
for skew, (worst, received) in zip((0.0, 3.0), moe[3], strict=True):
    load = [sum(r) for r in received]  # the 3-rank launch above ran both
    print(f"skew {skew}: rows received per rank {load} (of {TOP_K * len(tokens)}); "
          f"busiest / average {imbalance(load):.2f}; still equal to one process "
          f"({worst:.1e})")

# %% [markdown]
# Two remedies, which change different things:
#
# - A **capacity factor** (GShard, Switch Transformer) caps each expert at
#   `capacity = ceil(factor x T k / E)` assignments per batch. Buffers get a
#   fixed size and no rank gets more than its share, but assignments beyond
#   the cap are **dropped**: that expert's contribution is lost for the
#   token, which passes on through the residual connection.
# - An **auxiliary balancing loss** changes the router itself. Switch
#   Transformer's is `E * sum_i f_i P_i`, with `f_i` the fraction of tokens whose
#   first choice is expert `i` and `P_i` the mean router probability of `i`;
#   it is smallest when both are uniform. Added to the training loss with a
#   small weight, it teaches the router to spread the tokens.
#
# Measured on the skewed router, in one process: what each capacity factor
# drops, then the load after the router has trained on the balancing loss
# alone for 50 steps of gradient descent:

# %%
def expert_load(x, router, skew):
    _, expert = route(x, router, skew)
    return torch.bincount(expert.flatten(), minlength=N_EXPERTS)


def dropped(load, factor, n_tokens):
    capacity = math.ceil(factor * n_tokens * TOP_K / N_EXPERTS)
    return (load - capacity).clamp(min=0).sum().item(), capacity


def balancing_loss(x, router, skew):
    probs = (router(x) + skew * torch.arange(N_EXPERTS, 0, -1) / N_EXPERTS).softmax(-1)
    first = F.one_hot(probs.argmax(-1), N_EXPERTS).float()
    return N_EXPERTS * (first.mean(0) * probs.mean(0)).sum()


torch.manual_seed(3)
batch = torch.randn(600, WIDTH)
router, _ = make_moe()
for stage in ("before", "after"):
    if stage == "after":
        for _ in range(50):  # plain gradient descent on the router alone
            router.zero_grad()
            balancing_loss(batch, router, 3.0).backward()
            with torch.no_grad():
                router.weight -= 10.0 * router.weight.grad
    with torch.no_grad():
        load = expert_load(batch, router, 3.0)
        aux = balancing_loss(batch, router, 3.0).item()
    drops = ", ".join(f"{f}: {dropped(load, f, len(batch))[0] / load.sum().item():.0%}"
                      for f in (1.0, 1.25, 2.0))
    print(f"{stage} training on the balancing loss ({aux:.2f}; 1.00 is uniform): "
          f"load per expert {load.tolist()}\n   dropped with capacity factor {drops}")

# %% [markdown]
# The capacity factor trades dropped tokens for bounded buffers; the loss
# attacks the cause, so the same factors drop far fewer (the two lines
# above). Real models use
# both; DeepSeek-V3 balances its experts without an auxiliary loss (its report
# adjusts a per-expert bias of the routing scores during training instead).
# Exercise 11.2 builds the dispatch with a capacity.
#
# ## 5. The library path, and GPU figures
#
# `torch.distributed.tensor.experimental.context_parallel` does what section 2
# did, inside a context manager: it shards the buffers it is given along
# their sequence dimension (head-tail, that is zig-zag, for causal attention)
# and replaces `F.scaled_dot_product_attention` by ring attention. It handles
# the CUDA attention kernels only (flash, memory-efficient, cuDNN), so it runs
# here only with a GPU per rank:

# %%
def library_context_parallel(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (
        context_parallel_unshard,
    )

    mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1024, 64, device=f"cuda:{rank}") for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # q is sharded
    (out,) = context_parallel_unshard(mesh, [out], [2])
    return (out - want).abs().max().item()


if gpu_count() >= 2:
    n = gpu_count()
    worst = max(r.value for r in launch(library_context_parallel, n, timeout=120))
    print(f"context_parallel on {n} GPUs: largest difference from one GPU {worst:.1e}")
else:
    print(f"context_parallel not run: it needs a GPU per rank ({gpu_count()} GPU "
          "here); on CPU tensors it never returns")

# %% [markdown]
# Published figures from long-context and mixture-of-experts systems. Llama 3
# trained its 405B model first on 8K-token sequences, then on 128K-token ones
# with context parallelism over 16 GPUs (all-gather based, zig-zag chunks):

# %%
for key in ("llama3.cp1_8k_tflops_per_gpu", "llama3.cp16_128k_tflops_per_gpu",
            "cp_inference.llama3_405b_1m_prefill_seconds",
            "cp_inference.llama3_405b_128k_prefill_seconds",
            "cp_inference.parallel_efficiency_1m",
            "deepseek_v3.total_parameters", "deepseek_v3.activated_parameters",
            "switch.pretraining_speedup"):
    f = reference.published(key)
    print(f"{f.extra['quantity']}: {f.value} {f.unit}  [{f.label}]")
kept = (reference.published("llama3.cp16_128k_tflops_per_gpu").value
        / reference.published("llama3.cp1_8k_tflops_per_gpu").value)
print(f"-> with 16 times longer sequences split over 16 GPUs, Llama 3 kept {kept:.0%} "
      "of its per-GPU throughput")

# %% [markdown]
# Ring attention hides its transfers when computing with one K/V block takes
# longer than passing the next one on. Predicted with the course's calibrated
# models (achieved FLOP/s and launch cost for the kernel; NCCL's reached
# NVLink rate and a measured collective latency for the transfer), for H100
# SXM GPUs, a Llama-3-70B-like layer (64 query heads of 128, 8 K/V heads), bf16,
# one ring step on 8 GPUs:

# %%
N_GPU, Q_HEADS, KV_HEADS, DIM = 8, 64, 8, 128
for seq in (8192, 32768, 131072):
    c = seq // N_GPU
    compute = predict.kernel_seconds(4 * c * c * Q_HEADS * DIM,
                                     2 * (2 * c * Q_HEADS * DIM + 2 * c * KV_HEADS * DIM),
                                     "h100_sxm", "bf16")
    transfer = predict.exchange_seconds(2 * c * KV_HEADS * DIM * 2, 1, "nvlink_h100",
                                        "H100 SXM, NVLink")
    print(f"S = {seq:6d}: block attention {compute.value * 1e6:7.1f} us, K/V transfer "
          f"{transfer.value * 1e6:5.1f} us -> "
          + ("hidden" if compute.value > transfer.value else "exposed"))
print(f"[{compute.label}]\n[{transfer.label}]")
print("caveat: not calibrated for attention: the block runs at a large matmul's "
      "rate, and no published measurement of an attention kernel was found")

# %% [markdown]
# The compute per step grows as `(S/N)^2` and the transfer as `S/N`, so the
# longer the sequence, the better the ring hides its communication; at short
# lengths the transfer's fixed latency is what shows. Grouped K/V heads (8
# instead of 64) shrink the messages. The all-to-all of an MoE layer does not
# shrink that way: every token travels twice per layer, which is why
# DeepSeek-V3's authors worked to overlap it with computation almost entirely
# (their README says so of cross-node MoE training). Predicted for one
# MoE layer's dispatch on 8 H100s with DeepSeek-V3's shapes, each GPU sending
# `(N-1)/N` of its `T k` rows in bf16:

# %%
shapes = reference.published("deepseek_v3.experts_per_token")
top_k, width = shapes.value, shapes.extra["hidden_size"]
print(f"top-{top_k} routing, width {width}  [{shapes.label}]")
for tokens_per_gpu in (4096, 16384):
    rows = tokens_per_gpu * top_k * (N_GPU - 1) / N_GPU
    f = predict.exchange_seconds(rows * width * 2, N_GPU - 1, "nvlink_h100",
                                 "8 x H100 SXM, NVLink")
    print(f"{tokens_per_gpu} tokens per GPU: dispatch {f.value * 1e3:.2f} ms per "
          "layer, and as much again to combine")
print(f"[{f.label}]")

# %% [markdown]
# ## Summary
#
# - Attention's saved memory grows as `S^2` written plainly and as `S` with a
#   flash kernel; compute grows as `S^2`. Context parallelism splits the
#   sequence and exchanges K and V.
# - Ring attention passes K/V blocks around the ring with `batch_isend_irecv`
#   and merges partial results with the log-sum-exp rule: exact, `2 (N - 1)`
#   messages per rank. Causal attention loads the last rank most; zig-zag
#   sharding (chunks `r` and `2N - 1 - r`) balances it.
# - An autograd all-gather makes it trainable. Compare gradients with one
#   process: `torch.distributed.nn.functional.all_gather` gave wrong K/V
#   gradients here; `all_gather_single_autograd` is exact.
# - Expert parallelism dispatches tokens with two `all_to_all_single`s with
#   uneven splits, counts exchanged first; it equals one process. Routers
#   overload experts: capacity factors bound buffers and drop tokens, a
#   balancing loss spreads the load.
# - `context_parallel` is the library's ring attention, for CUDA kernels.

# %% [markdown]
# ## Exercises
#
# ### Exercise 11.1: attention block by block
#
# Write `blockwise_attention(q, k, v, block, causal)`: the attention of `q`
# over `k`, `v` (shapes `(batch, heads, S, d)`), computed over blocks of at most
# `block` keys at a time and merged with the log-sum-exp rule, as one rank of a
# ring does. It must equal `F.scaled_dot_product_attention(q, k, v,
# is_causal=causal)` for any `S` (not only multiples of `block`), and it must
# never build the full `S x S` score matrix: the checker watches the size of
# every tensor your function creates.

# %% tags=["exercise"] exercise="11.1"
def blockwise_attention(q, k, v, block, causal=False):
    ### BEGIN SOLUTION
    s = k.shape[2]
    out = torch.zeros_like(q)
    lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)
    rows = torch.arange(q.shape[2])[:, None]
    for start in range(0, s, block):
        stop = min(start + block, s)
        mask = rows >= torch.arange(start, stop)[None, :] if causal else None
        o_b, lse_b = block_attention(q, k[:, :, start:stop], v[:, :, start:stop],
                                     mask)
        # a row that sees no key of this block gets nan: it contributes nothing
        out, lse = merge(out, lse, o_b.nan_to_num(0.0), lse_b)
    return out
    ### END SOLUTION


# %% tags=["check"] exercise="11.1"
check_blockwise_attention(blockwise_attention)

# %% [markdown]
# ### Exercise 11.2: dispatch with a capacity
#
# Write the sending side of an expert-parallel dispatch with a capacity:
# `plan_dispatch(expert_idx, n_experts, world_size, capacity)`. `expert_idx`
# is this rank's `(T, k)` tensor of chosen experts (column 0 the first
# choice); experts `0 .. n_experts - 1` are spread over the ranks in equal,
# consecutive groups. Assignment `(t, j)` is numbered `t * k + j`. Each expert
# accepts at most `capacity` assignments from this rank: all first choices
# come before all second choices, and within a choice, earlier tokens first;
# the rest are dropped. Return `(order, send_counts)`: `order` lists the kept
# assignments' numbers, grouped by destination rank (rank 0's first), and
# `send_counts[r]` is how many go to rank `r`. The checker tries skewed
# routings for 2 and 3 ranks, then runs the real exchange with your plans on 3
# ranks and compares the layer with one process.

# %% tags=["exercise"] exercise="11.2"
def plan_dispatch(expert_idx, n_experts, world_size, capacity):
    ### BEGIN SOLUTION
    t, k = expert_idx.shape
    by_priority = expert_idx.t().flatten()  # first choices, then second, ...
    numbers = torch.arange(t * k).view(t, k).t().flatten()
    kept, taken = [], [0] * n_experts
    for number, e in zip(numbers.tolist(), by_priority.tolist(), strict=True):
        if taken[e] < capacity:
            taken[e] += 1
            kept.append(number)
    kept = torch.tensor(kept, dtype=torch.long)
    dest = expert_idx.flatten()[kept] // (n_experts // world_size)
    order = kept[dest.argsort(stable=True)]
    return order, torch.bincount(dest, minlength=world_size).tolist()
    ### END SOLUTION


# %% tags=["check"] exercise="11.2"
check_plan_dispatch(plan_dispatch)

# %% [markdown]
# ### Exercise 11.3: predict, then run
#
# Predict how many query-key scores each rank of section 2's causal ring
# computes: `predict_scores(seq_len, world_size, layout)` returns a list with
# one number per rank, for `layout` `"contiguous"` or `"zigzag"`. Remember that
# a diagonal block is computed whole, masked half included. The checker runs
# the ring on 2 and 3 ranks and counts.

# %% tags=["exercise"] exercise="11.3"
def predict_scores(seq_len, world_size, layout):
    ### BEGIN SOLUTION
    if layout == "contiguous":
        c = seq_len // world_size
        return [(r + 1) * c * c for r in range(world_size)]
    c = seq_len // (2 * world_size)
    return [(2 * world_size + 1) * c * c for _ in range(world_size)]
    ### END SOLUTION


# %% tags=["check"] exercise="11.3"
check_predict_scores(predict_scores)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | context parallelism | 上下文并行 |
# | ring attention | 环形注意力 |
# | log-sum-exp | 对数和指数 |
# | causal mask | 因果掩码 |
# | load balancing | 负载均衡 |
# | zig-zag sharding | 之字形切分 |
# | mixture of experts (MoE) | 混合专家模型 |
# | expert parallelism | 专家并行 |
# | router / gate | 路由器 / 门控 |
# | all-to-all | 全交换（all-to-all） |
# | capacity factor | 容量因子 |
# | auxiliary loss | 辅助损失 |
