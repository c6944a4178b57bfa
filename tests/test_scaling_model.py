"""The arithmetic of bench/scaling_model.py (no jobs run: pure functions, well under 1 s)."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.scaling_model import (Costs, background_share, best_ps, fit, main, mva,  # noqa: E402
                                 mva_overlapped, predict)

B = 1000
# a step as one serial chain (before rows were fetched ahead); test_overlapped_steps: after
C = Costs(batch=B, w0=20e-6, wr=1e-3, k=10e-6, r=2e-3, b0=900.0, br=4000.0, rep=700.0,
          overlap=False)


def test_linear_costs_in_rpcs_per_sample():
    # q = 2 P / B: two RPCs (lookup, push) per PS per step
    assert C.q(3) == pytest.approx(0.006)
    assert C.c_w(3) == pytest.approx(20e-6 + 1e-3 * 0.006)
    assert C.c_ps(3) == pytest.approx(10e-6 + 2e-3 * 0.006)
    assert C.bytes(3) == pytest.approx(900 + 4000 * 0.006)
    c = Costs(batch=B, w0=0, wr=0, k=10e-6, r=0, b0=0, br=0, rep_cpu=4e-6)
    assert c.c_ps(1) == pytest.approx(10e-6)  # no ring with one PS
    assert c.c_ps(2) == pytest.approx(14e-6) and c.c_ps(2, replication=False) == pytest.approx(10e-6)


def test_mva():
    # one customer: no queueing, a cycle is delay + demand
    assert mva(1, 0.3, 0.2) == pytest.approx(1 / 0.5)
    # two customers, one server: n=1 R=0.2 Q=0.4; n=2 R=0.2*1.4=0.28, X=2/0.58
    assert mva(2, 0.3, 0.2) == pytest.approx(2 / 0.58)
    # Seidmann: 2 servers = queue of D/2 + delay of D/2; saturates at servers / demand
    assert mva(2, 0.0, 1.0, 2) == pytest.approx(1.6)
    assert mva(500, 0.0, 1.0, 2) == pytest.approx(2.0, rel=1e-3)


def test_shared_machine():
    c = Costs(batch=B, w0=20e-6, wr=1e-3, k=10e-6, r=2e-3, b0=900.0, br=4000.0, overlap=False)
    cw, cps = c.c_w(1), c.c_ps(1)
    one = predict(c, 1, 1, cores=2, shared=True)
    assert one["bound"] == "queueing" and one["samples_per_s"] == pytest.approx(1 / (cw + cps))
    two = predict(c, 2, 1, cores=2, shared=True)
    assert two["samples_per_s"] == pytest.approx(1.6 / (cw + cps))
    # other programs wanting 1.5 cores: the job (1.6 cores) and they share 2 / 3.1
    bg = predict(c, 2, 1, cores=2, shared=True, background=1.5)
    assert bg["share"] == pytest.approx(2 / 3.1)
    assert bg["samples_per_s"] == pytest.approx(two["samples_per_s"] * 2 / 3.1)
    # a job that leaves room is not slowed by a small background
    assert predict(c, 1, 1, cores=2, shared=True, background=0.3)["share"] == 1.0
    assert background_share(1.0, 3.0, 2) == pytest.approx(0.5)
    # the ring's replication runs beside the steps and takes cores from them
    rep = Costs(batch=B, w0=20e-6, wr=0, k=10e-6, r=0, b0=0, br=0, rep_cpu=10e-6, overlap=False)
    assert predict(rep, 2, 2, 2, shared=True)["samples_per_s"] < \
        predict(rep, 2, 2, 2, shared=True, replication=False)["samples_per_s"]
    with pytest.raises(ValueError, match="no CPU left"):
        predict(Costs(batch=B, w0=1, wr=0, k=1, r=0, b0=0, br=0, master=1.0), 1, 1, 1.5,
                shared=True)


def test_cluster_bounds():
    bw = 10e9 / 8
    p = predict(C, 8, 1, cores=16, gbit=10)
    assert p["bounds"]["worker_nic"] == pytest.approx(8 * bw / (C.bytes(1) / 2))
    assert p["bounds"]["ps_nic"] == pytest.approx(bw / (C.bytes(1) / 2))  # no ring with 1 PS
    assert p["bounds"]["ps_cpu"] == pytest.approx(1 / C.c_ps(1))
    # the one-worker step: its CPU + the PS' share + one round trip + its bytes
    step = B * C.c_w(1) + B * C.c_ps(1) + 100e-6 + B * C.bytes(1) / 2 / bw
    assert p["step_ms_unloaded"] == pytest.approx(1e3 * step)
    assert predict(C, 1, 1, cores=16, gbit=10)["samples_per_s"] == pytest.approx(B / step)
    # many workers: the PS saturate at P cores / c_ps
    many = predict(C, 2000, 4, cores=16, gbit=1000)
    assert many["samples_per_s"] == pytest.approx(4 / C.c_ps(4), rel=1e-2)
    p4 = predict(C, 8, 4, cores=16, gbit=10)
    assert p4["bounds"]["ps_nic"] == pytest.approx(4 * bw / (C.bytes(4) / 2 + 700))
    assert p4["samples_per_s"] > p["samples_per_s"]
    # a slow network only lowers the latency and NIC bounds
    slow = predict(C, 8, 4, cores=16, gbit=0.01)
    assert slow["samples_per_s"] < p4["samples_per_s"] and slow["bound"].endswith("nic")
    with pytest.raises(ValueError, match="workers >= 1"):
        predict(C, 0, 1, cores=16)


def test_overlapped_steps():
    """Rows fetched ahead and pushes in flight: a step lasts its worker's CPU when the PS
    keep up; on one machine the PS' work takes cores beside the steps."""
    c = Costs(batch=B, w0=20e-6, wr=1e-3, k=10e-6, r=2e-3, b0=900.0, br=4000.0)
    assert c.overlap
    cw = c.c_w(1)
    one = predict(c, 1, 1, cores=2, shared=True)
    assert one["samples_per_s"] == pytest.approx(1 / cw)  # the PS beside it: not on the path
    serial = predict(Costs(**{**c.__dict__, "overlap": False}), 1, 1, cores=2, shared=True)
    assert one["samples_per_s"] > serial["samples_per_s"]
    # two workers on 2 cores: the PS' share leaves fewer cores to the steps than 2
    two = predict(c, 2, 1, cores=2, shared=True)["samples_per_s"]
    assert 1 / cw < two < 2 / cw
    # a cluster: the longer of the worker's CPU and the calls
    bw = 10e9 / 8
    calls = B * c.c_ps(1) + 100e-6 + B * c.bytes(1) / 2 / bw
    p = predict(c, 1, 1, cores=16, gbit=10)
    assert p["step_ms_unloaded"] == pytest.approx(1e3 * max(B * cw, calls))
    assert p["samples_per_s"] == pytest.approx(B / max(B * cw, calls))
    # one customer, the station slower than its own work: the station decides
    assert mva_overlapped(1, 0.1, 0.05, 0.2) == pytest.approx(1 / 0.25)
    assert mva_overlapped(1, 0.3, 0.05, 0.2) == pytest.approx(1 / 0.3)
    # many: the station saturates at servers / demand
    assert mva_overlapped(500, 0.1, 0.0, 1.0, 2) == pytest.approx(2.0, rel=1e-3)
    assert predict(c, 2000, 4, cores=16, gbit=1000)["samples_per_s"] == \
        pytest.approx(4 / c.c_ps(4), rel=1e-2)


def test_best_ps_is_the_fewest_near_the_best():
    b = best_ps(C, 32, cores=16, gbit=25)
    allp = [predict(C, 32, p, 16, 25)["samples_per_s"] for p in range(1, 33)]
    assert b["samples_per_s"] >= 0.98 * max(allp)
    assert all(x < 0.98 * max(allp) for x in allp[:b["ps"] - 1])


def test_fit_recovers_known_costs():
    truth = Costs(batch=B, w0=25e-6, wr=3e-3, k=12e-6, r=5e-4, b0=880.0, br=6000.0, rep=600.0,
                  rep_cpu=3e-6, master=0.005)
    runs = []
    for w, p, rep in ((1, 1, True), (1, 2, True), (2, 2, True), (1, 2, False)):
        runs.append({"workers": w, "ps": p, "replication": rep,
                     "worker_cpu_per_sample": truth.c_w(p),
                     "ps_cpu_per_sample": truth.c_ps(p, rep), "bytes_per_sample": truth.bytes(p),
                     "rep_bytes_per_sample": 600.0 if p > 1 and rep else 0.0,
                     "master_cores": 0.005 * (w + p)})
    c = fit(runs, B)
    for name in ("w0", "wr", "k", "r", "b0", "br", "rep", "rep_cpu", "master"):
        assert getattr(c, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_cli_predict_and_bad_input(tmp_path, capsys):
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
