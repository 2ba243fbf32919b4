"""The in-process benchmarks, as vLLM's `vllm bench latency` and `vllm bench
throughput`: `latency` (a small batch, default one request, decoded again and again:
each iteration's latency, and TTFT, TPOT, ITL) and `throughput` (many requests at once,
offline: random token prompts, or a ShareGPT file's). Decoding is greedy with eos
ignored, so every request produces its output length; warm-up runs of other prompts of
the same lengths compile the shapes the timed runs use (the report counts any compile
that still happens while timed). vLLM's keys lead the JSON, jaxmtp's sections follow."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import numpy as np

from jaxmtp.bench.datasets import SampleRequest, dataset_name, random_requests, sharegpt_requests
from jaxmtp.bench.stats import RequestTimes, emit, environment, summarize
from jaxmtp.engine.sampling_params import RequestOutputKind, SamplingParams

_request_ids = itertools.count()
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # vLLM's
RANDOM_OUTPUT_LEN = 128  # vLLM's random dataset's


def run_requests(
    engine, prompts: list, params: list[SamplingParams], arrivals=None
) -> tuple[list[RequestTimes], float]:
    """Run the requests on `engine` in this thread, each added once its arrival (seconds
    from the start; None: all at the start) has come. Returns each request's times,
    measured from its arrival (its tokens those of all its n samples), and the seconds
    until the last one finished."""
    n = len(prompts)
    arrivals = [0.0] * n if arrivals is None else [float(a) for a in arrivals]
    times: list[RequestTimes] = []
    index: dict[str, int] = {}
    finished = 0
    start = time.perf_counter()
    while finished < n:
        now = time.perf_counter() - start
        while len(times) < n and arrivals[len(times)] <= now:
            i = len(times)
            request_id = f"bench-{next(_request_ids)}"
            delta = dataclasses.replace(params[i], output_kind=RequestOutputKind.DELTA)
            engine.add_request(request_id, prompts[i], delta)
            index[request_id] = i
            times.append(RequestTimes(sent=arrivals[i]))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[len(times)] - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            record = times[index[out.request_id]]
            record.prompt_tokens = len(out.prompt_token_ids)
            record.record(now, sum(len(sample.token_ids) for sample in out.outputs))
            if out.finished:
                finished += 1
                record.error = out.error
    return times, time.perf_counter() - start


def _engine(args: argparse.Namespace):
    from jaxmtp.args import engine_kwargs, resolve_model
    from jaxmtp.engine.llm_engine import LLMEngine
    from jaxmtp.worker.programs import use_persistent_cache

    if args.compilation_cache_dir:
        use_persistent_cache(args.compilation_cache_dir)
    engine = LLMEngine(resolve_model(args), **engine_kwargs(args))
    if args.compile_all:
        engine.warmup()
    return engine


def _settings(args: argparse.Namespace, engine, **extra) -> dict:
    config = engine.config
    return {
        "model": str(engine.model_dir), **extra, "n": args.n, "num_speculative_tokens": config.num_speculative_tokens,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "prefix_caching": config.enable_prefix_caching, "dtype": engine.model_config.dtype, "seed": args.seed,
    }


def _spec_results(engine, before) -> dict:
    """Mean acceptance length of the drafts verified since `before` (a copy of the stats' counters)."""
    steps, accepted = engine.stats.spec.num_steps - before[0], engine.stats.spec.accepted - before[1]
    return {"mean_acceptance_length": 1.0 + accepted / steps} if steps else {}


def _params(args: argparse.Namespace, requests: list[SampleRequest]) -> list[SamplingParams]:
    return [SamplingParams(n=args.n, max_tokens=r.expected_output_len, temperature=0.0, ignore_eos=True)
            for r in requests]


def latency(args: argparse.Namespace) -> dict:
    from jaxmtp.worker.programs import num_compiles

    engine = _engine(args)
    rng = np.random.default_rng(args.seed)

    def iteration():  # fresh prompts each time: no prefix-cache hits
        batch = random_requests(rng, args.batch_size, args.input_len, args.output_len, 0.0,
                                engine.model_config.vocab_size)
        return run_requests(engine, [r.prompt for r in batch], _params(args, batch))

    for _ in range(args.num_iters_warmup):
        iteration()
    compiles, spec = num_compiles(), (engine.stats.spec.num_steps, engine.stats.spec.accepted)
    runs = [iteration() for _ in range(args.num_iters)]
    seconds = np.array([duration for _, duration in runs])
    summary = summarize([r for times, _ in runs for r in times], float(seconds.sum()))
    percentiles = dict(zip(LATENCY_PERCENTILES, np.percentile(seconds, LATENCY_PERCENTILES).tolist()))
    result = {
        "avg_latency": float(seconds.mean()), "std_latency": float(seconds.std()), "latencies": seconds.tolist(),
        "percentiles": percentiles,
        "environment": environment(),
        "settings": _settings(args, engine, input_len=args.input_len, output_len=args.output_len,
                              batch_size=args.batch_size, num_iters=args.num_iters,
                              num_iters_warmup=args.num_iters_warmup),
        "results": {
            "output_tokens_per_s": summary["output_tokens_per_s"], "ttft_ms": summary["ttft_ms"],
            "tpot_ms": summary["tpot_ms"], "itl_ms": summary["itl_ms"], **_spec_results(engine, spec),
            "failed": summary["failed"], "compiles_while_timed": num_compiles() - compiles,
        },
    }
    lines = [f"Avg latency: {result['avg_latency']} seconds", f"Std latency: {result['std_latency']} seconds"]
    lines += [f"{p}% percentile latency: {value} seconds" for p, value in percentiles.items()]
    emit("jaxmtp bench latency", lines, result, args.output_json)
    return result


def _requests(args: argparse.Namespace, engine) -> list[SampleRequest]:
    if dataset_name(args) == "random":
        rng = np.random.default_rng(args.seed)
        return random_requests(rng, args.num_prompts, args.input_len, args.output_len or RANDOM_OUTPUT_LEN,
                               args.random_range_ratio, engine.model_config.vocab_size)
    return sharegpt_requests(args.dataset_path, args.num_prompts, args.seed,
                             lambda text: len(engine.encode_prompt(text)[1]), args.output_len)


def throughput(args: argparse.Namespace) -> dict:
    from jaxmtp.worker.programs import num_compiles

    engine = _engine(args)
    requests = _requests(args, engine)
    params = _params(args, requests)
    if args.warmup:  # other prompts of the same lengths
        rng = np.random.default_rng(args.seed + 1)
        vocab = engine.model_config.vocab_size
        run_requests(engine, [rng.integers(3, vocab, size=r.prompt_len).tolist() for r in requests], params)
    compiles, spec = num_compiles(), (engine.stats.spec.num_steps, engine.stats.spec.accepted)
    times, seconds = run_requests(engine, [r.prompt for r in requests], params)
    summary = summarize(times, seconds)
    prompt_tokens, output_tokens = sum(t.prompt_tokens for t in times), sum(t.num_tokens for t in times)
    result = {
        "elapsed_time": seconds, "num_requests": len(requests), "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(requests) / seconds, "tokens_per_second": (prompt_tokens + output_tokens) / seconds,
        "environment": environment(),
        "settings": _settings(args, engine, dataset_name=dataset_name(args), dataset_path=args.dataset_path,
                              num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                              random_range_ratio=args.random_range_ratio, warmup=args.warmup),
        "results": {**{k: summary[k] for k in ("failed", "output_tokens_per_s", "ttft_ms", "e2e_ms")},
                    **_spec_results(engine, spec), "compiles_while_timed": num_compiles() - compiles},
    }
    lines = [
        (f"Throughput: {result['requests_per_second']:.2f} requests/s, "
         f"{result['tokens_per_second']:.2f} total tokens/s, {output_tokens / seconds:.2f} output tokens/s"),
        f"Total num prompt tokens:  {prompt_tokens}", f"Total num output tokens:  {output_tokens}",
    ]
    emit("jaxmtp bench throughput", lines, result, args.output_json)
    return result
