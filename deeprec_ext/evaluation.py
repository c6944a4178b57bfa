"""Evaluation while training, the evaluator's side (no TensorFlow import).

With an ``eval`` section in the job file the AIMaster starts one more process running the
worker command, with ``DEEPREC_ROLE=evaluator`` and ``DEEPREC_EVAL`` (the section, as
JSON). The training script is unchanged: ``shard_dataset`` gives the evaluator no training
data, and ``ElasticCallback`` / ``ElasticSessionHook`` run :class:`EvalLoop` instead of
training. Each round pulls the current dense weights (read-only), scores every record of
the eval files with lookups that insert nothing (``insert_missing=False``: an unseen id
gets its initial value, adds no row and counts toward no admission), and reports AUC and
log loss to the AIMaster. The evaluator never pushes. After training ends it scores the
final model once more (``final: true``) and leaves.
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import time
from typing import Callable, Iterator

import numpy as np

from deeprec_ext.data.ranges import read_shard
from deeprec_ext.proto import master_pb2

log = logging.getLogger(__name__)

ROLE_ENV = "DEEPREC_ROLE"
EVAL_ENV = "DEEPREC_EVAL"
EVALUATOR = "evaluator"


def role() -> str:
    """This process's role: ``worker`` (default) or ``evaluator``."""
    return os.environ.get(ROLE_ENV, "").strip() or "worker"


def is_evaluator() -> bool:
    return role() == EVALUATOR


def eval_spec() -> dict:
    """The job's ``eval`` section as the launcher passed it (files resolved)."""
    raw = os.environ.get(EVAL_ENV, "")
    if not raw:
        raise RuntimeError(f"{ROLE_ENV}={EVALUATOR} but {EVAL_ENV} is not set")
    return json.loads(raw)


def binary_metrics(labels, scores, from_logits: bool = False) -> dict:
    """ROC AUC (rank-sum formula, ties averaged) and mean log loss of 0/1 labels."""
    y = np.asarray(labels, np.float64).ravel()
    s = np.asarray(scores, np.float64).ravel()
    p = 1.0 / (1.0 + np.exp(-s)) if from_logits else s
    p = np.clip(p, 1e-7, 1 - 1e-7)
    logloss = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))) if y.size else float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(s.size)
    _, first, counts = np.unique(s[order], return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts - 1) / 2.0 + 1, counts)
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    auc = (float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
           if n_pos and n_neg else float("nan"))
    return {"auc": auc, "logloss": logloss, "examples": int(y.size),
            "positive_rate": float(n_pos / y.size) if y.size else float("nan")}


def _format(path: str, configured: str) -> str:
    gz = path.endswith(".gz")
    base = path[:-3] if gz else path
    if configured in ("", "auto"):
        if base.endswith((".tfrecord", ".tfrecords", ".tfr")):
            fmt = "tfrecord"
        elif base.endswith((".parquet", ".pq")):
            return "parquet"
        else:
            fmt = "text"
    else:
        fmt = configured.replace(".gz", "")
        if fmt == "parquet":
            return fmt
    return fmt + ".gz" if gz else fmt


ROWS_END = 1 << 62


def eval_files(patterns: list[str]) -> list[str]:
    """The files of ``eval.files`` patterns, each pattern's matches sorted."""
    expanded = []
    for pattern in patterns:  # patterns as in the job file (Kubernetes: expanded in the pod)
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"eval.files: {pattern!r} matches no file")
        expanded.extend(matches)
    return expanded


def record_batches(files: list[str], batch_size: int, fmt: str = "auto",
                   kinds: dict | None = None, null_values: dict | None = None) -> Iterator:
    """Every record of ``files``, in order, in batches (the last one short): lists of
    lines, or with ``kinds`` (``{column: kind}``) typed columns of Parquet files
    (``deeprec_ext.data.columns.ColumnRows``)."""
    from deeprec_ext.data.columns import ColumnRows
    from deeprec_ext.data.ranges import BadInput, parquet_columns
    buf = [] if kinds is None else ColumnRows(kinds)
    for path in eval_files(files):
        size = os.path.getsize(path)
        # a Parquet range is rows, and a file can hold more rows than bytes
        end = ROWS_END if _format(path, fmt) == "parquet" else size
        if kinds is None:
            records, _ = read_shard(path, 0, end, _format(path, fmt), size)
        else:
            if _format(path, fmt) != "parquet":
                raise BadInput(path, 0, "the training script reads typed columns "
                               "(shard_dataset(columns=...)), and this eval file is not Parquet")
            records = ColumnRows(kinds, parquet_columns(path, 0, end, kinds, null_values))
        buf.extend(records)
        while len(buf) >= batch_size:
            yield buf[:batch_size]
            buf = buf[batch_size:]
    if len(buf):
        yield buf


def training_over(status) -> bool:
    """Every worker has finished and no data shard is left: the model is final."""
    workers = [m for m in status.members if m.role == "worker"]
    if not workers or any(m.state == "running" for m in workers):
        return False
    return status.shards.todo == 0 and status.shards.doing == 0


class EvalLoop:
    """Rounds of evaluation until training ends, then a final one.

    ``score(records) -> (labels, scores)`` runs the model on one batch of raw records
    with read-only lookups; ``refresh()`` pulls the current dense weights (read-only) and
    raises while the training workers have not created them yet.
    """

    def __init__(self, ctx, score: Callable[[list[bytes]], tuple], refresh: Callable[[], None],
                 spec: dict | None = None, from_logits: bool = False, poll_seconds: float = 0.5,
                 kinds: dict | None = None, null_values: dict | None = None):
        self.ctx = ctx
        self.kinds, self.null_values = kinds, null_values  # typed Parquet columns
        self.score = score
        self.refresh = refresh
        self.spec = spec if spec is not None else eval_spec()
        self.from_logits = from_logits
        self.poll_seconds = poll_seconds
        self.results: list[dict] = []

    def _status(self):
        return self.ctx.session.stub.Status(master_pb2.StatusRequest(), timeout=10)

    def evaluate(self, step: int, final: bool = False) -> dict:
        start, cpu = time.monotonic(), time.process_time()
        self.refresh()
        labels, scores = [], []
        for records in record_batches(self.spec["files"], int(self.spec.get("batch_size", 4096)),
                                      self.spec.get("format", "auto"), self.kinds,
                                      self.null_values):
            y, s = self.score(records)
            labels.append(np.asarray(y).ravel())
            scores.append(np.asarray(s).ravel())
        result = binary_metrics(np.concatenate(labels) if labels else [],
                                np.concatenate(scores) if scores else [], self.from_logits)
        result.update(kind="eval", step=int(step), final=final, time=time.time(),
                      seconds=time.monotonic() - start, evaluator=self.ctx.worker_id,
                      cpu_seconds=time.process_time() - cpu)
        self.results.append(result)
        self._report(result)
        log.info("eval at step %d%s: auc %.4f logloss %.4f (%d examples, %.1fs)", step,
                 " (final)" if final else "", result["auc"], result["logloss"],
                 result["examples"], result["seconds"])
        return result

    def _report(self, result: dict) -> None:
        # sent over PutModel's free-form JSON, tagged kind=eval (no protocol change)
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in result.items()}
        req = master_pb2.PutModelRequest(worker_id=self.ctx.worker_id, model_json=json.dumps(clean))
        try:
            self.ctx.session.stub.PutModel(req, timeout=30)
        except Exception as exc:  # noqa: BLE001 - the next round reports again
            log.warning("could not report the eval result: %s", exc)

    def _due(self, step: int, last_step: int, last_time: float) -> bool:
        if self.spec.get("every_steps"):
            return step >= last_step + int(self.spec["every_steps"])
        return time.monotonic() - last_time >= float(self.spec["every_seconds"])

    def run(self) -> list[dict]:
        try:  # training comes first where the evaluator shares a machine with it
            os.nice(10)
        except OSError:
            pass
        last_step, last_time = 0, time.monotonic()
        while not self.ctx.stop_requested.is_set():
            try:
                st = self._status()
            except Exception as exc:  # noqa: BLE001 - the master may be busy; ask again
                log.debug("status failed: %s", exc)
                time.sleep(self.poll_seconds)
                continue
            if training_over(st):
                self._try(st.global_step, final=True)
                break
            if st.global_step > 0 and self._due(st.global_step, last_step, last_time):
                if self._try(st.global_step):
                    last_step, last_time = st.global_step, time.monotonic()
            time.sleep(self.poll_seconds)
        return self.results

    def _try(self, step: int, final: bool = False) -> bool:
        try:
            self.evaluate(step, final)
            return True
        except Exception as exc:  # noqa: BLE001 - e.g. dense tables not created yet
            log.warning("eval at step %d skipped: %s", step, exc)
            return False


class LossCurve:
    """A worker's training loss as TensorBoard scalars (``train/loss`` in run
    ``tensorboard/<worker id>``), every ``every`` steps; on when the launcher sets
    ``DEEPREC_TENSORBOARD_DIR`` (jobs with an eval section)."""

    def __init__(self, logdir_fn: Callable[[], str], every: int = 20):
        self._logdir_fn = logdir_fn
        self.every = every
        self._writer = None
        self._steps = 0  # this worker's steps
        self._next = 0

    @classmethod
    def from_env(cls, context_fn, every: int = 20) -> "LossCurve | None":
        root = os.environ.get("DEEPREC_TENSORBOARD_DIR", "")
        if not root or is_evaluator():
            return None
        return cls(lambda: os.path.join(root, context_fn().worker_id), every)

    def step(self, steps: int, loss) -> None:
        """``steps`` more training steps ended; ``loss`` as Keras reports it."""
        self._steps += steps
        step = self._steps
        if step < self._next:
            return
        self._next = step + self.every
        try:
            value = float(loss)
            if self._writer is None:
                from deeprec_ext.tensorboard import ScalarWriter
                self._writer = ScalarWriter(self._logdir_fn())
            self._writer.add(step, {"train/loss": value})
        except Exception as exc:  # noqa: BLE001 - a curve must never stop training
            log.warning("training loss curve off: %s", exc)
            self._next = float("inf")
