"""The `jaxmtp` command: generate (and serve, bench, train-mtp as they land)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "checkpoints" / "stories260K")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model folder (default: the shipped stories260K)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "orbax", "dummy"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--prefill-chunk-size", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--mtp-boundary", choices=["next_chunk", "sampled"], default="next_chunk")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"])
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        load_format=args.load_format,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        num_speculative_tokens=args.num_speculative_tokens,
        mtp_boundary=args.mtp_boundary,
        attention_backend=args.attention_backend,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxmtp import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
    )
    sys.stdout.write(args.prompt)
    printed = ""
    for chunk in llm.stream(args.prompt, params):
        text = chunk.outputs[0].text
        sys.stdout.write(text[len(printed) :])
        sys.stdout.flush()
        printed = text
    sys.stdout.write("\n")
    if chunk.spec_stats:
        print(f"[mtp] mean acceptance length {chunk.spec_stats['mean_acceptance_length']:.2f}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxmtp")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", nargs="?", default="Once upon a time")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sample-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxmtp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
