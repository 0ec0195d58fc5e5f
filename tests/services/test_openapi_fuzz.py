"""schemathesis against /openapi.json: at least 50 generated requests per operation (valid and
invalid ones), each answered without a 5xx, in the documented status codes, content types and
shapes; and the gateway still serves afterwards. The pipeline is the scripted fake."""
import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from tokenizers import Tokenizer

from ops.procs import free_port, start_nats, stop
from tests.services.fake_pipeline import said, served

KEY = "sk-fuzz"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
OPERATIONS = [("POST", "/v1/chat/completions", "positive"), ("POST", "/v1/chat/completions", "negative"),
              ("POST", "/v1/completions", "positive"), ("POST", "/v1/completions", "negative"),
              ("GET", "/v1/models", "positive"), ("GET", "/v1/models/{model}", "positive"),
              ("GET", "/healthz", "positive"), ("GET", "/health", "positive")]


async def script(down, req):
    """A short fixed answer, whatever was asked (generated prompts can be long)."""
    await down.reply(req, " fine" if said(req) != "" else " empty")


@pytest.fixture(scope="module")
def gateway_url(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    nats = start_nats(port, tmp / "nats")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY: {"tenant": "fuzz"}}))
    try:
        tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
        with served(f"nats://127.0.0.1:{port}", tiny_model, tok, script, api_keys=str(keys)) as down:
            yield down.http
    finally:
        stop([nats])


@pytest.fixture(scope="module")
def api(gateway_url):
    return schemathesis.openapi.from_url(gateway_url + "/openapi.json")


def test_the_document_lists_these_operations(api):
    assert {(op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()} == {
        (m, p) for m, p, _ in OPERATIONS}


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS)
def test_generated_requests_get_no_5xx_and_documented_answers(api, method, path, mode):
    calls = []

    @given(case=api[path][method].as_strategy(GenerationMode(mode)))
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def call(case):
        calls.append(case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, timeout=10, checks=CHECKS))

    call()
    if method == "POST":                          # a GET without parameters has one request to make
        assert len(calls) >= 50


def test_the_gateway_still_serves_after_the_fuzzing(gateway_url):
    with urllib.request.urlopen(gateway_url + "/healthz", timeout=5) as r:
        assert r.status == 200
