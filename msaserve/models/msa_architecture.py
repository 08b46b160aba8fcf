"""msaserve's own MSA transformer in the model registry: its safetensors checkpoints
(`model_type` "msa") and Llama-shaped ones with an `msa` section ("llama")."""

from msaserve.models.config import MSAConfig
from msaserve.models.registry import Architecture
from msaserve.models.safetensors_loader import load_safetensors
from msaserve.models.transformer import MSATransformer

ARCHITECTURE = Architecture(
    name="msa",
    model_types=("msa", "llama"),
    parse_config=MSAConfig.from_hf_dict,
    model_class=MSATransformer,
    load=load_safetensors,
)
