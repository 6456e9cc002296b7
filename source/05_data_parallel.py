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
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import Image, display
from torch import nn
from torch.func import functional_call

from course_utils import banner, predict, reference, try_all_gpus
from course_utils.build import ROOT
from course_utils.checks.ch05 import (
    check_apply_in_threads,
    check_make_replicas,
    check_predict_dp_bytes,
)
from course_utils.compare import compare as compare_timings
from course_utils.dist import launch

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
# here.)
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
# Device 0 keeps what every device has - a replica's parameters, and the
# gradient that backward sends to them before they are summed - and more: the
# original parameters, their summed gradients (`.grad`) and the optimizer's
# state. Rather than trust a formula, count it. The cell runs two Adam steps
# of the hand-made DataParallel on 3 "devices" and adds up, per device, the
# bytes of the tensors it would hold at the end of the backward pass
# (activations left out): hooks on each replica's parameters count the
# gradients that reach them. On a GPU, replica 0's parameters *are* the
# originals (torch's broadcast returns its input for the source device), so
# they are counted once; our CPU stand-in clones them, which is not counted.

# %%
def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def dp_bytes_per_device(model, x, n, steps=2):
    """Bytes per device after the backward of the last of `steps` DataParallel
    steps with Adam: parameters, gradients, optimizer state (no activations)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    devs = [torch.device("cpu")] * n
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        held = [0] * n

        def counter(i, held=held):
            def count(grad):
                held[i] += nbytes([grad])
            return count

        replicas = replicate(model, devs)
        for i, (_, tensors) in enumerate(replicas):
            for t in tensors.values():
                if t.requires_grad:  # a parameter's copy: count it and its gradient
                    held[i] += nbytes([t]) if i else 0  # replica 0: the originals
                    t.register_hook(counter(i))
        out = gather(parallel_apply(replicas, scatter(x, devs)), devs[0])
        out.square().mean().backward()
        if step < steps - 1:
            opt.step()  # Adam's state exists from the first step on
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    held[0] += nbytes(params) + nbytes(p.grad for p in params) + nbytes(state)
    return held, nbytes(params)


torch.manual_seed(0)
counted, param_bytes = dp_bytes_per_device(nn.Sequential(nn.Linear(64, 64), nn.Tanh(),
                                                         nn.Linear(64, 8)),
                                           torch.randn(12, 64), n=3)
per_param = [b / param_bytes * 4 for b in counted]  # bytes per float32 parameter
print("bytes per parameter, counted:", [f"{b:.2f}" for b in per_param])
print(f"device 0 holds {counted[0] / counted[1]:.2f}x what device 1 holds")

# %% [markdown]
# Device 0 holds about `4 + 4 + 4 + 8 = 20` bytes per parameter (its
# parameters, replica 0's gradient, the summed `.grad`, Adam's two states;
# Adam's step counters add a few bytes), each other device `4 + 4 = 8` (its
# replica and the gradient that reaches it): **2.5x**, not the "4x" that a
# count forgetting the replicas' gradients gives. The same counts, scaled to
# a 1-billion-parameter model on 4 GPUs:

# %%
P = 1e9
memory = reference.predicted(
    {f"device {i}": P * per_param[min(i, 1)] / 2**30 for i in range(4)}, "GiB",
    "4 GPUs under DataParallel",
    "bytes per parameter counted above on 3 CPU 'devices' (parameters, gradients "
    "reaching each replica, summed .grad, Adam's state), times P = 1e9; "
    "activations left out",
    caveat="not calibrated: no published measurement of DataParallel's memory per "
    "GPU was found; activations, the CUDA context and allocator rounding add to it")
for k, v in memory.value.items():
    print(f"  {k}: {v:5.1f} GiB")
print(f"  [{memory.label}]")

# %% [markdown]
# Device 0 also does the extra work of scattering, gathering, the loss and
# the optimizer step, while the others wait. DistributedDataParallel gives
# every device the same job instead (Chapter 6).
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
      "course_utils.predict --calibration: 8-GPU NVLink sweeps within 25 %); the "
      "DataParallel line leaves out its Python overhead, so it is optimistic (the "
      "published runs in section 6 are of other GPUs and another model)")

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
# And the backward pass? It is **not** run by `parallel_apply`'s threads:
# they have ended when `loss.backward()` is called. The caller's thread hands
# the graph to autograd's engine, which keeps one worker thread per GPU and
# runs each device's part of the graph there - so on GPUs the replicas'
# backward passes run at once, on the engine's device threads. CPU work has
# no such thread: the engine runs it on the thread that called `backward()`.
# Hooks on each replica's output record which thread ran what:

# %%
ran = {"forward": set(), "backward": set()}


class WhereItRuns(nn.Module):
    def forward(self, x):
        ran["forward"].add(threading.current_thread().name)
        if x.requires_grad:
            x.register_hook(lambda g: ran["backward"].add(
                threading.current_thread().name))
        return x


probe = nn.Sequential(nn.Linear(16, 4), WhereItRuns())
data_parallel(probe, torch.randn(9, 16), [torch.device("cpu")] * 3).sum().backward()
print(f"forward ran on {len(ran['forward'])} threads: {sorted(ran['forward'])}")
print(f"backward ran on: {sorted(ran['backward'])} "
      f"(this cell's thread: {threading.current_thread().name})")

# %% [markdown]
# **Claim** (seed 002): "each thread runs the forward and the backward of
# its piece". **Measured here**: the forward passes ran on three threads,
# the backward passes on the notebook's own thread. **Why**: the threads of
# `parallel_apply` only run the forward; backward is autograd's job, done on
# its per-GPU device threads on GPUs and on the calling thread on a CPU.
#
# So our `data_parallel` on CPU "devices" runs the replicas' backward passes
# one after the other. To see what GPUs get, `parallel_backward` below starts
# each replica's backward in its own thread, from the gradient that the loss
# sends to its output. Below, a small and a large model, one training step on
# one "device", and on two with each kind of backward, compared with the
# course's protocol (Chapter 4).

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
# ### DataParallel against DDP: published, and the CPU analogue
#
# Published measurements compare the two on real GPUs. The Hugging Face
# Transformers guide to multi-GPU training fine-tuned GPT-2 for 200 steps on
# 2 TITAN RTX GPUs, with DataParallel and with DDP (one process per GPU),
# with and without NVLink:

# %%
runs = {"DataParallel (NVLink there)": "dp_two_gpus_train_seconds",
        "DDP, NVLink used": "ddp_nvlink_train_seconds",
        "DDP, NVLink switched off": "ddp_no_nvlink_train_seconds"}
for label, key in runs.items():
    pub = reference.published(f"hf_multigpu_guide.{key}")
    print(f"  {label:28s} {pub.value:6.1f} s for 200 steps")
print(f"  [published: {pub.source}]")

# %% [markdown]
# DDP was faster with the fast link and slower without it: its gradient
# all-reduce is cheap only when the link is. The CPU analogue: the large
# model above, 2 "devices" as 2 threads of this process (our DataParallel,
# backward per replica) against 2 processes running PyTorch's DDP over gloo
# (Chapter 6 explains it), one core each, the same 5 steps. Each DDP rank
# times its own steps, so the processes' start-up is not counted.

# %%
def ddp_steps(rank, world, width, rows, steps):
    torch.manual_seed(0)
    net = nn.parallel.DistributedDataParallel(
        nn.Sequential(*[nn.Linear(width, width) for _ in range(8)]))
    xb = torch.randn(rows, width).chunk(world)[rank]
    net(xb).sum().backward()  # warm-up
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        net(xb).sum().backward()
    return time.perf_counter() - w0, time.process_time() - c0


def ddp_run(steps=5):
    ranks = [r.value for r in launch(ddp_steps, 2, args=(512, 512, steps),
                                     backend="gloo", echo=False)]  # CPU ranks
    return {"wall_s": max(w for w, _ in ranks), "cpu_s": sum(c for _, c in ranks)}


torch.manual_seed(0)
net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
xb = torch.randn(512, 512)
saved = torch.get_num_threads()
torch.set_num_threads(1)
try:
    analogue = compare_timings({
        "DataParallel: 2 threads": lambda: [dp_step(net, xb, 2, True)
                                            for _ in range(5)],
        "DDP: 2 processes": ddp_run}, repeats=3, number=1)
finally:
    torch.set_num_threads(saved)
print(analogue)

# %% [markdown]
# Read the verdict beside the published runs. On a CPU the two move no bytes
# over a link worth the name, so what separates them is what the GIL and
# the threads cost DataParallel against what gloo's all-reduce costs DDP;
# when another program uses the cores the verdict says "disturbed".
#
# ## 7. BatchNorm under DataParallel
#
# A BatchNorm layer normalises with the statistics of the batch it sees. Under
# DataParallel each replica sees only its piece, so it normalises with that
# piece's mean and variance - not the whole batch's. And the running
# statistics (used at evaluation) are buffers: each replica updates its own
# copy, and only **replica 0's** copy is the module's own. The other pieces'
# statistics are lost. Our `replicate` does the same: replica 0 runs with the
# module's buffers, every other replica with copies of its own, so no two
# threads update one buffer. One forward on the chapter's devices (3 CPU
# "devices", or the GPUs), against BatchNorm run on replica 0's piece alone
# (and, with 2 or more GPUs, PyTorch's DataParallel):

# %%
torch.manual_seed(0)
bn = nn.BatchNorm1d(3, momentum=0.1).to(devices[0])
xb = (torch.randn(12, 3) + torch.arange(12.0)[:, None] / 4).to(devices[0])
ours = copy.deepcopy(bn)
data_parallel(ours, xb, devices)
replica0 = copy.deepcopy(bn)
replica0(torch.chunk(xb, len(devices))[0])  # what DataParallel keeps
whole = copy.deepcopy(bn)
whole(xb)  # what one device would keep
runs = {"ours, 3 devices": ours, "replica 0's piece only": replica0,
        "the whole batch": whole}
if len(GPUS) >= 2:
    theirs = copy.deepcopy(bn)
    nn.DataParallel(theirs, device_ids=devices)(xb)
    runs[f"nn.DataParallel, {len(devices)} GPUs"] = theirs
for name, m in runs.items():
    print(f"{name:24s} num_batches_tracked {m.num_batches_tracked.item()}, running "
          f"mean {[round(v, 4) for v in m.running_mean.tolist()]}")
print("ours equal replica 0's:", all(
    torch.allclose(a, b, atol=1e-6) for a, b in
    zip(ours.buffers(), replica0.buffers(), strict=True)))

# %% [markdown]
# One batch tracked, and replica 0's statistics. (A `replicate`
# that gave every replica the module's own buffers would let three threads
# update them at once: three batches tracked, and running statistics that
# change from run to run.) `nn.SyncBatchNorm` computes the statistics over
# all devices at once, with a collective: Chapter 6.

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
# on `device_ids[0]` whenever it runs (every forward checks; with one device
# DataParallel moves the module there itself when wrapping it); `device_ids=[0]`
# only moves the input to that GPU and calls the module, with no replicas and
# no gather; and device 0 carries the imbalance shown in section 5. Seed 000's
# `nn.Softmax()` without `dim` is deprecated: see Chapter 0.
#
# ## Summary
#
# - DataParallel = scatter + replicate + parallel_apply (threads) + gather, in
#   one process, every step; gradients sum back on device 0.
# - Done right it computes the same gradient as one device; the loss must be
#   taken over the gathered outputs.
# - The split follows `torch.chunk`: uneven pieces, and idle devices when the
#   batch is small.
# - The replicas' threads run only the forward; autograd runs the backward
#   (on its per-GPU threads, or on the calling thread on a CPU).
# - Device 0 holds about 2.5x what the others hold with Adam (counted: the
#   replicas' gradients included) and does more; threads share the GIL;
#   parameters are copied every step; BatchNorm keeps replica 0's statistics.
#   DistributedDataParallel avoids all four, which is why PyTorch recommends
#   it - though with a slow link a published run found DataParallel faster.

# %% [markdown]
# ## Exercises
#
# ### Exercise 5.1: replicas by hand
#
# Write `make_replicas(module, devices)`: one replica per device, each a
# callable `replica(x)` that computes what `module(x)` computes, so that
# DataParallel's steps can run them on their pieces, in threads at once.
# Without looking at section 3, make sure that:
#
# - backward through any replica's output reaches `module`'s own parameters,
#   and the replicas' gradients add up there (the module's parameters stay in
#   place, unchanged);
# - replicas running in threads at the same time do not disturb each other;
# - the model's dtype is kept (float64 too);
# - replica 0 updates the module's own buffers (BatchNorm's running
#   statistics), every other replica a copy of its own, as DataParallel does.
#
# The checker's "devices" are all the CPU; it changes the module's parameters
# between calls.

# %% tags=["exercise"] exercise="5.1"
def make_replicas(module, devices):
    ### BEGIN SOLUTION
    class Replica(nn.Module):
        def __init__(self, index, device):
            super().__init__()
            self.shell = copy.deepcopy(module).to(device)
            self.tensors = {k: p.to(device) if p.device != device else p.clone()
                            for k, p in module.named_parameters()}
            self.tensors.update({k: b if index == 0 else b.to(device, copy=True)
                                 for k, b in module.named_buffers()})

        def forward(self, x):
            return functional_call(self.shell, self.tensors, (x,))

    return [Replica(i, d) for i, d in enumerate(devices)]
    ### END SOLUTION


# %% tags=["check"] exercise="5.1"
check_make_replicas(make_replicas)

# %% [markdown]
# ### Exercise 5.2: parallel_apply by hand
#
# Write `apply_in_threads(fns, inputs, timeout=60)`: call `fns[i](*inputs[i])`
# for every `i`, each in a thread of its own, all at once, and return the
# outputs in the order of `fns`. If a function raises, raise its exception in
# the caller once every thread has ended; if a thread is still running
# `timeout` seconds after the start, raise `TimeoutError` instead of waiting.
# The checker's functions only complete when they all run at the same time.

# %% tags=["exercise"] exercise="5.2"
def apply_in_threads(fns, inputs, timeout=60):
    ### BEGIN SOLUTION
    outputs, errors = [None] * len(fns), [None] * len(fns)

    def run(i):
        try:
            outputs[i] = fns[i](*inputs[i])
        except Exception as e:  # noqa: BLE001 - raised below, in the caller
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a function was still running after {timeout} s")
    for e in errors:
        if e is not None:
            raise e
    return outputs
    ### END SOLUTION


# %% tags=["check"] exercise="5.2"
check_apply_in_threads(apply_in_threads)

# %% [markdown]
# ### Exercise 5.3: predict device 0's memory, then count it
#
# Write `predict_dp_bytes(model, n, optimizer)`: the bytes each of `n` devices
# holds under DataParallel at the end of the backward pass of the second
# training step, as a list (device 0 first): parameters, gradients and the
# optimizer's state (`"sgd"`: none, `"momentum"`: one buffer per parameter,
# `"adam"`: two; leave out Adam's scalar step counters), activations left
# out. The model may be float32, float64 or bfloat16. The checker counts the
# real tensors of a hand-made DataParallel step and compares, for 1 to 8
# devices (remember what `nn.DataParallel` does with a single device).

# %% tags=["exercise"] exercise="5.3"
def predict_dp_bytes(model, n, optimizer):
    ### BEGIN SOLUTION
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    states = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]
    if n == 1:  # the module itself: no replica, one gradient
        return [size * (2 + states)]
    return [size * (3 + states)] + [2 * size] * (n - 1)
    ### END SOLUTION


# %% tags=["check"] exercise="5.3"
check_predict_dp_bytes(predict_dp_bytes)

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
