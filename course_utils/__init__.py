"""Helpers for the course "PyTorch Parallelism, hands-on".

Plumbing only: probing devices, timing, plotting, launching processes,
checking exercises and building notebooks. What a chapter teaches is written
out in the chapter itself.

Importing this package chooses where numba's CUDA kernels will run (Chapter 1):
on the GPU when torch sees one, otherwise on numba's CUDA simulator. numba reads
that choice when it is first imported, so import course_utils before numba.
"""

from course_utils.devices import (
    banner,
    check_fits,
    for_device,
    select_kernel_target,
    try_all_gpus,
    try_gpu,
)

select_kernel_target()

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
