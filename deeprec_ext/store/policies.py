"""Admission and eviction policies of a table: parsing and checking of their specs.

Admission (``admission=``) -- an id gets a row only once it has been looked up (for
training, ``insert_missing``) ``min_count`` times across all workers; until then a lookup
returns the table's fixed default vector and a gradient for it is dropped::

    {"min_count": 3}                                           # exact counter per id
    {"min_count": 3, "bloom": {"capacity": 1_000_000, "fpp": 0.01}}  # counting bloom filter
    {"min_count": 3, "default": 0.0}                           # or a list of ``dim`` floats

Counting: every lookup request counts each id it names once (the client de-duplicates
the ids of a batch, so this is one count per id per worker batch); a direct store call
counts every occurrence. Ids are counted on the PS that owns them, so the count is exact
across workers. Candidates are kept in a companion table of the store
(:func:`candidate_table_name`), partitioned by routing slot like rows, so they move with
their slot on migration, are replicated to the ring peer and are checkpointed like rows.
With ``bloom`` the companion table holds the filter's cells instead (bounded: about
``capacity * ln(1/fpp) / ln(2)^2`` cells whatever the number of candidates, BLOOM_BLOCK
float32 cells per row, about 7 bytes per cell); a row's key is made to route to the slot
of the ids hashed into its cells, so cells move with their slot too. A bloom filter over-counts (an id may be admitted early with probability about
``fpp``), never under-counts; its cells are never reset, so an evicted id that comes
back is admitted again at once.

Eviction (``eviction=``) -- rows are deleted (everywhere: owner, replica, next incremental
checkpoint) when::

    {"steps_to_live": 10000}   # not updated by the last S steps
    {"l2_below": 1e-4}         # the L2 norm of the value fell below x
    {"steps_to_live": 10000, "l2_below": 1e-4, "interval_seconds": 60}

either condition suffices; the PS checks every ``interval_seconds`` (default 60) and
before every checkpoint. A *step* is one push (gradient batch) applied to the table on
the PS holding the row: the table counts them. A row moved to another PS (migration,
promotion of a replica, restore) starts a fresh lease of ``steps_to_live`` steps there,
so a scale event or a recovery can delay an eviction, never bring one forward.
"""
from __future__ import annotations

import math
import numbers

CANDIDATE_SUFFIX = "::admission"

BLOOM_BLOCK = 16  # bloom cells per companion-table row (float32 counts)
MAX_MIN_COUNT = 1 << 24  # counts are kept as float32: exact up to 2**24
MAX_BLOOM_CELLS = 1 << 28


def candidate_table_name(table: str) -> str:
    """The companion table holding the admission candidates (or bloom cells) of ``table``."""
    return table + CANDIDATE_SUFFIX


def is_candidate_table(name: str) -> bool:
    return name.endswith(CANDIDATE_SUFFIX)


def _number(spec: dict, key: str, table: str, where: str, integer: bool = False):
    v = spec[key]
    ok = isinstance(v, numbers.Integral) if integer else isinstance(v, numbers.Real)
    try:
        ok = ok and not isinstance(v, bool) and math.isfinite(float(v))
    except OverflowError:  # an integer beyond float range
        ok = integer
    if not ok:
        kind = "an integer" if integer else "a finite number"
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
        raise ValueError(f"table '{table}': {where}.{key} must be {kind}, got {shown}")
    return int(v) if integer else float(v)


def _unknown(spec: dict, allowed: set, table: str, where: str) -> None:
    extra = sorted(set(spec) - allowed)
    if extra:
        raise ValueError(f"table '{table}': unknown {where} option(s) {extra}; "
                         f"known: {sorted(allowed)}")


def make_admission(spec, table: str, dim: int) -> dict | None:
    """The normalized admission spec (None: every id gets a row), or ValueError naming the
    table and the bad key."""
    if spec is None or spec == {}:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"table '{table}': admission must be a dict such as "
                         f"{{'min_count': 3}}, got {spec!r}")
    _unknown(spec, {"min_count", "bloom", "default"}, table, "admission")
    if "min_count" not in spec:
        raise ValueError(f"table '{table}': admission.min_count is required")
    n = _number(spec, "min_count", table, "admission", integer=True)
    if not 1 <= n <= MAX_MIN_COUNT:
        raise ValueError(f"table '{table}': admission.min_count must be within "
                         f"[1, {MAX_MIN_COUNT}], got {n}")
    out: dict = {"min_count": n}
    default = spec.get("default", 0.0)
    if isinstance(default, (list, tuple)):
        if len(default) != dim:
            raise ValueError(f"table '{table}': admission.default has {len(default)} "
                             f"values, the table's dim is {dim}")
        vals = [_number({"default": x}, "default", table, "admission") for x in default]
        out["default"] = vals if any(vals) else 0.0
    else:
        d = _number(spec, "default", table, "admission") if "default" in spec else 0.0
        out["default"] = d
    if out["default"] == 0.0:
        out.pop("default")
    bloom = spec.get("bloom")
    if bloom is not None:
        if not isinstance(bloom, dict):
            raise ValueError(f"table '{table}': admission.bloom must be a dict "
                             f"{{'capacity': C, 'fpp': p}}, got {bloom!r}")
        _unknown(bloom, {"capacity", "fpp"}, table, "admission.bloom")
        for key in ("capacity", "fpp"):
            if key not in bloom:
                raise ValueError(f"table '{table}': admission.bloom.{key} is required")
        cap = _number(bloom, "capacity", table, "admission.bloom", integer=True)
        fpp = _number(bloom, "fpp", table, "admission.bloom")
        if not 1 <= cap <= MAX_BLOOM_CELLS:
            raise ValueError(f"table '{table}': admission.bloom.capacity must be within "
                             f"[1, {MAX_BLOOM_CELLS}], got {cap}")
        if not 0.0 < fpp < 1.0:
            raise ValueError(f"table '{table}': admission.bloom.fpp must be within (0, 1), "
                             f"got {fpp}")
        cells, hashes = bloom_size(cap, fpp)
        if cells > MAX_BLOOM_CELLS:
            raise ValueError(f"table '{table}': admission.bloom needs {cells} cells for "
                             f"capacity {cap} at fpp {fpp}; at most {MAX_BLOOM_CELLS}")
        out["bloom"] = {"capacity": cap, "fpp": fpp}
    return out


def bloom_size(capacity: int, fpp: float) -> tuple[int, int]:
    """(cells, hash functions) of a counting bloom filter for ``capacity`` ids at ``fpp``."""
    cells = max(int(math.ceil(-capacity * math.log(fpp) / (math.log(2) ** 2))), 1)
    hashes = max(1, min(16, int(round(cells / capacity * math.log(2)))))
    return cells, hashes


def make_eviction(spec, table: str) -> dict | None:
    """The normalized eviction spec (None: rows are never evicted), or ValueError naming
    the table and the bad key."""
    if spec is None or spec == {}:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"table '{table}': eviction must be a dict such as "
                         f"{{'steps_to_live': 10000}}, got {spec!r}")
    _unknown(spec, {"steps_to_live", "l2_below", "interval_seconds"}, table, "eviction")
    if "steps_to_live" not in spec and "l2_below" not in spec:
        raise ValueError(f"table '{table}': eviction needs steps_to_live and/or l2_below")
    out: dict = {}
    if "steps_to_live" in spec:
        s = _number(spec, "steps_to_live", table, "eviction", integer=True)
        if s < 1:
            raise ValueError(f"table '{table}': eviction.steps_to_live must be >= 1, got {s}")
        out["steps_to_live"] = s
    if "l2_below" in spec:
        x = _number(spec, "l2_below", table, "eviction")
        if x <= 0:
            raise ValueError(f"table '{table}': eviction.l2_below must be > 0, got {x}")
        out["l2_below"] = x
    interval = _number(spec, "interval_seconds", table, "eviction") \
        if "interval_seconds" in spec else 60.0
    if not 0.0 < interval <= 86400.0:
        raise ValueError(f"table '{table}': eviction.interval_seconds must be within "
                         f"(0, 86400], got {interval}")
    out["interval_seconds"] = interval
    return out


def check_policies(table: str, dim: int, admission, eviction) -> None:
    """Refuse bad admission / eviction specs where a job defines its tables (the client,
    the Keras and TF1 APIs): ``InvalidRequestError`` naming the table and the key."""
    from deeprec_ext.errors import InvalidRequestError
    try:
        make_admission(admission, table, dim)
        make_eviction(eviction, table)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
