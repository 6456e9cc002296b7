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
# # Chapter 7: Model and pipeline parallelism
#
# **What you will learn**
#
# - How to split one model across devices, and why the backward pass crosses
#   the split by itself (the chain rule).
# - Why a naively split model leaves devices idle, and how micro-batches
#   (GPipe) shrink the **bubble** to `(p - 1) / (m + p - 1)`.
# - 1F1B: the same bubble, far less memory; `torch.distributed.pipelining`,
#   PyTorch's pipeline library; and pipeline + data parallelism together.
#
# **Hardware.** The stages are real processes that pass activations and
# gradients to each other through `gloo` - on GPUs, one stage per GPU - so the
# bubble below is measured, not drawn. On a 2-core machine each stage gets a
# core. Without GPUs, the chapter says so and adds labelled predictions.

# %%
import copy
import time
from importlib.util import find_spec

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from IPython.display import Image, display
from torch import nn

from course_utils import banner, images, reference
from course_utils.build import ROOT
from course_utils.checks.ch07 import check_gpipe, check_idle_fraction, check_one_f_one_b
from course_utils.dist import launch
from course_utils.plots import plot_timeline

banner()

# %% [markdown]
# ## 1. Splitting a model
#
# Model parallelism puts different layers on different devices. The forward
# pass moves the activation from one device to the next (`.to(device)`); the
# backward pass needs nothing more: `.to()` is an operation autograd records,
# so the gradient flows back across the split by the chain rule. Two halves
# give the same loss and gradients as the whole model, on any devices:

# %%
gpus = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
dev_a, dev_b = (gpus + gpus + [torch.device("cpu")] * 2)[:2] if gpus else \
    (torch.device("cpu"), torch.device("cpu"))
torch.manual_seed(0)
whole = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                      nn.Linear(64, 8))
part_a = copy.deepcopy(whole[:2]).to(dev_a)
part_b = copy.deepcopy(whole[2:]).to(dev_b)
x, y = torch.randn(16, 32), torch.randn(16, 8)
nn.functional.mse_loss(whole(x), y).backward()
out = part_b(part_a(x.to(dev_a)).to(dev_b))
nn.functional.mse_loss(out, y.to(dev_b)).backward()
pairs = zip(list(part_a.parameters()) + list(part_b.parameters()), whole.parameters(),
            strict=True)
worst = max((p.grad.cpu() - q.grad).abs().max().item() for p, q in pairs)
print(f"parts on {dev_a} and {dev_b}: largest gradient difference {worst:.1e}"
      + ("" if gpus else " (no GPU: both parts on the CPU, the same code)"))

# %% [markdown]
# ## 2. Stages as processes, and the bubble
#
# In one process the two halves run one after the other even on two GPUs:
# the second waits for the first. To see what a pipeline does we give each
# stage its own process (as each GPU would have its own stream of work):
# stage 0 runs its layers and **sends** the activation to stage 1, which
# finishes the forward pass and the loss; then stage 1 sends the gradient of
# its input back, and stage 0 finishes the backward pass. Each stage records
# when each forward (F) and backward (B) ran.
#
# With the batch in one piece, one stage always waits for the other: half of
# the time is idle. Cutting the batch into `m` **micro-batches** lets stage 0
# start the second micro-batch while stage 1 works on the first (GPipe:
# all forwards, then all backwards). The idle fraction, the **bubble**, is
# `(p - 1) / (m + p - 1)` for `p` stages if every step takes the same time.

# %%
WIDTH, BATCH = 256, 256


def pipeline_rank(rank, world_size, micro_batch_counts, repeats):
    """Stage `rank` of a GPipe pipeline; returns its spans and its gradients."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(8)]
    per = len(layers) // world_size
    stage = nn.Sequential(*[m for layer in layers[rank * per:(rank + 1) * per]
                            for m in (layer, nn.Tanh())])
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    runs = {}
    for m in micro_batch_counts:
        best = None
        for _ in range(repeats):
            stage.zero_grad()
            dist.barrier()
            t0, spans, saved = time.perf_counter(), [], []
            for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
                start = time.perf_counter() - t0
                if rank == 0:
                    inp = xm
                else:
                    inp = torch.empty(xm.shape[0], WIDTH)
                    dist.recv(inp, rank - 1)
                    inp.requires_grad_()
                    start = time.perf_counter() - t0  # work starts when data is here
                out = stage(inp)
                if rank < world_size - 1:
                    dist.send(out.detach(), rank + 1)
                else:
                    out = nn.functional.mse_loss(out, ym, reduction="sum") / y.numel()
                saved.append((inp, out))
                spans.append((f"stage {rank}", start, time.perf_counter() - t0, f"F{i}"))
            for i in reversed(range(m)):
                inp, out = saved[i]
                if rank == world_size - 1:
                    start = time.perf_counter() - t0
                    out.backward()
                else:
                    grad = torch.empty_like(out)
                    dist.recv(grad, rank + 1)
                    start = time.perf_counter() - t0
                    out.backward(grad)
                if rank > 0:
                    dist.send(inp.grad, rank - 1)
                spans.append((f"stage {rank}", start, time.perf_counter() - t0, f"B{i}"))
            total = time.perf_counter() - t0
            if best is None or total < best[0]:
                best = (total, spans)
        runs[m] = best
    grads = [p.grad.clone() for p in stage.parameters()]
    return runs, grads


M_SWEEP = [1, 2, 4, 8]
P = 2
results = launch(pipeline_rank, P, args=(M_SWEEP, 3), timeout=120)
runs = [r.value[0] for r in results]

# the same 8 layers in one process: the gradients must agree
torch.manual_seed(0)
ref_layers = [nn.Linear(WIDTH, WIDTH) for _ in range(8)]
ref = nn.Sequential(*[m for layer in ref_layers for m in (layer, nn.Tanh())])
torch.manual_seed(1)
xr, yr = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
nn.functional.mse_loss(ref(xr), yr).backward()
piped = [g for r in results for g in r.value[1]]
worst = max((a - p.grad).abs().max().item()
            for a, p in zip(piped, ref.parameters(), strict=True))
print(f"pipelined gradients against one process: largest difference {worst:.1e}")

# %%
def measured_bubble(rank_runs, m):
    spans = [s for r in rank_runs for s in r[m][1]]
    return images_bubble(spans, [f"stage {r}" for r in range(len(rank_runs))])


def images_bubble(spans, lanes):
    start = min(s[1] for s in spans)
    end = max(s[2] for s in spans)
    return 1 - sum(s[2] - s[1] for s in spans) / (len(lanes) * (end - start))


bubbles = {m: measured_bubble(runs, m) for m in M_SWEEP}
predicted = reference.predicted(
    {"x": M_SWEEP, "y": [(P - 1) / (m + P - 1) for m in M_SWEEP]}, "fraction idle",
    f"{P} stages", "GPipe bubble (p - 1) / (m + p - 1): equal, fixed-cost steps, "
    "free communication")
for m in M_SWEEP:
    print(f"m = {m}: measured bubble {bubbles[m]:.2f}, predicted "
          f"{(P - 1) / (m + P - 1):.2f}")
fig, ax = plt.subplots(figsize=(6.0, 3.4))
ax.plot(M_SWEEP, [bubbles[m] for m in M_SWEEP], marker="o", label="measured here")
ax.plot(M_SWEEP, predicted.value["y"], linestyle="--", label=predicted.legend)
ax.set_xscale("log", base=2)
ax.set_xlabel("micro-batches m")
ax.set_ylabel("idle fraction (bubble)")
ax.set_title(f"GPipe with {P} stage processes")
ax.legend()
plt.show()
gap = bubbles[M_SWEEP[-1]] - predicted.value["y"][-1]
print("verdict: " + ("the bubble shrinks with m, as predicted" if
      bubbles[M_SWEEP[-1]] < bubbles[1] else "the bubble did not shrink here: the "
      "machine was busy (run it again)")
      + f"; at m = {M_SWEEP[-1]} it is {gap:+.2f} from the formula, which ignores the "
      "cost of each send and receive and of smaller matmuls")

# %%
for m in (1, 4):
    spans = [s for r in runs for s in r[m][1]]
    plot_timeline(spans, title=f"GPipe, {P} stage processes, m = {m} "
                  f"(measured, bubble {bubbles[m]:.0%})")
    plt.show()

# %% [markdown]
# Read the two timelines: with `m = 1` the stages take turns; with `m = 4`
# stage 1 starts its first forward while stage 0 computes the second, and the
# idle triangles at the start and the end are the bubble. More micro-batches
# shrink it, until each one is so small that the fixed costs (a send, a
# receive, a kernel launch on a GPU) dominate - the measured curve flattens
# above the formula. The seed's `split_size` experiment (the official PyTorch
# model-parallel tutorial) shows the same trade-off as a curve with a best
# split size.
#
# ## 3. 1F1B: the same bubble, less memory
#
# GPipe keeps every micro-batch's activations until its backward: `m` of them
# on each stage. **1F1B** (one forward, one backward) starts the backward of a
# micro-batch as soon as it can and alternates: after a short warm-up, stage
# `s` holds at most `p - s` micro-batches. The time is the same; the memory is
# bounded by the number of stages instead of micro-batches:

# %%
display(Image(filename=str(ROOT / "images" / "pipeline_schedules.png")))

# %% [markdown]
# Drag the sliders to draw both schedules for other `p` and `m` (the model:
# every forward and backward takes one time unit, communication is free):

# %%
def draw_schedules(p=4, m=8):
    fig, axes = plt.subplots(2, 1, figsize=(9, 1.1 * p + 1.6), sharex=True)
    for ax, (name, sched) in zip(axes, (("GPipe", images.gpipe_schedule(p, m)),
                                         ("1F1B", images.one_f_one_b_schedule(p, m))),
                                 strict=True):
        spans = [(f"stage {s}", t, t + 1, f"{k}{i}") for s, ops in enumerate(sched)
                 for t, k, i in ops]
        plot_timeline(spans, ax=ax, unit="s", lanes=[f"stage {s}" for s in range(p)],
                      title=f"{name}: at most {max(images.in_flight(o) for o in sched)}"
                            " micro-batches held")
    plt.tight_layout()
    plt.show()
    print(f"bubble (p - 1) / (m + p - 1) = {(p - 1) / (m + p - 1):.0%} for both")


widgets.interact(draw_schedules,
                 p=widgets.IntSlider(min=2, max=6, value=4, description="stages p",
                                     continuous_update=False),
                 m=widgets.IntSlider(min=1, max=16, value=8, description="micro m",
                                     continuous_update=False));

# %% [markdown]
# ## 4. `torch.distributed.pipelining`
#
# PyTorch's pipeline library splits a model into stages, runs them in
# processes, and provides the schedules (`ScheduleGPipe`, `Schedule1F1B`,
# interleaved and zero-bubble variants). It replaced the old
# `torch.distributed.pipeline.sync.Pipe`, which no longer exists:

# %%
print("torch.distributed.pipeline (the old Pipe):",
      "present" if find_spec("torch.distributed.pipeline") else "gone")


def library_rank(rank, world_size, m):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(8)]
    per = len(layers) // world_size
    stage_mod = nn.Sequential(*[mod for layer in layers[rank * per:(rank + 1) * per]
                                for mod in (layer, nn.Tanh())])
    stage = PipelineStage(stage_mod, rank, world_size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=m,
                             loss_fn=lambda out, tgt: nn.functional.mse_loss(out, tgt))
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    return [p.grad.clone() for p in stage_mod.parameters()]


lib = launch(library_rank, P, args=(4,), timeout=120)
lib_grads = [g for r in lib for g in r.value]
worst = max((a - p.grad).abs().max().item()
            for a, p in zip(lib_grads, ref.parameters(), strict=True))
print(f"ScheduleGPipe, {P} processes, 4 micro-batches: largest gradient difference "
      f"from one process {worst:.1e}")

# %% [markdown]
# (By default the library averages over micro-batches, so the loss of each
# micro-batch is its mean and the gradients equal the whole batch's when the
# micro-batches are equal. On GPUs each stage is given its GPU as `device`.)
#
# ## 5. Pipeline and data parallelism together
#
# Large language models combine both: the layers are split into `p` pipeline
# stages, and the whole pipeline is replicated `d` times for data parallelism
# (and, inside each stage, tensors are split across GPUs: tensor parallelism,
# a later chapter). A device mesh of `d x p` GPUs names the groups: the
# all-reduce of data parallelism runs among the `d` copies of each stage, the
# sends and receives of the pipeline along each copy. The pipeline's bubble
# shrinks with more micro-batches per replica, which is why such training
# runs use large global batches.
#
# ## Summary
#
# - A model split over devices computes the same gradients: `.to()` is
#   differentiable.
# - Stages that hand work to each other are idle unless the batch is cut into
#   micro-batches; GPipe's bubble is `(p - 1) / (m + p - 1)`, and per-message
#   costs keep the measured one above it.
# - 1F1B has the same bubble and holds at most `p - s` micro-batches on stage
#   `s`; `torch.distributed.pipelining` provides these schedules.

# %% [markdown]
# ## Exercises
#
# ### Exercise 7.1: a GPipe schedule
#
# Write `gpipe_schedule(p, m)`: for each of the `p` stages, the list of the
# operations it runs, in order, as `("F", i)` and `("B", i)` for micro-batch
# `i`. GPipe runs all forwards, then all backwards. The checker runs your
# schedule (each operation one time unit, each waiting for its input) and
# wants it as short as a pipeline can be.

# %% tags=["exercise"] exercise="7.1"
def gpipe_schedule(p, m):
    ### BEGIN SOLUTION
    return [[("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
            for _ in range(p)]
    ### END SOLUTION


# %% tags=["check"] exercise="7.1"
check_gpipe(gpipe_schedule)

# %% [markdown]
# ### Exercise 7.2: a 1F1B schedule
#
# Write `one_f_one_b(p, m)` in the same form: as fast as GPipe, but holding at
# most `p - s` micro-batches (forwarded, not yet backwarded) on stage `s`.

# %% tags=["exercise"] exercise="7.2"
def one_f_one_b(p, m):
    ### BEGIN SOLUTION
    order = []
    for s in range(p):
        warm = min(p - s, m)
        ops = [("F", i) for i in range(warm)]
        f = warm
        for b in range(m):
            ops.append(("B", b))
            if f < m:
                ops.append(("F", f))
                f += 1
        order.append(ops)
    return order
    ### END SOLUTION


# %% tags=["check"] exercise="7.2"
check_one_f_one_b(one_f_one_b)

# %% [markdown]
# ### Exercise 7.3: the measured bubble
#
# Write `idle_fraction(spans, lanes)`: the idle fraction of a timeline, from
# spans `(lane, start, end)` or `(lane, start, end, label)` and the list of
# all lanes (a lane may have no span): one minus the busy time over the
# lanes' time from the first start to the last end.

# %% tags=["exercise"] exercise="7.3"
def idle_fraction(spans, lanes):
    ### BEGIN SOLUTION
    start = min(s[1] for s in spans)
    end = max(s[2] for s in spans)
    return 1 - sum(s[2] - s[1] for s in spans) / (len(lanes) * (end - start))
    ### END SOLUTION


# %% tags=["check"] exercise="7.3"
check_idle_fraction(idle_fraction)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | model parallelism | 模型并行 |
# | pipeline parallelism | 流水线并行 |
# | stage | 阶段（流水线级） |
# | micro-batch | 微批次 |
# | bubble | 气泡（空闲时间） |
# | one forward one backward (1F1B) | 一前一后调度 |
# | activation | 激活值 |
# | device mesh | 设备网格 |
