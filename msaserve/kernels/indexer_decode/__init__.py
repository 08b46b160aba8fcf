"""Block-max index scoring and top-K selection for 1–16 decode queries per sequence."""
