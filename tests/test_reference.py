"""course_utils.reference: recorded GPU results, and nothing fake."""

import json

import pytest
import torch

from course_utils import reference


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(reference.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(reference.RECORD_ENV, raising=False)
    return tmp_path


def test_nothing_recorded_says_so(data_dir, capsys):
    assert reference.show("00.x", local=1.5, unit="s") == []
    out = capsys.readouterr().out
    assert "1.5 s measured here" in out
    assert "no reference recorded yet on a GPU" in out
    assert reference.recorded_devices() == []


def test_cpu_results_are_never_recorded(data_dir, monkeypatch):
    monkeypatch.setenv(reference.RECORD_ENV, "1")
    assert reference.record("00.x", 1.0, "s", "cpu") is False
    assert list(data_dir.iterdir()) == []


def test_recording_off_writes_nothing(data_dir):
    assert reference.record("00.x", 1.0, "s", "cuda:0") is False
    assert list(data_dir.iterdir()) == []


def test_recorded_file_is_shown_with_device_and_date(data_dir, capsys):
    entry = {
        "value": 0.25,
        "unit": "ms",
        "note": "",
        "device": "NVIDIA H100 80GB HBM3",
        "capability": "9.0",
        "torch": "2.13.0",
        "cuda": "12.8",
        "date": "2026-11-22",
    }
    (data_dir / "nvidia-h100-80gb-hbm3.json").write_text(
        json.dumps({"device": entry["device"], "results": {"02.launch": entry}})
    )
    assert reference.recorded_devices() == ["NVIDIA H100 80GB HBM3"]
    assert reference.lookup("02.launch") == [entry]
    reference.show("02.launch")
    out = capsys.readouterr().out
    assert "0.25 ms reference (NVIDIA H100 80GB HBM3, 2026-11-22" in out


def test_shipped_data_files_are_well_formed():
    for path in reference.data_dir().glob("*.json"):
        data = json.loads(path.read_text())
        assert data["device"] and isinstance(data["results"], dict)
        for name, e in data["results"].items():
            assert name[:2].isdigit() and name[2] == "."
            assert {"value", "unit", "device", "torch", "cuda", "date"} <= set(e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_record_on_gpu_writes_a_file(data_dir, monkeypatch):
    monkeypatch.setenv(reference.RECORD_ENV, "1")
    assert reference.record("00.x", 2.0, "s", "cuda:0")
    (entry,) = reference.lookup("00.x")
    assert entry["value"] == 2.0 and entry["device"] == torch.cuda.get_device_name(0)
