"""Chapter 6's checkers: right answers written differently pass, and typical
mistakes fail with a message that names them."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import save as write_checkpoint
from torch.distributed import all_reduce as reduce_all
from torch.utils.data import DataLoader, DistributedSampler

from course_utils.checks import ch06
from course_utils.checks.ch06 import (
    check_average_gradients,
    check_epoch_batches,
    check_save_then_load,
)
from course_utils.exercises import ExerciseFailed


def placeholder(*args):
    raise NotImplementedError("Exercise 6.x")


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    text = str(e.value)
    for w in words:
        assert w in text, text


@pytest.fixture
def short_timeout(monkeypatch):
    """Answers that hang are stopped after a few seconds, not the usual 30."""
    monkeypatch.setattr(ch06, "TIMEOUT_S", 6)


# ------------------------------------------------------------------ 6.1


def grads_sum_then_divide(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def grads_flat(model):  # one all_reduce for all gradients, like a DDP bucket
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.flatten() for p in params])
    reduce_all(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def grads_avg_op(model):  # AVG: supported by nccl, and by gloo in torch 2.13
    for p in model.parameters():
        if p.requires_grad:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


class GradientAverager:  # a class instead of a function; a new tensor per .grad
    def __call__(self, model):
        n = dist.get_world_size()
        for p in filter(lambda q: q.grad is not None, model.parameters()):
            everyone = [torch.empty_like(p.grad) for _ in range(n)]
            dist.all_gather(everyone, p.grad)
            p.grad = torch.stack(everyone).mean(0)


def grads_not_divided(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def grads_copy_reduced(model):  # reduces a copy: the .grad is unchanged
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad.clone())


def grads_halved(model):  # a hard-coded world size
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2


def grads_first_only(model):  # stops after the first parameter
    p = next(model.parameters())
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()


def grads_max(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)


def grads_divided_twice(model):
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= n
            dist.all_reduce(p.grad)
            p.grad /= n


def grads_none_not_skipped(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def params_averaged(model):  # the weights, not the gradients
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


def grads_frozen_filled(model):  # gives the frozen parameter a gradient
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def grads_other_group(model):  # a group of rank 0 alone: nobody else's gradient
    alone = dist.new_group([0])
    for p in model.parameters():
        if p.grad is not None and dist.get_rank() == 0:
            dist.all_reduce(p.grad, group=alone)
            p.grad /= dist.get_world_size()


@pytest.mark.parametrize("fn", [grads_sum_then_divide, grads_flat, grads_avg_op,
                                GradientAverager()])
def test_average_gradients_accepts(fn):
    check_average_gradients(fn)


@pytest.mark.parametrize("fn, words", [
    (grads_not_divided, ["their sum", "divide by dist.get_world_size()"]),
    (grads_copy_reduced, ["unchanged"]),
    (grads_halved, ["divided by 2", "not a fixed number"]),
    (grads_first_only, ["unchanged", "every parameter"]),
    (grads_max, ["other values"]),
    (grads_divided_twice, ["divided by 4"]),
    (grads_none_not_skipped, ["None", "skip"]),
    (params_averaged, ["unchanged"]),
    (grads_frozen_filled, ["frozen", "None"]),
    (grads_other_group, ["other values"]),
    (placeholder, ["placeholder"]),
])
def test_average_gradients_rejects(fn, words):
    fails(check_average_gradients, fn, *words)


def test_average_gradients_unmatched_collective(short_timeout):
    def only_rank_0(model):  # the other ranks never join the all_reduce
        if dist.get_rank() == 0:
            grads_sum_then_divide(model)
    fails(check_average_gradients, only_rank_0, "same collectives", "never called")


# ------------------------------------------------------------------ 6.2


def batches_good(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


def batches_new_sampler_per_epoch(dataset, rank, world_size, epochs, batch_size):
    out = []
    for epoch in range(epochs):  # a fresh sampler seeded by the epoch: also right
        sampler = DistributedSampler(dataset, world_size, rank, seed=1000 + epoch)
        out.append([b for (b,) in DataLoader(dataset, batch_size, sampler=sampler)])
    return out


def batches_by_hand(dataset, rank, world_size, epochs, batch_size):
    n = len(dataset)
    per = -(-n // world_size)
    out = []
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(7 + epoch)
        order = torch.randperm(n, generator=g).tolist()
        order += order[:per * world_size - n]  # pad as the sampler does
        mine = order[rank::world_size]
        out.append([mine[i:i + batch_size] for i in range(0, per, batch_size)])
    return out


class EpochBatches:  # a class; batches from the sampler without a DataLoader
    def __call__(self, dataset, rank, world_size, epochs, batch_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
        result = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            idx = list(sampler)
            result.append([idx[i:i + batch_size] for i in range(0, len(idx),
                                                                batch_size)])
        return result


def batches_no_set_epoch(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return [[b[0].tolist() for b in loader] for _ in range(epochs)]


def batches_set_epoch_too_late(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    out = []
    for epoch in range(epochs):
        out.append([b[0].tolist() for b in loader])
        sampler.set_epoch(epoch)  # after the epoch: epochs 0 and 1 share an order
    return out


def batches_same_epoch_number(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    out = []
    for _ in range(epochs):
        sampler.set_epoch(1)  # the same number every epoch: the same shuffle
        out.append([b[0].tolist() for b in loader])
    return out


def batches_no_sampler(dataset, rank, world_size, epochs, batch_size):
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return [[b[0].tolist() for b in loader] for _ in range(epochs)]


def batches_rank_always_0(dataset, rank, world_size, epochs, batch_size):
    return batches_good(dataset, 0, world_size, epochs, batch_size)


def batches_no_shuffle(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


def batches_seed_per_rank(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                 seed=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


def batches_drop_last(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                        drop_last=True)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


def batches_fixed_share_reshuffled(dataset, rank, world_size, epochs, batch_size):
    share = list(DistributedSampler(dataset, world_size, rank, shuffle=False))
    out = []
    for epoch in range(epochs):  # only the order within the share changes
        g = torch.Generator().manual_seed(epoch)
        mine = [share[i] for i in torch.randperm(len(share), generator=g).tolist()]
        out.append([mine[i:i + batch_size] for i in range(0, len(mine), batch_size)])
    return out


def batches_one_at_a_time(dataset, rank, world_size, epochs, batch_size):
    return batches_good(dataset, rank, world_size, epochs, 1)


def batches_unseeded(dataset, rank, world_size, epochs, batch_size):
    sampler = DistributedSampler(dataset, world_size, rank,
                                 seed=int(torch.randint(0, 10**6, ())))
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([b[0].tolist() for b in DataLoader(dataset, batch_size,
                                                      sampler=sampler)])
    return out


@pytest.mark.parametrize("fn", [batches_good, batches_new_sampler_per_epoch,
                                batches_by_hand, EpochBatches()])
def test_epoch_batches_accepts(fn):
    check_epoch_batches(fn)


@pytest.mark.parametrize("fn, words", [
    (batches_no_set_epoch, ["same order", "set_epoch"]),
    (batches_set_epoch_too_late, ["epochs 0 and 1 in the same order",
                                  "before iterating"]),
    (batches_same_epoch_number, ["same order", "set_epoch(epoch)"]),
    (batches_no_sampler, ["whole data set", "DistributedSampler"]),
    (batches_rank_always_0, ["cover all"]),
    (batches_no_shuffle, ["same order"]),
    (batches_seed_per_rank, ["cover all", "same seed"]),
    (batches_drop_last, ["drop_last"]),
    (batches_fixed_share_reshuffled, ["same samples every epoch"]),
    (batches_one_at_a_time, ["batch sizes", "batch_size"]),
    (batches_unseeded, ["cover all", "same seed"]),
    (placeholder, ["placeholder"]),
])
def test_epoch_batches_rejects(fn, words):
    fails(check_epoch_batches, fn, *words)


# ------------------------------------------------------------------ 6.3


def save_good(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    state = torch.load(path, map_location=next(model.parameters()).device,
                       weights_only=True)
    model.load_state_dict(state)


def save_positional_alias(model, rank, path):  # `from torch import save as ...`
    dist.barrier()  # an extra barrier on entry does no harm
    if dist.get_rank() == 0:
        write_checkpoint(model.state_dict(), path)
    dist.monitored_barrier()  # another way to wait for everyone
    model.load_state_dict(torch.load(path, "cpu"))


def save_atomic_all_reduce(model, rank, path):
    if rank == 0:  # write elsewhere, then rename: the file appears complete
        torch.save(model.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.all_reduce(torch.zeros(1))  # any collective makes the readers wait
    device = model.weight.device
    state = torch.load(path, map_location=lambda storage, _: storage)  # on the CPU
    model.load_state_dict({k: v.to(device) for k, v in state.items()})


class SaveThenLoad:  # a class; an object broadcast as the signal
    def __call__(self, model, rank, path):
        if rank == 0:
            torch.save(model.state_dict(), path)
        done = [rank == 0]
        dist.broadcast_object_list(done, src=0)
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)


def save_every_rank(model, rank, path):
    torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_rank_1(model, rank, path):
    if rank == 1:
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


def save_unsafe_load(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


def save_temp_never_renamed(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path + ".tmp")
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu"))


def save_barrier_only_on_rank_0(model, rank, path):
    if rank == 0:
        torch.save(model.state_dict(), path)
        dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu"))


@pytest.mark.parametrize("fn", [save_good, save_positional_alias,
                                save_atomic_all_reduce, SaveThenLoad()])
def test_save_then_load_accepts(fn):
    check_save_then_load(fn)


@pytest.mark.parametrize("fn, words", [
    (save_every_rank, ["only rank 0 saves"]),
    (save_rank_1, ["rank 1 wrote the file"]),
    (save_no_barrier, ["before it existed", "dist.barrier()"]),
    (save_barrier_first, ["before it existed"]),
    (save_no_map_location, ["map_location", "does not have"]),
    (save_not_loaded_into_model, ["unchanged", "load_state_dict"]),
    (save_unsafe_load, ["weights_only=True"]),
    (save_temp_never_renamed, ["before it existed"]),
    (save_barrier_only_on_rank_0, ["before it existed"]),
    (placeholder, ["placeholder"]),
])
def test_save_then_load_rejects(fn, words, short_timeout):
    fails(check_save_then_load, fn, *words)
