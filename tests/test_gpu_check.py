"""course_utils.gpu_check: each chapter's solutions, run and reported."""

import re

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
    monkeypatch.setattr(gpu_check, "check", lambda sources, timeout: ("", True))
    assert gpu_check.main(["00"]) == 0
    import os
    assert "COURSE_RECORD" not in os.environ
    out = capsys.readouterr().out
    assert "recording nothing" in out and ("GPU" in out)
    assert gpu_check.main(["nonexistent-chapter"]) == 2
