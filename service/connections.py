"""What every connection, HTTP/1.1 (``service.http.connection``) or gRPC (``service.grpc.h2``), is held to: a
share of the process's open-file limit, a cap on how many are open, and warnings about refusals at
most once a second. gRPC's own timers and admission are ``service.grpc.policy``'s.

The descriptor budget needs no count shared between the two servers: a new socket takes the lowest
free descriptor (POSIX), so a connection whose descriptor lands at or above a ceiling proves every
descriptor below it taken. gRPC's ceiling sits a quarter of the table below HTTP's, and HTTP's
``RESERVED_FDS`` below the limit: idle gRPC connections can fill their share but never the
descriptors HTTP or the models' files need."""

from __future__ import annotations

import logging
import resource
import time

log = logging.getLogger("fusedserve")

RESERVED_FDS = 64  # descriptors no connection may take: model files, logs, the engine's socket
HTTP_ONLY_SHARE = 4  # 1/4 of the table only HTTP may take: its clients hold one connection per request


def default_max_connections() -> int:
    """4096, or fewer where the open-file limit is lower: a connection refused with an answer beats
    an accept() that fails silently for lack of descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 4096 if soft == resource.RLIM_INFINITY else max(1, min(4096, soft - RESERVED_FDS))


def connection_cap(settings) -> int:
    """Open connections each server (HTTP, gRPC) takes: ``max_connections``, 0 meaning the default."""
    return settings.max_connections or default_max_connections()


class Warnings:
    """Warnings by kind, each logged at most once a second with how many were held back since."""

    def __init__(self):
        self._held: dict[str, tuple[int, float]] = {}

    def note(self, kind: str, client) -> None:
        now = time.monotonic()
        count, since = self._held.get(kind, (0, 0.0))
        if now - since < 1.0:
            self._held[kind] = (count + 1, since)
            return
        log.warning("%s (latest client %s; %d more since the last such warning)", kind,
                    f"{client[0]}:{client[1]}" if client else "unknown", count)
        self._held[kind] = (0, now)


class Descriptors:
    """The descriptor ceilings of HTTP and gRPC connections under the open-file limit ``soft``
    (default: this process's); None where the limit is infinite."""

    def __init__(self, soft: int | None = None):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if soft is None else soft
        self.soft = soft
        self.http = None if soft == resource.RLIM_INFINITY else soft - RESERVED_FDS
        self.grpc = None if self.http is None else self.http - soft // HTTP_ONLY_SHARE

    @staticmethod
    def fits(transport, ceiling: int | None) -> bool:
        """Whether ``transport``'s socket holds a descriptor below ``ceiling``."""
        sock = transport.get_extra_info("socket")
        return ceiling is None or sock is None or sock.fileno() < ceiling
