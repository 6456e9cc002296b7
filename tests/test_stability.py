"""course_utils.stability: a check that changes its verdict on the same answer
is reported; a steady one is not."""

import textwrap

from course_utils import stability

CHAPTER = textwrap.dedent('''\
    # %% [markdown]
    # # A chapter

    # %%
    import itertools
    calls = itertools.count()
    from course_utils.exercises import is_placeholder

    # %% [markdown]
    # ## Exercises

    # %% tags=["exercise"] exercise="7.1"
    def double(x):
        ### BEGIN SOLUTION
        return 2 * x
        ### END SOLUTION

    # %% tags=["check"] exercise="7.1"
    assert not is_placeholder(double), "Exercise 7.1: still the placeholder"
    assert double(3) == 6

    # %% tags=["exercise"] exercise="7.2"
    def triple(x):
        ### BEGIN SOLUTION
        return 3 * x
        ### END SOLUTION

    # %% tags=["check"] exercise="7.2"
    assert not is_placeholder(triple), "Exercise 7.2: still the placeholder"
    assert triple(3) == 9 and next(calls) % 2 == 0  # a flaky check
    ''')


def test_steady_checks_pass_and_one_that_changes_its_verdict_is_reported(
        tmp_path, capsys):
    path = tmp_path / "07_demo.py"
    path.write_text(CHAPTER)
    code = stability.main(["--repeats", "3", str(path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "7.1: 3 x failed on the placeholder, 3 x passed on the solution" in out
    line = next(ln for ln in out.splitlines() if "7.2:" in ln)
    assert "NOT STEADY" in line and "'passed'" in line and "failed" in line
