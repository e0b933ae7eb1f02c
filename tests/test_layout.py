"""The flat buffer's layout from the widths alone, held against where a real model's parameters sit in memory."""

from __future__ import annotations

import numpy as np
import pytest

from dtrain.layout import layer_sizes, layer_starts, parameter_count, parameter_spans, spans
from dtrain.nn import MLP


def memory_spans(model) -> list[tuple[int, int]]:
    """(offset, count) of each parameter, read off the addresses of its view into the flat buffer."""
    base, itemsize = model.flat_params.__array_interface__["data"][0], model.flat_params.itemsize
    return [((p.data.__array_interface__["data"][0] - base) // itemsize, p.data.size) for p in model.parameters()]


@pytest.mark.parametrize("sizes", [[4, 3], [784, 128, 10], [7, 5, 1, 9, 2]])
def test_the_layout_is_where_the_model_keeps_its_parameters(sizes):
    model = MLP(sizes, seed=0)
    assert parameter_spans(sizes) == memory_spans(model)
    assert parameter_count(sizes) == model.flat_params.size == model.num_parameters()
    starts = layer_starts(sizes)
    weights = [offset for offset, _ in memory_spans(model)[::2]]  # each layer starts with its weight
    assert starts == [*weights, model.flat_params.size]
    assert layer_sizes(sizes) == list(np.diff(starts))


def test_spans_lay_counts_end_to_end():
    assert spans([3, 0, 5]) == [(0, 3), (3, 0), (3, 5)]
    assert spans([]) == []
