"""Test-session setup shared by every test folder.

Without CUDA, Triton kernels can only run under its interpreter, and Triton decides that when it is
first imported (its own standard-library functions are decorated then). Some torch modules import
Triton as a side effect, so the choice is made here, before any test module imports anything.
"""

import contextlib
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# transformers decides whether torchvision is there when its image modules are first imported; the
# M3 processor oracle needs it, so the oracle's torchvision (.oracle-site/, see tests/m3_oracle.py) is
# made importable here, before any test module imports transformers. A no-op where it is absent.
from m3_oracle import enable_torchvision

enable_torchvision()


@pytest.fixture(scope="session", autouse=True)
def _remove_shard_segment_files():
    """Shard actors that tests start keep their index arenas in shared-memory files
    (`kvcache/shared_segments.py`); a killed actor cannot unlink its own. At the end of the session
    the files the session's shards made (named msaserve-*, newer than the session) are removed."""
    from msaserve.kvcache.shared_segments import default_directory

    started = time.time() - 1
    yield
    for path in default_directory().glob("msaserve-*"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= started:
                path.unlink()
