"""Build and load the C kernels of the CPU backend, the way Triton builds its launchers: the source
is compiled once per machine with the system C compiler (`cc -O3 -march=native -fopenmp`) into a
cache directory keyed by the source's hash, then loaded with ctypes. No torch headers, no ninja:
a build takes about a second. Where no compiler works, `load` returns None and the caller uses its
PyTorch path (same results); MSASERVE_CPU_NATIVE=0 asks for the PyTorch paths.

Cache: $MSASERVE_CACHE_DIR, else $XDG_CACHE_HOME/msaserve, else ~/.cache/msaserve.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

# -fopenmp links libgomp.so.1: the process already holds torch's copy of that soname (torch/lib),
# so the kernels share torch's OpenMP thread pool instead of starting a second one. (Measured: a
# Python thread pool running the same kernels cost 1.5× dense CPU time at 4K, OpenMP 1.3×.)
# -ffast-math only when compiling (vectorised expf): linking with it would add crtfastmath.o, whose
# constructor sets flush-to-zero / denormals-are-zero for the whole process when the library loads
# (seen: every later float op in the server and the tests lost subnormals).
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-ffast-math", "-std=c11")
_LINK_FLAGS = ("-shared", "-fopenmp")


def cache_dir() -> Path:
    if os.environ.get("MSASERVE_CACHE_DIR"):
        return Path(os.environ["MSASERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "msaserve"


def enabled() -> bool:
    """False when MSASERVE_CPU_NATIVE=0: the CPU ops then take their PyTorch paths."""
    return os.environ.get("MSASERVE_CPU_NATIVE", "1") != "0"


@cache
def load(name: str, source: str) -> ctypes.CDLL | None:
    """The shared library built from C `source` (cached), or None if it cannot be built here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU MSA ops use their PyTorch path")
        return None
    parts = (source, compiler, *_FLAGS, *_LINK_FLAGS, platform.machine())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    path = cache_dir() / f"{name}-{key[:16]}.so"
    if not path.is_file():
        try:
            _build(compiler, source, path)
        except (OSError, subprocess.CalledProcessError) as err:
            log.warning("building %s failed (%s): the CPU MSA ops use their PyTorch path", name, err)
            return None
    return ctypes.CDLL(str(path))


def _build(compiler: str, source: str, path: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never see half a library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, obj, lib = Path(tmp) / "kernel.c", Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        src.write_text(source)
        subprocess.run([compiler, *_FLAGS, "-c", str(src), "-o", str(obj)], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([compiler, *_LINK_FLAGS, str(obj), "-o", str(lib), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, path)
