"""The obvious alternative to fusedserve: a plain FastAPI app, the model inline in the handler.

No batching, torch eager (the models' torch backend), 1 torch thread on a CPU; the same JSON in and
out as fusedserve's ``POST /infer``. Settings from NAIVE_REPOSITORY (default: the shipped one) and
NAIVE_DEVICE (default cpu). ``uvicorn --factory naive_fastapi:create_app --app-dir bench/peers
--workers N`` (bench/servers.py starts it so, with the checkout on PYTHONPATH).
"""

import os
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from fusedserve.models import load_repository


class InferRequest(BaseModel):
    model: str | None = None
    inputs: list[list[float]]


def create_app() -> FastAPI:
    device = os.environ.get("NAIVE_DEVICE", "cpu")
    models = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if device == "cpu":
            torch.set_num_threads(1)  # one thread per worker process: workers share the cores
        models.update(load_repository(os.environ.get("NAIVE_REPOSITORY") or None, device=device, backend="torch"))
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/v2/health/ready")
    async def ready() -> dict:
        return {"ready": True}

    @app.post("/infer")
    async def infer(request: InferRequest) -> dict:
        name = request.model or next(iter(models))
        if name not in models:
            raise HTTPException(404, f"no model {name!r}")
        with torch.inference_mode():
            y = models[name](torch.tensor(request.inputs, dtype=torch.float32, device=device))
        return {"model": name, "outputs": y.float().cpu().tolist()}

    return app
