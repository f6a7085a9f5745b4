"""Configuration of the weight-sync channel (sender and receiver share one config). Imports no torch."""

from __future__ import annotations

import os
from typing import Literal

import pydantic

from common.config import Config, FieldError

__all__ = ["RECEIVER_FIELDS", "WeightSyncConfig"]

DEFAULT_TOKEN_ENV = "RL_ALIGN_WEIGHT_SYNC_TOKEN"
MAX_COMMIT_WAITERS = 16  # Commits that may wait at once for the one applying their update (each holds an RPC thread)
MAX_RELAY_FANOUT = 64  # children a relay node opens per stream
RESERVED_SERVER_THREADS = MAX_COMMIT_WAITERS + 4  # + short calls: Describe, Begin, Abort, the applying Commit


RECEIVER_FIELDS = frozenset({
    "update_idle_timeout_s", "max_pending_data_connections", "max_watch_streams", "watch_timeout_s", "max_version_gap",
    "tls_require_client_cert", "bind_host", "port", "allow_insecure_remote", "offer_shm", "data_port",
    "num_server_threads", "max_grpc_connections",
})  # fmt: skip
"""The `WeightSyncConfig` fields only a receiver reads; a sender reads the rest (some both sides)."""


class WeightSyncConfig(Config):
    """How trainer ranks push weights to receivers, and how a receiver serves and checks pushes."""

    chunk_bytes: int = pydantic.Field(4 << 20, ge=64, le=64 << 20)
    """Raw payload bytes per streamed chunk, a multiple of 8; a receiver refuses larger ones. Each chunk costs a frame
    and its checks on both ends: 4 MiB keeps that a small share of a socket-plane push (``benchmarks/weight_sync.py
    --chunk-bytes`` compares sizes)."""
    num_streams: int = pydantic.Field(2, ge=1, le=64)
    """Push streams per rank and receiver; a rank's shards are spread over them."""
    rpc_timeout_s: float = pydantic.Field(30.0, gt=0)
    """Deadline of Describe/Begin/Abort calls."""
    push_timeout_s: float = pydantic.Field(600.0, gt=0)
    """Deadline of one rank's whole Push stream to one receiver. Receiver side: an update still open (not yet
    committing) this long plus ``rpc_timeout_s`` after its first Begin gives way to another session's Begin, so a
    client that keeps its streams alive with a byte now and then cannot hold the receiver's one update slot."""
    commit_timeout_s: float = pydantic.Field(600.0, gt=0)
    """Deadline of Commit; generous because a sink may wait for the engine's current generation batch to end."""
    num_retries: int = pydantic.Field(2, ge=0)
    """Retries of a unary call that failed with UNAVAILABLE (the server was not reachable)."""
    retry_backoff_s: float = pydantic.Field(0.5, ge=0)
    """Sleep before the first retry; doubles each retry."""
    update_idle_timeout_s: float = pydantic.Field(120.0, gt=0)
    """Receiver side: a staged update with no traffic for this long is dropped when another update begins. One that
    still waits for data (a rank's Begin or streams) is dropped sooner: after `stream_idle_timeout_s`."""
    stream_idle_timeout_s: float = pydantic.Field(30.0, gt=0)
    """Receiver side: a Push stream that receives nothing for this long is cut and its update dropped (gRPC: the next
    chunk message; socket plane: the next bytes), and an update still waiting for data (Begins or streams to come)
    with no traffic for this long gives way to another session's Begin. Sender side: a receiver stream that accepts no
    chunk for half of it is cut and reported, so one stalled receiver does not idle every other receiver's streams
    past their limit (a relay node cuts a stalled child after a quarter of it); one that took its whole socket or gRPC
    stream and sends no answer is cut after as long times one plus the receivers it relays to (a same-host
    shared-memory stream waits for its answer up to ``push_timeout_s``)."""
    hello_timeout_s: float = pydantic.Field(10.0, gt=0)
    """Receiver side: a socket data-plane connection must deliver its whole DataHello within this many seconds of
    being accepted, else it is closed (DEADLINE_EXCEEDED); a gRPC connection its handshake. Sender side: the longest
    wait to connect to a data port."""
    max_grpc_connections: int = pydantic.Field(4096, ge=1)
    """Receiver side: gRPC connections at once (one per sender rank, and per watcher); more are closed as they
    connect. Each must finish its TLS and HTTP/2 handshake within ``hello_timeout_s`` and is closed after 5 minutes
    without a call, so clients that connect and stay silent cannot hold a server's file descriptors (a receiver runs
    inside a vLLM server: its descriptors are the server's). Raise it for a trainer of more ranks."""
    max_pending_data_connections: int = pydantic.Field(16, ge=1, le=4096)
    """Receiver side: data-plane connections that have not yet sent their DataHello, at most this many at once; a new
    one beyond closes the oldest (RESOURCE_EXHAUSTED, `DataReply.unopened`). Connections past their hello belong to
    the open update and are bounded by what its Begins announced, so silent connections never take their place."""
    max_watch_streams: int = pydantic.Field(4, ge=1, le=1024)
    """Receiver side: concurrent WatchVersion streams (each holds an RPC thread); more get RESOURCE_EXHAUSTED."""
    watch_timeout_s: float = pydantic.Field(300.0, gt=0)
    """Receiver side: a WatchVersion stream ends (OK) after this long; the watcher calls again with the last version it
    saw as `after_version`, so an idle watcher cannot hold its slot for ever."""
    max_version_gap: int = pydantic.Field(1 << 20, ge=1)
    """Receiver side: the furthest a Begin may jump past the committed policy_version (a trainer resumed at step N
    pushes N + 1 to engines that start at 0). Larger jumps are refused (OUT_OF_RANGE) so that no client can spend the
    version space: a version near 2^63 would leave nothing newer to accept until a restart."""
    auth_token: str | None = None
    """Bearer token; prefer `auth_token_env` so the token stays out of recipes and logs."""
    auth_token_env: str | None = DEFAULT_TOKEN_ENV
    """Environment variable holding the bearer token (used when `auth_token` is unset and the variable is set)."""
    tls_cert_path: str | None = None
    """PEM certificate of this node: the server certificate of a receiver, the client certificate for mTLS."""
    tls_key_path: str | None = None
    """PEM private key matching `tls_cert_path`."""
    tls_ca_path: str | None = None
    """PEM CA bundle that verifies peers (servers for a sender; clients too when `tls_require_client_cert`)."""
    tls_require_client_cert: bool = False
    """Receiver side: demand a client certificate signed by `tls_ca_path` (mTLS)."""
    tls_server_name: str | None = None
    """Override the host name checked against the server certificate (for certificates issued to another name)."""
    bind_host: str = "127.0.0.1"
    """Receiver bind address; loopback by default. Binding elsewhere without TLS and a token is refused."""
    port: int = pydantic.Field(0, ge=0, le=65535)
    """Receiver port; 0 picks a free one (returned by `start()`)."""
    allow_insecure_remote: bool = False
    """Allow a non-loopback bind without TLS or without a token (trusted private networks only)."""
    delta: bool | Literal["auto"] = "auto"
    """Delta pushes (only the elements that changed since the version the receiver holds). Sender side: true sends
    deltas to every receiver that holds the previous version; false never; "auto" to each receiver whose link is
    measured slower than this sender compares (a delta push cannot go faster than the compare: on loopback and fast
    links full pushes win; see `weight_sync/delta_policy.py` and `benchmarks/weight_sync_links.py`); where it sends no
    delta it asks the receiver to keep no base (`BeginRequest.drop_base`). Receiver side: true or "auto" keep the
    committed version as a base copy for deltas (twice the staging memory) unless the update's Begin says drop_base;
    false keeps none."""
    delta_encoding: Literal["sparse", "xor_zstd"] = "sparse"
    """Delta chunks as changed (index, value) pairs (fast to compute) or zstd of the XOR (fewer bytes, more CPU)."""
    delta_threads: int = pydantic.Field(4, ge=1, le=64)
    """Threads of a sender that encode delta chunks ahead of its streams (the compare is compute-bound), so a host's
    idle cores between steps shorten a delta push."""
    delta_zstd_level: int = pydantic.Field(1, ge=-5, le=19)
    """zstd level of delta chunks (1 is fast; higher compresses better and costs sender CPU)."""
    relay_fanout: int = pydantic.Field(0, ge=0, le=MAX_RELAY_FANOUT)
    """0: the sender streams to every receiver. k >= 1: the sender streams to k receivers and each forwards to up to k
    more, so the sender's bytes per version stay about k x model bytes however many receivers there are."""
    data_plane: Literal["auto", "shm", "tcp", "grpc"] = "auto"
    """How shard bytes travel. 'shm': through shared memory to receivers on this host that offer it (a memfd per
    stream, its file descriptor passed over a Unix socket; control stays on gRPC, Begin hands each rank a ticket): the
    bytes are copied once per side. 'tcp': over plain sockets to the receiver's data port, at the socket's own rate.
    'grpc': as Push chunks inside gRPC, which works through TLS and proxies but copies every chunk several times.
    'auto': shm where the receiver offers it on this host, else tcp where both ends allow it (no TLS, the receiver
    offers a data port; relay trees too), else grpc; a stream a data plane refuses before opening it goes over gRPC.
    'shm' and 'tcp' insist: a receiver without that plane is reported failed. Receiver side: the socket plane is
    offered unless 'grpc' or TLS (it is not encrypted); the shared-memory plane with 'shm' or `offer_shm` (also with
    TLS: its bytes never leave the host), never with 'grpc'."""
    offer_shm: bool = False
    """Receiver side: also offer the shared-memory data plane to senders on this host (whatever `data_plane` says,
    unless 'grpc'), so that 'auto' senders of a shared config use it there and tcp or grpc elsewhere."""
    data_port: int = pydantic.Field(0, ge=0, le=65535)
    """Receiver's socket data-plane port; 0 picks a free one (announced in Describe)."""
    num_server_threads: int = pydantic.Field(64, ge=4)
    """Receiver RPC threads. Set apart: `max_watch_streams` for WatchVersion streams, 16 for Commits waiting on the
    one applying their update and 4 for short calls (Describe, Begin, Abort, the applying Commit); the rest is the most
    gRPC Push streams served at once (each open stream holds a thread; more get RESOURCE_EXHAUSTED, after a wait of up
    to 1 s while streams of a dropped update are still being cut).
    Socket data-plane streams hold no RPC thread."""
    endpoints: list[str] = []
    """External receivers (host:port) that get every version besides the rollout workers' receivers."""

    @pydantic.field_validator("endpoints")
    @classmethod
    def _check_endpoints(cls, value: list[str]) -> list[str]:
        for endpoint in value:
            host, sep, port = endpoint.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"endpoint {endpoint!r}: expected HOST:PORT, e.g. '10.0.0.5:50051'")
        return value

    @pydantic.model_validator(mode="after")
    def _check_tls(self) -> WeightSyncConfig:
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise FieldError("tls_key_path", "set both tls_cert_path and tls_key_path, or neither")
        if self.tls_require_client_cert and (self.tls_ca_path is None or self.tls_cert_path is None):
            raise FieldError("tls_require_client_cert",
                             "tls_require_client_cert needs tls_ca_path (to verify clients) and tls_cert_path/key")
        if self.data_plane == "tcp" and (self.tls_cert_path is not None or self.tls_ca_path is not None):
            raise FieldError("data_plane", "data_plane='tcp' sends plaintext: with TLS configured use 'auto' or 'grpc'")
        if self.max_grpc_push_streams < 1:
            raise FieldError("num_server_threads", (
                f"num_server_threads={self.num_server_threads} leaves no thread for gRPC Push streams after "
                f"max_watch_streams={self.max_watch_streams} and {RESERVED_SERVER_THREADS} reserved ones; raise it to "
                f"at least {self.max_watch_streams + RESERVED_SERVER_THREADS + 1}"
            ))  # fmt: skip
        if self.chunk_bytes % 8:
            raise FieldError("chunk_bytes", f"chunk_bytes={self.chunk_bytes} must be a multiple of 8 so chunks align "
                                            "to elements")  # fmt: skip
        return self

    def resolve_token(self) -> str | None:
        """The bearer token from `auth_token`, else from the environment variable `auth_token_env`, else None.

        Raises ``ValueError`` when that variable is set but empty: a receiver would otherwise run without a token
        (``export VAR=$(cat missing-file)`` is the usual way to get there)."""
        if self.auth_token:
            return self.auth_token
        if not self.auth_token_env:
            return None
        value = os.environ.get(self.auth_token_env)
        if value is not None and not value.strip():
            raise ValueError(f"the token's environment variable {self.auth_token_env} (auth_token_env) is set but "
                             "empty: give it the token, or unset it to run without one (loopback only)")  # fmt: skip
        return value

    @property
    def offers_shm(self) -> bool:
        """Receiver side: whether it offers the shared-memory data plane (`data_plane = "shm"` or `offer_shm`)."""
        return self.data_plane == "shm" or (self.offer_shm and self.data_plane != "grpc")

    @property
    def max_grpc_push_streams(self) -> int:
        """Receiver side: the most gRPC Push streams served at once, what `num_server_threads` leaves after the threads
        set apart for WatchVersion streams, waiting Commits and short calls."""
        return self.num_server_threads - self.max_watch_streams - RESERVED_SERVER_THREADS

    @property
    def max_message_bytes(self) -> int:
        """gRPC message limit: one chunk plus room for its header."""
        return self.chunk_bytes + (64 << 10)
