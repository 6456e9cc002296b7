"""The grade report: run notebooks under nbval, one line per exercise, a score.

    python -m course_utils.grade                      # every notebook in notebooks/
    python -m course_utils.grade notebooks/00_*.ipynb # some of them

Each notebook runs top to bottom in a fresh kernel, exactly as
``pytest --nbval`` runs it. The report then names every exercise, passed or
not, with the checker's short message, and gives a score per chapter and in
all. The exit status is 1 when anything failed. Introduced in Chapter 0.

The same runner serves the test suite's notebook gates: ``run_notebooks``
returns every cell's outcome as plain data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPORT_ENV = "COURSE_NBVAL_REPORT"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
DEFAULT_TIMEOUT = 120  # seconds a single cell may run before it counts as hung
STARTUP_S = 120  # seconds a fresh kernel may take to answer (nbval's own is 60)


@dataclass
class CellOutcome:
    notebook: str
    cell: int
    outcome: str  # "passed", "failed" or "skipped"
    tags: list[str]
    exercise: str | None
    message: str
    source: str
    seconds: float = 0.0  # how long the cell ran


# --- pytest plugin: loaded into the nbval run with -p course_utils.grade --------


def _message(excinfo) -> str:
    exc = excinfo.value
    text = getattr(exc, "inner_traceback", None) or str(exc)
    if "Timeout of" in str(exc):  # the interrupted traceback would only confuse
        return f"{exc} (an endless loop, or a wait that never ends?)"
    return ANSI.sub("", text).strip()


def _record(item, report, excinfo) -> None:
    path = os.environ.get(REPORT_ENV)
    cell = getattr(item, "cell", None)
    if not path or cell is None:
        return
    meta = cell.get("metadata", {})
    row = {
        "notebook": str(item.fspath),
        "cell": int(getattr(item, "cell_num", -1)),
        "outcome": report.outcome,
        "tags": list(meta.get("tags", [])),
        "exercise": meta.get("exercise"),
        "source": cell.source,
        "message": _message(excinfo) if report.failed and excinfo else "",
        "seconds": round(float(getattr(report, "duration", 0.0)), 3),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "call" or (report.when == "setup" and not report.passed):
            _record(item, report, call.excinfo)
except ImportError:  # pragma: no cover - pytest is in requirements.txt
    pass


# --- running notebooks ----------------------------------------------------------


def run_notebooks(
    paths: list[Path | str], timeout: int = DEFAULT_TIMEOUT, quiet: bool = True
) -> list[CellOutcome]:
    """Run notebooks under ``pytest --nbval``; return every code cell's outcome.

    Both limits, a cell's ``timeout`` and a kernel's start, are seconds on a
    quiet machine: a busy one stretches them by how much slower it runs now
    (``exercises.slowdown``), so a loaded laptop is not told its cell hung.
    """
    from course_utils.exercises import slowdown

    stretch = max(1.0, slowdown())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cells.jsonl"
        env = dict(os.environ, **{REPORT_ENV: str(report)})
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "--nbval",
            "--nbval-current-env",
            f"--nbval-cell-timeout={round(timeout * stretch)}",
            f"--nbval-kernel-startup-timeout={round(STARTUP_S * stretch)}",
            "-p",
            "course_utils.grade",
            "-p",
            "no:cacheprovider",
            "-q",
            "-o",
            "addopts=",
            "--rootdir",
            str(Path(tmp)),
            *map(str, paths),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=quiet, text=True)
        rows = (
            [json.loads(line) for line in report.read_text().splitlines()]
            if report.exists()
            else []
        )
    if not rows and proc.returncode not in (0, 1):
        out = (proc.stdout or "") + (proc.stderr or "")
        raise RuntimeError(
            f"nbval did not run (exit {proc.returncode}):\n{out[-2000:]}"
        )
    return [CellOutcome(**r) for r in rows]


@dataclass
class ExerciseResult:
    notebook: str
    exercise: str
    passed: bool
    message: str


def exercise_results(cells: list[CellOutcome]) -> list[ExerciseResult]:
    """One result per exercise, judged by its check cell.

    When the exercise cell itself failed (a syntax error, say), its message is
    reported: it explains the failed check better than the check does.
    """
    results, broken = [], {}
    for c in cells:
        if c.exercise is None:
            continue
        if "exercise" in c.tags and c.outcome == "failed":
            broken[(c.notebook, c.exercise)] = c.message
        elif "check" in c.tags:
            msg = c.message
            if (c.notebook, c.exercise) in broken:
                msg = (
                    "your exercise cell raised an error:\n"
                    + broken[(c.notebook, c.exercise)]
                )
            elif c.outcome == "skipped":
                msg = (
                    "not graded: an earlier cell did not finish in time, so nbval "
                    "stopped trusting the kernel; fix that one and grade again"
                )
            results.append(
                ExerciseResult(c.notebook, str(c.exercise), c.outcome == "passed", msg)
            )
    return results


def report(cells: list[CellOutcome]) -> tuple[str, bool]:
    """The printed report, and whether everything passed."""
    lines, all_ok = [], True
    by_nb: dict[str, list[CellOutcome]] = {}
    for c in cells:
        by_nb.setdefault(c.notebook, []).append(c)
    total = done = 0
    for nb, nb_cells in by_nb.items():
        results = exercise_results(nb_cells)
        others = [
            c
            for c in nb_cells
            if c.outcome == "failed" and not ({"check", "exercise"} & set(c.tags))
        ]
        lines.append(f"{Path(nb).name}")
        for r in results:
            mark = "passed" if r.passed else "FAILED"
            lines.append(f"  Exercise {r.exercise:<6} {mark}")
            if not r.passed:
                lines += ["      " + ln for ln in r.message.splitlines()[:8]]
        for c in others:
            all_ok = False
            first = c.message.splitlines()[-1] if c.message else "failed"
            lines.append(f"  cell {c.cell} (not an exercise) FAILED: {first}")
        ok = sum(r.passed for r in results)
        total, done = total + len(results), done + ok
        all_ok = all_ok and ok == len(results)
        lines.append(f"  score: {ok}/{len(results)}")
    lines.append(f"total: {done}/{total} exercises passed")
    return "\n".join(lines), all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.grade", description="Grade your exercises."
    )
    parser.add_argument(
        "notebooks",
        nargs="*",
        type=Path,
        help="notebooks to grade (default: all of notebooks/)",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT,
        help="seconds a cell may run before it counts as hung",
    )
    args = parser.parse_args(argv)
    from course_utils.build import NOTEBOOK_DIR

    paths = args.notebooks or sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"no such notebook: {', '.join(map(str, missing))}")
        return 2
    print(
        f"grading {len(paths)} notebook(s); each runs top to bottom in a fresh kernel"
    )
    text, ok = report(run_notebooks(paths, timeout=args.timeout))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
