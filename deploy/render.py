"""Plain Kubernetes manifests from the chart's values, for clusters without Helm and for the
tests (Helm itself is not installable on the machines that build loraserve).

    python deploy/render.py [-f more-values.yaml ...] [--name loraserve] [--namespace default]

reads deploy/helm/loraserve/values.yaml, deep-merges each -f file over it and prints the
manifests (YAML documents). deploy/helm/loraserve/templates/ renders the same objects under
Helm from the same values; tests/test_deploy_chart.py checks that every value the templates
read exists, validates these manifests against the Kubernetes schemas (kubernetes-validate)
and the CRDs' (deploy/schemas/), and that deploy/manifests/loraserve.yaml is this script's
output for the default values.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parent / "helm" / "loraserve"
CONFIG_DIR = "/etc/loraserve/config"
KEYS_DIR = "/etc/loraserve/keys"
# where the server writes (the root file system is read-only): the images' $XDG_CACHE_HOME and
# $LORASERVE_CACHE folder, /tmp, the demo catalog ($LORASERVE_DEMO_DIR); deploy/docker/Dockerfile.*
CACHE_DIR = "/var/lib/loraserve/cache"
DEMO_DIR = "/var/lib/loraserve/demo"
FETCH = ["/opt/loraserve/bin/python", "/opt/loraserve/docker/fetch-model.py"]
DRAIN_FLUSH_S = 5  # loraserve.server.app.DRAIN_FLUSH_S: after the deadline, errors are sent
GRACE_MARGIN_S = 10
UID = 10001  # the images' user (deploy/docker/Dockerfile.*)


def load_values(*overrides: str | Path) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in overrides:
        values = merge(values, yaml.safe_load(Path(path).read_text()) or {})
    return values


class ValuesError(ValueError):
    """Values the chart refuses to render (helm template fails with the same message)."""


def check(v: dict) -> None:
    """What the chart refuses: values.schema.json's checks (when jsonschema is installed), and
    the rules templates/_helpers.tpl's loraserve.validate holds (the same messages)."""
    try:
        import jsonschema
    except ImportError:  # a cluster's machine without it: Helm checks the schema there
        jsonschema = None
    if jsonschema is not None:
        schema = json.loads((CHART / "values.schema.json").read_text())
        try:
            jsonschema.validate(v, schema)
        except jsonschema.ValidationError as e:
            where = ".".join(map(str, e.absolute_path)) or "(the values)"
            raise ValuesError(f"values.schema.json: {where}: {e.message}") from None
    keys = v["keys"]
    if not v["auth"]["disabled"] and not keys["secretName"] and not keys["apiKey"]["secretName"]:
        raise ValuesError(NO_KEYS)
    fetch = v["modelFetch"]
    if fetch["enabled"]:
        if v["model"]["volume"]:
            raise ValuesError("modelFetch.enabled fetches into an emptyDir at model.mountPath: "
                              "leave model.volume empty")
        if fetch["source"] == "s3" and not fetch["s3"]["uri"].startswith("s3://"):
            raise ValuesError("modelFetch.source s3 needs modelFetch.s3.uri (s3://bucket/prefix)")
        if fetch["source"] == "pypi" and not (fetch["pypi"]["requirement"] and fetch["pypi"]["member"]):
            raise ValuesError("modelFetch.source pypi needs modelFetch.pypi.requirement and .member")


NO_KEYS = ("API keys are required: set keys.secretName (a Secret with keys.toml) or "
           "keys.apiKey.secretName, or auth.disabled=true to serve every route (admin and "
           "training included) to anyone who reaches the Service")


def model_path(v: dict) -> str:
    """The base model the server loads: model.path, else what modelFetch puts in mountPath."""
    fetch = v["modelFetch"]
    if v["model"]["path"] or not fetch["enabled"]:
        return v["model"]["path"]
    if fetch["source"] == "s3":
        return v["model"]["mountPath"]
    return f"{v['model']['mountPath']}/{fetch['pypi']['member'].rsplit('/', 1)[-1]}"


def service_account_name(v: dict, name: str) -> str:
    sa = v["serviceAccount"]
    return sa["name"] or (name if sa["create"] else "")


def merge(base: dict, over: dict) -> dict:
    """`over` deep-merged onto a copy of `base` (maps merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def labels(name: str) -> dict:
    return {"app.kubernetes.io/name": "loraserve", "app.kubernetes.io/instance": name}


def meta(name: str, ns: str, instance: str | None = None) -> dict:
    """metadata of object `name` of the release `instance` (default: `name`)."""
    return {"name": name, "namespace": ns, "labels": labels(instance or name)}


def grace_seconds(v: dict) -> int:
    """terminationGracePeriodSeconds: the preStop wait, the drain, its flush, a margin."""
    return int(v["drain"]["preStopDelaySeconds"]) + int(v["serve"]["shutdown-timeout"]) \
        + DRAIN_FLUSH_S + GRACE_MARGIN_S


def serve_toml(v: dict) -> str:
    """serve.toml: one `flag = value` line per serve setting (JSON scalars and lists are TOML)."""
    return "".join(f"{key} = {json.dumps(v['serve'][key])}\n" for key in sorted(v["serve"]))


def config_map(v: dict, name: str, ns: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{name}-config", ns, name),
            "data": {"serve.toml": serve_toml(v)}}


def service(v: dict, name: str, ns: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, ns),
            "spec": {"selector": labels(name),
                     "ports": [{"name": "http", "port": v["port"], "targetPort": "http"}]}}


def service_account(v: dict, name: str, ns: str) -> dict:
    sa = v["serviceAccount"]
    m = meta(service_account_name(v, name), ns, name)
    if sa["annotations"]:
        m["annotations"] = dict(sa["annotations"])
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": m,
            "automountServiceAccountToken": sa["automountServiceAccountToken"]}


def network_policy(v: dict, name: str, ns: str) -> dict:
    """Ingress to the HTTP port from ingressFrom (and the endpoint picker); egress DNS and
    networkPolicy.egress. An empty peer list admits nothing (never everything)."""
    np = v["networkPolicy"]
    peers = copy.deepcopy(np["ingressFrom"])
    if v["inferencePool"]["enabled"]:
        peers.append({"podSelector": {"matchLabels": epp_labels(name)}})
    ingress = [{"from": peers, "ports": [{"port": v["port"], "protocol": "TCP"}]}] if peers else []
    dns = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(name, ns),
            "spec": {"podSelector": {"matchLabels": labels(name)},
                     "policyTypes": ["Ingress", "Egress"], "ingress": ingress,
                     "egress": [dns, *copy.deepcopy(np["egress"])]}}


def env(v: dict) -> list[dict]:
    out = [{"name": "LORASERVE_PORT", "value": str(v["port"])},
           {"name": "LORASERVE_CONFIG", "value": f"{CONFIG_DIR}/serve.toml"}]
    if model_path(v):
        out.append({"name": "LORASERVE_MODEL", "value": model_path(v)})
    if v["catalog"]["persistence"]["enabled"]:
        out.append({"name": "LORASERVE_CATALOG", "value": v["catalog"]["mountPath"]})
    if v["keys"]["secretName"]:
        out.append({"name": "LORASERVE_KEYS", "value": f"{KEYS_DIR}/keys.toml"})
    ak = v["keys"]["apiKey"]
    if ak["secretName"]:
        out.append({"name": "LORASERVE_API_KEY", "valueFrom": {
            "secretKeyRef": {"name": ak["secretName"], "key": ak["key"]}}})
    mk = v["keys"]["metricsKey"]
    if mk["secretName"]:
        out.append({"name": "LORASERVE_METRICS_KEY", "valueFrom": {
            "secretKeyRef": {"name": mk["secretName"], "key": mk["key"]}}})
    if v["gpu"]["enabled"]:
        out.append({"name": "LORASERVE_DEVICE", "value": "cuda"})
    return out + copy.deepcopy(v["env"])


def volumes(v: dict, name: str) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the server container's mounts); the catalog's claim is the
    StatefulSet's volumeClaimTemplate."""
    vols = [{"name": "config", "configMap": {"name": f"{name}-config"}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if v["keys"]["secretName"]:
        vols.append({"name": "keys", "secret": {"secretName": v["keys"]["secretName"]}})
        mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
    if v["modelFetch"]["enabled"]:
        vols.append({"name": "model", "emptyDir": {"sizeLimit": v["modelFetch"]["sizeLimit"]}})
        mounts.append({"name": "model", "mountPath": v["model"]["mountPath"], "readOnly": True})
    elif v["model"]["volume"]:
        vols.append({"name": "model", **v["model"]["volume"]})
        mounts.append({"name": "model", "mountPath": v["model"]["mountPath"], "readOnly": True})
    if v["catalog"]["persistence"]["enabled"]:
        mounts.append({"name": "catalog", "mountPath": v["catalog"]["mountPath"]})
    w = v["writable"]
    for vol, path in (("cache", CACHE_DIR), ("tmp", "/tmp"), ("demo", DEMO_DIR)):
        vols.append({"name": vol, "emptyDir": {"sizeLimit": w[vol]["sizeLimit"]}})
        mounts.append({"name": vol, "mountPath": path})
    if v["shm"]["enabled"]:
        vols.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": v["shm"]["sizeLimit"]}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return vols, mounts


def resources(v: dict) -> dict:
    out = copy.deepcopy(v["resources"])
    if v["gpu"]["enabled"]:
        for part in ("requests", "limits"):
            out.setdefault(part, {})[v["gpu"]["resource"]] = v["gpu"]["count"]
    return out


def probe(path: str, period: int, failures: int = 3) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def pre_stop(v: dict) -> dict:
    """Wait for endpoints to drop the pod, start the drain (SIGTERM to the server, PID 1: the
    image's start script execs it) and wait until it has exited, so the kubelet's own SIGTERM
    (which uvicorn would take as a second one: stop at once) never comes during the drain."""
    delay = int(v["drain"]["preStopDelaySeconds"])
    script = f"sleep {delay}; kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done"
    return {"exec": {"command": ["/bin/sh", "-c", script]}}


# every container of the pod: no privilege, no capability, nothing written outside its volumes
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}


def container(v: dict, mounts: list[dict]) -> dict:
    p = v["probes"]
    box = {
        "name": "loraserve", "image": f"{v['image']['repository']}:{v['image']['tag']}",
        "imagePullPolicy": v["image"]["pullPolicy"],
        "ports": [{"name": "http", "containerPort": v["port"]}],
        "env": env(v), "volumeMounts": mounts, "resources": resources(v),
        "startupProbe": probe("/health", 5, p["startupFailureThreshold"]),
        "livenessProbe": probe("/health", p["periodSeconds"]),
        "readinessProbe": probe("/ready", p["periodSeconds"]),
        "lifecycle": {"preStop": pre_stop(v)},
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    if v["envFrom"]:
        box["envFrom"] = copy.deepcopy(v["envFrom"])
    return box


def model_fetch(v: dict) -> dict:
    """The init container that fetches the base model into the model emptyDir."""
    f, dest = v["modelFetch"], v["model"]["mountPath"]
    env_vars = []
    if f["source"] == "s3":
        command = [*FETCH, "s3", f["s3"]["uri"], dest]
        if f["s3"]["endpointUrl"]:
            env_vars.append({"name": "AWS_ENDPOINT_URL", "value": f["s3"]["endpointUrl"]})
        if f["s3"]["region"]:
            env_vars.append({"name": "AWS_REGION", "value": f["s3"]["region"]})
    else:
        command = [*FETCH, "pypi", f["pypi"]["requirement"], f["pypi"]["member"], dest]
        if f["pypi"]["indexUrl"]:
            env_vars.append({"name": "PIP_INDEX_URL", "value": f["pypi"]["indexUrl"]})
    box = {"name": "model-fetch", "image": f"{v['image']['repository']}:{v['image']['tag']}",
           "imagePullPolicy": v["image"]["pullPolicy"], "command": command,
           "volumeMounts": [{"name": "model", "mountPath": dest}, {"name": "tmp", "mountPath": "/tmp"}],
           "resources": copy.deepcopy(f["resources"]),
           "securityContext": copy.deepcopy(CONTAINER_SECURITY)}
    if env_vars:
        box["env"] = env_vars
    if f["source"] == "s3" and f["s3"]["credentialsSecret"]:
        box["envFrom"] = [{"secretRef": {"name": f["s3"]["credentialsSecret"]}}]
    return box


def pod_template(v: dict, name: str) -> dict:
    vols, mounts = volumes(v, name)
    spec = {"securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                                "fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}},
            "automountServiceAccountToken": v["serviceAccount"]["automountServiceAccountToken"],
            "terminationGracePeriodSeconds": grace_seconds(v),
            "containers": [container(v, mounts)], "volumes": vols}
    if service_account_name(v, name):
        spec["serviceAccountName"] = service_account_name(v, name)
    for key in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity",
                "topologySpreadConstraints", "priorityClassName"):
        if v[key]:
            spec[key] = copy.deepcopy(v[key])
    inits = []
    if v["modelFetch"]["enabled"]:
        inits.append(model_fetch(v))
    if v["catalog"]["persistence"]["enabled"]:
        inits.append({"name": "catalog-init", "image": f"{v['image']['repository']}:{v['image']['tag']}",
                      "command": ["/opt/loraserve/bin/loraserve", "catalog", "init",
                                  v["catalog"]["mountPath"]],
                      "volumeMounts": [{"name": "catalog", "mountPath": v["catalog"]["mountPath"]},
                                       {"name": "tmp", "mountPath": "/tmp"}],
                      "securityContext": copy.deepcopy(CONTAINER_SECURITY)})
    if inits:
        spec["initContainers"] = inits
    template_meta = {"labels": labels(name)}
    if v["podAnnotations"]:
        template_meta["annotations"] = dict(v["podAnnotations"])
    return {"metadata": template_meta, "spec": spec}


def workload(v: dict, name: str, ns: str) -> dict:
    """A Deployment, or a StatefulSet when the catalog is a persistent volume per replica."""
    spec = {"selector": {"matchLabels": labels(name)}, "template": pod_template(v, name)}
    if not v["autoscaling"]["enabled"]:
        spec = {"replicas": v["replicas"], **spec}
    persistence = v["catalog"]["persistence"]
    if not persistence["enabled"]:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(name, ns),
                "spec": spec}
    claim = {"accessModes": ["ReadWriteOnce"],
             "resources": {"requests": {"storage": persistence["size"]}}}
    if persistence["storageClassName"]:
        claim["storageClassName"] = persistence["storageClassName"]
    spec.update(serviceName=name, volumeClaimTemplates=[
        {"metadata": {"name": "catalog"}, "spec": claim}])
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(name, ns),
            "spec": spec}


def pdb(v: dict, name: str, ns: str) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(name, ns),
            "spec": {"maxUnavailable": v["podDisruptionBudget"]["maxUnavailable"],
                     "selector": {"matchLabels": labels(name)}}}


def service_monitor(v: dict, name: str, ns: str) -> dict:
    sm = v["serviceMonitor"]
    endpoint = {"port": "http", "path": "/metrics", "interval": sm["interval"]}
    mk = v["keys"]["metricsKey"]
    if mk["secretName"]:
        endpoint["authorization"] = {"type": "Bearer", "credentials": {
            "name": mk["secretName"], "key": mk["key"]}}
    m = meta(name, ns)
    m["labels"] = {**m["labels"], **sm["labels"]}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": m,
            "spec": {"selector": {"matchLabels": labels(name)}, "endpoints": [endpoint]}}


def hpa(v: dict, name: str, ns: str) -> dict:
    a = v["autoscaling"]
    kind = "StatefulSet" if v["catalog"]["persistence"]["enabled"] else "Deployment"
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": meta(name, ns),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": kind, "name": name},
                     "minReplicas": a["minReplicas"], "maxReplicas": a["maxReplicas"],
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": a["metric"]},
                         "target": {"type": "AverageValue",
                                    "averageValue": str(a["targetAverageValue"])}}}]}}


# -- the InferencePool example and its endpoint picker -------------------------------------------

def epp_labels(name: str) -> dict:
    return {"app.kubernetes.io/name": "loraserve-epp", "app.kubernetes.io/instance": name}


def inference_pool(v: dict, name: str, ns: str) -> dict:
    epp = v["inferencePool"]["endpointPicker"]
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": meta(name, ns),
            "spec": {"selector": {"matchLabels": labels(name)},
                     "targetPorts": [{"number": v["port"]}],
                     "endpointPickerRef": {"name": f"{name}-epp", "kind": "Service",
                                           "port": {"number": epp["grpcPort"]},
                                           "failureMode": epp["failureMode"]}}}


def epp_args(v: dict, name: str, ns: str) -> list[str]:
    """The picker's flags: the pool, its ports, and which of loraserve's metrics are the queue
    depth, the running count, KV-cache use and the LoRA adapters each pod serves."""
    epp = v["inferencePool"]["endpointPicker"]
    args = ["--pool-name", name, "--pool-namespace", ns,
            "--pool-group", "inference.networking.k8s.io",
            "--grpc-port", str(epp["grpcPort"]), "--grpc-health-port", str(epp["grpcHealthPort"]),
            "--metrics-port", str(epp["metricsPort"]), "--model-server-metrics-path", "/metrics"]
    for flag in sorted(epp["metrics"]):
        args += [f"--{flag}", epp["metrics"][flag]]
    return args


def epp_deployment(v: dict, name: str, ns: str) -> dict:
    epp = v["inferencePool"]["endpointPicker"]
    grpc = {"grpc": {"port": epp["grpcHealthPort"], "service": "inference-extension"},
            "periodSeconds": 10}
    box = {"name": "epp", "image": epp["image"], "args": epp_args(v, name, ns),
           "ports": [{"name": "grpc", "containerPort": epp["grpcPort"]},
                     {"name": "grpc-health", "containerPort": epp["grpcHealthPort"]},
                     {"name": "metrics", "containerPort": epp["metricsPort"]}],
           "livenessProbe": grpc, "readinessProbe": grpc,
           "securityContext": {"allowPrivilegeEscalation": False,
                               "capabilities": {"drop": ["ALL"]}}}
    pod = {"metadata": {"labels": epp_labels(name)},
           "spec": {"serviceAccountName": f"{name}-epp", "containers": [box],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                         "seccompProfile": {"type": "RuntimeDefault"}}}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(f"{name}-epp", ns, name),
            "spec": {"replicas": epp["replicas"], "selector": {"matchLabels": epp_labels(name)},
                     "template": pod}}


def epp_service(v: dict, name: str, ns: str) -> dict:
    epp = v["inferencePool"]["endpointPicker"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(f"{name}-epp", ns, name),
            "spec": {"selector": epp_labels(name), "ports": [
                {"name": "grpc-ext-proc", "port": epp["grpcPort"], "appProtocol": "http2"},
                {"name": "metrics", "port": epp["metricsPort"]}]}}


def epp_rbac(v: dict, name: str, ns: str) -> list[dict]:
    """What the picker reads: the pool, the pods it selects, the objectives of its models."""
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
              "verbs": ["get", "list", "watch"]},
             {"apiGroups": ["inference.networking.x-k8s.io"],
              "resources": ["inferenceobjectives", "inferencemodelrewrites"],
              "verbs": ["get", "list", "watch"]}]
    who = f"{name}-epp"
    return [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(who, ns, name)},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": meta(who, ns, name), "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": meta(who, ns, name),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": who},
             "subjects": [{"kind": "ServiceAccount", "name": who, "namespace": ns}]}]


def render(values: dict, name: str = "loraserve", namespace: str = "default") -> list[dict]:
    """Every manifest the values ask for, in the order the chart's templates write them."""
    v, n, ns = values, name, namespace
    check(v)
    out = [config_map(v, n, ns), service(v, n, ns)]
    if v["serviceAccount"]["create"]:
        out.append(service_account(v, n, ns))
    out.append(workload(v, n, ns))
    if v["podDisruptionBudget"]["enabled"]:
        out.append(pdb(v, n, ns))
    if v["networkPolicy"]["enabled"]:
        out.append(network_policy(v, n, ns))
    if v["serviceMonitor"]["enabled"]:
        out.append(service_monitor(v, n, ns))
    if v["autoscaling"]["enabled"]:
        out.append(hpa(v, n, ns))
    if v["inferencePool"]["enabled"]:
        out += [inference_pool(v, n, ns), *epp_rbac(v, n, ns), epp_service(v, n, ns),
                epp_deployment(v, n, ns)]
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serve.toml) as literal blocks, as the chart writes them."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def dump(manifests: list[dict]) -> str:
    return "".join("---\n" + yaml.dump(m, Dumper=_Dumper, sort_keys=False, width=100)
                   for m in manifests)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python deploy/render.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                   help="values merged over the chart's (repeatable, later wins)")
    p.add_argument("--name", default="loraserve", help="the release name (default: loraserve)")
    p.add_argument("--namespace", default="default")
    args = p.parse_args(argv)
    try:
        manifests = render(load_values(*args.values), args.name, args.namespace)
    except ValuesError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(dump(manifests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
