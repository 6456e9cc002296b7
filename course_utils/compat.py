"""The torch versions the course supports, and the code that depends on them.

    python course_utils/compat.py requirements requirements.txt   # what to install
    python course_utils/compat.py requirements --keep-installed requirements.txt
    python course_utils/compat.py check                           # torch in range?

The course runs on every torch in ``SUPPORTED`` (declared in pyproject.toml;
CI and a fresh environment use the exact pin of requirements.txt). A torch
already installed inside that range is kept: ``requirements`` prints the pins
with torch's line left out, and ``make lab`` / ``make test`` install those.
With ``--keep-installed`` it also leaves out every package already installed
at any version, and JupyterLab (a notebook service brings its own interface).

Run it as a script (as above), not with ``-m``: the package's ``__init__``
imports torch, which a fresh environment does not have yet. Everything below
the command line imports torch only when called.

The rest are the names whose home depends on the version: private modules
(the memory trackers, the fake process group, the autograd collectives),
``context_parallel``'s module path and the newer pipelining schedules. Import
them from here (``from course_utils.compat import MemTracker``); each is looked
up on first use in the places listed in ``MOVED``, first found wins.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
from importlib import metadata

SUPPORTED = ">=2.11,<2.15"  # the same string as pyproject.toml's dependency
OLDEST, NEWEST = "2.11.0", "2.14.1"  # the versions the whole suite ran on


def parse(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: release numbers only."""
    release = re.match(r"\d+(?:\.\d+)*", version.strip())
    if not release:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in release.group().split("."))


def _bounds(spec: str = SUPPORTED) -> tuple[tuple[int, ...], tuple[int, ...]]:
    low = re.search(r">=\s*([\d.]+)", spec)
    high = re.search(r"<\s*([\d.]+)", spec)
    if not (low and high):
        raise ValueError(f"expected '>=A,<B', got {spec!r}")
    return parse(low.group(1)), parse(high.group(1))


def in_range(version: str, spec: str = SUPPORTED) -> bool:
    """Is this torch version inside the supported range?"""
    low, high = _bounds(spec)
    v = parse(version)
    return low <= v < high


def installed_version(dist: str = "torch") -> str | None:
    """The installed distribution's version, without importing it."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement line."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    return re.sub(r"[-_.]+", "-", name.group()).lower() if name else ""


def requirements(lines: list[str], torch_version: str | None,
                 installed: set[str] | None = None) -> tuple[list[str], list[str]]:
    """The requirement lines to install, and one note per line left out.

    ``torch_version`` is the torch already installed (None: none). It is kept,
    and torch's pin left out, when it is inside ``SUPPORTED``. ``installed``
    (normalised names) keeps every package already there at any version, and
    leaves JupyterLab out, for a notebook service.
    """
    keep, notes = [], []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = _name(line)
        if name == "torch" and torch_version is not None:
            if in_range(torch_version):
                notes.append(f"keeping torch {torch_version} (supported: "
                             f"{SUPPORTED}); not installing {line}")
                continue
            notes.append(f"torch {torch_version} is outside {SUPPORTED}: "
                         f"installing {line} in its place")
        elif installed is not None and name in installed:
            notes.append(f"keeping what is installed: not installing {line}")
            continue
        elif installed is not None and name == "jupyterlab":
            notes.append(f"the service has its own notebooks: not installing {line}")
            continue
        keep.append(line)
    return keep, notes


def _installed_names() -> set[str]:
    return {_name(d.metadata["Name"] or "") for d in metadata.distributions()}


# --- names that moved -----------------------------------------------------------

_PIPELINING = ("torch.distributed.pipelining", "torch.distributed.pipelining.schedules")
_CP = ("torch.distributed.tensor.experimental",
       "torch.distributed.tensor.experimental._context_parallel",
       "torch.distributed.tensor.experimental._attention",
       "torch.distributed.tensor.experimental._context_parallel._attention")
_FC = "torch.distributed._functional_collectives"

# name -> the (module, attribute) places it has lived in, newest first
MOVED: dict[str, tuple[tuple[str, str], ...]] = {
    "MemTracker": (("torch.distributed._tools.mem_tracker", "MemTracker"),),
    "FSDPMemTracker": (("torch.distributed._tools.fsdp2_mem_tracker",
                        "FSDPMemTracker"),),
    # importing fake_pg also registers the "fake" process-group backend
    "FakeStore": (("torch.testing._internal.distributed.fake_pg", "FakeStore"),),
    "context_parallel": tuple((m, "context_parallel") for m in _CP),
    "context_parallel_unshard": tuple((m, "context_parallel_unshard")
                                      for m in _CP[1:]),
    "set_rotate_method": tuple((m, "set_rotate_method") for m in _CP[1:]),
    # torch 2.11 has only all_gather_tensor_autograd (see _all_gather_autograd)
    "all_gather_single_autograd": ((_FC, "all_gather_single_autograd"),
                                   (__name__, "_all_gather_autograd")),
    "all_to_all_single_autograd": ((_FC, "all_to_all_single_autograd"),),
    "_cp_options": ((_CP[3], "_cp_options"),),
    "_create_default_load_balancer": (
        (_CP[1] + "._load_balancer", "_create_default_load_balancer"),),
    "OVERLAP_F_B": ((_PIPELINING[1], "OVERLAP_F_B"),),
    **{name: tuple((m, name) for m in _PIPELINING)
       for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                    "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
                    "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS")},
}


def _all_gather_autograd(tensor, gather_dim: int, group, tag: str = ""):
    """``all_gather_single_autograd`` for torch 2.11, from its older function.

    2.11's ``all_gather_tensor_autograd`` takes the same arguments, but its
    backward (a reduce-scatter) refuses the non-contiguous gradient that a
    gather along any dimension but the first receives: gather along the first
    and give the backward a contiguous gradient.
    """
    import torch
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    class ContiguousGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad.contiguous()

    first = tensor.movedim(gather_dim, 0).contiguous()
    gathered = all_gather_tensor_autograd(first, 0, group, tag)
    return ContiguousGrad.apply(gathered).movedim(0, gather_dim)


def checkpoint_generator() -> str:
    """The name of the generator behind non-reentrant ``torch.utils.checkpoint``.

    ``checkpoint(..., use_reentrant=False)`` calls it by this module-level
    name, so a checker that patches it sees the learner use checkpoint:
    ``_checkpoint_without_reentrant_generator`` up to torch 2.13,
    ``..._impl`` from 2.14 (the old name is kept, but no longer called).
    """
    import torch.utils.checkpoint as cp

    new = "_checkpoint_without_reentrant_generator_impl"
    return new if hasattr(cp, new) else "_checkpoint_without_reentrant_generator"


def find(name: str):
    """The object ``name`` names in this torch, from the first place that has it."""
    if name not in MOVED:
        raise AttributeError(f"course_utils.compat has no {name!r}")
    tried = []
    for module, attribute in MOVED[name]:
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as e:
            tried.append(f"{module}.{attribute} ({type(e).__name__})")
    raise ImportError(f"{name} not found in torch {installed_version()}; tried "
                      + ", ".join(tried) + f". The course supports torch {SUPPORTED}")


def __getattr__(name: str):  # ``from course_utils.compat import MemTracker``
    if name in MOVED:
        return find(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- names newer torch has, given to an older supported one -------------------------


def backport() -> list[str]:
    """Give an older supported torch the newer names the chapters use; which.

    torch 2.13 added ``dist.all_gather_single`` and ``dist.reduce_scatter_single``
    (``all_gather_into_tensor`` and ``reduce_scatter_tensor`` under new names,
    same arguments) and DDP's ``forward_sync_buffers`` (which replaces
    ``broadcast_buffers`` for the buffers synchronised at each forward). On
    torch 2.11 and 2.12 the old names stand in, so every chapter runs as
    written. ``course_utils`` calls this on import, so ranks get it too; it
    changes nothing on a torch that has the names.
    """
    import inspect

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    added = []
    for new, old in (("all_gather_single", "all_gather_into_tensor"),
                     ("reduce_scatter_single", "reduce_scatter_tensor")):
        if not hasattr(dist, new) and hasattr(dist, old):
            setattr(dist, new, getattr(dist, old))
            added.append(f"torch.distributed.{new}")
    init = DDP.__init__
    if "forward_sync_buffers" not in inspect.signature(
            init, follow_wrapped=False).parameters:
        def __init__(self, *args, forward_sync_buffers=None, **kwargs):
            if forward_sync_buffers is not None:
                kwargs.setdefault("broadcast_buffers", forward_sync_buffers)
            init(self, *args, **kwargs)

        __init__.__wrapped__ = init
        DDP.__init__ = __init__
        added.append("DistributedDataParallel(forward_sync_buffers=...)")
    added += _empty_attention()
    return added


def _empty_attention() -> list[str]:
    """torch 2.11's CPU attention kernel divides by the number of heads: given
    none (a rank whose share of the heads came out 0), the process dies of
    SIGFPE. torch 2.13 returns the empty result; so does this wrapper."""
    import torch
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    if parse(torch.__version__) >= (2, 13) or getattr(sdpa, "_empty_safe", False):
        return []

    @functools.wraps(sdpa)
    def scaled_dot_product_attention(query, key, value, *args, **kwargs):
        if query.numel() == 0:
            shape = (*query.shape[:-1], value.shape[-1])
            # zeros joined to the inputs, so that backward reaches them as before
            return query.new_zeros(shape) + 0 * (query.sum() + key.sum() + value.sum())
        return sdpa(query, key, value, *args, **kwargs)

    scaled_dot_product_attention._empty_safe = True
    F.scaled_dot_product_attention = scaled_dot_product_attention
    return ["F.scaled_dot_product_attention of no heads"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python course_utils/compat.py",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    req = sub.add_parser("requirements",
                         help="print the pins to install in this Python")
    req.add_argument("file", nargs="?", default="requirements.txt")
    req.add_argument("--keep-installed", action="store_true",
                     help="also keep every package already installed")
    sub.add_parser("check", help="exit 1 unless this Python's torch is supported")
    args = parser.parse_args(argv)
    torch_version = installed_version("torch")
    if args.command == "check":
        ok = torch_version is not None and in_range(torch_version)
        print(f"torch {torch_version or '(none)'}: "
              f"{'supported' if ok else 'NOT in ' + SUPPORTED}")
        return 0 if ok else 1
    with open(args.file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    installed = _installed_names() if args.keep_installed else None
    keep, notes = requirements(lines, torch_version, installed)
    for note in notes:
        print(note, file=sys.stderr)
    print("\n".join(keep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
