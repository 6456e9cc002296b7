"""GPU figures for learners without a GPU: recorded, published and predicted.

Introduced in Chapter 0. A chapter measures on the device it has; for every GPU
experiment it also shows GPU figures of three kinds, each labelled with its
kind and never mixed up:

- **recorded**: measured by this course on a real GPU (``make record``), with
  device, versions and date, in ``reference_data/<gpu>.json``. Preferred, and
  shown first, when present.
- **published**: a figure from a public source (datasheet, paper, official
  tutorial, the seeds' own measurements), in ``reference_data/published/``,
  each with what it measures and its source (title, where, year).
- **predicted**: what a simple model says a named GPU would do (see
  ``course_utils.predict``), with the model and its inputs' sources.

``show(name, local=..., figures=[...])`` prints them one per line, and returns
them as ``Figure`` objects that ``plots.plot_figure_bars`` and
``plots.plot_figure_curves`` draw with a marker and a legend entry per kind.

Recording is switched on by ``COURSE_RECORD=1`` (``make record``). Only
measurements made on a CUDA device are recorded. Nothing is ever invented:
a published figure without a source, or a GPU experiment with no GPU figure at
all, is an error.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

RECORD_ENV = "COURSE_RECORD"
DIR_ENV = "COURSE_REFERENCE_DIR"
KINDS = ("measured", "recorded", "published", "predicted")


def data_dir() -> Path:
    """Where the data files live (``COURSE_REFERENCE_DIR`` overrides, for tests)."""
    return Path(os.environ.get(DIR_ENV) or Path(__file__).parent / "reference_data")


def published_dir() -> Path:
    """The published figures: ``reference_data/published/*.json``."""
    return data_dir() / "published"


def recording() -> bool:
    """True when this run should write reference results (``COURSE_RECORD=1``)."""
    return os.environ.get(RECORD_ENV) == "1"


def _slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass
class Figure:
    """One figure of one kind: its value, unit, device and where it comes from.

    ``value`` is a number or JSON-like data (a curve ``{"x": [...], "y": [...]}``,
    a table, a timeline). ``source`` is what the label says after the device:
    the date and versions of a recording, the title and year of a publication,
    the model and inputs of a prediction. ``caveat`` says, for a prediction
    no calibration pair checks, which part is not calibrated; the label ends
    with it.
    """

    kind: str
    value: object
    unit: str
    device: str
    source: str = ""
    measures: str = ""
    extra: dict = field(default_factory=dict, repr=False)
    caveat: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")

    @property
    def label(self) -> str:
        """The full label, always naming the kind."""
        head = {"measured": f"measured here on {self.device}",
                "recorded": f"recorded on {self.device}",
                "published": f"published, {self.device}",
                "predicted": f"predicted for {self.device}"}[self.kind]
        label = f"{head} ({self.source})" if self.source else head
        return f"{label}. Caveat: {self.caveat}" if self.caveat else label

    @property
    def legend(self) -> str:
        """A short label for a plot legend, still naming the kind."""
        kind = "measured here" if self.kind == "measured" else self.kind
        return f"{self.device}, {kind}"

    def format_value(self, fmt: str = "{:.4g}") -> str:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            if isinstance(v, dict) and "x" in v and "y" in v:
                return f"(curve of {len(v['y'])} points)"
            return "(data below)" if v is not None else "(none)"
        text = fmt.format(v)
        if "e+" in text and abs(v) < 1e15:  # "1.141e+04": the digits read better
            text = f"{v:,.0f}"
        return text


# --- recorded --------------------------------------------------------------------


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
    if not data_dir().is_dir():
        return found
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


def recorded(name: str) -> list[Figure]:
    """The recorded figures for ``name``, one per GPU that recorded it."""
    return [
        Figure("recorded", e["value"], e["unit"], e["device"],
               f"{e['date']}, torch {e['torch']}, CUDA {e['cuda']}",
               measures=e.get("note", ""), extra=e)
        for e in lookup(name)
    ]


# --- published -------------------------------------------------------------------

REQUIRED = ("id", "gpu", "value", "unit", "measures", "source")


def published_entries() -> dict[str, dict]:
    """Every published entry, by id, from ``reference_data/published/*.json``.

    Raises ``ValueError`` for an entry without a unit or a source, or a
    repeated id: a figure without its source is not shown.
    """
    entries: dict[str, dict] = {}
    folder = published_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        for e in _load(path).get("entries", []):
            missing = [k for k in REQUIRED if e.get(k) in (None, "", {})]
            src = e.get("source") or {}
            missing += [f"source.{k}" for k in ("title", "where")
                        if not isinstance(src, dict) or not src.get(k)]
            if missing:
                raise ValueError(f"{path.name}: entry {e.get('id')!r} lacks "
                                 f"{', '.join(missing)}")
            if e["id"] in entries:
                raise ValueError(f"{path.name}: id {e['id']!r} is repeated")
            entries[e["id"]] = e
    return entries


# an id named in prose: ``subject.quantity``, the quantity with an underscore
# (``megatron_2021.gpu_count``, ``seed000.cpu_add_loop_seconds``)
_ID_IN_TEXT = re.compile(
    r"(?<![\w./-])([a-z][a-z0-9_]*\.[a-z][a-z0-9]*_[a-z0-9_]+)(?![\w(/-])")


def dangling_references(entries: dict[str, dict] | None = None) -> list[str]:
    """``'entry: names missing.id'`` for each id a note or measure names that is absent.

    An id is recognised in ``measures`` and ``note`` as ``subject.quantity``
    (see ``_ID_IN_TEXT``); a subject none of the entries has is not an id
    (``pin_memory().to`` or ``torch.cuda`` are not matched either).
    """
    entries = published_entries() if entries is None else entries
    subjects = {k.split(".")[0] for k in entries}
    found = []
    for key, e in sorted(entries.items()):
        text = f"{e.get('measures', '')} {e.get('note', '')}"
        for ref in _ID_IN_TEXT.findall(text):
            prefix = ref.split(".")[0]
            if ref not in entries and (prefix in subjects or re.search(r"_\d{4}$",
                                                                      prefix)):
                found.append(f"{key}: names {ref}")
    return found


_PUBLISHED: dict[str, dict] | None = None


def published_entry(key: str) -> dict:
    """The raw published entry ``key`` (e.g. ``'h100_sxm.hbm_bandwidth'``)."""
    global _PUBLISHED
    if _PUBLISHED is None:
        _PUBLISHED = published_entries()
    if key not in _PUBLISHED:
        near = [k for k in _PUBLISHED if k.split(".")[0] == key.split(".")[0]]
        raise KeyError(f"no published figure {key!r}"
                       + (f"; that subject has: {', '.join(sorted(near))}" if near
                          else ""))
    return _PUBLISHED[key]


def cite(entry: dict) -> str:
    """``'NVIDIA H100 Tensor Core GPU Datasheet, NVIDIA, 2023'``."""
    src = entry["source"]
    year = f", {src['year']}" if src.get("year") else ""
    where = re.sub(r",?\s*https?://\S+", "", src["where"]).strip(" ,")
    return f"{src['title']}, {where}{year}" if where else f"{src['title']}{year}"


def published(key: str) -> Figure:
    """The published figure ``key`` as a ``Figure``, labelled with its source."""
    e = published_entry(key)
    return Figure("published", e["value"], e["unit"], e["gpu"], cite(e),
                  measures=e["measures"], extra=e)


# --- predicted and measured --------------------------------------------------------


def predicted(value, unit: str, gpu: str, model: str,
              inputs: list[str] | str = (), caveat: str = "") -> Figure:
    """A prediction for ``gpu``: the model's formula and its inputs' sources.

    ``inputs`` are published ids (their sources are cited) or plain text;
    ``caveat`` (one line) names what of the model no calibration pair checks.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    cited = []
    for item in inputs:
        try:
            e = published_entry(item)
            cited.append(f"{e['quantity'] if 'quantity' in e else item} "
                         f"{e['value']} {e['unit']} from {cite(e)}")
        except KeyError:
            cited.append(item)
    source = f"model: {model}" + (f"; inputs: {'; '.join(cited)}" if cited else "")
    return Figure("predicted", value, unit, gpu, source, measures=model,
                  caveat=caveat)


def device_name(device: torch.device | str) -> str:
    """``'CPU (2 cores)'`` or the GPU's name, for labels."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from course_utils.devices import usable_cores

        return f"this CPU ({usable_cores()} cores)"
    return str(device)


def measured(value, unit: str, device: torch.device | str = "cpu",
             what: str = "") -> Figure:
    """A figure measured by this run, on ``device``."""
    return Figure("measured", value, unit, device_name(device), what)


# --- showing --------------------------------------------------------------------------


def show(
    name: str,
    local=None,
    unit: str = "",
    local_device: torch.device | str = "cpu",
    figures=(),
    fmt: str = "{:.4g}",
) -> list[Figure]:
    """Print this run's figure and every GPU figure for ``name``, labelled by kind.

    ``local`` is the value measured here (on ``local_device``); ``figures`` are
    published or predicted ``Figure`` objects for the same experiment. Recorded
    figures are looked up by ``name`` and come first (a recording made by this
    very run is not repeated). Returns ``[measured, *recorded, *figures]``.

    Raises ``ValueError`` when there would be no GPU figure at all: a learner
    without a GPU must always see one, published or predicted.
    """
    here = torch.device(local_device)
    shown: list[Figure] = []
    if local is not None:
        shown.append(measured(local, unit, here))
    this_gpu = device_name(here) if here.type == "cuda" else None
    rec = [f for f in recorded(name)
           if not (recording() and f.device == this_gpu)]
    others = sorted(figures, key=lambda f: KINDS.index(f.kind))
    for f in others:
        if not isinstance(f, Figure) or f.kind not in ("published", "predicted"):
            raise ValueError(f"{name}: figures= takes published or predicted "
                             f"Figure objects, not {f!r:.80}")
    gpu_here = local is not None and here.type == "cuda"
    if not rec and not others and not gpu_here:
        raise ValueError(f"{name}: no GPU figure to show; pass a published or "
                         "predicted figure in figures=")
    shown += rec + others
    for f in shown:
        u = f.unit or unit
        print(f"{name}: {f.format_value(fmt)} {u}".rstrip() + f"  [{f.label}]")
    return shown
