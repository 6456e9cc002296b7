"""Checkers for Chapter 10 (tensor and sequence parallelism).

Each runs the learner's code on real ranks (``course_utils.dist.launch``, gloo
on CPU ranks on any machine, with a timeout) and judges what it does:

- 10.1: head-parallel attention on 2 and 3 ranks with odd sizes (float32 and
  float64): output, ``x.grad`` and weight gradients against one process, and
  which heads each rank really computed (from its weight gradients);
- 10.2: a tensor-parallel plan for a Llama-style model (grouped-query
  attention, SwiGLU) on 2 ranks, with and without sequence parallelism: loss
  and every gradient against one process, every linear sharded, plain full
  logits, and the collectives inside the blocks (``layers.<i>``, so that the
  embedding and the output layer may be split either way) counted by
  CommDebugMode in the forward and the backward: one per sublayer each way;
- 10.3: predicted collective counts against the counts of real training steps
  of the same model under section 3's one-style-per-linear plan at depths 1
  and 3 (measured once, then cached).

The ``_*_rank`` functions take a list of answers, so that the tests can judge
many answers in one launch; the checkers pass one. Every launch runs its ranks
in a group whose collectives give up after ``WAIT_RATIO`` times the reference
solution's check (``answer_limit``), so that an answer whose ranks wait for
each other gets its verdict in seconds, not at the launch's limit.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import (
    answer_limit,
    call_in_time,
    fail,
    passed,
    require_solution,
    stuck,
)
from course_utils.traces import Collectives

STORE_S = 600  # the rendezvous store's own wait: the launch's limit ends a hang first
# how long a rank waits in one collective for its peers, in reference checks
# (answer_limit): the ranks do the same work in step, so a wait this long
# means a collective nobody else calls
WAIT_RATIO = 1.5
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _in_group(rank: int, world_size: int, rank_fn: Callable, wait_s: float,
              *args):
    """``rank_fn`` in a gloo group whose collectives give up after ``wait_s``.

    The ranks meet first through a store that waits as long as the launch
    (on a busy machine one rank may start seconds after another); only then
    is the group made with the short wait.
    """
    import os
    import time

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=STORE_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=wait_s))
    value = rank_fn(rank, world_size, *args)
    dist.destroy_process_group()
    store.add("finished", 1)
    while rank == 0 and store.add("finished", 0) < world_size:
        time.sleep(0.01)  # rank 0 serves the store: it leaves last
    return value


SIZE_MISMATCH = "Received data size doesn't match expected size"
MISMATCH_HINTS = {
    "10.2": " (the checker's batch is 3 rows, its sequence 8 tokens, on 2 "
            "ranks). Sequence parallelism shards the sequence, dimension 1: "
            "Shard(1) between the sublayers and SequenceParallel() on the norms "
            "(its sequence_dim=1)",
}


def _run(exercise: str, rank_fn: Callable, world_size: int, args: tuple,
         calls: int = 1) -> list:
    """Launch ``rank_fn`` on ``world_size`` gloo ranks; a failure becomes a message.

    ``calls`` answers run in the launch: it may take their share of
    ``answer_limit`` and one collective's wait."""
    wait_s = answer_limit(exercise, ratio=WAIT_RATIO)
    timeout = answer_limit(exercise, calls) + wait_s
    hang = ("a rank waited in a collective that another rank never called: every "
            "rank must call the same collectives, in the same order")
    try:
        return [r.value for r in launch(_in_group, world_size,
                                        args=(rank_fn, wait_s, *args),
                                        timeout=timeout, init=False,
                                        backend="gloo", echo=False)]
    except RankFailed as e:
        first = str(e).splitlines()[0]
        if SIZE_MISMATCH in str(e):  # gloo aborts the rank: the cause is in its output
            fail(exercise, "every rank to finish",
                 f"{first[:160]}: {SIZE_MISMATCH} in a collective",
                 "the ranks sent tensors of different sizes to one collective: a "
                 "dimension that the ranks do not divide evenly was sharded"
                 + MISMATCH_HINTS.get(exercise, ""))
        fail(exercise, "every rank to finish", first[:200],
             hang if _waited(first) else
             "every rank must call the same collectives, in the same order")
    except LaunchTimeout as e:
        fail(exercise, "every rank to finish",
             f"your answer did not finish: {stuck(e)}", hang)


def _error(e: Exception) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:300]


# ---------------------------------------------------------------- exercise 10.1

# (world size, batch, seq, heads, head width, dtype, seed): odd sizes; 3 heads
# per rank on 2 ranks, 2 on 3 (a head count per rank written as a number shows)
ATTENTION_CASES = ((2, 3, 5, 6, 5, torch.float32, 0),
                   (3, 2, 7, 6, 5, torch.float64, 1))


def _attention_inputs(case):
    _, b, s, n_heads, head_dim, dtype, seed = case
    dim = n_heads * head_dim
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, dim, generator=g, dtype=dtype)
    weights = [torch.randn(dim, dim, generator=g, dtype=dtype) / math.sqrt(dim)
               for _ in range(4)]
    grad_out = torch.randn(b, s, dim, generator=g, dtype=dtype)
    return x, weights, grad_out


def one_process_attention(x, wq, wk, wv, wo, n_heads):
    """Causal multi-head self-attention in one process: the reference."""
    b, s, dim = x.shape
    q, k, v = (F.linear(x, w).view(b, s, n_heads, dim // n_heads).transpose(1, 2)
               for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(1, 2).reshape(b, s, dim), wo)


def _attention_variant(x, weights, n_heads, **sdpa) -> torch.Tensor:
    """One process's attention with other options of the attention kernel."""
    wq, wk, wv, wo = weights
    b, s, dim = x.shape
    q, k, v = (F.linear(x, w).view(b, s, n_heads, dim // n_heads).transpose(1, 2)
               for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, **sdpa)
    return F.linear(out.transpose(1, 2).reshape(b, s, dim), wo)


def _output_hint(out, x, weights, n_heads: int, world: int, dtype) -> str:
    """What a wrong output equals, as a hint."""
    if _close(out, _attention_variant(x, weights, n_heads), dtype):
        return ("every token attends to later tokens too: the attention is "
                "causal (is_causal=True)")
    dim = x.shape[-1]
    for width in {dim // world, dim, n_heads // world}:
        if width and _close(out, _attention_variant(
                x, weights, n_heads, is_causal=True, scale=width ** -0.5), dtype):
            return (f"the scores are scaled by 1/sqrt({width}): the scale is "
                    "1/sqrt(head width), which the split leaves unchanged")
    return ("rank r's heads are rows r*dim/world:(r+1)*dim/world of wq, wk and wv "
            "and the same columns of wo; reshape with view(b, s, -1, head_dim)")


def _attention_rank(rank: int, world_size: int, fns: list, case) -> list:
    results = []
    x, weights, grad_out = _attention_inputs(case)
    for fn in fns:
        xs = x.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in weights]
        forward, backward = Collectives(), Collectives()
        try:
            with forward:
                out = fn(xs, *ws, case[3])
            if not isinstance(out, torch.Tensor):
                results.append({"error": f"it returned a {type(out).__name__}"})
                continue
            if out.requires_grad and out.shape == grad_out.shape:
                with backward:
                    (out * grad_out).sum().backward()
            results.append({"out": out.detach(), "x_grad": xs.grad,
                            "w_grads": [w.grad for w in ws],
                            "requires_grad": out.requires_grad,
                            "forward": forward.counts, "backward": backward.counts})
        except Exception as e:  # both ranks raise alike: no collective is left waiting
            results.append({"error": _error(e)})
    return results


def _close(a, b, dtype) -> bool:
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.double(), b.double(), rtol=tol, atol=tol))


def _heads_used(grads, n_heads: int, head_dim: int) -> set:
    """The heads whose slices of wq, wk, wv (rows) or wo (columns) got gradient."""
    used = set()
    for i, g in enumerate(grads):
        if g is None:
            continue
        per_head = (g if i < 3 else g.t()).reshape(n_heads, head_dim, -1)
        used |= {h for h in range(n_heads) if per_head[h].abs().max() > 0}
    return used


def judge_attention(ranks: list[dict], case) -> None:
    """Fail with the mistake made, for one world size's results of one answer."""
    ex = "10.1"
    world, b, s, n_heads, head_dim, dtype, _ = case
    dim = n_heads * head_dim
    where = (f"{world} ranks, {n_heads} heads of width {head_dim}, x {b}x{s}x{dim} "
             f"{str(dtype).replace('torch.', '')}")
    x, weights, grad_out = _attention_inputs(case)
    xr = x.clone().requires_grad_()
    wr = [w.clone().requires_grad_() for w in weights]
    ref = one_process_attention(xr, *wr, n_heads)
    (ref * grad_out).sum().backward()
    for rank, r in enumerate(ranks):
        if "error" in r:
            err = r["error"]
            hint = ("reshape with this rank's head count: view(b, s, -1, head_dim), "
                    "or n_heads // world_size heads"
                    if "invalid for input of size" in err else
                    "rank r's heads are rows of wq, wk and wv but columns of wo "
                    "(wo[:, mine]): the output projection is row-parallel"
                    if "mat1 and mat2" in err else
                    "every rank must call the same collectives, in the same order: "
                    "a peer left while this rank still waited in one"
                    if "by peer" in err or "imed out" in err else
                    "keep every tensor in x's dtype (x.dtype): the checker also "
                    "runs float64" if "dtype" in err.lower() or "cast" in err
                    else "fix that error and run the exercise cell again")
            fail(ex, f"the function to run ({where})",
                 f"rank {rank}: {r['error']}", hint)
        if tuple(r["out"].shape) != (b, s, dim):
            fail(ex, f"an output of shape {(b, s, dim)} on every rank ({where})",
                 f"shape {tuple(r['out'].shape)} on rank {rank}",
                 "return the full output (all heads, summed over the ranks), not "
                 "this rank's slice")
        if r["out"].dtype != dtype:
            fail(ex, f"an output in x's dtype, {dtype} ({where})",
                 f"{r['out'].dtype} on rank {rank}",
                 "keep every tensor in x's dtype (x.dtype): the checker also runs "
                 "float64")
        if not r["requires_grad"]:
            fail(ex, f"an output that autograd can differentiate ({where})",
                 "an output with requires_grad=False",
                 "use the weights and x themselves (no .detach(), .data or "
                 "torch.no_grad()), and an autograd Function around the all-reduce")
    names = ("wq", "wk", "wv", "wo")
    for rank, r in enumerate(ranks):
        for name, g in zip(names, r["w_grads"], strict=True):
            if g is None:
                fail(ex, f"a gradient for {name} on every rank ({where})",
                     f"{name}.grad is None on rank {rank}",
                     "slice the weights themselves (w[rows]), without .detach(), "
                     ".data or a copy, so that the gradient reaches them")
    heads = [_heads_used(r["w_grads"], n_heads, head_dim) for r in ranks]
    for rank, used in enumerate(heads):
        if len(used) != n_heads // world:
            fail(ex, f"{n_heads // world} of the {n_heads} heads computed on each "
                 f"rank ({where})", f"rank {rank} used the weights of "
                 f"{len(used)} heads: {sorted(used)}",
                 "split the heads by dist.get_world_size(): each rank computes "
                 "n_heads / world_size heads, and only those")
    if set().union(*heads) != set(range(n_heads)):
        fail(ex, f"every head computed by one rank ({where})",
             f"heads per rank {[sorted(h) for h in heads]}",
             "rank r takes the r-th block of heads (use dist.get_rank())")
    outs = [r["out"] for r in ranks]
    total = sum(o.double() for o in outs)
    for rank, out in enumerate(outs):
        if _close(out, ref, dtype):
            continue
        if _close(total, ref, dtype):
            fail(ex, f"the full attention output on every rank ({where})",
                 f"rank {rank} returned its own heads' partial sum",
                 "all-reduce the output projection's partial sums (the g operator: "
                 "all-reduce forward, identity backward)")
        if _close(out, world * ref, dtype):
            fail(ex, f"the attention output ({where})",
                 f"{world} times the output on rank {rank}",
                 "each rank must compute only its own heads before the all-reduce "
                 "sums them")
        fail(ex, f"the attention output equal to one process ({where})",
             f"a largest difference of {(out.double() - ref.double()).abs().max():.3g}"
             f" on rank {rank}", _output_hint(out, x, weights, n_heads, world, dtype))
    for rank, r in enumerate(ranks):
        gx = r["x_grad"]
        if gx is None:
            fail(ex, f"x.grad on every rank ({where})", f"None on rank {rank}",
                 "compute from x itself so that the gradient reaches it")
        if _close(gx, xr.grad, dtype):
            continue
        if _close(gx, world * xr.grad, dtype):
            fail(ex, f"x.grad equal to one process ({where})",
                 f"{world} times it on rank {rank}",
                 "the backward of the output's all-reduce must pass the gradient "
                 "through unchanged (identity); only the f operator, where x enters, "
                 "all-reduces gradients")
        fail(ex, f"x.grad equal to one process on every rank ({where})",
             f"rank {rank}'s x.grad is only its own heads' share",
             "wrap x in the f operator (identity forward, all-reduce of the "
             "gradient backward) before the projections")
    for i, name in enumerate(names):
        total = sum(r["w_grads"][i].double() for r in ranks)
        if _close(total, wr[i].grad, dtype):
            continue
        seen = (f"{world} times the gradient"
                if _close(total, world * wr[i].grad, dtype) else "another gradient")
        fail(ex, f"{name}'s gradient, summed over the ranks, equal to one process "
             f"({where})", seen,
             "the output all-reduce's backward is the identity: a second "
             "all-reduce there multiplies every gradient by the world size")


    for rank, r in enumerate(ranks):
        for way, hint in (
                ("forward", "sum the partial outputs of all this rank's heads "
                 "through its columns of wo first, then all-reduce once (the g "
                 "operator)"),
                ("backward", "x's gradient is summed over the ranks once: apply "
                 "the f operator to x once, before the three projections, not to "
                 "each")):
            counts = r[way]
            if counts != {"all-reduce": 1}:
                seen = ", ".join(f"{n} {name}{'s' if n > 1 else ''}"
                                 for name, n in sorted(counts.items())) or "none"
                fail(ex, f"one all-reduce in the {way} on every rank ({where})",
                     f"{seen} on rank {rank}", hint)


def _check_attention_answers(fns: list, world_size: int) -> list[list[dict]]:
    """Run several answers at one world size; per answer, each rank's result."""
    case = next(c for c in ATTENTION_CASES if c[0] == world_size)
    ranks = _run("10.1", _attention_rank, world_size, (fns, case), len(fns))
    return [[ranks[r][i] for r in range(world_size)] for i in range(len(fns))]


def check_head_parallel_attention(head_parallel_attention: Callable) -> None:
    """Exercise 10.1: attention split by heads, equal to one process both ways."""
    ex = "10.1"
    require_solution(ex, head_parallel_attention)
    for case in ATTENTION_CASES:
        answer = _check_attention_answers([head_parallel_attention], case[0])[0]
        judge_attention(answer, case)
    passed(ex, "2 and 3 ranks, float32 and float64: output and gradients equal "
               "to one process, each head computed by one rank, one all-reduce "
               "each way.")


# ---------------------------------------------------------------- exercise 10.2

class _LlamaAttention(nn.Module):
    """Grouped-query attention: ``n_kv_heads`` key/value heads shared by the queries."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = _LlamaAttention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = _SwiGLU(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaLike(nn.Module):
    """Exercise 10.2's model: RMSNorm, grouped-query attention, SwiGLU; no position
    embedding."""

    def __init__(self, vocab: int = 40, dim: int = 24, n_heads: int = 4,
                 n_kv_heads: int = 2, hidden: int = 36, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_LlamaBlock(dim, n_heads, n_kv_heads, hidden)
                                    for _ in range(n_layers))
        self.final_norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_norm(x))


def exercise_model() -> LlamaLike:
    """The model of Exercise 10.2, with its default sizes (to print)."""
    torch.manual_seed(0)
    return LlamaLike()


SHARDED = ("attention.q_proj", "attention.k_proj", "attention.v_proj",
           "attention.out_proj", "feed_forward.gate", "feed_forward.up",
           "feed_forward.down")


def _short(op) -> str:
    """'all_gather' for c10d_functional.all_gather_into_tensor and its kin."""
    return str(op).split(".")[-1].replace("_into_tensor", "").replace(
        "_tensor", "").replace("_base", "")


def _counts(mode) -> dict[str, int]:
    short: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        short[_short(op)] = short.get(_short(op), 0) + n
    return short


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _block_counts(mode) -> dict[str, dict[str, int]]:
    """Collectives inside the blocks (modules named ``layers.<i>``), per pass."""
    total = {"forward": dict.fromkeys(COLLECTIVES, 0),
             "backward": dict.fromkeys(COLLECTIVES, 0)}
    for fqn, passes in mode.comm_module_counts.items():
        if not re.search(r"(^|\.)layers\.\d+$", fqn):
            continue
        for which in total:
            for op, n in passes.get(which, {}).items():
                name = _short(op)
                if name in total[which]:
                    total[which][name] += n
    return total


def _plan_rank(rank: int, world_size: int, fns: list, seed: int = 0) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    warnings.filterwarnings("ignore", message=".*Full backward hook")
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(seed)
    tokens, targets = torch.randint(0, 40, (2, 3, 8), generator=g)
    torch.manual_seed(seed)
    ref = LlamaLike()
    ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    results = []
    for fn in fns:
        per_mode = {}
        for sp in (False, True):
            try:
                torch.manual_seed(seed)
                model = LlamaLike()
                returned = fn(model, mesh, sp)
                if isinstance(returned, nn.Module):
                    model = returned
                params = dict(model.named_parameters())
                sharded = {}
                for i in range(len(model.layers)):
                    for name in SHARDED:
                        p = params[f"layers.{i}.{name}.weight"]
                        sharded[f"layers.{i}.{name}"] = (
                            isinstance(p, DTensor)
                            and p.to_local().numel() < p.numel())
                with CommDebugMode() as step:
                    logits = model(tokens)
                    kind = type(logits).__name__
                    shape = tuple(logits.shape)
                    local = tuple(logits.to_local().shape) if isinstance(
                        logits, DTensor) else shape
                    loss = None
                    if local[-1] == ref.output.out_features:
                        loss = F.cross_entropy(_full(logits).flatten(0, 1),
                                               targets.flatten())
                        loss.backward()
                r = {"kind": kind, "is_dtensor": isinstance(logits, DTensor),
                     "shape": shape, "local_shape": local, "sharded": sharded,
                     "layers": len(model.layers),
                     "ref_loss": ref_loss.item(), "blocks": _block_counts(step)}
                if loss is not None:
                    r["loss"] = loss.item()
                    r["grad_diffs"] = {
                        n: (float("inf") if p.grad is None
                            or _full(p.grad).shape != ref_grads[n].shape else
                            (_full(p.grad) - ref_grads[n]).abs().max().item())
                        for n, p in params.items()}
                per_mode[sp] = r
            except Exception as e:
                per_mode[sp] = {"error": _error(e)}
                if _waited(per_mode[sp]["error"]):  # the other mode would wait too
                    per_mode[not sp] = per_mode[sp]
                    break
        results.append(per_mode)
    return results


def _waited(err: str) -> bool:
    """Whether an error says a rank gave up waiting in a collective."""
    return any(k in err for k in ("imed out", "imeout", "by peer"))


def _error_hint(err: str, sp: bool, other_ran: bool) -> str:
    """The hint for an error, from what the answer did in the other mode too."""
    if _waited(err):
        return ("a rank waited in a collective that another rank never called: "
                "every rank must run the same plan and call the same collectives, "
                "in the same order")
    if "batch_size" in err:
        return ("under sequence parallelism the embedding must return sequence "
                "shards: RowwiseParallel(input_layouts=Replicate(), "
                "output_layouts=Shard(1)) on tok_embeddings, so that the norms get "
                "what SequenceParallel expects")
    shape_error = any(k in err for k in ("mat1 and mat2", "size of tensor a",
                                         "reduction dim", "shape", "invalid for "))
    if shape_error and sp and other_ran:
        return ("your plan runs without sequence parallelism, so its pairing is "
                "right; under SP attention and the feed-forward still need the whole "
                "sequence: PrepareModuleInput from Shard(1) to Replicate() on each "
                "gathers it once")
    if shape_error:
        return ("a row-parallel layer takes the column-parallel output as it is "
                "(sharded on the last dimension): pair ColwiseParallel on q, k, v, "
                "gate and up with RowwiseParallel on out_proj and down")
    if sp and ("being sharded" in err or "without redistribution" in err):
        # a view of a sequence-sharded activation (torch 2.11 refuses to flatten
        # it; 2.13 runs on, and the missing all-gathers show in the counts)
        return ("under SP attention and the feed-forward still need the whole "
                "sequence: gather it once before attention and once before the "
                "feed-forward (PrepareModuleInput from Shard(1) to Replicate()), "
                "one all-gather per sublayer")
    if "mixed torch.Tensor and DTensor" in err:
        return ("a DTensor met a plain tensor: every linear on the way needs a "
                "style, and under SP the sequence must be gathered before a "
                "replicated input")
    return ("the error above came from running the model after your plan: read "
            "its last line, then compare your plan with the chapter's "
            "parallelize_gpt")


def judge_plan(per_mode: dict) -> None:
    """Fail with the mistake made, from one answer's results on rank 0."""
    ex = "10.2"
    for sp in (False, True):
        r = per_mode[sp]
        mode = f"sequence_parallel={sp}"
        if "error" in r:
            fail(ex, f"the plan to run ({mode})", r["error"],
                 _error_hint(r["error"], sp, "error" not in per_mode[not sp]))
        flat = [n for n, ok in r["sharded"].items() if not ok]
        if flat:
            fail(ex, f"every linear inside the blocks sharded ({mode})",
                 f"{flat[0]}.weight is a full copy on every rank"
                 + (f" (and {len(flat) - 1} more)" if len(flat) > 1 else ""),
                 "give it a ColwiseParallel or RowwiseParallel style in the plan")
        vocab = LlamaLike().output.out_features
        if r["local_shape"][-1] != vocab:
            fail(ex, f"full logits, (batch, seq, {vocab}), on every rank ({mode})",
                 f"logits of local shape {r['local_shape']}",
                 "the output layer returned this rank's slice of the vocabulary: "
                 "ColwiseParallel(output_layouts=Replicate()) on the output layer "
                 "gathers the full logits")
        if r["is_dtensor"]:
            fail(ex, f"the logits as a plain torch.Tensor ({mode})",
                 f"a {r['kind']} of placements you would have to unwrap",
                 "keep use_local_output=True (the default) on the output layer, so "
                 "that the model returns a plain tensor")
        n = r["layers"]
        if abs(r["loss"] - r["ref_loss"]) > 1e-5:
            fail(ex, f"the loss of one process, {r['ref_loss']:.6f} ({mode})",
                 f"{r['loss']:.6f}",
                 "under sequence parallelism attention and the feed-forward need "
                 "the whole sequence: PrepareModuleInput from Shard(1) to "
                 "Replicate() on each (the embedding's output_layouts=Shard(1) "
                 "starts the sharded stream)" if sp else
                 "pair ColwiseParallel (q, k, v, gate, up) with RowwiseParallel "
                 "(out_proj, down), and leave the norms alone")
        bad = {k: v for k, v in r["grad_diffs"].items() if not v <= 1e-5}
        if bad:
            first = next(iter(bad))
            norms = all("norm" in k for k in bad)
            fail(ex, f"every gradient equal to one process ({mode})",
                 f"{first} differs by {bad[first]:.3g}"
                 + (f" ({len(bad)} parameters differ)" if len(bad) > 1 else ""),
                 "each rank's norm saw only its part of the sequence, so its weight "
                 "gradient is a share: mark the norms SequenceParallel() so that "
                 "DTensor sums it" if norms and sp else
                 "compare your plan with the chapter's parallelize_gpt")
        fwd, bwd = r["blocks"]["forward"], r["blocks"]["backward"]
        if not sp:
            if fwd["all_gather"] or fwd["reduce_scatter"]:
                fail(ex, f"no all-gather inside the blocks ({mode})",
                     f"{fwd['all_gather']} all-gathers and {fwd['reduce_scatter']} "
                     f"reduce-scatters in the {n} blocks' forward",
                     "a column-parallel layer should hand its sharded output to a "
                     "row-parallel one, not gather it: RowwiseParallel on out_proj "
                     "and down, default outputs on the others")
            if fwd["all_reduce"] != 2 * n:
                fail(ex, f"one all-reduce per attention and per feed-forward in the "
                     f"forward, {2 * n} in {n} blocks ({mode})",
                     f"{fwd['all_reduce']}",
                     "each sublayer is one column-parallel step and one "
                     "row-parallel step")
            if bwd["all_reduce"] != 2 * n or bwd["all_gather"] or bwd[
                    "reduce_scatter"]:
                fail(ex, f"one all-reduce per attention and per feed-forward in the "
                     f"backward, {2 * n} in {n} blocks ({mode})",
                     f"{bwd['all_reduce']} all-reduces, {bwd['all_gather']} "
                     f"all-gathers, {bwd['reduce_scatter']} reduce-scatters",
                     "each column-parallel linear that turns a plain input into a "
                     "DTensor all-reduces that input's gradient on its own (q, k, v: "
                     "three). Hand attention and the feed-forward one replicated "
                     "DTensor instead (PrepareModuleInput with desired "
                     "Replicate(), keeping the DTensor): their gradients then add "
                     "up locally and one all-reduce closes the sublayer"
                     if bwd["all_reduce"] > 2 * n else
                     "every column-parallel linear's input gradient must be summed "
                     "over the ranks once")
        else:
            if fwd["all_reduce"] or bwd["all_reduce"]:
                fail(ex, f"no all-reduce inside the blocks ({mode})",
                     f"{fwd['all_reduce']} in the forward, {bwd['all_reduce']} in "
                     "the backward",
                     "with sequence parallelism the row-parallel layers return "
                     "sequence shards (output_layouts=Shard(1)), a reduce-scatter "
                     "instead of an all-reduce")
            if fwd["reduce_scatter"] != 2 * n:
                fail(ex, f"one reduce-scatter per attention and per feed-forward, "
                     f"{2 * n} in {n} blocks ({mode})",
                     f"{fwd['reduce_scatter']} reduce-scatters in the forward",
                     "RowwiseParallel(output_layouts=Shard(1)) on out_proj and down")
            if fwd["all_gather"] != 2 * n or bwd["reduce_scatter"] != 2 * n:
                fail(ex, f"one all-gather per sublayer in the forward and one "
                     f"reduce-scatter per sublayer in the backward, {2 * n} each "
                     f"in {n} blocks ({mode})",
                     f"{fwd['all_gather']} all-gathers forward, "
                     f"{bwd['reduce_scatter']} reduce-scatters backward",
                     "gather the sequence once before attention and once before "
                     "the feed-forward (PrepareModuleInput), not once per linear")


def _check_plan_answers(fns: list) -> list[dict]:
    ranks = _run("10.2", _plan_rank, 2, (fns,), len(fns))
    return ranks[0]


def check_parallelize_plan(parallelize_llama: Callable) -> None:
    """Exercise 10.2: a TP (and TP+SP) plan, equal to one process, counted."""
    ex = "10.2"
    require_solution(ex, parallelize_llama)
    judge_plan(_check_plan_answers([parallelize_llama])[0])
    passed(ex, "TP and TP+SP on 2 ranks: loss and gradients equal to one process, "
               "every linear sharded, one collective per sublayer each way.")


# ---------------------------------------------------------------- exercise 10.3

def _parallelize_per_linear(model, mesh, sequence_parallel: bool,
                            loss_parallel: bool):
    """Section 3's plan on the Llama-style model: one style per linear."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1)
    between = seq if sequence_parallel else Replicate()
    plan = {name: ColwiseParallel() for name in (
        "attention.q_proj", "attention.k_proj", "attention.v_proj",
        "feed_forward.gate", "feed_forward.up")}
    plan |= {"attention.out_proj": RowwiseParallel(output_layouts=between),
             "feed_forward.down": RowwiseParallel(output_layouts=between)}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(seq,),
                                    desired_input_layouts=(Replicate(),))
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                 "attention": gather, "feed_forward": gather}
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                             output_layouts=between),
           "output": ColwiseParallel(
               input_layouts=between,
               output_layouts=Shard(-1) if loss_parallel else Replicate(),
               use_local_output=not loss_parallel)}
    if sequence_parallel:
        top["final_norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    return model


DEPTHS = (1, 3)
# depths asked but not measured: every block adds the same collectives, so the
# counts there follow from the two measured depths (a table of the measured
# depths, or a formula that only fits them, shows)
EXTRA_DEPTHS = (2, 6)
MODES = tuple((sp, lp) for sp in (False, True) for lp in (False, True))


def _counts_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    warnings.filterwarnings("ignore", message=".*Full backward hook")
    mesh = init_device_mesh("cpu", (world_size,))
    tokens, targets = torch.randint(0, 40, (2, 1, 4),
                                    generator=torch.Generator().manual_seed(0))
    measured = {}
    for depth in DEPTHS:
        for sp, lp in MODES:
            torch.manual_seed(0)
            model = _parallelize_per_linear(LlamaLike(n_layers=depth), mesh, sp, lp)
            with CommDebugMode() as step:
                with CommDebugMode() as fwd:
                    logits = model(tokens)
                if lp:
                    with loss_parallel():
                        F.cross_entropy(logits.flatten(0, 1),
                                        targets.flatten()).backward()
                else:
                    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            measured[(depth, sp, lp)] = (_counts(step), _counts(fwd))
    return measured


@functools.lru_cache(maxsize=1)
def measured_counts() -> dict:
    """{(depth, sp, lp): (step counts, forward counts)}, measured once on 2 ranks."""
    return _run("10.3", _counts_rank, 2, ())[0]


def _as_counts(ex: str, got, case: str) -> dict[str, int]:
    if not isinstance(got, dict):
        fail(ex, f"a dict of counts ({case})", f"a {type(got).__name__}: {got!r:.80}",
             'return {"all_reduce": ..., "all_gather": ..., "reduce_scatter": ...}')
    extra = [k for k, v in got.items() if k not in COLLECTIVES and v]
    if extra:
        fail(ex, f"only the keys {', '.join(COLLECTIVES)} ({case})",
             f"the key {extra[0]!r}", "name the collectives as the chapter's table")
    counts = {}
    for c in COLLECTIVES:
        v = got.get(c, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
            fail(ex, f"a whole number for {c} ({case})", f"{v!r:.40}")
        counts[c] = int(v)
    return counts


def _counts_hint(got: dict, depth: int, sp: bool, lp: bool, measured: dict,
                 answers: dict) -> str:
    """The mistake behind a wrong prediction, judged from what it predicted."""
    def want(d=depth, s=sp, p=lp):
        step = measured[(d, s, p)][0] if d in DEPTHS else None
        return None if step is None else {c: step.get(c, 0) for c in COLLECTIVES}

    right = want()
    per_block = {c: (want(DEPTHS[1])[c] - want(DEPTHS[0])[c])
                 // (DEPTHS[1] - DEPTHS[0]) for c in COLLECTIVES}
    if all(answers[(d, sp, lp)] == got for d in DEPTHS):
        return ("the same counts at every depth: each block adds its own "
                "collectives, so the counts grow with n_layers")
    if got == {c: right[c] + per_block[c] for c in COLLECTIVES}:
        return ("one block too many: the step has n_layers blocks, plus the "
                "embedding and the output layer once each")
    if got == {c: right[c] - per_block[c] for c in COLLECTIVES}:
        return ("one block too few: each of the n_layers blocks has its own "
                "collectives")
    if got == {c: 2 * right[c] for c in COLLECTIVES}:
        return ("twice the count: CommDebugMode counts what one rank calls, and "
                "every rank calls each collective once (a collective is one call "
                "per rank, not one per pair of ranks)")
    if got == {c: measured[(depth, sp, lp)][1].get(c, 0) for c in COLLECTIVES}:
        return ("those are the forward's collectives only: the backward has its own "
                "(each column-parallel input's gradient, and under SP each "
                "all-gather's reduce-scatter and the reverse)")
    without_lp = want(depth, sp, False)
    if lp and answers.get((depth, sp, False)) == without_lp and got != right and all(
            got[c] == right[c] for c in COLLECTIVES if c != "all_reduce"):
        return (f"right without loss_parallel; with it, {right['all_reduce']} "
                "all-reduces: loss_parallel adds three small ones in the "
                "cross-entropy (maximum, sum of exponentials, target logit) to "
                "what the plan has without it")
    if lp and got["all_gather"] > right["all_gather"]:
        return ("loss_parallel keeps the logits sharded by vocabulary: no "
                "all-gather of the logits, and three small all-reduces in the "
                "cross-entropy")
    if not lp and got["all_reduce"] == right["all_reduce"] + 3:
        return "loss_parallel's three all-reduces only come with loss_parallel"
    if lp and got["all_reduce"] == right["all_reduce"] - 3:
        return ("loss_parallel computes the cross-entropy on vocabulary shards: "
                "three small all-reduces (maximum, sum of exponentials, target "
                "logit)")
    if not sp and got["all_reduce"] == right["all_reduce"] - depth:
        return ("the feed-forward has two column-parallel linears here, gate and "
                "up, and attention three: each all-reduces its input's gradient in "
                "the backward")
    if not sp and got["all_reduce"] < right["all_reduce"]:
        return ("q, k, v, gate and up are separate column-parallel linears, each "
                "turning the plain input into its own DTensor: each all-reduces "
                "that input's gradient in the backward (five per block)")
    if sp and got["reduce_scatter"] > right["reduce_scatter"]:
        return ("under SP the all-reduces do not each become a reduce-scatter and "
                "an all-gather: the gathered input of attention (and of the "
                "feed-forward) is one DTensor, so q's, k's and v's gradients add up "
                "locally and one reduce-scatter closes the sublayer")
    if sp and got["all_reduce"] > right["all_reduce"]:
        return ("under sequence parallelism no all-reduce is left in the blocks: "
                "every row-parallel output is a reduce-scatter")
    if sum(got.values()) == sum(right.values()):
        return "the right total, in the wrong kinds: which collective is each?"
    return "count the forward's collectives, then what each becomes backward"


def check_predicted_counts(predict_collectives: Callable) -> None:
    """Exercise 10.3: collectives per training step, predicted, then measured."""
    ex = "10.3"
    require_solution(ex, predict_collectives)
    measured = measured_counts()
    answers = {}
    for depth, sp, lp in measured:
        case = f"n_layers={depth}, sequence_parallel={sp}, loss_parallel={lp}"
        got = call_in_time(ex, predict_collectives, depth, sp, lp)
        answers[(depth, sp, lp)] = _as_counts(ex, got, case)
    for (depth, sp, lp), (step, _) in measured.items():
        case = f"n_layers={depth}, sequence_parallel={sp}, loss_parallel={lp}"
        got, want = answers[(depth, sp, lp)], {c: step.get(c, 0) for c in COLLECTIVES}
        if got != want:
            fail(ex, f"{want} ({case}, measured on 2 ranks)", f"{got}",
                 _counts_hint(got, depth, sp, lp, measured, answers))
    low, high = DEPTHS
    for depth in EXTRA_DEPTHS:
        for sp, lp in MODES:
            case = f"n_layers={depth}, sequence_parallel={sp}, loss_parallel={lp}"
            first, last = (measured[(d, sp, lp)][0] for d in DEPTHS)
            want = {c: first.get(c, 0) + (last.get(c, 0) - first.get(c, 0))
                    * (depth - low) // (high - low) for c in COLLECTIVES}
            got = _as_counts(
                ex, call_in_time(ex, predict_collectives, depth, sp, lp), case)
            if got != want:
                fail(ex, f"{want} ({case}: each block adds the same collectives as "
                     f"from depth {low} to {high})", f"{got}",
                     "right at the measured depths only: write the counts as a "
                     "rule in n_layers (what the embedding and the output layer "
                     "pay once, plus the same per block), not a table")
    passed(ex, f"{len(measured)} configurations at depths {DEPTHS}, and depths "
               f"{EXTRA_DEPTHS} from the same rule: every count predicted.")
