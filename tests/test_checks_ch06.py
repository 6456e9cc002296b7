"""Chapter 6's checkers: right answers written differently pass, and typical
mistakes fail with a message that names them."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import save as write_checkpoint
from torch.distributed import all_reduce as reduce_all

from course_utils.checks import ch06
from course_utils.checks.ch06 import (
    check_average_gradients,
    check_ring_all_reduce,
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
    monkeypatch.setattr(ch06, "answer_limit", lambda *a, **k: 6)


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


def grads_bucketed_by_dtype(model):  # one flat buffer per dtype, as DDP's buckets
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat)
        for g, avg in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            g.copy_(avg / dist.get_world_size())


def grads_float32_buffer(model):  # one float32 buffer: float64 gradients rounded
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.flatten().float() for p in params])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


_calls = []


def grads_first_call_only(model):  # state kept across calls: averages once
    if _calls:
        return
    _calls.append(1)
    grads_sum_then_divide(model)


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


def grads_functional(model):  # the functional collectives, a new .grad each
    import torch.distributed._functional_collectives as funcol

    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            p.grad = funcol.wait_tensor(
                funcol.all_reduce(p.grad, "sum", dist.group.WORLD)) / n


def grads_async(model):  # every all_reduce in flight at once, then scaled
    works = [(p, dist.all_reduce(p.grad, async_op=True))
             for p in model.parameters() if p.grad is not None]
    for p, work in works:
        work.wait()
        p.grad.mul_(1.0 / dist.get_world_size())


def grads_broadcast_rank_0(model):  # rank 0's gradient everywhere
    for p in model.parameters():
        if p.grad is not None:
            dist.broadcast(p.grad, 0)


def grads_zero_for_frozen(model):  # gives the frozen bias a zero gradient
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


_averaged_once = set()


def grads_once_per_model(model):  # state kept across calls, keyed by the model
    if id(model) in _averaged_once:
        return
    _averaged_once.add(id(model))
    grads_sum_then_divide(model)


def grads_matrices_only(model):  # biases left out
    for p in model.parameters():
        if p.grad is not None and p.dim() == 2:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@pytest.mark.parametrize("fn", [grads_functional, grads_async,
                                grads_sum_then_divide, grads_flat, grads_avg_op,
                                GradientAverager(), grads_bucketed_by_dtype])
def test_average_gradients_accepts(fn):
    check_average_gradients(fn)


@pytest.mark.parametrize("fn, words", [
    (grads_broadcast_rank_0, ["rank 0's own gradient", "broadcast"]),
    (grads_zero_for_frozen, ["frozen", "None"]),
    (grads_once_per_model, ["call 2", "unchanged"]),
    (grads_matrices_only, ["bias", "every parameter"]),
])
def test_average_gradients_rejects_more(fn, words):
    fails(check_average_gradients, fn, *words)


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
    (grads_float32_buffer, ["float64", "own dtype"]),
    (grads_first_call_only, ["call 2", "unchanged"]),
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


def ring_parity(tensor):  # blocking send/recv, ordered by rank parity
    n, r = dist.get_world_size(), dist.get_rank()
    parts = tensor.view(-1).tensor_split(n)
    for step in range(2 * n - 2):
        out, into = parts[(r - step) % n], parts[(r - step - 1) % n]
        box = torch.empty_like(into)
        if r % 2 == 0:
            dist.send(out.contiguous(), (r + 1) % n)
            dist.recv(box, (r - 1) % n)
        else:
            dist.recv(box, (r - 1) % n)
            dist.send(out.contiguous(), (r + 1) % n)
        if step < n - 1:
            into.add_(box)
        else:
            into.copy_(box)


def ring_leftwards(tensor):  # the ring the other way round, batch_isend_irecv
    n, r = dist.get_world_size(), dist.get_rank()
    parts = list(torch.flatten(tensor).tensor_split(n))
    for step in range(2 * (n - 1)):
        out, into = parts[(r + step) % n], parts[(r + step + 1) % n]
        box = torch.zeros_like(into)
        ops = [dist.P2POp(dist.irecv, box, (r + 1) % n),
               dist.P2POp(dist.isend, out, (r - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        into.copy_(into + box if step < n - 1 else box)


class RingAllReduce:  # a class; works on a flat copy, copied back at the end
    def __call__(self, tensor):
        from torch.distributed import irecv as post_receive
        from torch.distributed import isend as post_send

        n, r = dist.get_world_size(), dist.get_rank()
        flat = tensor.reshape(-1).clone()
        sizes = [flat.numel() // n + (i < flat.numel() % n) for i in range(n)]
        parts = list(torch.split(flat, sizes))
        for phase in ("reduce", "gather"):
            for s in range(n - 1):
                send_i = (r - s + (1 if phase == "gather" else 0)) % n
                recv_i = (send_i - 1) % n
                box = torch.empty_like(parts[recv_i])
                got = post_receive(box, src=(r - 1) % n)
                sent = post_send(parts[send_i].clone(), dst=(r + 1) % n)
                got.wait()
                sent.wait()
                parts[recv_i] = parts[recv_i] + box if phase == "reduce" else box
        tensor.copy_(torch.cat(parts).view_as(tensor))


def ring_with_barriers(tensor):  # extra harmless work: barriers, a returned value
    dist.barrier()
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(n - 1):  # reduce-scatter
        box = torch.empty_like(chunks[(r - step - 1) % n])
        sent = dist.isend(chunks[(r - step) % n], (r + 1) % n)
        dist.recv(box, (r - 1) % n)
        sent.wait()
        chunks[(r - step - 1) % n].add_(box)
    for step in range(n - 1):  # all-gather, starting with the finished chunk
        box = torch.empty_like(chunks[(r - step) % n])
        sent = dist.isend(chunks[(r - step + 1) % n], (r + 1) % n)
        dist.recv(box, (r - 1) % n)
        sent.wait()
        chunks[(r - step) % n].copy_(box)
    dist.barrier()
    return tensor


def ring_recursive_index(tensor):  # chunk bookkeeping by a dict of owners
    n, r = dist.get_world_size(), dist.get_rank()
    views = dict(enumerate(tensor.view(-1).tensor_split(n)))
    send_i = r
    for step in range(2 * (n - 1)):
        recv_i = (send_i - 1) % n
        box = torch.empty_like(views[recv_i])
        reqs = [dist.irecv(box, (r + n - 1) % n),
                dist.isend(views[send_i], (r + 1) % n)]
        for q in reqs:
            q.wait()
        if step < n - 1:
            views[recv_i] += box
        else:
            views[recv_i][:] = box
        send_i = recv_i


def ring_uses_all_reduce(tensor):
    dist.all_reduce(tensor)


def ring_naive_exchange(tensor):  # everyone sends everything to everyone
    n, r = dist.get_world_size(), dist.get_rank()
    boxes = [torch.empty_like(tensor) for _ in range(n)]
    works = [dist.isend(tensor.clone(), q) for q in range(n) if q != r]
    works += [dist.irecv(boxes[q], q) for q in range(n) if q != r]
    for w in works:
        w.wait()
    for q in range(n):
        if q != r:
            tensor += boxes[q]


def ring_reduce_scatter_only(tensor):
    n, r = dist.get_world_size(), dist.get_rank()
    parts = tensor.view(-1).tensor_split(n)
    for step in range(n - 1):
        box = torch.empty_like(parts[(r - step - 1) % n])
        req = dist.irecv(box, (r - 1) % n)
        dist.isend(parts[(r - step) % n], (r + 1) % n).wait()
        req.wait()
        parts[(r - step - 1) % n].add_(box)


def ring_mean(tensor):
    ring_parity(tensor)
    tensor /= dist.get_world_size()


def ring_out_of_place(tensor):  # returns the sum, leaves the argument alone
    out = tensor.clone()
    ring_parity(out)
    return out


def ring_chunk(tensor):  # tensor.chunk(n) may give fewer than n pieces
    n, r = dist.get_world_size(), dist.get_rank()
    parts = tensor.view(-1).chunk(n)
    for step in range(2 * (n - 1)):
        into = parts[(r - step - 1) % n]
        box = torch.empty_like(into)
        req = dist.irecv(box, (r - 1) % n)
        dist.isend(parts[(r - step) % n], (r + 1) % n).wait()
        req.wait()
        if step < n - 1:
            into += box
        else:
            into.copy_(box)


def ring_rows(tensor):  # assumes the size divides by the world size
    n = dist.get_world_size()
    rows = tensor.view(n, -1)
    ring_parity(rows)


def ring_float32(tensor):  # adds in float32 whatever the dtype
    work = tensor.to(torch.float32)
    ring_parity(work)
    tensor.copy_(work)


def ring_float64(tensor):  # sends float64 chunks: twice a float32 tensor's bytes
    work = tensor.to(torch.float64)
    ring_parity(work)
    tensor.copy_(work)


def ring_gather_adds(tensor):  # the all-gather phase adds instead of copying
    n, r = dist.get_world_size(), dist.get_rank()
    parts = tensor.view(-1).tensor_split(n)
    for step in range(2 * (n - 1)):
        into = parts[(r - step - 1) % n]
        box = torch.empty_like(into)
        req = dist.irecv(box, (r - 1) % n)
        dist.isend(parts[(r - step) % n], (r + 1) % n).wait()
        req.wait()
        into += box


def ring_via_rank_0(tensor):  # a star of sends and receives through rank 0
    n, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        for q in range(1, n):
            box = torch.empty_like(tensor)
            dist.recv(box, q)
            tensor += box
        for q in range(1, n):
            dist.send(tensor, q)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)


_cached_parts = {}


def ring_cached_views(tensor):  # views kept from the first call: state reused
    n = dist.get_world_size()
    if "parts" not in _cached_parts:
        _cached_parts["parts"] = tensor.view(-1).tensor_split(n)
    parts = _cached_parts["parts"]
    r = dist.get_rank()
    for step in range(2 * (n - 1)):
        into = parts[(r - step - 1) % n]
        box = torch.empty_like(into)
        req = dist.irecv(box, (r - 1) % n)
        dist.isend(parts[(r - step) % n], (r + 1) % n).wait()
        req.wait()
        if step < n - 1:
            into += box
        else:
            into.copy_(box)


def ring_two_ranks_only(tensor):  # a hard-coded world size of 2
    r = dist.get_rank()
    parts = tensor.view(-1).tensor_split(2)
    for step in range(2):
        box = torch.empty_like(parts[(r - step - 1) % 2])
        sent = dist.isend(parts[(r - step) % 2], (r + 1) % 2)
        dist.recv(box, (r - 1) % 2)
        sent.wait()
        if step == 0:
            parts[(r - 1) % 2].add_(box)
        else:
            parts[r % 2].copy_(box)


def ring_send_thread(tensor):  # blocking send in a thread, recv in the caller's
    import threading

    n, r = dist.get_world_size(), dist.get_rank()
    parts = tensor.view(-1).tensor_split(n)
    for step in range(2 * (n - 1)):
        out, into = parts[(r - step) % n], parts[(r - step - 1) % n]
        box = torch.empty_like(into)
        sender = threading.Thread(target=dist.send, args=(out.clone(), (r + 1) % n))
        sender.start()
        dist.recv(box, (r - 1) % n)
        sender.join()
        if step < n - 1:
            into.add_(box)
        else:
            into.copy_(box)


def ring_tagged_new_buffers(tensor):  # tags, P2POp batches, new tensors per step
    n, r = dist.get_world_size(), dist.get_rank()
    parts = list(tensor.flatten().clone().tensor_split(n))
    for step in range(2 * n - 2):
        s_i, r_i = (r - step) % n, (r - step - 1) % n
        box = parts[r_i].new_zeros(parts[r_i].shape)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, parts[s_i].contiguous(), (r + 1) % n, tag=step),
            dist.P2POp(dist.irecv, box, (r - 1) % n, tag=step)])
        for w in works:
            w.wait()
        parts[r_i] = parts[r_i] + box if step < n - 1 else box.clone()
    tensor.copy_(torch.cat(parts).reshape(tensor.shape))


def ring_functional_sum_dummy_messages(tensor):  # the sum from another API
    import torch.distributed._functional_collectives as funcol

    n, r = dist.get_world_size(), dist.get_rank()
    total = funcol.all_reduce(tensor, "sum", dist.group.WORLD)
    parts = tensor.view(-1).tensor_split(n)
    for step in range(2 * (n - 1)):  # messages of the right count and sizes
        box = torch.empty_like(parts[(r - step - 1) % n])
        req = dist.irecv(box, (r - 1) % n)
        dist.isend(parts[(r - step) % n].clone(), (r + 1) % n).wait()
        req.wait()
    tensor.copy_(total)


def ring_hidden_sum_dummy_messages(tensor):  # dispatch modes off, then the sum
    import torch.distributed._functional_collectives as funcol
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        total = funcol.wait_tensor(funcol.all_reduce(tensor, "sum", dist.group.WORLD))
    n, r = dist.get_world_size(), dist.get_rank()
    parts = tensor.view(-1).tensor_split(n)
    for step in range(2 * (n - 1)):  # the rank's own chunks, not the ring's sums
        box = torch.empty_like(parts[(r - step - 1) % n])
        req = dist.irecv(box, (r - 1) % n)
        dist.isend(parts[(r - step) % n].clone(), (r + 1) % n).wait()
        req.wait()
    tensor.copy_(total)


def ring_store_sum_dummy_messages(tensor):  # the sum through the rendezvous store
    import pickle

    n, r = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    key = f"t{tensor.numel()}{tensor.dtype}"
    store.set(f"{key}/{r}", pickle.dumps(tensor.clone()))
    total = sum(pickle.loads(store.get(f"{key}/{q}")) for q in range(n))
    parts = tensor.view(-1).tensor_split(n)
    for step in range(2 * (n - 1)):
        box = torch.empty_like(parts[(r - step - 1) % n])
        req = dist.irecv(box, (r - 1) % n)
        dist.isend(torch.zeros_like(parts[(r - step) % n]), (r + 1) % n).wait()
        req.wait()
    tensor.copy_(total)


def ring_process_group_method(tensor):  # the ProcessGroup's own allreduce
    ring_parity(tensor.clone())
    dist.distributed_c10d._get_default_group().allreduce([tensor]).wait()


def ring_all_gather_into_tensor(tensor):  # all_gather_into_tensor, then a local sum
    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    everyone = flat.new_empty(n * flat.numel())
    dist.all_gather_into_tensor(everyone, flat)
    tensor.copy_(everyone.view(n, -1).sum(0).view_as(tensor))


@pytest.mark.parametrize("fn", [ring_parity, ring_leftwards, RingAllReduce(),
                                ring_with_barriers, ring_recursive_index,
                                ring_send_thread, ring_tagged_new_buffers])
def test_ring_all_reduce_accepts(fn):
    check_ring_all_reduce(fn)


@pytest.mark.parametrize("fn, words", [
    (ring_uses_all_reduce, ["send/recv", "allreduce"]),
    (ring_naive_exchange, ["message(s)", "neighbour"]),
    (ring_reduce_scatter_only, ["only chunk(s)", "all-gather"]),
    (ring_mean, ["do not divide"]),
    (ring_out_of_place, ["returned", "unchanged", "in place"]),
    (ring_chunk, ["fewer than n pieces", "tensor_split"]),
    (ring_rows, ["do not divide", "tensor_split"]),
    (ring_float32, ["rounded", "own dtype"]),
    (ring_float64, ["bytes", "own dtype"]),
    (ring_gather_adds, ["only chunk(s)", "all-gather"]),
    (ring_via_rank_0, ["message(s)", "neighbour"]),
    (ring_cached_views, ["earlier call", "keep no views"]),
    (ring_functional_sum_dummy_messages, ["send/recv", "_c10d_functional.all_reduce"]),
    (ring_hidden_sum_dummy_messages, ["carry", "ring's sums"]),
    (ring_store_sum_dummy_messages, ["carry", "ring's sums"]),
    (ring_process_group_method, ["send/recv", "allreduce"]),
    (ring_all_gather_into_tensor, ["send/recv", "allgather"]),
    (placeholder, ["placeholder"]),
])
def test_ring_all_reduce_rejects(fn, words):
    fails(check_ring_all_reduce, fn, *words)


def test_ring_all_reduce_hard_coded_world_size(short_timeout):
    fails(check_ring_all_reduce, ring_two_ranks_only, "never came",
          "dist.get_world_size()")


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


def save_through_bytes(model, rank, path):  # bytes written by hand, a store signal
    import io

    if rank == 0:
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        with open(path, "wb") as f:
            f.write(buffer.getvalue())
    dist.all_gather_object([None] * dist.get_world_size(), rank)
    with open(path, "rb") as f:
        state = torch.load(io.BytesIO(f.read()), map_location=model.weight.device,
                           weights_only=True)
    for name, tensor in model.state_dict().items():
        tensor.copy_(state[name])


def save_whole_model(model, rank, path):  # pickles the module, not its state_dict
    if rank == 0:
        torch.save(model, path)
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu",
                                     weights_only=True).state_dict())


def save_sleep_for_barrier(model, rank, path):  # a pause is not a barrier
    import time

    if rank == 0:
        torch.save(model.state_dict(), path)
    else:
        time.sleep(0.1)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


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
                                save_atomic_all_reduce, SaveThenLoad(),
                                save_through_bytes])
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
    (save_whole_model, ["state_dict", "not the model"]),
    (save_sleep_for_barrier, ["before it existed", "dist.barrier()"]),
    (placeholder, ["placeholder"]),
])
def test_save_then_load_rejects(fn, words, short_timeout):
    fails(check_save_then_load, fn, *words)


def save_poll_for_file(model, rank, path):  # waits for the file, not for rank 0
    import time

    if rank == 0:
        torch.save(model.state_dict(), path)
    while not os.path.exists(path):
        time.sleep(0.001)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_only_rank_1_loads(model, rank, path):  # a hard-coded rank loads
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    if rank == 1:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_broadcast_no_file(model, rank, path):  # right weights, no checkpoint
    for p in model.parameters():
        dist.broadcast(p.data, 0)


def save_all_reduce_as_barrier(model, rank, path):  # any collective waits as well
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
    dist.all_reduce(torch.zeros(1))
    device = str(next(model.parameters()).device)
    state = torch.load(path, map_location=device, weights_only=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])


@pytest.mark.parametrize("fn, words", [
    (save_poll_for_file, ["complete", "dist.barrier()"]),
    (save_only_rank_1_loads, ["rank 0 never loaded it", "every rank loads"]),
    (save_broadcast_no_file, ["file", "torch.save"]),
])
def test_save_then_load_rejects_more(fn, words, short_timeout):
    fails(check_save_then_load, fn, *words)


def test_save_then_load_accepts_all_reduce_as_barrier():
    check_save_then_load(save_all_reduce_as_barrier)


def save_fixed_sleep(model, rank, path):  # a long pause instead of waiting
    import time

    if rank == 0:
        torch.save(model.state_dict(), path)
    else:
        time.sleep(1.5)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def save_rank_0_keeps_its_model(model, rank, path):  # rank 0 skips the load
    if rank == 0:
        torch.save(model.state_dict(), path)
        dist.barrier()
        return
    dist.barrier()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


@pytest.mark.parametrize("fn, words", [
    (save_fixed_sleep, ["dist.barrier()"]),
    (save_rank_0_keeps_its_model, ["rank 0 never loaded it", "rank 0 included"]),
])
def test_save_then_load_rejects_a_sleep_and_a_skipped_load(fn, words, short_timeout):
    fails(check_save_then_load, fn, *words)


def grads_float32_assigned(model):  # a float32 mean assigned to a float64 .grad
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.float()
            dist.all_reduce(g)
            p.grad = g / dist.get_world_size()


def ring_buffer_of_the_sent_chunk(tensor):  # receives into a buffer like the sent chunk
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(2 * (n - 1)):
        box = torch.empty_like(chunks[(r - s) % n])
        recv = dist.irecv(box, (r - 1) % n)
        send = dist.isend(chunks[(r - s) % n], (r + 1) % n)
        recv.wait()
        send.wait()
        if s < n - 1:
            chunks[(r - s - 1) % n][:len(box)] += box[:len(chunks[(r - s - 1) % n])]
        else:
            chunks[(r - s - 1) % n][:len(box)] = box[:len(chunks[(r - s - 1) % n])]


def ring_while_loop(tensor):  # one loop over both phases, indices from the send
    n, r = dist.get_world_size(), dist.get_rank()
    chunks, s = tensor.view(-1).tensor_split(n), 0
    while s < 2 * n - 2:
        out = (r - s) % n
        got = torch.empty_like(chunks[(out - 1) % n])
        recv = dist.irecv(got, (r - 1) % n)
        send = dist.isend(chunks[out], (r + 1) % n)
        recv.wait()
        send.wait()
        if s < n - 1:
            chunks[(out - 1) % n].add_(got)
        else:
            chunks[(out - 1) % n].copy_(got)
        s += 1


def save_flag_broadcast(model, rank, path):  # a broadcast from rank 0 as the wait
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.broadcast(torch.ones(1), src=0)
    model.load_state_dict(torch.load(path, map_location=lambda s, _: s,
                                     weights_only=True))


@pytest.mark.parametrize("check, fn", [(check_ring_all_reduce, ring_while_loop),
                                       (check_save_then_load, save_flag_broadcast)])
def test_more_right_answers_accepted(check, fn):
    check(fn)


@pytest.mark.parametrize("check, fn, words", [
    (check_average_gradients, grads_float32_assigned, ("own dtype", "another dtype")),
    (check_ring_all_reduce, ring_buffer_of_the_sent_chunk, ("buffer of its size",
                                                            "(r - s - 1) mod n"))])
def test_more_mistakes_named(check, fn, words):
    fails(check, fn, *words)
