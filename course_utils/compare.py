"""Compare two timings honestly on a machine other programs also use.

Introduced in Chapter 4 ("CPU parallelism"), used by every cell that compares
timings (Chapters 1-8). A speed-up printed by a notebook is only a lesson if
the machine was ours while it ran; on a laptop or a shared server another
program can take a core half-way through and make the slower option look
faster. So every comparison follows one protocol:

- warm-up calls of every option first (caches, lazy initialisation, threads);
- then the options run interleaved, A B A B ..., ``repeats`` times each, so a
  slow minute hurts both options alike;
- each run records its wall seconds and the CPU seconds of everything that
  worked for it: this process (all its threads, ``time.process_time``), its
  finished child processes (``resource.getrusage``), and CPU seconds that other
  processes report back (a timed function may return ``{"cpu_s": ...}``, e.g.
  the sum over its ranks or pool workers; add ``"wall_s"`` too if it timed
  itself, then both figures are taken as they are, and ``"all_cpu_s"`` for
  what those processes used in all, start-up included);
- busy cores = CPU seconds / wall seconds: a 2x speed-up from two threads
  needs about 2 busy cores, and the verdict says where a speed-up came from
  (more busy cores, or less CPU work);
- the CPU seconds the whole machine spent during each run (``/proc/stat`` on
  Linux) minus ours tells how many cores *other programs* used; a run during
  which they used more than ``quiet_cores`` is set aside, unless the kernel's
  CPU pressure (``/proc/pressure/cpu``) shows that no task waited for a core
  meanwhile: then they ran on cores the run left idle (one busy program
  beside a one-thread run on two cores), which did not slow it. With too few
  quiet runs left the verdict is "disturbed: another program used the cores -
  run again", never a speed-up. The load average before and after is printed too.

The verdict is one of ``faster``, ``slower``, ``the same within noise`` or
``disturbed: ...``: "faster" needs the second option faster in (nearly) every
interleaved pair by more than ``tolerance``. A timing that cannot be made
honest (a disturbed one) is shown as its min-max range, not a single number.

Usage::

    result = compare({"one thread": run_a, "two threads": run_b}, repeats=5)
    print(result)            # a small table and the verdict line
    result.outcome           # "faster", "slower", "same" or "disturbed"
    result.ratio             # median time of the first / of the second

Give one option to measure a single timing as a range, or more than two to
compare each with the first.
"""

from __future__ import annotations

import math
import os
import resource
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "Comparison",
    "Meter",
    "Option",
    "Run",
    "Stalled",
    "compare",
    "usable_cores",
    "wait_while_working",
]

OUTCOMES = ("faster", "slower", "same", "disturbed")
DISTURBED = "disturbed: another program used the cores - run again"


def usable_cores() -> int:
    """How many cores this process may run on (its affinity set, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux only)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    # guest time is already part of user time
    total = sum(ticks[:8])
    return (total - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_stall_s() -> float | None:
    """Seconds during which some runnable task waited for a CPU, since boot.

    Linux's pressure stall information (``/proc/pressure/cpu``, "some"); None
    where it is missing (other systems, older kernels).
    """
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


# a run during which tasks waited for a core this share of its time or less
# was not slowed by other programs, whatever they used on the other cores
STALL_QUIET = 0.05


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass
class Run:
    """One timed call: wall and CPU seconds, and what other programs used."""

    wall_s: float
    cpu_s: float
    others_cores: float | None  # None where the machine's counters are unknown
    ours_s: float = 0.0  # CPU seconds of the whole run, ours, not per call
    span_s: float = 0.0  # wall seconds of the whole run
    stall: float | None = None  # share of the run some task waited for a core

    @property
    def busy_cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def quiet(self, quiet_cores: float) -> bool:
        return _undisturbed(self.others_cores, self.stall, quiet_cores)


def _undisturbed(others: float | None, stall: float | None,
                 quiet_cores: float) -> bool:
    """Other programs used few cores, or none of their work made a task wait."""
    if others is None or others <= quiet_cores:
        return True
    return stall is not None and stall <= STALL_QUIET


@dataclass
class Option:
    """Every run of one option, and figures over its quiet runs."""

    label: str
    runs: list[Run] = field(default_factory=list)
    kept: list[bool] = field(default_factory=list)
    number: int = 1  # calls per run

    def _quiet(self) -> list[Run]:
        runs = [r for r, k in zip(self.runs, self.kept, strict=True) if k]
        return runs or self.runs

    @property
    def median(self) -> float:
        return _median([r.wall_s for r in self._quiet()])

    @property
    def low(self) -> float:
        return min(r.wall_s for r in self.runs)

    @property
    def high(self) -> float:
        return max(r.wall_s for r in self.runs)

    @property
    def cpu_s(self) -> float:
        """Median CPU seconds of a quiet run."""
        return _median([r.cpu_s for r in self._quiet()])

    @property
    def busy_cores(self) -> float:
        """Median busy cores of a quiet run."""
        return _median([r.busy_cores for r in self._quiet()])

    @property
    def others_cores(self) -> float | None:
        seen = [r.others_cores for r in self.runs if r.others_cores is not None]
        return max(seen) if seen else None


@dataclass
class Comparison:
    """What ``compare`` measured; ``print`` it to show the table and verdict."""

    options: list[Option]
    load_before: float | None
    load_after: float | None
    cores: int
    outcomes: dict[str, str]
    verdicts: dict[str, str]
    ratios: dict[str, float]
    quiet_cores: float

    @property
    def outcome(self) -> str:
        """``faster``/``slower``/``same``/``disturbed`` of the second option vs
        the first (with one option: ``measured`` or ``disturbed``); with more
        options, ``disturbed`` if any was, else that of the last one."""
        if not self.outcomes:
            return "disturbed" if self.disturbed else "measured"
        if "disturbed" in self.outcomes.values():
            return "disturbed"
        return list(self.outcomes.values())[-1]

    @property
    def verdict(self) -> str:
        """The verdict line(s), without the table."""
        if not self.verdicts:
            if self.disturbed:
                return DISTURBED
            return f"{self.options[0].label}: measured on a quiet machine"
        return "\n".join(self.verdicts.values())

    @property
    def ratio(self) -> float:
        """Median time of the first option / of the second (>1: second faster)."""
        return list(self.ratios.values())[0] if self.ratios else math.nan

    @property
    def disturbed(self) -> bool:
        return any(
            sum(o.kept) < _enough(len(o.runs)) for o in self.options
        )

    def on(self, values: Mapping[str, list[float]], tolerance: float = 0.05
           ) -> Comparison:
        """The same runs judged on another figure each of them measured.

        Chapter 14. ``values[label][i]`` is what run ``i`` of that option
        measured besides its time (its warm-up runs not counted): a latency
        beside a throughput, say. Runs set aside stay set aside, and each
        keeps its busy cores; the verdicts are drawn from the new figures."""
        options = []
        for o in self.options:
            got = list(values[o.label])
            if len(got) != len(o.runs):
                raise ValueError(f"{o.label}: {len(got)} values for {len(o.runs)} "
                                 "runs (one per timed run, in order)")
            runs = [Run(v, r.cpu_s * v / r.wall_s if r.wall_s > 0 else 0.0,
                        r.others_cores, r.ours_s, r.span_s, r.stall)
                    for v, r in zip(got, o.runs, strict=True)]
            options.append(Option(o.label, runs, list(o.kept), o.number))
        outcomes, verdicts, ratios = {}, {}, {}
        for other in options[1:]:
            outcome, line, ratio = _judge(options[0], other, tolerance,
                                          self.quiet_cores)
            outcomes[other.label], verdicts[other.label] = outcome, line
            ratios[other.label] = ratio
        return Comparison(options, self.load_before, self.load_after, self.cores,
                          outcomes, verdicts, ratios, self.quiet_cores)

    def __getitem__(self, label: str) -> Option:
        for o in self.options:
            if o.label == label:
                return o
        raise KeyError(label)

    def table(self) -> str:
        width = max(12, *(len(o.label) for o in self.options))
        head = (
            f"{'option':<{width}}  {'median':>9}  {'range (min-max)':>21}  "
            f"{'CPU s':>7}  {'busy cores':>10}"
        )
        lines = [head]
        for o in self.options:
            disturbed = sum(o.kept) < _enough(len(o.runs))
            median = "-" if disturbed else _fmt(o.median)
            span = f"{_fmt(o.low)} - {_fmt(o.high)}"
            lines.append(
                f"{o.label:<{width}}  {median:>9}  {span:>21}  "
                f"{o.cpu_s:>7.3f}  {o.busy_cores:>10.2f}"
            )
        runs = len(self.options[0].runs)
        load = (
            "load unknown"
            if self.load_before is None
            else f"load {self.load_before:.2f} -> {self.load_after:.2f}"
        )
        others = [o.others_cores for o in self.options if o.others_cores is not None]
        busy_elsewhere = (
            f"; other programs used up to {max(others):.2f} cores during a run"
            if others
            else ""
        )
        numbers = sorted({o.number for o in self.options})
        calls = (
            f" of {'/'.join(map(str, numbers))} calls (times per call)"
            if numbers != [1]
            else ""
        )
        lines.append(
            f"{runs} interleaved runs{calls} each; {load} (1-min average); "
            f"{self.cores} usable cores{busy_elsewhere}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.table()}\nverdict: {self.verdict}"

    __repr__ = __str__


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return math.nan
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _enough(n: int) -> int:
    """Quiet runs an option needs for a verdict: most of them, and at least 2."""
    return min(n, max(2, (n + 1) // 2))


def _fmt(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _timed(
    fn: Callable[[], object], number: int, watched: Callable[[], list[int]]
) -> Run:
    """One run of ``number`` calls; times and CPU seconds are per call."""
    pids = watched()
    load0, stall0 = _machine_busy_s(), _cpu_stall_s()
    own0, kids0 = time.process_time(), _children_cpu_s()
    tree0 = _tree_cpu_s(pids, descendants=True)
    t0 = time.perf_counter()
    reported_cpu, reported_wall, elsewhere = 0.0, 0.0, 0.0
    for _ in range(number):
        out = fn()
        if isinstance(out, Mapping):
            reported_cpu += float(out.get("cpu_s", 0.0))
            reported_wall += float(out.get("wall_s", 0.0))
            elsewhere += float(out.get("all_cpu_s", out.get("cpu_s", 0.0)))
    wall = time.perf_counter() - t0
    # a child that ended and was waited for moves from the tree to the
    # children's rusage, with all its CPU seconds: the sum counts each once
    tree = _tree_cpu_s(pids, descendants=True) - tree0
    own = max(0.0, time.process_time() - own0 + _children_cpu_s() - kids0 + tree)
    load1, stall1 = _machine_busy_s(), _cpu_stall_s()
    ours = own + reported_cpu
    others = stall = None
    # the counters tick every 10 ms on each core: too coarse for a short run
    if load0 is not None and load1 is not None and wall >= 0.1:
        others = max(0.0, (load1 - load0 - own - elsewhere) / wall)
    if stall0 is not None and stall1 is not None and wall >= 0.1:
        stall = (stall1 - stall0) / wall
    if reported_wall > 0:
        wall_s, cpu_s = reported_wall / number, reported_cpu / number
    else:
        wall_s, cpu_s = wall / number, ours / number
    return Run(wall_s, cpu_s, others, ours_s=own + elsewhere, span_s=wall,
               stall=stall)


def _judge(
    base: Option, other: Option, tolerance: float, quiet_cores: float
) -> tuple[str, str, float]:
    """(outcome, verdict line, ratio) for ``other`` against ``base``."""
    name = f"{other.label} vs {base.label}"
    pairs = [
        (a.wall_s, b.wall_s)
        for a, b, ka, kb in zip(
            base.runs, other.runs, base.kept, other.kept, strict=True
        )
        if ka and kb
    ]
    ratio = base.median / other.median if other.median > 0 else math.nan
    if len(pairs) < _enough(len(base.runs)):
        return "disturbed", f"{name}: {DISTURBED}", ratio
    faster = sum(a > b * (1 + tolerance) for a, b in pairs)
    slower = sum(b > a * (1 + tolerance) for a, b in pairs)
    needed = len(pairs) - (1 if len(pairs) >= 5 else 0)
    busy = other.busy_cores / base.busy_cores if base.busy_cores > 0 else math.nan
    cpu = other.cpu_s / base.cpu_s if base.cpu_s > 0 else math.nan
    why = (
        f"busy cores {base.busy_cores:.2f} -> {other.busy_cores:.2f}, "
        f"CPU seconds x{cpu:.2f}"
    )
    if faster >= needed:
        outcome = "faster"
        line = f"{name}: faster, {ratio:.2f}x ({why})"
        if max(base.busy_cores, other.busy_cores) < 0.5:
            line += ": mostly waiting, and the waits overlapped"
        elif busy > 1.2 and cpu < 1.2 and other.busy_cores < 1.2:
            line += (
                f": it waited less, not on more cores ({base.label} kept only "
                f"{base.busy_cores:.2f} cores busy: it waited for a core or I/O)"
            )
        elif busy > 1.2 and cpu < 1.2:
            line += ": the gain came from more busy cores"
        elif cpu < 0.85 and busy < 1.2:
            line += ": the gain came from less CPU work, not more cores"
    elif slower >= needed:
        outcome = "slower"
        line = f"{name}: slower, {1 / ratio:.2f}x the time ({why})"
    else:
        outcome = "same"
        line = (
            f"{name}: the same within noise (faster in {faster}, slower in "
            f"{slower} of {len(pairs)} interleaved pairs; {why})"
        )
    long_enough = other.median * other.number >= 0.05  # for the CPU clocks
    if long_enough and other.busy_cores > usable_cores() + 0.25:
        outcome = "disturbed"
        line = (
            f"{name}: {DISTURBED} (more busy cores counted than exist: "
            "CPU seconds were reported twice)"
        )
    return outcome, line, ratio


def compare(
    options: Mapping[str, Callable[[], object]],
    repeats: int = 5,
    warmup: int = 1,
    number: int | None = None,
    min_run_s: float = 0.2,
    tolerance: float = 0.05,
    quiet_cores: float = 0.5,
    processes: Callable[[], list[int]] | list[int] = (),
    num_threads: int | None = None,
) -> Comparison:
    """Time each option ``repeats`` times, interleaved, and judge the difference.

    Chapter 4. ``options`` maps a label to a function of no arguments; the
    first is the baseline. Each run calls the function ``number`` times and
    reports the time per call; by default ``number`` is chosen from the
    warm-up so that a run lasts ``min_run_s`` (the machine's CPU counters tick
    every 10 ms). A function whose work runs in processes this one does not
    wait for returns ``{"cpu_s": seconds}`` for them. The CPU seconds of this
    process's child processes (a pool kept alive, ranks still running, or
    children it waited for) count without that, and so do those of
    ``processes``, ids of other processes that work for the options; a
    grandchild that ends during a run (a forkserver's worker, the launcher's
    ranks) leaves no trace here and must be reported. ``tolerance`` is the
    relative difference below which two times count as equal; ``quiet_cores``
    how many cores other programs may use during a run before it is set aside.
    ``num_threads`` runs every option with that many torch threads (as
    ``bench`` does; a copy's bandwidth is measured on one thread).
    """
    if num_threads is not None:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            return compare(options, repeats, warmup, number, min_run_s, tolerance,
                           quiet_cores, processes)
        finally:
            torch.set_num_threads(before)
    if not options:
        raise ValueError("compare() needs at least one option")
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    fns = dict(options)
    watched = processes if callable(processes) else (lambda: list(processes))
    idle_load = _load()  # before our own warm-up adds to it
    opts = [Option(label) for label in fns]
    for opt in opts:
        quickest = math.inf
        for _ in range(warmup):
            t0 = time.perf_counter()
            fns[opt.label]()
            quickest = min(quickest, time.perf_counter() - t0)
        opt.number = number or 1
        if number is None and warmup and 0 < quickest < min_run_s:
            opt.number = min(1000, math.ceil(min_run_s / quickest))
    load_before = _load()
    machine0, stall0, start = _machine_busy_s(), _cpu_stall_s(), time.perf_counter()
    for _ in range(repeats):
        for opt in opts:
            opt.runs.append(_timed(fns[opt.label], opt.number, watched))
    machine1, stall1 = _machine_busy_s(), _cpu_stall_s()
    span = time.perf_counter() - start
    pooled = pooled_stall = None  # over all the runs together
    if machine0 is not None and machine1 is not None and span >= 0.1:
        ours = sum(r.ours_s for o in opts for r in o.runs)
        pooled = max(0.0, (machine1 - machine0 - ours) / span)
    if stall0 is not None and stall1 is not None and span >= 0.1:
        pooled_stall = (stall1 - stall0) / span
    for opt in opts:
        for run in opt.runs:
            if run.others_cores is None:
                run.others_cores = pooled  # a short run: the pooled estimates
                run.stall = pooled_stall
            quiet = run.quiet(quiet_cores)
            if run.others_cores is None and idle_load is not None:
                # no counters (not Linux, or too short): trust only an idle start
                quiet = idle_load <= quiet_cores
            opt.kept.append(quiet)
    load_after = _load()
    outcomes, verdicts, ratios = {}, {}, {}
    for other in opts[1:]:
        outcome, line, ratio = _judge(opts[0], other, tolerance, quiet_cores)
        outcomes[other.label] = outcome
        verdicts[other.label] = line
        ratios[other.label] = ratio
    return Comparison(
        options=opts,
        load_before=load_before,
        load_after=load_after,
        cores=usable_cores(),
        outcomes=outcomes,
        verdicts=verdicts,
        ratios=ratios,
        quiet_cores=quiet_cores,
    )


class Meter:
    """Measure a block that ``compare`` cannot drive: ``with Meter() as m: ...``.

    Chapter 4. Afterwards ``m.wall_s``, ``m.cpu_s`` (this process, its threads
    and its child processes, plus what ``m.report(cpu_s)`` added for other
    processes), ``m.busy_cores``, ``m.others_cores`` (what other programs used
    meanwhile; None where unknown) and ``m.disturbed``: a verdict drawn from
    the block's timings says "disturbed" instead when that is true.
    """

    def __init__(self, quiet_cores: float = 0.5) -> None:
        self.quiet_cores = quiet_cores
        self.reported = 0.0
        self.wall_s = self.cpu_s = 0.0
        self.others_cores: float | None = None
        self.stall: float | None = None  # share of the block a task waited for a core

    def report(self, cpu_s: float) -> None:
        """Add CPU seconds that processes this one does not see used for it."""
        self.reported += cpu_s

    def __enter__(self) -> Meter:
        self._load0, self._stall0 = _machine_busy_s(), _cpu_stall_s()
        self._own0, self._kids0 = time.process_time(), _children_cpu_s()
        self._tree0 = _tree_cpu_s([], descendants=True)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        own = (
            time.process_time() - self._own0
            + _children_cpu_s() - self._kids0
            + _tree_cpu_s([], descendants=True) - self._tree0
        )
        self.cpu_s = max(0.0, own) + self.reported
        if self._load0 is None:
            return
        # the machine's counters tick every 10 ms: a block shorter than 0.1 s is
        # judged by what other programs used over its first 0.1 s
        span = max(self.wall_s, 0.1)
        time.sleep(max(0.0, self._t0 + span - time.perf_counter()))
        load1, stall1 = _machine_busy_s(), _cpu_stall_s()
        if load1 is not None:
            used = load1 - self._load0 - self.cpu_s
            self.others_cores = max(0.0, used / span)
        if self._stall0 is not None and stall1 is not None:
            self.stall = (stall1 - self._stall0) / span

    @property
    def busy_cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def disturbed(self) -> bool:
        return not _undisturbed(self.others_cores, self.stall, self.quiet_cores)

    def __str__(self) -> str:
        others = (
            "unknown"
            if self.others_cores is None
            else f"{self.others_cores:.2f} cores"
        )
        return (
            f"{_fmt(self.wall_s)} wall, {self.cpu_s:.3f} CPU s, busy cores "
            f"{self.busy_cores:.2f}; other programs used {others} meanwhile"
            + (f" - {DISTURBED}" if self.disturbed else "")
        )


class Stalled(TimeoutError):
    """Processes did not finish: they stopped working, or ran past the limit."""


def _tree_cpu_s(pids: list[int], descendants: bool = False) -> float:
    """CPU seconds used so far by these processes and their descendants (with
    ``descendants``, by this process's descendants too, not by itself)."""
    import psutil

    tree, seen = [], set()
    roots = [*pids, *([os.getpid()] if descendants else [])]
    for pid in roots:
        try:
            proc = psutil.Process(pid)
            family = proc.children(recursive=True)
            if pid != os.getpid():
                family.append(proc)
        except psutil.Error:
            continue
        for p in family:
            if p.pid not in seen:
                seen.add(p.pid)
                tree.append(p)
    total = 0.0
    for p in tree:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def wait_while_working(
    procs: list[subprocess.Popen], limit_s: float, stall_s: float = 15.0
) -> None:
    """Wait for every process to end, as long as their work goes on. Chapter 6.

    A fixed wall-clock limit is a guess that a busy machine can exceed: there
    a healthy job only runs slower. So the wait ends early only when the
    processes (and their children) used no CPU for ``stall_s`` seconds - they
    are stuck, whatever the load - or after ``limit_s`` seconds in all, a cap
    to derive from what the machine just measured (a multiple of its start-up
    time). Raises ``Stalled`` saying which, and how busy the machine was, so
    that a failure on a busy machine says so. The caller stops the processes.
    """
    start = last_progress = time.monotonic()
    cpu = _tree_cpu_s([p.pid for p in procs])
    ours = 0.0  # CPU seconds the processes used during the wait
    machine0 = _machine_busy_s()
    while any(p.poll() is None for p in procs):
        time.sleep(0.2)
        now = time.monotonic()
        used = _tree_cpu_s([p.pid for p in procs if p.poll() is None])
        if used > cpu + 0.02 or used < cpu:  # more work, or a process ended
            last_progress = now
        ours += max(0.0, used - cpu)
        cpu = used
        stuck = now - last_progress > stall_s
        if stuck or now - start > limit_s:
            machine1 = _machine_busy_s()
            if machine0 is not None and machine1 is not None:
                others = max(0.0, (machine1 - machine0 - ours) / (now - start))
            else:
                others = max(0.0, (_load() or 0.0) - ours / (now - start))
            busy = others > 0.5
            load = (
                f"other programs kept {others:.1f} of {usable_cores()} cores "
                "busy meanwhile"
                + (": the machine was busy - run the cell again" if busy else "")
            )
            if stuck:
                raise Stalled(
                    f"stuck: the processes used no CPU for {stall_s:.0f} s; {load}"
                )
            raise Stalled(
                f"still working after {limit_s:.0f} s, the limit derived from "
                f"this machine's start-up time; {load}"
            )
