"""The checked-in stubs match protos/weight_sync.proto, and the package keeps its dependency rules."""

import subprocess
import sys

from protos.generate import PROTOS_DIR, REPO_ROOT, generate, generated_names

PY = sys.executable


def test_checked_in_stubs_match_a_fresh_generation(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    generate(tmp_path)
    for proto in PROTOS_DIR.glob("*.proto"):
        for name in generated_names(proto):
            fresh = (tmp_path / "protos" / name).read_text()
            checked_in = (PROTOS_DIR / name).read_text()
            assert fresh == checked_in, f"protos/{name} is stale: run `python -m protos.generate` (make protos)"


def test_the_protobuf_floor_admits_no_runtime_older_than_the_stubs():
    """The generated messages refuse a protobuf runtime older than the protoc that generated them (a 6.x runtime under
    7.x code fails at import): ``pyproject.toml``'s floor must be at least that version, so an install resolves a
    runtime the stubs accept."""
    import re
    import tomllib

    from packaging.version import Version

    stub = (PROTOS_DIR / "weight_sync_pb2.py").read_text()
    match = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", stub)
    assert match, "protos/weight_sync_pb2.py names no protobuf gencode version"
    generated = Version(".".join(match.groups()))
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (floor,) = [d.split(">=", 1)[1].split(",")[0] for d in deps if d.replace(" ", "").startswith("protobuf>=")]
    assert Version(floor) >= generated, f"pyproject.toml: protobuf>={floor}, the stubs need >= {generated}"


def test_config_and_cli_help_import_no_torch():
    code = "import sys, weight_sync.config, weight_sync.__main__; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([PY, "-c", code], cwd=REPO_ROOT, check=True)


def test_weight_sync_never_imports_torch_distributed_or_engines():
    import ast

    for path in (REPO_ROOT / "weight_sync").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith(("torch.distributed", "vllm", "trainer", "rollout", "ray")), (
                    f"{path.name} imports {name}: weight_sync depends only on protos, common and torch"
                )


def test_stock_stub_service_names_match_our_raw_methods():
    from protos import weight_sync_pb2 as pb
    from weight_sync.channel import SERVICE

    service = pb.DESCRIPTOR.services_by_name["WeightSync"]
    assert service.full_name == SERVICE
    assert {m.name for m in service.methods} == {"Describe", "Begin", "Push", "Commit", "Abort", "WatchVersion"}
