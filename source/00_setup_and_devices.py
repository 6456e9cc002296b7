# %% [markdown]
# # Chapter 0 - Setup and devices
#
# **What you will learn**
#
# - why deep learning needs parallelism (compute, memory, scale), and how
#   *parallel*, *concurrent* and *distributed* differ;
# - how to ask PyTorch (and pycuda) what hardware this machine has;
# - where a tensor lives (`tensor.device`), how `.to()` moves tensors and
#   modules - differently - and how to write code that runs on any device;
# - what happens when an operation mixes devices;
# - how GPU memory is counted: allocated vs reserved, and the old name
#   `memory_cached`.
#
# **Hardware.** Every cell runs on a laptop CPU. With a GPU the probes describe
# it and the memory cells measure it; without one they say so, use the CPU (and
# PyTorch's `meta` device) for the same lessons, and show results recorded on a
# real GPU where one has been recorded.

# %%
import gc
import warnings

import psutil
import torch
from torch import nn

from course_utils import (
    banner,
    bench,
    check_fits,
    devices,
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
# - **Compute.** Training a large model takes on the order of 10^23 - 10^24
#   floating-point operations. No single chip does that in a useful time.
# - **Memory.** A model's weights, gradients and optimizer state outgrow one
#   device's memory long before they outgrow a cluster's.
# - **Scale.** Both problems are solved by many devices working together, which
#   brings the subject of this course: splitting the work and moving data
#   between devices without wasting them.
#
# The paper on Megatron-LM (Narayanan et al., SC'21) reports training a GPT
# model of about one trillion parameters on **3072 NVIDIA A100 80 GB GPUs** at an
# aggregate **502 PFLOP/s**. The published figures are enough to see both
# pressures; the next cell does the arithmetic.

# %%
gpus, aggregate = 3072, 502e15  # published: GPUs, achieved FLOP/s
a100_peak = 312e12  # A100 dense fp16/bf16 tensor-core peak, FLOP/s (datasheet)
per_gpu = aggregate / gpus
print(f"per GPU: {per_gpu / 1e12:.0f} TFLOP/s = {per_gpu / a100_peak:.0%} of the A100 peak")

params = 1e12
bytes_per_param = 2 + 2 + 12  # fp16 weights, fp16 grads, fp32 master weights + Adam
state = params * bytes_per_param
print(f"weights + grads + Adam state: {state / 1e12:.0f} TB; "
      f"at least {state / 80e9:.0f} GPUs of 80 GB just to hold them")

# %% [markdown]
# Each GPU kept about half of its peak busy, and merely *storing* the training
# state needs a couple of hundred GPUs - before a single activation is kept for
# the backward pass. The rest of the course shows the techniques that make this
# possible, at a size that fits on your machine.
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
        print(f"  {key:>24}: {format_bytes(value) if 'memory' in key else value}")
else:
    print("No CUDA GPU: current_device, get_device_name and get_device_properties "
          "would raise here, so they are only called when a GPU exists.")

# %% [markdown]
# The CPU matters too: it feeds the GPU, runs the data loading, and is the
# device for everything in this course when there is no GPU. `torch` uses a
# pool of threads for one operation (intra-op) and another for independent
# operations (inter-op).

# %%
for key, value in devices.cpu_facts().items():
    print(f"{key:>22}: {format_bytes(value) if key.startswith('memory') else value}")

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
# - it divides by 1e9 and calls the result GB; memory sizes are usually read in
#   GiB (2^30), and the two differ by 7%.
#
# `course_utils.devices.pycuda_facts` does the same job with these fixed: it
# makes a context on each GPU in turn before asking for its memory.

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
            print(f"  {name}: {d['attributes'].get(name)}")

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
# ## 5. `.to()` moves tensors and modules differently
#
# `tensor.to(...)` returns a **new** tensor and leaves the original where it was
# (unless nothing needs to change: then it returns the tensor itself).
# `module.to(...)` changes the module **in place** - its parameters are
# replaced - and returns the same module. `.to(dtype)` follows the same rules as
# `.to(device)`, so the cell shows both on any machine.

# %%
t = torch.ones(3)
t64 = t.to(torch.float64)
print("tensor: new object?", t64 is not t, "| original still", t.dtype)
print("tensor: .to() with nothing to change returns itself:", t.to(t.device) is t)

m = nn.Linear(3, 2)
m2 = m.to(torch.float64)
print("module: same object?", m2 is m, "| its weight is now", m.weight.dtype)

t_moved = t.to(device)
print("t stays on", t.device, "; the copy is on", t_moved.device)

# %% [markdown]
# So `batch.to(device)` on a line of its own does nothing useful: assign the
# result. For modules `model.to(device)` is enough, though
# `model = model.to(device)` does no harm.
#
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
big = nn.Linear(50_000, 50_000, device="meta")  # 10 GB of weights in float32, 0 bytes here
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
# counters after each step. On a GPU it runs for real and is recorded as a
# reference; on the CPU there is no caching allocator, so we watch the
# process's resident memory (RSS) instead: large CPU allocations come straight
# from the operating system and go straight back.

# %%
def cuda_memory_steps(device, n_bytes):
    steps = {}
    torch.cuda.synchronize(device)
    steps["start"] = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    x = torch.empty(n_bytes // 4, device=device)
    steps["after allocating"] = (torch.cuda.memory_allocated(device),
                                 torch.cuda.memory_reserved(device))
    del x
    steps["after del"] = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    steps["after empty_cache"] = (torch.cuda.memory_allocated(device),
                                  torch.cuda.memory_reserved(device))
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
        print(f"{step:>18}: allocated {format_bytes(alloc):>10}, reserved {format_bytes(res):>10}")
    reference.record("00.allocator_steps", {k: list(v) for k, v in steps.items()},
                     "bytes (allocated, reserved)", device, note="256 MiB float32 tensor")
else:
    steps = cpu_memory_steps(n_bytes)
    base = steps["start"]
    for step, rss in steps.items():
        print(f"{step:>18}: process RSS {format_bytes(rss)} ({format_bytes(rss - base)} over start)")
for entry in reference.lookup("00.allocator_steps"):
    print(f"\nreference ({reference.label(entry)}):")
    for step, (alloc, res) in entry["value"].items():
        print(f"{step:>18}: allocated {format_bytes(alloc):>10}, reserved {format_bytes(res):>10}")
if not reference.lookup("00.allocator_steps"):
    print("\n00.allocator_steps: no reference recorded yet on a GPU")

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
    del x


widgets.interact(allocate, mib=widgets.FloatLogSlider(
    value=64, base=2, min=0, max=17, step=1, description="MiB"));

# %% [markdown]
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
# each step matters). The GPU figure beside it was recorded on a real GPU, if
# one has been recorded.

# %%
n = 512 if device.type == "cpu" else 8192
A, B = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
t = bench(torch.mm, A, B, label=f"{n}x{n} matmul on {device}")
tflops = 2 * n**3 / t.median / 1e12
print(t)
if device.type == "cuda":
    reference.record("00.matmul_fp32_tflops", tflops, "TFLOP/s", device, note=f"n={n}")
reference.show("00.matmul_fp32_tflops", local=tflops, unit="TFLOP/s",
               local_device=f"{device}, n={n}");

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
    print("detach(): the change is caught ->", str(e).split(".")[0])
y = w.exp()
y.data.zero_()  # same change through .data; autograd does not notice
y.sum().backward()
print(".data: silently wrong gradient", w.grad, "(exp(1) = 2.718 expected)")

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
# - `tensor.to()` returns a new tensor; `module.to()` moves the module in place.
#   Pick the device once and write device-agnostic code.
# - Operators refuse operands on different devices; the `meta` device lets you
#   check placement and shapes with no memory at all.
# - `memory_allocated` counts live tensors, `memory_reserved` what the caching
#   allocator holds; `memory_cached` is the old, deprecated name of the latter.
#
# ## Exercises
#
# ### Exercise 0.1: run anywhere
#
# Write `run_on(model, batch, device)`: move the model and the batch to
# `device`, run the model on the batch, and return the output (left on
# `device`). It is checked on the `meta` device - so a batch left behind is
# caught on any machine - and on the best device this machine has.

# %% tags=["exercise"] exercise="0.1"
def run_on(model, batch, device):
    ### BEGIN SOLUTION
    model.to(device)
    return model(batch.to(device))
    ### END SOLUTION

# %% tags=["check"] exercise="0.1"
from course_utils.checks.ch00 import check_memory_held, check_run_on

check_run_on(run_on)

# %% [markdown]
# ### Exercise 0.2: how much memory do these tensors hold?
#
# Write `memory_held(tensors)`: the number of bytes of memory kept alive by the
# tensors in the list. Careful: a view (`x.view`, a slice `x[::2]`, `x.T`)
# shares its base's storage, `expand` copies nothing, and the element size
# depends on the dtype. `t.untyped_storage()` gives a tensor's storage, with
# `.nbytes()` and `.data_ptr()`.

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
