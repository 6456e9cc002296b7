# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 14: Parallelism for inference
#
# **What you will learn**
#
# - Why generating text is two workloads: a prefill that multiplies a whole
#   prompt at once, and a decode that reads every weight and the whole KV
#   cache for each new token; measured here against batch size, predicted
#   for an H100.
# - What the KV cache costs: bytes per token for multi-head, grouped-query
#   and multi-latent attention, counted on real tensors; how many sequences
#   fit beside the weights; paged allocation built by hand.
# - Tensor parallelism for decode: Chapter 10's Megatron split on 2 and 4
#   ranks, equal to one process token for token, with its all-reduces per
#   layer and token counted.
# - Serving layouts: replicas, attention data-parallel with experts sharded
#   and a per-step `all_to_all_single` dispatch (DeepSeek-V3's layout,
#   published), pipelines, and prefill/decode disaggregation.
# - Speculative decoding: a small draft model guesses, the large one checks
#   several tokens in one pass; the same tokens as plain greedy decoding,
#   with the acceptance and speed-up measured.
#
# **Hardware.** Every rank is a real process joined by `gloo` on the CPU,
# or by `nccl` with one GPU per rank when there are at least as many GPUs
# as ranks (on one GPU or two T4s, the 4-rank launches run on `gloo`; the
# decode pipeline runs on `gloo` everywhere). Tokens, logits and
# collectives below are measured. What a served model does on
# an H100 is a labelled prediction of the course's step model for serving
# (`course_utils.serving`), calibrated on published decode and prefill runs.

# %%
import itertools
import math
import time
import warnings

import ipywidgets as widgets
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from course_utils import banner, for_device, planner, reference, serving, try_gpu
from course_utils.checks.ch14 import (
    FusedGPT,
    check_cached_attention,
    check_serving_plan,
    check_tp_generate,
)
from course_utils.cleanup import scratch_folder, tidy_up
from course_utils.compare import compare, usable_cores
from course_utils.dist import choose_backend, launch

banner()
device = try_gpu()


def rank_device(rank):
    """The rank's GPU under nccl (one per rank), else the CPU."""
    if "nccl" in dist.get_backend():
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


# %% [markdown]
# ## 1. Prefill and decode are different workloads
#
# The model is Chapter 13's small GPT, with one change: attention can keep
# a **KV cache**. Generation runs the prompt through the model once (the
# *prefill*), then adds one token at a time (the *decode*). A new token's
# query must meet the keys and values of every earlier token; those do not
# change, so each layer keeps them and the decode step computes only the
# new token's. `cache` is a dict per layer: empty before the prefill, then
# holding `k` and `v` of shape (batch, heads, tokens so far, head_dim).
# A chunk of `s` new tokens after `t - s` cached ones sees, for its query
# `i`, the keys `0 .. t - s + i`: that is the causal mask `tril(t - s)`.

# %%
class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False)
                                              for _ in range(4))

    def forward(self, x, cache=None):
        b, s, _ = x.shape  # -1 heads: the local head count under TP
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        if cache is not None:  # grow the cache by this chunk, then read all of it
            if cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        t = k.shape[2]
        mask = torch.ones(s, t, dtype=torch.bool, device=x.device).tril(t - s)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x, cache=None):
        x = x + self.attn(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, dim=64, n_heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, caches=None):
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, None if caches is None else caches[i])
        return self.head(self.norm(x))


@torch.no_grad()
def generate(model, prompt, steps):
    """Greedy decoding with a KV cache: the tokens and the logits that chose them."""
    caches = [{} for _ in model.layers]
    logits = model(prompt, caches)[:, -1]  # the prefill
    tokens, chosen = [], []
    for i in range(steps):
        tokens.append(logits.argmax(-1, keepdim=True))
        chosen.append(logits)
        if i < steps - 1:
            logits = model(tokens[-1], caches)[:, -1]  # one decode step
    return torch.cat(tokens, 1), torch.stack(chosen, 1)


# %% [markdown]
# The cache changes nothing but the work: the logits that choose each
# token equal those of running the model on the whole sequence again.

# %%
torch.manual_seed(0)
gpt = GPT().eval()
prompt = torch.randint(0, 64, (3, 7))
tokens, logits = generate(gpt, prompt, 6)
with torch.no_grad():
    again = gpt(torch.cat([prompt, tokens], 1))[:, prompt.shape[1] - 1:-1]
print(f"tokens {tokens[0].tolist()}; largest logit difference from recomputing "
      f"the whole sequence: {(logits - again).abs().max():.1e}")

# %% [markdown]
# **Why decode is memory-bound.** A decode step multiplies a batch of `b`
# rows by every weight matrix: about `2 x parameters` FLOPs per row, but
# every weight is read from memory once for the whole batch. At batch 1
# that is 2 FLOPs per two bytes read (16-bit weights), far below what any
# GPU needs to keep its matmul units busy (Chapter 2's roofline: an H100
# needs about 300). So a step costs the time to read the weights, whatever
# the batch, until the batch is large enough for the FLOPs to take longer.
# A prefill of `s` tokens multiplies `s` rows at once and is compute-bound
# from a few hundred tokens on. Measured here, a larger model than above,
# one decode step for each batch and the prefill of the same prompts:

# %%
@torch.no_grad()
def time_per_token(model, batch, prompt_len=32, vocab=64):
    prompt = torch.randint(0, vocab, (batch, prompt_len), device=device)
    caches = [{} for _ in model.layers]
    t0 = time.perf_counter()
    logits = model(prompt, caches)
    nxt = logits[:, -1:].argmax(-1).cpu().to(device)  # .cpu() waits for the GPU
    prefill = time.perf_counter() - t0
    steps = []
    for _ in range(5):  # each step from the same cache, a copy of its dicts
        t0 = time.perf_counter()
        model(nxt, [dict(c) for c in caches])
        if device.type == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
    return prefill / (batch * prompt_len), sorted(steps)[2]


torch.manual_seed(0)
dim = for_device(device, 512, 2048)
big = GPT(dim=dim, n_heads=8, n_layers=4).to(device).eval()
print(f"{sum(p.numel() for p in big.parameters()) / 1e6:.1f} M parameters, "
      f"{sum(p.nbytes for p in big.parameters()) / 2**20:.0f} MiB in float32")
print(f"{'batch':>5s} {'decode step':>12s} {'per token':>10s} {'prefill per token':>18s}")
for b in (1, 4, 16, 64):
    time_per_token(big, b)  # warm-up
    pre, step = time_per_token(big, b)
    print(f"{b:5d} {step * 1e3:9.2f} ms {step / b * 1e3:7.3f} ms {pre * 1e3:15.4f} ms")

# %% [markdown]
# Read the columns down. A decode step costs much less than `b` times the
# step at batch 1: the weights are read once per step whatever the batch,
# so the time per token falls as the batch grows. The prefill's time per
# token is far below the decode's: its matmuls have many rows. On a CPU,
# and for a model this small on a GPU, the cost of launching each operator
# also counts at small batches.
#
# On a GPU the same arithmetic, with the step model for serving
# (`serving.decode_seconds`: the larger of bytes read over the achieved
# bandwidth and FLOPs over the achieved matmul rate), for Llama 3 8B on
# one H100 with 2,048 tokens of context per sequence:

# %%
llama8 = planner.LLAMA3_8B
for b in (1, 16, 64, 256):
    f = serving.decode_seconds(llama8, "h100_sxm", b, 2048)
    print(f"batch {b:3d}: {f.value * 1e3:6.2f} ms per step, {b / f.value:8,.0f} "
          f"tokens/s ({f.measures.split(' = ')[1].split(',')[0]})")
print(f"[{f.label}]")
pre = serving.prefill_seconds(llama8, "h100_sxm", 2048)
print(f"prefill of one 2,048-token prompt: {pre.value * 1e3:.0f} ms, "
      f"{2048 / pre.value:,.0f} tokens/s [{pre.label}]")
cross = serving.decode_crossover_batch(llama8, "h100_sxm", 0)
print(f"decode becomes compute-bound at batch {cross} with no context; with "
      "2,048 tokens of context it stays memory-bound at every batch: each "
      "sequence's KV cache is read at every step, as the weights are")

# %% [markdown]
# A served model therefore batches as many sequences as its memory holds:
# at batch 64 an H100 makes tens of times more tokens per second than at
# batch 1, for a step only about twice as long. What limits the batch is
# the KV cache.
#
# ## 2. The KV cache's memory
#
# Each layer caches a key and a value per token for every K/V head:
# `2 x kv_heads x head_dim` numbers. Multi-head attention has as many K/V
# heads as query heads; grouped-query attention (GQA, Llama 3: 8 K/V heads
# for 64 query heads in the 70B) shares each K/V head among a group of
# query heads; multi-latent attention (MLA, DeepSeek-V2 and V3) caches one
# compressed vector per token and layer (512 numbers) plus a shared rotary
# key (64), from which the keys and values are rebuilt. One token's cache
# entries, made as real tensors in bfloat16 and counted:

# %%
def cache_of_one_token(model, dtype=torch.bfloat16):
    """One token's cache entries for every layer, as the model's attention keeps them."""
    if model.name in serving.KV_LATENT:  # MLA: one latent (and rotary key) per layer
        return [torch.zeros(1, serving.KV_LATENT[model.name], dtype=dtype)
                for _ in range(model.layers)]
    return [torch.zeros(2, model.kv_heads, 1, model.head_dim, dtype=dtype)
            for _ in range(model.layers)]


for m, kind in ((planner.LLAMA2_7B, "multi-head"), (planner.LLAMA3_8B, "grouped"),
                (planner.LLAMA3_70B, "grouped"), (planner.DEEPSEEK_V3, "latent")):
    counted = sum(t.nbytes for t in cache_of_one_token(m))
    print(f"{m.name:18s} {kind:10s} {counted / 1024:7.1f} KiB per token "
          f"({counted // m.layers:6,d} bytes per layer); step model: "
          f"{serving.kv_bytes_per_token(m) / 1024:.1f} KiB")

# %% [markdown]
# Grouped-query attention divides the cache by the group size (Llama-2-7B
# shapes keep 4 times more per token than Llama 3 8B); DeepSeek-V3, with
# 128 heads of 128 per layer, caches less per token than Llama 3 70B.
#
# **How many sequences fit.** A GPU holds its share of the weights; a
# serving engine fills a fixed fraction of the rest (vLLM's default,
# `serving.memory_share()`) with cache blocks. Drag the sliders: model,
# context per sequence, the batch you would like, and the dtype of weights
# and cache (fp8 halves both).

# %%
def fits(model="Llama 3 8B", context=8192, batch=32, dtype="bf16", gpu="h100_sxm"):
    m, nbytes = planner.MODELS[model], {"fp32": 4, "bf16": 2, "fp8": 1}[dtype]
    weights = serving.weight_bytes(m, nbytes)
    per_seq = context * serving.kv_bytes_per_token(m, nbytes)
    usable = reference.published(f"{gpu}.memory_gb").value * 2**30 * (
        serving.memory_share())
    most = serving.max_batch(m, gpu, context, dtype_bytes=nbytes)
    print(f"{m.name} on one {gpu}: weights {weights / 2**30:.1f} GiB, "
          f"{per_seq / 2**30:.2f} GiB of cache per sequence, {usable / 2**30:.1f} "
          f"GiB usable")
    need = weights + batch * per_seq
    print(f"batch {batch}: {need / 2**30:.1f} GiB - "
          + ("fits" if need <= usable else "does NOT fit")
          + f"; at most {most} sequences of {context} tokens")


widgets.interact(fits, model=list(planner.MODELS),
                 context=widgets.SelectionSlider(
                     options=[512, 2048, 8192, 32768, 131072], value=8192),
                 batch=widgets.SelectionSlider(options=[1, 8, 32, 128, 512],
                                               value=32),
                 dtype=["bf16", "fp8", "fp32"], gpu=list(planner.GPUS));

# %% [markdown]
# **Paged allocation.** Sequences grow one token at a time and end at
# lengths nobody knows in advance. An allocator that reserves each
# sequence's longest possible context in one contiguous piece wastes most
# of it; vLLM's PagedAttention instead cuts the cache into blocks of a few
# tokens, hands a sequence a new block when its last one is full, and
# keeps a *block table* per sequence that says where its blocks are. A
# sequence wastes less than one block, and any free block serves any
# sequence, so freed memory never fragments. A pool of blocks, by hand:

# %%
class BlockPool:
    def __init__(self, n_blocks, block_size):
        self.free, self.block_size = list(range(n_blocks)), block_size

    def grow(self, table, length):  # blocks for `length` tokens, or False
        need = -(-length // self.block_size) - len(table)
        if need > len(self.free):
            return False
        table += [self.free.pop() for _ in range(need)]
        return True

    def release(self, table):
        self.free += table
        table.clear()


# %% [markdown]
# The cache itself is one tensor of blocks; a sequence's keys are its
# blocks read in table order. Written in scattered blocks, read back, they
# equal the keys written contiguously:

# %%
torch.manual_seed(0)
pool = BlockPool(n_blocks=32, block_size=4)
k_blocks = torch.zeros(32, 4, 2, 8)  # (block, slot, kv heads, head_dim)
tables, keys = [[], []], [torch.randn(10, 2, 8), torch.randn(7, 2, 8)]
for n in range(10):  # two sequences grow token by token, interleaved
    for table, k in zip(tables, keys, strict=True):
        if n < len(k):
            pool.grow(table, n + 1)
            k_blocks[table[n // 4], n % 4] = k[n]
read = [k_blocks[t].flatten(0, 1)[:len(k)] for t, k in zip(tables, keys, strict=True)]
print(f"block tables {tables}; read back equal: "
      f"{all(torch.equal(r, k) for r, k in zip(read, keys, strict=True))}")

# %% [markdown]
# What that buys, on a stream of requests of random lengths up to 2,048
# tokens into a cache of 16,384 token slots: how many run at once when each
# reserves its longest context, and when each takes 16-token blocks as it
# grows (a request that finds no room waits).

# %%
def concurrent(paged, slots=16384, longest=2048, block=16, n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, longest, (n,), generator=g).tolist()
    size = block if paged else longest  # a contiguous request reserves it all
    pool, running, waiting, counts, used = BlockPool(slots // size, size), [], 0, [], []
    while waiting < n or running:
        while waiting < n and pool.grow(table := [], 1 if paged else longest):
            running.append([table, 1, lengths[waiting]])
            waiting += 1
        counts.append(len(running))
        used.append(sum(r[1] for r in running) / slots)
        for r in running:  # one decode step: every running sequence grows
            r[1] += 1
            if r[1] > r[2] or not pool.grow(r[0], r[1]):
                pool.release(r[0])  # finished (or preempted: it would recompute)
        running = [r for r in running if r[0]]
    return sum(counts) / len(counts), sum(used) / len(used)


for paged in (False, True):
    n, used = concurrent(paged)
    print(f"{'paged, 16-token blocks' if paged else 'contiguous, longest context':28s}"
          f" {n:5.1f} sequences at once, {used:4.0%} of the slots hold tokens")

# %% [markdown]
# Paging runs several times more sequences at once on the same memory, and
# with the batch, the tokens per second of section 1 (a sequence that
# finds no block left is preempted here; vLLM recomputes or swaps it).
#
# ## 3. Tensor parallelism for decode
#
# A model too large for one GPU, or one that must answer faster, is split
# with Chapter 10's Megatron plan: the query, key, value and first MLP
# matrices by columns (each rank its heads and its share of the hidden
# units), the output and second MLP matrices by rows, and an all-reduce
# after each row-parallel matrix. Each rank's KV cache holds only its own
# heads, so the cache is split too. The plan below is Chapter 13's; the
# decode loop is `generate` unchanged. A dispatch mode counts the
# collectives of the decode steps.

# %%
TP_PLAN = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
           "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
           "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


class AllReduces(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace in ("c10d", "_c10d_functional") and (
            "allreduce" in func.__name__ or "all_reduce" in func.__name__)
        return func(*args, **(kwargs or {}))


def tp_decode(rank, world, steps=8, n_layers=3):
    warnings.filterwarnings("ignore")
    dev = rank_device(rank)
    torch.manual_seed(0)
    model = GPT(n_layers=n_layers).to(dev).eval()
    prompt = torch.randint(0, 64, (2, 5), device=dev)
    one = generate(model, prompt, steps) if rank == 0 else None
    mesh = init_device_mesh(dev.type, (world,))
    for block in model.layers:
        parallelize_module(block, mesh, TP_PLAN)
    with AllReduces() as counter:
        tokens, logits = generate(model, prompt, steps)
    return {"one": one, "tp": (tokens, logits), "all_reduces": counter.count,
            "heads": model.layers[0].attn.wq.weight.to_local().shape[0] // 16}


for world in (2, 4):
    runs = launch(tp_decode, world, timeout=120, echo=False)
    (one_t, one_l), (tp_t, tp_l) = runs[0].value["one"], runs[0].value["tp"]
    n = runs[0].value["all_reduces"]
    print(f"{world} ranks, {runs[0].value['heads']} of 4 heads each: tokens equal to one "
          f"process: {torch.equal(one_t, tp_t)}, largest logit difference "
          f"{(one_l - tp_l).abs().max():.1e}; {n} all-reduces = {n // 8} per "
          f"forward, {n // 8 // 3} per layer and token")

# %% [markdown]
# Two all-reduces per layer for every token, each carrying only the
# batch's activations (`batch x dim` numbers), but each on the critical
# path: the next layer cannot start before it ends. A decode step of a
# large model on 8 GPUs runs 160 of them (80 layers); their latency, not
# their bytes, is what tensor parallelism costs in decode. That is why it
# stays within a node, on NVLink. Predicted for Llama 3 70B (batch 1,
# 2,048 tokens of context), over NVLink and over PCIe:

# %%
l70 = planner.LLAMA3_70B
for tp in (1, 2, 4, 8):
    nv = serving.decode_seconds(l70, "h100_sxm", 1, 2048, tp=tp)
    pcie = serving.decode_seconds(l70, "h100_pcie", 1, 2048, tp=tp, link="pcie5_x16")
    room = serving.max_batch(l70, "h100_sxm", 2048, tp=tp)
    print(f"tp {tp}: {nv.value * 1e3:6.2f} ms per token on NVLink, "
          f"{pcie.value * 1e3:6.2f} ms over PCIe; "
          + (f"room for {room} sequences per GPU" if room else "does not fit"))
print(f"[{nv.label}]\n[{pcie.label}]")

# %% [markdown]
# Each doubling of the degree halves the bytes each GPU reads, and adds
# all-reduces of fixed latency: the time per token falls less and less.
# The step model for serving has no across-node link for these
# all-reduces (every published decode run it was fitted on used NVLink):
# across nodes each of the 160 per token would cross the network instead,
# with its slower links and longer latency. Serving stacks keep tensor
# parallelism inside a node and use other dimensions across nodes.

# %% [markdown]
# ## 4. Data and expert parallelism for serving
#
# **Replicas behind one queue.** The simplest way to serve more requests
# is more copies of the model, each taking the next request from a shared
# queue: throughput grows with the replicas, and the time per token stays
# that of one replica. No collective runs between them, so replicas go
# across nodes freely.
#
# Measured here: a small GPT served to 12 requests (prompts of 16 tokens,
# 6 to 16 new tokens each), all waiting at once, by 1 replica and by one per
# core. Each replica is a process with its own copy of the model; a counter
# that every replica can increment (`dist.FileStore.add`, atomic) is the
# queue: a free replica takes the next request. No collective joins them.

# %%
def replica(rank, world, queue_file, requests):
    """One copy of the model: serve the next request until none is left."""
    dev = rank_device(rank)
    torch.manual_seed(0)  # every replica the same weights
    model = GPT(dim=256, n_heads=8, n_layers=4).to(dev).eval()
    queue = dist.FileStore(queue_file, world)  # shared by every replica
    generate(model, requests[0][0].to(dev), 2)  # warm-up
    dist.barrier()  # they start serving at once
    start, cpu, served = time.perf_counter(), time.process_time(), []
    while (i := queue.add("next", 1) - 1) < len(requests):
        prompt, steps = requests[i]
        t0 = time.perf_counter()
        tokens = generate(model, prompt.to(dev), steps)[0].cpu()  # waits for a GPU
        done = time.perf_counter()
        served.append({"request": i, "done_s": done - start, "tokens": tokens,
                       "per_token_s": (done - t0) / steps})
    return {"served": served, "span_s": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu, "all_cpu_s": time.process_time()}


torch.manual_seed(2)
requests = [(torch.randint(0, 64, (1, 16)), int(s))
            for s in torch.randint(6, 17, (12,))]
total_tokens = sum(steps for _, steps in requests)
queues, served = scratch_folder("ch14-queue-"), {}


def serve(n):
    def run():
        path = str(queues / f"{n}-{len(served.get(n, []))}")
        out = [r.value for r in launch(replica, n, args=(path, requests),
                                       backend=backend, timeout=120, echo=False)]
        served.setdefault(n, []).append(out)
        span = max(v["span_s"] for v in out)  # until the last request was done
        return {"wall_s": span / total_tokens,
                "cpu_s": sum(v["cpu_s"] for v in out) / total_tokens,
                "all_cpu_s": sum(v["all_cpu_s"] for v in out)}
    return run


counts = sorted({1, min(usable_cores(), 4)})
backend = choose_backend(max(counts))  # both sides on GPUs, or both on CPUs
names = {n: f"{n} replica{'s' * (n > 1)}" for n in counts}
throughput = compare({names[n]: serve(n) for n in counts}, repeats=3, warmup=0)
print(f"time per generated token, {total_tokens} tokens (1 / throughput):")
print(throughput)
per_token = throughput.on({names[n]: [sorted(s["per_token_s"] for v in run
                                             for s in v["served"])[len(requests) // 2]
                                      for run in served[n]] for n in counts})
print("a request's own time per token (its latency, median of the requests):")
print(per_token)
one = {s["request"]: s["tokens"] for v in served[1][0] for s in v["served"]}
same = all(torch.equal(one[s["request"]], s["tokens"])
           for n in counts for run in served[n] for v in run for s in v["served"])
print(f"every request's tokens equal to one replica's: {same}")


# %% [markdown]
# Two verdicts from the same runs. The first is throughput: on a quiet
# machine, with a replica per core, the requests are served in about 1/n
# of the time. The second is each request's own time per token, which
# more replicas do not shorten: the gain comes from serving requests side
# by side, not from serving any one faster (on a CPU, replicas sharing
# caches and memory bandwidth may even make it a little longer). To cut
# the time per token, split each request's work instead: tensor
# parallelism, above.
#
# **Attention data-parallel, experts sharded.** A mixture of experts has
# far more weights in its experts than in its attention, and each token
# uses only a few experts. DeepSeek-V3 serves with each GPU group running
# attention for its own requests (data parallelism, with their KV cache
# kept there), and the experts spread one or a few per GPU over the whole
# unit (expert parallelism). Every decode step, every MoE layer sends each
# token to the GPU of its expert and back: two all-to-alls per layer and
# step. Its published layouts:

# %%
for key in ("deepseek_v3_2024.serving_prefill_unit",
            "deepseek_v3_2024.serving_decode_unit"):
    f = reference.published(key)
    print(f"{f.value}\n    [{f.label}]")

# %% [markdown]
# One MoE layer of one decode step, on 4 ranks: each rank holds its own
# requests (a different number each, as in serving), 1 of the 4 experts,
# and the router. Top-1 routing; the counts are exchanged first, then the
# tokens, sorted by destination, with `all_to_all_single` (Chapter 11);
# each rank runs its expert and sends the results back. Every rank also
# computes the layer with all the experts, one process's answer.

# %%
def moe_decode_step(rank, world, n_experts=4, dim=16):
    dev = rank_device(rank)
    torch.manual_seed(0)  # every rank builds every expert alike, keeps its own
    router = nn.Linear(dim, n_experts, bias=False).to(dev)
    experts = [nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                             nn.Linear(2 * dim, dim)).to(dev) for _ in range(n_experts)]
    per = n_experts // world
    torch.manual_seed(1 + rank)  # each rank its own requests
    x = torch.randn(3 + 2 * rank, dim, device=dev)
    with torch.no_grad():
        choice = router(x).argmax(-1)
        order = choice.argsort()
        send = torch.bincount(choice[order] // per, minlength=world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        ins, outs = recv.tolist(), send.tolist()
        tokens = x.new_empty(sum(ins), dim)
        dist.all_to_all_single(tokens, x[order], ins, outs)
        which = choice.new_empty(sum(ins))
        dist.all_to_all_single(which, choice[order], ins, outs)
        out = torch.zeros_like(tokens)
        for e in range(rank * per, (rank + 1) * per):
            out[which == e] = experts[e](tokens[which == e])
        back = torch.empty_like(x)
        dist.all_to_all_single(back, out, outs, ins)
        y = torch.empty_like(x)
        y[order] = back
        one = torch.stack([experts[c](t) for t, c in zip(x, choice.tolist(),
                                                         strict=True)])
    return {"diff": (y - one).abs().max().item(), "sent": outs, "got": sum(ins)}


for r, res in enumerate(launch(moe_decode_step, 4, timeout=120, echo=False)):
    v = res.value
    print(f"rank {r}: sent {v['sent']} tokens to ranks 0-3, ran its expert on "
          f"{v['got']}; largest difference from one process {v['diff']:.1e}")

# %% [markdown]
# Each rank's expert works on tokens from every rank, so an expert sees a
# batch of the whole unit: that is what makes a decode step's expert
# matmuls large enough to use the GPU (DeepSeek-V3's decode unit spreads
# them over 320 GPUs). The price is latency: two all-to-alls per layer,
# across nodes, on the critical path of every token.
#
# ## 5. Pipelines and disaggregation
#
# **Pipeline parallelism for inference** splits the layers into stages
# (Chapter 7) and keeps every stage busy with different micro-batches of
# requests. There is no backward pass and so no bubble in steady state:
# throughput grows with the stages. A single token still passes through
# every stage in turn, so its latency does not fall; it rises by a send per
# stage boundary. Pipelines serve a model too large for one node.
#
# Measured here, on CPU ranks: a GPT of 4 layers (width 768) cut into 2
# stages of 2 layers, one per rank. One process decodes one micro-batch of
# 2 requests through all 4 layers; the pipeline decodes two micro-batches,
# each stage working on one while the other stage works on the other. The
# last stage sends each new token back to the first, for the next step.
# Every send is an `isend`, so no rank waits for its own send to be
# received and the two directions cannot block each other on gloo (under
# nccl a stage would post each send with its next receive in one
# `batch_isend_irecv`, as Chapter 7's stages do).

# %%
def pipelined_decode(rank, world, n_micro, steps, batch=2, prompt_len=16, dim=768):
    """Decode n_micro micro-batches of requests through `world` stages."""
    dev = rank_device(rank)
    torch.manual_seed(0)  # every rank builds the same model, keeps its stage
    model = GPT(dim=dim, n_heads=8, n_layers=4).to(dev).eval()
    per = len(model.layers) // world
    stage = model.layers[rank * per:(rank + 1) * per]
    first, last = rank == 0, rank == world - 1
    torch.manual_seed(3)
    tokens = [torch.randint(0, 64, (batch, prompt_len)).to(dev) for _ in range(n_micro)]
    caches = [[{} for _ in stage] for _ in range(n_micro)]
    out, arrived, sends = [[] for _ in range(n_micro)], [], []
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for step in range(steps):
            s = prompt_len if step == 0 else 1  # the prefill, then one token
            for m in range(n_micro):
                if first:
                    if step > 0 and world > 1:  # the token the last stage chose
                        tokens[m] = torch.empty(batch, 1, dtype=torch.long, device=dev)
                        dist.recv(tokens[m], src=world - 1)
                    x = model.embed(tokens[m])
                else:
                    x = torch.empty(batch, s, dim, device=dev)
                    dist.recv(x, src=rank - 1)
                for layer, cache in zip(stage, caches[m], strict=True):
                    x = layer(x, cache)
                if not last:
                    sends.append(dist.isend(x, dst=rank + 1))
                    continue
                nxt = model.head(model.norm(x))[:, -1].argmax(-1, keepdim=True)
                out[m].append(nxt.cpu())  # .cpu() waits for a GPU
                if m == 0:
                    arrived.append(time.perf_counter())
                if world == 1:
                    tokens[m] = nxt
                elif step < steps - 1:
                    sends.append(dist.isend(nxt, dst=0))
    for handle in sends:
        handle.wait()
    gaps = sorted(b - a for a, b in itertools.pairwise(arrived))
    return {"span_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
            "all_cpu_s": time.process_time(),
            "tokens": [torch.cat(t, 1) for t in out] if last else None,
            "gap_s": gaps[len(gaps) // 2] if last else None}


steps, pipe_runs = 32, {}


def pipeline(world, n_micro):
    def run():
        out = [r.value for r in launch(pipelined_decode, world, args=(n_micro, steps),
                                       backend="gloo", timeout=120, echo=False)]
        pipe_runs.setdefault(world, []).append(out)
        made = 2 * n_micro * steps  # tokens generated, all micro-batches
        return {"wall_s": max(v["span_s"] for v in out) / made,
                "cpu_s": sum(v["cpu_s"] for v in out) / made,
                "all_cpu_s": sum(v["all_cpu_s"] for v in out)}
    return run


layouts = {"1 process, 1 micro-batch": (1, 1), "2 stages, 2 micro-batches": (2, 2)}
piped = compare({k: pipeline(*v) for k, v in layouts.items()}, repeats=3, warmup=0)
print("time per generated token, all micro-batches (1 / throughput):")
print(piped)
print("time between two tokens of the same micro-batch (its latency):")
print(piped.on({k: [run[-1]["gap_s"] for run in pipe_runs[w]]
                for k, (w, _) in layouts.items()}))
torch.manual_seed(0)
whole = GPT(dim=768, n_heads=8, n_layers=4).eval()
torch.manual_seed(3)
alone = [generate(whole, torch.randint(0, 64, (2, 16)), steps)[0] for _ in range(2)]
print("every micro-batch's tokens equal to one process's:",
      all(torch.equal(got, want) for runs in pipe_runs.values() for run in runs
          for got, want in zip(run[-1]["tokens"], alone, strict=False)))


# %% [markdown]
# With a micro-batch per stage, both stages work at once: on a quiet
# machine the tokens per second rise (the first verdict), by less than 2x,
# as the two ranks spend more CPU seconds per token than one process (on
# their sends and receives, and sharing this machine's caches). A
# micro-batch's own time between tokens does not fall (the second): each
# of its tokens still passes through all 4 layers, one stage after the
# other, crosses the boundary twice, and waits while a stage finishes the
# other micro-batch. With a single micro-batch the stages would only take
# turns. Pipelines serve a model too large for one node, or many requests
# at once; they do not make any one request faster.
#
# **Prefill/decode disaggregation.** A long prefill in the same batch as
# decode steps stalls every sequence's next token. Disaggregated serving
# runs prefills on some GPUs and decodes on others, each with its own
# parallelism, and moves each request's KV cache from one to the other
# once, after its prefill. What that move costs, predicted, against the
# prefill it follows (Llama 3 70B, a 4,096-token prompt, 8 GPUs):

# %%
pre = serving.prefill_seconds(l70, "h100_sxm", 4096, tp=8)
print(f"prefill: {pre.value * 1e3:.0f} ms [{pre.label}]")
for link in ("nvlink_h100", "ndr_infiniband"):
    f = serving.kv_transfer_seconds(l70, 4096, link)
    print(f"KV cache over {link}: {f.value * 1e3:.1f} ms [{f.label}]")
f = reference.published("distserve_2024.more_requests_than_colocated")
print(f"{f.value}{f.unit}: {f.measures}\n    [{f.label}]")

# %% [markdown]
# The transfer is paid once per request and costs a fraction of the
# prefill; DistServe reports serving several times more requests within
# both latency targets than colocated serving. DeepSeek-V3 serves the same
# way: its prefill and decode units above are separate.

# %% [markdown]
# ## 6. Speculative decoding: parallelism over tokens
#
# A decode step of a large model costs about the same for 1 token as for
# 5: it is memory-bound. Speculative decoding spends that slack. A small
# *draft* model proposes `k` tokens one by one (cheap); the large *target*
# model then runs once on all `k`, which gives its own greedy choice at
# each of the `k` positions plus one more. The leading guesses that agree
# are accepted, and the target's choice at the first disagreement is
# taken too: each verify pass yields between 1 and `k + 1` tokens, always
# exactly the tokens plain greedy decoding of the target would make.
#
# The caches roll back: after verification each model keeps the tokens
# accepted and drops the rest (`truncate`).

# %%
def truncate(caches, length):
    for c in caches:
        c["k"], c["v"] = c["k"][:, :, :length], c["v"][:, :, :length]


@torch.no_grad()
def speculative(target, draft, prompt, steps, k=4):
    """Greedy tokens of `target` (batch 1), drafted by `draft` k at a time."""
    tc, dc = [{} for _ in target.layers], [{} for _ in draft.layers]
    target(prompt[:, :-1], tc)  # the caches hold every token but the last
    draft(prompt[:, :-1], dc)
    out, last, drafted, accepted = [], prompt[:, -1:], 0, 0
    while len(out) < steps:
        n_cached, x, guess = tc[0]["k"].shape[2], last, []
        for _ in range(k):
            x = draft(x, dc)[:, -1:].argmax(-1)
            guess.append(x)
        guess = torch.cat(guess, 1)
        want = target(torch.cat([last, guess], 1), tc).argmax(-1)  # k + 1 choices
        agree = int((guess == want[:, :k]).int().cumprod(1).sum())
        new = torch.cat([guess[:, :agree], want[:, agree:agree + 1]], 1)
        drafted, accepted = drafted + k, accepted + agree
        truncate(tc, n_cached + agree + 1)
        if agree == k:  # the draft never saw its own last guess
            draft(guess[:, -1:], dc)
        truncate(dc, n_cached + agree + 1)
        out += new[0].tolist()
        last = new[:, -1:]
    return torch.tensor(out[:steps]), accepted / drafted


# %% [markdown]
# A target and a draft that agree often enough to show the effect: the
# target has 6 blocks whose last 5 write small updates into the residual
# stream; the draft is the target's embedding, first block and head, with
# its other blocks dropped (a *self-speculative* draft, as in LayerSkip).
# Real drafts are trained or distilled models; what matters is the
# acceptance rate, measured here.

# %%
torch.manual_seed(0)
target = GPT(dim=256, n_heads=8, n_layers=6).to(device).eval()
with torch.no_grad():
    for block in target.layers[1:]:
        block.attn.wo.weight.mul_(0.05)
        block.mlp[2].weight.mul_(0.05)
draft = GPT(dim=256, n_heads=8, n_layers=1).to(device).eval()
draft.load_state_dict(target.state_dict(), strict=False)
prompt = torch.randint(0, 64, (1, 8), device=device)
steps = 48
plain = generate(target, prompt, steps)[0][0].cpu()
spec, acceptance = speculative(target, draft, prompt, steps)
print(f"speculative tokens equal to greedy decoding: {torch.equal(plain, spec.cpu())}; "
      f"{acceptance:.0%} of drafted tokens accepted")
result = compare({"greedy": lambda: generate(target, prompt, steps)[0].tolist(),
                  "speculative, k = 4": lambda: speculative(target, draft, prompt,
                                                             steps)}, repeats=3)
print(result)

# %% [markdown]
# The verdict above is this machine's, under the course's comparison
# protocol. The speed-up depends on two numbers: the acceptance rate, and
# how little a verify pass of `k + 1` tokens costs over one token. A GPU
# decoding a large model at small batch is memory-bound, so `k + 1` tokens
# cost about one; whether a small model's pass costs about the same for 1
# and 5 tokens on this machine, the verdict above shows. At a large batch the
# slack is gone (the step is already compute-bound) and speculation helps
# less.

# %% [markdown]
# ## Summary
#
# - Generation is a compute-bound prefill followed by memory-bound decode
#   steps; a decode step reads every weight and the whole KV cache, so its
#   tokens per second grow almost with the batch until the FLOPs catch up.
# - The KV cache decides the batch: `2 x kv_heads x head_dim x layers`
#   numbers per token (one latent per layer for MLA); grouped-query and
#   latent attention cut it; paged blocks let sequences grow without
#   reserving their longest context.
# - Tensor-parallel decode is the Megatron split of training: each rank
#   its heads and its cache, two all-reduces per layer per token, equal to
#   one process; their latency keeps it inside a node.
# - Replicas and pipelines raise throughput, not a token's latency;
#   serving a mixture of experts runs attention data-parallel and sends
#   each token to its expert's GPU twice per layer and step;
#   disaggregation moves each request's KV cache once, after its prefill.
# - Speculative decoding checks several drafted tokens in one pass of the
#   target, and makes exactly the target's greedy tokens.

# %% [markdown]
# ## Exercises
#
# ### Exercise 14.1: a KV cache that grows in place
#
# Serving engines allocate the cache once, at its longest length, and
# write each new token's keys and values into it (gpt-fast's and Hugging
# Face's static cache). Write `cached_attention(attn, x, cache)` for a
# grouped-query attention `attn` (`attn.wq`, `attn.wk`, `attn.wv`,
# `attn.wo`, `attn.n_heads`, `attn.n_kv_heads`, `attn.head_dim`; each
# K/V head serves `n_heads // n_kv_heads` query heads, repeated with
# `repeat_interleave`). `x` holds `s` new tokens, `(batch, s, dim)`;
# `cache` is made like `new_cache` below: `cache["k"]` and `cache["v"]` of
# shape `(batch, n_kv_heads, max_len, head_dim)`, and `cache["len"]`, the
# tokens already in it. Project only the new tokens, write their keys and
# values at positions `len .. len + s - 1` of the same tensors, advance
# `len`, and return the attention output of the new tokens `(batch, s,
# dim)`: each new token attends causally to every token so far. The
# checker compares with recomputation over whole sequences, in chunks of
# several lengths, float32, float64 and bfloat16.

# %%
def new_cache(attn, batch, max_len, dtype=torch.float32):
    shape = (batch, attn.n_kv_heads, max_len, attn.head_dim)
    return {"k": torch.zeros(shape, dtype=dtype), "v": torch.zeros(shape, dtype=dtype),
            "len": 0}


# %% tags=["exercise"] exercise="14.1"
def cached_attention(attn, x, cache):
    ### BEGIN SOLUTION
    b, s, _ = x.shape
    q = attn.wq(x).view(b, s, attn.n_heads, attn.head_dim).transpose(1, 2)
    k, v = (w(x).view(b, s, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
            for w in (attn.wk, attn.wv))
    start, end = cache["len"], cache["len"] + s
    cache["k"][:, :, start:end] = k
    cache["v"][:, :, start:end] = v
    cache["len"] = end
    group = attn.n_heads // attn.n_kv_heads
    keys = cache["k"][:, :, :end].repeat_interleave(group, dim=1)
    values = cache["v"][:, :, :end].repeat_interleave(group, dim=1)
    mask = torch.ones(s, end, dtype=torch.bool, device=x.device).tril(start)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))
    ### END SOLUTION


# %% tags=["check"] exercise="14.1"
check_cached_attention(cached_attention)

# %% [markdown]
# ### Exercise 14.2: tensor-parallel decode by hand
#
# Serving engines fuse the query, key and value projections into one
# matrix. Write `tp_generate(model, prompt, steps)`, run on every rank of
# a group of `dist.get_world_size()` ranks, each with the same `model`: a
# `FusedGPT` (imported above), the chapter's GPT whose attention has one
# `attn.qkv` of `3 x dim` rows, all query heads' rows, then all key
# heads', then all value heads' (`attn.n_heads` heads of `attn.head_dim`),
# and `attn.wo`; its `model.generate(prompt, steps)` is the one-process
# reference. Split it as Megatron does, by hand with `dist.all_reduce`:
# each rank its `n_heads // world_size` heads (their rows of q, k and v in
# `qkv`, their columns of `wo`), its rows of `mlp[0]` (and bias), its
# columns of `mlp[2]`, a KV cache of its own heads; embedding, norms and
# head stay whole. Return what `generate` returns: the greedy tokens
# `(batch, steps)` and the logits that chose them. The checker runs 2 and
# 4 ranks, float32 and float64 (under `torch.no_grad()`), counts the
# all-reduces (and any other collective: there should be none) and each
# rank's FLOPs.

# %%
torch.manual_seed(0)
fused = FusedGPT()
print(f"{fused.layers[0].attn.qkv}: rows of q, k, v, each {fused.layers[0].attn.n_heads}"
      f" heads of {fused.layers[0].attn.head_dim}; one process's greedy tokens "
      f"{fused.generate(torch.randint(0, 64, (1, 3)), 4)[0].tolist()}")

# %% tags=["exercise"] exercise="14.2"
def tp_generate(model, prompt, steps):
    ### BEGIN SOLUTION
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = []
    for block in model.layers:
        q, k, v = block.attn.qkv.weight.chunk(3)
        shards.append({
            "qkv": torch.cat([w.chunk(world)[rank] for w in (q, k, v)]),
            "wo": block.attn.wo.weight.chunk(world, dim=1)[rank],
            "up": block.mlp[0].weight.chunk(world)[rank],
            "up_bias": block.mlp[0].bias.chunk(world)[rank],
            "down": block.mlp[2].weight.chunk(world, dim=1)[rank]})

    def forward(tokens, caches):
        h = model.embed(tokens)
        for block, w, cache in zip(model.layers, shards, caches, strict=True):
            b, s, _ = h.shape
            qkv = F.linear(block.norm1(h), w["qkv"]).view(b, s, 3, -1,
                                                          block.attn.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            if cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            mask = torch.ones(s, k.shape[2], dtype=torch.bool).tril(k.shape[2] - s)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            part = F.linear(out.transpose(1, 2).reshape(b, s, -1), w["wo"])
            dist.all_reduce(part)
            h = h + part
            up = block.mlp[1](F.linear(block.norm2(h), w["up"], w["up_bias"]))
            part = F.linear(up, w["down"])
            dist.all_reduce(part)
            h = h + part + block.mlp[2].bias
        return model.head(model.norm(h))

    caches = [{} for _ in model.layers]
    logits = forward(prompt, caches)[:, -1]
    tokens, chosen = [], []
    for i in range(steps):
        tokens.append(logits.argmax(-1, keepdim=True))
        chosen.append(logits)
        if i < steps - 1:
            logits = forward(tokens[-1], caches)[:, -1]
    return torch.cat(tokens, 1), torch.stack(chosen, 1)
    ### END SOLUTION


# %% tags=["check"] exercise="14.2"
check_tp_generate(tp_generate)

# %% [markdown]
# ### Exercise 14.3: how many sequences, how many tokens per second
#
# Write `serving_plan(model, gpu, context, tp, dtype_bytes)` for a
# `planner.Decoder` served on `tp` GPUs of kind `gpu`, weights and cache in
# a dtype of `dtype_bytes` bytes, every sequence holding `context` tokens.
# Return `(batch, tokens_per_s)`: the largest batch whose KV cache fits on
# each GPU beside its share of the weights, and the decode tokens per
# second of that batch. Per GPU: the serving engine's share
# (`serving.memory_share()`) of its memory (`reference.published(f"{gpu}.
# memory_gb")`, binary: x `2**30` bytes), less `1 / tp` of the weights
# (`model.params()` parameters); a sequence's cache there counts its K/V
# heads split over the `tp` GPUs (at least one head each: a model with
# fewer K/V heads than GPUs copies them). Count the bytes yourself, not
# with `serving.max_batch`; the step time of a batch is
# `serving.decode_seconds(model, gpu, batch, context, tp=tp).value`. The
# checker draws its own contexts, and its messages never show the answer.

# %% tags=["exercise"] exercise="14.3"
def serving_plan(model, gpu, context, tp, dtype_bytes):
    ### BEGIN SOLUTION
    memory = reference.published(f"{gpu}.memory_gb").value * 2**30
    free = memory * serving.memory_share() - model.params() * dtype_bytes / tp
    heads = max(1, model.kv_heads // tp)
    per_sequence = context * model.layers * 2 * heads * model.head_dim * dtype_bytes
    batch = max(0, math.floor(free / per_sequence))
    if batch == 0:
        return 0, 0.0
    return batch, batch / serving.decode_seconds(model, gpu, batch, context,
                                                 tp=tp).value
    ### END SOLUTION


# %% tags=["check"] exercise="14.3"
check_serving_plan(serving_plan)

# %% [markdown]
# ## Glossary
#
# | English | 中文 |
# | --- | --- |
# | inference / serving | 推理 / 推理服务 |
# | prefill | 预填充 |
# | decode (step) | 解码（步） |
# | KV cache | KV 缓存 |
# | memory-bound / compute-bound | 访存受限 / 计算受限 |
# | grouped-query attention | 分组查询注意力 |
# | multi-latent attention | 多头潜在注意力 |
# | paged attention, block table | 分页注意力，块表 |
# | tensor parallelism | 张量并行 |
# | speculative decoding, draft model | 投机解码，草稿模型 |
# | acceptance rate | 接受率 |
# | expert parallelism, all-to-all | 专家并行，全对全 |
# | prefill/decode disaggregation | 预填充/解码分离 |
# | throughput / latency | 吞吐量 / 延迟 |

# %%
tidy_up()  # the last cell: the chapter's temporary folder goes
