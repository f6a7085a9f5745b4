"""deploy/ and the hardware recipes: manifests parse and describe a coherent GKE TPU cluster, every recipe they (and the
Dockerfiles and the operations guide) launch exists and validates, and each recipe fits the hardware it names.

Nothing here needs a cluster, an accelerator, or torch: manifests are read with PyYAML, recipes with ``load_recipe``
(``check_paths=False``: the model directories live on the cluster), and the real Qwen 3 architectures come from their
published ``config.json`` values.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.published import PUBLISHED_CONFIGS, PUBLISHED_PARAMS
from driver.placement import plan_placement
from driver.reservation import why_unplaceable
from recipe import Recipe, load_recipe
from rollout.pool import worker_resources
from trainer.group import rank_resources
from trainer.memory import activation_bytes, gathered_block_bytes, gathered_root_bytes, train_state_bytes
from trainer.models.config import ModelConfig
from trainer.models.hf_config import model_config_from_hf_dict
from trainer.models.registry import ATTENTION_BLOCKS, MOE_EXPERTS, OUTPUT_HEADS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
HARDWARE_RECIPES = [
    "recipes/qwen3_0p6b_gpu.toml", "recipes/qwen3_8b_tpu.toml", "recipes/qwen3_8b_lora_tpu.toml",
    "recipes/qwen3_30b_a3b_tpu.toml", "recipes/qwen3_0p6b_xla_tpu.toml",
]  # fmt: skip
# A RayCluster has no entrypoint: the recipe it is sized for.
CLUSTER_RECIPES = {"raycluster-tpu-v6e.yaml": "recipes/qwen3_8b_tpu.toml"}

TPU_ACCELERATORS = {"tpu-v6e-slice": 32, "tpu-v5-lite-podslice": 16}  # GKE node label -> HBM GiB per chip
GPU_HBM_GIB = 80
ACCELERATOR_KEY = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_KEY = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"

_RECIPE_REF = [
    re.compile(r"rl_align\.py\s+--recipe[= ]\s*([\w./-]+\.toml)"),
    re.compile(r'"rl_align\.py",\s*"--recipe",\s*"([^"]+)"'),  # Dockerfile exec form
]


# -- helpers -------------------------------------------------------------------------------------------------------
def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def _ray_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in MANIFESTS:
        for doc in _docs(path):
            if doc.get("kind") in ("RayCluster", "RayJob"):
                yield path, doc


def _group(spec: dict[str, Any], prefix: str) -> dict[str, Any]:
    groups = [g for g in spec["workerGroupSpecs"] if g["groupName"].startswith(prefix)]
    assert len(groups) == 1, f"expected one worker group named {prefix}*, got {[g['groupName'] for g in groups]}"
    return groups[0]


def _pod(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]


def _container(group: dict[str, Any]) -> dict[str, Any]:
    return _pod(group)["containers"][0]


def _chips_per_host(group: dict[str, Any]) -> int:
    return int(_container(group)["resources"]["limits"][TPU_RESOURCE])


def _num_cpus(group: dict[str, Any]) -> float:
    return float(group["rayStartParams"]["num-cpus"])


def _nodes(group: dict[str, Any]) -> list[dict[str, float]]:
    """The Ray nodes a worker group starts: one per host, with its CPUs and TPU chips."""
    node = {"CPU": _num_cpus(group), "TPU": float(_chips_per_host(group))}
    return [node] * (group["replicas"] * group["numOfHosts"])


def _mounts(group: dict[str, Any]) -> list[str]:
    return [m["mountPath"] for m in _container(group).get("volumeMounts", [])]


def _is_under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def _recipe_for(path: Path, doc: dict[str, Any]) -> str:
    if doc["kind"] == "RayJob":
        refs = _recipe_refs(doc["spec"]["entrypoint"])
        assert len(refs) == 1, f"{path.name}: entrypoint should run exactly one recipe: {doc['spec']['entrypoint']!r}"
        return refs[0]
    return CLUSTER_RECIPES[path.name]


def _recipe_refs(text: str) -> list[str]:
    return [m for pattern in _RECIPE_REF for m in pattern.findall(text)]


def _ray_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("ray[")]
    return pin.split("==")[1]


# -- manifests -----------------------------------------------------------------------------------------------------
def test_manifests_exist_and_parse():
    names = {p.name for p in MANIFESTS}
    assert names >= {"raycluster-tpu-v6e.yaml", "rayjob-qwen3-8b.yaml", "rayjob-qwen3-30b-a3b.yaml",
                     "rayjob-qwen3-0p6b-xla.yaml"}  # fmt: skip
    for path in MANIFESTS:
        docs = _docs(path)
        assert docs, f"{path.name} holds no document"
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path.name


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kinds_and_api_versions(path):
    for doc in _docs(path):
        assert doc["kind"] in ("RayCluster", "RayJob"), f"{path.name}: unexpected kind {doc['kind']}"
        assert doc["apiVersion"] == "ray.io/v1", f"{path.name}: KubeRay's stable API is ray.io/v1"
        spec = _cluster_spec(doc)
        assert spec["rayVersion"] == _ray_pin(), f"{path.name}: rayVersion must match the image's ray pin"
        assert "headGroupSpec" in spec and spec["workerGroupSpecs"], path.name


def test_rayjobs_run_one_recipe_and_clean_up():
    jobs = [(p, d) for p, d in _ray_docs() if d["kind"] == "RayJob"]
    assert {p.name for p, _ in jobs} == {
        "rayjob-qwen3-8b.yaml", "rayjob-qwen3-30b-a3b.yaml", "rayjob-qwen3-0p6b-xla.yaml",
    }  # fmt: skip
    for path, doc in jobs:
        spec = doc["spec"]
        assert re.fullmatch(r"python rl_align\.py --recipe recipes/[\w.-]+\.toml", spec["entrypoint"]), path.name
        assert spec["shutdownAfterJobFinishes"] is True, path.name
        runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
        assert runtime_env["working_dir"] == "/app", f"{path.name}: run the code baked into the image"
        assert runtime_env["env_vars"]["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1", f"{path.name}: torch-tpu must load"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_tpu_groups_request_whole_slices_consistently(path):
    for doc in _docs(path):
        spec = _cluster_spec(doc)
        assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", f"{path.name}: no actor on the head"
        assert TPU_RESOURCE not in str(spec["headGroupSpec"]), f"{path.name}: the head runs on a CPU node"
        for group in spec["workerGroupSpecs"]:
            where = f"{path.name}:{group['groupName']}"
            resources = _container(group)["resources"]
            requested, limit = resources["requests"][TPU_RESOURCE], resources["limits"][TPU_RESOURCE]
            assert requested == limit, f"{where}: google.com/tpu requests {requested} != limits {limit}"
            selector = _pod(group)["nodeSelector"]
            assert selector[ACCELERATOR_KEY] in TPU_ACCELERATORS, where
            topology = [int(x) for x in selector[TOPOLOGY_KEY].split("x")]
            assert prod(topology) == group["numOfHosts"] * _chips_per_host(group), (
                f"{where}: topology {selector[TOPOLOGY_KEY]} has {prod(topology)} chips, but numOfHosts "
                f"{group['numOfHosts']} x {_chips_per_host(group)} chips per host requested"
            )
            assert group["replicas"] == group["minReplicas"] == group["maxReplicas"], f"{where}: fixed size"
            assert any(t["key"] == TPU_RESOURCE for t in _pod(group)["tolerations"]), f"{where}: TPU taint"
            env = {e["name"]: e.get("value") for e in _container(group)["env"]}
            assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1", where
            assert "RL_ALIGN_WEIGHT_SYNC_TOKEN" in env, where
        trainer = _group(spec, "trainer")
        if load_recipe(ROOT / _recipe_for(path, doc), check_paths=False).trainer.device == "xla":
            # torch_xla's trainer: one rank on one chip, in the torch_xla image with PJRT on the TPU.
            assert trainer["numOfHosts"] == 1 and _chips_per_host(trainer) == 1, f"{path.name}: one chip"
            env = {e["name"]: e.get("value") for e in _container(trainer)["env"]}
            assert env["PJRT_DEVICE"] == "TPU" and "rl-align-xla" in _container(trainer)["image"], path.name
            others = [spec["headGroupSpec"], _group(spec, "rollout")]
            assert all("rl-align-tpu" in g["template"]["spec"]["containers"][0]["image"] for g in others), path.name
        else:
            assert trainer["numOfHosts"] > 1 and trainer["replicas"] == 1, f"{path.name}: one multi-host trainer slice"


@pytest.mark.parametrize("path, doc", [pytest.param(p, d, id=p.name) for p, d in _ray_docs()])
def test_cluster_matches_its_recipe(path, doc):
    """Ranks, workers, tensor parallelism, CPU-based placement and mounted paths agree with the recipe."""
    recipe = load_recipe(ROOT / _recipe_for(path, doc), check_paths=False)
    spec = _cluster_spec(doc)
    trainer, rollout = _group(spec, "trainer"), _group(spec, "rollout")
    hosts = trainer["numOfHosts"] * trainer["replicas"]
    assert recipe.trainer.device in ("tpu", "xla")
    assert _num_cpus(trainer) == _chips_per_host(trainer), "a trainer host fits one rank (1 CPU, 1 TPU) per chip"
    assert recipe.trainer.num_ranks == hosts * _chips_per_host(trainer), "one trainer rank per slice chip"
    assert recipe.rollout.num_workers == rollout["replicas"] * rollout["numOfHosts"], "one rollout worker per host"
    assert recipe.rollout.num_cpus_per_worker == _num_cpus(rollout), "rollout hosts fit exactly one worker"
    assert recipe.rollout.num_gpus_per_worker == 0
    assert recipe.rollout.engine.tensor_parallel_size == _chips_per_host(rollout), "one engine spans its host"
    # The run places the engines first (each takes a whole rollout host), then the ranks: they must fit the trainer
    # hosts alone, by their strategies.
    plan = plan_placement(recipe, num_cores=1)
    assert plan.rollout_strategy == "SPREAD" and plan.trainer_strategy == "PACK"
    engines = [worker_resources(plan.rollout)] * recipe.rollout.num_workers
    ranks = [rank_resources(recipe.trainer, plan.trainer_cpus)] * recipe.trainer.num_ranks
    assert why_unplaceable(engines, plan.rollout_strategy, _nodes(rollout)) is None
    assert why_unplaceable(ranks, plan.trainer_strategy, _nodes(trainer)) is None

    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_mounts = [m["mountPath"] for m in head["volumeMounts"]]
    assert _is_under(recipe.model.path, head_mounts), "the driver reads the model's config.json and tokenizer"
    assert _is_under(recipe.task.path, head_mounts), "the driver builds the dataset"
    assert _is_under(str(recipe.run.resolved_output_dir), head_mounts), "the driver writes metrics"
    for group in (trainer, rollout):
        assert _is_under(recipe.model.path, _mounts(group)), group["groupName"]
    assert _is_under(recipe.trainer.checkpoint.dir or str(recipe.run.resolved_output_dir), _mounts(trainer))
    for tls in (recipe.weight_sync.tls_cert_path, recipe.weight_sync.tls_key_path, recipe.weight_sync.tls_ca_path):
        assert tls is not None and all(_is_under(tls, _mounts(g)) for g in (trainer, rollout)), tls


# -- every launched recipe exists and validates --------------------------------------------------------------------
def _deploy_texts() -> list[Path]:
    return sorted(p for p in DEPLOY.iterdir() if p.suffix in (".yaml", ".md") or p.name.startswith("Dockerfile."))


def test_every_recipe_launched_from_deploy_exists_and_validates():
    refs = {(path.name, ref) for path in _deploy_texts() for ref in _recipe_refs(path.read_text())}
    assert {ref for _, ref in refs} >= {*HARDWARE_RECIPES, "recipes/grpo_tiny.toml"}, "the guide shows every launch"
    for name, ref in sorted(refs):
        path = ROOT / ref
        assert path.is_file(), f"deploy/{name} launches {ref}, which does not exist"
        assert isinstance(load_recipe(path, check_paths=False), Recipe), f"deploy/{name}: {ref}"


def test_dockerfiles_install_the_right_stacks():
    cpu = (DEPLOY / "Dockerfile.cpu").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", cpu, re.M)
    assert "pip install" in cpu and "-e '.[cpu]'" in cpu
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec triton", cpu)
    tpu = (DEPLOY / "Dockerfile.tpu").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim\b", tpu, re.M)
    assert "pip install -e '.[tpu]'" in tpu and "--no-deps" not in tpu, "the [tpu] extra resolves as one set"
    tpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    assert any(re.fullmatch(r"vllm-torchtpu==\d.*", dep) for dep in tpu_extra), "vLLM's TPU build is pinned"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=1" in tpu
    xla = (DEPLOY / "Dockerfile.xla").read_text()
    assert re.search(r"^FROM python:3\.12-slim\b", xla, re.M), "the Python of the TPU image: one Python per cluster"
    assert "pip install -e '.[xla-tpu]'" in xla and "--no-deps" not in xla and "PJRT_DEVICE=TPU" in xla
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "torch_xla[tpu]" in extras["xla-tpu"] and "rl-align[xla]" in extras["xla-tpu"]
    for name in ("Dockerfile.cpu", "Dockerfile.tpu", "Dockerfile.xla"):
        ignore = (DEPLOY / f"{name}.dockerignore").read_text().split()
        assert ".venv" in ignore and "runs" in ignore, name


# The versions each host's resolution picked (`make install` on Python 3.11, `make tpu-env` on 3.12, `make xla-env` on
# 3.11, `pip install '.[gpu]'` --dry-run on 3.11), which the base ranges and that host's extra must all admit.
STACKS = {
    "cpu": ("3.11", {"torch": "2.13.0", "jax": "0.10.2", "jaxlib": "0.10.2", "transformers": "5.19.0"}),
    "tpu": ("3.12", {"torch": "2.13.0", "jax": "0.11.2", "jaxlib": "0.11.2", "transformers": "5.14.1"}),
    "gpu": ("3.11", {"torch": "2.14.0", "jax": "0.10.2", "transformers": "5.19.0"}),
    "xla": ("3.11", {"torch": "2.9.0", "jax": "0.10.2", "transformers": "5.19.0"}),
    "xla-tpu": ("3.12", {"torch": "2.9.0", "jax": "0.11.2", "transformers": "5.19.0"}),
}


@pytest.mark.parametrize("extra", sorted(STACKS))
def test_the_base_ranges_and_each_hosts_extra_admit_that_hosts_versions(extra):
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python, versions = STACKS[extra]
    assert python + ".0" in SpecifierSet(project["requires-python"])
    for dep in project["dependencies"] + project["optional-dependencies"][extra]:
        req = Requirement(dep)
        if req.name in versions:
            assert req.specifier.contains(versions[req.name], prereleases=True), f"{dep} refuses the {extra} stack"


# -- the hardware recipes --------------------------------------------------------------------------------------------

def _model(recipe: Recipe) -> tuple[str, ModelConfig]:
    name = Path(recipe.model.path).name
    return name, model_config_from_hf_dict(PUBLISHED_CONFIGS[name], source=name, **recipe.model.block_overrides())


@pytest.mark.parametrize("ref", HARDWARE_RECIPES)
def test_hardware_recipe_validates(ref):
    recipe = load_recipe(ROOT / ref, check_paths=False)
    assert recipe.trainer.device in ("cuda", "tpu", "xla") and recipe.model.create_tiny is None
    assert Path(recipe.model.path).is_absolute() and recipe.task.type == "jsonl"
    trains_in = "float32" if recipe.trainer.device == "xla" else "bfloat16"  # what torch_xla's trainer runs
    assert recipe.trainer.mixed_precision.param_dtype == trains_in and recipe.rollout.engine.dtype == "bfloat16"
    assert recipe.rollout.engine.enforce_eager is False
    assert any(t.type == "math" for t in recipe.reward.terms)
    if recipe.trainer.device == "tpu":
        assert recipe.trainer.parallelism.fsdp and recipe.trainer.num_ranks > 1
        assert recipe.run.mode == "async" and recipe.algorithm.importance_sampling.enabled
        assert recipe.rollout.num_workers > 1 and recipe.rollout.num_gpus_per_worker == 0
        assert (recipe.model.attention, recipe.model.output_head) == ("splash", "fused_pallas")
    elif recipe.trainer.device == "xla":
        assert recipe.trainer.num_ranks == 1 and not recipe.trainer.parallelism.fsdp
        assert recipe.run.mode == "async" and recipe.algorithm.importance_sampling.enabled
        assert recipe.rollout.num_workers > 1 and recipe.rollout.num_gpus_per_worker == 0
        assert recipe.model.attention == "sdpa"  # the Pallas kernels are refused on "xla"
    else:
        assert recipe.rollout.num_gpus_per_worker >= 1


@pytest.mark.parametrize("ref", HARDWARE_RECIPES)
def test_hardware_recipe_builds_the_real_architecture_with_registered_blocks(ref):
    recipe = load_recipe(ROOT / ref, check_paths=False)
    name, model = _model(recipe)
    assert abs(model.num_params / PUBLISHED_PARAMS[name] - 1) < 0.05, f"{name}: {model.num_params / 1e9:.2f}B"
    # Kernel names resolve without importing torch; the defaults are the built-in torch blocks.
    blocks = ((ATTENTION_BLOCKS, "attention"), (OUTPUT_HEADS, "output_head"), (MOE_EXPERTS, "moe_experts"))
    for registry, field in blocks:
        name = getattr(model, field)
        assert name == ModelConfig.model_fields[field].default or name in registry, f"{field} = {name!r}"
    if model.moe is not None:
        assert model.moe_experts == "gmm_pallas"
        # Each rank gathers and computes only its share of the experts; tokens reach them by all-to-all.
        assert recipe.trainer.parallelism.expert_parallel_degree > 1
    recipe.trainer.check_model(model)
    assert recipe.rollout.engine.max_model_len <= model.max_seq_len


@pytest.mark.parametrize("ref", HARDWARE_RECIPES)
def test_hardware_recipe_fits_its_chips(ref):
    """Per trainer rank, the training state (fp32 weights, gradients, AdamW moments, FSDP-sharded; a LoRA base frozen)
    plus the blocks FSDP gathers (only a rank's own experts under expert parallelism) plus its unsharded root unit
    (embedding and head, unless the vocabulary is split) plus one micro-batch's activations under the recipe's
    activation checkpointing (``trainer.memory``) fit in 90% of a chip; each engine's bf16 weight shard plus its KV
    cache fits one chip."""
    recipe = load_recipe(ROOT / ref, check_paths=False)
    _, model = _model(recipe)
    model = model.model_copy(update={"lora": recipe.model.lora})
    trainer = recipe.trainer
    hbm = GPU_HBM_GIB if trainer.device == "cuda" else TPU_ACCELERATORS["tpu-v6e-slice"]
    state = train_state_bytes(model, trainer.num_ranks) / 2**30
    activations = activation_bytes(
        model, trainer.micro_batch_tokens, trainer.activation_checkpoint, trainer.mixed_precision.param_dtype
    ) / 2**30
    precision = trainer.mixed_precision
    gathered = gathered_block_bytes(
        model, trainer.parallelism.expert_parallel_degree, precision.param_dtype, precision.reduce_dtype
    ) / 2**30
    root = gathered_root_bytes(
        model, trainer.parallelism.vocab_parallel, precision.param_dtype, precision.reduce_dtype,
        trainer.parallelism.tensor_parallel_degree,
    ) / 2**30
    assert state + gathered + root + activations <= 0.9 * hbm, (
        f"{state:.1f} GiB of training state + {gathered:.1f} GiB of gathered blocks + {root:.1f} GiB of the root "
        f"unit + {activations:.1f} GiB of activations per rank on {hbm} GiB chips"
    )
    engine = 2 * model.num_params / recipe.rollout.engine.tensor_parallel_size / 2**30
    assert engine + recipe.rollout.engine.kv_cache_gib <= 0.9 * hbm, f"{engine:.1f} GiB weights + KV cache per chip"
