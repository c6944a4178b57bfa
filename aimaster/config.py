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


def _parse_autoscale(d) -> AutoscaleConfig:
    d = _expect(d, "autoscale")
    unknown = set(d) - {"enabled"}
    if unknown:
        raise ConfigError(f"autoscale: unknown key(s) {sorted(unknown)}")
    return AutoscaleConfig(enabled=bool(d.get("enabled", False)))


# --- Gazer statistics (gazer/) ---
@dataclass(frozen=True)
class GazerConfig:
    enabled: bool = True


def _parse_gazer(d) -> GazerConfig:
    d = _expect(d, "gazer")
    unknown = set(d) - {"enabled"}
    if unknown:
        raise ConfigError(f"gazer: unknown key(s) {sorted(unknown)}")
    return GazerConfig(enabled=bool(d.get("enabled", True)))


# --- consistent (sync) mode with virtual workers ---
@dataclass(frozen=True)
class ConsistencyConfig:
    mode: str = "async"        # "async" | "sync"
    virtual_workers: int = 0   # sync: logical workers V (0: not set)


def _parse_consistency(d) -> ConsistencyConfig:
    if isinstance(d, str):
        d = {"mode": d}
    d = _expect(d, "consistency")
    unknown = set(d) - {"mode", "virtual_workers"}
    if unknown:
        raise ConfigError(f"consistency: unknown key(s) {sorted(unknown)}")
    mode = d.get("mode", "async")
    if mode not in ("async", "sync"):
        raise ConfigError(f"consistency.mode: expected 'async' or 'sync', got {mode!r}")
    return ConsistencyConfig(mode=mode,
                             virtual_workers=_int(d, "virtual_workers", "consistency", 0))


# --- Kubernetes deployment and access control (tfjob_crd/, aimaster/scaler/kubernetes.py) ---
@dataclass(frozen=True)
class KubernetesConfig:
    image: str = ""


def _parse_kubernetes(d) -> KubernetesConfig:
    d = _expect(d, "kubernetes")
    unknown = set(d) - {"image"}
    if unknown:
        raise ConfigError(f"kubernetes: unknown key(s) {sorted(unknown)}")
    return KubernetesConfig(image=str(d.get("image", "")))


@dataclass(frozen=True)
class SecurityConfig:
    token_file: str = ""


def _parse_security(d) -> SecurityConfig:
    d = _expect(d, "security")
    unknown = set(d) - {"token_file"}
    if unknown:
        raise ConfigError(f"security: unknown key(s) {sorted(unknown)}")
    return SecurityConfig(token_file=str(d.get("token_file", "")))
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
    autoscale: AutoscaleConfig = AutoscaleConfig()
    gazer: GazerConfig = GazerConfig()
    consistency: ConsistencyConfig = ConsistencyConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    security: SecurityConfig = SecurityConfig()


_TOP_KEYS = {"name", "num_slots", "ps", "worker", "workers", "data", "master", "replication",
             "checkpoint", "autoscale", "gazer", "consistency", "kubernetes", "security"}


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
    unknown = set(ck) - {"dir", "interval_seconds", "keep_chains", "full_every"}
    if unknown:
        raise ConfigError(f"checkpoint: unknown key(s) {sorted(unknown)}")
    interval = ck.get("interval_seconds", 0)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
        raise ConfigError(f"checkpoint.interval_seconds: expected a number >= 0, got {interval!r}")
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
                   port: int | None = None, state_dir: str | None = None) -> JobConfig:
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
    if not cfg.state_dir:
        cfg = replace(cfg, state_dir=os.path.join("runs", cfg.name))
    return cfg
