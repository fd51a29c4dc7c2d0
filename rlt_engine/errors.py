"""Errors the engine raises to its users, each with a message they can act on."""

from __future__ import annotations

from rlt_engine.kv_manager import CapacityError


class InvalidRequestError(ValueError):
    """A request that cannot be served as given (the message says which field and why)."""


class WorkerStartupError(RuntimeError):
    """A worker failed to start (its exit code or error is in the message)."""


class EngineDeadError(RuntimeError):
    """The engine stopped answering or exited."""


__all__ = ["CapacityError", "EngineDeadError", "InvalidRequestError", "WorkerStartupError"]
