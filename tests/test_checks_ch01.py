"""Chapter 1's checkers: varied correct answers pass, typical mistakes are named."""

import numpy as np
import pytest

from course_utils.checks import ch01  # imports course_utils: the simulator first
from course_utils.exercises import ExerciseFailed

# isort: split
import numba
from numba import cuda, float32, float64

gpu = cuda  # an alias: the checker must follow it

THREADS = 128  # the exercises' constants; the checker sets them per launch
TILE = 16


def failure(check, fn) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    return e.value.message()


# 1.1 -----------------------------------------------------------------------

@cuda.jit
def axpy_while(a, x, y, out):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    while i < len(x):
        out[i] = y[i] + x[i] * a
        i += step


@gpu.jit  # through an alias of numba.cuda
def axpy_alias(a, x, y, out):
    n_threads = gpu.gridDim.x * gpu.blockDim.x
    for i in range(gpu.grid(1), x.shape[0], n_threads):
        ax = a * x[i]
        out[i] = ax + y[i]


@cuda.jit(device=True)
def fma(a, u, v):
    return a * u + v


@cuda.jit
def axpy_device_function(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = fma(a, x[i], y[i])


def axpy_plain_function(a, x, y, out):  # no decorator; numba.cuda spelled out
    n_threads = numba.cuda.gridsize(1)
    for i in range(numba.cuda.grid(1), x.size, n_threads):
        check = x[i]  # an extra read: harmless
        out[i] = a * check + y[i]


@cuda.jit
def axpy_steps_counted(a, x, y, out):
    stride = cuda.gridsize(1)
    for k in range((x.size + stride - 1) // stride):
        i = k * stride + cuda.grid(1)
        if i < x.size:
            out[i] = a * x[i] + y[i]


@pytest.mark.parametrize("right", [axpy_while, axpy_alias, axpy_device_function,
                                   axpy_plain_function, axpy_steps_counted])
def test_axpy_accepts_correct_variants(right, capsys):
    ch01.check_axpy(right)
    assert "passed" in capsys.readouterr().out


@cuda.jit
def axpy_no_loop(a, x, y, out):  # one element per thread: the grid must cover n
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_block_stride(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.blockDim.x):
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_grid_dim_stride(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridDim.x):
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_no_block_offset(a, x, y, out):
    for i in range(cuda.threadIdx.x, x.size, cuda.gridsize(1)):
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_chunks(a, x, y, out):  # each thread a run of neighbours: strided warps
    n_threads = cuda.gridsize(1)
    per = (x.size + n_threads - 1) // n_threads
    start = cuda.grid(1) * per
    for i in range(start, min(start + per, x.size)):
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_stops_early(a, x, y, out):
    for i in range(cuda.grid(1), x.size - 1, cuda.gridsize(1)):
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_one_too_far(a, x, y, out):
    i = cuda.grid(1)
    while i <= x.size:
        out[i] = a * x[i] + y[i]
        i += cuda.gridsize(1)


@cuda.jit
def axpy_n_hard_coded(a, x, y, out):
    for i in range(cuda.grid(1), 1000, cuda.gridsize(1)):
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_stride_hard_coded(a, x, y, out):
    for i in range(cuda.grid(1), x.size, 128):
        out[i] = a * x[i] + y[i]


@cuda.jit
def axpy_float32_only(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = float32(a) * x[i] + y[i]


@cuda.jit
def axpy_without_a(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = x[i] + y[i]


@cuda.jit
def axpy_a_on_both(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = a * (x[i] + y[i])


@cuda.jit
def axpy_in_place(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        x[i] = a * x[i] + y[i]
        out[i] = x[i]


@cuda.jit
def axpy_one_thread(a, x, y, out):  # right values, but a single thread works
    if cuda.grid(1) == 0:
        for i in range(x.size):
            out[i] = a * x[i] + y[i]


@pytest.mark.parametrize("wrong, words", [
    (axpy_no_loop, "i + cuda.gridsize(1)"),
    (axpy_block_stride, "number of threads in the whole grid"),
    (axpy_grid_dim_stride, "number of threads in the whole grid"),
    (axpy_no_block_offset, "its global index cuda.grid(1)"),
    (axpy_chunks, "block of neighbouring elements"),
    (axpy_stops_early, "not x.size - 1"),
    (axpy_one_too_far, "stop the loop at x.size"),
    (axpy_n_hard_coded, "stop the loop at x.size"),
    (axpy_stride_hard_coded, "i + cuda.gridsize(1)"),
    (axpy_float32_only, "went through float32"),
    (axpy_without_a, "a was left out"),
    (axpy_a_on_both, "a multiplies x[i] only"),
    (axpy_in_place, "x was changed"),
    (axpy_one_thread, "a few threads do the work of all"),
    ("axpy", "a @cuda.jit kernel"),
])
def test_axpy_names_mistakes(wrong, words):
    assert words in failure(ch01.check_axpy, wrong)


def test_axpy_placeholder_is_named():
    @cuda.jit
    def axpy(a, x, y, out):
        raise NotImplementedError("Exercise 1.1")

    assert "placeholder" in failure(ch01.check_axpy, axpy)


# 1.2 -----------------------------------------------------------------------

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


@gpu.jit
def sum_for_loop(x, out):  # a counted loop over the steps, through an alias
    sdata = gpu.shared.array(THREADS, float32)
    tid = gpu.threadIdx.x
    i = gpu.grid(1)
    sdata[tid] = float32(0.0)
    if i < len(x):
        sdata[tid] = x[i]
    gpu.syncthreads()
    steps = 0
    while (1 << steps) < gpu.blockDim.x:
        steps += 1
    for k in range(steps):
        stride = gpu.blockDim.x >> (k + 1)
        if tid < stride:
            sdata[tid] = sdata[tid] + sdata[tid + stride]
        gpu.syncthreads()
    if tid == 0:
        out[gpu.blockIdx.x] = sdata[0]


@cuda.jit
def sum_reversed_pairs(x, out):  # the top half folds onto the bottom, mirrored
    sdata = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    width = cuda.blockDim.x
    while width > 1:
        half = width // 2
        if tid < half:
            sdata[tid] += sdata[width - 1 - tid]
        cuda.syncthreads()
        width = half
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@pytest.mark.parametrize("right", [sum_interleaved, sum_with_device_function,
                                   sum_plain_function, sum_for_loop,
                                   sum_reversed_pairs])
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


@cuda.jit
def integer_partials(x, out):  # the partial sums held in an int32 shared array
    sdata = cuda.shared.array(THREADS, numba.int32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    sdata[tid] = x[i] if i < x.size else 0
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sdata[tid] += sdata[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        out[cuda.blockIdx.x] = sdata[0]


@pytest.mark.parametrize("wrong, words", [
    (integer_partials, "holds integers"),
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

@cuda.jit
def transpose_padded(a, out):  # one spare column: no shared-memory bank conflicts
    tile = cuda.shared.array((TILE, TILE + 1), float64)
    x, y = cuda.grid(2)
    if y < a.shape[0] and x < a.shape[1]:
        tile[cuda.threadIdx.y, cuda.threadIdx.x] = a[y, x]
    cuda.syncthreads()
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.y
    c = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.x
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[cuda.threadIdx.x, cuda.threadIdx.y]


@gpu.jit
def transpose_stored_turned(a, out):  # the tile turns on the way in instead
    tile = gpu.shared.array((TILE, TILE), float64)
    tx, ty = gpu.threadIdx.x, gpu.threadIdx.y
    row, col = gpu.blockIdx.y * TILE + ty, gpu.blockIdx.x * TILE + tx
    if row < a.shape[0] and col < a.shape[1]:
        tile[tx, ty] = a[row, col]
    gpu.syncthreads()
    row, col = gpu.blockIdx.x * TILE + ty, gpu.blockIdx.y * TILE + tx
    if row < a.shape[1] and col < a.shape[0]:
        out[row, col] = tile[ty, tx]


@cuda.jit(device=True)
def inside(m, r, c):
    return r < m.shape[0] and c < m.shape[1]


@cuda.jit
def transpose_with_device_function(a, out):
    tile = cuda.shared.array((TILE, TILE), dtype=float64)
    bx, by = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    if inside(a, by + ty, bx + tx):
        tile[ty, tx] = a[by + ty, bx + tx]
    cuda.syncthreads()
    if inside(out, bx + ty, by + tx):
        out[bx + ty, by + tx] = tile[tx, ty]


def transpose_plain_function(a, out):  # no decorator, numba.cuda spelled out
    c = numba.cuda
    tile = c.shared.array((TILE, TILE), numba.float64)
    t, b = c.threadIdx, c.blockIdx
    h, w = a.shape
    ok = b.y * TILE + t.y < h and b.x * TILE + t.x < w
    if ok:
        tile[t.y, t.x] = a[b.y * TILE + t.y, b.x * TILE + t.x]
    c.syncthreads()
    c.syncthreads()  # a second barrier: harmless
    if b.x * TILE + t.y < w and b.y * TILE + t.x < h:
        out[b.x * TILE + t.y, b.y * TILE + t.x] = tile[t.x, t.y]


@cuda.jit
def transpose_flat_tile(a, out):  # a 1-D shared array, indexed by hand
    tile = cuda.shared.array(TILE * TILE, float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    y, x = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if y < a.shape[0]:
        if x < a.shape[1]:
            tile[ty * TILE + tx] = a[y, x]
    cuda.syncthreads()
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx * TILE + ty]


@cuda.jit
def transpose_reads_tile_first(a, out):  # reads its tile element before the guard
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    row, col = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if row < a.shape[0] and col < a.shape[1]:
        tile[ty, tx] = a[row, col]
    cuda.syncthreads()
    v = tile[tx, ty]  # garbage for a thread outside out, which never stores it
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = v


@pytest.mark.parametrize("right", [transpose_padded, transpose_stored_turned,
                                   transpose_with_device_function,
                                   transpose_plain_function, transpose_flat_tile,
                                   transpose_reads_tile_first])
def test_transpose_accepts_correct_variants(right, capsys):
    ch01.check_transpose(right)
    assert "passed" in capsys.readouterr().out


@cuda.jit
def transpose_naive(a, out):  # no tile: reads coalesce, writes go down a column
    x, y = cuda.grid(2)
    if y < a.shape[0] and x < a.shape[1]:
        out[x, y] = a[y, x]


@cuda.jit
def transpose_column_reads(a, out):  # no tile: writes coalesce, reads do not
    c, r = cuda.grid(2)  # c: column of out
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = a[c, r]


def _tile_kernel(load_guard=True, sync=True, store_guard=True, turn=True,
                 tile_type=float64, early=False, sync_in_if=False, skip_load=False):
    @cuda.jit
    def kernel(a, out):
        tile = cuda.shared.array((TILE, TILE), tile_type)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        x, y = cuda.blockIdx.x * TILE + tx, cuda.blockIdx.y * TILE + ty
        if early and (y >= a.shape[0] or x >= a.shape[1]):
            return
        if not load_guard or (y < a.shape[0] and x < a.shape[1]):
            if not (skip_load and tx == 1):  # one column of the tile left unloaded
                tile[ty, tx] = a[y, x]
            if sync_in_if:
                cuda.syncthreads()
        if sync and not sync_in_if:
            cuda.syncthreads()
        r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
        if not store_guard or (r < out.shape[0] and c < out.shape[1]):
            out[r, c] = tile[tx, ty] if turn else tile[ty, tx]
    return kernel


@cuda.jit
def transpose_tile_writes_column(a, out):  # staged in shared memory, still strided
    tile = cuda.shared.array((TILE, TILE), float64)
    x, y = cuda.grid(2)
    if y < a.shape[0] and x < a.shape[1]:
        tile[cuda.threadIdx.y, cuda.threadIdx.x] = a[y, x]
    cuda.syncthreads()
    if y < a.shape[0] and x < a.shape[1]:
        out[x, y] = tile[cuda.threadIdx.y, cuda.threadIdx.x]


@cuda.jit
def transpose_sync_first(a, out):  # the barrier before the load, not after
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    x, y = cuda.blockIdx.x * TILE + tx, cuda.blockIdx.y * TILE + ty
    cuda.syncthreads()
    if y < a.shape[0] and x < a.shape[1]:
        tile[ty, tx] = a[y, x]
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]


@cuda.jit
def transpose_tile_16(a, out):  # the tile size written as a number
    tile = cuda.shared.array((16, 16), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    x, y = cuda.blockIdx.x * 16 + tx, cuda.blockIdx.y * 16 + ty
    if y < a.shape[0] and x < a.shape[1]:
        tile[ty, tx] = a[y, x]
    cuda.syncthreads()
    r, c = cuda.blockIdx.x * 16 + ty, cuda.blockIdx.y * 16 + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]


@cuda.jit
def transpose_copy(a, out):  # copies through the tile instead of transposing
    tile = cuda.shared.array((TILE, TILE), float64)
    x, y = cuda.grid(2)
    if y < a.shape[0] and x < a.shape[1]:
        tile[cuda.threadIdx.y, cuda.threadIdx.x] = a[y, x]
    cuda.syncthreads()
    if y < out.shape[0] and x < out.shape[1]:
        out[y, x] = tile[cuda.threadIdx.y, cuda.threadIdx.x]


@cuda.jit
def transpose_one_thread(a, out):  # thread (0, 0) of each block moves the tile
    if cuda.threadIdx.x == 0 and cuda.threadIdx.y == 0:
        for ty in range(TILE):
            for tx in range(TILE):
                y, x = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
                if y < a.shape[0] and x < a.shape[1]:
                    out[x, y] = a[y, x]


@pytest.mark.parametrize("wrong, words", [
    (transpose_naive, "write out along a row"),
    (transpose_column_reads, "read a along a row"),
    (_tile_kernel(sync=False), "race"),
    (_tile_kernel(sync_in_if=True), "only some threads take"),
    (_tile_kernel(early=True), "must not return early"),
    (_tile_kernel(load_guard=False), "guard the load"),
    (_tile_kernel(store_guard=False), "guard the store"),
    (_tile_kernel(turn=False), "not transposed inside"),
    (_tile_kernel(tile_type=float32), "float32 tile"),
    (transpose_tile_writes_column, "write out along a row"),
    (transpose_sync_first, "race"),
    (transpose_tile_16, "not a number"),
    (transpose_copy, "copy of a"),
    (transpose_one_thread, "a few threads do the work of all"),
    (_tile_kernel(skip_load=True), "no thread loaded"),
    (None, "a @cuda.jit kernel"),
])
def test_transpose_names_mistakes(wrong, words):
    assert words in failure(ch01.check_transpose, wrong)


def test_transpose_placeholder_is_named():
    @cuda.jit
    def transpose(a, out):
        raise NotImplementedError("Exercise 1.3")

    assert "placeholder" in failure(ch01.check_transpose, transpose)


# Answers written by an adversary: new right ones, and wrong ones that passed
# before the checks were tightened (every thread writing the block's sum) or
# got a hint about another mistake (one thread writing an element twice, a race
# without barriers in the loop).

from numba import int32  # noqa: E402

N = 1000  # a size fixed in the kernel: wrong for every other n

@cuda.jit
def ax_block_stride(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.blockDim.x):
        out[i] = a * x[i] + y[i]
@cuda.jit
def ax_thread_start(a, x, y, out):
    for i in range(cuda.threadIdx.x, x.size, cuda.gridsize(1)):
        out[i] = a * x[i] + y[i]
@cuda.jit
def ax_no_loop(a, x, y, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i] + y[i]
@cuda.jit
def ax_hard_n(a, x, y, out):
    for i in range(cuda.grid(1), N, cuda.gridsize(1)):
        out[i] = a * x[i] + y[i]
@cuda.jit
def ax_two_writes(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = y[i]
        out[i] += a * x[i]
@cuda.jit
def ax_in_x(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        x[i] = a * x[i]
        out[i] = x[i] + y[i]
@cuda.jit
def ax_hard_stride(a, x, y, out):
    for i in range(cuda.grid(1), x.size, 128):
        out[i] = a * x[i] + y[i]
@cuda.jit
def ax_f32_local(a, x, y, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        t = float32(a) * x[i]
        out[i] = t + y[i]
@cuda.jit
def ax_chunks(a, x, y, out):
    n_threads = cuda.gridsize(1)
    per = (x.size + n_threads - 1) // n_threads
    start = cuda.grid(1) * per
    for i in range(start, min(start + per, x.size)):
        out[i] = a * x[i] + y[i]
@cuda.jit
def ax_thread0(a, x, y, out):
    if cuda.grid(1) == 0:
        for i in range(x.size):
            out[i] = a * x[i] + y[i]
# right
@cuda.jit
def ax_r_while_down(a, x, y, out):
    stride = cuda.blockDim.x * cuda.gridDim.x
    i = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x
    while i < out.shape[0]:
        out[i] = x[i] * a + y[i]
        i = i + stride
@cuda.jit
def ax_r_count(a, x, y, out):
    n = x.shape[0]
    g = cuda.gridsize(1)
    steps = (n + g - 1) // g
    for k in range(steps):
        i = cuda.grid(1) + k * g
        if i < n:
            out[i] = a * x[i] + y[i]

# 1.2
@cuda.jit
def bs_sync_in_if(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    p[t] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            p[t] += p[t + s]
            cuda.syncthreads()
        s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_all_write(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    p[t] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            p[t] += p[t + s]
        cuda.syncthreads()
        s //= 2
    out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_warp_sync(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    p[t] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 16:
        if t < s:
            p[t] += p[t + s]
        cuda.syncthreads()
        s //= 2
    if t < 16:
        while s > 0:
            p[t] += p[t + s]
            s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_f16_stride_hard(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * 128 + t
    p[t] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = 64
    while s > 0:
        if t < s:
            p[t] += p[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_serial(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    p[t] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    if t == 0:
        acc = float32(0.0)
        for k in range(cuda.blockDim.x):
            acc += p[k]
        out[cuda.blockIdx.x] = acc
@cuda.jit
def bs_stop_at_1(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    p[t] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 1:
        if t < s:
            p[t] += p[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_int(x, out):
    p = cuda.shared.array(THREADS, int32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    p[t] = x[i] if i < x.size else 0
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            p[t] += p[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_no_pad(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    if i < x.size:
        p[t] = x[i]
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            p[t] += p[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_same_buffer_race(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    p[t] = x[i] if i < x.size else float32(0.0)
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if t < s:
            p[t] += p[t + s]
        s //= 2
    cuda.syncthreads()
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
# right
@cuda.jit
def bs_r_interleaved(x, out):
    p = cuda.shared.array(THREADS, float64)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + t
    v = float64(0.0)
    if i < x.shape[0]:
        v = x[i]
    p[t] = v
    cuda.syncthreads()
    s = 1
    while s < cuda.blockDim.x:
        if t % (2 * s) == 0:
            p[t] += p[t + s]
        cuda.syncthreads()
        s *= 2
    if t == 0:
        out[cuda.blockIdx.x] = p[0]
@cuda.jit
def bs_r_for_shift(x, out):
    p = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    p[t] = 0
    if i < len(x):
        p[t] = x[i]
    cuda.syncthreads()
    steps = 0
    n = THREADS
    while n > 1:
        n >>= 1
        steps += 1
    for k in range(steps):
        s = THREADS >> (k + 1)
        if t < s:
            p[t] = p[t] + p[t + s]
        cuda.syncthreads()
    if t == 0:
        out[cuda.blockIdx.x] = p[0]

# 1.3
@cuda.jit
def tr_naive(a, out):
    c = cuda.blockIdx.x * TILE + cuda.threadIdx.x
    r = cuda.blockIdx.y * TILE + cuda.threadIdx.y
    if r < a.shape[0] and c < a.shape[1]:
        out[c, r] = a[r, c]
@cuda.jit
def tr_hard16(a, out):
    tile = cuda.shared.array((16, 16), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * 16 + ty, cuda.blockIdx.x * 16 + tx
    if r < a.shape[0] and c < a.shape[1]:
        tile[ty, tx] = a[r, c]
    cuda.syncthreads()
    r, c = cuda.blockIdx.x * 16 + ty, cuda.blockIdx.y * 16 + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]
@cuda.jit
def tr_square_guard(a, out):
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if r < a.shape[0] and c < a.shape[0]:
        tile[ty, tx] = a[r, c]
    cuda.syncthreads()
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[0]:
        out[r, c] = tile[tx, ty]
@cuda.jit
def tr_f32(a, out):
    tile = cuda.shared.array((TILE, TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if r < a.shape[0] and c < a.shape[1]:
        tile[ty, tx] = a[r, c]
    cuda.syncthreads()
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]
@cuda.jit
def tr_sync_in_if(a, out):
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if r < a.shape[0] and c < a.shape[1]:
        tile[ty, tx] = a[r, c]
        cuda.syncthreads()
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]
@cuda.jit
def tr_no_sync(a, out):
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if r < a.shape[0] and c < a.shape[1]:
        tile[ty, tx] = a[r, c]
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]
@cuda.jit
def tr_read_transposed(a, out):  # reads a down columns, writes rows
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * TILE + tx, cuda.blockIdx.x * TILE + ty
    if r < a.shape[0] and c < a.shape[1]:
        tile[tx, ty] = a[r, c]
    cuda.syncthreads()
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]
@cuda.jit
def tr_early_return(a, out):
    tile = cuda.shared.array((TILE, TILE), float64)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    r, c = cuda.blockIdx.y * TILE + ty, cuda.blockIdx.x * TILE + tx
    if r >= a.shape[0] or c >= a.shape[1]:
        return
    tile[ty, tx] = a[r, c]
    cuda.syncthreads()
    r, c = cuda.blockIdx.x * TILE + ty, cuda.blockIdx.y * TILE + tx
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = tile[tx, ty]
# right
@cuda.jit
def tr_r_padded(a, out):
    tile = cuda.shared.array((TILE, TILE + 1), float64)
    bx, by = cuda.blockIdx.x, cuda.blockIdx.y
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    h, w = a.shape
    if by * TILE + ty < h and bx * TILE + tx < w:
        tile[ty, tx] = a[by * TILE + ty, bx * TILE + tx]
    cuda.syncthreads()
    if bx * TILE + ty < w and by * TILE + tx < h:
        out[bx * TILE + ty, by * TILE + tx] = tile[tx, ty]
@cuda.jit
def tr_r_blockdim(a, out):
    tile = cuda.shared.array((TILE, TILE), float64)
    n = cuda.blockDim.x
    x, y = cuda.grid(2)
    if y < a.shape[0] and x < a.shape[1]:
        tile[cuda.threadIdx.y, cuda.threadIdx.x] = a[y, x]
    cuda.syncthreads()
    x2 = cuda.blockIdx.y * n + cuda.threadIdx.x
    y2 = cuda.blockIdx.x * n + cuda.threadIdx.y
    if y2 < out.shape[0] and x2 < out.shape[1]:
        out[y2, x2] = tile[cuda.threadIdx.x, cuda.threadIdx.y]


@pytest.mark.parametrize("right", [ax_r_while_down, ax_r_count])
def test_axpy_accepts_more_variants(right, capsys):
    ch01.check_axpy(right)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, words", [
    (ax_block_stride, "whole grid"),
    (ax_thread_start, "global index"),
    (ax_no_loop, "68 elements never written"),
    (ax_hard_n, "outside the array"),
    (ax_two_writes, "by one thread"),
    (ax_in_x, "x left as it was"),
    (ax_hard_stride, "cuda.gridsize(1)"),
    (ax_f32_local, "went through float32"),
    (ax_chunks, "sectors per warp request"),
    (ax_thread0, "a few threads do the work of all"),
])
def test_axpy_names_more_mistakes(wrong, words):
    assert words in failure(ch01.check_axpy, wrong)


@pytest.mark.parametrize("right", [bs_r_interleaved, bs_r_for_shift])
def test_block_sum_accepts_more_variants(right, capsys):
    ch01.check_block_sum(right)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, words", [
    (bs_sync_in_if, "never reaches"),
    (bs_all_write, "32 threads write out[0]"),
    (bs_warp_sync, "put cuda.syncthreads() between"),
    (bs_f16_stride_hard, "outside the shared array"),
    (bs_serial, "a tree"),
    (bs_stop_at_1, "sum of block 0"),
    (bs_int, "holds integers"),
    (bs_no_pad, "which no thread wrote"),
    (bs_same_buffer_race, "put cuda.syncthreads() between"),
])
def test_block_sum_names_more_mistakes(wrong, words):
    assert words in failure(ch01.check_block_sum, wrong)


@pytest.mark.parametrize("right", [tr_r_padded, tr_r_blockdim])
def test_transpose_accepts_more_variants(right, capsys):
    ch01.check_transpose(right)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, words", [
    (tr_naive, "global writes"),
    (tr_hard16, "use TILE"),
    (tr_square_guard, "outside the array"),
    (tr_f32, "float32 tile"),
    (tr_sync_in_if, "inside a branch"),
    (tr_no_sync, "a race"),
    (tr_read_transposed, "global reads"),
    (tr_early_return, "never reaches"),
])
def test_transpose_names_more_mistakes(wrong, words):
    assert words in failure(ch01.check_transpose, wrong)


@cuda.jit
def bs_stride_from_64(x, out):  # right for THREADS <= 128 only: idle steps below
    sh = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    sh[t] = x[i] if i < x.size else float32(0)
    cuda.syncthreads()
    s = 64
    while s > 0:
        if t < s and t + s < cuda.blockDim.x:
            sh[t] += sh[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        out[cuda.blockIdx.x] = sh[0]


@cuda.jit
def bs_r_sync_each_side(x, out):  # a barrier before and after every step
    sh = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    sh[t] = 0
    if i < x.size:
        sh[t] = x[i]
    s = cuda.blockDim.x // 2
    while s > 0:
        cuda.syncthreads()
        if t < s:
            sh[t] += sh[t + s]
        s //= 2
    cuda.syncthreads()
    if t == 0:
        out[cuda.blockIdx.x] = sh[0]


def test_block_sum_counts_the_steps():
    assert "log2(32) = 5 steps" in failure(ch01.check_block_sum, bs_stride_from_64)


def test_block_sum_allows_a_barrier_at_the_top_of_each_step(capsys):
    ch01.check_block_sum(bs_r_sync_each_side)
    assert "passed" in capsys.readouterr().out
