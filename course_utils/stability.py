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

``--record`` runs each check once instead and writes what every solution's
check took, with ``exercises.probe_s()`` timed around the run, to
``course_utils/answer_times.json``: the times the checkers'
limits for a learner's answer are derived from (``exercises.answer_limit``).
Record on a quiet machine; a run that other programs disturbed is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from course_utils import build, exercises
from course_utils.compare import Meter
from course_utils.grade import run_notebooks


def verdicts(source: Path, repeats: int, times: dict | None = None
             ) -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """Per exercise, the outcomes of its checks: ``{"placeholder": [...],
    "solution": [...]}``; and the other cells that failed. ``times``, if given,
    collects each solution check's seconds per exercise."""
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
            if times is not None and c.outcome == "passed":
                times.setdefault(c.exercise, []).append(c.seconds)
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
    parser.add_argument("--record", action="store_true",
                        help="time each solution's check once, on a quiet machine, "
                             "and store the times the checkers' limits derive from")
    args = parser.parse_args(argv)
    if args.record:
        return record(args.sources)
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


DISTURBED_CORES = 1.0  # other programs' use above which a recording is refused
SLOW_PROBE = 1.25  # a chapter's probe this much slower than the run's: scaled


def figures(seconds: float) -> float:
    """Three significant figures: a check of a few milliseconds keeps its
    time instead of rounding to zero."""
    return float(f"{seconds:.3g}")


def record(sources: list[Path]) -> int:
    """Time every solution's check (the slowest of 3 runs: the first carries
    one-time costs, a cache filled or a process pool started) and store them.

    The probe is timed before and after each chapter; the median over the
    run is stored with the times. A chapter whose probe ran more than
    ``SLOW_PROBE`` times slower than that median (something else ran) has its
    times scaled down by as much, so a recording tolerates a little load.
    """
    times: dict[str, tuple[float, float]] = {}  # exercise: (seconds, probe)
    probes = []
    for source in sources or build.chapter_sources():
        before = exercises.probe_s(9)
        runs: dict[str, list[float]] = {}
        with Meter(quiet_cores=1.0) as run:
            seen, others = verdicts(source, 3, runs)
        probe = statistics.median([before, exercises.probe_s(9)])
        probes.append(probe)
        print(f"{source.stem}: {run.wall_s:.0f} s, other programs used "
              f"{run.others_cores or 0:.1f} cores meanwhile, "
              f"probe {probe * 1e3:.1f} ms")
        if (run.others_cores or 0) > DISTURBED_CORES or others:
            print("  disturbed or failing: nothing recorded; run it on a quiet machine",
                  *others, sep="\n  ")
            return 1
        missing = [ex for ex, o in seen.items() if o["solution"] != ["passed"] * 3]
        if missing:
            print(f"  a solution failed its check ({', '.join(missing)}): "
                  "nothing recorded")
            return 1
        times.update({ex: (max(s), probe) for ex, s in runs.items()})
    scale = figures(statistics.median(probes))  # as stored: the file agrees with itself
    old = (json.loads(exercises.ANSWER_TIMES.read_text())
           if exercises.ANSWER_TIMES.exists() else {"checks": {}})
    # all on one scale: seconds per second of probe; earlier chapters kept
    checks = {ex: s / old["probe_s"] for ex, s in old["checks"].items()}
    checks.update({ex: s / max(scale, probe / SLOW_PROBE)
                   for ex, (s, probe) in times.items()})
    data = {
        "what": "seconds each solution's check took (the slowest of 3 runs), on the "
                "machine named, when exercises.probe_s() took probe_s",
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "probe_s": scale,
        "checks": {ex: figures(s * scale) for ex, s in sorted(
            checks.items(), key=lambda kv: [int(x) for x in kv[0].split(".")])},
    }
    exercises.ANSWER_TIMES.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded {len(times)} checks, probe {scale * 1000:.1f} ms, in "
          f"{exercises.ANSWER_TIMES}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
