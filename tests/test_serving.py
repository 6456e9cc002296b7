"""The serving step model (course_utils.serving): KV bytes, fits and calibration."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from course_utils import planner, predict, serving


def _cache_bytes(model: planner.Decoder, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of real key and value tensors a cache of ``tokens`` holds."""
    kv = [torch.zeros(1, model.kv_heads, tokens, model.head_dim, dtype=dtype)
          for _ in range(2 * model.layers)]
    return sum(t.untyped_storage().nbytes() for t in kv)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_counts_real_tensors(kv_heads, dtype):
    model = planner.Decoder("tiny", 3, 64, 128, 8, kv_heads, 100)
    size = torch.tensor([], dtype=dtype).element_size()
    assert (serving.kv_bytes_per_token(model, size) * 7
            == _cache_bytes(model, 7, dtype))


def test_latent_attention_caches_one_vector_per_layer():
    v3 = planner.DEEPSEEK_V3
    assert serving.kv_bytes_per_token(v3) == v3.layers * (512 + 64) * 2
    # far smaller than keys and values of its 128 heads would be
    full = serving.kv_bytes_per_token(dataclasses.replace(v3, name="no latent"))
    assert full / serving.kv_bytes_per_token(v3) > 20


def test_max_batch_fits_and_one_more_does_not():
    model, gpu, ctx = planner.LLAMA3_8B, "h100_sxm", 4096
    n = serving.max_batch(model, gpu, ctx)
    budget = planner._capacity(gpu) * serving.memory_share()

    def used(b):
        return serving.weight_bytes(model) + b * ctx * serving.kv_bytes_per_token(model)

    assert used(n) <= budget < used(n + 1)
    assert serving.max_batch(model, gpu, 2 * ctx) <= n // 2 + 1
    assert serving.max_batch(model, gpu, ctx, tp=8) > 8 * n  # weights shrink too
    assert serving.max_batch(planner.LLAMA3_405B, gpu, ctx) == 0  # weights alone


def test_tp_beyond_kv_heads_copies_them():
    model = planner.LLAMA3_70B  # 8 K/V heads
    assert serving.max_batch(model, "h100_sxm", 1024, tp=16) < 2 * serving.max_batch(
        model, "h100_sxm", 1024, tp=8)


def test_decode_reads_weights_and_cache():
    model, gpu = planner.LLAMA3_8B, "h100_sxm"
    one = serving.decode_seconds(model, gpu, 1, 0).value
    assert one == pytest.approx(serving.weight_bytes(model)
                                / predict.achieved_memory_bandwidth(gpu))
    # memory-bound: 16 sequences cost about as much as one, a long cache more
    assert serving.decode_seconds(model, gpu, 16, 0).value == pytest.approx(one)
    assert serving.decode_seconds(model, gpu, 16, 8192).value > 1.5 * one
    # tensor parallelism: less to read per GPU, but all-reduces per layer
    tp8 = serving.decode_seconds(model, gpu, 1, 0, tp=8).value
    assert one / 8 < tp8 < one
    fig = serving.decode_seconds(model, gpu, 1, 0)
    assert fig.kind == "predicted" and "memory-bound" in fig.label


def test_crossover_batch_is_where_compute_overtakes_memory():
    model, gpu = planner.LLAMA3_70B, "h100_sxm"
    b = serving.decode_crossover_batch(model, gpu)
    lat = serving.fitted_decode_latency()
    mem, comp, _ = serving._decode_parts(model, gpu, b, 0, 1, "nvlink_h100", lat)
    mem1, comp1, _ = serving._decode_parts(model, gpu, b - 1, 0, 1, "nvlink_h100",
                                           lat)
    assert comp >= mem and comp1 < mem1
    # GQA's small cache keeps a crossover at 1K tokens; Llama 3 8B's does not
    assert serving.decode_crossover_batch(model, gpu, 1024) > b
    assert serving.decode_crossover_batch(planner.LLAMA3_8B, gpu, 1024) == 0


def test_prefill_is_compute_bound_for_long_prompts():
    model, gpu = planner.LLAMA3_8B, "h100_sxm"
    t1, t2 = (serving.prefill_seconds(model, gpu, s).value for s in (2048, 4096))
    assert 2 < t2 / t1 < 2.5  # linear matmuls, quadratic attention
    assert "short prompts" in serving.prefill_seconds(model, gpu, 128).caveat


def test_serving_calibration_fits_some_and_checks_others():
    pairs = serving.serving_pairs()
    fit = [p for p in pairs if p.setup.startswith("[fit]")]
    held = [p for p in pairs if p.setup.startswith("[check]")]
    assert len(fit) == len(serving.DECODE_FIT) + len(serving.PREFILL_FIT)
    assert len(held) >= 10
    assert all(p.within for p in pairs), [p.line() for p in pairs if not p.within]
    assert {p.measured for p in fit} == {*serving.DECODE_FIT, *serving.PREFILL_FIT}
    assert 1e-6 < serving.fitted_decode_latency() < 1e-4
    assert 0.3 < serving.fitted_prefill_efficiency() < predict.matmul_efficiency()
    assert all(serving.is_serving(p) for p in pairs)
    lines, ok = predict.calibration_report()
    assert ok and any(line.startswith("serving: ") for line in lines)


def test_kv_transfer_over_network_is_slower_than_nvlink():
    model = planner.LLAMA3_70B
    nic = serving.kv_transfer_seconds(model, 4096, "ndr_infiniband").value
    nvl = serving.kv_transfer_seconds(model, 4096, "nvlink_h100").value
    assert nic > 3 * nvl
    nbytes = 4096 * serving.kv_bytes_per_token(model)
    assert nic == pytest.approx(predict.collective_latency()
                                + nbytes / predict.nic_bandwidth("ndr_infiniband"))


def test_sdpa_on_a_cache_equals_attention_over_the_whole_sequence():
    """What the model charges for (reading the cache) is what decode computes."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 16) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    last = F.scaled_dot_product_attention(q[:, :, -1:], k, v)
    torch.testing.assert_close(last, full[:, :, -1:])
