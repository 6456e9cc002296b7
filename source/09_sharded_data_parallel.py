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
#   reduce-scatter and all-gather: equal to DDP (to the last bit over gloo),
#   each rank holding `1/N` of what is sharded, measured by a deterministic
#   counter.
# - PyTorch's FSDP2 (`fully_shard`) as it is practised: DTensor parameters,
#   resharding, prefetching, mixed precision, CPU offload, hybrid sharding,
#   meta-device initialisation, clipping, accumulation, checkpointing order.
# - Distributed checkpoints saved on 2 ranks and loaded on 4.
# - How much memory a 7B model needs per GPU, by category, predicted by
#   running the real FSDP2 code on fake tensors, without allocating a byte.
#
# **Hardware.** The ranks are real processes joined by `gloo` - on GPUs, one
# rank per GPU over `nccl`, with `gloo` beside it for CPU tensors (the group
# is made with `"cpu:gloo,cuda:nccl"`) - so every collective below runs and every
# byte is counted, not estimated. Memory per rank comes from PyTorch's
# `MemTracker`, which counts tensor storages: the same number on every rank
# and every run, on a CPU or a GPU. Without GPUs, the GPU side is a published
# figure (the ZeRO paper) and a prediction (FSDP2 on a fake process group).

# %%
import functools
import math
import warnings

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn

from course_utils import banner, memory, reference
from course_utils.checks.ch09 import (
    check_clip_sharded,
    check_reshard_checkpoint,
    check_sharded_linear,
)
from course_utils.cleanup import scratch_folder, tidy_up
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
        part = [model_state_bytes(billions * 1e9, world_size, s, precision)[i] / 1e9
                for s in range(4)]
        ax.bar(labels, part, bottom=bottom, label=what, color=color)
        bottom = [b + v for b, v in zip(bottom, part, strict=True)]
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="GB per rank (1e9 bytes)", title=f"{billions:g} B parameters on {world_size} "
           f"ranks, {precision} (activations not included)")
    ax.legend(fontsize=7)
    plt.show()


widgets.interact(draw_memory,
                 billions=widgets.FloatLogSlider(value=7, base=10, min=-1, max=2.5,
                                                 description="B params",
                                                 readout_format=".3g"),
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
    """This rank's GPU when its group has nccl (one rank per GPU), else the CPU."""
    return torch.device("cuda", rank) if "nccl" in dist.get_backend() else \
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
    except (RuntimeError, ValueError) as e:  # gloo's text opens with a log prefix
        return f"{type(e).__name__}: {str(e).splitlines()[0].rpartition('] ')[2]}"


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
    results["backend"] = dist.get_backend()
    return results


for world_size in (2, 3):  # echo=False: gloo also logs the unpadded failure
    ranks = launch(train_rank, world_size, args=(37, 2, 3), timeout=60, echo=False)
    ddp = ranks[0].value[0]["weights"]
    for stage in (1, 2, 3):
        worst = max((a - b).abs().max().item() for r in ranks
                    for a, b in zip(r.value[stage]["weights"], ddp, strict=True))
        print(f"{world_size} ranks ({ranks[0].value['backend']}), ZeRO-{stage}: "
              f"largest weight difference from DDP after 3 Adam steps: {worst:.1e}"
              + (" (bitwise equal)" if worst == 0 else ""))

# %% [markdown]
# Over `gloo` the cell says bitwise equal, on 2 ranks and on 3: the same
# sums in the same order feed the same Adam arithmetic, only split across
# ranks. Over `nccl` that is not promised: with 3 or more ranks the
# all-reduce and the reduce-scatter may add the ranks' gradients in
# different orders (NCCL picks an algorithm per call), a difference of float
# rounding that Adam then amplifies (section 4 shows how). What each rank holds is
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
# reduce-scattered a 37-element tensor unpadded - gloo words it as a failed
# check, but it is an exception the rank caught, not a crash:

# %%
print(f"rank 0 caught {ranks[0].value['unpadded'][:160]}")

# %% [markdown]
# ## 3. Memory per rank, measured
#
# Now the point of it all: bytes. `MemTracker` (in
# `torch.distributed._tools.mem_tracker`, a private module: its interface
# may change between releases) is a dispatch mode that sees every
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
# computation - and those buckets are a second copy of the gradients. DDP
# allocates them when it is constructed and rebuilds them once, at the
# second forward, in the order the first backward produced the gradients;
# that rebuild runs in the measured step's forward, so the tracker files
# the buckets under activations.
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


def train(model, opt, x, y, steps=1):
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


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
        step = functools.partial(train, model, opt, x, y)
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
    train(model, opt, torch.cat(xs), torch.cat(ys), steps)
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
# has nothing to gather.)
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
# master weights. `CPUOffloadPolicy` keeps the shards and the optimizer on
# the CPU and copies each block to the GPU when needed; it pins the CPU
# memory for fast copies, which needs CUDA. And two mistakes that FSDP2's
# users report again and again: building the optimizer **before**
# `fully_shard` (it holds the old parameters, which `fully_shard` has
# replaced by DTensors), and saving `model.state_dict()` from rank 0 as if it
# were the whole model (it is rank 0's shards).

# %%
def options_rank(rank, world_size):
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

    def run(model, opt, steps=3):
        losses, first = [], {}
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x).float(), y)  # the loss in fp32
            loss.backward()
            first = first or {"grads": [p.grad.full_tensor().cpu()
                                        for p in model.parameters()]}
            opt.step()
            opt.zero_grad()
            first.setdefault("weights", [p.full_tensor().float().cpu()
                                         for p in model.parameters()])
            losses.append(loss.item())
        return [p.full_tensor().float().cpu() for p in model.parameters()], \
            losses, first

    policies = {"fp32": {}, "bf16": {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}}
    for name, option in policies.items():
        model = shard_blocks(make_blocks().to(dev), mesh, **option)
        out[name] = run(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    out["bf16 dtypes"] = (str(model[0][0].weight.dtype), str(model(x).dtype))
    try:
        shard_blocks(make_blocks().to(dev), mesh, offload_policy=CPUOffloadPolicy())
        out["offload"] = "pinned: ran"
    except RuntimeError as e:
        out["offload"] = f"pinned: {e}"
    model = shard_blocks(make_blocks().to(dev), mesh,
                         offload_policy=CPUOffloadPolicy(pin_memory=False))
    run(model, torch.optim.Adam(model.parameters(), lr=1e-2), 1)
    out["offload unpinned"] = str(model[0][0].weight.device)
    # mistake 1: the optimizer is built before fully_shard
    model = make_blocks().to(dev)
    early = torch.optim.Adam(model.parameters(), lr=1e-2)
    shard_blocks(model, mesh)
    before = [p.full_tensor().cpu() for p in model.parameters()]
    after = run(model, early)[0]
    out["early optimizer moved"] = max((a - b).abs().max().item()
                                       for a, b in zip(after, before, strict=True))
    # mistake 2: the state dict of an FSDP2 model is this rank's shards
    sharded = model.state_dict()["0.0.weight"]
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))  # rank 0 gets it, others {}
    out["state dicts"] = (type(sharded).__name__, tuple(sharded.to_local().shape),
                          {k: tuple(v.shape) for k, v in full.items()})
    return out


opts = [r.value for r in launch(options_rank, 2, timeout=120)]
o = opts[0]
print("bf16 compute:", o["bf16 dtypes"][0], "shards,", o["bf16 dtypes"][1], "output")
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
# of each weight, as DTensors; save a distributed checkpoint (section 5), or
# ask for a full state dict (`cpu_offload=True` gathers it to the CPU, one
# tensor at a time).
#
# **How to test bf16 training.** **Claim** (a common check): bf16 weights
# should match fp32 training to bf16's precision. **Measured here:**

# %%
w32, loss32, first32 = o["fp32"]
w16, loss16, first16 = o["bf16"]
print(f"after 3 steps: largest weight difference "
      f"{max((a - b).abs().max().item() for a, b in zip(w16, w32, strict=True)):.1e}; "
      f"losses fp32 {[f'{v:.4f}' for v in loss32]}, bf16 "
      f"{[f'{v:.4f}' for v in loss16]}")
flip = torch.cat([(a.sign() != b.sign()).flatten() for a, b in zip(
    first16["grads"], first32["grads"], strict=True)])
moved = torch.cat([(a - b).abs().flatten() for a, b in zip(
    first16["weights"], first32["weights"], strict=True)])
print(f"step 1: {int(flip.sum())} of {flip.numel()} gradients changed sign; those "
      f"weights differ by {moved[flip].min():.1e} to {moved[flip].max():.1e}, the "
      f"others by at most {moved[~flip].max():.1e} (learning rate 1e-2)")

# %% [markdown]
# **Why.** Adam's first update is `lr * m / (sqrt(v) + eps)` with `m = g`
# and `v = g^2`: about `lr * sign(g)`, whatever the gradient's size. Where
# bf16's rounding flips a near-zero gradient's sign, the two runs move that
# weight `lr` in opposite directions - a difference of up to `2 lr`, 0.02
# here (`lr` where one of them rounded to exactly zero), far above bf16's
# precision, and later steps keep amplifying such differences. The losses
# stay close. So compare a bf16 run's **losses** with fp32's, and its
# weights only with another run under the same policy (the same code and
# seeds give the same bits on these ranks).
#
# ### Hybrid sharding (HSDP)
#
# Sharding over all `N` ranks makes every all-gather cross the slowest link
# (between nodes). **HSDP** shards within a group (a node) and replicates
# across groups: a 2-D mesh, replicate x shard, where only the gradient
# all-reduce crosses nodes. Four ranks as a 2 x 2 mesh:

# %%
def hsdp_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh(rank_device(rank).type, (2, 2),
                            mesh_dim_names=("replicate", "shard"))
    model = shard_blocks(make_blocks().to(rank_device(rank)), mesh)
    x, y = (t.to(rank_device(rank)) for t in batch(rank))
    train(model, torch.optim.Adam(model.parameters(), lr=1e-2), x, y, steps=4)
    w = model[0][0].weight
    return (str(w.placements), tuple(w.to_local().shape),
            [p.full_tensor() for p in model.parameters()])


# %% [markdown]
# It runs below, in one launch with the next demonstrations (each launch
# starts fresh processes).
#
# ### FSDP2 in practice
#
# Five things a real FSDP2 training script does, on 4 ranks:
#
# - **Meta-device initialisation.** A 70B model does not fit in one
#   process's memory. Built under `torch.device("meta")` (shapes, no data),
#   sharded, then `to_empty` allocates only each rank's shards, and the
#   weights are initialised in place on the shards.
# - **Gradient clipping**: `clip_grad_norm_` works on DTensor gradients; its
#   norm is over the whole model (one all-reduce of the shards' squares).
# - **Gradient accumulation**: `set_requires_gradient_sync(False)` skips the
#   reduce-scatter of every micro-batch but the last.
# - **Activation checkpointing first, then `fully_shard`**: wrap each block
#   for recomputation, then shard the wrapper, so the recomputed forward
#   runs inside the unit FSDP2 has just gathered for backward.
# - **`reshard_after_forward` as an integer** (ZeRO++'s hpZ): after forward a
#   block keeps its parameters sharded over a smaller group (2 here, a node
#   on a cluster), so the backward all-gathers stay inside it.

# %%
class Checkpointed(nn.Module):  # activations recomputed in backward (Chapter 8)
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def practice_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    hsdp = hsdp_rank(rank, world_size)
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (world_size,))
    x, y = (t.to(dev) for t in batch(rank))
    with torch.device("meta"):
        model = make_blocks()
    shard_blocks(model, mesh)
    model.to_empty(device=dev)  # allocates this rank's shards only
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()  # initialise the shards in place
    out = {"hsdp": hsdp, "meta": (memory.storage_bytes(model.parameters()),
                                  str(model[0][0].weight.device))}
    nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    out["clip"] = (type(norm).__name__, norm.full_tensor().item(),
                   [p.grad.full_tensor().cpu() for p in model.parameters()])
    for sync_each in (True, False):  # 4 micro-batches
        scatters = 0
        for i in range(4):
            model.set_requires_gradient_sync(sync_each or i == 3)
            with CommDebugMode() as comm:
                nn.functional.mse_loss(model(x), y).backward()
            scatters += sum(v for k, v in comm.get_comm_counts().items()
                            if "reduce_scatter" in str(k))
        out[f"reduce-scatters, sync each={sync_each}"] = scatters
    for name, wrap, reshard in (("plain", False, True), ("checkpointed", True, True),
                                ("reshard to 2", False, 2), ("no reshard", False,
                                                             False)):
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128),
                                nn.Tanh()).to(dev) for _ in range(4)]
        model = shard_blocks(nn.Sequential(*[Checkpointed(b) if wrap else b
                                             for b in blocks]),
                             mesh, reshard_after_forward=reshard)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        xx, yy = (t.to(dev) for t in batch(rank, width=128, rows=32))
        step = functools.partial(train, model, opt, xx, yy)
        step()
        out[name] = memory.track_step(step, xx, yy, fsdp_model=model, optimizer=opt)
    return out




practice = launch(practice_rank, 4, timeout=150)[0].value
hsdp = practice["hsdp"]
reference_4 = one_process(4, world_size=4)
worst = max((a - b).abs().max().item() for a, b in zip(hsdp[2], reference_4,
                                                        strict=True))
print(f"HSDP: placements {hsdp[0]}, local piece {hsdp[1]} of (64, 64); largest "
      f"weight difference from one process on all 4 batches {worst:.1e}")

# %% [markdown]
# `Replicate()` on the first mesh dimension, `Shard(dim=0)` on the second:
# each weight is split in two, and each half held twice. Then the five
# practices:

# %%
shard_bytes, where = practice["meta"]
whole = sum(p.numel() * 4 for p in make_blocks().parameters())
print(f"meta init: each rank allocated {format_bytes(shard_bytes)} of the model's "
      f"{format_bytes(whole)}, on {where}")
kind, norm, clipped = practice["clip"]
print(f"clip_grad_norm_: total norm {norm:.4f} (a {kind}, the same on every rank); "
      f"after clipping the gathered gradients' norm is "
      f"{torch.cat([g.flatten() for g in clipped]).norm():.4f} (max_norm 0.1)")
for sync_each in (True, False):
    print(f"4 micro-batches, gradient sync {'every' if sync_each else 'last only'}: "
          f"{practice[f'reduce-scatters, sync each={sync_each}']} reduce-scatters")
for name in ("plain", "checkpointed"):
    print(f"{name}: activations kept for backward "
          f"{format_bytes(practice[name]['activations'])}")
print("peak per rank, reshard_after_forward True, 2, False: " + ", ".join(
    format_bytes(practice[name]["total"])
    for name in ("plain", "reshard to 2", "no reshard")))

# %% [markdown]
# What to read: meta initialisation never held the whole model; clipping's
# norm is the whole model's; accumulation reduce-scatters once per block at
# the last micro-batch instead of once per micro-batch; checkpointing cuts
# the activations kept for backward; an integer
# `reshard_after_forward` sits between `True` and `False` in memory.
#
# Two notes. Here `reset_parameters` draws each shard from its rank's own
# random stream; torchtitan initialises with a seed per model so that every
# layout gives the same weights (DTensor's random ops do that on CUDA).
# And FSDP2 can all-gather **float8** weights: torchao's
# `convert_to_float8_training` swaps each `nn.Linear` for a `Float8Linear`,
# and `Float8LinearConfig(enable_fsdp_float8_all_gather=True)` casts the
# weight before the all-gather - a quarter of fp32's bytes, on GPUs with
# float8 matmuls (H100 and newer); torchtitan's `docs/float8.md` shows it.

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
def save_rank(rank, world_size, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dev = rank_device(rank)
    model = shard_blocks(make_blocks().to(dev), init_device_mesh(dev.type,
                                                                 (world_size,)))
    x, y = (t.to(dev) for t in batch(rank))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, x, y, steps=2)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{folder}/sync")
    # async_save coordinates over the CPU: the launcher's groups have gloo for
    # CPU tensors, beside nccl on GPUs
    future = dcp.async_save({"model": model_sd}, checkpoint_id=f"{folder}/async")
    returned_at_once = not future.done()
    future.result()
    return {"weights": [p.full_tensor() for p in model.parameters()],
            "async returned before writing": returned_at_once}


folder = scratch_folder("ch09-dcp-")  # removed with the chapter, however it ends
saved_by = launch(save_rank, 2, args=(str(folder),), timeout=90)[0].value
saved = saved_by["weights"]
print("async_save returned before the write was done:",
      saved_by["async returned before writing"])

# %% [markdown]
# A distributed checkpoint is a folder; `dcp_to_torch_save` converts it
# offline, in one process, into one ordinary `torch.save` file - for
# inference, or for sharing the weights with someone who does not shard:

# %%
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

dcp_to_torch_save(f"{folder}/sync", f"{folder}/plain.pt")
plain = torch.load(f"{folder}/plain.pt", weights_only=False)
w = plain["model"]["0.0.weight"]
print(f"plain file: {sorted(plain)}; model tensors {len(plain['model'])}, "
      f"0.0.weight a {type(w).__name__} of {tuple(w.shape)}, equal to the trained "
      f"one: {torch.equal(w, saved[0])}")

# %% [markdown]
# Now the checkpoint written by those 2 ranks, loaded by 4 - a fresh model
# and optimizer, their state replaced by the checkpoint's:

# %%
def load_rank(rank, world_size, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh(rank_device(rank).type, (world_size,))
    model = shard_blocks(make_blocks(seed=1).to(rank_device(rank)), mesh)
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


loaded = launch(load_rank, 4, args=(str(folder),), timeout=90)[0].value
worst = max((a - b).abs().max().item()
            for a, b in zip(loaded["weights"], saved, strict=True))
print(f"saved on 2 ranks, loaded on 4: largest weight difference {worst:.1e}; "
      f"each rank now holds {loaded['local']} of the (64, 64) weight")
print(f"Adam resumed: step {loaded['step']:g}, moments of local shape "
      f"{loaded['exp_avg']} (sharded like the weight)")

# %% [markdown]
# ## 6. The GPU story: a 7B model
#
# How many GPUs does a 7B model need? The arithmetic of section 1 gives the
# model states; activations and the buffers FSDP2 gathers into come on top.
# PyTorch can answer the whole question without a GPU. A **fake process
# group** (backend `"fake"`: its collectives do nothing; its store lives in
# the private module `torch.testing._internal.distributed.fake_pg`) and
# **fake tensors** (`FakeTensorMode`: shapes and dtypes without data) let
# the real `fully_shard` code run real training steps of a
# Llama-2-7B-shaped model (`memory.Llama`), and `FSDPMemTracker` (section
# 4) counts what one rank holds. We measure
# the **second** step: the first creates Adam's state inside `opt.step()`,
# so its peak misses the optimizer state entirely.

# %%
def fake_fsdp2_peak(world_size, layers, tokens=2048):
    """Peak bytes per rank of FSDP2's second training step, on fake ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode
        with FakeTensorMode():
            model = memory.Llama(layers=layers)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters())
            x = torch.randint(0, 32000, (1, tokens))

            def step():
                logits = model(x)
                nn.functional.cross_entropy(logits.flatten(0, 1),
                                            x.flatten()).backward()
                opt.step()
                opt.zero_grad()

            step()  # creates Adam's state
            return memory.track_step(step, x, fsdp_model=model, optimizer=opt)
    finally:
        dist.destroy_process_group()


# %% [markdown]
# 32 layers take tens of seconds per world size, too slow for this notebook:
# `python -m course_utils.memory` ran the same code for 1 to 64 ranks into
# the table `memory.LLAMA2_7B_FSDP2`. Two layers run here, live, in a few
# seconds, and must give what that module stored, byte for byte:

# %%
live = fake_fsdp2_peak(8, layers=2)
stored = memory.LLAMA2_2_LAYERS_FSDP2[8]
print(f"2 layers, 8 ranks: {live['total'] / 1e9:.2f} GB per rank now, "
      f"{stored['total'] / 1e9:.2f} GB stored - "
      f"{'the same bytes' if live == stored else 'different: has torch changed?'}")

# %%
h100 = reference.published("h100_sxm.memory_gb")
table = memory.LLAMA2_7B_FSDP2
pred = reference.predicted(
    {"x": sorted(table), "y": [table[n]["total"] / 1e9 for n in sorted(table)]},
    "GB", "GPUs of any kind",
    "FSDP2 fully_shard per block and root, fp32 weights, Adam, the second step of "
    "1 x 2048 tokens, counted by FSDPMemTracker on a fake process group with fake "
    "tensors (no allocator slack, no CUDA/NCCL workspaces)")
fig, ax = plt.subplots(figsize=(7.5, 3.8))
memory.plot_parts(table, ax, h100.value, f"{h100.device}: {h100.value:g} GB")
ax.set(xlabel="GPUs (ranks)", ylabel="GB per GPU (1e9 bytes)",
       title="Llama-2-7B shapes, FSDP2, peak of the second step (predicted)")
plt.show()
print(f"{memory.LLAMA2_7B_PARAMETERS / 1e9:.2f} B parameters; GB per GPU at the "
      "peak of step 2:")
print("GPUs  parameters  gradients  optimizer  activations  buffers, temps  total")
for n in sorted(table):
    print(f"{n:4d}" + "".join(f"{v / 1e9:{w}.2f}" for v, w in zip(
        memory.parts(table[n]).values(), (12, 11, 11, 13, 16), strict=True))
        + f"{table[n]['total'] / 1e9:7.1f}")
print(f"[{pred.label}]\n[capacity: {h100.label}]")

# %% [markdown]
# Two regimes. On 1 GPU the peak is the optimizer step: about 16 bytes per
# parameter, over 100 GB. From 2 GPUs on it moves into backward, where the
# activations of all 32 layers - about 22 GB for 2048 tokens in fp32, the
# same on every rank whatever `N` - sit beside the model states, which
# shrink as `1/N`. Sharding alone stops helping there; activation
# checkpointing, bf16 activations, and splitting the sequence or the layers
# (Chapters 10 and 11) take over. The prediction leaves out what a real GPU
# adds: the caching allocator's slack, CUDA and NCCL workspaces.
# torchtitan's FSDP2 notes report that on some Llama-7B runs on 8 H100s it
# peaked 7% lower than FSDP1:

# %%
note = reference.published("torchtitan.fsdp2_vs_fsdp1_peak_memory_reduction_percent")
print(f"FSDP2 vs FSDP1 peak memory: -{note.value}% [{note.label}]")

# %% [markdown]
# With a GPU, an FSDP2 model of 8 layers of width 1024 trains on it here -
# one rank on one GPU, one rank per GPU on two - and the allocator's peak
# (`torch.cuda.max_memory_allocated`) prints beside the tracker's count of
# the same (second) step: the difference is the allocator's rounding and
# its workspaces. `make record` on a GPU machine stores it for learners
# without one; none is recorded yet.

# %%
def gpu_peak_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dev = rank_device(rank)
    mesh = init_device_mesh(dev.type, (world_size,))
    model = shard_blocks(make_blocks(width=1024, depth=8).to(dev), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = (t.to(dev) for t in batch(rank, width=1024, rows=64))
    step = functools.partial(train, model, opt, x, y)
    step()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    counted = memory.track_step(step, x, y, fsdp_model=model, optimizer=opt)["total"]
    torch.cuda.synchronize(dev)
    return counted, torch.cuda.max_memory_allocated(dev)


n_gpu = min(GPUS, 2)
name = f"09.fsdp2_8x1024_peak_bytes_{max(n_gpu, 1)}gpu"
if n_gpu:  # one rank per GPU: nccl
    counted, allocated = launch(gpu_peak_rank, n_gpu, timeout=120)[0].value
    print(f"{n_gpu} GPU(s): tracker {format_bytes(counted)}, allocator peak "
          f"{format_bytes(allocated)} per rank")
    reference.record(name, allocated, "B", "cuda:0")
else:
    print("no GPU: with one, this cell trains the model on it (one rank per GPU, "
          "at most 2) and prints the tracker's count beside the allocator's peak")
figures = reference.show(name, unit="B", fmt="{:.4g}", figures=[reference.predicted(
    (1024 * 1024 + 1024) * 8 * 16 / max(n_gpu, 1), "B",
    f"{max(n_gpu, 1)} GPU(s), any kind", "model states only: 16 bytes per parameter "
    f"(fp32 weight, gradient, Adam's 2 moments), sharded over {max(n_gpu, 1)} rank(s)",
    caveat="not calibrated: activations, the allocator's rounding and NCCL's "
    "buffers are left out, so a GPU's peak is higher")])

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
#   all-gathers bf16 (test it by its losses: Adam turns rounding into
#   steps of the learning rate); HSDP shards within and replicates across a
#   2-D mesh. In practice: initialise on the meta device, clip with
#   `clip_grad_norm_`, accumulate with `set_requires_gradient_sync(False)`,
#   wrap for checkpointing before `fully_shard`; build the optimizer after
#   sharding; save with DCP or a full state dict.
# - On GPUs the launcher's groups are `cpu:gloo,cuda:nccl`: CPU tensors
#   (offloading, checkpoints, a CPU collective) need the gloo half.
# - DCP checkpoints reshard on load: saved by 2 ranks, loaded by 4.
# - A fake process group with fake tensors predicts a 7B model's memory per
#   GPU from the real code, on the second step (the first has no optimizer
#   state yet); beyond a few GPUs the activations dominate.

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
# The checker runs it on 2 and on 3 ranks with odd sizes, in float32,
# float64 and bfloat16, against one process, and names whatever your
# forward keeps besides `x` and the shards.

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
# ### Exercise 9.3: clip gradients you hold a slice of
#
# Section 4 clipped FSDP2's gradients with `clip_grad_norm_`, which does the
# work behind the scenes. Build it for the flat shards of section 2: each
# rank holds only its slice of every (mean) gradient, zero-padded, as
# `Zero.shards[i].grad` are. Write `clip_sharded_grads(grad_shards,
# max_norm)`: return the L2 norm of the **whole model's** gradient as a
# float, the same on every rank, and scale every shard **in place** by
# `max_norm / (norm + 1e-6)` when that factor is below 1, as
# `clip_grad_norm_` does. The checker runs it on 2 and 3 ranks, with
# float32, float64 and bfloat16 gradients, against that rule applied to the
# full gradients in one process.

# %% tags=["exercise"] exercise="9.3"
def clip_sharded_grads(grad_shards, max_norm):
    ### BEGIN SOLUTION
    squares = torch.stack([g.double().pow(2).sum() for g in grad_shards]).sum()
    squares = squares.cpu()  # a CPU tensor: the launcher's groups all carry one
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    for g in grad_shards:
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm
    ### END SOLUTION


# %% tags=["check"] exercise="9.3"
check_clip_sharded(clip_sharded_grads)

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

# %%
tidy_up()  # the last cell: the chapter's temporary folder goes
