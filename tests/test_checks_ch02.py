"""The checkers of Chapter 2 accept correct solutions and name typical mistakes.

Each exercise is checked with several correct solutions written in different
ways and with the usual wrong ones; a wrong one must fail with a message that
names its mistake.
"""

from __future__ import annotations

import functools
import statistics
import time
import timeit

import pytest
import torch
import torch.utils.benchmark as tub

from course_utils import Benchmark, bench
from course_utils.bench import synchronize
from course_utils.checks.ch02 import (
    check_measure,
    check_roofline_point,
    check_run_epoch,
)
from course_utils.exercises import ExerciseFailed

# --- Exercise 2.1 ---------------------------------------------------------------


def measure_hand_written(fn, device):
    device = torch.device(device)
    fn()
    times = []
    for _ in range(5):
        synchronize([device])
        start = time.perf_counter()
        fn()
        synchronize([device])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_with_bench(fn, device):
    return bench(fn, min_run_time=0.1).median


def measure_with_timer(fn, device):
    fn()
    return tub.Timer("fn()", globals={"fn": fn}).blocked_autorange(
        min_run_time=0.1).median


def measure_with_benchmark(fn, device):
    fn()
    with Benchmark(device=device, verbose=False) as b:
        for _ in range(8):
            fn()
    return b.elapsed / 8


def measure_events_or_clock(fn, device):
    if device.type == "cuda":
        fn()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / 5
    fn()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cpu.synchronize()
    return (time.perf_counter() - t0) / 5


def measure_median_no_warmup(fn, device):
    times = []
    for _ in range(7):  # the median ignores the slow first call
        synchronize([device])
        t0 = time.perf_counter()
        fn()
        synchronize([device])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wait_for(device):
    """A learner's own helper, defined outside measure: the checker follows it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_own_helper(fn, device):
    fn()
    total = 0.0
    for _ in range(5):
        wait_for(device)
        t0 = time.perf_counter()
        fn()
        wait_for(device)
        total += time.perf_counter() - t0
    return total / 5


def measure_backend_synchronize(fn, device):
    sync = getattr(torch, device.type).synchronize  # torch.cpu / torch.cuda
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(4):
        fn()
    sync()
    return (time.perf_counter() - t0) / 4


def measure_timer_only(fn, device):
    # no explicit warm-up: blocked_autorange's first, estimating runs are untimed
    return tub.Timer("fn()", globals={"fn": fn}).blocked_autorange(
        min_run_time=0.1).median


def measure_tensor_result(fn, device):
    fn()
    times = []
    for _ in range(5):
        synchronize([device])
        t0 = time.perf_counter()
        fn()
        synchronize([device])
        times.append(time.perf_counter() - t0)
    return torch.tensor(times).median()  # a one-number tensor of seconds


def make_measure(sync, repeats):
    def measure(fn, device):  # the wait comes from the closure
        fn()
        sync([device])
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync([device])
        return (time.perf_counter() - t0) / repeats
    return measure


def measure_with_options(fn, device, repeats=5):
    fn()
    synchronize([device])
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize([device])
    return (time.perf_counter() - t0) / repeats


@pytest.mark.parametrize("measure", [
    measure_hand_written, measure_with_bench, measure_with_timer,
    measure_with_benchmark, measure_events_or_clock, measure_median_no_warmup,
    measure_own_helper, measure_backend_synchronize, measure_timer_only,
    measure_tensor_result, make_measure(synchronize, 6),
    functools.partial(measure_with_options, repeats=4)])
def test_measure_accepts_correct_methods(measure, capsys):
    check_measure(measure)
    assert "Exercise 2.1 passed" in capsys.readouterr().out


def wrong_no_warmup(fn, device):
    synchronize([device])
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    synchronize([device])
    return (time.perf_counter() - t0) / 5


def wrong_single_run(fn, device):
    fn()
    synchronize([device])
    t0 = time.perf_counter()
    fn()
    synchronize([device])
    return time.perf_counter() - t0


def wrong_total(fn, device):
    fn()
    synchronize([device])
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    synchronize([device])
    return time.perf_counter() - t0


def wrong_never_waits(fn, device):
    fn()
    times = []
    for _ in range(5):
        t0 = time.time()
        fn()
        times.append(time.time() - t0)
    return statistics.median(times)


def wrong_timeit_no_wait(fn, device):
    """Times fn; no need to synchronize here (a docstring is not a wait)."""
    fn()
    return timeit.timeit(fn, number=5) / 5


def wrong_long_loop_no_warmup(fn, device):
    synchronize([device])
    t0 = time.perf_counter()
    for _ in range(40):
        fn()
    synchronize([device])
    return (time.perf_counter() - t0) / 40


def wrong_returns_timing(fn, device):
    return bench(fn, min_run_time=0.05)


def wrong_hard_coded_cuda(fn, device):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# Without a GPU the checker reads the code for a wait; with one, the CUDA
# workload shows that only the launches were timed.
NO_WAIT = "LAUNCH" if torch.cuda.is_available() else "nothing in measure waits"


@pytest.mark.parametrize("measure, words", [
    (wrong_no_warmup, "first call"),
    (wrong_long_loop_no_warmup, "first call"),
    (wrong_single_run, "called 2 time"),
    (wrong_total, "total"),
    (wrong_never_waits, NO_WAIT),
    (wrong_timeit_no_wait, NO_WAIT),
    (wrong_returns_timing, "Timing"),
])
def test_measure_names_the_mistake(measure, words):
    with pytest.raises(ExerciseFailed) as e:
        check_measure(measure)
    assert words in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the mistake only shows on a CPU")
def test_measure_reports_hard_coded_cuda():
    with pytest.raises(ExerciseFailed) as e:
        check_measure(wrong_hard_coded_cuda)
    assert "device.type == 'cuda'" in str(e.value)


def test_measure_reports_the_placeholder():
    def stub(fn, device):
        raise NotImplementedError("Exercise 2.1")

    with pytest.raises(ExerciseFailed, match="placeholder"):
        check_measure(stub)


# --- Exercise 2.2 ---------------------------------------------------------------


def _step(model, optimizer, loss_fn, x, y):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def epoch_detach_sum(model, optimizer, batches, loss_fn):
    total = torch.zeros(())
    for x, y in batches:
        total = total.to(x.device) + _step(model, optimizer, loss_fn, x, y).detach()
    return total.item() / len(batches)


def epoch_stack(model, optimizer, batches, loss_fn):
    losses = [_step(model, optimizer, loss_fn, x, y).detach() for x, y in batches]
    return float(torch.stack(losses).mean())


def epoch_in_place(model, optimizer, batches, loss_fn):
    total = None
    for x, y in batches:
        loss = _step(model, optimizer, loss_fn, x, y)
        total = loss.detach().clone() if total is None else total.add_(loss.detach())
    return total.item() / len(batches)


@pytest.mark.parametrize("run_epoch", [epoch_detach_sum, epoch_stack, epoch_in_place])
def test_run_epoch_accepts_correct(run_epoch, capsys):
    check_run_epoch(run_epoch)
    assert "Exercise 2.2 passed" in capsys.readouterr().out


def wrong_item_every_step(model, optimizer, batches, loss_fn):
    total = 0.0
    for x, y in batches:
        total += _step(model, optimizer, loss_fn, x, y).item()
    return total / len(batches)


def wrong_print_every_step(model, optimizer, batches, loss_fn):
    total = 0
    for x, y in batches:
        loss = _step(model, optimizer, loss_fn, x, y).detach()
        print(f"loss {loss}")
        total = total + loss
    return total.item() / len(batches)


def wrong_keeps_graphs(model, optimizer, batches, loss_fn):
    total = 0
    for x, y in batches:
        total = total + _step(model, optimizer, loss_fn, x, y)
    return total.item() / len(batches)


def wrong_returns_tensor(model, optimizer, batches, loss_fn):
    total = 0
    for x, y in batches:
        total = total + _step(model, optimizer, loss_fn, x, y).detach()
    return total / len(batches)


def wrong_no_zero_grad(model, optimizer, batches, loss_fn):
    total = 0
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total = total + loss.detach()
    return total.item() / len(batches)


def wrong_sum_not_mean(model, optimizer, batches, loss_fn):
    total = 0
    for x, y in batches:
        total = total + _step(model, optimizer, loss_fn, x, y).detach()
    return total.item()


@pytest.mark.parametrize("run_epoch, words", [
    (wrong_item_every_step, "reads"),
    (wrong_print_every_step, "reads"),
    (wrong_keeps_graphs, "graphs alive"),
    (wrong_returns_tensor, "a tensor"),
    (wrong_no_zero_grad, "zero_grad"),
    (wrong_sum_not_mean, "mean loss"),
])
def test_run_epoch_names_the_mistake(run_epoch, words, capsys):
    with pytest.raises(ExerciseFailed) as e:
        check_run_epoch(run_epoch)
    assert words in str(e.value)


# --- Exercise 2.3 ---------------------------------------------------------------


def roofline_sizes(n, seconds, dtype):
    flop, size = 2 * n**3, torch.empty((), dtype=dtype).element_size()
    return flop / seconds, flop / (3 * n * n * size)


def roofline_finfo(n, seconds, dtype):
    nbytes = 3 * n**2 * torch.finfo(dtype).bits // 8
    return [2.0 * n * n * n / seconds, 2.0 * n * n * n / nbytes]


@pytest.mark.parametrize("fn", [roofline_sizes, roofline_finfo])
def test_roofline_accepts_correct(fn, capsys):
    check_roofline_point(fn)
    assert "Exercise 2.3 passed" in capsys.readouterr().out


def wrong_one_flop_per_fma(n, seconds, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return n**3 / seconds, n**3 / (3 * n * n * size)


def wrong_elements(n, seconds, dtype):
    return 2 * n**3 / seconds, 2 * n**3 / (3 * n * n)


def wrong_no_output(n, seconds, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * n**3 / seconds, 2 * n**3 / (2 * n * n * size)


def wrong_one_number(n, seconds, dtype):
    return 2 * n**3 / seconds


@pytest.mark.parametrize("fn, words", [
    (wrong_one_flop_per_fma, "2 floating-point operations"),
    (wrong_elements, "element size"),
    (wrong_no_output, "output C"),
    (wrong_one_number, "a pair"),
])
def test_roofline_names_the_mistake(fn, words):
    with pytest.raises(ExerciseFailed) as e:
        check_roofline_point(fn)
    assert words in str(e.value)
