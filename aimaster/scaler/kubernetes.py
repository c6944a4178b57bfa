"""KubernetesScaler: the job's roles are the pods of a Kubeflow TFJob (kubeflow.org/v1).

The only module that imports the ``kubernetes`` client (tests/test_layering.py checks it).

- **Act.** Scaling patches ``spec.tfReplicaSpecs.{PS,Worker}.replicas`` of the job's own TFJob
  (a JSON merge patch); the training operator creates the pods.
- **Scale-in.** The operator decides who leaves: in the reconcile that follows the patch,
  ``ReconcilePods`` deletes every pod of the type whose replica index is ``>= replicas``
  (``pkg/controller.v1/common/pod.go``, training-operator v1.9; the delete has the pod's
  grace period). So the leavers are the highest indices (``leavers``), they are gone as soon
  as the count drops, and they must be drained *before*: a PS's slots migrated to the PS that
  stay, a worker's step finished and its shards handed back. ``apply`` asks ``drain`` about
  every leaver before it sends the patch, and a leaver that still owns slots or shards makes
  it refuse (``ScalerError``, nothing changed). After the patch the scaler deletes the
  leavers' pods too (a no-op when the operator was first).
- **Replace a straggler.** ``start_replacement`` raises the count and, in the same patch,
  adds to the replica type's pod template a *required* node affinity ``NotIn`` the slow
  pod's node: the new pod (and any later pod of the type) is never scheduled there. Required,
  not preferred: a preferred term is only a score, and the scheduler may well put the new
  pod back on the slow node (it has room: the slow pod is leaving), which would make the
  replacement pointless. A cluster with no other node that fits leaves the pod Pending; the
  AIMaster's wait for it to register times out and the count goes back (nothing moved).
  ``retire`` lets one chosen member go without lowering the count: the member, told to stop
  with its next heartbeat, exits 0 and its pod completes; the operator re-creates neither a
  completed PS (restartPolicy ExitCode) nor a completed worker (OnFailure). The retired index
  stays counted in ``replicas`` (``_want`` adds it back), until a scale-in removes it.
- **Observe.** A pod watch turns a container exit, a failed (evicted) pod or a deleted pod
  into a node exit at once, instead of after the member's lease runs out.
- **Where.** Namespace and TFJob name come from the pod's environment (downward API, set by
  ``aimaster manifest``); the API credentials from the pod's ServiceAccount.

Pods map to members as in ``tfjob_crd.naming``. The member process is PID 1 of its
container (the entrypoint execs it), so every node reports pid 1.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable

from kubernetes import client, config as kube_config, watch
from kubernetes.client.exceptions import ApiException

from aimaster.config import JobConfig
from aimaster.registry import MemberState
from aimaster.scaler.api import NodeInfo, NodeState, ScalePlan, ScaleResult, Scaler, ScalerError
from tfjob_crd import naming

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "tfjobs"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
CONTAINER_PID = 1
# re-list/re-watch backoff after an API error (seconds, last one repeats)
WATCH_RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class _Node:
    role: str
    id: str
    state: NodeState = NodeState.PENDING
    exit_code: int | None = None
    restarts: int = 0
    stopping: bool = False
    reported: bool = True   # nothing to report until it ran
    uid: str = ""
    container_restarts: int = 0  # kubelet's restartCount in the current pod

    def info(self) -> NodeInfo:
        state = NodeState.STOPPED if self.stopping and self.state in (
            NodeState.FAILED, NodeState.SUCCEEDED) else self.state
        return NodeInfo(self.role, self.id, CONTAINER_PID, state, self.exit_code, self.restarts)


def _member_of(pod: dict, chief_is_worker: bool) -> str | None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    rtype = str(labels.get(naming.REPLICA_TYPE_LABEL, "")).lower()
    index = str(labels.get(naming.REPLICA_INDEX_LABEL, ""))
    if not index.isdigit() or rtype not in ("ps", "worker", "chief", "master"):
        return None
    if rtype in ("chief", "master") and not chief_is_worker:
        return None
    return naming.member_id(rtype, int(index))


def _tf_status(pod: dict) -> dict:
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                 if c.get("name") == naming.TENSORFLOW_CONTAINER), {})


def _last_exit(pod: dict) -> int | None:
    return ((_tf_status(pod).get("lastState") or {}).get("terminated") or {}).get("exitCode")


def _container_state(pod: dict) -> tuple[NodeState, int | None, int]:
    """(state, exit code, restarts) of the pod's tensorflow container."""
    status = pod.get("status") or {}
    cs = _tf_status(pod)
    restarts = int(cs.get("restartCount", 0))
    state = cs.get("state") or {}
    if "terminated" in state:
        code = state["terminated"].get("exitCode")
        return (NodeState.SUCCEEDED if code == 0 else NodeState.FAILED), code, restarts
    if "running" in state:
        return NodeState.RUNNING, None, restarts
    if status.get("phase") == "Failed":  # evicted, or failed before the container ran
        return NodeState.FAILED, None, restarts
    if status.get("phase") == "Succeeded":
        return NodeState.SUCCEEDED, 0, restarts
    return NodeState.PENDING, None, restarts


HOSTNAME_LABEL = "kubernetes.io/hostname"
_TYPE = {"ps": "PS", "worker": "Worker"}


def _avoiding(affinity: dict | None, node: str) -> dict:
    """``affinity`` (a pod template's) with a required node affinity keeping pods off
    ``node``: a ``NotIn`` on the hostname added to every node selector term (terms are
    ORed, a term's expressions ANDed), the rest of the user's affinity kept."""
    out = json.loads(json.dumps(affinity or {}))
    required = out.setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        exprs = term.setdefault("matchExpressions", [])
        mine = next((e for e in exprs if e.get("key") == HOSTNAME_LABEL
                     and e.get("operator") == "NotIn"), None)
        if mine is None:
            exprs.append({"key": HOSTNAME_LABEL, "operator": "NotIn", "values": [node]})
        elif node not in mine.setdefault("values", []):
            mine["values"].append(node)
    required["nodeSelectorTerms"] = terms
    return out


class KubernetesScaler(Scaler):
    # retire(node) lets exactly that member go: it exits and its pod completes (the count
    # keeps its index); a straggler's replacement
    retires_chosen = True

    def __init__(self, config: JobConfig, master_address: str = "", namespace: str | None = None,
                 job_name: str | None = None, api_client: "client.ApiClient | None" = None,
                 drain: Callable[[list[str]], None] | None = None,
                 chief_is_worker: bool | None = None, watch_timeout: int = 30):
        self.config = config
        self.master_address = master_address
        self.namespace = namespace or os.environ.get(naming.NAMESPACE_ENV) or _sa_namespace()
        self.job_name = job_name or os.environ.get(naming.JOB_NAME_ENV, "")
        if not self.namespace or not self.job_name:
            raise ScalerError(f"the Kubernetes scaler needs the namespace and the TFJob name: set "
                              f"{naming.NAMESPACE_ENV} and {naming.JOB_NAME_ENV} (aimaster manifest "
                              f"does, from the pod's downward API); got namespace "
                              f"{self.namespace!r}, job {self.job_name!r}")
        if chief_is_worker is None:
            chief_is_worker = os.environ.get(naming.CHIEF_WORKER_ENV, "1") == "1"
        self.chief_is_worker = chief_is_worker
        if api_client is None:
            try:
                kube_config.load_incluster_config()
            except kube_config.ConfigException as exc:
                raise ScalerError(f"not running in a pod with a ServiceAccount: {exc}") from exc
            api_client = client.ApiClient()
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.drain = drain
        self.watch_timeout = watch_timeout
        self._lock = threading.RLock()
        self._nodes: dict[str, _Node] = {}
        self._pods: dict[str, dict] = {}   # member id -> last seen pod
        self._adopted = False
        self._retired: set[str] = set()  # members let go below the count (their pods completed)
        self._stop = threading.Event()
        job = self._api(lambda: self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.job_name), f"read TFJob {self.job_name}")
        specs = (job.get("spec") or {}).get("tfReplicaSpecs") or {}
        missing = [k for k in ("PS", "Worker") if k not in specs]
        if missing:
            raise ScalerError(f"TFJob {self.namespace}/{self.job_name} has no {missing} replica "
                              "spec(s) to scale; render it with `aimaster manifest`")
        self._replicas = {k: int(specs[k].get("replicas", 0) or 0) for k in ("PS", "Worker")}
        self._resource_version = self._list()
        # an AIMaster restarted after a straggler's replacement: a completed PS or Worker
        # pod below the count is a retired member (the operator does not re-run it)
        self._retired = {m for m, n in self._nodes.items() if n.state == NodeState.SUCCEEDED
                         and m in self._pods and not self._is_chief(self._pods[m])}
        self._watcher = threading.Thread(target=self._watch_loop, name="k8s-pod-watch", daemon=True)
        self._watcher.start()

    # -- API plumbing -----------------------------------------------------------------------
    def _api(self, fn, what: str):
        try:
            return fn()
        except ApiException as exc:
            raise ScalerError(f"{what}: Kubernetes API {exc.status} {exc.reason}: "
                              f"{(exc.body or '')[:300]}") from exc
        except Exception as exc:  # connection errors come as urllib3 exceptions
            raise ScalerError(f"{what}: {exc}") from exc

    def _selector(self) -> str:
        return f"{naming.JOB_NAME_LABEL}={self.job_name}"

    def _list(self) -> str:
        resp = self._api(lambda: self.core.list_namespaced_pod(
            self.namespace, label_selector=self._selector(), _preload_content=False),
            f"list pods of {self.job_name}")
        body = json.loads(resp.data)
        for pod in body.get("items") or []:
            self._observe("ADDED", pod)
        return (body.get("metadata") or {}).get("resourceVersion", "")

    def _watch_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                w = watch.Watch()
                for event in w.stream(self.core.list_namespaced_pod, self.namespace,
                                      label_selector=self._selector(),
                                      resource_version=self._resource_version,
                                      timeout_seconds=self.watch_timeout,
                                      _request_timeout=self.watch_timeout + 10):
                    if self._stop.is_set():
                        w.stop()
                        return
                    pod = event.get("raw_object") or {}
                    rv = (pod.get("metadata") or {}).get("resourceVersion")
                    if rv:
                        self._resource_version = rv
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._observe(event["type"], pod)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - 410 Gone, a dropped connection: re-list
                if self._stop.is_set():
                    return
                delay = WATCH_RETRY_DELAYS[min(failures, len(WATCH_RETRY_DELAYS) - 1)]
                failures += 1
                log.info("pod watch of %s: %s; re-listing in %.1fs", self.job_name, exc, delay)
                if self._stop.wait(delay):
                    return
                try:
                    self._resource_version = self._list()
                except ScalerError as err:
                    log.warning("%s", err)

    def _observe(self, kind: str, pod: dict) -> None:
        member = _member_of(pod, self.chief_is_worker)
        if member is None:
            return
        uid = (pod.get("metadata") or {}).get("uid", "")
        with self._lock:
            node = self._nodes.get(member)
            if node is None:
                node = self._nodes[member] = _Node("ps" if member.startswith("ps-") else "worker", member)
            if kind == "DELETED":
                if node.uid and uid and node.uid != uid:
                    return  # an older pod of a re-used index
                self._pods.pop(member, None)
                if node.state in (NodeState.RUNNING, NodeState.PENDING):
                    node.state, node.exit_code = NodeState.FAILED, None
                    node.reported = False
                    log.info("pod of %s deleted", member)
                return
            if node.uid != uid:  # a new pod for this index (the operator re-created it)
                node.uid, node.stopping, node.container_restarts = uid, False, 0
                if node.reported:  # the old pod's end was reported: start afresh
                    node.state, node.exit_code = NodeState.PENDING, None
            self._pods[member] = pod
            state, code, restarts = _container_state(pod)
            if restarts > node.container_restarts:
                # kubelet restarted the container (restartPolicy OnFailure); if we did not see
                # the old one end, report its exit now
                node.restarts += restarts - node.container_restarts
                node.container_restarts = restarts
                if node.state == NodeState.RUNNING and state != NodeState.FAILED:
                    node.state, node.exit_code, node.reported = NodeState.FAILED, _last_exit(pod), False
            if state in (NodeState.SUCCEEDED, NodeState.FAILED):
                if node.state not in (NodeState.SUCCEEDED, NodeState.FAILED):
                    node.state, node.exit_code, node.reported = state, code, False
            elif node.reported or node.state not in (NodeState.SUCCEEDED, NodeState.FAILED):
                node.state, node.exit_code = state, None

    # -- Scaler -----------------------------------------------------------------------------
    def _worker_offset(self) -> int:
        return 1 if self.chief_is_worker else 0

    def _want(self, plan: ScalePlan) -> dict[str, int]:
        """The replica counts ``apply(plan)`` sends (lock held). worker-0 is the Chief's
        container when ``chief_is_worker``: ``workers`` counts it, ``Worker.replicas`` not."""
        want = dict(self._replicas)
        if plan.ps is not None:
            want["PS"] = self._with_retired("ps", max(plan.ps, 0))
        if plan.workers is not None:
            want["Worker"] = self._with_retired("worker",
                                                max(plan.workers - self._worker_offset(), 0))
        if not self._adopted:
            # the operator already created the manifest's pods; the AIMaster's first
            # call (PS now, workers later) must not delete the workers meanwhile
            want = {k: max(v, self._replicas[k]) for k, v in want.items()}
        return want

    def _with_retired(self, role: str, live: int) -> int:
        """The replica count that runs ``live`` pods of ``role``: retired indices below it
        hold completed pods and count in ``replicas`` (lock held)."""
        retired = {naming.replica_of(m)[1] for m in self._retired if m.startswith(role + "-")}
        n = live
        while n - sum(1 for i in retired if i < n) < live:
            n += 1
        return n

    def _removed(self, want: dict[str, int]) -> list[str]:
        """Members whose pods the operator deletes when the counts become ``want``: replica
        indices ``want[type]`` and up, in the order its reconcile deletes them (ascending)."""
        return [naming.member_id(t, i) for t, key in (("ps", "PS"), ("worker", "Worker"))
                for i in range(want[key], self._replicas[key])]

    def leavers(self, role: str, count: int) -> list[str]:
        """The highest replica indices of ``role``'s type: the pods the training operator
        deletes once ``replicas`` drops (never worker-0, the Chief's container)."""
        if role not in ("ps", "worker"):
            raise ValueError(f"role {role!r}: expected 'ps' or 'worker'")
        with self._lock:
            plan = ScalePlan(ps=count) if role == "ps" else ScalePlan(workers=count)
            return [m for m in self._removed(self._want(plan)) if m.startswith(role + "-")]

    def apply(self, plan: ScalePlan) -> ScaleResult:
        return self._apply(plan)

    def start_replacement(self, role: str, slow_id: str, count: int) -> ScaleResult:
        """Raise ``role`` to ``count`` pods, the new one kept off the slow pod's node by a
        required node affinity in the replica type's template, sent in the same patch as
        the count (the operator creates the pod from the patched template). A slow pod
        not scheduled yet (no node): a plain scale-out."""
        if role not in _TYPE:
            raise ValueError(f"role {role!r}: expected 'ps' or 'worker'")
        with self._lock:
            node = ((self._pods.get(slow_id) or {}).get("spec") or {}).get("nodeName")
        plan = ScalePlan(ps=count) if role == "ps" else ScalePlan(workers=count)
        if not node:
            log.warning("%s has no node yet: its replacement is not kept off any node", slow_id)
            return self._apply(plan)
        rtype = _TYPE[role]
        job = self._api(lambda: self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.job_name), f"read TFJob {self.job_name}")
        template = (((job.get("spec") or {}).get("tfReplicaSpecs") or {}).get(rtype) or {}) \
            .get("template") or {}
        affinity = _avoiding((template.get("spec") or {}).get("affinity"), node)
        log.info("replacing %s: new %s pods avoid node %s", slow_id, rtype, node)
        return self._apply(plan, {rtype: {"template": {"spec": {"affinity": affinity}}}})

    @staticmethod
    def _is_chief(pod: dict) -> bool:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return str(labels.get(naming.REPLICA_TYPE_LABEL, "")).lower() in ("chief", "master")

    def retire_refusal(self, node_id: str) -> str | None:
        if node_id == "worker-0" and self.chief_is_worker:
            # its container ending is the Chief's: the TFJob would count as finished
            return "worker-0 runs in the Chief pod, whose end is the job's"
        return None

    def retire(self, node_id: str) -> None:
        """Let ``node_id`` go without lowering the count: the AIMaster already told it to
        stop (it exits 0, its pod completes and is not re-created). Its pod is not
        deleted: the operator would re-create a missing index below ``replicas``."""
        with self._lock:
            self._retired.add(node_id)
            if node_id in self._nodes:
                self._nodes[node_id].stopping = True

    def _apply(self, plan: ScalePlan, template_patch: dict | None = None) -> ScaleResult:
        with self._lock:
            want = self._want(plan)
            self._adopted = True
            removed = self._removed(want)
            added = [naming.member_id(t, i) for t, key in (("ps", "PS"), ("worker", "Worker"))
                     for i in range(self._replicas[key], want[key])]
            if removed and self.drain is not None:
                # the operator deletes these pods as soon as the count drops: every one must
                # be drained first; raises ScalerError, and then nothing was changed
                self.drain(removed)
            patch = {k: {"replicas": want[k]} for k in ("PS", "Worker") if want[k] != self._replicas[k]}
            for k, v in (template_patch or {}).items():
                patch.setdefault(k, {}).update(v)
            if patch:
                self._api(lambda: self.custom.patch_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.job_name,
                    {"spec": {"tfReplicaSpecs": patch}},
                    _content_type="application/merge-patch+json"),
                    f"scale TFJob {self.job_name} to {want}")
                log.info("TFJob %s replicas %s -> %s", self.job_name, self._replicas, want)
                self._replicas = want
            # an index that comes back must get a fresh pod: a completed one is not re-run
            for member in added:
                pod = self._pods.get(member)
                if pod is not None and (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    self._delete(member, grace=None)
            for member in removed:
                if member in self._nodes:
                    self._nodes[member].stopping = True
                self._delete(member, grace=None)
                self._retired.discard(member)  # its completed pod goes with the index
            for member in added:
                node = self._nodes.setdefault(member, _Node(member.split("-")[0], member))
                node.stopping = False
        return ScaleResult(tuple(added), tuple(removed))

    def _delete(self, member: str, grace: int | None) -> None:
        rtype, index = naming.replica_of(member)
        name = naming.pod_name(self.job_name, rtype, index)
        kwargs = {} if grace is None else {"grace_period_seconds": grace}
        try:
            self.core.delete_namespaced_pod(name, self.namespace, **kwargs)
        except ApiException as exc:
            if exc.status != 404:  # already gone: what we wanted
                raise ScalerError(f"delete pod {name}: Kubernetes API {exc.status} {exc.reason}") from exc

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            return [n.info() for n in self._nodes.values()]

    def poll_exits(self) -> list[NodeInfo]:
        out = []
        with self._lock:
            for node in self._nodes.values():
                if not node.reported and node.state in (NodeState.SUCCEEDED, NodeState.FAILED):
                    node.reported = True
                    out.append(node.info())
        return out

    def restart(self, node_id: str) -> NodeInfo:
        """A crashed container is restarted in place by kubelet (restartPolicy OnFailure); a
        pod that is gone for good (evicted, completed) is deleted so the operator re-creates it."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise ScalerError(f"{node_id} is not a pod of TFJob {self.job_name}")
            pod = self._pods.get(node_id)
            phase = ((pod or {}).get("status") or {}).get("phase")
            if node_id != "worker-0" and (pod is None or phase in ("Failed", "Succeeded")):
                self._delete(node_id, grace=None)
            node.state, node.exit_code, node.reported = NodeState.PENDING, None, True
            node.restarts += 1
            return node.info()

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Delete a hung member's pod (SIGKILL: no grace period). worker-0 shares the pod
        with the AIMaster and is left to its lease."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is not None:
                node.stopping = True
        if node_id == "worker-0" and self.chief_is_worker:
            log.warning("not deleting the chief pod to stop %s: it runs the AIMaster", node_id)
            return
        self._delete(node_id, grace=0 if sig == signal.SIGKILL else None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop watching. The members' pods go with the TFJob: when the Chief completes the
        operator deletes the running pods (cleanPodPolicy: Running) with their grace period."""
        self._stop.set()
        self._watcher.join(timeout=min(timeout, 2.0))


def _sa_namespace() -> str:
    try:
        with open(SA_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def _shard_holders(shards) -> dict[str, list[int]]:
    """worker id -> the DOING shards it holds, from a ShardQueue's public state."""
    held: dict[str, list[int]] = {}
    if shards is not None:
        for sid, worker in (shards.to_state().get("doing") or {}).items():
            held.setdefault(worker, []).append(int(sid))
    return {w: sorted(ids) for w, ids in held.items()}


def drain_guard(get_master) -> Callable[[list[str]], None]:
    """The drain check for the AIMaster, run on the members a scale-in removes before the
    replica count drops (after it, the operator deletes their pods at once):

    - a PS is drained when the routing no longer names it: the scale event migrated its
      slots to the PS that stay (live hand-off). Deleting one that still owns slots loses
      its rows since the last checkpoint, or costs a recovery from its ring peer;
    - a worker is drained when it left: it finished its step, handed its shards back with
      their progress and deregistered (or the AIMaster gave its shards back after it died).
      One that is still registered, or still holds a shard, would lose the step in flight.

    Reads the JobMaster's ``routing``, ``registry`` and ``shards``; raises ScalerError."""
    def drain(member_ids: list[str]) -> None:
        master = get_master()
        routing = master.routing
        problems = []
        owning = [p for p in member_ids
                  if p.startswith("ps-") and routing is not None and p in routing.ps_ids]
        if owning:
            problems.append(f"{owning} still own slots at routing epoch {routing.epoch}: scale "
                            "PS in through the AIMaster (`aimaster scale --ps N`), which hands "
                            "their rows off first")
        workers = [w for w in member_ids if w.startswith("worker-")]
        if workers:
            registry = getattr(master, "registry", None)
            held = _shard_holders(getattr(master, "shards", None))
            busy = []
            for w in workers:
                member = registry.get(w) if registry is not None else None
                registered = member is not None and member.state == MemberState.RUNNING
                if w in held:
                    busy.append(f"{w} holds shards {held[w]}")
                elif registered:
                    busy.append(f"{w} is still registered")
            if busy:
                problems.append(f"workers not drained ({'; '.join(busy)}): scale workers in "
                                "through the AIMaster (`aimaster scale --workers N`), which lets "
                                "them finish their step and hand their shards back first")
        if problems:
            raise ScalerError("refusing to lower the replica count: the training operator "
                              "deletes the pods past it at once; " + "; ".join(problems))
    return drain


def master_scaler_factory(get_master):
    """``JobMaster(scaler_factory=...)`` for ``aimaster run --scaler kubernetes``."""
    def factory(address: str, cfg: JobConfig) -> KubernetesScaler:
        return KubernetesScaler(cfg, master_address=address, drain=drain_guard(get_master))
    return factory
