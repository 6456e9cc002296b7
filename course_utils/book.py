"""The course as a website and a PDF, built from each chapter's real run.

    python -m course_utils.book          # the website, build/book/ (make book)
    python -m course_utils.book --pdf    # and build/course.pdf (make pdf)
    python -m course_utils.book --leaks build/book   # solution text in a site?

Each chapter runs once, top to bottom in a fresh kernel, as the test gate runs
it (``build.gate_notebook``): the learner notebook with every exercise solved
right after its check. The page then drops the solved copies and their
outputs, so it shows the learner's notebook - exercises unsolved, each check's
short "not solved yet" message - and every later cell keeps the output of a
real run. A slider's page shows the output of its default setting and says to
open the notebook to move it. Runs are kept in ``build/book-runs/``, keyed by
the chapter, ``course_utils``, the Python packages and the machine: ``make
pdf`` after ``make book`` (or a second ``make book``) reruns nothing that did
not change.

Sphinx with myst-nb renders the pages (``book/conf.py``); nothing is fetched
from the internet at build time or by the pages (MathJax ships with the site).
Introduced by the README ("Read it as a website").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import html
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from course_utils import build, exercises, grade

ROOT = build.ROOT
CONF_DIR = ROOT / "book"
OUT = ROOT / "build"
RUNS = OUT / "book-runs"  # executed gate notebooks, one per chapter
STAGE = OUT / "book-src"  # the pages as Sphinx reads them
SITE = OUT / "book"
SINGLE = OUT / "book-single"  # one page holding every chapter, for the PDF
PDF = OUT / "course.pdf"
CELL_TIMEOUT_S = 120  # as nbval's (course_utils.grade)
DROPPED_TAGS = {"solved", "solved-exercise"}  # the gate's solution cells
DROPPED_IDS = {"generated", "run-all-note"}  # notes about the notebook file
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
CONTROLS = re.compile(r"(Slider|Dropdown|ToggleButtons|Checkbox|Text|Select)Model$")
SITE_SECTION = re.compile(r"\n## Read it as a website\n.*?(?=\n## |\Z)", re.S)


class BookError(Exception):
    """A chapter whose run cannot be shown (a cell failed that should not)."""


# --- running a chapter ------------------------------------------------------------


def machine() -> str:
    """The building machine in words: CPU model, cores, GPUs."""
    from course_utils import devices

    facts = devices.cpu_facts()
    gpus = devices.gpu_names() if devices.gpu_count() else []
    gpu = ", ".join(sorted(set(gpus))) if gpus else "no GPU"
    return f"{facts['model']} ({facts['usable_cores']} cores), {gpu}"


def run_key(source: Path, gate: str) -> str:
    """What a chapter's run depends on: its gate notebook, the helpers, the setup."""
    h = hashlib.sha1(gate.encode("utf-8"))
    pkg = ROOT / "course_utils"
    for path in sorted(pkg.rglob("*")):
        if (path.is_file() and "__pycache__" not in path.parts
                and path.name != "book.py"):  # the page maker, not the run
            h.update(str(path.relative_to(pkg)).encode())
            h.update(path.read_bytes())
    for req in sorted(ROOT.glob("requirements*.txt")):
        h.update(req.read_bytes())
    h.update(f"{platform.python_version()} {platform.node()}".encode())
    return h.hexdigest()


def check_run(nb, name: str) -> None:
    """Every cell passed but the checks, and each check failed on its placeholder."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tags = set(cell.metadata.get("tags", []))
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if "check" in tags:
            text = "\n".join("\n".join(o.traceback) for o in errors)
            if "not solved yet" not in text:
                problems.append(f"cell {i} (check {cell.metadata.get('exercise')}) "
                                "did not fail on its placeholder")
        elif errors and tags & DROPPED_TAGS:
            # a solution that fails its check is the test gate's to report;
            # the page drops it, and no cell shown may use it (build's lint)
            print(f"warning: {name}, cell {i}: exercise {cell.metadata.get('exercise')}"
                  f"'s solution failed its check ({errors[0].ename})", flush=True)
        elif errors:
            problems.append(f"cell {i}: {errors[0].ename}: {errors[0].evalue}"[:500])
    if problems:
        raise BookError(f"{name}: " + "; ".join(problems))


def execute(source: Path, runs: Path = RUNS, force: bool = False) -> Path:
    """Run a chapter's gate notebook once (or reuse the kept run); its path."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    gate = build.gate_notebook(source)
    key = run_key(source, gate)
    path = runs / f"{source.stem}.ipynb"
    if path.exists() and not force:
        kept = nbformat.read(path, as_version=4)
        if kept.metadata.get("book", {}).get("key") == key:
            print(f"{source.stem}: reusing the run of "
                  f"{kept.metadata['book']['date']}", flush=True)
            return path
    nb = nbformat.reads(gate, as_version=4)
    print(f"{source.stem}: running every cell ...", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as cwd:  # files a chapter writes go here
        # a local socket file, not TCP on a port: nothing to listen on
        km = KernelManager(kernel_name="python3", transport="ipc",
                           ip=os.path.join(cwd, "kernel"))
        # seconds on a quiet machine, stretched as course_utils.grade does
        stretch = max(1.0, exercises.slowdown())
        client = NotebookClient(
            nb, km=km, timeout=round(CELL_TIMEOUT_S * stretch),
            startup_timeout=round(grade.STARTUP_S * stretch),
            allow_errors=True, store_widget_state=True,
            resources={"metadata": {"path": cwd}})
        # the kernel, and every process it starts, imports this course's
        # course_utils, whichever one the environment has installed
        pythonpath = os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        try:
            client.execute(env={**os.environ, "PYTHONPATH": pythonpath})
        finally:  # the client ends only the kernels it started itself
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    wall = time.monotonic() - start
    check_run(nb, source.name)
    nb.metadata["book"] = {
        "key": key,
        "machine": machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": round(wall, 1),
    }
    runs.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    print(f"{source.stem}: ran in {wall:.0f} s", flush=True)
    return path


# --- the page a learner reads -------------------------------------------------------


def _widget_tree(state: dict, model_id: str, seen: set[str] | None = None):
    """The models under ``model_id`` (itself first), children in order."""
    seen = set() if seen is None else seen
    if model_id in seen or model_id not in state:
        return
    seen.add(model_id)
    model = state[model_id]
    yield model
    for child in model.get("state", {}).get("children", []):
        yield from _widget_tree(state, str(child).removeprefix("IPY_MODEL_"), seen)


def static_outputs(output: dict, state: dict) -> tuple[list, bool]:
    """A widget's view as the outputs its default setting drew; has it controls?

    ``interact`` draws into an Output widget, whose outputs the run stored in
    the notebook's widget state. A widget without one (a progress bar) shows
    nothing on a static page.
    """
    view = output.get("data", {}).get(WIDGET_VIEW, {})
    models = list(_widget_tree(state, view.get("model_id", "")))
    outs = [nbformat.from_dict(o) for m in models
            if m.get("model_name") == "OutputModel"
            for o in m.get("state", {}).get("outputs", [])]
    controls = any(CONTROLS.search(m.get("model_name", "")) for m in models)
    return outs, controls


def slider_note(notebook: str) -> str:
    return (f"*On this page the controls above cannot move: it shows the output "
            f"of their default setting. Open `notebooks/{notebook}` in JupyterLab "
            "(`make lab`) to move them.*")


def learner_view(nb, notebook: str):
    """The executed gate notebook as the learner's page: no solution anywhere.

    Drops the solved exercises and their checks' second runs (cells tagged
    ``solved-exercise`` and ``solved``) with their outputs, and the notes
    about the notebook file; turns each widget into its default output, with a
    note under it where it has controls; adds a line saying where and when
    the chapter ran.
    """
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))  # a deep copy
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    cells = []
    for cell in nb.cells:
        tags = set(cell.metadata.get("tags", []))
        if tags & DROPPED_TAGS or cell.get("id") in DROPPED_IDS:
            continue
        controls = False
        if cell.cell_type == "code":
            outputs = []
            for out in cell.outputs:
                if WIDGET_VIEW in out.get("data", {}):
                    shown, has = static_outputs(out, state)
                    outputs += shown
                    controls = controls or has
                else:
                    outputs.append(out)
            cell.outputs = outputs
            cell.execution_count = None
        cells.append(cell)
        if controls:
            cells.append(nbformat.v4.new_markdown_cell(
                slider_note(notebook), id=f"static-{len(cells):03d}"))
    info = nb.metadata.get("book", {})
    if info and cells and cells[0].cell_type == "markdown":
        cells.insert(1, nbformat.v4.new_markdown_cell(run_line(info, notebook),
                                                      id="book-run"))
    nb.cells = cells
    nb.metadata.pop("widgets", None)
    return nb


def run_line(info: dict, notebook: str) -> str:
    return (f"*This page is `notebooks/{notebook}` run top to bottom on "
            f"{info['machine']} on {info['date']} ({info['wall_s']:.0f} s), "
            "with its exercises unsolved. Its outputs are that machine's; "
            "your run shows yours.*")


def solution_blocks(source: Path) -> list[str]:
    """The text of every solution block of a chapter source, markers excluded."""
    blocks, current = [], None
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.strip() == build.BEGIN:
            current = []
        elif line.strip() == build.END and current is not None:
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _site_lines(site: Path) -> dict[Path, set[str]]:
    """Each file of a built site as the set of its text's stripped lines."""
    found = {}
    for path in sorted(site.rglob("*")):
        if not path.is_file() or path.suffix not in {".html", ".js", ".txt",
                                                      ".ipynb", ".json"}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".html":
            text = html.unescape(re.sub(r"<[^>]+>", "", text))
        found[path] = {ln.strip() for ln in text.splitlines() if ln.strip()}
    return found


def leaks(site: Path, sources: list[Path] | None = None) -> list[str]:
    """Solution lines found in a built site; empty when it shows no solution.

    A line of a solution block leaks when a file of the site holds it and no
    learner notebook does (a line such as ``optimizer.step()`` is in chapters'
    own code as well). Lines shorter than 12 characters are too common to tell.
    """
    sources = sources or build.chapter_sources()
    files = _site_lines(site)
    allowed = {ln.strip() for source in sources
               for c in nbformat.reads(build.generate(source), as_version=4).cells
               for ln in c.source.splitlines()}
    found = []
    for source in sources:
        for k, block in enumerate(solution_blocks(source), 1):
            lines = {ln.strip() for ln in block.splitlines()}
            lines = {ln for ln in lines if len(ln) >= 12 and ln not in allowed}
            for path, text in files.items():
                for ln in sorted(lines & text):
                    found.append(f"{path.relative_to(site)}: solution {k} of "
                                 f"{source.name}: {ln}")
    return found


# --- the site and the PDF ----------------------------------------------------------


def stage(chapters: list[tuple[Path, Path]], stage_dir: Path = STAGE) -> Path:
    """Write the pages Sphinx reads: the start page, each chapter, the images."""
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    stage_dir.mkdir(parents=True)
    shutil.copytree(ROOT / "images", stage_dir / "images")
    names = []
    for source, run in chapters:
        nb = learner_view(nbformat.read(run, as_version=4), f"{source.stem}.ipynb")
        nbformat.write(nb, stage_dir / f"{source.stem}.ipynb")
        names.append(source.stem)
    start = (build.SOURCE_DIR / build.START_SOURCE).read_text(encoding="utf-8")
    start = SITE_SECTION.sub("", start).replace("](../images/", "](images/")
    title, _, rest = start.partition("\n")
    intro = ("*This website shows each chapter with the outputs of a real run, "
             "exercises unsolved. To run the chapters, move the sliders and "
             "solve the exercises, clone the course and type `make lab`.*")
    toc = "\n".join(["", "```{toctree}", ":hidden:", ":maxdepth: 1", "", *names,
                     "```", ""])
    (stage_dir / "index.md").write_text(f"{title}\n\n{intro}\n{rest}\n{toc}",
                                        encoding="utf-8")
    return stage_dir


def sphinx(builder: str, out: Path, stage_dir: Path = STAGE) -> None:
    """Run Sphinx on the staged pages with the book's configuration."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "sphinx", "-b", builder, "-c", str(CONF_DIR),
           # a warning (a broken link, an output it cannot show) fails the build
           "-q", "-W", "--keep-going", "-j", "1", str(stage_dir), str(out)]
    subprocess.run(cmd, check=True)
    prune_mathjax(out)


MATHJAX_KEPT = {"tex-chtml.js", "loader.js", "startup.js", "core.js"}


def prune_mathjax(out: Path) -> None:
    """Drop the MathJax bundles the pages never load (14 MB of a 39 MB site).

    The pages load ``tex-chtml.js``, which loads what else it needs from the
    folders beside it; the other top-level bundles are other set-ups of it.
    """
    for bundle in (out / "_static" / "mathjax").glob("*.js"):
        if bundle.name not in MATHJAX_KEPT:
            bundle.unlink()


def print_pdf(single: Path = SINGLE, pdf: Path = PDF) -> Path:
    """Print the one-page build to a PDF with headless Chromium (Playwright)."""
    from playwright.sync_api import sync_playwright

    chromium = (os.environ.get("CHROMIUM") or shutil.which("chromium")
                or shutil.which("chromium-browser"))
    if not chromium:
        raise BookError("make pdf prints with Chromium: install it (Debian: "
                        "apt-get install chromium) or set CHROMIUM=/path/to/chrome")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page()
        page.goto((single / "index.html").resolve().as_uri(), wait_until="load")
        page.wait_for_function(
            "() => !window.MathJax || !MathJax.startup || "
            "MathJax.startup.promise.then(() => true)", timeout=60_000)
        page.emulate_media(media="print")
        page.pdf(path=str(pdf), format="A4", print_background=False,
                 margin={"top": "15mm", "bottom": "15mm", "left": "12mm",
                         "right": "12mm"},
                 display_header_footer=True, header_template="<span></span>",
                 footer_template=("<div style='font-size:8px;width:100%;"
                                  "text-align:center'><span class='pageNumber'>"
                                  "</span> / <span class='totalPages'></span></div>"))
        browser.close()
    return pdf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.book",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--pdf", action="store_true",
                        help="also print the course to build/course.pdf")
    parser.add_argument("--rerun", action="store_true",
                        help="run every chapter again, even when a kept run is current")
    parser.add_argument("--leaks", type=Path, metavar="SITE",
                        help="only list solution lines found in a built site")
    args = parser.parse_args(argv)
    if args.leaks:
        found = leaks(args.leaks)
        print("\n".join(found) or f"{args.leaks}: no solution text")
        return 1 if found else 0
    start = time.monotonic()
    chapters = [(s, execute(s, force=args.rerun)) for s in build.chapter_sources()]
    ran = time.monotonic() - start
    stage(chapters)
    sphinx("html", SITE)
    found = leaks(SITE)
    if found:
        print("solution text in the site:\n" + "\n".join(found[:20]))
        return 1
    print(f"wrote {SITE / 'index.html'} (chapters {ran:.0f} s, "
          f"in all {time.monotonic() - start:.0f} s)")
    if args.pdf:
        sphinx("singlehtml", SINGLE)
        found = leaks(SINGLE)
        if found:
            print("solution text in the PDF's page:\n" + "\n".join(found[:20]))
            return 1
        print(f"wrote {print_pdf()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
