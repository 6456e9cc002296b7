"""Chapter 1's plumbing: published GPU facts, predictions, plots and GPU-only demos."""

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")

from course_utils import kernels, reference  # noqa: E402
from course_utils.devices import FP32_LANES_PER_SM  # noqa: E402


@pytest.fixture(autouse=True)
def no_show(monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *a, **k: plt.close("all"))


def test_gpu_lanes_without_a_gpu_are_the_h100s_published():
    gpu = kernels.gpu_lanes(torch.device("cpu"), FP32_LANES_PER_SM)
    assert gpu["sms"] == 132
    assert gpu["lanes_per_sm"] == 128  # 16,896 FP32 cores / 132 SMs
    assert gpu["resident"] == 132 * 64 * 32
    assert gpu["how"].startswith("published")


def test_gather_prediction_follows_the_sector_model():
    f = kernels.gather_prediction()
    assert f.kind == "predicted"
    assert f.value["coalesced"] / f.value["random"] == pytest.approx(44 / 16)
    assert f.value["stride 8"] == f.value["random"]
    # below the datasheet's HBM bandwidth, and above a tenth of it
    hbm = kernels.published_value("h100_sxm.memory_bandwidth_gbps")
    assert hbm / 10 < f.value["coalesced"] < hbm


def test_matmul_floor_is_below_the_calibrated_time():
    f = kernels.matmul_floor(2048)
    assert 0 < f.value["any kernel, at best"] < f.value["cuBLAS, calibrated"]
    flops = 2 * 2048**3
    peak = kernels.published_value("h100_sxm.fp32_tflops", 1e12)
    assert f.value["any kernel, at best"] == pytest.approx(flops / peak * 1e3, rel=1e-6)


def test_published_facts_are_printed_with_their_sources(capsys):
    kernels.print_memory_facts(torch.device("cpu"))
    out = capsys.readouterr().out
    assert "not measured here" in out and "whitepaper" in out
    assert "132 SMs" in out and "3350 GB/s" in out


def test_bandwidth_levels_come_from_published_entries(capsys):
    levels = kernels.print_bandwidth_levels()
    assert levels["HBM3"] == 3350e9
    assert levels["L2 cache"] is None
    assert levels["PCIe Gen5 x16, to the host"] == 63e9
    assert "not measured here" in capsys.readouterr().out


def test_chapter_one_published_entries_have_sources():
    for key in ("flashattention_2022.sram_bandwidth_tbps",
                "flashattention_2022.hbm_bandwidth_tbps",
                "flashattention_2022.cpu_dram_bandwidth_gbps",
                "ddr3_1600.module_peak_bandwidth_gbps",
                "epyc_7002.memory_channels"):
        f = reference.published(key)
        assert f.kind == "published" and f.source
    # the paper's DRAM figure is one DDR3-1600 module's peak
    assert (reference.published("flashattention_2022.cpu_dram_bandwidth_gbps").value
            == reference.published("ddr3_1600.module_peak_bandwidth_gbps").value
            == 1600e6 * 8 / 1e9)
    assert reference.dangling_references() == []


def test_l2_cache_bytes_is_a_plausible_size():
    assert 64 * 1024 <= kernels.l2_cache_bytes() <= 64 * 2**20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_cuda_c_says_why_it_did_not_run():
    assert kernels.run_cuda_c_vector_add("__global__ void f() {}").startswith("not run")


def test_plots_draw_without_error(capsys):
    ids = [np.arange(24, dtype=np.int32).reshape(4, 6) for _ in range(4)]
    kernels.plot_grid_ids(*ids, (3, 2), (2, 2))
    here = reference.measured({"coalesced": 10.0, "stride 8": 4.0, "random": 2.0},
                              "GB/s", "cpu")
    kernels.plot_gather([here, kernels.gather_prediction()], 1024)
    assert "coalesced 10.0" in capsys.readouterr().out
    kernels.show_divergence(1.8, None, torch.device("cpu"))
    peak = reference.published("h100_sxm.memory_bandwidth_gbps")
    kernels.plot_loads_in_flight([1, 2, 4], [1e6, 2e6, 4e6], [], peak)
    kernels.plot_copy_curve([reference.measured({"x": [1, 2, 4], "y": [50, 40, 8]},
                                                "GB/s", "cpu"), peak], peak)
    amdahl = lambda p, n: 1 / ((1 - p) + p / n)  # noqa: E731
    kernels.plot_amdahl_measured(amdahl, 0.9, 1.7)
    assert kernels.amdahl_slider(amdahl) is not None
