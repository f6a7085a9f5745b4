"""How a case step reports: a failed expectation, a case the receiver cannot run, the status a call ends with."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from weight_sync.spec import TensorSpec


class CaseFailed(Exception):
    """A step of a case went otherwise than the protocol says (the message says how)."""


class CaseSkipped(Exception):
    """The receiver cannot run this case (no socket plane, no token, no tensor of the right size, ...)."""


def require(condition: bool, message: str) -> None:
    """Raise CaseFailed(`message`) unless `condition` holds."""
    if not condition:
        raise CaseFailed(message)


def need(spec: TensorSpec | None, what: str) -> TensorSpec:
    """`spec`, or CaseSkipped saying the manifest has no `what`."""
    if spec is None:
        raise CaseSkipped(f"the manifest has no {what}")
    return spec


def code_of(fn: Callable[[], object]) -> str:
    """The status name `fn`'s gRPC call ends with ("OK" when it returns)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"
