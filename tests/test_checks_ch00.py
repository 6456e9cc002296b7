"""Chapter 0's checkers accept varied correct answers and name typical mistakes."""

import pytest
import torch

from course_utils.checks.ch00 import check_memory_held, check_run_on
from course_utils.exercises import ExerciseFailed


def run_on_in_place(model, batch, device):
    model.to(device)
    return model(batch.to(device))


def run_on_reassign(model, batch, device):
    model = model.to(device)
    batch = batch.to(device)
    out = model(batch)
    return out


@pytest.mark.parametrize("solution", [run_on_in_place, run_on_reassign])
def test_run_on_accepts_correct(solution, capsys):
    check_run_on(solution)
    assert "passed" in capsys.readouterr().out


def run_on_batch_not_assigned(model, batch, device):
    model.to(device)
    batch.to(device)  # the result is thrown away
    return model(batch)


def run_on_ignores_device(model, batch, device):
    return model(batch)


def run_on_hard_coded_cuda(model, batch, device):
    model.to("cuda")
    return model(batch.to("cuda"))


def run_on_returns_cpu(model, batch, device):
    model.to(device)
    return model(batch.to(device)).cpu()


@pytest.mark.parametrize(
    "mistake, words",
    [
        (run_on_batch_not_assigned, "returns a NEW tensor"),
        (run_on_ignores_device, "meta"),
        (
            run_on_hard_coded_cuda,
            "hard-coded" if not torch.cuda.is_available() else "meta",
        ),
        (run_on_returns_cpu, "leave the output on the device"),
    ],
)
def test_run_on_names_the_mistake(mistake, words):
    with pytest.raises(ExerciseFailed) as info:
        check_run_on(mistake)
    assert words in str(info.value)


def held_by_storage(tensors):
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def held_by_base(tensors):
    bases = {}
    for t in tensors:
        base = t._base if t._base is not None else t
        bases[id(base)] = base.numel() * base.element_size()
    return sum(bases.values())


@pytest.mark.parametrize("solution", [held_by_storage, held_by_base])
def test_memory_held_accepts_correct(solution):
    check_memory_held(solution)


@pytest.mark.parametrize(
    "mistake, words",
    [
        (lambda ts: sum(t.numel() * 4 for t in ts), "not every tensor is float32"),
        (lambda ts: sum(t.numel() * t.element_size() for t in ts), "shares its base"),
        (
            lambda ts: sum(t.untyped_storage().nbytes() for t in ts),
            "count each storage",
        ),
        (lambda ts: str(len(ts)), "memory_held's result"),
    ],
)
def test_memory_held_names_the_mistake(mistake, words):
    with pytest.raises(ExerciseFailed) as info:
        check_memory_held(mistake)
    assert words in str(info.value)
