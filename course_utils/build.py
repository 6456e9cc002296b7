"""Generate the learner notebooks from the chapter sources, and check they agree.

``source/NN_topic.py`` (jupytext py:percent, with solutions) is the only file an
instructor edits for chapter NN. This module writes ``notebooks/NN_topic.ipynb``
from it: clean (no outputs, no execution counts), with a generated-file marker,
and with every solution replaced by ``raise NotImplementedError("Exercise N.M")``.

    python -m course_utils.build                 # regenerate notebooks/
    python -m course_utils.build source/02_*.py  # regenerate some of them
    python -m course_utils.build --check         # exit 1 if notebooks/ differs
    python -m course_utils.build --solutions DIR # also write solution notebooks
    python -m course_utils.build --force         # overwrite learners' work (backed up)

A notebook whose exercise cells a learner has edited is never overwritten
without ``--force``; with it, the old notebook is first copied to
``notebook_backups/``. Introduced in Chapter 0.
"""

from __future__ import annotations

import argparse
import ast
import base64
import datetime as _dt
import hashlib
import json
import platform
import re
import shutil
import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIR = ROOT / "source"
NOTEBOOK_DIR = ROOT / "notebooks"
BACKUP_DIR = ROOT / "notebook_backups"
START_SOURCE = "START_HERE.md"  # the course map, in source/
START_NOTEBOOK = "START_HERE.ipynb"  # what `make lab` opens
IMAGE_RE = re.compile(r"!\[([^\]]*)\]\(\.\./images/([A-Za-z0-9_.-]+\.png)\)")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHAPTER_RE = re.compile(r"^(\d\d)_[a-z0-9_]+\.py$")


class BuildError(Exception):
    """A chapter source that breaks the exercise conventions."""


def chapter_sources(source_dir: Path = SOURCE_DIR) -> list[Path]:
    """The chapter sources, ``NN_topic.py``, in chapter order."""
    return sorted(p for p in source_dir.glob("*.py") if CHAPTER_RE.match(p.name))


MAX_WORDS = 4500  # prose a learner reads in one sitting (markdown words)
MAX_CODE_LINES = 700  # non-blank lines in code cells, exercises and checks included


def chapter_length(source: Path) -> tuple[int, int]:
    """``(markdown words, non-blank code lines)`` of a chapter source."""
    nb = jupytext.read(source, fmt="py:percent")
    words = sum(len(re.findall(r"\w+", c.source))
                for c in nb.cells if c.cell_type == "markdown")
    code = sum(1 for c in nb.cells if c.cell_type == "code"
               for line in c.source.splitlines() if line.strip())
    return words, code


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def stub_solutions(source: str, exercise: str) -> str:
    """Replace each BEGIN/END SOLUTION block by a NotImplementedError, same indent."""
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise BuildError(f"exercise {exercise}: nested {BEGIN}")
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("Exercise {exercise}")')
            inside = True
        elif stripped == END:
            if not inside:
                raise BuildError(f"exercise {exercise}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise BuildError(f"exercise {exercise}: {BEGIN} without {END}")
    return "\n".join(out)


def lint(nb, chapter: int, name: str) -> list[tuple[str, int, int]]:
    """Check the exercise conventions; return ``(id, exercise_cell, check_cell)``.

    Each exercise cell carries an id ``chapter.k`` (k = 1, 2, ... in order) and
    a solution block, and the next code cell is a check cell with the same id.
    """
    found, code = [], [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    for pos, i in enumerate(code):
        cell = nb.cells[i]
        tags = cell.metadata.get("tags", [])
        if "exercise" not in tags:
            if BEGIN in cell.source:
                raise BuildError(
                    f"{name}: cell {i} has a solution block but no 'exercise' tag"
                )
            continue
        ex = str(cell.metadata.get("exercise", ""))
        expected = f"{chapter}.{len(found) + 1}"
        if ex != expected:
            raise BuildError(
                f"{name}: exercise cell {i} has id {ex!r}; the next "
                f"exercise of chapter {chapter} must be {expected!r}"
            )
        if BEGIN not in cell.source:
            raise BuildError(f"{name}: exercise {ex} has no {BEGIN} block")
        nxt = code[pos + 1] if pos + 1 < len(code) else None
        check = nb.cells[nxt] if nxt is not None else None
        if (
            check is None
            or "check" not in check.metadata.get("tags", [])
            or str(check.metadata.get("exercise")) != ex
        ):
            raise BuildError(
                f"{name}: exercise {ex} must be followed by a code cell "
                f'tagged "check" with exercise="{ex}"'
            )
        found.append((ex, i, nxt))
    _no_shadowing(nb, [i for _, i, _ in found], name)
    _no_dependence(nb, found, name)
    stray = stray_reprs(nb)
    if stray:
        raise BuildError(f"{name}: " + "; ".join(stray))
    return found


# --- bare expressions whose repr a learner would see ---------------------------

# calls that return None (what a notebook shows after them is nothing)
NONE_CALLS = {"print", "display", "exec", "plt.show", "plt.tight_layout",
              "plt.close", "plt.figure.show", "random.seed", "np.random.seed",
              "time.sleep", "os.environ.update", "warnings.filterwarnings",
              "warnings.simplefilter", "sys.path.insert"}
# methods that return None whatever they are called on
NONE_METHODS = {"cleanup", "append", "extend", "sort", "clear", "update", "reverse",
                "mkdir", "set_printoptions", "manual_seed_all"}
PACKAGE = "course_utils"


def _returns_value(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether a function can return something other than None."""
    if fn.returns is not None:
        return not (isinstance(fn.returns, ast.Constant) and fn.returns.value is None)
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                             ast.ClassDef)):
            continue  # a nested function's returns are its own
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            return True
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def parse(source: str) -> ast.Module:
    """``ast.parse``, once more where Python 3.11 fails it spuriously.

    Its AST constructor can raise "SystemError: AST constructor recursion
    depth mismatch" in a process whose other threads compile too (CPython
    gh-106905): a test run has such threads, and the same source parses the
    next time."""
    for attempt in range(3):
        try:
            return ast.parse(source)
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _module_defs(module: str, seen: frozenset = frozenset()) -> dict:
    """``name -> FunctionDef, ClassDef or (module, name)`` of a course_utils module."""
    parts = module.split(".")
    path = ROOT.joinpath(*parts)
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    if module in seen or not path.exists():
        return {}
    defs: dict = {}
    for node in parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                PACKAGE):
            for alias in node.names:
                defs[alias.asname or alias.name] = (node.module, alias.name)
    return defs


def _resolve(module: str, name: str, depth: int = 0):
    """The definition of ``module.name`` in course_utils, following re-exports."""
    found = _module_defs(module).get(name)
    if isinstance(found, tuple) and depth < 5:
        sub = f"{found[0]}.{found[1]}"  # a submodule, or a name from one
        if ROOT.joinpath(*sub.split(".")).with_suffix(".py").exists() or ROOT.joinpath(
                *sub.split(".")).is_dir():
            return sub
        return _resolve(*found, depth + 1)
    return found


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _shows_nothing(call: ast.Call, defs: dict, imported: dict) -> bool:
    """Whether a call returns None, as far as the sources tell."""
    name = _dotted(call.func)
    if name is None:
        return False
    if name in NONE_CALLS or ("." in name and name.rsplit(".", 1)[1] in NONE_METHODS):
        return True
    head, _, rest = name.partition(".")
    if not rest and head in defs:  # a function of the chapter
        node = defs[head]
        return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            not _returns_value(node))
    if head in imported:  # a name or module from course_utils
        target = imported[head]
        for part in rest.split(".") if rest else []:
            if not isinstance(target, str):
                return False
            target = _resolve(target, part)
        if isinstance(target, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return not _returns_value(target)
    return False


def stray_reprs(nb) -> list[str]:
    """Code cells whose last line is a call that shows a learner its repr.

    A notebook displays the value of a cell's last bare expression. A name or
    an attribute shown on purpose (a tensor, a shape) is fine; a call is fine
    only when it returns None (``print``, a course helper annotated ``->
    None``, a chapter function with no value to return); anything else shows
    a repr nobody wrote for a learner (``[Figure(kind='published', ...)]``,
    the banner's string a second time, a widget's function): end the line
    with ``;`` or use the value.
    """
    cells = [c for c in nb.cells if c.cell_type == "code"]
    trees = []
    for c in cells:
        lines = [ln for ln in c.source.splitlines()
                 if not ln.lstrip().startswith(("%", "!"))]
        if c.source.lstrip().startswith("%%"):
            trees.append(None)  # a cell magic: not Python
            continue
        try:
            trees.append(parse("\n".join(lines)))
        except SyntaxError:
            trees.append(None)
    defs, imported = {}, {}
    for tree in trees:
        for node in tree.body if tree else []:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs[node.name] = node
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    PACKAGE):
                for alias in node.names:
                    imported[alias.asname or alias.name] = _resolve(
                        node.module, alias.name) or f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE):
                        imported[alias.asname or alias.name] = alias.name
    stray = []
    for c, tree in zip(cells, trees, strict=True):
        if not tree or not tree.body or not isinstance(tree.body[-1], ast.Expr):
            continue
        last = tree.body[-1]
        code = [ln for ln in c.source.splitlines() if ln.strip()]
        if code and code[-1].split("#")[0].rstrip().endswith(";"):
            continue
        value = last.value
        if isinstance(value, ast.Await):
            value = value.value
        if isinstance(value, ast.Call) and _shows_nothing(value, defs, imported):
            continue
        if isinstance(value, (ast.Name, ast.Attribute, ast.Subscript, ast.Compare,
                              ast.BinOp, ast.UnaryOp, ast.Tuple)):
            continue  # a value shown on purpose
        text = ast.get_source_segment("\n".join(
            ln for ln in c.source.splitlines()
            if not ln.lstrip().startswith(("%", "!"))), last) or ""
        stray.append(f"cell {nb.cells.index(c)} ends in `{text.splitlines()[0][:60]}`,"
                     " whose repr the learner would see: end it with ';' or use it")
    return stray


def _top_level_names(source: str) -> set[str]:
    """Names a cell binds at its top level (def, class, assignment, import)."""
    import ast

    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        tree = parse("\n".join(lines))
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _no_shadowing(nb, exercise_cells: list[int], name: str) -> None:
    """An exercise must not rebind a name the rest of the chapter defines.

    Running the exercise would replace the chapter's own function (or value),
    and a slider or a later cell that uses it would break.
    """
    exercise_names = {i: _top_level_names(nb.cells[i].source) for i in exercise_cells}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or i in exercise_names:
            continue
        for j, names in exercise_names.items():
            clash = sorted(names & _top_level_names(cell.source))
            if clash:
                raise BuildError(
                    f"{name}: exercise cell {j} defines {', '.join(clash)}, which "
                    f"cell {i} defines too: running the exercise would replace "
                    "the chapter's; give the exercise's names of their own"
                )


def _names_used(source: str) -> set[str]:
    """Every name a cell reads (loads), at any depth."""
    import ast

    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        tree = parse("\n".join(lines))
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _no_dependence(nb, exercises: list[tuple[str, int, int]], name: str) -> None:
    """No cell but an exercise's own check may use what the exercise defines.

    A learner who has not solved it yet must still be able to run the rest of
    the chapter (and a later cell must not silently use a wrong answer).
    """
    for ex, i, check in exercises:
        defined = _top_level_names(nb.cells[i].source)
        for j in range(i + 1, len(nb.cells)):
            cell = nb.cells[j]
            if cell.cell_type != "code" or j == check:
                continue
            if "exercise" in cell.metadata.get("tags", []):
                defined -= _top_level_names(cell.source)  # rebound from here on
                continue
            used = sorted(defined & _names_used(cell.source))
            if used:
                raise BuildError(
                    f"{name}: cell {j} uses {', '.join(used)} from exercise {ex}: "
                    "the chapter must run while the exercise is unsolved"
                )


def marker_cell(source_name: str):
    """The last cell: where this notebook comes from (for instructors)."""
    text = (
        f"<small>Generated from `source/{source_name}` by "
        "`python -m course_utils.build`. Learners: work here; regenerating "
        "never overwrites your exercise answers. Instructors: edit the "
        "source, not this notebook.</small>"
    )
    return nbformat.v4.new_markdown_cell(
        text, id="generated", metadata={"tags": ["generated"]}
    )


RUN_ALL_NOTE = (
    "**Run All stops at the first check below.** Each exercise is followed by a "
    "check cell, which fails until the exercise is solved, and *Run All* stops at "
    "the first failing cell: everything above has run. Solve an exercise, then run "
    "its cell and its check (Shift+Enter). To run the rest without solving, select "
    "the next cell and use *Run > Run Selected Cell and All Below*."
)


def run_all_note():
    """The note placed before the exercises: where Run All stops, and why."""
    return nbformat.v4.new_markdown_cell(
        RUN_ALL_NOTE, id="run-all-note", metadata={"tags": ["generated"]}
    )


def _exercises_start(cells, first_exercise: int) -> int:
    """Index of the cell before which the Run All note goes."""
    for i in range(first_exercise - 1, -1, -1):
        cell = cells[i]
        if cell.cell_type == "markdown" and re.match(
            r"#+\s*(\d+\.\s*)?Exercises", cell.source.strip()
        ):
            return i + 1  # right under the Exercises heading
    return first_exercise


def generate(source: Path, solutions: bool = False) -> str:
    """The notebook text for ``source``: learner version, or with solutions."""
    m = CHAPTER_RE.match(source.name)
    if not m:
        raise BuildError(f"{source.name}: chapter sources are named NN_topic.py")
    chapter = int(m.group(1))
    for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("# #!"):
            # jupytext reads "# #!" as an escaped shell command and drops the
            # "#": a shebang in a markdown code block would lose its "#".
            raise BuildError(
                f"{source.name}, line {n}: write '# # #!' for a line that starts "
                "with '#!' (jupytext reads '# #!' as an escaped shell command)"
            )
    nb = jupytext.read(source, fmt="py:percent")
    exercises = lint(nb, chapter, source.name)
    cells = []
    for i, cell in enumerate(nb.cells):
        meta = {k: v for k, v in cell.metadata.items() if k in ("tags", "exercise")}
        src = cell.source
        if "exercise" in meta.get("tags", []) and not solutions:
            src = stub_solutions(src, meta["exercise"])
            meta["stub_sha1"] = _sha1(src)
        cid = f"c{i:03d}"
        if cell.cell_type == "markdown":
            cells.append(nbformat.v4.new_markdown_cell(src, id=cid, metadata=meta))
        else:
            cells.append(nbformat.v4.new_code_cell(src, id=cid, metadata=meta))
    if exercises:
        cells.insert(_exercises_start(cells, exercises[0][1]), run_all_note())
    cells.append(marker_cell(source.name))
    out = nbformat.v4.new_notebook(
        cells=cells,
        metadata={
            "kernelspec": {
                # what JupyterLab's default kernel calls itself: anything else
                # is rewritten on opening, and the notebook looks edited
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
                "name": "python3",
            },
            "language_info": language_info(),
            "course": {
                "generated_from": f"source/{source.name}",
                "solutions": solutions,
            },
        },
    )
    out.nbformat_minor = 5
    nbformat.validate(out)
    return nbformat.writes(out) + "\n"


def language_info() -> dict:
    """What the kernel reports about its language, as JupyterLab stores it.

    JupyterLab writes the kernel's ``language_info`` into a notebook it opens;
    anything else here, and every notebook would open with unsaved changes.
    The Python version is this interpreter's: the one the course's kernel runs.
    """
    return {
        "codemirror_mode": {"name": "ipython", "version": 3},
        "file_extension": ".py",
        "mimetype": "text/x-python",
        "name": "python",
        "nbconvert_exporter": "python",
        "pygments_lexer": "ipython3",
        "version": platform.python_version(),
    }


def generate_start(source: Path, images: Path | None = None) -> str:
    """The start page notebook from ``source/START_HERE.md``.

    One markdown cell per ``## `` section. Images written as
    ``![alt](../images/name.png)`` are embedded as cell attachments, so they
    show although JupyterLab serves only ``notebooks/``.
    """
    images = images or source.resolve().parent.parent / "images"
    text = source.read_text(encoding="utf-8")
    parts = re.split(r"\n(?=## )", text.strip())
    cells = []
    for i, part in enumerate(parts):
        attachments = {}

        def attach(m, attachments=attachments):
            data = (images / m.group(2)).read_bytes()
            attachments[m.group(2)] = {
                "image/png": base64.b64encode(data).decode("ascii")}
            return f"![{m.group(1)}](attachment:{m.group(2)})"

        body = IMAGE_RE.sub(attach, part)
        cell = nbformat.v4.new_markdown_cell(body, id=f"start-{i:02d}")
        if attachments:
            cell.attachments = attachments
        cells.append(cell)
    out = nbformat.v4.new_notebook(
        cells=cells,
        metadata={
            "kernelspec": {"display_name": "Python 3 (ipykernel)",
                           "language": "python", "name": "python3"},
            "language_info": language_info(),
            "course": {"generated_from": f"source/{source.name}"},
        },
    )
    out.nbformat_minor = 5
    nbformat.validate(out)
    return nbformat.writes(out) + "\n"


def learner_edits(path: Path) -> list[str]:
    """Exercise ids whose cell in the notebook at ``path`` differs from its stub."""
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:  # unreadable: treat the whole file as the learner's
        return ["(unreadable notebook)"]
    edited = []
    for cell in nb.cells:
        sha = cell.get("metadata", {}).get("stub_sha1")
        if sha and _sha1(cell.source) != sha:
            edited.append(str(cell.metadata.get("exercise", "?")))
    return edited


def target_for(source: Path, notebook_dir: Path = NOTEBOOK_DIR) -> Path:
    return notebook_dir / f"{source.stem}.ipynb"


def build(
    source_dir: Path = SOURCE_DIR,
    notebook_dir: Path = NOTEBOOK_DIR,
    force: bool = False,
    backup_dir: Path = BACKUP_DIR,
    only: list[Path] | None = None,
) -> dict[str, list[Path]]:
    """Regenerate the learner notebooks (all, or ``only`` those sources).

    Returns what was written, left unchanged and skipped.
    """
    result: dict[str, list[Path]] = {"written": [], "unchanged": [], "skipped": []}
    notebook_dir.mkdir(parents=True, exist_ok=True)
    for source in only or chapter_sources(source_dir):
        text, target = generate(source), target_for(source, notebook_dir)
        if target.exists():
            if target.read_text(encoding="utf-8") == text:
                result["unchanged"].append(target)
                continue
            edited = learner_edits(target)
            if edited and not force:
                print(
                    f"skipped {target}: exercise(s) {', '.join(edited)} hold your work "
                    "(use --force to overwrite it; a backup is kept)"
                )
                result["skipped"].append(target)
                continue
            if edited:
                backup_dir.mkdir(parents=True, exist_ok=True)
                stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
                backup = backup_dir / f"{target.stem}.{stamp}.ipynb"
                shutil.copy2(target, backup)
                print(f"backed up {target} to {backup}")
        target.write_text(text, encoding="utf-8")
        print(f"wrote {target}")
        result["written"].append(target)
    start = source_dir / START_SOURCE
    if only is None and start.exists():
        text, target = generate_start(start), notebook_dir / START_NOTEBOOK
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target}")
            result["written"].append(target)
    return result


def write_solutions(
    out_dir: Path, source_dir: Path = SOURCE_DIR, only: list[Path] | None = None
) -> list[Path]:
    """Write solution notebooks (for the test gates) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in only or chapter_sources(source_dir):
        path = out_dir / f"{source.stem}.ipynb"
        path.write_text(generate(source, solutions=True), encoding="utf-8")
        paths.append(path)
    return paths


def gate_notebook(source: Path, repeats: int = 1) -> str:
    """The learner notebook with each exercise solved right after its check.

    The test suite runs it once for both notebook gates: every check cell
    (tagged ``check``) must fail on the placeholder, naming its exercise; the
    solution's exercise cell and a second copy of the check follow it
    (tagged ``solved``), and that copy must pass; every other cell must pass.
    Cells after an exercise see its solution, as in the solution notebook;
    that no cell depends on an unsolved exercise is the build's lint
    (``_no_dependence``). With ``repeats`` > 1 the four cells (placeholder,
    check, solution, check) run that many times in a row, to show that every
    check gives the same verdict each time (``course_utils.stability``).
    """
    learner = nbformat.reads(generate(source), as_version=4)
    solved = nbformat.reads(generate(source, solutions=True), as_version=4)
    answers = {
        str(c.metadata.get("exercise")): c
        for c in solved.cells
        if "exercise" in c.metadata.get("tags", [])
    }
    cells, stub = [], {}
    for cell in learner.cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "code" and "exercise" in tags:
            stub[str(cell.metadata.get("exercise"))] = cell
        cells.append(cell)
        if cell.cell_type != "code" or "check" not in tags:
            continue
        ex = str(cell.metadata.get("exercise"))
        for k in range(repeats):
            again = [(stub[ex], ["exercise"]), (cell, ["check"])] if k else []
            for copy, tags in [*again, (answers[ex], ["solved-exercise"]),
                               (cell, ["solved"])]:
                cells.append(nbformat.v4.new_code_cell(
                    copy.source, id=f"gate{len(cells):04d}",
                    metadata={"tags": tags, "exercise": ex}))
    learner.cells = cells
    nbformat.validate(learner)
    return nbformat.writes(learner) + "\n"


def write_gate_notebooks(
    out_dir: Path, source_dir: Path = SOURCE_DIR, only: list[Path] | None = None
) -> list[Path]:
    """Write ``gate_notebook`` for each chapter into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in only or chapter_sources(source_dir):
        path = out_dir / f"{source.stem}.ipynb"
        path.write_text(gate_notebook(source), encoding="utf-8")
        paths.append(path)
    return paths


def same_notebook(a: str, b: str) -> bool:
    """Equal notebooks, but for the Python version in ``language_info``.

    The committed notebooks carry the version of the Python that generated
    them; a learner's Python may be another (``make lab`` regenerates them).
    """
    def norm(text: str) -> dict:
        nb = json.loads(text)
        nb.get("metadata", {}).get("language_info", {}).pop("version", None)
        return nb

    return a == b or norm(a) == norm(b)


def check(
    source_dir: Path = SOURCE_DIR, notebook_dir: Path = NOTEBOOK_DIR
) -> list[str]:
    """Problems that make ``notebooks/`` differ from what ``build`` would write."""
    problems = []
    expected = {
        target_for(s, notebook_dir).name: s for s in chapter_sources(source_dir)
    }
    for name, source in expected.items():
        target = notebook_dir / name
        if not target.exists():
            problems.append(f"{target}: missing (generate it from {source})")
        elif not same_notebook(target.read_text(encoding="utf-8"), generate(source)):
            problems.append(f"{target}: differs from what {source} generates")
    start = source_dir / START_SOURCE
    if start.exists():
        target = notebook_dir / START_NOTEBOOK
        expected[target.name] = start
        if not target.exists():
            problems.append(f"{target}: missing (generate it from {start})")
        elif not same_notebook(target.read_text(encoding="utf-8"),
                               generate_start(start)):
            problems.append(f"{target}: differs from what {start} generates")
    for nb in sorted(notebook_dir.glob("*.ipynb")):
        if nb.name not in expected:
            problems.append(f"{nb}: has no source in {source_dir}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "sources",
        nargs="*",
        type=Path,
        help="chapter sources to build (default: all of source/)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check that notebooks/ is what the sources generate",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite notebooks holding learners' work (backed up first)",
    )
    parser.add_argument(
        "--solutions",
        metavar="DIR",
        type=Path,
        help="also write solution notebooks into DIR",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check(SOURCE_DIR, NOTEBOOK_DIR)
            for p in problems:
                print(p)
            if problems:
                print("notebooks/ is not in sync with source/: run `make notebooks`")
                return 1
            n = len(chapter_sources(SOURCE_DIR))
            print(f"notebooks/ is in sync with source/ ({n} chapters)")
            return 0
        only = [s.resolve() for s in args.sources] or None
        result = build(SOURCE_DIR, NOTEBOOK_DIR, force=args.force, only=only)
        if args.solutions:
            for p in write_solutions(args.solutions, SOURCE_DIR, only=only):
                print(f"wrote {p}")
        if result["skipped"]:
            print(f"{len(result['skipped'])} notebook(s) skipped to keep your work")
        return 0
    except BuildError as e:
        print(f"build error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
