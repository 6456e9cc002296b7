"""The notebook launcher (course_utils.dist, Chapter 6), with real processes."""

import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import machine_s
from torch import nn

from course_utils.dist import (
    LaunchError,
    LaunchTimeout,
    RankFailed,
    choose_backend,
    free_port,
    group_backend,
    launch,
    pool,
    pool_map,
)


@pytest.fixture(autouse=True)
def no_orphans():
    """Every test must leave no child process behind (checked after it)."""
    yield
    left = [p for p in psutil.Process().children(recursive=True)
            # multiprocessing's own helpers (the forkserver's server and the
            # resource tracker) live as long as we do; the ranks they start do not
            if not any(helper in " ".join(p.cmdline())
                       for helper in ("resource_tracker", "forkserver"))]
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
    assert group_backend("nccl") == "cpu:gloo,cuda:nccl"  # CPU tensors too
    assert group_backend("gloo") == "gloo"


def cpu_tensors_in_the_launchers_groups(rank, world_size):
    """CPU collectives in the default group and in a device mesh's groups,
    on whatever device this rank owns, then FSDP2 with its shards on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    on_gpu = "nccl" in dist.get_backend()
    dev = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    t = torch.full((3,), float(rank + 1))  # a CPU tensor, whatever the rank owns
    dist.all_reduce(t)
    gathered = torch.empty(world_size)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
    mesh = init_device_mesh(dev.type, (world_size, 1), mesh_dim_names=("a", "b"))
    in_mesh = [torch.ones(1) for _ in range(2)]
    for x, name in zip(in_mesh, ("a", "b"), strict=True):
        dist.all_reduce(x, group=mesh.get_group(name))
    on_dev = torch.ones(2, device=dev)
    dist.all_reduce(on_dev)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    pin = torch.cuda.is_available()  # pinning needs CUDA
    for layer in model:
        fully_shard(layer, mesh=mesh["a"], offload_policy=CPUOffloadPolicy(pin))
    fully_shard(model, mesh=mesh["a"], offload_policy=CPUOffloadPolicy(pin))
    model(torch.randn(2, 4, device=dev)).sum().backward()
    full = model[0].weight.full_tensor()  # an all-gather of CPU shards
    return (dist.get_backend(), t, gathered, [x.item() for x in in_mesh],
            on_dev.cpu(), str(model[0].weight.device), tuple(full.shape))


def check_cpu_tensors_crossed(results, world_size, backend):
    for r in results:
        got_backend, t, gathered, in_mesh, on_dev, shard_device, full = r.value
        assert got_backend == backend
        assert torch.equal(t, torch.full((3,), world_size * (world_size + 1) / 2))
        assert torch.equal(gathered, torch.arange(float(world_size)))
        assert in_mesh == [world_size, 1]
        assert torch.equal(on_dev, torch.full((2,), float(world_size)))
        assert shard_device == "cpu" and full == (4, 4)


def test_cpu_tensors_cross_the_launchers_group_on_cpu_ranks():
    results = launch(cpu_tensors_in_the_launchers_groups, 2, backend="gloo",
                     echo=False, timeout=120)
    check_cpu_tensors_crossed(results, 2, "gloo")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU: the launcher makes a nccl group only for "
                    "ranks that own one (the CPU twin above always runs)")
def test_cpu_tensors_cross_the_launchers_group_on_gpu_ranks(capsys):
    n = torch.cuda.device_count()  # one rank per GPU: the launcher picks nccl
    results = launch(cpu_tensors_in_the_launchers_groups, n, echo=False,
                     timeout=180)
    assert "backend cpu:gloo,cuda:nccl" in capsys.readouterr().out
    check_cpu_tensors_crossed(results, n, "cpu:gloo,cuda:nccl")


def raises_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here forever: the launcher must stop it


def test_a_rank_that_raises():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(raises_on_rank_1, 2, timeout=30, echo=False)
    message = str(info.value)
    # rank 1 is named, not rank 0 (stopped, or failed when its peer went away)
    assert "rank 1 failed: ValueError: rank one is broken" in message
    assert "raise ValueError" in message  # the rank's traceback text
    assert time.monotonic() - start < machine_s(20)  # rank 0 did not wait for ever


def hangs_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def test_a_rank_that_hangs():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match="rank 1 did not finish within 8 s"):
        launch(hangs_on_rank_1, 2, timeout=8, echo=False)
    assert time.monotonic() - start < machine_s(20)


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


@pytest.mark.parametrize("directed", ["process", "main thread"])
def test_keyboard_interrupt_stops_every_rank(directed):
    # Jupyter interrupts the kernel process with SIGINT; the kernel has several
    # threads, and a process-directed signal may land on any of them.
    def interrupt():
        if directed == "process":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # a shell that starts a job in the background ignores SIGINT in it: as in a
    # notebook kernel, an interrupt must raise KeyboardInterrupt here
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, interrupt)
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            launch(sleeps, 2, args=(30,), timeout=30, echo=False, init=False)
        assert time.monotonic() - start < machine_s(15)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, old)


def test_unpicklable_return_value_is_reported():
    with pytest.raises(RankFailed, match="rank 0 failed"):
        launch(lambda rank, ws: threading.Lock(), 1, echo=False, init=False)


def test_cuda_initialised_here_does_not_change_how_ranks_start(monkeypatch):
    from course_utils import dist as d

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    # the ranks come from a fresh interpreter, which never saw this CUDA
    assert d.choose_start_method(lambda r, w: None, "nccl")[0] == "forkserver"
    monkeypatch.setattr(d, "choose_backend", lambda nprocs: "nccl")  # GPUs enough
    with pytest.raises(LaunchError, match="a forked process cannot use CUDA"):
        launch(lambda r, w: None, 2, start_method="fork")


def test_nccl_without_a_gpu_per_rank_is_refused():
    with pytest.raises(LaunchError, match="nccl needs a GPU for every rank"):
        launch(summed, torch.cuda.device_count() + 1, backend="nccl")


def test_spawn_runs_a_module_function_and_a_notebook_function(capsys):
    results = launch(summed, 2, timeout=60, start_method="spawn")
    assert "spawn" in capsys.readouterr().out
    assert torch.equal(results[1].value, torch.full((3,), 3.0))
    offset = 10  # a global of the "notebook", sent with the function
    results = launch(lambda rank, ws: rank + offset, 2, timeout=60, init=False,
                     start_method="spawn", echo=False)
    assert [r.value for r in results] == [10, 11]


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


# --- issue: no hang, nothing left behind, clear errors ------------------------


def matmul_threads(rank, world_size):
    a = torch.randn(600, 600)
    return torch.get_num_threads(), float((a @ a).sum())


def test_no_openmp_hang_after_a_threaded_op_in_the_parent(capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        b = torch.randn(1500, 1500)
        b @ b  # starts OpenMP's thread pool in this process
        for nprocs in (1, 2):
            results = launch(matmul_threads, nprocs, timeout=20, echo=False,
                             init=False)
            assert [r.value[0] for r in results] == [1] * nprocs
        assert "1 thread each" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


def test_threads_per_rank_after_a_threaded_op_here(capsys):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(1500, 1500) @ torch.randn(1500, 1500)

        def notebook_matmul(rank, world_size):  # defined here: sent by value
            a = torch.randn(600, 600)
            t = torch.ones(1)
            dist.all_reduce(t)
            return torch.get_num_threads(), float((a @ a).sum()), float(t)

        launch(notebook_matmul, 2, timeout=60, echo=False, threads=2)  # warm
        start = time.monotonic()
        results = launch(notebook_matmul, 2, timeout=60, echo=False, threads=2)
        seconds = time.monotonic() - start
    finally:
        torch.set_num_threads(before)
    assert [(r.value[0], r.value[2]) for r in results] == [(2, 2.0), (2, 2.0)]
    out = capsys.readouterr().out
    assert "forkserver" in out and "2 threads each" in out
    assert seconds < machine_s(10)  # well under a second on a quiet machine


def test_threads_cannot_be_forked_from_here():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="OpenMP is not fork-safe"):
        launch(matmul_threads, 2, threads=2, start_method="fork")
    assert time.monotonic() - start < machine_s(1)


@pytest.mark.parametrize("nprocs", [0, -1, 1.5])
def test_bad_process_counts_are_refused(nprocs):
    with pytest.raises(LaunchError, match="nprocs"):
        launch(hello, nprocs)


def test_a_platform_without_forkserver_spawns(monkeypatch, capsys):
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods",
                        lambda: ["spawn"])
    results = launch(lambda rank, ws: rank * 2, 2, init=False, echo=False)
    assert [r.value for r in results] == [0, 2]
    assert "spawn: linux has no forkserver" in capsys.readouterr().out


def exits_zero(rank, world_size):
    if rank == 0:
        sys.exit(0)
    os._exit(0)


def exits_nonzero(rank, world_size):
    sys.exit(4)


def test_sys_exit_zero_is_success_and_nonzero_is_not():
    assert [r.value for r in launch(exits_zero, 2, echo=False, init=False)] == [
        None, None]
    with pytest.raises(RankFailed, match=r"sys.exit\(4\)"):
        launch(exits_nonzero, 1, echo=False, init=False)


def killed(rank, world_size):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_rank_is_named_with_its_signal():
    with pytest.raises(RankFailed, match=r"signal 9 \(SIGKILL\) \(out of memory"):
        launch(killed, 1, echo=False, init=False)


def aborts_after_its_peer_lost_it(rank, world_size):
    if rank == 1:  # what a rank sees when its peer is going: a closed socket
        raise RuntimeError("Read error: Connection reset by peer")
    time.sleep(1.0)  # the peer is still dying of the cause, as a C++ abort does
    sys.stderr.write("what(): Received data size doesn't match expected size\n")
    sys.stderr.flush()
    os.abort()


def test_the_cause_is_reported_when_the_rank_that_lost_its_peer_ends_first():
    with pytest.raises(RankFailed) as info:
        launch(aborts_after_its_peer_lost_it, 2, timeout=30, echo=False, init=False)
    message = str(info.value)
    assert message.startswith("rank 0 failed") and "SIGABRT" in message, message
    assert "doesn't match expected size" in message  # the dying rank's own words


def stuck_in_all_reduce(rank, world_size):
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def test_timeout_shows_where_each_rank_was():
    with pytest.raises(LaunchTimeout) as info:
        launch(stuck_in_all_reduce, 2, timeout=10, echo=False)
    message = str(info.value)
    assert "ranks 0, 1 did not finish within 10 s" in message
    assert "stuck_in_all_reduce (test_dist.py" in message  # both ranks' frames
    assert "all_reduce (distributed_c10d.py" in message  # rank 0 waits in it
    assert "collective that another rank never joins" in message


def test_timeout_without_a_collective_does_not_blame_one():
    with pytest.raises(LaunchTimeout) as info:
        launch(hangs_on_rank_1, 2, timeout=8, echo=False, init=False)
    assert "collective" not in str(info.value)
    assert "hangs_on_rank_1 (test_dist.py" in str(info.value)


def starts_a_child_and_returns(rank, world_size, pidfile):
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    with open(pidfile, "a") as f:
        f.write(f"{child.pid}\n")
    return child.pid


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_ranks_children_end_with_it_after_a_normal_return(tmp_path):
    results = launch(starts_a_child_and_returns, 2, args=(tmp_path / "pids",),
                     echo=False, init=False)
    for r in results:
        assert gone(r.value), f"rank {r.rank}'s child {r.value} outlived launch"


def test_an_auto_picked_port_taken_meanwhile_is_retried(monkeypatch, capsys):
    from course_utils import dist as d

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = iter([busy.getsockname()[1]])
        real = d.free_port
        monkeypatch.setattr(d, "free_port", lambda: next(ports, None) or real())
        assert launch(summed, 2, echo=False, timeout=20)[0].value[0] == 3.0
    assert "retrying" in capsys.readouterr().out


PARENT = """
import sys, time
from course_utils.dist import launch

def rank_fn(rank, world_size, pidfile):
    import os, subprocess
    child = subprocess.Popen(["sleep", "300"])
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    time.sleep(300)

if __name__ == "__main__":
    launch(rank_fn, 2, args=(sys.argv[1],), timeout=300, init=False)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ranks_die_with_their_parent(tmp_path, sig):
    import subprocess

    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    pidfile = tmp_path / "pids"
    tmp = tmp_path / "tmp"  # where the launcher makes the ranks' folder
    tmp.mkdir()
    parent = subprocess.Popen([sys.executable, str(script), str(pidfile)],
                              env=dict(os.environ, TMPDIR=str(tmp)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120  # a fresh Python, torch, the server
        while time.monotonic() < deadline and (
                not pidfile.exists() or len(pidfile.read_text().split()) < 4):
            time.sleep(0.1)
        pids = [int(p) for p in pidfile.read_text().split()]
        assert len(pids) == 4, "the ranks did not start"
        parent.send_signal(sig)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(map(gone, pids)):
            time.sleep(0.1)
        assert all(map(gone, pids)), [p for p in pids if not gone(p)]
        def left():  # torch's own compile cache (made by importing it) may stay
            return [p for p in tmp.iterdir() if not p.name.startswith("torchinductor")]

        while time.monotonic() < deadline and left():
            time.sleep(0.1)
        assert not left(), f"folders left behind: {left()}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _square_after_matmul(x):
    a = torch.ones(300, 300)
    return (a @ a)[0, 0].item() * 0 + x * x, torch.get_num_threads()


def test_pool_workers_run_one_thread_and_do_not_hang_after_a_parent_matmul():
    torch.set_num_threads(2)
    b = torch.ones(1500, 1500)
    _ = b @ b  # the parent has run a multi-threaded op: OpenMP's state is forked
    out = pool_map(_square_after_matmul, range(5), processes=2, timeout=30)
    assert [v for v, _ in out] == [0, 1, 4, 9, 16]
    assert {t for _, t in out} == {1}


def _sleep_forever(_):
    time.sleep(300)


def test_pool_times_out_and_leaves_no_worker():
    before = set(mp.active_children())  # other tests' processes are not ours
    start = time.monotonic()
    with pytest.raises(mp.TimeoutError):
        pool_map(_sleep_forever, [1, 2], processes=2, timeout=1)
    assert time.monotonic() - start < machine_s(20)
    time.sleep(0.5)
    assert not set(mp.active_children()) - before
    with pytest.raises(LaunchError, match="at least 1"):
        with pool(0):
            pass


# --- forkserver and cloudpickle -------------------------------------------------


def test_the_environment_at_launch_reaches_the_ranks(monkeypatch):
    launch(lambda r, w: None, 1, init=False, echo=False)  # the server runs already
    monkeypatch.setenv("COURSE_PROBE", "set after the server started")
    results = launch(lambda r, w: os.environ.get("COURSE_PROBE"), 2, init=False,
                     echo=False)
    assert [r.value for r in results] == ["set after the server started"] * 2


def test_classes_defined_here_travel_both_ways():
    class Point:  # a local class: cloudpickle sends it by value
        def __init__(self, x):
            self.x = x

    results = launch(lambda r, w, p: Point(p.x + r), 2, args=(Point(5),),
                     init=False, echo=False)
    assert [type(r.value) is Point for r in results] == [True, True]
    assert [r.value.x for r in results] == [5, 6]


def test_what_cannot_be_sent_is_said_before_any_rank_starts():
    lock = threading.Lock()
    with pytest.raises(LaunchError, match="cannot be sent to the ranks"):
        launch(lambda r, w: lock.locked(), 2, echo=False)


def test_an_interrupt_reads_as_one_line():
    from course_utils.dist import LaunchInterrupted

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(LaunchInterrupted) as info:
            launch(sleeps, 2, args=(30,), timeout=30, echo=False)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, old)
    assert isinstance(info.value, KeyboardInterrupt)
    (line,) = info.value._render_traceback_()
    assert "interrupted: all 2 ranks stopped" in line


SCRIPT = """
import sys
from course_utils.dist import launch

def rank_fn(rank, world_size):
    return rank

# no `if __name__ == "__main__":` guard: the ranks must not run this again
print([r.value for r in launch(rank_fn, 2, echo=False)])
"""


def test_a_script_without_a_main_guard_launches_once(tmp_path):
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    # a limit from this machine's speed now: the script starts torch twice
    # (itself and the forkserver), so allow many times one torch start-up
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=600)
    limit = max(120.0, 30 * (time.monotonic() - start))
    done = subprocess.run([sys.executable, str(script)], capture_output=True,
                          text=True, timeout=limit)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("launching 2 processes") == 1
    assert done.stdout.strip().endswith("[0, 1]")


def test_ranks_that_return_at_once_never_fail_to_connect():
    for _ in range(10):  # the fast rank waits for the slow one to connect
        assert [r.value for r in launch(lambda r, w: r, 2, echo=False)] == [0, 1]


def test_a_rank_that_returned_is_not_reported_as_unfinished():
    def uneven(rank, world_size):
        if rank == 1:
            time.sleep(60)
        return rank

    with pytest.raises(LaunchTimeout) as info:
        launch(uneven, 2, timeout=8, echo=False)
    assert "rank 1 did not finish within 8 s; rank 0 finished" in str(info.value)


def test_pool_runs_functions_defined_here_with_threads():
    scale = 3
    out = pool_map(lambda x: x * scale, range(4), processes=2, timeout=60)
    assert out == [0, 3, 6, 9]
    with pool(2, threads=2) as p:
        threads = p.map_async(lambda _: torch.get_num_threads(), range(2)).get(60)
    assert threads == [2, 2]
