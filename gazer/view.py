"""Snapshots as JSON (``gazer dump``) and as a terminal screen (``gazer top``)."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"


def to_dict(msg) -> dict:
    """A protobuf message as plain JSON types (ints stay ints, unlike MessageToDict)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        if f.message_type is not None:
            out[f.name] = [to_dict(x) for x in v] if f.is_repeated else to_dict(v)
        else:
            out[f.name] = list(v) if f.is_repeated else v
    return out


def sparkline(values, width: int = 30) -> str:
    values = list(values)[-width:]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARK[min(int(v / top * (len(SPARK) - 1) + 0.5), len(SPARK) - 1)] for v in values)


def _uptime(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}"


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def _tail(name: str, width: int = 56) -> str:
    """Op names grow from the left (function/layer/op): keep the informative end."""
    return name if len(name) <= width else "…" + name[-(width - 1):]


POLICY_COLUMNS = ("rows", "admitted", "rejected", "candidates", "evicted")


def table_policy_totals(snap) -> dict:
    """{table: {rows, admitted, rejected, candidates, evicted}} summed over the PS of a
    snapshot, for the tables where admission or eviction did anything."""
    out: dict = {}
    for mv in snap.members:
        if mv.role != "ps" or not mv.HasField("stats"):
            continue
        for t in mv.stats.tables:
            c = out.setdefault(t.name, dict.fromkeys(POLICY_COLUMNS, 0))
            for k in POLICY_COLUMNS:
                c[k] += getattr(t, k)
    return {n: c for n, c in out.items() if c["admitted"] or c["rejected"] or c["candidates"]
            or c["evicted"]}


def render(snap, notice: str = ""):
    """The whole screen for one snapshot; ``notice`` is a line about the connection."""
    head = Text()
    head.append(f"job {snap.job}", style="bold")
    head.append(f"  phase {snap.phase}  epoch {snap.epoch}  up {_uptime(snap.uptime_seconds)}  "
                f"shards {snap.shards_done} done / {snap.shards_doing} doing / {snap.shards_todo} todo")
    tput = Text()
    tput.append(f"throughput {snap.samples_per_second:,.0f} samples/s  ", style="bold")
    tput.append(sparkline(snap.throughput_history), style="green")
    if snap.throughput_history:
        tput.append(f"  (last {len(snap.throughput_history)} s, max "
                    f"{max(snap.throughput_history):,.0f})")
    parts = [head, tput]
    if snap.HasField("eval"):  # evaluation while training
        ev = snap.eval
        parts.append(Text(
            f"eval auc {ev.auc:.4f}  logloss {ev.logloss:.4f}  at step {ev.step:,}"
            f"{' (final)' if ev.final else ''}  {ev.examples:,} examples  "
            f"{ev.rounds} round(s), latest {ev.age_seconds:,.0f} s ago" if ev.rounds
            else "eval: no round yet", style="cyan"))
    mig = snap.migration
    if mig.phase:
        parts.append(Text(f"migration {mig.phase}{' (active)' if mig.active else ''}: "
                          f"{mig.pairs_done}/{mig.pairs} pairs this round, {mig.rows:,} rows, "
                          f"{mig.elapsed_seconds:.1f} s", style="yellow" if mig.active else ""))
    if notice:
        parts.append(Text(notice, style="bold red"))

    members = Table(box=None, pad_edge=False, header_style="bold")
    for col, right in (("MEMBER", False), ("ROLE", False), ("STATE", False), ("CPU %", True),
                       ("RSS MB", True), ("RATE", True), ("P99 ms", True), ("STEP ms", True),
                       ("ROWS", True), ("TABLE MB", True), ("REPL LAG", True),
                       ("AHEAD", True)):
        members.add_column(col, justify="right" if right else "left", no_wrap=True)
    for mv in snap.members:
        s = mv.stats
        has = mv.stats_age_seconds >= 0
        state = mv.state if not has or mv.stats_age_seconds < 5 else f"{mv.state} (stale)"
        if mv.straggler:  # marked by the stragglers detector
            state = Text(f"{state} SLOW ({mv.straggler_why})", style="bold red")
        row = [mv.id, mv.role, state]
        if not has:
            members.add_row(*row, *[""] * 9)
            continue
        if mv.role == "worker":
            rate = f"{mv.steps_per_second:,.1f} st/s {mv.samples_per_second:,.0f} smp/s"
            step = f"{s.step_ms:,.1f}" if s.step_ms else ""
        else:
            rate = f"{mv.requests_per_second:,.0f} req/s" if s.rpcs else ""
            step = ""
        rows = sum(t.rows for t in s.tables)
        repl = ""
        if s.replication.peer:
            repl = f"{s.replication.behind_sequence:,} upd / {s.replication.since_ship_ms:,.0f} ms"
        ahead = ""
        la = s.lookahead
        if la.used or la.dropped:  # table lookups answered by rows fetched ahead
            ahead = f"{100.0 * la.used / (la.used + la.dropped):.0f}% of {la.used + la.dropped:,}"
        members.add_row(*row, f"{s.cpu_percent:,.0f}", _mb(s.rss_bytes), rate,
                        f"{mv.p99_ms:,.1f}" if mv.p99_ms else "", step,
                        f"{rows:,}" if s.tables else "",
                        _mb(sum(t.bytes for t in s.tables)) if s.tables else "", repl, ahead)
    parts += [Text(""), members, Text("")]
    policies = table_policy_totals(snap)
    if policies:  # tables with admission or eviction: what they keep out and throw away
        tab = Table(box=None, pad_edge=False, header_style="bold", title="tables (all PS)",
                    title_justify="left")
        for col in ("TABLE", "ROWS", "ADMITTED", "REJECTED", "CANDIDATES", "EVICTED"):
            tab.add_column(col, justify="left" if col == "TABLE" else "right")
        for name, c in sorted(policies.items()):
            tab.add_row(name, *(f"{c[k]:,}" for k in POLICY_COLUMNS))
        parts += [tab, Text("")]

    if snap.top_ops:
        ops = Table(box=None, pad_edge=False, header_style="bold",
                    title=f"top ops (one step in {snap.op_sample_every} traced)", title_justify="left")
        for col, right in (("OP", False), ("TYPE", False), ("ms/step", True), ("% step", True),
                           ("WORKERS", True)):
            ops.add_column(col, justify="right" if right else "left", no_wrap=not right and col == "TYPE")
        for op in snap.top_ops:
            ops.add_row(_tail(op.name), op.type, f"{op.micros / 1000:,.2f}",
                        f"{100 * op.share:,.1f}" if op.share else "", str(op.workers))
        parts.append(ops)
    elif snap.op_sample_every:
        parts.append(Text(f"top ops: no sampled step yet (one step in {snap.op_sample_every} is traced)",
                          style="dim"))
    else:
        parts.append(Text("top ops: per-op sampling is off (gazer.op_sample_every_steps: 0)",
                          style="dim"))
    return Group(*parts)
