"""The website's plumbing (course_utils.book): the page a learner reads shows no
solution, keeps every other cell's real output, turns sliders into their
default output with a note, and the leak check finds a solution in a site.

Rendering the site (Sphinx) and opening it in a browser is e2e/test_book.py.
"""

import html

import nbformat
import pytest

from course_utils import book, build

CHAPTERS = build.chapter_sources()
ERROR = {"output_type": "error", "ename": "ExerciseNotSolved", "evalue": "",
         "traceback": ["Exercise 0.1 is not solved yet.", "  hint: ..."]}


def _code(source, tags=(), exercise=None, outputs=()):
    meta = {"tags": list(tags)}
    if exercise:
        meta["exercise"] = exercise
    cell = nbformat.v4.new_code_cell(source, metadata=meta)
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    cell.execution_count = 3
    return cell


def _stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def _gate_run():
    """An executed gate notebook as nbclient leaves it, in small."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Chapter 0: a title"),
        _code("banner()", outputs=[_stream("CPU only (2 cores)\n")]),
        _code("def f():\n    raise NotImplementedError('Exercise 0.1')",
              tags=["exercise"], exercise="0.1"),
        _code("check_f(f)", tags=["check"], exercise="0.1", outputs=[ERROR]),
        _code("def f():\n    return sorted_secret_answer(42)",
              tags=["solved-exercise"], exercise="0.1"),
        _code("check_f(f)", tags=["solved"], exercise="0.1",
              outputs=[_stream("Exercise 0.1 passed\n")]),
        _code("print(1 + 1)", outputs=[_stream("2\n")]),
    ]
    nb.cells.insert(2, nbformat.v4.new_markdown_cell("**Run All stops**"))
    nb.cells[2]["id"] = "run-all-note"
    nb.cells.append(nbformat.v4.new_markdown_cell("<small>Generated</small>"))
    nb.cells[-1]["id"] = "generated"
    nb.metadata["book"] = {"machine": "Some CPU (2 cores), no GPU",
                           "date": "2026-01-01 00:00 UTC", "wall_s": 12.3, "key": "k"}
    return nb


def test_learner_view_drops_solutions_and_keeps_real_outputs():
    page = book.learner_view(_gate_run(), "00_x.ipynb")
    text = nbformat.writes(page)
    assert "sorted_secret_answer" not in text
    assert "passed" not in text  # the solved check's output went with it
    assert "Run All stops" not in text and "Generated" not in text
    sources = [c.source for c in page.cells]
    assert "check_f(f)" in sources and "print(1 + 1)" in sources
    check = next(c for c in page.cells if c.source == "check_f(f)")
    assert check.outputs[0].output_type == "error"  # the learner's own view
    last = next(c for c in page.cells if c.source == "print(1 + 1)")
    assert last.outputs[0].text == "2\n"
    assert page.cells[1].cell_type == "markdown"
    assert "Some CPU (2 cores), no GPU" in page.cells[1].source
    assert "2026-01-01" in page.cells[1].source
    assert all(c.get("execution_count") is None for c in page.cells
               if c.cell_type == "code")


def test_learner_view_leaves_its_input_unchanged():
    nb = _gate_run()
    before = nbformat.writes(nb)
    book.learner_view(nb, "00_x.ipynb")
    assert nbformat.writes(nb) == before


def _widget_run(models, view_id):
    nb = _gate_run()
    nb.cells.insert(2, _code("interact(draw, n=IntSlider(4))", outputs=[{
        "output_type": "display_data",
        "data": {book.WIDGET_VIEW: {"model_id": view_id, "version_major": 2},
                 "text/plain": "interactive(children=(IntSlider(value=4),))"},
        "metadata": {}}]))
    nb.metadata["widgets"] = {book.WIDGET_STATE: {"state": models}}
    return nb


def test_a_slider_shows_its_default_output_and_says_where_to_move_it():
    png = {"output_type": "display_data", "metadata": {},
           "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}}
    models = {
        "box": {"model_name": "VBoxModel",
                "state": {"children": ["IPY_MODEL_slider", "IPY_MODEL_out"]}},
        "slider": {"model_name": "IntSliderModel", "state": {"value": 4}},
        "out": {"model_name": "OutputModel",
                "state": {"outputs": [png, _stream("4 rows\n")]}},
    }
    page = book.learner_view(_widget_run(models, "box"), "05_x.ipynb")
    i = next(i for i, c in enumerate(page.cells) if "interact" in c.source)
    outs = page.cells[i].outputs
    assert [o.output_type for o in outs] == ["display_data", "stream"]
    assert "image/png" in outs[0].data and outs[1].text == "4 rows\n"
    note = page.cells[i + 1]
    assert note.cell_type == "markdown" and "notebooks/05_x.ipynb" in note.source
    assert "default" in note.source
    text = nbformat.writes(page)
    assert book.WIDGET_VIEW not in text and "widgets" not in page.metadata


def test_a_widget_without_controls_gets_no_note():
    models = {"bar": {"model_name": "HBoxModel",
                      "state": {"children": ["IPY_MODEL_p", "IPY_MODEL_loop"]}},
              "p": {"model_name": "FloatProgressModel", "state": {}},
              # a cycle in a malformed state must not hang the build
              "loop": {"model_name": "HBoxModel",
                       "state": {"children": ["IPY_MODEL_bar"]}}}
    page = book.learner_view(_widget_run(models, "bar"), "03_x.ipynb")
    i = next(i for i, c in enumerate(page.cells) if "interact" in c.source)
    assert page.cells[i].outputs == []
    assert "cannot move" not in page.cells[i + 1].source


def test_check_run_accepts_the_gate_and_names_what_broke():
    book.check_run(_gate_run(), "00_x.py")
    broken = _gate_run()
    broken.cells[-2].outputs = [nbformat.from_dict(
        {**ERROR, "ename": "ValueError", "evalue": "bad size",
         "traceback": ["ValueError: bad size"]})]
    with pytest.raises(book.BookError, match="ValueError: bad size"):
        book.check_run(broken, "00_x.py")
    vacuous = _gate_run()
    vacuous.cells[4].outputs = []  # the check passed on the placeholder
    with pytest.raises(book.BookError, match="did not fail on its placeholder"):
        book.check_run(vacuous, "00_x.py")


def test_a_failing_solution_is_reported_but_not_shown(capsys):
    run = _gate_run()
    run.cells[6].outputs = [nbformat.from_dict(ERROR)]  # the solved check failed
    book.check_run(run, "00_x.py")  # the test gate reports it; the page drops it
    assert "exercise 0.1's solution failed" in capsys.readouterr().out
    page = nbformat.writes(book.learner_view(run, "00_x.ipynb"))
    assert page.count("not solved yet") == 1  # the placeholder's check only


@pytest.mark.parametrize("source", CHAPTERS, ids=lambda p: p.stem)
def test_every_solution_block_is_found(source):
    blocks = book.solution_blocks(source)
    nb = build.jupytext.read(source, fmt="py:percent")
    assert len(blocks) == sum(c.source.count(build.BEGIN) for c in nb.cells) >= 2
    assert all(block.strip() for block in blocks)
    assert not any(build.BEGIN in b or build.END in b for b in blocks)


def _page(path, text):
    # as Sphinx writes code: every token in a span, HTML-escaped
    spans = "".join(f"<span>{html.escape(line)}</span>\n"
                    for line in text.splitlines())
    path.write_text(f"<html><body><pre>{spans}</pre></body></html>")


def test_leaks_finds_a_solution_line_in_a_page_but_not_the_learners_code(tmp_path):
    source = CHAPTERS[0]
    learner = nbformat.reads(build.generate(source), as_version=4)
    _page(tmp_path / "page.html", "\n".join(c.source for c in learner.cells))
    assert book.leaks(tmp_path, [source]) == []
    block = max(book.solution_blocks(source), key=len)
    _page(tmp_path / "other.html", block)
    found = book.leaks(tmp_path, [source])
    assert found and all(f.startswith("other.html: solution") for f in found)


def test_leaks_looks_into_the_search_index_too(tmp_path):
    source = CHAPTERS[1]
    block = max(book.solution_blocks(source), key=len)
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "searchindex.js").write_text(block)
    assert book.leaks(tmp_path, [source])


def test_run_key_follows_the_chapter():
    source = CHAPTERS[0]
    gate = build.gate_notebook(source)
    assert book.run_key(source, gate) == book.run_key(source, gate)
    assert book.run_key(source, gate) != book.run_key(source, gate + " ")


def test_the_start_page_drops_its_own_section_about_the_site():
    text = ("# Title\n\nHello.\n\n## Read it as a website\n\n`make book` ...\n"
            "build/book/index.html\n\n## Exercises and grading\n\nGrade.\n")
    out = book.SITE_SECTION.sub("", text)
    assert "make book" not in out and "## Exercises and grading" in out
    assert "Hello." in out


TINY = '''# %% [markdown]
# # Chapter 0: a tiny chapter

# %%
import ipywidgets as widgets

from course_utils.exercises import call_learner, fail, passed

print("CPU only (a tiny machine)")

# %%
widgets.interact(lambda n=3: print(f"n is {n}"),
                 n=widgets.IntSlider(value=3, min=1, max=5));

# %% [markdown]
# ## Exercises

# %% tags=["exercise"] exercise="0.1"
def double(x):
    ### BEGIN SOLUTION
    return x + x  # an_answer_only_the_solution_has
    ### END SOLUTION

# %% tags=["check"] exercise="0.1"
if call_learner("0.1", double, 2) != 4:
    fail("0.1", "4", "something else")
passed("0.1")

# %%
print("after the exercise:", 6 * 7)
'''


def test_a_chapter_runs_once_and_its_page_shows_the_run(tmp_path, capsys):
    source = tmp_path / "00_tiny.py"
    source.write_text(TINY)
    runs = tmp_path / "runs"
    path = book.execute(source, runs=runs)
    run = nbformat.read(path, as_version=4)
    assert run.metadata["book"]["wall_s"] > 0 and run.metadata["book"]["machine"]
    page = nbformat.writes(book.learner_view(run, "00_tiny.ipynb"))
    assert "an_answer_only_the_solution_has" not in page
    assert "Exercise 0.1 passed" not in page
    assert "Exercise 0.1 is not solved yet" in page
    assert "after the exercise: 42" in page
    assert "n is 3" in page and "cannot move" in page  # the slider's default
    assert book.WIDGET_VIEW not in page
    capsys.readouterr()
    assert book.execute(source, runs=runs) == path  # kept, not run again
    assert "reusing the run" in capsys.readouterr().out


def test_prune_mathjax_keeps_what_the_pages_load(tmp_path):
    mathjax = tmp_path / "_static" / "mathjax"
    (mathjax / "output").mkdir(parents=True)
    for name in ["tex-chtml.js", "loader.js", "startup.js", "core.js", "tex-svg.js",
                 "mml-chtml.js", "output/chtml.js"]:
        (mathjax / name).write_text("//")
    book.prune_mathjax(tmp_path)
    left = sorted(str(p.relative_to(mathjax)) for p in mathjax.rglob("*.js"))
    assert left == ["core.js", "loader.js", "output/chtml.js", "startup.js",
                    "tex-chtml.js"]
