"""`aimaster manifest`: the rendered TFJob, RBAC and job ConfigMap, their validation
(CRD schema, Kubernetes pod-template schemas, the operator's webhook rules) and `--check`."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import yaml

from aimaster.config import parse_job
from tests.conftest import ROOT
from tfjob_crd import validate
from tfjob_crd.render import ManifestError, RUN_AS, dump, parse_plan, render, render_file

CRD = validate.find_crd()
needs_crd = pytest.mark.skipif(CRD is None, reason="TFJob CRD schema kubeflow.org_tfjobs.v1.9.0.yaml "
                               "not found (../shared/schemas or $DEEPREC_TFJOB_CRD): CRD checks skipped")
JOB = {"name": "ctr", "ps": {"replicas": 2, "max_replicas": 8, "env": {"DEEPREC_LOG_LEVEL": "INFO"}},
       "worker": {"replicas": 3, "command": ["{python}", "-m", "examples.criteo.train"], "max_restarts": 2},
       "data": {"files": ["/data/criteo/train-*.txt"]},
       "kubernetes": {"image": "registry.example/deeprec:0.1", "namespace": "team-a",
                      "data_pvc": "criteo", "tls_secret": "ctr-tls"}}
ESTIMATE = {"tables": [], "plan": {"ps": {"replicas": 4, "memory_bytes": 3 * 2**30 + 1, "cpu": 1.5},
                                   "worker": {"replicas": 5, "memory_bytes": 2**31, "cpu": 2.0}}}


def _cli(*args, timeout=60):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "aimaster.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _docs(job=JOB, plan=None):
    return render(parse_job(job), job, parse_plan(plan) if plan else None)


def _by_kind(docs):
    return {d["kind"]: d for d in docs}


def _envs(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@needs_crd
def test_rendered_documents_pass_every_validation_layer():
    for job in (JOB, {**JOB, "worker": {"replicas": 0}}, {"name": "tiny", "kubernetes": {"image": "i"}}):
        problems, notes = validate.validate_documents(_docs(job, ESTIMATE if job is JOB else None),
                                                      require_crd=True)
        assert problems == [] and notes == []


def test_tfjob_layout_env_resources_and_grace():
    k = _by_kind(_docs(JOB, ESTIMATE))
    tf = k["TFJob"]
    assert tf["apiVersion"] == "kubeflow.org/v1" and tf["metadata"]["namespace"] == "team-a"
    specs = tf["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "PS", "Worker"}
    assert (specs["Chief"]["replicas"], specs["PS"]["replicas"], specs["Worker"]["replicas"]) == (1, 4, 4)
    chief = specs["Chief"]["template"]["spec"]
    assert [c["name"] for c in chief["containers"]] == ["tensorflow", "aimaster"]
    tf_c, am = chief["containers"]
    assert tf_c["command"][:4] == ["python", "-m", "tfjob_crd.entrypoint", "--"]
    assert tf_c["command"][4:] == ["{python}", "-m", "examples.criteo.train"]
    assert am["command"] == ["aimaster", "run", "/etc/deeprec/job/job.yaml", "--scaler", "kubernetes"]
    # every process finds the AIMaster; the sidecar knows its namespace and TFJob from the pod
    for spec in (chief, specs["PS"]["template"]["spec"], specs["Worker"]["template"]["spec"]):
        for c in spec["containers"]:
            env = _envs(c)
            assert env["DEEPREC_MASTER_ADDR"] == "ctr-chief-0:50051"
            assert env["DEEPREC_TOKEN_FILE"] == "/etc/deeprec/token/token"  # a file, not the secret
            assert env["DEEPREC_TLS_DIR"] == "/etc/deeprec/tls"
            assert c["image"] == "registry.example/deeprec:0.1"
            assert not any("token" in str(e.get("value", "")).lower() and "/" not in str(e.get("value"))
                           for e in c["env"])
        assert spec["securityContext"]["runAsUser"] == RUN_AS
    assert _envs(am)["DEEPREC_K8S_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert _envs(am)["DEEPREC_TFJOB_NAME"] == {
        "fieldRef": {"fieldPath": "metadata.labels['training.kubeflow.org/job-name']"}}
    # only the chief talks to the Kubernetes API
    assert chief["serviceAccountName"] == "ctr-aimaster" and chief["automountServiceAccountToken"]
    ps = specs["PS"]["template"]["spec"]
    assert ps["automountServiceAccountToken"] is False and "serviceAccountName" not in ps
    ps_c = ps["containers"][0]
    assert ps_c["command"][4:] == ["python", "-m", "deeprec_ext.ps"]
    assert _envs(ps_c)["DEEPREC_PS_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert _envs(ps_c)["DEEPREC_LOG_LEVEL"] == "INFO"  # ps.env
    assert _envs(ps_c)["DEEPREC_PS_MEMORY_LIMIT_MB"] == str(3 * 1024 + 1)
    # resources from the plan: requests = limits (Guaranteed QoS), rounded up
    assert ps_c["resources"] == {"requests": {"cpu": "1500m", "memory": "3073Mi"},
                                 "limits": {"cpu": "1500m", "memory": "3073Mi"}}
    wk = specs["Worker"]["template"]["spec"]["containers"][0]
    assert wk["resources"]["limits"] == {"cpu": "2000m", "memory": "2048Mi"}
    assert tf_c["resources"] == wk["resources"]  # the chief worker is a worker
    # preemption-friendly grace: enough for a PS hand-off, within a spot notice
    assert ps["terminationGracePeriodSeconds"] == 30
    assert chief["terminationGracePeriodSeconds"] == 45
    assert tf["spec"]["enableDynamicWorker"] is True
    vols = {v["name"]: v for v in chief["volumes"]}
    assert vols["job-token"]["secret"]["secretName"] == "ctr-token"
    assert vols["job-tls"]["secret"]["secretName"] == "ctr-tls"
    assert vols["data"]["persistentVolumeClaim"]["claimName"] == "criteo"
    assert vols["job-config"]["configMap"]["name"] == "ctr-job"


def test_rbac_is_minimal_and_bound_to_the_aimaster():
    k = _by_kind(_docs())
    assert k["Role"]["rules"] == [
        {"apiGroups": ["kubeflow.org"], "resources": ["tfjobs"], "resourceNames": ["ctr"],
         "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]}]
    assert k["RoleBinding"]["roleRef"]["name"] == k["Role"]["metadata"]["name"]
    assert k["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "ctr-aimaster",
                                             "namespace": "team-a"}]
    assert k["ServiceAccount"]["metadata"]["name"] == "ctr-aimaster"
    assert "Secret" not in k  # the token is created by the user, never printed


def test_job_configmap_is_a_valid_job_for_the_pod():
    k = _by_kind(_docs(JOB, ESTIMATE))
    cfg = parse_job(yaml.safe_load(k["ConfigMap"]["data"]["job.yaml"]))
    assert (cfg.host, cfg.port, cfg.state_dir) == ("0.0.0.0", 50051, "/data/runs/ctr")
    assert (cfg.ps.replicas, cfg.worker.replicas) == (4, 5)
    assert cfg.security.token_file == "/etc/deeprec/token/token"
    assert cfg.security.tls_dir == "/etc/deeprec/tls"


def test_plan_file_forms_and_errors(tmp_path):
    whole = tmp_path / "estimate.json"
    whole.write_text(json.dumps(ESTIMATE))
    only = tmp_path / "plan.json"
    only.write_text(json.dumps(ESTIMATE["plan"]))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    a = render_file(str(job), str(whole))
    b = render_file(str(job), str(only))
    assert a == b and a[-1]["spec"]["tfReplicaSpecs"]["PS"]["replicas"] == 4
    for bad, msg in (({"plan": {"ps": {"replicas": 0}}}, "plan.ps.replicas: expected an integer >= 1"),
                     ({"ps": {"memory_bytes": -5}}, "plan.ps.memory_bytes: expected a positive number"),
                     ({"ps": {"replicas": 99}}, r"plan.ps.replicas \(99\) is outside \[1, 8\]"),
                     ({"gpu": 1}, "expected an object with 'ps' and/or 'worker'")):
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(bad))
        with pytest.raises(ManifestError, match=msg):
            render_file(str(job), str(p))
    out_file = tmp_path / "out.yaml"
    out = _cli("manifest", str(job), "--plan", str(p), "-o", str(out_file))
    assert out.returncode == 2 and "plan:" in out.stderr and not out_file.exists()
    p.write_text("{not json")
    out = _cli("manifest", str(job), "--plan", str(p))
    assert out.returncode == 2 and "is not JSON" in out.stderr


def test_job_errors_name_the_field(tmp_path):
    for job, msg in (({**JOB, "kubernetes": {}}, "kubernetes.image: required"),
                     ({**JOB, "name": "Criteo_DeepFM"}, "name 'Criteo_DeepFM'"),
                     ({**JOB, "kubernetes": {"image": "x", "port": 2222}}, "must differ"),
                     ({**JOB, "kubernetes": {"image": "x", "imag": "y"}}, r"unknown key\(s\) \['imag'\]")):
        p = tmp_path / "job.yaml"
        p.write_text(yaml.safe_dump(job))
        out = _cli("manifest", str(p))
        assert out.returncode == 2 and msg.replace("\\", "") in out.stderr.replace("\\", ""), out.stderr


def test_cli_renders_and_checks_its_own_output(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    out = _cli("manifest", str(job), "-o", str(tmp_path / "m.yaml"))
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all((tmp_path / "m.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "TFJob"]
    assert "&id" not in (tmp_path / "m.yaml").read_text()  # no YAML anchors for kubectl users
    out = _cli("manifest", "--check", str(tmp_path / "m.yaml"))
    assert out.returncode == 0 and "valid" in out.stdout, out.stderr


def _broken(tmp_path, mutate) -> subprocess.CompletedProcess:
    """`aimaster manifest --check` on a rendered manifest changed by ``mutate``; in-process
    (the CLI's main) to keep the many cases quick."""
    import contextlib
    import io
    from aimaster.cli import main
    docs = _docs()
    tf = docs[-1]
    mutate(tf, docs)
    p = tmp_path / "broken.yaml"
    p.write_text(dump(docs))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["manifest", "--check", str(p)])
    return subprocess.CompletedProcess([], code, out.getvalue(), err.getvalue())


def test_check_enforces_the_operator_webhook_rules(tmp_path):
    cases = [
        (lambda tf, d: tf["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
         .update(name="trainer"), "Worker.template.spec.containers: must have a container named 'tensorflow'"),
        (lambda tf, d: tf["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][1]
         .pop("image"), "Chief.template.spec.containers[1].image: must be set (container 'aimaster')"),
        (lambda tf, d: tf["spec"]["tfReplicaSpecs"].update(
            Master=copy.deepcopy(tf["spec"]["tfReplicaSpecs"]["Chief"])),
         "must not have more than 1 Chief or Master role"),
        (lambda tf, d: tf["spec"]["tfReplicaSpecs"]["Chief"].update(replicas=2),
         "Chief.replicas: a TFJob has at most one Chief"),
        (lambda tf, d: tf["metadata"].update(name="Bad_Name"), "must be a DNS-1035 label"),
        (lambda tf, d: tf["spec"]["runPolicy"].update(cleanPodPolicy="Sometimes"),
         "spec.runPolicy.cleanPodPolicy: 'Sometimes' is not one of All, Running, None"),
        (lambda tf, d: tf["spec"]["tfReplicaSpecs"]["PS"].update(restartPolicy="Maybe"),
         "spec.tfReplicaSpecs.PS.restartPolicy: 'Maybe' is not one of"),
    ]
    for mutate, msg in cases:
        out = _broken(tmp_path, mutate)
        assert out.returncode == 1 and msg in out.stderr, (msg, out.stderr)


def test_check_reports_pod_template_and_rbac_schema_errors(tmp_path):
    out = _broken(tmp_path, lambda tf, d: tf["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]
                  ["containers"][0]["ports"][0].update(containerPort="grpc"))
    assert out.returncode == 1 and "tfReplicaSpecs.PS" in out.stderr and "'grpc'" in out.stderr, out.stderr
    out = _broken(tmp_path, lambda tf, d: d[1]["rules"][0].update(verbs="get"))
    assert out.returncode == 1 and "Role ctr-aimaster: rules[0].verbs" in out.stderr, out.stderr


@needs_crd
def test_check_reports_crd_schema_errors_the_api_server_would_prune_or_reject(tmp_path):
    out = _broken(tmp_path, lambda tf, d: tf["spec"]["tfReplicaSpecs"]["PS"].update(replica=3))
    assert out.returncode == 1 and "spec.tfReplicaSpecs.PS: Additional properties are not allowed " \
        "('replica' was unexpected)" in out.stderr, out.stderr
    out = _broken(tmp_path, lambda tf, d: tf["spec"]["runPolicy"].update(backoffLimit="many"))
    assert out.returncode == 1 and "spec.runPolicy.backoffLimit: 'many' is not of type 'integer'" \
        in out.stderr, out.stderr
    out = _broken(tmp_path, lambda tf, d: tf["spec"]["tfReplicaSpecs"]["PS"].update(replicas="two"))
    assert out.returncode == 1 and "spec.tfReplicaSpecs.PS.replicas: 'two' is not of type 'integer'" \
        in out.stderr, out.stderr


def test_check_of_unreadable_or_empty_files(tmp_path):
    out = _cli("manifest", "--check", str(tmp_path / "none.yaml"))
    assert out.returncode == 1 and "cannot read" in out.stderr
    (tmp_path / "e.yaml").write_text("")
    out = _cli("manifest", "--check", str(tmp_path / "e.yaml"))
    assert out.returncode == 1 and "holds no document" in out.stderr


@pytest.mark.parametrize("rtype,index,member", [("ps", "2", "ps-2"), ("worker", "2", "worker-3"),
                                                 ("chief", "0", "worker-0")])
def test_entrypoint_sets_the_member_id_and_execs(rtype, index, member):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DEEPREC_REPLICA_TYPE=rtype, DEEPREC_REPLICA_INDEX=index)
    env.pop("DEEPREC_MEMBER_ID", None)
    proc = subprocess.Popen([sys.executable, "-m", "tfjob_crd.entrypoint", "--", "{python}", "-c",
                             "import os; print(os.environ['DEEPREC_MEMBER_ID'], os.getpid())"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    got, pid = out.split()
    # exec, not a child: the member is the process the kubelet signals
    assert got == member and int(pid) == proc.pid


def test_dockerfile_runs_as_the_manifest_user():
    text = (ROOT / "Dockerfile").read_text()
    assert f"USER {RUN_AS}" in text
    assert (ROOT / ".dockerignore").exists()
