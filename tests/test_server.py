"""The OpenAI-compatible server as clients see it: a real `python server.py` process on
this machine, the official openai client, raw HTTP for disconnects and bad input, the
Prometheus metrics. (test_server_guards.py: the API key, overload, schema fuzzing and
faults injected inside the engine.)"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import ROOT

MODEL = ROOT / "checkpoints" / "stories260K-mtp"
MODEL_ID = "stories260K-mtp"
# Few batch shapes (8 tokens x 1/2 requests), so a server compiles its step in seconds
# and its background compilation (every shape, on a core of its own) ends soon. Every
# server of the suite with these options runs the same programs: they load from the
# run's compilation cache (conftest), which the servers here all use.
SMALL_ENGINE = [
    "--max-num-seqs", "2", "--max-num-batched-tokens", "8",
    "--compilation-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"],
]
STARTUP_TIMEOUT = 180
PROMPTS = [
    "Once upon a time", "Lily saw a cat", "The sun was", "Tom and his dog",
    "One day, a little bird", "Mom said", "The big tree", "Sam wanted to",
]
GREEDY = dict(model=MODEL_ID, temperature=0)


# ----- server processes -------------------------------------------------------------------


class ServerProcess:
    def __init__(self, log_path, *args, program: tuple[str, ...] = ("server.py",)):
        """`python server.py args` (program: what python runs instead of server.py)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *program, "--port", str(self.port), *args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"server not healthy after {STARTUP_TIMEOUT} s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def metric(self, name: str, **labels) -> float:
        value = sample_value(httpx.get(self.url + "/metrics").text, name, **labels)
        return 0.0 if value is None else value

    def wait_for_metric(self, name: str, value: float, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while (current := self.metric(name)) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return current


def sample_value(text: str, name: str, **labels) -> float | None:
    """The value of the Prometheus sample `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None


def running_server(tmp_path_factory, name, *args):
    server = ServerProcess(tmp_path_factory.mktemp(name) / "server.log", *args)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory, "main", *SMALL_ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from jaxmtp.loading.tokenizer import Tokenizer

    return Tokenizer(MODEL)


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ----- the openai client ------------------------------------------------------------------


def test_models_lists_the_model_folder(client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    # the path the server was started with names the model too
    out = client.completions.create(model=str(MODEL), prompt="Hi", max_tokens=2)
    assert out.model == MODEL_ID


def test_completion_streamed_equals_non_streamed(client, tokenizer):
    prompt = "Once upon a time"
    full = client.completions.create(prompt=prompt, max_tokens=40, logprobs=0, **GREEDY)
    choice = full.choices[0]
    assert choice.text.startswith(", there was a little girl named Lily.")
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == len(choice.logprobs.tokens) == 40
    assert full.usage.total_tokens == full.usage.prompt_tokens + 40
    spec = choice.model_extra["spec_stats"]
    assert spec["drafted"] >= spec["accepted"] >= 0 and len(spec["accepted_per_position"]) == 2

    chunks = list(client.completions.create(
        prompt=prompt, max_tokens=40, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage

    as_ids = client.completions.create(prompt=tokenizer.encode(prompt), max_tokens=40, **GREEDY)
    assert as_ids.choices[0].text == choice.text


def test_chat_streamed_equals_non_streamed(client, tokenizer):
    messages = [
        {"role": "system", "content": "You tell stories."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me about a cat."}]},
    ]
    full = client.chat.completions.create(messages=messages, max_tokens=32, logprobs=True, top_logprobs=3, **GREEDY)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    as_text = [messages[0], {"role": "user", "content": "Tell me about a cat."}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(as_text, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    assert prompt_ids[0] == 1  # the default template's BOS
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == len(choice.logprobs.content)
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)

    chunks = list(client.chat.completions.create(
        messages=messages, max_tokens=32, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage == full.usage


def test_stop_strings_cut_streams_and_responses_alike(client):
    kwargs = dict(prompt="Once upon a time", max_tokens=40, stop=[" named", "zebra"], **GREEDY)
    full = client.completions.create(**kwargs)
    assert full.choices[0].text == ", there was a little girl"
    assert full.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == full.choices[0].text


def test_several_prompts_and_n_index_their_choices(client, tokenizer):
    prompts = ["Once upon a time", "Lily saw a cat"]
    kwargs = dict(model=MODEL_ID, prompt=prompts, n=2, max_tokens=12, temperature=0.9, seed=7)
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert full.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    streamed = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    # a seeded sample is the same whatever else runs beside it
    assert streamed == {c.index: c.text for c in full.choices}


def test_concurrent_streams_match_their_solo_outputs(client, server):
    """Sixteen streams at once, each prompt twice: two run, the rest queue."""
    solo = {p: client.completions.create(prompt=p, max_tokens=24, **GREEDY).choices[0].text for p in PROMPTS}

    async def stream_one(aclient, prompt):
        text = ""
        async for chunk in await aclient.completions.create(prompt=prompt, max_tokens=24, stream=True, **GREEDY):
            text += chunk.choices[0].text
        return prompt, text

    async def stream_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(stream_one(aclient, PROMPTS[i % len(PROMPTS)]) for i in range(16)))

    results = asyncio.run(stream_all())
    assert [text for _, text in results] == [solo[prompt] for prompt, _ in results]


# ----- disconnects, timeouts, metrics -----------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_the_pages(server):
    aborted = server.metric("jaxmtp_requests_finished_total", finish_reason="abort")
    body = dict(prompt="Once upon a time", max_tokens=400, ignore_eos=True, stream=True, **GREEDY)
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as response:
        events = sse_events(response)  # kept: dropping a half-read iterator closes the stream
        assert json.loads(next(events))["choices"][0]["finish_reason"] is None
        assert json.loads(next(events))["choices"][0]["finish_reason"] is None
        assert server.metric("jaxmtp_kv_pages_used") > 0
    assert server.wait_for_metric("jaxmtp_kv_pages_used", 0, timeout=3) == 0
    assert server.metric("jaxmtp_requests_finished_total", finish_reason="abort") == aborted + 1


def test_timeout_answers_408_or_ends_the_stream_with_abort(server):
    body = dict(prompt="Once upon a time", max_tokens=400, ignore_eos=True, timeout=0.3, **GREEDY)
    error = assert_openai_error(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 408)
    assert error["code"] == "timeout"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert server.wait_for_metric("jaxmtp_kv_pages_used", 0, timeout=3) == 0


def test_metrics_count_tokens_speculation_and_latency(client, server):
    # a request of its own, so that the speculative and finish-reason series exist
    # whichever tests ran before
    client.completions.create(prompt=PROMPTS[0], max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    assert samples and all(sample.labels.get("model_name") == MODEL_ID for sample in samples)
    for name, labels in (
        ("jaxmtp_requests_running", {}), ("jaxmtp_requests_waiting", {}), ("jaxmtp_prompt_tokens_total", {}),
        ("jaxmtp_generation_tokens_total", {}), ("jaxmtp_kv_pages_used", {}), ("jaxmtp_kv_pages_free", {}),
        ("jaxmtp_kv_cache_usage_ratio", {}), ("jaxmtp_preemptions_total", {}), ("jaxmtp_spec_decode_drafts_total", {}),
        ("jaxmtp_spec_decode_draft_tokens_total", {}), ("jaxmtp_spec_decode_accepted_tokens_total", {}),
        ("jaxmtp_spec_decode_accepted_tokens_per_position_total", {"position": "1"}),
        ("jaxmtp_time_to_first_token_seconds_count", {}), ("jaxmtp_inter_token_latency_seconds_count", {}),
        ("jaxmtp_e2e_request_latency_seconds_count", {}), ("jaxmtp_request_queue_time_seconds_count", {}),
        ("jaxmtp_request_prefill_time_seconds_count", {}), ("jaxmtp_request_decode_time_seconds_count", {}),
        ("jaxmtp_requests_finished_total", {"finish_reason": "length"}),
        ("jaxmtp_prefix_cache_queries_total", {}), ("jaxmtp_prefix_cache_hits_total", {}),
        ("jaxmtp_prefix_cache_hit_rate", {}), ("jaxmtp_prefix_cache_evictions_total", {}),
    ):
        assert sample_value(text, name, **labels) is not None, (name, labels)
    assert server.metric("jaxmtp_generation_tokens_total") > 0
    drafts = server.metric("jaxmtp_spec_decode_drafts_total")
    assert server.metric("jaxmtp_spec_decode_draft_tokens_total") == 2 * drafts > 0  # k = 2 drafts each
    assert server.metric("jaxmtp_spec_decode_accepted_tokens_total") <= 2 * drafts
    assert server.metric("jaxmtp_e2e_request_latency_seconds_count") >= 1


def test_prefix_caching_is_on_by_default(client, server):
    prompt = " ".join(PROMPTS)  # more than two 16-token pages
    before = server.metric("jaxmtp_prefix_cache_hits_total")
    first = client.completions.create(prompt=prompt, max_tokens=8, **GREEDY)
    second = client.completions.create(prompt=prompt, max_tokens=8, **GREEDY)
    assert second.choices[0].text == first.choices[0].text
    assert server.metric("jaxmtp_prefix_cache_hits_total") - before == 32
    queries = server.metric("jaxmtp_prefix_cache_queries_total")
    assert server.metric("jaxmtp_prefix_cache_hit_rate") == pytest.approx(server.metric("jaxmtp_prefix_cache_hits_total") / queries)


# ----- bad input ----------------------------------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [
    # path, body, status, param, a piece of the message
    ("completions", {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": 5}, 400, "prompt", "prompt"),
    ("completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("chat/completions", {"messages": "Hi"}, 400, "messages", "valid list"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages", "role"),
    ("completions", {"prompt": "Hi", "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("chat/completions", {"messages": HI, "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("completions", {"prompt": ""}, 400, "prompt", "prompt is empty"),
    ("completions", {"prompt": []}, 400, "prompt", "prompt is empty"),
    ("completions", {"prompt": [[1], []]}, 400, "prompt", "prompt is empty"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("completions", {"prompt": [1] * 600}, 400, "prompt", "exceeds the model's context of 512"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi " * 600}]}, 400, "messages", "exceeds the model"),
    ("completions", {"prompt": [1, 5000]}, 400, "prompt", "out of vocabulary"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1 (0 only with echo)"),
    ("chat/completions", {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens", "greater than"),
    ("completions", {"prompt": "Hi", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ("completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("chat/completions", {"messages": HI, "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("completions", {"prompt": "Hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("completions", {"prompt": "Hi", "stop": [""]}, 400, "stop", "stop must be"),
    ("completions", {"prompt": "Hi", "logprobs": 50}, 400, "logprobs", "logprobs must be <= 20"),
    ("chat/completions", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", "logprobs: true"),
]


@pytest.mark.parametrize("path, body, status, param, message", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error(server, path, body, status, param, message):
    error = assert_openai_error(httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30), status)
    assert error["param"] == param
    assert message in error["message"]


def test_malformed_and_oversized_bodies(server):
    url = server.url + "/v1/completions"
    error = assert_openai_error(httpx.post(url, content=b'{"prompt": "Hi",', headers={"Content-Type": "application/json"}), 400)
    assert error["message"].startswith("invalid JSON")
    assert_openai_error(httpx.post(url, content=b'["Hi"]', headers={"Content-Type": "application/json"}), 400)
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    error = assert_openai_error(httpx.post(url, content=big, headers={"Content-Type": "application/json"}), 413)
    assert error["code"] == "request_too_large"
    # without a Content-Length (chunked), the limit holds while the body streams in
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
    assert_openai_error(httpx.post(url, content=chunks, headers={"Content-Type": "application/json"}), 413)
    assert_openai_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert_openai_error(httpx.get(url), 405)


def test_unknown_fields_are_refused_by_name_and_the_server_still_serves(server, client):
    body = dict(prompt="Once upon a time", max_tokens=5, **GREEDY)
    error = assert_openai_error(httpx.post(server.url + "/v1/completions", json={**body, "best_of": 2}, timeout=30), 400)
    assert error["param"] == "best_of" and "best_of is not a field this server implements" in error["message"]
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser"):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}], tools=[{"type": "function", "function": {"name": "f"}}],
            **GREEDY,
        )
    # implemented fields are honoured (user changes nothing, as OpenAI's)
    response = httpx.post(server.url + "/v1/completions", json={**body, "user": "me", "frequency_penalty": 0.5}, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.wait_for_metric("jaxmtp_kv_pages_used", 0, timeout=3) == 0


# ----- the README and the command line ------------------------------------------------------


def test_readme_server_examples_work(server):
    section = (ROOT / "README.md").read_text().split("\n## Server", 1)[1]
    curl = re.search(r"```bash\n(curl .*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?OpenAI\(.*?)```", section, re.S).group(1)
    here = f"127.0.0.1:{server.port}"
    result = subprocess.run(["bash", "-c", curl.replace("127.0.0.1:8000", here)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and json.loads(result.stdout)["choices"][0]["text"], result.stdout + result.stderr
    result = subprocess.run(
        [sys.executable, "-c", python.replace("127.0.0.1:8000", here)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "completion_tokens" in result.stdout, result.stdout + result.stderr


def test_serve_reports_bad_options_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "jaxmtp.cli", "serve", "--model", str(ROOT / "nowhere")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("jaxmtp: error: model folder") and "Traceback" not in result.stderr
