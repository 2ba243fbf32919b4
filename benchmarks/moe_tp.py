"""Expert parallelism: two ways for the routed experts to meet their rows, timed on
forced CPU devices (no accelerator needed).

    python benchmarks/moe_tp.py [--devices 2,4] [--tokens 8,64,512] [--out DIR]
    python benchmarks/moe_tp.py --tiny     # 2 devices, small shapes: checks that it runs

- gathered (what jaxmtp/models/moe.py runs): under tensor parallelism every device holds every
  row already (the residual stream is replicated), so each routes them all, runs the
  (row, expert) pairs of its own experts, and one all-reduce of [T, H] sums the parts;
- all-to-all: each device routes its T/N rows, sends each pair to its expert's device (a
  buffer of T/N * k rows per destination, so no pair is ever dropped), runs its experts
  over what arrives, sends the results back, and an all-gather makes the rows whole on
  every device again (the attention and norms around the layer read all of them).

Both compute the same output (checked, float32). The FFN alone is timed (one jitted
call, median of 11 after warm-up), DeepSeek-V3's routing (8 groups, 4 kept, top-8) at a
smaller width. Writes <date>_cpu_moe_tp.json and .md under --out (default
docs/benchmarks/) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FULL = dict(hidden=512, experts=64, k=8, n_group=8, topk_group=4, inter=128)
TINY = dict(hidden=32, experts=8, k=2, n_group=4, topk_group=2, inter=16)


def all_to_all_experts(mesh, cfg):
    """The all-to-all alternative: rows split over the devices on the way in, whole on the way out."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from jaxmtp.models.moe import Routing, route, routed_experts
    from jaxmtp.worker.sharding import ROWS_AXES, TP, param_specs, shard_per_device

    n = mesh.size

    def per_device(p, x):
        rows, k = x.shape[0], cfg.num_experts_per_tok
        routing = route(x, p.router, p.router_bias, cfg)
        held = p.experts_gate_up.shape[0]
        dest = (routing.experts // held).reshape(-1)  # [rows * k]: each pair's device
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=n)
        slot = jnp.arange(rows * k) - (jnp.cumsum(counts) - counts)[dest[order]]  # place in its buffer
        capacity = rows * k
        send = jnp.zeros((n, capacity, x.shape[1]), x.dtype).at[dest[order], slot].set(x[order // k])
        # -1: an empty slot, held by no expert (routed_experts gives it 0)
        expert = jnp.full((n, capacity), -1, jnp.int32).at[dest[order], slot].set(
            routing.experts.reshape(-1)[order] % held)
        got, got_expert = (jax.lax.all_to_all(a, TP, 0, 0) for a in (send, expert))
        ones = jnp.ones((n * capacity, 1), jnp.float32)
        out = routed_experts(got.reshape(n * capacity, -1), Routing(got_expert.reshape(-1, 1), ones),
                             p.experts_gate_up, p.experts_down)
        back = jax.lax.all_to_all(out.reshape(n, capacity, -1), TP, 0, 0)
        weights = routing.weights.reshape(-1)[order][:, None]
        mine = jnp.zeros((rows, x.shape[1]), jnp.float32).at[order // k].add(back[dest[order], slot] * weights)
        return jax.lax.all_gather(mine, TP, tiled=True).astype(x.dtype)

    rows_split = PartitionSpec(TP)  # the rows, T/N a device (the rules keep them whole)
    return lambda p, x: shard_per_device(per_device, mesh, (param_specs(p, mesh), rows_split), ROWS_AXES)(p, x)


def worker(devices: int, tokens: list[int], shape: dict) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmtp.models.config import MoEConfig
    from jaxmtp.models.moe import experts_fn
    from jaxmtp.models.params import MoEParams
    from jaxmtp.worker.sharding import make_mesh, param_shardings, replicated
    from timing import median_time

    assert len(jax.devices()) == devices
    mesh = make_mesh(devices)
    cfg = MoEConfig(num_experts=shape["experts"], num_experts_per_tok=shape["k"], num_shared_experts=0,
                    moe_intermediate_size=shape["inter"], first_k_dense_replace=0, n_group=shape["n_group"],
                    topk_group=shape["topk_group"], routed_scaling_factor=2.5, norm_topk_prob=True)
    rng = np.random.default_rng(0)
    h, e, inter = shape["hidden"], shape["experts"], shape["inter"]
    p = MoEParams(router=rng.standard_normal((h, e)) / np.sqrt(h), router_bias=0.1 * rng.standard_normal(e),
                  experts_gate_up=0.05 * rng.standard_normal((e, h, 2, inter)),
                  experts_down=0.05 * rng.standard_normal((e, inter, h)))
    p = jax.tree.map(lambda a, s: jax.device_put(jnp.asarray(a, jnp.float32), s), p, param_shardings(p, mesh))
    gathered = experts_fn(mesh)
    ways = {"gathered (psum)": jax.jit(lambda p, x: gathered(p, cfg, x, x.shape[0])), "all-to-all": jax.jit(all_to_all_experts(mesh, cfg))}
    rows = []
    for t in tokens:
        x = jax.device_put(jnp.asarray(rng.standard_normal((t, h)), jnp.float32), replicated(mesh))
        outs = {name: np.asarray(fn(p, x)) for name, fn in ways.items()}
        np.testing.assert_allclose(outs["all-to-all"], outs["gathered (psum)"], rtol=1e-4, atol=1e-4)
        times = {name: median_time(fn, p, x, runs=11) for name, fn in ways.items()}
        # what each device's collectives carry (float32): the psum's [T, H]; the two
        # all-to-alls' N buffers of T/N * k rows each, and the all-gather's [T, H]
        moved = {"gathered (psum) MB": 4 * t * h / 1e6, "all-to-all MB": 4 * (2 * t * shape["k"] * h + t * h) / 1e6}
        rows.append({"devices": devices, "tokens": t, **{f"{name} ms": 1e3 * s for name, s in times.items()}, **moved})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="2,4")
    parser.add_argument("--tokens", default="8,64,512")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "docs" / "benchmarks")))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = TINY if args.tiny else FULL
    devices = [2] if args.tiny else [int(n) for n in args.devices.split(",")]
    tokens = [8] if args.tiny else [int(t) for t in args.tokens.split(",")]
    if args.worker:
        print(json.dumps(worker(args.worker, tokens, shape)))
        return
    rows = []
    for n in devices:  # the device count is fixed when JAX starts: one process each
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        done = subprocess.run([sys.executable, __file__, "--worker", str(n), "--tokens", ",".join(map(str, tokens)),
                               *(["--tiny"] if args.tiny else [])], env=env, capture_output=True, text=True, check=True)
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    lines = ["| devices | tokens | gathered (psum) ms | all-to-all ms | all-to-all / gathered | "
             "collectives' MB a device, gathered / all-to-all |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["all-to-all ms"] / r["gathered (psum) ms"]
        lines.append(f"| {r['devices']} | {r['tokens']} | {r['gathered (psum) ms']:.3f} | {r['all-to-all ms']:.3f} | "
                     f"{ratio:.2f} | {r['gathered (psum) MB']:.3g} / {r['all-to-all MB']:.3g} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    date, load = str(datetime.date.today()), os.getloadavg()[0]  # the CPU is shared: its load says how noisy
    (args.out / f"{date}_cpu_moe_tp.json").write_text(
        json.dumps({"date": date, "shape": shape, "load_average_after": load, "rows": rows}, indent=2) + "\n")
    (args.out / f"{date}_cpu_moe_tp.md").write_text(
        f"Routed experts on forced CPU devices, shape {shape}, load average {load:.1f} after the run\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
