"""Block-fp8 checkpoints (transformers' "fp8" quantization, as DeepSeek-V3 and MiniMax publish
them): a weight [..., rows, cols] stored as float8_e4m3fn with `weight_scale_inv`
[..., ⌈rows/br⌉, ⌈cols/bc⌉] fp32, one scale per br × bc block; weight = fp8 value × its block's
scale. Dequantized at load time to the model dtype."""

from typing import Any

import torch


def fp8_block_size(raw_config: dict[str, Any]) -> tuple[int, int] | None:
    """(br, bc) of a config.json's quantization_config, None when the checkpoint is not quantized."""
    quant = raw_config.get("quantization_config")
    if quant is None and isinstance(raw_config.get("text_config"), dict):
        quant = raw_config["text_config"].get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported: allowed 'fp8' "
                         "(block-wise, with weight_block_size) or no quantization_config")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r} is invalid: allowed [rows, cols] "
                         "of two positive integers")
    return block[0], block[1]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., R, C] fp8; scale_inv [..., ⌈R/br⌉, ⌈C/bc⌉] → fp32 weight × its block's scale."""
    rows, cols = weight.shape[-2:]
    (br, bc), lead = block, weight.shape[:-2]
    if rows % br == 0 and cols % bc == 0:  # whole blocks (every M3 weight): broadcast, no copies
        blocks = weight.float().view(*lead, rows // br, br, cols // bc, bc)
        return (blocks * scale_inv.float()[..., :, None, :, None]).view(weight.shape)
    scale = scale_inv.float().repeat_interleave(br, dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(bc, dim=-1)[..., :cols]
    return weight.float() * scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for writing test checkpoints: weight [R, C] → (fp8 e4m3 [R, C], scale_inv
    [⌈R/br⌉, ⌈C/bc⌉] fp32) with each block's largest magnitude mapped to the fp8 maximum."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, br, nc, bc)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fp8_max  # [nr, nc]
    quantized = (blocks / scale[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols]
    return quantized.to(torch.float8_e4m3fn), scale
