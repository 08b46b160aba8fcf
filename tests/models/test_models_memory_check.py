"""A model whose weights cannot fit is refused before any memory is taken, with the sizes in the error."""

import pytest
import torch

from msaserve.models import loader, memory_check
from msaserve.models.memory_check import ModelTooLarge, available_bytes, weight_bytes
from msaserve.models.presets import M3_MINI_SMALL


def test_m3_mini_at_real_widths_is_refused_on_a_24_gib_host(monkeypatch) -> None:
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 24 * 2**30)
    with pytest.raises(ModelTooLarge) as error:
        loader.load_model("m3-mini", device="cpu", dtype=torch.float32, progress=False)
    text = str(error.value)
    assert "'m3-mini'" in text and "float32 on cpu" in text and "24.0 GiB is available" in text
    needed = float(text.split(" needs ")[1].split(" GiB")[0])
    assert 90 < needed < 110  # ≈ 50 GB of bf16 weights, twice that in fp32


def test_the_estimate_is_what_loading_takes(monkeypatch) -> None:
    """weight_bytes on the meta model = the bytes of the loaded model's tensors; a model that fits loads."""
    seen = []
    monkeypatch.setattr(loader, "check_fits", lambda model, name, dtype, device: seen.append(
        weight_bytes(model, dtype)))
    loaded = loader.load_model("m3-mini", device="cpu", dtype=torch.bfloat16, progress=False,
                               **M3_MINI_SMALL, num_hidden_layers=2)
    model = loaded.model
    actual = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert seen == [actual]
    memory_check.check_fits(model, "m3-mini", torch.bfloat16, "cpu")  # fits: no error
    assert available_bytes("cpu") is None or available_bytes("cpu") > 0
