"""The notebook gates.

- each chapter runs once under nbval as the learner notebook with every
  exercise solved right after its check: the checks fail on the placeholders
  (no check is vacuous), pass on the solutions, and every other cell passes;
  that nothing depends on an unsolved exercise is the build's lint;
- the committed notebooks are clean (no outputs, no execution counts);
- (the sync gate is in test_build.py; the exercise rules are enforced by the build)
"""

import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from course_utils import build
from course_utils.compare import Meter
from course_utils.grade import run_notebooks

CHAPTERS = build.chapter_sources()
BUDGET_S = 90  # a chapter's design budget is 60 s on a 2-core machine; 50% slack


@pytest.fixture(scope="session")
def gate_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gates")
    build.write_gate_notebooks(out)
    return out


def describe(cells):
    return "\n".join(f"cell {c.cell}: {c.message[-600:]}" for c in cells)


# caches with one fixed name per user, reused by every run: they do not pile up
CACHES = ("torchinductor_",)


def _left_in(folder, polls: int = 100) -> list[str]:
    """What is still in ``folder`` (a killed kernel's watchdog may lag a little)."""
    for _ in range(polls):
        left = sorted(p.name for p in folder.iterdir()
                      if not p.name.startswith(CACHES))
        if not left:
            break
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("source", CHAPTERS, ids=lambda p: p.stem)
def test_notebook_runs_and_each_check_fails_until_solved(source, gate_dir,
                                                         monkeypatch):
    """One run of the learner notebook, each exercise solved after its check.

    Every check fails on the placeholder and names its exercise (no check is
    vacuous); the solution then passes the same check; every other cell passes
    (the solution notebook's cells, in its order). The chapter's time budget is
    judged on this run.
    """
    # the notebook's processes are this one's children: their CPU seconds are
    # counted, and what the machine did besides is other programs' work
    # the notebook's temp directory, left empty: a short path, since the
    # socket a forkserver binds there may not exceed 107 bytes (pytest's own
    # temporary paths, under xdist's worker folders, come close)
    scratch = Path(tempfile.mkdtemp(prefix=f"gate{source.stem[:2]}-"))
    monkeypatch.setenv("TMPDIR", str(scratch))
    try:
        with Meter(quiet_cores=1.0) as run:
            cells = run_notebooks([gate_dir / f"{source.stem}.ipynb"])
        left = _left_in(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert cells, "nbval collected no cells"
    checks = [c for c in cells if "check" in c.tags]
    solved = [c for c in cells if "solved" in c.tags]
    assert checks, f"{source.stem} has no graded exercise"
    assert len(solved) == len(checks)
    vacuous = [c for c in checks if c.outcome != "failed"]
    assert not vacuous, ("check cells that pass with no solution (vacuous):\n"
                         + "\n".join(c.source for c in vacuous))
    for c in checks:
        assert f"Exercise {c.exercise}" in c.message and "placeholder" in c.message, (
            f"check {c.exercise} fails without naming the unsolved exercise:\n"
            + c.message)
    failed = [c for c in cells if "check" not in c.tags and c.outcome != "passed"]
    assert not failed, describe(failed)
    assert not left, f"{source.stem} left in the temp directory: {left}"
    took = (f"{source.stem} took {run.wall_s:.0f} s under nbval "
            f"({run.cpu_s:.0f} CPU s; other programs used "
            f"{run.others_cores or 0:.1f} cores meanwhile)")
    print(took)
    if run.wall_s >= BUDGET_S and run.disturbed:
        # a busy machine says nothing about the chapter's budget (ranks that
        # outlive the kernel are not counted as ours: hence a whole core)
        warnings.warn(f"time budget not judged: {took}", stacklevel=1)
        return
    assert run.wall_s < BUDGET_S, took


@pytest.mark.parametrize("source", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_graded_exercises(source):
    nb = build.jupytext.read(source, fmt="py:percent")
    exercises = build.lint(nb, int(source.name[:2]), source.name)
    assert len(exercises) >= 2


def test_committed_notebooks_are_clean():
    for path in sorted(build.NOTEBOOK_DIR.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            assert not cell.get("outputs"), f"{path.name} has outputs"
            assert cell.get("execution_count") is None, f"{path.name} was executed"
