"""The pipeline services: gateway, tokenizer, router."""
