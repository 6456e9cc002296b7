"""Chapter 13's checkers: right answers written differently pass, and typical
mistakes fail with a message that names them.

Exercise 13.1's answers run together in one launch of 4 ranks (the checker's
rank function takes a list of answers); each is then judged. The wrong
answers are ones that run to the end on every rank (a wrong answer that
raises on one pipeline stage only would leave the other waiting)."""

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import ColwiseParallel as Col

from course_utils import planner, reference
from course_utils.checks import ch13
from course_utils.exercises import ExerciseFailed


def rejected(judge, *args):
    with pytest.raises(ExerciseFailed) as e:
        judge(*args)
    return str(e.value)


# ------------------------------------------------------------------ 13.1

PLAN = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
        "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def keep_stage(model, index, n_stages, extra=0, per=None):
    names = list(model.layers)
    if per:  # `per` blocks a stage, whatever the depth
        keep = names[index * per:(index + 1) * per + extra]
    else:  # every block on one stage, the later stages one deeper where needed
        keep = names[index * len(names) // n_stages:
                     (index + 1) * len(names) // n_stages + extra]
    for name in names:
        if name not in keep:
            del model.layers[name]
    if index > 0:
        model.embed = None
    if index < n_stages - 1:
        model.norm = model.head = None
    return model


def make_tp(model, mesh):
    for block in model.layers.values():
        parallelize_module(block, mesh, PLAN)
    return model


def right_device_mesh(model, tp):
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world).view(-1, tp),
                      mesh_dim_names=("pp", "tp"))
    i = mesh.get_local_rank("pp")
    stage = make_tp(keep_stage(model, i, world // tp), mesh["tp"])
    return PipelineStage(stage, i, world // tp, torch.device("cpu"),
                         group=mesh.get_group("pp"))


def right_tp_first(model, tp):
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    model = make_tp(model, mesh["tp"])  # parallelize every block, then cut
    i = dist.get_rank() // tp
    return PipelineStage(keep_stage(model, i, n), i, n, "cpu",
                         group=mesh["pp"].get_group())


class RightBuilder:
    def __call__(self, model, tp):
        n = dist.get_world_size() // tp
        mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("stage", "model"))
        i = mesh.get_coordinate()[0]
        stage = make_tp(keep_stage(model, i, n), mesh["model"])
        return PipelineStage(stage, i, n, torch.device("cpu"), group=mesh.get_group(0))


right_class = RightBuilder()


def right_rebuilt_dict(model, tp):
    import torch.nn as tnn

    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    names = list(model.layers)
    per, extra = divmod(len(names), n)  # the first `extra` stages one deeper
    start = i * per + min(i, extra)
    model.layers = tnn.ModuleDict({k: model.layers[k] for k in names[
        start:start + per + (i < extra)]})
    if i:
        model.embed = None
    if i != n - 1:
        model.norm, model.head = None, None
    plan = {"attn.wq": Col(), "attn.wk": Col(), "attn.wv": Col(),
            "attn.wo": RowwiseParallel(), "mlp.0": Col(), "mlp.2": RowwiseParallel()}
    for block in model.layers.values():
        parallelize_module(block, mesh["tp"], plan)
    return PipelineStage(model, i, n, torch.device("cpu"), group=mesh["pp"].get_group())


def right_with_extra_work(model, tp):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("pp", "tp"))
    model.zero_grad()  # harmless
    _ = sum(p.numel() for p in model.parameters())
    stage = keep_stage(model, rank // tp, world // tp)
    for block in stage.layers.values():
        parallelize_module(block, mesh["tp"], dict(PLAN))
    return PipelineStage(stage, rank // tp, world // tp, torch.device("cpu"),
                         group=mesh["pp"].get_group())


def wrong_swapped_mesh(model, tp):  # TP ranks 0 and 2: across "nodes"
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (tp, n), mesh_dim_names=("tp", "pp"))
    i = mesh["pp"].get_local_rank()
    stage = make_tp(keep_stage(model, i, n), mesh["tp"])
    return PipelineStage(stage, i, n, torch.device("cpu"), group=mesh["pp"].get_group())


def wrong_fixed_tp(model, tp):
    return right_device_mesh(model, 2)


def wrong_ignores_tp(model, tp):  # every rank its own stage
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    i = dist.get_rank()
    return PipelineStage(keep_stage(model, i, world), i, world, torch.device("cpu"),
                         group=mesh.get_group())


def wrong_no_tp(model, tp):
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    return PipelineStage(keep_stage(model, i, n), i, n, torch.device("cpu"),
                         group=mesh["pp"].get_group())


def wrong_all_blocks(model, tp):  # keeps every block on every stage
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    if i > 0:
        model.embed = None
    if i < n - 1:
        model.norm = model.head = None
    return PipelineStage(make_tp(model, mesh["tp"]), i, n, torch.device("cpu"),
                         group=mesh["pp"].get_group())


def wrong_one_block_each(model, tp):
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    stage = make_tp(keep_stage(model, i, n, per=1), mesh["tp"])
    return PipelineStage(stage, i, n, torch.device("cpu"), group=mesh["pp"].get_group())


def wrong_overlap(model, tp):  # off by one: a block on two stages
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    stage = make_tp(keep_stage(model, i, n, extra=1), mesh["tp"])
    return PipelineStage(stage, i, n, torch.device("cpu"), group=mesh["pp"].get_group())


def wrong_float32(model, tp):
    return right_device_mesh(model.float(), tp)


_CACHE = {}


def wrong_cached_mesh(model, tp):  # the first call's mesh, reused
    world = dist.get_world_size()
    if "mesh" not in _CACHE:
        _CACHE["mesh"] = init_device_mesh("cpu", (world // tp, tp),
                                          mesh_dim_names=("pp", "tp"))
    mesh = _CACHE["mesh"]
    n, i = mesh["pp"].size(), mesh["pp"].get_local_rank()
    stage = make_tp(keep_stage(model, i, n), mesh["tp"])
    return PipelineStage(stage, i, n, torch.device("cpu"), group=mesh["pp"].get_group())


def wrong_fresh_model(model, tp):  # new weights instead of the given ones
    fresh = type(model)(n_layers=len(model.layers)).to(next(model.parameters()).dtype)
    return right_device_mesh(fresh, tp)


def right_new_groups(model, tp):
    """The pipeline groups made by hand: ranks t, t + tp, t + 2 tp, ..."""
    rank, n = dist.get_rank(), dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    groups = [dist.new_group([s * tp + t for s in range(n)]) for t in range(tp)]
    stage = make_tp(keep_stage(model, rank // tp, n), mesh["tp"])
    return PipelineStage(stage, rank // tp, n, torch.device("cpu"),
                         group=groups[rank % tp])


def wrong_world_group(model, tp):  # PipelineStage on every rank of the job
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    return PipelineStage(make_tp(keep_stage(model, i, n), mesh["tp"]), i, n, "cpu")


def wrong_drops_leftover(model, tp):  # len // n blocks a stage: the rest lost
    n = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (n, tp), mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    stage = make_tp(keep_stage(model, i, n, per=len(model.layers) // n), mesh["tp"])
    return PipelineStage(stage, i, n, torch.device("cpu"), group=mesh["pp"].get_group())


def wrong_two_stages(model, tp):
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                            mesh_dim_names=("pp", "tp"))
    i = mesh["pp"].get_local_rank()
    stage = make_tp(keep_stage(model, i, 2), mesh["tp"])
    return PipelineStage(stage, i, 2, torch.device("cpu"), group=mesh["pp"].get_group())


RIGHT_STAGE = [right_device_mesh, right_tp_first, right_class, right_rebuilt_dict,
               right_with_extra_work, right_new_groups]
WRONG_STAGE = {
    wrong_swapped_mesh: "adjacent", wrong_fixed_tp: "pipeline stages",
    wrong_ignores_tp: "pipeline stages", wrong_no_tp: "sharded",
    wrong_all_blocks: "exactly one stage", wrong_one_block_each: "exactly one stage",
    wrong_overlap: "exactly one stage", wrong_float32: "dtype",
    wrong_cached_mesh: "pipeline stages", wrong_fresh_model: "given model's weights",
    wrong_two_stages: "pipeline stages", wrong_drops_leftover: "missing",
    wrong_world_group: "group=mesh['pp'].get_group()",
}


@pytest.fixture(scope="module")
def stage_results():
    """Each answer's results on 4 ranks and on 2, judged together."""
    fns = RIGHT_STAGE + list(WRONG_STAGE)
    return dict(zip(fns, zip(ch13._run_stage(fns), ch13._run_stage(fns, world=2),
                             strict=True), strict=True))


def judge_both(results):
    for ranks in results:
        ch13.judge_stage(ranks)


@pytest.mark.parametrize("fn", RIGHT_STAGE, ids=lambda f: getattr(f, "__name__", "cls"))
def test_stage_right_answers_pass(stage_results, fn):
    judge_both(stage_results[fn])


@pytest.mark.parametrize("fn", list(WRONG_STAGE), ids=lambda f: f.__name__)
def test_stage_wrong_answers_fail(stage_results, fn):
    msg = rejected(judge_both, stage_results[fn])
    assert WRONG_STAGE[fn] in msg, msg


# 13.2: at the end of this file.


# ------------------------------------------------------------------ 13.3


def _tol(t):
    return 1e-3 if t.dtype == torch.float32 else 1e-8


def right_pairs(grads, dim_names):
    out = set()
    for a, b in itertools.combinations(grads, 2):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) == 1:
            ga, gb = grads[a], grads[b]
            scale = max(ga.abs().max().item(), gb.abs().max().item())
            if not torch.allclose(ga, gb, rtol=0, atol=_tol(ga) * scale):
                out.add(dim_names[diff[0]])
    return out


def right_std(grads, dim_names):
    coords = sorted(grads)
    found = set()
    for d, name in enumerate(dim_names):
        groups = {}
        for c in coords:
            groups.setdefault(c[:d] + c[d + 1:], []).append(grads[c].double())
        for group in groups.values():
            stack = torch.stack(group)
            spread = (stack.max(0).values - stack.min(0).values).abs().max()
            if spread > _tol(grads[coords[0]]) * stack.abs().max():
                found.add(name)
    return found


class RightFinder:
    def __call__(self, grads, dim_names):
        return {n for d, n in enumerate(dim_names) if self.differs(grads, d)}

    @staticmethod
    def differs(grads, d):
        for c, g in grads.items():
            ref = grads[c[:d] + (0,) + c[d + 1:]]
            if (g - ref).norm() > _tol(g) * ref.norm() / 10:
                return True
        return False


right_finder = RightFinder()


def right_mean(grads, dim_names):
    shape = tuple(max(c[i] for c in grads) + 1 for i in range(len(dim_names)))
    full = torch.stack([grads[c].double() for c in sorted(grads)]).view(
        *shape, *next(iter(grads.values())).shape)
    dtype = next(iter(grads.values())).dtype
    out = set()
    for d, name in enumerate(dim_names):
        dev = (full - full.mean(d, keepdim=True)).abs().max()
        if dev > _tol(torch.empty(0, dtype=dtype)) * full.abs().max():
            out.add(name)
    return out


def right_numpy_answer(grads, dim_names):
    arr = {c: g.double().numpy() for c, g in grads.items()}
    tol = 1e-3 if next(iter(grads.values())).dtype == torch.float32 else 1e-8
    missing = []
    for d, name in enumerate(dim_names):
        for c, a in arr.items():
            b = arr[c[:d] + (0,) + c[d + 1:]]
            if np.abs(a - b).max() > tol * max(np.abs(a).max(), np.abs(b).max()):
                missing.append(name)
                break
    return frozenset(missing)


def wrong_exact(grads, dim_names):
    return {n for d, n in enumerate(dim_names)
            if any(not torch.equal(g, grads[c[:d] + (0,) + c[d + 1:]])
                   for c, g in grads.items())}


def wrong_vs_origin(grads, dim_names):  # every dimension of a differing rank
    origin = grads[tuple(0 for _ in dim_names)]
    out = set()
    for c, g in grads.items():
        if (g - origin).abs().max() > _tol(g) * origin.abs().max():
            out |= {dim_names[i] for i, x in enumerate(c) if x}
    return out


def wrong_fixed_names(grads, dim_names):
    return {("dp", "tp", "pp")[d] for d in range(len(dim_names))
            if RightFinder.differs(grads, d)}


def wrong_first_dim_only(grads, dim_names):
    return {dim_names[0]} if RightFinder.differs(grads, 0) else set()


def wrong_indices(grads, dim_names):
    return {d for d in range(len(dim_names)) if RightFinder.differs(grads, d)}


_SEEN = set()


def wrong_accumulates(grads, dim_names):
    _SEEN.update(right_pairs(grads, dim_names))
    return set(_SEEN)


def wrong_absolute_tol(grads, dim_names):
    return {n for d, n in enumerate(dim_names)
            if any((g - grads[c[:d] + (0,) + c[d + 1:]]).abs().max() > 1e-4
                   for c, g in grads.items())}


def wrong_float64_tol(grads, dim_names):  # 1e-9 of the magnitude for float32 too
    out = set()
    for d, n in enumerate(dim_names):
        for c, g in grads.items():
            o = grads[c[:d] + (0,) + c[d + 1:]]
            if (g - o).abs().max() > 1e-9 * o.abs().max():
                out.add(n)
    return out


def wrong_inverted(grads, dim_names):
    return set(dim_names) - right_pairs(grads, dim_names)


def wrong_first_found(grads, dim_names):
    for d, n in enumerate(dim_names):
        if RightFinder.differs(grads, d):
            return {n}
    return set()


RIGHT_REDUCTION = [right_pairs, right_std, right_finder, right_mean, right_numpy_answer]
WRONG_REDUCTION = [wrong_exact, wrong_vs_origin, wrong_fixed_names,
                   wrong_first_dim_only, wrong_indices, wrong_accumulates,
                   wrong_absolute_tol, wrong_float64_tol, wrong_inverted,
                   wrong_first_found]


def _judge_all_reductions(fn):
    for case in ch13.REDUCTION_CASES:
        grads = ch13.make_gradients(case)
        for _ in range(2):
            ch13.judge_reduction(case, ch13.answer_reductions(fn, case, grads))


@pytest.mark.parametrize("fn", RIGHT_REDUCTION,
                         ids=lambda f: getattr(f, "__name__", "cls"))
def test_reduction_right_answers_pass(fn):
    _judge_all_reductions(fn)


@pytest.mark.parametrize("fn", WRONG_REDUCTION, ids=lambda f: f.__name__)
def test_reduction_wrong_answers_fail(fn):
    _SEEN.clear()
    msg = rejected(_judge_all_reductions, fn)
    assert "missing reductions" in msg or "set of dimension names" in msg, msg


def test_gradients_disagree_only_along_missing_dimensions():
    for case in ch13.REDUCTION_CASES:
        assert right_pairs(ch13.make_gradients(case), case[1]) == case[2]


def test_reduction_checker_runs_the_learner_code():
    ch13.check_missing_reductions(right_pairs)
    with pytest.raises(ExerciseFailed):
        ch13.check_missing_reductions(wrong_exact)


# Answers written without reading the ones above: each wrong one with the words
# its failure must contain.

def _one_apart(grads, dim_names, close):
    out = set()
    for d, name in enumerate(dim_names):
        for c, g in grads.items():
            for c2, g2 in grads.items():
                apart = [i for i in range(len(c)) if c[i] != c2[i]]
                if apart == [d] and not close(g, g2):
                    out.add(name)
    return out


def wrong_allclose_defaults(grads, dim_names):  # atol 1e-8 hides 1e-11 gradients
    return _one_apart(grads, dim_names, lambda a, b: torch.allclose(a, b))


def wrong_sums(grads, dim_names):  # an output bias's gradient sums to zero
    return _one_apart(grads, dim_names, lambda a, b: abs(a.sum() - b.sum())
                      <= 1e-3 * a.abs().sum())


def wrong_first_element(grads, dim_names):  # an embedding's row 0 is zero
    return _one_apart(grads, dim_names, lambda a, b: abs(
        a.flatten()[0] - b.flatten()[0]) <= 1e-3 * a.abs().max())


def wrong_elementwise_relative(grads, dim_names):  # 0 / 0 where rows are zero
    return _one_apart(grads, dim_names,
                      lambda a, b: ((a - b).abs() / b.abs()).max() <= 1e-4)


def wrong_two_dims_only(grads, dim_names):  # a 2-D mesh assumed
    out = set()
    for c, g in grads.items():
        for d in range(min(2, len(c))):
            twin = grads[c[:d] + (0,) + c[d + 1:]]
            if not torch.allclose(g, twin, rtol=1e-3, atol=0):
                out.add(dim_names[d])
    return out


def wrong_eps_tolerance(grads, dim_names):  # float32's epsilon: rounding flagged
    return _one_apart(grads, dim_names, lambda a, b: (a - b).abs().max()
                      <= 1e-7 * a.abs().max())


def wrong_half_precision(grads, dim_names):  # compared in float16: overflows
    return _one_apart(grads, dim_names, lambda a, b: not (
        (a.half() - b.half()).abs().max() > 1e-2 * a.half().abs().max()))


_BY_NAMES = {}


def wrong_cached_by_names(grads, dim_names):  # the first answer for these names
    key = tuple(dim_names)
    if key not in _BY_NAMES:
        _BY_NAMES[key] = right_pairs(grads, dim_names)
    return _BY_NAMES[key]


def wrong_in_place(grads, dim_names):  # subtracts in place: later pairs see zeros
    out = set()
    for d, name in enumerate(dim_names):
        for c, g in grads.items():
            other = grads[c[:d] + (0,) + c[d + 1:]]
            if other is not g:
                g.sub_(other)
                if g.abs().max() > 1e-3 * other.abs().max():
                    out.add(name)
    return out


def wrong_std_absolute(grads, dim_names):  # an absolute tolerance on the spread
    return _one_apart(grads, dim_names, lambda a, b: (a - b).std() <= 1e-6)


def wrong_reads_frames(grads, dim_names):
    import inspect
    for f in inspect.stack():
        if "case" in f.frame.f_locals:
            return set(f.frame.f_locals["case"][2])
    return set()


def wrong_replays_cases(grads, dim_names):
    from course_utils.checks import ch13 as checker
    for case in checker.REDUCTION_CASES:
        if tuple(case[1]) == tuple(dim_names):
            made = checker.make_gradients(case)
            if all(torch.equal(made[k], grads[k]) for k in made):
                return set(case[2])
    return set()


def wrong_endless(grads, dim_names):  # a generator that never ends
    def names():
        while True:
            yield dim_names[0]
    return names()


def wrong_one_percent(grads, dim_names):  # a loose tolerance for both dtypes
    return _one_apart(grads, dim_names, lambda a, b: (a - b).abs().max()
                      <= 1e-2 * max(a.abs().max(), b.abs().max()))


def wrong_float32_tol_for_float64(grads, dim_names):  # one tolerance, 1e-4
    return _one_apart(grads, dim_names, lambda a, b: (a - b).abs().max()
                      <= 1e-4 * max(a.abs().max(), b.abs().max()))


def wrong_line_through_origin(grads, dim_names):  # compares rank 0's lines only
    origin = tuple(0 for _ in dim_names)
    out = set()
    for c, g in grads.items():
        moved = [i for i in range(len(c)) if c[i]]
        o = grads[origin]
        if len(moved) == 1 and (g - o).abs().max() > _tol(g) * o.abs().max():
            out.add(dim_names[moved[0]])
    return out


def wrong_relative_per_element(grads, dim_names):  # zeros skipped, tiny kept
    def close(a, b):
        seen = (a != 0) | (b != 0)
        rel = (a - b).abs()[seen] / b.abs()[seen].clamp(min=1e-30)
        return rel.numel() == 0 or rel.max() <= _tol(a)
    return _one_apart(grads, dim_names, close)


def wrong_string(grads, dim_names):
    return ",".join(sorted(right_pairs(grads, dim_names)))


NEW_WRONG_REDUCTION = {
    wrong_allclose_defaults: "allclose's 1e-8",
    wrong_sums: "a sum or one element",
    wrong_first_element: "a sum or one element",
    wrong_elementwise_relative: "divides 0 by 0",
    wrong_two_dims_only: "every dimension",
    wrong_eps_tolerance: "by rounding",  # the CPU's rounding picks the case
    wrong_half_precision: "missing reductions ['pp']",
    wrong_cached_by_names: "differ only by rounding",
    wrong_in_place: "differ only by rounding",
    wrong_std_absolute: "differ only by rounding",
    wrong_reads_frames: "reads the checker",
    wrong_replays_cases: "reads the checker",
    wrong_endless: "never ends",
    wrong_string: "a set of dimension names",
    wrong_one_percent: "a few 1e-3",
    wrong_float32_tol_for_float64: "a few 1e-6",
    wrong_line_through_origin: "only some ranks",
    wrong_relative_per_element: "relative to the largest element",
}


def right_float64_norms(grads, dim_names):
    eps = {torch.float32: 1e-4, torch.float64: 1e-10}[next(iter(grads.values())).dtype]
    wide = {c: t.double() for c, t in grads.items()}
    return _one_apart(wide, dim_names,
                      lambda a, b: (a - b).norm() <= eps * max(a.norm(), b.norm()))


def right_spread(grads, dim_names):
    coords = sorted(grads)
    shape = tuple(max(c[i] for c in coords) + 1 for i in range(len(dim_names)))
    x = torch.stack([grads[c] for c in coords]).reshape(*shape, -1).double()
    tol = 1000 * torch.finfo(grads[coords[0]].dtype).eps * x.abs().max()
    return {n for d, n in enumerate(dim_names)
            if (x.amax(d) - x.amin(d)).abs().max() > tol}


class RightCallable:
    def __init__(self, rtol=1e-3):
        self.rtol = rtol

    def __call__(self, grads, dim_names):
        names = list(dim_names)
        wide = next(iter(grads.values())).dtype == torch.float64
        rtol = self.rtol * 1e-6 if wide else self.rtol
        return {names[d] for d in range(len(names)) for c in grads for c2 in grads
                if sum(a != b for a, b in zip(c, c2, strict=True)) == 1
                and c[d] != c2[d]
                and not torch.allclose(grads[c], grads[c2], rtol=rtol,
                                       atol=rtol * grads[c].abs().max().item())}


def right_numpy_frozenset(grads, dim_names):
    arr = {c: t.numpy() for c, t in grads.items()}
    tol = 1e-4 if next(iter(arr.values())).dtype == np.float32 else 1e-10
    return frozenset(n for d, n in enumerate(dim_names) for c in arr
                     if not np.allclose(arr[c], arr[c[:d] + (0,) + c[d + 1:]],
                                        rtol=tol, atol=tol * np.abs(arr[c]).max()))


def right_sorted_list(grads, dim_names):  # a list, with repeats
    top = max(t.abs().max().item() for t in grads.values())
    return [n for d, n in enumerate(dim_names) for c in grads
            if c[d] and not torch.allclose(grads[c], grads[c[:d] + (0,) + c[d + 1:]],
                                           rtol=0, atol=_tol(grads[c]) * top)]


def right_lazy(grads, dim_names):  # a generator that ends
    return (n for n in RightCallable(2e-3)(grads, dim_names))


NEW_RIGHT_REDUCTION = [right_float64_norms, right_spread, RightCallable(),
                       right_numpy_frozenset, right_sorted_list, right_lazy]


def _judge_checked(fn):
    ch13._refuse_peeking("13.3", fn)
    _judge_all_reductions(fn)


@pytest.mark.parametrize("fn", NEW_RIGHT_REDUCTION,
                         ids=lambda f: getattr(f, "__name__", "cls"))
def test_reduction_new_right_answers_pass(fn):
    _judge_checked(fn)


@pytest.mark.parametrize("fn", list(NEW_WRONG_REDUCTION), ids=lambda f: f.__name__)
def test_reduction_new_wrong_answers_fail(fn, monkeypatch):
    monkeypatch.setattr(ch13, "answer_limit", lambda *a, **k: 2)
    _BY_NAMES.clear()
    msg = rejected(_judge_checked, fn)
    assert NEW_WRONG_REDUCTION[fn] in msg, msg


# 13.1: more answers, written without reading the ones above (each runs to the
# end on every rank: an answer that hangs one stage is judged by the launch's
# timeout, which these tests do not wait for).

def _cut(model, i, n):
    names = list(model.layers)
    per = len(names) // n  # the last stage takes what is left over
    for k in names[:i * per] + (names[(i + 1) * per:] if i < n - 1 else []):
        del model.layers[k]
    if i:
        model.embed = None
    if i != n - 1:
        model.norm = None
        model.head = None
    return model


def _pp_tp(tp):
    return init_device_mesh("cpu", (dist.get_world_size() // tp, tp),
                            mesh_dim_names=("pp", "tp"))


def _partial_plan(model, tp, keys, blocks=None):
    mesh = _pp_tp(tp)
    i, n = mesh["pp"].get_local_rank(), mesh["pp"].size()
    stage = _cut(model, i, n)
    for b in list(stage.layers.values())[:blocks]:
        parallelize_module(b, mesh["tp"], {k: PLAN[k] for k in keys})
    return PipelineStage(stage, i, n, "cpu", group=mesh["pp"].get_group())


def right_wildcard_plan(model, tp):
    mesh = _pp_tp(tp)
    i, n = mesh["pp"].get_local_rank(), mesh["pp"].size()
    plan = {f"layers.*.{k}": style for k, style in PLAN.items()}
    stage = parallelize_module(_cut(model, i, n), mesh["tp"], plan)
    return PipelineStage(stage, i, n, torch.device("cpu"), group=mesh["pp"].get_group())


def right_deepcopy_per_linear(model, tp):
    import copy

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", [[r + k for k in range(tp)] for r in range(0, world, tp)],
                      mesh_dim_names=("pipe", "tensor"))
    i, n = rank // tp, world // tp
    stage = _cut(copy.deepcopy(model), i, n)
    for b in stage.layers.values():
        for lin in (b.attn.wq, b.attn.wk, b.attn.wv, b.mlp[0]):
            parallelize_module(lin, mesh["tensor"], ColwiseParallel())
        for lin in (b.attn.wo, b.mlp[2]):
            parallelize_module(lin, mesh["tensor"], RowwiseParallel())
    return PipelineStage(stage, i, n, "cpu", group=mesh.get_group("pipe"))


class RightCounting:
    def __init__(self):
        self.calls = 0

    def __call__(self, model, tp):
        self.calls += 1  # harmless state
        return right_wildcard_plan(model, tp)


def right_by_submodule(model, tp):
    mesh = _pp_tp(tp)
    i, _ = mesh.get_coordinate()
    n = mesh.shape[0]
    stage = _cut(model, i, n)
    for b in stage.layers.values():
        parallelize_module(b.attn, mesh["tp"], {"wq": Col(), "wk": Col(), "wv": Col(),
                                                "wo": RowwiseParallel()})
        parallelize_module(b.mlp, mesh["tp"], {"0": Col(), "2": RowwiseParallel()})
    return PipelineStage(stage, i, n, torch.device("cpu"),
                         group=mesh.get_group(mesh_dim="pp"))


def wrong_attention_only(model, tp):
    return _partial_plan(model, tp, ("attn.wq", "attn.wk", "attn.wv", "attn.wo"))


def wrong_mlp_only(model, tp):
    return _partial_plan(model, tp, ("mlp.0", "mlp.2"))


def wrong_first_block_only(model, tp):
    return _partial_plan(model, tp, tuple(PLAN), blocks=1)


def wrong_float64_always(model, tp):
    return right_wildcard_plan(model.double(), tp)


def wrong_bfloat16(model, tp):
    return right_wildcard_plan(model.to(torch.bfloat16), tp)


def wrong_reinitialised(model, tp):
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    return right_wildcard_plan(model, tp)


def wrong_scaled_weights(model, tp):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-3)
    return right_wildcard_plan(model, tp)


def wrong_frozen_embedding(model, tp):
    model.embed.weight.requires_grad_(False)
    return right_wildcard_plan(model, tp)


_FIRST_TP = {}


def wrong_first_tp_kept(model, tp):  # the first call's tp, reused
    return right_wildcard_plan(model, _FIRST_TP.setdefault("tp", tp))


def wrong_dealt_round_robin(model, tp):  # stage i keeps blocks i, i + n, ...
    mesh = _pp_tp(tp)
    i, n = mesh["pp"].get_local_rank(), mesh["pp"].size()
    names = list(model.layers)
    for k in names:
        if k not in names[i::n]:
            del model.layers[k]
    if i:
        model.embed = None
    if i != n - 1:
        model.norm = model.head = None
    return PipelineStage(make_tp(model, mesh["tp"]), i, n, "cpu",
                         group=mesh["pp"].get_group())


def hangs_on_rank_0(model, tp):  # one collective more on rank 0
    if dist.get_rank() == 0:
        dist.barrier()
    return right_device_mesh(model, tp)


def test_stage_hanging_answer_says_where_each_rank_waits():
    msg = rejected(ch13.check_pp_tp_stage, hangs_on_rank_0)
    assert "did not finish" in msg and "rank 0 in barrier" in msg, msg


NEW_RIGHT_STAGE = [right_wildcard_plan, right_deepcopy_per_linear, RightCounting(),
                   right_by_submodule]
NEW_WRONG_STAGE = {
    wrong_attention_only: "linear weights sharded", wrong_mlp_only:
    "linear weights sharded", wrong_first_block_only: "linear weights sharded",
    wrong_float64_always: "parameters in float32", wrong_bfloat16: "parameters in",
    wrong_reinitialised: "the given model's weights", wrong_scaled_weights:
    "the given model's weights", wrong_frozen_embedding: "every gradient",
    wrong_first_tp_kept: "pipeline stages",
    wrong_dealt_round_robin: "consecutive blocks",
}


@pytest.fixture(scope="module")
def new_stage_results():
    fns = NEW_RIGHT_STAGE + list(NEW_WRONG_STAGE)
    return dict(zip(fns, zip(ch13._run_stage(fns), ch13._run_stage(fns, world=2),
                             strict=True), strict=True))


@pytest.mark.parametrize("fn", NEW_RIGHT_STAGE,
                         ids=lambda f: getattr(f, "__name__", "cls"))
def test_stage_new_right_answers_pass(new_stage_results, fn):
    judge_both(new_stage_results[fn])


@pytest.mark.parametrize("fn", list(NEW_WRONG_STAGE), ids=lambda f: f.__name__)
def test_stage_new_wrong_answers_fail(new_stage_results, fn):
    msg = rejected(judge_both, new_stage_results[fn])
    assert NEW_WRONG_STAGE[fn] in msg, msg


def wrong_four_ranks(model, tp):  # the world size written in
    mesh = init_device_mesh("cpu", (4 // tp, tp), mesh_dim_names=("pp", "tp"))
    i, n = mesh["pp"].get_local_rank(), 4 // tp
    stage = make_tp(_cut(model, i, n), mesh["tp"])
    return PipelineStage(stage, i, n, "cpu", group=mesh["pp"].get_group())


# (an answer that writes in 4 stages over a mesh of the world size makes the
# 2-rank launch fail as a whole: a collective mismatch, reported as such)
WRONG_ON_TWO = {wrong_four_ranks: "dist.get_world_size()"}


@pytest.fixture(scope="module")
def two_rank_results():
    fns = list(WRONG_ON_TWO)
    return dict(zip(fns, ch13._run_stage(fns, world=2), strict=True))


@pytest.mark.parametrize("fn", list(WRONG_ON_TWO), ids=lambda f: f.__name__)
def test_stage_world_size_written_in_fails_on_two_ranks(two_rank_results, fn):
    msg = rejected(ch13.judge_stage, two_rank_results[fn])
    assert WRONG_ON_TWO[fn] in msg, msg


# ------------------------------------------------------------------ 13.2
# choose_layout over dp x cp x tp x pp x ep, schedules and recomputation, under
# the GPU's memory times the memory model's worst shortfall


SCHEDS = (("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2), ("interleaved", 4))


def _usable(gpu):
    return (reference.published(f"{gpu}.memory_gb").value * 2**30
            * planner.memory_shortfall())


def _time(model, lay, gpu, seq, batch):
    return sum(planner.step_parts(model, lay, gpu, seq, batch).values())


def _candidates(model, n, seq, batch, *, pp_divides=False, cps=True, eps=True,
                scheds=SCHEDS, recomputes=("none", "selective", "full"), kv=True,
                keep=None):
    for tp, cp, pp in itertools.product(range(1, 9), range(1, n + 1),
                                        range(1, model.layers // 2 + 1)):
        if n % (tp * cp * pp) or model.heads % tp or (kv and model.kv_heads % tp):
            continue
        if (cp > 1 and (not cps or (seq // 2) % cp)) or (
                pp_divides and model.layers % pp):
            continue
        dp = n // (tp * cp * pp)
        if batch % dp:
            continue
        ep_list = [e for e in range(1, dp * cp + 1) if eps and model.experts
                   and model.experts % e == 0 and (dp * cp) % e == 0] or [1]
        for ep, (sched, v), rc in itertools.product(ep_list, scheds, recomputes):
            if (pp == 1 and sched != "1f1b") or v > model.layers // pp:
                continue
            lay = planner.Layout(dp, tp, pp, cp=cp, ep=ep, recompute=rc,
                                 schedule=sched, virtual=v)
            if keep is None or keep(lay):
                yield lay


def _best(model, gpu, n, seq, batch, target, cap=None, **kw):
    cap = _usable(gpu) if cap is None else cap
    best = None
    for lay in _candidates(model, n, seq, batch, **kw):
        if planner.memory_per_gpu(model, lay, seq, batch)["total"] > cap:
            continue
        t = _time(model, lay, gpu, seq, batch)
        if batch * seq / t >= target and (best is None or t < best[0]):
            best = (t, lay)
    return best and best[1]


def right_loops(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target)


def right_sorted(model, gpu, n, seq, batch, target):
    rows = []
    for lay in planner.layouts(model, n, batch, seq=seq):
        for (sched, v), rc in itertools.product(SCHEDS, ("full", "selective", "none")):
            if (lay.pp == 1 and sched != "1f1b") or v > model.layers // lay.pp:
                continue
            cand = planner.Layout(lay.dp, lay.tp, lay.pp, cp=lay.cp, ep=lay.ep,
                                  recompute=rc, schedule=sched, virtual=v)
            if planner.memory_per_gpu(model, cand, seq, batch)["total"] <= _usable(gpu):
                t = _time(model, cand, gpu, seq, batch)
                if batch * seq / t >= target:
                    rows.append((t, str(cand), cand))
    return sorted(rows, key=lambda r: r[:2])[0][2] if rows else None


def right_numpy(model, gpu, n, seq, batch, target):
    cands = list(_candidates(model, n, seq, batch))
    mem = np.array([planner.memory_per_gpu(model, c, seq, batch)["total"]
                    for c in cands] or [np.inf])
    t = np.array([_time(model, c, gpu, seq, batch) for c in cands] or [np.inf])
    ok = (mem <= _usable(gpu)) & (batch * seq / t >= target)
    return cands[int(np.where(ok, t, np.inf).argmin())] if ok.any() else None


class RightMemo:  # a cache keyed on every argument is allowed
    def __init__(self):
        self.seen = {}

    def __call__(self, model, gpu, n_gpus, seq, global_batch, min_tokens_per_s):
        key = (model, gpu, n_gpus, seq, global_batch, min_tokens_per_s)
        if key not in self.seen:
            self.seen[key] = _best(*key)
        return self.seen[key]


def right_generator_min(model, gpu, n, seq, batch, target):
    usable = _usable(gpu)

    def timed():
        for c in _candidates(model, n, seq, batch, recomputes=("selective", "none",
                                                                 "full")):
            if planner.memory_per_gpu(model, c, seq, batch)["total"] <= usable:
                t = _time(model, c, gpu, seq, batch)
                if batch * seq / t >= target:
                    yield t, c
    return min(timed(), key=lambda x: x[0], default=(None, None))[1]


def wrong_no_margin(model, gpu, n, seq, batch, target):
    cap = reference.published(f"{gpu}.memory_gb").value * 2**30
    return _best(model, gpu, n, seq, batch, target, cap=cap)


def wrong_gb_units(model, gpu, n, seq, batch, target):
    cap = reference.published(f"{gpu}.memory_gb").value * 1e9  # GB, not GiB
    return _best(model, gpu, n, seq, batch, target, cap=cap)


def wrong_pp_divides(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target, pp_divides=True)


def wrong_no_cp(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target, cps=False)


def wrong_no_ep(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target, eps=False)


def wrong_only_1f1b(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target, scheds=(("1f1b", 1),))


def wrong_never_recompute(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target, recomputes=("none",))


def wrong_always_full(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target, recomputes=("full",))


def wrong_first_fit(model, gpu, n, seq, batch, target):
    for lay in _candidates(model, n, seq, batch):
        if planner.memory_per_gpu(model, lay, seq, batch)["total"] <= _usable(gpu):
            if batch * seq / _time(model, lay, gpu, seq, batch) >= target:
                return lay
    return None


def wrong_tokens_per_gpu(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target * n)


def wrong_fixed_gpus(model, gpu, n, seq, batch, target):
    return _best(model, gpu, 16, seq, batch, target)


def wrong_tuple(model, gpu, n, seq, batch, target):
    lay = _best(model, gpu, n, seq, batch, target)
    return lay and (lay.dp, lay.tp, lay.pp)


def wrong_plan_shortcut(model, gpu, n, seq, batch, target):
    rows = [r for r in planner.plan(model, gpu, n, seq, batch)
            if r.fits and not r.tight and r.tokens_per_s >= target]
    return rows[0].layout if rows else None


def wrong_tp_powers_of_two(model, gpu, n, seq, batch, target):  # tp in 1, 2, 4, 8
    return _best(model, gpu, n, seq, batch, target, keep=lambda x: x.tp in (1, 2, 4, 8))


def wrong_cp_powers_of_two(model, gpu, n, seq, batch, target):
    return _best(model, gpu, n, seq, batch, target,
                 keep=lambda x: x.cp & (x.cp - 1) == 0)


def wrong_pp_below_half(model, gpu, n, seq, batch, target):  # range(1, layers // 2)
    return _best(model, gpu, n, seq, batch, target,
                 keep=lambda x: x.pp < model.layers // 2)


_BY_MODEL = {}


def wrong_memo_by_model(model, gpu, n, seq, batch, target):
    if model.name not in _BY_MODEL:
        _BY_MODEL[model.name] = _best(model, gpu, n, seq, batch, target)
    return _BY_MODEL[model.name]


def wrong_endless_loop(model, gpu, n, seq, batch, target):
    tp = 1
    while tp <= n:
        if n % tp:
            continue
        tp *= 2
    return _best(model, gpu, n, seq, batch, target)


def wrong_reads_expected(model, gpu, n, seq, batch, target):
    from course_utils.checks.ch13 import expected_layout

    b = expected_layout((model, gpu, n, seq, batch, target))
    return b and b[1]


RIGHT_LAYOUT = [right_loops, right_sorted, right_numpy, RightMemo(),
                right_generator_min]
WRONG_LAYOUT = {
    wrong_no_margin: "shortfall", wrong_gb_units: "", wrong_pp_divides: "uneven",
    wrong_no_cp: "context parallelism", wrong_no_ep: "expert",
    wrong_only_1f1b: "schedule", wrong_never_recompute: "recomput",
    wrong_always_full: "recompute only where", wrong_first_fit: "shortest step",
    wrong_tokens_per_gpu: "not per GPU", wrong_fixed_gpus: "dp x cp x tp x pp",
    wrong_tuple: "a planner.Layout", wrong_plan_shortcut: "", wrong_memo_by_model: "",
    wrong_endless_loop: "never ends", wrong_reads_expected: "reads the checker",
    wrong_tp_powers_of_two: "split 3 or 6 ways", wrong_cp_powers_of_two: "3 and 6",
    wrong_pp_below_half: "model.layers // 2 itself",
}


def _judge_layouts(fn):
    ch13._refuse_peeking("13.2", fn)
    for case in ch13.LAYOUT_CASES:
        for _ in range(2):
            ch13.judge_layout(case, ch13._call("13.2", fn, *case))


@pytest.mark.parametrize("fn", RIGHT_LAYOUT,
                         ids=lambda f: getattr(f, "__name__", "cls"))
def test_layout_right_answers_pass(fn):
    _judge_layouts(fn)


@pytest.mark.parametrize("fn", list(WRONG_LAYOUT), ids=lambda f: f.__name__)
def test_layout_wrong_answers_fail(fn, monkeypatch):
    monkeypatch.setattr(ch13, "answer_limit", lambda *a, **k: 2)
    _BY_MODEL.clear()
    msg = rejected(_judge_layouts, fn)
    assert WRONG_LAYOUT[fn] in msg, msg


def test_layout_cases_cover_uneven_stages_context_and_experts():
    best = [ch13.expected_layout(c) for c in ch13.LAYOUT_CASES]
    found = [(c[0], b[1]) for b, c in zip(best, ch13.LAYOUT_CASES, strict=True) if b]
    # the best pipeline depth of a case does not divide that case's layers
    assert any(lay.pp > 1 and model.layers % lay.pp for model, lay in found)
    assert any(lay.cp > 1 for _, lay in found)
    assert any(model.experts and lay.ep > 1 for model, lay in found)
    assert any(b is None for b in best)  # nothing fits, or nothing fast enough


def test_layout_checker_passes_the_solution_and_fails_the_stub():
    ch13.check_choose_layout(right_loops)
    with pytest.raises(ExerciseFailed):
        ch13.check_choose_layout(wrong_first_fit)
