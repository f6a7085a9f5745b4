"""Regenerate the checked-in gRPC stubs from ``protos/*.proto``: ``python -m protos.generate [--out DIR]``.

Stubs are generated with ``-I <repo root>`` so that they import each other as ``protos.<name>_pb2``. A test regenerates
into a temporary folder and fails when the checked-in files drift from the ``.proto`` sources.

The gRPC stubs stamp the grpcio release that generated them as the oldest runtime they accept
(``GRPC_GENERATED_VERSION``); the stamp is set to the generator's minor series (``1.85.4`` -> ``1.85.0``), the series
``pyproject.toml`` pins, so a patch release of grpcio-tools neither changes the checked-in stubs nor makes them refuse
an older patch of grpcio.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTOS_DIR.parent


def generated_names(proto: Path) -> list[str]:
    """File names the generator writes for one ``.proto`` file."""
    stem = proto.stem
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on every ``.proto`` here; return the written files. Raises on protoc errors."""
    from grpc_tools import protoc  # grpcio-tools: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTOS_DIR.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    written: list[Path] = []
    for proto in protos:
        rel = proto.relative_to(REPO_ROOT)
        args = [
            "protoc",
            f"-I{REPO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed on {rel} with exit code {code}")
        written += [out_dir / rel.parent / name for name in generated_names(proto)]
    for path in written:
        if path.name.endswith("_pb2_grpc.py"):
            _stamp_minor_series(path)
    return written


def _stamp_minor_series(stub: Path) -> None:
    """Set the stub's ``GRPC_GENERATED_VERSION`` to ``<major>.<minor>.0`` of the release it names; raise if it names
    none (a generator whose stubs this module does not know)."""
    pattern = re.compile(r"^GRPC_GENERATED_VERSION = '(\d+)\.(\d+)\.[^']*'$", re.MULTILINE)
    text = stub.read_text()
    stamped, count = pattern.subn(lambda m: f"GRPC_GENERATED_VERSION = '{m[1]}.{m[2]}.0'", text)
    if count != 1:
        raise RuntimeError(f"{stub}: expected one GRPC_GENERATED_VERSION line, found {count}")
    stub.write_text(stamped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(REPO_ROOT), help="root to write protos/<name>_pb2*.py under")
    args = parser.parse_args(argv)
    import os

    cwd = os.getcwd()
    os.chdir(REPO_ROOT)  # protoc resolves the relative proto path against -I
    try:
        for path in generate(Path(args.out).resolve()):
            print(path)
    finally:
        os.chdir(cwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
