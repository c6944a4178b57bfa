"""A table's spec -- name, dim, initializer, optimizer -- converted in one place: to and
from its wire form (``ps_pb2.TableConfig``, specs as JSON text) and from a live table."""
from __future__ import annotations

import json

from deeprec_ext.errors import InvalidRequestError
from deeprec_ext.proto import ps_pb2


def to_wire(name: str, dim: int, initializer, optimizer) -> ps_pb2.TableConfig:
    """``initializer`` / ``optimizer``: a name or a dict, as ``create_table`` takes them."""
    return ps_pb2.TableConfig(name=name, dim=int(dim),
                              initializer_json=json.dumps(initializer, sort_keys=True),
                              optimizer_json=json.dumps(optimizer, sort_keys=True))


def of_table(table) -> ps_pb2.TableConfig:
    """The wire form of a store table (``EmbeddingTable.config``: resolved specs)."""
    cfg = table.config
    return to_wire(cfg["name"], cfg["dim"], cfg["initializer"], cfg["optimizer"])


def from_wire(cfg: ps_pb2.TableConfig) -> tuple[object, object]:
    """(initializer spec, optimizer spec) parsed from a TableConfig's JSON; empty means the
    defaults. The specs themselves are checked by the store (names, hyperparameters)."""
    try:
        init = json.loads(cfg.initializer_json) if cfg.initializer_json else "zeros"
        opt = json.loads(cfg.optimizer_json) if cfg.optimizer_json else "sgd"
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"table '{cfg.name}': malformed JSON config: {exc}") from None
    return init, opt
