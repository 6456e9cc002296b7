"""course_utils.memory (Chapter 9): counts by category, storages, the fake-rank
prediction and its recorded tables."""

import torch
from torch import nn

from course_utils import memory


def test_by_category_renames_and_sums_devices():
    snap = {torch.device("cpu"): {"Parameter": 8, "Gradient": 0, "Total": 8},
            torch.device("meta"): {"Sharded Param": 4, "Temp": 2, "Total": 6}}
    assert memory.by_category(snap) == {"total": 14, "parameters": 12,
                                        "temporaries": 2}
    assert memory.by_category({}) == {"total": 0}


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    assert memory.storage_bytes([a, a[2:5], a.view(2, 5), None]) == 40
    assert memory.storage_bytes([a, torch.zeros(3, dtype=torch.float64)]) == 64


def test_track_step_is_exact_and_repeatable():
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 64)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # Adam's state exists from now on
    first = memory.track_step(step, model, opt, x)
    second = memory.track_step(step, model, opt, x)
    param_bytes = (64 * 32 + 32) * 4
    assert first == second
    assert first["parameters"] == param_bytes
    assert first["gradients"] == param_bytes
    assert first["optimizer state"] >= 2 * param_bytes  # two moments, and a step
    assert first["total"] >= sum(v for k, v in first.items() if k != "total") / 2


def test_llama_has_llama2_7b_parameter_count():
    with torch.device("meta"):
        model = memory.Llama()
    assert sum(p.numel() for p in model.parameters()) == memory.LLAMA2_7B_PARAMETERS
    with torch.device("meta"):
        small = memory.Llama(vocab=11, dim=8, hidden=16, heads=2, layers=3)
    per_block = 8 * 3 * 8 + 8 * 8 + 3 * 8 * 16 + 2 * 8
    assert sum(p.numel() for p in small.parameters()) == (
        11 * 8 + 3 * per_block + 8 + 8 * 11)


def test_recorded_tables_shard_the_model_states():
    table, p = memory.LLAMA2_7B_FSDP2, memory.LLAMA2_7B_PARAMETERS
    assert sorted(table) == [1, 2, 4, 8, 16, 32, 64]
    for n in (4, 8, 16, 32, 64):  # peak in backward: fp32 shards, 1/n each
        assert table[n]["parameters"] == 4 * p // n
    for n in table:  # the second step: Adam's two moments exist, 1/n each
        assert table[n]["optimizer state"] >= 8 * p // n
        assert sum(memory.parts(table[n]).values()) == table[n]["total"]
    assert 46e9 < table[4]["total"] < 47e9  # not the first step's 33.2 GB
    assert all(table[a]["total"] > table[b]["total"]
               for a, b in zip(sorted(table), sorted(table)[1:], strict=False))


def test_fake_ranks_reproduce_the_recorded_point():
    live = memory.fsdp2_peak_on_fake_ranks([8], layers=2, in_process=True)[8]
    assert live["peak"] == memory.LLAMA2_2_LAYERS_FSDP2[8]
    assert not torch.distributed.is_initialized()  # cleaned up after itself


def test_live_bytes_counts_new_storages_until_freed():
    a = torch.zeros(100)  # made before: not counted, nor are its views
    with memory.LiveBytes() as live:
        b = a * 2  # 400 B, kept
        v = b.view(10, 10)  # a view: no new memory
        a.add_(1)  # in place: no new memory
        (b + 1).sum()  # 400 B and 4 B, freed at once
        del v
    assert (live.current, live.peak) == (400, 804)
    del b
    assert live.current == 0


def test_live_bytes_sees_what_autograd_keeps():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with memory.LiveBytes() as kept:
        out = torch.tanh(lin(x))  # the Linear's output is freed, tanh's is kept
    assert kept.current == 8 * 16 * 4  # out itself, which tanh saves
    with memory.LiveBytes() as nograd, torch.no_grad():
        torch.tanh(lin(x))
    assert nograd.current == 0 and nograd.peak == 2 * 8 * 16 * 4
    del out
