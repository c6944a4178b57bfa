"""Render a job file as Kubernetes documents: RBAC, the job file as a ConfigMap, the TFJob.

``aimaster manifest JOB.yaml [--plan PLAN.json]`` prints them; ``tfjob_crd.validate`` checks
them. Layout (pod <-> member mapping in ``tfjob_crd.naming``):

- **Chief** (1 pod): container ``tensorflow`` runs ``worker.command`` as worker-0 (idle for a
  PS-only job); container ``aimaster`` runs ``aimaster run --scaler kubernetes``, which
  patches the PS / Worker replica counts and watches the pods. Only this pod mounts the
  ServiceAccount token.
- **PS** (``ps.replicas`` pods): ``python -m deeprec_ext.ps`` bound to the pod IP.
- **Worker** (``worker.replicas - 1`` pods): ``worker.command`` as worker-1, worker-2, ...
"""
from __future__ import annotations

import copy
import json
import math
import re

import yaml

from aimaster.config import ConfigError, JobConfig
from aimaster.evaluation import eval_env_spec
from tfjob_crd import naming

JOB_CONFIG_DIR = "/etc/deeprec/job"
TOKEN_DIR = "/etc/deeprec/token"
TLS_DIR = "/etc/deeprec/tls"
STATE_DIR = "/var/lib/deeprec"
ENTRYPOINT = ["python", "-m", "tfjob_crd.entrypoint", "--"]
# the sidecar's own needs: routing tables, shard queue, RPC threads (not the model)
AIMASTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
RUN_AS = 10001  # the non-root user of the Dockerfile
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class ManifestError(ValueError):
    """The job cannot be rendered as a TFJob; the message names the field."""


# -- the estimate's plan -----------------------------------------------------------------
def parse_plan(doc) -> dict:
    """``{"plan": {"ps": {...}, "worker": {...}}}`` or just the plan object ->
    {"ps": {"replicas", "memory_bytes", "cpu"}, "worker": {...}}; each role optional."""
    if isinstance(doc, dict) and "plan" in doc:
        doc = doc["plan"]
    if not isinstance(doc, dict) or not set(doc) & {"ps", "worker"}:
        raise ManifestError("plan: expected an object with 'ps' and/or 'worker' (or a top-level "
                            f"'plan' holding one), got {json.dumps(doc)[:120]}")
    out = {}
    for role in ("ps", "worker"):
        if role not in doc:
            continue
        r = doc[role]
        if not isinstance(r, dict):
            raise ManifestError(f"plan.{role}: expected an object, got {r!r}")
        entry = {}
        reps = r.get("replicas")
        if reps is not None:
            if isinstance(reps, bool) or not isinstance(reps, int) or reps < (1 if role == "ps" else 0):
                raise ManifestError(f"plan.{role}.replicas: expected an integer >= "
                                    f"{1 if role == 'ps' else 0}, got {reps!r}")
            entry["replicas"] = reps
        for key, kind in (("memory_bytes", int), ("cpu", (int, float))):
            v = r.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, kind) or not v > 0 or \
                    (isinstance(v, float) and not math.isfinite(v)):
                raise ManifestError(f"plan.{role}.{key}: expected a positive number, got {v!r}")
            entry[key] = v
        out[role] = entry
    return out


def load_plan(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise ManifestError(f"cannot read plan {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(f"plan {path} is not JSON: {exc}") from exc
    return parse_plan(doc)


def _resources(entry: dict | None) -> dict:
    """Requests = limits: Guaranteed QoS is evicted last under node pressure, and the PS
    reports its memory limit to the AIMaster for scaling."""
    if not entry:
        return {}
    q = {}
    if "cpu" in entry:
        q["cpu"] = f"{math.ceil(entry['cpu'] * 1000)}m"
    if "memory_bytes" in entry:
        q["memory"] = f"{math.ceil(entry['memory_bytes'] / 2**20)}Mi"
    return {"requests": dict(q), "limits": dict(q)} if q else {}


# -- documents ----------------------------------------------------------------------------
def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def render(config: JobConfig, job_doc: dict, plan: dict | None = None, image: str | None = None,
           namespace: str | None = None) -> list[dict]:
    """The documents to ``kubectl apply``: ServiceAccount, Role, RoleBinding, ConfigMap, TFJob."""
    k8s = config.kubernetes
    name = config.name
    if not _DNS1035.match(name) or len(name) > 40:
        # pods are <name>-worker-<n>, services too: keep room under the 63-character limit
        raise ManifestError(f"name {name!r}: a TFJob name must be lowercase letters, digits and "
                            "'-', start with a letter, and be at most 40 characters here")
    image = image or k8s.image
    if not image:
        raise ManifestError("kubernetes.image: required (the image built from the Dockerfile), "
                            "or pass --image")
    # explicit everywhere: the RoleBinding's subject must name the namespace anyway
    namespace = namespace or k8s.namespace or "default"
    plan = plan or {}
    ps_n = plan.get("ps", {}).get("replicas", config.ps.replicas)
    workers = plan.get("worker", {}).get("replicas", config.worker.replicas)
    if not max(1, config.ps.min_replicas) <= ps_n <= config.ps.max_replicas:
        raise ManifestError(f"plan.ps.replicas ({ps_n}) is outside [{max(1, config.ps.min_replicas)}, "
                            f"{config.ps.max_replicas}] (ps.min_replicas / ps.max_replicas)")
    if not config.worker.min_replicas <= workers <= config.worker.max_replicas:
        raise ManifestError(f"plan.worker.replicas ({workers}) is outside [{config.worker.min_replicas}, "
                            f"{config.worker.max_replicas}] (worker.min_replicas / worker.max_replicas)")
    if workers and not config.worker.command:
        raise ManifestError("worker.command: required when the job has workers")
    token_secret = f"{name}-token" if k8s.token_secret is None else k8s.token_secret
    sa = k8s.service_account or f"{name}-aimaster"
    labels = {"app.kubernetes.io/name": "deeprec-ext", "app.kubernetes.io/instance": name}

    def meta(obj_name: str) -> dict:
        return {"name": obj_name, "namespace": namespace, "labels": dict(labels)}

    master_addr = f"{name}-chief-0:{k8s.port}"
    state_dir = f"{k8s.data_mount_path}/runs/{name}" if k8s.data_pvc else STATE_DIR
    common_env = [
        {"name": "DEEPREC_MASTER_ADDR", "value": master_addr},
        _field_env(naming.REPLICA_TYPE_ENV, f"metadata.labels['{naming.REPLICA_TYPE_LABEL}']"),
        _field_env(naming.REPLICA_INDEX_ENV, f"metadata.labels['{naming.REPLICA_INDEX_LABEL}']"),
        {"name": "DEEPREC_STATE_DIR", "value": state_dir},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "2"},
    ]
    mounts, volumes = [], []
    if token_secret:
        common_env.append({"name": "DEEPREC_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"})
        mounts.append({"name": "job-token", "mountPath": TOKEN_DIR, "readOnly": True})
        volumes.append({"name": "job-token", "secret": {"secretName": token_secret,
                                                        "defaultMode": 0o440}})
    if k8s.tls_secret:
        common_env.append({"name": "DEEPREC_TLS_DIR", "value": TLS_DIR})
        if config.security.tls_server_name:
            common_env.append({"name": "DEEPREC_TLS_SERVER_NAME",
                               "value": config.security.tls_server_name})
        mounts.append({"name": "job-tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "job-tls", "secret": {"secretName": k8s.tls_secret,
                                                      "defaultMode": 0o440}})
    if k8s.data_pvc:
        mounts.append({"name": "data", "mountPath": k8s.data_mount_path})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": k8s.data_pvc}})
    else:
        mounts.append({"name": "state", "mountPath": STATE_DIR})
        volumes.append({"name": "state", "emptyDir": {}})

    def container(cname: str, command: list[str], env_extra: list[dict], resources: dict,
                  ports: list[dict], extra_mounts: list[dict] = ()) -> dict:
        c = {"name": cname, "image": image, "imagePullPolicy": k8s.image_pull_policy,
             "command": command, "env": common_env + env_extra,
             "ports": ports, "volumeMounts": mounts + list(extra_mounts),
             "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                 "capabilities": {"drop": ["ALL"]}}}
        if resources:
            c["resources"] = resources
        return c

    def pod_spec(containers: list[dict], grace: int, api_access: bool, extra_volumes=()) -> dict:
        spec = {"containers": containers, "terminationGracePeriodSeconds": grace,
                "automountServiceAccountToken": api_access,
                # the image's user (Dockerfile); fsGroup lets it read the Secrets, write the PVC
                "securityContext": {"runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS},
                "volumes": volumes + list(extra_volumes)}
        if api_access:
            spec["serviceAccountName"] = sa
        return spec

    tf_port = [{"name": "tfjob-port", "containerPort": k8s.ps_port}]  # the operator's service port
    role_env = {role: [{"name": k, "value": v} for k, v in cfg.env]
                for role, cfg in (("ps", config.ps), ("worker", config.worker))}
    worker_cmd = ENTRYPOINT + list(config.worker.command)
    grace = k8s.termination_grace_seconds

    # the PS's control endpoint (AIMaster and peer PS calls, own threads) next to its port
    control_port = k8s.ps_port + 1
    ps_env = list(role_env["ps"]) + [_field_env("DEEPREC_PS_HOST", "status.podIP"),
                                     {"name": "DEEPREC_PS_PORT", "value": str(k8s.ps_port)},
                                     {"name": "DEEPREC_PS_CONTROL_PORT", "value": str(control_port)}]
    if plan.get("ps", {}).get("memory_bytes"):
        ps_env.append({"name": "DEEPREC_PS_MEMORY_LIMIT_MB",
                       "value": str(math.ceil(plan["ps"]["memory_bytes"] / 2**20))})
    ps_spec = pod_spec([container(naming.TENSORFLOW_CONTAINER, ENTRYPOINT + ["python", "-m", "deeprec_ext.ps"],
                                  ps_env, _resources(plan.get("ps")),
                                  tf_port + [{"name": "ps-control", "containerPort": control_port}])],
                        grace, False)
    worker_spec = pod_spec([container(naming.TENSORFLOW_CONTAINER, worker_cmd, role_env["worker"],
                                      _resources(plan.get("worker")), tf_port)], grace, False)

    chief_is_worker = workers > 0
    chief_tf = container(naming.TENSORFLOW_CONTAINER,
                         worker_cmd if chief_is_worker else ENTRYPOINT[:-1] + ["--idle"],
                         role_env["worker"] if chief_is_worker else [],
                         _resources(plan.get("worker")) if chief_is_worker else {}, tf_port)
    aimaster = container(
        naming.AIMASTER_CONTAINER,
        ["aimaster", "run", f"{JOB_CONFIG_DIR}/job.yaml", "--scaler", "kubernetes"],
        [_field_env(naming.NAMESPACE_ENV, "metadata.namespace"),
         _field_env(naming.JOB_NAME_ENV, f"metadata.labels['{naming.JOB_NAME_LABEL}']"),
         {"name": naming.CHIEF_WORKER_ENV, "value": "1" if chief_is_worker else "0"}],
        AIMASTER_RESOURCES, [{"name": "aimaster", "containerPort": k8s.port}],
        [{"name": "job-config", "mountPath": JOB_CONFIG_DIR, "readOnly": True}])
    # the AIMaster outlives its members' hand-offs at the end of a job
    chief_spec = pod_spec([chief_tf, aimaster], grace + 15, True,
                          [{"name": "job-config", "configMap": {"name": f"{name}-job"}}])

    def replica(n: int, spec: dict, policy: str) -> dict:
        return {"replicas": n, "restartPolicy": policy,
                "template": {"metadata": {"labels": dict(labels)}, "spec": spec}}

    tfjob = {
        "apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": meta(name),
        "spec": {
            # a worker that fails is restarted or replaced by the AIMaster; it must not fail
            # the whole TFJob
            "enableDynamicWorker": True,
            "runPolicy": {"cleanPodPolicy": "Running",
                          "backoffLimit": max(config.worker.max_restarts, 1) * max(workers, 1)},
            "tfReplicaSpecs": {
                # kubelet restarts a crashed chief worker in place, beside the AIMaster; an
                # AIMaster that exits non-zero counts against runPolicy.backoffLimit
                "Chief": replica(1, chief_spec, "OnFailure"),
                # a dead PS is not restarted empty in place: its peer is promoted and the
                # operator re-creates the pod, which joins by scale-out
                "PS": replica(ps_n, ps_spec, "ExitCode"),
                # kubelet restarts a crashed worker in place; it re-registers under its id
                "Worker": replica(max(workers - 1, 0), worker_spec, "OnFailure"),
            },
        },
    }
    if config.eval is not None and workers:
        # evaluation while training: the worker command told to evaluate (docs/guide-eval.md)
        eval_env = role_env["worker"] + [
            {"name": "DEEPREC_ROLE", "value": "evaluator"},
            {"name": "DEEPREC_EVAL", "value": json.dumps(eval_env_spec(config))}]
        tfjob["spec"]["tfReplicaSpecs"]["Evaluator"] = replica(1, pod_spec(
            [container(naming.TENSORFLOW_CONTAINER, worker_cmd, eval_env,
                       _resources(plan.get("worker")), tf_port)], grace, False), "OnFailure")

    job = copy.deepcopy(job_doc) if isinstance(job_doc, dict) else {}
    master = dict(job.get("master") or {})
    master.update(host="0.0.0.0", port=k8s.port, state_dir=state_dir)
    job["master"] = master
    if plan.get("ps", {}).get("replicas") is not None:
        job.setdefault("ps", {})
        job["ps"] = {**(job["ps"] or {}), "replicas": ps_n}
    if plan.get("worker", {}).get("replicas") is not None:
        key = "workers" if "workers" in job else "worker"
        job[key] = {**(job.get(key) or {}), "replicas": workers}
    security = dict(job.get("security") or {})
    security.pop("token_file", None)
    security.pop("tls_dir", None)
    if token_secret:
        security["token_file"] = f"{TOKEN_DIR}/token"
    if k8s.tls_secret:
        security["tls_dir"] = TLS_DIR
    if security:
        job["security"] = security
    else:
        job.pop("security", None)
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{name}-job"),
                 "data": {"job.yaml": yaml.safe_dump(job, sort_keys=False)}}

    service_account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(sa)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": meta(f"{name}-aimaster"),
            "rules": [
                # scale: read and patch the replica counts of its own TFJob, nothing else
                {"apiGroups": ["kubeflow.org"], "resources": ["tfjobs"], "resourceNames": [name],
                 "verbs": ["get", "patch"]},
                # observe members (death, eviction) and remove the highest-index pod on scale-in
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
            ]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": meta(f"{name}-aimaster"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                           "name": f"{name}-aimaster"},
               "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]}
    return [service_account, role, binding, configmap, tfjob]


def render_file(job_path: str, plan_path: str | None = None, image: str | None = None,
                namespace: str | None = None) -> list[dict]:
    from aimaster.config import parse_job
    try:
        with open(job_path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise ManifestError(f"cannot read job file {job_path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ManifestError(f"job file {job_path} is not valid YAML: {exc}") from exc
    try:
        config = parse_job(doc)
    except ConfigError as exc:
        raise ManifestError(str(exc)) from exc
    return render(config, doc, load_plan(plan_path) if plan_path else None, image, namespace)


class _Dumper(yaml.SafeDumper):
    """No anchors (shared env lists would print as &id001 / *id001), and multi-line strings
    (the job file in the ConfigMap) as readable ``|`` blocks."""

    def ignore_aliases(self, data):
        return True


def _str(dumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(documents: list[dict]) -> str:
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
