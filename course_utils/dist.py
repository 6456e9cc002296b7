"""Run a function in N processes from a notebook: ``launch(fn, nprocs=2)``.

Introduced in Chapter 6 (DistributedDataParallel); the CPU, pipeline and
sharding chapters use it too. Each rank runs ``fn(rank, world_size, *args)``
inside an initialised process group, as torchrun would run a script. What the
launcher guarantees:

- **Ranks start clean.** Ranks are forked from a *forkserver*: a server
  process started once per notebook as a fresh interpreter (exec, not fork),
  with torch and ``torch.distributed`` already imported. Whatever the notebook
  initialised - CUDA, OpenMP's thread pool - never reaches it, so a rank may
  use its GPU (nccl) and several threads whatever the notebook did before,
  and starts in a fraction of a second after the first launch. ``fn`` and
  ``args`` travel by value (cloudpickle), so functions and classes defined
  in the notebook work. Where there is no forkserver (Windows), fresh
  interpreters are spawned instead, with the same shipping.
- **Environment.** Each rank gets this process's environment as it is at the
  launch (plus ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); variables that torch reads only when
  it is imported keep the values they had when the server started.
- **Rendezvous** on a free port of 127.0.0.1; a picked port that something
  else took in the meantime is retried once.
- **Backend** ``nccl`` when there is a GPU per rank, ``gloo`` otherwise. A
  group on GPUs is made with ``"cpu:gloo,cuda:nccl"``: nccl carries CUDA
  tensors only, so gloo carries the CPU ones (CPU offloading, CPU-side
  checkpoint helpers, any collective on a CPU tensor). ``dist.get_backend()``
  then returns that whole string: a rank picks its device with
  ``"nccl" in dist.get_backend()``, and groups and device meshes made from
  the default group inherit both backends.
- **Ranks start together.** With ``init=True`` no rank runs ``fn`` before
  every rank has its process group, so a rank that returns at once never
  closes connections that a slower one is still opening.
- **Results**: each rank's stdout and stderr (C-level output too) and its
  return value come back as plain data; tensors are moved to the CPU first.
- **No process left behind**, whatever happens: after success (a rank's own
  child processes are ended too), a failing rank, a timeout, an interrupt,
  SIGTERM to this process, or even SIGKILL (each rank gets a parent-death
  signal, and a small watchdog process ends the ranks' process groups).
- **Clear failures**: the first failing rank's traceback; a rank killed by a
  signal is named (SIGKILL: out of memory?); on a timeout, each unfinished
  rank's Python stack at the moment it was stopped; an interrupt says in one
  line that every rank was stopped.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import importlib
import multiprocessing as mp
import multiprocessing.pool as mp_pool
import multiprocessing.util as mp_util
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

from course_utils.devices import usable_cores
from course_utils.errors import RED, RESET, FriendlyError


class LaunchError(FriendlyError):
    """The processes could not be started as asked (Chapter 6)."""


class RankFailed(FriendlyError):
    """A rank raised or died; the others were stopped (Chapter 6)."""


class LaunchTimeout(FriendlyError, TimeoutError):
    """Some ranks did not finish within the timeout; all were stopped (Chapter 6)."""


class _Terminated(BaseException):
    """SIGTERM arrived while ranks were running (raised in the main thread)."""


@dataclass
class RankResult:
    """What one rank left behind: its return value and its captured output."""

    rank: int
    value: object
    stdout: str
    stderr: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (Chapter 6)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """True when ``port`` on 127.0.0.1 cannot be bound (Chapter 6)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def choose_backend(nprocs: int) -> str:
    """``'nccl'`` when every rank can have its own GPU, else ``'gloo'`` (Chapter 6)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= nprocs else "gloo"


def group_backend(backend: str) -> str:
    """The backend string a launch's process group is made with. Chapters 6, 9.

    ``"nccl"`` becomes ``"cpu:gloo,cuda:nccl"``: one group whose CUDA tensors
    go through nccl and CPU tensors through gloo, since nccl alone fails on a
    CPU tensor ("No backend type associated with device type cpu"). Any other
    backend string is used as it is.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def _importable(fn: Callable) -> bool:
    """Whether a fresh interpreter can find ``fn`` by its module and name."""
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__", "builtins"):
        return False
    try:
        found = importlib.import_module(module)
        for part in fn.__qualname__.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is fn


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", "the function")


# Imported once by the forkserver's server, so that every rank starts with them.
# DDP and the optimizers import torch._dynamo on first use (about a second of
# CPU each time), which brings FSDP2 and DTensor too; distributed checkpoints
# and pipelining add about half a second more: preloaded, no rank pays it.
PRELOAD = ["course_utils.dist", "torch.distributed", "torch._dynamo",
           "torch.distributed.checkpoint", "torch.distributed.pipelining"]


def choose_start_method(fn: Callable | None = None, backend: str = "gloo",
                        threads: int = 1) -> tuple[str, str]:
    """``(method, why)``: the forkserver where there is one, spawn elsewhere. Ch. 6.

    Both start a rank in a process that never ran the notebook's code, so CUDA
    and OpenMP state of the notebook do not matter, and both receive ``fn`` by
    value. ``fn``, ``backend`` and ``threads`` do not change the choice; they
    are accepted so that callers can say what they are about to launch.
    """
    if "forkserver" in mp.get_all_start_methods():
        return "forkserver", ""
    return "spawn", f" (spawn: {sys.platform} has no forkserver)"


@contextmanager
def _without_main():
    """Start processes that do not run this process's main script again.

    multiprocessing makes a forkserver's server and each spawned child import
    the main script (a script without an ``if __name__ == "__main__"`` guard
    would launch again, for ever). The ranks receive ``fn`` by value, so they
    never need it: while processes start, ``__main__`` is an empty module.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _stop_forkserver() -> None:
    """At exit, stop the forkserver and wait for it (registered below).

    Waiting reaps it, so the CPU seconds of every rank it started count as
    this process's children's (``resource.getrusage``), as forked ranks' did;
    left to exit by itself, it would be reaped by init and those seconds lost.
    """
    from multiprocessing import forkserver

    try:
        forkserver._forkserver._stop()
    except Exception:  # noqa: BLE001 - nothing to stop, or already gone
        pass


atexit.register(_stop_forkserver)


def _context(method: str):
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _to_plain(value):
    """Tensors to CPU tensors, recursively, so the parent can unpickle them."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_plain(v) for v in value)
    return value


# --- dying with the parent ------------------------------------------------------

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere).

    A rank's parent is the forkserver, which exits when the notebook does.
    """
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


# A watchdog that outlives a killed parent: it reads the ranks' process group ids
# from a pipe. "done" means the launch ended cleanly; end-of-file without it
# means the parent died: every group is killed and the ranks' folder removed.
WATCHDOG = """
import os, shutil, signal, sys
fd, folders, groups, buf = int(sys.argv[1]), sys.argv[2:], set(), b""
while chunk := os.read(fd, 4096):
    buf += chunk
    *lines, buf = buf.split(b"\\n")
    groups.update(line for line in lines)
if b"done" not in groups:
    for g in groups:
        for kill in (os.killpg, os.kill):
            try:
                kill(int(g), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    for folder in folders:  # the ranks' files, the forkserver's socket
        shutil.rmtree(folder, ignore_errors=True)
"""


class _Watchdog:
    """The watchdog process and the pipe that tells it which groups to end."""

    def __init__(self, *folders: str | Path):
        read, self.fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-c", WATCHDOG, str(read), *map(str, folders)],
                pass_fds=(read,),
                start_new_session=True,  # an interrupt of this process spares it
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            os.close(read)

    def watch(self, pgid: int) -> None:
        os.write(self.fd, f"{pgid}\n".encode())

    def close(self) -> None:
        try:
            os.write(self.fd, b"done\n")
        finally:
            os.close(self.fd)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the rank -----------------------------------------------------------------

READY_KEY = "course_utils.dist/connected"


def _wait_for_all_connected(rank: int, world_size: int, timeout: float) -> None:
    """Return once every rank has its process group, through the rendezvous store.

    Without it a rank whose function returns at once tears its process group
    down while a slower rank may still be connecting to it ("Connection closed
    by peer" in gloo's connectFullMesh). Rank 0 hosts the store, so it leaves
    last: only once every other rank has seen that all are connected.
    """
    if world_size == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    wait = timedelta(seconds=timeout)
    if store.add(READY_KEY, 1) == world_size:  # the last to connect says so
        store.set(READY_KEY + "/all", "1")
    if rank == 0:
        store.wait([READY_KEY + "/seen"], wait)
        return
    store.wait([READY_KEY + "/all"], wait)
    if store.add(READY_KEY + "/seen_by", 1) == world_size - 1:
        store.set(READY_KEY + "/seen", "1")


def _rank_main(payload: bytes) -> None:
    """The body of one rank (runs in the child process)."""
    job = cloudpickle.loads(payload)
    rank, world_size, workdir = job["rank"], job["world_size"], job["workdir"]
    if job["watchdog_fd"] is not None:  # forked directly: drop the parent's pipe
        try:
            os.close(job["watchdog_fd"])
        except OSError:
            pass
    try:
        os.setpgid(0, 0)  # a group of its own: its children are ended with it
    except OSError:
        pass
    _die_with_parent()
    out = os.open(f"{workdir}/{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(f"{workdir}/{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)  # file-descriptor level: C++ and subprocess output land here too
    os.dup2(err, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    stacks = open(f"{workdir}/{rank}.stack", "w")  # noqa: SIM115 - open until exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.clear()
    os.environ.update(job["env"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]),
                      RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(job["threads"])
    init, backend, timeout = job["init"], job["backend"], job["timeout"]
    result = {"ok": True, "value": None}
    try:
        fn, args = cloudpickle.loads(job["fn_and_args"])
        if init:
            device = None
            if "nccl" in backend:  # bind the rank to its GPU (barrier uses it too)
                device = torch.device("cuda", rank)
                torch.cuda.set_device(device)
            dist.init_process_group(group_backend(backend), rank=rank,
                                    world_size=world_size,
                                    timeout=timedelta(seconds=timeout),
                                    device_id=device)
            _wait_for_all_connected(rank, world_size, timeout)
        result["value"] = _to_plain(fn(rank, world_size, *args))
        data = cloudpickle.dumps(result)  # fail here, in the rank, if it cannot
    except SystemExit as e:  # sys.exit(0) or sys.exit() is a normal end
        if e.code not in (0, None):
            result = {"ok": False, "error": f"it called sys.exit({e.code!r})",
                      "traceback": ""}
        data = cloudpickle.dumps(result)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".strip(),
                  "traceback": "".join(traceback.format_exception(  # skip this frame
                      type(e), e, e.__traceback__.tb_next))}
        data = cloudpickle.dumps(result)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    with open(f"{workdir}/{rank}.tmp", "wb") as f:
        f.write(data)
    os.replace(f"{workdir}/{rank}.tmp", f"{workdir}/{rank}.pkl")
    if init and result["ok"] and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0 if result["ok"] else 1)  # skip exit handlers inherited from the parent


# --- stopping -----------------------------------------------------------------


def stop_tree(pids: list[int], grace: float = 2.0) -> None:
    """End processes and all their descendants: terminate, then kill (Chapter 6).

    The descendants are listed first, because a process that dies hands its
    children to init, where nobody would find them. torchrun starts its workers
    in sessions of their own, so a process group is not enough to reach them.
    """
    import psutil

    victims = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            victims += parent.children(recursive=True) + [parent]
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            v.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def _kill_groups(pgids: list[int], grace: float = 5.0) -> None:
    """SIGKILL what is left in the ranks' process groups (their own children),
    and wait until each is gone: a killed process ends only when the kernel
    next schedules it, which on a busy machine can come after the launch
    would otherwise have returned."""
    import psutil

    groups, members = set(pgids), []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getpgid(p.pid) in groups:
                members.append(p)
        except (OSError, psutil.Error):  # gone meanwhile
            pass
    for g in pgids:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:  # the group is empty already
            pass
    deadline = time.monotonic() + grace
    while members and time.monotonic() < deadline:
        members = [p for p in members if _running(p)]
        if members:
            time.sleep(0.005)


def _running(p) -> bool:
    """Alive and not a zombie (a zombie has ended; its parent reaps it)."""
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop(procs: list, grace: float = 2.0) -> None:
    """Stop every live rank and its children, and reap the ranks.

    The ranks' descendants are listed first (a process that dies hands its
    children to init, where nobody would find them) and ended with
    ``stop_tree``; the ranks themselves are ended and joined through
    multiprocessing, so that it knows they are gone.
    """
    import psutil

    pids = [p.pid for p in procs if p.pid is not None]
    descendants = []
    for pid in pids:
        try:
            descendants += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.terminate()
    stop_tree(descendants, grace)
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=grace)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=grace)
    _kill_groups(pids)  # children of ranks that had already returned


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
        oom = " (out of memory? the system kills the biggest process)" if (
            -code == signal.SIGKILL) else ""
        return f"it was killed by signal {-code} ({name}){oom} before returning"
    return f"it exited with code {code} before returning"


def _dump_stacks(procs, ranks, workdir: Path) -> dict[int, str]:
    """Each unfinished rank's Python stack, written by faulthandler on SIGUSR1."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    paths = [workdir / f"{r}.stack" for r in ranks]
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and not all(
            p.exists() and p.stat().st_size for p in paths):
        time.sleep(0.05)
    time.sleep(0.1)  # let faulthandler finish writing
    return {r: _read(workdir / f"{r}.stack") for r in ranks}


FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def _main_thread_stack(dump: str) -> str:
    """The frames of the thread that runs ``fn``, innermost first, trimmed."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    main = next((b for b in blocks if "_rank_main" in b), blocks[0] if blocks else "")
    lines = []
    for line in main.splitlines()[1:]:
        m = FRAME.search(line)
        if not m:
            continue
        if m["fn"] == "_rank_main":
            break  # the launcher's own frames below fn
        lines.append(f"    {m['fn']} ({Path(m['file']).name}, line {m['line']})")
    return "\n".join(lines[:12])


# --- launching ----------------------------------------------------------------


class LaunchInterrupted(KeyboardInterrupt):
    """The notebook was interrupted during a launch; every rank was stopped.

    Still a KeyboardInterrupt (whatever stops on Ctrl-C stops on it), shown in
    a notebook as its one-line message instead of a traceback (Chapter 6).
    """

    def _render_traceback_(self) -> list[str]:
        return [f"{RED}{self}{RESET}"]


@dataclass
class _Run:
    results: dict
    outs: list
    stacks: dict


def _collect(r: int, proc, workdir: Path) -> dict:
    """What rank ``r`` left: its pickled result, or why it has none."""
    pkl = workdir / f"{r}.pkl"
    if pkl.exists():
        return pickle.loads(pkl.read_bytes())
    if proc.exitcode == 0:  # os._exit(0): a normal end, no value
        return {"ok": True, "value": None}
    return {"ok": False, "traceback": "", "error": _exit_reason(proc.exitcode)}


def _run(fn, nprocs, args, timeout, backend, init, port, method, threads) -> _Run:
    """Start the ranks once, wait for them, stop them; return what they left."""
    ctx = _context(method)
    workdir = Path(tempfile.mkdtemp(prefix="course_dist_"))
    # if this process dies, its multiprocessing folder (the forkserver's
    # socket) goes with the ranks' folder: nobody else would remove it
    mp_folder = [] if method == "fork" else [mp_util.get_temp_dir()]
    watchdog = _Watchdog(workdir, *mp_folder)
    fn_and_args = cloudpickle.dumps((fn, tuple(args)))
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, name=f"rank{r}", args=(cloudpickle.dumps(
        {"rank": r, "world_size": nprocs, "fn_and_args": fn_and_args,
         "backend": backend, "port": port, "init": init, "timeout": timeout,
         "workdir": str(workdir), "threads": threads, "env": env,
         "watchdog_fd": watchdog.fd if method == "fork" else None}),))
        for r in range(nprocs)]
    results: dict[int, dict] = {}
    stacks: dict[int, str] = {}
    terminated = False
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:  # SIGTERM gets the clean-up of an interrupt (signals need main)
        def on_term(signum, frame):
            raise _Terminated

        old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        for p in procs:
            with _without_main():
                p.start()
            try:
                os.setpgid(p.pid, p.pid)  # also done by the rank: whoever is first
            except OSError:  # not our child (forkserver), or it did it already
                pass
            watchdog.watch(p.pid)
        running = {p.sentinel: r for r, p in enumerate(procs)}

        def wait_until(deadline: float, until_failed: bool = True) -> bool:
            failed = False
            while running and not (failed and until_failed) and (
                    time.monotonic() < deadline):
                # short slices: an interrupt delivered to another thread of this
                # process (Jupyter has several) is noticed within half a second
                left = deadline - time.monotonic()
                for s in wait(list(running), timeout=max(0.0, min(0.5, left))):
                    r = running.pop(s)
                    procs[r].join()
                    results[r] = _collect(r, procs[r], workdir)
                    failed = failed or not results[r]["ok"]
            return failed

        failed = wait_until(time.monotonic() + timeout)
        if failed and running and all(peer_went_away(res["error"])
                                      for res in results.values() if not res["ok"]):
            # failed only because a peer went: the peer may still be dying of
            # the cause (a C++ abort takes a moment, more on a busy machine);
            # let it end on its own, so that its reason is the one reported
            wait_until(time.monotonic() + PEER_GRACE_S, until_failed=False)
        for s, r in list(running.items()):  # returned, waiting for the others
            if (workdir / f"{r}.pkl").exists():
                results[r] = _collect(r, procs[r], workdir)
                failed = failed or not results[r]["ok"]
                del running[s]
        if running and not failed:
            stacks = _dump_stacks(procs, sorted(running.values()), workdir)
    except KeyboardInterrupt:
        _stop(procs)
        raise LaunchInterrupted(
            f"interrupted: all {nprocs} rank{'s' if nprocs > 1 else ''} stopped, "
            "nothing left running") from None
    except _Terminated:
        terminated = True
    finally:
        _stop(procs)
        watchdog.close()
        if on_main:
            signal.signal(signal.SIGTERM,
                          signal.SIG_DFL if old_term is None else old_term)
        outs = [(_read(workdir / f"{r}.out"), _read(workdir / f"{r}.err"))
                for r in range(nprocs)]
        shutil.rmtree(workdir, ignore_errors=True)
    if terminated:  # die of the signal, as whoever sent it meant, now all is clean
        if old_term in (None, signal.SIG_DFL):  # this process ends here, and
            for folder in mp_folder:  # its exit handlers will not run
                shutil.rmtree(folder, ignore_errors=True)
        signal.raise_signal(signal.SIGTERM)
        raise LaunchError(f"SIGTERM: all {nprocs} ranks were stopped")
    return _Run(results, outs, stacks)


PEER_GRACE_S = 5.0  # how long a peer of a rank that lost it may take to end

PEER_GONE = ("closed by peer", "reset by peer", "Connection was likely closed",
             "Broken pipe", "DistNetworkError")


def peer_went_away(error: str) -> bool:
    """Whether a rank failed only because another rank had gone."""
    return any(text in error for text in PEER_GONE)


def _port_taken(run: _Run) -> bool:
    error = run.results.get(0, {}).get("error", "")
    return "EADDRINUSE" in error or "address already in use" in error.lower()


def launch(fn: Callable, nprocs: int = 2, args: tuple = (), timeout: float = 60.0,
           backend: str | None = None, init: bool = True, port: int | None = None,
           echo: bool = True, start_method: str | None = None,
           threads: int = 1) -> list[RankResult]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` processes; return per rank. Ch. 6.

    ``init=False`` leaves ``init_process_group`` to ``fn`` (as a torchrun script
    does, from the environment). ``backend`` and ``start_method`` override the
    launcher's choices (``"fork"`` forks this process: one thread per rank,
    and no CUDA once this process has used it). ``threads`` is each rank's
    intra-op thread count (1: one core per rank, the analogue of one device
    per rank). ``echo`` prints each rank's output, prefixed ``[rank r]``.
    Raises ``RankFailed`` when a rank raises or dies and ``LaunchTimeout``
    when one is still running after ``timeout`` seconds; in both cases, and on
    KeyboardInterrupt or SIGTERM, every rank is stopped first.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be a whole number of processes, 1 or more: "
                          f"got {nprocs!r}.")
    if not isinstance(threads, int) or threads < 1:
        raise LaunchError(f"threads must be 1 or more: got {threads!r}.")
    if backend is None:
        backend = choose_backend(nprocs)
    elif "nccl" in backend and choose_backend(nprocs) != "nccl":
        raise LaunchError(f"nccl needs a GPU for every rank: {nprocs} ranks, "
                          f"{torch.cuda.device_count()} GPUs. Use backend='gloo'.")
    if start_method:
        method, why = start_method, ""
        if method not in mp.get_all_start_methods():
            raise LaunchError(f"start_method={method!r} does not exist on "
                              f"{sys.platform}: leave it out.")
        if method == "fork" and threads > 1:
            raise LaunchError("threads > 1 cannot be forked from this process: a "
                              "forked rank must run one thread (OpenMP is not "
                              "fork-safe). Leave start_method out.")
        if method == "fork" and "nccl" in backend and torch.cuda.is_initialized():
            raise LaunchError("CUDA is initialised in this process, and a forked "
                              "process cannot use CUDA: leave start_method out.")
    else:
        method, why = choose_start_method(fn, backend, threads)
    try:
        cloudpickle.dumps((fn, tuple(args)))
    except Exception as e:  # noqa: BLE001 - what cannot be sent, said plainly
        raise LaunchError(
            f"{_name(fn)} or its arguments cannot be sent to the ranks: "
            f"{type(e).__name__}: {e}. A function is sent with the notebook "
            "globals it uses: pass what it needs as arguments instead of "
            "using an object that cannot be copied (a lock, a widget, an open "
            "file).") from None
    picked = port is None
    if picked:
        port = free_port()
    elif port_in_use(port):
        raise LaunchError(f"port {port} on 127.0.0.1 is already in use: pass "
                          "port=None to let the launcher pick a free one.")
    cores = usable_cores()
    crowd = (f"; {nprocs * threads} threads on {cores} usable "
             f"core{'s' if cores > 1 else ''}: they take turns"
             if nprocs * threads > cores else "")
    print(f"launching {nprocs} process{'es' if nprocs > 1 else ''}: {method}, "
          f"backend {group_backend(backend)}, {threads} "
          f"thread{'s' if threads > 1 else ''} each, rendezvous 127.0.0.1:{port}, "
          f"timeout {timeout:g} s{why}{crowd}")
    if method == "fork":  # DDP and the optimizers import torch._dynamo on first use
        importlib.import_module("torch._dynamo")  # once here, inherited by the ranks
    run = _run(fn, nprocs, args, timeout, backend, init, port, method, threads)
    if picked and _port_taken(run):  # another program took the port meanwhile
        port = free_port()
        print(f"port taken in the meantime: retrying on 127.0.0.1:{port}")
        run = _run(fn, nprocs, args, timeout, backend, init, port, method, threads)
    results, outs = run.results, run.outs
    if echo:
        for r, (out, err) in enumerate(outs):
            for line in (out + err).splitlines():
                print(f"[rank {r}] {line}")
    bad = {r: res for r, res in results.items() if not res["ok"]}
    if bad:
        # the cause, not a consequence: a rank whose peer died fails too, on a
        # closed connection, and may be noticed first
        r = min(bad, key=lambda k: (peer_went_away(bad[k]["error"]), k))
        stopped = set(range(nprocs)) - set(results)
        tail = f" ({_ranks(stopped)} stopped)" if stopped else ""
        hint = ("\nhint: a forked rank cannot use CUDA once this process has "
                "initialised it; leave start_method out"
                if any(text in bad[r]["error"] for text in
                       ("forked subprocess", "initialization error")) else "")
        raise RankFailed(f"rank {r} failed: {bad[r]['error']}{tail}{hint}\n"
                         f"--- traceback of rank {r} ---\n{bad[r]['traceback']}"
                         f"{outs[r][1][-2000:] if not bad[r]['traceback'] else ''}")
    missing = sorted(set(range(nprocs)) - set(results))
    if missing:
        done = f"; {_ranks(results)} finished" if results else ""
        where = []
        for r in missing:
            stack = _main_thread_stack(run.stacks.get(r, ""))
            where.append(f"  rank {r} was in (innermost first):\n{stack}" if stack
                         else f"  rank {r}: no stack (it did not answer in time)")
        waiting = any("distributed" in run.stacks.get(r, "") for r in missing)
        why = (" A rank waiting in a collective that another rank never joins "
               "waits for ever." if waiting else "")
        raise LaunchTimeout(f"{_ranks(missing)} did not finish within {timeout:g} s"
                            f"{done}; all ranks were stopped.{why}\n"
                            "Where each unfinished rank was:\n" + "\n".join(where))
    return [RankResult(r, results[r]["value"], *outs[r]) for r in range(nprocs)]


# --- worker pools (Chapter 4) -------------------------------------------------------


def pool_initializer(parent: int | None = None, threads: int = 1) -> None:
    """Run first in each pool worker: ``threads`` torch threads, die with the parent.

    ``course_utils.dist.pool`` passes it for you. For a pool of your own, pass
    ``initializer=pool_initializer, initargs=(os.getpid(),)`` to a forked pool:
    one thread keeps a forked worker clear of the OpenMP hang, and a
    parent-death signal ends the worker if the notebook's kernel dies.
    """
    torch.set_num_threads(threads)
    _die_with_parent(parent)


def _loaded(blob: bytes) -> _ByValue:
    fn = _LOADED.get(blob)
    if fn is None:  # once per worker and function, not once per task
        fn = _LOADED[blob] = _ByValue(cloudpickle.loads(blob))
    return fn


_LOADED: dict[bytes, _ByValue] = {}


class _ByValue:
    """A function that travels to pool workers by value (cloudpickle)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __reduce__(self):
        return _loaded, (cloudpickle.dumps(self.fn),)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class _Pool(mp_pool.Pool):
    """``multiprocessing.Pool`` whose tasks may be functions defined in a notebook."""

    def apply_async(self, func, *args, **kwargs):
        return super().apply_async(_ByValue(func), *args, **kwargs)

    def _map_async(self, func, *args, **kwargs):
        return super()._map_async(_ByValue(func), *args, **kwargs)

    def imap(self, func, *args, **kwargs):
        return super().imap(_ByValue(func), *args, **kwargs)

    def imap_unordered(self, func, *args, **kwargs):
        return super().imap_unordered(_ByValue(func), *args, **kwargs)


@contextmanager
def pool(processes: int, method: str | None = None, threads: int = 1):
    """A ``multiprocessing.Pool`` safe to use from a notebook; always torn down.

    Workers start like the launcher's ranks (from the forkserver, or spawned
    where there is none), so functions defined in the notebook work and
    whatever the notebook initialised does not reach them; each runs
    ``threads`` torch threads. ``method="fork"`` forks this process instead
    (then keep one thread). Leaving the ``with`` block terminates and joins
    the workers, whatever happened inside. Wait with a timeout, never
    without: ``p.map_async(f, xs).get(timeout=60)``.

        with dist.pool(2) as p:
            squares = p.map_async(square, range(10)).get(timeout=60)
    """
    if processes < 1:
        raise LaunchError(f"processes must be at least 1, not {processes}")
    if method is None:
        method = choose_start_method()[0]
    if method not in mp.get_all_start_methods():
        raise LaunchError(f"start method {method!r} does not exist on "
                          f"{sys.platform}: leave method out.")
    if method == "fork" and threads > 1:
        raise LaunchError("a forked worker must run one thread (OpenMP is not "
                          "fork-safe): leave method out to use more.")
    with _without_main():
        workers = _Pool(processes, initializer=pool_initializer,
                        initargs=(os.getpid() if method == "fork" else None,
                                  threads),
                        context=_context(method))
    try:
        yield workers
    finally:
        workers.terminate()
        workers.join()


def pool_map(fn: Callable, items, processes: int, timeout: float = 60.0,
             chunksize: int | None = None) -> list:
    """``[fn(x) for x in items]`` in a fresh ``pool``, or TimeoutError."""
    with pool(processes) as p:
        return p.map_async(fn, items, chunksize).get(timeout)
