"""`tokenbus up` refuses a bus reachable beyond this machine without credentials, and bad security flags,
with a message naming the flag to use; it starts nothing first."""
import os
import subprocess
import sys

import pytest

TOKENBUS = [sys.executable, "-m", "ops.cli", "up"]


@pytest.mark.parametrize(("args", "message"), [
    (["--nats-host", "0.0.0.0"], "refusing to start nats-server on 0.0.0.0 without credentials: anyone who reaches "
                                 "it could read every prompt and publish requests; add --bus-auth"),
    (["--nats-host", "10.0.0.7", "--host", "10.0.0.7", "--api-keys", "{keys}"], "add --bus-auth"),
    (["--nats-url", "nats://10.0.0.7:4222"], "refusing to use nats://10.0.0.7:4222 without credentials: add "
                                             "--bus-creds DIR"),
    (["--nats-host", "0.0.0.0", "--tls-cert", "{keys}", "--tls-key", "{keys}"], "add --bus-auth"),   # TLS is no login
    (["--nats-url", "nats://10.0.0.7:4222", "--bus-creds", "{empty}"], "missing {empty}/gateway.nk"),
    (["--tls-cert", "{keys}"], "--tls-cert and --tls-key go together"),
    (["--tls-ca", "{empty}/ca.pem"], "--tls-ca {empty}/ca.pem: no such file"),
], ids=["wildcard", "public-ip-with-api-keys", "remote-url", "tls-without-auth", "creds-missing", "tls-half",
        "tls-ca-missing"])
def test_up_refuses_an_open_bus_beyond_loopback_and_names_the_flag(args, message, tmp_path):
    keys, empty = tmp_path / "keys.json", tmp_path / "empty"
    keys.write_text('{"sk-1": {"tenant": "a"}}')
    empty.mkdir()
    fill = {"keys": keys, "empty": empty}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_NATS_")}   # no credentials
    p = subprocess.run([*TOKENBUS, *(a.format(**fill) for a in args), "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=60, env={**env, "TOKENBUS_HOME": str(tmp_path / "home")})
    assert p.returncode != 0 and message.format(**fill) in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "home").exists()      # nothing started or built
