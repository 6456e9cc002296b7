"""Does every check give the same verdict each time it runs?

    python -m course_utils.stability                  # every chapter, 10 times
    python -m course_utils.stability --repeats 5 source/05_*.py

Each chapter runs once under nbval, as the test suite runs it, except that at
every exercise the four cells - the placeholder, its check, the solution, its
check - run ``repeats`` times in a row (``build.gate_notebook``). A check that
passes once and fails once, on the same answer, is flaky: a learner would be
told a right answer is wrong (or the reverse). The report gives one line per
exercise and the exit status is 1 when any check was flaky or wrong. For
instructors; run it while another program holds a core, as a learner's
laptop would.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from course_utils import build
from course_utils.compare import Meter
from course_utils.grade import run_notebooks


def verdicts(source: Path, repeats: int) -> tuple[dict[str, dict[str, list[str]]],
                                                   list[str]]:
    """Per exercise, the outcomes of its checks: ``{"placeholder": [...],
    "solution": [...]}``; and the other cells that failed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{source.stem}.ipynb"
        path.write_text(build.gate_notebook(source, repeats), encoding="utf-8")
        cells = run_notebooks([path])
    seen: dict[str, dict[str, list[str]]] = defaultdict(
        lambda: {"placeholder": [], "solution": []})
    others = []
    for c in cells:
        if "check" in c.tags:
            named = f"Exercise {c.exercise}" in c.message and "placeholder" in c.message
            seen[c.exercise]["placeholder"].append(
                "failed, naming it" if c.outcome == "failed" and named else c.outcome)
        elif "solved" in c.tags:
            seen[c.exercise]["solution"].append(
                c.outcome if c.outcome == "passed" else f"failed: {c.message[-200:]}")
        elif c.outcome != "passed":
            others.append(f"cell {c.cell}: {c.message[-300:]}")
    return dict(seen), others


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.stability",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", type=Path)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    ok = True
    for source in args.sources or build.chapter_sources():
        with Meter(quiet_cores=1.0) as run:
            seen, others = verdicts(source, args.repeats)
        print(f"{source.stem}: {run.wall_s:.0f} s, other programs used "
              f"{run.others_cores or 0:.1f} cores meanwhile")
        for ex, outcome in sorted(seen.items(), key=lambda kv: [
                int(x) for x in kv[0].split(".")]):
            steady = (outcome["placeholder"] == ["failed, naming it"] * args.repeats
                      and outcome["solution"] == ["passed"] * args.repeats)
            ok &= steady
            if steady:
                print(f"  {ex}: {args.repeats} x failed on the placeholder, "
                      f"{args.repeats} x passed on the solution")
            else:
                print(f"  {ex}: NOT STEADY placeholder {outcome['placeholder']}, "
                      f"solution {outcome['solution']}")
        for line in others:
            ok = False
            print(f"  another cell failed: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
