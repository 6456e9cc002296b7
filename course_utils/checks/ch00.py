"""Checkers for Chapter 0, "Setup and devices"."""

from __future__ import annotations

import threading
from collections import namedtuple

import torch
from torch import nn

from course_utils.devices import try_gpu
from course_utils.exercises import (
    answer_limit,
    call_learner,
    check_close,
    check_device,
    check_shape,
    check_type,
    fail,
    passed,
)


def _guarded(ex: str, fn, *args, hints=None):
    """``call_learner`` in a worker thread, so that a check never hangs."""
    out: dict = {}

    def target():
        try:
            out["value"] = call_learner(ex, fn, *args, hints=hints)
        except BaseException as e:  # re-raised below, in the checker's thread
            out["error"] = e

    limit = answer_limit(ex)
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        fail(ex, f"your code to return within {limit:.0f} s",
             "it was still running", "look for a loop that never ends")
    if "error" in out:
        raise out["error"]
    return out["value"]


# --- Exercise 0.1: move a nested batch -------------------------------------------

Point = namedtuple("Point", ["x", "y"])


def _path(path: str) -> str:
    return f"batch{path}" if path else "the batch itself"


def _batches(g: torch.Generator):
    """Nested batches of every kind a data loader yields, and a module."""
    first = {
        "image": torch.randn(2, 3, generator=g),
        "label": torch.arange(2),
        "extra": {"ids": [torch.tensor(1.5), torch.randn(3, dtype=torch.float64,
                                                           generator=g)],
                  "name": "cat", "n": 3, "scale": 0.5, "none": None},
        "pair": (torch.ones(2, 2, dtype=torch.float16),
                 torch.zeros(1, dtype=torch.bool)),
        "point": Point(torch.randn(4, generator=g)[1::2], 7),
    }
    second = [Point(torch.randn(3, 2, generator=g).t(), "word"),
              (torch.randint(0, 9, (5,), generator=g),),
              {"deep": [[torch.randn(1, generator=g)]], "empty": []}, 42]
    return [first, second, torch.randn(3, generator=g), "just text"]


def _snapshot(obj):
    """A deep copy of every tensor, to prove later that none was changed."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_snapshot(v) for v in obj]
    return obj


def _unchanged(ex: str, obj, snap, path: str = "") -> None:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or not torch.equal(obj, snap):
            fail(ex, f"the caller's {_path(path)} unchanged (on the CPU, same values)",
                 f"it is now on {obj.device}" if obj.device.type != "cpu" else
                 "its values changed", "tensor.to(device) returns a NEW tensor: "
                 "build a new batch from the moved tensors, do not write into the "
                 "old one (no .data = ..., no copy_ into it)")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _unchanged(ex, v, snap[k], f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, (v, sv) in enumerate(zip(obj, snap, strict=True)):
            _unchanged(ex, v, sv, f"{path}[{i}]")


def _same_place(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and device.index in (None, t.device.index)


def _compare(ex: str, got, src, device: torch.device, path: str = "") -> None:
    """``got`` must be ``src`` with every tensor moved to ``device``."""
    where = _path(path)
    if isinstance(src, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            fail(ex, f"{where} a tensor on {device}", f"a {type(got).__name__}: "
                 f"{got!r:.60}", "move each tensor with .to(device) and keep it a "
                 "tensor")
        if not _same_place(got, device):
            if path.count("[") > 1:
                hint = ("every tensor, however deep in the batch, goes to the "
                        "device: walk into dicts, lists and tuples (recursion)")
            elif not src.is_floating_point():
                hint = (f"integer and bool tensors (labels, masks) move too: this "
                        f"one is {src.dtype}")
            else:
                hint = "move each tensor with .to(device), to the device you are given"
            fail(ex, f"{where} on {device}", f"on {got.device}", hint)
        if got.dtype != src.dtype:
            fail(ex, f"{where} still {src.dtype}", f"{got.dtype}",
                 "move with .to(device) only: a dtype (or .float()) changes the "
                 "data, and labels must stay integers")
        if tuple(got.shape) != tuple(src.shape):
            fail(ex, f"{where} of shape {tuple(src.shape)}", f"{tuple(got.shape)}")
        if device.type != "meta" and not torch.equal(got.cpu(), src):
            fail(ex, f"{where} with the same values", "other values",
                 "move the tensor; do not change it")
        return
    if isinstance(src, str):
        if got is not src and got != src:
            fail(ex, f"{where} the string {src!r}, untouched", f"{got!r:.60}",
                 "a string is a sequence too: leave strings (and anything that is "
                 "not a tensor or a container) as they are")
        return
    if isinstance(src, (dict, list, tuple)):
        if type(got) is not type(src):
            fail(ex, f"{where} a {type(src).__name__}, as given",
                 f"a {type(got).__name__}",
                 "rebuild each container with its own type: type(x)(...), and "
                 "type(x)(*items) for a namedtuple")
        if isinstance(src, dict):
            if list(got) != list(src):
                fail(ex, f"{where} with the keys {list(src)}", f"keys {list(got)}",
                     "keep every key, in order")
            for k in src:
                _compare(ex, got[k], src[k], device, f"{path}[{k!r}]")
            return
        if len(got) != len(src):
            fail(ex, f"{where} of length {len(src)}", f"length {len(got)}")
        for i, (g, v) in enumerate(zip(got, src, strict=True)):
            _compare(ex, g, v, device, f"{path}[{i}]")
        return
    if type(got) is not type(src) or (got is not src and got != src):
        fail(ex, f"{where} = {src!r} ({type(src).__name__}), untouched",
             f"a {type(got).__name__}: {got!r:.60}",
             "leave what is not a tensor (numbers, strings, None) as it is: do "
             "not turn it into a tensor")


def check_move_batch(move_batch) -> None:
    """Exercise 0.1: ``move_batch(batch, device)`` moves a nested batch.

    Batches of dicts, lists, tuples and namedtuples holding tensors of several
    dtypes (float16/32/64, int64, bool; views among them) and plain values
    (strings, numbers, None) must come back with the same structure and
    types, every tensor on the device with its dtype and values, and plain
    values untouched; the caller's batch must not change. A module is moved
    in place and returned. Checked on ``meta`` (so a tensor left on the CPU
    is caught on any machine) and on the best device here, twice over.
    """
    ex = "0.1"
    g = torch.Generator().manual_seed(0)
    devices = [torch.device("meta"), try_gpu()]
    for batch in _batches(g):  # each batch goes to every device: nothing cached
        for device in devices:
            snap = _snapshot(batch)
            got = _guarded(ex, move_batch, batch, device, hints=HINTS)
            _unchanged(ex, batch, snap)
            _compare(ex, got, batch, device)
    for device in devices:
        model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
        got = _guarded(ex, move_batch, model, device, hints=HINTS)
        if got is not model:
            fail(ex, "the same module, moved in place (module.to returns itself)",
                 f"a {type(got).__name__} that is not the module given",
                 "module.to(device) moves a module in place and returns it: "
                 "return that, not a copy")
        _check_model_moved(ex, model, device)
    passed(ex, f"Nested batches and a module moved to meta and {devices[-1]}; "
               "structure, dtypes and plain values kept.")


HINTS = {
    "Expected all tensors to be on the same device": "move every tensor",
    "not compiled with CUDA": "use the device you are given instead of a hard-coded "
    "'cuda': it is not always a GPU",
    "when none is available": "use the device you are given instead of a "
    "hard-coded 'cuda': it is not always a GPU",
    "Found no NVIDIA driver": "use the device you are given instead of a "
    "hard-coded 'cuda': it is not always a GPU",  # a CUDA build without a GPU
    "Cannot copy out of meta tensor": "leave the moved tensors on the device you "
    "were given (no .cpu(), .item() or .numpy() on them)",
    "maximum recursion depth": "a one-character string contains itself: do not "
    "walk into strings",
    "__new__() missing": "a namedtuple takes its fields as separate arguments: "
    "type(x)(*items), not type(x)(generator)",
}


def _where(model: nn.Module) -> set[torch.device]:
    return {t.device for t in list(model.parameters()) + list(model.buffers())}


def _check_model_moved(ex: str, model: nn.Module, device: torch.device) -> None:
    """The module the learner was given must be on ``device`` afterwards."""
    seen = _where(model)
    if all(_same_place(t, device) for t in
           list(model.parameters()) + list(model.buffers())):
        return
    params = {p.device for p in model.parameters()}
    if all(d.type == device.type for d in params):
        hint = ("the parameters moved but the buffers (BatchNorm's running "
                "statistics) did not: move the module itself with "
                "module.to(device), which moves both")
    else:
        hint = ("the module you were given is still where it was: move it with "
                "module.to(device)")
    fail(ex, f"the module's parameters and buffers on {device} afterwards",
         f"on {', '.join(sorted(map(str, seen)))}", hint)


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
        ("an empty slice of a tensor (x[10:10]: no elements, the whole storage)",
         [x[10:10]]),
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
        if float(seen) != int(seen):
            fail(ex, "a whole number of bytes", f"{float(seen):.6g}",
                 "count bytes, not kilobytes or megabytes: storage.nbytes() "
                 "is an integer")
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
    if any(t.numel() == 0 and nbytes(t) for t in tensors) and seen == sum(
            {t.untyped_storage().data_ptr(): nbytes(t) for t in tensors
             if t.numel()}.values()):
        return ("a view with no elements still keeps its base's whole storage "
                "alive: count its storage like any other")
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
    "Found no NVIDIA driver": "use x's device, not a hard-coded 'cuda'",
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
        if out.dtype != x.dtype:
            fail(ex, f"the output {where} with x's dtype, {x.dtype}",
                 f"{out.dtype}", "x + ramp takes the wider of the two dtypes: "
                 "make the ramp with the default dtype (or x's), or keep it in "
                 "a buffer, which model.to(dtype) converts")
        if x.device.type != "meta" and not torch.equal(x, given):
            fail(ex, "the input x unchanged", "forward changed x in place",
                 "return x + ramp, a new tensor; x += ... writes into the "
                 "caller's tensor")
        return out

    for n, shape in ((5, (3, 5)), (7, (2, 4, 7)), (1, (4, 1)), (6, (6, 6)), (4, (4,))):
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
    m = build(6)  # one module, used, then moved: nothing may stay behind
    for to in (torch.float32, torch.float64, "meta"):
        m = m.to(to)
        dtype = torch.float64 if to == "meta" else to
        x = torch.randn(2, 6, generator=g, dtype=dtype).to(
            "meta" if to == "meta" else "cpu")
        out = run(m, x, f"after a first call, then model.to({to!r})")
        if out.device.type == "meta" or x.device.type == "meta":
            check_device(ex, out, "meta", "the output for a meta x after a first "
                         "call, then model.to('meta')", hint="a ramp made in the "
                         "first forward and kept as a plain attribute stays where "
                         "it was made: keep it in a buffer")
        else:
            check_close(ex, out, _ramp(6, x), rtol=1e-5, atol=1e-6,
                        what=f"the output after a first call, then model.to({to})")
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
