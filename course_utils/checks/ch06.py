"""Checkers for Chapter 6 (DistributedDataParallel).

6.1 and 6.3 run the learner's function in real processes with
``course_utils.dist.launch`` (forked, so functions defined in the notebook
work), at world sizes 2 and 3; 6.2 needs no processes, since
``DistributedSampler`` takes the rank. Each is judged by what the function
does - the gradients it leaves, the batches it returns, the weights every
rank ends with - not by which functions it calls.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import call_learner, fail, passed, require_solution

TIMEOUT_S = 30  # a rank that waits longer waits for a collective nobody else calls
LATE_S = 0.4  # at most how late one rank arrives in 6.3


def _run(exercise: str, rank_fn: Callable, world_size: int, args: tuple,
         known: dict[str, tuple[str, str, str]]):
    """Launch ``rank_fn`` on ``world_size`` ranks; a failure becomes a message.

    ``known`` maps a text in the failing rank's error to (expected, seen, hint).
    """
    try:
        # gloo on CPU ranks on any machine; forked, so notebook functions work
        return [r.value for r in launch(rank_fn, world_size, args=args,
                                        timeout=TIMEOUT_S, backend="gloo")]
    except RankFailed as e:
        first = str(e).splitlines()[0]
        # gloo's words when the other side went away ("Connection closed by
        # peer", or "Read error ... Connection reset by peer", by timing)
        unmatched = ("every rank to call the same collectives",
                     "a rank waited in a collective that another rank never called",
                     "every rank must call the same collectives, in the same order")
        known = {**known, "closed by peer": unmatched, "reset by peer": unmatched}
        for key, (expected, seen, hint) in known.items():
            if key in first:
                fail(exercise, expected, f"{seen} ({first[:160]})", hint)
        fail(exercise, "every rank to finish", first[:200],
             "read the rank's traceback above")
    except LaunchTimeout as e:
        fail(exercise, "every rank to finish", str(e).splitlines()[0],
             "every rank must call the same collectives, in the same order")


# ---------------------------------------------------------------- exercise 6.1

def _model() -> torch.nn.Module:
    """Parameters of odd shapes, and one frozen (its .grad stays None)."""
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 2), torch.nn.Tanh(),
                                torch.nn.Linear(2, 3))
    model[2].bias.requires_grad_(False)
    return model


def _gradient_rank(rank: int, world_size: int, average_gradients: Callable):
    model = _model()
    torch.manual_seed(100 + rank)  # different data on every rank
    x, y = torch.randn(7, 3), torch.randn(7, 3) * (rank + 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    average_gradients(model)
    after = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return local, after


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(
        a, b, rtol=1e-5, atol=1e-7)


def _judge_gradients(ex: str, ranks: list, world_size: int) -> None:
    names = [n for n, _ in _model().named_parameters()]
    locals_ = [r[0] for r in ranks]
    total = [None if g is None else sum(loc[i] for loc in locals_)
             for i, g in enumerate(locals_[0])]
    for rank, (local, after) in enumerate(ranks):
        for i, name in enumerate(names):
            got, mine, tot = after[i], local[i], total[i]
            if tot is None:  # the frozen parameter
                if got is not None:
                    fail(ex, f"parameter {name} (frozen, no gradient) to keep "
                         ".grad None", f"a .grad on rank {rank}",
                         "skip parameters whose .grad is None")
                continue
            mean = tot / world_size
            if _same(got, mean):
                continue
            where = f"parameter {name} {tuple(mean.shape)} on rank {rank}"
            if got is None:
                fail(ex, f"{where}: the mean gradient", ".grad set to None")
            if _same(got, tot):
                fail(ex, f"{where}: the mean over the {world_size} ranks",
                     f"their sum, {world_size} x the mean",
                     "all_reduce sums: divide by dist.get_world_size()")
            for k in range(1, 5):
                if k != world_size and _same(got, tot / k):
                    fail(ex, f"{where}: the sum divided by the world size, "
                         f"{world_size}", f"the sum divided by {k}",
                         "divide by dist.get_world_size(), not a fixed number")
            if _same(got, mine):
                fail(ex, f"{where}: the mean over the ranks",
                     "this rank's own gradient, unchanged",
                     "all_reduce p.grad itself (it overwrites its argument), not "
                     "a copy; and every parameter, not only some")
            fail(ex, f"{where}: the mean over the ranks",
                 "other values (not the mean, the sum or the rank's own)",
                 "dist.all_reduce(p.grad) sums across ranks; then divide by "
                 "dist.get_world_size()")


def check_average_gradients(average_gradients: Callable) -> None:
    """Exercise 6.1: each .grad becomes the mean of that gradient over the ranks."""
    ex = "6.1"
    require_solution(ex, average_gradients)
    none_hint = "a frozen parameter has no gradient: skip it when p.grad is None"
    known = {"NoneType": ("every parameter with a gradient averaged",
                          "an operation on a .grad that is None", none_hint),
             "of type torch.Tensor": ("a tensor for every collective",
                                      "something else, such as a .grad that is None",
                                      none_hint)}
    for world_size in (2, 3):
        ranks = _run(ex, _gradient_rank, world_size, (average_gradients,), known)
        _judge_gradients(ex, ranks, world_size)
    passed(ex, "On 2 and 3 ranks, every rank now holds the gradient of the whole "
               "batch's mean loss.")


# ---------------------------------------------------------------- exercise 6.2

def _as_batches(ex: str, value, epochs: int, rank: int) -> list[list[list[int]]]:
    """The learner's result as epochs -> batches -> sample numbers."""
    if not isinstance(value, (list, tuple)) or len(value) != epochs:
        fail(ex, f"a list with one entry per epoch ({epochs})",
             f"{type(value).__name__}: {value!r:.80} (rank {rank})")
    out = []
    for epoch in value:
        batches = []
        for b in epoch:
            if isinstance(b, (list, tuple)) and len(b) == 1 and isinstance(
                    b[0], torch.Tensor):
                b = b[0]  # a TensorDataset batch, (samples,)
            if isinstance(b, torch.Tensor):
                b = b.flatten().tolist()
            try:
                batches.append([int(s) for s in b])
            except (TypeError, ValueError):
                fail(ex, "each batch as the list of its sample numbers",
                     f"{type(b).__name__}: {b!r:.60}")
        out.append(batches)
    return out


# (data set size, world size, epochs, batch size): odd sizes, and one that
# does not divide by the world size (DistributedSampler pads by repeating)
_SAMPLER_CASES = [(23, 2, 3, 4), (31, 3, 3, 5)]


def _judge_epochs(ex: str, seen: list, n: int, world: int, batch_size: int) -> None:
    per_rank = math.ceil(n / world)
    epochs = len(seen[0])
    setting = f"{n} samples, {world} ranks, batch size {batch_size}"
    for rank in range(world):
        for e, batches in enumerate(seen[rank]):
            sizes = [len(b) for b in batches]
            if any(s != batch_size for s in sizes[:-1]) or (
                    sizes and sizes[-1] > batch_size):
                fail(ex, f"batches of {batch_size} samples (the last may be "
                     f"smaller) ({setting})",
                     f"batch sizes {sizes} on rank {rank} in epoch {e}",
                     "pass batch_size to the DataLoader, and keep drop_last=False")
            count = sum(sizes)
            if count == n and world > 1:
                fail(ex, f"each rank to train on its share: {per_rank} of the {n} "
                     f"samples ({setting})",
                     f"all {n} samples on rank {rank}: every rank trains on the "
                     "whole data set", "give the DataLoader a DistributedSampler "
                     "with num_replicas=world_size and rank=rank")
            if count != per_rank:
                fail(ex, f"{per_rank} samples per rank and epoch ({setting}: the "
                     "sampler pads so that every rank gets as many)",
                     f"{count} on rank {rank} in epoch {e}",
                     "keep the sampler's defaults (drop_last=False)")
    for e in range(epochs):
        shares = [[s for b in seen[r][e] for s in b] for r in range(world)]
        every = [s for share in shares for s in share]
        if set(every) != set(range(n)):
            fail(ex, f"the ranks together to cover all {n} samples in every epoch "
                 f"({setting})", f"{len(set(every))} different samples in epoch {e}",
                 "every rank must use the same seed, its own rank, and "
                 "num_replicas=world_size")
        repeats = len(every) - n  # the sampler's padding
        overlap = [(a, b) for a in range(world) for b in range(a + 1, world)
                   if len(set(shares[a]) & set(shares[b])) > repeats]
        if overlap:
            a, b = overlap[0]
            fail(ex, f"disjoint shares, apart from {repeats} padding samples "
                 f"({setting})", f"ranks {a} and {b} share "
                 f"{len(set(shares[a]) & set(shares[b]))} samples in epoch {e}",
                 "each rank passes its own rank to the sampler, and all the same "
                 "seed")
    orders = [[[s for b in seen[r][e] for s in b] for e in range(epochs)]
              for r in range(world)]
    for e in range(1, epochs):
        if all(orders[r][e] == orders[r][e - 1] for r in range(world)):
            fail(ex, f"a new shuffle every epoch ({setting})",
                 f"epochs {e - 1} and {e} in the same order on every rank",
                 "call sampler.set_epoch(epoch) at the start of each epoch, before "
                 "iterating the DataLoader")
    for r in range(world):
        shares_r = [sorted(o) for o in orders[r]]
        if all(s == shares_r[0] for s in shares_r):
            fail(ex, f"each rank's share to change between epochs ({setting})",
                 f"rank {r} trains on the same samples every epoch, only "
                 "reordered", "shuffle the whole data set with DistributedSampler("
                 "shuffle=True) and set_epoch, not each rank's fixed share")
        if all(o == sorted(o) for o in orders[r]):
            fail(ex, f"a shuffled order ({setting})",
                 f"rank {r}'s samples in increasing order in every epoch",
                 "create the DistributedSampler with shuffle=True")


def check_epoch_batches(epoch_batches: Callable) -> None:
    """Exercise 6.2: disjoint shares, shuffled, a new order each epoch."""
    ex = "6.2"
    require_solution(ex, epoch_batches)
    for n, world, epochs, batch_size in _SAMPLER_CASES:
        data = TensorDataset(torch.arange(n))
        seen = [_as_batches(ex, call_learner(ex, epoch_batches, data, r, world, epochs,
                                             batch_size), epochs, r)
                for r in range(world)]
        _judge_epochs(ex, seen, n, world, batch_size)
        again = _as_batches(ex, call_learner(ex, epoch_batches, data, 1, world,
                                             epochs, batch_size), epochs, 1)
        if again != seen[1]:
            fail(ex, "the same batches when run again (a reproducible shuffle)",
                 "other batches on a second run of rank 1",
                 "give the sampler a fixed seed, the same on every rank")
    passed(ex, "On 2 and 3 ranks: disjoint shares that cover the data, and a new, "
               "reproducible shuffle every epoch.")


# ---------------------------------------------------------------- exercise 6.3

def _others_done(flags: Path, rank: int, world_size: int) -> bool:
    return all((flags / f"done{q}").exists() for q in range(world_size) if q != rank)


def _holds_rank_0(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint of rank 0's starting weights."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        return all(torch.equal(state[k], v)
                   for k, v in _rank_model(0, 0, None).state_dict().items())
    except Exception:  # not there yet, or still being written
        return False


def _hold_back(flags: Path, rank: int, world_size: int, until=None) -> None:
    """Wait up to LATE_S, less if every other rank has finished (it did not
    wait for this one) or ``until()`` holds."""
    deadline = time.monotonic() + LATE_S
    while time.monotonic() < deadline and not _others_done(flags, rank, world_size):
        if until is not None and until():
            return
        time.sleep(0.01)


class _Model(torch.nn.Linear):
    """A small model whose ``state_dict`` takes a while on the writing rank,
    as a large checkpoint does: until the other ranks have finished, or LATE_S."""

    def __init__(self, slow: bool, flags: Path | None, world_size: int):
        super().__init__(4, 3)
        self.slow, self.flags, self.world_size = slow, flags, world_size

    def state_dict(self, *args, **kwargs):
        if self.slow:
            _hold_back(self.flags, 0, self.world_size)
        return super().state_dict(*args, **kwargs)


def _rank_model(rank: int, world_size: int, flags: Path | None,
                slow: bool = False) -> _Model:
    torch.manual_seed(rank)  # different weights on each rank
    return _Model(slow, flags, world_size)


def _checkpoint_rank(rank: int, world_size: int, save_then_load: Callable,
                     path: str, late_rank: int):
    """Run the learner's function with rank ``late_rank`` arriving late.

    Lateness follows the other ranks, not the clock, so a loaded machine does
    not change the verdict: a late rank 0 (and its slow ``state_dict``) waits
    until the others have finished or LATE_S has passed - a rank that does
    not wait for the file has failed by then; any other late rank waits until
    the file holds rank 0's complete weights, so a rank that also writes it
    writes last. Rank 0's tensors are marked as saved from a GPU this machine
    does not have, so only a load with ``map_location`` brings them back; an
    audit hook sees whether the full unpickler (``weights_only=False``) ran.
    """
    flags = Path(path).parent
    model = _rank_model(rank, world_size, flags,
                        slow=rank == 0 and late_rank == 0)
    before = [p.detach().clone() for p in model.parameters()]
    if rank == late_rank:
        _hold_back(flags, rank, world_size,
                   until=None if rank == 0 else lambda: _holds_rank_0(path))
    missing_gpu = f"cuda:{max(7, torch.cuda.device_count())}"
    ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
    torch.serialization.register_package(
        1, lambda storage: missing_gpu if storage.data_ptr() in ours else None,
        lambda obj, location: None)
    unpickled = []
    sys.addaudithook(lambda event, args: unpickled.append(args[1])
                     if event == "pickle.find_class" else None)
    try:
        save_then_load(model, rank, path)
    finally:
        (flags / f"done{rank}").touch()
    return before, [p.detach().clone() for p in model.parameters()], bool(unpickled)


def check_save_then_load(save_then_load: Callable) -> None:
    """Exercise 6.3: rank 0 saves, every rank waits for it, then loads."""
    ex = "6.3"
    require_solution(ex, save_then_load)
    wait_hint = ("save on rank 0, then make every rank wait (dist.barrier()) "
                 "until the file is complete, then load")
    known = {
        "FileNotFoundError": ("every rank to read the checkpoint after rank 0 "
                              "has finished writing it",
                              "a rank read it before it existed", wait_hint),
        "PytorchStreamReader": ("every rank to read a complete checkpoint",
                                "a rank read it while it was being written, "
                                "or while several ranks wrote it",
                                "only rank 0 saves; every rank waits (dist.barrier()) "
                                "until the file is complete, then loads"),
        "deserialize object on": (
            "every rank to load onto its model's device",
            "a load onto the device the tensors were saved from, a GPU this "
            "machine does not have",
            "pass map_location (the device of the model's parameters) to "
            "torch.load: a checkpoint saved on a GPU machine then loads anywhere"),
    }
    cases = [(2, 0), (3, 2)]  # (world size, the rank that arrives late)
    for world_size, late in cases:
        with tempfile.TemporaryDirectory(prefix="ch06_ckpt_") as tmp:
            path = str(Path(tmp) / "model.pt")
            ranks = _run(ex, _checkpoint_rank, world_size,
                         (save_then_load, path, late), known)
            written = Path(path).exists()
        setting = f"{world_size} ranks, rank {late} arriving late"
        starts = [r[0] for r in ranks]
        for rank, (_, after, unpickled) in enumerate(ranks):
            if unpickled:
                fail(ex, "torch.load(..., weights_only=True)",
                     f"the full unpickler on rank {rank} (weights_only=False)",
                     "a checkpoint holds only tensors: weights_only=True refuses to "
                     "run code hidden in a file")
            if all(torch.equal(a, b) for a, b in zip(after, starts[0], strict=True)):
                continue
            same_as = [q for q, s in enumerate(starts) if all(
                torch.equal(a, b) for a, b in zip(after, s, strict=True))]
            if same_as == [rank]:
                fail(ex, f"rank {rank}'s model to hold rank 0's weights afterwards "
                     f"({setting})", "its own weights, unchanged",
                     "model.load_state_dict(the loaded state)")
            if same_as:
                fail(ex, f"every rank to end with rank 0's weights ({setting})",
                     f"rank {rank} holds rank {same_as[0]}'s weights: rank "
                     f"{same_as[0]} wrote the file, after rank 0 or instead of it",
                     "only rank 0 saves (`if rank == 0:`); ranks writing one file "
                     "overwrite, or corrupt, each other's")
            fail(ex, f"every rank to end with rank 0's weights ({setting})",
                 f"other weights on rank {rank}", wait_hint)
        if not written:
            fail(ex, f"the checkpoint file at `path` afterwards ({setting})",
                 "no file there", "torch.save(model.state_dict(), path) on rank 0")
    passed(ex, "One writer; every rank waited for the complete file, loaded it "
               "onto its own device and ended with rank 0's weights.")
