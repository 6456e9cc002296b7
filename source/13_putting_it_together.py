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
#   small GPT trained with FSDP2, with FSDP2 x tensor parallelism, and with
#   pipeline x data parallelism (GPipe and 1F1B), each equal to one process.
# - What each layout costs, measured side by side: bytes per rank and the
#   collectives of one step, counted.
# - What a missing gradient reduction looks like, and how to find the mesh
#   dimension it is missing on.
# - How a real run's layout is chosen: fit the model, then the batch, then
#   throughput; tensor parallelism inside a node; with published layouts of
#   Llama 3, DeepSeek-V3 and Megatron-LM.
# - A planner that predicts memory per GPU and step time for every layout of
#   a real model on a real cluster, cross-checked against a fake-tensor run.
#
# **Hardware.** Four ranks, each a real process, joined by `gloo` on the CPU
# (or `nccl` with one GPU per rank when there are four or more): every loss,
# byte and collective below is measured. The planner's numbers for large
# GPUs are labelled predictions from the course's calibrated models.

# %%
import warnings

import ipywidgets as widgets
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from course_utils import banner, memory, planner, reference
from course_utils.checks.ch13 import (
    check_choose_layout,
    check_missing_reductions,
    check_pp_tp_stage,
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
# The three kinds of wiring, each a few lines on top of a device mesh:
#
# - **tensor parallel**: Chapter 10's plan, column-parallel then row-parallel
#   in attention and in the MLP;
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
    names = list(model.layers)
    per = len(names) // n_stages
    for name in names[:index * per] + names[(index + 1) * per:]:
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


# %% [markdown]
# Two counters. `Collectives` is a dispatch mode that sees every operator
# and counts those of the distributed libraries (`c10d`, and the functional
# collectives DTensor uses), point-to-point sends and receives included.
# `SavedActivations` tracks what autograd keeps for the backward pass with a
# saved-tensors hook (Chapter 8): each kept storage counts once while it
# lives, and the peak is recorded. Unlike `MemTracker`, it also works when a
# pipeline runs a stage's forward several times per step (one per
# micro-batch), which `MemTracker` refuses.

# %%
class Collectives(TorchDispatchMode):
    NAMES = {"allreduce": "all-reduce", "all_reduce": "all-reduce",
             "allgather_base": "all-gather", "all_gather_into_tensor": "all-gather",
             "reduce_scatter_base": "reduce-scatter",
             "reduce_scatter_tensor": "reduce-scatter", "send": "send", "recv": "recv"}

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = self.NAMES.get(func.__name__.split(".")[0].strip("_"))
            if name:
                self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class SavedActivations:
    def __init__(self, model):
        self.model, self.alive, self.live, self.peak = model, {}, 0, 0

    def pack(self, t):
        storage = local(t).untyped_storage()
        key = storage.data_ptr()
        weights = {local(p).untyped_storage().data_ptr()  # FSDP2: the gathered ones
                   for p in self.model.parameters()}
        if key in weights or not storage.nbytes():
            return t
        return Kept(self, key, storage.nbytes(), t)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(
            self.pack, lambda k: k.t if isinstance(k, Kept) else k)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class Kept:
    """One saved tensor; the last one of a storage to go frees its bytes."""

    def __init__(self, owner, key, nbytes, t):
        self.owner, self.key, self.nbytes, self.t = owner, key, nbytes, t
        if owner.alive.get(key, 0) == 0:
            owner.live += nbytes
            owner.peak = max(owner.peak, owner.live)
        owner.alive[key] = owner.alive.get(key, 0) + 1

    def __del__(self):
        o = self.owner
        o.alive[self.key] -= 1
        if o.alive[self.key] == 0:
            o.live -= self.nbytes


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
# per step; a data-parallel group of `d` replicas gives each its `8 / d`.
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
#   over `dp` only and repeated on both `tp` ranks); a pipeline stage holds
#   its half of the model, halved again by FSDP over `dp`. The two stages
#   differ a little: the embedding lives on one, the output layer on the
#   other.
# - **saved KiB**: the largest peak of activations kept for backward on any
#   rank. Data parallelism divides the batch; tensor parallelism divides
#   what attention and the MLP keep; a pipeline keeps several
#   micro-batches in flight: GPipe all 4, 1F1B at most 2 on a 2-stage
#   pipeline.
# - **collectives**: FSDP2 all-gathers each block's weights before its
#   forward and again before its backward, and reduce-scatters each
#   gradient. TP adds its all-reduces inside every block. A pipeline stage
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
# | FSDP / ZeRO-3 | training state | all-gather weights, reduce-scatter gradients | 3 x the weights' bytes per rank | anywhere; across nodes |
# | DDP | the batch | all-reduce of gradients | 2 x the gradients' bytes | across nodes |
# | tensor parallel | weights and activations of each layer | all-reduce (or RS + AG) of activations | 4 per layer per micro-batch, on the critical path | inside a node (NVLink) |
# | pipeline | layers | one activation per micro-batch and stage boundary | small, point to point | across nodes |
# | context / expert | sequence / experts | ring K/V exchange / all-to-all | per layer | inside a node, or a few |
#
# Published layouts of three large runs:

# %%
for key in ("llama3_2024.layout_16384_gpus", "deepseek_v3_2024.layout_2048_gpus",
            "megatron_2021.layout_1t_3072_gpus"):
    f = reference.published(key)
    print(f"{f.value}\n    {f.measures}\n    [{f.label}]")

# %% [markdown]
# All three keep tensor parallelism at most 8, the GPUs of one NVLink node,
# and use pipelines across nodes; DeepSeek-V3, a mixture of experts, uses
# no tensor parallelism at all and spreads its experts over 8 nodes
# instead. Data parallelism takes what is left.
#
# ## 3. A planner
#
# `course_utils.planner` applies that order. For a model, a sequence length,
# a global batch, a GPU and a GPU count, it lists every layout `dp x tp x pp`
# the cluster allows (tp inside an 8-GPU node and dividing the heads, pp
# dividing the layers, dp dividing the batch) and predicts for each:
#
# - **memory per GPU** (`planner.memory_per_gpu`): the training state
#   divided by the layout, FSDP's two gathered layers, and the activations
#   of the micro-batches in flight (1F1B), with activation recomputation
#   switched on when a layout does not fit without it;
# - **step time** (`planner.step_seconds`): compute at the achieved FLOP/s
#   of the course's calibration with the pipeline's bubble, plus the
#   tensor-parallel, data-parallel and pipeline traffic at the links'
#   rates, nothing overlapped.
#
# Drag the sliders; layouts that do not fit are flagged.

# %%
def show_plan(model="Llama 3 8B", gpu="h100_sxm", n_gpus=64, seq=8192,
              global_batch=512, rows=8):
    lm = planner.MODELS[model]
    plan = planner.plan(lm, gpu, n_gpus, seq, global_batch)
    print(f"{lm.name}: {lm.params() / 1e9:.1f} B parameters, {n_gpus} x {gpu}, "
          f"{global_batch} x {seq} tokens per step; {len(plan)} layouts")
    for row in plan[:rows]:
        print(f"  {'fits ' if row.fits else 'NO FIT'} {str(row.layout):38s} "
              f"{row.memory['total'] / 1e9:7.1f} GB/GPU {row.step.value:8.2f} s/step "
              f"{row.tokens_per_s / 1e3:9.1f} k tokens/s")
    if plan:
        print(f"[best: {plan[0].step.label}]")


widgets.interact(show_plan, model=list(planner.MODELS), gpu=list(planner.GPUS),
                 n_gpus=widgets.SelectionSlider(options=[8, 16, 32, 64, 128, 256,
                                                         512, 1024], value=64),
                 seq=widgets.SelectionSlider(options=[2048, 4096, 8192, 16384], value=8192),
                 global_batch=widgets.SelectionSlider(
                     options=[64, 128, 256, 512, 1024, 2048], value=512),
                 rows=widgets.IntSlider(value=8, min=1, max=20));

# %% [markdown]
# **Against a published run.** Llama 3 405B's layout on 16,384 H100s,
# predicted, beside what the paper measured per GPU:

# %%
lay = planner.Layout(dp=128, tp=8, pp=16)
t = planner.step_seconds(planner.LLAMA3_405B, lay, "h100_sxm", 8192, 2048)
flops = 2048 * 8192 * 6 * planner.LLAMA3_405B.params()
print(f"{lay}: {flops / t.value / lay.gpus / 1e12:.0f} TFLOP/s per GPU [{t.label}]")
paper = reference.published("llama3_2024.tflops_per_gpu_16384_gpus")
print(f"{paper.value} {paper.unit} per GPU [{paper.label}]")
print(f"predicted / published: {flops / t.value / lay.gpus / 1e12 / paper.value:.2f}")
mem = planner.memory_per_gpu(planner.LLAMA3_405B, lay, 8192, 2048)
print(f"predicted memory without recomputation: {mem['total'] / 1e9:.0f} GB per GPU")

# %% [markdown]
# Look at the ratio. The time model is built from datasheets and one
# calibration, not from this run; it should land within tens of percent
# of the measured rate, and below it, since it overlaps no communication
# while real runs hide much of theirs.
#
# The memory model says this layout needs more than an 80 GB GPU if every
# activation is kept in bf16; the paper's table does not list its
# memory-saving settings, so read the memory as what the layout would need
# without them.
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
          f"{(ours['activations'] + ours['logits']) / 1e9:.2f} vs "
          f"{fake[n]['activations'] / 1e9:.2f}; gathered layers "
          f"{ours['gathered layers'] / 1e9:.2f} vs "
          f"{fake[n]['gathered parameters'] / 1e9:.2f}"
          f"; optimizer state {ours['optimizer state'] / 1e9:.2f} vs "
          f"{fake[n].get('optimizer state', 0) / 1e9:.2f}")
live = memory.fsdp2_peak_on_fake_ranks([8], layers=2, in_process=True)[8]["peak"]
print("2 layers on 8 fake ranks, recomputed now: "
      + ("the same bytes as stored" if live == memory.LLAMA2_2_LAYERS_FSDP2[8]
         else f"different: {live}"))

# %% [markdown]
# Parameters agree exactly and activations within a few percent; that
# checks the per-layer activation count the planner uses. Two differences
# are the fake run's, and they teach something: its one step starts from
# nothing, so at its peak (in the backward pass) Adam's state does not
# exist yet and most gradients are not made - a first step's peak, not a
# steady one. The planner counts the steady state, with the optimizer
# state alive. And the fake run holds a little more for gathered
# parameters, plus all-gather, reduce-scatter and temporary buffers that
# the planner leaves out - the reason it asks for 10 % headroom.
#
# **On GPUs.** With four GPUs or more the launches above run over `nccl`,
# one GPU per rank (with fewer, the 4 ranks run on the CPU over `gloo`), and
# print the same collective counts and training-state bytes: the layout
# decides them, not the device. The saved activations can differ a little:
# CUDA's attention kernels keep other tensors for the backward than the
# CPU's.

# %% [markdown]
# ## Summary
#
# - One device mesh, one dimension per parallelism: FSDP2, tensor
#   parallelism and pipeline stages compose, and each layout trains exactly
#   as one process does.
# - Each dimension divides something (state, activations, layers, the
#   batch) and pays in collectives; counting both per rank is how layouts
#   are compared.
# - A missing reduction shows as replicas that disagree along one mesh
#   dimension, whose mean is the right gradient.
# - Choose a layout in order: fit the model, fit the batch, then speed;
#   tensor parallelism inside a node, pipelines and data parallelism across.
# - A planner built from the course's calibrated models predicts memory and
#   step time for every layout; its memory is checked against a fake-tensor
#   run and its time against a published run.

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
# (`tp` 2 and 1) and on 2 (`tp` 2), at several depths, and compares the loss
# and every gradient with one process.

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
# ### Exercise 13.2: choose a layout
#
# Write `choose_layout(model, gpu, n_gpus, seq, global_batch,
# min_tokens_per_s)`. Search the layouts `planner.Layout(dp, tp, pp,
# sharded=..., recompute=...)` that are allowed - `dp * tp * pp == n_gpus`,
# tp at most 8 and dividing `model.heads`, pp dividing `model.layers`, dp
# dividing `global_batch` - with the data-parallel dimension sharded (FSDP)
# or replicated (DDP, which `planner.plan` never tries), with or without
# recomputation. Return the one with the shortest `planner.step_seconds`
# among those whose `planner.memory_per_gpu(...)["total"]` is at most 90 %
# of the GPU's memory (`reference.published(f"{gpu}.memory_gb")`, in GB)
# and that reach `min_tokens_per_s`; `None` if none does.

# %% tags=["exercise"] exercise="13.2"
def choose_layout(model, gpu, n_gpus, seq, global_batch, min_tokens_per_s):
    ### BEGIN SOLUTION
    capacity = 0.9 * reference.published(f"{gpu}.memory_gb").value * 1e9
    best, best_t = None, None
    for tp in (t for t in range(1, min(8, n_gpus) + 1)
               if n_gpus % t == 0 and model.heads % t == 0):
        for pp in (p for p in range(1, n_gpus // tp + 1)
                   if (n_gpus // tp) % p == 0 and model.layers % p == 0):
            dp = n_gpus // (tp * pp)
            if global_batch % dp:
                continue
            for sharded in (True, False):
                for recompute in (False, True):
                    lay = planner.Layout(dp, tp, pp, sharded=sharded,
                                         recompute=recompute)
                    mem = planner.memory_per_gpu(model, lay, seq, global_batch)
                    if mem["total"] > capacity:
                        continue
                    t = planner.step_seconds(model, lay, gpu, seq, global_batch).value
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
            tol = 1e-3 if g.dtype == torch.float32 else 1e-8
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
