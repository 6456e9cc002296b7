"""Chapter 12's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import os
import pickle
import warnings
from collections import defaultdict
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from course_utils import traces
from course_utils.checks import ch12
from course_utils.dist import launch
from course_utils.exercises import ExerciseFailed


def fails(check, *args, words=()):
    with pytest.raises(ExerciseFailed) as e:
        check(*args)
    for w in words:
        assert w in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    """A merged trace of 2 DDP ranks, profiled as in Section 1."""
    outdir = str(tmp_path_factory.mktemp("ch12_traces"))

    def profile_ddp(rank, world_size, outdir):
        from torch import nn
        from torch.profiler import ProfilerActivity, profile, record_function, schedule

        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]),
            bucket_cap_mb=0.0625)
        plan = schedule(wait=0, warmup=1, active=2, repeat=1)
        with profile(activities=[ProfilerActivity.CPU], schedule=plan,
                     on_trace_ready=lambda p: p.export_chrome_trace(
                         f"{outdir}/rank{rank}.json")) as prof:
            for _ in range(3):
                loss = model(torch.randn(32, 128)).square().mean()
                with record_function("backward"):
                    loss.backward()
                prof.step()

    launch(profile_ddp, 2, args=(outdir,), timeout=60, backend="gloo", echo=False)
    return traces.merge_traces({r: f"{outdir}/rank{r}.json" for r in range(2)})


@pytest.fixture(scope="module")
def real_dumps():
    """Flight-recorder entries of 2 ranks, rank 1 skipping one broadcast."""

    def skip(rank, world_size):
        os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
        dist.init_process_group("gloo", timeout=timedelta(seconds=2))
        x = torch.ones(8)
        try:
            for step in range(3):
                dist.all_reduce(x)
                if not (rank == 1 and step == 1):
                    dist.broadcast(x, src=0)
        except RuntimeError:
            pass
        return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]

    return {r.rank: r.value for r in launch(skip, 2, init=False, timeout=30,
                                            echo=False)}


# ---------------------------------------------------------------- 12.1


def complete_events(events):
    """B/E pairs turned into X events (a stack per pid and tid), X kept."""
    out, open_spans = [], defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            out.append(e)
        elif e.get("ph") == "B":
            open_spans[e["pid"], e.get("tid")].append(e)
        elif e.get("ph") == "E" and open_spans[e["pid"], e.get("tid")]:
            b = open_spans[e["pid"], e.get("tid")].pop()
            out.append(dict(b, ph="X", dur=e["ts"] - b["ts"]))
    return out


def hidden_x_only(events, comm="gloo:all_reduce", compute="backward"):
    """Cut each rank's time line at every span edge; add up the pieces."""
    ranks = {}
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in (comm, compute):
            continue
        ranks.setdefault(e["pid"], []).append(
            (e["name"] == comm, e["ts"], e["ts"] + e["dur"]))
    talk_time = both_time = 0.0
    for spans in ranks.values():
        edges = sorted({t for _, a, b in spans for t in (a, b)})
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            mid = (a + b) / 2
            talking = any(c and s <= mid < e for c, s, e in spans)
            working = any(not c and s <= mid < e for c, s, e in spans)
            talk_time += (b - a) * talking
            both_time += (b - a) * (talking and working)
    return both_time / talk_time if talk_time else 0.0


def hidden_solution(events, comm="gloo:all_reduce", compute="backward"):
    return hidden_x_only(complete_events(events), comm, compute)


def hidden_sweep(events, comm="gloo:all_reduce", compute="backward"):
    """A sweep over the start and end points of every span, per rank."""
    points, stacks = defaultdict(list), defaultdict(list)
    for e in events:
        ph, thread = e.get("ph"), (e.get("pid"), e.get("tid"))
        if ph == "B":
            stacks[thread].append(e)
            continue
        if ph == "E" and stacks[thread]:
            b = stacks[thread].pop()
            name, start, end = b.get("name"), b["ts"], e["ts"]
        elif ph == "X":
            name, start, end = e.get("name"), e["ts"], e["ts"] + e["dur"]
        else:
            continue
        if name not in (comm, compute):
            continue
        kind = 0 if name == comm else 1
        points[e["pid"]] += [(start, kind, +1), (end, kind, -1)]
    total = hidden = 0.0
    for pts in points.values():
        pts.sort(key=lambda p: (p[0], p[2]))
        depth, last = [0, 0], None
        for t, kind, delta in pts:
            if last is not None and depth[0] > 0:
                total += t - last
                if depth[1] > 0:
                    hidden += t - last
            depth[kind] += delta
            last = t
    return 0.0 if total == 0 else hidden / total


def hidden_with_helper(events, comm="gloo:all_reduce", compute="backward"):
    """Uses course_utils.traces.spans (X and B/E) and numpy for the union."""
    def union(spans):
        out = []
        for s in sorted(spans, key=lambda s: s.start):
            if out and s.start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], s.end)
            else:
                out.append([s.start, s.end])
        return np.array(out).reshape(-1, 2)

    ranks = {s.rank for s in traces.spans(events)}
    total = hidden = 0.0
    for r in ranks:
        talk = union(traces.spans(events, name=comm, rank=r))
        work = union(traces.spans(events, name=compute, rank=r))
        total += float((talk[:, 1] - talk[:, 0]).sum()) if len(talk) else 0.0
        for s, e in talk:
            if len(work):
                hidden += float(np.clip(np.minimum(e, work[:, 1])
                                        - np.maximum(s, work[:, 0]), 0, None).sum())
    return hidden / total if total > 0 else 0.0


class HiddenMeter:
    """A class whose instances are called like the function."""

    def __call__(self, events, comm="gloo:all_reduce", compute="backward"):
        self.last = hidden_solution(list(events), comm=comm, compute=compute)
        return float(self.last)


def hidden_microseconds(events, comm="gloo:all_reduce", compute="backward"):
    """Integer nanosecond grid with extra validation: the same fraction."""
    for e in events:
        assert isinstance(e, dict)
    scaled = [dict(e, ts=round(e["ts"] * 1000),
                   **({"dur": round(e["dur"] * 1000)} if "dur" in e else {}))
              if "ts" in e else e for e in events]
    return hidden_solution(scaled, comm, compute)


@pytest.mark.parametrize("fn", [hidden_solution, hidden_sweep, hidden_with_helper,
                                HiddenMeter(), hidden_microseconds])
def test_right_hidden_fraction_pass(fn, real_trace):
    ch12.check_hidden_fraction(fn, real_trace)


def test_real_trace_has_overlap(real_trace):
    value = hidden_solution(real_trace)
    assert 0.0 < value <= 1.0  # DDP's all-reduces start during the backward


def _sum_durations(events, comm="gloo:all_reduce", compute="backward"):
    talk = [e for e in events if e.get("ph") == "X" and e["name"] == comm]
    work = [e for e in events if e.get("ph") == "X" and e["name"] == compute]
    total = sum(e["dur"] for e in talk)
    hidden = sum(max(0, min(a["ts"] + a["dur"], b["ts"] + b["dur"])
                     - max(a["ts"], b["ts"]))
                 for a in talk for b in work if a["pid"] == b["pid"])
    return hidden / total if total else 0.0


def _times(events, comm, compute):
    """(hidden time, communication time, compute time), unions per rank."""
    def union(intervals):
        out = []
        for start, end in sorted(intervals):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    per = defaultdict(lambda: {comm: [], compute: []})
    for e in events:
        if e.get("ph") == "X" and e.get("name") in (comm, compute):
            per[e["pid"]][e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    hidden = talk = work = 0.0
    for spans in per.values():
        t, w = union(spans[comm]), union(spans[compute])
        talk += sum(b - a for a, b in t)
        work += sum(b - a for a, b in w)
        hidden += sum(max(0.0, min(b1, b2) - max(a1, a2))
                      for a1, b1 in t for a2, b2 in w)
    return hidden, talk, work


def test_wrong_hidden_fraction_fail(real_trace):
    def two_ranks(events, comm="gloo:all_reduce", compute="backward"):
        return hidden_solution([e for e in events if e.get("pid") in (0, 1)],
                               comm, compute)

    def stack_per_rank(events, comm="gloo:all_reduce", compute="backward"):
        return hidden_solution([dict(e, tid=0) if e.get("ph") in "BE" else e
                                for e in events], comm, compute)

    def e_by_name(events, comm="gloo:all_reduce", compute="backward"):
        opened, out = {}, []
        for e in events:
            if e.get("ph") == "B":
                opened[e["pid"], e["name"]] = e
            elif e.get("ph") == "E" and (e["pid"], e.get("name")) in opened:
                b = opened.pop((e["pid"], e["name"]))
                out.append(dict(b, ph="X", dur=e["ts"] - b["ts"]))
            else:
                out.append(e)
        return hidden_x_only(out, comm, compute)

    def no_union(events, comm="gloo:all_reduce", compute="backward"):
        return _sum_durations(events, comm, compute)

    def any_rank(events, comm="gloo:all_reduce", compute="backward"):
        return hidden_solution([dict(e, pid=0) for e in events], comm, compute)

    def substring(events, comm="gloo:all_reduce", compute="backward"):
        return hidden_solution([dict(e, name=comm) if comm in e.get("name", "")
                                else e for e in events], comm, compute)

    def ts_dur_as_interval(events, comm="gloo:all_reduce", compute="backward"):
        return hidden_solution([dict(e, ts=e["ts"], dur=e["dur"] - e["ts"])
                                if e.get("ph") == "X" else e for e in events],
                               comm, compute)

    def over_compute(events, comm="gloo:all_reduce", compute="backward"):
        hidden, _, work = _times(events, comm, compute)
        return hidden / work if work else 0.0

    def constant(events, comm="gloo:all_reduce", compute="backward"):
        return 0.5

    def divides_by_zero(events, comm="gloo:all_reduce", compute="backward"):
        talk = sum(e["dur"] for e in events
                   if e.get("ph") == "X" and e.get("name") == comm)
        return hidden_solution(events, comm, compute) * talk / talk

    def fixed_names(events, comm="gloo:all_reduce", compute="backward"):
        return hidden_solution(events)

    def time_not_fraction(events, comm="gloo:all_reduce", compute="backward"):
        return _times(events, comm, compute)[0]

    def all_or_nothing(events, comm="gloo:all_reduce", compute="backward"):
        talk = [e for e in events if e.get("ph") == "X" and e["name"] == comm]
        work = [e for e in events if e.get("ph") == "X" and e["name"] == compute]
        inside = [a for a in talk if any(
            a["pid"] == b["pid"] and b["ts"] <= a["ts"]
            and a["ts"] + a["dur"] <= b["ts"] + b["dur"] for b in work)]
        total = sum(a["dur"] for a in talk)
        return sum(a["dur"] for a in inside) / total if total else 0.0

    def unsorted_union(events, comm="gloo:all_reduce", compute="backward"):
        per = defaultdict(lambda: {comm: [], compute: []})
        for e in complete_events(events):
            if e.get("name") in (comm, compute):
                per[e["pid"]][e["name"]].append([e["ts"], e["ts"] + e["dur"]])
        total = hidden = 0.0
        for spans in per.values():
            merged = {}
            for key, items in spans.items():
                out = []
                for s, e in items:  # merged in arrival order, never sorted
                    if out and s <= out[-1][1] and s >= out[-1][0]:
                        out[-1][1] = max(out[-1][1], e)
                    else:
                        out.append([s, e])
                merged[key] = out
            total += sum(e - s for s, e in merged[comm])
            hidden += ch12._overlap(merged[comm], merged[compute])
        return hidden / total if total else 0.0

    def sorted_by_time_and_phase(events, comm="gloo:all_reduce", compute="backward"):
        return hidden_solution(sorted(events, key=lambda e: (e.get("ts", 0),
                                                             e.get("ph", ""))),
                               comm, compute)

    def stray_end_crashes(events, comm="gloo:all_reduce", compute="backward"):
        opened, out = defaultdict(list), []
        for e in events:
            if e.get("ph") == "B":
                opened[e["pid"], e["tid"]].append(e)
            elif e.get("ph") == "E":
                b = opened[e["pid"], e["tid"]].pop()
                out.append(dict(b, ph="X", dur=e["ts"] - b["ts"]))
            else:
                out.append(e)
        return hidden_x_only(out, comm, compute)

    def open_spans_to_the_end(events, comm="gloo:all_reduce", compute="backward"):
        opened, out = defaultdict(list), []
        last = max((e.get("ts", 0) + e.get("dur", 0) for e in events), default=0)
        for e in events:
            if e.get("ph") == "B":
                opened[e["pid"], e["tid"]].append(e)
            elif e.get("ph") == "E" and opened[e["pid"], e["tid"]]:
                b = opened[e["pid"], e["tid"]].pop()
                out.append(dict(b, ph="X", dur=e["ts"] - b["ts"]))
            else:
                out.append(e)
        out += [dict(b, ph="X", dur=last - b["ts"]) for bs in opened.values()
                for b in bs]  # a span still open runs to the trace's end
        return hidden_x_only(out, comm, compute)

    cases = [
        (sorted_by_time_and_phase, "order they happened"),
        (stray_end_crashes, "closes nothing"), (open_spans_to_the_end, "never closed"),
        (no_union, "at least one runs"), (any_rank, "own"), (substring, "exactly"),
        (ts_dur_as_interval, "expected"), (over_compute, "communication time"),
        (constant, "expected"), (divides_by_zero, "0.0"),
        (fixed_names, "names passed"), (time_not_fraction, "between 0 and 1"),
        (all_or_nothing, "part of each all-reduce"), (unsorted_union, "sort"),
        (hidden_x_only, "'B' (begin)"), (two_ranks, "not ranks 0 and 1"),
        (stack_per_rank, "AND tid"), (e_by_name, "'B'"),
    ]
    for fn, word in cases:
        fails(ch12.check_hidden_fraction, fn, real_trace, words=(word,))


def test_hidden_fraction_that_never_returns_gets_a_verdict():
    def spins(events, comm="gloo:all_reduce", compute="backward"):
        while True:
            pass

    fails(ch12.check_hidden_fraction, spins, words=("did not return",))


def test_hidden_fraction_placeholder():
    def stub(events, comm="gloo:all_reduce", compute="backward"):
        raise NotImplementedError("Exercise 12.1")

    fails(ch12.check_hidden_fraction, stub, words=("placeholder",))


# ---------------------------------------------------------------- 12.2


def mismatch_solution(dumps):
    by_rank = {r: {e["collective_seq_id"]: e for e in entries if not e.get("is_p2p")}
               for r, entries in dumps.items()}
    held = [set(d) for d in by_rank.values() if d]
    if not held:
        return None
    first, last = max(min(s) for s in held), max(max(s) for s in held)
    for seq in range(first, last + 1):
        entries = {r: d.get(seq) for r, d in by_rank.items()}
        keys = {None if e is None else (e["profiling_name"], str(e["input_sizes"]))
                for e in entries.values()}
        if len(keys) > 1 or None in keys:
            return seq, entries
    return None


def mismatch_defaultdict(dumps):
    table = defaultdict(dict)
    starts = []
    for rank, entries in dumps.items():
        coll = [e for e in entries if not e["is_p2p"]]
        if coll:
            starts.append(coll[0]["collective_seq_id"])
        for e in coll:
            table[e["collective_seq_id"]][rank] = e
    if not table:
        return None
    for seq in sorted(s for s in table if s >= max(starts)):
        row = table[seq]
        sigs = [(e["profiling_name"], tuple(map(tuple, e["input_sizes"])))
                for e in row.values()]
        if len(row) < len(dumps) or len(set(sigs)) > 1:
            return seq, {r: row.get(r) for r in dumps}
    return None


class MismatchFinder:
    def __call__(self, dumps):
        return mismatch_solution(dumps)


def mismatch_pairwise(dumps):
    """Compares every rank with the lowest rank, seq by seq."""
    ranks = sorted(dumps)
    lookup = {r: {e["collective_seq_id"]: e for e in dumps[r] if not e["is_p2p"]}
              for r in ranks}
    first = max(min(lookup[r]) for r in ranks)
    last = max(max(lookup[r]) for r in ranks)
    for seq in range(first, last + 1):
        ref = lookup[ranks[0]].get(seq)
        for r in ranks[1:]:
            e = lookup[r].get(seq)
            if (ref is None) != (e is None) or (ref is not None and (
                    ref["profiling_name"], ref["input_sizes"]) != (
                    e["profiling_name"], e["input_sizes"])):
                return seq, {q: lookup[q].get(seq) for q in ranks}
        if ref is None:
            return seq, {q: lookup[q].get(seq) for q in ranks}
    return None


def mismatch_as_list(dumps):
    """Returns a list [seq, entries] and plain ints: also a pair."""
    found = mismatch_solution(dumps)
    return None if found is None else [np.int64(found[0]), dict(found[1])]


def mismatch_tuples(dumps):
    """Signatures as tuples of tuples, ranks walked in a sorted list."""
    ranks = sorted(dumps)
    seqs = [{e["collective_seq_id"]: e for e in dumps[r] if not e["is_p2p"]}
            for r in ranks]
    if not any(seqs):
        return None
    lo = max(min(s) for s in seqs if s)
    hi = max(max(s) for s in seqs if s)
    seq = lo
    while seq <= hi:
        row = [s.get(seq) for s in seqs]
        sigs = {e and (e["profiling_name"], tuple(tuple(x) for x in e["input_sizes"]))
                for e in row}
        if len(sigs) != 1 or None in sigs:
            return (seq, dict(zip(ranks, row, strict=True)))
        seq += 1
    return None


@pytest.mark.parametrize("fn", [mismatch_solution, mismatch_defaultdict,
                                MismatchFinder(), mismatch_pairwise,
                                mismatch_as_list, mismatch_tuples])
def test_right_first_mismatch_pass(fn, real_dumps):
    ch12.check_first_mismatch(fn, real_dumps)


def test_real_dumps_mismatch_at_4(real_dumps):
    seq, entries = mismatch_solution(real_dumps)
    assert seq == 4
    assert entries[0]["profiling_name"] == "gloo:broadcast"
    assert entries[1]["profiling_name"] == "gloo:all_reduce"


def test_wrong_first_mismatch_fail(real_dumps):
    def by_position(dumps):
        ranks = sorted(dumps)
        for row in zip(*(dumps[r] for r in ranks), strict=False):
            if len({(e["profiling_name"], str(e["input_sizes"])) for e in row}) > 1:
                return row[0]["collective_seq_id"], dict(zip(ranks, row, strict=True))
        return None

    def names_only(dumps):
        return mismatch_solution({r: [dict(e, input_sizes=[]) for e in es]
                                  for r, es in dumps.items()})

    def two_ranks(dumps):
        return mismatch_solution({0: dumps[0], 1: dumps[1]})

    def common_only(dumps):
        by = {r: {e["collective_seq_id"]: e for e in es if not e["is_p2p"]}
              for r, es in dumps.items()}
        for seq in sorted(set.intersection(*(set(d) for d in by.values()))):
            if len({(by[r][seq]["profiling_name"], str(by[r][seq]["input_sizes"]))
                    for r in by}) > 1:
                return seq, {r: by[r][seq] for r in by}
        return None

    def from_oldest(dumps):
        by = {r: {e["collective_seq_id"]: e for e in es if not e["is_p2p"]}
              for r, es in dumps.items()}
        for seq in range(min(min(d) for d in by.values()),
                         max(max(d) for d in by.values()) + 1):
            entries = {r: d.get(seq) for r, d in by.items()}
            keys = {None if e is None else (e["profiling_name"], str(e["input_sizes"]))
                    for e in entries.values()}
            if len(keys) > 1:
                return seq, entries
        return None

    def with_p2p(dumps):
        return mismatch_solution({r: [dict(e, is_p2p=False) for e in es]
                                  for r, es in dumps.items()})

    def last_one(dumps):
        found, rest = None, dumps
        while True:
            got = mismatch_solution(rest)
            if got is None:
                return found
            found = got
            rest = {r: [e for e in es if e["collective_seq_id"] > got[0]]
                    for r, es in rest.items()}
            if not all(rest.values()):
                return found

    def only_bad_ranks(dumps):
        found = mismatch_solution(dumps)
        if found is None:
            return None
        seq, entries = found
        names = [e and e["profiling_name"] for e in entries.values()]
        common = max(set(names), key=names.count)
        return seq, {r: e for r, e in entries.items()
                     if (e and e["profiling_name"]) != common}

    def names_not_entries(dumps):
        found = mismatch_solution(dumps)
        return found and (found[0], {r: e and e["profiling_name"]
                                     for r, e in found[1].items()})

    def seq_only(dumps):
        found = mismatch_solution(dumps)
        return found and found[0]

    def never(dumps):
        return None

    def rank0_list(dumps):
        by = {r: {e["collective_seq_id"]: e for e in es if not e["is_p2p"]}
              for r, es in dumps.items()}
        start = max(min(d) for d in by.values())
        for seq in sorted(s for s in by[0] if s >= start):
            entries = {r: d.get(seq) for r, d in by.items()}
            if len({None if e is None else (e["profiling_name"],
                                            str(e["input_sizes"]))
                    for e in entries.values()}) > 1:
                return seq, entries
        return None

    def element_count(dumps):
        return mismatch_solution({r: [dict(e, input_sizes=[[int(np.prod(
            e["input_sizes"][0]))]] if e["input_sizes"] else []) for e in es]
            for r, es in dumps.items()})

    def whole_entries(dumps):  # every field but the ids and the stack
        def key(e):
            return str({k: v for k, v in e.items()
                        if k not in ("record_id", "p2p_seq_id", "frames")})
        return mismatch_solution({r: [dict(e, profiling_name=key(e)) for e in es]
                                  for r, es in dumps.items()})

    def by_record_id(dumps):
        by = {r: {e["record_id"]: e for e in es if not e["is_p2p"]}
              for r, es in dumps.items()}
        for rid in range(max(min(d) for d in by.values()),
                         max(max(d) for d in by.values()) + 1):
            row = {r: d.get(rid) for r, d in by.items()}
            if None in row.values() or len({(e["profiling_name"], str(
                    e["input_sizes"])) for e in row.values()}) > 1:
                seq = next(e for e in row.values() if e)["collective_seq_id"]
                return seq, {r: next((e for e in es if not e["is_p2p"] and e[
                    "collective_seq_id"] == seq), None) for r, es in dumps.items()}
        return None

    def output_sizes(dumps):
        return mismatch_solution({r: [dict(e, input_sizes=e["output_sizes"])
                                      for e in es] for r, es in dumps.items()})

    def first_tensor(dumps):
        return mismatch_solution({r: [dict(e, input_sizes=e["input_sizes"][:1])
                                      for e in es] for r, es in dumps.items()})

    def sorted_dims(dumps):  # the dimensions as a set, each shape forgotten
        return mismatch_solution({r: [dict(e, input_sizes=sorted(
            d for shape in e["input_sizes"] for d in shape)) for e in es]
            for r, es in dumps.items()})

    def first_three(dumps):
        return mismatch_solution({r: dumps[r] for r in sorted(dumps)[:3]})

    def pops_p2p(dumps):  # right, but strips the evidence out of the dumps
        for entries in dumps.values():
            entries[:] = [e for e in entries if not e["is_p2p"]]
        return mismatch_solution(dumps)

    def sorts_in_place(dumps):
        for entries in dumps.values():
            entries.sort(key=lambda e: e["collective_seq_id"])
            for e in entries:
                e.pop("frames", None)
        return mismatch_solution(dumps)

    cases = [
        (output_sizes, "not output_sizes"), (first_tensor, "not only the first"),
        (sorted_dims, "as it is"), (first_three, "every rank"),
        (pops_p2p, "without changing them"), (sorts_in_place, "without changing"),
        (whole_entries, "differ between ranks that agree"),
        (by_record_id, "Pair entries by collective_seq_id"),
        (by_position, "sequence number"), (names_only, "sizes"),
        (two_ranks, "every rank"), (common_only, "never joined"),
        (from_oldest, "ring buffers"), (with_p2p, "is_p2p"),
        (last_one, "sequence number"), (only_bad_ranks, "every rank"),
        (names_not_entries, "entry itself"), (seq_only, "(seq, {rank"),
        (never, "a mismatch at sequence number"),
        (rank0_list, "not only those of rank 0"), (element_count, "element count"),
    ]
    for fn, word in cases:
        fails(ch12.check_first_mismatch, fn, real_dumps, words=(word,))


# ---------------------------------------------------------------- 12.3


def _write_latest(ckpt_dir, step):
    dist.barrier()
    if dist.get_rank() == 0:
        with open(f"{ckpt_dir}/latest.tmp", "w") as f:
            f.write(str(step))
        os.replace(f"{ckpt_dir}/latest.tmp", f"{ckpt_dir}/latest")


def _read_latest(ckpt_dir):
    if not os.path.exists(f"{ckpt_dir}/latest"):
        return None
    with open(f"{ckpt_dir}/latest") as f:
        return int(f.read())


def save_solution(ckpt_dir, step, model, optimizer, scheduler):
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state,
              "scheduler": scheduler.state_dict(), "step": step},
             checkpoint_id=f"{ckpt_dir}/step{step}")
    _write_latest(ckpt_dir, step)


def load_solution(ckpt_dir, model, optimizer, scheduler):
    step = _read_latest(ckpt_dir)
    if step is None:
        return 0
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state,
             "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{step}")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def save_torch_rank0(ckpt_dir, step, model, optimizer, scheduler):
    """torch.save of whole state dicts by rank 0 (DDP replicas are equal)."""
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(),
                    "optim": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step},
                   f"{ckpt_dir}/tmp.pt")
        os.replace(f"{ckpt_dir}/tmp.pt", f"{ckpt_dir}/state.pt")
    dist.barrier()


def load_torch_rank0(ckpt_dir, model, optimizer, scheduler):
    path = f"{ckpt_dir}/state.pt"
    if not os.path.exists(path):
        return 0
    state = torch.load(path, weights_only=False)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def save_split_apis(ckpt_dir, step, model, optimizer, scheduler):
    """get_model_state_dict / get_optimizer_state_dict; numbered folders only."""
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, optimizer),
              "sched": scheduler.state_dict()},
             checkpoint_id=os.path.join(ckpt_dir, f"{step:06d}"))
    dist.barrier()


def load_split_apis(ckpt_dir, model, optimizer, scheduler):
    done = [d for d in os.listdir(ckpt_dir)
            if os.path.exists(os.path.join(ckpt_dir, d, ".metadata"))]
    if not done:
        return 0
    newest = max(done, key=int)
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer),
             "sched": scheduler.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, newest))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(state["sched"])
    return int(newest)


class Checkpointer:
    """A class: save and load are bound methods; the RNG is saved too."""

    def save(self, ckpt_dir, step, model, optimizer, scheduler):
        save_solution(ckpt_dir, step, model, optimizer, scheduler)
        torch.save(torch.get_rng_state(), f"{ckpt_dir}/rng{dist.get_rank()}.pt")

    def load(self, ckpt_dir, model, optimizer, scheduler):
        step = load_solution(ckpt_dir, model, optimizer, scheduler)
        rng = f"{ckpt_dir}/rng{dist.get_rank()}.pt"
        if step and os.path.exists(rng):
            torch.set_rng_state(torch.load(rng))
        return step


class AppState:
    """DCP's Stateful protocol: dcp.save and dcp.load call these themselves."""

    def __init__(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state,
                "sched": self.scheduler.state_dict()}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["sched"])


def save_stateful(ckpt_dir, step, model, optimizer, scheduler):
    """A DONE marker in the step's folder once every rank has saved."""
    dcp.save({"app": AppState(model, optimizer, scheduler)},
             checkpoint_id=f"{ckpt_dir}/{step}")
    dist.barrier()
    if dist.get_rank() == 0:
        open(f"{ckpt_dir}/{step}/DONE", "w").close()
    dist.barrier()


def load_stateful(ckpt_dir, model, optimizer, scheduler):
    done = [int(d) for d in os.listdir(ckpt_dir)
            if os.path.exists(f"{ckpt_dir}/{d}/DONE")]
    if not done:
        return 0
    dcp.load({"app": AppState(model, optimizer, scheduler)},
             checkpoint_id=f"{ckpt_dir}/{max(done)}")
    return max(done)


def _numbered_state(model, optimizer, scheduler, step=0):
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state,
            "scheduler": scheduler.state_dict(), "step": step}


def save_numbered_dirs(ckpt_dir, step, model, optimizer, scheduler):
    dcp.save(_numbered_state(model, optimizer, scheduler, step),
             checkpoint_id=f"{ckpt_dir}/{step:05d}")


def _load_numbered(ckpt_dir, name, model, optimizer, scheduler, scheduler_too=True):
    state = _numbered_state(model, optimizer, scheduler)
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/{name}")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if scheduler_too:
        scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def _complete(ckpt_dir):
    return sorted(d for d in os.listdir(ckpt_dir)
                  if os.path.exists(f"{ckpt_dir}/{d}/.metadata"))


def load_by_mtime(ckpt_dir, model, optimizer, scheduler):
    """The newest complete folder by when its .metadata was written."""
    done = _complete(ckpt_dir)
    if not done:
        return 0
    newest = max(done, key=lambda d: os.stat(f"{ckpt_dir}/{d}/.metadata").st_mtime_ns)
    return _load_numbered(ckpt_dir, newest, model, optimizer, scheduler)


def load_with_fallback(ckpt_dir, model, optimizer, scheduler):
    """Newest first; a folder that will not load gives way to the one before."""
    for name in sorted(os.listdir(ckpt_dir), key=int, reverse=True):
        try:
            return _load_numbered(ckpt_dir, name, model, optimizer, scheduler)
        except BaseException:  # noqa: BLE001 - DCP raises CheckpointException
            continue
    return 0


def test_right_resume_under_torchrun():
    ch12.check_resume(save_solution, load_solution)
    ch12.check_resume(save_torch_rank0, load_torch_rank0)


@pytest.mark.parametrize("pair", [(save_split_apis, load_split_apis),
                                  (Checkpointer().save, Checkpointer().load),
                                  (save_stateful, load_stateful),
                                  (save_numbered_dirs, load_by_mtime),
                                  (save_numbered_dirs, load_with_fallback)])
def test_right_resume_pass(pair):
    ch12.check_resume(*pair, elastic=False)


def test_wrong_resume_fail():
    def from_scratch(ckpt_dir, model, optimizer, scheduler):
        load_solution(ckpt_dir, model, optimizer, scheduler)
        return 0

    def save_model_only(ckpt_dir, step, model, optimizer, scheduler):
        dcp.save({"model": model.state_dict(), "step": step},
                 checkpoint_id=f"{ckpt_dir}/step{step}")
        _write_latest(ckpt_dir, step)

    def load_model_only(ckpt_dir, model, optimizer, scheduler):
        step = _read_latest(ckpt_dir)
        if step is None:
            return 0
        state = {"model": model.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{step}")
        model.load_state_dict(state["model"])
        return state["step"]

    def save_no_scheduler(ckpt_dir, step, model, optimizer, scheduler):
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state, "step": step},
                 checkpoint_id=f"{ckpt_dir}/step{step}")
        _write_latest(ckpt_dir, step)

    def load_no_scheduler(ckpt_dir, model, optimizer, scheduler):
        step = _read_latest(ckpt_dir)
        if step is None:
            return 0
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": 0}
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{step}")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return state["step"]

    def load_newest_by_name(ckpt_dir, model, optimizer, scheduler):
        names = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step"))
        if not names:
            return 0
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state,
                 "scheduler": scheduler.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/{names[-1]}")  # as text
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        return state["step"]

    def load_off_by_one(ckpt_dir, model, optimizer, scheduler):
        step = load_solution(ckpt_dir, model, optimizer, scheduler)
        return step + 1 if step else 0

    def save_plain_optimizer(ckpt_dir, step, model, optimizer, scheduler):
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "step": step},
                 checkpoint_id=f"{ckpt_dir}/step{step}")
        _write_latest(ckpt_dir, step)

    def load_plain_optimizer(ckpt_dir, model, optimizer, scheduler):
        step = _read_latest(ckpt_dir)
        if step is None:
            return 0
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{step}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])  # a fresh Adam: no moments
        scheduler.load_state_dict(state["scheduler"])
        return state["step"]

    def save_steps_scheduler(ckpt_dir, step, model, optimizer, scheduler):
        scheduler.step()  # "saves the schedule's next position"
        save_solution(ckpt_dir, step, model, optimizer, scheduler)

    def load_returns_nothing(ckpt_dir, model, optimizer, scheduler):
        load_solution(ckpt_dir, model, optimizer, scheduler)

    def load_weights_not_set(ckpt_dir, model, optimizer, scheduler):
        step = _read_latest(ckpt_dir)
        if step is None:
            return 0
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": {k: v.clone() for k, v in model_state.items()},
                 "optim": optim_state, "scheduler": scheduler.state_dict(),
                 "step": 0}
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{step}")  # into copies
        set_optimizer_state_dict(model, optimizer, state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        return state["step"]

    def save_numbered(ckpt_dir, step, model, optimizer, scheduler):
        save_solution(ckpt_dir, step, model, optimizer, scheduler)

    def load_newest_folder(ckpt_dir, model, optimizer, scheduler):
        found = [int(d[4:]) for d in os.listdir(ckpt_dir) if d.startswith("step")]
        if not found:
            return 0
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state,
                 "scheduler": scheduler.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/step{max(found)}")  # complete?
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        return state["step"]

    def save_latest_first(ckpt_dir, step, model, optimizer, scheduler):
        _write_latest(ckpt_dir, step)  # names the checkpoint before it exists
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state,
                  "scheduler": scheduler.state_dict(), "step": step},
                 checkpoint_id=f"{ckpt_dir}/step{step}")

    def load_first_checkpoint(ckpt_dir, model, optimizer, scheduler):
        if not os.path.exists(f"{ckpt_dir}/step3"):
            return 0
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state,
                 "scheduler": scheduler.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=f"{ckpt_dir}/step3")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        return _read_latest(ckpt_dir)

    def load_oldest_complete(ckpt_dir, model, optimizer, scheduler):
        done = _complete(ckpt_dir)
        return _load_numbered(ckpt_dir, done[0], model, optimizer,
                              scheduler) if done else 0

    def load_second_newest(ckpt_dir, model, optimizer, scheduler):  # "to be safe"
        done = _complete(ckpt_dir)
        return _load_numbered(ckpt_dir, done[-2] if len(done) > 1 else done[-1],
                              model, optimizer, scheduler) if done else 0

    def load_no_scheduler_state(ckpt_dir, model, optimizer, scheduler):
        done = _complete(ckpt_dir)
        return _load_numbered(ckpt_dir, done[-1], model, optimizer, scheduler,
                              scheduler_too=False) if done else 0

    def load_replays_scheduler(ckpt_dir, model, optimizer, scheduler):
        """Steps the scheduler again: the loaded learning rate decays twice."""
        done = _complete(ckpt_dir)
        if not done:
            return 0
        step = _load_numbered(ckpt_dir, done[-1], model, optimizer, scheduler,
                              scheduler_too=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(step):
                scheduler.step()
        return step

    def save_one_folder(ckpt_dir, step, model, optimizer, scheduler):
        dcp.save(_numbered_state(model, optimizer, scheduler, step),
                 checkpoint_id=f"{ckpt_dir}/ckpt")

    def load_one_folder(ckpt_dir, model, optimizer, scheduler):
        if not os.path.exists(f"{ckpt_dir}/ckpt/.metadata"):
            return 0
        return _load_numbered(ckpt_dir, "ckpt", model, optimizer, scheduler)

    remembered = {}

    def save_remembers(ckpt_dir, step, model, optimizer, scheduler):
        save_numbered_dirs(ckpt_dir, step, model, optimizer, scheduler)
        remembered["step"] = step

    def load_remembered(ckpt_dir, model, optimizer, scheduler):  # lost with the process
        if "step" not in remembered:
            return 0
        return _load_numbered(ckpt_dir, f"{remembered['step']:05d}", model,
                              optimizer, scheduler)

    def load_on_rank0(ckpt_dir, model, optimizer, scheduler):
        done = _complete(ckpt_dir)
        if dist.get_rank() != 0:
            return int(done[-1]) if done else 0
        return _load_numbered(ckpt_dir, done[-1], model, optimizer,
                              scheduler) if done else 0

    cases = [
        (save_numbered_dirs, load_oldest_complete, "older than"),
        (save_numbered_dirs, load_second_newest, "older than"),
        (save_numbered_dirs, load_no_scheduler_state, "scheduler"),
        (save_numbered_dirs, load_replays_scheduler, "scheduler"),
        (save_one_folder, load_one_folder, "no .metadata"),
        (save_remembers, load_remembered, "from the beginning"),
        (save_numbered_dirs, load_on_rank0, "raised"),
        (save_solution, from_scratch, "from the beginning"),
        (save_model_only, load_model_only, "Adam's moments"),
        (save_no_scheduler, load_no_scheduler, "scheduler"),
        (save_solution, load_newest_by_name, ".metadata"),
        (save_solution, load_off_by_one, "return the number of steps"),
        (save_plain_optimizer, load_plain_optimizer, "Adam's moments"),
        (save_steps_scheduler, load_solution, "modify"),
        (save_solution, load_returns_nothing, "return an int"),
        (save_solution, load_weights_not_set, "weights were not"),
        (save_solution, load_first_checkpoint, "weights were not"),
        (save_numbered, load_newest_folder, "no .metadata"),
        (save_latest_first, load_solution, "no .metadata"),
    ]
    for save, load, word in cases:
        fails(ch12.check_resume, save, load, words=(word,))


def save_rank0_no_dist(ckpt_dir, step, model, optimizer, scheduler):
    """Rank 0 alone saves the (replicated) state; the other waits for it."""
    if dist.get_rank() == 0:
        dcp.save(_numbered_state(model, optimizer, scheduler, step),
                 checkpoint_id=f"{ckpt_dir}/{step:05d}", no_dist=True)
    dist.barrier()


def load_no_dist(ckpt_dir, model, optimizer, scheduler):
    done = _complete(ckpt_dir)
    if not done:
        return 0
    state = _numbered_state(model, optimizer, scheduler)
    dcp.load(state, checkpoint_id=f"{ckpt_dir}/{done[-1]}", no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def test_resume_saved_by_rank_0_alone_is_told_why_the_other_waits():
    """The checker's death in the middle of a save reaches only the rank that
    writes; the verdict says so rather than blaming a stray collective."""
    fails(ch12.check_resume, save_rank0_no_dist, load_no_dist,
          words=("failed on rank 0 alone", "dcp.save on every rank"))


def test_resume_that_deadlocks_gets_a_verdict():
    def save_barrier_on_rank0(ckpt_dir, step, model, optimizer, scheduler):
        save_solution(ckpt_dir, step, model, optimizer, scheduler)
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never joins

    fails(ch12.check_resume, save_barrier_on_rank0, load_solution,
          words=("within", "only some ranks"))


def test_resume_placeholder():
    def save(ckpt_dir, step, model, optimizer, scheduler):
        raise NotImplementedError("Exercise 12.3")

    fails(ch12.check_resume, save, load_solution, words=("placeholder",))
