"""Accuracy-consistent (sync) training: V virtual workers on any number of physical
workers, one optimizer step per global step, the same bits whatever the layout.
See docs/guide-consistent.md. Import ``deeprec_ext.sync.keras`` for the Keras parts."""
from deeprec_ext.sync.client import SyncPSClient
from deeprec_ext.sync.runtime import StepModel, SyncTrainer, VirtualWorker

__all__ = ["SyncPSClient", "SyncTrainer", "VirtualWorker", "StepModel"]
