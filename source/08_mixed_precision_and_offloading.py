# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 8: Mixed precision and offloading
#
# **What you will learn**
#
# - The floating-point formats deep learning uses - fp32, tf32, fp16, bf16 -
#   from their real bits: range, precision, and what rounds to zero or infinity.
# - `torch.autocast`, and why fp16 needs a gradient scaler while bf16 does not.
# - Where a training step's memory goes (parameters, gradients, optimizer
#   state, activations), counted exactly; how activation checkpointing and
#   offloading trade time for memory - the seeds' "living with too little GPU".
#
# **Hardware.** Everything runs on a CPU: autocast works there with bfloat16
# (and float16, slowly), the gradient scaler too, and memory is counted by
# deterministic counters - a saved-tensors hook and PyTorch's `MemTracker` -
# rather than by GPU counters (on a CPU-only build
# `torch.cuda.memory_allocated()` returns 0 without an error). With a GPU,
# each measurement also runs there, beside its CPU twin: fp32/bf16/fp16 and
# TF32 speed, `torch.cuda.max_memory_allocated` beside the counters,
# checkpointing's peak and `save_on_cpu`. A GPU older than Ampere (compute
# capability below 8.0, e.g. a T4) has no bf16 tensor cores and no TF32: the
# cells say so and show what happens instead. Without a GPU, GPU speed-ups
# are shown as published datasheet peaks and training measurements, and
# labelled predictions.

# %%
import copy
import inspect
import os
import tempfile
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import Image, display
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_utils import banner, bench, predict, reference
from course_utils.bench import format_seconds
from course_utils.build import ROOT
from course_utils.checks.ch08 import (
    check_cheapest_format,
    check_offloaded,
    check_recompute,
    check_scaled_step,
)
from course_utils.compare import compare
from course_utils.compat import MemTracker  # torch.distributed._tools.mem_tracker

banner()
FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}
# with its index: MemTracker files memory under cuda:0, not under "cuda"
gpu = (torch.device("cuda", torch.cuda.current_device())
       if torch.cuda.is_available() else None)
if gpu:
    major, minor = torch.cuda.get_device_capability(gpu)
    print(f"GPU: {torch.cuda.get_device_name(gpu)}, compute capability "
          f"{major}.{minor}: " + ("bf16 tensor cores and TF32" if major >= 8 else
                                 "fp16 tensor cores only - no bf16 tensor cores, "
                                 "no TF32"))

# %% [markdown]
# ## 1. Number formats, from their bits
#
# A float is a sign, an exponent and a mantissa. The exponent's bits set the
# **range** (how large and how small a number can be); the mantissa's bits set
# the **precision** (how many significant digits). bf16 keeps fp32's 8
# exponent bits and cuts the mantissa to 7; fp16 has more mantissa (10) but
# only 5 exponent bits. tf32 is not a storage format: it is how tensor cores
# on NVIDIA GPUs (since Ampere) multiply fp32 inputs, with fp16's 10 mantissa
# bits and fp32's range.

# %%
display(Image(filename=str(ROOT / "images" / "number_formats.png")))
print(f"{'format':9} {'bits':>4} {'largest':>11} {'smallest normal':>16} "
      f"{'epsilon':>10}")
for name, dt in FORMATS.items():
    fi = torch.finfo(dt)
    print(f"{name:9} {fi.bits:>4} {fi.max:>11.4g} {fi.tiny:>16.4g} {fi.eps:>10.3g}")
fi8 = torch.finfo(torch.float8_e4m3fn)
print(f"(float8_e4m3fn, for the newest GPUs: {fi8.bits} bits, largest {fi8.max:g})")

# %% [markdown]
# The bits are real: `.view()` reinterprets a tensor's memory as integers, so
# we can print them. And rounding shows what each format cannot hold:

# %%
def bits(value, dtype):
    """'s eeeee mmmmmmmmmm': the stored bits of value in dtype."""
    t = torch.tensor([value], dtype=dtype)
    width = torch.finfo(dtype).bits
    as_int = t.view({16: torch.int16, 32: torch.int32}[width]).item() % (1 << width)
    b = format(as_int, f"0{width}b")
    exp = {torch.float32: 8, torch.bfloat16: 8, torch.float16: 5}[dtype]
    return f"{b[0]} {b[1:1 + exp]} {b[1 + exp:]}"


for value in (1.0, 0.1, 70000.0, 1e-8, 1 + 1 / 512):
    print(f"{value!r:>18}")
    for name, dt in FORMATS.items():
        stored = torch.tensor(value, dtype=dt).item()
        print(f"    {name:9} {bits(value, dt):>36}  -> {stored!r}")

# %% [markdown]
# Read the three interesting rows: 70000 is beyond fp16's largest value
# (65504) and becomes `inf`; 1e-8 is below half of fp16's smallest
# subnormal and becomes 0, while bf16 keeps both (with few digits); and
# 1 + 1/512 needs 9
# mantissa bits, so bf16 rounds it to 1. Drag the slider to see any value's
# bits and rounding:

# %%
def show_value(log10_value=-1.0):
    value = 10**log10_value
    for name, dt in FORMATS.items():
        stored = torch.tensor(value, dtype=dt).item()
        err = abs(stored - value) / value
        print(f"{name:9} {bits(value, dt):>36}  {stored:.6g}  (relative error "
              f"{err:.1e})")


widgets.interact(show_value, log10_value=widgets.FloatSlider(
    min=-10, max=6, step=0.25, value=-1.0, description="log10 x",
    continuous_update=False));

# %% [markdown]
# ## 2. `torch.autocast`
#
# Mixed precision keeps the parameters in fp32 and runs the operations that
# gain from it (matmuls, convolutions) in a 16-bit format, leaving the ones
# that need range or accuracy (losses, reductions) in fp32. `torch.autocast`
# picks per operation. The lists differ by device: on CUDA, softmax runs in
# fp32; on the CPU it stays in its input's dtype.

# %%
lin = nn.Linear(64, 64)
xa = torch.randn(8, 64)
with torch.autocast("cpu", dtype=torch.bfloat16):
    h = lin(xa)
    p = torch.softmax(h, dim=-1)
    loss = nn.functional.mse_loss(h, torch.zeros_like(h))
print(f"under CPU autocast (bf16): linear -> {h.dtype}, softmax -> {p.dtype}, "
      f"mse_loss -> {loss.dtype}; the parameters stay {lin.weight.dtype}")
if torch.cuda.is_available():  # the same three operations under CUDA autocast
    lin_g, xa_g = lin.cuda(), xa.cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        h = lin_g(xa_g)
        p = torch.softmax(h, dim=-1)
        loss = nn.functional.mse_loss(h, torch.zeros_like(h))
    print(f"under CUDA autocast (fp16): linear -> {h.dtype}, softmax -> {p.dtype}, "
          f"mse_loss -> {loss.dtype}")
    lin = lin.cpu()
else:
    print("no GPU here: on CUDA, autocast puts softmax on its float32 list "
          "(the autocast op reference in PyTorch's documentation)")

# %% [markdown]
# Is it faster? Only where the hardware has fast 16-bit arithmetic. Recent
# server CPUs have bf16 instructions (AVX512-BF16, AMX); on others bf16 may be
# slower than fp32, and fp16 is very slow on CPUs (a tiny size here). The
# cell reads which instructions this CPU has, then compares the two formats
# with the comparison protocol. On GPUs the tensor cores are many times
# faster in 16 bits than fp32 (the published peaks below); with a GPU, the
# same matmuls run there too.

# %%
caps = torch.cpu.get_capabilities()
bf16_units = [k for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
              if caps.get(k)]
print(f"this CPU: {caps.get('cpu_name', '?')}, vector unit "
      f"{torch.backends.cpu.get_cpu_capability()}, bf16 instructions: "
      f"{', '.join(bf16_units) or 'none'}")


def matmuls(n, dtype, device, number):
    """A function that runs `number` n x n matmuls in dtype and waits for them."""
    a = torch.randn(n, n, device=device).to(dtype)

    def run():
        for _ in range(number):
            torch.mm(a, a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def one_matmul(n, dtype):
    """(fastest, slowest) seconds of one n x n matmul in dtype, one thread."""
    a = torch.randn(n, n).to(dtype)
    times = bench(torch.mm, a, a, min_run_time=0.05, num_threads=1).times
    return min(times), max(times)


cpu_dev = torch.device("cpu")
if bf16_units:  # a fast bf16 path can exist: the comparison protocol judges it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: a second thread only shares a busy machine
    try:
        print("CPU, one thread, 10 matmuls of 384 x 384:")
        print(compare({"fp32": matmuls(384, torch.float32, cpu_dev, 10),
                       "bf16": matmuls(384, torch.bfloat16, cpu_dev, 10)}, repeats=3))
    finally:
        torch.set_num_threads(threads)
else:  # bf16 is far slower here: ranges of a few runs, judged by their overlap
    ranges = {name: one_matmul(256, dt) for name, dt in FORMATS.items()
              if name != "float16"}
    ranges["float16"] = tuple(t * 64 for t in one_matmul(64, torch.float16))
    for name, (lo, hi) in ranges.items():
        print(f"CPU, one thread, one 256 x 256 matmul in {name:8}: "
              f"{format_seconds(lo)} - {format_seconds(hi)}"
              + (" (scaled from 64 x 64, x64)" if name == "float16" else ""))
    (f_lo, f_hi), (b_lo, b_hi) = ranges["float32"], ranges["bfloat16"]
    print("verdict: " + (
        f"bf16 is slower here in every run ({b_lo / f_hi:.0f}x at least): without "
        "bf16 instructions it is widened to fp32 to compute" if b_lo > f_hi else
        "the ranges overlap: no difference can be read from them - run again"))
if gpu:  # the same matmuls on the GPU, in every format it can run
    def runs_on_gpu(dtype):
        try:
            torch.mm(*[torch.ones(8, 8, device=gpu, dtype=dtype)] * 2)
            return True
        except RuntimeError:
            return False

    gpu_mm = compare({name: matmuls(2048, dt, gpu, 20) for name, dt in
                      (("fp32", torch.float32), ("fp16", torch.float16),
                       ("bf16", torch.bfloat16)) if runs_on_gpu(dt)}, repeats=3)
    print(f"{torch.cuda.get_device_name(gpu)}, 20 matmuls of 2048 x 2048 (fp32 "
          "as PyTorch runs it by default, without TF32):")
    print(gpu_mm)
    if major < 8:
        print(f"capability {major}.{minor}: fp16 runs on tensor cores, bf16 has none "
              "here (or cannot run at all), so it cannot gain like fp16")
for key in ("h100_sxm.fp32_tflops", "h100_sxm.bf16_tensor_dense_tflops",
            "a100_sxm_80gb.fp32_tflops", "a100_sxm_80gb.tf32_tensor_dense_tflops",
            "a100_sxm_80gb.bf16_tensor_dense_tflops"):
    f = reference.published(key)
    print(f"  {f.value:>7} {f.unit}  [{f.label}]")
for model_gpu, high in (("h100_sxm", "fp32"), ("a100_sxm_80gb", "tf32")):
    ceiling = predict.tensor_math_speedup(model_gpu, "bf16", high)
    print(f"predicted, {high} to bf16 matmul math on {ceiling.device}: at most "
          f"{ceiling.value:.1f}x [model: predict.tensor_math_speedup, the ratio of "
          "the peaks above: a ceiling for one large matmul, not a training step]")
print("published: training speed-up, TF32 to mixed precision (fp16, whose A100 peak "
      "is bf16's), same batch per GPU [NVIDIA Deep Learning Examples, each model's "
      "PyTorch README, 'Training performance: NVIDIA DGX A100']:")
for key in predict.AMP_SPEEDUPS:
    f = reference.published(key)
    print(f"  {f.value:5.2f}x  {f.extra['quantity']}")
for gpus in (1, 8):
    amp = reference.published(f"dle_rn50.dgxa100_amp_{gpus}gpu_ips")
    tf32 = reference.published(f"dle_rn50.dgxa100_tf32_{gpus}gpu_ips")
    print(f"  {amp.value / tf32.value:5.2f}x  ResNet-50 v1.5 (classification), "
          f"{gpus} A100{'s' if gpus > 1 else ''}")
print(predict.caveat("dle_rn50.dgxa100_amp_1gpu_ips"))

# %% [markdown]
# A training step gains far less than its matmuls: these runs gain 0.84x to
# 2.6x, most about 1.6x, as much of a step runs outside tensor-core math (ops
# kept in fp32 such as softmax, norms and losses, the optimizer's fp32 update,
# casts, launches, data loading) and gains little or nothing from it; a
# 16-bit step can even be slower (Tacotron 2). The ceiling holds for the math
# alone, not a step: kernels reach different fractions of their peaks in each
# format (nnU-Net 3D gains 2.45x), and ResNet-50's AMP recipe also changes its
# memory layout (the caveat above).

# %% [markdown]
# ## 3. Why fp16 needs a gradient scaler
#
# Gradients are often tiny. fp16's smallest subnormal is 2^-24 (about
# 6.0e-8); rounding to nearest sends values below half of it, 2^-25 (about
# 3.0e-8), to 0 (2^-25 itself is a tie, rounded to the even 0), and values
# between the two up to 2^-24. A gradient that small **underflows**, and the
# weights stop learning. The fix is to
# multiply the loss by a large **scale** before `backward()` (all gradients
# grow by the same factor), and divide the gradients by it before the
# optimizer step. If the scale was too large, some gradient overflows to
# `inf`: that step is **skipped** and the scale halved; after a run of good
# steps the scale grows again. `torch.amp.GradScaler` does all of it. Here
# with fp16 for real, on tiny tensors:

# %%
for k, value in (("2^-24", 2.0**-24), ("1.5 x 2^-25", 1.5 * 2.0**-25),
                 ("2^-25", 2.0**-25), ("2^-26", 2.0**-26)):
    print(f"{k:>11} = {value:.3e} in fp16 -> "
          f"{torch.tensor(value, dtype=torch.float16).item():.3e}")
w = torch.full((1000,), 1e-3, dtype=torch.float16, requires_grad=True)
xs = torch.full((1000,), 1e-5, dtype=torch.float16)
(w * xs).sum().backward()  # each gradient is 1e-5 * d(loss)... tiny
w.grad = None
((w * xs).sum() * 1e-3).backward()  # a small loss: gradients of 1e-8
zero_plain = (w.grad == 0).float().mean().item()
w.grad = None
((w * xs).sum() * 1e-3 * 2**16).backward()  # the same, scaled by 65536
zero_scaled = (w.grad == 0).float().mean().item()
print(f"fp16 gradients that are exactly 0: {zero_plain:.0%} unscaled, "
      f"{zero_scaled:.0%} with the loss scaled by 2^16")

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
before = model.weight.detach().clone()
bad = torch.tensor([[float("inf"), 1.0, 2.0, 3.0]])
scaler.scale(model(bad).sum()).backward()
scaler.step(opt)
scaler.update()
print(f"an overflowing step: weights unchanged {torch.equal(before, model.weight)}, "
      f"scale {2.0**16:g} -> {scaler.get_scale():g}")
try:
    half = nn.Linear(4, 1).half()
    opt_h = torch.optim.SGD(half.parameters(), lr=0.1)
    s2 = torch.amp.GradScaler("cpu")
    s2.scale(half(torch.randn(2, 4).half()).sum()).backward()
    s2.step(opt_h)
except ValueError as e:
    print(f"fp16 weights: ValueError: {e}")

# %% [markdown]
# The last line is why mixed precision keeps **fp32 master weights**: an
# update of 1e-4 to a weight of 1.0 is lost in fp16 (its spacing near 1 is
# 1e-3). And bf16 needs no scaler: it has fp32's range, so gradients do not
# underflow - it pays in precision instead. (The device-generic API is
# `torch.amp.GradScaler("cuda")` / `("cpu")` and `torch.autocast(device)`;
# `torch.cuda.amp.GradScaler()` and `torch.cuda.amp.autocast()` are the
# deprecated spellings.)
#
# ## 4. TF32 switches
#
# On Ampere and newer GPUs, fp32 matmuls can run on tensor cores in tf32 (10
# mantissa bits), several times faster and slightly less accurate. PyTorch
# keeps them off for matmuls by default, but cuDNN's convolutions use tf32
# by default (`torch.backends.cudnn.conv.fp32_precision` is `"tf32"`): an
# fp32 convolution network on an Ampere GPU already runs in tf32. Two APIs
# switch it for matmuls: the legacy
# `torch.backends.cuda.matmul.allow_tf32` /
# `torch.set_float32_matmul_precision("high")`, and, in recent releases, a
# per-backend `fp32_precision` setting; mixing the two raises an error when
# read (the cell sets the new one and reads the legacy ones, then restores
# them; use only the new API). On a CPU the oneDNN backend has the same kind
# of switch, with bf16 as the faster internal format - where the CPU has bf16
# instructions. Where it has none (most laptops), oneDNN keeps fp32 and the
# switch does nothing: the cell checks whether the products changed at all
# before it times anything. With a GPU, the real TF32 switch runs beside it
# (Ampere and newer; on older GPUs, it changes nothing either):

# %%
print("float32 matmul precision:", torch.get_float32_matmul_precision())
print("cuDNN convolutions, fp32_precision:", torch.backends.cudnn.conv.fp32_precision)
cuda_mm = torch.backends.cuda.matmul  # settable, and readable, without a GPU
old_cuda = cuda_mm.fp32_precision
print(f"CUDA matmul: fp32_precision {old_cuda!r}, legacy allow_tf32 "
      f"{cuda_mm.allow_tf32}")
try:
    cuda_mm.fp32_precision = "tf32"  # the new API...
    for name, read in (("allow_tf32", lambda: cuda_mm.allow_tf32),
                       ("get_float32_matmul_precision()",
                        torch.get_float32_matmul_precision)):
        try:  # ...then a legacy read
            print(f"  after the new API, reading {name}: {read()}")
        except RuntimeError as e:
            print(f"  after the new API, reading {name}: RuntimeError: "
                  f"{str(e).split(',')[1][:90]}...")
finally:
    cuda_mm.fp32_precision = old_cuda
print(f"restored: fp32_precision {cuda_mm.fp32_precision!r}, allow_tf32 "
      f"{cuda_mm.allow_tf32}")
def in_mode(backend, mode, fn):
    """fn, run with the backend's fp32 matmul precision set to mode (restored)."""
    def run():
        old = backend.fp32_precision
        backend.fp32_precision = mode
        try:
            return fn()
        finally:
            backend.fp32_precision = old
    return run


def fp32_modes(backend, modes, a, device):
    """Each mode's error against fp64 and, if the products differ, their timing."""
    exact = a.double() @ a.double()
    prods = {mode: in_mode(backend, mode, lambda: a @ a)() for mode in modes}
    for mode, prod in prods.items():
        err = (prod.double() - exact).abs().max() / exact.abs().max()
        print(f"  internal {mode:4}: largest relative error {err.item():.1e}")
    if torch.equal(*prods.values()):
        return None  # the switch changed nothing: no timing to compare
    return compare({mode: in_mode(backend, mode, matmuls(a.shape[0], torch.float32,
                                                         device, 10))
                    for mode in modes}, repeats=5)


print(f"oneDNN fp32 matmul on this CPU (bf16 instructions: "
      f"{', '.join(bf16_units) or 'none'}):")
onednn = fp32_modes(torch.backends.mkldnn.matmul, ("ieee", "bf16"),
                    torch.randn(512, 512), torch.device("cpu"))
print(onednn if onednn else "verdict: nothing happens on this CPU - the products "
      "are bit for bit the same, so oneDNN kept fp32 (no bf16 instructions to "
      "use); there is no speed to compare")
if gpu:  # the real TF32, on the GPU
    print(f"CUDA fp32 matmul on {torch.cuda.get_device_name(gpu)} (capability "
          f"{major}.{minor}):")
    tf32 = fp32_modes(torch.backends.cuda.matmul, ("ieee", "tf32"),
                      torch.randn(2048, 2048, device=gpu), gpu)
    print(tf32 if tf32 else f"verdict: no TF32 on capability {major}.{minor} - the "
          "products are bit for bit the same, the switch changes nothing")

# %% [markdown]
# ## 5. Where the memory of training goes
#
# For each parameter, training with Adam in fp32 keeps the parameter (4
# bytes), its gradient (4) and Adam's two moments (8): 16 bytes. Activations
# come on top: every tensor the forward pass **saves for the backward pass**.
# We count those exactly with a saved-tensor hook, which sees each one as it
# is saved; it counts each storage once, since two operations may save the
# same tensor.

# %%
def saved_activation_bytes(fn, skip=()):
    """Bytes autograd holds for backward while fn() runs: each saved storage
    once (two operations may save the same tensor), leaving out storages
    shared with a tensor in `skip` (the parameters)."""
    held = {}
    skipped = {t.untyped_storage().data_ptr() for t in skip}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skipped:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(held.values()), out


def block(width):
    return nn.Sequential(nn.Linear(width, width), nn.GELU())


def breakdown(batch=64, width=256, depth=6):
    net = nn.Sequential(*[block(width) for _ in range(depth)])
    params = sum(p.numel() for p in net.parameters())
    acts, _ = saved_activation_bytes(lambda: net(torch.randn(batch, width)),
                                     skip=list(net.parameters()))
    return {"parameters": 4 * params, "gradients": 4 * params,
            "Adam state": 8 * params, "activations": acts}


parts = breakdown()
for k, v in parts.items():
    print(f"{k:12} {v / 2**20:8.2f} MiB")

# %% [markdown]
# The activations grow with the batch; everything else does not. Each block
# here saves its input (for the Linear's weight gradient) and the Linear's
# output (for GELU's): `2 x batch x width x 4` bytes per block, which the
# slider's formula line checks against the hook's count. (The hook also sees
# the weights - a matmul saves both of its operands - but they are no extra
# memory, so the count leaves out tensors that share a parameter's storage.)

# %%
def draw_breakdown(batch=64):
    parts = breakdown(batch=batch)
    formula = 6 * 2 * batch * 256 * 4
    fig, ax = plt.subplots(figsize=(6.0, 2.6))
    ax.barh(list(parts), [v / 2**20 for v in parts.values()], color="tab:blue")
    ax.set_xlabel("MiB")
    ax.set_title(f"6 blocks of Linear(256) + GELU, batch {batch}")
    plt.tight_layout()
    plt.show()
    print(f"activations counted {parts['activations']:,} B, formula {formula:,} B: "
          + ("equal" if parts["activations"] == formula else "different"))


widgets.interact(draw_breakdown, batch=widgets.IntSlider(
    min=8, max=512, step=8, value=64, description="batch", continuous_update=False));

# %% [markdown]
# The hook counts what autograd keeps; a training step holds more: the
# gradients, the optimizer's state, and temporaries of the backward pass.
# PyTorch's `MemTracker` (`torch.distributed._tools.mem_tracker`) counts them
# all, deterministically: it sees every tensor created while it is active and
# files its storage under parameters, gradients, optimizer state, activations
# or temporaries, and it records the peak. (The profiler's "Total Allocated"
# is no substitute: it keeps counting across profiles in one process.) With
# a GPU, the same step runs there too, and the allocator's own peak,
# `torch.cuda.max_memory_allocated`, stands beside the tracker's:

# %%
def step_memory(device, batch=64, width=256, depth=6):
    """One Adam step of the breakdown's model: MemTracker's snapshots after the
    forward, at the peak and after the step, and on a GPU the allocator's peak
    above the start."""
    torch.manual_seed(0)
    net = nn.Sequential(*[block(width) for _ in range(depth)]).to(device)
    adam = torch.optim.Adam(net.parameters())
    x = torch.randn(batch, width, device=device)
    if device.type == "cuda":  # the warm-up creates cuBLAS's workspace first
        net(x).sum().backward()
        net.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    tracker = MemTracker()
    tracker.track_external(net, adam, x)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[device]["Total"]
        out = net(x)
        after_forward = tracker.get_tracker_snapshot("current")[device]
        out.sum().backward()
        adam.step()
        after_step = tracker.get_tracker_snapshot("current")[device]
    peak = tracker.get_tracker_snapshot("peak")[device]
    gpu_peak = (torch.cuda.max_memory_allocated(device) - start
                if device.type == "cuda" else None)
    return before, after_forward, after_step, peak, gpu_peak


def by_category(snapshot):
    return ", ".join(f"{k.value.lower()} {v / 2**20:.2f}"
                     for k, v in snapshot.items() if v and k != "Total")


for device in [torch.device("cpu")] + ([gpu] if gpu else []):
    before, after_forward, after_step, peak, gpu_peak = step_memory(device)
    print(f"{device.type}: after the forward (MiB): {by_category(after_forward)}")
    print(f"{device.type}: at the step's peak (MiB): {by_category(peak)}")
    print(f"{device.type}: after Adam's step (MiB): {by_category(after_step)}")
    if gpu_peak is not None:
        print(f"{device.type}: above the start, MemTracker "
              f"{peak['Total'] - before:,} B, "
              f"torch.cuda.max_memory_allocated {gpu_peak:,} B (both round each "
              "block up to 512 B; a difference is memory MemTracker cannot see, "
              "such as a library's workspace)")
n_p = sum(p.numel() for b in range(6) for p in block(256).parameters())
print(f"the formula, {n_p:,} parameters: 4 B each for the parameters and the "
      f"gradients, 8 B for Adam's two moments = {16 * n_p / 2**20:.2f} MiB; the hook's "
      f"activations {parts['activations'] / 2**20:.2f} MiB")

# %% [markdown]
# Read the three snapshots: after the forward, the activations are the
# hook's count plus the output (the input is filed as "other"); after the
# step, the gradients and Adam's two moments match the formula; at the peak,
# inside `adam.step()`, Adam also holds temporaries of its update, filed with
# its state - a real step needs a little more than 16 bytes per parameter.
#
# For a large model we need not allocate anything to count: on the **meta**
# device tensors have shapes and dtypes but no memory. A model with the shapes
# of a 7-billion-parameter transformer (32 layers, width 4096, MLP 11008,
# vocabulary 32000) builds in a second:

# %%
def transformer_like(layers=32, d=4096, ffn=11008, vocab=32000):
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False),
                   nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False),
                   nn.Linear(ffn, d, bias=False), nn.LayerNorm(d), nn.LayerNorm(d)]
    return nn.Sequential(nn.Embedding(vocab, d), *blocks, nn.LayerNorm(d),
                         nn.Linear(d, vocab, bias=False))


t0 = time.perf_counter()
with torch.device("meta"):
    big = transformer_like()
n_params = sum(p.numel() for p in big.parameters())
print(f"{n_params / 1e9:.2f} billion parameters, built in "
      f"{time.perf_counter() - t0:.1f} s on the meta device, no memory allocated")

# Adam's state, counted from Adam itself: one real step on meta gradients
for p in big.parameters():
    p.grad = torch.empty_like(p)  # meta, like the parameter
adam = torch.optim.Adam(big.parameters())
adam.step()  # creates exp_avg and exp_avg_sq for every parameter, on meta
state_bytes = sum(t.numel() * t.element_size() for st in adam.state.values()
                  for t in st.values() if t.device.type == "meta")
print(f"Adam's state after one step: {state_bytes / 1e9:.1f} GB = "
      f"{state_bytes / n_params:.1f} bytes per parameter (exp_avg and exp_avg_sq; "
      "its step counters are a few bytes each, on the CPU)")
del adam
for name, per_param in (("fp32 + Adam", 16), ("mixed precision + Adam", 16 + 2),
                        ("bf16 weights and gradients, fp32 Adam", 2 + 2 + 8)):
    print(f"  {name:40} {n_params * per_param / 1e9:7.0f} GB before activations")
h100_mem = reference.published("h100_sxm.memory_gb")
print(f"  one {h100_mem.device} holds {h100_mem.value} GB [{h100_mem.label}]")

# %% [markdown]
# (Mixed precision keeps an fp16/bf16 copy of the weights *beside* the fp32
# master weights, so it saves activation memory and time, not parameter
# memory.) Does the smallest line fit one "80 GB" GPU? Keep the units
# apart: a GB is 10^9 bytes, a GiB 2^30 bytes (7 % more), and the answer
# turns on which one the datasheet's 80 means. The bytes a card really
# offers are what `torch.cuda.get_device_properties(i).total_memory` reports
# (the driver keeps a little). The cell prints both readings, and with a GPU
# its own.
# What is left must still hold the activations, the CUDA context and the
# allocator's cache:

# %%
smallest = n_params * (2 + 2 + 8)
print(f"bf16 weights and gradients, fp32 Adam: {smallest:.4g} bytes = "
      f"{smallest / 1e9:.1f} GB = {smallest / 2**30:.1f} GiB")
capacities = {f"{h100_mem.value} GB, read as 10^9 bytes": h100_mem.value * 1e9,
              f"{h100_mem.value} GiB (2^30 bytes)": h100_mem.value * 2**30}
if gpu:
    capacities["this GPU's total_memory"] = torch.cuda.get_device_properties(
        gpu).total_memory
for label, cap in capacities.items():
    left = (cap - smallest) / 2**30
    print(f"  against {label} = {cap:.4g} bytes: " + (
        f"fits, {left:.1f} GiB left" if left > 0 else f"{-left:.1f} GiB short"))

# %% [markdown]
# ## 6. Activation checkpointing
#
# Instead of saving every activation, a checkpointed segment saves only its
# input and **recomputes** the rest during the backward pass: less memory,
# more time. `torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)`
# wraps a segment. Below, 8 blocks, checkpointed not at all, per block, and
# every 4 blocks. Two memory figures matter, and they differ: what the
# forward pass leaves saved (the hook), and the **peak** of the whole step,
# which includes the recomputation - the backward rebuilds a segment's
# activations before it can use them - and the gradients (MemTracker, and on
# a GPU `max_memory_allocated`). The times come from the comparison protocol.

# %%
def checkpointed(blocks, every):
    """The forward of blocks, checkpointing segments of `every` blocks (0: none)."""
    size = every or len(blocks)
    segments = [nn.Sequential(*blocks[i:i + size]) for i in range(0, len(blocks), size)]

    def forward(x):
        for seg in segments:
            x = checkpoint(seg, x, use_reentrant=False) if every else seg(x)
        return x
    return forward


def step_peak(forward, x, blocks):
    """Peak bytes above the start while forward + backward run: MemTracker's
    and, on a GPU, the allocator's."""
    if x.is_cuda:  # a warm-up first: cuBLAS's workspace is not the step's memory
        forward(x).sum().backward()
        torch.cuda.synchronize(x.device)
    blocks.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.reset_peak_memory_stats(x.device)
        start = torch.cuda.memory_allocated(x.device)
    tracker = MemTracker()
    tracker.track_external(blocks, x)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[x.device]["Total"]
        forward(x).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[x.device]["Total"] - before
    return peak, (torch.cuda.max_memory_allocated(x.device) - start
                  if x.is_cuda else None)


torch.manual_seed(0)
blocks = nn.ModuleList(block(256) for _ in range(8))
xc = torch.randn(512, 256)
twins = [(blocks, xc)] + ([(copy.deepcopy(blocks).to(gpu), xc.to(gpu))] if gpu else [])
MODES = {"no checkpointing": 0, "every block": 1, "every 4 blocks": 4}
ckpt = {}
for label, every in MODES.items():
    saved_b, _ = saved_activation_bytes(lambda e=every: checkpointed(blocks, e)(xc),
                                        skip=list(blocks.parameters()))
    peaks = [step_peak(checkpointed(b, every), x, b) for b, x in twins]
    ckpt[label] = (saved_b, peaks[0][0])
    print(f"{label:16} saved by the forward {saved_b / 2**20:5.1f} MiB; peak of "
          f"forward + backward {peaks[0][0] / 2**20:5.1f} MiB (MemTracker)" + (
              f"; on the GPU {peaks[1][0] / 2**20:5.1f} MiB (MemTracker), "
              f"{peaks[1][1] / 2**20:5.1f} MiB (max_memory_allocated)" if gpu else ""))
timing = compare({label: lambda e=every: checkpointed(blocks, e)(xc).sum().backward()
                  for label, every in MODES.items()}, repeats=3)
print(timing)
(s0, p0), (s4, p4) = ckpt["no checkpointing"], ckpt["every 4 blocks"]
print(f"verdict: every 4 blocks saves {s0 / s4:.0f}x less in the forward, but the "
      f"step's peak is only {p0 / p4:.1f}x lower: the backward recomputes a whole "
      "4-block segment's activations, and the gradients come on top")

# %% [markdown]
# `torch.autograd.graph.save_on_cpu()` is the other trade: keep the saved
# tensors, but in CPU memory until the backward pass needs them. By default
# that memory is ordinary pageable memory (`pin_memory=False`: the cell
# prints the signature), so each copy blocks; `pin_memory=True` pins it and
# makes the copies asynchronous. On a CPU the tensors are already there:
# `tensor.cpu()` returns the tensor itself, and nothing changes. With a GPU,
# the cell measures the peak that moving them out saves, and its time:

# %%
print(f"save_on_cpu{inspect.signature(torch.autograd.graph.save_on_cpu)}")


def saved_on_cpu(forward, pin):
    def run(x):
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return forward(x)
    return run


plain = checkpointed(blocks, 0)
peak_cpu = step_peak(saved_on_cpu(plain, False), xc, blocks)[0]
print(f"CPU: peak {peak_cpu / 2**20:.1f} MiB with save_on_cpu, "
      f"{ckpt['no checkpointing'][1] / 2**20:.1f} MiB without: "
      + ("the same - nothing moved" if peak_cpu == ckpt["no checkpointing"][1]
         else "different"))
if gpu:
    blocks_g, x_g = twins[1]
    plain_g = checkpointed(blocks_g, 0)
    options = {"saved on the GPU": plain_g,
               "save_on_cpu()": saved_on_cpu(plain_g, False),
               "save_on_cpu(pin_memory=True)": saved_on_cpu(plain_g, True)}
    for label, fwd in options.items():
        tracked, allocated = step_peak(fwd, x_g, blocks_g)
        print(f"GPU, {label:28}: peak {tracked / 2**20:5.1f} MiB (MemTracker), "
              f"{allocated / 2**20:5.1f} MiB (max_memory_allocated)")
    print(compare({label: lambda f=fwd: (f(x_g).sum().backward(),
                                         torch.cuda.synchronize(gpu))
                   for label, fwd in options.items()}, repeats=3))

# %% [markdown]
# ## 7. Offloading: swapping halves of a model
#
# Seed 002 trains a model too large for its GPU by keeping half of it in CPU
# memory and moving halves in and out. Its order has a bug worth knowing:
# build the optimizer **after** the parameters have their final placement, or
# keep the same parameter objects (`module.to()` moves them in place, so an
# optimizer made before still holds the right ones; one made from copies
# would not). And its `loss.backward()` runs the backward pass of the first
# half after that half went back to the CPU, while its activations are on the
# GPU: the backward must wait until the half is back, so the boundary is
# crossed by hand - back-propagate the second half from a detached input, move
# the halves, then `h.backward(h_in.grad)` (the chain rule across a split,
# Chapter 7). And a graph through the first half would keep that half's GPU
# weights alive in its saved tensors (a matmul saves its weight) after `.to()`
# moved the parameters out, so the GPU version runs the first half's forward
# without a graph and again, with one, when the half is back (as checkpointing
# does). Optimizer state would have to move too; plain SGD has none. The
# cost is the transfer: every step moves each offloaded half in and out. Here
# the slower tier is a file, and the weights after training must equal a run
# that kept everything resident:

# %%
torch.manual_seed(1)
full = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
swapped = copy.deepcopy(full)
data = [(torch.randn(16, 64), torch.randn(16, 64)) for _ in range(5)]
opt_a = torch.optim.SGD(full.parameters(), lr=0.05)
opt_b = torch.optim.SGD(swapped.parameters(), lr=0.05)
def offload(module):
    """Write the module's tensors to the slow tier and free them here."""
    torch.save(module.state_dict(), tier + ".tmp")
    os.replace(tier + ".tmp", tier)  # never rewrite a file that is being read
    for p in module.parameters():
        p.data = torch.empty(0)


def bring_back(module, state):
    for (name, p) in module.named_parameters():
        p.data = state[name]


second_half = swapped[2:]


def resident_step(x_, y_):
    opt_a.zero_grad()
    nn.functional.mse_loss(full(x_), y_).backward()
    opt_a.step()


def swapping_step(x_, y_):
    if second_half[0].weight.numel() == 0:
        bring_back(second_half, torch.load(tier, weights_only=True))
    opt_b.zero_grad()
    nn.functional.mse_loss(swapped(x_), y_).backward()
    opt_b.step()
    offload(second_half)


with tempfile.TemporaryDirectory(prefix="ch08_") as tier_dir:  # removed on exit
    tier = os.path.join(tier_dir, "half.pt")
    for x_, y_ in data:
        resident_step(x_, y_)
        swapping_step(x_, y_)
    bring_back(second_half, torch.load(tier, weights_only=True))
    same = all(torch.equal(p, q) for p, q in zip(full.parameters(),
                                                 swapped.parameters(), strict=True))
    print(f"weights equal to the resident run after {len(data)} steps: {same}")
    print(compare({"resident": lambda: resident_step(*data[0]),
                   "swapping through a file": lambda: swapping_step(*data[0])},
                  repeats=3))
print(f"the tier's folder is left on disk after the block: {os.path.exists(tier_dir)}")
if gpu:  # the seed's swap for real, with the GPU's own counter
    mse = nn.functional.mse_loss

    def halves():
        torch.manual_seed(1)
        net = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])
        return net[:4], net[4:]

    def resident_step(half1, half2, opt, x, y):
        mse(half2(half1(x)), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def swapping_step(half1, half2, opt1, opt2, x, y):
        """Only one half's weights (and gradients) on the GPU at a time."""
        half1.to(gpu)
        with torch.no_grad():  # no graph: nothing keeps half 1's GPU weights alive
            h_in = half1(x)
        half1.to("cpu")  # in place: opt1 keeps the same parameter objects
        h_in.requires_grad_()  # the boundary, crossed by hand below
        half2.to(gpu)
        mse(half2(h_in), y).backward()  # half 2's gradients, and h_in.grad
        opt2.step()
        opt2.zero_grad(set_to_none=True)
        half2.to("cpu")
        half1.to(gpu)
        h = half1(x)  # half 1's forward again, this time with a graph
        h.backward(h_in.grad)  # the chain rule across the boundary (Chapter 7)
        opt1.step()
        opt1.zero_grad(set_to_none=True)

    def peak_and_weights(swap, steps=3):
        half1, half2 = halves()
        # optimizers after the placement is decided, over the same parameter
        # objects that .to() moves in place (plain SGD: no state to move)
        if swap:
            opts = (torch.optim.SGD(half1.parameters(), lr=1e-3),
                    torch.optim.SGD(half2.parameters(), lr=1e-3))
        else:
            half1.to(gpu)
            half2.to(gpu)
            opts = (torch.optim.SGD([*half1.parameters(), *half2.parameters()],
                                    lr=1e-3),)
        g = torch.Generator(device=gpu).manual_seed(2)
        x = torch.randn(64, 4096, device=gpu, generator=g)
        y = torch.randn(64, 4096, device=gpu, generator=g)
        torch.cuda.synchronize(gpu)
        torch.cuda.reset_peak_memory_stats(gpu)
        for _ in range(steps):
            if swap:
                swapping_step(half1, half2, *opts, x, y)
            else:
                resident_step(half1, half2, *opts, x, y)
        torch.cuda.synchronize(gpu)
        weights = [p.detach().cpu() for p in (*half1.parameters(),
                                               *half2.parameters())]
        return torch.cuda.max_memory_allocated(gpu), weights

    (resident_peak, w_res), (swapped_peak, w_swap) = (peak_and_weights(False),
                                                      peak_and_weights(True))
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                for a, b in zip(w_res, w_swap, strict=True))
    print(f"on {torch.cuda.get_device_name(gpu)} (torch.cuda.max_memory_allocated): "
          f"peak {resident_peak / 2**20:.0f} MiB resident, {swapped_peak / 2**20:.0f} "
          f"MiB swapping halves; same weights after 3 steps: {close}")
    print("verdict:", "swapping lowered the peak" if swapped_peak < resident_peak
          else "swapping did not lower the peak")
else:
    print("no GPU: the swap above used a file as the slow tier. With a GPU, this "
          "cell also runs the seed's swap for real, one half on the GPU at a time, "
          "and reads torch.cuda.max_memory_allocated (which, on a CPU-only build, "
          "returns 0 without an error: never read it without a GPU)")
half_bytes = sum(p.numel() * 4 for p in full[2:].parameters())
for n_params_half in (half_bytes / 4, 3.5e9):
    f = predict.calibrated_copy_seconds(8 * n_params_half, "pcie4_x16",
                                        "a GPU on PCIe 4.0 x16")
    print(f"  moving a half of {n_params_half:.3g} fp32 parameters in and out: "
          f"{format_seconds(f.value)} per step [{f.label}]")
slower = (predict.calibrated_copy_seconds(1e9, pinned=False).value
          / predict.calibrated_copy_seconds(1e9).value)
print(f"caveat: only device-to-host copies are calibrated; .to() copies pageable "
      f"memory, {slower:.1f}x slower by the pageable model, and a published "
      "server's pageable host-to-device copies were slower still "
      f"({reference.published('bwtest.a100_pcie_pageable_h2d_gbps').value} GB/s)")

# %% [markdown]
# ## Summary
#
# - Exponent bits give range, mantissa bits precision: fp16's largest value
#   is 65504 (from 65520 up, values round to inf), and it rounds values below
#   2^-25 (about 3e-8) to 0 (2^-24, about 6e-8, is its smallest subnormal);
#   bf16 keeps fp32's range with 3 digits.
# - Autocast runs matmuls in 16 bits and keeps sensitive ops in fp32, with
#   fp32 master weights; fp16 needs a GradScaler (skips inf steps, adjusts the
#   scale), bf16 does not.
# - 16-bit formats are faster only on hardware that has them: read the CPU's
#   capabilities (`torch.cpu.get_capabilities()`) or the GPU's compute
#   capability (bf16 tensor cores and TF32 from 8.0) before expecting a gain.
# - Training memory is 16 bytes per parameter with Adam, plus activations that
#   grow with the batch; the saved-tensor hook counts what autograd holds,
#   MemTracker counts a whole step by category and its peak (on a GPU, beside
#   `torch.cuda.max_memory_allocated`), the meta device counts a huge model -
#   Adam's state included - without memory.
# - TF32 (and oneDNN's bf16 path on CPUs with bf16 instructions) trade fp32
#   accuracy for speed; where the hardware lacks them the switch does nothing.
#   Set it with one API only, as mixing the legacy and the new ones raises.
# - Checkpointing recomputes to save activation memory: the forward saves
#   much less, but the step's peak falls less, as the backward recomputes a
#   segment; `save_on_cpu` (pageable memory unless `pin_memory=True`) and
#   offloading move tensors to a slower tier and pay the transfer every step.

# %% [markdown]
# ## Exercises
#
# ### Exercise 8.1: a loss-scaled training step
#
# Write `scaled_step(model, optimizer, scaler, x, y, max_norm)`: one step of
# MSE training with the `GradScaler` `scaler`, clipping the gradient norm to
# `max_norm` (`torch.nn.utils.clip_grad_norm_`). The clip must see the true
# gradients; a step whose gradients are not finite (inf or nan) must change
# nothing but the scale. The checker calls it many times with the same
# scaler, on float32 and float64 models, with inputs from 1e-3 to 1e3.

# %% tags=["exercise"] exercise="8.1"
def scaled_step(model, optimizer, scaler, x, y, max_norm):
    ### BEGIN SOLUTION
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    ### END SOLUTION


# %% tags=["check"] exercise="8.1"
check_scaled_step(scaled_step)

# %% [markdown]
# ### Exercise 8.2: recomputation by hand
#
# Write `recompute(segment, x)`: it returns `segment(x)`, but autograd keeps
# only `x` for the backward pass, nothing the segment computes inside; the
# backward runs the segment again and passes the gradients to `x` and to the
# segment's parameters. Build it with a `torch.autograd.Function` (forward
# under `torch.no_grad()`, backward under `torch.enable_grad()`), not with
# `torch.utils.checkpoint`. Segments hold `Dropout`: the recomputation must
# draw the same masks. The checker chains your function over blocks and
# measures what the forward leaves held and the step's peak with
# `course_utils.memory.LiveBytes`, a light cousin of `MemTracker`, and counts
# how often each block runs.

# %% tags=["exercise"] exercise="8.2"
def recompute(segment, x):
    ### BEGIN SOLUTION
    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *params):
            ctx.rng = torch.get_rng_state()  # the forward's dropout masks
            ctx.save_for_backward(x)
            with torch.no_grad():
                return segment(x)

        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            now = torch.get_rng_state()
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                x_ = x.detach().requires_grad_()
                out = segment(x_)
            torch.set_rng_state(now)
            return torch.autograd.grad(out, (x_, *segment.parameters()), grad_out)

    return Recompute.apply(x, *segment.parameters())
    ### END SOLUTION


# %% tags=["check"] exercise="8.2"
check_recompute(recompute)

# %% [markdown]
# ### Exercise 8.3: saved tensors offloaded to disk
#
# Write `offloaded(fn, x, folder)`: it returns `fn(x)`, and every tensor
# autograd saves for the backward pass goes to a file in `folder` instead of
# staying in memory; when the backward needs it, it is read back (same
# dtype and values) and its file deleted. Use
# `torch.autograd.graph.saved_tensors_hooks`. The checker runs two forwards
# before one backward (both graphs alive at once), in float32, float64 and
# bfloat16, and checks what stays in memory, what lies on disk, that the
# folder is empty afterwards, and the gradients. It runs on the CPU, so it
# cannot see a tensor read back onto the wrong device: keep what
# `torch.load` gives (the device it was saved from), since a
# `map_location="cpu"` breaks the backward of a model on a GPU.

# %% tags=["exercise"] exercise="8.3"
def offloaded(fn, x, folder):
    ### BEGIN SOLUTION
    def pack(t):
        fd, path = tempfile.mkstemp(suffix=".pt", dir=folder)  # a unique name
        os.close(fd)
        torch.save(t, path)
        return path  # all that stays in memory

    def unpack(path):
        t = torch.load(path, weights_only=True)
        os.remove(path)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)
    ### END SOLUTION


# %% tags=["check"] exercise="8.3"
check_offloaded(offloaded)

# %% [markdown]
# ### Exercise 8.4: the cheapest format that will do
#
# Write `cheapest_format(values, rel_error)`: the first of `"float16"`,
# `"bfloat16"`, `"float32"` that stores every value of the tensor `values`
# finite and within relative error `rel_error` (return `"float64"` if none
# does). The checker's tensors have from 3 to 4,099 values, of any shape and
# float dtype, views included.

# %% tags=["exercise"] exercise="8.4"
def cheapest_format(values, rel_error):
    ### BEGIN SOLUTION
    exact = values.double()
    for name in ("float16", "bfloat16", "float32"):
        stored = values.to(getattr(torch, name)).double()
        if torch.isfinite(stored).all() and (
                (stored - exact).abs() <= rel_error * exact.abs()).all():
            return name
    return "float64"
    ### END SOLUTION


# %% tags=["check"] exercise="8.4"
check_cheapest_format(cheapest_format)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | mixed precision | 混合精度 |
# | exponent / mantissa | 指数 / 尾数 |
# | overflow / underflow | 上溢 / 下溢 |
# | loss scaling | 损失缩放 |
# | master weights | 主权重（fp32 副本） |
# | automatic mixed precision (autocast) | 自动混合精度 |
# | activation checkpointing | 激活检查点（重计算） |
# | offloading | 卸载（到 CPU / 磁盘） |
# | optimizer state | 优化器状态 |
# | meta device | meta 设备（只有形状） |
