"""Checkers for Chapter 8 (mixed precision and offloading).

8.1 runs the learner's loss-scaled step against a reference on finite and
on overflowing gradients, with clipping that only agrees when gradients are
unscaled first; 8.2 compares the learner's count of the bytes saved for
backward with a saved-tensor hook's, on models where parameters, outputs and
saved activations all differ; 8.3 asks for the cheapest float format for
value sets chosen so that range, precision and underflow each decide once.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from course_utils.exercises import call_learner, fail, passed, require_solution

# ---------------------------------------------------------------- exercise 8.1


def _reference_step(model, x, y, lr, max_norm, scale):
    """One fp32 SGD step with the gradient of the loss clipped to max_norm."""
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    if not all(torch.isfinite(g).all() for g in grads):
        return False
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return True


def check_scaled_step(scaled_step) -> None:
    ex = "8.1"
    require_solution(ex, scaled_step)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    x, y = torch.randn(9, 5) * 3, torch.randn(9, 2)
    for scale, max_norm in ((1024.0, 0.05), (8.0, 0.3), (4.0, 1e6)):
        ref = copy.deepcopy(base)
        _reference_step(ref, x, y, 0.1, max_norm, scale)
        mine = copy.deepcopy(base)
        for p in mine.parameters():  # left over from an earlier step
            p.grad = torch.full_like(p, 0.5)
        opt = torch.optim.SGD(mine.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
        call_learner(ex, scaled_step, mine, opt, scaler, x, y, max_norm)
        for (name, p), q in zip(mine.named_parameters(), ref.parameters(),
                                strict=True):
            if not torch.allclose(p, q, rtol=1e-4, atol=1e-6):
                moved = not torch.equal(p, base.state_dict()[name])
                fail(ex, f"the step of unscaled, clipped gradients (scale {scale:g}, "
                     f"max_norm {max_norm})",
                     f"{name} moved {'differently' if moved else 'not at all'}",
                     "zero the old gradients, scaler.scale(loss).backward(), then "
                     "scaler.unscale_(optimizer) BEFORE clipping (the clip must see "
                     "the true gradients), then scaler.step(optimizer) and "
                     "scaler.update()")
        if scaler.get_scale() != scale:
            fail(ex, f"the scale unchanged after a finite step ({scale:g})",
                 f"{scaler.get_scale():g}", "call scaler.update() once per step")
    # an overflowing batch: the step must be skipped and the scale halved
    mine = copy.deepcopy(base)
    before = copy.deepcopy(mine.state_dict())
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x_inf = x.clone()
    x_inf[0, 0] = float("inf")
    call_learner(ex, scaled_step, mine, opt, scaler, x_inf, y, 1.0)
    after = mine.state_dict()
    if not all(torch.equal(before[k], after[k]) for k in before):
        fail(ex, "no change to the weights after an overflowing step",
             "weights changed (to nan or inf, or by a clipped inf)",
             "let scaler.step(optimizer) decide: it skips the step when the "
             "gradients are not finite")
    if scaler.get_scale() != 2.0**15:
        fail(ex, "the scale halved after an overflowing step (65536 -> 32768)",
             f"{scaler.get_scale():g}", "call scaler.update() after scaler.step()")
    passed(ex, "Unscaled before clipping, overflowing steps skipped, scale updated.")


# ---------------------------------------------------------------- exercise 8.2


def saved_bytes_reference(model, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total


def _bytes_cases():
    torch.manual_seed(1)
    yield ("Linear + GELU", nn.Sequential(nn.Linear(32, 64), nn.GELU()),
           torch.randn(5, 32))
    yield "two Linear + ReLU", nn.Sequential(nn.Linear(16, 48), nn.ReLU(),
                                             nn.Linear(48, 8)), torch.randn(7, 16)
    yield "bf16 Linear + Tanh", nn.Sequential(nn.Linear(24, 40), nn.Tanh()).to(
        torch.bfloat16), torch.randn(3, 24, dtype=torch.bfloat16)
    yield "LayerNorm + Linear", nn.Sequential(nn.LayerNorm(20), nn.Linear(20, 20)), \
        torch.randn(11, 20)


def check_saved_bytes(saved_bytes) -> None:
    ex = "8.2"
    require_solution(ex, saved_bytes)
    for name, model, x in _bytes_cases():
        want = saved_bytes_reference(model, x)
        got = call_learner(ex, saved_bytes, model, x)
        if isinstance(got, float) and got != int(got):
            fail(ex, f"{want} bytes saved for backward by {name}", f"{got!r:.30}",
                 "a whole number of bytes, not MiB, KiB or another unit")
        try:
            got = int(got)
        except (TypeError, ValueError):
            fail(ex, "a number of bytes", f"{got!r:.60}")
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out = model(x)
        out_bytes = out.numel() * out.element_size()
        if got == want:
            continue
        x_bytes = x.numel() * x.element_size()
        if got == 0:
            hint = ("nothing was saved: run the forward with grad enabled (not under "
                    "torch.no_grad()) while the hooks are active")
        elif got == 2 * want:
            hint = "each saved tensor was counted twice; count each pack once"
        elif got == x_bytes:
            hint = "that is the input's size; the layers save more than their input"
        elif got == params + out_bytes:
            hint = ("parameters plus output is a guess; count the tensors autograd "
                    "actually packs")
        elif got == params:
            hint = "that is the parameters' size; count what autograd saves"
        elif got == out_bytes:
            hint = "that is the output's size; count every tensor saved for backward"
        elif got == want // x.element_size() or got * 8 == want:
            hint = "count bytes: numel() x element_size(), not elements"
        else:
            hint = ("count each tensor torch.autograd.graph.saved_tensors_hooks packs "
                    "during the forward, in bytes")
        fail(ex, f"{want} bytes saved for backward by {name}", f"{got}", hint)
    passed(ex, "Saved activations counted exactly, whatever the layers and dtype.")


# ---------------------------------------------------------------- exercise 8.3

FORMATS = ("float16", "bfloat16", "float32")


def cheapest_format_reference(values: torch.Tensor, rel_error: float) -> str:
    v = values.double()
    for name in FORMATS:
        r = values.to(getattr(torch, name)).double()
        if not torch.isfinite(r).all():
            continue
        err = ((r - v).abs() / v.abs().clamp_min(1e-300))
        if bool((err <= rel_error).all()):
            return name
    return "float64"


FORMAT_CASES = [
    ("pixel values 0-255", torch.arange(0.0, 256.0, 7.0), 1e-3),
    ("large activations", torch.tensor([7e4, 1.2e5, 3.0e4, 9.9e4]), 1e-2),
    ("tiny gradients", torch.tensor([3e-9, 1e-10, 5e-12, 2e-8]), 1e-2),
    ("precise weights", torch.tensor([1.0001, 0.99991, 1.00037]), 1e-5),
    ("moderate values, loose tolerance", torch.tensor([0.5, 3.25, -12.0, 100.0]), 1e-2),
    ("large and precise", torch.tensor([70000.5, 123456.25]), 1e-4),
    ("mostly small, one large", torch.tensor([1.0, 2.0, 0.5, 1e5]), 1e-2),
]


def check_cheapest_format(cheapest_format) -> None:
    ex = "8.3"
    require_solution(ex, cheapest_format)
    for what, values, rel in FORMAT_CASES:
        want = cheapest_format_reference(values, rel)
        got = call_learner(ex, cheapest_format, values.clone(), rel)
        got = str(got).replace("torch.", "")
        if got == want:
            continue
        hints = {
            "float16": "float16's largest value is 65504 and its smallest "
                       "subnormal about 6e-8: check the range, not only the bits",
            "bfloat16": "bfloat16 has float32's range but only 8 bits of mantissa "
                        "(about 3 significant digits)",
            "float32": "a 16-bit format would do: try the cheap ones first",
        }
        fail(ex, f"{want} for {what} (relative error {rel:g})", got,
             hints.get(got, "try float16, then bfloat16, then float32: convert and "
                       "compare with the original values"))
    passed(ex, "Range, underflow and precision each decided the format once.")
