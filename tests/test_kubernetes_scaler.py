"""KubernetesScaler through the real ``kubernetes`` client against an in-process HTTP server
that speaks the subset of the Kubernetes API the scaler uses (TFJob get/patch, pod
list/watch/delete). The test plays the training operator: it adds and removes pods, either
by hand or (``operator=True``) as training-operator v1.9's ``ReconcilePods`` does on every
change of the TFJob: a pod whose replica index is at or past ``replicas`` is deleted at once
(``pkg/controller.v1/common/pod.go``), a missing index below it is created."""
from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from kubernetes import client

from aimaster.config import parse_job
from aimaster.registry import MemberState, Registry
from aimaster.scaler import NodeState, ScalePlan, ScalerError, create_scaler
from aimaster.scaler.kubernetes import KubernetesScaler, drain_guard
from aimaster.scaler.local import LocalProcessScaler
from aimaster.shards import Shard, ShardQueue
from tfjob_crd import naming

pytestmark = pytest.mark.timeout(60)

NS, JOB = "team-a", "ctr"
TFJOB_PATH = f"/apis/kubeflow.org/v1/namespaces/{NS}/tfjobs/{JOB}"
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"
CONFIG = parse_job({"name": JOB, "ps": {"replicas": 2}, "worker": {"replicas": 2, "command": ["x"]}})


def _merge(dst: dict, patch: dict) -> dict:
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif v is None:
            dst.pop(k, None)
        else:
            dst[k] = v
    return dst


class FakeKubeAPI:
    """Just enough of an API server; records every request. With ``operator`` it also plays
    the training operator's reconcile of the TFJob after every patch, before answering it."""

    def __init__(self, ps: int = 2, workers: int = 1, operator: bool = False):
        self.operator = operator
        self.nodes = ["node-a", "node-b", "node-c"]  # where the fake scheduler puts new pods
        self.timeline: list[tuple] = []        # ("patch", body) / ("deleted", member), in order
        self.on_operator_delete = None        # called with the member just before its pod goes
        self.requests: list[dict] = []
        self.tfjob = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob",
                      "metadata": {"name": JOB, "namespace": NS},
                      "spec": {"tfReplicaSpecs": {"Chief": {"replicas": 1}, "PS": {"replicas": ps},
                                                  "Worker": {"replicas": workers}}}}
        self.pods: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.rv = itertools.count(100)
        self.cond = threading.Condition()
        self.closing = False
        self.watch_connections = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def _send(self, code: int, obj: dict):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method):
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                body = self._body()
                api.requests.append({"method": method, "path": url.path, "query": query,
                                     "body": body, "content_type": self.headers.get("Content-Type")})
                if url.path == TFJOB_PATH and method == "GET":
                    return self._send(200, api.tfjob)
                if url.path == TFJOB_PATH and method == "PATCH":
                    _merge(api.tfjob, body)
                    api.timeline.append(("patch", body))
                    if api.operator:
                        api.reconcile()
                    return self._send(200, api.tfjob)
                if url.path == PODS_PATH and method == "GET" and query.get("watch") in ("true", "True", "1"):
                    return self._watch(int(query.get("resourceVersion") or 0),
                                       float(query.get("timeoutSeconds") or 5))
                if url.path == PODS_PATH and method == "GET":
                    with api.cond:
                        items = list(api.pods.values())
                        rv = api.events[-1][0] if api.events else 99
                    return self._send(200, {"kind": "PodList", "apiVersion": "v1",
                                            "metadata": {"resourceVersion": str(rv)}, "items": items})
                if url.path.startswith(PODS_PATH + "/") and method == "DELETE":
                    name = url.path.rsplit("/", 1)[1]
                    pod = api.delete_pod(name)
                    if pod is None:
                        return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                "reason": "NotFound", "code": 404})
                    return self._send(200, pod)
                return self._send(404, {"kind": "Status", "status": "Failure", "code": 404})

            def _watch(self, since: int, timeout: float):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                api.watch_connections += 1
                deadline = time.monotonic() + timeout
                sent = since
                try:
                    while time.monotonic() < deadline and not api.closing:
                        with api.cond:
                            fresh = [e for e in api.events if e[0] > sent]
                            if not fresh:
                                api.cond.wait(0.1)
                                continue
                        for rv, kind, obj in fresh:
                            data = (json.dumps({"type": kind, "object": obj}) + "\n").encode()
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                            self.wfile.flush()
                            sent = rv
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass

            def do_GET(self):
                self._route("GET")

            def do_PATCH(self):
                self._route("PATCH")

            def do_DELETE(self):
                self._route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    # -- the test plays the operator / kubelet ------------------------------------------------
    def _event(self, kind: str, pod: dict) -> None:
        with self.cond:
            rv = next(self.rv)
            pod["metadata"]["resourceVersion"] = str(rv)
            self.events.append((rv, kind, json.loads(json.dumps(pod))))
            self.cond.notify_all()

    def put_pod(self, rtype: str, index: int, state: dict | None = None, phase: str = "Running",
                restarts: int = 0, uid: str | None = None, reason: str | None = None,
                node: str | None = None) -> dict:
        name = f"{JOB}-{rtype}-{index}"
        if node is None and name in self.pods:  # a status change keeps the pod's node
            node = (self.pods[name].get("spec") or {}).get("nodeName")
        kind = "MODIFIED" if name in self.pods else "ADDED"
        status = {"phase": phase, "containerStatuses": [{
            "name": "tensorflow", "restartCount": restarts, "ready": True, "image": "img",
            "imageID": "", "state": state or {"running": {"startedAt": "2026-11-21T00:00:00Z"}}}]}
        if reason:
            status["reason"] = reason
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": NS, "uid": uid or f"uid-{name}",
                            "labels": {"training.kubeflow.org/job-name": JOB,
                                       "training.kubeflow.org/replica-type": rtype,
                                       "training.kubeflow.org/replica-index": str(index)}},
               "status": status}
        if node:  # scheduled
            pod["spec"] = {"nodeName": node, "containers": [{"name": "tensorflow", "image": "img"}]}
        with self.cond:
            self.pods[name] = pod
        self._event(kind, pod)
        return pod

    def delete_pod(self, name: str) -> dict | None:
        with self.cond:
            pod = self.pods.pop(name, None)
        if pod is not None:
            self._event("DELETED", pod)
        return pod

    def reconcile(self) -> None:
        """training-operator v1.9, ``ReconcilePods`` for each replica type: ``GetPodSlices``
        groups the pods by replica index; an index ``>= replicas`` is deleted right away
        (``PodControl.DeletePod``, default grace period), a missing one below it created."""
        for rtype, spec in self.tfjob["spec"]["tfReplicaSpecs"].items():
            rt, n = rtype.lower(), int(spec.get("replicas") or 0)
            with self.cond:
                have = {int(p["metadata"]["labels"]["training.kubeflow.org/replica-index"]): name
                        for name, p in self.pods.items()
                        if p["metadata"]["labels"]["training.kubeflow.org/replica-type"] == rt}
            for index in sorted(have):
                if index >= n:
                    self._operator_delete(rt, index, have[index])
            for index in range(n):
                if index not in have:
                    node = self.schedule(spec.get("template") or {})
                    if node is None:  # unschedulable: Pending, no container ran
                        self.put_pod(rt, index, uid=f"uid-{JOB}-{rt}-{index}-{next(self.rv)}",
                                     state={"waiting": {"reason": "Unschedulable"}},
                                     phase="Pending")
                    else:
                        self.put_pod(rt, index, uid=f"uid-{JOB}-{rt}-{index}-{next(self.rv)}",
                                     node=node)

    def schedule(self, template: dict) -> str | None:
        """The scheduler's filter for what the scaler sets: the first of ``nodes`` that
        satisfies the template's required node affinity (terms ORed; ``In``/``NotIn``
        expressions on the hostname ANDed), or None."""
        required = ((((template.get("spec") or {}).get("affinity") or {}).get("nodeAffinity")
                     or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
        terms = required.get("nodeSelectorTerms")

        def fits(node, term):
            for e in term.get("matchExpressions") or []:
                assert e["key"] == "kubernetes.io/hostname", e
                if (e["operator"] == "NotIn") == (node in e["values"]):
                    return False
            return True
        return next((n for n in self.nodes if not terms or any(fits(n, t) for t in terms)), None)

    def _operator_delete(self, rt: str, index: int, name: str) -> None:
        member = naming.member_id(rt, index)
        if self.on_operator_delete is not None:
            self.on_operator_delete(member)
        self.timeline.append(("deleted", member))
        with self.cond:
            pod = self.pods.get(name)
            if pod is None:
                return
            # deletionTimestamp set, SIGTERM: a running container ends, then the pod is gone
            pod["metadata"]["deletionTimestamp"] = "2026-11-21T00:05:00Z"
            cs = pod["status"]["containerStatuses"][0]
            if "terminated" not in cs["state"]:
                cs["state"] = {"terminated": {"exitCode": 143, "reason": "Error"}}
        self._event("MODIFIED", pod)
        self.delete_pod(name)

    def mutations(self) -> list[tuple]:
        return [(r["method"], r["path"], r["body"], r["content_type"])
                for r in self.requests if r["method"] not in ("GET",)]

    def close(self):
        self.closing = True
        with self.cond:
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api():
    a = FakeKubeAPI()
    a.put_pod("chief", 0)
    for i in range(2):
        a.put_pod("ps", i)
    a.put_pod("worker", 0)
    yield a
    a.close()


@pytest.fixture(autouse=True)
def _no_threads_left():
    """Every test stops what it started: the pod watch, the fake API's threads."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra:
            return
        time.sleep(0.05)
    raise AssertionError(f"threads left behind: {[t.name for t in extra]}")


def _scaler(api: FakeKubeAPI, **kw) -> KubernetesScaler:
    cfg = client.Configuration()
    cfg.host = api.url
    return KubernetesScaler(CONFIG, namespace=NS, job_name=JOB, api_client=client.ApiClient(cfg),
                            watch_timeout=2, **kw)


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out")


MERGE = "application/merge-patch+json"


def test_scale_out_patches_the_tfjob_replica_counts(api):
    s = _scaler(api)
    try:
        assert {n.id: n.state for n in s.nodes()} == {
            "worker-0": NodeState.RUNNING, "ps-0": NodeState.RUNNING, "ps-1": NodeState.RUNNING,
            "worker-1": NodeState.RUNNING}
        # the AIMaster's first call (PS up, workers later) adopts the operator's pods
        assert s.apply(ScalePlan(ps=2, workers=0)).stopped == ()
        assert api.mutations() == []
        r = s.apply(ScalePlan(ps=3))
        assert r.started == ("ps-2",) and r.stopped == ()
        assert api.mutations() == [
            ("PATCH", TFJOB_PATH, {"spec": {"tfReplicaSpecs": {"PS": {"replicas": 3}}}}, MERGE)]
        r = s.apply(ScalePlan(workers=4))  # worker-0 is the chief: 3 Worker pods
        assert r.started == ("worker-2", "worker-3")
        assert api.mutations()[1:] == [
            ("PATCH", TFJOB_PATH, {"spec": {"tfReplicaSpecs": {"Worker": {"replicas": 3}}}}, MERGE)]
        assert api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["replicas"] == 3
        # nothing to change: no request
        s.apply(ScalePlan(ps=3, workers=4))
        assert len(api.mutations()) == 2
        # the only reads are the TFJob and the job's pods, by label
        for r in api.requests:
            if r["method"] == "GET" and r["path"] == PODS_PATH:
                assert r["query"]["labelSelector"] == f"training.kubeflow.org/job-name={JOB}"
            else:
                assert r["method"] != "GET" or r["path"] == TFJOB_PATH
    finally:
        s.shutdown()


def test_drain_then_scale_in_removes_the_highest_index(api):
    api.put_pod("ps", 2)
    api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["replicas"] = 3
    drained = []
    s = _scaler(api, drain=lambda ids: drained.append((list(ids), len(api.mutations()))))
    try:
        s.apply(ScalePlan(ps=3, workers=2))
        r = s.apply(ScalePlan(ps=2))
        assert r.stopped == ("ps-2",)
        # drained first (before any request), then the count drops, then the pod goes
        assert drained == [(["ps-2"], 0)]
        assert [m[:3] for m in api.mutations()] == [
            ("PATCH", TFJOB_PATH, {"spec": {"tfReplicaSpecs": {"PS": {"replicas": 2}}}}),
            ("DELETE", f"{PODS_PATH}/{JOB}-ps-2", None)]
        assert api.mutations()[0][3] == MERGE
        exits = _wait(s.poll_exits)
        assert [(e.id, e.state) for e in exits] == [("ps-2", NodeState.STOPPED)]
    finally:
        s.shutdown()


def test_a_drain_that_refuses_changes_nothing(api):
    class _Master:  # what drain_guard reads of the JobMaster: its routing table
        class routing:
            ps_ids = ("ps-0", "ps-1")
            epoch = 7
    s = _scaler(api, drain=drain_guard(lambda: _Master))
    try:
        s.apply(ScalePlan(ps=2, workers=2))
        with pytest.raises(ScalerError, match=r"\['ps-1'\] still own slots at routing epoch 7"):
            s.apply(ScalePlan(ps=1))
        assert api.mutations() == []
        assert api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["replicas"] == 2
        assert {n.id for n in s.nodes() if n.state == NodeState.RUNNING} >= {"ps-1"}
    finally:
        s.shutdown()


def test_pod_deletion_and_eviction_are_exits_before_any_lease(api):
    s = _scaler(api)
    try:
        s.apply(ScalePlan(ps=2, workers=2))
        assert s.poll_exits() == []
        api.delete_pod(f"{JOB}-worker-0")  # someone (a node drain) deleted worker-1's pod
        exits = _wait(s.poll_exits, timeout=3)
        assert [(e.id, e.state, e.exit_code) for e in exits] == [("worker-1", NodeState.FAILED, None)]
        # an eviction leaves a Failed pod behind
        api.put_pod("ps", 1, state={"terminated": {"exitCode": 137, "reason": "Error"}},
                    phase="Failed", reason="Evicted")
        exits = _wait(s.poll_exits, timeout=3)
        assert [(e.id, e.state, e.exit_code) for e in exits] == [("ps-1", NodeState.FAILED, 137)]
        assert s.poll_exits() == []  # each exit is reported once
        # no request was made for these: the scaler only observed
        assert api.mutations() == []
        # restarting the evicted-for-good worker deletes its pod so the operator re-creates it
        api.put_pod("worker", 0, state={"terminated": {"exitCode": 1}}, phase="Failed", uid="uid-2")
        _wait(s.poll_exits)
        s.restart("worker-1")
        assert [m[:3] for m in api.mutations()] == [("DELETE", f"{PODS_PATH}/{JOB}-worker-0", None)]
    finally:
        s.shutdown()


def test_namespace_and_job_name_come_from_the_pod_environment(api, monkeypatch):
    cfg = client.Configuration()
    cfg.host = api.url
    monkeypatch.setenv("DEEPREC_K8S_NAMESPACE", NS)
    monkeypatch.setenv("DEEPREC_TFJOB_NAME", JOB)
    s = create_scaler("kubernetes", config=CONFIG, api_client=client.ApiClient(cfg), watch_timeout=2)
    try:
        assert (s.namespace, s.job_name) == (NS, JOB)
        assert api.requests[0]["path"] == TFJOB_PATH
    finally:
        s.shutdown()
    monkeypatch.delenv("DEEPREC_TFJOB_NAME")
    with pytest.raises(ScalerError, match="DEEPREC_TFJOB_NAME"):
        create_scaler("kubernetes", config=CONFIG, api_client=client.ApiClient(cfg))


def test_a_missing_tfjob_is_a_clear_error(api):
    cfg = client.Configuration()
    cfg.host = api.url
    with pytest.raises(ScalerError, match="read TFJob nope: Kubernetes API 404"):
        KubernetesScaler(CONFIG, namespace=NS, job_name="nope", api_client=client.ApiClient(cfg))


# -- scale-in against the operator's real deletion: drain the leavers, then lower the count ----
SLOTS = 12


class _Job:
    """The part of the AIMaster that ``drain_guard`` reads (``routing``, ``registry``,
    ``shards``), plus what a drain does: the scale event moves a leaving PS's slots to the PS
    that stay; a leaving worker finishes its step, hands its shard back with its progress,
    deregisters and exits. ``check`` runs when the operator deletes a pod and records what the
    member still owned at that moment: anything there is lost."""

    def __init__(self, api: FakeKubeAPI, ps_ids: list[str], workers: list[str]):
        self.api = api
        self.registry = Registry(lease_seconds=3600)
        for i, p in enumerate(ps_ids):
            self.registry.register("ps", p, 1, f"10.0.0.{i + 1}:2222")
        for w in workers:
            self.registry.register("worker", w, 1, "")
        self.ps_ids = list(ps_ids)
        self.epoch = 1
        self.owner = {s: ps_ids[s % len(ps_ids)] for s in range(SLOTS)}
        self.rows = {s: 1000 + s for s in range(SLOTS)}   # they travel with their slot
        self.shards = ShardQueue([Shard(i, "/data/train-0.txt", 100 * i, 100 * (i + 1))
                                  for i in range(2 * len(workers))])
        self.held = {w: self.shards.assign(w)[1] for w in workers}
        self.lost: list[tuple[str, list]] = []
        api.on_operator_delete = self.check

    @property
    def routing(self):
        return SimpleNamespace(ps_ids=tuple(self.ps_ids), epoch=self.epoch)

    def owns(self, member: str) -> list:
        if member.startswith("ps-"):
            slots = sorted(s for s, o in self.owner.items() if o == member)
            return slots or (["in routing"] if member in self.ps_ids else [])
        doing = self.shards.to_state()["doing"]
        held = sorted(int(s) for s, w in doing.items() if w == member)
        m = self.registry.get(member)
        return held or (["registered"] if m is not None and m.state == MemberState.RUNNING else [])

    def check(self, member: str) -> None:
        if self.owns(member):
            self.lost.append((member, self.owns(member)))

    def migrate_off(self, leaving: list[str]) -> None:
        self.api.timeline.append(("drained", tuple(leaving)))
        stay = [p for p in self.ps_ids if p not in leaving]
        moved = [s for s in sorted(self.owner) if self.owner[s] in leaving]
        for k, slot in enumerate(moved):
            self.owner[slot] = stay[k % len(stay)]
        self.ps_ids, self.epoch = stay, self.epoch + 1
        for p in leaving:
            self.registry.mark(p, MemberState.LEFT)

    def worker_leaves(self, w: str, trained: int = 40) -> None:
        self.api.timeline.append(("drained", (w,)))
        shard = self.held.pop(w)
        # the position where its untrained records begin: ``trained`` bytes in
        self.shards.give_back(w, [shard.shard_id], {shard.shard_id: shard.start + trained})
        self.registry.mark(w, MemberState.LEFT)
        rt, index = naming.replica_of(w)
        self.api.put_pod(rt, index, state={"terminated": {"exitCode": 0, "reason": "Completed"}},
                         phase="Succeeded")


def _operator_api(ps: int, workers: int) -> FakeKubeAPI:
    """A running TFJob: Chief (worker-0), ``ps`` PS pods, ``workers`` Worker pods."""
    a = FakeKubeAPI(ps=ps, workers=workers, operator=True)
    a.put_pod("chief", 0)
    for i in range(ps):
        a.put_pod("ps", i)
    for i in range(workers):
        a.put_pod("worker", i)
    return a


def _running(s: KubernetesScaler) -> set[str]:
    return {n.id for n in s.nodes() if n.state == NodeState.RUNNING}


def test_leavers_are_the_highest_indices_and_what_apply_removes(api):
    s = _scaler(api)
    try:
        # before the first apply adopts the operator's pods, nothing would be removed
        assert s.leavers("ps", 0) == [] and s.leavers("worker", 0) == []
        s.apply(ScalePlan(ps=2, workers=2))       # PS 2, Worker 1 (worker-0 is the chief)
        assert s.leavers("ps", 2) == [] and s.leavers("ps", 5) == []
        assert s.leavers("ps", 1) == ["ps-1"]
        assert s.leavers("ps", 0) == ["ps-0", "ps-1"]
        assert s.leavers("worker", 2) == []
        assert s.leavers("worker", 1) == ["worker-1"]
        assert s.leavers("worker", 0) == ["worker-1"]   # the chief's container stays
        with pytest.raises(ValueError):
            s.leavers("chief", 0)
        assert s.apply(ScalePlan(workers=4)).started == ("worker-2", "worker-3")
        assert s.leavers("worker", 2) == ["worker-2", "worker-3"]   # Worker pods 1, 2
        assert s.apply(ScalePlan(workers=2)).stopped == ("worker-2", "worker-3")
        assert s.apply(ScalePlan(ps=1)).stopped == ("ps-1",)
    finally:
        s.shutdown()
    s = _scaler(api, chief_is_worker=False)   # a PS-only chief: every worker is a Worker pod
    try:
        s.apply(ScalePlan(ps=1, workers=1))
        assert s.leavers("worker", 1) == [] and s.leavers("worker", 0) == ["worker-1"]
    finally:
        s.shutdown()


def test_a_drained_scale_in_loses_nothing_when_the_operator_deletes_at_once():
    api = _operator_api(ps=3, workers=2)
    job = _Job(api, ["ps-0", "ps-1", "ps-2"], ["worker-0", "worker-1", "worker-2"])
    s = _scaler(api, drain=drain_guard(lambda: job))
    try:
        s.apply(ScalePlan(ps=3, workers=3))
        assert api.mutations() == []
        rows = sum(job.rows.values())

        # PS 3 -> 2: the operator will delete index 2; the AIMaster migrates exactly that one
        leaving = s.leavers("ps", 2)
        assert leaving == ["ps-2"]
        job.migrate_off(leaving)
        assert s.apply(ScalePlan(ps=2)).stopped == ("ps-2",)
        assert api.timeline == [("drained", ("ps-2",)),
                                ("patch", {"spec": {"tfReplicaSpecs": {"PS": {"replicas": 2}}}}),
                                ("deleted", "ps-2")]
        assert f"{JOB}-ps-2" not in api.pods and job.lost == []
        exits = _wait(s.poll_exits)
        assert [(e.id, e.state) for e in exits] == [("ps-2", NodeState.STOPPED)]

        # workers 3 -> 2: Worker pod 1 (worker-2) goes; it finishes its step, hands its
        # shard back with its progress and exits 0 before the count drops
        api.timeline.clear()
        leaving = s.leavers("worker", 2)
        assert leaving == ["worker-2"]
        shard = job.held["worker-2"]
        job.worker_leaves("worker-2", trained=40)
        _wait(lambda: any(n.id == "worker-2" and n.state == NodeState.SUCCEEDED for n in s.nodes()))
        assert s.apply(ScalePlan(workers=2)).stopped == ("worker-2",)
        assert api.timeline == [
            ("drained", ("worker-2",)),
            ("patch", {"spec": {"tfReplicaSpecs": {"Worker": {"replicas": 1}}}}),
            ("deleted", "worker-2")]
        assert f"{JOB}-worker-1" not in api.pods and job.lost == []

        # nothing lost: every slot (and its rows) on a PS that is still running, and the
        # returned shard is handed out again from where worker-2 stopped
        assert set(job.owner.values()) == {"ps-0", "ps-1"} and sum(job.rows.values()) == rows
        _wait(lambda: {"ps-0", "ps-1", "worker-0", "worker-1"} <= _running(s))
        assert job.shards.complete("worker-1", [job.held["worker-1"].shard_id])
        state, again = job.shards.assign("worker-1")
        assert (again.shard_id, again.start, again.end) == (shard.shard_id, shard.start + 40, shard.end)
        assert api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["replicas"] == 2
        assert api.tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 1
    finally:
        s.shutdown()
        api.close()


def test_lowering_replicas_first_is_refused_before_the_operator_deletes_an_owner():
    api = _operator_api(ps=3, workers=2)
    job = _Job(api, ["ps-0", "ps-1", "ps-2"], ["worker-0", "worker-1", "worker-2"])
    s = _scaler(api, drain=drain_guard(lambda: job))
    try:
        s.apply(ScalePlan(ps=3, workers=3))
        with pytest.raises(ScalerError, match=r"\['ps-2'\] still own slots at routing epoch 1"):
            s.apply(ScalePlan(ps=2))
        with pytest.raises(ScalerError, match=r"worker-2 holds shards \[2\]"):
            s.apply(ScalePlan(workers=2))
        # its shard done but the worker not gone: it would lose the step it is in
        job.shards.complete("worker-2", [job.held["worker-2"].shard_id])
        with pytest.raises(ScalerError, match="worker-2 is still registered"):
            s.apply(ScalePlan(workers=2))
        with pytest.raises(ScalerError, match=r"\['ps-1', 'ps-2'\] still own.*worker-1 holds"):
            s.apply(ScalePlan(ps=1, workers=1))
        # refused before any request: the operator had nothing to act on
        assert api.mutations() == [] and api.timeline == [] and job.lost == []
        assert api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["replicas"] == 3
        assert api.tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 2
        assert _running(s) == {"ps-0", "ps-1", "ps-2", "worker-0", "worker-1", "worker-2"}
    finally:
        s.shutdown()
    # the same call without the check: the operator deletes ps-2 with its slots, at once
    s = _scaler(api)
    try:
        s.apply(ScalePlan(ps=3, workers=3))
        s.apply(ScalePlan(ps=2))
        assert job.lost == [("ps-2", [2, 5, 8, 11])]
        assert f"{JOB}-ps-2" not in api.pods
    finally:
        s.shutdown()
        api.close()


def test_the_leavers_are_the_operators_victims_even_with_a_gap_in_the_routing():
    """ps-1 died and its re-created pod has not joined yet: the routing is ps-0, ps-2, ps-3.
    Keeping the two lowest routed ids (ps-0, ps-2) is not what the operator does at
    replicas=2: it deletes indices 2 and 3. Draining only ps-3 is refused; draining the
    leavers loses nothing."""
    api = _operator_api(ps=4, workers=0)
    job = _Job(api, ["ps-0", "ps-2", "ps-3"], ["worker-0"])
    job.registry.register("ps", "ps-1", 1, "10.0.0.9:2222")
    s = _scaler(api, drain=drain_guard(lambda: job))
    try:
        s.apply(ScalePlan(ps=4, workers=1))
        keep = sorted(job.ps_ids, key=lambda i: int(i.rsplit("-", 1)[1]))[:2]
        job.migrate_off([p for p in job.ps_ids if p not in keep])   # ps-3 only
        with pytest.raises(ScalerError, match=r"\['ps-2'\] still own slots"):
            s.apply(ScalePlan(ps=2))
        assert api.mutations() == [] and job.lost == []

        leaving = s.leavers("ps", 2)
        assert leaving == ["ps-2", "ps-3"]
        job.migrate_off([p for p in leaving if p in job.ps_ids])
        assert s.apply(ScalePlan(ps=2)).stopped == ("ps-2", "ps-3")
        assert [e for e in api.timeline if e[0] == "deleted"] == [("deleted", "ps-2"), ("deleted", "ps-3")]
        assert job.lost == [] and set(job.owner.values()) == {"ps-0"}
        assert f"{JOB}-ps-1" in api.pods and f"{JOB}-ps-0" in api.pods
    finally:
        s.shutdown()
        api.close()


def test_local_scaler_leavers_are_the_live_nodes_it_stops(tmp_path):
    cfg = parse_job({"name": "loc", "ps": {"replicas": 1},
                     "worker": {"replicas": 3, "command": ["{python}", "-c", "import time; time.sleep(60)"]}})
    s = LocalProcessScaler("127.0.0.1:1", cfg, str(tmp_path / "logs"))
    try:
        s.apply(ScalePlan(workers=4))
        assert s.leavers("worker", 4) == [] and s.leavers("worker", 2) == ["worker-2", "worker-3"]
        s.kill("worker-2")          # gone: the next live one by index leaves instead
        _wait(lambda: any(n.id == "worker-2" and n.state != NodeState.RUNNING for n in s.nodes()))
        assert s.leavers("worker", 2) == ["worker-3"]
        assert s.apply(ScalePlan(workers=2)).stopped == ("worker-3",)
        assert s.leavers("worker", 1) == ["worker-1"]
    finally:
        s.shutdown(timeout=5)
    assert all(n.state != NodeState.RUNNING for n in s.nodes())


# -- a straggler's replacement: the new pod avoids the slow pod's node ---------------------------
def test_avoiding_adds_a_not_in_to_every_term_and_keeps_the_users_affinity():
    from aimaster.scaler.kubernetes import _avoiding
    assert _avoiding(None, "n1") == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}]}]}}}
    user = {"podAntiAffinity": {"x": 1}, "nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}],
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]},
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                   "values": ["n0"]}]}]}}}
    out = _avoiding(user, "n1")
    assert out["podAntiAffinity"] == {"x": 1}
    assert out["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [{"weight": 1}]
    terms = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"] == [
        {"key": "pool", "operator": "In", "values": ["gpu"]},
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1"]}]
    assert terms[1]["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n0", "n1"]}]
    assert _avoiding(out, "n1") == out                  # once per node
    assert "nodeAffinity" not in user["podAntiAffinity"] and len(user["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"]) == 1                         # the input is not changed


def test_a_replacement_pod_avoids_the_slow_node_and_the_slow_member_retires_in_place():
    api = FakeKubeAPI(ps=2, workers=1, operator=True)
    api.put_pod("chief", 0, node="node-a")
    api.put_pod("ps", 0, node="node-b")
    api.put_pod("ps", 1, node="node-a")          # the slow PS
    api.put_pod("worker", 0, node="node-b")      # worker-1, slow too (later)
    api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"] = {"spec": {"containers": [{"name": "tensorflow"}]}}
    s = _scaler(api)
    try:
        s.apply(ScalePlan(ps=2, workers=2))
        assert s.start_replacement("ps", "ps-1", 3).started == ("ps-2",)
        # one patch: the count and the template's required node affinity together (the
        # operator creates the pod from it); the user's template is kept
        patch = api.mutations()[0][2]["spec"]["tfReplicaSpecs"]["PS"]
        assert patch["replicas"] == 3
        assert patch["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                   "values": ["node-a"]}]}]
        assert api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"] == [
            {"name": "tensorflow"}]
        assert api.pods[f"{JOB}-ps-2"]["spec"]["nodeName"] == "node-b"   # not node-a
        _wait(lambda: "ps-2" in _running(s))

        # the slow PS owns nothing now and was told to stop: retired in place, no delete
        # (the operator would re-create a missing index), its pod completes
        n = len(api.mutations())
        assert s.retire_refusal("ps-1") is None and "Chief" in s.retire_refusal("worker-0")
        s.retire("ps-1")
        assert len(api.mutations()) == n
        api.put_pod("ps", 1, state={"terminated": {"exitCode": 0, "reason": "Completed"}},
                    phase="Succeeded")
        assert [(e.id, e.state) for e in _wait(s.poll_exits)] == [("ps-1", NodeState.STOPPED)]
        assert f"{JOB}-ps-1" in api.pods                 # the operator left it completed
        # two PS run: the count keeps the retired index; a scale-out adds after it, a
        # scale-in removes the highest indices (the retired one's pod goes with its index)
        assert s.apply(ScalePlan(ps=2)).stopped == () and len(api.mutations()) == n
        again = _scaler(api)      # an AIMaster restarted: the completed pod tells it
        try:
            assert again.apply(ScalePlan(ps=2, workers=2)) == s.apply(ScalePlan(ps=2))
            assert len(api.mutations()) == n     # no patch: it runs 2 PS with replicas 3
            assert again.leavers("ps", 1) == ["ps-1", "ps-2"]
        finally:
            again.shutdown()
        assert s.leavers("ps", 1) == ["ps-1", "ps-2"]     # the completed pod goes too
        assert s.apply(ScalePlan(ps=3)).started == ("ps-3",)
        assert api.tfjob["spec"]["tfReplicaSpecs"]["PS"]["replicas"] == 4
        assert api.pods[f"{JOB}-ps-3"]["spec"]["nodeName"] == "node-b"   # node-a still avoided
        assert s.apply(ScalePlan(ps=1)).stopped == ("ps-1", "ps-2", "ps-3")
        assert sorted(p for p in api.pods if "-ps-" in p) == [f"{JOB}-ps-0"]
        assert s.apply(ScalePlan(ps=2)).started == ("ps-1",)   # index 1 is an ordinary one again

        # a worker: the Worker template avoids its node (node-b): only node-a and node-c are left
        assert s.start_replacement("worker", "worker-1", 3).started == ("worker-2",)
        assert api.pods[f"{JOB}-worker-1"]["spec"]["nodeName"] == "node-a"
        _wait(lambda: "worker-2" in _running(s))          # the scaler saw where it runs
        api.nodes = ["node-b"]                            # only the slow node has room
        assert s.start_replacement("worker", "worker-2", 4).started == ("worker-3",)
        pending = api.pods[f"{JOB}-worker-2"]
        assert pending["status"]["phase"] == "Pending" and "spec" not in pending  # no node
        worker_terms = api.tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"][
            "affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert worker_terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [
            "node-b", "node-a"]
    finally:
        s.shutdown()
        api.close()
