"""A layout planner for large training runs: memory per GPU and step time. Chapter 13.

Given a decoder model, a sequence length, a global batch and a cluster, it
lists the layouts ``dp x tp x pp`` that the cluster allows and predicts, for
each, the bytes one GPU holds at the step's peak and the time of one training
step. Every prediction is labelled: the memory model is arithmetic checked
against the fake-tensor FSDP2 run of ``course_utils.memory``; the time model
feeds the calibrated models of ``course_utils.predict`` (achieved FLOP/s,
tensor-parallel collectives, the pipeline's bubble, the collectives' latency)
with published bandwidths.

- ``Decoder``: a Llama-style model's shapes; ``LLAMA2_7B``, ``LLAMA3_8B``,
  ``LLAMA3_70B``, ``LLAMA3_405B``.
- ``Layout``: ``dp``, ``tp``, ``pp``, the micro-batches, whether the data-
  parallel dimension shards the training state (FSDP / ZeRO-3).
- ``memory_per_gpu(model, layout, seq, ...)``: bytes by category.
- ``step_seconds(model, layout, gpu, seq, global_batch)``: a predicted Figure.
- ``plan(model, gpu, n_gpus, seq, global_batch)``: every allowed layout, best
  first, each flagged when it does not fit.

One model function is new here: ``network_allreduce_seconds``, a ring
all-reduce across nodes (each GPU's own InfiniBand port), since
``predict.allreduce_seconds`` covers links inside a node only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from course_utils import predict, reference

GPUS = ("h100_sxm", "h100_pcie", "l4", "t4")  # the GPUs with a published memory size
# the link between the GPUs of one node (NVLink on SXM boards, else PCIe)
NODE_LINK = {"h100_sxm": "nvlink_h100", "h100_pcie": "pcie5_x16", "l4": "pcie4_x16",
             "t4": "pcie3_x16"}
MATH = {"h100_sxm": "bf16", "h100_pcie": "bf16", "l4": "bf16", "t4": "fp16"}
NETWORK_KEY = "ndr_infiniband.bandwidth_per_direction_gbps"
# (weights, gradients, optimizer state) bytes per parameter; activation bytes
PRECISIONS = {"bf16 + fp32 master + Adam": ((2, 2, 12), 2),
              "fp32 + Adam": ((4, 4, 8), 4)}


@functools.cache
def _value(key: str) -> float:
    """A published value, looked up once (the planner asks thousands of times)."""
    return reference.published(key).value


@functools.cache
def _peak_key(gpu: str) -> str:
    return predict.peak_key(gpu, MATH[gpu])


@functools.cache
def _achieved_flops(gpu: str) -> float:
    return predict.achieved_flops(gpu, MATH[gpu])


@dataclass(frozen=True)
class Decoder:
    """A Llama-style decoder: RMSNorm, attention (grouped K/V heads), SwiGLU MLP."""

    name: str
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    def layer_params(self) -> int:
        kv = self.dim * self.kv_heads // self.heads
        return (2 * self.dim * self.dim + 2 * self.dim * kv  # q, o; k, v
                + 3 * self.dim * self.ffn + 2 * self.dim)  # gate, up, down; norms

    def params(self) -> int:
        """Parameters: the layers, the embedding, the final norm, the output layer."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.dim + self.dim

    def act_per_token_layer(self) -> int:
        """Elements one layer keeps for backward per token (no attention scores).

        Counted for the ``memory.Block`` Llama layer as autograd saves it: about
        ``10 dim + 4 ffn`` (norm inputs and outputs, q/k/v, the attention
        output, the MLP's gate, up, SiLU and product). Attention scores are
        never kept (memory-efficient SDPA); the fake-tensor run checks it.
        """
        return 10 * self.dim + 4 * self.ffn


# Llama 2 7B as course_utils.memory builds it (its fake-tensor run checks the model)
LLAMA2_7B = Decoder("Llama-2-7B shapes", 32, 4096, 11008, 32, 32, 32000)
# Llama 3: shapes from "The Llama 3 Herd of Models", Table 3 (arXiv:2407.21783)
LLAMA3_8B = Decoder("Llama 3 8B", 32, 4096, 14336, 32, 8, 128000)
LLAMA3_70B = Decoder("Llama 3 70B", 80, 8192, 28672, 64, 8, 128000)
LLAMA3_405B = Decoder("Llama 3 405B", 126, 16384, 53248, 128, 8, 128000)
MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B)}


@dataclass(frozen=True)
class Layout:
    """``dp x tp x pp`` GPUs; ``micro_batch`` sequences per micro-batch;
    ``sharded``: the data-parallel dimension shards weights, gradients and
    optimizer state (FSDP / ZeRO-3), else it replicates them (DDP);
    ``recompute``: every layer's activations are recomputed in the backward
    (full activation checkpointing), keeping only each layer's input."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    sharded: bool = True
    recompute: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return (f"dp {self.dp}{' (FSDP)' if self.sharded and self.dp > 1 else ''} x "
                f"tp {self.tp} x pp {self.pp}"
                + (", recompute" if self.recompute else ""))


def microbatches(layout: Layout, global_batch: int) -> int:
    """Micro-batches each pipeline replica runs per step."""
    return global_batch // (layout.dp * layout.micro_batch)


def memory_per_gpu(model: Decoder, layout: Layout, seq: int, global_batch: int,
                   precision: str = "bf16 + fp32 master + Adam") -> dict[str, float]:
    """Bytes one GPU holds at a training step's peak, by category.

    - training state: the parameters of ``layers / pp`` layers, split ``tp``
      ways (the embedding and output layer on the end stages, counted on every
      stage: the busiest one sets the need), then ``dp`` ways when sharded;
    - gathered layers: FSDP keeps about two layers unsharded (the one computing
      and the one prefetched);
    - activations: ``act_per_token_layer`` per token and layer, split ``tp``
      ways (sequence parallelism), for the micro-batches in flight on the
      first stage: all of them under GPipe, at most ``pp`` under 1F1B (this
      model assumes 1F1B); plus the logits kept for the loss.

    Left out: temporaries, communication buffers, the allocator's slack.
    """
    (w, g, o), act_bytes = PRECISIONS[precision]
    stage_layers = model.layers / layout.pp
    ends = 2 * model.vocab * model.dim
    params = (stage_layers * model.layer_params() + ends) / layout.tp
    shard = layout.dp if layout.sharded else 1
    out = {"parameters": params * w / shard, "gradients": params * g / shard,
           "optimizer state": params * o / shard}
    if layout.sharded and layout.dp > 1:
        out["gathered layers"] = 2 * model.layer_params() / layout.tp * w
    m = microbatches(layout, global_batch)
    in_flight = min(m, layout.pp) if layout.pp > 1 else 1
    tokens = layout.micro_batch * seq
    per_layer = model.act_per_token_layer() / layout.tp * act_bytes
    kept = model.dim / layout.tp * act_bytes if layout.recompute else per_layer
    out["activations"] = in_flight * tokens * stage_layers * kept
    if layout.recompute:  # the one layer being recomputed
        out["activations"] += tokens * per_layer
    out["logits"] = tokens * model.vocab / layout.tp * act_bytes
    out["total"] = sum(out.values())
    return out


def network_allreduce_seconds(nbytes: float, n: int) -> reference.Figure:
    """A ring all-reduce over ``n`` GPUs in different nodes (new in Chapter 13).

    ``collective_latency() + 2 (n - 1) / n x bytes / port bandwidth``: every
    GPU sends through its own 400 Gb/s InfiniBand port (the DGX H100 pairs one
    with each GPU), at line rate: no protocol overhead subtracted, so it is a
    lower bound. Latency as ``predict.allreduce_seconds``.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    bw = _value(NETWORK_KEY) * 1e9
    t = 0.0 if n == 1 else (predict.collective_latency()
                            + 2 * (n - 1) / n * nbytes / bw)
    return reference.predicted(
        t, "s", f"{n} GPUs across nodes",
        f"ring all-reduce: latency {predict.collective_latency() * 1e6:.0f} us + "
        f"2(n-1)/n x bytes / {bw / 1e9:.0f} GB/s (one port per GPU, line rate), "
        f"n={n}, {nbytes:.3g} bytes",
        [NETWORK_KEY, *predict.COLLECTIVE_LATENCY_INPUTS],
        caveat=predict.NETWORK_CAVEAT)


def step_parts(model: Decoder, layout: Layout, gpu: str, seq: int, global_batch: int,
               gpus_per_node: int = 8) -> dict[str, float]:
    """Seconds of one step by part: compute with the bubble, TP, DP, PP traffic."""
    tokens = global_batch * seq
    # 6 N per token for the matmuls, 12 L s d for attention (Narayanan et al. 2021)
    flops = tokens * (6 * model.params() + 12 * model.layers * seq * model.dim)
    if layout.recompute:  # one more forward: 8 N instead of 6 N
        flops *= 8 / 6
    compute = flops / layout.gpus / _achieved_flops(gpu)
    m = microbatches(layout, global_batch)
    compute = predict.pipeline_seconds(compute, layout.pp, m) * layout.pp if (
        layout.pp > 1) else compute
    parts = {"compute": compute, "tensor parallel": 0.0, "data parallel": 0.0,
             "pipeline sends": 0.0}
    mb_tokens = layout.micro_batch * seq
    if layout.tp > 1:
        link = NODE_LINK[gpu] if layout.tp <= gpus_per_node else "ndr_infiniband"
        per_layer = predict.tp_layer_comm_seconds(mb_tokens, model.dim, layout.tp, link)
        parts["tensor parallel"] = per_layer.value * model.layers / layout.pp * m
    if layout.dp > 1:
        grad_bytes = 2 * model.params() / (layout.tp * layout.pp)
        inside = layout.dp * layout.tp <= gpus_per_node
        ar = (predict.allreduce_seconds(grad_bytes, layout.dp, NODE_LINK[gpu])
              if inside and NODE_LINK[gpu] in predict.LINKS
              else network_allreduce_seconds(grad_bytes, layout.dp)).value
        # FSDP: all-gather forward and backward, reduce-scatter: 1.5 all-reduces
        parts["data parallel"] = ar * (1.5 if layout.sharded else 1.0)
    if layout.pp > 1:
        act = 2 * mb_tokens * model.dim / layout.tp
        bw = _value(NETWORK_KEY) * 1e9
        parts["pipeline sends"] = 2 * m * (predict.collective_latency() + act / bw)
    return parts


def step_seconds(model: Decoder, layout: Layout, gpu: str, seq: int,
                 global_batch: int, gpus_per_node: int = 8) -> reference.Figure:
    """Predicted time of one training step of ``layout`` on ``gpu``s.

    Compute at the achieved FLOP/s (``predict.achieved_flops``) with the
    pipeline's bubble (``predict.pipeline_seconds``); tensor-parallel
    collectives (``predict.tp_layer_comm_seconds``) over NVLink or PCIe inside
    a node, InfiniBand beyond; the data-parallel gradient all-reduce
    (``predict.allreduce_seconds`` inside a node, ``network_allreduce_seconds``
    across); the pipeline's sends. Nothing overlapped: an upper bound on the
    communication's cost, and the compute is an achieved-peak lower bound.
    """
    parts = step_parts(model, layout, gpu, seq, global_batch, gpus_per_node)
    words = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in parts.items() if v)
    return reference.predicted(
        sum(parts.values()), "s", f"{layout.gpus} x {predict.gpu_name(gpu)}",
        f"{model.name}, {layout}, {global_batch} x {seq} tokens: {words}; "
        "compute at achieved FLOP/s with the pipeline bubble, collectives "
        "not overlapped",
        [_peak_key(gpu), *predict.MATMUL_EFFICIENCY_INPUTS,
         NETWORK_KEY], caveat=step_caveat(layout, gpu, gpus_per_node))


def step_caveat(layout: Layout, gpu: str, gpus_per_node: int = 8) -> str:
    """The terms of ``step_seconds`` that no calibration pair checks (Chapter 13).

    Checked: compute at one large matmul's rate, a 2-stage bubble and an
    all-reduce inside a node. Not: collectives at line rate (tensor parallel),
    anything across nodes, bubbles of more stages.
    """
    terms = []
    if layout.tp > 1:
        terms.append("tensor-parallel collectives (line rate, no latency)")
    across = (layout.dp * layout.tp > gpus_per_node
              or NODE_LINK[gpu] not in predict.LINKS)
    if layout.dp > 1 and across:
        terms.append("the data-parallel all-reduce across nodes (line rate)")
    if layout.pp > 1:
        terms.append("pipeline sends across nodes")
    if layout.pp > 2:
        terms.append(f"the bubble of {layout.pp} stages (checked for 2)")
    if not terms:
        return ""
    return ("not calibrated: " + ", ".join(terms) + "; each optimistic (line "
            "rates, equal stages), while overlapping nothing is pessimistic")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: Decoder, n_gpus: int, global_batch: int, gpus_per_node: int = 8,
            sharded: bool = True) -> list[Layout]:
    """Every layout allowed: tp inside a node and dividing the heads, pp
    dividing the layers, dp dividing the global batch."""
    out = []
    for tp in divisors(n_gpus):
        if tp > gpus_per_node or model.heads % tp:
            continue
        for pp in divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if model.layers % pp or global_batch % dp:
                continue
            out.append(Layout(dp, tp, pp, 1, sharded))
    return out


@dataclass
class Row:
    layout: Layout
    memory: dict
    step: reference.Figure
    fits: bool
    tokens_per_s: float


def plan(model: Decoder, gpu: str, n_gpus: int, seq: int, global_batch: int,
         gpus_per_node: int = 8, precision: str = "bf16 + fp32 master + Adam",
         headroom: float = 0.9) -> list[Row]:
    """Every allowed layout with its predictions: those that fit, fastest first.

    A layout fits when its predicted memory is at most ``headroom`` of the
    GPU's published memory (the rest for what the model leaves out); one
    that does not fit is tried again with ``recompute``.
    """
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {GPUS}, not {gpu!r}")
    capacity = _value(f"{gpu}.memory_gb") * 1e9 * headroom
    rows = []
    for lay in layouts(model, n_gpus, global_batch, gpus_per_node):
        mem = memory_per_gpu(model, lay, seq, global_batch, precision)
        if mem["total"] > capacity:  # fit the model first: recompute if it helps
            lay = Layout(lay.dp, lay.tp, lay.pp, lay.micro_batch, lay.sharded, True)
            mem = memory_per_gpu(model, lay, seq, global_batch, precision)
        t = step_seconds(model, lay, gpu, seq, global_batch, gpus_per_node)
        rows.append(Row(lay, mem, t, mem["total"] <= capacity,
                        global_batch * seq / t.value))
    return sorted(rows, key=lambda r: (not r.fits, r.step.value))
