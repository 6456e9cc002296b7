"""Chapter 5's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import copy
import math
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call

from course_utils.checks import ch05
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    for w in words:
        assert w in str(e.value), str(e.value)


# ---------------------------------------------------------------- 5.1


def scatter_chunk(x, n, dim):
    return list(torch.chunk(x, n, dim))


def scatter_split(x, n, dim):
    size = math.ceil(x.shape[dim] / n)
    return list(torch.split(x, size, dim))


def scatter_narrow(x, n, dim):
    size, out, start = -(-x.shape[dim] // n), [], 0
    while start < x.shape[dim]:
        out.append(x.narrow(dim, start, min(size, x.shape[dim] - start)))
        start += size
    return out


def scatter_tuple_movedim(x, n, dim):
    pieces = torch.chunk(x.movedim(dim, 0), n)
    return tuple(p.movedim(0, dim) for p in pieces)


@pytest.mark.parametrize("fn", [scatter_chunk, scatter_split, scatter_narrow,
                                scatter_tuple_movedim])
def test_right_scatters_pass(fn):
    ch05.check_scatter_batch(fn)


def test_wrong_scatters_fail():
    def tensor_split(x, n, dim):
        return list(torch.tensor_split(x, n, dim))

    def always_dim0(x, n, dim):
        return list(torch.chunk(x, n, 0))

    def floor_size(x, n, dim):
        return list(torch.split(x, max(1, x.shape[dim] // n), dim))

    def two_devices(x, n, dim):
        return list(torch.chunk(x, 2, dim))

    def reversed_order(x, n, dim):
        return list(torch.chunk(x, n, dim))[::-1]

    def whole_tensor(x, n, dim):
        return x

    def split_n_rows(x, n, dim):  # split's argument is a size, not a count
        return list(torch.split(x, n, dim))

    def shuffled_rows(x, n, dim):
        perm = torch.randperm(x.shape[dim], generator=torch.Generator().manual_seed(0))
        return list(torch.chunk(x.index_select(dim, perm), n, dim))

    def padded_to_n(x, n, dim):
        pieces = list(torch.chunk(x, n, dim))
        while len(pieces) < n:
            pieces.append(x.narrow(dim, 0, 0))
        return pieces

    fails(ch05.check_scatter_batch, tensor_split, "torch.chunk")
    fails(ch05.check_scatter_batch, always_dim0, "dim=1")
    fails(ch05.check_scatter_batch, floor_size, "shapes")
    fails(ch05.check_scatter_batch, two_devices, "shapes")
    fails(ch05.check_scatter_batch, reversed_order, "order")
    fails(ch05.check_scatter_batch, whole_tensor, "list of tensors")
    fails(ch05.check_scatter_batch, split_n_rows, "shapes")
    fails(ch05.check_scatter_batch, shuffled_rows, "in order")
    fails(ch05.check_scatter_batch, padded_to_n, "shapes")


# ---------------------------------------------------------------- 5.2


def _threads(fns):
    out = [None] * len(fns)

    def run(i):
        out[i] = fns[i]()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def step_functional(model, x, y, n):
    params = dict(model.named_parameters())
    outs = []
    for piece in torch.chunk(x, n):
        shell = copy.deepcopy(model)
        outs.append(functional_call(shell, {k: p.clone() for k, p in params.items()},
                                    (piece,)))
    loss = nn.functional.mse_loss(torch.cat(outs), y)
    loss.backward()
    return loss


def step_threads(model, x, y, n):
    params = dict(model.named_parameters())
    shells = [copy.deepcopy(model) for _ in range(n)]
    pieces = torch.chunk(x, n)
    outs = _threads([lambda s=s, p=p: functional_call(
        s, {k: v.clone() for k, v in params.items()}, (p,))
        for s, p in zip(shells, pieces, strict=False)])
    loss = nn.functional.mse_loss(torch.cat(outs), y)
    loss.backward()
    return loss.item()


def step_weighted_chunk_losses(model, x, y, n):  # sum of chunk SSEs / all elements
    total = 0
    for xp, yp in zip(torch.chunk(x, n), torch.chunk(y, n), strict=True):
        total = total + ((model(xp) - yp) ** 2).sum()
    loss = total / y.numel()
    loss.backward()
    return loss


def step_grads_summed_by_hand(model, x, y, n):
    total = None
    for xp, yp in zip(torch.chunk(x, n), torch.chunk(y, n), strict=True):
        part = ((model(xp) - yp) ** 2).sum() / y.numel()
        part.backward()
        total = part.detach() if total is None else total + part.detach()
    return total


@pytest.mark.parametrize("fn", [step_functional, step_threads,
                                step_weighted_chunk_losses, step_grads_summed_by_hand])
def test_right_steps_pass(fn):
    ch05.check_data_parallel_step(fn)


def test_wrong_steps_fail():
    def mean_of_chunk_means(model, x, y, n):
        losses = [nn.functional.mse_loss(model(xp), yp)
                  for xp, yp in zip(torch.chunk(x, n), torch.chunk(y, n), strict=True)]
        loss = sum(losses) / len(losses)
        loss.backward()
        return loss

    def sum_of_chunk_means(model, x, y, n):
        loss = sum(nn.functional.mse_loss(model(xp), yp)
                   for xp, yp in zip(torch.chunk(x, n), torch.chunk(y, n), strict=True))
        loss.backward()
        return loss

    def deepcopied_replicas(model, x, y, n):
        outs = [copy.deepcopy(model)(xp) for xp in torch.chunk(x, n)]
        loss = nn.functional.mse_loss(torch.cat(outs), y)
        loss.backward()
        return loss

    def detached_copies(model, x, y, n):
        params = {k: p.detach().clone().requires_grad_() for k, p in
                  model.named_parameters()}
        outs = [functional_call(copy.deepcopy(model), params, (xp,))
                for xp in torch.chunk(x, n)]
        loss = nn.functional.mse_loss(torch.cat(outs), y)
        loss.backward()
        return loss

    def first_chunk_only(model, x, y, n):
        xp, yp = torch.chunk(x, n)[0], torch.chunk(y, n)[0]
        loss = nn.functional.mse_loss(model(xp), yp)
        loss.backward()
        return loss

    def shared_module_in_threads(model, x, y, n):
        params = dict(model.named_parameters())
        outs = _threads([lambda p=p: functional_call(
            model, {k: v.clone() for k, v in params.items()}, (p,))
            for p in torch.chunk(x, n)])
        loss = nn.functional.mse_loss(torch.cat(outs), y)
        loss.backward()
        return loss

    def takes_a_step(model, x, y, n):
        loss = step_functional(model, x, y, n)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        return loss

    def loss_times_n(model, x, y, n):
        loss = nn.functional.mse_loss(model(x), y) * n
        loss.backward()
        return loss

    def no_backward(model, x, y, n):
        return nn.functional.mse_loss(model(x), y)

    fails(ch05.check_data_parallel_step, mean_of_chunk_means, "mean of the chunks")
    fails(ch05.check_data_parallel_step, sum_of_chunk_means, "loss of the whole batch")
    fails(ch05.check_data_parallel_step, deepcopied_replicas, "no .grad")
    fails(ch05.check_data_parallel_step, detached_copies, "no .grad")
    fails(ch05.check_data_parallel_step, first_chunk_only, "loss of the whole batch")
    fails(ch05.check_data_parallel_step, takes_a_step, "parameters unchanged")
    fails(ch05.check_data_parallel_step, loss_times_n, "loss of the whole batch")
    fails(ch05.check_data_parallel_step, no_backward, "no .grad")
    # one module object shared by threads: the copies swapped in may stay behind,
    # or the gradients come out wrong - either way it must not pass
    with pytest.raises(ExerciseFailed) as err:
        for _ in range(3):
            ch05.check_data_parallel_step(shared_module_in_threads)
    assert any(w in str(err.value) for w in ("own module object", "gradient")), \
        str(err.value)


# ---------------------------------------------------------------- 5.3


def rm_module(bn, x, n):
    bn.train()
    bn(torch.chunk(x, n)[0])
    return bn.running_mean


def rm_formula(bn, x, n):
    first = torch.chunk(x, n)[0]
    return (1 - bn.momentum) * bn.running_mean + bn.momentum * first.mean(0)


def rm_replica(bn, x, n):
    replica = copy.deepcopy(bn).train()
    replica(x[: math.ceil(x.shape[0] / n)])
    return replica.running_mean.clone()


def rm_lerp(bn, x, n):
    first = torch.chunk(x, n)[0]
    return torch.lerp(bn.running_mean, first.mean(dim=0), bn.momentum)


@pytest.mark.parametrize("fn", [rm_module, rm_formula, rm_replica, rm_lerp])
def test_right_running_means_pass(fn):
    ch05.check_dp_running_mean(fn)


def test_wrong_running_means_fail():
    def whole_batch(bn, x, n):
        bn.train()
        bn(x)
        return bn.running_mean

    def last_chunk(bn, x, n):
        bn.train()
        bn(torch.chunk(x, n)[-1])
        return bn.running_mean

    def average_of_replicas(bn, x, n):
        means = []
        for piece in torch.chunk(x, n):
            r = copy.deepcopy(bn).train()
            r(piece)
            means.append(r.running_mean)
        return torch.stack(means).mean(0)

    def chunk_mean_only(bn, x, n):
        return torch.chunk(x, n)[0].mean(0)

    def unchanged(bn, x, n):
        return bn.running_mean

    def eval_mode(bn, x, n):
        bn.eval()
        bn(torch.chunk(x, n)[0])
        return bn.running_mean

    def wrong_momentum(bn, x, n):
        first = torch.chunk(x, n)[0]
        return 0.9 * bn.running_mean + 0.1 * first.mean(0)

    def every_replica_in_turn(bn, x, n):  # one shared module updated n times
        bn.train()
        for piece in torch.chunk(x, n):
            bn(piece)
        return bn.running_mean

    def as_list(bn, x, n):
        return rm_formula(bn, x, n).tolist()

    fails(ch05.check_dp_running_mean, whole_batch, "full batch")
    fails(ch05.check_dp_running_mean, last_chunk, "last chunk")
    fails(ch05.check_dp_running_mean, average_of_replicas, "average of every")
    fails(ch05.check_dp_running_mean, chunk_mean_only, "chunk's mean itself")
    fails(ch05.check_dp_running_mean, unchanged, "unchanged")
    fails(ch05.check_dp_running_mean, eval_mode, "unchanged")
    fails(ch05.check_dp_running_mean, wrong_momentum, "momentum")
    fails(ch05.check_dp_running_mean, every_replica_in_turn, "in turn")
    fails(ch05.check_dp_running_mean, as_list, "running_mean tensor")
