"""What the lab's benchmarks share, once: a request's timings and their percentiles, the load clients
(websocket and OpenAI HTTP), the tokenizer corpus' text, token-id workloads run in a closed loop
through the engine, offline engine and HF runs, and the bus records a run reads back. A benchmark
imports these and the product, never another benchmark.

- results.py   Result, stats, ratio, fmt, best_ms; finish (a command's table, --json, --plot, failures)
- clients.py   WsClient, HttpClient: many requests in flight over the gateway's two protocols
- corpus.py    Corpus: text of a given token length; length(): lengths drawn around a mean
- turns.py     Turn, Workload, warmup, closed_loop, figures, EngineLoop: token-id workloads, greedy
- engine.py    workload, run_engine, timed_engine_run, hf_generate: the engine and HF in this process
- records.py   results_seq, records, router_stats: what the cluster recorded of a run
- options.py   BENCH_MODEL: what the lab's commands say alike in their parsers
"""
