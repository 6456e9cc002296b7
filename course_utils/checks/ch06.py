"""Checkers for Chapter 6 (DistributedDataParallel).

6.1 and 6.3 run the learner's function in two real processes with
``course_utils.dist.launch`` (forked, so functions defined in the notebook
work); 6.2 needs no processes, since ``DistributedSampler`` takes the rank.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import call_learner, fail, passed

PLACEHOLDER = ("the placeholder `raise NotImplementedError`",
               "replace that line with your code and run the exercise cell again")


def _run(exercise: str, rank_fn: Callable, args: tuple,
         known: dict[str, tuple[str, str, str]]):
    """Launch ``rank_fn`` on 2 ranks; turn a failure into a friendly message.

    ``known`` maps a text in the failing rank's error to (expected, seen, hint).
    """
    if not callable(args[0]):
        fail(exercise, "a function", f"{type(args[0]).__name__} {args[0]!r:.60}",
             "run the exercise cell that defines it first")
    try:
        # gloo on CPU ranks on any machine; forked, so notebook functions work
        return [r.value for r in launch(rank_fn, 2, args=args, timeout=30,
                                        backend="gloo")]
    except RankFailed as e:
        first = str(e).splitlines()[0]
        if "NotImplementedError" in first:
            fail(exercise, "your solution in the exercise cell", *PLACEHOLDER)
        for key, (expected, seen, hint) in known.items():
            if key in first:
                fail(exercise, expected, f"{seen} ({first})", hint)
        fail(exercise, "every rank to finish", first, "read the rank's traceback above")
    except LaunchTimeout as e:
        fail(exercise, "every rank to finish", str(e).splitlines()[0],
             "every rank must call the same collectives, in the same order")


# ---------------------------------------------------------------- exercise 6.1

def _gradient_rank(rank: int, world_size: int, average_gradients: Callable):
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2))
    torch.manual_seed(100 + rank)  # different data on every rank
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    average_gradients(model)
    after = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return local, after


def _close(a: list, b: list) -> bool:
    return all(u is not None and torch.allclose(u, v, rtol=1e-5, atol=1e-7)
               for u, v in zip(a, b, strict=True))


def check_average_gradients(average_gradients: Callable) -> None:
    """Exercise 6.1: each .grad becomes the mean of that gradient over the ranks."""
    ex = "6.1"
    ranks = _run(ex, _gradient_rank, (average_gradients,),
                 {"AVG": ("an all_reduce this backend supports",
                          "ReduceOp.AVG refused",
                          "all_reduce with SUM, then divide by the world size")})
    (local0, after0), (local1, after1) = ranks
    mean = [(a + b) / 2 for a, b in zip(local0, local1, strict=True)]
    total = [a + b for a, b in zip(local0, local1, strict=True)]
    for rank, (local, after) in enumerate(ranks):
        if _close(after, mean):
            continue
        if _close(after, total):
            fail(ex, "the mean of the gradients over the ranks",
                 f"their sum on rank {rank} (world size 2): twice the mean",
                 "all_reduce sums: divide each gradient by dist.get_world_size()")
        if _close(after, local):
            fail(ex, "the mean of the gradients over the ranks",
                 f"rank {rank}'s own gradients, unchanged",
                 "all_reduce each p.grad in place (it overwrites its argument)")
        if any(g is None for g in after):
            fail(ex, "every parameter to keep a .grad", "a .grad set to None")
        fail(ex, "the mean of the gradients over the ranks",
             f"other gradients on rank {rank}",
             "sum them with dist.all_reduce, then divide by the world size")
    passed(ex, "Both ranks now hold the gradient of the full batch's mean loss.")


# ---------------------------------------------------------------- exercise 6.2

def _as_batches(exercise: str, value, epochs: int) -> list[list[list[int]]]:
    """The learner's result as epochs -> batches -> sample numbers."""
    if not isinstance(value, (list, tuple)) or len(value) != epochs:
        fail(exercise, f"a list with one entry per epoch ({epochs})",
             f"{type(value).__name__}: {value!r:.80}")
    out = []
    for epoch in value:
        batches = []
        for b in epoch:
            if isinstance(b, (list, tuple)) and len(b) == 1 and isinstance(
                    b[0], torch.Tensor):
                b = b[0]  # a TensorDataset batch, (samples,)
            if isinstance(b, torch.Tensor):
                b = b.flatten().tolist()
            batches.append([int(s) for s in b])
        out.append(batches)
    return out


def check_epoch_batches(epoch_batches: Callable) -> None:
    """Exercise 6.2: disjoint shares, shuffled, a new order each epoch."""
    ex = "6.2"
    n, world, epochs, batch_size = 20, 2, 3, 4
    data = TensorDataset(torch.arange(n))
    seen = [_as_batches(ex, call_learner(ex, epoch_batches, data, r, world, epochs,
                                         batch_size), epochs) for r in range(world)]
    for rank in range(world):
        for batch in (b for e in seen[rank] for b in e):
            if len(batch) > batch_size:
                fail(ex, f"batches of at most {batch_size} samples",
                     f"a batch of {len(batch)}", "pass batch_size to the DataLoader")
    for epoch in range(epochs):
        shares = [[s for b in seen[r][epoch] for s in b] for r in range(world)]
        if set(shares[0]) & set(shares[1]):
            fail(ex, "each rank to see a different share of every epoch",
                 f"ranks 0 and 1 both train on samples "
                 f"{sorted(set(shares[0]) & set(shares[1]))[:6]} in epoch {epoch}",
                 "use DistributedSampler(dataset, num_replicas=world_size, rank=rank)")
        if sorted(shares[0] + shares[1]) != list(range(n)):
            fail(ex, f"the ranks together to cover all {n} samples once per epoch",
                 f"{len(set(shares[0] + shares[1]))} different samples "
                 f"in epoch {epoch}")
    orders = [[s for b in e for s in b] for e in seen[0]]
    if orders[0] == sorted(orders[0]):
        fail(ex, "a shuffled order", f"rank 0 in order: {orders[0]}",
             "create the DistributedSampler with shuffle=True")
    if all(o == orders[0] for o in orders):
        fail(ex, "a different order in every epoch",
             f"the same order in all {epochs} epochs: {orders[0]}",
             "missing set_epoch: call sampler.set_epoch(epoch) at the start of each "
             "epoch, or every epoch shuffles the same way")
    again = _as_batches(ex, call_learner(ex, epoch_batches, data, 0, world, epochs,
                                         batch_size), epochs)
    if again != seen[0]:
        fail(ex, "the same batches when run again (a reproducible shuffle)",
             "different batches on a second run",
             "give the sampler a fixed seed, the same on every rank")
    passed(ex, "Disjoint shares, and a new shuffle every epoch.")


# ---------------------------------------------------------------- exercise 6.3

class _LoadedTooEarly(RuntimeError):
    pass


def _checkpoint_rank(rank: int, world_size: int, save_then_load: Callable,
                     path: str):
    events = []
    real_save, real_load, real_barrier = torch.save, torch.load, dist.barrier

    def slow_save(obj, f, *args, **kwargs):
        events.append("save")
        time.sleep(0.5)  # a big checkpoint takes a while to write
        return real_save(obj, f, *args, **kwargs)

    def watched_load(f, *args, **kwargs):
        if rank != 0 and "barrier" not in events:
            raise _LoadedTooEarly("rank 1 loaded the checkpoint before any barrier")
        events.append("load")
        events.append(("map_location", "map_location" in kwargs or len(args) >= 1))
        events.append(("weights_only", kwargs.get("weights_only", True)))
        return real_load(f, *args, **kwargs)

    def watched_barrier(*args, **kwargs):
        events.append("barrier")
        return real_barrier(*args, **kwargs)

    torch.manual_seed(rank)  # different weights on each rank
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    torch.save, torch.load, dist.barrier = slow_save, watched_load, watched_barrier
    try:
        save_then_load(model, rank, path)
    finally:
        torch.save, torch.load, dist.barrier = real_save, real_load, real_barrier
    return events, before, [p.detach().clone() for p in model.parameters()]


def check_save_then_load(save_then_load: Callable) -> None:
    """Exercise 6.3: rank 0 saves, a barrier, every rank loads onto its device."""
    ex = "6.3"
    barrier_hint = ("save on rank 0, then dist.barrier() on every rank, then load: "
                    "the barrier makes the readers wait for the writer")
    with tempfile.TemporaryDirectory(prefix="ch06_ckpt_") as tmp:
        path = str(Path(tmp) / "model.pt")
        ranks = _run(ex, _checkpoint_rank, (save_then_load, path),
                     {"_LoadedTooEarly": ("rank 1 to load after the barrier",
                                          "a checkpoint loaded before the barrier",
                                          barrier_hint),
                      "FileNotFoundError": ("rank 1 to load after rank 0 has saved",
                                            "rank 1 read the file before rank 0 had "
                                            "written it", barrier_hint)})
    (events0, before0, _), (events1, _, after1) = ranks
    if "save" in events1:
        fail(ex, "only rank 0 to save", "a checkpoint saved from every rank",
             "guard torch.save with `if rank == 0:`; ranks writing one file at once "
             "can corrupt it")
    if "save" not in events0:
        fail(ex, "rank 0 to save with torch.save", "no torch.save call on rank 0")
    if "barrier" in events0 and events0.index("barrier") < events0.index("save"):
        fail(ex, "rank 0 to reach the barrier after saving",
             "a barrier before the save on rank 0", barrier_hint)
    for rank, events in enumerate((events0, events1)):
        if "load" not in events:
            fail(ex, "every rank to load the checkpoint",
                 f"no torch.load on rank {rank}")
        if ("map_location", False) in events:
            fail(ex, "torch.load(..., map_location=device)",
                 "a load without map_location",
                 "without it, tensors saved from cuda:0 load onto cuda:0 on every rank")
        if ("weights_only", False) in events:
            fail(ex, "weights_only=True", "weights_only=False",
                 "a checkpoint holds only tensors; weights_only=True refuses to run "
                 "code hidden in a file")
    if not all(torch.equal(a, b) for a, b in zip(after1, before0, strict=True)):
        fail(ex, "rank 1's model to hold rank 0's saved weights afterwards",
             "other weights on rank 1", "load_state_dict the loaded state into model")
    passed(ex, "One writer, a barrier, and every rank loads onto its own device.")
