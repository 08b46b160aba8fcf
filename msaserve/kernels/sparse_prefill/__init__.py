"""Sparse attention of a chunk of queries over their selected KV pages."""
