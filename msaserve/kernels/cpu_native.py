"""Build and load the C kernels of the CPU backend, the way Triton builds its launchers: the source
is compiled once per machine with the system C compiler (`cc -O3 -march=native`) into a
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# -fopenmp-simd: the `omp simd` loop hints only, no OpenMP runtime (torch brings its own; a second
# one would oversubscribe the cores). Threads come from `parallel_tasks`.
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-ffast-math", "-std=c11")
_pool: ThreadPoolExecutor | None = None


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
    key = hashlib.sha256("\0".join((source, compiler, *_FLAGS, platform.machine())).encode()).hexdigest()
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
        src, lib = Path(tmp) / "kernel.c", Path(tmp) / "kernel.so"
        src.write_text(source)
        subprocess.run([compiler, *_FLAGS, str(src), "-o", str(lib), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, path)


def parallel_tasks(run: Callable[[int, int], None], num_tasks: int) -> None:
    """Run `run(begin, end)` over task ranges covering 0..num_tasks on torch.get_num_threads()
    threads (ctypes releases the GIL, so the ranges run in parallel); small ranges interleave so
    uneven tasks (causal: later blocks cost more) balance."""
    global _pool
    threads = max(1, min(torch.get_num_threads(), num_tasks))
    if threads == 1:
        run(0, num_tasks)
        return
    if _pool is None or _pool._max_workers < threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="msa-cpu")
    chunk = max(1, num_tasks // (threads * 8))
    ranges = [(b, min(b + chunk, num_tasks)) for b in range(0, num_tasks, chunk)]
    for future in [_pool.submit(run, b, e) for b, e in ranges]:
        future.result()
