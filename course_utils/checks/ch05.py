"""Checkers for Chapter 5 (DataParallel and its primitives).

5.1 compares the learner's scatter with ``torch.chunk`` semantics on uneven
batches, other dims and more devices than rows; 5.2 runs a hand-made
data-parallel step and compares loss and gradients with one device, on
uneven chunks where "mean of the chunk means" differs from the batch mean;
5.3 checks BatchNorm's running statistics after a DataParallel step: only
replica 0's survive.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from course_utils.exercises import call_learner, fail, passed, require_solution

# ---------------------------------------------------------------- exercise 5.1

SCATTER_CASES = [((30, 5), 4, 0), ((6, 3), 4, 0), ((7, 2), 3, 0), ((2, 11, 3), 3, 1),
                 ((5, 9), 2, -1), ((12,), 3, 0), ((1, 4), 3, 0)]


def check_scatter_batch(scatter_batch) -> None:
    ex = "5.1"
    require_solution(ex, scatter_batch)
    g = torch.Generator().manual_seed(5)
    for shape, n, dim in SCATTER_CASES:
        x = torch.randn(shape, generator=g)
        got = call_learner(ex, scatter_batch, x, n, dim)
        want = torch.chunk(x, n, dim)
        case = f"shape {tuple(shape)}, {n} devices, dim={dim}"
        if isinstance(got, torch.Tensor) or not hasattr(got, "__len__"):
            fail(ex, "a list of tensors, one per device used", f"{type(got).__name__}",
                 "return the pieces, e.g. as a list")
        sizes = [tuple(t.shape) for t in got]
        wsizes = [tuple(t.shape) for t in want]
        if sizes != wsizes:
            hint = ("DataParallel cuts pieces of ceil(rows / devices) rows, like "
                    "torch.chunk, so the last piece is smaller and a device can be "
                    "left idle; tensor_split and array_split balance instead")
            if len(sizes) == len(wsizes) and sorted(sizes) == sorted(wsizes):
                hint = "the pieces must be in the batch's order"
            fail(ex, f"pieces of shapes {wsizes} ({case})", str(sizes), hint)
        for a, b in zip(got, want, strict=True):
            if not torch.equal(a, b):
                fail(ex, f"the batch's rows in order ({case})",
                     "pieces with other values", "cut along `dim`, without "
                     "shuffling or copying values around")
    passed(ex, "Uneven batches, other dims, more devices than rows.")


# ---------------------------------------------------------------- exercise 5.2


class _Pause(nn.Module):
    """A layer that takes a while (a sleep: it lets other threads run), as a real
    layer does: replicas run in threads really overlap, so one module object
    shared by the threads shows its race on every run, however busy the machine."""

    def forward(self, x):
        time.sleep(0.02)
        return x


def _models(g):
    torch.manual_seed(int(torch.randint(0, 1000, (1,), generator=g)))
    yield nn.Sequential(nn.Linear(4, 8), _Pause(), nn.Tanh(), nn.Linear(8, 2))
    yield nn.Sequential(nn.Linear(4, 3), nn.ReLU(), _Pause(), nn.Linear(3, 2),
                        nn.Sigmoid())


STEP_CASES = [(10, 3), (7, 2), (12, 4), (5, 3)]  # batch, devices (uneven chunks)


def check_data_parallel_step(data_parallel_step) -> None:
    ex = "5.2"
    require_solution(ex, data_parallel_step)
    g = torch.Generator().manual_seed(3)
    for model in _models(g):
        for batch, n in STEP_CASES:
            x = torch.randn(batch, 4, generator=g)
            y = torch.randn(batch, 2, generator=g)
            ref = copy.deepcopy(model)
            ref_loss = nn.functional.mse_loss(ref(x), y)
            ref_loss.backward()
            mine = copy.deepcopy(model)
            mine.zero_grad(set_to_none=True)
            loss = call_learner(ex, data_parallel_step, mine, x, y, n)
            case = f"a batch of {batch} on {n} devices"
            if any(not p.is_leaf for p in mine.parameters()):
                fail(ex, f"the model's own parameters left in place ({case})",
                     "parameters replaced by copies",
                     "each replica needs its own module object: functional_call on "
                     "one module shared by several threads swaps tensors in and out "
                     "of it at the same time")
            if any(p.grad is None for p in mine.parameters()):
                fail(ex, f"gradients on the original model's parameters ({case})",
                     "no .grad on some of them",
                     "replicas must be differentiable copies of the parameters (a "
                     "clone, not a deepcopy or a detach), so that backward reaches "
                     "the original parameters and sums there")
            try:
                loss_value = float(loss.detach() if isinstance(loss, torch.Tensor)
                                   else loss)
            except (TypeError, ValueError):
                fail(ex, "the loss of the whole batch, a number or a 0-d tensor",
                     f"{type(loss).__name__}")
            ref_value = ref_loss.item()
            if abs(loss_value - ref_value) > 1e-5 * max(1, abs(ref_value)):
                fail(ex, f"the loss of the whole batch, {ref_value:.6f} ({case})",
                     f"{loss_value:.6f}",
                     "gather the outputs first, then one loss over "
                     "the whole batch: the mean of the chunks' means is not the batch "
                     "mean when the chunks are unequal")
            for (name, p), q in zip(mine.named_parameters(), ref.parameters(),
                                    strict=True):
                if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6):
                    ratio = (p.grad.norm() / q.grad.norm()).item()
                    fail(ex, f"the single-device gradient of {name} ({case})",
                         f"a gradient {ratio:.3g}x as large",
                         "one backward of the batch loss; each replica's share of the "
                         "gradient must flow back and add up on the original")
            for p, q in zip(mine.parameters(), model.parameters(), strict=True):
                if not torch.equal(p.detach(), q.detach()):
                    fail(ex, "the parameters unchanged (a step computes gradients)",
                         "changed parameters", "leave the optimizer step out")
    passed(ex, "Loss and gradients equal one device's, on unequal chunks.")


# ---------------------------------------------------------------- exercise 5.3

BN_CASES = [(10, 3, 0.1), (9, 2, 0.5), (6, 4, 0.1), (13, 3, 0.3)]


def check_dp_running_mean(dp_running_mean) -> None:
    ex = "5.3"
    require_solution(ex, dp_running_mean)
    g = torch.Generator().manual_seed(9)
    for batch, n, momentum in BN_CASES:
        bn = nn.BatchNorm1d(3, momentum=momentum)
        with torch.no_grad():
            bn.running_mean.copy_(torch.randn(3, generator=g))
        x = torch.randn(batch, 3, generator=g) * 2 + torch.arange(batch)[:, None] * 0.5
        start = bn.running_mean.clone()
        got = call_learner(ex, dp_running_mean, copy.deepcopy(bn), x, n)
        first = torch.chunk(x, n)[0]
        want = (1 - momentum) * start + momentum * first.mean(0)
        full = (1 - momentum) * start + momentum * x.mean(0)
        case = f"a batch of {batch} on {n} devices, momentum {momentum}"
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            fail(ex, "the running_mean tensor, of shape (3,)", f"{got!r:.60}")
        if torch.allclose(got, want, atol=1e-5):
            continue
        if torch.allclose(got, full, atol=1e-5):
            fail(ex, f"replica 0's update only ({case})",
                 "the full batch's statistics", "under DataParallel each replica "
                 "sees its own chunk, and only replica 0's buffers are kept")
        last = (1 - momentum) * start + momentum * torch.chunk(x, n)[-1].mean(0)
        if torch.allclose(got, last, atol=1e-5):
            fail(ex, f"replica 0's update ({case})", "the last chunk's",
                 "replica 0 gets the first chunk")
        if torch.allclose(got, start, atol=1e-6):
            fail(ex, f"replica 0's update ({case})", "the running mean unchanged",
                 "replica 0 runs in train mode on its chunk, so its statistics move")
        if torch.allclose(got, first.mean(0), atol=1e-5):
            fail(ex, f"replica 0's update ({case})", "the chunk's mean itself",
                 "a running mean moves by momentum towards the chunk's mean")
        pieces = torch.chunk(x, n)
        avg = torch.stack([(1 - momentum) * start + momentum * p.mean(0)
                           for p in pieces]).mean(0)
        if len(pieces) > 1 and torch.allclose(got, avg, atol=1e-5):
            fail(ex, f"replica 0's update ({case})", "the average of every replica's",
                 "DataParallel never averages buffers: the other replicas' "
                 "statistics are lost")
        seq = start.clone()
        for p in pieces:
            seq = (1 - momentum) * seq + momentum * p.mean(0)
        if len(pieces) > 1 and torch.allclose(got, seq, atol=1e-5):
            fail(ex, f"replica 0's update ({case})", "one module updated by every "
                 "chunk in turn", "each replica is a separate copy; only replica 0's "
                 "update is kept")
        fail(ex, f"{want.tolist()} ({case})", str(got.tolist()),
             "one BatchNorm update, with replica 0's chunk and the module's momentum")
    passed(ex, "Only replica 0's statistics survive a DataParallel step.")
