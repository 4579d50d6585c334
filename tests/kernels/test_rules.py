"""The one bucket rule: batches, runner buckets and tuning keys."""

import pytest
import torch

from fusedserve.kernels.rules import batch_buckets, bucket, bucket_rows, m_bucket, tuning_rows


@pytest.mark.parametrize("rows, cap, want", [(1, 64, 1), (3, 64, 4), (33, 64, 64), (65, 64, 64), (9, 10, 10),
                                             (5, 1, 1), (65, 1000, 128), (129, 1000, 144), (145, 1000, 160),
                                             (257, 1000, 288), (999, 1000, 1000), (1025, 8192, 1152)])
def test_a_bucket_is_a_power_of_two_then_an_eighth_of_an_octave_capped(rows, cap, want):
    assert bucket(rows, cap) == want


def test_past_128_rows_a_bucket_pads_at_most_an_eighth():
    for rows in range(129, 9000):
        assert rows <= bucket(rows, 10**6) <= rows * 1.125


@pytest.mark.parametrize("M,want", [(1, 1), (2, 2), (3, 4), (17, 32), (64, 64), (65, 128), (128, 128),
                                    (129, 144), (214, 224), (256, 256), (257, 288), (275, 288), (1637, 1664),
                                    (3073, 3072 + 256), (4096, 4096), (4097, 4096), (100000, 4096)])
def test_tuning_keys_are_the_same_buckets_up_to_the_cap(M, want):
    assert m_bucket(M) == want


def test_every_runner_bucket_is_tuned_at_its_own_size():
    assert all(m_bucket(b) == b for b in batch_buckets(4096))


@pytest.mark.parametrize("bad", [0, -3])
def test_an_empty_batch_has_no_bucket(bad):
    with pytest.raises(ValueError, match="rows"):
        bucket(bad, 64)
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_buckets(bad)


def test_runner_buckets_are_powers_of_two_then_eighths_then_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert batch_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, *range(144, 257, 16), 288, 300]
    # every batch size lands in one of them, as the runner and the batcher compute it
    assert all(bucket(rows, 100) in batch_buckets(100) for rows in range(1, 101))


@pytest.mark.parametrize("M, stride, timed_rows", [(33, 64, 64), (1, 1, 1), (3, 100, 4), (64, 64, 64),
                                                   (5000, 64, 5000)])
def test_a_bucket_is_tuned_on_its_largest_batch(M, stride, timed_rows):
    # The runner pads batches to the bucket: the choice for M=33..64 is timed at 64 rows (the
    # first M's rows repeated, same row stride), whichever M in the bucket came first.
    x = torch.randn(M, stride)[:, :40] if stride > 40 else torch.randn(M, 40)
    grown = bucket_rows(x)
    assert tuning_rows(M) == timed_rows == grown.shape[0] and grown.shape[1] == 40
    assert grown is x if timed_rows == M else grown.stride() == (stride if stride > 40 else 40, 1)
    assert torch.equal(grown[:M], x) and torch.equal(grown[M:], x.repeat(timed_rows // M + 1, 1)[M:timed_rows])


def test_rows_with_a_short_stride_grow_into_aligned_rows():
    # A broadcast row (stride 0) is legal input; the grown copy packs rows 16-byte aligned, as TMA needs.
    x = torch.randn(100, dtype=torch.bfloat16).as_strided((3, 100), (0, 1))
    grown = bucket_rows(x)
    assert grown.shape == (4, 100) and grown.stride() == (104, 1)  # 208 bytes per row
    assert torch.equal(grown, x[:1].expand(4, 100))
