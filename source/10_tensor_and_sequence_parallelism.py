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
# # Chapter 10: Tensor and sequence parallelism
#
# **What you will learn**
#
# - Why large runs split each layer (batch, gathers and activations that
#   data parallelism cannot divide), and what it costs: collectives on the
#   critical path of every layer, hence inside a node.
# - The Megatron-LM split by hand: column-parallel then row-parallel linear
#   and the conjugate operators `f` and `g` as autograd functions.
# - DTensor placements, `parallelize_module` on a small GPT, and why a
#   plan's collective count depends on where DTensors are made.
# - Sequence parallelism and `loss_parallel` with every collective counted
#   and the saved activations measured; FSDP2 x TP with a DCP checkpoint;
#   grouped-query attention, dropout seeds and async TP.
#
# **Hardware.** Every rank is a real process and every collective a real
# `gloo` (CPU) or `nccl` (one GPU per rank) collective, so the counts, the
# losses and the bytes below are measured. Without GPUs the ranks run on the
# CPU; the GPU side - how long these collectives take on NVLink and across
# nodes - is shown as labelled predictions and published figures.

# %%
import os
import warnings
from contextlib import nullcontext

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from course_utils import banner, predict, reference
from course_utils.checks.ch10 import (
    check_head_parallel_attention,
    check_parallelize_plan,
    check_predicted_counts,
    exercise_model,
)
from course_utils.cleanup import scratch_folder, tidy_up
from course_utils.dist import launch

banner()


def rank_device(rank):
    """The rank's GPU under nccl (one per rank), else the CPU."""
    if "nccl" in dist.get_backend():
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


# %% [markdown]
# ## 1. Why split a layer
#
# Data parallelism (Chapters 5-6) copies the whole model onto every device;
# sharding (Chapter 9) splits the *stored* weights but gathers each layer
# whole before computing it. Pipelines (Chapter 7) cut between layers.
# **Tensor parallelism** cuts inside each layer: every device holds a slice
# of every weight matrix and computes a slice of every product.
#
# A model that does not fit is not the reason: FSDP fits any model whose
# single layer fits. The reasons are three limits of data parallelism at
# scale. The cell takes Llama 3 405B's published shape and its 16,384-GPU layout, and
# counts what pure FSDP over all those GPUs would need:
#
# - **the batch**: every data-parallel rank needs at least one whole
#   sequence, so the global batch is at least one sequence per GPU;
# - **the gathers**: a ring all-gather over `N` ranks takes `N - 1` steps,
#   each paying the network's fixed latency, per layer, forward and
#   backward;
# - **the activations**: FSDP shards weights, never the activations a layer
#   saves for its backward. Korthikanti et al. (2022) count them per layer
#   in 16-bit: `s b h (34 + 5 a s / h)` bytes for `s` tokens, batch `b`,
#   width `h` and `a` heads; the `5 a s / h` part is attention's scores,
#   which FlashAttention-style kernels recompute instead of saving. Under
#   tensor parallelism of degree `t` only the parts inside attention and
#   the MLP shrink, to `s b h (10 + 24 / t + 5 a s / (h t))`; sequence
#   parallelism (section 4) divides the rest too, to `s b h (34 + 5 a s /
#   h) / t`. (The count is for a GPT layer; Llama's SwiGLU and shared KV
#   heads change its constants a little, not the lesson.)

# %%
def activation_bytes(s, b, h, a, t=1, sp=False, selective=False):
    """Bytes one layer saves for backward (Korthikanti et al., 2022, Table 2)."""
    scores = 0 if selective else 5 * a * s / h  # attention's softmax and dropout
    if sp:
        return s * b * h * (34 + scores) / t
    return s * b * h * (10 + (24 + scores) / t)


layout = reference.published("llama3_2024.layout_16384_gpus")
shape = reference.published("runs.torchtitan_llama3_405b_fsdp8_tp8_pp8_1f1b_512xh100")
L, m = layout.value, shape.value["model"]
n_gpus, seq, h = L["gpus"], L["seq"], m["hidden"]
batch = L["dp"] * L["batch_per_dp"]  # sequences per step
print(f"Llama 3 405B: {batch:,} sequences of {seq:,} tokens per step on "
      f"{n_gpus:,} GPUs [{layout.label}]")
print(f"  the batch: pure data parallelism needs >= {n_gpus:,} sequences, "
      f"{n_gpus / batch:.0f}x the published batch")
head_dim = h // m["heads"]
layer_params = 2 * h * h + 2 * h * m["kv_heads"] * head_dim + 3 * h * m["ffn"]
for t in (1, L["tp"]):
    dp = n_gpus // t
    print(f"  the gathers, TP {t}: FSDP over {dp:,} ranks gathers "
          f"{2 * layer_params / t / 2**30:.2f} GiB per layer in {dp - 1:,} steps")
memory = reference.published("h100_sxm.memory_gb")
for label, t, sp in (("FSDP alone", 1, False), (f"TP {L['tp']}", L["tp"], False),
                     (f"TP {L['tp']} + SP", L["tp"], True)):
    per_gpu = m["layers"] * activation_bytes(seq, 1, h, m["heads"], t, sp,
                                             selective=True)
    print(f"  the activations, {label}: {per_gpu / 1e9:,.0f} GB per GPU and "
          f"sequence for {m['layers']} layers (scores recomputed), "
          f"{per_gpu / 1e9 / memory.value:.1f}x an H100's {memory.value} GB")
print(f"[{m['name']}: {m['layers']} layers, width {h}, {m['heads']} query heads "
      f"sharing {m['kv_heads']} KV heads; {m['shape_source']}]")

# %% [markdown]
# Tensor parallelism answers all three: `t` GPUs work on one sequence, so
# the data-parallel degree and its minimum batch drop `t`-fold; FSDP's ring
# has `t` times fewer steps and gathers `t` times fewer bytes; with
# sequence parallelism the activations divide by `t`. (Pipelines divide the
# layers, and the activations per GPU with them; Llama 3 used both, TP 8
# and PP 16; Chapter 13 composes them.)
#
# The price is communication *inside* every layer: the forward pass of
# each attention and each MLP ends with a collective of the full
# activation, and the next layer cannot start before it finishes. So the
# link between the devices sets the pace. Inside an 8-GPU node NVLink
# carries hundreds of GB/s per GPU; between nodes a GPU's share of the
# network is far less (section 7 predicts both). That is why tensor
# parallelism is used inside a node, and pipelines or data parallelism
# across nodes.
#
# ## 2. The Megatron MLP by hand
#
# An MLP computes `Y = GeLU(X A) B`. Megatron-LM (Shoeybi et al., 2019)
# splits `A` by **columns** across `t` devices: device `i` computes
# `GeLU(X A_i)` with no communication, since GeLU acts element by element.
# It splits `B` by **rows**, so device `i` computes `GeLU(X A_i) B_i`, a
# partial sum of `Y`; one all-reduce adds the `t` partial sums. The bias of
# `B` is added once, after the sum. (`nn.Linear` stores `A` transposed, so
# "columns of `A`" are the *rows* of its `weight`.)
#
# Autograd must see two operators at the borders of this region:
#
# - **`f`**, where the replicated `X` enters: identity forward; in backward
#   each device holds only its slice's contribution to `dL/dX`, so `f`
#   **all-reduces the gradient**;
# - **`g`**, where the partial sums leave: **all-reduce forward**, identity
#   backward (the gradient of a sum is copied to each term).
#
# They are each other's conjugate, and they are all the communication the
# layer needs: one all-reduce forward, one backward.

# %%
class CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def megatron_mlp(x, w1, b1, w2, b2, use_f=True):
    """GeLU(x A) B with A split by columns, B by rows, over the default group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * w1.shape[0] // world, (rank + 1) * w1.shape[0] // world)
    if use_f:
        x = CopyToParallel.apply(x)
    hidden = F.gelu(F.linear(x, w1[mine], b1[mine]))  # column-parallel
    partial = F.linear(hidden, w2[:, mine])  # row-parallel: a partial sum
    return ReduceFromParallel.apply(partial) + b2  # the bias once


# %% [markdown]
# Each rank builds the same full weights (same seed), uses only its slices,
# and compares with one process computing the whole MLP. A weight slice's
# gradient lands in the full tensor's slice, so summing the ranks' weight
# gradients must give one process's gradients. The cell also runs without
# `f`, to see what it is for:

# %%
def mlp_by_hand(rank, world_size):
    dev = rank_device(rank)
    torch.manual_seed(0)
    d, hidden = 6, 20
    full = [torch.randn(hidden, d) / d**0.5, torch.randn(hidden),
            torch.randn(d, hidden) / hidden**0.5, torch.randn(d)]
    x = torch.randn(5, d)
    report = {}
    for use_f in (True, False):
        xs = x.clone().to(dev).requires_grad_()
        ws = [w.clone().to(dev).requires_grad_() for w in full]
        out = megatron_mlp(xs, *ws, use_f=use_f)
        out.square().mean().backward()
        ref_x = x.clone().requires_grad_()  # one process, the whole MLP
        ref_w = [w.clone().requires_grad_() for w in full]
        ref = F.linear(F.gelu(F.linear(ref_x, ref_w[0], ref_w[1])), ref_w[2], ref_w[3])
        ref.square().mean().backward()
        w1_grad = ws[0].grad.clone()
        dist.all_reduce(w1_grad)  # each rank filled its own rows
        report[use_f] = ((out.cpu() - ref).abs().max().item(),
                         (xs.grad.cpu() - ref_x.grad).abs().max().item(),
                         (w1_grad.cpu() - ref_w[0].grad).abs().max().item())
    return report


for r in launch(mlp_by_hand, 2, timeout=60, echo=False):
    for use_f, (out, gx, gw) in r.value.items():
        print(f"rank {r.rank}, {'with f   ' if use_f else 'without f'}: "
              f"output {out:.1e}, x.grad {gx:.1e}, w1.grad {gw:.1e} "
              "(largest difference from one process)")

# %% [markdown]
# With `f`, forward and backward equal one process. Without it the output
# and the weight gradients are still right, but `x.grad` is wrong on every
# rank: each holds only its half of the hidden units' contribution, and the
# layers below would train on half a gradient.
#
# **Attention splits by heads.** Heads are independent until the output
# projection, so the query, key and value projections are column-parallel
# (each device computes `heads / t` whole heads: the rows of `wq`, `wk`,
# `wv` that belong to its heads) and the output projection is
# row-parallel, closed by `g`. Same pattern, one all-reduce forward, one
# backward. You build it in Exercise 10.1.
#
# ## 3. DTensor: the same split, declared
#
# Writing slices and collectives by hand for every layer does not scale.
# PyTorch's **DTensor** (distributed tensor) pairs each local tensor with a
# **device mesh** (the ranks, as an n-dimensional grid) and a **placement**
# per mesh dimension:
#
# - `Shard(d)`: each rank holds one slice along tensor dimension `d`;
# - `Replicate()`: each rank holds the whole tensor;
# - `Partial()`: each rank holds a term; the tensor is their sum.
#
# Operators on DTensors compute on the local pieces and track the
# placement of the result; `redistribute` changes a placement, with the
# collective that change needs. `CommDebugMode` counts the collectives run
# inside it. The function below tries the four changes that matter; it runs
# on the ranks, in one launch together with the rest of this section, since
# a first DTensor launch takes a few seconds:

# %%
def comm_counts(mode):
    """{'all_reduce': 2, ...} from a CommDebugMode, short names."""
    short = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].replace("_into_tensor", "").replace(
            "_tensor", "")
        short[name] = short.get(name, 0) + n
    return short


def redistributions(mesh):
    torch.manual_seed(0)
    full = torch.arange(24.0, device=mesh.device_type).reshape(4, 6)
    rows = distribute_tensor(full, mesh, [Shard(0)])
    partial = DTensor.from_local(full / mesh.size(), mesh, [Partial()])
    changes = {"Shard(0) -> Replicate": (rows, [Replicate()]),
               "Partial -> Replicate": (partial, [Replicate()]),
               "Partial -> Shard(0)": (partial, [Shard(0)]),
               "Replicate -> Shard(1)": (rows.redistribute(mesh, [Replicate()]),
                                         [Shard(1)])}
    table = {}
    for name, (t, placements) in changes.items():
        with CommDebugMode() as mode:
            out = t.redistribute(mesh, placements)
        assert torch.allclose(out.full_tensor(), full)
        table[name] = (tuple(out.to_local().shape), comm_counts(mode))
    return {"local shape of Shard(0)": tuple(rows.to_local().shape),
            "changes": table}


# %% [markdown]
# ### A small GPT and its tensor-parallel plan
#
# The model: token embeddings, two blocks of pre-norm attention and MLP,
# a final norm and an output layer (no position embedding, to keep the plan
# short; the causal mask still orders the tokens). Note the attention's
# reshape: `view(b, s, -1, self.head_dim)` lets the head count follow the
# local width, which is what tensor parallelism changes.

# %%
class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False)
                                              for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, n_heads, attention=Attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attention(dim, n_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, dim=32, n_heads=4, n_layers=2, attention=Attention):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, attention)
                                    for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# %% [markdown]
# A **plan** maps submodule names to styles. `ColwiseParallel` shards a
# linear's weight by output features (`Shard(0)` of `nn.Linear.weight`) and
# takes a replicated input: Megatron's column-parallel. `RowwiseParallel`
# shards by input features (`Shard(1)`), takes a sharded input and returns
# the all-reduced output: row-parallel with `g` built in. The embedding is
# row-parallel too (each rank holds a slice of the vocabulary; the rows it
# lacks give zeros, hence an all-reduce). The output layer is
# column-parallel, gathered back to full logits.
#
# The `sequence_parallel` and `loss_parallel` switches are explained in
# section 4; read the plain plan first.

# %%
def parallelize_gpt(model, mesh, sequence_parallel=False, loss_parallel=False):
    seq = Shard(1)  # the sequence dimension of (batch, seq, dim)
    between = seq if sequence_parallel else Replicate()  # between sublayers
    block_plan = {
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=between),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        block_plan |= {
            "norm1": SequenceParallel(), "norm2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(seq,),
                                       desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(seq,),
                                      desired_input_layouts=(Replicate(),)),
        }
    for layer in model.layers:
        parallelize_module(layer, mesh, block_plan)
    top_plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "head": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel),  # a DTensor for loss_parallel
    }
    if sequence_parallel:
        top_plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top_plan)
    return model


# %% [markdown]
# One training step, measured three ways: the loss, the collectives
# (`CommDebugMode` around forward and backward) and the activation bytes
# that autograd saves for the backward, counted by a saved-tensors hook
# (Chapter 8) that sums each storage once and skips the weights. What a
# rank really holds is the storage under a DTensor's `to_local()`, or under
# a collective's pending result once waited for (`AsyncCollectiveTensor`,
# from the private module `torch.distributed._functional_collectives`).

# %%
def local_storage(t):
    with torch.no_grad():
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()
    return t.untyped_storage()


def train_step(model, tokens, targets, use_loss_parallel=False):
    """Forward and backward once: (loss, collectives per pass, saved bytes)."""
    seen = {local_storage(p).data_ptr() for p in model.parameters()}
    saved = [0]

    def pack(t):
        storage = local_storage(t)
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes()
        return t

    sharded_loss = loss_parallel() if use_loss_parallel else nullcontext()
    with sharded_loss, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with CommDebugMode() as forward:
            logits = model(tokens)  # under loss_parallel: vocabulary shards
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with CommDebugMode() as backward:
            loss.backward()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.item(), (comm_counts(forward), comm_counts(backward)), saved[0]


# %% [markdown]
# And the classic bug: an attention written for one device, with the head
# count built into its reshape. Under tensor parallelism its input is
# `dim / t` wide, so `view(b, s, n_heads, head_dim)` fails, and
# `view(b, s, n_heads, -1)` silently makes heads of the wrong width:

# %%
class HardCodedHeads(Attention):
    def __init__(self, dim, n_heads):
        super().__init__(dim, n_heads)
        self.n_heads = n_heads

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


# %% [markdown]
# Now one launch on two ranks runs it all: the redistributions, one process
# as the reference (every rank computes it; same seed), then tensor
# parallel (TP), TP with sequence parallelism (SP), TP with
# `loss_parallel`, and the hard-coded-heads model under TP.

# %%
def tour(rank, world_size):
    warnings.filterwarnings("ignore", message=".*Full backward hook")
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (world_size,))
    out = {"redistribute": redistributions(mesh)}
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 3, 16), device=dev)
    torch.manual_seed(0)
    one = GPT().to(dev)
    out["one process"] = train_step(one, tokens, targets)
    for name, sp, lp in [("TP", False, False), ("TP+SP", True, False),
                         ("TP+loss_parallel", False, True)]:
        torch.manual_seed(0)  # the same weights as the one-process model
        model = parallelize_gpt(GPT().to(dev), mesh, sp, lp)
        out[name] = train_step(model, tokens, targets, use_loss_parallel=lp)
        wq = model.layers[0].attn.wq.weight
        out[name + " grad"] = (wq.grad.full_tensor()
                               - one.layers[0].attn.wq.weight.grad).abs().max().item()
    out["wq"] = (tuple(wq.shape), wq.placements, tuple(wq.to_local().shape))
    torch.manual_seed(0)
    buggy = parallelize_gpt(GPT(attention=HardCodedHeads).to(dev), mesh)
    out["hard-coded heads"] = train_step(buggy, tokens, targets)[0]
    torch.manual_seed(0)  # one seed on every rank, as for the weights
    kept = F.dropout(torch.ones(12, device=dev), 0.5)
    out["dropout"] = kept.nonzero().flatten().tolist()
    return out


runs = launch(tour, 2, timeout=120, echo=False)
results = runs[0].value
print("rank 0's local shape of a (4, 6) tensor with Shard(0):",
      results["redistribute"]["local shape of Shard(0)"])
for change, (shape, counts) in results["redistribute"]["changes"].items():
    print(f"  {change:22s} local shape {shape}, collectives {counts or 'none'}")

# %% [markdown]
# Each change of placement has its collective: `Shard -> Replicate` is an
# **all-gather**, `Partial -> Replicate` an **all-reduce**, `Partial ->
# Shard` a **reduce-scatter**, and `Replicate -> Shard` costs nothing (each
# rank keeps its slice). Since an all-reduce is a reduce-scatter followed by
# an all-gather (the ring algorithm of Chapter 6 does exactly that), these
# three are all the collectives tensor parallelism needs.
#
# What the plan did to the first query projection, and the losses:

# %%
for r in runs:
    shape, placements, local = r.value["wq"]
    print(f"rank {r.rank}: layers[0].attn.wq.weight global {shape}, "
          f"placements {placements}, local {local}")
one_loss = results["one process"][0]
for name in ("TP", "TP+SP", "TP+loss_parallel"):
    print(f"{name:17s} loss {results[name][0]:.6f} (one process "
          f"{one_loss:.6f}, difference {abs(results[name][0] - one_loss):.1e}); "
          f"wq gradient differs by {results[name + ' grad']:.1e}")

# %% [markdown]
# The hard-coded head count, run the same way. In one process it computes
# exactly what `Attention` computes (with all 4 heads present, `-1` is the
# head width), and its weights are drawn the same way, so its loss should be
# the one-process loss:

# %%
bug = results["hard-coded heads"]
print(f"view(b, s, n_heads, -1) under TP: loss {bug:.6f}, one process "
      f"{one_loss:.6f} -> "
      + ("silently wrong" if abs(bug - one_loss) > 1e-4 else "equal"))

# %% [markdown]
# Each rank holds 2 of the 4 heads, 16 features wide; `view(b, s, 4, -1)`
# cut them into 4 heads of 4 features, so attention mixed the wrong
# features. No error, just a different model. Use
# `view(b, s, -1, head_dim)` (or compute `n_heads // tp`).
#
# ## 4. Sequence parallelism and `loss_parallel`
#
# Under plain TP, everything between the sublayers - the LayerNorms, the
# residual additions, dropout - runs on the full activation on every rank:
# replicated work and replicated memory. Korthikanti et al. (2022) noticed
# that these operations are independent along the **sequence**: shard them
# by sequence instead (`Shard(1)`). The row-parallel output becomes a
# reduce-scatter (into sequence shards) instead of an all-reduce, and before
# the next column-parallel layer an all-gather rebuilds the full sequence.
# Since an all-reduce *is* a reduce-scatter plus an all-gather, that costs
# no extra bytes. In the plan: `output_layouts=Shard(1)` on the row-parallel
# layers, `SequenceParallel()` on the norms, and `PrepareModuleInput` to
# gather the sequence before attention and the MLP.
#
# **`loss_parallel`** keeps the logits sharded by vocabulary and computes
# the cross-entropy on the shards: each rank's maximum, sum of
# exponentials and target logit are combined with small all-reduces, and
# the big `(tokens, vocab)` logits are never gathered.
#
# The collectives of one training step, counted, forward + backward:

# %%
kinds = ("all_reduce", "all_gather", "reduce_scatter")
print(f"{'':17s}" + "".join(f"{c:>16s}" for c in kinds))
for name in ("TP", "TP+SP", "TP+loss_parallel"):
    fwd, bwd = results[name][1]
    print(f"{name:17s}" + "".join(
        f"{f'{fwd.get(c, 0)} + {bwd.get(c, 0)}':>16s}" for c in kinds))
totals = {name: {c: sum(passes.get(c, 0) for passes in results[name][1])
                 for c in kinds} for name in ("TP", "TP+SP")}
tp_back, sp_back = results["TP"][1][1], results["TP+SP"][1][1]
print(f"TP's {totals['TP']['all_reduce']} all-reduces became "
      f"{totals['TP+SP']['reduce_scatter']} reduce-scatters and "
      f"{totals['TP+SP']['all_gather']} all-gathers; in the backward, "
      f"{tp_back.get('all_reduce', 0)} all-reduces became "
      f"{sp_back.get('reduce_scatter', 0)} reduce-scatters")

# %% [markdown]
# Read the TP line with the plan in mind. Forward: an all-reduce per
# row-parallel layer (the embedding, and `wo` and `mlp.2` in each block)
# and one all-gather of the logits. Backward: an all-reduce of the input
# gradient at each column-parallel entry, the `f` of section 2 - `wq`,
# `wk`, `wv` and `mlp.0`, four per block, and the output layer.
#
# The SP line is *not* "each all-reduce became a pair". Its forward pays a
# reduce-scatter where TP paid an all-reduce, and an all-gather before
# attention, the MLP and the output layer; its backward mirrors the
# forward, an all-gather per reduce-scatter and a reduce-scatter per
# gather (the logits' gather excepted: its backward is a free split). The
# backward has fewer collectives than TP's because the three all-reduces of
# `wq`, `wk` and `wv` merged into one reduce-scatter: `PrepareModuleInput`
# hands attention *one* replicated DTensor, the three partial gradients
# (`Partial` placements) add up locally, and one collective closes them.
# Under plain TP each column-parallel linear makes its own DTensor from a
# plain input and pays its own. Megatron fuses `wq`, `wk`, `wv` into one
# linear for the same saving: 4 collectives per layer instead of the 6
# measured here, the count Chapter 13's planner uses. Exercise 10.2 asks
# for that saving without fusing.
#
# `loss_parallel` drops the logits all-gather and adds three small
# all-reduces of per-token numbers.
#
# What SP buys is memory. The activations saved for backward, per rank,
# and the published reduction beside Korthikanti et al.'s count (section 1)
# at this toy size and at GPT-3's (`s` 2048, `h` 12288, 96 heads, `t` 8):

# %%
saved = {name: results[name][2] for name in ("one process", "TP", "TP+SP")}
for name, b in saved.items():
    print(f"{name:11s} {b / 1024:6.1f} KiB per rank ({b / saved['one process']:.0%}"
          " of one process)")
print("verdict: " + (f"sequence parallelism saved {1 - saved['TP+SP'] / saved['TP']:.0%}"
                     " of TP's saved activations per rank"
                     if saved["TP+SP"] < saved["TP"] else "no saving here"))
toy, gpt3 = (16, 3, 32, 4, 2), (2048, 1, 12288, 96, 8)  # s, b, h, heads, t
counted = {}
for label, (s_, b_, h_, a_, t_) in (("toy", toy), ("GPT-3", gpt3)):
    tp_only = activation_bytes(s_, b_, h_, a_, t_)
    counted[label] = {"TP": tp_only,
                      "TP+SP": activation_bytes(s_, b_, h_, a_, t_, sp=True),
                      "TP+SP, selective": activation_bytes(s_, b_, h_, a_, t_, True,
                                                           True)}
    print(f"counted, {label}: TP+SP saves {1 - counted[label]['TP+SP'] / tp_only:.0%}"
          f" of TP's; with selective recomputation "
          f"{tp_only / counted[label]['TP+SP, selective']:.1f}x less than TP")
five = reference.published("korthikanti_2022.activation_memory_reduction")
print(f"published: {five.value}{five.unit} [{five.label}]")
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
left.bar(list(saved), [b / 1024 for b in saved.values()], color=["C7", "C0", "C1"])
left.set(ylabel="KiB per rank", title="saved for backward, measured here")
right.bar(list(counted["GPT-3"]), [b / 2**30 for b in counted["GPT-3"].values()],
          color=["C0", "C1", "C2"])
right.set(ylabel="GiB per layer and GPU", title="GPT-3 layer, t = 8 (counted)")
right.tick_params(axis="x", labelsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# TP alone splits only what lives inside attention and the MLP; the norms'
# inputs, the residual stream and the logits' inputs stay whole on every
# rank. SP splits those too. Here it saves little, and the count says why:
# SP divides only the part TP leaves whole (the `10` of `10 + 24 / t`), and
# by `t` = 2. The demo also saves each all-gathered input whole
# (Megatron-LM saves the shard and gathers it again in the backward). At
# GPT-3's size with `t` = 8, the count gives the published 5x only with
# **selective recomputation**: attention's scores (`5 a s / h`), which grow
# with `s` and `a` and there outweigh the rest of the layer, are recomputed
# rather than saved, and SP divides all that remains by 8.
#
# ## 5. 2-D parallelism: FSDP2 across, TP within
#
# Tensor parallelism stops at a node; to use more nodes, combine it with
# data parallelism. A 2-D mesh `(dp, tp)` of 4 ranks: ranks `{0, 1}` and
# `{2, 3}` are TP pairs (in practice, GPUs of one node), and `{0, 2}`,
# `{1, 3}` are data-parallel replicas that FSDP2 (`fully_shard`, Chapter 9)
# shards across. Each data-parallel group reads its own half of the batch;
# the mean of their losses is the whole batch's loss.
#
# The order is fixed: **TP first, FSDP second**. `parallelize_module`
# splits plain weights into DTensors on the `tp` mesh; `fully_shard` then
# shards whatever it finds, TP's DTensors included, along `dp`, and its
# all-gathers rebuild only TP's slice. The cell tries the other order too.
# It also saves the 2-D model with **Distributed Checkpoint** (DCP,
# `torch.distributed.checkpoint`, Chapter 12): each rank writes its own
# pieces, and a model built with other weights loads them back, each rank
# reading what its placements need.

# %%
def build_2d(mesh, dev, seed):
    torch.manual_seed(seed)
    model = parallelize_gpt(GPT().to(dev), mesh["tp"])  # TP first
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])  # then FSDP
    fully_shard(model, mesh=mesh["dp"])
    return model


def two_d(rank, world_size, folder):
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 4, 16), device=dev)
    model = build_2d(mesh, dev, seed=0)
    half = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)

    def loss_of(m):
        return F.cross_entropy(m(tokens[half]).flatten(0, 1), targets[half].flatten())

    loss = loss_of(model)
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=mesh["dp"].get_group())
    mean_loss /= mesh["dp"].size()
    torch.manual_seed(0)
    ref = GPT().to(dev)
    ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    wq = model.layers[0].attn.wq.weight
    grad_diff = (wq.grad.full_tensor() - ref.layers[0].attn.wq.weight.grad).abs()
    dcp.save(model.state_dict(), checkpoint_id=folder)
    other = build_2d(mesh, dev, seed=5)
    with torch.no_grad():
        before = loss_of(other).item()
        state = other.state_dict()
        dcp.load(state, checkpoint_id=folder)  # in place, into other's shards
        after = loss_of(other).item()
    try:
        torch.manual_seed(0)
        reverse = fully_shard(GPT().to(dev), mesh=mesh["dp"])
        parallelize_gpt(reverse, mesh["tp"])
        reverse_error = "none"
    except Exception as e:
        reverse_error = f"{type(e).__name__}: {e}"
    return {"coord": tuple(mesh.get_coordinate()), "loss": mean_loss.item(),
            "ref_loss": ref_loss.item(), "grad_diff": grad_diff.max().item(),
            "placements": str(wq.placements), "local": tuple(wq.to_local().shape),
            "norm": str(model.norm.weight.placements), "own_loss": loss.item(),
            "dcp": (before, after), "reverse": reverse_error}


folder = scratch_folder("ch10-")  # removed with the chapter, however it ends
two_d_runs = launch(two_d, 4, args=(str(folder),), timeout=120, echo=False)
files = sorted(os.listdir(folder))
for r in two_d_runs:
    v = r.value
    print(f"rank {r.rank} (dp, tp) = {v['coord']}: loss {v['loss']:.6f} vs one "
          f"process {v['ref_loss']:.6f}; wq grad differs by {v['grad_diff']:.1e}; "
          f"wq local {v['local']}, {v['placements']}")
print(f"final norm's weight: {v['norm']}")
print(f"DCP wrote {files}")
for r in two_d_runs:
    (before, after), own = r.value["dcp"], r.value["own_loss"]
    print(f"rank {r.rank}: other weights' loss {before:.6f}, after loading "
          f"{after:.6f} (saved model {own:.6f}: "
          f"{'the same' if after == own else 'different'})")
print(f"FSDP first, then TP: {v['reverse'][:150]}")

# %% [markdown]
# How to read the placements: one entry per mesh dimension, `(dp, tp)`.
# `wq` is `Shard(0)` along `tp` - the column-parallel split - and FSDP
# shards the *same* dimension 0 again along `dp`. Its slice is then not a
# contiguous block of the full tensor but a block of TP's block: DTensor
# prints that as `_StridedShard(dim=0, sf=2)`, a private placement meaning
# "shard dimension 0, applied after another shard of it with split factor
# 2". The local shape shows the result: 32 rows / 2 (TP) / 2 (FSDP) = 8.
# The final norm is not tensor-parallel, so FSDP makes it a DTensor on the
# `dp` mesh alone: a single placement, `Shard(0)`.
#
# The other order fails: after `fully_shard` the weights are already
# DTensors on the `dp` mesh, and a TP style cannot redistribute them onto
# another mesh. DCP wrote one file per rank and a `.metadata` index; the
# loaded model computes the saved model's loss exactly, since every rank
# read back the very values it had written.
#
# ## 6. In practice: heads, random numbers, overlap
#
# **Grouped-query attention.** Llama-style models share each key/value head
# among several query heads. Tensor parallelism splits `wk` and `wv` by
# heads like `wq`, so the number of KV heads must divide by `t`: Llama 3
# 405B has 8 (section 1 printed its shape), hence TP of at most 8 without
# copying K and V. Beyond that each KV head has to be replicated on
# the ranks whose queries use it. The reshape rule of section 3 still
# holds: `view(b, s, -1, head_dim)` for K and V too. Exercise 10.2's model
# uses grouped-query attention.
#
# **Dropout and random numbers.** Every rank seeds its generator alike, so
# that the weights agree. Dropout then draws the same mask on every rank,
# which is what a *replicated* region needs (the copies must stay equal).
# In a *sharded* region it is wrong: each rank holds different tokens (SP)
# or different heads (attention's dropout under TP), and the same seed gives
# every shard the same pattern. Here is each rank's draw of 12 keep/drop
# decisions after `torch.manual_seed(0)`:

# %%
for r in runs:
    print(f"rank {r.rank} keeps positions {r.value['dropout']}")
same = runs[0].value["dropout"] == runs[1].value["dropout"]
print("verdict: " + ("the same pattern on both ranks - right for replicated "
                     "activations, correlated for shards" if same else
                     "different patterns"))

# %% [markdown]
# Megatron-LM keeps two generators, one seeded alike (replicated regions)
# and one seeded per TP rank (sharded regions). DTensor does it by
# placement on GPU meshes: a random op on a sharded DTensor draws its
# shard's own part of one global stream, so the whole matches one process
# (its offset-based generator lives in the private module
# `torch.distributed.tensor._random`; CPU meshes fall back to each rank's
# own generator).
#
# **Overlapping the collectives.** A layer's all-gather must finish before
# its matmul, and its reduce-scatter waits for the matmul: plain TP leaves
# them on the critical path. *Async TP* splits each pair into chunks, so
# that one chunk travels while the previous one multiplies. torchtitan
# ships it (its `enable_async_tensor_parallel` option, with `torch.compile`):
# the option turns on Inductor's private `_micro_pipeline_tp` pass and
# registers the TP group with `torch.distributed._symmetric_memory`, also
# private. Its published measurement:

# %%
for model_name, n in (("70b", "fsdp32_tp8_bf16_256xh100"),
                      ("8b", "fsdp8_tp8_bf16_64xh100")):
    plain = reference.published(f"runs.torchtitan_llama3_{model_name}_{n}")
    overlapped = reference.published(
        f"runs.torchtitan_llama3_{model_name}_{n.replace('bf16', 'bf16_asynctp')}")
    rate, rate_async = (f.value["measured"]["tokens_per_s_per_gpu"]
                        for f in (plain, overlapped))
    v = plain.value
    print(f"{v['model']['name']} on {v['n_gpus']} GPUs (FSDP {v['dp']} x TP "
          f"{v['tp']}): {rate:,} -> {rate_async:,} tokens/s per GPU with async TP, "
          f"{rate_async / rate:.2f}x")
print(f"[{plain.label}]")

# %% [markdown]
# Overlap hides part of the communication, not all of it: the first chunk
# waits, the chunked matmuls run a little less efficiently, and the gain
# is bounded by the communication's share of the step.
#
# ## 7. On GPUs: what a layer's collectives cost
#
# The counts above set the traffic: per layer and step, Megatron's layer
# (Q, K, V fused) does 4 all-reduces of the `(tokens, h)` activation - 2
# forward, 2 backward - or, with SP, 4 reduce-scatters and 4 all-gathers of
# the same total bytes. The cell predicts them for one 2048-token sequence
# of GPT-3's width, beside the layer's own compute (`24 s h^2 + 4 s^2 h`
# FLOPs forward, 3x that per step, divided by `t`), both from the course's
# step model (Chapter 13): collectives as NCCL runs them, compute at the
# whole-step rate that model reaches on published training runs. One thing
# changes at a time: first the TP degree on NVLink inside a node, then the
# link at 8 GPUs (one GPU in each of 8 nodes, one network port each).

# %%
width, heads = 12288, 96  # GPT-3


def layer_times(tp, link, tokens=2048, gpu="h100_sxm", math="bf16"):
    """(communication, compute) Figures of one layer's training step per GPU."""
    flops = 3 * (24 * tokens * width**2 + 4 * tokens**2 * width) / tp
    return (predict.tp_layer_comm_seconds(tokens, width, tp, link),
            predict.training_compute_seconds(flops, gpu, math))


def show_times(label, comm, compute):
    print(f"  {label}: communication {comm.value * 1e3:.2f} ms, compute "
          f"{compute.value * 1e3:.2f} ms -> {comm.value / compute.value:.2f}x")


cases = {}
print("TP degree, NVLink inside one H100 node:")
for tp in (2, 4, 8):
    cases[f"TP {tp}, NVLink"] = layer_times(tp, "nvlink_h100")
    show_times(f"TP {tp}", *cases[f"TP {tp}, NVLink"])
ratios = [comm.value / compute.value for comm, compute in cases.values()]
print(f"  [{cases['TP 8, NVLink'][0].label}]")
print("verdict: communication's share " + (
    "grows with the TP degree" if ratios == sorted(ratios) else
    "does not grow steadily with the TP degree") +
      f" ({ratios[0]:.2f}x at TP 2, {ratios[-1]:.2f}x at TP 8), and stays "
      + ("below" if max(ratios) < 1 else "not below") + " the ideal compute")
print("the link, TP 8:")
cases["TP 8, InfiniBand"] = layer_times(8, "ndr_infiniband")
show_times("across nodes", *cases["TP 8, InfiniBand"])
ib, nv = cases["TP 8, InfiniBand"][0].value, cases["TP 8, NVLink"][0].value
print(f"  [{cases['TP 8, InfiniBand'][0].label}]")
print(f"verdict: the same 8-way split communicates {ib / nv:.1f}x "
      + ("longer" if ib > nv else "shorter") + " across nodes than over NVLink")
print("2 x T4 (PCIe 3, no NVLink), fp16:")
cases["TP 2, 2 x T4"] = layer_times(2, "pcie3_x16", gpu="t4", math="fp16")
show_times("TP 2", *cases["TP 2, 2 x T4"])
print(f"  [{cases['TP 2, 2 x T4'][0].label}]")
(t4_comm, t4_compute), (h_comm, h_compute) = (cases["TP 2, 2 x T4"],
                                              cases["TP 2, NVLink"])
print(f"verdict: at TP 2 a T4 computes {t4_compute.value / h_compute.value:.0f}x "
      f"longer than an H100 and communicates {t4_comm.value / h_comm.value:.0f}x "
      "longer, so communication's share is "
      + ("smaller" if t4_comm.value / t4_compute.value
         < h_comm.value / h_compute.value else "larger") + " on the T4s")

fig, ax = plt.subplots(figsize=(8, 3))
names = list(cases)
for i, (what, color) in enumerate((("communication", "C3"), ("compute", "C0"))):
    ax.bar([x + 0.4 * i for x in range(len(names))],
           [cases[n][i].value * 1e3 for n in names], 0.4, label=what, color=color)
ax.set_xticks([x + 0.2 for x in range(len(names))], names, fontsize=8)
ax.set(ylabel="ms per layer and step", yscale="log",
       title="one GPT-3 layer, one 2048-token sequence (predicted)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Each prediction's label ends with what its model leaves out and which
# way that moves the number: read every verdict with it, not as a
# measurement. Overlap (section 6) hides part of whatever communication
# there is. A T4 pair is slower on both counts, its compute and its PCIe
# link, and what matters is the ratio of the two: its verdict compares it
# with an H100 pair's. Drag the sliders: the TP degree, the sequence length and
# the link against the time per layer, and the activations one layer saves
# per GPU (section 1's count, attention's scores recomputed):

# %%
def draw_layer(tp=4, tokens=2048, link="nvlink_h100"):
    comm, compute = layer_times(tp, link, tokens)
    saved = {"TP": activation_bytes(tokens, 1, width, heads, tp, selective=True),
             "TP+SP": activation_bytes(tokens, 1, width, heads, tp, True, True)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
    left.bar(["compute", "communication"], [compute.value * 1e3, comm.value * 1e3],
             color=["C0", "C3"])
    left.set(ylabel="ms per layer and step (predicted)",
             title=f"TP {tp} over {link}: {comm.value / compute.value:.2f}x")
    right.bar(list(saved), [b / 2**20 for b in saved.values()], color=["C0", "C1"])
    right.set(ylabel="MiB per layer and GPU",
              title=f"SP saves {1 - saved['TP+SP'] / saved['TP']:.0%} of TP's")
    plt.tight_layout()
    plt.show()


widgets.interact(draw_layer,
                 tp=widgets.IntSlider(value=4, min=2, max=8, step=2,
                                      description="TP degree"),
                 tokens=widgets.IntSlider(value=2048, min=512, max=32768, step=512,
                                          description="tokens"),
                 link=["nvlink_h100", "ndr_infiniband"]);

# %% [markdown]
# Published results at scale:

# %%
for key in ("megatron_2019.scaling_efficiency_512_gpus",
            "megatron_2021.aggregate_pflops_3072_gpus",
            "megatron_2021.fraction_of_peak_3072_gpus",
            "korthikanti_2022.mfu_530b_sp_selective",
            "korthikanti_2022.mfu_530b_full_recompute"):
    f = reference.published(key)
    print(f"{f.value} {f.unit}: {f.measures}\n    [{f.label}]")

# %% [markdown]
# Megatron-LM (2019) combined tensor and data parallelism. At 3,072 GPUs
# Narayanan et al. (2021) compose tensor, pipeline and data parallelism,
# and name expensive cross-node communication as what breaks their naive
# use. Sequence parallelism with selective recomputation (Korthikanti et
# al., 2022) took a 530B model from 42.1 % to 54.2 % model FLOPs
# utilisation, against recomputing whole layers to fit.
#
# **On your GPUs.** A launch gets `nccl` when there is a GPU for each of its
# ranks. With one GPU, every launch here needs 2 or 4 ranks, so all of them
# ran over `gloo` on the CPU and the GPU stayed idle (tensor parallelism
# needs two devices at least). With 2 GPUs the 2-rank launches ran over `nccl` and
# the 4-rank 2-D one over `gloo`; with 4 or more, all of them ran over
# `nccl`. The counts are the same either way: the plan, not the device,
# decides the collectives. The losses differ from one process by float
# rounding on either.

# %% [markdown]
# ## Summary
#
# - Tensor parallelism is used at scale because data parallelism alone
#   runs out of batch, its gathers take a step per rank, and it never
#   divides activations; TP divides all three by `t`.
# - The Megatron split: column-parallel then row-parallel linear, one
#   collective forward (`g`) and one backward (`f`) per sublayer; attention
#   splits by heads, and KV heads must divide by `t`.
# - A DTensor is a local tensor plus placements on a device mesh; `Shard`
#   to `Replicate` is an all-gather, `Partial` to `Replicate` an all-reduce,
#   `Partial` to `Shard` a reduce-scatter.
# - One replicated DTensor into a sublayer (`PrepareModuleInput`) sums its
#   linears' input gradients before one collective, as fused QKV does.
# - Sequence parallelism shards the norms' activations by sequence at no
#   extra bytes; its large savings come with selective recomputation.
# - TP before FSDP on a 2-D mesh; DCP saves and loads it per rank; overlap
#   (async TP) hides part of the communication; TP stays inside a node.

# %% [markdown]
# ## Exercises
#
# ### Exercise 10.1: attention split by heads
#
# Write `head_parallel_attention(x, wq, wk, wv, wo, n_heads)`. It runs on
# every rank of a process group; `x` (batch, seq, dim) and the full weights
# (`nn.Linear` layout, no biases) are the same on every rank. Return the
# output of causal multi-head self-attention - the same on every rank - but
# compute only `n_heads / world_size` heads on each rank, with one
# all-reduce forward and one backward (for `x`'s gradient), and the right
# gradients (for `x`, and for the slices of the weights your rank used).
# The one-process version:
#
# ```python
# q, k, v = (F.linear(x, w).view(b, s, n_heads, dim // n_heads).transpose(1, 2)
#            for w in (wq, wk, wv))
# out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
# return F.linear(out.transpose(1, 2).reshape(b, s, dim), wo)
# ```
#
# The checker runs it on 2 and 3 ranks with odd sizes.

# %% tags=["exercise"] exercise="10.1"
def head_parallel_attention(x, wq, wk, wv, wo, n_heads):
    ### BEGIN SOLUTION
    rank, world = dist.get_rank(), dist.get_world_size()
    b, s, dim = x.shape
    head_dim = dim // n_heads
    mine = slice(rank * dim // world, (rank + 1) * dim // world)  # my heads
    x = CopyToParallel.apply(x)
    q, k, v = (F.linear(x, w[mine]).view(b, s, -1, head_dim).transpose(1, 2)
               for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    partial = F.linear(out.transpose(1, 2).reshape(b, s, -1), wo[:, mine])
    return ReduceFromParallel.apply(partial)
    ### END SOLUTION


# %% tags=["check"] exercise="10.1"
check_head_parallel_attention(head_parallel_attention)

# %% [markdown]
# ### Exercise 10.2: one collective per sublayer, both ways
#
# Write `parallelize_llama(model, mesh, sequence_parallel)` that applies a
# tensor-parallel plan to the model below on `mesh`, with sequence
# parallelism when `sequence_parallel` is true. Its attention is
# grouped-query (4 query heads share 2 KV heads, so `k_proj` and `v_proj`
# are narrower) and its MLP is SwiGLU: `down(silu(gate(x)) * up(x))`, two
# column-parallel linears side by side. The model must then return full
# logits (batch, seq, vocab) as a plain tensor.
#
# The new part: `parallelize_gpt`'s plan pays one backward all-reduce per
# column-parallel linear. Yours must pay **one collective per sublayer in
# each direction**, as fused Q, K, V would, but without fusing anything.
# The checker runs it on 2 ranks and wants: the loss and every gradient
# equal to one process; every linear inside the blocks sharded; and,
# counted inside the blocks only (the embedding and the output layer are
# yours to split as you like), per attention and per feed-forward exactly
# one all-reduce forward and one backward, or with SP one all-gather and
# one reduce-scatter each way.

# %%
print(exercise_model())

# %% tags=["exercise"] exercise="10.2"
def parallelize_llama(model, mesh, sequence_parallel):
    ### BEGIN SOLUTION
    seq = Shard(1)
    between = seq if sequence_parallel else Replicate()
    block_plan = {
        "attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(),
        "attention.v_proj": ColwiseParallel(),
        "attention.out_proj": RowwiseParallel(output_layouts=between),
        "feed_forward.gate": ColwiseParallel(), "feed_forward.up": ColwiseParallel(),
        "feed_forward.down": RowwiseParallel(output_layouts=between),
    }
    # one replicated DTensor into each sublayer: its linears' partial input
    # gradients add up locally and one collective closes them (under SP, the
    # same module also gathers the sequence)
    one_input = PrepareModuleInput(input_layouts=(between,),
                                   desired_input_layouts=(Replicate(),))
    block_plan |= {"attention": one_input, "feed_forward": one_input}
    if sequence_parallel:
        block_plan |= {"attention_norm": SequenceParallel(),
                       "ffn_norm": SequenceParallel()}
    for block in model.layers:
        parallelize_module(block, mesh, block_plan)
    top_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top_plan["final_norm"] = SequenceParallel()
    parallelize_module(model, mesh, top_plan)
    return model
    ### END SOLUTION


# %% tags=["check"] exercise="10.2"
check_parallelize_plan(parallelize_llama)

# %% [markdown]
# ### Exercise 10.3: predict the counts of another model
#
# Section 4 counted the collectives of one training step of its GPT. Now
# predict them for Exercise 10.2's model under `parallelize_gpt`'s plan,
# one style per linear (not your merged plan): `ColwiseParallel` on `q_proj`,
# `k_proj`, `v_proj`, `gate` and `up`; `RowwiseParallel` on `out_proj` and
# `down`; the embedding row-parallel, the output layer column-parallel;
# and `sequence_parallel` and `loss_parallel` switched as in
# `parallelize_gpt`. Write `predict_collectives(n_layers, sequence_parallel,
# loss_parallel)` returning `{"all_reduce": ..., "all_gather": ...,
# "reduce_scatter": ...}` for one rank's forward and backward, for any
# depth and any combination of the two switches. The checker builds that
# model and plan, runs real steps at several depths on 2 ranks and counts.

# %% tags=["exercise"] exercise="10.3"
def predict_collectives(n_layers, sequence_parallel, loss_parallel):
    ### BEGIN SOLUTION
    if not sequence_parallel:
        # forward: embedding + 2 per block; backward: the output layer's input
        # and q, k, v, gate, up: 5 per block
        return {"all_reduce": 2 + 7 * n_layers + (3 if loss_parallel else 0),
                "all_gather": 0 if loss_parallel else 1, "reduce_scatter": 0}
    # each forward reduce-scatter has an all-gather backward, and the reverse;
    # the logits' gather (not with loss_parallel) has a free split backward
    forward_rs = 1 + 2 * n_layers
    forward_ag = 2 * n_layers + 1 + (0 if loss_parallel else 1)
    return {"all_reduce": 3 if loss_parallel else 0,
            "all_gather": forward_ag + forward_rs,
            "reduce_scatter": forward_rs + 2 * n_layers + 1}
    ### END SOLUTION


# %% tags=["check"] exercise="10.3"
check_predicted_counts(predict_collectives)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | tensor parallelism | 张量并行 |
# | column-parallel / row-parallel linear | 列并行 / 行并行线性层 |
# | conjugate operators f and g | 共轭算子 f 与 g |
# | all-reduce / all-gather / reduce-scatter | 全规约 / 全收集 / 规约散射 |
# | DTensor (distributed tensor) | 分布式张量 |
# | device mesh | 设备网格 |
# | placement (shard, replicate, partial) | 放置方式（分片、复制、部分和） |
# | sequence parallelism | 序列并行 |
# | loss parallel | 损失并行 |
# | 2-D parallelism | 二维并行 |
# | attention head | 注意力头 |
# | grouped-query attention | 分组查询注意力 |
# | selective activation recomputation | 选择性激活重计算 |
# | asynchronous tensor parallelism (compute-communication overlap) | 异步张量并行（计算与通信重叠） |
# | distributed checkpoint | 分布式检查点 |

# %%
tidy_up()  # the last cell: the chapter's temporary folder goes
