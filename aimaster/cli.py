"""``aimaster`` command line.

  aimaster run [JOB.yaml] [--ps N] [--workers M] [--port P] [--state-dir DIR]
  aimaster status --master ADDR [--json] [--token-file F]
  aimaster manifest JOB.yaml [--plan PLAN.json] [-o FILE]  |  aimaster manifest --check FILE
  aimaster estimate MODULE:FUNCTION|SAVEDMODEL|GRAPH [--rows T=N] [--job JOB.yaml --parse M:F] [--json]
  aimaster export CHECKPOINT_DIR --out DIR [--tables A,B] [--dtype float16] [--min-count N] [--json]

Every flag also reads an environment variable (AIMASTER_PS, AIMASTER_WORKERS, ...).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import grpc

from aimaster.config import ConfigError, load_job, with_overrides
from aimaster.state import StateStoreError

log = logging.getLogger("aimaster")


def _env_int(name: str):
    """Default from the environment; argparse converts it (type=int) only when the
    subcommand that owns the flag runs, and names the flag if it is not an integer."""
    v = os.environ.get(name)
    return v if v not in (None, "") else None


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aimaster", description="Job master of an elastic PS job.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job: AIMaster + PS + workers as local processes")
    run.add_argument("job", nargs="?", default=os.environ.get("AIMASTER_JOB"),
                     help="job YAML file (env AIMASTER_JOB)")
    run.add_argument("--ps", type=int, default=_env_int("AIMASTER_PS"), help="PS count")
    run.add_argument("--workers", type=int, default=_env_int("AIMASTER_WORKERS"),
                     help="worker count (0: PS-only job that clients use directly)")
    run.add_argument("--port", type=int, default=_env_int("AIMASTER_PORT"),
                     help="AIMaster gRPC port (0: pick a free one)")
    run.add_argument("--state-dir", default=os.environ.get("AIMASTER_STATE_DIR"),
                     help="where job state and logs are written")
    run.add_argument("--log-level", default=os.environ.get("AIMASTER_LOG_LEVEL", "INFO"))
    run.add_argument("--token-file", default=None,
                     help="job token: every RPC of the AIMaster and the PS must carry it "
                          "(env DEEPREC_TOKEN_FILE; job file security.token_file)")
    run.add_argument("--init-from", default=os.environ.get("AIMASTER_INIT_FROM"),
                     help="warm start: tables, optimizer slots and dense variables from this "
                          "checkpoint (a root or one ckpt-* directory; job file init_from)")
    run.add_argument("--scaler", choices=("local", "kubernetes"),
                     default=os.environ.get("AIMASTER_SCALER", "local"),
                     help="local: child processes, loopback only; kubernetes: the TFJob's pods "
                          "(env AIMASTER_SCALER)")

    man = sub.add_parser("manifest", help="print the Kubernetes TFJob (+ RBAC, job ConfigMap) of a "
                                          "job file, or --check a manifest file")
    man.add_argument("job", nargs="?", help="job YAML file")
    man.add_argument("--plan", help="JSON of `aimaster estimate --json` (or its 'plan' object): "
                                    "replicas and resources")
    man.add_argument("--image", help="container image (default: kubernetes.image of the job file)")
    man.add_argument("--namespace", help="default: kubernetes.namespace, else 'default'")
    man.add_argument("-o", "--output", help="write here instead of stdout")
    man.add_argument("--check", metavar="FILE", help="validate FILE (TFJob CRD schema, pod "
                                                     "templates, operator webhook rules) instead")
    man.add_argument("--crd", default=None, help="TFJob CRD file (default: bundled or "
                                                 "$DEEPREC_TFJOB_CRD)")
    run.add_argument("--prometheus-port", type=int, default=_env_int("AIMASTER_PROMETHEUS_PORT"),
                     help="serve Gazer metrics for Prometheus on this port (env "
                          "AIMASTER_PROMETHEUS_PORT; overrides gazer.prometheus_port)")

    status = sub.add_parser("status", help="print the state of a running job")
    status.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                        help="AIMaster address host:port (env DEEPREC_MASTER_ADDR)")
    status.add_argument("--token-file", default=None,
                    help="job token file (env DEEPREC_TOKEN_FILE)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=10.0)
    status.add_argument("--tables", action="store_true",
                        help="also ask every PS for its tables: rows and the admission / "
                             "eviction counters (admitted, rejected, candidates, evicted, "
                             "dropped), summed over the PS")
    scale = sub.add_parser("scale", help="grow or shrink a running job's PS / worker sets; "
                                          "blocks until done and prints the event as JSON")
    scale.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                       help="AIMaster address host:port (env DEEPREC_MASTER_ADDR)")
    scale.add_argument("--token-file", default=None,
                    help="job token file (env DEEPREC_TOKEN_FILE)")
    scale.add_argument("--ps", type=int, default=None, help="new PS count")
    scale.add_argument("--workers", type=int, default=None, help="new worker count")
    scale.add_argument("--rebalance", action="store_true",
                       help="keep the counts; move slots between the PS to even out their "
                            "bytes and lookups (placement)")
    scale.add_argument("--timeout", type=float, default=600.0)
    ck = sub.add_parser("checkpoint", help="take a checkpoint of a running job now; prints the event")
    ck.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                    help="AIMaster address host:port (env DEEPREC_MASTER_ADDR)")
    ck.add_argument("--token-file", default=None,
                    help="job token file (env DEEPREC_TOKEN_FILE)")
    ck.add_argument("--full", action="store_true", help="a full checkpoint (default: incremental "
                    "when the job has one to build on)")
    ck.add_argument("--timeout", type=float, default=3600.0)
    ex = sub.add_parser("export", help="write a TensorFlow SavedModel (serving_default + one "
                                       "lookup signature per table) from a checkpoint")
    ex.add_argument("checkpoint", help="checkpoint root (newest chain) or one ckpt-* directory")
    ex.add_argument("--out", required=True, help="SavedModel directory to create (must not "
                                                 "exist; for TF Serving: BASE/<version>)")
    ex.add_argument("--tables", default=None,
                    help="comma-separated tables to export (lookup signatures only)")
    ex.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                    help="storage type of the exported values (lookups return float32)")
    ex.add_argument("--min-count", type=int, default=0,
                    help="keep only rows updated by at least N pushes (the others are served "
                         "like unseen ids: their initializer value)")
    ex.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    from graph_opt.cli import add_parser as add_estimate_parser  # argparse only; no TF
    add_estimate_parser(sub)
    return p


def _fail(message: str, code: int = 2) -> int:
    print(f"aimaster: error: {message}", file=sys.stderr)
    return code


def cmd_run(args) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = with_overrides(load_job(args.job), ps=args.ps, workers=args.workers,
                                port=args.port, state_dir=args.state_dir,
                                init_from=args.init_from)
        if args.prometheus_port is not None:
            from aimaster.monitor import with_prometheus_port
            config = with_prometheus_port(config, args.prometheus_port)
        if args.token_file:
            from dataclasses import replace
            config = replace(config, security=config.security.model_copy(update={"token_file": args.token_file}))
        from deeprec_ext.auth import is_loopback
        if args.scaler == "local" and not is_loopback(config.host):
            return _fail(f"master.host {config.host!r}: local runs listen on loopback only "
                         "(127.0.0.1, ::1, localhost); in a cluster run with --scaler kubernetes")
        from aimaster.master import JobMaster  # after validation: a bad flag fails fast
        factory = None
        if args.scaler == "kubernetes":
            from aimaster.scaler.kubernetes import master_scaler_factory
            factory = master_scaler_factory(lambda: master)
        master = JobMaster(config, scaler_factory=factory)
    except ConfigError as exc:
        return _fail(str(exc))
    except StateStoreError as exc:  # a damaged state dir: name the file, no traceback
        return _fail(str(exc))
    try:
        address = master.start()
    except (OSError, RuntimeError) as exc:
        master.shutdown()
        return _fail(f"cannot start the AIMaster service on port {config.port}: {exc}")
    signal.signal(signal.SIGTERM, lambda *_: master.stop_from_signal())
    signal.signal(signal.SIGINT, lambda *_: master.stop_from_signal())
    print(f"AIMaster for job '{config.name}' listening on {address} "
          f"(ps={config.ps.replicas}, workers={config.worker.replicas}, "
          f"state dir {os.path.abspath(config.state_dir)})", flush=True)
    code = master.run(on_progress=lambda line: print(line, flush=True))
    print(f"job '{config.name}' {master.phase.value}"
          + (f": {master.message}" if master.message else ""), flush=True)
    return code


def status_dict(resp) -> dict:
    return {
        "job": resp.job_name, "phase": resp.phase, "epoch": resp.epoch,
        "uptime_seconds": round(resp.uptime_seconds, 3), "state_dir": resp.state_dir,
        "members": [{"role": m.role, "id": m.id, "pid": m.pid, "address": m.address,
                     "state": m.state, "last_heartbeat_age": round(m.last_heartbeat_age, 3),
                     "steps": m.steps, "samples": m.samples} for m in resp.members],
        "shards": {"todo": resp.shards.todo, "doing": resp.shards.doing, "done": resp.shards.done,
                   "bad_shards": resp.shards.bad_shards, "bad_records": resp.shards.bad_records,
                   "bad_input": json.loads(resp.shards.bad_json) if resp.shards.bad_json else []},
        "events": [json.loads(e) for e in resp.events_json],
        # autoscale policy state and cost accounting (resource-seconds allocated vs used)
        "autoscale": json.loads(resp.autoscale_json) if resp.autoscale_json else None,
        "global_step": resp.global_step,
        "placement": json.loads(resp.placement_json) if resp.placement_json else None,
        "model_recorded": resp.model_recorded,
        "final_checkpoint": resp.final_checkpoint or None,
        "export_dir": resp.export_dir or None,
    }


TABLE_COUNTERS = ("rows", "admitted", "rejected", "candidates", "evicted", "dropped")


def table_counters(placement: dict | None, timeout: float) -> dict:
    """``{table: {rows, admitted, rejected, candidates, evicted, dropped}}`` summed over
    the PS of ``placement`` (their Stats; a PS that does not answer is left out, and rows
    of slots being migrated may count twice)."""
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import ps_pb2, ps_pb2_grpc
    out: dict = {}
    for p in ((placement or {}).get("ps") or {}).values():
        try:
            with insecure_channel(p["address"]) as ch:
                resp = ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(),
                                                                 timeout=timeout)
        except grpc.RpcError:
            continue
        for t in resp.tables:
            agg = out.setdefault(t.name, dict.fromkeys(TABLE_COUNTERS, 0))
            for k in TABLE_COUNTERS:
                agg[k] += int(getattr(t, k))
    return dict(sorted(out.items()))


def _client_setup(args) -> str | None:
    """Check --master and set up this CLI's job token (--token-file); returns an error
    message or None."""
    if not args.master:
        return "--master is required (or set DEEPREC_MASTER_ADDR)"
    from deeprec_ext import auth
    try:
        auth.configure(token_file=getattr(args, "token_file", None))
    except auth.AuthError as exc:
        return str(exc)
    return None


def _rpc_fail(what: str, address: str, exc: grpc.RpcError) -> int:
    from deeprec_ext import auth
    if auth.is_unauthenticated(exc):
        return _fail(auth.unauthenticated_hint(address), 1)
    return _fail(f"{what} {address}: {exc.code().name}: {exc.details()}", 1)


def cmd_status(args) -> int:
    if (err := _client_setup(args)):
        return _fail(err)
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    try:
        with insecure_channel(args.master) as ch:
            resp = master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(),
                                                         timeout=args.timeout)
    except grpc.RpcError as exc:
        return _rpc_fail("cannot reach AIMaster at", args.master, exc)
    d = status_dict(resp)
    if args.tables:
        d["tables"] = table_counters(d["placement"], min(args.timeout, 5.0))
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"job {d['job']}  phase {d['phase']}  epoch {d['epoch']}  step {d['global_step']}  "
          f"shards todo/doing/done {d['shards']['todo']}/{d['shards']['doing']}/{d['shards']['done']}")
    if d["shards"]["bad_shards"]:
        print(f"  bad input in {d['shards']['bad_shards']} shards, "
              f"{d['shards']['bad_records']} records:")
        for b in d["shards"]["bad_input"][-10:]:
            print(f"    shard {b['shard_id']}: {b['path']} at {b['offset']}: {b['reason']}"
                  + (f" (x{b['count']})" if b.get("count", 1) > 1 else ""))
    if d["placement"]:
        print("  placement " + "  ".join(f"{p} {v['slots']} slots" for p, v in
                                         d["placement"]["ps"].items()))
    if d["final_checkpoint"]:
        print(f"  final checkpoint {d['final_checkpoint']}")
    if d["export_dir"]:
        print(f"  exported model   {d['export_dir']}")
    for m in d["members"]:
        print(f"  {m['role']:6} {m['id']:10} pid {m['pid']:<8} {m['state']:9} {m['address']:21} "
              f"steps {m['steps']}")
    if d["autoscale"]:
        print("  cost      core-s alloc   core-s used  used%   GB-s alloc   GB-s used")
        for role, c in d["autoscale"]["cost"].items():
            eff = "-" if c["cpu_efficiency"] is None else f"{c['cpu_efficiency']:.0%}"
            print(f"  {role:6} {c['allocated_core_seconds']:14.1f} {c['used_core_seconds']:13.1f} "
                  f"{eff:>6} {c['allocated_gb_seconds']:12.1f} {c['used_gb_seconds']:11.1f}")
        for dec in d["autoscale"]["decisions"][-3:]:
            print(f"  autoscale {dec['rule']}: {dec['reason']}")
    for name, c in d.get("tables", {}).items():
        print(f"  table {name:20} " + "  ".join(f"{k} {c[k]:,}" for k in TABLE_COUNTERS))
    for e in [e for e in d["events"] if e["kind"].startswith("straggler_")
              or e["kind"] in ("shard_split", "hot_slot")][-5:]:
        print(f"  {_straggler_line(e)}")
    return 0


def _straggler_line(e: dict) -> str:
    """One line of ``aimaster status`` for a straggler event (docs/guide-stragglers.md)."""
    k = e["kind"]
    if k in ("straggler_detected", "straggler_cleared"):
        what = f"{e.get('role')} {e.get('id')} {'slow' if k.endswith('detected') else 'well again'}"
        if "ratio" in e:
            what += f": {e['ratio']} x median"
        return f"straggler {what}"
    if k == "straggler_rebalance":
        return (f"straggler re-placement: {e.get('moved_slots')} slots moved, capacity "
                f"{e.get('capacity')}")
    if k == "straggler_replace":
        return f"straggler {e.get('slow')} replaced by {e.get('new')} ({e.get('reason')})"
    if k == "straggler_spare":
        ids = ", ".join(e.get("ids") or []) or "none"
        if e.get("state") == "started":
            return f"straggler {e.get('id')} suspected: {ids} started to replace it"
        return f"spare {ids} retired ({e.get('reason')})"
    if k == "shard_split":
        return (f"shard {e.get('shard')} of {e.get('worker')} split at {e.get('at')}: "
                f"the rest (shard {e.get('new_shard')}) to {e.get('to')}")
    if k == "hot_slot":
        return f"hot slot {e.get('slot')} on {e.get('ps')}: {e.get('lookup_share'):.0%} of lookups"
    return f"{k}: {e.get('reason', '')}"


def _refusal(exc: grpc.RpcError) -> str | None:
    """The AIMaster's refusal of a change, in words (None for other failures), decided by
    the kind the status carries: busy means the same command may succeed later."""
    from aimaster.errors import Busy, Preempted, from_rpc_error
    refused = from_rpc_error(exc)
    if refused is None:
        return None
    if isinstance(refused, (Busy, Preempted)):
        return f"{refused} (busy: try again)"
    return str(refused)


def _what_happened(address: str, kind: str, since: float, timeout: float) -> dict | None:
    """After a lost answer (the connection dropped, the deadline passed): the event of a
    ``kind`` operation that started at or after ``since``, if the AIMaster recorded one."""
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    try:
        with insecure_channel(address) as ch:
            resp = master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(),
                                                         timeout=timeout, wait_for_ready=True)
    except grpc.RpcError:
        return None
    events = [json.loads(e) for e in resp.events_json]
    return next((e for e in reversed(events) if e.get("kind") == kind
                 and e.get("time", 0) >= since - 1.0), None)


def cmd_scale(args) -> int:
    if args.rebalance and (args.ps is not None or args.workers is not None):
        return _fail("--rebalance keeps the counts: give it without --ps / --workers")
    if args.ps is None and args.workers is None and not args.rebalance:
        return _fail("give --ps N, --workers M, both, or --rebalance")
    for flag, value in (("--ps", args.ps), ("--workers", args.workers)):
        if value is not None and value < 0:
            return _fail(f"{flag} must be >= 0, got {value}")
    if (err := _client_setup(args)):
        return _fail(err)
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    req = master_pb2.ScaleRequest(timeout_seconds=args.timeout, rebalance=args.rebalance)
    if args.ps is not None:
        req.ps = args.ps
    if args.workers is not None:
        req.workers = args.workers
    sent = time.time()
    try:
        with insecure_channel(args.master) as ch:
            resp = master_pb2_grpc.MasterStub(ch).Scale(req, timeout=args.timeout + 30)
    except grpc.RpcError as exc:
        if (said := _refusal(exc)):
            return _fail(f"scale refused: {said}", 1)
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            # the answer was lost, not necessarily the scale: say what really happened
            kind = "rebalance" if args.rebalance else "scale"
            event = _what_happened(args.master, kind, sent, timeout=10)
            if event is not None:
                print(json.dumps(event, sort_keys=True))
                print(f"aimaster: the answer was lost ({exc.code().name}), but the {kind} "
                      "completed (event above)", file=sys.stderr)
                return 0
        return _rpc_fail("scale failed at", args.master, exc)
    print(resp.event_json)
    return 0


def cmd_checkpoint(args) -> int:
    if (err := _client_setup(args)):
        return _fail(err)
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    try:
        with insecure_channel(args.master) as ch:
            resp = master_pb2_grpc.MasterStub(ch).Checkpoint(
                master_pb2.CheckpointRequest(full=args.full), timeout=args.timeout)
    except grpc.RpcError as exc:
        if (said := _refusal(exc)):
            return _fail(f"checkpoint refused: {said}", 1)
        return _rpc_fail("checkpoint failed at", args.master, exc)
    print(resp.event_json)
    return 0


def cmd_manifest(args) -> int:
    from tfjob_crd.render import ManifestError, dump, render_file
    from tfjob_crd.validate import check_file, validate_documents
    if args.check:
        if args.job:
            return _fail("give either a job file (to render) or --check FILE, not both")
        problems, notes = check_file(args.check, args.crd)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        for p in problems:
            print(f"{args.check}: {p}", file=sys.stderr)
        if problems:
            return _fail(f"{args.check}: {len(problems)} problem(s)", 1)
        print(f"{args.check}: valid")
        return 0
    if not args.job:
        return _fail("give a job file to render, or --check FILE")
    try:
        docs = render_file(args.job, args.plan, args.image, args.namespace)
    except ManifestError as exc:
        return _fail(str(exc))
    problems, notes = validate_documents(docs, args.crd)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if problems:  # our own output must be valid: this is a bug, not a user error
        return _fail("the rendered manifest is invalid:\n  " + "\n  ".join(problems), 1)
    text = dump(docs)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_export(args) -> int:
    tables = None
    if args.tables is not None:
        tables = [t.strip() for t in args.tables.split(",") if t.strip()]
        if not tables:
            return _fail("--tables: give at least one table name")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    from checkpoint import CheckpointError
    from aimaster.export import ExportError, export
    try:
        summary = export(args.checkpoint, args.out, tables=tables, dtype=args.dtype,
                         min_count=args.min_count)
    except (ExportError, CheckpointError) as exc:
        return _fail(f"export: {exc}", 1)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        rows = ", ".join(f"{n} {r:,} rows" for n, r in summary["tables"].items())
        print(f"exported {summary['checkpoint']} (step {summary['global_step']}) to "
              f"{summary['dir']}: {rows}; {summary['bytes'] / 1e6:.1f} MB in "
              f"{summary['seconds']:.1f} s; signatures {', '.join(summary['signatures'])}")
    return 0


def cmd_estimate(args) -> int:
    args.job_config = None
    if args.job:  # graph_opt sits below the AIMaster: the job file is parsed here
        try:
            args.job_config = load_job(args.job)
        except ConfigError as exc:
            return _fail(str(exc))
    from graph_opt.cli import run  # TensorFlow is imported only by this subcommand
    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    return {"run": cmd_run, "status": cmd_status, "scale": cmd_scale,
            "checkpoint": cmd_checkpoint, "manifest": cmd_manifest,
            "estimate": cmd_estimate, "export": cmd_export}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
