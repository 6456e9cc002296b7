"""The layout planner: parameter counts, memory arithmetic, step-time parts,
the layouts it allows, and its agreement with the fake-tensor FSDP2 run."""

import pytest

from course_utils import memory, planner


def test_parameter_counts_match_the_built_models():
    assert planner.LLAMA2_7B.params() == memory.LLAMA2_7B_PARAMETERS
    assert 400e9 < planner.LLAMA3_405B.params() < 410e9  # "405B"
    assert 69e9 < planner.LLAMA3_70B.params() < 72e9


def test_state_is_sixteen_bytes_per_parameter_divided_by_the_layout():
    m = planner.LLAMA2_7B
    one = planner.memory_per_gpu(m, planner.Layout(), 2048, 1)
    state = one["parameters"] + one["gradients"] + one["optimizer state"]
    assert state == pytest.approx(16 * m.params())
    eight = planner.memory_per_gpu(m, planner.Layout(dp=8), 2048, 8)
    assert eight["optimizer state"] == pytest.approx(one["optimizer state"] / 8)
    ddp = planner.memory_per_gpu(m, planner.Layout(dp=8, sharded=False), 2048, 8)
    assert ddp["optimizer state"] == pytest.approx(one["optimizer state"])
    assert "gathered layers" not in ddp


def test_recompute_keeps_less_and_computes_more():
    m, lay = planner.LLAMA3_8B, planner.Layout(dp=8)
    rc = planner.Layout(dp=8, recompute=True)
    assert (planner.memory_per_gpu(m, rc, 8192, 8)["activations"]
            < planner.memory_per_gpu(m, lay, 8192, 8)["activations"] / 5)
    assert (planner.step_parts(m, rc, "h100_sxm", 8192, 8)["compute"]
            == pytest.approx(planner.step_parts(m, lay, "h100_sxm", 8192, 8)["compute"]
                             * 8 / 6))


def test_activations_agree_with_the_fake_tensor_run():
    for n in (8, 64):
        ours = planner.memory_per_gpu(planner.LLAMA2_7B, planner.Layout(dp=n), 2048, n,
                                      precision="fp32 + Adam")
        fake = memory.LLAMA2_7B_FSDP2[n]
        assert ours["parameters"] == pytest.approx(fake["parameters"], rel=1e-3)
        assert (ours["activations"] + ours["logits"]) == pytest.approx(
            fake["activations"], rel=0.05)


def test_step_time_parts_follow_the_layout():
    m = planner.LLAMA3_70B
    tp8 = planner.step_parts(m, planner.Layout(dp=8, tp=8), "h100_sxm", 4096, 64)
    tp1 = planner.step_parts(m, planner.Layout(dp=64), "h100_sxm", 4096, 64)
    assert tp8["tensor parallel"] > 0 and tp1["tensor parallel"] == 0
    assert tp8["compute"] == pytest.approx(tp1["compute"])
    pp = planner.step_parts(m, planner.Layout(dp=8, pp=8), "h100_sxm", 4096, 64)
    assert pp["compute"] > tp1["compute"]  # the bubble: 8 micro-batches, 8 stages
    t = planner.step_seconds(m, planner.Layout(dp=64), "h100_sxm", 4096, 64)
    assert t.kind == "predicted" and "not overlapped" in t.label


def test_network_allreduce_is_latency_then_bandwidth():
    assert planner.network_allreduce_seconds(1e9, 1).value == 0
    small = planner.network_allreduce_seconds(8, 16).value
    big = planner.network_allreduce_seconds(1e9, 16).value
    assert small < 1e-3 < big
    with pytest.raises(ValueError):
        planner.network_allreduce_seconds(1.0, 0)


def test_layouts_respect_node_heads_layers_and_batch():
    for lay in planner.layouts(planner.LLAMA3_8B, 48, 24):
        assert lay.gpus == 48 and lay.tp <= 8 and 32 % lay.tp == 0
        assert 32 % lay.pp == 0 and 24 % lay.dp == 0


def test_plan_puts_fitting_layouts_first_fastest_first():
    rows = planner.plan(planner.LLAMA3_70B, "h100_sxm", 64, 4096, 128)
    fits = [r for r in rows if r.fits]
    assert fits and rows[:len(fits)] == fits
    times = [r.step.value for r in fits]
    assert times == sorted(times)
    assert all(not r.fits for r in planner.plan(planner.LLAMA3_405B, "t4", 8, 2048, 8))
    with pytest.raises(ValueError):
        planner.plan(planner.LLAMA3_8B, "a100", 8, 2048, 8)
