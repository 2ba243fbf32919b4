"""`jaxmtp bench serve`, as vLLM's `vllm bench serve`: a client against a running
OpenAI-compatible server (jaxmtp's or any other). It streams the requests of a dataset
(random token prompts, or a ShareGPT file's conversations) to /v1/completions (backends
vllm and openai) or /v1/chat/completions (openai-chat), sent at --request-rate (gamma
arrivals of --burstiness, 1 being Poisson; seeded; inf: all at once) with at most
--max-concurrency in flight. It prints vLLM's summary (request and token throughput, the
TTFT, TPOT, ITL and end-to-end statistics, and the speculative decoding the server's
/metrics counted meanwhile) and with --save-result writes vLLM's JSON, jaxmtp's
environment added. Prompts are counted and decoded by the server's /tokenize and
/detokenize (vLLM's and jaxmtp's). Only the standard library: a thread per request in
flight."""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import time
import urllib.parse
from http.client import HTTPConnection, HTTPSConnection

import numpy as np

from jaxmtp.bench.datasets import SampleRequest, dataset_name, random_requests, sharegpt_requests
from jaxmtp.bench.stats import RequestTimes, emit, environment, heading, line, vllm_stats

BACKENDS = ("vllm", "openai", "openai-chat")  # the first two stream completions, the last chat completions
# vLLM's --percentile-metrics: name, label and heading of each
PERCENTILE_METRICS = {
    "ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency"),
}
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")  # only with --save-detailed
# the speculative decoding counters of /metrics: vLLM's result key, jaxmtp.server.metrics' series
SPEC_COUNTERS = {"num_drafts": "drafts", "draft_tokens": "draft_tokens", "accepted_tokens": "accepted_tokens"}


class Client:
    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        url = urllib.parse.urlsplit(base_url)
        self.connection = HTTPSConnection if url.scheme == "https" else HTTPConnection
        self.netloc, self.prefix, self.timeout = url.netloc, url.path.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, path: str, body: dict | None = None) -> bytes | None:
        """What a GET (a POST of body, if given) answers, or None for an error status."""
        conn = self.connection(self.netloc, timeout=self.timeout)
        try:
            conn.request("GET" if body is None else "POST", self.prefix + path,
                         None if body is None else json.dumps(body), self.headers)
            response = conn.getresponse()
            answer = response.read()
            return answer if response.status == 200 else None
        finally:
            conn.close()

    def call_json(self, path: str, body: dict | None = None) -> dict | None:
        answer = self.call(path, body)
        return None if answer is None else json.loads(answer)

    def stream(self, path: str, body: dict, chat: bool, record: RequestTimes, clock) -> None:
        """POST a streamed (chat) completion and record when each chunk with text arrives,
        and the text; the token counts come from the usage of the last chunk."""
        conn = self.connection(self.netloc, timeout=self.timeout)
        try:
            conn.request("POST", self.prefix + path, json.dumps(body), self.headers)
            response = conn.getresponse()
            if response.status != 200:
                record.error = f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
                return
            chunks = 0
            for raw in response:
                raw = raw.strip()
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return
                choices = chunk.get("choices")
                text = choices and (choices[0].get("delta", {}).get("content") if chat else choices[0].get("text"))
                if text:
                    record.event_times.append(clock())
                    record.text += text
                    chunks += 1
                if chunk.get("usage"):
                    record.num_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
            if not record.num_tokens:  # a server without usage in its stream: a token per chunk
                record.num_tokens = chunks
            if not record.event_times:  # nothing but tokens without text: their end stands for their start
                record.event_times.append(clock())
        except (OSError, ValueError) as err:
            record.error = f"{type(err).__name__}: {err}"
        finally:
            conn.close()


def served_model(client: Client) -> str:
    models = client.call_json("/v1/models")
    if not models or not models.get("data"):
        raise ValueError(f"no --model given, and {client.netloc} lists no model at /v1/models")
    return models["data"][0]["id"]


def base_url(args: argparse.Namespace) -> str:
    """--base-url, else http://HOST:PORT (an IPv6 host in brackets)."""
    if args.base_url:
        return args.base_url
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def endpoint(args: argparse.Namespace) -> tuple[str, bool]:
    """The path requests go to, and whether it is a chat endpoint (backend openai-chat)."""
    chat = args.backend == "openai-chat"
    path = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    if chat != path.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--backend {args.backend} streams {'chat ' if chat else ''}completions; "
                         f"--endpoint {path} is {'not ' if chat else ''}a chat completions endpoint")
    return path, chat


def selected_percentiles(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    metrics = args.percentile_metrics.split(",")
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: {unknown[0]!r} is none of {', '.join(PERCENTILE_METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        percentiles = []
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(
            f"--metric-percentiles takes numbers in 0..100 separated by commas, got {args.metric_percentiles!r}"
        )
    return metrics, percentiles


def dataset_requests(args: argparse.Namespace, client: Client, model: str, chat: bool) -> list[SampleRequest]:
    """The dataset's requests; a chat's random prompts as the text of their token ids."""
    if dataset_name(args) == "sharegpt":
        def count_tokens(text: str) -> int:
            answer = client.call_json("/tokenize", {"model": model, "prompt": text})
            if answer is None:
                raise ValueError(f"{client.netloc}'s /tokenize did not count a ShareGPT prompt's tokens")
            return answer["count"]

        output_len = args.output_len or args.sharegpt_output_len
        return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, count_tokens, output_len)
    rng = np.random.default_rng(args.seed)
    requests = random_requests(rng, args.num_prompts, args.input_len or args.random_input_len,
                               args.output_len or args.random_output_len, args.random_range_ratio,
                               args.prompt_vocab_size)
    for request in requests if chat else ():
        answer = client.call_json("/detokenize", {"model": model, "tokens": request.prompt})
        if answer is None:
            raise ValueError(f"{client.netloc}'s /detokenize did not decode a random prompt for the chat endpoint")
        request.prompt = answer["prompt"]
    return requests


def arrival_times(rng: np.random.Generator, num: int, rate: float, burstiness: float) -> np.ndarray:
    """vLLM's arrivals: gaps from a gamma distribution of shape `burstiness` (1: Poisson)
    and mean 1 / rate, scaled so that the last request comes at num / rate; inf: all at
    once."""
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.full(num, 1 / rate) if math.isinf(burstiness) else rng.gamma(burstiness, 1 / (rate * burstiness), num)
    times = np.cumsum(gaps)
    return times * (num / rate) / times[-1]


def spec_counters(client: Client) -> dict | None:
    """The server's speculative decoding counters (vLLM's names or jaxmtp's), None where
    /metrics has none."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxmtp.server.metrics import NAMES

    text = client.call("/metrics")
    try:
        families = list(text_string_to_metric_families(text.decode())) if text is not None else []
    except ValueError:  # not Prometheus' text: some other server's page
        families = []
    counts, per_position, found = dict.fromkeys(SPEC_COUNTERS, 0.0), {}, False
    for family in families:
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            for key, series in SPEC_COUNTERS.items():
                if family.name in NAMES[series]:
                    counts[key] += sample.value
                    found = True
            if family.name in NAMES["accepted_per_position"]:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    return {**counts, "per_position": per_position} if found else None


def spec_result(before: dict | None, after: dict | None) -> dict:
    """vLLM's spec_decode_* figures of the drafts between two reads of the counters."""
    if before is None or after is None:
        return {}
    drafts, drafted, accepted = (after[key] - before[key] for key in SPEC_COUNTERS)
    if drafted <= 0:
        return {}
    positions = sorted(after["per_position"])
    return {
        "spec_decode_acceptance_rate": accepted / drafted * 100,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "spec_decode_num_drafts": int(drafts), "spec_decode_draft_tokens": int(drafted),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": [
            (after["per_position"][p] - before["per_position"].get(p, 0.0)) / drafts for p in positions
        ] if drafts else [],
    }


def serving_result(requests: list[RequestTimes], duration: float, metrics: list[str],
                   percentiles: list[float]) -> dict:
    """vLLM's figures: counts and throughput over `duration` seconds, each request's
    lengths, times, text and error, and the statistics of the chosen metrics in ms;
    failed requests are counted, not timed."""
    done = [r for r in requests if r.error is None]
    output_lens = [r.num_tokens if r.error is None else 0 for r in requests]
    total_input, total_output = sum(r.prompt_tokens for r in done), sum(output_lens)
    result = {
        "duration": duration, "completed": len(done), "failed": len(requests) - len(done),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(done) / duration, "request_goodput": None,  # no --goodput
        "output_throughput": total_output / duration, "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [r.prompt_tokens for r in requests], "output_lens": output_lens,
        "ttfts": [r.ttft if r.event_times else 0.0 for r in requests], "itls": [r.itls for r in requests],
        "generated_texts": [r.text for r in requests], "errors": [r.error or "" for r in requests],
    }
    values = {
        "ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itls], "e2el": [r.e2e for r in done],
    }
    for metric in metrics:
        result.update({f"{key}_{metric}_ms": value for key, value in vllm_stats(values[metric], percentiles).items()})
    return result


def summary_lines(result: dict, metrics: list[str]) -> list[str]:
    """vLLM's printed summary of a result."""
    lines = [heading(" Serving Benchmark Result ", "="), line("Successful requests:", result["completed"]),
             line("Failed requests:", result["failed"])]
    if result["max_concurrency"] is not None:
        lines.append(line("Maximum request concurrency:", result["max_concurrency"]))
    if result["request_rate"] != "inf":
        lines.append(line("Request rate configured (RPS):", float(result["request_rate"])))
    lines += [
        line("Benchmark duration (s):", result["duration"]), line("Total input tokens:", result["total_input_tokens"]),
        line("Total generated tokens:", result["total_output_tokens"]),
        line("Request throughput (req/s):", result["request_throughput"]),
        line("Output token throughput (tok/s):", result["output_throughput"]),
        line("Total Token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for metric in metrics:
        name, title = PERCENTILE_METRICS[metric]
        lines.append(heading(title))
        for key in [k for k in result if k.endswith(f"_{metric}_ms") and not k.startswith("std_")]:
            stat = key.split("_")[0]
            lines.append(line(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {name} (ms):",
                              result[key]))
    if "spec_decode_acceptance_rate" in result:
        lines += [
            heading("Speculative Decoding"), line("Acceptance rate (%):", result["spec_decode_acceptance_rate"]),
            line("Acceptance length:", result["spec_decode_acceptance_length"]),
            line("Drafts:", result["spec_decode_num_drafts"]),
            line("Draft tokens:", result["spec_decode_draft_tokens"]),
            line("Accepted tokens:", result["spec_decode_accepted_tokens"]), "Per-position acceptance (%):",
            *(line(f"  Position {i}:", rate * 100)
              for i, rate in enumerate(result["spec_decode_per_position_acceptance_rates"])),
        ]
    return [*lines, "=" * 50]


def result_path(args: argparse.Namespace, model_id: str, date: str) -> str:
    """Where --save-result writes: --result-filename, else vLLM's
    {label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json; in --result-dir."""
    concurrency = "" if args.max_concurrency is None else f"-concurrency{args.max_concurrency}"
    name = args.result_filename or (f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-"
                                    f"{model_id.split('/')[-1]}-{date}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def serve(args: argparse.Namespace) -> dict:
    path, chat = endpoint(args)
    metrics, percentiles = selected_percentiles(args)
    client = Client(base_url(args), args.api_key, args.request_timeout)
    model = args.model or served_model(client)
    requests = dataset_requests(args, client, model, chat)
    ignore_eos = args.ignore_eos or dataset_name(args) == "random"  # as vLLM's: random prompts run to their length
    arrivals = arrival_times(np.random.default_rng(args.seed + 1), len(requests), args.request_rate, args.burstiness)
    print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness} "
          f"({'Poisson process' if args.burstiness == 1 else 'Gamma distribution'})\n"
          f"Maximum request concurrency: {args.max_concurrency}", flush=True)
    spec_before = spec_counters(client)
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    times = [RequestTimes(sent=0.0, prompt_tokens=r.prompt_len) for r in requests]  # usage replaces the count

    def send(i: int) -> None:  # on a free worker: at most max_concurrency in flight
        request, times[i].sent = requests[i], clock()
        body = {"model": model, "temperature": args.temperature, "ignore_eos": ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}
        if chat:
            body.update(messages=[{"role": "user", "content": request.prompt}],
                        max_completion_tokens=request.expected_output_len)
        else:
            body.update(prompt=request.prompt, max_tokens=request.expected_output_len)
        client.stream(path, body, chat, times[i], clock)

    with concurrent.futures.ThreadPoolExecutor(args.max_concurrency or len(requests)) as pool:
        futures = []
        for i, arrival in enumerate(arrivals):
            time.sleep(max(0.0, arrival - clock()))
            futures.append(pool.submit(send, i))
        for future in futures:
            future.result()
    duration = clock()
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    version = client.call_json("/version") or {}
    result = {
        "date": date, "endpoint_type": args.backend, "backend": args.backend, "label": args.label, "model_id": model,
        "tokenizer_id": model,  # the server's /tokenize counts the prompts
        "num_prompts": args.num_prompts, "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        **serving_result(times, duration, metrics, percentiles), **spec_result(spec_before, spec_counters(client)),
        # the server's device, when its /version says; the date and versions are the client's
        "environment": environment(device=version.get("device", "the server's (its /version names none)")) |
        {"server_version": version.get("version")},
    }
    if not args.save_detailed:
        result = {key: value for key, value in result.items() if key not in DETAILED}
    saved = args.output_json or (result_path(args, model, date) if args.save_result else None)
    emit("jaxmtp bench serve", summary_lines(result, metrics), result, saved)
    return result


def default_api_key() -> str | None:
    return os.environ.get("JAXMTP_API_KEY") or os.environ.get("OPENAI_API_KEY")
