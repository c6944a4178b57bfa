"""PS-side embedding store (numpy only, no TensorFlow).

* :class:`HashIndex` -- vectorized open-addressing int64 key -> row id map.
* :func:`make_initializer` -- deterministic per-key initial values.
* :func:`make_optimizer` -- TF-formula sparse optimizers over value+slot rows.
* :class:`EmbeddingTable` / :class:`EmbeddingStore` / :class:`SequenceCounter`.
"""
from deeprec_ext.store.hash_index import HashIndex
from deeprec_ext.store.initializers import Initializer, make_initializer
from deeprec_ext.store.optimizers import Optimizer, make_optimizer
from deeprec_ext.store.table import EmbeddingStore, EmbeddingTable, LogTrimmed, SequenceCounter

__all__ = [
    "EmbeddingStore",
    "EmbeddingTable",
    "HashIndex",
    "Initializer",
    "LogTrimmed",
    "Optimizer",
    "SequenceCounter",
    "make_initializer",
    "make_optimizer",
]
