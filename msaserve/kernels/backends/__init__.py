"""Attention backends, one module each: `resolve(device: torch.device) -> AttentionOps`.

The module's name is the backend's name (`EngineConfig.attention_backend`); `backend_names` lists
them without importing any (configs check names without loading torch or a kernel) and
`msaserve.kernels.dispatch.get_ops` resolves one.
"""

import pkgutil


def backend_names() -> tuple[str, ...]:
    """The registered backends: the modules of this package."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def check_backend_name(name: str) -> str:
    """`name` if it is a registered backend, else a ValueError naming the allowed ones."""
    if name not in backend_names():
        raise ValueError(f"attention_backend={name!r} is invalid: allowed {', '.join(backend_names())}")
    return name
