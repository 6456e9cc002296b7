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

The calibrated models, which add what dominates small and real workloads, each
input a published *measurement* (``reference_data/published/calibration.json``):

- ``kernel_seconds``: per-launch host cost (PyTorch's dispatch plus a CUDA
  launch) overlapping the kernel's time at the *achieved* FLOP/s and bandwidth.
- ``calibrated_copy_seconds``: pinned copies at the rate PCIe copies reach;
  pageable ones add the driver's staging copy.
- ``allreduce_seconds``: NCCL's ring, a per-collective latency plus
  ``2 (n - 1) / n x bytes`` at the link's achieved rate. Conventions are
  nccl-tests': algbw = bytes / time, busbw = algbw x 2 (n - 1) / n.
- ``pipeline_seconds``, ``ddp_step_seconds``, ``mixed_precision_speedup``.

``python -m course_utils.predict --calibration`` prints every prediction of a
setup someone measured beside that measurement, with the ratio; it exits
non-zero when a ratio leaves [0.8, 1.25] (known gaps, each with its reason,
are printed and excepted; ``--strict`` fails on them too).

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
    )


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


def allreduce_seconds(nbytes: float, n: int, link: str = "nvlink_h100",
                      gpu: str = "") -> reference.Figure:
    """An all-reduce of ``nbytes`` over ``n`` GPUs: latency plus NCCL's ring.

    ``collective_latency() + 2 (n - 1) / n x bytes / (link x efficiency)``:
    NCCL's ring algorithm, whose per-GPU traffic defines nccl-tests' *bus
    bandwidth* convention (busbw = algbw x 2(n-1)/n, algbw = bytes / time).
    NCCL picks other algorithms too (tree; NVLS, the reduction inside an
    NVSwitch, on H100/H200 nodes from about 2 MiB), which can beat the ring.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    if n == 1:
        t = 0.0
    else:
        t = collective_latency() + 2 * (n - 1) / n * nbytes / achieved_link_bandwidth(
            link)
    return reference.predicted(
        t, "s", gpu or f"{n} GPUs over {link.replace('_', ' ')}",
        f"NCCL ring all-reduce: latency {collective_latency() * 1e6:.0f} us + "
        f"2(n-1)/n x bytes / {achieved_link_bandwidth(link) / 1e9:.4g} GB/s "
        f"(bus bandwidth), n={n}, {nbytes:.3g} bytes",
        list(dict.fromkeys([LINKS[link][0], *COLLECTIVE_LATENCY_INPUTS,
                            *(NVLINK_EFFICIENCY_INPUTS if link.startswith("nvlink")
                              else PCIE_EFFICIENCY_INPUTS)])))


def algbw(nbytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: bytes / time."""
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2 (n - 1) / n."""
    return algbw(nbytes, seconds) * 2 * (n - 1) / n


def pipeline_seconds(t_one: float, stages: int, microbatches: int) -> float:
    """GPipe schedule time for work that takes ``t_one`` on one device.

    ``stages`` equal stages, the batch in ``microbatches``: each stage does
    ``t_one / (stages x microbatches)`` per micro-batch, and the last one
    finishes after ``microbatches + stages - 1`` such slots (the bubble).
    """
    if stages < 1 or microbatches < 1:
        raise ValueError("stages and microbatches must be at least 1")
    return t_one * (microbatches + stages - 1) / (stages * microbatches)


def mixed_precision_speedup(gpu: str, low: str = "bf16",
                            high: str = "tf32") -> tuple[float, float]:
    """Bounds on the training speed-up from ``high`` to ``low`` precision math.

    Memory-bound work moves half the bytes (2x); tensor-core math speeds up by
    the ratio of peaks. A step mixing both speeds up by at least the smaller
    and at most the larger (Amdahl). Returns ``(low_bound, high_bound)``.
    """
    ratio = peak_flops(gpu, low) / peak_flops(gpu, high)
    return min(2.0, ratio), max(2.0, ratio)


def ddp_step_seconds(t_compute: float, grad_bytes: float, n: int,
                     link: str = "nvlink_h100") -> float:
    """A data-parallel step: one GPU's compute plus its gradient all-reduce.

    The all-reduce is not overlapped with the backward pass here (an upper
    bound on its cost; DDP's buckets hide most of it).
    """
    return t_compute + allreduce_seconds(grad_bytes, n, link).value


# --- calibration: predictions against published measurements -------------------------

BAND = (0.8, 1.25)


@dataclass
class Pair:
    """One setup predicted by a model and measured by someone else.

    ``ratio`` is predicted / published for the quantity as published. ``gap``
    names why a model does not cover the setup; such a pair is shown, with
    its ratio, but marked as a known gap (and the chapters print a caveat).
    """

    setup: str
    predicted: float
    published: float
    unit: str
    measured: str
    inputs: tuple[str, ...]
    gap: str = ""

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        return BAND[0] <= self.ratio <= BAND[1]

    def line(self) -> str:
        head = (f"{self.setup}: predicted {self.predicted:.4g} {self.unit}, published "
                f"measurement {self.published:.4g} {self.unit} "
                f"[{self.measured}], ratio {self.ratio:.2f}")
        return head + (f"  (known gap: {self.gap})" if self.gap else "")


def _pinned_rate(link: str) -> float:
    return achieved_link_bandwidth(link) / 1e9


def calibration_pairs() -> list[Pair]:
    """Every prediction the course's models make of a published measurement."""
    v = _value
    pairs: list[Pair] = []
    mm = MATMUL_EFFICIENCY_INPUTS
    for key, gpu, setup in (
            ("mamf.h100_sxm_bf16_tflops", "h100_sxm", "bf16 matmul, H100 SXM"),
            ("mamf.a100_pcie_bf16_tflops", "a100_sxm_80gb",
             "bf16 matmul, A100 PCIe (same datasheet peak as the SXM)")):
        pairs.append(Pair(setup, achieved_flops(gpu, "bf16") / 1e12, v(key),
                          "TFLOP/s", key, (peak_key(gpu, "bf16"), *mm)))
    pairs.append(Pair(
        "HBM device-to-device copy, A100-SXM4-40GB",
        memory_bandwidth("a100_sxm_40gb") * memory_efficiency() / 1e9,
        v("bwtest.a100_sxm4_40gb_d2d_gbps"), "GB/s", "bwtest.a100_sxm4_40gb_d2d_gbps",
        ("a100_sxm_40gb.memory_bandwidth_gbps", *MEMORY_EFFICIENCY_INPUTS)))
    pcie = PCIE_EFFICIENCY_INPUTS
    host_gap = ("host-to-device reads of host memory run below the link's rate on "
                "some servers; the model has no input for the host side")
    for key, link, setup, gap in (
            ("bwtest.a100_pcie_pinned_d2h_gbps", "pcie4_x16",
             "pinned copy device to host, A100 PCIe server (PCIe 4.0 x16)", ""),
            ("bwtest.t4_pinned_d2h_gbps", "pcie3_x16",
             "pinned copy device to host, T4 cloud VM (PCIe 3.0 x16)", ""),
            ("bwtest.a100_pcie_pinned_h2d_gbps", "pcie4_x16",
             "pinned copy host to device, A100 PCIe server (PCIe 4.0 x16)", host_gap),
            ("bwtest.t4_pinned_h2d_gbps", "pcie3_x16",
             "pinned copy host to device, T4 cloud VM (PCIe 3.0 x16)", host_gap)):
        pairs.append(Pair(setup, _pinned_rate(link), v(key), "GB/s", key,
                          (LINKS[link][0], *pcie), gap))
    page_gap = ("a pageable copy's staging copy runs at the host's memcpy speed, "
                "which varies by machine (3.3 to 10.8 GB/s published for A100 "
                "servers)")
    for key, setup, gap in (("bwtest.a100_pcie_pageable_d2h_gbps",
                             "pageable copy device to host, A100 PCIe server", ""),
                            ("bwtest.a100_pcie_pageable_h2d_gbps",
                             "pageable copy host to device, A100 PCIe server",
                             page_gap)):
        rate = 1 / (1 / achieved_link_bandwidth("pcie4_x16") + 1 / host_copy_rate())
        pairs.append(Pair(setup, rate / 1e9, v(key), "GB/s", key,
                          ("pcie4_x16.bandwidth_per_direction_gbps", *pcie,
                           *PAGEABLE_INPUTS), gap))
    # all-reduce on NVLink: an 8-GPU sweep (the latency input is its 32 KiB point,
    # a separate measurement of the same run)
    sweep = _entry("nccl.h200x8_allreduce_sweep")["value"]
    nvl = ("h100_sxm.nvlink_bandwidth_total_gbps", *NVLINK_EFFICIENCY_INPUTS,
           *COLLECTIVE_LATENCY_INPUTS)
    for size, t in zip(sweep["x"], sweep["y"], strict=True):
        gap = ("NCCL uses NVLS (the reduction inside the NVSwitch) at this size, "
               "which beats the ring the model assumes") if size > 2**30 else ""
        pairs.append(Pair(
            f"all_reduce of {size / 2**20:,.0f} MiB on 8x H200 (NVLink 4), time",
            allreduce_seconds(size, 8, "nvlink_h100").value * 1e6, t * 1e6, "us",
            "nccl.h200x8_allreduce_sweep", nvl, gap))
    ring = achieved_link_bandwidth("nvlink_h100") / 1e9
    pairs.append(Pair("all_reduce bus bandwidth, 8x H200 with NVLS off (ring)", ring,
                      v("nccl.h200x8_ring_busbw_gbps"), "GB/s",
                      "nccl.h200x8_ring_busbw_gbps",
                      ("h100_sxm.nvlink_bandwidth_total_gbps",
                       *NVLINK_EFFICIENCY_INPUTS)))
    pairs.append(Pair("all_reduce bus bandwidth, 8x A100 (NVLink 3)",
                      achieved_link_bandwidth("nvlink_a100") / 1e9,
                      v("nccl.a100x8_allreduce_busbw_gbps"), "GB/s",
                      "nccl.a100x8_allreduce_busbw_gbps",
                      ("a100_sxm_80gb.nvlink_bandwidth_total_gbps",
                       *NVLINK_EFFICIENCY_INPUTS)))
    pairs.append(Pair("all_reduce bus bandwidth, 2x H100 PCIe with an NVLink bridge",
                      _value("h100_pcie.nvlink_bridge_bandwidth_gbps") / 2
                      * nvlink_efficiency(),
                      v("nccl.h100_pcie_nvlink_bridge_allreduce_busbw_gbps"), "GB/s",
                      "nccl.h100_pcie_nvlink_bridge_allreduce_busbw_gbps",
                      ("h100_pcie.nvlink_bridge_bandwidth_gbps",
                       *NVLINK_EFFICIENCY_INPUTS),
                      "the bridged pair reaches under half the bridge's rate; the "
                      "issue reporting it found no cause"))
    # all-reduce on PCIe
    pairs.append(Pair("all_reduce bus bandwidth, 4x RTX 4090 over PCIe 4.0",
                      _pinned_rate("pcie4_x16"),
                      v("nccl.rtx4090x4_pcie_allreduce_busbw_gbps"), "GB/s",
                      "nccl.rtx4090x4_pcie_allreduce_busbw_gbps",
                      ("pcie4_x16.bandwidth_per_direction_gbps", *pcie)))
    pairs.append(Pair("all_reduce bus bandwidth, 8x RTX 5090 over PCIe 5.0",
                      _pinned_rate("pcie5_x16"),
                      v("nccl.rtx5090x8_pcie5_allreduce_busbw_gbps"), "GB/s",
                      "nccl.rtx5090x8_pcie5_allreduce_busbw_gbps",
                      ("pcie5_x16.bandwidth_per_direction_gbps", *pcie),
                      "8 GPUs on PCIe share the CPU's and memory's bandwidth "
                      "(NCCL's maintainer); the model gives each GPU its own link"))
    pairs.append(Pair("all_reduce of 8 bytes on 8x RTX 4090 (PCIe), time",
                      allreduce_seconds(8, 8, "pcie4_x16").value * 1e6,
                      v("nccl.rtx4090x8_pcie_allreduce_8b_us"), "us",
                      "nccl.rtx4090x8_pcie_allreduce_8b_us",
                      ("pcie4_x16.bandwidth_per_direction_gbps", *pcie,
                       *COLLECTIVE_LATENCY_INPUTS)))
    # DDP scaling: ResNet-50 (25.6 M parameters, fp32 gradients) on a DGX A100. The
    # README does not state the batch per GPU; 256 is assumed (any batch from 64 to
    # 256 moves these ratios by under 2 %: the all-reduce is under 1 ms of a step).
    grad_bytes, batch = 4 * 25.6e6, 256
    for prec in ("tf32", "amp"):
        one = v(f"dle_rn50.dgxa100_{prec}_1gpu_ips")
        step = ddp_step_seconds(batch / one, grad_bytes, 8, "nvlink_a100")
        pairs.append(Pair(
            f"DDP ResNet-50 on 8x A100, {prec.upper()}, throughput",
            8 * batch / step, v(f"dle_rn50.dgxa100_{prec}_8gpu_ips"), "img/s",
            f"dle_rn50.dgxa100_{prec}_8gpu_ips",
            (f"dle_rn50.dgxa100_{prec}_1gpu_ips",
             "a100_sxm_80gb.nvlink_bandwidth_total_gbps",
             *NVLINK_EFFICIENCY_INPUTS, *COLLECTIVE_LATENCY_INPUTS)))
    # mixed precision: the larger of the two bounds (tensor-core ratio, 2x bytes)
    lo, hi = mixed_precision_speedup("a100_sxm_80gb", "bf16", "tf32")
    for gpus in (1, 8):
        amp = v(f"dle_rn50.dgxa100_amp_{gpus}gpu_ips")
        tf32 = v(f"dle_rn50.dgxa100_tf32_{gpus}gpu_ips")
        pairs.append(Pair(
            f"mixed-precision speed-up (TF32 to AMP), ResNet-50, {gpus} A100",
            hi, amp / tf32, "x", f"dle_rn50.dgxa100_amp_{gpus}gpu_ips",
            ("a100_sxm_80gb.bf16_tensor_dense_tflops",
             "a100_sxm_80gb.tf32_tensor_dense_tflops"),
            "" if gpus == 8 else "the measured speed-up beats both bounds: TF32 "
            "kernels reach less of their peak than fp16 ones, which the model's "
            "single efficiency cannot show"))
    # pipeline bubbles: the PyTorch tutorial (2 GPUs) from its 1-GPU time
    one = v("pt_mp_tutorial.resnet50_single_gpu_seconds")
    for key, m in (("resnet50_two_gpus_no_pipeline_seconds", 1),
                   ("resnet50_pipelined_split20_seconds", 6),
                   ("resnet50_pipelined_split12_seconds", 10)):
        pairs.append(Pair(
            f"ResNet-50 on 2 GPUs, {m} micro-batch{'es' if m > 1 else ''}, time",
            pipeline_seconds(one, 2, m), v(f"pt_mp_tutorial.{key}"), "s",
            f"pt_mp_tutorial.{key}", ("pt_mp_tutorial.resnet50_single_gpu_seconds",)))
    # pipeline bubbles: torchgpipe's AmoebaNet-D, relative to 2 stages, 1 micro-batch
    base = v("torchgpipe.amoebanetd_n2m1_ips")
    imbalance = ("AmoebaNet-D's partitions are unequal, so the slowest stage sets "
                 "the pace; the model assumes equal stages")
    for n, m, gap in ((2, 4, ""), (2, 32, ""), (4, 1, ""), (4, 4, imbalance),
                      (4, 32, imbalance), (8, 1, ""), (8, 4, ""), (8, 32, imbalance)):
        pred = pipeline_seconds(1, 2, 1) / pipeline_seconds(1, n, m)
        meas = v(f"torchgpipe.amoebanetd_n{n}m{m}_ips") / base
        pairs.append(Pair(
            f"GPipe AmoebaNet-D on P40s, {n} stages, {m} micro-batch"
            f"{'es' if m > 1 else ''}, throughput over 2 stages and 1",
            pred, meas, "x", f"torchgpipe.amoebanetd_n{n}m{m}_ips",
            ("torchgpipe.amoebanetd_n2m1_ips",), gap))
    # training compute: 6 P T FLOPs at the achieved matmul rate vs Megatron's run
    pairs.append(Pair(
        "large-model training throughput per A100 (Megatron-LM, 3072 GPUs)",
        achieved_flops("a100_sxm_80gb", "bf16") / 1e12,
        v("megatron_2021.aggregate_pflops") * 1e3 / v("megatron_2021.gpu_count"),
        "TFLOP/s", "megatron_2021.aggregate_pflops",
        ("a100_sxm_80gb.bf16_tensor_dense_tflops", *mm),
        "a training step is not one large matmul: attention, communication, "
        "pipeline bubbles and memory-bound layers cut it to about 52% of peak"))
    # launch-bound: 1000 tiny in-place adds, host time (the seed's unsynchronised loop)
    seed = _entry("seed000.gpu_add_loop_seconds")["value"]
    pairs.append(Pair(
        "1000 launches of a += a on a 4x4 tensor, host time",
        kernel_seconds(16, 2 * 4 * 16, "h100_sxm", launches=1000).value,
        seed["y"][0], "s", "seed000.gpu_add_loop_seconds", LAUNCH_INPUTS,
        "the seed's timer also covers torch.ones(n, n).cuda() and its machine, "
        "GPU and PyTorch version are unknown; no published measurement of "
        "a PyTorch launch loop on a named machine was found"))
    pairs.append(Pair(
        "queueing 50 matmuls of 4000 x 4000 without waiting, host time",
        50 * launch_overhead(), _value("seed001.run_only_seconds"), "s",
        "seed001.run_only_seconds", LAUNCH_INPUTS,
        "a matmul's launch costs more than an elementwise kernel's (cuBLAS "
        "dispatch), and the seed's machine and PyTorch version are unknown"))
    return pairs


def calibration_report(strict: bool = False) -> tuple[list[str], bool]:
    """The calibration lines and whether it passes.

    Two tables. The calibration: every pair a model covers, each of which must
    have its ratio within ``BAND`` (at least 20 of them). The known gaps:
    published measurements of setups the chapters show that a model leaves
    out, each with the term it lacks; they are printed, never counted as
    calibrated, and a gap that closes must lose its label. ``strict`` fails on
    the gaps too.
    """
    pairs = calibration_pairs()
    covered = [p for p in pairs if not p.gap]
    gaps = [p for p in pairs if p.gap]
    bad = [p for p in covered if not p.within]
    lines = [f"Calibration: {len(covered)} predictions a model covers, each against "
             f"a published measurement (band [{BAND[0]}, {BAND[1]}])"]
    lines += [p.line() for p in covered]
    lines.append(f"{len(covered) - len(bad)} pairs within [{BAND[0]}, {BAND[1]}], "
                 f"{len(bad)} outside it")
    lines.append("")
    lines.append(f"Known gaps: {len(gaps)} published measurements the models do not "
                 "reproduce (not calibrated; a chapter that shows one prints a caveat)")
    lines += [p.line() for p in gaps]
    stale = [p for p in gaps if p.within]
    for p in stale:
        lines.append(f"known gap now within the band, remove its label: {p.setup}")
    if len(covered) < 20:
        lines.append(f"too few calibrated pairs: {len(covered)} < 20")
    ok = (not bad and not stale and len(covered) >= 20
          and not (strict and any(not p.within for p in gaps)))
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    """``python -m course_utils.predict --calibration [--strict]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_utils.predict")
    parser.add_argument("--calibration", action="store_true",
                        help="print every prediction beside its published measurement")
    parser.add_argument("--strict", action="store_true",
                        help="fail on known gaps too")
    args = parser.parse_args(argv)
    if not args.calibration:
        parser.print_help()
        return 2
    lines, ok = calibration_report(args.strict)
    print("\n".join(lines))
    return 0 if ok else 1


# link name -> published id of its one-direction bandwidth (Chapter 10)
_TP_LINKS = {"ndr_infiniband": "ndr_infiniband.bandwidth_per_direction_gbps"}


def tp_layer_comm_seconds(tokens: int, hidden: int, tp: int,
                          link: str = "nvlink_h100", dtype_bytes: int = 2,
                          collectives: int = 4) -> reference.Figure:
    """One transformer layer's tensor-parallel collectives per step (Chapter 10).

    Megatron's layer (Q, K, V fused) all-reduces its ``(tokens, hidden)``
    activation ``collectives`` = 4 times per training step (2 forward, 2
    backward); with sequence parallelism each becomes a reduce-scatter and an
    all-gather, the same bytes. Each costs the ring's bandwidth term,
    ``2 (tp - 1) / tp x bytes / bandwidth`` of the ring's slowest link:
    ``nvlink_h100`` inside an 8-GPU node (NVSwitch gives every GPU its full
    NVLink bandwidth), ``ndr_infiniband`` once the ring leaves the node (each
    GPU's one 400 Gb/s port). No latency, no overlap with compute.
    """
    if tp < 2:
        raise ValueError(f"tp must be at least 2, not {tp}")
    if link in _TP_LINKS:
        key = _TP_LINKS[link]
        e = _entry(key)
        assert e["unit"] == "GB/s", e
        bw = float(e["value"]) * 1e9
    else:
        bw, key = link_bandwidth(link), LINKS[link][0]
    nbytes = tokens * hidden * dtype_bytes
    t = collectives * 2 * (tp - 1) / tp * nbytes / bw
    return reference.predicted(
        t, "s", f"{tp} GPUs over {link.replace('_', ' ')}",
        f"{collectives} ring all-reduces of a ({tokens}, {hidden}) activation, "
        f"{dtype_bytes} bytes each: {collectives} x 2(t-1)/t x bytes / link "
        f"bandwidth ({bw / 1e9:.4g} GB/s each way), t={tp}, no latency, no overlap",
        [key],
    )


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
           else PCIE_EFFICIENCY_INPUTS)])


if __name__ == "__main__":
    raise SystemExit(main())
