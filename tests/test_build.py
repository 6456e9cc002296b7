"""course_utils.build: stubs, the exercise rules, the sync check, learners' work."""

import json
import textwrap

import pytest

from course_utils import build

SOURCE = textwrap.dedent('''\
    # %% [markdown]
    # # A chapter

    # %%
    import math

    # %% tags=["exercise"] exercise="7.1"
    def area(r):
        """Area of a circle."""
        ### BEGIN SOLUTION
        return math.pi * r**2
        ### END SOLUTION

    # %% tags=["check"] exercise="7.1"
    assert abs(area(1) - math.pi) < 1e-9
    ''')


@pytest.fixture
def course(tmp_path):
    src, nbs = tmp_path / "source", tmp_path / "notebooks"
    src.mkdir()
    (src / "07_demo.py").write_text(SOURCE)
    build.build(src, nbs, backup_dir=tmp_path / "backups")
    return src, nbs, tmp_path / "backups"


def cells(path):
    return json.loads(path.read_text())["cells"]


def test_stub_keeps_indentation_and_names_exercise(course):
    _, nbs, _ = course
    ex = [
        c
        for c in cells(nbs / "07_demo.ipynb")
        if "exercise" in c["metadata"].get("tags", [])
    ]
    src = "".join(ex[0]["source"])
    assert '    raise NotImplementedError("Exercise 7.1")' in src
    assert "math.pi * r**2" not in src and "BEGIN SOLUTION" not in src
    assert '"""Area of a circle."""' in src


def test_notebook_is_clean_and_marked(course):
    _, nbs, _ = course
    nb = json.loads((nbs / "07_demo.ipynb").read_text())
    assert nb["metadata"]["course"]["generated_from"] == "source/07_demo.py"
    # the instructors' note is last, out of the learner's way; the Run All note
    # sits just before the first exercise
    assert "Generated from `source/07_demo.py`" in "".join(nb["cells"][-1]["source"])
    assert "".join(nb["cells"][0]["source"]).startswith("# A chapter")
    tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
    first = next(i for i, t in enumerate(tags) if "exercise" in t)
    assert "Run All stops" in "".join(nb["cells"][first - 1]["source"])
    assert nb["metadata"]["kernelspec"]["display_name"] == "Python 3 (ipykernel)"
    for c in nb["cells"]:
        assert not c.get("outputs") and c.get("execution_count") is None


def test_solutions_keep_the_code(course, tmp_path):
    src, _, _ = course
    (path,) = build.write_solutions(tmp_path / "sol", src)
    assert "math.pi * r**2" in path.read_text()


def test_check_detects_hand_edit_missing_and_extra(course):
    src, nbs, _ = course
    assert build.check(src, nbs) == []
    nb = nbs / "07_demo.ipynb"
    nb.write_text(nb.read_text().replace("A chapter", "A chapter, edited"))
    assert "differs" in build.check(src, nbs)[0]
    nb.unlink()
    assert "missing" in build.check(src, nbs)[0]
    (nbs / "99_orphan.ipynb").write_text("{}")
    assert any("no source" in p for p in build.check(src, nbs))


def test_check_cli_exits_nonzero_naming_files(course, monkeypatch, capsys):
    src, nbs, _ = course
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    monkeypatch.setattr(build, "NOTEBOOK_DIR", nbs)
    assert build.main(["--check"]) == 0
    nb = nbs / "07_demo.ipynb"
    nb.write_text(nb.read_text().replace("A chapter", "A chapter, edited"))
    assert build.main(["--check"]) == 1
    assert "07_demo.ipynb: differs" in capsys.readouterr().out


def test_learner_work_is_kept(course, capsys):
    src, nbs, backups = course
    nb_path = nbs / "07_demo.ipynb"
    nb = json.loads(nb_path.read_text())
    for c in nb["cells"]:
        if "exercise" in c["metadata"].get("tags", []):
            c["source"] = "def area(r):\n    return 3.14 * r * r\n"
    nb_path.write_text(json.dumps(nb))
    (src / "07_demo.py").write_text(SOURCE.replace("A chapter", "A better chapter"))
    result = build.build(src, nbs, backup_dir=backups)
    assert result["skipped"] == [nb_path]
    assert "3.14 * r * r" in nb_path.read_text()
    assert "exercise(s) 7.1 hold your work" in capsys.readouterr().out
    result = build.build(src, nbs, force=True, backup_dir=backups)
    assert result["written"] == [nb_path]
    (backup,) = backups.iterdir()
    assert "3.14 * r * r" in backup.read_text()
    assert "A better chapter" in nb_path.read_text()


def test_untouched_notebook_is_regenerated(course):
    src, nbs, backups = course
    (src / "07_demo.py").write_text(SOURCE.replace("A chapter", "A new title"))
    result = build.build(src, nbs, backup_dir=backups)
    assert result["written"] and not backups.exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ('# %% tags=["check"] exercise="7.1"\n', "must be followed"),
        ('exercise="7.1"', "must be '7.1'"),
    ],
)
def test_exercise_rules_are_enforced(tmp_path, change, message):
    if change.startswith("# %%"):
        text = SOURCE.replace(change, "# %%\n")
    else:
        text = SOURCE.replace(change, 'exercise="7.2"', 1)
    path = tmp_path / "07_demo.py"
    path.write_text(text)
    with pytest.raises(build.BuildError, match=message):
        build.generate(path)


def test_duplicate_ids_are_refused(tmp_path):
    text = SOURCE + SOURCE.split("# %%\nimport math\n")[1]
    path = tmp_path / "07_demo.py"
    path.write_text(text)
    with pytest.raises(build.BuildError, match="must be '7.2'"):
        build.generate(path)


@pytest.mark.parametrize("other", [
    "def area(shape):\n    return 0\n",  # the chapter's own function
    "area = lambda r: 0\n",
    "from math import pi as area\n",
    "class area:\n    pass\n",
])
def test_an_exercise_may_not_replace_a_chapter_name(tmp_path, other):
    text = SOURCE.replace("import math\n", "import math\n\n" + other, 1)
    path = tmp_path / "07_demo.py"
    path.write_text(text)
    with pytest.raises(build.BuildError, match="defines area, which cell"):
        build.generate(path)


def test_an_exercise_may_use_a_chapter_name(tmp_path):
    path = tmp_path / "07_demo.py"  # reading math, defining its own name: fine
    path.write_text(SOURCE.replace("import math\n", "import math\ntau = 2\n", 1))
    build.generate(path)


@pytest.mark.parametrize("later", [
    "print(area(2))\n",
    "def plot():\n    return [area(r) for r in range(3)]\n",
    "f = area\n",
])
def test_a_later_cell_may_not_use_an_exercise(tmp_path, later):
    path = tmp_path / "07_demo.py"
    path.write_text(SOURCE + "\n# %%\n" + later)
    with pytest.raises(build.BuildError, match="uses area from exercise 7.1"):
        build.generate(path)


def test_the_gate_notebook_solves_each_exercise_after_its_check(tmp_path):
    path = tmp_path / "07_demo.py"
    path.write_text(SOURCE + "\n# %%\nprint(math.tau)\n")
    nb = json.loads(build.gate_notebook(path))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    tags = [c["metadata"].get("tags", []) for c in code]
    assert tags == [[], ["exercise"], ["check"], ["solved-exercise"], ["solved"], []]
    src = ["".join(c["source"]) for c in code]
    assert 'raise NotImplementedError("Exercise 7.1")' in src[1]
    assert "math.pi * r**2" in src[3] and src[4] == src[2]
    assert len({c["id"] for c in nb["cells"]}) == len(nb["cells"])
    nb = json.loads(build.gate_notebook(path, repeats=3))
    tags = [c["metadata"].get("tags", [])
            for c in nb["cells"] if c["cell_type"] == "code"]
    block = [["exercise"], ["check"], ["solved-exercise"], ["solved"]]
    assert tags == [[], *block * 3, []]
    assert len({c["id"] for c in nb["cells"]}) == len(nb["cells"])


@pytest.mark.parametrize("source", build.chapter_sources(), ids=lambda p: p.stem)
def test_a_chapter_is_read_in_one_sitting(source):
    words, code = build.chapter_length(source)
    assert words <= build.MAX_WORDS, f"{source.name}: {words} words of prose"
    assert code <= build.MAX_CODE_LINES, f"{source.name}: {code} lines of code"


def test_unbalanced_markers_are_refused():
    with pytest.raises(build.BuildError):
        build.stub_solutions("    ### BEGIN SOLUTION\n    x = 1\n", "7.1")


def test_the_course_notebooks_are_in_sync():
    """The sync gate: notebooks/ is exactly what source/ generates."""
    problems = build.check()
    assert not problems, "\n".join(problems) + "\nrun `make notebooks`"


def test_shebang_in_markdown_is_kept_or_refused(tmp_path):
    src = tmp_path / "source"
    src.mkdir()
    body = "# %% [markdown]\n# ```bash\n{}\n# echo hi\n# ```\n"
    (src / "07_demo.py").write_text(body.format("# #!/bin/bash"))
    with pytest.raises(build.BuildError, match="# # #!"):
        build.generate(src / "07_demo.py")
    (src / "07_demo.py").write_text(body.format("# # #!/bin/bash"))
    nb = json.loads(build.generate(src / "07_demo.py"))
    assert "#!/bin/bash\necho hi" in "".join(nb["cells"][0]["source"])


def test_notebooks_carry_the_kernels_language_info_and_the_gate_ignores_its_version():
    import platform

    src = build.chapter_sources()[0]
    text = build.generate(src)
    info = json.loads(text)["metadata"]["language_info"]
    # what ipykernel reports: JupyterLab rewrites anything else, and the
    # notebook would open with unsaved changes
    assert info["pygments_lexer"] == "ipython3"
    assert info["version"] == platform.python_version()
    other = text.replace(f'"version": "{info["version"]}"', '"version": "3.99.0"')
    assert other != text and build.same_notebook(other, text)
    assert not build.same_notebook(text.replace("import", "imports", 1), text)


@pytest.mark.parametrize("last", [
    "from course_utils import banner\nbanner()\n",  # returns its line: shown twice
    "from course_utils import reference\nreference.show('x', local=1, unit='s')\n",
    "import course_utils.reference as ref\nref.published('x')\n",
    "def pair():\n    return 1, 2\n\n\npair()\n",  # a chapter function with a value
    "import torch\ntorch.manual_seed(0)\n",  # a Generator's repr
    "import ipywidgets as w\nw.interact(print, x=1)\n",  # the function's repr
    "[print(i) for i in range(2)]\n",  # [None, None]
    "'a sentence'.upper()\n",
    "import matplotlib.pyplot as plt\nplt.plot([1], [2])  # a comment\n",
])
def test_a_bare_expression_with_a_stray_repr_is_refused(tmp_path, last):
    path = tmp_path / "07_demo.py"
    path.write_text(SOURCE.replace("# %%\nimport math\n",
                                   "# %%\nimport math\n\n# %%\n" + last, 1))
    with pytest.raises(build.BuildError, match="whose repr the learner would see"):
        build.generate(path)


@pytest.mark.parametrize("last", [
    "from course_utils import banner\nbanner();\n",
    "from course_utils import banner\nbanner()  ;  # with a comment\n",
    "print('x')\n",
    "import matplotlib.pyplot as plt\nplt.show()\n",
    "def say():\n    print('hi')\n    return\n\n\nsay()\n",
    "def outer():\n    def inner():\n        return 1\n    print(inner)\n\n\nouter()\n",
    "from course_utils.cleanup import tidy_up\ntidy_up()\n",  # annotated -> None
    "x = 3\nx\n",  # a value shown on purpose
    "import math\nmath.pi\n",
    "x = [3]\nx[0] * 2\n",
    "x = [3]\nx.append(4)\n",
    "%%writefile f.py\nprint(1)\n",
])
def test_a_bare_expression_meant_for_the_learner_is_kept(tmp_path, last):
    path = tmp_path / "07_demo.py"
    text = SOURCE.replace("# %%\nimport math\n", "# %%\nimport math\n\n# %%\n"
                          + "\n".join(("# " + ln if ln.startswith("%%") else ln)
                                      for ln in last.splitlines()) + "\n", 1)
    path.write_text(text)
    build.generate(path)


def test_the_course_has_no_stray_repr():
    for source in build.chapter_sources():
        nb = build.jupytext.read(source, fmt="py:percent")
        assert not build.stray_reprs(nb), source.name
