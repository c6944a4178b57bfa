"""How TFJob pods map to job members, shared by the manifest, the entrypoint and the scaler.

The training operator names pods ``<job>-<type>-<index>`` and labels them with the type and
index. The Chief's ``tensorflow`` container is worker 0 (the chief worker); Worker pod ``i``
is ``worker-<i+1>``; PS pod ``i`` is ``ps-<i>``. So member ranks follow pod indices and
"remove the highest index" on scale-in is what both the AIMaster and the operator do.
"""
from __future__ import annotations

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"

# environment of every pod (downward API), read by the entrypoint and the scaler
NAMESPACE_ENV = "DEEPREC_K8S_NAMESPACE"
JOB_NAME_ENV = "DEEPREC_TFJOB_NAME"
REPLICA_TYPE_ENV = "DEEPREC_REPLICA_TYPE"
REPLICA_INDEX_ENV = "DEEPREC_REPLICA_INDEX"
CHIEF_WORKER_ENV = "DEEPREC_CHIEF_IS_WORKER"  # "1": the Chief's tensorflow container is worker-0

TENSORFLOW_CONTAINER = "tensorflow"   # the operator's webhook requires this name
AIMASTER_CONTAINER = "aimaster"

SPEC_KEY = {"ps": "PS", "worker": "Worker", "chief": "Chief"}


def member_id(replica_type: str, index: int) -> str:
    t = replica_type.lower()
    if t == "ps":
        return f"ps-{index}"
    if t == "evaluator":  # the job's evaluator (an eval section): not a training worker
        return f"evaluator-{index}"
    if t == "worker":
        return f"worker-{index + 1}"
    if t in ("chief", "master"):
        return "worker-0"
    raise ValueError(f"replica type {replica_type!r} has no member (expected chief, ps or worker)")


def replica_of(member: str) -> tuple[str, int]:
    """member id -> (replica type, pod index): ``ps-3`` -> ("ps", 3), ``worker-0`` -> ("chief", 0)."""
    role, _, num = member.rpartition("-")
    if not num.isdigit() or role not in ("ps", "worker"):
        raise ValueError(f"{member!r} is not a member id of a TFJob (ps-N or worker-N)")
    n = int(num)
    if role == "ps":
        return "ps", n
    return ("chief", 0) if n == 0 else ("worker", n - 1)


def pod_name(job: str, replica_type: str, index: int) -> str:
    return f"{job}-{replica_type.lower()}-{index}"
