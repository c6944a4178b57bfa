"""``estimate(...)``: inventory + expected rows + plan, and its human-readable form."""
from __future__ import annotations

import math

import numpy as np

from graph_opt.api import Estimate, EstimateError
from graph_opt.memory import slots_per_row
from graph_opt.plan import PlanInputs, make_plan


def parse_assignments(items, flag: str, value_type=str) -> dict:
    """``["A=1", "B=2"]`` -> ``{"A": 1, "B": 2}``; EstimateError naming the bad item."""
    out = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        if not sep or not name.strip() or not value.strip():
            raise EstimateError(f"{flag} {item!r}: expected NAME=VALUE")
        try:
            out[name.strip()] = value_type(value.strip())
        except ValueError as exc:
            raise EstimateError(f"{flag} {item!r}: {exc}") from exc
    return out


def parse_rows(value: str) -> int:
    v = value.replace("_", "").replace(",", "").lower()
    scale = 1
    if v and v[-1] in "kmg":
        scale, v = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}[v[-1]], v[:-1]
    try:
        n = float(v) * scale
    except ValueError:
        raise ValueError(f"{value!r} is not a row count (e.g. 2000000, 2.5m)") from None
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"row count must be >= 0, got {value!r}")
    return int(n)


def parse_literal(value: str):
    """``--arg`` values: YAML scalars/lists (``8``, ``0.1``, ``adam``, ``[64, 32]``)."""
    import yaml
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def estimate(target: str, fn_kwargs: dict | None = None, rows: dict | None = None,
             data: list[str] | None = None, parse: str | None = None,
             features: dict | None = None, sample_records: int = 200_000,
             optimizers: dict | None = None, job=None,
             plan_inputs: PlanInputs | None = None, admission: dict | None = None,
             eviction: dict | None = None) -> Estimate:
    """Estimate the resources of a model before its first step. Never starts a PS.

    ``target``: ``module:function`` (returns a Keras model or builds a TF1 graph; called
    with ``fn_kwargs``), a SavedModel directory, or a MetaGraph/GraphDef file.
    ``rows``: ``{table: expected rows}`` hints (they win over sampling). ``data`` file
    globs (default: the job file's ``data.files``) are read through ``parse``
    (``module:function``, lines -> features) for ``sample_records`` records; each table
    counts the distinct ids of its feature (``features`` overrides table -> feature).
    ``optimizers``: ``{table: name}`` for graphs that do not record one.
    ``admission`` / ``eviction``: ``{table: spec}`` overriding (or supplying) the policies
    the model declares; with them the rows planned are those admitted and alive within
    the eviction window (:func:`plan_policy_rows`), plus the admission candidates.
    """
    from graph_opt.inventory import inspect_target, load_callable
    inputs = plan_inputs or PlanInputs()
    rows = dict(rows or {})
    for name, n in rows.items():
        if not isinstance(n, int) or n < 0:
            raise EstimateError(f"rows for table {name!r} must be an int >= 0, got {n!r}")
    if sample_records <= 0:
        raise EstimateError(f"sample_records must be > 0, got {sample_records}")
    if job is not None:  # a loaded job file (aimaster.config.JobConfig): the AIMaster parses it
        cfg = job
        data = data or list(cfg.data.files)
        inputs.epochs = cfg.data.epochs
        if inputs.workers is None and cfg.worker.replicas:
            inputs.workers = cfg.worker.replicas

    inv = inspect_target(target, fn_kwargs)
    warnings = list(inv.warnings)
    known = {t.name for t in inv.tables}
    for name in (list(rows) + list(features or {}) + list(optimizers or {})
                 + list(admission or {}) + list(eviction or {})):
        if name not in known:
            raise EstimateError(f"no elastic table named {name!r} in the model (tables: "
                                f"{sorted(known) or 'none'})")
    for t in inv.tables:
        if optimizers and t.name in optimizers:
            try:
                t.num_slots = slots_per_row(optimizers[t.name])
            except ValueError as exc:
                raise EstimateError(f"--optimizer {t.name}: {exc}") from exc
            t.optimizer, t.optimizer_assumed = optimizers[t.name], False
            warnings = [w for w in warnings if not w.startswith(f"table {t.name!r}: optimizer")]
        if features and t.name in features:
            t.feature = features[t.name]
        if t.name in rows:
            t.rows, t.rows_source = rows[t.name], "hint"
        _set_policies(t, (admission or {}).get(t.name, t.admission),
                      (eviction or {}).get(t.name, t.eviction))

    sampling = None
    need = [t for t in inv.tables if t.rows is None]
    if need and data:
        if not parse:
            raise EstimateError("reading the training data needs --parse module:function "
                                "(lines -> features)")
        from graph_opt.plan import steps_per_second
        sampling = _sample(need, data, load_callable(parse), sample_records, inputs,
                           steps_per_second(inv.tables, inv.flops_per_sample, inputs))
    for t in inv.tables:
        _bloom_rows(t)
        if t.admission and "bloom" not in t.admission and t.admission["min_count"] > 1 \
                and t.rows_source == "hint":
            warnings.append(f"table {t.name!r}: admission candidates (exact counters) not "
                            f"estimated for a --rows hint; give --data to count them")
    for t in inv.tables:
        if t.rows is None:
            t.rows = 0
            warnings.append(f"table {t.name!r}: no row count (give --rows {t.name}=N or "
                            f"--data/--job with --parse); counted as 0 rows")
    if inputs.records is None and sampling:
        inputs.records = sampling["total_records"]

    plan, mem, lines = make_plan(inv.tables, inv.dense, inv.flops_per_sample, inputs)
    return Estimate(source=target, kind=inv.kind, tables=inv.tables, candidates=inv.candidates,
                    dense=inv.dense, flops_per_sample=inv.flops_per_sample, plan=plan,
                    ps_memory=mem, arithmetic=lines, warnings=warnings, sampling=sampling)


def _set_policies(t, admission, eviction) -> None:
    from deeprec_ext.store.policies import make_admission, make_eviction
    try:
        t.admission = make_admission(admission, t.name, t.dim)
        t.eviction = make_eviction(eviction, t.name)
    except ValueError as exc:
        raise EstimateError(str(exc)) from exc


def _bloom_rows(t) -> None:
    """A bloom filter's memory is fixed by its spec: its cells, BLOOM_BLOCK to a row, each
    routing slot holding its share (at least 2 x hashes cells) as the store lays it out."""
    from deeprec_ext.hashing import DEFAULT_NUM_SLOTS
    from deeprec_ext.store.policies import BLOOM_BLOCK, bloom_size
    if not t.admission or "bloom" not in t.admission:
        return
    cells, k = bloom_size(t.admission["bloom"]["capacity"], t.admission["bloom"]["fpp"])
    per_slot = max(-(-cells // DEFAULT_NUM_SLOTS), 2 * k)
    per_slot = -(-per_slot // BLOOM_BLOCK) * BLOOM_BLOCK
    t.candidate_rows = DEFAULT_NUM_SLOTS * per_slot // BLOOM_BLOCK
    t.candidate_dim = BLOOM_BLOCK
    t.rows_reason += (f"{'; ' if t.rows_reason else ''}bloom filter: {cells:,} cells for "
                      f"capacity {t.admission['bloom']['capacity']:,} at fpp "
                      f"{t.admission['bloom']['fpp']:g} -> {DEFAULT_NUM_SLOTS} slots x "
                      f"{per_slot} cells = {t.candidate_rows:,} rows of {BLOOM_BLOCK}")


def plan_policy_rows(t, occurrences, sampled: int, total: int, batch_records: int,
                     marks: list[int], steps_per_s: float = 0.0) -> None:
    """Rows planned for table ``t`` under its admission / eviction policies, from the
    sampled (id, batch) pairs; sets ``t.rows``, ``t.candidate_rows``, ``t.rows_reason``.

    Admission: the ids seen in >= min_count batches, counted at the sample's marks and
    extrapolated like distinct ids (Heaps). steps_to_live S: a step is a training batch of
    ``batch_records`` records, so rows live within a window of S x batch_records records;
    when the sample holds two windows the replay's peak of live rows is planned (the live
    set of a stationary stream does not grow past it), else the admitted ids of one window
    (Heaps, up to the data). Eviction runs every ``interval_seconds``: a row may live that
    many more seconds, ``steps_per_s`` x interval more steps, which the window includes. An exact counter counts again from zero after an eviction
    (those ids are candidates again); a bloom filter admits them at once. l2_below cannot
    be foreseen from data: not counted.
    """
    from graph_opt.sketch import heaps_extrapolate, policy_timeline
    ids, batch = occurrences
    n_b = -(-sampled // batch_records)
    need = t.admission["min_count"] if t.admission else 1
    stl = (t.eviction or {}).get("steps_to_live")
    lag = 0
    if stl is not None:
        lag = int(math.ceil(steps_per_s * t.eviction["interval_seconds"]))
        stl += lag
    bloom = bool(t.admission and "bloom" in t.admission)
    tl = policy_timeline(ids, batch, n_b, need, stl, bloom)
    at = [(m, max(0, min(-(-m // batch_records), n_b) - 1)) for m in marks]

    def curve(key):
        return [(m, float(tl[key][b])) for m, b in at] if n_b else []

    why = []
    admitted_all, _ = heaps_extrapolate(curve("admitted"), total)
    if need > 1:
        why.append(f"admission min_count {need}: {int(tl['admitted'][-1]):,} of "
                   f"{int(tl['distinct'][-1]):,} sampled ids seen in >= {need} batches of "
                   f"{batch_records}")
    rows = admitted_all
    if stl is not None:
        window = stl * batch_records
        life = (f"steps_to_live {stl - lag} + {lag} steps of the {t.eviction['interval_seconds']:g}"
                f" s eviction interval at {steps_per_s:,.1f} steps/s")
        if 2 * stl <= n_b:
            rows = float(tl["rows"].max())
            why.append(f"{life}: live window {window:,} records; peak live rows "
                       f"{int(rows):,} replayed over {n_b} sampled batches ("
                       f"{int(tl['evicted'][-1]):,} evictions)")
        else:
            rows = min(admitted_all, heaps_extrapolate(curve("admitted"), min(window, total))[0])
            why.append(f"{life}: live window {window:,} records (longer than half the "
                       f"sample): admitted ids of one window -> {int(rows):,}")
    if t.eviction and "l2_below" in t.eviction:
        why.append("l2_below: not foreseeable from data, not counted")
    if need > 1 and not bloom:
        # candidates are never evicted: the most held during the sample, extrapolated
        peak = np.maximum.accumulate(tl["candidates"])
        cand, _ = heaps_extrapolate([(m, float(peak[b])) for m, b in at], total)
        t.candidate_rows, t.candidate_dim = int(round(cand)), 1
        why.append(f"exact counters: {t.candidate_rows:,} candidates (ids counted fewer "
                   f"than {need} times since their last eviction) x 1 float")
    t.rows = int(round(rows))
    t.rows_reason = "; ".join(why)


def _sample(tables, patterns, parse_fn, sample_records, inputs, steps_per_s: float) -> dict:
    from graph_opt.sketch import expand_files, file_records, heaps_extrapolate, sample_distinct
    try:
        files = expand_files(patterns)
    except FileNotFoundError as exc:
        raise EstimateError(str(exc)) from exc
    feats = {t.name: t.feature for t in tables}
    track = {t.feature for t in tables if t.admission or t.eviction}
    try:
        res = sample_distinct(files, parse_fn, feats, sample_records, track=track,
                              batch_records=inputs.batch_size)
    except (KeyError, TypeError) as exc:
        raise EstimateError(f"sampling the data: {exc.args[0] if exc.args else exc}") from exc
    except Exception as exc:  # the user's parse function failed
        raise EstimateError(f"the parse function failed on the data: "
                            f"{type(exc).__name__}: {exc}") from exc
    total = file_records(files)
    out = {"files": len(files), "sampled_records": res["records"], "total_records": total,
           "features": {}}
    for t in tables:
        curve = res["per_feature"][t.feature]
        if not curve:
            continue
        d, beta = heaps_extrapolate(curve, total)
        t.rows = int(round(d))
        t.rows_source = "sample" if res["records"] >= total else f"sample+heaps(beta={beta:.2f})"
        out["features"][str(t.feature)] = {"curve": [[n, round(c)] for n, c in curve],
                                           "beta": round(beta, 3), "distinct": t.rows}
        if t.feature in res.get("occurrences", {}):
            t.rows_all_ids = t.rows
            plan_policy_rows(t, res["occurrences"][t.feature], res["records"], total,
                             inputs.batch_size, [n for n, _ in curve], steps_per_s)
            t.rows_source += "+policies"
    return out


def format_text(est: Estimate) -> str:
    """The human-readable report, arithmetic included."""
    d = est.to_dict()
    out = [f"estimate for {est.source} ({est.kind})", ""]
    out.append("elastic tables:")
    if not est.tables:
        out.append("  (none)")
    for t in est.tables:
        out.append(f"  {t.name:16} dim {t.dim:<4} keys {t.key_dtype} (input "
                   f"{t.input_dtype or '?'}, feature {t.feature or '?'}, "
                   f"{t.ids_per_sample or '?'} ids/sample)  optimizer {t.optimizer}"
                   f"{' (assumed)' if t.optimizer_assumed else ''}: {t.num_slots} slots -> "
                   f"{t.row_floats} floats/row  rows {t.rows:,} ({t.rows_source})")
        if t.admission or t.eviction:
            pol = ", ".join(f"{k} {v}" for k, v in (("admission", t.admission),
                                                     ("eviction", t.eviction)) if v)
            out.append(f"    policies: {pol}")
            out.append(f"    rows planned {t.rows:,}"
                       + (f" of {t.rows_all_ids:,} distinct ids" if t.rows_all_ids else "")
                       + (f" + {t.candidate_rows:,} candidate rows x {t.candidate_dim}"
                          if t.candidate_rows else "")
                       + (f": {t.rows_reason}" if t.rows_reason else ""))
    if est.candidates:
        out.append("candidates for ElasticEmbedding:")
        for c in est.candidates:
            out.append(f"  {c.name:24} {c.kind:24} shape {c.shape}  "
                       f"{c.bytes / 2**20:,.1f} MiB: {c.reason}")
    out.append(f"dense: {len(est.dense)} variables, {est.dense_params:,} params "
               f"({4 * est.dense_params / 2**20:,.2f} MiB)")
    for v in est.dense[:12]:
        out.append(f"  {v.name:32} {v.shape}")
    if len(est.dense) > 12:
        out.append(f"  ... {len(est.dense) - 12} more")
    if est.flops_per_sample is not None:
        out.append(f"FLOPs per sample: {est.flops_per_sample:,} forward, "
                   f"~{3 * est.flops_per_sample:,} training")
    if est.sampling:
        s = est.sampling
        out.append(f"data: sampled {s['sampled_records']:,} of {s['total_records']:,} records "
                   f"in {s['files']} files")
        for f, info in s["features"].items():
            curve = ", ".join(f"{n:,}->{c:,}" for n, c in info["curve"])
            out.append(f"  feature {f}: distinct ids {curve}; Heaps beta {info['beta']}"
                       f" -> {info['distinct']:,}")
    out.append("")
    out.append("arithmetic:")
    out += [f"  {line}" for line in est.arithmetic]
    p = d["plan"]
    out.append("")
    out.append(f"plan: {p['ps']['replicas']} PS x ({p['ps']['memory_bytes'] / 2**20:,.0f} MiB, "
               f"{p['ps']['cpu']:g} CPU; estimated RSS {p['ps']['estimated_rss_bytes'] / 2**20:,.1f}"
               f" MiB), {p['worker']['replicas']} workers x ({p['worker']['memory_bytes'] / 2**20:,.0f}"
               f" MiB, {p['worker']['cpu']:g} CPU)")
    for w in est.warnings:
        out.append(f"warning: {w}")
    return "\n".join(out)
