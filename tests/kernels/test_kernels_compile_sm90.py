"""The Triton kernels of M3's decode layer compiled for sm_90 on the CPU (no GPU needed): compiled
Triton rejects what the interpreter runs, e.g. a runtime branch that leaves values of different
shapes (the first `m3_attention_heads` kernel did), so the CPU suite compiles them too. The compile
runs in a subprocess: this suite decorates every kernel, Triton's own included, for the interpreter."""

import os
import subprocess
import sys

import pytest

SKIP = 3
"""The subprocess's exit status when this Triton cannot assemble for sm_90 here."""


def _compile(fn, pointers: dict[str, str], scalars: dict[str, str], constants: dict) -> None:
    """Compile `fn` for sm_90: pointers by name, scalars as given (others i32), constants constexpr."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(index,)] = constants[name]
        else:
            signature[name] = pointers.get(name) or scalars.get(name, "i32")
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_all() -> None:
    from msaserve.kernels.layer_ops import triton as layer_triton
    from msaserve.kernels.moe import triton as moe_triton

    def bf16_pointers(fn) -> dict[str, str]:
        return {name: "*bf16" for name in fn.arg_names if name.endswith("_ptr")}

    heads = layer_triton._m3_attention_heads_kernel
    names = ("HQ", "HKV", "HI", "HKI", "D", "DI", "R", "RI", "HBQ", "HBK", "HBI", "HBIK")
    for counts, indexed in (((64, 4, 4, 1, 128, 128, 64, 64, 16, 4, 4, 1), True),
                            ((64, 4, 0, 0, 128, 128, 64, 64, 16, 4, 1, 1), False)):
        _compile(heads, {**bf16_pointers(heads), "kv_slot_ptr": "*i64", "index_slot_ptr": "*i64"},
                 {"eps": "fp32"}, {**dict(zip(names, counts, strict=True)), "WRITE_INDEX": indexed})
    norm = layer_triton._offset_rms_norm_kernel
    for residual in (True, False):
        _compile(norm, bf16_pointers(norm), {"eps": "fp32"},
                 {"ROWS": 1, "BLOCK": 8192, "HAS_RESIDUAL": residual})
    swiglu = moe_triton._clamped_swiglu_kernel
    for round_steps in (True, False):
        _compile(swiglu, bf16_pointers(swiglu), {"alpha": "fp32", "limit": "fp32"},
                 {"BLOCK": 1024, "ROUND_STEPS": round_steps})


def test_m3_layer_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == SKIP:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    try:
        compile_all()
    except RuntimeError as error:
        if "ptxas" not in str(error).lower():
            raise
        print(f"cannot assemble for sm_90 here: {error}")
        sys.exit(SKIP)
