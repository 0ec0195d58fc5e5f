"""Decoder-only models of the Llama family, built from HF config.json and loaded from safetensors."""
