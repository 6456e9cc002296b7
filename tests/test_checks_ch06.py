"""Chapter 6's checkers: correct variants pass, typical mistakes are named."""

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from course_utils.checks.ch06 import (
    check_average_gradients,
    check_epoch_batches,
    check_save_then_load,
)
from course_utils.exercises import ExerciseFailed

# ------------------------------------------------------------------ 6.1


def grads_sum_then_divide(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def grads_flat(model):  # one all_reduce for all gradients, like a DDP bucket
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def grads_not_divided(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def grads_copy_reduced(model):  # reduces a copy: the .grad is unchanged
    for p in model.parameters():
        dist.all_reduce(p.grad.clone())


def grads_avg_op(model):  # AVG: supported by nccl, and by gloo in recent torch
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def placeholder(*args):
    raise NotImplementedError("Exercise 6.x")


@pytest.mark.parametrize("fn", [grads_sum_then_divide, grads_flat, grads_avg_op])
def test_average_gradients_accepts(fn):
    check_average_gradients(fn)


@pytest.mark.parametrize("fn, words", [
    (grads_not_divided, "divide each gradient by dist.get_world_size"),
    (grads_copy_reduced, "unchanged"),
    (placeholder, "placeholder"),
])
def test_average_gradients_rejects(fn, words):
    with pytest.raises(ExerciseFailed, match=words):
        check_average_gradients(fn)


# ------------------------------------------------------------------ 6.2


def batches_good(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=7)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b for (b,) in loader])  # tensors are accepted too
    return out


def batches_no_set_epoch(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return [[b[0].tolist() for b in loader] for _ in range(epochs)]


def batches_no_sampler(dataset, rank, world_size, epochs, batch_size):
    torch.manual_seed(0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    return [[b[0].tolist() for b in loader] for _ in range(epochs)]


def batches_no_shuffle(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


def test_epoch_batches_accepts():
    check_epoch_batches(batches_good)


@pytest.mark.parametrize("fn, words", [
    (batches_no_set_epoch, "missing set_epoch"),
    (batches_no_sampler, "DistributedSampler"),
    (batches_no_shuffle, "shuffle=True"),
    (placeholder, "placeholder"),
])
def test_epoch_batches_rejects(fn, words):
    with pytest.raises(ExerciseFailed, match=words):
        check_epoch_batches(fn)


# ------------------------------------------------------------------ 6.3


def save_good(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    state = torch.load(path, map_location=next(model.parameters()).device,
                       weights_only=True)
    model.load_state_dict(state)


def save_good_positional(model, rank, path):
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, "cpu"))


def save_every_rank(model, rank, path):
    torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_no_barrier(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_barrier_first(model, rank, path):
    dist.barrier()
    if rank == 0:
        torch.save(model.state_dict(), path)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_no_map_location(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, weights_only=True))


def save_not_loaded_into_model(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("fn", [save_good, save_good_positional])
def test_save_then_load_accepts(fn):
    check_save_then_load(fn)


@pytest.mark.parametrize("fn, words", [
    (save_every_rank, "saved from every rank"),
    (save_no_barrier, "loaded before the barrier"),
    (save_barrier_first, "before rank 0 had written it"),
    (save_no_map_location, "map_location"),
    (save_not_loaded_into_model, "load_state_dict"),
    (placeholder, "placeholder"),
])
def test_save_then_load_rejects(fn, words):
    with pytest.raises(ExerciseFailed, match=words):
        check_save_then_load(fn)
