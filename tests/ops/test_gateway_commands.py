"""The gateway's side of the `tokenbus` commands: `up` refuses what it must not serve, and
`bench-gateway` runs end to end."""
import json
import subprocess
import sys

import pytest

TOKENBUS = [sys.executable, "-m", "ops.cli"]


def test_up_and_the_gateway_refuse_a_public_address_without_keys_and_a_bad_keys_file(tmp_path, tiny_model):
    bad = tmp_path / "keys.json"
    bad.write_text('{"sk-x": {"tenant": "a", "rpm": 1}}')
    for args, message in [(["up", "--host", "0.0.0.0"], "refusing to serve on 0.0.0.0 without --api-keys"),
                          (["up", "--api-keys", str(bad)], "unknown field 'rpm'")]:
        p = subprocess.run([*TOKENBUS, *args], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "services.gateway", "--model", tiny_model, "--host", "10.0.0.1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "without --api-keys" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_bench_gateway_measures_refused_accepted_and_streamed_and_writes_json(tiny_model, tmp_path):
    out = subprocess.run([*TOKENBUS, "bench-gateway", "--model", tiny_model, "--requests", "40", "--concurrency", "4",
                          "--streams", "4", "--tokens", "50", "--json", str(tmp_path / "r.json")],
                         check=True, capture_output=True, text=True, timeout=300).stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert "refused (429, token bucket)" in out and "streamed, SSE" in out
    assert r["refused_429"]["requests_per_s"] > 0 and 0 < r["refused_429"]["p50_ms"] <= r["refused_429"]["p99_ms"]
    assert r["accepted"]["requests_per_s"] > 0 and r["accepted"]["without_gateway_p50_ms"] > 0
    for via in ("streamed_sse", "streamed_ws"):
        assert r[via]["tokens"] == 4 * 50 and r[via]["tokens_per_s"] > 0
