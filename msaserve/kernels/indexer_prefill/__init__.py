"""Causal block-max index scoring and top-K block selection for a chunk of queries."""
