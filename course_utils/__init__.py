"""Helpers for the course "PyTorch Parallelism, hands-on".

Plumbing only: probing devices, timing, plotting, launching processes,
checking exercises and building notebooks. What a chapter teaches is written
out in the chapter itself.

Importing this package chooses where numba's CUDA kernels will run (Chapter 1):
on the GPU when torch sees one, otherwise on numba's CUDA simulator. numba reads
that choice when it is first imported, so import course_utils before numba.
"""

import os

# Ask NVML, not the CUDA driver, whether there is a GPU: the driver's answer
# initialises CUDA in this process. The launcher's forkserver imports
# course_utils before it forks the ranks, so importing it must leave CUDA
# alone, or the ranks could not use their GPUs (nccl).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# torch 2.13's profiler library (kineto) prints "USDT: ... profiler_start" and
# "profiler_stop" to stderr around every profile, which a notebook shows as
# an error box. Level 6 silences its native log (read at each profile).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

from course_utils.devices import (  # noqa: E402
    banner,
    check_fits,
    for_device,
    select_kernel_target,
    try_all_gpus,
    try_gpu,
)

select_kernel_target()

from course_utils.compat import backport  # noqa: E402

backport()  # the newer torch names the chapters use, on torch 2.11 and 2.12

from course_utils.bench import Benchmark, Timing, bench, sweep  # noqa: E402

__all__ = [
    "Benchmark",
    "Timing",
    "banner",
    "bench",
    "check_fits",
    "for_device",
    "sweep",
    "try_all_gpus",
    "try_gpu",
]
