"""Fixtures for the service tests: a tiny model repository written with models.save_model, and an
in-memory app with its lifespan running."""

import asyncio

import httpx
import pytest
import torch

import models
from service.app import create_app
from service.settings import Settings

IN, HIDDEN, OUT = 3, (17,), 2


def write_repository(root):
    """Two float32 models: "tiny" (3 -> 17 -> 2) and "wide" (5 -> 7 -> 4), seeded weights."""
    torch.manual_seed(0)
    models.save_model(models.MLP(models.MLPConfig(IN, HIDDEN, OUT)), root / "tiny")
    models.save_model(models.MLP(models.MLPConfig(5, (7,), 4)), root / "wide")
    return root


@pytest.fixture
def repository(tmp_path):
    return write_repository(tmp_path / "repo")


def reference(repository, name, rows):
    """What the model itself computes, in float32 on the CPU."""
    model = models.load_model(repository / name, device="cpu", backend="torch")
    with torch.no_grad():
        return model(torch.tensor(rows, dtype=torch.float32)).float().numpy()


async def wait_ready(client, timeout_s=60.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while loop.time() < end:
        r = await client.get("/v2/health/ready")
        if r.status_code == 200:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not ready after {timeout_s} s: {r.status_code} {r.text}")


@pytest.fixture
def settings(repository):
    return Settings(model_repository=repository, device="cpu", max_batch_size=8, max_delay_ms=5.0)


@pytest.fixture
async def client(settings):
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            await wait_ready(c)
            c.app = app
            yield c
