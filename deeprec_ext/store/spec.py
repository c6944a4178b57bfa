"""Parsing of the ``"name"`` / ``{"name": ..., **params}`` specs shared by initializers
and optimizers."""
from __future__ import annotations


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
