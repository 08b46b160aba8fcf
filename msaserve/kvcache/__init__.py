"""Disaggregated KV cache service: index store apart from block store, memory and disk tiers, migration."""
