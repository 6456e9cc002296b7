"""The comparison protocol: interleaving, CPU accounting and verdicts.

Timed functions sleep (no CPU) or report CPU seconds, so the verdicts below do
not depend on how busy the machine is; the machine-wide counter is replaced by
one that sees only this process, or one that sees another program.
"""

import os
import time

import pytest

import course_utils.compare as cmp

READ_CPU_STALL = cmp._cpu_stall_s  # the real reader: tests below replace it


@pytest.fixture(autouse=True)
def tasks_wait_for_cores(monkeypatch):
    """CPU pressure as on a machine whose cores are all taken: whatever another
    program runs makes a task wait. Tests of the pressure rule replace it."""
    monkeypatch.setattr(cmp, "_cpu_stall_s", time.perf_counter)


@pytest.fixture
def quiet_machine(monkeypatch):
    """The machine-wide counter sees nothing but what the runs report."""
    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: None)
    monkeypatch.setattr(cmp, "_load", lambda: 0.0)


def compare(options, **kw):
    """One call per run unless a test asks otherwise: the tests stay short."""
    return cmp.compare(options, **{"number": 1, **kw})


def sleeper(seconds, cpu_s=None):
    def run():
        time.sleep(seconds)
        return None if cpu_s is None else {"cpu_s": cpu_s}

    return run


def test_runs_are_interleaved_after_a_warm_up(quiet_machine):
    calls = []
    result = compare(
        {"A": lambda: calls.append("A"), "B": lambda: calls.append("B")},
        repeats=3,
        warmup=2,
    )
    assert calls == ["A", "A", "B", "B"] + ["A", "B"] * 3
    assert [len(o.runs) for o in result.options] == [3, 3]


def test_a_clear_difference_is_faster_or_slower(quiet_machine):
    result = compare({"slow": sleeper(0.04), "quick": sleeper(0.01)}, repeats=3)
    assert result.outcome == "faster"
    assert result.ratio == pytest.approx(4, rel=0.5)
    assert "quick vs slow: faster" in result.verdict
    back = compare({"quick": sleeper(0.01), "slow": sleeper(0.04)}, repeats=3)
    assert back.outcome == "slower"
    assert "slower" in str(back)


def test_equal_times_are_the_same_within_noise(quiet_machine):
    result = compare(
        {"a": sleeper(0.02), "b": sleeper(0.02)}, repeats=4, tolerance=0.5
    )
    assert result.outcome == "same"
    assert "the same within noise" in result.verdict


def test_reported_cpu_seconds_give_busy_cores(quiet_machine):
    result = compare(
        {"one rank": sleeper(0.04, cpu_s=0.04), "two ranks": sleeper(0.02, 0.04)},
        repeats=3,
    )
    one, two = result["one rank"], result["two ranks"]
    assert one.busy_cores == pytest.approx(1.0, rel=0.5)
    assert two.busy_cores == pytest.approx(2.0, rel=0.5)
    assert "more busy cores" in result.verdict


def test_a_function_that_timed_itself_is_taken_as_it_says(quiet_machine):
    def timed():
        return {"cpu_s": 0.3, "wall_s": 0.2}

    result = compare({"self-timed": timed}, repeats=2, warmup=0)
    run = result.options[0].runs[0]
    assert (run.wall_s, run.cpu_s) == (0.2, 0.3)
    assert result.outcome == "measured"


def test_another_program_makes_the_verdict_disturbed(monkeypatch):
    # the machine counts one more busy core-second per wall second than we use
    monkeypatch.setattr(
        cmp, "_machine_busy_s", lambda: 2.0 * time.perf_counter()
    )
    monkeypatch.setattr(cmp, "_load", lambda: 2.0)
    result = compare({"slow": sleeper(0.03), "quick": sleeper(0.01)}, repeats=3)
    assert result.outcome == "disturbed"
    assert "another program used the cores - run again" in result.verdict
    text = str(result)
    assert "faster" not in text
    # a disturbed timing is shown as a range, not a median
    row = text.splitlines()[1]
    assert row.split()[1] == "-"
    assert result.options[0].others_cores > 1.0


def test_a_few_disturbed_runs_are_set_aside(monkeypatch):
    calls = {"n": 0}

    def counter():
        calls["n"] += 1
        # read 1 starts the comparison, reads 2-3 time run A1, 4-5 B1, 6-7 A2:
        # another program's 5 core-seconds land during A2
        return 5.0 if calls["n"] >= 7 else 0.0

    monkeypatch.setattr(cmp, "_machine_busy_s", counter)
    monkeypatch.setattr(cmp, "_load", lambda: 0.0)
    result = compare({"slow": sleeper(0.2), "quick": sleeper(0.1)}, repeats=3)
    assert result["slow"].kept == [True, False, True]
    assert result["quick"].kept == [True, True, True]
    assert result.outcome == "faster"


def test_cpu_counted_twice_is_not_a_speed_up(quiet_machine):
    result = compare(
        {"base": sleeper(0.1), "double-counted": sleeper(0.06, cpu_s=1.0)},
        repeats=3,
    )
    assert result.outcome == "disturbed"
    assert "reported twice" in result.verdict


def test_no_per_run_counters_trust_only_an_idle_start(monkeypatch):
    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: None)
    monkeypatch.setattr(cmp, "_load", lambda: 3.0)
    result = compare({"a": sleeper(0.02), "b": sleeper(0.01)}, repeats=3)
    assert result.outcome == "disturbed"


def test_more_than_two_options_each_against_the_first(quiet_machine):
    result = compare(
        {"base": sleeper(0.03), "same": sleeper(0.03), "quick": sleeper(0.0)},
        repeats=3,
        tolerance=1.0,
    )
    assert result.outcomes == {"same": "same", "quick": "faster"}
    assert len(result.verdict.splitlines()) == 2


def test_real_cpu_work_is_counted_on_this_machine():
    def spin():
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass

    result = compare({"spin": spin}, repeats=2, warmup=0)
    option = result.options[0]
    assert option.cpu_s >= 0.05
    assert 0.0 < option.busy_cores <= cmp.usable_cores() + 0.25
    assert result.outcome in ("measured", "disturbed")


def test_bad_arguments():
    with pytest.raises(ValueError):
        cmp.compare({})
    with pytest.raises(ValueError):
        cmp.compare({"a": lambda: None}, repeats=0)


def test_calls_per_run_chosen_from_the_warm_up(quiet_machine):
    calls = []
    result = cmp.compare(
        {"quick": lambda: (calls.append(1), time.sleep(0.01))},
        repeats=2,
        min_run_s=0.05,
    )
    number = result.options[0].number
    assert 3 <= number <= 6
    assert len(calls) == 1 + 2 * number
    assert result.options[0].median == pytest.approx(0.01, rel=0.8)
    assert f"of {number} calls" in str(result)


def test_child_processes_kept_alive_count_as_ours(quiet_machine):
    import subprocess
    import sys

    # a child that spins for 0.1 s of CPU for every line it reads
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfor line in sys.stdin:\n"
         "    end = time.process_time() + 0.1\n"
         "    while time.process_time() < end: pass\n"
         "    print(flush=True)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        def ask_worker():
            worker.stdin.write(b"go\n")
            worker.stdin.flush()
            worker.stdout.readline()  # it has done its work

        result = compare({"in a child": ask_worker}, repeats=2)
        assert result.options[0].cpu_s >= 0.08
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)


def test_a_meter_measures_a_block_and_names_disturbance(monkeypatch):
    with cmp.Meter() as quiet:
        end = time.process_time() + 0.15
        while time.process_time() < end:
            pass
    assert quiet.cpu_s >= 0.15
    assert 0.0 < quiet.busy_cores <= cmp.usable_cores() + 0.25
    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: 2.0 * time.perf_counter())
    with cmp.Meter() as busy:
        time.sleep(0.12)
        busy.report(0.01)
    assert busy.disturbed and busy.others_cores > 1.0
    assert "run again" in str(busy)


def test_a_meter_judges_a_short_block_over_its_first_tenth_of_a_second(monkeypatch):
    """The machine's counters tick every 10 ms: a 20 ms block alone says nothing."""
    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: 2.0 * time.perf_counter())
    start = time.perf_counter()
    with cmp.Meter() as busy:
        time.sleep(0.02)
    total = time.perf_counter() - start
    # the block's own time is kept; the meter waited out the tenth of a second
    assert 0.02 <= busy.wall_s < total and total >= 0.1
    assert busy.others_cores is not None and busy.others_cores > 1.0
    assert busy.disturbed
    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: None)  # not Linux
    with cmp.Meter() as unknown:
        pass
    assert unknown.others_cores is None and not unknown.disturbed


def test_another_program_on_an_idle_core_does_not_disturb(monkeypatch):
    """One busy program beside a one-thread run on two cores: nothing waited."""
    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: 2.0 * time.perf_counter())
    monkeypatch.setattr(cmp, "_cpu_stall_s", lambda: 7.0)  # no task ever waits
    result = compare({"slow": sleeper(0.2), "quick": sleeper(0.1)}, repeats=3)
    assert result.options[0].others_cores > 0.9
    assert result.outcome == "faster"
    with cmp.Meter() as beside:
        time.sleep(0.12)
    assert beside.others_cores > 0.9 and not beside.disturbed


def test_tasks_that_wait_for_a_core_while_others_run_disturb(monkeypatch):
    stalled = {"s": 0.0}

    def stall():  # a quarter of every run spent waiting for a core
        stalled["s"] = 0.25 * time.perf_counter()
        return stalled["s"]

    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: 2.0 * time.perf_counter())
    monkeypatch.setattr(cmp, "_cpu_stall_s", stall)
    result = compare({"slow": sleeper(0.2), "quick": sleeper(0.1)}, repeats=3)
    assert result.outcome == "disturbed"
    assert result.options[0].runs[0].stall == pytest.approx(0.25, abs=0.05)
    # without pressure information, other programs' use alone decides
    monkeypatch.setattr(cmp, "_cpu_stall_s", lambda: None)
    with cmp.Meter() as unknown:
        time.sleep(0.12)
    assert unknown.stall is None and unknown.disturbed


def test_cpu_pressure_is_read_where_the_kernel_has_it():
    stall = READ_CPU_STALL()
    if os.path.exists("/proc/pressure/cpu"):
        assert stall is not None and stall >= 0
        time.sleep(0.05)
        assert READ_CPU_STALL() >= stall
    else:
        assert stall is None


def test_the_same_runs_judged_on_another_figure(quiet_machine):
    # two options whose times differ 2x, and whose latency, measured in the
    # same runs, does not: each verdict is drawn from its own figures
    result = compare({"one": sleeper(0.04, cpu_s=0.04),
                      "two": sleeper(0.02, cpu_s=0.04)}, repeats=3, warmup=0)
    assert result.outcome == "faster"
    latency = result.on({"one": [0.010, 0.011, 0.010], "two": [0.010, 0.010, 0.011]},
                        tolerance=0.2)
    assert latency.outcome == "same"
    assert latency["two"].median == pytest.approx(0.010)
    # each run keeps its busy cores
    assert latency["two"].busy_cores == pytest.approx(result["two"].busy_cores)
    slower = result.on({"one": [0.01] * 3, "two": [0.03] * 3})
    assert slower.outcome == "slower"
    assert result.outcome == "faster"  # the original is unchanged
    with pytest.raises(ValueError, match="one per timed run"):
        result.on({"one": [0.01], "two": [0.01] * 3})


def test_runs_set_aside_stay_set_aside_on_another_figure(monkeypatch):
    monkeypatch.setattr(cmp, "_machine_busy_s", lambda: 2.0 * time.perf_counter())
    monkeypatch.setattr(cmp, "_load", lambda: 2.0)
    result = compare({"a": sleeper(0.02), "b": sleeper(0.01)}, repeats=3)
    assert result.outcome == "disturbed"
    again = result.on({"a": [0.03] * 3, "b": [0.01] * 3})
    assert again.outcome == "disturbed"
    assert "run again" in again.verdict
