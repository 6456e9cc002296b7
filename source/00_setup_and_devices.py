# %% [markdown]
# # Chapter 0 - Setup and devices
#
# **What you will learn**
#
# - why deep learning needs parallelism (compute, memory, scale), and how
#   *parallel*, *concurrent* and *distributed* differ;
# - how to ask PyTorch (and pycuda) what hardware this machine has;
# - where a tensor lives (`tensor.device`), what a device name such as
#   `"cuda"` means, how `.to()` moves tensors and modules - differently - and
#   how to write code that runs on any device;
# - what happens when an operation mixes devices;
# - how GPU memory is counted: allocated vs reserved, and the old name
#   `memory_cached`.
#
# **Hardware.** Every cell runs on a laptop CPU. With a GPU the probes describe
# it and the memory cells measure it; without one they say so and use the CPU
# (and PyTorch's `meta` device) for the same lessons. A GPU figure shown
# without a GPU is labelled with its kind: *published* (a datasheet or paper,
# cited), *predicted* (a stated model), or *recorded* (a run of this course on
# a GPU, when one has been made).

# %%
import gc
import threading
import warnings

import matplotlib.pyplot as plt
import psutil
import torch
from torch import nn

from course_utils import (
    banner,
    bench,
    check_fits,
    devices,
    plots,
    reference,
    try_all_gpus,
    try_gpu,
)
from course_utils.devices import format_bytes

torch.manual_seed(0)
banner();

# %% [markdown]
# ## 1. Why parallelism?
#
# Three pressures push training off a single processor:
#
# - **Compute.** Training a frontier model now takes 10^25 floating-point
#   operations (FLOP) and more (Meta's published count for Llama 3 405B is
#   printed below). No single chip does that in a useful time.
# - **Memory.** A model's weights, gradients and optimizer state outgrow one
#   device's memory long before they outgrow a cluster's.
# - **Scale.** Both problems are solved by many devices working together, which
#   brings the subject of this course: splitting the work and moving data
#   between devices without wasting them. How many GPUs fit in one server is
#   not set by PCIe lanes any more, as older slides say. A training server
#   typically holds 8 GPUs joined by NVLink through NVSwitch chips, and what
#   stops it from holding more is power, cooling and how the links can be
#   wired. Between servers the network is much slower. The fast domain is
#   growing: NVIDIA's GB200 NVL72 joins a whole rack of GPUs by NVLink.
#
# The paper on Megatron-LM (Narayanan et al., SC'21) reports training a GPT
# model of about one trillion parameters on thousands of A100 GPUs. Its
# published figures are enough to see both pressures; the next cell does the
# arithmetic. Nothing in it is measured here: each input is a published figure
# from the course's data files, and its source is printed once, below.

# %%
cited = {}


def published(key):
    """The value of a published figure; its source is listed by `sources()`."""
    cited[key] = reference.published(key)
    return cited[key].value


def sources():
    for key, fig in cited.items():
        print(f"  [{key}] {fig.value} {fig.unit}: {fig.label}")
    cited.clear()


gpus = published("megatron_2021.gpu_count")
aggregate = published("megatron_2021.aggregate_pflops") * 1e15  # FLOP/s
a100_peak = published("a100_sxm_80gb.bf16_tensor_dense_tflops") * 1e12
per_gpu = aggregate / gpus
print(f"{gpus} GPUs at {aggregate / 1e15:.0f} PFLOP/s: {per_gpu / 1e12:.0f} TFLOP/s "
      f"per GPU = {per_gpu / a100_peak:.0%} of the A100's bf16 peak")

params = 1e12
bytes_per_param = 2 + 2 + 12  # fp16 weights, fp16 grads, fp32 master weights + Adam
state = params * bytes_per_param
gpu_bytes = published("h100_sxm.memory_gb") * 1e9
print(f"weights + grads + Adam state: {state / 1e12:.0f} TB; at least "
      f"{state / gpu_bytes:.0f} GPUs of {gpu_bytes / 1e9:.0f} GB just to hold them")

llama_flop = published("llama3.training_compute_flop")
days = llama_flop / aggregate / 86400
print(f"Llama 3 405B ({llama_flop:.1e} FLOP) at the Megatron run's rate: "
      f"{days:.0f} days ({days / 365:.1f} years); Meta used "
      f"{published('llama3.gpus'):,} H100s")
print("sources:")
sources()

# %% [markdown]
# Each GPU kept about half of its peak busy, and merely *storing* the training
# state needs a couple of hundred GPUs - before a single activation is kept for
# the backward pass. And the whole machine of 2021 would need years for one of
# today's frontier training runs.
#
# The bandwidths of the *Scale* bullet are quoted differently: NVIDIA's NVLink
# figure adds both directions, a network port's is bits per second in each
# direction. Put on the same footing:

# %%
nvlink_each_way = published("h100_sxm.nvlink_bandwidth_total_gbps") / 2  # GB/s
ndr_each_way = published("ndr_infiniband.bandwidth_per_direction_gbps")  # 400 Gb/s
print(f"NVLink: {nvlink_each_way:.0f} GB/s each way per H100; "
      f"one NDR port: {ndr_each_way:.0f} GB/s each way "
      f"({nvlink_each_way / ndr_each_way:.0f}x less)")
print(f"one NVLink domain: {published('hgx_h100.gpus_per_nvlink_domain')} GPUs in "
      f"an H100 server, {published('gb200_nvl72.gpus_per_nvlink_domain')} in a "
      "GB200 NVL72 rack")
print("sources:")
sources()

# %% [markdown]
# That gap between inside a server and across servers shapes how later
# chapters split the work: the kinds of parallelism that exchange data all the
# time stay inside the fast NVLink domain, and the ones that talk less cross
# the network (Chapters 6 and 7). The rest of the course shows these
# techniques at a size that fits on your machine.
#
# ## 2. Parallel, concurrent, distributed
#
# These three words are often mixed up:
#
# | word | meaning | example in PyTorch |
# | --- | --- | --- |
# | **concurrent** | several tasks are *in progress* at once; they may take turns on one processor | a DataLoader worker preparing the next batch while the GPU trains (Chapter 3) |
# | **parallel** | several computations *execute at the same instant* on separate hardware | the thousands of threads of one CUDA kernel (Chapter 1); several GPUs each running a replica (Chapters 5, 6) |
# | **distributed** | the work is spread over processes with *separate memories* that communicate by messages | `torch.distributed` with one process per GPU, possibly on several machines (Chapter 6) |
#
# Parallelism needs concurrency, but not the other way round: two Python
# threads can take turns on one core (concurrent, not parallel). Distributed
# programs are usually parallel too, and pay for it in communication.
#
# ## 3. What does this machine have?
#
# `torch.cuda` answers the GPU questions. Each probe below runs live; without a
# GPU the cell says so instead of failing.

# %%
print("torch", torch.__version__, "| CUDA build:", torch.version.cuda)
print("torch.cuda.is_available():", torch.cuda.is_available())
print("torch.cuda.device_count():", torch.cuda.device_count())
if torch.cuda.is_available():
    i = torch.cuda.current_device()
    print("torch.cuda.current_device():", i)
    print("torch.cuda.get_device_name(i):", torch.cuda.get_device_name(i))
    print("torch.cuda.get_device_properties(i):", torch.cuda.get_device_properties(i))
    for key, value in devices.gpu_facts(i).items():
        is_size = ("memory" in key or "bytes" in key or "total" in key) and value
        print(f"  {key:>24}: {format_bytes(value) if is_size else value}")
else:
    print("No CUDA GPU: current_device, get_device_name and get_device_properties "
          "would raise here, so they are only called when a GPU exists.")

# %% [markdown]
# The CPU matters too: it feeds the GPU, runs the data loading, and is the
# device for everything in this course when there is no GPU. `torch` uses a
# pool of threads for one operation (intra-op) and another for independent
# operations (inter-op).
#
# Count its cores with care. With **SMT** (simultaneous multithreading, which
# Intel calls hyper-threading) one **physical core** runs two hardware
# threads and the operating system shows it as two **logical cores**, called
# siblings. The siblings share that core's execution units, its SIMD units
# included: a second thread helps when the first one is stalled, waiting for
# memory, but two number-crunching threads on siblings rarely get much more
# done than one. `os.cpu_count()` counts logical cores; `psutil` also counts
# physical ones (or answers `None` where the system does not say).

# %%
cpu_info = devices.cpu_facts()
for key, value in cpu_info.items():
    print(f"{key:>22}: {format_bytes(value) if key.startswith('memory') else value}")

physical, logical = cpu_info["physical_cores"], cpu_info["logical_cores"]
if physical is None:
    print(f"\n{logical} logical cores; this system does not report physical ones")
elif logical > physical:
    print(f"\n{physical} physical cores show up as {logical} logical ones: SMT is on")
else:
    print(f"\n{physical} physical cores, {logical} logical: no SMT here")

# %% [markdown]
# ### pycuda: the driver's own view
#
# pycuda talks to the CUDA driver directly and reports every attribute the
# driver knows (warp size, shared memory per block, clock rates, ...). A
# popular snippet wraps it in a class `aboutCudaDevices`; it has bugs worth
# knowing:
#
# - it imports `pycuda.autoinit` but never `pycuda.driver as cuda`, so every
#   method fails with `NameError: cuda`;
# - `autoinit` creates a context on GPU 0 as a side effect of the import;
# - its `mem_get_info()` reports the free memory of the *current context's*
#   GPU only, although it is described as "all devices";
#
# One thing in it that looks like a bug is not: it divides by 10^9 and calls
# the result GB, which is what a gigabyte is (SI units, as disk and network
# makers count). Memory is usually sized in powers of two, and `nvidia-smi`
# and this course print MiB and GiB (2^20 and 2^30 bytes): 80 GB is 74.5 GiB.
# Neither is wrong; a number without its unit is.
#
# `course_utils.devices.pycuda_facts` does the same job with the real bugs
# fixed: it enters each GPU's primary context in turn (the one PyTorch uses)
# before asking for its memory. The cell prints sizes in binary units.

# %%
facts = devices.pycuda_facts()
if isinstance(facts, str):
    print(facts)
else:
    for d in facts:
        print(f"GPU {d['id']}: {d['name']}, {format_bytes(d['memory_free'])} free of "
              f"{format_bytes(d['memory_total'])}")
        for name in ("WARP_SIZE", "MAX_THREADS_PER_BLOCK", "MULTIPROCESSOR_COUNT",
                     "MAX_SHARED_MEMORY_PER_BLOCK", "L2_CACHE_SIZE"):
            value = d["attributes"].get(name)
            if value and name.endswith(("MEMORY_PER_BLOCK", "CACHE_SIZE")):
                value = f"{format_bytes(value)} ({value:,} B)"  # the driver gives bytes
            print(f"  {name}: {value}")

# %% [markdown]
# ## 4. Where a tensor lives
#
# Every tensor has a `device`: `cpu`, `cuda:0`, `cuda:1`, ... Create tensors
# directly on their device instead of creating them on the CPU and copying.
# `course_utils.try_gpu()` returns GPU 0 when there is one and the CPU otherwise
# (so the code below runs anywhere); `try_all_gpus()` returns every GPU, or
# `[cpu]` - never an empty list.

# %%
device = try_gpu()
x = torch.ones(2, 3, device=device)
print(x.device, "| try_all_gpus():", try_all_gpus())
print("x.get_device():", x.get_device(), "(-1 means the CPU)")

# %% [markdown]
# Two corrections to older tutorials:
#
# - `tensor.get_device()` does not fail on a CPU tensor: it returns `-1`.
#   `tensor.device` is the clearer spelling and works for every device.
# - The legacy constructors (`torch.Tensor(data, device=...)`,
#   `torch.cuda.FloatTensor`) are not the way to make a tensor on a GPU:
#   `torch.Tensor` refuses a CUDA device outright.

# %%
try:
    torch.Tensor([1.0, 2.0], device="cuda:0")
except RuntimeError as e:
    print("RuntimeError:", e)
print(torch.tensor([1.0, 2.0], device=device))  # the modern factory

# %% [markdown]
# Asking for a GPU that does not exist is a common mistake when code moves
# between machines. `try_gpu` answers in one line instead of failing later:

# %%
print(try_gpu(99))

# %% [markdown]
# ### Naming a device, and the *current* device
#
# A `torch.device` is only a name for a place: a type (`cpu`, `cuda`, `meta`,
# ...) and an optional index. Making one touches no hardware, so
# `torch.device("cuda", 1)` works on a laptop; only putting a tensor there
# needs that GPU. A name without an index, `torch.device("cuda")`, does not
# mean GPU 0: it means the **current** CUDA device, whichever GPU the process
# has selected when the tensor is made (GPU 0 unless something changed it).
# The cell also names `meta`, a device that records shapes and dtypes but
# holds no data. Section 6 explains it; until then it stands in for a second
# device, so that the cells show on any machine what a GPU would show.

# %%
for name in (torch.device("cuda"), torch.device("cuda", 1), torch.device("cuda:1"),
             torch.device("meta"), torch.device("cpu")):
    print(f"{name!r:35} type: {name.type:5} index: {name.index}")
print("torch.device('cuda', 1) == torch.device('cuda:1'):",
      torch.device("cuda", 1) == torch.device("cuda:1"))
print("torch.device('cuda') == torch.device('cuda:0'):",
      torch.device("cuda") == torch.device("cuda:0"))

# %% [markdown]
# Three calls read and change the current device; they need a GPU:
#
# - `torch.cuda.current_device()` returns its index;
# - `torch.cuda.set_device(i)` changes it for the **calling thread** from then
#   on, not for the process: the CUDA runtime keeps one current device per
#   host thread (`cudaSetDevice`), and a thread started later begins on GPU 0
#   (Chapter 6 calls it once in each process, at the start of the thread that
#   does the work, so that each process's `"cuda"` is its own GPU);
# - `with torch.cuda.device(i):` changes it inside the block only, and puts
#   the old one back at the end.
#
# Calls that take no device use the current one. Chapter 3 relies on this:
# `torch.cuda.synchronize()` with no argument waits for the current device
# only, not for every GPU. With two GPUs or more the cell shows the current
# device changing, in this thread and not in a new one; with one it shows
# where `"cuda"` lands; without a GPU it says what it would show.

# %%
def lands_on():
    return torch.ones(1, device="cuda").device


def in_a_new_thread(fn):
    """What `fn()` returns when a freshly started thread calls it."""
    out = {}
    worker = threading.Thread(target=lambda: out.update(value=fn()))
    worker.start()
    worker.join()
    return out["value"]


if torch.cuda.device_count() >= 2:
    start = torch.cuda.current_device()
    print("current device:", start, "| 'cuda' lands on", lands_on())
    with torch.cuda.device(1):
        print("inside `with torch.cuda.device(1)`:", torch.cuda.current_device(),
              "| 'cuda' lands on", lands_on())
    print("after the block:", torch.cuda.current_device())
    torch.cuda.set_device(1)
    print("after set_device(1): this thread", torch.cuda.current_device(),
          "| 'cuda' lands on", lands_on(), "| a new thread:",
          in_a_new_thread(torch.cuda.current_device), "and lands on",
          in_a_new_thread(lands_on))
    torch.cuda.set_device(start)  # put it back for the rest of the notebook
elif torch.cuda.is_available():
    print("current device:", torch.cuda.current_device(), "| 'cuda' lands on",
          lands_on(), "| in a new thread:", in_a_new_thread(lands_on))
    print("One GPU: there is no other device to switch to. With two, set_device(1) "
          "would make 'cuda' land on cuda:1 in this thread only; a new thread "
          "would still start on cuda:0.")
else:
    print("No GPU, so there is no current device. On a machine with two GPUs, "
          "current_device() answers 0 at the start and device='cuda' lands on "
          "cuda:0; after set_device(1), or inside `with torch.cuda.device(1)`, "
          "it lands on cuda:1 in this thread, while a thread started afterwards "
          "still begins on cuda:0.")

# %% [markdown]
# Two names look alike and do different jobs. `torch.device("cuda", 0)` is a
# *name*: you pass it to `.to()` and to `device=`. `torch.cuda.device(0)` is a
# *context manager* for a `with` block that changes the current device. It is
# not a `torch.device`, and `.to()` refuses it, on tensors and modules alike -
# yet a widely shared slide deck moves its models with
# `.to(torch.cuda.device(0))`. Making the context manager object needs no GPU,
# so the mistake shows on any machine:

# %%
ctx = torch.cuda.device(0)
print("isinstance(torch.cuda.device(0), torch.device):",
      isinstance(ctx, torch.device))
for thing in (torch.ones(2), nn.Linear(2, 2)):
    try:
        thing.to(ctx)
    except TypeError as e:
        print(f"{type(thing).__name__}.to(torch.cuda.device(0)): TypeError:",
              str(e).splitlines()[0].split(", but")[0])
name = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("meta")
print("a torch.device is accepted:", torch.ones(2).to(name).device)

# %% [markdown]
# ## 5. `.to()` moves tensors and modules differently
#
# `tensor.to(...)` returns a **new** tensor and leaves the original where it was
# (unless nothing needs to change: then it returns the tensor itself).
# `module.to(...)` changes the module **in place** and returns the same module.
# It does not replace its parameters: each `nn.Parameter` stays the same
# Python object, and only the data inside it (its `.data`) is swapped for the
# converted copy, so a reference to a parameter taken before the move sees the
# moved data. Buffers, such as BatchNorm's running statistics, are replaced by
# new tensors. `.to(dtype)` follows the same rules as `.to(device)`, so the
# cell shows both on any machine.

# %%
t = torch.ones(3)
t64 = t.to(torch.float64)
print("tensor: new object?", t64 is not t, "| original still", t.dtype)
print("tensor: .to() with nothing to change returns itself:", t.to(t.device) is t)

m = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
w, stats = m[0].weight, m[1].running_mean  # references taken before the move
m2 = m.to(torch.float64)
print("module: same object?", m2 is m, "| its weight is now", m[0].weight.dtype)
print("same Parameter object?", m[0].weight is w, "| the old reference is",
      w.dtype, "| same buffer object?", m[1].running_mean is stats)

t_moved = t.to(device)
print("t stays on", t.device, "| t.to(device) is on", t_moved.device,
      "| a new tensor?", t_moved is not t, "(not when t is there already)")

# %% [markdown]
# Why it matters: an optimizer keeps references to the Parameter objects it was
# given. Because `model.to(...)` keeps those objects, an optimizer created
# before the move still updates the model's real parameters. The usual advice
# is still to **move the model first, then create the optimizer**, for two
# reasons the cell shows. An optimizer that makes its state when it is created
# (Adagrad does) leaves that state where it was. And a conversion that cannot
# swap the data inside the same object - moving to the `meta` device is one -
# makes new Parameter objects, which the optimizer has never seen.

# %%
layer = nn.Linear(3, 2)
opt = torch.optim.Adagrad(layer.parameters(), lr=0.1)  # makes its state now
layer.to(device=device, dtype=torch.float64)
held = opt.param_groups[0]["params"][0]
print("optimizer holds layer.weight after the move:", held is layer.weight,
      f"| {held.device}, {held.dtype}")
adagrad_sum = opt.state[held]["sum"]
print(f"but its state stayed where it was: {adagrad_sum.device}, {adagrad_sum.dtype}")

layer.to("meta")
print("after .to('meta') the optimizer holds layer.weight:",
      opt.param_groups[0]["params"][0] is layer.weight)

# %% [markdown]
# So `batch.to(device)` on a line of its own does nothing useful: assign the
# result. For modules `model.to(device)` is enough, though
# `model = model.to(device)` does no harm.
#
# ### `.cuda()`, `.cuda(i)` and `.cpu()`
#
# Older code, the seeds of this course among it, moves things with `.cuda()`
# and `.cpu()`. They are shorthands for `.to()` and follow the same rules:
#
# | shorthand | the same as |
# | --- | --- |
# | `t.cuda()` | `t.to("cuda")`: the *current* GPU |
# | `t.cuda(1)` | `t.to("cuda:1")` |
# | `t.cpu()` | `t.to("cpu")` |
# | `model.cuda()`, `model.cuda(1)`, `model.cpu()` | `model.to(...)`: in place, returns the same module |
#
# A tensor's shorthand returns a new tensor (or the tensor itself when it is
# there already); a module's moves the module. The drawback of `.cuda()` is
# that it writes a GPU into the code: without one it raises, so the code no
# longer runs on a laptop. `.to(device)` with a device picked once runs
# everywhere. `.cpu()` stays the usual way to bring a result back for printing
# or for NumPy.

# %%
t = torch.ones(3)
m = nn.Linear(2, 2)
print("t.cpu() is t (it is on the CPU already):", t.cpu() is t,
      "| m.cpu() is m:", m.cpu() is m)
if torch.cuda.is_available():
    last = torch.cuda.device_count() - 1
    g = t.cuda()
    print("t.cuda() ->", g.device, "| t.to('cuda') ->", t.to("cuda").device)
    print(f"t.cuda({last}) ->", t.cuda(last).device, f"| t.to('cuda:{last}') ->",
          t.to(f"cuda:{last}").device)
    print("g.cpu() ->", g.cpu().device, "| a new tensor:", g.cpu() is not g)
    print("m.cuda() is m:", m.cuda() is m, "| its weight is now on", m.weight.device)
    m.cpu()
else:
    for what, call in (("t.cuda()", t.cuda), ("m.cuda()", m.cuda),
                       ("t.cuda(1)", lambda: t.cuda(1))):
        try:
            call()
        except (AssertionError, RuntimeError) as e:  # what a CPU-only build raises
            print(f"{what} without a GPU: {type(e).__name__}: {e}")

# %% [markdown]
# ### Which device is a model on?
#
# A tensor has one device; a module has none. `nn.Module` has no `.device`
# attribute (some slides say it has), because nothing forces its
# parameters onto one device: Chapter 7 splits models across devices on
# purpose. The usual idiom asks the first parameter,
# `next(model.parameters()).device`, which is right when all of them live
# together; collect the set of devices to be sure. Tensors also have
# `is_cuda` (`True` on any GPU); older tutorials ask
# `next(model.parameters()).is_cuda`, with the same blind spot.

# %%
net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
print("hasattr(net, 'device'):", hasattr(net, "device"))
first = next(net.parameters())
print("first parameter:", first.device, "| is_cuda:", first.is_cuda)

elsewhere = device if device.type == "cuda" else torch.device("meta")
net[1].to(elsewhere)  # the second layer moves, the first stays
print("first parameter still says", next(net.parameters()).device,
      "| all of them:", {p.device for p in net.parameters()})

# %% [markdown]
# ### Device-agnostic code
#
# Pick the device once, at the top, and create or move everything with it. The
# same training step then runs on a laptop, on one GPU, or on GPU 3.

# %%
device = try_gpu()  # or: torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
inputs = torch.randn(32, 20).to(device)
targets = torch.randint(0, 4, (32,), device=device)
loss = nn.functional.cross_entropy(model(inputs), targets)
loss.backward()
opt.step()
print(f"one step on {device}: loss {loss.item():.3f}")

# %% [markdown]
# **A correction to a seed.** Seed 004's device-agnostic snippet writes
# `model = MyModule.to(device)`. That calls `.to` on the *class*, not on a
# model, so the device lands where the model should be and the call fails at
# once. Make the model, then move it: `model = MyModule().to(device)`.

# %%
MyModule = nn.Linear  # any nn.Module class
try:
    MyModule.to(device)
except (AttributeError, TypeError) as e:
    print(f"MyModule.to(device): {type(e).__name__}: {e}")
print("MyModule(4, 2).to(device):", next(MyModule(4, 2).to(device).parameters()).device)

# %% [markdown]
# ### A default device: `torch.set_default_device` and `with torch.device(...)`
#
# Factory functions (`torch.zeros`, `torch.randn`, `torch.tensor`, ...) and the
# layers built with them make their tensors on the *default device*, the CPU
# unless you change it. `with torch.device(d):` changes it inside the block;
# `torch.set_default_device(d)` changes it from then on, for the calling
# thread only, like `set_device` (PyTorch keeps it in a `threading.local`). An
# explicit `device=` still wins. Building a model inside
# `with torch.device("cuda"):` makes its parameters on the GPU directly,
# without a copy on the CPU first, and `with torch.device("meta"):` builds a
# model of any size with no memory at all (Chapter 8 uses it). The PyTorch
# documentation warns that a default device other than the CPU adds a little
# cost to every call into torch, so prefer the `with` block, or
# `device=` at the call. The cell uses `meta`, so it shows the same on any
# machine.

# %%
with torch.device("meta"):
    layer = nn.Linear(1000, 1000)
    print("inside `with torch.device('meta')`: weight on", layer.weight.device,
          "| torch.zeros(2) on", torch.zeros(2).device,
          "| device='cpu' still wins:", torch.zeros(2, device="cpu").device)
print("after the block:", torch.zeros(2).device)
torch.set_default_device("meta")
try:
    print("after set_default_device('meta'): torch.tensor([1.0]) on",
          torch.tensor([1.0]).device, "| in a new thread:",
          in_a_new_thread(lambda: torch.tensor([1.0]).device))
finally:
    torch.set_default_device(None)  # back to the CPU for the rest of the notebook
print("default device now:", torch.get_default_device())

# %% [markdown]
# ### Making new tensors without naming a device
#
# Inside a model's `forward()` there is no `device` variable at hand, and
# `torch.zeros(shape)` makes a CPU float32 tensor whatever the input is. Make
# new tensors *from* a tensor you already have instead:
#
# - `torch.zeros_like(t)`, `torch.randn_like(t)`: `t`'s shape, dtype and device;
# - `t.new_zeros(shape)`, `t.new_full(shape, value)`: a new shape, with `t`'s
#   dtype and device.
#
# The cell makes them from a float64 CPU tensor and from a float16 tensor on
# the `meta` device.

# %%
def made_from(x):
    return {
        "torch.zeros_like(x)": torch.zeros_like(x),
        "torch.randn_like(x)": torch.randn_like(x),
        "x.new_zeros((4,))": x.new_zeros((4,)),
        "x.new_full((2, 2), 7.0)": x.new_full((2, 2), 7.0),
    }


for x in (torch.ones(2, 3, dtype=torch.float64),
          torch.ones(2, 3, dtype=torch.float16, device="meta")):
    print(f"x: {x.device}, {x.dtype}")
    for how, new in made_from(x).items():
        print(f"  {how:24} -> {new.device}, {new.dtype}, shape {tuple(new.shape)}")

# %% [markdown]
# In a module that is the difference between code that follows its input and
# code that works only on the CPU. The `meta` device shows it on any machine,
# as a GPU would:

# %%
class AddNoise(nn.Module):
    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)  # follows x wherever it is


class AddNoiseOnCPU(nn.Module):
    def forward(self, x):
        return x + 0.1 * torch.randn(x.shape)  # always a CPU tensor


x = torch.ones(2, 3, device="meta")
print("randn_like:", AddNoise()(x).device)
try:
    AddNoiseOnCPU()(x)
except RuntimeError as e:
    print("torch.randn(x.shape): RuntimeError:", str(e).splitlines()[0])

# %% [markdown]
# A fixed tensor that a module needs in every call (a mask, a table of
# positions) belongs in a **buffer**: `self.register_buffer("name", tensor)`.
# `module.to()` moves and converts buffers along with the parameters, they are
# saved in the `state_dict`, and an optimizer never sees them, since they are
# not parameters. A tensor kept as a plain attribute is invisible to
# `module.to()` and stays where it was made:

# %%
class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("weights", torch.linspace(0.5, 1.5, n))  # moves
        self.plain = torch.linspace(0.5, 1.5, n)  # does not

    def forward(self, x):
        return x * self.weights


scale = Scale(3).to("meta")
print("buffer:", scale.weights.device, "| plain attribute:", scale.plain.device,
      "| parameters:", len(list(scale.parameters())),
      "| in the state_dict:", list(scale.state_dict()))
print("forward on meta:", scale(torch.ones(2, 3, device="meta")).device)

# %% [markdown]
# ## 6. Operations across devices raise
#
# The CPU and a GPU have separate memories; an operator cannot read operands
# from both, and PyTorch does not copy silently. On a GPU machine we add a CPU
# tensor to a CUDA tensor. Without a GPU we use PyTorch's **`meta` device**: it
# records shapes and dtypes but holds no data, so device-placement mistakes
# show up on any machine - with the same kind of error.

# %%
other = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("meta")
a, b = torch.ones(2), torch.ones(2, device=other)
try:
    a + b
except RuntimeError as e:
    print(f"cpu + {other}: RuntimeError: {e}")
print("fixed:", a.to(other) + b)

# %% [markdown]
# The fix is always to bring the operands together explicitly with `.to()`.
# The `meta` device also runs whole models, which is handy for checking shapes
# of a model too big for your memory:

# %%
big = nn.Linear(50_000, 50_000, device="meta")  # 10 GB of float32 weights, 0 bytes here
print(big(torch.empty(8, 50_000, device="meta")).shape)

# %% [markdown]
# ## 7. Counting GPU memory: allocated vs reserved
#
# PyTorch's CUDA *caching allocator* asks the driver for big blocks and keeps
# them after tensors are freed, because asking the driver again is slow.
#
# - `torch.cuda.memory_allocated()`: bytes held by live tensors;
# - `torch.cuda.memory_reserved()`: bytes the allocator holds from the driver
#   (allocated + cached free blocks); `nvidia-smi` shows roughly this plus the
#   CUDA context;
# - `torch.cuda.empty_cache()` returns the cached free blocks to the driver.
#
# Old code calls `torch.cuda.memory_cached()`. That name was replaced by
# `memory_reserved()`; in this version of PyTorch it still exists only as a
# deprecated alias that warns and forwards:

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.memory_cached()
print(f"{caught[0].category.__name__}: {caught[0].message}")

# %% [markdown]
# The experiment: allocate a tensor, free it, empty the cache, and read both
# counters after each step. On a GPU it runs for real (and `make record`
# records it); on the CPU there is no caching allocator, so we watch the
# process's resident memory (RSS) instead: large CPU allocations come straight
# from the operating system and go straight back. Below it, what the caching
# allocator does on a GPU, *predicted* from its documented behaviour (and a
# *recorded* run where a GPU has made one).

# %%
def cuda_memory_steps(device, n_bytes):
    def counters():
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)

    steps = {}
    torch.cuda.synchronize(device)
    steps["start"] = counters()
    x = torch.empty(n_bytes // 4, device=device)
    steps["after allocating"] = counters()
    del x
    steps["after del"] = counters()
    torch.cuda.empty_cache()
    steps["after empty_cache"] = counters()
    return steps


def cpu_memory_steps(n_bytes):
    rss = psutil.Process().memory_info().rss
    steps = {"start": rss}
    x = torch.ones(n_bytes // 4)  # ones, not empty: untouched pages are not resident
    steps["after allocating"] = psutil.Process().memory_info().rss
    del x
    gc.collect()
    steps["after del"] = psutil.Process().memory_info().rss
    return steps


n_bytes = 256 * 2**20
check_fits(n_bytes // 4, torch.float32, device)
if device.type == "cuda":
    steps = cuda_memory_steps(device, n_bytes)
    for step, (alloc, res) in steps.items():
        print(f"{step:>18}: allocated {format_bytes(alloc):>10}, "
              f"reserved {format_bytes(res):>10}")
    reference.record("00.allocator_steps", {k: list(v) for k, v in steps.items()},
                     "bytes (allocated, reserved)", device,
                     note="256 MiB float32 tensor")
else:
    steps = cpu_memory_steps(n_bytes)
    base = steps["start"]
    for step, rss in steps.items():
        print(f"{step:>18}: process RSS {format_bytes(rss)} "
              f"({format_bytes(rss - base)} over start)")
MiB256 = 256 * 2**20
# What PyTorch's caching allocator does with the same steps on a GPU: a freed
# block stays reserved for the next tensor until empty_cache() returns it.
expected = reference.predicted(
    {"start": [0, 0], "after allocating": [MiB256, MiB256],
     "after del": [0, MiB256], "after empty_cache": [0, 0]},
    "bytes (allocated, reserved)", "any CUDA GPU",
    "the caching allocator keeps freed blocks reserved until empty_cache() "
    "(PyTorch docs, CUDA semantics: memory management); a fresh process "
    "starts at zero")
print()
shown = reference.show("00.allocator_steps", figures=[expected])
for fig in shown:
    for step, (alloc, res) in fig.value.items():
        print(f"{step:>18}: allocated {format_bytes(alloc):>10}, "
              f"reserved {format_bytes(res):>10}")

# the same steps drawn: what this device measured, and each GPU figure's two counters
names = list(expected.value)
curves = []
if device.type == "cuda":
    for j, counter in enumerate(("memory_allocated", "memory_reserved")):
        curves.append(reference.measured(
            {"x": list(range(len(steps))), "y": [v[j] / 2**20 for v in steps.values()]},
            "MiB", device))
        curves[-1].device += f": {counter}"
else:
    curves.append(reference.measured(
        {"x": list(range(len(steps))),
         "y": [(v - steps["start"]) / 2**20 for v in steps.values()]}, "MiB", device))
    curves[-1].device += ": process RSS over start"
for fig in shown:
    for j, counter in enumerate(("memory_allocated", "memory_reserved")):
        curve = reference.Figure(
            fig.kind, {"x": list(range(len(fig.value))),
                       "y": [v[j] / 2**20 for v in fig.value.values()]},
            "MiB", f"{fig.device}: {counter}", fig.source)
        curves.append(curve)
ax = plots.plot_figure_curves(curves, ylabel="MiB", logx=False, logy=False,
                              title="Memory after each step, 256 MiB tensor")
ax.set_xticks(range(len(names)), names, fontsize=8)
for line in ax.get_lines():
    line.set_drawstyle("steps-post")  # a counter holds its value until the next step
ax.set_ylim(-10, 330)
ax.legend(fontsize=7, loc="upper right")
plt.show()

# %% [markdown]
# What to look for on a GPU: after `del`, *allocated* drops back but *reserved*
# stays - the memory is cached for the next tensor; only `empty_cache()` hands
# it back. On the CPU the resident memory grows by the tensor's size and falls
# back after `del`.
#
# ### How big is a tensor? Try it
#
# A tensor needs `numel x element_size` bytes (4 for float32, 2 for
# bfloat16, ...). Drag the slider to allocate a square float32 tensor of that
# many MiB on this notebook's device. Sizes that would not fit are refused in
# one line by `check_fits`, before anything is allocated, instead of crashing
# the kernel.

# %%
import ipywidgets as widgets


def allocate(mib):
    side = int((mib * 2**20 / 4) ** 0.5)
    try:
        need = check_fits((side, side), torch.float32, device)
    except MemoryError as e:  # check_fits raises DoesNotFit, a MemoryError
        print(e)
        return
    before = (torch.cuda.memory_allocated(device) if device.type == "cuda"
              else psutil.Process().memory_info().rss)
    x = torch.ones(side, side, device=device)
    after = (torch.cuda.memory_allocated(device) if device.type == "cuda"
             else psutil.Process().memory_info().rss)
    counter = "memory_allocated" if device.type == "cuda" else "process RSS"
    print(f"{side} x {side} float32 = {x.numel():,} elements x {x.element_size()} B "
          f"= {format_bytes(need)}; {counter} grew by {format_bytes(after - before)}")
    if device.type == "cpu" and after - before < need / 2:
        print("  RSS grew by less than the tensor: the C library served it from "
              "memory this process already holds (pages freed earlier stay "
              "resident for reuse). RSS counts the process's pages, not tensors.")
    del x


widgets.interact(allocate, mib=widgets.FloatLogSlider(
    value=64, base=2, min=0, max=17, step=1, description="MiB", readout_format=".0f",
    continuous_update=False));

# %% [markdown]
# On the CPU, small sizes may show RSS growing by less than the tensor, even
# 0 B: the C library's allocator hands out memory the process already holds
# (blocks freed earlier stay resident, ready for reuse), and only large
# blocks come fresh from the operating system. The cell says so when it
# happens. RSS measures the process, not a tensor; on a GPU,
# `memory_allocated` counts the tensor itself.
#
# The top of the slider asks for 128 GiB, more than most machines have. The
# same refusal, called directly:

# %%
allocate(2**17)

# %% [markdown]
# ## 8. A measurement, and a reference from a GPU
#
# Throughout the course a measurement needs the device it is about. This
# chapter's one: the speed of a float32 matrix multiplication, in TFLOP/s
# (an n x n matmul does 2n^3 floating-point operations). `bench` warms up,
# waits for the device, repeats and takes the median (Chapter 2 explains why
# each step matters). Beside it, GPU figures labelled with their kind: two
# GPUs' datasheet peaks (*published*, with the source), and a measurement made
# by this course on a GPU (*recorded*) where one exists. Every GPU figure in
# the course says which kind it is.

# %%
n = 512 if device.type == "cpu" else 8192
A, B = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
t = bench(torch.mm, A, B, label=f"{n}x{n} matmul on {device}")
tflops = 2 * n**3 / t.median / 1e12
print(t)
if device.type == "cuda":
    reference.record("00.matmul_fp32_tflops", tflops, "TFLOP/s", device, note=f"n={n}")
# the published figures are datasheet peaks (dense FP32 on the CUDA cores): a
# large matmul gets most of the way there, a small one much less
matmul_figures = reference.show(
    "00.matmul_fp32_tflops", local=tflops, unit="TFLOP/s", local_device=device,
    figures=[reference.published("h100_sxm.fp32_tflops"),
             reference.published("t4.fp32_tflops")])
ax = plots.plot_figure_bars(matmul_figures, ylabel="TFLOP/s (float32)",
                            title=f"{n} x {n} float32 matmul here, beside GPU peaks")
ax.set_ylim(top=ax.get_ylim()[1] * 30)  # room for the legend above the bars
plt.show()

# %% [markdown]
# ## 9. Leftovers from old PyTorch
#
# Old tutorials carry habits from PyTorch 0.3 and earlier. What is true now:
#
# - `Variable` is gone in practice: tensors carry autograd themselves.
#   Tensors you create have `requires_grad=False` because they are data;
#   `nn.Parameter` sets it to `True` because parameters are what we optimise.
# - `volatile=True` was replaced by `with torch.no_grad():`.
# - A loss, and a full reduction like `x.sum()`, is a **0-dimensional** tensor
#   (`shape == torch.Size([])`); `.item()` turns it into a Python number.
# - `x.detach()` and `x.data` both share `x`'s memory without the graph, but
#   only `detach()` lets autograd notice an in-place change that would make a
#   gradient wrong. Prefer `detach()`.
# - `torch.set_grad_enabled(mode)` is the switchable form of `no_grad`: called
#   as a function it turns gradient recording on or off for the rest of the
#   thread; as `with torch.set_grad_enabled(is_training):` it lets one loop
#   serve both training and evaluation.
# - `tensor.type()` returns the legacy type name as a string
#   (`'torch.FloatTensor'`, and `'torch.cuda.FloatTensor'` on a GPU), while
#   Python's `type(tensor)` only says `torch.Tensor`. Today `tensor.dtype`
#   and `tensor.device` say the same more plainly; `tensor.type(torch.float64)`
#   converts, like `.to(torch.float64)`.
# - `nn.Softmax()` without `dim`, as many old models write it, is deprecated
#   (see the third cell below).

# %%
w = nn.Parameter(torch.ones(3))
print("tensor:", torch.ones(3).requires_grad, "| parameter:", w.requires_grad)
with torch.no_grad():
    print("under no_grad:", (w * 2).requires_grad)
s = (w * 2).sum()
print("a sum is 0-dimensional:", s.shape, "->", s.item())

y = w.exp()
y.detach().zero_()  # changes y's memory; autograd notices
try:
    y.sum().backward()
except RuntimeError as e:
    # the message's first clause; the tensor's type in it holds dots of its own
    print("detach(): the change is caught ->", str(e).split(":")[0])
y = w.exp()
y.data.zero_()  # same change through .data; autograd does not notice
y.sum().backward()
print(".data: silently wrong gradient", w.grad, "(exp(1) = 2.718 expected)")

# %%
for is_training in (True, False):
    with torch.set_grad_enabled(is_training):
        print(f"set_grad_enabled({is_training}): (w * 2).requires_grad =",
              (w * 2).requires_grad)
torch.set_grad_enabled(False)  # as a call: off until switched back on
print("after torch.set_grad_enabled(False):", torch.is_grad_enabled())
torch.set_grad_enabled(True)

for t in (torch.ones(2), torch.ones(2, dtype=torch.float16),
          torch.ones(2, dtype=torch.int64)):
    print(f"t.type() = {t.type():20} type(t) = {type(t).__name__:7} "
          f"t.dtype = {t.dtype}, t.device = {t.device}")
print("t.type(torch.float64) converts:", torch.ones(2).type(torch.float64).dtype)

# %% [markdown]
# A softmax must be told which dimension holds the classes. Without `dim`,
# `nn.Softmax()` guesses from the input's number of dimensions (dimension 0 for
# 1-D and 3-D inputs, 1 otherwise) and warns each time it runs. On the usual
# 2-D (batch, classes) input the guess happens to be right; on a 3-D
# (batch, positions, classes) input it normalises across the batch, a silent
# bug. The fix is to say it: `nn.Softmax(dim=1)` for (batch, classes), or
# `dim=-1` for "the last dimension", whatever comes before it.

# %%
logits = torch.randn(4, 3)  # (batch, classes)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    nn.Softmax()(logits)
print(f"{caught[0].category.__name__}: {caught[0].message}")
fixed = nn.Softmax(dim=1)(logits)
print("nn.Softmax(dim=1): each row sums to 1:",
      torch.allclose(fixed.sum(dim=1), torch.ones(4)))

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    guessed = nn.Softmax()(torch.randn(4, 5, 3))  # (batch, positions, classes)
print("3-D input, no dim: sums to 1 across the batch (dim 0):",
      torch.allclose(guessed.sum(dim=0), torch.ones(5, 3)))

# %% [markdown]
# ## Summary
#
# - Parallelism answers three needs: more compute, more memory, and scale
#   beyond one machine; published large runs keep about half of each GPU's
#   peak busy.
# - Concurrent = in progress together; parallel = executing at the same
#   instant; distributed = separate memories that exchange messages.
# - `torch.cuda` probes the GPUs, `course_utils.devices` the CPU; pycuda adds
#   the driver's attribute table.
# - A CPU core with SMT shows up as two logical cores that share one core's
#   execution units; count physical cores for number-crunching.
# - Inside a server GPUs talk over NVLink, across servers over a network
#   several times slower; that gap decides where each kind of parallelism goes.
# - `torch.device("cuda")` names the *current* GPU; `set_device` and
#   `with torch.cuda.device(i)` change it, for the calling thread only. `torch.cuda.device` is a context
#   manager, not a device: never pass it to `.to()`.
# - `tensor.to()` returns a new tensor; `module.to()` moves the module in place
#   and keeps its Parameter objects. Still, move the model, then create the
#   optimizer. A module has no `.device`: ask its parameters.
# - `.cuda()`, `.cuda(i)` and `.cpu()` are shorthands for `.to()`, with the
#   same tensor/module rules; `.cuda()` ties code to a GPU, `.to(device)` does
#   not.
# - Pick the device once and write device-agnostic code (make the model,
#   then move it: `MyModule().to(device)`); inside `forward()`, make new
#   tensors with `zeros_like`, `randn_like`, `new_zeros`, `new_full`, and keep
#   fixed tensors in buffers, which `module.to()` moves. `with
#   torch.device(d):` sets the default device for a block.
# - Operators refuse operands on different devices; the `meta` device lets you
#   check placement and shapes with no memory at all.
# - `memory_allocated` counts live tensors, `memory_reserved` what the caching
#   allocator holds; `memory_cached` is the old, deprecated name of the latter.
#
# ## Exercises
#
# ### Exercise 0.1: move a whole batch
#
# A data loader rarely yields one tensor: a batch is a dict of images and
# labels, a tuple of inputs, a namedtuple, with strings and numbers beside the
# tensors. Write `move_batch(batch, device)`, the helper every training loop
# needs: it returns the same structure - dicts with the same keys, lists,
# tuples and namedtuples of the same types, nested at any depth - with every
# tensor moved to `device` (same dtype, same values), and everything else
# (strings, numbers, `None`) as it was. The caller's batch must not change.
# Given a module, it moves it and returns it, as `module.to` does. It is
# checked on the `meta` device - so a tensor left behind is caught on any
# machine - and on the best device this machine has.

# %% tags=["exercise"] exercise="0.1"
def move_batch(batch, device):
    ### BEGIN SOLUTION
    if isinstance(batch, (torch.Tensor, nn.Module)):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: move_batch(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(move_batch(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(value, device) for value in batch)
    return batch  # a string, a number, None: nothing to move
    ### END SOLUTION

# %% tags=["check"] exercise="0.1"
from course_utils.checks.ch00 import check_memory_held, check_move_batch

check_move_batch(move_batch)

# %% [markdown]
# ### Exercise 0.2: how much memory do these tensors hold?
#
# Write `memory_held(tensors)`: the number of bytes of memory kept alive by the
# tensors in the list. Careful: a view (`x.view`, a slice `x[::2]` or
# `x[10:]`, `x.T`) shares its base's storage, also when it starts at an
# offset; `expand` copies nothing; two different tensors are two storages,
# even of equal size; and the element size depends on the dtype.
# `t.untyped_storage()` gives a tensor's storage, with `.nbytes()` and
# `.data_ptr()` (the address of the storage, where `t.data_ptr()` is the
# address of the tensor's first element).

# %% tags=["exercise"] exercise="0.2"
def memory_held(tensors):
    ### BEGIN SOLUTION
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())
    ### END SOLUTION

# %% tags=["check"] exercise="0.2"
check_memory_held(memory_held)

# %% [markdown]
# ### Exercise 0.3: a module that follows `model.to()`
#
# Write a module class `AddRamp`: `AddRamp(n)` adds to its input `x`, of shape
# `(..., n)`, the fixed ramp `r[j] = j / n` (j = 0, ..., n - 1) along the last
# dimension, and returns the sum as a new tensor. After `model.to(device)` or
# `model.to(dtype)` it must work on inputs of that device and dtype, and give
# an output on `x`'s device with `x`'s dtype. The ramp is fixed: nothing an
# optimizer would train. It is checked on the `meta` device, in float16 and
# float64, and on the best device this machine has.

# %% tags=["exercise"] exercise="0.3"
class AddRamp(nn.Module):
    def __init__(self, n):
        super().__init__()
        ### BEGIN SOLUTION
        self.register_buffer("ramp", torch.arange(n) / n)
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        return x + self.ramp
        ### END SOLUTION

# %% tags=["check"] exercise="0.3"
from course_utils.checks.ch00 import check_add_ramp

check_add_ramp(AddRamp)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | parallel / concurrent / distributed | 并行 / 并发 / 分布式 |
# | device | 设备 |
# | host (CPU) memory / device (GPU) memory | 主机内存 / 设备内存（显存） |
# | device-agnostic code | 设备无关的代码 |
# | caching allocator | 缓存分配器 |
# | allocated / reserved memory | 已分配 / 已保留的显存 |
# | view (of a tensor) | 视图 |
# | storage | 存储 |
# | meta device | meta 设备（只记录形状、不存数据） |
# | physical core / logical core | 物理核心 / 逻辑核心 |
# | SMT (simultaneous multithreading) / hyper-threading | 同时多线程 / 超线程 |
# | current device | 当前设备 |
# | context manager | 上下文管理器 |
# | parameter / buffer | 参数 / 缓冲区 |
# | optimizer state | 优化器状态 |
# | FLOP (floating-point operations) | 浮点运算（次数） |
# | interconnect (NVLink, InfiniBand) | 互连 |
