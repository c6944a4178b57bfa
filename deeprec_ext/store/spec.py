"""Parsing of the ``"name"`` / ``{"name": ..., **params}`` specs shared by initializers
and optimizers."""
from __future__ import annotations

import numpy as np


def split_spec(spec, kind: str) -> tuple[str, dict]:
    """``(name, params)`` of a spec; ValueError naming the problem otherwise."""
    if isinstance(spec, str):
        name, params = spec, {}
    elif isinstance(spec, dict):
        if "name" not in spec:
            raise ValueError(f"{kind} spec {spec!r} has no 'name' field")
        params = dict(spec)
        name = params.pop("name")
    else:
        raise ValueError(f"{kind} spec must be a str or dict, got {type(spec).__name__}")
    if not isinstance(name, str):
        raise ValueError(f"{kind} name must be a string, got {name!r}")
    return name, params


STORAGE_DTYPES = ("float32", "float16")


def check_dtype(dtype, table: str) -> str:
    """A table's storage dtype checked: "float32" (the default, also for None / "") or
    "float16" (numpy dtypes of those accepted); anything else is a ValueError naming the
    table."""
    if dtype is None or dtype == "":
        return "float32"
    name = dtype
    if not isinstance(dtype, str) and dtype is not float:  # np.float16, np.dtype("float16")
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if not isinstance(name, str) or name not in STORAGE_DTYPES:
        raise ValueError(f"table '{table}': dtype must be one of {list(STORAGE_DTYPES)}, "
                         f"got {dtype!r}")
    return name
