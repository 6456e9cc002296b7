"""Checkers for Chapter 9 (sharded data parallelism).

9.1 runs the learner's ``ShardedLinear`` in real processes: one launch of 5
ranks that form two independent process groups, of 2 and of 3 ranks (keys
apart in one store), so both world sizes are tried at once. Sizes are odd,
so the shards need padding; the output, the input's gradient and each
rank's shard gradients are compared with one process, and the bytes the
forward keeps for backward (saved tensors and tensors on ``ctx``) are
counted. 9.2 is a pure function, tried on
many world sizes, dtypes and odd shapes. 9.3 compares the learner's
predicted collective counts with those ``CommDebugMode`` counts in a real
FSDP2 step (measured once per process, for every model the checker asks
about).
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
from datetime import timedelta

import torch

from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import (
    call_learner,
    fail,
    is_placeholder,
    passed,
    require_solution,
)

TIMEOUT_S = 40
GROUPS = ((0, 2), (2, 3))  # (first launched rank, world size): 2 and 3 ranks


def _padded_flat(t: torch.Tensor, n: int) -> torch.Tensor:
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % n)])


def _shard(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    return _padded_flat(t, n).chunk(n)[rank].clone()


# ---------------------------------------------------------------- exercise 9.1

CASES_91 = ((13, 11, 3), (64, 97, 2))  # (out_features, in_features, rows)


def _linear_problem(out_f: int, in_f: int, rows: int, rank: int):
    g = torch.Generator().manual_seed(out_f * 1000 + in_f)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g)
    g.manual_seed(7 + 31 * rank + out_f)
    x = torch.randn(rows, in_f, generator=g)
    c = torch.randn(rows, out_f, generator=g)  # the loss is (y * c).sum()
    return w, b, x, c


def _kept_for_backward(y, *inputs: torch.Tensor) -> int:
    """Bytes a custom autograd function's forward kept for its backward,
    besides the storages of ``inputs``: its saved tensors and any tensor put
    on ``ctx`` as an attribute (``ctx`` is the output's ``grad_fn``)."""
    node = getattr(y, "grad_fn", None)
    if node is None:
        return 0
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
    own = {t.untyped_storage().data_ptr() for t in inputs}
    seen, kept = set(), 0
    for t in found:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own | seen:
            seen.add(storage.data_ptr())
            kept += storage.nbytes()
    return kept


def _linear_cases(fn, rank: int, n: int) -> list[dict]:
    """Every case of 9.1 for one class, on this rank of an n-rank group."""
    results = []
    for out_f, in_f, rows in CASES_91:
        w, b, x, c = _linear_problem(out_f, in_f, rows, rank)
        ws = _shard(w, rank, n).requires_grad_()
        bs = _shard(b, rank, n).requires_grad_()
        x = x.requires_grad_()
        y = fn.apply(x, ws, bs, out_f, in_f)
        kept = _kept_for_backward(y, x, ws, bs)
        if isinstance(y, torch.Tensor) and y.requires_grad:
            (y * c).sum().backward()
        results.append({
            "y": y.detach().clone() if isinstance(y, torch.Tensor) else y,
            "x.grad": None if x.grad is None else x.grad.clone(),
            "w.grad": None if ws.grad is None else ws.grad.clone(),
            "b.grad": None if bs.grad is None else bs.grad.clone(),
            "kept": kept})
    return results


def _linear_rank(launched: int, nprocs: int, classes: list, wait_s: float) -> list:
    """One rank of one of the two groups. The group is reused from class to
    class, and made anew after a class that failed on any of its ranks, so that
    one class's error cannot disturb the next."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    start, n = next(g for g in GROUPS if g[0] <= launched < g[0] + g[1])
    rank = launched - start
    # one store for the launch (the launcher's rendezvous port); prefixes keep
    # the groups' keys apart
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           nprocs, is_master=launched == 0,
                           timeout=timedelta(seconds=TIMEOUT_S))
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
            out.append((n, rank, _linear_cases(fn, rank, n)))
        except Exception as e:  # noqa: BLE001 - judged by the parent
            first = (str(e).splitlines() or [""])[0]
            out.append((n, rank, f"{type(e).__name__}: {first}"))
            failed = 1
        key = f"group{n}/class{i}"
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


_LINEAR_RUNS: dict = {}


def run_sharded_linear(classes: list, wait_s: float = 10.0) -> None:
    """Run 9.1's cases for several classes in one launch; keep what each did.

    ``check_sharded_linear`` then judges a class from these results instead of
    launching again (the checker tests use it: one launch for all answers).
    """
    nprocs = sum(n for _, n in GROUPS)
    try:
        ranks = [r.value for r in launch(
            _linear_rank, nprocs, args=(list(classes), wait_s),
            timeout=TIMEOUT_S + 2 * wait_s * len(classes), init=False,
            echo=False, backend="gloo")]
    except RankFailed as e:
        ranks = str(e).splitlines()[0][:240]
    except LaunchTimeout as e:
        ranks = "timeout: " + str(e).splitlines()[0][:200]
    for i, cls in enumerate(classes):
        _LINEAR_RUNS[cls] = ranks if isinstance(ranks, str) else [r[i] for r in ranks]


def _linear_results(ex: str, cls) -> list:
    if cls not in _LINEAR_RUNS:
        run_sharded_linear([cls])
    runs = _LINEAR_RUNS.pop(cls)
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
    if cause in errors and any(p in cause for p in peer):
        fail(ex, "every rank to call the same collectives", cause[:200],
             "each rank must run the same all-gathers and reduce-scatters")
    fail(ex, "ShardedLinear to run on 2 and 3 ranks", cause[:240],
         "read the error; run your class by hand on one case to find its line")


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(
        a.double(), b.double(), rtol=1e-4, atol=1e-5)


def check_sharded_linear(ShardedLinear) -> None:
    """Exercise 9.1: a ZeRO-3 linear layer as an autograd function."""
    ex = "9.1"
    for name in ("forward", "backward"):
        if is_placeholder(getattr(ShardedLinear, name, None)):
            require_solution(ex, getattr(ShardedLinear, name))
    if not (isinstance(ShardedLinear, type) and issubclass(
            ShardedLinear, torch.autograd.Function)):
        fail(ex, "a torch.autograd.Function subclass", f"{ShardedLinear!r:.60}",
             "keep `class ShardedLinear(torch.autograd.Function)`")
    results = _linear_results(ex, ShardedLinear)
    for n, rank, cases in results:
        for (out_f, in_f, rows), got in zip(CASES_91, cases, strict=True):
            where = f"{n} ranks, rank {rank}, weight ({out_f}, {in_f})"
            w, b, x, c = _linear_problem(out_f, in_f, rows, rank)
            if not _close(got["y"], x @ w.T + b):
                seen = (f"shape {tuple(got['y'].shape)}" if isinstance(
                    got["y"], torch.Tensor) else f"{type(got['y']).__name__}")
                fail(ex, f"the output x @ W.T + b ({where})", seen,
                     "all-gather the full weight and bias from the shards first")
            if not _close(got["x.grad"], c @ w):
                fail(ex, f"the gradient of x, grad_out @ W ({where})",
                     "None" if got["x.grad"] is None else "other values",
                     "backward returns the input's gradient first, computed with "
                     "the full (re-gathered) weight")
            grads_w = [c_r.T @ x_r for c_r, x_r in (
                _linear_problem(out_f, in_f, rows, r)[3:1:-1] for r in range(n))]
            grads_b = [_linear_problem(out_f, in_f, rows, r)[3].sum(0)
                       for r in range(n)]
            for what, grads, seen in (("weight", grads_w, got["w.grad"]),
                                      ("bias", grads_b, got["b.grad"])):
                total = sum(grads)
                want = _shard(total / n, rank, n)
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
                if _close(seen, _shard(total, rank, n)):
                    fail(ex, label, f"the sum over the {n} ranks",
                         "reduce-scatter sums: divide by the world size")
                if _close(seen, _shard(grads[rank], rank, n)):
                    fail(ex, label, "this rank's own gradient, not averaged",
                         "reduce-scatter the gradient over the ranks")
                if any(_close(seen, _shard(total / k, rank, n)) for k in (1, 2, 3, 4)):
                    fail(ex, label, "the sum divided by another number",
                         "divide by dist.get_world_size(), not a fixed number")
                fail(ex, label, "other values", "reduce-scatter the padded, "
                     "flattened gradient, then divide by the world size")
    for n, _rank, cases in results:
        got = cases[-1]
        out_f, in_f, _ = CASES_91[-1]
        weight_bytes = out_f * in_f * 4
        if got["kept"] >= weight_bytes // 2:
            fail(ex, f"forward to keep only x and the shards ({n} ranks, weight "
                 f"{weight_bytes} bytes)", f"{got['kept']} more bytes kept for "
                 "backward", "do not save the gathered weight (or anything made "
                 "from it) for backward: gather it again there")
    passed(ex, "Equal to one process on 2 and 3 ranks, with padding, keeping only "
               "the shards between forward and backward.")


# ---------------------------------------------------------------- exercise 9.2

SHAPES_92 = {"w": (5, 7), "b": (5,), "w.exp_avg": (5, 7), "b.exp_avg": (5,),
             "emb": (3, 1)}
CASES_92 = ((2, 4), (4, 2), (3, 2), (2, 3), (1, 5), (5, 1), (3, 3), (4, 7), (6, 4))


def _full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=g) for name, shape in SHAPES_92.items()}
    state["b"] = state["b"].to(torch.bfloat16)
    state["emb"] = torch.randint(0, 100, (3, 1), generator=g)  # an int64 tensor
    state["step"] = torch.tensor(float(seed % 7 + 3))  # replicated scalar
    return state


def _cut(state: dict, n: int) -> list[dict]:
    return [{k: (v.clone() if k not in SHAPES_92 else _shard(v, r, n))
             for k, v in state.items()} for r in range(n)]


def check_reshard_checkpoint(reshard_checkpoint) -> None:
    """Exercise 9.2: flat padded shards of N ranks -> those of M ranks."""
    ex = "9.2"
    require_solution(ex, reshard_checkpoint)
    for i, (n, m) in enumerate(CASES_92):
        state = _full_state(i)
        shards = _cut(state, n)
        kept = copy.deepcopy(shards)
        case = f"{n} ranks -> {m} ranks"
        got = call_learner(ex, reshard_checkpoint, shards, dict(SHAPES_92), m)
        if not all(torch.equal(a[k], b[k]) for a, b in zip(shards, kept, strict=True)
                   for k in a):
            fail(ex, f"the saved shards left as they were ({case})",
                 "they were changed", "build new tensors; the checkpoint you read "
                 "from is someone's only copy")
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
                     "keep every entry, the replicated 'step' too")
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
                        fail(ex, f"{label} = {t.item():g}, as saved",
                             f"{s.flatten()[:3].tolist()}",
                             "replicated entries are copied whole to every rank")
                    continue
                numel = math.prod(SHAPES_92[k])
                if s.shape != t.shape:
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
                    fail(ex, label, f"{s[:4].tolist()} ... instead of "
                         f"{t[:4].tolist()} ...", "rank r gets elements r * size "
                         "... (r + 1) * size of the padded flat tensor")
    passed(ex, f"{len(CASES_92)} reshardings (1 to 7 ranks), odd sizes, fp32, bf16 "
               "and int64 tensors, replicated step: all exact.")


# ---------------------------------------------------------------- exercise 9.3

CASES_93 = tuple((blocks, root, reshard) for blocks in (1, 3) for root in (False, True)
                 for reshard in (True, False, None))
_MEASURED: dict[tuple, tuple[int, int]] = {}


def _collective_rank(rank: int, world_size: int, cases) -> dict:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world_size,))
    counts = {}
    for blocks, root, reshard in cases:
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(blocks)]
        if root:
            layers.append(nn.Linear(6, 3))
        model = nn.Sequential(*layers)
        options = {} if reshard is None else {"reshard_after_forward": reshard}
        for block in model[:blocks]:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        comm = CommDebugMode()
        with comm:
            model(torch.randn(4, 6)).sum().backward()
        found = {str(k): v for k, v in comm.get_comm_counts().items()}
        counts[(blocks, root, reshard)] = (
            sum(v for k, v in found.items() if "allgather" in k),
            sum(v for k, v in found.items() if "reduce_scatter" in k))
    return counts


def measured_collectives() -> dict[tuple, tuple[int, int]]:
    """(all-gathers, reduce-scatters) of one FSDP2 forward+backward, per case."""
    if not _MEASURED:
        ranks = launch(_collective_rank, 2, args=(CASES_93,), timeout=120,
                       echo=False, backend="gloo")
        _MEASURED.update(ranks[0].value)
    return _MEASURED


def check_fsdp_collectives(predict_collectives) -> None:
    """Exercise 9.3: predict FSDP2's all-gathers and reduce-scatters."""
    ex = "9.3"
    require_solution(ex, predict_collectives)
    answers = {}
    for case in CASES_93:
        got = call_learner(ex, predict_collectives, *case)
        try:
            ag, rs = (int(v) for v in got)
        except (TypeError, ValueError):
            fail(ex, "a pair (all_gathers, reduce_scatters)", f"{got!r:.60}")
        answers[case] = (ag, rs)
    measured = measured_collectives()
    for case in CASES_93:
        blocks, root, reshard = case
        want, seen = measured[case], answers[case]
        if seen == want:
            continue
        what = (f"{blocks} block{'s' if blocks > 1 else ''}, root "
                f"{'with' if root else 'without'} parameters, "
                f"reshard_after_forward={reshard}")
        units = blocks + root
        if seen[1] != want[1]:
            hint = ("one reduce-scatter per unit that owns parameters, in backward: "
                    "the root counts when it has parameters" if seen[1] in (
                        blocks, units + 1, 2 * units) else
                    "each fully_shard unit with parameters reduce-scatters its "
                    "gradients once")
        elif reshard is None:
            hint = ("left out, reshard_after_forward is True for the blocks and "
                    "False for the root (the root is needed again at once)")
        elif reshard is False:
            hint = "with False nothing is freed after forward: no backward all-gather"
        else:
            hint = ("with True every unit is freed after forward and gathered again "
                    "in backward - the root too, when it has parameters")
        fail(ex, f"{want[0]} all-gathers and {want[1]} reduce-scatters ({what}, "
             "measured)", f"{seen[0]} and {seen[1]}", hint)
    passed(ex, f"all {len(CASES_93)} models predicted exactly, as FSDP2 ran them.")
