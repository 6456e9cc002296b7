"""Per-rank profiler traces as one timeline: merge them, read spans (Chapter 12).

``torch.profiler`` writes one Chrome trace per process (``export_chrome_trace``,
usually from ``on_trace_ready``). On one machine every rank's profiler reads
the same clock, so the ranks' events can be put side by side: ``merge_traces``
loads the files, names each process ``rank r`` (its ``pid`` becomes the rank)
and aligns the times on the earliest base time. The result opens in Perfetto
(https://ui.perfetto.dev) or ``chrome://tracing`` once written with
``save_trace``, and ``spans`` reads its spans back (complete "X" events and
"B"/"E" pairs) as ``Span`` tuples with times in microseconds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


class Span(NamedTuple):
    """One complete event of a merged trace; times in microseconds."""

    rank: int
    name: str
    start: float
    end: float
    thread: int | str

    @property
    def duration(self) -> float:
        return self.end - self.start


def load_trace(path: str | Path) -> dict:
    """One Chrome trace file as a dict with ``traceEvents`` (a bare list is wrapped)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {"traceEvents": data}


def merge_traces(traces: Mapping[int, str | Path | dict]) -> list[dict]:
    """Events of every rank's trace in one list: ``pid`` = rank, one time axis.

    ``traces`` maps each rank to its trace file (or to an already loaded trace).
    Event times are shifted by the difference of the files'
    ``baseTimeNanoseconds`` (the profiler's time origin), so events that
    happened at once line up. Each rank gets a ``process_name`` record
    ``rank r``; the originals' process records are dropped.
    """
    loaded = {int(r): t if isinstance(t, dict) else load_trace(t)
              for r, t in traces.items()}
    if not loaded:
        return []
    bases = {r: int(t.get("baseTimeNanoseconds", 0)) for r, t in loaded.items()}
    origin = min(bases.values())
    merged: list[dict] = []
    for rank in sorted(loaded):
        shift_us = (bases[rank] - origin) / 1000
        merged.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        merged.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                       "tid": 0, "args": {"sort_index": rank}})
        for event in loaded[rank].get("traceEvents", []):
            if event.get("ph") == "M" and event.get("name", "").startswith("process_"):
                continue
            event = dict(event, pid=rank)
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift_us
            merged.append(event)
    return merged


def save_trace(events: list[dict], path: str | Path) -> Path:
    """Write merged events as a Chrome trace that Perfetto opens."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def spans(events: Iterable[dict], name: str | None = None, rank: int | None = None,
          pattern: str | None = None) -> list[Span]:
    """Spans of a trace as ``Span`` tuples, sorted by start.

    A span is a complete event (``"ph": "X"``, from ``ts`` to ``ts + dur``) or
    a begin event (``"ph": "B"``) with the end event (``"ph": "E"``) of the
    same process and thread that closes it: B/E pairs nest like brackets, and
    an E event need not repeat the name. ``name`` keeps spans of exactly that
    name, ``pattern`` those whose name matches the regular expression
    (``re.search``), ``rank`` one rank's.
    """
    found = []
    open_spans: dict[tuple, list[dict]] = {}
    for e in events:
        ph = e.get("ph")
        if "ts" not in e or ph not in ("X", "B", "E"):
            continue
        thread = (e.get("pid", 0), e.get("tid", 0))
        if ph == "B":
            open_spans.setdefault(thread, []).append(e)
            continue
        if ph == "E":
            if not open_spans.get(thread):
                continue  # an end whose begin was cut off
            begin = open_spans[thread].pop()
            start, end = float(begin["ts"]), float(e["ts"])
            e = begin
        else:
            start = float(e["ts"])
            end = start + float(e.get("dur", 0.0))
        if name is not None and e.get("name") != name:
            continue
        if pattern is not None and not re.search(pattern, e.get("name", "")):
            continue
        if rank is not None and e.get("pid") != rank:
            continue
        found.append(Span(int(e.get("pid", 0)), e.get("name", ""), start, end,
                          e.get("tid", 0)))
    return sorted(found, key=lambda s: (s.start, s.rank))


# --- counters of one training step (Chapter 13) ------------------------------


class Collectives(TorchDispatchMode):
    """Counts the distributed operators a block of code dispatches (Chapter 13).

    ``c10d`` and the functional collectives DTensor uses, point-to-point sends
    and receives included; ``counts`` maps a name ("all-gather", ...) to calls.
    """

    NAMES = {"allreduce": "all-reduce", "all_reduce": "all-reduce",
             "allgather_base": "all-gather", "all_gather_into_tensor": "all-gather",
             "allgather": "all-gather",
             "reduce_scatter_base": "reduce-scatter",
             "reduce_scatter_tensor": "reduce-scatter", "send": "send", "recv": "recv"}

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = self.NAMES.get(func.__name__.split(".")[0].strip("_"))
            if name:
                self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def local(t):
    """A DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class SavedActivations:
    """The peak bytes autograd keeps for the backward inside the block
    (Chapter 13): each kept storage once while it lives, the model's own
    (gathered) weights left out; ``peak`` after the block."""

    def __init__(self, model):
        self.model, self.alive, self.live, self.peak = model, {}, 0, 0

    def pack(self, t):
        storage = local(t).untyped_storage()
        key = storage.data_ptr()
        weights = {local(p).untyped_storage().data_ptr()  # FSDP2: the gathered ones
                   for p in self.model.parameters()}
        if key in weights or not storage.nbytes():
            return t
        return Kept(self, key, storage.nbytes(), t)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(
            self.pack, lambda k: k.t if isinstance(k, Kept) else k)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class Kept:
    """One saved tensor; the last one of a storage to go frees its bytes."""

    def __init__(self, owner, key, nbytes, t):
        self.owner, self.key, self.nbytes, self.t = owner, key, nbytes, t
        if owner.alive.get(key, 0) == 0:
            owner.live += nbytes
            owner.peak = max(owner.peak, owner.live)
        owner.alive[key] = owner.alive.get(key, 0) + 1

    def __del__(self):
        o = self.owner
        o.alive[self.key] -= 1
        if o.alive[self.key] == 0:
            o.live -= self.nbytes
