"""Command line for external servers and checkpoints.

    python -m weight_sync serve --dir CKPT_DIR [--host 127.0.0.1] [--port 50051] [--<config field> VALUE ...]
        run a standalone receiver whose sink keeps the latest version as CKPT_DIR/model.safetensors; it starts at
        the version the directory holds, so a restarted server never accepts older ones
    python -m weight_sync push --checkpoint DIR --to HOST:PORT [--to ...] [--version N] [--<config field> VALUE ...]
        push an HF checkpoint (*.safetensors) to receivers and commit it as policy_version N
    python -m weight_sync describe --to HOST:PORT
        print a receiver's version and manifest

Extra `--field VALUE` flags set `WeightSyncConfig` fields (e.g. `--auth_token_env MY_TOKEN --tls_ca_path ca.pem`).
The bearer token is read from $RL_ALIGN_WEIGHT_SYNC_TOKEN by default.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from common.config import ConfigError, parse_overrides, validate_config
from weight_sync.config import WeightSyncConfig


def _config(extra: list[str], **fields: object) -> WeightSyncConfig:
    overrides = parse_overrides(extra)
    overrides.update({k: v for k, v in fields.items() if v is not None})
    return validate_config(WeightSyncConfig, overrides, source="command line")


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import SafetensorsDirSink

    config = _config(extra, bind_host=args.host, port=args.port)
    receiver = WeightReceiver(SafetensorsDirSink(args.dir), config)
    receiver.start()
    print(f"serving {args.dir} on {receiver.address}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    receiver.stop()
    return 0


def _push(args: argparse.Namespace, extra: list[str]) -> int:
    from weight_sync.checkpoint import checkpoint_shards
    from weight_sync.sender import WeightSender

    config = _config(extra)
    with WeightSender(args.to, config, session_id=args.session) as sender:
        report = sender.push(args.version, checkpoint_shards(args.checkpoint))
        committed = sender.commit(args.version)
    failed = {a: e for a, e in committed.items() if e}
    for address, error in committed.items():
        print(f"{address}: {f'committed v{args.version}' if error is None else error}")
    print(f"{report.payload_bytes / 1e6:.1f} MB in {report.seconds:.2f} s", flush=True)
    return 1 if failed else 0


def _describe(args: argparse.Namespace, extra: list[str]) -> int:
    from weight_sync.channel import WeightSyncClient

    client = WeightSyncClient(args.to, _config(extra))
    reply = client.describe()
    plane = f"socket data plane on port {reply.data_port}" if reply.data_port else "gRPC Push only"
    print(f"{args.to}: policy_version {reply.policy_version}, {len(reply.manifest)} tensors, {plane}")
    for spec in reply.manifest:
        print(f"  {spec.name} {tuple(spec.shape)} {spec.dtype}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weight_sync", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a standalone receiver into a safetensors directory")
    serve.add_argument("--dir", required=True, help="HF checkpoint directory (its *.safetensors give the manifest)")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default: a free one, printed)")
    push = sub.add_parser("push", help="push an HF checkpoint to receivers")
    push.add_argument("--checkpoint", required=True, help="directory with *.safetensors")
    push.add_argument("--to", required=True, action="append", help="receiver HOST:PORT (repeatable)")
    push.add_argument("--version", type=int, default=1, help="policy_version to commit (must exceed the receiver's)")
    push.add_argument("--session", default="cli", help="session id of this push")
    describe = sub.add_parser("describe", help="print a receiver's version and manifest")
    describe.add_argument("--to", required=True, help="receiver HOST:PORT")
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return {"serve": _serve, "push": _push, "describe": _describe}[args.command](args, extra)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
