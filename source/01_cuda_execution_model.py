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
# Every PyTorch operator that runs on a GPU is a *kernel*: a function that
# thousands of GPU threads execute at once. How those threads are organised,
# and how they reach memory, decides how fast your code runs. In this chapter
# you write kernels yourself, in Python, with numba's `@cuda.jit`.
#
# **What you will learn**
#
# - How the host (CPU) and the device (GPU) share work: separate allocations,
#   copies in and out, kernel launches over a grid of blocks of threads.
# - How to give each thread its own element, with the bounds guard that keeps
#   threads inside the array (vector add, matrix multiply).
# - Why warps of 32 threads decide memory efficiency (coalescing) and the cost
#   of branches (divergence), counted with a memory-access tracer, and how many
#   warps an SM keeps (occupancy).
# - The memory hierarchy, and how shared memory cuts the traffic of a matmul.
# - Why a parallel speed-up is capped (Amdahl's law), measured here.
#
# **Hardware.** The kernels are written once. With a GPU they run on it.
# Without one, numba's *CUDA simulator* runs the same source on the CPU, one
# Python thread per GPU thread: slow, so sizes are tiny, but it checks indices
# and runs `syncthreads` like the hardware. What only a GPU shows (kernel
# timings, bandwidths) is then set beside labelled GPU figures, *published*
# (cited) or *predicted* (a model with its inputs). No GPU run of this chapter
# has been recorded yet; *recorded* figures appear after `make record` on a
# GPU.

# %% [markdown]
# Import `course_utils` **before** numba: it tells numba whether to use the GPU
# or the simulator, and numba reads that choice once, at its first import.

# %%
import functools
import multiprocessing as mp
import time
import warnings

import numpy as np
import torch

from course_utils import banner, bench, for_device, kernels, reference, try_gpu
from course_utils.bench import synchronize
from course_utils.compare import DISTURBED, compare
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
from numba import cuda, float32, float64, njit  # after course_utils
from numba.core.errors import NumbaPerformanceWarning

# tiny teaching grids leave a GPU idle, and NumPy arguments are copied at each
# launch: both intended here
warnings.simplefilter("ignore", NumbaPerformanceWarning)
warnings.filterwarnings("ignore", message="Grid size .* low occupancy")
warnings.filterwarnings("ignore", message="Host array used in CUDA kernel")

device = try_gpu()
on_gpu = device.type == "cuda"  # torch's operators run on a GPU
# numba's kernels run on the GPU only with its CUDA target installed (the banner
# says which): sizes and timings of kernels follow it
kernels_on_gpu = kernel_target() == "GPU"
torch.manual_seed(0)
rng = np.random.default_rng(0)
print("numba CUDA kernels run on:", kernel_target())

# %% [markdown]
# ## 1. Host and device
#
# ### Two ways to spend a chip
#
# A CPU core is built to finish *one* stream of instructions fast: large
# caches, out-of-order execution and branch prediction take much of its area,
# so a CPU has few cores. A GPU is built to finish as *many* independent
# pieces of work per second as it can. Its cores, the **streaming
# multiprocessors (SMs)**, drop out-of-order execution and branch prediction
# and spend the area on many simple arithmetic lanes and on a register file
# large enough to keep many warps resident, so that when one warp waits for
# memory another is ready (section 8).
#
# Two names need care. What NVIDIA calls a **CUDA core** is one 32-bit
# floating-point lane of an SM; it fetches no instructions of its own. The
# counterpart of a CPU core is the SM, and of a CUDA core one lane of a CPU's
# SIMD unit (section 9). And SM stands for *streaming* multiprocessor, not the
# seed's "Stream Multiprocessor".
#
# Counted in lanes: this machine's usable physical cores times the float32
# lanes of its widest SIMD instruction, against a GPU's SMs times its FP32
# lanes per SM (from the CUDA C++ Programming Guide's throughput table).
# Without a GPU the GPU side is the H100 SXM's published figures.

# %%
cpu_info = cpu_facts()
cpu_lanes = usable_physical_cores() * (cpu_info["simd_bits"] // 32)
print(f"CPU, {cpu_info['model']}: {usable_physical_cores()} usable physical cores x "
      f"{cpu_info['simd_bits'] // 32} float32 lanes ({cpu_info['simd']}) = "
      f"{cpu_lanes} lanes")
gpu = kernels.gpu_lanes(device, FP32_LANES_PER_SM)
if gpu["lanes_per_sm"]:
    lanes = gpu["sms"] * gpu["lanes_per_sm"]
    print(f"GPU, {gpu['name']}: {gpu['sms']} SMs x {gpu['lanes_per_sm']} FP32 lanes"
          f" = {lanes:,} lanes, {lanes / cpu_lanes:.0f}x this CPU's ({gpu['how']})")
else:
    print(f"GPU, {gpu['name']}: {gpu['sms']} SMs; its lanes per SM are not in the "
          f"table ({gpu['how']})")
print(f"threads resident at once: {cpu_info['usable_cores']} on the CPU, "
      f"{gpu['resident']:,} on the GPU")

# %% [markdown]
# A CPU lane runs at a higher clock, so lanes are not the whole story; the
# count shows the design: a GPU needs far more independent work to keep busy
# (Chapter 2 measures where the CPU wins).
#
# ### From graphics shaders to CUDA
#
# Before CUDA, general-purpose computing on GPUs (GPGPU) went through the
# graphics pipeline: data packed into textures, the computation written as a
# fragment shader (GLSL), results read back as pixels. **CUDA** (2007) exposed
# the hardware as a parallel processor programmed in an extension of C;
# **OpenCL** (2008) and the **compute shaders** of Direct3D 11 and OpenGL 4.3
# followed with the same model: kernels over a grid of threads. Today kernels
# are written in CUDA C++ (`nvcc`), or from Python with numba (this chapter) or
# Triton, which `torch.compile` generates. PyTorch's operators are C++/CUDA
# kernels in ATen (e.g. `aten/src/ATen/native/cuda/AbsKernel.cu`); matmuls and
# convolutions go to cuBLAS and cuDNN.
#
# ### Kernels, and copies in and out
#
# The **host** is the CPU with its RAM; it runs your Python. The **device** is
# the GPU with its own memory (HBM on data-centre GPUs), which kernels read and
# write. (Zero-copy host memory crosses the bus on every access; managed memory
# migrates pages on first touch: neither makes the bus faster.) So: **copy the
# inputs in**, **launch** the kernel, **copy the results out**. A launch names its
# shape in brackets, `kernel[blocks, threads_per_block](args)`, and each
# thread asks `cuda.grid(1)` for its global index,
# `blockIdx.x * blockDim.x + threadIdx.x`.

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
# On the simulator the device array wraps a NumPy array, so the same code
# runs. A NumPy array passed straight to a kernel is copied in and out around
# *every* launch; explicit copies keep data on the device between kernels, as
# PyTorch does with CUDA tensors.
#
# ### One address space, separate allocations
#
# **Claim** (seed): recent NVIDIA GPUs have virtual memory like a CPU's, so
# data moved into GPU memory keeps its address, pages migrate on page faults,
# and processes share data without copies.
# **What holds:**
#
# - **Unified virtual addressing** (UVA, CUDA 4.0, 64-bit programs): host
#   memory and every GPU's memory lie in *one* virtual address space, so an
#   address says which device owns it. It is about naming; no data move.
# - **Managed memory** (`cudaMallocManaged`, CUDA 6.0): one allocation used by
#   host and device at the same address, its pages migrated on demand through
#   page faults (compute capability 6.0 and later). Only for memory allocated
#   as managed.
# - **PyTorch tensors are not managed memory**: `.to("cuda")` *copies* into a
#   new allocation at a new address.
# - **CUDA IPC**: another process can map an existing GPU allocation without a
#   copy; `torch.multiprocessing` uses it to hand CUDA tensors over.
#
# `data_ptr()` shows which operations made a new allocation.

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
# Only `.to()` with nothing to do returns the same tensor. With a GPU the CUDA
# copy gets an address in the same unified space, but a different one: the
# data were copied, not re-mapped.
#
# ## 2. Grids of blocks of threads, and the 1024 limit
#
# Threads are grouped in **blocks**, and blocks in a **grid**, each up to
# three-dimensional (x, y, z). The threads of one block run on the same SM,
# can share fast on-chip memory and wait for each other
# (`cuda.syncthreads()`); different blocks cannot, and run in any order. A
# block holds **at most 1024 threads**, `x * y * z`, on every GPU since
# compute capability 2.0; a grid can have up to 2^31 - 1 blocks in x.
#
# Ask for 2048 threads in one block and a GPU refuses the launch
# (`CUDA_ERROR_INVALID_VALUE`, raised by numba as `CudaAPIError`). The
# simulator does **not** check this limit, so on the simulator the cell runs
# the launch to show that, then applies the hardware's rule itself.

# %%
MAX_THREADS_PER_BLOCK = (cuda.get_current_device().MAX_THREADS_PER_BLOCK
                         if kernels_on_gpu else 1024)


@cuda.jit
def fill_thread_ids(out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = i


def launch_fill(threads_per_block):
    out = cuda.to_device(np.zeros(threads_per_block, dtype=np.int32))
    fill_thread_ids[1, threads_per_block](out)
    cuda.synchronize()
    if not kernels_on_gpu:
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
for block in [(1024,), (32, 32), (16, 16, 4), (32, 32, 2)]:  # the product counts
    n = int(np.prod(block))
    print(f"block {str(block):14} = {n:5} threads  "
          f"{'ok' if n <= MAX_THREADS_PER_BLOCK else 'too many: launch fails'}")

# %% [markdown]
# The fix is always **more blocks**, not bigger ones.
#
# ## 3. The grid, drawn
#
# A kernel on a 2-D grid writes, for every thread, its `blockIdx`, its
# `threadIdx` and the global (x, y) it computes; the picture is drawn from
# what the kernel wrote.

# %%
@cuda.jit
def record_ids(block_id, thread_id, global_x, global_y):
    x, y = cuda.grid(2)  # x = blockIdx.x * blockDim.x + threadIdx.x, same for y
    if y < block_id.shape[0] and x < block_id.shape[1]:
        block_id[y, x] = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
        thread_id[y, x] = cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        global_x[y, x] = x
        global_y[y, x] = y


grid_shape, block_shape = (3, 2), (4, 3)  # (x, y): 3 x 2 blocks of 4 x 3 threads
H, W = grid_shape[1] * block_shape[1], grid_shape[0] * block_shape[0]
ids = [np.zeros((H, W), dtype=np.int32) for _ in range(4)]
record_ids[grid_shape, block_shape](*ids)
kernels.plot_grid_ids(*ids, grid_shape, block_shape)

# %% [markdown]
# Each coloured rectangle is a block. Inside it, threads are numbered with x
# fastest: t = `threadIdx.y * blockDim.x + threadIdx.x`. The hardware cuts
# each block into **warps** of 32 consecutive threads in exactly this order.
#
# ## 4. Vector add, and why the bounds guard is there
#
# One thread per output element. The element count is rarely a multiple of
# the block size, so the launch rounds the number of blocks **up**, and the
# `if i < c.size` guard sends the spare threads of the last block home.

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
# Without the guard the 24 spare threads write past the end of `c`. The
# simulator checks every index and raises an `IndexError`. **A GPU does not
# check**: the stray writes silently corrupt whatever follows the array, or
# crash later with an "illegal memory access" (`compute-sanitizer` finds such
# bugs). So the unguarded kernel runs only on the simulator.

# %%
@cuda.jit
def vector_add_unguarded(a, b, c):
    i = cuda.grid(1)
    c[i] = a[i] + b[i]  # no guard: threads 1000..1023 index past the end


if not kernels_on_gpu:
    try:
        vector_add_unguarded[blocks, threads](a, b, np.zeros(n, dtype=np.float32))
    except IndexError as e:
        print("the simulator stopped it:", e)
else:
    print("not run on a GPU: out-of-bounds writes are not checked there")

# %% [markdown]
# ### How big a block, and how many?
#
# **Claim** (seed): a launch with "too many" threads wastes threads that other
# kernels could have used. **Counted here:** rounding up leaves at most
# `threads - 1` spare threads, all in the last block, and each exits at the
# guard after a few instructions. **What matters instead:** a block size that
# is a **multiple of 32**, so every warp is full (a block of 100 threads runs
# as 4 warps, the last with idle lanes for the kernel's whole life; 128 to 256
# is usual), and **enough blocks** that every SM gets several (section 8).

# %%
for n_elements in (n, 1025, 10**6):
    launched = -(-n_elements // threads) * threads
    print(f"{n_elements:9,} elements, blocks of {threads}: "
          f"{launched - n_elements:3} idle threads of {launched:,} launched "
          f"({(launched - n_elements) / launched:.2%})")
print(f"a block of 100 threads: {-(-100 // 32)} warps, {-(-100 // 32) * 32 - 100} "
      "idle lanes in the last warp")

# %% [markdown]
# ## 5. Matrix multiply, one thread per output element
#
# For `C = A @ B`, thread (x, y) computes `C[y, x]`, the dot product of row y
# of A and column x of B.
#
# **Claim** (seed): put the whole matrix in one block, and the product takes
# "the time of one dot product", since all dot products run in parallel.
# **Why not:** a block holds at most 1024 threads (32 x 32), so real launches
# tile C over many blocks, as `launch_2d` does. And a GPU holds a fixed number
# of threads at once (section 1 printed it), so a large product runs in
# waves, each thread reading 2n numbers from memory: the time grows with the
# n^3 arithmetic and, for this naive kernel, with the memory traffic
# (section 8 counts it).

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


size = 1024 if kernels_on_gpu else 48
A = torch.randn(size, size)
B = torch.randn(size, size)
C = launch_2d(matmul_naive, A.numpy(), B.numpy())
torch.testing.assert_close(torch.from_numpy(C), A @ B, rtol=1e-4, atol=1e-4)
print(f"{size}x{size} naive matmul on the {kernel_target()} matches torch")

# %% [markdown]
# ## 6. Warps and memory coalescing
#
# The hardware runs threads in **warps of 32 consecutive threads** that issue
# each instruction together: **SIMT**, single instruction, multiple threads.
# You write one thread's program; the hardware runs 32 in lockstep, each with
# its own registers. What matters is where a load's 32 addresses fall (this
# section) and what a branch that splits them costs (section 7).
#
# A warp's load is served in **32-byte sectors** (compute capability 6.0 and
# later; a 128-byte cache line holds four). 32 threads reading 32 consecutive
# `float32` need 128 bytes = **4 sectors**: the access is *coalesced*. If each
# thread reads a float 8 elements after its neighbour's, each needs its own
# sector: 32 sectors, using 4 bytes of each.
#
# **Claim** (seed): the accesses of 16 neighbouring threads coalesce.
# **Why:** that was true of compute capability 1.x (2007-2009), which combined
# accesses per *half-warp*. Since Fermi it is the whole warp of 32, and what
# counts is how many distinct sectors its addresses touch.
#
# `course_utils.warps.trace_sectors` counts them without a GPU: it evaluates a
# kernel's **index expression**, written as a Python function of
# `(blockIdx, threadIdx)`, for every thread, groups threads into warps as the
# hardware does, and counts distinct sectors per warp request (addresses only:
# no caches, no timing). Here is a gather kernel, `out[i] = src[idx[i]]`, with
# four index arrays: the identity, strides of 2 and 8 floats (permutations
# that put neighbours that far apart), and a random permutation.

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
for name, idx in patterns.items():  # the kernel really computes the gather
    out = np.zeros(512, dtype=np.float32)
    gather[2, threads](src, idx[:512], out)
    assert np.array_equal(out, src[idx[:512]]), name


def gather_accesses(idx):  # the load of src[idx[i]], the one whose pattern varies
    def accesses(block, thread):
        i = block[0] * threads + thread[0]
        return [("src", int(idx[i]))] if i < len(idx) else []
    return accesses


for name, idx in patterns.items():
    trace = trace_sectors(gather_accesses(idx), grid=n_trace // threads, block=threads)
    print(f"{name:10} {trace}")

# %% [markdown]
# The coalesced load needs the minimum, 4 sectors per request; stride 2
# doubles it; at 8 floats or more each thread needs its own sector, 8 times
# the bytes used. Random indices come close to that.
#
# Does it cost time? `torch.take(src, idx)` launches the same
# one-thread-per-element gather, timed here for three patterns on this device
# (one thread, on a CPU). A CPU has the same problem with its 64-byte cache lines, so
# the CPU run is an honest analogue; beside it is the sector model's
# prediction for an H100 (`kernels.gather_prediction` says how).

# %%
n_bw = for_device(device, cpu=2**22, gpu=2**26)
src_t = torch.randn(n_bw, device=device)
bw_patterns = {
    "coalesced": torch.arange(n_bw, device=device),
    "stride 8": torch.from_numpy(strided_permutation(n_bw, 8)).to(device),
    "random": torch.randperm(n_bw, generator=torch.Generator().manual_seed(0)).to(device),
}
useful_bytes = n_bw * (4 + 8 + 4)  # read src (float32) and idx (int64), write out
gathers = compare({name: lambda idx=idx: (torch.take(src_t, idx), synchronize([device]))
                   for name, idx in bw_patterns.items()},
                  num_threads=for_device(device, cpu=1, gpu=None), min_run_s=0.1)
print(gathers)
bandwidth = {o.label: useful_bytes / o.median / 1e9 for o in gathers.options}
if on_gpu and not gathers.disturbed:
    reference.record("01.gather_bandwidth", bandwidth, "GB/s", device)
gpu_gather = kernels.gather_prediction()
shown = reference.show("01.gather_bandwidth", local=bandwidth, unit="GB/s",
                       local_device=device, figures=[gpu_gather])
here = bandwidth["coalesced"] / bandwidth["random"]
gpu_ratio = gpu_gather.value["coalesced"] / gpu_gather.value["random"]
print(f"coalesced / random: {here:.2f}x here, {gpu_ratio:.2f}x predicted for the GPU")
print("verdict: " + (DISTURBED if gathers.disturbed else
                     f"scattered reads cost {here:.1f}x here" if here >= 1.2 else
                     "the random gather was not clearly slower here"))
kernels.plot_gather(shown, n_bw)

# %% [markdown]
# The right-hand bars are the lesson: a scattered gather moves 44 bytes per 16
# used on a GPU, about 2.75x slower - not 8x, as the index and the output stay
# coalesced. This CPU's 64-byte lines and stride prefetcher make its gap larger
# or smaller.
#
# ## 7. Divergence: when threads of a warp disagree
#
# A warp issues one instruction for all 32 threads. At a branch where some
# threads go one way and some the other, it runs **both** paths, each with the
# other path's threads switched off.
#
# **Claim** (seed): "branches can be very inefficient", and 32 neighbouring
# threads "can only execute the same instruction". **Why that needs care:**
# only branches that split a warp cost extra - a branch on `i % 2` splits
# every warp, the same work branched on `(i // 32) % 2` splits none. And since
# Volta (compute capability 7.0) each thread has its own program counter, so
# the two paths of a split warp may interleave, but each cycle still issues
# one instruction for the threads on one path.

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
    print(f"branch on {'(i // 32) % 2' if by_warp else 'i % 2':13}: "
          f"{div} of {total} warps diverge")

# %% [markdown]
# On a GPU the next cell times both layouts (CUDA events, median of repeated
# launches after a warm-up): look for the divergent one to take about twice
# as long. The simulator has no warps, so there it only checks that both
# layouts compute the same values.

# %%
n_div = 2**22 if kernels_on_gpu else 512
steps = 2000 if kernels_on_gpu else 4
results = {}
for by_warp in (False, True):
    out = cuda.to_device(np.ones(n_div, dtype=np.float32))
    launch = functools.partial(two_paths[(n_div + 255) // 256, 256], out, by_warp, steps)
    key = "by warp" if by_warp else "by parity"
    if kernels_on_gpu:
        results[key] = kernels.time_kernel(launch)
    else:
        launch()
        results[key] = out.copy_to_host()
gpu_div = None
if kernels_on_gpu:
    gpu_div = results["by parity"] / results["by warp"]
    print(f"divergent (i % 2) / by warp: {gpu_div:.2f}x")
    reference.record("01.divergence_ratio", gpu_div, "x", device)
else:
    print("both layouts give the same values:",
          np.array_equal(np.sort(results["by parity"]), np.sort(results["by warp"])))

# %% [markdown]
# A CPU's SIMD lanes cannot branch either. With one branch per element,
# vectorised code computes **both** paths for every element and keeps one per
# lane (`torch.where`, or masked instructions): the split warp. When whole
# groups take one path, each path runs on its own elements only: the
# warp-sized layout. The cell times both on one thread.

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
even = torch.arange(x_div.numel()) % 2 == 0
divergence = compare({fn.__name__: lambda fn=fn: fn(x_div, even, 8)
                     for fn in (branch_per_element, branch_per_group)},
                    repeats=3, min_run_s=0.05, num_threads=1)
print(divergence)
cpu_ratio = divergence.ratio
print(f"one branch per element / per group of 32: {cpu_ratio:.2f}x")
print("verdict: " + (DISTURBED if divergence.disturbed else
                     "both paths ran for every element, as in a split warp"
                     if cpu_ratio > 1.4 else "no clear cost here"))
kernels.show_divergence(cpu_ratio, gpu_div, device)

# %% [markdown]
# ## 8. The memory hierarchy
#
# From fastest and smallest to slowest and largest: **registers** (private to
# a thread); **shared memory** (in the same on-chip storage as the L1 cache,
# shared by a block's threads, managed by the kernel); the **L2 cache**
# (shared by all SMs); **global memory** (HBM), with a latency of hundreds of
# cycles, hidden by having many warps in flight. With a GPU the next cell
# prints what torch and numba report; without one, the H100 SXM's published
# figures.

# %%
kernels.print_memory_facts(device)

# %% [markdown]
# ### How fast each level is
#
# Shared memory has 32 banks that each deliver 4 bytes per clock, so an SM
# serves a warp's 32-bit loads in one clock when no two threads hit the same
# bank; times the SMs and the clock, that is the whole GPU's shared-memory
# bandwidth. NVIDIA publishes none for L2 or registers. Off the GPU, links are
# far slower: PCIe to the host, NVLink to other GPUs.

# %%
def shared_memory_bandwidth(n_sms, clock_hz):
    return n_sms * 32 * 4 * clock_hz  # SMs x 32 banks x 4 bytes x clocks per second


levels = kernels.print_bandwidth_levels()
a100_smem = shared_memory_bandwidth(kernels.published_value("a100.sm_count"),
                                    kernels.published_value("a100.boost_clock_mhz", 1e6))
a100_hbm = kernels.published_value("a100_sxm_80gb.memory_bandwidth_gbps", 1e9)
print(f"HBM / PCIe on an H100: "
      f"{levels['HBM3'] / levels['PCIe Gen5 x16, to the host']:.0f}x; "
      f"shared memory / HBM on an A100: {a100_smem / a100_hbm:.0f}x "
      "(computed from published SM count, clock and bandwidth)")
smem_bw = None
if on_gpu:
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "clock_rate", 0) or (
        cuda.get_current_device().CLOCK_RATE if kernels_on_gpu else 0)
    if clock_khz:
        smem_bw = shared_memory_bandwidth(props.multi_processor_count, clock_khz * 1e3)
        print(f"this GPU, {props.name}: {smem_bw / 1e12:.1f} TB/s of shared memory "
              "(computed from its probed SM count and clock)")
        reference.record("01.shared_memory_bandwidth", smem_bw / 1e12, "TB/s", device)
_ = reference.show(
    "01.shared_memory_bandwidth", unit="TB/s",
    figures=[reference.predicted(
        a100_smem / 1e12, "TB/s", "NVIDIA A100",
        "SMs x 32 banks x 4 bytes x boost clock: a peak, uncalibrated",
        ["a100.sm_count", "a100.boost_clock_mhz"])])

# %% [markdown]
# Each step outwards costs an order of magnitude or more of bandwidth: keep
# tensors on the GPU, and reuse data in shared memory (the tiled matmul below).
#
# ### Hiding latency with many loads in flight
#
# A warp waiting for an HBM load does nothing; the SM switches to another
# ready warp, for free, since every resident warp keeps its registers on chip.
# Bandwidth is then bytes *in flight* / latency (Little's law), so it needs
# many warps in flight.
#
# A CPU core does the same on a smaller scale: its out-of-order engine keeps
# several cache misses outstanding. The cell follows pointers through a random
# cycle in a 64 MiB table, compiled with numba's `@njit`: one chain keeps one
# load in flight, k independent chains up to k.

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
loads, chains = 2**17, [1, 2, 4, 8, 16, 32, 64]


def chase(table, order, k):
    starts = order[np.arange(k) * (n_chase // k)]
    return lambda: follow_chains(table, starts, loads // k)


loads_per_s = [loads / min(bench(chase(next_index, cycle, k), min_run_time=0.02).times)
               for k in chains]
for k, rate in zip(chains, loads_per_s, strict=True):
    print(f"{k:3} chains: {1e9 / rate:6.1f} ns per load, {rate / 1e6:6.1f} M loads/s")
print(compare({f"{k} chain{'s' if k > 1 else ''}": chase(next_index, cycle, k)
               for k in (1, 16)}, repeats=3))

# %% [markdown]
# Look for the time per load to fall almost in proportion to the chains, then
# level off when the core's buffers for outstanding misses are full (some
# tens). A GPU plays the same game with thousands of threads. A **grid-stride
# loop** lets any number of blocks do the same work: thread i handles element
# i, then i + (all threads of the grid), and so on (you write one in Exercise
# 1.1). On a GPU the cell copies 64 MiB with such a loop for a growing number
# of blocks of 256 threads: look for the bandwidth to climb until there are
# several blocks per SM, then level off towards the HBM peak.

# %%
hbm_peak = reference.published("h100_sxm.memory_bandwidth_gbps")
blocks_curve = kernels.copy_bandwidth_vs_blocks() if kernels_on_gpu else None
if kernels_on_gpu:
    reference.record("01.copy_bandwidth_vs_blocks", blocks_curve, "GB/s", device)
lat_shown = reference.show("01.copy_bandwidth_vs_blocks", unit="GB/s",
                           local_device=device, local=blocks_curve, figures=[hbm_peak])
kernels.plot_loads_in_flight(chains, loads_per_s,
                             [f for f in lat_shown if isinstance(f.value, dict)],
                             hbm_peak)
del next_index, cycle

# %% [markdown]
# The hierarchy shows on either device when you copy a buffer of growing size:
# fast while source and copy fit in a cache, then down to what RAM or HBM
# delivers. Look for the step down on the right (on a GPU the smallest copies
# are held back by the launch cost, so its curve first rises). The CPU copy
# runs on one thread: one core's caches.

# %%
def copy_bandwidth(n_bytes, on=device):
    x = torch.empty(n_bytes // 4, dtype=torch.float32, device=on).fill_(1.0)
    y = torch.empty_like(x)
    timing = bench(y.copy_, x, min_run_time=0.03,
                   num_threads=for_device(on, cpu=1, gpu=None))
    return 2 * n_bytes / min(timing.times) / 1e9  # read x and write y


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
kernels.plot_copy_curve(reference.show("01.copy_bandwidth_vs_size", local=copy_curve,
                                       unit="GB/s", local_device=device,
                                       figures=[hbm_peak]), hbm_peak)
best = int(np.argmax(bw_curve))
print(f"peak {bw_curve[best]:.0f} GB/s at {sizes[best] // 2**20} MiB buffers, "
      f"{bw_curve[best] / bw_curve[-1]:.1f}x the {bw_curve[-1]:.0f} GB/s of the "
      f"largest ({sizes[-1] // 2**20} MiB)")

# %% [markdown]
# ### A figure to correct
#
# **Claim** (seed): the hierarchy picture from the FlashAttention paper, for an
# A100: on-chip SRAM 19 TB/s, HBM 1.5 TB/s, "CPU DRAM" 12.8 GB/s.
# **Checked here:** the first two fit the A100's published figures. The third
# is the peak of **one DDR3-1600 module** (the memory of a 2012 desktop); one
# thread copying on this machine may beat it (the cell reuses the sweep's
# largest buffer, or measures one on the host with a GPU), and a server
# socket of the A100's generation drives eight memory channels at once.
# **Why it matters:** what limits a GPU reading host memory is neither figure
# but the **PCIe link**.

# %%
paper = {k: reference.published(f"flashattention_2022.{k}") for k in (
    "sram_bandwidth_tbps", "hbm_bandwidth_tbps", "cpu_dram_bandwidth_gbps")}
host_copy = bw_curve[-1] if not on_gpu else copy_bandwidth(2**27, on="cpu")
print(f"FlashAttention's figures ({paper['sram_bandwidth_tbps'].source}):")
print(f"  SRAM {paper['sram_bandwidth_tbps'].value} TB/s: A100 SMs x 32 x 4 B x boost "
      f"clock = {a100_smem / 1e12:.1f} TB/s (computed from published figures)")
print(f"  HBM {paper['hbm_bandwidth_tbps'].value} TB/s: A100 40GB datasheet "
      f"{kernels.published_value('a100_sxm_40gb.memory_bandwidth_gbps') / 1e3:.3f} TB/s")
for key, label in [("ddr3_1600.module_peak_bandwidth_gbps", "one DDR3-1600 module"),
                   ("pcie4_x16.bandwidth_per_direction_gbps",
                    "PCIe Gen4 x16, each direction: the real bottleneck")]:
    f = reference.published(key)
    print(f"  DRAM {paper['cpu_dram_bandwidth_gbps'].value} GB/s vs {label}: "
          f"{f.value} GB/s (published)")
print(f"  one thread copying here: {host_copy:.1f} GB/s (measured); a server socket "
      f"of the A100's generation: "
      f"{kernels.published_value('epyc_7002.memory_channels'):.0f} DDR4 channels")

# %% [markdown]
# ### Shared memory: a tiled matrix multiply
#
# In the naive matmul every thread reads a whole row of A and a whole column of
# B from global memory, so each element is fetched n times. In a tiled kernel
# the threads of a block cooperate: each loads **one** element of a
# TILE x TILE piece of A and one of B into shared memory, the block waits at
# `cuda.syncthreads()`, then every thread reads its TILE products from shared
# memory. Global traffic falls by about TILE. FlashAttention rests on the same
# idea: attention is computed tile by tile in shared memory, so the n x n
# score matrix never goes to HBM.

# %%
TILE = 16


@cuda.jit
def matmul_tiled(A, B, C):
    a_tile = cuda.shared.array((TILE, TILE), dtype=float32)
    b_tile = cuda.shared.array((TILE, TILE), dtype=float32)
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
# expressions, at a small size.

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
print(f"naive: {naive_trace}\ntiled: {tiled_trace}")
print(f"the tiled kernel issues {naive_trace.requests / tiled_trace.requests:.1f}x fewer "
      f"requests and moves {naive_trace.total_sectors / tiled_trace.total_sectors:.1f}x"
      f" fewer sectors (TILE = {TILE})")

# %% [markdown]
# The tiled kernel issues a request per *tile* of k instead of per k, about
# TILE times fewer; the sector saving is smaller, as the naive kernel's A loads
# touch only 2 sectors (a warp covers two rows of C), and on a GPU caches catch
# part of its repeats. On a GPU the next cell times
# both kernels and cuBLAS (`torch.matmul`); everywhere it shows the roofline
# floor for an H100 (no fp32 kernel beats the FP32 peak).

# %%
n_mm = 2048
times = (kernels.time_matmuls({"naive": matmul_naive, "tiled": matmul_tiled}, TILE,
                              device, n_mm) if kernels_on_gpu else None)
if kernels_on_gpu:
    reference.record("01.matmul_2048_ms", times, "ms", device)
for f in reference.show("01.matmul_2048_ms", unit="ms", local_device=device,
                        local=times, figures=[kernels.matmul_floor(n_mm)]):
    for k, v in f.value.items():
        print(f"    {k:20} {v:8.3f} ms  {2 * n_mm**3 / (v / 1e3) / 1e12:6.1f} TFLOP/s")

# %% [markdown]
# ### Occupancy: how many warps fit on an SM
#
# Latency hiding needs warps *resident* on the SM. How many fit is set by
# whichever runs out first: the SM's warp limit; **registers** (R per thread
# fit registers-per-SM / R threads); **shared memory** (S bytes per block fit
# shared-per-SM / S blocks). Blocks are resident whole. **Occupancy** is
# resident warps over the limit, computed here from the H100's published
# figures (real allocation also rounds to granules: see Nsight Compute's
# occupancy calculator).

# %%
h100 = {k: reference.published(f"h100_sxm.{k}") for k in (
    "max_resident_warps_per_sm", "register_file_per_sm_kb", "shared_memory_per_sm_kb")}
max_warps = h100["max_resident_warps_per_sm"].value
registers_per_sm = h100["register_file_per_sm_kb"].value * 1024 // 4  # 32-bit each
shared_per_sm = h100["shared_memory_per_sm_kb"].value * 1024


def occupancy(threads_per_block, registers_per_thread, shared_per_block,
              sm=(max_warps, registers_per_sm, shared_per_sm)):
    """Resident warps per SM (an H100's by default), and which limit binds."""
    warps, registers, shared = sm  # no rounding to granules
    warps_per_block = -(-threads_per_block // 32)
    limits = {
        "warps": warps // warps_per_block,
        "registers": registers // (registers_per_thread * threads_per_block),
        "shared memory": shared // shared_per_block if shared_per_block else warps,
    }
    return min(limits.values()) * warps_per_block, min(limits, key=limits.get)


kernel_shapes = [  # (what, threads per block, registers per thread, shared bytes)
    ("a light elementwise kernel", 256, 32, 0),
    ("a heavy kernel, 128 registers", 256, 128, 0),
    ("this chapter's tiled matmul", TILE * TILE, 32, 2 * TILE * TILE * 4),
    ("a block with 120 KiB of shared memory", 256, 32, 120 * 1024),
]
print(f"H100 SXM per SM (published): {max_warps} warps, {registers_per_sm:,} "
      f"registers, {shared_per_sm // 1024} KB shared memory")
for what, tpb, regs, smem in kernel_shapes:
    warps, limiter = occupancy(tpb, regs, smem)
    print(f"{what:38} {tpb:4} threads {regs:4} regs {smem // 1024:4} KiB: {warps:3} "
          f"warps, occupancy {warps / max_warps:4.0%}, limited by {limiter}")
if kernels_on_gpu:  # registers compiled for this GPU: judged by its own limits
    dev = cuda.get_current_device()
    here = (dev.MAX_THREADS_PER_MULTI_PROCESSOR // 32,
            dev.MAX_REGISTERS_PER_MULTIPROCESSOR,
            dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
    for types, regs in matmul_tiled.get_regs_per_thread().items():
        warps, limiter = occupancy(TILE * TILE, regs, 2 * TILE * TILE * 4, here)
        print(f"numba compiled matmul_tiled{types} for this GPU to {regs} registers "
              f"per thread: {warps} of its {here[0]} warps per SM, limited by "
              f"{limiter}")
print("sources:", "; ".join(sorted({reference.cite(f.extra) for f in h100.values()})))

# %% [markdown]
# ## 9. SIMD on the CPU, for contrast
#
# One **SIMD** instruction (single instruction, multiple data) adds 4, 8 or 16
# floats at once, depending on the register width. A Python loop cannot use
# it - each `+` goes through the interpreter; NumPy's add is a compiled loop
# that does.

# %%
print(f"this CPU: {cpu_info['model']}, widest SIMD {cpu_info['simd']} = "
      f"{cpu_info['simd_bits'] // 32} float32 per instruction")
n_simd = max(1024, kernels.l2_cache_bytes() // 4 // 12)  # x, y, out in 1/4 of L2
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
t_numpy = fastest(np.add, xs, ys, out=out_simd)
ns_loop, ns_numpy = t_loop / n_simd * 1e9, t_numpy / n_simd * 1e9
ghz = (cpu_info["clock_mhz"] or 0) / 1e3
print(f"{n_simd:,} floats, x + y: numpy is {t_loop / t_numpy:.0f}x faster than the "
      f"loop; per element python {ns_loop:.1f} ns, numpy {ns_numpy:.3f} ns")
if ghz:
    cycles = ns_numpy * ghz
    print(f"= {ns_loop * ghz:.0f} and {cycles:.2f} clock cycles at {ghz:.1f} GHz")
    print("verdict: " + (f"numpy needs {cycles:.2f} cycles per element: several "
                         "elements per instruction, SIMD at work" if cycles < 1 else
                         f"numpy needed {cycles:.2f} cycles per element here, so this "
                         "run cannot show SIMD (a busy machine?) - run it again"))

# %% [markdown]
# The loop spends tens to hundreds of cycles per element: that is the
# interpreter. Less than one cycle per element means several elements per
# instruction: SIMD.
#
# **Claim** (seed): an SSE add (4 floats per instruction) is only 18-24%
# faster than a plain C loop. **Why:** compilers already vectorise the plain
# loop (GCC at `-O3`, clang at `-O2`), and vectors of 10^5 to 5 x 10^7 floats
# live in RAM, where the add waits for memory. **Measured here:** numpy's add
# per element in L2 (above) and far beyond the caches. (The seed's SSE loop
# also steps by 4 with no tail: for n not a multiple of 4 it runs past the
# arrays, the CPU cousin of a kernel without its bounds guard.)

# %%
n_ram = 2**24  # 64 MiB per array: far beyond the caches
xr, yr = np.ones(n_ram, dtype=np.float32), np.ones(n_ram, dtype=np.float32)
out_ram = np.empty_like(xr)
t_ram = fastest(np.add, xr, yr, out=out_ram)  # like with like: out= in both
ns_ram = t_ram / n_ram * 1e9
print(f"numpy add per element: {ns_numpy:.3f} ns in L2, {ns_ram:.3f} ns in RAM "
      f"({ns_ram / ns_numpy:.1f}x); the RAM-sized add moves "
      f"{3 * 4 * n_ram / t_ram / 1e9:.1f} GB/s")
print("verdict: " + ("out of the caches the add waits for memory, as the seed's "
                     "large vectors did" if ns_ram > 1.3 * ns_numpy else
                     "no clear gap in this run (a busy machine?) - run it again"))
del xr, yr, out_ram

# %% [markdown]
# A warp is 32 lanes running one instruction, like a SIMD unit, but the
# program is written for one thread and each lane may branch (at the cost of
# divergence): SIMD is visible in the code, SIMT is the hardware's business.
#
# ## 10. Amdahl's law
#
# If a fraction p of a program's work can be parallelised and the rest cannot,
# n processors give at best
#
# $$ S(n) = \frac{1}{(1 - p) + p / n}, \qquad \lim_{n \to \infty} S(n) = \frac{1}{1-p}. $$
#
# The serial part is the barrel's shortest stave (the seed's image): with
# p = 0.95 no number of processors beats 20x. Drag the sliders in a live
# notebook.

# %%
def amdahl(p, n):
    return 1.0 / ((1.0 - p) + p / n)


amdahl_plot = kernels.amdahl_slider(amdahl)

# %% [markdown]
# Now a measured point. The job has a serial part (in the parent process) and
# a parallel part (pure-Python arithmetic in equal chunks over worker
# processes; processes, because the GIL lets one thread run Python at a time:
# Chapter 4). The one- and two-worker runs alternate through the course's
# comparison protocol, which says "disturbed" when other programs used the
# cores meanwhile; p comes from the one-worker runs.

# %%
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
    # .get(timeout) so that a lost worker cannot hang the cell
    pool.map_async(burn, [chunk] * workers, chunksize=1).get(timeout=120)
    return t1 - t0, time.perf_counter() - t1


serial_iters, parallel_iters = 300_000, 2_700_000
if "fork" in mp.get_all_start_methods():
    runs = {1: [], 2: []}
    with mp.get_context("fork").Pool(2) as pool:
        pool.map_async(burn, [1000, 1000]).get(timeout=60)  # start the workers first
        result = compare({f"{w} worker{'s' if w > 1 else ''}": lambda w=w: runs[w].append(
            run_job(w, serial_iters, parallel_iters, pool)) for w in (1, 2)},
            repeats=4, warmup=0)
    one = sorted(runs[1], key=sum)[len(runs[1]) // 2]  # a run of median length
    p_measured = one[1] / sum(one)
    bound = amdahl(p_measured, 2)
    print(result)
    print(f"parallel fraction p = {p_measured:.2f} -> Amdahl's bound {bound:.2f}x; "
          f"measured {result.ratio:.2f}x (medians)")
    if result.outcome != "disturbed" and result.ratio > 1.05 * bound:
        print("but above the bound, which Amdahl's law forbids: the runs were "
              "disturbed after all - run it again")
    kernels.plot_amdahl_measured(amdahl, p_measured, result.ratio)
else:
    print("this platform has no 'fork' start method; run the chapter on Linux to measure")

# %% [markdown]
# On an idle machine the point lies a little below the prediction (handing
# work to the pool is more serial work); a busy machine pushes it further down,
# and the verdict says so. Amdahl's law is an upper bound.
#
# ## 11. The same kernel in CUDA C, through pycuda
#
# The classic alternative to numba is a kernel in CUDA C, compiled at run time
# by pycuda's `SourceModule` (which calls `nvcc`). It needs a GPU, the CUDA
# toolkit and pycuda (`requirements-gpu.txt`); `kernels.run_cuda_c_vector_add`
# compiles and runs it, or says why it could not.

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
print(kernels.run_cuda_c_vector_add(VECTOR_ADD_CUDA_C))
print(VECTOR_ADD_CUDA_C)

# %% [markdown]
# The two kernels are the same program: `cuda.grid(1)` is
# `blockIdx.x * blockDim.x + threadIdx.x`, the guard is the same, and the
# launch `[blocks, threads]` is CUDA C's `<<<blocks, threads>>>`; pycuda's
# `drv.In` and `drv.Out` do the copies in and out.
#
# ## Summary
#
# - A GPU spends its chip on many simple lanes and resident warps. A "CUDA
#   core" is one lane; the SM is the counterpart of a CPU core.
# - The host launches kernels on the device, which has its own memory: copy
#   in, launch, copy out (or keep data on the device). One virtual address
#   space does not make `.to("cuda")` stop copying; only managed memory keeps
#   its address while pages migrate.
# - A launch is a grid of blocks of threads, up to 3-D; a block holds at most
#   1024 threads. Round the block count up and guard the index: out-of-bounds
#   threads are silent bugs on a GPU. Use block sizes that are multiples of 32
#   and enough blocks for every SM.
# - Threads run in warps of 32 (SIMT). A warp request costs one 32-byte sector
#   per distinct sector touched: neighbouring threads should read neighbouring
#   addresses (a warp, not the seed's 16 threads). A branch costs extra only
#   when it splits a warp.
# - Bandwidth needs many loads in flight; occupancy is capped by the warp
#   limit, registers or shared memory, whichever runs out first.
# - Registers, shared memory, L2 and HBM trade size for speed; links off the
#   GPU are slower still. A tiled kernel reuses data in shared memory.
# - SIMD and warps are one idea at two scales; Amdahl's law caps a speed-up.
#
# ## Exercises
#
# Each exercise is a kernel. The check runs it on a simulator that names
# indices outside an array, shared-memory races and skipped barriers, and
# counts each warp request's sectors (section 6); on a GPU the kernel also runs.
#
# **Exercise 1.1 - a grid-stride loop.** Write `axpy(a, x, y, out)`, which
# sets `out[i] = a * x[i] + y[i]` for every i of the 1-D arrays, correctly for
# **any** launch: a grid with fewer threads than elements (each thread handles
# several) or with more (some handle none). Use a grid-stride loop (section
# 8): start at the thread's global index and step by the number of threads in
# the whole grid, so that in every step the threads of a warp touch
# neighbouring elements (coalesced). The check launches 1 to 4 blocks of 32 or
# 64 threads over 1 to 1000 float32 and float64 elements (compute in the
# arrays' own type), and wants each element written once, `x` and `y` kept,
# and coalesced requests.

# %% tags=["exercise"] exercise="1.1"
@cuda.jit
def axpy(a, x, y, out):
    ### BEGIN SOLUTION
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, x.size, stride):
        out[i] = a * x[i] + y[i]
    ### END SOLUTION


# %% tags=["check"] exercise="1.1"
from course_utils.checks.ch01 import check_axpy

check_axpy(axpy)

# %% [markdown]
# **Exercise 1.2 - a block sum in shared memory.** A GPU sums an array in two
# levels: each block sums its piece in shared memory, then a small pass adds
# the blocks' results. Write the first level: `block_sum(x, out)`
# is launched with `(n + THREADS - 1) // THREADS` blocks of `THREADS` threads
# over a float32 array `x` of n elements, and stores in `out[b]` the sum of
# block b's THREADS elements (elements past the end count as 0). Sum as a
# tree, in log2(THREADS) steps:
#
# 1. each thread stores its element of `x` in a shared array of THREADS floats
#    (a thread past the end of `x` stores 0);
# 2. for stride = THREADS/2, THREADS/4, ..., 1: every thread whose index is
#    below the stride adds the element `stride` places after its own to its
#    own;
# 3. thread 0 writes the block's sum to `out[cuda.blockIdx.x]`.
#
# A `cuda.syncthreads()` must separate each step from the next, and every
# thread must reach every `syncthreads` (one that returns early leaves the
# others waiting for ever). The check uses blocks of 32, 64 and 128 threads (it
# sets `THREADS` for each launch) and sizes that are and are not multiples of
# the block size.

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
# **Exercise 1.3 - a coalesced transpose.** `out = a.T` one thread per
# element, `out[x, y] = a[y, x]`, reads `a` along rows (coalesced) but writes
# `out` down a column: each thread of a warp in its own sector. Write
# `transpose(a, out)` so that **both** the reads and the writes are coalesced,
# by turning the corner in shared memory. It is launched over TILE x TILE
# blocks (`TILE` of section 8), on a grid of
# `(ceil(a.shape[1] / TILE), ceil(a.shape[0] / TILE))` blocks:
#
# 1. block (bx, by) loads the tile of `a` at rows `by * TILE ...`, columns
#    `bx * TILE ...` into a shared `TILE x TILE` array, thread (tx, ty)
#    reading `a[by * TILE + ty, bx * TILE + tx]` (neighbouring tx, neighbouring
#    columns);
# 2. after a barrier, the block writes that tile, transposed, to `out` at rows
#    `bx * TILE ...`, columns `by * TILE ...`, again with neighbouring tx
#    writing neighbouring columns - so thread (tx, ty) writes the element
#    another thread loaded.
#
# Guard both steps (sides need not be multiples of TILE) and let every thread
# reach the barrier. The check sets TILE to 8 and 16, uses square and
# rectangular float32 and float64 matrices (a `float64` tile holds both
# exactly), and counts the sectors of every read and write request.

# %% tags=["exercise"] exercise="1.3"
@cuda.jit
def transpose(a, out):
    ### BEGIN SOLUTION
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row, col = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if row < a.shape[0] and col < a.shape[1]:
        tile[ty, tx] = a[row, col]
    cuda.syncthreads()  # the tile is complete before threads read across it
    row, col = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if row < out.shape[0] and col < out.shape[1]:
        out[row, col] = tile[tx, ty]
    ### END SOLUTION


# %% tags=["check"] exercise="1.3"
from course_utils.checks.ch01 import check_transpose

check_transpose(transpose)

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
# | unified virtual addressing (UVA) | 统一虚拟寻址 |
# | managed (unified) memory | 统一内存（托管内存） |
# | coalesced access | 合并访存 |
# | sector / cache line | 扇区 / 缓存行 |
# | warp divergence | 线程束分化 |
# | shared memory / bank | 共享内存 / 存储体 |
# | global memory (HBM) | 全局内存（高带宽显存） |
# | register / register file | 寄存器 / 寄存器堆 |
# | bounds guard | 边界检查 |
# | grid-stride loop | 网格跨步循环 |
# | transpose | 转置 |
# | SIMT (single instruction, multiple threads) | 单指令多线程 |
# | occupancy | 占用率 |
# | latency hiding | 延迟隐藏 |
# | reduction | 归约 |
# | race condition | 竞争条件（数据竞争） |
# | barrier (`syncthreads`) | 屏障同步 |
# | Amdahl's law | 阿姆达尔定律 |
