"""Chapter 1's checkers: varied correct answers pass, typical mistakes are named."""

import numpy as np
import pytest

from course_utils.checks import ch01  # imports course_utils: the simulator first
from course_utils.exercises import ExerciseFailed

# isort: split
import numba
from numba import cuda, float32

THREADS = 128  # the exercise's constant; the checker sets it per launch


def failure(check, fn) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    return e.value.message()


# 1.1 -----------------------------------------------------------------------

def index_with_names(block_idx, thread_idx, block_dim, width):
    col = block_idx[0] * block_dim[0] + thread_idx[0]
    row = block_idx[1] * block_dim[1] + thread_idx[1]
    return row * width + col


class IndexObject:  # a callable object
    def __call__(self, b, t, d, w):
        x, y = (b[i] * d[i] + t[i] for i in range(2))
        return int(y * w + x)


@pytest.mark.parametrize("right", [
    index_with_names,
    IndexObject(),
    lambda b, t, d, w: (b[1] * d[1] + t[1]) * w + b[0] * d[0] + t[0],
    lambda b, t, d, w: np.int64(np.ravel_multi_index(  # numpy integers are fine
        (b[1] * d[1] + t[1], b[0] * d[0] + t[0]), (10_000, w))),
    lambda b, t, d, w: float((b[1] * d[1] + t[1]) * w + b[0] * d[0] + t[0]),
])
def test_global_index_accepts_correct_variants(right, capsys):
    ch01.check_global_index_2d(right)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, words", [
    (lambda b, t, d, w: (b[0] * d[0] + t[0]) * w + b[1] * d[1] + t[1], "swapped"),
    (lambda b, t, d, w: t[1] * w + t[0], "block offset"),
    (lambda b, t, d, w: (b[1] * d[0] + t[1]) * w + b[0] * d[1] + t[0], "blockDim.x"),
    (lambda b, t, d, w: (b[1] * d[1] + t[1]) * d[0] + b[0] * d[0] + t[0],
     "not blockDim.x"),
    (lambda b, t, d, w: (b[1] * d[1] + t[1]) * w + b[0] * d[0] + t[0] + 1,
     "count from 0"),
    (lambda b, t, d, w: (b[1] * d[1] + t[1]) * 24 + b[0] * d[0] + t[0], "index"),
    (lambda b, t, d, w: 0, "index"),
    (lambda b, t, d, w: "3", "whole number"),
    (lambda b, t, d, w: (b[1] * d[1] + t[1], b[0] * d[0] + t[0]), "whole number"),
])
def test_global_index_names_mistakes(wrong, words):
    assert words in failure(ch01.check_global_index_2d, wrong)


# 1.2 -----------------------------------------------------------------------

@cuda.jit
def sum_sequential(x, out):  # the chapter's solution
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + tid
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def sum_interleaved(x, out):  # the classic first version: stride doubles
    buf = cuda.shared.array(THREADS, numba.float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    value = float32(0.0)
    if i < len(x):
        value = x[i]
    buf[t] = value
    cuda.syncthreads()
    stride = 1
    while stride < cuda.blockDim.x:
        if t % (2 * stride) == 0:
            buf[t] += buf[t + stride]
        cuda.syncthreads()
        stride *= 2
    if t == 0:
        out[cuda.blockIdx.x] = buf[0]


@cuda.jit(device=True)
def load_or_zero(x, i):
    return x[i] if i < x.shape[0] else float32(0.0)


@cuda.jit
def sum_with_device_function(x, out):
    shared = numba.cuda.shared.array(shape=(THREADS,), dtype=np.float32)
    tid = numba.cuda.threadIdx.x
    shared[tid] = load_or_zero(x, numba.cuda.grid(1))
    numba.cuda.syncthreads()
    for k in range(1, 16):
        half = THREADS >> k
        if half == 0:
            break
        if tid < half:
            shared[tid] = shared[tid] + shared[tid + half]
        numba.cuda.syncthreads()
    if tid == 0:
        out[numba.cuda.blockIdx.x] = shared[0]


def sum_plain_function(x, out):  # no decorator, local partial sum kept
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.blockIdx.x * THREADS + tid
    acc = float32(0.0)
    if i < x.size:
        acc = x[i]
    sdata[tid] = acc
    cuda.syncthreads()
    s = THREADS // 2
    while s >= 1:
        if tid < s:
            acc += sdata[tid + s]
            sdata[tid] = acc
        cuda.syncthreads()
        s = s // 2
    if tid == 0:
        out[cuda.blockIdx.x] = acc


@pytest.mark.parametrize("right", [sum_sequential, sum_interleaved,
                                   sum_with_device_function, sum_plain_function])
def test_block_sum_accepts_correct_variants(right, capsys):
    ch01.check_block_sum(right)
    assert "passed" in capsys.readouterr().out


@cuda.jit
def no_first_sync(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def no_sync_in_loop(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def sync_inside_if(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
            cuda.syncthreads()  # only the active threads get here
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def early_return(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    if i >= x.size:
        return  # the bounds guard of vector add, in the wrong place
    sdata[tid] = x[i]
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def no_guard(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    sdata[tid] = x[cuda.grid(1)]
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def no_zero_fill(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    if i < x.size:
        sdata[tid] = x[i]  # threads past the end leave garbage behind
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def stride_hard_coded(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = 32  # right for blocks of 64 only
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def stride_a_quarter(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 4
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def stride_from_block_size(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x  # should start at half of it
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@cuda.jit
def serial_thread_zero(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    if tid == 0:
        acc = float32(0.0)
        for k in range(cuda.blockDim.x):
            acc += sdata[k]
        out[cuda.blockIdx.x] = acc


@cuda.jit
def atomics_only(x, out):
    i = cuda.grid(1)
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = 0.0
    cuda.syncthreads()
    if i < x.size:
        cuda.atomic.add(out, cuda.blockIdx.x, x[i])


@cuda.jit
def writes_out_by_thread(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[i] = sdata[0]  # out has one element per block


@cuda.jit
def never_writes_out(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()


@cuda.jit
def loop_never_ends(x, out):
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] = sdata[tid] + sdata[tid + s]
        cuda.syncthreads()
        s = max(s // 2, 1)  # never reaches 0
    out[cuda.blockIdx.x] = sdata[0]


@pytest.mark.parametrize("wrong, words", [
    (no_first_sync, "race"),
    (no_sync_in_loop, "race"),
    (sync_inside_if, "branches that only some threads take"),
    (early_return, "must not return early"),
    (no_guard, "Threads past the end of x must not read it"),
    (no_zero_fill, "which no thread wrote"),
    (stride_hard_coded, "stride starts at cuda.blockDim.x // 2"),
    (stride_a_quarter, "only the first 1/2"),
    (stride_from_block_size, "stride starts at cuda.blockDim.x // 2"),
    (serial_thread_zero, "halve the active threads"),
    (atomics_only, "atomic"),
    (writes_out_by_thread, "out[cuda.blockIdx.x]"),
    (never_writes_out, "never written"),
    (loop_never_ends, "never ends"),
    (lambda x, out: None, "no cuda.shared.array"),
    (42, "a @cuda.jit kernel"),
])
def test_block_sum_names_mistakes(wrong, words):
    assert words in failure(ch01.check_block_sum, wrong)


def test_block_sum_placeholder_is_named():
    @cuda.jit
    def block_sum(x, out):
        raise NotImplementedError("Exercise 1.2")

    assert "placeholder" in failure(ch01.check_block_sum, block_sum)


# 1.3 -----------------------------------------------------------------------

class CoalescedObject:
    def __call__(self, t, j, n_threads, per_thread):
        return t + n_threads * j


@pytest.mark.parametrize("right", [
    lambda t, j, nt, pt: j * nt + t,
    lambda t, j, nt, pt: (pt - 1 - j) * nt + t,  # steps in another order
    lambda t, j, nt, pt: ((j + t // 32) % pt) * nt + t,  # each warp its own order
    CoalescedObject(),
    lambda t, j, nt, pt: np.int32(j * nt + t),
])
def test_coalesced_accepts_grid_stride_and_variants(right, capsys):
    ch01.check_coalesced_element(right)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, words", [
    (lambda t, j, nt, pt: t * pt + j, "far apart"),
    (lambda t, j, nt, pt: j * nt + (t + 1) % nt, "boundary"),
    (lambda t, j, nt, pt: j * 32 + t, "more than once"),
    (lambda t, j, nt, pt: t, "never touched"),
    (lambda t, j, nt, pt: j * (nt - 1) + t, "never touched"),
    (lambda t, j, nt, pt: j * nt + t + 1, "indices in"),
    (lambda t, j, nt, pt: j * 256 + t, "indices in"),  # n_threads hard-coded
    (lambda t, j, nt, pt: (t % 32) * pt + j + (t // 32) * 32 * pt, "far apart"),
    (lambda t, j, nt, pt: j * nt + t + 0.5, "whole number"),
    (lambda t, j, nt, pt: j * nt + t // 2, "never touched"),
])
def test_coalesced_names_mistakes(wrong, words):
    assert words in failure(ch01.check_coalesced_element, wrong)
