"""The memory-access tracer of Chapter 1, against sector counts done by hand."""

import random

import pytest

from course_utils.warps import count_divergent_warps, trace_sectors, warps


def one_d(fn):
    """An access function for a 1-D launch: global thread id -> accesses."""
    def accesses(b, t):
        return fn(b[0] * 32 + t[0])
    return accesses


def test_warps_are_32_consecutive_threads_x_fastest():
    ws = list(warps(grid=(1,), block=(8, 8)))
    assert len(ws) == 2
    assert [t for _, t in ws[0][:9]] == [(x, 0, 0) for x in range(8)] + [(0, 1, 0)]
    assert ws[1][0][1] == (0, 4, 0)


def test_partial_last_warp():
    ws = list(warps(grid=2, block=40))
    assert [len(w) for w in ws] == [32, 8, 32, 8]
    assert ws[2][0][0] == (1, 0, 0)


def test_consecutive_float32_is_four_sectors():
    # 32 threads x 4 bytes = 128 bytes = 4 sectors of 32 bytes
    tr = trace_sectors(one_d(lambda i: [i]), grid=1, block=32)
    assert tr.sectors == [4]
    assert tr.efficiency == 1.0


def test_misaligned_start_touches_one_more_sector():
    tr = trace_sectors(one_d(lambda i: [i + 1]), grid=1, block=32)
    assert tr.sectors == [5]


def test_stride_two_is_eight_sectors():
    tr = trace_sectors(one_d(lambda i: [2 * i]), grid=1, block=32)
    assert tr.sectors == [8]
    assert tr.efficiency == 0.5


@pytest.mark.parametrize("stride", [8, 9, 32, 1000])
def test_stride_of_eight_floats_or_more_is_32_sectors(stride):
    tr = trace_sectors(one_d(lambda i: [stride * i]), grid=1, block=32)
    assert tr.sectors == [32]


def test_float64_consecutive_is_eight_sectors():
    tr = trace_sectors(one_d(lambda i: [i]), grid=1, block=32, itemsize=8)
    assert tr.sectors == [8]


def test_broadcast_is_one_sector():
    tr = trace_sectors(lambda b, t: [7], grid=1, block=32)
    assert tr.sectors == [1]
    assert tr.requested_bytes == 4


def test_random_permutation_matches_count_by_hand():
    rng = random.Random(0)
    perm = list(range(4096))
    rng.shuffle(perm)
    tr = trace_sectors(one_d(lambda i: [perm[i]]), grid=4, block=32)
    by_hand = [len({perm[w * 32 + k] // 8 for k in range(32)}) for w in range(4)]
    assert tr.sectors == by_hand
    assert all(s >= 28 for s in tr.sectors)  # almost every thread its own sector


def test_bounds_guard_leaves_threads_out():
    n = 40  # second warp: 8 active threads, 32 bytes = 1 sector
    tr = trace_sectors(one_d(lambda i: [i] if i < n else []), grid=2, block=32)
    assert tr.sectors == [4, 1]
    assert tr.requested_bytes == n * 4


def test_two_arrays_and_several_requests():
    def add(b, t):  # c[i] = a[i] + b[i]: three requests per warp
        i = b[0] * 32 + t[0]
        return [("a", i), ("b", i), ("c", i)]
    tr = trace_sectors(add, grid=2, block=32)
    assert tr.sectors == [4] * 6
    assert tr.requests == 6


def test_same_index_in_two_arrays_is_two_sectors():
    tr = trace_sectors(lambda b, t: [[("a", 0), ("b", 0)][t[0] % 2]], grid=1, block=32)
    assert tr.sectors == [2]


def test_2d_block_row_major():
    # 16x2 block reading a 16-wide row-major matrix: one warp, 32 floats in a row
    tr = trace_sectors(lambda b, t: [t[1] * 16 + t[0]], grid=1, block=(16, 2))
    assert tr.sectors == [4]
    # reading it column-major instead: x walks down rows of width 64
    tr = trace_sectors(lambda b, t: [t[0] * 64 + t[1]], grid=1, block=(16, 2))
    assert tr.sectors == [16]


def test_divergence_by_parity_and_by_warp():
    def parity(b, t):
        return t[0] % 2 == 0
    def per_warp(b, t):
        return (t[0] // 32) % 2 == 0
    assert count_divergent_warps(parity, grid=2, block=128) == (8, 8)
    assert count_divergent_warps(per_warp, grid=2, block=128) == (0, 8)


def test_bad_launch_shape_is_refused():
    with pytest.raises(ValueError):
        list(warps(grid=0, block=32))
    with pytest.raises(ValueError):
        list(warps(grid=(1, 1, 1, 1), block=32))
