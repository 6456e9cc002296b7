"""Chapter 5's checkers: right answers written differently pass, wrong ones fail
with a message that names the mistake."""

import concurrent.futures as cf
import copy
import functools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torch.func import functional_call

from course_utils.checks import ch05
from course_utils.exercises import ExerciseFailed


def fails(check, fn, *words):
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    text = str(e.value)
    for w in words:
        assert w in text, text
    return text


# ---------------------------------------------------------------- 5.1


def replicas_closures(module, devices):
    out = []
    for i, _ in enumerate(devices):
        shell = copy.deepcopy(module)
        ts = {k: p.clone() for k, p in module.named_parameters()}
        ts |= {k: (b if i == 0 else b.clone()) for k, b in module.named_buffers()}
        out.append(lambda x, shell=shell, ts=ts: functional_call(shell, ts, (x,)))
    return out


def replicas_parameters_swapped(module, devices):  # as torch's replicate does
    out = []
    for i, _ in enumerate(devices):
        rep = copy.deepcopy(module)
        for name, sub in rep.named_modules():
            orig = module.get_submodule(name)
            for k, p in orig._parameters.items():
                sub._parameters[k] = None if p is None else p.clone()
            if i == 0:
                for k, b in orig._buffers.items():
                    sub._buffers[k] = b
        out.append(rep)
    return out


class ReplicaModule(nn.Module):
    def __init__(self, module, keep_buffers):
        super().__init__()
        self.inner = copy.deepcopy(module)
        self.params = {k: p.view_as(p) * 1 for k, p in module.named_parameters()}
        self.bufs = {k: (b if keep_buffers else b.detach().clone())
                     for k, b in module.named_buffers()}

    def forward(self, x):
        return functional_call(self.inner, {**self.params, **self.bufs}, x)


def replicas_class(module, devices):
    return [ReplicaModule(module, i == 0) for i in range(len(devices))]


def replicas_to_device(module, devices):  # p.to(d, copy=True): a copy even on the CPU
    reps = []
    for i, d in enumerate(devices):
        tensors = {k: p.to(d, copy=True) for k, p in module.named_parameters()}
        for k, b in module.named_buffers():
            tensors[k] = b if not i else b.to(d, copy=True)
        shell = copy.deepcopy(module).to(d)
        reps.append(lambda x, s=shell, t=tensors: functional_call(s, t, x))
    return reps


def replicas_tuple_with_extra_work(module, devices):
    n = len(devices)
    made = replicas_closures(module, devices)
    assert len(made) == n
    return tuple(made)


@pytest.mark.parametrize("fn", [replicas_closures, replicas_parameters_swapped,
                                replicas_class, replicas_to_device,
                                replicas_tuple_with_extra_work])
def test_right_replicas_pass(fn):
    ch05.check_make_replicas(fn)


def test_wrong_replicas_fail():
    def same_module(module, devices):
        return [module] * len(devices)

    def deepcopies(module, devices):
        return [copy.deepcopy(module) for _ in devices]

    def detached(module, devices):
        reps = []
        for i, _ in enumerate(devices):
            shell = copy.deepcopy(module)
            ts = {k: p.detach().clone() for k, p in module.named_parameters()}
            ts |= {k: (b if i == 0 else b.clone()) for k, b in module.named_buffers()}
            reps.append(lambda x, s=shell, t=ts: functional_call(s, t, x))
        return reps

    def float32_copies(module, devices):
        reps = []
        for i, _ in enumerate(devices):
            shell = copy.deepcopy(module).float()
            ts = {k: p.float() for k, p in module.named_parameters()}
            ts |= {k: (b if i == 0 else b.clone()) for k, b in module.named_buffers()}
            reps.append(lambda x, s=shell, t=ts: functional_call(s, t, x.float()))
        return reps

    def every_buffer_shared(module, devices):
        reps = []
        for _ in devices:
            shell = copy.deepcopy(module)
            ts = {k: p.clone() for k, p in module.named_parameters()}
            ts |= dict(module.named_buffers())
            reps.append(lambda x, s=shell, t=ts: functional_call(s, t, x))
        return reps

    def no_buffer_kept(module, devices):
        reps = []
        for _ in devices:
            shell = copy.deepcopy(module)
            ts = {k: p.clone() for k, p in module.named_parameters()}
            reps.append(lambda x, s=shell, t=ts: functional_call(s, t, x))
        return reps

    def one_replica(module, devices):
        return replicas_closures(module, devices[:1])

    def only_replica0_differentiable(module, devices):
        reps = replicas_closures(module, devices[:1])
        shells = [copy.deepcopy(module) for _ in devices[1:]]
        return reps + [lambda x, s=s: s(x).detach() for s in shells]

    cache = {}

    def cached(module, devices):  # replicas made once, reused for later calls
        if len(devices) not in cache:
            cache[len(devices)] = replicas_closures(module, devices)
        return cache[len(devices)]

    def swapped_into_the_module(module, devices):
        reps = []
        for _ in devices:
            ts = {k: p.clone() for k, p in module.named_parameters()}

            def run(x, ts=ts):
                for k, t in ts.items():
                    mod, _, name = k.rpartition(".")
                    module.get_submodule(mod)._parameters[name] = t
                return module(x)
            reps.append(run)
        return reps

    def zero_rather_than_clone(module, devices):  # a value bug, not a graph bug
        reps = replicas_closures(module, devices[:1])
        for _ in devices[1:]:
            shell = copy.deepcopy(module)
            ts = {k: p * 0.5 for k, p in module.named_parameters()}
            reps.append(lambda x, s=shell, t=ts: functional_call(s, t, x))
        return reps

    fails(ch05.check_make_replicas, same_module, "buffers")
    fails(ch05.check_make_replicas, deepcopies, "gradient", "differentiable")
    fails(ch05.check_make_replicas, detached, "does not require grad")
    fails(ch05.check_make_replicas, float32_copies, "dtype")
    fails(ch05.check_make_replicas, every_buffer_shared, "replica 0's update")
    fails(ch05.check_make_replicas, no_buffer_kept, "replica 0's update")
    fails(ch05.check_make_replicas, one_replica, "one replica per entry")
    fails(ch05.check_make_replicas, only_replica0_differentiable,
          "does not require grad")
    fails(ch05.check_make_replicas, cached, "older state")
    fails(ch05.check_make_replicas, swapped_into_the_module, "left in place")
    fails(ch05.check_make_replicas, zero_rather_than_clone, "output equal")


# ---------------------------------------------------------------- 5.2


def apply_list_comp(fns, inputs, timeout=60):
    outs, errs = {}, {}

    def go(i):
        try:
            outs[i] = fns[i](*inputs[i])
        except BaseException as e:  # noqa: BLE001
            errs[i] = e

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    [t.start() for t in ts]
    end = time.time() + timeout
    [t.join(max(0, end - time.time())) for t in ts]
    if any(t.is_alive() for t in ts):
        raise TimeoutError("still running")
    if errs:
        raise errs[min(errs)]
    return [outs[i] for i in range(len(fns))]


def apply_executor(fns, inputs, timeout=60):
    ex = ThreadPoolExecutor(len(fns))
    try:
        futs = [ex.submit(f, *a) for f, a in zip(fns, inputs, strict=True)]
        end = time.monotonic() + timeout
        for f in futs:
            f.exception(timeout=max(0.0, end - time.monotonic()))
        return [f.result() for f in futs]
    finally:
        ex.shutdown(wait=False, cancel_futures=True)


class Applier:
    def __call__(self, fns, inputs, timeout=60):
        self.results = [None] * len(fns)
        self.errors = []
        threads = []
        for i, (f, a) in enumerate(zip(fns, inputs, strict=True)):
            t = threading.Thread(target=self.one, args=(i, f, a), daemon=True)
            threads.append(t)
            t.start()
        stop = time.perf_counter() + timeout
        for t in threads:
            t.join(timeout=max(0, stop - time.perf_counter()))
            if t.is_alive():
                raise TimeoutError
        if self.errors:
            raise RuntimeError("a replica failed") from self.errors[0]
        return list(self.results)

    def one(self, i, f, a):
        try:
            self.results[i] = f(*a)
        except Exception as e:  # noqa: BLE001
            self.errors.append(e)


apply_class = Applier()


def apply_with_events(fns, inputs, timeout=60):
    done = [threading.Event() for _ in fns]
    box = [None] * len(fns)

    def go(i):
        try:
            box[i] = ("ok", fns[i](*inputs[i]))
        except Exception as e:  # noqa: BLE001
            box[i] = ("err", e)
        finally:
            done[i].set()

    for i in range(len(fns)):
        threading.Thread(target=go, args=(i,), daemon=True).start()
    t_end = time.monotonic() + timeout
    for d in done:
        if not d.wait(max(0, t_end - time.monotonic())):
            raise TimeoutError("a thread did not finish")
    for kind, v in box:
        if kind == "err":
            raise v
    return [v for _, v in box]


def apply_reversed_start(fns, inputs, timeout=60):  # starts the last first
    outs = [None] * len(fns)
    errs = []
    ts = {}
    for i in reversed(range(len(fns))):
        def go(i=i):
            try:
                outs[i] = fns[i](*inputs[i])
            except Exception as e:  # noqa: BLE001
                errs.append(e)
        ts[i] = threading.Thread(target=go)
        ts[i].start()
    end = time.monotonic() + timeout
    for i in range(len(fns)):
        ts[i].join(max(0, end - time.monotonic()))
    if any(t.is_alive() for t in ts.values()):
        raise TimeoutError
    if errs:
        raise errs[0]
    return outs


@pytest.mark.parametrize("fn", [apply_list_comp, apply_executor, apply_class,
                                apply_with_events, apply_reversed_start])
def test_right_applies_pass(fn):
    ch05.check_apply_in_threads(fn)


# the wrong answers' own threads end on the checker's broken barrier
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_wrong_applies_fail():
    def serial(fns, inputs, timeout=60):
        return [f(*a) for f, a in zip(fns, inputs, strict=True)]

    def start_join_each(fns, inputs, timeout=60):
        outs = [None] * len(fns)
        for i in range(len(fns)):
            t = threading.Thread(target=lambda i=i: outs.__setitem__(
                i, fns[i](*inputs[i])))
            t.start()
            t.join(timeout)
        return outs

    def completion_order(fns, inputs, timeout=60):
        outs = []
        ts = [threading.Thread(target=lambda f=f, a=a: outs.append(f(*a)))
              for f, a in zip(fns, inputs, strict=True)]
        [t.start() for t in ts]
        [t.join(timeout) for t in ts]
        return outs

    def no_join(fns, inputs, timeout=60):
        outs = [None] * len(fns)
        for i in range(len(fns)):
            threading.Thread(target=lambda i=i: outs.__setitem__(
                i, fns[i](*inputs[i])), daemon=True).start()
        return outs

    def errors_swallowed(fns, inputs, timeout=60):
        outs = [None] * len(fns)

        def go(i):
            try:
                outs[i] = fns[i](*inputs[i])
            except Exception:  # noqa: BLE001
                pass
        ts = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
        [t.start() for t in ts]
        [t.join(timeout) for t in ts]
        return outs

    def waits_for_ever(fns, inputs, timeout=60):
        return apply_list_comp(fns, inputs, timeout=1e6)

    def raises_at_once(fns, inputs, timeout=60):
        errs, outs = [], [None] * len(fns)
        ready = threading.Event()

        def go(i):
            try:
                outs[i] = fns[i](*inputs[i])
            except Exception as e:  # noqa: BLE001
                errs.append(e)
                ready.set()
        ts = [threading.Thread(target=go, args=(i,), daemon=True)
              for i in range(len(fns))]
        [t.start() for t in ts]
        if ready.wait(0.1) and errs:
            raise errs[0]
        [t.join(timeout) for t in ts]
        return outs

    def new_error(fns, inputs, timeout=60):
        try:
            return apply_list_comp(fns, inputs, timeout)
        except TimeoutError:
            raise
        except Exception:
            raise RuntimeError("something failed") from None

    def inputs_not_unpacked(fns, inputs, timeout=60):
        return apply_list_comp(fns, [(a[0],) for a in inputs], timeout)

    state = []

    def state_kept(fns, inputs, timeout=60):
        state.extend([None] * len(fns))
        start = len(state) - len(fns)

        def go(i):
            state[start + i] = fns[i](*inputs[i])
        ts = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
        [t.start() for t in ts]
        [t.join(timeout) for t in ts]
        return list(state)

    def timeout_each(fns, inputs, timeout=60):  # `timeout` per thread, not in all
        outs, errors = [None] * len(fns), []

        def go(i):
            try:
                outs[i] = fns[i](*inputs[i])
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        ts = [threading.Thread(target=go, args=(i,), daemon=True)
              for i in range(len(fns))]
        [t.start() for t in ts]
        for t in ts:
            t.join(timeout)
        if any(t.is_alive() for t in ts):
            raise TimeoutError
        if errors:
            raise errors[0]
        return outs

    def first_inline(fns, inputs, timeout=60):  # the first in the caller's thread
        others = [threading.Thread(target=fns[i], args=inputs[i])
                  for i in range(1, len(fns))]
        [t.start() for t in others]
        first = fns[0](*inputs[0])
        [t.join(timeout) for t in others]
        return [first] + [None] * (len(fns) - 1)

    fails(ch05.check_apply_in_threads, serial, "one after the other")
    fails(ch05.check_apply_in_threads, start_join_each, "one after the other")
    fails(ch05.check_apply_in_threads, completion_order, "order")
    fails(ch05.check_apply_in_threads, no_join, "join every thread")
    fails(ch05.check_apply_in_threads, errors_swallowed, "raised in the caller")
    fails(ch05.check_apply_in_threads, waits_for_ever, "TimeoutError")
    fails(ch05.check_apply_in_threads, raises_at_once, "joined before")
    fails(ch05.check_apply_in_threads, new_error, "own error")
    fails(ch05.check_apply_in_threads, inputs_not_unpacked, "unpack")
    fails(ch05.check_apply_in_threads, state_kept, "empty list on every call")
    fails(ch05.check_apply_in_threads, timeout_each, "one deadline")
    fails(ch05.check_apply_in_threads, first_inline, "thread of its own")


# ---------------------------------------------------------------- 5.3


def _size(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bytes_dict_of_states(model, n, optimizer):
    s = _size(model)
    k = dict(sgd=0, momentum=1, adam=2)[optimizer]
    return [s * (2 + k)] if n == 1 else [s * (3 + k), *([2 * s] * (n - 1))]


def bytes_per_parameter(model, n, optimizer):
    out = []
    for d in range(n):
        total = 0
        for p in model.parameters():
            per = p.element_size()
            if d == 0:
                total += p.numel() * per * (2 + (n > 1))
                states = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]
                total += p.numel() * per * states
            else:
                total += 2 * p.numel() * per
        out.append(total)
    return out


def bytes_from_state_dict(model, n, optimizer):
    s = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    states = 2 if optimizer == "adam" else int(optimizer == "momentum")
    first = s + s + states * s + (s if n > 1 else 0)
    return [first] + [s + s for _ in range(n - 1)]


def bytes_as_tuple_of_floats(model, n, optimizer):
    return tuple(float(v) for v in bytes_dict_of_states(model, n, optimizer))


class DeviceBytes(list):  # a list subclass, tensor.nbytes
    def __init__(self, model, n, optimizer):
        p = sum(t.nbytes for t in model.parameters())
        kept = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]
        super().__init__([p * (2 + kept) + (p if n > 1 else 0)] + [2 * p] * (n - 1))


@pytest.mark.parametrize("fn", [bytes_dict_of_states, bytes_per_parameter,
                                bytes_from_state_dict, bytes_as_tuple_of_floats,
                                DeviceBytes])
def test_right_predictions_pass(fn):
    ch05.check_predict_dp_bytes(fn)


def test_wrong_predictions_fail():
    def no_replica_grads(model, n, optimizer):  # the "four times" count
        s = _size(model)
        k = dict(sgd=0, momentum=1, adam=2)[optimizer]
        return [s * (2 + k)] + [s] * (n - 1)

    def states_everywhere(model, n, optimizer):
        s = _size(model)
        k = dict(sgd=0, momentum=1, adam=2)[optimizer]
        return bytes_dict_of_states(model, n, optimizer)[:1] + \
            [s * (2 + k)] * (n - 1)

    def float32_assumed(model, n, optimizer):
        s = 4 * sum(p.numel() for p in model.parameters())
        k = dict(sgd=0, momentum=1, adam=2)[optimizer]
        return [s * (2 + k)] if n == 1 else [s * (3 + k)] + [2 * s] * (n - 1)

    def one_device_like_many(model, n, optimizer):
        s = _size(model)
        k = dict(sgd=0, momentum=1, adam=2)[optimizer]
        return [s * (3 + k)] + [2 * s] * (n - 1)

    def one_gradient_on_device0(model, n, optimizer):
        s = _size(model)
        k = dict(sgd=0, momentum=1, adam=2)[optimizer]
        return [s * (2 + k)] + [2 * s] * (n - 1)

    def reversed_list(model, n, optimizer):
        return bytes_dict_of_states(model, n, optimizer)[::-1]

    def in_gib(model, n, optimizer):
        return [v / 2**30 for v in bytes_dict_of_states(model, n, optimizer)]

    def adam_always(model, n, optimizer):
        return bytes_dict_of_states(model, n, "adam")

    def four_devices(model, n, optimizer):
        return bytes_dict_of_states(model, 4, optimizer)

    def replica0_params_twice(model, n, optimizer):
        out = bytes_dict_of_states(model, n, optimizer)
        return [out[0] + _size(model) * (n > 1)] + out[1:]

    def momentum_as_two(model, n, optimizer):
        s = _size(model)
        k = dict(sgd=0, momentum=2, adam=2)[optimizer]
        return [s * (2 + k)] if n == 1 else [s * (3 + k)] + [2 * s] * (n - 1)

    fails(ch05.check_predict_dp_bytes, no_replica_grads, "gradient that reaches")
    fails(ch05.check_predict_dp_bytes, states_everywhere, "device 0 only")
    fails(ch05.check_predict_dp_bytes, float32_assumed, "element_size")
    fails(ch05.check_predict_dp_bytes, one_device_like_many, "module itself")
    fails(ch05.check_predict_dp_bytes, one_gradient_on_device0, "two gradients")
    fails(ch05.check_predict_dp_bytes, reversed_list, "device 0 first")
    fails(ch05.check_predict_dp_bytes, in_gib, "in bytes")
    fails(ch05.check_predict_dp_bytes, adam_always, "momentum keeps one")
    fails(ch05.check_predict_dp_bytes, four_devices, "one per device")
    fails(ch05.check_predict_dp_bytes, replica0_params_twice, "on device 0")
    fails(ch05.check_predict_dp_bytes, momentum_as_two, "momentum keeps one")


# ------------------------------------------------- more answers, written apart


def replicas_leaves_swapped_out(module, devices):  # non-leaf copies set as attributes
    reps = []
    for i, _ in enumerate(devices):
        r = copy.deepcopy(module)
        for name, p in module.named_parameters():
            *path, leaf = name.split(".")
            owner = r.get_submodule(".".join(path))
            del owner._parameters[leaf]
            setattr(owner, leaf, p.clone())
        for name, b in module.named_buffers():
            *path, leaf = name.split(".")
            r.get_submodule(".".join(path))._buffers[leaf] = b if i == 0 else b.clone()
        reps.append(r)
    return reps


def replicas_times_one(module, devices):  # p * 1: a differentiable copy too
    reps = []
    for i, _ in enumerate(devices):
        tensors = {k: p * 1 for k, p in module.named_parameters()}
        tensors |= {k: b if i == 0 else b.detach().clone()
                    for k, b in module.named_buffers()}
        reps.append(functools.partial(torch.func.functional_call,
                                      copy.deepcopy(module), tensors))
    return reps


class LazyReplicas:  # an iterable, read by the checker
    def __init__(self, module, devices):
        self.module, self.devices = module, list(devices)

    def __iter__(self):
        for i, d in enumerate(self.devices):
            shell = copy.deepcopy(self.module)
            t = {k: p.to(d, copy=True) for k, p in self.module.named_parameters()}
            t |= {k: b if i == 0 else b.to(d, copy=True)
                  for k, b in self.module.named_buffers()}
            yield lambda x, s=shell, t=t: functional_call(s, t, x)


def replicas_generator(module, devices):
    return iter(LazyReplicas(module, devices))


@pytest.mark.parametrize("fn", [replicas_leaves_swapped_out, replicas_times_one,
                                LazyReplicas, replicas_generator])
def test_more_right_replicas_pass(fn):
    ch05.check_make_replicas(fn)


def _copies(module, i):
    t = {k: p.clone() for k, p in module.named_parameters()}
    return t | {k: b if i == 0 else b.clone() for k, b in module.named_buffers()}


def _calling(shell, tensors, cast=None):
    def replica(x):
        return functional_call(shell, tensors, (x if cast is None else x.to(cast),))
    return replica


def test_more_wrong_replicas_fail():
    def the_module_itself_swapped(module, devices):  # functional_call on `module`
        return [_calling(module, _copies(module, i)) for i, _ in enumerate(devices)]

    def one_shell_for_all(module, devices):
        shell = copy.deepcopy(module)
        return [_calling(shell, _copies(module, i)) for i, _ in enumerate(devices)]

    def module_made_float32(module, devices):  # .float() converts it in place
        module.float()
        return [_calling(copy.deepcopy(module), _copies(module, i), torch.float32)
                for i, _ in enumerate(devices)]

    def eval_copies(module, devices):
        return [copy.deepcopy(module).eval() for _ in devices]

    def module_behind_a_lock(module, devices):
        lock = threading.Lock()

        def run(x):
            with lock:
                return module(x)
        return [run for _ in devices]

    def gradient_divided(module, devices):  # averaged instead of summed
        n = len(devices)

        def rep(i):
            s, t = copy.deepcopy(module), _copies(module, i)

            def f(x):
                y = functional_call(s, t, (x,))
                return y.detach() + (y - y.detach()) / n
            return f
        return [rep(i) for i, _ in enumerate(devices)]

    def under_no_grad(module, devices):
        def rep(i):
            s, t = copy.deepcopy(module), _copies(module, i)

            def f(x):
                with torch.no_grad():
                    return functional_call(s, t, (x,))
            return f
        return [rep(i) for i, _ in enumerate(devices)]

    def module_then_deepcopies(module, devices):
        return [module] + [copy.deepcopy(module) for _ in devices[1:]]

    fails(ch05.check_make_replicas, the_module_itself_swapped, "left in place")
    fails(ch05.check_make_replicas, one_shell_for_all, "share one module object")
    fails(ch05.check_make_replicas, module_made_float32, "left in its dtype")
    fails(ch05.check_make_replicas, eval_copies, "gradient")
    fails(ch05.check_make_replicas, module_behind_a_lock, "replica 0's update")
    fails(ch05.check_make_replicas, gradient_divided, "summed")
    fails(ch05.check_make_replicas, under_no_grad, "does not require grad")
    fails(ch05.check_make_replicas, module_then_deepcopies, "summed")


def apply_futures_wait(fns, inputs, timeout=60):
    pool = cf.ThreadPoolExecutor(max_workers=max(1, len(fns)))
    try:
        futures = [pool.submit(f, *a) for f, a in zip(fns, inputs, strict=True)]
        _, pending = cf.wait(futures, timeout=timeout)
        if pending:
            raise TimeoutError("still running")
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False)


class ResultThread(threading.Thread):
    def __init__(self, f, args):
        super().__init__(daemon=True)
        self.f, self.args, self.out, self.err = f, args, None, None

    def run(self):
        try:
            self.out = self.f(*self.args)
        except BaseException as e:  # noqa: BLE001
            self.err = e


def apply_thread_subclass(fns, inputs, timeout=60):
    ts = [ResultThread(f, a) for f, a in zip(fns, inputs, strict=True)]
    for t in ts:
        t.start()
    end = time.perf_counter() + timeout
    for t in ts:
        t.join(max(0.0, end - time.perf_counter()))
    if any(t.is_alive() for t in ts):
        raise TimeoutError
    errors = [t.err for t in ts if t.err is not None]
    if errors:
        raise errors[0]
    return [t.out for t in ts]


def apply_result_queue(fns, inputs, timeout=60):
    q = queue.Queue()

    def run(i):
        try:
            q.put((i, True, fns[i](*inputs[i])))
        except Exception as e:  # noqa: BLE001
            q.put((i, False, e))
    for i in range(len(fns)):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    end, got = time.monotonic() + timeout, {}
    while len(got) < len(fns):
        try:
            i, ok, v = q.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("timed out") from None
        got[i] = ok, v
    for i in range(len(fns)):
        if not got[i][0]:
            raise got[i][1]
    return [got[i][1] for i in range(len(fns))]


def apply_error_chained(fns, inputs, timeout=60.0):  # raise ... from the thread's
    try:
        return apply_thread_subclass(fns, inputs, timeout)
    except TimeoutError:
        raise
    except Exception as e:
        raise RuntimeError("a function failed") from e


@pytest.mark.parametrize("fn", [apply_futures_wait, apply_thread_subclass,
                                apply_result_queue, apply_error_chained])
def test_more_right_applies_pass(fn):
    ch05.check_apply_in_threads(fn)


def test_more_wrong_applies_fail():
    def timeout_in_ms(fns, inputs, timeout=60):
        return apply_thread_subclass(fns, inputs, timeout / 1000)

    def pool_of_two(fns, inputs, timeout=60):
        with cf.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(f, *a) for f, a in zip(fns, inputs, strict=True)]
            return [f.result(timeout=timeout) for f in futures]

    def outputs_float32(fns, inputs, timeout=60):
        return [o.float() for o in apply_thread_subclass(fns, inputs, timeout)]

    def inputs_float32(fns, inputs, timeout=60):
        return apply_thread_subclass(fns, [tuple(a.float() if torch.is_tensor(a) else a
                                                 for a in i) for i in inputs], timeout)

    def timeout_as_runtime_error(fns, inputs, timeout=60):
        try:
            return apply_thread_subclass(fns, inputs, timeout)
        except TimeoutError:
            raise RuntimeError("timed out") from None

    def timeout_ignored(fns, inputs, timeout=60):
        return apply_thread_subclass(fns, inputs, 60)

    def endless_generator(fns, inputs, timeout=60):
        outs = apply_thread_subclass(fns, inputs, timeout)
        yield from outs
        while True:
            yield outs[-1]

    def tuple_passed_whole(fns, inputs, timeout=60):
        return apply_thread_subclass(fns, [(a,) for a in inputs], timeout)

    fails(ch05.check_apply_in_threads, timeout_in_ms, "in seconds")
    fails(ch05.check_apply_in_threads, pool_of_two, "at once")
    fails(ch05.check_apply_in_threads, outputs_float32, "as fns[")
    fails(ch05.check_apply_in_threads, inputs_float32, "float64")
    fails(ch05.check_apply_in_threads, timeout_as_runtime_error, "TimeoutError")
    fails(ch05.check_apply_in_threads, timeout_ignored, "TimeoutError")
    fails(ch05.check_apply_in_threads, endless_generator, "3 outputs")
    fails(ch05.check_apply_in_threads, tuple_passed_whole, "unpack")


def test_checkers_reference_refused():
    def bytes_counted_by_the_checker(model, n, optimizer):
        return ch05.counted_dp_bytes(model, n, optimizer)

    fails(ch05.check_predict_dp_bytes, bytes_counted_by_the_checker,
          "reference answer")


def replicas_originals_used_directly(module, devices):  # no copy: grads land there
    out = []
    for i, _ in enumerate(devices):
        tensors = dict(module.named_parameters())
        tensors |= {k: (b if i == 0 else b.clone()) for k, b in module.named_buffers()}
        out.append(_calling(copy.deepcopy(module), tensors))
    return out


def apply_countdown_event(fns, inputs, timeout=60):
    n, left, lock, done = len(fns), [len(fns)], threading.Lock(), threading.Event()
    outs, errors = [None] * n, [None] * n
    if n == 0:
        return []

    def run(i):
        try:
            outs[i] = fns[i](*inputs[i])
        except Exception as e:  # noqa: BLE001
            errors[i] = e
        finally:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
    for i in range(n):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError
    for e in errors:
        if e is not None:
            raise e
    return outs


def bytes_from_finfo_bits(model, n, optimizer):
    size = sum(p.numel() * torch.finfo(p.dtype).bits // 8 for p in model.parameters())
    state = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer] * size
    return [2 * size + state + (size if n > 1 else 0)] + [2 * size] * (n - 1)


@pytest.mark.parametrize("check, fn", [
    (ch05.check_make_replicas, replicas_originals_used_directly),
    (ch05.check_apply_in_threads, apply_countdown_event),
    (ch05.check_predict_dp_bytes, bytes_from_finfo_bits)])
def test_right_answers_written_otherwise_pass(check, fn):
    check(fn)


def test_replicas_behind_a_lock_fail():
    def one_shell_behind_a_lock(module, devices):  # right values, one at a time
        shell, lock = copy.deepcopy(module), threading.Lock()

        def rep(i):
            f = _calling(shell, _copies(module, i))

            def locked(x):
                with lock:
                    return f(x)
            return locked
        return [rep(i) for i, _ in enumerate(devices)]

    fails(ch05.check_make_replicas, one_shell_behind_a_lock, "at the same time",
          "never overlapped")


def test_applies_that_bind_late_pool_or_overwrite_fail():
    def default_pool(fns, inputs, timeout=60):  # min(32, cores + 4) threads
        pool = cf.ThreadPoolExecutor()
        try:
            futures = [pool.submit(f, *a) for f, a in zip(fns, inputs, strict=True)]
            _, pending = cf.wait(futures, timeout=timeout)
            if pending:
                raise TimeoutError
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False)

    def outputs_into_inputs(fns, inputs, timeout=60):
        outs = apply_thread_subclass(fns, inputs, timeout)
        inputs[:] = outs
        return inputs

    def late_bound_index(fns, inputs, timeout=60):
        out = [None] * len(fns)
        threads = [threading.Thread(target=lambda: out.__setitem__(
            i, fns[i](*inputs[i])), daemon=True) for i in range(len(fns))]  # noqa: B023
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        return out

    def unpacking_forgotten_errors_lost(fns, inputs, timeout=60):
        out = [None] * len(fns)

        def run(i):
            try:
                out[i] = fns[i](inputs[i])
            except Exception:  # noqa: BLE001, S110
                pass
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        return out

    fails(ch05.check_apply_in_threads, default_pool, "40 functions", "at most")
    fails(ch05.check_apply_in_threads, outputs_into_inputs, "left as it was given")
    fails(ch05.check_apply_in_threads, late_bound_index, "called once", "args=(i,)")
    fails(ch05.check_apply_in_threads, unpacking_forgotten_errors_lost, "unpack")


def test_predictions_with_a_state_miscounted_name_it():
    def count(model, n, states, factor=1, extra=0):
        size = factor * _size(model)
        return [size * (2 + states) + (size if n > 1 else 0) + extra] + [
            2 * size] * (n - 1)

    def momentum_without_state(model, n, optimizer):
        return count(model, n, {"sgd": 0, "momentum": 0, "adam": 2}[optimizer])

    def adam_with_one_state(model, n, optimizer):
        return count(model, n, {"sgd": 0, "momentum": 1, "adam": 1}[optimizer])

    def adam_step_counters_counted(model, n, optimizer):
        steps = 4 * len(list(model.parameters())) if optimizer == "adam" else 0
        return count(model, n, {"sgd": 0, "momentum": 1, "adam": 2}[optimizer],
                     extra=steps)

    def parameters_of_every_module(model, n, optimizer):  # each counted twice
        size = sum(p.numel() * p.element_size() for m in model.modules()
                   for p in m.parameters())
        states = {"sgd": 0, "momentum": 1, "adam": 2}[optimizer]
        return [size * (2 + states) + (size if n > 1 else 0)] + [2 * size] * (n - 1)

    fails(ch05.check_predict_dp_bytes, momentum_without_state, "momentum keeps one")
    fails(ch05.check_predict_dp_bytes, adam_with_one_state, "Adam two")
    fails(ch05.check_predict_dp_bytes, adam_step_counters_counted, "step counters")
    fails(ch05.check_predict_dp_bytes, parameters_of_every_module,
          "each parameter once")
