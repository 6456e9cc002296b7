"""The notebook launcher (course_utils.dist, Chapter 6), with real processes."""

import os
import signal
import socket
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from course_utils.dist import (
    LaunchError,
    LaunchTimeout,
    RankFailed,
    choose_backend,
    free_port,
    launch,
)


@pytest.fixture(autouse=True)
def no_orphans():
    """Every test must leave no child process behind (checked after it)."""
    yield
    left = [p for p in psutil.Process().children(recursive=True)
            # multiprocessing's own helper, started by spawn, lives as long as we do
            if "resource_tracker" not in " ".join(p.cmdline())]
    assert not left, f"processes left behind: {left}"


def hello(rank, world_size):
    print(f"hello from {rank} of {world_size}")
    os.system(f"echo c-level {rank}")  # written by another process, to fd 1
    return {"rank": rank, "env": (os.environ["RANK"], os.environ["WORLD_SIZE"],
                                  os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"])}


def test_return_values_and_captured_output():
    results = launch(hello, 2, echo=False)
    assert [r.value["rank"] for r in results] == [0, 1]
    assert results[1].value["env"] == ("1", "2", "1", "127.0.0.1")
    assert results[0].stdout == "hello from 0 of 2\nc-level 0\n"
    assert "hello from 1 of 2" in results[1].stdout


def summed(rank, world_size):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return t


def test_all_reduce_with_gloo(capsys):
    results = launch(summed, 2)
    assert "backend gloo" in capsys.readouterr().out
    for r in results:
        assert torch.equal(r.value, torch.full((3,), 3.0))


def test_backend_choice():
    assert choose_backend(torch.cuda.device_count() + 1) == "gloo"


def raises_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here forever: the launcher must stop it


def test_a_rank_that_raises():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(raises_on_rank_1, 2, timeout=30, echo=False)
    message = str(info.value)
    assert "rank 1 failed: ValueError: rank one is broken" in message
    assert "raise ValueError" in message  # the rank's traceback text
    assert "rank 0 stopped" in message
    assert time.monotonic() - start < 10


def hangs_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def test_a_rank_that_hangs():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match="rank 1 did not finish within 2 s"):
        launch(hangs_on_rank_1, 2, timeout=2, echo=False)
    assert time.monotonic() - start < 8


def exits_early(rank, world_size):
    os._exit(3)


def test_a_rank_that_dies():
    with pytest.raises(RankFailed, match="exited with code 3"):
        launch(exits_early, 2, timeout=10, echo=False, init=False)


def test_port_already_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} .* already in use"):
            launch(hello, 2, port=port, echo=False)
        assert free_port() != port
        os.environ["MASTER_PORT"] = str(port)  # a stale setting must not matter
        try:
            assert launch(summed, 2, echo=False)[0].value[0] == 3.0
        finally:
            del os.environ["MASTER_PORT"]


def sleeps(rank, world_size, seconds):
    time.sleep(seconds)


def test_keyboard_interrupt_stops_every_rank():
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(sleeps, 2, args=(30,), timeout=30, echo=False, init=False)
    timer.join()
    assert time.monotonic() - start < 8


def test_unpicklable_return_value_is_reported():
    with pytest.raises(RankFailed, match="rank 0 failed"):
        launch(lambda rank, ws: threading.Lock(), 1, echo=False, init=False)


def test_cuda_initialised_refuses_or_spawns(monkeypatch):
    from course_utils import dist as d

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert d.choose_start_method(summed, "nccl")[0] == "spawn"  # importable
    assert d.choose_start_method(lambda r, w: None, "gloo")[0] == "fork"  # CPU ranks
    with pytest.raises(LaunchError, match="CUDA is already initialised"):
        d.choose_start_method(lambda r, w: None, "nccl")
    monkeypatch.setattr(d, "choose_backend", lambda nprocs: "nccl")  # GPUs enough
    with pytest.raises(LaunchError, match="CUDA is already initialised"):
        launch(lambda r, w: None, 2, backend="nccl")


def test_cuda_initialised_falls_back_to_gloo_and_says_so(monkeypatch, capsys):
    from course_utils import dist as d

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(d, "choose_backend", lambda nprocs: "nccl")
    results = launch(lambda r, w: dist.get_backend(), 2, echo=False)
    line = capsys.readouterr().out
    assert "fork, backend gloo instead of nccl" in line
    assert "CUDA is initialised in this process" in line
    assert [r.value for r in results] == ["gloo", "gloo"]


def test_nccl_without_a_gpu_per_rank_is_refused():
    with pytest.raises(LaunchError, match="nccl needs a GPU for every rank"):
        launch(summed, torch.cuda.device_count() + 1, backend="nccl")


def test_spawn_runs_a_module_function(capsys):
    results = launch(summed, 2, timeout=60, start_method="spawn")
    assert "spawn" in capsys.readouterr().out
    assert torch.equal(results[1].value, torch.full((3,), 3.0))


def hangs_with_a_child(rank, world_size):
    import subprocess

    subprocess.Popen(["sleep", "60"])  # a grandchild of the test process
    time.sleep(60)


def test_stop_tree_reaches_children_in_their_own_session():
    import subprocess

    from course_utils.dist import stop_tree

    # like a torchrun agent, whose workers run in sessions of their own
    agent = subprocess.Popen(["bash", "-c", "setsid sleep 60 & sleep 60"])
    time.sleep(0.3)
    assert psutil.Process(agent.pid).children()
    stop_tree([agent.pid])
    agent.wait(timeout=5)


def test_timeout_also_ends_the_ranks_children():
    with pytest.raises(LaunchTimeout, match="ranks 0, 1 did not finish"):
        launch(hangs_with_a_child, 2, timeout=2, echo=False, init=False)
