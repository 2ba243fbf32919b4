"""`jaxmtp bench`, as vLLM's `vllm bench`, with its flags and result keys: latency
(batch-1 decode by default), throughput (offline, many prompts) and serve (a client
against a running OpenAI-compatible server). Each report also states the date, the
device and the JAX version; latency's and throughput's --output-json and serve's
--save-result save it."""

from __future__ import annotations

import argparse

from jaxmtp.args import HelpFormatter, add_engine_args
from jaxmtp.server.config import ServerConfig

DATASETS = ("random", "sharegpt")
OFFLINE_EPILOG = "--seed also seeds the random prompts, as vLLM's."


def _add_offline(parser: argparse.ArgumentParser) -> None:
    """The flags latency and throughput share: vLLM's, and the engine's."""
    parser.add_argument("--n", type=_positive(int), default=1, help="samples generated per prompt")
    parser.add_argument("--output-json", default=None, help="also write the report to this JSON file (default: none)")
    add_engine_args(parser)
    parser.add_argument("--compilation-cache-dir", default=ServerConfig.compilation_cache_dir,
                        help="persistent XLA cache, as `jaxmtp serve`'s; '' disables it (default: %(default)s)")
    parser.add_argument("--compile-all", action="store_true",
                        help="compile every batch shape before measuring, not only those the warm-up runs use")


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _command(mode):
    """A mode (it returns its report) as a command (it returns the exit status)."""
    def run(args: argparse.Namespace) -> int:
        mode(args)
        return 0

    return run


def add_bench_parser(sub) -> None:
    from jaxmtp.bench import offline, serve

    bench = sub.add_parser("bench", help="benchmark latency, throughput or a running server",
                           description=__doc__, formatter_class=HelpFormatter)
    modes = bench.add_subparsers(dest="bench_mode", required=True, help="what to measure")
    lat = modes.add_parser("latency", help="decode a small batch again and again (default: one request)",
                           epilog=OFFLINE_EPILOG, formatter_class=HelpFormatter)
    lat.add_argument("--input-len", type=_positive(int), default=32, help="prompt tokens per request (random ids)")
    lat.add_argument("--output-len", type=_positive(int), default=128,
                     help="tokens each request generates (greedy, eos ignored)")
    lat.add_argument("--batch-size", type=_positive(int), default=1, help="requests decoded together")
    lat.add_argument("--num-iters", type=_positive(int), default=10, help="timed iterations")
    lat.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first (they compile)")
    _add_offline(lat)
    lat.set_defaults(func=_command(offline.latency))
    thr = modes.add_parser("throughput", help="many requests at once, offline", epilog=OFFLINE_EPILOG,
                           formatter_class=HelpFormatter)
    thr.add_argument("--dataset-name", choices=DATASETS, default=None,
                     help="random token prompts, or a ShareGPT file's (default: sharegpt with --dataset-path, "
                     "else random)")
    thr.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (no default)")
    thr.add_argument("--num-prompts", type=_positive(int), default=64, help="requests")
    thr.add_argument("--input-len", type=_positive(int), default=32, help="prompt tokens per random request")
    thr.add_argument("--output-len", type=_positive(int), default=None,
                     help="tokens each request generates, greedy and eos ignored (default: 128 for random, the "
                     "conversation's for sharegpt)")
    thr.add_argument("--random-range-ratio", type=float, default=0.0,
                     help="random lengths are drawn from [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    thr.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="run as many other prompts of the same lengths first, untimed (they compile)")
    _add_offline(thr)
    thr.set_defaults(func=_command(offline.throughput))
    srv = modes.add_parser("serve", help="a client against a running OpenAI-compatible server",
                           formatter_class=HelpFormatter)
    srv.add_argument("--backend", choices=serve.BACKENDS, default="openai",
                     help="vllm and openai stream /v1/completions, openai-chat /v1/chat/completions")
    srv.add_argument("--base-url", default=None, help="the server's address (default: http://HOST:PORT)")
    srv.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    srv.add_argument("--port", type=int, default=8000, help="the server's port, without --base-url")
    srv.add_argument("--endpoint", default=None,
                     help="the path requests go to (default: /v1/completions; openai-chat's /v1/chat/completions)")
    srv.add_argument("--model", default=None, help="the model name to request (default: the first of /v1/models)")
    srv.add_argument("--dataset-name", choices=DATASETS, default="random",
                     help="random token prompts, or a ShareGPT file's")
    srv.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (no default)")
    srv.add_argument("--num-prompts", type=_positive(int), default=32, help="requests")
    srv.add_argument("--random-input-len", type=_positive(int), default=32, help="prompt tokens per random request")
    srv.add_argument("--random-output-len", type=_positive(int), default=64,
                     help="tokens each random request generates")
    srv.add_argument("--random-range-ratio", type=float, default=0.0,
                     help="random lengths are drawn from [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    srv.add_argument("--sharegpt-output-len", type=_positive(int), default=None,
                     help="tokens each ShareGPT request generates (default: its conversation's second turn's)")
    srv.add_argument("--input-len", type=_positive(int), default=None,
                     help="sets --random-input-len, as vLLM's (default: none)")
    srv.add_argument("--output-len", type=_positive(int), default=None,
                     help="sets --random-output-len and --sharegpt-output-len, as vLLM's (default: none)")
    srv.add_argument("--prompt-vocab-size", type=_positive(int), default=500,
                     help="random token ids are drawn below this; keep it within the served model's vocabulary")
    srv.add_argument("--seed", "--prompt-seed", type=int, default=0, help="seed of the prompts and the arrivals")
    srv.add_argument("--request-rate", type=_positive(float), default=float("inf"),
                     help="requests per second (inf: all at once)")
    srv.add_argument("--burstiness", type=_positive(float), default=1.0,
                     help="the gamma distribution's shape of the gaps between arrivals: 1 is a Poisson process, "
                     "less is burstier, more is more even")
    srv.add_argument("--max-concurrency", type=_positive(int), default=None,
                     help="requests in flight at most (default: no limit)")
    srv.add_argument("--temperature", type=float, default=0.0,
                     help="the requests' temperature (0: greedy; vLLM's sends none unless given)")
    srv.add_argument("--ignore-eos", action="store_true",
                     help="generate each request's whole output length; random prompts always do, as vLLM's")
    srv.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                     help="the latencies to report statistics of: ttft, tpot, itl, e2el, separated by commas")
    srv.add_argument("--metric-percentiles", default="99", help="their percentiles, separated by commas")
    srv.add_argument("--save-result", action="store_true", help="write the result as JSON, in vLLM's layout")
    srv.add_argument("--save-detailed", action="store_true",
                     help="with each request's input and output lengths, TTFT, ITLs, text and error")
    srv.add_argument("--result-dir", default=None, help="where --save-result writes (default: the current folder)")
    srv.add_argument("--result-filename", default=None,
                     help="the file --save-result writes (default: vLLM's "
                     "LABEL-{request_rate}qps[-concurrencyN]-MODEL-DATE.json)")
    srv.add_argument("--label", default=None, help="the result's label, its file name's start (default: --backend)")
    srv.add_argument("--output-json", default=None,
                     help="write the result as JSON to this file, as --save-result --result-filename (default: none)")
    srv.add_argument("--api-key", default=serve.default_api_key(),
                     help="sent as 'Authorization: Bearer KEY' (default: $JAXMTP_API_KEY or $OPENAI_API_KEY)")
    srv.add_argument("--request-timeout", type=_positive(float), default=600.0, help="seconds a request may take")
    srv.set_defaults(func=_command(serve.serve))
