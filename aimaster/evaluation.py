"""Evaluation while training, the AIMaster's side (docs/guide-eval.md).

The evaluator reports each round (AUC, log loss, the global step it scored); the AIMaster
appends it to ``<state_dir>/eval.jsonl`` (the metrics file), keeps the latest for status,
Gazer and Prometheus, and writes TensorBoard scalars under ``<state_dir>/tensorboard/eval``.
Training curves (global step, samples/s, PS memory) go to ``<state_dir>/tensorboard/train``,
so ``tensorboard --logdir runs/<job>`` shows both.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time

from deeprec_ext.tensorboard import ScalarWriter

EVAL_FILE = "eval.jsonl"
TRAIN_EVERY_SECONDS = 5.0


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def eval_env_spec(config, files: list[str] | None = None) -> dict:
    """DEEPREC_EVAL for the evaluator: the eval section (patterns are expanded by it)."""
    spec = config.eval
    return {"files": files if files is not None else spec.file_list(),
            "batch_size": spec.batch_size, "every_steps": spec.every_steps,
            "every_seconds": spec.every_seconds, "format": config.data.format}


class EvalRecorder:
    def __init__(self, state_dir: str, clock=time.monotonic):
        self.state_dir = state_dir
        self.clock = clock
        self.path = os.path.join(state_dir, EVAL_FILE)
        self._lock = threading.Lock()
        self.latest: dict | None = None
        self.final: dict | None = None
        self.rounds = 0
        self._eval_tb = ScalarWriter(os.path.join(state_dir, "tensorboard", "eval"))
        self._train_tb = ScalarWriter(os.path.join(state_dir, "tensorboard", "train"))
        self._last_train = None  # (clock, samples)

    def record(self, member_id: str, result: dict) -> dict:
        """One round of the evaluator; returns what was kept."""
        step = int(result.get("step", 0))
        kept = {"step": step, "auc": _num(result.get("auc")), "logloss": _num(result.get("logloss")),
                "examples": int(result.get("examples", 0) or 0), "final": bool(result.get("final")),
                "seconds": _num(result.get("seconds")), "evaluator": member_id,
                "cpu_seconds": _num(result.get("cpu_seconds")),
                "time": _num(result.get("time")) or time.time()}
        with self._lock:
            self.latest = kept
            self.rounds += 1
            if kept["final"]:
                self.final = kept
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(kept, sort_keys=True) + "\n")
        self._eval_tb.add(step, {"eval/auc": kept["auc"], "eval/logloss": kept["logloss"]})
        return kept

    def state(self) -> dict:
        with self._lock:
            latest = dict(self.latest) if self.latest else None
            rounds = self.rounds
        age = time.time() - latest["time"] if latest else None
        return {"latest": latest, "rounds": rounds, "age_seconds": age}

    def train_point(self, step: int, samples: int, ps_memory_bytes: float | None,
                    force: bool = False) -> None:
        """Training curves, at most every few seconds."""
        now = self.clock()
        last = self._last_train
        if last is not None and not force and now - last[0] < TRAIN_EVERY_SECONDS:
            return
        rate = (samples - last[1]) / (now - last[0]) if last and now > last[0] else None
        self._last_train = (now, samples)
        self._train_tb.add(step, {"train/samples_per_second": rate, "train/samples": samples,
                                  "train/ps_memory_bytes": ps_memory_bytes})

    def close(self) -> None:
        self._eval_tb.close()
        self._train_tb.close()
