"""The OpenAPI document says what the app does: errors as {"error": ...}, /infer's body and answer as
schemas, an /infer example the shipped server answers; /docs and /redoc load nothing from elsewhere."""

import re

import httpx

from fusedserve.service.app import create_app
from fusedserve.service.http.routes.openapi import INFER_EXAMPLE, SCHEMAS
from fusedserve.service.settings import Settings

from ..conftest import wait_ready

ERROR_REF = {"$ref": "#/components/schemas/Error"}


async def test_every_error_answer_is_the_error_body_the_app_sends(client):
    doc = (await client.get("/openapi.json")).json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            errors = {code: r for code, r in operation["responses"].items() if code[0] in "45"}
            assert "401" in errors and "500" in errors, (method, path)
            for code, answer in errors.items():
                assert answer["content"]["application/json"]["schema"] == ERROR_REF, (method, path, code)
    r = await client.post("/infer", json={"model": "tiny", "inputs": [[1, 2]]})  # a row too short
    assert r.status_code == 422 and list(r.json()) == ["error"], r.text
    assert "422" in doc["paths"]["/infer"]["post"]["responses"]
    assert "404" in doc["paths"]["/v2/models/{model}"]["get"]["responses"]


async def test_infer_is_documented_with_its_schemas():
    body = (await _doc())["paths"]["/infer"]["post"]
    content = body["requestBody"]["content"]["application/json"]
    assert content["schema"] == {"$ref": "#/components/schemas/InferRequest"}
    assert body["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/InferResponse"}
    assert set(SCHEMAS["InferRequest"]["properties"]) >= set(content["example"])


async def _doc() -> dict:
    app = create_app(Settings(device="cpu"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c:
        return (await c.get("/openapi.json")).json()


async def test_the_infer_example_works_on_the_shipped_server():
    app = create_app(Settings(device="cpu", gc_freeze=False))  # the shipped repository
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c:
            await wait_ready(c)
            r = await c.post("/infer", json=INFER_EXAMPLE)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert set(answer) <= set(SCHEMAS["InferResponse"]["properties"]) and answer["model"] == "digits"
    logits = answer["outputs"][0]
    assert len(logits) == 10 and logits.index(max(logits)) == 0  # the example is a handwritten 0


async def test_docs_pages_load_nothing_from_elsewhere(client):
    for path in ("/docs", "/redoc"):
        r = await client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert "/openapi.json" in r.text
        # every URL the page names is this server's own (a path), none another host's
        assert not re.findall(r"""(?:src|href)=["']?(?:https?:)?//""", r.text), path
        assert "cdn" not in r.text.lower(), path


async def test_docs_off_leaves_no_page_and_no_document(settings):
    app = create_app(settings.model_copy(update={"docs": False}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost") as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await c.get(path)).status_code == 404, path
