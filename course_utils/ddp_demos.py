"""Plumbing for Chapter 6 (DistributedDataParallel): running a command line
with a watchdog, hiding C++ chatter, and the chapter's tables and figures.

The chapter keeps what it teaches (the scripts, the rank functions, the
collectives and what they measure); this module prints and draws their
results.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import psutil

from course_utils import plots, predict, reference
from course_utils.bench import Sweep
from course_utils.cleanup import (  # noqa: F401 - Chapter 6 uses leftover_processes
    Interrupted,
    leftover_processes,
)
from course_utils.compare import Stalled, wait_while_working
from course_utils.dist import stop_tree


def run_command(cmd: Sequence, work: Path, limit_s: float, attempts: int = 1,
                env: dict | None = None) -> None:
    """Run a command, print what it printed; raise if every attempt failed.

    No fixed time limit: it may run while it works (``limit_s`` at most); no
    CPU used for 15 s means it is stuck. A stuck or crashed run is tried again
    (a torch 2.13 gloo worker can abort at exit after its work is done). The
    command's temporary files (torchrun's logs) go into ``work``; an interrupt
    stops the command and its workers and reads as one line.
    """
    env = dict(os.environ if env is None else env, TMPDIR=str(work))
    for attempt in range(1, attempts + 1):
        print("$", " ".join(map(str, cmd)))
        out, err = work / "command.out", work / "command.err"  # files: a full pipe
        with open(out, "w") as o, open(err, "w") as e:        # could stall the job
            proc = subprocess.Popen([str(c) for c in cmd], stdout=o, stderr=e,
                                    env=env)
        try:
            wait_while_working([proc], limit_s=limit_s)
            failed = proc.returncode and f"exit code {proc.returncode}"
        except Stalled as stalled:
            failed = str(stalled)
        except KeyboardInterrupt:
            try:
                workers = len(psutil.Process(proc.pid).children(recursive=True))
            except psutil.Error:
                workers = 0
            stop_tree([proc.pid])
            raise Interrupted(
                "interrupted: the command"
                + (f" and its {workers} process{'es' * (workers > 1)}" if workers
                   else "")
                + " stopped, nothing left running") from None
        finally:  # torchrun's workers have sessions of their own: end the tree
            if proc.poll() is None:
                stop_tree([proc.pid])
        print(out.read_text(), end="")
        if not failed:
            return
        log = err.read_text().splitlines()[-8:]
        if attempt == attempts or "still working" in failed:  # busy: no retry
            raise RuntimeError("\n".join([f"FAILED: {failed}. The end of its log:",
                                          *log]))
        print(f"FAILED: {failed}. The end of its log:", *log, "-> trying once more",
              sep="\n")


@contextlib.contextmanager
def quiet_stderr():
    """Hide C++ messages on stderr (gloo logs an error it also raises)."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def show_allreduce_sweep(rows: list, backend: str, n: int = 2) -> None:
    """Print and plot a sweep of ``[bytes, fastest, median, q1, q3]`` rows.

    Beside it: the calibrated NCCL ring's prediction for 2 GPUs over NVLink 4
    and PCIe 4.0, a GPU's recorded sweep when there is one, and a published
    8 x H200 sweep of the same collective with the same model's prediction.
    """
    print(f"all_reduce on {n} ranks with {backend}, time per call")
    print(f"{'bytes':>11} {'fastest':>10} {'median':>10} {'algbw':>12} {'busbw':>12}"
          "  (bandwidths of the fastest)")
    for size, fastest, median, *_ in rows:
        algbw = size / fastest
        print(f"{size:>11,d} {fastest * 1e6:>7.0f} us {median * 1e6:>7.0f} us "
              f"{algbw / 1e9:>7.3f} GB/s {algbw * 2 * (n - 1) / n / 1e9:>7.3f} GB/s")
    best = max(rows, key=lambda r: r[0] / r[1])
    print(f"best algorithmic bandwidth at {best[0]:,d} bytes: "
          f"{best[0] / best[1] / (rows[0][0] / rows[0][1]):.0f} x that of "
          f"{rows[0][0]:,d} bytes; the largest message took "
          f"{rows[-1][1] / rows[0][1]:.0f} x as long as the smallest, for "
          f"{rows[-1][0] // rows[0][0]:,d} x the bytes")
    sizes = [r[0] for r in rows]
    ring = {link: reference.predicted(
                [predict.allreduce_seconds(b, 2, link).value for b in sizes], "s",
                f"2 GPUs over {name}",
                "calibrated NCCL ring: a per-collective latency "
                f"({predict.collective_latency() * 1e6:.0f} us) + 2(n-1)/n x bytes "
                f"/ {predict.achieved_link_bandwidth(link) / 1e9:.4g} GB/s, the bus "
                "bandwidth NCCL reaches on the link; n = 2",
                [predict.LINKS[link][0], *predict.COLLECTIVE_LATENCY_INPUTS,
                 *(predict.NVLINK_EFFICIENCY_INPUTS if link.startswith("nvlink")
                   else predict.PCIE_EFFICIENCY_INPUTS)])
            for link, name in (("nvlink_h100", "NVLink 4 (H100)"),
                               ("pcie4_x16", "PCIe 4.0 x16"))}
    h200 = reference.published("nccl.h200x8_allreduce_sweep")
    h200_pred = reference.predicted(
        {"x": h200.value["x"],
         "y": [predict.allreduce_seconds(b, 8, "nvlink_h100").value
               for b in h200.value["x"]]},
        "s", "8 GPUs over NVLink 4", "the same calibrated NCCL ring, n = 8",
        [predict.LINKS["nvlink_h100"][0], *predict.COLLECTIVE_LATENCY_INPUTS,
         *predict.NVLINK_EFFICIENCY_INPUTS])
    figures = reference.show("06.allreduce_2gpu", local=rows[-1][1], unit="s",
                             local_device="cuda:0" if "nccl" in backend else "cpu",
                             figures=[*ring.values(), h200_pred, h200])
    print(f"at the largest message, {sizes[-1]:,d} bytes: measured here "
          f"{rows[-1][1] * 1e6:,.0f} us (fastest run); predicted "
          + ", ".join(f"{f.device} {f.value[-1] * 1e6:,.1f} us" for f in ring.values()))
    for b, t_pub, t_pred in zip(h200.value["x"], h200.value["y"], h200_pred.value["y"],
                                strict=True):
        print(f"8x H200, {b / 2**20:>8,.0f} MiB: predicted {t_pred * 1e6:9,.1f} us, "
              f"published {t_pub * 1e6:9,.1f} us, ratio {t_pred / t_pub:.2f}")
    print("caveats: no published 2-GPU sweep was found, so the 2-GPU lines assume "
          "the 8-GPU latency; from about 2 MiB NCCL on an NVSwitch node reduces "
          "inside the switch (NVLS), faster than the ring the model assumes")
    us = 1e6  # plotted in microseconds
    curves = [Sweep(f"{backend}, {n} ranks, median (measured here)", sizes,
                    [r[2] * us for r in rows], [(r[4] - r[3]) * us for r in rows],
                    low=[r[3] * us for r in rows], high=[r[4] * us for r in rows]),
              Sweep(f"{backend}, {n} ranks, fastest (measured here)", sizes,
                    [r[1] * us for r in rows], [0.0] * len(rows))]
    for f in figures:
        if f.kind == "recorded":  # rows of [bytes, fastest, median, quartiles]
            curves.append(Sweep(f"nccl, {f.legend}", [v[0] for v in f.value],
                                [v[1] * us for v in f.value], [0.0] * len(f.value)))
    ax = plots.plot_time_vs_size(curves, xlabel="message size (bytes)",
                                 ylabel="time per all_reduce (us)",
                                 title="all_reduce time vs message size (median "
                                       "with quartile band, and fastest)")
    for fig, color in zip(ring.values(), ("tab:green", "tab:purple"), strict=True):
        ax.plot(sizes, [t * us for t in fig.value], color=color, label=fig.legend,
                **plots.figure_style("predicted"))
    ax.legend(fontsize=7)
    plt.show()


def show_buckets(runs: dict[str, tuple[list, list]]) -> None:
    """Print each option's buckets per iteration and draw its last profile.

    ``runs`` maps a label to (buckets, spans): buckets as (iteration, index,
    bytes) in the order DDP reduced them, spans as (lane, start, end).
    """
    lanes = ["backward (main thread)", "all_reduce (gloo threads)"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 1.9 * len(runs)), sharex=True)
    for ax, (label, (buckets, spans)) in zip(axes, runs.items(), strict=True):
        for it in sorted({b[0] for b in buckets}):
            sizes = [f"{b[2] / 2**20:.2f}" for b in buckets if b[0] == it]
            print(f"{label:>17}, iteration {it}: {len(sizes)} bucket(s) of "
                  f"{', '.join(sizes)} MiB, in the order reduced")
        reduces = [s for s in spans if s[0] == lanes[1]]
        backward_end = max(s[2] for s in spans if s[0] == lanes[0])
        early = sum(s[1] < backward_end for s in reduces)
        print(f"{'':>17}  profiled iteration: {len(reduces)} all-reduce(s), "
              f"{early} started before the backward pass ended")
        plots.plot_timeline(spans, ax=ax, lanes=lanes,
                            title=f"{label}: {len(reduces)} all-reduce(s), {early} "
                                  "during the backward pass")
    plt.tight_layout()
    plt.show()


def show_throughput(runs: dict[int, list], disturbed: bool) -> None:
    """Per rank count: a DDP step's time beside the same step without its
    all-reduce (``no_sync``, timed just before it in the same launch).

    The two are separate timings, so "compute alone" is a part of the step
    only on a quiet machine, and only where it was the shorter in every
    launch; otherwise no share is printed.
    """
    for n, launches in runs.items():
        step = [max(v["DDP step"] for v in out) for out in launches]
        compute = [max(v["compute only (no_sync)"] for v in out) for out in launches]
        head = (f"{n} rank{'s' * (n > 1)}: a DDP step took {_span_ms(step)}, the "
                f"same step without its all-reduce (no_sync) {_span_ms(compute)}")
        if disturbed:
            print(f"{head}; disturbed runs: no share of the all-reduce is computed")
        elif all(c < s for c, s in zip(compute, step, strict=True)):
            shares = sorted(1 - c / s for c, s in zip(compute, step, strict=True))
            print(f"{head}; the all-reduce not hidden by the backward pass: "
                  f"{shares[0]:.0%}-{shares[-1]:.0%} of a step")
        else:
            print(f"{head}; compute alone was not the shorter in every launch: the "
                  "all-reduce's cost is within the noise here")


def _span_ms(seconds: list[float]) -> str:
    lo, hi = min(seconds) * 1e3, max(seconds) * 1e3
    return f"{lo:.0f} ms" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f} ms"


NODE_GPUS = 8  # GPUs of one NVLink node (DGX H100)


def beyond_node_caveat() -> str:
    """Chapter 6's slider past one node: how the step model crosses nodes."""
    ib = reference.published_entry("ndr_infiniband.bandwidth_per_direction_gbps")
    return (f"beyond {NODE_GPUS} GPUs the ring crosses the network: every GPU "
            f"through its own {ib['value']} GB/s port (InfiniBand NDR) at the rate "
            "NCCL reaches per port, as published multi-node all-reduces show "
            "(python -m course_utils.predict --calibration)")


def scaling_slider(predicted_step: Callable[[int, int, str], tuple[float, float]]):
    """Sliders for tokens per GPU and GPU count over ``predicted_step``'s
    compute and all-reduce times (seconds) on NVLink 4 and PCIe 5.0."""
    import ipywidgets as widgets

    print(f"the compute bars are at {predict.step_efficiency():.0%} of the peak, "
          "the whole-step rate of the course's step model (fitted on published "
          f"training runs; one large matmul alone reaches "
          f"{predict.matmul_efficiency():.0%}); caveat: 8 GPUs on PCIe share the "
          "host's bandwidth: a published 8 x RTX 5090 run reached "
          f"{reference.published('nccl.rtx5090x8_pcie5_allreduce_busbw_gbps').value}"
          " GB/s bus bandwidth, about half the PCIe line's prediction")

    def draw(tokens=16_384, n=8):
        links = (("nvlink_h100", "NVLink 4"), ("pcie5_x16", "PCIe 5.0 x16"))
        fig, ax = plt.subplots(figsize=(7, 2.9))
        for row, (link, name) in enumerate(links):
            compute, reduce = predicted_step(tokens, n, link)
            ax.barh(row, compute * 1e3, color="tab:blue",
                    label="compute (6 P T FLOPs, whole-step rate)" if row == 0
                    else None)
            ax.barh(row, reduce * 1e3, left=compute * 1e3, color="tab:orange",
                    label="gradient all-reduce, if not overlapped" if row == 0
                    else None)
            print(f"{name:>12}: compute {compute * 1e3:6.1f} ms, all-reduce "
                  f"{reduce * 1e3:6.1f} ms: {compute / (compute + reduce):4.0%} (no "
                  f"overlap) to {compute / max(compute, reduce):4.0%} (full overlap) "
                  f"of {n} x one GPU's throughput")
        if n > NODE_GPUS:
            print(beyond_node_caveat())
        ax.set_yticks(range(len(links)), [name for _, name in links])
        ax.set_xlabel("time per step (ms)")
        ax.set_title(f"Predicted (a model, not measured): {n} x "
                     f"{predict.gpu_name('h100_sxm')}\n1 B parameters, {tokens:,d} "
                     "tokens per GPU per step", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2)
        plt.tight_layout()
        plt.show()

    widgets.interact(
        draw,
        tokens=widgets.SelectionSlider(options=[2**k for k in range(10, 17)],
                                       value=16_384, description="tokens/GPU",
                                       continuous_update=False),
        n=widgets.SelectionSlider(options=[2, 4, 8, 16, 32, 64], value=8,
                                  description="GPUs n", continuous_update=False))
