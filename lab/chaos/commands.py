"""`tokenbus chaos`, registered through the entry-point group tokenbus.commands: its parser only, the
scenarios imported when they run."""
from lab.common.options import BENCH_MODEL
from ops.args import delegate
from schemas.subjects import partition_count


def chaos(sub) -> None:
    ch = sub.add_parser("chaos", help="fault scenarios against a live stack under a verified load: lost, "
                        "duplicated, wrong tokens, recovery time")
    ch.add_argument("--scenarios", nargs="+", default=None, metavar="NAME",
                    help="which scenarios (default: all): none, kill-/stop- worker|router|tokenizer|gateway|"
                         "recorder, broker-restart, poison, slow-client, overload, database-restart, backlog-full; "
                         "with --cluster (default: its own): "
                         "kill-leader-node, kill-follower-node, partition-node, throughput")
    ch.add_argument("--cluster", action="store_true",
                    help="run on a 3-node nats cluster (R3; nodes in network namespaces where root allows): "
                         "node SIGKILLs, a 10 s partition, and the throughput cost of R3 and of fsync policies")
    ch.add_argument("--bus-partitions", type=partition_count, default=1, metavar="N",
                    help="run each stack on a bus of N partitions (a router each; the records of every "
                         "partition are checked)")
    ch.add_argument("--model", help=BENCH_MODEL)
    ch.add_argument("--workers", type=int, default=2, help="workers of each scenario's stack")
    ch.add_argument("--requests", type=int, default=40, help="greedy requests per scenario (3x for overload)")
    ch.add_argument("--max-tokens", type=int, default=48, help="output tokens of each request (EOS ignored)")
    ch.add_argument("--clients", type=int, default=4, help="websocket connections the requests are spread over")
    ch.add_argument("--interval", type=float, default=0.1, help="seconds between requests (default 0.1)")
    ch.add_argument("--max-num-seqs", type=int, default=16, help="each worker's batch (default 16)")
    ch.add_argument("--patience", type=float, default=90.0,
                    help="seconds a client waits for its answers after the last request (default 90)")
    ch.add_argument("--database-down", type=float, default=30.0, metavar="SECONDS",
                    help="how long database-restart keeps PostgreSQL down (default 30)")
    ch.add_argument("--data-dir", help="keep each scenario's stack (logs, JetStream) under here "
                                       "(default: a temporary directory)")
    ch.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ch.set_defaults(func=delegate("lab.chaos.scenarios", exits=True))
