"""TensorFlow integration. Keras: ``ElasticEmbedding`` + ``ElasticCallback``; TF1 graphs:
``embedding_lookup`` + ``ElasticSessionHook``; input: ``shard_dataset``."""
from deeprec_ext.tf.data import look_ahead, shard_dataset
from deeprec_ext.tf.keras_api import ElasticCallback, ElasticEmbedding
from deeprec_ext.tf.tf1_api import ElasticSessionHook, embedding_lookup
from deeprec_ext.tf.tf1_eval import EvalTensorsError, eval_tensors
from deeprec_ext.worker import WorkerContext, get_context, set_context

__all__ = ["ElasticEmbedding", "ElasticCallback", "embedding_lookup", "ElasticSessionHook",
           "shard_dataset", "look_ahead", "eval_tensors", "EvalTensorsError", "WorkerContext", "get_context",
           "set_context"]
