"""compose.yaml and the Dockerfile, checked without Docker: compose.yaml (interpolated as compose does)
validates against the compose-spec JSON schema, names every service, and runs the same entry points with
the same flags as `tokenbus up`. The schema is vendored from the docker-compose 1.29.2 wheel on PyPI
(compose/config/compose_spec.json, Apache-2.0), the last compose that shipped it as a file. The stack run for
real in containers: tests/e2e/test_compose_stack.py."""
import importlib
import json
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import yaml

from ops import cluster, procs, up

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((Path(__file__).parent / "data" / "compose_spec.json").read_text())
NODES = {"nats-1", "nats-2", "nats-3"}                  # the 3-node nats cluster
SERVING = {"gateway", "tokenizer", "router", "worker", "worker-cpu"}   # the services with the model directory
SERVICES = {*NODES, *SERVING, "postgres", "recorder", "prometheus", "grafana"}
NATS_URL = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
PARSERS = {"services.gateway": "services.gateway.app", "services.tokenizer": "services.tokenizer.service",
           "services.router": "services.router.service", "workers.service": "workers.service",
           "services.recorder": "services.recorder.service"}
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")
ONE_MODEL = {"--models": "--model"}   # up writes a served models file; compose serves one model, named by --model
LATER = {"--tensor-parallel-size": 1, "--api-keys": 1}   # flags of parallel issues (tensor parallel, API keys):
                                                       # taken out while a parser does not know them yet


def interpolate(node, env: dict):
    """${VAR:-default}, ${VAR} and $VAR from env, $$ as a literal $, in every string (as compose does)."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, str):
        return VARIABLE.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1] or m[3], m[2] or ""), node)
    return node


def compose(env: dict | None = None) -> dict:
    return interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text()), env or {})


def errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft201909Validator(SCHEMA)
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def mounts(service: dict) -> dict[str, str]:
    """A service's volumes: container path -> source."""
    return {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}


def argv(service: dict) -> list[str]:
    """The command a service runs, with `sh -c "exec ..."` unwrapped."""
    cmd = service["command"]
    if cmd[:2] == ["sh", "-c"]:
        cmd = shlex.split(cmd[2].replace("exec ", "", 1))
    return cmd


def test_compose_validates_against_the_compose_spec_and_names_every_service():
    doc = compose()
    assert errors(doc) == []
    assert set(doc["services"]) == SERVICES
    assert all("healthcheck" in s for s in doc["services"].values())


def test_the_validator_rejects_a_broken_compose_file():
    doc = compose()
    doc["services"]["gateway"]["helthcheck"] = doc["services"]["gateway"].pop("healthcheck")
    doc["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] = [1]
    assert len(errors(doc)) == 2


def test_nats_is_a_3_node_cluster_of_the_official_image_each_node_named_with_its_own_volume():
    doc = compose()
    config = (ROOT / "ops" / "nats-cluster.conf").read_text()
    store = re.search(r'store_dir: "([^"]+)"', config)[1]
    volumes = set()
    for name in NODES:
        node = doc["services"][name]
        cmd = node["command"]
        assert node["image"].startswith("nats:") and cmd[cmd.index("--server_name") + 1] == name
        mounts = {v.split(":")[1]: v.split(":")[0] for v in node["volumes"]}      # container path -> source
        assert mounts[cmd[cmd.index("-c") + 1]] == "./ops/nats-cluster.conf"
        assert mounts[store] in doc["volumes"]
        volumes.add(mounts[store])
    assert len(volumes) == 3                                            # one store per node


def test_the_cluster_config_passes_nats_server_t_routes_to_every_node_and_fsyncs_every_write():
    path = ROOT / "ops" / "nats-cluster.conf"
    checked = subprocess.run([procs.nats_server_binary(), "-t", "-c", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr + checked.stdout
    text = path.read_text()
    routes = set(re.findall(r"nats-route://([\w-]+):6222", text))
    assert routes == NODES and "sync_interval: always" in text and f"name: {cluster.CLUSTER_NAME}" in text
    assert f'ping_interval: "{cluster.PING}"' in text and f"ping_max: {cluster.PING_MAX}" in text   # as `up`'s
    ports = {int(p) for p in re.findall(r"0\.0\.0\.0:(\d+)", text)}
    assert ports == {4222, 6222, 8222} and {f"nats://{n}:4222" for n in NODES} == set(NATS_URL.split(","))


def test_settings_come_from_the_environment_gpus_tensor_parallel_size_model_and_api_keys():
    doc = compose({"TB_TP_SIZE": "4", "TB_MODEL": "llama-70b", "TB_MODEL_DIR": "/srv/models",
                   "TB_API_KEYS": "/etc/tb/keys.json"})
    worker = doc["services"]["worker"]
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == "4"
    cmd = argv(worker)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4" and cmd[cmd.index("--model") + 1] == "/models/llama-70b"
    assert cmd[cmd.index("--id") + 1] == "${HOSTNAME}"          # expanded by the container's shell
    assert "deploy" not in doc["services"]["worker-cpu"] and doc["services"]["worker-cpu"]["profiles"] == ["cpu"]
    gateway = doc["services"]["gateway"]
    assert argv(gateway)[argv(gateway).index("--api-keys") + 1] == "/config/api-keys.json"
    assert "/etc/tb/keys.json:/config/api-keys.json:ro" in gateway["volumes"]
    for name in SERVING | {"recorder"}:
        assert all(doc["services"][name]["depends_on"][n]["condition"] == "service_healthy" for n in NODES), name
    for name in SERVING:
        assert "/srv/models:/models:ro" in doc["services"][name]["volumes"], name


def test_the_recorder_writes_to_the_postgres_service_once_healthy_and_keeps_its_archive_in_a_volume():
    doc = compose({"TB_PG_USER": "billing", "TB_PG_PASSWORD": "p@ss/word", "TB_PG_DB": "records"})
    postgres, recorder = doc["services"]["postgres"], doc["services"]["recorder"]
    assert re.fullmatch(r"postgres:\d+(\.\d+)*-alpine", postgres["image"])          # the official image, a pinned major
    env = postgres["environment"]
    assert (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], env["POSTGRES_DB"]) == ("billing", "p@ss/word", "records")
    assert mounts(postgres)["/var/lib/postgresql/data"] in doc["volumes"]
    assert postgres["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert all(p.startswith("127.0.0.1:") for p in postgres.get("ports", []))       # loopback only, if at all
    args = importlib.import_module(PARSERS["services.recorder"]).parser().parse_args(argv(recorder)[3:])
    assert args.database == "postgresql://billing@postgres:5432/records"           # the password: libpq's PGPASSWORD
    assert recorder["environment"]["PGPASSWORD"] == "p@ss/word" and "p@ss" not in " ".join(argv(recorder))
    assert recorder["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert mounts(recorder)[args.archive] in doc["volumes"]
    assert args.metrics_host == "0.0.0.0"                                       # scraped from other containers
    assert f"127.0.0.1:{args.metrics_port}/metrics" in " ".join(recorder["healthcheck"]["test"])


def up_commands(monkeypatch, tmp_path) -> dict[str, list[str]]:
    """The commands `tokenbus up` starts, by module (nothing is started)."""
    started = {}
    monkeypatch.setattr(up.procs, "start_nats", lambda *a, **k: None)
    monkeypatch.setattr(up, "prepare", lambda url, credentials=None, partitions=None, storage=None: _done())
    monkeypatch.setattr(up.Stack, "spawn",
                        lambda self, name, module, *args, **kw: started.setdefault(module, list(args)))
    up.Stack("/models/tiny", 8000, tmp_path).start()
    return started


async def _done():
    return None


def test_compose_runs_the_entry_points_of_tokenbus_up_with_flags_their_parsers_take(monkeypatch, tmp_path):
    started = up_commands(monkeypatch, tmp_path)
    doc = compose()
    modules = {}
    for name in SERVICES - NODES - {"postgres", "prometheus", "grafana"}:
        cmd = argv(doc["services"][name])
        assert cmd[:2] == ["python", "-m"], cmd
        modules.setdefault(cmd[2], []).append(cmd[3:])
    assert set(modules) == set(started) == set(PARSERS)
    for module, commands in modules.items():
        parser = importlib.import_module(PARSERS[module]).parser()
        for args in commands:
            for flag, n in LATER.items():
                if flag in args and flag not in parser._option_string_actions:
                    i = args.index(flag)
                    args = args[:i] + args[i + 1 + n:]
            parsed = parser.parse_args(args)                 # exits (fails the test) on an unknown flag
            assert parsed.nats_url == NATS_URL                # every service is given the whole cluster
        flags_up = {ONE_MODEL.get(a, a) for a in started[module] if a.startswith("--")}
        assert flags_up <= {a for a in commands[0] if a.startswith("--")}, module   # nothing up passes is missing


def test_the_dockerfile_copies_every_package_and_installs_tokenbus():
    text = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+)", text, re.M)
    assert all((ROOT / c).exists() for c in copied)
    packages = {"schemas", "services", "workers", "kernels", "ops"}
    assert packages <= set(copied) and "pyproject.toml" in copied and "pip install --no-deps ." in text
    assert text.startswith("#") and re.search(r"^FROM python:3\.1[1-9]", text, re.M)
