"""The Kubernetes manifests (ops/k8s/), checked without a cluster: both overlays rendered by `kubectl kustomize`,
every document validated against Kubernetes 1.32's schemas (kubernetes-validate, strict: no unknown field) and
the KEDA ScaledObject against KEDA 2.20.2's CRD schema, unknown fields refused as the API server refuses them.
Then what the manifests promise: the production overlay sized by `tokenbus plan --json`, every worker pod one
tensor-parallel group with its revision pinned and its drain waited for, every Deployment probed and given
longer than its drain, each service holding only its own role's seed, every command accepted by its service's
parser, and the NATS chart's values made of the chart's own keys and accepted by nats-server.

tests/ops/data/k8s/ holds, unchanged (both Apache-2.0): the nats chart's values.yaml (nats-io/k8s
helm/charts/nats/values.yaml, chart 2.14.2, commit 957650fba03e) and KEDA's ScaledObject CRD (kedacore/keda
config/crd/bases/keda.sh_scaledobjects.yaml, tag v2.20.2)."""
import argparse
import contextlib
import copy
import importlib
import io
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from schemas import roles, subjects
from schemas.revision import LENGTH

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "k8s"
DATA = Path(__file__).parent / "data" / "k8s"
KUBERNETES = "1.32.0"                                      # kubectl v1.32 renders; its API's schemas validate
KUBECTL = shutil.which("kubectl")
CHART = yaml.safe_load((DATA / "nats-chart-values.yaml").read_text())
CRD = yaml.safe_load((DATA / "keda-scaledobjects-crd.yaml").read_text())
VALUES = yaml.safe_load((K8S / "nats-values.yaml").read_text())
PRODUCTION_VALUES = yaml.safe_load((K8S / "nats-values-production.yaml").read_text())
PARSERS = {"services.gateway": "services.gateway.app", "services.tokenizer": "services.tokenizer.service",
           "services.router": "services.router.service", "services.recorder": "services.recorder.service",
           "workers.service": "workers.service"}
VARIABLE = re.compile(r"\$\((\w+)\)")
HEADLESS = "nats-headless.nats.svc.cluster.local"           # the chart's headless Service, release nats in nats

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: `kubectl kustomize` renders "
                                "the overlays")


def render(overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def dev() -> list[dict]:
    return render("dev")


@pytest.fixture(scope="module")
def production() -> list[dict]:
    return render("production")


@pytest.fixture(scope="module")
def plan() -> dict:
    """`tokenbus plan --json` at its defaults: 10M daily users, 3,000 in / 400 out, llama-3-70b, h100-sxm, TP 8."""
    from ops.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", "--json"])
    return json.loads(out.getvalue())


@pytest.fixture(params=["dev", "production"])
def docs(request) -> list[dict]:
    return request.getfixturevalue(request.param)


def of(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def config(docs: list[dict], name: str) -> dict[str, str]:
    """A generated ConfigMap's data (its name carries kustomize's hash)."""
    return next(d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(name + "-"))


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def environment(docs: list[dict], c: dict) -> dict[str, str]:
    """The container's variables as the kubelet gives them: envFrom's ConfigMaps, then env (a field reference
    as the pod's name)."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = {k: v for ref in c.get("envFrom", []) for k, v in maps[ref["configMapRef"]["name"]].items()}
    for e in c.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else "pod-0" if "fieldRef" in e.get("valueFrom", {}) else "secret"
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in command and subPathExpr; one it cannot expand fails the test (the
    kubelet would leave it in place, silently)."""
    missing = [v for v in VARIABLE.findall(text) if v not in env]
    assert not missing, f"{text}: no variable {missing}"
    return VARIABLE.sub(lambda m: env[m[1]], text)


def argv(docs: list[dict], deployment: dict) -> list[str]:
    c = container(deployment)
    env = environment(docs, c)
    return [expand(a, env) for a in c["command"]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def role(deployment: dict) -> str:
    """The service's bus role: its component label."""
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


# -- schemas ---------------------------------------------------------------------------------------------------

def kubernetes_errors(doc: dict) -> list[str]:
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}"]
    return []


def strict(schema):
    """The CRD's schema as the API server applies it to a create: a field it does not declare is refused."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(s) for s in schema]
    return schema


KEDA = strict(next(v for v in CRD["spec"]["versions"] if v["name"] == "v1alpha1")["schema"]["openAPIV3Schema"])


def keda_errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(KEDA)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_every_document_validates_against_kubernetes_1_32_and_keda_s_crd(docs):
    errors, kinds = [], set()
    for doc in docs:
        kinds.add(doc["kind"])
        errors += keda_errors(doc) if doc["apiVersion"].startswith("keda.sh/") else kubernetes_errors(doc)
    assert not errors, "\n".join(errors)
    assert {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "PodDisruptionBudget"} <= kinds


def test_the_validators_refuse_an_unknown_field_and_a_wrong_type(production):
    worker = copy.deepcopy(of(production, "Deployment")["tokenbus-worker"])
    worker["spec"]["replicaz"] = 3
    assert kubernetes_errors(worker)
    worker = copy.deepcopy(of(production, "Deployment")["tokenbus-worker"])
    container(worker)["readinessProbe"]["periodSeconds"] = "often"
    assert kubernetes_errors(worker)
    scaled = copy.deepcopy(of(production, "ScaledObject")["tokenbus-worker"])
    scaled["spec"]["minReplicaCount"] = "some"
    scaled["spec"]["trigers"] = []
    assert len(keda_errors(scaled)) == 2


# -- workers ---------------------------------------------------------------------------------------------------

def test_every_worker_pod_is_one_tensor_parallel_group_with_a_pinned_revision(docs):
    worker = of(docs, "Deployment")["tokenbus-worker"]
    c, model = container(worker), config(docs, "tokenbus-model")
    args, env = argv(docs, worker), environment(docs, c)
    tp, gpus = int(flag(args, "--tensor-parallel-size")), c["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == tp or (gpus is None and tp == 1)       # a GPU per rank, or the model on the CPU
    for labels in (worker["metadata"]["labels"], worker["spec"]["template"]["metadata"]["labels"]):
        assert labels["tokenbus.io/model-revision"] == model["TB_MODEL_REVISION"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
    assert mount["readOnly"]
    assert expand(mount["subPathExpr"], env) == f"{model['TB_MODEL']}/{model['TB_MODEL_REVISION']}"
    assert flag(args, "--model") == mount["mountPath"] and flag(args, "--served-model-name") == model["TB_MODEL"]
    volume = next(v for v in worker["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"]["readOnly"]


def test_every_worker_drains_in_its_prestop_under_its_own_id(docs):
    worker = of(docs, "Deployment")["tokenbus-worker"]
    c = container(worker)
    ids = {e["name"] for e in c["env"]
           if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name"}
    assert VARIABLE.fullmatch(c["command"][c["command"].index("--id") + 1])[1] in ids
    shell, dash_c, line = c["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, dash_c) == ("sh", "-c")
    assert c["command"][:3] == ["python", "-m", "workers.service"] or c["command"][:2] == ["sh", "-c"]
    # SIGTERM to the worker (PID 1: the image runs it without a shell) starts its drain; the hook waits for it
    assert line == "kill -TERM 1 && while kill -0 1 2>/dev/null; do sleep 1; done"


def test_dev_is_one_of_each_with_a_cpu_worker_and_no_autoscaler(dev):
    assert all(d["spec"]["replicas"] == 1 for d in of(dev, "Deployment").values())
    assert not of(dev, "HorizontalPodAutoscaler") and not of(dev, "ScaledObject")
    assert not any("nvidia.com/gpu" in json.dumps(container(d)["resources"]) for d in of(dev, "Deployment").values())
    args = argv(dev, of(dev, "Deployment")["tokenbus-worker"])
    assert flag(args, "--engine") == "model" and flag(args, "--tensor-parallel-size") == "1"
    assert re.fullmatch(f"[0-9a-f]{{{LENGTH}}}", config(dev, "tokenbus-model")["TB_MODEL_REVISION"])


# -- every service ---------------------------------------------------------------------------------------------

def probe_port(docs: list[dict], deployment: dict) -> int:
    """The port the service serves its probes on, from its own flags."""
    args = argv(docs, deployment)
    name = {"gateway": "--port", "recorder": "--metrics-port"}.get(role(deployment), "--health-port")
    return int(flag(args, name))


def test_every_deployment_has_both_probes_on_its_health_port(docs):
    """Readiness is /readyz; liveness /healthz, the gateway's /livez (its /healthz is 503 while no worker is
    registered, which no restart mends)."""
    for name, d in of(docs, "Deployment").items():
        c = container(d)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        alive = "/livez" if role(d) == "gateway" else "/healthz"
        for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", alive)):
            get = c[probe]["httpGet"]
            assert get["path"] == path and ports[get["port"]] == probe_port(docs, d), (name, probe)
        if role(d) != "gateway":
            assert flag(argv(docs, d), "--health-host" if role(d) != "recorder" else "--metrics-host") == "0.0.0.0"


def test_every_grace_period_covers_the_drain_timeout(docs):
    for name, d in of(docs, "Deployment").items():
        drain = float(flag(argv(docs, d), "--drain-timeout"))
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 30, name


def test_each_service_mounts_only_its_own_role_s_seed(docs):
    for name, d in of(docs, "Deployment").items():
        spec, c, r = d["spec"]["template"]["spec"], container(d), role(d)
        assert r in roles.ROLES
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        seeds = {v: s for v, s in secrets.items() if s.startswith("tokenbus-nats-")}
        assert list(seeds.values()) == [f"tokenbus-nats-{r}"], name
        (mount,) = [m for m in c["volumeMounts"] if m["name"] in seeds]
        creds = {e["name"]: e.get("value") for e in c["env"]}["TOKENBUS_NATS_CREDS"]
        assert creds == f"{mount['mountPath']}/{r}.nk" and mount["readOnly"], name
        assert not any("secretRef" in ref for ref in c.get("envFrom", [])), name


def test_every_command_is_accepted_by_its_service_s_parser(docs):
    for name, d in of(docs, "Deployment").items():
        args = argv(docs, d)
        assert args[:2] == ["python", "-m"], name
        parser = importlib.import_module(PARSERS[args[2]]).parser()
        parser.exit_on_error = False
        try:
            parser.parse_args(args[3:])
        except (argparse.ArgumentError, SystemExit) as e:
            pytest.fail(f"{name}: {' '.join(args)}: {e}")
        with pytest.raises((argparse.ArgumentError, SystemExit)), contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args([*args[3:], "--no-such-flag"])


# -- production, from the plan ----------------------------------------------------------------------------------

def in_flight(plan: dict) -> float:
    """Requests in flight across the fleet at the peak (Little's law): the peak rate × a request's time, its first
    token and then a step per further token."""
    node, w = plan["node"], plan["workload"]
    return w["peak_rps"] * (node["ttft_s"] + (w["output_tokens"] - 1) * node["step_s"])


def mean_nodes(plan: dict) -> int:
    return math.ceil(plan["gpu_hours_per_day"]["following_the_load"] / (plan["tp"] * 24))


def test_production_workers_are_the_plan_s_nodes(production, plan):
    worker = of(production, "Deployment")["tokenbus-worker"]
    c, nodes = container(worker), plan["nodes_at_peak"]
    assert worker["spec"]["replicas"] == nodes
    assert c["resources"]["limits"]["nvidia.com/gpu"] == plan["tp"] == 8
    args = argv(production, worker)
    assert int(flag(args, "--tensor-parallel-size")) == plan["tp"]
    assert plan["node"]["batch"] <= int(flag(args, "--max-num-seqs")) <= plan["concurrency_full_context"]
    assert config(production, "tokenbus-model")["TB_MODEL"] == "llama-3-70b"
    scaled = of(production, "ScaledObject")["tokenbus-worker"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "tokenbus-worker"
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (mean_nodes(plan), nodes)
    (prometheus,) = [t for t in scaled["triggers"] if t["type"] == "prometheus"]
    assert int(prometheus["metadata"]["threshold"]) == round(in_flight(plan) / nodes)


def test_the_workers_scale_on_the_router_s_lag_in_every_partition(docs):
    scaled = of(docs, "ScaledObject")
    if not scaled:
        pytest.skip("this overlay does not autoscale")
    partitions = int(config(docs, "tokenbus-config")["TB_BUS_PARTITIONS"])
    triggers = [t["metadata"] for t in scaled["tokenbus-worker"]["spec"]["triggers"] if t["type"] == "nats-jetstream"]
    assert sorted(t["stream"] for t in triggers) == [subjects.stream(subjects.REQUESTS_STREAM, p)
                                                      for p in subjects.parts(partitions)]
    for t in triggers:                                     # what KEDA's parser needs (nats_jetstream_scaler.go)
        assert t["consumer"] == subjects.ROUTER_DURABLE and t["account"] == "$G" and int(t["lagThreshold"]) > 0
        assert t["natsServerMonitoringEndpoint"] == f"{HEADLESS}:{VALUES['config']['monitor']['port']}"


def test_the_worker_trigger_reads_gauges_the_gateway_exports(production):
    """The Prometheus trigger's series are the per-worker gauges of the gateway's /metrics (from the heartbeats)."""
    from services.gateway import metrics

    promql = pytest.importorskip("promql_parser")
    exported = {name for name, kind, _ in metrics.WORKER_METRICS.values() if kind == "gauge"}
    (trigger,) = [t for t in of(production, "ScaledObject")["tokenbus-worker"]["spec"]["triggers"]
                  if t["type"] == "prometheus"]
    promql.parse(trigger["metadata"]["query"])
    assert set(re.findall(r"tokenbus_\w+", trigger["metadata"]["query"])) <= exported


def test_the_gateway_hpa_reads_the_gateway_s_connection_gauge(production):
    from services.gateway import metrics

    (metric,) = of(production, "HorizontalPodAutoscaler")["tokenbus-gateway"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] in metrics.Metrics().registry._names_to_collectors


def test_production_gateways_tokenizers_and_routers_are_the_plan_s_cores(production, plan):
    cores, peak = plan["bus"]["cores_at_target"], plan["workload"]["peak_factor"]
    deployments, hpas = of(production, "Deployment"), of(production, "HorizontalPodAutoscaler")
    for r in ("gateway", "tokenizer", "router"):
        d, hpa = deployments[f"tokenbus-{r}"], hpas[f"tokenbus-{r}"]["spec"]
        assert container(d)["resources"]["requests"]["cpu"] == "1"      # one process, one core
        assert d["spec"]["replicas"] == hpa["maxReplicas"] == math.ceil(cores[r]), r
        assert hpa["minReplicas"] == math.ceil(cores[r] / peak), r
    (metric,) = hpas["tokenbus-gateway"]["spec"]["metrics"]
    gateways = deployments["tokenbus-gateway"]["spec"]["replicas"]
    assert int(metric["pods"]["target"]["averageValue"]) == round(in_flight(plan) / gateways)


def test_production_bus_is_the_plan_s_servers_and_partitions(production, dev, plan):
    bus = plan["bus"]
    cluster = PRODUCTION_VALUES["config"]["cluster"]["replicas"]
    assert cluster == bus["nats_servers"]
    assert PRODUCTION_VALUES["config"]["merge"]["server_tags"] == [f"tb-p{p}" for p in range(bus["bus_partitions"])]
    assert PRODUCTION_VALUES["container"]["resources"]["requests"]["cpu"] == str(bus["server_cores"])
    assert config(production, "tokenbus-config")["TB_BUS_PARTITIONS"] == str(bus["bus_partitions"])
    assert config(dev, "tokenbus-config")["TB_BUS_PARTITIONS"] == "1"
    for docs, values in ((dev, VALUES), (production, merged(VALUES, PRODUCTION_VALUES))):
        settings, servers = config(docs, "tokenbus-config"), values["config"]["cluster"]["replicas"]
        assert settings["TB_NATS_URL"].split(",") == [f"nats://nats-{i}.{HEADLESS}:4222" for i in range(servers)]
        store = gibibytes(values["config"]["jetstream"]["fileStore"]["pvc"]["size"])
        assert int(settings["TB_BUS_STORAGE"]) == servers * store // 2 // 3   # half the store; three replicas


def gibibytes(size: str) -> int:
    assert size.endswith("Gi"), size
    return int(size[:-2]) << 30


def merged(base: dict, over: dict) -> dict:
    """Helm's merge of two values files: maps deep, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# -- the NATS chart's values ------------------------------------------------------------------------------------

FREE = ("merge", "patch")           # the chart's passthroughs: what they hold is nats-server's or Kubernetes'


def unknown(values: dict, chart: dict, path: str = "") -> list[str]:
    """The key paths of values that the chart's values.yaml does not have; a map the chart leaves empty ({},
    e.g. container.resources) and a passthrough take anything."""
    out = []
    for k, v in values.items():
        where = f"{path}.{k}".lstrip(".")
        if k not in chart:
            out.append(where)
        elif isinstance(v, dict) and chart[k] != {} and k not in FREE:
            out += unknown(v, chart[k] or {}, where)
    return out


def test_the_nats_values_use_only_the_chart_s_keys():
    assert unknown(VALUES, CHART) == [] and unknown(PRODUCTION_VALUES, CHART) == []
    assert unknown({"config": {"jetstream": {"filestore": {}}}}, CHART) == ["config.jetstream.filestore"]
    c = VALUES["config"]
    assert c["cluster"]["enabled"] and c["cluster"]["replicas"] == 3 and c["monitor"]["enabled"]
    store = c["jetstream"]["fileStore"]
    assert c["jetstream"]["enabled"] and store["enabled"] and store["pvc"]["enabled"]


def test_the_auth_secret_is_mounted_where_the_config_includes_it_and_the_reloader_watches():
    """nats.conf is /etc/nats-config/nats.conf in the chart; its reloader mounts what the server mounts under /etc/."""
    (mount,) = [p["value"] for p in VALUES["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    (volume,) = [p["value"] for p in VALUES["podTemplate"]["patch"] if p["path"] == "/spec/volumes/-"]
    assert mount["name"] == volume["name"] and volume["secret"]["secretName"] == "tokenbus-nats-auth"
    included = Path("/etc/nats-config") / VALUES["config"]["merge"]["$include"]
    assert included.resolve() == Path(mount["mountPath"]) / "tokenbus.conf"
    assert any(mount["mountPath"].startswith(p) for p in CHART["reloader"]["natsVolumeMountPrefixes"])


@pytest.mark.parametrize("production_bus", [False, True])
def test_nats_server_accepts_what_the_values_add_with_bus_config_s_output(tmp_path, production_bus):
    """The server config the chart writes from these values (its keys as JSON, `$include` as an include
    directive), trimmed to what the values add, with `tokenbus bus-config`'s output in the Secret's place."""
    from ops import bus
    from ops.procs import nats_server_binary

    try:
        server = nats_server_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    values = merged(VALUES, PRODUCTION_VALUES) if production_bus else VALUES
    c = values["config"]
    partitions = len(c["merge"].get("server_tags", [])) or 1
    (tmp_path / "etc" / "tokenbus-auth").mkdir(parents=True)
    (tmp_path / "etc" / "tokenbus-auth" / "tokenbus.conf").write_text(bus.config(tmp_path / "creds", None, partitions))
    top = {k: v for k, v in c["merge"].items() if k != "$include"}
    conf = {**top, "port": 4222, "http_port": c["monitor"]["port"], "server_name": "nats-0",
            "jetstream": {"store_dir": str(tmp_path / "js"), **c["jetstream"]["merge"]},
            "cluster": {"name": "nats", "port": 6222, "routes": ["nats://nats-1.nats-headless:6222"],
                        **c["cluster"]["merge"]}}
    text = json.dumps(conf, indent=2)[:-1] + f'  include {c["merge"]["$include"]};\n}}\n'
    (tmp_path / "etc" / "nats-config").mkdir()
    (tmp_path / "etc" / "nats-config" / "nats.conf").write_text(text)
    out = subprocess.run([server, "-t", "-c", str(tmp_path / "etc" / "nats-config" / "nats.conf")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "is valid" in out.stdout + out.stderr, out.stdout + out.stderr
