"""The checkers of Chapter 2 accept correct solutions and name typical mistakes.

Each exercise is checked with several correct solutions written in different
ways and with the usual wrong ones; a wrong one must fail with a message that
names its mistake.
"""

from __future__ import annotations

import statistics
import time
import timeit
from time import perf_counter as clock

import numpy as np
import pytest
import torch

from course_utils.checks.ch02 import (
    check_measure,
    check_roofline_verdicts,
    check_run_epoch,
)
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    text = str(e.value)
    for w in words:
        assert w in text, text


def placeholder(*args):
    raise NotImplementedError("Exercise 2.x")


# --- Exercise 2.1 ---------------------------------------------------------------


def measure_median(fn, sync):
    fn()
    sync()
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_loop_mean(fn, sync, calls=8):  # one clock around a loop, divided
    fn()
    sync()
    start = clock()
    for _ in range(calls):
        fn()
    sync()
    return (clock() - start) / calls


class Timer:  # a context-manager timer, as the chapter's Benchmark
    def __init__(self, sync):
        self.sync = sync

    def __enter__(self):
        self.sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.sync()
        self.elapsed = time.perf_counter() - self.start


def measure_with_context_manager(fn, sync):
    with Timer(sync):
        fn()  # warm-up, waited for on exit
    runs = []
    for _ in range(4):
        with Timer(sync) as t:
            fn()
        runs.append(t.elapsed)
    return min(runs)


def measure_timeit(fn, sync):
    fn()
    sync()

    def once():
        fn()
        sync()
    return min(timeit.repeat(once, number=2, repeat=3)) / 2


def measure_median_no_warmup(fn, sync):  # the median leaves the slow call out
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_tensor_result(fn, sync):
    return torch.tensor(measure_median(fn, sync))


@pytest.mark.parametrize("measure", [
    measure_median, measure_loop_mean, measure_with_context_manager, measure_timeit,
    measure_median_no_warmup, measure_tensor_result])
def test_measure_accepts_right_answers(measure, capsys):
    check_measure(measure)
    assert "Exercise 2.1 passed" in capsys.readouterr().out


def wrong_no_warmup_mean(fn, sync):
    sync()
    start = time.perf_counter()
    for _ in range(5):
        fn()
    sync()
    return (time.perf_counter() - start) / 5


def wrong_single_run(fn, sync):
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def wrong_total(fn, sync):
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(5):
        fn()
    sync()
    return time.perf_counter() - start


def wrong_never_waits(fn, sync):
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wrong_waits_only_at_start(fn, sync):
    fn()
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wrong_warmup_not_waited(fn, sync):  # the warm-up's work is still running
    fn()
    start = time.perf_counter()
    for _ in range(5):
        fn()
    sync()
    return (time.perf_counter() - start) / 5


def wrong_constant(fn, sync):  # the cost of one run, written down
    fn()
    sync()
    for _ in range(4):
        fn()
    sync()
    return 0.012


def wrong_timeit_no_sync(fn, sync):
    fn()
    sync()
    return min(timeit.repeat(fn, number=3, repeat=3)) / 3


def wrong_returns_list(fn, sync):
    fn()
    sync()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


@pytest.mark.parametrize("measure, words", [
    (wrong_no_warmup_mean, ["slow first call", "warm up"]),
    (wrong_single_run, ["at least 3"]),
    (wrong_total, ["the total of all"]),
    (wrong_never_waits, ["QUEUE", "sync()"]),
    (wrong_waits_only_at_start, ["QUEUE"]),
    (wrong_warmup_not_waited, ["slow first call", "then sync()"]),
    (wrong_constant, ["25 ms of work per call"]),
    (wrong_timeit_no_sync, ["QUEUE"]),
    (wrong_returns_list, ["measure's return value"]),
    (placeholder, ["placeholder"]),
])
def test_measure_names_the_mistake(measure, words):
    fails(check_measure, measure, *words)


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


class EpochRunner:  # a class; the losses kept on the device in a list
    def __call__(self, model, optimizer, batches, loss_fn):
        kept = [_step(model, optimizer, loss_fn, x, y).detach() for x, y in batches]
        return torch.stack(kept).sum().item() / len(kept)


@pytest.mark.parametrize("run_epoch", [epoch_detach_sum, epoch_stack, epoch_in_place,
                                       EpochRunner()])
def test_run_epoch_accepts_correct(run_epoch, capsys):
    check_run_epoch(run_epoch)
    assert "Exercise 2.2 passed" in capsys.readouterr().out


def wrong_item_every_step(model, optimizer, batches, loss_fn):
    total = 0.0
    for x, y in batches:
        total += _step(model, optimizer, loss_fn, x, y).item()
    return total / len(batches)


def wrong_float_every_step(model, optimizer, batches, loss_fn):
    total = 0.0
    for x, y in batches:
        total += float(_step(model, optimizer, loss_fn, x, y).detach())
    return total / len(batches)


def wrong_cpu_every_step(model, optimizer, batches, loss_fn):
    kept = [_step(model, optimizer, loss_fn, x, y).detach().cpu() for x, y in batches]
    return sum(t.sum() for t in kept).item() / len(kept)


def wrong_bool_every_step(model, optimizer, batches, loss_fn):
    total = torch.zeros(())
    for x, y in batches:
        loss = _step(model, optimizer, loss_fn, x, y).detach()
        if loss > 1e6:  # a divergence check reads the value every step
            raise RuntimeError("diverged")
        total += loss
    return total.item() / len(batches)


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


def wrong_to_cpu_every_step(model, optimizer, batches, loss_fn):
    total = 0.0
    for x, y in batches:
        total += _step(model, optimizer, loss_fn, x, y).detach().to("cpu")
    return float(total) / len(batches)


def wrong_numpy_every_step(model, optimizer, batches, loss_fn):
    losses = []
    for x, y in batches:
        losses.append(np.asarray(_step(model, optimizer, loss_fn, x, y).detach()))
    return float(np.mean(losses))


def wrong_tolist_every_step(model, optimizer, batches, loss_fn):
    total = 0.0
    for x, y in batches:
        total += _step(model, optimizer, loss_fn, x, y).detach().reshape(1).tolist()[0]
    return total / len(batches)


@pytest.mark.parametrize("run_epoch, words", [
    (wrong_to_cpu_every_step, ".to('cpu')"),
    (wrong_numpy_every_step, "numpy.asarray"),
    (wrong_tolist_every_step, "tolist"),
    (placeholder, "placeholder"),
    (wrong_item_every_step, ".item()"),
    (wrong_print_every_step, "f-string"),
    (wrong_float_every_step, "float()"),
    (wrong_cpu_every_step, ".cpu()"),
    (wrong_bool_every_step, "bool() or an if"),
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


def verdicts_ratio(points, peak_flops, bandwidth):
    ridge = peak_flops / bandwidth
    return [("compute" if f / b >= ridge else "memory",
             max(f / peak_flops, b / bandwidth) / t) for f, b, t in points]


def verdicts_roof(points, peak_flops, bandwidth):  # achieved over the roof
    out = []
    for flop, nbytes, seconds in points:
        if flop == 0:  # a copy: only the bandwidth roof
            out.append(("memory", nbytes / seconds / bandwidth))
            continue
        intensity = flop / nbytes
        roof = min(peak_flops, intensity * bandwidth)
        out.append(("compute" if roof == peak_flops else "memory",
                    flop / seconds / roof))
    return out


def verdicts_cross_multiplied(points, peak_flops, bandwidth):
    return [["compute" if f * bandwidth >= peak_flops * b else "memory",
             np.float64(max(f / peak_flops, b / bandwidth) / t)]
            for f, b, t in points]


class Roofline:  # a class
    def __call__(self, points, peak_flops, bandwidth):
        return tuple(self.one(p, peak_flops, bandwidth) for p in points)

    @staticmethod
    def one(point, peak, bw):
        flop, nbytes, seconds = point
        t_compute, t_memory = flop / peak, nbytes / bw
        return ("compute" if t_compute >= t_memory else "memory",
                max(t_compute, t_memory) / seconds)


@pytest.mark.parametrize("fn", [verdicts_ratio, verdicts_roof,
                                verdicts_cross_multiplied, Roofline()])
def test_roofline_accepts_right_answers(fn, capsys):
    check_roofline_verdicts(fn)
    assert "Exercise 2.3 passed" in capsys.readouterr().out


def wrong_ridge_inverted(points, peak_flops, bandwidth):
    ridge = bandwidth / peak_flops
    return [("compute" if f / b >= ridge else "memory",
             max(f / peak_flops, b / bandwidth) / t) for f, b, t in points]


def wrong_strictly_above(points, peak_flops, bandwidth):
    ridge = peak_flops / bandwidth
    return [("compute" if f / b > ridge else "memory",
             max(f / peak_flops, b / bandwidth) / t) for f, b, t in points]


def wrong_one_flop_per_byte(points, peak_flops, bandwidth):  # a fixed ridge
    return [("compute" if f > b else "memory",
             max(f / peak_flops, b / bandwidth) / t) for f, b, t in points]


def wrong_fraction_of_peak(points, peak_flops, bandwidth):
    return [("compute" if f / b >= peak_flops / bandwidth else "memory",
             f / t / peak_flops) for f, b, t in points]


def wrong_fraction_inverted(points, peak_flops, bandwidth):
    return [("compute" if f / b >= peak_flops / bandwidth else "memory",
             t / max(f / peak_flops, b / bandwidth)) for f, b, t in points]


def wrong_min_not_max(points, peak_flops, bandwidth):
    return [("compute" if f / b >= peak_flops / bandwidth else "memory",
             min(f / peak_flops, b / bandwidth) / t) for f, b, t in points]


def wrong_by_achieved_rate(points, peak_flops, bandwidth):  # judges the speed
    return [("compute" if f / t >= 0.5 * peak_flops else "memory",
             max(f / peak_flops, b / bandwidth) / t) for f, b, t in points]


def wrong_bound_only(points, peak_flops, bandwidth):
    return ["compute" if f / b >= peak_flops / bandwidth else "memory"
            for f, b, t in points]


def wrong_short(points, peak_flops, bandwidth):  # forgets the last point
    return verdicts_ratio(points[:-1], peak_flops, bandwidth)


def wrong_words(points, peak_flops, bandwidth):
    return [("compute-bound" if v[0] == "compute" else "memory-bound", v[1])
            for v in verdicts_ratio(points, peak_flops, bandwidth)]


@pytest.mark.parametrize("fn, words", [
    (wrong_ridge_inverted, ["ridge point"]),
    (wrong_strictly_above, ["exactly at the ridge"]),
    (wrong_one_flop_per_byte, ["ridge point"]),
    (wrong_fraction_of_peak, ["fraction of the roof", "min(peak"]),
    (wrong_fraction_inverted, ["not its inverse"]),
    (wrong_min_not_max, ["fraction of the roof"]),
    (wrong_by_achieved_rate, ["ridge point"]),
    (wrong_bound_only, ["a pair (bound, fraction)"]),
    (wrong_short, ["one (bound, fraction) pair per point"]),
    (wrong_words, ['"compute" or "memory"']),
    (placeholder, ["placeholder"]),
])
def test_roofline_names_the_mistake(fn, words):
    fails(check_roofline_verdicts, fn, *words)
