"""Model control, the KServe v2 repository extension (Triton's routes): the repository's models and
their state, and loading or unloading one while the others serve. Admin routes: ``--admin-api-key``
guards them (service.security)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from fusedserve.service.errors import BadInput, NotServed
from fusedserve.service.http.codec import parse_json, read_body

if TYPE_CHECKING:  # the control, and torch with it, lives only where the models do
    from fusedserve.service.engine.model_control import ModelControl

router = APIRouter(prefix="/v2/repository", tags=["model repository"])


def _control(request: Request) -> ModelControl:
    control = request.app.state.control
    if control is None:
        raise NotServed("model control is not served with --workers > 1 yet: run one process (--workers 1) "
                        "to load and unload models while serving")
    return control


@router.post("/index", summary="Every model of the repository: version, state (READY or UNAVAILABLE), reason")
async def index(request: Request) -> list[dict]:
    raw = await read_body(request, 4096)
    body = parse_json(raw) if raw.strip() else {}
    if not isinstance(body, dict) or not isinstance(body.get("ready", False), bool):
        raise BadInput('body must be empty or {"ready": true|false}')
    return _control(request).index(ready_only=body.get("ready", False))


@router.post("/models/{model}/load", summary="Load the model's latest version; it serves once warm")
async def load(request: Request, model: str) -> dict:
    await _control(request).load(model)
    return {}


@router.post("/models/{model}/unload", summary="Stop serving the model (queued requests are answered)")
async def unload(request: Request, model: str) -> dict:
    await _control(request).unload(model)
    return {}
