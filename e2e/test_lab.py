"""The course in a real browser: JupyterLab driven by Playwright in Chromium.

    make e2e            # or: .venv/bin/python -m pytest e2e

For instructors. Starts JupyterLab on 127.0.0.1 (with a token) on a copy of
``notebooks/``, opens the start page and then each chapter in headless
Chromium (the system's ``chromium``: Playwright never downloads a browser
here), runs every cell the way a learner does - *Run All*, and after it stops
at an unsolved exercise's check, *Run Selected Cell and All Below* from the
next cell - and checks that:

- the only errors are the unsolved exercises' short messages (no traceback);
- the plots rendered, and no widget shows as plain text (the widget frontend
  is there);
- every slider still changes its output after every cell, exercises
  included, has run (an exercise must not break a chapter's slider); the
  sliders a chapter should show are counted from its code (widgets it makes,
  ``interact`` abbreviations, course helpers that make sliders), so a slider
  added to any chapter is checked without a list to update;
- every cell that draws a figure unconditionally (``plt.show()`` or a course
  helper that ends in one) shows a rendered image;
- a notebook opens clean (no unsaved changes before anything ran);
- the link that ``make lab`` prints opens the start page;
- interrupting a multi-process cell ends in one line, not a traceback, and
  Chapter 6's torchrun cell, interrupted or restarted mid-run, leaves no
  process and nothing in the temp directory.

Screenshots go to ``build/e2e/``. Every process started is stopped.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
# another folder of notebooks (e.g. solution notebooks) can be tested instead
NOTEBOOKS = Path(os.environ.get("COURSE_E2E_NOTEBOOKS") or ROOT / "notebooks")
SHOTS = ROOT / "build" / "e2e"
CHAPTERS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 120  # as nbval's: a cell that runs longer counts as hung

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="pip install -r requirements-e2e.txt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of notebooks/; yields its base URL and token."""
    root = tmp_path_factory.mktemp("course") / "notebooks"
    shutil.copytree(NOTEBOOKS, root)
    tmp = root.parent / "tmp"  # the kernels' temp directory, watched below
    tmp.mkdir()
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.news_url=", "--ServerApp.port_retries=0"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(root.parent / "lab.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, cwd=root,
                              env=dict(os.environ, TMPDIR=str(tmp)))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n"
                                + (root.parent / "lab.log").read_text()[-2000:])
                time.sleep(0.5)
        yield {"base": base, "token": token, "root": root, "tmp": tmp}
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)  # the server and its kernels
            server.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)
        log.close()



def _open(browser, lab, name: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # a fresh workspace per notebook: nothing restored from an earlier run
    page.goto(f"{lab['base']}/lab/workspaces/e2e-{name[:2]}/tree/{name}"
              f"?reset&token={lab['token']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                           "#jp-main-statusbar :text('Idle')", timeout=60_000)
    return page


def _menu(page, menu: str, item: str) -> None:
    page.click(f".lm-MenuBar-itemLabel:text-is('{menu}')")
    page.click(f".lm-Menu-itemLabel:text-is('{item}')")


def _wait_idle(page, timeout_s: float) -> None:
    """Until no cell is queued or running ([*]) for a second."""
    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 4:
        busy = page.eval_on_selector_all(
            ".jp-Notebook .jp-InputPrompt",
            "els => els.some(e => e.textContent.includes('*'))")
        calm = 0 if busy else calm + 1
        if time.monotonic() > deadline:
            raise AssertionError(f"cells still running after {timeout_s:.0f} s")
        time.sleep(0.25)


CELLS_JS = """els => els.map((c, i) => ({
  index: i,
  code: c.classList.contains('jp-CodeCell'),
  prompt: (c.querySelector('.jp-InputPrompt') || {}).textContent || '',
  error: Array.from(c.querySelectorAll(
      ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"))
      .map(e => e.textContent).join('\\n'),
  images: c.querySelectorAll('.jp-OutputArea-output img').length,
  text: Array.from(c.querySelectorAll('.jp-OutputArea-output'))
      .map(e => e.textContent).join('\\n'),
}))"""


def _cells(page) -> list[dict]:
    return page.eval_on_selector_all(".jp-Notebook .jp-Cell", CELLS_JS)


def _is_unsolved(error: str) -> bool:
    return bool(re.search(r"Exercise \d+\.\d+ is not solved yet", error)) and (
        "Traceback" not in error)


def _run_everything(page, name: str, n_cells: int) -> list[dict]:
    """Run All, then past each unsolved check, like a learner following the note."""
    _menu(page, "Run", "Run All Cells")
    seen_errors: set[int] = set()
    for _ in range(n_cells):
        _wait_idle(page, CELL_TIMEOUT_S * 3)
        cells = _cells(page)
        new = [c for c in cells if c["error"] and c["index"] not in seen_errors]
        if not new:
            return cells
        cell = new[0]
        assert _is_unsolved(cell["error"]), (
            f"{name}: cell {cell['index']} raised something other than an unsolved "
            f"exercise's message:\n{cell['error'][-1500:]}")
        seen_errors.add(cell["index"])
        if cell["index"] + 1 >= len(cells):
            return cells
        # on the prompt area: the cell becomes the active one (the collapser
        # bar at the far left only folds a code cell's input); a click that
        # lands while the notebook still scrolls or re-renders selects another
        # cell, so the run is checked and, if nothing below started, retried
        for _attempt in range(3):
            page.locator(".jp-Notebook .jp-Cell").nth(cell["index"] + 1).click(
                position={"x": 40, "y": 8})
            _menu(page, "Run", "Run Selected Cell and All Below")
            if _wait_started(page, cell["index"] + 1):
                break
            _wait_idle(page, CELL_TIMEOUT_S * 3)
    return _cells(page)


def _wait_started(page, first: int, timeout_s: float = 30) -> bool:
    """Until the first code cell from ``first`` on is queued, running or done."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        below = [c for c in _cells(page)[first:] if c["code"]]
        if not below or re.search(r"\[(\*|\d+)\]", below[0]["prompt"]):
            return True
        time.sleep(0.25)
    return False


def _code(name: str) -> str:
    nb = json.loads((NOTEBOOKS / name).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"]
                     if c["cell_type"] == "code")


def _cell_trees(name: str) -> list[tuple[int, ast.Module | None]]:
    """(index among all cells, parsed code) of each code cell; magics left out."""
    nb = json.loads((NOTEBOOKS / name).read_text())
    out = []
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code":
            continue
        lines = [ln for ln in "".join(c["source"]).splitlines()
                 if not ln.lstrip().startswith(("%", "!"))]
        try:
            out.append((i, ast.parse("\n".join(lines))))
        except SyntaxError:  # a cell magic's body (%%writefile): not Python here
            out.append((i, None))
    return out


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _helpers() -> tuple[dict[str, int], set[str]]:
    """course_utils functions: how many sliders each makes; which draw a figure."""
    bodies = {}
    for path in sorted((ROOT / "course_utils").glob("*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                bodies[node.name] = (ast.get_source_segment(text, node), node)
    sliders = {n: len(re.findall(r"\w*Slider\(", src))
               for n, (src, _) in bodies.items()}
    plotting = {n for n, (src, _) in bodies.items() if "plt.show()" in src}
    grew = True
    while grew:  # a helper that calls a plotting helper plots too
        grew = False
        for n, (_, node) in bodies.items():
            calls = {_call_name(c) for c in ast.walk(node) if isinstance(c, ast.Call)}
            if n not in plotting and calls & plotting:
                plotting.add(n)
                grew = True
            more = sum(sliders[c] for c in calls if c in sliders and c != n)
            if more > sliders[n] and "Slider(" not in bodies[n][0]:
                sliders[n] = more
                grew = True
    return {n: k for n, k in sliders.items() if k}, plotting


def _expected_sliders(name: str) -> int:
    """Sliders the chapter's code makes, as far as its text tells."""
    helper_sliders, _ = _helpers()
    count = 0
    for _, tree in _cell_trees(name):
        for node in ast.walk(tree) if tree else []:
            if not isinstance(node, ast.Call):
                continue
            called = _call_name(node)
            if called.endswith("Slider"):
                count += 1
            elif called == "interact":  # (min, max[, step]) abbreviations
                count += sum(isinstance(k.value, ast.Tuple) for k in node.keywords)
            else:
                count += helper_sliders.get(called, 0)
    return count


def _figure_cells(name: str) -> list[int]:
    """Cells that draw a figure whatever the machine: ``plt.show()`` or a
    plotting helper called outside any ``if`` and any function definition."""
    _, plotting = _helpers()
    cells = []
    for i, tree in _cell_trees(name):
        for stmt in tree.body if tree else []:
            if isinstance(stmt, (ast.If, ast.FunctionDef, ast.ClassDef, ast.Try)):
                continue  # conditional, or not run here
            calls = [c for c in ast.walk(stmt) if isinstance(c, ast.Call)]
            if any(_call_name(c) in plotting or (_call_name(c) == "show" and
                   isinstance(c.func, ast.Attribute)
                   and getattr(c.func.value, "id", "") == "plt") for c in calls):
                cells.append(i)
                break
    return cells


def _has_sliders(name: str) -> bool:
    return _expected_sliders(name) > 0


def _has_plots(name: str) -> bool:
    return bool(re.search(r"\bplt\.|\bplot_\w+\(|\bImage\(", _code(name)))


def test_start_page_opens_clean_with_its_pictures(browser, lab):
    page = _open(browser, lab, "START_HERE.ipynb")
    try:
        page.wait_for_selector(".jp-RenderedMarkdown :text('The chapters')")
        page.wait_for_selector(".jp-RenderedMarkdown img", state="attached")
        deadline = time.monotonic() + 20
        while True:
            sizes = page.eval_on_selector_all(
                ".jp-RenderedMarkdown img", "els => els.map(e => e.naturalWidth)")
            if (sizes and min(sizes) > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sizes and all(w > 100 for w in sizes), f"images not shown: {sizes}"
        hrefs = page.eval_on_selector_all(
            ".jp-RenderedMarkdown a", "els => els.map(e => e.getAttribute('href'))")
        links = sum(".ipynb" in (h or "") for h in hrefs)
        assert links >= len(CHAPTERS)
        time.sleep(2)
        assert not page.query_selector(".jp-mod-dirty"), "opens with unsaved changes"
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "START_HERE.png"))
    finally:
        page.close()


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_runs_in_the_browser(browser, lab, name):
    page = _open(browser, lab, name)
    try:
        time.sleep(1)
        assert not page.query_selector(".jp-mod-dirty"), (
            f"{name} opens with unsaved changes (its metadata is rewritten on open)")
        n_cells = page.locator(".jp-Notebook .jp-Cell").count()
        cells = _run_everything(page, name, n_cells)
        code = [c for c in cells if c["code"]]
        unrun = [c["index"] for c in code if not re.search(r"\[\d+\]", c["prompt"])]
        assert not unrun, f"{name}: cells never ran: {unrun[:10]}"
        raw = [c for c in code if re.search(
            r"(interactive|IntSlider|FloatSlider|VBox|HBox|Output)\(", c["text"])]
        assert not raw, (f"{name}: a widget shows as plain text (no widget frontend):"
                         f" {raw[0]['text'][:200]}")
        if _has_plots(name):
            assert sum(c["images"] for c in code) > 0, f"{name}: no plot rendered"
        missing = [i for i in _figure_cells(name) if not cells[i]["images"]]
        assert not missing, f"{name}: cells that draw a figure show none: {missing}"
        widths = page.eval_on_selector_all(".jp-OutputArea-output img",
                                           "els => els.map(e => e.naturalWidth)")
        assert all(w > 0 for w in widths), f"{name}: a figure did not render"
        SHOTS.mkdir(parents=True, exist_ok=True)
        if _has_sliders(name):
            _every_slider_changes_its_output(page, name, _expected_sliders(name))
        page.screenshot(path=str(SHOTS / f"{name[:-6]}.png"), full_page=False)
    finally:
        page.close()


SLIDERS = ".widget-slider .noUi-handle, .widget-hslider .noUi-handle"


def _every_slider_changes_its_output(page, name: str, expected: int) -> None:
    """Move each slider; its output must change and show no error."""
    sliders = page.locator(SLIDERS)
    assert sliders.count() >= expected, (
        f"{name}: its code makes {expected} sliders, {sliders.count()} are shown")
    for i in range(sliders.count()):
        slider = sliders.nth(i)
        slider.scroll_into_view_if_needed()
        area = slider.locator("xpath=ancestor::div[contains(@class,"
                              "'jp-OutputArea-output')][1]")
        cell = slider.locator("xpath=ancestor::div[contains(@class,'jp-Cell')][1]")
        before = area.inner_html()
        slider.focus()
        for _ in range(3):
            page.keyboard.press("ArrowRight")
        deadline = time.monotonic() + 60
        while area.inner_html() == before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert area.inner_html() != before, (
            f"{name}: moving slider {i + 1} did not change its output")
        time.sleep(1)
        errors = cell.locator(".jp-OutputArea-output[data-mime-type="
                              "'application/vnd.jupyter.stderr']").all_inner_texts()
        assert not any(errors), (f"{name}: slider {i + 1} shows an error once "
                                 f"every cell has run:\n{errors[0][-1500:]}")


def test_the_printed_link_opens_the_start_page(browser):
    """``make lab`` prints a link; on a remote machine it is all a learner has."""
    port = _free_port()
    extra = f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port={port}"
    log_path = SHOTS / "make_lab.log"
    SHOTS.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(["make", "--no-print-directory", "lab",
                                   f"LAB_EXTRA={extra}"], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, link = time.monotonic() + 120, None
        while link is None and time.monotonic() < deadline:
            found = re.search(rf"http://127\.0\.0\.1:{port}/\S+token=\w+",
                              log_path.read_text())
            link = found.group(0) if found else None
            assert server.poll() is None or link, log_path.read_text()[-2000:]
            time.sleep(0.5)
        assert link, "make lab printed no link:\n" + log_path.read_text()[-2000:]
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(link)
            page.wait_for_selector(".jp-RenderedMarkdown :text('The chapters')",
                                   timeout=60_000)
        finally:
            page.close()
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(server.pid, signal.SIGKILL)


PROBE = ("import time\n"
         "from course_utils.dist import launch\n"
         "launch(lambda rank, ws: time.sleep(60), 2, timeout=120)")


def test_an_interrupted_launch_reads_as_one_line(browser, lab):
    # a notebook like the chapters', with one multi-process cell
    nb = json.loads((NOTEBOOKS / CHAPTERS[0]).read_text())
    nb["cells"] = [{"cell_type": "code", "execution_count": None, "id": "launch",
                    "metadata": {}, "outputs": [], "source": PROBE}]
    (lab["root"] / "interrupt_probe.ipynb").write_text(json.dumps(nb))
    page = _open(browser, lab, "interrupt_probe.ipynb")
    try:
        time.sleep(1)
        _menu(page, "Run", "Run All Cells")
        try:
            page.wait_for_selector(
                ".jp-OutputArea-output :text('launching 2 processes')",
                timeout=60_000)
        finally:
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "interrupt_probe.png"))
        time.sleep(1)
        _menu(page, "Kernel", "Interrupt Kernel")
        _wait_idle(page, 60)
        (cell,) = _cells(page)
        error = cell["error"].strip()
        assert "interrupted: all 2 ranks stopped" in error, cell["text"][-1500:]
        assert "Traceback" not in error and len(error.splitlines()) <= 3, error
    finally:
        page.close()


def _torchrun_probe(lab) -> str:
    """Chapter 6 up to its torchrun cell, as a notebook of its own."""
    chapter = next(c for c in CHAPTERS if c.startswith("06_"))
    nb = json.loads((NOTEBOOKS / chapter).read_text())
    last = next(i for i, c in enumerate(nb["cells"])
                if "TORCHRUN = " in "".join(c["source"]))
    nb["cells"] = nb["cells"][:last + 1]
    (lab["root"] / "torchrun_probe.ipynb").write_text(json.dumps(nb))
    return "torchrun_probe.ipynb"


def _torchrun_processes(tmp: Path) -> list[psutil.Process]:
    """torchrun's agent and workers (forked: same command line) of the probe."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if "torch.distributed.run" in line and str(tmp) in line:
            found.append(p)
    return found


def _start_torchrun(page, lab, menu: tuple[str, str]) -> None:
    """Run the probe until torchrun's agent and both workers are up."""
    _menu(page, *menu)
    deadline = time.monotonic() + CELL_TIMEOUT_S * 3
    while len(_torchrun_processes(lab["tmp"])) < 3:
        assert time.monotonic() < deadline, "torchrun's workers never started"
        time.sleep(0.1)


# caches with one fixed name per user, reused by every run: they do not pile up
CACHES = ("torchinductor_",)


def _nothing_left(lab, before: set[str], what: str) -> None:
    deadline = time.monotonic() + 30  # a killed kernel's watchdog may lag
    while True:
        procs = _torchrun_processes(lab["tmp"])
        left = sorted(n for n in set(os.listdir(lab["tmp"])) - before
                      if not n.startswith(CACHES))
        if not procs and not left:
            return
        assert time.monotonic() < deadline, (
            f"{what}: left running {[p.pid for p in procs]}, left in the temp "
            f"directory {left}")
        time.sleep(0.5)


def test_torchrun_interrupted_or_restarted_leaves_nothing(browser, lab):
    """Chapter 6's torchrun cell: stopped mid-run twice, the way a learner would."""
    before = set(os.listdir(lab["tmp"]))
    page = _open(browser, lab, _torchrun_probe(lab))
    try:
        time.sleep(1)
        _start_torchrun(page, lab, ("Run", "Run All Cells"))
        _menu(page, "Kernel", "Interrupt Kernel")
        _wait_idle(page, 60)
        cell = [c for c in _cells(page) if c["code"]][-1]
        error = cell["error"].strip()
        assert "interrupted: the command" in error and "nothing left running" in \
            error, cell["text"][-1500:]
        assert "Traceback" not in error and len(error.splitlines()) == 1, error
        assert not _torchrun_processes(lab["tmp"]), "the interrupt left torchrun"
        # again, and now restart the kernel in the middle of the run
        _start_torchrun(page, lab, ("Run", "Run All Cells"))
        _menu(page, "Kernel", "Restart Kernel…")
        page.click(".jp-Dialog .jp-mod-accept")
        _wait_idle(page, 60)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "torchrun_probe.png"))
        _nothing_left(lab, before, "a restart during torchrun")
    finally:
        page.close()
