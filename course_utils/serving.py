"""The step model for serving: prefill, decode and the KV cache (Chapter 14).

The same pieces as the training step model (``course_utils.predict``,
``course_utils.planner``), applied to generation, with ``planner.Decoder``
configurations:

- **decode** reads every weight of the GPU's share and the KV cache of every
  sequence in the batch once per token: ``max(bytes / achieved bandwidth,
  FLOPs / achieved FLOP/s)``; under tensor parallelism of degree ``t`` each
  layer adds two all-reduces of the batch's activations (Megatron's split,
  Chapter 10), each paying a per-collective latency fitted on published
  decode runs;
- **prefill** multiplies the whole prompt at once: its matmuls at a
  fraction of the peak fitted on a published prefill, its attention at the
  fused kernel's fraction (``predict.attention_efficiency``);
- **memory**: weights plus ``tokens x kv_bytes_per_token`` within the share
  of the GPU a serving engine uses (vLLM's default).

Serving stacks run a decode step as one CUDA graph (or a C++ runtime), so
no per-kernel launch cost is charged: PyTorch eager adds one per kernel
(``predict.launch_overhead``), which this model leaves out.

``serving_pairs()`` holds the model against published measurements (batch-1
decode with tensor parallelism, batch-1 prefill, whole static batches);
``python -m course_utils.predict --calibration`` prints them, fitted ones
marked ``[fit]`` and the held-back ones ``[check]``.
"""

from __future__ import annotations

import functools
import math

from course_utils import planner, predict, reference

# GPT-J 6B: the layer count, width and heads TensorRT-LLM's build command gives
# (n_layer 28, n_embd 4096, n_head 16); a GELU MLP of 4 x width; vocabulary 50400
GPTJ_6B = planner.Decoder("GPT-J 6B", 28, 4096, 16384, 16, 16, 50400,
                          mlp_matrices=2)
# Llama 2 70B: 80 layers of width 8192, 64 query and 8 key/value heads, SwiGLU
# of 28672 ("Llama 2", Touvron et al. 2023, arXiv:2307.09288, and its config)
LLAMA2_70B = planner.Decoder("Llama-2-70B", 80, 8192, 28672, 64, 8, 32000)
MODELS = {**planner.MODELS, GPTJ_6B.name: GPTJ_6B, LLAMA2_70B.name: LLAMA2_70B}

# multi-latent attention caches one compressed vector per token and layer: the
# key-value latent (rank 512) and the decoupled rotary key (64), DeepSeek-V3's
# report, section 2.1.1
KV_LATENT = {planner.DEEPSEEK_V3.name: 512 + 64}
MEMORY_SHARE = "vllm.gpu_memory_utilization_default"

GPT_FAST = tuple(f"gptfast.llama2_{m}_tp{t}_tokens_per_s"
                 for m, t in (("7b", 1), ("7b", 2), ("7b", 4), ("7b", 8),
                              ("70b", 2), ("70b", 4), ("70b", 8)))
# the decode latency is fitted on the 7B runs with tensor parallelism
DECODE_FIT = GPT_FAST[1:4]
PREFILL = {  # published id: model, tensor-parallel degree, prompt
    "trtllm.a100_fp16_gptj_6b_tp1_in2048_first_token_ms": (GPTJ_6B, 1, 2048),
    "trtllm.a100_fp16_llama_7b_tp1_in2048_first_token_ms": (planner.LLAMA2_7B, 1,
                                                            2048),
    "trtllm.a100_fp16_llama_70b_tp4_in2048_first_token_ms": (LLAMA2_70B, 4, 2048),
}
PREFILL_FIT = ("trtllm.a100_fp16_gptj_6b_tp1_in2048_first_token_ms",)
THROUGHPUT = {  # published id: model, batch, prompt, output tokens
    "trtllm.a100_fp16_llama_7b_tp1_bs384_in128_out128_tokens_per_s":
        (planner.LLAMA2_7B, 384, 128, 128),
    "trtllm.a100_fp16_llama_7b_tp1_bs60_in128_out2048_tokens_per_s":
        (planner.LLAMA2_7B, 60, 128, 2048),
    "trtllm.a100_fp16_llama_7b_tp1_bs52_in2048_out128_tokens_per_s":
        (planner.LLAMA2_7B, 52, 2048, 128),
    "trtllm.a100_fp16_gptj_6b_tp1_bs512_in128_out128_tokens_per_s":
        (GPTJ_6B, 512, 128, 128),
    "trtllm.a100_fp16_gptj_6b_tp1_bs60_in2048_out128_tokens_per_s":
        (GPTJ_6B, 60, 2048, 128),
}
SHORT_PROMPTS = ("trtllm.a100_fp16_gptj_6b_tp1_in128_first_token_ms",
                 "trtllm.a100_fp16_llama_7b_tp1_in128_first_token_ms",
                 "trtllm.a100_fp16_llama_70b_tp4_in128_first_token_ms")
CALIBRATED_GPU = "a100_sxm_80gb"  # every published serving run above


def _model_of(key: str) -> planner.Decoder:
    return planner.LLAMA2_7B if "_7b_" in key else LLAMA2_70B


def _tp_of(key: str) -> int:
    return int(key.split("_tp")[1].split("_")[0])


def kv_bytes_per_token(model: planner.Decoder, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token adds, over all layers (Chapter 14).

    Grouped K/V heads: a key and a value of ``kv_heads x head_dim`` per
    layer (multi-head attention has ``kv_heads == heads``). Multi-latent
    attention (DeepSeek-V3): one latent of ``KV_LATENT`` values per layer.
    """
    per_layer = KV_LATENT.get(model.name, 2 * model.kv_heads * model.head_dim)
    return model.layers * per_layer * dtype_bytes


def weight_bytes(model: planner.Decoder, dtype_bytes: int = 2) -> int:
    return model.params() * dtype_bytes


def memory_share() -> float:
    """The fraction of a GPU's memory a serving engine fills (vLLM's default)."""
    return reference.published(MEMORY_SHARE).value


def max_batch(model: planner.Decoder, gpu: str, context: int, tp: int = 1,
              dtype_bytes: int = 2) -> int:
    """Sequences of ``context`` tokens whose KV cache fits beside the weights.

    Per GPU: ``memory_share()`` of its memory, less its ``1 / tp`` of the
    weights, divided by one sequence's ``1 / tp`` of the KV cache (tensor
    parallelism splits the K/V heads; a model with fewer K/V heads than
    ``tp`` copies them, so a GPU keeps at least one head). Activations'
    workspace is not counted: a few per cent of the memory at these batches.
    0 when the weights alone do not fit.
    """
    if context < 1 or tp < 1:
        raise ValueError("context and tp must be at least 1")
    free = (planner._capacity(gpu) * memory_share()
            - weight_bytes(model, dtype_bytes) / tp)
    heads = max(1, model.kv_heads // tp) if model.name not in KV_LATENT else None
    per_token = kv_bytes_per_token(model, dtype_bytes)
    if heads is not None:
        per_token = per_token * heads // model.kv_heads
    return max(0, math.floor(free / (context * per_token)))


@functools.cache
def fitted_decode_latency() -> float:
    """Seconds per tensor-parallel all-reduce in a decode step, fitted.

    The value that makes the mean log-ratio of predicted to published
    tokens/s zero over ``DECODE_FIT`` (gpt-fast's Llama-2-7B on 2, 4 and 8
    A100s); its 70B runs and the one-GPU run are held back to check it.
    """
    def mean_log(lat: float) -> float:  # falls as the latency grows
        logs = [math.log(1 / _decode(_model_of(k), CALIBRATED_GPU, 1, 5, _tp_of(k),
                                     "nvlink_a100", lat) / _published(k))
                for k in DECODE_FIT]
        return -sum(logs) / len(logs)

    return planner._fit(mean_log, 1e-7, 1e-3)


@functools.cache
def fitted_prefill_efficiency() -> float:
    """Fraction of the 16-bit peak a prefill's matmuls reach, fitted.

    Fitted on ``PREFILL_FIT`` (a 2048-token prompt of GPT-J 6B on an A100);
    the other long prompts are held back to check it.
    """
    def mean_log(eff: float) -> float:  # falls as the efficiency grows
        logs = [math.log(_prefill(*PREFILL[k][:1], CALIBRATED_GPU, PREFILL[k][2], 1,
                                  PREFILL[k][1], "nvlink_a100", eff)
                         / (_published(k) / 1e3)) for k in PREFILL_FIT]
        return -sum(logs) / len(logs)

    return planner._fit(mean_log, 0.05, 1.0)


def _published(key: str) -> float:
    return float(reference.published(key).value)


def _allreduce(nbytes: float, tp: int, link: str, latency: float) -> float:
    rate = predict.achieved_link_bandwidth(link)
    return latency + 2 * (tp - 1) / tp * nbytes / rate


def _decode_parts(model, gpu, batch, context, tp, link, latency):
    read = (weight_bytes(model) + batch * context * kv_bytes_per_token(model)) / tp
    memory = read / predict.achieved_memory_bandwidth(gpu)
    flops = batch * (model.matmul_flops_per_token()
                     + model.attention_flops_per_token(2 * context)) / tp
    compute = flops / predict.achieved_flops(gpu, "bf16")
    comm = 0.0 if tp == 1 else 2 * model.layers * _allreduce(
        batch * model.dim * 2, tp, link, latency)
    return memory, compute, comm


def _decode(model, gpu, batch, context, tp, link, latency) -> float:
    memory, compute, comm = _decode_parts(model, gpu, batch, context, tp, link, latency)
    return max(memory, compute) + comm


def _prefill(model, gpu, prompt, batch, tp, link, eff) -> float:
    peak = predict.peak_flops(gpu, "bf16")
    tokens = batch * prompt
    compute = (tokens * model.matmul_flops_per_token() / (peak * eff)
               + tokens * model.attention_flops_per_token(prompt)
               / (peak * predict.attention_efficiency())) / tp
    memory = weight_bytes(model) / tp / predict.achieved_memory_bandwidth(gpu)
    comm = 0.0 if tp == 1 else 2 * model.layers * _allreduce(
        tokens * model.dim * 2, tp, link, predict.collective_latency())
    return max(compute, memory) + comm


def _caveat(gpu: str, tp: int, link: str) -> str:
    parts = []
    if gpu != CALIBRATED_GPU:
        parts.append(f"calibrated on A100 runs only: on {predict.gpu_name(gpu)} the "
                     "achieved bandwidth and FLOP/s are the calibrated fractions of "
                     "its datasheet")
    if tp > 1 and not link.startswith("nvlink"):
        parts.append(f"tensor-parallel all-reduces over {link} are not checked by "
                     "any serving run (all ran over NVLink)")
    return "; ".join(parts)


def decode_seconds(model: planner.Decoder, gpu: str, batch: int, context: int,
                   tp: int = 1, link: str = "nvlink_h100") -> reference.Figure:
    """One decode step: every sequence of ``batch`` adds a token (Chapter 14).

    ``max(read bytes / achieved bandwidth, FLOPs / achieved FLOP/s)`` per GPU,
    reading its ``1 / tp`` of the 16-bit weights and of the KV cache of
    ``batch x context`` tokens, plus ``2 x layers`` all-reduces of the batch's
    activations when ``tp > 1``, each ``fitted_decode_latency()`` plus its
    bytes over ``link``.
    """
    if batch < 1 or context < 0 or tp < 1:
        raise ValueError("batch and tp must be at least 1, context at least 0")
    lat = fitted_decode_latency()
    memory, compute, comm = _decode_parts(model, gpu, batch, context, tp, link, lat)
    bound = "memory" if memory >= compute else "compute"
    return reference.predicted(
        max(memory, compute) + comm, "s", predict.gpu_name(gpu),
        f"decode step of {model.name}, batch {batch}, context {context}, tp {tp}: "
        f"max(bytes read {memory * 1e3:.3g} ms, matmuls {compute * 1e3:.3g} ms) = "
        f"{bound}-bound, + {2 * model.layers if tp > 1 else 0} all-reduces "
        f"{comm * 1e3:.3g} ms (latency {lat * 1e6:.0f} us fitted on gpt-fast's "
        "decode runs)",
        [f"{gpu}.memory_bandwidth_gbps", predict.peak_key(gpu, "bf16"),
         *predict.MEMORY_EFFICIENCY_INPUTS, *predict.MATMUL_EFFICIENCY_INPUTS],
        caveat=_caveat(gpu, tp, link))


def prefill_seconds(model: planner.Decoder, gpu: str, prompt: int, batch: int = 1,
                    tp: int = 1, link: str = "nvlink_h100") -> reference.Figure:
    """The prefill of ``batch`` prompts of ``prompt`` tokens (Chapter 14).

    Matmuls at ``fitted_prefill_efficiency()`` of the 16-bit peak, causal
    attention at the fused kernel's fraction, both split over ``tp`` GPUs,
    never faster than reading the weights once; plus two all-reduces of the
    prompt's activations per layer when ``tp > 1``.
    """
    if prompt < 1 or batch < 1 or tp < 1:
        raise ValueError("prompt, batch and tp must be at least 1")
    eff = fitted_prefill_efficiency()
    t = _prefill(model, gpu, prompt, batch, tp, link, eff)
    caveat = _caveat(gpu, tp, link)
    if prompt < 1024:
        caveat = "; ".join(filter(None, [caveat, (
            "short prompts are not calibrated: published 128-token prefills take "
            "1.5-1.8x this (their matmuls of few rows reach neither roof)")]))
    return reference.predicted(
        t, "s", predict.gpu_name(gpu),
        f"prefill of {batch} x {prompt} tokens of {model.name}, tp {tp}: matmuls at "
        f"{eff:.0%} of the bf16 peak (fitted on a published prefill), attention at "
        f"{predict.attention_efficiency():.0%} (fused kernel)",
        [predict.peak_key(gpu, "bf16"), *predict.ATTENTION_EFFICIENCY_INPUTS,
         *PREFILL_FIT], caveat=caveat)


def decode_crossover_batch(model: planner.Decoder, gpu: str, context: int = 0,
                           tp: int = 1) -> int:
    """The smallest batch whose decode step is compute-bound, not memory-bound.

    With ``context=0`` the weights alone: they are read once per step for
    the whole batch, so below this batch a larger one costs almost nothing
    per step (about the GPU's achieved FLOP/s over its achieved bandwidth,
    per byte of weight). With a context, each sequence also reads its own
    KV cache, once per token and never shared, which stays memory-bound: a
    long enough context keeps decode memory-bound at any batch (then 0).
    """
    if context < 0 or tp < 1:
        raise ValueError("context must be at least 0 and tp at least 1")
    lat = fitted_decode_latency()
    # both terms are linear in the batch: memory = a + b x batch, compute = c x batch
    m0, _, _ = _decode_parts(model, gpu, 1, 0, tp, "nvlink_h100", lat)
    m1, c1, _ = _decode_parts(model, gpu, 1, context, tp, "nvlink_h100", lat)
    per_sequence = m1 - m0  # one sequence's KV cache read
    if c1 <= per_sequence:
        return 0
    return max(1, math.ceil(m0 / (c1 - per_sequence) - 1e-9))


def kv_transfer_seconds(model: planner.Decoder, prompt: int,
                        link: str = "nvlink_h100") -> reference.Figure:
    """Moving one request's KV cache from a prefill GPU to a decode GPU.

    ``prompt x kv_bytes_per_token`` bytes, one transfer: a point-to-point
    latency plus the bytes at ``link``'s achieved rate (``predict.LINKS``) or,
    for a network port (``predict.NICS``), at NCCL's rate per port.
    """
    nbytes = prompt * kv_bytes_per_token(model)
    if link in predict.NICS:
        rate = predict.nic_bandwidth(link)
        inputs = [predict.NICS[link], *predict.NIC_EFFICIENCY_INPUTS]
    else:
        rate = predict.achieved_link_bandwidth(link)
        inputs = [predict.LINKS[link][0]]
    t = predict.collective_latency() + nbytes / rate
    return reference.predicted(
        t, "s", link.replace("_", " "),
        f"KV cache of {prompt} tokens of {model.name} ({nbytes / 2**20:.4g} MiB) at "
        f"{rate / 1e9:.3g} GB/s after a {predict.collective_latency() * 1e6:.0f} us "
        "latency", [*inputs, *predict.COLLECTIVE_LATENCY_INPUTS],
        caveat="no published measurement checks a KV-cache transfer")


def _static_batch_seconds(model, gpu, batch, prompt, out) -> float:
    t = _prefill(model, gpu, prompt, batch, 1, "nvlink_a100",
                 fitted_prefill_efficiency())
    lat = fitted_decode_latency()
    return t + sum(_decode(model, gpu, batch, prompt + i, 1, "nvlink_a100", lat)
                   for i in range(out))


def serving_pairs() -> list[predict.Pair]:
    """The serving model against published decode, prefill and batch runs."""
    pairs = []
    lat = fitted_decode_latency()
    for key in GPT_FAST:
        model, tp = _model_of(key), _tp_of(key)
        role = "fit" if key in DECODE_FIT else "check"
        t = _decode(model, CALIBRATED_GPU, 1, 5, tp, "nvlink_a100", lat)
        pairs.append(predict.Pair(
            f"[{role}] decode, {model.name}, batch 1, {tp} x A100"
            f"{' (tensor parallel)' if tp > 1 else ''}, tokens/s", 1 / t,
            _published(key), "tokens/s", key,
            ("a100_sxm_80gb.memory_bandwidth_gbps", *predict.MEMORY_EFFICIENCY_INPUTS,
             "decode all-reduce latency fitted")))
    eff = fitted_prefill_efficiency()
    for key, (model, tp, prompt) in PREFILL.items():
        role = "fit" if key in PREFILL_FIT else "check"
        t = _prefill(model, CALIBRATED_GPU, prompt, 1, tp, "nvlink_a100", eff)
        pairs.append(predict.Pair(
            f"[{role}] prefill, {model.name}, {prompt}-token prompt, batch 1, "
            f"{tp} x A100, first-token latency", t * 1e3, _published(key), "ms", key,
            (predict.peak_key(CALIBRATED_GPU, "bf16"),
             *predict.ATTENTION_EFFICIENCY_INPUTS, "prefill efficiency fitted")))
    for key, (model, batch, prompt, out) in THROUGHPUT.items():
        t = _static_batch_seconds(model, CALIBRATED_GPU, batch, prompt, out)
        pairs.append(predict.Pair(
            f"[check] static batch, {model.name}, batch {batch}, {prompt} in, {out} "
            "out, 1 A100, output tokens/s", batch * out / t, _published(key),
            "tokens/s", key, ("prefill and decode as above, nothing fitted",)))
    return pairs


def is_serving(pair: predict.Pair) -> bool:
    """Whether a calibration pair is one of ``serving_pairs()``."""
    return pair.measured.split(".")[0] in ("gptfast", "trtllm")


def fit_summary(pairs: list[predict.Pair]) -> str:
    """The calibration's line on what the serving pairs fitted and held back."""
    mine = [p for p in pairs if is_serving(p)]
    fit = [p for p in mine if p.setup.startswith("[fit]")]
    held = [p for p in mine if p.setup.startswith("[check]")]
    return (f"serving: the decode all-reduce latency "
            f"({fitted_decode_latency() * 1e6:.0f} us) and the prefill matmuls' "
            f"fraction of peak ({fitted_prefill_efficiency():.0%}) fitted on the "
            f"{len(fit)} serving pairs marked [fit]; the {len(held)} marked [check] "
            f"were held back, ratios {min(p.ratio for p in held):.2f}-"
            f"{max(p.ratio for p in held):.2f}")


def out_of_scope() -> list[predict.OutOfScope]:
    """Published serving runs the model does not predict, and why."""
    return [predict.OutOfScope(
        reference.published(k).extra["quantity"], _published(k), "ms", k,
        "a prefill of 128 tokens is neither compute- nor memory-bound: its matmuls "
        "of 128 rows reach neither roof, and launches count; the model's max() of "
        "the two is 1.5-1.8x too fast there") for k in SHORT_PROMPTS]
