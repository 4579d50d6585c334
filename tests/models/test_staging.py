"""Staging's rule for when a graph that copies whole buckets serves a batch (the copies need a GPU:
tests/models/test_staging_gpu.py)."""

import pytest
import torch

from fusedserve.models.staging import _GRAPH_COPY_PADDING_BYTES, Staging


@pytest.mark.parametrize("in_features, out_features", [(64, 10), (7, 1000), (3000, 5000)])
def test_a_batch_pads_cheaply_up_to_the_byte_limit(in_features, out_features):
    staging = Staging("m", 256, in_features, out_features, torch.device("cpu"))
    row_bytes = 4 * (in_features + out_features)
    most = _GRAPH_COPY_PADDING_BYTES // row_bytes  # the padded rows the limit allows
    assert staging.pads_cheaply(200, 200)  # no padding is always cheap
    assert staging.pads_cheaply(200 - most, 200)
    assert not staging.pads_cheaply(200 - most - 1, 200)
