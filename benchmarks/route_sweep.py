"""A decode step's MoE routing on one GPU (an H200, under a minute): XLA's path (the
scores, top-k, weights, an argsort of the pairs, their rows and a bincount: about seven
kernels) against kernels/route.py's one program, from the router's logits to the
sorted pairs the grouped calls take, at the shipped MoE shapes' experts and k.

    python benchmarks/route_sweep.py [--models moonlight,glm45_air_fp8] [--rows 8] [--real 1]
        [--update kernels/route_paths.json] [--out DIR] [--tiny]

Per model and step rows T (a decode step's token bucket, 8 at the least; the pairs T*k,
at most route.MAX_PAIRS), of which --real are requests' (the rest padding): both paths are
checked against each other (group sizes and rows equal, weights within 16 float32
ulps), then timed in one profiler trace (gemm_sweep.device_times: their kernels'
summed duration per call, and the kernels a call launches). Writes route_sweep.json
(every row) and route_paths.json, the table the engine reads ({"E,k": {pairs bucket:
"kernel" or "xla"}}; --update merges it into a table file). --tiny: a CPU smoke test
(interpret mode, no trace).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WEIGHT_RTOL = 16 * 2.0**-24  # tests/test_route_kernel.py says why


def paths(moe_cfg, tiny: bool) -> dict:
    """name -> a jitted function of (logits, bias, real rows) giving (group sizes, rows,
    weights) of the sorted pairs."""
    import jax

    from jaxmtp.kernels.route import route_and_sort
    from jaxmtp.models import moe

    experts, k = moe_cfg.num_experts, moe_cfg.num_experts_per_tok

    def xla(logits, bias, real):
        pairs = moe.sort_pairs(moe.choose(logits, bias, moe_cfg).without_rows_from(real), 0, experts)
        return pairs.group_sizes, pairs.rows, pairs.weights

    kernel = functools.partial(route_and_sort, first_expert=0, k=k, num_held=experts, sigmoid=moe_cfg.routing != "softmax",
                               norm_topk_prob=moe_cfg.norm_topk_prob, scaling=moe_cfg.routed_scaling_factor,
                               interpret=tiny)
    return {"xla": jax.jit(xla), "kernel": jax.jit(lambda logits, bias, real: kernel(logits, bias, real))}


def run_case(model: str, moe_cfg, rows: int, real: int, repeats: int, tiny: bool) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from gemm_sweep import device_times

    rng = np.random.default_rng(rows)
    logits = jnp.asarray(rng.standard_normal((rows, moe_cfg.num_experts)), jnp.float32)
    bias = jnp.asarray(0.1 * rng.standard_normal(moe_cfg.num_experts), jnp.float32)
    real = jnp.int32(min(real, rows))
    fns = paths(moe_cfg, tiny)
    outs = {name: [np.asarray(o) for o in fn(logits, bias, real)] for name, fn in fns.items()}
    (sizes, order, weights), (k_sizes, k_order, k_weights) = outs["xla"], outs["kernel"]
    ok = bool(np.array_equal(sizes, k_sizes) and np.array_equal(order, k_order)
              and np.allclose(k_weights, weights, rtol=WEIGHT_RTOL, atol=0))
    times = device_times({name: functools.partial(fn, logits, bias, real) for name, fn in fns.items()}, repeats, 1,
                         tiny)
    row = {"model": model, "rows": rows, "pairs": rows * moe_cfg.num_experts_per_tok,
           "experts": moe_cfg.num_experts, "k": moe_cfg.num_experts_per_tok, "kernel_ok": ok}
    for name in fns:
        us, kernels, wall = times[name]
        row[name] = {"us": us, "kernels": kernels, "wall_us": wall}
    return row


def table(rows: list[dict]) -> dict:
    """{"E,k": {pairs bucket: the faster path}}: the kernel where it agreed with XLA and
    its kernels took less device time."""
    from jaxmtp.kernels.tiling_table import row_bucket

    out = {}
    for r in rows:
        kernel_us, xla_us = r["kernel"]["us"], r["xla"]["us"]
        faster = r["kernel_ok"] and kernel_us is not None and xla_us is not None and kernel_us < xla_us
        out.setdefault(f"{r['experts']},{r['k']}", {})[str(row_bucket(r["pairs"]))] = "kernel" if faster else "xla"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="moonlight,glm45_air_fp8")
    parser.add_argument("--rows", default="8")
    parser.add_argument("--real", type=int, default=1, help="the step's rows that are requests' (batch 1: 1)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--update", default=None, help="a table file (kernels/route_paths.json) to merge into")
    parser.add_argument("--out", default=".")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()

    import jax

    from gemm_sweep import merged_table
    from jaxmtp.kernels.route import MAX_PAIRS
    from jaxmtp.models.config import MoEConfig
    from moe import MODELS

    results = []
    for model in args.models.split(","):
        hf = MODELS[model][1 if args.tiny else 0]
        moe_cfg = MoEConfig.from_hf(hf, hf["model_type"])
        for rows in map(int, args.rows.split(",")):
            if rows * moe_cfg.num_experts_per_tok > MAX_PAIRS:
                continue
            row = run_case(model, moe_cfg, rows, args.real, 5 if args.tiny else args.repeats, args.tiny)
            results.append(row)
            print(f"{model} {rows} rows ({row['pairs']} pairs): xla {row['xla']['us']} us in {row['xla']['kernels']} "
                  f"kernels, kernel {row['kernel']['us']} us (agrees: {row['kernel_ok']})", flush=True)
    measured = table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind
    note = (f"benchmarks/route_sweep.py on {device}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M%z}, "
            f"jax {jax.__version__}")
    (out / "route_sweep.json").write_text(json.dumps({"note": note, "rows": results}, indent=1))
    (out / "route_paths.json").write_text(json.dumps(merged_table(args.update, measured) | {"_note": note}, indent=1))
    print(json.dumps(measured))


if __name__ == "__main__":
    main()
