"""Chapter 2's plumbing: GPU figures with each source cited once, and the plots."""

import matplotlib
import pytest
import torch

from course_utils import reference, roofline
from course_utils.bench import Sweep

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def fresh_sources():
    roofline.reset_sources()
    yield
    roofline.reset_sources()


def test_a_source_is_printed_in_full_once_then_by_number(capsys):
    fig = reference.published("h100_sxm.fp32_tflops")
    bw = reference.published("h100_sxm.memory_bandwidth_gbps")  # the same datasheet
    roofline.show("02.roofline_gpu", figures=[fig, bw])
    roofline.show("02.roofline_gpu", figures=[fig])
    out = capsys.readouterr().out
    source = reference.cite(reference.published_entry("h100_sxm.fp32_tflops"))
    assert out.count(source) == 1, out
    assert out.count("[1]") == 4, out  # three figure lines and one footnote


def test_predicted_inputs_are_cited_by_number(capsys):
    roofline.show("02.launch_queue", figures=[
        roofline.doubling_seconds(4096), roofline.doubling_seconds(40)])
    out = capsys.readouterr().out
    first, second = [line for line in out.splitlines() if line.startswith("02.")]
    assert "from [" in first and "from [" in second
    def cited(line):  # a launch-bound figure also carries its caveat
        return line.split(". Caveat:")[0]

    assert len(cited(second)) < len(cited(first)) + 40  # nothing cited again in full
    for entry in reference.published_entries().values():
        assert out.count(reference.cite(entry)) <= 1


def test_lines_print_under_their_figure(capsys):
    seed = reference.published("seed003.softmax_dim_seconds")
    roofline.show("02.softmax_16384", figures=[seed],
                  lines=lambda f: [f"{len(f.value)} runs"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("02.softmax_16384:") and lines[1].strip() == "4 runs"


def test_show_refuses_an_experiment_without_a_gpu_figure():
    with pytest.raises(ValueError, match="no GPU figure"):
        roofline.show("02.nothing_recorded_here")


def test_seed_columns_print_both_kinds_and_the_caveat(capsys):
    seed = roofline.seed_gpu_columns([4, 40, 400, 4000])
    out = capsys.readouterr().out
    assert seed.kind == "published" and seed.value["x"] == [4, 40, 400, 4000]
    assert "02.seed_table_gpu_seed" in out and "02.seed_table_gpu_right" in out
    assert "predicted for" in out and "caveat" in out


def test_doubling_seconds_grows_with_the_work_past_the_launch_cost():
    small = roofline.doubling_seconds(4).value
    assert roofline.doubling_seconds(40).value == pytest.approx(small)  # launch-bound
    big, bigger = roofline.doubling_seconds(4096).value, roofline.doubling_seconds(
        8192).value
    assert bigger == pytest.approx(4 * big, rel=1e-6)  # memory-bound: 4x the bytes


def test_crossing_from_a_gpu_curve(capsys):
    cpu = Sweep("cpu", [16, 64, 256], [1e-6, 1e-5, 1e-3], [0, 0, 0])
    roofline.crossing(cpu, ([16, 64, 256], [5e-6, 5e-6, 1e-5]))
    out = capsys.readouterr().out
    assert "CPU faster at n = [16]" in out and "GPU faster at n = [64, 256]" in out
    assert "100.0x faster" in out


def test_crossing_without_a_gpu_curve_uses_the_prediction(capsys):
    cpu = Sweep("cpu", [512, 2048], [1e-4, 2e-3], [0, 0])
    roofline.crossing(cpu)
    out = capsys.readouterr().out
    if reference.lookup("02.doubling_sweep_gpu"):
        pytest.skip("a recorded GPU curve is used instead")
    assert "at n = 2048" in out and "predicted" in out


def test_plots_draw_without_a_gpu():
    cpu_points = {"matmul": [[2.0, 1e9, 32], [40.0, 3e10, 512]],
                  "add": [[1 / 12, 1e9, 4096]]}
    published = (reference.published("h100_sxm.fp32_tflops"),
                 reference.published("h100_sxm.memory_bandwidth_gbps"))
    ax = roofline.plot_roofline(4e10, 1.5e10, cpu_points, None, published)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("published datasheet peaks" in t for t in labels)
    gpu_roof = {"points": cpu_points, "peak_flops": None, "peak_bw": None,
                "copy_bw": 1e12, "peaks_from": "", "label": "a GPU"}
    ax = roofline.plot_roofline(4e10, 1.5e10, cpu_points, gpu_roof)
    assert any("peak unknown" in t.get_text() for t in ax.get_legend().get_texts())
    cpu = Sweep("CPU, measured here", [16, 64], [1e-6, 1e-5], [1e-7, 1e-6])
    seed = reference.published("seed000.gpu_add_loop_seconds")
    ax = roofline.plot_doubling_sweep([cpu], [16, 64, 256], seed)
    assert len(ax.get_lines()) >= 3


def test_error_line_names_the_line_of_the_traceback():
    script = "x = 1\ny = [0][5]  # the bug\nprint(x)\n"
    assert roofline.error_line(script, blocking=False) == "line 2: y = [0][5]"
    assert roofline.error_line("print('fine')\n", blocking=True).startswith(
        "no error reported")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_peaks_of_this_gpu():
    flops, bw, how = roofline.gpu_peaks(torch.device("cuda", 0))
    assert (flops is None or flops > 1e12) and (bw is None or bw > 1e11), how
