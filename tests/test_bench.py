"""`jaxmtp bench` with vLLM's flags and result keys, on the tiny shipped model, a few
tokens each: latency and throughput in this process, serve against a server started
here (uvicorn on a thread). The saved JSON has vLLM's keys with figures that add up
(counts, tokens, throughput = tokens / duration, percentiles in order) and jaxmtp's
environment (date, device, JAX version); a ShareGPT file is read as vLLM reads it; the
latency statistics are checked on made-up times."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from conftest import MTP_MODEL
from jaxmtp.bench.datasets import random_requests, sharegpt_requests
from jaxmtp.bench.serve import arrival_times
from jaxmtp.bench.stats import RequestTimes, summarize
from jaxmtp.cli import main

TINY_ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--compilation-cache-dir", ""]
STORY = "Once upon a time there was a little girl who liked to play"
# two conversations vLLM samples (a and c), one whose prompt is too short (d), and two it leaves out (b, e)
SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": STORY}, {"from": "gpt", "value": "She had a dog"}]},
    {"id": "b", "conversations": [{"from": "human", "value": STORY}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Tell me about the big red ball"},
                                  {"from": "gpt", "value": "The ball was very big and red and round"},
                                  {"from": "human", "value": "And then?"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend"}]},
    {"id": "e"},
]
SERVING_KEYS = (
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
)
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def run_bench(tmp_path, capsys, *argv) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    assert main(["bench", *argv, "--output-json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def check_environment(report: dict, printed: str, title: str) -> None:
    import jax

    env = report["environment"]
    assert env["jax"] == jax.__version__ and env["date"].endswith("UTC") and env["device"]
    assert title in printed and f"jax:{' ' * 24}{jax.__version__}" in printed and "date:" in printed
    assert "device:" in printed


def check_percentiles(p: dict) -> None:
    assert 0 < p["p50"] <= p["p90"] <= p["p99"]


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    return path


def test_latency_statistics_from_made_up_times():
    """Sent at 1.0, outputs at 1.5 (1 token), 1.7 (2 tokens, an MTP step), 2.0 (1)."""
    request = RequestTimes(sent=1.0, prompt_tokens=10)
    for now, tokens in ((1.5, 1), (1.6, 0), (1.7, 2), (2.0, 1)):
        request.record(now, tokens)
    assert request.num_tokens == 4 and request.event_times == [1.5, 1.7, 2.0]
    assert request.ttft == pytest.approx(0.5) and request.e2e == pytest.approx(1.0)
    assert request.tpot == pytest.approx(0.5 / 3) and request.itls == pytest.approx([0.2, 0.3])
    failed = RequestTimes(sent=0.0, error="HTTP 400")
    summary = summarize([request, failed], duration=2.0)
    assert summary["requests"] == 2 and summary["failed"] == 1 and summary["errors"] == ["HTTP 400"]
    assert summary["output_tokens_per_s"] == pytest.approx(2.0) and summary["total_tokens_per_s"] == pytest.approx(7.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(500) and summary["itl_ms"]["mean"] == pytest.approx(250)


def test_sharegpt_is_sampled_as_vllm_samples_it(sharegpt_file):
    """Conversations of two turns or more, shuffled by Python's random with the seed; the
    first turn is the prompt, the second's token count the output length; prompts under
    4 tokens are skipped, and too few samples are topped up with copies."""
    words = lambda text: len(text.split())  # noqa: E731 - a tokenizer of words
    order = [e for e in SHAREGPT if len(e.get("conversations", ())) >= 2]
    random.seed(6)
    random.shuffle(order)  # vLLM's order
    want = [(e["conversations"][0]["value"], e["conversations"][1]["value"]) for e in order if e["id"] != "d"]
    samples = sharegpt_requests(str(sharegpt_file), 3, 6, words)
    assert [s.prompt for s in samples[:2]] == [prompt for prompt, _ in want]
    assert [(s.prompt_len, s.expected_output_len) for s in samples[:2]] == [(words(p), words(c)) for p, c in want]
    assert samples[2] in samples[:2]  # a copy: the file has two samples
    assert [s.expected_output_len for s in sharegpt_requests(str(sharegpt_file), 2, 6, words, output_len=3)] == [3, 3]
    assert len(sharegpt_requests(str(sharegpt_file), 1, 6, words)) == 1


def test_random_requests_and_arrivals_as_vllm_draws_them():
    rng = np.random.default_rng(0)
    exact = random_requests(rng, 3, 8, 6, 0.0, 100)
    assert [(len(r.prompt), r.prompt_len, r.expected_output_len) for r in exact] == [(8, 8, 6)] * 3
    assert all(3 <= t < 100 for r in exact for t in r.prompt)
    spread = random_requests(rng, 200, 10, 10, 0.5, 100)
    assert {r.prompt_len for r in spread} == {r.expected_output_len for r in spread} == set(range(5, 16))
    with pytest.raises(ValueError, match="--random-range-ratio"):
        random_requests(rng, 1, 8, 6, 1.0, 100)
    # the last request comes at num / rate; burstiness inf: evenly spaced; rate inf: all at once
    for burstiness in (0.5, 1.0, 4.0):
        times = arrival_times(rng, 50, 10.0, burstiness)
        assert np.all(np.diff(times) >= 0) and times[-1] == pytest.approx(5.0)
    assert arrival_times(rng, 4, 2.0, float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert not arrival_times(rng, 4, float("inf"), 1.0).any()
    # burstier arrivals vary more
    gaps = {b: np.diff(arrival_times(np.random.default_rng(1), 2000, 10.0, b)).std() for b in (0.25, 4.0)}
    assert gaps[0.25] > 3 * gaps[4.0]


def test_latency_decodes_one_request_per_iteration(tmp_path, capsys):
    report, printed = run_bench(tmp_path, capsys, "latency", "--input-len", "8", "--output-len", "6",
                                "--num-iters", "3", "--num-iters-warmup", "1", *TINY_ENGINE)
    check_environment(report, printed, "jaxmtp bench latency")
    # vLLM's keys: each iteration's seconds, their mean, std and percentiles
    latencies = report["latencies"]
    assert len(latencies) == 3 and report["avg_latency"] == pytest.approx(np.mean(latencies))
    assert report["std_latency"] == pytest.approx(np.std(latencies))
    percentiles = report["percentiles"]
    assert list(percentiles) == ["10", "25", "50", "75", "90", "99"]
    assert percentiles["50"] == pytest.approx(np.median(latencies))
    assert min(latencies) <= percentiles["10"] <= percentiles["99"] <= max(latencies)
    assert f"Avg latency: {report['avg_latency']} seconds" in printed and "99% percentile latency:" in printed
    settings, results = report["settings"], report["results"]
    assert settings["batch_size"] == 1 and settings["num_speculative_tokens"] == 2  # the CLI's default for MTP weights
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        check_percentiles(results[key])
    assert percentiles["50"] * 1e3 >= results["ttft_ms"]["p50"]
    assert results["failed"] == 0 and 1 <= results["mean_acceptance_length"] <= 3
    assert results["compiles_while_timed"] == 0  # the warm-up iteration compiled the same shapes


def test_throughput_of_a_sharegpt_file_with_n_samples(server, sharegpt_file, tmp_path, capsys):
    report, printed = run_bench(tmp_path, capsys, "throughput", "--dataset-path", str(sharegpt_file),
                                "--num-prompts", "3", "--n", "2", "--no-warmup", "--seed", "6", *TINY_ENGINE)
    check_environment(report, printed, "jaxmtp bench throughput")
    assert report["settings"]["dataset_name"] == "sharegpt" and report["settings"]["n"] == 2
    samples = sharegpt_requests(str(sharegpt_file), 3, 6, lambda text: tokenize(server, text))
    prompt_tokens, output_tokens = sum(s.prompt_len for s in samples), sum(s.expected_output_len for s in samples)
    # vLLM's keys: every prompt once, every sample's tokens (greedy, eos ignored: the conversation's length)
    assert report["num_requests"] == 3 and report["total_num_tokens"] == prompt_tokens + 2 * output_tokens
    assert report["requests_per_second"] * report["elapsed_time"] == pytest.approx(3)
    assert report["tokens_per_second"] * report["elapsed_time"] == pytest.approx(report["total_num_tokens"])
    assert f"Total num prompt tokens:  {prompt_tokens}\nTotal num output tokens:  {2 * output_tokens}" in printed
    assert report["results"]["failed"] == 0
    check_percentiles(report["results"]["ttft_ms"])


@pytest.fixture(scope="module")
def server():
    import uvicorn

    from jaxmtp.engine.llm_engine import LLMEngine
    from jaxmtp.server import create_app

    engine = LLMEngine(MTP_MODEL, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(engine, str(MTP_MODEL)), host="127.0.0.1", port=port, log_level="warning")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield port
    http.should_exit = True
    thread.join(30)


def tokenize(port: int, text: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", json.dumps({"prompt": text}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.load(response)["count"]


def check_serving_result(result: dict, num_prompts: int) -> None:
    """vLLM's keys, with figures that add up."""
    assert set(SERVING_KEYS + DETAILED_KEYS) <= set(result), set(SERVING_KEYS + DETAILED_KEYS) - set(result)
    assert result["completed"] + result["failed"] == result["num_prompts"] == num_prompts
    assert len(result["input_lens"]) == len(result["output_lens"]) == len(result["ttfts"]) == num_prompts
    assert result["total_output_tokens"] == sum(result["output_lens"])
    duration = result["duration"]
    assert result["request_throughput"] * duration == pytest.approx(result["completed"])
    assert result["output_throughput"] * duration == pytest.approx(result["total_output_tokens"])
    assert result["total_token_throughput"] * duration == pytest.approx(
        result["total_input_tokens"] + result["total_output_tokens"])
    assert result["request_goodput"] is None and result["model_id"] == MTP_MODEL.name


def test_serve_with_vllms_flags_saves_vllms_result(server, tmp_path, capsys):
    argv = ["bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(server), "--dataset-name",
            "random", "--random-input-len", "8", "--random-output-len", "6", "--num-prompts", "4", "--request-rate",
            "40", "--burstiness", "2", "--max-concurrency", "2", "--seed", "3", "--percentile-metrics",
            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
            "--result-dir", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    [path] = tmp_path.iterdir()
    assert re.fullmatch(rf"vllm-40\.0qps-concurrency2-{MTP_MODEL.name}-\d{{8}}-\d{{6}}\.json", path.name)
    result = json.loads(path.read_text())
    check_serving_result(result, 4)
    assert result["backend"] == "vllm" and result["request_rate"] == 40.0 and result["burstiness"] == 2.0
    assert result["max_concurrency"] == 2 and result["date"] in path.name and result["failed"] == 0
    assert result["input_lens"] == [8] * 4 and result["output_lens"] == [6] * 4 and result["total_input_tokens"] == 32
    assert result["errors"] == [""] * 4 and all(result["generated_texts"])
    assert all(0 < ttft < result["duration"] for ttft in result["ttfts"]) and all(len(i) >= 1 for i in result["itls"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p50, p99 = (result[f"{stat}_{metric}_ms"] for stat in ("mean", "median", "p50", "p99"))
        assert 0 < p50 <= p99 and p50 == pytest.approx(median) and mean > 0 and result[f"std_{metric}_ms"] >= 0, metric
    assert result["mean_ttft_ms"] == pytest.approx(np.mean(result["ttfts"]) * 1e3)
    assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    # the server's MTP drafts, read from its /metrics (under jaxmtp's names)
    assert result["spec_decode_num_drafts"] > 0 and 1 <= result["spec_decode_acceptance_length"] <= 3
    drafted = result["spec_decode_draft_tokens"]
    assert result["spec_decode_accepted_tokens"] <= drafted == 2 * result["spec_decode_num_drafts"]
    assert len(result["spec_decode_per_position_acceptance_rates"]) == 2
    import jax

    assert result["environment"]["jax"] == jax.__version__
    assert "============ Serving Benchmark Result ============" in printed
    for text in ("Successful requests:                     4", "P99 TTFT (ms):", "Median E2EL (ms):",
                 "Request rate configured (RPS):           40.00", "-------------Speculative Decoding--------------",
                 f"jax:{' ' * 24}{jax.__version__}"):
        assert text in printed, text


def test_serve_a_sharegpt_file_on_the_chat_endpoint(server, sharegpt_file, tmp_path, capsys):
    result, _ = run_bench(tmp_path, capsys, "serve", "--port", str(server), "--backend", "openai-chat",
                          "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_file), "--num-prompts", "3",
                          "--seed", "6", "--ignore-eos", "--save-detailed")
    check_serving_result(result, 3)
    samples = sharegpt_requests(str(sharegpt_file), 3, 6, lambda text: tokenize(server, text))
    assert result["output_lens"] == [s.expected_output_len for s in samples]  # the conversations' lengths
    assert all(n > s.prompt_len for n, s in zip(result["input_lens"], samples))  # the chat template's tokens too
    assert "mean_e2el_ms" not in result and "p99_itl_ms" in result  # vLLM's default metrics and percentile


def test_serve_counts_the_requests_a_server_refuses(server, tmp_path, capsys):
    result, printed = run_bench(tmp_path, capsys, "serve", "--base-url", f"http://127.0.0.1:{server}",
                                "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--prompt-vocab-size",
                                "100000", "--model", MTP_MODEL.name)
    check_serving_result({**result, **{key: [0, 0] for key in DETAILED_KEYS}}, 2)
    assert result["failed"] == 2 and result["mean_ttft_ms"] == 0.0  # vLLM's 0 without values
    assert not any(key in result for key in DETAILED_KEYS)  # without --save-detailed, as vLLM's
    assert "Failed requests:                         2" in printed


@pytest.mark.parametrize("flags, message", [
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--endpoint /v1/completions"),
    (["--dataset-path", "conversations.json"], "--dataset-name random takes no --dataset-path"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--percentile-metrics", "ttft,goodput"], "--percentile-metrics: 'goodput'"),
    (["--metric-percentiles", "99,101"], "--metric-percentiles"),
])
def test_serve_refuses_flags_it_cannot_honour(flags, message, capsys):
    assert main(["bench", "serve", "--model", "m", "--port", "1", *flags]) == 2
    assert message in capsys.readouterr().err
