"""Predicted GPU figures: simple, named models fed with published numbers.

Introduced in Chapter 2. A learner without a GPU still sees what a GPU would
do, as a *prediction*: a formula (the model) applied to published datasheet
figures (its inputs, each cited). Every function here returns a
``reference.Figure`` of kind ``"predicted"`` whose label names the model and
the sources of its inputs, so a prediction is never mistaken for a
measurement. Two layers:

The textbook bounds, with datasheet peaks - right order of magnitude and the
right shape of a curve, and always optimistic:

- ``roofline_seconds``: a kernel takes at least ``max(flops / peak, bytes /
  bandwidth)`` (Williams, Waterman and Patterson, *Roofline*, CACM 2009).
- ``copy_seconds``: ``bytes / link bandwidth`` for a host-device copy or a
  point-to-point transfer.
- ``ring_allreduce_seconds``: each of ``n`` ranks sends and receives
  ``2 (n - 1) / n`` times the buffer (the bandwidth term of the ring
  algorithm that NCCL and gloo use).
- ``tensor_math_speedup``: the ratio of two math modes' datasheet peaks, the
  most a large matmul gains from mixed precision; a ceiling for that math
  only, not a prediction of a training step's speed-up (Chapter 8).

The calibrated models, which add what dominates small and real workloads, each
input a published *measurement* (``reference_data/published/calibration.json``):

- ``kernel_seconds``: per-launch host cost (PyTorch's dispatch plus a CUDA
  launch) overlapping the kernel's time at the *achieved* FLOP/s and bandwidth.
- ``calibrated_copy_seconds``: pinned copies at the rate PCIe copies reach;
  pageable ones add the driver's staging copy.
- ``allreduce_seconds``: NCCL's ring, a per-collective latency plus
  ``2 (n - 1) / n x bytes`` at the link's achieved rate; on an 8-GPU H100
  NVSwitch node, large buffers at NVLS's peak instead. Conventions are
  nccl-tests': algbw = bytes / time, busbw = algbw x 2 (n - 1) / n.
- ``pipeline_seconds``, ``ddp_step_seconds``.

``python -m course_utils.predict --calibration`` prints every prediction of a
setup someone measured beside that measurement, with the ratio, and exits
non-zero when any ratio leaves [0.8, 1.25] or fewer than 20 pairs remain. After
that table it lists the published measurements outside the models' scope, each
with its reason (``out_of_scope``); they are never counted, and a chapter that
shows a prediction near one prints ``caveat(key)`` beside it.

GPUs are named by the subjects of ``reference_data/published/gpus.json``:
``h100_sxm``, ``h100_pcie``, ``a100_sxm_80gb``, ``l4``, ``t4``, ``rtx_4090``.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_utils import reference

GPUS = ("h100_sxm", "h100_pcie", "a100_sxm_80gb", "l4", "t4", "rtx_4090")

# the published id of each math mode's peak, in order of preference
_PEAK_KEYS = {
    "fp32": ("fp32_tflops",),
    "tf32": ("tf32_tensor_dense_tflops",),
    "bf16": ("bf16_tensor_dense_tflops",),
    "fp16": ("fp16_tensor_dense_tflops", "fp16_tensor_fp32acc_dense_tflops",
             "fp16_tensor_tflops"),
    "fp64": ("fp64_tflops",),
}

# host-device links: published id, and whether the figure counts both directions
LINKS = {
    "pcie3_x16": ("pcie3_x16.bandwidth_gbps", False),
    "pcie4_x16": ("pcie4_x16.bandwidth_per_direction_gbps", False),
    "pcie5_x16": ("pcie5_x16.bandwidth_per_direction_gbps", False),
    "nvlink_h100": ("h100_sxm.nvlink_bandwidth_total_gbps", True),
    "nvlink_a100": ("a100_sxm_80gb.nvlink_bandwidth_total_gbps", True),
}


def _entry(key: str) -> dict:
    return reference.published_entry(key)


def gpu_name(gpu: str) -> str:
    """The GPU's full name in its published figures: 'NVIDIA H100 SXM5 80GB'."""
    return _entry(f"{gpu}.memory_bandwidth_gbps")["gpu"]


def peak_key(gpu: str, math: str = "fp32") -> str:
    """The published id of ``gpu``'s peak for ``math`` (fp32, tf32, bf16, ...)."""
    if math not in _PEAK_KEYS:
        raise ValueError(f"math must be one of {sorted(_PEAK_KEYS)}, not {math!r}")
    entries = reference.published_entries()
    for q in _PEAK_KEYS[math]:
        if f"{gpu}.{q}" in entries:
            return f"{gpu}.{q}"
    raise KeyError(f"no published {math} peak for {gpu!r}")


def peak_flops(gpu: str, math: str = "fp32") -> float:
    """Peak FLOP/s of ``gpu`` for ``math``, from its datasheet (dense, no sparsity)."""
    e = _entry(peak_key(gpu, math))
    assert e["unit"] == "TFLOP/s", e
    return float(e["value"]) * 1e12


def memory_bandwidth(gpu: str) -> float:
    """Peak device-memory bandwidth of ``gpu`` in bytes/s, from its datasheet."""
    e = _entry(f"{gpu}.memory_bandwidth_gbps")
    assert e["unit"] == "GB/s", e
    return float(e["value"]) * 1e9


def link_bandwidth(link: str) -> float:
    """Bandwidth of ``link`` in one direction, bytes/s."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {sorted(LINKS)}, not {link!r}")
    key, both = LINKS[link]
    e = _entry(key)
    assert e["unit"] == "GB/s", e
    return float(e["value"]) * 1e9 / (2 if both else 1)


def roofline_seconds(flops: float, bytes_moved: float, gpu: str,
                     math: str = "fp32") -> reference.Figure:
    """The roofline's lower bound on a kernel's time on ``gpu``.

    ``max(flops / peak, bytes / bandwidth)``: no launch overhead, no cache
    effects, perfect overlap of compute and memory. Real kernels are slower;
    small ones much slower (each launch costs microseconds).
    """
    peak, bw = peak_flops(gpu, math), memory_bandwidth(gpu)
    t = max(flops / peak, bytes_moved / bw)
    bound = "compute" if flops / peak >= bytes_moved / bw else "memory"
    return reference.predicted(
        t, "s", gpu_name(gpu),
        f"roofline max(FLOPs / peak, bytes / bandwidth) = {bound}-bound, "
        f"{flops:.3g} FLOPs and {bytes_moved:.3g} bytes, no launch overhead",
        [peak_key(gpu, math), f"{gpu}.memory_bandwidth_gbps"],
    )


def roofline_flops_per_s(intensity: float, gpu: str,
                         math: str = "fp32") -> reference.Figure:
    """Attainable FLOP/s at arithmetic intensity ``intensity`` (FLOPs per byte)."""
    peak, bw = peak_flops(gpu, math), memory_bandwidth(gpu)
    return reference.predicted(
        min(peak, intensity * bw), "FLOP/s", gpu_name(gpu),
        f"roofline min(peak, intensity x bandwidth) at {intensity:.3g} FLOP/byte",
        [peak_key(gpu, math), f"{gpu}.memory_bandwidth_gbps"],
    )


def ridge_point(gpu: str, math: str = "fp32") -> float:
    """The intensity (FLOP/byte) above which ``gpu`` is compute-bound."""
    return peak_flops(gpu, math) / memory_bandwidth(gpu)


def copy_seconds(nbytes: float, link: str = "pcie4_x16",
                 gpu: str = "") -> reference.Figure:
    """Time to move ``nbytes`` over ``link`` at its full published bandwidth.

    Pinned host memory gets close to it; pageable memory is slower (an extra
    host copy through a staging buffer).
    """
    bw = link_bandwidth(link)
    key, both = LINKS[link]
    half = ", half of the two-way total" if both else ""
    return reference.predicted(
        nbytes / bw, "s", gpu or link.replace("_", " "),
        f"bytes / link bandwidth ({link}, {bw / 1e9:.4g} GB/s each way{half}), "
        f"{nbytes:.3g} bytes, no latency",
        [key],
    )


def ring_allreduce_seconds(nbytes: float, n: int, link: str = "nvlink_h100",
                           gpu: str = "") -> reference.Figure:
    """Bandwidth term of a ring all-reduce of ``nbytes`` over ``n`` ranks.

    Each rank sends (and receives) ``2 (n - 1) / n x nbytes``: a
    reduce-scatter then an all-gather, each ``n - 1`` steps of ``nbytes / n``.
    Latency per step is left out, so small buffers take longer than this.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    bw = link_bandwidth(link)
    sent = 2 * (n - 1) / n * nbytes
    key, _ = LINKS[link]
    return reference.predicted(
        sent / bw, "s", gpu or f"{n} GPUs over {link.replace('_', ' ')}",
        f"ring all-reduce: 2(n-1)/n x bytes / link bandwidth, n={n}, "
        f"{nbytes:.3g} bytes, {bw / 1e9:.4g} GB/s each way, no per-step latency",
        [key],
    )


# --- calibrated models -------------------------------------------------------------
#
# The textbook models above use datasheet peaks and leave out fixed costs. The
# models below add the terms that dominate real and small workloads, each fed
# with a published *measurement* (cited, in reference_data/published/
# calibration.json): a per-launch and a per-collective latency, and the fraction
# of its datasheet rate that a compute unit, a memory or a link actually reaches.
# Each input comes from a different measurement than those the calibration table
# (``calibration_pairs``) checks it against.

# published ids of the calibrated models' inputs
MATMUL_EFFICIENCY_INPUTS = ("mamf.a100_sxm_bf16_tflops",
                            "a100_sxm_80gb.bf16_tensor_dense_tflops")
MEMORY_EFFICIENCY_INPUTS = ("bwtest.t4_d2d_gbps", "t4.memory_bandwidth_gbps")
PCIE_EFFICIENCY_INPUTS = ("bwtest.dgx_a100_pinned_h2d_gbps",
                          "bwtest.dgx_a100_pinned_d2h_gbps",
                          "pcie4_x16.bandwidth_per_direction_gbps")
NVLINK_EFFICIENCY_INPUTS = ("nccl.h100_nvlink_effective_busbw_gbps",
                            "h100_sxm.nvlink_bandwidth_total_gbps")
PAGEABLE_INPUTS = ("bwtest.dgx_a100_pageable_h2d_gbps",
                   "bwtest.dgx_a100_pinned_h2d_gbps")
COLLECTIVE_LATENCY_INPUTS = ("nccl.h200x8_allreduce_32kib_seconds",)
LAUNCH_INPUTS = ("pt_overhead.python_op_us", "cuda_launch.empty_kernel_us")
NVLS_INPUTS = ("nccl.h100x8_nvls_peak_busbw_gbps", "nccl.nvls_below_peak_bytes")
NVLS_GPUS = 8  # the GPU count NCCL's maintainer gives NVLS's peak for


def _value(key: str) -> float:
    return float(_entry(key)["value"])


def matmul_efficiency() -> float:
    """Fraction of the datasheet peak a large matmul reaches (A100 SXM, bf16).

    267.9 of 312 TFLOP/s, the best of a shape search (``mamf.*``). Applied to
    every GPU and math mode: an assumption the calibration checks on others.
    """
    achieved, peak = (_value(k) for k in MATMUL_EFFICIENCY_INPUTS)
    return achieved / peak


def memory_efficiency() -> float:
    """Fraction of the datasheet memory bandwidth a device-to-device copy reaches.

    From CUDA's bandwidthTest on a T4 (read plus write traffic per second).
    """
    achieved, peak = (_value(k) for k in MEMORY_EFFICIENCY_INPUTS)
    return achieved / peak


def pcie_efficiency() -> float:
    """Fraction of a PCIe link's data rate a pinned ``cudaMemcpy`` reaches.

    The mean of both directions of bandwidthTest on a DGX A100 (PCIe 4.0 x16).
    """
    h2d, d2h, link = (_value(k) for k in PCIE_EFFICIENCY_INPUTS)
    return (h2d + d2h) / 2 / link


def nvlink_efficiency() -> float:
    """Fraction of NVLink's line rate NCCL's ring reaches (bus bandwidth).

    NCCL's maintainers: about 370 of H100's 450 GB/s each way, the rest is
    protocol overhead.
    """
    effective, total = (_value(k) for k in NVLINK_EFFICIENCY_INPUTS)
    return effective / (total / 2)


def link_efficiency(link: str) -> float:
    """The achieved fraction used for ``link``: PCIe's or NVLink's."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {sorted(LINKS)}, not {link!r}")
    return nvlink_efficiency() if link.startswith("nvlink") else pcie_efficiency()


def achieved_link_bandwidth(link: str) -> float:
    """What a large transfer reaches over ``link`` in one direction, bytes/s."""
    return link_bandwidth(link) * link_efficiency(link)


def collective_latency() -> float:
    """Seconds of a collective that carries (almost) no data.

    The 32 KiB all-reduce of a published 8-GPU sweep (torch.distributed over
    NCCL, so it includes PyTorch's and NCCL's launch and synchronisation).
    Used for any number of ranks and any link: an assumption.
    """
    return _value(COLLECTIVE_LATENCY_INPUTS[0])


def launch_overhead() -> float:
    """Host seconds to issue one small CUDA operation from PyTorch eager.

    PyTorch's own per-operation cost (about 2 us, measured on CPU tensors)
    plus a conventional CUDA kernel launch (at least 2.6 us).
    """
    return sum(_value(k) for k in LAUNCH_INPUTS) * 1e-6


def host_copy_rate() -> float:
    """Bytes/s of the extra host copy a pageable transfer makes (a staging copy).

    Derived from one system's pageable and pinned host-to-device rates:
    ``1 / pageable = 1 / pinned + 1 / host_copy``.
    """
    pageable, pinned = (_value(k) * 1e9 for k in PAGEABLE_INPUTS)
    return 1 / (1 / pageable - 1 / pinned)


def achieved_flops(gpu: str, math: str = "fp32") -> float:
    """FLOP/s a large matmul reaches on ``gpu``: peak x ``matmul_efficiency()``."""
    return peak_flops(gpu, math) * matmul_efficiency()


def achieved_memory_bandwidth(gpu: str) -> float:
    """Bytes/s a large copy kernel reaches: datasheet x ``memory_efficiency()``."""
    return memory_bandwidth(gpu) * memory_efficiency()


def kernel_seconds(flops: float, bytes_moved: float, gpu: str, math: str = "fp32",
                   launches: int = 1) -> reference.Figure:
    """Time for ``launches`` identical kernels issued back to back from PyTorch.

    Each kernel takes ``max(flops / achieved FLOP/s, bytes / achieved
    bandwidth)`` on the GPU; the host needs ``launch_overhead()`` to issue each
    one, and the two overlap, so a run of small kernels costs the launch
    overhead per kernel (launch-bound) and a run of large ones their GPU time.
    """
    if launches < 1:
        raise ValueError(f"launches must be at least 1, not {launches}")
    gpu_s = max(flops / achieved_flops(gpu, math),
                bytes_moved / achieved_memory_bandwidth(gpu))
    host_s = launch_overhead()
    bound = "launch" if host_s > gpu_s else (
        "compute" if flops / achieved_flops(gpu, math)
        >= bytes_moved / achieved_memory_bandwidth(gpu) else "memory")
    return reference.predicted(
        launches * max(gpu_s, host_s), "s", gpu_name(gpu),
        f"{launches} x max(launch {host_s * 1e6:.1f} us, GPU time {gpu_s * 1e6:.3g} "
        f"us) = {bound}-bound; GPU time at {matmul_efficiency():.0%} of peak FLOP/s "
        f"and {memory_efficiency():.0%} of peak bandwidth",
        [peak_key(gpu, math), f"{gpu}.memory_bandwidth_gbps", *LAUNCH_INPUTS,
         *MATMUL_EFFICIENCY_INPUTS, *MEMORY_EFFICIENCY_INPUTS],
        caveat=kernel_caveat(bound, math),
    )


def kernel_caveat(bound: str, math: str) -> str:
    """What of ``kernel_seconds`` no calibration pair checks (Chapters 2, 11).

    Memory-bound kernels and bf16 matmuls are checked; the launch cost is not,
    and other math modes only through the FP32-to-TF32 ratio on an A100.
    """
    if bound == "launch":
        return ("not calibrated: launch-bound, and no published measurement "
                "checks the launch cost (see the out-of-scope list of "
                "python -m course_utils.predict --calibration)")
    if bound == "compute" and math != "bf16":
        return (f"not calibrated for {math}: the fraction of peak is bf16 "
                "matmuls'; for other math modes only the FP32-to-TF32 ratio of "
                "an A100 checks it")
    return ""


def calibrated_copy_seconds(nbytes: float, link: str = "pcie4_x16", gpu: str = "",
                            pinned: bool = True) -> reference.Figure:
    """A host-device copy of ``nbytes`` at the rate such copies reach.

    Pinned: the link's data rate x ``pcie_efficiency()``. Pageable: the driver
    copies through a pinned staging buffer, so the host copy is added,
    ``bytes / pinned rate + bytes / host_copy_rate()``; how fast that host copy
    is depends on the machine (published pageable rates vary 3-fold).
    """
    rate = achieved_link_bandwidth(link)
    t = nbytes / rate
    inputs = [LINKS[link][0], *(NVLINK_EFFICIENCY_INPUTS if link.startswith("nvlink")
                                else PCIE_EFFICIENCY_INPUTS)]
    model = (f"bytes / ({link_bandwidth(link) / 1e9:.4g} GB/s x "
             f"{link_efficiency(link):.0%} reached) = {rate / 1e9:.3g} GB/s")
    if not pinned:
        t += nbytes / host_copy_rate()
        model += (f", plus the staging copy at {host_copy_rate() / 1e9:.3g} GB/s "
                  f"(pageable: {nbytes / t / 1e9:.3g} GB/s in all)")
        inputs += list(PAGEABLE_INPUTS)
    return reference.predicted(
        t, "s", gpu or link.replace("_", " "),
        f"{'pinned' if pinned else 'pageable'} copy of {nbytes:.3g} bytes: {model}",
        list(dict.fromkeys(inputs)))


def nvls_applies(nbytes: float, n: int, link: str) -> bool:
    """Whether NCCL's NVLink SHARP (NVLS) all-reduce runs at its peak here.

    On an 8-GPU H100/H200 NVSwitch node NCCL reduces inside the switch; its
    maintainer gives the peak for 8 GPUs and calls 256 MiB too small to reach
    it (``NVLS_INPUTS``). Below that size, or with fewer GPUs, the model keeps
    the ring.
    """
    return (link == "nvlink_h100" and n == NVLS_GPUS
            and nbytes > _value(NVLS_INPUTS[1]))


def nvls_busbw() -> float:
    """NVLS's peak all-reduce bus bandwidth on 8 H100s, bytes/s (nccl-tests' busbw)."""
    return _value(NVLS_INPUTS[0]) * 1e9


def allreduce_seconds(nbytes: float, n: int, link: str = "nvlink_h100",
                      gpu: str = "") -> reference.Figure:
    """An all-reduce of ``nbytes`` over ``n`` GPUs: latency plus NCCL's ring.

    ``collective_latency() + 2 (n - 1) / n x bytes / (link x efficiency)``:
    NCCL's ring algorithm, whose per-GPU traffic defines nccl-tests' *bus
    bandwidth* convention (busbw = algbw x 2(n-1)/n, algbw = bytes / time).
    On an 8-GPU H100/H200 NVSwitch node NCCL reduces inside the switch
    (NVLS): above the size its maintainer says reaches the peak, the bytes
    move at that peak bus bandwidth instead (``nvls_applies``). NCCL picks
    other algorithms too (tree; NVLS from about 2 MiB), which the ring
    stands for below that size.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    nvls = nvls_applies(nbytes, n, link)
    rate = nvls_busbw() if nvls else achieved_link_bandwidth(link)
    t = 0.0 if n == 1 else collective_latency() + 2 * (n - 1) / n * nbytes / rate
    algo = (f"NVLS (in-switch reduction) at its peak bus bandwidth {rate / 1e9:.4g} "
            "GB/s" if nvls else f"ring at {rate / 1e9:.4g} GB/s (bus bandwidth)")
    return reference.predicted(
        t, "s", gpu or f"{n} GPUs over {link.replace('_', ' ')}",
        f"NCCL all-reduce: latency {collective_latency() * 1e6:.0f} us + "
        f"2(n-1)/n x bytes / rate, {algo}, n={n}, {nbytes:.3g} bytes",
        list(allreduce_inputs(nbytes, n, link)))


def allreduce_inputs(nbytes: float, n: int, link: str) -> tuple[str, ...]:
    """The published ids ``allreduce_seconds`` uses for this all-reduce."""
    inputs = [LINKS[link][0], *COLLECTIVE_LATENCY_INPUTS,
              *(NVLINK_EFFICIENCY_INPUTS if link.startswith("nvlink")
                else PCIE_EFFICIENCY_INPUTS),
              *(NVLS_INPUTS if nvls_applies(nbytes, n, link) else ())]
    return tuple(dict.fromkeys(inputs))


def algbw(nbytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: bytes / time."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2 (n - 1) / n."""
    return algbw(nbytes, seconds) * 2 * (n - 1) / n


# pipeline schedules: idle slots of one stage per step, in units of one
# micro-batch's forward and backward on one stage (Chapter 7, Chapter 13)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


def bubble_slots(stages: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Idle time of a pipeline step, in micro-batch slots of one stage.

    - ``gpipe`` and ``1f1b``: ``stages - 1`` (1F1B only bounds memory);
    - ``interleaved``: each GPU holds ``virtual`` stages, the bubble shrinks to
      ``(stages - 1) / virtual`` (Narayanan et al. 2021, section 2.2.2;
      PyTorch's ``ScheduleInterleaved1F1B``);
    - ``zero-bubble``: the backward split into input and weight gradients
      fills the bubble; its ZB-H1 schedule, at 1F1B's memory, leaves a third
      of 1F1B's when forward, input-gradient and weight-gradient passes take
      equal time (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section
      3.1; PyTorch ships ``ScheduleInterleavedZeroBubble`` and
      ``ScheduleZBVZeroBubble``).
    """
    if stages < 1 or virtual < 1:
        raise ValueError("stages and virtual must be at least 1")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, not {schedule!r}")
    if schedule == "interleaved":
        return (stages - 1) / virtual
    if schedule == "zero-bubble":
        return (stages - 1) / 3
    return float(stages - 1)


def pipeline_seconds(t_one: float, stages: int, microbatches: int,
                     schedule: str = "gpipe", virtual: int = 1) -> float:
    """Schedule time for work that takes ``t_one`` on one device.

    ``stages`` equal stages, the batch in ``microbatches``: each stage does
    ``t_one / (stages x microbatches)`` per micro-batch, and the last one
    finishes after ``microbatches + bubble_slots(...)`` such slots (GPipe's
    bubble is ``stages - 1`` slots).
    """
    if stages < 1 or microbatches < 1:
        raise ValueError("stages and microbatches must be at least 1")
    slots = bubble_slots(stages, schedule, virtual)
    return t_one * (microbatches + slots) / (stages * microbatches)


# --- the step model's kernels: attention, whole steps, networks ---------------------

ATTENTION_EFFICIENCY_INPUTS = ("pt_bench.h100_sdpa_forward_tflops",
                               "h100_sxm.bf16_tensor_dense_tflops")
HOPPER_ATTENTION_INPUTS = ("fa3.h100_fp16_forward_tflops",
                           "h100_sxm.bf16_tensor_dense_tflops")
NIC_EFFICIENCY_INPUTS = ("nccl.ndr_per_nic_busbw_gbps",
                         "ndr_infiniband.bandwidth_per_direction_gbps")
# a node's network: one port per GPU at this line rate (rail-optimised clusters)
NICS = {"ndr_infiniband": "ndr_infiniband.bandwidth_per_direction_gbps",
        "hdr_infiniband": "hdr_infiniband.bandwidth_per_direction_gbps"}


def attention_efficiency(kernel: str = "sdpa") -> float:
    """Fraction of the 16-bit peak a fused attention kernel reaches on an H100.

    ``"sdpa"``: PyTorch's ``scaled_dot_product_attention`` forward
    (FlashAttention-2 backend, head dim 128, long sequences), from PyTorch's
    own benchmark: well below a large matmul's fraction, since the softmax
    between the two matmuls runs on the slower non-tensor units.
    ``"hopper"``: FlashAttention-3, written for Hopper's asynchronous tensor
    cores, at its best (its paper's figure), as production stacks reach with
    it or cuDNN's attention.
    """
    keys = {"sdpa": ATTENTION_EFFICIENCY_INPUTS,
            "hopper": HOPPER_ATTENTION_INPUTS}[kernel]
    achieved, peak = (_value(k) for k in keys)
    return achieved / peak


def attention_seconds(flops: float, gpu: str, math: str = "bf16") -> reference.Figure:
    """Time of ``flops`` of fused attention (QK^T and PV) on ``gpu`` (Chapter 11).

    ``flops / (peak x attention_efficiency())``: the fraction PyTorch's SDPA
    reaches on an H100, applied to other GPUs and to the backward pass (an
    assumption: FlashAttention-2's backward reaches a lower fraction).
    """
    t = flops / (peak_flops(gpu, math) * attention_efficiency())
    return reference.predicted(
        t, "s", gpu_name(gpu),
        f"{flops:.3g} attention FLOPs at {attention_efficiency():.0%} of the "
        f"{math} peak (fused SDPA kernel)",
        [peak_key(gpu, math), *ATTENTION_EFFICIENCY_INPUTS],
        caveat="" if gpu == "h100_sxm" else
        "not calibrated on this GPU: the attention kernel's fraction of peak is "
        "an H100's")


def step_efficiency() -> float:
    """Fraction of the peak a whole training step's matmuls reach (Chapters 6, 13).

    Not one large matmul's rate: a step also runs norms, activations, the
    optimizer, casts and launches, and its matmuls have the model's shapes.
    Fitted on published whole training runs (``course_utils.planner``'s
    calibration, the runs marked for fitting) and checked on the others.
    """
    from course_utils import planner  # the fit models whole runs

    return planner.whole_step_efficiency(planner.LLAMA3_8B)


def training_compute_seconds(flops: float, gpu: str,
                             math: str = "bf16") -> reference.Figure:
    """Time of a training step's ``flops`` of model matmuls on one ``gpu``.

    ``flops / (peak x step_efficiency())``: the whole-step rate calibrated on
    published training runs, not one matmul's (which ``achieved_flops`` gives).
    """
    eff = step_efficiency()
    return reference.predicted(
        flops / (peak_flops(gpu, math) * eff), "s", gpu_name(gpu),
        f"{flops:.3g} FLOPs at {eff:.0%} of the {math} peak (whole-step rate "
        "fitted on published training runs)",
        [peak_key(gpu, math), "fitted: python -m course_utils.predict --calibration"],
        caveat="" if math == "bf16" else
        f"not calibrated for {math}: the whole-step rate is bf16 runs'")


def nic_efficiency() -> float:
    """Fraction of an InfiniBand port's line rate NCCL reaches per NIC."""
    achieved, line = (_value(k) for k in NIC_EFFICIENCY_INPUTS)
    return achieved / line


def nic_bandwidth(nic: str = "ndr_infiniband") -> float:
    """What NCCL reaches through one network port, bytes/s each way."""
    if nic not in NICS:
        raise ValueError(f"nic must be one of {sorted(NICS)}, not {nic!r}")
    return _value(NICS[nic]) * 1e9 * nic_efficiency()


def group_busbw(n: int, local: int, link: str = "nvlink_h100",
                nic: str = "ndr_infiniband", nics: int = 0) -> float:
    """Bus bandwidth of a collective over ``n`` GPUs, ``local`` of them per node.

    Inside one node (``n <= local``): the link's achieved rate. Across nodes,
    NCCL drives every port of the node at once (one per GPU on
    rail-optimised clusters): the group's ``local`` GPUs of a node cross the
    network through ``local`` ports, so the bus bandwidth is ``local`` ports'
    achieved rate, capped by the link inside the node. A group with one GPU
    per node (tensor parallel inside, data parallel across) gets one port.
    ``nics``: a node's ports, when it has fewer than one per GPU.
    """
    if n < 1 or local < 1:
        raise ValueError("n and local must be at least 1")
    inside = achieved_link_bandwidth(link)
    if n <= local:
        return inside
    ports = min(local, nics) if nics else local
    return min(inside, ports * nic_bandwidth(nic))


COLLECTIVE_FACTORS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0,
                      "all_to_all": 1.0}


def collective_seconds(kind: str, nbytes: float, n: int, local: int = 8,
                       link: str = "nvlink_h100",
                       nic: str = "ndr_infiniband") -> float:
    """Seconds of one collective of a ``nbytes`` buffer over ``n`` GPUs.

    nccl-tests' conventions: each GPU moves ``factor x (n - 1) / n x bytes``
    (factor 2 for an all-reduce, 1 for all-gather, reduce-scatter and
    all-to-all) at the group's bus bandwidth (``group_busbw``), after the
    calibrated per-collective latency. An all-reduce of a whole 8-GPU H100
    node uses NVLS above the size its maintainer gives (``allreduce_seconds``).
    """
    if kind not in COLLECTIVE_FACTORS:
        raise ValueError(f"kind must be one of {sorted(COLLECTIVE_FACTORS)}")
    if n <= 1:
        return 0.0
    if kind == "all_reduce" and n <= local:
        return allreduce_seconds(nbytes, n, link).value
    rate = group_busbw(n, local, link, nic)
    return (collective_latency()
            + COLLECTIVE_FACTORS[kind] * (n - 1) / n * nbytes / rate)


def tensor_math_speedup(gpu: str, low: str = "bf16",
                        high: str = "tf32") -> reference.Figure:
    """The ceiling on ``gpu``'s matmul speed-up from ``high`` to ``low`` (Chapter 8).

    The ratio ``r`` of the two datasheet peaks: what one large matmul gains at
    most. It is not a training step's speed-up. A step also runs work that
    mixed precision speeds up little or not at all (ops autocast keeps in fp32,
    the optimizer's fp32 update, casts, launches, data loading); with a fraction
    ``f`` of its time in the math, the math gives it ``1 / (1 - f + f / r)``
    (Amdahl), near 1 for a small ``f``: there is no floor above 1, and a 16-bit
    step can even be slower. Nor is ``r`` a ceiling on a step: kernels reach
    different fractions of their peaks in each format. No source gives ``f``
    for a real step, so the model stops at ``r``.
    """
    return reference.predicted(
        peak_flops(gpu, low) / peak_flops(gpu, high), "x", gpu_name(gpu),
        f"ratio of datasheet peaks, {low} / {high}: the ceiling of the math "
        "alone, not a training step's speed-up",
        [peak_key(gpu, low), peak_key(gpu, high)],
    )


def ddp_step_seconds(t_compute: float, grad_bytes: float, n: int,
                     link: str = "nvlink_h100") -> float:
    """A data-parallel step: one GPU's compute plus its gradient all-reduce.

    The all-reduce is not overlapped with the backward pass here (an upper
    bound on its cost; DDP's buckets hide most of it).
    """
    return t_compute + allreduce_seconds(grad_bytes, n, link).value


# --- calibration: predictions against published measurements -------------------------

BAND = (0.8, 1.25)
MIN_PAIRS = 40


@dataclass
class Pair:
    """One setup predicted by a model and measured by someone else.

    ``ratio`` is predicted / published for the quantity as published; a pair
    passes when it lies within ``BAND``.
    """

    setup: str
    predicted: float
    published: float
    unit: str
    measured: str
    inputs: tuple[str, ...]

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        return BAND[0] <= self.ratio <= BAND[1]

    def line(self) -> str:
        return (f"{self.setup}: predicted {self.predicted:.4g} {self.unit}, published "
                f"measurement {self.published:.4g} {self.unit} "
                f"[{self.measured}], ratio {self.ratio:.2f}")


@dataclass
class OutOfScope:
    """A published measurement of a setup no model here predicts, and why.

    Listed after the calibration, never counted in it; a chapter that shows a
    prediction near such a setup prints ``caveat(measured)`` beside it.
    """

    setup: str
    published: float
    unit: str
    measured: str
    reason: str

    def line(self) -> str:
        return (f"{self.setup}: published {self.published:.4g} {self.unit} "
                f"[{self.measured}]; {self.reason}")


def _pinned_rate(link: str) -> float:
    return achieved_link_bandwidth(link) / 1e9


def _compute_pairs() -> list[Pair]:
    """Matmul rates, HBM copies and a math mode's speed-up (Chapters 2 and 8)."""
    v, mm = _value, MATMUL_EFFICIENCY_INPUTS
    pairs = [Pair(setup, achieved_flops(gpu, "bf16") / 1e12, v(key), "TFLOP/s", key,
                  (peak_key(gpu, "bf16"), *mm))
             for key, gpu, setup in (
                 ("mamf.h100_sxm_bf16_tflops", "h100_sxm", "bf16 matmul, H100 SXM"),
                 ("mamf.a100_pcie_bf16_tflops", "a100_sxm_80gb",
                  "bf16 matmul, A100 PCIe (same datasheet peak as the SXM)"))]
    pairs.append(Pair(
        "HBM device-to-device copy, A100-SXM4-40GB",
        memory_bandwidth("a100_sxm_40gb") * memory_efficiency() / 1e9,
        v("bwtest.a100_sxm4_40gb_d2d_gbps"), "GB/s", "bwtest.a100_sxm4_40gb_d2d_gbps",
        ("a100_sxm_40gb.memory_bandwidth_gbps", *MEMORY_EFFICIENCY_INPUTS)))
    # one efficiency for every math mode: TF32 tensor cores against FP32 cores
    pairs.append(Pair(
        "math-mode speed-up, FP32 to TF32, 10240^3 matmul on an A100",
        achieved_flops("a100_sxm_80gb", "tf32") / achieved_flops("a100_sxm_80gb"),
        v("pt_docs.a100_fp32_matmul_seconds") / v("pt_docs.a100_tf32_matmul_seconds"),
        "x", "pt_docs.a100_tf32_matmul_seconds",
        ("a100_sxm_80gb.tf32_tensor_dense_tflops", "a100_sxm_80gb.fp32_tflops")))
    return pairs


def _copy_pairs() -> list[Pair]:
    """Pinned and pageable copies between host and device (Chapter 3)."""
    v, pcie = _value, PCIE_EFFICIENCY_INPUTS
    pairs = [Pair(setup, _pinned_rate(link), v(key), "GB/s", key,
                  (LINKS[link][0], *pcie))
             for key, link, setup in (
                 ("bwtest.a100_pcie_pinned_d2h_gbps", "pcie4_x16",
                  "pinned copy device to host, A100 PCIe server (PCIe 4.0 x16)"),
                 ("bwtest.t4_pinned_d2h_gbps", "pcie3_x16",
                  "pinned copy device to host, T4 cloud VM (PCIe 3.0 x16)"))]
    rate = 1 / (1 / achieved_link_bandwidth("pcie4_x16") + 1 / host_copy_rate())
    pairs.append(Pair("pageable copy device to host, A100 PCIe server", rate / 1e9,
                      v("bwtest.a100_pcie_pageable_d2h_gbps"), "GB/s",
                      "bwtest.a100_pcie_pageable_d2h_gbps",
                      ("pcie4_x16.bandwidth_per_direction_gbps", *pcie,
                       *PAGEABLE_INPUTS)))
    return pairs


def _allreduce_pairs() -> list[Pair]:
    """NCCL all-reduces over NVLink and PCIe (Chapters 5 and 6)."""
    v = _value
    # an 8-GPU sweep (the latency input is its 32 KiB point, a separate
    # measurement of the same run); NVLS's inputs come from NCCL's maintainer
    sweep = _entry("nccl.h200x8_allreduce_sweep")["value"]
    pairs = []
    for size, t in zip(sweep["x"], sweep["y"], strict=True):
        pairs.append(Pair(
            f"all_reduce of {size / 2**20:,.0f} MiB on 8x H200 (NVLink 4), time",
            allreduce_seconds(size, 8, "nvlink_h100").value * 1e6, t * 1e6, "us",
            "nccl.h200x8_allreduce_sweep", allreduce_inputs(size, 8, "nvlink_h100")))
    big = 4 * 2**30
    t_big = allreduce_seconds(big, 8, "nvlink_h100").value
    pairs.append(Pair("all_reduce bus bandwidth, 8x H200, NCCL's default (NVLS)",
                      busbw(big, t_big, 8) / 1e9,
                      v("nccl.h200x8_nvls_peak_busbw_gbps"), "GB/s",
                      "nccl.h200x8_nvls_peak_busbw_gbps",
                      allreduce_inputs(big, 8, "nvlink_h100")))
    nvl = NVLINK_EFFICIENCY_INPUTS
    pairs.append(Pair("all_reduce bus bandwidth, 8x H200 with NVLS off (ring)",
                      _pinned_rate("nvlink_h100"), v("nccl.h200x8_ring_busbw_gbps"),
                      "GB/s", "nccl.h200x8_ring_busbw_gbps",
                      ("h100_sxm.nvlink_bandwidth_total_gbps", *nvl)))
    pairs.append(Pair("all_reduce bus bandwidth, 8x A100 (NVLink 3)",
                      _pinned_rate("nvlink_a100"),
                      v("nccl.a100x8_allreduce_busbw_gbps"), "GB/s",
                      "nccl.a100x8_allreduce_busbw_gbps",
                      ("a100_sxm_80gb.nvlink_bandwidth_total_gbps", *nvl)))
    pcie = ("pcie4_x16.bandwidth_per_direction_gbps", *PCIE_EFFICIENCY_INPUTS)
    pairs.append(Pair("all_reduce bus bandwidth, 4x RTX 4090 over PCIe 4.0",
                      _pinned_rate("pcie4_x16"),
                      v("nccl.rtx4090x4_pcie_allreduce_busbw_gbps"), "GB/s",
                      "nccl.rtx4090x4_pcie_allreduce_busbw_gbps", pcie))
    pairs.append(Pair("all_reduce of 8 bytes on 8x RTX 4090 (PCIe), time",
                      allreduce_seconds(8, 8, "pcie4_x16").value * 1e6,
                      v("nccl.rtx4090x8_pcie_allreduce_8b_us"), "us",
                      "nccl.rtx4090x8_pcie_allreduce_8b_us",
                      (*pcie, *COLLECTIVE_LATENCY_INPUTS)))
    return pairs


def _training_pairs() -> list[Pair]:
    """DDP scaling and pipeline bubbles of whole training runs (Chapters 6, 7)."""
    v = _value
    # ResNet-50 (25.6 M parameters, fp32 gradients) on a DGX A100, at the
    # recipe's batch per GPU
    grad_bytes, batch = 4 * 25.6e6, v("dle_rn50.dgxa100_batch_per_gpu")
    pairs = []
    for prec in ("tf32", "amp"):
        one = v(f"dle_rn50.dgxa100_{prec}_1gpu_ips")
        step = ddp_step_seconds(batch / one, grad_bytes, 8, "nvlink_a100")
        pairs.append(Pair(
            f"DDP ResNet-50 on 8x A100, {prec.upper()}, throughput",
            8 * batch / step, v(f"dle_rn50.dgxa100_{prec}_8gpu_ips"), "img/s",
            f"dle_rn50.dgxa100_{prec}_8gpu_ips",
            (f"dle_rn50.dgxa100_{prec}_1gpu_ips", "dle_rn50.dgxa100_batch_per_gpu",
             "a100_sxm_80gb.nvlink_bandwidth_total_gbps",
             *NVLINK_EFFICIENCY_INPUTS, *COLLECTIVE_LATENCY_INPUTS)))
    # pipeline bubbles: the PyTorch tutorial (2 GPUs) from its 1-GPU time
    one = v("pt_mp_tutorial.resnet50_single_gpu_seconds")
    for key, m in (("resnet50_two_gpus_no_pipeline_seconds", 1),
                   ("resnet50_pipelined_split20_seconds", 6),
                   ("resnet50_pipelined_split12_seconds", 10)):
        pairs.append(Pair(
            f"ResNet-50 on 2 GPUs, {m} micro-batch{'es' if m > 1 else ''}, time",
            pipeline_seconds(one, 2, m), v(f"pt_mp_tutorial.{key}"), "s",
            f"pt_mp_tutorial.{key}", ("pt_mp_tutorial.resnet50_single_gpu_seconds",)))
    return pairs


def _network_pairs() -> list[Pair]:
    """All-reduces across nodes: every port of a node at NCCL's rate per port."""
    pairs = []
    for key, link, nic, ports, setup in (
            ("gtc24_dgx_h100_8x400g_busbw", "nvlink_h100", "ndr_infiniband", 8,
             "DGX H100 nodes, 8 x 400 Gb/s ports each"),
            ("gtc24_dgx_a100_8x200g_busbw", "nvlink_a100", "hdr_infiniband", 8,
             "DGX A100 nodes, 8 x 200 Gb/s ports each (NVIDIA's slide)"),
            ("nccl812_dgx_a100_8x200g_busbw", "nvlink_a100", "hdr_infiniband", 8,
             "DGX A100 nodes, 8 x 200 Gb/s ports each (NCCL's maintainer)"),
            ("nccltests119_3x_a100_4x_hdr_busbw", "nvlink_a100", "hdr_infiniband",
             4, "3 nodes of 8 A100s, 4 x 200 Gb/s ports each"),
            ("nccltests175_2x_a100_4x200g_busbw", "nvlink_a100", "hdr_infiniband",
             4, "2 nodes of 8 A100s, 4 x 200 Gb/s ports each"),
            ("gtc24_one_400g_nic_busbw", "nvlink_h100", "ndr_infiniband", 1,
             "one 400 Gb/s port per node"),
            ("gtc24_one_200g_nic_busbw", "nvlink_a100", "hdr_infiniband", 1,
             "one 200 Gb/s port per node")):
        measured = f"runs.allreduce_crossnode_{key}"
        pairs.append(Pair(
            f"all_reduce bus bandwidth across nodes, {setup}",
            group_busbw(16, 8, link, nic, ports) / 1e9, _value(measured), "GB/s",
            measured, (NICS[nic], *NIC_EFFICIENCY_INPUTS)))
    return pairs


def calibration_pairs() -> list[Pair]:
    """Every prediction the course's models make of a published measurement."""
    from course_utils import planner, serving  # whole runs and serving runs

    return [*_compute_pairs(), *_copy_pairs(), *_allreduce_pairs(),
            *_network_pairs(), *_training_pairs(), *planner.run_pairs(),
            *serving.serving_pairs()]


_HOST_READS = ("the same machine's device-to-host copy reaches the link's rate, so "
               "its host side limits reads of host memory; the source names neither "
               "CPU nor topology, and no model input exists for that host")
_AMOEBA = ("each row of the benchmark has its own batch size (96 to 1280), "
           "partition balance and checkpointing (its main.py), so a ratio of two "
           "rows is not the bubble's alone")
_AMP_LAYOUT = ("the recipe's AMP run also switches to channels-last memory format "
               "(configs.yml: memory_format nhwc for AMP only), so the speed-up is "
               "not the math mode's alone")
_AMP_STEP = ("tensor_math_speedup gives only the ceiling of the tensor-core math, "
             "not a step's speed-up: a step also runs work mixed precision does not "
             "speed up (ops kept in fp32, the optimizer, casts, launches, data "
             "loading), for a fraction of its time no source gives")

# published A100 training speed-ups, TF32 to mixed precision at the same batch
# per GPU, from NVIDIA's Deep Learning Examples (Chapter 8)
AMP_SPEEDUPS = tuple(f"dle_{m}.dgxa100_amp_speedup_{g}" for m, g in (
    ("gnmt", "1gpu"), ("gnmt", "8gpu"), ("transformer", "1gpu"),
    ("transformer", "8gpu"), ("nnunet", "2d_1gpu"), ("nnunet", "3d_1gpu"),
    ("tacotron2", "1gpu")))


def out_of_scope() -> list[OutOfScope]:
    """Published measurements of setups the models do not predict, with why.

    None is a calibration pair: each measures something else than the setup
    its nearest model describes (an extra timed step, a machine the source
    does not describe, a change besides the one modelled).
    """
    v = _value
    items = [
        ("pinned copy host to device, A100 PCIe server (PCIe 4.0 x16)",
         "bwtest.a100_pcie_pinned_h2d_gbps", "GB/s", _HOST_READS),
        ("pinned copy host to device, T4 cloud VM (PCIe 3.0 x16)",
         "bwtest.t4_pinned_h2d_gbps", "GB/s", _HOST_READS),
        ("pageable copy host to device, A100 PCIe server",
         "bwtest.a100_pcie_pageable_h2d_gbps", "GB/s",
         "it inherits that server's host-limited reads (pinned, above) and adds a "
         "staging copy at a host memcpy speed the source does not give"),
        ("all_reduce bus bandwidth, 2x H100 PCIe with an NVLink bridge",
         "nccl.h100_pcie_nvlink_bridge_allreduce_busbw_gbps", "GB/s",
         "under half the bridge's datasheet rate; the issue reporting it found no "
         "cause, so it measures a fault, not the link"),
        ("all_reduce bus bandwidth, 8x RTX 5090 over PCIe 5.0",
         "nccl.rtx5090x8_pcie5_allreduce_busbw_gbps", "GB/s",
         "8 GPUs share one host's PCIe and memory bandwidth (NCCL's maintainer, "
         "same issue), which the issue does not state; the model gives each GPU "
         "its own link"),
        *((f"mixed-precision speed-up (TF32 to AMP), ResNet-50, {g} A100",
           f"dle_rn50.dgxa100_amp_{g}gpu_ips", "x", _AMP_LAYOUT) for g in (1, 8)),
        *((f"mixed-precision speed-up (TF32 to AMP), {_entry(key)['quantity']}",
           key, "x", _AMP_STEP) for key in AMP_SPEEDUPS),
        *((f"GPipe AmoebaNet-D on {n} P40s, {m} micro-batch"
           f"{'es' if m > 1 else ''}", f"torchgpipe.amoebanetd_n{n}m{m}_ips",
           "samples/s", _AMOEBA)
          for n, m in ((2, 4), (2, 32), (4, 1), (4, 4), (4, 32), (8, 1), (8, 4),
                       (8, 32))),
        ("all_reduce bus bandwidth across 2 nodes of 8 A100s, 8 x 100 Gb/s ports",
         "runs.allreduce_crossnode_nccl812_2x_a100_8x100g_ring_busbw", "GB/s",
         "a user's run that NCCL's maintainer calls 'a little low' for its ports in "
         "the same thread; no model input exists for 100 Gb/s ports"),
        ("1000 launches of a += a on a 4x4 tensor, host time",
         "seed000.gpu_add_loop_seconds", "s",
         "the seed's timer also covers torch.ones(n, n).cuda(), on a GPU and "
         "PyTorch version it does not name"),
        ("queueing 50 matmuls of 4000 x 4000 without waiting, host time",
         "seed001.run_only_seconds", "s",
         "the seed's machine and PyTorch version are unknown, and a matmul's "
         "launch (cuBLAS dispatch) is not the elementwise launch the model has"),
    ]
    from course_utils import planner, serving  # runs no model covers

    out = []
    for setup, key, unit, reason in items:
        value = _entry(key)["value"]
        value = value["y"][0] if isinstance(value, dict) else v(key)
        if unit == "x" and _entry(key)["unit"] != "x":  # AMP's over TF32's rate
            value /= v(key.replace("_amp_", "_tf32_"))
        out.append(OutOfScope(setup, float(value), unit, key, reason))
    return out + planner.out_of_scope() + serving.out_of_scope()


def caveat(measured: str) -> str:
    """The line a chapter prints beside a prediction of ``measured``'s setup.

    Says why no model covers it when it is listed in ``out_of_scope``; empty
    when a calibration pair checks that measurement within ``BAND``.
    """
    for s in out_of_scope():
        if s.measured == measured:
            return f"caveat: no model here covers '{s.setup}': {s.reason}"
    if any(p.measured == measured and p.within for p in calibration_pairs()):
        return ""
    return f"caveat: no published measurement checks the model for {measured}"


def calibration_report() -> tuple[list[str], bool]:
    """The calibration lines and whether it passes.

    Two tables. The calibration: every prediction of a published measurement
    of the same setup; it passes when every ratio lies within ``BAND`` and
    there are at least ``MIN_PAIRS``. Then the published measurements outside
    the models' scope, each with its reason: printed, never counted.
    """
    pairs = calibration_pairs()
    bad = [p for p in pairs if not p.within]
    lines = [f"Calibration: {len(pairs)} predictions, each against a published "
             f"measurement of the same setup (band [{BAND[0]}, {BAND[1]}])"]
    lines += [p.line() for p in pairs]
    lines.append(f"{len(pairs) - len(bad)} pairs within [{BAND[0]}, {BAND[1]}], "
                 f"{len(bad)} outside it")
    lines += [f"outside the band: {p.setup}" for p in bad]
    from course_utils import planner, serving

    runs = [p for p in pairs if not serving.is_serving(p)]
    fit = [p for p in runs if p.setup.startswith("[fit]")]
    held = [p for p in runs if p.setup.startswith("[check]")]
    if fit and held:
        lines.append(
            f"whole runs: the activation traffic "
            f"({planner.fitted_activation_traffic():.0f} x 2 bytes per token and "
            f"hidden unit) fitted on the {len(fit)} pairs marked [fit]; the "
            f"{len(held)} marked [check] were held back from the fit, ratios "
            f"{min(p.ratio for p in held):.2f}-{max(p.ratio for p in held):.2f}")
    if any(serving.is_serving(p) for p in pairs):
        lines.append(serving.fit_summary(pairs))
    if len(pairs) < MIN_PAIRS:
        lines.append(f"too few calibration pairs: {len(pairs)} < {MIN_PAIRS}")
    scope = out_of_scope()
    lines += ["", f"Published measurements outside the models' scope: {len(scope)} "
              "(not calibration pairs, never counted; a chapter that shows a "
              "prediction near one prints its caveat)"]
    lines += [s.line() for s in scope]
    return lines, not bad and len(pairs) >= MIN_PAIRS


def main(argv: list[str] | None = None) -> int:
    """``python -m course_utils.predict --calibration``: exit 1 if a pair fails."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_utils.predict")
    parser.add_argument("--calibration", action="store_true",
                        help="print every prediction beside its published measurement")
    args = parser.parse_args(argv)
    if not args.calibration:
        parser.print_help()
        return 2
    lines, ok = calibration_report()
    print("\n".join(lines))
    return 0 if ok else 1


def tp_layer_comm_seconds(tokens: int, hidden: int, tp: int,
                          link: str = "nvlink_h100", dtype_bytes: int = 2,
                          collectives: int = 4) -> reference.Figure:
    """One transformer layer's tensor-parallel collectives per step (Chapter 10).

    Megatron's layer (Q, K, V fused) all-reduces its ``(tokens, hidden)``
    activation ``collectives`` = 4 times per training step (2 forward, 2
    backward); with sequence parallelism each becomes a reduce-scatter and an
    all-gather, the same bytes. Each is the step model's all-reduce
    (``collective_seconds``): over ``link`` inside a node (NVSwitch gives
    every GPU its full NVLink bandwidth), or, for a network port such as
    ``"ndr_infiniband"``, with the ``tp`` GPUs in different nodes, one port
    each. Nothing overlapped with compute.
    """
    if tp < 2:
        raise ValueError(f"tp must be at least 2, not {tp}")
    nbytes = tokens * hidden * dtype_bytes
    if link in NICS:  # the ranks in different nodes, one GPU each
        one = collective_seconds("all_reduce", nbytes, tp, 1, "nvlink_h100", link)
        inputs = [NICS[link], *NIC_EFFICIENCY_INPUTS, *COLLECTIVE_LATENCY_INPUTS]
        where = f"{tp} GPUs in {tp} nodes, one {link.replace('_', ' ')} port each"
    else:
        one = collective_seconds("all_reduce", nbytes, tp, tp, link)
        inputs = list(allreduce_inputs(nbytes, tp, link))
        where = f"{tp} GPUs over {link.replace('_', ' ')}"
    return reference.predicted(
        collectives * one, "s", where,
        f"{collectives} NCCL all-reduces of a ({tokens}, {hidden}) activation, "
        f"{dtype_bytes} bytes each, {one * 1e6:.0f} us each (the step model's "
        "collectives, calibrated), not overlapped with compute", inputs)


def exchange_seconds(sent_bytes: float, peers: int, link: str = "nvlink_h100",
                     gpu: str = "") -> reference.Figure:
    """Each GPU sends ``sent_bytes`` in all to ``peers`` others at once (Chapter 11).

    ``collective_latency() + sent_bytes / (link x efficiency)``: the calibrated
    latency and the rate NCCL reaches on the link. It fits the all-to-all of an
    expert-parallel layer (each GPU's share for the other ``n - 1``) and one
    step of ring attention (one K/V block to one neighbour, ``peers=1``) as
    long as every GPU has its full link bandwidth whatever the mix of peers, as
    NVSwitch gives inside an 8-GPU node. Uneven splits make the busiest GPU
    set the time; across nodes the slower network link does.
    """
    if peers < 1:
        raise ValueError(f"peers must be at least 1, not {peers}")
    rate = achieved_link_bandwidth(link)
    return reference.predicted(
        collective_latency() + sent_bytes / rate, "s",
        gpu or link.replace("_", " "),
        f"latency {collective_latency() * 1e6:.0f} us + {sent_bytes:.3g} bytes sent "
        f"to {peers} peer{'s' if peers > 1 else ''} / {rate / 1e9:.4g} GB/s "
        f"(the rate NCCL reaches), every GPU at its full link bandwidth",
        [LINKS[link][0], *COLLECTIVE_LATENCY_INPUTS,
         *(NVLINK_EFFICIENCY_INPUTS if link.startswith("nvlink")
           else PCIE_EFFICIENCY_INPUTS)],
        caveat=EXCHANGE_CAVEAT)


EXCHANGE_CAVEAT = ("not calibrated: no published measurement of a point-to-point "
                   "send or an all-to-all was found; its latency and rate are "
                   "those of the all-reduces the calibration checks")


if __name__ == "__main__":
    raise SystemExit(main())
