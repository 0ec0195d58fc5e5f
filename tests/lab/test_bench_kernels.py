"""lab.benchmarks.kernels --shard's machinery on the CPU, with a small shard: the engine steps of two depths give
a prefill row and a decode row per batch, each decode step holding the whole batch at its context."""
from lab.benchmarks.kernels import shard_layers, shard_table

SMALL = {"hidden": 128, "intermediate": 256, "heads": 4, "kv_heads": 1, "head_dim": 32}


def test_the_shard_layer_bench_times_a_prefill_and_each_decode_batch_through_the_engine():
    report = shard_layers("cpu", SMALL, depths=(1, 2), batches=(1, 3), context=40, prefill=48,
                          bandwidth=50e9, flops=1e12)
    assert [r["step"].split(",")[0] for r in report["rows"]] == ["prefill 48 tokens", "decode batch 1",
                                                                   "decode batch 3"]
    assert report["params_per_layer"] == 128 * 6 * 32 + 4 * 32 * 128 + 3 * 128 * 256
    for batch, runs in report["runs"].items():
        for run in runs:       # every measured step decoded the whole batch, past its prompt
            assert run["decode_steps"] >= 8 and 40 < run["decode_context"] < 40 + 40 * int(batch)
            assert run["prefill_s"] > 0 and run["decode_s"] > 0
    assert "of floor" in shard_table(report)
