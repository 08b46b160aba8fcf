"""Random weights for an M3 model built from a preset (`m3-mini`): what a checkpoint would load,
drawn instead from a seed, on the model's device and in its dtype.

M3's RMSNorms scale by (1 + weight), so a zero weight is the identity (the trained model's
starting point); the router's correction bias is zero (no expert favoured). Every other tensor
is N(0, std). Large tensors (the experts, [E, 2I, H]) are drawn one leading slice at a time, so
the fp32 draw never needs more than one expert's worth of scratch memory.
"""

import torch
from torch import nn

ZERO_SUFFIXES = ("norm.weight", "e_score_correction_bias")


def init_m3_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Fill every parameter of `model` in place (same seed and device: same weights)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(ZERO_SUFFIXES):
                param.zero_()
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            generator = generators[param.device]
            slices = param if param.dim() == 3 else param[None]  # [E, a, b] drawn per expert
            for piece in slices:
                values = torch.randn(piece.shape, generator=generator, dtype=torch.float32,
                                     device=param.device)
                piece.copy_(values * std)
    return model
