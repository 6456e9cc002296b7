"""Checkers for Chapter 14 (parallelism for inference).

- 14.1: a static KV cache for grouped-query attention, on two sequences
  interleaved (each with its own cache), in chunks of several lengths after
  prefills of 1 to 6 tokens, float32, float64 and bfloat16, 1 to 3 K/V heads
  per group: every output against recomputation over the whole sequence in
  float64, the keys and values written in place at the right positions (the
  buffers stay the same tensors, slots past the length hold a large value
  that a mask must hide, as a static cache attended whole is), only the
  new tokens projected, the input left alone;
- 14.2: tensor-parallel greedy decoding of a GPT with a fused QKV projection
  on 2 and 4 gloo ranks (1 or 2 heads per rank, vocabularies of odd sizes,
  float32 and float64): tokens and logits against one process, the
  all-reduces counted (2 per layer per forward), and each rank's FLOPs
  (about 1/N of the blocks': sharded, with a cache);
- 14.3: the largest batch that fits and its decode tokens per second
  against the step model for serving, on contexts drawn by the checker,
  several GPUs, tensor-parallel degrees (one past the K/V heads) and dtypes;
  the mistake made is named (weights' share, dtype, GB vs GiB, ...), the
  answer never shown.

The ``_tp_rank`` function takes a list of answers, so that the tests judge
many answers in one launch; the checker passes one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from course_utils import planner, reference, serving
from course_utils.dist import LaunchTimeout, RankFailed, launch, peer_went_away
from course_utils.exercises import (
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
    stuck,
    time_limit,
)


def _call(ex: str, fn, *args):
    """The learner's function within ``answer_limit(ex)``, failures made friendly."""
    with time_limit(answer_limit(ex)):
        return call_learner(ex, fn, *args, hints={
            "took longer than": "your function did not return: look for a loop "
                                "that never ends",
            "must match the existing size": "the cache holds attn.n_kv_heads K/V "
                                            "heads: view keys and values with that "
                                            "count, not the query heads'",
            "no published bf16 peak": "no sequence fits here: return (0, 0.0) "
                                      "without asking for a step time"})


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- exercise 14.1

class GQAttention(nn.Module):
    """Grouped-query attention: ``n_kv_heads`` K/V heads, each for a group."""

    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def heads(self, w, x, n):
        b, s, _ = x.shape
        return w(x).view(b, s, n, self.head_dim).transpose(1, 2)

    def full(self, x):
        """Causal attention over the whole sequence ``x``: the reference."""
        q = self.heads(self.wq, x, self.n_heads)
        group = self.n_heads // self.n_kv_heads
        k, v = (self.heads(w, x, self.n_kv_heads).repeat_interleave(group, dim=1)
                for w in (self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


# (dim, heads, K/V heads, batch, chunk lengths, dtype, seed)
_EMPTY = 4096.0  # what the cache's unused slots hold (exact in bfloat16)
CACHE_CASES = (
    (32, 4, 2, 2, (5, 1, 3, 1, 2), torch.float32, 0),
    (24, 6, 3, 3, (1, 1, 4, 1), torch.float64, 1),
    (32, 4, 1, 1, (6, 2, 1, 1), torch.bfloat16, 2),
    (16, 2, 2, 2, (3, 3, 1), torch.float64, 3),  # multi-head: groups of one
    (36, 6, 2, 2, (2, 1, 5), torch.float32, 4),
)


def _counted(module: nn.Module, counter: dict, name: str) -> None:
    def hook(_, args):
        counter[name] = counter.get(name, 0) + args[0].numel() // args[0].shape[-1]
    module.register_forward_pre_hook(hook)


def check_cached_attention(cached_attention: Callable, cases=CACHE_CASES) -> None:
    ex = "14.1"
    require_solution(ex, cached_attention)
    for dim, heads, kv, batch, chunks, dtype, seed in cases:
        where = (f"{heads} query heads, {kv} K/V heads, batch {batch}, chunks "
                 f"{list(chunks)}, {_dtype_name(dtype)}")
        torch.manual_seed(seed)
        attn = GQAttention(dim, heads, kv).to(dtype)
        ref = GQAttention(dim, heads, kv).double()
        ref.load_state_dict(attn.state_dict())
        rows: dict = {}
        for name in ("wq", "wk", "wv"):
            _counted(getattr(attn, name), rows, name)
        total, hd = sum(chunks), dim // heads
        g = torch.Generator().manual_seed(100 + seed)
        seqs = [torch.randn(batch, total, dim, generator=g).to(dtype) for _ in range(2)]
        caches = []
        for _ in seqs:  # unused slots hold _EMPTY: reading them unmasked shows
            shape = (batch, kv, total + 3, hd)
            caches.append({"k": torch.full(shape, _EMPTY, dtype=dtype),
                           "v": torch.full(shape, _EMPTY, dtype=dtype), "len": 0})
        buffers = [(c["k"], c["v"]) for c in caches]
        tol = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 4e-2}[dtype]
        start = 0
        for chunk in chunks:
            end = start + chunk
            for i, (x_all, cache) in enumerate(zip(seqs, caches, strict=True)):
                x = x_all[:, start:end].clone()
                before, rows_before = x.clone(), dict(rows)
                out = _call(ex, cached_attention, attn, x, cache)
                step = f"sequence {i}, tokens {start}..{end - 1} ({where})"
                if not torch.equal(x, before):
                    fail(ex, f"x left as it was ({step})", "x changed in place",
                         "compute new tensors; do not write into the input")
                if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                    fail(ex, f"an output of shape {tuple(x.shape)} ({step})",
                         f"{getattr(out, 'shape', type(out).__name__)}")
                if out.dtype != dtype:
                    fail(ex, f"an output in {_dtype_name(dtype)} ({step})",
                         f"{_dtype_name(out.dtype)}",
                         "keep the input's dtype: the checker also runs float64 "
                         "and bfloat16")
                if cache.get("len") != end:
                    fail(ex, f"cache['len'] = {end} after this call ({step})",
                         f"{cache.get('len')!r}",
                         "advance cache['len'] by the number of new tokens")
                if cache.get("k") is not buffers[i][0] or cache.get("v") is not (
                        buffers[i][1]):
                    fail(ex, f"the keys and values written into the cache's own "
                         f"tensors ({step})", "cache['k'] or cache['v'] replaced by "
                         "another tensor",
                         "write in place: cache['k'][:, :, start:end] = k; the "
                         "cache is allocated once, at its longest length")
                new_rows = {n: rows.get(n, 0) - rows_before.get(n, 0)
                            for n in ("wq", "wk", "wv")}
                if new_rows["wk"] > batch * chunk or new_rows["wv"] > batch * chunk:
                    fail(ex, f"only the {chunk} new token(s) projected to keys and "
                         f"values ({step})", f"{new_rows['wk']} rows through wk for "
                         f"a batch of {batch}",
                         "the cache keeps earlier tokens' keys and values: do not "
                         "recompute them")
                with torch.no_grad():
                    xd = x_all[:, :end].double()
                    want = ref.full(xd)[:, start:end]
                    want_k = ref.heads(ref.wk, xd, kv)
                    want_v = ref.heads(ref.wv, xd, kv)
                scale = tol * max(1.0, want.abs().max().item())
                got_k, got_v = (cache["k"][:, :, :end].double(),
                                cache["v"][:, :, :end].double())

                def close(a, b, s=scale):
                    return a.shape == b.shape and bool(((a - b).abs() <= s).all())

                if not (close(got_k, want_k) and close(got_v, want_v)):
                    swapped = close(got_k, want_v) and close(got_v, want_k)
                    shifted = bool((got_k == _EMPTY).all(-1).any())
                    fail(ex, f"cache['k'] and cache['v'] holding every token's keys "
                         f"and values at positions 0..{end - 1} ({step})",
                         "keys and values swapped" if swapped else
                         "empty (never written) slots among them" if shifted else
                         "other values",
                         "wk gives keys, wv values; write the new tokens at "
                         "positions cache['len'] .. cache['len'] + s - 1")
                got = out.detach().double()
                if not close(got, want) and got.abs().max().item() > _EMPTY / 8:
                    fail(ex, f"outputs from the tokens in the cache ({step})",
                         "outputs as large as the empty slots: slots past "
                         "cache['len'] were read",
                         "attend to cache['k'][:, :, :len] only, or mask the "
                         "slots past it")
                if not close(got, want):
                    diff = (got - want).abs().max().item()
                    if dtype == torch.float64 and diff < 1e-3 * scale / tol:
                        fail(ex, f"the output of recomputing attention over the "
                             f"whole sequence ({step})", f"a largest difference of "
                             f"{diff:.3g}", "the error of float32, not of float64: "
                             "compute in the input's dtype throughout")
                    fail(ex, f"the output of recomputing attention over the whole "
                         f"sequence ({step})", f"a largest difference of {diff:.3g}",
                         "each new token i of the chunk attends to every earlier "
                         "token and to the chunk's tokens up to itself: the mask is "
                         "tril(len) for keys 0..len+s-1; each K/V head serves "
                         "n_heads // n_kv_heads adjacent query heads "
                         "(repeat_interleave)")
            start = end
    passed(ex, "equal to recomputation in chunks of 1-6 tokens, two sequences "
           "interleaved, float32, float64 and bfloat16, written in place.")


# ---------------------------------------------------------------- exercise 14.2

class _FusedAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # all q heads, all k, all v
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cache):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        if cache:
            k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
        cache["k"], cache["v"] = k, v
        t = k.shape[2]
        mask = torch.ones(s, t, dtype=torch.bool, device=x.device).tril(t - s)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _FusedBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _FusedAttention(dim, n_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x, cache):
        x = x + self.attn(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class FusedGPT(nn.Module):
    """The chapter's GPT with one fused query-key-value projection per block."""

    def __init__(self, vocab=64, dim=32, n_heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_FusedBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, caches):
        x = self.embed(tokens)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cache)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, prompt, steps):
        """Greedy tokens (batch, steps) and the logits that chose them."""
        caches = [{} for _ in self.layers]
        logits = self(prompt, caches)[:, -1]
        tokens, chosen = [], []
        for i in range(steps):
            tokens.append(logits.argmax(-1, keepdim=True))
            chosen.append(logits)
            if i < steps - 1:
                logits = self(tokens[-1], caches)[:, -1]
        return torch.cat(tokens, 1), torch.stack(chosen, 1)


# (vocab, dim, heads, layers, batch, prompt, steps, dtype, seed), per world size
TP_CASES = {
    2: ((64, 32, 4, 2, 3, 5, 4, torch.float32, 0),
        (47, 40, 2, 1, 1, 3, 5, torch.float64, 1)),
    4: ((64, 32, 4, 2, 2, 7, 3, torch.float64, 2),
        (53, 48, 8, 2, 1, 4, 4, torch.float32, 3)),
}


class _Counter(TorchDispatchMode):
    """Counts all-reduces and every other collective a rank runs."""

    def __init__(self):
        super().__init__()
        self.all_reduces, self.others = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func.__name__.split(".")[0].strip("_")
            if name in ("allreduce", "all_reduce"):
                self.all_reduces += 1
            elif name not in ("wait_tensor", "barrier", "wrap_tensor_autograd"):
                self.others += 1
        return func(*args, **(kwargs or {}))


def _flops(fn, *args):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = fn(*args)
    return out, counter.get_total_flops()


def _tp_rank(rank: int, world: int, fns: list, cases=None) -> list:
    import copy
    import warnings

    warnings.filterwarnings("ignore")
    cases = cases or TP_CASES[world]
    out = []
    for fn in fns:
        per_case = []
        for vocab, dim, heads, layers, batch, plen, steps, dtype, seed in cases:
            torch.manual_seed(seed)
            model = FusedGPT(vocab, dim, heads, layers).to(dtype).eval()
            prompt = torch.randint(0, vocab, (batch, plen),
                                   generator=torch.Generator().manual_seed(seed))
            (want_t, want_l), ref_flops = _flops(copy.deepcopy(model).generate,
                                                 prompt, steps)
            head_flops = 2 * dim * vocab * batch * (plen + steps)
            given = prompt.clone()
            counter = _Counter()
            try:
                with time_limit(answer_limit("14.2")), torch.no_grad(), counter:
                    got, flops = _flops(fn, model, prompt, steps)
                tokens, logits = got
                per_case.append({
                    "tokens": torch.as_tensor(tokens).detach().cpu(),
                    "logits": torch.as_tensor(logits).detach().cpu(),
                    "want_t": want_t, "want_l": want_l, "flops": flops,
                    "ref_flops": ref_flops, "head_flops": head_flops,
                    "all_reduces": counter.all_reduces, "others": counter.others,
                    "prompt_kept": torch.equal(prompt, given)})
            except Exception as e:  # the others may wait: the launch's timeout ends it
                per_case.append({"error": f"{type(e).__name__}: {str(e)[:200]}"})
                break
        out.append(per_case + [per_case[-1]] * (len(cases) - len(per_case)))
    return out


def judge_tp(ranks: list[list[dict]], cases=None) -> None:
    """``ranks[r][c]``: rank r's result for case c. Fail with the mistake made."""
    ex = "14.2"
    world = len(ranks)
    cases = cases or TP_CASES[world]
    for c, case in enumerate(cases):
        vocab, _, heads, layers, batch, plen, steps, dtype, _ = case
        where = (f"{world} ranks, {heads} heads, {layers} layers, batch {batch}, "
                 f"prompt {plen}, {steps} steps, {_dtype_name(dtype)}")
        for rank, r in enumerate(r[c] for r in ranks):
            if "error" in r:
                hint = ("each rank keeps heads // world_size heads: read the world "
                        "size from dist.get_world_size()"
                        if "shape" in r["error"] or "size" in r["error"] else
                        "fix that error and run the exercise cell again")
                if c and ("shape" in r["error"] or "size" in r["error"]):
                    hint = ("the first case ran; this one brings another model, of "
                            "other sizes: keep nothing between calls, and shard "
                            "the model that each call receives")
                if "took longer than" in r["error"]:
                    hint = ("your function did not return: look for a loop that "
                            "never ends")
                # the rank left in an extra collective is told, by timing, that
                # the others timed out, closed or reset their connections
                if peer_went_away(r["error"]) or "Timed out" in r["error"]:
                    hint = ("a rank waited in a collective that another never joined: "
                            "every rank runs the same all-reduces, in the same order")
                fail(ex, f"tp_generate to run ({where})", f"rank {rank}: {r['error']}",
                     hint)
            if not r["prompt_kept"]:
                fail(ex, f"the prompt left as it was ({where})",
                     f"rank {rank} changed it in place")
            t, lg = r["tokens"], r["logits"]
            if tuple(t.shape) != (batch, steps) or tuple(lg.shape) != (batch, steps,
                                                                     vocab):
                fail(ex, f"tokens {(batch, steps)} and logits {(batch, steps, vocab)} "
                     f"({where})", f"{tuple(t.shape)} and {tuple(lg.shape)} on rank "
                     f"{rank}",
                     "return (tokens, logits) as the chapter's generate does")
            if lg.dtype != dtype:
                fail(ex, f"logits in {_dtype_name(dtype)} ({where})",
                     f"{_dtype_name(lg.dtype)} on rank {rank}",
                     "keep the model's dtype: the checker runs float32 and float64")
            tol = 1e-4 if dtype == torch.float32 else 1e-9
            scale = tol * max(1.0, r["want_l"].abs().max().item())
            diff = (lg.double() - r["want_l"].double()).abs().max().item()
            if not torch.equal(t, r["want_t"]) or diff > scale:
                fail(ex, f"the tokens and logits of one process ({where})",
                     f"rank {rank}: logits differ by up to {diff:.3g}",
                     "each rank keeps the query, key and value rows of its own "
                     "heads (the fused projection holds all q rows, then all k, then "
                     "all v), the matching columns of wo, its rows of mlp.0 and its "
                     "columns of mlp.2; the all-reduce sums the partial outputs of wo "
                     "and mlp.2, and mlp.2's bias is added once, after it")
            forwards = {2 * layers * steps, 2 * layers * (steps + 1)}
            if r["all_reduces"] not in forwards:
                fail(ex, f"2 all-reduces per layer per forward: {2 * layers * steps} "
                     f"for {steps} tokens ({where})",
                     f"{r['all_reduces']} all-reduces on rank {rank}"
                     + (f" and {r['others']} other collectives" if r["others"] else ""),
                     "one all-reduce after attention's output matrix and one after "
                     "the MLP's second matrix, in every layer and every forward")
            if r["others"]:
                fail(ex, f"no other collective than the all-reduces ({where})",
                     f"{r['others']} other collectives on rank {rank}",
                     "embedding, norms and head stay whole on every rank: each "
                     "rank picks the same token itself, with nothing to send")
            # the blocks' share split N ways, the head whole, as often as generate
            # runs them and one forward more; a matrix kept whole on every rank
            # goes over
            extra = (plen + steps) / (plen + steps - 1)
            bound = extra * (1.05 * (r["ref_flops"] - r["head_flops"]) / world
                             + r["head_flops"])
            if r["flops"] > bound:
                fail(ex, f"rank {rank} computing about 1/{world} of the blocks' FLOPs "
                     f"({where})", f"{r['flops'] / r['ref_flops']:.2f} x one "
                     "process's",
                     "multiply only this rank's shard of each matrix, and keep a KV "
                     "cache of its heads instead of recomputing the whole sequence")


def _run_tp(fns: list, world: int) -> list:
    """Each answer's tokens and counts on ``world`` ranks, in one launch that may
    take ``answer_limit("14.2")`` per answer."""
    timeout = answer_limit("14.2", len(fns))
    try:
        ranks = [r.value for r in launch(_tp_rank, world, args=(fns,),
                                         timeout=timeout, backend="gloo", echo=False)]
    except RankFailed as e:
        fail("14.2", "every rank to finish", str(e).splitlines()[0][:200],
             "every rank must run the same collectives in the same order")
    except LaunchTimeout as e:
        fail("14.2", "every rank to finish", f"your answer did not finish: {stuck(e)}",
             "a rank waited in an all-reduce that another never joined: every rank "
             "runs the same number of all-reduces, in the same order")
    return [[r[i] for r in ranks] for i in range(len(fns))]


def check_tp_generate(tp_generate: Callable) -> None:
    require_solution("14.2", tp_generate)
    for world in (2, 4):
        judge_tp(_run_tp([tp_generate], world)[0])
    passed("14.2", "tokens and logits equal to one process on 2 and 4 ranks, "
           "2 all-reduces per layer and token, 1/N of the FLOPs per rank.")


# ---------------------------------------------------------------- exercise 14.3

# a grouped-query model with fewer K/V heads than some tensor-parallel degrees
FEW_KV = planner.Decoder("a 2-K/V-head model", 32, 4096, 14336, 32, 2, 32000)


def plan_cases():
    """(model, gpu, context, tp, dtype bytes): contexts drawn, not listed."""
    g = torch.Generator().manual_seed(14)

    def ctx(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))
    return (
        (planner.LLAMA3_8B, "h100_sxm", ctx(3000, 9000), 1, 2),
        (planner.LLAMA3_70B, "h100_sxm", ctx(1000, 5000), 4, 2),
        (planner.LLAMA3_70B, "a100_sxm_80gb", ctx(20000, 60000), 8, 1),
        (planner.LLAMA2_7B, "l4", ctx(500, 3000), 1, 2),
        (planner.MIXTRAL_8X7B, "h100_sxm", ctx(2000, 30000), 2, 2),
        (FEW_KV, "h100_sxm", ctx(5000, 20000), 4, 2),
        (planner.LLAMA3_8B, "t4", ctx(1000, 4000), 1, 4),
        (planner.LLAMA3_405B, "h100_sxm", ctx(1000, 5000), 1, 2),  # does not fit
        (planner.LLAMA3_8B, "h100_pcie", ctx(200, 2000), 2, 1),
        (planner.LLAMA3_8B, "h100_sxm", ctx(9000, 30000), 1, 2),  # a longer context
    )


def _variants(model, gpu, context, tp, nbytes) -> dict:
    """What typical mistakes give, to name the one made (never the answer)."""
    cap = reference.published(f"{gpu}.memory_gb").value
    share = serving.memory_share()
    heads = max(1, model.kv_heads // tp)

    def batch(usable, weights, per_token):
        return max(0, math.floor((usable - weights) / (context * per_token)))

    kv = 2 * model.head_dim * model.layers * nbytes
    w = model.params() * nbytes
    return {
        "the weights' share ignored": batch(cap * 2**30 * share, 0, kv * heads),
        "all the weights on every GPU (not 1 / tp)": batch(cap * 2**30 * share, w,
                                                           kv * heads),
        "16-bit bytes whatever the dtype": batch(
            cap * 2**30 * share, model.params() * 2 / tp,
            2 * model.head_dim * model.layers * 2 * heads),
        "the whole memory, not the serving engine's share": batch(cap * 2**30, w / tp,
                                                                  kv * heads),
        "decimal GB (10**9) for a binary memory size": batch(cap * 1e9 * share, w / tp,
                                                             kv * heads),
        "K/V heads split below one per GPU": batch(cap * 2**30 * share, w / tp,
                                                   kv * model.kv_heads / tp),
        "the K/V heads not split across tensor-parallel GPUs": batch(
            cap * 2**30 * share, w / tp, kv * model.kv_heads),
        "only keys (or only values) counted": batch(cap * 2**30 * share, w / tp,
                                                    kv * heads / 2),
    }


_PEEKING = ("max_batch", "_variants", "plan_cases", "ch14", "course_utils.checks",
            "_getframe", "currentframe", "f_back", "f_locals", "inspect")


def check_serving_plan(serving_plan: Callable, cases=None) -> None:
    ex = "14.3"
    require_solution(ex, serving_plan)
    from course_utils.checks.ch13 import _names

    found = sorted(n for n in _names(serving_plan) if n in _PEEKING)
    if found:
        fail(ex, "the batch computed from bytes", f"code that calls {found[0]}",
             "count the bytes yourself: serving.max_batch is the answer, and the "
             "checker's own cases are not yours to read")
    cases = cases or plan_cases()
    earlier = {}  # (model, gpu, tp, dtype) -> (context, the batch answered)
    for model, gpu, context, tp, nbytes in cases:
        where = f"{model.name} on {gpu}, tp {tp}, {nbytes}-byte dtype"
        got = _call(ex, serving_plan, model, gpu, context, tp, nbytes)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            fail(ex, f"(batch, tokens per second) ({where})", f"{got!r:.80}")
        batch, rate = got
        want = serving.max_batch(model, gpu, context, tp=tp, dtype_bytes=nbytes)
        if not isinstance(batch, numbers.Real) or batch != want:
            named = [k for k, v in _variants(model, gpu, context, tp, nbytes).items()
                     if v == batch and v != want]
            seen = f"{batch!r:.40}" + (f": the count with {named[0]}" if named else "")
            before = earlier.get((model.name, gpu, tp, nbytes))
            if before and before[1] == batch and before[0] != context:
                seen = (f"{batch!r:.40}: the batch answered before for this model, "
                        "GPU and degree at another context (kept from an earlier "
                        "call?)")
            hint = ("round down: a sequence that does not fit whole does not run"
                    if isinstance(batch, numbers.Real) and abs(batch - want) == 1 else
                    "per GPU: the serving engine's share of its memory (binary "
                    "GiB), less its 1 / tp of the weights, over one sequence's cache "
                    "on that GPU (its K/V heads split over tp, at least one each; "
                    "bytes of the given dtype)")
            many = isinstance(batch, numbers.Real) and batch > want
            fail(ex, f"the largest batch that fits ({where}, a context the chapter "
                 "does not show)", seen + (" (too many)" if many else " (too few)"),
                 hint)
        earlier[model.name, gpu, tp, nbytes] = (context, batch)
        t = (serving.decode_seconds(model, gpu, want, context, tp=tp).value
             if want else 0)
        right = want / t if want else 0.0
        try:
            ok = math.isclose(float(rate), right, rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            one = (1 / serving.decode_seconds(model, gpu, 1, context, tp=tp).value
                   if want else 0)
            seen = (f"{rate!r:.40}"
                    + (": one sequence's tokens per second" if want and math.isclose(
                        float(rate), one, rel_tol=1e-6) else "")
                    + (": divided by the GPUs" if want and math.isclose(
                        float(rate), right / tp, rel_tol=1e-6) and tp > 1 else ""))
            fail(ex, f"decode tokens per second at that batch ({where})", seen,
                 "every sequence of the batch makes one token per decode step: "
                 "batch / serving.decode_seconds(model, gpu, batch, context, tp).value "
                 "(0 when nothing fits)")
    passed(ex, f"batch and tokens per second equal to the step model on {len(cases)} "
           "models, GPUs, contexts, degrees and dtypes.")
