"""The frames between front ends and the engine process (``service.workers.wire``), split however the
stream cuts them: rows and outputs bit-exact, errors back as their own class."""

import numpy as np
import pytest

from fusedserve.service.errors import BadInput, QueueFull
from fusedserve.service.workers import wire


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_frames_survive_any_split_of_the_stream(chunk):
    x = np.random.default_rng(0).standard_normal((3, 17), dtype=np.float32)
    out = x[:, :5].copy()
    stream = b"".join([*(bytes(part) for part in wire.infer_frame(5, 2, x, 0.25)), wire.cancel_frame(5),
                       *(bytes(part) for part in wire.result_frame(6, out)),
                       wire.json_frame(wire.ERROR, 8, wire.error_payload(QueueFull("full", {"Retry-After": "1"})))])
    frames, reader = [], wire.Frames()
    for i in range(0, len(stream), chunk):
        frames += reader.feed(stream[i:i + chunk])
    assert [(kind, ident) for kind, ident, _ in frames] == [(wire.INFER, 5), (wire.CANCEL, 5), (wire.RESULT, 6),
                                                            (wire.ERROR, 8)]
    model, idents, counts, rows, timeout_s = wire.read_infer(frames[0][2])
    assert (model, idents, counts, timeout_s) == (2, [5], [3], 0.25)
    assert rows.flags.writeable  # torch may write what it is handed
    assert rows.flags.aligned and rows.flags.c_contiguous
    np.testing.assert_array_equal(rows, x)
    np.testing.assert_array_equal(wire.read_result(frames[2][2]), out)
    error = wire.read_error(frames[3][2])
    assert isinstance(error, QueueFull) and error.status == 503 and error.headers == {"Retry-After": "1"}


def test_an_infer_frame_of_the_wrong_length_is_refused():
    head, data = wire.infer_frame(1, 0, np.ones((2, 4), dtype=np.float32), 1.0)
    payload = bytearray((bytes(head) + bytes(data))[wire.HEADER.size:-2])
    with pytest.raises(BadInput, match="for 2 rows of 4"):
        wire.read_infer(payload)


def test_a_group_carries_each_requests_id_and_rows_in_order():
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((n, 5), dtype=np.float32) for n in (1, 3, 2)]
    group = wire.InferGroup(1, 5, 2.0)
    for ident, x in zip((7, 8, 9), parts, strict=True):
        group.add(ident, x)
    [(kind, ident, payload)] = wire.Frames().feed(b"".join(bytes(chunk) for chunk in group.frame()))
    model, idents, counts, rows, timeout_s = wire.read_infer(payload)
    assert (kind, model, idents, counts, timeout_s) == (wire.INFER, 1, [7, 8, 9], [1, 3, 2], 2.0)
    np.testing.assert_array_equal(rows, np.concatenate(parts))
    assert rows.flags.aligned and rows.flags.c_contiguous
