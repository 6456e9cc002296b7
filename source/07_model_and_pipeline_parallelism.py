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
#   the split by itself: the chain rule, done by hand once, then by autograd.
# - Why a naively split model leaves devices idle, and how micro-batches
#   (GPipe) shrink the **bubble** to `(p - 1) / (m + p - 1)` - predicted,
#   simulated and measured.
# - 1F1B: the same bubble, far less memory; interleaved stages; the schedules
#   of `torch.distributed.pipelining`, PyTorch's pipeline library, including
#   zero-bubble and DualPipeV.
# - Pipeline and data parallelism together, on a 2 x 2 device mesh.
#
# **Hardware.** The stages are real processes that pass activations and
# gradients to each other, so the bubble below is measured, not drawn: with a
# GPU for every stage, each process drives its own GPU through `nccl`;
# otherwise the stages run on CPU cores through `gloo` (on a 2-core machine
# each of two stages gets a core; four stages share them). The seed's
# one-process loop runs on two GPUs, on one GPU beside the CPU, or on the CPU
# alone. Without GPUs, the GPU side is shown as the published results of
# PyTorch's model-parallel tutorial and as labelled predictions.

# %%
import copy
import functools
import time
import warnings
from importlib.util import find_spec

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn

from course_utils import banner, plots, predict, reference
from course_utils.checks.ch07 import (
    check_one_f_one_b,
    check_split_stages,
    check_two_stage_step,
)
from course_utils.compare import compare
from course_utils.dist import launch
from course_utils.plots import plot_timeline

banner();

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
dev_a, dev_b = (gpus * 2)[:2] if gpus else (torch.device("cpu"),) * 2
torch.manual_seed(0)
whole = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                      nn.Linear(64, 8))
part_a = copy.deepcopy(whole[:2]).to(dev_a)
part_b = copy.deepcopy(whole[2:]).to(dev_b)
x, y = torch.randn(16, 32), torch.randn(16, 8)
nn.functional.mse_loss(whole(x), y).backward()
out = part_b(part_a(x.to(dev_a)).to(dev_b))
nn.functional.mse_loss(out, y.to(dev_b)).backward()


def worst_difference(parts, reference_model):
    pairs = zip([p for part in parts for p in part.parameters()],
                reference_model.parameters(), strict=True)
    return max((p.grad.cpu() - q.grad).abs().max().item() for p, q in pairs)


print(f"parts on {dev_a} and {dev_b}: largest gradient difference "
      f"{worst_difference((part_a, part_b), whole):.1e}"
      + ("" if gpus else " (no GPU: both parts on the CPU, the same code)"))

# %% [markdown]
# What autograd did at the boundary, by hand. With `h` the activation that
# crosses it, the chain rule gives the second half's gradients from the loss
# directly, and the first half's through `h`:
# $\partial L / \partial w_a = (\partial L / \partial h)\,(\partial h /
# \partial w_a)$. So cut the graph at `h` (`detach`), back-propagate the
# second half, which leaves $\partial L / \partial h$ in `h_in.grad`, and hand
# that to the first half: `h.backward(h_in.grad)`. That is exactly what a
# pipeline stage does with the gradient it receives from the next stage.

# %%
for part in (part_a, part_b):
    part.zero_grad()
h = part_a(x.to(dev_a))  # stage 1
h_in = h.detach().to(dev_b).requires_grad_()  # the boundary: a new leaf
nn.functional.mse_loss(part_b(h_in), y.to(dev_b)).backward()  # stage 2
h.backward(h_in.grad.to(dev_a))  # the gradient crosses back by hand
print("by hand: largest gradient difference from the whole model "
      f"{worst_difference((part_a, part_b), whole):.1e}")

# %% [markdown]
# Seed 000, after PyTorch's old parallelism tutorial, computes an embedding
# on the CPU and the rest of the model on the GPU.
#
# **Claim** (seed 000): the embedding goes on the CPU because it needs high
# precision and little computation. **Measured here**: a lookup returns the
# table's rows bit for bit, on any device. **Why**: a lookup copies rows and
# does no arithmetic, so there is no precision to gain (the tutorial gives no
# reason at all: it only shows the mechanics). The reason to keep a table on
# the CPU is memory: a large vocabulary's table may not fit beside the model
# on the GPU, and a lookup, little computation, is cheap wherever it runs.
#
# The seed's module passed its parts to `nn.Module.__init__`, which raises
# `TypeError`; with `super().__init__()` first and the parts assigned after,
# it runs:

# %%
class EmbeddingOnCpu(nn.Module):
    def __init__(self, device, vocab=1000, width=16):
        super().__init__()
        self.device = device
        self.embedding = nn.Embedding(vocab, width)  # stays on the CPU
        self.rest = nn.Sequential(nn.Linear(width, width), nn.Tanh(),
                                  nn.Linear(width, 4)).to(device)

    def forward(self, tokens):
        return self.rest(self.embedding(tokens).mean(1).to(self.device))


split_model = EmbeddingOnCpu(dev_b)
tokens = torch.randint(0, 1000, (8, 12))
logits = split_model(tokens)
logits.sum().backward()
print(f"embedding on cpu, the rest on {dev_b}: logits {tuple(logits.shape)} on "
      f"{logits.device}; the embedding's gradient is on "
      f"{split_model.embedding.weight.grad.device}"
      + ("" if gpus else " (no GPU: both on the CPU)"))
table = split_model.embedding.weight.detach()
looked_up = {"cpu": split_model.embedding(tokens).detach()}
if gpus:  # the same lookup on a GPU
    looked_up[str(dev_b)] = nn.functional.embedding(tokens.to(dev_b),
                                                    table.to(dev_b)).cpu()
print("lookups equal to the table's rows, bit for bit: "
      + ", ".join(f"{where} {torch.equal(rows, table[tokens])}"
                  for where, rows in looked_up.items()))

# %% [markdown]
# ## 2. The seed's micro-batch loop, in one process
#
# The official PyTorch tutorial the seed follows splits a ResNet-50 over two
# GPUs and then feeds each batch as `split_size`-image pieces: while the
# second GPU works on piece `k`, the first already computes piece `k + 1`.
# In one process, with no threads. That works on GPUs only because a CUDA
# launch returns at once: Python queues piece `k + 1` on GPU 0 while GPU 1
# still runs piece `k`. On a CPU every operator returns when it is done, so
# the same loop runs the pieces one after the other, and cutting the batch
# cannot gain from overlap. The comparison below runs the options
# interleaved and judges them from their own numbers (the course's
# comparison protocol, `course_utils.compare`: wall and CPU seconds, busy
# cores, what other programs used). With GPUs the same loop runs beside it:
# on two GPUs as in the tutorial; on one GPU, the first half on the CPU and
# the second on the GPU, so the CPU computes piece `k + 1` while the GPU runs
# piece `k` - at most the GPU half's time can hide.

# %%
def seed_split_loop(first, second, batch, split_size):
    """The tutorial's loop: piece k on `second` while piece k + 1 on `first`."""
    pieces = iter(batch.split(split_size))
    prev = first(next(pieces))
    outs = []
    for nxt in pieces:
        outs.append(second(prev))  # asynchronous on a GPU, blocking on a CPU
        prev = first(nxt)
    outs.append(second(prev))
    return torch.cat(outs)


def make_halves(width, device_1, device_2):
    """Two halves of 4 Linear layers; the second moves its input to its device."""
    torch.manual_seed(0)
    first = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).to(device_1)
    second = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).to(device_2)
    return first, lambda h: second(h.to(device_2))


def timed_loop(halves, batch, split_size, devices):
    """One run of the loop; it ends when every GPU involved has finished."""
    def run():
        with torch.no_grad():
            seed_split_loop(*halves, batch, split_size)
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
    return run


cpu = torch.device("cpu")
places = [("CPU", cpu, cpu, 512, 240)]
if len(gpus) >= 2:  # the tutorial's case, at a size where the GPUs have work
    places.append((f"{gpus[0]} + {gpus[1]}", gpus[0], gpus[1], 2048, 3840))
elif gpus:  # one GPU: the blocking half on the CPU, the asynchronous one on it
    places.append((f"CPU + {gpus[0]}", cpu, gpus[0], 512, 240))
for where, d1, d2, width, rows in places:
    halves = make_halves(width, d1, d2)
    batch = torch.randn(rows, width, device=d1)
    print(f"{where}: {rows} x {width} batch, 4 + 4 Linear({width})")
    print(compare({f"split_size {rows // k}": timed_loop(halves, batch, rows // k,
                                                         (d1, d2))
                   for k in (1, 4, 12)}, repeats=3))

# %% [markdown]
# The tutorial published its GPU results (section 4 puts them beside the CPU
# measurement): 4.02 s for its two-GPU split fed whole batches, 2.51 s with
# `split_size=20` and 2.43 s at its best `split_size`, 12 - and it notes the
# trade-off: small pieces mean many tiny kernel launches, large ones long
# idle stretches at the start and the end. On a CPU the honest analogue needs
# two workers that really run at once: two processes, one per stage.
#
# ## 3. A schedule simulator
#
# Before measuring, a model of what to expect. Each of `p` ranks runs one
# operation at a time: the forward (F) or the backward (B) of a micro-batch
# on one of its stages. An operation starts when its input exists - a
# forward needs the previous stage's forward of the same micro-batch, a
# backward the next stage's backward - and its rank is free. Which waiting
# operation a rank takes is the schedule:
#
# - **GPipe**: all forwards first, then all backwards;
# - **1F1B**: a backward as soon as one can run, and a forward only while
#   fewer than `p - rank` micro-batches are in flight (forwarded, not yet
#   backwarded), which bounds the memory;
# - **interleaved**: each rank holds `v` stages (chunks) of the model -
#   rank 0 the 1st and the (p+1)-th, ... - each costing `1/v` of the time.
#
# The simulator is the loop below: thirty lines, no library.

# %%
def simulate(p, m, schedule, v=1, f=1.0, b=2.0):
    """Spans (rank, start, end, label) of p ranks running m micro-batches.

    The model has p * v stages; stage k lives on rank k % p. An op is
    (kind, i, k): the forward "F" or backward "B" of micro-batch i on stage k.
    Among the ops a rank may start (its inputs done, and the schedule allows
    it), the one that can start first runs (a backward on a tie). A forward
    costs f, a backward b, divided by v.
    """
    stages = p * v

    def needs(op):
        kind, i, k = op
        if kind == "F":
            return [("F", i, k - 1)] if k > 0 else []
        return [("B", i, k + 1)] if k < stages - 1 else [("F", i, k)]

    done, free, spans = {}, [0.0] * p, []
    todo = {(kind, i, k) for kind in "FB" for i in range(m) for k in range(stages)}
    while todo:
        best = None
        for op in todo:
            rank = op[2] % p
            if any(d not in done for d in needs(op)) or not schedule(op, rank, done,
                                                                     p, m, v):
                continue
            start = max([free[rank]] + [done[d] for d in needs(op)])
            key = (start, op[0] != "B", op[1], op[2])
            best = min(best or (key, op), (key, op))
        if best is None:
            raise ValueError("no operation can start: this schedule deadlocks")
        (start, *_), op = best
        rank = op[2] % p
        done[op] = free[rank] = start + (f if op[0] == "F" else b) / v
        todo.remove(op)
        spans.append((f"rank {rank}", start, done[op], f"{op[0]}{op[1]}"))
    return spans


def in_flight(rank, done, p):
    """Forwards done on this rank's stages minus backwards done there."""
    kinds = [kind for (kind, i, k) in done if k % p == rank]
    return kinds.count("F") - kinds.count("B")


def gpipe_policy(op, rank, done, p, m, v):
    forwards_done = sum(1 for (kind, i, k) in done if kind == "F" and k % p == rank)
    return op[0] == "F" or forwards_done == m * v


def one_f_one_b_policy(op, rank, done, p, m, v):
    return op[0] == "B" or in_flight(rank, done, p) < p - rank


def bubble(spans):
    lanes = {s[0] for s in spans}
    start, end = min(s[1] for s in spans), max(s[2] for s in spans)
    return 1 - sum(s[2] - s[1] for s in spans) / (len(lanes) * (end - start))


print(" p   m   GPipe   1F1B  interleaved v=2   formula (p-1)/(m+p-1)")
for p, m in ((2, 1), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)):
    print(f"{p:2d} {m:3d}  {bubble(simulate(p, m, gpipe_policy)):6.3f} "
          f"{bubble(simulate(p, m, one_f_one_b_policy)):6.3f}  "
          f"{bubble(simulate(p, m, gpipe_policy, v=2)):6.3f} (p-1)/(vm+p-1) = "
          f"{(p - 1) / (2 * m + p - 1):.3f}    {(p - 1) / (m + p - 1):.3f}")

# %% [markdown]
# GPipe and 1F1B land exactly on the formula, with backward twice as long as
# forward: the bubble does not depend on the costs, only on `p` and `m`.
# Interleaving `v` chunks per rank divides it by about `v` once there are at
# least `p` micro-batches (each operation is shorter, so the ramp-up and
# ramp-down are), at the price of `v` times more
# sends and receives. (PyTorch's `ScheduleInterleaved1F1B` combines
# interleaving with 1F1B's memory bound; its order is harder to write down,
# which is why libraries generate it.) Drag the sliders to draw the three
# schedules:

# %%
def draw_schedules(p=4, m=8, v=2):
    fig, axes = plt.subplots(3, 1, figsize=(9, 1.0 * p * 3 + 1.5), sharex=True,
                             layout="constrained")
    lanes = [f"rank {r}" for r in range(p)]
    for ax, (name, spans) in zip(axes, (
            ("GPipe", simulate(p, m, gpipe_policy)),
            ("1F1B", simulate(p, m, one_f_one_b_policy)),
            (f"interleaved GPipe, v={v}", simulate(p, m, gpipe_policy, v=v))),
            strict=True):
        plot_timeline(spans, ax=ax, unit="s", lanes=lanes,
                      title=f"{name}: bubble {bubble(spans):.0%}")
        ax.set_xlabel("time (forward = 1 unit, backward = 2)")
    plt.show()
    print(f"formulas: (p - 1) / (m + p - 1) = {(p - 1) / (m + p - 1):.0%} for GPipe "
          f"and 1F1B; (p - 1) / (vm + p - 1) = {(p - 1) / (v * m + p - 1):.0%} for "
          "interleaving, which holds when m is a multiple of p (the titles give the "
          "simulated bubbles)")


widgets.interact(draw_schedules,
                 p=widgets.IntSlider(min=2, max=6, value=4, description="ranks p",
                                     continuous_update=False),
                 m=widgets.IntSlider(min=1, max=16, value=8, description="micro m",
                                     continuous_update=False),
                 v=widgets.IntSlider(min=1, max=3, value=2, description="chunks v",
                                     continuous_update=False));

# %% [markdown]
# What the bubble costs on real hardware, predicted: a model split into 8
# stages over 8 GPUs of a node, trained with 32 micro-batches per step, leaves
# `7 / 39` of every GPU-second idle - on average about 1.4 of the 8 GPUs do
# nothing. The figure depends only on `p` and `m`; its price is that of the
# GPUs.

# %%
for p, m in ((8, 8), (8, 32), (8, 128)):
    f = reference.predicted((p - 1) / (m + p - 1), "fraction idle",
                            f"{p} x NVIDIA H100 SXM5 80GB, one stage each",
                            f"GPipe/1F1B bubble (p - 1) / (m + p - 1), p = {p}, "
                            f"m = {m}, equal stages, communication hidden")
    print(f"m = {m:3d}: {f.value:.1%} idle, {f.value * p:.1f} of {p} GPUs on average "
          f"[{f.label.split(' (')[0]}]")
# the same model beside published pipelines (throughput relative to 2 stages, m = 1)
gpipe = {k: reference.published(f"torchgpipe.amoebanetd_{k}_ips").value
         for k in ("n2m1", "n2m32", "n8m4", "n8m32")}
for k, p, m in (("n2m32", 2, 32), ("n8m4", 8, 4), ("n8m32", 8, 32)):
    print(f"torchgpipe AmoebaNet-D on {p} P40s, m = {m}: the model says "
          f"{p * m / (m + p - 1):.2f}x, the benchmark {gpipe[k] / gpipe['n2m1']:.2f}x")
print(predict.caveat("torchgpipe.amoebanetd_n8m32_ips"))

# %% [markdown]
# ## 4. Stages as processes
#
# Now for real: each stage is a process with one thread; stage 0 runs its
# layers and **sends** the activation to stage 1, which finishes the forward
# pass and the loss; then stage 1 sends the gradient of its input back, and
# stage 0 finishes the backward pass, with `h.backward(grad)` as in section
# 1. Each rank runs its list of operations in the order the simulator
# produced for a schedule, and records when each ran, how many micro-batches
# it held, and how many bytes of activations autograd kept for them (counted
# with a saved-tensors hook, each storage once, parameters left out).
#
# **The order of sends and receives.** A blocking send waits until the other
# rank receives (gloo's does, even for a few bytes), and nccl runs what a
# rank posts on its stream in order. In 1F1B, stage 0 sends micro-batch 1's
# activation while stage 1 sends micro-batch 0's gradient: two sends, each
# waiting for a receive the other rank has not posted yet - a deadlock. So
# each rank posts the send of its last operation together with the receive
# of its next one, in one `dist.batch_isend_irecv`, whose sends and receives
# never wait for each other; the same code runs under gloo and nccl.
#
# A timeline is only evidence if it is measured carefully:
#
# - each operation's span closes **before** its send, so the next stage's
#   span (which starts when its receive returns) can never begin before it;
# - all ranks read the same clock (`time.perf_counter` is the machine's
#   monotonic clock, shared by its processes);
# - the steps run under the comparison protocol, interleaved, 6 steps a run
#   (a run must last long enough for the machine's CPU counters), and the
#   timeline shown is **one** step, the same on every rank (the middle step
#   of the median run), never each rank's fastest of different steps;
# - each rank reports its CPU seconds: a stage whose operations lasted longer
#   than the CPU it got was waiting for a core, not for data;
# - a bubble below the formula's floor (or an operation that starts before
#   its input exists) is impossible, so it is reported as a measurement
#   error and left out of the plot.

# %%
WIDTH, BATCH, LAYERS = 256, 256, 8


def orders(spans, p):
    """Each rank's operations, in the order the simulator ran them."""
    per_rank = [[] for _ in range(p)]
    for lane, _start, _end, label in sorted(spans, key=lambda s: s[1]):
        per_rank[int(lane.split()[1])].append((label[0], int(label[1:])))
    return per_rank


def make_stage(rank, world_size):
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    per = LAYERS // world_size
    return nn.Sequential(*[mod for layer in layers[rank * per:(rank + 1) * per]
                           for mod in (layer, nn.Tanh())])


def rank_device(rank):
    """This rank's GPU under nccl (one stage per GPU), else the CPU."""
    return torch.device("cuda", rank) if "nccl" in dist.get_backend() else \
        torch.device("cpu")


def run_pipeline(rank, world_size, plans, groups, repeats, steps):
    """Run the plans (name -> (m, per-rank orders)) of each group through the
    comparison protocol, `steps` steps a run, in step on every rank. Returns
    rank 0's comparisons, every step's (spans, CPU seconds, micro-batches
    held, bytes kept), and the gradients."""
    dev = rank_device(rank)
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda *a: None
    stage = make_stage(rank, world_size).to(dev)
    own = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH).to(dev), torch.randn(BATCH, WIDTH).to(dev)
    last = rank == world_size - 1

    def step(name, calls):
        m, plan = plans[name]
        stage.zero_grad()
        xs, ys = x.chunk(m), y.chunk(m)
        saved, held, peak, most, spans = {}, 0, 0, 0, []
        outbox, sends, posted = [], [], []  # outbox: the last op's send, not yet posted
        dist.barrier()
        cpu0 = time.process_time()
        for kind, i in plan[rank]:
            peer = rank - 1 if kind == "F" else rank + 1  # where this op's input is
            buf = None
            if 0 <= peer < world_size:  # not stage 0's forward, not the loss's backward
                buf = torch.empty(xs[i].shape[0], WIDTH, device=dev)
                outbox.append(dist.P2POp(dist.irecv, buf, peer))
            if outbox:  # the last send and this receive as one batch: neither waits
                works = dist.batch_isend_irecv(outbox)  # for the other, on any backend
                if buf is not None:
                    works.pop().wait()  # the receive (under nccl: the whole batch)
                sends, posted, outbox = sends + works, posted + outbox, []
            sync(dev)  # under nccl the data has arrived only now
            start = time.perf_counter()
            if kind == "F":
                inp, kept = xs[i] if rank == 0 else buf.requires_grad_(), {}

                def pack(t, kept=kept):  # each storage once, parameters left out
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in own:
                        kept[storage.data_ptr()] = storage.nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = stage(inp)
                    if last:  # each piece's share of the whole batch's mean loss
                        out = nn.functional.mse_loss(out, ys[i],
                                                     reduction="sum") / y.numel()
                sync(dev)
                end = time.perf_counter()  # the span closes before the send
                if not last:
                    outbox.append(dist.P2POp(dist.isend, out.detach(), rank + 1))
                saved[i] = (inp, out, sum(kept.values()))
                held += saved[i][2]
                peak, most = max(peak, held), max(most, len(saved))
            else:
                inp, out, nbytes = saved.pop(i)
                out.backward(buf)  # buf: the gradient received; None for the loss
                sync(dev)
                end = time.perf_counter()
                if rank > 0:
                    outbox.append(dist.P2POp(dist.isend, inp.grad, rank - 1))
                held -= nbytes
            spans.append((f"stage {rank}", start, end, f"{kind}{i}"))
        if outbox:
            sends += dist.batch_isend_irecv(outbox)
        for request in sends:  # each receive was waited for once already
            request.wait()
        sync(dev)
        cpu = time.process_time() - cpu0
        calls[name].append((spans, cpu, most, peak))
        return cpu

    def run(name, calls):  # long enough for the machine's CPU counters
        cpu = sum(step(name, calls) for _ in range(steps))
        others = torch.tensor([0.0 if rank == 0 else cpu], device=dev)
        dist.all_reduce(others)  # the other ranks' CPU seconds, for rank 0's count
        return {"cpu_s": others.item()}

    results, records = [], []
    for names in groups:  # the same calls in the same order on every rank
        calls = {name: [] for name in names}
        results.append(compare({n: functools.partial(run, n, calls) for n in names},
                               repeats=repeats, warmup=1, number=1))
        records.append(calls)
    return (results if rank == 0 else None), records, [p.grad.cpu()
                                                       for p in stage.parameters()]


def reference_gradients():
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    model = nn.Sequential(*[mod for layer in layers for mod in (layer, nn.Tanh())])
    torch.manual_seed(1)
    xr, yr = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    nn.functional.mse_loss(model(xr), yr).backward()
    return [p.grad for p in model.parameters()]


def median_step(ranks, group, name, steps):
    """The same step on every rank: the middle step of the median one of rank
    0's quiet runs."""
    option = ranks[0].value[0][group][name]
    runs = [i for i, kept in enumerate(option.kept) if kept] or range(len(option.runs))
    k = sorted(runs, key=lambda i: option.runs[i].wall_s)[len(runs) // 2]
    calls = [r.value[1][group][name][(k + 1) * steps + steps // 2]  # after warm-up
             for r in ranks]
    return {"spans": [s for c in calls for s in c[0]], "cpu": [c[1] for c in calls],
            "held": [c[2] for c in calls], "kept": [c[3] for c in calls]}


def causal(spans):
    """Whether every operation started after its input existed and its rank's
    previous operation ended: a timeline that breaks this is a measurement error."""
    ends = {(int(lane.split()[1]), label): e for lane, s, e, label in spans}
    last_end = {}
    for lane, start, end, label in sorted(spans, key=lambda s: s[1]):
        r = int(lane.split()[1])
        source = (r - 1 if label[0] == "F" else r + 1, label)
        if start < last_end.get(r, start) or start < ends.get(source, start):
            return False
        last_end[r] = end
    return True


def report(step, m, p):
    """The bubble of a step against the formula's floor, or why it is an error."""
    floor = (p - 1) / (m + p - 1)
    idle = bubble(step["spans"])
    if not causal(step["spans"]) or idle < floor - 0.005:
        return float("nan"), (f"measured bubble {idle:.2f} below the floor {floor:.2f}"
                              " or spans out of order: a measurement error")
    work = [sum(e - s for lane, s, e, _ in step["spans"] if lane == f"stage {r}")
            for r in range(p)]
    no_cpu = [r for r in range(p) if work[r] > 1.1 * step["cpu"][r]]
    return idle, (f"bubble {idle:.2f} (floor {floor:.2f}); work per stage "
                  f"{[f'{w * 1e3:.1f}' for w in work]} ms, CPU seconds per stage "
                  f"{[f'{c * 1e3:.1f}' for c in step['cpu']]} ms" + (
                      f" - stages {no_cpu} got less CPU than their operations "
                      "lasted: they waited for a core, not only for data"
                      if no_cpu else ""))


M_SWEEP, P = [1, 2, 4, 8], 2
plans = {f"GPipe m={m}": (m, orders(simulate(P, m, gpipe_policy), P)) for m in M_SWEEP}
plans["1F1B m=8"] = (8, orders(simulate(P, 8, one_f_one_b_policy), P))
groups = [[f"GPipe m={m}" for m in M_SWEEP], ["GPipe m=8", "1F1B m=8"]]
STEPS = 6  # steps a run: runs long enough for the CPU counters to judge
ranks = launch(run_pipeline, P, args=(plans, groups, 3, STEPS), timeout=120)
ref_grads = reference_gradients()
piped = [g for r in ranks for g in r.value[2]]
worst = max((a - b).abs().max().item() for a, b in zip(piped, ref_grads, strict=True))
print(f"pipelined gradients against one process: largest difference {worst:.1e}")
sweep = ranks[0].value[0][0]
print(sweep)
picked = {m: median_step(ranks, 0, f"GPipe m={m}", STEPS) for m in M_SWEEP}
bubbles = {}
for m in M_SWEEP:
    bubbles[m], line = report(picked[m], m, P)
    print(f"GPipe m = {m}, the median step: {line}")

# %% [markdown]
# The measured bubble and the step time against `m`, beside the prediction,
# and beside the tutorial's published GPU times (each relative to the same
# split fed whole batches: the tutorial's 120-image batches as 6 pieces of 20
# and 10 pieces of 12). With two equal stages, the formula predicts a step
# time of `(m + 1) / (2m)` of the unpipelined one.

# %%
where = (f"{P} GPU processes" if torch.cuda.device_count() >= P
         else f"{P} CPU processes")
base = sweep["GPipe m=1"].median / STEPS  # a run is STEPS steps
mp = reference.published("pt_mp_tutorial.resnet50_two_gpus_no_pipeline_seconds")
tutorial = [reference.published(f"pt_mp_tutorial.resnet50_pipelined_{k}_seconds")
            for k in ("split20", "split12")]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.4))
ax1.plot(M_SWEEP, [bubbles[m] for m in M_SWEEP],  # errors are left out (nan)
         label=f"measured here, {where}", **plots.figure_style("measured"))
ax1.plot(M_SWEEP, [(P - 1) / (m + P - 1) for m in M_SWEEP],
         label="predicted: (p - 1) / (m + p - 1)", **plots.figure_style("predicted"))
ax1.set(xscale="log", xlabel="micro-batches m", ylabel="idle fraction (bubble)",
        title="The bubble")
ax1.set_xticks(M_SWEEP, labels=[str(m) for m in M_SWEEP])
ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))  # below: no curve hidden
ax2.plot(M_SWEEP, [sweep[f"GPipe m={m}"].median / STEPS / base for m in M_SWEEP],
         label=f"measured here, {where} (median step)",
         **plots.figure_style("measured"))
ax2.plot(M_SWEEP, [(m + 1) / (2 * m) for m in M_SWEEP],
         label="predicted: (m + 1) / (2m)", **plots.figure_style("predicted"))
ax2.plot([1, 6, 10], [1.0] + [f.value / mp.value for f in tutorial],
         label="published: PyTorch tutorial, ResNet-50 on 2 GPUs",
         **plots.figure_style("published"))
ax2.set_xscale("log")
ax2.set_xticks([1, 2, 4, 6, 8, 10], labels=["1", "2", "4", "6", "8", "10"])
ax2.set(xlabel="micro-batches m", ylabel="step time / unpipelined",
        title="Step time against micro-batches")
ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))  # below: no curve hidden
plt.tight_layout()
plt.show()
print(f"[{mp.label}]")
work = {m: max(sum(e - s for lane, s, e, _ in picked[m]["spans"]
                   if lane == f"stage {r}") for r in range(P)) for m in M_SWEEP}
m_hi = M_SWEEP[-1]
print(f"the busiest stage's own work: {work[1] * 1e3:.1f} ms at m = 1, "
      f"{work[m_hi] * 1e3:.1f} ms at m = {m_hi} ({work[m_hi] / work[1]:.2f}x); with "
      f"that work, the formula's step at m = {m_hi} is "
      f"{work[m_hi] * (m_hi + P - 1) / m_hi * 1e3:.1f} ms, measured "
      f"{sweep[f'GPipe m={m_hi}'].median / STEPS * 1e3:.1f} ms (median)")
print("verdict: " + (
    "the machine was busy during the runs - run the cell again"
    if sweep.disturbed else
    "the step got shorter: the bubble shrank more than each stage's work grew"
    if sweep.outcomes[f"GPipe m={m_hi}"] == "faster" else
    f"no shorter step: each stage's work grew {work[m_hi] / work[1]:.2f}x with the "
    "micro-batches (fixed costs per micro-batch), eating what the smaller bubble "
    "saved" if bubbles[m_hi] < bubbles[1] else
    f"no shorter step and no smaller bubble ({bubbles[1]:.2f} at m = 1, "
    f"{bubbles[m_hi]:.2f} at m = {m_hi}): each stage's work grew "
    f"{work[m_hi] / work[1]:.2f}x, and the waits between its operations grew "
    "more (sends, receives and their CPU seconds: per-micro-batch costs that the "
    "timeline counts as idle)"))

# %%
for m in (1, 4):
    if bubbles[m] == bubbles[m]:  # not nan: a timeline that can be true
        plot_timeline(picked[m]["spans"], title=f"GPipe, {where}, m = {m} "
                      f"(measured, the median step, bubble {bubbles[m]:.0%})")
        plt.show()

# %% [markdown]
# Read the two timelines: with `m = 1` the stages take turns; with `m = 4`
# stage 1 starts its first forward while stage 0 computes the second, and the
# idle triangles at the start and the end are the bubble. More micro-batches
# shrink it, until each one is so small that its fixed costs dominate, which
# is the tutorial's best `split_size` on GPUs.
#
# **Why the step does not get shorter on CPU stages.** The formula assumes
# that cutting the batch into `m` pieces leaves each stage's work the same.
# On a CPU it does not: every micro-batch pays the Python and autograd
# overhead of 16 modules forward and backward, a send and a receive, and its
# matmuls are `m` times smaller, which one core runs less efficiently. The
# line above the verdict prints how much each stage's own work grew from
# `m = 1` to `m = 8`; when it grows about as much as the bubble shrinks, the
# step stays as long. A stage's CPU seconds beyond its work are its sends
# and receives: per-micro-batch costs too, which the timeline counts as idle.
# On GPUs with real model sizes a micro-batch's kernels are long compared
# with those fixed costs, which is why the tutorial gains.
#
# ### 1F1B: the same bubble in theory, less memory
#
# GPipe keeps every micro-batch's activations until its backward: `m` of them
# on stage 0. 1F1B starts backwards as early as it can, so stage `s` never
# holds more than `p - s`. Its idle time is GPipe's on paper; measured, a
# stage's waits also hold its sends and receives, so the two bubbles printed
# below can differ. Measured on the same run, with 8 micro-batches:

# %%
for name in ("GPipe m=8", "1F1B m=8"):
    step = median_step(ranks, 1, name, STEPS)
    print(f"{name}: {report(step, 8, P)[1]}; micro-batches held at most "
          f"{step['held']}, activations kept at most "
          f"{[f'{b / 2**20:.2f} MiB' for b in step['kept']]} (stage 0, stage 1)")
print(ranks[0].value[0][1])

# %% [markdown]
# Same work, and the comparison's verdict says whether the times differ;
# stage 0 holds 2 micro-batches' worth of activations instead of 8 (the
# saved-tensors hook counts each storage once). At scale that is the
# difference between fitting and not: the activations of a large model's
# micro-batch are gigabytes.
#
# With four stages on a 2-core machine, two stages share each core, so a
# stage can wait for a core as well as for data; the CPU seconds beside each
# stage's work tell the two apart (with a GPU per stage, they would not
# share):

# %%
P4, M4 = 4, 8
plans4 = {"GPipe": (M4, orders(simulate(P4, M4, gpipe_policy), P4)),
          "1F1B": (M4, orders(simulate(P4, M4, one_f_one_b_policy), P4))}
ranks4 = launch(run_pipeline, P4, args=(plans4, [list(plans4)], 3, 1), timeout=120)
for name in plans4:
    step = median_step(ranks4, 0, name, 1)
    print(f"{name}, 4 stages, m = {M4}: {report(step, M4, P4)[1]}; micro-batches "
          f"held {step['held']}")

# %% [markdown]
# ## 5. `torch.distributed.pipelining`
#
# PyTorch's pipeline library does all of the above: it splits a model into
# stages, runs them in processes, and provides the schedules. It replaced the
# old `torch.distributed.pipeline.sync.Pipe` (and its RPC-based multi-machine
# variant) that seed 002 shows, which no longer exist:

# %%
print("torch.distributed.pipeline (the old Pipe):",
      "present" if find_spec("torch.distributed.pipeline") else "gone")


def library_rank(rank, world_size, m):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dev = rank_device(rank)
    stage_mod = make_stage(rank, world_size).to(dev)  # a manual split: our own
    stage = PipelineStage(stage_mod, rank, world_size, dev)
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH).to(dev), torch.randn(BATCH, WIDTH).to(dev)
    grads = {}
    for schedule_class in (ScheduleGPipe, Schedule1F1B):
        stage_mod.zero_grad()
        schedule = schedule_class(stage, n_microbatches=m,
                                  loss_fn=lambda out, tgt: nn.functional.mse_loss(out,
                                                                                  tgt))
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        grads[schedule_class.__name__] = [p.grad.cpu() for p in stage_mod.parameters()]
    return grads


lib = [r.value for r in launch(library_rank, P, args=(4,), timeout=120)]
for name in ("ScheduleGPipe", "Schedule1F1B"):
    got = [g for r in lib for g in r[name]]
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref_grads, strict=True))
    print(f"{name}, {P} processes, 4 micro-batches: largest gradient difference from "
          f"one process {worst:.1e}")

# %% [markdown]
# (The library averages over micro-batches by default, so the gradients equal
# the whole batch's when the micro-batches are equal. Under nccl, each stage
# is given its GPU as `device`, as `rank_device` does here; the examples
# below keep their stages on the CPU with gloo.)
#
# The library can also split a model itself: `pipeline()` traces the model
# once with an example micro-batch and cuts it where `split_spec` says.

# %%
def traced_rank(rank, world_size):
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    warnings.simplefilter("ignore", FutureWarning)  # the tracer's own deprecations

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])

        def forward(self, x):
            return self.layers(x)

    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    pipe = pipeline(Net(), mb_args=(x.chunk(4)[0],),
                    split_spec={"layers.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4,
                             loss_fn=lambda out, tgt: nn.functional.mse_loss(out, tgt))
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    return pipe.num_stages, [n for n, _ in stage.submod.named_parameters()]


for r in launch(traced_rank, P, timeout=120, backend="gloo"):  # CPU stages
    stages, names = r.value
    print(f"rank {r.rank}: stage {r.rank} of {stages}, parameters {names}")

# %% [markdown]
# Newer schedules go further than 1F1B. **Zero-bubble** schedules split each
# backward in two: `I`, the gradient with respect to the stage's input, which
# the previous stage is waiting for, and `W`, the gradient of the weights,
# which nobody waits for and so can fill the bubble. **DualPipeV** is Sea AI
# Lab's "cut-in-half" variant of DualPipe, the bidirectional schedule of
# DeepSeek-V3's training (the DualPipe repository credits them): two stages
# on each rank in a V shape (rank 0 holds the first and the last), pairing a
# forward of one micro-batch with a backward of another. Each schedule
# exposes the order it runs on every rank; here with 2 ranks and 4
# micro-batches (`0F1` is stage 0's forward of micro-batch 1):

# %%
def zero_bubble_rank(rank, world_size):
    from torch.distributed.pipelining import PipelineStage

    from course_utils.compat import (  # torch.distributed.pipelining.schedules
        OVERLAP_F_B,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(2 * world_size)]
    ids = [rank, 2 * world_size - 1 - rank]  # the V: rank 0 holds stages 0 and 3
    shown = {}
    for cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        stages = [PipelineStage(nn.Sequential(layers[k]), k, 2 * world_size,
                                torch.device("cpu")) for k in ids]
        schedule = cls(stages, n_microbatches=4,
                       loss_fn=lambda out, tgt: nn.functional.mse_loss(out, tgt))
        # the order is fixed when the schedule is built, before any step
        shown[cls.__name__] = [[str(a) for a in schedule.pipeline_order[r] if a]
                               for r in range(world_size)]
    # a function registered for OVERLAP_F_B would run its two parts together
    shown["overlap function registered"] = (
        OVERLAP_F_B in schedule._comp_type_to_function_map)
    return shown


shown = launch(zero_bubble_rank, P, timeout=120, backend="gloo")[0].value
for name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
    for r, order in enumerate(shown[name]):
        print(f"{name}, rank {r}: {' '.join(order)}")
for r, order in enumerate(shown["ScheduleZBVZeroBubble"]):
    later = [a for k, a in enumerate(order)
             if "W" in a and order[k - 1] != a.replace("W", "I")]
    print(f"zero-bubble, rank {r}: {len(later)} of {sum('W' in a for a in order)} "
          f"W's run later than right after their I ({' '.join(later) or '-'})")
print("DualPipeV: a function registered for OVERLAP_F_B: "
      f"{shown['overlap function registered']}")

# %% [markdown]
# In the zero-bubble order, `I` and `W` are separate entries, so the
# schedule may run a `W` later, in a moment where the rank would otherwise
# wait for a neighbour. The lines above count the `W`s it moved: on rank 0
# each `W` follows its `I`; on rank 1 the last `W`s wait until the end of the
# step, after the `I`s that rank 0 still needs, filling what would be the
# cool-down bubble. DualPipeV's
# `OVERLAP_F_B` entries pair a forward and a backward of different
# micro-batches so that one's communication can hide behind the other's
# computation - but in torch 2.13 the runtime runs the two parts **one after
# the other** unless a function is registered for `OVERLAP_F_B`
# (`schedule.register_custom_function`), as the line above shows: the overlap
# itself is left to the model's code.
#
# ## 6. Pipeline and data parallelism together
#
# Large models combine both: the layers are split into `p` pipeline stages,
# and the whole pipeline is replicated `d` times for data parallelism.
#
# **Claim** (a common summary, which seed 002 echoes: "8 to 10 GPUs per
# node" beside Megatron-LM's 3,072-GPU run): model parallelism inside a node,
# data parallelism across nodes. **Published**: the Megatron-LM paper that
# seed 002 cites
# (Narayanan et al., SC '21, arXiv 2104.04473) puts *tensor* parallelism
# (each layer's matmuls split across GPUs, a later chapter) inside a node,
# up to its GPU count, and *pipeline* parallelism across nodes, with data
# parallelism on top. **Why**: tensor parallelism communicates inside every
# layer, so it needs the node's fast links; a pipeline sends only one
# activation per stage boundary and micro-batch, which the slower links
# between nodes can carry.
#
# A **device mesh** names the groups: with 4 ranks as a
# 2 x 2 mesh, the `pp` dimension pairs the two stages of each replica, the
# `dp` dimension pairs the two replicas of each stage. Each replica pipelines
# its half of the batch; then each stage all-reduces its gradients with its
# twin in the other replica, and the result must equal one process on the
# whole batch:

# %%
def dp_pp_rank(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"], mesh["pp"]
    stage_index, replica = pp.get_local_rank(), dp.get_local_rank()
    stage_mod = make_stage(stage_index, 2)
    stage = PipelineStage(stage_mod, stage_index, 2, torch.device("cpu"),
                          group=pp.get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=4,
                             loss_fn=lambda out, tgt: nn.functional.mse_loss(out, tgt))
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    half = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
    if stage_index == 0:
        schedule.step(x[half])
    else:
        schedule.step(target=y[half])
    for p in stage_mod.parameters():  # data parallelism across the replicas
        dist.all_reduce(p.grad, group=dp.get_group())
        p.grad /= dp.size()
    return stage_index, replica, [p.grad.clone() for p in stage_mod.parameters()]


mesh_ranks = [r.value for r in launch(dp_pp_rank, 4, timeout=120, backend="gloo")]
for stage_index, replica, grads in mesh_ranks:
    want = ref_grads[:len(grads)] if stage_index == 0 else ref_grads[len(grads):]
    worst = max((a - b).abs().max().item() for a, b in zip(grads, want, strict=True))
    print(f"stage {stage_index} of replica {replica}: largest gradient difference "
          f"from one process {worst:.1e}")

# %% [markdown]
# Every rank holds the gradient one process computes on the whole batch. The
# pipeline's bubble shrinks with more micro-batches per replica, which is one
# reason such training runs use large global batches.
#
# ## Summary
#
# - A model split over devices computes the same gradients: `.to()` is
#   differentiable, and the chain rule can cross the split by hand
#   (`h.backward(h_in.grad)`), as pipeline stages do.
# - In one process, micro-batches overlap only on GPUs (asynchronous
#   launches); stages in separate processes overlap anywhere. They pass
#   activations forward and gradients back with send and receive, in orders
#   that cannot wait on each other: a rank posts its send with its next
#   receive (`dist.batch_isend_irecv`).
# - GPipe's bubble is `(p - 1) / (m + p - 1)`, a floor: a measured bubble
#   below it is a measurement error. Per-micro-batch costs keep the measured
#   one above it, and on CPU stages they grow each stage's work with `m`, so
#   the step need not get shorter. 1F1B has the
#   same bubble and holds at most `p - s` micro-batches on stage `s`;
#   interleaving divides the bubble by the chunks per rank; zero-bubble
#   schedules fill it with weight gradients.
# - `torch.distributed.pipelining` provides stages (by hand or traced) and
#   the schedules; a device mesh combines pipeline and data parallelism
#   (tensor parallelism inside a node, pipelines across nodes).

# %% [markdown]
# ## Exercises
#
# ### Exercise 7.1: a two-stage training step
#
# Write `two_stage_step(stage, rank, x, y, m, hidden)`, run on two ranks: rank
# 0 holds the first half of a model (`stage`), rank 1 the second half. Both
# ranks get the whole batch `x` (inputs) and `y` (targets). Cut both into `m`
# micro-batches with `.chunk(m)`; rank 0 runs its stage on each and sends the
# activation (`hidden` columns, in `x.dtype`) to rank 1, which runs its stage
# and the loss, a micro-batch's share of the whole batch's mean squared error
# (`mse_loss(out, y_i, reduction="sum") / y.numel()`). Then the boundary
# backward of section 1, across processes: rank 1 sends the gradient of each
# received activation back, and rank 0 calls `backward` with it. Start from
# zero gradients; rank 1 returns the step's loss. Both stages must end with
# the gradients one process computes on the whole batch. Mind the order: a
# blocking send waits for the matching receive.
#
# The checker runs your function on two real processes with models of other
# widths, in float32 and float64, 1 to 5 micro-batches, twice in a row.

# %% tags=["exercise"] exercise="7.1"
def two_stage_step(stage, rank, x, y, m, hidden):
    ### BEGIN SOLUTION
    stage.zero_grad()
    kept, loss = [], 0.0
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):  # all forwards
        if rank == 0:
            out = stage(xi)
            dist.send(out.detach(), 1)
            kept.append(out)
        else:
            h = torch.empty(len(yi), hidden, dtype=x.dtype, device=x.device)
            dist.recv(h, 0)
            part = nn.functional.mse_loss(stage(h.requires_grad_()), yi,
                                          reduction="sum") / y.numel()
            kept.append((h, part))
            loss += part.item()
    for item in kept:  # then all backwards, in the same order on both ranks
        if rank == 0:
            grad = torch.empty_like(item)
            dist.recv(grad, 1)
            item.backward(grad)
        else:
            item[1].backward()
            dist.send(item[0].grad, 0)
    return loss if rank == 1 else None
    ### END SOLUTION


# %% tags=["check"] exercise="7.1"
check_two_stage_step(two_stage_step)

# %% [markdown]
# ### Exercise 7.2: a 1F1B schedule
#
# Write `one_f_one_b(p, m)`: for each of the `p` stages, the list of the
# operations it runs, in order, as `("F", i)` and `("B", i)` for micro-batch
# `i`, as fast as GPipe but holding at most `p - s` micro-batches (forwarded,
# not yet backwarded) on stage `s`. Write the rule yourself: an order made by
# section 3's `one_f_one_b_policy` is refused. The checker runs your lists on a
# simulator (one time unit per operation, each waiting for its input) for
# several `p` and `m`, then on 3 real processes that count what each stage
# holds.

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
# ### Exercise 7.3: balance the stages
#
# Every micro-batch passes through every stage, so the slowest stage sets
# the pace of the whole pipeline. Write `split_stages(costs, p)`: given the
# cost of each layer (`costs[i]` for layer `i`, in order) and a number of
# stages `p`, return `p` stages - each a list of consecutive layer indices,
# none empty, together every layer in order - whose slowest stage (largest
# sum of costs) is as cheap as any split can make it.

# %% tags=["exercise"] exercise="7.3"
def split_stages(costs, p):
    ### BEGIN SOLUTION
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[(k, j)]: (slowest stage, last cut) splitting layers 0..j-1 in k stages
    best = {(0, 0): (0.0, 0)}
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            best[(k, j)] = min((max(best[(k - 1, i)][0], prefix[j] - prefix[i]), i)
                               for i in range(k - 1, j) if (k - 1, i) in best)
    stages, j = [], n
    for k in range(p, 0, -1):
        i = best[(k, j)][1]
        stages.append(list(range(i, j)))
        j = i
    return stages[::-1]
    ### END SOLUTION


# %% tags=["check"] exercise="7.3"
check_split_stages(split_stages)

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
# | interleaved schedule | 交错调度 |
# | zero-bubble schedule | 零气泡调度 |
# | stage balancing | 阶段负载均衡 |
