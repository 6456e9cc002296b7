"""Checkers for Chapter 13 (putting it together).

- 13.1: a pipeline x tensor-parallel stage on 4 gloo ranks (tp 2 and 1:
  2 stages of 5 blocks in float32, 4 stages of 6 in float64, depths the
  stages do not divide) and on 2 (tp 2, one stage of 4 blocks): GPipe's loss
  and every gradient
  against one process, which ranks share a pipeline group and a TP mesh
  (TP ranks adjacent), and that the blocks' weights really are sharded;
- 13.2: a layout search (FSDP or DDP, recomputation or not) against the
  checker's exhaustive search, on several models, GPUs, GPU counts (24 too)
  and throughput targets, some impossible, one met by the whole cluster but
  not per GPU; where a forbidden layout (tp 16, dp not dividing the batch)
  would be fastest;
- 13.3: a tool that names the mesh dimensions whose reduction is missing,
  on gradients made by autograd on different data shards, float32 and
  float64, tiny and huge magnitudes, 1-D to 3-D meshes, rounding noise.

The ``_*_rank`` function takes a list of answers, so that the tests judge
many answers in one launch; the checker passes one.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_utils import planner, reference
from course_utils.dist import LaunchTimeout, RankFailed, launch
from course_utils.exercises import (
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
    time_limit,
)

# What an answer that reads the checker instead of the gradients would name.
_PEEKING = ("_getframe", "currentframe", "f_locals", "f_back", "f_globals",
            "inspect", "ch13", "course_utils.checks", "REDUCTION_CASES",
            "LAYOUT_CASES", "STAGE_CASES", "make_gradients", "expected_layout")


def _names(obj, seen=None) -> set:
    """Every name and string constant in the code of ``obj`` (a function, a
    callable object or a class), nested functions and methods included."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    out = set()
    if isinstance(obj, types.CodeType):
        out |= set(obj.co_names)
        for c in obj.co_consts:
            if isinstance(c, str):
                out.add(c)
            elif isinstance(c, types.CodeType):
                out |= _names(c, seen)
        return out
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = getattr(obj, "__func__", obj)
        out |= _names(fn.__code__, seen)
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if callable(value):
                out |= _names(value, seen)
        return out
    cls = obj if isinstance(obj, type) else type(obj)
    if cls.__module__ in ("builtins", "functools") or cls.__module__.startswith(
            ("torch", "numpy", "course_utils")):
        return out
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, (types.FunctionType, types.CodeType)):
            out |= _names(value, seen)
    return out


def _refuse_peeking(ex: str, fn) -> None:
    """Fail an answer whose code reads the checker's cases or its frames."""
    found = sorted(n for n in _names(fn)
                   if n in _PEEKING or "course_utils.checks" in n)
    if found:
        fail(ex, "an answer computed from its arguments",
             f"code that reads the checker ({', '.join(found[:3])})",
             "work from the arguments only, not the checker's cases or frames")


def _call(ex: str, fn, *args, convert=None):
    """The learner's function (and ``convert`` of its result, which may walk a
    lazy iterator) within ``answer_limit(ex)``, its failures made friendly."""
    def body():
        got = fn(*args)
        return convert(got) if convert else got

    body.__name__ = getattr(fn, "__name__", "your function")
    with time_limit(answer_limit(ex)):
        return call_learner(ex, body, hints={
            "took longer than": "your function did not return: look for a loop "
                                "or an iterator that never ends"})


def _error(e: Exception) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:300]


# ---------------------------------------------------------------- exercise 13.1

class _Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False)
                                              for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, n_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ExerciseGPT(nn.Module):
    """The chapter's GPT, the same structure and parameter names."""

    def __init__(self, vocab=48, dim=32, n_heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): _Block(dim, n_heads)
                                     for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(self.norm(x))


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# (tp, layers, dtype, seed)
# depths the stages do not divide: 5 blocks on 2 stages, 6 on 4
STAGE_CASES = ((2, 5, torch.float32, 0), (1, 6, torch.float64, 1))
# on 2 ranks, one stage of 4 blocks: the stages come from the world size
STAGE_CASES_2 = ((2, 4, torch.float64, 2),)


_TP_WEIGHTS = tuple(f"{m}.weight" for m in ("attn.wq", "attn.wk", "attn.wv",
                                              "attn.wo", "mlp.0", "mlp.2"))


def local_full(p):
    """A parameter's whole value, gathered if it is a DTensor."""
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def _stage_rank(rank: int, world: int, fns: list, cases=STAGE_CASES) -> list:
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe
    from torch.distributed.tensor import DTensor

    warnings.filterwarnings("ignore")
    out = []
    for fn in fns:
        per_case = []
        for tp, layers, dtype, seed in cases:
            g = torch.Generator().manual_seed(seed)
            tokens, targets = torch.randint(0, 48, (2, 4, 6), generator=g)
            torch.manual_seed(seed)
            ref = ExerciseGPT(n_layers=layers).to(dtype)
            _loss(ref(tokens), targets).backward()
            try:
                torch.manual_seed(seed)
                stage = fn(ExerciseGPT(n_layers=layers).to(dtype), tp)
                module = stage.submod
                names = [n for n, _ in module.named_parameters()]
                tp_peers = next((sorted(p.device_mesh.mesh.flatten().tolist())
                                 for p in module.parameters()
                                 if isinstance(p, DTensor)), None)
                sharded = any(isinstance(p, DTensor) and p.to_local().numel()
                              < p.numel() for p in module.parameters())
                # the blocks' six linear weights, each split over the TP ranks
                unsharded = [n for n, p in module.named_parameters()
                             if n.endswith(_TP_WEIGHTS) and not (
                                 isinstance(p, DTensor)
                                 and p.to_local().numel() < p.numel())]
                given = dict(ref.named_parameters())
                dtypes = sorted({str(p.dtype).replace("torch.", "")
                                 for p in module.parameters()})
                changed = [n for n, p in module.named_parameters()
                           if n in given and (p.shape != given[n].shape or not
                                              torch.equal(local_full(p).to(dtype),
                                                          given[n].detach()))]
                schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=_loss)
                losses = []
                if stage.is_first and stage.is_last:
                    schedule.step(tokens, target=targets, losses=losses)
                elif stage.is_first:
                    schedule.step(tokens)
                elif stage.is_last:
                    schedule.step(target=targets, losses=losses)
                else:
                    schedule.step()
                ref_grads = dict(ref.named_parameters())
                diffs = {}
                for n, p in module.named_parameters():
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else (
                        p.grad)
                    want = ref_grads[n].grad if n in ref_grads else None
                    diffs[n] = (float("inf") if grad is None or want is None
                                or grad.shape != want.shape
                                else (grad.double() - want.double()).abs().max().item())
                per_case.append({
                    "pp_group": sorted(dist.get_process_group_ranks(stage.group)),
                    "tp_peers": tp_peers, "sharded": sharded, "names": names,
                    "unsharded": unsharded, "dtypes": dtypes, "changed": changed,
                    "loss": (torch.stack(losses).mean().item() if losses else None),
                    "ref_loss": _loss(ref(tokens), targets).item(), "diffs": diffs,
                    "all_names": [n for n, _ in ref.named_parameters()],
                    "stage_index": stage.stage_index, "num_stages": stage.num_stages})
            except Exception as e:  # all ranks raise alike: nothing left waiting
                per_case.append({"error": _error(e)})
        out.append(per_case)
    return out


def judge_stage(ranks: list[list[dict]], cases=None) -> None:
    """``ranks[r][c]``: rank r's result for case c. Fail with the mistake made."""
    ex = "13.1"
    world = len(ranks)
    cases = cases or (STAGE_CASES if world == 4 else STAGE_CASES_2)
    for c, (tp, layers, dtype, _) in enumerate(cases):
        where = (f"{world} ranks, tp={tp}, {layers} layers, "
                 f"{str(dtype).replace('torch.', '')}")
        results = [r[c] for r in ranks]
        for rank, r in enumerate(results):
            if "error" in r:
                err = r["error"]
                if "group size" in err.lower():  # PipelineStage on the world
                    hint = ("PipelineStage sends activations within its group: "
                            "pass group=mesh['pp'].get_group(), the ranks that "
                            "hold this rank's TP slice of every stage")
                elif "mesh" in err.lower() or "numel" in err:
                    hint = ("the mesh has world_size // tp pipeline stages: use "
                            "dist.get_world_size() and tp, not fixed numbers")
                else:
                    hint = "fix that error and run the exercise cell again"
                fail(ex, f"pp_tp_stage to run ({where})", f"rank {rank}: {err}", hint)
        n_stages = world // tp
        want_dtype = str(dtype).replace("torch.", "")
        for rank, r in enumerate(results):
            if r["dtypes"] != [want_dtype]:
                fail(ex, f"the stage's parameters in {want_dtype} ({where})",
                     f"{', '.join(r['dtypes'])} on rank {rank}",
                     "keep the model's own dtype and weights: the checker runs "
                     "float32 and float64, each compared with one process")
            if r["changed"]:
                fail(ex, f"the given model's weights ({where})",
                     f"{r['changed'][0]} changed on rank {rank}",
                     "cut and parallelize the model you are given; do not build "
                     "or initialise new weights")
            if r["num_stages"] != n_stages:
                fail(ex, f"{n_stages} pipeline stages ({where})",
                     f"a PipelineStage of {r['num_stages']} stages on rank {rank}",
                     "the pipeline has world_size // tp stages")
            want_group = [i for i in range(world) if i % tp == rank % tp]
            if r["pp_group"] != want_group:
                hint = ("the TP ranks of a stage must be adjacent (a node's GPUs): "
                        "make tp the last, fastest-varying mesh dimension, "
                        "mesh shape (world // tp, tp)"
                        if tp > 1 and r["pp_group"] == list(range(
                            rank // n_stages * n_stages, rank // n_stages * n_stages
                            + n_stages)) else
                        "give the PipelineStage the pipeline dimension's group: "
                        "mesh['pp'].get_group()")
                fail(ex, f"rank {rank}'s pipeline group {want_group} ({where})",
                     f"{r['pp_group']}", hint)
            if r["stage_index"] != rank // tp:
                fail(ex, f"rank {rank} to run stage {rank // tp} ({where})",
                     f"stage {r['stage_index']}",
                     "the stage index is the rank's coordinate on the pipeline "
                     "dimension: mesh['pp'].get_local_rank()")
            if tp > 1:
                peers = list(range(rank // tp * tp, rank // tp * tp + tp))
                if r["tp_peers"] is None or not r["sharded"]:
                    fail(ex, f"the blocks' weights sharded over tp={tp} ({where})",
                         f"no sharded weight on rank {rank}",
                         "apply the tensor-parallel plan to the stage's blocks "
                         "on mesh['tp']")
                if r["unsharded"]:
                    fail(ex, f"every block's linear weights sharded over tp={tp} "
                         f"({where})", f"{', '.join(r['unsharded'][:3])} whole on "
                         f"rank {rank}", "the plan covers attention (wq, wk, wv, wo) "
                         "and the MLP (mlp.0, mlp.2) of every block")
                if r["tp_peers"] != peers:
                    fail(ex, f"rank {rank}'s TP peers {peers} ({where})",
                         f"{r['tp_peers']}",
                         "parallelize on the tensor-parallel dimension mesh['tp'], "
                         "whose ranks are adjacent")
        held = [n for r in results[::tp] for n in r["names"]]
        all_names = results[0]["all_names"]
        if sorted(held) != sorted(all_names):
            extra = sorted({n for n in held if held.count(n) > 1})
            fail(ex, f"each parameter on exactly one stage ({where})",
                 f"held twice: {extra[:3]}" if extra else
                 f"missing: {sorted(set(all_names) - set(held))[:3]}",
                 "keep only this stage's blocks (pipeline_stage(model, index, "
                 "n_stages)), the embedding on the first, norm and head on the last")
        blocks = [sorted({int(n.split(".")[1]) for n in r["names"]
                          if n.startswith("layers.")}) for r in results[::tp]]
        if [b for stage in blocks for b in stage] != sorted(
                b for stage in blocks for b in stage):
            fail(ex, f"consecutive blocks on each stage, stage 0 the first ({where})",
                 "blocks per stage " + ", ".join(map(str, blocks)),
                 "a pipeline passes each activation on to the next stage: stage i "
                 "keeps blocks i x L // n .. (i + 1) x L // n - 1 of L, in order")
        tol = 1e-4 if dtype == torch.float32 else 1e-9
        last = results[-1]
        if last["loss"] is None or not math.isclose(
                last["loss"], last["ref_loss"], rel_tol=tol, abs_tol=tol):
            near = last["loss"] is not None and math.isclose(
                last["loss"], last["ref_loss"], rel_tol=1e-5)
            fail(ex, f"the loss of one process, {last['ref_loss']:.10f} ({where})",
                 f"{last['loss']}",
                 "keep the model's own dtype and weights: the checker also runs "
                 "float64" if near else "the last stage computes the loss; check "
                 "which blocks each stage keeps and the plan's column/row pairs")
        for rank, r in enumerate(results):
            for n, d in r["diffs"].items():
                if not d <= tol * 10:
                    fail(ex, f"every gradient equal to one process ({where})",
                         f"{n} on rank {rank} differs by {d:.3g}",
                         "the plan pairs ColwiseParallel (wq, wk, wv, mlp.0) with "
                         "RowwiseParallel (wo, mlp.2)")


def _stuck(message: str) -> str:
    """What each unfinished rank of a LaunchTimeout was doing, in one line."""
    where, rank = [], None
    for line in message.splitlines():
        found = re.match(r"\s*rank (\d+)", line)
        if found:
            rank = found[1]
            if "no stack" in line:
                where.append(f"rank {rank}: no stack")
                rank = None
        elif rank is not None and "(" in line:
            where.append(f"rank {rank} in {line.strip()}")
            rank = None  # the innermost frame is enough
    return "; ".join(where) or message.splitlines()[0]


def _run_stage(fns: list, world: int = 4) -> list:
    """Each answer's stages on ``world`` ranks, in one launch that may take
    ``answer_limit("13.1")`` per answer (longer on a busier machine)."""
    cases = STAGE_CASES if world == 4 else STAGE_CASES_2
    limit = answer_limit("13.1", len(fns))
    try:
        ranks = [r.value for r in launch(_stage_rank, world, args=(fns, cases),
                                         timeout=limit, backend="gloo", echo=False)]
    except RankFailed as e:
        fail("13.1", "every rank to finish", str(e).splitlines()[0][:200],
             "every rank must build the same mesh and run its stage")
    except LaunchTimeout as e:
        fail("13.1", f"every rank to finish within {limit:.0f} s ({world} ranks; "
             "the reference answer takes a few seconds)",
             f"your answer did not finish: {_stuck(str(e))}",
             "a rank waited for a peer that never came: every rank must build "
             "the same mesh, make the same collective calls, and the stage's "
             "group is the pipeline dimension's")
    return [[r[i] for r in ranks] for i in range(len(fns))]


def check_pp_tp_stage(pp_tp_stage: Callable) -> None:
    require_solution("13.1", pp_tp_stage)
    judge_stage(_run_stage([pp_tp_stage])[0])
    judge_stage(_run_stage([pp_tp_stage], world=2)[0])
    passed("13.1", "equal to one process on 4 ranks (tp 2 and 1) and on 2 (tp 2), "
           "with adjacent TP ranks.")


# ---------------------------------------------------------------- exercise 13.2

# a model whose heads and K/V heads divide by 3 and 6: degrees not powers of two
HEADS_48 = planner.Decoder("a 48-head model", 48, 6144, 24576, 48, 12, 50304)
# few wide layers: the deepest pipeline allowed is the fastest that fits
WIDE_12 = planner.Decoder("a 12-layer model", 12, 12288, 49152, 96, 8, 50304)

# (model, gpu, GPUs, seq, global batch, minimum tokens/s)
LAYOUT_CASES = (
    (planner.LLAMA3_8B, "h100_sxm", 64, 8192, 512, 0.0),
    (planner.LLAMA3_70B, "h100_sxm", 64, 4096, 256, 1.0e5),  # none that fast
    (planner.LLAMA3_8B, "t4", 16, 2048, 64, 0.0),  # fits with full recompute
    (planner.LLAMA2_7B, "l4", 24, 2048, 48, 1.0e3),
    (planner.LLAMA3_405B, "t4", 8, 2048, 8, 0.0),  # nothing fits
    (planner.LLAMA3_405B, "h100_sxm", 512, 8192, 128, 0.0),  # pp 16: uneven stages
    (planner.LLAMA3_8B, "h100_sxm", 16, 131072, 4, 0.0),  # context parallel
    (planner.MIXTRAL_8X7B, "h100_sxm", 64, 4096, 256, 0.0),  # expert parallel
    (planner.LLAMA3_70B, "a100_sxm_80gb", 128, 4096, 64, 0.0),
    (planner.LLAMA2_7B, "h100_sxm", 24, 2048, 24, 0.0),
    (planner.LLAMA3_8B, "t4", 16, 2048, 64, 3.0e3),  # met in all, not per GPU
    (HEADS_48, "l4", 48, 4096, 16, 0.0),  # tp 6
    (HEADS_48, "h100_sxm", 72, 12288, 36, 0.0),  # cp 6
    (WIDE_12, "t4", 48, 2048, 48, 0.0),  # pp 6: two layers a stage
)
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zero-bubble", 1))


def usable_bytes(gpu: str) -> float:
    """The GPU's memory times the memory model's worst published shortfall."""
    return (reference.published(f"{gpu}.memory_gb").value * 2**30
            * planner.memory_shortfall())


def allowed_layouts(model, n, seq, batch):
    """Every layout Exercise 13.2 allows, each with every variant."""
    for lay in planner.layouts(model, n, batch, seq=seq):
        for sched, v in SCHEDULES:
            if (lay.pp == 1 and sched != "1f1b") or v > model.layers // lay.pp:
                continue
            for rc in ("none", "selective", "full"):
                yield planner.Layout(lay.dp, lay.tp, lay.pp, 1, True, rc, lay.cp,
                                     lay.ep, sched, v)


@functools.cache
def expected_layout(case):
    """(step seconds, layout) of the fastest allowed layout that fits and meets
    the target; None if none does."""
    model, gpu, n, seq, batch, target = case
    capacity = usable_bytes(gpu)
    best = None
    for cand in allowed_layouts(model, n, seq, batch):
        if planner.memory_per_gpu(model, cand, seq, batch)["total"] > capacity:
            continue
        t = sum(planner.step_parts(model, cand, gpu, seq, batch).values())
        if batch * seq / t >= target and (best is None or t < best[0]):
            best = (t, cand)
    return best


def _layout_errors(model, got, n, seq, batch):
    """(what was expected, the hint) for the first rule ``got`` breaks."""
    if got.dp * got.cp * got.tp * got.pp != n:
        return (f"dp x cp x tp x pp = {n}", "use every GPU: the GPU count is an "
                "argument, not a constant")
    if got.tp > 8 or model.heads % got.tp or model.kv_heads % got.tp:
        return (f"tp at most 8, dividing {model.heads} heads and {model.kv_heads} "
                "key-value heads", "tensor parallelism stays inside an 8-GPU node "
                "and splits whole heads; with grouped queries, whole K/V heads too")
    if got.cp > 1 and (seq // 2) % got.cp:
        return (f"cp dividing half the sequence ({seq // 2})", "context "
                "parallelism cuts each sequence in 2 cp chunks (load balancing)")
    if not 1 <= got.pp <= model.layers // 2:
        return (f"pp from 1 to {model.layers // 2}", "at least two layers a stage")
    if batch % got.dp:
        return (f"dp dividing {batch} sequences", "each replica takes a whole "
                "share of the global batch")
    if got.ep != 1 and (not model.experts or model.experts % got.ep
                        or (got.dp * got.cp) % got.ep):
        return ("ep 1 for a dense model; for experts, dividing them and dp x cp",
                "experts are split over the data and context ranks")
    if not got.sharded:
        return ("FSDP (sharded=True, the default)", "the exercise searches FSDP "
                "layouts only")
    if got.micro_batch != 1 or got.stages or got.shard_group or (
            got.cp_method, got.attention_kernel) != ("all-gather", "sdpa") or not (
            got.fused_attention and got.sequence_parallel):
        return ("micro-batches of one sequence, the other fields at their "
                "defaults", "set only dp, tp, pp, cp, ep, sharded, recompute, "
                "schedule and virtual")
    if (got.schedule, got.virtual) not in SCHEDULES or (
            got.pp == 1 and got.schedule != "1f1b") or (
            got.virtual > model.layers // got.pp):
        return ("1f1b, or with pp > 1 interleaved (virtual 2 or 4, at most the "
                "layers per stage) or zero-bubble", "the schedule belongs to the "
                "pipeline: without one, 1f1b")
    return None


# what a search left out, the hint for it, and which layouts it then keeps
def _power_of_two(k: int) -> bool:
    return k & (k - 1) == 0


SEARCH_GAPS = (
    ("try every tp that divides the heads, up to 8: this model's split 3 or 6 "
     "ways, not only in powers of two", lambda m, x: _power_of_two(x.tp)),
    ("try every cp that divides half the sequence: 3 and 6 may, not only powers "
     "of two", lambda m, x: _power_of_two(x.cp)),
    ("try every divisor of the GPU count: degrees need not be powers of two",
     lambda m, x: all(_power_of_two(k) for k in (x.dp, x.tp, x.pp, x.cp, x.ep))),
    ("pp goes up to model.layers // 2 itself (stages of two layers)",
     lambda m, x: x.pp < m.layers // 2),
    ("pipeline depths need not divide the layers: the planner makes uneven "
     "stages, the ends lighter", lambda m, x: m.layers % x.pp == 0),
    ("try context parallelism: it splits each long sequence",
     lambda m, x: x.cp == 1),
    ("try every expert-parallel degree: it splits the experts' weights",
     lambda m, x: x.ep == 1),
    ("try every schedule: interleaving and zero-bubble schedules shrink the "
     "bubble", lambda m, x: x.schedule == "1f1b"),
    ("recompute only where a layout does not fit without it",
     lambda m, x: x.recompute == "full"),
    ("try every recomputation: recomputing lets a faster layout fit",
     lambda m, x: x.recompute == "none"),
)


@functools.cache
def _restricted(case, gap: int):
    """The layout a search that leaves out ``SEARCH_GAPS[gap]`` would return."""
    model, gpu, n, seq, batch, target = case
    keep = SEARCH_GAPS[gap][1]
    best = None
    for cand in allowed_layouts(model, n, seq, batch):
        if not keep(model, cand) or planner.memory_per_gpu(
                model, cand, seq, batch)["total"] > usable_bytes(gpu):
            continue
        t = sum(planner.step_parts(model, cand, gpu, seq, batch).values())
        if batch * seq / t >= target and (best is None or t < best[0]):
            best = (t, cand)
    return best and best[1]


def _search_hint(case, got) -> str:
    """The hints of every left-out part that explains ``got`` (a search
    without it returns ``got``), or none."""
    hints = [hint for i, (hint, _) in enumerate(SEARCH_GAPS)
             if _restricted(case, i) == got]
    return "".join(f"{h}; " for h in hints)


def _slower_hint(case, got):
    return (_search_hint(case, got) + "keep the layout with the shortest step "
            "time among all that fit, not the first one found nor the one with "
            "the most room")


def judge_layout(case, got) -> None:
    ex = "13.2"
    model, gpu, n, seq, batch, target = case
    where = (f"{model.name} on {n} x {gpu}, {batch} x {seq} tokens, at least "
             f"{target:.3g} tokens/s")
    best = expected_layout(case)
    if got is None:
        if best is None:
            return
        fast = batch * seq / best[0]
        fail(ex, f"a layout ({where})", "None",
             f"{best[1]} fits and makes {fast:.3g} tokens/s in all: the target is "
             "the global batch's tokens per second, not per GPU" if fast / n < target
             else _search_hint(case, None) + "a layout fits and is fast enough: "
             "search every allowed dp, cp, tp, pp and ep, each recomputation and "
             "schedule")
    if not isinstance(got, planner.Layout):
        fail(ex, f"a planner.Layout ({where})", f"a {type(got).__name__}",
             "return planner.Layout(dp, tp, pp, cp=..., ep=..., sharded=..., "
             "recompute=..., schedule=..., virtual=...)")
    if best is None:
        fail(ex, f"None: no layout fits and meets the target ({where})", str(got),
             "check the memory against the GPU's and the throughput against the "
             "target before keeping a layout")
    broken = _layout_errors(model, got, n, seq, batch)
    if broken:
        fail(ex, f"{broken[0]} ({where})", str(got), broken[1])
    capacity = usable_bytes(gpu)
    mem = planner.memory_per_gpu(model, got, seq, batch)["total"]
    if mem > capacity:
        full = reference.published(f"{gpu}.memory_gb").value
        fail(ex, f"a layout within {capacity / 2**30:.1f} GiB, the GPU's {full:g} "
             f"GiB x the memory model's shortfall ({where})",
             f"{got}: {mem / 2**30:.1f} GiB per GPU",
             "the memory model counted a third less than published runs held: "
             "keep memory_per_gpu(...)['total'] under memory_gb x 2**30 x "
             "planner.memory_shortfall()" if mem <= full * 2**30 else
             "compare planner.memory_per_gpu(...)['total'] with memory_gb x 2**30 "
             "x planner.memory_shortfall() (HBM sizes are binary: GiB)")
    t = sum(planner.step_parts(model, got, gpu, seq, batch).values())
    if batch * seq / t < target:
        fail(ex, f"at least {target:.3g} tokens/s ({where})",
             f"{got}: {batch * seq / t:.3g}", "tokens per second = global batch x "
             "sequence / step time: drop layouts below the target")
    if t > best[0] * (1 + 1e-9):
        fail(ex, f"the fastest layout that fits: {best[1]}, {best[0]:.3g} s "
             f"({where})", f"{got}: {t:.3g} s", _slower_hint(case, got))


def check_choose_layout(choose_layout: Callable) -> None:
    require_solution("13.2", choose_layout)
    _refuse_peeking("13.2", choose_layout)
    for case in LAYOUT_CASES:
        for _ in range(2):  # twice: nothing may carry over between calls
            judge_layout(case, _call("13.2", choose_layout, *case))
    passed("13.2", "the fastest layout that fits on every cluster - uneven "
           "pipeline stages, context and expert parallelism included - and None "
           "where none does.")


# ---------------------------------------------------------------- exercise 13.3

# (mesh shape, names, missing dims, dtype, scale, seed[, parameter]): the
# parameter is a linear layer's weight unless named; an output bias's gradient
# sums to zero on every rank (cross-entropy), an embedding's has exact zeros
# (rows of tokens no shard saw, row 0 among them)
REDUCTION_CASES = (
    ((2, 2), ("dp", "tp"), {"dp"}, torch.float32, 1.0, 0),
    ((2, 2), ("dp", "tp"), set(), torch.float32, 1e6, 1),
    ((3, 2), ("pp", "dp"), {"dp"}, torch.float64, 1e-6, 2),
    ((4,), ("dp",), set(), torch.float64, 1.0, 3),
    ((2, 3, 2), ("dp", "cp", "tp"), {"cp", "tp"}, torch.float32, 1e-5, 4),
    ((2, 2, 2), ("pp", "dp", "tp"), {"pp"}, torch.float32, 3e4, 5),
    ((5,), ("dp",), {"dp"}, torch.float32, 1.0, 6),
    ((3, 2), ("dp", "tp"), set(), torch.float32, 1e-6, 7),
    ((2, 2), ("dp", "tp"), {"tp"}, torch.float64, 1e-12, 8),
    ((2, 3), ("dp", "cp"), {"dp"}, torch.float32, 1.0, 9, "bias"),
    ((2, 2), ("dp", "tp"), {"tp"}, torch.float32, 1.0, 10, "embedding"),
    ((3, 2), ("dp", "tp"), set(), torch.float64, 1e3, 11, "embedding"),
    # shards that nearly agree: a missing reduction moves the gradient by a few
    # 1e-4 of its size in float32, a few 1e-7 in float64 (a 1% tolerance, or
    # float32's for float64, misses it)
    ((2, 2), ("dp", "tp"), {"dp"}, torch.float32, 1.0, 12, "linear",
     {"spread": 3e-2}),
    ((3, 2), ("dp", "cp"), {"cp"}, torch.float64, 10.0, 13, "linear",
     {"spread": 1e-6}),
    # one TP rank's data-parallel reduction lost: its dp group disagrees, the
    # other agrees, and the two TP ranks differ (a line through rank 0 sees
    # only the second); then only on the ranks at pp 1 and tp 1, which differ
    # from their neighbours along all three dimensions
    ((3, 2), ("dp", "tp"), {"dp", "tp"}, torch.float32, 1.0, 14, "linear",
     {"lost": {"dp"}, "where": {1: 1}}),
    ((2, 2, 2), ("pp", "dp", "tp"), {"pp", "dp", "tp"}, torch.float64, 1e-3, 15,
     "linear", {"lost": {"dp"}, "where": {0: 1, 2: 1}}),
    # every reduction done, one element summing to nearly zero: its relative
    # rounding error is large, not the gradient's
    ((2, 3), ("dp", "tp"), set(), torch.float32, 1.0, 16, "linear",
     {"cancel": True}),
)


def _shard_gradient(kind, w, g, dtype, scale):
    """One rank's gradient of ``w`` on its own shard of the batch, by autograd."""
    wc = w.clone().requires_grad_()
    if kind == "bias":  # an output layer's bias under cross-entropy
        logits = torch.randn(3, w.numel(), generator=g, dtype=dtype) * 3 + wc
        targets = torch.randint(0, w.numel(), (3,), generator=g)
        (scale * F.cross_entropy(logits, targets)).backward()
    elif kind == "embedding":  # tokens 2.. only: rows 0 and 1 stay zero
        tokens = torch.randint(2, w.shape[0], (4,), generator=g)
        y = torch.randn(4, w.shape[1], generator=g, dtype=dtype) * scale
        F.mse_loss(F.embedding(tokens, wc), y).backward()
    else:
        x = torch.randn(3, 7, generator=g, dtype=dtype) * (1 + 9 * torch.rand(
            1, generator=g).item())
        y = torch.randn(3, 5, generator=g, dtype=dtype) * scale
        F.mse_loss(x @ wc.t(), y).backward()
    return wc.grad


def make_gradients(case) -> dict[tuple, torch.Tensor]:
    """Per coordinate, one parameter's gradient as ranks would hold it.

    A linear layer's weight gradient on a shard of the batch, by autograd: a
    rank whose reduction is missing along some dimensions holds the mean over
    the shards it did reduce, computed in its own order (so rounding
    differs); a correct rank holds the mean over all shards.
    """
    shape, names, missing, dtype, scale, seed = case[:6]
    kind = case[6] if len(case) > 6 else "linear"
    opts = case[7] if len(case) > 7 else {}
    g = torch.Generator().manual_seed(seed)
    size = {"bias": (6,), "embedding": (9, 4)}.get(kind, (5, 7))
    w = (torch.randn(*size, generator=g, dtype=torch.float64) * scale).to(dtype)
    coords = list(itertools.product(*(range(s) for s in shape)))
    shards = {c: _shard_gradient(kind, w, g, dtype, scale) for c in coords}
    if "spread" in opts:  # a common gradient, each shard off by a little
        common = _shard_gradient(kind, w, g, dtype, scale)
        shards = {c: common + opts["spread"] * t for c, t in shards.items()}
    if opts.get("cancel"):  # element 0's mean over all shards is about zero
        mean0 = sum(t.double().flatten()[0] for t in shards.values()) / len(coords)
        for t in shards.values():
            t.view(-1)[0] -= mean0.to(dtype)
    lost = opts.get("lost", missing)  # the reductions lost, on the ranks `where`
    kept = [i for i, n in enumerate(names) if n in lost]
    out = {}
    for c in coords:
        group = [d for d in coords if all(d[i] == c[i] for i in kept)]
        if any(c[i] != v for i, v in opts.get("where", {}).items()):
            group = coords  # this rank's reductions all ran
        order = group[len(group) // 2:] + group[:len(group) // 2]  # this rank's order
        if sum(c) % 2:
            order = order[::-1]
        total = torch.zeros_like(w)
        for d in order:
            total = total + shards[d]
        out[c] = total / len(group)
    return out


def judge_reduction(case, got) -> None:
    ex = "13.3"
    shape, names, missing, dtype, scale = case[:5]
    kind = {"bias": "an output bias's ", "embedding": "an embedding's "}.get(
        case[6] if len(case) > 6 else "", "")
    where = (f"mesh {shape} {names}, {kind}{str(dtype).replace('torch.', '')} "
             f"gradients of size about {scale:g}")
    if isinstance(got, str) or not isinstance(got, (set, frozenset, list, tuple)):
        fail(ex, f"a set of dimension names ({where})", repr(got)[:80],
             "return a set of names from dim_names, empty when nothing is missing")
    got = set(got)
    if got == missing:
        return
    opts = case[7] if len(case) > 7 else {}
    if got < missing and "spread" in opts:
        hint = ("the ranks differ by only a few 1e-3 of the gradient in float32, "
                "a few 1e-6 in float64: a tolerance just above rounding (about "
                "1e-6 of the largest element for float32, 1e-15 for float64) tells "
                "them apart, 1% or float32's tolerance for float64 does not")
    elif got != missing and "where" in opts and not got - missing:
        hint = ("only some ranks of a dimension disagree here: compare every rank "
                "with its neighbour along each dimension, not only the ranks on a "
                "line through rank 0")
    elif got > missing and opts.get("cancel"):
        hint = ("one element sums to nearly zero: its rounding is large relative "
                "to itself, not to the gradient; compare with a tolerance "
                "relative to the largest element, not element by element")
    elif not got - set(names) and got > missing and not missing:
        hint = ("the ranks differ only by rounding here: compare with a tolerance "
                "relative to the gradients' magnitude (float32 about 1e-6 of it)")
    elif got > missing and kind:
        hint = ("a dimension was flagged where ranks agree: an element-wise "
                "relative error divides 0 by 0 where every rank's gradient is "
                "exactly zero; compare with a tolerance relative to the largest "
                "element")
    elif got > missing:
        hint = ("a dimension was flagged that only differs by rounding, or because "
                "another dimension differs: compare ranks that differ in one "
                "coordinate only, with a tolerance relative to the magnitude")
    elif got < missing and kind:
        hint = ("a real disagreement was missed: compare every element of the "
                "gradients (a sum or one element can agree where the rest do "
                "not), with a tolerance relative to the largest one")
    elif got < missing:
        hint = ("a real disagreement was missed: the tolerance must scale with the "
                "gradients' size (an absolute 1e-6, or allclose's 1e-8, hides "
                "gradients of size 1e-9), and every dimension and coordinate must "
                "be compared")
    else:
        hint = ("compare ranks that differ in exactly one mesh coordinate, for each "
                "dimension in turn, and name the dimension by dim_names")
    fail(ex, f"missing reductions {sorted(missing) or 'none'} ({where})",
         f"{sorted(got) if got else 'none'}", hint)


def _as_names(got):
    """The learner's answer as a set if it is a collection (an iterator is
    walked here, inside the time limit), else as given."""
    if isinstance(got, str) or not hasattr(got, "__iter__"):
        return got
    return set(got) if not isinstance(got, (set, frozenset, list, tuple)) else got


def answer_reductions(fn, case, grads):
    """``fn``'s answer for ``case``: a fresh copy of the gradients, within the
    time limit; an iterator is walked there."""
    return _call("13.3", fn, {c: t.clone() for c, t in grads.items()},
                 tuple(case[1]), convert=_as_names)


def check_missing_reductions(missing_reductions: Callable) -> None:
    require_solution("13.3", missing_reductions)
    _refuse_peeking("13.3", missing_reductions)
    for case in REDUCTION_CASES:
        grads = make_gradients(case)
        for _ in range(2):  # twice, with the same dict: nothing may carry over
            judge_reduction(case, answer_reductions(missing_reductions, case, grads))
    passed("13.3", "every missing reduction found, none invented.")
