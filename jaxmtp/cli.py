"""The `jaxmtp` command: generate, serve (and bench, train-mtp as they land)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmtp.prefix_cache import PREFIX_CACHE_BOUNDARIES

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DEFAULT_MODEL = str(CHECKPOINTS / "stories260K-mtp")  # stories260K with its trained MTP head
DEFAULT_BASE = str(CHECKPOINTS / "stories260K")
DEFAULT_SPECULATIVE_TOKENS = 2  # for models that ship MTP weights


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model folder (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "orbax", "dummy"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--prefill-chunk-size", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help=f"MTP drafts per step (default {DEFAULT_SPECULATIVE_TOKENS} if the model has MTP weights, else 0)")
    parser.add_argument("--mtp-boundary", choices=["next_chunk", "sampled"], default="next_chunk")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV pages of earlier requests' shared prefixes (default: on)")
    parser.add_argument("--prefix-cache-boundary", choices=PREFIX_CACHE_BOUNDARIES, default="exact",
                        help="the MTP draft row at the end of the last reused page: exact (default), or the "
                        "ablations drop (vLLM) and stale (docs/prefix-cache.md)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="local devices that split the model's heads, MLP and vocabulary (docs/tensor-parallel.md)")
    parser.add_argument("--seed", type=int, default=0)


def speculative_tokens(args: argparse.Namespace) -> int:
    if args.num_speculative_tokens is not None:
        return args.num_speculative_tokens
    from jaxmtp.config import load_config

    return DEFAULT_SPECULATIVE_TOKENS if load_config(args.model).num_mtp_modules else 0


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
        num_speculative_tokens=speculative_tokens(args),
        mtp_boundary=args.mtp_boundary,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_boundary=args.prefix_cache_boundary,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tensor_parallel_size,
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


def cmd_train_mtp(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxmtp import LLM
    from jaxmtp import train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, max_num_seqs=64, max_num_batched_tokens=1024, seed=args.seed)
    if args.text_file:
        lines = [line for line in Path(args.text_file).read_text().split("\n\n") if line.strip()]
        corpus = [llm.tokenizer.encode(line) for line in lines]
    else:
        prompts = train.story_prompts(train.TRAIN_NAMES, train.TRAIN_OPENINGS)
        corpus = train.self_distillation_corpus(llm, prompts, args.samples_per_prompt, args.max_new_tokens, args.seed)
        held_out = train.story_prompts(train.HELD_OUT_NAMES, train.HELD_OUT_OPENINGS)
        corpus_eval = train.self_distillation_corpus(llm, held_out, 2, args.max_new_tokens, args.seed + 1)
    if args.text_file:
        split = max(1, len(corpus) // 20)
        corpus, corpus_eval = corpus[split:], corpus[:split]
    tokens, lengths = train.pad_sequences(corpus, args.seq_len)
    eval_tokens, eval_lengths = train.pad_sequences(corpus_eval, args.seq_len)
    print(f"train-mtp: {len(corpus)} training sequences ({int(lengths.sum())} tokens), {len(corpus_eval)} held out")
    config = train.TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, depths=args.depths,
        learning_rate=args.learning_rate, seed=args.seed, soft_targets=args.distill,
    )
    trainer = train.Trainer(llm.engine.params, llm.engine.model_config, config)
    state, history = trainer.fit(tokens, lengths, eval_tokens, eval_lengths, checkpoint_dir=out)
    trainer.export(state.module, out, args.model)
    train.write_history(history, out / "training_history.json")
    train.plot_loss(history, out / "loss.png")
    final = history["eval_accuracy"][-1]
    print(f"train-mtp: wrote {out}; held-out draft top-1 accuracy per depth {np.round(final, 4).tolist()}")
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
    tr = sub.add_parser("train-mtp", help="train an MTP draft module on a frozen base model")
    tr.add_argument("--model", default=DEFAULT_BASE)
    tr.add_argument("--out", required=True, help="engine checkpoint to write (base + MTP module)")
    tr.add_argument("--text-file", default=None, help="train on this text (blank-line separated) instead of self-distillation")
    tr.add_argument("--samples-per-prompt", type=int, default=8)
    tr.add_argument("--max-new-tokens", type=int, default=200)
    tr.add_argument("--steps", type=int, default=1500)
    tr.add_argument("--batch-size", type=int, default=16)
    tr.add_argument("--seq-len", type=int, default=192)
    tr.add_argument("--depths", type=int, default=2)
    tr.add_argument("--learning-rate", type=float, default=3e-3)
    tr.add_argument("--distill", action="store_true", help="train on the base model's distribution, not data tokens")
    tr.add_argument("--seed", type=int, default=0)
    tr.set_defaults(func=cmd_train_mtp)
    from jaxmtp.server import launch

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (see README.md)")
    launch.add_server_args(srv)
    srv.set_defaults(func=launch.serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxmtp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
