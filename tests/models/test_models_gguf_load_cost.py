"""Loading SmolLM2 does no work that startup does not need (benchmarks/reliability/startup.py):
no torch._dynamo import (5.8 s on a loaded 2-core machine, from nn.Embedding's init on the meta
device), and the patches that avoid it and the memmap parse are undone afterwards."""

import json
import subprocess
import sys

CHECK = """
import json, sys, numpy, torch
from gguf import gguf_reader
from msaserve.models.loader import load_model
reset = torch.nn.Embedding.reset_parameters
loaded = load_model("smollm2", progress=False)
emb = torch.nn.Embedding(4, 3)
print(json.dumps({
    "dynamo_imported": "torch._dynamo" in sys.modules,
    "reset_restored": torch.nn.Embedding.reset_parameters is reset,
    "numpy_restored": gguf_reader.np is numpy,
    "fresh_embedding_initialised": bool(emb.weight.std() > 0.1),
    "embedding_loaded": float(loaded.model.embed_tokens.weight.abs().sum()) > 0,
}))
"""


def test_loading_smollm2_skips_dynamo_and_restores_its_patches() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"dynamo_imported": False, "reset_restored": True, "numpy_restored": True,
                      "fresh_embedding_initialised": True, "embedding_loaded": True}  # fmt: skip
