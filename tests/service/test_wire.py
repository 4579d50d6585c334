"""The frames between front ends and the engine process (``service.wire``), split however the
stream cuts them: rows and outputs bit-exact, errors back as their own class."""

import numpy as np
import pytest

from fusedserve.service import wire
from fusedserve.service.errors import QueueFull


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
    model, rows, timeout_s = wire.read_infer(frames[0][2])
    assert (model, timeout_s) == (2, 0.25) and rows.flags.writeable  # torch may write what it is handed
    np.testing.assert_array_equal(rows, x)
    np.testing.assert_array_equal(wire.read_result(frames[2][2]), out)
    error = wire.read_error(frames[3][2])
    assert isinstance(error, QueueFull) and error.status == 503 and error.headers == {"Retry-After": "1"}
