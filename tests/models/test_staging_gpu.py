"""Staging on CUDA: rows in through pinned memory, outputs back as whole buckets where the padding is
a few bytes and as the rows alone where it is more, and the stream waited for either way; the copies
a graph holds itself."""

import pytest
import torch

from fusedserve.models.staging import Staging

pytestmark = pytest.mark.gpu

IN = 7


@pytest.mark.parametrize("out_features, rows, bucket", [
    (10, 3, 8),  # 200 padded bytes: the whole bucket comes back
    (1000, 37, 64),  # 108 KB of padding: only the rows
    (1000, 64, 64),  # no padding
    (1000, 1, 128),
    (24, 221, 221),
])
def test_copy_out_returns_the_rows_after_the_stream_finished(out_features, rows, bucket):
    staging = Staging("m", 256, IN, out_features, torch.device("cuda"))
    want = torch.randn(bucket, out_features, device="cuda")
    torch.cuda._sleep(5_000_000)  # a long kernel first: the copy must wait for what follows it
    out = want * 1.0
    got = staging.copy_out(out, rows)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert torch.equal(got, want[:rows].cpu())
    staging.copy_out(torch.zeros_like(out), rows)  # the next batch reuses the staging buffer...
    assert torch.equal(got, want[:rows].cpu())  # ...and the answer handed out is a copy of it


def test_a_16_bit_output_comes_back_as_float32():
    staging = Staging("m", 64, IN, 300, torch.device("cuda"))
    out = torch.randn(64, 300, device="cuda").bfloat16()
    got = staging.copy_out(out, 5)
    assert got.dtype == torch.float32 and torch.equal(got, out[:5].float().cpu())


def test_copy_in_fills_the_first_rows_and_leaves_the_rest():
    staging = Staging("m", 16, IN, 3, torch.device("cuda"))
    staging.input.fill_(-1.0)
    x = torch.randn(5, IN)
    staging.copy_in(x, 5)
    torch.cuda.synchronize()
    assert torch.equal(staging.input[:5].cpu(), x)
    assert bool((staging.input[5:] == -1.0).all())


def test_a_graph_with_the_captured_copies_answers_each_batchs_rows():
    staging = Staging("m", 16, IN, IN, torch.device("cuda"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staging.copy_in_captured(8)
        out = staging.input[:8] * 2 + 1
        staging.copy_out_captured(out)
    for rows in (5, 8, 2):
        x = torch.randn(rows, IN)
        staging.fill(x, rows)
        torch.cuda._sleep(5_000_000)  # a long kernel first: take must wait for the replay behind it
        graph.replay()
        got = staging.take(rows)
        assert torch.equal(got, x * 2 + 1), f"rows={rows}"
        assert torch.equal(staging.input[:rows].cpu(), x)  # the device input holds the batch, as run leaves it
