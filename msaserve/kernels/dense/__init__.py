"""Dense causal attention over the paged KV cache: the baseline every benchmark compares with."""
