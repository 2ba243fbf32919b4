"""`jaxmtp bench` on the tiny shipped model, a few tokens each: latency and throughput
in this process, serve against a server started here (uvicorn on a thread). Each
report states date, device and JAX version, and the figures add up (token counts,
percentiles in order); the latency statistics are checked on made-up times."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from conftest import MTP_MODEL
from jaxmtp.bench.stats import RequestTimes, summarize
from jaxmtp.cli import main

TINY_ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--compilation-cache-dir", ""]


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


def test_latency_decodes_one_request_per_iteration(tmp_path, capsys):
    report, printed = run_bench(tmp_path, capsys, "latency", "--input-len", "8", "--output-len", "6",
                                "--num-iters", "2", "--num-iters-warmup", "1", *TINY_ENGINE)
    check_environment(report, printed, "jaxmtp bench latency")
    settings, results = report["settings"], report["results"]
    assert settings["batch_size"] == 1 and settings["num_speculative_tokens"] == 2  # the CLI's default for MTP weights
    for key in ("latency_ms", "ttft_ms", "tpot_ms", "itl_ms"):
        check_percentiles(results[key])
    assert results["latency_ms"]["p50"] >= results["ttft_ms"]["p50"]
    assert results["failed"] == 0 and 1 <= results["mean_acceptance_length"] <= 3
    assert results["compiles_while_timed"] == 0  # the warm-up iteration compiled the same shapes


def test_throughput_runs_every_prompt(tmp_path, capsys):
    report, printed = run_bench(tmp_path, capsys, "throughput", "--num-prompts", "4", "--input-len", "8",
                                "--output-len", "6", "--no-warmup", *TINY_ENGINE)
    check_environment(report, printed, "jaxmtp bench throughput")
    results = report["results"]
    assert results["requests"] == 4 and results["failed"] == 0
    assert results["output_tokens_per_s"] * results["duration_s"] == pytest.approx(4 * 6)
    assert results["total_tokens_per_s"] * results["duration_s"] == pytest.approx(4 * (8 + 6))
    check_percentiles(results["ttft_ms"])


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
    yield f"http://127.0.0.1:{port}"
    http.should_exit = True
    thread.join(30)


def test_serve_measures_a_running_server(server, tmp_path, capsys):
    report, printed = run_bench(tmp_path, capsys, "serve", "--base-url", server, "--num-prompts", "4",
                                "--input-len", "8", "--output-len", "6", "--request-rate", "40",
                                "--max-concurrency", "2")
    check_environment(report, printed, "jaxmtp bench serve")
    assert report["settings"]["model"] == MTP_MODEL.name  # the first of /v1/models
    results = report["results"]
    assert results["requests"] == 4 and results["failed"] == 0 and results["output_tokens"] == 4 * 6
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        check_percentiles(results[key])
    assert results["ttft_ms"]["p50"] <= results["e2e_ms"]["p50"]


def test_serve_counts_the_requests_a_server_refuses(server, tmp_path, capsys):
    report, _ = run_bench(tmp_path, capsys, "serve", "--base-url", server, "--num-prompts", "2", "--input-len", "4",
                          "--output-len", "2", "--prompt-vocab-size", "100000", "--model", MTP_MODEL.name)
    results = report["results"]
    assert results["failed"] == 2 and results["ttft_ms"] is None
    assert results["errors"] and results["errors"][0].startswith("HTTP 400")
