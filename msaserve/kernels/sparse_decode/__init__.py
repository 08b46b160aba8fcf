"""Paged sparse attention of 1–16 decode queries per sequence over their selected pages."""
