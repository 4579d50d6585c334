"""fusedserve_queued_rows, the gauge the HorizontalPodAutoscaler scales on (deploy/base/hpa.yaml)."""

from dataclasses import dataclass

from prometheus_client import generate_latest

from fusedserve.service.stats.metrics import Metrics


@dataclass
class Queue:
    queued_rows: int


def test_gauge_reads_each_queue_at_scrape_time():
    queues = {"b": Queue(0)}
    metrics = Metrics()
    metrics.watch_queues(queues)
    queues["b"].queued_rows = 12
    queues["a"] = Queue(3)  # a model that came later is exported too
    text = generate_latest(metrics.registry).decode()
    assert 'fusedserve_queued_rows{model="a"} 3.0' in text
    assert 'fusedserve_queued_rows{model="b"} 12.0' in text


async def test_app_exports_every_models_queue(client):  # the client fixture waits for readiness
    text = (await client.get("/metrics")).text
    for model in ("tiny", "wide"):
        assert f'fusedserve_queued_rows{{model="{model}"}} 0.0' in text, text[-2000:]
