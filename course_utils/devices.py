"""What this machine has: CPUs, GPUs, memory, and which device to use.

Introduced in Chapter 0 ("Setup and devices"). Every chapter prints
``banner()`` first, so a learner always knows whether a cell ran on a GPU, on
the CPU, or shows a reference result recorded elsewhere.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import sys

import torch

from course_utils.errors import DoesNotFit

# Share of the free memory a single tensor may take before check_fits refuses:
# the rest is left for the kernel, the allocator's slack and the operating system.
FIT_FRACTION = 0.8

# 32-bit floating-point lanes ("CUDA cores") per SM, by compute capability: the
# per-clock throughput of fp32 add, multiply and multiply-add in the CUDA C++
# Programming Guide ("Arithmetic Instructions"). Chapters 1 and 2.
FP32_LANES_PER_SM = {
    (6, 0): 64, (6, 1): 128, (6, 2): 128, (7, 0): 64, (7, 2): 64, (7, 5): 64,
    (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128,
    (10, 0): 128, (12, 0): 128,
}


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, as memory is sized). Chapter 0."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gpu_count() -> int:
    """How many CUDA GPUs torch can use (0 without a GPU). Chapter 0."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def try_gpu(i: int = 0) -> torch.device:
    """GPU ``i`` if it exists, else the CPU, saying so in one line. Chapter 0.

    Unlike ``torch.device(f"cuda:{i}")`` this never fails later with an
    "invalid device ordinal": code written with it runs on any machine.
    """
    n = gpu_count()
    if i < n:
        return torch.device(f"cuda:{i}")
    if i > 0 or n > 0:
        print(
            f"try_gpu({i}): this machine has {n} GPU(s), so there is no GPU {i};"
            " using the CPU."
        )
    return torch.device("cpu")


def try_all_gpus() -> list[torch.device]:
    """Every GPU, or ``[cpu]`` when there is none: never an empty list. Chapter 0."""
    n = gpu_count()
    return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]


def for_device(device: torch.device | str, cpu, gpu):
    """Pick a size (or anything) by device type: ``cpu`` on a CPU, else ``gpu``.

    Chapters use it to keep CPU runs short and GPU runs realistic. Chapter 0.
    """
    return cpu if torch.device(device).type == "cpu" else gpu


def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (empty off Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            block = f.read().split("\n\n")[0]
    except OSError:
        return {}
    pairs = (line.split(":", 1) for line in block.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def cpu_quota() -> float | None:
    """Cores' worth of CPU time the cgroup allows this process, if it is capped.

    Containers and job schedulers often cap CPU time (``docker --cpus=2``,
    Kubernetes limits) without hiding the host's cores. cgroup v2 writes the
    cap as ``quota period`` in ``cpu.max``; v1 in two files. None: no cap.
    """
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", encoding="ascii") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us", encoding="ascii") as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may really use: affinity mask and cgroup quota. Ch. 0.

    ``os.cpu_count()`` counts the host's cores, also those a container or a
    scheduler keeps from us; thread and process counts are taken from this.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity mask
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def usable_physical_cores() -> int:
    """Usable cores, counting SMT siblings once. Chapters 1 and 2.

    Hardware threads that share one physical core share its SIMD units, so
    arithmetic peaks count physical cores: the usable (logical) cores scaled by
    physical / logical where the system reports both, at least 1.
    """
    import psutil

    physical, logical = psutil.cpu_count(logical=False), os.cpu_count()
    if not physical or not logical:
        return usable_cores()
    return max(1, usable_cores() * physical // logical)


def cpu_facts() -> dict:
    """Model, physical/logical cores, SIMD, clock, memory, torch threads. Chapter 0."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    if "avx512f" in flags:
        simd = ("AVX-512", 512)
    elif "avx2" in flags:
        simd = ("AVX2", 256)
    elif "avx" in flags:
        simd = ("AVX", 256)
    elif flags & {"sse2", "asimd"} or platform.machine() in ("arm64", "aarch64"):
        simd = ("SSE2/NEON", 128)
    else:
        simd = ("unknown", 128)
    import psutil

    mem = psutil.virtual_memory()
    freq = psutil.cpu_freq()
    mhz = freq.max or freq.current if freq else float(info.get("cpu MHz", 0) or 0)
    return {
        "model": info.get("model name") or platform.processor() or platform.machine(),
        # SMT (hyper-threading) shows one physical core as several logical ones;
        # psutil returns None where the platform does not say.
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "simd": simd[0],
        "simd_bits": simd[1],
        "fma": "fma" in flags or "asimd" in flags,
        "clock_mhz": round(mhz) if mhz else None,
        "memory_total": mem.total,
        "memory_available": mem.available,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


def gpu_facts(i: int = 0) -> dict:
    """torch.cuda's view of GPU ``i``: name, capability, SMs, memory. Chapter 0."""
    p = torch.cuda.get_device_properties(i)
    free, total = torch.cuda.mem_get_info(i)
    return {
        "name": p.name,
        "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "warp_size": getattr(p, "warp_size", 32),
        "max_threads_per_sm": getattr(p, "max_threads_per_multi_processor", None),
        "l2_cache_bytes": getattr(p, "L2_cache_size", None),
        "memory_total": p.total_memory,
        "memory_free": free,
        "memory_allocated": torch.cuda.memory_allocated(i),
        "memory_reserved": torch.cuda.memory_reserved(i),
        "device_total_by_driver": total,
    }


def pycuda_facts() -> list[dict] | str:
    """Every GPU's attributes as pycuda reports them, or why they are unavailable.

    Chapter 0. Returns one dict per device: name, total memory, free memory
    (read in a context on *that* device) and the driver's attribute table.
    """
    try:
        import pycuda.driver as cuda
    except ImportError:
        return (
            "pycuda is not installed (it needs the CUDA toolkit: "
            "see requirements-gpu.txt)"
        )
    try:
        cuda.init()
        devices = []
        for i in range(cuda.Device.count()):
            dev = cuda.Device(i)
            # the primary context is the one the runtime (and torch) uses: reuse
            # it instead of creating a second context on the GPU, and let it go
            ctx = dev.retain_primary_context()
            ctx.push()  # mem_get_info reports the current context's GPU
            try:
                free, total = cuda.mem_get_info()
            finally:
                ctx.pop()
                ctx.detach()
            attributes = {
                str(k).split(".")[-1]: v for k, v in dev.get_attributes().items()
            }
            devices.append(
                {
                    "id": i,
                    "name": dev.name(),
                    "memory_total": total,
                    "memory_free": free,
                    "attributes": attributes,
                }
            )
        return devices
    except cuda.Error as e:  # a driver without a GPU, or a GPU in use elsewhere
        return f"pycuda is installed but the CUDA driver says: {e}"


KERNEL_NOTE = ""  # why kernels run on the simulator although there is a GPU


def kernel_target() -> str:
    """Where numba's ``@cuda.jit`` kernels run: ``'GPU'`` or ``'simulator'``.

    Chapter 1.
    """
    return "simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "GPU"


def numba_cuda_installed() -> bool:
    """Whether numba's CUDA target package (``numba-cuda``) is installed. Ch. 1.

    Checked without importing it, so that no CUDA context is made here.
    """
    import importlib.util

    return importlib.util.find_spec("numba_cuda") is not None


def select_kernel_target() -> None:
    """Run numba CUDA kernels on the simulator unless the GPU target can work. Ch. 1.

    The GPU target needs a GPU and the optional ``numba-cuda`` package
    (requirements-gpu.txt); without either, kernels run on numba's simulator
    and ``banner()`` says why. numba reads NUMBA_ENABLE_CUDASIM once, when it
    is first imported, so this runs when course_utils is imported. A choice
    already in the environment wins.
    """
    global KERNEL_NOTE
    if "NUMBA_ENABLE_CUDASIM" in os.environ:
        return
    if "numba" in sys.modules:
        return  # too late to choose; numba has already decided
    gpu = torch.cuda.is_available()
    if gpu and not numba_cuda_installed():
        KERNEL_NOTE = " (numba-cuda is not installed: see requirements-gpu.txt)"
    elif gpu:
        why = numba_gpu_fails()
        if why:
            KERNEL_NOTE = f" (numba's GPU target failed a test kernel: {why})"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if gpu and not KERNEL_NOTE else "1"


# A kernel that numba must compile, launch and copy back on the GPU target.
NUMBA_PROBE = """
import numpy as np
from numba import cuda
@cuda.jit
def one(a):
    a[cuda.grid(1)] = 1
x = cuda.to_device(np.zeros(4, np.int32))
one[1, 4](x)
assert x.copy_to_host().tolist() == [1, 1, 1, 1], "wrong result"
"""


def numba_gpu_fails(timeout: float = 120.0) -> str:
    """Why numba's GPU target cannot run a kernel here ("" when it can). Ch. 1.

    Installed is not working: a driver too old for the toolkit pieces, or no
    NVVM, shows only when a kernel is compiled. The test runs in a separate
    process (numba decides its target once per process, and CUDA stays
    uninitialised here); its answer is kept in the environment for the
    processes this one starts.
    """
    import subprocess

    if "COURSE_NUMBA_GPU" in os.environ:
        return os.environ["COURSE_NUMBA_GPU"]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    try:
        done = subprocess.run([sys.executable, "-c", NUMBA_PROBE], env=env,
                              capture_output=True, text=True, timeout=timeout)
        why = "" if done.returncode == 0 else (
            done.stderr.strip().splitlines() or ["it failed"])[-1][:200]
    except subprocess.TimeoutExpired:
        why = f"no answer in {timeout:g} s"
    os.environ["COURSE_NUMBA_GPU"] = why
    return why


def check_fits(
    shape,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    copies: int = 1,
) -> int:
    """Refuse, in one line, a tensor that would not fit; return its size in bytes.

    ``copies`` counts tensors of this size alive at once (``a + b`` makes a
    third). Chapter 0. Raises ``DoesNotFit`` instead of letting the allocator
    fail, or the operating system kill the notebook's kernel.
    """
    device = torch.device(device)
    numel = 1
    for s in shape if isinstance(shape, (tuple, list, torch.Size)) else [shape]:
        if int(s) < 0:
            raise DoesNotFit(f"shape {tuple(shape)} has a negative size")
        numel *= int(s)
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = numel * itemsize * copies
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # blocks PyTorch's allocator holds but no tensor uses are free to reuse
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        where = f"{torch.cuda.get_device_name(device)} has {format_bytes(free)} free"
    else:
        import psutil

        free = psutil.virtual_memory().available
        where = f"this machine has {format_bytes(free)} of RAM available"
    if need > FIT_FRACTION * free:
        dims = list(shape) if isinstance(shape, (tuple, list, torch.Size)) else [shape]
        what = f"{'x'.join(map(str, dims))} {str(dtype).replace('torch.', '')}"
        what = f"{copies} tensors of {what}" if copies > 1 else f"a {what} tensor"
        raise DoesNotFit(
            f"{what} needs {format_bytes(need)}, but {where}: choose a smaller size."
        )
    return need


def _nvml_names() -> list[str]:
    """GPU names from NVML (the library nvidia-smi uses), without touching CUDA."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    if nvml.nvmlInit_v2() != 0:
        return []
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        names = []
        for i in range(count.value):
            handle, buf = ctypes.c_void_p(), ctypes.create_string_buffer(96)
            if (nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetName(handle, buf, 96) != 0):
                return []
            names.append(buf.value.decode(errors="replace"))
        return names
    finally:
        nvml.nvmlShutdown()


def gpu_names() -> list[str]:
    """Names of the GPUs, read without initialising CUDA. Chapter 0.

    Printing a banner should not cost a CUDA context (GPU memory and a moment
    of start-up) on every GPU: NVML answers from outside CUDA
    (``CUDA_VISIBLE_DEVICES`` is honoured when it lists indices). Where CUDA
    is initialised already, torch is asked directly.
    """
    n = gpu_count()
    if not n:
        return []
    if torch.cuda.is_initialized():
        return [torch.cuda.get_device_name(i) for i in range(n)]
    names = _nvml_names()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and names:
        try:
            names = [names[int(v)] for v in visible.split(",") if v.strip()]
        except (ValueError, IndexError):  # UUIDs or MIG names: keep NVML's order
            pass
    if len(names) >= n:
        return names[:n]
    return [f"GPU {i} (name unknown: NVML did not answer)" for i in range(n)]


def banner() -> str:
    """Print and return one line saying what this notebook runs on. Chapter 0.

    In a notebook it also makes an interrupted cell stop the processes it
    started and read as one line (``cleanup.end_interrupts_in_one_line``).
    """
    from course_utils import cleanup, reference

    cleanup.end_interrupts_in_one_line()

    cpu = f"{usable_cores()} cores"
    n = gpu_count()
    if n == 0:
        ref = reference.recorded_devices()
        shown = "GPU cells show published and predicted GPU figures" + (
            f", and results recorded on {', '.join(ref)}" if ref else "")
        line = f"CPU only ({cpu}) - {shown}; CUDA kernels run on numba's simulator"
    else:
        names = sorted(set(gpu_names()))
        kernels = ("; CUDA kernels run on numba's simulator" + KERNEL_NOTE
                   if kernel_target() == "simulator" else "")
        line = (
            f"{n} GPU{'s' if n > 1 else ''} ({', '.join(names)}) + CPU ({cpu})"
            f" - GPU cells run for real{kernels}"
            "; collectives use nccl where every rank has a GPU, gloo otherwise"
        )
    print(line)
    return line
