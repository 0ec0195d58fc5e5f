"""The engine: add requests, step (schedule, run, update), abort. Tokens in, tokens out; text
and stop strings are the caller's (the offline LLM or the gateway)."""
import concurrent.futures
import json
import os
import random
import time
import weakref
from dataclasses import asdict, dataclass

import torch

from kernels import bf16_linear
from schemas.messages import MAX_PRIORITY, MAX_WEIGHT, MIN_PRIORITY, MIN_WEIGHT, SCHEDULING_POLICIES
from schemas.sampling import SamplingParams, check, check_vocabulary, to_grammar
from workers.distributed import SINGLE, Followers, TPGroup, WorkerFailure, leave
from workers.engine.grammar import Grammars, Pending
from workers.engine.kv_cache import KVCacheManager
from workers.engine.kv_tiers import KVTiers, identity
from workers.engine.request import Request, Status
from workers.engine.roofline import GPUS
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Batch, Scheduler, SchedulerConfig
from workers.engine.speculative import SpeculativeConfig, Speculator
from workers.layers.quant import QUANTIZATIONS
from workers.models.config import ModelConfig
from workers.models.llama import CausalLM

CPU_KV_CACHE_MEMORY = 1 << 30
ENGINES = ("model", "mock")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None       # the KV pool size; else sized from kv_cache_memory
    kv_cache_memory: int | None = None     # bytes for the pool; default 1 GiB on CPU, the free GPU memory on CUDA
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048     # the token budget of one step
    max_num_seqs: int = 128
    max_model_len: int | None = None       # default and upper bound: the model's context
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str | None = None               # default: bfloat16 on a CPU with AMX or AVX-512 BF16, else float32;
                                           # the checkpoint's 16-bit type on CUDA
    device: str | None = None              # default: cuda when available, else cpu
    seed: int = 0                          # draws the seeds of requests that bring none
    tensor_parallel_size: int = 1          # ranks one replica spans (one GPU each on CUDA)
    speculative: dict | str | None = None  # SpeculativeConfig's fields, or "ngram:4" / "draft:DIR:4"; None: off
    scheduling_policy: str = "fcfs"        # or "priority": requests' priority orders admission and preemption;
    #                                        "fair": priority, then each tenant's share by weight
    kv_host_memory: int | None = None      # bytes of the prefix cache's host-memory tier below the pool; None: none
    kv_disk_dir: str | None = None         # the disk tier's directory (below the host tier); None: none
    kv_disk_size: int | None = None        # bytes of block files the disk tier keeps at most
    kv_cache_dtype: str = "auto"           # the KV pool's: "auto" (the model's dtype), "int8" or "fp8" (e4m3),
    #                                        quantized with a scale per token and KV head (docs/engine.md)
    quantization: str | None = None        # the linear weights': None or "none" (the checkpoint's), "int8"
    #                                        (weight-only, per output channel, made at load; docs/models.md),
    #                                        "w4a16" (read from a checkpoint: only checks it is one), "gguf" (keep
    #                                        a GGUF file's Q8_0/Q4_0 linear weights quantized; other types are
    #                                        dequantized as today)
    engine: str = "model"                  # or "mock": no model, each step held for the roofline's time on
    #                                        mock_tp × mock_gpu, tokens a hash of (seed, position) (engine/mock.py)
    mock_gpu: str = "h100-sxm"             # the mock's GPU preset (workers.engine.roofline.GPUS)
    mock_tp: int = 1                       # the mock's simulated tensor-parallel size (no ranks are started)

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            check(getattr(self, name) >= 1, name, "must be at least 1", getattr(self, name))
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, "must be at least 1 (or None for the default)", value)
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]",
              self.gpu_memory_utilization)
        SpeculativeConfig.of(self.speculative)     # raises ValueError naming what is wrong
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}",
              self.kv_cache_dtype)
        check(self.quantization in (None, *QUANTIZATIONS), "quantization", f"must be one of {', '.join(QUANTIZATIONS)}",
              self.quantization)
        check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
              f"must be one of {', '.join(SCHEDULING_POLICIES)}", self.scheduling_policy)
        self.check_tiers()
        self.check_mock()

    def check_mock(self) -> None:
        """The mock engine's options, and what it refuses (each named)."""
        check(self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)}", self.engine)
        check(self.mock_gpu in GPUS, "mock_gpu", f"must be one of {', '.join(GPUS)}", self.mock_gpu)
        check(self.mock_tp >= 1, "mock_tp", "must be at least 1", self.mock_tp)
        if self.engine != "mock":
            return
        check(self.tensor_parallel_size == 1, "tensor_parallel_size",
              "must be 1 with engine='mock': its tensor-parallel size is mock_tp (no ranks are started)",
              self.tensor_parallel_size)
        check(self.kv_host_memory is None and self.kv_disk_dir is None, "kv_host_memory",
              "the prefix cache's tiers (kv_host_memory, kv_disk_dir) are not supported by engine='mock'",
              self.kv_host_memory)
        check(self.quantization in (None, "none"), "quantization", "is not supported by engine='mock'",
              self.quantization)
        spec = SpeculativeConfig.of(self.speculative)
        check(spec is None or spec.method != "draft", "speculative",
              "a draft model is not supported by engine='mock' (ngram is)", self.speculative)

    def check_tiers(self) -> None:
        for name in ("kv_host_memory", "kv_disk_size"):
            value = getattr(self, name)
            check(value is None or value >= 0, name, "must be at least 0 (or None for no such tier)", value)
        check((self.kv_disk_dir is None) == (self.kv_disk_size is None), "kv_disk_size",
              "is given with kv_disk_dir, and kv_disk_dir with it", self.kv_disk_size)
        if self.kv_host_memory is not None or self.kv_disk_dir is not None:
            check(self.enable_prefix_caching, "enable_prefix_caching",
                  "must be on for the prefix cache's tiers (kv_host_memory, kv_disk_dir)", self.enable_prefix_caching)
            check(self.tensor_parallel_size == 1, "tensor_parallel_size",
                  "must be 1 with the prefix cache's tiers (kv_host_memory, kv_disk_dir): not supported yet",
                  self.tensor_parallel_size)


@dataclass(slots=True)
class StepTrace:
    num_requests: int
    num_tokens: int
    seconds: float          # the whole step
    forward_seconds: float  # model forward + logits
    kv_waste_slots: int     # allocated but unused KV slots over the scheduled requests
    num_sampled: int = 0    # the step's shape for a cost model (workers.engine.roofline.StepShape): rows that sample
    attention: float = 0.0  # Σ new tokens × the keys each attends to
    kv_read: int = 0        # Σ context after the step


class LLMEngine:
    def __init__(self, model_dir: str, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_cfg, self.model_dir = ModelConfig.load(model_dir), model_dir
        self.followers, tp = None, SINGLE
        if config.tensor_parallel_size > 1:
            device_type = pick_device(config.device, SINGLE).type
            check_tensor_parallel(self.model_cfg, config.tensor_parallel_size, device_type)
            self.followers, tp = Followers.start(config.tensor_parallel_size, device_type, model_dir,
                                                 json.dumps(asdict(config)))
        self.closer = weakref.finalize(self, shut_down, self.followers, tp)
        try:
            self.runner = build_runner(model_dir, self.model_cfg, config, tp)
        except BaseException as e:
            if self.followers is not None:
                if isinstance(e, RuntimeError):
                    self.followers.explain(e)
                self.followers.error = self.followers.error or f"rank 0 failed to start: {e!r}"  # no clean stop
            self.closer()
            raise
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.max_model_len = min(config.max_model_len or self.model_cfg.max_model_len, self.model_cfg.max_model_len)
        num_blocks = self.runner.num_blocks
        self.tiers = build_tiers(model_dir, config, self.runner)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.tiers)
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len, config.enable_chunked_prefill,
            frozenset(self.model_cfg.eos_token_ids), config.scheduling_policy), self.kv)
        self.requests: dict[str, Request] = {}
        self.grammars: Grammars | None = None      # built on the first constrained request
        self.compiling: dict[str, Pending] = {}    # constrained requests waiting for their grammar
        self.seeds = random.Random(config.seed)
        self.num_steps = 0
        self.num_failed_steps = 0                  # steps that raised and were run again in parts
        self.trace: list[StepTrace] | None = None  # set to a list to record every step
        self.speculator: Speculator | None = None
        spec = SpeculativeConfig.of(config.speculative)
        if spec is not None:
            from workers.engine import speculative
            self.speculator = speculative.build(spec, self, self.max_model_len)

    def close(self) -> None:
        """Writes the prefix cache down to the disk tier, if there is one, so that an engine started on the same
        directory finds it; stops the tensor-parallel followers, if any (also done when the engine is collected)."""
        try:
            if self.tiers is not None and self.tiers.disk is not None:
                self.tiers.flush(self.kv.cached_blocks())
        finally:
            self.closer()

    def check_alive(self) -> None:
        """Raises WorkerFailure when a tensor-parallel rank is gone."""
        if self.followers is not None:
            self.followers.check()

    # -- requests ------------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError, naming the field and the limit, for a request the engine cannot take."""
        n, vocab = len(prompt_token_ids), self.model_cfg.vocab_size
        if n == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        check_vocabulary(params, vocab)
        to_grammar(params)                       # a constraint xgrammar cannot convert (no compile here)
        if params.constraint is not None and self.config.engine == "mock":
            raise ValueError("structured output (json_schema, json_object, regex, choice, grammar) is not supported "
                             "by the mock engine (engine='mock', --engine mock)")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len={self.max_model_len} (the model's context) "
                             "leaves no room for output")
        longest = min(n + params.max_tokens, self.max_model_len)
        if not self.config.enable_chunked_prefill and longest > self.config.max_num_batched_tokens:
            raise ValueError(f"request may grow to {longest} tokens, more than max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}, which without chunked prefill must hold "
                             "a whole (resumed) prompt")
        need = self.kv.num_blocks_for(longest)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs {need} KV blocks for prompt + max_tokens, more than the whole pool "
                             f"(num_kv_blocks={self.kv.num_blocks}); lower max_tokens or grow the pool")

    def check_resume(self, prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for output tokens a moved request cannot continue from."""
        vocab, n = self.model_cfg.vocab_size, len(output_token_ids)
        bad = next((t for t in output_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"output_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if n >= params.max_tokens or len(prompt_token_ids) + n >= self.max_model_len:
            raise ValueError(f"output_token_ids: {n} tokens leave no room for more (max_tokens={params.max_tokens}, "
                             f"max_model_len={self.max_model_len})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, output_token_ids: list[int] = (), isolate: bool = False,
                    seed: int | None = None, priority: int = 0, tenant: str = "", weight: float = 1.0,
                    block_hashes: list[int] = (), group: str = "") -> Request:
        """Queues a request. With output_token_ids (a request moved from another worker) it continues
        after them: prompt + those tokens are computed as one prefill, and positions, penalties,
        max_tokens and stop conditions go on as if it had never moved. `isolate`: its steps run
        alone until its first token (a request suspected of crashing a worker). `seed`: the seed
        another worker drew for it (a handed-off request), when its params bring none. `priority`:
        lower runs first under the priority and fair policies; the fcfs policy ignores it. `tenant` and
        `weight`: the fair policy shares the engine between tenants in proportion to their weights.
        `block_hashes`: those of the prompt's full blocks, if the caller has them (not hashed again).
        `group`: the choices of one prompt (n > 1) share a group; they are forked after one prefill."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        check_priority(priority)
        check_weight(weight)
        self.check_request(prompt_token_ids, params)
        if output_token_ids:
            self.check_resume(prompt_token_ids, output_token_ids, params)
        seed = as_int64(params.seed) if params.seed is not None else seed if seed is not None \
            else self.seeds.getrandbits(63)
        req = Request(request_id, [*prompt_token_ids, *output_token_ids], len(prompt_token_ids), params, seed,
                      self.config.block_size, cache_salt, isolate=isolate, num_resumed_tokens=len(output_token_ids),
                      priority=priority, tenant=tenant, weight=weight, block_hashes=list(block_hashes), group=group)
        if params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.model_cfg.eos_token_ids)
            req.min_ban = tuple(t for t in {*eos, *params.stop_token_ids} if t < self.model_cfg.vocab_size)
        self.requests[request_id] = req
        if params.constraint is None:
            self.scheduler.add(req)
            return req
        if self.grammars is None:
            self.grammars = Grammars(self.model_dir, self.model_cfg.vocab_size, self.model_cfg.eos_token_ids)
        self.compiling[request_id] = Pending(req, self.grammars.submit(params))
        return req

    def admit_compiled(self) -> list[Request]:
        """Hands the scheduler the constrained requests whose grammar is ready; returns those whose grammar
        failed (to compile, or in time), ended with finish_reason "error"."""
        failed = []
        for rid, pending in list(self.compiling.items()):
            req = pending.req
            try:
                req.matcher = pending.matcher()
            except ValueError as e:
                req.status, req.finish_reason, req.error = Status.FINISHED, "error", str(e)
                failed.append(req)
                del self.requests[rid]
            if req.matcher is not None or req.finished:
                del self.compiling[rid]
                if not req.finished:
                    self.scheduler.add(req)
        return failed

    def abort(self, request_id: str) -> Request | None:
        """Ends a request wherever it is and frees its KV; None when it is not (or no longer) here."""
        req = self.requests.pop(request_id, None)
        self.kv.unpin(request_id)
        if self.compiling.pop(request_id, None) is not None:
            req.status, req.finish_reason = Status.FINISHED, "abort"
        elif req is not None:
            self.scheduler.abort(req)
            if self.speculator is not None:
                self.speculator.forget(request_id)
        return req

    def finish(self, req: Request, stop_reason: str, num_output_tokens: int | None = None) -> None:
        """Ends req as stopped by a stop string the caller found in its text (the same step may
        have ended it already, by length or a stop token: the stop string wins). With
        num_output_tokens, the tokens after the one that completed the stop string (a step that
        verified drafts can add several) are dropped, as if the request had stopped there."""
        self.abort(req.request_id)
        req.finish_reason, req.stop_reason = "stop", stop_reason
        if num_output_tokens is not None and num_output_tokens < req.num_output_tokens:
            del req.token_ids[req.num_prompt_tokens + num_output_tokens:]
            del req.logprobs[max(num_output_tokens - req.num_resumed_tokens, 0):]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One engine step. Returns the requests that got a token or finished in it."""
        start = time.perf_counter()
        forward_before = self.runner.forward_seconds
        failed = self.admit_compiled() if self.compiling else []
        batch = self.scheduler.schedule()
        if self.tiers is not None:
            self.move_tiers(batch)
        if not batch.requests:
            if self.compiling and not failed:     # nothing to run but grammars to wait for: not a busy loop
                wait(self.compiling.values())
            return failed
        if self.speculator is not None:
            self.speculator.draft(batch, self.scheduler)
        tables = [self.kv.block_ids(r.request_id) for r in batch.requests]
        shape = batch.shape() if self.trace is not None else None
        self.check_alive()
        run_start = time.perf_counter()
        if self.config.engine == "mock":
            self.runner.step_start = start       # the mock holds the step until the roofline's time from here
        try:
            tokens, logprobs = self.run(batch, tables)
        except Exception as e:                   # one request's fault, most likely: find it, fail it alone
            self.num_failed_steps += 1
            updated = failed + self.isolate(batch, tables, e)
        else:
            updated = failed + self.scheduler.update(batch, tokens, logprobs)
            if self.speculator is not None:
                self.speculator.observe(batch, time.perf_counter() - run_start)
        for req in updated:
            if req.finished and req.request_id in self.requests:
                del self.requests[req.request_id]
                if self.speculator is not None:
                    self.speculator.forget(req.request_id)
        self.num_steps += 1
        if self.trace is not None:
            waste = sum(len(t) * self.config.block_size - r.num_computed_tokens
                        for r, t in zip(batch.requests, tables))
            self.trace.append(StepTrace(len(batch.requests), batch.num_tokens, time.perf_counter() - start,
                                        self.runner.forward_seconds - forward_before, waste, shape.sampled,
                                        shape.attention, shape.kv_read))
        return updated

    def move_tiers(self, batch: Batch) -> None:
        """Copies the blocks this schedule evicted down to the lower tiers, then its lower-tier hits up into
        their pool blocks: before the forward, the only writer of KV. A hit that cannot be filled (its file
        failed its checksum) sends the requests holding it back to the queue, to recompute it."""
        saves, restores = self.kv.take_transfers()
        self.tiers.save(saves)
        bad = self.tiers.restore(restores)
        if bad:
            self.kv.forget(bad)
            for req in [r for r in batch.requests if not set(bad).isdisjoint(self.kv.block_ids(r.request_id))]:
                self.scheduler.requeue(req, batch)

    def run(self, batch: Batch, tables: list[list[int]]):
        try:
            return self.runner.run(batch, tables)
        except RuntimeError as e:
            if self.followers is not None:       # a collective failed: name the rank that died
                self.followers.explain(e)
            raise

    def isolate(self, batch: Batch, tables: list[list[int]], error: Exception) -> list[Request]:
        """After a failed step: runs halves of it again until each failure is one request that fails
        alone; those end with finish_reason "error", the others get their step's tokens. KV slots the
        failed runs wrote are simply written again (same tokens, same positions). When every request
        of a step of several fails alone, no request is to blame (e.g. out of memory): it raises."""
        if self.followers is not None or isinstance(error, WorkerFailure):
            raise error                          # other ranks may be mid-step: nothing to attribute
        updated: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        pending = [list(range(len(batch.requests)))]
        while pending:
            rows = pending.pop()
            sub = sub_batch(batch, rows)
            try:
                if len(rows) == len(batch.requests):
                    raise error                  # the whole step failed already: split it
                tokens, logprobs = self.run(sub, [tables[i] for i in rows])
            except WorkerFailure:
                raise
            except Exception as e:
                if len(rows) == 1:
                    failed.append((sub.requests[0], e))
                else:
                    pending += [rows[len(rows) // 2:], rows[:len(rows) // 2]]
            else:
                updated += self.scheduler.update(sub, tokens, logprobs)
        if len(failed) == len(batch.requests) > 1:
            raise error
        for req, e in failed:
            self.scheduler.fail(req, f"the engine failed on this request: {e!r}"[:1000])
            updated.append(req)
        return updated

    def inject_fault(self, token_id: int, action: str = "raise") -> None:
        """TEST HOOK, off unless called: the model forward of any step whose input holds token_id
        raises (action "raise") or ends this process at once (action "exit"), as a poison request
        would deep inside a kernel. For tests of fault isolation only."""
        execute = self.runner.execute

        def faulty(inputs):
            if bool((inputs.input_ids == token_id).any()):
                if action == "exit":
                    os._exit(70)
                raise RuntimeError(f"test hook: fault injected on token {token_id}")
            return execute(inputs)

        self.runner.execute = faulty

    def stats(self) -> dict:
        return {
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "preemptions": self.scheduler.num_preemptions,
            "forks": self.scheduler.num_forks,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self.scheduler.held),
            "steps": self.num_steps,
            "failed_steps": self.num_failed_steps,
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self.tiers.stats() if self.tiers is not None else {}),
        }


def wait(pending) -> None:
    """Until one of these grammars is ready, for a short while at most."""
    concurrent.futures.wait([p.future for p in pending], timeout=0.05, return_when="FIRST_COMPLETED")


def check_priority(priority: int) -> None:
    check(isinstance(priority, int) and not isinstance(priority, bool), "priority", "must be an integer", priority)
    check(MIN_PRIORITY <= priority <= MAX_PRIORITY, "priority",
          f"must be in [MIN_PRIORITY, MAX_PRIORITY] = [{MIN_PRIORITY}, {MAX_PRIORITY}]", priority)


def check_weight(weight: float) -> None:
    check(isinstance(weight, int | float) and not isinstance(weight, bool) and MIN_WEIGHT <= weight <= MAX_WEIGHT,
          "weight", f"must be a number in [MIN_WEIGHT, MAX_WEIGHT] = [{MIN_WEIGHT}, {MAX_WEIGHT}]", weight)


def sub_batch(batch: Batch, rows: list[int]) -> Batch:
    """The part of a step's batch with these rows (in order), as the scheduler planned them."""
    sub = Batch()
    for i in rows:
        sub.requests.append(batch.requests[i])
        sub.num_new_tokens.append(batch.num_new_tokens[i])
        sub.samples.append(batch.samples[i])
        sub.drafts.append(batch.drafts[i])
    sub.copies = [c for c in batch.copies if any(c[0] is r for r in sub.requests)]
    return sub


def as_int64(seed: int) -> int:
    """An unsigned 64-bit seed as the int64 with the same bits (the sampler's hash runs in int64)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def build_runner(model_dir: str, model_cfg: ModelConfig, config: EngineConfig, tp: TPGroup) -> ModelRunner:
    """This rank's model shard and KV pool; every rank of a group calls it with the same config.
    The pool has the same block count on every rank: the fewest any rank's memory allows."""
    if config.engine == "mock":
        from workers.engine.mock import MockRunner
        return MockRunner(model_cfg, config)
    device = pick_device(config.device, tp)
    model_cfg = model_cfg.quantized(config.quantization)
    runner = ModelRunner(model_dir, model_cfg, pick_dtype(config.dtype, model_cfg.dtype, device), device,
                         config.block_size, tp, config.kv_cache_dtype)
    runner.allocate_kv(tp.min_over_ranks(config.num_kv_blocks or blocks_in_budget(runner, config)))
    runner.rank_bytes = tp.all_gather_ints([runner.parameter_bytes(), runner.kv_pool.nbytes])
    return runner


def build_tiers(model_dir: str, config: EngineConfig, runner: ModelRunner) -> KVTiers | None:
    """The prefix cache's host and disk tiers, if configured; the disk tier's directory is named by
    everything that shapes a block's KV bytes, so another model, dtype or block size never hits."""
    if config.kv_host_memory is None and config.kv_disk_dir is None:
        return None
    layout = {"dtype": runner.dtype, "block_size": config.block_size, "block_bytes": runner.block_bytes(),
              "kv_cache_dtype": config.kv_cache_dtype,
              "quantization": config.quantization, "tp": config.tensor_parallel_size}
    key = identity(model_dir, **layout) if config.kv_disk_dir else ""
    return KVTiers(runner, config.kv_host_memory or 0, config.kv_disk_dir, config.kv_disk_size or 0, key)


def blocks_in_budget(runner: ModelRunner, config: EngineConfig) -> int:
    budget = config.kv_cache_memory
    if budget is None and runner.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.device)
        budget = int(free - (1 - config.gpu_memory_utilization) * total)
    budget = budget or CPU_KV_CACHE_MEMORY
    return max(1, budget // runner.block_bytes())


def pick_device(asked: str | None, tp: TPGroup) -> torch.device:
    """The asked device, else CUDA when there is one; rank r of a CUDA group takes GPU r."""
    device = torch.device(asked or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and tp.size > 1:
        device = torch.device("cuda", tp.rank)
        torch.cuda.set_device(device)
    return device


def check_tensor_parallel(cfg: ModelConfig, size: int, device_type: str) -> None:
    """Raises ValueError naming the constraint before any follower starts."""
    CausalLM.check_tensor_parallel(cfg, size)
    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")


def shut_down(followers: Followers | None, tp: TPGroup) -> None:
    """Tells the followers to stop and waits for them (kills them if they do not), then leaves the
    group. A follower that died already means the others are stuck: they are killed at once."""
    if followers is None:
        return
    clean = followers.error is None
    if clean:
        try:
            tp.stop_followers()
        except RuntimeError:
            clean = False
    followers.close(timeout=5.0 if clean else 0.0)
    leave()


def pick_dtype(asked: str | None, checkpoint: str, device: torch.device) -> torch.dtype:
    """The dtype asked for, else: on the CPU bfloat16 where it has bfloat16 instructions (AMX or AVX-512 BF16,
    kernels/bf16_linear.py), as OpenVINO and oneDNN pick, float32 where it has none (bfloat16 would be
    emulated, slower than float32); on CUDA the checkpoint's 16-bit type. docs/decisions.md has the
    figures behind the CPU's default."""
    if asked:
        dtype = getattr(torch, asked, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype {asked!r} is not a torch floating-point type (e.g. float32, bfloat16)")
        return dtype
    if device.type == "cpu":
        return torch.bfloat16 if bf16_linear.kernel() is not None else torch.float32
    return torch.float16 if checkpoint == "float16" else torch.bfloat16
