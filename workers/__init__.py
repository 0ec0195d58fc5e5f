"""The GPU worker: the engine and its offline API.

    from workers import LLM, SamplingParams
"""
from schemas.sampling import SamplingParams
from workers.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
