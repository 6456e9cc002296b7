import cloudpickle
import pytest
import torch

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)


def pytest_collection_modifyitems(session, config, items):
    """Test modules' functions reach the ranks by value, as a notebook's do.

    By reference, every rank would import the test module, and with it pytest,
    before running a line: seconds on a busy machine.
    """
    for module in {item.module for item in items if getattr(item, "module", None)}:
        cloudpickle.register_pickle_by_value(module)


def machine_s(seconds: float) -> float:
    """A test's time bound: ``seconds`` on the machine the course's reference
    times were recorded on, stretched by how much slower this one runs now
    (``exercises.slowdown``), never shortened."""
    from course_utils.exercises import slowdown

    return seconds * max(1.0, slowdown())
