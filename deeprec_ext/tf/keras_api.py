"""Keras integration: ``ElasticEmbedding`` (a drop-in for ``keras.layers.Embedding`` whose
table lives on the PS) and ``ElasticCallback`` (shares dense weights through the PS and
reports training progress and consumed data shards)."""
from __future__ import annotations

import json
import logging

import keras
import numpy as np
import tensorflow as tf

from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.evaluation import EvalLoop, eval_spec, is_evaluator, record_batches
from deeprec_ext.evaluation import LossCurve
from deeprec_ext.store.policies import check_policies
from deeprec_ext.store.spec import check_dtype
from deeprec_ext.tf.dense import DenseSync
from deeprec_ext.tf.op_sampler import sampler_for
from deeprec_ext.tf.ops import ANCHOR_SUFFIX, elastic_lookup
from deeprec_ext.worker import get_context

log = logging.getLogger(__name__)

DEFAULT_INITIALIZER = {"name": "uniform", "minval": -0.05, "maxval": 0.05, "seed": 0}
DEFAULT_OPTIMIZER = {"name": "adagrad", "learning_rate": 0.05}
TABLE_SPEC_OP = "deeprec_table_spec"


def record_table_spec(table: str, dim: int, initializer, optimizer, admission=None,
                      eviction=None, storage_dtype="float32") -> None:
    """Leave the table's spec in the graph being traced as an unused string constant, so
    ``graph_opt`` finds it in a GraphDef, MetaGraph or SavedModel (where layer attributes
    are not saved); its admission / eviction policies size the planned rows. Nothing in
    eager mode; Grappler prunes it at run time."""
    if not tf.executing_eagerly():
        spec = {"table": table, "dim": int(dim), "key_dtype": "int64",
                "initializer": initializer, "optimizer": optimizer}
        if admission:
            spec["admission"] = admission
        if eviction:
            spec["eviction"] = eviction
        if storage_dtype != "float32":
            spec["dtype"] = storage_dtype
        tf.constant(json.dumps(spec), name=TABLE_SPEC_OP)


class ElasticEmbedding(keras.layers.Layer):
    """Embedding table on the parameter servers.

    Same call as ``keras.layers.Embedding``: integer ids of any shape in, float32
    ``ids.shape + [dim]`` out; ids are any int64 (no vocabulary size: unseen ids get a
    deterministic initial row). The optimizer runs on the PS (sgd, adagrad, adam, ftrl).

    ``admission={"min_count": N}`` (optionally ``"bloom": {"capacity": C, "fpp": p}``,
    ``"default"``): an id gets a row once seen N times, until then it reads the default
    vector; ``eviction={"steps_to_live": S}`` / ``{"l2_below": x}``: rows are deleted
    once stale or small (see ``deeprec_ext.store.policies``). Bad specs are refused here,
    naming the table.

    ``storage_dtype="float16"``: the PS stores the values as float16 (half the value
    bytes; optimizer slots and math stay float32, lookups still return float32). Not
    ``dtype``: Keras layers already take ``dtype`` as their compute dtype.
    """

    def __init__(self, dim: int, table: str | None = None, initializer=None, optimizer=None,
                 admission=None, eviction=None, storage_dtype="float32", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"ElasticEmbedding: dim must be a positive int, got {dim!r}")
        self.dim = dim
        self.table = table or self.name
        check_policies(self.table, dim, admission, eviction)
        try:
            self.storage_dtype = check_dtype(storage_dtype, self.table)
        except ValueError as exc:  # refused like a bad policy: where the model is built
            raise InvalidRequestError(str(exc)) from None
        self.admission, self.eviction = admission, eviction
        self.initializer = initializer if initializer is not None else DEFAULT_INITIALIZER
        self.optimizer_spec = optimizer if optimizer is not None else DEFAULT_OPTIMIZER
        self.supports_jit = False  # the lookup is a host call, not XLA-compilable
        self._table_ready = False

    def build(self, input_shape):
        self.anchor = self.add_weight(name=ANCHOR_SUFFIX, shape=(), initializer="zeros",
                                      trainable=True)
        super().build(input_shape)

    def _ensure_table(self):
        if not self._table_ready:
            get_context().client.create_table(self.table, self.dim, initializer=self.initializer,
                                              optimizer=self.optimizer_spec,
                                              admission=self.admission, eviction=self.eviction,
                                              dtype=self.storage_dtype)
            self._table_ready = True

    def call(self, ids, training=None):
        self._ensure_table()
        record_table_spec(self.table, self.dim, self.initializer, self.optimizer_spec,
                          self.admission, self.eviction, self.storage_dtype)
        return elastic_lookup(self.table, self.dim, ids, tf.convert_to_tensor(self.anchor),
                              training=bool(training))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.dim,)

    def get_config(self):
        cfg = super().get_config()
        cfg.update(dim=self.dim, table=self.table, initializer=self.initializer,
                   optimizer=self.optimizer_spec)
        if self.admission:
            cfg["admission"] = self.admission
        if self.eviction:
            cfg["eviction"] = self.eviction
        if self.storage_dtype != "float32":
            cfg["storage_dtype"] = self.storage_dtype
        return cfg


def _embedding_tables(specs: dict) -> dict:
    from deeprec_ext.tf.dense import DENSE_PREFIX
    return {n: spec for n, spec in specs.items() if not n.startswith(DENSE_PREFIX)}


def model_record(model, dense_vars) -> dict:
    """What an offline export needs to rebuild ``model`` with stock TF ops: the Keras
    config (functional or Sequential models), the inputs, the dense variables' shapes and
    the tables' specs. A model Keras cannot serialize (a subclassed model without
    ``get_config``) is recorded as its tables only: the export then serves lookups only."""
    tables = _embedding_tables(get_context().client.table_specs)
    for layer in model._flatten_layers():
        if isinstance(layer, ElasticEmbedding):
            tables[layer.table] = {"dim": layer.dim, "initializer": layer.initializer,
                                   "optimizer": layer.optimizer_spec}
            if layer.storage_dtype != "float32":
                tables[layer.table]["dtype"] = layer.storage_dtype
    record = {"kind": "tables", "tables": tables,
              "dense_shapes": {v.path: [int(d) for d in v.shape] for v in dense_vars},
              "tensorflow": tf.__version__, "keras": keras.__version__}
    try:
        keras_json = model.to_json()
        inputs = model.inputs
    except Exception as exc:  # noqa: BLE001 - any serialization failure: tables only
        log.warning("model %s cannot be serialized by Keras (%s): its export will hold the "
                    "table lookups only", model.name, exc)
        return record
    record.update(kind="keras", keras_json=keras_json, input_is_dict=isinstance(model.input, dict),
                  inputs=[{"name": t.name, "dtype": str(t.dtype), "shape": list(t.shape)}
                          for t in inputs])
    return record


def _anchor_ids(model) -> set[int]:
    return {id(layer.anchor) for layer in model._flatten_layers()
            if isinstance(layer, ElasticEmbedding) and hasattr(layer, "anchor")}


class ElasticCallback(keras.callbacks.Callback):
    """Add to ``model.fit(callbacks=[...])`` in a job run by the AIMaster.

    - dense weights: created on the PS from the first worker's values, pulled before the
      first step, then synced every ``sync_every`` steps in the background while the next
      step trains (local delta pushed, merged value adopted, no local update lost), so all
      workers train one set of dense weights;
    - data: marks the shards of ``deeprec_ext.tf.shard_dataset`` DONE once their batches
      are trained and those batches' embedding pushes acknowledged (one step behind, as
      pushes are in flight one step), and returns unfinished shards if training stops early;
    - progress: steps and samples go to the AIMaster with the lease heartbeat;
    - leaving: when the AIMaster scales this worker in (or it gets SIGTERM), training stops
      at the next step boundary.
    """

    def __init__(self, sync_every: int = 1, overlap: bool | str = True):
        """``overlap=True`` (the default): a step's embedding push leaves from the
        backward pass and stays in flight while the step ends and the next step reads its
        input and starts; the dense sync runs in the background (with ``sync_every=1`` a
        second call per PS at the step's end). Lookups stay fresh: rows the push in
        flight changes are taken from its answer (the PS returns them), so a worker reads what a synchronous push would have
        left; rows fetched ahead (``look_ahead``) wait for that answer only to be patched.
        ``overlap=False``: every push is waited at the step's end.
        ``overlap="stale"`` skips that (less data on the wire, but each step reads
        embeddings one step stale: about -0.02 AUC on the example).
        ``overlap="carry"``: the step end sends nothing; the step's embedding push and
        dense deltas ride in the next step's lookup call, which the PS applies before it
        reads (one call per step per PS, the freshness of a waited push); the merged
        dense values are adopted at the next step end, as with ``overlap=True``. End of
        training, evaluation and ``flush_pushes`` send a held push at once."""
        super().__init__()
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if not (overlap is False or overlap is True or overlap in ("stale", "carry")):
            raise ValueError(f"overlap must be False, True, 'stale' or 'carry', got {overlap!r}")
        self.sync_every = sync_every
        self.overlap = overlap
        self._dense: DenseSync | None = None
        self._vars: list = []
        self._since_sync = 0
        self._last_batch = -1
        self._pool = None
        self._fused = False
        self._ops = None  # Gazer per-op sampler
        self._loss_curve = LossCurve.from_env(get_context)

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1

    def on_train_begin(self, logs=None):
        from concurrent.futures import ThreadPoolExecutor
        if is_evaluator():  # this process is the job's evaluator: score, never train
            self.model.stop_training = True
            run_keras_evaluator(self.model, self._vars_of)
            return
        ctx = get_context()
        ctx.async_pushes = self.overlap in (True, "stale")
        ctx.fresh_lookups = self.overlap != "stale"
        ctx.batcher.carry = self.overlap == "carry"
        self._ops = sampler_for(ctx)
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="dense-sync")
        anchors = _anchor_ids(self.model)
        self._vars = [v for v in self.model.trainable_variables if id(v) not in anchors]
        # synchronous every step: the step's embedding gradients and dense deltas share one
        # push per PS (held by the batcher until on_train_batch_end)
        # overlap: the embedding push leaves from the backward pass, as soon as every
        # table has pushed, and stays in flight while the step ends and the next one
        # starts (lookups stay fresh: they take the rows it changed from its answer); the
        # dense deltas leave at the step's end in a call of their own, whose merged
        # values the next step's end adopts. Leaving ~2 ms earlier, the push's answer
        # is waited for less: one more call a step, 0.4 ms a step shorter on average
        # here, in 6 of 8 paired runs (docs/BENCHMARKS.md)
        self._fused = bool(self.overlap) and self.sync_every == 1 and bool(self._vars)
        ctx.batcher.early_in_flight = self.overlap is True
        ctx.batcher.hold_pushes = (self.sync_every == 1 and bool(self._vars)
                                   and self.overlap is not True)
        if self._dense is None:
            self._dense = DenseSync(ctx.client, [v.path for v in self._vars],
                                    [tuple(v.shape) for v in self._vars])
            self._assign(self._dense.create([np.asarray(v.numpy()) for v in self._vars]))
            if ctx.rank == 0:
                ctx.put_model(model_record(self.model, self._vars))
        else:
            self._assign(self._dense.pull())

    def _vars_of(self, model):
        anchors = _anchor_ids(model)
        return [v for v in model.trainable_variables if id(v) not in anchors]

    def _assign(self, values):
        if getattr(self, "_writers_of", None) is not self._vars:
            self._writers, self._writers_of = [_writer(v) for v in self._vars], self._vars
        for write, value in zip(self._writers, values):
            write(value)

    def _dense_step(self) -> "_DenseStep | None":
        if getattr(self, "_step_of", None) is not self._vars:
            raws = _raw_variables(self._vars)
            self._step_fn, self._step_of = (_DenseStep(raws) if raws else None), self._vars
        return self._step_fn

    def _local(self):
        return [np.asarray(v.numpy()) for v in self._vars]

    def on_train_batch_begin(self, batch, logs=None):
        if self._ops is not None:
            self._ops.begin_trace()  # every N steps: profile this one

    def on_train_batch_end(self, batch, logs=None):
        ctx = get_context()
        # with steps_per_execution > 1 Keras calls this once per execution, with the
        # index of its last step: count every step it covers
        steps = max(1, batch - self._last_batch)
        self._last_batch = batch
        if self._ops is not None:
            self._ops.end_trace(steps)
        if self._loss_curve is not None and logs and "loss" in logs:
            self._loss_curve.step(steps, logs["loss"])
        if self._fused and self._dense is not None:
            if self.overlap == "carry":
                ctx.batcher.flush()  # the previous step's push, if no lookup carried it

            def send(updates, names):
                return ctx.batcher.end_step(updates, names, wait=False)
            step = self._dense_step()
            if step is not None:  # one TensorFlow call reads and writes every variable
                got = self._dense.take_answer()  # the previous step's call
                self._dense.start_sync_with(step.read() if got is None else step.adopt(*got),
                                            send, copy=False)
            else:
                local = self._local()
                merged = self._dense.finish_sync(local)  # the previous step's call
                if merged is not None:
                    self._assign(merged)
                    local = merged
                self._dense.start_sync_with(local, send)
            ctx.step_done(steps)
        elif ctx.batcher.hold_pushes and self._dense is not None:
            self._assign(self._dense.sync(self._local(), send=ctx.batcher.end_step))
            ctx.step_done(steps)
        else:
            ctx.step_done(steps)
            self._sync_dense(steps)
        if ctx.stop_requested.is_set():
            self.model.stop_training = True  # leave at this step boundary

    def _sync_dense(self, steps: int) -> None:
        if self._dense is not None and self._vars:
            merged = self._dense.finish_sync(self._local())
            if merged is not None:
                self._assign(merged)
            self._since_sync += steps
            if self._since_sync >= self.sync_every:
                if self.overlap in (True, "stale"):
                    self._dense.start_sync(self._local(), self._pool)
                else:
                    self._assign(self._dense.sync(self._local()))
                self._since_sync = 0

    def _sync_now(self):
        """Finish any background sync and send what is left (no local update is lost),
        adopting the merged values."""
        if self._dense is not None and self._vars:
            merged = self._dense.finish_sync(self._local())
            if merged is not None:
                self._assign(merged)
            self._assign(self._dense.sync(self._local()))
        self._since_sync = 0

    def on_train_end(self, logs=None):
        if is_evaluator():
            return  # nothing was trained, nothing is pushed
        get_context().batcher.hold_pushes = False
        get_context().batcher.early_in_flight = False
        get_context().gazer.pause_steps()
        get_context().settle()  # sends a push held for a next lookup too
        get_context().batcher.carry = False
        self._sync_now()
        get_context().tracker.finish()

    def on_test_begin(self, logs=None):
        """Evaluate with the shared weights."""
        if is_evaluator():
            return
        get_context().flush_pushes()
        self._sync_now()

    on_predict_begin = on_test_begin


def _raw_float32(v):
    """The ``tf.Variable`` a float32 Keras variable of the TensorFlow backend is, else None."""
    raw = getattr(v, "_value", None)
    if (isinstance(raw, tf.Variable) and raw.dtype == tf.float32
            and getattr(v, "dtype", None) == "float32"):
        return raw
    return None


def _raw_variables(variables) -> list | None:
    """``_raw_float32`` of every variable, or None if any is something else."""
    raws = [_raw_float32(v) for v in variables]
    return None if any(r is None for r in raws) else raws


class _DenseStep:
    """The dense sync's reads and writes of a step's variables as one TensorFlow call.

    Done op by op, the step end reads every variable (one eager op each) and writes the
    merged value back (another): 16 calls for DeepFM's 8 variables, 1.5 ms of the step
    end on the training thread (the step's critical path). ``adopt`` computes
    ``merged + (local - sent)`` (``DenseSync.finish_sync``, the same float32 arithmetic),
    assigns it and returns it, in one call.
    """

    def __init__(self, raws: list):
        specs = [tf.TensorSpec(r.shape, tf.float32) for r in raws]

        def adopt(merged, sent):
            out = []
            for r, m, s in zip(raws, merged, sent):
                value = m + (r.read_value() - s)
                r.assign(value, read_value=False)
                out.append(value)
            return out

        self._adopt = tf.function(adopt, input_signature=[specs, specs], autograph=False)
        self._read = tf.function(lambda: [r.read_value() for r in raws], autograph=False)

    def read(self) -> list[np.ndarray]:
        return [t.numpy() for t in self._read()]

    def adopt(self, merged, sent) -> list[np.ndarray]:
        return [t.numpy() for t in self._adopt(list(merged), list(sent))]


def _writer(v):
    """How the dense sync writes variable ``v`` every step: a float32 Keras variable of the
    TensorFlow backend is its own ``tf.Variable``, and Keras' ``assign`` is that variable's
    ``assign`` after a conversion, a shape check, a cast and with a read of the value it
    returns; the same AssignVariableOp without them costs 0.32-0.37 ms a step for DeepFM's
    8 variables against 0.80-0.96 ms. Anything else (another dtype or backend) keeps
    Keras' own ``assign``."""
    raw = _raw_float32(v)
    if raw is not None:
        shape = tuple(raw.shape)

        def write(value):
            value = np.asarray(value, np.float32)
            if value.shape != shape:  # Keras' own check, same message
                raise ValueError(f"The shape of the target variable and the shape of the "
                                 f"target value in `variable.assign(value)` must match. "
                                 f"variable.shape={shape}, Received: value.shape={value.shape}. "
                                 f"Target variable: {v}")
            raw.assign(value, read_value=False)
        return write
    return v.assign


def _from_logits(model) -> bool:
    loss = getattr(model, "loss", None)
    return bool(getattr(loss, "from_logits", False) or
                getattr(loss, "get_config", lambda: {})().get("from_logits", False))


def run_keras_evaluator(model, vars_of) -> list[dict]:
    """The evaluator's loop for a Keras model (``ElasticCallback`` in the evaluator role):
    dense weights pulled read-only each round, embeddings looked up read-only
    (``training=False``), records parsed by the ``shard_dataset`` parse_fn."""
    from deeprec_ext.tf.data import EVAL_INPUT
    ctx = get_context()
    parse_fn = EVAL_INPUT.get("parse_fn")
    state: dict = {}

    def refresh():
        if "dense" not in state:
            if not model.built or not vars_of(model):  # a subclassed model: build it first
                spec = eval_spec()
                first = next(record_batches(spec["files"], 1, spec.get("format", "auto"), kinds,
                                            EVAL_INPUT.get("null_values")), None)
                if first is not None:
                    score(first)
            dense_vars = vars_of(model)
            state["dense"] = DenseSync(ctx.client, [v.path for v in dense_vars],
                                       [tuple(v.shape) for v in dense_vars])
            state["vars"] = dense_vars
        for v, value in zip(state["vars"], state["dense"].pull()):
            v.assign(value)

    kinds = EVAL_INPUT.get("kinds")

    def score(records):
        if kinds is not None:  # typed Parquet columns (shard_dataset(columns=...))
            from deeprec_ext.data.tf_dataset import columns_from_flat
            batch = columns_from_flat([tf.constant(x) for x in records.flat()], kinds)
        else:
            batch = tf.constant(np.array(records, dtype=object), tf.string)
        parsed = parse_fn(batch) if parse_fn is not None else batch
        features, labels = parsed[0], parsed[1]
        return np.asarray(labels), model(features, training=False).numpy()
    return EvalLoop(ctx, score, refresh, from_logits=_from_logits(model), kinds=kinds,
                    null_values=EVAL_INPUT.get("null_values")).run()
