"""Chapter 8's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import pytest
import torch
from torch import nn

from course_utils.checks import ch08
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    for w in words:
        assert w in str(e.value), str(e.value)


# ---------------------------------------------------------------- 8.1


def step_plain(model, optimizer, scaler, x, y, max_norm):
    optimizer.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_autocast(model, optimizer, scaler, x, y, max_norm):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float32, enabled=False):
        loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm=max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_clip_by_hand(model, optimizer, scaler, x, y, max_norm):
    for p in model.parameters():
        p.grad = None
    scaler.scale(nn.MSELoss()(model(x), y)).backward()
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                 for g in grads]))
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(factor)
    scaler.step(optimizer)
    scaler.update()


class Trainer:  # a class, called like a function
    def __call__(self, model, optimizer, scaler, x, y, max_norm):
        step_plain(model, optimizer, scaler, x, y, max_norm)


@pytest.mark.parametrize("fn", [step_plain, step_autocast, step_clip_by_hand,
                                Trainer()])
def test_right_scaled_steps_pass(fn):
    ch08.check_scaled_step(fn)


def test_wrong_scaled_steps_fail():
    def clip_before_unscale(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()

    def no_update(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)

    def no_scaler(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()

    def optimizer_step_directly(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scaler.update()

    def no_clip(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()

    def clip_value(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_value_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()

    def update_twice(model, optimizer, scaler, x, y, max_norm):
        step_plain(model, optimizer, scaler, x, y, max_norm)
        scaler.update(scaler.get_scale() * 2)

    def forgets_zero_grad(model, optimizer, scaler, x, y, max_norm):
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()

    def sum_loss(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(((model(x) - y) ** 2).sum()).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm * 1000)
        scaler.step(optimizer)
        scaler.update()

    fails(ch08.check_scaled_step, clip_before_unscale, "BEFORE clipping")
    fails(ch08.check_scaled_step, no_update, "scale halved")
    fails(ch08.check_scaled_step, no_scaler, "scaler.step(optimizer) decide")
    fails(ch08.check_scaled_step, optimizer_step_directly, "no change to the weights")
    fails(ch08.check_scaled_step, no_clip, "clipped")
    fails(ch08.check_scaled_step, clip_value, "clipped")
    fails(ch08.check_scaled_step, update_twice, "scale unchanged")
    fails(ch08.check_scaled_step, forgets_zero_grad, "zero the old gradients")
    fails(ch08.check_scaled_step, sum_loss, "clipped gradients (scale")


# ---------------------------------------------------------------- 8.2


def bytes_hook(model, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total


def bytes_list(model, x):
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t,
                                                  lambda t: t):
        model(x)
    return sum(t.numel() * t.element_size() for t in seen)


class CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self):
        self.bytes = 0
        super().__init__(self.pack, lambda t: t)

    def pack(self, t):
        self.bytes += t.numel() * t.element_size()
        return t


def bytes_class(model, x):
    counter = CountingHooks()
    with counter:
        model(x)
    return counter.bytes


def bytes_grad_mode(model, x):
    with torch.enable_grad():
        return bytes_hook(model, x)


@pytest.mark.parametrize("fn", [bytes_hook, bytes_list, bytes_class, bytes_grad_mode])
def test_right_saved_bytes_pass(fn):
    ch08.check_saved_bytes(fn)


def test_wrong_saved_bytes_fail():
    def parameters(model, x):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def output(model, x):
        out = model(x)
        return out.numel() * out.element_size()

    def elements(model, x):
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t,
                                                      lambda t: t):
            model(x)
        return sum(t.numel() for t in seen)

    def no_grad(model, x):
        with torch.no_grad():
            return bytes_hook(model, x)

    def assumes_float32(model, x):
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t,
                                                      lambda t: t):
            model(x)
        return sum(t.numel() * 4 for t in seen)

    def input_only(model, x):
        return x.numel() * x.element_size()

    def params_plus_output(model, x):
        return parameters(model, x) + output(model, x)

    def counts_twice(model, x):
        return 2 * bytes_hook(model, x)

    def as_mib(model, x):
        return bytes_hook(model, x) / 2**20

    fails(ch08.check_saved_bytes, parameters, "parameters' size")
    fails(ch08.check_saved_bytes, output, "output's size")
    fails(ch08.check_saved_bytes, elements, "not elements")
    fails(ch08.check_saved_bytes, no_grad, "torch.no_grad()")
    fails(ch08.check_saved_bytes, assumes_float32, "bf16")
    fails(ch08.check_saved_bytes, input_only, "input's size")
    fails(ch08.check_saved_bytes, params_plus_output, "parameters plus output")
    fails(ch08.check_saved_bytes, counts_twice, "counted twice")
    fails(ch08.check_saved_bytes, as_mib, "whole number of bytes")


# ---------------------------------------------------------------- 8.3


def fmt_loop(values, rel_error):
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        r = values.to(dt).to(torch.float64)
        v = values.to(torch.float64)
        if torch.isfinite(r).all() and torch.all((r - v).abs() <= rel_error * v.abs()):
            return str(dt).removeprefix("torch.")
    return "float64"


def fmt_finfo_then_check(values, rel_error):
    for name in ("float16", "bfloat16", "float32"):
        dt = getattr(torch, name)
        if values.abs().max() > torch.finfo(dt).max:
            continue
        back = values.to(dt).double()
        rel = (back - values.double()).abs() / values.double().abs().clamp_min(1e-300)
        if rel.max() <= rel_error:
            return name
    return "float64"


def fmt_isclose(values, rel_error):
    for name in ("float16", "bfloat16", "float32"):
        back = values.to(getattr(torch, name)).double()
        if torch.isclose(back, values.double(), rtol=rel_error, atol=0).all():
            return name
    return "float64"


def fmt_dtype_object(values, rel_error):
    return getattr(torch, fmt_loop(values, rel_error))


@pytest.mark.parametrize("fn", [fmt_loop, fmt_finfo_then_check, fmt_isclose,
                                fmt_dtype_object])
def test_right_formats_pass(fn):
    ch08.check_cheapest_format(fn)


def test_wrong_formats_fail():
    def range_only(values, rel_error):
        if values.abs().max() <= torch.finfo(torch.float16).max:
            return "float16"
        return "bfloat16"

    def eps_only(values, rel_error):
        for name in ("float16", "bfloat16", "float32"):
            if torch.finfo(getattr(torch, name)).eps <= rel_error:
                return name
        return "float64"

    def bf16_first(values, rel_error):
        for name in ("bfloat16", "float16", "float32"):
            back = values.to(getattr(torch, name)).double()
            if torch.isfinite(back).all() and torch.isclose(
                    back, values.double(), rtol=rel_error, atol=0).all():
                return name
        return "float64"

    def ignores_underflow(values, rel_error):
        for name in ("float16", "bfloat16", "float32"):
            dt = getattr(torch, name)
            if values.abs().max() <= torch.finfo(dt).max and \
                    torch.finfo(dt).eps / 2 <= rel_error:
                return name
        return "float64"

    def always_float32(values, rel_error):
        return "float32"

    def always_float16(values, rel_error):
        return "float16"

    def absolute_error(values, rel_error):
        for name in ("float16", "bfloat16", "float32"):
            back = values.to(getattr(torch, name)).double()
            if torch.isfinite(back).all() and \
                    (back - values.double()).abs().max() <= rel_error:
                return name
        return "float64"

    def mean_error(values, rel_error):
        for name in ("float16", "bfloat16", "float32"):
            back = values.to(getattr(torch, name)).double()
            rel = ((back - values.double()) / values.double()).abs()
            if torch.isfinite(back).all() and rel.mean() <= rel_error:
                return name
        return "float64"

    def first_value_only(values, rel_error):
        return fmt_loop(values[:1], rel_error)

    fails(ch08.check_cheapest_format, range_only, "65504")
    fails(ch08.check_cheapest_format, eps_only, "65504")
    fails(ch08.check_cheapest_format, bf16_first, "8 bits of mantissa")
    fails(ch08.check_cheapest_format, ignores_underflow, "subnormal")
    fails(ch08.check_cheapest_format, always_float32, "16-bit format would do")
    fails(ch08.check_cheapest_format, always_float16, "65504")
    fails(ch08.check_cheapest_format, absolute_error, "16-bit format would do")
    fails(ch08.check_cheapest_format, mean_error, "try float16")
    fails(ch08.check_cheapest_format, first_value_only, "65504")
