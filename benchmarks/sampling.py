"""The device cost of each stage of a sampled step's token choice, alone and back to back,
so that a branch the step takes (a lax.cond, which XLA:GPU runs from the host) can be
weighed against computing its work unconditionally.

Over logits [B * R, V] (B requests, R = k+1 verify rows, V a real vocabulary: Llama 3's
128256 by default), float32 as the step holds them, it times per call:
- argmax: a greedy row's choice;
- scale_gumbel_argmax: temperature, the Gumbel-max sample keyed per row (no filter);
- restrict: top-k / top-p / min-p on scaled logits, as the engine runs it on this platform
  (sampling.RESTRICT_SEARCH_FROM_ROWS); restrict_sort and restrict_search_{1,2,4}: each
  of its forms (a sort of each row, or a search over the values' bits at 1, 2 or 4 bits
  a pass), which set that table and RESTRICT_DIGIT_BITS;
- top_logprobs: log_softmax and the top 20 (an OpenAI request's most);
- verify_and_sample: the engine's function for a batch at temperature 0.7 without
  restriction, branches and all.

    python benchmarks/sampling.py [--batches 1,32,128] [--rows 1,2] [--vocab 128256] [--out DIR]

Writes sampling.json and sampling.md (date, device, JAX version) under $OUT or --out."""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmtp.worker.sampling import restrict, row_keys, top_k_by_chunks, verify_and_sample  # noqa: E402

TOP_LOGPROBS = 20


class SampledBatch:
    """The fields of a Batch that verify_and_sample reads, every request at temperature 0.7."""

    def __init__(self, b: int):
        self.temperature = jnp.full((b,), 0.7, jnp.float32)
        self.top_k = jnp.zeros((b,), jnp.int32)
        self.top_p = jnp.ones((b,), jnp.float32)
        self.min_p = jnp.zeros((b,), jnp.float32)
        self.seed = jnp.arange(b, dtype=jnp.int32)
        self.output_index = jnp.zeros((b,), jnp.int32)


def stages(b: int, r: int) -> dict:
    batch = SampledBatch(b)
    rep = lambda x: jnp.repeat(x, r)  # noqa: E731

    def scale_gumbel_argmax(logits):
        scaled = logits.reshape(b * r, -1) / rep(batch.temperature)[:, None]
        keys = row_keys(batch.seed, batch.output_index, r).reshape(-1)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (scaled.shape[-1],)))(keys)
        return jnp.argmax(scaled + gumbel, axis=-1)

    def restrict_by(**form):  # top-k 50 and top-p 0.95, as a request restricting both
        return lambda logits: restrict(logits.reshape(b * r, -1), rep(jnp.full((b,), 50, jnp.int32)),
                                       rep(jnp.full((b,), 0.95, jnp.float32)), rep(batch.min_p), **form)

    return {
        "argmax": lambda logits: jnp.argmax(logits, axis=-1),
        "scale_gumbel_argmax": scale_gumbel_argmax,
        "restrict": restrict_by(),
        "restrict_sort": restrict_by(search=False),
        **{f"restrict_search_{bits}": restrict_by(search=True, digit_bits=bits) for bits in (1, 2, 4)},
        "top_logprobs": lambda logits: jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), TOP_LOGPROBS),
        **{f"top_logprobs_chunks_{chunk}": (lambda chunk: lambda logits: top_k_by_chunks(
            jax.nn.log_softmax(logits, axis=-1), TOP_LOGPROBS, chunk))(chunk) for chunk in (512, 2048, 8192)},
        "verify_and_sample": lambda logits: verify_and_sample(logits, jnp.zeros((b, r - 1), jnp.int32),
                                                              jnp.full((b,), r - 1, jnp.int32), batch),
    }


def time_stage(fn, logits, calls: int) -> dict:
    compiled = jax.jit(fn).lower(logits).compile()
    jax.block_until_ready(compiled(logits))
    start = time.perf_counter()
    for _ in range(calls):  # queued back to back: the device's time a call
        out = compiled(logits)
    jax.block_until_ready(out)
    queued = (time.perf_counter() - start) / calls
    alone = []
    for _ in range(max(calls // 4, 5)):  # each waited for: the device's time plus a round trip
        start = time.perf_counter()
        jax.block_until_ready(compiled(logits))
        alone.append(time.perf_counter() - start)
    return {"us_queued": 1e6 * queued, "us_alone_median": 1e6 * sorted(alone)[len(alone) // 2]}


def restriction_choice(rows: list[dict]) -> list[str]:
    """The restriction's fastest form per row count (queued time), and the table entry it
    gives sampling.RESTRICT_SEARCH_FROM_ROWS: the fewest rows from which every measured
    row count's fastest form is a search (none: the sort)."""
    forms = collections.defaultdict(dict)
    for row in rows:
        if row["stage"].startswith("restrict_"):  # (batch x rows counts met twice: the faster)
            times = forms[row["batch"] * row["rows"]]
            times[row["stage"]] = min(row["us_queued"], times.get(row["stage"], float("inf")))
    if not forms:
        return []
    fastest = {n: min(times, key=times.get) for n, times in sorted(forms.items())}
    searching = [n for n in fastest if all(fastest[m] != "restrict_sort" for m in fastest if m >= n)]
    lines = ["", "| rows of logits | fastest restriction | us a call, queued | the sort |", "|---|---|---|---|"]
    lines += [f"| {n} | {form} | {forms[n][form]:.1f} | {forms[n].get('restrict_sort', float('nan')):.1f} |"
              for n, form in fastest.items()]
    return lines + ["", f"RESTRICT_SEARCH_FROM_ROWS entry: {min(searching) if searching else 'none (the sort)'}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32,128", help="requests B, comma-separated (default: 1,32,128)")
    parser.add_argument("--rows", default="1,2", help="verify rows per request R = k+1 (default: 1,2)")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary size (default: 128256, Llama 3)")
    parser.add_argument("--calls", type=int, default=50, help="calls timed per stage (default: 50)")
    parser.add_argument("--stages", help="comma-separated stages to time, by name prefix (default: all)")
    parser.add_argument("--out", default="docs/benchmarks", help="output folder when $OUT is unset (default: docs/benchmarks)")
    args = parser.parse_args()
    results = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "vocab": args.vocab, "rows": []}
    key = jax.random.key(0)
    for b in map(int, args.batches.split(",")):
        for r in map(int, args.rows.split(",")):
            key, sub = jax.random.split(key)
            logits = 4 * jax.random.normal(sub, (b, r, args.vocab), jnp.float32)
            for name, fn in stages(b, r).items():
                if args.stages and not name.startswith(tuple(args.stages.split(","))):
                    continue
                row = {"batch": b, "rows": r, "stage": name, **time_stage(fn, logits, args.calls)}
                results["rows"].append(row)
                print(row, flush=True)
    out = Path(os.environ.get("OUT", args.out))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling.json").write_text(json.dumps(results, indent=1))
    lines = [f"{results['date']}, {results['device']}, JAX {results['jax']}, vocabulary {args.vocab}\n",
             "| batch | rows | stage | us a call, queued | us a call, waited for |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['rows']} | {r['stage']} | {r['us_queued']:.1f} | {r['us_alone_median']:.1f} |"
              for r in results["rows"]]
    lines += restriction_choice(results["rows"])
    (out / "sampling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
