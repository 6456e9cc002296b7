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
# # Chapter 13: Putting it together
#
# **What you will learn**
#
# - How the parallelisms of Chapters 6-11 compose on one device mesh: one
#   small GPT trained with FSDP2, with FSDP2 x tensor parallelism, with
#   FSDP2 x context parallelism, and with pipeline x data parallelism (GPipe
#   and 1F1B), each equal to one process.
# - What each layout costs, measured side by side: bytes per rank and the
#   collectives of one step, counted.
# - What a missing gradient reduction looks like, and how to find the mesh
#   dimension it is missing on.
# - How a real run's layout is chosen: fit the model, then the batch, then
#   throughput; tensor parallelism inside a node; with published layouts of
#   Llama 3, DeepSeek-V3 and Megatron-LM.
# - A planner that predicts memory per GPU and step time for every layout of
#   a real model, dense or mixture of experts, over data, context, tensor,
#   pipeline and expert parallelism, checked against published training
#   runs it was not fitted on, and against a fake-tensor run.
#
# **Hardware.** Four ranks, each a real process, joined by `gloo` on the CPU
# (or `nccl` with one GPU per rank when there are four or more): every loss,
# byte and collective below is measured. The planner's numbers for large
# GPUs are labelled predictions from the course's calibrated models.

# %%
import functools
import warnings

import ipywidgets as widgets
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from course_utils import banner, memory, planner, reference
from course_utils.checks.ch13 import (
    check_choose_layout,
    check_missing_reductions,
    check_pp_tp_stage,
)
from course_utils.dist import launch
from course_utils.traces import Collectives, SavedActivations

banner()


def rank_device(rank):
    """The rank's GPU under nccl (one per rank), else the CPU."""
    if "nccl" in dist.get_backend():
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


# %% [markdown]
# ## 1. One model, five layouts
#
# The model is Chapter 10's small GPT: an embedding, pre-norm blocks of
# causal attention and an MLP, a final norm and an output layer. Its blocks
# sit in a `ModuleDict` keyed by layer number, so that a pipeline stage can
# drop the blocks it does not own and keep the others' names.

# %%
class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False)
                                              for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape  # -1 heads: the local head count under TP
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, dim=64, n_heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads)
                                     for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):  # tokens on the first stage, activations after it
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(self.norm(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# %% [markdown]
# The four kinds of wiring, each a few lines on top of a device mesh:
#
# - **tensor parallel**: Chapter 10's plan, column-parallel then row-parallel
#   in attention and in the MLP;
# - **context parallel**: each rank of a `cp` group holds a contiguous chunk
#   of every sequence; attention all-gathers the keys and values of the whole
#   sequence (Llama 3's all-gather method, Chapter 11) and masks what lies in
#   each query's future. The backward of an all-gather is a reduce-scatter;
#   `gloo` has none, so it all-reduces and keeps this rank's chunk;
# - **pipeline stage**: stage `i` of `n` keeps its share of the blocks, the
#   first stage the embedding, the last the norm and output layer;
# - **FSDP2**: `fully_shard` per block and on the root (Chapter 9).

# %%
TP_PLAN = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
           "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
           "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def tensor_parallel(model, tp_mesh):
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, TP_PLAN)
    return model


def pipeline_stage(model, index, n_stages):
    names = list(model.layers)  # stage i: blocks i*L//n .. (i+1)*L//n - 1
    first, end = index * len(names) // n_stages, (index + 1) * len(names) // n_stages
    for name in names[:first] + names[end:]:
        del model.layers[name]
    if index > 0:
        model.embed = None
    if index < n_stages - 1:
        model.norm = model.head = None
    return model


def shard(model, dp_mesh):
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2); backward: sum, keep my chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        chunks = grad.chunk(dist.get_world_size(ctx.group), dim=2)
        return chunks[dist.get_rank(ctx.group)], None


def cp_attention(attn, group, x):
    b, s, _ = x.shape  # s: this rank's chunk of the sequence
    q, k, v = (w(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
               for w in (attn.wq, attn.wk, attn.wv))
    k, v = GatherSequence.apply(k, group), GatherSequence.apply(v, group)
    start = dist.get_rank(group) * s  # where my chunk starts in the sequence
    mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=x.device).tril(start)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


def context_parallel(model, cp_mesh):
    for block in model.layers.values():
        block.attn.forward = functools.partial(cp_attention, block.attn,
                                               cp_mesh.get_group())
    return model


# %% [markdown]
# Two counters, from `course_utils.traces`. `Collectives` is a dispatch mode that sees every operator
# and counts those of the distributed libraries (`c10d`, and the functional
# collectives DTensor uses), point-to-point sends and receives included.
# `SavedActivations` tracks what autograd keeps for the backward pass with a
# saved-tensors hook (Chapter 8): each kept storage counts once while it
# lives, and the peak is recorded. Unlike `MemTracker`, it also works when a
# pipeline runs a stage's forward several times per step (one per
# micro-batch), which `MemTracker` refuses. Each is a context manager:
# `with Collectives() as counter:` leaves `counter.counts`, `with
# SavedActivations(model) as tracker:` leaves `tracker.peak` (bytes).

# %% [markdown]
# One training loop serves every layout: five Adam steps, memory counted on
# step 2 (the optimizer state exists from step 1 on), collectives on step 3.
# `step()` returns this rank's loss, or `None` on a pipeline stage that does
# not compute it. The training state is the local bytes of the parameters,
# their gradients and Adam's two moments: under FSDP and TP, the shards.

# %%
def train(model, step, steps=5, keep_grads=False):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, saved, counts, state, grads = [], 0, {}, 0, {}
    for i in range(steps):
        if i == 0:
            losses.append(step())
            if keep_grads:  # step 1's gradients, for the seeded bug below
                grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
        elif i == 1:
            with SavedActivations(model) as tracker:
                losses.append(step())
            saved = tracker.peak
            state = memory.storage_bytes(
                [*model.parameters(), *(p.grad for p in model.parameters())])
        elif i == 2:
            with Collectives() as counter:
                losses.append(step())
            counts = counter.counts
        else:
            losses.append(step())
        opt.step()
        opt.zero_grad()
    state += memory.storage_bytes(v for s in opt.state.values() for v in s.values()
                                  if v.dim())
    return {"losses": losses, "state": state, "saved": saved, "counts": counts,
            "grads": grads}


# %% [markdown]
# The layouts, on 4 ranks. Each reads the same 8 sequences of 16 tokens
# per step; a data-parallel group of `d` replicas gives each its `8 / d`,
# and a context-parallel pair splits each of those sequences in two halves
# of 8 tokens. Every rank's loss is the mean over its tokens, and FSDP
# averages the gradients over all 4 ranks: with equal token counts, that is
# one process's mean.
# The pipeline layouts split each replica's sequences into 4
# micro-batches. The last one is a **seeded bug**: the PP x DP layout with
# plain modules on each replica and the data-parallel gradient reduction
# forgotten.

# %%
BATCH, SEQ, VOCAB = 8, 16, 64


def fsdp_layout(dev, world, tokens, targets):
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = shard(GPT().to(dev), mesh["dp"])
    mine = slice(mesh.get_local_rank() * BATCH // world,
                 (mesh.get_local_rank() + 1) * BATCH // world)

    def step():
        loss = loss_fn(model(tokens[mine]), targets[mine])
        loss.backward()
        return loss.item()
    return train(model, step)


def fsdp_tp_layout(dev, world, tokens, targets):
    mesh = init_device_mesh(dev.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = shard(tensor_parallel(GPT().to(dev), mesh["tp"]), mesh["dp"])
    d, n = mesh["dp"].get_local_rank(), mesh["dp"].size()
    mine = slice(d * BATCH // n, (d + 1) * BATCH // n)

    def step():
        loss = loss_fn(model(tokens[mine]), targets[mine])
        loss.backward()
        return loss.item()
    return train(model, step)


def fsdp_cp_layout(dev, world, tokens, targets):
    mesh = init_device_mesh(dev.type, (world // 2, 2), mesh_dim_names=("dp", "cp"))
    everyone = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp_cp",))
    torch.manual_seed(0)  # FSDP shards over dp x cp, as torchtitan does
    model = shard(context_parallel(GPT().to(dev), mesh["cp"]), everyone)
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    rows = slice(d * BATCH // 2, (d + 1) * BATCH // 2)
    cols = slice(c * SEQ // 2, (c + 1) * SEQ // 2)

    def step():
        loss = loss_fn(model(tokens[rows, cols]), targets[rows, cols])
        loss.backward()
        return loss.item()
    return train(model, step)


def pp_dp_layout(dev, world, tokens, targets, schedule_class, reduce_dp=True):
    mesh = init_device_mesh(dev.type, (world // 2, 2), mesh_dim_names=("dp", "pp"))
    pp, d, n = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), world // 2
    torch.manual_seed(0)
    model = pipeline_stage(GPT().to(dev), pp, 2)
    if reduce_dp:
        shard(model, mesh["dp"])
    stage = PipelineStage(model, pp, 2, dev, group=mesh["pp"].get_group())
    schedule = schedule_class(stage, n_microbatches=4, loss_fn=loss_fn)
    mine = slice(d * BATCH // n, (d + 1) * BATCH // n)

    def step():
        if pp == 0:
            schedule.step(tokens[mine])
            return None
        losses = []
        schedule.step(target=targets[mine], losses=losses)
        return torch.stack(losses).mean().item()
    return train(model, step, keep_grads=not reduce_dp)


# %% [markdown]
# One launch runs them all (a launch costs seconds of start-up, so it is
# paid once), with one process's training computed on rank 0 as the
# reference. Losses are averaged over the ranks that computed one.

# %%
LAYOUTS = {"FSDP2 (dp 4)": (fsdp_layout,),
           "FSDP2 x TP (dp 2, tp 2)": (fsdp_tp_layout,),
           "FSDP2 x CP (dp 2, cp 2)": (fsdp_cp_layout,),
           "PP x DP, GPipe (pp 2, dp 2)": (pp_dp_layout, ScheduleGPipe),
           "PP x DP, 1F1B (pp 2, dp 2)": (pp_dp_layout, Schedule1F1B),
           "PP x DP, no DP reduction": (pp_dp_layout, Schedule1F1B, False)}


def all_layouts(rank, world):
    warnings.filterwarnings("ignore")
    dev = rank_device(rank)
    torch.manual_seed(1)
    tokens, targets = torch.randint(0, VOCAB, (2, BATCH, SEQ), device=dev)
    out = {}
    if rank == 0:
        torch.manual_seed(0)
        one = GPT().to(dev)

        def step():
            loss = loss_fn(one(tokens), targets)
            loss.backward()
            return loss.item()
        out["one process"] = train(one, step, keep_grads=True)
    for name, (fn, *args) in LAYOUTS.items():
        r = fn(dev, world, tokens, targets, *args)
        mine = torch.tensor([x if x is not None else 0.0 for x in r["losses"]],
                            dtype=torch.float64, device=dev)
        has = torch.tensor([float(r["losses"][0] is not None)], device=dev)
        dist.all_reduce(mine)  # after training: not counted
        dist.all_reduce(has)
        r["losses"] = (mine / has).tolist()
        out[name] = r
    return out


runs = launch(all_layouts, 4, timeout=240, echo=False)
results = {name: [r.value[name] for r in runs] for name in LAYOUTS}
reference_run = runs[0].value["one process"]

# %%
def table(results, reference_run):
    ref = reference_run["losses"]
    print(f"{'layout':29s} {'loss diff':>9s} {'state KiB':>10s} {'saved KiB':>10s}"
          "  collectives in one step (rank 0)")
    print(f"{'one process':29s} {0:9.1e} {reference_run['state'] / 1024:10.0f} "
          f"{reference_run['saved'] / 1024:10.0f}")
    for name, ranks in results.items():
        diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref, strict=True))
        state = "/".join(f"{r['state'] / 1024:.0f}" for r in ranks)
        saved = max(r["saved"] for r in ranks)
        counts = ", ".join(f"{v} {k}" for k, v in sorted(ranks[0]["counts"].items()))
        print(f"{name:29s} {diff:9.1e} {state:>10s} {saved / 1024:10.0f}  {counts}")


table(results, reference_run)

# %% [markdown]
# How to read it, column by column:
#
# - **loss diff**: the largest difference over the five steps from one
#   process. Every correct layout is at float32 rounding (Adam turns
#   last-bit gradient differences into slightly different weights, so
#   later steps differ a little more than step 1). The buggy layout is far
#   off from step 2 on: its step 1 loss is right - the forward saw the
#   right weights - but each replica then stepped on its own half-batch
#   gradient.
# - **state KiB**, one number per rank: parameters, gradients and Adam
#   state held by that rank. FSDP2 divides them by 4; FSDP2 x TP holds a
#   little more than a quarter (what TP does not split - norms, biases of
#   the row-parallel layers, the embedding and output layer - is sharded
#   over `dp` only and repeated on both `tp` ranks); FSDP2 x CP shards over
#   all 4 ranks, like FSDP2 alone; a pipeline stage holds
#   its half of the model, halved again by FSDP over `dp`. The two stages
#   differ a little: the embedding lives on one, the output layer on the
#   other.
# - **saved KiB**: the largest peak of activations kept for backward on any
#   rank. Data parallelism divides the batch; context parallelism divides
#   the sequence, so each rank keeps as many tokens as under FSDP2 (dp 4),
#   plus the gathered keys and values of whole sequences; tensor
#   parallelism divides what attention and the MLP keep; a pipeline keeps several
#   micro-batches in flight: GPipe all 4, 1F1B at most 2 on a 2-stage
#   pipeline.
# - **collectives**: FSDP2 all-gathers each block's weights before its
#   forward and again before its backward, and reduce-scatters each
#   gradient. TP adds its all-reduces inside every block. CP adds two
#   all-gathers per block (keys and values) and, in the backward, the
#   all-reduces that stand in for their reduce-scatters. A pipeline stage
#   sends an activation and receives a gradient per micro-batch (or the
#   reverse on the last stage); its FSDP2 groups (one block and the root)
#   reduce-scatter once per step, after the last micro-batch, not once per
#   micro-batch. The buggy layout runs no collective besides the
#   pipeline's: that is the bug.
#
# ### The seeded bug
#
# Which mesh dimension lacks its reduction? Compare a parameter's gradient
# across the ranks that should hold the same one. After a correct step,
# replicas along `dp` hold identical gradients; without the reduction they
# differ, and their *mean* is the right gradient. The buggy layout kept its
# step 1 gradients: the last block's MLP weight on the two replicas of
# stage 1 (ranks 1 and 3), against one process:

# %%
name = "layers.1.mlp.2.weight"
want = reference_run["grads"][name]
bug = results["PP x DP, no DP reduction"]
g0, g1 = bug[1]["grads"][name], bug[3]["grads"][name]
mean = (g0 + g1) / 2
print(f"{name}: replica 0 vs one process {(g0 - want).abs().max():.2e}, replica 1 "
      f"{(g1 - want).abs().max():.2e}, their mean {(mean - want).abs().max():.2e}")

# %% [markdown]
# Each replica's gradient is off; their mean is one process's. That is the
# signature of a missing reduction on `dp`. In Exercise 13.3 you write the
# tool that finds the dimension on any mesh.
#
# ## 2. How a layout is chosen
#
# A large run's layout is chosen in an order (the Ultra-Scale Playbook's
# configuration guide gives the same order):
#
# 1. **Fit the model.** Parameters, gradients and optimizer state take about
#    16 bytes per parameter in mixed precision: shard them (FSDP / ZeRO,
#    Chapter 9), split the layers (tensor parallelism, Chapter 10), or cut
#    the model into stages (pipelines, Chapter 7). Activations grow with
#    the tokens in flight: recompute them (Chapter 8), or split the sequence
#    (sequence and context parallelism, Chapters 10-11).
# 2. **Fit the batch.** The global batch is fixed by the optimisation
#    (millions of tokens); the data-parallel replicas split it, micro-batches
#    and gradient accumulation make up the rest. A pipeline needs many
#    micro-batches per replica to keep its bubble small.
# 3. **Then throughput.** Among the layouts that fit, pick the one whose
#    communication costs least for its links.
#
# What each dimension costs, and where it goes in the hardware:
#
# | dimension | divides | communicates | per step | placed |
# | --- | --- | --- | --- | --- |
# | FSDP / ZeRO-3 | training state | all-gather weights, reduce-scatter gradients | 3 x the weights' bytes per rank, per micro-batch under gradient accumulation (FSDP2 gathers again for each) | anywhere; across nodes |
# | HSDP | training state, inside a group | FSDP inside, all-reduce of the shards across groups | FSDP's inside a node, a shard's all-reduce across | shard inside a node, replicate across |
# | DDP | the batch | all-reduce of gradients | 2 x the gradients' bytes | across nodes |
# | tensor parallel | weights and activations of each layer | all-reduce (or RS + AG) of activations | 4 per layer per micro-batch with one fused QKV projection; 6 with separate q, k, v (the 12 in the table above: their 3 backward all-reduces) | inside a node (NVLink) |
# | pipeline | layers | one activation per micro-batch and stage boundary | small, point to point; the bubble idles the stages | across nodes |
# | context | the sequence | keys and values per layer: all-gather, ring or all-to-all (Chapter 11) | grows with the tokens per rank | inside a node, or a few |
# | expert | the experts | two all-to-alls per mixture-of-experts layer each way | tokens x experts per token x width | inside a node, or a few |
#
# A pipeline's schedule sets its bubble, in slots of one micro-batch's
# forward and backward on one stage: 1F1B idles `pp - 1` of them (GPipe
# too, with more memory); the interleaved schedule gives each GPU `v`
# smaller stages and idles `(pp - 1) / v`, for more sends and activations
# in flight; zero-bubble schedules split each backward in two and fill most
# of the rest (a third of 1F1B's in their ZB-H1 form). PyTorch ships all of
# them (`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`,
# `ScheduleZBVZeroBubble`). Stages need not be equal: Llama 3 405B put its
# 126 layers on 16 stages with one layer fewer on the first and the last,
# which also hold the embedding and the output layer.
#
# Published layouts of three large runs:

# %%
for key in ("llama3_2024.layout_16384_gpus", "deepseek_v3_2024.layout_2048_gpus",
            "megatron_2021.layout_1t_3072_gpus"):
    f = reference.published(key)
    print(", ".join(f"{k} {v}" for k, v in f.value.items())
          + f"\n    {f.measures}\n    [source: {f.source}]")

# %% [markdown]
# All three keep tensor parallelism at most 8, the GPUs of one NVLink node,
# and use pipelines across nodes; DeepSeek-V3, a mixture of experts, uses
# no tensor parallelism at all and spreads its experts over 8 nodes
# instead. Data parallelism takes what is left.
#
# ## 3. A planner
#
# `course_utils.planner` applies that order with the course's one step
# model. For a model (dense or mixture of experts), a sequence length, a
# global batch, a GPU and a GPU count, it lists every layout `dp x cp x tp x
# pp` (with `ep` inside `dp x cp`) the cluster allows - tp inside a node and
# dividing the heads and key-value heads, pp up to half the layers with
# uneven stages, cp splitting the sequence - tries each in every schedule
# and recomputation, and keeps the fastest that fits. It predicts:
#
# - **memory per GPU** (`planner.memory_per_gpu`): the training state
#   divided by the layout, FSDP's gathered layers (a pipelined stage keeps
#   its whole weights gathered and its gradients unsharded across
#   micro-batches), the activations of the micro-batches in flight, and the
#   loss's logits in fp32;
# - **step time** (`planner.step_parts`): matmuls at the rate one large
#   matmul reaches, attention at a fused kernel's, Adam and the elementwise
#   work at the achieved memory bandwidth, the schedule's bubble, and every
#   collective over NVLink inside a node and every network port of a node
#   across nodes. One factor, the elementwise traffic per token, is fitted
#   on published runs; the next cell checks the model on runs it never saw.
#
# Drag the sliders. Layouts closer to the best than the calibration's spread
# are marked `~`: the planner cannot tell them apart. `tight` marks a layout
# that would not fit if the memory model were as short as its worst
# published check.

# %%
def show_plan(model="Llama 3 70B", gpu="h100_sxm", n_gpus=256, seq=8192,
              global_batch=512, rows=6):
    lm = planner.MODELS[model]
    plan = planner.plan(lm, gpu, n_gpus, seq, global_batch)
    close = planner.within_error(plan)
    print(f"{lm.name}: {lm.params() / 1e9:.1f}B parameters, {n_gpus} x {gpu}, "
          f"{global_batch} x {seq} tokens per step; {len(plan)} layouts")
    for row in plan[:rows]:
        mark = "~" if row in close else " "
        print(f"{mark} {'fits ' if row.fits else 'NO FIT'}{' tight' if row.tight else ''}"
              f" {str(row.layout):58s} {row.memory['total'] / 2**30:6.1f} GiB "
              f"{row.step.value:7.2f} s {row.tokens_per_s / 1e3:8.1f} k tokens/s")
    planner.draw_plan(plan[:rows], gpu)
    if plan and plan[0].step.caveat:
        print(plan[0].step.caveat)


widgets.interact(show_plan, model=list(planner.MODELS), gpu=list(planner.GPUS),
                 n_gpus=widgets.SelectionSlider(options=[8, 16, 32, 64, 128, 256,
                                                         512, 1024], value=256),
                 seq=widgets.SelectionSlider(options=[2048, 4096, 8192, 32768,
                                                      131072], value=8192),
                 global_batch=widgets.SelectionSlider(
                     options=[16, 64, 128, 256, 512, 1024, 2048], value=512,
                     description="batch"),
                 rows=widgets.IntSlider(value=6, min=1, max=12));

# %% [markdown]
# **Against published runs.** Every run below is a published layout with
# its measured throughput; the planner predicts it from the layout alone
# (`[fit]`: one of the runs the traffic factor was fitted on; `[check]`:
# held back from the fit). Each layout is one the planner enumerates.

# %%
pairs = {p.measured.split(": ")[0]: p for p in planner.run_pairs() if p.unit != "GiB"}
listed = 0
for run in planner.runs():
    if run.key not in pairs:
        continue
    found = any((x.dp, x.tp, x.pp, x.cp) == (run.layout.dp, run.layout.tp,
                                            run.layout.pp, run.layout.cp)
                for x in planner.layouts(run.model, run.layout.gpus,
                                         run.global_batch, seq=run.seq))
    listed += found
    if "llama3_405b" in run.key or "462b" in run.key or "1008p0b" in run.key:
        p = pairs[run.key]
        print(f"{run.role:5s} {run.model.name:12s} {run.layout.gpus:5d} GPUs "
              f"{run.layout}: predicted {p.predicted:.4g}, published "
              f"{p.published:.4g} {p.unit}, ratio {p.ratio:.2f}")
held = [p.ratio for p in pairs.values() if p.setup.startswith("[check]")]
print(f"{listed} of {len(pairs)} published layouts enumerated by the planner; "
      f"held-back ratios {min(held):.2f}-{max(held):.2f}")
planner.draw_runs()

# %% [markdown]
# Read the ratios, not only their band. Whole steps of 2021-2024 runs on
# A100s and H100s land within the band, held-back runs as well as fitted
# ones, because the model has what moves them: a large run's whole step
# reaches 38-56 % of the peak, not a matmul's 80 %, once its attention,
# elementwise work, optimizer and collectives are counted, and a pipeline
# loses its bubble. What it assumed where a source is silent is printed
# beside each run (`python -m course_utils.predict --calibration` lists
# every pair): Llama 3's micro-batch size and virtual stages, for
# instance, are not in its paper. Mixture-of-experts runs (DeepSeek-V3,
# Mixtral) are listed but not predicted: their sources do not give a step
# the planner could be compared with, so expert parallelism's terms are
# uncalibrated.
#
# Memory is checked on torchtitan's published peaks, and there the planner
# is weaker:

# %%
for p in planner.run_pairs():
    if p.unit == "GiB":
        print(f"{p.setup[:70]}: predicted {p.predicted:.1f}, published "
              f"{p.published:.1f} GiB, ratio {p.ratio:.2f}")
for s in planner.out_of_scope():
    if s.unit == "GiB":
        print(f"{s.setup}: {s.reason}")
short = planner.memory_shortfall()
print(f"worst shortfall: the planner counts {short:.0%} of what a published run "
      f"held, which held {1 / short - 1:.0%} more (planner.memory_shortfall())")
lay = planner.Layout(dp=64, tp=8, pp=16, schedule="interleaved", virtual=2)
mem = planner.memory_per_gpu(planner.LLAMA3_405B, lay, 8192, 2048)["total"] / 2**30
h100 = reference.published("h100_sxm.memory_gb").value
print(f"Llama 3 405B, {lay}, no activation checkpointing: {mem:.0f} GiB per GPU "
      f"predicted; it trained on {h100} GB H100s, so here the planner counts "
      + ("too much" if mem > h100 else "no more than fits"))

# %% [markdown]
# The memory model errs both ways. torchtitan's FSDP runs come out within
# 13 % above their published peaks; its tensor-parallel and pipelined runs
# held about half as much again as the planner counts (the worst shortfall
# above), and the planner cannot say
# exactly where it went. Llama 3 405B goes the other way: its paper
# trained 8K sequences without activation checkpointing on 80 GB GPUs
# (section 3.3.2), while the planner, counting an interleaved schedule's
# micro-batches in flight as Megatron-LM keeps them, finds far more; Meta
# changed its schedule to keep fewer and to free each stage's inputs and
# outputs early. Plan with the margin Exercise 13.2 uses, and treat a
# `tight` layout as one to try, not one that fits.
#
# **Against the fake-tensor run.** Chapter 9 predicted a Llama-2-7B-shaped
# model's memory under FSDP2 by running the real FSDP2 code on fake
# tensors (`memory.LLAMA2_7B_FSDP2`, fp32 and Adam, 2048 tokens per rank).
# The planner's arithmetic for the same model, layout and precision,
# category by category, and the 2-layer point recomputed here:

# %%
fake = memory.LLAMA2_7B_FSDP2
for n in (8, 64):
    ours = planner.memory_per_gpu(planner.LLAMA2_7B, planner.Layout(dp=n), 2048, n,
                                  precision="fp32 + Adam")
    print(f"{n} GPUs: parameters {ours['parameters'] / 1e9:.2f} vs fake "
          f"{fake[n]['parameters'] / 1e9:.2f} GB; activations "
          f"{ours['activations'] / 1e9:.2f} vs {fake[n]['activations'] / 1e9:.2f}; "
          f"gathered layers {ours['gathered layers'] / 1e9:.2f} vs "
          f"{fake[n]['gathered parameters'] / 1e9:.2f}")
live = memory.fsdp2_peak_on_fake_ranks([8], layers=2, in_process=True)[8]["peak"]
print("2 layers on 8 fake ranks, recomputed now: "
      + ("the same bytes as stored" if live == memory.LLAMA2_2_LAYERS_FSDP2[8]
         else f"different: {live}"))

# %% [markdown]
# Parameters agree exactly and activations closely: that checks the
# per-layer activation count the planner uses. The fake run counts the
# logits with the activations and holds a little more for gathered
# parameters, plus all-gather, reduce-scatter and temporary buffers.
#
# **On GPUs.** With four GPUs or more the launches above run over `nccl`,
# one GPU per rank, with CPU tensors crossing the same groups over `gloo`
# (with fewer, the 4 ranks run on the CPU over `gloo`), and print the same
# collective counts and training-state bytes: the layout decides them, not
# the device. The saved activations can differ a little: CUDA's attention
# kernels keep other tensors for the backward than the CPU's.

# %% [markdown]
# ## Summary
#
# - One device mesh, one dimension per parallelism: FSDP2, tensor,
#   context and pipeline parallelism compose, and each layout trains
#   exactly as one process does.
# - Each dimension divides something (state, activations, sequence, layers,
#   experts, the batch) and pays in collectives; counting both per rank is
#   how layouts are compared.
# - A missing reduction shows as replicas that disagree along one mesh
#   dimension, whose mean is the right gradient.
# - Choose a layout in order: fit the model, fit the batch, then speed;
#   tensor parallelism inside a node, pipelines and data parallelism across;
#   the schedule sets the pipeline's bubble, and stages need not be equal.
# - The planner's step model predicts published runs within 20 % where
#   their layouts are known: a whole step reaches 38-56 % of the peak, not a
#   matmul's 80 %. Its memory model falls short on tensor-parallel and
#   pipelined runs, so plan with that margin.

# %% [markdown]
# ## Exercises
#
# ### Exercise 13.1: pipeline x tensor parallel
#
# The one pair of section 1 not shown: pipeline stages, each tensor
# parallel. Write `pp_tp_stage(model, tp)`, run on every rank of a group of
# `world_size` ranks with the same `model` (a `GPT` built alike). It builds
# a mesh of `world_size // tp` pipeline stages by `tp` tensor-parallel
# ranks, with each stage's TP ranks **adjacent** (ranks `0..tp-1` form
# stage 0: a node's GPUs), keeps this rank's stage of the model
# (`pipeline_stage`), makes its blocks tensor parallel, and returns a
# `PipelineStage` on the pipeline group. The checker runs GPipe on 4 ranks
# (`tp` 2 and 1) and on 2 (`tp` 2), at depths the stages do not divide, and
# compares the loss and every gradient with one process.

# %% tags=["exercise"] exercise="13.1"
def pp_tp_stage(model, tp):
    ### BEGIN SOLUTION
    world = dist.get_world_size()
    dev = next(model.parameters()).device
    mesh = init_device_mesh(dev.type, (world // tp, tp), mesh_dim_names=("pp", "tp"))
    index, n_stages = mesh["pp"].get_local_rank(), world // tp
    stage = tensor_parallel(pipeline_stage(model, index, n_stages), mesh["tp"])
    return PipelineStage(stage, index, n_stages, dev, group=mesh["pp"].get_group())
    ### END SOLUTION


# %% tags=["check"] exercise="13.1"
check_pp_tp_stage(pp_tp_stage)

# %% [markdown]
# ### Exercise 13.2: choose a layout, with the model's error
#
# Write `choose_layout(model, gpu, n_gpus, seq, global_batch,
# min_tokens_per_s)`. Search every FSDP layout `planner.Layout(dp, tp, pp,
# cp=..., ep=..., recompute=..., schedule=..., virtual=...)` the cluster
# allows:
#
# - `dp * cp * tp * pp == n_gpus`; tp at most 8, dividing `model.heads` and
#   `model.kv_heads`; cp 1 or dividing `seq // 2`; pp from 1 to
#   `model.layers // 2` (stages need not be equal); dp dividing
#   `global_batch`;
# - ep 1, or for a mixture of experts (`model.experts > 0`) any divisor of
#   `model.experts` that also divides `dp * cp`;
# - recompute `"none"`, `"selective"` or `"full"`; schedule `"1f1b"`, and
#   with pp > 1 also `"zero-bubble"`, or `"interleaved"` with `virtual` 2 or
#   4 (at most `model.layers // pp`).
#
# Keep the layouts whose `planner.memory_per_gpu(...)["total"]` stays under
# the GPU's memory (`memory_gb`, binary: x `2**30` bytes) times
# `planner.memory_shortfall()`, the worst the memory model fell short of a
# published run, and whose tokens per second (`global_batch * seq` over the
# step time, the sum of `planner.step_parts(...)`) reach
# `min_tokens_per_s`. Return the fastest; `None` if none qualifies.
# `planner.plan` ranks layouts too, but without that margin.

# %% tags=["exercise"] exercise="13.2"
def choose_layout(model, gpu, n_gpus, seq, global_batch, min_tokens_per_s):
    ### BEGIN SOLUTION
    usable = (reference.published(f"{gpu}.memory_gb").value * 2**30
              * planner.memory_shortfall())
    best, best_t = None, None
    for tp in (t for t in range(1, 9) if model.heads % t == 0
               and model.kv_heads % t == 0):
        for cp in range(1, n_gpus // tp + 1):
            if cp > 1 and (seq // 2) % cp:
                continue
            for pp in range(1, model.layers // 2 + 1):
                if n_gpus % (tp * cp * pp) or global_batch % (n_gpus // (tp * cp * pp)):
                    continue
                dp = n_gpus // (tp * cp * pp)
                eps = [e for e in range(1, dp * cp + 1) if model.experts
                       and model.experts % e == 0 and dp * cp % e == 0] or [1]
                schedules = [("1f1b", 1)] + ([("zero-bubble", 1)] + [
                    ("interleaved", v) for v in (2, 4) if v <= model.layers // pp]
                    if pp > 1 else [])
                for ep in eps:
                    for schedule, virtual in schedules:
                        for recompute in ("none", "selective", "full"):
                            lay = planner.Layout(dp, tp, pp, cp=cp, ep=ep,
                                                 recompute=recompute,
                                                 schedule=schedule, virtual=virtual)
                            mem = planner.memory_per_gpu(model, lay, seq, global_batch)
                            if mem["total"] > usable:
                                continue
                            t = sum(planner.step_parts(model, lay, gpu, seq,
                                                       global_batch).values())
                            if global_batch * seq / t >= min_tokens_per_s and (
                                    best_t is None or t < best_t):
                                best, best_t = lay, t
    return best
    ### END SOLUTION


# %% tags=["check"] exercise="13.2"
check_choose_layout(choose_layout)

# %% [markdown]
# ### Exercise 13.3: which dimension lost its reduction?
#
# Write `missing_reductions(grads, dim_names)`. `grads` maps each rank's
# mesh coordinate (a tuple, one entry per mesh dimension) to its gradient
# of one parameter that every rank should hold identically after a correct
# step (a replicated norm weight, say). Return the set of names of the mesh
# dimensions along which ranks disagree - the reductions missing - or an
# empty set. Gradients are float32 or float64, of any magnitude, and
# carry the rounding of different summation orders: tell a real
# disagreement from rounding.

# %% tags=["exercise"] exercise="13.3"
def missing_reductions(grads, dim_names):
    ### BEGIN SOLUTION
    missing = set()
    for dim, name in enumerate(dim_names):
        for coord, g in grads.items():
            twin = coord[:dim] + (0,) + coord[dim + 1:]
            other = grads[twin]
            tol = 1e-5 if g.dtype == torch.float32 else 1e-12
            scale = max(g.abs().max().item(), other.abs().max().item(), 1e-30)
            if (g - other).abs().max().item() > tol * scale:
                missing.add(name)
    return missing
    ### END SOLUTION


# %% tags=["check"] exercise="13.3"
check_missing_reductions(missing_reductions)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | device mesh | 设备网格 |
# | layout (parallel configuration) | 并行布局（并行配置） |
# | 3-D parallelism | 三维并行 |
# | pipeline stage | 流水线阶段 |
# | micro-batch | 微批次 |
# | fully sharded data parallel (FSDP) | 全分片数据并行 |
# | tensor parallelism | 张量并行 |
# | gradient reduction | 梯度规约 |
# | activation recomputation | 激活重计算 |
# | step time / throughput | 单步时间 / 吞吐量 |
# | memory per GPU | 每 GPU 显存 |
# | planner | 规划器 |
