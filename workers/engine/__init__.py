"""The continuous-batching engine: request state, paged KV cache manager, scheduler, model runner,
sampler. `LLMEngine.step()` is schedule, run, update."""
