"""Observability: round summaries and the TensorBoard dashboard."""
