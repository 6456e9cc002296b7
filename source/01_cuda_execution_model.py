# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 1: The CUDA execution model
#
# PyTorch hides the GPU behind `tensor.to("cuda")`, but every operator it runs
# there is a *kernel*: a function that thousands of GPU threads execute at once.
# How those threads are organised, and how they reach memory, decides how fast
# your code runs. In this chapter you write kernels yourself, in Python, with
# numba's `@cuda.jit`.
#
# **What you will learn**
#
# - Why a GPU spends its chip so differently from a CPU, and how the host (CPU)
#   and the device (GPU) share work: separate allocations, copies in and out,
#   kernel launches over a grid of blocks of threads.
# - How to give each thread its own element: vector add and matrix multiply,
#   with the bounds guard that keeps threads inside the array.
# - Why warps of 32 threads (the SIMT model) decide memory efficiency
#   (coalescing) and the cost of branches (divergence), counted with a small
#   memory-access tracer, and how many warps an SM can keep (occupancy).
# - The GPU memory hierarchy, how shared memory cuts the traffic of matmul, and
#   how the threads of a block cooperate through it (a block sum).
# - Why a parallel program's speed-up is capped (Amdahl's law), measured here.
#
# **Hardware.** The kernels are written once. With a GPU they run on it for
# real. Without one, numba's *CUDA simulator* runs the very same kernel source
# on the CPU, one Python thread per GPU thread: it is slow, so sizes are tiny,
# but it checks indices and runs `syncthreads` like the hardware. Timings that
# need a GPU are then shown as reference results recorded on a real GPU.

# %% [markdown]
# `course_utils` must be imported **before** numba: it tells numba whether to use
# the GPU or the simulator, and numba reads that choice once, when it is first
# imported. The banner says which one this notebook uses.

# %%
import functools
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from course_utils import banner, bench, for_device, plots, predict, reference, try_gpu
from course_utils.compare import compare
from course_utils.devices import (
    FP32_LANES_PER_SM,
    DoesNotFit,
    check_fits,
    cpu_facts,
    kernel_target,
    usable_physical_cores,
)
from course_utils.warps import count_divergent_warps, trace_sectors

banner()
import warnings

from numba import cuda, float32, njit  # after course_utils: the simulator is chosen
from numba.core.errors import NumbaPerformanceWarning

# On a GPU numba warns that our tiny teaching grids leave it mostly idle, and that
# NumPy arguments are copied at every launch: both true, and intended here. The
# message filters also catch the same warnings from the separate numba-cuda package.
warnings.simplefilter("ignore", NumbaPerformanceWarning)
warnings.filterwarnings("ignore", message="Grid size .* low occupancy")
warnings.filterwarnings("ignore", message="Host array used in CUDA kernel")

device = try_gpu()
on_gpu = device.type == "cuda"  # torch's operators run on a GPU
# numba's kernels run on the GPU only with its CUDA target installed; otherwise on
# the simulator, even beside a GPU (the banner says why): sizes and timings follow it
kernels_on_gpu = kernel_target() == "GPU"
torch.manual_seed(0)
rng = np.random.default_rng(0)
print("numba CUDA kernels run on:", kernel_target())

# %% [markdown]
# ## 1. Host and device
#
# ### Two ways to spend a chip
#
# A CPU and a GPU are built for different jobs, and they spend their transistors
# accordingly. A CPU core is designed to finish *one* stream of instructions as
# soon as possible: large caches keep its data close, out-of-order execution
# runs later instructions while an earlier one waits for memory, and branch
# prediction guesses where a branch will go before it is decided. That machinery
# takes much of the area of each core, so a CPU has few of them. A GPU is
# designed to finish as *many* independent pieces of work per second as it can.
# Its cores, the **streaming multiprocessors (SMs)**, have small caches for the
# number of threads they serve, and no out-of-order execution or branch
# prediction. The area goes into many simple arithmetic lanes, and into a
# register file large enough to keep many warps resident at once, so that
# whenever one warp waits for memory another is ready to run (section 8
# measures the effect).
#
# Two names need care. What NVIDIA calls a **CUDA core** is one 32-bit
# floating-point lane of an SM. It fetches and schedules no instructions of its
# own, so it is not a core in the CPU sense: the counterpart of a CPU core is
# the SM, and the counterpart of a CUDA core is one lane of a CPU's SIMD unit
# (section 9). And SM stands for *streaming* multiprocessor; the seed's
# "Stream Multiprocessor" is a slip of the name.
#
# Counted in lanes, then: this machine's usable physical cores times the
# float32 lanes of its widest SIMD instruction, against the GPU's SMs times the
# FP32 lanes of one SM. (Physical cores, because two hardware threads that
# share a core with SMT also share its SIMD units: Chapter 0.) The lanes per SM
# depend on the architecture; `course_utils.devices.FP32_LANES_PER_SM` copies
# them from the CUDA C++ Programming Guide (throughput of 32-bit floating-point
# add, multiply and multiply-add, per clock and per SM).

# %%
cpu_info = cpu_facts()
cpu_cores = usable_physical_cores()
cpu_lanes_per_core = cpu_info["simd_bits"] // 32
cpu_lanes = cpu_cores * cpu_lanes_per_core
print(f"CPU, {cpu_info['model']}: {cpu_cores} usable physical cores x "
      f"{cpu_lanes_per_core} float32 lanes ({cpu_info['simd']}) = {cpu_lanes} lanes")
if on_gpu:
    props = torch.cuda.get_device_properties(device)
    gpu_name, gpu_sms = props.name, props.multi_processor_count
    lanes_per_sm = FP32_LANES_PER_SM.get((props.major, props.minor))
    resident = gpu_sms * props.max_threads_per_multi_processor
    gpu_source = f"probed, compute capability {props.major}.{props.minor}"
else:
    gpu_name, gpu_sms, lanes_per_sm = "NVIDIA H100 SXM5", 132, 128
    resident = 132 * 2048  # 2048 resident threads per SM
    gpu_source = "published figures, not measured here"
if lanes_per_sm:
    gpu_lanes = gpu_sms * lanes_per_sm
    print(f"GPU, {gpu_name} ({gpu_source}): {gpu_sms} SMs x {lanes_per_sm} FP32 "
          f"lanes = {gpu_lanes:,} lanes ('CUDA cores'), "
          f"{gpu_lanes / cpu_lanes:.0f}x this CPU's")
else:
    print(f"GPU, {gpu_name}: {gpu_sms} SMs; compute capability {props.major}."
          f"{props.minor} is not in the table, see the programming guide")
print(f"threads that can be resident at once: {cpu_info['usable_cores']} on the "
      f"CPU (one per usable logical core), {resident:,} on the GPU")

# %% [markdown]
# Lanes are not the whole comparison: a CPU lane runs at a higher clock, and a
# CPU core can often start more than one SIMD instruction per cycle. What
# the count does show is the design: the GPU has far more lanes, and to keep
# them busy it keeps vastly more threads resident, so it needs that much
# independent work. A problem of a few thousand elements leaves most of a GPU
# idle; Chapter 2 measures where the CPU wins.
#
# ### From graphics shaders to CUDA, and the software stack today
#
# Before CUDA, computing on a GPU (GPGPU, general-purpose computing on GPUs)
# went through the graphics pipeline. The data were packed into textures, the
# computation was written as a fragment shader in a shading language such as
# GLSL (OpenGL's), and the results were read back as the pixels of a rendered
# image. It worked, but every problem had to be disguised as drawing, with the
# data types and memory access that drawing allows. NVIDIA's **CUDA** (first
# released in 2007) exposed the same hardware as a general parallel processor
# programmed in an extension of C. **OpenCL** (specification 1.0 in 2008), a
# vendor-neutral standard, and the **compute shaders** of Direct3D 11 (2009)
# and OpenGL 4.3 (2012) followed with the same model: kernels over a grid of
# threads.
#
# The stack today: kernels are written in CUDA C/C++ (NVIDIA also supports
# Fortran) and compiled by `nvcc`; from Python, just-in-time compilers turn
# Python functions into GPU code at run time - numba's `@cuda.jit`, used in this
# chapter, and Triton, which programs whole blocks rather than single threads
# and is the language `torch.compile` writes its GPU kernels in. PyTorch's own
# operators are C++/CUDA kernels in its ATen library. The elementwise ones live
# in files such as `aten/src/ATen/native/cuda/AbsKernel.cu`: a small function
# says what to do with one element, and a shared loop template launches a grid
# over all elements (each thread taking a few). Matrix multiplies and
# convolutions are handed to NVIDIA's libraries, cuBLAS and cuDNN.
#
# ### Kernels, and copies in and out
#
# A CUDA program has two sides. The **host** is the CPU with its RAM; it runs
# your Python. The **device** is the GPU with its own memory (HBM on data-centre
# GPUs). By default a kernel reads and writes device memory only. There are two
# exceptions: a kernel may use *mapped pinned* host memory directly across the
# bus ("zero-copy"), and *managed* memory moves its pages to the GPU when a
# kernel touches them (both are explained below). Neither makes the bus
# faster: zero-copy memory crosses it on every access, so data read more than
# once is much slower there than in HBM, and managed memory pays a page fault
# and a migration whenever a page is first touched on the other side. The usual
# pattern is therefore:
#
# 1. allocate on the device and **copy the inputs in** (host to device),
# 2. **launch** the kernel over many threads,
# 3. **copy the results out** (device to host).
#
# A launch names its shape in square brackets: `kernel[blocks, threads_per_block](args)`.
# Each thread asks `cuda.grid(1)` for its global index,
# `blockIdx.x * blockDim.x + threadIdx.x`, and does the work for that one index.

# %%
@cuda.jit
def scale(x, factor, out):
    i = cuda.grid(1)  # blockIdx.x * blockDim.x + threadIdx.x
    if i < x.size:
        out[i] = x[i] * factor


x_host = np.arange(8, dtype=np.float32)
x_dev = cuda.to_device(x_host)                  # 1. copy in
out_dev = cuda.device_array_like(x_dev)         #    room for the result
scale[2, 4](x_dev, np.float32(10), out_dev)     # 2. launch: 2 blocks x 4 threads
print(out_dev.copy_to_host())                   # 3. copy out
print("host array:", type(x_host).__name__, "| device array:", type(x_dev).__name__)

# %% [markdown]
# With a GPU the device array is a `DeviceNDArray` living in GPU memory; on the
# simulator it is a stand-in object wrapping a NumPy array, so the same code
# runs. Passing a NumPy array straight to a kernel also works, but numba then
# copies it in and out around *every* launch: explicit copies let you keep data
# on the device between kernels, which is what PyTorch does with CUDA tensors.
#
# ### One address space, separate allocations
#
# One seed says that recent NVIDIA GPUs have virtual memory like a CPU's, so
# that data moved from host memory into GPU memory keeps its address, pages
# migrate between the two on page faults, and processes share data without
# copies. Each part is true only in a narrower sense:
#
# - **Unified virtual addressing** (UVA, since CUDA 4.0 in 2011, for 64-bit
#   programs): host memory and the memory of every GPU lie in *one* virtual
#   address space, so an address alone says which device owns it. It is about
#   naming, not moving: no data move because of it.
# - **Managed (unified) memory** (`cudaMallocManaged`, since CUDA 6.0 in 2014):
#   one allocation that host and device both use at the same address; the
#   driver migrates its pages to whichever side touches them, on demand through
#   page faults on GPUs of compute capability 6.0 (Pascal) or later. This holds
#   only for memory allocated as managed.
# - **PyTorch tensors are not managed memory.** By default PyTorch's CUDA
#   allocator hands out ordinary device memory, so `.to("cuda")` *copies* the
#   data into a new allocation at a new address, and the host tensor stays
#   where it was. The same copy semantics hold on the CPU whenever `.to()` has
#   something to convert, such as the dtype, and `.clone()` always copies.
# - **CUDA IPC** (inter-process communication): another process can map an
#   existing GPU allocation into its own address space and use it without a
#   copy. That is how `torch.multiprocessing` hands a CUDA tensor to another
#   process.
#
# `data_ptr()` gives the address of a tensor's first element, so it shows which
# operations made a new allocation.

# %%
x_cpu = torch.arange(4, dtype=torch.float32)
versions = {
    "x_cpu": x_cpu,
    "x_cpu.to(torch.float32)": x_cpu.to(torch.float32),  # nothing to convert
    "x_cpu.to(torch.float64)": x_cpu.to(torch.float64),  # a new dtype
    "x_cpu.clone()": x_cpu.clone(),
}
if on_gpu:
    versions['x_cpu.to("cuda")'] = x_cpu.to(device)
for label, t in versions.items():
    where = "same memory" if t.data_ptr() == x_cpu.data_ptr() else "new allocation"
    print(f"{label:24} on {str(t.device):6} data_ptr 0x{t.data_ptr():x}  {where}")

# %% [markdown]
# Every conversion and every copy lands at a new address; only `.to()` with
# nothing to do returns the very same tensor. With a GPU, the CUDA copy gets an
# address in the same (unified) address space as the host's, but a different
# one: the data were copied, not re-mapped.
#
# ## 2. Grids of blocks of threads, and the 1024 limit
#
# Threads are grouped in **blocks**, and blocks in a **grid**. Both can have up
# to three dimensions (x, y, z), which is convenient for images and matrices.
# The threads of one block run on the same streaming multiprocessor (SM), can
# share fast on-chip memory and wait for each other (`cuda.syncthreads()`);
# different blocks cannot, and may run in any order. A block holds **at most
# 1024 threads** in total, `x * y * z`, on every GPU since compute capability 2.0.
# The grid, in contrast, can have up to 2^31 - 1 blocks in x.
#
# What happens if we ask for 2048 threads in one block? A real GPU refuses the
# launch: the driver returns `CUDA_ERROR_INVALID_VALUE` and numba raises it as a
# `CudaAPIError`. The simulator does **not** check this limit (it simply starts
# 2048 Python threads), so on the simulator the cell below first runs the
# launch to show that, then applies the hardware's rule itself.

# %%
MAX_THREADS_PER_BLOCK = (cuda.get_current_device().MAX_THREADS_PER_BLOCK
                         if kernel_target() == "GPU" else 1024)


@cuda.jit
def fill_thread_ids(out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = i


def launch_fill(threads_per_block):
    out = cuda.to_device(np.zeros(threads_per_block, dtype=np.int32))
    fill_thread_ids[1, threads_per_block](out)
    cuda.synchronize()
    if kernel_target() == "simulator":
        print(f"the simulator ran {threads_per_block} threads in one block without"
              " complaint - it does not enforce the hardware limit")
        if threads_per_block > MAX_THREADS_PER_BLOCK:
            raise ValueError(f"{threads_per_block} threads per block exceeds the "
                             f"limit of {MAX_THREADS_PER_BLOCK}: a GPU driver answers "
                             "CUDA_ERROR_INVALID_VALUE")
    return out.copy_to_host()


try:
    launch_fill(2048)
except Exception as e:  # CudaAPIError on a GPU, our ValueError on the simulator
    print(f"launch refused: {type(e).__name__}: {e}")
    print("fix: at most 1024 threads per block, and more blocks instead")

# %% [markdown]
# The fix is always to use **more blocks**, not bigger ones. The cell below
# checks the rule for a few block shapes: it is the product of the three
# dimensions that counts.

# %%
for block in [(1024,), (32, 32), (16, 16, 4), (32, 32, 2), (2048,)]:
    n = int(np.prod(block))
    verdict = "ok" if n <= MAX_THREADS_PER_BLOCK else "too many: launch fails"
    print(f"block {str(block):14} = {n:5} threads  {verdict}")

# %% [markdown]
# ## 3. The grid, drawn
#
# To see the numbering, a kernel on a 2-D grid writes, for every thread, its
# `blockIdx`, its `threadIdx` and the global (x, y) position it computes. The
# picture is drawn from what the kernel wrote, not by hand.

# %%
@cuda.jit
def record_ids(block_id, thread_id, global_x, global_y):
    x, y = cuda.grid(2)  # x = blockIdx.x * blockDim.x + threadIdx.x, same for y
    if y < block_id.shape[0] and x < block_id.shape[1]:
        block_id[y, x] = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
        thread_id[y, x] = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        global_x[y, x] = x
        global_y[y, x] = y


grid_shape, block_shape = (3, 2), (4, 3)        # (x, y): 3 x 2 blocks of 4 x 3 threads
H, W = grid_shape[1] * block_shape[1], grid_shape[0] * block_shape[0]
ids = [np.zeros((H, W), dtype=np.int32) for _ in range(4)]
record_ids[grid_shape, block_shape](*ids)
block_id, thread_id, gx, gy = ids

fig, ax = plt.subplots(figsize=(8, 4.2))
ax.imshow(block_id, cmap="Pastel1", vmin=0, vmax=8)
for yy in range(H):
    for xx in range(W):
        ax.text(xx, yy, f"b{block_id[yy, xx]} t{thread_id[yy, xx]}\n"
                f"({gx[yy, xx]},{gy[yy, xx]})", ha="center", va="center", fontsize=7)
for k in range(1, grid_shape[0]):
    ax.axvline(k * block_shape[0] - 0.5, color="black", lw=2)
for k in range(1, grid_shape[1]):
    ax.axhline(k * block_shape[1] - 0.5, color="black", lw=2)
ax.set_xticks(range(W))
ax.set_yticks(range(H))
ax.set_xlabel("global x = blockIdx.x * blockDim.x + threadIdx.x (column)")
ax.set_ylabel("global y (row)")
ax.set_title("A 3 x 2 grid of 4 x 3 blocks: block b, thread t, global (x, y)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Each coloured rectangle is one block. Inside it, threads are numbered with x
# moving fastest: thread t = `threadIdx.y * blockDim.x + threadIdx.x`. This
# linear order matters later: the hardware cuts each block into **warps** of 32
# consecutive threads in exactly this order.
#
# ## 4. Vector add, and why the bounds guard is there
#
# One thread per output element. The number of elements is rarely a multiple
# of the block size, so the launch rounds the number of blocks **up**, and the
# last block has threads with no element. The `if i < c.size` guard sends them
# home.

# %%
@cuda.jit
def vector_add(a, b, c):
    i = cuda.grid(1)
    if i < c.size:  # the bounds guard
        c[i] = a[i] + b[i]


n = 1000
threads = 256
blocks = (n + threads - 1) // threads  # ceiling division: 4 blocks, 1024 threads
a = rng.standard_normal(n).astype(np.float32)
b = rng.standard_normal(n).astype(np.float32)
c_dev = cuda.device_array(n, dtype=np.float32)
vector_add[blocks, threads](cuda.to_device(a), cuda.to_device(b), c_dev)
print(f"{blocks} blocks x {threads} threads = {blocks * threads} threads for {n} elements")
print("matches numpy:", np.allclose(c_dev.copy_to_host(), a + b))

# %% [markdown]
# Without the guard, the 24 spare threads write past the end of `c`. The
# simulator checks every index, so it stops with an `IndexError` naming the
# offending thread and block. **A real GPU does not check**: the stray writes
# land in whatever memory follows the array, silently corrupting other data or,
# if they leave the allocation, crashing later with an "illegal memory access".
# (NVIDIA's `compute-sanitizer` finds such bugs.) That is why this cell only
# runs the unguarded kernel on the simulator.

# %%
@cuda.jit
def vector_add_unguarded(a, b, c):
    i = cuda.grid(1)
    c[i] = a[i] + b[i]  # no guard: threads 1000..1023 index past the end


if kernel_target() == "simulator":
    try:
        vector_add_unguarded[blocks, threads](a, b, np.zeros(n, dtype=np.float32))
    except IndexError as e:
        print("the simulator stopped it:", e)
else:
    print("not run on a GPU: out-of-bounds writes are not checked there and would"
          " corrupt memory instead of raising")

# %% [markdown]
# ### How big a block, and how many?
#
# A seed warns that a launch with "too many" threads wastes threads that other
# kernels running at the same time could have used. Rounding up costs much less
# than that: the spare threads are all in the last block, at most
# `threads - 1` of them, and each reaches the bounds guard and exits after a
# handful of instructions. The rules that do matter are two:
#
# - a block size that is a **multiple of 32**, so that every warp is full. A
#   block of 100 threads runs as 4 warps, and in *every* block the last warp
#   has idle lanes for the kernel's whole life; 128 to 256 threads per block is
#   the usual choice.
# - **enough blocks** that every SM gets several of them, because an SM hides
#   memory latency by switching between resident warps (section 8 measures it).
#
# The cell counts the idle threads of our launch, of the worst case for the
# same block size (one element into a new block), and of a large launch. Even
# in the worst case the idle threads only pass the guard and leave, and in a
# large launch they are a vanishing fraction.

# %%
def idle_threads(n_elements, block_size):
    n_blocks = (n_elements + block_size - 1) // block_size
    return n_blocks * block_size - n_elements, n_blocks * block_size


for n_elements in (n, 1025, 10**6):
    idle, launched = idle_threads(n_elements, threads)
    print(f"{n_elements:9,} elements, blocks of {threads}: {idle:3} idle threads of "
          f"{launched:,} launched ({idle / launched:.2%})")
warps_100 = (100 + 31) // 32
print(f"a block of 100 threads: {warps_100} warps, {warps_100 * 32 - 100} idle lanes "
      "in the last warp")

# %% [markdown]
# ## 5. Matrix multiply, one thread per output element
#
# For `C = A @ B`, thread (x, y) computes `C[y, x]` as the dot product of row y
# of A with column x of B. The seed's description puts the whole matrix in one
# block; with at most 1024 threads per block that works only up to 32 x 32, so
# real launches tile C over many blocks, as `launch_2d` below does. The seed also
# says the whole product then takes "the time of one dot product", since all
# dot products run in parallel. That is not so. A GPU holds a fixed number of threads at once (by NVIDIA's
# published figures, at most 132 x 2048 on an H100 SXM5), so a large product
# runs in many waves; and every thread reads 2n numbers from memory, so the
# time grows with the n^3 arithmetic and, for this naive kernel,
# with the memory traffic. Section 8 counts that traffic.

# %%
@cuda.jit
def matmul_naive(A, B, C):
    x, y = cuda.grid(2)  # x: column of C, y: row of C
    if y < C.shape[0] and x < C.shape[1]:
        acc = float32(0.0)  # a bare 0.0 is a float64 in numba: slow on most GPUs
        for k in range(A.shape[1]):
            acc += A[y, k] * B[k, x]
        C[y, x] = acc


def launch_2d(kernel, A, B, tile=16):
    n_rows, n_cols = A.shape[0], B.shape[1]
    C = cuda.device_array((n_rows, n_cols), dtype=np.float32)
    grid = ((n_cols + tile - 1) // tile, (n_rows + tile - 1) // tile)
    kernel[grid, (tile, tile)](cuda.to_device(A), cuda.to_device(B), C)
    cuda.synchronize()
    return C.copy_to_host()


size = 1024 if kernels_on_gpu else 48  # the simulator: about 1 s at 64
A = torch.randn(size, size)
B = torch.randn(size, size)
start = time.perf_counter()
C = launch_2d(matmul_naive, A.numpy(), B.numpy())
elapsed = time.perf_counter() - start
torch.testing.assert_close(torch.from_numpy(C), A @ B, rtol=1e-4, atol=1e-4)
print(f"{size}x{size} naive matmul on the {kernel_target()} matches torch "
      f"({elapsed:.2f} s including copies and, on a GPU, compilation)")

# %% [markdown]
# ## 6. Warps and memory coalescing
#
# The hardware does not schedule threads one by one. It runs them in **warps of
# 32 consecutive threads** (numbered as in the picture above) that issue each
# instruction together. NVIDIA names this execution model **SIMT**, single
# instruction, multiple threads: you write the program of one thread, and the
# hardware runs 32 of them in lockstep on 32 lanes, each with its own
# registers (section 9 compares it with a CPU's SIMD). Two consequences follow:
# how the 32 threads' addresses fall in memory (this section), and what
# happens when they branch apart (section 7). When a warp executes a load, the
# 32 addresses are
# combined into as few memory transactions as possible. On current NVIDIA GPUs
# (compute capability 6.0 and later) the unit is a **32-byte sector**; a
# 128-byte cache line holds four of them. So 32 threads reading 32 consecutive
# `float32` values need 128 bytes = **4 sectors**: the access is *coalesced*.
# If each thread reads a float 8 elements (32 bytes) after its neighbour, every
# thread needs its own sector: 32 sectors, of which only 4 bytes each are used.
#
# **A correction to the seed.** The seed says that the accesses of 16
# neighbouring threads coalesce. That was true of compute capability 1.x GPUs
# (2007-2009), which combined accesses per *half-warp*. Since Fermi (2.x) it is
# the whole warp of 32 threads, and what matters is how many distinct 32-byte
# sectors the warp's addresses fall in.
#
# To count sectors we use a small tracer from `course_utils.warps`. It does not
# run a kernel: it evaluates the kernel's **index expression**, written as a
# plain Python function of `(blockIdx, threadIdx)`, for every thread of a
# launch, groups the threads into warps the way the hardware does, and counts
# distinct sectors per warp request. It therefore works with or without a GPU.
# It models addresses only - no caches, no timing.
#
# Here is a gather kernel, `out[i] = src[idx[i]]`, and four index arrays: the
# identity (coalesced), strides of 2 and of 8 floats (permutations that visit
# every 2nd or 8th element first, so neighbouring threads read elements that
# far apart), and a random permutation.

# %%
@cuda.jit
def gather(src, idx, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = src[idx[i]]


def strided_permutation(n, stride):
    """0, s, 2s, ..., then 1, 1+s, ...: every element once, neighbours s apart."""
    return np.arange(n).reshape(n // stride, stride).T.reshape(-1)


n_trace, threads = 4096, 256
patterns = {
    "coalesced": np.arange(n_trace),
    "stride 2": strided_permutation(n_trace, 2),
    "stride 8": strided_permutation(n_trace, 8),
    "random": rng.permutation(n_trace),
}
src = np.arange(n_trace, dtype=np.float32)
small = 1024  # the simulator runs one Python thread per GPU thread: keep it small
for name, idx in patterns.items():  # the kernel really computes the gather
    out = np.zeros(small, dtype=np.float32)
    gather[small // threads, threads](src, idx[:small], out)
    assert np.array_equal(out, src[idx[:small]]), name
print("gather kernel checked on", list(patterns))

# %% [markdown]
# The index expression of `gather` for the tracer. Thread `i` reads `idx[i]`,
# then `src[idx[i]]`, then writes `out[i]`; the first and last are coalesced
# for every pattern, so we trace only the load of `src[idx[i]]`, the one whose
# pattern varies.

# %%
def gather_accesses(idx):
    def accesses(block, thread):
        i = block[0] * threads + thread[0]
        if i >= len(idx):
            return []
        return [("src", int(idx[i]))]  # the load whose pattern varies
    return accesses


sector_table = {}
for name, idx in patterns.items():
    trace = trace_sectors(gather_accesses(idx), grid=n_trace // threads, block=threads)
    sector_table[name] = trace
    print(f"{name:10} {trace}")

# %% [markdown]
# Read the `sectors/request` column: the coalesced load needs the minimum, 4;
# stride 2 doubles it, because half of every sector is skipped; at a stride of 8
# floats or more each thread needs its own sector, so a warp moves 8 times the
# bytes it uses. Random indices come close to that: two threads of a warp only
# rarely land in the same sector.
#
# Does that cost time? The memory system moves sectors, so when memory is the
# bottleneck, bandwidth in *useful* bytes per second should fall in proportion.
# `torch.take(src, idx)` launches the same one-thread-per-element gather, so we
# time it for the three patterns on the device we have. A CPU has the same
# problem with its 64-byte cache lines, so the CPU run is an honest analogue; on
# a GPU the measurement is recorded, and beside it is the sector model's
# prediction for an H100.

# %%
n_bw = for_device(device, cpu=2**22, gpu=2**26)
src_t = torch.randn(n_bw, device=device)
bw_patterns = {
    "coalesced": torch.arange(n_bw, device=device),
    "stride 8": torch.from_numpy(strided_permutation(n_bw, 8)).to(device),
    "random": torch.randperm(n_bw, generator=torch.Generator().manual_seed(0)).to(device),
}
useful_bytes = n_bw * (4 + 8 + 4)  # read src (float32) and idx (int64), write out
bandwidth = {}
threads = torch.get_num_threads()
torch.set_num_threads(1)  # one core: its caches, not how many cores share the work
try:
    for name, idx in bw_patterns.items():
        t = bench(torch.take, src_t, idx, min_run_time=0.1).median
        bandwidth[name] = useful_bytes / t / 1e9
finally:
    torch.set_num_threads(threads)
for name, gbs in bandwidth.items():
    print(f"{name:10} {gbs:8.1f} GB/s useful  ({bandwidth['coalesced'] / gbs:.1f}x "
          f"slower than coalesced)")
if on_gpu:
    reference.record("01.gather_bandwidth", bandwidth, "GB/s", device)

# The sector model on a GPU: per element, idx (8 bytes) and out (4 bytes) are
# always coalesced; src costs 4 bytes when coalesced and a whole 32-byte sector
# when scattered. Bandwidth in useful bytes = HBM bandwidth x useful / moved.
moved = {"coalesced": 8 + 4 + 4, "stride 8": 8 + 4 + 32, "random": 8 + 4 + 32}
hbm = predict.achieved_memory_bandwidth("h100_sxm")  # calibrated: what copies reach
gpu_gather = reference.predicted(
    {k: hbm * 16 / m / 1e9 for k, m in moved.items()}, "GB/s",
    predict.gpu_name("h100_sxm"),
    "sector model: useful GB/s = achieved HBM bandwidth "
    f"({predict.memory_efficiency():.0%} of the datasheet's) x 16 useful / bytes "
    "moved per element (16 coalesced, 44 scattered: 8 B index + 4 B output + one "
    "32 B sector)",
    ["h100_sxm.memory_bandwidth_gbps", *predict.MEMORY_EFFICIENCY_INPUTS])
shown = reference.show("01.gather_bandwidth", local=bandwidth, unit="GB/s",
                       local_device=device, figures=[gpu_gather])
for f in shown:
    print(f"  {f.legend}: " + ", ".join(f"{k} {v:,.0f}" for k, v in f.value.items())
          + f"  (coalesced / random = {f.value['coalesced'] / f.value['random']:.1f}x)")
here = bandwidth["coalesced"] / bandwidth["random"]
gpu_ratio = gpu_gather.value["coalesced"] / gpu_gather.value["random"]
if here < 1.2:
    print(f"verdict: here the random gather was not clearly slower ({here:.2f}x); "
          "a busy machine can hide the gap - run the cell again")
else:
    print(f"verdict: scattered reads cost {here:.1f}x here, "
          f"{'more' if here > gpu_ratio else 'less'} than the {gpu_ratio:.2f}x "
          "predicted for the GPU")

# %%
def scalar(fig, value, unit):
    """One number taken out of a figure, keeping its kind, device and source."""
    return reference.Figure(fig.kind, value, unit, fig.device, fig.source)


fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
plots.plot_figure_bars([scalar(f, f.value["coalesced"], "GB/s") for f in shown],
                       ax=axes[0], ylabel="useful GB/s, coalesced gather",
                       title="Coalesced gather")
plots.plot_figure_bars(
    [scalar(f, f.value["coalesced"] / f.value["random"], "x") for f in shown],
    ax=axes[1], logy=False, ylabel="coalesced / random (times slower)",
    title="What scattering the reads costs", fmt="{:.2f}x")
fig.suptitle(f"Gather of {n_bw:,} floats: measured here and predicted for a GPU")
plt.tight_layout()
plt.show()

# %% [markdown]
# The right-hand bars are the lesson: how many times slower the same gather
# runs when its reads scatter. The prediction for a GPU applies the sector
# counts above: a scattered gather
# moves 44 bytes for every 16 it uses, so it runs at about 16/44 of the
# coalesced speed, 2.75x slower - not 8x, because the index and the output are
# read and written coalesced whatever the pattern. A gather with 4-byte
# indices, or a kernel that reads only the scattered array, would pay closer to
# 8x. Without a GPU the cell measured this CPU (one thread): it has 64-byte
# cache lines and a prefetcher that follows strides but not random addresses,
# so its gap can be larger or smaller than the GPU's. With a GPU it measured
# the GPU itself. The verdict above says which way it went here.
#
# ## 7. Divergence: when threads of a warp disagree
#
# A warp issues one instruction for all its 32 threads. At a branch where some
# threads go one way and some the other, it runs **both** paths one after the
# other, each time with the threads of the other path switched off. A branch on
# `i % 2` makes every warp diverge; the same amount of work branched on
# `(i // 32) % 2` sends whole warps one way and costs nothing extra. The seed
# warns that "branches can be very inefficient": it is only branches that
# split a warp that cost, as the count below shows. Its rule that 32
# neighbouring threads "can only execute the same instruction" also needs a
# footnote: since Volta (compute capability 7.0) each thread has its own program
# counter, so the two paths of a split warp may interleave, but in any one cycle
# the warp still issues one instruction for the threads on that path.

# %%
@cuda.jit
def two_paths(out, by_warp, steps):
    i = cuda.grid(1)
    if i >= out.size:
        return
    lane_group = (i // 32) % 2 if by_warp else i % 2
    v = out[i]
    if lane_group == 0:
        for _ in range(steps):
            v = v * float32(1.000001) + float32(0.5)  # float32, like v
    else:
        for _ in range(steps):
            v = v * float32(0.999999) - float32(0.25)
    out[i] = v


def branch_of(by_warp):
    def branch(block, thread):
        i = block[0] * 256 + thread[0]
        return (i // 32) % 2 if by_warp else i % 2
    return branch


for by_warp in (False, True):
    div, total = count_divergent_warps(branch_of(by_warp), grid=8, block=256)
    label = "(i // 32) % 2" if by_warp else "i % 2       "
    print(f"branch on {label}: {div} of {total} warps diverge")

# %% [markdown]
# On a GPU the cell below times both layouts (numba's CUDA events, median of
# repeated launches after a warm-up). Expect the divergent layout to take about
# twice as long, as the warp runs both loops. On the simulator every thread is a
# Python thread and there is no warp, so timing it would teach nothing: it runs
# a tiny launch to check that both layouts compute the same values. The cell
# after it measures the same cost on the CPU.

# %%
def time_kernel(launch, repeats=20):
    """Median seconds of ``launch()`` measured with CUDA events (GPU only)."""
    launch()  # warm-up: compilation and first-launch costs
    times = []
    for _ in range(repeats):
        start, end = cuda.event(), cuda.event()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


n_div = 2**22 if kernels_on_gpu else 512
steps = 2000 if kernels_on_gpu else 4
results = {}
for by_warp in (False, True):
    out = cuda.to_device(np.ones(n_div, dtype=np.float32))
    launch = functools.partial(two_paths[(n_div + 255) // 256, 256], out, by_warp, steps)
    if kernels_on_gpu:
        results["by warp" if by_warp else "by parity"] = time_kernel(launch)
    else:
        launch()
        results["by warp" if by_warp else "by parity"] = out.copy_to_host()
if kernels_on_gpu:
    ratio = results["by parity"] / results["by warp"]
    print(f"divergent (i % 2): {results['by parity'] * 1e3:.3f} ms, "
          f"by warp: {results['by warp'] * 1e3:.3f} ms, ratio {ratio:.2f}")
    reference.record("01.divergence_ratio", ratio, "x", device)
else:
    same = np.array_equal(np.sort(results["by parity"]), np.sort(results["by warp"]))
    print("both layouts give the same multiset of values:", same)

# %% [markdown]
# A CPU's SIMD lanes cannot branch either, so vectorised code meets the same
# choice. With one branch per element, it computes **both** paths for every
# element and keeps one of them per lane (`torch.where`; compilers emit masked
# or blended instructions for the same job): that is the split warp. When the
# elements are grouped so that whole groups take one path, each path runs on
# its own elements only: the warp-sized layout. The cell times both on one
# thread, with the same two loops as the kernel.

# %%
def run_path(v, scale, shift, steps):
    v = v.clone()  # contiguous, and the input stays as it was
    for _ in range(steps):
        v.mul_(scale).add_(shift)
    return v


def branch_per_element(x, even, steps):  # lanes disagree: both paths everywhere
    return torch.where(even, run_path(x, 1.000001, 0.5, steps),
                       run_path(x, 0.999999, -0.25, steps))


def branch_per_group(x, even, steps):  # groups of 32 agree: each path on its half
    groups = x.view(-1, 2, 32)  # group g of 32 takes path g % 2
    out = torch.empty_like(groups)
    out[:, 0] = run_path(groups[:, 0], 1.000001, 0.5, steps)
    out[:, 1] = run_path(groups[:, 1], 0.999999, -0.25, steps)
    return out.view(-1)


x_div = torch.rand(2**18)
even = torch.arange(x_div.numel()) % 2 == 0  # which path each element takes
cpu_times = {}
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    for _ in range(2):  # alternate the two, and keep each one's fastest run
        for fn in (branch_per_element, branch_per_group):
            t = min(bench(fn, x_div, even, 8, min_run_time=0.05).times)
            cpu_times[fn.__name__] = min(t, cpu_times.get(fn.__name__, t))
finally:
    torch.set_num_threads(threads)
cpu_ratio = cpu_times["branch_per_element"] / cpu_times["branch_per_group"]
print(f"one branch per element: {cpu_times['branch_per_element'] * 1e3:.2f} ms, "
      f"per group of 32: {cpu_times['branch_per_group'] * 1e3:.2f} ms "
      f"-> {cpu_ratio:.2f}x")
print("verdict: " + ("both paths ran for every element, as in a split warp"
                     if cpu_ratio > 1.4 else
                     "no clear cost here (disturbed by load?) - run the cell again"))
cpu_analogue = reference.measured(cpu_ratio, "x", "cpu")
cpu_analogue.device += ", torch.where vs grouped"
shown = reference.show(
    "01.divergence_ratio", unit="x (divergent time / uniform time)",
    local=ratio if kernels_on_gpu else None, local_device=device,
    figures=[reference.predicted(
        2.0, "x", "any NVIDIA GPU",
        "SIMT: a split warp runs both loops one after the other, and the loops are "
        "almost all of the work, so the divergent layout takes twice as long "
        "(uncalibrated: no published measurement of this kernel)")])
ax = plots.plot_figure_bars([cpu_analogue] + shown, logy=False, fmt="{:.2f}x",
                            ylabel="divergent time / uniform time",
                            title="What a branch that splits the lanes costs")
ax.axhline(1, color="grey", lw=1)
ax.set_ylim(0, ax.get_ylim()[1] * 1.4)  # room for the legend
ax.legend(fontsize=7, loc="upper right")
plt.show()

# %% [markdown]
# ## 8. The memory hierarchy
#
# From fastest and smallest to slowest and largest, a GPU offers:
#
# - **registers**, private to a thread;
# - **shared memory** (and the L1 cache, in the same on-chip storage), private to a
#   block and shared by its threads - the kernel manages it explicitly;
# - the **L2 cache**, shared by all SMs;
# - **global memory** (HBM), large, with a latency of hundreds of cycles. That
#   latency is hidden by having many warps in flight: while one waits, another
#   computes - the reason kernels launch far more threads than there are cores.
#
# On a GPU the next cell probes what torch reports. Without one it shows the
# figures NVIDIA publishes for the H100 SXM5 (NVIDIA H100 Tensor Core GPU
# datasheet and architecture whitepaper): published specifications, **not
# measurements**.

# %%
def in_bytes(n):
    """1024-based size, e.g. 49152 -> '48 KiB'; None when a probe gave nothing."""
    if not n:
        return None
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024


if on_gpu:
    p = torch.cuda.get_device_properties(device)
    # numba's view of device 0, the same GPU as `device`, when its CUDA target works
    numba_gpu = cuda.get_current_device() if kernels_on_gpu else None
    bus, clock = getattr(p, "memory_bus_width", 0), getattr(p, "memory_clock_rate", 0)
    facts = {
        "device": p.name,
        "SMs": p.multi_processor_count,
        "32-bit registers per SM":
            getattr(numba_gpu, "MAX_REGISTERS_PER_MULTIPROCESSOR", None),
        "shared memory per SM":
            in_bytes(getattr(p, "shared_memory_per_multiprocessor", 0)),
        "shared memory per block (default)":
            in_bytes(getattr(p, "shared_memory_per_block", 0)),
        "shared memory per block (opt-in maximum)":
            in_bytes(getattr(numba_gpu, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 0)),
        "L2 cache": in_bytes(getattr(p, "L2_cache_size", 0)),
        "global memory": in_bytes(p.total_memory),
        # memory_clock_rate is in kHz; DDR memory moves data twice per clock
        "peak DRAM bandwidth, 2 x clock x bus width":
            f"{2 * clock * 1e3 * bus / 8 / 1e12:.2f} TB/s" if bus and clock else None,
    }
    print("probed by torch and numba on this GPU (None: not reported here):")
else:
    facts = {
        "device": "NVIDIA H100 SXM5 80GB (published specification)",
        "SMs": 132,
        "32-bit registers per SM": 65536,
        "shared memory per SM (configurable with L1)": "up to 228 KB",
        "shared memory per block (opt-in maximum)": "227 KB",
        "L2 cache": "50 MB",
        "global memory": "80 GB HBM3",
        "HBM3 bandwidth": "3.35 TB/s",
    }
    print("no GPU: NVIDIA's published H100 SXM5 figures, not measured here:")
for k, v in facts.items():
    print(f"  {k:45} {v}")

# %% [markdown]
# ### How fast each level is
#
# Sizes are half the story; bandwidth is the other half. Shared memory is split
# into 32 banks that each deliver 4 bytes per clock, so an SM serves a whole
# warp's 32-bit loads in one clock when no two threads hit the same bank. Times
# the SMs and the clock, that is the shared-memory bandwidth of the whole GPU.
# NVIDIA publishes no bandwidth for the L2 cache; on a GPU, the copy sweep
# further down (buffers up to 2 GiB) shows it as the high plateau of the
# buffers that fit in L2, below 50 MB on an H100. Data that must leave the GPU
# cross links far slower than HBM: PCIe to the host, NVLink to other GPUs.
# Registers are faster still, but no bandwidth is published for them either.
# The cell lists the H100 SXM5's published figures, and predicts the A100's
# shared-memory bandwidth from its published SM count and clock; with a GPU it
# also computes that of the GPU it runs on, from its probed SMs and clock.

# %%
def shared_memory_bandwidth(n_sms, clock_hz):
    return n_sms * 32 * 4 * clock_hz  # SMs x 32 banks x 4 bytes x clocks per second


def published_value(key, scale=1.0):
    return reference.published_entry(key)["value"] * scale


# A100: the GPU whose whitepaper publishes both its SM count and its boost clock
a100_smem = shared_memory_bandwidth(published_value("a100.sm_count"),
                                    published_value("a100.boost_clock_mhz", 1e6))
h100_levels = {  # bytes per second, and how we know
    "HBM3": (published_value("h100_sxm.memory_bandwidth_gbps", 1e9),
             "published (datasheet)"),
    "L2 cache": (None, "not published: see the copy sweep below"),
    "NVLink 4, to other GPUs": (
        published_value("h100_sxm.nvlink_bandwidth_total_gbps", 1e9),
        "published, both directions together"),
    "PCIe Gen5 x16, to the host": (
        published_value("pcie5_x16.bandwidth_per_direction_gbps", 1e9),
        "published, each direction"),
}
print("NVIDIA H100 SXM5, from published figures (not measured here):")
for level, (bw, how) in h100_levels.items():
    shown = "-" if bw is None else (f"{bw / 1e12:.3g} TB/s" if bw >= 1e12
                                    else f"{bw / 1e9:.0f} GB/s")
    print(f"  {level:28} {shown:>11}   {how}")
hbm, pcie = h100_levels["HBM3"][0], h100_levels["PCIe Gen5 x16, to the host"][0]
print(f"HBM / PCIe on an H100: {hbm / pcie:.0f}x; shared memory / HBM on an A100: "
      f"{a100_smem / published_value('a100_sxm_80gb.memory_bandwidth_gbps', 1e9):.0f}x")
smem_bw = None
if on_gpu:
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "clock_rate", 0) or (
        cuda.get_current_device().CLOCK_RATE if kernels_on_gpu else 0)
    if clock_khz:
        smem_bw = shared_memory_bandwidth(props.multi_processor_count, clock_khz * 1e3)
        print(f"this GPU, {props.name}: {props.multi_processor_count} SMs x 32 x 4 B x "
              f"{clock_khz / 1e6:.2f} GHz = {smem_bw / 1e12:.1f} TB/s of shared memory "
              "(computed from its probed properties)")
        reference.record("01.shared_memory_bandwidth", smem_bw / 1e12, "TB/s", device)
    else:
        print(f"this GPU, {props.name}: its clock rate is not reported here")
_ = reference.show(
    "01.shared_memory_bandwidth", unit="TB/s",
    figures=[reference.predicted(
        a100_smem / 1e12, "TB/s", "NVIDIA A100",
        "SMs x 32 banks x 4 bytes x boost clock: a peak, uncalibrated (no "
        "published measurement in the calibration)",
        ["a100.sm_count", "a100.boost_clock_mhz"])])

# %% [markdown]
# Read the two ratios: each step outwards costs an order of magnitude or more of
# bandwidth, and a byte that must come from the host is the most expensive one a
# kernel can read. That is why training keeps its tensors on the GPU, and why
# fast kernels reuse data in shared memory (the tiled matmul below).
#
# ### Hiding latency with many loads in flight
#
# A load from HBM takes hundreds of cycles, and a warp waiting for it does
# nothing. The SM hides the wait by switching to another warp that is ready,
# which costs nothing because every resident warp keeps its registers on the
# chip. What sets the bandwidth is then how many loads are *in flight* at once:
# bytes in flight / latency (Little's law). So bandwidth needs many warps in
# flight.
#
# A CPU core hides latency the same way, on a smaller scale: its out-of-order
# engine keeps several cache misses outstanding, when the program gives it
# independent loads. The cell below follows pointers through a random cycle in
# a 64 MiB table (far beyond the caches): each load needs the address the
# previous one returned, so one chain keeps one load in flight. Following k
# independent chains in the same loop keeps up to k in flight. It is compiled
# with numba's CPU compiler (`@njit`), so that no interpreter stands between
# the loads.

# %%
@njit
def follow_chains(next_index, starts, steps):
    """Follow len(starts) independent pointer chains, one step of each in turn."""
    pos = starts.copy()
    for _ in range(steps):
        for c in range(pos.size):
            pos[c] = next_index[pos[c]]  # each load waits only for its own chain
    return pos.sum()


n_chase = 2**23  # 8 Mi int64 = 64 MiB
cycle = np.random.default_rng(0).permutation(n_chase)
next_index = np.empty(n_chase, dtype=np.int64)
next_index[cycle[:-1]] = cycle[1:]  # one random cycle through the whole table
next_index[cycle[-1]] = cycle[0]
follow_chains(next_index, cycle[:1].copy(), 10)  # compile before timing
loads = 2**17
chains = [1, 2, 4, 8, 16, 32, 64]
loads_per_s = []
for k in chains:
    starts = cycle[np.arange(k) * (n_chase // k)]
    best = float("inf")
    for _ in range(3):  # the fastest of three: other programs only slow a run down
        t0 = time.perf_counter()
        follow_chains(next_index, starts, loads // k)
        best = min(best, time.perf_counter() - t0)
    loads_per_s.append(loads / best)
for k, rate in zip(chains, loads_per_s, strict=True):
    print(f"{k:3} chains: {1e9 / rate:6.1f} ns per load, {rate / 1e6:6.1f} M loads/s")

def chase(table, order, k):
    starts = order[np.arange(k) * (n_chase // k)]
    return lambda: follow_chains(table, starts, loads // k)


print("the same loads, on 1 and on 16 chains:")  # the course's protocol (Chapter 4)
print(compare({f"{k} chain{'s' if k > 1 else ''}": chase(next_index, cycle, k)
               for k in (1, 16)}, repeats=3))
del next_index, cycle

# %% [markdown]
# Look for the time per load to fall almost in proportion to the number of
# chains, then level off when the core's buffers for outstanding misses are
# full (some tens on current cores). A GPU plays the same game with thousands
# of threads. The kernel below copies an array with a **grid-stride loop**
# (each thread copies element i, then i + all threads in the grid, ...), so
# the same work can be done by any number of blocks. On a GPU the cell
# measures the copy bandwidth for a growing number of blocks of 256 threads;
# look for it to climb until there are several blocks per SM, then level off
# at the memory's bandwidth. On the simulator it only checks that every grid
# size copies correctly; the published HBM peak is the roof a GPU's curve
# climbs towards.

# %%
@cuda.jit
def copy_grid_stride(src, dst):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, src.size, stride):
        dst[i] = src[i]


if kernels_on_gpu:
    n_lat = 2**24  # 64 MiB of float32, well beyond the L2 cache
    src_d = cuda.to_device(np.ones(n_lat, dtype=np.float32))
    dst_d = cuda.device_array_like(src_d)
    n_sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    block_counts = [1, 4, 16, n_sms // 2, n_sms, 2 * n_sms, 4 * n_sms, 8 * n_sms,
                    16 * n_sms, 64 * n_sms]
    latency_curve = {"x": block_counts, "y": []}
    for nb in block_counts:
        t = time_kernel(lambda nb=nb: copy_grid_stride[nb, 256](src_d, dst_d),
                        repeats=5)
        latency_curve["y"].append(2 * 4 * n_lat / t / 1e9)  # read + write
    for nb, gbs in zip(block_counts, latency_curve["y"], strict=True):
        print(f"{nb:6} blocks ({nb / n_sms:6.2f} per SM): {gbs:8.1f} GB/s")
    reference.record("01.copy_bandwidth_vs_blocks", latency_curve, "GB/s", device)
    del src_d, dst_d
else:
    src_s = np.arange(3000, dtype=np.float32)
    for nb in (1, 3, 12):
        dst_s = np.zeros_like(src_s)
        copy_grid_stride[nb, 64](src_s, dst_s)
        assert np.array_equal(dst_s, src_s), nb
    print("grid-stride copy checked with 1, 3 and 12 blocks on the simulator")
hbm_peak = reference.published("h100_sxm.memory_bandwidth_gbps")
lat_shown = reference.show(
    "01.copy_bandwidth_vs_blocks", unit="GB/s", local_device=device,
    local=latency_curve if kernels_on_gpu else None, figures=[hbm_peak])

# %%
gpu_curves = [f for f in lat_shown if isinstance(f.value, dict)]  # measured/recorded
# a GPU panel only when there is a GPU curve to draw (measured or recorded)
fig, axes = plt.subplots(1, 2 if gpu_curves else 1,
                         figsize=(11, 3.8) if gpu_curves else (6, 3.8))
ax_cpu = axes[0] if gpu_curves else axes
chase_curve = reference.measured({"x": chains, "y": [r / 1e6 for r in loads_per_s]},
                                 "M loads/s", "cpu")
plots.plot_figure_curves([chase_curve], ax=ax_cpu, logx=True, logy=True,
                         xlabel="independent chains (loads in flight)",
                         ylabel="million loads per second",
                         title="This CPU: more loads in flight")
ax_cpu.set_xscale("log", base=2)
ax_cpu.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
if gpu_curves:
    ax_gpu = axes[1]
    plots.plot_figure_curves(gpu_curves, ax=ax_gpu, xlabel="blocks of 256 threads",
                             ylabel="copy bandwidth (GB/s, read + write)",
                             title="A GPU: more warps in flight")
    ax_gpu.set_xscale("log", base=2)
    ax_gpu.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_gpu.axhline(hbm_peak.value, color="grey", label=hbm_peak.legend + " (HBM peak)",
                   **plots.figure_style("published"))
    ax_gpu.legend(fontsize=7)
else:
    print("no GPU curve measured or recorded yet: on a GPU the copy climbs with the "
          f"blocks in flight towards the HBM peak ({hbm_peak.label})")
plt.tight_layout()
plt.show()

# %% [markdown]
# We can see the hierarchy in a measurement on either device: copy a buffer of
# growing size and compute the bandwidth. While source and copy fit in a cache,
# copies are fast; once they spill to main memory (RAM or HBM), bandwidth drops
# to what that memory delivers. Look for the step down on the right of the
# curve. On a GPU, also look at the left end: the smallest copies are held back
# by the fixed cost of a kernel launch, so the GPU curve first rises. On a CPU
# the copy runs on one thread, so the caches are those of one core; a busy
# machine makes the curve noisy (each point is the fastest of several runs), so
# run it again if it looks ragged.

# %%
def copy_bandwidth(n_bytes, on=device):
    x = torch.empty(n_bytes // 4, dtype=torch.float32, device=on).fill_(1.0)
    y = torch.empty_like(x)
    # one CPU thread: one core's caches, and steadier on a machine shared with others
    timing = bench(y.copy_, x, min_run_time=0.03,
                   num_threads=for_device(on, cpu=1, gpu=None))
    t = min(timing.times)  # the fastest run: other programs can only slow one down
    return 2 * n_bytes / t / 1e9  # read x and write y


def fits(n_bytes):
    """Source and copy both fit on the device (a 6 GB laptop GPU stops early)."""
    try:
        check_fits((2 * n_bytes // 4,), torch.float32, device)
        return True
    except DoesNotFit:
        return False


sizes = [2**k for k in range(20, for_device(device, cpu=28, gpu=32)) if fits(2**k)]
bw_curve = [copy_bandwidth(s) for s in sizes]
copy_curve = {"x": [s / 2**20 for s in sizes], "y": bw_curve}  # MiB, GB/s
if on_gpu:
    reference.record("01.copy_bandwidth_vs_size", copy_curve, "GB/s", device,
                     note="x: buffer MiB")
curve_shown = reference.show("01.copy_bandwidth_vs_size", local=copy_curve,
                             unit="GB/s", local_device=device, figures=[hbm_peak])

ax = plots.plot_figure_curves(
    [f for f in curve_shown if isinstance(f.value, dict)],
    xlabel="buffer size (MiB)", ylabel="copy bandwidth (GB/s, read + write)",
    title="Copy bandwidth against working-set size")
ax.axhline(hbm_peak.value, color="gray", label=hbm_peak.legend + " HBM peak",
           **plots.figure_style("published"))
ax.set_xscale("log", base=2)
ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 1, 2, 4, ...
ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # 10, 20, 50, 100, ...
ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
ax.yaxis.set_minor_formatter(NullFormatter())
ax.set_xlabel("buffer size (MiB)")
ax.set_ylabel("copy bandwidth (GB/s, read + write)")
ax.set_title("Copy bandwidth against working-set size")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
best = int(np.argmax(bw_curve))
print(f"peak {bw_curve[best]:.0f} GB/s at {sizes[best] // 2**20} MiB buffers, "
      f"{bw_curve[best] / bw_curve[-1]:.1f}x the {bw_curve[-1]:.0f} GB/s of the "
      f"largest ({sizes[-1] // 2**20} MiB)")

# %% [markdown]
# ### A figure to correct
#
# The seed's picture of the hierarchy comes from the FlashAttention paper (Dao
# et al., 2022), which gives for an A100: on-chip SRAM 19 TB/s, HBM 1.5 TB/s and
# "CPU DRAM" 12.8 GB/s. The first two fit the A100, as the cell below computes
# from its published figures. The third does not describe a server's memory:
# 12.8 GB/s is exactly **one channel of DDR3-1600** (1600 million transfers a
# second x 8 bytes), the memory of a desktop of 2012. Even one thread copying
# on this machine may beat it (the cell reuses the largest buffer of the sweep
# above, or measures one on the host with a GPU), and a server socket of the
# A100's generation has eight DDR4-3200 channels working at once. What limits
# a GPU that reads host memory is neither figure but the **PCIe link** between
# them, about 32 GB/s each way for PCIe 4.0 x16.

# %%
host_copy = bw_curve[-1] if not on_gpu else copy_bandwidth(2**27, on="cpu")
ddr4_socket = 8 * 3200e6 * 8  # 8 channels x 3200 MT/s x 8 bytes (published spec)
pcie4 = 16e9 * 16 / 8 * 128 / 130  # 16 GT/s x 16 lanes, 128b/130b encoding
print("FlashAttention's A100 figures against what they should be:")
print(f"  SRAM 19 TB/s:     {published_value('a100.sm_count'):.0f} SMs x 32 x 4 B x "
      f"{published_value('a100.boost_clock_mhz') / 1e3:.2f} GHz = "
      f"{a100_smem / 1e12:.1f} TB/s (computed from published figures)")
print("  HBM 1.5 TB/s:     A100 40GB, "
      f"{published_value('a100_sxm_40gb.memory_bandwidth_gbps') / 1e3:.3f} TB/s "
      "(published)")
print(f"  DRAM 12.8 GB/s:   = 1 channel of DDR3-1600: {1600e6 * 8 / 1e9:.1f} GB/s; "
      f"one thread copying here: {host_copy:.1f} GB/s (measured);"
      f" 8 x DDR4-3200 socket: {ddr4_socket / 1e9:.1f} GB/s (computed from spec)")
print(f"                    PCIe Gen4 x16, each direction: {pcie4 / 1e9:.1f} GB/s "
      "(computed from spec) - the real bottleneck")

# %% [markdown]
# ### Shared memory: a tiled matrix multiply
#
# In the naive matmul every thread reads a whole row of A and a whole column of
# B from global memory, so each element of A and B is fetched n times. A tiled
# kernel lets the threads of a block cooperate: each thread loads **one**
# element of a TILE x TILE piece of A and one of B into shared memory, the block
# waits at `cuda.syncthreads()`, and then every thread reads its TILE products
# from fast shared memory. Global traffic falls by a factor of about TILE.
# FlashAttention rests on the same idea: it computes attention tile by tile in
# shared memory, so the large n x n matrix of attention scores is never written
# to HBM.

# %%
TILE = 16


@cuda.jit
def matmul_tiled(A, B, C):
    a_tile = cuda.shared.array((TILE, TILE), dtype=np.float32)
    b_tile = cuda.shared.array((TILE, TILE), dtype=np.float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    x, y = cuda.grid(2)
    acc = float32(0.0)
    for t in range((A.shape[1] + TILE - 1) // TILE):
        k_a, k_b = t * TILE + tx, t * TILE + ty
        a_tile[ty, tx] = A[y, k_a] if y < A.shape[0] and k_a < A.shape[1] else float32(0.0)
        b_tile[ty, tx] = B[k_b, x] if k_b < B.shape[0] and x < B.shape[1] else float32(0.0)
        cuda.syncthreads()  # the whole tile is loaded before anyone reads it
        for k in range(TILE):
            acc += a_tile[ty, k] * b_tile[k, tx]
        cuda.syncthreads()  # everyone is done before the tile is overwritten
    if y < C.shape[0] and x < C.shape[1]:
        C[y, x] = acc


size_t = 1024 if kernels_on_gpu else 32
A2, B2 = torch.randn(size_t, size_t), torch.randn(size_t, size_t)
C_tiled = launch_2d(matmul_tiled, A2.numpy(), B2.numpy(), tile=TILE)
torch.testing.assert_close(torch.from_numpy(C_tiled), A2 @ B2, rtol=1e-4, atol=1e-4)
print(f"{size_t}x{size_t} tiled matmul on the {kernel_target()} matches torch")

# %% [markdown]
# The tracer counts the global-memory sectors of both kernels from their index
# expressions, for a small size so it takes a moment.

# %%
def naive_accesses(n):
    def accesses(block, thread):
        x, y = block[0] * TILE + thread[0], block[1] * TILE + thread[1]
        reads = []
        for k in range(n):
            reads += [("A", y * n + k), ("B", k * n + x)]
        return reads + [("C", y * n + x)]
    return accesses


def tiled_accesses(n):
    def accesses(block, thread):
        x, y = block[0] * TILE + thread[0], block[1] * TILE + thread[1]
        reads = []
        for t in range(n // TILE):
            reads += [("A", y * n + t * TILE + thread[0]),
                      ("B", (t * TILE + thread[1]) * n + x)]
        return reads + [("C", y * n + x)]
    return accesses


n_mm = 64
launch_shape = dict(grid=(n_mm // TILE, n_mm // TILE), block=(TILE, TILE))
naive_trace = trace_sectors(naive_accesses(n_mm), **launch_shape)
tiled_trace = trace_sectors(tiled_accesses(n_mm), **launch_shape)
print(f"naive: {naive_trace}")
print(f"tiled: {tiled_trace}")
print(f"the tiled kernel issues {naive_trace.requests / tiled_trace.requests:.1f}x fewer "
      f"requests and moves {naive_trace.total_sectors / tiled_trace.total_sectors:.1f}x"
      f" fewer sectors (TILE = {TILE})")

# %% [markdown]
# Compare the request counts: the naive kernel issues one request per k for A
# and one for B, the tiled kernel one per *tile* of TILE values of k, so about
# TILE times fewer. The naive kernel's requests are cheap (a warp covers two
# rows of C, so its A loads touch just 2 sectors), which is why the saving in
# sectors is smaller than the saving in requests. On a real GPU the caches already catch part of
# the naive kernel's repeated reads, so the time gap is smaller than the sector
# gap. The next cell measures it on a GPU, with cuBLAS (`torch.matmul`) timed
# beside them as the yardstick; everywhere it shows the roofline's floor for
# an H100 (no fp32 kernel can beat the FP32 peak), and recorded times where a
# GPU has recorded them.

# %%
if kernels_on_gpu:
    n_gpu = 2048
    A_d = cuda.to_device(np.random.default_rng(0).standard_normal(
        (n_gpu, n_gpu), dtype=np.float32))
    B_d = cuda.to_device(np.random.default_rng(1).standard_normal(
        (n_gpu, n_gpu), dtype=np.float32))
    C_d = cuda.device_array((n_gpu, n_gpu), dtype=np.float32)
    grid2 = (n_gpu // TILE, n_gpu // TILE)
    times = {
        "naive": time_kernel(lambda: matmul_naive[grid2, (TILE, TILE)](A_d, B_d, C_d)),
        "tiled": time_kernel(lambda: matmul_tiled[grid2, (TILE, TILE)](A_d, B_d, C_d)),
    }
    At, Bt = torch.randn(n_gpu, n_gpu, device=device), torch.randn(n_gpu, n_gpu, device=device)
    times["torch.matmul"] = bench(torch.matmul, At, Bt).median
    for k, v in times.items():
        print(f"{k:13} {v * 1e3:8.3f} ms  {2 * n_gpu**3 / v / 1e12:6.2f} TFLOP/s")
    reference.record("01.matmul_2048_ms", {k: v * 1e3 for k, v in times.items()},
                     "ms", device)
n_mm = 2048
floor = predict.roofline_seconds(2 * n_mm**3, 3 * 4 * n_mm**2, "h100_sxm", "fp32")
likely = predict.kernel_seconds(2 * n_mm**3, 3 * 4 * n_mm**2, "h100_sxm", "fp32")
floor = reference.predicted({"any kernel, at best": floor.value * 1e3,
                             "cuBLAS, calibrated": likely.value * 1e3}, "ms",
                            floor.device, floor.measures + "; calibrated: "
                            f"{predict.matmul_efficiency():.0%} of peak, what large "
                            "bf16 matmuls reach (not checked for fp32)",
                            ["h100_sxm.fp32_tflops", "h100_sxm.memory_bandwidth_gbps",
                             *predict.MATMUL_EFFICIENCY_INPUTS])
for f in reference.show("01.matmul_2048_ms", unit="ms", local_device=device,
                        local={k: v * 1e3 for k, v in times.items()}
                        if kernels_on_gpu else None, figures=[floor]):
    for k, v in f.value.items():
        print(f"    {k:20} {v:8.3f} ms  {2 * n_mm**3 / (v / 1e3) / 1e12:6.1f} TFLOP/s")

# %% [markdown]
# ### Occupancy: how many warps fit on an SM
#
# Latency hiding needs warps *resident* on the SM, and how many fit is set by
# whichever of three resources runs out first:
#
# - the SM's limit on resident warps (64 warps, 2048 threads, on an H100);
# - **registers**: the SM's register file is shared by all its resident
#   threads, so a kernel that needs R registers per thread fits at most
#   (registers per SM) / R threads;
# - **shared memory**: a block that declares S bytes of it fits at most
#   (shared memory per SM) / S times.
#
# A whole block is resident or not at all. **Occupancy** is the resident warps
# over the limit. The cell computes it from NVIDIA's published H100 figures
# for a few kernels; real allocation rounds registers and shared memory up to
# a granule and also caps the blocks per SM, which the model leaves out (the
# CUDA Occupancy Calculator in Nsight Compute has all the rules). With a GPU
# and numba's CUDA target, it also asks the compiler how many registers this
# chapter's tiled matmul uses.

# %%
H100 = {k: reference.published(f"h100_sxm.{k}") for k in (
    "max_resident_warps_per_sm", "register_file_per_sm_kb", "shared_memory_per_sm_kb")}
max_warps = H100["max_resident_warps_per_sm"].value
registers_per_sm = H100["register_file_per_sm_kb"].value * 1024 // 4  # 32-bit each
shared_per_sm = H100["shared_memory_per_sm_kb"].value * 1024


def occupancy(threads_per_block, registers_per_thread, shared_per_block):
    """Resident warps per SM, and which limit binds (no rounding to granules)."""
    warps_per_block = -(-threads_per_block // 32)
    limits = {
        "warps": max_warps // warps_per_block,
        "registers": registers_per_sm // (registers_per_thread * threads_per_block),
        "shared memory": (shared_per_sm // shared_per_block if shared_per_block
                          else max_warps),
    }
    blocks = min(limits.values())
    return blocks * warps_per_block, min(limits, key=limits.get)


print(f"H100 SXM, per SM (published): {max_warps} resident warps, a register file "
      f"of {registers_per_sm:,} 32-bit registers, {shared_per_sm // 1024} KB of "
      "shared memory")
kernels = [  # (what, threads per block, registers per thread, shared bytes per block)
    ("a light elementwise kernel", 256, 32, 0),
    ("the same with 64 registers", 256, 64, 0),
    ("a heavy kernel, 128 registers", 256, 128, 0),
    ("this chapter's tiled matmul", TILE * TILE, 32, 2 * TILE * TILE * 4),
    ("a block with 64 KiB of shared memory", 256, 32, 64 * 1024),
    ("a block with 120 KiB of shared memory", 256, 32, 120 * 1024),
]
print(f"{'kernel':38} {'threads':>7} {'regs':>5} {'shared':>8}  warps  occupancy "
      "limited by")
for what, tpb, regs, smem in kernels:
    warps, limiter = occupancy(tpb, regs, smem)
    print(f"{what:38} {tpb:7} {regs:5} {smem // 1024:6} KiB  {warps:4}  "
          f"{warps / max_warps:8.0%}  {limiter}")
if kernels_on_gpu:
    # numba reports the registers of each version it compiled (one per argument
    # types): {argument types: registers per thread}
    for types, regs in matmul_tiled.get_regs_per_thread().items():
        print(f"on this GPU, numba compiled matmul_tiled{types} to {regs} registers "
              f"per thread: {occupancy(TILE * TILE, regs, 2 * TILE * TILE * 4)[0]} "
              "resident warps by the H100 model")
print("sources:", "; ".join(f.label for f in H100.values()))

# %% [markdown]
# ## 9. SIMD on the CPU, for contrast
#
# CPUs parallelise too, in a different way: one **SIMD** instruction (Single
# Instruction, Multiple Data) adds 4, 8 or 16 floats at once, depending on the
# register width. A Python loop cannot use it - each `+` goes through the
# interpreter, checks types and allocates a new float object. NumPy's add is a
# compiled loop over raw memory that uses SIMD instructions.

# %%
facts_cpu = cpu_facts()
print(f"this CPU: {facts_cpu['model']}, widest SIMD {facts_cpu['simd']} = "
      f"{facts_cpu['simd_bits'] // 32} float32 per instruction")

def l2_cache_bytes(default=256 * 1024):
    """One core's L2 cache, from Linux's sysfs (a common minimum elsewhere)."""
    try:
        from pathlib import Path
        for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip()  # e.g. '1024K'
                return int(size[:-1]) * {"K": 1024, "M": 2**20}[size[-1]]
    except (OSError, ValueError, KeyError):
        pass
    return default


# x, y and the result, 4 bytes each, in a quarter of the L2 cache
n_simd = max(1024, l2_cache_bytes() // 4 // 12)
xs = rng.standard_normal(n_simd).astype(np.float32)
ys = rng.standard_normal(n_simd).astype(np.float32)
out_simd = np.empty_like(xs)
xl, yl = xs.tolist(), ys.tolist()


def python_add(x, y):
    return [a + b for a, b in zip(x, y, strict=True)]


def fastest(fn, *args, **kwargs):
    """Seconds per call of the fastest run: other programs only slow runs down."""
    return min(bench(fn, *args, min_run_time=0.1, **kwargs).times)


t_loop = fastest(python_add, xl, yl)
t_numpy = fastest(np.add, xs, ys, out=out_simd)  # writes into the same array each time
print(f"{n_simd:,} floats, x + y: python loop {t_loop * 1e3:.2f} ms, numpy "
      f"{t_numpy * 1e6:.1f} us: numpy is {t_loop / t_numpy:.0f}x faster")
ns_loop, ns_numpy = t_loop / n_simd * 1e9, t_numpy / n_simd * 1e9
ghz = (facts_cpu["clock_mhz"] or 0) / 1e3
print(f"per element: python {ns_loop:.1f} ns, numpy {ns_numpy:.3f} ns", end="")
if ghz:
    cycles = ns_numpy * ghz
    print(f" = {ns_loop * ghz:.0f} and {cycles:.2f} clock cycles at {ghz:.1f} GHz")
    print("verdict: " + (f"numpy needs {cycles:.2f} cycles per element: several "
                         "elements per instruction, SIMD at work" if cycles < 1 else
                         f"numpy needed {cycles:.2f} cycles per element here, so this "
                         "run cannot show SIMD (a busy machine?) - run it again"))
else:
    print(" (clock rate unknown)")

# %% [markdown]
# Work per clock cycle tells the story. The Python loop spends tens to hundreds
# of cycles on each element: that is the interpreter, not the addition. If numpy
# needs less than one cycle per element, the CPU must be adding several
# elements per instruction: that is SIMD at work.
#
# **A correction to the seed.** The seed compares an SSE version of the add
# (intrinsics, 4 floats per instruction) with a plain C loop and finds SIMD only
# 18-24% faster. That small gain has two causes, neither of them "SIMD does not
# help much": an optimising compiler already turns the plain loop into SIMD code
# (GCC at `-O3`, clang already at `-O2`), and vectors of 100
# thousand to 50 million floats mostly live in RAM, where the add waits for
# memory, not for arithmetic. The next cell shows the second effect: numpy's own
# add, per element, on vectors that fit in the L2 cache (above) and on vectors
# far beyond the caches, both written into an existing output array and each
# the fastest of several runs. (The seed's SSE loop also steps by 4 with no tail: for n not a multiple
# of 4 it reads and writes past the end of the arrays, the CPU cousin of a
# kernel without its bounds guard.)

# %%
n_ram = 2**24  # 64 MiB per array: far beyond the caches
xr = np.ones(n_ram, dtype=np.float32)
yr = np.ones(n_ram, dtype=np.float32)
out_ram = np.empty_like(xr)
t_ram = fastest(np.add, xr, yr, out=out_ram)  # like with like: out= in both
ns_ram = t_ram / n_ram * 1e9
print(f"numpy add per element: {ns_numpy:.3f} ns for {n_simd:,} floats (in L2), "
      f"{ns_ram:.3f} ns for {n_ram:,} floats (in RAM): {ns_ram / ns_numpy:.1f}x")
print(f"the RAM-sized add moves {3 * 4 * n_ram / t_ram / 1e9:.1f} GB/s "
      "(read two arrays, write one)")
print("verdict: " + ("out of the caches the add waits for memory, as the seed's "
                     "large vectors did" if ns_ram > 1.3 * ns_numpy else
                     "no clear gap in this run (a busy machine?) - run it again"))
del xr, yr, out_ram

# %% [markdown]
# Look for the RAM-sized add to cost more per element: out of the caches, the
# add is limited by memory bandwidth, and wider arithmetic cannot help. A GPU
# takes the same idea further. A warp is 32 lanes executing one instruction,
# like a SIMD unit, but the program is written for one thread, and each lane
# is a thread with its own registers that may branch (at the cost of
# divergence): NVIDIA calls this **SIMT**, single instruction, multiple
# threads. SIMD is visible in the code (vector types, intrinsics, or a
# compiler that vectorises a loop); SIMT is the hardware's business. And
# thousands of warps in flight hide memory latency.
#
# ## 10. Amdahl's law
#
# If a fraction p of a program's work can be parallelised and the rest cannot,
# n processors give at best
#
# $$ S(n) = \frac{1}{(1 - p) + p / n}, \qquad \lim_{n \to \infty} S(n) = \frac{1}{1-p}. $$
#
# The serial part is the shortest stave of the barrel: with p = 0.95, no number
# of processors beats 20x. Drag the sliders (in a live notebook) to see it.

# %%
import ipywidgets as widgets


def amdahl(p, n):
    return 1.0 / ((1.0 - p) + p / n)


def plot_amdahl(p=0.9, n=8):
    procs = np.logspace(0, 12, 49, base=2)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(procs, amdahl(p, procs), label=f"p = {p:.2f}")
    ax.axhline(1 / (1 - p) if p < 1 else procs[-1], ls="--", color="grey",
               label="limit 1 / (1 - p)")
    ax.plot([n], [amdahl(p, n)], "o", color="tab:red",
            label=f"n = {n}: {amdahl(p, n):.2f}x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("processors n")
    ax.set_ylabel("speed-up S(n)")
    ax.set_title("Amdahl's law: speed-up against processors")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    plt.show()


amdahl_plot = widgets.interact(  # n in powers of two, as the plot's axis
    plot_amdahl, p=widgets.FloatSlider(0.9, min=0.0, max=0.99, step=0.01,
                                       continuous_update=False),
    n=widgets.SelectionSlider(options=[2**k for k in range(13)], value=8,
                              description="n", continuous_update=False))

# %% [markdown]
# Now a measured point. The job below has a serial part (in the parent process)
# and a parallel part (pure-Python arithmetic, split into equal chunks over
# worker processes). We time the serial and the parallel part on one worker to
# get p for this job, then the same job on two workers, and compare the
# measured speed-up with Amdahl's prediction for n = 2. The one- and
# two-worker runs alternate, so that a burst of load elsewhere hits both
# alike, and the machine's own counters tell whether other programs used the
# cores meanwhile: then the verdict says "disturbed" instead of a speed-up. A
# result that Amdahl's law forbids (more than the bound) can only come from
# such disturbance, and the cell says so too.
# Processes, not threads: Python's GIL lets only one thread run Python code at
# a time (Chapter 4).

# %%
import multiprocessing as mp


def burn(iterations):
    s = 0
    for k in range(iterations):
        s += k * k % 7
    return s


def run_job(workers, serial_iters, parallel_iters, pool):
    t0 = time.perf_counter()
    burn(serial_iters)                              # the part that cannot be split
    t1 = time.perf_counter()
    chunk = parallel_iters // workers
    # the part that can; .get(timeout) so that a lost worker cannot hang the cell
    pool.map_async(burn, [chunk] * workers, chunksize=1).get(timeout=120)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


serial_iters, parallel_iters = 300_000, 2_700_000
if "fork" in mp.get_all_start_methods():
    runs = {1: [], 2: []}
    with mp.get_context("fork").Pool(2) as pool:
        pool.map_async(burn, [1000, 1000]).get(timeout=60)  # start the workers first
        # 1 worker, 2 workers, 1, 2, ...: the course's comparison protocol
        # (Chapter 4), which counts the workers' CPU seconds too
        result = compare({f"{w} worker{'s' if w > 1 else ''}": lambda w=w: runs[w].append(
            run_job(w, serial_iters, parallel_iters, pool)) for w in (1, 2)},
            repeats=4, warmup=0)
    one = sorted(runs[1], key=sum)[len(runs[1]) // 2]  # a run of median length
    p_measured = one[1] / sum(one)
    speedup = result.ratio
    bound = amdahl(p_measured, 2)
    print(result)
    print(f"parallel fraction p = {p_measured:.2f} -> Amdahl's bound {bound:.2f}x; "
          f"measured {speedup:.2f}x (medians)")
    if result.outcome != "disturbed" and speedup > 1.05 * bound:
        print("but above the bound, which Amdahl's law forbids: the runs were "
              "disturbed after all - run it again")
    procs = np.arange(1, 9)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(procs, amdahl(p_measured, procs), marker=".",
            label=f"Amdahl, p = {p_measured:.2f}")
    ax.plot(procs, procs, ls=":", color="grey", label="perfect scaling")
    ax.plot([2], [speedup], "o", color="tab:red", ms=9, label="measured, 2 processes")
    ax.set_xlabel("processes n")
    ax.set_ylabel("speed-up over 1 process")
    ax.set_title("Measured speed-up against Amdahl's prediction")
    ax.grid(True, alpha=0.3)
    ax.legend()
    plt.show()
else:
    print("this platform has no 'fork' start method; run the chapter on Linux to measure")

# %% [markdown]
# On an otherwise idle machine the measured point lies close to the
# prediction, and a little below it: handing work to the pool and collecting
# results is more serial work. When other programs use the cores, the
# measured speed-up falls below the curve - there is no free core to gain -
# and the verdict says the run was disturbed. Amdahl's law
# assumes perfect splitting, no overhead and idle processors, so it is an upper
# bound.
#
# ## 11. The same kernel in CUDA C, through pycuda
#
# numba compiles Python to GPU code. The classic alternative is to write the
# kernel in CUDA C and compile it at run time with pycuda's `SourceModule`
# (which calls `nvcc`). This needs a GPU, the CUDA toolkit and pycuda (see
# `requirements-gpu.txt`).

# %%
VECTOR_ADD_CUDA_C = r"""
__global__ void vector_add(const float *a, const float *b, float *c, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {            // the same bounds guard as in Python
        c[i] = a[i] + b[i];
    }
}
"""

try:
    import pycuda.autoprimaryctx  # noqa: F401  (GPU 0's primary context, as torch's)
    import pycuda.driver as drv
    from pycuda.compiler import SourceModule
    why_not = None if on_gpu else "there is no GPU"
except ImportError as e:
    why_not = ("pycuda is not installed (it needs the CUDA toolkit)"
               if (e.name or "").startswith("pycuda") else f"pycuda could not load: {e}")
except Exception as e:  # pycuda present, but no driver or no device
    why_not = f"pycuda could not start: {e}"

if why_not is None:
    try:
        module = SourceModule(VECTOR_ADD_CUDA_C)  # runs nvcc
    except Exception as e:  # no nvcc on PATH, or it failed
        why_not = f"nvcc could not compile the kernel: {str(e)[:300]}"

if why_not is None:
    vector_add_c = module.get_function("vector_add")
    n = 1000
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c = np.empty_like(a)
    vector_add_c(drv.In(a), drv.In(b), drv.Out(c), np.int32(n),
                 block=(256, 1, 1), grid=((n + 255) // 256, 1))
    print("pycuda vector_add matches numpy:", np.allclose(c, a + b))
else:
    print(f"Not run: {why_not}. The CUDA C source it would compile:")
    print(VECTOR_ADD_CUDA_C)

# %% [markdown]
# Put side by side, the two kernels are the same program: `cuda.grid(1)` is
# `blockIdx.x * blockDim.x + threadIdx.x`, the guard is the same, and the launch
# `[blocks, threads]` is CUDA C's `<<<blocks, threads>>>`. `drv.In` and
# `drv.Out` do the copies in and out.
#
# ## Summary
#
# - A CPU spends its chip on a few strong cores; a GPU spends it on many simple
#   lanes and on keeping many warps resident to hide latency. A "CUDA core" is
#   one lane; the SM is the GPU's counterpart of a CPU core.
# - The host launches kernels on the device, which has its own memory: copy
#   inputs in, launch, copy results out (or keep data on the device). Host and
#   GPUs share one virtual address space, but `.to("cuda")` still copies into a
#   new allocation; only managed memory keeps its address while its pages
#   migrate.
# - A launch is a grid of blocks of threads, each up to 3-D; a block holds at
#   most 1024 threads, and big problems use more blocks. Round the block count
#   up and guard the index: out-of-bounds threads are silent bugs on a GPU.
#   The few idle threads rounding leaves cost little; pick a multiple of 32 for
#   the block size and enough blocks for every SM.
# - Threads run in warps of 32. A warp's memory request costs one 32-byte sector
#   per distinct sector it touches: neighbouring threads should read
#   neighbouring addresses (not "16 threads", as the seed says).
# - The model is SIMT: you write one thread, the hardware runs a warp of 32 in
#   lockstep. A branch costs extra only when it splits a warp; then both paths
#   run, as a CPU's SIMD code computes both sides of a per-element branch.
# - Bandwidth needs many loads in flight: a CPU core keeps some tens, a GPU
#   keeps thousands of threads resident. How many warps fit on an SM
#   (occupancy) is capped by its warp limit, its register file and its shared
#   memory, whichever runs out first.
# - Threads of a block cooperate through shared memory; a `syncthreads` must
#   separate writing from reading, and every thread must reach it (a block
#   sum is a tree of such steps).
# - Registers, shared memory, L2 and HBM trade size for speed, and the links
#   off the GPU (NVLink, PCIe) are slower still; a tiled kernel reuses data in
#   shared memory and moves far fewer sectors, as FlashAttention does for
#   attention.
# - SIMD on a CPU and warps on a GPU are the same idea at different scales;
#   Amdahl's law caps any parallel speed-up by the serial fraction.
#
# ## Exercises
#
# **Exercise 1.1 - the global index in a 2-D grid.** A kernel runs over a
# row-major matrix of width `width` with a 2-D grid of 2-D blocks. Return the
# flat index of the element that thread `thread_idx = (tx, ty)` of block
# `block_idx = (bx, by)` handles, for blocks of `block_dim = (bdx, bdy)`
# threads. x is the column, y the row.

# %% tags=["exercise"] exercise="1.1"
def global_index_2d(block_idx, thread_idx, block_dim, width):
    ### BEGIN SOLUTION
    col = block_idx[0] * block_dim[0] + thread_idx[0]
    row = block_idx[1] * block_dim[1] + thread_idx[1]
    return row * width + col
    ### END SOLUTION


# %% tags=["check"] exercise="1.1"
from course_utils.checks.ch01 import check_global_index_2d

check_global_index_2d(global_index_2d)

# %% [markdown]
# **Exercise 1.2 - a block sum in shared memory.** Summing an array is inside
# most kernels (a loss, a norm, a softmax's denominator), and a GPU does it in
# two levels: each block sums its own piece in shared memory, and a second,
# much smaller pass adds up the blocks' results. Write the first level:
# `block_sum(x, out)` is launched with `(n + THREADS - 1) // THREADS` blocks
# of `THREADS` threads over a float32 array `x` of n elements, and stores in
# `out[b]` the sum of block b's THREADS elements (elements past the end of `x`
# count as 0). Sum as a tree, so that the block needs log2(THREADS) steps, not
# THREADS:
#
# 1. each thread stores its element of `x` in a shared array of THREADS floats
#    (a thread past the end of `x` stores 0);
# 2. for stride = THREADS/2, THREADS/4, ..., 1: every thread whose index is
#    below the stride adds the element `stride` places after its own to its
#    own;
# 3. thread 0 writes the block's sum to `out[cuda.blockIdx.x]`.
#
# Threads read what other threads wrote, so a `cuda.syncthreads()` must
# separate each step from the next, and every thread of the block must reach
# every `syncthreads` (a thread that returns early leaves the others waiting
# for ever). The check runs your kernel on a simulator that takes a block's
# threads one at a time from barrier to barrier, and names any shared element
# that two threads touch between two barriers (a race), any read of shared
# memory nobody wrote, any index outside an array and any barrier some
# threads skip. It uses blocks of 32, 64 and 128 threads (it sets `THREADS`
# for each launch) and sizes that are and are not multiples of the block
# size; on a GPU the kernel also runs for real.

# %% tags=["exercise"] exercise="1.2"
THREADS = 128  # threads per block, a power of two


@cuda.jit
def block_sum(x, out):
    ### BEGIN SOLUTION
    partial = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + tid
    partial[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()  # every element is stored before anyone adds
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()  # this step's sums are written before the next reads
        stride //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = partial[0]
    ### END SOLUTION


# %% tags=["check"] exercise="1.2"
from course_utils.checks.ch01 import check_block_sum

check_block_sum(block_sum)

# %% [markdown]
# **Exercise 1.3 - from strided to coalesced.** `n_threads` threads copy
# `n_threads * per_thread` floats, each thread `per_thread` of them, in steps
# j = 0, 1, .... The version below gives each thread a contiguous chunk:
# thread t handles `t * per_thread + j` in step j. It looks tidy, but in each
# step neighbouring threads are `per_thread` floats apart, so the tracer counts
# up to 32 sectors per warp request:

# %%
def strided_element(t, j, n_threads, per_thread):
    return t * per_thread + j


strided = trace_sectors(
    lambda b, th: [strided_element(b[0] * 128 + th[0], j, 256, 8) for j in range(8)],
    grid=2, block=128)
print("strided:", strided)

# %% [markdown]
# Write `coalesced_element(t, j, n_threads, per_thread)` so that every element
# is still copied exactly once, and each warp request touches only 4 sectors.
# (In a kernel, this is the *grid-stride loop*.)

# %% tags=["exercise"] exercise="1.3"
def coalesced_element(t, j, n_threads, per_thread):
    ### BEGIN SOLUTION
    return j * n_threads + t
    ### END SOLUTION


# %% tags=["check"] exercise="1.3"
from course_utils.checks.ch01 import check_coalesced_element

check_coalesced_element(coalesced_element)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | host / device | 主机 / 设备 |
# | kernel | 核函数 |
# | thread / block / grid | 线程 / 线程块 / 网格 |
# | warp | 线程束 |
# | streaming multiprocessor (SM) | 流式多处理器 |
# | CUDA core (FP32 lane) | CUDA 核心（FP32 运算单元） |
# | SIMD lane | SIMD 通道 |
# | out-of-order execution / branch prediction | 乱序执行 / 分支预测 |
# | latency hiding | 延迟隐藏 |
# | shader / GPGPU | 着色器 / GPU 通用计算 |
# | unified virtual addressing (UVA) | 统一虚拟寻址 |
# | managed (unified) memory | 统一内存（托管内存） |
# | zero-copy (mapped pinned) memory | 零拷贝内存（映射的锁页内存） |
# | inter-process communication (IPC) | 进程间通信 |
# | bandwidth / shared-memory bank | 带宽 / 共享内存存储体（bank） |
# | coalesced access | 合并访存 |
# | sector / cache line | 扇区 / 缓存行 |
# | warp divergence | 线程束分化 |
# | shared memory | 共享内存 |
# | global memory (HBM) | 全局内存（高带宽显存） |
# | register | 寄存器 |
# | bounds guard | 边界检查 |
# | Amdahl's law | 阿姆达尔定律 |
# | SIMT (single instruction, multiple threads) | 单指令多线程 |
# | occupancy | 占用率 |
# | register file | 寄存器堆 |
# | memory-level parallelism (loads in flight) | 访存级并行 |
# | reduction | 归约 |
# | race condition | 竞争条件（数据竞争） |
# | barrier (`syncthreads`) | 屏障同步 |
