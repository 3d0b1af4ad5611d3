"""A failed step rewinds the random streams to its start (`RandomState.mark` / `rewind`), and
numpy's and python's states are read from raw bytes while the loop does not draw from them
(`NumpyState`, `PythonState`): the redone step must draw exactly what the step drew the first
time, whatever the loop drew before."""

import random

import numpy
import pytest
import torch

from elastic.worker.random_state import NumpyState, PythonState, RandomState


def _draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), numpy.random.rand(2).tolist(), float(numpy.random.randn()))


@pytest.mark.parametrize("before", ["nothing", "uniforms", "one gaussian", "two gaussians"])
def test_a_rewound_step_draws_what_it_drew_the_first_time(before):
    numpy.random.seed(3)
    state = RandomState()
    for step in range(4):
        state.mark()
        if step % 2:
            # Between the marks the loop drew (or not), leaving numpy with or without a cached gaussian.
            {"nothing": lambda: None, "uniforms": lambda: numpy.random.rand(5),
             "one gaussian": numpy.random.randn, "two gaussians": lambda: numpy.random.randn(2)}[before]()
    state.mark()
    first = _draws()
    state.rewind()
    assert _draws() == first


def test_a_cached_gaussian_used_without_a_draw_is_still_rewound():
    # randn() draws two normals from the key and caches the second; the next randn() returns the
    # cache without moving the key or the position, so the raw bytes alone cannot see it.
    numpy.random.seed(5)
    numpy.random.randn()
    reader = NumpyState()
    marked = reader.read()
    cached = float(numpy.random.randn())
    assert reader.read()[3] == 0  # the cache was used: a state the raw bytes of the last read share
    numpy.random.set_state(marked)
    assert float(numpy.random.randn()) == cached


def test_an_unchanged_generator_is_read_from_its_raw_bytes_and_a_drawn_one_in_full():
    numpy.random.seed(7)
    reader = NumpyState()
    first = reader.read()
    assert reader.read() is first  # nothing drawn: the last full read stands
    numpy.random.rand()
    drawn = reader.read()
    assert drawn is not first and drawn[2] != first[2]
    numpy.random.seed(7)
    assert reader.read()[1].tolist() == first[1].tolist()


def test_another_global_bit_generator_is_read_in_full():
    original = numpy.random.get_bit_generator()
    numpy.random.set_bit_generator(numpy.random.PCG64(11))
    try:
        state = RandomState()
        state.mark()
        first = _draws()
        state.rewind()
        assert _draws() == first
    finally:
        numpy.random.set_bit_generator(original)


def test_python_state_is_read_from_raw_bytes_while_unchanged_and_equals_getstate():
    random.seed(11)
    reader = PythonState()
    first = reader.read()
    assert first == random.getstate()
    assert reader.read()[1] is first[1]  # nothing drawn: the last full read's key stands
    random.random()
    drawn = reader.read()
    assert drawn == random.getstate() and drawn[1] is not first[1]
    random.seed(11)
    assert reader.read() == first


def test_python_gaussian_cached_without_moving_the_key_is_still_rewound():
    # gauss() draws two normals and caches one; the next gauss() returns the cache, which moves
    # no byte of the key: the second mark reads the same bytes as the first, with no gaussian cached.
    random.seed(13)
    state = RandomState()
    random.gauss(0.0, 1.0)
    state.mark()
    random.gauss(0.0, 1.0)
    state.mark()
    fresh = random.gauss(0.0, 1.0)
    state.rewind()
    assert random.gauss(0.0, 1.0) == fresh
