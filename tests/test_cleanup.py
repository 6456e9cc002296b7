"""A chapter's temporary folders and processes do not outlive it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from course_utils import cleanup

PROBE = """
import sys, time
from course_utils.cleanup import scratch_folder
folder = scratch_folder("probe-")
(folder / "file").write_text("x")
print(folder, flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def no_watchdog_left():
    """A watchdog started here ends with the test: later tests count children."""
    yield
    cleanup.stop_watchdog()


def _gone_soon(path: Path, polls: int = 200) -> bool:
    for _ in range(polls):  # the watchdog acts when it is next scheduled
        if not path.exists():
            return True
        time.sleep(0.05)
    return not path.exists()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_process_leaves_no_folder(tmp_path, sig):
    proc = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    folder = Path(proc.stdout.readline().strip())
    assert folder.is_dir() and folder.parent == tmp_path
    assert any(p.name.startswith("pymp-") for p in tmp_path.iterdir())
    os.kill(proc.pid, sig)
    proc.wait()
    proc.stdout.close()
    assert _gone_soon(folder)
    for _ in range(100):  # multiprocessing's folder goes with it
        if not list(tmp_path.iterdir()):
            break
        time.sleep(0.05)
    assert not list(tmp_path.iterdir())


def test_tidy_up_removes_the_folders_and_says_so(capsys):
    folder = cleanup.scratch_folder("probe-")
    (folder / "file").write_text("x")
    cleanup.tidy_up()
    assert not folder.exists()
    out = capsys.readouterr().out
    assert f"removed 1 temporary folder ({folder.name})" in out
    assert "still running: none" in out
    cleanup.tidy_up()  # twice: nothing to do, no error
    assert "removed 0 temporary folders" in capsys.readouterr().out


def test_the_multiprocessing_folder_is_watched_once():
    first = cleanup.watch_multiprocessing_folder()
    proc = cleanup._watchdog["proc"]
    assert cleanup.watch_multiprocessing_folder() == first
    assert cleanup._watchdog["proc"] is proc  # one watchdog per process
    cleanup.stop_watchdog()  # this process lives on: its folder stays
    assert proc.returncode == 0 and first.exists()


def test_an_interrupt_stops_what_the_cell_started_in_one_line():
    IPython = pytest.importorskip("IPython")
    shell = IPython.core.interactiveshell.InteractiveShell.instance()
    shown = []
    shell._showtraceback = lambda etype, value, stb: shown.append(stb)
    before = subprocess.Popen(["sleep", "60"])  # started before the cell: kept
    try:
        assert cleanup.end_interrupts_in_one_line(shell)
        assert cleanup.end_interrupts_in_one_line(shell)  # once is enough
        result = shell.run_cell(
            "import subprocess\n"
            "def wait():\n"
            "    raise KeyboardInterrupt\n"
            "child = subprocess.Popen(['sleep', '60'])\n"
            "wait()\n")
        assert isinstance(result.error_in_exec, KeyboardInterrupt)
        assert len(shown) == 1 and len(shown[0]) == 1, shown
        line = shown[0][0]
        assert "interrupted at line 3 of this cell (in wait): 1 process it " \
               "started stopped, nothing left running" in line, line
        child = shell.user_ns["child"]
        assert child.wait(timeout=10) is not None
        assert before.poll() is None
    finally:
        before.kill()
        before.wait()


def test_an_error_that_renders_itself_keeps_its_line():
    IPython = pytest.importorskip("IPython")
    shell = IPython.core.interactiveshell.InteractiveShell.instance()
    shown = []
    shell._showtraceback = lambda etype, value, stb: shown.append(stb)
    cleanup.end_interrupts_in_one_line(shell)
    shell.user_ns["Interrupted"] = cleanup.Interrupted
    shell.run_cell("raise Interrupted('interrupted: all 2 ranks stopped')")
    assert len(shown[0]) == 1 and "interrupted: all 2 ranks stopped" in shown[0][0]


def test_leftover_processes_leave_out_the_servers():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert any(line.startswith(f"{child.pid} ") for line in
                   cleanup.leftover_processes())
        assert cleanup.stop([psutil.Process(child.pid)]) == 1
        assert child.wait(timeout=10) is not None
    finally:
        child.kill()
        child.wait()
