"""TLS and mTLS with certificates made in the test (a throwaway CA signs a server and a client certificate)."""

import datetime
import ipaddress

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from ws_helpers import rank_shards, tiny_state_dict, zeros_like_dict

from weight_sync.channel import WeightSyncClient
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.report import error_text
from weight_sync.sender import WeightSender
from weight_sync.sink import StateDictSink


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test-ca", ca_key, None, None, ca=True)
    paths = {"ca": root / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(who, key, ca.subject, ca_key, ca=False)
        paths[f"{who}_cert"] = root / f"{who}.pem"
        paths[f"{who}_key"] = root / f"{who}.key"
        paths[f"{who}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{who}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return {k: str(v) for k, v in paths.items()}


def _serve(config):
    sd = tiny_state_dict(5)
    sink = StateDictSink(zeros_like_dict(sd))
    receiver = WeightReceiver(sink, config)
    receiver.start()
    return receiver, sink, sd


def _push_ok(address, config, sd):
    with WeightSender([address], config) as sender:
        report = sender.push(1, rank_shards(sd, 0, 1))
        return not report.failed and sender.commit(1) == {address: None}


def test_tls_push_works_and_plaintext_clients_are_refused(pki):
    server = WeightSyncConfig(tls_cert_path=pki["server_cert"], tls_key_path=pki["server_key"], auth_token="t")
    receiver, sink, sd = _serve(server)
    try:
        plain = WeightSyncClient(receiver.address, WeightSyncConfig(auth_token="t", num_retries=0, rpc_timeout_s=3))
        with pytest.raises(grpc.RpcError) as err:
            plain.describe()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "may require TLS (give tls_ca_path)" in error_text(err.value)  # gRPC says only "Socket closed"
        client = WeightSyncConfig(tls_ca_path=pki["ca"], auth_token="t")
        assert _push_ok(receiver.address, client, sd)
        assert all(torch.equal(sink.state_dict[k], v) for k, v in sd.items())
    finally:
        receiver.stop(0)


def test_a_tls_client_of_a_plaintext_receiver_is_told_so(pki):
    receiver, _, _ = _serve(WeightSyncConfig())
    try:
        client = WeightSyncClient(receiver.address, WeightSyncConfig(tls_ca_path=pki["ca"], num_retries=0,
                                                                     rpc_timeout_s=3))  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            client.describe()
        assert "the receiver does not speak TLS" in error_text(err.value)
    finally:
        receiver.stop(0)


def test_mtls_requires_a_client_certificate_signed_by_the_ca(pki):
    server = WeightSyncConfig(
        tls_cert_path=pki["server_cert"], tls_key_path=pki["server_key"], tls_ca_path=pki["ca"],
        tls_require_client_cert=True,
    )
    receiver, sink, sd = _serve(server)
    try:
        anonymous = WeightSyncClient(
            receiver.address, WeightSyncConfig(tls_ca_path=pki["ca"], num_retries=0, rpc_timeout_s=3)
        )
        with pytest.raises(grpc.RpcError) as err:
            anonymous.describe()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        client = WeightSyncConfig(
            tls_ca_path=pki["ca"], tls_cert_path=pki["client_cert"], tls_key_path=pki["client_key"]
        )
        assert _push_ok(receiver.address, client, sd)
        assert receiver.policy_version == 1
    finally:
        receiver.stop(0)


def test_remote_bind_is_allowed_with_tls_and_a_token(pki):
    with pytest.raises(ValueError, match="not loopback"):
        _serve(WeightSyncConfig(bind_host="0.0.0.0", auth_token="t"))  # no TLS: refused
    with pytest.raises(ValueError, match="not loopback"):
        _serve(WeightSyncConfig(bind_host="0.0.0.0", tls_cert_path=pki["server_cert"],
                                tls_key_path=pki["server_key"]))  # no token: refused  # fmt: skip
    config = WeightSyncConfig(bind_host="0.0.0.0", tls_cert_path=pki["server_cert"], tls_key_path=pki["server_key"],
                              auth_token="t")
    receiver, sink, sd = _serve(config)
    try:
        port = receiver.address.rpartition(":")[2]  # reached from this host as localhost; shown as bound
        assert receiver.address == f"localhost:{port}" and receiver.listening_on == f"0.0.0.0:{port}"
        assert _push_ok(f"127.0.0.1:{port}", WeightSyncConfig(
            tls_ca_path=pki["ca"], auth_token="t"), sd)  # fmt: skip
        assert receiver.policy_version == 1 and all(torch.equal(sink.state_dict[k], v) for k, v in sd.items())
    finally:
        receiver.stop(0)


def test_silent_connections_are_closed_and_capped_while_a_sender_still_pushes(pki):
    """Two clients each held ~10,000 connections that sent 6 bytes of a TLS ClientHello: the server's descriptors ran
    out (a plugin receiver's are the vLLM server's, whose HTTP API failed with them). A handshake not finished within
    hello_timeout_s is closed, and connections past max_grpc_connections are closed as they connect."""
    import socket
    import time

    server = WeightSyncConfig(tls_cert_path=pki["server_cert"], tls_key_path=pki["server_key"], auth_token="t",
                              hello_timeout_s=3.0, max_grpc_connections=4)  # fmt: skip
    receiver, sink, sd = _serve(server)

    def closed(sock: socket.socket) -> bool:
        sock.setblocking(False)
        try:
            return sock.recv(1) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True

    silent = []
    try:
        for _ in range(6):
            sock = socket.create_connection(("127.0.0.1", int(receiver.address.rsplit(":", 1)[1])))
            sock.send(b"\x16\x03\x01\x02\x00\x01")  # the start of a ClientHello, never finished
            silent.append(sock)
        time.sleep(0.5)
        assert sum(closed(s) for s in silent) == 2  # past the cap: closed as they connect
        deadline = time.monotonic() + 10
        while not all(closed(s) for s in silent) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(closed(s) for s in silent)  # the handshake timeout closed the rest
        assert _push_ok(receiver.address, WeightSyncConfig(tls_ca_path=pki["ca"], auth_token="t"), sd)
    finally:
        for sock in silent:
            sock.close()
        receiver.stop(0)
