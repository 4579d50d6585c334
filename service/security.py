"""Who may call what, checked before a request is read: an optional API key (``Authorization:
Bearer``; probes stay open), a separate key for admin routes (the API key never opens them), the
``Host`` names answered (against DNS rebinding; by default only local names on a loopback-only
server), admin routes closed to cross-site browser requests when no admin key is set, and the
Content-Type of inference requests (a browser's cross-site "simple" POST sends text/plain or a form).
One ``Guard`` per app, used by the hot path and by ``GuardMiddleware``; keys are compared as
precomputed header values, in constant time."""

from __future__ import annotations

import hmac
import ipaddress

from pydantic import SecretStr

from fusedserve.service.http.codec import dump_json
from fusedserve.service.settings import Settings

PROBES = frozenset({"/v2/health/live", "/v2/health/ready", "/healthz", "/readyz"})
ADMIN_PREFIXES = ("/kernel-stats/reset", "/v2/repository")
# JSON, or the v2 binary tensor extension's body; none at all is what tritonclient sends.
BODY_TYPES = ("application/json", "application/octet-stream")
WANTED = (b"authorization", b"host", b"content-type", b"origin", b"sec-fetch-site")
# Sec-Fetch-Site values a browser sends for a page of this server's own origin, or typed by its user.
SAME_SITE = (b"same-origin", b"none")
ANY_HOST, LOCAL_HOSTS = "*", "local"  # allowed_hosts' two words: every name; localhost and IP addresses

Refusal = tuple[int, str, dict]


def _bearer(secret) -> bytes | None:
    value = secret.get_secret_value() if isinstance(secret, SecretStr) else secret or ""
    return f"Bearer {value}".encode() if value else None


def is_admin(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES)


def host_name(host: str) -> str:
    """The name in a ``Host`` (or an Origin's authority): "name:port", "[v6 address]:port", or either
    without the port, lower-cased."""
    host = host.strip().lower()
    return host[1:host.find("]")] if host.startswith("[") and "]" in host else host.partition(":")[0]


def is_local_name(name: str) -> bool:
    """localhost or an IP address: names no DNS answer can point at another machine's page (or no
    name at all: browsers always send Host, so a request without one comes from no web page)."""
    if not name or name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def default_hosts(bind: str) -> str:
    """allowed_hosts when none is set: a server listening on loopback only answers local names (a web
    page that rebinds its own DNS name to 127.0.0.1 gets 400); one on other interfaces answers any."""
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = False
    return LOCAL_HOSTS if loopback else ANY_HOST


class Guard:
    def __init__(self, settings: Settings):
        self._api, self._admin = _bearer(settings.api_key), _bearer(settings.admin_api_key)
        names = [h.strip().lower() for h in (settings.allowed_hosts or default_hosts(settings.host)).split(",")]
        self._any_host = ANY_HOST in names
        self._local = LOCAL_HOSTS in names
        self._hosts = frozenset(h for h in names if h and h not in (ANY_HOST, LOCAL_HOSTS))
        self._seen: dict[bytes, bool] = {}  # Host header -> allowed: clients send the same few
        self._open = self._any_host and not self.keyed  # then only inference and admin routes are checked

    def check(self, method: str, path: str, headers: dict[bytes, bytes], inference: bool) -> Refusal | None:
        """None if the request may go on, else ``(status, message, headers)`` to answer it with.
        ``headers``: at least the ``WANTED`` ones, lower-case names, as sent."""
        admin = is_admin(path)
        if (self._open and not inference and not admin) or path in PROBES:
            return None
        if not self._any_host and not self._host_allowed(headers.get(b"host", b"")):
            return 400, ("this server does not answer for that Host; address it as localhost or by IP address, or "
                         "ask its operator to list the name in FUSEDSERVE_ALLOWED_HOSTS"), {}
        if self.keyed:
            refusal = self.authorize(path, headers.get(b"authorization", b""))
            if refusal is not None:
                return refusal
        if admin and self._admin is None:
            return self._same_site(headers)
        if inference and method == "POST":
            kind = headers.get(b"content-type")
            if (kind is not None and kind != b"application/json"
                    and kind.split(b";", 1)[0].strip().decode("latin-1").lower() not in BODY_TYPES):
                return 415, (f"Content-Type {kind.decode('latin-1')!r} is not accepted: send application/json "
                             "(or application/octet-stream with Inference-Header-Content-Length)"), {}
        return None

    def _host_allowed(self, host: bytes) -> bool:
        allowed = self._seen.get(host)
        if allowed is None:
            name = host_name(host.decode("latin-1"))
            allowed = (name in self._hosts or (self._local and is_local_name(name))
                       or any(h.startswith("*.") and name.endswith(h[1:]) for h in self._hosts))
            if len(self._seen) >= 64:
                self._seen.clear()
            self._seen[host] = allowed
        return allowed

    def _same_site(self, headers: dict[bytes, bytes]) -> Refusal | None:
        """Admin routes with no admin key: never for a web page of another origin (a browser sends
        Origin on every POST, and Sec-Fetch-Site), nor for a name DNS could rebind to this server."""
        host = headers.get(b"host", b"")
        name = host_name(host.decode("latin-1"))
        if not (is_local_name(name) or name in self._hosts):
            return 403, ("admin routes without an admin key answer only requests addressed to localhost or an IP "
                         "address: set FUSEDSERVE_ADMIN_API_KEY, or list this name in FUSEDSERVE_ALLOWED_HOSTS"), {}
        origin, site = headers.get(b"origin"), headers.get(b"sec-fetch-site")
        if (origin is not None and origin.partition(b"://")[2].lower() != host.strip().lower()) or (
                site is not None and site.strip().lower() not in SAME_SITE):
            return 403, ("admin routes refuse requests from another site's web page; call them from a client "
                         "(curl, tritonclient) or set FUSEDSERVE_ADMIN_API_KEY"), {}
        return None

    @property
    def keyed(self) -> bool:
        return self._api is not None or self._admin is not None

    def authorize(self, path: str, given: bytes) -> Refusal | None:
        """None if ``given`` (the Authorization value) opens ``path``, else the 401 or 403 to answer."""
        if is_admin(path) and self._admin is not None:
            allowed = (self._admin,)
        elif is_admin(path):  # an API key alone: it never opens admin routes
            return 403, "admin routes need the admin key (FUSEDSERVE_ADMIN_API_KEY); the API key does not open them", {}
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
