"""Loading a MiniMax-M3-layout checkpoint: msaserve's loader against reading the same safetensors.

Writes a synthetic checkpoint in MiniMax's release layout (`language_model.model.layers.{i}.
block_sparse_moe.experts.{j}.w1/w2/w3.weight` per expert, gate/up separate) at a reduced M3 shape,
in bf16 and in block-fp8 (128×128 `weight_scale_inv`), then times, with a warm page cache:
- read: every tensor read with safetensors and copied once (the floor: the bytes into memory);
- load bf16: `load_model` (plan, build, read shard by shard, stack experts, fuse gate/up);
- load fp8: the same from the fp8 checkpoint, dequantized to bf16 on load.

    python benchmarks/models/bench_m3_load.py [--layers 2] [--experts 32] [--rounds 2] [--threads 1]

Prints a table last; writes benchmarks/results/m3_load.json (command, hardware, date, revision).
"""

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from msaserve.models.fp8_blocks import quantize_blocks  # noqa: E402
from msaserve.models.loader import load_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "m3_load.json"
SHAPE = dict(hidden=2048, heads=16, kv_heads=4, head_dim=128, inter=1024, dense_inter=4096, vocab=32000,
             index_heads=4, index_dim=128)
SHARD_BYTES = 256 << 20


def text_config(layers: int, experts: int) -> dict:
    s = SHAPE
    return dict(
        model_type="minimax_m3_vl_text", vocab_size=s["vocab"], hidden_size=s["hidden"],
        intermediate_size=s["inter"], num_hidden_layers=layers, num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], dense_intermediate_size=s["dense_inter"], shared_intermediate_size=s["inter"],
        num_local_experts=experts, num_experts_per_tok=4, index_n_heads=s["index_heads"],
        index_head_dim=s["index_dim"], index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
        layer_types=["full_attention" if i % 2 == 0 else "minimax_m3_sparse" for i in range(layers)],
        mlp_layer_types=["dense" if i == 0 else "sparse" for i in range(layers)],
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    )


def tensors(layers: int, experts: int) -> dict[str, torch.Tensor]:
    s, g = SHAPE, torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    h, p = s["hidden"], "language_model.model."
    out = {p + "embed_tokens.weight": w(s["vocab"], h), p + "norm.weight": w(h),
           "language_model.lm_head.weight": w(s["vocab"], h)}
    for i in range(layers):
        a = f"{p}layers.{i}.self_attn."
        out |= {a + "q_proj.weight": w(s["heads"] * s["head_dim"], h), a + "k_proj.weight": w(512, h),
                a + "v_proj.weight": w(512, h), a + "o_proj.weight": w(h, s["heads"] * s["head_dim"]),
                a + "q_norm.weight": w(s["head_dim"]), a + "k_norm.weight": w(s["head_dim"]),
                f"{p}layers.{i}.input_layernorm.weight": w(h),
                f"{p}layers.{i}.post_attention_layernorm.weight": w(h)}
        if i % 2:
            out |= {a + "index_q_proj.weight": w(s["index_heads"] * s["index_dim"], h),
                    a + "index_k_proj.weight": w(s["index_dim"], h),
                    a + "index_q_norm.weight": w(s["index_dim"]),
                    a + "index_k_norm.weight": w(s["index_dim"])}
        m = f"{p}layers.{i}."
        if i == 0:
            out |= {m + "mlp.gate_proj.weight": w(s["dense_inter"], h),
                    m + "mlp.up_proj.weight": w(s["dense_inter"], h),
                    m + "mlp.down_proj.weight": w(h, s["dense_inter"])}
            continue
        moe = m + "block_sparse_moe."
        out |= {moe + "gate.weight": w(experts, h), moe + "e_score_correction_bias": w(experts)}
        shared = (("gate_proj", (s["inter"], h)), ("up_proj", (s["inter"], h)),
                  ("down_proj", (h, s["inter"])))
        for name, shape in shared:
            out[f"{moe}shared_experts.{name}.weight"] = w(*shape)
        for j in range(experts):
            e = f"{moe}experts.{j}."
            out |= {e + "w1.weight": w(s["inter"], h), e + "w3.weight": w(s["inter"], h),
                    e + "w2.weight": w(h, s["inter"])}
    return out


def fp8(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in named.items():
        if t.dim() == 2 and name.endswith(("proj.weight", "w1.weight", "w2.weight", "w3.weight")):
            out[name], out[name + "_scale_inv"] = quantize_blocks(t, (128, 128))
        else:
            out[name] = t
    return out


def write(directory: Path, named: dict[str, torch.Tensor], config: dict) -> int:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    shards, size = [{}], 0
    for name, t in named.items():
        if shards[-1] and size + t.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += t.nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(t.nbytes for t in named.values())


def read_all(directory: Path) -> None:
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                f.get_tensor(name).clone()  # get_tensor maps the file lazily: copy, as a load does


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    return f"{cpu}, {torch.get_num_threads()} torch threads, Python {platform.python_version()}, CPU tensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: per-core figures)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = text_config(args.layers, args.experts)
    named = tensors(args.layers, args.experts)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bf16_bytes = write(Path(tmp) / "bf16", named, config)
        quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [128, 128]}
        fp8_bytes = write(Path(tmp) / "fp8", fp8(named), {**config, "quantization_config": quantization})
        del named
        for label, directory, nbytes in (("bf16", "bf16", bf16_bytes), ("fp8", "fp8", fp8_bytes)):
            path = Path(tmp) / directory
            read_all(path)  # warm the page cache
            read_s = best(lambda p=path: read_all(p), args.rounds)
            load_s = best(lambda p=path: load_model(str(p), dtype=torch.bfloat16, progress=False),
                          args.rounds)
            rows.append(dict(checkpoint=label, gib=nbytes / 2**30, read_s=read_s, load_s=load_s))
    common = {"command": "python " + " ".join(sys.argv), "hardware": hardware(),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "git_revision": git_revision()}
    out = {}
    for row in rows:
        out[f"m3_load.{row['checkpoint']}_load_gib_per_s"] = {
            "value": round(row["gib"] / row["load_s"], 3), "unit": "GiB/s", **common}
        out[f"m3_load.{row['checkpoint']}_load_over_read"] = {
            "value": round(row["load_s"] / row["read_s"], 3), "unit": "x", **common}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'checkpoint':<10} {'GiB':>6} {'read s':>8} {'load s':>8} {'load GiB/s':>11} {'load/read':>10}")
    for r in rows:
        print(f"{r['checkpoint']:<10} {r['gib']:>6.2f} {r['read_s']:>8.2f} {r['load_s']:>8.2f} "
              f"{r['gib'] / r['load_s']:>11.2f} {r['load_s'] / r['read_s']:>10.2f}")


if __name__ == "__main__":
    main()
