"""course_utils.predict: textbook models fed with cited, published figures."""

import pytest

from course_utils import predict, reference


def test_roofline_is_memory_bound_for_a_copy_and_compute_bound_for_a_big_matmul():
    n = 1 << 28  # a 1 GiB fp32 copy: read and write every byte, no math
    copy = predict.roofline_seconds(0, 2 * 4 * n, "h100_sxm")
    assert copy.kind == "predicted"
    assert copy.value == pytest.approx(2 * 4 * n / 3350e9)
    assert "memory-bound" in copy.source and "3350 GB/s" in copy.source
    m = 8192
    mm = predict.roofline_seconds(2 * m**3, 3 * 4 * m * m, "h100_sxm", "bf16")
    assert mm.value == pytest.approx(2 * m**3 / 989.5e12)
    assert "compute-bound" in mm.source and "989.5 TFLOP/s" in mm.source
    assert mm.device == "NVIDIA H100 SXM5 80GB"
    assert "predicted for NVIDIA H100 SXM5 80GB" in mm.label


def test_every_gpu_has_the_inputs_the_models_need():
    for gpu in predict.GPUS:
        assert predict.peak_flops(gpu, "fp32") > 1e12
        assert predict.peak_flops(gpu, "fp16") > predict.peak_flops(gpu, "fp32")
        assert predict.memory_bandwidth(gpu) > 1e11
        assert 1 < predict.ridge_point(gpu) < 1000
    with pytest.raises(ValueError):
        predict.peak_flops("h100_sxm", "int3")


def test_attainable_flops_bends_at_the_ridge_point():
    ridge = predict.ridge_point("a100_sxm_80gb")
    low = predict.roofline_flops_per_s(ridge / 10, "a100_sxm_80gb").value
    high = predict.roofline_flops_per_s(ridge * 10, "a100_sxm_80gb").value
    assert low == pytest.approx(predict.peak_flops("a100_sxm_80gb") / 10)
    assert high == pytest.approx(predict.peak_flops("a100_sxm_80gb"))


def test_links_are_per_direction():
    # NVLink's datasheet figure counts both directions; PCIe's is per direction
    assert predict.link_bandwidth("nvlink_h100") == pytest.approx(450e9)
    assert predict.link_bandwidth("pcie4_x16") == pytest.approx(31.5e9)
    f = predict.copy_seconds(1e9, "pcie4_x16", gpu="NVIDIA A100")
    assert f.value == pytest.approx(1e9 / 31.5e9)
    assert "pcie4_x16" in f.source and f.kind == "predicted"


def test_ring_allreduce_sends_2_n_minus_1_over_n():
    one = predict.ring_allreduce_seconds(1e9, 1).value
    two = predict.ring_allreduce_seconds(1e9, 2).value
    eight = predict.ring_allreduce_seconds(1e9, 8).value
    assert one == 0
    assert two == pytest.approx(1e9 / 450e9)
    assert eight == pytest.approx(2 * 7 / 8 * 1e9 / 450e9)
    with pytest.raises(ValueError):
        predict.ring_allreduce_seconds(1e9, 0)


def test_a_prediction_is_shown_as_one():
    f = predict.roofline_seconds(1e9, 1e6, "t4")
    shown = reference.show("demo", local=1e-3, unit="s", figures=[f])
    assert [s.kind for s in shown] == ["measured", "predicted"]
