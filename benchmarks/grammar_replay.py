"""The grammar's host work of a constrained batch, replayed from the outputs that
benchmarks/structured.py saved: per step, the time to accept each request's token and
the time to fill every request's next mask in one llguidance call, at several
llguidance thread counts and counts of compiled matchers the requests copy, and the slowest single masks (their state's text), so a slow
host can be told from slow grammar states.

    python benchmarks/structured.py --k 0 --out DIR      # saves the outputs
    python benchmarks/grammar_replay.py DIR/DATE_DEVICE_structured.json

Prints and writes JSON beside the input (or under $OUT)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from e2e import LLAMA3_8B, TINY, Bench  # noqa: E402
from structured import SCHEMA  # noqa: E402


def replay(grammars, outputs: list[list[int]], schema: dict, executor=None) -> dict:
    """ms a step: accepting, and filling the going requests' masks in one call."""
    import llguidance.numpy as llnp

    from jaxmtp.engine.structured_outputs import StructuredOutputsParams

    matchers = [grammars.matcher(StructuredOutputsParams(json=schema))._matcher for _ in outputs]
    masks = np.empty((len(outputs), grammars.mask_words), np.int32)
    executor = executor or grammars.executor
    accept = fill = 0.0
    steps = max(map(len, outputs))
    for step in range(steps):
        t = time.perf_counter()
        going = []
        for i, (matcher, out) in enumerate(zip(matchers, outputs)):
            if step < len(out):
                matcher.consume_token(out[step])
                if not matcher.is_stopped() and step + 1 < len(out):
                    going.append((matcher, i))
        t2 = time.perf_counter()
        if going:
            llnp.fill_next_token_bitmask_par(executor, going, masks)
        fill += time.perf_counter() - t2
        accept += t2 - t
    return {"accept_ms_per_step": 1e3 * accept / steps, "fill_ms_per_step": 1e3 * fill / steps}


def slowest_masks(grammars, tokenizer, outputs: list[list[int]], schema: dict, count: int = 8) -> list[dict]:
    """The single masks that took longest, one request at a time on one thread."""
    import llguidance.numpy as llnp

    from jaxmtp.engine.structured_outputs import StructuredOutputsParams

    mask = np.empty((1, grammars.mask_words), np.int32)
    found = []
    for out in outputs:
        matcher = grammars.matcher(StructuredOutputsParams(json=schema))._matcher
        for step, token in enumerate(out):
            t = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask, 0)
            found.append((time.perf_counter() - t, out[:step]))
            matcher.consume_token(token)
            if matcher.is_stopped():
                break
    found.sort(key=lambda f: -f[0])
    times = np.array([f[0] for f in found]) * 1e3
    return {"masks": len(found), "median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "total_ms": float(times.sum()),
            "slowest": [{"ms": 1e3 * s, "text_tail": tokenizer.decode(prefix)[-60:]} for s, prefix in found[:count]]}


def main() -> None:
    from jaxmtp.engine.structured_outputs import MATCHER_FAMILIES, GrammarCompiler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("saved", help="benchmarks/structured.py's JSON")
    parser.add_argument("--row", default="k=0 json_schema", help="which configuration's outputs (default: k=0 json_schema)")
    parser.add_argument("--no-max-length", action="store_true",
                        help="the schema without its free-text field's maxLength (default: as structured.py ran it)")
    parser.add_argument("--threads", default="1,4,8,12", help="llguidance thread counts (default: 1,4,8,12)")
    parser.add_argument("--families", default=f"1,{MATCHER_FAMILIES}",
                        help="compiled matchers the requests copy in turn (structured_outputs.MATCHER_FAMILIES; "
                             f"default: 1,{MATCHER_FAMILIES})")
    args = parser.parse_args()
    import llguidance
    from tokenizers import Tokenizer

    saved = json.loads(Path(args.saved).read_text())
    outputs = saved["rows"][args.row]["outputs"]
    # the run's vocabulary: its --tokenizer, else the random one of its size (files
    # written before structured.py recorded either: the size from the batch)
    vocab_size = saved.get("vocab_size") or (TINY if saved["batch"] == 2 else LLAMA3_8B)["vocab_size"]
    config = {**TINY, "vocab_size": vocab_size}
    folder = Path(Bench.model_folder(config, saved.get("tokenizer")))
    text = (folder / "tokenizer.json").read_text()
    schema = copy.deepcopy(SCHEMA)
    if args.no_max_length:  # the same outputs fit: the schema only loses a bound
        del schema["properties"]["summary"]["maxLength"]
    results = {"saved": args.saved, "row": args.row, "cpus": os.cpu_count(), "schema": schema, "families": {}}
    for families in map(int, args.families.split(",")):
        grammars = GrammarCompiler(text, vocab_size, [config["eos_token_id"]], num_families=families)
        replay(grammars, outputs, schema)  # warm: compiles, and fills each family's caches
        results["families"][families] = {}
        for n in map(int, args.threads.split(",")):
            results["families"][families][n] = replay(grammars, outputs, schema, llguidance.LLExecutor(n))
            print(families, "families,", n, "threads:", results["families"][families][n], flush=True)
    results["single_masks"] = slowest_masks(grammars, Tokenizer.from_str(text), outputs, schema)
    print(json.dumps(results["single_masks"], indent=1))
    out = Path(os.environ.get("OUT", Path(args.saved).parent))
    (out / f"{Path(args.saved).stem}_grammar_replay{'_no-max-length' if args.no_max_length else ''}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
