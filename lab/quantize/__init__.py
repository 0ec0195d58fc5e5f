"""Quantized checkpoints made offline by the ecosystem's own tools: `tokenbus quantize` runs llm-compressor
(AWQ or GPTQ, W4A16) in a venv of its own and writes the compressed-tensors checkpoint the engine serves."""
