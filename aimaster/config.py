"""Job configuration: built once from YAML, then flags, then passed down as dataclasses."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field, fields, replace

import yaml

from deeprec_ext.hashing import DEFAULT_NUM_SLOTS


class ConfigError(ValueError):
    """The job file or a flag is wrong; the message names the field."""


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
    records_per_shard: int = 10_000
    epochs: int = 1

    def resolved_files(self) -> list[str]:
        out: list[str] = []
        for pattern in self.files:
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise ConfigError(f"data.files: pattern {pattern!r} matches no file")
            out.extend(matches)
        return out


# Each feature parses its own section; the blocks below are owned by the feature named.

# --- planning: autoscale policy (aimaster/policy.py) ---
@dataclass(frozen=True)
class AutoscaleConfig:
    enabled: bool = False
    dry_run: bool = False              # decide and record, never scale
    interval_seconds: float = 1.0      # one observation (PS Stats, worker counters) per interval
    cooldown_seconds: float = 30.0
    settle_seconds: float = 5.0
    measure_seconds: float = 10.0
    window_seconds: float = 30.0
    max_wait_seconds: float = 120.0
    recovery: str = "continue"         # "continue" | "wait"
    resource_fit: bool = True
    performance_fit: bool = True
    memory_headroom: float = 0.2
    lead_seconds: float = 20.0
    scale_out_reserve: float = 2.0     # x a PS's data (RSS above the bare process) kept free
    replicated: bool = True            # ring replication doubles what a PS holds at >= 2 PS
    ps_memory_limit_mb: float = 0.0    # given to every PS (DEEPREC_PS_MEMORY_LIMIT_MB); 0: none
    ps_cpu_high: float = 0.8
    ps_cpu_low: float = 0.25
    worker_util_low: float = 0.5
    min_gain: float = 0.9
    explore_ttl_seconds: float = 300.0
    worker_cores: float = 1.0
    ps_cores: float = 1.0
    worker_memory_mb: float = 0.0

    def policy_config(self, job: "JobConfig"):
        """The policy's knobs, with each role's min/max from the job's role sections."""
        from aimaster.policy import PolicyConfig
        return PolicyConfig(
            ps_min=max(1, job.ps.min_replicas), ps_max=job.ps.max_replicas,
            worker_min=job.worker.min_replicas, worker_max=job.worker.max_replicas,
            ps_memory_limit_bytes=int(self.ps_memory_limit_mb * 1024 * 1024),
            worker_memory_bytes=int(self.worker_memory_mb * 1024 * 1024),
            **{f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("enabled", "dry_run", "ps_memory_limit_mb", "worker_memory_mb")})


def _parse_autoscale(d) -> AutoscaleConfig:
    d = _expect(d, "autoscale")
    known = {f.name for f in fields(AutoscaleConfig)}
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"autoscale: unknown key(s) {sorted(unknown)}; expected some of {sorted(known)}")
    out = {}
    for f in fields(AutoscaleConfig):
        if f.name not in d:
            continue
        v = d[f.name]
        if isinstance(f.default, bool):
            if not isinstance(v, bool):
                raise ConfigError(f"autoscale.{f.name}: expected true or false, got {v!r}")
        elif f.name == "recovery":
            if v not in ("continue", "wait"):
                raise ConfigError(f"autoscale.recovery: expected 'continue' or 'wait', got {v!r}")
        elif f.name in ("memory_headroom", "ps_memory_limit_mb", "worker_memory_mb",
                        "scale_out_reserve"):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 \
                    or (f.name == "memory_headroom" and v >= 1):
                raise ConfigError(f"autoscale.{f.name}: expected a number >= 0"
                                  + (" and < 1" if f.name == "memory_headroom" else "")
                                  + f", got {v!r}")
            v = float(v)
        else:
            v = _float(d, f.name, "autoscale", f.default)
        out[f.name] = v
    cfg = AutoscaleConfig(**out)
    if cfg.ps_cpu_low >= cfg.ps_cpu_high:
        raise ConfigError(f"autoscale.ps_cpu_low ({cfg.ps_cpu_low}) must be below "
                          f"autoscale.ps_cpu_high ({cfg.ps_cpu_high})")
    if cfg.measure_seconds > cfg.window_seconds:
        raise ConfigError(f"autoscale.measure_seconds ({cfg.measure_seconds}) must not exceed "
                          f"autoscale.window_seconds ({cfg.window_seconds})")
    return cfg


# --- Gazer statistics (gazer/) ---
@dataclass(frozen=True)
class GazerConfig:
    enabled: bool = True
    op_sample_every_steps: int = 100  # workers trace one step in N (0: no per-op timings)
    top_ops: int = 20                  # ops per worker report
    prometheus_port: int = 0           # 0: no Prometheus endpoint (`aimaster run --prometheus-port`)


def _parse_gazer(d) -> GazerConfig:
    d = _expect(d, "gazer")
    unknown = set(d) - {"enabled", "op_sample_every_steps", "top_ops", "prometheus_port"}
    if unknown:
        raise ConfigError(f"gazer: unknown key(s) {sorted(unknown)}")
    enabled = d.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"gazer.enabled: expected true or false, got {enabled!r}")
    port = _int(d, "prometheus_port", "gazer", 0)
    if port > 65535:
        raise ConfigError(f"gazer.prometheus_port: {port} is not a TCP port")
    if port and not enabled:
        raise ConfigError("gazer.prometheus_port needs gazer.enabled: true")
    return GazerConfig(enabled=enabled,
                       op_sample_every_steps=_int(d, "op_sample_every_steps", "gazer", 100),
                       top_ops=_int(d, "top_ops", "gazer", 20, minimum=1),
                       prometheus_port=port)


# --- consistent (sync) mode with virtual workers (aimaster/consistent.py) ---
@dataclass(frozen=True)
class ConsistencyConfig:
    mode: str = "async"        # "async" | "sync"
    virtual_workers: int = 0   # sync: logical workers V (0: not set)
    seed: int = 0              # sync: seeds each virtual worker's random state
    steps: int = 0             # sync: stop after this many global steps (0: when data runs out)


def _parse_consistency(d) -> ConsistencyConfig:
    if isinstance(d, str):
        d = {"mode": d}
    d = _expect(d, "consistency")
    unknown = set(d) - {"mode", "virtual_workers", "seed", "steps"}
    if unknown:
        raise ConfigError(f"consistency: unknown key(s) {sorted(unknown)}")
    mode = d.get("mode", "async")
    if mode not in ("async", "sync"):
        raise ConfigError(f"consistency.mode: expected 'async' or 'sync', got {mode!r}")
    cfg = ConsistencyConfig(mode=mode,
                            virtual_workers=_int(d, "virtual_workers", "consistency", 0),
                            seed=_int(d, "seed", "consistency", 0),
                            steps=_int(d, "steps", "consistency", 0))
    if mode == "sync" and cfg.virtual_workers < 1:
        raise ConfigError("consistency.virtual_workers: mode 'sync' needs an integer >= 1 "
                          "(the number of logical workers every step is split into)")
    if mode == "async" and (cfg.virtual_workers or cfg.steps):
        raise ConfigError("consistency: virtual_workers and steps apply to mode 'sync' only")
    return cfg


# --- Kubernetes deployment and access control (tfjob_crd/, aimaster/scaler/kubernetes.py) ---
@dataclass(frozen=True)
class KubernetesConfig:
    """How ``aimaster manifest`` renders the job as a TFJob (see docs/guide-kubernetes.md)."""
    image: str = ""
    namespace: str = ""                 # empty: the namespace kubectl applies to
    image_pull_policy: str = "IfNotPresent"
    port: int = 50051                   # AIMaster port inside the chief pod
    ps_port: int = 2222                 # PS port (the operator's default TFJob port)
    token_secret: str | None = None     # Secret with key "token"; None: "<name>-token"; "": off
    tls_secret: str = ""                # Secret with tls.crt, tls.key, ca.crt; empty: no TLS
    # long enough for a PS to hand its last changes to its ring peer, short enough to fit
    # a spot instance's preemption notice (30 s on the big clouds' shortest)
    termination_grace_seconds: int = 30
    data_pvc: str = ""                  # PersistentVolumeClaim mounted in every container
    data_mount_path: str = "/data"
    service_account: str = ""           # default "<name>-aimaster"


_K8S_KEYS = {"image", "namespace", "image_pull_policy", "port", "ps_port", "token_secret",
             "tls_secret", "termination_grace_seconds", "data_pvc", "data_mount_path",
             "service_account"}


def _parse_kubernetes(d) -> KubernetesConfig:
    d = _expect(d, "kubernetes")
    unknown = set(d) - _K8S_KEYS
    if unknown:
        raise ConfigError(f"kubernetes: unknown key(s) {sorted(unknown)}; expected some of "
                          f"{sorted(_K8S_KEYS)}")
    for key in _K8S_KEYS - {"port", "ps_port", "termination_grace_seconds", "token_secret"}:
        if key in d and not isinstance(d[key], str):
            raise ConfigError(f"kubernetes.{key}: expected a string, got {d[key]!r}")
    token_secret = d.get("token_secret")
    if token_secret is not None and token_secret is not False and not isinstance(token_secret, str):
        raise ConfigError(f"kubernetes.token_secret: expected a Secret name, '' or false, "
                          f"got {token_secret!r}")
    policy = d.get("image_pull_policy", "IfNotPresent")
    if policy not in ("Always", "IfNotPresent", "Never"):
        raise ConfigError(f"kubernetes.image_pull_policy: expected Always, IfNotPresent or "
                          f"Never, got {policy!r}")
    ports = {k: _int(d, k, "kubernetes", default, minimum=1)
             for k, default in (("port", 50051), ("ps_port", 2222))}
    for k, v in ports.items():
        if v > 65535:
            raise ConfigError(f"kubernetes.{k}: {v} is not a TCP port")
    if ports["port"] == ports["ps_port"]:
        raise ConfigError(f"kubernetes.port and kubernetes.ps_port must differ (both {ports['port']})")
    mount = d.get("data_mount_path", "/data")
    if not mount.startswith("/"):
        raise ConfigError(f"kubernetes.data_mount_path: expected an absolute path, got {mount!r}")
    return KubernetesConfig(
        image=d.get("image", ""), namespace=d.get("namespace", ""), image_pull_policy=policy,
        port=ports["port"], ps_port=ports["ps_port"],
        token_secret=None if token_secret is None else (token_secret or ""),
        tls_secret=d.get("tls_secret", ""),
        termination_grace_seconds=_int(d, "termination_grace_seconds", "kubernetes", 30, minimum=1),
        data_pvc=d.get("data_pvc", ""), data_mount_path=mount,
        service_account=d.get("service_account", ""))


@dataclass(frozen=True)
class SecurityConfig:
    token_file: str = ""       # job token; every RPC of the AIMaster and the PS must carry it
    tls_dir: str = ""          # ca.crt, tls.crt, tls.key: serve and dial over TLS
    tls_server_name: str = ""  # the name in the certificate (default "deeprec")


def _parse_security(d) -> SecurityConfig:
    d = _expect(d, "security")
    unknown = set(d) - {"token_file", "tls_dir", "tls_server_name"}
    if unknown:
        raise ConfigError(f"security: unknown key(s) {sorted(unknown)}")
    for key in ("token_file", "tls_dir", "tls_server_name"):
        if key in d and not isinstance(d[key], str):
            raise ConfigError(f"security.{key}: expected a string, got {d[key]!r}")
    return SecurityConfig(token_file=d.get("token_file", ""), tls_dir=d.get("tls_dir", ""),
                          tls_server_name=d.get("tls_server_name", ""))
# --- the model as an output: final checkpoint, export, warm start (deeprec_ext/serving/) ---
@dataclass(frozen=True)
class ExportConfig:
    dir: str = ""                       # "": no export; else DIR/<unix time> after the final checkpoint
    tables: tuple[str, ...] = ()        # () : every table
    dtype: str = "float32"              # "float16": values stored as float16 in the export
    min_count: int = 0                  # keep only rows updated at least N times (0: all)


def _parse_export(d) -> ExportConfig:
    d = _expect(d, "export")
    unknown = set(d) - {"dir", "tables", "dtype", "min_count"}
    if unknown:
        raise ConfigError(f"export: unknown key(s) {sorted(unknown)}; expected some of "
                          "['dir', 'dtype', 'min_count', 'tables']")
    out = d.get("dir", "")
    if not isinstance(out, str):
        raise ConfigError(f"export.dir: expected a directory path, got {out!r}")
    tables = d.get("tables", [])
    if isinstance(tables, str):
        tables = [tables]
    if not isinstance(tables, list) or not all(isinstance(t, str) and t for t in tables):
        raise ConfigError(f"export.tables: expected a list of table names, got {tables!r}")
    dtype = d.get("dtype", "float32")
    if dtype not in ("float32", "float16"):
        raise ConfigError(f"export.dtype: expected 'float32' or 'float16', got {dtype!r}")
    return ExportConfig(dir=out, tables=tuple(tables), dtype=dtype,
                        min_count=_int(d, "min_count", "export", 0))


# --- end of feature sections ---


@dataclass(frozen=True)
class JobConfig:
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
    # how long a member asked to leave (scale-in, job end) may take to hand off and exit
    # before it is killed; the preemption window Kubernetes gives is typically 30 s
    grace_seconds: float = 30.0
    replication_interval_ms: float = 200.0
    sync_replication: bool = False
    checkpoint_dir: str = ""            # default: <state_dir>/checkpoints
    checkpoint_interval_seconds: float = 0.0  # 0: only on request (aimaster checkpoint)
    checkpoint_keep_chains: int = 2
    checkpoint_full_every: int = 5      # every Nth checkpoint is full, the others incremental
    checkpoint_on_success: bool = True  # a full checkpoint when the job succeeds
    export: ExportConfig = ExportConfig()
    init_from: str = ""                 # warm start: tables and dense variables from this checkpoint
    reset_optimizer: bool = False       # warm start without the optimizer slots
    autoscale: AutoscaleConfig = AutoscaleConfig()
    gazer: GazerConfig = GazerConfig()
    consistency: ConsistencyConfig = ConsistencyConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    security: SecurityConfig = SecurityConfig()


_TOP_KEYS = {"name", "num_slots", "ps", "worker", "workers", "data", "master", "replication",
             "checkpoint", "autoscale", "gazer", "consistency", "kubernetes", "security",
             "export", "init_from", "reset_optimizer"}


def _expect(d, what: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{what}: expected a mapping, got {type(d).__name__}")
    return d


def _int(d: dict, key: str, what: str, default: int, minimum: int = 0) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{what}.{key}: expected an integer >= {minimum}, got {v!r}")
    return v


def _float(d: dict, key: str, what: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"{what}.{key}: expected a positive number, got {v!r}")
    return float(v)


def _role(d, what: str, default_replicas: int) -> RoleConfig:
    d = _expect(d, what)
    allowed = {"replicas", "command", "env", "max_restarts", "min_replicas", "max_replicas"}
    if what == "ps":  # PS always run `python -m deeprec_ext.ps`; a dead PS is not restarted empty
        allowed -= {"command", "max_restarts"}
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {sorted(unknown)}")
    command = d.get("command", [])
    if isinstance(command, str):
        command = command.split()
    if not isinstance(command, list) or not all(isinstance(c, (str, int, float)) for c in command):
        raise ConfigError(f"{what}.command: expected a list of strings, got {command!r}")
    env = _expect(d.get("env"), f"{what}.env")
    role = RoleConfig(replicas=_int(d, "replicas", what, default_replicas),
                      command=tuple(str(c) for c in command),
                      env=tuple((str(k), str(v)) for k, v in env.items()),
                      max_restarts=_int(d, "max_restarts", what, 3),
                      min_replicas=_int(d, "min_replicas", what, 0),
                      max_replicas=_int(d, "max_replicas", what, 64, minimum=1))
    if not role.min_replicas <= role.replicas <= role.max_replicas:
        raise ConfigError(f"{what}: replicas ({role.replicas}) must lie within min_replicas "
                          f"({role.min_replicas}) and max_replicas ({role.max_replicas})")
    return role


def parse_job(doc) -> JobConfig:
    """Validate a parsed YAML document into a JobConfig."""
    d = _expect(doc, "job file")
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"job file: unknown key(s) {sorted(unknown)}; expected some of {sorted(_TOP_KEYS)}")
    name = d.get("name", "job")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name: expected a non-empty string, got {name!r}")
    data = _expect(d.get("data"), "data")
    unknown = set(data) - {"files", "records_per_shard", "epochs"}
    if unknown:
        raise ConfigError(f"data: unknown key(s) {sorted(unknown)}")
    files = data.get("files", [])
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ConfigError(f"data.files: expected a list of paths or globs, got {files!r}")
    master = _expect(d.get("master"), "master")
    unknown = set(master) - {"host", "port", "state_dir", "lease_seconds", "heartbeat_seconds",
                             "ps_start_timeout", "progress_seconds", "grace_seconds"}
    if unknown:
        raise ConfigError(f"master: unknown key(s) {sorted(unknown)}")
    repl = _expect(d.get("replication"), "replication")
    unknown = set(repl) - {"interval_ms", "mode"}
    if unknown:
        raise ConfigError(f"replication: unknown key(s) {sorted(unknown)}")
    mode = repl.get("mode", "async")
    if mode not in ("async", "sync"):
        raise ConfigError(f"replication.mode: expected 'async' or 'sync', got {mode!r}")
    ck = _expect(d.get("checkpoint"), "checkpoint")
    unknown = set(ck) - {"dir", "interval_seconds", "keep_chains", "full_every", "on_success"}
    if unknown:
        raise ConfigError(f"checkpoint: unknown key(s) {sorted(unknown)}")
    interval = ck.get("interval_seconds", 0)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
        raise ConfigError(f"checkpoint.interval_seconds: expected a number >= 0, got {interval!r}")
    on_success = ck.get("on_success", True)
    if not isinstance(on_success, bool):
        raise ConfigError(f"checkpoint.on_success: expected true or false, got {on_success!r}")
    init_from = d.get("init_from", "")
    if not isinstance(init_from, str):
        raise ConfigError(f"init_from: expected a checkpoint directory, got {init_from!r}")
    reset_optimizer = d.get("reset_optimizer", False)
    if not isinstance(reset_optimizer, bool):
        raise ConfigError(f"reset_optimizer: expected true or false, got {reset_optimizer!r}")
    if "worker" in d and "workers" in d:
        raise ConfigError("job file: give either 'worker' or 'workers', not both")
    num_slots = _int(d, "num_slots", "job", DEFAULT_NUM_SLOTS, minimum=1)
    ps = _role(d.get("ps"), "ps", 1)
    if ps.replicas < 1:
        raise ConfigError("ps.replicas: a job needs at least 1 PS")
    if ps.max_replicas > num_slots:
        raise ConfigError(f"ps.max_replicas ({ps.max_replicas}) exceeds num_slots ({num_slots}): "
                          "a PS would own no slot")
    cfg = JobConfig(
        name=name, num_slots=num_slots, ps=ps,
        worker=_role(d.get("worker", d.get("workers")), "worker", 0),
        data=DataConfig(files=tuple(files),
                        records_per_shard=_int(data, "records_per_shard", "data", 10_000, 1),
                        epochs=_int(data, "epochs", "data", 1, 1)),
        host=str(master.get("host", "127.0.0.1")),
        port=_int(master, "port", "master", 0),
        state_dir=str(master.get("state_dir", "")),
        lease_seconds=_float(master, "lease_seconds", "master", 10.0),
        heartbeat_seconds=_float(master, "heartbeat_seconds", "master", 1.0),
        ps_start_timeout=_float(master, "ps_start_timeout", "master", 60.0),
        progress_seconds=_float(master, "progress_seconds", "master", 5.0),
        grace_seconds=_float(master, "grace_seconds", "master", 30.0),
        replication_interval_ms=_float(repl, "interval_ms", "replication", 200.0),
        sync_replication=mode == "sync",
        checkpoint_dir=str(ck.get("dir", "")),
        checkpoint_interval_seconds=float(interval),
        checkpoint_keep_chains=_int(ck, "keep_chains", "checkpoint", 2, minimum=1),
        checkpoint_full_every=_int(ck, "full_every", "checkpoint", 5, minimum=1),
        checkpoint_on_success=on_success,
        export=_parse_export(d.get("export")),
        init_from=init_from,
        reset_optimizer=reset_optimizer,
        autoscale=_parse_autoscale(d.get("autoscale")),
        gazer=_parse_gazer(d.get("gazer")),
        consistency=_parse_consistency(d.get("consistency")),
        kubernetes=_parse_kubernetes(d.get("kubernetes")),
        security=_parse_security(d.get("security")),
    )
    if cfg.worker.replicas and not cfg.worker.command:
        raise ConfigError("worker.command: required when worker.replicas > 0")
    if cfg.heartbeat_seconds * 2 > cfg.lease_seconds:
        raise ConfigError(f"master.heartbeat_seconds ({cfg.heartbeat_seconds}) must be at most half "
                          f"of master.lease_seconds ({cfg.lease_seconds})")
    return cfg


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
