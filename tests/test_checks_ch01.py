"""Chapter 1's checkers: varied correct answers pass, typical mistakes are named."""

import numpy as np
import pytest

from course_utils.checks import ch01
from course_utils.exercises import ExerciseFailed


def failure(check, fn) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check(fn)
    return e.value.message()


# 1.1 -----------------------------------------------------------------------

def test_global_index_accepts_correct_variants():
    ch01.check_global_index_2d(
        lambda b, t, d, w: (b[1] * d[1] + t[1]) * w + b[0] * d[0] + t[0])
    ch01.check_global_index_2d(  # numpy integers are fine
        lambda b, t, d, w: np.int64(np.ravel_multi_index(
            (b[1] * d[1] + t[1], b[0] * d[0] + t[0]), (10_000, w))))


@pytest.mark.parametrize("wrong, words", [
    (lambda b, t, d, w: (b[0] * d[0] + t[0]) * w + b[1] * d[1] + t[1], "swapped"),
    (lambda b, t, d, w: t[1] * w + t[0], "block offset"),
    (lambda b, t, d, w: (b[1] * d[0] + t[1]) * w + b[0] * d[1] + t[0], "blockDim.x"),
    (lambda b, t, d, w: 0, "index"),
    (lambda b, t, d, w: "3", "whole number"),
])
def test_global_index_names_mistakes(wrong, words):
    assert words in failure(ch01.check_global_index_2d, wrong)


# 1.2 -----------------------------------------------------------------------

@pytest.mark.parametrize("threads", [32, 128, 256, 1024])
def test_launch_config_accepts_any_legal_block(threads):
    ch01.check_launch_config(lambda n: (-(-n // threads), threads))


def test_launch_config_accepts_math_ceil_and_lists():
    import math
    ch01.check_launch_config(lambda n: [math.ceil(n / 512), 512])


@pytest.mark.parametrize("wrong, words", [
    (lambda n: (n // 256, 256), "round the number of blocks up"),
    (lambda n: (n // 256 + 1, 256), "nothing to do"),
    (lambda n: (-(-n // 2048), 2048), "1024"),
    (lambda n: (-(-n // 100), 100), "multiple of 32"),
    (lambda n: (n, 1), "multiple of 32"),
    (lambda n: -(-n // 256), "pair"),
])
def test_launch_config_names_mistakes(wrong, words):
    assert words in failure(ch01.check_launch_config, wrong)


# 1.3 -----------------------------------------------------------------------

def test_coalesced_accepts_grid_stride_and_variants():
    ch01.check_coalesced_element(lambda t, j, nt, pt: j * nt + t)
    # a different order of steps is still coalesced and complete
    ch01.check_coalesced_element(lambda t, j, nt, pt: (pt - 1 - j) * nt + t)


@pytest.mark.parametrize("wrong, words", [
    (lambda t, j, nt, pt: t * pt + j, "far apart"),
    (lambda t, j, nt, pt: j * nt + (t + 1) % nt, "boundary"),
    (lambda t, j, nt, pt: j * 32 + t, "more than once"),
    (lambda t, j, nt, pt: t, "never touched"),
    (lambda t, j, nt, pt: j * (nt - 1) + t, "never touched"),
    (lambda t, j, nt, pt: j * nt + t + 1, "indices in"),
])
def test_coalesced_names_mistakes(wrong, words):
    assert words in failure(ch01.check_coalesced_element, wrong)
