"""What one rank's push reports: per-receiver outcomes (`PushReport`) and how stream failures become them."""

from __future__ import annotations

import dataclasses

import grpc

from protos import weight_sync_pb2 as pb

__all__ = ["PushReport", "error_text", "record_results"]


@dataclasses.dataclass
class PushReport:
    """Outcome of one rank's push: per-receiver error (None = its stream succeeded) and traffic counters."""

    policy_version: int
    errors: dict[str, str | None]
    delta_endpoints: list[str]
    socket_endpoints: list[str]
    """Receivers this rank streamed to over the socket data plane (the others took gRPC Push streams)."""
    bytes_sent: int
    payload_bytes: int
    seconds: float
    grpc_fallback: dict[str, str] = dataclasses.field(default_factory=dict)
    """Receivers whose socket or shared-memory plane refused some of this rank's streams before opening them (address
    -> why): those streams went again over gRPC Push (`data_plane = "auto"` only). They are not in `socket_endpoints`
    nor `shm_endpoints`."""
    shm_endpoints: list[str] = dataclasses.field(default_factory=list)
    """Receivers on this host this rank streamed to over the shared-memory plane (never delta: raw is as cheap)."""
    behind: dict[str, int] = dataclasses.field(default_factory=dict)
    """Receivers holding a base model at a version older than the push's ``min_version`` (address -> that version):
    sent nothing, and in ``errors``; they need the base pushed with the adapters (``WeightSender.push``)."""

    @property
    def ok(self) -> list[str]:
        return [a for a, err in self.errors.items() if err is None]

    @property
    def failed(self) -> dict[str, str]:
        return {a: err for a, err in self.errors.items() if err is not None}


def status_name(code: int) -> str:
    """The name of a gRPC status code number."""
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), f"code {code}")


# A stream that was cut because another stream of its update failed reports one of these; the other one's code is the
# cause worth reporting (DATA_LOSS, ...).
_CONSEQUENCES = frozenset({grpc.StatusCode.CANCELLED.value[0], grpc.StatusCode.UNAVAILABLE.value[0]})


def record_results(errors: dict[str, str | None], codes: dict[str, int], results: list[pb.RelayResult]) -> None:
    """Report each receiver's first failure in `errors` (its status code in `codes`), unless a later one names the
    cause of a mere consequence."""
    for result in results:
        if result.code == 0:
            continue
        first = errors.get(result.address) is None
        if first or (codes.get(result.address) in _CONSEQUENCES and result.code not in _CONSEQUENCES):
            errors[result.address] = f"Push: {status_name(result.code)}: {result.message}"
            codes[result.address] = result.code


# What gRPC's connection errors mean for a weight-sync client: the receiver's TLS set-up and the sender's disagree.
_CONNECT_HINTS = (
    ("WRONG_VERSION_NUMBER", "the receiver does not speak TLS: connect without tls_ca_path, or start it with "
                             "tls_cert_path / tls_key_path"),
    ("CERTIFICATE_VERIFY_FAILED", "the receiver's certificate is not signed by tls_ca_path (or not issued to the "
                                  "host name connected to: tls_server_name)"),
    ("Socket closed", "the receiver closed the connection at its handshake: it may require TLS (give tls_ca_path) or "
                      "a client certificate (tls_cert_path / tls_key_path), or not be a weight-sync receiver"),
)  # fmt: skip


def error_text(error: BaseException) -> str:
    """`CODE: details` of an RPC error, `Type: message` of anything else; a connection that failed for a TLS
    mismatch says which (gRPC's own text names only the socket or the handshake)."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        details = error.details() or ""
        hint = next((h for marker, h in _CONNECT_HINTS if marker in details), None)
        connecting = error.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details
        return f"{error.code().name}: {details}" + (f" ({hint})" if hint and connecting else "")
    return f"{type(error).__name__}: {error}"
