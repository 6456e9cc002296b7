"""GPU readiness check: run every chapter's solutions on this machine's GPU.

    python -m course_utils.gpu_check                  # every chapter
    python -m course_utils.gpu_check 02 06            # some chapters
    python -m course_utils.gpu_check --quick          # only cells that differ on a GPU
    python -m course_utils.gpu_check --record         # and record the GPU results
    python -m course_utils.gpu_check --wheelhouse DIR # offline: Jupyter bits from DIR
    python -m course_utils.gpu_check --make-wheelhouse DIR --python-version 3.12
    python -m course_utils.gpu_check --lines          # lines only a GPU runs

For instructors (``make gpu-check``). Every chapter is written for 0, 1 or N
GPUs, but most of its GPU lines only run where there is a GPU. This builds
each chapter's solution notebook in a temporary folder, runs it top to bottom
in a fresh kernel under nbval with a per-cell timeout, and prints one verdict
per chapter - passed or failed, how long it took - then the failing cells with
their messages and the slowest cells. Nothing is written to the repository
unless ``--record`` is given (then ``COURSE_RECORD=1`` writes each GPU
measurement to ``course_utils/reference_data/<gpu>.json``, as ``make record``
does). On a machine without a GPU it says so and checks the CPU path.

A GPU machine often has a CUDA torch but no Jupyter and no internet. There,
``--wheelhouse DIR`` installs what the check needs from a folder of wheels
(``make wheelhouse`` writes it on a connected machine) with ``pip --no-index``
into a temporary folder put in front of ``sys.path``: the site's torch, numpy,
matplotlib and numba are used as they are, and nothing is installed for good.

``--lines`` runs every chapter as a script on this machine's CPU under
``coverage`` (ranks included) and lists, per chapter, the lines of the chapter
that did not run and sit under a GPU condition: the lines only a GPU runs.
``--quick`` runs, per chapter, the cells that mention the GPU and the cells
that define what those use.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAPPED_ENV = "COURSE_GPU_CHECK_SITE"  # set in the child that uses the wheels
MAX_WHEELHOUSE_MB = 60

# What the GPU machine's own Python must have: large native packages that
# every GPU image with torch carries (torch brings its own dependencies).
SITE_NEEDS = ("torch", "numpy", "matplotlib", "numba")
# Never in the wheelhouse: torch and what it depends on (the site has them,
# and a second copy in front of sys.path could break its torch), the large
# native packages above and their native parts, and tools the check never runs.
WHEELHOUSE_SKIP = re.compile(
    r"^(torch|triton|nvidia-.*|cuda-.*|filelock|typing-extensions|sympy|mpmath|"
    r"networkx|jinja2|markupsafe|fsspec|setuptools|numpy|matplotlib|contourpy|"
    r"kiwisolver|pillow|fonttools|numba|llvmlite|jupyterlab|ruff|pytest-xdist|"
    r"execnet)$")
# A wheel's platform tags pip accepts for a Linux x86-64 GPU machine.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


# --- the report ---------------------------------------------------------------


def describe_hardware() -> str:
    """One line: the GPUs this check will use, without initialising CUDA."""
    from course_utils.devices import gpu_names, usable_cores

    names = gpu_names()
    if not names:
        return (f"no GPU found ({usable_cores()} CPU cores): this checks the CPU "
                "path only; run it on a GPU machine to check the GPU paths")
    return f"{len(names)} GPU(s): {', '.join(names)}"


def check(sources: list[Path], timeout: int, slowest: int = 3,
          quick: bool = False, echo=None) -> tuple[str, bool]:
    """Run each chapter's solutions; return the report and whether all passed.

    ``echo`` (``print``, say) is given each chapter's lines as it finishes.
    """
    from course_utils import build, grade

    lines, all_ok = [], True
    done = 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for nb in build.write_solutions(Path(tmp), only=sources):
            kept = "of {} ".format(*quick_notebook(nb)) if quick else ""
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
                         f"{seconds:6.1f} s  {len(cells)} {kept}cells")
            if crash:
                lines += ["    " + ln for ln in crash.splitlines()[-6:]]
            for c in failed:
                last = (c.message.strip().splitlines() or [c.outcome])[-1]
                lines.append(f"    cell {c.cell} {c.outcome}: {last[:160]}")
            for c in sorted(cells, key=lambda c: -c.seconds)[:slowest]:
                first = (c.source.strip().splitlines() or [""])[0]
                lines.append(
                    f"    slow: cell {c.cell} {c.seconds:5.1f} s  {first[:70]}")
            if echo is not None:
                echo("\n".join(lines[done:]), flush=True)
            done = len(lines)
    return "\n".join(lines), all_ok


# --- --quick: the cells that differ on a GPU, and what they need ------------------

GPU_WORDS = re.compile(r"cuda|gpu|nccl|on_device|device\.type", re.IGNORECASE)


def _defined_and_used(source: str) -> tuple[set[str], set[str]]:
    """Names a cell binds at top level, and names it reads (anywhere)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(), set()
    bound, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                               ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
    return bound, used


def quick_cells(sources: list[str], gpu_names: frozenset[str] = frozenset()
                ) -> list[int]:
    """Indices of the code cells ``--quick`` runs, in order.

    A cell is kept when its code mentions the GPU (``GPU_WORDS``) or reads one
    of ``gpu_names`` (checkers with a GPU path), and then every earlier cell
    that binds a name a kept cell reads, transitively. The first cell (imports
    and the banner) always runs.
    """
    info = [_defined_and_used(s) for s in sources]
    keep = {i for i, s in enumerate(sources)
            if GPU_WORDS.search(s) or info[i][1] & gpu_names}
    if sources:
        keep.add(0)
    todo = sorted(keep)
    while todo:
        i = todo.pop()
        for name in info[i][1]:
            for j in range(i - 1, -1, -1):  # the latest earlier binding
                if name in info[j][0]:
                    if j not in keep:
                        keep.add(j)
                        todo.append(j)
                    break
    return sorted(keep)


def checkers_with_gpu_paths(chapter: str) -> frozenset[str]:
    """Names of chapter ``NN``'s checkers whose code mentions the GPU."""
    import importlib
    import inspect

    try:
        module = importlib.import_module(f"course_utils.checks.ch{chapter}")
    except ImportError:
        return frozenset()
    names = set()
    for name, fn in vars(module).items():
        if inspect.isfunction(fn) and fn.__module__ == module.__name__:
            try:
                if GPU_WORDS.search(inspect.getsource(fn)):
                    names.add(name)
            except (OSError, TypeError):
                continue
    return frozenset(names)


def quick_notebook(path: Path) -> tuple[int]:
    """Keep only the ``--quick`` code cells of a notebook, in place.

    Returns how many code cells it had.
    """
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    gpu_names = checkers_with_gpu_paths(path.stem[:2])
    keep = {id(code[i]) for i in quick_cells([c.source for c in code], gpu_names)}
    nb.cells = [c for c in nb.cells if c.cell_type != "code" or id(c) in keep]
    nbformat.write(nb, path)
    return (len(code),)


# --- the wheelhouse -------------------------------------------------------------


def _name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    return re.sub(r"[-_.]+", "-", name.group()).lower() if name else ""


def wheelhouse_pins(lines: list[str]) -> list[str]:
    """The pins of requirements.txt that the wheelhouse brings (not the site)."""
    pins = [ln.split("#", 1)[0].strip() for ln in lines]
    return [p for p in pins if p and not WHEELHOUSE_SKIP.match(_name(p))]


def _wheel_name(path: Path) -> str:
    return _name(path.name.split("-", 1)[0])


def make_wheelhouse(dest: Path, python_version: str,
                    requirements: Path = ROOT / "requirements.txt") -> str:
    """Download the wheels the check needs for a Linux x86-64 Python; a summary."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = wheelhouse_pins(requirements.read_text().splitlines())
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
           "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS],
           *pins]
    subprocess.run(cmd, check=True)
    for wheel in dest.glob("*.whl"):  # dependencies the site brings itself
        if WHEELHOUSE_SKIP.match(_wheel_name(wheel)):
            wheel.unlink()
    wheels = sorted(dest.glob("*.whl"))
    mb = sum(w.stat().st_size for w in wheels) / 1e6
    if mb > MAX_WHEELHOUSE_MB:
        raise RuntimeError(f"{dest}: {mb:.1f} MB, more than {MAX_WHEELHOUSE_MB}")
    return (f"{dest}: {len(wheels)} wheels, {mb:.1f} MB, for CPython "
            f"{python_version} on Linux x86-64 (the site brings "
            f"{', '.join(SITE_NEEDS)})")


def install_wheelhouse(wheelhouse: Path, target: Path) -> None:
    """Install every wheel of ``wheelhouse`` into ``target``, with no index."""
    wheels = sorted(str(w) for w in Path(wheelhouse).glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {wheelhouse} (make wheelhouse)")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                    "--no-deps", "--no-compile", "--disable-pip-version-check",
                    "--target", str(target), *wheels], check=True)


def missing_site_packages(names=SITE_NEEDS) -> list[str]:
    """Which of the site's packages this Python cannot find."""
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def run_with_wheelhouse(wheelhouse: Path, argv: list[str]) -> int:
    """Install the wheels in a temporary folder, run the check with it, clean up."""
    missing = missing_site_packages()
    if missing:
        print(f"this Python lacks {', '.join(missing)}: the wheelhouse brings "
              "only the pure-Python parts; install those first")
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-check-site-") as tmp:
        target = Path(tmp) / "site"
        start = time.perf_counter()
        install_wheelhouse(wheelhouse, target)
        print(f"installed {len(list(Path(wheelhouse).glob('*.whl')))} wheels from "
              f"{wheelhouse} into a temporary folder in "
              f"{time.perf_counter() - start:.0f} s (no index; torch untouched)")
        path = os.pathsep.join([str(target), str(ROOT),
                                os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = dict(os.environ, PYTHONPATH=path, **{BOOTSTRAPPED_ENV: str(target)})
        return subprocess.run([sys.executable, "-m", "course_utils.gpu_check",
                               *argv], env=env, cwd=ROOT).returncode


# --- --lines: what only a GPU runs ----------------------------------------------

GPU_CONDITION = re.compile(
    r"cuda|gpu|nccl|on_device|device\.type|\.is_cuda|GPU", re.IGNORECASE)


def _guarded(tree: ast.AST, source: str, gpu_functions: set[str]
             ) -> tuple[set[int], set[str]]:
    """Lines under a GPU condition or in a GPU function, and the names they read."""
    lines: set[int] = set()
    names: set[str] = set()

    def mark(stmt: ast.stmt) -> None:
        lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
        names.update(n.id for n in ast.walk(stmt)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    GPU_CONDITION.search(child.name) or child.name in gpu_functions):
                for stmt in child.body:
                    mark(stmt)
            elif isinstance(child, (ast.If, ast.While)) and GPU_CONDITION.search(
                    ast.get_source_segment(source, child.test) or ""):
                for stmt in child.body + child.orelse:  # the CPU's branch ran
                    mark(stmt)
            else:
                visit(child)

    visit(tree)
    return lines, names


def gpu_only_lines(source: str, ran: set[int]) -> list[int]:
    """Lines that did not run and that only a GPU would run.

    Such a line sits in a branch whose condition mentions the GPU (``if``,
    ``while``: the branch a CPU took ran), in a function whose name does, or
    in a function called only from such lines. Lines that did not run for
    other reasons (error paths, exercises' wrong answers) are not counted.
    """
    tree = ast.parse(source)
    functions = {n.name for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    gpu_functions: set[str] = set()
    while True:
        guarded, names = _guarded(tree, source, gpu_functions)
        more = (names & functions) - gpu_functions
        if not more:
            break
        gpu_functions |= more
    text = source.splitlines()
    return sorted(n for n in guarded - ran if n <= len(text)
                  and text[n - 1].strip() and not text[n - 1].lstrip().startswith("#"))


COVERAGE_RC = """[run]
parallel = true
concurrency = thread,multiprocessing
patch = subprocess,_exit,fork
sigterm = true
include = {include}
"""


CELL_START = re.compile(r"^# %%( |$)")


def run_cells(source: Path) -> list[str]:
    """Run a chapter's code cells in order in one namespace, as its kernel would.

    Each cell is compiled with its own line numbers in ``source`` (so that
    coverage counts the chapter's lines); a ``%%writefile`` cell writes its
    file; a cell that raises is reported and the next one runs, as under
    nbval. Returns one line per failed cell.
    """
    import matplotlib

    matplotlib.use("Agg")
    try:
        from IPython.display import display
    except ImportError:  # no IPython: show what would be displayed
        display = print
    lines = source.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if CELL_START.match(line)]
    import types

    main = types.ModuleType("__main__")  # as a kernel's: what pickles by name
    ns = main.__dict__  # (a pool's function) is found in it
    ns.update(__file__=str(source), display=display)
    failed, before = [], sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        _run(starts, lines, source, ns, failed)
    finally:
        sys.modules["__main__"] = before
    return failed


def _run(starts: list[int], lines: list[str], source: Path, ns: dict,
         failed: list[str]) -> None:
    for k, start in enumerate(starts):
        header = lines[start]
        body = lines[start + 1:starts[k + 1] if k + 1 < len(starts) else None]
        if "[markdown]" in header or not "".join(body).strip():
            continue
        code = "".join(body)
        magic = re.match(r"\s*# %%writefile (\S+)\n", code)
        try:
            if magic:
                target = eval(f"f{magic.group(1)!r}", ns)  # {NAME} as IPython does
                Path(target).write_text(code[magic.end():])
                continue
            exec(compile("\n" * (start + 1) + code, str(source), "exec"), ns)
        except Exception as e:  # noqa: BLE001 - report it, run the next cell
            failed.append(f"cell at line {start + 1}: {type(e).__name__}: {e}"[:200])


def chapter_lines(source: Path, timeout: int) -> tuple[list[int], str]:
    """Run a chapter's cells under coverage; its GPU-only lines, and a note."""
    import coverage

    with tempfile.TemporaryDirectory(prefix="gpu-lines-") as tmp:
        rc = Path(tmp) / "coveragerc"
        rc.write_text(COVERAGE_RC.format(include=source.resolve()))
        env = dict(os.environ, MPLBACKEND="Agg", COVERAGE_RCFILE=str(rc),
                   PYTHONPATH=os.pathsep.join([str(ROOT),
                                               os.environ.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "coverage", "run", "--rcfile", str(rc),
                 "--data-file", str(Path(tmp) / ".coverage"),
                 "-m", "course_utils.gpu_check", "--run-cells", str(source)],
                cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
            note = "" if proc.returncode == 0 else (
                f"exit {proc.returncode}: "
                + ((proc.stderr or proc.stdout).strip().splitlines() or [""])[-1])
        except subprocess.TimeoutExpired:
            note = f"stopped after {timeout} s"
        data = coverage.Coverage(data_file=str(Path(tmp) / ".coverage"),
                                 config_file=str(rc))
        data.combine(strict=False)
        data.load()
        ran = set(data.get_data().lines(str(source.resolve())) or [])
    return gpu_only_lines(source.read_text(), ran), note


def lines_report(sources: list[Path], timeout: int) -> tuple[str, int]:
    """Per chapter: how many lines only a GPU runs, and which; the total."""
    out, total = [], 0
    for source in sources:
        lines, note = chapter_lines(source, timeout)
        total += len(lines)
        out.append(f"{source.stem:<42} {len(lines):4d} GPU-only lines"
                   + (f"  ({note[:100]})" if note else ""))
        if lines:
            out.append("    " + _ranges(lines))
    out.append(f"{'in all':<42} {total:4d}")
    return "\n".join(out), total


def _ranges(numbers: list[int]) -> str:
    spans, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            spans.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return "lines " + ", ".join(spans)


# --- the command line -----------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m course_utils.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*",
                        help="chapter numbers or source names (default: all)")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds a cell may run before it counts as hung")
    parser.add_argument("--record", action="store_true",
                        help="write GPU measurements to course_utils/reference_data/")
    parser.add_argument("--quick", action="store_true",
                        help="only the cells that mention the GPU, and their needs")
    parser.add_argument("--wheelhouse", type=Path, metavar="DIR",
                        help="first install the check's packages from DIR, offline")
    parser.add_argument("--make-wheelhouse", type=Path, metavar="DIR",
                        help="download the check's packages into DIR (needs the index)")
    parser.add_argument("--python-version", default="3.12",
                        help="the GPU machine's Python, for --make-wheelhouse")
    parser.add_argument("--lines", action="store_true",
                        help="list per chapter the lines that only run with a GPU")
    parser.add_argument("--run-cells", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_cells:  # one chapter, for --lines (under coverage)
        failed = run_cells(args.run_cells.resolve())
        print("\n".join(failed), file=sys.stderr)
        return 1 if failed else 0
    if args.make_wheelhouse:
        print(make_wheelhouse(args.make_wheelhouse, args.python_version))
        return 0
    if args.wheelhouse and not os.environ.get(BOOTSTRAPPED_ENV):
        i = argv.index("--wheelhouse")
        rest = argv[:i] + argv[i + 2:]
        return run_with_wheelhouse(args.wheelhouse.resolve(), rest)
    from course_utils import build, reference

    sources = build.chapter_sources()
    if args.chapters:
        sources = [s for s in sources
                   if any(s.stem.startswith(c) or s.stem == c for c in args.chapters)]
        if not sources:
            print(f"no chapter matches {' '.join(args.chapters)}")
            return 2
    if args.lines:
        print(f"each chapter's cells under coverage, on this machine's CPU "
              f"({describe_hardware().split(':')[0]})")
        text, _ = lines_report(sources, args.timeout)
        print(text)
        return 0
    if args.record:
        os.environ[reference.RECORD_ENV] = "1"
    else:
        os.environ.pop(reference.RECORD_ENV, None)
    print(describe_hardware())
    print(f"running {len(sources)} chapter(s) with solutions"
          f"{', only the cells that differ on a GPU' if args.quick else ''}, "
          f"{'recording' if args.record else 'recording nothing'}")
    start = time.perf_counter()
    _, ok = check(sources, args.timeout, quick=args.quick, echo=print)
    print(f"{'all chapters passed' if ok else 'some chapters FAILED (see above)'}"
          f" in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
