"""A real 131k vocabulary for the benchmarks' byte-level tokenizer: Mistral NeMo's
tekken file (shipped in the mistral-common wheel, so it needs no Hugging Face access) as
a Hugging Face tokenizer.json, for `benchmarks/structured.py --tokenizer` on a machine
that cannot download Llama 3's.

    pip download --no-deps mistral-common && unzip -j mistral_common-*.whl '*/tekken_240718.json'
    python benchmarks/tekken_tokenizer.py tekken_240718.json tokenizer.json

tekken is tiktoken's format: token byte strings ranked by merge order, after
`default_num_special_tokens` special ids. As a BPE, a token of rank r merges every split
of it into two lower-ranked tokens at priority r (tiktoken's own merge rule)."""

from __future__ import annotations

import argparse
import base64
import json


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the one tokenizers' ByteLevel pre-tokenizer maps bytes
    to): printable Latin-1 bytes stand for themselves, the rest for code points from 256."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def convert(tekken: dict):
    """tokenizers.Tokenizer of a tekken file's vocabulary: special ids first, then the
    ranked tokens (default_vocab_size in all)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    config = tekken["config"]
    num_special = config["default_num_special_tokens"]
    ranks = {base64.b64decode(entry["token_bytes"]): entry["rank"]
             for entry in tekken["vocab"][: config["default_vocab_size"] - num_special]}
    symbols = byte_symbols()
    text = lambda piece: "".join(symbols[b] for b in piece)  # noqa: E731
    merges = sorted((rank, ranks[piece[:i]], ranks[piece[i:]], text(piece[:i]), text(piece[i:]))
                    for piece, rank in ranks.items() for i in range(1, len(piece))
                    if ranks.get(piece[:i], rank) < rank and ranks.get(piece[i:], rank) < rank)
    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, num_special)]
    vocab = {**{text(piece): rank + num_special for piece, rank in ranks.items()},
             **{name: i for i, name in enumerate(specials)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[m[3:] for m in merges], ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(config["pattern"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tekken", help="a tekken .json (mistral-common's mistral_common/data/tekken_240718.json)")
    parser.add_argument("out", help="the tokenizer.json to write")
    args = parser.parse_args()
    with open(args.tekken) as f:
        tokenizer = convert(json.load(f))
    tokenizer.save(args.out)
    print(f"{args.out}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
