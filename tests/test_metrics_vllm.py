"""The /metrics series vLLM has beside the latency ones: tokens per engine step, each
finished request's prompt and generated tokens, inference time and time per output
token, the n and max_tokens of requests, and the KV cache's settings; under jaxmtp's
names and vLLM's, every series with vLLM's engine label."""

from __future__ import annotations

import pytest

from test_server_api import GREEDY, MODEL_ID, engine, serving  # noqa: F401 - engine is the module's fixture

# (jaxmtp's name, vLLM's) of the histograms
HISTOGRAMS = {
    "iteration": ("jaxmtp_iteration_tokens", "vllm:iteration_tokens_total"),
    "prompt": ("jaxmtp_request_prompt_tokens", "vllm:request_prompt_tokens"),
    "generation": ("jaxmtp_request_generation_tokens", "vllm:request_generation_tokens"),
    "inference": ("jaxmtp_request_inference_time_seconds", "vllm:request_inference_time_seconds"),
    "tpot": ("jaxmtp_request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"),
    "n": ("jaxmtp_request_params_n", "vllm:request_params_n"),
    "max_tokens": ("jaxmtp_request_params_max_tokens", "vllm:request_params_max_tokens"),
    "prefill": ("jaxmtp_request_prefill_time_seconds", "vllm:request_prefill_time_seconds"),
    "decode": ("jaxmtp_request_decode_time_seconds", "vllm:request_decode_time_seconds"),
}
COUNTERS = {
    "prompt_tokens": ("jaxmtp_prompt_tokens_total", "vllm:prompt_tokens_total"),
    "generation_tokens": ("jaxmtp_generation_tokens_total", "vllm:generation_tokens_total"),
}
CACHE_CONFIG = ("jaxmtp_cache_config_info", "vllm:cache_config_info")


def scrape(http) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(http.get("/metrics").text) for s in family.samples]


def value(samples, name: str, **labels) -> float:
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.mark.parametrize("names", ["jaxmtp", "vllm"])
def test_step_request_and_cache_series(engine, names, monkeypatch):  # noqa: F811 - the imported fixture
    pick = 0 if names == "jaxmtp" else 1
    hist = {key: pair[pick] for key, pair in HISTOGRAMS.items()}
    steps, step = [], engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    with serving(engine, metrics_names=names, disable_log_stats=True) as http:
        before = scrape(http)
        # a prompt with n = 2 choices of 5 tokens, then one choice of 3: 3 engine requests
        first = http.post("/v1/completions", json=dict(prompt="Once upon a time", max_tokens=5, n=2,
                                                        ignore_eos=True, **GREEDY)).json()["usage"]
        second = http.post("/v1/completions", json=dict(prompt=[5, 6, 7, 8, 9], max_tokens=3, ignore_eos=True,
                                                         **GREEDY)).json()["usage"]
        after = scrape(http)
    assert all(s.labels["engine"] == "0" and s.labels["model_name"] == MODEL_ID for s in after)
    # per finished request: its prompt (once per choice) and its tokens
    assert value(after, hist["prompt"] + "_count") == 3
    assert value(after, hist["prompt"] + "_sum") == 2 * first["prompt_tokens"] + second["prompt_tokens"]
    assert value(after, hist["generation"] + "_count") == 3
    assert value(after, hist["generation"] + "_sum") == first["completion_tokens"] + second["completion_tokens"] == 13
    assert value(after, hist["generation"] + "_bucket", le="5.0") == 3  # 5, 5 and 3 tokens
    assert value(after, hist["generation"] + "_bucket", le="2.0") == 0
    # the request parameters: n once a prompt, max_tokens once a choice
    assert value(after, hist["n"] + "_count") == 2 and value(after, hist["n"] + "_sum") == 3
    assert value(after, hist["n"] + "_bucket", le="1.0") == 1
    assert value(after, hist["max_tokens"] + "_count") == 3 and value(after, hist["max_tokens"] + "_sum") == 13
    # the steps' tokens add up to the prompt and generation counters' growth
    grown = sum(value(after, c[pick]) - value(before, c[pick]) for c in COUNTERS.values())
    assert value(after, hist["iteration"] + "_sum") == grown == 13 + 2 * first["prompt_tokens"] + 5
    assert 2 <= value(after, hist["iteration"] + "_count") <= len(steps)  # a step that did nothing is none
    # inference time = prefill + decode; time per output token = decode / (tokens - 1)
    times = {key: value(after, hist[key] + "_sum") for key in ("inference", "prefill", "decode", "tpot")}
    assert value(after, hist["inference"] + "_count") == value(after, hist["tpot"] + "_count") == 3
    assert times["inference"] == pytest.approx(times["prefill"] + times["decode"])
    assert 0 < times["tpot"] <= times["decode"] / 2  # 4 or 2 gaps per decode
    config = [s for s in after if s.name == CACHE_CONFIG[pick]]
    assert len(config) == 1 and config[0].value == 1
    labels = config[0].labels
    assert labels["block_size"] == str(engine.config.page_size)
    assert labels["num_gpu_blocks"] == str(engine.allocator.num_pages)
    assert labels["enable_prefix_caching"] == str(engine.config.enable_prefix_caching)
    assert not any(s.name.startswith(CACHE_CONFIG[1 - pick]) for s in after)  # one name set at a time
