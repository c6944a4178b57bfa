"""Serving: export a trained job's model as a stock TensorFlow SavedModel."""
