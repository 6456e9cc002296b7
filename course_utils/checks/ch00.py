"""Checkers for Chapter 0, "Setup and devices"."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from course_utils.devices import try_gpu
from course_utils.exercises import (
    ExerciseFailed,
    call_learner,
    check_close,
    check_device,
    check_shape,
    check_type,
    fail,
    passed,
)

MOVE_BOTH = (
    "move the model AND the batch; tensor.to(device) returns a NEW tensor, "
    "so assign it: batch = batch.to(device)"
)
HINTS = {
    "not on the expected device": MOVE_BOTH,
    "Expected all tensors to be on the same device": MOVE_BOTH,
    "not compiled with CUDA": "use the device you are given instead of a hard-coded "
    "'cuda': it is not always a GPU",
    "when none is available": "use the device you are given instead of a "
    "hard-coded 'cuda': it is not always a GPU",
    "Cannot copy out of meta tensor": "leave the output on the device you were given "
    "(no .cpu(), .item() or .numpy() on it)",
}


TIMEOUT_S = 20.0


def _guarded(ex: str, fn, *args, hints=None):
    """``call_learner`` in a worker thread, so that a check never hangs."""
    out: dict = {}

    def target():
        try:
            out["value"] = call_learner(ex, fn, *args, hints=hints)
        except BaseException as e:  # re-raised below, in the checker's thread
            out["error"] = e

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    if worker.is_alive():
        fail(ex, f"your code to return within {TIMEOUT_S:.0f} s",
             "it was still running", "look for a loop that never ends")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _model_and_batch(seed: int, n_in: int, rows: int,
                     dtype: torch.dtype = torch.float32):
    """A small model with a buffer (BatchNorm's running statistics) and a batch."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(n_in, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        model[1].running_mean.copy_(torch.randn(16, generator=g))
        model[1].running_var.copy_(torch.rand(16, generator=g) + 0.5)
    model.eval()  # the buffers are used, not updated
    return model.to(dtype), torch.randn(rows, n_in, generator=g, dtype=dtype)


def _where(model: nn.Module) -> set[torch.device]:
    return {t.device for t in list(model.parameters()) + list(model.buffers())}


def _check_model_moved(ex: str, model: nn.Module, device: torch.device) -> None:
    """The model the learner was given must be on ``device`` afterwards."""
    seen = _where(model)
    moved = all(d.type == device.type and device.index in (None, d.index)
                for d in seen)
    if moved:
        return
    params = {p.device for p in model.parameters()}
    if all(d.type == device.type for d in params):
        hint = ("the parameters moved but the buffers (BatchNorm's running "
                "statistics) did not: move the module itself with "
                "model.to(device), which moves both")
    else:
        hint = ("the model you were given is still where it was: move it with "
                "model.to(device) (computing on the CPU and moving only the "
                "output, or moving a copy, leaves the model behind)")
    fail(ex, f"the model's parameters and buffers on {device} afterwards",
         f"on {', '.join(sorted(map(str, seen)))}", hint)


def _call_run_on(ex, run_on, model, batch, device):
    """Call the learner; a device error with only the buffers behind says so."""
    try:
        return _guarded(ex, run_on, model, batch, device, hints=HINTS)
    except ExerciseFailed:
        params = {p.device.type for p in model.parameters()}
        buffers = {b.device.type for b in model.buffers()}
        if params == {device.type} and buffers != {device.type}:
            _check_model_moved(ex, model, device)  # names the buffers left behind
        raise


def check_run_on(run_on) -> None:
    """Exercise 0.1: ``run_on(model, batch, device)`` moves both and runs the model.

    It is called first on the ``meta`` device, which holds shapes but no data,
    so a batch left behind on the CPU is caught on any machine; then on the
    best real device, where the values must match the CPU result. Each time
    the model it was given must be on the device afterwards (a model with a
    buffer, so moving only the parameters is caught too).
    """
    ex = "0.1"
    for seed, n_in, rows, dtype in ((0, 8, 5, torch.float32), (1, 5, 7, torch.float32),
                                    (2, 6, 3, torch.float64)):
        model, batch = _model_and_batch(seed, n_in, rows, dtype)
        with torch.no_grad():
            expected = model(batch)
        meta = torch.device("meta")
        given = copy.deepcopy(model)
        out = _call_run_on(ex, run_on, given, batch.clone(), meta)
        check_type(ex, out, torch.Tensor, "run_on's return value")
        check_device(ex, out, "meta", "the output for device='meta'",
                     hint="run the model on the device you are given and return "
                          "its output")
        check_shape(ex, out, expected.shape, "the output")
        _check_model_moved(ex, given, meta)
        device = try_gpu()
        given = copy.deepcopy(model)
        batch_given = batch.clone()
        out = _call_run_on(ex, run_on, given, batch_given, device)
        check_type(ex, out, torch.Tensor, "run_on's return value")
        check_device(ex, out, device, f"the output for device={device}",
                     hint="leave the output on the device you were given")
        _check_model_moved(ex, given, device)
        if not torch.equal(batch_given, batch):
            fail(ex, "the caller's batch unchanged", "run_on changed it in place",
                 "batch.to(device) gives a moved copy; do not write into the batch")
        if out.dtype != expected.dtype:
            fail(ex, f"a {expected.dtype} output for a {dtype} model and batch",
                 f"{out.dtype}", "move with .to(device) only: .float() or a "
                 "dtype in .to() changes the numbers' precision")
        check_close(ex, out, expected, rtol=1e-4, atol=1e-5,
                    what="the model's output",
                    hint="return model(batch) itself, not a modified copy")
        # called again with the model already there and a new batch: nothing
        # may be kept from the first call
        again = batch.flip(0) * 0.5
        with torch.no_grad():
            expected = model(again)
        out = _call_run_on(ex, run_on, given, again.clone(), device)
        check_close(ex, out, expected, rtol=1e-4, atol=1e-5,
                    what="the output of a second call with another batch",
                    hint="compute the output afresh on every call")
    passed(ex, f"It ran on meta (shapes only) and on {device}, and moved the model.")


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(s.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def _memory_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    y = torch.randn(1000, generator=g)
    m = torch.randn(30, 40, generator=g)
    return [
        ("one float32 tensor of 1000 elements", [x]),
        ("a float64 tensor of 10 elements",
         [torch.randn(10, dtype=torch.float64, generator=g)]),
        ("int8 and bfloat16 tensors",
         [torch.arange(100, dtype=torch.int8), torch.ones(100, dtype=torch.bfloat16)]),
        ("a tensor and a view of it", [x, x.view(10, 100)]),
        ("a tensor and a slice of it that starts at element 10 (an offset)",
         [x, x[10:]]),
        ("two slices of one tensor, at offsets 0 and 500, without the tensor",
         [x[:500], x[500:]]),
        ("every other element of a tensor (x[::2])", [x[::2]]),
        ("a column of a matrix and its transpose (m[:, 3], m.T)", [m[:, 3], m.T]),
        ("two different tensors of the same size", [x, y]),
        ("the same tensor twice in the list", [y, y]),
        ("one element expanded to 1000 (expand copies nothing)",
         [torch.ones(1).expand(1000)]),
        ("a tensor seen as int32 through .view(torch.int32)",
         [m, m.view(torch.int32)]),
        ("an empty tensor", [torch.empty(0)]),
    ]


def check_memory_held(memory_held) -> None:
    """Exercise 0.2: ``memory_held(tensors)`` = bytes of the storages they keep alive.

    Views share their base's storage, also when they start at an offset; a
    slice keeps the whole storage alive; ``expand`` copies nothing; distinct
    tensors of equal size are distinct storages; the element size depends on
    the dtype.
    """
    ex = "0.2"
    for what, tensors in _memory_cases():
        seen = _guarded(ex, memory_held, list(tensors))
        check_type(ex, seen, (int, float, torch.Tensor), "memory_held's result")
        if isinstance(seen, torch.Tensor) and seen.numel() != 1:
            fail(ex, "one number of bytes", f"a tensor of shape {tuple(seen.shape)}")
        seen = int(seen)
        want = _storage_bytes(tensors)
        if seen == want:
            continue
        fail(ex, f"{want} bytes for {what}", f"{seen} bytes",
             _memory_hint(tensors, seen))
    passed(ex, "Views (with offsets), slices, expand, distinct equal tensors and "
               "dtypes all counted right.")


def _memory_hint(tensors, seen: int) -> str:
    """Name the mistake that gives ``seen`` for these tensors, if it is a known one."""
    def nbytes(t):
        return t.untyped_storage().nbytes()

    logical = sum(t.numel() * t.element_size() for t in tensors)
    undeduplicated = sum(nbytes(t) for t in tensors)
    by_tensor_ptr = sum({t.data_ptr(): nbytes(t) for t in tensors}.values())
    by_size = sum({nbytes(t) for t in tensors})
    as_f32 = sum(t.numel() * 4 for t in tensors)
    if seen == as_f32 and seen != logical:
        return "not every tensor is float32: use t.element_size() or the storage"
    if seen == by_tensor_ptr:
        return ("t.data_ptr() is where the tensor's first element is, so a view "
                "that starts at an offset gets another address: identify the "
                "storage with t.untyped_storage().data_ptr()")
    if seen == logical and seen != undeduplicated:
        return ("a slice or an expanded tensor is a view: the memory held is its "
                "storage's, t.untyped_storage().nbytes(), not numel x element size")
    if seen in (logical, undeduplicated):
        return ("a view shares its base's storage: count each storage once "
                "(t.untyped_storage().data_ptr() identifies it)")
    if seen == by_size:
        return ("two different tensors of the same size are two storages: "
                "identify storages by their address, not by their size")
    if len(tensors) > 1 and seen == nbytes(tensors[0]):
        return "add up the storages of every tensor in the list, not only the first"
    return "count each storage once: t.untyped_storage().nbytes()"


RAMP_HINTS = {
    "not on the expected device": (
        "the ramp stayed on the CPU: a tensor kept as a plain attribute is not "
        "moved by model.to(); register it with self.register_buffer(...), or "
        "make it in forward on x's device"),
    "Expected all tensors to be on the same device": (
        "the ramp stayed on the CPU: register it as a buffer, or make it in "
        "forward on x's device"),
    "not compiled with CUDA": "use x's device, not a hard-coded 'cuda'",
    "when none is available": "use x's device, not a hard-coded 'cuda'",
    "Cannot copy out of meta tensor": "leave the output where x is (no .cpu(), "
    ".item() or .tolist() in forward)",
}


def _ramp(n: int, x: torch.Tensor) -> torch.Tensor:
    return x + torch.arange(n, dtype=torch.float64).div(n).to(x.dtype)


def check_add_ramp(AddRamp) -> None:
    """Exercise 0.3: ``AddRamp(n)`` adds r[j] = j / n along the last dimension.

    The module is moved and converted the way users do (``.to("meta")``,
    ``.to(torch.float16)``, ``.to(torch.float64)``, the best device) and must
    then give outputs on x's device, with x's dtype; the ramp must not be a
    trainable parameter, and the input must not change.
    """
    ex = "0.3"
    g = torch.Generator().manual_seed(3)

    def build(n):
        m = _guarded(ex, AddRamp, n, hints=RAMP_HINTS)
        check_type(ex, m, nn.Module, f"AddRamp({n})")
        return m

    def run(m, x, where):
        given = x.clone()
        out = _guarded(ex, m, x, hints=RAMP_HINTS)
        check_type(ex, out, torch.Tensor, f"the output {where}")
        check_shape(ex, out, x.shape, f"the output {where}")
        if x.device.type != "meta" and not torch.equal(x, given):
            fail(ex, "the input x unchanged", "forward changed x in place",
                 "return x + ramp, a new tensor; x += ... writes into the "
                 "caller's tensor")
        return out

    for n, shape in ((5, (3, 5)), (7, (2, 4, 7)), (1, (4, 1)), (6, (6, 6))):
        m = build(n)
        trained = [name for name, p in m.named_parameters() if p.requires_grad]
        if trained:
            fail(ex, "no trainable parameter: the ramp is fixed",
                 f"parameters {trained}",
                 "an nn.Parameter is trained by the optimizer; keep a fixed "
                 "tensor in a buffer: self.register_buffer('ramp', ...)")
        x = torch.randn(shape, generator=g)
        out = run(m, x, f"for x of shape {shape}")
        check_close(ex, out, _ramp(n, x), rtol=1e-5, atol=1e-6,
                    what=f"AddRamp({n})(x) for x of shape {shape}",
                    hint=_ramp_value_hint(out - x, n))
    for dtype in (torch.float32, torch.float16):
        m = build(9).to("meta", dtype)
        x = torch.empty(4, 9, device="meta", dtype=dtype)
        out = run(m, x, f"on the meta device ({dtype})")
        check_device(ex, out, "meta", "the output for a meta x after model.to('meta')",
                     hint="make the ramp on x's device, or keep it in a buffer")
        if out.dtype != dtype:
            fail(ex, f"a {dtype} output on meta", f"{out.dtype}",
                 "make the ramp with x's dtype, or keep it in a buffer")
    for dtype, atol in ((torch.float16, 2e-3), (torch.float64, 1e-6)):
        m = build(6).to(dtype)
        x = torch.randn(3, 6, generator=g).to(dtype)
        out = run(m, x, f"for {dtype} input")
        if out.dtype != dtype:
            fail(ex, f"a {dtype} output after model.to({dtype}) for a {dtype} x",
                 f"{out.dtype}",
                 "make the ramp with x's dtype (torch.arange(..., dtype=x.dtype), "
                 "x.new_tensor(...)), or keep it in a buffer, which model.to() "
                 "converts")
        check_close(ex, out, _ramp(6, x), rtol=1e-3, atol=atol,
                    what=f"the output for {dtype}")
    device = try_gpu()
    m = build(8).to(device)
    x = torch.randn(5, 8, generator=g).to(device)
    out = run(m, x, f"on {device}")
    check_device(ex, out, device, f"the output on {device}",
                 hint="make the ramp on x's device, or keep it in a buffer")
    check_close(ex, out, _ramp(8, x), rtol=1e-5, atol=1e-6,
                what=f"the output on {device}")
    passed(ex, f"It followed model.to() to meta, float16, float64 and {device}.")


def _ramp_value_hint(added: torch.Tensor, n: int) -> str:
    """Name the ramp the learner added, when it is a known wrong one."""
    flat = added.detach().double().reshape(-1, added.shape[-1])[0]
    j = torch.arange(added.shape[-1], dtype=torch.float64)
    if n > 1 and torch.allclose(flat, j / (n - 1), atol=1e-5):
        return "r[j] = j / n: the last is (n - 1) / n, not 1 (linspace(0, 1, n))"
    if torch.allclose(flat, j, atol=1e-5):
        return "divide by n: r[j] = j / n"
    if torch.allclose(flat, (j + 1) / n, atol=1e-5):
        return "j counts from 0: r[0] = 0"
    if added.dim() > 1 and not torch.allclose(
            added.detach().double(), flat.expand_as(added), atol=1e-5):
        return "the ramp runs along the LAST dimension: the same for every row"
    return "r[j] = j / n for j = 0 .. n - 1, along the last dimension of x"
