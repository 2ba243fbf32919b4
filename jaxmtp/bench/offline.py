"""The in-process benchmarks: `latency` (a small batch, default one request, decoded
again and again: per-iteration latency, TTFT, TPOT) and `throughput` (many requests at
once, offline). Both run random token prompts of fixed lengths with greedy decoding
and eos ignored, so every request produces exactly --output-len tokens; warm-up runs of
other prompts of the same lengths compile the shapes the timed runs use (the report
counts any compile that still happens while timed)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import numpy as np

from jaxmtp.bench.stats import RequestTimes, emit, environment, percentiles_ms, summarize
from jaxmtp.engine.sampling_params import RequestOutputKind, SamplingParams

_request_ids = itertools.count()


def random_prompts(rng: np.random.Generator, num: int, length: int, vocab_size: int) -> list[list[int]]:
    """Token ids drawn past the first three (the unk, bos and eos of Llama-2-style vocabularies)."""
    return [rng.integers(3, vocab_size, size=length).tolist() for _ in range(num)]


def run_requests(engine, prompts: list, params: list[SamplingParams], arrivals=None) -> tuple[list[RequestTimes], float]:
    """Run the requests on `engine` in this thread, each added once its arrival (seconds
    from the start; None: all at the start) has come. Returns each request's times,
    measured from its arrival, and the seconds until the last one finished."""
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
            engine.add_request(request_id, prompts[i], dataclasses.replace(params[i], output_kind=RequestOutputKind.DELTA))
            index[request_id] = i
            times.append(RequestTimes(sent=arrivals[i], prompt_tokens=len(prompts[i])))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[len(times)] - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            record = times[index[out.request_id]]
            record.record(now, len(out.outputs[0].token_ids))
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
        "model": str(engine.model_dir), "input_len": args.input_len, "output_len": args.output_len, **extra,
        "num_speculative_tokens": config.num_speculative_tokens, "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens, "prefix_caching": config.enable_prefix_caching,
        "dtype": engine.model_config.dtype,
    }


def _spec_results(engine, before) -> dict:
    """Mean acceptance length of the drafts verified since `before` (a copy of the stats' counters)."""
    steps, accepted = engine.stats.spec.num_steps - before[0], engine.stats.spec.accepted - before[1]
    return {"mean_acceptance_length": 1.0 + accepted / steps} if steps else {}


def latency(args: argparse.Namespace) -> dict:
    from jaxmtp.worker.programs import num_compiles

    engine = _engine(args)
    rng = np.random.default_rng(args.prompt_seed)
    params = [SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)] * args.batch_size

    def iteration():  # fresh prompts each time: no prefix-cache hits
        return run_requests(engine, random_prompts(rng, args.batch_size, args.input_len, engine.model_config.vocab_size),
                            params)

    for _ in range(args.num_iters_warmup):
        iteration()
    compiles, spec = num_compiles(), (engine.stats.spec.num_steps, engine.stats.spec.accepted)
    runs = [iteration() for _ in range(args.num_iters)]
    seconds = [duration for _, duration in runs]
    summary = summarize([r for times, _ in runs for r in times], sum(seconds))
    result = {
        "environment": environment(),
        "settings": _settings(args, engine, batch_size=args.batch_size, num_iters=args.num_iters,
                              num_iters_warmup=args.num_iters_warmup),
        "results": {
            "latency_ms": percentiles_ms(seconds), "output_tokens_per_s": summary["output_tokens_per_s"],
            "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"], "itl_ms": summary["itl_ms"],
            **_spec_results(engine, spec), "failed": summary["failed"], "compiles_while_timed": num_compiles() - compiles,
        },
    }
    emit("jaxmtp bench latency", result, args.output_json)
    return result


def throughput(args: argparse.Namespace) -> dict:
    from jaxmtp.worker.programs import num_compiles

    engine = _engine(args)
    rng = np.random.default_rng(args.prompt_seed)
    vocab = engine.model_config.vocab_size
    params = [SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)] * args.num_prompts
    if args.warmup:
        run_requests(engine, random_prompts(rng, args.num_prompts, args.input_len, vocab), params)
    compiles, spec = num_compiles(), (engine.stats.spec.num_steps, engine.stats.spec.accepted)
    times, seconds = run_requests(engine, random_prompts(rng, args.num_prompts, args.input_len, vocab), params)
    summary = summarize(times, seconds)
    keys = ("requests", "failed", "duration_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
            "ttft_ms", "e2e_ms")
    result = {
        "environment": environment(),
        "settings": _settings(args, engine, num_prompts=args.num_prompts, warmup=args.warmup),
        "results": {**{k: summary[k] for k in keys}, **_spec_results(engine, spec),
                    "compiles_while_timed": num_compiles() - compiles},
    }
    emit("jaxmtp bench throughput", result, args.output_json)
    return result
