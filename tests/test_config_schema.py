"""The job-file schema: its generated reference is current, every key it documents is
accepted, defaults match JobConfig(), and bad values are named by their path."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from aimaster import config_reference
from aimaster.config import ConfigError, JobConfig, parse_job
from tests.conftest import ROOT

GUIDE = ROOT / "docs" / "guide-aimaster.md"


def test_reference_in_the_guide_is_generated_from_the_schema():
    r = subprocess.run([sys.executable, "-m", "aimaster.config_reference", "--check", str(GUIDE)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = GUIDE.read_text()
    for path, *_ in config_reference.rows():
        assert f"| `{path}` |" in text
    stale = text.replace("| `num_slots` |", "| `num_slot` |")
    assert config_reference.render(stale) == text  # --write repairs a hand edit


def _value_for(path: str, kind: str):
    """A valid non-default value of the documented type, for a maximal job file."""
    specials = {"ps.replicas": 2, "worker.replicas": 1, "worker.command": ["python", "w.py"],
                "ps.max_replicas": 8, "worker.max_replicas": 8, "master.port": 0,
                "ps.min_replicas": 1, "worker.min_replicas": 1, "num_slots": 1024,
                "gazer.prometheus_port": 9400, "kubernetes.port": 50052, "kubernetes.ps_port": 2223,
                "kubernetes.data_mount_path": "/mnt/data", "consistency.mode": "sync",
                "consistency.virtual_workers": 4, "autoscale.ps_cpu_low": 0.2,
                "autoscale.memory_headroom": 0.3, "master.heartbeat_seconds": 0.5,
                "export.dtype": "float16", "replication.mode": "sync", "autoscale.recovery": "wait",
                "kubernetes.image_pull_policy": "Always", "data.format": "tfrecord",
                "stragglers.replace_below": 0.05, "stragglers.min_weight": 0.5,
                "stragglers.hot_slot_share": 0.5,
                # deprecated, and not with bytes_per_shard: null is its documented default
                "data.records_per_shard": None,
                # streaming is refused with epochs > 1 and sync mode, both set here
                "data.watch": False, "data.on_bad_record": "fail",
                # one of every_steps / every_seconds
                "eval.every_seconds": None}
    if path in specials:
        return specials[path]
    if kind.startswith("boolean"):
        return True
    if kind.startswith("integer"):
        return 3
    if kind.startswith("number"):
        return 0.5 if "< 1" in kind else 7.5
    if kind.startswith("mapping"):
        return {"K": "v"}
    if kind.startswith("list"):
        return ["a"]
    return "x"


def test_every_documented_key_is_accepted():
    doc: dict = {}
    for path, kind, _, _ in config_reference.rows():
        if kind == "mapping" and path.count(".") == 0:
            continue
        *parents, leaf = path.split(".")
        d = doc
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = _value_for(path, kind)
    cfg = parse_job(yaml.safe_load(yaml.safe_dump(doc)))
    assert cfg.ps.replicas == 2 and cfg.consistency.virtual_workers == 4
    assert cfg.export.dtype == "float16" and cfg.checkpoint_on_success is True
    assert cfg.sync_replication and cfg.autoscale.recovery == "wait"


def test_defaults_equal_jobconfig_and_the_example_parses():
    assert parse_job({}) == JobConfig() == parse_job(None)
    cfg = parse_job(yaml.safe_load((ROOT / "examples" / "criteo" / "job.yaml").read_text()))
    assert cfg.export.dir == "runs/criteo-deepfm/model" and cfg.worker.replicas == 2
    assert parse_job({"ps": None, "consistency": "async"}).ps.replicas == 1


@pytest.mark.parametrize("doc,message", [
    ({"checkpoint": {"on_success": "yes"}}, "checkpoint.on_success: input should be a valid boolean, got 'yes'"),
    ({"export": {"dtype": "int8"}}, "export.dtype: input should be 'float32' or 'float16', got 'int8'"),
    ({"export": {"dir": 3}}, "export.dir: input should be a valid string, got 3"),
    ({"init_from": ["a"]}, "init_from: input should be a valid string, got ['a']"),
    ({"master": {"lease_seconds": True}}, "master.lease_seconds: input should be a valid integer, got True"),
    ({"data": {"files": 3}}, "data.files: input should be a valid list, got 3"),
    ({"checkpoint": {"every": 3}}, "checkpoint: unknown key(s) ['every']"),
    ({"kubernetes": {"port": 2222}}, "kubernetes.port and ps_port must differ (both 2222)"),
])
def test_bad_values_are_named_by_path(doc, message):
    with pytest.raises(ConfigError) as e:
        parse_job(doc)
    assert str(e.value) == message


def test_several_problems_are_all_reported():
    with pytest.raises(ConfigError) as e:
        parse_job({"ps": {"replicas": 0}, "gazer": {"top_ops": 0}, "bogus": 1})
    lines = str(e.value).splitlines()
    assert len(lines) == 3 and any(ln.startswith("gazer.top_ops") for ln in lines)
