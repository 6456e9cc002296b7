"""Chapter 0's checkers accept varied correct answers and name typical mistakes."""

import copy
import time

import pytest
import torch
from torch import nn
from torch.func import functional_call

from course_utils.checks.ch00 import check_add_ramp, check_memory_held, check_run_on
from course_utils.exercises import ExerciseFailed


def failure(check, answer) -> str:
    with pytest.raises(ExerciseFailed) as info:
        check(answer)
    return info.value.message()


# 0.1 -----------------------------------------------------------------------

def run_on_in_place(model, batch, device):
    model.to(device)
    return model(batch.to(device))


def run_on_reassign(model, batch, device):
    model = model.to(device)
    batch = batch.to(device)
    out = model(batch)
    return out


def run_on_no_grad(model, batch, device):
    with torch.no_grad():
        return model.to(device=device)(batch.to(device=device))


def run_on_apply(model, batch, device):
    model.apply(lambda m: m.to(device))  # every submodule, each in place
    return model.forward(torch.as_tensor(batch, device=device))


class RunOn:  # a callable object instead of a function
    def __call__(self, model, batch, device):
        moved = batch.to(device, non_blocking=True)
        return model.to(device)(moved)


@pytest.mark.parametrize(
    "solution", [run_on_in_place, run_on_reassign, run_on_no_grad, run_on_apply,
                 RunOn()])
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


def run_on_moves_output_only(model, batch, device):
    return model(batch).to(device)  # computed on the CPU, the model never moved


def run_on_moves_a_copy(model, batch, device):
    return copy.deepcopy(model).to(device)(batch.to(device))


def run_on_parameters_only(model, batch, device):
    for module in model.modules():  # the BatchNorm buffers stay behind
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(p.detach().to(device)))
    return model(batch.to(device))


def run_on_functional_call(model, batch, device):
    params = {k: v.to(device) for k, v in model.state_dict().items()}
    return functional_call(model, params, (batch.to(device),))


def run_on_moves_the_batch_in_place(model, batch, device):
    model.to(device)
    if device.type != "meta":
        batch.mul_(1.0001)  # "normalises" the caller's batch
    return model(batch.to(device))


def run_on_float32(model, batch, device):  # forces float32 on the way
    return model.to(device, torch.float32)(batch.to(device, torch.float32))


_FIRST = {}


def run_on_remembers(model, batch, device):  # the first output, kept per device
    model.to(device)
    key = (str(device), id(model))
    if key not in _FIRST:
        _FIRST[key] = model(batch.to(device))
    return _FIRST[key]


@pytest.mark.parametrize(
    "mistake, words",
    [
        (run_on_float32, "float64 output"),
        (run_on_remembers, "second call"),
        (run_on_batch_not_assigned, "returns a NEW tensor"),
        (run_on_ignores_device, "run the model on the device"),
        (run_on_hard_coded_cuda,
         "hard-coded" if not torch.cuda.is_available() else "meta"),
        (run_on_returns_cpu, "leave the output on the device"),
        (run_on_moves_output_only, "the model you were given is still where it was"),
        (run_on_moves_a_copy, "moving a copy"),
        (run_on_parameters_only, "buffers"),
        (run_on_functional_call, "still where it was"),
        (run_on_moves_the_batch_in_place, "batch unchanged"),
        (lambda m, b, d: "done", "return value"),
    ],
)
def test_run_on_names_the_mistake(mistake, words):
    assert words in failure(check_run_on, mistake)


# 0.2 -----------------------------------------------------------------------

def held_by_storage(tensors):
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def held_by_base(tensors):
    bases = {}
    for t in tensors:
        base = t._base if t._base is not None else t
        bases[base.untyped_storage().data_ptr()] = base.untyped_storage().nbytes()
    return sum(bases.values())


def held_by_pairs(tensors):
    pairs = {(t.untyped_storage().data_ptr(), len(t.untyped_storage()))
             for t in tensors}
    return torch.tensor(sum(n for _, n in pairs))  # a 0-d tensor is fine


def held_by_offset_arithmetic(tensors):
    total, starts = 0, set()
    for t in tensors:
        start = t.data_ptr() - t.storage_offset() * t.element_size()
        if start not in starts:
            starts.add(start)
            total += t.untyped_storage().nbytes()
    return total


def held_by_storage_id(tensors):
    # torch keeps one Python object per storage, so `is` and id() identify it
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes()
                for t in tensors}.values())


@pytest.mark.parametrize(
    "solution", [held_by_storage, held_by_base, held_by_pairs,
                 held_by_offset_arithmetic, held_by_storage_id])
def test_memory_held_accepts_correct(solution):
    check_memory_held(solution)


def held_by_tensor_ptr(tensors):
    return sum({t.data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def held_by_size(tensors):
    return sum({t.untyped_storage().nbytes() for t in tensors})


@pytest.mark.parametrize(
    "mistake, words",
    [
        (lambda ts: sum(t.numel() * 4 for t in ts), "not every tensor is float32"),
        (lambda ts: sum(t.numel() * t.element_size() for t in ts), "shares its base"),
        (lambda ts: sum(t.untyped_storage().nbytes() for t in ts),
         "count each storage"),
        (held_by_tensor_ptr, "offset"),
        (held_by_size, "same size are two storages"),
        (lambda ts: sum({id(t): t.untyped_storage().nbytes() for t in ts}.values()),
         "shares its base"),
        (lambda ts: str(len(ts)), "memory_held's result"),
        (lambda ts: max(t.untyped_storage().nbytes() for t in ts), "bytes"),
        (lambda ts: ts[0].untyped_storage().nbytes(), "not only the first"),
        (lambda ts: torch.tensor([t.untyped_storage().nbytes() for t in ts]),
         "one number"),
    ],
)
def test_memory_held_names_the_mistake(mistake, words):
    assert words in failure(check_memory_held, mistake)


# 0.3 -----------------------------------------------------------------------

class RampBuffer(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("r", torch.arange(n) / n, persistent=False)

    def forward(self, x):
        return x + self.r


class RampInForward(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x + torch.arange(self.n, device=x.device, dtype=x.dtype) / self.n


class RampNewTensor(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.values = [j / n for j in range(n)]

    def forward(self, x):
        return torch.add(x, x.new_tensor(self.values))


class RampLinspace(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("ramp", torch.linspace(0, (n - 1) / n, n,
                                                    dtype=torch.float64))

    def forward(self, x):
        return x + self.ramp.to(x)  # .to(x): x's dtype and device


def ramp_factory(n):  # a function returning a module is fine too
    class Ramp(nn.Module):
        def forward(self, x):
            return x + torch.arange(n).to(x) / n
    return Ramp()


@pytest.mark.parametrize(
    "solution", [RampBuffer, RampInForward, RampNewTensor, RampLinspace, ramp_factory])
def test_add_ramp_accepts_correct(solution, capsys):
    check_add_ramp(solution)
    assert "passed" in capsys.readouterr().out


class RampPlainAttribute(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ramp = torch.arange(n) / n  # not moved by .to()

    def forward(self, x):
        return x + self.ramp


class RampOnCPU(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x + torch.arange(self.n) / self.n


class RampNoDtype(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x + torch.arange(self.n, device=x.device) / self.n  # float32


class RampParameter(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ramp = nn.Parameter(torch.arange(n) / n)

    def forward(self, x):
        return x + self.ramp


class RampInPlace(RampBuffer):
    def forward(self, x):
        x += self.r
        return x


class RampLinspace01(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("r", torch.linspace(0, 1, n))

    def forward(self, x):
        return x + self.r


class RampFirstDim(RampBuffer):
    def forward(self, x):
        shape = (-1,) + (1,) * (x.dim() - 1)
        return x + self.r[: x.shape[0]].reshape(shape)


class RampNotDivided(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("r", torch.arange(n, dtype=torch.float32))

    def forward(self, x):
        return x + self.r


class RampFromOne(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("r", torch.arange(1, n + 1) / n)

    def forward(self, x):
        return x + self.r


class RampCuda(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x + (torch.arange(self.n, device="cuda") / self.n).to(x.dtype)


class RampBackToCPU(RampBuffer):
    def forward(self, x):
        return (x + self.r).cpu()


@pytest.mark.parametrize(
    "mistake, words",
    [
        (RampPlainAttribute, "plain attribute"),
        (RampOnCPU, "ramp stayed on the CPU"),
        (RampNoDtype, "x's dtype"),
        (RampParameter, "no trainable parameter"),
        (RampInPlace, "in place"),
        (RampLinspace01, "not 1"),
        (RampFirstDim, "LAST dimension"),
        (RampNotDivided, "divide by n"),
        (RampFromOne, "r[0] = 0"),
        (RampCuda, "hard-coded 'cuda'" if not torch.cuda.is_available() else "meta"),
        (RampBackToCPU, "leave the output where x is"),
        (lambda n: (lambda x: x + torch.arange(n) / n), "AddRamp(5) to be a Module"),
    ],
)
def test_add_ramp_names_the_mistake(mistake, words):
    assert words in failure(check_add_ramp, mistake)


def test_a_learner_that_never_returns_is_stopped(monkeypatch):
    from course_utils.checks import ch00

    monkeypatch.setattr(ch00, "TIMEOUT_S", 0.5)

    def run_on_forever(model, batch, device):  # as good as for ever, here
        time.sleep(3)

    assert "within" in failure(check_run_on, run_on_forever)
