"""The server's guards, in-process (one engine for the module, an app per ServerConfig):
per-request limits and int32 bounds, invalid Unicode, Content-Type, the API key on every
path but the probes, health while the engine is unusable or draining, no install paths in
answers, logprobs without a tokenizer, served model names, and an event loop that keeps
answering while a long prompt is tokenised."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import pytest

from conftest import MTP_MODEL, ROOT
from test_server import assert_openai_error

MODEL_ID = "stories260K-mtp"
GREEDY = dict(model=MODEL_ID, temperature=0)
INT32_MAX = 2**31 - 1


@pytest.fixture(scope="module")
def engine():
    from jaxmtp.engine.llm_engine import LLMEngine

    return LLMEngine(
        MTP_MODEL, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=8, enable_prefix_caching=True
    )


@contextlib.contextmanager
def serving(engine, **config):
    from fastapi.testclient import TestClient

    from jaxmtp.server import ServerConfig, create_app

    app = create_app(engine, str(MTP_MODEL), ServerConfig(**config))
    with TestClient(app) as http:
        yield http


@pytest.fixture(scope="module")
def http(engine):
    limits = dict(max_stop_strings=2, max_stop_string_length=8, max_n=4, max_request_tokens=100, max_waiting=6,
                  max_logprob_entries=200)
    with serving(engine, **limits) as http:
        yield http


HI = [{"role": "user", "content": "Hi"}]
LIMITED = [
    # path, body, param, a piece of the message
    ("completions", {"prompt": "Hi", "stop": ["a", "b", "c"]}, "stop", "at most 2 stop strings"),
    ("completions", {"prompt": "Hi", "stop": "123456789"}, "stop", "at most 8 characters"),
    ("completions", {"prompt": "Hi", "n": 5}, "n", "n must be <= 4"),
    ("chat/completions", {"messages": HI, "n": 5}, "n", "n must be <= 4"),
    ("completions", {"prompt": "Hi", "temperature": 2.5}, "temperature", "temperature must be <= 2"),
    ("completions", {"prompt": "Hi", "n": 4, "max_tokens": 26}, "max_tokens", "n x max_tokens = 4 x 26"),
    ("chat/completions", {"messages": HI, "max_completion_tokens": 101}, "max_completion_tokens", "exceeds"),
    # logprob entries past max_logprob_entries: n x (prompt tokens x (prompt_logprobs + 1) + max_tokens x (logprobs + 1))
    ("completions", {"prompt": [1] * 20, "n": 2, "max_tokens": 1, "prompt_logprobs": 9}, "prompt_logprobs",
     "returns 400 logprob entries"),
    ("completions", {"prompt": [1] * 20, "max_tokens": 1, "echo": True, "logprobs": 9}, "prompt_logprobs",
     "returns 210 logprob entries"),
    ("completions", {"prompt": "Hi", "n": 2, "max_tokens": 26, "logprobs": 3}, "logprobs", "returns 208 logprob"),
    ("chat/completions", {"messages": HI, "max_tokens": 51, "logprobs": True, "top_logprobs": 3}, "logprobs",
     "returns 204 logprob entries"),
    # more choices than the waiting queue holds can never be admitted: 400, not "retry later"
    ("completions", {"prompt": ["a", "b"], "n": 4, "max_tokens": 2}, "n", "can never be admitted"),
    # values the device's int32 arrays cannot hold
    ("completions", {"prompt": "Hi", "top_k": 2**31}, "top_k", "less than or equal to 2147483647"),
    ("completions", {"prompt": "Hi", "max_tokens": 2**31}, "max_tokens", "less than or equal to 2147483647"),
    ("completions", {"prompt": "Hi", "logprobs": 2**31}, "logprobs", "less than or equal to 2147483647"),
    ("completions", {"prompt": [1, 2**31]}, "prompt", "less than or equal to 2147483647"),
    ("completions", {"prompt": [[1, -1]]}, "prompt", "greater than or equal to 0"),
    ("chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "<= 20"),
    # seed + j for choice j would pass 2**63: the error names the field the client sent
    ("completions", {"prompt": "Hi", "seed": 2**63 - 2, "n": 3, "max_tokens": 2}, "seed", "seed + j"),
    # a lone surrogate is no text: no tokenizer can encode it
    ("completions", {"prompt": "Hi \ud800"}, "prompt", "lone surrogate '\\ud800' at character 3"),
    ("completions", {"prompt": ["fine", "\udfff"]}, "prompt", "lone surrogate"),
    ("completions", {"prompt": "Hi", "stop": ["\ud800"]}, "stop", "lone surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi \ud800"}]}, "messages", "lone surrogate"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages", "lone surrogate"),
]


@pytest.mark.parametrize("path, body, param, message", LIMITED)
def test_limits_and_bounds_get_a_400_naming_the_field(http, path, body, param, message):
    content = json.dumps({**body, "model": MODEL_ID})  # ASCII: JSON's "\ud800" escapes, as clients send them
    response = http.post(f"/v1/{path}", content=content, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["param"] == param, error
    assert message in error["message"], error


def test_json_infinity_and_nan_are_no_numbers(http):
    for field, value in (("temperature", "Infinity"), ("top_p", "NaN"), ("timeout", "Infinity")):
        content = f'{{"prompt": "Hi", "{field}": {value}}}'
        response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
        assert assert_openai_error(response, 400)["param"] == field


def test_the_engine_serves_on_after_refusals(http, engine):
    response = http.post("/v1/completions", json=dict(prompt="Once upon a time", max_tokens=6, seed=3, **GREEDY))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 6
    assert engine.num_waiting == engine.num_running == 0


def test_a_chat_replys_default_length_fits_the_request_token_limit(http):
    response = http.post("/v1/chat/completions", json=dict(messages=HI, n=4, ignore_eos=True, **GREEDY))
    assert response.status_code == 200, response.text
    assert [len(c["message"]["content"]) > 0 for c in response.json()["choices"]] == [True] * 4
    assert response.json()["usage"]["completion_tokens"] == 100  # 4 x (100 // 4)


def test_a_chat_replys_default_length_with_logprobs_fits_the_logprob_entry_limit(http):
    body = dict(messages=HI, logprobs=True, top_logprobs=3, ignore_eos=True, **GREEDY)
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 50  # 200 // (3 + 1)
    assert len(response.json()["choices"][0]["logprobs"]["content"]) == 50


def test_a_body_must_be_sent_as_json(http):
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    for headers, given in (({}, "none was sent"), ({"Content-Type": "text/plain"}, "got 'text/plain'")):
        error = assert_openai_error(http.post("/v1/completions", content=body, headers=headers), 400)
        assert "Content-Type: application/json" in error["message"] and given in error["message"]
    ok = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_no_answer_shows_where_the_model_is_installed(http, engine, monkeypatch):
    models = http.get("/v1/models").json()
    assert models["data"][0]["root"] == MODEL_ID
    monkeypatch.setattr(engine, "tokenizer", None)
    for path, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": HI})):
        error = assert_openai_error(http.post(f"/v1/{path}", json=body), 400)
        assert "tokenizer.json" in error["message"] and str(ROOT) not in error["message"], error


def test_logprobs_without_a_tokenizer_name_token_ids(http, engine, monkeypatch):
    expected = http.post("/v1/completions", json=dict(prompt=[1, 403, 407], max_tokens=4, **GREEDY)).json()
    monkeypatch.setattr(engine, "tokenizer", None)
    monkeypatch.setattr(engine.output_processor, "tokenizer", None)  # which names the tokens in logprobs
    response = http.post("/v1/completions", json=dict(prompt=[1, 403, 407], max_tokens=4, logprobs=2, **GREEDY))
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4 and all(t.startswith("token_id:") for t in logprobs["tokens"])
    assert all(len(top) == 2 and all(t.startswith("token_id:") for t in top) for top in logprobs["top_logprobs"])
    assert expected["usage"] == response.json()["usage"]


def test_served_model_names(engine):
    with serving(engine, served_model_name=["storyteller", "tiny"]) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["storyteller", "tiny"]
        out = http.post("/v1/completions", json=dict(prompt="Hi", max_tokens=2, model="tiny"))
        assert out.status_code == 200 and out.json()["model"] == "tiny"
        out = http.post("/v1/completions", json=dict(prompt="Hi", max_tokens=2))
        assert out.status_code == 200 and out.json()["model"] == "storyteller"
        error = assert_openai_error(http.post("/v1/completions", json=dict(prompt="Hi", model=MODEL_ID)), 404)
        assert error["param"] == "model"


def test_a_non_ascii_api_key_guards_every_path_but_the_probes(engine):
    key = "sésame-ключ"
    good = {"Authorization": f"Bearer {key}".encode()}  # as a client sends it: UTF-8 bytes
    with serving(engine, api_key=key) as http:
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics", "/v1/models"):
            assert assert_openai_error(http.get(path), 401)["code"] == "invalid_api_key", path
            assert http.get(path, headers={"Authorization": "Bearer sésame".encode()}).status_code == 401, path
            assert http.get(path, headers=good).status_code == 200, path
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
    with serving(engine, api_key=key, public_metrics=True) as http:
        assert http.get("/metrics").status_code == 200
        assert http.get("/openapi.json").status_code == 401


def test_each_api_key_has_a_prefix_cache_of_its_own(engine):
    """Cache hits are a side channel (a hit answers faster): a client may reuse only the
    prefixes its own key's requests computed."""
    prompt = "Once upon a time Lily saw a cat. The sun was warm. Tom and his dog played in the big tree."
    body = dict(prompt=prompt, max_tokens=2, **GREEDY)
    stats = engine.stats.prefix_cache

    def hits_of(key):
        before = stats.hits
        response = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return stats.hits - before

    with serving(engine, api_key=["alice", "bob"]) as http:
        assert hits_of("alice") == 0
        assert hits_of("alice") > 0
        assert hits_of("bob") == 0
        assert hits_of("bob") > 0


def test_health_answers_503_while_the_engine_is_unusable_or_draining(engine, monkeypatch):
    with serving(engine) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/health_generate").json() == {"status": "ok"}

        monkeypatch.setattr(engine, "usable", False, raising=False)
        for path in ("/health", "/health_generate"):
            assert "unusable" in assert_openai_error(http.get(path), 503)["message"]
        monkeypatch.undo()

        schedule, failures = engine.scheduler.schedule, [RuntimeError("device fell over")]

        def schedule_failing_once():
            if failures:
                raise failures.pop()
            return schedule()

        monkeypatch.setattr(engine.scheduler, "schedule", schedule_failing_once)
        error = assert_openai_error(http.get("/health_generate"), 503)
        assert "could not generate a token" in error["message"]
        assert http.get("/health_generate").status_code == 200
        monkeypatch.undo()

        http.app.state.server.draining = True
        assert "shutting down" in assert_openai_error(http.get("/health"), 503)["message"]
        response = http.post("/v1/completions", json=dict(prompt="Hi", max_tokens=2))
        assert "shutting down" in assert_openai_error(response, 503)["message"]


def test_a_disconnect_cancels_the_work_cleanly_and_returns_false():
    """finished_before_disconnect once inspected the task it had just cancelled (neither
    done nor cancelled yet): InvalidStateError, and no 499."""
    from jaxmtp.server.serving import finished_before_disconnect

    class GoneClient:
        async def receive(self):
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

    cleaned_up = []

    async def work():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned_up.append(True)  # where a generation aborts its engine requests

    async def finishing_work():
        return None

    async def main():
        assert await finished_before_disconnect(GoneClient(), work()) is False
        assert await finished_before_disconnect(GoneClient(), finishing_work()) is True

    asyncio.run(main())
    assert cleaned_up == [True]


class HealthProbe:
    """Wraps functions so that each call, before it runs, waits until a /health request
    sent as it starts has been answered. Where a call runs on the server's event loop,
    the loop cannot answer while the call waits: the wait ends after LIMIT seconds
    instead, and the call is recorded as one that held the loop."""

    LIMIT = 10.0

    def __init__(self, http):
        self.http = http
        self.answered: list[bool] = []  # per call: /health answered while it waited
        self.probes: list[threading.Thread] = []

    def wrap(self, function):
        def probed(*args, **kwargs):
            done = threading.Event()
            probe = threading.Thread(target=lambda: self.http.get("/health").status_code == 200 and done.set())
            self.probes.append(probe)
            probe.start()
            self.answered.append(done.wait(self.LIMIT))
            return function(*args, **kwargs)
        return probed

    def join(self) -> list[bool]:
        for probe in self.probes:
            probe.join()
        return self.answered


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_prompts_are_tokenised_off_the_event_loop(engine, monkeypatch, path):
    """Tokenisation (a GIL-free tokenizer's, which a long prompt keeps busy) runs off the
    event loop: /health answers while it runs."""
    tokenizer = engine.tokenizer
    body = {"prompt": "Once upon a time"} if path == "completions" else {"messages": HI}
    with serving(engine) as http:
        probe = HealthProbe(http)
        monkeypatch.setattr(tokenizer, "encode", probe.wrap(tokenizer.encode))
        monkeypatch.setattr(tokenizer, "apply_chat_template", probe.wrap(tokenizer.apply_chat_template))
        http.post(f"/v1/{path}", json={**body, "max_tokens": 2, **GREEDY}).raise_for_status()
        answered = probe.join()
    assert answered and all(answered), answered


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_formatted_off_the_event_loop(engine, monkeypatch, stream):
    """Formatting many tokens' logprobs takes a while (n=128 with logprobs=20 once stalled
    /health 2.6 s): it runs off the event loop, and /health answers while it runs."""
    from jaxmtp.server.formatting import CompletionFormat

    body = dict(prompt="Once upon a time", max_tokens=2, logprobs=1, stream=stream, **GREEDY)
    with serving(engine) as http:
        probe = HealthProbe(http)
        monkeypatch.setattr(CompletionFormat, "logprobs_body", probe.wrap(CompletionFormat.logprobs_body))
        http.post("/v1/completions", json=body).raise_for_status()
        answered = probe.join()
    assert answered and all(answered), answered
