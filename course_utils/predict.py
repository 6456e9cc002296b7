"""Predicted GPU figures: simple, named models fed with published numbers.

Introduced in Chapter 2. A learner without a GPU still sees what a GPU would
do, as a *prediction*: a formula (the model) applied to published datasheet
figures (its inputs, each cited). Every function here returns a
``reference.Figure`` of kind ``"predicted"`` whose label names the model and
the sources of its inputs, so a prediction is never mistaken for a
measurement. The models are deliberately the textbook ones - they give the
right order of magnitude and the right shape of a curve, not the last 20 %:

- ``roofline_seconds``: a kernel takes at least ``max(flops / peak, bytes /
  bandwidth)`` (Williams, Waterman and Patterson, *Roofline*, CACM 2009).
- ``copy_seconds``: ``bytes / link bandwidth`` for a host-device copy or a
  point-to-point transfer.
- ``ring_allreduce_seconds``: each of ``n`` ranks sends and receives
  ``2 (n - 1) / n`` times the buffer (the bandwidth term of the ring
  algorithm that NCCL and gloo use).

GPUs are named by the subjects of ``reference_data/published/gpus.json``:
``h100_sxm``, ``h100_pcie``, ``a100_sxm_80gb``, ``l4``, ``t4``, ``rtx_4090``.
"""

from __future__ import annotations

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
