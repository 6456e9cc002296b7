"""Checkers for Chapter 3 ("Streams and asynchronous execution").

They run on any machine: the race is the CPU analogue (a producer thread and
an event), and the other two exercises compute from spans and epoch times,
so they are checked with hand-made inputs whose answers are known.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from course_utils.exercises import call_learner, check_close, check_type, fail, passed

# How late after ``ready.set()`` a consumer may return (thread wake-up on a
# loaded machine takes milliseconds; a fixed sleep is off by much more).
LATE_S = 0.15
TIMEOUT_S = 5.0


def _run_with_timeout(exercise: str, fn: Callable, *args):
    """Call the learner's ``fn`` in a thread; fail if it does not return in time."""
    out: dict = {}

    def target():
        try:
            out["value"] = call_learner(exercise, fn, *args)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e
        out["returned_at"] = time.perf_counter()

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    if worker.is_alive():
        fail(exercise, f"your function to return within {TIMEOUT_S:.0f} s",
             "it was still running (waiting for something that never happens?)",
             "wait on the `ready` event the function is given")
    if "error" in out:
        raise out["error"]
    return out["value"], out["returned_at"]


def check_consume_when_ready(fn: Callable) -> None:
    """Exercise 3.1: read a buffer only after its producer set the event.

    Producers of different durations fill the buffer in two halves and then
    set the event; the result must be the full sum, returned soon after.
    """
    ex = "3.1"
    n = 1000
    for delay, value in ((0.3, 2.0), (0.0, 1.0), (0.12, 3.0)):
        buffer, ready = torch.zeros(n), threading.Event()
        set_at: list[float] = []

        def produce(buffer=buffer, ready=ready, delay=delay, value=value,
                    set_at=set_at):
            time.sleep(delay / 2)
            buffer[: n // 2].fill_(value)
            time.sleep(delay / 2)
            buffer[n // 2:].fill_(value)
            set_at.append(time.perf_counter())
            ready.set()

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        seen, returned_at = _run_with_timeout(ex, fn, buffer, ready)
        producer.join(TIMEOUT_S)
        expected = n * value
        try:
            got = float(seen)
        except (TypeError, ValueError):
            fail(ex, "the sum of the buffer as a number",
                 f"a {type(seen).__name__}: {seen!r:.80}",
                 "return buffer.sum().item() (or a 0-d tensor)")
        if got != expected:
            if got == 0.0:
                what = "0: the buffer was read before the producer had written it"
            elif 0 < got < expected:
                what = f"{got:g}: the buffer was read while it was half written"
            else:
                what = f"{got:g}"
            fail(ex, f"{expected:g} (the producer took {delay:.2f} s)", what,
                 "this is the race: wait for the producer's event before reading; "
                 "a fixed sleep is too short for a slower producer")
        late = returned_at - set_at[0]
        if late > LATE_S:
            fail(ex, f"to return soon after the producer finished (within {LATE_S} s)",
                 f"returned {late:.2f} s after `ready` was set "
                 f"(producer took {delay:.2f} s)",
                 "a fixed sleep waits too long for a fast producer: wait on the event")
    passed(ex, "The consumer waits for exactly what it needs, like "
               "stream.wait_event(event) on a GPU.")


# (spans, expected fraction, hint shown when this case is wrong)
_OVERLAP_CASES: list[tuple[list[tuple], float, str]] = [
    ([("a", 0.0, 2.0), ("b", 0.0, 2.0)], 1.0,
     "two spans running the whole time overlap for all of it"),
    ([("a", 0.0, 1.0), ("b", 1.0, 2.0)], 0.0,
     "spans that only touch (one ends when the next starts) do not overlap"),
    ([("a", 0.0, 1.0), ("a", 1.0, 2.0), ("a", 2.0, 3.0)], 0.0,
     "spans one after the other do not overlap"),
    ([("a", 10.0, 12.0), ("b", 11.0, 13.0)], 1 / 3,
     "times may come from any clock: measure from the first start, not from 0"),
    ([("b", 2.0, 5.0, "x"), ("a", 0.0, 3.0, "y")], 1 / 5,
     "spans come in any order (sort them) and may carry a label"),
    ([("a", 0.0, 10.0), ("b", 1.0, 2.0), ("c", 5.0, 6.0)], 0.2,
     "a long span can overlap several others: compare all spans, not neighbours "
     "or the first two"),
    ([("a", 0.0, 4.0), ("b", 1.0, 2.0), ("c", 1.5, 3.0)], 0.5,
     "time when three spans run at once counts once, not once per pair"),
    ([("a", 0.0, 1.0), ("b", 0.5, 1.0), ("a", 3.0, 4.0)], 0.125,
     "divide by the wall-clock time from the first start to the last end, gaps "
     "included, not by the time something was running"),
]


def check_overlap_fraction(fn: Callable, measured_spans: Sequence[tuple] | None = None
                           ) -> None:
    """Exercise 3.2: the fraction of wall-clock time with two or more spans running."""
    ex = "3.2"
    for spans, expected, hint in _OVERLAP_CASES:
        seen = call_learner(ex, fn, [tuple(s) for s in spans])
        shown = ", ".join(str(s) for s in spans)
        check_close(ex, seen, expected, rtol=1e-3, atol=1e-6,
                    what=f"overlap_fraction([{shown}])", hint=hint)
    note = ""
    if measured_spans:
        value = float(check_type(ex, call_learner(ex, fn, list(measured_spans)),
                                 (float, int, torch.Tensor)))
        if not 0.0 <= value <= 1.0:
            fail(ex, "a fraction between 0 and 1 for the threads measured above",
                 f"{value:g}")
        note = (f"The two threads measured above overlapped for {value:.0%} "
                "of their run.")
    passed(ex, note)


# (epoch times, tolerance, expected choice, hint shown when this case is wrong)
_WORKER_CASES: list[tuple[dict[int, float], float, int, str]] = [
    ({0: 3.0, 1: 2.0, 2: 1.5}, 0.05, 2,
     "choose the fastest when nothing else is close"),
    ({0: 1.0, 1: 1.3, 2: 1.4}, 0.05, 0,
     "more workers can be slower (few cores, a loaded machine): go by the times"),
    ({0: 3.0, 1: 2.0, 2: 1.95}, 0.05, 1,
     "1 worker is within 5% of the fastest: take the fewest workers that are"),
    ({4: 1.0, 2: 1.02, 8: 0.99}, 0.05, 2,
     "the keys need not be in order or start at 0"),
    ({0: 100.0, 1: 60.0, 2: 58.0}, 0.05, 1,
     "the tolerance is relative: within fastest * (1 + tolerance), not fastest + "
     "tolerance"),
    ({0: 3.0, 1: 2.0, 2: 1.95}, 0.0, 2,
     "use the `tolerance` argument: 0 means the fastest"),
    ({0: 3.0, 1: 2.0, 2: 1.5}, 0.5, 1, "use the `tolerance` argument, not a fixed 5%"),
]


def check_choose_num_workers(fn: Callable, measured: dict[int, float] | None = None
                             ) -> None:
    """Exercise 3.3: the fewest workers whose epoch time is near the fastest."""
    ex = "3.3"
    for times, tol, expected, hint in _WORKER_CASES:
        seen = call_learner(ex, fn, dict(times), tolerance=tol)
        if isinstance(seen, bool) or not isinstance(seen, int):
            fail(ex, "a number of workers (an int, one of the dict's keys)",
                 f"a {type(seen).__name__}: {seen!r:.80}",
                 "return the key (num_workers), not its epoch time")
        if seen != expected:
            fail(ex, f"choose_num_workers({times}, tolerance={tol}) == {expected}",
                 str(seen), hint)
    note = ""
    if measured:
        choice = call_learner(ex, fn, dict(measured), tolerance=0.05)
        shown = ", ".join(f"{k}: {v:.3f} s" for k, v in measured.items())
        note = f"For the epochs measured above ({shown}) it chooses {choice}."
    passed(ex, note)
