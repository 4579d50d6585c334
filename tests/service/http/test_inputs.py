"""Decoding /infer rows: simdjson's flat-buffer path gives exactly the rows the checked (orjson) path
gives, and declines every body it cannot vouch for, which the checked path then explains."""

import json

import numpy as np
import orjson
import pytest

from fusedserve.service.http import codec as inputs
from fusedserve.service.http.codec import rows_from_json, simd_rows


def checked(raw: bytes, width: int) -> np.ndarray:
    return rows_from_json(orjson.loads(raw)["inputs"], "inputs", width, 10**6, raw)


WELL_FORMED = [
    b'{"model": "m", "inputs": [[1, 2.5, -3e-2]]}',
    b'{"inputs": [[0, -0.0, 1E3, 3.4e38], [7, 8, 9, 10]]}',  # ints, negative zero, the float32 edge
    b' { "inputs" : [ [ 1 , 2 ] , [ 3 , 4 ] , [ 5 , 6 ] ] , "model" : null } ',  # whitespace, null model
    b'{"inputs": [[16777217, 9007199254740993, 18446744073709551615, -9223372036854775808]]}',
]


@pytest.mark.parametrize("raw", WELL_FORMED)
def test_well_formed_rows_match_the_checked_path(raw):
    model, fast = simd_rows(raw, "inputs")
    assert model == json.loads(raw).get("model")
    x = inputs.check_rows(fast, "inputs", fast.shape[1], 10**6)
    np.testing.assert_array_equal(x, checked(raw, x.shape[1]))  # bit for bit: both read each number as a double
    assert x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable


def test_wide_random_rows_match_the_checked_path():
    rng = np.random.default_rng(5)
    for rows, width in [(1, 2048), (3, 130), (17, 1)]:  # widths as awkward as a model's
        values = rng.standard_normal((rows, width)) * 10.0 ** rng.integers(-30, 30, (rows, width))
        raw = orjson.dumps({"model": "wide", "inputs": values.tolist()})
        _, fast = simd_rows(raw, "inputs")
        np.testing.assert_array_equal(inputs.check_rows(fast, "inputs", width, 10**6), checked(raw, width))


DECLINED = {  # bodies the fast path must leave to the checked one: name -> body
    "not JSON": b"{inputs: [[1]]}",
    "empty": b"",
    "a list": b"[[1, 2]]",
    "no inputs": b'{"model": "m"}',
    "empty inputs": b'{"inputs": []}',
    "inputs a number": b'{"inputs": 5}',
    "ragged": b'{"inputs": [[1, 2], [3]]}',
    "nested deeper": b'{"inputs": [[[1, 2]], [[3, 4]]]}',
    "nested empty list": b'{"inputs": [[[1, 2], []], [3, 4]]}',
    "nested empty list in a long body": b'{"inputs": [[[1, 2], [], ' + b"1, " * 2999 + b"1], [" + b"1, " * 3001
                                        + b"1]]}",
    "a boolean": b'{"inputs": [[1, true]]}',
    "a null": b'{"inputs": [[1, null]]}',
    "a string": b'{"inputs": [[1, "2"]]}',
    "an object row beside a [ in a string": b'{"model": "[", "inputs": [[1, 2], {"a": 1, "b": 2}]}',
    "a string row beside a [ in a string": b'{"model": "[", "inputs": ["ab"]}',
    "beyond float64": b'{"inputs": [[1e400]]}',
    "an integer beyond 64 bits": b'{"inputs": [[100000000000000000000000000000000000000]]}',
    "NaN": b'{"inputs": [[NaN]]}',
    "trailing text": b'{"inputs": [[1]]} x',
    "too deep": b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "invalid UTF-8": b'{"model": "\xff", "inputs": [[1]]}',
    "another list": b'{"inputs": [[1, 2]], "tags": [1]}',
    "a repeated key": b'{"model": "a", "model": "b", "inputs": [[1, 2]]}',
}


@pytest.mark.parametrize("name", DECLINED)
def test_bodies_it_cannot_vouch_for_are_declined(name):
    assert simd_rows(DECLINED[name], "inputs") is None


async def test_a_well_formed_infer_body_never_reaches_orjson(client, monkeypatch):
    """The route takes the flat-buffer path for a good body, and the checked one for a bad body."""
    parsed = []
    monkeypatch.setattr(inputs.orjson, "loads", lambda raw, real=orjson.loads: parsed.append(raw) or real(raw))
    r = await client.post("/infer", json={"model": "tiny", "inputs": [[1, 2, 3], [4, 5, 6]]})
    assert r.status_code == 200, r.text
    assert len(r.json()["outputs"]) == 2 and parsed == []
    r = await client.post("/infer", json={"model": "tiny", "inputs": [[1, True, 3]]})
    assert r.status_code == 422 and "true/false" in r.json()["error"], r.text
    assert len(parsed) == 1
