"""The Kubernetes manifests in deploy/kubernetes, checked offline: each object against the Kubernetes API
schema (kubernetes-validate, strict: unknown fields are errors), and against each other and streamrl's
own config rules (the run's config builds, the learner's listeners pass the loopback/CURVE check, the
ports and names the pods use are the ones the Services and the config declare)."""

from __future__ import annotations

import copy
import pathlib
import subprocess
import tomllib

import kubernetes_validate
import pytest
import yaml

from streamrl.engine import auth
from streamrl.engine.config import build

FOLDER = pathlib.Path(__file__).parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.33"  # a release clusters run today; the schemas ship with the package (no network)


def _objects() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(FOLDER.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


OBJECTS = _objects()


@pytest.mark.parametrize("key", sorted(OBJECTS), ids=lambda k: f"{k[0]}/{k[1]}")
def test_each_object_is_valid_against_the_kubernetes_schema(key):
    kubernetes_validate.validate(OBJECTS[key], K8S_VERSION, strict=True)


def test_the_validator_refuses_a_broken_object():
    broken = copy.deepcopy(OBJECTS[("Deployment", "streamrl-rollout")])
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    misspelt = copy.deepcopy(OBJECTS[("StatefulSet", "streamrl-learner")])
    misspelt["spec"]["template"]["spec"]["containers"][0]["commmand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, K8S_VERSION, strict=True)


def _container(kind: str, name: str) -> dict:
    return OBJECTS[(kind, name)]["spec"]["template"]["spec"]["containers"][0]


def _argv(script: str, env: dict[str, str]) -> list[str]:
    """The command a pod's `bash -c` script runs, expanded by bash itself with the pod's environment."""
    assert script.startswith("exec python ")
    echo = script.replace("exec python ", "exec printf '%s\\n' python ", 1)
    done = subprocess.run(["bash", "-c", echo], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _sets(argv: list[str]) -> list[str]:
    return [value for flag, value in zip(argv, argv[1:]) if flag == "--set"]


def test_the_run_config_and_the_learners_listeners_pass_streamrls_own_checks():
    run_toml = OBJECTS[("ConfigMap", "streamrl-config")]["data"]["run.toml"]
    learner = _container("StatefulSet", "streamrl-learner")["args"][0]
    env = {"NNODES": "2", "GPUS_PER_NODE": "8", "POD_IP": "10.4.0.17", "REDIS_PASSWORD": "pw",
           "HOSTNAME": "streamrl-learner-1"}  # fmt: skip
    argv = _argv(learner, env)
    assert "--node-rank=1" in argv and "--nnodes=2" in argv  # pod 1 of 2: the second torchrun node
    sets = _sets(argv)
    cfg = build(tomllib.loads(run_toml), sets)
    assert cfg.learner.ranks == 16
    assert cfg.transport.host == cfg.weights.store_host == "10.4.0.17" and cfg.transport.curve
    assert cfg.ledger.url.startswith("rediss://:pw@streamrl-redis:6379/")
    auth.check_listeners(cfg)  # beyond loopback, allowed only because CURVE is on and the ledger is TLS
    no_curve = build(tomllib.loads(run_toml), [*sets, "transport.curve=false"])
    with pytest.raises(auth.AuthError, match="transport.host = '10.4.0.17'"):
        auth.check_listeners(no_curve)


def test_names_and_ports_agree_between_pods_services_and_config():
    cfg = tomllib.loads(OBJECTS[("ConfigMap", "streamrl-config")]["data"]["run.toml"])["transport"]
    service = {p["name"]: p["port"] for p in OBJECTS[("Service", "streamrl-learner")]["spec"]["ports"]}
    assert (service["control"], service["trajectories"]) == (cfg["control_port"], cfg["trajectory_port"])
    learner = _container("StatefulSet", "streamrl-learner")["args"][0]
    assert "torch.distributed.run --nnodes=" in learner and '--node-rank="${HOSTNAME##*-}"' in learner
    assert f"--master-port={service['torchrun']}" in learner and "streamrl-learner-0.streamrl-learner" in learner
    rollout = _container("Deployment", "streamrl-rollout")["args"][0]
    assert f"--learner tcp://streamrl-learner-0.streamrl-learner:{cfg['control_port']}" in rollout
    redis_port = OBJECTS[("Service", "streamrl-redis")]["spec"]["ports"][0]["port"]
    assert f"@streamrl-redis:{redis_port}/" in learner
    assert OBJECTS[("Deployment", "streamrl-rollout")]["kind"] == "Deployment"  # what `kubectl scale` takes


def test_credentials_come_from_secrets_never_from_the_manifests():
    text = "\n".join(p.read_text() for p in FOLDER.glob("*.yaml"))
    assert "kind: Secret" not in text and "secret-key" not in text
    for kind, name in (("StatefulSet", "streamrl-learner"), ("Deployment", "streamrl-rollout")):
        volumes = {v["name"]: v for v in OBJECTS[(kind, name)]["spec"]["template"]["spec"]["volumes"]}
        assert volumes["keys"]["secret"]["defaultMode"] == 0o400
