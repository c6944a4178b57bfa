"""The evaluator role for TF1 graphs (``ElasticSessionHook`` under
``MonitoredTrainingSession``): the unchanged training graph, scored on the eval files.

The evaluator runs the training script as is. ``shard_dataset`` gave it an empty dataset
and recorded its ``parse_fn``; the hook then

1. finds the graph's labels and scores (:func:`find_eval_tensors`): the one binary loss
   the optimizer minimizes, either ``tf.nn.sigmoid_cross_entropy_with_logits`` (also what
   ``tf.compat.v1.losses.sigmoid_cross_entropy`` and Keras' binary cross-entropy build)
   -> its ``labels`` and ``logits``, or a log loss over probabilities
   (``tf.compat.v1.losses.log_loss``, ``-y*log(p) - (1-y)*log(1-p)``, clipped or not)
   -> ``p`` and the ``y`` it multiplies. ``dtf.eval_tensors(...)`` names them instead;
   a graph with no such loss, or with several, is refused naming that line. Nothing is
   guessed;
2. finds the iterator whose outputs carry ``shard_dataset``'s elements, and feeds those
   outputs with eval records parsed by the same ``parse_fn`` (a small parse graph built
   in ``begin``, before the graph is finalized);
3. runs :class:`deeprec_ext.evaluation.EvalLoop` (the Keras path's loop: cadence, metrics
   file, TensorBoard, Gazer) with dense weights pulled read-only and fetches limited to
   labels and scores, so no gradient, push or optimizer op runs; the worker context
   refuses any push and makes every lookup read-only in this role.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
log = logging.getLogger(__name__)
EVAL_TENSORS_COLLECTION = "deeprec_ext_eval_tensors"
ONE_LINE = ("dtf.eval_tensors(labels=<label tensor>, logits=<logit tensor>)  "
            "# or predictions=<probabilities>")
_GET_NEXT = ("IteratorGetNext", "IteratorGetNextSync")
# element-wise steps between a probability and the Log of a log loss (eps, 1 - p, clipping)
_PASS = ("Identity", "AddV2", "Add", "Sub", "Maximum", "Minimum", "ClipByValue", "Reshape",
         "Squeeze", "ExpandDims")
_GRAD_SCOPE = re.compile(r"(?:^|/)gradients(?:_\d+)?/(.+?)_grad/")


class EvalTensorsError(ValueError):
    """The evaluator cannot tell the labels and predictions of a TF1 graph."""


class _NoLabels(EvalTensorsError):
    """The loss shows its predictions (``scores``) but not its labels."""

    def __init__(self, message: str, scores):
        super().__init__(message)
        self.scores = scores


def eval_tensors(labels, predictions=None, logits=None) -> None:
    """Name the labels and the model's output of a TF1 graph for the job's evaluator.

    Optional: needed only where the evaluator cannot find them itself (a graph with
    several binary losses, or none it recognizes; docs/guide-eval.md). Give exactly one
    of ``predictions`` (probabilities) and ``logits``. Harmless outside the evaluator.
    """
    if (predictions is None) == (logits is None):
        raise ValueError("eval_tensors: give exactly one of predictions= and logits=")
    scores = logits if logits is not None else predictions
    graph = v1.get_default_graph()
    for name, t in (("labels", labels), ("predictions/logits", scores)):
        if not isinstance(t, tf.Tensor) or t.graph is not graph:
            raise ValueError(f"eval_tensors: {name} must be a tensor of the default graph, "
                             f"got {t!r}")
    v1.add_to_collection(EVAL_TENSORS_COLLECTION,
                         {"labels": labels, "scores": scores, "from_logits": logits is not None})


def _const(t: tf.Tensor) -> bool:
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    return t.op.type == "Const"


def _strip(t: tf.Tensor) -> tf.Tensor:
    while t.op.type in ("Identity", "Reshape", "Squeeze", "ExpandDims", "Cast"):
        t = t.op.inputs[0]
    return t


def _sigmoid_ce(op) -> tuple | None:
    """``op`` is the Log1p of ``tf.nn.sigmoid_cross_entropy_with_logits`` ->
    (labels, logits, final op), else None. The structure is matched, not the names:
    relu(z) - z*y + log1p(exp(-|z|)) with -|z| as Select(z >= 0, -z, z)."""
    if op.type != "Log1p" or op.inputs[0].op.type != "Exp":
        return None
    sel = op.inputs[0].op.inputs[0].op
    if sel.type not in ("Select", "SelectV2") or sel.inputs[1].op.type != "Neg":
        return None
    z = sel.inputs[2]
    if sel.inputs[1].op.inputs[0] is not z or sel.inputs[0].op.type != "GreaterEqual":
        return None
    for final in op.outputs[0].consumers():
        if final.type not in ("AddV2", "Add") or final.inputs[0].op.type != "Sub":
            continue
        mul = final.inputs[0].op.inputs[1].op
        if mul.type == "Mul" and mul.inputs[0] is z:
            return mul.inputs[1], z, final
    return None


def _log_loss(op) -> tuple | None:
    """``op`` is a Log of a log loss over probabilities -> (p, labels or None, op)."""
    if op.type != "Log":
        return None
    t = op.inputs[0]
    while t.op.type in _PASS:  # log(p + eps), log(1 - p), log(clip(p))
        ins = [i for i in t.op.inputs if not _const(i)]
        if len(ins) != 1:
            break
        t = ins[0]
    if _const(t):
        return None
    labels = set()
    for mul in op.outputs[0].consumers():
        if mul.type != "Mul" or _GRAD_SCOPE.search(mul.name):  # not its gradient's Mul
            continue
        y = mul.inputs[0] if mul.inputs[1] is op.outputs[0] else mul.inputs[1]
        if y.op.type == "Sub" and _const(y.op.inputs[0]):  # (1 - y) * log(1 - p)
            y = y.op.inputs[1]
        labels.add(y)
    return t, (labels.pop() if len(labels) == 1 else None), op


def _ancestors(tensors, stop_types=()) -> set:
    seen, todo = set(), [t.op for t in tensors]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type not in stop_types:
            todo.extend(i.op for i in op.inputs)
    return seen


def _trained(t: tf.Tensor) -> bool:
    """Depends on a variable or a PS lookup: a model output, not an input transform."""
    return any(op.type in ("ReadVariableOp", "VariableV2", "PyFunc", "PyFuncStateless",
                             "EagerPyFunc")
               for op in _ancestors([t]))


def find_eval_tensors(graph, dataset_labels=None) -> dict:
    """The labels and scores the evaluator fetches: ``{"labels", "scores",
    "from_logits", "how"}``. ``dataset_labels``: the label tensor of the training input
    (used when the loss does not show the labels itself). Raises EvalTensorsError
    naming the one line that settles it when the graph is ambiguous or unrecognized."""
    named = graph.get_collection(EVAL_TENSORS_COLLECTION)
    if len(named) > 1:
        raise EvalTensorsError(f"dtf.eval_tensors was called {len(named)} times in this "
                               "graph: call it once")
    if named:
        return dict(named[0], how="dtf.eval_tensors")
    ops = graph.get_operations()
    with_grad = {m.group(1) for op in ops for m in [_GRAD_SCOPE.search(op.name)] if m}
    ces, logs = [], []
    for op in ops:
        if _GRAD_SCOPE.search(op.name):
            continue
        found = _sigmoid_ce(op)
        if found:
            ces.append(found + (op,))
            continue
        found = _log_loss(op)
        if found and _trained(found[0]):
            logs.append(found)
    # "op": one whose gradient always has ops of its own (Log1p, Log: a reciprocal)
    cands = ([{"labels": y, "scores": z, "from_logits": True, "op": log1p,
               "how": f"sigmoid cross-entropy {final.name}"} for y, z, final, log1p in ces] +
             [{"labels": y, "scores": p, "from_logits": False, "op": op,
               "how": f"log loss {op.name}"} for p, y, op in logs])
    # the loss the optimizer minimizes: the one whose gradient the graph computes (a
    # loss only logged is not the model's; a graph without gradients: any)
    if with_grad:
        cands = [c for c in cands if c["op"].name in with_grad]
    # a log loss over sigmoid(z) where z also feeds a sigmoid cross-entropy is that model
    ce_logits = {c["scores"].ref() for c in cands if c["from_logits"]}
    cands = [c for c in cands if c["from_logits"] or not (
        c["scores"].op.type == "Sigmoid" and c["scores"].op.inputs[0].ref() in ce_logits)]
    by_scores: dict = {}
    for c in cands:  # log(p) and log(1 - p) of one loss are one candidate
        prev = by_scores.setdefault(c["scores"].ref(), c)
        if prev["labels"] is None:
            prev["labels"] = c["labels"]
    cands = list(by_scores.values())
    if not cands:
        raise EvalTensorsError(
            "the evaluator found no binary loss in this graph (recognized: "
            "tf.nn.sigmoid_cross_entropy_with_logits, tf.compat.v1.losses.sigmoid_cross_entropy, "
            "a log loss over probabilities such as tf.compat.v1.losses.log_loss). "
            f"Add one line before the session: {ONE_LINE}")
    if len(cands) > 1:
        listed = "; ".join(f"{c['how']} (scores {c['scores'].name})" for c in cands)
        raise EvalTensorsError(
            f"the evaluator found {len(cands)} binary losses in this graph and will not "
            f"guess which one to score: {listed}. Add one line before the session: {ONE_LINE}")
    c = cands[0]
    if c["labels"] is None:
        if dataset_labels is None:
            raise _NoLabels(
                f"the evaluator found the predictions ({c['how']}, {c['scores'].name}) but "
                f"not the labels. Add one line before the session: {ONE_LINE}", c["scores"])
        c["labels"] = dataset_labels
    return {k: c[k] for k in ("labels", "scores", "from_logits", "how")}


def input_feeds(graph, element_spec, fetches) -> list:
    """The outputs of the iterator that reads ``shard_dataset`` (flat, in
    ``tf.nest.flatten(element_spec)`` order): the one ``IteratorGetNext`` among the
    fetches' ancestors whose output types are the dataset's."""
    want = [s.dtype for s in tf.nest.flatten(element_spec)]
    ancestors = _ancestors(fetches)
    found = [op for op in ancestors if op.type in _GET_NEXT
             and [o.dtype for o in op.outputs] == want]
    if len(found) != 1:
        raise EvalTensorsError(
            f"the evaluator feeds eval records where the graph reads dtf.shard_dataset, but "
            f"found {len(found)} iterators over it behind the scored tensors "
            f"({', '.join(t.name for t in fetches)}): read the training input through one "
            "dtf.shard_dataset iterator")
    return list(found[0].outputs)


class TF1Evaluator:
    """Built in ``ElasticSessionHook.begin`` (the graph still open), run in
    ``after_create_session``."""

    def __init__(self, dense_vars: list):
        from deeprec_ext.tf.data import EVAL_INPUT
        if "element_spec" not in EVAL_INPUT:
            raise EvalTensorsError(
                "the evaluator of a TF1 graph reads the eval files through the parse_fn of "
                "dtf.shard_dataset, and this script built no dtf.shard_dataset")
        graph = v1.get_default_graph()
        spec = EVAL_INPUT["element_spec"]
        self.parse_fn = EVAL_INPUT.get("parse_fn")
        # the dataset's label: the second element of (features, labels), as Keras reads it
        flat = tf.nest.flatten(spec)
        label_index = None
        if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[1], tf.TensorSpec):
            label_index = len(tf.nest.flatten(spec[0]))
        try:
            found = find_eval_tensors(graph)
        except _NoLabels as exc:  # a loss that hides its labels: the dataset's
            if label_index is None:
                raise
            feeds = input_feeds(graph, spec, [exc.scores])
            found = find_eval_tensors(graph, dataset_labels=feeds[label_index])
        self.found = found
        self.feeds = input_feeds(graph, spec, [found["scores"]])
        self.labels, self.scores = found["labels"], found["scores"]
        self.from_logits = bool(found["from_logits"])
        log.info("evaluator: scoring %s %s against labels %s (found by: %s)",
                 "logits" if self.from_logits else "probabilities", self.scores.name,
                 self.labels.name, found["how"])
        self.kinds, self.null_values = EVAL_INPUT.get("kinds"), EVAL_INPUT.get("null_values")
        with v1.name_scope("deeprec_eval_input"):
            if self.kinds is not None:  # typed Parquet columns: one placeholder per flat part
                from deeprec_ext.data.tf_dataset import column_types, columns_from_flat
                self.records = [v1.placeholder(t, [] if t == tf.string else [None])
                                for t in column_types(self.kinds)]
                batch = columns_from_flat(list(self.records), self.kinds)
            else:
                self.records = v1.placeholder(tf.string, [None], name="records")
                batch = self.records
            parsed = self.parse_fn(batch) if self.parse_fn is not None else batch
        self.parsed = tf.nest.flatten(parsed)
        if [t.dtype for t in self.parsed] != [s.dtype for s in flat]:
            raise EvalTensorsError("parse_fn gave other types on eval records than in "
                                   "shard_dataset")
        self.vars = dense_vars
        self.placeholders = [v1.placeholder(v.dtype.base_dtype, v.shape) for v in dense_vars]
        self.assign = tf.group(*[v.assign(p) for v, p in zip(dense_vars, self.placeholders)])

    def run(self, session) -> list[dict]:
        from deeprec_ext.evaluation import EvalLoop, record_batches
        from deeprec_ext.tf.dense import DenseSync
        from deeprec_ext.worker import get_context
        ctx = get_context()
        dense = DenseSync(ctx.client, [v.op.name for v in self.vars],
                          [tuple(v.shape.as_list()) for v in self.vars])

        def refresh():  # raises until the workers created the dense tables
            if self.vars:
                session.run(self.assign, feed_dict=dict(zip(self.placeholders, dense.pull())))

        def score(records):
            if self.kinds is not None:
                feed = dict(zip(self.records, records.flat()))
            else:
                feed = {self.records: np.array(records, dtype=object)}
            values = session.run(self.parsed, feed)
            y, s = session.run([self.labels, self.scores], dict(zip(self.feeds, values)))
            y, s = np.asarray(y).ravel(), np.asarray(s).ravel()
            if y.size != s.size:
                raise EvalTensorsError(
                    f"labels {self.labels.name} ({y.size} values) and scores "
                    f"{self.scores.name} ({s.size}) differ in size on one batch. "
                    f"Add one line before the session: {ONE_LINE}")
            return y, s
        loop = EvalLoop(ctx, score, refresh, from_logits=self.from_logits, kinds=self.kinds,
                        null_values=self.null_values)
        # a graph whose labels and scores do not pair up fails here, not round after round
        first = next(record_batches(loop.spec["files"], 16, loop.spec.get("format", "auto"),
                                    self.kinds, self.null_values), None)
        if first is not None:
            score(first)
        return loop.run()
