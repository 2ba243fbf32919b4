"""`jaxmtp bench`: latency (batch-1 decode by default), throughput (offline, many
prompts) and serve (a client against a running OpenAI-compatible server). Each report
states the date, the device and the JAX version; --output-json saves it."""

from __future__ import annotations

import argparse

from jaxmtp.args import HelpFormatter, add_engine_args
from jaxmtp.server.config import ServerConfig


def _add_common(parser: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    parser.add_argument("--input-len", type=int, default=input_len, help="prompt tokens per request (random ids)")
    parser.add_argument("--output-len", type=int, default=output_len,
                        help="tokens each request generates (greedy, eos ignored)")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts (and of serve's arrivals)")
    parser.add_argument("--output-json", default=None, help="also write the report to this JSON file (default: none)")


def _add_engine(parser: argparse.ArgumentParser) -> None:
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
                           formatter_class=HelpFormatter)
    _add_common(lat, 32, 128)
    lat.add_argument("--batch-size", type=_positive(int), default=1, help="requests decoded together")
    lat.add_argument("--num-iters", type=_positive(int), default=10, help="timed iterations")
    lat.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first (they compile)")
    _add_engine(lat)
    lat.set_defaults(func=_command(offline.latency))
    thr = modes.add_parser("throughput", help="many requests at once, offline", formatter_class=HelpFormatter)
    _add_common(thr, 32, 128)
    thr.add_argument("--num-prompts", type=_positive(int), default=64, help="requests")
    thr.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="run as many other prompts of the same lengths first, untimed (they compile)")
    _add_engine(thr)
    thr.set_defaults(func=_command(offline.throughput))
    srv = modes.add_parser("serve", help="a client against a running OpenAI-compatible server",
                           formatter_class=HelpFormatter)
    _add_common(srv, 32, 64)
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    srv.add_argument("--model", default=None, help="the model name to request (default: the first of /v1/models)")
    srv.add_argument("--num-prompts", type=_positive(int), default=32, help="requests")
    srv.add_argument("--request-rate", type=_positive(float), default=float("inf"),
                     help="requests per second, Poisson arrivals (inf: all at once)")
    srv.add_argument("--max-concurrency", type=_positive(int), default=None,
                     help="requests in flight at most (default: no limit)")
    srv.add_argument("--prompt-vocab-size", type=_positive(int), default=500,
                     help="prompt token ids are drawn below this; keep it within the served model's vocabulary")
    srv.add_argument("--api-key", default=serve.default_api_key(),
                     help="sent as 'Authorization: Bearer KEY' (default: $JAXMTP_API_KEY or $OPENAI_API_KEY)")
    srv.add_argument("--request-timeout", type=_positive(float), default=600.0, help="seconds a request may take")
    srv.set_defaults(func=_command(serve.serve))
