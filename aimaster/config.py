"""Job configuration: the job file (YAML) is validated by one pydantic schema
(:class:`JobFile`, nested like the file), then flags apply, and the job runs on a frozen
:class:`JobConfig`.

The schema is the single definition of every key: its type, default, bounds and
description. ``scripts/gen-config-reference`` renders it as the reference table in
docs/guide-aimaster.md, and a test fails when the two differ.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)

from deeprec_ext.data import fs as data_fs
from deeprec_ext.hashing import DEFAULT_NUM_SLOTS

DEFAULT_BYTES_PER_SHARD = 4 << 20


class ConfigError(ValueError):
    """The job file or a flag is wrong; the message names the field."""


def _num(default: float, description: str, **bounds) -> Any:
    """A number field: int or float (never a bool), with bounds."""
    return Field(default, description=description, **bounds)


Number = Union[StrictInt, float]  # strict: ints and floats, never bools or strings


class _Section(BaseModel):
    """A mapping of the job file: unknown keys are errors, values are not coerced."""
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --- roles, data, master, replication, checkpoint ---------------------------------------
class _RoleBase(_Section):
    env: dict[str, Any] = Field(default_factory=dict, description=(
        "Added to the role's environment, on top of the AIMaster's own; keys and values "
        "are converted to strings."))
    min_replicas: StrictInt = Field(0, ge=0, description=(
        "Lower bound for `--ps` / `--workers` and `aimaster scale` (for `ps`, at least 1 "
        "regardless)."))
    max_replicas: StrictInt = Field(64, ge=1, description=(
        "Upper bound for `--ps` / `--workers` and `aimaster scale`. For `ps` at most "
        "`num_slots` (else a PS could own no slot)."))

    @model_validator(mode="after")
    def _within_bounds(self):
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must lie within min_replicas "
                             f"({self.min_replicas}) and max_replicas ({self.max_replicas})")
        return self


class PsSection(_RoleBase):
    """PS always run `python -m deeprec_ext.ps`; a dead PS is not restarted empty (its
    ring peer takes over and a new PS joins), so `command` and `max_restarts` are not
    keys here."""
    replicas: StrictInt = Field(1, ge=1, description="PS count at start (at least 1).")


class WorkerSection(_RoleBase):
    replicas: StrictInt = Field(0, ge=0, description=(
        "Worker count at start; 0 runs a PS-only job that clients use directly."))
    command: Union[list[Union[StrictStr, StrictInt, float]], StrictStr] = Field(
        default_factory=list, description=(
            "Worker command: a list, or one string split on whitespace. Required when "
            "`replicas` > 0. `{python}` is replaced by the AIMaster's Python; it runs in "
            "the AIMaster's working directory."))
    max_restarts: StrictInt = Field(3, ge=0, description=(
        "How many times one worker id is restarted after a crash or hang."))


class DataSection(_Section):
    files: Union[list[StrictStr], StrictStr] = Field(default_factory=list, description=(
        "Paths, URLs (`s3://`, `gs://`, `hdfs://`...: fsspec; docs/guide-data.md) or glob "
        "patterns (a list, or one string). Each pattern must match a file; "
        "matches are sorted within a pattern. Without files the job has no shards."))
    bytes_per_shard: Optional[StrictInt] = Field(None, ge=1, description=(
        "Shard size in bytes of the file (default 4194304 = 4 MiB); a shard never spans "
        "two files. The AIMaster only `stat`s files: a shard is a byte range whose "
        "records are those that begin in it (docs/guide-data.md). Parquet: whole row "
        "groups; a compressed (`.gz`) file is one shard."))
    records_per_shard: Optional[StrictInt] = Field(None, ge=1, description=(
        "Deprecated, an approximation: `bytes_per_shard` = this x the mean line length "
        "of the first 64 KiB of the first file. Set `bytes_per_shard` instead; not both."))
    format: Literal["auto", "text", "text.gz", "tfrecord", "tfrecord.gz", "parquet"] = Field(
        "auto", description=(
            "`auto`: by file name (`.tfrecord`/`.tfrecords`/`.tfr`: TFRecord, "
            "`.parquet`/`.pq`: Parquet, else newline text such as CSV/TSV; a `.gz` suffix: "
            "gzip). A given format applies to every file (`.gz` files still count as gzip)."))
    epochs: StrictInt = Field(1, ge=1, description="Passes over the whole file list.")
    watch: StrictBool = Field(False, description=(
        "Streaming: files that appear under `files` while the job runs become new shards "
        "(a file is taken once its size is the same at two listings); the job runs until "
        "stopped. Done files are part of the job state and checkpoints: a restarted job "
        "neither skips nor repeats a file. A pattern may match nothing at start. Not with "
        "`epochs` > 1 or `consistency: sync`."))
    poll_seconds: Number = _num(10.0, "`watch`: seconds between two listings of `files`.", gt=0)
    on_bad_record: Literal["skip", "fail"] = Field("skip", description=(
        "Bad input (a TFRecord CRC mismatch, a truncated or corrupt gzip stream, an "
        "unreadable file, a record with the wrong number of `fields`): `skip` leaves the "
        "bad record out (or, where framing is lost, the rest of its shard) and the job "
        "goes on; `fail` fails the job. Either way the file and position are reported "
        "and counted in `aimaster status`."))
    fields: StrictInt = Field(0, ge=0, description=(
        "Text and Parquet records: the number of `delimiter`-separated fields each must "
        "have (0: not checked)."))
    delimiter: StrictStr = Field("\t", min_length=1, description="Field separator for `fields`.")

    @model_validator(mode="after")
    def _one_shard_size(self):
        if self.bytes_per_shard is not None and self.records_per_shard is not None:
            raise ValueError("data: set bytes_per_shard or the deprecated records_per_shard, "
                             "not both")
        if self.watch and self.epochs > 1:
            raise ValueError("data: watch reads each file once; epochs must be 1")
        return self


class MasterSection(_Section):
    host: StrictStr = Field("127.0.0.1", description=(
        "Interface the AIMaster and every PS bind and advertise."))
    port: StrictInt = Field(0, ge=0, le=65535, description="AIMaster gRPC port; 0 picks a free one.")
    state_dir: StrictStr = Field("", description=(
        "Directory for state and logs (default `runs/<name>`); created if missing."))
    lease_seconds: Number = _num(10.0, "A member silent this long is dead.", gt=0)
    heartbeat_seconds: Number = _num(1.0, "Member heartbeat interval; at most half of "
                                          "`lease_seconds`.", gt=0)
    ps_start_timeout: Number = _num(60.0, "Seconds for all initial PS to register, or the "
                                          "job fails.", gt=0)
    progress_seconds: Number = _num(5.0, "Interval of the progress line `aimaster run` "
                                         "prints.", gt=0)
    grace_seconds: Number = _num(30.0, "How long a member asked to leave (scale-in, job "
                                       "end) may take to hand off and exit before it is "
                                       "killed.", gt=0)


class ReplicationSection(_Section):
    mode: Literal["async", "sync"] = Field("async", description=(
        "`async`: pushes are answered at once and each PS ships its changes to its ring "
        "peer every `interval_ms`; `sync`: a push is answered once the peer holds its rows."))
    interval_ms: Number = _num(200.0, "Background shipping interval (both modes).", gt=0)


class CheckpointSection(_Section):
    dir: StrictStr = Field("", description="Checkpoint root (default `<state_dir>/checkpoints`); "
                           "a path or an object-store URL such as `s3://bucket/prefix`.")
    interval_seconds: Number = _num(0.0, "Seconds between periodic checkpoints; 0: only on "
                                         "`aimaster checkpoint`.", ge=0)
    keep_chains: StrictInt = Field(2, ge=1, description="Restorable chains kept by retention.")
    full_every: StrictInt = Field(5, ge=1, description=(
        "Every Nth checkpoint of a chain is full, the others incremental."))
    on_success: StrictBool = Field(True, description=(
        "A full checkpoint when the job succeeds, before the PS stop (the final model)."))


# --- feature sections: these are the runtime config objects too -----------------------------
class AutoscaleConfig(_Section):
    """Auto-scaling policy (aimaster/policy.py); see docs/guide-autoscale.md."""
    enabled: StrictBool = Field(False, description="Load the auto-scaling plugin.")
    dry_run: StrictBool = Field(False, description="Decide and record events, never scale.")
    interval_seconds: Number = _num(1.0, "One observation (PS stats, worker counters) per "
                                         "interval.", gt=0)
    cooldown_seconds: Number = _num(30.0, "Between performance-fit (and recovery) changes.", gt=0)
    settle_seconds: Number = _num(5.0, "After a change, before measurements count.", gt=0)
    measure_seconds: Number = _num(10.0, "Steady span a throughput measurement needs "
                                         "(at most `window_seconds`).", gt=0)
    window_seconds: Number = _num(30.0, "Newest span used for rates.", gt=0)
    max_wait_seconds: Number = _num(120.0, "A scale not satisfied by then is downgraded or "
                                           "given up.", gt=0)
    recovery: Literal["continue", "wait"] = Field("continue", description=(
        "After a loss: `continue` at reduced size, or `wait` for the full size."))
    resource_fit: StrictBool = Field(True, description="Scale on PS memory growth.")
    performance_fit: StrictBool = Field(True, description="Scale on throughput.")
    memory_headroom: Number = _num(0.2, "Fraction of each PS's memory limit kept free.",
                                   ge=0, lt=1)
    lead_seconds: Number = _num(20.0, "At least how long a PS scale-out takes.", gt=0)
    scale_out_reserve: Number = _num(2.0, "Times a PS's data (RSS above the bare process) "
                                          "kept free for its scale-out.", ge=0)
    replicated: StrictBool = Field(True, description=(
        "Ring replication: with 2 or more PS each holds a peer's copy."))
    ps_memory_limit_mb: Number = _num(0.0, "Each PS's memory budget "
                                           "(`DEEPREC_PS_MEMORY_LIMIT_MB`); 0: none.", ge=0)
    ps_cpu_high: Number = _num(0.8, "PS CPU saturated above this fraction of `ps_cores`.", gt=0)
    ps_cpu_low: Number = _num(0.25, "PS CPU idle below this fraction of `ps_cores`.", gt=0)
    worker_util_low: Number = _num(0.5, "Mean worker CPU below this with nothing pending: "
                                        "idle.", gt=0)
    min_gain: Number = _num(0.9, "Marginal throughput per core over the average needed to "
                                 "keep a change.", gt=0)
    explore_ttl_seconds: Number = _num(300.0, "How long a size that did not pay is not "
                                              "retried.", gt=0)
    worker_cores: Number = _num(1.0, "Cores allocated per worker (cost accounting).", gt=0)
    ps_cores: Number = _num(1.0, "Cores allocated per PS (cost accounting).", gt=0)
    worker_memory_mb: Number = _num(0.0, "Memory allocated per worker (cost accounting).", ge=0)

    @model_validator(mode="after")
    def _consistent(self):
        if self.ps_cpu_low >= self.ps_cpu_high:
            raise ValueError(f"ps_cpu_low ({self.ps_cpu_low}) must be below ps_cpu_high "
                             f"({self.ps_cpu_high})")
        if self.measure_seconds > self.window_seconds:
            raise ValueError(f"measure_seconds ({self.measure_seconds}) must not exceed "
                             f"window_seconds ({self.window_seconds})")
        return self

    def policy_config(self, job: "JobConfig"):
        """The policy's knobs, with each role's min/max from the job's role sections."""
        from aimaster.policy import PolicyConfig
        skip = ("enabled", "dry_run", "ps_memory_limit_mb", "worker_memory_mb")
        return PolicyConfig(
            ps_min=max(1, job.ps.min_replicas), ps_max=job.ps.max_replicas,
            worker_min=job.worker.min_replicas, worker_max=job.worker.max_replicas,
            ps_memory_limit_bytes=int(self.ps_memory_limit_mb * 1024 * 1024),
            worker_memory_bytes=int(self.worker_memory_mb * 1024 * 1024),
            **{k: (float(v) if isinstance(v, int) and not isinstance(v, bool) else v)
               for k, v in self.model_dump().items() if k not in skip})


class StragglersConfig(_Section):
    """Straggler detection and mitigation (aimaster/stragglers.py); see
    docs/guide-stragglers.md."""
    enabled: StrictBool = Field(False, description=(
        "Detect slow PS and workers and act on them; false: nothing is watched or moved."))
    dry_run: StrictBool = Field(False, description="Detect and record events, never act.")
    k: Number = _num(3.0, "A PS is slow when its data-plane p50 or p99 stays above k x the "
                          "median of the other PS; a worker when its records/s stays below "
                          "1/k of the median worker's. Above 1.", gt=0)
    interval_seconds: Number = _num(1.0, "One observation (the stats members send with their "
                                         "heartbeats) per interval.", gt=0)
    window_seconds: Number = _num(5.0, "Each verdict pools this span; a member must be slow "
                                       "(or well again) for this long before it is marked (or "
                                       "cleared): one GC pause does nothing. A PS is marked "
                                       "after half of it (its verdicts already pool a window). "
                                       "At least `interval_seconds` and "
                                       "`master.heartbeat_seconds`.", gt=0)
    min_requests: StrictInt = Field(20, ge=1, description=(
        "Data-plane requests a PS must serve in an interval for its latency to count."))
    cpu_saturated: Number = _num(0.9, "A PS at this fraction of a core (or more) while the "
                                      "median other PS is below half of it is slow too.",
                                 gt=0)
    reweight: StrictBool = Field(True, description=(
        "Slow PS: re-place slots by measured service rate (a PS serving at half speed "
        "owns about half the load)."))
    replace: StrictBool = Field(True, description=(
        "Slow PS still slow one window after re-placement, or below `replace_below`: "
        "start a new PS, move its slots live, retire it (the new PS is started as soon "
        "as the PS is suspected, and retired if it is not needed)."))
    replace_below: Number = _num(0.2, "Replace at once, without re-placement first, a PS "
                                      "whose service rate is below this x the median of the "
                                      "other PS' (a worker whose records/s is below this x "
                                      "the median). Below 1/k.", gt=0)
    min_weight: Number = _num(0.1, "Smallest capacity weight re-placement gives a PS.",
                              gt=0, le=1)
    split_shards: StrictBool = Field(True, description=(
        "Slow worker: split its shard at the record it reached and hand the rest to an "
        "idle worker (also: an idle worker while another holds more than one shard's "
        "worth of work)."))
    replace_workers: StrictBool = Field(True, description=(
        "Slow worker (marked while data is left to hand out, below `replace_below`, or "
        "still slow one window after it was marked): start a new worker and retire the "
        "slow one at a step boundary (its shards handed back at the record it reached). "
        "Needs worker.max_replicas above the worker count."))
    hot_slot_share: Number = _num(0.2, "A slot carrying this share of all lookups is "
                                       "reported as hot.", gt=0, le=1)

    @model_validator(mode="after")
    def _consistent(self):
        if self.k <= 1:
            raise ValueError(f"k ({self.k}) must be above 1: a PS or worker at the median "
                             "speed would be a straggler")
        if self.window_seconds < self.interval_seconds:
            raise ValueError(f"window_seconds ({self.window_seconds}) must be at least "
                             f"interval_seconds ({self.interval_seconds})")
        if self.replace_below >= 1 / self.k:
            raise ValueError(f"replace_below ({self.replace_below}) must be below 1/k "
                             f"({1 / self.k:.4g}, the detection threshold)")
        return self


class GazerConfig(_Section):
    """Gazer statistics (gazer/); see docs/guide-gazer.md."""
    enabled: StrictBool = Field(True, description="Collect and stream statistics.")
    op_sample_every_steps: StrictInt = Field(100, ge=0, description=(
        "Workers trace one step in N for per-op timings (0: none)."))
    top_ops: StrictInt = Field(20, ge=1, description="Ops per worker report.")
    prometheus_port: StrictInt = Field(0, ge=0, le=65535, description=(
        "Serve Prometheus metrics on this port (0: off; `aimaster run --prometheus-port`)."))

    @model_validator(mode="after")
    def _port_needs_enabled(self):
        if self.prometheus_port and not self.enabled:
            raise ValueError("prometheus_port needs gazer.enabled: true")
        return self


class ConsistencyConfig(_Section):
    """Consistent (sync) mode with virtual workers; see docs/guide-consistent.md. The
    file may give the mode alone: `consistency: sync`."""
    mode: Literal["async", "sync"] = Field("async", description=(
        "`sync`: the same model bit for bit on any number of workers."))
    virtual_workers: StrictInt = Field(0, ge=0, description=(
        "Sync: logical workers every step is split into (required, at least 1)."))
    seed: StrictInt = Field(0, ge=0, description="Sync: seeds each virtual worker's random state.")
    steps: StrictInt = Field(0, ge=0, description=(
        "Sync: stop after this many global steps (0: when the data runs out)."))

    @model_validator(mode="after")
    def _mode_fields(self):
        if self.mode == "sync" and self.virtual_workers < 1:
            raise ValueError("virtual_workers: mode 'sync' needs an integer >= 1 (the number "
                             "of logical workers every step is split into)")
        if self.mode == "async" and (self.virtual_workers or self.steps):
            raise ValueError("virtual_workers and steps apply to mode 'sync' only")
        return self


class KubernetesConfig(_Section):
    """How `aimaster manifest` renders the job as a TFJob; see docs/guide-kubernetes.md."""
    image: StrictStr = Field("", description="Container image.")
    namespace: StrictStr = Field("", description="Namespace (empty: kubectl's).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of every container.")
    port: StrictInt = Field(50051, ge=1, le=65535, description="AIMaster port in the chief pod.")
    ps_port: StrictInt = Field(2222, ge=1, le=65534, description=(
        "PS port (the TFJob default); the PS's control endpoint listens on the next one."))
    token_secret: Optional[StrictStr] = Field(None, description=(
        "Secret with key `token` (default `<name>-token`; `''` or false: no token)."))
    tls_secret: StrictStr = Field("", description=(
        "Secret with tls.crt, tls.key, ca.crt (empty: no TLS)."))
    # long enough for a PS to hand its last changes to its ring peer, short enough to fit
    # a spot instance's preemption notice (30 s on the big clouds' shortest)
    termination_grace_seconds: StrictInt = Field(30, ge=1, description=(
        "Pod termination grace period: time for a PS to hand off."))
    data_pvc: StrictStr = Field("", description="PersistentVolumeClaim mounted in every container.")
    data_mount_path: StrictStr = Field("/data", description="Where `data_pvc` is mounted.")
    service_account: StrictStr = Field("", description="Default `<name>-aimaster`.")

    @field_validator("token_secret", mode="before")
    @classmethod
    def _false_is_off(cls, v):
        return "" if v is False else v

    @model_validator(mode="after")
    def _ports_and_paths(self):
        if self.port == self.ps_port:
            raise ValueError(f"port and ps_port must differ (both {self.port})")
        if self.port == self.ps_port + 1:
            raise ValueError(f"port must not be ps_port + 1 ({self.port}): a PS's control "
                             "endpoint uses it")
        if not self.data_mount_path.startswith("/"):
            raise ValueError(f"data_mount_path: expected an absolute path, got "
                             f"{self.data_mount_path!r}")
        return self


class SecurityConfig(_Section):
    """Job token and TLS; see docs/guide-kubernetes.md."""
    token_file: StrictStr = Field("", description=(
        "Job token: every RPC of the AIMaster and the PS must carry it."))
    tls_dir: StrictStr = Field("", description="ca.crt, tls.crt, tls.key: serve and dial over TLS.")
    tls_server_name: StrictStr = Field("", description=(
        "The name in the certificate (default `deeprec`)."))


class ExportConfig(_Section):
    """The SavedModel written after the final checkpoint; see docs/guide-serving.md."""
    dir: StrictStr = Field("", description=(
        "Export base directory (a path or a URL such as `s3://bucket/models`): the "
        "SavedModel goes to `dir/<unix seconds>` (TF Serving's layout); empty: no export."))
    tables: Union[list[StrictStr], StrictStr] = Field(default_factory=tuple, description=(
        "Export only these tables (then: lookup signatures only); default all."))
    dtype: Literal["float32", "float16"] = Field("float32", description=(
        "Storage type of the exported values; lookups return float32."))
    min_count: StrictInt = Field(0, ge=0, description=(
        "Keep only rows updated by at least this many pushes (0: all); the others are "
        "served like unseen ids."))

    @field_validator("tables", mode="after")
    @classmethod
    def _as_tuple(cls, v):
        return tuple([v] if isinstance(v, str) else v)


# --- the whole file ----------------------------------------------------------------------------
class EvalConfig(_Section):
    """Evaluation while training (docs/guide-eval.md): an evaluator process runs the
    worker command with ``DEEPREC_ROLE=evaluator`` and scores the current model."""
    files: Union[list[StrictStr], StrictStr] = Field(default_factory=list, description=(
        "Eval files: paths or glob patterns, read whole each round, in the format of "
        "`data.format`. Required when the section is given."))
    every_steps: Optional[StrictInt] = Field(None, gt=0, description=(
        "Evaluate each time the job's global step advanced this much; or `every_seconds`."))
    every_seconds: Optional[Number] = Field(None, gt=0, description=(
        "Evaluate at most this often (seconds); or `every_steps`."))
    batch_size: StrictInt = Field(4096, gt=0, description="Eval batch size.")
    final_timeout_seconds: Number = Field(600, gt=0, description=(
        "After training, how long the job waits for the final evaluation."))

    @model_validator(mode="after")
    def _complete(self):
        if not self.files:
            raise ValueError("files: required (the eval data)")
        if self.every_steps is not None and self.every_seconds is not None:
            raise ValueError("every_steps, every_seconds: give one, not both")
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("every_steps or every_seconds: one is required")
        return self

    def file_list(self) -> list[str]:
        return [self.files] if isinstance(self.files, str) else list(self.files)

    def resolved_files(self) -> list[str]:
        out: list[str] = []
        for pattern in self.file_list():
            matches = data_fs.glob(pattern)
            if not matches:
                raise ConfigError(f"eval.files: pattern {pattern!r} matches no file")
            out.extend(matches)
        return out


class JobFile(_Section):
    """The job file, as written. Every key is optional."""
    name: StrictStr = Field("job", min_length=1, description=(
        "Job name; used in output and in the default `state_dir`."))
    num_slots: StrictInt = Field(DEFAULT_NUM_SLOTS, ge=1, description=(
        "Routing slots: `hash64(key) % num_slots` picks a key's slot. Fixed for the job."))
    ps: PsSection = Field(default_factory=PsSection, description="PS processes.")
    worker: WorkerSection = Field(default_factory=WorkerSection, description=(
        "Worker processes (`workers:` is accepted as an alias; give only one)."))
    data: DataSection = Field(default_factory=DataSection, description="Training data shards.")
    master: MasterSection = Field(default_factory=MasterSection, description="The AIMaster.")
    replication: ReplicationSection = Field(default_factory=ReplicationSection, description=(
        "Peer replication of each PS's rows (docs/guide-fault-tolerance.md)."))
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description=(
        "Checkpoints (docs/guide-fault-tolerance.md)."))
    export: ExportConfig = Field(default_factory=ExportConfig, description=(
        "Export for serving after the final checkpoint (docs/guide-serving.md)."))
    init_from: StrictStr = Field("", description=(
        "Warm start: tables, optimizer slots and dense variables from this checkpoint (a "
        "root or one `ckpt-*` directory; a path or an `s3://...` URL), on any PS count and "
        "`num_slots`."))
    reset_optimizer: StrictBool = Field(False, description=(
        "With `init_from`: load the values only; optimizer slots start fresh."))
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig, description=(
        "Auto-scaling (docs/guide-autoscale.md)."))
    gazer: GazerConfig = Field(default_factory=GazerConfig, description=(
        "Monitoring (docs/guide-gazer.md)."))
    stragglers: StragglersConfig = Field(default_factory=StragglersConfig, description=(
        "Slow PS and workers (docs/guide-stragglers.md)."))
    consistency: ConsistencyConfig = Field(default_factory=ConsistencyConfig, description=(
        "Consistent mode (docs/guide-consistent.md)."))
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description=(
        "TFJob rendering (docs/guide-kubernetes.md)."))
    security: SecurityConfig = Field(default_factory=SecurityConfig, description=(
        "Job token and TLS (docs/guide-kubernetes.md)."))
    eval: Optional[EvalConfig] = Field(None, description=(
        "Evaluation while training (docs/guide-eval.md); absent: no evaluator."))

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "worker" in data and "workers" in data:
            raise ValueError("give either 'worker' or 'workers', not both")
        if "workers" in data:
            data["worker"] = data.pop("workers")
        for key, f in cls.model_fields.items():  # an empty YAML section is an empty mapping
            if data.get(key, 0) is None and isinstance(f.default_factory, type):
                data[key] = {}
        if isinstance(data.get("consistency"), str):
            data["consistency"] = {"mode": data["consistency"]}
        return data

    @model_validator(mode="after")
    def _across_sections(self):
        if self.ps.max_replicas > self.num_slots:
            raise ValueError(f"ps.max_replicas ({self.ps.max_replicas}) exceeds num_slots "
                             f"({self.num_slots}): a PS would own no slot")
        if self.worker.replicas and not self.worker.command:
            raise ValueError("worker.command: required when worker.replicas > 0")
        if self.data.watch and self.consistency.mode == "sync":
            raise ValueError("data.watch: not with consistency sync (its virtual workers "
                             "read a shard list fixed at start)")
        if self.stragglers.window_seconds < self.master.heartbeat_seconds:
            raise ValueError(f"stragglers.window_seconds ({self.stragglers.window_seconds}) "
                             f"must be at least master.heartbeat_seconds "
                             f"({self.master.heartbeat_seconds}): members report their "
                             "stats once per heartbeat")
        if self.master.heartbeat_seconds * 2 > self.master.lease_seconds:
            raise ValueError(f"master.heartbeat_seconds ({self.master.heartbeat_seconds}) must "
                             f"be at most half of master.lease_seconds "
                             f"({self.master.lease_seconds})")
        return self


# --- what the job runs on ----------------------------------------------------------------------
@dataclass(frozen=True)
class RoleConfig:
    replicas: int = 0
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 3
    min_replicas: int = 0
    max_replicas: int = 64


@dataclass(frozen=True)
class DataConfig:
    files: tuple[str, ...] = ()
    bytes_per_shard: int | None = None
    records_per_shard: int | None = None  # deprecated: see shard_bytes
    epochs: int = 1
    format: str = "auto"
    watch: bool = False
    poll_seconds: float = 10.0
    on_bad_record: str = "skip"
    fields: int = 0
    delimiter: str = "\t"

    def shard_bytes(self, files: list[str]) -> int:
        """``bytes_per_shard``; the deprecated ``records_per_shard`` is converted with the
        mean line length of a 64 KiB sample of the first file; default 4 MiB."""
        if self.bytes_per_shard is not None:
            return self.bytes_per_shard
        if self.records_per_shard is not None:
            from aimaster.shards import bytes_for_records
            return bytes_for_records(files, self.records_per_shard)
        return DEFAULT_BYTES_PER_SHARD

    def resolved_files(self) -> list[str]:
        """The files matching ``files`` now, in pattern order. A pattern that matches
        nothing is an error, except with ``watch`` (files may come later)."""
        out: list[str] = []
        for pattern in self.files:
            try:
                matches = data_fs.glob(pattern)
            except (OSError, ValueError) as exc:  # credentials, endpoint, unknown scheme
                raise ConfigError(f"data.files: cannot list {pattern!r}: {exc}") from None
            if not matches and not self.watch:
                raise ConfigError(f"data.files: pattern {pattern!r} matches no file")
            out.extend(matches)
        return out


@dataclass(frozen=True)
class JobConfig:
    """The validated job, flat (``parse_job(doc)``; ``JobConfig()`` equals an empty file)."""
    name: str = "job"
    num_slots: int = DEFAULT_NUM_SLOTS
    ps: RoleConfig = RoleConfig(replicas=1)
    worker: RoleConfig = RoleConfig(replicas=0)
    data: DataConfig = DataConfig()
    host: str = "127.0.0.1"
    port: int = 0
    state_dir: str = ""
    lease_seconds: float = 10.0
    heartbeat_seconds: float = 1.0
    ps_start_timeout: float = 60.0
    progress_seconds: float = 5.0
    grace_seconds: float = 30.0
    replication_interval_ms: float = 200.0
    sync_replication: bool = False
    checkpoint_dir: str = ""
    checkpoint_interval_seconds: float = 0.0
    checkpoint_keep_chains: int = 2
    checkpoint_full_every: int = 5
    checkpoint_on_success: bool = True
    export: ExportConfig = ExportConfig()
    init_from: str = ""
    reset_optimizer: bool = False
    autoscale: AutoscaleConfig = AutoscaleConfig()
    gazer: GazerConfig = GazerConfig()
    stragglers: StragglersConfig = StragglersConfig()
    consistency: ConsistencyConfig = ConsistencyConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    security: SecurityConfig = SecurityConfig()
    eval: Optional[EvalConfig] = None


def _role(r: _RoleBase) -> RoleConfig:
    command = getattr(r, "command", ())
    if isinstance(command, str):
        command = command.split()
    return RoleConfig(replicas=r.replicas, command=tuple(str(c) for c in command),
                      env=tuple((str(k), str(v)) for k, v in r.env.items()),
                      max_restarts=getattr(r, "max_restarts", 3),
                      min_replicas=r.min_replicas, max_replicas=r.max_replicas)


def _describe(err: dict) -> str:
    """One ``path: problem`` line for a pydantic error, in the job file's terms."""
    kind, msg = err["type"], err["msg"]
    raw = err["loc"][:-1] if kind == "extra_forbidden" else err["loc"]
    # pydantic adds union branch names ("str", "list[str]", ...) to a location: keep keys only
    loc = [str(p) for p in raw if isinstance(p, str) and p in _KEYS]
    path = ".".join(loc)
    if kind == "extra_forbidden":
        return f"{path or 'job file'}: unknown key(s) [{str(err['loc'][-1])!r}]"
    if kind == "value_error":  # our own checks: the message names the key(s)
        msg = msg.removeprefix("Value error, ")
        return f"{path}.{msg}" if path else msg
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"{path or 'job file'}: expected a mapping, got {type(err['input']).__name__}"
    return f"{path}: {msg[0].lower() + msg[1:]}, got {err['input']!r}"


def _all_keys(model) -> set[str]:
    out = set()
    for name, f in model.model_fields.items():
        out.add(name)
        for ann in (f.annotation, *getattr(f.annotation, "__args__", ())):  # Optional too
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out |= _all_keys(ann)
    return out


_KEYS = _all_keys(JobFile) | {"workers"}


def parse_job(doc) -> JobConfig:
    """Validate a parsed YAML document into a JobConfig; ConfigError names every problem."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"job file: expected a mapping, got {type(doc).__name__}")
    try:
        f = JobFile.model_validate(doc)
    except ValidationError as exc:
        # one line per key: a union (list or string) reports each alternative; keep the first
        lines = {}
        for e in exc.errors():
            line = _describe(e)
            lines.setdefault(line.split(":")[0] if e["type"] != "value_error" else line, line)
        raise ConfigError("\n".join(lines.values())) from None
    files = f.data.files
    m, ck = f.master, f.checkpoint
    return JobConfig(
        name=f.name, num_slots=f.num_slots, ps=_role(f.ps), worker=_role(f.worker),
        data=DataConfig(files=tuple([files] if isinstance(files, str) else files),
                        bytes_per_shard=f.data.bytes_per_shard,
                        records_per_shard=f.data.records_per_shard, epochs=f.data.epochs,
                        format=f.data.format, watch=f.data.watch,
                        poll_seconds=float(f.data.poll_seconds),
                        on_bad_record=f.data.on_bad_record, fields=f.data.fields,
                        delimiter=f.data.delimiter),
        host=m.host, port=m.port, state_dir=m.state_dir,
        lease_seconds=float(m.lease_seconds), heartbeat_seconds=float(m.heartbeat_seconds),
        ps_start_timeout=float(m.ps_start_timeout), progress_seconds=float(m.progress_seconds),
        grace_seconds=float(m.grace_seconds),
        replication_interval_ms=float(f.replication.interval_ms),
        sync_replication=f.replication.mode == "sync",
        checkpoint_dir=ck.dir, checkpoint_interval_seconds=float(ck.interval_seconds),
        checkpoint_keep_chains=ck.keep_chains, checkpoint_full_every=ck.full_every,
        checkpoint_on_success=ck.on_success, export=f.export, init_from=f.init_from,
        reset_optimizer=f.reset_optimizer, autoscale=f.autoscale, gazer=f.gazer,
        stragglers=f.stragglers,
        consistency=f.consistency, kubernetes=f.kubernetes, security=f.security,
        eval=f.eval)


def load_job(path: str | None) -> JobConfig:
    if not path:
        return JobConfig()
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read job file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"job file {path} is not valid YAML: {exc}") from exc
    return parse_job(doc)


def with_overrides(cfg: JobConfig, ps: int | None = None, workers: int | None = None,
                   port: int | None = None, state_dir: str | None = None,
                   init_from: str | None = None) -> JobConfig:
    if ps is not None:
        if ps < 1:
            raise ConfigError(f"--ps: a job needs at least 1 PS, got {ps}")
        if not max(1, cfg.ps.min_replicas) <= ps <= cfg.ps.max_replicas:
            raise ConfigError(f"--ps {ps} is outside [{max(1, cfg.ps.min_replicas)}, "
                              f"{cfg.ps.max_replicas}] (ps.min_replicas / ps.max_replicas)")
        cfg = replace(cfg, ps=replace(cfg.ps, replicas=ps))
    if workers is not None:
        if workers < 0:
            raise ConfigError(f"--workers: must be >= 0, got {workers}")
        if workers and not cfg.worker.command:
            raise ConfigError("--workers > 0 needs worker.command in the job file")
        if not cfg.worker.min_replicas <= workers <= cfg.worker.max_replicas:
            raise ConfigError(f"--workers {workers} is outside [{cfg.worker.min_replicas}, "
                              f"{cfg.worker.max_replicas}] (worker.min_replicas / max_replicas)")
        cfg = replace(cfg, worker=replace(cfg.worker, replicas=workers))
    if port is not None:
        if not 0 <= port < 65536:
            raise ConfigError(f"--port: {port} is not a TCP port")
        cfg = replace(cfg, port=port)
    if state_dir is not None:
        cfg = replace(cfg, state_dir=state_dir)
    if init_from is not None:
        cfg = replace(cfg, init_from=init_from)
    if not cfg.state_dir:
        cfg = replace(cfg, state_dir=os.path.join("runs", cfg.name))
    return cfg
