"""Chapter 8's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import glob
import itertools
import math
import os
import pathlib
import shutil
import tempfile
import uuid

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_ as clip
from torch.utils.checkpoint import checkpoint

from course_utils.checks import ch08
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    for w in words:
        assert w in str(e.value), str(e.value)


# ---------------------------------------------------------------- 8.1


def step_alias(model, optimizer, scaler, x, y, max_norm):
    optimizer.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x), y, reduction="mean")
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip(model.parameters(), max_norm=max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_autocast(model, optimizer, scaler, x, y, max_norm):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
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


class Trainer:  # a class, called like a function, that logs as it goes
    def __init__(self):
        self.log = []

    def __call__(self, model, optimizer, scaler, x, y, max_norm):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        self.log.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        scaler.step(optimizer)
        scaler.update()


def step_returns_loss(model, optimizer, scaler, x, y, max_norm):
    optimizer.zero_grad()
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=2.0)
    stepped = scaler.step(optimizer)
    scaler.update()
    return loss.item(), stepped


@pytest.mark.parametrize("fn", [step_alias, step_autocast, step_clip_by_hand,
                                Trainer(), step_returns_loss])
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

    def update_twice(model, optimizer, scaler, x, y, max_norm):
        step_alias(model, optimizer, scaler, x, y, max_norm)
        scaler.update(scaler.get_scale() * 2)

    def forgets_zero_grad(model, optimizer, scaler, x, y, max_norm):
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()

    def sum_loss(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(((model(x) - y) ** 2).sum()).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()

    def new_scaler_each_call(model, optimizer, scaler, x, y, max_norm):
        mine = torch.amp.GradScaler("cpu", init_scale=scaler.get_scale(),
                                    growth_interval=2)
        step_alias(model, optimizer, mine, x, y, max_norm)

    def fresh_optimizer(model, optimizer, scaler, x, y, max_norm):
        lr = optimizer.param_groups[0]["lr"]
        mine = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        step_alias(model, mine, scaler, x, y, max_norm)

    def float32_only(model, optimizer, scaler, x, y, max_norm):
        step_alias(model, optimizer, scaler, x.float(), y.float(), max_norm)

    def skips_on_the_loss(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            return  # a skipped step, but the scale stays where it was
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()

    def update_before_step(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.update()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)

    def inf_check_by_hand(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scale = scaler.get_scale()
        grads = [p.grad for p in model.parameters()]
        for g in grads:
            g.div_(scale)
        if any(torch.isinf(g).any() for g in grads):  # misses nan
            scaler.update(scale / 2)
            return
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()

    fails(ch08.check_scaled_step, clip_before_unscale, "BEFORE clipping")
    fails(ch08.check_scaled_step, no_update, "at the end of every step")
    fails(ch08.check_scaled_step, no_scaler, "never changed")
    fails(ch08.check_scaled_step, optimizer_step_directly, "scaler.step(optimizer)")
    fails(ch08.check_scaled_step, no_clip, "not clipped")
    fails(ch08.check_scaled_step, update_twice, "scaler.update() once per step")
    fails(ch08.check_scaled_step, forgets_zero_grad, "zero the old gradients")
    fails(ch08.check_scaled_step, sum_loss, "not the sum")
    fails(ch08.check_scaled_step, new_scaler_each_call, "made inside your function")
    fails(ch08.check_scaled_step, float32_only, "float64 here")
    fails(ch08.check_scaled_step, fresh_optimizer, "the optimizer you are given")
    fails(ch08.check_scaled_step, skips_on_the_loss, "scale")
    fails(ch08.check_scaled_step, update_before_step, "before scaler.update()")
    fails(ch08.check_scaled_step, inf_check_by_hand, "never changed")


# ---------------------------------------------------------------- 8.2


def recompute_torch(segment, x):  # torch's own, which the exercise rules out
    return checkpoint(segment, x, use_reentrant=False, preserve_rng_state=True)


class _ForkRng(torch.autograd.Function):
    """fork_rng around the recomputation; gradients only for inputs needing them."""

    @staticmethod
    def forward(ctx, x, segment, *params):
        ctx.segment, ctx.state = segment, torch.random.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return segment(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(ctx.state)
            with torch.enable_grad():
                xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
                out = ctx.segment(xd)
        params = tuple(ctx.segment.parameters())
        inputs = ((xd,) if xd.requires_grad else ()) + params
        got = torch.autograd.grad(out, inputs, grad)
        return ((got[0] if xd.requires_grad else None), None, *got[-len(params):])


def recompute_fork_rng(segment, x):
    return _ForkRng.apply(x, segment, *segment.parameters())


class _AccumulateIntoGrad(torch.autograd.Function):
    """Reentrant style: backward() fills the parameters' .grad itself."""

    @staticmethod
    def forward(ctx, x, segment, *params):
        ctx.segment, ctx.state = segment, torch.random.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return segment(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(ctx.state)
            with torch.enable_grad():
                inp = x.detach().requires_grad_(ctx.needs_input_grad[0])
                torch.autograd.backward(ctx.segment(inp), grad)
        n = len(ctx.needs_input_grad) - 2
        return (inp.grad if ctx.needs_input_grad[0] else None, None, *[None] * n)


def recompute_accumulate(segment, x):
    return _AccumulateIntoGrad.apply(x, segment, *segment.parameters())


class Recomputer:  # a class with __call__, hooks instead of a Function
    def __call__(self, segment, x):
        return recompute_hooks(segment, x)


def recompute_hooks(segment, x):
    """Saved-tensor hooks: pack keeps nothing but a note, unpack recomputes."""
    state = torch.get_rng_state()
    cache = {}

    def recompute_all():
        here = torch.get_rng_state()
        torch.set_rng_state(state)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or len(saved) - 1, lambda i: saved[i]):
            with torch.enable_grad():
                segment(x.detach().requires_grad_(x.requires_grad))
        torch.set_rng_state(here)
        cache["saved"] = saved

    def unpack(i):
        if "saved" not in cache:
            recompute_all()
        t, cache["saved"][i] = cache["saved"][i], None  # each is unpacked once
        return t

    counter = itertools.count()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: next(counter), unpack):
        return segment(x)


def recompute_functional(segment, x):
    params = dict(segment.named_parameters())
    names = list(params)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, *values):
            ctx.rng = torch.get_rng_state()
            ctx.save_for_backward(inp)
            with torch.no_grad():
                return torch.func.functional_call(segment, dict(zip(names, values,
                                                      strict=True)),
                                                  (inp,))

        @staticmethod
        def backward(ctx, grad_out):
            (inp,) = ctx.saved_tensors
            values = [params[n].detach().requires_grad_() for n in names]
            keep = torch.get_rng_state()
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                i2 = inp.detach().requires_grad_()
                out = torch.func.functional_call(segment, dict(zip(names, values,
                                                      strict=True)),
                                                 (i2,))
            torch.set_rng_state(keep)
            return torch.autograd.grad(out, [i2, *values], grad_out)

    return Fn.apply(x, *params.values())


@pytest.mark.parametrize("fn", [recompute_fork_rng, recompute_accumulate, Recomputer(),
                                recompute_hooks, recompute_functional])
def test_right_recomputations_pass(fn):
    ch08.check_recompute(fn)


def _function(forward, backward):
    """A torch.autograd.Function from two plain functions (for wrong answers)."""
    fn = type("Wrong", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})
    return fn


def _wrong_recompute(save_rng=True, grad_of_sum=False, params_too=True,
                     accumulate_and_return=False, recomputes=1, enable_grad=True,
                     keep_first=False, restore_rng=True):
    def recompute(segment, x):
        params = list(segment.parameters())

        def forward(ctx, inp, *ps):
            ctx.rng = torch.get_rng_state()
            with torch.no_grad():
                out = segment(inp)
            kept = segment[1](inp) if keep_first else inp
            ctx.save_for_backward(inp, kept)
            return out

        def backward(ctx, grad):
            inp, _ = ctx.saved_tensors
            now = torch.get_rng_state()
            for _ in range(recomputes):
                if save_rng:
                    torch.set_rng_state(ctx.rng)
                with torch.set_grad_enabled(enable_grad):
                    i2 = inp.detach().requires_grad_()
                    out = segment(i2)
            if restore_rng:
                torch.set_rng_state(now)
            wrt = [i2, *params] if params_too else [i2]
            g = grad if not grad_of_sum else torch.ones_like(out)
            if accumulate_and_return:
                torch.autograd.backward(out, g, inputs=wrt)
                return (i2.grad, *[p.grad for p in params])
            grads = torch.autograd.grad(out, wrt, g)
            return (*grads, *[None] * (len(params) + 1 - len(grads)))

        return _function(forward, backward).apply(x, *params)
    return recompute


def test_wrong_recomputations_fail():
    def plain(segment, x):
        return segment(x)

    def no_graph(segment, x):
        with torch.no_grad():
            return segment(x)

    def reentrant(segment, x):
        return checkpoint(segment, x, use_reentrant=True)

    def float32_only(segment, x):
        return recompute_torch(segment, x.float())

    def keeps_a_graph_too(segment, x):
        inner = segment(x)  # the activations stay held by inner's graph
        return recompute_fork_rng(segment, x) + 0 * inner

    check = ch08.check_recompute
    fails(check, plain, "ran once")
    fails(check, no_graph, "no graph")
    fails(check, reentrant, "torch.utils.checkpoint")
    fails(check, recompute_torch, "torch.utils.checkpoint", "by hand")
    fails(check, float32_only, "float64")
    fails(check, keeps_a_graph_too, "ran 3 times")
    fails(check, _wrong_recompute(save_rng=False), "dropout masks")
    fails(check, _wrong_recompute(grad_of_sum=True), "gradient of the output")
    fails(check, _wrong_recompute(params_too=False), "parameters")
    fails(check, _wrong_recompute(accumulate_and_return=True), "twice")
    fails(check, _wrong_recompute(recomputes=2), "ran 3 times")
    fails(check, _wrong_recompute(enable_grad=False), "enable_grad")
    fails(check, _wrong_recompute(keep_first=True), "bytes held")
    fails(check, _wrong_recompute(restore_rng=False), "repeats masks")


# ---------------------------------------------------------------- 8.3


def offload_uuid(fn, x, folder):
    def pack(t):
        path = os.path.join(folder, uuid.uuid4().hex + ".pt")
        torch.save(t, path)
        return path

    def unpack(path):
        try:
            return torch.load(path, weights_only=True)
        finally:
            os.remove(path)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


_numbers = itertools.count()  # one counter for every call: names never repeat


def offload_counter(fn, x, folder):
    def pack(t):
        name = pathlib.Path(folder) / f"saved_{next(_numbers)}.bin"
        with open(name, "wb") as f:
            torch.save({"tensor": t}, f)
        return name

    def unpack(name):
        with open(name, "rb") as f:
            t = torch.load(f, weights_only=True)["tensor"]
        name.unlink()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


class ToDisk(torch.autograd.graph.saved_tensors_hooks):  # a class of hooks
    def __init__(self, folder):
        self.folder = folder
        super().__init__(self.pack, self.unpack)

    def pack(self, t):
        fd, path = tempfile.mkstemp(dir=self.folder)
        with os.fdopen(fd, "wb") as f:
            torch.save(t, f)
        return path

    def unpack(self, path):
        t = torch.load(path, weights_only=True)
        os.unlink(path)
        return t


def offload_class(fn, x, folder):
    with ToDisk(folder):
        out = fn(x)
    return out


def offload_keeps_parameters(fn, x, folder):
    """Parameters stay where they are (they are held anyway); the rest to disk."""
    params = {p.untyped_storage().data_ptr() for p in fn.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() in params:
            return ("here", t)
        path = os.path.join(folder, f"{uuid.uuid4()}.pt")
        torch.save(t.detach(), path)
        return ("disk", path)

    def unpack(packed):
        where, what = packed
        if where == "here":
            return what
        t = torch.load(what, weights_only=True)
        os.remove(what)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


class Offloader:  # a callable object whose file names carry its own id and a count
    def __init__(self):
        self.n = 0

    def __call__(self, fn, x, folder):
        def pack(t):
            self.n += 1
            path = os.path.join(folder, f"{id(self)}-{self.n}")
            torch.save(t, path)
            return path

        def unpack(path):
            t = torch.load(path, weights_only=False)
            os.remove(path)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(x)


@pytest.mark.parametrize("fn", [offload_uuid, offload_counter, offload_class,
                                offload_keeps_parameters, Offloader()])
def test_right_offloads_pass(fn):
    ch08.check_offloaded(fn)


def _offload(pack_kind="file", unpack_kind="delete", names="unique", keep=False,
             to_half=False, as_float=False):
    def offloaded(fn, x, folder):
        count = itertools.count()
        cache = []

        def pack(t):
            if pack_kind == "none":
                return t
            path = os.path.join(folder, f"{uuid.uuid4()}.pt" if names == "unique"
                                else f"{next(count)}.pt")
            u = t.half() if to_half else t.float() if as_float else t
            if pack_kind == "numpy":
                np.save(path, u.detach().numpy())
                path += ".npy"
            else:
                torch.save(u, path)
            if keep:
                cache.append(t)  # "for speed"
            return path, t.dtype

        def unpack(packed):
            if pack_kind == "none":
                return packed
            path, dtype = packed
            t = (torch.from_numpy(np.load(path)) if pack_kind == "numpy" else
                 torch.load(path, weights_only=True)).to(dtype)
            if unpack_kind == "delete":
                os.remove(path)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(x)
    return offloaded


def test_wrong_offloads_fail(request):
    def hooks_around_nothing(fn, x, folder):
        out = fn(x)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            pass
        return out

    elsewhere = tempfile.TemporaryDirectory()
    request.addfinalizer(elsewhere.cleanup)  # with the files left in it

    def own_temp_dir(fn, x, folder):
        return offload_uuid(fn, x, elsewhere.name)

    def no_grad(fn, x, folder):
        with torch.no_grad():
            return offload_uuid(fn, x, folder)

    def names_by_shape(fn, x, folder):
        def pack(t):
            path = os.path.join(folder, "x".join(map(str, t.shape)) + ".pt")
            torch.save(t, path)
            return path

        def unpack(path):
            t = torch.load(path, weights_only=True)
            if os.path.exists(path):
                os.remove(path)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(x)

    def clears_folder_after_forward(fn, x, folder):
        out = offload_counter(fn, x, folder)
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        return out

    check = ch08.check_offloaded
    fails(check, _offload(pack_kind="none"), "empty folder")
    fails(check, _offload(keep=True), "keep no reference")
    fails(check, _offload(names="per call"), "overwrote")
    fails(check, _offload(unpack_kind="keep"), "delete each file")
    fails(check, _offload(to_half=True), "not a smaller copy")
    fails(check, _offload(as_float=True), "not a smaller copy")
    fails(check, _offload(pack_kind="numpy"), "numpy has no bfloat16")
    fails(check, hooks_around_nothing, "empty folder")
    fails(check, own_temp_dir, "empty folder")
    fails(check, no_grad, "no graph")
    fails(check, clears_folder_after_forward, "only once it has been read back")
    fails(check, names_by_shape, "names repeat")
    elsewhere.cleanup()


def test_checkers_leave_no_temporary_folder():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "ch08_check_*")))
    ch08.check_offloaded(offload_uuid)
    with pytest.raises(ExerciseFailed):
        ch08.check_offloaded(_offload(unpack_kind="keep"))
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "ch08_check_*")))
    assert after == before
# ---------------------------------------------------------------- 8.4


def fmt_loop(values, rel_error):
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        r = values.to(dt).to(torch.float64)
        v = values.to(torch.float64)
        if torch.isfinite(r).all() and torch.all((r - v).abs() <= rel_error * v.abs()):
            return str(dt).removeprefix("torch.")
    return "float64"


def fmt_python_floats(values, rel_error):  # element by element, Python floats
    xs = values.reshape(-1).tolist()
    for name in ("float16", "bfloat16", "float32"):
        stored = torch.tensor(xs, dtype=torch.float64).to(getattr(torch, name)).tolist()
        if all(math.isfinite(s) and abs(s - v) <= rel_error * abs(v)
               for s, v in zip(stored, xs, strict=True)):
            return name
    return "float64"


class FormatPicker:  # a class; relative error with zeros handled apart
    order = ("float16", "bfloat16", "float32")

    def __call__(self, values, rel_error):
        v = values.to(torch.float64)
        for name in self.order:
            r = values.to(getattr(torch, name)).to(torch.float64)
            err = torch.where(v == 0, (r - v).abs(), (r - v).abs() / v.abs())
            if torch.isfinite(r).all() and (err <= rel_error).all():
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


def fmt_numpy(values, rel_error):
    v = values.double().numpy()
    for name in ("float16", "bfloat16", "float32"):
        back = values.to(getattr(torch, name)).double().numpy()
        err = np.abs(back - v)
        if np.isfinite(back).all() and (err <= rel_error * np.abs(v)).all():
            return name
    return "float64"


@pytest.mark.parametrize("fn", [fmt_loop, fmt_python_floats, FormatPicker(),
                                fmt_isclose, fmt_dtype_object, fmt_numpy])
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

    def largest_only(values, rel_error):
        return fmt_loop(values.abs().max().reshape(1), rel_error)

    fails(ch08.check_cheapest_format, largest_only, "subnormal")
    fails(ch08.check_cheapest_format, range_only, "65504")
    fails(ch08.check_cheapest_format, eps_only, "65504")
    fails(ch08.check_cheapest_format, bf16_first, "8 bits of mantissa")
    fails(ch08.check_cheapest_format, ignores_underflow, "subnormal")
    fails(ch08.check_cheapest_format, always_float32, "16-bit format would do")
    fails(ch08.check_cheapest_format, always_float16, "65504")
    fails(ch08.check_cheapest_format, absolute_error, "16-bit format would do")
    fails(ch08.check_cheapest_format, mean_error, "division by |v|")
    fails(ch08.check_cheapest_format, first_value_only, "65504")


def fmt_finfo_then_check(values, rel_error):  # range by finfo.max: 65510 fits
    for name in ("float16", "bfloat16", "float32"):
        dt = getattr(torch, name)
        if values.abs().max() > torch.finfo(dt).max:
            continue
        back = values.to(dt).double()
        rel = (back - values.double()).abs() / values.double().abs().clamp_min(1e-300)
        if rel.max() <= rel_error:
            return name
    return "float64"


def fmt_never_float64(values, rel_error):
    exact = values.double()
    for name in ("float16", "bfloat16"):
        s = values.to(getattr(torch, name)).double()
        if torch.isfinite(s).all() and (
                (s - exact).abs() <= rel_error * exact.abs()).all():
            return name
    return "float32"


def fmt_float32_reference(values, rel_error):  # the "exact" values in float32
    exact = values.float()
    for name in ("float16", "bfloat16", "float32"):
        s = values.to(getattr(torch, name)).float()
        if torch.isfinite(s).all() and (
                (s - exact).abs() <= rel_error * exact.abs()).all():
            return name
    return "float64"


def fmt_eps_and_tiny(values, rel_error):  # a formula from finfo, no conversion
    a = values.double().abs()
    nonzero = a[a > 0]
    for name in ("float16", "bfloat16", "float32"):
        fi = torch.finfo(getattr(torch, name))
        if fi.eps / 2 <= rel_error and a.max() <= fi.max and (
                nonzero.numel() == 0 or nonzero.min() >= fi.tiny):
            return name
    return "float64"


def fmt_strictly_less(values, rel_error):  # < : a zero never passes
    exact = values.double()
    for name in ("float16", "bfloat16", "float32"):
        s = values.to(getattr(torch, name)).double()
        if torch.isfinite(s).all() and (
                (s - exact).abs() < rel_error * exact.abs()).all():
            return name
    return "float64"


def fmt_mean_clamped(values, rel_error):  # the mean relative error, zeros handled
    exact = values.double()
    for name in ("float16", "bfloat16", "float32"):
        s = values.to(getattr(torch, name)).double()
        rel = (s - exact).abs() / exact.abs().clamp_min(1e-300)
        if torch.isfinite(s).all() and rel.mean() <= rel_error:
            return name
    return "float64"


def fmt_rounded_in_place(values, rel_error):  # writes the rounded values back
    answer = fmt_loop(values.clone(), rel_error)
    values.copy_(values.to(torch.float16).to(values.dtype))
    return answer


def fmt_calls_reference(values, rel_error):  # returns what the check compares with
    return ch08.cheapest_format_reference(values, rel_error)


@pytest.mark.parametrize("fn, words", [
    (fmt_finfo_then_check, ["65504", "finfo"]),
    (fmt_never_float64, ["float64", "float32 copy"]),
    (fmt_float32_reference, ["float64", "float32 copy"]),
    (fmt_eps_and_tiny, ["65504", "finfo"]),
    (fmt_strictly_less, ["zero", "<="]),
    (fmt_mean_clamped, ["every value", "mean"]),
    (fmt_rounded_in_place, ["left as given", "never write"]),
    (fmt_calls_reference, ["reference answer"]),
])
def test_more_wrong_formats_fail(fn, words):
    fails(ch08.check_cheapest_format, fn, *words)


# ------------------------------------------- 8.1-8.3: more answers, written anew


def step_total_norm(model, optimizer, scaler, x, y, max_norm):  # 2.6+ clip helpers
    for p in model.parameters():
        p.grad = None
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters()]
    total = nn.utils.get_total_norm(grads, 2.0)
    nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    scaler.step(optimizer)
    scaler.update()


class StepWithLoss:  # a class that also returns the unscaled loss
    def __call__(self, model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad(set_to_none=True)
        scaled = scaler.scale(nn.MSELoss()(model(x), y))
        scaled.backward()
        scaler.unscale_(optimizer)
        clip(list(model.parameters()), max_norm=max_norm, norm_type=2, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        return scaled.detach() / scaler.get_scale()


def _step_with(clip_fn):
    def step(model, optimizer, scaler, x, y, max_norm):
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(optimizer)
        clip_fn(model, max_norm)
        scaler.step(optimizer)
        scaler.update()
    return step


def _clip_each(model, max_norm):
    for p in model.parameters():
        clip([p], max_norm)


def step_float32_model(model, optimizer, scaler, x, y, max_norm):  # float32 only
    model.float()
    optimizer.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x.float()), y.float())).backward()
    scaler.unscale_(optimizer)
    clip(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_own_inf_check(model, optimizer, scaler, x, y, max_norm):  # no update on skip
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    if not torch.isfinite(loss):
        return
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def step_calls_reference(model, optimizer, scaler, x, y, max_norm):
    ch08._solution_step(model, optimizer, scaler, x, y, max_norm)


@pytest.mark.parametrize("fn", [step_total_norm, StepWithLoss()])
def test_more_right_scaled_steps_pass(fn):
    ch08.check_scaled_step(fn)


@pytest.mark.parametrize("fn, words", [
    (_step_with(lambda m, n: nn.utils.clip_grad_value_(m.parameters(), n)),
     ["element by element", "clip_grad_norm_"]),
    (_step_with(_clip_each), ["on its own", "all gradients together"]),
    (_step_with(lambda m, n: clip(m.parameters(), 1.0)), ["1.0", "max_norm you are"]),
    (step_float32_model, ["still torch.float64", "keep the dtypes"]),
    (step_own_inf_check, ["the scale", "halves the scale"]),
    (step_calls_reference, ["reference answer"]),
])
def test_more_wrong_scaled_steps_fail(fn, words):
    fails(ch08.check_scaled_step, fn, *words)


def recompute_float32(segment, x):  # turns the segment to float32
    return recompute_fork_rng(segment.float(), x.float())


def recompute_calls_reference(segment, x):
    return ch08._reference_recompute(segment, x)


_first_states = {}


def recompute_state_from_first_call(segment, x):  # random state kept across calls
    first = _first_states.setdefault(id(segment), torch.get_rng_state())

    class Kept(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, *params):
            ctx.save_for_backward(inp)
            with torch.no_grad():
                return segment(inp)

        @staticmethod
        def backward(ctx, grad):
            (inp,) = ctx.saved_tensors
            now = torch.get_rng_state()
            torch.set_rng_state(first)
            with torch.enable_grad():
                i2 = inp.detach().requires_grad_()
                out = segment(i2)
            torch.set_rng_state(now)
            return torch.autograd.grad(out, (i2, *segment.parameters()), grad)

    return Kept.apply(x, *segment.parameters())


@pytest.mark.parametrize("fn, words", [
    (recompute_float32, ["still torch.float64", "own dtype"]),
    (recompute_calls_reference, ["reference answer"]),
    (recompute_state_from_first_call, ["dropout masks"]),
])
def test_more_wrong_recomputations_fail(fn, words):
    fails(ch08.check_recompute, fn, *words)


class OffloadWithOpen:  # a class; a counter kept across calls; open() and pathlib
    def __init__(self):
        self.n = itertools.count()

    def __call__(self, fn, x, folder):
        def pack(t):
            path = pathlib.Path(folder) / f"saved-{os.getpid()}-{next(self.n)}.bin"
            with open(path, "wb") as f:
                torch.save(t.detach(), f)
            return str(path)

        def unpack(path):
            with open(path, "rb") as f:
                t = torch.load(f, weights_only=True)
            pathlib.Path(path).unlink()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(x)


def offload_pickle(fn, x, folder):  # pickle instead of torch.save
    import pickle

    def pack(t):
        path = os.path.join(folder, uuid.uuid4().hex + ".pkl")
        with open(path, "wb") as f:
            pickle.dump(t.detach().clone(), f)
        return path

    def unpack(path):
        with open(path, "rb") as f:
            t = pickle.load(f)  # noqa: S301 - the file was written just above
        os.unlink(path)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


_OWN_FOLDERS = []  # made by wrong answers that save elsewhere; removed after each test


def _folder_of_its_own():
    _OWN_FOLDERS.append(tempfile.mkdtemp(prefix="ch08_wrong_"))
    return _OWN_FOLDERS[-1]


@pytest.fixture(autouse=True)
def _remove_own_folders():
    yield
    while _OWN_FOLDERS:
        shutil.rmtree(_OWN_FOLDERS.pop(), ignore_errors=True)


def _offload_named(name_of, keep=False, save=lambda t: t, folder_of=None):
    def offloaded(fn, x, folder):
        kept = {}
        where = folder_of() if folder_of else folder

        def pack(t):
            path = os.path.join(where, name_of(t))
            torch.save(save(t), path)
            if keep:
                kept[path] = t
            return path, t.dtype

        def unpack(entry):
            path, dtype = entry
            t = kept.pop(path) if keep else torch.load(path).to(dtype)
            os.remove(path)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(x)
    return offloaded


def _counter_per_call():  # names restart at 0 on every call
    def offloaded(fn, x, folder):
        counter = itertools.count()
        return _offload_named(lambda t: f"{next(counter)}.pt")(fn, x, folder)
    return offloaded


@pytest.mark.parametrize("fn", [OffloadWithOpen(), offload_pickle])
def test_more_right_offloads_pass(fn):
    ch08.check_offloaded(fn)


@pytest.mark.parametrize("fn, words", [
    (_counter_per_call(), ["two forwards", "in this call or another"]),
    (_offload_named(lambda t: uuid.uuid4().hex, keep=True), ["bytes left held",
                                                           "no reference"]),
    (_offload_named(lambda t: uuid.uuid4().hex,
                    save=lambda t: t.half() if t.is_floating_point() else t),
     ["on disk", "smaller copy"]),
    (_offload_named(lambda t: uuid.uuid4().hex, folder_of=_folder_of_its_own),
     ["an empty folder", "folder you are given"]),
])
def test_more_wrong_offloads_fail(fn, words):
    fails(ch08.check_offloaded, fn, *words)


# ------------------------------------------ 8.4: long, strided, each value its own


def fmt_first_hundred(values, rel_error):  # looks at the first 100 values only
    return fmt_loop(values.reshape(-1)[:100], rel_error)


def fmt_norm_wise(values, rel_error):  # the largest error against the largest value
    v = values.double()
    for name in ("float16", "bfloat16", "float32"):
        r = values.to(getattr(torch, name)).double()
        if torch.isfinite(r).all() and (r - v).abs().max() <= rel_error * v.abs().max():
            return name
    return "float64"


def fmt_allclose(values, rel_error):  # allclose's default atol=1e-8 as well
    v = values.double()
    for name in ("float16", "bfloat16", "float32"):
        r = values.to(getattr(torch, name)).double()
        if torch.isfinite(r).all() and torch.allclose(r, v, rtol=rel_error):
            return name
    return "float64"


def fmt_first_row(values, rel_error):  # a 2-D input read by its first row
    return fmt_loop(values[0] if values.dim() > 1 else values, rel_error)


def fmt_sorted_chunks(values, rel_error):  # right: the values sorted, in chunks
    flat = values.reshape(-1).sort().values
    names = ("float16", "bfloat16", "float32", "float64")
    worst = max(names.index(fmt_loop(c, rel_error)) for c in flat.split(64))
    return names[worst]


def test_cheapest_format_accepts_sorted_chunks():
    ch08.check_cheapest_format(fmt_sorted_chunks)


@pytest.mark.parametrize("fn, words", [
    (fmt_first_hundred, ["4,099 values", "whole tensor"]),
    (fmt_norm_wise, ["ITS size", "not the largest error"]),
    (fmt_allclose, ["atol=1e-8"]),
    (fmt_first_row, ["transposed", "convert all of it"]),
])
def test_cheapest_format_names_a_partial_look(fn, words):
    fails(ch08.check_cheapest_format, fn, *words)


def fmt_relative_to_stored(values, rel_error):  # |stored - v| <= rel * |stored|
    v = values.double()
    for name in ("float16", "bfloat16", "float32"):
        r = values.to(getattr(torch, name)).double()
        if torch.isfinite(r).all() and ((r - v).abs() <= rel_error * r.abs()).all():
            return name
    return "float64"


def fmt_tiny_epsilon(values, rel_error):  # an epsilon against division by zero
    v = values.double()
    for name in ("float16", "bfloat16", "float32"):
        r = values.to(getattr(torch, name)).double()
        if torch.isfinite(r).all() and ((r - v).abs() / (v.abs() + 1e-12)
                                        <= rel_error).all():
            return name
    return "float64"


def fmt_numpy_of_the_input(values, rel_error):  # numpy first: no bfloat16 there
    v = values.numpy().astype(np.float64)
    for name in ("float16", "bfloat16", "float32"):
        r = values.to(getattr(torch, name)).double().numpy()
        if np.isfinite(r).all() and (np.abs(r - v) <= rel_error * np.abs(v)).all():
            return name
    return "float64"


def fmt_allclose_no_atol(values, rel_error):  # right: allclose told atol=0
    v = values.detach().to(torch.float64)
    for name in ("float16", "bfloat16", "float32"):
        r = v.to(getattr(torch, name)).to(torch.float64)
        if torch.isfinite(r).all() and torch.allclose(r, v, rtol=rel_error, atol=0.0):
            return name
    return "float64"


def test_cheapest_format_accepts_allclose_without_atol():
    ch08.check_cheapest_format(fmt_allclose_no_atol)


@pytest.mark.parametrize("fn, words", [
    (fmt_relative_to_stored, ["rounds up", "not to the stored value"]),
    (fmt_tiny_epsilon, ["1e-15", "no epsilon"]),
    (fmt_numpy_of_the_input, ["bfloat16", "numpy has no bfloat16"]),
])
def test_cheapest_format_names_the_error_measure(fn, words):
    fails(ch08.check_cheapest_format, fn, *words)


# ------------------------------------------ 8.3: the input on disk, hooks that end


def offload_grad_tensors_only(fn, x, folder):  # what needs no gradient stays in memory
    def pack(t):
        if not t.requires_grad:
            return t
        path = os.path.join(folder, f"{uuid.uuid4()}.pt")
        torch.save(t, path)
        return path

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        t = torch.load(packed, weights_only=True)
        os.remove(packed)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


def offload_hooks_never_closed(fn, x, folder):  # entered, never left
    def pack(t):
        path = os.path.join(folder, f"{uuid.uuid4()}.pt")
        torch.save(t, path)
        return path

    def unpack(path):
        t = torch.load(path, weights_only=True)
        os.remove(path)
        return t

    torch.autograd.graph.saved_tensors_hooks(pack, unpack).__enter__()
    return fn(x)


@pytest.mark.parametrize("fn, words", [
    (offload_grad_tensors_only, ["the input x too", "still held in memory"]),
    (offload_hooks_never_closed, ["still set after", "context manager"]),
])
def test_offloads_that_keep_the_input_or_the_hooks_fail(fn, words):
    fails(ch08.check_offloaded, fn, *words)


def recompute_input_on_ctx(segment, x):  # x kept as a ctx attribute, not saved
    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, *params):
            ctx.inp, ctx.rng = inp, torch.get_rng_state()
            with torch.no_grad():
                return segment(inp)

        @staticmethod
        def backward(ctx, grad):
            now = torch.get_rng_state()
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                leaf = ctx.inp.detach().requires_grad_()
                out = segment(leaf)
            torch.set_rng_state(now)
            return torch.autograd.grad(out, [leaf, *segment.parameters()], grad)

    return Recompute.apply(x, *segment.parameters())


def test_recompute_with_the_input_on_ctx_is_named():
    fails(ch08.check_recompute, recompute_input_on_ctx, "peak", "save_for_backward")
