"""Timing that does not lie: synchronise, warm up, repeat, report the median.

Introduced in Chapter 0 and explained in Chapter 2 ("CPU vs GPU, and measuring
it right"). GPU work is asynchronous: a Python timer around a launch measures
the launch, not the work, unless it waits for the device first.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.utils.benchmark as tub

from course_utils.devices import try_all_gpus


def synchronize(devices: Iterable[torch.device | str] = ()) -> None:
    """Wait until every device in ``devices`` has finished its queued work.

    Chapter 2. CPU operators in eager PyTorch return when they are done, so the
    CPU needs no waiting; a CUDA device does.
    """
    for d in devices:
        d = torch.device(d)
        if d.type == "cuda":
            torch.cuda.synchronize(d)
        elif d.type != "cpu" and hasattr(torch, d.type):
            getattr(torch, d.type).synchronize()


class Benchmark:
    """Time a block of code: ``with Benchmark("matmul") as b: ...``; then ``b.elapsed``.

    Chapter 0. On entry and on exit it waits for the devices it measures
    (default: every GPU, or the CPU), so queued GPU work is counted.
    ``sync=False`` skips the waiting, to show the trap of timing only launches.
    Prints like d2l's ``Benchmark`` unless ``verbose=False``.
    """

    def __init__(
        self,
        description: str = "Done",
        device=None,
        sync: bool = True,
        verbose: bool = True,
    ):
        self.description = description
        if device is None:
            self.devices = try_all_gpus()
        elif isinstance(device, (list, tuple)):
            self.devices = [torch.device(d) for d in device]
        else:
            self.devices = [torch.device(device)]
        self.sync = sync
        self.verbose = verbose
        self.elapsed: float | None = None

    def __enter__(self) -> Benchmark:
        if self.sync:
            synchronize(self.devices)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.sync:
            synchronize(self.devices)
        self.elapsed = time.perf_counter() - self._start
        if self.verbose and exc[0] is None:
            note = "" if self.sync else " (not synchronised)"
            print(f"{self.description}: {self.elapsed:.4f} sec{note}")


@dataclass
class Timing:
    """One measurement: seconds per call, as a median over repeated runs."""

    label: str
    median: float
    iqr: float
    times: list[float] = field(repr=False)
    number_per_run: int = 1
    num_threads: int = 1

    @property
    def quartiles(self) -> tuple[float, float]:
        """The 25th and 75th percentiles of the runs (``iqr`` is their gap)."""
        q = torch.tensor(self.times, dtype=torch.float64).quantile(
            torch.tensor([0.25, 0.75], dtype=torch.float64)
        )
        return q[0].item(), q[1].item()

    def __str__(self) -> str:
        return (
            f"{self.label}: median {_fmt_s(self.median)} per call, "
            f"IQR {_fmt_s(self.iqr)} over {len(self.times)} runs "
            f"of {self.number_per_run} ({self.num_threads} CPU threads)"
        )


def _fmt_s(s: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


MIN_RUNS = 5  # runs a timing needs for its median and quartiles to mean much


def bench(
    fn: Callable,
    *args,
    label: str | None = None,
    min_run_time: float = 0.2,
    warmup: int = 1,
    num_threads: int | None = None,
    **kwargs,
) -> Timing:
    """Median time of ``fn(*args, **kwargs)`` with torch.utils.benchmark. Chapter 0.

    Warm-up calls run first (caches, lazy initialisation, cuDNN autotuning).
    ``torch.utils.benchmark`` then picks how many calls make one run, repeats
    runs for at least ``min_run_time`` seconds, waits for the GPU around every
    run, and gives the median and interquartile range. ``num_threads`` defaults
    to torch's current thread count and is stated in the result. The GPU it
    waits for is the *current* one (``torch.accelerator.synchronize()``): time
    work on another GPU inside ``with torch.cuda.device(i):``.
    """
    for _ in range(warmup):
        fn(*args, **kwargs)
    threads = num_threads or torch.get_num_threads()
    timer = tub.Timer(
        stmt="fn(*args, **kwargs)",
        globals={"fn": fn, "args": args, "kwargs": kwargs},
        num_threads=threads,
        label=label or getattr(fn, "__name__", "fn"),
    )
    m = timer.blocked_autorange(min_run_time=min_run_time)
    if len(m.times) < MIN_RUNS and m.number_per_run > 1:
        # it grows a block tenfold until the timer's overhead is 1e-4 of it,
        # so a block can take most of min_run_time (10 or 100 calls of a
        # 10 ms sleep, as the overhead it measured varies): time MIN_RUNS
        # smaller blocks instead, each still long against the overhead
        number = max(1, int(min_run_time / MIN_RUNS / statistics.median(m.times)))
        m = tub.Measurement(number, [timer.timeit(number).raw_times[0]
                                     for _ in range(MIN_RUNS)], m.task_spec)
    return Timing(
        label=label or getattr(fn, "__name__", "fn"),
        median=m.median,
        iqr=m.iqr,
        times=list(m.times),
        number_per_run=m.number_per_run,
        num_threads=threads,
    )


@dataclass
class Sweep:
    """Timings over sizes, as plain lists that ``plots.plot_time_vs_size`` takes.

    ``low`` and ``high`` are the quartiles of each size's runs, when known; the
    plot shades the band between them.
    """

    label: str
    sizes: list
    median: list[float]
    iqr: list[float]
    low: list[float] | None = None
    high: list[float] | None = None


def sweep(
    measure: Callable[[int], Timing | float],
    sizes: Sequence,
    label: str = "",
    progress: bool = True,
) -> Sweep:
    """Call ``measure(size)`` for each size, with a progress line. Chapter 2.

    ``measure`` returns a ``Timing`` (from ``bench``) or plain seconds. The
    progress line is plain text that ends saying what was measured (a
    notebook's progress-bar widget that closes falls back to its first text,
    a bar at 0%).
    """
    medians, iqrs, lows, highs = [], [], [], []
    start = time.perf_counter()
    for i, size in enumerate(sizes):
        if progress:
            print(f"\r{label or 'sweep'}: size {i + 1} of {len(sizes)} ({size:,})",
                  end="", flush=True)
        t = measure(size)
        timed = isinstance(t, Timing)
        medians.append(t.median if timed else float(t))
        iqrs.append(t.iqr if timed else 0.0)
        low, high = t.quartiles if timed else (medians[-1], medians[-1])
        lows.append(low)
        highs.append(high)
    if progress:
        print(f"\r{label or 'sweep'}: {len(sizes)} sizes measured in "
              f"{format_seconds(time.perf_counter() - start)}", flush=True)
    return Sweep(label=label, sizes=list(sizes), median=medians, iqr=iqrs,
                 low=lows, high=highs)


def format_seconds(t: float) -> str:
    """``850 ns``, ``12.3 us``, ``4.56 ms``, ``1.23 s``: never ``0.0000 s``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(t) >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"
