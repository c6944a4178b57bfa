"""``aimaster estimate``: flags and command (imported lazily by aimaster/cli.py, so other
subcommands never import TensorFlow)."""
from __future__ import annotations

import json
import os
import sys


def add_parser(sub) -> None:
    e = sub.add_parser(
        "estimate", help="estimate tables, FLOPs and a PS/worker plan from a model (no PS runs)",
        description="TARGET is module:function (returns a Keras model or builds a TF1 graph), "
                    "a SavedModel directory, or a MetaGraph (.meta) / GraphDef (.pb, .pbtxt).")
    e.add_argument("target", help="module:function | SavedModel dir | graph file")
    e.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                   help="keyword argument for module:function (YAML value), repeatable")
    e.add_argument("--rows", action="append", default=[], metavar="TABLE=N",
                   help="expected rows of a table (e.g. embedding=2.5m), repeatable")
    e.add_argument("--optimizer", action="append", default=[], metavar="TABLE=NAME",
                   help="PS optimizer of a table the graph does not record")
    e.add_argument("--admission", action="append", default=[], metavar="TABLE=SPEC",
                   help="admission policy of a table the model does not declare (YAML, e.g. "
                        "'embedding={min_count: 3}'); plans the admitted rows + candidates")
    e.add_argument("--eviction", action="append", default=[], metavar="TABLE=SPEC",
                   help="eviction policy (YAML, e.g. 'embedding={steps_to_live: 2000}'); "
                        "plans the rows live within the window")
    e.add_argument("--feature", action="append", default=[], metavar="TABLE=FEATURE",
                   help="parsed feature that feeds a table (default: traced from the model)")
    e.add_argument("--job", default=os.environ.get("AIMASTER_JOB"),
                   help="job file: data files, epochs, worker count (env AIMASTER_JOB)")
    e.add_argument("--data", action="append", default=[], metavar="GLOB",
                   help="training data files (default: the job file's data.files)")
    e.add_argument("--parse", default=None, metavar="MODULE:FUNCTION",
                   help="lines (1-D string tensor) -> features, e.g. "
                        "examples.criteo.reader:parse_lines")
    e.add_argument("--sample-records", type=int, default=200_000,
                   help="records to read for the distinct-id sketch")
    e.add_argument("--workers", type=int, default=None, help="worker count (default: job "
                   "file, else 1)")
    e.add_argument("--ps", type=int, default=None, help="force the PS count")
    e.add_argument("--worker-cpu", type=float, default=1.0)
    e.add_argument("--ps-memory-limit-mb", type=float, default=8192.0,
                   help="memory one PS may use")
    e.add_argument("--ps-max-cpu", type=float, default=4.0)
    e.add_argument("--headroom", type=float, default=0.25,
                   help="requested memory = estimated RSS x (1 + headroom)")
    e.add_argument("--batch-size", type=int, default=1024)
    e.add_argument("--steps-per-second", type=float, default=None,
                   help="training steps (batches pushed) a second over the job, for the "
                        "rows an eviction interval keeps (default: the cost model's)")
    e.add_argument("--records", type=int, default=None,
                   help="training records per epoch (default: counted in the data files)")
    e.add_argument("--ps-base-mb", type=float, default=None,
                   help="RSS of an idle PS process (default: the measured constant)")
    e.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    from graph_opt.api import EstimateError
    try:
        return _run(args)
    except EstimateError as exc:
        print(f"aimaster: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from graph_opt.api import EstimateError
    from graph_opt.estimation import (estimate, format_text, parse_assignments, parse_literal,
                                    parse_rows)
    from graph_opt.plan import PlanInputs
    for flag, v in (("--sample-records", args.sample_records), ("--batch-size", args.batch_size)):
        if v <= 0:
            raise EstimateError(f"{flag} must be > 0, got {v}")
    for flag, v in (("--workers", args.workers), ("--ps", args.ps)):
        if v is not None and v < 1:
            raise EstimateError(f"{flag} must be >= 1, got {v}")
    if args.steps_per_second is not None and not args.steps_per_second > 0:
        raise EstimateError(f"--steps-per-second must be > 0, got {args.steps_per_second}")
    if args.headroom < 0 or args.worker_cpu <= 0 or args.ps_memory_limit_mb <= 0 \
            or args.ps_max_cpu <= 0:
        raise EstimateError("--headroom must be >= 0; --worker-cpu, --ps-memory-limit-mb and "
                            "--ps-max-cpu must be > 0")
    rows = parse_assignments(args.rows, "--rows", parse_rows)
    inputs = PlanInputs(workers=args.workers, ps=args.ps, worker_cpu=args.worker_cpu,
                        ps_memory_limit_bytes=int(args.ps_memory_limit_mb * 2 ** 20),
                        ps_max_cpu=args.ps_max_cpu, headroom=args.headroom,
                        batch_size=args.batch_size, records=args.records,
                        steps_per_second=args.steps_per_second)
    if args.ps_base_mb is not None:
        inputs.ps_base_bytes = int(args.ps_base_mb * 2 ** 20)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    est = estimate(args.target, fn_kwargs=parse_assignments(args.arg, "--arg", parse_literal),
                   rows=rows, data=args.data or None, parse=args.parse,
                   features=parse_assignments(args.feature, "--feature"),
                   sample_records=args.sample_records,
                   optimizers=parse_assignments(args.optimizer, "--optimizer"),
                   job=getattr(args, "job_config", None), plan_inputs=inputs,
                   admission=parse_assignments(args.admission, "--admission", parse_literal),
                   eviction=parse_assignments(args.eviction, "--eviction", parse_literal))
    print(json.dumps(est.to_dict(), indent=2, default=str) if args.json else format_text(est))
    return 0
