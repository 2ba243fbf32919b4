"""The server honours or refuses, never ignores (in-process, one engine for the module):
the sampling fields as the SamplingParams the server builds on both endpoints, their bad
values as 400s naming them, fields not implemented (yet) as 400s naming them, /tokenize,
/detokenize and /version as vLLM's, the /metrics series under jaxmtp's and vLLM's names
with a model_name label, and the periodic stats log line."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import time

import openai
import pytest

from conftest import MTP_MODEL
from test_server import assert_openai_error, sample_value
from tolerances import assert_within

MODEL_ID = "stories260K-mtp"
GREEDY = dict(model=MODEL_ID, temperature=0)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engine():
    from jaxmtp.engine.llm_engine import LLMEngine

    return LLMEngine(MTP_MODEL, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=8)


@contextlib.contextmanager
def serving(engine, **config):
    from fastapi.testclient import TestClient

    from jaxmtp.server import ServerConfig, create_app

    with TestClient(create_app(engine, str(MTP_MODEL), ServerConfig(**config))) as http:
        yield http


@pytest.fixture(scope="module")
def http(engine):
    with serving(engine, disable_log_stats=True) as http:
        yield http


def post(http, path: str, body: dict):
    """POST body as ASCII JSON, as clients send it (a lone surrogate escaped: "\\ud800")."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.fixture
def submitted(engine, monkeypatch):
    """The SamplingParams of each engine request the server adds, in order."""
    params, add_request = [], engine.add_request

    def recording_add_request(request_id, prompt, sampling_params, **kwargs):
        params.append(sampling_params)
        return add_request(request_id, prompt, sampling_params, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording_add_request)
    return params


# ----- sampling fields --------------------------------------------------------------------

SAMPLING = dict(
    presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias={"5": 2.5, "17": -100},
    min_tokens=2, bad_words=["cat", "big dog"], allowed_token_ids=[5, 17, 403], stop_token_ids=[13],
    include_stop_str_in_output=True, skip_special_tokens=False, seed=7, top_k=4, top_p=0.9, min_p=0.05,
    stop=["zebra"], ignore_eos=True, n=2, temperature=0.7,
)
EXPECTED = dict(
    presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias={5: 2.5, 17: -100.0},
    min_tokens=2, bad_words=["cat", "big dog"], allowed_token_ids=[5, 17, 403], stop_token_ids=[13],
    include_stop_str_in_output=True, skip_special_tokens=False, top_k=4, top_p=0.9, min_p=0.05, stop=["zebra"],
    ignore_eos=True, temperature=0.7,
)


@pytest.mark.parametrize("path, body, logprobs", [
    ("completions", {"prompt": "Once upon a time", "logprobs": 3}, 3),
    ("chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 3}, 3),
    ("chat/completions", {"messages": HI, "logprobs": True}, 0),
])
def test_sampling_fields_become_the_sampling_params_of_each_choice(http, submitted, path, body, logprobs):
    response = http.post(f"/v1/{path}", json={**body, **SAMPLING, "max_tokens": 3, "model": MODEL_ID})
    assert response.status_code == 200, response.text
    assert len(submitted) == 2
    for j, params in enumerate(submitted):  # choice j samples with seed + j, as the engine's own n > 1
        assert {name: getattr(params, name) for name in EXPECTED} == EXPECTED
        assert (params.seed, params.n, params.max_tokens, params.logprobs) == (7 + j, 1, 3, logprobs)


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": "Hi", "max_tokens": 3}),
    ("chat/completions", {"messages": HI, "max_completion_tokens": 3}),
])
def test_fields_not_given_leave_sampling_params_defaults(http, submitted, path, body):
    from jaxmtp import SamplingParams

    assert http.post(f"/v1/{path}", json=body).status_code == 200
    assert submitted == [SamplingParams(max_tokens=3)]


BAD_VALUES = [
    # field, value, a piece of the message
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0"),
    ("logit_bias", {"cat": 1}, "keys must be token ids (decimal integers), got 'cat'"),
    ("logit_bias", {"-1": 1}, "got '-1'"),
    ("logit_bias", {"512": 1}, "logit_bias has token ids out of vocabulary (size 512): [512]"),
    ("logit_bias", {"5": "up"}, "valid number"),
    ("min_tokens", 20, "min_tokens must be an integer in [0, max_tokens=16]"),
    ("bad_words", [""], "bad_words must be a list of non-empty strings"),
    ("bad_words", ["\ud800"], "lone surrogate"),
    ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list"),
    ("allowed_token_ids", [3, 9999], "allowed_token_ids has token ids out of vocabulary"),
    ("stop_token_ids", [-1], "greater than or equal to 0"),
    ("include_stop_str_in_output", "yes", "valid boolean"),
]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("field, value, message", BAD_VALUES)
def test_bad_sampling_values_get_a_400_naming_the_field(http, path, field, value, message):
    body = {"prompt": "Hi"} if path == "completions" else {"messages": HI, "max_tokens": 16}
    error = assert_openai_error(post(http, f"/v1/{path}", {**body, field: value}), 400)
    assert error["param"] == field and message in error["message"], error


# ----- fields the server does not implement --------------------------------------------------

UNSUPPORTED = [
    # path, field, value, a piece of the message
    ("chat/completions", "functions", [{"name": "f"}], "functions is not supported (use tools"),
    ("chat/completions", "function_call", "auto", "function_call is not supported (use tools and tool_choice"),
    ("completions", "suffix", "The end.", "suffix is not a field this server implements"),
    ("completions", "best_of", 2, "best_of is not a field this server implements"),
    ("chat/completions", "typo_penalty", 1.0, "typo_penalty is not a field this server implements"),
    ("chat/completions", "stream_options", {"include_usage": True, "include_typo": True},
     "stream_options.include_typo is not a field"),
    ("chat/completions", "messages", [{"role": "user", "content": "Hi", "tool_call_ids": "1"}],
     "messages.0.tool_call_ids is not a field"),
]


@pytest.mark.parametrize("path, field, value, message", UNSUPPORTED)
def test_fields_not_implemented_get_a_400_naming_them(http, path, field, value, message):
    body = {"prompt": "Hi"} if path == "completions" else {"messages": HI}
    error = assert_openai_error(http.post(f"/v1/{path}", json={**body, field: value}), 400)
    assert error["param"] == field and message in error["message"], error


def test_every_unsupported_field_is_named(http):
    body = {"messages": HI, "functions": [{"name": "f"}], "logit_bias_typo": {}, "audio": {}}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["message"] == (
        "functions is not supported (use tools, which replace them); logit_bias_typo is not a field this server "
        "implements; audio is not a field this server implements"
    )


def test_the_openai_client_gets_the_refusal(http):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="functions is not supported") as caught:
        client.chat.completions.create(messages=HI, functions=[{"name": "f"}], **GREEDY)
    assert caught.value.body["param"] == "functions"


def test_values_that_ask_for_nothing_are_accepted(http):
    nothing = dict(
        response_format={"type": "text"}, tools=[], tool_choice="none", functions=None, function_call="none",
        user="alice", prompt_logprobs=None,
    )
    response = http.post("/v1/chat/completions", json=dict(messages=HI, max_tokens=2, **nothing, **GREEDY))
    assert response.status_code == 200, response.text
    response = http.post("/v1/completions", json=dict(prompt="Hi", max_tokens=2, echo=False, **GREEDY))
    assert response.status_code == 200, response.text


def test_descriptive_fields_are_accepted_and_request_ids_and_token_ids_honoured(http, engine):
    """Fields that only describe the request (OpenAI's metadata, store, user,
    safety_identifier, prompt_cache_key, service_tier) change nothing; vLLM's request_id
    names the response (the X-Request-Id header before it) and is echoed;
    return_token_ids adds the prompt's and each choice's token ids."""
    described = dict(metadata={"team": "a"}, store=False, user="alice", safety_identifier="u1", prompt_cache_key="k",
                     service_tier="auto")
    plain = http.post("/v1/chat/completions", json=dict(messages=HI, max_tokens=4, **GREEDY)).json()
    response = http.post("/v1/chat/completions", json=dict(messages=HI, max_tokens=4, request_id="run-7",
                                                           return_token_ids=True, **described, **GREEDY))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "chatcmpl-run-7" and response.headers["X-Request-Id"] == "run-7"
    assert body["choices"][0]["message"] == plain["choices"][0]["message"]
    assert body["prompt_token_ids"] == engine.tokenizer.apply_chat_template(HI, add_generation_prompt=True,
                                                                            return_dict=False)
    decode = functools.partial(engine.tokenizer.decode, skip_special_tokens=True)
    prompt = body["prompt_token_ids"]
    assert decode(prompt + body["choices"][0]["token_ids"]) == decode(prompt) + body["choices"][0]["message"]["content"]
    response = http.post("/v1/completions", json=dict(prompt="Once upon", max_tokens=3, return_token_ids=True, **GREEDY),
                         headers={"X-Request-Id": "from-header"})
    choice = response.json()["choices"][0]
    assert response.json()["id"] == "cmpl-from-header" and response.headers["X-Request-Id"] == "from-header"
    assert choice["prompt_token_ids"] == engine.tokenizer.encode("Once upon") and len(choice["token_ids"]) == 3
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    bad = http.post("/v1/completions", json=dict(prompt="Hi", max_tokens=1, request_id="two words", **GREEDY))
    assert assert_openai_error(bad, 400)["param"] == "request_id"


def test_a_stream_returns_token_ids_and_usage_in_every_chunk_when_asked(http, engine):
    """return_token_ids in a stream: the prompt's ids in the first chunk, each chunk's new
    tokens; stream_options.continuous_usage_stats: every chunk's usage so far."""
    body = dict(prompt="Once upon", max_tokens=5, stream=True, return_token_ids=True, ignore_eos=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY)
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["prompt_token_ids"] == engine.tokenizer.encode("Once upon")
    assert all("prompt_token_ids" not in c for c in choices[1:])
    tokens = [t for c in choices for t in c["token_ids"]]
    assert len(tokens) == 5 and chunks[-1]["usage"]["completion_tokens"] == 5
    # every chunk counts the tokens streamed up to it
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and all(
        c["usage"]["completion_tokens"] >= sum(len(x["token_ids"]) for x in choices[: i + 1])
        for i, c in enumerate(chunk for chunk in chunks if chunk["choices"]))


def test_chat_template_fields_are_honoured(http, engine):
    """vLLM's add_generation_prompt, continue_final_message, chat_template_kwargs and a
    message's name: the chat prompt is the template's rendering with them."""
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": "Hi", "name": "Ann"}, {"role": "assistant", "content": "Once"}]
    body = dict(messages=messages, add_generation_prompt=False, continue_final_message=True,
                chat_template_kwargs={"enable_thinking": False}, max_tokens=2, **GREEDY)
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    expected = tokenizer.apply_chat_template(messages, continue_final_message=True, return_dict=False)
    assert tokenizer.decode(expected).endswith("Once")  # the open message, no turn after it
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    error = assert_openai_error(http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True}), 400)
    assert error["param"] == "continue_final_message"


# ----- /tokenize, /detokenize, /version ------------------------------------------------------


def test_tokenize_and_detokenize_as_vllm(http, engine):
    tokenizer, prompt = engine.tokenizer, "Once upon a time"
    out = http.post("/tokenize", json={"model": MODEL_ID, "prompt": prompt}).json()
    assert out == {"count": len(tokenizer.encode(prompt)), "max_model_len": 512, "tokens": tokenizer.encode(prompt)}
    bare = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert bare == out["tokens"][1:]  # no BOS
    assert http.post("/detokenize", json={"tokens": bare}).json() == {"prompt": prompt}
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"].startswith("<s>")
    # messages: the prompt the chat endpoint would generate from
    chat = http.post("/tokenize", json={"messages": HI}).json()
    usage = http.post("/v1/chat/completions", json=dict(messages=HI, max_tokens=1, **GREEDY)).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"] == len(chat["tokens"])
    assert chat["tokens"] == tokenizer.apply_chat_template(HI, add_generation_prompt=True, return_dict=False)
    open_ended = http.post("/tokenize", json={"messages": HI, "add_generation_prompt": False}).json()["tokens"]
    assert open_ended == tokenizer.apply_chat_template(HI, return_dict=False) != chat["tokens"]


@pytest.mark.parametrize("path, body, param, message", [
    ("tokenize", {}, "prompt", "give either prompt or messages"),
    ("tokenize", {"prompt": "Hi", "messages": HI}, "prompt", "give either prompt or messages"),
    ("tokenize", {"prompt": "Hi", "add_generation_prompt": False}, "add_generation_prompt", "applies to messages"),
    ("tokenize", {"messages": HI, "add_special_tokens": True}, "add_special_tokens", "chat template writes"),
    ("tokenize", {"prompt": "Hi", "return_token_strs": True}, "return_token_strs", "not a field"),
    ("tokenize", {"prompt": "Hi \ud800"}, "prompt", "lone surrogate"),
    ("tokenize", {"prompt": "Hi", "model": "gpt-4o"}, "model", "does not exist"),
    ("detokenize", {"tokens": [1, 512]}, "tokens", "out of vocabulary (size 512): [512]"),
    ("detokenize", {"tokens": [-1]}, "tokens", "greater than or equal to 0"),
])
def test_tokenize_and_detokenize_refuse_what_they_cannot_do(http, path, body, param, message):
    response = post(http, f"/{path}", body)
    error = assert_openai_error(response, 404 if param == "model" else 400)
    assert error["param"] == param and message in error["message"], error


def test_version(http):
    import jaxmtp

    assert http.get("/version").json() == {"version": jaxmtp.__version__}


# ----- /metrics ------------------------------------------------------------------------------

VLLM_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
]


def test_metrics_under_vllm_names(engine, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    with serving(engine, metrics_names="vllm", disable_log_stats=True) as http:
        body = dict(prompt="Once upon a time", max_tokens=12, ignore_eos=True, **GREEDY)
        assert http.post("/v1/completions", json=body).status_code == 200
        monkeypatch.setattr(engine.scheduler, "num_preemptions", 3)
        text = http.get("/metrics").text
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    for name in VLLM_SERIES:
        assert name in samples and samples[name].labels["model_name"] == MODEL_ID, name
    assert not any(name.startswith("jaxmtp_requests_running") for name in samples)  # the vLLM name replaces it
    assert sample_value(text, "vllm:request_success_total", finished_reason="length") >= 1
    assert samples["vllm:num_preemptions_total"].value == 3
    stats = engine.stats.spec
    assert samples["vllm:spec_decode_num_drafts_total"].value == stats.num_steps > 0
    assert samples["vllm:spec_decode_num_accepted_tokens_total"].value == stats.accepted
    for stage in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert samples[f"vllm:{stage}_seconds_count"].value >= 1, stage
        assert samples[f"vllm:{stage}_seconds_sum"].value >= 0, stage
    e2e, parts = (samples[f"vllm:{s}_seconds_sum"].value for s in ("e2e_request_latency", "request_decode_time"))
    assert e2e >= parts


# ----- the stats log line --------------------------------------------------------------------

STATS_LINE = re.compile(
    r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: (?P<generation>[\d.]+) tokens/s, "
    r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%, "
    r"Mean acceptance length: (?P<acceptance>[\d.]+|-)$"
)


def test_the_server_logs_a_stats_line_every_interval(engine, caplog):
    caplog.set_level(logging.INFO, logger="jaxmtp.server")
    with serving(engine, log_stats_interval=0.05) as http:
        body = dict(prompt="Once upon a time", max_tokens=24, ignore_eos=True, **GREEDY)
        assert http.post("/v1/completions", json=body).status_code == 200
        time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxmtp.server" and "throughput" in r.getMessage()]
    assert lines and all(STATS_LINE.match(line) for line in lines), lines
    busy = [STATS_LINE.match(line) for line in lines if float(STATS_LINE.match(line)["generation"]) > 0]
    assert busy and all(1 <= float(m["acceptance"]) <= 3 for m in busy if m["acceptance"] != "-"), lines
    caplog.clear()
    with serving(engine, disable_log_stats=True):
        time.sleep(0.2)
    assert not [r for r in caplog.records if "throughput" in r.getMessage()]


# ----- echo, prompt logprobs and structured outputs -------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


def reference_logprobs(ids: list[int]):
    """float64 log-softmax of transformers' logits for the stories260K body, and how far
    ours may lie from it (conftest.stories_logprob_bound)."""
    import numpy as np
    import torch
    import transformers

    from conftest import STORIES, stories_logprob_bound

    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype="float32").eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double().numpy()
    top = logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits - top).sum(-1, keepdims=True)) - top, stories_logprob_bound(logits)


def test_echo_scores_the_prompt_as_lm_eval_harness_asks(http, engine):
    """lm-eval-harness's loglikelihood request: token ids (context + continuation),
    max_tokens 0, echo, logprobs 1; the continuation's logprobs are read off the echo."""
    import numpy as np

    ids = engine.tokenizer.encode("Once upon a time there was a girl")
    body = dict(model=MODEL_ID, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0.0, seed=1234)
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(ids, skip_special_tokens=True) and choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert logprobs["tokens"][0] == "<s>"  # the unscored first token by name, as vLLM's
    want, bound = reference_logprobs(ids)
    assert_within(logprobs["token_logprobs"][1:], want[np.arange(len(ids) - 1), ids[1:]], bound)
    greedy = [max(top, key=top.get) for top in logprobs["top_logprobs"][1:]]
    assert greedy == [engine.tokenizer.token_texts(ids[:p], [int(np.argmax(want[p - 1]))], 4, False)[0]
                      for p in range(1, len(ids))]  # is_greedy, as the harness computes it


def test_echo_with_a_completion_and_the_openai_client(http):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    out = client.completions.create(prompt="Once upon a time", max_tokens=3, echo=True, logprobs=2, **GREEDY)
    plain = client.completions.create(prompt="Once upon a time", max_tokens=3, logprobs=2, **GREEDY)
    choice = out.choices[0]
    assert choice.text == "Once upon a time" + plain.choices[0].text
    assert choice.logprobs.token_logprobs[-3:] == plain.choices[0].logprobs.token_logprobs
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == out.usage.prompt_tokens + 3
    # OpenAI's text_offset: where each token's text starts, from the choice's first token on
    for logprobs in (choice.logprobs, plain.choices[0].logprobs):
        assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_completion_max_tokens_null_runs_to_the_end_of_the_context(engine):
    """vLLM's max_tokens null: the rest of the context, within --max-request-tokens."""
    with serving(engine, disable_log_stats=True, max_request_tokens=12) as http:
        body = dict(prompt="Once upon a time", max_tokens=None, ignore_eos=True, **GREEDY)
        response = http.post("/v1/completions", json=body).json()
        assert response["usage"]["completion_tokens"] == 12 and response["choices"][0]["finish_reason"] == "length"


def test_prompt_logprobs_field_as_vllm(http):
    response = http.post("/v1/completions", json=dict(prompt="Once upon", max_tokens=1, prompt_logprobs=1, **GREEDY))
    entries = response.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(
        {"logprob", "rank", "decoded_token"} <= set(lp) for entry in entries[1:] for lp in entry.values()
    )
    # a chat's one prompt: at the response's top level, as vLLM's
    chat = http.post("/v1/chat/completions", json=dict(messages=HI, max_tokens=1, prompt_logprobs=0, **GREEDY)).json()
    assert "prompt_logprobs" not in chat["choices"][0] and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_response_format_json_schema_constrains_the_output(http, path):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    if path == "completions":
        text = client.completions.create(prompt="Lily", max_tokens=40, extra_body={"response_format": fmt},
                                         **GREEDY).choices[0].text
    else:
        text = client.chat.completions.create(messages=HI, max_tokens=40, response_format=fmt,
                                              **GREEDY).choices[0].message.content
    assert set(json.loads(text)) == {"name"}


def test_structured_outputs_and_guided_fields(http):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    for extra in ({"structured_outputs": {"choice": ["cat", "dog"]}}, {"guided_choice": ["cat", "dog"]}):
        out = client.completions.create(prompt="Lily", max_tokens=8, extra_body=extra, **GREEDY).choices[0]
        assert out.text in ("cat", "dog") and out.finish_reason == "stop"
    out = client.completions.create(prompt="Lily", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"}, **GREEDY)
    assert re.fullmatch("[0-9]{3}", out.choices[0].text)
    # a JSON constraint's whitespace, as vLLM spells it: none at all, or a pattern of its own
    schema = {key: value for key, value in SCHEMA.items() if key != "x-guidance"}
    for extra in ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
                  {"guided_json": schema, "guided_whitespace_pattern": "[ ]"}):
        text = client.completions.create(prompt="Lily", max_tokens=40, extra_body=extra, **GREEDY).choices[0].text
        assert json.loads(text) and "\n" not in text and "  " not in text, (extra, text)


@pytest.mark.parametrize("body, param, message", [
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format", "one constraint at most"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, None, "does not compile"),
    ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "applies to a JSON constraint"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, None, "applies to json and json_object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"echo": True, "stream": True}, "echo", "echo with stream is not supported yet"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo"),
])
def test_bad_constraints_and_echo_get_400s(http, body, param, message):
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": "Hi", **body}), 400)
    assert message in error["message"] and (param is None or error["param"] == param), error


# ----- tools ---------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "description": "the time now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
# a Hermes call, forced by a regex: the stories model knows no tool format of its own
HERMES_CALL = r'Sure\.<tool_call>\n\{"name": "weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def tools_http(engine):
    with serving(engine, disable_log_stats=True, enable_auto_tool_choice=True, tool_call_parser="hermes") as http:
        yield http


def test_a_named_function_is_called_with_arguments_its_schema_allows(http):
    """tool_choice naming a function constrains the output to its parameters' schema
    (the structured-output path, exact under MTP): the same tokens as that schema given
    as a JSON constraint, returned as the call's arguments."""
    body = dict(messages=HI, max_tokens=40, tools=[WEATHER, TIME], **GREEDY)
    response = http.post("/v1/chat/completions", json={**body, "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    plain = http.post("/v1/chat/completions", json={**body, "tool_choice": "none", "structured_outputs": {
        "json": WEATHER["function"]["parameters"]}}).json()["choices"][0]["message"]["content"]
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": plain} and message["content"] is None
    assert json.loads(plain)["city"] in ("Paris", "Rome") and call["id"].startswith("chatcmpl-tool-")


def test_required_calls_one_offered_tool_or_more(http):
    """tool_choice required: the output is a JSON array of calls of offered tools
    (vLLM's form); parallel_tool_calls false allows one. This model keeps calling while
    it may, so the request runs with one call allowed; the array's schema is checked
    against hand-written outputs."""
    import jsonschema

    from jaxmtp.server.tool_choice import ToolChoice, forced_call_constraint

    body = dict(messages=HI, max_tokens=120, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                **GREEDY)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    assert call["function"]["name"] in ("weather", "time")
    assert call["function"]["name"] == "time" or json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    two = [{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"city": "Rome"}}]
    for parallel, output, valid in [(True, two, True), (False, two, False), (False, two[1:], True), (True, [], False),
                                    (True, [{"name": "weather", "parameters": {"city": "Oslo"}}], False),
                                    (True, [{"name": "time", "parameters": {}, "why": 1}], False)]:
        schema = forced_call_constraint(ToolChoice("required"), [WEATHER, TIME], parallel)["json"]
        assert jsonschema.Draft202012Validator(schema).is_valid(output) == valid, (parallel, output)


def test_auto_reads_the_models_calls_with_the_servers_parser_whole_and_streamed(tools_http):
    """tool_choice auto (the default with tools): the output read by --tool-call-parser
    hermes into content and calls; streamed, the deltas add up to the same."""
    body = dict(messages=HI, max_tokens=100, tools=[WEATHER], structured_outputs={"regex": HERMES_CALL}, **GREEDY)
    choice = tools_http.post("/v1/chat/completions", json=body).json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert choice["message"]["content"] == "Sure." and choice["finish_reason"] == "tool_calls"
    assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    with tools_http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert streamed[0]["function"]["name"] == "weather" and streamed[0]["id"].startswith("chatcmpl-tool-")
    assert "".join(c["function"]["arguments"] for c in streamed) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the openai client reads it
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tools_http, max_retries=0)
    regex = body.pop("structured_outputs")
    out = client.chat.completions.create(**body, extra_body={"structured_outputs": regex}).choices[0].message
    assert out.tool_calls[0].function.arguments == call["function"]["arguments"] and out.content == "Sure."


def test_tool_histories_reach_the_template_and_bad_tool_requests_are_400s(http, tools_http):
    history = HI + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    response = http.post("/v1/chat/completions", json=dict(messages=history, max_tokens=2, tools=[WEATHER],
                                                           tool_choice="none", **GREEDY))
    assert response.status_code == 200, response.text
    bad = [
        (http, dict(tools=[WEATHER]), "tool_choice", "--enable-auto-tool-choice"),
        (http, dict(tools=[WEATHER], tool_choice="auto"), "tool_choice", "--enable-auto-tool-choice"),
        (tools_http, dict(tool_choice="required"), "tool_choice", "needs tools"),
        (tools_http, dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "time"}}),
         "tool_choice", "does not offer"),
        (tools_http, dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "tool_choice", "cannot be combined"),
        (tools_http, dict(messages=HI + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "weather", "arguments": "{city"}}]}]),
         "messages", "are not JSON"),
    ]
    for client, fields, param, message in bad:
        error = assert_openai_error(client.post("/v1/chat/completions", json={"messages": HI, **fields}), 400)
        assert error["param"] == param and message in error["message"], (fields, error)


def test_cors_answers_browser_preflights_as_vllm_does(http, engine):
    """CORS with vLLM's defaults (any origin, method, header) and options; a preflight
    carries no API key, so it is answered before the key is checked."""
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    response = http.options("/v1/chat/completions", headers=preflight)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    with serving(engine, disable_log_stats=True, api_key=["k"], allowed_origins=["https://app.example"]) as guarded:
        response = guarded.options("/v1/chat/completions", headers=preflight)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        assert guarded.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
                               ).status_code == 400
        body = dict(messages=HI, max_tokens=1, **GREEDY)
        refused = guarded.post("/v1/chat/completions", json=body, headers={"Origin": "https://app.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
        answered = guarded.post("/v1/chat/completions", json=body,
                                headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "https://app.example"


def test_vllm_docs_tool_calling_example_runs_unchanged(tools_http):
    """The OpenAI-client example of vLLM's tool-calling docs (its named-function form:
    this model writes no tool format of its own), with only the base URL changed, and
    the schema closed (the location an enum, no other properties): this model never
    ends a free string."""
    from openai import OpenAI

    client = OpenAI(base_url="http://testserver/v1", api_key="dummy", http_client=tools_http)

    def get_weather(location: str, unit: str):
        return f"Getting the weather for {location} in {unit}..."

    tool_functions = {"get_weather": get_weather}
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "City and state, e.g., 'San Francisco, CA'",
                                 "enum": ["San Francisco, CA", "Boston, MA"]},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location", "unit"],
                "additionalProperties": False,
            },
        },
    }]
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What's the weather like in San Francisco?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    tool_call = response.choices[0].message.tool_calls[0].function
    assert tool_call.name == "get_weather"
    assert tool_functions[tool_call.name](**json.loads(tool_call.arguments)).startswith("Getting the weather for")
