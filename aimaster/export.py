"""Export a checkpoint as a SavedModel that stock TensorFlow (and TF Serving) loads.

Each embedding table becomes two variables and stock ops: ``ids`` (int64, ascending) and
``values`` ([rows, dim], float32 or float16); a lookup is ``tf.searchsorted`` on ``ids``
plus a ``gather``. Binary search rather than a hash table: nothing is built at load time,
and the keys live in the variables' checkpoint shards, not as graph constants (a GraphDef
is limited to 2 GB; a table's keys are not). An id that is not in the table gets the
table's initializer value for that id, computed with stock ops
(:mod:`deeprec_ext.serving.tf_initializers`): the same vector the live job returns at
inference (a lookup with ``training=False`` does not insert).

A Keras model is rebuilt from the config worker 0 recorded in the checkpoint, with every
``ElasticEmbedding`` swapped for a layer that reads those variables, and its dense
weights set from the checkpoint. The SavedModel has ``serving_default`` (the model's raw
inputs in, its outputs out) and one ``lookup_<table>`` signature per table (ids in,
``values`` out); a TF1 job's export has the lookup signatures only.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np

from deeprec_ext.store.policies import is_candidate_table

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16")


class ExportError(ValueError):
    """The export cannot be made; the message names the file, table or option."""


def _signature_name(table: str) -> str:
    return "lookup_" + re.sub(r"[^A-Za-z0-9_]", "_", table)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _table_module(tf, name: str, table, dtype: str):
    """A tf.Module serving one table: sorted ids, values, initializer for unseen ids."""
    from deeprec_ext.serving.tf_initializers import initial_values

    class TableLookup(tf.Module):
        def __init__(self):
            super().__init__(name=re.sub(r"[^A-Za-z0-9_]", "_", name))
            self.dim = table.dim
            self.size = len(table)
            self.init_config = table.config["initializer"]
            # a table with admission serves its default vector for ids without a row
            adm = table.config.get("admission")
            self.default = (None if not adm else
                            np.broadcast_to(np.asarray(adm.get("default", 0.0), np.float32),
                                            (self.dim,)).copy())
            # a one-row placeholder keeps an empty table's gathers valid; it never matches
            # (searchsorted + equality decide), so an empty table serves initial values
            ids = table.ids if self.size else np.zeros(1, np.int64)
            values = table.values if self.size else np.zeros((1, self.dim), np.float32)
            self.ids = tf.Variable(ids, trainable=False, name="ids")
            self.values = tf.Variable(values.astype(dtype), trainable=False, name="values")

        def lookup(self, ids):
            flat = tf.reshape(tf.cast(ids, tf.int64), [-1])
            pos = tf.minimum(tf.searchsorted(self.ids, flat, side="left", out_type=tf.int64),
                             tf.shape(self.ids, out_type=tf.int64)[0] - 1)
            found = tf.equal(tf.gather(self.ids, pos), flat)
            if self.size == 0:
                found = tf.zeros_like(found)
            stored = tf.cast(tf.gather(self.values, pos), tf.float32)
            if self.default is not None:
                fresh = tf.broadcast_to(tf.constant(self.default)[None, :],
                                        [tf.size(flat), self.dim])
            else:
                fresh = initial_values(self.init_config, self.dim, flat)
            out = tf.where(found[:, None], stored, fresh)
            shape = tf.concat([tf.shape(ids, out_type=tf.int32), [self.dim]], axis=0)
            return tf.reshape(out, shape)

    return TableLookup()


def _rebuild_keras(tf, record: dict, lookups: dict, dense: dict) -> tuple:
    """The recorded Keras model with stock-op embeddings and the checkpoint's dense
    weights; returns (model, warnings)."""
    import keras

    class ServingEmbedding(keras.layers.Layer):
        """``ElasticEmbedding`` at serving time: reads the exported table variables."""

        def __init__(self, dim, table=None, initializer=None, optimizer=None, admission=None,
                     eviction=None, storage_dtype=None, **kwargs):
            super().__init__(**kwargs)
            self.dim = dim
            self.table = table or self.name
            if self.table not in lookups:
                raise ExportError(f"the model uses table '{self.table}', which is not in the "
                                  f"export (tables: {sorted(lookups)})")

        def call(self, ids):
            return lookups[self.table].lookup(ids)

        def compute_output_shape(self, input_shape):
            return tuple(input_shape) + (self.dim,)

    try:
        model = keras.models.model_from_json(record["keras_json"],
                                             custom_objects={"ElasticEmbedding": ServingEmbedding})
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - Keras raises many kinds here
        raise ExportError(f"the recorded Keras model cannot be rebuilt here ({exc}); it was "
                          f"recorded with Keras {record.get('keras')}") from exc
    warnings = []
    for v in model.variables:
        value = dense.get(v.path)
        if value is None:
            if v.trainable:
                raise ExportError(f"the model's variable '{v.path}' has no value in the "
                                  f"checkpoint (it has {sorted(dense)})")
            warnings.append(f"non-trainable variable '{v.path}' is worker-local state, not "
                            "in the checkpoint: exported with its initial value")
            continue
        if int(np.prod(value.shape)) != int(np.prod(v.shape)):
            raise ExportError(f"variable '{v.path}': shape {list(v.shape)} in the model, "
                              f"{list(value.shape)} in the checkpoint")
        v.assign(np.asarray(value, np.float32).reshape(v.shape))
    return model, warnings


def _keep_frequent(table, min_count: int, where: str):
    """The rows updated by at least ``min_count`` pushes (the others are served like ids
    the model never saw: their initializer value)."""
    from checkpoint.load import Table
    if not table.counts.any() and len(table):
        raise ExportError(f"{where}: table '{table.name}' has no update counts (a checkpoint "
                          "written before they were recorded): min_count cannot be applied")
    keep = table.counts >= min_count
    return Table(table.name, table.ids[keep], table.values[keep], table.slots[keep],
                 table.config, table.counts[keep])


def _export_remote(checkpoint_dir, url: str, tables, dtype: str, min_count: int) -> dict:
    """Export to an object store (s3://...): TensorFlow needs tensorflow-io to write
    there, so the SavedModel is written into a local temporary directory, then uploaded
    file by file with ``saved_model.pb`` last -- TF Serving takes a version directory
    once that file exists, so it never loads a half-uploaded model."""
    import tempfile

    from checkpoint import CheckpointError, remote
    url = url.rstrip("/")
    try:
        if remote.exists(url):
            raise ExportError(f"{url} exists: export into a new directory (for TF Serving, "
                              "a new version number under the model's base path)")
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="deeprec-export-") as tmp:
        local = Path(tmp) / "model"
        summary = export(checkpoint_dir, local, tables=tables, dtype=dtype, min_count=min_count)
        files = sorted((p for p in local.rglob("*") if p.is_file()),
                       key=lambda p: (p.name == "saved_model.pb", str(p)))
        try:
            for p in files:
                remote.upload(p, remote.join(url, *p.relative_to(local).parts))
        except CheckpointError as exc:
            raise ExportError(f"upload of the SavedModel failed: {exc}") from None
    summary["dir"] = url
    return summary


def export(checkpoint_dir, out, tables=None, dtype: str = "float32", min_count: int = 0) -> dict:
    """Write the SavedModel of a checkpoint (a root: its newest chain; or one
    ``ckpt-*`` directory) into ``out``, which must not exist. Written into a temporary
    directory beside ``out`` and renamed, so ``out`` is complete or absent. ``min_count``:
    keep only rows updated by at least that many pushes. Returns a summary (dir, tables
    and their rows, signatures, bytes, seconds, warnings)."""
    from deeprec_ext.data import fs
    if fs.is_remote(str(out)):
        return _export_remote(checkpoint_dir, str(out), tables, dtype, min_count)
    from checkpoint import CheckpointError, load

    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 0:
        raise ExportError(f"min_count must be an integer >= 0, got {min_count!r}")
    out = Path(out)
    if out.exists():
        raise ExportError(f"{out} exists: export into a new directory (for TF Serving, a new "
                          "version number under the model's base path)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"cannot create {out.parent}: {exc.strerror}") from None
    try:
        loaded = load(checkpoint_dir, tables=tables, slots=False)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    record = loaded.model or {"kind": "tables", "tables": {}}
    for name in [n for n in loaded.tables if is_candidate_table(n)]:
        del loaded.tables[name]  # admission counters: training state, not served
    warnings = []
    dropped = {}
    if min_count:
        for name in list(loaded.tables):
            before = len(loaded.tables[name])
            loaded.tables[name] = _keep_frequent(loaded.tables[name], min_count, loaded.dir)
            dropped[name] = before - len(loaded.tables[name])
    if loaded.model is None:
        warnings.append("the checkpoint has no model record (no worker sent one): lookup "
                        "signatures only")
    # TensorFlow only now: a bad option or checkpoint fails in well under a second, not
    # after the seconds TF takes to import.
    import tensorflow as tf

    lookups = {name: _table_module(tf, name, t, dtype) for name, t in loaded.tables.items()}
    root = tf.Module()
    root.tables = lookups
    signatures = {}
    full_model = record.get("kind") == "keras" and tables is None
    if record.get("kind") == "keras" and tables is not None:
        warnings.append("a table subset was chosen: lookup signatures only, no serving_default")
    if full_model:
        model, w = _rebuild_keras(tf, record, lookups, loaded.dense)
        warnings += w
        root.model = model
        spec = {i["name"]: tf.TensorSpec([None] + list(i["shape"][1:]), i["dtype"], name=i["name"])
                for i in record["inputs"]}
        as_dict = record.get("input_is_dict", True)
        names = [i["name"] for i in record["inputs"]]

        @tf.function(input_signature=[spec], autograph=False)  # no Python control flow to convert
        def serve(features):
            x = features if as_dict else ([features[n] for n in names] if len(names) > 1
                                          else features[names[0]])
            y = model(x, training=False)
            if isinstance(y, dict):
                return y
            if isinstance(y, (list, tuple)):
                return {f"output_{i}": t for i, t in enumerate(y)}
            return {"predictions": y}

        signatures["serving_default"] = serve
    for name, module in lookups.items():
        def make(m):
            @tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name="ids")], autograph=False)
            def lookup(ids):
                return {"values": m.lookup(ids)}
            return lookup
        signatures[_signature_name(name)] = make(module)
    if not signatures:
        raise ExportError(f"{loaded.dir}: nothing to export (no table, no model record)")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tf.saved_model.save(root, str(tmp), signatures=signatures)
        (tmp / "assets.extra").mkdir(exist_ok=True)
        info = {"checkpoint": loaded.dir, "checkpoint_id": loaded.checkpoint_id,
                "global_step": loaded.global_step, "dtype": dtype, "min_count": min_count,
                "tables": {n: {"rows": len(t), "dim": t.dim,
                               "initializer": t.config["initializer"],
                               "signature": _signature_name(n)}
                           for n, t in loaded.tables.items()},
                "unseen_ids": "the table's initializer value for the id (as the live job "
                              "returns at inference)"}
        (tmp / "assets.extra" / "deeprec_export.json").write_text(json.dumps(info, indent=2))
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = {"dir": str(out.resolve()), "checkpoint": loaded.dir,
               "global_step": loaded.global_step,
               "tables": {n: len(t) for n, t in loaded.tables.items()},
               "signatures": sorted(signatures), "dtype": dtype, "min_count": min_count,
               "rows_below_min_count": dropped, "bytes": _du(out),
               "seconds": round(time.perf_counter() - start, 3), "warnings": warnings}
    for w in warnings:
        log.warning("export: %s", w)
    return summary
