"""The obvious alternatives to fusedserve: a plain FastAPI app, the model inline in the handler.

No batching; the same JSON in and out as fusedserve's ``POST /infer``. Settings from NAIVE_REPOSITORY
and NAIVE_DEVICE (default cpu). Two apps, one route shape (``naive_app``):

- ``create_app``: torch eager (the models' torch backend) on a fusedserve model repository (default:
  the shipped one), 1 torch thread on a CPU.
- ``create_onnx_app``: onnxruntime with its default session options on every ``<model>/model.onnx``
  of the repository (the file a user has), on its CUDA execution provider where NAIVE_DEVICE is cuda
  and it is installed, else its CPU one; ``GET /providers`` says which runs each model.

``uvicorn --factory naive_fastapi:create_app --app-dir bench/peers --workers N`` (bench/servers.py
starts it so, with the checkout on PYTHONPATH).
"""

import os
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

ONNX_FILE = "model.onnx"  # create_onnx_app's file in each model folder


class InferRequest(BaseModel):
    model: str | None = None
    inputs: list[list[float]]


def ort_providers(device: str) -> list[str]:
    """onnxruntime's CUDA execution provider (CPU behind it) where ``device`` is cuda and it is installed,
    else its CPU one."""
    import onnxruntime

    if device.startswith("cuda") and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def naive_app(load: Callable[[], dict], compute: Callable) -> FastAPI:
    """The app around ``load() -> {name: model}`` (run by the lifespan; kept in ``app.state.models``) and
    ``compute(model, rows) -> output rows``, called inline in the handler."""
    models = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        models.update(load())
        yield

    app = FastAPI(lifespan=lifespan)
    app.state.models = models

    @app.get("/v2/health/ready")
    async def ready() -> dict:
        return {"ready": True}

    @app.post("/infer")
    async def infer(request: InferRequest) -> dict:
        name = request.model or next(iter(models))
        if name not in models:
            raise HTTPException(404, f"no model {name!r}")
        return {"model": name, "outputs": compute(models[name], request.inputs)}

    return app


def create_app() -> FastAPI:
    import torch

    from fusedserve.models import load_repository

    device = os.environ.get("NAIVE_DEVICE", "cpu")

    def load() -> dict:
        if device == "cpu":
            torch.set_num_threads(1)  # one thread per worker process: workers share the cores
        return load_repository(os.environ.get("NAIVE_REPOSITORY") or None, device=device, backend="torch")

    def compute(model, rows: list) -> list:
        with torch.inference_mode():
            return model(torch.tensor(rows, dtype=torch.float32, device=device)).float().cpu().tolist()

    return naive_app(load, compute)


def create_onnx_app() -> FastAPI:
    import numpy as np
    import onnxruntime

    root, device = Path(os.environ["NAIVE_REPOSITORY"]), os.environ.get("NAIVE_DEVICE", "cpu")

    def load() -> dict:
        files = sorted(root.glob(f"*/{ONNX_FILE}"))
        if not files:
            raise FileNotFoundError(f"no <model>/{ONNX_FILE} under {root}")
        return {f.parent.name: onnxruntime.InferenceSession(str(f), providers=ort_providers(device)) for f in files}

    def compute(session, rows: list) -> list:
        return session.run(None, {session.get_inputs()[0].name: np.asarray(rows, dtype=np.float32)})[0].tolist()

    app = naive_app(load, compute)

    @app.get("/providers")
    async def providers() -> dict:
        return {name: session.get_providers()[0] for name, session in app.state.models.items()}

    return app
