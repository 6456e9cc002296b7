"""course_utils.exercises: the friendly failure and the check helpers."""

import pytest
import torch

from course_utils.exercises import (
    ExerciseFailed,
    call_learner,
    check_close,
    check_device,
    check_shape,
    check_type,
)


def test_failure_renders_short_message():
    e = ExerciseFailed("1.2", "4 sectors", "32 sectors", "read neighbours")
    lines = e._render_traceback_()
    assert "Exercise 1.2" in lines[0]
    assert any("expected: 4 sectors" in ln for ln in lines)
    assert any("hint:" in ln for ln in lines) and len(lines) == 4
    assert isinstance(e, AssertionError)


def test_call_learner_names_the_placeholder():
    def stub():
        raise NotImplementedError("Exercise 9.1")

    with pytest.raises(ExerciseFailed, match="placeholder"):
        call_learner("9.1", stub)


def test_call_learner_wraps_errors_with_hints():
    def broken(x):
        return x + torch.ones(2, device="meta")

    with pytest.raises(ExerciseFailed) as info:
        call_learner(
            "9.1",
            broken,
            torch.ones(2),
            hints={"not on the expected device": "move it"},
        )
    assert "RuntimeError" in info.value.seen and info.value.hint == "move it"


def test_call_learner_rejects_non_callable():
    with pytest.raises(ExerciseFailed, match="a function"):
        call_learner("9.1", 42)


def test_check_close_reports_largest_difference():
    a = torch.zeros(3, 3)
    b = a.clone()
    b[1, 2] = 1.0
    with pytest.raises(ExerciseFailed) as info:
        check_close("9.1", a, b)
    assert "(1, 2)" in info.value.seen
    check_close("9.1", b + 1e-9, b)


def test_check_close_numbers_and_types():
    check_close("9.1", 1.0, 1.0 + 1e-9)
    with pytest.raises(ExerciseFailed, match="a number"):
        check_close("9.1", "one", 1.0)
    with pytest.raises(ExerciseFailed, match="shape"):
        check_close("9.1", torch.zeros(2), torch.zeros(3))


def test_shape_dtype_device_checks():
    t = torch.zeros(2, 3)
    check_shape("9.1", t, (2, 3))
    with pytest.raises(ExerciseFailed):
        check_shape("9.1", t, (3, 2))
    with pytest.raises(ExerciseFailed):
        check_type("9.1", [1], torch.Tensor)
    check_device("9.1", t, "cpu")
    with pytest.raises(ExerciseFailed, match="meta"):
        check_device("9.1", t, "meta")
    check_device("9.1", torch.nn.Linear(2, 2), "cpu")


def test_placeholder_is_recognised_without_calling_it():
    from course_utils.exercises import is_placeholder, require_solution

    def stub(x):
        raise NotImplementedError("Exercise 4.1")

    def solved(x):
        return x + 1

    def raises_other(x):
        raise NotImplementedError("not on this backend")

    assert is_placeholder(stub)
    assert not is_placeholder(solved) and not is_placeholder(raises_other)
    assert not is_placeholder(print)
    with pytest.raises(ExerciseFailed, match="placeholder"):
        require_solution("4.1", stub)
    with pytest.raises(ExerciseFailed, match="a function"):
        require_solution("4.1", None)
    require_solution("4.1", solved)


def test_where_ranks_waited_names_the_collective_and_the_calling_line():
    from course_utils.exercises import where_ranks_waited

    text = ("ranks 0 and 1 did not finish within 30 s; all ranks were stopped.\n"
            "Where each unfinished rank was:\n"
            "  rank 0 was in (innermost first):\n"
            "    recv (distributed_c10d.py, line 2450)\n"
            "    wrapper (c10d_logger.py, line 81)\n"
            "    two_stage_step (3312.py, line 12)\n"
            "    _step_rank (ch07.py, line 200)\n"
            "  rank 1 was in (innermost first):\n"
            "    step (3312.py, line 30)\n"
            "  rank 2: no stack (it did not answer in time)")
    assert where_ranks_waited(text) == (
        "rank 0 waiting in recv (called from two_stage_step, line 12); "
        "rank 1 in step (line 30)")
    assert where_ranks_waited("rank 0 failed: ValueError") == ""


# --- the time an answer may take ----------------------------------------------


def _source_exercises() -> set[str]:
    import re

    from course_utils import build
    return {ex for source in build.chapter_sources() for ex in
            re.findall(r'exercise="(\d+\.\d+)"', source.read_text(encoding="utf-8"))}


def test_every_exercise_has_a_reference_time():
    from course_utils import exercises

    recorded = set(exercises.answer_times()["checks"])
    assert recorded == _source_exercises(), recorded ^ _source_exercises()
    assert all(s > 0 for s in exercises.answer_times()["checks"].values())


def test_a_hanging_answer_is_stopped_within_30_s_where_the_times_were_recorded():
    # the guarded part's limit, plus the work before it (at most the whole
    # reference check) and a collective's wait where a group gives up first
    from course_utils import exercises
    from course_utils.checks import ch09, ch10

    wait = {"9": ch09.WAIT_RATIO, "10": ch10.WAIT_RATIO}
    for ex, ref in exercises.answer_times()["checks"].items():
        limit = max(exercises.FLOOR_S, exercises.RATIO * ref)
        worst = ref + limit + wait.get(ex.split(".")[0], 0) * ref
        assert worst < 30, (ex, ref, worst)


def test_answer_limit_follows_the_machine_speed(monkeypatch):
    from course_utils import exercises

    probe = exercises.answer_times()["probe_s"]
    ref = exercises.reference_s("7.1")
    monkeypatch.setattr(exercises, "_SLOWDOWN", [])
    monkeypatch.setattr(exercises, "probe_s", lambda repeats=5: probe)
    quiet = exercises.answer_limit("7.1")
    want = max(exercises.FLOOR_S, exercises.RATIO * ref)
    assert quiet == pytest.approx(want, abs=0.1)
    monkeypatch.setattr(exercises, "_SLOWDOWN", [])
    monkeypatch.setattr(exercises, "probe_s", lambda repeats=5: 3 * probe)
    assert exercises.answer_limit("7.1") == pytest.approx(3 * quiet, rel=0.02)
    assert exercises.answer_limit("7.1", calls=4) == pytest.approx(
        3 * max(exercises.FLOOR_S, 4 * exercises.RATIO * ref), rel=0.02)
    monkeypatch.setenv("COURSE_SLOWDOWN", "2")
    assert exercises.answer_limit("7.1") == pytest.approx(6 * quiet, rel=0.02)
    with pytest.raises(KeyError, match="stability --record"):
        exercises.answer_limit("99.9")


def test_probe_measures_a_busy_core():
    # the probe runs in one thread: two busy processes per core slow it
    import os
    import subprocess
    import sys
    import time

    from course_utils import exercises

    quiet = exercises.probe_s()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)  # the spinners have started
        loaded = exercises.probe_s()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded > 1.3 * quiet, (quiet, loaded)
