"""gRPC plumbing shared by the sender, the receiver and the relay: channels, TLS credentials, auth, raw methods."""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from protos import weight_sync_pb2 as pb
from weight_sync.config import WeightSyncConfig

__all__ = ["SERVICE", "WeightSyncClient", "check_token", "client_channel", "is_loopback", "server_credentials"]

SERVICE = "rl_align.weight_sync.v1.WeightSync"
T = TypeVar("T")


def _identity(data: bytes) -> bytes:
    return data


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def grpc_options(config: WeightSyncConfig) -> list[tuple[str, int | str]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def client_channel(address: str, config: WeightSyncConfig) -> grpc.Channel:
    """A channel to a receiver: TLS when `tls_ca_path` is set (with a client certificate when one is configured)."""
    # gRPC's reconnect backoff grows to 2 min while a receiver is down: a restarted one stayed unreachable a push or
    # more after it served again. The sender paces its own tries of an unreachable receiver (sender._rest).
    options = grpc_options(config)
    options += [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]
    if config.tls_ca_path is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca_path),
        private_key=_read(config.tls_key_path),
        certificate_chain=_read(config.tls_cert_path),
    )
    if config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    return grpc.secure_channel(address, creds, options=options)


def server_credentials(config: WeightSyncConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of a receiver, or None for plaintext."""
    if config.tls_cert_path is None:
        return None
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key_path), _read(config.tls_cert_path))],
        root_certificates=_read(config.tls_ca_path) if config.tls_require_client_cert else None,
        require_client_auth=config.tls_require_client_cert,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_token(expected: str | None, metadata: tuple[tuple[str, str | bytes], ...]) -> str | None:
    """None when the call may proceed, else why not. Compares in constant time."""
    if expected is None:
        return None
    for key, value in metadata:
        if key == "authorization":
            given = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = given.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), expected.encode()):
                return None
            return "invalid bearer token"
    return "missing 'authorization: Bearer <token>' metadata"


class WeightSyncClient:
    """Thin client of one receiver: unary calls with deadlines, retries on UNAVAILABLE, and the raw Push method."""

    def __init__(self, address: str, config: WeightSyncConfig) -> None:
        self.address = address
        self.config = config
        self.channel = client_channel(address, config)
        token = config.resolve_token()
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._describe = self._unary("Describe", pb.DescribeReply)
        self._begin = self._unary("Begin", pb.BeginReply)
        self._commit = self._unary("Commit", pb.CommitReply)
        self._abort = self._unary("Abort", pb.AbortReply)
        # Push sends pre-serialized PushChunk bytes (see codec.encode_chunk): no protobuf copy of the payload.
        self.push = self.channel.stream_unary(
            f"/{SERVICE}/Push", request_serializer=_identity, response_deserializer=pb.PushReply.FromString
        )
        self.watch = self.channel.unary_stream(
            f"/{SERVICE}/WatchVersion",
            request_serializer=pb.WatchVersionRequest.SerializeToString,
            response_deserializer=pb.VersionEvent.FromString,
        )

    def _unary(self, method: str, reply: type[Message]) -> grpc.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply.FromString,
        )

    def _call(self, fn: Callable[..., T], request: object, timeout_s: float) -> T:
        delay = self.config.retry_backoff_s
        for attempt in range(self.config.num_retries + 1):
            try:
                return fn(request, timeout=timeout_s, metadata=self.metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.config.num_retries:
                    raise
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def describe(self) -> pb.DescribeReply:
        return self._call(self._describe, pb.DescribeRequest(), self.config.rpc_timeout_s)

    def begin(self, request: pb.BeginRequest) -> pb.BeginReply:
        return self._call(self._begin, request, self.config.rpc_timeout_s)

    def commit(self, request: pb.CommitRequest) -> pb.CommitReply:
        return self._call(self._commit, request, self.config.commit_timeout_s)

    def abort(self, request: pb.AbortRequest) -> pb.AbortReply:
        return self._call(self._abort, request, self.config.rpc_timeout_s)

    def close(self) -> None:
        self.channel.close()
