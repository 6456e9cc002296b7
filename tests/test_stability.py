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


def test_record_times_each_solution_and_keeps_the_other_chapters(
        tmp_path, monkeypatch, capsys):
    import json

    from course_utils import exercises

    times = tmp_path / "answer_times.json"
    times.write_text(json.dumps({"probe_s": 0.01, "checks": {"1.1": 2.0}}))
    monkeypatch.setattr(exercises, "ANSWER_TIMES", times)
    monkeypatch.setattr(stability, "DISTURBED_CORES", float("inf"))  # any load
    steady = tmp_path / "07_steady.py"
    steady.write_text(CHAPTER.split("# %% tags=[\"exercise\"] exercise=\"7.2\"")[0])
    assert stability.main(["--record", str(steady)]) == 0, capsys.readouterr().out
    data = json.loads(times.read_text())
    assert set(data["checks"]) == {"1.1", "7.1"}
    assert 0 < data["checks"]["7.1"] < 30
    # the kept time is put on this run's scale: seconds per second of probe
    assert data["checks"]["1.1"] == stability.figures(2.0 / 0.01 * data["probe_s"])

    flaky = tmp_path / "07_demo.py"
    flaky.write_text(CHAPTER)
    before = times.read_text()
    assert stability.main(["--record", str(flaky)]) == 1
    assert "a solution failed its check (7.2)" in capsys.readouterr().out
    assert times.read_text() == before
