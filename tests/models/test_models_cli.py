"""`msaserve generate` end to end on the tiny preset, and its argument errors."""

import pytest
from reference_decode import generate

from msaserve.models.loader import load_model
from msaserve.platform.cli import main


@pytest.mark.parametrize("attention", ["dense", "msa"])
def test_generate_tiny_streams_the_decoded_tokens(capsys, attention: str) -> None:
    assert main(["generate", "--prompt", "hello", "--model", "tiny", "--max-tokens", "6",
                 "--attention", attention, "--no-chat"]) == 0
    out, err = capsys.readouterr()
    loaded = load_model("tiny", progress=False)
    tokens = generate(loaded.model, loaded.tokenizer.encode("hello"), 6,
                      eos_token_ids=loaded.tokenizer.eos_token_ids)
    assert out == loaded.tokenizer.decode(tokens) + "\n"
    assert f"attention {attention}" in err and "random weights" in err


def test_generate_rejects_bad_temperature(capsys) -> None:
    assert main(["generate", "--prompt", "x", "--model", "tiny", "--temperature", "3"]) == 2
    assert "--temperature=3.0 is invalid: allowed 0.0 to 2.0" in capsys.readouterr().err


def test_unknown_model_spec() -> None:
    with pytest.raises(FileNotFoundError, match="preset"):
        load_model("no-such-model", progress=False)
