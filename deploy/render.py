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
DRAIN_FLUSH_S = 5  # loraserve.server.app.DRAIN_FLUSH_S: after the deadline, errors are sent
GRACE_MARGIN_S = 10
UID = 10001  # the images' user (deploy/docker/Dockerfile.*)


def load_values(*overrides: str | Path) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in overrides:
        values = merge(values, yaml.safe_load(Path(path).read_text()) or {})
    return values


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


def env(v: dict) -> list[dict]:
    out = [{"name": "LORASERVE_PORT", "value": str(v["port"])},
           {"name": "LORASERVE_CONFIG", "value": f"{CONFIG_DIR}/serve.toml"}]
    if v["model"]["path"]:
        out.append({"name": "LORASERVE_MODEL", "value": v["model"]["path"]})
    if v["catalog"]["persistence"]["enabled"]:
        out.append({"name": "LORASERVE_CATALOG", "value": v["catalog"]["mountPath"]})
    if v["keys"]["secretName"]:
        out.append({"name": "LORASERVE_KEYS", "value": f"{KEYS_DIR}/keys.toml"})
    mk = v["keys"]["metricsKey"]
    if mk["secretName"]:
        out.append({"name": "LORASERVE_METRICS_KEY", "valueFrom": {
            "secretKeyRef": {"name": mk["secretName"], "key": mk["key"]}}})
    if v["gpu"]["enabled"]:
        out.append({"name": "LORASERVE_DEVICE", "value": "cuda"})
    return out


def volumes(v: dict, name: str) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the server container's mounts); the catalog's claim is the
    StatefulSet's volumeClaimTemplate."""
    vols = [{"name": "config", "configMap": {"name": f"{name}-config"}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if v["keys"]["secretName"]:
        vols.append({"name": "keys", "secret": {"secretName": v["keys"]["secretName"]}})
        mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
    if v["model"]["volume"]:
        vols.append({"name": "model", **v["model"]["volume"]})
        mounts.append({"name": "model", "mountPath": v["model"]["mountPath"], "readOnly": True})
    if v["catalog"]["persistence"]["enabled"]:
        mounts.append({"name": "catalog", "mountPath": v["catalog"]["mountPath"]})
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


def container(v: dict, mounts: list[dict]) -> dict:
    p = v["probes"]
    return {
        "name": "loraserve", "image": f"{v['image']['repository']}:{v['image']['tag']}",
        "imagePullPolicy": v["image"]["pullPolicy"],
        "ports": [{"name": "http", "containerPort": v["port"]}],
        "env": env(v), "volumeMounts": mounts, "resources": resources(v),
        "startupProbe": probe("/health", 5, p["startupFailureThreshold"]),
        "livenessProbe": probe("/health", p["periodSeconds"]),
        "readinessProbe": probe("/ready", p["periodSeconds"]),
        "lifecycle": {"preStop": pre_stop(v)},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
                            "capabilities": {"drop": ["ALL"]}},
    }


def pod_template(v: dict, name: str) -> dict:
    vols, mounts = volumes(v, name)
    spec = {"securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                                "fsGroup": UID},
            "terminationGracePeriodSeconds": grace_seconds(v),
            "containers": [container(v, mounts)], "volumes": vols}
    if v["catalog"]["persistence"]["enabled"]:
        init = {"name": "catalog-init", "image": f"{v['image']['repository']}:{v['image']['tag']}",
                "command": ["/opt/loraserve/bin/loraserve", "catalog", "init",
                            v["catalog"]["mountPath"]],
                "volumeMounts": [{"name": "catalog", "mountPath": v["catalog"]["mountPath"]}],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}}}
        spec["initContainers"] = [init]
    return {"metadata": {"labels": labels(name)}, "spec": spec}


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
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532}}}
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
    out = [config_map(v, n, ns), service(v, n, ns), workload(v, n, ns)]
    if v["podDisruptionBudget"]["enabled"]:
        out.append(pdb(v, n, ns))
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
    sys.stdout.write(dump(render(load_values(*args.values), args.name, args.namespace)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
