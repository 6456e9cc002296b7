"""Chapter 3's plumbing: the models, span arithmetic and plots run on a CPU."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from course_utils import transfers  # noqa: E402


def test_overlap_seconds_and_span_wall():
    assert transfers.overlap_seconds(("a", 0.0, 2.0), ("b", 1.0, 3.0)) == 1.0
    assert transfers.overlap_seconds(("a", 0.0, 1.0), ("b", 1.0, 3.0)) == 0.0
    assert transfers.overlap_seconds(("a", 0.0, 1.0), ("b", 2.0, 3.0)) == 0.0
    assert transfers.span_wall([("a", 2.0, 3.0), ("b", 0.5, 1.0)]) == 2.5


def test_median_run_picks_the_middle_wall_time():
    runs = [{"wall": w, "id": i} for i, w in enumerate([3.0, 1.0, 2.0])]
    assert transfers.median_run(runs)["id"] == 2


def test_two_stream_speedup_is_between_one_and_two():
    for n in transfers.STREAM_SIZES:
        s = transfers.two_stream_speedup(n)
        assert 1.0 <= s <= 2.0
    assert transfers.two_stream_speedup(256) == 2.0   # 4 tiles: most SMs idle
    assert transfers.two_stream_speedup(8192) == 1.0  # 4096 tiles fill every SM


def test_copy_model_orders_the_three_modes():
    t = transfers.copy_model(8, 4096)
    assert set(t) == set(transfers.COPY_MODES)
    assert t["copy stream"] < t["pinned non_blocking, one stream"]
    assert t["pinned non_blocking, one stream"] < t["pageable, one stream"]
    mm, cp = transfers.matmul_seconds(4096), transfers.copy_seconds(4 * 4096**2)
    assert t["copy stream"] >= 8 * max(mm, cp)  # overlap hides only the smaller


def test_predicted_copy_spans_never_start_a_copy_before_its_matmul():
    for mode in transfers.COPY_MODES:
        spans = transfers._predicted_copy_spans(mode, k=5)
        compute = {sp[3]: sp for sp in spans if sp[0] == "compute"}
        for lane, start, _end, label in spans:
            if lane == "copy":
                assert start >= compute[label][2] - 1e-15


def test_loader_estimates_respect_the_core_bound():
    est = transfers.loader_estimates(0.04, 0.01, n=10, cores=2)
    assert est[0] == pytest.approx(0.5)
    assert est[1] == pytest.approx(0.4)        # n max(L, T)
    assert est[2] == pytest.approx(0.25)       # n (L+T) / cores beats n L/2
    assert est[0] >= est[1] >= est[2]


def test_lock_fresh_pages_is_timed_or_refused():
    s = transfers.lock_fresh_pages_seconds(64 * 1024)
    assert s is None or s >= 0.0


def test_gpu_figures_and_plots_run_without_a_gpu(capsys):
    cpu = torch.device("cpu")
    transfers.show_race(None, cpu)
    transfers.show_allocator_race(None, cpu)
    transfers.show_d2h_trap(None, cpu)
    transfers.plot_two_streams(None, 1.3, 320, cpu)
    transfers.show_two_stream_timelines(None, cpu)
    transfers.plot_h2d(cpu, [2**16, 2**20], [5.0, 3.0])
    transfers.show_copy_compute(None, cpu)
    transfers.plot_seed_workload()
    transfers.draw_overlap(16.0, 2048)
    transfers.show_prefetch_prediction()
    transfers.show_two_devices(None, cpu)
    transfers.draw_mlp_graph()
    spans = {0: [("main: load", 0.0, 1.0, ""), ("main: train", 1.0, 1.5, "")],
             1: [("worker 0: load", 0.0, 1.0, ""), ("main: train", 1.0, 1.5, "")]}
    transfers.print_epochs(spans, {0: 1.5, 1: 1.0})
    transfers.plot_epochs(spans)
    out = capsys.readouterr().out
    assert "predicted" in out and "published" in out
    assert "copy stream" in out and "median load per batch 1000.0 ms" in out


def test_a_profile_with_no_gpu_kernel_gives_no_spans(monkeypatch):
    """Without CUDA activity tracing the profiler sees no kernel: [] (no min())."""
    import torch.profiler

    class NoKernels:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return []

    monkeypatch.setattr(torch.profiler, "profile", NoKernels)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert transfers.kernel_spans(lambda: None, "cpu") == []
