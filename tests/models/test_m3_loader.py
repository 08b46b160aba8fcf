"""Loading M3 checkpoints: the model registry, wrong or partial checkpoints refused before any
weight is read, block-fp8 weights dequantized on load, bf16, the tokenizer and its chat template."""

import json
import re
import shutil

import pytest
import torch
from m3_checkpoint import EOS, one_cpu_thread, quantize_checkpoint, write_m3_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from msaserve.models import checkpoint_loader
from msaserve.models.cache import allocate_caches
from msaserve.models.checkpoint_plan import CheckpointMismatch
from msaserve.models.loader import load_model
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.registry import UnsupportedModelType, supported_model_types

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures(one_cpu_thread.__name__)

LOGIT_RTOL = 1e-4
FP8_MEDIAN_RTOL = 0.25
"""fp8 (e4m3, 16×16 blocks) against the unquantized weights, per position: max |Δlogit| / max
|logit|. Measured on this tiny random checkpoint at 120 tokens: median 0.13, worst 0.83 — its
random weights amplify e4m3's rounding (expert routing and block selections flip), so the
bound is loose; exactness is checked against transformers on the same dequantized weights."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_m3_checkpoint(tmp_path_factory.mktemp("m3") / "vl", vl=True)


def copy_of(checkpoint, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(checkpoint[0], directory)
    return directory


def edit_tensors(directory, edit) -> None:
    """Rewrite every shard with edit(name → tensor dict) applied; keep the index in step."""
    weight_map = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        edit(tensors, shard.name)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    c, n = model.config, len(ids)
    positions = torch.arange(n)
    pages = -(-n // c.page_size)
    meta = AttentionMetadata(
        positions=positions, slot_mapping=positions.clone(),
        block_tables=torch.arange(pages, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), max_query_len=n,
    )
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return model.compute_logits(model(ids, meta, allocate_caches(c, pages, "cpu", dtype)))


def refuse_weight_reads(monkeypatch) -> None:
    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the checkpoint was checked")
    monkeypatch.setattr(checkpoint_loader, "safe_open", no_reads)


def test_unsupported_model_type_lists_the_supported(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelType) as error:
        load_model(str(tmp_path), progress=False)
    message = str(error.value)
    assert "'gpt2'" in message
    for model_type in ("msa", "minimax_m3_vl", "minimax_m3_vl_text"):
        assert model_type in supported_model_types() and model_type in message


def test_missing_expert_tensor_is_named_before_any_weight_is_read(checkpoint, tmp_path, monkeypatch) -> None:
    directory = copy_of(checkpoint, tmp_path)
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight"
    edit_tensors(directory, lambda tensors, _: tensors.pop(name, None))
    refuse_weight_reads(monkeypatch)
    with pytest.raises(CheckpointMismatch) as error:
        load_model(str(directory), progress=False)
    expected = "missing tensor for layers.1.mlp.experts.gate_up_proj (expert 3, gate half) [32, 64]"
    assert expected in str(error.value)


def test_unexpected_and_misshapen_tensors_are_named(checkpoint, tmp_path, monkeypatch) -> None:
    directory = copy_of(checkpoint, tmp_path)
    bogus = "language_model.model.layers.0.self_attn.bogus.weight"
    wrong = "language_model.model.layers.2.self_attn.index_k_proj.weight"

    def edit(tensors, shard):
        if shard.startswith("model-00001"):
            tensors[bogus] = torch.zeros(3, 4)
        if wrong in tensors:
            tensors[wrong] = torch.zeros(8, 64)
    edit_tensors(directory, edit)
    refuse_weight_reads(monkeypatch)
    with pytest.raises(CheckpointMismatch) as error:
        load_model(str(directory), progress=False)
    message = str(error.value)
    assert f"unexpected tensor {bogus} [3, 4]" in message
    assert f"tensor {wrong} has shape [8, 64]: expected [16, 64]" in message


def test_fp8_checkpoint_dequantizes_on_load(checkpoint, tmp_path) -> None:
    directory, oracle = checkpoint
    quantized_dir = tmp_path / "fp8"
    dequantized = quantize_checkpoint(directory, quantized_dir, block=(16, 16))
    model = load_model(str(quantized_dir), progress=False).model
    # Exactly the block-dequantized values, stacked into the expert tensor's gate half.
    w1 = dequantized["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    assert torch.equal(model.layers[1].mlp.experts.gate_up_proj[3, :32], w1)
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(7))
    logits = logits_of(model, ids)
    # transformers on the same dequantized weights (an fp32 checkpoint holding them): 1e-4.
    same_weights = copy_of(checkpoint, tmp_path)
    edit_tensors(same_weights, lambda tensors, _: tensors.update(
        {name: dequantized[name] for name in tensors if name in dequantized}))
    twin = type(oracle).from_pretrained(same_weights, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected, unquantized = twin(input_ids=ids[None]).logits[0], oracle(input_ids=ids[None]).logits[0]
    error = float((logits - expected).abs().max() / expected.abs().max())
    assert error <= LOGIT_RTOL, f"relative logit error {error:.2e} against transformers on the fp8 weights"
    per_position = (logits - unquantized).abs().amax(-1) / unquantized.abs().amax(-1)
    assert 0 < float(per_position.median()) <= FP8_MEDIAN_RTOL


def test_fp8_weight_without_scale_is_refused(checkpoint, tmp_path) -> None:
    quantized_dir = tmp_path / "fp8"
    quantize_checkpoint(checkpoint[0], quantized_dir, block=(16, 16))
    scale = "language_model.model.layers.0.self_attn.q_proj.weight_scale_inv"
    edit_tensors(quantized_dir, lambda tensors, _: tensors.pop(scale, None))
    with pytest.raises(CheckpointMismatch, match="fp8 tensor language_model.model.layers.0.self_attn.q_proj"
                       r".weight \[128, 64\] has no its scale"):
        load_model(str(quantized_dir), progress=False)


def test_bf16_load(checkpoint) -> None:
    directory, oracle = checkpoint
    model = load_model(str(directory), dtype=torch.bfloat16, progress=False).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = oracle(input_ids=ids[None]).logits[0]
    error = float((logits_of(model, ids) - expected).abs().max() / expected.abs().max())
    assert error < 5e-2, f"bf16 relative logit error {error:.2e}"


def test_tokenizer_and_chat_template_match_transformers(checkpoint) -> None:
    directory, _ = checkpoint
    tokenizer = load_model(str(directory), progress=False).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools)
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == expected
    assert '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>' in text
    assert tokenizer.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert EOS in tokenizer.eos_token_ids


def test_single_file_checkpoint_loads_and_a_missing_shard_is_named(tmp_path) -> None:
    directory, oracle = write_m3_checkpoint(tmp_path / "single", vl=False, max_shard_size="50MB")
    assert (directory / "model.safetensors").is_file()
    assert not (directory / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = oracle(input_ids=ids[None]).logits[0]
    logits = logits_of(load_model(str(directory), progress=False).model, ids)
    assert float((logits - expected).abs().max() / expected.abs().max()) <= LOGIT_RTOL
    sharded = tmp_path / "sharded"
    write_m3_checkpoint(sharded, vl=False)
    (sharded / "model-00002-of-00019.safetensors").unlink()
    with pytest.raises(CheckpointMismatch, match=re.escape(
            "shard model-00002-of-00019.safetensors listed in model.safetensors.index.json is missing")):
        load_model(str(sharded), progress=False)
