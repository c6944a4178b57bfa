"""Access control: the job token on every RPC of the AIMaster and the PS, TLS when
certificates are mounted, and local runs on loopback only. Real `aimaster run` jobs."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys

import grpc
import numpy as np
import psutil
import pytest

from deeprec_ext import auth
from deeprec_ext.proto import master_pb2, master_pb2_grpc, ps_pb2, ps_pb2_grpc
from tests.conftest import ROOT, wait_for

TOKEN = "s3cr3t-job-token-0123456789abcdef"
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def _cli(*args, env=None, timeout=60):
    e = {k: v for k, v in os.environ.items() if not k.startswith("DEEPREC_")}
    e.update(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=e)


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


@pytest.fixture
def clean_auth_env(monkeypatch):
    """The test process itself starts without access-control settings."""
    for k in (auth.TOKEN_FILE_ENV, auth.TLS_DIR_ENV, auth.TLS_SERVER_NAME_ENV):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _status(address, token_file, extra_env=None):
    out = _cli("aimaster.cli", "status", "--master", address, "--json", "--token-file", token_file,
               env=extra_env)
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout)


def _running(address, token_file, n_ps, extra_env=None):
    def ready():
        st = _status(address, token_file, extra_env)
        live = [m for m in st["members"] if m["role"] == "ps" and m["state"] == "running"]
        return st if st["phase"] == "running" and len(live) == n_ps else None
    return wait_for(ready, 90, f"{n_ps} PS running")


def test_every_rpc_needs_the_job_token_and_a_refused_call_changes_nothing(
        start_job, token_file, clean_auth_env):
    job = start_job({"name": "auth", "ps": {"replicas": 2}}, ["--token-file", token_file])
    st = _running(job.address, token_file, 2)
    ps_addresses = [m["address"] for m in st["members"] if m["role"] == "ps"]

    # --- AIMaster: no token, wrong token --------------------------------------------------
    with grpc.insecure_channel(job.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Status(master_pb2.StatusRequest(), timeout=10, metadata=md)
            assert e.value.code() == UNAUTH
        with pytest.raises(grpc.RpcError) as e:
            stub.Scale(master_pb2.ScaleRequest(ps=3, timeout_seconds=30), timeout=30)
        assert e.value.code() == UNAUTH and "no job token" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(master_pb2.RegisterRequest(role="ps", id="ps-9", pid=1,
                                                     address="127.0.0.1:1"), timeout=10)
        assert e.value.code() == UNAUTH
        with pytest.raises(grpc.RpcError) as e:
            stub.Scale(master_pb2.ScaleRequest(ps=3, timeout_seconds=30), timeout=30,
                       metadata=(("authorization", "Bearer wrong"),))
        assert e.value.code() == UNAUTH and "wrong job token" in e.value.details()
    after = _status(job.address, token_file)
    assert [m["id"] for m in after["members"]] == [m["id"] for m in st["members"]]  # no ps-9
    assert after["epoch"] == st["epoch"] and not [e for e in after["events"] if e["kind"] == "scale"]

    # --- PS: the data plane, control plane and streams --------------------------------------
    clean_auth_env.setenv(auth.TOKEN_FILE_ENV, token_file)
    from deeprec_ext import PSClient
    client = PSClient.connect(job.address, timeout=30)
    try:
        client.create_table("t", dim=4, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
        ids = np.arange(64, dtype=np.int64)
        before = client.lookup("t", ids)
        for address in ps_addresses:
            with grpc.insecure_channel(address) as ch:
                stub = ps_pb2_grpc.ParameterServerStub(ch)
                calls = [
                    lambda: stub.Push(ps_pb2.PushRequest(tables=[ps_pb2.TableUpdate(
                        table="t", ids=ids.tobytes(), values=np.ones((64, 4), "<f4").tobytes())]),
                        timeout=10),
                    lambda: stub.CreateTable(ps_pb2.CreateTableRequest(
                        config=ps_pb2.TableConfig(name="evil", dim=2)), timeout=10),
                    lambda: stub.Stats(ps_pb2.StatsRequest(), timeout=10),
                    lambda: stub.ImportRows(iter([ps_pb2.RowBatch()]), timeout=10),  # a stream
                ]
                for call in calls:
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == UNAUTH, e.value
        np.testing.assert_array_equal(client.lookup("t", ids), before)  # the pushes did nothing
        with grpc.insecure_channel(ps_addresses[0]) as ch:  # with the token: answered
            stub = ps_pb2_grpc.ParameterServerStub(ch)
            names = [t.name for t in stub.ListTables(ps_pb2.ListTablesRequest(), timeout=10,
                                                     metadata=(("authorization", f"Bearer {TOKEN}"),)).tables]
            assert names == ["t"]  # no "evil" table
        client.push("t", ids, np.ones((64, 4), np.float32))
        np.testing.assert_allclose(client.lookup("t", ids), before - 1.0)
    finally:
        client.close()

    # --- CLIs: a clear message without the token ----------------------------------------
    for args in (("aimaster.cli", "status", "--master", job.address),
                 ("aimaster.cli", "scale", "--master", job.address, "--ps", "3"),
                 ("gazer.cli", "dump", "--master", job.address)):
        out = _cli(*args)
        assert out.returncode == 1, out
        assert "UNAUTHENTICATED" in out.stderr and "--token-file" in out.stderr, out.stderr
    out = _cli("gazer.cli", "dump", "--master", job.address, "--token-file", token_file)
    assert out.returncode == 0 and "phase running" in out.stdout, out.stderr
    out = _cli("aimaster.cli", "status", "--master", job.address,
               env={auth.TOKEN_FILE_ENV: token_file})  # the env var works as well
    assert out.returncode == 0, out.stderr

    # --- local runs listen on loopback only ----------------------------------------------
    pids = [job.proc.pid] + [m["pid"] for m in after["members"] if m["role"] == "ps"]
    for pid in pids:
        listening = [c.laddr for c in psutil.Process(pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(auth.is_loopback(a.ip) for a in listening), (pid, listening)


def test_bad_token_files_and_non_loopback_hosts_are_refused_at_start(tmp_path, clean_auth_env):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: x\nmaster: {{state_dir: {tmp_path / 'st'}}}\n")
    out = _cli("aimaster.cli", "run", str(job), "--token-file", str(empty))
    assert out.returncode == 2 and f"token file {empty} is empty" in out.stderr, out.stderr
    out = _cli("aimaster.cli", "run", str(job), "--token-file", str(tmp_path / "nope"))
    assert out.returncode == 2 and "cannot read token file" in out.stderr
    job.write_text(f"name: x\nmaster: {{host: 0.0.0.0, state_dir: {tmp_path / 'st'}}}\n")
    out = _cli("aimaster.cli", "run", str(job))
    assert out.returncode == 2 and "local runs listen on loopback only" in out.stderr, out.stderr
    assert not (tmp_path / "st" / "master.addr").exists()
    out = _cli("aimaster.cli", "status", "--master", "127.0.0.1:1", "--token-file", str(empty))
    assert out.returncode == 2 and "is empty" in out.stderr


def _self_signed(tmp_path, name="deeprec", subdir="tls"):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    d = tmp_path / subdir
    d.mkdir()
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (d / "tls.crt").write_bytes(pem)
    (d / "ca.crt").write_bytes(pem)  # self-signed: its own CA
    (d / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                  serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return d


def test_tls_when_certificates_are_mounted(start_job, tmp_path, token_file, clean_auth_env):
    tls = _self_signed(tmp_path)
    job = start_job({"name": "tls", "ps": {"replicas": 2},
                     "security": {"token_file": token_file, "tls_dir": str(tls)}})
    env = {auth.TLS_DIR_ENV: str(tls)}
    # the PS registered and got routing over TLS, with the token: the job runs
    _running(job.address, token_file, 2, env)
    # a plaintext client cannot talk to it at all
    out = _cli("aimaster.cli", "status", "--master", job.address, "--token-file", token_file,
               "--timeout", "3")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr, out.stderr
    # a TLS client that trusts another CA is refused too
    other = _self_signed(tmp_path, subdir="other-ca")
    out = _cli("aimaster.cli", "status", "--master", job.address, "--token-file", token_file,
               "--timeout", "3", env={auth.TLS_DIR_ENV: str(other)})
    assert out.returncode == 1, out.stdout
    # TLS without the token is still refused
    out = _cli("aimaster.cli", "status", "--master", job.address, env=env)
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr, out.stderr
    # the data plane works over TLS
    clean_auth_env.setenv(auth.TOKEN_FILE_ENV, token_file)
    clean_auth_env.setenv(auth.TLS_DIR_ENV, str(tls))
    from deeprec_ext import PSClient
    client = PSClient.connect(job.address, timeout=30)
    try:
        client.create_table("t", dim=2, initializer="zeros",
                            optimizer={"name": "sgd", "learning_rate": 1.0})
        ids = np.arange(10, dtype=np.int64)
        client.push("t", ids, np.ones((10, 2), np.float32))
        np.testing.assert_allclose(client.lookup("t", ids), -np.ones((10, 2)))
    finally:
        client.close()
