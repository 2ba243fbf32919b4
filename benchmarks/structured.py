"""Structured outputs at batch 32: output tokens/s of JSON-schema-constrained requests
against the same batch unconstrained (to max_tokens, and to the lengths the constrained
requests reached, since a request that closes its JSON stops while the batch runs as long
as its longest), the host's own time per step (the step less its
compiled call and read-back) against the unconstrained step's, the time per step that building the batch
spends on grammar masks (one llguidance call over the step's rows), the grammar's own
work a step with nothing else running (the constrained outputs replayed through fresh
matchers: each request's tokens accepted, then the next masks of all of them in one
call; the host's floor for a constrained step is the unconstrained host time plus it),
and the mean acceptance length with MTP under the schema and without.

    python benchmarks/structured.py            # Llama-3-8B shape, dummy weights, one GPU
    python benchmarks/structured.py --tiny     # CPU smoke test
    python benchmarks/structured.py --tiny-layers --new-tokens 24   # the host side at full size, on a CPU
    python benchmarks/structured.py --tokenizer PATH/tokenizer.json  # a real model's vocabulary

The model is benchmarks/e2e.py's (random weights, its 128k byte-level BPE tokenizer of
random byte strings, or with --tokenizer a real one and its vocabulary size). The masks'
cost depends on the vocabulary: inside a JSON string llguidance takes the tokens of
ordinary text in bulk and walks the rest one by one, and most random byte strings are not
valid UTF-8 text, so the random tokenizer is its slow case. Each configuration runs once
untimed first, so that its batch shapes are compiled.
Writes JSON and markdown (date, device, JAX version) under $OUT or --out."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

from e2e import LLAMA3_8B, TINY, Bench  # noqa: E402
from timing import host_work, runner_phases  # noqa: E402

# a record whose free-text field outlasts max_tokens: every step is constrained
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "tags", "summary"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}},
        "summary": {"type": "string", "maxLength": 4000},
    },
}


def timed_run(llm, prompts, params) -> dict:
    """One batch to completion; the mask computation timed on the side, and when each
    step's fill reached llguidance against when it was started and when the engine's
    thread came to take it (fill_timeline)."""
    from jaxmtp.engine import llm_engine, structured_outputs

    spent, marks = [0.0], {"start": [], "llguidance": [], "wanted": []}
    fill, llnp, engine = llm_engine.step_bitmask, structured_outputs.llnp, llm.engine
    originals = {name: getattr(llnp, name) for name in FILLS}

    def timed_fill(*args):
        t = time.perf_counter()
        try:
            return fill(*args)
        finally:
            spent[0] += time.perf_counter() - t

    def marked(name, method):
        def wrapper(*args, **kwargs):
            now = time.perf_counter()
            if name == "start":  # a fill's first llguidance call fills its slot
                marks["llguidance"].append(None)
            if name != "llguidance":
                marks[name].append(now)
            elif marks["llguidance"] and marks["llguidance"][-1] is None:
                marks["llguidance"][-1] = now
            return method(*args, **kwargs)
        return wrapper

    llm_engine.step_bitmask = timed_fill
    for name, method in originals.items():
        setattr(llnp, name, marked("llguidance", method))
    engine._mask_worker.submit = marked("start", engine._mask_worker.submit)
    engine._complete_awaiting = marked("wanted", engine._complete_awaiting)
    steps_before = llm.engine.stats.steps
    try:
        with runner_phases(llm.engine) as phases:
            outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = phases["whole"]
    finally:
        llm_engine.step_bitmask = fill
        for name, method in originals.items():
            setattr(llnp, name, method)
        del engine._mask_worker.submit, engine._complete_awaiting  # the instance attributes over the methods
    steps = llm.engine.stats.steps - steps_before
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # over the batch's steps that ran with drafts (a request with none has no length)
    spec = [o.spec_stats for o in outs if o.spec_stats]
    drafting = sum(stats["num_steps"] for stats in spec)
    host_ms = 1e3 * host_work(phases) / steps
    result = {"tokens_per_s": tokens / elapsed, "tokens": tokens, "steps": steps, "mask_ms_per_step": 1e3 * spent[0] / steps,
              "host_ms_per_step": host_ms, "phases_ms_per_step": {name: 1e3 * v / steps for name, v in phases.items()},
            "acceptance_length": 1 + sum(stats["accepted"] for stats in spec) / drafting if drafting else None,
              "finish": sorted({o.outputs[0].finish_reason for o in outs})}
    if not isinstance(params, list) and params.structured_outputs is not None:
        result["fill_timeline"] = fill_timeline(marks)
        result["outputs"] = [list(o.outputs[0].token_ids) for o in outs]  # to replay the grammar's work elsewhere
        result["grammar_alone_ms_per_step"] = grammar_alone(llm, params, result["outputs"])
    return result


FILLS = ("fill_next_token_bitmask_par", "fill_next_token_bitmask_par_with_draft_tokens")


def fill_timeline(marks: dict) -> dict:
    """Over the steps whose fill called llguidance: the median ms from the fill's start
    to its first llguidance call and to when the engine's thread came for the masks (its
    next _complete_awaiting), and the share of fills inside llguidance by then."""
    import numpy as np

    wanted = np.array(marks["wanted"])
    rows = [(start, fill, wanted[np.searchsorted(wanted, start)])
            for start, fill in zip(marks["start"], marks["llguidance"])
            if fill is not None and len(wanted) and start <= wanted[-1]]
    if not rows:
        return {}
    start, fill, came = (1e3 * np.array(column) for column in zip(*rows))
    return {"fills": len(rows), "ms_start_to_llguidance": float(np.median(fill - start)),
            "ms_start_to_wanted": float(np.median(came - start)),
            "share_in_llguidance_before_wanted": float(np.mean(fill < came))}


def grammar_alone(llm, params, outputs: list[list[int]]) -> float:
    """ms a step of the grammar's own host work for these outputs, nothing else running:
    each step, one token accepted per request, then the next masks of every request
    still going in one call (the engine's fill_row_masks)."""
    import numpy as np

    from jaxmtp.engine.structured_outputs import fill_row_masks

    grammars = llm.engine.intake.grammars
    matchers = [grammars.matcher(params.structured_outputs) for _ in outputs]
    masks = np.empty((len(outputs), grammars.mask_words), np.int32)
    steps = max(map(len, outputs))
    start = time.perf_counter()
    fill_row_masks([(m, i, []) for i, m in enumerate(matchers)], masks)
    for step in range(steps):
        going = []
        for i, (matcher, out) in enumerate(zip(matchers, outputs)):
            if step < len(out) and not matcher.accept(out[step]) and step + 1 < len(out):
                going.append((matcher, i, []))
        fill_row_masks(going, masks)
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model, CPU smoke test (default: off)")
    parser.add_argument("--tiny-layers", action="store_true",
                        help="tiny layers with the real 128k vocabulary and batch: the host's mask work at full size "
                             "on a CPU (default: off)")
    parser.add_argument("--batch", type=int, default=32, help="requests in the batch (default: 32)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request (default: 128)")
    parser.add_argument("--k", default="0,1", help="MTP draft counts, comma-separated (default: 0,1)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature, seed 0 (default: 0, greedy)")
    parser.add_argument("--tokenizer", help="a real model's tokenizer.json; the model's vocabulary is its size "
                        "(default: benchmarks/e2e.py's random 128k BPE)")
    parser.add_argument("--out", default="docs/benchmarks", help="output folder when $OUT is unset (default: docs/benchmarks)")
    args = parser.parse_args()
    import jax

    from jaxmtp import LLM, SamplingParams

    batch, new = (2, 8) if args.tiny else (args.batch, args.new_tokens)
    config = TINY if args.tiny else {**TINY, "vocab_size": LLAMA3_8B["vocab_size"]} if args.tiny_layers else LLAMA3_8B
    if args.tokenizer:
        from tokenizers import Tokenizer

        config = {**config, "vocab_size": Tokenizer.from_file(args.tokenizer).get_vocab_size()}
    folder = Bench.model_folder(config, args.tokenizer)
    rng = __import__("numpy").random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"] - 2, size=32 if args.tiny else 64 if args.tiny_layers else 512).tolist() for _ in range(batch)]
    results = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "batch": batch, "new_tokens": new, "tokenizer": args.tokenizer, "vocab_size": config["vocab_size"],
               "temperature": args.temperature, "rows": {}}
    for k in map(int, args.k.split(",")):
        llm = LLM(folder, load_format="dummy", num_speculative_tokens=k, max_num_seqs=batch,
                  max_num_batched_tokens=512 if args.tiny else 2048,
                  max_model_len=min(2048, config["max_position_embeddings"]), num_pages=None)
        plain = dict(temperature=args.temperature, seed=0, ignore_eos=True)
        runs = {"unconstrained": SamplingParams(max_tokens=new, **plain),
                "json_schema": SamplingParams(max_tokens=new, structured_outputs={"json": SCHEMA}, **plain)}
        for name, params in runs.items():
            timed_run(llm, prompts, params)  # compiles this configuration's shapes
            results["rows"][f"k={k} {name}"] = timed_run(llm, prompts, params)
            print(f"k={k} {name}", {f: v for f, v in results["rows"][f"k={k} {name}"].items() if f != "outputs"}, flush=True)
        # the constrained requests that close their JSON stop early while the batch runs as
        # long as its longest: the same lengths unconstrained compare the steps alone
        lengths = [SamplingParams(max_tokens=len(out), **plain) for out in results["rows"][f"k={k} json_schema"]["outputs"]]
        timed_run(llm, prompts, lengths)
        results["rows"][f"k={k} unconstrained, same lengths"] = timed_run(llm, prompts, lengths)
        del llm
    for k in map(int, args.k.split(",")):
        rows = results["rows"]
        constrained, free = rows[f"k={k} json_schema"], rows[f"k={k} unconstrained"]
        constrained["vs_unconstrained"] = constrained["tokens_per_s"] / free["tokens_per_s"]
        constrained["vs_same_lengths"] = constrained["tokens_per_s"] / rows[f"k={k} unconstrained, same lengths"]["tokens_per_s"]
        constrained["host_vs_unconstrained"] = constrained["host_ms_per_step"] / free["host_ms_per_step"]
        constrained["host_floor_vs_unconstrained"] = 1 + constrained["grammar_alone_ms_per_step"] / free["host_ms_per_step"]
    out = Path(os.environ.get("OUT", args.out))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['date']}_{results['device'].replace(' ', '-')}_structured{'_tiny' if args.tiny else '_tiny-layers' if args.tiny_layers else ''}{'_tokenizer' if args.tokenizer else ''}{f'_t{args.temperature:g}' if args.temperature else ''}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    lines = ["| configuration | tokens/s | vs unconstrained | vs same lengths unconstrained | host ms / step | host vs unconstrained | mask ms / step "
             "| grammar alone ms / step | host floor vs unconstrained | fill in llguidance / engine came, ms after start "
             "(share before) | acceptance length | finish |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["rows"].items():
        ratio = f"{r['vs_unconstrained']:.3f}" if "vs_unconstrained" in r else ""
        same = f"{r['vs_same_lengths']:.3f}" if "vs_same_lengths" in r else ""
        host_ratio = f"{r['host_vs_unconstrained']:.2f}" if "host_vs_unconstrained" in r else ""
        accept = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else ""
        alone = f"{r['grammar_alone_ms_per_step']:.3f}" if "grammar_alone_ms_per_step" in r else ""
        floor = f"{r['host_floor_vs_unconstrained']:.2f}" if "host_floor_vs_unconstrained" in r else ""
        timeline = r.get("fill_timeline") or {}
        fills = (f"{timeline['ms_start_to_llguidance']:.2f} / {timeline['ms_start_to_wanted']:.2f} "
                 f"({timeline['share_in_llguidance_before_wanted']:.2f})" if timeline else "")
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {ratio} | {same} | {r['host_ms_per_step']:.2f} | {host_ratio} | "
                     f"{r['mask_ms_per_step']:.3f} | {alone} | {floor} | {fills} | {accept} | {', '.join(r['finish'])} |")
    header = (f"{results['date']}, {results['device']}, JAX {results['jax']}, batch {batch}, {new} tokens each, "
              f"tokenizer: {args.tokenizer or 'random 128k BPE'}, temperature {args.temperature:g}\n\n")
    (out / f"{stem}.md").write_text(header + "\n".join(lines) + "\n")
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
