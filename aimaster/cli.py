"""``aimaster`` command line.

  aimaster run [JOB.yaml] [--ps N] [--workers M] [--port P] [--state-dir DIR]
  aimaster status --master ADDR [--json]

Every flag also reads an environment variable (AIMASTER_PS, AIMASTER_WORKERS, ...).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import grpc

from aimaster.config import ConfigError, load_job, with_overrides

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

    status = sub.add_parser("status", help="print the state of a running job")
    status.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                        help="AIMaster address host:port (env DEEPREC_MASTER_ADDR)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=10.0)
    scale = sub.add_parser("scale", help="grow or shrink a running job's PS / worker sets; "
                                          "blocks until done and prints the event as JSON")
    scale.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                       help="AIMaster address host:port (env DEEPREC_MASTER_ADDR)")
    scale.add_argument("--ps", type=int, default=None, help="new PS count")
    scale.add_argument("--workers", type=int, default=None, help="new worker count")
    scale.add_argument("--timeout", type=float, default=600.0)
    ck = sub.add_parser("checkpoint", help="take a checkpoint of a running job now; prints the event")
    ck.add_argument("--master", default=os.environ.get("DEEPREC_MASTER_ADDR"),
                    help="AIMaster address host:port (env DEEPREC_MASTER_ADDR)")
    ck.add_argument("--full", action="store_true", help="a full checkpoint (default: incremental "
                    "when the job has one to build on)")
    ck.add_argument("--timeout", type=float, default=3600.0)
    return p


def _fail(message: str, code: int = 2) -> int:
    print(f"aimaster: error: {message}", file=sys.stderr)
    return code


def cmd_run(args) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = with_overrides(load_job(args.job), ps=args.ps, workers=args.workers,
                                port=args.port, state_dir=args.state_dir)
        from aimaster.master import JobMaster  # after validation: a bad flag fails fast
        master = JobMaster(config)
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        address = master.start()
    except (OSError, RuntimeError) as exc:
        master.shutdown()
        return _fail(f"cannot start the AIMaster service on port {config.port}: {exc}")
    signal.signal(signal.SIGTERM, lambda *_: master.stop())
    signal.signal(signal.SIGINT, lambda *_: master.stop())
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
        "shards": {"todo": resp.shards.todo, "doing": resp.shards.doing, "done": resp.shards.done},
        "events": [json.loads(e) for e in resp.events_json],
    }


def cmd_status(args) -> int:
    if not args.master:
        return _fail("--master is required (or set DEEPREC_MASTER_ADDR)")
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    try:
        with insecure_channel(args.master) as ch:
            resp = master_pb2_grpc.MasterStub(ch).Status(master_pb2.StatusRequest(),
                                                         timeout=args.timeout)
    except grpc.RpcError as exc:
        return _fail(f"cannot reach AIMaster at {args.master}: {exc.code().name}: {exc.details()}", 1)
    d = status_dict(resp)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"job {d['job']}  phase {d['phase']}  epoch {d['epoch']}  "
          f"shards todo/doing/done {d['shards']['todo']}/{d['shards']['doing']}/{d['shards']['done']}")
    for m in d["members"]:
        print(f"  {m['role']:6} {m['id']:10} pid {m['pid']:<8} {m['state']:9} {m['address']:21} "
              f"steps {m['steps']}")
    return 0


def cmd_scale(args) -> int:
    if not args.master:
        return _fail("--master is required (or set DEEPREC_MASTER_ADDR)")
    if args.ps is None and args.workers is None:
        return _fail("give --ps N, --workers M or both")
    for flag, value in (("--ps", args.ps), ("--workers", args.workers)):
        if value is not None and value < 0:
            return _fail(f"{flag} must be >= 0, got {value}")
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    req = master_pb2.ScaleRequest(timeout_seconds=args.timeout)
    if args.ps is not None:
        req.ps = args.ps
    if args.workers is not None:
        req.workers = args.workers
    try:
        with insecure_channel(args.master) as ch:
            resp = master_pb2_grpc.MasterStub(ch).Scale(req, timeout=args.timeout + 30)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            return _fail(f"scale refused: {exc.details()}", 1)
        return _fail(f"scale failed at {args.master}: {exc.code().name}: {exc.details()}", 1)
    print(resp.event_json)
    return 0


def cmd_checkpoint(args) -> int:
    if not args.master:
        return _fail("--master is required (or set DEEPREC_MASTER_ADDR)")
    from deeprec_ext.grpc_util import insecure_channel
    from deeprec_ext.proto import master_pb2, master_pb2_grpc
    try:
        with insecure_channel(args.master) as ch:
            resp = master_pb2_grpc.MasterStub(ch).Checkpoint(
                master_pb2.CheckpointRequest(full=args.full), timeout=args.timeout)
    except grpc.RpcError as exc:
        return _fail(f"checkpoint failed at {args.master}: {exc.code().name}: {exc.details()}", 1)
    print(resp.event_json)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    return {"run": cmd_run, "status": cmd_status, "scale": cmd_scale,
            "checkpoint": cmd_checkpoint}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
