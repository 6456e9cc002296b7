"""course_utils.reference: recorded, published and predicted GPU figures."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course_utils import plots, reference  # noqa: E402

ENTRY = {
    "value": 0.25,
    "unit": "ms",
    "note": "",
    "device": "NVIDIA H100 80GB HBM3",
    "capability": "9.0",
    "torch": "2.13.0",
    "cuda": "12.8",
    "date": "2026-11-22",
}
PUBLISHED = {
    "entries": [
        {"id": "gpu_x.bandwidth", "gpu": "GPU X", "quantity": "bandwidth",
         "value": 1000, "unit": "GB/s", "measures": "peak memory bandwidth",
         "source": {"title": "GPU X datasheet", "where": "Maker, https://x.example",
                    "year": 2024}},
        {"id": "seed9.curve", "gpu": "GPU not stated", "quantity": "curve",
         "value": {"x": [1, 2], "y": [3.0, 4.0]}, "unit": "s",
         "measures": "two points", "source": {"title": "a post", "where": "a blog",
                                              "year": None}},
    ]
}


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(reference.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(reference.RECORD_ENV, raising=False)
    monkeypatch.setattr(reference, "_PUBLISHED", None)
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "test.json").write_text(json.dumps(PUBLISHED))
    return tmp_path


def record_h100(data_dir, name="02.launch"):
    (data_dir / "nvidia-h100-80gb-hbm3.json").write_text(
        json.dumps({"device": ENTRY["device"], "results": {name: ENTRY}}))


def test_a_gpu_experiment_without_any_gpu_figure_is_refused(data_dir):
    with pytest.raises(ValueError, match="no GPU figure"):
        reference.show("00.x", local=1.5, unit="s")


def test_each_kind_is_labelled_in_the_printed_lines(data_dir, capsys):
    record_h100(data_dir)
    pub = reference.published("gpu_x.bandwidth")
    pred = reference.predicted(0.2, "ms", "GPU X", "t = bytes / bandwidth",
                               inputs=["gpu_x.bandwidth"])
    shown = reference.show("02.launch", local=1.5, unit="ms", figures=[pred, pub])
    assert [f.kind for f in shown] == ["measured", "recorded", "published",
                                       "predicted"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("02.launch: 1.5 ms  [measured here on this CPU")
    assert lines[1] == ("02.launch: 0.25 ms  [recorded on NVIDIA H100 80GB HBM3 "
                        "(2026-11-22, torch 2.13.0, CUDA 12.8)]")
    assert lines[2] == ("02.launch: 1000 GB/s  [published, GPU X (GPU X datasheet, "
                        "Maker, 2024)]")
    assert lines[3].startswith("02.launch: 0.2 ms  [predicted for GPU X (model: "
                               "t = bytes / bandwidth; inputs: bandwidth 1000 GB/s "
                               "from GPU X datasheet, Maker, 2024)")
    assert "no reference recorded yet" not in "\n".join(lines)


def test_recorded_is_shown_before_and_beside_a_prediction(data_dir, capsys):
    record_h100(data_dir)
    pred = reference.predicted(0.2, "ms", "NVIDIA H100 80GB HBM3", "a model")
    shown = reference.show("02.launch", figures=[pred])
    assert [f.kind for f in shown] == ["recorded", "predicted"]
    out = capsys.readouterr().out
    assert out.index("recorded on") < out.index("predicted for")


def test_plot_legends_name_every_kind(data_dir):
    record_h100(data_dir)
    figs = reference.show("02.launch", local=1.5, unit="ms", figures=[
        reference.published("gpu_x.bandwidth"),
        reference.predicted(0.2, "ms", "GPU X", "a model")])
    ax = plots.plot_figure_bars(figs)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0].startswith("this CPU (") and legend[0].endswith("measured here")
    assert legend[1:] == ["NVIDIA H100 80GB HBM3, recorded", "GPU X, published",
                          "GPU X, predicted"]
    plt.close("all")
    curve = reference.published("seed9.curve")
    pred = reference.predicted({"x": [1, 2], "y": [2.5, 3.5]}, "s", "GPU X", "m")
    ax = plots.plot_figure_curves([curve, pred])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["GPU not stated, published", "GPU X, predicted"]
    styles = [(ln.get_linestyle(), ln.get_marker()) for ln in ax.get_lines()]
    assert styles[0] != styles[1]  # each kind looks different
    plt.close("all")


def test_published_entries_need_a_unit_and_a_source(data_dir):
    bad = dict(PUBLISHED["entries"][0], id="gpu_x.nosource", source={"title": "t"})
    (data_dir / "published" / "bad.json").write_text(json.dumps({"entries": [bad]}))
    with pytest.raises(ValueError, match="lacks source.where"):
        reference.published_entries()
    nounit = dict(PUBLISHED["entries"][0], id="gpu_x.nounit", unit="")
    (data_dir / "published" / "bad.json").write_text(json.dumps({"entries": [nounit]}))
    with pytest.raises(ValueError, match="lacks unit"):
        reference.published_entries()


def test_unknown_published_id_lists_what_there_is(data_dir):
    with pytest.raises(KeyError, match="gpu_x.bandwidth"):
        reference.published("gpu_x.bandwith")


def test_shipped_published_figures_all_have_sources():
    entries = reference.published_entries()  # raises on a missing field
    assert len(entries) >= 30
    for e in entries.values():
        assert isinstance(e["value"], (int, float, dict, list)), e["id"]
        src = e["source"]
        assert src["title"] and src["where"], e["id"]


def test_cpu_results_are_never_recorded(data_dir, monkeypatch):
    monkeypatch.setenv(reference.RECORD_ENV, "1")
    assert reference.record("00.x", 1.0, "s", "cpu") is False
    assert [p.name for p in data_dir.iterdir()] == ["published"]


def test_recording_off_writes_nothing(data_dir):
    assert reference.record("00.x", 1.0, "s", "cuda:0") is False
    assert [p.name for p in data_dir.iterdir()] == ["published"]


def test_shipped_recorded_files_are_well_formed():
    for path in reference.data_dir().glob("*.json"):
        data = json.loads(path.read_text())
        assert data["device"] and isinstance(data["results"], dict)
        for name, e in data["results"].items():
            assert name[:2].isdigit() and name[2] == "."
            assert {"value", "unit", "device", "torch", "cuda", "date"} <= set(e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_record_on_gpu_writes_a_file(data_dir, monkeypatch, capsys):
    monkeypatch.setenv(reference.RECORD_ENV, "1")
    assert reference.record("00.x", 2.0, "s", "cuda:0")
    (entry,) = reference.lookup("00.x")
    assert entry["value"] == 2.0 and entry["device"] == torch.cuda.get_device_name(0)
    # the run that just recorded shows its figure once, as measured here
    shown = reference.show("00.x", local=2.0, unit="s", local_device="cuda:0")
    assert [f.kind for f in shown] == ["measured"]


def test_a_note_naming_a_missing_entry_is_found(data_dir):
    note = dict(PUBLISHED["entries"][0], id="gpu_x.peak_tflops",
                note="see gpu_x.missing_figure and paper_2021.gpu_count; "
                     "pin_memory().to and torch.cuda are prose")
    (data_dir / "published" / "notes.json").write_text(json.dumps({"entries": [note]}))
    found = reference.dangling_references()
    assert found == ["gpu_x.peak_tflops: names gpu_x.missing_figure",
                     "gpu_x.peak_tflops: names paper_2021.gpu_count"]
    present = dict(note, note="see gpu_x.bandwidth's source; seed9.curve")
    (data_dir / "published" / "notes.json").write_text(
        json.dumps({"entries": [present]}))
    assert reference.dangling_references() == []


def test_shipped_notes_name_only_entries_that_exist():
    assert reference.dangling_references() == []


def test_shipped_hardware_rows_cite_no_secondary_summaries():
    # datasheet figures come from NVIDIA's own documents, not blogs or data repos
    for e in reference.published_entries().values():
        where = e["source"]["where"]
        for bad in ("gadgetbrains", "manunicholasjacob", "llama-cpp-mmvq", "hpctech",
                    "manuals.plus"):
            assert bad not in where.lower(), e["id"]


def test_pcie_rates_share_one_precision():
    # 15.75, 31.5 and 63.0 GB/s: each generation at its exact 128b/130b data rate
    rates = {g: reference.published_entry(k)["value"] for g, k in (
        (3, "pcie3_x16.bandwidth_gbps"), (4, "pcie4_x16.bandwidth_per_direction_gbps"),
        (5, "pcie5_x16.bandwidth_per_direction_gbps"))}
    for gen, rate in rates.items():
        exact = 16 * 8 * 2 ** (gen - 3) * 128 / 130 / 8
        assert abs(rate - exact) < 5e-4 * exact, (gen, rate, exact)


def test_a_large_value_is_written_out_not_in_exponent_form():
    f = reference.predicted(11410.2, "ms", "H100", "a model")
    assert f.format_value() == "11,410"
    assert reference.predicted(123.456, "ms", "H100", "a model").format_value() == \
        "123.5"
