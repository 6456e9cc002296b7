"""Chapter 3's checkers: correct answers pass, typical mistakes fail by name."""

from __future__ import annotations

import time

import pytest

from course_utils.checks.ch03 import (
    check_choose_num_workers,
    check_consume_when_ready,
    check_overlap_fraction,
)
from course_utils.exercises import ExerciseFailed

# --- Exercise 3.1: fix the race ----------------------------------------------


def consume_wait(buffer, ready):
    ready.wait()
    return buffer.sum().item()


def consume_poll(buffer, ready):
    while not ready.is_set():
        time.sleep(0.001)
    return buffer.sum()  # a 0-d tensor is a number too


def consume_wait_timeout(buffer, ready):
    if not ready.wait(timeout=3.0):
        raise TimeoutError("producer never finished")
    return float(buffer.sum())


def consume_no_wait(buffer, ready):
    return buffer.sum().item()


def consume_short_sleep(buffer, ready):
    time.sleep(0.2)
    return buffer.sum().item()


def consume_long_sleep(buffer, ready):
    time.sleep(0.6)
    return buffer.sum().item()


def consume_returns_buffer(buffer, ready):
    ready.wait()
    return buffer


def consume_placeholder(buffer, ready):
    raise NotImplementedError("Exercise 3.1")


@pytest.mark.parametrize("fn", [consume_wait, consume_poll, consume_wait_timeout])
def test_consume_correct(fn, capsys):
    check_consume_when_ready(fn)
    assert "Exercise 3.1 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (consume_no_wait, "before the producer had written it"),
    (consume_short_sleep, "half written"),
    (consume_long_sleep, "fixed sleep waits too long"),
    (consume_returns_buffer, "as a number"),
    (consume_placeholder, "placeholder"),
])
def test_consume_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_consume_when_ready(fn)
    assert words in str(err.value)


# --- Exercise 3.2: overlap fraction ------------------------------------------


def overlap_sweep(spans):
    edges = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans])
    running, busy, last = 0, 0.0, None
    for t, step in edges:
        if running >= 2:
            busy += t - last
        running, last = running + step, t
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    return busy / total


def overlap_grid(spans, steps=20_000):
    """Another correct answer: sample the time axis finely (midpoints)."""
    t0, t1 = min(s[1] for s in spans), max(s[2] for s in spans)
    dt = (t1 - t0) / steps
    hits = 0
    for i in range(steps):
        t = t0 + (i + 0.5) * dt
        hits += sum(s[1] <= t < s[2] for s in spans) >= 2
    return hits / steps


def overlap_pieces(spans):
    """Another correct answer: cut time at every edge, count the busy pieces."""
    cuts = sorted({t for s in spans for t in (s[1], s[2])})
    busy = 0.0
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        if sum(s[1] < hi and s[2] > lo for s in spans) >= 2:
            busy += hi - lo
    return busy / (cuts[-1] - cuts[0])


def overlap_pairwise_sum(spans):
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    busy = sum(max(0.0, min(a[2], b[2]) - max(a[1], b[1]))
               for i, a in enumerate(spans) for b in spans[i + 1:])
    return busy / total


def overlap_first_two(spans):
    a, b = spans[0], spans[1]
    total = max(s[2] for s in spans) - min(s[1] for s in spans)
    return max(0.0, min(a[2], b[2]) - max(a[1], b[1])) / total


def overlap_over_busy_time(spans):
    edges = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans])
    running, busy, union, last = 0, 0.0, 0.0, None
    for t, step in edges:
        if running >= 2:
            busy += t - last
        if running >= 1:
            union += t - last
        running, last = running + step, t
    return busy / union


def overlap_from_zero(spans):
    edges = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans])
    running, busy, last = 0, 0.0, None
    for t, step in edges:
        if running >= 2:
            busy += t - last
        running, last = running + step, t
    return busy / max(s[2] for s in spans)


MEASURED = [("thread 1", 100.0, 100.05, "x"), ("thread 2", 100.01, 100.06, "y")]


@pytest.mark.parametrize("fn", [overlap_sweep, overlap_grid, overlap_pieces])
def test_overlap_correct(fn, capsys):
    check_overlap_fraction(fn, measured_spans=MEASURED)
    assert "Exercise 3.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (overlap_pairwise_sum, "counts once"),
    (overlap_first_two, "compare all spans"),
    (overlap_over_busy_time, "gaps"),
    (overlap_from_zero, "first start, not from 0"),
    (lambda spans: 0.5, "two spans running the whole time"),
])
def test_overlap_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_overlap_fraction(fn)
    assert words in str(err.value)


# --- Exercise 3.3: choose num_workers ----------------------------------------


def choose_min_within(epoch_times, tolerance=0.05):
    best = min(epoch_times.values())
    return min(k for k, t in epoch_times.items() if t <= best * (1 + tolerance))


def choose_sorted_scan(epoch_times, tolerance=0.05):
    best = min(epoch_times.values())
    for k in sorted(epoch_times):
        if epoch_times[k] / best - 1 <= tolerance + 1e-12:
            return k
    raise AssertionError("unreachable")


def choose_fastest(epoch_times, tolerance=0.05):
    return min(epoch_times, key=epoch_times.get)


def choose_most_workers(epoch_times, tolerance=0.05):
    return max(epoch_times)


def choose_absolute_tolerance(epoch_times, tolerance=0.05):
    best = min(epoch_times.values())
    return min(k for k, t in epoch_times.items() if t <= best + tolerance)


def choose_fixed_five_percent(epoch_times, tolerance=0.05):
    return choose_min_within(epoch_times, 0.05)


def choose_first_key(epoch_times, tolerance=0.05):
    best = min(epoch_times.values())
    for k, t in epoch_times.items():  # assumes the keys are in order
        if t <= best * (1 + tolerance):
            return k
    raise AssertionError("unreachable")


def choose_returns_time(epoch_times, tolerance=0.05):
    return min(epoch_times.values())


@pytest.mark.parametrize("fn", [choose_min_within, choose_sorted_scan])
def test_choose_correct(fn, capsys):
    check_choose_num_workers(fn, measured={0: 0.3, 1: 0.2, 2: 0.25})
    out = capsys.readouterr().out
    assert "Exercise 3.3 passed" in out and "it chooses 1" in out


@pytest.mark.parametrize("fn, words", [
    (choose_fastest, "fewest workers"),
    (choose_most_workers, "more workers can be slower"),
    (choose_absolute_tolerance, "relative"),
    (choose_fixed_five_percent, "`tolerance` argument"),
    (choose_first_key, "need not be in order"),
    (choose_returns_time, "not its epoch time"),
])
def test_choose_wrong(fn, words):
    with pytest.raises(ExerciseFailed) as err:
        check_choose_num_workers(fn)
    assert words in str(err.value)
