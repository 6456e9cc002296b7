"""Chapter 10's checkers: right answers written differently pass, and typical
mistakes fail with a message that names them.

Each exercise's answers run together in one launch per world size (the
checkers' rank functions take a list of answers), then each is judged by the
checker's own judge; one test per exercise also runs the whole checker."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import ColwiseParallel as Columns

from course_utils.checks import ch10
from course_utils.exercises import ExerciseFailed


def placeholder(*args):
    raise NotImplementedError("Exercise 10.x")


def rejected(judge, *args):
    with pytest.raises(ExerciseFailed) as e:
        judge(*args)
    return str(e.value)


# ------------------------------------------------------------------ 10.1

class Copy:  # f as a gradient hook: identity forward, all-reduce backward
    @staticmethod
    def apply(x):
        y = x * 1
        if y.requires_grad:
            def reduce_grad(g):
                g = g.clone()
                dist.all_reduce(g)
                return g
            y.register_hook(reduce_grad)
        return y


class Reduce:  # g straight through: the all-reduced value, identity backward
    @staticmethod
    def apply(x):
        total = x.detach().clone()
        dist.all_reduce(total)
        return x + (total - x.detach())


def _mine(dim):
    r, n = dist.get_rank(), dist.get_world_size()
    return slice(r * dim // n, (r + 1) * dim // n)


def _heads(x, ws, rows, head_dim):
    b, s, _ = x.shape
    q, k, v = (F.linear(x, w[rows]).view(b, s, -1, head_dim).transpose(1, 2)
               for w in ws)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


def attn_solution(x, wq, wk, wv, wo, n_heads):
    dim = x.shape[-1]
    rows = _mine(dim)
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, dim // n_heads)
    return Reduce.apply(F.linear(out, wo[:, rows]))


def attn_strided_heads(x, wq, wk, wv, wo, n_heads):  # heads r, r + n, r + 2n...
    r, n = dist.get_rank(), dist.get_world_size()
    hd = x.shape[-1] // n_heads
    rows = torch.cat([torch.arange(h * hd, (h + 1) * hd)
                      for h in range(r, n_heads, n)])
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, hd)
    return Reduce.apply(F.linear(out, wo[:, rows]))


def attn_hook_and_inplace(x, wq, wk, wv, wo, n_heads):
    """f as a gradient hook on x; g as an in-place all_reduce (identity backward)."""
    if x.requires_grad:
        x.register_hook(lambda g: Reduce.apply(g))
    rows = _mine(x.shape[-1])
    out = F.linear(_heads(x, (wq, wk, wv), rows, x.shape[-1] // n_heads),
                   wo[:, rows])
    dist.all_reduce(out)
    return out


class HeadParallel(torch.nn.Module):  # a class, one head at a time, no SDPA
    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, x, wq, wk, wv, wo):
        b, s, dim = x.shape
        hd = dim // self.n_heads
        per_rank = self.n_heads // dist.get_world_size()
        first = dist.get_rank() * per_rank
        x = Copy.apply(x)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        total = 0
        for h in range(first, first + per_rank):
            rows = slice(h * hd, (h + 1) * hd)
            q, k, v = (x @ w[rows].t() for w in (wq, wk, wv))
            scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            total = total + (weights @ v) @ wo[:, rows].t()
        return Reduce.apply(total)


def attn_class(x, wq, wk, wv, wo, n_heads):
    return HeadParallel(n_heads)(x, wq, wk, wv, wo)


def attn_local_heads(x, wq, wk, wv, wo, n_heads):  # n_heads // world in the view
    b, s, dim = x.shape
    local = n_heads // dist.get_world_size()
    rows = _mine(dim)
    x = Copy.apply(x)
    q, k, v = (F.linear(x, w[rows]).view(b, s, local, dim // n_heads).transpose(1, 2)
               for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=None)
    return Reduce.apply(F.linear(out.transpose(1, 2).reshape(b, s, -1), wo[:, rows]))


RIGHT_ATTENTION = [attn_solution, attn_strided_heads, attn_hook_and_inplace,
                   attn_class, attn_local_heads]


def attn_no_g(x, wq, wk, wv, wo, n_heads):
    rows = _mine(x.shape[-1])
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, x.shape[-1] // n_heads)
    return F.linear(out, wo[:, rows])


def attn_no_f(x, wq, wk, wv, wo, n_heads):
    rows = _mine(x.shape[-1])
    return Reduce.apply(F.linear(_heads(x, (wq, wk, wv), rows,
                                        x.shape[-1] // n_heads), wo[:, rows]))


def attn_all_heads(x, wq, wk, wv, wo, n_heads):  # every rank computes everything
    return ch10.one_process_attention(x, wq, wk, wv, wo, n_heads)


def attn_all_heads_reduced(x, wq, wk, wv, wo, n_heads):
    return Reduce.apply(ch10.one_process_attention(Copy.apply(x), wq, wk, wv, wo,
                                                   n_heads))


def attn_hard_coded_heads(x, wq, wk, wv, wo, n_heads):  # view(b, s, n_heads, -1)
    b, s, dim = x.shape
    rows = _mine(dim)
    x = Copy.apply(x)
    q, k, v = (F.linear(x, w[rows]).view(b, s, n_heads, -1).transpose(1, 2)
               for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return Reduce.apply(F.linear(out.transpose(1, 2).reshape(b, s, -1), wo[:, rows]))


def _my_heads_with(x, wq, wk, wv, wo, n_heads, **sdpa):
    b, s, dim = x.shape
    rows = _mine(dim)
    x = Copy.apply(x)
    q, k, v = (F.linear(x, w[rows]).view(b, s, -1, dim // n_heads).transpose(1, 2)
               for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, **sdpa)
    return Reduce.apply(F.linear(out.transpose(1, 2).reshape(b, s, -1), wo[:, rows]))


def attn_not_causal(x, wq, wk, wv, wo, n_heads):  # every token sees the future
    return _my_heads_with(x, wq, wk, wv, wo, n_heads)


def attn_scaled_by_local_width(x, wq, wk, wv, wo, n_heads):  # 1/sqrt(dim / world)
    scale = (x.shape[-1] // dist.get_world_size()) ** -0.5
    return _my_heads_with(x, wq, wk, wv, wo, n_heads, is_causal=True, scale=scale)


def attn_two_ranks_only(x, wq, wk, wv, wo, n_heads):  # world size hard-coded
    dim = x.shape[-1]
    r = dist.get_rank()
    rows = slice(min(r * dim // 2, dim), min((r + 1) * dim // 2, dim))
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, dim // n_heads)
    return Reduce.apply(F.linear(out, wo[:, rows]))


def attn_two_heads_each(x, wq, wk, wv, wo, n_heads):  # 2 heads per rank, always
    hd = x.shape[-1] // n_heads
    r = dist.get_rank()
    rows = slice(r * 2 * hd, (r + 1) * 2 * hd)
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, hd)
    return Reduce.apply(F.linear(out, wo[:, rows]))


def attn_autograd_all_reduce(x, wq, wk, wv, wo, n_heads):  # backward all-reduces too
    from torch.distributed.nn.functional import all_reduce

    rows = _mine(x.shape[-1])
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, x.shape[-1] // n_heads)
    return all_reduce(F.linear(out, wo[:, rows]))


def attn_local_output(x, wq, wk, wv, wo, n_heads):  # no output projection
    return _heads(Copy.apply(x), (wq, wk, wv), _mine(x.shape[-1]),
                  x.shape[-1] // n_heads)


def attn_detached_weights(x, wq, wk, wv, wo, n_heads):
    rows = _mine(x.shape[-1])
    ws = [w.detach() for w in (wq, wk, wv)]
    out = _heads(Copy.apply(x), ws, rows, x.shape[-1] // n_heads)
    return Reduce.apply(F.linear(out, wo[:, rows]))


def attn_no_grad(x, wq, wk, wv, wo, n_heads):
    with torch.no_grad():
        return attn_no_g(x, wq, wk, wv, wo, n_heads) * 1.0


def attn_wo_rows(x, wq, wk, wv, wo, n_heads):  # wo split like wq
    rows = _mine(x.shape[-1])
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, x.shape[-1] // n_heads)
    return Reduce.apply(F.linear(out, wo[rows]))


def attn_float32_buffer(x, wq, wk, wv, wo, n_heads):  # float32 only
    rows = _mine(x.shape[-1])
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, x.shape[-1] // n_heads)
    total = torch.zeros(x.shape)
    total += F.linear(out, wo[:, rows])
    return Reduce.apply(total)


def attn_rank0_heads(x, wq, wk, wv, wo, n_heads):  # every rank takes rank 0's heads
    dim = x.shape[-1]
    rows = slice(0, dim // dist.get_world_size())
    out = _heads(Copy.apply(x), (wq, wk, wv), rows, dim // n_heads)
    return Reduce.apply(F.linear(out, wo[:, rows]))


def attn_f_per_projection(x, wq, wk, wv, wo, n_heads):  # right values, 3 x f
    b, s, dim = x.shape
    rows, hd = _mine(dim), dim // n_heads
    q, k, v = (F.linear(Copy.apply(x), w[rows]).view(b, s, -1, hd).transpose(1, 2)
               for w in (wq, wk, wv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return Reduce.apply(F.linear(out.transpose(1, 2).reshape(b, s, -1), wo[:, rows]))


class ReducedPerHead(HeadParallel):  # the class above, g on every head
    def forward(self, x, wq, wk, wv, wo):
        b, s, dim = x.shape
        hd = dim // self.n_heads
        per_rank = self.n_heads // dist.get_world_size()
        x = Copy.apply(x)
        total = 0
        for h in range(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank):
            rows = slice(h * hd, (h + 1) * hd)
            q, k, v = (F.linear(x, w[rows]).unsqueeze(1) for w in (wq, wk, wv))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            total = total + Reduce.apply(F.linear(out.squeeze(1), wo[:, rows]))
        return total


def attn_reduced_per_head(x, wq, wk, wv, wo, n_heads):
    return ReducedPerHead(n_heads)(x, wq, wk, wv, wo)


WRONG_ATTENTION = {
    attn_f_per_projection: ["one all-reduce in the backward", "3 all-reduces",
                            "f operator to x once"],
    attn_reduced_per_head: ["one all-reduce in the forward", "all-reduce once"],
    attn_not_causal: ["attends to later tokens", "is_causal=True"],
    attn_scaled_by_local_width: ["scaled by 1/sqrt(", "head width"],
    attn_no_g: ["partial sum", "g operator"],
    attn_no_f: ["x.grad", "f operator"],
    attn_all_heads: ["heads computed on each rank", "only those"],
    attn_all_heads_reduced: ["used the weights of", "only those"],
    attn_hard_coded_heads: ["invalid for input", "view(b, s, -1, head_dim)"],
    attn_two_ranks_only: ["3 ranks", "get_world_size"],
    attn_autograd_all_reduce: ["2 times", "identity"],
    attn_local_output: ["shape", "full output"],
    attn_detached_weights: ["wq.grad is None", ".detach()"],
    attn_no_grad: ["requires_grad=False"],
    attn_wo_rows: ["columns of wo"],
    attn_float32_buffer: ["float64", "dtype"],
    attn_rank0_heads: ["every head computed by one rank", "get_rank"],
    attn_two_heads_each: ["3 of the 6 heads computed on each rank",
                          "n_heads / world_size heads"],
}


@pytest.fixture(scope="module")
def attention_results():
    answers = RIGHT_ATTENTION + list(WRONG_ATTENTION)
    results = {}
    for case in ch10.ATTENTION_CASES:
        per_answer = ch10._check_attention_answers(answers, case[0])
        for fn, ranks in zip(answers, per_answer, strict=True):
            results[(fn, case[0])] = ranks
    return results


def judge_attention_everywhere(results, fn):
    for case in ch10.ATTENTION_CASES:
        ch10.judge_attention(results[(fn, case[0])], case)


@pytest.mark.parametrize("fn", RIGHT_ATTENTION, ids=lambda f: f.__name__)
def test_attention_right_answers_pass(attention_results, fn):
    judge_attention_everywhere(attention_results, fn)


@pytest.mark.parametrize("fn", list(WRONG_ATTENTION), ids=lambda f: f.__name__)
def test_attention_wrong_answers_fail_with_their_mistake(attention_results, fn):
    text = rejected(judge_attention_everywhere, attention_results, fn)
    for word in WRONG_ATTENTION[fn]:
        assert word in text, text


def test_attention_checker_end_to_end(capsys):
    ch10.check_head_parallel_attention(attn_solution)
    assert "Exercise 10.1 passed" in capsys.readouterr().out
    assert "placeholder" in rejected(ch10.check_head_parallel_attention, placeholder)


def attn_only_rank0_reduces(x, wq, wk, wv, wo, n_heads):  # a collective on one rank
    out = attn_no_g(x, wq, wk, wv, wo, n_heads)
    if dist.get_rank() == 0:
        dist.all_reduce(out)
    return out


def test_attention_hang_is_stopped():
    text = rejected(ch10.check_head_parallel_attention, attn_only_rank0_reduces)
    assert "same collectives" in text, text


# ------------------------------------------------------------------ 10.2

BLOCK_PER_LINEAR = {"attention.q_proj": ColwiseParallel(),
                    "attention.k_proj": ColwiseParallel(),
                    "attention.v_proj": ColwiseParallel(),
                    "attention.out_proj": RowwiseParallel(),
                    "feed_forward.gate": ColwiseParallel(),
                    "feed_forward.up": ColwiseParallel(),
                    "feed_forward.down": RowwiseParallel()}
KEEP = PrepareModuleInput(input_layouts=(Replicate(),),
                          desired_input_layouts=(Replicate(),))
BLOCK_TP = BLOCK_PER_LINEAR | {"attention": KEEP, "feed_forward": KEEP}


def _block_sp(norms=True, gather=True):
    plan = {"attention.q_proj": ColwiseParallel(),
            "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(),
            "attention.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.gate": ColwiseParallel(),
            "feed_forward.up": ColwiseParallel(),
            "feed_forward.down": RowwiseParallel(output_layouts=Shard(1))}
    if norms:
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    if gather:
        g = PrepareModuleInput(input_layouts=(Shard(1),),
                               desired_input_layouts=(Replicate(),))
        plan |= {"attention": g, "feed_forward": g}
    return plan


TOP_SP = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                            output_layouts=Shard(1)),
          "final_norm": SequenceParallel(),
          "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
TOP_TP = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
          "output": ColwiseParallel(output_layouts=Replicate())}


def _apply(model, mesh, block_plan, top_plan):
    for block in model.layers:
        parallelize_module(block, mesh, block_plan)
    parallelize_module(model, mesh, top_plan)


def plan_solution(model, mesh, sequence_parallel):
    if sequence_parallel:
        _apply(model, mesh, _block_sp(), TOP_SP)
    else:
        _apply(model, mesh, BLOCK_TP, TOP_TP)
    return model


def plan_wildcards(model, mesh, sequence_parallel):  # one call, "layers.*." keys
    block = _block_sp() if sequence_parallel else BLOCK_TP
    plan = {f"layers.*.{k}": v for k, v in block.items()}
    if sequence_parallel:
        plan |= TOP_SP
    parallelize_module(model, mesh, plan)


def plan_per_submodule(model, mesh, sequence_parallel):  # style per module object
    out = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else
                          Replicate())
    into = Shard(1) if sequence_parallel else Replicate()
    for block in model.layers:
        for name in ("attention", "feed_forward"):
            parallelize_module(getattr(block, name), mesh, PrepareModuleInput(
                input_layouts=(into,), desired_input_layouts=(Replicate(),),
                use_local_output=False))
        parallelize_module(block.attention, mesh, {
            "q_proj": Columns(), "k_proj": Columns(), "v_proj": Columns(),
            "out_proj": out})
        parallelize_module(block.feed_forward, mesh, {
            "gate": Columns(), "up": Columns(), "down": out})
        if sequence_parallel:
            for name in ("attention_norm", "ffn_norm"):
                parallelize_module(getattr(block, name), mesh, SequenceParallel())
    if sequence_parallel:
        parallelize_module(model, mesh, TOP_SP)


def plan_blocks_only_tp(model, mesh, sequence_parallel):  # embeddings left whole
    if sequence_parallel:
        return plan_solution(model, mesh, True)
    _apply(model, mesh, BLOCK_TP, {})
    return model


class ColumnEmbedding:  # a class; the embedding split by features, not vocabulary
    def __call__(self, model, mesh, sequence_parallel):
        between = Shard(1) if sequence_parallel else Replicate()
        block = _block_sp() if sequence_parallel else BLOCK_TP
        top = {"tok_embeddings": ColwiseParallel(output_layouts=between),
               "output": ColwiseParallel(input_layouts=between,
                                         output_layouts=Replicate())}
        if sequence_parallel:
            top["final_norm"] = SequenceParallel()
        _apply(model, mesh, block, top)
        return model


def plan_norm_outputs_dtensors(model, mesh, sequence_parallel):
    """The norms hand out replicated DTensors, so the linears share one input."""
    if sequence_parallel:
        return plan_solution(model, mesh, True)
    keep = PrepareModuleOutput(output_layouts=Replicate(),
                               desired_output_layouts=Replicate(),
                               use_local_output=False)
    _apply(model, mesh, BLOCK_PER_LINEAR | {"attention_norm": keep, "ffn_norm": keep},
           TOP_TP)
    return model


def plan_rowwise_output(model, mesh, sequence_parallel):
    """The output layer split by its input features: the logits all-reduced."""
    if sequence_parallel:
        return plan_solution(model, mesh, True)
    _apply(model, mesh, BLOCK_TP, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": RowwiseParallel(input_layouts=Replicate(),
                                  output_layouts=Replicate())})
    return model


RIGHT_PLANS = [plan_solution, plan_wildcards, plan_per_submodule, plan_blocks_only_tp,
               ColumnEmbedding(), plan_norm_outputs_dtensors, plan_rowwise_output]


def plan_nothing(model, mesh, sequence_parallel):
    return model


def plan_attention_only(model, mesh, sequence_parallel):
    plan = {k: v for k, v in BLOCK_TP.items() if k.startswith("attention")}
    _apply(model, mesh, plan, {})


def plan_all_columns(model, mesh, sequence_parallel):  # every output gathered
    plan = {k: ColwiseParallel(output_layouts=Replicate()) for k in BLOCK_PER_LINEAR}
    _apply(model, mesh, plan, {})


def plan_down_columns(model, mesh, sequence_parallel):
    _apply(model, mesh, BLOCK_TP | {"feed_forward.down": ColwiseParallel()}, {})


def plan_up_forgotten(model, mesh, sequence_parallel):
    plan = {k: v for k, v in BLOCK_TP.items() if k != "feed_forward.up"}
    _apply(model, mesh, plan, {})


def plan_sp_ignored(model, mesh, sequence_parallel):
    return plan_solution(model, mesh, False)


def plan_sp_without_norms(model, mesh, sequence_parallel):
    if not sequence_parallel:
        return plan_solution(model, mesh, False)
    _apply(model, mesh, _block_sp(norms=False),
           {k: v for k, v in TOP_SP.items() if k != "final_norm"})


def plan_sp_without_gather(model, mesh, sequence_parallel):
    if not sequence_parallel:
        return plan_solution(model, mesh, False)
    _apply(model, mesh, _block_sp(gather=False), TOP_SP)


def plan_sp_no_gather_no_norms(model, mesh, sequence_parallel):
    if not sequence_parallel:
        return plan_solution(model, mesh, False)
    _apply(model, mesh, _block_sp(norms=False, gather=False),
           {k: v for k, v in TOP_SP.items() if k != "final_norm"})


def plan_sp_replicated_embeddings(model, mesh, sequence_parallel):
    if not sequence_parallel:
        return plan_solution(model, mesh, False)
    top = TOP_SP | {"tok_embeddings": RowwiseParallel(input_layouts=Replicate())}
    _apply(model, mesh, _block_sp(), top)


def plan_swapped(model, mesh, sequence_parallel):  # row-parallel first
    plan = {k: (RowwiseParallel() if isinstance(v, ColwiseParallel) else
                ColwiseParallel()) for k, v in BLOCK_PER_LINEAR.items()}
    _apply(model, mesh, plan, {})


def plan_without_layer_prefix(model, mesh, sequence_parallel):  # keys match nothing
    parallelize_module(model, mesh, BLOCK_TP)


def plan_per_linear(model, mesh, sequence_parallel):  # section 3's plan, renamed
    if sequence_parallel:
        return plan_solution(model, mesh, True)
    _apply(model, mesh, BLOCK_PER_LINEAR, TOP_TP)


def plan_keep_but_local(model, mesh, sequence_parallel):  # the DTensor is unwrapped
    if sequence_parallel:
        return plan_solution(model, mesh, True)
    keep = PrepareModuleInput(input_layouts=(Replicate(),),
                              desired_input_layouts=(Replicate(),),
                              use_local_output=True)
    _apply(model, mesh, BLOCK_PER_LINEAR | {"attention": keep, "feed_forward": keep},
           TOP_TP)


def plan_dtensor_logits(model, mesh, sequence_parallel):
    top = dict(TOP_SP if sequence_parallel else TOP_TP)
    top["output"] = ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate(),
        output_layouts=Replicate(), use_local_output=False)
    _apply(model, mesh, _block_sp() if sequence_parallel else BLOCK_TP, top)


def plan_sharded_logits(model, mesh, sequence_parallel):  # vocabulary slices
    top = dict(TOP_SP if sequence_parallel else TOP_TP)
    top["output"] = ColwiseParallel(
        input_layouts=Shard(1) if sequence_parallel else Replicate())
    _apply(model, mesh, _block_sp() if sequence_parallel else BLOCK_TP, top)


def plan_sp_final_norm_whole(model, mesh, sequence_parallel):
    """The blocks' norms sequence parallel, the final norm forgotten."""
    if not sequence_parallel:
        return plan_solution(model, mesh, False)
    _apply(model, mesh, _block_sp(),
           {k: v for k, v in TOP_SP.items() if k != "final_norm"})
    return model


def plan_kv_whole(model, mesh, sequence_parallel):  # "k, v are too narrow to split"
    if sequence_parallel:
        return plan_solution(model, mesh, True)
    _apply(model, mesh, {k: v for k, v in BLOCK_TP.items()
                         if k not in ("attention.k_proj", "attention.v_proj")}, TOP_TP)
    return model


def plan_one_input_attention_only(model, mesh, sequence_parallel):
    if sequence_parallel:
        return plan_solution(model, mesh, True)
    _apply(model, mesh, {k: v for k, v in BLOCK_TP.items() if k != "feed_forward"},
           TOP_TP)
    return model


WRONG_PLANS = {
    plan_sp_final_norm_whole: ["final_norm.weight differs", "SequenceParallel()"],
    plan_kv_whole: ["mixed torch.Tensor and DTensor", "every linear"],
    plan_one_input_attention_only: ["6 all-reduces", "PrepareModuleInput"],
    plan_nothing: ["full copy", "ColwiseParallel or RowwiseParallel"],
    plan_attention_only: ["feed_forward.gate.weight is a full copy"],
    plan_all_columns: ["no all-gather inside the blocks", "RowwiseParallel"],
    plan_down_columns: ["to run", "pair ColwiseParallel"],
    plan_up_forgotten: ["mixed torch.Tensor and DTensor", "every linear"],
    plan_sp_ignored: ["sequence_parallel=True", "no all-reduce"],
    plan_sp_without_norms: ["norm", "SequenceParallel()"],
    plan_sp_without_gather: ["one all-gather per sublayer", "once before attention"],
    plan_sp_no_gather_no_norms: ["sequence_parallel=True", "pairing is right",
                                 "PrepareModuleInput"],
    plan_sp_replicated_embeddings: ["sequence_parallel=True", "tok_embeddings"],
    plan_swapped: ["sequence_parallel=False", "pair ColwiseParallel"],
    plan_without_layer_prefix: ["full copy"],
    plan_per_linear: ["in the backward", "10 all-reduces", "one replicated DTensor"],
    plan_keep_but_local: ["in the backward", "keeping the DTensor"],
    plan_dtensor_logits: ["plain torch.Tensor", "use_local_output=True"],
    plan_sharded_logits: ["full logits", "slice of the vocabulary"],
}


@pytest.fixture(scope="module")
def plan_results():
    answers = RIGHT_PLANS + list(WRONG_PLANS)
    return dict(zip(answers, ch10._check_plan_answers(answers), strict=True))


@pytest.mark.parametrize("fn", RIGHT_PLANS, ids=lambda f: getattr(
    f, "__name__", type(f).__name__))
def test_plan_right_answers_pass(plan_results, fn):
    ch10.judge_plan(plan_results[fn])


@pytest.mark.parametrize("fn", list(WRONG_PLANS), ids=lambda f: f.__name__)
def test_plan_wrong_answers_fail_with_their_mistake(plan_results, fn):
    text = rejected(ch10.judge_plan, plan_results[fn])
    for word in WRONG_PLANS[fn]:
        assert word in text, text


def plan_ranks_wait_for_each_other(model, mesh, sequence_parallel):
    waiting = torch.zeros(1)
    dist.recv(waiting, src=1 - dist.get_rank())  # each rank waits for the other
    return plan_solution(model, mesh, sequence_parallel)


def test_plan_hang_is_stopped_by_the_collective_wait():
    text = rejected(ch10.check_parallelize_plan, plan_ranks_wait_for_each_other)
    assert "never called" in text and "same collectives" in text, text


def plan_sp_on_the_batch(model, mesh, sequence_parallel):
    """"Sequence" parallel on dimension 0: the batch, 3 rows on 2 ranks."""
    if not sequence_parallel:
        return plan_solution(model, mesh, False)
    batch = Shard(0)
    block = {k: RowwiseParallel(output_layouts=batch)
             if k.endswith(("out_proj", "down")) else v
             for k, v in _block_sp(gather=False).items()}
    block |= {"attention_norm": SequenceParallel(sequence_dim=0),
              "ffn_norm": SequenceParallel(sequence_dim=0)}
    gather = PrepareModuleInput(input_layouts=(batch,),
                                desired_input_layouts=(Replicate(),))
    block |= {"attention": gather, "feed_forward": gather}
    _apply(model, mesh, block, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=batch),
        "final_norm": SequenceParallel(sequence_dim=0),
        "output": ColwiseParallel(input_layouts=batch, output_layouts=Replicate())})
    return model


def test_plan_sharding_the_batch_is_told_the_sequence_is_dimension_1():
    # gloo aborts the rank that receives the other's larger shard, in C++
    text = rejected(ch10.check_parallelize_plan, plan_sp_on_the_batch)
    assert "different sizes" in text and "Shard(1)" in text, text


def test_plan_checker_end_to_end(capsys):
    ch10.check_parallelize_plan(plan_solution)
    assert "Exercise 10.2 passed" in capsys.readouterr().out
    assert "placeholder" in rejected(ch10.check_parallelize_plan, placeholder)


# ------------------------------------------------------------------ 10.3

def counts_solution(n_layers, sequence_parallel, loss_parallel):
    lp = 3 if loss_parallel else 0
    if not sequence_parallel:
        return {"all_reduce": 2 + 7 * n_layers + lp,
                "all_gather": 0 if lp else 1, "reduce_scatter": 0}
    return {"all_reduce": lp, "all_gather": 4 * n_layers + 2 + (0 if lp else 1),
            "reduce_scatter": 4 * n_layers + 2}


def counts_by_walking(n_layers, sequence_parallel, loss_parallel):
    """Walk the forward, then the backward, collective by collective."""
    forward = []
    sp = sequence_parallel
    forward.append("reduce_scatter" if sp else "all_reduce")  # embedding
    for _ in range(n_layers):
        for _sublayer in ("attention", "feed_forward"):
            if sp:
                forward.append("all_gather")
            forward.append("reduce_scatter" if sp else "all_reduce")
    if sp:
        forward.append("all_gather")  # the head's input
    if not loss_parallel:
        forward.append("all_gather")  # the logits
    backward = []
    for op in forward:
        if op == "reduce_scatter":
            backward.append("all_gather")
        elif op == "all_gather":
            backward.append("reduce_scatter")
    if sp and not loss_parallel:
        backward.remove("reduce_scatter")  # gathering the logits: split back, free
    elif not sp:  # each column-parallel linear's f: q, k, v, gate, up; the head
        backward = ["all_reduce"] * (1 + 5 * n_layers)
    ops = forward + backward + ["all_reduce"] * (3 if loss_parallel else 0)
    return {name: ops.count(name) for name in ch10.COLLECTIVES}


class CountTable:
    def __call__(self, n_layers, sequence_parallel, loss_parallel):
        return {k: v for k, v in counts_solution(
            n_layers, sequence_parallel, loss_parallel).items() if v}  # zeros left out


def counts_as_floats(n_layers, sequence_parallel, loss_parallel):
    return {k: float(v) for k, v in counts_solution(
        n_layers, sequence_parallel, loss_parallel).items()}


def counts_as_tensors(n_layers, sequence_parallel, loss_parallel):
    return {k: int(torch.tensor(v)) for k, v in counts_solution(
        n_layers, bool(sequence_parallel), bool(loss_parallel)).items()}


RIGHT_COUNTS = [counts_solution, counts_by_walking, CountTable(), counts_as_floats,
                counts_as_tensors]


def counts_constant(n_layers, sequence_parallel, loss_parallel):  # depth 2 only
    return counts_solution(2, sequence_parallel, loss_parallel)


def counts_forward_only(n_layers, sequence_parallel, loss_parallel):
    sp = sequence_parallel
    return {"all_reduce": 0 if sp else 1 + 2 * n_layers,
            "all_gather": (2 * n_layers + 1 if sp else 0) + (0 if loss_parallel else 1),
            "reduce_scatter": 1 + 2 * n_layers if sp else 0}


def counts_sp_as_all_reduce(n_layers, sequence_parallel, loss_parallel):
    return counts_solution(n_layers, False, loss_parallel)


def counts_each_all_reduce_a_pair(n_layers, sequence_parallel, loss_parallel):
    tp = counts_solution(n_layers, False, loss_parallel)
    if not sequence_parallel:
        return tp
    pairs = tp["all_reduce"] - (3 if loss_parallel else 0)
    return {"all_reduce": 3 if loss_parallel else 0,
            "all_gather": pairs + tp["all_gather"], "reduce_scatter": pairs}


def counts_lp_ignored(n_layers, sequence_parallel, loss_parallel):
    return counts_solution(n_layers, sequence_parallel, False)


def counts_lp_keeps_gather(n_layers, sequence_parallel, loss_parallel):
    c = counts_solution(n_layers, sequence_parallel, loss_parallel)
    if loss_parallel:
        c["all_gather"] += 1
    return c


def counts_lp_always(n_layers, sequence_parallel, loss_parallel):
    c = counts_solution(n_layers, sequence_parallel, True)
    c["all_gather"] = counts_solution(n_layers, sequence_parallel, False)["all_gather"]
    return c


def counts_lp_one_all_reduce(n_layers, sequence_parallel, loss_parallel):
    c = counts_solution(n_layers, sequence_parallel, loss_parallel)
    c["all_reduce"] -= 2 if loss_parallel else 0  # one for the loss, not three
    return c


def counts_gpt_formula(n_layers, sequence_parallel, loss_parallel):  # section 4's
    c = counts_solution(n_layers, sequence_parallel, loss_parallel)
    if not sequence_parallel:
        c["all_reduce"] -= n_layers
    return c


def counts_fused(n_layers, sequence_parallel, loss_parallel):  # one f per sublayer
    c = counts_solution(n_layers, sequence_parallel, loss_parallel)
    if not sequence_parallel:
        c["all_reduce"] -= 3 * n_layers
    return c


def counts_one_layer_too_many(n_layers, sequence_parallel, loss_parallel):
    return counts_solution(n_layers + 1, sequence_parallel, loss_parallel)


def counts_both_ranks(n_layers, sequence_parallel, loss_parallel):
    return {k: 2 * v for k, v in counts_solution(
        n_layers, sequence_parallel, loss_parallel).items()}


def counts_wrong_names(n_layers, sequence_parallel, loss_parallel):
    return {"allreduce": 16, "allgather": 1}


def counts_as_list(n_layers, sequence_parallel, loss_parallel):
    return list(counts_solution(n_layers, sequence_parallel, loss_parallel).values())


def counts_swapped_kinds(n_layers, sequence_parallel, loss_parallel):
    c = counts_solution(n_layers, sequence_parallel, loss_parallel)
    c["all_gather"], c["reduce_scatter"] = c["reduce_scatter"], c["all_gather"]
    return c


def counts_fractional(n_layers, sequence_parallel, loss_parallel):
    return {k: v / 2 for k, v in counts_solution(
        n_layers, sequence_parallel, loss_parallel).items()}


def counts_measured_depths(n_layers, sequence_parallel, loss_parallel):  # a table
    known = {1: 1, 3: 3}  # the depths one ran with CommDebugMode, by heart
    return counts_solution(known.get(n_layers, 1), sequence_parallel, loss_parallel)


WRONG_COUNTS = {
    counts_measured_depths: ["n_layers=2", "not a table"],
    counts_constant: ["same counts at every depth"],
    counts_forward_only: ["forward's collectives only"],
    counts_sp_as_all_reduce: ["sequence_parallel=True", "no all-reduce is left"],
    counts_each_all_reduce_a_pair: ["do not each become", "one reduce-scatter"],
    counts_lp_ignored: ["loss_parallel=True", "three small all-reduces"],
    counts_lp_keeps_gather: ["no all-gather of the logits"],
    counts_lp_always: ["only come with loss_parallel"],
    counts_lp_one_all_reduce: ["right without loss_parallel", "adds three small"],
    counts_gpt_formula: ["two column-parallel linears here, gate and up"],
    counts_fused: ["separate column-parallel linears", "five per block"],
    counts_one_layer_too_many: ["one block too many"],
    counts_both_ranks: ["twice the count", "one rank"],
    counts_wrong_names: ["only the keys", "'allreduce'"],
    counts_as_list: ["a dict of counts"],
    counts_swapped_kinds: ["wrong kinds"],
    counts_fractional: ["whole number"],
}


@pytest.mark.parametrize("fn", RIGHT_COUNTS, ids=lambda f: getattr(
    f, "__name__", type(f).__name__))
def test_counts_right_answers_pass(fn, capsys):
    ch10.check_predicted_counts(fn)
    assert "Exercise 10.3 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn", list(WRONG_COUNTS), ids=lambda f: f.__name__)
def test_counts_wrong_answers_fail_with_their_mistake(fn):
    text = rejected(ch10.check_predicted_counts, fn)
    for word in WRONG_COUNTS[fn]:
        assert word in text, text


def test_counts_placeholder():
    assert "placeholder" in rejected(ch10.check_predicted_counts, placeholder)


# ------------------------------------------------------- the chapter's prediction

def test_tp_layer_comm_prediction_counts_the_ring_bytes():
    """Chapter 10's section 7 calls this model; its cross-node part may change."""
    from course_utils import predict

    nbytes = 2048 * 12288 * 2
    nvlink = predict.tp_layer_comm_seconds(2048, 12288, 8, "nvlink_h100")
    ib = predict.tp_layer_comm_seconds(2048, 12288, 8, "ndr_infiniband")
    assert nvlink.kind == ib.kind == "predicted"
    assert nvlink.value == pytest.approx(
        4 * predict.allreduce_seconds(nbytes, 8, "nvlink_h100").value)
    assert ib.value > nvlink.value > 0 and "NVLink" in nvlink.label
    with pytest.raises(ValueError):
        predict.tp_layer_comm_seconds(2048, 12288, 1)



def test_prediction_that_never_returns_is_stopped(monkeypatch):
    ch10.measured_counts()  # measured with the usual limit, then cached
    monkeypatch.setattr(ch10, "answer_limit", lambda *a, **k: 1.0)

    def predict_endless(n_layers, sequence_parallel, loss_parallel):
        counts = {}
        while len(counts) < 3:
            pass
        return counts

    text = rejected(ch10.check_predicted_counts, predict_endless)
    assert "did not return" in text, text
