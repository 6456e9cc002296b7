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
# # Chapter 9: Sharded data parallelism
#
# **What you will learn**
#
# - Where a training step's memory goes, in bytes per parameter, and why
#   DistributedDataParallel (Chapter 6) keeps all of it on every rank.
# - ZeRO stages 1, 2 and 3 built by hand from two collectives,
#   reduce-scatter and all-gather: equal to DDP to the last bit, with each
#   rank holding `1/N` of what is sharded, measured by a deterministic counter.
# - PyTorch's FSDP2 (`fully_shard`): parameters as DTensors, resharding after
#   forward, prefetching, mixed precision, hybrid sharding, CPU offload, and
#   the two mistakes its users make most.
# - Distributed checkpoints saved on 2 ranks and loaded on 4.
# - How much memory a 7B model needs per GPU, predicted by running the real
#   FSDP2 code on fake tensors, without allocating a byte.
#
# **Hardware.** The ranks are real processes joined by `gloo` - on GPUs, one
# rank per GPU over `nccl` - so every collective below really runs and every
# byte is counted, not estimated. Memory per rank comes from PyTorch's
# `MemTracker`, which counts tensor storages: the same number on every rank
# and every run, on a CPU or a GPU. Without GPUs, the GPU side is a published
# figure (the ZeRO paper) and a prediction (FSDP2 on a fake process group).

# %%
import math
import tempfile
import warnings

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn

from course_utils import banner, memory, plots, reference
from course_utils.checks.ch09 import (
    check_fsdp_collectives,
    check_reshard_checkpoint,
    check_sharded_linear,
)
from course_utils.devices import format_bytes
from course_utils.dist import launch

banner()
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# %% [markdown]
# ## 1. Memory arithmetic
#
# Training with Adam keeps four things per parameter besides the activations:
# the parameter, its gradient, and Adam's two running moments. In fp32 that
# is 4 + 4 + 8 = 16 bytes per parameter. Mixed precision (Chapter 8) keeps
# the parameters and gradients in bf16 (2 + 2 bytes) but needs an fp32 master
# copy for the update beside fp32 moments (4 + 4 + 4 = 12 bytes): 16 bytes
# again. The ZeRO paper calls the optimizer's share `K` (12 here) and the
# parameter count `Psi`. Activations come on top; they depend on the batch,
# not on how the model is sharded.
#
# DDP replicates all of it on each of `N` ranks. ZeRO removes the copies in
# three stages: stage 1 shards the optimizer state (each rank updates `1/N`
# of the parameters), stage 2 also the gradients, stage 3 also the
# parameters.

# %%
BYTES_PER_PARAM = {  # (parameters, gradients, optimizer state)
    "fp32 + Adam": (4, 4, 8),
    "bf16 + fp32 master + Adam": (2, 2, 12),
}


def model_state_bytes(params, world_size, stage, precision="bf16 + fp32 master + Adam"):
    """Bytes per rank for parameters, gradients, optimizer state (stage 0 = DDP)."""
    p, g, o = BYTES_PER_PARAM[precision]
    n = world_size
    return (params * p / (n if stage >= 3 else 1),
            params * g / (n if stage >= 2 else 1),
            params * o / (n if stage >= 1 else 1))


names = ["baseline_dp", "pos", "pos_g", "pos_g_p"]
print("7.5 B parameters, 64 ranks, mixed precision - per rank:")
for stage, name in enumerate(names):
    ours = sum(model_state_bytes(7.5e9, 64, stage)) / 1e9
    paper = reference.published(f"zero_paper.{name}_7p5b_64gpus_gb")
    print(f"  {'DDP' if stage == 0 else f'ZeRO-{stage}'}: {ours:6.1f} GB here, "
          f"{paper.value:6.1f} GB in the paper - "
          f"{'the same' if abs(ours - paper.value) < 0.05 else 'different'}")
print(f"[{paper.label}]")

# %% [markdown]
# The formula reproduces the paper's Figure 1. Drag the sliders: stage 3
# divides everything by `N`, stages 1 and 2 level off at the parameters (and
# gradients) every rank still holds whole.

# %%
def draw_memory(billions=7.0, world_size=8, precision="bf16 + fp32 master + Adam"):
    fig, ax = plt.subplots(figsize=(7, 3))
    labels = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    bottom = [0.0] * 4
    for i, (what, color) in enumerate((("parameters", "C0"), ("gradients", "C1"),
                                       ("optimizer state", "C2"))):
        part = [model_state_bytes(billions * 1e9, world_size, s, precision)[i] / 2**30
                for s in range(4)]
        ax.bar(labels, part, bottom=bottom, label=what, color=color)
        bottom = [b + v for b, v in zip(bottom, part, strict=True)]
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="GiB per rank", title=f"{billions:g} B parameters on {world_size} "
           f"ranks, {precision} (activations not included)")
    ax.legend(fontsize=7)
    plt.show()


widgets.interact(draw_memory,
                 billions=widgets.FloatLogSlider(value=7, base=10, min=-1, max=2.5,
                                                 description="B params"),
                 world_size=widgets.IntSlider(value=8, min=1, max=256,
                                              description="ranks N"),
                 precision=list(BYTES_PER_PARAM));

# %% [markdown]
# ## 2. ZeRO by hand
#
# Two collectives do all the work. **Reduce-scatter** sums a tensor over the
# ranks and leaves each rank one `1/N` slice of the sum; **all-gather** is the
# reverse, every rank contributing its slice and receiving the whole. An
# all-reduce is exactly a reduce-scatter followed by an all-gather, which is
# why ZeRO-1 and ZeRO-2 communicate no more than DDP.
#
# In torch 2.13 they are `dist.reduce_scatter_single(out, inp)` and
# `dist.all_gather_single(out, inp)` (the older names `reduce_scatter_tensor`
# and `all_gather_into_tensor` warn that they are deprecated). Both need the
# big tensor to be exactly `N` times the slice, so each parameter is
# flattened and zero-padded to a multiple of `N`; rank `r` owns slice `r`.

# %%
def padded_flat(t, world_size):
    """t as one flat vector, zero-padded to a multiple of world_size."""
    flat = t.detach().reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)])


def my_shard(t):
    """This rank's slice of t: ceil(numel / N) elements."""
    rank, n = dist.get_rank(), dist.get_world_size()
    return padded_flat(t, n).chunk(n)[rank].clone()


def gather_full(shard, shape):
    """All-gather every rank's slice; drop the padding; view as shape."""
    full = shard.new_empty(shard.numel() * dist.get_world_size())
    dist.all_gather_single(full, shard)
    return full[:math.prod(shape)].view(shape)


def reduce_scatter_mean(grad, out):
    """Write this rank's slice of the mean of grad over the ranks into out."""
    dist.reduce_scatter_single(out, padded_flat(grad, dist.get_world_size()))
    out /= dist.get_world_size()


def rank_device(rank):
    """This rank's GPU under nccl (one rank per GPU), else the CPU."""
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else \
        torch.device("cpu")


# %% [markdown]
# The trainer below is all three stages in one class. Every rank owns a
# shard of each parameter - the slice that its Adam updates - and a gradient
# buffer of the same size. In stages 1 and 2 the shard is a view into the
# (padded) parameter itself; in stage 3 it is the only copy. What changes
# with the stage is *when* the collectives run:
#
# - **ZeRO-1**: backward as usual (full gradients), then reduce-scatter each
#   gradient into the shard's buffer, Adam on the shard, all-gather the
#   updated shard into the full parameter.
# - **ZeRO-2**: the reduce-scatter runs inside backward, in a hook that fires
#   as soon as a parameter's gradient is complete, and the full gradient is
#   dropped at once: no rank ever holds all gradients.
# - **ZeRO-3**: the parameters themselves are freed (their storage resized to
#   zero bytes) and all-gathered just before each layer runs, in forward and
#   again in backward; the optimizer step needs no all-gather.
#
# Each collective is logged, so the schedule can be printed.

# %%
class Zero:
    """ZeRO stage 1, 2 or 3 by hand: Adam on this rank's shard of each parameter."""

    def __init__(self, model, stage, lr=1e-2):
        self.model, self.stage, self.log = model, stage, []
        self.params = list(model.parameters())
        self.index = {p: i for i, p in enumerate(self.params)}
        self.names = [n for n, _ in model.named_parameters()]
        self.shards = nn.ParameterList(self.own_slice(p) for p in self.params)
        for s in self.shards:
            s.grad = torch.zeros_like(s)  # reduce-scatter writes here
        self.opt = torch.optim.Adam(self.shards, lr=lr)
        if stage >= 2:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self.scatter_and_drop)
        if stage == 3:
            for m in model.modules():
                if list(m.parameters(recurse=False)):
                    m.register_forward_pre_hook(lambda m, args: self.gather(m))
                    m.register_forward_hook(lambda m, args, out: self.free(m))
                    m.register_full_backward_pre_hook(lambda m, g: self.gather(m))
            for p in self.params:
                p.untyped_storage().resize_(0)

    def own_slice(self, p):
        if self.stage == 3:  # a copy: the full parameter will be freed
            return nn.Parameter(my_shard(p))
        # stages 1, 2: p lives in a padded flat buffer; the shard is a view of
        # it, so Adam updates this rank's slice of p in place, with no copy
        n, flat = dist.get_world_size(), padded_flat(p, dist.get_world_size())
        p.data = flat[:p.numel()].view_as(p)
        return nn.Parameter(flat.chunk(n)[dist.get_rank()])

    def scatter(self, p):
        i = self.index[p]
        reduce_scatter_mean(p.grad, self.shards[i].grad)
        self.log.append(f"RS {self.names[i]}")

    def scatter_and_drop(self, p):  # ZeRO-2 and 3: inside backward
        self.scatter(p)
        p.grad = None
        if self.stage == 3:
            p.untyped_storage().resize_(0)  # its layer's backward is done

    def unshard(self, p):
        i = self.index[p]
        full = gather_full(self.shards[i].detach(), p.shape)
        self.log.append(f"AG {self.names[i]}")
        if p.untyped_storage().nbytes() == 0:
            p.untyped_storage().resize_(p.numel() * p.element_size())
        p.data.copy_(full)  # .data: autograd's version counter is left alone

    def gather(self, module):
        for p in module.parameters(recurse=False):
            self.unshard(p)

    def free(self, module):
        for p in module.parameters(recurse=False):
            p.untyped_storage().resize_(0)

    def step(self, x, y):
        self.log.clear()
        nn.functional.mse_loss(self.model(x), y).backward()
        if self.stage == 1:
            for p in self.params:
                self.scatter(p)
        self.opt.step()
        self.model.zero_grad()
        if self.stage < 3:
            self.log.append("-- step --")
            for p in self.params:
                self.unshard(p)


class AllReduceDDP:
    """Stage 0 for comparison: Chapter 6's gradient all-reduce, Adam on everything."""

    def __init__(self, model, lr=1e-2):
        self.model, self.log = model, []
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(self, x, y):
        self.log.clear()
        nn.functional.mse_loss(self.model(x), y).backward()
        for name, p in self.model.named_parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
            self.log.append(f"AR {name}")
        self.opt.step()
        self.opt.zero_grad()


# %% [markdown]
# Three steps of each, on 2 and then 3 ranks, with layers of width 37: every
# weight (1369 elements) and bias (37) is odd, so it needs padding for both
# world sizes. Each rank trains on its own data; DDP is the reference. At
# the end, each rank also tries one reduce-scatter without padding.

# %%
def make_model(width, depth, seed=0):
    torch.manual_seed(seed)  # the same initial weights on every rank
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def unpadded_attempt(world_size, dev):
    """Reduce-scatter 37 elements without padding: what does the backend say?"""
    try:
        dist.reduce_scatter_single(torch.empty(37 // world_size, device=dev),
                                   torch.ones(37, device=dev))
        return "accepted"
    except (RuntimeError, ValueError) as e:
        return str(e).splitlines()[0]


def train_rank(rank, world_size, width, depth, steps):
    warnings.simplefilter("ignore")  # a note on full backward hooks (ZeRO-3)
    dev = rank_device(rank)
    torch.manual_seed(100 + rank)  # different data on every rank
    x, y = torch.randn(8, width, device=dev), torch.randn(8, width, device=dev)
    results = {}
    for stage in range(4):
        model = make_model(width, depth).to(dev)
        trainer = AllReduceDDP(model) if stage == 0 else Zero(model, stage)
        for _ in range(steps):
            trainer.step(x, y)
        log = list(trainer.log)  # the last step's collectives
        if stage == 3:  # whole weights, to compare them
            for p in model.parameters():
                trainer.unshard(p)
        results[stage] = {
            "weights": [p.detach().cpu().clone() for p in model.parameters()],
            "log": log,
            "shard elements": [s.numel() for s in getattr(trainer, "shards", [])],
            "state elements": sum(v.numel() for st in trainer.opt.state.values()
                                  for v in st.values() if v.dim() > 0)}
    results["unpadded"] = unpadded_attempt(world_size, dev)
    return results


for world_size in (2, 3):
    ranks = launch(train_rank, world_size, args=(37, 2, 3), timeout=60)
    ddp = ranks[0].value[0]["weights"]
    for stage in (1, 2, 3):
        worst = max((a - b).abs().max().item() for r in ranks
                    for a, b in zip(r.value[stage]["weights"], ddp, strict=True))
        print(f"{world_size} ranks, ZeRO-{stage}: largest weight difference from DDP "
              f"after 3 Adam steps: {worst:.1e}"
              + (" (bitwise equal)" if worst == 0 else ""))

# %% [markdown]
# Bitwise equal, on 2 ranks and on 3: the same sums in the same order feed
# the same Adam arithmetic, only split across ranks. (Over `nccl` with 3 or
# more ranks, the all-reduce and the reduce-scatter may add the ranks'
# gradients in different orders - NCCL picks an algorithm per call - so a
# difference of float rounding can show up there.) What each rank holds is
# exactly a `1/N` slice of every sharded state, padding included:

# %%
sizes = [p.numel() for p in ddp]
elements = ranks[0].value[3]["shard elements"]
print(f"{world_size} ranks: parameter sizes {sizes}")
print(f"  shard on each rank: {elements} = ceil(size / {world_size}): "
      f"{elements == [math.ceil(n / world_size) for n in sizes]}")
print(f"  Adam state elements: DDP {ranks[0].value[0]['state elements']}, "
      f"ZeRO {ranks[0].value[1]['state elements']} per rank "
      f"(2 moments x {sum(elements)})")

# %% [markdown]
# The collectives of one step, in the order rank 0 issued them (`AR` an
# all-reduce, `RS` a reduce-scatter, `AG` an all-gather). ZeRO-1 and ZeRO-2
# issue the same collectives - ZeRO-2 moves its reduce-scatters into
# backward, where they can overlap the computation of earlier layers. ZeRO-3
# all-gathers each layer twice (forward, and again in backward) instead of
# once after the step: the paper's 1.5x communication.

# %%
for stage, name in enumerate(["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]):
    log = ranks[0].value[stage]["log"]
    counts = {k: sum(e.startswith(k) for e in log) for k in ("AR", "RS", "AG")}
    print(f"{name:7s} {counts}: {' | '.join(log)}")
ratio = reference.published("zero_paper.stage3_communication_vs_dp")
print(f"[ZeRO-3 moves {ratio.value}x DDP's bytes: {ratio.label}]")

# %% [markdown]
# Why the padding: without it, the backend refuses a tensor that does not
# split into `N` equal slices. What each of the 3 ranks was told when it
# reduce-scattered a 37-element tensor unpadded:

# %%
print(ranks[0].value["unpadded"][:160])

# %% [markdown]
# ## 3. Memory per rank, measured
#
# Now the point of it all: bytes. `MemTracker` (in
# `torch.distributed._tools.mem_tracker`) is a dispatch mode that sees every
# tensor created while it runs and files each storage under a category -
# parameters, gradients, optimizer state, activations (made in forward),
# temporaries (made in backward). `memory.track_step` runs one step under it
# and returns the peak by category. Unlike the operating system's view of a
# process (RSS) or the profiler's running total, it counts tensors, so it
# gives the same number on every rank and every run.
#
# Eight layers of width 512, 2 ranks; the second step is measured (the first
# creates Adam's state). Besides the hand-made trainers, PyTorch's own
# `DistributedDataParallel`:

# %%
class TorchDDP(AllReduceDDP):
    """PyTorch's DistributedDataParallel: it all-reduces during backward."""

    def __init__(self, model, lr=1e-2):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(DistributedDataParallel(model), lr)

    def step(self, x, y):
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()


def memory_rank(rank, world_size, width, depth):
    warnings.simplefilter("ignore")
    dev = rank_device(rank)
    torch.manual_seed(100 + rank)
    x, y = torch.randn(16, width, device=dev), torch.randn(16, width, device=dev)
    trainers = {"DDP by hand": AllReduceDDP, "torch DDP": TorchDDP,
                "ZeRO-1": lambda m: Zero(m, 1), "ZeRO-2": lambda m: Zero(m, 2),
                "ZeRO-3": lambda m: Zero(m, 3)}
    table = {}
    for name, make_trainer in trainers.items():
        model = make_model(width, depth).to(dev)
        trainer = make_trainer(model)
        trainer.step(x, y)  # the first step creates Adam's state
        tracked = [model, trainer.opt, x, y, getattr(trainer, "shards", None)]
        table[name] = memory.track_step(lambda t=trainer: t.step(x, y), *tracked)
    return table


mem_ranks = launch(memory_rank, 2, args=(512, 8), timeout=90)
tables = [r.value for r in mem_ranks]
columns = ["parameters", "gradients", "optimizer state", "activations", "temporaries"]
print(f"peak of one step, MiB per rank   {'  '.join(f'{c[:11]:>11s}' for c in columns)}"
      "        total")
for name, peak in tables[0].items():
    print(f"{name:12s} {' ' * 19}" + "  ".join(
        f"{peak.get(c, 0) / 2**20:11.2f}" for c in columns)
        + f"  {peak['total'] / 2**20:11.2f}")
same = all(t[n]["total"] == tables[0][n]["total"] for t in tables for n in tables[0])
totals = [tables[0][n]["total"] for n in ("DDP by hand", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
print(f"the same numbers on both ranks: {same}; DDP > ZeRO-1 > ZeRO-2 > ZeRO-3: "
      f"{all(a > b for a, b in zip(totals, totals[1:], strict=False))}")

# %% [markdown]
# Read the table by column (8 MiB is one copy of the model in fp32).
# **Parameters**: whole on every rank until ZeRO-3, where a rank holds its
# half plus the layer being gathered. **Gradients**: whole in DDP; ZeRO-1
# adds the shard buffers to the whole gradients; ZeRO-2 and ZeRO-3 keep only
# the buffers and one full gradient in flight. **Optimizer state**: Adam's
# two moments (DDP's figure also holds the update's scratch tensors), halved
# by every ZeRO stage. Activations and temporaries hold what lives briefly -
# the padded copies a reduce-scatter sends, the layer outputs - filed by
# when they were made: in forward, or in backward.
#
# **torch DDP** holds a model's worth more than DDP by hand: it copies the
# gradients into **buckets** - flat buffers of about 25 MiB that it
# all-reduces while backward still runs, so communication overlaps
# computation - and those buckets are a second copy of the gradients
# (counted under activations: DDP builds them during a forward).
#
# ## 4. FSDP2: `fully_shard`
#
# PyTorch's ZeRO-3 is FSDP ("fully sharded data parallel"); FSDP2 is its
# current form, `torch.distributed.fsdp.fully_shard`. It is applied to each
# block (a unit of all-gather and free) and then to the whole model (the
# root, which owns what no block owns). Parameters become **DTensors**:
# tensors that know their device mesh and how they are split - `Shard(dim=0)`,
# each rank holds a row-slice.

# %%
def make_blocks(width=64, depth=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(depth)])


def shard_blocks(model, mesh, **options):
    from torch.distributed.fsdp import fully_shard

    for block in model:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def batch(rank, width=64, rows=8):
    torch.manual_seed(100 + rank)
    return torch.randn(rows, width), torch.randn(rows, width)


def fsdp_rank(rank, world_size, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    warnings.simplefilter("ignore")  # FSDP2's notes on hooks and views
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (world_size,))
    x, y = (t.to(dev) for t in batch(rank))
    out = {}
    for setting in (True, False, "prefetch"):
        model = shard_blocks(make_blocks().to(dev), mesh, reshard_after_forward=(
            setting if isinstance(setting, bool) else True))
        if setting == "prefetch":  # gather the next block while this one runs
            for block, after in zip(model, model[1:], strict=False):
                block.set_modules_to_forward_prefetch([after])
                after.set_modules_to_backward_prefetch([block])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def step(model=model, opt=opt):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        step()
        comm = CommDebugMode()
        with comm:
            step()
        peak = memory.track_step(step, x, y, fsdp_model=model, optimizer=opt)
        for _ in range(steps - 3):
            step()
        w = model[0][0].weight
        out[setting] = {"counts": {str(k).split(".")[-1]: v for k, v in
                                   comm.get_comm_counts().items()},
                        "peak": peak, "weights": [p.full_tensor().cpu()
                                                  for p in model.parameters()]}
    torch.set_printoptions(threshold=8, edgeitems=2, precision=3)
    out["printed"] = str(w)
    out["local"] = (tuple(w.shape), tuple(w.to_local().shape), w.placements)
    return out


fsdp = [r.value for r in launch(fsdp_rank, 2, args=(4,), timeout=90)]
print(fsdp[0]["printed"])
shape, local, placements = fsdp[0]["local"]
print(f"global shape {shape}, this rank's piece {local}, placements {placements}")

# %% [markdown]
# Is it still data parallelism? One process that trains the same model on
# both ranks' data at once (the mean loss over the union of the batches)
# must end with the same weights:

# %%
def one_process(steps, world_size=2):
    model = make_blocks()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs, ys = zip(*(batch(r) for r in range(world_size)), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


single = one_process(4)
for reshard in (True, False):
    worst = max((a - b).abs().max().item()
                for a, b in zip(fsdp[0][reshard]["weights"], single, strict=True))
    print(f"reshard_after_forward={reshard}: largest weight difference from one "
          f"process after 4 steps {worst:.1e}")

# %% [markdown]
# (Not bitwise: one process sums the two halves of the batch inside one
# matmul, the ranks sum them in a reduce-scatter - another order of
# additions.)
#
# `reshard_after_forward=True` is ZeRO-3: each block's parameters are freed
# after its forward and all-gathered again for its backward.
# `False` keeps them from forward to backward (FSDP1 called it
# `SHARD_GRAD_OP`, ZeRO-2-like): fewer all-gathers, more memory. Counted by
# `CommDebugMode` (which counts the collectives a step dispatches) and
# measured by `FSDPMemTracker` (MemTracker with FSDP2's categories):

# %%
for reshard in (True, False):
    r = fsdp[0][reshard]
    print(f"reshard_after_forward={reshard!s:5s}: collectives per step {r['counts']}; "
          f"peak {format_bytes(r['peak']['total'])} per rank, of which gathered "
          f"parameters {format_bytes(r['peak'].get('gathered parameters', 0))}")
gap = fsdp[0][False]["peak"]["total"] - fsdp[0][True]["peak"]["total"]
print(f"keeping the parameters costs {format_bytes(gap)} per rank here, and saves "
      f"{fsdp[0][True]['counts']['_allgather_base_'] - fsdp[0][False]['counts']['_allgather_base_']}"
      " all-gathers per step")

# %% [markdown]
# Four blocks: 4 all-gathers in forward, 4 more in backward when resharding,
# and one reduce-scatter per block. (The root owns no parameter here, so it
# has nothing to gather; Exercise 9.3 asks what changes when it does.)
#
# **Prefetching.** On a GPU, an all-gather runs on its own stream while the
# previous block computes. FSDP2 issues the next block's all-gather early by
# itself in backward, and can be told to do so in forward, or further ahead:
# `block.set_modules_to_forward_prefetch([next_block])` and
# `next_block.set_modules_to_backward_prefetch([block])`, as the third run
# did. That changes *when* the collectives start, not how many there are or
# what they compute (over gloo on a CPU there is nothing to overlap with):

# %%
same = all(torch.equal(a, b) for a, b in zip(
    fsdp[0]["prefetch"]["weights"], fsdp[0][True]["weights"], strict=True))
print(f"with prefetching: {fsdp[0]['prefetch']['counts']}, the same weights: {same}")

# %% [markdown]
# ### Mixed precision, CPU offload, and the two classic mistakes
#
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`
# all-gathers bf16 copies of the fp32 shards and computes in bf16, then
# reduce-scatters the gradients in fp32: half the all-gather bytes, fp32
# master weights. The weights then differ from fp32 training by bf16's
# rounding. `CPUOffloadPolicy` keeps the shards and the optimizer on the CPU
# and copies each block to the GPU when needed; it pins the CPU memory for
# fast copies, which fails without a GPU. And two mistakes that FSDP2's users
# report again and again: building the optimizer **before** `fully_shard`
# (it holds the old parameters, which `fully_shard` has replaced by DTensors),
# and saving `model.state_dict()` from rank 0 as if it were the whole model
# (it is rank 0's shards).

# %%
def options_rank(rank, world_size, folder):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    warnings.simplefilter("ignore")
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (world_size,))
    x, y = (t.to(dev) for t in batch(rank))
    out = {}

    def train(model, opt, steps=3):
        for _ in range(steps):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return [p.full_tensor().float().cpu() for p in model.parameters()]

    policies = {"fp32": {}, "bf16": {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}}
    for name, option in policies.items():
        model = shard_blocks(make_blocks().to(dev), mesh, **option)
        out[name] = train(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    out["bf16 dtypes"] = (str(model[0][0].weight.dtype), str(model(x).dtype))
    try:
        shard_blocks(make_blocks(), mesh, offload_policy=CPUOffloadPolicy())
        out["offload"] = "pinned: ran"
    except RuntimeError as e:
        out["offload"] = f"pinned: {e}"
    model = shard_blocks(make_blocks(), mesh,
                         offload_policy=CPUOffloadPolicy(pin_memory=False))
    train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 1)
    out["offload unpinned"] = str(model[0][0].weight.device)
    # mistake 1: the optimizer is built before fully_shard
    model = make_blocks().to(dev)
    early = torch.optim.Adam(model.parameters(), lr=1e-2)
    shard_blocks(model, mesh)
    before = [p.full_tensor().clone() for p in model.parameters()]
    after = train(model, early)
    out["early optimizer moved"] = max((a.to(dev) - b).abs().max().item()
                                       for a, b in zip(after, before, strict=True))
    # mistake 2: the state dict of an FSDP2 model is this rank's shards
    sharded = model.state_dict()["0.0.weight"]
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))  # rank 0 gets it, others {}
    out["state dicts"] = (type(sharded).__name__, tuple(sharded.to_local().shape),
                          {k: tuple(v.shape) for k, v in full.items()})
    out["checkpoint"] = save_checkpoint(rank, world_size, mesh, folder, x, y)
    return out


# %% [markdown]
# ## 5. Distributed checkpoints
#
# `torch.distributed.checkpoint` (DCP) saves each rank's shards to its own
# file plus a metadata file that says which slice of which tensor each holds.
# Loading asks for the slices the *loading* ranks own - whatever their number
# - and reads them from wherever they are. `get_state_dict` and
# `set_state_dict` turn a model and its optimizer into such a state dict and
# back. `async_save` copies the state to memory and writes it in a background
# thread, so training continues during the write.

# %%
def save_checkpoint(rank, world_size, mesh, folder, x, y):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = shard_blocks(make_blocks(), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{folder}/sync")
    # async_save coordinates over a CPU group: nccl ranks make a gloo one for it
    cpu_group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
    future = dcp.async_save({"model": model_sd}, checkpoint_id=f"{folder}/async",
                            process_group=cpu_group)
    returned_at_once = not future.done()
    future.result()
    return {"weights": [p.full_tensor() for p in model.parameters()],
            "async returned before writing": returned_at_once}


folder = tempfile.TemporaryDirectory(prefix="ch09_dcp_")
opts = [r.value for r in launch(options_rank, 2, args=(folder.name,), timeout=120)]
o = opts[0]
print("bf16 compute:", o["bf16 dtypes"][0], "shards,", o["bf16 dtypes"][1], "output; "
      "largest weight difference from fp32 after 3 steps "
      f"{max((a - b).abs().max().item() for a, b in zip(o['bf16'], o['fp32'], strict=True)):.1e}")
print("CPU offload,", o["offload"][:90])
print("CPU offload, not pinned: ran; the shards live on", o["offload unpinned"],
      "(each block is copied to the GPU when it runs)" if GPUS >= 2 else
      "- the ranks run on the CPU, so there is nothing to offload from")
print(f"optimizer built before fully_shard: the weights moved by "
      f"{o['early optimizer moved']:.1e} in 3 steps")
sharded_type, sharded_shape, full = o["state dicts"]
print(f"model.state_dict()['0.0.weight'] is a {sharded_type} of local shape "
      f"{sharded_shape}; with full_state_dict=True rank 0 gets plain tensors "
      f"({full['0.0.weight']}), rank 1 {opts[1]['state dicts'][2] or 'nothing'}")

# %% [markdown]
# The early optimizer trained nothing: it updates tensors the model no longer
# uses, and no error says so. Build the optimizer from `model.parameters()`
# after `fully_shard`. `torch.save(model.state_dict())` on rank 0 writes half
# of each weight, as DTensors; save a distributed checkpoint, or ask for a
# full state dict (`cpu_offload=True` gathers it to the CPU, one tensor at a
# time). (The bf16 difference is rounding, not an error: compare bf16 runs
# with a tolerance of bf16's precision.)
#
# A distributed checkpoint is a folder; `dcp_to_torch_save` converts it
# offline, in one process, into one ordinary `torch.save` file - for
# inference, or for sharing the weights with someone who does not shard:

# %%
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

dcp_to_torch_save(f"{folder.name}/sync", f"{folder.name}/plain.pt")
plain = torch.load(f"{folder.name}/plain.pt", weights_only=False)
w, saved = plain["model"]["0.0.weight"], opts[0]["checkpoint"]["weights"]
print(f"plain file: {sorted(plain)}; model tensors {len(plain['model'])}, "
      f"0.0.weight a {type(w).__name__} of {tuple(w.shape)}, equal to the trained "
      f"one: {torch.equal(w, saved[0])}")

# %% [markdown]
# Now the checkpoint written by those 2 ranks, loaded by 4 - a fresh model
# and optimizer, their state replaced by the checkpoint's (it runs in the
# 4-rank launch below):

# %%
def load_rank(rank, world_size, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh(rank_device(rank).type, (world_size,))
    model = shard_blocks(make_blocks(seed=1), mesh)  # other weights
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{folder}/sync")  # fills state in place
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    w = model[0][0].weight
    adam = opt.state[w]
    return {"weights": [p.full_tensor() for p in model.parameters()],
            "local": tuple(w.to_local().shape), "step": float(adam["step"]),
            "exp_avg": tuple(adam["exp_avg"].to_local().shape)}


# %% [markdown]
# ### Hybrid sharding (HSDP)
#
# Sharding over all `N` ranks makes every all-gather cross the slowest link
# (between nodes). **HSDP** shards within a group (a node) and replicates
# across groups: a 2-D mesh, replicate x shard, where only the gradient
# all-reduce crosses nodes. Four ranks as a 2 x 2 mesh, launched together
# with the checkpoint's loading (each launch starts fresh processes):

# %%
def hsdp_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh(rank_device(rank).type, (2, 2),
                            mesh_dim_names=("replicate", "shard"))
    model = shard_blocks(make_blocks(), mesh)
    x, y = (t.to(rank_device(rank)) for t in batch(rank))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(4):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    w = model[0][0].weight
    return (str(w.placements), tuple(w.to_local().shape),
            [p.full_tensor() for p in model.parameters()])


def four_ranks(rank, world_size, folder):
    return load_rank(rank, world_size, folder), hsdp_rank(rank, world_size)


both = [r.value for r in launch(four_ranks, 4, args=(folder.name,), timeout=150)]
folder.cleanup()
loaded, hsdp = [b[0] for b in both], [b[1] for b in both]

# %%
worst = max((a - b).abs().max().item()
            for a, b in zip(loaded[0]["weights"], saved, strict=True))
print(f"saved on 2 ranks, loaded on 4: largest weight difference {worst:.1e}; "
      f"each rank now holds {loaded[0]['local']} of the (64, 64) weight")
print(f"Adam resumed: step {loaded[0]['step']:g}, moments of local shape "
      f"{loaded[0]['exp_avg']} (sharded like the weight)")
print("async_save returned before the write was done:",
      opts[0]["checkpoint"]["async returned before writing"])

# %%
reference_4 = one_process(4, world_size=4)
worst = max((a - b).abs().max().item() for r in hsdp
            for a, b in zip(r[2], reference_4, strict=True))
print(f"placements {hsdp[0][0]}, local piece {hsdp[0][1]} of (64, 64); largest "
      f"weight difference from one process on all 4 batches {worst:.1e}")

# %% [markdown]
# `Replicate()` on the first mesh dimension, `Shard(dim=0)` on the second:
# each weight is split in two, and each half held twice.
#
# ## 6. The GPU story: a 7B model
#
# How many GPUs does a 7B model need? The arithmetic of section 1 gives the
# model states; activations and the buffers FSDP2 gathers into come on top.
# PyTorch can answer the whole question without a GPU: a **fake process
# group** (its collectives do nothing) and **fake tensors** (shapes without
# data) let the real `fully_shard` code run a real training step of a
# Llama-2-7B-shaped model, and `FSDPMemTracker` counts what one rank would
# hold. `course_utils.memory` has the model and the plumbing; its table
# `LLAMA2_7B_FSDP2` holds the prediction for 1 to 64 ranks, computed by
# `python -m course_utils.memory` (about 10 s per world size, too slow for
# this notebook). The same code on a 2-layer version runs here, live, in
# about a second, and must give what the module recorded, byte for byte:

# %%
live = memory.fsdp2_peak_on_fake_ranks([8], layers=2, in_process=True)[8]
recorded = memory.LLAMA2_2_LAYERS_FSDP2[8]
print(f"2 layers, {live['parameters'] / 1e9:.2f} B parameters, 8 ranks: "
      f"{live['peak']['total'] / 2**30:.2f} GiB per rank now, "
      f"{recorded['total'] / 2**30:.2f} GiB recorded - "
      f"{'the same' if live['peak'] == recorded else 'different: has torch changed?'}")

# %%
h100 = reference.published("h100_sxm.memory_gb")
table = memory.LLAMA2_7B_FSDP2
ns = sorted(table)
pred = reference.predicted(
    {"x": ns, "y": [table[n]["total"] / 1e9 for n in ns]}, "GB", "GPUs of any kind",
    "FSDP2 fully_shard per block and root, fp32 weights, Adam, one step of 1 x 2048 "
    "tokens, counted by FSDPMemTracker on a fake process group with fake tensors "
    "(no allocator slack, no CUDA/NCCL workspaces)")
fig, ax = plt.subplots(figsize=(7, 3.5))
plots.plot_figure_curves([pred], ax=ax, xlabel="ranks (GPUs)", ylabel="GB per GPU",
                         title="Llama-2-7B shapes, FSDP2: peak memory per GPU",
                         logy=False)
ax.axhline(h100.value, color="gray", linestyle=":", label=f"{h100.device} capacity")
ax.legend(fontsize=7)
plt.show()
print(f"{memory.LLAMA2_7B_PARAMETERS / 1e9:.2f} B parameters; peak per GPU, of which")
for n in ns:
    print(f"{n:3d} GPUs: {table[n]['total'] / 1e9:6.1f} GB | sharded parameters "
          f"{table[n]['parameters'] / 1e9:5.2f} | activations "
          f"{table[n].get('activations', 0) / 1e9:5.1f} | optimizer state "
          f"{table[n].get('optimizer state', 0) / 1e9:5.1f}")
print(f"[{pred.label}]")
print(f"[capacity: {h100.label}]")

# %% [markdown]
# Two regimes. On 1 and 2 GPUs the peak is the optimizer step, with Adam's
# state in full (or halved): 16 bytes per parameter, over 100 GB on one GPU.
# From 4 GPUs on, the model states shrink as `1/N` and the peak moves into
# backward, where the activations of all 32 layers - about 20 GB for 2048
# tokens in fp32, the same on every rank whatever `N` - dominate. Sharding
# alone stops helping there; activation checkpointing (Chapter 8), bf16
# activations, and splitting the sequence or the layers (Chapters 10 and 11)
# take over. The prediction leaves out what a real GPU adds: the caching
# allocator's slack, CUDA and NCCL workspaces. torchtitan's FSDP2 notes
# report that on some Llama-7B runs on 8 H100s it peaked 7% lower than FSDP1:

# %%
note = reference.published("torchtitan.fsdp2_vs_fsdp1_peak_memory_reduction_percent")
print(f"FSDP2 vs FSDP1 peak memory: -{note.value}% [{note.label}]")

# %% [markdown]
# With GPUs, an FSDP2 model of 8 layers of width 1024 runs on them here: the
# allocator's peak (`torch.cuda.max_memory_allocated`) beside the tracker's
# count of the same step - the difference is the allocator's rounding and
# its workspaces. It is recorded for learners without a GPU.

# %%
def gpu_peak_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (world_size,))
    model = shard_blocks(make_blocks(width=1024, depth=8).to(dev), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = (t.to(dev) for t in batch(rank, width=1024, rows=64))

    def step():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    counted = memory.track_step(step, x, y, fsdp_model=model, optimizer=opt)["total"]
    torch.cuda.synchronize(dev)
    return counted, torch.cuda.max_memory_allocated(dev)


if GPUS >= 2:
    gpu_ranks = [r.value for r in launch(gpu_peak_rank, 2, timeout=120)]
    counted, allocated = gpu_ranks[0]
    print(f"2 GPUs: tracker {format_bytes(counted)}, allocator peak "
          f"{format_bytes(allocated)} per rank")
    reference.record("09.fsdp2_8x1024_peak_bytes_2gpus", allocated, "B", "cuda:0")
else:
    print(f"{GPUS} GPU(s): nothing measured on a GPU here")
reference.show("09.fsdp2_8x1024_peak_bytes_2gpus", unit="B", figures=[
    reference.predicted((1024 * 1024 + 1024) * 8 * 16 / 2,
                        "B", "2 GPUs, any kind",
                        "model states only: 16 bytes per parameter (fp32 weight, "
                        "gradient, Adam's 2 moments), sharded over 2 ranks",
                        caveat="not calibrated: activations, the allocator's "
                        "rounding and NCCL's buffers are left out, so a GPU's "
                        "peak is higher")],
    fmt="{:.4g}");

# %% [markdown]
# ## Summary
#
# - Adam training keeps 16 bytes per parameter (fp32, or bf16 with fp32
#   master weights) besides the activations; DDP keeps all of it on every
#   rank, plus gradient buckets.
# - ZeRO shards it: stage 1 the optimizer state, stage 2 the gradients (a
#   reduce-scatter in backward), stage 3 the parameters (an all-gather per
#   layer in forward and again in backward, 1.5x DDP's communication). Built
#   from `reduce_scatter_single` and `all_gather_single` over padded flat
#   tensors, it matches DDP bitwise (over `gloo`; to rounding over `nccl`).
# - `MemTracker` and `FSDPMemTracker` count memory per rank by category,
#   deterministically: the same on every rank, on CPU, GPU or fake tensors.
# - FSDP2's `fully_shard` per block and root gives DTensor parameters;
#   `reshard_after_forward` trades memory for all-gathers; mixed precision
#   all-gathers bf16; HSDP shards within and replicates across a 2-D mesh.
#   Build the optimizer after sharding, and save with DCP or a full state
#   dict.
# - DCP checkpoints reshard on load: saved by 2 ranks, loaded by 4.
# - A fake process group with fake tensors predicts a 7B model's memory per
#   GPU from the real code; beyond a few GPUs the activations dominate.

# %% [markdown]
# ## Exercises
#
# ### Exercise 9.1: a ZeRO-3 linear layer
#
# Section 2 freed and re-gathered parameters with hooks. Another way is to
# write the layer's forward and backward yourself. Complete
# `ShardedLinear`, an autograd function whose inputs are the activation `x`
# (rows of `in_features`) and this rank's shards of the weight and the bias
# (each the rank's slice of the flattened, zero-padded tensor, as
# `my_shard` makes them):
#
# - `forward`: all-gather the full weight and bias, return `x @ W.T + b`,
#   and keep **only** `x` and the shards for backward - not the full weight;
# - `backward`: all-gather again, compute the gradient of `x`, and return,
#   for each shard, this rank's slice of the gradient **averaged over the
#   ranks** (as DDP averages), with a reduce-scatter.
#
# The checker runs it on 2 and on 3 ranks with odd sizes, against one
# process, and counts the bytes your forward keeps.

# %% tags=["exercise"] exercise="9.1"
class ShardedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_shard, bias_shard, out_features, in_features):
        ### BEGIN SOLUTION
        ctx.save_for_backward(x, weight_shard, bias_shard)
        ctx.shape = (out_features, in_features)
        w = gather_full(weight_shard, ctx.shape)
        b = gather_full(bias_shard, (out_features,))
        return x @ w.T + b
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        ### BEGIN SOLUTION
        x, weight_shard, bias_shard = ctx.saved_tensors
        w = gather_full(weight_shard, ctx.shape)
        grad_w, grad_b = grad_out.T @ x, grad_out.sum(0)
        grad_w_shard = torch.empty_like(weight_shard)
        grad_b_shard = torch.empty_like(bias_shard)
        reduce_scatter_mean(grad_w, grad_w_shard)
        reduce_scatter_mean(grad_b, grad_b_shard)
        return grad_out @ w, grad_w_shard, grad_b_shard, None, None
        ### END SOLUTION


# %% tags=["check"] exercise="9.1"
check_sharded_linear(ShardedLinear)

# %% [markdown]
# ### Exercise 9.2: reshard a checkpoint
#
# What DCP did in section 5, for flat shards. A checkpoint saved by `N` ranks
# is a list of `N` dictionaries, one per rank: for each name, that rank's
# slice of the flattened tensor, zero-padded to a multiple of `N` (as
# `my_shard` cuts it), plus Adam's `"step"` - a scalar tensor every rank
# holds whole (so does any name that `shapes` leaves out). `shapes` gives
# each sharded tensor's full shape. Write
# `reshard_checkpoint(shards, shapes, new_world_size)`: the list of
# `new_world_size` dictionaries that ranks of the new world would load,
# sliced and padded the same way, with the same dtypes and values.

# %% tags=["exercise"] exercise="9.2"
def reshard_checkpoint(shards, shapes, new_world_size):
    ### BEGIN SOLUTION
    m = new_world_size
    new = [{} for _ in range(m)]
    for name in shards[0]:
        if name not in shapes:  # replicated: every rank keeps it whole
            for d in new:
                d[name] = shards[0][name].clone()
            continue
        numel = math.prod(shapes[name])
        flat = torch.cat([s[name] for s in shards])[:numel]
        for rank, piece in enumerate(padded_flat(flat, m).chunk(m)):
            new[rank][name] = piece.clone()
    return new
    ### END SOLUTION


# %% tags=["check"] exercise="9.2"
check_reshard_checkpoint(reshard_checkpoint)

# %% [markdown]
# ### Exercise 9.3: predict the collectives
#
# A model of `blocks` blocks, each `fully_shard`-ed, then the root; the root
# owns parameters of its own (an output layer after the blocks) when
# `root_params` is True. Every `fully_shard` call gets the same
# `reshard_after_forward`: True, False, or None - left out, FSDP2's default
# (read its docstring: `help(torch.distributed.fsdp.fully_shard)`). Predict
# how many all-gathers and reduce-scatters one forward and backward
# dispatches, on 2 ranks, and return `(all_gathers, reduce_scatters)`. The
# checker runs FSDP2 on such models and counts.

# %% tags=["exercise"] exercise="9.3"
def predict_collectives(blocks, root_params, reshard_after_forward):
    ### BEGIN SOLUTION
    units = blocks + (1 if root_params else 0)
    if reshard_after_forward is None:  # True for the blocks, False for the root
        regathered = blocks
    else:
        regathered = units if reshard_after_forward else 0
    return units + regathered, units
    ### END SOLUTION


# %% tags=["check"] exercise="9.3"
check_fsdp_collectives(predict_collectives)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | sharded data parallelism | 分片数据并行 |
# | ZeRO (zero redundancy optimizer) | 零冗余优化器 |
# | optimizer state | 优化器状态 |
# | reduce-scatter | 归约分散 |
# | all-gather | 全收集 |
# | shard / reshard | 分片 / 重新分片 |
# | padding | 填充 |
# | fully sharded data parallel (FSDP) | 完全分片数据并行 |
# | device mesh | 设备网格 |
# | hybrid sharding (HSDP) | 混合分片 |
# | distributed checkpoint | 分布式检查点 |
# | fake tensor | 伪张量 |
# | activation | 激活值 |
