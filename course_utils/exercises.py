"""Checking exercises: the friendly failure and small checks to build on.

Introduced in Chapter 0. A chapter's checkers (in ``course_utils.checks``) call
the learner's function through ``call_learner`` and test *properties* of the
result with the helpers here, so every correct answer passes and each typical
mistake fails with a message that names it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from course_utils.errors import RED, RESET, FriendlyError

GREEN = "\x1b[32m"


class ExerciseFailed(FriendlyError, AssertionError):
    """A failed check: which exercise, what was expected, what was seen, a hint.

    In a notebook it shows as those few lines instead of a traceback; the cell
    still fails, so ``pytest --nbval`` and the grade report count it.
    """

    def __init__(self, exercise: str, expected: str, seen: str, hint: str = ""):
        self.exercise, self.expected, self.seen, self.hint = (
            exercise,
            expected,
            seen,
            hint,
        )
        super().__init__(self.message())

    def message(self) -> str:
        lines = [
            f"Exercise {self.exercise} is not solved yet.",
            f"  expected: {self.expected}",
            f"  seen:     {self.seen}",
        ]
        if self.hint:
            lines.append(f"  hint:     {self.hint}")
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        first, *rest = self.message().splitlines()
        return [f"{RED}{first}{RESET}", *rest]


def fail(exercise: str, expected: str, seen: str, hint: str = "") -> None:
    """Raise ``ExerciseFailed``: the one way a checker reports a mistake."""
    raise ExerciseFailed(exercise, expected, seen, hint)


def passed(exercise: str, note: str = "") -> None:
    """Print the line a learner sees when a check passes."""
    print(f"{GREEN}Exercise {exercise} passed.{RESET}" + (f" {note}" if note else ""))


def call_learner(
    exercise: str, fn: Callable, *args, hints: dict[str, str] | None = None, **kwargs
):
    """Call the learner's function; turn what it raises into a friendly failure.

    ``hints`` maps a piece of an error message to the hint shown when the
    learner's code raises an error containing it (a known typical mistake).
    """
    if not callable(fn):
        fail(
            exercise,
            "a function",
            f"{type(fn).__name__} {fn!r}",
            "run the exercise cell that defines it first",
        )
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        if str(e) and not str(e).startswith("Exercise"):  # torch's, not the stub
            _fail_raised(exercise, fn, e, hints)
        fail(
            exercise,
            "your solution in the exercise cell",
            "the placeholder `raise NotImplementedError`",
            "replace that line with your code and run the exercise cell again",
        )
    except ExerciseFailed:
        raise
    except Exception as e:  # the learner's code raised: name it, skip torch's internals
        _fail_raised(exercise, fn, e, hints)


def _fail_raised(exercise: str, fn: Callable, e: Exception, hints) -> None:
    """Report an error raised by the learner's code, with its line in their cell."""
    tb = e.__traceback__
    line = None
    while tb is not None:  # the last frame of the learner's own cell
        if tb.tb_frame.f_code.co_filename.startswith(
            ("<ipython-input", "/tmp/ipykernel")
        ):
            line = tb.tb_lineno
        tb = tb.tb_next
    where = f" (line {line} of the exercise cell)" if line else ""
    hint = next(
        (h for key, h in (hints or {}).items() if key in str(e)),
        "fix that error and run the exercise cell again",
    )
    first = str(e).splitlines()[0] if str(e) else ""
    fail(
        exercise,
        f"{getattr(fn, '__name__', 'your function')} to run",
        f"it raised {type(e).__name__}: {first}{where}",
        hint,
    )


def check_type(exercise: str, value, kind: type | tuple, what: str = "the result"):
    """Fail unless ``value`` is an instance of ``kind``."""
    if not isinstance(value, kind):
        names = (
            " or ".join(k.__name__ for k in kind)
            if isinstance(kind, tuple)
            else kind.__name__
        )
        fail(
            exercise,
            f"{what} to be a {names}",
            f"a {type(value).__name__}: {value!r:.80}",
        )
    return value


def check_shape(exercise: str, t: torch.Tensor, shape, what: str = "the result"):
    """Fail unless tensor ``t`` has exactly ``shape``."""
    check_type(exercise, t, torch.Tensor, what)
    if tuple(t.shape) != tuple(shape):
        fail(exercise, f"{what} of shape {tuple(shape)}", f"shape {tuple(t.shape)}")
    return t


def check_dtype(exercise: str, t: torch.Tensor, dtype: torch.dtype, what="the result"):
    """Fail unless tensor ``t`` has ``dtype``."""
    check_type(exercise, t, torch.Tensor, what)
    if t.dtype != dtype:
        fail(exercise, f"{what} of dtype {dtype}", f"dtype {t.dtype}")
    return t


def check_device(
    exercise: str, t, device: torch.device | str, what="the result", hint: str = ""
):
    """Fail unless ``t`` (a tensor or a module's parameters) is on ``device``."""
    device = torch.device(device)
    if isinstance(t, torch.nn.Module):
        seen = {p.device for p in t.parameters()} or {torch.device("cpu")}
    else:
        seen = {check_type(exercise, t, torch.Tensor, what).device}
    same = all(d.type == device.type and device.index in (None, d.index) for d in seen)
    if not same:
        fail(
            exercise,
            f"{what} on {device}",
            f"on {', '.join(map(str, sorted(seen, key=str)))}",
            hint or "move it with .to(device)",
        )
    return t


def check_close(
    exercise: str,
    seen,
    expected,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    what: str = "the result",
    hint: str = "",
):
    """Fail unless ``seen`` equals ``expected`` within the tolerances.

    Numbers or tensors; tensors are compared on the CPU after a shape check,
    and the message shows the largest difference and where it is.
    """
    if isinstance(expected, torch.Tensor):
        check_shape(exercise, seen, expected.shape, what)
        a, b = seen.detach().cpu().double(), expected.detach().cpu().double()
        if not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            diff = (a - b).abs().nan_to_num(float("inf"))
            idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            fail(
                exercise,
                f"{what} equal to the reference (rtol={rtol}, atol={atol})",
                f"a largest difference of {diff.max().item():.3g} at index {idx}: "
                f"{a[idx].item():.6g} instead of {b[idx].item():.6g}",
                hint,
            )
        return seen
    try:
        value = float(seen)
    except (TypeError, ValueError):
        fail(
            exercise, f"{what} to be a number", f"a {type(seen).__name__}: {seen!r:.80}"
        )
    if not abs(value - float(expected)) <= atol + rtol * abs(float(expected)):
        fail(exercise, f"{what} = {float(expected):.6g}", f"{value:.6g}", hint)
    return seen


def is_placeholder(fn) -> bool:
    """True when ``fn`` is still the exercise's stub (``raise NotImplementedError``).

    Looks at the function's code, not by calling it: an expensive checker (one
    that starts processes, say) can say "not solved yet" at once.
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    consts = [c for c in code.co_consts if isinstance(c, str)]
    return "NotImplementedError" in code.co_names and any(
        c.startswith("Exercise ") for c in consts
    )


def require_solution(exercise: str, fn) -> None:
    """Fail at once, kindly, when ``fn`` is missing or still the stub."""
    if not callable(fn):
        fail(exercise, "a function", f"{type(fn).__name__} {fn!r:.60}",
             "run the exercise cell that defines it first")
    if is_placeholder(fn):
        fail(exercise, "your solution in the exercise cell",
             "the placeholder `raise NotImplementedError`",
             "replace that line with your code and run the exercise cell again")


# --- how long an answer may take -------------------------------------------------
#
# A check that runs the learner's code guards it with a time limit, so an answer
# that hangs still gets its verdict. Each limit is derived from the reference
# solution's own run: ``python -m course_utils.stability --record`` times every
# solution's check on a quiet machine and stores those seconds, with the time a
# fixed probe took there, in course_utils/answer_times.json. Here the probe is
# timed again, so a slower or busier machine gets a proportionally longer limit.

ANSWER_TIMES = Path(__file__).parent / "answer_times.json"
RATIO = 2.5  # an answer may take this many times the reference's whole check
FLOOR_S = 5.0  # and never less: starting processes and imports vary most
_SLOWDOWN: list[float] = []  # [when measured, value]
_SLOWDOWN_AGE_S = 20.0  # remeasured after this long: the load on a machine changes


def _probe_once() -> float:
    # plain Python: no torch call, which a checker's dispatch mode would see
    start = time.perf_counter()
    total, items = 0, {}
    for i in range(120_000):
        total += i % 7
        items[i & 255] = total
    return time.perf_counter() - start


def probe_s(repeats: int = 5) -> float:
    """Seconds a fixed piece of plain Python work takes here, now.

    The median of ``repeats`` runs of about 15 ms each, after one to warm up;
    one thread, so it measures the share of a core a busy machine leaves as
    well as the machine's speed.
    """
    _probe_once()
    return statistics.median(_probe_once() for _ in range(repeats))


def answer_times() -> dict:
    """The recorded reference times: ``{"probe_s": ..., "checks": {"7.1": s, ...}}``."""
    return json.loads(ANSWER_TIMES.read_text(encoding="utf-8"))


def slowdown() -> float:
    """How many times slower this machine runs now than the one the reference
    times were recorded on (at least 0.5); remeasured after 20 s.

    ``COURSE_SLOWDOWN`` in the environment multiplies it (a learner's shared
    cluster node, say).
    """
    now = time.monotonic()
    if not _SLOWDOWN or now - _SLOWDOWN[0] > _SLOWDOWN_AGE_S:
        value = max(0.5, probe_s() / answer_times()["probe_s"])
        _SLOWDOWN[:] = [now, value]
    return _SLOWDOWN[1] * float(os.environ.get("COURSE_SLOWDOWN", "1") or 1)


def reference_s(exercise: str) -> float:
    """Seconds the reference solution's whole check took where it was recorded."""
    checks = answer_times()["checks"]
    if exercise not in checks:
        raise KeyError(f"no reference time recorded for Exercise {exercise}: run "
                       "python -m course_utils.stability --record on a quiet machine")
    return float(checks[exercise])


def answer_limit(exercise: str, calls: int = 1, ratio: float = RATIO) -> float:
    """Seconds one guarded part of ``exercise``'s check may take on this machine now.

    ``ratio`` times the reference solution's whole check, times ``calls`` (the
    answers checked in one go, as the tests do), scaled by ``slowdown()``, and
    at least ``FLOOR_S`` scaled the same way. On a quiet 2-core machine an
    answer that never returns gets its verdict within 30 s.
    """
    return round(max(FLOOR_S, ratio * reference_s(exercise) * calls) * slowdown(), 1)


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in this thread after ``seconds`` (main thread, POSIX).

    Checkers of Chapters 11-13 call the learner's function inside it, so an
    answer that never returns gets its verdict; elsewhere it does nothing.
    """
    usable = (hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


NEVER_RETURNED = "your function did not return: look for a loop that never ends"


def call_in_time(exercise: str, fn: Callable, *args,
                 hints: dict[str, str] | None = None):
    """``call_learner`` within ``answer_limit(exercise)`` (``time_limit``), an
    answer that never returns told so."""
    with time_limit(answer_limit(exercise)):
        return call_learner(exercise, fn, *args,
                            hints={"took longer than": NEVER_RETURNED, **(hints or {})})


_FRAME = re.compile(r"^\s+(\S+) \((\S+), line (\d+)\)$", re.M)
_DIST_FILES = ("distributed_c10d.py", "c10d_logger.py")


def where_ranks_waited(error: BaseException | str) -> str:
    """One line from a launch timeout's stacks: what each unfinished rank was doing.

    ``"rank 0 waiting in recv (called from two_stage_step, line 12); rank 1 in
    step (line 30)"``: the collective a rank was blocked in, and the learner's
    line that called it; else the innermost frame. Empty if no stack was sent.
    """
    parts = []
    for rank, frames in re.findall(r"rank (\d+) was in \(innermost first\):\n"
                                   r"((?:    .*(?:\n|$))*)", str(error)):
        names = _FRAME.findall(frames)
        in_dist = [i for i, (_, file, _) in enumerate(names) if file in _DIST_FILES]
        if in_dist:
            caller = next((f"called from {fn}, line {line}" for fn, file, line
                           in names[in_dist[0]:] if file not in _DIST_FILES), "")
            parts.append(f"rank {rank} waiting in {names[in_dist[0]][0]}"
                         + (f" ({caller})" if caller else ""))
        elif names:
            parts.append(f"rank {rank} in {names[0][0]} (line {names[0][2]})")
    return "; ".join(parts)


def stuck(error: BaseException | str) -> str:
    """A launch timeout in one line: its first line, then what each unfinished
    rank was doing (``where_ranks_waited``), when the stacks say."""
    where = where_ranks_waited(error)
    first = (str(error).splitlines() or [""])[0]
    return first + (f": {where}" if where else "")
