"""Reference results recorded on real GPUs, shown to learners who have none.

Introduced in Chapter 0. A chapter measures on the device it has. Where a
measurement needs a GPU, it calls ``record`` after measuring on one and
``show`` to put what was recorded beside (or in place of) the local figure.

Recording is switched on by the environment variable ``COURSE_RECORD=1``
(``make record`` sets it). Only measurements made on a CUDA device are
recorded, one JSON file per device in ``course_utils/reference_data/``, each
entry with its value, unit, device name, torch and CUDA versions and date.
Nothing is ever invented: with no file, ``show`` says that no reference has
been recorded yet on a GPU.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from pathlib import Path

import torch

RECORD_ENV = "COURSE_RECORD"
DIR_ENV = "COURSE_REFERENCE_DIR"


def data_dir() -> Path:
    """Where the data files live (``COURSE_REFERENCE_DIR`` overrides, for tests)."""
    return Path(os.environ.get(DIR_ENV) or Path(__file__).parent / "reference_data")


def recording() -> bool:
    """True when this run should write reference results (``COURSE_RECORD=1``)."""
    return os.environ.get(RECORD_ENV) == "1"


def _slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def record(
    name: str, value, unit: str, device: torch.device | str, note: str = ""
) -> bool:
    """Write ``value`` under ``name`` for this GPU when recording is on.

    ``value`` is anything JSON can hold: a number, a list (a sweep), a dict
    (a timeline). Returns whether it was written. A CPU measurement is never
    written: the files hold GPU results only.
    """
    device = torch.device(device)
    if not recording() or device.type != "cuda":
        return False
    gpu = torch.cuda.get_device_name(device)
    path = data_dir() / f"{_slug(gpu)}.json"
    data = _load(path) if path.exists() else {"device": gpu, "results": {}}
    data["results"][name] = {
        "value": value,
        "unit": unit,
        "note": note,
        "device": gpu,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.date.today().isoformat(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    tmp.replace(path)
    return True


def lookup(name: str) -> list[dict]:
    """Every recorded entry for ``name``, one per GPU that recorded it."""
    found = []
    for path in sorted(data_dir().glob("*.json")):
        entry = _load(path).get("results", {}).get(name)
        if entry is not None:
            found.append(entry)
    return found


def recorded_devices() -> list[str]:
    """Names of the GPUs that have recorded at least one result."""
    if not data_dir().is_dir():
        return []
    names = []
    for path in sorted(data_dir().glob("*.json")):
        data = _load(path)
        if data.get("results"):
            names.append(data.get("device", path.stem))
    return names


def label(entry: dict) -> str:
    """``'NVIDIA H100 80GB HBM3, 2026-11-22, torch 2.13.0, CUDA 12.8'``."""
    return (
        f"{entry['device']}, {entry['date']}, torch {entry['torch']}, "
        f"CUDA {entry['cuda']}"
    )


def show(
    name: str, local=None, unit: str = "", local_device: str = "", fmt: str = "{:.4g}"
) -> list[dict]:
    """Print the local figure (if any) and the recorded GPU references for ``name``.

    Returns the reference entries (empty when none has been recorded), so a
    chapter can plot them beside its own measurement.
    """
    entries = lookup(name)
    unit = unit or (entries[0]["unit"] if entries else "")
    if local is not None:
        value = fmt.format(local) if isinstance(local, (int, float)) else str(local)
        print(
            f"{name}: {value} {unit}".rstrip()
            + f" measured here ({local_device or 'this machine'})"
        )
    if not entries:
        print(f"{name}: no reference recorded yet on a GPU")
    for e in entries:
        v = e["value"]
        value = fmt.format(v) if isinstance(v, (int, float)) else "(recorded data)"
        print(f"{name}: {value} {e['unit']} reference ({label(e)})")
    return entries
