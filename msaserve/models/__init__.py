"""MSA transformer and vision tower, MSAConfig, presets, loaders (safetensors, GGUF) and tokenizer."""
