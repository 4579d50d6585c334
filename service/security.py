"""Who may call what, checked before a request is read: an optional API key (``Authorization:
Bearer``; probes stay open), a separate key for admin routes, an allowed-hosts list against DNS
rebinding, and the Content-Type of inference requests (a browser's cross-site "simple" POST sends
text/plain or a form). One ``Guard`` per app, used by the hot path and by ``GuardMiddleware``;
keys are compared as precomputed header values, in constant time."""

from __future__ import annotations

import hmac

from pydantic import SecretStr

from fusedserve.service.inputs import dump_json
from fusedserve.service.settings import Settings

PROBES = frozenset({"/v2/health/live", "/v2/health/ready", "/healthz", "/readyz"})
ADMIN_PREFIXES = ("/kernel-stats/reset", "/v2/repository")
# JSON, or the v2 binary tensor extension's body; none at all is what tritonclient sends.
BODY_TYPES = ("application/json", "application/octet-stream")
WANTED = (b"authorization", b"host", b"content-type")

Refusal = tuple[int, str, dict]


def _bearer(secret) -> bytes | None:
    value = secret.get_secret_value() if isinstance(secret, SecretStr) else secret or ""
    return f"Bearer {value}".encode() if value else None


def is_admin(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES)


class Guard:
    def __init__(self, settings: Settings):
        self._api, self._admin = _bearer(settings.api_key), _bearer(settings.admin_api_key)
        self._hosts = frozenset(h.strip().lower() for h in settings.allowed_hosts.split(",") if h.strip())
        self._open = not (self._hosts or self.keyed)  # then only inference's Content-Type is checked

    def check(self, method: str, path: str, headers: dict[bytes, bytes], inference: bool) -> Refusal | None:
        """None if the request may go on, else ``(status, message, headers)`` to answer it with.
        ``headers``: at least the ``WANTED`` ones, lower-case names, as sent."""
        if self._open and not inference:
            return None
        if path in PROBES:
            return None
        if self._hosts and not self._host_allowed(headers.get(b"host", b"")):
            return 400, "this server does not answer for that Host; ask its operator for the right address", {}
        if self.keyed:
            refusal = self.authorize(path, headers.get(b"authorization", b""))
            if refusal is not None:
                return refusal
        if inference and method == "POST":
            kind = headers.get(b"content-type")
            if kind is not None and kind != b"application/json" and kind.split(b";", 1)[0].strip().decode("latin-1").lower() not in BODY_TYPES:
                return 415, (f"Content-Type {kind.decode('latin-1')!r} is not accepted: send application/json "
                             "(or application/octet-stream with Inference-Header-Content-Length)"), {}
        return None

    def _host_allowed(self, host: bytes) -> bool:
        name = host.decode("latin-1").strip().lower()
        # "name:port", "[v6 address]:port" or either without the port
        name = name[1:name.find("]")] if name.startswith("[") and "]" in name else name.partition(":")[0]
        return name in self._hosts or any(h.startswith("*.") and name.endswith(h[1:]) for h in self._hosts)

    @property
    def keyed(self) -> bool:
        return self._api is not None or self._admin is not None

    def authorize(self, path: str, given: bytes) -> Refusal | None:
        """None if ``given`` (the Authorization value) opens ``path``, else the 401 to answer."""
        if is_admin(path) and self._admin is not None:
            allowed = (self._admin,)
        else:
            allowed = tuple(k for k in (self._api, self._admin) if k is not None)
            if self._api is None:  # only admin routes are guarded
                return None
        # compare_digest on every key, so the time taken does not say which one nearly matched.
        if sum(hmac.compare_digest(given, key) for key in allowed):
            return None
        what = "an admin key" if allowed == (self._admin,) else "an API key"
        return 401, f"this route needs {what}: send Authorization: Bearer <key>", {"WWW-Authenticate": "Bearer"}


class GuardMiddleware:
    """``Guard`` for the framework's routes (the hot path checks its own)."""

    def __init__(self, app, guard: Guard, is_inference):
        self.app = app
        self.guard = guard
        self.is_inference = is_inference

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name: value for name, value in scope["headers"] if name in WANTED}
        refusal = self.guard.check(scope["method"], scope["path"], headers, self.is_inference(scope["path"]))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, extra = refusal
        body = dump_json({"error": message})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *((k.lower().encode(), v.encode()) for k, v in extra.items())]})
        await send({"type": "http.response.body", "body": body})
