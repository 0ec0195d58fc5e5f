"""`tokenbus sim` and `tokenbus sim-check`, registered through the entry-point group tokenbus.commands:
their parsers only, the simulator imported when one runs (it imports torch)."""
from lab.common.options import BENCH_MODEL
from ops.args import delegate, deployment
from schemas.messages import SCHEDULING_POLICIES


def sim(sub) -> None:
    sm = sub.add_parser("sim", help="a discrete-event simulation of a fleet that runs the project's own scheduler, "
                                    "KV cache manager and router with a cost model per step: latency percentiles, "
                                    "goodput under the SLOs, load, prefix hits; or the fewest workers for the SLOs")
    sim_hardware(sm)
    sim_fleet(sm)
    sim_workload(sm)
    sim_goals(sm)
    sm.set_defaults(func=delegate("lab.capacity.sim"))


def sim_hardware(sm) -> None:
    """sim's options: the model, its GPUs and how well a step uses them."""
    deployment(sm, "the GPU preset a step's roofline cost is computed for, or cpu: this machine, the real "
                   "engine's steps on --model measured and fitted (cached under $TOKENBUS_HOME/sim; "
                   "default h100-sxm)")
    sm.add_argument("--threads", type=int, default=1, help="with --gpu cpu: torch threads of a worker (default 1)")
    sm.add_argument("--cores", type=float, default=0.0, help="with --gpu cpu: cores the workers share, each busy "
                    "worker an equal share (default 0: a core each)")
    sm.add_argument("--background-cores", type=float, default=0.0, help="with --gpu cpu and --cores: of those, what "
                    "the stack's other processes take (sim-check meters it; about 0.07 with 3 workers on 2 cores)")
    sm.add_argument("--contention", type=float, nargs=2, default=[0.0, 0.0], metavar=("DECODE", "PREFILL"),
                    help="with --gpu cpu and --cores: how much longer a step runs per other core in use by a "
                    "worker stepping beside it, for decode-only steps and steps that prefill (sim-check "
                    "probes it; default 0 0)")
    sm.add_argument("--tp", type=int, default=8, help="GPUs of one worker (tensor parallel; default 8)")
    sm.add_argument("--mfu", type=float, default=0.5, help="share of the peak FLOP/s a step reaches (default 0.5)")
    sm.add_argument("--mbu", type=float, default=0.7,
                    help="share of the memory bandwidth a step reaches (default 0.7)")
    sm.add_argument("--memory-utilization", type=float, default=0.9, help="share of each GPU's memory for "
                    "weights and KV (default 0.9)")


def sim_fleet(sm) -> None:
    """sim's options: the fleet's make-up, each worker's engine and the router."""
    sm.add_argument("--workers", type=int, default=8, help="colocated workers per router cell (default 8)")
    sm.add_argument("--prefill-workers", type=int, default=0, help="prefill-only workers per cell (default 0)")
    sm.add_argument("--decode-workers", type=int, default=0, help="decode-only workers per cell (default 0)")
    sm.add_argument("--cells", type=int, default=1, help="router cells of that make-up in the fleet, each with its "
                    "own router and share of the arrivals (default 1)")
    sm.add_argument("--sample-cells", type=int, default=0, help="cells simulated, standing for all of them "
                    "(default 0: every cell)")
    sm.add_argument("--processes", type=int, default=1, help="cells simulated at once (default 1)")
    sm.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    sm.add_argument("--kv-blocks", type=int, default=0, help="KV blocks per worker (default 0: what the plan "
                    "leaves for KV on the worker's GPUs)")
    sm.add_argument("--max-num-seqs", type=int, default=512, help="requests a worker runs at once (default 512)")
    sm.add_argument("--max-batched-tokens", type=int, default=2048,
                    help="token budget of one step: the chunked-prefill size (default 2048)")
    sm.add_argument("--max-model-len", type=int, default=8192, help="context length (default 8192)")
    sm.add_argument("--policy", default="prefix", choices=["prefix", "least-loaded", "round-robin"],
                    help="the router's policy (default prefix)")
    sm.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                    help="the workers' scheduling policy, as a worker's flag of that name (default fcfs)")
    sm.add_argument("--tenant", action="append", metavar="NAME:SHARE[:WEIGHT[:PRIORITY]]",
                    help="a tenant: its share of the conversations, and its key's weight (fair policy, default 1) "
                         "and priority (priority and fair policies, lower first, default 0); repeat for each "
                         "(default: one tenant). With more than one, the figures are also given per tenant")
    sm.add_argument("--alpha", type=float, default=4.0, help="the prefix policy's weight of a block to prefill "
                    "against a block of KV held (default 4, the router's)")
    sm.add_argument("--max-local-prefill", type=int, default=1000, help="with prefill workers: uncached prompt "
                    "tokens a decode worker prefills itself (default 1000)")
    sm.add_argument("--max-prefill-queue", type=int, default=2, help="with prefill workers: requests queued on "
                    "the least queued one at most, for a remote prefill (default 2)")
    sm.add_argument("--kv-gb-per-s", type=float, default=25.0, help="with prefill workers: a KV transfer's "
                    "bandwidth in GB/s (default 25, a 200 Gb/s RDMA link)")
    sm.add_argument("--dispatch-ms", type=float, default=5.0, help="an arrival to its worker's queue: gateway, "
                    "tokenizer, router and bus (default 5)")
    sm.add_argument("--stream-ms", type=float, default=2.0, help="a sampled token to the client (default 2)")


def sim_workload(sm) -> None:
    """sim's options: the arrivals and their speculative decoding."""
    sm.add_argument("--rate", type=float, default=40.0, help="requests/s over the fleet (default 40)")
    sm.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60)")
    sm.add_argument("--warmup", type=float, default=0.0, help="seconds of arrivals not measured (default 0)")
    sm.add_argument("--turns", type=int, default=8, help="turns of a conversation (default 8)")
    sm.add_argument("--system-tokens", type=int, default=1000, help="tokens of a system prompt (default 1000)")
    sm.add_argument("--system-prompts", type=int, default=8, help="system prompts conversations draw from "
                    "(default 8)")
    sm.add_argument("--user-tokens", type=int, default=150, help="tokens of a user message (default 150)")
    sm.add_argument("--output-tokens", type=int, default=400, help="tokens of an answer (default 400)")
    sm.add_argument("--replay", metavar="FILE", help="arrivals from a `tokenbus log export` file instead of chats "
                    "(default: none)")
    sm.add_argument("--spec-k", type=int, default=0, help="draft tokens per decoding request and step "
                    "(default 0: no speculation)")
    sm.add_argument("--spec-acceptance", type=float, default=0.7,
                    help="the chance each draft token is kept, up to the first rejected (default 0.7)")
    sm.add_argument("--spec-draft-cost", type=float, default=0.0, help="a draft token's cost as a share of the "
                    "target's decode step (default 0: n-gram drafts)")
    sm.add_argument("--spec-max-batch", type=int, default=1 << 30, help="no drafting in steps of more requests "
                    "(default: no limit)")


def sim_goals(sm) -> None:
    """sim's options: the SLOs, the search, the randomness and the output."""
    sm.add_argument("--ttft-slo-ms", type=float, default=700.0, help="time to the first token, p99 (default 700)")
    sm.add_argument("--tpot-slo-ms", type=float, default=40.0, help="time per output token, p99 (default 40)")
    sm.add_argument("--search", action="store_true", help="find the fewest colocated workers per cell that meet "
                    "the SLOs at --rate (default: off)")
    sm.add_argument("--seed", type=int, default=0, help="seed of the arrivals, the sampled tokens and the jitter "
                    "(default 0)")
    sm.add_argument("--jitter", type=float, default=0.0, help="each step's time × a random factor of mean 1 whose "
                    "log has this standard deviation: a real step's spread around the cost model (sim-check "
                    "probes 0.04-0.11 on this CPU; default 0)")
    sm.add_argument("--json", action="store_true", help="the figures as JSON (default: a table)")
    sm.add_argument("--plot", metavar="FILE", help="TTFT and TPOT CDFs and per-worker load (.png or .svg; "
                    "default: none)")



def sim_check(sub) -> None:
    sc = sub.add_parser("sim-check", help="tokenbus sim with the CPU cost fitted on this machine against the real "
                                          "stack on the same requests: TTFT, TPOT and throughput errors")
    sc.add_argument("--model", help=BENCH_MODEL)
    sc.add_argument("--workers", type=int, nargs="+", default=[1, 3], help="worker counts, a stack each (default 1 3)")
    sc.add_argument("--workloads", nargs="+", choices=["poisson", "chat"], default=["poisson", "chat"],
                    help="which workloads, in this order (default poisson chat)")
    sc.add_argument("--requests", type=int, default=40, help="poisson: requests per worker (default 40)")
    sc.add_argument("--rate", type=float, default=4.0, help="poisson: requests/s per worker (default 4)")
    sc.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"),
                    help="poisson: prompt tokens, uniform in [MIN, MAX] (default 64 512)")
    sc.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                    help="poisson: output tokens, uniform in [MIN, MAX] (default 16 64)")
    sc.add_argument("--conversations", type=int, default=4, help="chat: conversations per worker (default 4)")
    sc.add_argument("--turns", type=int, default=4, help="chat: turns per conversation (default 4)")
    sc.add_argument("--system-prompts", type=int, default=2, help="chat: shared system prompts (default 2)")
    sc.add_argument("--system-len", type=int, default=256, help="chat: tokens of a system prompt (default 256)")
    sc.add_argument("--user-len", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"),
                    help="chat: tokens of a user turn, uniform in [MIN, MAX] (default 32 96)")
    sc.add_argument("--reply-len", type=int, default=32, help="chat: output tokens of each turn (default 32)")
    sc.add_argument("--think", type=float, default=2.0, help="chat: a user's pause before each turn, uniform up to "
                    "this many seconds (default 2)")
    sc.add_argument("--kv-blocks", type=int, default=2000, help="KV blocks per worker (default 2000)")
    sc.add_argument("--max-num-seqs", type=int, default=64, help="requests in a step at most (default 64)")
    sc.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in a step at most (default 512)")
    sc.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    sc.add_argument("--seed", type=int, default=0, help="seed of the random workloads (default 0)")
    sc.add_argument("--repeat", type=int, nargs="+", default=[1], metavar="N", help="runs of each workload on its "
                    "stack, from the same seed in other token ids (a cold prefix cache): one count for every "
                    "workload, or one each in --workloads' order (a chat run takes seconds, a Poisson one minutes); "
                    "the figures are their means, and the real runs' spread is how far the real stack moves from "
                    "run to run (default 1)")
    sc.add_argument("--replicas", type=int, default=8, help="replays of each run in the simulator, each drawing its "
                    "steps' jitter (their spread around the fitted cost, probed) from a seed of its own: the "
                    "simulated figures are their means (default 8)")
    sc.add_argument("--steps", action="store_true", help="also compare the steps: the real workers' (their "
                    "--step-trace) against the simulator's, and the scaled cost on the real steps' shapes")
    sc.add_argument("--data-dir", help="keep each stack's logs here (default: a temporary directory)")
    sc.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    sc.set_defaults(func=delegate("lab.capacity.check", exits=True))
