"""Checkers for Chapter 0, "Setup and devices"."""

from __future__ import annotations

import copy

import torch
from torch import nn

from course_utils.devices import try_gpu
from course_utils.exercises import (
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
    "Cannot copy out of meta tensor": "leave the output on the device you were given "
    "(no .cpu(), .item() or .numpy() on it)",
}


def check_run_on(run_on) -> None:
    """Exercise 0.1: ``run_on(model, batch, device)`` moves both and runs the model.

    It is called first on the ``meta`` device, which holds shapes but no data,
    so a batch left behind on the CPU is caught on any machine; then on the
    best real device, where the values must match the CPU result.
    """
    ex = "0.1"
    torch.manual_seed(0)
    model, batch = (
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)),
        torch.randn(5, 8),
    )
    expected = model(batch).detach()
    out = call_learner(
        ex,
        run_on,
        copy.deepcopy(model),
        batch.clone(),
        torch.device("meta"),
        hints=HINTS,
    )
    check_type(ex, out, torch.Tensor, "run_on's return value")
    check_device(
        ex,
        out,
        "meta",
        "the output for device='meta'",
        hint="run the model on the device you are given and return its output",
    )
    check_shape(ex, out, expected.shape, "the output")
    device = try_gpu()
    out = call_learner(
        ex, run_on, copy.deepcopy(model), batch.clone(), device, hints=HINTS
    )
    check_device(ex, out, device, f"the output for device={device}")
    check_close(
        ex,
        out,
        expected,
        rtol=1e-4,
        atol=1e-5,
        what="the model's output",
        hint="return model(batch) itself, not a modified copy",
    )
    passed(ex, f"It ran on meta (shapes only) and on {device}.")


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(s.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def check_memory_held(memory_held) -> None:
    """Exercise 0.2: ``memory_held(tensors)`` = bytes of the storages they keep alive.

    Views share their base's storage; a slice keeps the whole storage alive;
    ``expand`` copies nothing; the element size depends on the dtype.
    """
    ex = "0.2"
    x = torch.zeros(1000)
    cases = [
        ("one float32 tensor of 1000 elements", [x]),
        ("a float64 tensor of 10 elements", [torch.zeros(10, dtype=torch.float64)]),
        (
            "int8 and bfloat16 tensors",
            [
                torch.zeros(100, dtype=torch.int8),
                torch.zeros(100, dtype=torch.bfloat16),
            ],
        ),
        ("a tensor and a view of it", [x, x.view(10, 100)]),
        ("every other element of a tensor (x[::2])", [x[::2]]),
        (
            "one element expanded to 1000 (expand copies nothing)",
            [torch.zeros(1).expand(1000)],
        ),
        ("an empty tensor", [torch.empty(0)]),
    ]
    for what, tensors in cases:
        seen = call_learner(ex, memory_held, list(tensors))
        check_type(ex, seen, (int, float, torch.Tensor), "memory_held's result")
        seen = int(seen)
        want = _storage_bytes(tensors)
        if seen == want:
            continue
        logical = sum(t.numel() * t.element_size() for t in tensors)
        undeduplicated = sum(t.untyped_storage().nbytes() for t in tensors)
        as_f32 = sum(t.numel() * 4 for t in tensors)
        hint = "count each storage once: t.untyped_storage().nbytes()"
        if seen == logical and len(tensors) > 1:
            hint = (
                "a view shares its base's storage: count each storage once "
                "(t.untyped_storage().data_ptr() identifies it)"
            )
        elif seen == logical:
            hint = (
                "a slice or an expanded tensor is a view: the memory held is its "
                "storage's, t.untyped_storage().nbytes(), not numel x element size"
            )
        elif seen == undeduplicated:
            hint = (
                "two tensors here share one storage: count it once "
                "(t.untyped_storage().data_ptr() identifies it)"
            )
        elif seen == as_f32:
            hint = "not every tensor is float32: use t.element_size()"
        fail(ex, f"{want} bytes for {what}", f"{seen} bytes", hint)
    passed(ex, "Views, slices, expand and dtypes all counted right.")
