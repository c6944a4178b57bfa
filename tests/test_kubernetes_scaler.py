"""KubernetesScaler through the real ``kubernetes`` client against an in-process HTTP server
that speaks the subset of the Kubernetes API the scaler uses (TFJob get/patch, pod
list/watch/delete). The test plays the training operator: it adds and removes pods."""
from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from aimaster.config import parse_job
from aimaster.scaler import NodeState, ScalePlan, ScalerError, create_scaler
from aimaster.scaler.kubernetes import KubernetesScaler, drain_guard

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
    """Just enough of an API server; records every request."""

    def __init__(self, ps: int = 2, workers: int = 1):
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
                restarts: int = 0, uid: str | None = None, reason: str | None = None) -> dict:
        name = f"{JOB}-{rtype}-{index}"
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
