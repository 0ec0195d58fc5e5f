"""The observability files (ops/observability/, docs/observability.md): Grafana's dashboard and provisioning and
Prometheus's config and rules parse; every PromQL expression parses with a real PromQL parser; every metric they
name is one that a live stack's gateway or recorder exposes on /metrics (its gateway's bus series say that
the stages' consumers have nothing left after the requests); the SLO lines and burn-rate alerts are
ops/plan.py's SLOs in the SRE workbook's windows; compose.yaml's observability services mount files that exist
and scrape the ports the gateway and recorder serve."""
import inspect
import json
import re
import time
import urllib.request
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ops.plan import Plan
from ops.procs import free_port
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, get, post, running

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "ops" / "observability"
DASHBOARD = OBS / "grafana" / "tokenbus.json"
PROVISIONING = OBS / "grafana" / "provisioning"
RULES = OBS / "alerts.yml"
PROMETHEUS = OBS / "prometheus.yml"
GRAFANA_VARIABLES = {"$__rate_interval": "5m"}     # what Grafana puts in place of its variables before a query
PROMETHEUS_OWN = {"up"}                            # the series Prometheus makes of each scrape, not a target's
BURN = {"1h": ("5m", 14.4), "6h": ("30m", 6.0), "3d": ("6h", 1.0)}   # long window: short window, burn rate
OBJECTIVE = 0.99                                   # each latency SLO met by 99% of requests (alerts.yml)


def panels(items: list[dict]) -> list[dict]:
    """Every panel of the dashboard, those inside rows included."""
    return [q for p in items for q in (p, *panels(p.get("panels", [])))]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query, with Grafana's variables replaced."""
    found = []
    for panel in panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found.append((panel["title"], expr))
    return found


def rules() -> list[dict]:
    return [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every expression, the dashboard's and the rules'."""
    return [*dashboard_exprs(), *((r.get("record") or r["alert"], r["expr"]) for r in rules())]


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    found = []
    promql_parser.walk(promql_parser.parse(expr),
                       lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector) else None)
    return found


def referenced() -> dict[str, set[str]]:
    """The metric names the expressions read (recording rules' names and Prometheus's own aside) → where."""
    names: dict[str, set[str]] = {}
    for where, expr in exprs():
        for s in selectors(expr):
            assert s.name, f"{where}: a selector without a metric name: {expr}"
            if s.name not in recorded() and s.name not in PROMETHEUS_OWN:
                names.setdefault(s.name, set()).add(where)
    return names


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_the_dashboard_provisioning_config_and_rules_parse_and_every_expression_is_promql():
    doc = dashboard()
    assert doc["uid"] and doc["title"] and len(dashboard_exprs()) >= 20
    ids = [p["id"] for p in panels(doc["panels"])]
    assert len(ids) == len(set(ids))
    for path in [PROMETHEUS, RULES, *PROVISIONING.rglob("*.yml")]:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    with pytest.raises(ValueError):                            # the parser refuses what is not PromQL
        promql_parser.parse("sum(rate(tokenbus_requests_total[5m])")
    for where, expr in exprs():
        try:
            promql_parser.parse(expr)
        except ValueError as e:
            pytest.fail(f"{where}: {e}: {expr}")
    for rule in rules():
        assert ("record" in rule) != ("alert" in rule), rule
        if "record" in rule:
            assert re.fullmatch(r"tokenbus:\w+:\w+", rule["record"]), rule["record"]   # level:metric:operations
        else:
            assert rule["labels"]["severity"] in ("page", "ticket") and rule["annotations"]["summary"], rule
    used = {s.name for _, expr in exprs() for s in selectors(expr) if ":" in s.name}
    assert used <= recorded(), f"recording rules read but not recorded: {used - recorded()}"


def test_slo_lines_and_burn_rate_alerts_are_the_plans_slos_in_the_workbooks_windows():
    defaults = inspect.signature(Plan).parameters
    slo = {"ttft": defaults["ttft_slo"].default, "tpot": defaults["tpot_slo"].default}
    lines = {}
    for panel in panels(dashboard()["panels"]):
        steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
        lines[panel["title"]] = [s["value"] for s in steps if s["value"] is not None]
    assert lines["Time to first token"] == [slo["ttft"]] and lines["Time per output token"] == [slo["tpot"]]
    budget = round(1 - OBJECTIVE, 6)
    assert {14.4, 6} <= set(lines["SLO error budget burn rate"])
    by_name = {r["record"]: r["expr"] for r in rules() if "record" in r}
    for name, expr in by_name.items():
        if name.startswith("tokenbus:ttft_slo_errors:"):   # the 700 ms line between two bucket bounds, linearly
            terms = {float(le): float(k) for k, le in re.findall(
                r"([\d.]+) \* sum\(rate\(tokenbus_time_to_first_token_seconds_bucket\{le=\"([\d.]+)\"\}", expr)}
            (lo, k_lo), (hi, k_hi) = sorted(terms.items())
            assert lo < slo["ttft"] < hi and k_hi == pytest.approx((slo["ttft"] - lo) / (hi - lo)), expr
            assert k_lo == pytest.approx(1 - k_hi), expr
        if name.startswith("tokenbus:tpot_slo_errors:"):
            assert f'tokenbus_time_per_output_token_seconds_bucket{{le="{slo["tpot"]}"}}' in expr, expr
    alerts = [r for r in rules() if "alert" in r and "slo" in r["labels"]]
    seen = set()
    for rule in alerts:
        windows = re.findall(rf"tokenbus:{rule['labels']['slo']}_slo_errors:ratio_rate(\w+) > ([\d.]+) \* ([\d.]+)",
                             rule["expr"])
        assert len(windows) == 2, rule["expr"]
        (long, rate, b1), (short, rate2, b2) = windows
        assert BURN[long] == (short, float(rate)) and rate == rate2 and float(b1) == float(b2) == budget, rule
        assert rule["labels"]["severity"] == ("ticket" if float(rate) == 1 else "page"), rule
        seen.add((rule["labels"]["slo"], long))
    assert seen == {(s, w) for s in slo for w in BURN}
    windows = {*BURN, *(short for short, _ in BURN.values())}
    assert recorded() >= {f"tokenbus:{s}_slo_errors:ratio_rate{w}" for s in slo for w in windows}


def test_compose_observability_services_mount_files_that_exist_and_scrape_the_served_ports():
    services = compose()["services"]
    mounted = {}
    for name in ("prometheus", "grafana"):
        service = services[name]
        assert service["profiles"] == ["observability"] and "healthcheck" in service
        assert all(p.startswith("127.0.0.1:") for p in service["ports"]), service["ports"]   # loopback only
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (ROOT / source).exists(), volume
                mounted[target] = ROOT / source
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert mounted["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    assert [mounted[f] for f in config["rule_files"]] == [RULES]
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "tokenbus.yml").read_text())["providers"][0]
    assert mounted[f"{provider['options']['path']}/tokenbus.json"] == DASHBOARD
    assert mounted["/etc/grafana/provisioning"] == PROVISIONING
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    [source] = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and services["prometheus"]["ports"][0].endswith(":9090")
    assert {t["datasource"]["uid"] for p in panels(dashboard()["panels"]) for t in p.get("targets", [])} == {
        source["uid"]}
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in config["scrape_configs"]}
    gateway, recorder = services["gateway"]["command"], services["recorder"]["command"]
    assert jobs["tokenbus-gateway"]["names"] == ["gateway"]
    assert str(jobs["tokenbus-gateway"]["port"]) == gateway[gateway.index("--port") + 1]
    assert jobs["tokenbus-recorder"]["names"] == ["recorder"]
    assert str(jobs["tokenbus-recorder"]["port"]) == recorder[recorder.index("--metrics-port") + 1]
    assert recorder[recorder.index("--metrics-host") + 1] == "0.0.0.0"


def scrape(url: str) -> tuple[set[str], dict[str, set[float]]]:
    """The metric names a /metrics page exposes (a histogram's _bucket, _sum and _count; a family without
    samples by its TYPE line) and each histogram's bucket bounds."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    names, bounds = set(), {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names |= {name, *((f"{name}_bucket", f"{name}_sum", f"{name}_count") if kind == "histogram" else ())}
    names |= set(re.findall(r"^([a-zA-Z_:][\w:]*)[{ ]", text, re.M))
    for name, le in re.findall(r'^(\w+)_bucket\{.*?le="([^"]+)"', text, re.M):
        bounds.setdefault(name, set()).add(float(le))
    return names, bounds


def bus_series(url: str) -> dict[tuple[str, str, str], float]:
    """(name, stream, consumer) → value of the tokenbus_stream_* and tokenbus_consumer_* samples a /metrics page
    exposes (consumer "" for a stream's)."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {(s.name, s.labels["stream"], s.labels.get("consumer", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(("tokenbus_stream_", "tokenbus_consumer_"))}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_metric_named_is_one_a_live_gateway_or_recorder_exposes(tiny_model, tmp_path):
    stack = Stack(tiny_model, free_port(), tmp_path, nats_port=free_port(), workers=1,
                  worker_args=[*WORKER_ARGS, "--speculative", "ngram:2"],    # its tokenbus_spec_decode_* series
                  recorder_port=free_port())
    with running(stack):
        status, models = get(f"{stack.http}/v1/models")
        assert status == 200, models
        for prompt in ("one two three one two three one two", "hello"):
            status, body = post(f"{stack.http}/v1/completions", {"model": models["data"][0]["id"], "prompt": prompt,
                                                                  "max_tokens": 6, "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 6, body
        deadline = time.monotonic() + 60              # a heartbeat after the requests (every 0.5 s), read in time
        while True:
            gateway, buckets = scrape(f"{stack.http}/metrics")
            if "tokenbus_spec_decode_k" in gateway or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        recorder, _ = scrape(f"http://127.0.0.1:{stack.recorder_port}/metrics")
        bus = bus_series(f"{stack.http}/metrics")
    assert "tokenbus_time_to_first_token_seconds_bucket" in gateway, sorted(gateway)
    assert "tokenbus_spec_decode_k" in gateway, sorted(gateway)
    held = {stream: v for (name, stream, _), v in bus.items() if name == "tokenbus_stream_messages"}
    assert held.keys() == {"TB_REQUESTS", "TB_ROUTE", "TB_WORK", "TB_RESULTS", "TB_USAGE", "TB_DEAD"}, held
    assert held["TB_REQUESTS"] >= 2 and held["TB_DEAD"] == 0, held
    lag = {(stream, consumer): v for (name, stream, consumer), v in bus.items()
           if name == "tokenbus_consumer_pending_messages"}
    [worker] = [c for stream, c in lag if stream == "TB_WORK"]               # the one live worker's
    assert worker.startswith("worker-") and lag.keys() >= {("TB_REQUESTS", "router"), ("TB_ROUTE", "router"),
                                                           ("TB_USAGE", "recorder"), ("TB_RESULTS", "recorder")}
    assert not any(lag.values()), lag                                       # everything delivered
    assert "tokenbus_recorder_backlog_records" in recorder
    missing = {name: sorted(where) for name, where in referenced().items() if name not in gateway | recorder}
    assert not missing, f"metrics named but not on /metrics: {missing}"
    for where, expr in exprs():                               # an `le` named is a bucket bound of its histogram
        for s in selectors(expr):
            for m in s.matchers.matchers:
                if m.name == "le":
                    assert float(m.value) in buckets[s.name.removesuffix("_bucket")], (where, expr)
