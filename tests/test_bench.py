"""course_utils.bench: timing that waits for the device."""

import time

import pytest
import torch
import torch.utils.benchmark as tub
from conftest import machine_s

from course_utils import Benchmark, Timing, bench, sweep
from course_utils.bench import MIN_RUNS


def test_benchmark_measures_a_known_duration(capsys):
    with Benchmark("sleep", device="cpu") as b:
        time.sleep(0.05)
    assert 0.045 < b.elapsed < machine_s(0.5)
    assert capsys.readouterr().out.startswith("sleep: 0.0")


def test_benchmark_unsynchronised_says_so(capsys):
    with Benchmark("trap", device="cpu", sync=False):
        pass
    assert "(not synchronised)" in capsys.readouterr().out


def test_benchmark_quiet_returns_elapsed(capsys):
    with Benchmark(verbose=False) as b:
        torch.ones(100).sum()
    assert b.elapsed is not None and b.elapsed >= 0
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_benchmark_waits_for_queued_gpu_work():
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    with Benchmark(verbose=False, device="cuda") as synced:
        start.record()
        for _ in range(20):
            x = x @ x / 4096
        end.record()
    torch.cuda.synchronize()
    gpu_seconds = start.elapsed_time(end) / 1e3
    assert synced.elapsed >= 0.9 * gpu_seconds
    with Benchmark(verbose=False, device="cuda", sync=False) as unsynced:
        for _ in range(20):
            x = x @ x / 4096
    torch.cuda.synchronize()
    assert unsynced.elapsed < 0.5 * gpu_seconds  # only the launches were timed


def test_bench_reports_median_of_a_sleep():
    # blocks of up to about 0.1 s: 0.3 s of timing gives several of them
    t = bench(time.sleep, 0.01, min_run_time=0.3, label="sleep 10 ms")
    assert isinstance(t, Timing)
    assert 0.009 < t.median < machine_s(0.05)
    assert t.num_threads == torch.get_num_threads()
    assert len(t.times) >= 2 and t.iqr >= 0
    assert "sleep 10 ms: median" in str(t)


def test_bench_warms_up_before_timing():
    calls = []

    def first_call_is_slow():
        calls.append(1)
        time.sleep(0.2 if len(calls) == 1 else 0.001)

    t = bench(first_call_is_slow, min_run_time=0.05, warmup=1)
    assert t.median < machine_s(0.05)


def test_sweep_returns_plain_lists():
    s = sweep(
        lambda n: bench(torch.ones, n, min_run_time=0.02),
        [10, 100],
        label="ones",
        progress=False,
    )
    assert s.sizes == [10, 100] and len(s.median) == 2 and len(s.iqr) == 2
    for low, median, high, iqr in zip(s.low, s.median, s.high, s.iqr, strict=True):
        assert low <= median <= high and high - low == pytest.approx(iqr)
    s2 = sweep(lambda n: n * 1e-3, [1, 2], progress=False)
    assert s2.median == [1e-3, 2e-3]


def test_format_seconds_picks_a_readable_unit():
    from course_utils.bench import format_seconds

    assert format_seconds(1.234) == "1.23 s"
    assert format_seconds(0.00456) == "4.56 ms"
    assert format_seconds(12.3e-6) == "12.3 us"
    assert format_seconds(8.5e-7) == "850 ns"
    assert format_seconds(0) == "0 ns"


def test_sweep_progress_is_plain_text_ending_in_a_summary(capsys):
    sweep(lambda n: n * 1e-3, [1, 2000], label="probe")
    out = capsys.readouterr().out
    assert "\rprobe: size 2 of 2 (2,000)" in out
    last = out.split("\r")[-1]  # what a notebook keeps of the line
    assert last.startswith("probe: 2 sizes measured in ") and last.endswith("\n")


def test_bench_times_smaller_blocks_when_autorange_made_too_few(monkeypatch):
    # blocked_autorange grows its block tenfold while the timer's overhead is
    # above 1e-4 of it: a block of 100 sleeps of 2 ms fills the whole run
    real = tub.Timer.blocked_autorange

    def one_big_block(self, min_run_time=0.2, callback=None):
        m = self.timeit(100)
        return tub.Measurement(100, m.raw_times, m.task_spec)

    monkeypatch.setattr(tub.Timer, "blocked_autorange", one_big_block)
    t = bench(time.sleep, 0.002, min_run_time=0.05)
    assert len(t.times) == MIN_RUNS and 1 <= t.number_per_run < 100
    assert 0.0018 < t.median < machine_s(0.01)
    monkeypatch.setattr(tub.Timer, "blocked_autorange", real)
    slow = bench(time.sleep, 0.03, min_run_time=0.02)  # one call per run: kept
    assert slow.number_per_run == 1 and len(slow.times) >= 1
