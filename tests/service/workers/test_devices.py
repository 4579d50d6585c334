"""One engine per device, without real processes: which engines ``--devices`` asks for, the totals
over several engines' stats and metrics, and ``EnginePool`` routing between two engine servers in
this event loop (fewest rows outstanding, never a split request, a gone engine out of rotation)."""

import asyncio
import json

import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from fusedserve.models.timing import LayerTiming
from fusedserve.service.engine.batcher import Batcher
from fusedserve.service.engine.state import ModelInfo, ServiceState
from fusedserve.service.errors import NotReady
from fusedserve.service.settings import Settings
from fusedserve.service.stats import devices as stats_devices
from fusedserve.service.stats.metrics import Metrics
from fusedserve.service.stats.service_stats import ServiceStats
from fusedserve.service.workers.devices import Slot, engine_settings, engines
from fusedserve.service.workers.engine_process import EngineServer
from fusedserve.service.workers.pool import EnginePool

from .test_remote_engine import ROW, GatedRunner, HeldConnection


# -- which engines ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "gpus", "want"), [
    ({}, 0, [Slot("auto", "auto")]),  # no GPU: one engine picks its device as before
    ({}, 1, [Slot("auto", "auto")]),
    ({}, 3, [Slot("cuda:0", "cuda:0"), Slot("cuda:1", "cuda:1"), Slot("cuda:2", "cuda:2")]),
    ({"device": "cuda:1"}, 3, [Slot("cuda:1", "cuda:1")]),  # an explicit device keeps its one engine
    ({"devices": "all"}, 2, [Slot("cuda:0", "cuda:0"), Slot("cuda:1", "cuda:1")]),
    ({"devices": "cuda:2, cuda:0"}, 0, [Slot("cuda:2", "cuda:2"), Slot("cuda:0", "cuda:0")]),
    ({"devices": "cpu,cpu", "device": "cpu"}, 0, [Slot("cpu:0", "cpu"), Slot("cpu:1", "cpu")]),
])
def test_devices_name_the_engines(flags, gpus, want):
    assert engines(Settings(**flags), gpus=lambda: gpus) == want


def test_all_without_a_gpu_and_bad_lists_say_what_to_fix():
    with pytest.raises(ValueError, match="no GPU is visible.*--devices cpu"):
        engines(Settings(devices="all"), gpus=lambda: 0)
    for value, why in [("gpu0", "'gpu0' is none of them"), ("cuda:0,cuda:0", "names a GPU twice"),
                       ("cuda:1,,cpu", "'' is none of them")]:
        with pytest.raises(ValidationError, match=why):
            Settings(devices=value)
    with pytest.raises(ValidationError, match="device 'cpu' and devices 'cuda:0' disagree"):
        Settings(device="cpu", devices="cuda:0")


def test_each_engine_gets_its_own_device_and_the_secrets():
    settings = Settings(devices="cpu,cpu", api_key="k")
    child = Settings(**json.loads(engine_settings(settings, Slot("cpu:1", "cpu")).handoff()))
    assert (child.device, child.devices, child.api_key.get_secret_value()) == ("cpu", "cpu", "k")


# -- totals over engines ---------------------------------------------------------------------------
def _engine_stats(batch: int, waits: list[float], layer_s: float) -> ServiceStats:
    stats = ServiceStats(reservoir=8)
    stats.record_batch("m", batch, waits, 0.01)
    stats.record_request("m", ok=True, seconds=waits[0], count=len(waits))
    stats.record_outcome("m", "ok", len(waits))
    stats.record_outcome("", "unknown_model")
    stats.record_layer(LayerTiming(model="m", layer="layers.0", rows=batch, M=batch, N=7, K=5, dtype="float32",
                                   backend="torch", kernel="torch", config="", seconds=layer_s))
    return stats


def test_merged_stats_add_counts_and_take_percentiles_over_every_engine():
    a, b = _engine_stats(3, [0.001, 0.002, 0.003], 1e-3), _engine_stats(1, [0.009], 3e-3)
    exports = [orjson.loads(orjson.dumps(s.export(), option=orjson.OPT_NON_STR_KEYS)) for s in (a, b)]
    total = ServiceStats.merged(exports).snapshot()
    m = total["models"]["m"]
    assert m["batch_size_histogram"] == {"1": 1, "3": 1} and m["rows"] == 4 and m["batches"] == 2
    assert m["requests"] == {"success": 4, "failed": 0} and m["outcomes"] == {"ok": 4}
    # Waits 1, 2, 3 and 9 ms: the median of both engines' samples, not of either alone.
    assert m["queue_wait"]["p50_s"] == pytest.approx(0.0025) and m["queue_wait"]["count"] == 4
    assert total["unattributed_outcomes"] == {"unknown_model": 2}
    layers = {(r["M"], r["calls"]) for r in total["layers"]}
    assert layers == {(3, 1), (1, 1)}, total["layers"]  # a bucket per engine's batch size, kept apart
    counts = stats_devices.merge_counts([a.model_counts("m"), b.model_counts("m")])
    assert (counts["success"], counts["rows"], counts["batch_sizes"]) == (4, 4, {3: 1, 1: 1})


def _exposition(requests: int) -> str:
    from prometheus_client import generate_latest

    metrics = Metrics()
    metrics.record_request("m", "ok", requests)
    metrics.record_duration("m", 0.002, requests)
    return generate_latest(metrics.registry).decode()


def test_metrics_of_several_engines_are_one_valid_exposition_labelled_by_device():
    text = stats_devices.merge_metrics({"cuda:0": _exposition(3), "cuda:1": _exposition(5)})
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: each family once
    requests = {s.labels["device"]: s.value for s in families["fusedserve_requests"].samples}
    assert requests == {"cuda:0": 3.0, "cuda:1": 5.0}
    counts = [s for s in families["fusedserve_request_duration_seconds"].samples if s.name.endswith("_count")]
    assert sorted((s.labels["device"], s.value) for s in counts) == [("cuda:0", 3.0), ("cuda:1", 5.0)]
    assert sum(line.startswith("# TYPE fusedserve_requests_total ") for line in text.splitlines()) == 1
    assert stats_devices.with_label('x{a="}"} 1.0', "device", "cpu:0") == 'x{a="}",device="cpu:0"} 1.0'
    assert stats_devices.with_label("x 2.0", "device", "cpu:0") == 'x{device="cpu:0"} 2.0'


# -- routing between two engines in this event loop ------------------------------------------------
class _Engine:
    """An ``EngineServer`` serving model "m" on a ``GatedRunner``, on its own Unix socket."""

    def __init__(self, path: str):
        settings = Settings(device="cpu", grpc_port=0, workers=1, gc_freeze=False, max_batch_size=8)
        self.state = ServiceState.fresh(settings)
        self.state.models["m"] = ModelInfo("m", 3, 2, "float32", "torch", "cpu")
        self.runner = GatedRunner(fail=False)
        self.batcher = Batcher(self.runner, max_batch_size=8, max_delay_ms=1.0, max_queue_rows=64,
                               inline_batch_ms=0.0, recorders=(self.state.stats,))
        self.path = path
        self.connections: list[HeldConnection] = []
        self.killed = False

    async def start(self) -> None:
        self.batcher.start()
        self.state.batchers["m"], self.state.serving = self.batcher, True
        server = EngineServer(self.state)
        self.watch = asyncio.create_task(server.watch_status())

        def connect():
            self.connections.append(HeldConnection(server, len(self.connections) + 1))
            return self.connections[-1]

        self.listener = await asyncio.get_running_loop().create_unix_server(connect, self.path)

    async def kill(self) -> None:
        """As a process killed: no more connections, and every one open closes."""
        self.killed = True
        self.listener.close()
        for conn in self.connections:
            conn.transport.abort()
        self.runner.gate.set()
        self.watch.cancel()
        await self.batcher.stop()


@pytest.fixture
async def pool(tmp_path):
    members = [_Engine(str(tmp_path / f"engine-{i}.sock")) for i in range(2)]
    for engine in members:
        await engine.start()
    pool = EnginePool({"cpu:0": members[0].path, "cpu:1": members[1].path},
                      ServiceState.fresh(Settings(device="cpu", grpc_port=0, gc_freeze=False)))
    await pool.start()
    try:
        yield pool, members
    finally:
        for engine in members:
            engine.runner.gate.set()
        await pool.close()
        for engine in members:
            if not engine.killed:
                await engine.kill()


async def _until(check, what: str) -> None:
    for _ in range(300):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_requests_go_to_the_engine_with_fewest_rows_outstanding(pool):
    pool, (a, b) = pool
    assert pool.ready(), pool.reason()
    calls = [asyncio.create_task(pool.infer("m", np.full((3, 3), i, np.float32), 10.0)) for i in range(4)]
    # 4 requests of 3 rows from one front end: 2 to each engine, each whole (3 rows in one queue).
    await _until(lambda: a.runner.started.is_set() and b.runner.started.is_set(), "both engines got requests")
    assert pool.outstanding() == {"cpu:0": {"m": 6}, "cpu:1": {"m": 6}}
    # Each engine runs its 6 rows (held at the gate); a 5-row request then queues whole on one.
    big = asyncio.create_task(pool.infer("m", np.ones((5, 3), np.float32), 10.0))
    await _until(lambda: a.batcher.queued_rows + b.batcher.queued_rows == 5, "the 5-row request was queued")
    assert sorted([a.batcher.queued_rows, b.batcher.queued_rows]) == [0, 5], "the request was split"
    small = []
    for n in (6, 7):  # one after another, both to the engine with fewer rows outstanding (6, then 7; not 11)
        small.append(asyncio.create_task(pool.infer("m", ROW, 10.0)))
        await _until(lambda n=n: a.batcher.queued_rows + b.batcher.queued_rows == n, "a request was queued")
    assert sorted([a.batcher.queued_rows, b.batcher.queued_rows]) == [2, 5]
    a.runner.gate.set()
    b.runner.gate.set()
    outs = await asyncio.wait_for(asyncio.gather(*calls, big, *small), 10)
    for i, out in enumerate(outs[:4]):
        np.testing.assert_array_equal(out, np.full((3, 2), i, np.float32))
    np.testing.assert_array_equal(outs[4], np.ones((5, 2), np.float32))
    np.testing.assert_array_equal(outs[5], ROW[:, :2])
    assert pool.outstanding() == {"cpu:0": {"m": 0}, "cpu:1": {"m": 0}}


async def test_a_gone_engine_is_out_of_rotation_and_its_requests_answered(pool):
    pool, (a, b) = pool
    held = [asyncio.create_task(pool.infer("m", ROW, 10.0)) for _ in range(2)]  # one on each engine
    await _until(lambda: a.runner.started.is_set() and b.runner.started.is_set(), "both engines got requests")
    await a.kill()
    b.runner.gate.set()
    gone = [r for r in await asyncio.gather(*held, return_exceptions=True) if isinstance(r, BaseException)]
    assert len(gone) == 1 and isinstance(gone[0], NotReady) and "not running" in gone[0].message, gone
    assert gone[0].headers == {"Retry-After": "1"}
    await _until(lambda: not pool._members[0].connected(), "the front end saw the engine go")
    assert pool.ready() and pool.live(), pool.reason()  # the other engine serves every model
    for _ in range(6):  # every new request goes to the engine that is left
        np.testing.assert_array_equal(await asyncio.wait_for(pool.infer("m", ROW, 5.0), 5), ROW[:, :2])
    counts = await pool.model_counts("m")  # the stats of the engines that answer
    assert counts["success"] == 7, counts
    await b.kill()
    await _until(lambda: not pool._members[1].connected(), "the front end saw the second engine go")
    assert not pool.ready() and not pool.live()
    assert "engine cpu:0" in pool.reason() and "engine cpu:1" in pool.reason(), pool.reason()
    with pytest.raises(NotReady, match="no engine serves model 'm'"):
        await pool.infer("m", ROW, 5.0)
