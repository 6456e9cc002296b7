"""The course's website in a real browser: build/book/ opened in headless Chromium.

    make book && .venv/bin/python -m pytest e2e/test_book.py

Opens the built site from its files (as a copy of ``build/book/`` is read
offline) with the system's ``chromium`` through Playwright, and checks that:

- the start page links every chapter, and every chapter page renders its
  title, its hardware line, the outputs of its run (plots and tables) and its
  exercises, unsolved, with links to the previous and next chapter;
- every image on every page loads, and the math is typeset;
- a static slider's page says where to move it;
- the search box finds each chapter by a word from its body;
- no request leaves the machine (each one is recorded, and any that is not a
  file of the site fails the test).

Screenshots go to ``build/e2e/book-*.png``. Without a built site the tests are
skipped, but under CI (``CI`` set) they fail: CI builds the site first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(os.environ.get("COURSE_BOOK_SITE") or ROOT / "build" / "book")
PAGES = ROOT / "build" / "book-src"  # the staged pages the site was built from
SHOTS = ROOT / "build" / "e2e"
CHAPTERS = sorted(p.stem for p in (ROOT / "source").glob("[0-9][0-9]_*.py"))

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="pip install -r requirements-e2e.txt")

if not (SITE / "index.html").exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"no site in {SITE}: CI runs `make book` before this")
    pytest.skip(f"no site in {SITE}: run `make book` first", allow_module_level=True)



@pytest.fixture()
def page(browser):
    """A page whose every request is recorded; one that leaves the site fails."""
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    outside: list[str] = []

    def route(r):
        url = r.request.url
        if url.startswith(SITE.resolve().as_uri()) or url.startswith(("data:",
                                                                      "blob:")):
            r.continue_()
        else:
            outside.append(url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    yield page
    context.close()
    assert not outside, f"requests that leave the site: {sorted(set(outside))[:10]}"


def _url(name: str, query: str = "") -> str:
    return (SITE / name).resolve().as_uri() + query


def _load(page, name: str) -> None:
    page.goto(_url(name), wait_until="load")
    page.wait_for_function("() => !window.MathJax || !MathJax.startup || "
                           "MathJax.startup.promise.then(() => true)")


def _broken_images(page) -> list[str]:
    for img in page.locator("article img").all():
        img.scroll_into_view_if_needed()  # lazy images load when seen
    page.wait_for_function("() => Array.from(document.images).every(i => i.complete)")
    broken = page.eval_on_selector_all(
        "img", "els => els.filter(e => !e.naturalWidth).map(e => e.src)")
    page.evaluate("window.scrollTo(0, 0)")  # the screenshot shows the top
    return broken


def _staged(name: str) -> dict:
    return json.loads((PAGES / f"{name}.ipynb").read_text())


def _images_in_run(name: str) -> int:
    return sum("image/png" in o.get("data", {})
               for c in _staged(name)["cells"] for o in c.get("outputs", []))


def test_start_page_links_every_chapter(page):
    _load(page, "index.html")
    assert "PyTorch Parallelism" in page.locator("h1").first.inner_text()
    hrefs = page.eval_on_selector_all("article a", "els => els.map(e => e.href)")
    for name in CHAPTERS:
        assert any(h.split("#")[0].endswith(f"/{name}.html") for h in hrefs), name
    nav = page.eval_on_selector_all(".bd-sidebar-primary a",
                                    "els => els.map(e => e.href)")
    assert sum(h.split("#")[0].endswith(tuple(f"/{n}.html" for n in CHAPTERS))
               for h in nav) == len(CHAPTERS), "the sidebar lists every chapter"
    assert not _broken_images(page)
    assert page.locator("input[type=search], .search-button").count()
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "book-index.png"))


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_page_renders_its_run(page, name):
    _load(page, f"{name}.html")
    number = int(name[:2])
    assert page.locator("h1").first.inner_text().startswith(f"Chapter {number}")
    body = page.locator("article").inner_text()
    assert re.search(r"CPU only \(\d+ cores\)|\d GPUs? \(", body), "no hardware line"
    assert "run top to bottom on" in body, "the page does not say where it ran"
    outputs = page.locator(".cell_output").count()
    assert outputs >= 10, f"only {outputs} cell outputs shown"
    assert not re.search(r"(interactive|IntSlider|VBox|HBox)\(children=", body), (
        "a widget shows as plain text")
    errors = page.locator(".cell_output .output.traceback").all_inner_texts()
    others = [e for e in errors if not re.match(r"Exercise \d+\.\d+ is not solved", e)]
    assert not others, f"a cell failed in the run shown: {others[0][-800:]}"
    unsolved = re.findall(r"Exercise (\d+\.\d+) is not solved yet", body)
    assert len(unsolved) >= 2 and all(u.startswith(f"{number}.") for u in unsolved)
    assert "passed" not in " ".join(
        page.locator(".tag_check .cell_output").all_inner_texts()).lower()
    assert not _broken_images(page), "images that do not load"
    shown = page.locator(".cell_output img").count()
    assert shown == _images_in_run(name), (
        f"{shown} images on the page, {_images_in_run(name)} in the run")
    if "$" in "".join("".join(c["source"]) for c in _staged(name)["cells"]
                      if c["cell_type"] == "markdown"):
        assert page.locator("mjx-container").count(), "math not typeset"
    if any("interact" in "".join(c["source"]) for c in _staged(name)["cells"]):
        assert "controls above cannot move" in body
    links = page.eval_on_selector_all(".prev-next-area a",
                                      "els => els.map(e => e.href)")
    assert links, "no link to the previous or next chapter"
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"book-{name}.png"))


def _words(name: str) -> Counter:
    text = " ".join("".join(c["source"]) for c in _staged(name)["cells"]
                    if c["cell_type"] == "markdown")
    return Counter(w.lower() for w in re.findall(r"\b[A-Za-z]{7,}\b", text))


def search_terms() -> dict[str, str]:
    """For each chapter, its most frequent long word that no other chapter uses."""
    words = {name: _words(name) for name in CHAPTERS}
    terms = {}
    for name, counts in words.items():
        others = set().union(*(set(w) for n, w in words.items() if n != name))
        own = [(n, w) for w, n in counts.items() if w not in others]
        terms[name] = max(own)[1]
    return terms


def _wait_for_all_results(page) -> None:
    """Sphinx's search lists its results one by one, then says it finished."""
    page.wait_for_function(
        "() => { const s = document.querySelector('#search-results .search-summary');"
        " return s && s.innerText.length > 0; }", timeout=30_000)


def test_search_finds_each_chapter_by_a_word_from_its_body(page):
    _load(page, "index.html")
    # through the search box, as a reader does
    terms = search_terms()
    first = CHAPTERS[0]
    page.keyboard.press("Control+k")
    box = page.locator(".search-button__search-container input, "
                       "#pst-search-dialog input").first
    box.fill(terms[first])
    box.press("Enter")
    _wait_for_all_results(page)
    assert f"{first}.html" in page.locator("#search-results").inner_html()
    for name, term in terms.items():
        page.goto(_url("search.html", f"?q={term}"), wait_until="load")
        _wait_for_all_results(page)
        found = page.eval_on_selector_all("#search-results li a",
                                          "els => els.map(e => e.href)")
        assert any(f"/{name}.html" in h for h in found), (
            f"searching {term!r} does not find {name}: {found[:5]}")


def _title(name: str) -> str:
    first = "".join(_staged(name)["cells"][0]["source"]).splitlines()[0]
    return first.lstrip("# ").strip()


def test_the_pdf_holds_every_chapter():
    """``make pdf``'s output, where it was built: every chapter, in order, after
    the table of contents, each with its unsolved exercises."""
    pdf = SITE.parent / "course.pdf"
    if not pdf.exists() or not shutil.which("pdftotext"):
        pytest.skip("no build/course.pdf (make pdf) or no pdftotext (poppler-utils)")
    text = subprocess.run(["pdftotext", "-layout", str(pdf), "-"], check=True,
                          capture_output=True, text=True).stdout
    text = re.sub(r"\s+", " ", text)
    titles = [re.sub(r"\s+", " ", _title(name)) for name in CHAPTERS]
    at = text.find(titles[-1])  # past the table of contents
    assert at >= 0, f"{titles[-1]!r} is not in the PDF"
    for title in titles:
        found = text.find(title, at + 1)
        assert found > at, f"{title!r} is not in the PDF after the chapter before it"
        at = found
    assert text.count("is not solved yet") >= 2 * len(CHAPTERS)


def test_no_solution_text_in_the_site():
    """Every line of every solution block, searched in every file of the site."""
    from course_utils import book

    assert book.leaks(SITE) == []
