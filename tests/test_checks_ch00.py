"""Chapter 0's checkers accept varied correct answers and name typical mistakes."""

import copy
import time

import pytest
import torch
from torch import nn

from course_utils.checks.ch00 import check_add_ramp, check_memory_held, check_move_batch
from course_utils.exercises import ExerciseFailed


def failure(check, answer) -> str:
    with pytest.raises(ExerciseFailed) as info:
        check(answer)
    return info.value.message()


# 0.1 -----------------------------------------------------------------------

def move_match(batch, device):  # structural pattern matching
    match batch:
        case torch.Tensor() | nn.Module():
            return batch.to(device)
        case dict():
            return {k: move_match(v, device) for k, v in batch.items()}
        case tuple() if hasattr(batch, "_make"):
            return batch._make(move_match(v, device) for v in batch)
        case list() | tuple():
            return type(batch)([move_match(v, device) for v in batch])
        case _:
            return batch


def move_with_pytree(batch, device):  # torch's own tree utilities
    from torch.utils import _pytree as pytree

    if isinstance(batch, nn.Module):
        return batch.to(device)
    return pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


class Mover:  # a class, with a dispatch table and non_blocking copies
    def __call__(self, batch, device):
        self.device = device
        return self.move(batch)

    def move(self, x):
        if isinstance(x, torch.Tensor):
            return x.to(self.device, non_blocking=True)
        if isinstance(x, nn.Module):
            x.to(self.device)
            return x
        if isinstance(x, dict):
            return type(x)((k, self.move(v)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(**{f: self.move(v) for f, v in zip(x._fields, x,
                                                              strict=True)})
        if isinstance(x, (list, tuple)):
            return type(x)(map(self.move, x))
        return x


def move_iterative(batch, device):  # copies first, then replaces, no recursion
    if isinstance(batch, (torch.Tensor, nn.Module)):
        return batch.to(device)
    import copy as copy_module

    out = copy_module.copy(batch)
    stack = [(out, None, None)]
    fixed = []
    while stack:
        obj, parent, key = stack.pop()
        if isinstance(obj, torch.Tensor):
            fixed.append((parent, key, obj.to(device)))
        elif isinstance(obj, dict):
            new = dict(obj)
            fixed.append((parent, key, new))
            stack += [(v, new, k) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            new = list(obj)
            fixed.append((parent, key, (type(obj), new)))
            stack += [(v, new, i) for i, v in enumerate(obj)]
    # rebuild from the leaves up
    for parent, key, value in reversed(fixed):
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
            kind, items = value
            value = (kind(*items) if hasattr(kind, "_fields") else kind(items))
        if parent is None:
            out = value
        else:
            parent[key] = value
    return out


move_alias = Mover()


@pytest.mark.parametrize(
    "solution", [move_match, move_with_pytree, Mover(), move_iterative, move_alias])
def test_move_batch_accepts_correct(solution, capsys):
    check_move_batch(solution)
    assert "passed" in capsys.readouterr().out


def move_top_level_only(batch, device):  # no recursion
    if isinstance(batch, dict):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}
    return batch.to(device) if hasattr(batch, "to") else batch


def move_lists_only(batch, device):  # every sequence becomes a list
    if isinstance(batch, (torch.Tensor, nn.Module)):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_lists_only(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [move_lists_only(v, device) for v in batch]
    return batch


def move_breaks_namedtuple(batch, device):  # type(t)(generator) for a namedtuple
    if isinstance(batch, (torch.Tensor, nn.Module)):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_breaks_namedtuple(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_breaks_namedtuple(v, device) for v in batch)
    return batch


def move_walks_strings(batch, device):  # any iterable is a container
    if isinstance(batch, (torch.Tensor, nn.Module)):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_walks_strings(v, device) for k, v in batch.items()}
    if hasattr(batch, "_fields"):
        return type(batch)(*(move_walks_strings(v, device) for v in batch))
    if hasattr(batch, "__iter__"):
        return type(batch)(move_walks_strings(v, device) for v in batch) \
            if not isinstance(batch, str) else "".join(
                move_walks_strings(c, device) if len(c) > 1 else c.upper()
                for c in batch)
    return batch


def _move_floats(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, torch.float32)
    if isinstance(batch, dict):
        return {k: _move_floats(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_move_floats(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move_floats(v, device) for v in batch)
    return batch.to(device) if isinstance(batch, nn.Module) else batch


def _with(tensor_fn, module_fn=lambda m, d: m.to(d)):
    """A mover that is right except for what it does to a tensor or module."""
    def move(batch, device):
        if isinstance(batch, torch.Tensor):
            return tensor_fn(batch, device)
        if isinstance(batch, nn.Module):
            return module_fn(batch, device)
        if isinstance(batch, dict):
            return {k: move(v, device) for k, v in batch.items()}
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return type(batch)(*(move(v, device) for v in batch))
        if isinstance(batch, (list, tuple)):
            return type(batch)(move(v, device) for v in batch)
        return batch
    return move


def move_in_place(batch, device):  # writes the moved tensors into the caller's
    if isinstance(batch, dict):
        for k, v in batch.items():
            batch[k] = move_in_place(v, device)
        return batch
    if isinstance(batch, list):
        for i, v in enumerate(batch):
            batch[i] = move_in_place(v, device)
        return batch
    return move_match(batch, device)


def _params_only(m, device):  # new Parameter objects; the buffers stay behind
    for mod in m.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, nn.Parameter(p.detach().to(device)))
    return m


move_ignores_device = _with(lambda t, d: t)
move_hard_coded_cuda = _with(lambda t, d: t.cuda())
move_module_copy = _with(lambda t, d: t.to(d),
                         lambda m, d: copy.deepcopy(m).to(d))
move_module_params_only = _with(lambda t, d: t.to(d), _params_only)
move_to_numpy_and_back = _with(lambda t, d: torch.as_tensor(t.tolist(), device=d))


def move_drops_plain_values(batch, device):
    if isinstance(batch, dict):
        return {k: move_drops_plain_values(v, device) for k, v in batch.items()
                if isinstance(v, (torch.Tensor, dict, list, tuple))}
    return move_match(batch, device)


def move_sorted_keys(batch, device):  # keys sorted on the way
    if isinstance(batch, dict):
        return {k: move_sorted_keys(batch[k], device) for k in sorted(batch)}
    return move_match(batch, device)


@pytest.mark.parametrize(
    "mistake, words",
    [
        (move_top_level_only, "walk into dicts"),
        (move_lists_only, "rebuild each container with its own type"),
        (move_breaks_namedtuple, "a namedtuple takes its fields"),
        (move_walks_strings, "a string is a sequence too"),
        (_move_floats, "a dtype (or .float())"),
        (move_in_place, "the caller's"),
        (move_ignores_device, "to the device you are given"),
        (move_hard_coded_cuda,
         "hard-coded" if not torch.cuda.is_available() else "meta"),
        (move_module_copy, "not a copy"),
        (move_module_params_only, "buffers"),
        (move_to_numpy_and_back, "still torch.float64"),
        (move_drops_plain_values, "keep every key"),
        (move_sorted_keys, "keep every key, in order"),
        (lambda b, d: None, "the batch itself"),
    ],
)
def test_move_batch_names_the_mistake(mistake, words):
    assert words in failure(check_move_batch, mistake)


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

    monkeypatch.setattr(ch00, "answer_limit", lambda *a, **k: 0.5)

    def move_forever(batch, device):  # as good as for ever, here
        time.sleep(3)

    assert "within" in failure(check_move_batch, move_forever)


# Answers written by an adversary: new right ones, and wrong ones that passed or
# crashed the checker before it was tightened.

def _mover(tensor_fn, module_fn=lambda m, d: m.to(d)):
    def move(b, d):
        if isinstance(b, nn.Module):
            return module_fn(b, d)
        if isinstance(b, torch.Tensor):
            return tensor_fn(b, d)
        if isinstance(b, dict):
            return {k: move(v, d) for k, v in b.items()}
        if isinstance(b, tuple) and hasattr(b, "_fields"):
            return type(b)(*[move(v, d) for v in b])
        if isinstance(b, (list, tuple)):
            return type(b)(move(v, d) for v in b)
        return b
    return move


def _move_numbers_too(b, d):  # turns Python numbers into tensors
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return torch.tensor(b, device=d)
    if isinstance(b, dict):
        return {k: _move_numbers_too(v, d) for k, v in b.items()}
    if isinstance(b, tuple) and hasattr(b, "_fields"):
        return type(b)(*[_move_numbers_too(v, d) for v in b])
    if isinstance(b, (list, tuple)):
        return type(b)(_move_numbers_too(v, d) for v in b)
    return b.to(d) if isinstance(b, (torch.Tensor, nn.Module)) else b


_CACHE: dict = {}


def _move_cached(b, d):  # remembers the first result for each batch
    if id(b) not in _CACHE:
        _CACHE[id(b)] = _mover(lambda t, dd: t.to(dd))(b, d)
    return _CACHE[id(b)]


def _move_lazy_lists(b, d):  # lists come back as lazy map objects
    if isinstance(b, (torch.Tensor, nn.Module)):
        return b.to(d)
    if isinstance(b, dict):
        return {k: _move_lazy_lists(v, d) for k, v in b.items()}
    if isinstance(b, tuple) and hasattr(b, "_fields"):
        return type(b)(*[_move_lazy_lists(v, d) for v in b])
    if isinstance(b, tuple):
        return tuple(_move_lazy_lists(v, d) for v in b)
    if isinstance(b, list):
        return map(lambda v: _move_lazy_lists(v, d), b)
    return b


@pytest.mark.parametrize("solution", [
    lambda b, d: b.to(d) if isinstance(b, nn.Module) else __import__(
        "torch.utils._pytree", fromlist=["x"]).tree_map_only(
        torch.Tensor, lambda t: t.to(d), b),
    _mover(lambda t, d: t.detach().to(device=d, copy=True)),
    _mover(lambda t, d: t.to(torch.device(str(d))).clone()),
    _mover(lambda t, d: t.to(d), lambda m, d: m._apply(lambda t: t.to(d))),
])
def test_move_batch_accepts_more_correct(solution, capsys):
    check_move_batch(solution)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, words", [
    (_mover(lambda t, d: t.to(d) if t.is_floating_point() else t),
     "integer and bool tensors"),
    (_mover(lambda t, d: torch.zeros_like(t, device=d)), "same values"),
    (_mover(lambda t, d: t.reshape(-1).to(d)), "of shape"),
    (_move_numbers_too, "do not turn it into a tensor"),
    (_move_cached, "on cpu" if not torch.cuda.is_available() else "on cuda"),
    (_move_lazy_lists, "a map"),
    (_mover(lambda t, d: t.to("meta")), "to the device you are given"),
])
def test_move_batch_names_more_mistakes(mistake, words):
    assert words in failure(check_move_batch, mistake)


def _held(ts):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in ts}.values())


_SEEN: set = set()


def _held_global(ts):  # storages seen in earlier calls count 0
    total = 0
    for t in ts:
        s = t.untyped_storage()
        if s.data_ptr() not in _SEEN:
            _SEEN.add(s.data_ptr())
            total += s.nbytes()
    return total


def _held_max_extent(ts):  # only up to the furthest element used
    ends: dict = {}
    for t in ts:
        k = t.untyped_storage().data_ptr()
        end = (t.storage_offset() + t.numel()) * t.element_size()
        ends[k] = max(ends.get(k, 0), end)
    return sum(ends.values())


@pytest.mark.parametrize("solution", [
    lambda ts: float(_held(ts)),
    lambda ts: sum({(t.data_ptr() - t.storage_offset() * t.element_size()):
                    t.untyped_storage().nbytes() for t in ts}.values()),
    lambda ts: torch.tensor([s.nbytes() for s in {
        t.untyped_storage().data_ptr(): t.untyped_storage() for t in ts}.values()],
        dtype=torch.float64).sum(),
])
def test_memory_held_accepts_more_correct(solution):
    check_memory_held(solution)


@pytest.mark.parametrize("mistake, words", [
    (lambda ts: _held(ts) / 1e6, "not kilobytes or megabytes"),
    (lambda ts: _held(ts) + 0.6, "whole number of bytes"),
    (_held_global, "count each storage once"),
    (_held_max_extent, "not numel x element size"),
    (lambda ts: sum(t.nbytes for t in ts), "shares its base"),
    (lambda ts: sum({t.untyped_storage().data_ptr(): t.numel() * t.element_size()
                     for t in ts}.values()), "3960 bytes"),
    (lambda ts: 4000, "bytes for"),
])
def test_memory_held_names_more_mistakes(mistake, words):
    assert words in failure(check_memory_held, mistake)


class _RampFloat64Buffer(nn.Module):  # float32 x comes back as float64
    def __init__(self, n):
        super().__init__()
        self.register_buffer("r", torch.arange(n, dtype=torch.float64) / n)

    def forward(self, x):
        return x + self.r


class _RampMadeOnFirstCall(nn.Module):  # kept as a plain attribute after call 1
    def __init__(self, n):
        super().__init__()
        self.n, self.r = n, None

    def forward(self, x):
        if self.r is None:
            self.r = torch.arange(self.n, device=x.device, dtype=x.dtype) / self.n
        return x + self.r


class _RampHalfBuffer(nn.Module):  # the ramp rounded to float16
    def __init__(self, n):
        super().__init__()
        self.register_buffer("r", (torch.arange(n) / n).half())

    def forward(self, x):
        return x + self.r


class _RampFrozenParameter(nn.Module):  # a Parameter nobody trains: allowed
    def __init__(self, n):
        super().__init__()
        self.r = nn.Parameter(torch.arange(n) / n, requires_grad=False)

    def forward(self, x):
        return torch.add(x, self.r)


class _RampNewTensor(nn.Module):  # made in forward with x.new_tensor
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x + x.new_tensor(range(self.n)) / self.n


@pytest.mark.parametrize("solution", [_RampFrozenParameter, _RampNewTensor])
def test_add_ramp_accepts_more_correct(solution, capsys):
    check_add_ramp(solution)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, words", [
    (_RampFloat64Buffer, "with x's dtype, torch.float32"),
    (_RampMadeOnFirstCall, "plain attribute"),
    (_RampHalfBuffer, "equal to the reference"),
])
def test_add_ramp_names_more_mistakes(mistake, words):
    assert words in failure(check_add_ramp, mistake)


class _RampRow(nn.Module):  # a (1, n) ramp: a 1-D x comes back 2-D
    def __init__(self, n):
        super().__init__()
        self.register_buffer("r", (torch.arange(n) / n)[None])

    def forward(self, x):
        return x + self.r


def test_add_ramp_keeps_a_1d_input_1d():
    assert "of shape (4,)" in failure(check_add_ramp, _RampRow)


def test_memory_held_counts_an_empty_view():
    def skips_empty(ts):  # a view with no elements counted as nothing
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in ts if t.numel()}.values())

    assert "no elements still keeps" in failure(check_memory_held, skips_empty)
