"""Checkers for Chapter 1, "The CUDA execution model"."""

from __future__ import annotations

from collections.abc import Callable

from course_utils.exercises import call_learner, fail, passed
from course_utils.warps import trace_sectors

MAX_THREADS_PER_BLOCK = 1024


def _as_int(exercise: str, value, what: str) -> int:
    try:
        if int(value) == value:
            return int(value)
    except (TypeError, ValueError):
        pass
    fail(exercise, f"{what} to be a whole number",
         f"{type(value).__name__} {value!r:.60}")
    raise AssertionError("unreachable")


def check_global_index_2d(fn: Callable) -> None:
    """Exercise 1.1: the row-major index of a thread's element in a 2-D grid."""
    ex = "1.1"
    for block_dim, grid_dim in (((8, 4), (3, 5)), ((16, 2), (2, 3))):
        width = block_dim[0] * grid_dim[0]
        seen = set()
        for by in range(grid_dim[1]):
            for bx in range(grid_dim[0]):
                for ty in range(block_dim[1]):
                    for tx in range(block_dim[0]):
                        got = call_learner(ex, fn, (bx, by), (tx, ty), block_dim, width)
                        got = _as_int(ex, got, "the index")
                        x, y = bx * block_dim[0] + tx, by * block_dim[1] + ty
                        want = y * width + x
                        if got != want:
                            _explain_index(ex, got, want, bx, by, tx, ty, block_dim,
                                           grid_dim, width)
                        seen.add(got)
        if len(seen) != width * block_dim[1] * grid_dim[1]:
            fail(ex, "every thread a different element",
                 f"{len(seen)} distinct indices")
    passed(ex, "Neighbouring threads in x get neighbouring elements: that is what "
               "lets a warp's loads coalesce.")


def _explain_index(ex, got, want, bx, by, tx, ty, block_dim, grid_dim, width) -> None:
    x, y = bx * block_dim[0] + tx, by * block_dim[1] + ty
    height = block_dim[1] * grid_dim[1]
    wrong = {
        x * height + y: "you made x the row: in CUDA x is the column, the index "
                        "that moves fastest, so the element is y * width + x",
        x * width + y: "you swapped x and y: the element is y * width + x",
        ty * width + tx: "you left out the block offset: x = blockIdx.x * "
                         "blockDim.x + threadIdx.x (and the same for y)",
        (by * block_dim[0] + ty) * width + bx * block_dim[1] + tx:
            "you mixed up blockDim.x and blockDim.y",
        (by * grid_dim[1] + ty) * width + bx * grid_dim[0] + tx:
            "you multiplied blockIdx by the grid size; multiply by blockDim",
        y * height + x: "the row stride is the width of the matrix, not its height",
    }
    hint = wrong.get(got, "row = blockIdx.y * blockDim.y + threadIdx.y, "
                          "col = blockIdx.x * blockDim.x + threadIdx.x, "
                          "index = row * width + col")
    fail(ex, f"index {want} for block {(bx, by)}, thread {(tx, ty)}, blockDim "
             f"{block_dim}, width {width}", str(got), hint)


def check_launch_config(fn: Callable) -> None:
    """Exercise 1.2: blocks and threads per block that cover n elements."""
    ex = "1.2"
    for n in (1, 31, 32, 100, 256, 257, 1000, 1025, 4097, 1_000_000, 10_000_001):
        result = call_learner(ex, fn, n)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            fail(ex, "a pair (blocks, threads_per_block)", repr(result)[:80])
        blocks = _as_int(ex, result[0], "blocks")
        threads = _as_int(ex, result[1], "threads_per_block")
        if threads > MAX_THREADS_PER_BLOCK:
            fail(ex, "at most 1024 threads per block", f"{threads} for n={n}",
                 "a launch with more threads per block fails on every current GPU")
        if threads < 32 or threads % 32:
            fail(ex, "threads per block a multiple of 32 (a whole number of warps)",
                 f"{threads} for n={n}",
                 "a warp is 32 threads; a partial warp wastes the rest of its lanes")
        if blocks * threads < n:
            fail(ex, f"enough threads: at least {n} for n={n}",
                 f"{blocks} x {threads} = {blocks * threads}",
                 "round the number of blocks up: (n + threads - 1) // threads")
        if (blocks - 1) * threads >= n:
            fail(ex, f"no block without work for n={n}",
                 f"{blocks} blocks of {threads}: the last block has nothing to do",
                 "use ceiling division, not floor division plus one")
    passed(ex)


def check_coalesced_element(fn: Callable) -> None:
    """Exercise 1.3: thread t's element in step j, coalesced across a warp."""
    ex = "1.3"
    for blocks, threads, per_thread in ((2, 128, 8), (3, 64, 5)):
        n_threads = blocks * threads
        n = n_threads * per_thread

        def accesses(b, t, n_threads=n_threads, per_thread=per_thread, threads=threads):
            g = b[0] * threads + t[0]
            return [call_learner(ex, fn, g, j, n_threads, per_thread)
                    for j in range(per_thread)]

        counts = [0] * n
        for g in range(n_threads):
            for j in range(per_thread):
                i = _as_int(ex, call_learner(ex, fn, g, j, n_threads, per_thread),
                            "the element index")
                if not 0 <= i < n:
                    fail(ex, f"indices in 0..{n - 1}", f"{i} for thread {g}, step {j}",
                         f"there are n_threads * per_thread = {n} elements")
                counts[i] += 1
        missed = [i for i, c in enumerate(counts) if c == 0]
        twice = sum(c > 1 for c in counts)
        if missed:
            fail(ex, "every element copied exactly once",
                 f"{len(missed)} elements never touched (first: {missed[0]}), "
                 f"{twice} touched more than once",
                 "with n_threads threads, step j covers elements j * n_threads "
                 "... j * n_threads + n_threads - 1")
        trace = trace_sectors(accesses, grid=blocks, block=threads)
        if trace.sectors_per_request > 4:
            if trace.sectors_per_request <= 5:
                hint = ("neighbouring threads read neighbouring elements, but a "
                        "warp's 32 floats straddle a 128-byte boundary: let each "
                        "warp start at a multiple of 32 elements")
            else:
                hint = ("neighbouring threads still read elements far apart; in "
                        "each step, thread t+1 must read the element right after "
                        "thread t's")
            fail(ex, "4 sectors per warp request (32 threads x 4 bytes = 128 bytes)",
                 f"{trace.sectors_per_request:.1f} sectors per request", hint)
    passed(ex, "Each warp request now moves 4 sectors, all of them used.")
