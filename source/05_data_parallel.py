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
# # Chapter 5: DataParallel and its primitives
#
# **What you will learn**
#
# - What `nn.DataParallel` does in one training step: scatter, replicate,
#   parallel_apply, gather - and why device 0 does more work and holds more
#   memory than the others.
# - The four primitives, built by hand so they run on any machine, and checked
#   equal to one device, forward and backward.
# - How a batch is split (and when a device is left idle), what happens to
#   BatchNorm's statistics, and why threads and the GIL make DataParallel slow -
#   the reasons PyTorch recommends DistributedDataParallel (Chapter 6).
#
# **Hardware.** With two or more GPUs the chapter also runs PyTorch's own
# primitives and `nn.DataParallel` and compares them with one device. Without
# them, PyTorch's primitives refuse to run (we show exactly how), so we build
# them ourselves over N "devices" that are all the CPU: the arithmetic and
# the autograd are the real ones; only the speed-up needs real devices, and
# for that the chapter shows labelled predictions.

# %%
import copy
import threading

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import Image, display
from torch import nn
from torch.func import functional_call

from course_utils import banner, predict, reference, try_all_gpus
from course_utils.build import ROOT
from course_utils.checks.ch05 import (
    check_data_parallel_step,
    check_dp_running_mean,
    check_scatter_batch,
)
from course_utils.compare import compare as compare_timings

banner()
GPUS = try_all_gpus() if torch.cuda.is_available() else []
print(f"GPUs here: {len(GPUS)}")

# %% [markdown]
# ## 1. One step of DataParallel
#
# `nn.DataParallel(module, device_ids, output_device, dim=0)` wraps a module.
# Calling it runs, in **one process**:
#
# 1. **scatter**: cut the batch along `dim` into one piece per device and copy
#    each piece to its device;
# 2. **replicate**: copy the module to every device - *at every step*, because
#    the parameters changed since the last one;
# 3. **parallel_apply**: run each replica on its piece, **one Python thread per
#    device**;
# 4. **gather**: copy the outputs to `output_device` (by default `device_ids[0]`)
#    and concatenate them.
#
# The loss is computed there, on device 0; `backward()` sends each replica's
# share of the gradient back, and the replication's backward **sums** the
# replicas' gradients onto the original parameters on device 0, where the
# optimizer updates them.

# %%
display(Image(filename=str(ROOT / "images" / "dataparallel_step.png")))

# %% [markdown]
# ## 2. PyTorch's primitives, on this machine
#
# The four steps exist as functions in `torch.nn.parallel`. On a CPU they
# refuse to run, and `nn.DataParallel` quietly does nothing: with no GPU its
# `device_ids` is empty and it just calls the module. With GPUs it wants the
# module on `device_ids[0]` (with one GPU it moves it there itself, in place)
# and scatters the batch, wherever it is, to its devices.

# %%
lin = nn.Linear(4, 2)
x8 = torch.randn(8, 4)
attempts = {
    "scatter": lambda: nn.parallel.scatter(x8, [torch.device("cpu")] * 2),
    "replicate": lambda: nn.parallel.replicate(lin, [torch.device("cpu")] * 2),
    "gather": lambda: nn.parallel.gather([x8, x8], torch.device("cpu")),
}
for name, attempt in attempts.items():
    try:
        attempt()
        print(f"{name}: ran")
    except Exception as e:  # noqa: BLE001 - we show whatever it raises
        print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
lin = lin.to(GPUS[0] if GPUS else "cpu")  # DataParallel's module: on device_ids[0]
dp = nn.DataParallel(lin)
diff = (dp(x8) - lin(x8.to(lin.weight.device))).abs().max().item()
print("DataParallel device_ids:", dp.device_ids, f"| output differs from the "
      f"module's by {diff:.1e} | state_dict keys:", list(dp.state_dict()))

# %% [markdown]
# Note the `module.` prefix in the wrapper's `state_dict`: a checkpoint saved
# from `nn.DataParallel` does not load into the bare model. Save
# `dp.module.state_dict()` instead (or strip the prefix when loading).
#
# ## 3. The primitives, by hand
#
# Each is a few lines. Our "devices" are a list; on a CPU every entry is the
# CPU, and the code is the same for GPUs.
#
# - **scatter** is `torch.chunk` along `dim`, one piece per device, each moved
#   to its device (and the targets the same way);
# - **replicate** gives each device its own copy of the module object and the
#   module's parameters as *differentiable copies* - `p.to(device)` (or
#   `p.clone()` on the same device) is recorded by autograd, so a gradient that
#   reaches a copy flows back to the original and adds up there. Each replica
#   runs with its copies through `torch.func.functional_call`. (Its own module
#   object matters: `functional_call` swaps tensors into the module it is given
#   for the duration of the call, and two threads swapping into one module
#   would race);
# - **parallel_apply** runs each replica on its piece in its own thread;
# - **gather** moves the outputs to the output device and concatenates them.

# %%
def scatter(x, devices, dim=0):
    return [piece.to(d) for piece, d in zip(torch.chunk(x, len(devices), dim),
                                             devices, strict=False)]


def replicate(module, devices):
    """Per device: its own module object, and differentiable copies of the
    parameters (and buffers) to run it with."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    replicas = []
    for d in devices:
        shell = copy.deepcopy(module).to(d)  # its own object: threads never share one
        tensors = {k: p.to(d) if d != p.device else p.clone() for k, p in params.items()}
        # buffers (BatchNorm's running statistics) are not differentiable: replica
        # 0 uses the module's own, the others copies - as torch's replicate does,
        # so only replica 0's updates are kept (section 7)
        tensors.update({k: b if not replicas else b.to(d, copy=True)
                        for k, b in buffers.items()})
        replicas.append((shell, tensors))
    return replicas


def parallel_apply(replicas, pieces, timeout=60):
    outputs = [None] * len(pieces)
    errors = []

    def run(i):
        try:
            shell, tensors = replicas[i]
            outputs[i] = functional_call(shell, tensors, (pieces[i],))
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pieces))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return outputs


def gather(outputs, device, dim=0):
    return torch.cat([o.to(device) for o in outputs], dim)


def data_parallel(module, x, devices, output_device=None, dim=0):
    pieces = scatter(x, devices, dim)
    replicas = replicate(module, devices[:len(pieces)])
    return gather(parallel_apply(replicas, pieces), output_device or devices[0], dim)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
devices = GPUS[:3] if len(GPUS) >= 2 else [torch.device("cpu")] * 3
model = model.to(devices[0])
x = torch.randn(10, 16, device=devices[0])  # 10 rows on 3 devices: 4, 4, 2
y = torch.randn(10, 4, device=devices[0])

single = copy.deepcopy(model)
loss_1 = nn.functional.mse_loss(single(x), y)
loss_1.backward()
loss_n = nn.functional.mse_loss(data_parallel(model, x, devices), y)
loss_n.backward()
print(f"devices: {[str(d) for d in devices]}")
print(f"loss: one device {loss_1.item():.6f}, {len(devices)} devices {loss_n.item():.6f}")
worst = max((p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), single.parameters(), strict=True))
print(f"largest gradient difference: {worst:.2e} (rounding only)")

# %% [markdown]
# Equal, up to rounding. This is the point of data parallelism: N devices
# compute exactly the gradient of the whole batch, because the loss is taken
# over the gathered outputs and the replicas' gradients sum back. (Taking a
# loss per piece and averaging those would be wrong for unequal pieces, as
# here: Exercise 5.2.)
#
# With GPUs, PyTorch's own primitives and `nn.DataParallel` must agree too
# (with one GPU they run a single replica on a single piece):

# %%
def compare(name, out, params):
    """How far an output and its gradients are from the one-device run."""
    nn.functional.mse_loss(out, y.to(out.device)).backward()
    out_diff = (out.detach().cpu() - single(x).detach().cpu()).abs().max().item()
    grad_diff = max((p.grad.cpu() - q.grad.cpu()).abs().max().item()
                    for p, q in zip(params, single.parameters(), strict=True))
    print(f"{name}: output differs by {out_diff:.2e}, gradients by {grad_diff:.2e}")


if GPUS:  # one GPU runs them too: one replica, one piece, nothing split
    gpus = GPUS[:3]
    # PyTorch's four primitives, one by one
    base = copy.deepcopy(single).to(gpus[0])
    base.zero_grad()
    replicas = nn.parallel.replicate(base, gpus)
    pieces = nn.parallel.scatter(x.to(gpus[0]), gpus)
    outs = nn.parallel.parallel_apply(replicas[:len(pieces)], pieces)
    compare("replicate + scatter + parallel_apply + gather",
            nn.parallel.gather(outs, gpus[0]), list(base.parameters()))
    # and the module that does all four
    base = copy.deepcopy(single).to(gpus[0])
    base.zero_grad()
    wrapped = nn.DataParallel(base, device_ids=gpus, output_device=gpus[0])
    compare(f"nn.DataParallel on {len(gpus)} GPUs", wrapped(x.to(gpus[0])),
            list(base.parameters()))
else:
    print("no GPU here: PyTorch's primitives refuse the CPU (section 2); the "
          "hand-made ones above stand in for them")

# %% [markdown]
# ## 4. How a batch is split
#
# Scatter cuts pieces of `ceil(rows / devices)` rows, like `torch.chunk`: 30
# rows on 4 devices give 8, 8, 8 and 6; 6 rows on 4 devices give 2, 2, 2 -
# **three** pieces, and the fourth device gets nothing. Keyword arguments are
# scattered the same way as positional ones, and `dim` picks the axis (for
# sequence-first data, `dim=1`). Drag the sliders:

# %%
def draw_split(batch=30, devices=4):
    sizes = [p.shape[0] for p in torch.chunk(torch.empty(batch, 1), devices)]
    sizes += [0] * (devices - len(sizes))
    fig, ax = plt.subplots(figsize=(6.0, 2.4))
    ax.bar([f"device {i}" for i in range(devices)], sizes,
           color=["tab:red" if s == 0 else "tab:blue" for s in sizes])
    ax.set_ylabel("rows")
    ax.set_title(f"{batch} rows on {devices} devices: {sizes}")
    plt.tight_layout()
    plt.show()
    idle = sizes.count(0)
    print(f"slowest device works on {max(sizes)} rows; "
          f"{idle} device(s) idle" if idle else f"slowest device: {max(sizes)} rows")


widgets.interact(draw_split,
                 batch=widgets.IntSlider(min=1, max=64, value=30, description="batch",
                                         continuous_update=False),
                 devices=widgets.IntSlider(min=1, max=8, value=4,
                                           description="devices",
                                           continuous_update=False));

# %% [markdown]
# Keyword arguments go through the same scatter. A tensor is cut along `dim`
# like a positional one; anything else (a flag, a number, `None`) is given to
# every replica as it is. This is what `nn.parallel.scatter_kwargs` does; by
# hand it is a few more lines, and a forward pass with a `mask=` keyword shows
# it working:

# %%
def scatter_kwargs(args, kwargs, devices, dim=0):
    """Per device: (its args, its kwargs); tensors cut, everything else copied."""
    def cut(value):
        if isinstance(value, torch.Tensor):
            return scatter(value, devices, dim)
        return [value] * len(devices)

    cut_args = [cut(a) for a in args]
    cut_kwargs = {k: cut(v) for k, v in kwargs.items()}
    n = min(len(c) for c in [*cut_args, *cut_kwargs.values()])  # chunk may give fewer
    return [(tuple(c[i] for c in cut_args), {k: c[i] for k, c in cut_kwargs.items()})
            for i in range(n)]


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x, mask=None, scale=1.0):
        out = self.lin(x) * scale
        return out if mask is None else out * mask


torch.manual_seed(1)
masked = Masked().to(devices[0])
xs = torch.randn(7, 5).to(devices[0])
mask = (torch.rand(7, 1) > 0.3).float().to(devices[0])
per_device = scatter_kwargs((xs,), {"mask": mask, "scale": 2.0}, devices)
for i, (a, kw) in enumerate(per_device):
    print(f"device {i}: x {tuple(a[0].shape)}, mask {tuple(kw['mask'].shape)}, "
          f"scale {kw['scale']}")
# each piece runs on its own device, with the module's copy there
outs = [copy.deepcopy(masked).to(a[0].device)(*a, **kw) for a, kw in per_device]
print("same as one device:", torch.allclose(
    gather(outs, devices[0]), masked(xs, mask=mask, scale=2.0), atol=1e-6))
if len(GPUS) >= 2:
    theirs = nn.parallel.scatter_kwargs((xs.to(GPUS[0]),), {"mask": mask, "scale": 2.0},
                                        GPUS[:3])
    print("PyTorch's scatter_kwargs gives pieces of",
          [tuple(a[0].shape) for a in theirs[0]])

# %% [markdown]
# ## 5. Why device 0 holds more
#
# Device 0 keeps everything the others have (a replica's parameters and its
# piece's activations) and more: the original parameters and their gradients,
# the optimizer's state, the gathered outputs and the loss. A model with
# `P` float32 parameters trained with Adam (two more numbers per parameter)
# needs on device 0 about `4P` (parameters) + `4P` (gradients) + `8P` (Adam)
# bytes, and on each other device `4P` for its replica. The table is that
# model's prediction for a 1-billion-parameter model on 4 GPUs, activations
# left out:

# %%
P = 1e9
per_device = {"device 0": 4 * P + 4 * P + 8 * P}
per_device.update({f"device {i}": 4 * P for i in range(1, 4)})
memory = reference.predicted(
    {k: v / 2**30 for k, v in per_device.items()}, "GiB", "4 GPUs under DataParallel",
    "device 0: parameters + gradients + Adam's two states (4 + 4 + 8 bytes per "
    "parameter); others: a replica's parameters (4 bytes); activations left out")
for k, v in memory.value.items():
    print(f"  {k}: {v:5.1f} GiB")
print(f"  [{memory.label}]")

# %% [markdown]
# Device 0 needs four times the memory of the others here, and it also does
# the extra work of scattering, gathering, the loss and the optimizer step,
# while the others wait. DistributedDataParallel gives every device the same
# job instead (Chapter 6).
#
# What about time? Per step, DataParallel copies the parameters from device 0
# to every replica *before* the forward pass (replicate) and sums the
# gradients back onto device 0 *after* the backward pass: about `4P` bytes
# each way over each link, and neither can overlap with compute. DDP moves
# about as many bytes in its ring all-reduce (`2(n-1)/n x 4P`), but during
# the backward pass (Chapter 6, gradient buckets). A model of one step, for
# the 1-billion-parameter model on H100s linked by NVLink, with a compute
# time per step chosen for the example (100 ms); DataParallel's Python
# overhead (one process launching every replica's kernels, its threads
# sharing the GIL) is left out, so its real cost is higher still:

# %%
COMPUTE_S = 0.100  # an example compute time per step, the same for both
link = predict.achieved_link_bandwidth("nvlink_h100")  # the rate NCCL reaches
rows = {}
for n in (2, 4, 8):
    dp_comm = 2 * 4 * P / link  # broadcast the parameters, reduce the gradients
    ddp_comm = predict.allreduce_seconds(4 * P, n, "nvlink_h100").value
    rows[n] = (COMPUTE_S + dp_comm, max(COMPUTE_S, ddp_comm))
step_model = reference.predicted(
    rows, "s", f"n x {predict.gpu_name('h100_sxm')} over NVLink 4",
    "DataParallel: compute + 4P bytes broadcast + 4P bytes reduced, not overlapped; "
    "DDP: max(compute, calibrated NCCL ring all-reduce of 4P bytes), overlapped; "
    f"links at the {link / 1e9:.0f} GB/s NCCL reaches; P = 1e9, compute 100 ms "
    "per step (an example), Python and thread overhead left out",
    ["h100_sxm.nvlink_bandwidth_total_gbps", *predict.NVLINK_EFFICIENCY_INPUTS,
     *predict.COLLECTIVE_LATENCY_INPUTS])
for n, (dp_s, ddp_s) in rows.items():
    print(f"  {n} GPUs: DataParallel {dp_s * 1e3:6.1f} ms per step, DDP "
          f"{ddp_s * 1e3:6.1f} ms ({dp_s / ddp_s:.2f}x)")
print(f"  [{step_model.label}]")
print("caveat: the DDP line's all-reduce is calibrated (python -m "
      "course_utils.predict --calibration: 8-GPU NVLink sweeps within 25 %); no "
      "published measurement of DataParallel was found to check its line, which "
      "leaves out its Python overhead and so is optimistic")

# %% [markdown]
# The prediction does not change with `n`: both move about `4P` bytes per
# link each way whatever the number of GPUs. What separates them is that DDP
# hides its communication behind the backward pass and DataParallel cannot -
# and, in practice, DataParallel's single Python process, which this model
# leaves out.
#
# ## 6. Why threads make it slow
#
# `parallel_apply` runs the replicas in Python threads of one process. A
# thread holds the GIL while Python code runs (Chapter 4), so only the parts
# of a forward pass spent inside C++ operators run at the same time. Large
# layers spend most of their time there; small ones spend it in Python. On
# top of that, replicate copies the parameters at every step.
#
# And the backward pass? `loss.backward()` hands the graph to autograd's
# engine, which runs each device's part on a thread of its own for that
# device: on GPUs, every replica's backward runs at once. Every "device" here
# is the CPU, and the engine runs all CPU work on the thread that called
# `backward()` - so our `data_parallel` runs the replicas' backward passes one
# after the other, and only the forward pass is parallel. To see what GPUs
# get, `parallel_backward` below starts each replica's backward in its own
# thread, from the gradient that the loss sends to its output. Below, a small
# and a large model, one training step on one "device", and on two with each
# kind of backward, compared with the course's protocol (Chapter 4).

# %%
def parallel_backward(outputs, grads):
    """Each replica's backward in its own thread, as autograd does per GPU."""
    threads = [threading.Thread(target=torch.autograd.backward, args=(o, g))
               for o, g in zip(outputs, grads, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def dp_step(model, x, n_devices, backward_per_replica):
    devs = [torch.device("cpu")] * n_devices
    if not backward_per_replica:  # the backward on this one thread, as on a CPU
        return data_parallel(model, x, devs).sum().backward()
    outputs = parallel_apply(replicate(model, devs), scatter(x, devs))
    ends = [o.detach().requires_grad_() for o in outputs]
    gather(ends, devs[0]).sum().backward()  # the loss's own backward, on device 0
    parallel_backward(outputs, [e.grad for e in ends])


saved = torch.get_num_threads()
torch.set_num_threads(1)  # one core per "device": threads are the only parallelism
try:
    for name, width, rows in (("small: 8 x Linear(16), 8 rows", 16, 8),
                              ("large: 8 x Linear(512), 512 rows", 512, 512)):
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])
        xb = torch.randn(rows, width)
        print(name)
        print(compare_timings({
            "1 device": lambda net=net, xb=xb: dp_step(net, xb, 1, False),
            "2, backward on one thread": lambda net=net, xb=xb: dp_step(net, xb, 2,
                                                                        False),
            "2, backward per replica": lambda net=net, xb=xb: dp_step(net, xb, 2,
                                                                      True),
        }, repeats=3), end="\n\n")
finally:
    torch.set_num_threads(saved)

# %% [markdown]
# Read the verdicts and the busy cores. The small model cannot gain from a
# second thread: its time goes to Python, which the GIL runs one thread at a
# time, and to the threads' overhead. The large one spends its time in C++
# operators, and can gain when a second core is free - with the backward on
# one thread only the forward pass (about a third of the step) is shared, so
# at most about 1.2x on two cores (Amdahl's law, Chapter 1); with a backward
# per replica, up to about 2x. When another program holds a core, the verdict
# says "disturbed" instead.
# On GPUs the same holds for the Python side: DataParallel's one process must
# launch every kernel of every replica, and its threads take turns doing so.
#
# ## 7. BatchNorm under DataParallel
#
# A BatchNorm layer normalises with the statistics of the batch it sees. Under
# DataParallel each replica sees only its piece, so it normalises with that
# piece's mean and variance - not the whole batch's. And the running
# statistics (used at evaluation) are buffers: each replica updates its own
# copy, and only **replica 0's** copy is the module's own. The other pieces'
# statistics are lost. (`nn.SyncBatchNorm` computes the statistics over all
# devices at once, with a collective: Chapter 6.)

# %%
bn = nn.BatchNorm1d(3, momentum=0.1)
xb = torch.randn(12, 3) + torch.arange(12.0)[:, None] / 4  # pieces differ
pieces = torch.chunk(xb, 3)
replica0 = copy.deepcopy(bn)
replica0(pieces[0])  # what DataParallel keeps
whole = copy.deepcopy(bn)
whole(xb)  # what one device would keep
print("running mean, replica 0's piece only:", replica0.running_mean.tolist())
print("running mean, the whole batch:       ", whole.running_mean.tolist())

# %% [markdown]
# ## 8. The seeds' examples, corrected
#
# Seed 000's model puts an embedding on the CPU and the rest on the GPU, a
# small example of placing parts of a model on different devices (Chapter 7
# goes further). As written it raises `TypeError`: `nn.Module.__init__` takes
# no keyword arguments. Call `super().__init__()` first, then assign the
# layers. Here it runs on the CPU and the GPU when there is one, else on the
# CPU twice (and says so):

# %%
second = GPUS[0] if GPUS else torch.device("cpu")


class SplitModel(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.device = device
        self.embedding = nn.Embedding(1000, 10)  # stays on the CPU
        self.head = nn.Linear(10, 10).to(device)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).to(self.device))


out = SplitModel(second)(torch.randint(0, 1000, (4, 7)))
print(f"embedding on cpu, head on {second}: output {tuple(out.shape)} on {out.device}"
      + ("" if GPUS else " (no GPU: both parts on the CPU)"))

# %% [markdown]
# The seeds' DataParallel notes, in short: `device_ids` defaults to every GPU
# visible; `output_device` to `device_ids[0]`; the module's parameters must be
# on `device_ids[0]` before wrapping it; `device_ids=[0]` runs the machinery on
# one GPU without any parallelism; and device 0 carries the imbalance shown in
# section 5. Seed 000's `nn.Softmax()` without `dim` is deprecated: see
# Chapter 0.
#
# ## Summary
#
# - DataParallel = scatter + replicate + parallel_apply (threads) + gather, in
#   one process, every step; gradients sum back on device 0.
# - Done right it computes the same gradient as one device; the loss must be
#   taken over the gathered outputs.
# - The split follows `torch.chunk`: uneven pieces, and idle devices when the
#   batch is small.
# - Device 0 holds and does more; threads share the GIL; parameters are copied
#   every step; BatchNorm keeps replica 0's statistics. DistributedDataParallel
#   avoids all four, which is why PyTorch recommends it.

# %% [markdown]
# ## Exercises
#
# ### Exercise 5.1: scatter a batch as DataParallel does
#
# Write `scatter_batch(x, n, dim)`: the pieces DataParallel gives `n`
# devices, in order, cut along `dim` (all on `x`'s device).

# %% tags=["exercise"] exercise="5.1"
def scatter_batch(x, n, dim):
    ### BEGIN SOLUTION
    return list(torch.chunk(x, n, dim))
    ### END SOLUTION


# %% tags=["check"] exercise="5.1"
check_scatter_batch(scatter_batch)

# %% [markdown]
# ### Exercise 5.2: a data-parallel step by hand
#
# Write `data_parallel_step(model, x, y, n)`: split the batch over `n`
# replicas (all on `x`'s device), run them, and leave in `model`'s parameters'
# `.grad` the gradient of the mean squared error over the whole batch - the
# same as `mse_loss(model(x), y).backward()` would. Return that loss. Do not
# update the parameters. (You may reuse the primitives of section 3.)

# %% tags=["exercise"] exercise="5.2"
def data_parallel_step(model, x, y, n):
    ### BEGIN SOLUTION
    out = data_parallel(model, x, [x.device] * n)
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    return loss
    ### END SOLUTION


# %% tags=["check"] exercise="5.2"
check_data_parallel_step(data_parallel_step)

# %% [markdown]
# ### Exercise 5.3: which statistics survive?
#
# Write `dp_running_mean(bn, x, n)`: the `running_mean` that BatchNorm layer
# `bn` (in training mode) has after one DataParallel forward of the batch `x`
# on `n` devices.

# %% tags=["exercise"] exercise="5.3"
def dp_running_mean(bn, x, n):
    ### BEGIN SOLUTION
    bn.train()
    bn(torch.chunk(x, n)[0])
    return bn.running_mean
    ### END SOLUTION


# %% tags=["check"] exercise="5.3"
check_dp_running_mean(dp_running_mean)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | data parallelism | 数据并行 |
# | replica | 副本 |
# | scatter / gather | 分发 / 收集 |
# | output device | 输出设备 |
# | load imbalance | 负载不均衡 |
# | running statistics (BatchNorm) | 滑动统计量 |
# | synchronised BatchNorm | 同步批归一化 |
# | differentiable copy | 可微拷贝 |
