"""course_utils.predict: textbook models fed with cited, published figures."""

import re

import pytest

from course_utils import predict, reference
from course_utils.build import ROOT


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


# --- calibrated models and the calibration table ------------------------------------


def _run_calibration():
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "course_utils.predict", "--calibration"],
        capture_output=True, text=True, timeout=120)


def test_calibration_command_passes_with_at_least_20_pairs():
    run = _run_calibration()
    assert run.returncode == 0, run.stdout + run.stderr
    table, scope = run.stdout.split("outside the models' scope")
    lines = [ln for ln in table.splitlines() if ", ratio " in ln]
    assert len(lines) == len(predict.calibration_pairs()) >= predict.MIN_PAIRS >= 20
    for ln in lines:  # every printed pair is in the band: no exempt class
        ratio = float(ln.split(", ratio ")[1].split()[0])
        assert 0.8 <= ratio <= 1.25, ln
    # the measurements outside the scope follow, each with its reason, no ratio
    assert ", ratio " not in scope
    for s in predict.out_of_scope():
        assert f"[{s.measured}]; {s.reason}" in scope


def test_calibration_fails_when_a_published_value_leaves_the_band(monkeypatch, capsys):
    pairs = predict.calibration_pairs()
    assert predict.main(["--calibration"]) == 0
    # a published value a third lower: that one pair's ratio leaves the band
    real = predict._value
    key = "nccl.a100x8_allreduce_busbw_gbps"
    monkeypatch.setattr(predict, "_value",
                        lambda k: real(k) * (0.7 if k == key else 1))
    assert predict.main(["--calibration"]) == 1
    out = capsys.readouterr().out
    assert "outside the band: all_reduce bus bandwidth, 8x A100 (NVLink 3)" in out
    monkeypatch.setattr(predict, "_value", real)
    few = predict.MIN_PAIRS - 1
    monkeypatch.setattr(predict, "calibration_pairs", lambda: pairs[:few])
    assert predict.main(["--calibration"]) == 1  # too few pairs
    assert (f"too few calibration pairs: {few} < {predict.MIN_PAIRS}"
            in capsys.readouterr().out)


def test_no_measurement_is_both_calibrated_and_out_of_scope():
    calibrated = {(p.measured, p.unit) for p in predict.calibration_pairs()}
    for s in predict.out_of_scope():
        assert (s.measured, s.unit) not in calibrated, s.setup
        assert s.reason and s.unit, s.setup
    assert predict.caveat("nccl.a100x8_allreduce_busbw_gbps") == ""
    line = predict.caveat("torchgpipe.amoebanetd_n8m32_ips")
    assert line.startswith("caveat: ") and "batch size" in line


def test_no_pair_checks_a_model_against_its_own_input():
    entries = reference.published_entries()
    for p in predict.calibration_pairs():
        measured = p.measured.split(": ")[0]  # a whole run: "id: field"
        assert measured in entries, p.setup
        assert measured not in p.inputs, p.setup
        for key in p.inputs:  # published ids, or what the planner fitted
            assert key in entries or "fitted" in key, (p.setup, key)
        if measured == p.measured:
            assert entries[measured]["unit"] in (p.unit, "s", "img/s", "samples/s",
                                                 "PFLOP/s", "us", "GB/s", "TFLOP/s")


def test_calibration_covers_what_the_chapters_predict():
    setups = " | ".join(p.setup for p in predict.calibration_pairs())
    for word in ("matmul", "HBM", "pinned copy", "pageable copy", "8x H200",
                 "NVLS", "PCIe", "8 bytes", "DDP", "micro-batch", "speed-up"):
        assert word in setups, word


def test_calibrated_inputs_are_fractions_of_datasheet_rates():
    for f in (predict.matmul_efficiency, predict.memory_efficiency,
              predict.pcie_efficiency, predict.nvlink_efficiency):
        assert 0.5 < f() < 1, f.__name__
    assert 1e-6 < predict.launch_overhead() < 1e-4
    assert 1e-6 < predict.collective_latency() < 1e-3
    assert predict.achieved_link_bandwidth("pcie5_x16") == pytest.approx(
        63.0e9 * predict.pcie_efficiency())


def test_tiny_kernels_are_launch_bound_and_big_ones_are_not():
    tiny = predict.kernel_seconds(16, 128, "h100_sxm", launches=1000)
    assert tiny.value == pytest.approx(1000 * predict.launch_overhead())
    assert "launch-bound" in tiny.source and tiny.kind == "predicted"
    big = predict.kernel_seconds(2 * 8192**3, 3 * 2 * 8192**2, "h100_sxm", "bf16")
    assert big.value == pytest.approx(2 * 8192**3 / predict.achieved_flops("h100_sxm",
                                                                            "bf16"))
    assert "compute-bound" in big.source


def test_allreduce_has_a_latency_floor_and_the_ring_bandwidth_term():
    small = predict.allreduce_seconds(8, 2, "nvlink_h100").value
    assert small == pytest.approx(predict.collective_latency(), rel=1e-3)
    big = predict.allreduce_seconds(1e8, 8, "nvlink_h100").value
    assert big == pytest.approx(predict.collective_latency() + 2 * 7 / 8 * 1e8
                                / predict.achieved_link_bandwidth("nvlink_h100"))
    assert predict.allreduce_seconds(1e9, 1).value == 0
    # 8 H100s above 256 MiB: NCCL's in-switch reduction (NVLS) at its peak
    huge = predict.allreduce_seconds(2**33, 8, "nvlink_h100")
    assert huge.value == pytest.approx(predict.collective_latency() + 2 * 7 / 8
                                       * 2**33 / predict.nvls_busbw())
    assert "NVLS" in huge.source
    assert not predict.nvls_applies(2**28, 8, "nvlink_h100")  # 256 MiB: the ring
    assert not predict.nvls_applies(2**33, 4, "nvlink_h100")
    assert not predict.nvls_applies(2**33, 8, "nvlink_a100")
    # nccl-tests' conventions
    assert predict.busbw(1e9, 1.0, 8) == pytest.approx(1e9 * 2 * 7 / 8)
    assert predict.algbw(1e9, 2.0) == pytest.approx(5e8)


def test_pageable_copies_are_slower_than_pinned_by_the_staging_copy():
    pinned = predict.calibrated_copy_seconds(1e9, "pcie4_x16").value
    pageable = predict.calibrated_copy_seconds(1e9, "pcie4_x16", pinned=False).value
    assert pageable == pytest.approx(pinned + 1e9 / predict.host_copy_rate())
    assert 2 < pageable / pinned < 4


def test_pipeline_bubble():
    assert predict.pipeline_seconds(4.0, 1, 1) == pytest.approx(4.0)
    assert predict.pipeline_seconds(4.0, 2, 1) == pytest.approx(4.0)
    assert predict.pipeline_seconds(4.0, 4, 8) == pytest.approx(4.0 * 11 / 32)
    with pytest.raises(ValueError):
        predict.pipeline_seconds(1.0, 0, 1)


def test_mixed_precision_model_gives_the_maths_ceiling_and_no_floor():
    h100 = predict.tensor_math_speedup("h100_sxm", "bf16", "fp32")
    assert h100.kind == "predicted" and h100.value == pytest.approx(989.5 / 67)
    a100 = predict.tensor_math_speedup("a100_sxm_80gb", "bf16", "tf32")
    assert a100.value == pytest.approx(2.0) and "not a training step" in a100.source
    # published A100 steps gain less than 2x (Tacotron 2 loses), so there is no
    # 2x floor from halved bytes; nnU-Net 3D gains more than the math's ceiling
    steps = {s.measured: s.published for s in predict.out_of_scope()
             if s.measured in predict.AMP_SPEEDUPS}
    assert len(steps) == len(predict.AMP_SPEEDUPS)
    assert min(steps.values()) < 1 and sum(v < 2 for v in steps.values()) >= 5
    assert steps["dle_nnunet.dgxa100_amp_speedup_3d_1gpu"] > a100.value
    assert steps["dle_gnmt.dgxa100_amp_speedup_1gpu"] == pytest.approx(
        140909 / 83214, abs=5e-4)
    chapter = (ROOT / "source" / "08_mixed_precision_and_offloading.py").read_text()
    assert not hasattr(predict, "mixed_precision_speedup")
    assert not re.search(r"speed-up[^\n]*between", chapter)
    assert "half the bytes" not in chapter
