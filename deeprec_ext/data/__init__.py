"""Data shards: reading the records of a byte/row range of a file (``ranges``, no
TensorFlow) and the same in a ``tf.data`` pipeline (``deeprec_ext.data.tf``)."""
from deeprec_ext.data.ranges import read_shard  # noqa: F401

__all__ = ["read_shard"]
