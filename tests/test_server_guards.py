"""The server's guards, as clients see them: the API key and the 429s of an overloaded
queue (a real `python server.py` process), a bounded schemathesis fuzz run (another),
and two faults that need the engine's insides, injected into an in-process server: one
request failing in detokenisation, a whole step failing."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from test_server import GREEDY, MODEL, MODEL_ID, SMALL_ENGINE, assert_openai_error, running_server, sample_value, sse_events

API_KEY = "sesame"


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    """API key, at most one request waiting (two run: SMALL_ENGINE's)."""
    yield from running_server(tmp_path_factory, "guarded", *SMALL_ENGINE, "--api-key", API_KEY, "--max-waiting", "1")


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    # at most 32 generated tokens a request and a 1 s request timeout: the fuzzer's long
    # generations stay short (its cases test validation, not generation; n x 16, the
    # default max_tokens, still fits, and each case gets the status it got from a server
    # of 48-token contexts); the engine's options are the other servers', so its
    # programs load from the compilation cache
    yield from running_server(
        tmp_path_factory, "fuzz", *SMALL_ENGINE, "--request-timeout", "1", "--max-request-tokens", "32",
    )


# ----- API key and overload -----------------------------------------------------------------


def test_api_key_guards_all_but_health(guarded_server):
    url = guarded_server.url
    body = {"prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = assert_openai_error(httpx.post(url + "/v1/completions", json=body, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(url + "/v1/models"), 401)
    assert_openai_error(httpx.post(url + "/v1/completions", content=b"{oops"), 401)  # the key before the body
    assert httpx.get(url + "/health").status_code == 200
    # /metrics would tell anyone how often other users' prompts hit the prefix cache
    assert_openai_error(httpx.get(url + "/metrics"), 401)
    assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(model=MODEL_ID, prompt="Hi")
    keyed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert keyed.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=3).usage.completion_tokens == 3


def test_overload_answers_429_at_once(guarded_server):
    """With two requests running and one waiting (the guarded server's limits), further
    requests get 429 without waiting for room: each 429 arrives before either running
    stream has finished its 300 tokens (an ordering of events, not a wall-clock bound,
    so a loaded machine cannot fail it). The waiting request's own length is moot."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = dict(prompt="Once upon a time", max_tokens=300, ignore_eos=True, **GREEDY)
    started, finished = {"running 0": threading.Event(), "running 1": threading.Event()}, {}

    def stream(name, max_tokens=300):
        with httpx.stream("POST", guarded_server.url + "/v1/completions", json={**body, "stream": True,
                          "max_tokens": max_tokens}, headers=headers, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and name in started:
                    started[name].set()
        finished[name] = time.monotonic()

    def metric(name):
        return sample_value(httpx.get(guarded_server.url + "/metrics", headers=headers).text, name)

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        running = [pool.submit(stream, name) for name in started]
        assert all(event.wait(60) for event in started.values()), "a running stream sent nothing"
        assert metric("jaxmtp_requests_running") == 2
        waiting = pool.submit(stream, "waiting", 8)
        deadline = time.monotonic() + 60
        while metric("jaxmtp_requests_waiting") != 1:
            assert time.monotonic() < deadline, "the third stream never waited"
            time.sleep(0.01)

        def post(_):
            response = httpx.post(guarded_server.url + "/v1/completions", json=body, headers=headers, timeout=120)
            return response, time.monotonic()

        refused = list(pool.map(post, range(4)))
        [future.result() for future in (*running, waiting)]
    for response, answered in refused:
        assert assert_openai_error(response, 429)["type"] == "rate_limit_error"
        assert answered < min(finished["running 0"], finished["running 1"])


# ----- faults inside the engine (in-process server) -----------------------------------------


@pytest.fixture(scope="module")
def inprocess():
    from fastapi.testclient import TestClient

    from jaxmtp.engine.llm_engine import LLMEngine
    from jaxmtp.server import create_app

    engine = LLMEngine(MODEL, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=8)
    with TestClient(create_app(engine, str(MODEL))) as http:
        yield engine, http


def wait_all_pages_free(engine, timeout=3.0) -> bool:
    deadline = time.monotonic() + timeout
    while engine.allocator.num_free != engine.allocator.num_pages and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.allocator.num_free == engine.allocator.num_pages


def test_a_request_failing_inside_the_engine_gets_500_and_others_go_on(inprocess, monkeypatch):
    engine, http = inprocess
    add_text = engine.output_processor._add_text

    def exploding_add_text(seq, token):
        if "boom" in seq.params.stop:
            raise RuntimeError("detokeniser exploded")
        return add_text(seq, token)

    monkeypatch.setattr(engine.output_processor, "_add_text", exploding_add_text)
    good = dict(prompt="Once upon a time", max_tokens=30, **GREEDY)
    bad = {**good, "stop": ["boom"]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ok, failed = pool.map(lambda body: http.post("/v1/completions", json=body), [good, bad])
    assert "detokeniser exploded" in assert_openai_error(failed, 500)["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 30

    with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    assert "detokeniser exploded" in json.loads(events[-2])["error"]["message"]
    assert wait_all_pages_free(engine)


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(inprocess, monkeypatch):
    engine, http = inprocess
    schedule = engine.scheduler.schedule
    failures = [RuntimeError("device fell over")]

    def schedule_failing_once():
        if failures:
            raise failures.pop()
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_failing_once)
    body = dict(prompt="Once upon a time", max_tokens=10, **GREEDY)
    assert "engine step failed" in assert_openai_error(http.post("/v1/completions", json=body), 500)["message"]
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith(", there was")
    assert wait_all_pages_free(engine)


# ----- schema fuzzing -----------------------------------------------------------------------


def test_schema_fuzzing_finds_no_server_error(fuzz_server, tmp_path):
    """Schemathesis cases (valid and invalid bodies, six per operation and kind: thirty-six
    and more) against a server whose requests generate at most 32 tokens and time out
    after 1 s, so that long generations stay cheap."""
    result = subprocess.run(
        [
            sys.executable, "-m", "schemathesis.cli", "run", fuzz_server.url + "/openapi.json",
            "--checks", "not_a_server_error", "--max-examples", "6", "--seed", "1",
            "--generation-database", "none", "--request-timeout", "20", "--no-color",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    generated = int(re.search(r"(\d+) generated", result.stdout).group(1))
    assert generated >= 36, result.stdout[-2000:]
