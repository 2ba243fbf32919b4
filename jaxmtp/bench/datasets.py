"""The benchmarks' requests, as vLLM's benchmarks sample them: `random` (random token
prompts, their input and output lengths drawn around the given ones with
--random-range-ratio) and `sharegpt` (a ShareGPT JSON file: each conversation's first
turn is the prompt and the second's token length the output length)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from collections.abc import Callable

import numpy as np

# vLLM's bounds on a ShareGPT sample (vllm/benchmarks/datasets: is_valid_sequence)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


def dataset_name(args: argparse.Namespace) -> str:
    """--dataset-name, checked against --dataset-path as vLLM's; throughput's default is
    sharegpt with a --dataset-path and random without."""
    name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    if name == "random" and args.dataset_path:
        raise ValueError(f"--dataset-name random takes no --dataset-path (got {args.dataset_path}); "
                         "give --dataset-name sharegpt for a ShareGPT file")
    if name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path, a ShareGPT JSON file")
    return name


@dataclasses.dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int
    expected_output_len: int


def random_requests(rng: np.random.Generator, num: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_size: int) -> list[SampleRequest]:
    """Token ids drawn past the first three (the unk, bos and eos of Llama-2-style
    vocabularies); each length drawn from [len * (1 - r), len * (1 + r)] as vLLM's
    (at least one token)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")

    def lengths(length: int) -> np.ndarray:
        low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
        return rng.integers(max(1, low), max(1, high) + 1, size=num)

    return [
        SampleRequest(rng.integers(3, vocab_size, size=n).tolist(), int(n), int(out))
        for n, out in zip(lengths(input_len), lengths(output_len))
    ]


def sharegpt_requests(path: str, num: int, seed: int, count_tokens: Callable[[str], int],
                      output_len: int | None = None) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: the conversations of two turns or more, shuffled with
    Python's random seeded with `seed`; each one's first turn is the prompt, the token
    count of its second the output length (or output_len); samples too short or too
    long are skipped, and too few are topped up with copies of random ones."""
    with open(path, encoding="utf-8") as f:
        data = [entry for entry in json.load(f) if len(entry.get("conversations", ())) >= 2]
    picker = random.Random(seed)
    picker.shuffle(data)
    samples = []
    for entry in data:
        if len(samples) == num:
            break
        prompt, completion = (turn["value"] for turn in entry["conversations"][:2])
        prompt_len = count_tokens(prompt)
        expected = count_tokens(completion) if output_len is None else output_len
        if (prompt_len < MIN_LEN or (output_len is None and expected < MIN_LEN) or prompt_len > MAX_PROMPT_LEN
                or prompt_len + expected > MAX_TOTAL_LEN):
            continue
        samples.append(SampleRequest(prompt, prompt_len, expected))
    if not samples:
        raise ValueError(f"{path} has no ShareGPT conversation within vLLM's bounds (prompt {MIN_LEN}.."
                         f"{MAX_PROMPT_LEN} tokens, prompt + output at most {MAX_TOTAL_LEN})")
    return samples + [dataclasses.replace(picker.choice(samples)) for _ in range(num - len(samples))]
