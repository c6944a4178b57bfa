"""PS memory model: the bytes a PS process holds for given tables, from the store's layout.

It mirrors ``deeprec_ext/store/table.py`` and ``hash_index.py`` (keep them in step):

* **arena** ``float32 [capacity, dim * (1 + num_slots)]``: value then optimizer slots. It
  grows x2 with ``np.zeros``, whose untouched pages the OS maps lazily, and growth copies
  only the used rows, so what is resident is the used rows: ``4 * row_width`` per row
  (float16 value storage: ``2 * dim + 4 * dim * num_slots``).
* **per-row arrays** ``row_seq``, ``row_key`` (int64, copied on growth) and ``row_count``
  (uint32 update counts): 20 bytes per used row.
* **hash index** ``int32 [cap]`` (row ids; the keys are read from ``row_key``) = 4 bytes
  per position, all resident (keys hash uniformly over the positions). ``cap`` is a power of two,
  at least 2048 (a new table's index), doubled whenever full + deleted positions would
  pass 1/2: the smallest power of two ``>= 2 * rows``.
* **ring replica**: with 2 or more PS, each PS also keeps a copy of its ring
  predecessor's tables in the same layout (``deeprec_ext/ps/replication.py``), so it
  holds about twice its own rows.
* **push request ids**: the last <= 200,000 applied push ids (own dedup window, and the
  replica's log of its peer's), about ``REQUEST_ID_BYTES`` each.
* **allocator**: measured, not derived (bench/bench_estimate.py, docs/guide-planning.md).
  glibc serves arrays below its (dynamic, up to 32 MiB) mmap threshold from the heap, and
  the freed earlier generations of the index and per-row arrays stay resident there:
  ``RETAINED_FACTOR`` x (index + row arrays). numpy asks for transparent huge pages on
  arrays >= 4 MiB, so each such array rounds up by about ``HUGE_PAGE_SLACK``.
* **base**: the PS process with no tables (Python, numpy, grpc, psutil, protos, gRPC
  threads), measured once (``BASE_RSS_BYTES``).
"""
from __future__ import annotations

import math

# Optimizer slot vectors per row (each ``dim`` floats), from
# deeprec_ext/store/optimizers.py. Kept here so estimating never imports the store;
# tests check it against the real optimizer classes.
SLOTS_PER_ROW = {"sgd": 0, "adagrad": 1, "ftrl": 2, "adam": 3, "assign_add": 0}

ROW_ARRAY_BYTES = 20          # row_seq + row_key (int64) + row_count (uint32)
ROW_STEP_BYTES = 8            # _row_step (int64): the step a row was last updated (eviction)
INDEX_BYTES_PER_POSITION = 4   # _tab int32 [cap]
MIN_INDEX_CAPACITY = 2048      # EmbeddingTable(initial_capacity=1024) -> HashIndex(2048)
MIN_ARENA_ROWS = 1024
REQUEST_ID_WINDOW = 200_000    # AppliedRequests capacity / replica log length
REQUEST_ID_BYTES = 160         # str object + OrderedDict / list entry

# RSS of an idle PS process (python -m deeprec_ext.ps registered with an AIMaster, no
# table): 53.6-54.0 MiB measured on the reference machine (Python 3.11, numpy 2.4, grpcio
# 1.85; docs/guide-planning.md). Override with --ps-base-mb.
BASE_RSS_BYTES = 54 * 2 ** 20
RETAINED_FACTOR = 1.15
HUGE_PAGE_SLACK = 2 ** 20
_HUGE_PAGE_MIN = 4 * 2 ** 20


def slots_per_row(optimizer) -> int:
    """Slot vectors of an optimizer spec (``"adam"`` or ``{"name": "adam", ...}``)."""
    name = optimizer.get("name") if isinstance(optimizer, dict) else optimizer
    if not isinstance(name, str) or name.lower() not in SLOTS_PER_ROW:
        raise ValueError(f"unknown optimizer {optimizer!r} (expected one of "
                         f"{sorted(SLOTS_PER_ROW)})")
    return SLOTS_PER_ROW[name.lower()]


def index_capacity(rows: int, churn: bool = False) -> int:
    """Hash-index positions of a table holding ``rows`` keys. Without deletes it doubles
    once ``2 x rows`` would pass it; under delete churn (eviction) tombstones fill it too
    and a rehash keeps the capacity only while ``8 x rows <= 3 x cap`` (hash_index.reserve)."""
    cap = MIN_INDEX_CAPACITY
    while (8 * rows > 3 * cap) if churn else (2 * rows > cap):
        cap *= 2
    return cap


def table_bytes(rows: int, dim: int, num_slots: int, evicting: bool = False,
                value_bytes: int = 4) -> dict:
    """Resident bytes of one table with ``rows`` keys, by component. ``evicting``: rows
    are deleted and reused (eviction): a ``row_step`` int64 per row, churn-sized index.
    ``value_bytes``: 2 for float16 value storage (the slots stay float32)."""
    rows = max(int(rows), 0)
    row_bytes = value_bytes * dim + 4 * dim * num_slots
    cap = index_capacity(rows, evicting)
    per_row = ROW_ARRAY_BYTES + (ROW_STEP_BYTES if evicting else 0)
    arena, row_arrays, index = row_bytes * rows, per_row * rows, INDEX_BYTES_PER_POSITION * cap
    # index, row_count, row_seq/key (+ row_step)
    arrays = [arena, 4 * cap, 4 * rows] + [8 * rows] * (3 if evicting else 2)
    return {"arena": arena, "row_arrays": row_arrays, "index": index,
            "allocator": int(RETAINED_FACTOR * (index + row_arrays))
            + HUGE_PAGE_SLACK * sum(a >= _HUGE_PAGE_MIN for a in arrays)}


def ps_bytes(tables: list[dict], n_ps: int, push_rpcs_per_ps: int = 0,
             base_bytes: int = BASE_RSS_BYTES) -> dict:
    """Estimated RSS of ONE PS of ``n_ps``.

    ``tables``: ``[{"name", "rows", "dim", "num_slots"[, "evicting"]}]`` with job-wide row
    counts (admission candidates are tables of their own: dim 1, or bloom blocks);
    rows spread evenly over the PS (routing hashes keys to 4096 slots). Returns the
    components and ``total``.
    """
    if n_ps < 1:
        raise ValueError(f"n_ps must be >= 1, got {n_ps}")
    copies = 2 if n_ps >= 2 else 1  # own rows + the ring predecessor's replica
    own = {"arena": 0, "row_arrays": 0, "index": 0, "allocator": 0}
    per_table = []
    for t in tables:
        b = table_bytes(math.ceil(t["rows"] / n_ps), t["dim"], t["num_slots"],
                        t.get("evicting", False), t.get("value_bytes", 4))
        per_table.append({"name": t["name"], **b, "total": sum(b.values())})
        for k, v in b.items():
            own[k] += v
    tables_total = copies * sum(own.values())
    ids = min(push_rpcs_per_ps, REQUEST_ID_WINDOW) * REQUEST_ID_BYTES * copies
    total = base_bytes + tables_total + ids
    return {"base": base_bytes, "copies": copies, **{k: copies * v for k, v in own.items()},
            "request_ids": ids, "total": int(total), "per_table": per_table}
