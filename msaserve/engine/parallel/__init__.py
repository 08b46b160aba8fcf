"""One model replica across several ranks (GPUs, or CPU processes over gloo): the layout, the
torch.distributed groups, tensor- and expert-parallel sharding of MiniMax-M3, the Ray worker group
a replica drives, and rank-to-rank session page moves (docs/scaling.md)."""
