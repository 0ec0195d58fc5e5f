"""The GPU worker: the engine and its offline API.

    from workers import LLM, SamplingParams
"""
from workers.engine.sampling_params import SamplingParams
from workers.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
