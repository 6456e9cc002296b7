"""Checkers for Chapter 12 (profiling and fault tolerance).

12.1 runs the learner's overlap measure on hand-made traces whose answers are
known (two all-reduce threads at once, nested spans, B/E pairs on two
threads, 2 to 4 ranks, decoy names and event kinds) and on the chapter's real
merged trace. 12.2 runs the learner's matcher on generated flight-recorder
dumps - 2 to 4 ranks, skipped, swapped, resized, reshaped and extra
collectives on any rank, ring buffers that wrapped at different places,
point-to-point entries on some ranks - and on the chapter's real dumps. Both
give the learner's function 20 s in all, and a hint chosen from the typical
mistake that reproduces what the answer returned. 12.3 runs the learner's
checkpoint functions twice: first in two ranks that "crash" three times in
the same processes, once in the middle of a save (every restored state is
compared with what was saved), then under torchrun's agent with a rank that
really dies at a random step, and compares the final weights with an
uninterrupted run.
"""

from __future__ import annotations

import copy
import os
import random
import re
import shutil
import tempfile
import time
from datetime import timedelta

import torch

from course_utils.exercises import (
    answer_limit,
    call_learner,
    fail,
    passed,
    require_solution,
    stuck,
    time_limit,
)

# ---------------------------------------------------------------- exercise 12.1


TOO_SLOW = {"took longer than": "your function did not return in time over all the "
                                "cases: look for a loop that never ends"}


def _union(intervals, sort=True):
    merged: list[list[float]] = []
    for start, end in (sorted(intervals) if sort else intervals):
        if merged and merged[-1][0] <= start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(a, b) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def _spans_by_rank(events, name, exact=True, begin_end=True, by_rank=True,
                   stack_by_thread=True, ranks=None):
    """{rank: [(start, end)]} of the spans called ``name``: X events, B/E pairs."""
    out: dict[int, list] = {}
    stacks: dict[tuple, list] = {}
    for e in events:
        ph, pid = e.get("ph"), e.get("pid", 0)
        key = (pid, e.get("tid")) if stack_by_thread else pid
        if ph == "B" and begin_end and "ts" in e:
            stacks.setdefault(key, []).append(e)
            continue
        if ph == "E" and begin_end and "ts" in e:
            if not stacks.get(key):
                continue
            begin = stacks[key].pop()
            n, start, end = begin.get("name", ""), float(begin["ts"]), float(e["ts"])
        elif ph == "X" and "ts" in e and "dur" in e:
            n, start = e.get("name", ""), float(e["ts"])
            end = start + float(e["dur"])
        else:
            continue
        if (n != name) if exact else (name not in n):
            continue
        if ranks is not None and pid not in ranks:
            continue
        out.setdefault(pid if by_rank else 0, []).append((start, end))
    return out


def hidden_reference(events, comm, compute, union_comm=True, union_compute=True,
                     exact=True, begin_end=True, by_rank=True, per_compute=False,
                     sort=True, stack_by_thread=True, ranks=None) -> float:
    """The fraction asked for; the keyword switches give typical mistakes."""
    kw = {"exact": exact, "begin_end": begin_end, "by_rank": by_rank,
          "stack_by_thread": stack_by_thread, "ranks": ranks}
    talk = _spans_by_rank(events, comm, **kw)
    work = _spans_by_rank(events, compute, **kw)
    total = hidden = work_total = 0.0
    for rank, spans in talk.items():
        t = _union(spans, sort) if union_comm else spans
        w = work.get(rank, [])
        w = _union(w, sort) if union_compute else w
        total += sum(e - s for s, e in t)
        hidden += _overlap(t, w)
        work_total += sum(e - s for s, e in w)
    if per_compute:
        return hidden / work_total if work_total else 0.0
    return hidden / total if total else 0.0


def _x(rank, name, start, dur, tid=1):
    return {"ph": "X", "name": name, "pid": rank, "tid": tid, "ts": start, "dur": dur,
            "cat": "user_annotation"}


def _b(rank, name, ts, tid=1):
    return {"ph": "B", "name": name, "pid": rank, "tid": tid, "ts": ts}


def _e(rank, ts, tid=1, name=None):  # Chrome traces may leave an E event unnamed
    e = {"ph": "E", "pid": rank, "tid": tid, "ts": ts}
    return dict(e, name=name) if name else e


GENERIC_12_1 = ("per rank, take the union of the comm spans (sorted by start) and "
                "its overlap with the union of the compute spans; divide by the union")


def _trace_cases():
    """(what, events, comm, compute, hint) with answers known by construction."""
    ar, bw = "gloo:all_reduce", "backward"
    base = 4_739_021_172_110.117  # real traces have large time stamps
    cases = [
        ("half of one all-reduce under the backward",
         [_x(0, bw, base, 100), _x(0, ar, base + 50, 100, 7)], ar, bw,
         "count the part of each all-reduce that lies inside a backward span"),
        ("two all-reduces at once on gloo's two threads",
         [_x(0, bw, base, 50), _x(0, ar, base + 10, 50, 7),
          _x(0, ar, base + 30, 50, 8)], ar, bw,
         "two all-reduces can run at once (gloo has two threads): count the time "
         "during which at least one runs - their union - not the sum of durations"),
        ("a backward span nested in another one",
         [_x(0, bw, base, 100), _x(0, bw, base + 20, 40), _x(0, ar, base + 10, 40, 7)],
         ar, bw, "backward spans may overlap (nested record_function): take their "
         "union too, so no moment is counted twice"),
        ("two ranks; rank 1's all-reduce runs during rank 0's backward only",
         [_x(0, bw, base, 100), _x(0, ar, base + 20, 20, 7),
          _x(1, bw, base, 30), _x(1, ar, base + 50, 40, 9)], ar, bw,
         "compare each all-reduce with the backward of its own rank (pid): rank "
         "0's backward does not hide rank 1's communication"),
        ("the launch op c10d::allreduce_ and an instant event named like the "
         "all-reduce",
         [_x(0, bw, base, 100), _x(0, "c10d::allreduce_", base + 10, 5),
          {"ph": "i", "name": ar, "pid": 0, "tid": 7, "ts": base + 20, "s": "t"},
          {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7,
           "args": {"name": "gloo"}},
          _x(0, ar, base + 90, 30, 7), _x(0, "gloo:all_reduce_coalesced", base, 5)],
         ar, bw, "use only spans whose name is exactly `comm`: c10d::allreduce_ is "
         "the call, an instant event ('ph' 'i') has no duration"),
        ("no communication at all", [_x(0, bw, base, 100), _x(1, bw, base, 80)],
         ar, bw, "return 0.0 when there is no communication"),
        ("every all-reduce inside the backward, three ranks, two steps",
         [_x(r, bw, base + s * 1000, 300) for r in range(3) for s in range(2)]
         + [_x(r, ar, base + s * 1000 + 50 + 10 * r, 100, 5) for r in range(3)
            for s in range(2)], ar, bw, "all communication here is hidden: 1.0"),
        ("other names (a GPU trace): comm and compute are parameters",
         [_x(0, "Backward 0", base, 60), _x(0, "ncclDevKernel_AllReduce", base + 40,
                                            60, 3),
          _x(0, bw, base + 60, 100), _x(0, ar, base + 60, 40, 7)],
         "ncclDevKernel_AllReduce", "Backward 0",
         "use the names passed as `comm` and `compute`, not fixed ones"),
        ("communication mostly after the backward (the optimizer waits)",
         [_x(0, bw, base, 200), _x(0, ar, base + 150, 200, 7),
          _x(1, bw, base + 5, 100), _x(1, ar, base + 50, 300, 7)], ar, bw,
         "divide the hidden time by the communication time, not by the backward's"),
        ("the backward written as begin (B) and end (E) events",
         [_b(0, bw, base), _x(0, ar, base + 50, 100, 7), _e(0, base + 100)], ar, bw,
         "a span is a complete event ('ph' 'X', ts to ts + dur) or a 'B' event and "
         "the 'E' event of the same pid and tid that closes it"),
        ("nested B/E spans on two threads of one rank, unnamed E events",
         [_b(0, bw, base), _b(0, "AddmmBackward0", base + 10), _e(0, base + 20),
          _b(0, "optimizer", base + 30, tid=2), _x(0, ar, base + 90, 40, 7),
          _e(0, base + 100), _e(0, base + 120, tid=2),
          _b(0, ar, base + 200, tid=8), _b(1, bw, base), _e(1, base + 50),
          _x(1, bw, base + 250, 100)], ar, bw,
         "an 'E' event closes the latest open 'B' of the same pid and tid (they "
         "nest like brackets); an 'E' need not carry a name; a 'B' never closed "
         "is no span"),
        ("back-to-back B/E spans of one thread, an E and the next B at the same "
         "time stamp; the trace begins inside a span (an E with no B)",
         [_e(0, base - 5), _b(0, bw, base), _e(0, base + 100), _b(0, ar, base + 100),
          _e(0, base + 150), _x(0, bw, base + 120, 10, tid=2)], ar, bw,
         "a thread's events come in the order they happened: pair them in that "
         "order (sorting them can put the next 'B' before the 'E' that closes "
         "the last one); an 'E' with no open 'B' closes nothing"),
        ("ranks 0 to 3 in B/E events, ranks 2 and 3 start their all-reduce early",
         [ev for r in range(4) for ev in (
             _b(r, bw, base + 10 * r), _b(r, ar, base + 60 - 40 * (r >= 2), 6),
             _e(r, base + 100 + 10 * r), _e(r, base + 150, 6))], ar, bw,
         "count every rank in the trace (every pid), not a fixed number of them"),
    ]
    rng = random.Random(12)
    for n_ranks in (3, 2):
        events = []
        for r in range(n_ranks):
            t = base + rng.uniform(0, 50)
            for _ in range(3):
                length = rng.uniform(100, 300)
                events.append(_x(r, bw, t, length))
                for tid in (7, 8):
                    s = t + rng.uniform(0, length + 50)
                    events.append(_x(r, ar, s, rng.uniform(5, 80), tid))
                t += length + rng.uniform(20, 120)
        rng.shuffle(events)
        cases.append((f"random spans on {n_ranks} ranks, events in no order", events,
                      ar, bw, GENERIC_12_1))
    return cases


MISTAKES_12_1 = [
    ({"begin_end": False}, "spans also come as a 'B' (begin) and an 'E' (end) "
     "event: pair each 'E' with the latest open 'B' of the same pid and tid"),
    ({"stack_by_thread": False}, "pair each 'E' with the latest open 'B' of the "
     "same pid AND tid: two threads of one rank open and close spans in between"),
    ({"ranks": (0, 1)}, "count every rank in the trace (every pid), not ranks 0 "
     "and 1 only"),
    ({"union_comm": False}, "two all-reduces can run at once (gloo has two "
     "threads): count the time during which at least one runs - sort the spans "
     "by start and merge those that overlap - not the sum of their durations"),
    ({"sort": False}, "sort each rank's spans by start before merging them: the "
     "events of a trace come in no particular order"),
    ({"union_compute": False}, "overlapping backward spans count once: take the "
     "union of the compute spans too"),
    ({"by_rank": False}, "compare each rank's communication with its own "
     "backward (events of the same pid), not with any rank's"),
    ({"exact": False}, "match names exactly: `gloo:all_reduce_coalesced` or "
     "`c10d::allreduce_` are other events"),
    ({"per_compute": True}, "divide by the communication time, not by the "
     "compute time"),
]


def _close(a, b) -> bool:
    return abs(a - b) <= 1e-7 + 1e-4 * abs(b)  # rounding of times to ns passes


def _comm_name(events) -> str:
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    for name in ("gloo:all_reduce", "nccl:all_reduce"):
        if name in names:
            return name
    return "gloo:all_reduce"


def _mistake_12_1(value, events, comm, compute, want, fallback, earlier) -> str:
    """The hint of the first typical mistake that gives exactly this value here
    and the right values on the ``earlier`` cases, which the answer got right."""
    for kw, hint in MISTAKES_12_1:
        wrong = hidden_reference(events, comm, compute, **kw)
        if not _close(wrong, want) and _close(value, wrong) and all(
                _close(hidden_reference(ev, c, w, **kw), hidden_reference(ev, c, w))
                for _, ev, c, w, _ in earlier):
            return hint
    return fallback


def check_hidden_fraction(hidden_fraction, real_events=None) -> None:
    """Exercise 12.1: the hidden share of communication time, from a merged trace."""
    ex = "12.1"
    require_solution(ex, hidden_fraction)
    cases = _trace_cases()
    if real_events:
        comm = _comm_name(real_events)
        cases.append(("the chapter's real merged trace", list(real_events), comm,
                      "backward", "check it on the real trace: " + GENERIC_12_1))
    seen_values = []
    with time_limit(answer_limit(ex)):
        for _what, events, comm, compute, _ in cases:
            copy = [dict(e) for e in events]
            seen_values.append(call_learner(
                ex, hidden_fraction, copy, comm=comm, compute=compute,
                hints={"division by zero": "return 0.0 when there is no "
                       "communication at all", "pop from empty list": "an 'E' "
                       "with no open 'B' (the trace began inside a span) closes "
                       "nothing: skip it", **TOO_SLOW}))
    for index, ((what, events, comm, compute, hint), seen) in enumerate(
            zip(cases, seen_values, strict=True)):
        want = hidden_reference(events, comm, compute)
        try:
            value = float(seen)
        except (TypeError, ValueError):
            fail(ex, "a number between 0 and 1", f"{type(seen).__name__} {seen!r:.60}")
        if value != value or not 0.0 <= value <= 1.0 + 1e-9:
            fail(ex, f"a fraction between 0 and 1 ({what})", f"{value:.4g}",
                 _mistake_12_1(value, events, comm, compute, want, hint,
                               cases[:index]))
        if not _close(value, want):
            fail(ex, f"{want:.4f} ({what})", f"{value:.4f}",
                 _mistake_12_1(value, events, comm, compute, want, hint,
                               cases[:index]))
    passed(ex, f"{len(cases)} traces, including the chapter's own: the hidden share "
               "of communication, per rank, without double counting.")


# ---------------------------------------------------------------- exercise 12.2

OPS = ["gloo:all_reduce", "gloo:broadcast", "gloo:allgather", "gloo:reduce_scatter",
       "gloo:barrier"]


def _outputs(name, sizes, world):
    """What a rank's output tensors hold: an all-gather's are world times longer."""
    if name == "gloo:allgather":
        return [[world * s[0], *s[1:]] for s in sizes]
    return [] if name == "gloo:barrier" else [list(s) for s in sizes]


def _entry(record_id, seq, p2p_seq, name, sizes, is_p2p=False, outputs=None):
    return {"record_id": record_id, "collective_seq_id": seq, "p2p_seq_id": p2p_seq,
            "profiling_name": name, "input_sizes": sizes,
            "output_sizes": sizes if outputs is None else outputs,
            "is_p2p": is_p2p, "state": "scheduled", "frames": [],
            "process_group": ("0", "default_pg"), "timeout_ms": 2000, "retired": False}


def _program(seed: int):
    """The seed's generator and the program of collectives it draws first."""
    rng = random.Random(seed)
    n = rng.randint(6, 12)
    return rng, [(rng.choice(OPS), [[rng.randint(1, 64)]]) for _ in range(n)]


def make_dumps(seed: int, world: int, kind: str, where: int | None = None,
               buffer: int | None = None, p2p_ranks=(),
               bad: int | None = None) -> dict[int, list[dict]]:
    """Flight-recorder entries per rank for a generated program with one bug.

    ``kind``: "none" (all agree), "skip" (a rank skips collective ``where``),
    "swap" (a rank runs another operation there), "resize" (same operation,
    the input one longer, the outputs unchanged; "resize2": the second of two
    inputs), "reshape" (same operation and element count, another shape),
    "transpose" (the second of two inputs, [a, b], given as [b, a]), "extra"
    (a rank runs one collective more at the end). Other collectives may take
    two tensors, the second 2-D. ``bad`` is the rank with the bug (drawn from
    the seed when None).
    ``where`` may count from the end (-2: the second last). ``buffer`` keeps
    the last entries only, like the ring buffer; ``p2p_ranks`` get
    point-to-point entries between their collectives (so their buffers hold
    fewer collectives).
    """
    rng, program = _program(seed)
    n = len(program)
    where = rng.randint(1, n - 2) if where is None else where % n
    bad = rng.randrange(world) if bad is None else bad
    shapes = random.Random(seed + 7919)  # the same programs as before, more shapes
    for i, (name, sizes) in enumerate(program):
        if i != where and shapes.random() < 0.3:  # two tensors, the second 2-D
            program[i] = (name, sizes + [[shapes.randint(2, 9), shapes.randint(2, 9)]])
    n_last = program[where][1][-1][0]
    if kind == "reshape":  # an even element count, to split in two
        program[where] = (program[where][0], [[4], [2 * n_last]])
    if kind == "resize2":  # the second of two tensors changes
        program[where] = (program[where][0], [[4], [n_last]])
    if kind == "transpose":  # an [a, b] with a != b, after a tensor that agrees
        program[where] = (program[where][0], [[4], [n_last + 1, n_last + 2]])
    dumps = {}
    for r in range(world):
        ops = [(name, sizes, _outputs(name, sizes, world)) for name, sizes in program]
        if r == bad:
            name, sizes, outputs = ops[where]
            if kind == "skip":
                ops.pop(where)
            elif kind == "swap":
                name = next(o for o in OPS if o != name)
                ops[where] = (name, sizes, _outputs(name, sizes, world))
            elif kind in ("resize", "resize2"):  # the outputs the others expect
                last = [sizes[-1][0] + 1, *sizes[-1][1:]]
                ops[where] = (name, [*sizes[:-1], last], outputs)
            elif kind == "reshape":  # [n] as [2, n / 2]
                ops[where] = (name, [sizes[0], [2, n_last]], outputs)
            elif kind == "transpose":
                ops[where] = (name, [sizes[0], sizes[1][::-1]], outputs)
            elif kind == "extra":
                ops.append(("gloo:all_reduce", [[3]], [[3]]))
        entries, record, p2p = [], 0, 0
        for i, (name, sizes, outputs) in enumerate(ops, start=1):
            if r in p2p_ranks and i % 2 == 0:
                p2p += 1
                entries.append(_entry(record, i - 1, p2p, "gloo:send" if r % 2 else
                                      "gloo:recv", [[8]], is_p2p=True))
                record += 1
            entries.append(_entry(record, i, p2p, name, sizes, outputs=outputs))
            record += 1
        for k, e in enumerate(entries):  # what differs between ranks that agree:
            e["time_created_ns"] = 10**9 * k + 7919 * r  # when each one ran it,
            if k >= len(entries) - 1 - r % 2:  # and how far each one got
                e["state"] = "started" if r % 2 else "scheduled"
            else:
                e["state"] = "completed"
        dumps[r] = entries[-buffer:] if buffer else entries
    return dumps


def _numel(sizes) -> int:
    total = 0
    for shape in sizes or []:
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


def _compared_sizes(e, numel_only, outputs, first_only, dims_only) -> str:
    sizes = e["output_sizes" if outputs else "input_sizes"] or []
    if first_only:
        sizes = sizes[:1]
    if dims_only:  # the dimensions as a bag, the shapes forgotten
        return str(sorted(int(d) for shape in sizes for d in shape))
    return str(_numel(sizes)) if numel_only else str(sizes)


def mismatch_reference(dumps, sizes=True, skip_p2p=True, common_start=True,
                       missing=True, numel_only=False, first_rank_only=False,
                       outputs=False, first_only=False, dims_only=False,
                       only_ranks=None):
    """The first mismatch; the keyword switches give typical mistakes."""
    if only_ranks:  # the first ranks only
        dumps = {r: dumps[r] for r in sorted(dumps)[:only_ranks]}
    by_rank = {r: {e["collective_seq_id"]: e for e in entries
                   if not (skip_p2p and e.get("is_p2p"))}
               for r, entries in dumps.items()}
    held = [set(d) for d in by_rank.values() if d]
    if not held:
        return None
    first = max(min(s) for s in held) if common_start else min(min(s) for s in held)
    last = max(max(s) for s in held)
    if first_rank_only:  # walks the numbers of the first rank's list only
        last = max(by_rank[min(by_rank)], default=first)
    for seq in range(first, last + 1):
        entries = {r: d.get(seq) for r, d in by_rank.items()}
        if not missing and None in entries.values():
            continue
        keys = {None if e is None else (
            e["profiling_name"], "" if not sizes else _compared_sizes(
                e, numel_only, outputs, first_only, dims_only))
            for e in entries.values()}
        if len(keys) > 1 or None in keys:
            return seq, entries
    return None


MISTAKES_12_2 = [
    ({"numel_only": True}, "compare the sizes themselves, not their element "
     "count: [[2, 8]] and [[16]] are different inputs"),
    ({"sizes": False}, "ranks also disagree when the input sizes differ (same "
     "operation, other shapes)"),
    ({"skip_p2p": False}, "skip point-to-point entries (is_p2p): they have no "
     "collective of their own"),
    ({"common_start": False}, "compare from the first sequence number that every "
     "rank still holds: older numbers were overwritten in some ring buffers"),
    ({"missing": False}, "a number that one rank has and another lacks is a "
     "mismatch (the other rank never joined it)"),
    ({"first_rank_only": True}, "walk every sequence number that any rank holds, "
     "not only those of rank 0's list: another rank may have run one more"),
    ({"only_ranks": 2}, "compare every rank, not only ranks 0 and 1"),
    ({"only_ranks": 3}, "compare every rank, not only the first three: the "
     "checker runs up to 4"),
    ({"outputs": True}, "compare input_sizes, not output_sizes: a rank can pass "
     "another input into the output the others expect"),
    ({"first_only": True}, "compare every tensor of input_sizes, not only the "
     "first: a collective can take several"),
    ({"dims_only": True}, "compare each shape as it is, its dimensions in order: "
     "[[3, 4]] is not [[4, 3]]"),
]


def _seen_seq(seen):
    return _seq_of(seen if isinstance(seen, (tuple, list)) and len(seen) == 2
                   else None)


def _mistake_12_2(cases, seen_values, index) -> str | None:
    """The hint of the typical mistake that reproduces the answer's sequence
    numbers: on every case if one does, else on case ``index`` and those
    before it (which the answer got right)."""
    seen = [_seen_seq(v) for v in seen_values]
    here = cases[index][1]
    candidates = [(kw, h) for kw, h in MISTAKES_12_2
                  if _seq_of(mismatch_reference(here, **kw)) == seen[index]
                  != _seq_of(mismatch_reference(here))]
    for span in (len(cases), index):
        for kw, h in candidates:
            if all(_seq_of(mismatch_reference(d, **kw)) == seen[k]
                   for k, (_, d, _) in enumerate(cases[:span])):
                return h
    return None


def _first_op(seed: int, name: str) -> int:
    """Where ``make_dumps(seed, ...)``'s program first runs ``name`` (else 1)."""
    return next((i for i, (op, _) in enumerate(_program(seed)[1]) if op == name), 1)


def _seq_of(found):
    return None if found is None else found[0]


def _dump_cases(real):
    cases = [
        ("2 ranks, rank skips one collective", make_dumps(1, 2, "skip"),
         "compare entries by their collective_seq_id"),
        ("3 ranks, one runs another operation", make_dumps(2, 3, "swap"),
         "compare every rank, not only ranks 0 and 1"),
        ("4 ranks, same operation with other sizes", make_dumps(3, 4, "resize"),
         "ranks also disagree when the input sizes differ"),
        ("2 ranks, one runs one collective more than the other",
         make_dumps(4, 2, "extra"), "a number that one rank has and another "
         "lacks is a mismatch (the other rank never joined it)"),
        ("3 ranks that agree", make_dumps(5, 3, "none"),
         "return None when every rank agrees"),
        ("3 ranks whose ring buffers wrapped at different places",
         make_dumps(6, 3, "swap", where=-2, buffer=5, p2p_ranks=(1, 2)),
         "compare from the first sequence number that every rank still holds: "
         "older numbers were overwritten in some ring buffers"),
        ("2 ranks, point-to-point entries on rank 0 only",
         make_dumps(7, 2, "none", p2p_ranks=(0,)),
         "skip point-to-point entries (is_p2p): they have no collective of "
         "their own"),
        ("3 ranks, p2p entries and a skipped collective",
         make_dumps(8, 3, "skip", p2p_ranks=(0, 1)),
         "skip point-to-point entries (is_p2p) and compare by sequence number"),
        ("2 ranks that agree, ring buffers wrapped", make_dumps(9, 2, "none",
                                                                buffer=4),
         "with wrapped buffers, compare only numbers every rank still holds"),
        ("4 ranks, the first collective differs on rank 3",
         make_dumps(10, 4, "swap", where=0, bad=3),
         "the very first collective can be the bad one"),
        ("3 ranks, rank 2 runs one collective more than the others",
         make_dumps(11, 3, "extra", bad=2), "walk every sequence number that any "
         "rank holds: rank 2 has one that ranks 0 and 1 never reached"),
        ("2 ranks, rank 1 runs one collective more, p2p entries on rank 0",
         make_dumps(12, 2, "extra", bad=1, p2p_ranks=(0,)),
         "walk every sequence number that any rank holds, not only rank 0's"),
        ("2 ranks, same operation and element count, another shape",
         make_dumps(13, 2, "reshape", bad=1), "compare the input sizes as they are "
         "([[2, 8]] is not [[16]]), not their element count"),
        ("4 ranks, rank 3 reshapes an input", make_dumps(14, 4, "reshape", bad=3),
         "compare the input sizes of every rank as they are"),
        ("3 ranks, rank 0 gives another input to an all-gather's output",
         make_dumps(15, 3, "resize", bad=0, where=_first_op(15, "gloo:allgather")),
         "compare input_sizes, not output_sizes: a rank can pass another input "
         "into the output the others expect"),
        ("3 ranks, rank 2 resizes the second of two input tensors",
         make_dumps(18, 3, "resize2", bad=2), "compare every tensor of "
         "input_sizes, not only the first: a collective can take several"),
        ("2 ranks, the second of two input tensors transposed on rank 0",
         make_dumps(16, 2, "transpose", bad=0), "compare every tensor of "
         "input_sizes, each shape as it is: [[3, 4]] is not [[4, 3]]"),
        ("4 ranks, rank 1 transposes the second of two tensors, buffers wrapped",
         make_dumps(17, 4, "transpose", where=-2, bad=1, buffer=7, p2p_ranks=(3,)),
         "compare every tensor of input_sizes, not only the first"),
    ]
    if real:
        cases.append(("the chapter's real dumps", real,
                      "check it on Section 3's dumps"))
    return cases


def check_first_mismatch(first_mismatch, real_dumps=None) -> None:
    """Exercise 12.2: the first collective on which the ranks' dumps disagree."""
    ex = "12.2"
    require_solution(ex, first_mismatch)
    cases = _dump_cases(real_dumps)
    seen_values = []
    with time_limit(answer_limit(ex)):
        for what, dumps, _hint in cases:
            given = copy.deepcopy(dumps)  # nothing shared with the checker's own
            seen_values.append(call_learner(ex, first_mismatch, given,
                                            hints=TOO_SLOW))
            if given != dumps:
                changed = sorted(r for r in dumps if given.get(r) != dumps[r]) or [
                    r for r in given if r not in dumps]
                fail(ex, f"the dumps left as they were given ({what})",
                     f"rank {changed[0]}'s entries changed by first_mismatch",
                     "read the dumps without changing them (no pop, sort, del or "
                     "assignment into them): they are the evidence of the hang; "
                     "filter into new lists or dicts instead")
    for index, ((what, dumps, hint), seen) in enumerate(
            zip(cases, seen_values, strict=True)):
        want = mismatch_reference(dumps)
        if want is None:
            if seen is not None:
                fail(ex, f"None ({what})", f"{seen!r:.100}", hint)
            continue
        seq, entries = want
        mistake = _mistake_12_2(cases, seen_values, index) or hint
        if seen is None:
            fail(ex, f"a mismatch at sequence number {seq} ({what})", "None",
                 mistake)
        try:
            got_seq, got_entries = seen
            got_seq = int(got_seq)
            dict(got_entries)
        except (TypeError, ValueError):
            fail(ex, "(seq, {rank: entry or None})", f"{seen!r:.100}")
        if got_seq != seq:
            there = [next((e for e in entries if not e.get("is_p2p") and e.get(
                "collective_seq_id") == got_seq), None) for entries in dumps.values()]
            if None not in there and len({(e["profiling_name"], str(e["input_sizes"]))
                                          for e in there}) == 1:
                mistake = (f"every rank has the same collective at sequence number "
                           f"{got_seq} (same profiling_name and input_sizes): no "
                           "mismatch there. Pair entries by collective_seq_id and "
                           "compare those two fields only; record_id, state and "
                           "time_created_ns differ between ranks that agree")
            fail(ex, f"sequence number {seq} ({what})", f"{got_seq}", mistake)
        if set(got_entries) != set(entries):
            fail(ex, f"an entry (or None) for every rank {sorted(entries)} ({what})",
                 f"ranks {sorted(got_entries)}", "map every rank, also those that "
                 "agree, to its entry with that number")
        for r, e in entries.items():
            g = got_entries[r]
            same = (g is None and e is None) or (
                isinstance(g, dict) and e is not None
                and g.get("record_id") == e["record_id"])
            if not same:
                fail(ex, f"rank {r}'s entry with sequence number {seq} ({what})",
                     f"{g!r:.100}", "give the entry itself, or None when the rank "
                     "has no entry with that number")
    passed(ex, f"{len(cases)} sets of dumps, 2 to 4 ranks, wrapped buffers and p2p "
               "entries: the first mismatch found every time.")


# ---------------------------------------------------------------- exercise 12.3

STEPS, EVERY = 14, 3


def _build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def _weights(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def _snapshot(model, optimizer, scheduler):
    moments = []
    for p in model.parameters():
        st = optimizer.state.get(p, {})
        moments.append({k: (v.clone() if torch.is_tensor(v) else v)
                        for k, v in st.items()})
    return {"weights": _weights(model), "moments": moments,
            "last_epoch": scheduler.last_epoch, "lr": optimizer.param_groups[0]["lr"]}


def _moments_equal(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key not in x or key not in y:
                return False
            if not torch.equal(torch.as_tensor(x[key]).float(),
                               torch.as_tensor(y[key]).float()):
                return False
    return True


def _compare(restored, saved):
    """What differs between a restored state and the snapshot taken at a save."""
    if not torch.equal(restored["weights"], saved["weights"]):
        return "weights"
    if not _moments_equal(restored["moments"], saved["moments"]):
        return "moments"
    if restored["last_epoch"] != saved["last_epoch"] or restored["lr"] != saved["lr"]:
        return "scheduler"
    return None


def _die_while_saving(dying: dict) -> None:
    """Make DCP's file writer fail before it writes .metadata while ``dying``.

    The data files of the checkpoint are on disk by then, its .metadata is
    not: what a job killed in the middle of a save leaves behind.
    """
    from torch.distributed.checkpoint import filesystem

    finish = filesystem._FileSystemWriter.finish

    def finish_or_die(self, metadata, results):
        if dying["now"]:
            dying["fired"] = True
            if dying.get("note"):  # for the verdict, should the others then wait
                open(f"{dying['note']}{torch.distributed.get_rank()}", "w").close()
            raise RuntimeError("the job died while this checkpoint was written")
        return finish(self, metadata, results)

    filesystem._FileSystemWriter.finish = finish_or_die


def _quick_stage(rank, world_size, save, load, ckpt_dir, crashes):
    """Every attempt in the same process: train, 'crash', rebuild, load, compare.

    ``crashes`` holds one ("after", step) or ("saving", step) per attempt:
    a crash after that step, or one in the middle of the save after it.
    """
    torch.set_num_threads(1)
    dying = {"now": False, "fired": False,
             "note": os.path.join(os.path.dirname(ckpt_dir), "died_on_rank")}
    _die_while_saving(dying)
    model, optimizer, scheduler = _build()
    for step in range(STEPS):
        _train_step(model, optimizer, scheduler, step, rank)
    reference = _weights(model)
    fresh = _weights(_build()[0])
    saved, report, start = {}, [], 0
    for attempt, crash in enumerate([*crashes, None]):
        model, optimizer, scheduler = _build()
        latest = max(saved, default=0)
        try:
            got = load(ckpt_dir, model, optimizer, scheduler)
        except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException
            report.append(("raised", attempt, f"{type(e).__name__}: {e}"[:240],
                           latest, sorted(saved)))
            return {"report": report}
        restored = _snapshot(model, optimizer, scheduler)
        try:
            got = int(got)
        except (TypeError, ValueError):
            report.append(("type", attempt, repr(got)[:60], latest, None))
            return {"report": report}
        problem = None
        if got != latest:
            problem = "step"
        elif latest:
            problem = _compare(restored, saved[latest])
        elif not torch.equal(restored["weights"], fresh):
            problem = "fresh"
        report.append((problem, attempt, got, latest, sorted(saved)))
        if problem:
            return {"report": report}
        start = got
        for step in range(start, STEPS):
            _train_step(model, optimizer, scheduler, step, rank)
            if (step + 1) % EVERY == 0:
                dying.update(now=crash == ("saving", step), fired=False)
                died = False
                try:
                    save(ckpt_dir, step + 1, model, optimizer, scheduler)
                except BaseException:  # DCP raises CheckpointException, a
                    # BaseException, on every rank for the death caused here
                    if not dying["now"]:
                        raise
                    died = True
                dying["now"] = False
                if not (died or dying["fired"]):  # a save that finished
                    saved[step + 1] = _snapshot(model, optimizer, scheduler)
            if crash is not None and step == crash[1]:
                break
    return {"report": report, "reference": reference, "final": _weights(model)}


def _elastic_worker(ckpt_dir, crash_at, crash_rank, save, load):
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, optimizer, scheduler = _build()
    start = int(load(ckpt_dir, model, optimizer, scheduler))
    for step in range(start, STEPS):
        _train_step(model, optimizer, scheduler, step, rank)
        if (step + 1) % EVERY == 0:
            save(ckpt_dir, step + 1, model, optimizer, scheduler)
        if step == crash_at and attempt == 0 and rank == crash_rank:
            os._exit(1)
    weights = _weights(model)
    del model, optimizer, scheduler  # DDP's reducer must go before its group
    dist.destroy_process_group()
    return {"attempt": attempt, "start": start, "weights": weights}


def _elastic_agent(_rank, _world_size, args, scratch):
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from course_utils.dist import free_port

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # pytorch/pytorch#135712
    tempfile.tempdir = scratch  # torchrun's log folders and error files go there
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=1,
                          run_id="ch12-check", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}",
                          monitor_interval=0.1, start_method="fork")
    return elastic_launch(config, _elastic_worker)(*args)


HINTS_12_3 = {
    "weights": "the model's weights were not those saved: load them into the model "
               "(dcp.load fills the state dict in place; then load_state_dict or "
               "set_state_dict)",
    "moments": "Adam's moments (exp_avg, exp_avg_sq) and step count were not "
               "restored: save and load the optimizer's state too - "
               "get_state_dict(model, optimizer) gives one dcp can load in place",
    "scheduler": "the learning-rate scheduler was not restored: save "
                 "scheduler.state_dict() and load it back, or the restart trains "
                 "with the initial learning rate",
    "fresh": "with no checkpoint yet, load must leave the fresh model alone and "
             "return 0",
}


HALF_SAVED = ("the save of step {step} died before it finished: its folder holds "
              "data files but no .metadata, which DCP writes last. Only a complete "
              "checkpoint counts: name it (a `latest` file) once dcp.save has "
              "returned on every rank, or skip folders without .metadata")


def _step_hint(got, latest, saved) -> str:
    if latest == 0:
        return "with no checkpoint saved yet, return 0"
    if got == 0:
        return ("returning 0 restarts from the beginning: every step since the "
                "start runs again - return the number of steps the checkpoint holds")
    if saved and got in saved and got < latest:
        return (f"the checkpoint of step {got} is older than that of step {latest}: "
                "find the newest by number (as text, 'step12' < 'step9'), or keep a "
                "file that names it")
    return (f"return the number of steps the loaded checkpoint holds ({latest}), "
            "saved with it")


def check_resume(save_checkpoint, load_checkpoint, elastic: bool = True) -> None:
    """Exercise 12.3: checkpoint functions that make a restart change nothing.

    ``elastic=False`` skips the run under torchrun's agent (the in-process
    restarts still run); the course's tests use it to stay within their time.
    """
    ex = "12.3"
    require_solution(ex, save_checkpoint)
    require_solution(ex, load_checkpoint)
    from course_utils.dist import LaunchTimeout, RankFailed, launch

    rng = random.Random(time.time_ns())
    # a crash after step 5-8, one in the middle of the save of step 9, one after
    # step 13 (indices count from 0)
    crashes = (("after", rng.randrange(EVERY + 1, 2 * EVERY + 2)),
               ("saving", 3 * EVERY - 1), ("after", 12))
    root = tempfile.mkdtemp(prefix="ch12_check_")
    ckpt_dir, scratch = os.path.join(root, "ckpt"), os.path.join(root, "tmp")
    os.makedirs(ckpt_dir)
    os.makedirs(scratch)
    try:
        started = time.perf_counter()
        limit = answer_limit(ex)
        try:
            out = launch(_quick_stage, 2, args=(save_checkpoint, load_checkpoint,
                                                ckpt_dir, crashes),
                         timeout=limit, backend="gloo", echo=False)
        except RankFailed as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            cause = next((line for line in reversed(lines)
                          if re.match(r"^\w+(Error|Exception)\b", line)), "")
            seen = lines[0][:200] + (f" ... {cause[:200]}" if cause and
                                     cause not in lines[0] else "")
            fail(ex, "save_checkpoint and load_checkpoint to run on 2 ranks", seen,
                 "read the error; both functions run on every rank, in a process "
                 "group (dist.get_rank() works)")
        except LaunchTimeout as e:
            died = [r for r in range(2) if os.path.exists(
                os.path.join(root, f"died_on_rank{r}"))]
            fail(ex, f"both functions to return within {limit:.0f} s on 2 ranks",
                 stuck(e)[:400], (
                     f"the save of step {3 * EVERY} failed on rank {died[0]} alone "
                     "(the checker makes it fail where DCP writes .metadata, as a "
                     "killed job would) and the other rank waited for it. In a real "
                     "job torchrun stops every rank; here they run on, so call "
                     "dcp.save on every rank: it passes a failure on to all of "
                     "them") if len(died) == 1 else "a collective that only some "
                 "ranks call (a barrier inside `if rank == 0`) waits for ever")
        value = out[0].value
        # the torchrun run's deadline follows what this machine just took
        deadline = max(limit, 6 * (time.perf_counter() - started))
        for problem, attempt, got, latest, saved in value["report"]:
            kind, at = crashes[attempt - 1] if attempt else ("", 0)
            half = kind == "saving"
            when = ("the first start" if not attempt else
                    f"restart {attempt} (the job died in the middle of the save "
                    f"of step {at + 1})" if half else
                    f"restart {attempt} (after a crash at step {at + 1})")
            if problem == "raised":
                fail(ex, f"load_checkpoint to restore step {latest} at {when}",
                     f"it raised {got}", HALF_SAVED.format(step=at + 1) if half
                     else "read the error; load_checkpoint runs on every rank")
            if problem == "step" and half and got == at + 1:
                fail(ex, f"load_checkpoint to return {latest} at {when}", f"{got}",
                     HALF_SAVED.format(step=got))
            if problem == "type":
                fail(ex, f"load_checkpoint to return a step number at {when}",
                     f"{got}", "return an int: the steps the checkpoint holds")
            if problem == "step":
                fail(ex, f"load_checkpoint to return {latest} at {when}", f"{got}",
                     _step_hint(got, latest, saved))
            if problem:
                fail(ex, f"the state saved after step {latest} restored at {when}",
                     f"different {problem}", HINTS_12_3[problem])
        if not torch.equal(value["final"], value["reference"]):
            gap = (value["final"] - value["reference"]).abs().max().item()
            fail(ex, "the weights of an uninterrupted run after two restarts",
                 f"a largest difference of {gap:.2g}", "every state was restored, "
                 "so something else changed the training: does save_checkpoint "
                 "step or modify the model, the optimizer or the scheduler?")
        if not elastic:
            passed(ex, "Three restarts in the same processes, one in the middle of a "
                       "save, changed nothing.")
            return
        shutil.rmtree(ckpt_dir)
        os.makedirs(ckpt_dir)
        crash_at, crash_rank = rng.randrange(EVERY, STEPS - 1), rng.randrange(2)
        for attempt in (1, 2):  # a second try only when a busy machine timed out
            try:
                res = launch(_elastic_agent, 1, init=False, timeout=deadline,
                             echo=False,
                             args=((ckpt_dir, crash_at, crash_rank, save_checkpoint,
                                    load_checkpoint), scratch))[0].value
                break
            except LaunchTimeout as e:
                if attempt == 2:
                    where = [line.strip() for line in str(e).splitlines()
                             if "(" in line and "line" in line][:6]
                    fail(ex, "the job to finish under torchrun after one restart",
                         f"no end within {deadline:.0f} s, twice; the agent was in: "
                         f"{'; '.join(where)}", "the in-process restarts passed, so "
                         "this is probably the machine (load average "
                         f"{os.getloadavg()[0]:.1f}): run the check again")
                shutil.rmtree(ckpt_dir)
                os.makedirs(ckpt_dir)
            except RankFailed as e:
                fail(ex, "the job to finish under torchrun after one restart",
                     str(e).splitlines()[0][:300], "the in-process restarts "
                     "passed; read the error of the worker that failed")
        latest = (crash_at + 1) // EVERY * EVERY
        for r, result in res.items():
            if result["attempt"] != 1 or result["start"] != latest:
                fail(ex, f"worker {r} restarted once, at step {latest}",
                     f"attempt {result['attempt']}, start {result['start']}",
                     _step_hint(result["start"], latest, None))
            if not torch.allclose(result["weights"], value["reference"], rtol=0,
                                  atol=1e-6):
                gap = (result["weights"] - value["reference"]).abs().max().item()
                fail(ex, "the weights of an uninterrupted run", f"a largest "
                     f"difference of {gap:.2g} on worker {r}", "the restored state "
                     "was right in one process: is the checkpoint written by every "
                     "rank, and complete before `latest` names it?")
        passed(ex, f"rank {crash_rank} died after step {crash_at + 1}; torchrun "
                   f"restarted both workers from step {latest}, and the final "
                   "weights equal an uninterrupted run's.")
    finally:
        shutil.rmtree(root, ignore_errors=True)
