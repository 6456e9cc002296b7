"""Checkers for Chapter 9 (sharded data parallelism).

9.1 and 9.3 run the learner's code in real processes: one launch of 5 ranks
that form two independent process groups, of 2 and of 3 ranks (keys apart in
one store), so both world sizes are tried at once, with float32, float64 and
bfloat16 tensors of odd sizes, and one shape called twice with other values
(state kept across calls shows). 9.1 compares the output, the input's
gradient and each rank's shard gradients with one process, and names
everything the forward keeps for backward besides x and the shards (saved
tensors and tensors on ``ctx``), in every case, and watches x and the shards
for any change. 9.3 compares the returned
norm and the shards, scaled in place, with ``clip_grad_norm_``'s rule. 9.2 is
a pure function, tried on many world sizes, dtypes and odd shapes; the
checkpoint it is given is watched for any change.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import time
import warnings
import weakref
from datetime import timedelta

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import (
    answer_limit,
    call_in_time,
    fail,
    is_placeholder,
    passed,
    require_solution,
    stuck,
)

STORE_S = 600  # the rendezvous store's own wait: the launch's limit ends a hang first
WAIT_RATIO = 1.5  # a rank waits in one collective this many times the reference's check
GROUPS = ((0, 2), (2, 3))  # (first launched rank, world size): 2 and 3 ranks


def _padded_flat(t: torch.Tensor, n: int) -> torch.Tensor:
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % n)])


def _shard(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    return _padded_flat(t, n).chunk(n)[rank].clone()


# ---------------------------------------------------------------- exercise 9.1

# (out_features, in_features, rows, dtype, seed): odd sizes; a small layer
# whose weight is smaller than a rank's activations; float64 and bfloat16;
# the first shape again with other weights (a weight cached across calls
# shows there)
CASES_91 = ((13, 11, 3, torch.float32, 0), (64, 97, 2, torch.float32, 0),
            (5, 3, 4, torch.float64, 0), (7, 9, 5, torch.bfloat16, 0),
            (13, 11, 3, torch.float32, 1))
REPEATED_91 = {4: 0}  # case 4 has case 0's shape, with other weights


def _linear_problem(out_f: int, in_f: int, rows: int, dtype, seed: int, rank: int):
    g = torch.Generator().manual_seed(out_f * 1000 + in_f + 7919 * seed)
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    g.manual_seed(7 + 31 * rank + out_f + 101 * seed)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    c = torch.randn(rows, out_f, generator=g).to(dtype)  # the loss is (y * c).sum()
    return w, b, x, c


def _kept_for_backward(y, known: dict[str, torch.Tensor], own) -> list[tuple]:
    """What a custom autograd function's forward kept for its backward,
    besides the storages of ``own`` (its inputs): its saved tensors and any
    tensor put on ``ctx`` as an attribute (``ctx`` is the output's
    ``grad_fn``). Each as ``(what, bytes)``, ``what`` the name in ``known``
    whose values it equals, or its shape."""
    node = getattr(y, "grad_fn", None)
    if node is None:
        return []
    found: list = []

    def collect(v):
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            for item in v:
                collect(item)
        elif isinstance(v, dict):
            for item in v.values():
                collect(item)

    try:
        collect(node.saved_tensors)
    except RuntimeError:  # nothing saved, or already freed
        pass
    collect(list(getattr(node, "__dict__", {}).values()))
    seen = {t.untyped_storage().data_ptr() for t in own}
    kept = []
    for t in found:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        what = next((name for name, k in known.items() if t.shape == k.shape
                     and torch.equal(t.detach(), k.detach())), None)
        if what is None:
            what = next((f"{name} (transposed)" for name, k in known.items()
                         if k.dim() == 2 and t.shape == k.T.shape
                         and torch.equal(t.detach(), k.detach().T)),
                        f"a tensor of shape {tuple(t.shape)}")
        kept.append((what, storage.nbytes()))
    return kept


class _Made(TorchDispatchMode):
    """Every tensor the ops inside it return, held weakly: what is still
    alive afterwards was kept by someone (ctx, a global, a class attribute)."""

    def __init__(self):
        super().__init__()
        self.made: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor)]
        return out


def _still_alive(made: _Made, y, known: dict, found: list) -> list[tuple]:
    """Tensors made in forward and alive after it, besides the output and
    what ``found`` already names, as ``(what, bytes)``."""
    def alive():
        out_ptr = y.untyped_storage().data_ptr() if isinstance(y, torch.Tensor) \
            else None
        return [t for t in (r() for r in made.made) if t is not None
                and t.untyped_storage().data_ptr() != out_ptr]

    if not alive():
        return []
    gc.collect()  # a reference cycle is not a keeper
    by_storage: dict = {}  # a buffer and the views of it kept with it
    for t in alive():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    kept = []
    for views in by_storage.values():
        nbytes = views[0].untyped_storage().nbytes()
        what = next((name for t in views for name, k in known.items()
                     if t.shape == k.shape and torch.equal(t.detach(), k.detach())),
                    f"a tensor of shape {tuple(views[0].shape)}")
        if nbytes and what not in (w for w, _ in found):
            kept.append((what + " (outside ctx)", nbytes))
    return kept


def _linear_cases(fn, rank: int, n: int) -> list[dict]:
    """Every case of 9.1 for one class, on this rank of an n-rank group."""
    results = []
    for out_f, in_f, rows, dtype, seed in CASES_91:
        w, b, x, c = _linear_problem(out_f, in_f, rows, dtype, seed, rank)
        ws = _shard(w, rank, n).requires_grad_()
        bs = _shard(b, rank, n).requires_grad_()
        x = x.requires_grad_()
        given = {"x": x.detach().clone(), "the weight shard": ws.detach().clone(),
                 "the bias shard": bs.detach().clone()}
        with _Made() as made:
            y = fn.apply(x, ws, bs, out_f, in_f)
        known = {"x": x, "shard": ws, "bias shard": bs, "the gathered weight": w,
                 "the gathered bias": b,
                 "the output": y if isinstance(y, torch.Tensor) else x}
        kept = _kept_for_backward(y, known, (x, ws, bs))
        kept += _still_alive(made, y, known, kept)
        kept = [k for k in kept if k[0].removesuffix(" (outside ctx)") not in (
            "x", "shard", "bias shard")]  # copies of x and the shards: fine
        del made
        grad_out = {}  # the tensor backward receives, and a copy to compare

        def keep(g, grad_out=grad_out):
            grad_out.update(given=g, copy=g.detach().clone())

        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(keep)
            (y * c).sum().backward()
        changed = [name for name, t in zip(given, (x, ws, bs), strict=True)
                   if not torch.equal(t.detach(), given[name])]
        if grad_out and not torch.equal(grad_out["given"], grad_out["copy"]):
            changed.append("grad_out")
        results.append({
            "y": y.detach().clone() if isinstance(y, torch.Tensor) else y,
            "x.grad": None if x.grad is None else x.grad.clone(),
            "w.grad": None if ws.grad is None else ws.grad.clone(),
            "b.grad": None if bs.grad is None else bs.grad.clone(),
            "kept": kept,
            "changed": changed})
    return results


def _group_rank(launched: int, nprocs: int, cases, classes: list,
                wait_s: float) -> list:
    """One rank of one of the two groups, running ``cases(fn, rank, n)`` for
    every answer. The group is reused from answer to answer, and made anew
    after an answer that failed on any of its ranks, so that one answer's
    error cannot disturb the next."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    start, n = next(g for g in GROUPS if g[0] <= launched < g[0] + g[1])
    rank = launched - start
    # one store for the launch (the launcher's rendezvous port); prefixes keep
    # the groups' keys apart
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           nprocs, is_master=launched == 0,
                           timeout=timedelta(seconds=STORE_S))
    generation = 0

    def new_group():
        store = dist.PrefixStore(f"group{n}/generation{generation}", shared)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=wait_s))

    def wait_for(key, count):
        while shared.add(key, 0) < count:
            time.sleep(0.01)

    new_group()
    out = []
    for i, fn in enumerate(classes):
        failed = 0
        try:
            out.append((n, rank, cases(fn, rank, n)))
        except Exception as e:  # noqa: BLE001 - judged by the parent
            first = (str(e).splitlines() or [""])[0]
            out.append((n, rank, f"{type(e).__name__}: {first}"))
            failed = 1
        key = f"group{n}/answer{i}"
        shared.add(f"{key}/failed", failed)
        shared.add(f"{key}/done", 1)
        wait_for(f"{key}/done", n)
        if shared.add(f"{key}/failed", 0):
            dist.destroy_process_group()
            generation += 1
            new_group()
    dist.destroy_process_group()
    shared.add("finished", 1)
    if launched == 0:
        wait_for("finished", nprocs)  # rank 0 serves the store: it leaves last
    return out


_RUNS: dict = {}


def _run_groups(ex: str, cases, answers: list) -> None:
    """Run ``cases`` for several answers in one launch of both groups; keep
    what each did, by answer. A collective nobody else calls gives up after
    WAIT_RATIO times the reference's check; the launch, after the answers'
    share of ``answer_limit`` and one such wait each."""
    nprocs = sum(n for _, n in GROUPS)
    wait_s = answer_limit(ex, ratio=WAIT_RATIO)
    try:
        ranks = [r.value for r in launch(
            _group_rank, nprocs, args=(cases, list(answers), wait_s),
            timeout=answer_limit(ex, len(answers)) + wait_s * len(answers), init=False,
            echo=False, backend="gloo")]
    except RankFailed as e:
        ranks = str(e).splitlines()[0][:240]
    except LaunchTimeout as e:
        ranks = "your answer did not finish: " + stuck(e)[:400]
    for i, answer in enumerate(answers):
        _RUNS[cases, answer] = ranks if isinstance(ranks, str) else [
            r[i] for r in ranks]


def run_sharded_linear(classes: list) -> None:
    """Run 9.1's cases for several classes in one launch; keep what each did.

    ``check_sharded_linear`` then judges a class from these results instead of
    launching again (the checker tests use it: one launch for all answers).
    """
    _run_groups("9.1", _linear_cases, classes)


def _group_results(ex: str, cases, answer, what: str) -> list:
    if (cases, answer) not in _RUNS:
        _run_groups(ex, cases, [answer])
    runs = _RUNS.pop((cases, answer))
    if isinstance(runs, str):  # the launch itself failed
        fail(ex, "every rank to finish", runs, "a rank waits for ever in a "
             "collective another rank never calls")
    errors = [r[2] for r in runs if isinstance(r[2], str)]
    if not errors:
        return runs
    peer = ("closed by peer", "reset by peer", "timed out", "Timeout", "timeout")
    cause = next((e for e in errors if not any(p in e for p in peer)), errors[0])
    if "invalid gradient at index" in cause:
        which = {"0": "x", "1": "weight shard", "2": "bias shard"}.get(
            cause.split("index ")[1][:1], "input")
        fail(ex, f"backward's gradient for the {which} in the {which}'s shape",
             cause[:200], "a shard's gradient has the shard's shape: "
             "reduce-scatter the full gradient; return gradients in the order "
             "of forward's inputs")
    if "Check failed" in cause or "divisible" in cause:
        fail(ex, "collectives on tensors that split into N equal slices",
             cause[:200], "pad the flattened tensor to a multiple of the world "
             "size before a reduce-scatter (the shards already are)")
    if any(w in cause for w in ("dtype", "Float", "Double", "BFloat16", "type")):
        fail(ex, f"{what} for float32, float64 and bfloat16 tensors", cause[:200],
             "make every buffer in the input's dtype (new_empty, empty_like), "
             "not torch.empty's default float32")
    if cause in errors and any(p in cause for p in peer):
        fail(ex, "every rank to call the same collectives", cause[:200],
             "each rank must run the same collectives, in the same order")
    fail(ex, f"{what} to run on 2 and 3 ranks", cause[:240],
         "read the error; run your code by hand on one case to find its line")


def _tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol relative to the largest expected value) per dtype."""
    return {torch.float64: (1e-9, 1e-12), torch.bfloat16: (3e-2, 3e-2)}.get(
        dtype, (1e-4, 1e-5))


def _close(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
        return False
    rtol, atol = _tolerance(b.dtype)
    want = b.double()
    return torch.allclose(a.double(), want, rtol=rtol,
                          atol=atol * max(1.0, want.abs().max().item()))


def _where_they_differ(seen: torch.Tensor, want: torch.Tensor) -> str:
    """The largest difference, where it is, and both values there."""
    diff = (seen.double() - want.double()).abs()
    i = int(diff.flatten().argmax())
    at = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), diff.shape))
    a, b = seen.flatten()[i].item(), want.flatten()[i].item()
    digits = next((d for d in (5, 8, 11, 14) if f"{a:.{d}g}" != f"{b:.{d}g}"), 17)
    return (f"at {at if len(at) > 1 else at[0]}: {a:.{digits}g} instead of "
            f"{b:.{digits}g} (largest difference {diff.max().item():.3g})")


def _output_hint(seen, x, w, b, stale) -> tuple[str, str]:
    """(what was seen, a hint) for a wrong output, from what it equals."""
    if not isinstance(seen, torch.Tensor):
        return type(seen).__name__, "return a tensor: x @ W.T + b"
    want = x @ w.T + b
    if seen.dtype != want.dtype:
        return f"dtype {seen.dtype}", "keep the input's dtype (x.dtype) throughout"
    if seen.shape != want.shape:
        return (f"shape {tuple(seen.shape)}", "all-gather the full weight and "
                "bias from the shards first, and drop the padding")
    if _close(seen, x @ w.T):
        return "x @ W.T: the bias is missing", "add the gathered bias"
    if stale is not None and _close(seen, x @ stale[0].T + stale[1]):
        return ("the output of an earlier call's weight", "gather the weight on "
                "every call: a cache keyed by shape serves another layer's weight")
    return _where_they_differ(seen, want), ("all-gather the full weight and bias "
                                            "from the shards first")


def check_sharded_linear(ShardedLinear) -> None:  # noqa: C901, PLR0912
    """Exercise 9.1: a ZeRO-3 linear layer as an autograd function."""
    ex = "9.1"
    for name in ("forward", "backward"):
        if is_placeholder(getattr(ShardedLinear, name, None)):
            require_solution(ex, getattr(ShardedLinear, name))
    if not (isinstance(ShardedLinear, type) and issubclass(
            ShardedLinear, torch.autograd.Function)):
        fail(ex, "a torch.autograd.Function subclass", f"{ShardedLinear!r:.60}",
             "keep `class ShardedLinear(torch.autograd.Function)`")
    results = _group_results(ex, _linear_cases, ShardedLinear, "ShardedLinear")
    for n, rank, cases in results:
        for (out_f, in_f, *_), got in zip(CASES_91, cases, strict=True):
            if got["changed"]:
                fail(ex, f"the inputs left as they were ({n} ranks, rank {rank}, "
                     f"weight ({out_f}, {in_f}))", f"forward or backward changed "
                     f"{' and '.join(got['changed'])}", "write results into new "
                     "tensors (torch.empty_like(shard)): the shards are the model's "
                     "parameters, x belongs to the layer below, and grad_out may "
                     "also be the gradient another branch of the graph receives")
    for n, rank, cases in results:
        for i, ((out_f, in_f, rows, dtype, seed), got) in enumerate(
                zip(CASES_91, cases, strict=True)):
            where = (f"{n} ranks, rank {rank}, weight ({out_f}, {in_f}), "
                     f"{str(dtype).replace('torch.', '')}"
                     + (", a second layer of that shape" if seed else ""))
            w, b, x, c = _linear_problem(out_f, in_f, rows, dtype, seed, rank)
            if not _close(got["y"], x @ w.T + b):
                earlier = CASES_91[REPEATED_91[i]] if i in REPEATED_91 else None
                stale = (_linear_problem(*earlier, rank)[:2] if earlier else None)
                seen, hint = _output_hint(got["y"], x, w, b, stale)
                fail(ex, f"the output x @ W.T + b ({where})", seen, hint)
            if got["x.grad"] is None:
                fail(ex, f"the gradient of x, grad_out @ W ({where})", "None",
                     "backward returns the input's gradient first")
            if not _close(got["x.grad"], c @ w):
                fail(ex, f"the gradient of x, grad_out @ W ({where})",
                     _where_they_differ(got["x.grad"], c @ w)
                     if got["x.grad"].shape == x.shape else
                     f"shape {tuple(got['x.grad'].shape)}",
                     "backward returns the input's gradient first, computed with "
                     "the full (re-gathered) weight of this call")
            problems = [_linear_problem(out_f, in_f, rows, dtype, seed, r)
                        for r in range(n)]
            grads_w = [(c_r.T.double() @ x_r.double()) for _, _, x_r, c_r in problems]
            grads_b = [c_r.double().sum(0) for *_, c_r in problems]
            for what, grads, seen in (("weight", grads_w, got["w.grad"]),
                                      ("bias", grads_b, got["b.grad"])):
                total = sum(grads)
                want = _shard(total / n, rank, n).to(dtype)
                label = f"this rank's slice of the mean {what} gradient ({where})"
                if seen is None:
                    fail(ex, label, "None", f"return a gradient for the {what} "
                         "shard, in the order of forward's inputs")
                if seen.shape != want.shape:
                    fail(ex, label + f", {want.numel()} elements",
                         f"shape {tuple(seen.shape)}", "a shard's gradient has the "
                         "shard's shape: reduce-scatter the full gradient")
                if _close(seen, want):
                    continue
                if seen.dtype != want.dtype:
                    fail(ex, label, f"dtype {seen.dtype}", "keep the shard's dtype")
                if _close(seen, _shard(total, rank, n).to(dtype)):
                    fail(ex, label, f"the sum over the {n} ranks",
                         "reduce-scatter sums: divide by the world size")
                if _close(seen, _shard(grads[rank], rank, n).to(dtype)):
                    fail(ex, label, "this rank's own gradient, not averaged",
                         "reduce-scatter the gradient over the ranks")
                if any(_close(seen, _shard(total / k, rank, n).to(dtype))
                       for k in (1, 2, 3, 4, 9)):
                    fail(ex, label, "the sum divided by another number",
                         "divide by dist.get_world_size(), not a fixed number")
                fail(ex, label, _where_they_differ(seen, want), "reduce-scatter "
                     "the padded, flattened gradient, then divide by the world size")
    for n, _rank, cases in results:
        for (out_f, in_f, *_), got in zip(CASES_91, cases, strict=True):
            if got["kept"]:
                what = ", ".join(f"{w} ({nbytes} bytes)" for w, nbytes in got["kept"])
                fail(ex, f"forward to keep only x and the shards ({n} ranks, weight "
                     f"({out_f}, {in_f}))", f"also kept for backward: {what}",
                     "save only x and the shards (save_for_backward or ctx); "
                     "gather the weight again in backward")
    passed(ex, f"Equal to one process on 2 and 3 ranks, {len(CASES_91)} layers "
               "(float32, float64, bfloat16; padding; a second layer of one "
               "shape), keeping only x and the shards between forward and backward.")


# ---------------------------------------------------------------- exercise 9.2

SHAPES_92 = {"w": (5, 7), "b": (5,), "w.exp_avg": (5, 7), "b.exp_avg": (5,),
             "emb": (3, 1)}
# the last case repeats (2, 3) with other values: an answer that keeps the
# result of an earlier call (by world sizes, say) shows
CASES_92 = ((2, 4), (4, 2), (3, 2), (2, 3), (1, 5), (5, 1), (3, 3), (4, 7), (6, 4),
            (2, 3))


def _full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=g) for name, shape in SHAPES_92.items()}
    state["b"] = state["b"].to(torch.bfloat16)
    state["b.exp_avg"] = state["b.exp_avg"].to(torch.float64)
    state["emb"] = torch.randint(0, 100, (3, 1), generator=g)  # an int64 tensor
    state["w"][-1, -3:] = 0  # real zeros at the end: not padding to strip
    state["step"] = torch.tensor(float(seed % 7 + 3))  # replicated scalar
    state["betas"] = torch.tensor([0.9, 0.999])  # replicated too, not named "step"
    return state


def _cut(state: dict, n: int) -> list[dict]:
    return [{k: (v.clone() if k not in SHAPES_92 else _shard(v, r, n))
             for k, v in state.items()} for r in range(n)]


def _what_changed(shards: list, kept: list, shapes: dict) -> str:
    """How the learner changed the checkpoint it was given, or ''."""
    if shapes != SHAPES_92:
        return "the shapes dictionary was changed"
    if not isinstance(shards, list) or len(shards) != len(kept):
        return f"the list of shards now has {len(shards)} dictionaries"
    for r, (a, b) in enumerate(zip(shards, kept, strict=True)):
        if set(a) != set(b):
            gone, new = sorted(set(b) - set(a)), sorted(set(a) - set(b))
            return (f"rank {r}'s dictionary lost {gone}" if gone else
                    f"rank {r}'s dictionary gained {new}")
        for k in b:
            if not (isinstance(a[k], torch.Tensor) and a[k].dtype == b[k].dtype
                    and a[k].shape == b[k].shape and torch.equal(a[k], b[k])):
                return f"rank {r}'s {k!r} was changed"
    return ""


def check_reshard_checkpoint(reshard_checkpoint) -> None:
    """Exercise 9.2: flat padded shards of N ranks -> those of M ranks."""
    ex = "9.2"
    require_solution(ex, reshard_checkpoint)
    for i, (n, m) in enumerate(CASES_92):
        state = _full_state(i)
        shards = _cut(state, n)
        kept, shapes = copy.deepcopy(shards), dict(SHAPES_92)
        case = f"{n} ranks -> {m} ranks"
        got = call_in_time(ex, reshard_checkpoint, shards, shapes, m, hints={
            "'betas'": "every name that shapes leaves out is replicated, whatever "
            "its name: copy it whole to every new rank"})
        changed = _what_changed(shards, kept, shapes)
        if changed:
            fail(ex, f"the saved shards and shapes left as they were ({case})",
                 changed, "build new dictionaries and tensors; the checkpoint you "
                 "read from is someone's only copy")
        if not isinstance(got, (list, tuple)) or len(got) != m:
            fail(ex, f"a list of {m} dictionaries, one per new rank ({case})",
                 f"{type(got).__name__} of length "
                 f"{len(got) if hasattr(got, '__len__') else '?'}",
                 "use new_world_size, not the old number of ranks")
        want = _cut(state, m)
        for rank, (d, w) in enumerate(zip(got, want, strict=True)):
            if not isinstance(d, dict) or set(d) != set(w):
                fail(ex, f"rank {rank}'s dictionary with keys {sorted(w)} ({case})",
                     f"{sorted(d) if isinstance(d, dict) else type(d).__name__}",
                     "keep every entry, the replicated ones ('step', 'betas') "
                     "too")
            for k, t in w.items():
                s = d[k]
                label = f"rank {rank}'s {k!r} ({case})"
                if not isinstance(s, torch.Tensor):
                    fail(ex, f"{label} as a tensor", type(s).__name__)
                if s.dtype != t.dtype:
                    fail(ex, f"{label} in {t.dtype}", f"{s.dtype}",
                         "keep each tensor's dtype: a checkpoint restores values "
                         "exactly")
                if k not in SHAPES_92:
                    if not torch.equal(s, t):
                        fail(ex, f"{label} = {t.tolist()}, as saved",
                             f"{s.tolist() if s.numel() < 9 else tuple(s.shape)}",
                             "replicated entries (names that shapes leaves out) "
                             "are copied whole to every rank")
                    continue
                numel = math.prod(SHAPES_92[k])
                if s.shape != t.shape:
                    flat = state[k].reshape(-1)
                    stripped = int(flat.nonzero().max()) + 1 if flat.any() else 0
                    if stripped < numel and s.numel() == math.ceil(stripped / m):
                        fail(ex, f"{label} of ceil({numel} / {m}) = {t.numel()} "
                             "elements", f"{s.numel()}: the zeros at the tensor's "
                             "end were dropped as if they were padding", "cut the "
                             f"joined shards to math.prod(shapes[name]) = {numel} "
                             "elements: zeros can be real values")
                    stale = _padded_flat(torch.cat([x[k] for x in shards]), m)
                    if s.numel() == stale.numel() // m != t.numel():
                        fail(ex, f"{label} of ceil({numel} / {m}) = {t.numel()} "
                             "elements", f"{s.numel()}: the old padding is still in",
                             "join the old shards, then cut them to the tensor's "
                             f"{numel} elements before padding again")
                    fail(ex, f"{label} of ceil({numel} / {m}) = {t.numel()} "
                         "elements", f"shape {tuple(s.shape)}",
                         "flatten, pad with zeros to a multiple of the new world "
                         "size, and give every rank an equal slice (torch.chunk "
                         "without padding makes unequal or missing slices)")
                if not torch.equal(s, t):
                    stale = any(torch.equal(s, _cut(_full_state(j), m)[rank][k])
                                for j, (n_j, m_j) in enumerate(CASES_92[:i])
                                if m_j == m)
                    fail(ex, label, _where_they_differ(s, t),
                         "the values of an earlier call: keep no state between "
                         "calls, reshard the shards you are given" if stale else
                         "rank r gets elements r * size ... (r + 1) * size of the "
                         "padded flat tensor")
    passed(ex, f"{len(CASES_92)} reshardings (1 to 7 ranks, one pair twice), odd "
               "sizes, float32, float64, bfloat16 and int64 tensors, zeros at a "
               "tensor's end, two replicated entries: all exact, the saved "
               "checkpoint untouched.")


# ---------------------------------------------------------------- exercise 9.3

# (parameter shapes, dtype, scale of the gradients, seed): a norm above
# max_norm (clipped) and below it (left alone), float32, float64, bfloat16,
# one case whose gradient lives on the last rank's slices only, and a second
# call with other gradients of the same shapes (an answer with state shows)
# max_norm per case: not always 1 (a norm of 4.3 clipped to 2.5, one of 4.0
# left alone under 5), so an answer that uses 1 in place of max_norm shows
MAX_NORMS_93 = (1.0, 1.0, 2.5, 5.0, 1.0, 0.5)
CASES_93 = (
    (((5, 7), (5,), (3, 1)), torch.float32, 1.0, 0),
    (((5, 7), (5,), (3, 1)), torch.float32, 0.02, 1),
    (((4, 4), (9,)), torch.float64, 1.0, 2),
    (((6, 3), (2,)), torch.bfloat16, 1.0, 3),
    (((5, 7), (5,), (3, 1)), torch.float32, 1.0, 4),
    (((11,), (2, 3)), torch.float32, 3.0, "tail"),
)


def _clip_problem(shapes, dtype, scale, seed) -> list[torch.Tensor]:
    """The full (mean) gradient of each parameter, in ``dtype``."""
    g = torch.Generator().manual_seed(1000 + (7 if seed == "tail" else seed))
    grads = [torch.randn(shape, generator=g) * scale for shape in shapes]
    if seed == "tail":  # all the norm is at the end: only the last slices see it
        grads = [torch.zeros(shape) for shape in shapes[:-1]] + [grads[-1]]
        grads[-1].view(-1)[:-1] = 0
    return [t.to(dtype) for t in grads]


def _clip_cases(fn, rank: int, n: int) -> list[dict]:
    """Every case of 9.3 for one function, on this rank of an n-rank group."""
    results = []
    for (shapes, dtype, scale, seed), max_norm in zip(CASES_93, MAX_NORMS_93,
                                                      strict=True):
        shards = [_shard(t, rank, n) for t in _clip_problem(shapes, dtype, scale, seed)]
        given = list(shards)
        norm = fn(shards, max_norm)
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().double().cpu()
            norm = norm.item() if norm.numel() == 1 else norm.tolist()
        results.append({"norm": norm, "same list": len(shards) == len(given)
                        and all(a is b for a, b in zip(shards, given, strict=True)),
                        "shards": [t.clone() for t in given]})
    return results


def run_clip(functions: list) -> None:
    """Run 9.3's cases for several functions in one launch (the tests use it)."""
    _run_groups("9.3", _clip_cases, functions)


def _norm_hint(seen: float, want: float, grads, n: int, rank: int,
               agreed: bool) -> str:
    """What a wrong norm equals, as a hint (``agreed``: every rank returned it)."""
    flat = [_padded_flat(g.double(), n).chunk(n) for g in grads]
    squares = [sum(float(f[r].pow(2).sum()) for f in flat) for r in range(n)]

    def near(v):
        return math.isclose(seen, v, rel_tol=2e-2, abs_tol=1e-9)

    if math.isclose(seen, want, rel_tol=1e-3):
        return ("close, not exact: sum the squares in the gradients' dtype or in "
                "float64 (float32 loses float64's digits)")
    if not agreed and near(math.sqrt(squares[rank])):
        return ("the norm of this rank's slices only: all-reduce the sum of "
                "squares over the ranks first")
    if near(sum(math.sqrt(q) for q in squares)):
        return ("the sum of the ranks' norms: norms do not add; all-reduce the "
                "squares, then take the square root")
    if near(want ** 2):
        return "the square root is missing"
    if near(math.sqrt(sum(squares) / n)) or near(want / n):
        return "a sum, not a mean: do not divide by the world size"
    if agreed and near(max(math.sqrt(q) for q in squares)):
        return "the largest rank's norm: sum the squares over the ranks instead"
    return "the L2 norm of all the gradients: sqrt of the sum over ranks of squares"


def check_clip_sharded(clip_sharded_grads) -> None:  # noqa: C901
    """Exercise 9.3: clip gradients from their shards (a global L2 norm)."""
    ex = "9.3"
    require_solution(ex, clip_sharded_grads)
    results = _group_results(ex, _clip_cases, clip_sharded_grads, "clip_sharded_grads")
    agreed: dict = {}  # the values each case returned, over the ranks
    for n, _rank, cases in results:
        for i, got in enumerate(cases):
            agreed.setdefault((n, i), set()).add(repr(got["norm"]))
    norms: dict = {}
    for n, rank, cases in results:
        for i, ((shapes, dtype, scale, seed), got) in enumerate(
                zip(CASES_93, cases, strict=True)):
            grads = _clip_problem(shapes, dtype, scale, seed)
            want = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            where = (f"{n} ranks, rank {rank}, {len(shapes)} gradients, "
                     f"{str(dtype).replace('torch.', '')}, norm {want:.4g}, "
                     f"max_norm {MAX_NORMS_93[i]}"
                     + (", shapes of an earlier call" if any(
                         case[:2] == (shapes, dtype) for case in CASES_93[:i]) else "")
                     + (", all of it on the last rank" if seed == "tail" else ""))
            seen = got["norm"]
            if not isinstance(seen, (int, float)):
                fail(ex, f"the total norm as a number ({where})", f"{seen!r:.60}",
                     "return a float (or a one-element tensor)")
            rtol = _tolerance(dtype)[0] if dtype != torch.float32 else 1e-5
            if not math.isclose(seen, want, rel_tol=rtol, abs_tol=1e-12):
                earlier = [math.sqrt(sum(float(g.double().pow(2).sum())
                                         for g in _clip_problem(*case)))
                           for case in CASES_93[:i] if case[:2] == (shapes, dtype)]
                hint = ("the norm of an earlier call: compute it from this call's "
                        "gradients" if any(math.isclose(seen, e, rel_tol=1e-4)
                                           for e in earlier)
                        else _norm_hint(seen, want, grads, n, rank,
                                        len(agreed[n, i]) == 1))
                fail(ex, f"the total norm {want:.6g} ({where})", f"{seen:.6g}", hint)
            norms.setdefault((n, i), set()).add(seen)
            max_norm = MAX_NORMS_93[i]
            coef = min(1.0, max_norm / (want + 1e-6))
            if not got["same list"]:
                fail(ex, f"the shards scaled in place ({where})", "the list or its "
                     "tensors were replaced", "multiply each shard in place (mul_): "
                     "the optimizer holds those tensors")
            for k, (shard, g) in enumerate(zip(got["shards"], grads, strict=True)):
                expect = _shard((g.double() * coef).to(dtype), rank, n)
                if _close(shard, expect):
                    continue
                unchanged = _shard(g, rank, n)
                by_one = [_shard((g.double() * f).to(dtype), rank, n) for f in
                          (min(1.0, 1 / (want + 1e-6)), max_norm / (want + 1e-6))]
                if max_norm != 1 and any(_close(shard, t) for t in by_one):
                    hint = (f"max_norm is {max_norm} here: compare the norm with "
                            "max_norm and scale by max_norm / (norm + 1e-6), "
                            "never with 1")
                elif _close(shard, unchanged) and coef < 1:
                    hint = ("the shards are unchanged: scale them in place by "
                            "max_norm / (norm + 1e-6) when the norm is above max_norm")
                elif coef == 1 and not _close(shard, unchanged):
                    hint = ("the norm is below max_norm: leave the gradients as "
                            "they are (the factor is capped at 1)")
                elif _close(shard, _shard((g.double() / coef).to(dtype), rank, n)):
                    hint = ("the factor is inverted: max_norm / norm, not "
                            "norm / max_norm")
                else:
                    hint = "scale every shard by min(1, max_norm / (norm + 1e-6))"
                fail(ex, f"gradient {k} clipped by {coef:.4g} ({where})",
                     _where_they_differ(shard, expect), hint)
    split = [key for key, values in norms.items() if len(values) > 1]
    if split:
        fail(ex, "the same total norm on every rank", f"{len(split)} cases differ",
             "all-reduce the squares so that every rank computes the same norm")
    passed(ex, f"{len(CASES_93)} cases on 2 and 3 ranks (float32, float64, bfloat16; "
               "clipped and not, max_norm 0.5 to 5; a second call): the whole "
               "model's norm, the shards "
               "scaled in place, as clip_grad_norm_ would.")
