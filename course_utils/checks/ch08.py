"""Checkers for Chapter 8 (mixed precision, checkpointing, offloading).

Every checker runs the learner's code, forward and backward, inside a thread
it waits for with a timeout, so a loop that never ends fails the check
instead of hanging the notebook.

8.1 runs the learner's loss-scaled step several times with one scaler
(float32 and float64 models, inputs of mixed magnitudes, steps whose
gradients overflow to inf or become nan) against a reference trajectory of
weights and scales. 8.2 chains the learner's hand-written recomputation over
blocks (Dropout included, float64, 3-D inputs) and checks the gradients, the
bytes the forward leaves held and the step's peak (LiveBytes, deterministic)
and how often each block runs. 8.3 runs a forward whose saved tensors the
learner keeps in files: what stays in memory, what lies on disk after two
forwards, that nothing is left after the backward, and the gradients. 8.4
asks for the cheapest float format for value sets chosen so that range,
precision and underflow each decide once.
"""

from __future__ import annotations

import copy
import os
import tempfile
import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn

from course_utils import compat
from course_utils.exercises import (
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
)
from course_utils.memory import LiveBytes


def _guarded(exercise: str, body: Callable, *args, timeout: float | None = None):
    """Run ``body(*args)`` (which calls the learner's code) in a thread; fail
    kindly if it does not return within ``timeout`` seconds."""
    out: dict = {}

    def target():
        try:
            out["value"] = body(*args)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    timeout = timeout or answer_limit(exercise)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a second thread only waits on a busy CPU
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout)
    torch.set_num_threads(threads)
    if worker.is_alive():
        fail(exercise, f"your code to finish within {timeout:.0f} s",
             "it was still running (a loop that never ends?)",
             "look for a loop whose end never comes, or a wait on nothing")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _same(a, b, rtol=1e-5, atol=1e-7) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=rtol,
                                                 atol=atol)


def _not_from_learner(exercise: str) -> None:
    """Called first by the checker's own reference answers: code outside this
    module that calls one (an import from the checker) has not solved it."""
    import sys

    if sys._getframe(2).f_globals.get("__name__") != __name__:
        fail(exercise, "your own code", "a call to the checker's reference answer",
             "write the function yourself: the check compares with this reference")


# ---------------------------------------------------------------- exercise 8.1


def _solution_step(model, optimizer, scaler, x, y, max_norm):
    _not_from_learner("8.1")
    optimizer.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def _variant_step(model, optimizer, x, y, max_norm, scale, variant):
    """A mistaken step, done by hand, to name the mistake a learner made."""
    if variant != "leftover gradients":
        optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    if variant == "sum loss":
        loss = ((model(x) - y) ** 2).sum()
    (loss * scale).backward()
    grads = [p.grad for p in model.parameters()]
    if not all(torch.isfinite(g).all() for g in grads):
        return
    if variant == "clip before unscale":
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with torch.no_grad():
        for g in grads:
            g /= scale
    if variant in ("sum loss", "leftover gradients"):
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if variant == "clip by value":
        nn.utils.clip_grad_value_(model.parameters(), max_norm)
    if variant == "clip each parameter":
        for p in model.parameters():
            nn.utils.clip_grad_norm_([p], max_norm)
    if variant == "a fixed max_norm":
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


STEP_HINTS = {
    "clip before unscale": "the gradients were clipped while still scaled: call "
                           "scaler.unscale_(optimizer) BEFORE clipping (the clip "
                           "must see the true gradients)",
    "no clip": "the gradients were not clipped to max_norm (their total norm): "
               "clip_grad_norm_ after scaler.unscale_(optimizer)",
    "leftover gradients": "the gradients of the earlier step were added to the new "
                          "ones: zero the old gradients first",
    "sum loss": "the loss is the mean squared error (mse_loss), not the sum",
    "clip by value": "the gradients were clipped element by element (clip_grad_value_):"
                     " clip their total norm to max_norm with clip_grad_norm_",
    "clip each parameter": "each parameter's gradient was clipped on its own: clip "
                           "the norm of all gradients together, one "
                           "clip_grad_norm_(model.parameters(), max_norm)",
    "a fixed max_norm": "the norm was clipped to 1.0: clip to the max_norm you are "
                        "given",
}


def _step_batches(dtype, mixed):
    """(x, y) batches: finite ones, one with inf, one with nan, in between."""
    g = torch.Generator().manual_seed(5)
    mag = torch.logspace(-3, 3, 5, dtype=torch.float64) if mixed else torch.ones(5)
    out = []
    for k in range(7):
        x = (torch.randn(9, 5, generator=g, dtype=torch.float64) * mag).to(dtype)
        y = torch.randn(9, 2, generator=g, dtype=torch.float64).to(dtype)
        if k == 2:
            x[3, 1] = float("inf")
        if k == 5:
            y[0, 0] = float("nan")
        out.append((x, y))
    return out


STEP_CASES = [  # what, dtype, mixed magnitudes, init_scale, max_norm, lr
    ("float32, moderate inputs", torch.float32, False, 1024.0, 0.05, 0.1),
    ("float64, inputs from 1e-3 to 1e3", torch.float64, True, 8.0, 0.3, 0.03),
    ("float32, no clipping needed", torch.float32, False, 4.0, 1e6, 0.05),
    ("float32, a scale so large that gradients overflow", torch.float32, False,
     2.0**127, 1.0, 0.02),
]


def _scaled_step_body(scaled_step) -> None:
    ex = "8.1"
    for what, dtype, mixed, init_scale, max_norm, lr in STEP_CASES:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).to(dtype)
        ref, mine = copy.deepcopy(base), copy.deepcopy(base)
        for p in mine.parameters():  # left over from an earlier step
            p.grad = torch.full_like(p, 0.5)
        # momentum: an optimizer made afresh inside the step loses its state
        opt_r = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        opt_m = torch.optim.SGD(mine.parameters(), lr=lr, momentum=0.9)
        kw = {"init_scale": init_scale, "growth_interval": 2}
        s_ref, s_mine = torch.amp.GradScaler("cpu", **kw), torch.amp.GradScaler(
            "cpu", **kw)
        # float64 steps agree to float64's rounding, not float32's
        tol = (1e-9, 1e-12) if dtype == torch.float64 else (1e-4, 1e-6)
        for k, (x, y) in enumerate(_step_batches(dtype, mixed)):
            start = copy.deepcopy(mine.state_dict())
            old_grads = [None if p.grad is None else p.grad.clone()
                         for p in mine.parameters()]
            old_opt = copy.deepcopy(opt_m.state_dict())
            scale = s_mine.get_scale()
            _solution_step(ref, opt_r, s_ref, x, y, max_norm)
            call_learner(ex, scaled_step, mine, opt_m, s_mine, x.clone(), y.clone(),
                         max_norm, hints={
                             "dtype": "the model is float64 here: keep the dtypes "
                                      "of the model and the batch as they are",
                             "being called after step()": "call scaler.update() "
                                 "at the end of every step: it readies the scaler "
                                 "for the next one",
                             "No inf checks": "call scaler.step(optimizer) before "
                                              "scaler.update(): it records the inf "
                                              "check that update needs"})
            if opt_r.state and not opt_m.state:
                fail(ex, "a step through the optimizer you are given", "its state "
                     "still empty (no momentum buffer)", "use the optimizer you are "
                     "given: it keeps state between steps (momentum here), a new one "
                     "starts afresh")
            finite = all(torch.isfinite(t).all() for t in (x, y))
            where = f"{what}, call {k + 1} with the same scaler"
            after = mine.state_dict()
            if any(not torch.isfinite(v).all() for v in after.values()):
                fail(ex, f"finite weights ({where})", "inf or nan in the weights",
                     "an inf or nan step must be skipped: let scaler.step(optimizer) "
                     "decide, it skips the step when the gradients are not finite")
            changed = [(n, p.dtype) for n, p in mine.named_parameters()
                       if p.dtype != dtype]
            if changed:
                fail(ex, f"the model's parameters still {dtype} ({where})",
                     f"{changed[0][0]} is now {changed[0][1]}",
                     "keep the dtypes of the model and the batch as they are: no "
                     ".float() or .to(...) on the model or the inputs")
            skipped = s_ref.get_scale() < scale
            moved = any(not torch.equal(start[n], after[n]) for n in start)
            if skipped and moved:
                fail(ex, f"no change to the weights after a step whose gradients "
                     f"were not finite ({where})", "the weights changed",
                     "let scaler.step(optimizer) decide: it skips the step when "
                     "the gradients are not finite (inf or nan)")
            for (name, p), q in zip(mine.named_parameters(), ref.parameters(),
                                    strict=True):
                if _same(p, q, *tol):
                    continue
                hint = ("zero the old gradients, scaler.scale(loss).backward(), "
                        "scaler.unscale_(optimizer), clip, scaler.step(optimizer), "
                        "scaler.update()")
                if not moved and not skipped:
                    hint = ("the weights did not move: call scaler.step(optimizer) "
                            "(and pass this optimizer, not a new one)")
                for variant, h in STEP_HINTS.items():
                    trial = copy.deepcopy(base)
                    trial.load_state_dict(start)
                    for tp, g in zip(trial.parameters(), old_grads, strict=True):
                        tp.grad = g
                    opt_t = torch.optim.SGD(trial.parameters(), lr=lr, momentum=0.9)
                    opt_t.load_state_dict(old_opt)
                    _variant_step(trial, opt_t, x, y, max_norm, scale, variant)
                    if all(_same(a, b, *tol) for a, b in zip(
                            trial.parameters(), mine.parameters(), strict=True)):
                        hint = h
                        break
                fail(ex, f"the SGD step of the unscaled, clipped gradients ({where}, "
                     f"max_norm {max_norm:g})", f"{name} differs "
                     f"({'finite' if finite else 'an inf or nan'} batch)", hint)
            if s_mine.get_scale() != s_ref.get_scale():
                seen = s_mine.get_scale()
                hint = ("call scaler.update() once per step, on the scaler you are "
                        "given: it halves the scale after an inf or nan step and "
                        "doubles it after growth_interval good steps")
                if seen == init_scale:
                    hint = ("the scale you were given never changed: scale the "
                            "loss, step and update through it - scaler.scale(loss), "
                            "scaler.step(optimizer), scaler.update() (a GradScaler "
                            "made inside your function starts afresh every call)")
                fail(ex, f"the scale {s_ref.get_scale():g} after {where}",
                     f"{seen:g}", hint)


def check_scaled_step(scaled_step) -> None:
    ex = "8.1"
    require_solution(ex, scaled_step)
    _guarded(ex, _scaled_step_body, scaled_step)
    passed(ex, "Unscaled before clipping, inf and nan steps skipped, the scale "
           "kept across calls; float32 and float64.")


# ---------------------------------------------------------------- exercise 8.2


class Tap(nn.Module):
    """Counts how often the block it opens runs (its forward, from the inside)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return x


def _recompute_blocks(width, depth, dropout, dtype):
    torch.manual_seed(depth)
    return nn.ModuleList(
        nn.Sequential(Tap(), nn.Linear(width, 2 * width), nn.GELU(),
                      nn.Dropout(dropout), nn.Linear(2 * width, width), nn.Tanh())
        for _ in range(depth)).to(dtype)


RECOMPUTE_CASES = [  # what, width, depth, dropout, dtype, input shape, x needs grad
    ("3 blocks, float64, a 3-D input", 24, 3, 0.0, torch.float64, (4, 24, 24), True),
    ("4 blocks with Dropout(0.2), float32", 32, 4, 0.2, torch.float32, (96, 32),
     True),
    ("5 blocks with Dropout(0.5), an input that needs no gradient", 16, 5, 0.5,
     torch.float32, (128, 16), False),
]


def _reference_recompute(segment, x):
    """The checker's own recomputation (torch's, not reentrant)."""
    _not_from_learner("8.2")
    from torch.utils.checkpoint import checkpoint

    return checkpoint(segment, x, use_reentrant=False)


def _chain_step(forward, blocks, x, w, seed, ex=None):
    """Forward through blocks (each through ``forward``), backward of (out * w);
    returns out, the gradients, the bytes held after the forward and the peak
    (``LiveBytes``: tensors made during the step), and how often each block ran."""
    for b in blocks:
        b[0].runs = 0
    blocks.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    with LiveBytes() as live:
        h = x
        for b in blocks:
            h = forward(b, h) if ex is None else call_learner(ex, forward, b, h, hints={
                "dtype": "keep the input's dtype (float64 here)"})
        held = live.current
        if not isinstance(h, torch.Tensor) or h.grad_fn is None:
            return h, None, held, None, [b[0].runs for b in blocks]

        def backward():
            (h * w).sum().backward()

        if ex is None:
            backward()
        else:
            call_learner(ex, backward, hints={
                "does not require grad": "recompute under torch.enable_grad(): "
                                         "backward runs with gradients off"})
    grads = [x.grad] + [p.grad for p in blocks.parameters()]
    _chain_step.rng_after = torch.get_rng_state()
    return h, grads, held, live.peak, [b[0].runs for b in blocks]


class _CheckpointWatch:
    """Notes whether torch.utils.checkpoint runs (either flavour) while the
    learner's code does: the exercise builds recomputation by hand."""

    def __enter__(self):
        import torch.utils.checkpoint as cp

        self.cp, self.used = cp, False
        self.name = compat.checkpoint_generator()  # moved in torch 2.14
        self.gen = getattr(cp, self.name)
        self.fwd = cp.CheckpointFunction.__dict__["forward"]

        def gen(*args, **kwargs):
            self.used = True
            return self.gen(*args, **kwargs)

        def fwd(*args, **kwargs):
            self.used = True
            return self.fwd.__func__(*args, **kwargs)

        setattr(cp, self.name, gen)
        cp.CheckpointFunction.forward = staticmethod(fwd)
        return self

    def __exit__(self, *exc):
        setattr(self.cp, self.name, self.gen)
        self.cp.CheckpointFunction.forward = self.fwd


def _plain(b, h):
    return b(h)


def _plain_step(blocks, x, w, seed):
    blocks.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    h = x
    for b in blocks:
        h = b(h)
    (h * w).sum().backward()
    _plain_step.rng_after = torch.get_rng_state()
    return h.detach(), [x.grad] + [p.grad for p in blocks.parameters()]


_BASELINES: dict = {}


def _baseline(blocks, x, w, seed):
    """Held and peak bytes without recomputation and with torch's, measured once
    per shape (LiveBytes counts bytes, not values: the same for any input)."""
    key = (tuple(x.shape), x.dtype, x.requires_grad, len(blocks))
    if key not in _BASELINES:
        _, _, held_p, peak_p, _ = _chain_step(_plain, blocks, x, w, seed)
        _, _, held_r, peak_r, _ = _chain_step(_reference_recompute, blocks, x, w, seed)
        _BASELINES[key] = held_p, peak_p, held_r, peak_r
    return _BASELINES[key]


def _recompute_body(recompute) -> None:
    ex = "8.2"
    dropout_free_passed = False
    for what, width, depth, dropout, dtype, shape, needs_grad in RECOMPUTE_CASES:
        blocks = _recompute_blocks(width, depth, dropout, dtype)
        blocks.train()
        g = torch.Generator().manual_seed(width)
        w = torch.rand(*shape[:-1], width, generator=g, dtype=torch.float64).to(dtype)
        for call in (1, 2):  # the same blocks twice: nothing may be kept between
            x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
            x.requires_grad_(needs_grad)
            seed = 100 + call
            out_p, grads_p = _plain_step(blocks, x, w, seed)
            rng_p = _plain_step.rng_after
            held_p, peak_p, held_r, peak_r = _baseline(blocks, x, w, seed)
            where = f"{what}, call {call}"
            with _CheckpointWatch() as watch:
                out, grads, held, peak, runs = _chain_step(recompute, blocks, x, w,
                                                           seed, ex)
            rng = _chain_step.rng_after
            kinds = {p.dtype for p in blocks.parameters()}
            if kinds != {dtype}:
                fail(ex, f"the blocks' parameters still {dtype} ({where})",
                     f"{sorted(map(str, kinds))}", "keep the segment and the input "
                     "in their own dtype: no .float() or .to(...) on them")
            if watch.used:
                fail(ex, f"recomputation built by hand ({where})",
                     "torch.utils.checkpoint doing it",
                     "write a torch.autograd.Function: forward under torch.no_grad() "
                     "keeping only x, backward recomputing under torch.enable_grad()")
            if not isinstance(out, torch.Tensor) or not _same(out, out_p):
                fail(ex, f"recompute(block, x) equal to block(x) ({where})",
                     "a different output" if isinstance(out, torch.Tensor) else
                     f"a {type(out).__name__}",
                     "return what the block computes on x (same dropout masks: "
                     "the forward draws them like block(x) would)")
            if grads is None:
                fail(ex, f"an output that autograd can differentiate ({where})",
                     "an output with no graph (computed under no_grad, or detached)",
                     "run the block without a graph in the forward, but give the "
                     "output one: a torch.autograd.Function whose backward "
                     "recomputes" + ("" if needs_grad else ", with the parameters "
                                     "among its inputs: here x needs no gradient "
                                     "(torch.utils.checkpoint's use_reentrant=True "
                                     "gives no graph then)"))
            _check_recompute_grads(ex, where, grads, grads_p, dropout,
                                   dropout_free_passed, blocks, x, seed)
            if any(r != 2 for r in runs):
                k = max(runs)
                fail(ex, f"each block run twice per step: forward, then once more "
                     f"in backward ({where})", f"runs per block {runs}",
                     "the block ran once: the forward kept its activations instead "
                     "of recomputing them - run it without a graph in the forward"
                     if k < 2 else f"it ran {k} times: recompute once, in backward")
            most = held_r + (held_p - held_r) // 4
            if held > most:
                fail(ex, f"the forward to leave at most {most:,}"
                     f" bytes held (the blocks' inputs and output; {held_p:,} without "
                     f"recomputation) ({where}, LiveBytes)", f"{held:,} bytes",
                     "keep only each block's input for backward, nothing it "
                     "computes inside (no tensor on ctx but the input)")
            if peak > peak_r + (peak_p - peak_r) // 2:
                fail(ex, f"a peak of forward + backward below "
                     f"{peak_r + (peak_p - peak_r) // 2:,} bytes ({where}, LiveBytes;"
                     f" {peak_p:,} without recomputation)", f"{peak:,} bytes",
                     "in backward, recompute one block at a time and let its "
                     "activations go before the next; keep x with "
                     "ctx.save_for_backward(x), which lets it go once used (a "
                     "tensor set as a ctx attribute stays as long as the graph)")
            if dropout and not torch.equal(rng, rng_p):
                fail(ex, f"the random state after the step where a plain step leaves "
                     f"it ({where})", "another state",
                     "restore the random state after recomputing (or recompute "
                     "inside torch.random.fork_rng()): else the next step's dropout "
                     "repeats masks of this one")
        dropout_free_passed = dropout_free_passed or dropout == 0


def _check_recompute_grads(ex, where, grads, grads_p, dropout, dropout_free_passed,
                           blocks, x, seed):
    gx, gx_p, gp, gp_p = grads[0], grads_p[0], grads[1:], grads_p[1:]
    if gx_p is not None and gx is None:
        fail(ex, f"a gradient for x ({where})", "None",
             "backward must return the gradient of the block's input")
    if all(g is None or not g.any() for g in gp):
        fail(ex, f"gradients for the blocks' parameters ({where})", "none (or zeros)",
             "the recomputation must reach the parameters too: torch.autograd.grad "
             "over the input and the parameters, or backward() from the "
             "recomputed output")
    pairs = list(zip([gx, *gp], [gx_p, *gp_p], strict=True))
    if all(_same(a, b) for a, b in pairs):
        return
    if all(a is not None and _same(a, 2 * b) for a, b in zip(gp, gp_p, strict=True)):
        hint = ("the parameters' gradients are twice the plain ones: they were "
                "accumulated into .grad and returned as well - do one or the other")
    elif dropout and dropout_free_passed:
        hint = ("the recomputation drew new dropout masks: save the random state "
                "(torch.get_rng_state()) in the forward and restore it to recompute")
    else:
        hint = ("backward's argument is the gradient of the output: pass it on "
                "(torch.autograd.grad(out, inputs, grad_output)); do not backpropagate "
                "out.sum()")
    fail(ex, f"gradients equal to the blocks' own ({where})", "different gradients",
         hint)


def check_recompute(recompute) -> None:
    ex = "8.2"
    require_solution(ex, recompute)
    _guarded(ex, _recompute_body, recompute)
    passed(ex, "Gradients equal to the plain blocks', each block run twice, and "
           "less held and a lower peak (LiveBytes).")


# ---------------------------------------------------------------- exercise 8.3


def _activation_bytes(model, x) -> tuple[int, int, int]:
    """Bytes autograd saves while model(x) runs, each storage once, parameters
    left out; how many such storages; and how many tensors it packs in all."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held, packs = {}, []

    def pack(t):
        s = t.untyped_storage()
        packs.append(1)
        if s.data_ptr() not in params:
            held[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(held.values()), len(held), len(packs)


def _folder_bytes(folder) -> tuple[int, int]:
    names = os.listdir(folder)
    return len(names), sum(os.path.getsize(os.path.join(folder, n)) for n in names)


OFFLOAD_CASES = [  # what, dtype, input shape, width
    ("float32 MLP", torch.float32, (64, 48), 48),
    ("float64 MLP, a 3-D input of mixed magnitudes", torch.float64, (3, 20, 40), 40),
    ("bfloat16 MLP", torch.bfloat16, (32, 64), 64),
]


def _offload_model(width, dtype):
    torch.manual_seed(width)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                         nn.Linear(2 * width, width), nn.LayerNorm(width),
                         nn.Tanh()).to(dtype)


def _hooks_left_on() -> bool:
    """Whether saved-tensor hooks are still set in this thread."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _offload_body(offloaded) -> None:
    ex = "8.3"
    hints = {"BFloat16": "numpy has no bfloat16: torch.save keeps every dtype",
             "No such file": "a file was missing when the backward needed it: delete "
                             "each file only once it has been read back"}
    for what, dtype, shape, width in OFFLOAD_CASES:
        model = _offload_model(width, dtype)
        g = torch.Generator().manual_seed(width)
        scale = torch.logspace(-3, 3, shape[-1], dtype=torch.float64)
        xs = [(torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
              for _ in range(2)]
        w = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
        model.zero_grad()
        outs_p = [model(x) for x in xs]
        sum((o * w).sum() for o in outs_p).backward()
        grads_p = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        saved, n_saved, n_packs = _activation_bytes(model, xs[0])
        out_bytes = outs_p[0].numel() * outs_p[0].element_size()
        with tempfile.TemporaryDirectory(prefix="ch08_check_") as folder:
            x1 = xs[0].clone()  # the checker keeps no reference to this input
            with LiveBytes() as live:
                out1 = call_learner(ex, offloaded, model, x1, folder, hints=hints)
            held = live.current
            n1, disk1 = _folder_bytes(folder)
            if _hooks_left_on():
                fail(ex, f"the hooks set only while fn(x) runs ({what})",
                     "saved-tensor hooks still set after offloaded returned",
                     "use them as a context manager: `with torch.autograd.graph."
                     "saved_tensors_hooks(pack, unpack): return fn(x)`")
            x1_alive = weakref.ref(x1)
            del x1
            out2 = call_learner(ex, offloaded, model, xs[1], folder, hints=hints)
            n2, _ = _folder_bytes(folder)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            for out, out_p in ((out1, outs_p[0]), (out2, outs_p[1])):
                if not isinstance(out, torch.Tensor) or not _same(out, out_p, tol):
                    fail(ex, f"offloaded(model, x, folder) equal to model(x) ({what})",
                         "a different output" if isinstance(out, torch.Tensor) else
                         f"a {type(out).__name__}", "return what fn(x) returns")
                if out.grad_fn is None:
                    fail(ex, f"an output that autograd can differentiate ({what})",
                         "an output with no graph",
                         "run fn(x) with grad enabled, inside the hooks")
            if n1 == 0:
                hint = ("write each tensor the pack hook receives into the folder "
                        "you are given, and keep the hooks active while fn(x) runs")
                try:
                    (out1 * w).sum().backward()
                except FileNotFoundError:
                    hint = ("the files were gone before the backward needed them: "
                            "delete each file only once it has been read back")
                except Exception:  # noqa: S110 - any other error: the first hint
                    pass
                fail(ex, f"the saved tensors in files in `folder` after the forward "
                     f"({what})", "an empty folder", hint)
            if n1 < n_saved:
                fail(ex, f"at least {n_saved} files after the forward, one per tensor "
                     f"saved ({what})", f"{n1} files",
                     "some file names repeat, so one tensor overwrote another: give "
                     "every file a name no other pack uses (a counter, uuid4, "
                     "tempfile.mkstemp)")
            if disk1 < saved:
                fail(ex, f"at least the {saved:,} bytes autograd saved, on disk "
                     f"({what})", f"{disk1:,} bytes in {n1} files",
                     f"{n_packs} tensors were packed but {n1} files remain: names "
                     "that repeat overwrite each other (id(t) is reused once a "
                     "tensor is freed): give every file a name no other pack uses"
                     if n1 < n_packs else "save every tensor the pack hook "
                     "receives, as it is (not a smaller copy)")
            if held > out_bytes + saved // 8:
                fail(ex, f"at most {out_bytes + saved // 8:,} bytes left held by the "
                     f"forward: its output (LiveBytes; {saved:,} saved for backward "
                     f"went to disk) ({what})", f"{held:,} bytes",
                     "the pack hook must return something small (the file's name) "
                     "and keep no reference to the tensor")
            if x1_alive() is not None:  # made before LiveBytes: not counted there
                fail(ex, f"every saved tensor on disk, the input x too ({what})",
                     "x still held in memory by the graph after the forward",
                     "write every tensor the pack hook receives to a file, those "
                     "that need no gradient (the input) as well, and return only "
                     "the file's name")
            if n2 < 2 * n1:
                fail(ex, f"{2 * n1} files after two forwards whose graphs are both "
                     f"alive ({what})", f"{n2} files",
                     "the second forward overwrote the first one's files: give every "
                     "file a name no other pack, in this call or another, uses")

            def backward(outs=(out1, out2), w=w):
                sum((o * w).sum() for o in outs).backward()

            call_learner(ex, backward, hints=hints)
            left = os.listdir(folder)
            if left:
                fail(ex, f"an empty folder after the backward ({what})",
                     f"{len(left)} files left",
                     "delete each file in the unpack hook, once it has been read back")
        grads = [p.grad for p in model.parameters()]
        if not all(_same(a, b, tol, tol) for a, b in zip(grads, grads_p, strict=True)):
            fail(ex, f"gradients equal to the plain forward's ({what})",
                 "different gradients",
                 "the unpack hook must give back the same tensor: the same values, "
                 "dtype and shape (torch.load of what torch.save wrote)")


def check_offloaded(offloaded) -> None:
    ex = "8.3"
    require_solution(ex, offloaded)
    _guarded(ex, _offload_body, offloaded)
    passed(ex, "Saved tensors kept on disk, not in memory, read back once and "
           "deleted; gradients equal, two graphs at once, three dtypes.")


# ---------------------------------------------------------------- exercise 8.4

FORMATS = ("float16", "bfloat16", "float32")


def cheapest_format_reference(values: torch.Tensor, rel_error: float) -> str:
    _not_from_learner("8.4")
    v = values.double()
    for name in FORMATS:
        r = values.to(getattr(torch, name)).double()
        if not torch.isfinite(r).all():
            continue
        err = ((r - v).abs() / v.abs().clamp_min(1e-300))
        if bool((err <= rel_error).all()):
            return name
    return "float64"


FORMAT_CASES = [  # what, values, relative error, what the case is about
    ("pixel values 0-255", torch.arange(0.0, 256.0, 7.0), 1e-3, ""),
    ("large activations", torch.tensor([7e4, 1.2e5, 3.0e4, 9.9e4]), 1e-2, ""),
    ("tiny gradients", torch.tensor([3e-9, 1e-10, 5e-12, 2e-8]), 1e-2, ""),
    ("precise weights", torch.tensor([1.0001, 0.99991, 1.00037]), 1e-5, ""),
    ("moderate values, loose tolerance", torch.tensor([0.5, 3.25, -12.0, 100.0]), 1e-2,
     ""),
    ("large and precise", torch.tensor([70000.5, 123456.25]), 1e-4, ""),
    ("mostly small, one large", torch.tensor([1.0, 2.0, 0.5, 1e5]), 1e-2, ""),
    ("one value below float16's smallest subnormal",
     torch.tensor([1.0, 0.25, -3.0, 4e-8], dtype=torch.float64), 1e-2, ""),
    ("values that float16 rounds down to its largest, 65504",
     torch.tensor([65510.0, -65519.0, 1.0]), 1e-2,
     "values below 65520 round to 65504 in float16, a finite value: convert and "
     "look at the stored values instead of comparing with torch.finfo(...).max"),
    ("float64 values finer than float32 keeps",
     torch.tensor([1 + 2.0**-40, -3.0 + 2.0**-38], dtype=torch.float64), 1e-13,
     "the values are float64: compare with values.double(), never with a "
     "float32 copy, and return float64 when no cheaper format will do"),
    ("float64 values beyond float32's range",
     torch.tensor([1e39, -2.5e-3], dtype=torch.float64), 1e-2,
     "float32's largest value is about 3.4e38: beyond it only float64 stores the "
     "values finite"),
    ("a 2-D tensor of zeros, negatives and a float16 subnormal, stored exactly",
     torch.tensor([[0.0, -1.5], [2.0**-20, 3.0], [0.0, 0.0]]), 1e-6,
     "values a format stores exactly pass any tolerance, tiny subnormals and "
     "zeros included (a zero's error is 0, never 0/0): convert and compare "
     "rather than reasoning from eps or the smallest normal"),
    ("nine exact values and one off by 1e-4", torch.tensor([1.0] * 9 + [1.0001]),
     2e-5, "every value must be within the tolerance, not their mean or most"),
    ("a large value and a tiny one, each judged by its own size",
     torch.tensor([30000.0, 2e-6, -30000.0]), 1e-3,
     "the error of each value relative to ITS size: |stored - v| <= rel_error * "
     "|v| element by element, not the largest error against the largest value "
     "(a norm)"),
    ("a value float16 flushes to zero, 5e-9", torch.tensor([1.0, 2.0, 5e-9]), 1e-2,
     "a value stored as 0 has lost all of itself: use no absolute tolerance "
     "(torch.allclose and isclose add atol=1e-8 unless told atol=0)"),
]


def _norm_wise(values: torch.Tensor, rel_error: float) -> str:
    v = values.double()
    for name in FORMATS:
        r = values.to(getattr(torch, name)).double()
        if torch.isfinite(r).all() and bool(
                (r - v).abs().max() <= rel_error * v.abs().max()):
            return name
    return "float64"


def _with_atol(values: torch.Tensor, rel_error: float) -> str:
    v = values.double()
    for name in FORMATS:
        r = values.to(getattr(torch, name)).double()
        if torch.isfinite(r).all() and torch.allclose(r, v, rtol=rel_error):
            return name
    return "float64"


def _mistake_probes() -> list:
    """(mistake model, the case that shows it) for hints confirmed on probes."""
    by_what = {c[0]: c for c in FORMAT_CASES}
    return [(_norm_wise, by_what["a large value and a tiny one, each judged by "
                                 "its own size"]),
            (_with_atol, by_what["a value float16 flushes to zero, 5e-9"])]


def _confirmed_hint(ex, cheapest_format, values, rel, got) -> str:
    """The hint of a mistake that gives ``got`` here and also on its own probe."""
    for model, (_, probe, probe_rel, hint) in _mistake_probes():
        if model(values, rel) != got:
            continue
        seen = str(call_learner(ex, cheapest_format, probe.clone(), probe_rel))
        if seen.replace("torch.", "") == model(probe, probe_rel):
            return hint
    return ""


def _long_case() -> tuple:
    """4,099 values float16 stores exactly, but value 2,713 needs float32."""
    g = torch.Generator().manual_seed(84)
    values = torch.randn(4099, generator=g).half().float()
    values[2713] = 1.0001
    return ("4,099 values, one of them (value 2,713) finer than 16 bits keep",
            values, 1e-5, "every value counts: look at the whole tensor, not its "
            "first values or a sample of them")


def _strided_case() -> tuple:
    """A transposed (non-contiguous) float64 view; one value needs bfloat16."""
    g = torch.Generator().manual_seed(85)
    base = torch.randn(7, 5, generator=g, dtype=torch.float64).half().double()
    base[6, 4] = 7e5
    return ("a transposed 5 x 7 float64 view with one value beyond float16's range",
            base.T, 1e-2, "a view is a tensor like any other: convert all of it "
            "(no .view(-1) on a non-contiguous tensor, no loop over the first row)")


def _rounded_up_case() -> tuple:
    """A value float16 rounds up, to 1 + 2**-10, by just more than rel_error of
    the value itself and just less than rel_error of the stored value."""
    stored, value = 1.0 + 2.0**-10, 1.0 + 2.0**-10 - 2.0**-12
    rel = 2.0**-12 / stored * (1 + 1e-9)
    return ("a value float16 rounds up, judged by its own size",
            torch.tensor([value, 1.0]), rel,
            "the error relative to the value itself, |stored - v| <= rel_error * "
            "|v|, not to the stored value (which float16 rounded up)")


FORMAT_CASES += [
    _long_case(), _strided_case(), _rounded_up_case(),
    ("a value far below any epsilon, 1e-15, beside 1", torch.tensor([1.0, 1e-15]),
     1e-2, "judge each value by its own size, however small: no epsilon added to "
     "|v| or to the tolerance (float16 stores 1e-15 as 0)"),
    ("bfloat16 values beyond float16's range",
     torch.tensor([3.0e5, -1.0, 0.5], dtype=torch.bfloat16), 1e-6,
     "the values may come in any float dtype, bfloat16 too: convert them with "
     "torch (values.double()), not numpy, which has no bfloat16"),
]


def check_cheapest_format(cheapest_format) -> None:
    ex = "8.4"
    require_solution(ex, cheapest_format)
    _guarded(ex, _formats_body, cheapest_format)
    passed(ex, "Range, underflow and precision each decided the format once.")


def _formats_body(cheapest_format) -> None:
    ex = "8.4"
    for what, values, rel, about in FORMAT_CASES:
        want = cheapest_format_reference(values, rel)
        given = values.clone()
        got = call_learner(ex, cheapest_format, given, rel, hints={
            "BFloat16": "numpy has no bfloat16: convert and compare with torch "
                        "(values.double())"})
        got = str(got).replace("torch.", "")
        if not torch.equal(given, values) or given.dtype != values.dtype:
            fail(ex, f"the values left as given ({what})", "they were changed",
                 "convert copies (values.to(...) returns a new tensor); never "
                 "write into values")
        if got == want:
            continue
        hints = {
            "float16": "float16's largest value is 65504 and its smallest "
                       "subnormal about 6e-8: check the range, not only the bits",
            "bfloat16": "bfloat16 has float32's range but only 8 bits of mantissa "
                        "(about 3 significant digits)",
            "float32": "a 16-bit format would do: try the cheap ones first",
        }
        hint = hints.get(got, "try float16, then bfloat16, then float32: convert "
                         "and compare with the original values")
        about = _confirmed_hint(ex, cheapest_format, values, rel, got) or about
        if (values == 0).any() and got == "float64":  # no format passed: zeros?
            about = ("a zero is stored exactly, with an error of 0: test "
                     "|stored - v| <= rel_error * |v| (true at 0), not < and not "
                     "a division by |v|")
        fail(ex, f"{want} for {what} (relative error {rel:g})", got, about or hint)
