"""Greedy MTP acceptance of a checkpoint on held-out prompts, for k = 1..4.

CPU, about a minute:  python benchmarks/acceptance.py [--model checkpoints/stories260K-mtp]

Prompts are held-out story openings (never in training, see jaxmtp/train.py) and the
decoding is greedy; prints per-position acceptance and mean acceptance length last.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import jax

from jaxmtp import LLM, SamplingParams
from jaxmtp.train import HELD_OUT_NAMES, HELD_OUT_OPENINGS, story_prompts

ROOT = Path(__file__).resolve().parent.parent


def acceptance(model: str, k: int, prompts: list[str], max_tokens: int, temperature: float) -> dict:
    llm = LLM(model, num_speculative_tokens=k, max_num_seqs=16, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    steps = sum(o.spec_stats["num_steps"] for o in outs)
    per_position = [sum(o.spec_stats["accepted_per_position"][j] for o in outs) / steps for j in range(k)]
    accepted = sum(o.spec_stats["accepted"] for o in outs)
    return {"k": k, "per_position": per_position, "mean_acceptance_length": 1 + accepted / steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "checkpoints" / "stories260K-mtp"))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    prompts = story_prompts(HELD_OUT_NAMES, HELD_OUT_OPENINGS)
    rows = [acceptance(args.model, k, prompts, args.max_tokens, args.temperature) for k in (1, 2, 3, 4)]
    print(f"\n{datetime.date.today()}, CPU, jax {jax.__version__}, {Path(args.model).name}, {len(prompts)} held-out "
          f"prompts, {args.max_tokens} tokens, temperature {args.temperature}\n")
    print("| k | acceptance per draft position | mean acceptance length |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {', '.join(f'{a:.3f}' for a in r['per_position'])} | {r['mean_acceptance_length']:.3f} |")


if __name__ == "__main__":
    main()
