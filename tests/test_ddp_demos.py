"""Chapter 6's plumbing: the command runner, the stderr silencer, the
leftover-process listing and the bucket and throughput printouts."""

import os
import sys

import matplotlib
import pytest

from course_utils import ddp_demos

matplotlib.use("Agg")


def test_run_command_prints_the_output(tmp_path, capsys):
    ddp_demos.run_command([sys.executable, "-c", "print('hello from a child')"],
                          tmp_path, limit_s=30)
    out = capsys.readouterr().out
    assert "hello from a child" in out and out.startswith("$ ")


def test_run_command_tries_again_then_fails_with_the_log(tmp_path, capsys):
    script = "import sys; print('attempt'); sys.exit('broken on purpose')"
    with pytest.raises(RuntimeError) as e:
        ddp_demos.run_command([sys.executable, "-c", script], tmp_path, limit_s=30,
                              attempts=2)
    assert "exit code 1" in str(e.value) and "broken on purpose" in str(e.value)
    out = capsys.readouterr().out
    assert out.count("attempt\n") == 2 and "trying once more" in out


def test_quiet_stderr_hides_fd_2_and_restores_it(capfd):
    with ddp_demos.quiet_stderr():
        os.write(2, b"hidden\n")
    os.write(2, b"shown\n")
    err = capfd.readouterr().err
    assert "hidden" not in err and "shown" in err


def test_leftover_processes_lists_a_running_child():
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert any(str(child.pid) in line for line in ddp_demos.leftover_processes())
    finally:
        child.kill()
        child.wait()
    assert not any(str(child.pid) in line for line in ddp_demos.leftover_processes())


def test_show_buckets_counts_buckets_and_early_all_reduces(capsys):
    mib = 2**20
    spans = [("backward (main thread)", 0.0, 1.0),
             ("all_reduce (gloo threads)", 0.5, 0.7),   # during the backward
             ("all_reduce (gloo threads)", 1.1, 1.5)]   # after it
    buckets = [(0, 0, 8 * mib), (1, 0, mib), (1, 1, 7 * mib)]
    ddp_demos.show_buckets({"defaults": (buckets, spans),
                            "one bucket": ([(0, 0, 8 * mib)], spans[:1] + spans[2:])})
    out = capsys.readouterr().out
    assert "iteration 0: 1 bucket(s) of 8.00 MiB" in out
    assert "iteration 1: 2 bucket(s) of 1.00, 7.00 MiB" in out
    assert "2 all-reduce(s), 1 started before" in out
    assert "1 all-reduce(s), 0 started before" in out


def test_show_throughput_prints_ranges_and_a_share_only_when_it_is_one(capsys):
    runs = {2: [[{"compute only (no_sync)": 0.010, "DDP step": 0.020},
                 {"compute only (no_sync)": 0.012, "DDP step": 0.018}],
                [{"compute only (no_sync)": 0.011, "DDP step": 0.030},
                 {"compute only (no_sync)": 0.009, "DDP step": 0.025}]]}
    ddp_demos.show_throughput(runs, disturbed=False)
    out = capsys.readouterr().out
    assert "2 ranks: a DDP step took 20-30 ms, the same step without its " \
           "all-reduce (no_sync) 11-12 ms" in out
    assert "not hidden by the backward pass: 40%-63% of a step" in out
    ddp_demos.show_throughput(runs, disturbed=True)
    out = capsys.readouterr().out
    assert "disturbed runs: no share" in out and "%" not in out
    # compute alone longer than a whole step (a disturbed launch): not a part
    runs[2][1][0]["compute only (no_sync)"] = 0.040
    ddp_demos.show_throughput(runs, disturbed=False)
    out = capsys.readouterr().out
    assert "within the noise" in out and "%" not in out


def test_an_interrupted_command_stops_its_tree_in_one_line(tmp_path):
    import signal
    import threading

    import psutil

    script = ("import os, subprocess, sys, tempfile, time\n"
              "print(tempfile.gettempdir(), flush=True)\n"
              "subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
              "time.sleep(60)\n")
    # processes this test process had before (a forkserver of an earlier
    # test, say) are not the command's
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    # a shell that starts a job in the background ignores SIGINT in it: as in a
    # notebook kernel, an interrupt must raise KeyboardInterrupt here
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            ddp_demos.run_command([sys.executable, "-c", script], tmp_path,
                                  limit_s=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    lines = caught.value._render_traceback_()
    assert len(lines) == 1
    assert "interrupted: the command and its 1 process stopped, nothing left " \
           "running" in lines[0]
    assert not [c for c in psutil.Process().children(recursive=True)
                if c.pid not in before]
    # the command's temporary files go into its work folder
    assert (tmp_path / "command.out").read_text().strip() == str(tmp_path)
