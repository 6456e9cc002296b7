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
