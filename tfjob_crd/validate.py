"""Validate rendered (or hand-written) documents before they reach a cluster.

Three layers, each naming the document and the field at fault:

1. the TFJob against the CRD's OpenAPI schema (``kubeflow.org_tfjobs.v1.9.0.yaml``), made
   strict: a field the schema does not know is reported, where the API server would prune it
   silently (a typo such as ``replica:`` would otherwise vanish);
2. every pod template, ServiceAccount, Role, RoleBinding and ConfigMap against the Kubernetes
   schemas of ``kubernetes-validate`` (strict mode);
3. the rules the training operator's webhook enforces beyond the schema: a container named
   ``tensorflow`` in every replica, an image on every container, at most one Chief/Master
   role (and one replica of it), a DNS-1035 job name; and the policy values the operator
   understands (the CRD types them as free strings).
"""
from __future__ import annotations

import copy
import functools
import os
import re

import yaml

K8S_VERSION = "1.31"  # a Kubernetes release the v1.9 training operator supports
CRD_ENV = "DEEPREC_TFJOB_CRD"
_HERE = os.path.dirname(os.path.abspath(__file__))
CRD_CANDIDATES = (
    os.path.join(_HERE, "kubeflow.org_tfjobs.v1.9.0.yaml"),
    os.path.join(_HERE, "..", "..", "shared", "schemas", "kubeflow.org_tfjobs.v1.9.0.yaml"),
)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class SchemaMissing(RuntimeError):
    """The TFJob CRD file is not available."""


def find_crd(path: str | None = None) -> str | None:
    for p in ([path] if path else []) + [os.environ.get(CRD_ENV, "")] + list(CRD_CANDIDATES):
        if p and os.path.isfile(p):
            return os.path.abspath(p)
    return None


def _strict(schema):
    """Forbid properties a structural schema does not declare (the API server prunes them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=4)
def _crd_validator(path: str):
    import jsonschema
    with open(path, encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    # OpenAPI v3.0 schemas are JSON-Schema draft 4 in substance
    return jsonschema.Draft4Validator(schema)


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(document)"


def check_crd(doc: dict, crd_path: str | None = None) -> list[str]:
    path = find_crd(crd_path)
    if path is None:
        raise SchemaMissing(f"TFJob CRD schema not found (looked in {crd_path or ''} ${CRD_ENV} "
                            f"{' '.join(CRD_CANDIDATES)})")
    errors = sorted(_crd_validator(path).iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"TFJob schema: {_path(e.absolute_path)}: {e.message}" for e in errors]


def _k8s(doc: dict, what: str) -> list[str]:
    import kubernetes_validate
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{what}: {_path(e.absolute_path)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{what}: {e.message}"]
    return []


def check_pod_templates(tfjob: dict) -> list[str]:
    out = []
    specs = (tfjob.get("spec") or {}).get("tfReplicaSpecs") or {}
    for rtype, rspec in specs.items():
        template = (rspec or {}).get("template")
        if not isinstance(template, dict):
            continue  # reported by the schema / webhook checks
        # a PodTemplate object wraps exactly a PodTemplateSpec: validate it as one
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                   "template": template}
        for problem in _k8s(wrapped, f"tfReplicaSpecs.{rtype}"):
            out.append(problem.replace(": template.", ": template.", 1))
    return out


def check_webhook(tfjob: dict) -> list[str]:
    """The training operator's admission rules (pkg/webhooks/tensorflow) that no schema holds."""
    out = []
    name = (tfjob.get("metadata") or {}).get("name", "")
    if not isinstance(name, str) or not _DNS1035.match(name) or len(name) > 63:
        out.append(f"metadata.name: {name!r} must be a DNS-1035 label (lowercase letters, digits, "
                   "'-', starting with a letter, at most 63 characters)")
    specs = (tfjob.get("spec") or {}).get("tfReplicaSpecs")
    if not isinstance(specs, dict) or not specs:
        return out + ["spec.tfReplicaSpecs: must be specified"]
    # values the CRD types as free strings but the operator understands only these of
    policy = ((tfjob.get("spec") or {}).get("runPolicy") or {}).get("cleanPodPolicy")
    if policy is not None and policy not in ("All", "Running", "None"):
        out.append(f"spec.runPolicy.cleanPodPolicy: {policy!r} is not one of All, Running, None")
    for rtype, rspec in specs.items():
        rp = (rspec or {}).get("restartPolicy")
        if rp is not None and rp not in ("Always", "OnFailure", "Never", "ExitCode"):
            out.append(f"spec.tfReplicaSpecs.{rtype}.restartPolicy: {rp!r} is not one of "
                       "Always, OnFailure, Never, ExitCode")
    chiefs = [t for t in specs if str(t).lower() in ("chief", "master")]
    if len(chiefs) > 1:
        out.append(f"spec.tfReplicaSpecs: must not have more than 1 Chief or Master role, has {chiefs}")
    for rtype, rspec in specs.items():
        where = f"spec.tfReplicaSpecs.{rtype}"
        rspec = rspec or {}
        if str(rtype).lower() in ("chief", "master") and isinstance(rspec.get("replicas"), int) \
                and rspec["replicas"] > 1:
            out.append(f"{where}.replicas: a TFJob has at most one {rtype}, got {rspec['replicas']}")
        containers = (((rspec.get("template") or {}).get("spec") or {}).get("containers")) or []
        if not containers:
            out.append(f"{where}.template.spec.containers: must be specified")
            continue
        for i, c in enumerate(containers):
            if not (c or {}).get("image"):
                out.append(f"{where}.template.spec.containers[{i}].image: must be set "
                           f"(container {(c or {}).get('name', '?')!r})")
        if not any((c or {}).get("name") == "tensorflow" for c in containers):
            out.append(f"{where}.template.spec.containers: must have a container named "
                       f"'tensorflow', has {[(c or {}).get('name') for c in containers]}")
    return out


def validate_documents(docs: list[dict], crd_path: str | None = None,
                       require_crd: bool = False) -> tuple[list[str], list[str]]:
    """-> (problems, notes). Notes say what could not be checked (e.g. no CRD file)."""
    problems, notes = [], []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            problems.append(f"document {i}: expected a mapping, got {type(doc).__name__}")
            continue
        kind, api = doc.get("kind"), doc.get("apiVersion")
        what = f"{kind or '?'} {((doc.get('metadata') or {}).get('name')) or '?'}"
        if not kind or not api:
            problems.append(f"document {i}: needs apiVersion and kind")
            continue
        if kind == "TFJob":
            if api != "kubeflow.org/v1":
                problems.append(f"{what}: apiVersion {api!r}; expected kubeflow.org/v1")
                continue
            try:
                problems += [f"{what}: {p}" for p in check_crd(doc, crd_path)]
            except SchemaMissing as exc:
                if require_crd:
                    problems.append(f"{what}: {exc}")
                else:
                    notes.append(f"{what}: not checked against the CRD schema: {exc}")
            problems += [f"{what}: {p}" for p in check_pod_templates(doc)]
            problems += [f"{what}: {p}" for p in check_webhook(doc)]
        else:
            problems += _k8s(doc, what)
    return problems, notes


def check_file(path: str, crd_path: str | None = None, require_crd: bool = False):
    try:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
    except OSError as exc:
        return [f"cannot read {path}: {exc.strerror}"], []
    except yaml.YAMLError as exc:
        return [f"{path} is not valid YAML: {exc}"], []
    if not docs:
        return [f"{path} holds no document"], []
    return validate_documents(docs, crd_path, require_crd)
