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
# - Why a layer is split across devices, what that costs (collectives on the
#   critical path of every layer), and why tensor parallelism stays inside a
#   node.
# - The Megatron-LM split by hand: a column-parallel then a row-parallel
#   linear with one all-reduce, and the two conjugate operators `f` and `g`
#   as autograd functions.
# - DTensor: placements (`Shard`, `Replicate`, `Partial`), what each
#   `redistribute` costs, and `parallelize_module` on a small GPT.
# - Sequence parallelism and `loss_parallel`, with every collective counted
#   and the activation memory per rank measured; 2-D parallelism (FSDP2 x TP).
#
# **Hardware.** Every rank is a real process and every collective a real
# `gloo` (CPU) or `nccl` (one GPU per rank) collective, so the counts, the
# losses and the bytes below are measured. Without GPUs the ranks run on the
# CPU; the GPU side - how long these collectives take on NVLink and across
# nodes - is shown as labelled predictions and published figures.

# %%
import warnings

import torch
import torch.distributed as dist
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
from course_utils.dist import launch

banner()


def rank_device(rank):
    """The rank's GPU under nccl (one per rank), else the CPU."""
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


# %% [markdown]
# ## 1. Why split a layer
#
# Data parallelism (Chapters 5-6) copies the whole model onto every device;
# sharding (Chapter 9) splits the *stored* weights but gathers each layer
# whole before computing it. Both assume one layer, with its activations,
# fits on one device. Pipelines (Chapter 7) cut between layers. **Tensor
# parallelism** cuts inside each layer: every device holds a slice of every
# weight matrix and computes a slice of every product.
#
# How large is one layer? A GPT layer of width `h` has about `12 h^2`
# weights (`4 h^2` in attention, `8 h^2` in the MLP). For GPT-3's width the
# cell counts its weights, their Adam training state (16 bytes per weight
# in mixed precision) and its stored activations for one 2048-token
# sequence, counting only six `(s, h)` and two `(s, 4h)` tensors per layer
# in bf16 and leaving out attention's scores - a lower bound:

# %%
h, seq, n_layers = 12288, 2048, 96  # GPT-3 175B's width, context, depth
layer_weights = 12 * h * h
adam_bytes = 16 * layer_weights  # bf16 weight + grad, fp32 master, 2 moments
act_bytes = 2 * seq * (6 * h + 2 * 4 * h)  # a lower bound, bf16
print(f"one layer: {layer_weights / 1e9:.2f} B weights, "
      f"{adam_bytes / 2**30:.0f} GiB of training state, "
      f"{act_bytes / 2**20:.0f} MiB of activations per sequence")
print(f"{n_layers} layers: {n_layers * adam_bytes / 2**30:,.0f} GiB of state, "
      f"{n_layers * act_bytes / 2**30:.0f} GiB of activations per sequence")
per_gpu = n_layers * (adam_bytes + act_bytes) / 8 / 2**30
gpu_memory = reference.published("h100_sxm.memory_gb")
print(f"split 8 ways (one 8-GPU node): {per_gpu:,.0f} GiB per GPU, "
      f"{per_gpu * 2**30 / 1e9 / gpu_memory.value:.1f}x an H100's "
      f"{gpu_memory.value} GB [{gpu_memory.label}]")

# %% [markdown]
# Even split 8 ways it does not fit, so tensor parallelism is combined with
# pipelines and sharding (section 5). The price is communication *inside*
# every layer: the forward pass of each
# attention and each MLP ends with an all-reduce of the full activation, and
# the next layer cannot start before it finishes. So the link between the
# devices sets the pace. Inside an 8-GPU node NVLink carries hundreds of
# GB/s per GPU; between nodes each GPU has one network port, about nine
# times slower (published figures in section 6). That is why tensor
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
# rank really holds is the storage under a DTensor's local tensor (or under
# a collective's pending result, an `AsyncCollectiveTensor`).

# %%
def local_storage(t):
    while isinstance(t, (DTensor, AsyncCollectiveTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t.untyped_storage()


def train_step(model, tokens, targets, use_loss_parallel=False):
    """Forward and backward once: (loss, collective counts, saved bytes)."""
    seen = {local_storage(p).data_ptr() for p in model.parameters()}
    saved = [0]

    def pack(t):
        storage = local_storage(t)
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes()
        return t

    with CommDebugMode() as mode, torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        logits = model(tokens)
        if use_loss_parallel:
            with loss_parallel():  # cross-entropy on vocabulary shards
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
            loss = loss.full_tensor()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
    return loss.item(), comm_counts(mode), saved[0]


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
# The collectives of one training step, counted:

# %%
print(f"{'':17s} {'all_reduce':>11s} {'all_gather':>11s} {'reduce_scatter':>15s}")
for name in ("TP", "TP+SP", "TP+loss_parallel"):
    counts = results[name][1]
    print(f"{name:17s} " + " ".join(
        f"{counts.get(c, 0):>{w}d}" for c, w in
        (("all_reduce", 11), ("all_gather", 11), ("reduce_scatter", 15))))

# %% [markdown]
# Read the TP line with the plan in mind: forward, an all-reduce per
# row-parallel layer (the embedding, and `wo` and `mlp.2` in each block)
# and one all-gather of the logits; backward, an all-reduce of the input
# gradient at each column-parallel entry - the `f` of section 2. (`wq`, `wk`
# and `wv` each count one: Megatron fuses them into one linear to pay once.)
# Under SP, every all-reduce became a reduce-scatter / all-gather pair:
# none is left. `loss_parallel` drops the logits all-gather and adds three
# small all-reduces of per-token numbers.
#
# What SP buys is memory. The activations saved for backward, per rank:

# %%
one_bytes = results["one process"][2]
for name in ("TP", "TP+SP"):
    b = results[name][2]
    print(f"{name:6s} {b / 1024:6.1f} KiB per rank ({b / one_bytes:.0%} of one "
          f"process's {one_bytes / 1024:.1f} KiB)")
tp_b, sp_b = results["TP"][2], results["TP+SP"][2]
print("verdict: " + (f"sequence parallelism saved {1 - sp_b / tp_b:.0%} of "
                     "TP's saved activations per rank" if sp_b < tp_b else
                     "no saving here"))

# %% [markdown]
# TP alone splits only what lives inside attention and the MLP; the norms'
# inputs, the residual stream and the logits' inputs stay whole on every
# rank. SP splits those too. Not everything: the all-gathered input of each
# column-parallel layer is still saved whole here (Megatron-LM saves the
# shard instead and gathers it again in the backward). Korthikanti et al.
# pair SP with selective recomputation of attention's largest activations
# (published figures in section 6).
#
# ## 5. 2-D parallelism: FSDP2 across, TP within
#
# Tensor parallelism stops at a node; to use more nodes, combine it with
# data parallelism. A 2-D mesh `(dp, tp)` of 4 ranks: ranks `{0, 1}` and
# `{2, 3}` are TP pairs (in practice, GPUs of one node), and `{0, 2}`,
# `{1, 3}` are data-parallel replicas that FSDP2 (`fully_shard`, Chapter 9)
# shards across. Each data-parallel group reads its own half of the batch;
# the mean of their losses is the whole batch's loss.

# %%
def two_d(rank, world_size):
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, 64, (2, 4, 16), device=dev)
    torch.manual_seed(0)
    model = parallelize_gpt(GPT().to(dev), mesh["tp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    half = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    loss = F.cross_entropy(model(tokens[half]).flatten(0, 1),
                           targets[half].flatten())
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
    return (mesh.get_coordinate(), mean_loss.item(), ref_loss.item(),
            grad_diff.max().item(), str(wq.placements),
            tuple(wq.to_local().shape), str(model.norm.weight.placements))


for r in launch(two_d, 4, timeout=120, echo=False):
    coord, loss, ref_loss, gdiff, placements, local, norm = r.value
    print(f"rank {r.rank} (dp, tp) = {tuple(coord)}: loss {loss:.6f} vs one "
          f"process {ref_loss:.6f}; wq grad differs by {gdiff:.1e}; wq local "
          f"{local}, {placements}")
print(f"final norm's weight: {norm}")

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
# ## 6. On GPUs: what a layer's collectives cost
#
# The counts above set the traffic: per layer and step, Megatron's layer
# (Q, K, V fused) does 4 all-reduces of the `(tokens, h)` activation - 2
# forward, 2 backward - or, with SP, 4 reduce-scatters and 4 all-gathers of
# the same total bytes. A prediction for a GPT-3-width layer on one 8-GPU
# H100 node (NVLink), across two nodes (each GPU's 400 Gb/s InfiniBand
# port), and on 2 x T4 (PCIe 3, no NVLink), each beside the layer's own
# compute time at the GPU's peak:

# %%
tokens_per_step, width = 2048, 12288  # one sequence of GPT-3's width
layer_flops = 3 * 24 * tokens_per_step * width**2  # forward + backward
for tp, link, gpu, math in ((8, "nvlink_h100", "h100_sxm", "bf16"),
                            (16, "ndr_infiniband", "h100_sxm", "bf16"),
                            (2, "pcie3_x16", "t4", "fp16")):
    comm = predict.tp_layer_comm_seconds(tokens_per_step, width, tp, link)
    compute = predict.roofline_seconds(layer_flops / tp, 0, gpu, math)
    reference.show(f"10.tp_comm_{link}", figures=[comm], fmt="{:.3g}")
    print(f"  vs compute {compute.value * 1e3:.2f} ms per GPU at {gpu}'s peak "
          f"{math}: communication is {comm.value / compute.value:.2f}x the compute")

# %% [markdown]
# Inside the H100 node the collectives cost a fraction of the (ideal)
# compute, and real systems overlap part of them with it; across nodes they
# cost several times the compute, and nothing can hide that. On two T4s the
# ratio is small only because their compute is slow: the faster the GPU,
# the more its links matter. Published results at scale:

# %%
for key in ("megatron_2019.scaling_efficiency_512_gpus",
            "megatron_2021.aggregate_pflops_3072_gpus",
            "megatron_2021.fraction_of_peak_3072_gpus",
            "korthikanti_2022.activation_memory_reduction",
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
# ranks: with 2 GPUs the 2-rank launches ran over `nccl` and the 4-rank 2-D
# one over `gloo` on the CPU; with 4 or more, all of them ran over `nccl`.
# The counts are the same either way: the plan, not the device, decides the
# collectives. The losses differ from one process by float rounding on
# either.

# %% [markdown]
# ## Summary
#
# - Tensor parallelism splits each layer: column-parallel then row-parallel
#   linear, one all-reduce forward (`g`) and one backward (`f`) per MLP or
#   attention; attention splits by heads.
# - A DTensor is a local tensor plus placements on a device mesh; changing
#   `Shard` to `Replicate` is an all-gather, `Partial` to `Replicate` an
#   all-reduce, `Partial` to `Shard` a reduce-scatter.
# - `parallelize_module` applies a plan of `ColwiseParallel` /
#   `RowwiseParallel`; reshapes must use the local head count
#   (`view(b, s, -1, head_dim)`).
# - Sequence parallelism turns each all-reduce into a reduce-scatter and an
#   all-gather (same bytes) and shards the norms' activations;
#   `loss_parallel` never gathers the logits.
# - TP stays inside a node (NVLink); 2-D meshes add FSDP2 across nodes.

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
# all-reduce forward and the right gradients backward (for `x`, and for the
# slices of the weights your rank used). The one-process version:
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
# ### Exercise 10.2: a plan for a Llama-style model
#
# Write `parallelize_llama(model, mesh, sequence_parallel)` that applies a
# tensor-parallel plan to the model below (its MLP is SwiGLU:
# `down(silu(gate(x)) * up(x))`) on `mesh`, with sequence parallelism when
# `sequence_parallel` is true. The model must then return full logits
# (batch, seq, vocab) as a plain tensor. The checker runs it on 2 ranks and
# wants: the loss and every gradient equal to one process; every linear
# inside the blocks sharded; exactly one collective per sublayer in the
# forward (an all-reduce, or with SP a reduce-scatter) and nothing else
# inside the blocks except SP's all-gathers.

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
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(seq,),
                                    desired_input_layouts=(Replicate(),))
        block_plan |= {"attention_norm": SequenceParallel(),
                       "ffn_norm": SequenceParallel(),
                       "attention": gather, "feed_forward": gather}
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
# ### Exercise 10.3: predict the counts
#
# Section 4 counted the collectives of one training step of its 2-layer GPT.
# Write `predict_collectives(n_layers, sequence_parallel, loss_parallel)`
# returning `{"all_reduce": ..., "all_gather": ..., "reduce_scatter": ...}`
# for the same GPT and `parallelize_gpt` plan with `n_layers` blocks, for
# any combination of the two switches (SP *and* `loss_parallel` too). Work
# out where each collective comes from; the checker runs the real thing at
# several depths.

# %% tags=["exercise"] exercise="10.3"
def predict_collectives(n_layers, sequence_parallel, loss_parallel):
    ### BEGIN SOLUTION
    if not sequence_parallel:
        # forward: embedding + 2 per block; backward: head input + 4 per block
        return {"all_reduce": 2 + 6 * n_layers + (3 if loss_parallel else 0),
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
