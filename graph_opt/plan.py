"""Plan: PS count, memory and CPU per PS, worker count and CPU, with the arithmetic.

Memory comes from the PS layout model (``graph_opt.memory``). CPU comes from a per-sample
cost model whose constants were calibrated on the example (``CostModel``; see
docs/guide-planning.md): a starting point that the runtime autoscaler corrects, not a
measured promise.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from graph_opt.api import Plan, RolePlan, TableEstimate
from graph_opt.memory import (BASE_RSS_BYTES, INDEX_BYTES_PER_POSITION, ROW_ARRAY_BYTES,
                              ps_bytes)

MiB = 2 ** 20
GiB = 2 ** 30


@dataclass(frozen=True)
class CostModel:
    """CPU seconds per training sample (calibrated: docs/guide-planning.md)."""
    worker_flops_per_second: float = 2.0e10   # effective dense math per worker core
    worker_seconds_per_id: float = 0.2e-6     # unique + lookup/push marshalling per id
    worker_seconds_per_sample: float = 5e-6   # parsing, data feed, step overhead
    ps_seconds_per_id: float = 0.45e-6        # one id's lookup + push on the PS
    worker_base_rss_bytes: int = 700 * MiB    # TF + Keras worker process before data


@dataclass
class PlanInputs:
    workers: int | None = None          # None: 1 (or the job file's worker.replicas)
    ps: int | None = None               # force a PS count
    worker_cpu: float = 1.0
    ps_memory_limit_bytes: int = 8 * GiB  # what one PS may use
    ps_max_cpu: float = 4.0
    headroom: float = 0.25              # requested memory = estimate x (1 + headroom)
    batch_size: int = 1024
    records: int | None = None          # training records (all epochs: x epochs)
    epochs: int = 1
    ps_base_bytes: int = BASE_RSS_BYTES
    cost: CostModel = field(default_factory=CostModel)
    # training steps (pushed batches) a second, for the eviction lag; None: from the cost
    # model's throughput
    steps_per_second: float | None = None


def dense_tables(dense) -> list[dict]:
    """Each trainable variable is a PS table ``dense/<path>``: rows = first axis, the
    other axes flattened, optimizer assign_add (no slots); a scalar is one 1x1 row."""
    out = []
    for v in dense:
        rows = v.shape[0] if v.shape else 1
        dim = math.prod(v.shape[1:]) if len(v.shape) > 1 else 1
        out.append({"name": f"dense/{v.name}", "rows": rows, "dim": dim, "num_slots": 0})
    return out


def worker_seconds_per_sample(tables, flops_per_sample: int | None, c: CostModel) -> float:
    """CPU seconds a worker core spends on one training sample (the cost model)."""
    ids = sum(t.ids_per_sample or 0 for t in tables)
    return (3 * (flops_per_sample or 0) / c.worker_flops_per_second
            + ids * c.worker_seconds_per_id + c.worker_seconds_per_sample)


def steps_per_second(tables, flops_per_sample: int | None, inputs: "PlanInputs") -> float:
    """Pushed batches a second over the job: given, else the cost model's throughput."""
    if inputs.steps_per_second:
        return float(inputs.steps_per_second)
    rate = (inputs.workers or 1) * inputs.worker_cpu / worker_seconds_per_sample(
        tables, flops_per_sample, inputs.cost)
    return rate / max(inputs.batch_size, 1)


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


def _round_cpu(x: float) -> float:
    return max(0.5, math.ceil(x * 2) / 2)


def make_plan(tables: list[TableEstimate], dense, flops_per_sample: int | None,
              inputs: PlanInputs) -> tuple[Plan, dict, list[str]]:
    """``(plan, components of one PS's RSS, arithmetic lines)``."""
    c = inputs.cost
    lines: list[str] = []
    sparse = [{"name": t.name, "rows": t.rows or 0, "dim": t.dim, "num_slots": t.num_slots,
               "evicting": bool(t.eviction), "value_bytes": t.value_bytes} for t in tables]
    # admission candidates live in a companion table (deeprec_ext.store.policies)
    sparse += [{"name": f"{t.name}::admission", "rows": t.candidate_rows,
                "dim": t.candidate_dim, "num_slots": 0} for t in tables if t.candidate_rows]
    all_tables = sparse + dense_tables(dense)
    steps = math.ceil((inputs.records or 0) * inputs.epochs / max(inputs.batch_size, 1))
    pushes_per_ps = steps * (len(tables) + 1)  # one push per table + one dense sync per step

    lines.append(f"PS memory per row = (4 B, float16 storage 2 B) x dim + 4 B x dim x "
                 f"optimizer slots arena + "
                 f"{ROW_ARRAY_BYTES} B row arrays + {INDEX_BYTES_PER_POSITION} B x index "
                 "positions (power of two >= 2 x rows, >= 2048); "
                 "allocator = 1.15 x (index + row arrays) + 1 MiB per array >= 4 MiB")
    for t in tables:
        per_row = t.arena_row_bytes + ROW_ARRAY_BYTES
        lines.append(f"  table {t.name}: {t.rows or 0:,} rows ({t.rows_source}) x ("
                     f"{t.value_bytes} x {t.dim} + 4 x {t.dim} x {t.num_slots} {t.optimizer} "
                     f"slots + {ROW_ARRAY_BYTES}) B = "
                     f"{_mib((t.rows or 0) * per_row)} + index")
        if t.rows_reason:
            lines.append(f"    rows planned under its policies: {t.rows_reason}")
        if t.candidate_rows:
            lines.append(f"    + admission candidates: {t.candidate_rows:,} rows x (4 x "
                         f"{t.candidate_dim} + 28) B = "
                         f"{_mib(t.candidate_rows * (4 * t.candidate_dim + 28))} + index")
    dparams = sum(v.params for v in dense)
    lines.append(f"  dense: {len(dense)} variables, {dparams:,} params -> {len(dense)} "
                 f"assign_add tables")

    # workers and throughput
    workers = inputs.workers or 1
    ids = sum(t.ids_per_sample or 0 for t in tables)
    flops = 3 * (flops_per_sample or 0)  # forward + backward ~ 3x forward
    w_sec = worker_seconds_per_sample(tables, flops_per_sample, c)
    per_worker = inputs.worker_cpu / w_sec
    total_rate = workers * per_worker
    lines.append(f"worker CPU/sample = {flops:,} train FLOPs / {c.worker_flops_per_second:.2g} "
                 f"+ {ids} ids x {c.worker_seconds_per_id * 1e6:.2f} us + "
                 f"{c.worker_seconds_per_sample * 1e6:.1f} us = {w_sec * 1e6:.1f} us")
    lines.append(f"throughput = {workers} workers x {inputs.worker_cpu:g} CPU / "
                 f"{w_sec * 1e6:.1f} us = {total_rate:,.0f} samples/s")
    ps_cpu_total = total_rate * ids * c.ps_seconds_per_id
    lines.append(f"PS CPU = {total_rate:,.0f} samples/s x {ids} ids x "
                 f"{c.ps_seconds_per_id * 1e6:.2f} us = {ps_cpu_total:.2f} cores")

    # PS count: memory first, then CPU
    def est(n):
        return ps_bytes(all_tables, n, pushes_per_ps, inputs.ps_base_bytes)

    if inputs.ps:
        n_ps = inputs.ps
        lines.append(f"PS count = {n_ps} (given)")
    else:
        n_mem = next((n for n in range(1, 4097)
                      if est(n)["total"] * (1 + inputs.headroom) <= inputs.ps_memory_limit_bytes),
                     None)
        if n_mem is None:
            n_mem = 4096
        n_cpu = max(1, math.ceil(ps_cpu_total / inputs.ps_max_cpu))
        n_ps = max(n_mem, n_cpu)
        lines.append(f"PS count = max(memory: smallest n with RSS(n) x {1 + inputs.headroom:g} "
                     f"<= {_mib(inputs.ps_memory_limit_bytes)} -> {n_mem}, CPU: ceil("
                     f"{ps_cpu_total:.2f} / {inputs.ps_max_cpu:g}) -> {n_cpu}) = {n_ps}")
    mem = est(n_ps)
    lines.append(
        f"RSS of one PS of {n_ps} = base {_mib(mem['base'])} + {mem['copies']} x (own rows"
        f"{' + ring replica' if mem['copies'] == 2 else ''}: arena {_mib(mem['arena'])}, "
        f"row arrays {_mib(mem['row_arrays'])}, index {_mib(mem['index'])}, allocator "
        f"{_mib(mem['allocator'])} in total) + request ids {_mib(mem['request_ids'])} = "
        f"{_mib(mem['total'])}")
    ps_mem = math.ceil(mem["total"] * (1 + inputs.headroom) / MiB) * MiB
    ps_cpu = _round_cpu(ps_cpu_total / n_ps)
    lines.append(f"PS request: memory {_mib(mem['total'])} x {1 + inputs.headroom:g} = "
                 f"{_mib(ps_mem)}, CPU {ps_cpu_total:.2f} / {n_ps} -> {ps_cpu:g}")

    act = sum((t.ids_per_sample or 0) * t.dim for t in tables) * 4 * 3  # values, gather, grad
    w_est = c.worker_base_rss_bytes + 16 * dparams + inputs.batch_size * act
    w_mem = math.ceil(w_est * (1 + inputs.headroom) / MiB) * MiB
    lines.append(f"worker memory = base {_mib(c.worker_base_rss_bytes)} + 16 B x {dparams:,} "
                 f"dense params + batch {inputs.batch_size} x {act:,} B embeddings = "
                 f"{_mib(w_est)} x {1 + inputs.headroom:g} = {_mib(w_mem)}")
    plan = Plan(
        ps=RolePlan(replicas=n_ps, memory_bytes=ps_mem, cpu=ps_cpu,
                    estimated_rss_bytes=int(mem["total"])),
        worker=RolePlan(replicas=workers, memory_bytes=w_mem, cpu=float(inputs.worker_cpu),
                        estimated_rss_bytes=int(w_est)),
        inputs={**{k: v for k, v in asdict(inputs).items() if k != "cost"},
                "cost": asdict(c), "expected_samples_per_second": round(total_rate)})
    return plan, mem, lines
