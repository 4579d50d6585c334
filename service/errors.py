"""Errors the service answers with, each carrying its HTTP status and a message saying what to fix."""

from __future__ import annotations


class ServiceError(Exception):
    status = 500
    outcome = "error"  # label for the requests counter in /metrics

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadInput(ServiceError):
    status = 422
    outcome = "bad_input"


class PayloadTooLarge(ServiceError):
    status = 413
    outcome = "too_large"


class UnknownModel(ServiceError):
    status = 404
    outcome = "unknown_model"


class NotReady(ServiceError):
    status = 503
    outcome = "not_ready"


class QueueFull(ServiceError):
    status = 503
    outcome = "queue_full"


class DeadlineExceeded(ServiceError):
    status = 504
    outcome = "timeout"


class BatchFailed(ServiceError):
    status = 500
    outcome = "failed"


class ClientGone(ServiceError):
    # Never seen by the client (it left); 499 is the conventional log status for that.
    status = 499
    outcome = "disconnected"
