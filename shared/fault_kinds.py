"""Faults by kind: what an error means for the work in hand, decided in one place.

Every side of the fleet (worker stages, sinks, the producer client) meets the same errors from
the same libraries; what to do about one depends only on its kind:

- ``TRANSIENT``: Redis or a database is unreachable, timed out, is failing over, or said "try
  again". Wait with capped backoff (``BackoffPolicy``) and try again, as long as it takes:
  nothing is lost by waiting, entries stay pending. Never dead-letter for it.
- ``ROW``: the database refused one row (a value it cannot store, a constraint). Retrying the
  same row cannot succeed; the rows around it can. Isolate the row, dead-letter only it.
- ``WORKER``: nothing this worker writes can succeed until a person changes something (bad
  credentials, a missing extension or table, wrong dimension). Exit non-zero with a message
  that names the setting, for the supervisor (and the person) to act on.

Classification reads the exception's type. This module holds the contract (the kinds, ``classify``)
and the rules every side meets: Redis's (the queue), the operating system's, HTTP statuses. A
store's own rules (PostgreSQL's SQLSTATE classes, Qdrant's transport errors) live in the store's
module under embedfleet/sinks/ as a ``FaultRules``: the modules of its client library and what
their errors mean; the sinks' registry registers them (``register_fault_rules``), so the light
client, which never imports a store, carries none of them. The client libraries are optional
extras, so they are recognised by module name and attributes, never imported here.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from redis import exceptions as redis_errors


class FaultKind(StrEnum):
    TRANSIENT = "transient"
    ROW = "row"
    WORKER = "worker"


class System(StrEnum):
    """Which system an error came from: logs and metrics say it, so an operator knows where."""

    REDIS = "redis"
    POSTGRESQL = "postgresql"
    QDRANT = "qdrant"
    LANCEDB = "lancedb"
    PARQUET = "parquet"  # the Parquet sink's folder or object store
    UNKNOWN = "unknown"


# The setting a person changes when a system fails permanently for the worker.
SETTING_FOR_SYSTEM: dict[System, str] = {
    System.REDIS: "EMBEDFLEET_REDIS_URL",
    System.POSTGRESQL: "EMBEDFLEET_SINK",
    System.QDRANT: "EMBEDFLEET_SINK",
    System.LANCEDB: "EMBEDFLEET_SINK",
    System.PARQUET: "EMBEDFLEET_SINK",
    System.UNKNOWN: "EMBEDFLEET_SINK",
}


@dataclass(frozen=True)
class Fault:
    """An error, with its kind and where it came from."""

    kind: FaultKind
    system: System
    error: BaseException

    @property
    def detail(self) -> str:
        """The library's own message (the database's words), one line."""
        text = " ".join(str(self.error).split())
        return f"{type(self.error).__name__}: {text}" if text else type(self.error).__name__

    @property
    def setting(self) -> str:
        return SETTING_FOR_SYSTEM[self.system]


class WorkerFault(RuntimeError):
    """A fault no retry fixes: the worker stops, exits non-zero, and the message names the
    setting to change."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(f"{message} (check {setting})")
        self.setting = setting

    @classmethod
    def from_fault(cls, fault: Fault, doing: str) -> WorkerFault:
        return cls(f"{fault.system} failed while {doing}: {fault.detail}", fault.setting)


# errno values of a peer that is down, restarting or unreachable.
_NETWORK_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.ENOTCONN,
        errno.EADDRNOTAVAIL,
    }
)

# Redis replies that mean "not now": loading, failing over, cluster resharding, and out of
# memory (is_redis_out_of_memory: with maxmemory-policy noeviction, a write waits until consumers
# drain the backlog or a person raises maxmemory; nothing is lost by waiting).
_REDIS_TRANSIENT = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,
    redis_errors.MasterDownError,
    redis_errors.ReadOnlyError,
    redis_errors.ClusterError,
    redis_errors.AskError,  # also MOVED: a slot migrating
)
_REDIS_TRANSIENT_REPLIES = ("LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "READONLY")
# The OOM reply's words, wherever redis-py puts them (a pipeline's error says which command
# first, a script's error comes as a plain ResponseError)
_REDIS_OOM_TEXT = "command not allowed when used memory > 'maxmemory'"
_REDIS_WORKER = (
    redis_errors.AuthenticationError,
    redis_errors.AuthorizationError,
    redis_errors.NoPermissionError,
)


@dataclass(frozen=True)
class FaultRules:
    """A store's own rules, declared in its module (embedfleet/sinks/): which errors are its,
    by the root module of its client libraries, and what they mean."""

    system: System
    # root modules whose errors are this store's (``psycopg``, ``qdrant_client``, ...)
    modules: tuple[str, ...]
    # the kind of one of its errors; None: the common rules decide (classify)
    kind: Callable[[BaseException], FaultKind | None] = lambda _error: None


# the registered stores' rules by root module (register_fault_rules)
_STORE_RULES: dict[str, FaultRules] = {}


def register_fault_rules(rules: FaultRules) -> None:
    """Classify the errors of ``rules.modules`` by ``rules`` (the sinks' registry calls it for
    each store). A module claimed by two systems is a registry mistake, refused loudly."""
    for module in rules.modules:
        known = _STORE_RULES.get(module)
        if known is not None and known.system is not rules.system:
            raise ValueError(
                f"errors of {module!r} are {known.system}'s already; {rules.system} cannot "
                "claim them too"
            )
        _STORE_RULES[module] = rules


def _store_rules(error: BaseException) -> FaultRules | None:
    """The registered rules of the store whose client library raised ``error``."""
    module = type(error).__module__ or ""
    return _STORE_RULES.get(module.split(".", 1)[0])


def system_of(error: BaseException) -> System:
    """The system whose library raised ``error``: Redis, a registered store, else unknown."""
    module = type(error).__module__ or ""
    if module.split(".", 1)[0] == "redis":
        return System.REDIS
    rules = _store_rules(error)
    return rules.system if rules is not None else System.UNKNOWN


def classify(error: BaseException, system: System | None = None) -> Fault:
    """The fault an error stands for. ``system`` overrides the guess from the error's module
    (a builtin TimeoutError raised inside a sink is the sink's database)."""
    found = system_of(error)
    if found is System.UNKNOWN and system is not None:
        found = system
    return Fault(_kind(error), found, error)


# redis-py's connection modules: an AttributeError raised there on a None stream is a
# connection another task disconnected under the command (_lost_inside_redis_py)
_REDIS_PY_CONNECTION_MODULES = frozenset({"redis.asyncio.connection", "redis.connection"})


def _lost_inside_redis_py(error: BaseException) -> bool:
    """redis-py writing to a connection whose stream a concurrent disconnect cleared: seen in CI
    when a cluster master was SIGKILLed while redis-py asked it for a command's keys
    (``'NoneType' object has no attribute 'writelines'`` in ``_send_packed_command``), and the
    worker's query stage died on it. A lost connection, though raised as an AttributeError;
    the same error anywhere else is a bug and stays the worker's."""
    if not isinstance(error, AttributeError) or not str(error).startswith("'NoneType' object"):
        return False
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and (
        frame.tb_frame.f_globals.get("__name__") in _REDIS_PY_CONNECTION_MODULES
    )


def _kind(error: BaseException) -> FaultKind:
    if isinstance(error, redis_errors.RedisError):
        return _redis_kind(error)
    if isinstance(error, redis_errors.RedisClusterException):
        return FaultKind.TRANSIENT  # no node serves the slot yet: a cluster failing over
    rules = _store_rules(error)
    if rules is not None:
        kind = rules.kind(error)  # the store's own rules first (a SQLSTATE, a transport error)
        if kind is not None:
            return kind
    status = _http_status(error)
    if status is not None:
        return _http_kind(status)
    if isinstance(error, (TimeoutError, ConnectionError)):
        return FaultKind.TRANSIENT
    if isinstance(error, RuntimeError) and "handler is closed" in str(error):
        # asyncio's transport of a connection whose node died under it (seen when a cluster
        # master is killed while redis-py asks it for a command's keys): a lost connection
        return FaultKind.TRANSIENT
    if _lost_inside_redis_py(error):
        return FaultKind.TRANSIENT
    if isinstance(error, PermissionError):
        return FaultKind.WORKER
    if isinstance(error, OSError) and error.errno in _NETWORK_ERRNOS:
        return FaultKind.TRANSIENT
    # A value the library cannot encode for the database: that row, not the worker.
    if isinstance(error, (ValueError, TypeError, UnicodeError, OverflowError)):
        return FaultKind.ROW
    return FaultKind.WORKER


def _redis_kind(error: redis_errors.RedisError) -> FaultKind:
    if isinstance(error, _REDIS_WORKER):
        return FaultKind.WORKER
    if isinstance(error, _REDIS_TRANSIENT):
        return FaultKind.TRANSIENT
    if is_redis_out_of_memory(error) or (
        isinstance(error, redis_errors.ResponseError)
        and str(error).startswith(_REDIS_TRANSIENT_REPLIES)
    ):
        return FaultKind.TRANSIENT
    return FaultKind.WORKER


def is_redis_out_of_memory(error: BaseException) -> bool:
    """Redis refused a write at its maxmemory (up, but full: the fix is memory, not the URL)."""
    return isinstance(error, redis_errors.OutOfMemoryError) or (
        isinstance(error, redis_errors.ResponseError)
        and (str(error).startswith("OOM ") or _REDIS_OOM_TEXT in str(error))
    )


def _http_status(error: BaseException) -> int | None:
    for holder in (error, getattr(error, "response", None)):
        status = getattr(holder, "status_code", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


def _http_kind(status: int) -> FaultKind:
    if status in (408, 425, 429) or status >= 500:
        return FaultKind.TRANSIENT
    if status in (401, 403, 404):
        return FaultKind.WORKER  # credentials, or the collection is gone
    return FaultKind.ROW  # 400, 413, 422: the request's content was refused


def is_transient(error: BaseException) -> bool:
    """For ``except`` clauses that only ride out outages (``except Exception as e: if not
    is_transient(e): raise``)."""
    return _kind(error) is FaultKind.TRANSIENT


@dataclass
class BackoffPolicy:
    """Capped exponential delays with full jitter, so a fleet that lost a server does not
    reconnect in lockstep. Pure: the caller sleeps (``asyncio.sleep`` or ``time.sleep``)."""

    base_s: float = 0.1
    cap_s: float = 5.0
    attempt: int = 0

    def next_delay(self) -> float:
        delay = random.uniform(0, min(self.cap_s, self.base_s * 2**self.attempt))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
