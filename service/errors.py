"""Errors the service answers with, each carrying its HTTP status, its gRPC status code (a
``grpc.StatusCode`` name; this module does not import grpc) and a message saying what to fix."""

from __future__ import annotations

import logging
import re
import traceback

# An absolute path of two or more parts (or ~/...) inside an exception's text.
_PATH = re.compile(r"(?<![\w.:/])(?:~|/[^\s'\"/]+)(?:/[^\s'\"/]+)*/([^\s'\"/]+)")
# Frames of an unexpected error's trace that reach the log: where it failed, not 60 lines of stack.
TRACE_FRAMES = 6


class ServiceError(Exception):
    status = 500
    grpc_code = "INTERNAL"
    outcome = "error"  # label for the requests counter in /metrics

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadInput(ServiceError):
    status = 422
    grpc_code = "INVALID_ARGUMENT"
    outcome = "bad_input"


class NonFiniteOutput(ServiceError):
    # Finite weights and inputs that still overflow the model's dtype: never answered as nulls.
    status = 422
    grpc_code = "INVALID_ARGUMENT"
    outcome = "non_finite_output"


class LoadFailed(ServiceError):
    # A model control request (load, unload) that cannot be done: Triton answers 400.
    status = 400
    grpc_code = "INVALID_ARGUMENT"
    outcome = "control_failed"


class PayloadTooLarge(ServiceError):
    status = 413
    grpc_code = "INVALID_ARGUMENT"
    outcome = "too_large"


class NotServed(ServiceError):
    """A feature this server's configuration does not serve."""
    status = 501
    grpc_code = "UNIMPLEMENTED"
    outcome = "not_served"


class UnknownModel(ServiceError):
    status = 404
    grpc_code = "NOT_FOUND"
    outcome = "unknown_model"


class NotReady(ServiceError):
    status = 503
    grpc_code = "UNAVAILABLE"
    outcome = "not_ready"


class QueueFull(ServiceError):
    status = 503
    grpc_code = "UNAVAILABLE"
    outcome = "queue_full"


class DeadlineExceeded(ServiceError):
    status = 504
    grpc_code = "DEADLINE_EXCEEDED"
    outcome = "timeout"


class BatchFailed(ServiceError):
    status = 500
    grpc_code = "INTERNAL"
    outcome = "failed"


class ClientGone(ServiceError):
    # Never seen by the client (it left); 499 is the conventional log status for that.
    status = 499
    grpc_code = "CANCELLED"
    outcome = "disconnected"


def log_unexpected(log: logging.Logger, what: str, exc: BaseException) -> None:
    """One log record for a bug: a line naming it, then the last ``TRACE_FRAMES`` frames only."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-TRACE_FRAMES, chain=False))
    log.error("%s: %s: %s\n%s", what, type(exc).__name__, exc, trace.rstrip())


def redact_paths(text: str) -> str:
    """``text`` with every absolute path cut to ``.../<last part>``: error bodies go to clients, who
    have no business learning the server's directory layout (the log keeps the whole message)."""
    return _PATH.sub(r".../\1", text)
