"""The main model's decode step alone, replayed back to back, under other attention
tilings: which kernel tiling is fastest inside the real step (one H200, a few minutes).

    python benchmarks/decode_step.py [--shapes 1x768,8x1024,32x1024,128x1024]
        [--tilings "num_splits=1;block_kv=64,num_splits=6"] [--profile] [--out DIR] [--tiny]

Llama-3-8B shape (benchmarks/e2e.py), random weights, a random-filled KV cache. Each
shape BxC is B requests decoding at context C, padded as the engine pads a batch (at
least 8 rows, padding rows' writes dropped). The timed function is the main
model's forward, final norm, LM head and argmax: the decode work without sampling or
MTP. Every tiling is the kernel's default for the shape with the named fields replaced
(jaxmtp.kernels.KernelConfig), and is reported as its step time over the default's, measured
in the same run. --profile adds the per-kernel device time of the default tiling
(profile_step.kernel_table). Writes decode_step.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PAGE_SIZE = 16
MIN_ROWS = 8  # the engine's smallest token bucket


def decode_batch(batch: int, context: int):
    """B requests with `context` tokens each, the last one this step's row; returns the
    Batch and the number of cache pages it needs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmtp.worker.batch import Batch, unprocessed
    from jaxmtp.worker.cache import dropped_index

    rows = max(batch, MIN_ROWS)
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    page_table = np.arange(num_pages, dtype=np.int32).reshape(batch, pages_per_seq)
    positions = np.zeros(rows, np.int32)
    positions[:batch] = context - 1
    slots = dropped_index(num_pages * PAGE_SIZE, np.arange(rows, dtype=np.int32))  # padding: dropped
    slots[:batch] = page_table[:, -1] * PAGE_SIZE + (context - 1) % PAGE_SIZE
    ids = np.random.default_rng().integers(3, 1000, rows, dtype=np.int32)
    per_request = np.zeros(batch, np.int32)
    batch_arrays = Batch(
        input_ids=ids, positions=positions, slot_mapping=slots, query_start=np.arange(batch + 1, dtype=np.int32),
        kv_len=np.full(batch, context, np.int32), page_table=page_table,
        sample_index=np.arange(batch, dtype=np.int32)[:, None], num_drafts=per_request,
        has_output=np.ones(batch, bool), next_chunk_token=np.zeros((batch, 1), np.int32),
        temperature=np.zeros(batch, np.float32), top_k=per_request, top_p=np.ones(batch, np.float32),
        min_p=np.zeros(batch, np.float32), seed=np.zeros(batch, np.uint32), output_index=per_request,
        carry_index=np.full(batch, -1, np.int32), **unprocessed(batch),
    )
    return jax.tree.map(jnp.asarray, batch_arrays), num_pages


def random_cache(cfg, num_pages: int):
    import jax

    from jaxmtp.worker.cache import allocate_cache

    cache = allocate_cache(cfg, num_pages, PAGE_SIZE, 0)
    fill = lambda n, pages: jax.random.normal(jax.random.key(n), pages.shape, pages.dtype)  # noqa: E731
    return dataclasses.replace(cache, k=[fill(i, c) for i, c in enumerate(cache.k)],
                               v=[fill(1000 + i, c) for i, c in enumerate(cache.v)])


def parse_tiling(text: str) -> dict:
    fields = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        fields[name.strip()] = int(value)
    return fields


def time_step(params, cfg, batch, cache, kernel_config, backend, profile):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmtp.models import model
    from jaxmtp.models.attention import attention_fn
    from profile_step import profile_kernels
    from timing import replay_time

    ops = model.LayerOps(attention_fn(backend, cfg.head_dim, kernel_config=kernel_config))

    def step(params, cache, batch):
        hidden, cache = model.forward(params, cfg, batch, cache, ops)
        return cache, jnp.argmax(model.logits(params.head(), params.final_norm, cfg, hidden), axis=-1)

    compiled = jax.jit(step, donate_argnums=1).lower(params, cache, batch).compile()

    def run_once():
        nonlocal cache
        cache, tokens = compiled(params, cache, batch)
        return tokens

    times = [replay_time(run_once, 20, warmup=3 if i == 0 else 0) for i in range(5)]
    result = {"step_ms": 1e3 * float(np.median(times)), "spread_ms": [1e3 * min(times), 1e3 * max(times)]}
    if profile:
        result["kernels"] = profile_kernels(run_once, 10)
    return result, cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x768,8x1024,32x1024,128x1024", help="comma list of BATCHxCONTEXT")
    parser.add_argument("--tilings", default="num_splits=1;block_kv=64,num_splits=6",
                        help="';'-separated KernelConfig overrides, each 'field=value,...'")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, interpreted kernel")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)

    import jax

    from e2e import LLAMA3_8B, TINY
    from jaxmtp.models.registry import load_config
    from jaxmtp.models.params import random_params
    from jaxmtp.kernels import default_config

    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(json.dumps(TINY if args.tiny else LLAMA3_8B))
    cfg = load_config(folder)
    backend = "pallas_interpret" if args.tiny else "pallas"
    params = random_params(cfg, jax.random.key(0), num_mtp_modules=0)
    report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/decode_step.py " + " ".join(sys.argv[1:]),
              "runs": []}
    for shape in args.shapes.split(","):
        batch_size, context = map(int, shape.split("x"))
        batch, num_pages = decode_batch(batch_size, context)
        cache = random_cache(cfg, num_pages)
        rows = batch.input_ids.shape[0]
        default = default_config(rows, batch_size, cfg.num_heads // cfg.num_kv_heads, cfg.num_kv_heads,
                                 batch.page_table.shape[1] * PAGE_SIZE, cfg.head_dim, jax.numpy.dtype(cfg.jnp_dtype).itemsize)
        base_ms = None
        for overrides in [{}] + [parse_tiling(t) for t in args.tilings.split(";") if t]:
            tiling = dataclasses.replace(default, **overrides)
            result, cache = time_step(params, cfg, batch, cache, tiling, backend, args.profile and not overrides)
            base_ms = base_ms or result["step_ms"]
            run = {"batch": batch_size, "context": context, "overrides": overrides,
                   "tiling": dataclasses.asdict(tiling), "vs_default": result["step_ms"] / base_ms, **result}
            report["runs"].append(run)
            print(f"b{batch_size} ctx {context} {overrides or 'default'} {tiling}: {result['step_ms']:.3f} ms "
                  f"({run['vs_default']:.3f} of default; spread {result['spread_ms'][0]:.3f}-{result['spread_ms'][1]:.3f})",
                  flush=True)
            for row in result.get("kernels", [])[:20]:
                print(f"    {row['us_per_step']:8.1f} us x{row['calls_per_step']:5.1f} {row['name']}")
        del cache
        Path(args.out, "decode_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
