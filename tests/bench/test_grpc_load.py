"""bench/grpc_load.py: the requests it sends are ones the service accepts, and its summary's ratios."""

import json

from tritonclient.grpc import service_pb2 as pb

from bench.grpc_load import grpc_requests, http_requests, rows, summarize
from fusedserve.service import grpc_codec
from fusedserve.service.state import ModelInfo

DIGITS = ModelInfo("digits", 64, 10, "float32", "torch", "cpu")


def test_requests_carry_one_row_each_as_the_service_decodes_it():
    x = rows(3)
    for i, wire in enumerate(grpc_requests(x)):
        got, raw = grpc_codec.decode(pb.ModelInferRequest.FromString(wire), DIGITS, 64)
        assert raw and got.tolist() == x[i:i + 1].tolist()
    v2, infer = http_requests(8000, x, "http_v2")[1], http_requests(8000, x, "http_infer")[1]
    head, body = v2.split(b"\r\n\r\n", 1)
    n = int(next(line.split(b": ")[1] for line in head.split(b"\r\n") if line.startswith(b"Inference-Header")))
    assert body[n:] == x[1].tobytes() and json.loads(body[:n])["inputs"][0]["shape"] == [1, 64]
    assert json.loads(infer.split(b"\r\n\r\n", 1)[1])["inputs"] == [x[1].tolist()]


def test_summary_takes_medians_and_ratios_per_client_count():
    def run(mode, clients, rps, cpu):
        return {"mode": mode, "clients": clients, "rps": rps, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0,
                "server_cpu_ms_per_request": cpu, "client_cpu_ms_per_request": 0.1, "mean_batch_rows": 1.0}

    results = [run("grpc", 64, r, 0.3) for r in (1000, 1300, 1200)] + \
              [run("http_v2", 64, r, 0.2) for r in (1000, 900, 1100)] + [run("http_infer", 64, 1000, 0.25)]
    (row,) = summarize(results, target=1.2)
    assert row["grpc"]["rps"] == 1200 and row["http_v2"]["rps"] == 1000
    assert row["grpc_over_http_v2"] == {"rps": 1.2, "met": True, "server_cpu_per_request": 1.5}
    assert row["grpc_over_http_infer"]["met"] is True and "grpc_shared_over_http_v2" not in row
