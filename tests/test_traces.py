"""course_utils.traces: per-rank Chrome traces merged into one timeline."""

import json

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from course_utils import traces


def trace(base_ns, events, pid=4242):
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": "python"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 7,
             "args": {"name": "gloo"}}]
    return {"baseTimeNanoseconds": base_ns, "traceEvents": meta + [
        {"ph": "X", "name": n, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
        for n, tid, ts, dur in events]}


def test_merge_names_ranks_and_aligns_clocks():
    a = trace(1_000_000_000, [("backward", 1, 100.0, 50.0)], pid=11)
    b = trace(1_000_002_000, [("backward", 1, 100.0, 50.0),  # 2 us later
                              ("gloo:all_reduce", 7, 120.0, 10.0)], pid=12)
    merged = traces.merge_traces({0: a, 1: b})
    names = {(e["pid"], e["args"]["name"]) for e in merged
             if e.get("name") == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}  # the originals are dropped
    assert all(e["pid"] in (0, 1) for e in merged)
    assert any(e.get("name") == "thread_name" for e in merged)  # thread names kept
    back = traces.spans(merged, name="backward")
    assert [(s.rank, s.start, s.end) for s in back] == [(0, 100.0, 150.0),
                                                        (1, 102.0, 152.0)]
    assert traces.spans(merged, pattern="all_reduce$", rank=1)[0].duration == 10.0
    assert traces.spans(merged, name="backward", rank=1)[0].thread == 1
    assert traces.merge_traces({}) == []


def test_spans_keep_only_complete_events_sorted():
    events = [{"ph": "X", "name": "b", "pid": 1, "tid": 0, "ts": 5.0, "dur": 1.0},
              {"ph": "i", "name": "b", "pid": 1, "tid": 0, "ts": 1.0},
              {"ph": "X", "name": "b", "pid": 0, "tid": "PyTorch Profiler",
               "ts": 2.0, "dur": 0.5},
              {"ph": "M", "name": "b", "pid": 0, "tid": 0}]
    found = traces.spans(events, name="b")
    assert [(s.rank, s.start) for s in found] == [(0, 2.0), (1, 5.0)]
    assert found[0].thread == "PyTorch Profiler"


def test_spans_pair_begin_and_end_events_per_thread():
    events = [{"ph": "B", "name": "backward", "pid": 0, "tid": 1, "ts": 0.0},
              {"ph": "B", "name": "mm", "pid": 0, "tid": 1, "ts": 10.0},
              {"ph": "E", "pid": 0, "tid": 1, "ts": 20.0},  # closes mm, no name
              {"ph": "B", "name": "optimizer", "pid": 0, "tid": 2, "ts": 30.0},
              {"ph": "E", "pid": 0, "tid": 1, "ts": 100.0},  # closes backward
              {"ph": "E", "pid": 0, "tid": 2, "ts": 120.0},
              {"ph": "E", "pid": 1, "tid": 1, "ts": 5.0},  # its begin was cut off
              {"ph": "B", "name": "backward", "pid": 1, "tid": 1, "ts": 50.0},
              {"ph": "X", "name": "backward", "pid": 1, "tid": 3, "ts": 7.0,
               "dur": 3.0}]
    found = traces.spans(events)
    assert [(s.rank, s.name, s.start, s.end) for s in found] == [
        (0, "backward", 0.0, 100.0), (1, "backward", 7.0, 10.0),
        (0, "mm", 10.0, 20.0), (0, "optimizer", 30.0, 120.0)]
    assert [s.thread for s in traces.spans(events, name="optimizer")] == [2]
    assert traces.spans(events, name="backward", rank=1)[0].duration == 3.0


def test_real_profiler_traces_merge_and_save(tmp_path):
    paths = {}
    for rank in range(2):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("work"):
                torch.ones(64, 64) @ torch.ones(64, 64)
        paths[rank] = tmp_path / f"rank{rank}.json"
        prof.export_chrome_trace(str(paths[rank]))
    merged = traces.merge_traces(paths)
    work = traces.spans(merged, name="work")
    assert [s.rank for s in work] == [0, 1]
    assert work[0].end <= work[1].start  # rank 1 was profiled after rank 0
    out = traces.save_trace(merged, tmp_path / "merged.json")
    assert json.loads(out.read_text())["traceEvents"] == merged
    assert traces.load_trace(out)["traceEvents"] == merged
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(merged))
    assert traces.load_trace(bare) == {"traceEvents": merged}
