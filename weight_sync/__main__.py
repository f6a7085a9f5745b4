"""Command line for external servers and checkpoints.

    python -m weight_sync serve --dir CKPT_DIR [--host 127.0.0.1] [--port 50051] [--<config field> VALUE ...]
        run a standalone receiver whose sink keeps the latest version as CKPT_DIR/model.safetensors; it starts at
        the version the directory holds, so a restarted server never accepts older ones
    python -m weight_sync serve --dir ADAPTER_DIR --adapter_of BASE_DIR --rank R --alpha A [--target_modules ...]
        [--target_parameters ...]
        the same for LoRA adapters: ADAPTER_DIR is kept as a PEFT adapter directory of the latest version (for servers
        that hot-load adapters, e.g. vLLM's /v1/load_lora_adapter); the manifest is the adapters over BASE_DIR
    python -m weight_sync push --checkpoint DIR --to HOST:PORT [--to ...] [--version N] [--<config field> VALUE ...]
        push an HF checkpoint (*.safetensors) to receivers and commit it as policy_version N
    python -m weight_sync describe --to HOST:PORT
        print a receiver's version and manifest
    python -m weight_sync conformance --to HOST:PORT [--token TOKEN] [--case NAME ...] [--list]
        run the protocol's conformance cases (weight_sync/PROTOCOL.md) against a receiver and print a pass/fail table;
        it commits synthetic versions of a few small tensors, so point it at a receiver whose weights may change

Every `WeightSyncConfig` field is a flag of `serve` (`--chunk_bytes 65536`, `--auth_token_env MY_TOKEN`,
`--tls_ca_path ca.pem`), and every field a sender reads a flag of the client commands (`push`, `describe`,
`conformance`: a receiver's own settings, such as `--port`, are refused there); `<command> --help` lists them with
their docs and defaults. Values are read as TOML values (`true`, `[...]`, numbers), anything else as a string. The
bearer token is read from $RL_ALIGN_WEIGHT_SYNC_TOKEN by default.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from pydantic.fields import FieldInfo

from common.config import ConfigError, parse_overrides, validate_config
from common.signals import wait_for_stop
from weight_sync.config import DEFAULT_TOKEN_ENV, RECEIVER_FIELDS, WeightSyncConfig

if TYPE_CHECKING:
    from weight_sync.chunking import Shard

_FIELD = "config."  # argparse dest prefix of the generated WeightSyncConfig flags
_CLIENT = "config:client"  # argparse dest: the command takes no receiver settings


def _metavar(name: str, annotation: object) -> str:
    """How a field's value is written on the command line."""
    if typing.get_origin(annotation) is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if annotation is bool:
        return "{true,false}"
    if bool in typing.get_args(annotation):  # bool | Literal[...]
        literals = [a for t in typing.get_args(annotation) if typing.get_origin(t) is typing.Literal
                    for a in typing.get_args(t)]
        return "{" + ",".join(["true", "false", *map(str, literals)]) + "}"
    if annotation is int:
        return "INT"
    if annotation is float:
        return "SECONDS" if name.endswith("_s") else "FLOAT"
    if typing.get_origin(annotation) is list:
        return '["HOST:PORT",...]'
    return "PATH" if name.endswith("_path") else "STR"


def _default_text(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, list) else str(value)


def add_config_flags(
    parser: argparse.ArgumentParser, aliases: dict[str, list[str]] | None = None, client: bool = False
) -> None:
    """One `--<field>` flag per `WeightSyncConfig` field, its help the field's docstring and default (the one source
    of truth: a new field is a flag of every command that reads it). `aliases`: more flag names of a field (`--host`).
    `client`: a command that only talks to receivers, whose own settings (`RECEIVER_FIELDS`) it does not take."""
    group = parser.add_argument_group("WeightSyncConfig fields (weight_sync/config.py)")
    parser.set_defaults(**{_CLIENT: client})
    for name, field in WeightSyncConfig.model_fields.items():
        if client and name in RECEIVER_FIELDS:
            continue
        doc = " ".join((field.description or "").split()).replace("%", "%%")
        flags = [f"--{name}", *(f"--{a}" for a in (aliases or {}).get(name, []))]
        group.add_argument(
            *flags, dest=_FIELD + name, metavar=_metavar(name, field.annotation), default=argparse.SUPPRESS,
            help=f"{doc} (default: {_default_text(field)})",
        )


def config_of(args: argparse.Namespace, extra: list[str], **fields: object) -> WeightSyncConfig:
    """The config from the generated flags, then `fields` (command options that set config fields); `extra` (flags
    argparse did not know) is validated too, so a misspelt field fails naming the field it probably meant."""
    flags: list[str] = []
    for dest, raw in vars(args).items():
        if dest.startswith(_FIELD):
            flags += [f"--{dest.removeprefix(_FIELD)}", raw]
    overrides = parse_overrides(flags + extra)
    if getattr(args, _CLIENT, False) and (settings := sorted(RECEIVER_FIELDS & overrides.keys())):
        raise ValueError(
            f"{', '.join('--' + s for s in settings)}: receiver settings, which {args.command} does not read (it "
            "only talks to receivers); give it to the receiver (`serve`, or the rl_align plugin's config)"
        )
    overrides.update({k: v for k, v in fields.items() if v is not None})
    return validate_config(WeightSyncConfig, overrides, source="command line", what="settings")


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from weight_sync.peft import AdapterSpec, stored_adapter_fields
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import PeftAdapterDirSink, SafetensorsDirSink, WeightSink

    sink: WeightSink
    if args.adapter_of is None:
        sink = SafetensorsDirSink(args.dir)
    else:
        fields = {"rank": args.rank, "alpha": args.alpha, "target_modules": args.target_modules,
                  "target_parameters": args.target_parameters}  # fmt: skip
        held = stored_adapter_fields(args.dir)
        if held is None and (args.rank is None or args.alpha is None):
            raise ValueError(
                "--adapter_of: give the --rank and --alpha of the run's [model.lora] (and its --target_modules unless "
                "they are all seven projections): pushes carry the adapter tensors, which show the rank but not "
                "alpha, so a wrong alpha would scale every adapter silently"
            )
        fields = {**(held or {}), **{k: v for k, v in fields.items() if v is not None}}
        spec = validate_config(AdapterSpec, fields, source="flags", what="adapter settings")
        sink = PeftAdapterDirSink(args.dir, args.adapter_of, spec)
    config = config_of(args, extra)
    if config.tls_cert_path is not None and config.tls_ca_path is None:
        print("warning: TLS without --tls_ca_path: this receiver cannot verify the TLS receivers a sender asks it to "
              "relay to (relay_fanout), and those pushes fail at them ('Socket closed'); give the CA that signed their "
              "certificates", file=sys.stderr, flush=True)  # fmt: skip
    receiver = WeightReceiver(sink, config)
    receiver.start()
    # The last word stays the address a client on this host connects to (scripts read it).
    where = f"on every interface ({receiver.listening_on}); from this host: " if receiver.listens_everywhere else "on "
    print(f"serving {args.dir} {where}{receiver.address}", flush=True)
    wait_for_stop()
    receiver.stop()
    return 0


def _push(args: argparse.Namespace, extra: list[str]) -> int:
    import grpc

    from weight_sync.checkpoint import checkpoint_shards
    from weight_sync.peft import stored_adapter_fields
    from weight_sync.sender import WeightSender

    config = config_of(args, extra)
    session = args.session or f"cli-{os.getpid()}-{secrets.token_hex(3)}"  # two users' pushes never share an update
    adapter = stored_adapter_fields(args.checkpoint)  # a PEFT adapter directory: receivers check its alpha
    alpha = float(adapter["alpha"] or 0.0) if adapter is not None else 0.0
    with WeightSender(args.to, config, session_id=session, lora_alpha=alpha) as sender:
        version = args.version
        if version is None:  # one above the highest version the receivers serve
            described = sender.describe()
            if unreachable := {a: r for a, r in described.items() if isinstance(r, str)}:
                for address, why in unreachable.items():
                    print(f"{address}: cannot read its version: {why}")
                refused = f"{grpc.StatusCode.UNAUTHENTICATED.name}:"  # the code, as report.error_text leads with it
                if any(why.startswith(refused) for why in unreachable.values()):
                    print("nothing pushed: the receiver refused the token; give the one it was started with "
                          f"(--auth_token, or ${DEFAULT_TOKEN_ENV})", flush=True)  # fmt: skip
                else:
                    print("nothing pushed: give --version, or reach every receiver", flush=True)
                return 1
            version = max(r.policy_version for r in described.values() if not isinstance(r, str)) + 1
        report = sender.push(version, _as_declared(checkpoint_shards(args.checkpoint), sender.declared_dtypes()))
        if report.failed:  # all or nothing: a receiver that took the push must not commit what another refused
            sender.abort(version, "the push failed on another receiver")
            for address, error in report.errors.items():
                print(f"{address}: {'pushed, then aborted' if error is None else f'push failed: {error}'}")
            print(f"nothing committed: v{version} was aborted on every receiver", flush=True)
            return 1
        committed = sender.commit(version)
    failed = {a: e for a, e in committed.items() if e}
    for address, error in committed.items():
        print(f"{address}: {f'committed v{version}' if error is None else f'commit failed: {error}'}")
    print(f"{report.payload_bytes / 1e6:.1f} MB in {report.seconds:.2f} s", flush=True)
    return 1 if failed else 0


def _as_declared(shards: Iterable[Shard], dtypes: dict[str, str]) -> Iterator[Shard]:
    """``shards`` in the dtypes the receivers declare (a float32 checkpoint pushed to a bfloat16 server), as the
    trainer sends them."""
    from weight_sync.chunking import Shard, as_dtype

    for shard in shards:
        yield Shard(shard.name, as_dtype(shard.tensor, dtypes.get(shard.name)), shard.global_shape,
                    shard.global_offsets)  # fmt: skip


def _describe(args: argparse.Namespace, extra: list[str]) -> int:
    import grpc

    from weight_sync.channel import WeightSyncClient
    from weight_sync.report import error_text

    client = WeightSyncClient(args.to, config_of(args, extra))
    try:
        reply = client.describe()
    except grpc.RpcError as e:
        print(f"error: {args.to} does not answer Describe: {error_text(e)}", file=sys.stderr)
        return 1
    planes = [f"socket data plane on port {reply.data_port}"] if reply.data_port else []
    if reply.HasField("shm_plane"):
        planes.append(f"shared-memory plane (same host, pid {reply.shm_plane.pid})")
    plane = " + ".join(planes) or "gRPC Push only"
    version = reply.protocol_version
    print(
        f"{args.to}: policy_version {reply.policy_version}, {len(reply.manifest)} tensors, {plane}, "
        f"protocol {version.major or 1}.{version.minor}"
        + (f", applies adapters with lora_alpha {reply.lora_alpha:g}" if reply.lora_alpha else "")
    )
    for spec in reply.manifest:
        print(f"  {spec.name} {tuple(spec.shape)} {spec.dtype}")
    return 0


def _conformance(args: argparse.Namespace, extra: list[str]) -> int:
    import grpc

    from weight_sync.conformance import describe_cases, format_table, run_conformance

    if args.list:
        print(describe_cases())
        return 0
    if not args.to:
        raise ValueError("conformance needs --to HOST:PORT (or --list)")
    config = config_of(args, extra, auth_token=args.token)
    try:
        results = run_conformance(
            args.to, config, names=args.case or (), include_pending=args.include_pending, timeout_s=args.timeout_s,
            probe=args.tensor, max_wait_s=args.max_wait_s,
        )
    except grpc.RpcError as e:
        print(f"error: {args.to} does not answer Describe: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    print(format_table(results), flush=True)
    return 1 if any(r.outcome == "FAIL" for r in results) else 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace, list[str]], int]]]:
    parser = argparse.ArgumentParser(prog="python -m weight_sync", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, allow_abbrev=False)

    serve = command("serve", "run a standalone receiver into a safetensors directory")
    serve.add_argument("--dir", required=True, help="HF checkpoint directory (its *.safetensors give the manifest), or "
                       "with --adapter_of the PEFT adapter directory to keep")  # fmt: skip
    serve.add_argument("--adapter_of", default=None, help="serve LoRA adapters over this base HF model directory")
    serve.add_argument("--rank", type=int, default=None,
                       help="LoRA rank of the adapters (required with --adapter_of, unless --dir holds an adapter)")
    serve.add_argument("--alpha", type=float, default=None,
                       help="LoRA alpha of the adapters (required with --adapter_of, unless --dir holds an adapter)")
    serve.add_argument("--target_modules", nargs="+", default=None,
                       help="projections with adapters (default: those of the adapter in --dir, else all of "
                            "q/k/v/o/gate/up/down_proj)")  # fmt: skip
    serve.add_argument("--target_parameters", nargs="+", default=None,
                       help="MoE expert weights with an adapter per expert (PEFT target_parameters: "
                            "mlp.experts.gate_up_proj, mlp.experts.down_proj; default: none)")  # fmt: skip
    add_config_flags(serve, aliases={"bind_host": ["host"]})
    push = command("push", "push an HF checkpoint to receivers")
    push.add_argument("--checkpoint", required=True, help="directory with *.safetensors")
    push.add_argument("--to", required=True, action="append", help="receiver HOST:PORT (repeatable)")
    push.add_argument("--version", type=int, default=None,
                      help="policy_version to commit (must exceed the receivers'; default: one above the highest "
                           "they serve)")  # fmt: skip
    push.add_argument("--session", default=None, help="session id of this push (default: one of its own)")
    add_config_flags(push, client=True)
    describe = command("describe", "print a receiver's version and manifest")
    describe.add_argument("--to", required=True, help="receiver HOST:PORT")
    add_config_flags(describe, client=True)
    conformance = command("conformance", "run the protocol's conformance cases against a receiver")
    conformance.add_argument("--to", help="receiver HOST:PORT")
    conformance.add_argument("--token", default=None, help="bearer token (default: auth_token / $auth_token_env); "
                             "given, the receiver must refuse calls without it")
    conformance.add_argument("--case", action="append", help="run only this case (repeatable); --list names them")
    conformance.add_argument("--tensor", default=None, help="tensor the cases push (default: smallest with 4+ rows)")
    conformance.add_argument("--include_pending", action="store_true",
                             help="also run cases whose expectation depends on work not landed yet")
    conformance.add_argument("--timeout_s", type=float, default=10.0, help="deadline of each call (default: 10)")
    conformance.add_argument("--max_wait_s", type=float, default=60.0,
                             help="longest wait for a receiver timeout (hello, idle stream; default 60)")
    conformance.add_argument("--list", action="store_true", help="list the cases and what each expects, then exit")
    add_config_flags(conformance, client=True)
    return parser, {"serve": _serve, "push": _push, "describe": _describe, "conformance": _conformance}


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return commands[args.command](args, extra)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
