"""The `jaxmtp` command: generate, serve, bench and train-mtp."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmtp import __version__
from jaxmtp.args import DEFAULT_BASE, DEFAULT_MODEL, HelpFormatter, add_engine_args, engine_kwargs, resolve_model

__all__ = ["DEFAULT_MODEL", "DEFAULT_BASE", "build_parser", "main"]


# SamplingParams fields the generate command sets, by option (dest), and what it uses
# where neither the option nor the model's generation_config gives one
GENERATE_OPTIONS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "seed": "sample_seed"}
GENERATE_FALLBACK = {"max_tokens": 128, "temperature": 0.0}


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxmtp import LLM, SamplingParams

    llm = LLM(resolve_model(args), **engine_kwargs(args))
    # the options given, over the model's generation_config (engine option
    # generation_config), over greedy decoding of 128 tokens
    given = {name: getattr(args, option) for name, option in GENERATE_OPTIONS.items() if getattr(args, option) is not None}
    params = SamplingParams(**{**GENERATE_FALLBACK, **llm.engine.generation_defaults, **given})
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

    from jaxmtp import LLM, train

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxmtp", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxmtp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt", formatter_class=HelpFormatter)
    gen.add_argument("prompt", nargs="?", default="Once upon a time", help="the text to continue")
    model_default = "default: the model's generation_config, else "
    gen.add_argument("--max-tokens", type=int, default=None, help=f"tokens to generate ({model_default}128)")
    gen.add_argument("--temperature", type=float, default=None,
                     help=f"sampling temperature, 0: greedy ({model_default}0)")
    gen.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling's probability mass ({model_default}1)")
    gen.add_argument("--top-k", type=int, default=None,
                     help=f"sample among the k likeliest tokens, -1: all ({model_default}-1)")
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of the sampling (default: a random one)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    tr = sub.add_parser(
        "train-mtp", help="train an MTP draft module on a frozen base model", formatter_class=HelpFormatter
    )
    tr.add_argument("--model", default=DEFAULT_BASE, help="the frozen base model's folder")
    tr.add_argument("--out", required=True, help="engine checkpoint to write (base + MTP module; no default)")
    tr.add_argument(
        "--text-file", default=None,
        help="train on this text (blank-line separated) instead of self-distillation (default: none)",
    )
    tr.add_argument("--samples-per-prompt", type=int, default=8, help="self-distillation samples per story prompt")
    tr.add_argument("--max-new-tokens", type=int, default=200, help="tokens per self-distillation sample")
    tr.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    tr.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    tr.add_argument("--seq-len", type=int, default=192, help="tokens per training sequence")
    tr.add_argument("--depths", type=int, default=2, help="draft depths trained")
    tr.add_argument("--learning-rate", type=float, default=3e-3, help="peak learning rate")
    tr.add_argument("--distill", action="store_true", help="train on the base model's distribution, not data tokens")
    tr.add_argument("--seed", type=int, default=0, help="seed of sampling and initialisation")
    tr.set_defaults(func=cmd_train_mtp)
    from jaxmtp.server import launch

    srv = sub.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API (see README.md)", formatter_class=HelpFormatter
    )
    launch.add_server_args(srv)
    srv.set_defaults(func=launch.serve)
    from jaxmtp.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxmtp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
