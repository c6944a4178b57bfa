"""A table's spec -- name, dim, initializer, optimizer, admission and eviction policies,
storage dtype --
converted in one place: to and from its wire form (``ps_pb2.TableConfig``, specs as JSON
text) and from a live table."""
from __future__ import annotations

import json

from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.proto import ps_pb2


def to_wire(name: str, dim: int, initializer, optimizer, admission=None,
            eviction=None, dtype=None) -> ps_pb2.TableConfig:
    """``initializer`` / ``optimizer``: a name or a dict, as ``create_table`` takes them;
    ``admission`` / ``eviction``: a dict or None (no policy); ``dtype``: the storage dtype
    (None / "float32": float32, sent as "" so older PS read the same message)."""
    return ps_pb2.TableConfig(name=name, dim=int(dim),
                              initializer_json=json.dumps(initializer, sort_keys=True),
                              optimizer_json=json.dumps(optimizer, sort_keys=True),
                              admission_json=(json.dumps(admission, sort_keys=True)
                                              if admission else ""),
                              eviction_json=(json.dumps(eviction, sort_keys=True)
                                             if eviction else ""),
                              dtype=("" if dtype in (None, "float32") else str(dtype)))


def of_table(table) -> ps_pb2.TableConfig:
    """The wire form of a store table (``EmbeddingTable.config``: resolved specs)."""
    cfg = table.config
    return to_wire(cfg["name"], cfg["dim"], cfg["initializer"], cfg["optimizer"],
                   cfg.get("admission"), cfg.get("eviction"), cfg.get("dtype"))


def from_wire(cfg: ps_pb2.TableConfig) -> tuple[object, object]:
    """(initializer spec, optimizer spec) parsed from a TableConfig's JSON; empty means the
    defaults. The specs themselves are checked by the store (names, hyperparameters)."""
    try:
        init = json.loads(cfg.initializer_json) if cfg.initializer_json else "zeros"
        opt = json.loads(cfg.optimizer_json) if cfg.optimizer_json else "sgd"
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"table '{cfg.name}': malformed JSON config: {exc}") from None
    return init, opt


def policies(cfg: ps_pb2.TableConfig) -> dict:
    """``{"admission": ..., "eviction": ..., "dtype": ...}`` keyword arguments of
    ``create_table`` parsed from a TableConfig (None: no policy; dtype "float32" when
    empty); checked by the store."""
    out = {"dtype": cfg.dtype or "float32"}
    for key, text in (("admission", cfg.admission_json), ("eviction", cfg.eviction_json)):
        try:
            out[key] = json.loads(text) if text else None
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRequestError(f"table '{cfg.name}': malformed {key} JSON: {exc}") \
                from None
    return out
