"""The layout planner: parameter counts, memory arithmetic, step-time parts,
schedules and uneven stages, context and expert parallelism, the layouts it
allows, its calibration on published runs, and its agreement with the
fake-tensor FSDP2 run."""

import pytest

from course_utils import memory, planner, predict


def test_parameter_counts_match_the_built_models_and_the_papers():
    assert planner.LLAMA2_7B.params() == memory.LLAMA2_7B_PARAMETERS
    assert 400e9 < planner.LLAMA3_405B.params() < 410e9  # "405B"
    assert 69e9 < planner.LLAMA3_70B.params() < 72e9
    # Mixtral: 46.7B in all, 12.9B per token; DeepSeek-V3: 671B, 37B per token
    assert planner.MIXTRAL_8X7B.params() == pytest.approx(46.7e9, rel=0.01)
    assert planner.MIXTRAL_8X7B.active_params() == pytest.approx(12.9e9, rel=0.01)
    assert planner.DEEPSEEK_V3.params() == pytest.approx(671e9, rel=0.01)
    assert planner.DEEPSEEK_V3.active_params() == pytest.approx(37e9, rel=0.03)


def test_state_is_sixteen_bytes_per_parameter_divided_by_the_layout():
    m = planner.LLAMA2_7B
    one = planner.memory_per_gpu(m, planner.Layout(), 2048, 1)
    state = one["parameters"] + one["gradients"] + one["optimizer state"]
    assert state == pytest.approx(16 * m.params())
    eight = planner.memory_per_gpu(m, planner.Layout(dp=8), 2048, 8)
    assert eight["optimizer state"] == pytest.approx(one["optimizer state"] / 8)
    ddp = planner.memory_per_gpu(m, planner.Layout(dp=8, sharded=False), 2048, 8)
    assert ddp["optimizer state"] == pytest.approx(one["optimizer state"])
    assert ddp["gathered layers"] == 0 < eight["gathered layers"]
    hsdp = planner.memory_per_gpu(m, planner.Layout(dp=8, shard_group=4), 2048, 8)
    assert hsdp["optimizer state"] == pytest.approx(one["optimizer state"] / 4)


def test_experts_are_split_by_expert_parallelism():
    m = planner.MIXTRAL_8X7B
    one = planner.memory_per_gpu(m, planner.Layout(dp=8, sharded=False), 4096, 8)
    ep = planner.memory_per_gpu(m, planner.Layout(dp=8, ep=8, sharded=False),
                                4096, 8)
    routed = m.routed_params()
    assert one["parameters"] - ep["parameters"] == pytest.approx(
        2 * routed * 7 / 8, rel=1e-6)
    assert planner.step_parts(m, planner.Layout(dp=8, ep=8), "h100_sxm", 4096,
                              8)["expert parallel"] > 0


def test_recompute_keeps_less_and_computes_more():
    m, lay = planner.LLAMA3_8B, planner.Layout(dp=8)
    rc = planner.Layout(dp=8, recompute=True)
    assert rc.recompute == "full"
    assert (planner.memory_per_gpu(m, rc, 8192, 8)["activations"]
            < planner.memory_per_gpu(m, lay, 8192, 8)["activations"] / 5)
    sel = planner.Layout(dp=8, recompute="selective")
    t = {x.recompute: planner.step_parts(m, x, "h100_sxm", 8192, 8)["compute"]
         for x in (lay, sel, rc)}
    assert t["none"] < t["selective"] < t["full"] < t["none"] * 4 / 3 * 1.01


def test_activations_agree_with_the_fake_tensor_run():
    for n in (8, 64):
        ours = planner.memory_per_gpu(planner.LLAMA2_7B, planner.Layout(dp=n), 2048, n,
                                      precision="fp32 + Adam")
        fake = memory.LLAMA2_7B_FSDP2[n]
        assert ours["parameters"] == pytest.approx(fake["parameters"], rel=1e-3)
        assert ours["activations"] == pytest.approx(fake["activations"], rel=0.1)


def test_step_time_parts_follow_the_layout():
    m = planner.LLAMA3_70B
    tp8 = planner.step_parts(m, planner.Layout(dp=8, tp=8), "h100_sxm", 4096, 64)
    tp1 = planner.step_parts(m, planner.Layout(dp=64), "h100_sxm", 4096, 64)
    assert tp8["tensor parallel"] > 0 and tp1["tensor parallel"] == 0
    assert tp8["compute"] == pytest.approx(tp1["compute"])
    pp = planner.step_parts(m, planner.Layout(dp=8, pp=8), "h100_sxm", 4096, 64)
    assert pp["compute"] > tp1["compute"]  # the bubble: 8 micro-batches, 8 stages
    t = planner.step_seconds(m, planner.Layout(dp=64), "h100_sxm", 4096, 64)
    assert t.kind == "predicted" and "fitted on published runs" in t.label


def test_schedules_shrink_the_bubble_in_order():
    m, gpu = planner.LLAMA3_70B, "h100_sxm"
    t = {s: planner.step_parts(m, planner.Layout(dp=2, tp=8, pp=8, schedule=s,
                                                 virtual=2 if s == "interleaved"
                                                 else 1), gpu, 4096, 16)["compute"]
         for s in predict.SCHEDULES}
    assert t["gpipe"] == t["1f1b"] > t["interleaved"] > t["zero-bubble"]
    assert predict.bubble_slots(8, "interleaved", 4) == pytest.approx(7 / 4)
    with pytest.raises(ValueError):
        planner.Layout(schedule="bfs")


def test_uneven_stages_put_fewer_layers_on_the_ends():
    assert planner.stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    assert sum(planner.stage_layers(61, 16)) == 61
    for n in (5, 7, 13):
        st = planner.stage_layers(80, n)
        assert sum(st) == 80 and max(st) - min(st) <= 1
        assert st[0] == min(st) and st[-1] == min(st)


def test_collectives_across_nodes_use_every_port_of_the_group():
    one_port = predict.group_busbw(16, 1)
    eight = predict.group_busbw(16, 8)
    assert eight == pytest.approx(min(predict.achieved_link_bandwidth("nvlink_h100"),
                                      8 * one_port))
    assert predict.group_busbw(8, 8) == predict.achieved_link_bandwidth(
        "nvlink_h100")
    assert planner.network_allreduce_seconds(1e9, 1).value == 0
    small = planner.network_allreduce_seconds(8, 16).value
    big = planner.network_allreduce_seconds(1e9, 16).value
    assert small < 1e-3 < big
    with pytest.raises(ValueError):
        planner.network_allreduce_seconds(1.0, 0)


def test_context_parallel_methods_cost_what_they_send():
    m, gpu = planner.LLAMA3_8B, "h100_sxm"
    parts = {c: planner.step_parts(m, planner.Layout(cp=8, cp_method=c), gpu,
                                   131072, 1)["context parallel"]
             for c in planner.CP_METHODS}
    assert all(v >= 0 for v in parts.values()) and parts["all-gather"] > 0
    assert parts["ulysses"] > 0


def test_layouts_respect_node_heads_batch_and_experts():
    for lay in planner.layouts(planner.LLAMA3_8B, 48, 24):
        assert lay.gpus == 48 and lay.tp <= 8 and 8 % lay.tp == 0
        assert 24 % lay.dp == 0 and lay.cp == 1
    pps = {lay.pp for lay in planner.layouts(planner.LLAMA3_405B, 1024, 2048)}
    assert 16 in pps  # 126 layers do not divide by 16: uneven stages
    cps = {lay.cp for lay in planner.layouts(planner.LLAMA3_8B, 64, 8, seq=65536)}
    assert {1, 2, 8} <= cps
    eps = {lay.ep for lay in planner.layouts(planner.MIXTRAL_8X7B, 64, 64)}
    assert 8 in eps and all(8 % e == 0 for e in eps)


def test_plan_puts_fitting_layouts_first_fastest_first():
    rows = planner.plan(planner.LLAMA3_70B, "h100_sxm", 64, 4096, 128)
    fits = [r for r in rows if r.fits]
    assert fits and rows[:len(fits)] == fits
    times = [r.step.value for r in fits]
    assert times == sorted(times)
    assert all(not r.fits for r in planner.plan(planner.LLAMA3_405B, "t4", 8, 2048, 8))
    with pytest.raises(ValueError):
        planner.plan(planner.LLAMA3_8B, "a100", 8, 2048, 8)
    close = planner.within_error(rows)
    assert close[0] is fits[0] and all(r.fits for r in close)


def test_calibration_fits_on_some_runs_and_checks_on_others():
    pairs = planner.run_pairs()
    fit = [p for p in pairs if p.setup.startswith("[fit]")]
    held = [p for p in pairs if p.setup.startswith("[check]")]
    assert len(fit) >= 6 and len(held) >= 12
    assert all(p.within for p in pairs)
    sources = {p.measured.split("_")[0] for p in pairs}
    assert len(sources) >= 3, sources
    # the fit is a solve, not a constant: it moves when a fitted run moves
    before = planner.fitted_activation_traffic()
    assert 10 < before < 500
    assert 0.3 < planner.whole_step_efficiency(planner.LLAMA3_8B) < 0.6


def test_planner_enumerates_every_published_layout_it_is_compared_with():
    for run in planner.runs():
        listed = planner.layouts(run.model, run.layout.gpus, run.global_batch,
                                 seq=run.seq)
        assert any((x.dp, x.tp, x.pp, x.cp) == (run.layout.dp, run.layout.tp,
                                                run.layout.pp, run.layout.cp)
                   for x in listed), run.key
