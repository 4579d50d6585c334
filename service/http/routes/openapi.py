"""The OpenAPI document as the app answers: ``/infer``'s request and answer as schemas, and every error
as ``{"error": "..."}`` (``Error``), the body the app sends, in place of the framework's 422 shape that
it never sends; built once, on the first ``GET /openapi.json``. ``GET /docs`` (and ``/redoc``) is a page
of our own shipped in the package (``api_docs.html``) that draws it, so it works offline."""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from fusedserve.service.classification import TOP_K

# One handwritten 0 of the shipped digits model (8x8 pixels, 0-16), so "Try it" works as shipped.
INFER_EXAMPLE = {"model": "digits", "inputs": [[
    0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4, 12, 0, 0, 8, 8, 0,
    0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5, 10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0]]}

_ROWS = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "additionalProperties": False,
              "properties": {"error": {"type": "string", "description": "what went wrong, and what to fix"}}},
    "InferRequest": {
        "type": "object", "required": ["inputs"],
        "properties": {
            "model": {"type": "string", "description": "the model's name; may be left out when one is served"},
            "inputs": {**_ROWS, "description": "rows of the model's in_features numbers each (finite)"},
            TOP_K: {"type": "integer", "minimum": 1, "description": "also answer each row's k best classes"}}},
    "InferResponse": {
        "type": "object", "required": ["model", "outputs"],
        "properties": {
            "model": {"type": "string"},
            "outputs": {**_ROWS, "description": "one row of the model's out_features numbers per input row"},
            "classes": {"type": "array", "description": f"with {TOP_K}: per row, its best classes first",
                        "items": {"type": "array", "items": {
                            "type": "object", "required": ["index", "score"],
                            "properties": {"index": {"type": "integer"}, "score": {"type": "number"},
                                           "label": {"type": "string"}}}}}}},
}

_ANY = {401: "a key is required and was missing or wrong (FUSEDSERVE_API_KEY)",
        500: "a bug: answered with the request id, logged and counted"}
_MODEL = {404: "no such model (the message lists the served ones)",
          503: "the model is not ready, or the server is draining"}
_INFERENCE = {413: "the body is over --max-body-bytes", 415: "the Content-Type is not JSON",
              422: "the body or a row is malformed (the message says which and how)",
              503: "the model's queue is full (Retry-After), it is not ready, or the server is draining",
              504: "the request was still queued at its deadline"}


def _errors(path: str, method: str) -> dict[int, str]:
    """The error answers an operation may give, with why."""
    errors = dict(_ANY)
    if "{model}" in path or path == "/infer":
        errors.update(_MODEL)
    if method == "post" and (path == "/infer" or path.endswith("/infer")):
        errors.update(_INFERENCE)
    return errors


def document(app: FastAPI) -> dict:
    """The app's OpenAPI document (``app.openapi``), with our schemas and error answers."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas.update(SCHEMAS)
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
        for path, operations in doc["paths"].items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for code, why in sorted(_errors(path, method).items()):
                    responses[str(code)] = {"description": why, "content": error}
        infer = doc["paths"]["/infer"]["post"]
        infer["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/InferRequest"}, "example": INFER_EXAMPLE}}}
        infer["responses"]["200"] = {"description": "the model's outputs", "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/InferResponse"}}}}
        app.openapi_schema = doc
    return app.openapi_schema


router = APIRouter()


@functools.cache
def _page() -> bytes:
    return (resources.files("fusedserve.service.http.routes") / "api_docs.html").read_bytes()


@router.get("/docs", include_in_schema=False)
@router.get("/redoc", include_in_schema=False)
async def docs_page() -> Response:
    return Response(_page(), media_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})
