"""Where the routed-expert layer's time goes at a few token counts: the GPU kernels of
jaxmtp.models.moe.routed_experts (the sorted layer: the grouped kernels at the measured
table's tilings, the sort, the row gather and the weighted sum) and of
routed_experts_by_pair (the paired kernels and the weighted sum, no sort) from a profiler
trace, each kernel's microseconds per layer.

    python benchmarks/expert_layer_trace.py [--model moonlight] [--tokens 1,2,8,32] [--out DIR]

Writes expert_layer_trace.json. Needs a GPU (the trace's kernels).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from grouped_sweep import MODELS  # noqa: E402
from profile_step import kernel_table, trace_events  # noqa: E402

CALLS = 20  # layer calls per trace, each on its own weight copy set (no L2 reuse)


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmtp.models.moe import Routing, routed_experts, routed_experts_by_pair

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="moonlight", choices=sorted(MODELS))
    parser.add_argument("--tokens", default="1,2,8,32")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    experts, top_k, hidden, inter = MODELS[args.model]
    rng = np.random.default_rng(0)
    copies = 4
    gate_up = [jnp.asarray(0.02 * rng.standard_normal((experts, hidden, 2, inter)), jnp.bfloat16) for _ in range(copies)]
    down = [jnp.asarray(0.02 * rng.standard_normal((experts, inter, hidden)), jnp.bfloat16) for _ in range(copies)]
    results = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "command": "python benchmarks/expert_layer_trace.py " + " ".join(sys.argv[1:]), "by_tokens": {}}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
        chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        routing = Routing(jnp.asarray(chosen, jnp.int32), jnp.asarray(rng.random((tokens, top_k)), jnp.float32))
        for name, fn in (("sorted", routed_experts), ("paired", routed_experts_by_pair)):
            layer = jax.jit(lambda x, routing, gu, dn, fn=fn: fn(x, routing, gu, dn))
            jax.block_until_ready([layer(x, routing, gate_up[i], down[i]) for i in range(copies)])
            copy = itertools.cycle(range(copies))

            def run(layer=layer, copy=copy):  # each call on the next weight copy
                i = next(copy)
                return layer(x, routing, gate_up[i], down[i])

            table = kernel_table(trace_events(run, CALLS), CALLS)
            total = sum(row["us_per_step"] for row in table)
            results["by_tokens"].setdefault(str(tokens), {})[name] = {"kernels": table, "kernel_us_per_layer": total}
            print(f"T={tokens} {name}: {total:.1f} us of kernels a layer", flush=True)
            for row in table:
                print(f"   {row['us_per_step']:7.1f} us x{row['calls_per_step']:.0f}  {row['name'][:90]}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "expert_layer_trace.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
