"""Dataclasses and errors of the estimate (no TensorFlow import here)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


class EstimateError(Exception):
    """Bad input to the estimate: the message names the problem (the CLI prints it)."""


@dataclass
class TableEstimate:
    """One elastic table (``ElasticEmbedding`` layer or ``dtf.embedding_lookup``)."""
    name: str
    dim: int
    optimizer: str
    num_slots: int                 # slot vectors per row on the PS (adam 3, ftrl 2, ...)
    initializer: object = None
    key_dtype: str = "int64"       # PS keys are int64 whatever the input dtype
    input_dtype: str | None = None
    feature: str | None = None     # input feature that feeds it, when known
    ids_per_sample: int | None = None
    rows: int | None = None
    rows_source: str = "unknown"   # hint | sample | sample+heaps | unknown
    optimizer_assumed: bool = False
    admission: dict | None = None  # the table's policies (deeprec_ext.store.policies)
    eviction: dict | None = None
    rows_all_ids: int | None = None  # distinct ids of the stream (rows without the policies)
    candidate_rows: int = 0        # admission candidates: exact counters, or bloom blocks
    candidate_dim: int = 1         # floats per candidate row (1; bloom: BLOOM_BLOCK cells)
    rows_reason: str = ""          # why these rows (admission / eviction arithmetic)
    storage_dtype: str = "float32"  # of the values on the PS (float16: 2 B each)

    @property
    def row_floats(self) -> int:
        return self.dim * (1 + self.num_slots)

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value (the slots stay float32)."""
        return 2 if self.storage_dtype == "float16" else 4

    @property
    def arena_row_bytes(self) -> int:
        return self.value_bytes * self.dim + 4 * self.dim * self.num_slots


@dataclass
class Candidate:
    """A local variable that should be an ElasticEmbedding."""
    name: str
    kind: str                      # "keras.layers.Embedding" | "large variable" | "gathered variable"
    shape: list
    bytes: int
    reason: str


@dataclass
class DenseVariable:
    name: str
    shape: list
    params: int
    dtype: str = "float32"


@dataclass
class RolePlan:
    replicas: int
    memory_bytes: int              # what to request: estimate x (1 + headroom)
    cpu: float
    estimated_rss_bytes: int = 0   # the estimate itself (compared with measured RSS)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    ps: RolePlan
    worker: RolePlan
    inputs: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"ps": self.ps.to_dict(), "worker": self.worker.to_dict(), "inputs": self.inputs}


@dataclass
class Estimate:
    source: str
    kind: str                      # keras | tf1 | savedmodel | metagraph | graphdef
    tables: list[TableEstimate]
    candidates: list[Candidate]
    dense: list[DenseVariable]
    flops_per_sample: int | None   # forward pass
    plan: Plan
    ps_memory: dict                # components of one PS's estimated RSS
    arithmetic: list[str]
    warnings: list[str] = field(default_factory=list)
    sampling: dict | None = None

    @property
    def dense_params(self) -> int:
        return sum(v.params for v in self.dense)

    def to_dict(self) -> dict:
        tables = []
        for t in self.tables:
            d = asdict(t)
            d["row_floats"] = t.row_floats
            tables.append(d)
        return {
            "source": self.source, "kind": self.kind, "tables": tables,
            "candidates": [asdict(c) for c in self.candidates],
            "dense": {"variables": [asdict(v) for v in self.dense],
                      "params": self.dense_params, "bytes": 4 * self.dense_params},
            "flops_per_sample": self.flops_per_sample,
            "train_flops_per_sample": 3 * self.flops_per_sample if self.flops_per_sample else None,
            "plan": self.plan.to_dict(), "ps_memory": self.ps_memory,
            "arithmetic": self.arithmetic, "warnings": self.warnings, "sampling": self.sampling,
        }
