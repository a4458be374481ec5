"""The fault vocabulary: each library's errors land in the kind their meaning calls for.

Real exception classes from the real libraries (redis-py, psycopg, httpx, qdrant-client); the
classification is pure logic, so no server is needed here. Servers going away for real are in
test_reliability.py and test_sinks.py.
"""

from __future__ import annotations

import errno

import httpx
import psycopg
import pytest
from embedfleet.shared.faults import (
    BackoffPolicy,
    FaultKind,
    System,
    WorkerFault,
    classify,
    is_transient,
)
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse
from redis import exceptions as redis_errors


@pytest.mark.parametrize(
    ("error", "kind", "system"),
    [
        (redis_errors.ConnectionError("Connection refused"), FaultKind.TRANSIENT, System.REDIS),
        (redis_errors.TimeoutError("Timeout reading"), FaultKind.TRANSIENT, System.REDIS),
        (redis_errors.BusyLoadingError("LOADING"), FaultKind.TRANSIENT, System.REDIS),
        (redis_errors.ReadOnlyError("READONLY replica"), FaultKind.TRANSIENT, System.REDIS),
        (redis_errors.ResponseError("OOM command not allowed"), FaultKind.TRANSIENT, System.REDIS),
        # AuthenticationError is a ConnectionError subclass: it must not be waited out
        (redis_errors.AuthenticationError("invalid password"), FaultKind.WORKER, System.REDIS),
        (redis_errors.NoPermissionError("NOPERM"), FaultKind.WORKER, System.REDIS),
        (redis_errors.ResponseError("WRONGTYPE"), FaultKind.WORKER, System.REDIS),
        (psycopg.OperationalError("connection refused"), FaultKind.TRANSIENT, System.POSTGRESQL),
        (psycopg.errors.AdminShutdown(), FaultKind.TRANSIENT, System.POSTGRESQL),
        (psycopg.errors.SerializationFailure(), FaultKind.TRANSIENT, System.POSTGRESQL),
        (psycopg.errors.DeadlockDetected(), FaultKind.TRANSIENT, System.POSTGRESQL),
        (psycopg.errors.UntranslatableCharacter(), FaultKind.ROW, System.POSTGRESQL),
        (psycopg.errors.CheckViolation(), FaultKind.ROW, System.POSTGRESQL),
        (psycopg.errors.InvalidPassword(), FaultKind.WORKER, System.POSTGRESQL),
        (psycopg.errors.UndefinedTable(), FaultKind.WORKER, System.POSTGRESQL),
        (psycopg.errors.InsufficientPrivilege(), FaultKind.WORKER, System.POSTGRESQL),
        (httpx.ConnectError("refused"), FaultKind.TRANSIENT, System.QDRANT),
        (httpx.ReadTimeout("slow"), FaultKind.TRANSIENT, System.QDRANT),
        (ResponseHandlingException(OSError("reset")), FaultKind.TRANSIENT, System.QDRANT),
        (
            UnexpectedResponse(503, "Unavailable", b"", httpx.Headers()),
            FaultKind.TRANSIENT,
            System.QDRANT,
        ),
        (
            UnexpectedResponse(429, "Too Many", b"", httpx.Headers()),
            FaultKind.TRANSIENT,
            System.QDRANT,
        ),
        (
            UnexpectedResponse(400, "Bad Request", b"", httpx.Headers()),
            FaultKind.ROW,
            System.QDRANT,
        ),
        (
            UnexpectedResponse(401, "Unauthorized", b"", httpx.Headers()),
            FaultKind.WORKER,
            System.QDRANT,
        ),
        (TimeoutError(), FaultKind.TRANSIENT, System.UNKNOWN),
        (ConnectionResetError(), FaultKind.TRANSIENT, System.UNKNOWN),
        (OSError(errno.EHOSTUNREACH, "no route"), FaultKind.TRANSIENT, System.UNKNOWN),
        (PermissionError(errno.EACCES, "denied"), FaultKind.WORKER, System.UNKNOWN),
        (ValueError("cannot encode"), FaultKind.ROW, System.UNKNOWN),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_each_error_has_the_kind_its_meaning_calls_for(
    error: BaseException, kind: FaultKind, system: System
) -> None:
    fault = classify(error)
    assert (fault.kind, fault.system) == (kind, system)
    assert is_transient(error) == (kind is FaultKind.TRANSIENT)


def test_the_caller_names_the_system_of_a_builtin_error() -> None:
    """A builtin TimeoutError raised in the pgvector sink is PostgreSQL's, not Redis's."""
    assert classify(TimeoutError(), System.POSTGRESQL).system is System.POSTGRESQL
    # ... but a library's own error keeps its system whatever the caller guessed
    assert classify(redis_errors.ConnectionError(), System.POSTGRESQL).system is System.REDIS


def test_a_worker_fault_names_the_setting_to_change() -> None:
    fault = classify(psycopg.errors.InvalidPassword("password authentication failed"))
    message = str(WorkerFault.from_fault(fault, "writing vectors"))
    assert "EMBEDFLEET_SINK" in message and "password authentication failed" in message


def test_backoff_delays_grow_to_the_cap_and_restart_after_reset() -> None:
    policy = BackoffPolicy(base_s=0.1, cap_s=1.0)
    delays = [policy.next_delay() for _ in range(12)]
    assert all(0 <= delay <= 1.0 for delay in delays)
    assert policy.attempt == 12
    policy.reset()
    assert policy.next_delay() <= 0.1
