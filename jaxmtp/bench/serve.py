"""`jaxmtp bench serve`: a client against a running OpenAI-compatible server (jaxmtp's
or any other). It streams /v1/completions requests of random token prompts, sent at
--request-rate (Poisson arrivals, seeded; inf: all at once) with at most
--max-concurrency in flight, and reports request and token throughput and the TTFT,
TPOT, ITL and end-to-end percentiles. Only the standard library: a thread per request
in flight."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time
import urllib.parse
from http.client import HTTPConnection, HTTPSConnection

import numpy as np

from jaxmtp.bench.offline import random_prompts
from jaxmtp.bench.stats import RequestTimes, emit, environment, summarize


class Client:
    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        url = urllib.parse.urlsplit(base_url)
        self.connection = HTTPSConnection if url.scheme == "https" else HTTPConnection
        self.netloc, self.prefix, self.timeout = url.netloc, url.path.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get_json(self, path: str) -> dict | None:
        """The JSON a GET answers, or None for any error status."""
        conn = self.connection(self.netloc, timeout=self.timeout)
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            response = conn.getresponse()
            body = response.read()
            return json.loads(body) if response.status == 200 else None
        finally:
            conn.close()

    def stream_completion(self, body: dict, record: RequestTimes, clock) -> None:
        """POST a streamed completion and record when each chunk with text arrives; the
        token count comes from the usage of the last chunk."""
        conn = self.connection(self.netloc, timeout=self.timeout)
        try:
            conn.request("POST", self.prefix + "/v1/completions", json.dumps(body), self.headers)
            response = conn.getresponse()
            if response.status != 200:
                record.error = f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
                return
            chunks = 0
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    record.event_times.append(clock())
                    chunks += 1
                if chunk.get("usage"):
                    record.num_tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
            if not record.num_tokens:  # a server without usage in its stream: a token per chunk
                record.num_tokens = chunks
        except (OSError, ValueError) as err:
            record.error = f"{type(err).__name__}: {err}"
        finally:
            conn.close()


def served_model(client: Client) -> str:
    models = client.get_json("/v1/models")
    if not models or not models.get("data"):
        raise ValueError(f"no --model given, and {client.netloc} lists no model at /v1/models")
    return models["data"][0]["id"]


def serve(args: argparse.Namespace) -> dict:
    client = Client(args.base_url, args.api_key, args.request_timeout)
    model = args.model or served_model(client)
    rng = np.random.default_rng(args.prompt_seed)
    prompts = random_prompts(rng, args.num_prompts, args.input_len, args.prompt_vocab_size)
    gaps = np.zeros(args.num_prompts) if args.request_rate == float("inf") else \
        rng.exponential(1 / args.request_rate, args.num_prompts)
    arrivals = np.cumsum(gaps) - gaps[0]
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    times = [RequestTimes(sent=0.0) for _ in prompts]

    def send(i: int) -> None:  # on a free worker: at most max_concurrency in flight
        times[i].sent = clock()
        body = {"model": model, "prompt": prompts[i], "max_tokens": args.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        client.stream_completion(body, times[i], clock)

    with concurrent.futures.ThreadPoolExecutor(args.max_concurrency or args.num_prompts) as pool:
        futures = []
        for i, arrival in enumerate(arrivals):
            time.sleep(max(0.0, arrival - clock()))
            futures.append(pool.submit(send, i))
        for future in futures:
            future.result()
    duration = clock()
    version = client.get_json("/version") or {}
    result = {
        # the server's device, when its /version says; the date and versions are the client's
        "environment": environment(device=version.get("device", "the server's (its /version names none)")) |
        {"server_version": version.get("version")},
        "settings": {"base_url": args.base_url, "model": model, "num_prompts": args.num_prompts,
                     "input_len": args.input_len, "output_len": args.output_len, "request_rate": args.request_rate,
                     "max_concurrency": args.max_concurrency, "prompt_seed": args.prompt_seed},
        "results": summarize(times, duration),
    }
    emit("jaxmtp bench serve", result, args.output_json)
    return result


def default_api_key() -> str | None:
    return os.environ.get("JAXMTP_API_KEY") or os.environ.get("OPENAI_API_KEY")
