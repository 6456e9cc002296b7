"""GPU readiness check: run every chapter's solutions on this machine's GPU.

    python -m course_utils.gpu_check                 # every chapter
    python -m course_utils.gpu_check 02 06           # some chapters
    python -m course_utils.gpu_check --record        # and record the GPU results

For instructors (``make gpu-check``). Every chapter is written for 0, 1 or N
GPUs, but most of its GPU lines only run where there is a GPU. This builds
each chapter's solution notebook in a temporary folder, runs it top to bottom
in a fresh kernel under nbval with a per-cell timeout, and prints one line per
chapter - passed or failed, how long it took - then the failing cells with
their messages and the slowest cells. Nothing is written to the repository
unless ``--record`` is given (then ``COURSE_RECORD=1`` writes each GPU
measurement to ``course_utils/reference_data/<gpu>.json``, as ``make record``
does). On a machine without a GPU it says so and checks the CPU path.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from course_utils import build, grade, reference


def describe_hardware() -> str:
    """One line: the GPUs this check will use, without initialising CUDA."""
    from course_utils.devices import gpu_names, usable_cores

    names = gpu_names()
    if not names:
        return (f"no GPU found ({usable_cores()} CPU cores): this checks the CPU "
                "path only; run it on a GPU machine to check the GPU paths")
    return f"{len(names)} GPU(s): {', '.join(names)}"


def check(sources: list[Path], timeout: int, slowest: int = 3) -> tuple[str, bool]:
    """Run each chapter's solutions; return the report and whether all passed."""
    lines, all_ok = [], True
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for nb in build.write_solutions(Path(tmp), only=sources):
            start = time.perf_counter()
            try:
                cells = grade.run_notebooks([nb], timeout=timeout)
                crash = ""
            except RuntimeError as e:  # the kernel or nbval itself failed
                cells, crash = [], str(e)
            seconds = time.perf_counter() - start
            failed = [c for c in cells if c.outcome != "passed"]
            ok = bool(cells) and not failed and not crash
            all_ok = all_ok and ok
            lines.append(f"{'passed' if ok else 'FAILED'}  {nb.stem:<40} "
                         f"{seconds:6.1f} s  {len(cells)} cells")
            if crash:
                lines += ["    " + ln for ln in crash.splitlines()[-6:]]
            for c in failed:
                last = (c.message.strip().splitlines() or [c.outcome])[-1]
                lines.append(f"    cell {c.cell} {c.outcome}: {last[:160]}")
            for c in sorted(cells, key=lambda c: -c.seconds)[:slowest]:
                first = (c.source.strip().splitlines() or [""])[0]
                lines.append(
                    f"    slow: cell {c.cell} {c.seconds:5.1f} s  {first[:70]}")
    return "\n".join(lines), all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*",
                        help="chapter numbers or source names (default: all)")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds a cell may run before it counts as hung")
    parser.add_argument("--record", action="store_true",
                        help="write GPU measurements to course_utils/reference_data/")
    args = parser.parse_args(argv)
    sources = build.chapter_sources()
    if args.chapters:
        sources = [s for s in sources
                   if any(s.stem.startswith(c) or s.stem == c for c in args.chapters)]
        if not sources:
            print(f"no chapter matches {' '.join(args.chapters)}")
            return 2
    if args.record:
        os.environ[reference.RECORD_ENV] = "1"
    else:
        os.environ.pop(reference.RECORD_ENV, None)
    print(describe_hardware())
    print(f"running {len(sources)} chapter(s) with solutions, "
          f"{'recording' if args.record else 'recording nothing'}")
    text, ok = check(sources, args.timeout)
    print(text)
    print("all chapters passed" if ok else "some chapters FAILED (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
