"""The checkers of Chapter 2 accept correct solutions and name typical mistakes.

Each exercise is checked with several correct solutions written in different
ways and with the usual wrong ones; a wrong one must fail with a message that
names its mistake.
"""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections import defaultdict
from itertools import pairwise
from time import perf_counter as clock

import numpy as np
import pytest
import torch

from course_utils.checks.ch02 import (
    check_measure,
    check_run_epoch,
    check_time_with_events,
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


def wrong_milliseconds(fn, sync):  # a CUDA-event habit: elapsed_time is in ms
    return measure_median(fn, sync) * 1000


@pytest.mark.parametrize("measure, words", [
    (wrong_milliseconds, ["milliseconds"]),
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


def epoch_running_mean(model, optimizer, batches, loss_fn):  # a running mean
    mean, n = None, 0
    for x, y in batches:
        loss = _step(model, optimizer, loss_fn, x, y).detach()
        n += 1
        mean = loss if mean is None else mean + (loss - mean) / n
    return float(mean)


@pytest.mark.parametrize("run_epoch", [epoch_detach_sum, epoch_stack, epoch_in_place,
                                       EpochRunner(), epoch_running_mean])
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


def events_median(stages, new_event, sync, rounds=5):  # pairwise, a defaultdict
    times = defaultdict(list)
    for r in range(-1, rounds):  # round -1 warms up
        marks = [new_event()]
        marks[0].record()
        for _, fn in stages:
            fn()
            marks.append(new_event())
            marks[-1].record()
        sync()
        if r >= 0:
            for (name, _), (a, b) in zip(stages, pairwise(marks), strict=True):
                times[name].append(a.elapsed_time(b) / 1000)
    return {n: statistics.median(times[n]) for n, _ in stages}


def events_end_synchronize(stages, new_event, sync, rounds=5):
    # waits on the last event instead of the whole device; a list of pairs
    names = [n for n, _ in stages]
    per_round = []
    for _ in range(rounds + 1):
        ev = [new_event()]
        ev[0].record()
        for _, fn in stages:
            fn()
            e = new_event()
            e.record()
            ev.append(e)
        ev[-1].synchronize()
        per_round.append([ev[k].elapsed_time(ev[k + 1]) * 1e-3
                          for k in range(len(names))])
    kept = per_round[1:]
    return {n: float(np.median([row[k] for row in kept]))
            for k, n in enumerate(names)}


class StageTimer:  # a class, events reused round after round
    def __init__(self, warmup=2):
        self.warmup = warmup

    def __call__(self, stages, new_event, sync, rounds=5):
        marks = [new_event() for _ in range(len(stages) + 1)]
        samples = {name: [] for name, _ in stages}
        for r in range(self.warmup + rounds):
            sync()  # a second wait per round is allowed
            marks[0].record()
            for k, (_, run) in enumerate(stages):
                run()
                marks[k + 1].record()
            sync()
            if r >= self.warmup:
                for k, (name, _) in enumerate(stages):
                    samples[name].append(marks[k].elapsed_time(marks[k + 1]) / 1e3)
        return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def events_mean_after_warmup(stages, new_event, sync, rounds=6):
    for _, fn in stages:  # warm every stage up first, on its own
        fn()
    sync()
    total = dict.fromkeys((n for n, _ in stages), 0.0)
    for _ in range(rounds):
        start = new_event()
        start.record()
        ends = []
        for _, fn in stages:
            fn()
            ends.append(new_event())
            ends[-1].record()
        sync()
        prev = start
        for (name, _), end in zip(stages, ends, strict=True):
            total[name] += prev.elapsed_time(end)
            prev = end
    return {n: torch.tensor(t / rounds / 1e3) for n, t in total.items()}


def events_median_no_warmup(stages, new_event, sync, rounds=7):
    # no warm-up round: the median leaves the slow first round out
    times = {name: [] for name, _ in stages}
    for _ in range(rounds):
        ev = [new_event() for _ in range(len(stages) + 1)]
        ev[0].record()
        for (_, fn), e in zip(stages, ev[1:], strict=True):
            fn()
            e.record()
        sync()
        for k, (name, _) in enumerate(stages):
            times[name].append(ev[k].elapsed_time(ev[k + 1]) / 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


@pytest.mark.parametrize("fn", [events_median, events_end_synchronize, StageTimer(),
                                StageTimer(warmup=1)])
def test_time_with_events_accepts_right_answers(fn, capsys):
    check_time_with_events(fn)
    assert "Exercise 2.3 passed" in capsys.readouterr().out


def wrong_host_clock(stages, new_event, sync, rounds=5):  # times the queueing
    times = {name: [] for name, _ in stages}
    for _ in range(rounds + 1):
        for name, fn in stages:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        sync()
    return {n: statistics.median(v[1:]) for n, v in times.items()}


def wrong_sync_every_stage(stages, new_event, sync, rounds=5):  # right numbers
    times = {name: [] for name, _ in stages}
    for _ in range(rounds + 1):
        for name, fn in stages:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(v[1:]) for n, v in times.items()}


def wrong_milliseconds(stages, new_event, sync, rounds=5):
    got = events_median(stages, new_event, sync, rounds)
    return {n: v * 1000 for n, v in got.items()}


def wrong_from_round_start(stages, new_event, sync, rounds=5):
    times = {name: [] for name, _ in stages}
    for r in range(rounds + 1):
        start = new_event()
        start.record()
        ends = []
        for _, fn in stages:
            fn()
            ends.append(new_event())
            ends[-1].record()
        sync()
        if r:
            for (name, _), end in zip(stages, ends, strict=True):
                times[name].append(start.elapsed_time(end) / 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def wrong_total_of_rounds(stages, new_event, sync, rounds=5):
    times = {name: 0.0 for name, _ in stages}
    for r in range(rounds + 1):
        ev = [new_event() for _ in range(len(stages) + 1)]
        ev[0].record()
        for (_, fn), e in zip(stages, ev[1:], strict=True):
            fn()
            e.record()
        sync()
        if r:
            for k, (name, _) in enumerate(stages):
                times[name] += ev[k].elapsed_time(ev[k + 1]) / 1e3
    return times


def wrong_mean_no_warmup(stages, new_event, sync, rounds=4):
    times = {name: [] for name, _ in stages}
    for _ in range(rounds):
        ev = [new_event() for _ in range(len(stages) + 1)]
        ev[0].record()
        for (_, fn), e in zip(stages, ev[1:], strict=True):
            fn()
            e.record()
        sync()
        for k, (name, _) in enumerate(stages):
            times[name].append(ev[k].elapsed_time(ev[k + 1]) / 1e3)
    return {n: statistics.mean(v) for n, v in times.items()}


def wrong_reads_before_waiting(stages, new_event, sync, rounds=5):
    times = {name: [] for name, _ in stages}
    for _ in range(rounds + 1):
        for name, fn in stages:
            a, b = new_event(), new_event()
            a.record()
            fn()
            b.record()
            times[name].append(a.elapsed_time(b) / 1e3)  # not reached yet
        sync()
    return {n: statistics.median(v[1:]) for n, v in times.items()}


def wrong_one_round(stages, new_event, sync, rounds=5):  # one run, no warm-up
    ev = [new_event() for _ in range(len(stages) + 1)]
    ev[0].record()
    for (_, fn), e in zip(stages, ev[1:], strict=True):
        fn()
        e.record()
    sync()
    return {name: ev[k].elapsed_time(ev[k + 1]) / 1e3
            for k, (name, _) in enumerate(stages)}


def wrong_reversed(stages, new_event, sync, rounds=5):
    return events_median(stages[::-1], new_event, sync, rounds)


def wrong_list(stages, new_event, sync, rounds=5):
    return list(events_median(stages, new_event, sync, rounds).values())


def wrong_constant(stages, new_event, sync, rounds=5):  # a guess, written down
    events_median(stages, new_event, sync, rounds)
    return {n: 0.02 for n, _ in stages}


_CACHE: dict = {}


def wrong_cached(stages, new_event, sync, rounds=5):  # results kept between calls
    key = tuple(n for n, _ in stages)
    if key not in _CACHE:
        _CACHE[key] = events_median(stages, new_event, sync, rounds)
    else:  # still runs the stages, to look busy
        for _ in range(rounds + 1):
            for _, fn in stages:
                fn()
            sync()
    return _CACHE[key]


def wrong_event_before_call(stages, new_event, sync, rounds=5):
    # the end event is recorded before the stage is called: each time is the
    # previous stage's work
    times = {name: [] for name, _ in stages}
    for r in range(rounds + 1):
        ev = [new_event() for _ in range(len(stages) + 1)]
        ev[0].record()
        for (_, fn), e in zip(stages, ev[1:], strict=True):
            e.record()
            fn()
        sync()
        if r:
            for k, (name, _) in enumerate(stages):
                times[name].append(ev[k].elapsed_time(ev[k + 1]) / 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


@pytest.mark.parametrize("fn, words", [
    (wrong_host_clock, ["less than the stage's work", "record an event"]),
    (wrong_sync_every_stage, ["one at every stage boundary"]),
    (wrong_milliseconds, ["MILLISECONDS"]),
    (wrong_from_round_start, ["since the round began"]),
    (wrong_total_of_rounds, ["the total of 5 rounds"]),
    (wrong_mean_no_warmup, ["no warm-up round"]),
    (wrong_reads_before_waiting, ["RuntimeError", "wait first"]),
    (wrong_one_round, ["at least 3 times"]),
    (wrong_reversed, ["in the order given"]),
    (wrong_list, ["a dict {stage name: seconds}"]),
    (wrong_constant, ["for stage"]),
    (wrong_cached, ["measured afresh"]),
    (wrong_event_before_call, ["record each stage's end event right after"]),
    (placeholder, ["placeholder"]),
])
def test_time_with_events_names_the_mistake(fn, words):
    fails(check_time_with_events, fn, *words)


@pytest.mark.parametrize("check", [check_measure, check_run_epoch,
                                   check_time_with_events])
def test_a_learner_that_never_returns_is_stopped(check, monkeypatch):
    from course_utils.checks import ch02

    monkeypatch.setattr(ch02, "answer_limit", lambda *a, **k: 0.5)

    def forever(*args):  # as good as for ever, here
        time.sleep(3)

    fails(check, forever, "within")


# Answers written by an adversary: new right ones, and wrong ones that passed
# before the checks were tightened (a constant or a cached result, state kept
# between epochs, the rounds argument ignored).

def _measure_np_float32(fn, sync):  # numpy's float32 is a number too
    fn()
    sync()
    times = []
    for _ in range(4):
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return np.float32(np.median(times))


_KEPT: list = []


def _measure_cached(fn, sync):  # measures once, then returns that for ever
    if not _KEPT:
        _KEPT.append(_measure_np_float32(fn, sync))
    return _KEPT[0]


def _measure_constant(fn, sync):  # runs the work, returns a guess
    for _ in range(4):
        fn()
        sync()
    return 0.012


def _measure_no_final_sync(fn, sync):
    fn()
    sync()
    start = clock()
    for _ in range(5):
        fn()
    return (clock() - start) / 5


def test_measure_accepts_numpy_float32(capsys):
    check_measure(_measure_np_float32)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("measure, words", [
    (_measure_cached, "nothing kept between calls"),
    (_measure_constant, "exactly what the previous run returned"),
    (_measure_no_final_sync, "only the time to QUEUE"),
])
def test_measure_names_more_mistakes(measure, words):
    fails(check_measure, measure, words)


_TOTAL = [0.0, 0]


def _epoch_global_total(model, optimizer, batches, loss_fn):  # kept across calls
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        _TOTAL[0] = _TOTAL[0] + loss.detach()
        _TOTAL[1] += 1
    return (_TOTAL[0] / _TOTAL[1]).item()


def _epoch_default_list(model, optimizer, batches, loss_fn, losses=[]):  # noqa: B006
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item()


def _epoch_stack_float64(model, optimizer, batches, loss_fn):
    losses = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return float(torch.stack(losses).double().mean())


def test_run_epoch_accepts_a_float64_mean(capsys):
    check_run_epoch(_epoch_stack_float64)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("run_epoch", [_epoch_global_total, _epoch_default_list])
def test_run_epoch_names_state_kept_between_calls(run_epoch, capsys):
    fails(check_run_epoch, run_epoch, "the previous epoch's losses")


def _events_fixed_rounds(stages, new_event, sync, rounds=5):  # ignores rounds
    times = {n: [] for n, _ in stages}
    for r in range(6):
        events = [new_event() for _ in range(len(stages) + 1)]
        events[0].record()
        for (_, f), end in zip(stages, events[1:], strict=True):
            f()
            end.record()
        sync()
        if r:
            for (n, _), a, b in zip(stages, events[:-1], events[1:], strict=True):
                times[n].append(a.elapsed_time(b) / 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def _events_poll_query(stages, new_event, sync, rounds=5):  # no sync: polls
    times = {n: [] for n, _ in stages}
    for r in range(rounds + 1):
        events = [new_event() for _ in range(len(stages) + 1)]
        events[0].record()
        for (_, f), end in zip(stages, events[1:], strict=True):
            f()
            end.record()
        while not events[-1].query():
            time.sleep(0.001)
        if r:
            for (n, _), a, b in zip(stages, events[:-1], events[1:], strict=True):
                times[n].append(a.elapsed_time(b) / 1e3)
    return {n: min(v) for n, v in times.items()}


def test_time_with_events_accepts_polling(capsys):
    check_time_with_events(_events_poll_query)
    assert "passed" in capsys.readouterr().out


def test_time_with_events_names_ignored_rounds():
    fails(check_time_with_events, _events_fixed_rounds, "use the rounds argument")


def _one_step(model, optimizer, x, y, loss_fn):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def _epoch_divides_by_8(model, optimizer, batches, loss_fn):  # a fixed count
    total = 0
    for x, y in batches:
        total = total + _one_step(model, optimizer, x, y, loss_fn).detach()
    return total.item() / 8


def _epoch_sum(model, optimizer, batches, loss_fn):
    total = 0
    for x, y in batches:
        total = total + _one_step(model, optimizer, x, y, loss_fn).detach()
    return total.item()


def _epoch_last_loss(model, optimizer, batches, loss_fn):
    for x, y in batches:
        loss = _one_step(model, optimizer, x, y, loss_fn)
    return loss.item()


def _epoch_nan_guard(model, optimizer, batches, loss_fn):  # an `if` per step
    total = 0
    for x, y in batches:
        loss = _one_step(model, optimizer, x, y, loss_fn)
        if torch.isnan(loss):
            break
        total = total + loss.detach()
    return total.item() / len(batches)


class _RunningMean:  # a class keeping a running mean on the device
    def __call__(self, model, optimizer, batches, loss_fn):
        mean = None
        for k, (x, y) in enumerate(batches, 1):
            loss = _one_step(model, optimizer, x, y, loss_fn).detach()
            mean = loss if mean is None else mean + (loss - mean) / k
        return float(mean)


def _epoch_loss_data(model, optimizer, batches, loss_fn):  # .data, then sum()
    losses = [_one_step(model, optimizer, x, y, loss_fn).data for x, y in batches]
    return sum(losses).item() / len(losses)


@pytest.mark.parametrize("run_epoch", [_RunningMean(), _epoch_loss_data])
def test_run_epoch_accepts_more_correct(run_epoch, capsys):
    check_run_epoch(run_epoch)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("run_epoch, words", [
    (_epoch_divides_by_8, "not a fixed number"),
    (_epoch_sum, "that is the sum"),
    (_epoch_last_loss, "the last step's loss"),
    (_epoch_nan_guard, "bool() or an if"),
])
def test_run_epoch_names_more_mistakes(run_epoch, words, capsys):
    fails(check_run_epoch, run_epoch, words)


# --- the mean, no warm-up and an off-by-one call count --------------------------


def _measure_off_by_one(fn, sync, calls=5):  # times 5 calls, divides by 6
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / (calls + 1)


def _measure_min_of_single_calls(fn, sync):  # the fastest of single calls
    fn()
    sync()
    best = math.inf
    for _ in range(4):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def test_measure_names_an_off_by_one_count():
    fails(check_measure, _measure_off_by_one, "less than the fastest call",
          "number of calls you timed")


def test_measure_accepts_the_fastest_single_call(capsys):
    check_measure(_measure_min_of_single_calls)
    assert "passed" in capsys.readouterr().out


def _events_trimmed_mean(stages, new_event, sync, rounds=5):  # drops the extremes
    times = {n: [] for n, _ in stages}
    for r in range(rounds + 1):
        ev = [new_event() for _ in range(len(stages) + 1)]
        ev[0].record()
        for (_, f), end in zip(stages, ev[1:], strict=True):
            f()
            end.record()
        sync()
        if r:
            for k, (n, _) in enumerate(stages):
                times[n].append(ev[k].elapsed_time(ev[k + 1]) / 1e3)
    return {n: statistics.mean(sorted(v)[1:-1]) for n, v in times.items()}


def _events_per_stage_records(stages, new_event, sync, rounds=5):
    # two events per stage (start and end), numpy's median
    got = {n: [] for n, _ in stages}
    for r in range(rounds + 1):
        pairs = []
        for _, f in stages:
            a, b = new_event(), new_event()
            a.record()
            f()
            b.record()
            pairs.append((a, b))
        sync()
        if r > 0:
            for (n, _), (a, b) in zip(stages, pairs, strict=True):
                got[n].append(a.elapsed_time(b) * 1e-3)
    return {n: float(np.median(v)) for n, v in got.items()}


@pytest.mark.parametrize("fn", [_events_trimmed_mean, _events_per_stage_records])
def test_time_with_events_accepts_more_right_answers(fn, capsys):
    check_time_with_events(fn)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("fn, words", [
    (events_mean_after_warmup, ["the mean of the rounds", "median"]),
    (events_median_no_warmup, ["no warm-up round"]),
])
def test_time_with_events_names_a_mean_and_a_missing_warm_up(fn, words):
    fails(check_time_with_events, fn, *words)


def _epoch_keeps_predictions(model, optimizer, batches, loss_fn):
    preds, total = [], 0.0  # kept "for an accuracy later", graphs and all
    for x, y in batches:
        optimizer.zero_grad()
        pred = model(x)
        preds.append(pred)
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        total = total + loss.detach()
    return total.item() / len(batches)


def _epoch_keeps_detached_predictions(model, optimizer, batches, loss_fn):
    preds, total = [], 0.0
    for x, y in batches:
        optimizer.zero_grad()
        pred = model(x)
        preds.append(pred.detach())
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        total = total + loss.detach()
    return total.item() / len(batches)


def test_run_epoch_names_kept_predictions(capsys):
    fails(check_run_epoch, _epoch_keeps_predictions, "outputs still holding",
          "pred.detach()")


def test_run_epoch_accepts_detached_predictions(capsys):
    check_run_epoch(_epoch_keeps_detached_predictions)
    assert "passed" in capsys.readouterr().out


def _measure_with_tub_timer(fn, sync):  # torch.utils.benchmark after a warm-up
    import torch.utils.benchmark as tub

    fn()
    sync()
    timer = tub.Timer("fn(); sync()", globals={"fn": fn, "sync": sync})
    return timer.blocked_autorange(min_run_time=0.05).median


def _events_from_round_start(stages, new_event, sync, rounds=5):
    """Each end event read from the round's start, then differenced."""
    rows = []
    for r in range(rounds + 1):
        ev = [new_event() for _ in range(len(stages) + 1)]
        ev[0].record()
        for (_, fn), end in zip(stages, ev[1:], strict=True):
            fn()
            end.record()
        sync()
        if r:
            since = [ev[0].elapsed_time(e) for e in ev[1:]]
            rows.append([b - a for a, b in pairwise([0.0, *since])])
    med = np.median(np.array(rows), axis=0) / 1e3
    return {n: float(m) for (n, _), m in zip(stages, med, strict=True)}


def test_measure_accepts_torch_utils_benchmark(capsys):
    check_measure(_measure_with_tub_timer)
    assert "passed" in capsys.readouterr().out


def test_time_with_events_accepts_differences_from_the_round_start(capsys):
    check_time_with_events(_events_from_round_start)
    assert "passed" in capsys.readouterr().out
