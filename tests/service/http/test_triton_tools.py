"""The Triton extensions that perf_analyzer and model_analyzer read before anything else (model
configuration, statistics, server metadata's extensions), through unmodified ``tritonclient.http``
and ``tritonclient.grpc`` against a real server (one process, and --workers 2) on free ports."""

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from ..conftest import Server, write_repository

MAX_BATCH, DELAY_MS = 16, 3.0
ROWS = np.array([[0.5, -1.0, 2.0], [3.0, 0.0, -7.0]], dtype=np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    s = Server(write_repository(tmp_path_factory.mktemp("repo")), tmp_path_factory.mktemp("log") / "server.log",
               "--max-batch-size", str(MAX_BATCH), "--max-delay-ms", str(DELAY_MS), "--workers", request.param)
    try:
        s.wait_ready()
        s.http = triton_http.InferenceServerClient(f"127.0.0.1:{s.port}")
        s.grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        yield s
    finally:
        s.stop()


def pytest_generate_tests(metafunc):
    if "server" in metafunc.fixturenames:  # one process, and a supervisor with an engine and two front ends
        metafunc.parametrize("server", ["1", "2"], ids=["workers1", "workers2"], indirect=True, scope="module")


def _tensors(meta: list, config: list) -> None:
    """A config's input or output list says what the metadata says (the batch dim left out)."""
    assert [t["name"] for t in config] == [t["name"] for t in meta], (config, meta)
    for m, c in zip(meta, config, strict=True):
        assert c["data_type"] == f"TYPE_{m['datatype']}", (c, m)
        assert [int(d) for d in c["dims"]] == m["shape"][1:], (c, m)  # proto3 JSON: int64 as strings


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", ["tiny", "wide"])
def test_model_config_matches_metadata_both_protocols(server, model):
    meta = server.http.get_model_metadata(model)
    for config in (server.http.get_model_config(model), server.http.get_model_config(model, model_version="1"),
                   server.grpc.get_model_config(model, as_json=True)["config"]):
        assert config["name"] == model and config["backend"] == "fusedserve", config
        assert int(config["max_batch_size"]) == MAX_BATCH, config
        assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == DELAY_MS * 1000, config
        _tensors(meta["inputs"], config["input"])
        _tensors(meta["outputs"], config["output"])
    # HTTP's JSON as Triton writes it: numbers, not proto3 JSON's strings for 64-bit fields.
    assert server.http.get_model_config(model)["input"][0]["dims"] == meta["inputs"][0]["shape"][1:]
    # gRPC's message: the DataType enum, dims as int64 without the batch dim.
    config = server.grpc.get_model_config(model).config
    assert config.input[0].data_type == triton_grpc.model_config_pb2.TYPE_FP32, config
    assert list(config.input[0].dims) == meta["inputs"][0]["shape"][1:], config


@pytest.mark.timeout(60)
def test_unknown_model_or_version_answers_like_metadata(server):
    for call in (server.http.get_model_metadata, server.http.get_model_config):
        with pytest.raises(InferenceServerException, match="unknown model 'nope'; loaded models") as err:
            call("nope")
        assert err.value.status() == "404", err.value.status()
    r = httpx.get(f"{server.url}/v2/models/nope/config")
    assert r.status_code == 404 and r.text == httpx.get(f"{server.url}/v2/models/nope").text, r.text
    for call in (server.grpc.get_model_metadata, server.grpc.get_model_config, server.grpc.get_inference_statistics):
        with pytest.raises(InferenceServerException, match="unknown model 'nope'; loaded models") as err:
            call("nope")
        assert err.value.status() == "StatusCode.NOT_FOUND", err.value.status()
    with pytest.raises(InferenceServerException, match="has only version '1' loaded") as err:
        server.grpc.get_model_config("tiny", model_version="7")
    assert err.value.status() == "StatusCode.NOT_FOUND", err.value.status()


def _infer(client, module, model="tiny") -> None:
    x = module.InferInput("input", list(ROWS.shape), "FP32")
    x.set_data_from_numpy(ROWS)
    client.infer(model, [x])


@pytest.mark.timeout(60)
def test_grpc_statistics_grow_and_match_http(server):
    def tiny(stats: dict) -> dict:
        return next(s for s in stats["model_stats"] if s["name"] == "tiny")

    before = tiny(server.grpc.get_inference_statistics("tiny", as_json=True))
    for _ in range(3):
        _infer(server.grpc, triton_grpc)
        _infer(server.http, triton_http)
    after = server.grpc.get_inference_statistics("tiny", as_json=True)
    assert [s["name"] for s in after["model_stats"]] == ["tiny"], after
    after = tiny(after)
    # proto3 JSON writes 64-bit counts as strings and leaves out what is 0
    count = int(after["inference_count"]) - int(before.get("inference_count", 0))
    assert count == 6 * len(ROWS), (before, after)
    assert int(after["execution_count"]) > int(before.get("execution_count", 0)), (before, after)
    success = after["inference_stats"]["success"]
    assert int(success["count"]) >= 6 and int(success["ns"]) > 0, after
    assert int(after["inference_stats"]["compute_infer"]["ns"]) > 0, after
    http = tiny(server.http.get_inference_statistics("tiny"))  # nothing ran since: the same figures
    assert (http["inference_count"], http["execution_count"], http["inference_stats"]["success"]["count"]) == \
        (int(after["inference_count"]), int(after["execution_count"]), int(success["count"])), (http, after)
    # An empty name: every model, over both protocols.
    for every in (server.grpc.get_inference_statistics(as_json=True), server.http.get_inference_statistics()):
        assert sorted(s["name"] for s in every["model_stats"]) == ["tiny", "wide"], every


@pytest.mark.timeout(60)
def test_server_metadata_lists_only_extensions_that_answer(server, request):
    listed = server.http.get_server_metadata()["extensions"]
    assert list(server.grpc.get_server_metadata().extensions) == listed, listed
    assert {"binary_tensor_data", "statistics"} <= set(listed), listed
    # each one listed answers, over both protocols
    x = triton_http.InferInput("input", list(ROWS.shape), "FP32")
    x.set_data_from_numpy(ROWS, binary_data="binary_tensor_data" in listed)
    assert server.http.infer("tiny", [x]).as_numpy("output") is not None
    if "statistics" in listed:
        assert server.http.get_inference_statistics("tiny")["model_stats"]
        assert server.grpc.get_inference_statistics("tiny").model_stats
    assert "model_configuration" in listed, listed
    assert server.http.get_model_config("tiny")["name"] == "tiny"
    assert server.grpc.get_model_config("tiny").config.name == "tiny"
    one_process = request.node.callspec.params["server"] == "1"
    assert ("model_repository" in listed) == one_process, listed  # --workers N serves no model control
    if one_process:
        assert {m["name"] for m in server.http.get_model_repository_index()} == {"tiny", "wide"}
        assert {m.name for m in server.grpc.get_model_repository_index().models} == {"tiny", "wide"}
