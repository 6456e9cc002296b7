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
# # Chapter 12: Seeing and surviving a distributed job
#
# **What you will learn**
#
# - To profile every rank with `torch.profiler`, merge the ranks' traces into
#   one timeline and read it: where DDP's all-reduces overlap the backward,
#   and which span names show a pipeline stage waiting or FSDP gathering.
# - To follow memory over time: the profiler's memory timeline on a CPU, and
#   the GPU's allocator snapshots.
# - To find a hang from data: the flight recorder's sequence numbers,
#   `TORCH_DISTRIBUTED_DEBUG=DETAIL`, `monitored_barrier`, timeouts and the
#   stacks of stuck ranks - each tied to the symptom it explains.
# - To survive a crash: `torchrun`'s elastic restarts resuming from a
#   distributed checkpoint, what a restart loses, and how often to save
#   given how often a big job fails.
# - What `torch.compile` changes in a training step, and why its first step
#   is slow.
#
# **Hardware.** Every tool here runs on CPU ranks joined by `gloo` (the
# profiled DDP run uses `nccl` when there is a GPU per rank): the
# traces, the flight recorder, the restarts and the checkpoints are real. The
# GPU-only tools (CUDA kernels in traces, the CUDA allocator's memory
# snapshots) are shown as code that runs when a GPU is present, and GPU
# figures as published results with their sources. `torch.compile` is never
# run in this notebook (its first compile of even a tiny training step took
# 16-21 s on this machine): its effect is shown as a figure measured once,
# with the code to run it by hand.

# %%
import json
import os
import pickle
import re
import shutil
import tempfile
import time
import warnings
from datetime import timedelta

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from course_utils import banner, reference, traces
from course_utils.checks.ch12 import (
    check_first_mismatch,
    check_hidden_fraction,
    check_resume,
)
from course_utils.dist import LaunchTimeout, RankFailed, free_port, launch
from course_utils.plots import plot_timeline

banner()
workdir = tempfile.TemporaryDirectory(prefix="ch12_")  # removed in the last cell
WORK = workdir.name

# %% [markdown]
# ## 1. A trace of every rank
#
# Chapter 6 timed DDP with a stopwatch; a profiler shows *what* ran *when*.
# Each rank runs its own `torch.profiler.profile`, and three habits keep the
# result readable:
#
# - **`record_function("name")`** puts your own spans (forward, backward,
#   optimizer) on the timeline, so the library's events have a frame.
# - **A schedule** records a few steps, not the whole run:
#   `schedule(wait=1, warmup=1, active=2)` skips one step, runs the profiler
#   through one more without keeping it (the first profiled step is usually
#   slower), then keeps two. A trace of every step of a long job is too big
#   to open.
# - **`on_trace_ready`** is called when the active steps end, with the
#   profiler in hand: export the trace there. Exporting after the `with`
#   block instead gives a nearly empty file when a schedule is used.

# %%
def profile_ddp(rank, world_size, outdir, steps=5):
    device = (torch.device("cuda", rank) if "nccl" in dist.get_backend()
              else torch.device("cpu"))
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if device.type == "cuda" else [])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def write_trace(prof):  # the profiler calls this when the active steps end
        prof.export_chrome_trace(f"{outdir}/rank{rank}.json")

    plan = schedule(wait=1, warmup=1, active=2, repeat=1)
    with profile(activities=activities, schedule=plan,
                 on_trace_ready=write_trace) as prof:
        for _ in range(steps):
            x = torch.randn(64, 256, device=device)
            with record_function("forward"):
                loss = ddp(x).square().mean()
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                opt.step()
                opt.zero_grad()
            prof.step()  # tells the schedule that a step ended
    by = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=by, row_limit=8,
                                     max_name_column_width=36)


results = launch(profile_ddp, 2, args=(WORK,), timeout=60, echo=False)
files = {r: f"{WORK}/rank{r}.json" for r in range(2)}
for r, path in files.items():
    print(f"rank {r}: {os.path.getsize(path) / 1e3:.0f} kB of trace for 2 of 5 steps")

# %% [markdown]
# **Per rank, in numbers.** `key_averages()` sums every event by name; below,
# rank 0's table. Two rows are the all-reduce. `gloo:all_reduce` spans the
# collective itself, which runs on gloo's own worker threads (so its self
# time on the main thread is 0). `c10d::allreduce_` is the call on the main
# thread that queues a bucket for them. On gloo that call is not always a
# quick hand-off: in some runs its `Self CPU %` is a large share of the step,
# because the call itself waits (while an all-reduce is in flight, or for a
# core), and the backward does not advance meanwhile. The cell after the table measures this wait
# from the trace and says which happened in this run. Over `nccl` the same
# call only queues a kernel on a stream and returns; the table is then
# sorted by GPU time, led by the kernels (`ncclDevKernel_AllReduce...`
# under `nccl:all_reduce`).

# %%
print(results[0].value)

# %% [markdown]
# **One timeline.** On one machine every rank's profiler reads the same
# clock, so the ranks' events can simply be put side by side.
# `course_utils.traces.merge_traces` does it (each rank becomes a process
# named `rank r`); `save_trace` writes a file that Perfetto
# (https://ui.perfetto.dev) or `chrome://tracing` opens. On several machines
# the clocks can differ by more than a collective lasts: align the traces on
# one collective that all ranks leave at about the same moment before
# reading them. Below, the last profiled step of each rank: the main
# thread's spans, and the all-reduces, one row per thread that runs them.

# %%
merged = traces.merge_traces(files)
traces.save_trace(merged, f"{WORK}/merged.json")  # open it in Perfetto
# with CUDA, every record_function span is repeated on the GPU's stream rows
merged = [e for e in merged if e.get("cat") != "gpu_user_annotation"]
comm_name = next((n for n in ("gloo:all_reduce", "nccl:all_reduce")
                  if traces.spans(merged, name=n)), "gloo:all_reduce")
rows, verdicts, waits = [], [], []
for r in range(2):
    steps = traces.spans(merged, name="ProfilerStep#3", rank=r)
    t0, t1 = steps[0].start, steps[0].end
    main = [s for s in traces.spans(merged, pattern="^(forward|backward|optimizer)$",
                                    rank=r) if t0 <= s.start < t1]
    comm = [s for s in traces.spans(merged, name=comm_name, rank=r)
            if t0 <= s.start < t1]
    rows += [(f"rank {r} main", s.start / 1e6, s.end / 1e6, s.name) for s in main]
    threads = sorted({s.thread for s in comm}, key=str)  # gloo: two at once
    rows += [(f"rank {r} comm {threads.index(s.thread) + 1}", s.start / 1e6,
              s.end / 1e6, "AR") for s in comm]
    backward = next(s for s in main if s.name == "backward")
    early = sum(s.start < backward.end for s in comm)
    verdicts.append(f"rank {r}: {early} of {len(comm)} all-reduces started "
                    "before its backward ended")
    ticks = np.arange(t0, t1, 5.0)  # the step in 5-microsecond ticks
    in_call, running = (np.any([(s.start <= ticks) & (ticks < s.end) for s in found]
                               + [ticks < t0], axis=0) for found in (
        traces.spans(merged, name="c10d::allreduce_", rank=r),
        traces.spans(merged, name=comm_name, rank=r)))
    during = (in_call & running).sum() / max(in_call.sum(), 1)
    waits.append(f"rank {r}: c10d::allreduce_ held the main thread for "
                 f"{in_call.mean():.0%} of the step, and an all-reduce was running "
                 f"during {during:.0%} of that time: " + (
                     "a quick hand-off this time" if in_call.mean() <= 0.1 else
                     "the call waited while communication ran" if during >= 0.5
                     else "the call waited, mostly before its all-reduce ran (for "
                     "a core, or for the other rank)"))
plot_timeline(rows, unit="ms", title="last profiled step of each rank (AR: "
              "all-reduce; last bar of a main row: optimizer)",
              lanes=sorted({row[0] for row in rows}, key=lambda lane: (
                  lane.split()[1], "main" not in lane, lane)))
plt.show()
print("\n".join(verdicts + waits))

# %% [markdown]
# Read it as Chapter 6 taught: the all-reduces start while the backward is
# still running (a bucket is sent as soon as its gradients are ready; the
# first lines under the plot count them), and the optimizer waits for the
# last one. The last two lines are the gloo caveat above, in numbers: when
# the main thread sits in `c10d::allreduce_` while an all-reduce runs, that
# communication is not hidden behind computing, it holds the backward up
# (and on two CPU cores the ranks' threads also take turns on the cores).
# On GPUs, NCCL's kernels run on a stream of their own and the overlap is
# real. With a GPU, the trace also holds the kernels
# (`ncclDevKernel_AllReduce...` on a CUDA stream): the `nccl:all_reduce`
# span on the CPU is only the launch, so measure overlap on the kernels.
#
# The same reading works for the other layouts. `torch.distributed.pipelining`
# labels each micro-batch `Forward i` / `Backward i`; the gaps between them on
# a stage's row are its bubble, and a long receive before a `Forward` is a
# stage waiting for the one before it. FSDP2 (`fully_shard`) labels
# `FSDP::all_gather (layers.3)`, `FSDP::pre_forward`,
# `FSDP::post_backward_reduce`: an all-gather that ends just before its
# layer's forward starts was not prefetched early enough.

# %% [markdown]
# ## 2. Memory over time
#
# A peak tells you *that* memory ran out; a timeline tells you *what* held it.
# With `profile_memory=True`, `record_shapes=True` and `with_stack=True`, the
# profiler can categorise every tensor (parameter, gradient, optimizer state,
# activation, ...) and `export_memory_timeline(path, device="cpu")` writes the
# bytes of each category at every allocation. Caveats, measured on torch
# 2.13: it needs `with_stack=True` (slow to record), it sees one process (no
# collectives' buffers across ranks), and it is deprecated in favour of the
# GPU snapshots below.

# The model is sized so that every category shows: a batch of 1,024 rows
# through a 256 -> 1,024 -> 256 MLP keeps 4 MiB per saved hidden activation
# against 2 MiB of parameters. `record_function` marks the phases, so each
# category can be read where it belongs.

# %%
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
             record_shapes=True, with_stack=True) as prof:
    for _ in range(2):
        x = torch.randn(1024, 256)
        with record_function("forward"):
            loss = model(x).square().mean()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prof.export_memory_timeline(f"{WORK}/memory.json", device="cpu")
print("warning:", str(caught[0].message).split(". ")[0] if caught else "none")
with open(f"{WORK}/memory.json") as f:
    times, sizes = json.load(f)
phases, todo = [], prof.profiler.kineto_results.experimental_event_tree()
while todo:  # the phases' spans in the profiler's event tree, on the timeline's clock
    e = todo.pop()
    todo += e.children
    try:
        if e.name in ("forward", "backward", "optimizer"):
            phases.append((e.name, e.start_time_ns / 1e3, e.end_time_ns / 1e3))
    except UnicodeDecodeError:  # torch 2.13 garbles a few names of Python frames
        pass
phases.sort(key=lambda phase: phase[1])

# %%
CATEGORIES = ["parameter", "optimizer state", "input", "temporary", "activation",
              "gradient", "autograd detail", "unknown"]
mib = np.array(sizes, dtype=float)[:, 1:] / 2**20  # column 0 is unused
ms = (np.array(times) - times[0]) / 1e3
fig, ax = plt.subplots(figsize=(8, 3.8))
ax.stackplot(ms, mib.T, labels=CATEGORIES, step="post")
top = mib.sum(1).max()
for name, start, end in phases:
    start, end = (start - times[0]) / 1e3, (end - times[0]) / 1e3
    ax.axvline(start, color="black", lw=0.6, ls=":")
    ax.text((start + end) / 2, top * 1.04, name, ha="center", fontsize=7)
ax.set(xlabel="time (ms)", ylabel="MiB", ylim=(0, top * 1.15))
ax.set_title("memory timeline of two Adam steps (CPU, profiler)", pad=10)
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()
print(f"{'phase':<12}" + "".join(f"{c[:10]:>11}" for c in CATEGORIES[:6]))
for step, (name, start, end) in enumerate(phases):
    inside = [i for i, t in enumerate(times) if start <= t <= end]
    if inside:
        peak = mib[inside].max(0)
        print(f"{name + (' 1' if step < 3 else ' 2'):<12}"
              + "".join(f"{v:>11.1f}" for v in peak[:6]))
params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(f"(MiB, the largest value of each category in each phase) parameters "
      f"counted from the model: {params:.2f} MiB; one saved hidden activation, "
      f"1024 x 1024 x 4 bytes: {1024 * 1024 * 4 / 2**20:.0f} MiB")

# %% [markdown]
# Read it phase by phase, against the table. The parameters sit at the
# bottom all along. In each **forward**, activations grow: the hidden layer
# and its ReLU are kept for the backward. The **backward** frees them while it
# creates the gradients (and, as "autograd detail", the gradients of the
# activations on the way). Adam's two moments appear in the first
# **optimizer** step and stay. The categories are inferred from the autograd
# graph and the optimizer, not declared by anyone, so read the odd label with
# care: the buffers that Adam's update allocates and frees show up inside
# the optimizer phases as "parameter" or "activation" above the parameters'
# own size, and the input batch is counted as "input".
#
# **On a GPU** the allocator itself keeps a history: every allocation and free
# with its Python stack. Record it, take a snapshot, and drop the pickle on
# https://pytorch.org/memory_viz, which draws the same picture per
# allocation, including the allocator's fragmentation. A published example
# (*Understanding GPU Memory 1: Visualizing All Allocations over Time*, Aaron
# Shi and Zachary DeVito, PyTorch blog, 2023): a snapshot of three training
# iterations shows three peaks, memory rising in each forward pass and
# falling in the backward as gradients are computed, with many tiny spikes
# that are temporary buffers of convolutions. On a CPU-only build these
# functions are not usable (`_record_memory_history` raises `AttributeError`
# about `_cuda_record_memory_history`):

# %%
if torch.cuda.is_available():
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    gpu_model = nn.Linear(1024, 1024).cuda()
    gpu_model(torch.randn(512, 1024, device="cuda")).sum().backward()
    torch.cuda.memory._dump_snapshot(f"{WORK}/snapshot.pickle")
    torch.cuda.memory._record_memory_history(enabled=None)  # stop recording
    print("GPU snapshot written; open it at https://pytorch.org/memory_viz")
else:
    print("no GPU: the allocator snapshot is the GPU path; the CPU timeline above "
          "is what this machine can show")

# %% [markdown]
# ## 3. Hangs found from data
#
# A distributed job hangs when one rank waits in a collective that another
# rank never joins. The usual cause is a code path that differs between
# ranks: a collective inside `if rank == 0`, a data loader that gives one
# rank one batch fewer, an early `return`. The rank that is *stuck* is not
# the rank that is *wrong*, and the waiting rank's error names only itself.
# You need data from every rank.
#
# **The flight recorder** keeps, in every process, a ring buffer of the last
# collectives: operation, sizes, and a sequence number that counts the
# collectives of the process group. Ranks that run the same program have the
# same operation at the same number; the first number where they differ is
# the bug. Enable it with `TORCH_FR_BUFFER_SIZE` (entries kept) **before** the
# process group is created. On NCCL it dumps itself on a timeout
# (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`, files named by `TORCH_FR_DUMP_TEMP_FILE`,
# formerly `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`);
# here each rank asks for its buffer with
# `torch._C._distributed_c10d._dump_fr_trace()` (a pickle). Rank 1 below skips
# one `broadcast`:

# %%
def skip_one_broadcast(rank, world_size, skipper=1, skipped_step=1):
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"  # before the process group
    dist.init_process_group("gloo", timeout=timedelta(seconds=1.5))
    x = torch.ones(8)
    error = None
    try:
        for step in range(3):
            dist.all_reduce(x)
            if not (rank == skipper and step == skipped_step):  # the bug
                dist.broadcast(x, src=0)
    except RuntimeError as e:  # gloo gives up after the group's timeout
        error = str(e).splitlines()[0][-60:]
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return error, dump["entries"]


fr = launch(skip_one_broadcast, 2, init=False, timeout=30, echo=False)
dumps = {r.rank: r.value[1] for r in fr}
for r in fr:
    print(f"rank {r.rank} raised: ...{r.value[0]}")
print(f"\n{'seq':>4} | {'rank 0':<24}| rank 1")
by_seq = [{e["collective_seq_id"]: e for e in dumps[r]} for r in range(2)]
for seq in sorted(set(by_seq[0]) | set(by_seq[1])):
    cells = [f"{d[seq]['profiling_name']} {d[seq]['input_sizes']}" if seq in d
             else "-" for d in by_seq]
    print(f"{seq:>4} | {cells[0]:<24}| {cells[1]}")

# %% [markdown]
# Both ranks timed out, each blaming the pair it was waiting on; the table
# shows the cause: at sequence number 4 rank 0 broadcast while rank 1 had
# gone on to the next all-reduce. Each entry also holds the Python stack of
# the call (`frames`) and timestamps. PyTorch's analyser (`python -m
# torch.distributed.flight_recorder.fr_trace` over a folder of dumps) does
# this matching for NCCL dumps; in 2.13 it fails on gloo dumps (a
# `KeyError`), and Exercise 12.2 has you write the matching yourself.
#
# **`TORCH_DISTRIBUTED_DEBUG=DETAIL`** checks every collective *before* it
# runs: each rank sends the others a fingerprint (sequence number, operation,
# shapes) and a mismatch raises at once, on every rank, naming both sides.
# It costs an extra exchange per collective, so it is for debugging runs. It
# is read when the process group is created (here set in the rank, then
# applied with `set_debug_level_from_env()`):

# %%
def mismatch_with_detail(rank, world_size):
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=0)
    except RuntimeError as e:
        return str(e)
    return "no error"


message = launch(mismatch_with_detail, 2, init=False, timeout=30,
                 echo=False)[0].value
# both sides, without the tensor options that repeat on each
print(re.sub(r", TensorDtypes=.*?\)\)", "", message).replace(", but", ",\nbut")
      .replace(".Collectives", ".\nCollectives"))

# %% [markdown]
# **`monitored_barrier`** answers "which rank is late?": rank 0 waits for each
# other rank in turn and names the first one that does not arrive within the
# timeout (gloo only; with NCCL, create a gloo group for it). Put one before a
# suspect section. **Process-group timeouts** (`init_process_group(...,
# timeout=)`) decide how long a collective may wait before it raises; the
# default is 10 minutes for NCCL and 30 for gloo: a short one turns a silent
# hang into an error, at the risk of killing a job that was merely slow (a
# long checkpoint save on rank 0 while the others wait in a barrier).

# %%
def one_rank_late(rank, world_size):
    dist.init_process_group("gloo", timeout=timedelta(seconds=10))
    if rank == 1:
        time.sleep(1.5)  # stands for a rank stuck in its data loader
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1))
        return "passed"
    except RuntimeError as e:
        return str(e).splitlines()[0]


print(launch(one_rank_late, 2, init=False, timeout=30, echo=False)[0].value)

# %% [markdown]
# **Stacks of stuck ranks.** When nothing raises (an NCCL job with a long
# timeout, a rank stuck in Python), ask each process where it is:
# `py-spy dump --pid PID` prints a live process's Python stack, and
# `faulthandler` (what this course's launcher uses) prints it on a signal.
# Here rank 1 is stuck elsewhere (a `sleep` stands for a data loader that
# never returns) while rank 0 waits in the all-reduce; the launcher's timeout
# reports each rank's stack:

# %%
def rank1_stuck(rank, world_size):
    if rank == 1:
        time.sleep(60)  # stuck before the collective
    dist.all_reduce(torch.ones(4))


try:
    launch(rank1_stuck, 2, timeout=2.5, backend="gloo", echo=False)
except (LaunchTimeout, RankFailed) as e:
    print("\n".join(line for line in str(e).splitlines()
                    if " was in " in line or "all_reduce (" in line
                    or "rank1_stuck (" in line or "sleep" in line))

# %% [markdown]
# | symptom | tool | what it tells |
# | --- | --- | --- |
# | job silent, GPUs busy at 100 % | flight recorder dumps | the first sequence number where ranks disagree |
# | a collective times out, the error says nothing of why | `TORCH_DISTRIBUTED_DEBUG=DETAIL` | both ranks' operation and shapes, at once |
# | one rank slow to arrive | `monitored_barrier` | which rank is late |
# | job silent for ever | process-group `timeout` | turns a hang into an error |
# | hang in Python, not in a collective | `py-spy dump`, `faulthandler` | each rank's stack |

# %% [markdown]
# ## 4. Surviving failures
#
# A synchronous job stops when any rank dies. `torchrun --max-restarts N`
# (its *agent*) then stops the other workers, starts them all again and sets
# `TORCHELASTIC_RESTART_COUNT` to the restart's number. On one machine:
#
# ```
# torchrun --standalone --nproc-per-node 2 --max-restarts 1 train.py
# ```
#
# Everything in the workers' memory is lost: weights, optimizer state, the
# scheduler's position, random generators, the data loader's place. What is
# kept is what was saved: a restart is only as good as the last checkpoint.
#
# To run torchrun's own agent without paying for fresh interpreters, this
# notebook calls it as a function: `elastic_launch(LaunchConfig(...), fn)` is
# what `torchrun` runs, here with forked workers (a command-line torchrun
# starts a fresh Python interpreter for its agent and for each worker, and
# each of them imports torch again).
# `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` makes the restarted workers connect
# to a fresh store; without it restarts failed to reconnect on torch 2.13
# (pytorch/pytorch#135712). The agent itself runs in one process of the
# course's launcher, so a time limit and the clean-up still apply.

# %%
def run_elastic(train, args, restarts=1, timeout=60.0):
    """Run ``train(*args)`` on 2 workers under torchrun's agent; their results."""
    def agent(_rank, _world_size):
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # pytorch#135712
        tempfile.tempdir = WORK  # torchrun's logs and error files: removed at the end
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2,
                              max_restarts=restarts, run_id="ch12",
                              rdzv_backend="c10d",
                              rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              monitor_interval=0.1, start_method="fork")
        return elastic_launch(config, train)(*args)
    return launch(agent, 1, init=False, timeout=timeout, echo=False)[0].value

# %% [markdown]
# The training script. Its data are a function of the step (`make_batch`
# seeds a generator with the step and the rank), so a resumed run sees the
# same batches as an uninterrupted one. The checkpoint functions are
# parameters; this first version saves the model only, with
# `torch.distributed.checkpoint` (Chapter 9: each rank writes its part, and
# `.metadata` is written last, so a checkpoint cut short is never read),
# and a file `latest` that rank 0 replaces atomically once every rank has
# saved. Rank 1 dies at `crash_at` in the first attempt (`os._exit`, as a
# killed process would: no clean-up).

# %%
def build_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    return model, optimizer, scheduler


def make_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def elastic_train(ckpt_dir, steps, every, crash_at, save, load):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, optimizer, scheduler = build_training()
    start = load(ckpt_dir, model, optimizer, scheduler)
    for step in range(start, steps):
        x, y = make_batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if (step + 1) % every == 0:
            save(ckpt_dir, step + 1, model, optimizer, scheduler)
        if step == crash_at and attempt == 0 and rank == 1:
            os._exit(1)  # a rank dies
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    del model, optimizer, scheduler  # the reducer goes before its group (Ch. 6)
    dist.destroy_process_group()
    return {"attempt": attempt, "start": start, "weights": weights}


def save_model_only(ckpt_dir, step, model, optimizer, scheduler):
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{ckpt_dir}/step{step}")
    dist.barrier()  # every rank has written its part
    if dist.get_rank() == 0:
        with open(f"{ckpt_dir}/latest.tmp", "w") as f:
            f.write(str(step))
        os.replace(f"{ckpt_dir}/latest.tmp", f"{ckpt_dir}/latest")


def load_model_only(ckpt_dir, model, optimizer, scheduler):
    if not os.path.exists(f"{ckpt_dir}/latest"):
        return 0
    with open(f"{ckpt_dir}/latest") as f:
        step = int(f.read())
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{step}")  # in place
    model.load_state_dict(state["model"])
    return step

# %% [markdown]
# First the uninterrupted run, timed; its time sets the deadline of the run
# with a crash (four times as long, at least 30 s), rather than a guess.

# %%
STEPS, EVERY, CRASH_AT = 12, 4, 6
os.makedirs(f"{WORK}/clean")
started = time.perf_counter()
clean = run_elastic(elastic_train, (f"{WORK}/clean", STEPS, EVERY, -1,
                                    save_model_only, load_model_only))
clean_s = time.perf_counter() - started
print(f"uninterrupted: {STEPS} steps on 2 workers in {clean_s:.1f} s, "
      f"load average {os.getloadavg()[0]:.1f}")

# %%
for attempt in (1, 2):  # once more only if a busy machine missed the deadline
    shutil.rmtree(f"{WORK}/crash", ignore_errors=True)
    os.makedirs(f"{WORK}/crash")
    try:
        crashed = run_elastic(elastic_train, (f"{WORK}/crash", STEPS, EVERY,
                                              CRASH_AT, save_model_only,
                                              load_model_only),
                              timeout=max(30.0, 4 * clean_s))
        break
    except LaunchTimeout as e:
        print(f"no end within {max(30.0, 4 * clean_s):.0f} s (load average "
              f"{os.getloadavg()[0]:.1f}: a busy machine); the end of its log:\n"
              f"{str(e)[-1500:]}")
        if attempt == 2:
            raise
done = crashed[0]
print(f"rank 1 died after step {CRASH_AT + 1}; attempt {done['attempt']} resumed at "
      f"step {done['start']}, so steps {done['start'] + 1}..{CRASH_AT + 1} ran twice")
gap = (done["weights"] - clean[0]["weights"]).abs().max().item()
print(f"largest weight difference from the uninterrupted run: {gap:.1e} -> "
      + ("the same training" if gap < 1e-6 else
         "a different training: the optimizer's moments and the learning-rate "
         "schedule were lost at the restart"))

# %% [markdown]
# The restart worked - the agent noticed the dead worker, restarted both and
# the job finished - but the result is not the run that was meant: Adam
# started again from zero moments and the scheduler from the initial learning
# rate. Exercise 12.3 makes it exact.
#
# **A restart with another world size.** Above, the job came back with as
# many workers as before. When a machine is lost and no spare replaces it,
# torchrun can restart with fewer (`--nnodes MIN:MAX`: the rendezvous admits
# the workers that are there), and then more changes than the process count:
#
# - **Sharded state** (FSDP, ZeRO, tensor parallelism) was cut for N ranks
#   and must be cut again for N'. DCP stores each shard with its place in the
#   whole tensor (in `.metadata`), so `dcp.load` into state dicts sharded for
#   the new mesh reads, on each rank, the saved pieces that overlap its new
#   shard. Replicated state (DDP) loads as before.
# - **The global batch** is N times the per-rank batch: keep it by changing
#   the per-rank batch or the gradient accumulation, or the learning-rate
#   schedule meets other batches than it was tuned for.
# - **The data order**: batches drawn as a function of (step, rank), as
#   `make_batch` does, now cover other samples; resume a loader by the
#   number of samples consumed, not by rank.
# - **Per-rank random states** (dropout) have no counterpart to restore.
#
# The cell below saves an FSDP2-sharded model and its Adam state on 3 ranks
# and loads both on 2; each rank's piece of the first weight changes shape,
# and the whole state gathered afterwards equals the saved one.

# %%
def sharded_training(rank, world_size, ckpt, save):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (world_size,))  # CPU ranks, also beside GPUs
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)  # each parameter cut in world_size pieces
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    if save:  # one step, so that Adam has moments to save
        model(torch.randn(4, 10)).square().mean().backward()
        optimizer.step()
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer),
                     strict=True))
    if save:
        dcp.save(state, checkpoint_id=ckpt)
    else:  # a fresh model sharded for this world size, filled in place
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    whole = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    return tuple(model[0].weight.to_local().shape), whole


saved = launch(sharded_training, 3, args=(f"{WORK}/resharded", True),
               backend="gloo", echo=False)
loaded = launch(sharded_training, 2, args=(f"{WORK}/resharded", False),
                backend="gloo", echo=False)
print("rank pieces of the first weight (7 x 10): saved by 3 ranks",
      [r.value[0] for r in saved], "- loaded by 2 ranks", [r.value[0] for r in loaded])
(model_a, optim_a), (model_b, optim_b) = saved[0].value[1], loaded[0].value[1]
same = all(torch.equal(model_a[k], model_b[k]) for k in model_a) and all(
    torch.equal(optim_a["state"][k][m], optim_b["state"][k][m])
    for k in optim_a["state"] for m in ("exp_avg", "exp_avg_sq"))
print("weights and Adam's moments after resharding:",
      "equal to the saved ones" if same else "DIFFERENT")

# %% [markdown]
# **How often to save?** Saving costs time $\delta$ per checkpoint; a failure
# costs the work since the last checkpoint, half an interval $\tau$ on average,
# plus a restart $R$. With a mean time between failures $M$, the fraction of
# time lost is about $\delta/\tau + (\tau/2 + R)/M$, smallest at
# $\tau = \sqrt{2 \delta M}$ (Young, *A first order approximation to the
# optimum checkpoint interval*, CACM 1974). The number that matters is $M$,
# and it shrinks with the number of GPUs. Published, for Llama 3 405B:

# %%
sources = []
for key in ("llama3.unexpected_interruptions", "llama3.planned_interruptions",
            "llama3.gpus", "llama3.faulty_gpu_interruptions",
            "llama3.hbm3_interruptions", "llama3.effective_training_time"):
    e = reference.published_entry(key)
    sources += [reference.cite(e)] * (reference.cite(e) not in sources)
    print(f"{e['quantity']}: {e['value']} {e['unit']} "
          f"[{sources.index(reference.cite(e)) + 1}]")
print("\n".join(f"[{i}] published: {c}" for i, c in enumerate(sources, 1)))
days, gpus = 54, reference.published_entry("llama3.gpus")["value"]
stops = reference.published_entry("llama3.unexpected_interruptions")["value"]
gpu_stops = sum(reference.published_entry(k)["value"] for k in (
    "llama3.faulty_gpu_interruptions", "llama3.hbm3_interruptions"))
mtbf_h = days * 24 / stops
print(f"the whole job: {days} days x 24 h / {stops} = one unexpected interruption "
      f"every {mtbf_h:.1f} h")
print(f"one GPU: {days} days x {gpus:,} GPUs / {stops} = one every "
      f"{days * gpus / stops / 365:.1f} years if each interruption is charged to "
      f"one GPU; counting only the faulty-GPU and HBM3 rows ({gpu_stops}): one "
      f"every {days * gpus / gpu_stops / 365:.1f} years")

# %% [markdown]
# So GPUs that each fail once in 6 to 11 years (the last line) stop a job of
# 16,384 of them every few hours. Young's interval is the first term of a
# series in $\sqrt{\delta/M}$. Daly (*A higher order estimate of the optimum checkpoint interval
# for restart dumps*, Future Generation Computer Systems 22(3), 2006) adds the
# next terms, for $\delta < 2M$:
# $\tau = \sqrt{2\delta M}\,\bigl[1 + \tfrac{1}{3}\sqrt{\delta/(2M)} +
# \tfrac{1}{9}\,\delta/(2M)\bigr] - \delta$ (and $\tau = M$ beyond). The two
# differ by a few percent while a save takes well under a percent of $M$;
# Young's is enough there. Daly's matters when saves are long against the
# failure interval (set the save to 30 minutes below). The curve is Daly's
# complete model for failures at a constant rate, whose first-order terms
# are the fraction above. Drag the sliders: the failure interval, the save
# time and the restart cost, against the hours lost per day.

# %%
def lost_fraction(interval_s, save_s, mtbf_s, restart_s=0.0):
    """Share of the time not spent on new work, failures at a constant rate.

    Daly's complete model (wall time per unit of work); to first order it is
    Young's save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s.
    """
    wall_per_work = (mtbf_s * np.exp(restart_s / mtbf_s)
                     * np.expm1((interval_s + save_s) / mtbf_s) / interval_s)
    return 1 - 1 / wall_per_work


def young_interval(save_s, mtbf_s):
    return np.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s, mtbf_s):
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return young_interval(save_s, mtbf_s) * (1 + np.sqrt(x) / 3 + x / 9) - save_s


def draw_checkpoint_cost(mtbf_h=3.0, save_min=1.0, restart_min=10.0):
    mtbf_s, save_s, restart_s = mtbf_h * 3600, save_min * 60, restart_min * 60
    intervals = np.geomspace(save_s / 4 + 30, 8 * mtbf_s, 300)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(intervals / 60, 24 * lost_fraction(intervals, save_s, mtbf_s, restart_s),
            "--", label="hours lost per day (predicted)")
    for name, tau, style in (("Young", young_interval(save_s, mtbf_s), "o"),
                             ("Daly", daly_interval(save_s, mtbf_s), "s")):
        lost = 24 * lost_fraction(tau, save_s, mtbf_s, restart_s)
        ax.plot(tau / 60, lost, style, label=f"{name}: every {tau / 60:.0f} min, "
                f"{lost:.1f} h/day")
    ax.set(xscale="log", ylim=(0, 24), xlabel="checkpoint interval (minutes)",
           ylabel="hours lost per day")
    ax.set_title(f"M = {mtbf_h:g} h, save {save_min:g} min, restart "
                 f"{restart_min:g} min (Young 1974, Daly 2006)", fontsize=9, pad=8)
    ax.legend(fontsize=8, loc="lower left")
    plt.show()


print(f"M defaults to the Llama 3 405B figure above ({mtbf_h:.1f} h); the save and "
      "restart times are assumed, not published")
widgets.interact(
    draw_checkpoint_cost,
    mtbf_h=widgets.FloatLogSlider(value=round(mtbf_h, 1), base=10, min=-0.5, max=3,
                                  description="M (h)", continuous_update=False),
    save_min=widgets.FloatLogSlider(value=1.0, base=10, min=-1.5, max=1.5,
                                    description="save (min)",
                                    continuous_update=False),
    restart_min=widgets.FloatSlider(value=10.0, min=0, max=60, step=1,
                                    description="restart (min)",
                                    continuous_update=False));
print("caveat: not calibrated: no published measurement of the time a run lost to "
      "checkpoints was found; the model assumes failures at a constant rate")

# %% [markdown]
# What the curves say: at the Llama 3 failure rate a checkpoint every few
# hours loses a large share of each day however fast it saves, so saving
# cheaply (asynchronous saving, `dcp.async_save`, Chapter 9) is what lets a
# job save often. The restart cost $R$ raises the curve everywhere but
# leaves the best interval where it is: only a faster start-up wins that
# time back, which is why the Llama 3 report describes reducing job
# start-up and checkpointing times.

# %% [markdown]
# ## 5. Compilation: `torch.compile`
#
# `torch.compile(fn)` changes *how* a training step runs, not what it
# computes. On the first call, TorchDynamo reads the Python bytecode and
# captures the tensor operations as a graph (breaking it where Python does
# something it cannot trace), AOTAutograd derives the backward graph ahead of
# time, and TorchInductor fuses the operations into generated kernels - C++ with
# OpenMP on a CPU, Triton on a GPU - then compiles them. Guards (shapes,
# dtypes, Python values the graph depends on) are checked on every later call;
# a call that breaks one recompiles. So the first step is slow (tracing plus
# a C++ or Triton compiler), later steps skip Python and launch fewer,
# fused kernels, and a new input shape costs another compile (use
# `dynamic=True` or fixed shapes). With DDP, Dynamo splits the graph at bucket
# boundaries so that all-reduces still overlap the backward.
#
# This notebook never compiles (it would cost 16-21 s of this notebook's
# time for one tiny step, more for a real model). The cell below shows the
# code to run by hand - set `RUN_COMPILE = True` - and, until then, a figure
# measured once.

# %%
RUN_COMPILE = False  # True: compile here (20 s or more the first time on a CPU)


def compile_demo(steps=30):
    """Seconds per step: eager, then compiled (first step, median of later)."""
    torch.set_num_threads(1)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    result = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256),
                            nn.LayerNorm(256), nn.Linear(256, 10))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step(x, y, net=net):
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            return loss

        run = torch.compile(step) if name == "compiled" else step
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            run(x, y)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
        result[name] = {"first_s": times[0], "later_s": float(np.median(times[5:]))}
    return result


if RUN_COMPILE:
    print(compile_demo())
else:  # measured once for this course, on the machine that builds it
    print("measured once (not here) on this course's 2-core AMD EPYC build machine, "
          "torch 2.13.0+cpu, 1 thread, 2026-11-25, two runs of this cell's step, "
          "each starting with an empty compile cache:")
    MEASURED_ONCE = {  # seconds: eager step, compiled first step, compiled later
        "run 1, load average 1.8": (4.27e-3, 15.8, 3.67e-3),
        "run 2, load average 3.1": (11.3e-3, 20.6, 3.72e-3)}
    for run, (eager, first, later) in MEASURED_ONCE.items():
        print(f"  {run}: eager {eager * 1e3:.2f} ms/step; compiled: first step "
              f"{first:.1f} s, later {later * 1e3:.2f} ms/step "
              f"({eager / later:.1f}x eager, first step = {first / later:,.0f} later)")
    gains = [eager / later for eager, _, later in MEASURED_ONCE.values()]
    print(f"the speed-up of later steps: {min(gains):.1f}x to {max(gains):.1f}x in "
          f"two runs ({max(gains) / min(gains):.1f}x apart): two runs give a range, "
          "not a figure")
gain = reference.published("torch_compile.speedup_range")
print(f"GPU: {gain.extra['quantity']}: {gain.value['low']}x to {gain.value['high']}x "
      f"[{gain.label}]")

# %% [markdown]
# The two runs disagree: the compiled steps took the same time in both, but
# the eager step moved with the machine's load, so the speed-up is only
# known as the range printed above, and two runs cannot say which end is
# typical (run the cell by hand, several times, for more). What both runs
# agree on is the first step: it cost as much as thousands of later ones, so
# compiling pays only in long runs. The losses agreed to 1.5e-8. That first
# step also matters for fault tolerance: every restarted worker of Section 4
# compiles again, so keep the on-disk compile cache
# (`TORCHINDUCTOR_CACHE_DIR`, under /tmp by default) where a restarted
# worker finds it and can reuse the kernels already generated.

# %% [markdown]
# ## Summary
#
# - Profile each rank with `record_function` spans, a `schedule` and
#   `on_trace_ready`; on one machine the ranks' traces share a clock and
#   merge into one timeline. Measure communication on the communication
#   spans (gloo's threads, NCCL's kernels), not on the launch.
# - The CPU memory timeline (`export_memory_timeline`, deprecated, needs
#   `with_stack=True`) shows parameters, activations, gradients and optimizer
#   state over time, phase by phase; on GPUs use `_record_memory_history`
#   and memory_viz.
# - A hang is found from every rank's data: the flight recorder's first
#   mismatched sequence number; `DETAIL` debug checks each collective;
#   `monitored_barrier` names a late rank; timeouts turn hangs into errors;
#   stacks show where each rank waits.
# - torchrun restarts workers; only what was checkpointed survives. Save
#   model, optimizer, scheduler and step together; make the data a function
#   of the step. DCP reshards on load when the world size changes. Choose
#   the interval from the save time and the failure rate: $\sqrt{2\delta M}$
#   (Young), with Daly's correction when a save is long against $M$.
# - `torch.compile` traces, fuses and compiles: a slow first step, faster
#   later ones, a recompile on each new shape.
#
# ## Exercises

# %% [markdown]
# ### Exercise 12.1: how much communication is hidden?
#
# Write `hidden_fraction(events, comm="gloo:all_reduce", compute="backward")`.
# `events` is a merged trace (a list of Chrome trace events, `pid` = rank, as
# `merge_traces` returns); `comm` and `compute` are exact event names. Return
# the fraction of communication time that runs while the same rank computes:
# on each rank, the time during which at least one `comm` span runs *and* a
# `compute` span runs, summed over ranks, divided by the time during which at
# least one `comm` span runs, summed over ranks. A span is a complete event
# (`"ph": "X"`, from `ts` to `ts + dur`) or a begin event (`"ph": "B"`) with
# the end event (`"ph": "E"`) that closes it: the latest open `B` of the same
# `pid` and `tid` (they nest like brackets; an `E` need not repeat the name;
# a thread's events come in the order they happened). Other events do not
# count. Return 0.0 when there is no communication at all.

# %% tags=["exercise"] exercise="12.1"
def hidden_fraction(events, comm="gloo:all_reduce", compute="backward"):
    ### BEGIN SOLUTION
    def union(intervals):
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return merged

    per_rank, open_spans = {}, {}
    for e in events:
        thread = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            open_spans.setdefault(thread, []).append(e)
            continue
        if e.get("ph") == "E" and open_spans.get(thread):
            begin = open_spans[thread].pop()
            name, start, end = begin.get("name"), begin["ts"], e["ts"]
        elif e.get("ph") == "X":
            name, start, end = e.get("name"), e["ts"], e["ts"] + e["dur"]
        else:
            continue
        if name in (comm, compute):
            spans = per_rank.setdefault(e["pid"], {comm: [], compute: []})
            spans[name].append((start, end))
    total = hidden = 0.0
    for spans in per_rank.values():
        talk, work = union(spans[comm]), union(spans[compute])
        total += sum(end - start for start, end in talk)
        hidden += sum(max(0.0, min(e1, e2) - max(s1, s2))
                      for s1, e1 in talk for s2, e2 in work)
    return hidden / total if total else 0.0
    ### END SOLUTION


# %% tags=["check"] exercise="12.1"
check_hidden_fraction(hidden_fraction, merged)

# %% [markdown]
# ### Exercise 12.2: the first mismatched collective
#
# Write `first_mismatch(dumps)`. `dumps` maps each rank to its flight-recorder
# entries (the `"entries"` list of a dump, as in Section 3). Entries of
# point-to-point operations (`"is_p2p": True`) do not count. Two ranks agree on
# a collective when they have an entry with the same `collective_seq_id` and
# the same `profiling_name` and `input_sizes` (the shape of each input tensor,
# in order: a collective may take several). A ring buffer keeps only the
# last entries, so the ranks' lists may start at different sequence numbers:
# compare only from the first number that every rank still holds. Return
# `None` when the ranks agree on every number from there to the largest one
# any rank holds; otherwise `(seq, entries)`, where `seq` is the first number
# at which they do not, and `entries` maps every rank to its entry with that
# number (or `None` if it has none). The dumps are the evidence of a hang:
# read them without changing them.

# %% tags=["exercise"] exercise="12.2"
def first_mismatch(dumps):
    ### BEGIN SOLUTION
    by_rank = {r: {e["collective_seq_id"]: e for e in entries if not e.get("is_p2p")}
               for r, entries in dumps.items()}
    held = [set(d) for d in by_rank.values() if d]
    if not held:
        return None
    first, last = max(min(s) for s in held), max(max(s) for s in held)
    for seq in range(first, last + 1):
        entries = {r: d.get(seq) for r, d in by_rank.items()}
        keys = {None if e is None else (e["profiling_name"], str(e["input_sizes"]))
                for e in entries.values()}
        if len(keys) > 1 or None in keys:
            return seq, entries
    return None
    ### END SOLUTION


# %% tags=["check"] exercise="12.2"
check_first_mismatch(first_mismatch, dumps)

# %% [markdown]
# ### Exercise 12.3: a restart that changes nothing
#
# Write the two checkpoint functions that `elastic_train` (Section 4) calls,
# so that a run in which a rank dies at any step and torchrun restarts it
# ends with the same weights as an uninterrupted run, and loses at most the
# steps since the last checkpoint:
#
# - `save_checkpoint(ckpt_dir, step, model, optimizer, scheduler)` is called on
#   every rank after `step` steps (`step` a multiple of the interval); it must
#   save whatever a restart needs under `ckpt_dir`, each rank calling
#   `dcp.save` (which writes each rank's part and `.metadata` last).
# - `load_checkpoint(ckpt_dir, model, optimizer, scheduler)` is called on every
#   rank of every attempt, before training; it restores the newest complete
#   checkpoint, if there is one, and returns the number of steps it holds
#   (0 when there is none). A save can die half-way, leaving a folder whose
#   data files are written but whose `.metadata` is not: that checkpoint is
#   not complete.
#
# `model` is DDP-wrapped, `optimizer` an Adam, `scheduler` a StepLR. Use
# `torch.distributed.checkpoint` (`dcp.save` / `dcp.load`); for the optimizer,
# `get_state_dict(model, optimizer)` and `set_state_dict(...)` from
# `torch.distributed.checkpoint.state_dict` give state dicts that `dcp` can
# load in place (a fresh Adam's own `state_dict()` has no moments to fill).
# The checker restarts your functions three times in the same processes (once
# in the middle of a save), then under torchrun's agent with a crash at a
# random step, and compares the weights.

# %% tags=["exercise"] exercise="12.3"
def save_checkpoint(ckpt_dir, step, model, optimizer, scheduler):
    ### BEGIN SOLUTION
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state,
              "scheduler": scheduler.state_dict(), "step": step},
             checkpoint_id=f"{ckpt_dir}/step{step}")
    dist.barrier()  # every rank has written its part before it counts
    if dist.get_rank() == 0:
        with open(f"{ckpt_dir}/latest.tmp", "w") as f:
            f.write(str(step))
        os.replace(f"{ckpt_dir}/latest.tmp", f"{ckpt_dir}/latest")
    ### END SOLUTION


def load_checkpoint(ckpt_dir, model, optimizer, scheduler):
    ### BEGIN SOLUTION
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.exists(f"{ckpt_dir}/latest"):
        return 0
    with open(f"{ckpt_dir}/latest") as f:
        step = int(f.read())
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state,
             "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{step}")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]
    ### END SOLUTION


# %% tags=["check"] exercise="12.3"
check_resume(save_checkpoint, load_checkpoint)

# %%
workdir.cleanup()  # the traces, dumps and checkpoints of this notebook

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | trace | 跟踪（轨迹）文件 |
# | span | 时间区间（跨度） |
# | profiler schedule | 性能分析调度 |
# | memory timeline | 内存时间线 |
# | memory snapshot | 显存快照 |
# | hang | 挂起（卡死） |
# | flight recorder | 飞行记录器 |
# | sequence number | 序列号 |
# | collective mismatch | 集合通信不匹配 |
# | timeout | 超时 |
# | elastic restart | 弹性重启 |
# | checkpoint interval | 检查点间隔 |
# | mean time between failures (MTBF) | 平均故障间隔时间 |
# | graph capture | 计算图捕获 |
# | kernel fusion | 算子融合 |
