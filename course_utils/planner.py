"""A layout planner for large training runs: memory per GPU and step time. Chapter 13.

Given a model (dense or mixture of experts), a sequence length, a global
batch and a cluster, it lists the layouts ``dp x cp x tp x pp`` (with expert
parallelism ``ep`` inside ``dp x cp``) that the cluster allows and predicts,
for each, the bytes one GPU holds at the step's peak and the time of one
training step. It is the course's one step model for large runs: every
term is a function of ``course_utils.predict`` or a count stated here, and the
two factors no datasheet gives are fitted on published whole training runs
and checked on others (``run_pairs``, printed by ``python -m
course_utils.predict --calibration``):

- matmuls at the rate one large matmul reaches (``predict.matmul_efficiency``,
  measured), attention at a fused kernel's (``predict.attention_efficiency``,
  measured), Adam's update and everything elementwise at the achieved memory
  bandwidth, and collectives over NVLink and every network port of a node;
- one **fitted factor**, the activation traffic (``fitted_activation_traffic``):
  how many bytes per token and hidden unit a layer's elementwise work (norms,
  activations, residuals, casts, dropout) moves per pass, in 16-bit units.
  It stands for everything a step does besides its matmuls, attention and
  collectives, so a whole step reaches 38-56% of the peak, not a matmul's 80%.

Public names: ``Decoder`` and the models (``LLAMA2_7B``, ``LLAMA3_8B``,
``LLAMA3_70B``, ``LLAMA3_405B``, ``MIXTRAL_8X7B``, ``DEEPSEEK_V3``),
``Layout``, ``memory_per_gpu``, ``step_parts``, ``step_seconds``,
``layouts``, ``variants``, ``plan``, ``stage_layers``, ``whole_step_efficiency``,
``runs``, ``run_pairs``, ``out_of_scope``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from course_utils import predict, reference

GPUS = ("h100_sxm", "h100_pcie", "a100_sxm_80gb", "l4", "t4")
# the link between the GPUs of one node (NVLink on SXM boards, else PCIe)
NODE_LINK = {"h100_sxm": "nvlink_h100", "h100_pcie": "pcie5_x16",
             "a100_sxm_80gb": "nvlink_a100", "l4": "pcie4_x16", "t4": "pcie3_x16"}
# each GPU's network port on the clusters these GPUs are sold in
NODE_NIC = {"h100_sxm": "ndr_infiniband", "h100_pcie": "ndr_infiniband",
            "a100_sxm_80gb": "hdr_infiniband", "l4": "ndr_infiniband",
            "t4": "ndr_infiniband"}
MATH = {"h100_sxm": "bf16", "h100_pcie": "bf16", "a100_sxm_80gb": "bf16",
        "l4": "bf16", "t4": "fp16"}
NETWORK_KEY = "ndr_infiniband.bandwidth_per_direction_gbps"
# (weights, gradients, optimizer state) bytes per parameter; activation bytes
PRECISIONS = {"bf16 + fp32 master + Adam": ((2, 2, 12), 2),
              "fp32 + Adam": ((4, 4, 8), 4)}
RECOMPUTE = ("none", "attention", "selective", "full")
ATTENTION_KERNELS = ("sdpa", "hopper")
CP_METHODS = ("all-gather", "ring", "ulysses")
# bytes per logit at the loss: the bf16 logits, the fp32 log-probabilities
# kept for the backward (their fp32 input is freed), and their fp32 gradient
LOGIT_BYTES = 2 + 4 + 4
# without sequence parallelism, the share of a layer's activation traffic that
# every tensor-parallel rank does whole (norms, dropouts, residuals): 10 of
# the 34 bytes per token and hidden unit of Korthikanti et al. 2022, eq. 2
REPLICATED_SHARE = 10 / 34
# bytes an Adam step moves per parameter it updates: it reads the fp32
# parameter, gradient and two moments and writes the parameter and moments
ADAM_BYTES = 7 * 4
# bytes per attention score and pass without a fused kernel: the scores written
# (2), read and written by softmax (4), by dropout with its mask (5), read by
# the product with V (2)
SCORE_BYTES = 13


@functools.cache
def _value(key: str) -> float:
    """A published value, looked up once (the planner asks thousands of times)."""
    return reference.published(key).value


@functools.cache
def _peak(gpu: str) -> float:
    return predict.peak_flops(gpu, MATH[gpu])


@functools.cache
def _capacity(gpu: str) -> float:
    """Bytes of a GPU's memory: HBM sizes are binary, so 80 GB is 80 GiB."""
    return _value(f"{gpu}.memory_gb") * 2**30


@dataclass(frozen=True)
class Decoder:
    """A Llama-style decoder: RMSNorm, attention (grouped K/V heads), SwiGLU MLP.

    A mixture of experts replaces the MLP of all but its first
    ``dense_layers`` layers by ``experts`` routed experts (``top_k`` per
    token) of width ``expert_ffn``, plus ``shared_experts`` that every token
    uses. ``attn_params`` overrides the attention's count (multi-latent
    attention has low-rank projections).
    """

    name: str
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    attn_params: int = 0
    mlp_matrices: int = 3  # SwiGLU: gate, up, down; GPT's GELU MLP: 2

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    def attention_params(self) -> int:
        if self.attn_params:
            return self.attn_params
        kv = self.kv_heads * self.head_dim
        return 2 * self.dim * self.dim + 2 * self.dim * kv  # q, o; k, v

    def expert_params(self) -> int:
        """One expert's SwiGLU weights."""
        return 3 * self.dim * self.expert_ffn

    def layer_params(self) -> int:
        """A dense layer's parameters (norms, attention, MLP)."""
        return (self.attention_params() + self.mlp_matrices * self.dim * self.ffn
                + 2 * self.dim)

    def routed_params(self) -> int:
        """All routed experts of the model (what expert parallelism splits)."""
        return self.moe_layers * self.experts * self.expert_params()

    def params(self) -> int:
        """Parameters: the layers, the embedding, the final norm, the output layer."""
        dense = (self.layers - self.moe_layers) * self.layer_params()
        moe_layer = (self.attention_params() + 2 * self.dim
                     + self.shared_experts * self.expert_params()
                     + self.dim * self.experts)  # the router
        return (dense + self.moe_layers * moe_layer + self.routed_params()
                + 2 * self.vocab * self.dim + self.dim)

    def active_params(self) -> int:
        """Parameters one token's forward pass multiplies (its experts only)."""
        return self.params() - self.moe_layers * (
            self.experts - self.top_k) * self.expert_params()

    def matmul_flops_per_token(self) -> float:
        """Forward matmul FLOPs per token: 2 per active weight, embedding excluded."""
        return 2 * (self.active_params() - self.vocab * self.dim)

    def attention_flops_per_token(self, seq: int) -> float:
        """Forward attention FLOPs per token (QK^T and PV), causal: half the keys."""
        return self.layers * 2 * 2 * self.heads * self.head_dim * seq / 2

    def act_per_token_layer(self) -> int:
        """Elements one layer keeps for backward per token (no attention scores).

        Counted for the ``memory.Block`` Llama layer as autograd saves it: about
        ``10 dim + 4 ffn`` (norm inputs and outputs, q/k/v, the attention
        output, the MLP's gate, up, SiLU and product). Attention scores are
        never kept (memory-efficient SDPA); the fake-tensor run checks it. A
        mixture-of-experts layer keeps its MLP's four per routed copy of the
        token (``top_k`` plus the shared experts) and the router's scores.
        """
        if not self.moe:
            return 10 * self.dim + 2 * (self.mlp_matrices - 1) * self.ffn
        return (10 * self.dim + self.experts
                + 4 * (self.top_k + self.shared_experts) * self.expert_ffn)


# Llama 2 7B as course_utils.memory builds it (its fake-tensor run checks the model)
LLAMA2_7B = Decoder("Llama-2-7B shapes", 32, 4096, 11008, 32, 32, 32000)
# Llama 3: shapes from "The Llama 3 Herd of Models", Table 3 (arXiv:2407.21783)
LLAMA3_8B = Decoder("Llama 3 8B", 32, 4096, 14336, 32, 8, 128256)
LLAMA3_70B = Decoder("Llama 3 70B", 80, 8192, 28672, 64, 8, 128256)
LLAMA3_405B = Decoder("Llama 3 405B", 126, 16384, 53248, 128, 8, 128256)
# Mixtral 8x7B: "Mixtral of Experts", Table 1 (arXiv:2401.04088)
MIXTRAL_8X7B = Decoder("Mixtral 8x7B", 32, 4096, 14336, 32, 8, 32000,
                       experts=8, top_k=2, expert_ffn=14336)
# DeepSeek-V3: "DeepSeek-V3 Technical Report", section 4.2 (arXiv:2412.19437):
# 61 layers of width 7168, 128 heads; multi-latent attention with query rank
# 1536, key-value rank 512, head dims 128 (+64 rotary); the first 3 layers
# dense, then 1 shared and 256 routed experts of width 2048, 8 per token.
# Its dense layers' width (18432) is from the model's published config.
_MLA = (7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64)
        + 512 * 128 * (128 + 128) + 128 * 128 * 7168)
DEEPSEEK_V3 = Decoder("DeepSeek-V3", 61, 7168, 18432, 128, 128, 129280,
                      experts=256, top_k=8, expert_ffn=2048, shared_experts=1,
                      dense_layers=3, attn_params=_MLA)
MODELS = {m.name: m for m in (LLAMA2_7B, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B,
                              MIXTRAL_8X7B, DEEPSEEK_V3)}


@dataclass(frozen=True)
class Layout:
    """``dp x cp x tp x pp`` GPUs, and how each dimension works.

    - ``micro_batch``: sequences per micro-batch;
    - ``sharded``: the data-parallel (and context-parallel) ranks shard
      weights, gradients and optimizer state (FSDP / ZeRO-3), else they
      replicate them (DDP); ``shard_group`` > 1 shards inside groups of that
      many ranks and replicates across them (HSDP);
    - ``recompute``: "none", "attention" (the attention core only, as
      Korthikanti et al. 2022's selective recomputation: free with a fused
      kernel, which never stores the scores), "selective" (every other layer
      recomputed, as torchtitan's per-layer option ``2``), "full" (every layer
      keeps only its input); ``True`` / ``False`` mean "full" / "none";
    - ``schedule`` and ``virtual``: the pipeline schedule
      (``predict.SCHEDULES``) and stages per GPU when interleaved;
    - ``stages``: layers of each pipeline stage, when not as even as
      possible (``stage_layers``);
    - ``cp_method``: how context parallelism exchanges keys and values;
    - ``ep``: expert-parallel degree (experts split over ``ep`` of the
      ``dp x cp`` ranks);
    - ``fused_attention``: a FlashAttention-class kernel (never stores the
      scores); ``False`` for runs before them (2021-2022), whose attention
      writes and reads its ``heads x seq`` scores per token;
    - ``sequence_parallel``: the norms, dropouts and residuals between the
      tensor-parallel blocks are split over ``tp`` too (Chapter 10); without
      it every tensor-parallel rank does them whole;
    - ``attention_kernel``: "sdpa", PyTorch's fused attention on an H100
      (FlashAttention-2), or "hopper", a kernel written for Hopper
      (FlashAttention-3, cuDNN) as production stacks use.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    sharded: bool = True
    recompute: str | bool = "none"
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    cp_method: str = "all-gather"
    shard_group: int = 0
    stages: tuple[int, ...] = field(default=())
    fused_attention: bool = True
    sequence_parallel: bool = True
    attention_kernel: str = "sdpa"

    def __post_init__(self) -> None:
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute",
                               "full" if self.recompute else "none")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp_method must be one of {CP_METHODS}")
        if self.schedule not in predict.SCHEDULES:
            raise ValueError(f"schedule must be one of {predict.SCHEDULES}")
        if min(self.dp, self.tp, self.pp, self.cp, self.ep, self.virtual,
               self.micro_batch) < 1:
            raise ValueError("every degree must be at least 1")
        if self.stages and len(self.stages) != self.pp:
            raise ValueError(f"stages lists {len(self.stages)} stages, pp is {self.pp}")

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard(self) -> int:
        """Ranks the training state is sharded over (1 when replicated)."""
        if not self.sharded:
            return 1
        return self.shard_group or self.dp * self.cp

    def __str__(self) -> str:
        dp = f"dp {self.dp}"
        if self.sharded and self.dp * self.cp > 1:
            dp += f" (HSDP {self.shard_group})" if self.shard_group else " (FSDP)"
        elif self.dp > 1:
            dp += " (DDP)"
        parts = [dp]
        if self.cp > 1:
            parts.append(f"cp {self.cp} ({self.cp_method})")
        parts += [f"tp {self.tp}", f"pp {self.pp}"]
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        text = " x ".join(parts)
        if self.pp > 1 and self.schedule != "1f1b":
            text += f", {self.schedule}" + (f" v{self.virtual}" if self.virtual > 1
                                            else "")
        if self.stages and len(set(self.stages)) > 1:
            text += f", stages {min(self.stages)}-{max(self.stages)} layers"
        if self.recompute != "none":
            text += f", {self.recompute} recompute"
        return text


def stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage, as even as possible, the end stages lightest.

    The first stage also holds the embedding and the last the output layer
    and the loss, so when the layers do not divide, those two get fewer (as
    Llama 3 405B's 126 layers on 16 stages: 7 on each end, 8 between).
    """
    if pp < 1 or pp > layers:
        raise ValueError(f"pp must be between 1 and {layers}, not {pp}")
    base, extra = divmod(layers, pp)
    stages = [base] * pp
    # the extra layers go to the middle stages first, ends last
    order = sorted(range(pp), key=lambda i: (i in (0, pp - 1), abs(i - (pp - 1) / 2)))
    for i in order[:extra]:
        stages[i] += 1
    return tuple(stages)


def _stages(model: Decoder, layout: Layout) -> tuple[int, ...]:
    return layout.stages or stage_layers(model.layers, layout.pp)


def microbatches(layout: Layout, global_batch: int) -> int:
    """Micro-batches each pipeline replica runs per step."""
    return max(1, global_batch // (layout.dp * layout.micro_batch))


def _in_flight(layout: Layout, m: int, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    p = layout.pp
    if p == 1:
        return 1
    if layout.schedule == "gpipe":
        return m
    held = min(m, p - stage)
    if layout.schedule == "interleaved" and layout.virtual > 1:
        held *= 1 + (p - 1) / (p * layout.virtual)  # Narayanan et al. 2021, 2.2.2
    return held


def _layer_state(model: Decoder, layout: Layout, layers: float) -> tuple[float, float]:
    """(parameters, of which routed experts) one GPU holds for ``layers`` layers."""
    share = layers / model.layers
    routed = model.routed_params() * share / layout.ep
    dense = (model.params() - model.routed_params()
             - 2 * model.vocab * model.dim) * share
    return dense / layout.tp + routed / layout.tp, routed / layout.tp


def memory_per_gpu(model: Decoder, layout: Layout, seq: int, global_batch: int,
                   precision: str = "bf16 + fp32 master + Adam") -> dict[str, float]:
    """Bytes one GPU holds at a training step's peak, by category.

    The busiest pipeline stage sets the need (the first holds the most
    micro-batches' activations, the last the logits). Per stage:

    - training state: its layers' parameters split ``tp`` ways (routed
      experts also ``ep`` ways), the embedding on the first and the output
      layer on the last, then sharded ``shard`` ways (FSDP / HSDP);
    - gathered layers: FSDP keeps two layers unsharded (the one computing and
      the one prefetched); with a pipeline, a stage's whole weights stay
      gathered across its micro-batches (torchtitan does not reshard after
      the forward when pipelining), in 16 bits;
    - accumulated gradients: with a pipeline, PyTorch's schedules turn FSDP's
      gradient reduction off until the last micro-batch
      (``PipelineStage.backward_maybe_with_nosync``), so a stage's whole
      gradients accumulate unsharded, in fp32 (the reduction dtype);
    - activations: ``act_per_token_layer`` per token and layer, split
      ``tp`` ways (sequence parallelism) and ``cp`` ways, for the
      micro-batches in flight (1F1B: at most ``pp``; interleaving adds
      ``(pp - 1) / (pp v)``); recomputation keeps each recomputed layer's
      input only, plus the one layer being recomputed;
    - logits and loss: 16-bit logits, their fp32 copy and its gradient, on
      the last stage, split ``tp`` ways (loss parallel);
    - communication buffers: one layer's gathered bf16 weights and fp32
      gradient for FSDP's all-gather and reduce-scatter.

    Left out: the allocator's reserve and fragmentation, the CUDA context,
    the pipeline schedules' per-micro-batch buffers. Checked against
    torchtitan's published peaks (``run_pairs``).
    """
    (w, g, o), act_bytes = PRECISIONS[precision]
    stages = _stages(model, layout)
    m = microbatches(layout, global_batch)
    tokens = layout.micro_batch * seq / layout.cp
    per_layer = model.act_per_token_layer() * tokens / layout.tp * act_bytes
    saved = {"none": per_layer, "attention": per_layer,
             "selective": (per_layer + model.dim * tokens / layout.tp * act_bytes) / 2,
             "full": model.dim * tokens / layout.tp * act_bytes}[layout.recompute]
    best: dict[str, float] | None = None
    for i in {0, len(stages) - 1}:
        params, _ = _layer_state(model, layout, stages[i])
        ends = model.vocab * model.dim * ((i == 0) + (i == len(stages) - 1)) / layout.tp
        params += ends
        out = {"parameters": params * w / layout.shard,
               "gradients": params * g / layout.shard,
               "optimizer state": params * o / layout.shard}
        layer = (model.layer_params() if not model.moe else
                 model.attention_params() + (model.top_k + model.shared_experts)
                 * model.expert_params()) / layout.tp
        out["gathered layers"] = out["accumulated gradients"] = 0.0
        out["communication buffers"] = 0.0
        if layout.shard > 1:
            out["gathered layers"] = (params * 2 if layout.pp > 1
                                      else 2 * layer * 2)
            out["accumulated gradients"] = params * 4 if layout.pp > 1 else 0.0
            out["communication buffers"] = layer * (2 + 4)
        acts = _in_flight(layout, m, i) * stages[i] * saved
        if layout.recompute != "none":
            acts += per_layer
        out["activations"] = acts
        out["logits and loss"] = (tokens * model.vocab / layout.tp * LOGIT_BYTES
                                  if i == len(stages) - 1 else 0.0)
        out["total"] = sum(out.values())
        if best is None or out["total"] > best["total"]:
            best = out
    assert best is not None
    return best


def network_allreduce_seconds(nbytes: float, n: int, local: int = 1,
                              nic: str = "ndr_infiniband") -> reference.Figure:
    """An all-reduce over ``n`` GPUs in different nodes, ``local`` per node.

    ``predict.collective_seconds``: NCCL drives one port per GPU of the
    group in each node at the rate its maintainer gives, so the bus
    bandwidth is ``local`` ports' worth (capped by NVLink inside the node).
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    t = predict.collective_seconds("all_reduce", nbytes, n, local, "nvlink_h100", nic)
    rate = predict.group_busbw(n, local, "nvlink_h100", nic)
    return reference.predicted(
        t, "s", f"{n} GPUs across nodes, {local} per node",
        f"NCCL all-reduce: latency {predict.collective_latency() * 1e6:.0f} us + "
        f"2(n-1)/n x bytes / {rate / 1e9:.0f} GB/s ({local} port"
        f"{'s' if local > 1 else ''} per node at {predict.nic_bandwidth(nic) / 1e9:.0f}"
        f" GB/s), n={n}, {nbytes:.3g} bytes",
        [predict.NICS[nic], *predict.NIC_EFFICIENCY_INPUTS,
         *predict.COLLECTIVE_LATENCY_INPUTS],
        caveat=run_caveat("network"))


def _group(size: int, inner: int, gpus_per_node: int) -> tuple[int, int]:
    """(size, members per node) of a group whose ranks are ``inner`` apart.

    Ranks are laid out tp fastest, then cp, then dp, then pp (torchtitan's
    and Megatron's order), so a group of stride ``inner`` has
    ``gpus_per_node // inner`` members in a node (at least 1).
    """
    return size, max(1, min(size, gpus_per_node // inner))


def step_parts(model: Decoder, layout: Layout, gpu: str, seq: int, global_batch: int,
               gpus_per_node: int = 8, traffic: float | None = None
               ) -> dict[str, float]:
    """Seconds of one step by part (the sum is the step).

    - **compute**: the slowest stage's matmuls at the whole-step efficiency
      and its attention at the fused kernel's (``predict.attention_efficiency``),
      per micro-batch, times the micro-batches plus the schedule's bubble
      (``predict.bubble_slots``); recomputation adds a forward pass;
    - **tensor parallel**: 4 collectives of the micro-batch's activation per
      layer (6 with recomputation), on the critical path;
    - **context parallel**: all-gather of K and V and reduce-scatter of
      their gradients (all-gather), or the ring's exchanges beyond what the
      attention hides (ring), or 4 all-to-alls (Ulysses), per layer;
    - **expert parallel**: dispatch and combine all-to-alls, forward and
      backward, per mixture-of-experts layer, on the critical path;
    - **data parallel**: FSDP's all-gathers and reduce-scatters (or DDP's
      all-reduce), hidden behind the compute except one layer's worth and
      whatever exceeds the compute;
    - **pipeline sends**: one activation per micro-batch each way.
    """
    k = fitted_activation_traffic() if traffic is None else traffic
    peak = _peak(gpu)
    mm_rate = peak * predict.matmul_efficiency()
    attn_rate = peak * predict.attention_efficiency(layout.attention_kernel)
    bw = predict.achieved_memory_bandwidth(gpu)
    link, nic = NODE_LINK[gpu], NODE_NIC[gpu]
    stages = _stages(model, layout)
    m = microbatches(layout, global_batch)
    mb_tokens = layout.micro_batch * seq  # one micro-batch of one replica
    # per micro-batch, per GPU of the slowest stage: forward, backward (twice
    # the forward) and any recomputed forward
    passes = 3 + {"none": 0, "attention": 0, "selective": 0.5,
                  "full": 1}[layout.recompute]
    attn_passes = passes + (layout.recompute == "attention")
    layer_mm = (model.matmul_flops_per_token() - 2 * model.vocab * model.dim) / \
        model.layers
    layer_attn = model.attention_flops_per_token(seq) / model.layers
    layer_bytes = k * model.dim * 2  # elementwise traffic per token and pass
    out_mm = 2 * model.vocab * model.dim
    split = layout.tp * layout.cp
    tokens = mb_tokens / split
    stage_t = []
    for i, n_layers in enumerate(stages):
        last = i == len(stages) - 1
        t_mm = passes * (n_layers * layer_mm + last * out_mm) * tokens / mm_rate
        if layout.fused_attention:
            t_attn = attn_passes * n_layers * layer_attn * tokens / attn_rate
            score_bytes = 0.0
        else:  # batched matmuls, and the scores through softmax and dropout
            t_attn = attn_passes * n_layers * 2 * layer_attn * tokens / mm_rate
            score_bytes = SCORE_BYTES * model.heads * seq / layout.tp * layout.cp
        whole = 1 if layout.sequence_parallel else (
            1 + REPLICATED_SHARE * (layout.tp - 1))
        t_mem = (n_layers * (passes * layer_bytes * whole + attn_passes * score_bytes)
                 + last * model.vocab * LOGIT_BYTES) * tokens / bw
        stage_t.append((t_mm + t_attn + t_mem, t_attn, n_layers))
    t_stage, t_attn_stage, n_layers = max(stage_t)
    slots = predict.bubble_slots(layout.pp, layout.schedule, layout.virtual)
    owned, _ = _layer_state(model, layout, max(stages))
    owned += model.vocab * model.dim / layout.tp
    parts = {"compute": t_stage * (m + slots),
             "optimizer": owned / layout.shard * ADAM_BYTES / bw,
             "tensor parallel": 0.0,
             "context parallel": 0.0, "expert parallel": 0.0, "data parallel": 0.0,
             "pipeline sends": 0.0}
    act = 2 * mb_tokens / layout.cp * model.dim  # one micro-batch's activation, bf16
    max_layers = max(stages)
    if layout.tp > 1:
        n, local = _group(layout.tp, 1, gpus_per_node)
        # 2 forward, 2 backward; sequence parallelism saves only its shard of
        # each column-parallel layer's input and all-gathers it again in the
        # backward (Korthikanti et al. 2022, section 4.2.2); recomputing a
        # layer repeats its forward's 2
        count = (4 + (1 if layout.sequence_parallel else 0)
                 + (2 if layout.recompute == "full" else 0))
        one = predict.collective_seconds("all_reduce", act, n, local, link, nic)
        parts["tensor parallel"] = count * one * max_layers * (m + slots)
    if layout.cp > 1:
        n, local = _group(layout.cp, layout.tp, gpus_per_node)
        kv = 2 * 2 * mb_tokens / layout.cp * model.kv_heads * model.head_dim / \
            min(layout.tp, model.kv_heads)
        if layout.cp_method == "all-gather":
            per_layer = (predict.collective_seconds("all_gather", kv * layout.cp, n,
                                                    local, link, nic)
                         + predict.collective_seconds("reduce_scatter", kv * layout.cp,
                                                      n, local, link, nic))
        elif layout.cp_method == "ring":
            send = (n - 1) * (predict.collective_latency() + kv / predict.group_busbw(
                2, min(2, local), link, nic))
            per_layer = 3 * max(0.0, send - t_attn_stage / max_layers / 3)
        else:  # Ulysses: q and the output whole, k and v only their K/V heads
            # (copied up to the cp degree when there are fewer), forward and
            # backward
            kv_share = max(model.kv_heads, layout.cp) / model.heads
            per_layer = 2 * (2 + 2 * kv_share) * predict.collective_seconds(
                "all_to_all", act / layout.tp, n, local, link, nic)
        parts["context parallel"] = per_layer * max_layers * (m + slots)
    if model.moe and layout.ep > 1:
        n, local = _group(layout.ep, layout.tp, gpus_per_node)
        routed = act / layout.tp * model.top_k
        per_layer = 4 * predict.collective_seconds("all_to_all", routed, n, local,
                                                   link, nic)
        moe_share = model.moe_layers / model.layers
        parts["expert parallel"] = per_layer * max_layers * moe_share * (m + slots)
    dp = layout.dp * layout.cp
    if dp > 1:
        params, _ = _layer_state(model, layout, max_layers)
        params += model.vocab * model.dim / layout.tp
        nbytes = 2 * params  # bf16 weights and gradients
        shard = layout.shard
        n, local = _group(dp, layout.tp, gpus_per_node)
        if shard > 1:
            sn, slocal = _group(shard, layout.tp, gpus_per_node)
            gathers = 2 * m if layout.pp == 1 else 1  # pipelines keep them
            t = (gathers * predict.collective_seconds("all_gather", nbytes, sn,
                                                      slocal, link, nic)
                 + (m if layout.pp == 1 else 1) * predict.collective_seconds(
                     "reduce_scatter", nbytes, sn, slocal, link, nic))
            if shard < dp:  # HSDP: all-reduce the shards across the groups
                rn, rlocal = _group(dp // shard, layout.tp * shard, gpus_per_node)
                t += predict.collective_seconds("all_reduce", nbytes / shard, rn,
                                                rlocal, link, nic)
        else:
            t = predict.collective_seconds("all_reduce", nbytes, n, local, link, nic)
        exposed_layer = t / max(1, max_layers)
        parts["data parallel"] = exposed_layer + max(0.0, t - parts["compute"])
    if layout.pp > 1:
        n, local = _group(2, layout.tp * layout.cp * layout.dp, gpus_per_node)
        one = predict.collective_latency() + act / layout.tp / predict.group_busbw(
            2, local, link, nic)
        parts["pipeline sends"] = 2 * (m + slots) * one
    return parts


def step_seconds(model: Decoder, layout: Layout, gpu: str, seq: int,
                 global_batch: int, gpus_per_node: int = 8) -> reference.Figure:
    """Predicted time of one step of ``layout`` on ``gpu``s (``step_parts``)."""
    parts = step_parts(model, layout, gpu, seq, global_batch, gpus_per_node)
    words = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in parts.items() if v)
    return reference.predicted(
        sum(parts.values()), "s", f"{layout.gpus} x {predict.gpu_name(gpu)}",
        f"{model.name}, {layout}, {global_batch} x {seq} tokens: {words}; matmuls "
        f"at {predict.matmul_efficiency():.0%} of peak, attention at "
        f"{predict.attention_efficiency(layout.attention_kernel):.0%}, "
        f"elementwise traffic {fitted_activation_traffic():.0f} x 2 bytes per token "
        "and hidden unit (fitted on published runs) at the achieved bandwidth, "
        "the schedule's bubble, collectives over NVLink and every port of a node",
        [predict.peak_key(gpu, MATH[gpu]), *predict.MATMUL_EFFICIENCY_INPUTS,
         *predict.ATTENTION_EFFICIENCY_INPUTS, *predict.MEMORY_EFFICIENCY_INPUTS,
         "activation traffic fitted: python -m course_utils.predict --calibration"],
        caveat=step_caveat(layout, gpu))


def step_caveat(layout: Layout, gpu: str) -> str:
    """What of ``step_seconds`` the calibration does not check for this layout."""
    terms = []
    if layout.cp > 1 and layout.cp_method != "all-gather":
        terms.append(f"{layout.cp_method} context parallelism (no published run)")
    if layout.ep > 1:
        terms.append("expert all-to-alls (no published run with its layout)")
    if layout.pp > 1 and layout.schedule == "zero-bubble":
        terms.append("the zero-bubble schedule")
    if gpu not in ("h100_sxm", "a100_sxm_80gb"):
        terms.append(f"whole steps on {gpu} (fitted on H100 and A100 runs)")
    if not terms:
        return ""
    return "not calibrated: " + "; ".join(terms)


def run_caveat(kind: str) -> str:
    """One-line caveats of the planner's terms that no pair checks."""
    if kind == "network":
        return ("checked against published multi-node all-reduce bandwidths; "
                "latency across nodes is the one-node figure")
    return ""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: Decoder, n_gpus: int, global_batch: int, gpus_per_node: int = 8,
            sharded: bool = True, seq: int = 0) -> list[Layout]:
    """Every layout allowed, each with 1F1B and no recomputation.

    tp inside a node and dividing the heads and K/V heads; cp (only when
    ``seq`` is given) dividing half the sequence (its load balancing splits it
    in ``2 cp`` chunks); pp any depth up to half the layers (uneven
    stages when they do not divide, ends lightest); dp dividing the global
    batch; ep dividing the experts and ``dp x cp``.
    """
    out = []
    for tp in divisors(n_gpus):
        if tp > gpus_per_node or model.heads % tp or model.kv_heads % tp:
            continue
        rest = n_gpus // tp
        for cp in divisors(rest):
            if cp > 1 and (not seq or (seq // 2) % cp):
                continue
            for pp in divisors(rest // cp):
                dp = rest // (cp * pp)
                if pp > max(1, model.layers // 2) or global_batch % dp:
                    continue
                eps = [e for e in divisors(dp * cp)
                       if model.moe and model.experts % e == 0] or [1]
                for ep in eps:
                    out.append(Layout(dp, tp, pp, 1, sharded, "none", cp, ep))
    return out


def variants(model: Decoder, lay: Layout) -> list[Layout]:
    """The schedules and recomputation a layout can use, cheapest memory last."""
    out = []
    schedules = [("1f1b", 1)]
    if lay.pp > 1:
        per_stage = model.layers // lay.pp
        schedules += [("interleaved", v) for v in (2, 4) if per_stage >= v]
        schedules.append(("zero-bubble", 1))
    for sched, v in schedules:
        for rc in RECOMPUTE:
            out.append(replace(lay, schedule=sched, virtual=v, recompute=rc))
    return out


@dataclass
class Row:
    layout: Layout
    memory: dict
    step: reference.Figure
    fits: bool
    tokens_per_s: float
    tight: bool = False


def plan(model: Decoder, gpu: str, n_gpus: int, seq: int, global_batch: int,
         gpus_per_node: int = 8, precision: str = "bf16 + fp32 master + Adam"
         ) -> list[Row]:
    """Every allowed layout, in the variant (schedule, recomputation) that is
    fastest among those that fit: fitting layouts first, fastest first.

    A layout fits when its predicted memory is at most the GPU's memory; it
    is ``tight`` when it would not fit were the memory model as short as the
    worst of its published checks (``memory_shortfall``); one that never fits
    is listed last with its smallest variant.
    """
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {GPUS}, not {gpu!r}")
    capacity = _capacity(gpu)
    rows = []
    for lay in layouts(model, n_gpus, global_batch, gpus_per_node, seq=seq):
        best = None
        smallest = None
        for cand in variants(model, lay):
            mem = memory_per_gpu(model, cand, seq, global_batch, precision)
            if smallest is None or mem["total"] < smallest[1]["total"]:
                smallest = (cand, mem)
            if mem["total"] > capacity:
                continue
            t = sum(step_parts(model, cand, gpu, seq, global_batch,
                               gpus_per_node).values())
            if best is None or t < best[2]:
                best = (cand, mem, t)
        if best is None:
            assert smallest is not None
            cand, mem = smallest
            t = sum(step_parts(model, cand, gpu, seq, global_batch,
                               gpus_per_node).values())
            best = (cand, mem, t)
        cand, mem, t = best
        rows.append((cand, mem, t, mem["total"] <= capacity))
    rows.sort(key=lambda r: (not r[3], r[2]))
    short = memory_shortfall()
    return [Row(c, mem, step_seconds(model, c, gpu, seq, global_batch, gpus_per_node),
                fits, global_batch * seq / t, fits and mem["total"] / short > capacity)
            for c, mem, t, fits in rows]


def within_error(rows: list[Row], spread: float | None = None) -> list[Row]:
    """The fitting rows whose step time is within the calibration's spread of
    the best: layouts the planner cannot tell apart."""
    spread = run_spread() if spread is None else spread
    fit = [r for r in rows if r.fits]
    if not fit:
        return []
    best = fit[0].step.value
    return [r for r in fit if r.step.value <= best * spread]


# --- calibration on published whole training runs ------------------------------------
#
# Each run is a published layout and its measured throughput (and, where
# published, memory). The planner predicts it from the layout; the two
# fitted factors are fitted on the runs marked "fit" and checked on the
# others ("check"), which the fit never sees.


@dataclass(frozen=True)
class Run:
    """A published training run the planner is checked against.

    ``key`` is its published id (``reference_data/published/runs.json``),
    ``field`` the measured quantity compared (``tokens_per_s_per_gpu``,
    ``tflops_per_gpu``, ``tflops_per_gpu_hardware`` or ``iteration_time_s``);
    ``flops`` how the source counts a step's FLOPs for its TFLOP/s;
    ``memory`` whether it published memory per GPU (``memory_gib``).
    ``assumed`` says what the layout takes that the source does not state.
    """

    key: str
    field: str
    model: Decoder
    layout: Layout
    gpu: str
    seq: int
    global_batch: int
    role: str  # "fit" or "check"
    flops: str = "6N+attention"
    memory: bool = False
    assumed: str = ""
    gpus_per_node: int = 8
    throughput: bool = True

    def measured(self, field: str = "") -> float:
        entry = reference.published_entry(self.key)
        return float(entry["value"]["measured"][field or self.field])


UNITS = {"tokens_per_s_per_gpu": "tokens/s", "tflops_per_gpu": "TFLOP/s",
         "tflops_per_gpu_hardware": "TFLOP/s", "iteration_time_s": "s"}


def source_flops(run: Run) -> float:
    """FLOPs of one step as the run's source counts them."""
    m, tokens = run.model, run.global_batch * run.seq
    if run.flops == "megatron":  # Narayanan et al. 2021, eq. (3): recompute counted
        b, s, layers, h, v = run.global_batch, run.seq, m.layers, m.dim, m.vocab
        return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    # 6 N plus causal attention, the usual model-FLOPs convention
    return tokens * 3 * (m.matmul_flops_per_token() + m.attention_flops_per_token(
        run.seq))


def predicted_rate(run: Run, traffic: float | None = None) -> float:
    """The run's published quantity as the planner predicts it."""
    t = sum(step_parts(run.model, run.layout, run.gpu, run.seq, run.global_batch,
                       run.gpus_per_node, traffic).values())
    unit = UNITS[run.field]
    if unit == "TFLOP/s":
        return source_flops(run) / t / run.layout.gpus / 1e12
    if unit == "tokens/s":
        return run.global_batch * run.seq / t / run.layout.gpus
    return t


def _gpt(name: str, layers: int, dim: int, heads: int, vocab: int = 51200) -> Decoder:
    """A GPT-3-style model (GELU MLP of width 4 h, no grouped heads)."""
    return Decoder(name, layers, dim, 4 * dim, heads, heads, vocab, mlp_matrices=2)


def _runs() -> list[Run]:
    a100, h100 = "a100_sxm_80gb", "h100_sxm"
    out = []
    # Narayanan et al. 2021, Table 1 (A100, DDP, full recomputation, its eq. 3)
    for i, (key, (layers, dim, heads, tp, pp, v, mb, gb)) in enumerate({
            "gpt_1p7b_tp1_pp1_dp32_32xa100": (24, 2304, 24, 1, 1, 1, 16, 512),
            "gpt_3p6b_tp2_pp1_dp32_64xa100": (30, 3072, 32, 2, 1, 1, 16, 512),
            "gpt_7p5b_tp4_pp1_dp32_128xa100": (36, 4096, 32, 4, 1, 1, 16, 512),
            "gpt_18p4b_tp8_pp1_dp32_256xa100": (40, 6144, 48, 8, 1, 1, 8, 1024),
            "gpt_39p1b_tp8_pp2_dp32_512xa100": (48, 8192, 64, 8, 2, 1, 4, 1536),
            "gpt_76p1b_tp8_pp4_dp32_1024xa100": (60, 10240, 80, 8, 4, 3, 2, 1792),
            "gpt_145p6b_tp8_pp8_dp24_1536xa100": (80, 12288, 96, 8, 8, 2, 2, 2304),
            "gpt_310p1b_tp8_pp16_dp15_1920xa100": (96, 16384, 128, 8, 16, 2, 1, 2160),
            "gpt_529p6b_tp8_pp35_dp9_2520xa100": (105, 20480, 128, 8, 35, 3, 1, 2520),
            "gpt_1008p0b_tp8_pp64_dp6_3072xa100": (128, 25600, 160, 8, 64, 1, 1, 3072),
            }.items()):
        n = int(key.rsplit("_", 1)[1].split("x")[0])
        dp = n // (tp * pp)
        lay = Layout(dp, tp, pp, mb, sharded=False, recompute="full",
                     schedule="interleaved" if v > 1 else "1f1b", virtual=v,
                     fused_attention=False, sequence_parallel=False)
        out.append(Run(f"runs.narayanan2021_{key}", "tflops_per_gpu_hardware",
                       _gpt(f"GPT {key.split('_')[1]}", layers, dim, heads), lay, a100,
                       2048, gb, "check" if i % 2 else "fit", flops="megatron"))
    # Korthikanti et al. 2022, Table 5 (A100): selective recomputation there
    # recomputes the attention core, with sequence parallelism; full without
    for key, (layers, dim, heads, pp, v, gb, rc) in {
            "gpt_22b_tp8_pp1_sp_selective_8xa100": (48, 6144, 64, 1, 1, 4, "attention"),
            "gpt_22b_tp8_pp1_fullrecompute_8xa100": (48, 6144, 64, 1, 1, 4, "full"),
            "gpt_175b_tp8_pp8_sp_selective_64xa100": (96, 12288, 96, 8, 3, 64,
                                                      "attention"),
            "gpt_175b_tp8_pp8_fullrecompute_64xa100": (96, 12288, 96, 8, 3, 64, "full"),
            "gpt_530b_tp8_pp35_sp_selective_280xa100": (105, 20480, 128, 35, 3, 280,
                                                        "attention"),
            "gpt_530b_tp8_pp35_fullrecompute_280xa100": (105, 20480, 128, 35, 3, 280,
                                                         "full"),
            "gpt_1t_tp8_pp64_sp_selective_512xa100": (128, 25600, 160, 64, 1, 512,
                                                      "attention"),
            "gpt_1t_tp8_pp64_fullrecompute_512xa100": (128, 25600, 160, 64, 1, 512,
                                                       "full"),
            }.items():
        mb = gb if pp == 1 else 1
        lay = Layout(1, 8, pp, mb, sharded=False, recompute=rc,
                     schedule="interleaved" if v > 1 else "1f1b", virtual=v,
                     fused_attention=False, sequence_parallel=rc == "attention")
        out.append(Run(f"runs.korthikanti2022_{key}", "iteration_time_s",
                       _gpt(f"GPT {key.split('_')[1]}", layers, dim, heads), lay, a100,
                       2048, gb, "check"))
    # torchtitan's Llama 3 benchmarks (bf16, FSDP2): memory only, since they ran
    # on H100s of another variant (96 GB, capped at 500 W) with no published
    # peak, so their throughput is out of the model's scope
    tt = "runs.torchtitan_llama3_"
    out += [
        Run(tt + "8b_fsdp_8xh100", "tokens_per_s_per_gpu", LLAMA3_8B,
            Layout(8, micro_batch=2, recompute="selective"), h100, 8192, 16, "check",
            memory=True, throughput=False),
        Run(tt + "8b_fsdp_128xh100", "tokens_per_s_per_gpu", LLAMA3_8B,
            Layout(128, micro_batch=2, recompute="selective"), h100, 8192, 256,
            "check", memory=True, throughput=False),
        Run(tt + "70b_fsdp32_tp8_256xh100", "tokens_per_s_per_gpu", LLAMA3_70B,
            Layout(32, 8, micro_batch=16, recompute="full"), h100, 8192, 512,
            "check", memory=True, throughput=False),
        Run(tt + "405b_fsdp8_tp8_pp8_1f1b_512xh100", "tokens_per_s_per_gpu",
            LLAMA3_405B, Layout(8, 8, 8, recompute="full"), h100, 8192, 256, "check",
            memory=True, throughput=False,
            assumed="micro-batches of 1 sequence (torchtitan's default)"),
    ]
    # Megatron-LM's H100 table (GPT models, data parallel 48, sequences of 4096)
    for i, (key, (layers, dim, heads, tp, pp, gb)) in enumerate({
            "gpt_1p7b_tp1_pp1_dp48_48xh100": (24, 2048, 16, 1, 1, 192),
            "gpt_7p1b_tp2_pp1_dp48_96xh100": (30, 4096, 32, 2, 1, 192),
            "gpt_16b_tp4_pp1_dp48_192xh100": (32, 6144, 48, 4, 1, 192),
            "gpt_32b_tp8_pp1_dp48_384xh100": (48, 7168, 56, 8, 1, 192),
            "gpt_70b_tp8_pp2_dp48_768xh100": (84, 8192, 64, 8, 2, 384),
            "gpt_177b_tp8_pp6_dp48_2304xh100": (96, 12288, 96, 8, 6, 1152),
            "gpt_462b_tp8_pp16_dp48_6144xh100": (112, 18432, 144, 8, 16, 3072),
            }.items()):
        lay = Layout(48, tp, pp, gb // 48 if pp == 1 else 1, sharded=False,
                     attention_kernel="hopper")
        out.append(Run(f"runs.megatron_h100_{key}", "tflops_per_gpu",
                       _gpt(f"GPT {key.split('_')[1]}", layers, dim, heads, 131072),
                       lay, h100, 4096, gb, "check" if i % 2 else "fit",
                       assumed="no recomputation, 1F1B with micro-batches of 1 "
                       "sequence when pipelined, Hopper attention kernels"))
    # Llama 3 405B pre-training (the Llama 3 paper, Table 4)
    for key, dp in (("tp8_cp1_pp16_dp64_seq8k_8192xh100", 64),
                    ("tp8_cp1_pp16_dp128_seq8k_16384xh100", 128)):
        out.append(Run(f"runs.llama3_405b_{key}", "tflops_per_gpu", LLAMA3_405B,
                       Layout(dp, 8, 16, schedule="interleaved", virtual=2,
                              attention_kernel="hopper"), h100, 8192, 2048, "check",
                       assumed="micro-batches of 1 sequence, 2 virtual stages per "
                       "GPU, Hopper attention kernels"))
    out.append(Run("runs.llama3_405b_tp8_cp16_pp16_dp8_seq128k_16384xh100",
                   "tflops_per_gpu", LLAMA3_405B,
                   Layout(8, 8, 16, cp=16, schedule="interleaved", virtual=2,
                          attention_kernel="hopper"), h100, 131072, 128, "check",
                   assumed="micro-batches of 1 sequence, 2 virtual stages per GPU, "
                   "Hopper attention kernels"))
    return out


RUNS = _runs()


def runs() -> list[Run]:
    """The published runs with their layouts."""
    return RUNS


def _fit(ratio_of, lo: float, hi: float) -> float:
    """The factor in [lo, hi] whose log-ratios over the fit runs average 0."""
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if ratio_of(mid) > 0:
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)


@functools.cache
def fitted_activation_traffic() -> float:
    """The whole-step efficiency fitted on the runs marked "fit".

    The value that makes the mean log-ratio of predicted to published
    throughput zero over those runs (a 1-D solve: throughput rises with it).
    """
    fit = [r for r in runs() if r.role == "fit" and r.throughput]

    def mean_log(k: float) -> float:  # falls as k grows: a slower step
        logs = [math.log(predicted_rate(r, k) / r.measured()) for r in fit]
        signs = [-1 if UNITS[r.field] == "s" else 1 for r in fit]
        return -sum(s * x for s, x in zip(signs, logs, strict=True)) / len(fit)

    return _fit(mean_log, 0.1, 1000.0)


def run_pairs() -> list[predict.Pair]:
    """Every published run beside the planner's prediction, fitted or held back."""
    pairs = []
    for r in runs():
        what = f"{r.model.name}, {r.layout.gpus} x {r.gpu}, {r.layout}, seq {r.seq}"
        if r.assumed:
            what += f" (assumed: {r.assumed})"
        if r.throughput:
            pairs.append(predict.Pair(
                f"[{r.role}] {what}", predicted_rate(r), r.measured(),
                UNITS[r.field], f"{r.key}: {r.field}",
                ("activation traffic fitted", *predict.ATTENTION_EFFICIENCY_INPUTS)))
        if r.memory and (r.key, "memory_gib") not in {
                (k, f) for k, f, _ in MEMORY_GAPS}:
            mem = memory_per_gpu(r.model, r.layout, r.seq, r.global_batch)
            pairs.append(predict.Pair(
                f"[{r.role}] memory per GPU, {what}", mem["total"] / 2**30,
                r.measured("memory_gib"), "GiB", f"{r.key}: memory_gib",
                ("memory model, nothing fitted",)))
    return pairs


@functools.cache
def run_spread() -> float:
    """The largest predicted/published throughput ratio spread of the check runs,
    as a factor: layouts closer than this are not told apart."""
    ratios = [p.ratio for p in run_pairs() if p.setup.startswith("[check]")
              and p.unit != "GiB"]
    if not ratios:
        return 1.25
    return max(max(ratios), 1 / min(ratios))


def whole_step_efficiency(model: Decoder, gpu: str = "h100_sxm", seq: int = 8192,
                          micro_batch: int = 1) -> float:
    """Model FLOPs per second of one GPU's training step over its peak (MFU).

    One GPU, one micro-batch, no communication: the fraction of the peak the
    step model gives a whole step of ``model`` (its matmuls, attention,
    elementwise work and Adam's update), which chapters use for a step's
    compute when they count ``6 N`` FLOPs per token (``predict.step_efficiency``).
    """
    layout = Layout(micro_batch=micro_batch)
    parts = step_parts(model, layout, gpu, seq, micro_batch)
    flops = micro_batch * seq * 3 * (model.matmul_flops_per_token()
                                     + model.attention_flops_per_token(seq))
    return flops / (parts["compute"] + parts["optimizer"]) / _peak(gpu)


def out_of_scope() -> list[predict.OutOfScope]:
    """Published runs the planner does not predict, or misses, and why."""
    items = []
    for r in runs():
        if not r.throughput:
            items.append(predict.OutOfScope(
                f"{r.model.name}, {r.layout.gpus} GPUs, {r.layout}: throughput",
                r.measured(), UNITS[r.field], f"{r.key}: {r.field}",
                "torchtitan ran on an H100 variant with 96 GB of HBM2e capped at "
                "500 W, with no published peak (its own benchmark says its MFU "
                "understates for that reason), so the step model, built on the "
                "H100 SXM's peak, does not predict it; its memory is a pair"))
    for key, quantity, reason in MEMORY_GAPS:
        run = next(r for r in runs() if r.key == key)
        counted = memory_per_gpu(run.model, run.layout, run.seq,
                                 run.global_batch)["total"] / 2**30
        items.append(predict.OutOfScope(
            f"{run.model.name}, {run.layout.gpus} GPUs, {run.layout}: memory per "
            "GPU", run.measured(quantity), "GiB", f"{key}: {quantity}",
            f"a gap of the memory model: it counts {counted:.0f} of the "
            f"{run.measured(quantity):.1f} GiB published; {reason}"))
    for key, quantity, reason in OTHER_RUNS:
        entry = reference.published_entry(key)
        items.append(predict.OutOfScope(
            f"{entry['value']['model']['name']}, {entry['value']['n_gpus']} GPUs",
            float(entry["value"]["measured"][quantity]), entry["unit"],
            f"{key}: {quantity}", reason))
    return items


MEMORY_GAPS = (
    ("runs.torchtitan_llama3_70b_fsdp32_tp8_256xh100", "memory_gib",
     "it cannot say where the rest goes (the backward's working set of a "
     "recomputed layer under sequence parallelism, the loss's buffers and the "
     "allocator's fragmentation are candidates it does not count)"),
    ("runs.torchtitan_llama3_405b_fsdp8_tp8_pp8_1f1b_512xh100", "memory_gib",
     "PyTorch's pipeline schedules keep each micro-batch's stage inputs and "
     "outputs, and the allocator fragments, which it does not count"),
)
OTHER_RUNS = (
    ("runs.deepseek_v3_pp16_ep64_zero1_2048xh800", "tokens_per_s_per_gpu_derived",
     "an average over the whole training's GPU-hours, not a step, in FP8 on "
     "H800s (NVLink cut to 400 GB/s), with DualPipe overlapping the expert "
     "all-to-alls: the planner has no FP8 rate, no H800 and no DualPipe"),
    ("runs.megatron_moe_mixtral_8x7b_tp1_ep8_pp4_vp8_64xh100", "tflops_per_gpu",
     "the source gives the layout but not the batch, the sequence length's "
     "use or which FLOPs it counts for a mixture of experts, so no prediction "
     "can be compared with it"),
)


@functools.cache
def memory_shortfall() -> float:
    """The smallest predicted / published memory of the checks and known gaps.

    Below 1: the memory model counted that much less than a published run
    held, so a layout within that factor of the GPU's memory may not fit.
    """
    ratios = [p.ratio for p in run_pairs() if p.unit == "GiB"]
    for key, quantity, _ in MEMORY_GAPS:
        run = next(r for r in runs() if r.key == key)
        mem = memory_per_gpu(run.model, run.layout, run.seq, run.global_batch)
        ratios.append(mem["total"] / 2**30 / run.measured(quantity))
    return min(ratios)


# --- display (Chapter 13's widget and comparison) ------------------------------------

MEMORY_COLORS = {"parameters": "tab:blue", "gradients": "tab:orange",
                 "optimizer state": "tab:green", "gathered layers": "tab:purple",
                 "accumulated gradients": "tab:brown",
                 "communication buffers": "tab:pink", "activations": "tab:red",
                 "logits and loss": "tab:olive"}


def draw_plan(rows: list[Row], gpu: str, title: str = "") -> None:
    """Memory per GPU by category for ``rows`` and the best one's mesh."""
    import matplotlib.pyplot as plt

    rows = rows[:6]
    fig, (ax, mesh) = plt.subplots(1, 2, figsize=(10, 4.2),
                                   gridspec_kw={"width_ratios": [3, 2]})
    for i, row in enumerate(rows):
        left = 0.0
        for name, color in MEMORY_COLORS.items():
            v = row.memory.get(name, 0.0) / 2**30
            ax.barh(i, v, left=left, color=color, label=name if i == 0 else None)
            left += v
    cap = _capacity(gpu) / 2**30
    ax.axvline(cap, color="k", lw=1)
    ax.text(cap, -0.6, f"{cap:.0f} GiB", fontsize=7, ha="right", va="bottom")
    ax.set_xlim(0, cap * 1.15)
    ax.set_yticks(range(len(rows)), [_short(r.layout) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("predicted memory per GPU (GiB)")
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4)
    ax.set_title(title or "memory per GPU, fastest first", fontsize=9)
    if rows:
        _draw_mesh(mesh, rows[0].layout)
    else:
        mesh.axis("off")
    fig.tight_layout()
    plt.show()


def _short(lay: Layout) -> str:
    parts = [f"dp{lay.dp}"] + [f"{k}{v}" for k, v in (("cp", lay.cp), ("tp", lay.tp),
                                                      ("pp", lay.pp), ("ep", lay.ep))
                               if v > 1]
    extra = {"none": "", "attention": "", "selective": " sel", "full": " full"}
    sched = {"1f1b": "", "gpipe": " gpipe", "interleaved": f" v{lay.virtual}",
             "zero-bubble": " zb"}[lay.schedule] if lay.pp > 1 else ""
    return " ".join(parts) + sched + extra[lay.recompute]


def _draw_mesh(ax, lay: Layout, gpus_per_node: int = 8) -> None:
    """One pipeline replica's GPUs: a row per stage, tp x cp across, in nodes."""
    import matplotlib.patches as patches

    width = lay.tp * lay.cp
    rows = min(lay.pp, 8)
    for s in range(rows):
        for j in range(width):
            gpu = s * width + j
            node = gpu // gpus_per_node
            ax.add_patch(patches.Rectangle((j, -s), 0.9, 0.9,
                                           color=f"C{node % 10}", alpha=0.6))
            if width <= 16:
                ax.text(j + 0.45, -s + 0.45, f"t{j % lay.tp}" + (
                    f"c{j // lay.tp}" if lay.cp > 1 else ""), fontsize=6,
                    ha="center", va="center")
    ax.set_xlim(-0.2, max(width, 1) + 0.2)
    ax.set_ylim(-rows + 0.8, 1.1)
    ax.set_yticks([-s + 0.45 for s in range(rows)],
                  [f"stage {s}" for s in range(rows)], fontsize=6)
    ax.set_xticks([])
    more = f", {lay.pp - rows} more stages" if lay.pp > rows else ""
    ax.set_title(f"the best layout, one of {lay.dp} replicas\n(colour: node{more})",
                 fontsize=8)


def draw_runs() -> None:
    """Predicted / published throughput of every run pair, by source (Chapter 13)."""
    import matplotlib.pyplot as plt

    pairs = [p for p in run_pairs() if p.unit != "GiB"]
    sources = {"narayanan2021": "Narayanan et al. 2021 (A100)",
               "korthikanti2022": "Korthikanti et al. 2022 (A100)",
               "megatron_h100": "Megatron-LM H100 table",
               "llama3_405b": "Llama 3 405B (H100)"}
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.axhspan(predict.BAND[0], predict.BAND[1], color="0.92", label="the band")
    ax.axhline(1, color="0.5", lw=0.8)
    x = 0
    for i, (prefix, name) in enumerate(sources.items()):
        mine = [p for p in pairs if p.measured.startswith(f"runs.{prefix}")]
        for p in mine:
            fit = p.setup.startswith("[fit]")
            speed = 1 / p.ratio if p.unit == "s" else p.ratio  # a time: inverted
            ax.plot(x, speed, "o" if fit else "s", color=f"C{i}",
                    mfc="none" if fit else None, ms=6)
            x += 1
        ax.plot([], [], "s", color=f"C{i}", label=name)
        x += 1
    ax.plot([], [], "o", color="k", mfc="none", label="fitted on")
    ax.plot([], [], "s", color="k", label="held back")
    ax.set_xticks([])
    ax.set_ylim(0.6, 1.4)
    ax.set_ylabel("predicted / published speed")
    ax.set_title("The step model against published training runs (throughput)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.05), ncol=3)
    fig.tight_layout()
    plt.show()
