"""The routes that carry rows, ``POST /infer`` and ``POST /v2/models/{m}[/versions/{v}]/infer``,
served straight from ASGI: no routing, dependency injection or middleware stack per request.
Decoding and encoding are the codecs the framework's routes call too (``http.infer_body``,
``http.v2_body``), so a request answers the same whichever way it comes in; FastAPI keeps every other
route and the API's documentation."""

from __future__ import annotations

import logging
import time

from fusedserve.service.engine.state import ServiceState
from fusedserve.service.errors import ServiceError, log_unexpected
from fusedserve.service.http import infer_body, v2_body
from fusedserve.service.http.codec import dump_json, read_asgi_body
from fusedserve.service.http.inference import TIMEOUT_HEADER, run_rows, timeout_s
from fusedserve.service.http.middleware import GONE, INTERNAL_ERROR, REQUESTS, RequestIds, answer_headers, log_access
from fusedserve.service.security import WANTED, Guard

log = logging.getLogger("fusedserve")
_JSON, _V2_PREFIX, _V2_SUFFIX = b"application/json", "/v2/models/", "/infer"
_TIMEOUT, _HEADER_LENGTH = TIMEOUT_HEADER.encode(), v2_body.HEADER_LENGTH.encode()
_WANTED = {b"content-length", _TIMEOUT, _HEADER_LENGTH, *WANTED}


def _text(headers: dict[bytes, bytes], name: bytes) -> str | None:
    """A header's value as text (decoded only when read: most requests carry few of them)."""
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def route(path: str) -> tuple[str, str | None, str | None] | None:
    """``("infer", None, None)``, ``("v2", model, version)`` or None for any other path."""
    if path == "/infer":
        return "infer", None, None
    if not (path.startswith(_V2_PREFIX) and path.endswith(_V2_SUFFIX)):
        return None
    parts = path[len(_V2_PREFIX):-len(_V2_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return "v2", parts[0], None
    if len(parts) == 3 and parts[0] and parts[1] == "versions":
        return "v2", parts[0], parts[2]
    return None


class HotPath:
    """Serves the rows' routes of one app (``__call__`` says whether it took the request)."""

    def __init__(self, app, state: ServiceState, ids: RequestIds, guard: Guard):
        self.app = app  # its engine is read per request: tests and the app may swap it
        self.state = state
        self.ids = ids
        self.guard = guard

    async def __call__(self, scope, receive, send) -> bool:
        if scope["type"] != "http" or scope["method"] != "POST":
            return False
        where = route(scope["path"])
        if where is None:
            return False
        start, request_id = time.perf_counter(), self.ids.take(scope)
        raw = {name: value for name, value in scope["headers"] if name in _WANTED}
        refusal = self.guard.check("POST", scope["path"], raw, inference=True)
        if refusal is None:
            status, body, media_type, extra = await self._answer(where, raw, receive, scope.get(GONE),
                                                                 scope.get(REQUESTS))
        else:
            status, message, extra = refusal
            body, media_type = dump_json({"error": message}), _JSON
        out = [(b"content-type", media_type), (b"content-length", str(len(body)).encode()),
               *answer_headers(request_id, self.state.draining),
               *((k.encode("latin-1"), str(v).encode("latin-1")) for k, v in extra.items())]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})
        log_access(scope, status, start, request_id)
        return True

    async def _answer(self, where, headers: dict, receive, gone, in_progress) -> tuple[int, bytes, bytes, dict]:
        """``(status, body, media type, extra headers)``; a ServiceError answers as the framework's
        handler would (its status, ``{"error": ...}``, counted in the metrics). ``in_progress``: the
        server's requests in progress (``middleware.REQUESTS``), None where unknown."""
        state, engine, model = self.state, self.app.state.engine, ""
        try:
            kind, name, version = where
            info = v2_body.model_info(engine, name, version) if kind == "v2" else None
            model = info.name if info is not None else ""
            raw = await read_asgi_body(receive, _text(headers, b"content-length"), state.settings.max_body_bytes)
            if kind == "infer":
                info, inputs, top_k = infer_body.parse(engine, raw)
                model = info.name
                x = infer_body.rows(state, info, inputs, raw)
            else:
                req, x, binary = v2_body.decode(state, info, raw, _text(headers, _HEADER_LENGTH))
            alone = in_progress is not None and len(in_progress) == 1  # read now: others may have come
            out = await run_rows(engine, info.name, x, timeout_s(state, _text(headers, _TIMEOUT)), receive, gone,
                                 alone)
            if kind == "infer":
                return 200, infer_body.encode(info, out, top_k), _JSON, {}
            body, media_type, extra = v2_body.encode(info, req, binary, out)
            return 200, body, media_type.encode(), extra
        except ServiceError as exc:
            engine.record_error(model, exc.outcome)
            return exc.status, dump_json({"error": exc.message}), _JSON, exc.headers
        except Exception as exc:  # a bug, not the client's: logged, and answered rather than dropped
            log_unexpected(log, f"POST {'/infer' if where[0] == 'infer' else 'v2 infer'} failed", exc)
            engine.record_error(model, "error")
            engine.record_unexpected("http")
            return 500, INTERNAL_ERROR, _JSON, {}
