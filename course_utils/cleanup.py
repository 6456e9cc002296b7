"""What a chapter leaves behind: its temporary folders and its processes.

- ``scratch_folder(prefix)`` makes a temporary folder that goes with the
  chapter: ``tidy_up()`` (the chapter's last cell) removes it, and so does
  the kernel's normal exit; when the kernel dies any other way (a restart
  that ends it with SIGTERM or SIGKILL, a crash) a small watchdog process,
  which outlives it, removes the folder and multiprocessing's own folder.
- ``end_interrupts_in_one_line()``, installed by ``banner()``: an interrupt
  (the stop button, a restart mid-cell) stops every process the interrupted
  cell started and reads as one line instead of a traceback; and the
  kernel's multiprocessing folder is watched like a scratch folder.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util as mp_util
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import psutil

from course_utils.errors import RED, RESET

WATCHDOG = """
import os, shutil, sys
fd, folders, buf = int(sys.argv[1]), set(), b""
while chunk := os.read(fd, 4096):  # until the notebook's end of the pipe closes
    buf += chunk
    *lines, buf = buf.split(b"\\n")
    folders.update(line.decode() for line in lines)
if "" not in folders:  # an empty line: the notebook ended its own way
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
"""

# multiprocessing's own helpers stay for the kernel's life by design
SERVERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")

_folders: list[Path] = []
_watchdog: dict = {}


def _start_watchdog() -> int:
    """The write end of the pipe to the watchdog, started once per process."""
    if _watchdog.get("pid") == os.getpid():
        return _watchdog["fd"]
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", WATCHDOG, str(read)], pass_fds=(read,),
            start_new_session=True,  # a signal to the kernel's group spares it
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
    finally:
        os.close(read)
    _watchdog.update(pid=os.getpid(), fd=write, proc=proc)

    def drop_in_child():  # a forked child must not keep the pipe open
        with contextlib.suppress(OSError):
            os.close(write)
        _watchdog.clear()

    os.register_at_fork(after_in_child=drop_in_child)
    return write


def stop_watchdog() -> None:
    """End the watchdog, leaving its folders to their owners (tests)."""
    if _watchdog.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            os.write(_watchdog["fd"], b"\n")
            os.close(_watchdog["fd"])
        _watchdog["proc"].wait(timeout=10)
    _watchdog.clear()


def _watch(folder: Path) -> None:
    os.write(_start_watchdog(), f"{folder}\n".encode())


def watch_multiprocessing_folder() -> Path:
    """Have the watchdog remove multiprocessing's folder if this process is killed.

    That folder (the forkserver's socket) is removed at a normal exit only;
    made now, it is the one every later pool and launch of this process uses.
    """
    folder = Path(mp_util.get_temp_dir())
    if _watchdog.get("mp") != (os.getpid(), folder):
        _watch(folder)
        _watchdog["mp"] = (os.getpid(), folder)
    return folder


def scratch_folder(prefix: str) -> Path:
    """A new temporary folder that is removed with the chapter, however it ends."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    _watch(folder)
    watch_multiprocessing_folder()
    if not _folders:
        atexit.register(_remove_all)
    _folders.append(folder)
    return folder


def _remove_all() -> list[Path]:
    removed = [f for f in _folders if f.exists()]
    for folder in _folders:
        shutil.rmtree(folder, ignore_errors=True)
    _folders.clear()
    return removed


def tidy_up() -> None:
    """A chapter's last cell: remove its temporary folders, say what is left."""
    removed = _remove_all()
    left = leftover_processes()
    print(f"removed {len(removed)} temporary folder{'s' * (len(removed) != 1)}"
          + "".join(f" ({f.name})" for f in removed)
          + (" - a cell that uses one needs the chapter run again from the top"
             if removed else "")
          + "; processes this notebook started still running: "
          + (", ".join(left) if left else "none"))


def _descendants() -> list[psutil.Process]:
    """This process's descendants, less multiprocessing's servers and the watchdog."""
    keep = {p.pid for p in [_watchdog.get("proc")] if p is not None}
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.pid not in keep and not any(s in " ".join(p.cmdline())
                                             for s in SERVERS):
                found.append(p)
    return found


def leftover_processes() -> list[str]:
    """This process's descendants, apart from multiprocessing's own servers
    (the launcher's forkserver and the resource tracker stay by design)."""
    left = []
    for p in _descendants():
        with contextlib.suppress(psutil.Error):
            left.append(f"{p.pid} {' '.join(p.cmdline())[:60]}")
    return left


def stop(procs: list[psutil.Process], grace: float = 2.0) -> int:
    """Terminate, then kill; return how many were still running."""
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
            alive.append(p)
    _, alive_after = psutil.wait_procs(alive, timeout=grace)
    for p in alive_after:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive_after, timeout=grace)
    return len(alive)


class Interrupted(KeyboardInterrupt):
    """An interrupt, after the processes it would have orphaned were stopped."""

    def _render_traceback_(self) -> list[str]:
        return [f"{RED}{self}{RESET}"]


def where(tb, cell_files: tuple[str, ...] = ("<ipython-input", "ipykernel_")) -> str:
    """'line N of this cell (in fn)': the innermost frame of the cell's code."""
    frames = [f for f in traceback.extract_tb(tb)
              if any(c in f.filename for c in cell_files)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at line {f.lineno} of this cell" + (
        f" (in {f.name})" if f.name != "<module>" else "")


def interrupted_message(tb, before: set[int]) -> str:
    """Stop what the cell started; say so in one line."""
    started = [p for p in _descendants() if p.pid not in before]
    n = stop(started)
    left = _descendants()
    tail = ("nothing left running" if not [p for p in left if p.pid not in before]
            else f"{len(left)} still running")
    stopped = f"{n} process{'es' * (n != 1)} it started stopped, " if n else ""
    return f"interrupted{where(tb)}: {stopped}{tail}"


def end_interrupts_in_one_line(shell=None) -> bool:
    """In IPython: an interrupted cell stops what it started and shows one line."""
    if shell is None:
        try:
            shell = get_ipython()  # type: ignore[name-defined]  # noqa: F821
        except NameError:
            return False
    if getattr(shell, "_course_interrupts", False):
        return True
    state = {"before": set()}

    def remember(*_):
        with contextlib.suppress(psutil.Error):
            state["before"] = {p.pid for p in psutil.Process().children(
                recursive=True)}

    def on_interrupt(self, etype, value, tb, tb_offset=None):
        try:
            message = interrupted_message(tb, state["before"])
        except Exception as e:  # never lose the interrupt to a clean-up error
            message = f"interrupted (clean-up failed: {e})"
        render = getattr(value, "_render_traceback_", None)
        lines = render() if render else [f"{RED}{message}{RESET}"]
        self._showtraceback(etype, value, lines)

    shell.events.register("pre_run_cell", remember)
    shell.set_custom_exc((KeyboardInterrupt,), on_interrupt)
    shell._course_interrupts = True
    watch_multiprocessing_folder()  # a kernel killed by a restart leaves none
    return True
