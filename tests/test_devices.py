"""course_utils.devices with real tensors."""

import os

import pytest
import torch

from course_utils import banner, check_fits, for_device, try_all_gpus, try_gpu
from course_utils.devices import (
    cpu_facts,
    format_bytes,
    gpu_count,
    kernel_target,
    usable_physical_cores,
)
from course_utils.errors import DoesNotFit


def test_try_all_gpus_is_never_empty():
    devices = try_all_gpus()
    assert devices, "try_all_gpus() returned an empty list"
    assert len(devices) == max(gpu_count(), 1)
    assert all(isinstance(d, torch.device) for d in devices)


def test_try_gpu_falls_back_to_cpu_with_one_line(capsys):
    d = try_gpu(99)
    assert d == torch.device("cpu")
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "no GPU 99" in out


def test_try_gpu_zero_is_usable():
    x = torch.ones(2, device=try_gpu())
    assert (x + x).sum().item() == 4


def test_check_fits_refuses_impossible_size_in_one_line():
    with pytest.raises(DoesNotFit) as info:
        check_fits((10**7, 10**7), torch.float32, "cpu")
    msg = str(info.value)
    assert "needs" in msg and "choose a smaller size" in msg and "\n" not in msg
    assert isinstance(info.value, MemoryError)
    rendered = info.value._render_traceback_()
    assert len(rendered) == 1 and "DoesNotFit" in rendered[0]


def test_check_fits_accepts_small_size_and_counts_bytes():
    assert check_fits((1024, 1024), torch.float16, "cpu") == 2 * 2**20
    assert check_fits(10, torch.float64, "cpu", copies=3) == 240


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_check_fits_on_gpu_uses_free_memory():
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(DoesNotFit):
        check_fits(free, torch.float32, "cuda")


def test_for_device_picks_by_type():
    assert for_device("cpu", cpu=1, gpu=2) == 1
    assert for_device(torch.device("cuda", 0), cpu=1, gpu=2) == 2


def test_cpu_facts_are_plausible():
    facts = cpu_facts()
    assert facts["usable_cores"] >= 1 and facts["torch_threads"] >= 1
    assert facts["simd_bits"] in (128, 256, 512)
    assert facts["memory_total"] > facts["memory_available"] > 0


def test_usable_physical_cores_counts_smt_siblings_once():
    facts = cpu_facts()
    n = usable_physical_cores()
    assert 1 <= n <= facts["usable_cores"]
    if facts["physical_cores"] == facts["logical_cores"]:
        assert n == facts["usable_cores"]


def test_cpu_facts_physical_cores_fit_within_logical():
    facts = cpu_facts()
    physical, logical = facts["physical_cores"], facts["logical_cores"]
    assert physical is None or 1 <= physical <= logical


def test_banner_says_which_situation(capsys):
    line = banner()
    assert capsys.readouterr().out.strip() == line
    if gpu_count() == 0:
        assert line.startswith("CPU only") and "simulator" in line
    else:
        assert "GPU" in line


def test_kernel_target_follows_torch():
    # importing course_utils chose the numba target before numba was imported
    from course_utils.devices import numba_cuda_installed

    gpu = torch.cuda.is_available() and numba_cuda_installed()
    expected = "GPU" if gpu else "simulator"
    if os.environ.get("NUMBA_ENABLE_CUDASIM") in ("0", "1"):
        assert kernel_target() == expected


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


def test_usable_cores_honours_a_cgroup_quota(monkeypatch):
    from course_utils import devices

    monkeypatch.setattr(devices, "cpu_quota", lambda: 1.5)
    assert devices.usable_cores() == min(2, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(devices, "cpu_quota", lambda: 0.5)
    assert devices.usable_cores() == 1
    monkeypatch.setattr(devices, "cpu_quota", lambda: None)
    assert devices.usable_cores() == len(os.sched_getaffinity(0))


def test_gpu_names_never_initialise_cuda(monkeypatch):
    from course_utils import devices

    def initialises(*args):
        raise AssertionError("gpu_names initialised CUDA")

    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", initialises)
    monkeypatch.setattr(devices, "_nvml_names", lambda: ["A", "B", "C"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert devices.gpu_names() == ["C", "A"]
    monkeypatch.setattr(devices, "_nvml_names", lambda: [])
    assert all("name unknown" in n for n in devices.gpu_names())


def test_kernels_fall_back_to_the_simulator_without_numba_cuda(monkeypatch):
    from course_utils import devices

    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    monkeypatch.setattr(devices, "KERNEL_NOTE", "")
    monkeypatch.delitem(__import__("sys").modules, "numba", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "numba_cuda_installed", lambda: False)
    devices.select_kernel_target()
    assert os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
    assert "numba-cuda is not installed" in devices.KERNEL_NOTE
