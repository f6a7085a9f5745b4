"""Regenerate the checked-in gRPC stubs from ``protos/*.proto``: ``python -m protos.generate [--out DIR]``.

Stubs are generated with ``-I <repo root>`` so that they import each other as ``protos.<name>_pb2``. A test regenerates
into a temporary folder and fails when the checked-in files drift from the ``.proto`` sources.
"""

from __future__ import annotations

import argparse
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
    return written


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
