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
# - Three context-parallel designs built by hand and weighed: ring attention
#   (K/V blocks passed around with `batch_isend_irecv`, merged with the
#   log-sum-exp rule), all-gather of K/V (trainable), and Ulysses (an
#   all-to-all that shards the heads instead); the causal imbalance and its
#   zig-zag fix.
# - PyTorch's `context_parallel` as it really behaves in 2.13: all-gather by
#   default, ring on request, its head-tail balancer, and its error on CPUs.
# - Expert parallelism as it is trained today: dropless dispatch with two
#   `all_to_all_single`s of variable splits, equal to one process forward and
#   backward; load balance, and capacity factors as the older design.
#
# **Hardware.** Every rank is a real process; collectives go through `gloo`
# on CPUs and `nccl` when there is a GPU per rank. PyTorch's own
# `context_parallel` handles only the CUDA attention kernels: on CPU ranks it
# raises an error at once, which section 3 shows. So this chapter
# builds every design by hand, runs the library API for real only with a GPU
# per rank, and shows published and predicted GPU figures beside the CPU
# measurements.

# %%
import math
import warnings

import ipywidgets as widgets
import matplotlib.pyplot as plt
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
from course_utils.compat import (  # private names whose module moved between versions
    _cp_options,
    _create_default_load_balancer,
)
from course_utils.devices import format_bytes, gpu_count
from course_utils.dist import launch

banner()
torch.set_num_threads(1)  # this process only computes small tensors: one thread
# is as fast, and does not fight other programs for the cores


def rank_device(rank):
    """This rank's GPU under nccl, else the CPU."""
    if dist.is_initialized() and "nccl" in dist.get_backend():
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
# and V (the queries and outputs stay put): pass K/V blocks around a ring
# (ring attention), or all-gather them. A third design (Ulysses, section 4)
# exchanges the sequence split for a split of the heads instead.
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
# but still computed, smaller. Llama 3's context parallelism splits the
# sequence this way, and so does PyTorch's `context_parallel` through its
# head-tail load balancer - with three traps, which its balancer (read in
# torch 2.13's `_context_parallel`) and our zig-zag run show:

# %%
for seq in (16, 18):
    balancer = _create_default_load_balancer(seq, N_RING, "cpu")
    try:
        shown = (str(balancer._generate_indices(restore=False).view(N_RING, -1).tolist())
                 if balancer else "- no balancer: contiguous chunks, imbalanced again")
    except AssertionError:  # torch 2.11 builds one for any S, then asserts
        shown = f"- AssertionError: S must be a multiple of {2 * N_RING}"
    print(f"S = {seq}, {N_RING} ranks: tokens per rank {shown}")
naive = torch.cat(outs, dim=2)  # the zig-zag outputs, concatenated in rank order
print(f"zig-zag outputs joined in rank order: largest difference from one process "
      f"{(naive - want).abs().max():.2f} (put each chunk back in its place: "
      f"{(got - want).abs().max():.0e})")

# %% [markdown]
# - The balancer needs `S` to be a multiple of `2N`. Where it is not,
#   torch 2.13 shards contiguously and the causal imbalance is back, with
#   no warning; torch 2.11 builds the balancer anyway, and it fails with an
#   `AssertionError`.
# - A rank's shard is not one slice of the sequence: outputs joined in rank
#   order are scrambled (use `context_parallel_unshard`, which restores the
#   order), and every tensor indexed by position (labels, positions for
#   rotary embeddings, masks) must be sharded the same way: pass it in
#   `buffers`.
# - With the balancer on, non-causal attention raises `RuntimeError: Load
#   balancing requires is_causal=True`; an encoder or a diffusion model
#   switches it off first (`_cp_options.enable_load_balance = False`).
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

    from course_utils.compat import all_gather_single_autograd

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
# ### PyTorch's `context_parallel`
#
# `torch.distributed.tensor.experimental.context_parallel` does this inside
# a context manager: it shards the tensors given as `buffers` along their
# sequence dimension (head-tail for causal attention) and replaces
# `F.scaled_dot_product_attention` by its own loop over K/V shards. What it
# sends is set by `_cp_options.rotate_method`, whose default in torch 2.13 is
# **all-gather**, not a ring:
#
# - `set_rotate_method("allgather")` (the default): one `all_gather_single`
#   of every rank's K and V at the first step; each rank then holds the
#   whole K and V, as in the all-gather above.
# - `set_rotate_method("alltoall")`: at each of the `N - 1` steps an
#   `all_to_all_single` in which each rank sends its current K/V shard to
#   rank `r + 1` only (`permute_tensor`): the ring of section 2.
#
# Both send every rank `2 (N - 1)` shards; the ring holds two at a time and
# can overlap each with a step's compute. We hand the library a small
# attention layer's *input* (a model passes its inputs, labels and position
# tables as `buffers`; q, k and v are computed inside from the sharded
# input), with each rotation, on two ranks:

# %%
def library_context_parallel(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from course_utils.compat import (  # their modules moved between versions
        context_parallel,
        context_parallel_unshard,
        set_rotate_method,
    )

    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (world_size,))
    torch.manual_seed(0)
    proj = nn.Linear(64, 3 * 64).to(dev)  # q, k and v: 4 heads of 16

    def layer(x):  # (batch, S, 64) -> (batch, S, 64)
        q, k, v = proj(x).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).flatten(2)

    x = torch.randn(2, 256, 64, device=dev)
    want, found = layer(x), {}
    for method in ("allgather", "alltoall"):
        set_rotate_method(method)
        try:
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
                out = layer(x)  # x is this rank's shard inside the context
            (out,) = context_parallel_unshard(mesh, [out], [1])
            found[method] = f"largest difference {(out - want).abs().max():.1e}"
        except NotImplementedError as error:
            found[method] = f"NotImplementedError: {str(error).splitlines()[0]}"
    return found


print(f"default rotate_method: {_cp_options.rotate_method.name}")
results = launch(library_context_parallel, 2, timeout=60, echo=False)
where = "2 GPUs" if gpu_count() >= 2 else "2 CPU ranks"
for method, result in results[0].value.items():
    print(f"{where}, {method}: {result}")

# %% [markdown]
# On CPU ranks both fail at once: the library's DTensor rules cover the
# CUDA attention kernels (flash, memory-efficient, cuDNN) and not the CPU
# one. With a GPU per rank the same cell prints each rotation's difference
# from one GPU. Hence the hand-built versions here, which run everywhere.
#
# ## 4. Ulysses: shard the heads instead
#
# The third design, DeepSpeed-Ulysses (Jacobs et al., arXiv:2309.14509),
# exchanges *which* dimension is split. Attention mixes positions but never
# heads, so before attention one all-to-all turns "rows `S/N` of all `H`
# heads" into "all `S` rows of `H/N` heads"; each rank runs ordinary
# attention on its heads, and a second all-to-all turns the output back. No
# log-sum-exp merging, no causal imbalance (each rank sees the whole
# sequence), and any attention kernel works:

# %%
def seq_to_heads(t, world_size):
    """(b, H, S/N, d) on each rank -> (b, H/N, S, d): all rows of H/N heads."""
    b, h, s, d = t.shape
    send = t.reshape(b, world_size, h // world_size, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # head group j goes to rank j
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world_size, world_size * s, d)


def heads_to_seq(t, world_size):
    """(b, H/N, S, d) -> (b, H, S/N, d): rows group j goes back to rank j."""
    b, h, s, d = t.shape
    send = t.reshape(b, h, world_size, s // world_size, d).transpose(0, 2).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.permute(2, 0, 1, 3, 4).reshape(b, world_size * h, s // world_size, d)


def ulysses_attention(rank, world_size, q, k, v, causal):
    dev, c = rank_device(rank), q.shape[2] // world_size
    local = [t[:, :, rank * c:(rank + 1) * c].to(dev) for t in (q, k, v)]
    if k.shape[1] < world_size:  # fewer K/V heads than ranks (GQA): copy them
        local[1:] = [t.repeat_interleave(world_size // k.shape[1], dim=1)
                     for t in local[1:]]
    heads = [seq_to_heads(t, world_size) for t in local]
    out = heads_to_seq(F.scaled_dot_product_attention(*heads, is_causal=causal,
                                                      enable_gqa=True), world_size)
    sent = sum(t.nelement() * t.element_size() for t in (*local, out))
    return out.cpu(), sent * (world_size - 1) // world_size  # (N-1)/N leaves


def ulysses_runs(rank, world_size, q, k, v):
    return [ulysses_attention(rank, world_size, q, k, v, c) for c in (False, True)] + [
        ulysses_attention(rank, world_size, q, k[:, :1], v[:, :1], True)]  # 1 K/V head


torch.manual_seed(0)  # section 2's tensors again
q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM) for _ in range(3))
runs = [r.value for r in launch(ulysses_runs, N_RING, args=(q, k, v), timeout=60,
                                echo=False)]
for i, causal in enumerate((False, True)):
    got = torch.cat([r[i][0] for r in runs], dim=2)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    print(f"Ulysses, causal={causal!s:5}: largest difference from one process "
          f"{(got - want).abs().max():.1e}")
print(f"bytes each rank sent: Ulysses {format_bytes(runs[0][0][1])}, the ring "
      f"{format_bytes(2 * (N_RING - 1) * block)}")
got = torch.cat([r[2][0] for r in runs], dim=2)
want = F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True,
                                      enable_gqa=True)
print(f"{HEADS} query heads, 1 K/V head copied to {N_RING} ranks: largest difference "
      f"{(got - want).abs().max():.1e}; Ulysses sent {format_bytes(runs[0][2][1])}, "
      f"a ring would send {format_bytes(2 * (N_RING - 1) * block // HEADS)}")

# %% [markdown]
# Exact, and with 4 K/V heads half the ring's traffic. With one K/V head
# shared by all queries (grouped K/V, taken to the extreme), Ulysses must
# copy it to every rank and still moves Q and the output, while the ring's
# blocks shrink with the K/V heads: compare the last line's two numbers.
# Per rank and layer, with `s = S/N` rows of `d` values per head:
#
# | design | elements sent per rank | K/V held | limit |
# | --- | --- | --- | --- |
# | ring | `2 (N-1) s H_kv d`, in steps that overlap compute | 2 blocks | - |
# | all-gather | the same, in one collective | all of K, V | memory |
# | Ulysses | `(N-1)/N (2H + 2H_kv) s d`, blocking | `H_kv/N` heads | `N <= H_kv` |
#
# Grow `S` and `N` together (fixed `s`) and Ulysses's volume stays nearly
# constant (`(N-1)/N` creeps towards 1) while the ring's grows with `N` (the
# paper's claim). But Ulysses moves Q
# and the output too: with grouped K/V heads (GQA, e.g. 64 query heads and
# 8 K/V heads) the ring sends less, and Ulysses cannot use more ranks than
# K/V heads without copying K/V heads. The figure, for bf16 heads of 128:

# %%
def cp_bytes(seq, heads, kv_heads, n, dim=128, nbytes=2):
    """Bytes sent per rank and layer (forward) by each design; None: impossible."""
    s = seq // n * dim * nbytes  # one head's rows on one rank
    ring = 2 * (n - 1) * kv_heads * s
    ulysses = ((n - 1) * (2 * heads + 2 * max(kv_heads, n)) * s // n
               if n <= heads else None)  # K/V heads copied up to N
    return {"ring": ring, "all-gather": ring, "Ulysses": ulysses}


def kv_held(seq, heads, kv_heads, n, dim=128, nbytes=2):
    """Bytes of K and V each rank holds at once."""
    s = seq // n * dim * nbytes
    return {"ring": 2 * 2 * kv_heads * s, "all-gather": 2 * kv_heads * s * n,
            "Ulysses": 2 * max(kv_heads, n) * s}


def plot_cp_tradeoff(heads=64, kv_heads=8, rows_per_rank=8192, seq=131072, n=8):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    ranks, kvs = [2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16, 32, 64]
    seqs = [rows_per_rank * r for r in ranks]
    for name, color in (("ring", "C0"), ("Ulysses", "C1")):
        for kv, dash in ((heads, ":"), (kv_heads, "-")):
            left.plot(seqs, [cp_bytes(rows_per_rank * r, heads, kv, r)[name] / 2**20
                             for r in ranks], dash + "o", color=color,
                      label=f"{name}, {kv} K/V heads")
        right.plot(kvs, [cp_bytes(seq, heads, kv, n)[name] / 2**20 for kv in kvs],
                   "-o", color=color, label=name)
    left.set(xscale="log", yscale="log", xlabel=f"sequence S (N = S / {rows_per_rank})",
             ylabel="MiB sent per rank per layer",
             title=f"{heads} query heads: S and N grow together")
    left.set_xticks(seqs, [f"{x // 1024}K" for x in seqs], minor=False)
    left.minorticks_off()
    right.set(xscale="log", xlabel="K/V heads", ylabel="MiB sent per rank per layer",
              title=f"S = {seq // 1024}K, N = {n}, {heads} query heads")
    right.set_xticks(kvs, [str(x) for x in kvs])
    right.minorticks_off()
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.suptitle("cp_bytes, bf16, heads of 128 (all-gather sends as the ring)")
    fig.tight_layout()
    plt.show()


plot_cp_tradeoff()

# %% [markdown]
# **Try it.** Move the sequence length, the heads and the ranks: what each
# design sends, and the K and V each rank holds at once (bf16, heads of 128,
# one layer):

# %%
def compare_designs(seq_k=128, heads=64, kv_heads=8, ranks=8):
    seq = seq_k * 1024
    if heads % kv_heads or seq % ranks:
        print("K/V heads must divide the query heads, and ranks the sequence")
        return
    sent = cp_bytes(seq, heads, kv_heads, ranks)
    held = {m: b if sent[m] else None  # no Ulysses with more ranks than heads
            for m, b in kv_held(seq, heads, kv_heads, ranks).items()}
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.6))
    for ax, values, what in ((axes[0], sent, "sent"), (axes[1], held, "K/V held")):
        ax.bar(list(values), [(b or 0) / 2**20 for b in values.values()],
               color=["C0", "C1", "C2"])
        ax.set(ylabel=f"MiB {what} per rank")
    fig.tight_layout()
    plt.show()
    for name, b in sent.items():
        print(f"{name:10}: sends {format_bytes(b) if b else '-':>10}, holds "
              f"{format_bytes(held[name]) if b else '-':>10} of K/V"
              + ("" if b else f" (impossible: {ranks} ranks > {heads} heads)"))
    print(f"one GPU without context parallelism holds "
          f"{format_bytes(2 * kv_heads * seq * 128 * 2)} of K/V")


widgets.interact(compare_designs,
                 seq_k=widgets.SelectionSlider(options=[2**i for i in range(3, 11)],
                                               value=128, description="S (K)",
                                               continuous_update=False),
                 heads=widgets.SelectionSlider(options=[8, 16, 32, 64, 128], value=64,
                                               description="heads",
                                               continuous_update=False),
                 kv_heads=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64],
                                                  value=8, description="K/V heads",
                                                  continuous_update=False),
                 ranks=widgets.SelectionSlider(options=[2, 4, 8, 16, 32, 64, 128],
                                               value=8, description="ranks N",
                                               continuous_update=False));

# %% [markdown]
# Llama 3 chose the all-gather for its 128K stage (its report, section
# 3.3.2): a gathered K/V makes masks such as a document mask easy, and with
# GQA the K/V are much smaller than Q. Designs also combine: USP (Fang and
# Zhao, arXiv:2405.07719) runs Ulysses on one mesh dimension and a ring on
# the other.
#
# ## 5. Expert parallelism: dropless dispatch
#
# A **mixture of experts** (MoE) layer replaces one feed-forward network by
# `E` of them and a router: for each token the router picks its top `k`
# experts and mixes their outputs with the router's weights. The parameters
# grow `E` times while the computation per token grows only `k` times. Expert
# parallelism puts different experts on different ranks, so each token must
# travel to the ranks of its experts and its results must come back: two
# all-to-alls per layer. Today's MoE training is **dropless**: every
# assignment reaches its expert, however uneven the load (DeepSeek-V3's
# report, section 2.1.2: "DeepSeek-V3 does not drop any tokens during
# training"; MegaBlocks, Gale et al., arXiv:2211.15841; torchtitan's MoE, with
# no capacity at all). Each expert then gets a batch of a different size,
# which one **grouped GEMM** computes in a single kernel (`torch._grouped_mm`
# in torchtitan's `GroupedExperts`). First the one-process layer, the
# reference:

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
# together with the expert each is for. Each rank sorts what it received by
# expert and runs each expert on its contiguous group of rows (a grouped GEMM
# on a GPU, a loop here); a second all-to-all sends the results back with the
# splits swapped, and each token sums its experts' results times the gates.
# For the backward, the token all-to-alls use the functional collective with
# autograd.

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
    by_expert = e_recv.argsort(stable=True)  # rows grouped by expert
    sizes = torch.bincount(e_recv - rank * per_rank, minlength=per_rank).tolist()
    groups = x_recv[by_expert].split(sizes)  # variable sizes: nothing dropped
    y_recv = torch.cat([experts[rank * per_rank + i](g) for i, g in enumerate(groups)])
    y_recv = y_recv[by_expert.argsort()]  # back to the order received
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
moe = compare_with_one_process(3, tokens, skews=(0.0, 3.0))  # 3.0: see below
worst, received = moe[0]
print(f"3 ranks, {N_EXPERTS // 3} experts each: largest difference from one process "
      f"(output and every gradient) {worst:.1e}; token rows each rank received from "
      f"ranks 0..2: {received}")

# %% [markdown]
# Equal to one process, forward and backward, with splits that differ from
# rank to rank (no two ranks receive the same number of rows), and nothing
# dropped. This dispatch sends one row per (token, expert) pair; a token whose
# two experts live on one rank travels twice. Sending one copy per (token,
# destination) instead, and letting the receiver hand it to each of its
# experts, saves that:

# %%
with torch.no_grad():
    _, chosen = route(tokens, make_moe()[0])
dest = (chosen // (N_EXPERTS // 3)).tolist()
once = sum(len(set(row)) for row in dest)
print(f"rows dispatched: {len(dest) * TOP_K}, one per (token, expert); one per "
      f"(token, destination rank): {once}")

# %% [markdown]
# DeepSeek-V3's dispatch does this per node: a token crosses InfiniBand once
# to each node it needs, to the GPU with the same index there, and NVLink
# forwards it to the GPUs of its experts; **node-limited routing** lets a
# token pick experts on at most 4 nodes (its report, sections 2.1.2 and
# 3.2.2). A **shared expert**, which every token passes through (DeepSeek-V3
# has one beside 256 routed ones), needs no dispatch at all: each rank runs it
# on its own tokens.
#
# ### Load balance: the problem
#
# Nothing forces the router to spread the tokens. A router that prefers some
# experts (here a bias towards the low-numbered ones, `skew`, as an untrained
# or collapsing router does) sends most tokens to one rank, which then
# computes for everyone while the others wait - and must hold buffers for
# however many arrive:

# %%
for skew, (worst, received) in zip((0.0, 3.0), moe, strict=True):
    load = [sum(r) for r in received]  # the 3-rank launch above ran both
    print(f"skew {skew}: rows received per rank {load} (of {TOP_K * len(tokens)}); "
          f"busiest / average {imbalance(load):.2f}; still equal to one process "
          f"({worst:.1e})")

# %% [markdown]
# Two remedies, which change different things:
#
# - A **capacity factor**, the older design (GShard, Switch Transformer),
#   caps each expert at `capacity = ceil(factor x T k / E)` assignments per
#   batch. Buffers get a fixed size and no rank gets more than its share, but
#   assignments beyond the cap are **dropped**: that expert's contribution is
#   lost for the token, which passes on through the residual connection.
#   Dropless training sizes the buffers from the counts exchanged first
#   instead; a capacity remains where a fixed buffer size matters more than
#   every token's expert (static shapes, some serving systems).
# - An **auxiliary balancing loss** changes the router itself. Switch
#   Transformer's is `E * sum_i f_i P_i`, with `f_i` the fraction of tokens whose
#   first choice is expert `i` and `P_i` the mean router probability of `i`;
#   it is smallest when both are uniform. Added to the training loss with a
#   small weight, it teaches the router to spread the tokens.
#
# Measured on the skewed router, in one process: what each capacity factor
# would drop, then the load after the router has trained on the balancing
# loss alone for 50 steps of gradient descent:

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
loads = {}
for stage in ("before", "after"):
    if stage == "after":
        for _ in range(50):  # plain gradient descent on the router alone
            router.zero_grad()
            balancing_loss(batch, router, 3.0).backward()
            with torch.no_grad():
                router.weight -= 10.0 * router.weight.grad
    with torch.no_grad():
        loads[stage] = load = expert_load(batch, router, 3.0)
        aux = balancing_loss(batch, router, 3.0).item()
    drops = ", ".join(f"{f}: {dropped(load, f, len(batch))[0] / load.sum().item():.0%}"
                      for f in (1.0, 1.25, 2.0))
    print(f"{stage} training on the balancing loss ({aux:.2f}; 1.00 is uniform): "
          f"load per expert {load.tolist()}\n   dropped with capacity factor {drops}")

# %% [markdown]
# The loss attacks the cause, so the same factors drop far fewer (the two
# lines above). DeepSeek-V3 balances without an auxiliary loss (its report
# adjusts a per-expert bias of the routing scores during training instead).
# **Try it**: the capacity factor against what it would drop, before and
# after balancing (Exercise 11.2 builds a capacity-limited dispatch):

# %%
def capacity_plot(factor=1.25):
    fig, ax = plt.subplots(figsize=(7, 2.8))
    for i, (stage, load) in enumerate(loads.items()):
        lost, capacity = dropped(load, factor, len(batch))
        ax.bar(torch.arange(N_EXPERTS) + 0.4 * i, load, width=0.4,
               label=f"{stage} balancing: {lost / load.sum().item():.0%} dropped")
    ax.axhline(capacity, color="k", linestyle="--", label=f"capacity {capacity}")
    ax.set(xlabel="expert", ylabel="assignments", title=f"capacity factor {factor}")
    ax.legend(fontsize=8)
    plt.show()


widgets.interact(capacity_plot, factor=widgets.FloatSlider(
    min=0.5, max=3.0, step=0.25, value=1.25, description="factor",
    continuous_update=False));

# %% [markdown]
# ## 6. GPU figures
#
# The library's `context_parallel` ran above on GPUs when there were two;
# these are published figures from long-context and mixture-of-experts
# systems. Llama 3 trained its 405B model first on 8K-token sequences, then on
# 128K-token ones with context parallelism over 16 GPUs (all-gather based,
# zig-zag chunks):

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
# longer than passing the next one on. Predicted with the course's step
# model (a fused attention kernel's fraction of the bf16 peak for the block;
# NCCL's reached NVLink rate for the transfer), for H100 SXM GPUs, a
# Llama-3-70B-like layer (64 query heads of 128, 8 K/V heads), one ring step
# on 8 GPUs. A ring step is one send to a neighbour, not a collective, and
# the step model has no published point-to-point latency: the transfer is
# given between no latency at all (its floor) and a whole 8-GPU all-reduce's
# latency (its ceiling), and the verdict holds only where both agree:

# %%
N_GPU, Q_HEADS, KV_HEADS, DIM = 8, 64, 8, 128
for seq in (8192, 32768, 131072):
    c = seq // N_GPU
    compute = predict.attention_seconds(4 * c * c * Q_HEADS * DIM, "h100_sxm",
                                        math="bf16")
    kv_bytes = 2 * c * KV_HEADS * DIM * 2
    ceiling = predict.exchange_seconds(kv_bytes, 1, "nvlink_h100", "H100 SXM, NVLink")
    floor = kv_bytes / predict.achieved_link_bandwidth("nvlink_h100")  # no latency
    verdict = (f"hidden ({compute.value / ceiling.value:.0f}x the slowest transfer)"
               if compute.value > ceiling.value else "exposed"
               if compute.value < floor else "hidden only if a send's latency is "
               f"under {(compute.value - floor) * 1e6:.0f} us")
    print(f"S = {seq:6d}: block attention {compute.value * 1e6:7.1f} us, K/V transfer "
          f"{floor * 1e6:5.1f}-{ceiling.value * 1e6:5.1f} us -> {verdict}")
print(f"[{compute.label}]\n[{ceiling.label}]")
print("the transfer's range: a K/V block at the rate NCCL reaches, plus 0 to "
      f"{predict.collective_latency() * 1e6:.0f} us (an 8-GPU "
      "all-reduce's latency; a send to a neighbour takes less)")

# %% [markdown]
# The compute per step grows as `(S/N)^2` and the transfer as `S/N`, so the
# longer the sequence, the more room the ring has to hide its communication
# (the verdicts above say where it runs out, if anywhere); at short lengths
# the transfer is mostly its latency, the term the step model knows least
# (the range above). Grouped K/V heads (8 instead of
# 64) shrink the messages. The all-to-all of an MoE layer does not
# shrink that way: every token travels twice per layer, which is why
# DeepSeek-V3's authors worked to overlap it with computation almost entirely
# (their README says so of cross-node MoE training). Predicted for one
# MoE layer's dispatch on 8 H100s with DeepSeek-V3's shapes, counting one row
# per (token, expert) pair (no de-duplication), each GPU sending `(N-1)/N` of
# its `T k` rows in bf16:

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
experts = shapes.extra["routed_experts"]
distinct = N_GPU * (1 - math.comb(experts - experts // N_GPU, top_k)
                    / math.comb(experts, top_k))
print(f"one row per (token, expert): were experts chosen uniformly, a token's "
      f"{top_k} would sit on {distinct:.1f} GPUs on average, and one copy per "
      f"destination would send {distinct / top_k:.0%} of these rows")

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
# - `context_parallel` all-gathers K/V by default in torch 2.13 (the ring is
#   `set_rotate_method("alltoall")`), balances head-tail only when `2N`
#   divides `S`, and raises on CPU ranks.
# - Ulysses trades the sequence split for a head split with two all-to-alls:
#   constant volume when `S` and `N` grow together, but at most as many ranks
#   as K/V heads, and more traffic than the ring under GQA.
# - Expert parallelism dispatches tokens with two `all_to_all_single`s with
#   variable splits, counts exchanged first, and drops nothing: it equals one
#   process. A balancing loss (or DeepSeek-V3's bias) spreads the load;
#   capacity factors, the older design, bound buffers by dropping tokens.

# %% [markdown]
# ## Exercises
#
# ### Exercise 11.1: attention block by block
#
# Write `blockwise_attention(q, k, v, block, causal)`: the attention of `q`
# over `k`, `v` (shapes `(batch, heads, S, d)`), computed over blocks of at most
# `block` keys at a time and merged with the log-sum-exp rule, as one rank of a
# ring does. It must equal `F.scaled_dot_product_attention(q, k, v,
# is_causal=causal)` for any `S` (not only multiples of `block`) and keep the
# inputs' dtype, and it must never compute with more than `block` keys at once
# (no `S x S` matrix, no `S x 2 block` either): the checker watches the shape
# of every tensor your function creates.

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
# Write the sending side of the older, capacity-limited dispatch:
# `plan_dispatch(expert_idx, n_experts, world_size, capacity)`. `expert_idx`
# is this rank's `(T, k)` tensor of chosen experts (column 0 the first
# choice); experts `0 .. n_experts - 1` are spread over the ranks in equal,
# consecutive groups. Assignment `(t, j)` is numbered `t * k + j`. Each expert
# accepts at most `capacity` assignments from this rank: all first choices
# come before all second choices, and within a choice, earlier tokens first;
# the rest are dropped. Return `(order, send_counts)`: `order` lists the kept
# assignments' numbers, grouped by destination rank (rank 0's first), and
# `send_counts[r]` is how many go to rank `r`. The checker tries skewed
# routings for 2, 3 and 4 ranks, then runs the real exchange with your plans on 3
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
# ### Exercise 11.3: predict a layout's work
#
# Section 2's causal ring runs any `layout`: `layout[r]` lists the chunks
# rank `r` holds (every rank the same number), the sequence being cut into
# as many equal chunks as the layout lists in all. Write
# `predict_scores(seq_len, layout)`: how many query-key scores each rank
# computes, one number per rank, without running anything. A diagonal block
# is computed whole, masked half included; a block whose keys all come later
# is skipped. The checker runs the real ring on layouts not shown here (2 and
# 3 ranks, chunks dealt out in other orders, more than two per rank) and
# counts.

# %% tags=["exercise"] exercise="11.3"
def predict_scores(seq_len, layout):
    ### BEGIN SOLUTION
    c = seq_len // sum(map(len, layout))
    every = [chunk for chunks in layout for chunk in chunks]
    return [sum(c * c for qc in mine for kc in every if kc <= qc) for mine in layout]
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
