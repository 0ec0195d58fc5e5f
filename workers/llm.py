"""The offline API: `LLM(model_dir).generate(prompts, params)`."""
import itertools
import warnings
from dataclasses import dataclass

from schemas import generation
from schemas.sampling import SamplingParams
from text.detokenizer import Detokenizer
from workers.engine.engine import EngineConfig, LLMEngine, check_priority, check_weight
from workers.engine.request import Request, TokenLogprobs
from workers.models import catalogue
from workers.models.gguf import hf_dir


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str                  # "stop" | "length"
    stop_reason: int | str | None       # the stop token id or stop string, when one ended it
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int              # prompt tokens served from the prefix cache


class LLM:
    def __init__(self, model: str | None = None, tokenizer=None, generation_config: str = "auto", **options):
        """`model`: an HF checkpoint directory, a GGUF file or a model name: smollm2-135m-instruct (the
        default, pulled on first use; the tiny model, with a warning, when it cannot be), or tiny and
        small (random weights, built on first use). `generation_config`: where the model's sampling defaults
        come from, auto, none or a file (schemas/generation.py), for generate() without params and for
        sampling_params(). Options are EngineConfig's fields (block_size, num_kv_blocks,
        max_num_batched_tokens, tensor_parallel_size, ...)."""
        model = catalogue.resolve(model, lambda why: warnings.warn(why, stacklevel=4))
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(hf_dir(model))
        self.model_dir, self.tokenizer = model, tokenizer
        self.engine = LLMEngine(model, EngineConfig(**options))
        self.sampling_defaults = generation.load(hf_dir(model), generation_config)
        self.ids = itertools.count()

    def sampling_params(self, **fields) -> SamplingParams:
        """SamplingParams of `fields`, the model's sampling defaults for those of generation.FIELDS not among them
        (none when temperature 0 is): what the gateway runs a request that sets `fields` with."""
        params = SamplingParams(**fields)
        generation.fill(params, fields, self.sampling_defaults)
        return params

    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: list[str | list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None, priority: list[int] | None = None, tenant: list[str] | None = None,
                 weights: dict[str, float] | None = None) -> list[RequestOutput]:
        """`params`: one for all prompts or one each; without them, the model's sampling defaults (vLLM's LLM
        does the same; a SamplingParams given is run as it is). `priority`: one per prompt, lower first, with the
        option scheduling_policy="priority" (vLLM's) or "fair". `tenant`: one per prompt, and `weights` by tenant
        (1 when left out): with the option scheduling_policy="fair" each tenant's share of the engine follows its
        weight."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        params = params or self.sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else priority
        if len(priority) != len(prompts):
            raise ValueError(f"priority: {len(priority)} priorities for {len(prompts)} prompts")
        tenant = [""] * len(prompts) if tenant is None else tenant
        if len(tenant) != len(prompts):
            raise ValueError(f"tenant: {len(tenant)} tenants for {len(prompts)} prompts")
        weights = weights or {}
        encoded = [self.encode(p) for p in prompts]
        for i, (ids, p) in enumerate(zip(encoded, params)):
            try:
                self.engine.check_request(ids, p)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        for i, rank in enumerate(priority):
            try:
                check_priority(rank)
            except ValueError as e:
                raise ValueError(f"priority[{i}]: {e}") from None
        for name, weight in weights.items():
            try:
                check_weight(weight)
            except ValueError as e:
                raise ValueError(f"weights[{name!r}]: {e}") from None
        requests = [self.engine.add_request(f"offline-{next(self.ids)}", ids, p, cache_salt, priority=rank, tenant=t,
                                            weight=weights.get(t, 1.0))
                    for ids, p, rank, t in zip(encoded, params, priority, tenant)]
        return self.run(requests)

    def chat(self, conversations: list[list[dict]] | list[dict], params=None, cache_salt=None) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation (a list of {role, content})."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for c in conversations]
        return self.generate(prompts, params, cache_salt)

    def run(self, requests: list[Request]) -> list[RequestOutput]:
        backend = self.tokenizer.backend_tokenizer
        detoks = {r.request_id: Detokenizer(backend, r.prompt_token_ids, r.params.stop) for r in requests}
        try:
            pushed = {r.request_id: r.num_output_tokens for r in requests}
            while self.engine.has_unfinished():
                for req in self.engine.step():          # one new token per step, or more with drafts
                    detok = detoks[req.request_id]
                    for n in range(pushed[req.request_id], req.num_output_tokens):
                        stop = detok.push(req.output_token_ids[n:n + 1])
                        if stop is not None:
                            self.engine.finish(req, stop, n + 1)
                            break
                    pushed[req.request_id] = req.num_output_tokens
        except BaseException:  # e.g. Ctrl-C: leave nothing behind in the engine
            for req in requests:
                self.engine.abort(req.request_id)
            raise
        return [self.output(r, detoks[r.request_id]) for r in requests]

    def output(self, req: Request, detok: Detokenizer) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_token_ids, req.output_token_ids, detok.text,
                             req.finish_reason, req.stop_reason, req.logprobs if req.params.logprobs is not None
                             else None, max(req.num_cached_tokens, 0))

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Stops tensor-parallel followers now rather than when the LLM is collected."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
