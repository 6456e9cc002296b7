"""course_utils.gpu_check: each chapter's solutions, run and reported."""

import re
import subprocess
import sys
import zipfile

import pytest

from course_utils import gpu_check

GOOD = '''# %% [markdown]
# # A chapter

# %%
import time
time.sleep(0.3)
print("hello")
'''
BAD = GOOD + '''
# %%
raise RuntimeError("this GPU path is broken")
'''


def test_report_names_failing_cells_and_slow_ones(tmp_path, monkeypatch):
    src = tmp_path / "source"
    src.mkdir()
    (src / "07_good.py").write_text(GOOD)
    (src / "08_bad.py").write_text(BAD)
    text, ok = gpu_check.check(sorted(src.glob("*.py")), timeout=60)
    assert not ok
    good, bad = [ln for ln in text.splitlines() if not ln.startswith(" ")]
    assert good.startswith("passed") and "07_good" in good
    assert bad.startswith("FAILED") and "08_bad" in bad
    assert "this GPU path is broken" in text
    assert re.search(r"slow: cell 0 +\d+\.\d s  import time", text)


def test_it_records_nothing_unless_asked(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_RECORD", "1")
    monkeypatch.setattr(gpu_check, "check",
                        lambda sources, timeout, quick=False, echo=None: ("", True))
    assert gpu_check.main(["00"]) == 0
    import os
    assert "COURSE_RECORD" not in os.environ
    out = capsys.readouterr().out
    assert "recording nothing" in out and ("GPU" in out)
    assert gpu_check.main(["nonexistent-chapter"]) == 2


def test_quick_keeps_gpu_cells_and_what_they_read():
    cells = ["import torch\nfrom x import banner\nbanner()",  # 0: always
             "size = 10\nunused = 3",                     # 1: read by 4
             "slow = sum(range(10**6))",                   # 2: never read
             "def helper(n):\n    return n + size",       # 3: read by 4
             "if torch.cuda.is_available():\n    helper(size)",  # 4: GPU
             "print(slow)",                                # 5: CPU only
             "device = try_gpu()"]                         # 6: GPU
    assert gpu_check.quick_cells(cells) == [0, 1, 3, 4, 6]
    assert gpu_check.quick_cells(["x = 1", "print(x)"]) == [0]
    assert gpu_check.quick_cells(["this is not python(", "gpu = 1"]) == [0, 1]


def test_quick_notebook_drops_cells_in_place(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# title"),
        nbformat.v4.new_code_cell("import torch"),
        nbformat.v4.new_code_cell("total = 1 + 1"),
        nbformat.v4.new_code_cell("x = torch.zeros(2, device='cuda')")])
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert gpu_check.quick_notebook(path) == (3,)
    kept = nbformat.read(path, as_version=4).cells
    assert [c.source for c in kept if c.cell_type == "code"] == [
        "import torch", "x = torch.zeros(2, device='cuda')"]


SCRIPT = """import torch

def on_gpu(n):
    return n * 2          # 4: a GPU function, never called here

def helper():
    return 1              # 7: called only under the GPU branch

if torch.cuda.is_available():
    x = helper()          # 10
    y = on_gpu(x)         # 11
else:
    x = 0
try:
    z = 1
except ValueError:
    z = 2                 # 17: an error path, not a GPU line
print(x)
"""


def test_gpu_only_lines_are_the_gpu_branches_that_did_not_run():
    ran = {1, 3, 6, 9, 13, 14, 15, 18}
    assert gpu_check.gpu_only_lines(SCRIPT, ran) == [4, 7, 10, 11]
    # on a GPU they all ran: nothing is left
    assert gpu_check.gpu_only_lines(SCRIPT, ran | {4, 7, 10, 11}) == []


def test_lines_report_runs_a_chapter_under_coverage(tmp_path):
    source = tmp_path / "05_demo.py"
    source.write_text("# %%\n" + SCRIPT)  # one cell: every line one further down
    text, total = gpu_check.lines_report([source], timeout=120)
    if __import__("torch").cuda.is_available():
        pytest.skip("on a GPU the branches run")
    assert total == 4, text
    assert "05_demo" in text and "lines 5, 8, 11-12" in text


def test_cells_run_as_in_a_kernel(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "06_demo.py"
    source.write_text(
        "# %% [markdown]\n# # A chapter\n\n"
        "# %%\nNAME = 'job.py'\n\n"
        "# %%\n# %%writefile {NAME}\nraise SystemExit('not run here')\n\n"
        "# %%\nraise ValueError('this cell fails')\n\n"
        "# %% tags=['check']\nresult = open(NAME).read()\n")
    failed = gpu_check.run_cells(source)
    assert failed == ["cell at line 11: ValueError: this cell fails"]
    assert (tmp_path / "job.py").read_text() == "raise SystemExit('not run here')\n\n"


def test_wheelhouse_pins_leave_torch_and_the_native_giants_to_the_site():
    lines = (gpu_check.ROOT / "requirements.txt").read_text().splitlines()
    pins = [p.split("==")[0] for p in gpu_check.wheelhouse_pins(lines)]
    assert {"nbval", "ipykernel", "nbformat", "jupytext", "cloudpickle",
            "coverage"} <= set(pins)
    assert not {"torch", "numpy", "matplotlib", "numba", "jupyterlab",
                "ruff"} & set(pins)


def _wheel(folder, name="demo_pkg"):
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_the_wheelhouse_installs_offline_into_a_folder_of_its_own(tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    _wheel(house)
    target = tmp_path / "site"
    gpu_check.install_wheelhouse(house, target)
    out = subprocess.run(
        [sys.executable, "-c", "import demo_pkg, torch; print(demo_pkg.VALUE)"],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True)
    assert out.stdout.strip() == "42", out.stderr
    with pytest.raises(FileNotFoundError, match="make wheelhouse"):
        gpu_check.install_wheelhouse(tmp_path, target)


def test_with_a_wheelhouse_the_check_reruns_itself_with_the_wheels(
        tmp_path, capsys):
    house = tmp_path / "house"
    house.mkdir()
    _wheel(house)
    code = gpu_check.main(["--wheelhouse", str(house), "no-such-chapter"])
    out = capsys.readouterr().out
    assert "installed 1 wheels" in out and "torch untouched" in out
    assert code == 2  # the child found no chapter of that name


def test_a_site_without_its_native_packages_is_told_so(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "SITE_NEEDS", ("torch", "no_such_package"))
    monkeypatch.setattr(gpu_check, "missing_site_packages",
                        lambda names=None: ["no_such_package"])
    assert gpu_check.run_with_wheelhouse(gpu_check.ROOT, []) == 2
    assert "lacks no_such_package" in capsys.readouterr().out


def test_quick_keeps_the_checks_whose_checker_has_a_gpu_path():
    names = gpu_check.checkers_with_gpu_paths("02")
    assert "check_measure" in names
    assert gpu_check.checkers_with_gpu_paths("99") == frozenset()
    cells = ["import x", "def measure(): pass", "check_measure(measure)", "y = 1"]
    assert gpu_check.quick_cells(cells, names) == [0, 1, 2]
    assert gpu_check.quick_cells(cells) == [0]
