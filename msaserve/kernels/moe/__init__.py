"""Mixture-of-experts ops: `naive.py` is the spec (a loop over experts, PyTorch), `grouped.py` the fast
path (routing, sort by expert, grouped GEMMs, weighted un-permute; no loop, no host sync), with its
elementwise kernels in `triton.py`."""
