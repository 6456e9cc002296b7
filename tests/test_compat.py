"""course_utils.compat: the supported torch range, kept torches, moved names."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_utils import compat

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = (ROOT / "requirements.txt").read_text().splitlines()


def test_the_range_is_declared_once_and_holds_the_pin():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'dependencies = ["torch{compat.SUPPORTED}"]' in pyproject
    pin = next(ln for ln in REQUIREMENTS if ln.startswith("torch=="))
    for version in (pin.split("==")[1], compat.OLDEST, compat.NEWEST):
        assert compat.in_range(version)
    assert compat.in_range(torch.__version__)  # the torch this suite runs on


@pytest.mark.parametrize("version, inside", [
    ("2.11.0", True), ("2.11.0+cu130", True), ("2.13.0+cpu", True),
    ("2.14.1", True), ("2.14.9", True), ("2.10.2", False), ("2.15.0", False),
    ("2.15.0.dev20260101", False), ("3.0", False), ("2.11", True),
])
def test_in_range(version, inside):
    assert compat.in_range(version) is inside


def test_parse_rejects_what_is_not_a_version():
    with pytest.raises(ValueError):
        compat.parse("latest")


def names(lines):
    return [re.split("[=<>]", ln)[0] for ln in lines]


def test_a_torch_inside_the_range_is_kept():
    keep, notes = compat.requirements(REQUIREMENTS, "2.11.0+cu130")
    assert "torch" not in names(keep)
    assert "numpy" in names(keep) and "jupyterlab" in names(keep)
    assert any("keeping torch 2.11.0+cu130" in n for n in notes)
    assert all("#" not in ln and ln.strip() for ln in keep)


@pytest.mark.parametrize("installed", [None, "2.10.0", "2.15.1"])
def test_no_torch_or_one_outside_the_range_gets_the_pin(installed):
    keep, notes = compat.requirements(REQUIREMENTS, installed)
    assert "torch==2.13.0" in keep
    assert bool(notes) is (installed is not None)


def test_keep_installed_installs_only_what_is_missing():
    keep, _ = compat.requirements(REQUIREMENTS, "2.12.0",
                                  installed={"numpy", "matplotlib", "ipykernel"})
    got = names(keep)
    assert not {"torch", "numpy", "matplotlib", "ipykernel", "jupyterlab"} & set(got)
    assert "nbval" in got and "cloudpickle" in got


def test_the_script_runs_without_importing_torch(tmp_path):
    """make setup runs it in a fresh venv: no torch, no course_utils package."""
    script = str(ROOT / "course_utils" / "compat.py")
    code = ("import sys, runpy; sys.modules['torch'] = None; "
            "sys.argv = ['compat.py', 'requirements', sys.argv[1]]; "
            f"runpy.run_path({script!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code,
                           str(ROOT / "requirements.txt")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "numpy==" in proc.stdout
    check = subprocess.run([sys.executable, str(ROOT / "course_utils" / "compat.py"),
                            "check"], capture_output=True, text=True)
    assert check.returncode == 0 and "supported" in check.stdout


def test_the_makefile_installs_through_the_filter():
    make = (ROOT / "Makefile").read_text()
    setup = make[make.index("$(STAMP):"):make.index("ROOT_FLAG")]
    assert "course_utils/compat.py requirements requirements.txt" in setup
    assert "-r requirements.txt" not in setup


@pytest.mark.parametrize("name", sorted(compat.MOVED))
def test_every_moved_name_is_found_in_this_torch(name):
    assert compat.find(name) is not None


def test_moved_names_import_from_the_module():
    from course_utils.compat import FakeStore, MemTracker, context_parallel

    assert MemTracker.__name__ == "MemTracker" and callable(context_parallel)
    assert FakeStore.__name__ == "FakeStore"
    with pytest.raises(ImportError):
        from course_utils.compat import NoSuchThing  # noqa: F401


def test_a_name_found_nowhere_says_what_was_tried(monkeypatch):
    monkeypatch.setitem(compat.MOVED, "Gone", (("torch.no_such_module", "Gone"),
                                               ("torch", "NoSuchName")))
    with pytest.raises(ImportError, match=r"torch.no_such_module.Gone.*"
                                          r"torch.NoSuchName.*supports torch"):
        compat.find("Gone")


def test_the_older_all_gather_is_the_fallback(monkeypatch):
    fc = pytest.importorskip("torch.distributed._functional_collectives")
    monkeypatch.delattr(fc, "all_gather_single_autograd", raising=False)
    assert compat.find("all_gather_single_autograd") is compat._all_gather_autograd


def _gather_and_backward(rank, world_size):
    import torch
    import torch.distributed as dist

    from course_utils import compat

    x = (torch.arange(12.0).reshape(1, 2, 6) + 100 * rank).requires_grad_()
    out = compat._all_gather_autograd(x, 2, dist.group.WORLD)
    (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad


def test_the_fallback_gathers_along_any_dimension_and_back(monkeypatch):
    from course_utils.dist import launch

    results = launch(_gather_and_backward, 2, echo=False)
    x = [torch.arange(12.0).reshape(1, 2, 6) + 100 * r for r in range(2)]
    weights = torch.arange(24.0).reshape(1, 2, 12)
    for r, result in enumerate(results):
        out, grad = result.value
        assert torch.equal(out, torch.cat(x, dim=2))
        # every rank's loss weights its copy the same: the gradient is their sum
        assert torch.equal(grad, 2 * weights[..., 6 * r:6 * (r + 1)])


def test_backport_gives_older_torch_the_newer_names(monkeypatch):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    compat.backport()  # as on import: once given, nothing is added again
    assert compat.backport() == []
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    seen = {}

    def old_init(self, module, broadcast_buffers=True):
        seen["broadcast_buffers"] = broadcast_buffers

    monkeypatch.setattr(DDP, "__init__", old_init)
    added = compat.backport()
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor
    assert dist.all_gather_single is dist.all_gather_into_tensor
    assert len(added) == 3
    DDP.__init__(object(), None, forward_sync_buffers=False)
    assert seen == {"broadcast_buffers": False}
    DDP.__init__(object(), None)
    assert seen == {"broadcast_buffers": True}


def test_the_checkpoint_generator_is_the_one_checkpoint_calls(monkeypatch):
    import torch.utils.checkpoint as cp

    name = compat.checkpoint_generator()
    calls = []
    real = getattr(cp, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cp, name, spy)
    x = torch.ones(3, requires_grad=True)
    cp.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    assert calls


def test_attention_over_no_heads_returns_nothing_on_every_supported_torch():
    # torch 2.11's CPU kernel divided by the head count and died of SIGFPE;
    # importing course_utils makes it return the empty result, as 2.13 does
    import torch.nn.functional as F

    import course_utils  # noqa: F401

    q = torch.randn(2, 0, 5, 4, requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.shape == (2, 0, 5, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)  # the rest as before
    want = torch.softmax(x @ x.transpose(-1, -2) / 2, -1) @ x
    assert torch.allclose(F.scaled_dot_product_attention(x, x, x), want)
