"""Stragglers: detection with hysteresis, capacity-weighted placement, and the job-file
section's refusals of contradictory thresholds."""
from __future__ import annotations

import pytest

from aimaster.config import ConfigError, parse_job


@pytest.mark.parametrize("doc,key", [
    ({"stragglers": {"k": 1}}, "stragglers.k (1) must be above 1"),
    ({"stragglers": {"k": 0.5}}, "stragglers.k (0.5) must be above 1"),
    ({"stragglers": {"interval_seconds": 2, "window_seconds": 1}},
     "stragglers.window_seconds (1) must be at least interval_seconds (2)"),
    ({"master": {"heartbeat_seconds": 2, "lease_seconds": 10},
      "stragglers": {"interval_seconds": 1, "window_seconds": 1.5}},
     "stragglers.window_seconds (1.5) must be at least master.heartbeat_seconds (2)"),
    ({"stragglers": {"k": 2, "replace_below": 0.6}},
     "stragglers.replace_below (0.6) must be below 1/k (0.5, the detection threshold)"),
    ({"stragglers": {"bogus": 1}}, "stragglers: unknown key(s) ['bogus']"),
])
def test_contradictory_thresholds_are_refused_naming_the_key(doc, key):
    with pytest.raises(ConfigError) as e:
        parse_job(doc)
    assert str(e.value).startswith(key), str(e.value)


def test_defaults_and_the_off_switch():
    cfg = parse_job({})
    assert cfg.stragglers.enabled is False and cfg.stragglers.k > 1
    on = parse_job({"stragglers": {"enabled": True, "k": 2.5, "window_seconds": 4}})
    assert on.stragglers.enabled and on.stragglers.k == 2.5
    assert parse_job({"stragglers": {"enabled": False}}).stragglers.enabled is False
