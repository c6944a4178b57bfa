"""The arithmetic of bench/scaling_model.py (no jobs run: pure functions, < 1 s)."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.scaling_model import Costs, best_ps, fit, main, predict  # noqa: E402

B = 1000
C = Costs(batch=B, w0=20e-6, wr=1e-3, k=10e-6, r=2e-3, b0=900.0, br=4000.0, rep=700.0,
          master=0.01)


def test_linear_costs_in_rpcs_per_sample():
    # q = 2 P / B: two RPCs (lookup, push) per PS per step
    assert C.q(3) == pytest.approx(0.006)
    assert C.c_w(3) == pytest.approx(20e-6 + 1e-3 * 0.006)
    assert C.c_ps(3) == pytest.approx(10e-6 + 2e-3 * 0.006)
    assert C.bytes(3) == pytest.approx(900 + 4000 * 0.006)


def test_shared_machine_one_worker_is_latency_bound():
    p = predict(C, 1, 1, cores=2, shared=True, background=0.0)
    cw, cps = 20e-6 + 2e-6, 10e-6 + 4e-6
    step = B * cw + (10e-6 * B + 2 * 2e-3)   # u = 1, no network on one machine
    assert p["bounds"]["latency"] == pytest.approx(B / step)
    assert p["bounds"]["cpu_shared"] == pytest.approx((2 - 0.02) / (cw + cps))
    assert p["bound"] == "latency" and p["samples_per_s"] == pytest.approx(B / step)


def test_shared_machine_cpu_bound_and_background():
    # 2 workers + 2 PS on 2 cores: all of the job's CPU comes out of the same 2 cores
    p = predict(C, 2, 2, cores=2, shared=True, background=0.5)
    cw, cps = C.c_w(2), C.c_ps(2)
    assert p["bound"] == "cpu_shared"
    assert p["samples_per_s"] == pytest.approx((2 - 0.5 - 0.04) / (cw + cps))
    with pytest.raises(ValueError, match="no CPU left"):
        predict(C, 1, 1, cores=2, shared=True, background=2.0)


def test_cluster_bounds():
    p = predict(C, 8, 1, cores=16, gbit=10)
    # one PS of one usable core serves everyone
    assert p["bound"] == "ps_cpu"
    assert p["samples_per_s"] == pytest.approx(1 / C.c_ps(1))
    bw = 10e9 / 8
    assert p["bounds"]["worker_nic"] == pytest.approx(8 * bw / (C.bytes(1) / 2))
    assert p["bounds"]["ps_nic"] == pytest.approx(bw / (C.bytes(1) / 2))  # no ring with 1 PS
    p4 = predict(C, 8, 4, cores=16, gbit=10)
    assert p4["bounds"]["ps_nic"] == pytest.approx(4 * bw / (C.bytes(4) / 2 + 700))
    assert p4["samples_per_s"] > p["samples_per_s"]
    # a slower network only lowers the latency and NIC bounds
    slow = predict(C, 8, 4, cores=16, gbit=0.01)
    assert slow["samples_per_s"] < p4["samples_per_s"] and slow["bound"].endswith("nic")


def test_best_ps_is_the_fewest_near_the_best():
    b = best_ps(C, 32, cores=16, gbit=25)
    allp = [predict(C, 32, p, 16, 25)["samples_per_s"] for p in range(1, 33)]
    assert b["samples_per_s"] >= 0.98 * max(allp)
    assert all(x < 0.98 * max(allp) for x in allp[:b["ps"] - 1])


def test_replication_cpu_only_with_several_ps():
    c = Costs(batch=B, w0=0, wr=0, k=10e-6, r=0, b0=0, br=0, rep_cpu=4e-6)
    assert c.c_ps(1) == pytest.approx(10e-6)
    assert c.c_ps(2) == pytest.approx(14e-6) and c.c_ps(2, replication=False) == pytest.approx(10e-6)


def test_fit_recovers_known_costs():
    truth = Costs(batch=B, w0=25e-6, wr=3e-3, k=12e-6, r=5e-4, b0=880.0, br=6000.0, rep=600.0,
                  rep_cpu=3e-6, master=0.005, u_w=1.6)
    runs = []
    for w, p, rep in ((1, 1, True), (1, 2, True), (2, 2, True), (1, 2, False)):
        rate = predict(truth, w, p, cores=8, shared=True, replication=rep)["samples_per_s"]
        runs.append({"workers": w, "ps": p, "replication": rep, "samples_per_s": rate,
                     "worker_cpu_per_sample": truth.c_w(p),
                     "ps_cpu_per_sample": truth.c_ps(p, rep), "bytes_per_sample": truth.bytes(p),
                     "rep_bytes_per_sample": 600.0 if p > 1 and rep else 0.0,
                     "master_cores": 0.005 * (w + p), "cores": 8})
    c = fit(runs, B)
    for name in ("w0", "wr", "k", "r", "b0", "br", "rep", "rep_cpu", "master", "u_w"):
        assert getattr(c, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_bad_input():
    with pytest.raises(ValueError, match="workers >= 1"):
        predict(C, 0, 1, cores=16)


def test_cli_predict_and_bad_file(tmp_path, capsys):
    from dataclasses import asdict
    good = tmp_path / "r.json"
    good.write_text(json.dumps({"costs": asdict(C)}))
    assert main(["predict", str(good), "--workers", "8", "--gbit", "10"]) == 0
    assert "<- fewest PS" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["predict", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cannot use" in err and "costs" in err
    with pytest.raises(SystemExit):  # argparse: exit 2 with a message
        main(["validate", "--layouts", "2x0"])
    assert "layouts must be WxP" in capsys.readouterr().err
