"""The grade report on a learner's notebook with typical answers."""

import json
import re
import subprocess
import sys
import textwrap
import time

from course_utils import build, grade

SOURCE = textwrap.dedent("""\
    # %%
    import time
    from course_utils.exercises import call_learner, check_close, passed
    """)
for k in range(1, 7):
    SOURCE += textwrap.dedent(f"""
    # %% tags=["exercise"] exercise="5.{k}"
    def answer():
        ### BEGIN SOLUTION
        return 2
        ### END SOLUTION

    # %% tags=["check"] exercise="5.{k}"
    check_close("5.{k}", call_learner("5.{k}", answer), 2, what="answer()")
    passed("5.{k}")
    """)

LEARNER_ANSWERS = {
    "5.1": "def answer():\n    return 2\n",  # right
    "5.2": "def answer():\n    return 'two'\n",  # wrong type
    "5.3": "def answer():\n    return 1 / 0\n",  # raises
    "5.4": "def answer():\n    return (\n",  # syntax error
    # 5.5 left as the stub
    # never returns:
    "5.6": "def answer():\n    while True:\n        time.sleep(0.05)\n",
}


def make_learner_notebook(tmp_path):
    src = tmp_path / "source"
    src.mkdir()
    (src / "05_demo.py").write_text(SOURCE)
    nbs = tmp_path / "notebooks"
    build.build(src, nbs, backup_dir=tmp_path / "b")
    path = nbs / "05_demo.ipynb"
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        ex = cell["metadata"].get("exercise")
        if "exercise" in cell["metadata"].get("tags", []) and ex in LEARNER_ANSWERS:
            cell["source"] = LEARNER_ANSWERS[ex]
    path.write_text(json.dumps(nb))
    return src, path


def cell_timeout() -> int:
    """A cell's time limit from this machine's speed now: ten times what a
    fresh interpreter takes to import the checkers (about 0.5 s quiet), at
    least 5 s, so a busy machine does not time out the cells that finish."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import course_utils.exercises"],
                   check=True)
    return max(5, round(10 * (time.perf_counter() - start)))


def test_report_names_each_typical_failure(tmp_path):
    src, path = make_learner_notebook(tmp_path)
    timeout = cell_timeout()
    cells = grade.run_notebooks([path], timeout=timeout)
    results = {r.exercise: r for r in grade.exercise_results(cells)}
    assert set(results) == {f"5.{k}" for k in range(1, 7)}
    assert results["5.1"].passed
    assert "a number" in results["5.2"].message and "str" in results["5.2"].message
    assert "ZeroDivisionError" in results["5.3"].message
    assert "exercise cell raised" in results["5.4"].message
    assert "SyntaxError" in results["5.4"].message
    assert "placeholder" in results["5.5"].message
    # the limit given, stretched by how much slower the machine runs now
    seconds = re.search(r"Timeout of (\d+) seconds", results["5.6"].message)
    assert seconds and int(seconds[1]) >= timeout, results["5.6"].message
    for r in results.values():  # short messages, no internal tracebacks
        assert "site-packages" not in r.message, r.message
    text, ok = grade.report(cells)
    assert not ok
    lines = text.splitlines()
    assert any(ln.split() == ["Exercise", "5.1", "passed"] for ln in lines)
    assert any(ln.split() == ["Exercise", "5.6", "FAILED"] for ln in lines)
    assert "score: 1/6" in text and "Traceback" not in text
    assert "total: 1/6 exercises passed" in text

    # the command's exit status: 0 for the solution notebook, 2 for a wrong path
    (solution,) = build.write_solutions(tmp_path / "sol", src)
    assert grade.main([str(solution)]) == 0
    assert grade.main([str(tmp_path / "nope.ipynb")]) == 2
