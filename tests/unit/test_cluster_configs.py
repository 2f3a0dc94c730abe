"""Cluster configs under cluster/: they parse, validate, keep the dashboard private, use token auth,
and name entry points and flags that exist. Pure: no Ray cluster is started."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
LAUNCHER_CONFIGS = [CLUSTER / "aws.yaml", CLUSTER / "gcp.yaml"]
KUBERAY = sorted((CLUSTER / "kuberay").glob("*.yaml"))
ALL_YAML = sorted(CLUSTER.rglob("*.yaml"))
TOKEN_SECRET = "raypar-ray-token"


def load(path: Path) -> list:
    return list(yaml.safe_load_all(path.read_text()))


def strings(node) -> list[str]:
    """Every string value in a parsed YAML document."""
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings(value)]
    if isinstance(node, list):
        return [s for item in node for s in strings(item)]
    return [node] if isinstance(node, str) else []


def test_the_configs_exist():
    names = {p.relative_to(CLUSTER).as_posix() for p in ALL_YAML}
    assert {
        "aws.yaml",
        "gcp.yaml",
        "kuberay/raycluster.yaml",
        "kuberay/rayjob-ddp.yaml",
        "kuberay/rayjob-pipeline.yaml",
    } <= names


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.relative_to(CLUSTER).as_posix())
def test_every_yaml_parses(path):
    assert all(isinstance(doc, dict) for doc in load(path))


# ---- cluster launcher (`ray up`) --------------------------------------------------------------


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_config_matches_rays_schema(path):
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    (config,) = load(path)
    jsonschema.validate(config, schema)
    assert config["available_node_types"][config["head_node_type"]]["resources"].get("GPU", 0) == 0
    gpu_types = [t for t in config["available_node_types"].values() if t["resources"].get("GPU")]
    assert gpu_types and all(t["min_workers"] == 0 for t in gpu_types)  # GPUs only while jobs need them


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_config_keeps_the_dashboard_on_loopback_with_token_auth(path):
    (config,) = load(path)
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [cmd for cmd in config[key] if "ray start" in cmd]
        assert starts and all("RAY_AUTH_MODE=token" in cmd and "RAY_AUTH_TOKEN_PATH=" in cmd for cmd in starts)
    token_path = re.search(r"RAY_AUTH_TOKEN_PATH=\$HOME/(\S+)", head).group(1)
    assert f"~/{token_path}" in config["file_mounts"]  # the token reaches every node
    assert "security_group" not in config["provider"]  # no extra inbound rule (8265 stays closed)
    setup = " ".join(config["setup_commands"])
    assert "ray[default,train]==2.60.0" in setup and "torch" in setup and "pyarrow" in setup


# ---- KubeRay ----------------------------------------------------------------------------------


def ray_cluster_specs(doc: dict) -> list[dict]:
    return [doc["spec"]] if doc["kind"] == "RayCluster" else [doc["spec"]["rayClusterSpec"]]


def ray_containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for group in groups for c in group["template"]["spec"]["containers"]]


def has_token_env(env: list[dict]) -> bool:
    by_name = {item["name"]: item for item in env}
    secret = by_name.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
    return by_name.get("RAY_AUTH_MODE", {}).get("value") == "token" and secret.get("name") == TOKEN_SECRET


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_manifest_has_the_fields_the_crds_require(path):
    for doc in load(path):
        assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
        assert doc["metadata"]["name"]
        if doc["kind"] == "RayJob":
            spec = doc["spec"]
            assert spec["entrypoint"].startswith("python -m ray_jobs.")
            assert spec["activeDeadlineSeconds"] > 0 and spec["shutdownAfterJobFinishes"] is True
        for spec in ray_cluster_specs(doc):
            assert spec["rayVersion"] == "2.60.0"
            head = spec["headGroupSpec"]
            assert isinstance(head["rayStartParams"], dict) and head["template"]["spec"]["containers"]
            assert spec["workerGroupSpecs"]
            for group in spec["workerGroupSpecs"]:
                assert group["groupName"] and isinstance(group["rayStartParams"], dict)
                assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
                (container,) = group["template"]["spec"]["containers"]
                assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_every_ray_process_gets_the_token_from_the_secret(path):
    for doc in load(path):
        for spec in ray_cluster_specs(doc):
            assert all(has_token_env(c.get("env", [])) for c in ray_containers(spec))
            if spec.get("enableInTreeAutoscaling"):
                assert has_token_env(spec["autoscalerOptions"]["env"])
        if doc["kind"] == "RayJob":
            (submitter,) = doc["spec"]["submitterPodTemplate"]["spec"]["containers"]
            assert has_token_env(submitter["env"])


# ---- every config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    sorted(p for p in CLUSTER.rglob("*") if p.is_file() and "__pycache__" not in p.parts),
    ids=lambda p: p.relative_to(CLUSTER).as_posix(),
)
def test_nothing_listens_on_all_interfaces(path):
    assert "0.0.0.0" not in path.read_text(errors="replace")


# ---- entry points named in configs and docs ------------------------------------------------


def commands() -> list[tuple[str, str, str]]:
    """(source file, module, flags text) for every `python -m ray_jobs.X ...` in cluster/ configs and README."""
    texts = [(p, s) for p in ALL_YAML for doc in load(p) for s in strings(doc)]
    readme = CLUSTER / "README.md"
    if readme.exists():
        texts.append((readme, readme.read_text().replace("\\\n", " ")))
    found = []
    for path, text in texts:
        for match in re.finditer(r"python -m ray_jobs\.(\w+)([^\n;|&`]*)", text):
            found.append((path.relative_to(REPO).as_posix(), match.group(1), match.group(2)))
    return found


@functools.lru_cache(maxsize=None)
def help_text(module: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", f"ray_jobs.{module}", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_configs_name_entry_points():
    assert {module for _, module, _ in commands()} >= {"ddp", "pipeline"}


@pytest.mark.parametrize(("source", "module", "flags"), commands(), ids=lambda v: str(v)[:60])
def test_entry_point_and_flags_exist(source, module, flags):
    entry = REPO / "ray_jobs" / module
    assert entry.with_suffix(".py").exists() or (entry / "__main__.py").exists(), f"{source}: no ray_jobs.{module}"
    accepted = set(re.findall(r"--[a-z][a-z0-9-]*", help_text(module)))
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", flags))
    assert used <= accepted, f"{source}: python -m ray_jobs.{module} has no {sorted(used - accepted)}"
