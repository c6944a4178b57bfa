"""What a model holds, from the model itself: elastic tables, plain embeddings and large
variables (candidates for ElasticEmbedding), dense variables, FLOPs per sample.

Targets:

* ``module:function`` -- called with ``--arg`` keyword arguments. It returns a Keras model,
  or builds a TF1 graph (into the default graph; a function that needs graph mode is
  re-run inside a fresh ``tf.Graph``).
* a SavedModel directory; a MetaGraph (``.meta``) or GraphDef (``.pb``/``.pbtxt``) file.

Elastic tables are read from the ``ElasticEmbedding`` layers of a Keras model, or from the
``deeprec_table_spec`` string constants that ``ElasticEmbedding.call`` and
``dtf.embedding_lookup`` leave in every traced graph (they survive in GraphDefs and
SavedModels, where layer attributes do not). Building runs under a planning context whose
client records ``create_table`` and talks to no PS.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from graph_opt.api import Candidate, DenseVariable, EstimateError, TableEstimate
from graph_opt.memory import slots_per_row

TABLE_SPEC_OP = "deeprec_table_spec"  # deeprec_ext.tf.keras_api.TABLE_SPEC_OP
ANCHOR_SUFFIX = "push_anchor"
LARGE_VARIABLE_ROWS = 100_000
LARGE_VARIABLE_BYTES = 64 * 2 ** 20
_PASS_THROUGH = {"Cast", "Reshape", "Identity", "Squeeze", "ExpandDims", "StopGradient"}


@dataclass
class Inventory:
    kind: str
    tables: list[TableEstimate] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    dense: list[DenseVariable] = field(default_factory=list)
    flops_per_sample: int | None = None
    warnings: list[str] = field(default_factory=list)


# -- planning context: build the model without a PS ----------------------------------------
class RecordingClient:
    """Stands in for PSClient while a model is built for planning: records the tables
    the model declares; any data-plane call is a bug (building must not train)."""

    def __init__(self):
        self.tables: dict[str, dict] = {}

    def create_table(self, name, dim, initializer="zeros", optimizer="sgd", admission=None,
                     eviction=None, dtype="float32", **_):
        self.tables[name] = {"dim": int(dim), "initializer": initializer, "optimizer": optimizer,
                             "admission": admission, "eviction": eviction, "dtype": dtype}

    def __getattr__(self, item):
        raise EstimateError(f"the model called PSClient.{item} while being built for "
                            f"planning; build it without training or running it")


class PlanningContext:
    def __init__(self):
        self.client = RecordingClient()
        self.stop_requested = threading.Event()


@contextmanager
def planning_context():
    from deeprec_ext import worker
    prev = getattr(worker, "_context", None)
    ctx = PlanningContext()
    worker.set_context(ctx)
    try:
        yield ctx
    finally:
        worker.set_context(prev)


# -- loading -------------------------------------------------------------------------------
def load_callable(target: str):
    module_name, _, fn_name = target.partition(":")
    if not module_name or not fn_name:
        raise EstimateError(f"{target!r} is not module:function, a SavedModel directory "
                            f"or a graph file")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise EstimateError(f"cannot import module {module_name!r}: {exc}") from exc
    except Exception as exc:  # the user's module failed while importing
        raise EstimateError(f"importing module {module_name!r} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise EstimateError(f"module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise EstimateError(f"{target} is not callable (it is a {type(fn).__name__})")
    return fn


def inspect_target(target: str, fn_kwargs: dict | None = None) -> Inventory:
    """Inventory of a ``module:function``, SavedModel directory or graph file."""
    import tensorflow as tf
    if os.path.isdir(target):
        return inspect_saved_model(target)
    if os.path.isfile(target):
        return inspect_graph_file(target)
    fn = load_callable(target)
    import keras
    with planning_context() as ctx:
        result, eager_error = None, None
        try:
            result = _call(fn, fn_kwargs, target)
        except EstimateError as exc:
            eager_error = exc  # maybe a TF1 builder that needs graph mode: retried below
        if isinstance(result, keras.Model):
            return inspect_keras(result, ctx.client.tables)
        if not tf.executing_eagerly() and tf.compat.v1.get_default_graph().get_operations():
            return inspect_graph(tf.compat.v1.get_default_graph(), "tf1", ctx.client.tables)
        graph = tf.Graph()
        try:
            with graph.as_default():
                result = _call(fn, fn_kwargs, target)
        except EstimateError:
            if eager_error is not None and "eager execution" not in str(eager_error):
                raise eager_error from None
            raise
        if isinstance(result, keras.Model):
            if eager_error is not None:
                # the model failed to build eagerly: that is its own error, not a mode problem
                raise eager_error from None
            raise EstimateError(f"{target} builds a Keras model only in graph mode; build "
                                f"it eagerly (TF2 default)")
        if not graph.get_operations():
            raise EstimateError(f"{target} returned {type(result).__name__} and built no "
                                f"graph: not a model (return a keras.Model, or build a "
                                f"TF1 graph into the default graph)")
        return inspect_graph(graph, "tf1", ctx.client.tables)


def _call(fn, kwargs, target):
    try:
        return fn(**(kwargs or {}))
    except EstimateError:
        raise
    except TypeError as exc:
        raise EstimateError(f"calling {target}({_fmt_kwargs(kwargs)}) failed: {exc} "
                            f"(pass arguments with --arg NAME=VALUE)") from exc
    except Exception as exc:
        raise EstimateError(f"building the model with {target} failed: "
                            f"{type(exc).__name__}: {exc}") from exc


def _fmt_kwargs(kwargs) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in (kwargs or {}).items())


# -- tables ----------------------------------------------------------------------------------
def _table(spec: dict, warnings: list) -> TableEstimate:
    opt = spec.get("optimizer")
    assumed = opt is None
    if assumed:
        from deeprec_ext.tf.keras_api import DEFAULT_OPTIMIZER
        opt = DEFAULT_OPTIMIZER
        warnings.append(f"table {spec['table']!r}: optimizer not recorded in the graph, "
                        f"assumed {opt['name']} (override with --optimizer)")
    name = opt.get("name") if isinstance(opt, dict) else opt
    try:
        slots = slots_per_row(opt)
    except ValueError as exc:
        raise EstimateError(f"table {spec['table']!r}: {exc}") from exc
    from deeprec_ext.store.policies import make_admission, make_eviction
    try:  # the planner sizes rows by the policies (graph_opt.estimation)
        admission = make_admission(spec.get("admission"), spec["table"], int(spec["dim"]))
        eviction = make_eviction(spec.get("eviction"), spec["table"])
    except ValueError as exc:
        raise EstimateError(str(exc)) from exc
    return TableEstimate(name=spec["table"], dim=int(spec["dim"]), optimizer=str(name),
                         num_slots=slots, initializer=spec.get("initializer"),
                         key_dtype=spec.get("key_dtype", "int64"), optimizer_assumed=assumed,
                         admission=admission, eviction=eviction,
                         storage_dtype=spec.get("dtype") or "float32")


def _spec_consts(nodes) -> list[dict]:
    """Table specs from the ``deeprec_table_spec`` constants among NodeDefs."""
    specs = []
    for nd in nodes:
        if nd.op == "Const" and nd.name.rsplit("/", 1)[-1].startswith(TABLE_SPEC_OP):
            vals = nd.attr["value"].tensor.string_val
            if vals:
                try:
                    specs.append(json.loads(vals[0].decode("utf-8")))
                except (ValueError, UnicodeDecodeError):
                    continue
    return specs


def _dedupe(specs: list[dict]) -> list[dict]:
    out: dict[str, dict] = {}
    for s in specs:
        out.setdefault(s["table"], s)
    return list(out.values())


# -- Keras -----------------------------------------------------------------------------------
def inspect_keras(model, recorded: dict) -> Inventory:
    import keras

    from deeprec_ext.tf.keras_api import ElasticEmbedding
    inv = Inventory(kind="keras")
    seen = set()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, ElasticEmbedding):
            if layer.table in seen:
                continue
            seen.add(layer.table)
            t = _table({"table": layer.table, "dim": layer.dim,
                        "initializer": layer.initializer, "optimizer": layer.optimizer_spec,
                        "admission": layer.admission, "eviction": layer.eviction,
                        "dtype": layer.storage_dtype},
                       inv.warnings)
            feature, dtype, per_sample = _keras_feature(layer)
            t.feature, t.input_dtype, t.ids_per_sample = feature, dtype, per_sample
            inv.tables.append(t)
        elif isinstance(layer, keras.layers.Embedding):
            v = layer.embeddings
            shape = [int(d) for d in v.shape]
            inv.candidates.append(Candidate(
                name=layer.name, kind="keras.layers.Embedding", shape=shape,
                bytes=4 * math.prod(shape),
                reason=f"local table of {shape[0]:,} rows x {shape[1]}: every worker holds "
                       f"it and ids must be reduced modulo the vocabulary; use "
                       f"dtf.ElasticEmbedding({shape[1]}, table={layer.name!r})"))
    for name, spec in recorded.items():  # tables created outside layers
        if name not in seen:
            inv.tables.append(_table({"table": name, **spec}, inv.warnings))
            seen.add(name)
    cand_paths = {c.name for c in inv.candidates}
    for v in model.trainable_variables:
        path = v.path
        if path.endswith(ANCHOR_SUFFIX):
            continue
        shape = [int(d) for d in v.shape]
        inv.dense.append(DenseVariable(name=path, shape=shape, params=math.prod(shape),
                                       dtype=str(v.dtype)))
        if path.split("/")[0] not in cand_paths:
            _flag_large(inv, path, shape, 4 * math.prod(shape))
    inv.flops_per_sample = _keras_flops(model, inv.warnings)
    return inv


def _keras_feature(layer):
    """(feature name, dtype, ids per sample) of the model input feeding ``layer``."""
    try:
        node = layer._inbound_nodes[0]
        x = node.input_tensors[0]
    except (AttributeError, IndexError):
        return None, None, None
    shape = list(x.shape)[1:]
    per_sample = math.prod(shape) if all(d is not None for d in shape) else None
    hist = getattr(x, "_keras_history", None)
    src = hist[0] if hist else None
    feature = src.name if src is not None and type(src).__name__ == "InputLayer" else None
    return feature, str(getattr(x, "dtype", None)), per_sample


def _flag_large(inv: Inventory, name: str, shape: list, nbytes: int, gathered: bool = False):
    if gathered and len(shape) == 2:
        inv.candidates.append(Candidate(name=name, kind="gathered variable", shape=shape,
                                        bytes=nbytes, reason="rows are gathered by id: an "
                                        "embedding table kept as a local variable"))
    elif shape and (shape[0] >= LARGE_VARIABLE_ROWS or nbytes >= LARGE_VARIABLE_BYTES):
        inv.candidates.append(Candidate(name=name, kind="large variable", shape=shape,
                                        bytes=nbytes, reason=f"{nbytes / 2**20:.1f} MiB with "
                                        f"{shape[0]:,} rows; shared whole every sync"))


def _profile_flops(graph, exclude_scopes=("gradients",)) -> int:
    from tensorflow.python.profiler import model_analyzer, option_builder
    opts = option_builder.ProfileOptionBuilder.float_operation()
    opts["output"] = "none"
    with _quiet():
        res = model_analyzer.profile(graph=graph, options=opts)
    total = 0
    for child in res.children:  # top-level scopes
        if child.name.split("/")[0] not in exclude_scopes:
            total += child.total_float_ops
    return total


@contextmanager
def _quiet():
    import logging
    log = logging.getLogger("tensorflow")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _keras_flops(model, warnings) -> int | None:
    """Forward FLOPs per sample: profile the call at batch 1 and 2, take the difference
    (drops any batch-independent work)."""
    import tensorflow as tf
    structure = model.input

    def spec(batch):
        def one(t):
            shape = list(t.shape)
            if any(d is None for d in shape[1:]):
                raise ValueError(f"input {t.name} has unknown dims {shape}")
            return tf.TensorSpec([batch] + shape[1:], t.dtype)
        return tf.nest.map_structure(one, structure)

    try:
        counts = []
        for b in (1, 2):
            fn = tf.function(lambda x: model(x, training=False))
            counts.append(_profile_flops(fn.get_concrete_function(spec(b)).graph))
        return max(counts[1] - counts[0], 0)
    except Exception as exc:  # noqa: BLE001 - FLOPs are best effort
        warnings.append(f"FLOPs not computed: {type(exc).__name__}: {exc}")
        return None


# -- TF1 graphs, GraphDefs, MetaGraphs --------------------------------------------------------
def inspect_graph(graph, kind: str, recorded: dict | None = None) -> Inventory:
    inv = Inventory(kind=kind)
    gdef = graph.as_graph_def()
    specs = _dedupe(_spec_consts(gdef.node) + _library_specs(gdef))
    names = {s["table"] for s in specs}
    specs += [{"table": n, **s} for n, s in (recorded or {}).items() if n not in names]
    by_name = {nd.name: nd for nd in gdef.node}
    for s in specs:
        t = _table(s, inv.warnings)
        t.feature, t.input_dtype, t.ids_per_sample = _graph_feature(by_name, t.name)
        inv.tables.append(t)
    _graph_variables(inv, gdef)
    inv.flops_per_sample = _graph_flops(gdef, inv.warnings)
    return inv


def _library_specs(gdef) -> list[dict]:
    out = []
    for f in gdef.library.function:
        out += _spec_consts(f.node_def)
    return out


def _clean(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in name)


def _graph_feature(by_name: dict, table: str):
    """Walk back from the table's lookup op to the Placeholder feeding it."""
    suffix = f"ps_lookup_{_clean(table)}"
    look = next((nd for n, nd in by_name.items() if n.rsplit("/", 1)[-1].startswith(suffix)), None)
    if look is None or not look.input:
        return None, None, None
    nd = by_name.get(look.input[0].split(":")[0].lstrip("^"))
    if nd is not None and nd.op == "Unique":
        nd = by_name.get(nd.input[0].split(":")[0])
    for _ in range(16):
        if nd is None or nd.op not in _PASS_THROUGH:
            break
        nd = by_name.get(nd.input[0].split(":")[0])
    if nd is None or nd.op not in ("Placeholder", "PlaceholderWithDefault"):
        return None, None, None
    import tensorflow as tf
    dims = [d.size for d in nd.attr["shape"].shape.dim]
    per = math.prod(dims[1:]) if dims and all(d >= 0 for d in dims[1:]) else None
    return nd.name.rsplit("/", 1)[-1], tf.dtypes.as_dtype(nd.attr["dtype"].type).name, per


_VAR_OPS = {"VarHandleOp", "VariableV2", "Variable"}


def _graph_variables(inv: Inventory, gdef) -> None:
    import tensorflow as tf
    by_name = {nd.name: nd for nd in gdef.node}
    gathered = set()
    for nd in gdef.node:
        if nd.op in ("ResourceGather", "GatherV2", "Gather") and nd.input:
            src = by_name.get(nd.input[0].split(":")[0])
            for _ in range(4):
                if src is None or src.op in _VAR_OPS:
                    break
                src = by_name.get(src.input[0].split(":")[0]) if src.input else None
            if src is not None and src.op in _VAR_OPS:
                gathered.add(src.name)
    for nd in gdef.node:
        if nd.op not in _VAR_OPS or nd.name.endswith(ANCHOR_SUFFIX):
            continue
        if nd.name.startswith(("gradients", "beta1_power", "beta2_power", "global_step")) or \
                "/Adam" in nd.name or "/Adagrad" in nd.name or "/Momentum" in nd.name \
                or "/Ftrl" in nd.name:
            continue  # optimizer state and step counters are not model weights
        dtype = tf.dtypes.as_dtype(nd.attr["dtype"].type)
        if not dtype.is_floating:
            continue
        shape = [d.size for d in nd.attr["shape"].shape.dim]
        params = math.prod(shape)
        inv.dense.append(DenseVariable(name=nd.name, shape=shape, params=params,
                                       dtype=dtype.name))
        _flag_large(inv, nd.name, shape, dtype.size * params, gathered=nd.name in gathered)


def _graph_flops(gdef, warnings) -> int | None:
    """Forward FLOPs per sample of a GraphDef: re-import it with the unknown batch
    dimension of each Placeholder fixed to 1 and to 2, profile both, subtract;
    the ``gradients`` scope is left out."""
    import tensorflow as tf
    v1 = tf.compat.v1
    placeholders = [nd for nd in gdef.node if nd.op == "Placeholder"]
    variable = [nd for nd in placeholders if nd.attr["shape"].shape.dim
                and nd.attr["shape"].shape.dim[0].size < 0]
    try:
        counts = []
        for b in (1, 2):
            g = tf.Graph()
            with g.as_default():
                input_map = {}
                for nd in variable:
                    dims = [d.size if d.size >= 0 else None for d in nd.attr["shape"].shape.dim]
                    dims[0] = b
                    input_map[nd.name] = v1.placeholder(tf.dtypes.as_dtype(nd.attr["dtype"].type),
                                                        dims, name=nd.name + "_b")
                with _quiet():
                    tf.graph_util.import_graph_def(gdef, input_map=input_map, name="")
            counts.append(_profile_flops(g))
        if not variable:
            static = [nd.attr["shape"].shape.dim[0].size for nd in placeholders
                      if nd.attr["shape"].shape.dim]
            if not static:
                warnings.append("FLOPs: no Placeholder with a batch dimension; the figure "
                                "is for the whole graph")
                return counts[0]
            return counts[0] // max(static[0], 1)
        return max(counts[1] - counts[0], 0)
    except Exception as exc:  # noqa: BLE001 - FLOPs are best effort
        warnings.append(f"FLOPs not computed: {type(exc).__name__}: {exc}")
        return None


def inspect_graph_file(path: str) -> Inventory:
    import tensorflow as tf
    from google.protobuf import message, text_format
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise EstimateError(f"cannot read {path}: {exc.strerror}") from exc
    candidates = ([(meta_graph_pb2.MetaGraphDef, "metagraph"), (graph_pb2.GraphDef, "graphdef")]
                  if path.endswith(".meta") else
                  [(graph_pb2.GraphDef, "graphdef"), (meta_graph_pb2.MetaGraphDef, "metagraph")])
    for cls, kind in candidates:
        proto = cls()
        try:
            if path.endswith((".pbtxt", ".txt")):
                text_format.Parse(data.decode("utf-8"), proto)
            else:
                proto.ParseFromString(data)
        except (message.DecodeError, text_format.ParseError, UnicodeDecodeError):
            continue
        gdef = proto.graph_def if kind == "metagraph" else proto
        if not gdef.node:
            continue
        graph = tf.Graph()
        try:
            with graph.as_default(), _quiet():
                tf.graph_util.import_graph_def(gdef, name="")
        except (ValueError, tf.errors.OpError) as exc:
            raise EstimateError(f"{path}: the graph does not import: {exc}") from exc
        return inspect_graph(graph, kind)
    raise EstimateError(f"{path} is not a readable MetaGraphDef or GraphDef (binary, or "
                        f"text with .pbtxt)")


# -- SavedModel ------------------------------------------------------------------------------
def inspect_saved_model(path: str) -> Inventory:
    import tensorflow as tf
    from google.protobuf import message, text_format
    from tensorflow.core.protobuf import saved_model_pb2
    pb, pbtxt = os.path.join(path, "saved_model.pb"), os.path.join(path, "saved_model.pbtxt")
    sm = saved_model_pb2.SavedModel()
    try:
        if os.path.exists(pb):
            with open(pb, "rb") as f:
                sm.ParseFromString(f.read())
        elif os.path.exists(pbtxt):
            with open(pbtxt, encoding="utf-8") as f:
                text_format.Parse(f.read(), sm)
        else:
            raise EstimateError(f"{path} is not a SavedModel directory (no saved_model.pb)")
    except (OSError, message.DecodeError, text_format.ParseError, UnicodeDecodeError) as exc:
        raise EstimateError(f"cannot read SavedModel {path}: {exc}") from exc
    if not sm.meta_graphs:
        raise EstimateError(f"SavedModel {path} holds no MetaGraph")
    mg = sm.meta_graphs[0]
    inv = Inventory(kind="savedmodel")
    gdef = mg.graph_def
    for s in _dedupe(_spec_consts(gdef.node) + _library_specs(gdef)):
        inv.tables.append(_table(s, inv.warnings))
    _saved_variables(inv, mg)
    inv.flops_per_sample = _saved_model_flops(path, mg, inv.warnings)
    return inv


def _saved_variables(inv: Inventory, mg) -> None:
    import tensorflow as tf
    og = mg.object_graph_def
    # full paths: walk the object graph from the root, naming nodes by their edges
    paths: dict[int, str] = {}
    stack = [(0, "")]
    while stack and og.nodes:
        i, p = stack.pop()
        if i in paths:
            continue
        paths[i] = p
        for c in og.nodes[i].children:
            if not c.local_name.startswith("_") or c.local_name in ("_kernel",):
                stack.append((c.node_id, f"{p}/{c.local_name}" if p else c.local_name))
    found = False
    for i, node in enumerate(og.nodes):
        if node.WhichOneof("kind") != "variable":
            continue
        found = True
        var = node.variable
        name = var.name or paths.get(i, f"variable_{i}")
        if name.endswith(ANCHOR_SUFFIX) or not tf.dtypes.as_dtype(var.dtype).is_floating:
            continue
        if not var.trainable:
            continue  # optimizer state, step counters, moving statistics: not on the PS
        shape = [d.size for d in var.shape.dim]
        params = math.prod(shape)
        inv.dense.append(DenseVariable(name=name, shape=shape, params=params,
                                       dtype=tf.dtypes.as_dtype(var.dtype).name))
        nbytes = tf.dtypes.as_dtype(var.dtype).size * params
        if name.rsplit("/", 1)[-1] == "embeddings" and len(shape) == 2:
            inv.candidates.append(Candidate(
                name=name, kind="keras.layers.Embedding", shape=shape, bytes=nbytes,
                reason=f"local table of {shape[0]:,} rows x {shape[1]}; use "
                       f"dtf.ElasticEmbedding({shape[1]})"))
        else:
            _flag_large(inv, name, shape, nbytes)
    if not found:
        _graph_variables(inv, mg.graph_def)


def _saved_model_flops(path: str, mg, warnings) -> int | None:
    """Load the serving signature, trace it at batch 1 and 2, inline every function call
    (``convert_variables_to_constants_v2``), profile the flat graphs."""
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2)
    if "serving_default" not in mg.signature_def:
        warnings.append("FLOPs not computed: the SavedModel has no serving_default signature")
        return None
    try:
        with _quiet():
            loaded = tf.saved_model.load(path)
        sig = loaded.signatures["serving_default"]
        inputs = sig.structured_input_signature[1]
        counts = []
        for b in (1, 2):
            specs = {k: tf.TensorSpec([b] + list(v.shape)[1:], v.dtype, name=k)
                     for k, v in inputs.items()}
            cf = tf.function(lambda **kw: sig(**kw)).get_concrete_function(**specs)
            with _quiet():
                frozen = convert_variables_to_constants_v2(cf)
            counts.append(_profile_flops(frozen.graph))
        return max(counts[1] - counts[0], 0)
    except Exception as exc:  # noqa: BLE001 - FLOPs are best effort
        warnings.append(f"FLOPs not computed: {type(exc).__name__}: {exc}")
        return None
