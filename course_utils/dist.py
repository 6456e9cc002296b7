"""Run a function in N processes from a notebook: ``launch(fn, nprocs=2)``.

Introduced in Chapter 6 (DistributedDataParallel); the data, pipeline and
sharding chapters use it too. Each rank runs ``fn(rank, world_size, *args)``
inside an initialised process group, as torchrun would run a script:

- start method: ``fork``, so functions defined in the notebook work. While
  CUDA is not initialised in this process the forked ranks may use their GPUs
  (nccl); ``course_utils`` asks NVML, not the CUDA driver, how many GPUs there
  are, so importing it and printing the banner keep it that way. Once CUDA is
  initialised, forked ranks stay on the CPU (gloo, and the launcher says so),
  a function importable from a module is spawned instead, and asking for nccl
  with a notebook function is refused in one line;
- rendezvous on a free port of 127.0.0.1 (``MASTER_ADDR``, ``MASTER_PORT``,
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` are set);
- backend ``nccl`` when there is a GPU per rank, ``gloo`` otherwise (printed);
- each rank's stdout and stderr (C-level output too) and its return value come
  back as plain data; tensors are moved to the CPU first;
- a per-run timeout, and no process left behind after success, a failing rank,
  a timeout or a KeyboardInterrupt.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch

from course_utils.errors import FriendlyError


class LaunchError(FriendlyError):
    """The processes could not be started as asked (Chapter 6)."""


class RankFailed(FriendlyError):
    """A rank raised or died; the others were stopped (Chapter 6)."""


class LaunchTimeout(FriendlyError, TimeoutError):
    """Some ranks did not finish within the timeout; all were stopped (Chapter 6)."""


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


def _importable(fn: Callable) -> bool:
    """Whether a spawned process can find ``fn`` by its module and name."""
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


def choose_start_method(fn: Callable, backend: str) -> tuple[str, str]:
    """``(method, why)``: fork when safe, spawn for module functions (Chapter 6).

    A forked process cannot use CUDA once its parent has initialised it (torch
    raises if it tries), so after that fork is used only for CPU ranks (gloo).
    """
    fork_ok = "fork" in mp.get_all_start_methods()
    if fork_ok and not torch.cuda.is_initialized():
        return "fork", ""  # the ranks may initialise CUDA themselves: nccl works
    if fork_ok and backend == "gloo":
        return "fork", (" (CUDA is initialised in this process, so forked ranks must "
                        "stay on the CPU; restart the kernel to use the GPUs)")
    if _importable(fn):
        return "spawn", " (spawn: CUDA is already initialised in this process)"
    raise LaunchError(
        "CUDA is already initialised in this process, and a forked process cannot "
        "use CUDA: restart the kernel and launch before any CUDA call, or move "
        f"{getattr(fn, '__name__', 'the function')} into a .py module so it can be "
        "spawned.")


def _to_plain(value):
    """Tensors to CPU tensors, recursively, so the parent can unpickle them."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_plain(v) for v in value)
    return value


def _rank_main(fn, rank, world_size, args, backend, port, init, timeout, workdir):
    """The body of one rank (runs in the child process)."""
    out = os.open(f"{workdir}/{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(f"{workdir}/{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)  # file-descriptor level: C++ and subprocess output land here too
    os.dup2(err, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist = torch.distributed
    result = {"ok": True, "value": None}
    try:
        if init:
            device = None
            if backend == "nccl":  # bind the rank to its GPU (barrier uses it too)
                device = torch.device("cuda", rank)
                torch.cuda.set_device(device)
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout),
                                    device_id=device)
        result["value"] = _to_plain(fn(rank, world_size, *args))
        pickle.dumps(result)  # fail here, in the rank, if it cannot be sent
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".strip(),
                  "traceback": "".join(traceback.format_exception(  # skip this frame
                      type(e), e, e.__traceback__.tb_next))}
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    with open(f"{workdir}/{rank}.tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(f"{workdir}/{rank}.tmp", f"{workdir}/{rank}.pkl")
    if init and result["ok"] and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0 if result["ok"] else 1)  # skip exit handlers inherited from the parent


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


def _stop(procs: list) -> None:
    """Stop every live rank and its children, and reap the ranks."""
    stop_tree([p.pid for p in procs if p.pid is not None])
    for p in procs:
        if p.pid is not None:
            p.join(timeout=1)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def launch(fn: Callable, nprocs: int = 2, args: tuple = (), timeout: float = 60.0,
           backend: str | None = None, init: bool = True, port: int | None = None,
           echo: bool = True, start_method: str | None = None) -> list[RankResult]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` processes; return per rank. Ch. 6.

    ``init=False`` leaves ``init_process_group`` to ``fn`` (as a torchrun script
    does, from the environment). ``backend`` and ``start_method`` override the
    launcher's choices. ``echo`` prints each rank's output, prefixed
    ``[rank r]``. Raises ``RankFailed`` when a rank raises or dies and
    ``LaunchTimeout`` when one is still running after ``timeout`` seconds; in
    both cases, and on KeyboardInterrupt, every rank is stopped first.
    """
    note = ""
    if backend is None:
        backend = choose_backend(nprocs)
        if (backend == "nccl" and torch.cuda.is_initialized()
                and not _importable(fn)):  # forked ranks could not use the GPUs
            backend, note = "gloo", " instead of nccl"  # the start method says why
    elif backend == "nccl" and choose_backend(nprocs) != "nccl":
        raise LaunchError(f"nccl needs a GPU for every rank: {nprocs} ranks, "
                          f"{torch.cuda.device_count()} GPUs. Use backend='gloo'.")
    if start_method:
        method, why = start_method, ""
    else:
        method, why = choose_start_method(fn, backend)
    if port is None:
        port = free_port()
    elif port_in_use(port):
        raise LaunchError(f"port {port} on 127.0.0.1 is already in use: pass "
                          "port=None to let the launcher pick a free one.")
    print(f"launching {nprocs} processes: {method}, backend {backend}{note}, "
          f"rendezvous 127.0.0.1:{port}, timeout {timeout:g} s{why}")
    ctx = mp.get_context(method)
    workdir = Path(tempfile.mkdtemp(prefix="course_dist_"))
    procs = [ctx.Process(target=_rank_main, name=f"rank{r}",
                         args=(fn, r, nprocs, tuple(args), backend, port, init,
                               timeout, str(workdir)))
             for r in range(nprocs)]
    results: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        running = {p.sentinel: r for r, p in enumerate(procs)}
        failed = False
        while running and not failed and time.monotonic() < deadline:
            for s in wait(list(running), timeout=max(0.0, deadline - time.monotonic())):
                r = running.pop(s)
                procs[r].join()
                pkl = workdir / f"{r}.pkl"
                results[r] = (pickle.loads(pkl.read_bytes()) if pkl.exists() else
                              {"ok": False, "traceback": "",
                               "error": f"it exited with code {procs[r].exitcode} "
                                        "before returning"})
                failed = failed or not results[r]["ok"]
    except KeyboardInterrupt:
        _stop(procs)
        print(f"interrupted: stopped all {nprocs} ranks")
        raise
    finally:
        _stop(procs)
        outs = [(_read(workdir / f"{r}.out"), _read(workdir / f"{r}.err"))
                for r in range(nprocs)]
        shutil.rmtree(workdir, ignore_errors=True)
    if echo:
        for r, (out, err) in enumerate(outs):
            for line in (out + err).splitlines():
                print(f"[rank {r}] {line}")
    bad = {r: res for r, res in results.items() if not res["ok"]}
    if bad:
        r = next(iter(bad))  # the first to fail; the others may fail because of it
        stopped = set(range(nprocs)) - set(results)
        tail = f" ({_ranks(stopped)} stopped)" if stopped else ""
        hint = ("\nhint: a forked rank cannot use CUDA once this process has "
                "initialised it; restart the kernel and launch before any CUDA call"
                if any(text in bad[r]["error"] for text in
                       ("forked subprocess", "initialization error")) else "")
        raise RankFailed(f"rank {r} failed: {bad[r]['error']}{tail}{hint}\n"
                         f"--- traceback of rank {r} ---\n{bad[r]['traceback']}"
                         f"{outs[r][1][-2000:] if not bad[r]['traceback'] else ''}")
    missing = set(range(nprocs)) - set(results)
    if missing:
        done = f"; {_ranks(results)} finished" if results else ""
        raise LaunchTimeout(f"{_ranks(missing)} did not finish within {timeout:g} s"
                            f"{done}; all ranks were stopped (a rank waiting in a "
                            "collective that another rank never joins hangs).")
    return [RankResult(r, results[r]["value"], *outs[r]) for r in range(nprocs)]
