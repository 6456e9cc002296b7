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
# # Chapter 6: DistributedDataParallel
#
# **What you will learn**
#
# - Why data parallel training runs **one process per device**, and what rank,
#   world size and local rank mean; how `torchrun` (one node or several) and a
#   notebook launcher start the processes.
# - Why DDP *is* big-batch training, shown numerically, and how
#   `DistributedSampler` and `set_epoch` shard the data.
# - The collectives, what they cost, the key-value stores underneath, and a
#   ring all-reduce built from send and recv.
# - Checkpoints and logged losses done right.
# - DDP in practice: `no_sync`, unused parameters, BatchNorm buffers, the
#   gradient buckets DDP really builds, hangs, elastic restarts, and what more
#   ranks buy.
#
# **Hardware.** Everything runs on a laptop: the ranks are CPU processes
# talking `gloo` over the loopback network. With a GPU per rank they use
# `nccl` and the collectives are timed on the GPUs; with fewer GPUs, the ranks
# stay on the CPU. Timing cells show labelled published and predicted GPU
# figures beside the local ones.

# %%
import contextlib
import os
import runpy
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import constants
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

from course_utils import banner, for_device, predict, reference
from course_utils.checks.ch06 import (
    check_average_gradients,
    check_ring_all_reduce,
    check_save_then_load,
)
from course_utils.cleanup import scratch_folder, tidy_up
from course_utils.compare import compare
from course_utils.ddp_demos import (
    leftover_processes,
    quiet_stderr,
    run_command,
    scaling_slider,
    show_allreduce_sweep,
    show_buckets,
    show_throughput,
)
from course_utils.devices import usable_cores
from course_utils.dist import LaunchTimeout, free_port, launch

banner();

# %% [markdown]
# ## 1. One process per device
#
# Data parallel training keeps a full copy of the model on every device and
# gives each copy a different slice of every batch. `DistributedDataParallel`
# (DDP) runs **one operating-system process per device**. Each process is a
# *rank*, numbered `0 .. world_size - 1`. On several machines ("nodes") the
# *local rank* numbers the processes of one node, and it, not the global rank,
# picks the GPU: rank 9 on the second of two 8-GPU nodes uses `cuda:1`. (The
# seed slides write `torch.device('cuda', rank)`, which fails on every node but
# the first.)
#
# Processes, not threads: each has its own GIL, so the ranks' Python work runs
# in parallel; they share nothing and exchange gradients through a *backend*
# (`nccl` between GPUs, `gloo` between CPUs). `launch(fn, nprocs)` from
# `course_utils.dist` starts them from this notebook, sets up a process group
# in each, calls `fn(rank, world_size)` and returns what each rank returned.

# %%
gpus = torch.cuda.device_count()  # 0 without a GPU


def rank_device(rank):
    """The device of this rank: its own GPU under nccl, the CPU under gloo."""
    if "nccl" in dist.get_backend():
        return torch.device("cuda", rank)
    return torch.device("cpu")


def hello(rank, world_size):
    print(f"I am rank {rank} of {world_size}, process {os.getpid()}, "
          f"backend {dist.get_backend()}, device {rank_device(rank)}")
    return os.getpid()


start = time.perf_counter()
results = launch(hello, nprocs=2)
print("notebook process:", os.getpid(), "- rank processes:", [r.value for r in results])
# this machine's start-up time now, busy or not: the demos below wait a multiple
STARTUP_S = time.perf_counter() - start
LIMIT_S = round(min(90, max(30, 15 * STARTUP_S)))  # whole seconds

# %% [markdown]
# Every rank ran the *same* function and learned its part from its rank: the
# SPMD style (single program, multiple data). The launcher forks its ranks from
# a **forkserver** (a fresh interpreter that never runs this notebook's cells)
# and sends the function by value, so notebook functions work and ranks may
# use their GPUs after the notebook used CUDA. It stops every rank on a timeout
# or when one fails: a dead rank leaves the others waiting in their next
# collective.

# %%
def stuck(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 gives up before the all_reduce")
    # only rank 0 gets here, and waits for rank 1, which will never come
    dist.all_reduce(torch.ones(1, device=rank_device(rank)))


try:
    launch(stuck, nprocs=2, timeout=20)
except Exception as e:
    print(f"{type(e).__name__}: {str(e).splitlines()[0]}")

# %% [markdown]
# ## 2. torchrun: the launcher for scripts
#
# Real training is a script started with `torchrun`. It starts
# `--nproc_per_node` copies and tells each who it is through environment
# variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
# `MASTER_ADDR`, `MASTER_PORT`), which `init_process_group()` reads. The old
# `python -m torch.distributed.launch` that the seed slides also list is
# deprecated: it passes the local rank as an argument, `--local-rank=N` since
# torch 2.0 and `--local_rank=N` before, so its scripts must accept both.
# torchrun passes nothing on the command line.
#
# The script below is a complete DDP training run; every line of it returns
# later in this chapter.

# %%
# ruff: noqa: F811 - the scripts below repeat the imports, as standalone files must
WORK = scratch_folder("ch06-")  # scripts and checkpoints; removed with the chapter
SCRIPT = WORK / "train_ddp.py"

# %%
# %%writefile {SCRIPT}
"""Train a tiny regression model with DDP. Start it with torchrun."""
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(epochs=3):
    local_rank = int(os.environ["LOCAL_RANK"])
    gpus_here = torch.cuda.device_count()
    use_gpu = gpus_here >= int(os.environ["LOCAL_WORLD_SIZE"])  # one GPU per rank
    device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo",  # reads the env vars
                            device_id=device if use_gpu else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same data set on every rank
    x = torch.randn(256, 8)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(256, 1)
    data = TensorDataset(x, y)  # inputs and targets travel together
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # this rank's share
    loader = DataLoader(data, batch_size=16, sampler=sampler)  # 16 per rank

    model = DDP(nn.Linear(8, 1).to(device),  # move first, then wrap
                device_ids=[local_rank] if use_gpu else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch
        total = torch.zeros(2, device=device)  # sum of losses, number of samples
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
            total += torch.stack([loss.detach() * len(xb),
                                  torch.tensor(len(xb), device=device)])
        dist.all_reduce(total)  # every rank must call it, or all wait forever
        if rank == 0:
            print(f"epoch {epoch}: mean loss {(total[0] / total[1]).item():.4f} "
                  f"over {int(total[1])} samples")

    checkpoint = Path(__file__).with_name("checkpoint.pt")
    if rank == 0:  # one writer; the .module inside DDP has the plain names
        torch.save(model.module.state_dict(), checkpoint)
    dist.barrier()  # nobody reads before rank 0 has finished writing
    state = torch.load(checkpoint, map_location=device, weights_only=True)
    model.module.load_state_dict(state)
    print(f"rank {rank} of {world_size} (local rank {local_rank}, node "
          f"{os.environ.get('GROUP_RANK', '0')}): weight[:3] = "
          f"{[round(w, 4) for w in model.module.weight[0, :3].tolist()]}")
    del model  # free DDP before its process group (see the note below the run)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# %% [markdown]
# Run it with `torchrun --standalone --nproc_per_node=2`, here as
# `python -m torch.distributed.run` with this notebook's Python. `--standalone`
# runs the rendezvous on this machine; `--tee=3` copies each worker's output
# to torchrun's, prefixed with its local rank. By default each worker is a
# fresh Python importing torch again; `--run-path --start-method=fork`
# forks them from torchrun instead.

# %%
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
start = time.perf_counter()
run_command(TORCHRUN + ["--standalone", "--nproc_per_node=2", "--tee=3", "--run-path",
                        "--start-method=fork", SCRIPT],
            WORK, LIMIT_S, attempts=2)  # see below: a rare crash at exit
print(f"torchrun took {time.perf_counter() - start:.1f} s in all")

# %% [markdown]
# Both ranks print the same weights: they started from the same seed, DDP
# broadcast rank 0's parameters when it wrapped the model, and every step
# applied the same averaged gradient.
#
# **Corrections to the seed slides.** The model is moved to its device
# *before* DDP wraps it, with `device_ids=[local_rank]`: DDP sets up its
# buckets and broadcasts the parameters where they are at construction (the
# slides wrap, then move). The targets come from the same `TensorDataset` as
# the inputs, so the sampler shards them together (the slides' separate
# `get_target_tensor()` would not match each rank's inputs). The logged loss is
# averaged over all ranks' samples, not rank 0's alone. And the slides'
# `optim = optim.Adam(...)` rebinds the `torch.optim` module's name: the next
# `optim.` call breaks, and inside a function it raises `UnboundLocalError`.
# Newer than the slides: `init_process_group(device_id=...)` binds each rank to
# its GPU, so that `barrier` (no tensor to go by) knows which one to use.
#
# **Two shutdown traps (torch 2.13, gloo).** The script frees the DDP model
# before `destroy_process_group()`: otherwise the reducer, the group's last
# holder, destroys it when `main()` returns, under the GIL, and gloo's
# destructor can wait for a thread that needs the GIL (3 hangs in 150 launches
# here without the `del`, none in 350 with it; PyTorch issue 56297). And a
# finished worker rarely dies at shutdown with `terminate called without an
# active exception` (once in about 75 runs here; compare issue 190489), which
# torchrun reports as a failure: the cell above tries once more.

# %% [markdown]
# ## 3. Sharding the data: `DistributedSampler` and `set_epoch`
#
# Each rank must see a different part of every epoch, or the ranks compute the
# same gradient twice. `DistributedSampler` shuffles the indices with a seed,
# pads them to divide evenly, and gives rank `r` every `world_size`-th index
# from `r`. So the `DataLoader`'s `batch_size` is **per rank**: two ranks with
# `batch_size=16` train with a global batch of 32. (With `nn.DataParallel`,
# which the seed notes describe, one batch is split across the GPUs.)
#
# The shuffle is seeded with `seed + epoch`, and the sampler knows the epoch
# only through `set_epoch`: forget it and every epoch has the same order. Given
# `num_replicas` and `rank`, the sampler needs no process group:

# %%
numbers = TensorDataset(torch.arange(12))


def indices_per_epoch(rank, world_size, epochs, call_set_epoch):
    sampler = DistributedSampler(numbers, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


for call_set_epoch in (True, False):
    print(f"set_epoch called: {call_set_epoch}")
    per_rank = [indices_per_epoch(r, 2, 3, call_set_epoch) for r in range(2)]
    for epoch in range(3):
        print(f"  epoch {epoch}: rank 0 gets {per_rank[0][epoch]}, "
              f"rank 1 gets {per_rank[1][epoch]}")
shares = [list(DistributedSampler(TensorDataset(torch.arange(10)), num_replicas=4,
                                  rank=r, shuffle=False)) for r in range(4)]
print("10 samples on 4 ranks:", shares, "- samples seen twice:",
      sum(map(len, shares)) - 10)

# %% [markdown]
# With `set_epoch` the order changes each epoch; without it the epochs are
# identical. The ranks' indices are disjoint and cover the data; when it does
# not divide evenly the sampler repeats a few samples, so that every rank runs
# as many steps (a rank with a step fewer would leave the others waiting).
#
# ## 4. DDP is big-batch training
#
# The loss of a batch is a mean over its samples, and the gradient of a mean is
# the mean of the gradients. If rank `r` computes the gradient $g_r$ of the
# mean loss over its half of the batch, $(g_0 + g_1) / 2$ is the gradient over
# the whole batch. DDP computes exactly that in `loss.backward()`: it
# **all-reduces** (sums across ranks) the gradients, in buckets that overlap
# the rest of the backward pass, and divides by the world size. (The seed notes
# describe the losses being averaged and then one backward pass: that is
# `nn.DataParallel`, Chapter 5, which gathers the outputs on one GPU. Under DDP
# each rank back-propagates its own loss; only gradients are averaged.)
#
# The proof: train one model on the full batch in this process, and the same
# model with two DDP ranks on half the batch each.

# %%
STEPS = 4


def make_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    return model, x, y


def train(model, x, y, steps):
    """SGD on (x, y); the gradients of step 0 and the parameters after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads0, params = None, []
    for step in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            grads0 = [p.grad.clone() for p in model.parameters()]
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return grads0, params


def train_ddp(rank, world_size, steps):
    model, x, y = make_problem()
    d = rank_device(rank)
    share = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
    ddp = DDP(model.to(d), device_ids=[rank] if d.type == "cuda" else None)
    return train(ddp, x[share].to(d), y[share].to(d), steps)


single = train(*make_problem(), STEPS)
ranks = [r.value for r in launch(train_ddp, nprocs=2, args=(STEPS,))]


def max_diff(a, b):
    return max((u - v).abs().max().item() for u, v in zip(a, b, strict=True))


print(f"step 0 gradients, rank 0 vs one process: {max_diff(ranks[0][0], single[0]):.2e}")
for step in (0, STEPS - 1):
    print(f"parameters after step {step}: rank 0 vs one process "
          f"{max_diff(ranks[0][1][step], single[1][step]):.2e}, rank 0 vs rank 1 "
          f"{max_diff(ranks[0][1][step], ranks[1][1][step]):.2e}")
print(f"(float32 resolves about {torch.finfo(torch.float32).eps:.1e} of a value)")

# %% [markdown]
# The differences to one process are float32 rounding (another summation order
# rounds differently); the two ranks agree exactly, having applied the same
# averaged gradient. Exactness needs a **mean** loss per rank and shares of the
# **same size** (DDP divides by the world size, not the sample count). Average
# the gradients of two shares split evenly, then unevenly:

# %%
def mean_of_share_gradients(cut):
    """The average of the gradients of the mean loss on x[:cut] and on x[cut:]."""
    model, x, y = make_problem()
    grads = []
    for share in (slice(0, cut), slice(cut, len(x))):
        model.zero_grad()
        nn.functional.mse_loss(model(x[share]), y[share]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return [(a + b) / 2 for a, b in zip(*grads, strict=True)]


for cut in (16, 24):
    print(f"shares of {cut} and {32 - cut} samples: differs from the full batch's "
          f"gradient by {max_diff(mean_of_share_gradients(cut), single[0]):.2e}")

# %% [markdown]
# Uneven shares give another gradient (the smaller share's samples weigh
# more): one more reason the sampler pads. The learning rate belongs to the
# *global* batch, which doubles with the ranks at a fixed per-rank batch.
#
# `nn.DataParallel` (Chapter 5) reaches the same gradients with **one**
# process, one thread per GPU sharing one GIL, replicating the model every step
# and gathering outputs on GPU 0; DDP avoids both costs and works across
# machines, which is why PyTorch recommends it even on one machine. What DDP
# does not save, as the seed notes rightly say, is memory: every rank holds the
# whole model, its gradients and optimizer state. Sharded data parallelism
# (ZeRO, FSDP) splits those, building on the reduce_scatter below.
#
# ## 5. The collectives
#
# *Collectives* are called by every rank of a group and complete only when all
# have called them. Output tensors must be allocated, of the right size,
# before the call. **broadcast** copies `src`'s tensor to every rank;
# **all_reduce** combines every rank's tensor (sum, max, ...) and leaves the
# result on all, *in the same tensor*: the input is overwritten (the seed
# slides call it an input only). **reduce** leaves it on one rank.

# %%
def broadcast_and_reduce(rank, world_size):
    d = rank_device(rank)
    t = torch.tensor([10.0 * rank], device=d)
    dist.broadcast(t, src=1)
    print("broadcast from rank 1:", t.tolist())
    t = torch.tensor([rank + 1.0, 2.0 * rank], device=d)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # in place
    print("all_reduce sum:", t.tolist())
    t = torch.tensor([rank + 1.0], device=d)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    print("all_reduce max:", t.tolist())
    t = torch.tensor([rank + 1.0], device=d)
    dist.reduce(t, dst=0)  # only rank 0's tensor holds the sum afterwards
    print("reduce to rank 0:", t.tolist())


_ = launch(broadcast_and_reduce, nprocs=2)

# %% [markdown]
# **all_gather** gives every rank the list of all ranks' tensors; **gather**
# gives it to one rank. **scatter** sends a different piece to each rank.
# **reduce_scatter** sums the ranks' lists element-wise and gives piece `r` to
# rank `r`. An all_reduce is a reduce_scatter followed by an all_gather: that
# is the ring all-reduce you build in Exercise 6.2.

# %%
def gather_and_scatter(rank, world_size):
    d = rank_device(rank)
    mine = torch.tensor([rank * 1.0, rank * 1.0 + 0.5], device=d)
    everyone = [torch.zeros(2, device=d) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    print("all_gather:", [t.tolist() for t in everyone])
    at_root = [torch.zeros(2, device=d) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, gather_list=at_root, dst=0)
    print("gather to rank 0:", [t.tolist() for t in at_root] if at_root else None)
    piece = torch.zeros(1, device=d)
    pieces = [torch.tensor([100.0 + r], device=d) for r in range(world_size)]
    dist.scatter(piece, scatter_list=pieces if rank == 0 else None, src=0)
    print("scatter from rank 0:", piece.tolist())
    out = torch.zeros(1, device=d)
    dist.reduce_scatter(out, [torch.tensor([rank + 10.0 * r], device=d)
                              for r in range(world_size)])
    print("reduce_scatter:", out.tolist())


_ = launch(gather_and_scatter, nprocs=2)

# %% [markdown]
# **barrier** waits until every rank has reached it. **send** and **recv** are
# point to point, into a tensor the receiver allocated. Under gloo `send`
# returns once the tensor may be reused and `recv` once the data has arrived;
# `isend` and `irecv` return at once, with a handle to `wait()` on. (Under
# nccl every call returns once queued on the GPU's stream.)

# %%
def barrier_and_p2p(rank, world_size):
    d = rank_device(rank)
    time.sleep(0.3 * rank)
    start = time.perf_counter()
    dist.barrier()
    print(f"waited {time.perf_counter() - start:.2f} s at the barrier")
    if rank == 0:
        dist.send(torch.arange(3.0, device=d), dst=1)
    else:
        box = torch.zeros(3, device=d)
        dist.recv(box, src=0)
        print("received from rank 0:", box.tolist())


_ = launch(barrier_and_p2p, nprocs=2)

# %% [markdown]
# Rank 1 slept 0.3 s, so rank 0 waited about that long at the barrier.
#
# The **`*_object` variants** move any picklable object:
# `broadcast_object_list`, `all_gather_object`, `gather_object`,
# `scatter_object_list`, `send_object_list`, `recv_object_list`. There is no
# `reduce_object`, whatever the seed slides say (what would "sum" mean for
# any object?). They need picklable objects on *every* backend, not only nccl
# (under nccl the bytes also pass through GPU memory, so each rank must have
# called `torch.cuda.set_device`). They cost more: pickling, a first collective
# for the sizes, then the bytes. Unpickling runs code: trusted peers only.

# %%
def objects(rank, world_size):
    config = [{"lr": 0.1, "note": "from rank 0"}] if rank == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    print("broadcast_object_list:", config)
    d = rank_device(rank)
    t = torch.zeros(256, device=d)
    timings = {}
    for name, call in [
            ("all_gather of a tensor", lambda: dist.all_gather(
                [torch.empty_like(t) for _ in range(world_size)], t)),
            # a CPU copy: a pickled CUDA tensor unpickles onto the sender's GPU
            ("all_gather_object of the same values", lambda: dist.all_gather_object(
                [None] * world_size, t.cpu()))]:
        call()  # warm-up
        if d.type == "cuda":
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        for _ in range(50):
            call()
        if d.type == "cuda":  # nccl calls return before the GPU has finished
            torch.cuda.synchronize(d)
        timings[name] = (time.perf_counter() - start) / 50
    return timings


timings = launch(objects, nprocs=2)[0].value
for name, seconds in timings.items():
    print(f"{name:38s} {seconds * 1e6:8.1f} us per call")

# %% [markdown]
# ### What a collective costs
#
# For a message of $S$ bytes taking $t$ seconds, the **algorithmic bandwidth**
# is $S / t$. A ring all-reduce sends and receives $2(n-1)/n \cdot S$ bytes per
# rank, so the **bus bandwidth** $2(n-1)/n \cdot S/t$ is what the links
# carried: the figure to compare with a link's speed (nccl-tests reports
# both). With two ranks the factor is 1; with 8 GPUs, 1.75.
#
# A fixed latency per call dominates small messages; large ones approach the
# link's bandwidth (on the plot: a flat start, then a slope of one). The ranks
# meet at a barrier, then each times a burst of all_reduces, as nccl-tests
# does. A pause of one rank makes the other wait, so the table gives the
# **fastest** burst (what ranks and links can do) beside the **median** (what
# you typically get here).

# %%
REPEATS = 9


def time_all_reduce(rank, world_size, repeats):
    d = rank_device(rank)
    # bytes of float32: 1 KiB .. 4 MiB on CPUs, .. 256 MiB on GPUs
    sizes = [2**k for k in range(10, for_device(d, cpu=23, gpu=29), 3)]
    rows = []
    for size in sizes:
        t = torch.ones(size // 4, device=d)
        dist.all_reduce(t)  # warm-up (and connection set-up)
        calls = max(2, min(32, 2**21 // size))  # a burst of a millisecond or two on a CPU
        times = []
        for _ in range(repeats):
            dist.barrier()
            if d.type == "cuda":
                torch.cuda.synchronize(d)
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t)
            if d.type == "cuda":  # nccl calls return before the GPU has finished
                torch.cuda.synchronize(d)
            times.append((time.perf_counter() - start) / calls)
        times.sort()
        n = len(times)  # fastest, median, and the quartiles
        rows.append((size, times[0], times[n // 2], times[n // 4], times[3 * n // 4]))
    if d.type == "cuda" and rank == 0:  # recorded by the rank that measured it
        reference.record("06.allreduce_2gpu", [list(r) for r in rows],
                         "[bytes, fastest s, median s, quartiles s]", d,
                         note=f"2 ranks, nccl, {repeats} bursts per size")
    return dist.get_backend(), rows


backend, rows = launch(time_all_reduce, nprocs=2, args=(REPEATS,))[0].value
show_allreduce_sweep(rows, backend)

# %% [markdown]
# ## 6. Key-value stores
#
# Before any collective, the ranks must find each other, through a small
# **key-value store** all can reach. `init_process_group` creates a `TCPStore`
# from `MASTER_ADDR:MASTER_PORT` (a server in rank 0, clients over TCP: works
# across machines). A `FileStore` is a file all ranks can open (one machine or
# a shared file system); a `HashStore` lives inside one process, for threads.
# You can use them yourself, to share small values or wait for a signal:

# %%
def stores(rank, world_size, port, path):
    tcp = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0))
    tcp.add("arrived", 1)  # an atomic counter
    tcp.set(f"address/{rank}", f"rank {rank} lives in process {os.getpid()}")
    tcp.wait([f"address/{1 - rank}"])  # block until the other rank has written,
    # and so has counted itself: it adds before it sets
    print("TCPStore:", tcp.get(f"address/{1 - rank}").decode(), "| counter =",
          tcp.add("arrived", 0))
    files = dist.FileStore(str(path), world_size)
    dist.init_process_group("gloo", store=files, rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print("all_reduce over a group that met through a FileStore:", t.item())
    dist.destroy_process_group()


(WORK / "filestore").unlink(missing_ok=True)  # a fresh store on every run
_ = launch(stores, nprocs=2, args=(free_port(), WORK / "filestore"), init=False,
           backend="gloo")  # the group below is gloo's, on every machine
hashes = dist.HashStore()  # in this process only
hashes.set("epoch", "3")
print("HashStore:", hashes.get("epoch"))

# %% [markdown]
# ## 7. Checkpoints and logged losses
#
# **Saving.** All ranks hold the same parameters, so only rank 0 writes (two
# writers can corrupt one file), and the others wait at a `barrier` until the
# file is complete. Save `ddp_model.module.state_dict()`: the wrapper's own
# prefixes every name with `module.`.
#
# **Loading.** `torch.save` records each tensor's device. Without
# `map_location`, a checkpoint saved from `cuda:0` loads onto `cuda:0` in
# every rank (GPU 0 runs out of memory first), and one saved from `cuda:3`
# does not load at all on a machine with fewer GPUs. Pass `map_location` (the
# rank's device) and `weights_only=True` (only tensors and plain containers
# are unpickled; the default since torch 2.6). The seed slides use neither.

# %%
def own_device(rank):
    """Rank's GPU (shared when there are fewer GPUs than ranks), else the CPU."""
    n = torch.cuda.device_count()
    return torch.device("cuda", rank % n) if n else torch.device("cpu")


def checkpoint_round_trip(rank, world_size, path):
    d = own_device(rank)
    torch.manual_seed(rank)  # different weights on each rank, to see the load work
    model = nn.Linear(3, 1).to(d)
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    naive = torch.load(path, weights_only=True)  # no map_location
    state = torch.load(path, map_location=d, weights_only=True)
    model.load_state_dict(state)
    return (str(d), str(naive["weight"].device), str(state["weight"].device),
            model.weight.detach().cpu())


loaded = [r.value for r in launch(checkpoint_round_trip, nprocs=2,
                                  args=(WORK / "round_trip.pt",))]
for rank, (own, naive, mapped, _) in enumerate(loaded):
    print(f"rank {rank} (device {own}): loaded without map_location onto {naive}, "
          f"with it onto {mapped}")
print("rank 1 now holds rank 0's weights:", torch.equal(loaded[0][3], loaded[1][3]))

# %% [markdown]
# (Without a GPU every tensor was saved from the CPU, so `map_location`
# changes nothing here; with GPUs, rank 1 loads onto `cuda:0` without it.)
#
# **Logging a loss.** Each rank's loss covers its share only: all-reduce it and
# divide by the world size. That is a collective, so *every* rank calls it,
# even if only rank 0 prints. Work on a detached copy: the seed's
# `print_averaged_value(value)` all-reduces the caller's tensor in place, and
# if that is the loss and `backward()` follows, torch warns of "silently
# incorrect behavior".

# %%
def averaged_for_logging(loss):
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def log_loss(rank, world_size):
    w = torch.tensor(float(rank + 1), device=rank_device(rank), requires_grad=True)
    loss = w * 2  # 2.0 on rank 0, 4.0 on rank 1
    mean = averaged_for_logging(loss)
    return loss.item(), mean.item()


values = [r.value for r in launch(log_loss, nprocs=2)]
print("local losses", [v[0] for v in values], "- logged mean on every rank",
      [v[1] for v in values])

# %% [markdown]
# ## 8. Several nodes
#
# On a cluster, torchrun runs once on **each node** with the same arguments.
# `--nnodes` says how many nodes take part, and a *rendezvous* lets the
# torchrun agents find each other and agree on the ranks. With
# `--rdzv_backend=c10d` one agent hosts a store at `--rdzv_endpoint` (usually
# the first node) and the rendezvous numbers the nodes itself, so
# `--node_rank` is ignored; it matters for the older static rendezvous
# (`--master_addr`, `--master_port`, `--node_rank`). A c10d rendezvous also
# lets a restarted job take in nodes that replace failed ones.
#
# `torchrun` is a thin command line over
# `torch.distributed.launcher.api.elastic_launch`, which runs the *agent*: it
# joins the rendezvous, then starts and watches the workers. Below, each of two
# "nodes" is a forked process running that very agent code, with forked
# workers as in section 2.

# %%
def run_path(path):
    """A worker's entry point: the script, run as torchrun would run it."""
    runpy.run_path(str(path), run_name="__main__")


def node(index, nodes, endpoint, path):
    """Node ``index`` of ``nodes``: torchrun's agent, for one worker, in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(gpus)))
    # each "node" sees only its own GPU, as a real machine would; none if short
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if gpus >= 2 else ""
    tempfile.tempdir = str(WORK)  # the agent's log and error files go with WORK
    config = LaunchConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=1,
                          rdzv_backend="c10d", rdzv_endpoint=endpoint,
                          run_id="ch06", max_restarts=0, start_method="fork")
    elastic_launch(config, run_path)(path)  # = torchrun's main()


endpoint = f"127.0.0.1:{free_port()}"
print("$ torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d "
      f"--rdzv_endpoint={endpoint} --rdzv_id=ch06 {SCRIPT.name}  # on each node")
start = time.perf_counter()
try:
    finished = launch(node, nprocs=2, args=(endpoint, SCRIPT), init=False,
                      timeout=LIMIT_S, echo=False)
except LaunchTimeout:
    print(f"load {os.getloadavg()[0]:.1f} on {usable_cores()} cores: if that is more "
          "than the cores, the machine was busy - run the cell again")
    raise
for i, r in enumerate(finished):
    print(*(f"[node {i}] {line}" for line in r.stdout.splitlines()), sep="\n")
print(f"the two nodes took {time.perf_counter() - start:.1f} s in all")
print("ranks, agents or workers still running:", leftover_processes() or "none")

# %% [markdown]
# Each node printed the same weights; the c10d rendezvous numbered the nodes
# (by host name and process id). Rank 1 read the checkpoint rank 0 wrote
# because both "nodes" share a file system, as a cluster's checkpoint
# directory must. No process was left behind (the launcher's forkserver and
# multiprocessing's resource tracker stay by design). On a cluster the
# scheduler starts one torchrun per node; a Slurm script for two nodes of 8
# GPUs (shown, not run):
#
# ```bash
# # #!/bin/bash
# #SBATCH --nodes=2
# #SBATCH --ntasks-per-node=1
# #SBATCH --gpus-per-node=8
# #SBATCH --time=01:00:00
# head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# srun torchrun --nnodes="$SLURM_NNODES" --nproc_per_node=8 \
#     --rdzv_backend=c10d --rdzv_endpoint="$head:29500" --rdzv_id="$SLURM_JOB_ID" \
#     train_ddp.py
# ```
#
# `srun` runs torchrun once per node; the 16 ranks meet at the first node,
# whose port 29500 the others must reach. The script is unchanged: that is
# why it reads its rank from the environment.
#
# ## 9. DDP in practice
#
# Real training runs add a handful of things to the script of section 2. Each
# is shown on CPU ranks with `gloo` and works the same on GPUs with `nccl`.
#
# ### Gradient accumulation and `no_sync()`
#
# When the batch you want does not fit, run `k` micro-batches, let their
# gradients add up in `.grad` (each loss divided by `k`), and step once. Under
# DDP every `backward()` all-reduces, wasted for the first `k - 1`
# micro-batches. Inside `with ddp_model.no_sync():` a backward pass only
# accumulates; the next one outside all-reduces the sum. A *communication
# hook* (DDP's way to wrap its all-reduce) counts the calls.

# %%
def accumulate(rank, world_size, k, use_no_sync):
    """k micro-batches on this rank's share of the batch of section 4, one step."""
    model, x, y = make_problem()
    ddp = DDP(model)
    buckets_reduced = []

    def counting_hook(group, bucket):  # wraps DDP's default all-reduce
        buckets_reduced.append(bucket.index())
        return default_hooks.allreduce_hook(group, bucket)

    ddp.register_comm_hook(None, counting_hook)
    share = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
    micro = list(zip(x[share].chunk(k), y[share].chunk(k), strict=True))
    for i, (xb, yb) in enumerate(micro):
        last = i == k - 1
        quiet = ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext()
        with quiet:
            (nn.functional.mse_loss(ddp(xb), yb) / k).backward()
    return [p.grad.clone() for p in model.parameters()], len(buckets_reduced)


K = 4
for use_no_sync in (False, True):
    grads, reductions = launch(accumulate, nprocs=2, args=(K, use_no_sync),
                               backend="gloo", echo=False)[0].value
    print(f"{K} micro-batches per rank, no_sync {'used' if use_no_sync else 'not used'}:"
          f" {reductions} all-reduce call{'s' if reductions > 1 else ''}, gradient "
          f"differs from the full batch's by {max_diff(grads, single[0]):.1e}")

# %% [markdown]
# Both give the full batch's gradient: averaging is linear, so averaging every
# micro-batch or only their sum is the same, and `no_sync()` saves `k - 1` of
# every `k` all-reduces.
#
# ### Parameters that get no gradient
#
# DDP all-reduces a bucket when every parameter in it has its gradient. A
# parameter the forward pass did not use never gets one, its bucket never
# completes, and DDP stops at the next iteration. A model with two heads, of
# which each step uses one, is the classic case:

# %%
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head_a, self.head_b = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x, task="a"):
        head = self.head_a if task == "a" else self.head_b
        return head(torch.tanh(self.body(x)))


def two_heads(rank, world_size):
    outcome = {}
    for options in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        torch.manual_seed(0)
        ddp = DDP(TwoHeads(), **options)
        steps = 0
        try:
            while steps < 3:
                ddp(torch.randn(4, 4)).sum().backward()  # head_b is never used
                steps += 1
            outcome[str(options)] = "3 steps ran"
        except RuntimeError as e:
            outcome[str(options)] = f"step {steps}: {str(e).split('. ')[0]}"
    return outcome


for options, what in launch(two_heads, nprocs=2, backend="gloo",
                            echo=False)[0].value.items():
    print(f"DDP(model, **{options}): {what}")

# %% [markdown]
# `find_unused_parameters=True` walks the autograd graph after every forward
# to mark the unused parameters ready: it copes with a set that changes each
# step, at the cost of that walk. `static_graph=True` promises the same set
# (and gradient order) every iteration; DDP learns it once. Both are off by
# default, since most models use every parameter.
#
# ### BatchNorm buffers under DDP
#
# `BatchNorm` normalises with the statistics of the batch it sees, each rank's
# share, and its running statistics are buffers, which no gradient all-reduce
# touches. DDP syncs buffers by broadcasting rank 0's, at two moments: once
# when it wraps the model (with the parameters), and at the start of every
# forward pass. Since torch 2.13 `forward_sync_buffers` controls the second
# only; the deprecated `broadcast_buffers=False` switched off both, so the
# replacement's `False` is not the same thing. Below, each rank writes its own
# number into `running_mean` before wrapping, and the two ranks' shares come
# from different distributions, as with badly shuffled data:

# %%
def batchnorm_under_ddp(rank, world_size):
    torch.manual_seed(0)
    x = torch.randn(32, 3) + torch.tensor([0.0, 5.0, -5.0])
    x[16:] += 2.0  # the second half differs
    d = rank_device(rank)
    mine = x[rank * 16:(rank + 1) * 16].to(d)
    seen = {}
    for options in ({}, {"forward_sync_buffers": False}, {"broadcast_buffers": False}):
        bn = nn.BatchNorm1d(3, momentum=None).to(d)  # momentum=None: a plain mean
        bn.running_mean.fill_(float(rank))  # a rank-local value
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(bn, device_ids=[rank] if d.type == "cuda" else None, **options)
        wrapped = bn.running_mean[0].item()
        ddp(mine)
        ddp(mine)  # under forward sync, this one starts from rank 0's buffers
        seen[str(options)] = (wrapped, bn.running_mean[0].item(),
                              len([w for w in caught if "deprecated" in str(w.message)]))
    sums = torch.stack([mine.sum(0), torch.full((3,), 16.0, device=d)])
    dist.all_reduce(sums)  # SyncBatchNorm's statistics, by hand
    return mine[:, 0].mean().item(), seen, (sums[0] / sums[1])[0].item()


bn = [r.value for r in launch(batchnorm_under_ddp, nprocs=2, echo=False)]
print(f"feature 0: share means {bn[0][0]:.2f} (rank 0), {bn[1][0]:.2f} (rank 1); "
      f"the global batch's {bn[0][2]:.2f}")
for options in bn[0][1]:
    (w0, r0, warned), (w1, r1, _) = bn[0][1][options], bn[1][1][options]
    print(f"DDP(bn, **{options}): running_mean[0] after wrapping {w0:.0f} | {w1:.0f},"
          f" after 2 forwards {r0:.2f} | {r1:.2f} (rank 0 | rank 1)"
          + (", FutureWarning: deprecated" if warned else ""))

# %% [markdown]
# By default, wrapping made rank 1's buffer rank 0's, and rank 1's second
# forward started from rank 0's statistics, so its running mean mixes both
# shares', while a checkpoint saved by rank 0 holds rank 0's alone.
# `forward_sync_buffers=False` still syncs at wrapping, then lets each rank
# keep its own statistics; only the deprecated `broadcast_buffers=False` (or
# `init_sync=False`, which skips the parameters' broadcast too) keeps a
# rank-local buffer from the start. With small per-rank batches, one share's
# statistics are too noisy: `nn.SyncBatchNorm` all-reduces the per-channel
# sums in every forward (the global mean above, by hand), at one collective
# per BatchNorm layer per forward. It runs on GPU modules only; convert with
# `nn.SyncBatchNorm.convert_sync_batchnorm(model)` before wrapping.
#
# ### The gradient buckets DDP builds
#
# DDP does not wait for the whole backward pass: it groups the gradients into
# **buckets**, in reverse order of the parameters, and all-reduces a bucket as
# soon as its gradients are ready, while autograd goes on. Three facts from
# torch 2.13's `DistributedDataParallel.__init__`: the first iteration uses
# one bucket for everything unless `find_unused_parameters=True` (DDP then
# rebuilds the buckets in the order the gradients arrived); the cap, `bucket_cap_mb`, is 25 MiB by default;
# and with the default the *first* bucket is capped at 1 MiB, so the last
# layer's gradients start their all-reduce early. Passing `bucket_cap_mb=25`
# explicitly, the "default" value, turns that small first bucket off. A
# communication hook records every bucket DDP reduces, for a model of eight
# 1 MiB layers, and a profile shows rank 0's third iteration: its backward on
# the main thread, the all-reduces on gloo's threads.

# %%
def bucket_sizes_and_profile(rank, world_size, options):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]), **options)
    iteration, buckets = [0], []

    def recording_hook(state, bucket):  # wraps DDP's all-reduce, records the bucket
        buffer = bucket.buffer()
        buckets.append((iteration[0], bucket.index(),
                        buffer.numel() * buffer.element_size()))
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, recording_hook)
    x = torch.randn(256, 512)
    for step in range(3):  # the profile of the last one is kept
        iteration[0] = step
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ddp(x).sum().backward()
            time.sleep(0.05)  # gloo's threads close their last events first
    spans = []
    for e in prof.events():
        if e.name == "gloo:all_reduce":
            lane = "all_reduce (gloo threads)"
        elif e.name.startswith("autograd::engine::evaluate_function: AddmmBackward"):
            lane = "backward (main thread)"
        else:
            continue
        spans.append((lane, e.time_range.start / 1e6, e.time_range.end / 1e6))
    return buckets, spans


def bucket_runs(rank, world_size):
    return {label: bucket_sizes_and_profile(rank, world_size, options)
            for label, options in (("defaults", {}), ("bucket_cap_mb=25",
                                   {"bucket_cap_mb": 25}), ("bucket_cap_mb=1",
                                                            {"bucket_cap_mb": 1}))}


show_buckets(launch(bucket_runs, nprocs=2, backend="gloo", echo=False)[0].value)

# %% [markdown]
# With the defaults, iteration 0 reduces one bucket of all 8 MiB; from
# iteration 1 on there are two, the last layer's 1 MiB first, and the profile
# shows that first all-reduce start while the backward pass still runs. An
# explicit `bucket_cap_mb=25` keeps one bucket, whose all-reduce waits for the
# end of the backward pass; 1 MiB buckets start earlier but pay the per-call
# latency of section 5 more often. On a GPU the same happens on CUDA streams
# instead of threads. Tune the cap only with a profile like this in hand
# (`prof.export_chrome_trace("trace.json")`, opened in Perfetto, shows one).
#
# ### When the ranks hang
#
# A misbehaving distributed program usually waits rather than crashes: one
# rank calls a collective the others never call, or with another shape, or
# died. The tools, cheapest first: **timeouts**
# (`init_process_group(timeout=...)`, defaults below) turn a silent hang into
# an error; **`dist.monitored_barrier(timeout=...)`** (gloo) names the ranks
# that did not arrive; **`TORCH_DISTRIBUTED_DEBUG=DETAIL`**, set before the
# group is created, checks before every collective that all ranks call the
# same one with the same shapes (an extra collective per call: debugging
# only); **`NCCL_DEBUG=INFO`** (GPUs) prints what nccl set up and why a call
# failed.

# %%
nccl_timeout = constants.default_pg_nccl_timeout  # None where torch has no nccl
print("default timeout of a process group:", constants.default_pg_timeout, "| of an "
      "nccl one:", nccl_timeout or "10 minutes, in builds with nccl (not this one)")


def mismatched_shapes(rank, world_size, level):
    dist.set_debug_level(getattr(dist.DebugLevel, level))  # as the env variable does
    dist.init_process_group("gloo")  # init=False: this rank creates its group
    t = torch.ones(3 + rank)  # rank 0 has 3 numbers, rank 1 has 4
    try:
        dist.all_reduce(t)
        return f"no error, result {t.tolist()}"
    except RuntimeError as e:  # the first words, without gloo's source location
        message = str(e).split("] ", 1)[-1] if str(e).startswith("[") else str(e)
        return f"RuntimeError: {message.split(', but')[0][:110]} ..."


def one_rank_busy(rank, world_size):
    from datetime import timedelta

    if rank == 1:
        time.sleep(1.0)  # stuck in something else, for twice the barrier's timeout
        return "was busy"
    try:
        with quiet_stderr():  # gloo also logs the error on stderr
            dist.monitored_barrier(timeout=timedelta(seconds=0.5))
        return "passed the barrier"
    except RuntimeError as e:
        return f"RuntimeError: {str(e).splitlines()[0]}"


for level in ("OFF", "DETAIL"):
    print(f"TORCH_DISTRIBUTED_DEBUG={level}:")
    for r in launch(mismatched_shapes, nprocs=2, args=(level,), init=False,
                    backend="gloo", echo=False):
        print(f"  rank {r.rank}: {r.value}")
print("monitored_barrier:", [r.value for r in launch(one_rank_busy, nprocs=2,
                                                     backend="gloo", echo=False)])

# %% [markdown]
# Without the debug level rank 0 returned a wrong result without a word (with
# nccl such a mismatch may hang or corrupt memory); with `DETAIL` both ranks
# stop at the faulty call and say which shapes differ. `monitored_barrier`
# named rank 1, busy for longer than the barrier waits.
#
# Most tutorials start ranks with `torch.multiprocessing.spawn(fn, args,
# nprocs)`, which calls `fn(i, *args)` in `n` fresh interpreters. It uses the
# *spawn* start method, so `fn` must be importable from a module (a notebook
# function is not; Chapter 4), it returns nothing (the children print to
# Jupyter's terminal), and it has no timeout: the reasons this course uses its
# own launcher in notebooks and torchrun for scripts.
#
# ### Elastic restarts
#
# On hundreds of GPUs something fails every few days. `torchrun
# --max-restarts=N` restarts *all* workers (up to `N` times) when one exits
# with an error, and the script resumes from its last checkpoint; it tells a
# worker how many restarts came before in `TORCHELASTIC_RESTART_COUNT`. The
# script below checkpoints every epoch and crashes once, in epoch 2:

# %%
ELASTIC = WORK / "elastic.py"

# %%
# %%writefile {ELASTIC}
"""Train for 4 epochs, checkpoint every epoch, resume after a restart."""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
checkpoint = Path(__file__).with_name("elastic.pt")
weights, first_epoch = torch.zeros(3), 0
if checkpoint.exists():  # resume where the last attempt stopped
    state = torch.load(checkpoint, weights_only=True)
    weights, first_epoch = state["weights"], state["epoch"] + 1
print(f"attempt {attempt}, rank {rank}: starting at epoch {first_epoch}", flush=True)
for epoch in range(first_epoch, 4):
    if attempt == 0 and epoch == 2 and rank == 1:
        sys.exit(f"rank {rank} fails in epoch {epoch}")  # a crash, for the demo
    update = torch.ones(3)
    dist.all_reduce(update)  # "training": every rank adds the world size
    weights += update
    if rank == 0:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"weights": weights, "epoch": epoch}, tmp)
        os.replace(tmp, checkpoint)  # never leave half a checkpoint behind
    dist.barrier()
print(f"attempt {attempt}, rank {rank}: done, weights {weights.tolist()}", flush=True)
dist.destroy_process_group()

# %%
def elastic_agent(rank, world_size, path):
    """torchrun --standalone --nproc_per_node=2 --max-restarts=1, in this process."""
    # the workers host their own store (see below): restarts reconnect reliably
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    tempfile.tempdir = str(WORK)  # the agent's log and error files go with WORK
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=1,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                          run_id="elastic", monitor_interval=0.2, start_method="fork")
    elastic_launch(config, run_path)(path)


(WORK / "elastic.pt").unlink(missing_ok=True)  # a fresh start on every run
print("$ torchrun --standalone --nproc_per_node=2 --max-restarts=1", ELASTIC.name)
agent = launch(elastic_agent, nprocs=1, args=(ELASTIC,), init=False, timeout=LIMIT_S,
               echo=False)[0]
print(agent.stdout, end="")
print("what ended attempt 0:", *(e for e in agent.stderr.splitlines() if "fails" in e))

# %% [markdown]
# Attempt 0 died in epoch 2; torchrun stopped the surviving rank and started
# both again, and attempt 1 went on from epoch 2. A crash costs the work since
# the last checkpoint, plus the restart (`--nnodes=MIN:MAX` lets torchrun go on
# with another world size). One trap: by default restarted workers share torchrun's own store with
# the attempt before, and in torch 2.13 they then often fail to connect (four
# runs in five here; PyTorch issue 135712). `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
# gives every attempt a fresh store.
#
# ### gloo or nccl
#
# Which backend for which tensors, per the backends table of the PyTorch
# documentation (`torch.distributed`, "Backends"):
#
# | operation | gloo, CPU tensors | gloo, GPU tensors | nccl, CPU tensors | nccl, GPU tensors |
# | --- | --- | --- | --- | --- |
# | send, recv, barrier | yes | no | no | yes |
# | the other collectives | yes | yes | no | yes |
#
# So: `nccl` for GPU tensors, one GPU per rank (NVLink, RDMA between nodes);
# `gloo` for CPU tensors. `init_process_group("cpu:gloo,cuda:nccl")` gives a
# group both, each tensor going to its device's backend.
#
# ### Throughput against the number of ranks
#
# At a fixed batch per rank, `n` ranks process `n` times the samples per step
# for one rank's compute plus the all-reduce that does not overlap. Samples per
# second of the bucket profile's model, on 1 rank and on as many as this
# machine has cores for (CPU ranks share cores and memory bandwidth; GPUs do not).

# %%
def throughput(rank, world_size, steps, batch):
    d = rank_device(rank)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).to(d)
    ddp = DDP(model, device_ids=[rank] if d.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(batch, 512, device=d)
    timings = {}
    for name, quiet in (("compute only (no_sync)", ddp.no_sync), ("DDP step", None)):
        for i in range(steps + 2):  # two warm-up steps
            if i == 2:
                if d.type == "cuda":
                    torch.cuda.synchronize(d)
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
            with quiet() if quiet else contextlib.nullcontext():
                ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if d.type == "cuda":
            torch.cuda.synchronize(d)
        timings[name] = (time.perf_counter() - start) / steps
        timings[name + " CPU"] = (time.process_time() - cpu) / steps
    timings["all CPU"] = time.process_time()  # since the rank started
    return timings


def per_sample_batch(n, backend, seen):
    """One launch of n ranks: the time (and CPU seconds) per batch of 64 samples."""
    def run():
        out = [r.value for r in launch(throughput, nprocs=n, args=(6, 64),
                                       backend=backend, echo=False)]
        seen.setdefault(n, []).append(out)
        step = max(v["DDP step"] for v in out)  # the slowest rank sets the pace
        return {"wall_s": step / n, "cpu_s": sum(v["DDP step CPU"] for v in out) / n,
                "all_cpu_s": sum(v["all CPU"] for v in out)}
    return run


cpu_runs = {}
print("gloo, CPU ranks: time per 64 samples")
cpu_result = compare({f"{n} rank{'s' if n > 1 else ''}": per_sample_batch(
    n, "gloo", cpu_runs) for n in sorted({1, min(usable_cores(), 4)})}, repeats=3,
    warmup=0)
print(cpu_result)
show_throughput(cpu_runs, disturbed=cpu_result.disturbed)
if gpus:  # one GPU per rank, nccl: a real GPU run, even with a single GPU
    print("nccl, one GPU per rank: time per 64 samples")
    print(compare({f"{n} GPU(s)": per_sample_batch(n, "nccl", {})
                   for n in (1, 2, 4, 8) if n <= gpus}, repeats=3, warmup=0))

# %% [markdown]
# Two things keep `n` CPU ranks below `n` times one rank's throughput (the
# ranges above show each): ranks sharing cores, caches and memory bandwidth
# compute more slowly than one alone, and part of the all-reduce does not
# overlap the backward pass.
#
# For GPUs, a model of one step predicts the trade-off at scale. Take a
# language model of `P = 1e9` parameters trained on `T` tokens per GPU per
# step. Its compute is about `6 P T` FLOPs (forward and backward; Kaplan et
# al., "Scaling Laws for Neural Language Models", 2020), here at the
# whole-step rate the course's step model reaches on published training runs
# (Chapter 13). The all-reduce moves the
# gradients, and their bytes depend on their dtype, not on autocast's: the
# cell below shows that under bf16 autocast the activations are bf16 but the
# gradients stay fp32, like the parameters they belong to. So the all-reduce
# moves `4 P` bytes, not `2 P` (DDP's `bf16_compress_hook` halves it, at the
# cost of rounding). If it does not overlap the backward pass, a step takes
# the sum; if it overlaps completely, the longer of the two.

# %%
layer = nn.Linear(8, 8)
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = layer(torch.randn(4, 8))
out.float().sum().backward()
GRAD_BYTES = layer.weight.grad.element_size()
print(f"under autocast: output {out.dtype}, gradient {layer.weight.grad.dtype} "
      f"({GRAD_BYTES} bytes per parameter)")
PARAMS = 1e9


def predicted_step(tokens, n, link):
    compute = predict.training_compute_seconds(6 * PARAMS * tokens, "h100_sxm")
    reduce = predict.collective_seconds("all_reduce", GRAD_BYTES * PARAMS, n,
                                        min(n, 8), link)  # 8 GPUs a node
    return compute.value, reduce


scaling_slider(predicted_step)

# %% [markdown]
# The all-reduce time hardly grows with `n`: a ring sends `2(n - 1)/n` times
# the gradient per GPU, which tends to twice the gradient. And the ratio of
# compute to communication is set by the tokens per GPU, not the model size
# (both grow with `P`): over NVLink it stays small down to small per-GPU
# batches; over slower links only overlap or larger batches keep the GPUs
# busy. Links between nodes are slower still, which is why large runs keep the
# most communication-hungry parallelism inside a node (Chapter 7).
#
# ## Summary
#
# - One process per device, all running the same code; the local rank picks
#   the GPU. `torchrun` (one node or many) passes ranks in the environment.
# - `DistributedSampler` shards the data; call `set_epoch` every epoch; the
#   batch size is per rank.
# - Averaged gradients make N ranks equal one process on an N-times batch.
# - Every rank calls each collective; a ring all-reduce sends `2(n - 1)/n` of
#   the data per rank.
# - Save on rank 0, barrier, load with `map_location` and `weights_only=True`.
# - `no_sync()` for accumulation; `find_unused_parameters` or `static_graph`;
#   `forward_sync_buffers=False` still syncs buffers at wrapping.
# - Default buckets: one at first, then a 1 MiB first bucket and 25 MiB ones;
#   an explicit `bucket_cap_mb` drops the small one.
# - Hangs: timeouts, `monitored_barrier`, `TORCH_DISTRIBUTED_DEBUG=DETAIL`;
#   `--max-restarts` restarts all workers from a checkpoint.
# - Tokens per GPU and link speed decide scaling; fp32 gradients make the
#   all-reduce `4 P` bytes.

# %% [markdown]
# ## Exercises
#
# ### Exercise 6.1: average the gradients by hand
#
# DDP does this during `backward()`. Write `average_gradients(model)`, called
# on every rank after `loss.backward()`, that replaces each parameter's
# `.grad` by the mean of that gradient over all ranks, in the gradient's own
# dtype. A frozen parameter's `.grad` is `None` and stays so. The checker runs
# it twice per rank on 2 and 3 ranks, with a model that has a float64 layer.

# %% tags=["exercise"] exercise="6.1"
def average_gradients(model):
    ### BEGIN SOLUTION
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
    ### END SOLUTION


# %% tags=["check"] exercise="6.1"
check_average_gradients(average_gradients)

# %% [markdown]
# ### Exercise 6.2: a ring all-reduce from send and recv
#
# Write `ring_all_reduce(tensor)`, called on every rank, that leaves in
# `tensor` itself (as `dist.all_reduce` does) the sum of every rank's tensor,
# with point-to-point messages only (`send`/`recv`, `isend`/`irecv`, or
# `batch_isend_irecv`). Split the flat tensor into `n` chunks
# (`tensor.view(-1).tensor_split(n)`: their sizes may differ by one). In
# `n - 1` reduce-scatter steps, at step `s` rank `r` sends chunk
# `(r - s) mod n` to rank `r + 1` and adds what it receives from rank `r - 1`
# to chunk `(r - s - 1) mod n`; rank `r` then holds the finished chunk
# `(r + 1) mod n`. In `n - 1` all-gather steps the finished chunks travel the
# same way, copied instead of added. Post each receive before waiting on your
# send, or the ranks may wait for each other forever. The checker compares
# with `dist.all_reduce` on 2, 3 and 4 ranks, for float32, float64 and int64
# tensors of sizes that do not divide by `n`, and counts each rank's messages:
# `2(n - 1)`, one chunk each, all to the same neighbour, each carrying the
# ring's running or finished sums.

# %% tags=["exercise"] exercise="6.2"
def ring_all_reduce(tensor):
    ### BEGIN SOLUTION
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(2 * (n - 1)):
        outgoing = chunks[(rank - step) % n]
        target = chunks[(rank - step - 1) % n]
        incoming = torch.empty_like(target)
        receive = dist.irecv(incoming, src=(rank - 1) % n)
        send = dist.isend(outgoing, dst=(rank + 1) % n)
        receive.wait()
        send.wait()
        if step < n - 1:
            target += incoming  # reduce-scatter: add
        else:
            target.copy_(incoming)  # all-gather: copy the finished chunk
    ### END SOLUTION


# %% tags=["check"] exercise="6.2"
check_ring_all_reduce(ring_all_reduce)

# %% [markdown]
# ### Exercise 6.3: a checkpoint every rank can trust
#
# Write `save_then_load(model, rank, path)`, called on every rank: rank 0
# saves the model's `state_dict` to `path`, then every rank loads it back into
# its own model, on the device its parameters are on, with
# `weights_only=True`. The checker runs it on 2 and 3 ranks whose models start
# different; one rank arrives late, rank 0's `state_dict()` and its write take
# a while, and the file says its tensors come from a GPU this machine lacks.
# Every rank must end with rank 0's weights.

# %% tags=["exercise"] exercise="6.3"
def save_then_load(model, rank, path):
    ### BEGIN SOLUTION
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    device = next(model.parameters()).device
    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    ### END SOLUTION


# %% tags=["check"] exercise="6.3"
check_save_then_load(save_then_load)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | process / rank | 进程 / 进程编号（秩） |
# | world size | 进程总数（世界大小） |
# | local rank | 本地进程编号 |
# | node | 节点 |
# | process group | 进程组 |
# | backend (nccl, gloo) | 通信后端 |
# | collective communication | 集合通信 |
# | all-reduce / ring all-reduce | 全归约 / 环形全归约 |
# | all-gather | 全收集 |
# | reduce-scatter | 归约散射 |
# | broadcast | 广播 |
# | barrier | 屏障（同步点） |
# | point-to-point (send/recv) | 点对点通信 |
# | rendezvous | 汇合（集合点） |
# | key-value store | 键值存储 |
# | sampler | 采样器 |
# | checkpoint | 检查点 |
# | algorithmic / bus bandwidth | 算法带宽 / 总线带宽 |
# | gradient accumulation | 梯度累积 |
# | gradient bucket | 梯度桶 |
# | buffer (running statistics) | 缓冲区（运行统计量） |
# | synchronized BatchNorm | 同步批归一化 |
# | elastic training / restart | 弹性训练 / 重启 |
# | scaling efficiency | 扩展效率 |

# %%
tidy_up()  # the last cell: the chapter's temporary folder goes
