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
#   world size and local rank mean.
# - How to start the processes: `torchrun` for scripts (one machine or several
#   "nodes"), and a launcher for functions written in a notebook.
# - Why two-rank DDP *is* big-batch training: the gradient all-reduce, shown
#   numerically, and how `DistributedSampler` and `set_epoch` shard the data.
# - The collectives (broadcast, all_reduce, all_gather, reduce_scatter, scatter,
#   gather, barrier, send/recv, the `*_object` variants), what they cost, and
#   the key-value stores underneath.
# - Checkpointing and logging correctly: save on rank 0, barrier, load with
#   `map_location`; average a loss across ranks.
# - DDP in practice: gradient accumulation with `no_sync`, unused parameters,
#   BatchNorm, gradient buckets seen in a profile, debugging hangs,
#   `mp.spawn`, elastic restarts, gloo or nccl, and what more ranks buy.
#
# **Hardware.** Everything here runs for real on a laptop: the ranks are CPU
# processes that talk through the `gloo` backend over the loopback network. With
# a GPU for every rank, `torchrun` scripts use `nccl` with one GPU per rank, and
# so does the notebook launcher (it prints the backend it chose), whatever this
# notebook did with CUDA before; the collective timings are then measured on
# the GPUs (and `make record` keeps them as reference results). With a single
# GPU, the two ranks stay CPU processes with `gloo` (two ranks cannot share
# one GPU under `nccl`), and the GPU is used where that is enough: the
# checkpoints of section 7 are saved from it, and section 9 measures one
# rank on it with `nccl`. Without GPUs, the timing cells show published and
# predicted GPU figures beside the local ones, each labelled with its kind.

# %%
import atexit
import contextlib
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ipywidgets as widgets
import matplotlib.pyplot as plt
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed import constants
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from course_utils import banner, for_device, plots, predict, reference
from course_utils.bench import Sweep
from course_utils.checks.ch06 import (
    check_average_gradients,
    check_epoch_batches,
    check_save_then_load,
)
from course_utils.compare import Stalled, compare, wait_while_working
from course_utils.devices import usable_cores
from course_utils.dist import LaunchTimeout, free_port, launch, stop_tree
from course_utils.plots import plot_time_vs_size, plot_timeline

banner();

# %% [markdown]
# ## 1. One process per device
#
# Data parallel training keeps a full copy of the model on every device and gives
# each copy a different slice of every batch. PyTorch's `DistributedDataParallel`
# (DDP) runs **one operating-system process per device**. Each process is a
# *rank*, numbered `0 .. world_size - 1`; the *world size* is how many ranks take
# part. On several machines ("nodes"), the *local rank* numbers the processes of
# one node, and it, not the global rank, picks the GPU: rank 9 on the second of
# two 8-GPU nodes uses `cuda:1`. (The seed slides write
# `torch.device('cuda', rank)`, which fails on every node but the first.)
#
# Why processes and not threads? Each process has its own Python interpreter and
# its own GIL, so the Python work of the ranks runs truly in parallel. The price
# is that they share nothing: they must exchange gradients through a
# communication *backend* (`nccl` between GPUs, `gloo` between CPUs).
#
# `launch(fn, nprocs)` from `course_utils.dist` starts the processes from this
# notebook, sets up a process group in each and calls `fn(rank, world_size)`.
# It prints which start method and backend it chose, and returns what each rank
# returned, with its printed output.

# %%
gpus = torch.cuda.device_count()  # 0 without a GPU


def rank_device(rank):
    """The device of this rank: its own GPU under nccl, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", rank)
    return torch.device("cpu")


def hello(rank, world_size):
    print(f"I am rank {rank} of {world_size}, process {os.getpid()}, "
          f"backend {dist.get_backend()}, device {rank_device(rank)}")
    return os.getpid()


start = time.perf_counter()
results = launch(hello, nprocs=2)
print("notebook process:", os.getpid(), "- rank processes:", [r.value for r in results])
# the first launch starts a process that imports torch: this machine's start-up
# time now, busy or not; the demos below that start processes wait a multiple
STARTUP_S = time.perf_counter() - start
LIMIT_S = min(90.0, max(30.0, 15 * STARTUP_S))
print(f"starting the ranks took {STARTUP_S:.1f} s: demos below may take "
      f"{LIMIT_S:.0f} s")

# %% [markdown]
# Every rank ran the *same* function and learned which part it plays only from
# its rank. That is the SPMD style (single program, multiple data) that all of
# distributed PyTorch uses. Three more facts about the launcher, because they
# matter in every chapter that uses it:
#
# - Its ranks are forked from a **forkserver**: a server process started once,
#   as a fresh interpreter with torch already imported, that never runs this
#   notebook's cells. The function and its arguments are sent to the ranks by
#   value (cloudpickle), so functions defined in the notebook work, and a rank
#   can use its GPU with `nccl` even after this notebook has used CUDA. Its
#   first line says which start method and backend it chose.
# - It finds a free port on `127.0.0.1` for the ranks to meet at, and sets the
#   same environment variables as `torchrun` does (below).
# - It stops every rank on a timeout, when one rank fails, or when you press
#   *interrupt*: a rank that dies leaves the others waiting forever in their next
#   collective, so the launcher ends them and names the ranks that failed.

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
# In real training you write a script and start it with `torchrun`. It starts
# `--nproc_per_node` copies of the script and tells each one who it is through
# environment variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
# `MASTER_ADDR`, `MASTER_PORT`. The script then calls `init_process_group()`,
# which reads them (the `env://` rendezvous). The old
# `python -m torch.distributed.launch` that the seed slides also list is
# deprecated: it passes the local rank as a command-line argument, spelled
# `--local-rank=N` since torch 2.0 and `--local_rank=N` before, so scripts
# written for it must accept both spellings. torchrun passes nothing on the
# command line; read `LOCAL_RANK` from the environment.
#
# The script below is a complete DDP training run. Read it top to bottom: every
# line of it returns later in this chapter.

# %%
# ruff: noqa: F811 - the scripts below repeat the imports, as standalone files must
WORK = Path(tempfile.mkdtemp(prefix="ch06-"))  # scripts and checkpoints go here
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # removed with the kernel
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
# Now run it with `torchrun --standalone --nproc_per_node=2`. We call torchrun as
# `python -m torch.distributed.run` with this notebook's Python, so the same
# environment is used; on the command line you would type `torchrun ...`.
# `--standalone` runs the rendezvous on this machine, and `--tee=3` copies each
# worker's stdout and stderr to torchrun's, prefixing every line with the worker's
# role and local rank (`[default0]:`), so that the lines of two ranks never mix.

# %%
def run_command(cmd, env=None, attempts=1):
    """Run a command, print what it printed; fail the cell if every attempt failed.

    No fixed time limit: it may run while it works (LIMIT_S at most); no CPU
    used for 15 s means it is stuck, and a stuck or crashed run is tried again.
    """
    for attempt in range(1, attempts + 1):
        print("$", " ".join(map(str, cmd)))
        out, err = WORK / "command.out", WORK / "command.err"  # files: a full pipe
        with open(out, "w") as o, open(err, "w") as e:        # could stall the job
            proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env)
        try:
            wait_while_working([proc], limit_s=LIMIT_S)
            failed = proc.returncode and f"exit code {proc.returncode}"
        except Stalled as stalled:
            failed = str(stalled)
        finally:  # torchrun's workers have sessions of their own: end the tree
            if proc.poll() is None:
                stop_tree([proc.pid])
        print(out.read_text(), end="")
        if not failed:
            return
        log = err.read_text().splitlines()[-8:]
        if attempt == attempts or "still working" in failed:  # busy: no retry
            raise RuntimeError("\n".join([f"FAILED: {failed}. The end of its log:",
                                           *log]))
        print(f"FAILED: {failed}. The end of its log:", *log, "-> trying once more",
              sep="\n")


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
start = time.perf_counter()
run_command(TORCHRUN + ["--standalone", "--nproc_per_node=2", "--tee=3", SCRIPT],
            attempts=2)  # see below: a rare crash at exit
print(f"torchrun took {time.perf_counter() - start:.1f} s in all")

# %% [markdown]
# Three details of this script differ from the DDP examples in the seed slides,
# on purpose. The model is moved to its device *before* DDP wraps it, with
# `device_ids=[local_rank]`: DDP sets up its gradient buckets and broadcasts
# the parameters where they are when it is constructed (the slides wrap first,
# then move). The targets come from the same `TensorDataset` as the inputs, so
# the sampler shards them together (the slides take the targets from a separate
# `get_target_tensor()`, which would not match each rank's inputs). And the
# logged loss is averaged over all ranks' samples, not rank 0's alone. One line
# is simply newer than the slides: `init_process_group(device_id=...)` binds
# each rank to its GPU, so that a collective with no tensor to go by, such as
# `barrier`, knows which GPU to use. (The slides also write
# `optim = optim.Adam(...)`, which rebinds the name of the `torch.optim` module
# to the optimizer: at the top of a script it works once and breaks the next
# `optim.` call; inside a function it raises `UnboundLocalError` at once. Name
# the optimizer `opt`, as here.)
#
# Both ranks print the same weights: they started from the same seed, DDP
# broadcast rank 0's parameters when it wrapped the model, and every step applied
# the same averaged gradient.
#
# The script frees the DDP model (`del model`) before it destroys the process
# group, and the order matters. `destroy_process_group()` takes the group out of
# PyTorch's registry, but DDP's reducer still holds it. Were the reducer the last
# holder, the group would be destroyed when `main()` returns and frees its
# locals: on the main thread, holding Python's GIL, and gloo's destructor waits
# for its worker threads to end. A worker that is just then freeing a finished
# collective that holds a Python tensor needs the GIL too, so neither can go
# on, and the rank hangs after printing its last line. With torch 2.13 and gloo,
# running this script with the notebook's launcher (below), that happened here
# in 3 of 150 runs without the `del` (rank 1 stuck at the end of `main()`; `gdb`
# showed the two threads), and in none of 350 runs with it, 200 of them with
# another process keeping a core busy. Dropped by the registry, the group is
# destroyed with the GIL released. PyTorch issue 56297 lists this blocking
# destructor as a source of deadlocks. In your own scripts: free the DDP model,
# or return from the function that owns it, before you destroy its process
# group.
#
# You may meet one more thing, rarely: a worker that has already printed its
# last line dies while Python shuts down, with `terminate called without an
# active exception` and exit code -6 (SIGABRT), and torchrun reports the whole
# job as failed. With torch 2.13 and gloo it happened here once in about 75
# torchrun runs of this script on a loaded 2-core machine, and never in a forked
# rank (the notebook's launcher ends its ranks without Python's shutdown).
# PyTorch issue 190489 reports the same abort from gloo at exit when
# `destroy_process_group` is never called; this script calls it, so the exact
# cause here is not known. The training was done, but a job scheduler cannot
# tell such an exit from a real failure, so the cell above tries once more, and
# shows the first attempt's error if there was one.
#
# The notebook launcher can run the very same script: it sets the same
# environment variables, and with `init=False` it leaves `init_process_group` to
# the script. Compare the two times: the training is identical, so the
# difference is what it costs torchrun to start three fresh Python processes
# (its agent and two workers) that each import torch. The launcher's ranks
# are forked from a server that imported torch once, before the first launch.

# %%
def run_script(rank, world_size, path):
    runpy.run_path(str(path), run_name="__main__")


start = time.perf_counter()
launch(run_script, nprocs=2, args=(SCRIPT,), init=False)
print(f"the launcher took {time.perf_counter() - start:.1f} s in all")

# %% [markdown]
# ## 3. Sharding the data: `DistributedSampler` and `set_epoch`
#
# Each rank must see a different part of every epoch, or the ranks would compute
# the same gradient twice. `DistributedSampler` shuffles the indices with a
# seed, pads them so that they divide evenly, and gives rank `r` every
# `world_size`-th index starting at `r`. The `batch_size` of the `DataLoader` is
# therefore **per rank**: two ranks with `batch_size=16` train with a global
# batch of 32. (With `nn.DataParallel`, which the seed notes describe, it is the
# other way round: one batch is split across the GPUs.)
#
# The shuffle is seeded with `seed + epoch`, and the sampler only knows the epoch
# if you tell it with `set_epoch`. Forget it and every epoch visits the data in
# the same order. `DistributedSampler` needs no process group when it is given
# `num_replicas` and `rank`, so we can look at its choices right here.

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

# %% [markdown]
# With `set_epoch` the order changes each epoch; without it the three epochs are
# identical. In both cases the two ranks' indices are disjoint and together cover
# all 12 samples. When the data set does not divide evenly, the sampler repeats a
# few samples so that every rank runs the same number of steps (a rank with one
# step fewer would leave the others waiting in the gradient all-reduce):

# %%
shares = [list(DistributedSampler(TensorDataset(torch.arange(10)), num_replicas=4,
                                  rank=r, shuffle=False)) for r in range(4)]
print("10 samples on 4 ranks:", shares)
print("samples seen twice:", sum(map(len, shares)) - 10)

# %% [markdown]
# ## 4. DDP is big-batch training
#
# Why may each rank train on only its share? Because the loss of a batch is a
# mean over its samples, and the gradient of a mean is the mean of the
# gradients. If rank `r` computes the gradient $g_r$ of the mean loss over its
# half of the batch, then $(g_0 + g_1) / 2$ is the gradient of the mean loss over
# the whole batch. DDP computes exactly that during `loss.backward()`: it
# **all-reduces** (sums across ranks) the gradients, in buckets, overlapping the
# communication with the rest of the backward pass, and divides by the world
# size. After the step, all ranks hold the same parameters again. (The seed
# notes describe the losses of all GPUs being averaged and then a backward pass
# running on all of them: that is how `nn.DataParallel` works, Chapter 5, which
# gathers the outputs on one GPU, computes one loss and back-propagates it
# through every replica. DDP does it the other way round: each rank
# back-propagates its own loss, and only the gradients are averaged.)
#
# The proof is numerical: train one model for a few steps on the full batch in
# this process, and the same model with two DDP ranks on half the batch each.

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
print(f"step 0 gradients after DDP's averaging, rank 0 vs rank 1: "
      f"{max_diff(ranks[0][0], ranks[1][0]):.2e}")
print(f"(float32 resolves about {torch.finfo(torch.float32).eps:.1e} of a value)")

# %% [markdown]
# The differences to one process are at the level of float32 rounding and need
# not be zero: summing in another order (or on another device) rounds
# differently. The two ranks agree exactly, because they apply the very same
# averaged gradient.
#
# Two conditions make the equality exact in exact arithmetic: the loss must be a
# **mean** over each rank's samples, and the shares must be the **same size**
# (DDP divides by the world size, not by the number of samples). No processes
# are needed to see the second one fail: average the gradients of two shares of
# the same batch, split evenly and then unevenly.

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
# Even shares agree to rounding; uneven ones give another gradient, because the
# samples of the smaller share weigh more. That is one reason why
# `DistributedSampler` pads the data so that every rank gets the same number of
# samples. And the learning rate is tied to the *global* batch: doubling the
# ranks at a fixed per-rank batch doubles the batch.
#
# `nn.DataParallel` (Chapter 5) reaches the same gradients differently: **one**
# process with one thread per GPU, which scatters each batch, replicates the
# model every step, and gathers the outputs on GPU 0. The threads share one GIL,
# and GPU 0 holds the gathered outputs and the loss, so it runs out of memory
# first. DDP's processes avoid both, and also work across machines, which is why
# PyTorch recommends DDP even on a single machine. What DDP does not avoid, as
# the seed notes rightly say, is the memory: every rank holds the whole model,
# its gradients and its optimizer state, so a model that does not fit on one
# GPU does not fit under DDP either. Sharded data parallelism (ZeRO, FSDP)
# splits those across the ranks; it builds on the reduce_scatter below.

# %% [markdown]
# ## 5. The collectives
#
# DDP is built on *collectives*: operations that every rank of a group calls,
# and that complete only when all have called them. Each example below runs on
# two ranks; `rank_device` puts the tensors on the rank's GPU under `nccl`, on
# the CPU under `gloo`. The output arguments must be tensors of the right size,
# allocated before the call: the collectives fill them in place.
#
# **broadcast** copies `src`'s tensor to every rank; **all_reduce** combines
# every rank's tensor (sum, product, min, max) and leaves the result on all of
# them, *in the same tensor*: the input is overwritten (the seed slides call it an
# input only). **reduce** leaves the result on one rank.

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
# gives it to one rank only. **scatter** is the reverse of gather: one rank
# sends a different piece to each. **reduce_scatter** sums the ranks' lists
# element-wise and gives piece `r` of the sum to rank `r`; an all_reduce is a
# reduce_scatter followed by an all_gather, which is how ring all-reduce works
# and what sharded training (ZeRO, FSDP) builds on.

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
# point to point: one rank sends, one named rank receives, into a tensor of the
# right size that it allocated. Under gloo, `send` returns once the tensor may
# be reused and `recv` once the data has arrived; `isend` and `irecv` return at
# once, with a handle to `wait()` on. (Under nccl, as for every nccl
# operation, the calls return once the transfer is queued on the GPU: the
# stream waits for it, not Python.)

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
# Rank 1 slept 0.3 s before the barrier, so rank 0 waited there about that long,
# and rank 1, the last to arrive, hardly waited at all.
#
# The **`*_object` variants** move any picklable Python object:
# `broadcast_object_list`, `all_gather_object`, `gather_object`,
# `scatter_object_list`, `send_object_list` and `recv_object_list`. There is no
# `reduce_object` (what would "sum" mean for arbitrary objects?), despite what
# the seed slides say. They need picklable objects on *every* backend, not only
# on nccl; under nccl they also copy the bytes through GPU memory, so each rank
# must have called `torch.cuda.set_device`. They cost more: pickling, a first
# collective that exchanges the sizes, then the bytes. And unpickling runs code,
# so use them only between processes you trust.

# %%
def objects(rank, world_size):
    config = [{"lr": 0.1, "note": "from rank 0"}] if rank == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    print("broadcast_object_list:", config)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"rank": rank, "pid": os.getpid()})
    print("all_gather_object:", everyone)

    d = rank_device(rank)
    t = torch.zeros(256, device=d)
    timings = {}
    for name, call in [
            ("all_gather of a tensor", lambda: dist.all_gather(
                [torch.empty_like(t) for _ in range(world_size)], t)),
            # a CPU copy: a pickled CUDA tensor would be unpickled onto the
            # sender's GPU in every receiving process
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
ratio = (timings["all_gather_object of the same values"]
         / timings["all_gather of a tensor"])
print(f"the object version takes {ratio:.1f} x as long here")

# %% [markdown]
# ### What a collective costs
#
# For a message of $S$ bytes that takes $t$ seconds, the **algorithmic
# bandwidth** is $S / t$: how fast the operation as a whole moves your data.
# For all_reduce, a ring implementation sends and receives $2(n-1)/n \cdot S$
# bytes per rank, so the **bus bandwidth** $2(n-1)/n \cdot S/t$ is what the
# links actually carried, and is the figure to compare with the hardware's link
# speed (nccl-tests reports both). With two ranks the factor $2(n-1)/n$ is 1,
# so the two columns below agree; with 8 GPUs it is 1.75.
#
# Small messages are dominated by a fixed latency per call, so their bandwidth
# is low; large messages approach the link's bandwidth. Here the "links" are
# the loopback network and two CPU cores; on a CPU the largest messages may
# lose bandwidth again, once they no longer fit in the caches and the ranks
# compete for the same cores, so the cell reports where the bandwidth peaked.
# On the plot, a flat start means latency-bound; a slope of one (time doubling
# with size) means bandwidth-bound.
#
# How to time it. A collective finishes only when the *slowest* rank gets
# there, so the ranks first meet at a barrier; then each times a burst of
# back-to-back all_reduces and divides by their number, as nccl-tests does. A
# single call is too short to time on its own: when the operating system
# pauses one rank for a moment (on a 2-core machine, two ranks, their
# communication threads and everything else share two cores), the other
# rank waits, and that one call looks ten times slower. So the table gives,
# for each size, the **fastest** of the repeated bursts (what the ranks and
# the links can do; pauses only ever add time) beside the **median** (what
# you typically get on this machine).

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
n = 2
print(f"all_reduce on {n} ranks with {backend}, time per call")
print(f"{'bytes':>11} {'fastest':>10} {'median':>10} {'algbw':>12} {'busbw':>12}"
      "  (bandwidths of the fastest)")
for size, fastest, median, *_ in rows:
    algbw = size / fastest
    print(f"{size:>11,d} {fastest * 1e6:>7.0f} us {median * 1e6:>7.0f} us "
          f"{algbw / 1e9:>7.3f} GB/s {algbw * 2 * (n - 1) / n / 1e9:>7.3f} GB/s")
best = max(rows, key=lambda r: r[0] / r[1])
print(f"best algorithmic bandwidth at {best[0]:,d} bytes: "
      f"{best[0] / best[1] / (rows[0][0] / rows[0][1]):.0f} x that of "
      f"{rows[0][0]:,d} bytes; the largest message took "
      f"{rows[-1][1] / rows[0][1]:.0f} x as long as the smallest, for "
      f"{rows[-1][0] // rows[0][0]:,d} x the bytes")

# %%
sizes = [r[0] for r in rows]
ring = {link: reference.predicted(
            [predict.allreduce_seconds(b, 2, link).value for b in sizes], "s",
            f"2 GPUs over {name}",
            "calibrated NCCL ring: a per-collective latency "
            f"({predict.collective_latency() * 1e6:.0f} us) + 2(n-1)/n x bytes / "
            f"{predict.achieved_link_bandwidth(link) / 1e9:.4g} GB/s, the bus "
            "bandwidth NCCL reaches on the link; n = 2",
            [predict.LINKS[link][0], *predict.COLLECTIVE_LATENCY_INPUTS,
             *(predict.NVLINK_EFFICIENCY_INPUTS if link.startswith("nvlink")
               else predict.PCIE_EFFICIENCY_INPUTS)])
        for link, name in (("nvlink_h100", "NVLink 4 (H100)"),
                           ("pcie4_x16", "PCIe 4.0 x16"))}
# a published sweep of the same collective (8 GPUs), beside the same model
h200 = reference.published("nccl.h200x8_allreduce_sweep")
h200_pred = reference.predicted(
    {"x": h200.value["x"],
     "y": [predict.allreduce_seconds(b, 8, "nvlink_h100").value
           for b in h200.value["x"]]},
    "s", "8 GPUs over NVLink 4", "the same calibrated NCCL ring, n = 8",
    [predict.LINKS["nvlink_h100"][0], *predict.COLLECTIVE_LATENCY_INPUTS,
     *predict.NVLINK_EFFICIENCY_INPUTS])
figures = reference.show("06.allreduce_2gpu", local=rows[-1][1], unit="s",
                         local_device="cuda:0" if backend == "nccl" else "cpu",
                         figures=[*ring.values(), h200_pred, h200])
print(f"at the largest message, {sizes[-1]:,d} bytes: measured here "
      f"{rows[-1][1] * 1e6:,.0f} us (fastest run); predicted "
      + ", ".join(f"{f.device} {f.value[-1] * 1e6:,.1f} us" for f in ring.values()))
for b, t_pub, t_pred in zip(h200.value["x"], h200.value["y"], h200_pred.value["y"],
                            strict=True):
    print(f"8x H200, {b / 2**20:>8,.0f} MiB: predicted {t_pred * 1e6:9,.1f} us, "
          f"published {t_pub * 1e6:9,.1f} us, ratio {t_pred / t_pub:.2f}")
print("caveats: no published 2-GPU sweep was found, so the 2-GPU lines assume the "
      "8-GPU latency; from about 2 MiB NCCL on an NVSwitch node reduces inside the "
      "switch (NVLS), faster than the ring the model assumes (ratio above 1.25 at "
      "16 GiB)")
US = 1e6  # plotted in microseconds
curves = [Sweep(f"{backend}, 2 ranks, median (measured here)", sizes,
                [r[2] * US for r in rows], [(r[4] - r[3]) * US for r in rows],
                low=[r[3] * US for r in rows], high=[r[4] * US for r in rows]),
          Sweep(f"{backend}, 2 ranks, fastest (measured here)", sizes,
                [r[1] * US for r in rows], [0.0] * len(rows))]
for f in figures:
    if f.kind == "recorded":  # rows of [bytes, fastest, median, quartiles]
        curves.append(Sweep(f"nccl, {f.legend}", [v[0] for v in f.value],
                            [v[1] * US for v in f.value], [0.0] * len(f.value)))
ax = plot_time_vs_size(curves, xlabel="message size (bytes)",
                       ylabel="time per all_reduce (us)",
                       title="all_reduce time vs message size (median with quartile "
                             "band, and fastest)")
for fig, color in zip(ring.values(), ("tab:green", "tab:purple"), strict=True):
    ax.plot(sizes, [t * US for t in fig.value], color=color, label=fig.legend,
            **plots.figure_style("predicted"))
ax.legend(fontsize=7)
plt.show()

# %% [markdown]
# ## 6. Key-value stores
#
# Before any collective can run, the ranks must find each other. They do it
# through a small **key-value store** that all of them can reach: rank 0 opens
# it, the others connect, and each writes its address. `init_process_group`
# creates one from `MASTER_ADDR:MASTER_PORT` (a `TCPStore`); you can also use one
# yourself, to share small values or wait for a signal:
#
# - `TCPStore`: a server in one process, clients over TCP: works across
#   machines.
# - `FileStore`: a file that all ranks can open: one machine, or a shared file
#   system.
# - `HashStore`: a dictionary inside one process, for threads of that process
#   only (handy in tests).

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


store_file = WORK / "filestore"
store_file.unlink(missing_ok=True)
_ = launch(stores, nprocs=2, args=(free_port(), store_file), init=False,
           backend="gloo")  # the group below is gloo's, on every machine

hashes = dist.HashStore()  # in this process only
hashes.set("epoch", "3")
print("HashStore:", hashes.get("epoch"))

# %% [markdown]
# ## 7. Checkpoints and logged losses
#
# **Saving.** All ranks hold the same parameters, so one copy is enough: only
# rank 0 writes (two ranks writing one file can leave it corrupt). The others
# must wait until the file is complete before reading it, hence a `barrier`
# between the save and the load. Save `ddp_model.module.state_dict()`: the
# wrapper's own state dict prefixes every name with `module.`, and a plain model
# will not load it.
#
# **Loading.** `torch.save` records the device of every tensor. Without
# `map_location`, a checkpoint saved from `cuda:0` loads onto `cuda:0` in every
# rank: each rank puts a copy on GPU 0, which runs out of memory first. And a
# checkpoint saved from `cuda:3` does not load at all on a machine with fewer
# than four GPUs, or with none. Pass
# `map_location` (the rank's own device) and `weights_only=True`, which unpickles
# only tensors and plain containers instead of running arbitrary code (the
# default since torch 2.6). The seed slides load with neither.

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
    stored_on = []  # the device each tensor was saved from, as the file records it
    torch.load(path, weights_only=True,
               map_location=lambda storage, location: stored_on.append(location)
               or storage)
    naive = torch.load(path, weights_only=True)  # no map_location
    state = torch.load(path, map_location=d, weights_only=True)
    model.load_state_dict(state)
    return (str(d), sorted(set(stored_on)), str(naive["weight"].device),
            str(state["weight"].device), model.weight.detach().cpu())


ckpt = WORK / "round_trip.pt"
loaded = [r.value for r in launch(checkpoint_round_trip, nprocs=2, args=(ckpt,))]
for rank, (own, stored, naive, mapped, _) in enumerate(loaded):
    print(f"rank {rank} (its device {own}): the file records {stored}; loaded without "
          f"map_location onto {naive}, with map_location onto {mapped}")
print("rank 1 now holds rank 0's weights:", torch.equal(loaded[0][4], loaded[1][4]))
if not gpus:
    print("(no GPU: every tensor was saved from the CPU, so map_location changes "
          "nothing here; with GPUs, rank 1 would load onto cuda:0 without it)")

# %% [markdown]
# **Logging a loss.** Each rank's loss is the loss of its share only. To log the
# loss of the global batch, all-reduce it and divide by the world size; this is
# a collective, so *every* rank must call it, even if only rank 0 prints. Work
# on a detached copy: `all_reduce` writes into its argument, so the seed's
# `print_averaged_value(value)` overwrites the caller's tensor. If that tensor is
# the loss and `backward()` comes later, autograd does not know about the
# all_reduce, and torch warns that this "may lead to silently incorrect
# behavior".

# %%
def averaged_for_logging(loss):
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def log_loss(rank, world_size):
    w = torch.tensor(float(rank + 1), device=rank_device(rank), requires_grad=True)
    loss = w * 2  # 2.0 on rank 0, 4.0 on rank 1
    mean = averaged_for_logging(loss)
    if rank == 0:
        print(f"rank 0's own loss {loss.item()}, mean over ranks {mean.item()}")
    return loss.item(), mean.item()


values = [r.value for r in launch(log_loss, nprocs=2)]
print("the local losses were", [v[0] for v in values])

# %% [markdown]
# ## 8. Several nodes
#
# On a cluster, torchrun runs once on **each node**, with the same arguments
# except the node's own identity. `--nnodes` says how many nodes take part, and
# a *rendezvous* lets the torchrun agents find each other and agree on the
# ranks. With `--rdzv_backend=c10d`, one agent hosts a store at
# `--rdzv_endpoint` (usually the first node's address) and the rendezvous
# assigns the node ranks itself, so `--node_rank` is ignored (torch says so); it
# matters for the older *static* rendezvous (`--master_addr`, `--master_port`,
# `--node_rank`), where each node's rank is fixed by hand. A c10d rendezvous
# also lets a job restart with nodes that replace failed ones.
#
# `torchrun` itself is a thin command line over
# `torch.distributed.launcher.api.elastic_launch`: it turns its arguments into a
# `LaunchConfig` and runs the *agent*, which joins the rendezvous, then starts
# and watches the workers. Started as a command, each agent and each worker is a
# fresh interpreter that imports torch (the run in section 2 showed the cost). So
# below, each of two "nodes" on this machine is a forked process that runs the
# very same agent and rendezvous code, with `start_method="fork"` for its worker.
# The command line each node would run is printed first.

# %%
def run_path(path):
    """A worker's entry point: the script, run as torchrun would run it."""
    runpy.run_path(str(path), run_name="__main__")


def node(index, nodes, endpoint, path):
    """Node ``index`` of ``nodes``: torchrun's agent, for one worker, in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(gpus)))
    # each "node" sees only its own GPU, as a real machine would; none if short
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if gpus >= 2 else ""
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

# %% [markdown]
# Each node printed its own line, and both hold the same weights. The node
# numbers come from the c10d rendezvous, which sorts the agents by host name and
# process id (a `--node_rank` would be ignored). On this machine both
# "nodes" share one file system, so rank 1 could read the checkpoint that rank 0
# wrote; on a real cluster the checkpoint directory must be on a shared file
# system (or each node saves and loads its own copy).
#
# Were any processes left behind? No rank, agent or worker should be running
# now: the launcher and the cells above end every process they start, even
# after a failure. Two helpers stay by design, until the kernel exits: the
# launcher's forkserver, the clean process that ranks are forked from, and
# multiprocessing's resource tracker.

# %%
servers = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
left = [p for p in psutil.Process().children(recursive=True)
        if not any(server in " ".join(p.cmdline()) for server in servers)]
print("ranks, agents or workers started from this notebook still running:",
      [f"{p.pid} {' '.join(p.cmdline())[:60]}" for p in left] or "none")

# %% [markdown]
# On a real cluster the scheduler starts one torchrun per node. A Slurm batch
# script for two nodes with 8 GPUs each looks like this (shown, not run):
#
# ```bash
# # #!/bin/bash
# #SBATCH --job-name=ddp
# #SBATCH --nodes=2                 # two machines
# #SBATCH --ntasks-per-node=1       # one torchrun per machine ...
# #SBATCH --gpus-per-node=8         # ... which starts 8 ranks, one per GPU
# #SBATCH --cpus-per-task=32
# #SBATCH --time=01:00:00
#
# # the first node of the allocation hosts the rendezvous
# head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
#
# srun torchrun \
#     --nnodes="$SLURM_NNODES" --nproc_per_node=8 \
#     --rdzv_backend=c10d --rdzv_endpoint="$head:29500" --rdzv_id="$SLURM_JOB_ID" \
#     train_ddp.py
# ```
#
# `srun` runs the torchrun line once per node (one task per node), and each
# torchrun starts 8 ranks: 2 x 8 = 16 ranks meet at the head node, where the
# agent whose host name matches the endpoint hosts the rendezvous store. Port
# 29500 must be free there and reachable from the other nodes. The script itself
# is unchanged: that is the point of reading the ranks from the environment.
# Its checkpoint directory must be on a file system that every node sees (on
# most clusters, the home or project directory is).

# %% [markdown]
# ## 9. DDP in practice
#
# The script of section 2 is the core of every DDP program. Real training runs
# add a handful of things to it. Each is shown below on CPU ranks with `gloo`
# (the BatchNorm cell and the throughput measurement use the GPUs when every
# rank has one); each works the same way on GPUs with `nccl`, the model moved
# to the rank's GPU first.
#
# ### Gradient accumulation and `no_sync()`
#
# When the batch you want does not fit in memory, you run `k` smaller
# micro-batches, let their gradients add up in `.grad`, and step once. Divide
# each micro-batch's loss by `k` so that the sum is the mean. Under DDP every
# `backward()` all-reduces the gradients; for the first `k - 1` micro-batches
# that traffic is wasted, since the sum happens locally anyway. Inside
# `with ddp_model.no_sync():` a backward pass only accumulates; the next
# backward outside the block all-reduces the accumulated sum. A *communication
# hook* (DDP's way to replace or wrap its all-reduce) counts the calls.

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
                               backend="gloo")[0].value
    print(f"{K} micro-batches per rank, no_sync {'used' if use_no_sync else 'not used'}:"
          f" {reductions} all-reduce call{'s' if reductions > 1 else ''}, gradient "
          f"differs from the full batch's by {max_diff(grads, single[0]):.1e}")

# %% [markdown]
# Both give the full batch's gradient, to rounding: averaging is linear, so it
# does not matter whether the ranks average every micro-batch's gradient or
# only their sum. `no_sync()` saves `k - 1` of every `k` all-reduces. (The
# model here is small enough for one bucket, so one call per backward.)
#
# ### Parameters that get no gradient
#
# DDP all-reduces a bucket when every parameter in it has its gradient. A
# parameter that the forward pass did not use never gets one, so its bucket
# never completes, and DDP stops at the next iteration with the error below. A
# model with two heads, of which each step uses one, is the classic case:

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


for options, what in launch(two_heads, nprocs=2, backend="gloo")[0].value.items():
    print(f"DDP(model, **{options}): {what}")

# %% [markdown]
# `find_unused_parameters=True` makes DDP walk the autograd graph after every
# forward pass to find the parameters it will not see, and mark them ready: it
# works when the set changes from step to step, and costs that walk every
# step. `static_graph=True` promises that the set of used parameters (and the
# order of their gradients) is the same in every iteration: DDP learns it in
# the first iteration and pays nothing afterwards. Neither is needed for a
# model whose forward pass uses every parameter, which is why both are off by
# default.
#
# ### BatchNorm under DDP
#
# `BatchNorm` normalises with the mean and variance of the batch it sees, and
# under DDP each rank sees only its share. Its running statistics (buffers,
# not parameters, so no gradient all-reduce touches them) are therefore each
# rank's own. DDP's `broadcast_buffers=True`, the default, copies rank 0's
# buffers to every rank at the start of each forward pass, so all ranks carry
# rank 0's statistics: statistics of rank 0's shares only. Below, the two
# shares come from different distributions, as they do when data is not
# shuffled well:

# %%
def batchnorm_under_ddp(rank, world_size):
    torch.manual_seed(0)
    x = torch.randn(32, 3) + torch.tensor([0.0, 5.0, -5.0])
    x[16:] += 2.0  # the second half differs
    mine = x[rank * 16:(rank + 1) * 16]
    d = rank_device(rank)
    plain = DDP(nn.BatchNorm1d(3, momentum=None).to(d))  # momentum=None: plain mean
    plain(mine.to(d))
    plain(mine.to(d))  # the second forward starts with rank 0's buffers
    # SyncBatchNorm's statistics, by hand: sums over every rank's samples
    sums = torch.stack([mine.sum(0), (mine**2).sum(0), torch.full((3,), 16.0)]).to(d)
    dist.all_reduce(sums)
    by_hand = (sums[0] / sums[2]).cpu()
    try:
        sync = nn.SyncBatchNorm(3, momentum=None).to(d)
        DDP(sync, device_ids=[rank] if d.type == "cuda" else None)(mine.to(d))
        synced = sync.running_mean.cpu()
    except ValueError as e:  # on CPU modules
        synced = f"ValueError: {e}"
    return (mine.mean(0), plain.module.running_mean.cpu(), by_hand, synced,
            x.mean(0))


bn = [r.value for r in launch(batchnorm_under_ddp, nprocs=2)]
fmt = lambda t: "[" + ", ".join(f"{v:6.2f}" for v in t.tolist()) + "]"  # noqa: E731
print("full-batch mean             ", fmt(bn[0][4]))
for rank, (share_mean, running, by_hand, *_) in enumerate(bn):
    print(f"rank {rank}: its share's mean   {fmt(share_mean)}")
    print(f"        running_mean        {fmt(running)} (BatchNorm1d under DDP)")
    print(f"        all-reduced mean    {fmt(by_hand)} (what SyncBatchNorm computes)")
print("SyncBatchNorm here:", bn[0][3] if isinstance(bn[0][3], str) else fmt(bn[0][3]))

# %% [markdown]
# Rank 1's running mean is no longer its own share's: the broadcast at the
# second forward replaced it with rank 0's, to which rank 1 then added its own
# batch. A checkpoint saved by rank 0 keeps rank 0's statistics. With
# well-shuffled shares of a decent size the difference is small; with small
# per-rank batches (a few images per GPU in detection or segmentation) the
# statistics of one share are too noisy. `nn.SyncBatchNorm` all-reduces the
# per-channel sums and sums of squares in every forward, so every rank
# normalises with the statistics of the global batch (the third line above,
# computed by hand). It runs only on GPU modules (the error above on a CPU);
# convert a model with `nn.SyncBatchNorm.convert_sync_batchnorm(model)` before
# wrapping it in DDP. The cost is one extra collective per BatchNorm layer per
# forward.
#
# ### Gradient buckets and overlap, seen in a profile
#
# DDP does not wait for the whole backward pass. It groups the parameters into
# **buckets** of about `bucket_cap_mb` megabytes (25 by default; the first
# bucket is smaller), in the reverse order of the forward pass, and starts the
# all-reduce of a bucket as soon as all its gradients are ready, while autograd
# computes the gradients of earlier layers. The profiler shows it: rank 0's
# backward pass on the main thread, the all-reduces on gloo's threads. A model
# of 8.4 MB of gradients fits in one bucket of 25 MB, so its only all-reduce
# waits for the end of the backward pass; with 1 MB buckets it is cut into
# eight, and the printed counts say how many of them began while autograd was
# still at work.

# %%
@contextlib.contextmanager
def quiet_stderr():
    """Hide C++ messages on stderr (the profiler announces its start and stop)."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_buckets(rank, world_size, bucket_cap_mb):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    x = torch.randn(256, 512)
    for _ in range(2):  # DDP settles its buckets in the first iterations
        ddp(x).sum().backward()
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        ddp(x).sum().backward()
    spans = []
    for e in prof.events():
        if e.name == "gloo:all_reduce":
            lane = "all_reduce (gloo threads)"
        elif e.name.startswith("autograd::engine::evaluate_function: AddmmBackward"):
            lane = "backward (main thread)"
        else:
            continue
        spans.append((lane, e.time_range.start / 1e6, e.time_range.end / 1e6))
    return spans


LANES = ["backward (main thread)", "all_reduce (gloo threads)"]
fig, axes = plt.subplots(2, 1, figsize=(8, 3.8), sharex=True)
for ax, cap in zip(axes, (25, 1), strict=True):
    spans = launch(profile_buckets, nprocs=2, args=(cap,), backend="gloo")[0].value
    reduces = [s for s in spans if s[0] == LANES[1]]
    backward_end = max(s[2] for s in spans if s[0] == LANES[0])
    early = sum(s[1] < backward_end for s in reduces)
    plot_timeline(spans, ax=ax, lanes=LANES,
                  title=f"bucket_cap_mb={cap}: {len(reduces)} all-reduce"
                        f"{'s' if len(reduces) > 1 else ''}, {early} started "
                        "during the backward pass")
    print(f"bucket_cap_mb={cap:>2}: {len(reduces)} all-reduces, {early} of them started "
          f"before the backward pass ended")
plt.tight_layout()
plt.show()

# %% [markdown]
# On a GPU the same picture holds with CUDA streams instead of threads: nccl's
# kernels run on their own stream beside the backward kernels. Smaller
# buckets start communication earlier but pay the per-call latency more often
# (section 5); the default is a compromise, worth tuning only with a profile
# like this one in hand. (To look at such a trace yourself, call
# `prof.export_chrome_trace("trace.json")` and open it in `chrome://tracing` or
# Perfetto.)
#
# ### When the ranks hang
#
# A distributed program that misbehaves usually does not crash: it waits. One
# rank calls a collective the others never call, or calls it with another
# shape, or died, and the rest wait in their next collective until the
# timeout. The tools, from the cheapest:
#
# - **Timeouts.** `init_process_group(timeout=timedelta(minutes=...))` bounds
#   every wait; the defaults are below. A smaller one turns a silent hang into
#   an error sooner.
# - **`dist.monitored_barrier(timeout=...)`** (gloo only) waits like a barrier
#   and, when it times out, names the ranks that did not arrive.
# - **`TORCH_DISTRIBUTED_DEBUG=DETAIL`** (set before the process group is
#   created) checks before every collective that all ranks call the same one
#   with the same shapes, and says which rank differs. It costs an extra
#   collective per call: for debugging only.
# - **`NCCL_DEBUG=INFO`** (GPUs) prints what nccl set up (rings, links, the
#   network it chose) and why a call failed; `NCCL_DEBUG_SUBSYS=COLL` logs every
#   collective.

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


for level in ("OFF", "DETAIL"):
    print(f"TORCH_DISTRIBUTED_DEBUG={level}:")
    for r in launch(mismatched_shapes, nprocs=2, args=(level,), init=False,
                    backend="gloo"):
        print(f"  rank {r.rank}: {r.value}")

# %% [markdown]
# Without the debug level, rank 0 returned a wrong result without a word, and
# rank 1 failed only because rank 0 went away; with nccl such a mismatch can
# just as well hang or corrupt memory. With `DETAIL`, both ranks stop at the
# faulty call and say which shapes differ. `monitored_barrier` finds a rank
# that is stuck elsewhere (here rank 1, busy for longer than the barrier
# waits):

# %%
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


for r in launch(one_rank_busy, nprocs=2, backend="gloo"):
    print(f"rank {r.rank}: {r.value}")

# %% [markdown]
# ### `torch.multiprocessing.spawn`
#
# Most tutorials start their ranks with `torch.multiprocessing.spawn(fn,
# args=..., nprocs=n)`: it starts `n` fresh interpreters and calls
# `fn(i, *args)` in each, `i` being the process index, so `fn` must set up its
# own process group. Two things to know. It uses the *spawn* start method, so
# `fn` must be importable from a module: a function defined in a notebook is
# not (the children cannot find it; Chapter 4). And it returns nothing: the
# children print to the terminal that started Jupyter, not to the notebook,
# so results come back through a queue here. With `join=False` it returns at
# once, and we wait with a deadline of our own, since `spawn` has no timeout.

# %%
SPAWNED = WORK / "spawned_ranks.py"

# %%
# %%writefile {SPAWNED}
"""A rank function for torch.multiprocessing.spawn: importable, so spawn finds it."""
import os

import torch
import torch.distributed as dist


def main(index, world_size, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=index, world_size=world_size)
    t = torch.tensor([index + 1.0])
    dist.all_reduce(t)
    results.put((index, os.getpid(), t.item()))
    dist.destroy_process_group()

# %%
sys.path.insert(0, str(WORK))
import spawned_ranks  # noqa: E402

results_queue = mp.get_context("spawn").SimpleQueue()
start = time.perf_counter()
context = mp.spawn(spawned_ranks.main, args=(2, free_port(), results_queue), nprocs=2,
                   join=False)
try:
    while not context.join(timeout=1):  # True once every process has ended
        if time.perf_counter() - start > LIMIT_S:  # derived from the start-up time
            raise TimeoutError(f"the spawned ranks did not finish in {LIMIT_S:.0f} s; "
                               f"load {os.getloadavg()[0]:.1f}: was the machine busy?")
finally:
    stop_tree([p.pid for p in context.processes if p.is_alive()])
for index, pid, total in sorted(results_queue.get() for _ in range(2)):
    print(f"spawned process {index}: pid {pid}, all_reduce gave {total}")
print(f"mp.spawn took {time.perf_counter() - start:.1f} s (fresh interpreters "
      "import torch; forked ranks do not)")

# %% [markdown]
# ### Elastic restarts
#
# On hundreds of GPUs something fails every few days: a GPU, a node, a
# network link. `torchrun --max-restarts=N` restarts *all* workers (up to `N`
# times) when one of them exits with an error, and the script resumes from its
# last checkpoint, which is why real training scripts save one every so often
# and load it at start. torchrun tells a worker how many restarts came before
# in `TORCHELASTIC_RESTART_COUNT`. The script below saves a checkpoint after
# every epoch and crashes once, on its first attempt, in epoch 2:

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
(WORK / "elastic.pt").unlink(missing_ok=True)


def elastic_agent(rank, world_size, path):
    """torchrun --standalone --nproc_per_node=2 --max-restarts=1, in this process."""
    # the workers host their own store (see below): restarts reconnect reliably
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=1,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                          run_id="elastic", monitor_interval=0.2, start_method="fork")
    elastic_launch(config, run_path)(path)


print("$ torchrun --standalone --nproc_per_node=2 --max-restarts=1", ELASTIC.name)
start = time.perf_counter()
agent = launch(elastic_agent, nprocs=1, args=(ELASTIC,), init=False, timeout=LIMIT_S,
               echo=False)[0]
print(agent.stdout, end="")
print("what ended attempt 0:", *(e for e in agent.stderr.splitlines() if "fails" in e))
print(f"two attempts took {time.perf_counter() - start:.1f} s")

# %% [markdown]
# The first attempt ran epochs 0 and 1 and died in epoch 2; torchrun stopped
# the surviving rank, started both again, and the second attempt went on from
# epoch 2. The final weights are those of four epochs, as if nothing had
# happened. What a crash costs is the work since the last checkpoint, plus the
# restart. (With `--nnodes=MIN:MAX` and a c10d rendezvous, torchrun can also go
# on with fewer or more nodes; the script must then cope with a new world
# size.)
#
# One trap: by default the restarted workers share torchrun's own key-value
# store with the attempt before, and in torch 2.13 the restarted ranks then
# often fail to connect (four runs in five when this course was tested),
# because they can read the previous attempt's addresses (PyTorch
# issue 135712, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0 is not compatible with
# torchelastic restarts"). Setting `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, as
# the cell does, gives every attempt a fresh store of its own.
#
# ### gloo or nccl
#
# Which backend for which tensors, as the PyTorch documentation's table of
# backends gives it ("Distributed communication package", docs of
# `torch.distributed`, Backends):
#
# | operation | gloo, CPU tensors | gloo, GPU tensors | nccl, CPU tensors | nccl, GPU tensors |
# | --- | --- | --- | --- | --- |
# | send, recv, barrier | yes | no | no | yes |
# | broadcast, all_reduce, reduce | yes | yes | no | yes |
# | all_gather, gather, scatter | yes | yes | no | yes |
# | reduce_scatter, all_to_all | yes | yes | no | yes |
#
# So: `nccl` for GPU tensors, one GPU per rank (two ranks on one GPU are
# refused), and it is by far the faster (it uses NVLink, and RDMA between
# nodes); `gloo` for CPU tensors, and as a fallback that can also move GPU
# tensors, slowly, through the host. A process group can have both:
# `init_process_group("cpu:gloo,cuda:nccl")` sends each tensor to the backend
# of its device. The gloo column for CPU tensors, checked here:

# %%
def gloo_ops(rank, world_size):
    n = world_size
    ops = {
        "send/recv": lambda: (dist.send(torch.ones(2), 1) if rank == 0
                              else dist.recv(torch.empty(2), 0)),
        "broadcast": lambda: dist.broadcast(torch.ones(2), 0),
        "all_reduce": lambda: dist.all_reduce(torch.ones(2)),
        "reduce": lambda: dist.reduce(torch.ones(2), 0),
        "all_gather": lambda: dist.all_gather([torch.empty(2) for _ in range(n)],
                                              torch.ones(2)),
        "gather": lambda: dist.gather(torch.ones(2), [torch.empty(2) for _ in range(n)]
                                      if rank == 0 else None, 0),
        "scatter": lambda: dist.scatter(torch.empty(2), [torch.ones(2)] * n
                                        if rank == 0 else None, 0),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(2),
                                                      [torch.ones(2)] * n),
        "all_to_all": lambda: dist.all_to_all([torch.empty(2) for _ in range(n)],
                                              [torch.ones(2)] * n),
        "barrier": dist.barrier,
    }
    works = {}
    for name, call in ops.items():
        try:
            call()
            works[name] = "works"
        except RuntimeError as e:
            works[name] = f"RuntimeError: {str(e).splitlines()[0][:60]}"
    return works


print("gloo with CPU tensors:", launch(gloo_ops, nprocs=2, backend="gloo")[0].value)

# %% [markdown]
# ### Throughput against the number of ranks
#
# What do more ranks buy? At a fixed batch per rank, each step processes `n`
# times the samples, and costs one rank's compute plus the part of the
# gradient all-reduce that does not overlap with it. Here, each rank trains
# the 8-layer model of the profile above; we measure the samples per second
# of all ranks together, on 1 rank and on as many as this machine has cores
# for (the ranks of a CPU machine compete for its cores and its memory
# bandwidth; GPUs do not share their compute).

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


top = min(usable_cores(), 4)
cpu_runs = {}
result = compare({f"{n} rank{'s' if n > 1 else ''}": per_sample_batch(n, "gloo", cpu_runs)
                  for n in sorted({1, top})}, repeats=3, warmup=0)
print("gloo, CPU ranks: time per 64 samples")
print(result)
for n, runs in cpu_runs.items():
    compute = [max(v["compute only (no_sync)"] for v in out) * 1e3 for out in runs]
    step = [max(v["DDP step"] for v in out) * 1e3 for out in runs]
    print(f"{n} rank(s): a step took {min(step):.1f}-{max(step):.1f} ms, of which "
          f"compute alone {min(compute):.1f}-{max(compute):.1f} ms")
if gpus:  # one GPU per rank, nccl: a real GPU run, even with a single GPU
    gpu_runs = {}
    print("nccl, one GPU per rank: time per 64 samples")
    print(compare({f"{n} GPU(s)": per_sample_batch(n, "nccl", gpu_runs)
                   for n in (1, 2, 4, 8) if n <= gpus}, repeats=3, warmup=0))

# %% [markdown]
# Two things keep `n` CPU ranks below `n` times the throughput of one; the
# step and compute ranges above show how much of each there was here, and the
# busy cores say whether the ranks had a core each. The ranks of a CPU
# machine share its cores, caches and memory bandwidth, so each may compute
# more slowly than a rank alone (GPUs do not share their arithmetic, though
# the ranks of a node share the CPU that feeds them). And part of the gradient
# all-reduce does not overlap with the backward pass: over the loopback
# network of one machine, gloo moves data at the bandwidths section 5
# measured.
#
# For GPUs, a model of one step predicts the same trade-off at scale. Take a
# language model of one billion parameters, `P = 1e9`, trained on `T` tokens
# per GPU per step. Its compute is about `6 P T` FLOPs (a forward and a
# backward pass; Kaplan et al., "Scaling Laws for Neural Language Models",
# 2020), here at the rate large matmuls reach (a calibrated fraction of the
# H100's dense bf16 peak); whole training steps reach less (the cell prints
# how much less a published run did), so the compute time is optimistic and
# the share of communication an upper bound. The gradient all-reduce moves
# `2 P` bytes (bf16) in NCCL's ring over NVLink or over PCIe, latency
# included. If it does not overlap with the
# backward pass, a step takes the sum; if it overlaps completely, the longer
# of the two. Drag the sliders:

# %%
PARAMS = 1e9


def predicted_step(tokens, n, link):
    compute = 6 * PARAMS * tokens / predict.achieved_flops("h100_sxm", "bf16")
    reduce = predict.allreduce_seconds(2 * PARAMS, n, link).value
    return compute, reduce


megatron = reference.published("megatron_2021.fraction_of_peak")
print(f"caveat: the compute bars assume {predict.matmul_efficiency():.0%} of peak, "
      "what one large matmul reaches; Megatron-LM's 3072-GPU training run reached "
      f"{megatron.value}% ({megatron.label}), so real steps take about "
      f"{predict.matmul_efficiency() * 100 / megatron.value:.1f}x the compute shown "
      "(a known gap of the calibration); and 8 GPUs on PCIe share the host's "
      "bandwidth: a published 8 x RTX 5090 run reached "
      f"{reference.published('nccl.rtx5090x8_pcie5_allreduce_busbw_gbps').value} GB/s "
      "bus bandwidth, about half the PCIe line's prediction")


def draw_scaling(tokens=16_384, n=8):
    links = (("nvlink_h100", "NVLink 4"), ("pcie5_x16", "PCIe 5.0 x16"))
    fig, ax = plt.subplots(figsize=(7, 2.9))
    for row, (link, name) in enumerate(links):
        compute, reduce = predicted_step(tokens, n, link)
        ax.barh(row, compute * 1e3, color="tab:blue",
                label="compute (6 P T FLOPs, matmul rate)" if row == 0 else None)
        ax.barh(row, reduce * 1e3, left=compute * 1e3, color="tab:orange",
                label="gradient all-reduce, if not overlapped" if row == 0 else None)
        print(f"{name:>12}: compute {compute * 1e3:6.1f} ms, all-reduce "
              f"{reduce * 1e3:6.1f} ms: {compute / (compute + reduce):4.0%} (no "
              f"overlap) to {compute / max(compute, reduce):4.0%} (full overlap) of "
              f"{n} x one GPU's throughput")
    ax.set_yticks(range(len(links)), [name for _, name in links])
    ax.set_xlabel("time per step (ms)")
    ax.set_title(f"Predicted (a model, not measured): {n} x "
                 f"{predict.gpu_name('h100_sxm')}\n1 B parameters, {tokens:,d} tokens "
                 "per GPU per step", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2)
    plt.tight_layout()
    plt.show()


widgets.interact(
    draw_scaling,
    tokens=widgets.SelectionSlider(options=[2**k for k in range(10, 17)], value=16_384,
                                   description="tokens/GPU", continuous_update=False),
    n=widgets.SelectionSlider(options=[2, 4, 8, 16, 32, 64], value=8,
                              description="GPUs n", continuous_update=False));

# %% [markdown]
# Two things to see. The all-reduce time hardly grows with `n`: a ring sends
# `2(n - 1)/n` times the gradient per GPU, which tends to twice the gradient,
# so data parallelism scales to many GPUs as long as the links are fast. And
# the ratio of compute to communication is set by the tokens per GPU, not by
# the model size (both grow in proportion to `P`): over NVLink it stays small
# down to small per-GPU batches; over slower links only overlap or larger
# per-GPU batches keep the GPUs busy. Between nodes the links are slower
# still (a network card of a few hundred Gbit/s per GPU; NVLink beyond the 8
# GPUs of a node needs NVIDIA's NVLink switch systems), which is why large
# runs keep the most communication-hungry parallelism inside a node
# (Chapter 7).

# %% [markdown]
# ## Summary
#
# - DDP runs one process per device; every rank runs the same code and learns
#   its role from its rank. The local rank, not the global rank, picks the GPU.
# - `torchrun` starts scripts (one node or many, via a rendezvous) and passes the
#   ranks in environment variables; a notebook launcher can do the same for
#   functions, but must choose a start method that is safe and clean up after
#   failures.
# - `DistributedSampler` gives each rank a disjoint share; `set_epoch` is needed
#   for a new shuffle each epoch. The DataLoader's batch size is per rank.
# - Averaging the gradients with an all-reduce makes N-rank training equal to
#   single-process training on the N-times larger batch, up to rounding.
# - Collectives are called by every rank of the group; their latency dominates
#   small messages, so bandwidth is measured on large ones. `*_object` variants
#   pickle, and cost more.
# - Save on rank 0, barrier, load with `map_location` and `weights_only=True`;
#   average logged losses with an all-reduce divided by the world size.
# - `no_sync()` saves the all-reduce of all but the last accumulation step;
#   `find_unused_parameters` or `static_graph` for parameters a step skips;
#   BatchNorm statistics stay per rank unless `SyncBatchNorm` (GPU) syncs them.
# - DDP all-reduces gradients in buckets during the backward pass; a profile
#   shows the overlap. Hangs are found with timeouts, `monitored_barrier` and
#   `TORCH_DISTRIBUTED_DEBUG=DETAIL`.
# - `torchrun --max-restarts` restarts every worker after a failure; the
#   script resumes from its last checkpoint.
# - A ring all-reduce costs about twice the gradient per GPU whatever the
#   number of GPUs; tokens per GPU and link speed decide how well DDP scales.

# %% [markdown]
# ## Exercises
#
# ### Exercise 6.1: average the gradients by hand
#
# DDP does this for you during `backward()`. Write `average_gradients(model)`,
# called on every rank after `loss.backward()`, that replaces each parameter's
# `.grad` by the mean of that gradient over all ranks. The default all_reduce
# sums; `dist.get_world_size()` tells you by how much. A frozen parameter
# (`requires_grad=False`) has no gradient: its `.grad` is `None`, and stays so.
# The checker runs your function on 2 and on 3 ranks.

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
# ### Exercise 6.2: a new shuffle every epoch
#
# Write `epoch_batches(dataset, rank, world_size, epochs, batch_size)` that
# returns, for each epoch, the list of batches this rank trains on, each batch as
# the list of its samples (the data set holds the numbers `0 .. n-1`, so a
# sample is its own index). Use a `DistributedSampler` with `shuffle=True` and a
# `DataLoader`; every epoch must be shuffled differently, and reproducibly.

# %% tags=["exercise"] exercise="6.2"
def epoch_batches(dataset, rank, world_size, epochs, batch_size):
    ### BEGIN SOLUTION
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    seen = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seen.append([batch[0].tolist() for batch in loader])
    return seen
    ### END SOLUTION


# %% tags=["check"] exercise="6.2"
check_epoch_batches(epoch_batches)

# %% [markdown]
# ### Exercise 6.3: a checkpoint every rank can trust
#
# Write `save_then_load(model, rank, path)`, called on every rank: rank 0 saves
# the model's `state_dict` to `path`, and then every rank loads it back into its
# own model, on the device its parameters are on, safely (`weights_only=True`).
# The checker runs it on 2 and on 3 ranks whose models start different; one
# rank arrives late, rank 0's `state_dict()` takes a while, as a big model's
# does, and the file says its tensors come from a GPU this machine lacks, as a
# checkpoint from a GPU server would. Every rank must end with rank 0's
# weights.

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
# | all-reduce | 全归约 |
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
# | synchronized BatchNorm | 同步批归一化 |
# | elastic training / restart | 弹性训练 / 重启 |
# | scaling efficiency | 扩展效率 |
