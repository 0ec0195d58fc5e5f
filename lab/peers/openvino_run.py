"""Runs token-id workloads through OpenVINO GenAI's ContinuousBatchingPipeline; run by the Python of the
OpenVINO venv (lab/peers/clients.py), never imported by tokenbus, so it imports only OpenVINO and numpy:

    .../peer-clients/openvino-2026.4.1/bin/python lab/peers/openvino_run.py REQUEST.json RESULT.json

REQUEST: {"model": the exported dir, "device": "CPU", "properties": the pipeline's (INFERENCE_NUM_THREADS...),
"scheduler": SchedulerConfig's fields, "workloads": [{"concurrency": c, "conversations": [[[prompt ids,
max tokens], ...], ...]}, ...]}. Each workload runs in turn as lab.common.turns.closed_loop runs one:
`concurrency` conversations in flight, a turn added when its conversation's previous turn ended; the
pipeline is stepped until none is left, and after each step every request's new tokens are read and
stamped with the time the step returned. Every request is greedy, EOS ignored, run to its max tokens.

RESULT: {"runs": [{"seconds", "results": [{"conversation", "turn", "start", "chunks", "end",
"prompt_tokens", "token_ids", "error"}, ...]}, ...] (times: perf_counter), "peak_rss_bytes": this
process's VmHWM after the runs, "compiled": the properties of the model compiled again with the same
properties after that (the precision it infers in, its KV cache's), "versions"}."""
import itertools
import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as genai

PROPERTIES = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION",
              "DYNAMIC_QUANTIZATION_GROUP_SIZE", "INFERENCE_NUM_THREADS", "EXECUTION_MODE_HINT")
ENDED = {genai.GenerationStatus.FINISHED: None, genai.GenerationStatus.IGNORED: "openvino_ignored",
         genai.GenerationStatus.STOP: "openvino_stopped", genai.GenerationStatus.CANCEL: "openvino_cancelled"}


def pipeline(request: dict) -> genai.ContinuousBatchingPipeline:
    config = genai.SchedulerConfig()
    for key, value in request["scheduler"].items():
        setattr(config, key, value)
    return genai.ContinuousBatchingPipeline(request["model"], config, request["device"], request["properties"])


def greedy(max_tokens: int) -> genai.GenerationConfig:
    config = genai.GenerationConfig()
    config.do_sample, config.max_new_tokens, config.ignore_eos = False, max_tokens, True
    return config


def closed_loop(pipe: genai.ContinuousBatchingPipeline, workload: dict) -> dict:
    """The workload's turns through `pipe`, `concurrency` conversations in flight: each request's
    times and tokens, and the seconds from the first request added to the last token."""
    queue = list(enumerate(workload["conversations"]))[::-1]
    live: dict[int, dict] = {}                    # request id -> its record, handle and conversation
    ids, done = itertools.count(), []

    def send(conversation: int, turns: list, turn: int) -> bool:
        if turn == len(turns):
            return False
        prompt, max_tokens = turns[turn]
        rid = next(ids)
        record = {"conversation": conversation, "turn": turn, "start": time.perf_counter(), "chunks": [],
                  "end": 0.0, "prompt_tokens": len(prompt), "token_ids": [], "error": None}
        handle = pipe.add_request(rid, ov.Tensor(np.array([prompt], dtype=np.int64)), greedy(max_tokens))
        live[rid] = {"record": record, "handle": handle, "turns": turns}
        return True

    def refill() -> None:
        while len(live) < workload["concurrency"] and queue:
            send(*queue.pop(), 0)

    start = time.perf_counter()
    refill()
    while live:
        pipe.step()
        now = time.perf_counter()
        for rid, entry in list(live.items()):
            record, handle = entry["record"], entry["handle"]
            new = []
            while handle.can_read():
                new += [t for out in handle.read().values() for t in out.generated_ids]
            if new:
                record["chunks"].append(now)
                record["token_ids"] += new
            status = handle.get_status()
            if status == genai.GenerationStatus.RUNNING:
                continue
            record["end"], record["error"] = now, ENDED.get(status, f"openvino_{status.name.lower()}")
            done.append(record)
            del live[rid]
            if not send(record["conversation"], entry["turns"], record["turn"] + 1):
                refill()
        if live and not pipe.has_non_finished_requests():
            raise RuntimeError(f"the pipeline has no request left to run but {len(live)} never ended")
    return {"seconds": time.perf_counter() - start, "results": done}


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def compiled(request: dict) -> dict:
    """PROPERTIES of the exported model compiled as the pipeline compiles it (device, properties)."""
    model = ov.Core().compile_model(f"{request['model']}/openvino_model.xml", request["device"],
                                    request["properties"])
    values = {p: model.get_property(p) for p in PROPERTIES}
    return {p: v.to_string() if isinstance(v, ov.Type) else str(v) for p, v in values.items()}


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    pipe = pipeline(request)
    runs = [closed_loop(pipe, w) for w in request["workloads"]]
    rss = peak_rss()
    del pipe
    result = {"runs": runs, "peak_rss_bytes": rss, "compiled": compiled(request),
              "versions": {"openvino": ov.__version__, "openvino_genai": genai.__version__}}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
