"""The routed experts' grouped matmuls on one GPU (an H200, one call of a few minutes):
XLA's ragged_dot against the grouped Pallas kernel (kernels/grouped_matmul.py) over a
grid of tilings, at the expert shapes of the MoE models that ship MTP layers, per token
count. Writes the tilings that win into a table in the form of the kernel's
GROUPED_TILINGS, which the engine reads at trace time.

    python benchmarks/grouped_sweep.py [--models moonlight,glm45_air] [--tokens 1,8,32,...]
        [--kernels swiglu,down] [--fp8] [--step-tokens 8] [--hopper-only]
        [--update kernels/grouped_tilings.json] [--budget-s 540] [--out DIR] [--tiny]

A case is a model's expert layer at T tokens: T x top_k (token, expert) pairs routed
uniformly at random (seeded by the case) and sorted by expert, as jaxmtp/models/moe.py
sorts them; the gate/up projection with SiLU-and-multiply (swiglu) and the down
projection (down) are timed apart. The time, the correctness check (relative Frobenius
error against the float32 ragged_dot of the same inputs) and the two-stage search are
benchmarks/gemm_sweep.py's; the weights cycle through enough copies that the experts a
call touches are never in the L2 cache. The floor of a case is the larger of its touched
experts' weight bytes over the copy bandwidth measured in the same process and its FLOPs
over the bf16 matmul rate, also measured here. Writes grouped_sweep.json (every variant)
and grouped_tilings.json ({kernel key: {row bucket: tiling}}, the measured best where it
beat both XLA and the kernel's default by 5%); --fp8: the experts in fp8 with 128 x 128
block scales, held K-major as the engine holds them on one device, XLA's path being the
reference's (dequantize, then a float32 ragged_dot),
the keys "G,K,N,swiglu,128"; --step-tokens S: each --tokens count is the real tokens of
a step of S rows whose other rows are padding routed to no expert (as an engine step pads
to its token bucket: a batch-1 decode step is 8 rows), every count timed at the same
tilings (their first stages together), and the bucket's table entry is the tiling with the
least time summed over the mix; --tiny: a CPU smoke test. Cases of 64 rows a touched
expert or more (prefill) also time the Hopper kernel (kernels/grouped_wgmma.py; not in
--tiny, whose Mosaic GPU interpreter would take minutes), its entries {"wgmma": fields};
--hopper-only skips the Triton stages and times the Hopper kernel against XLA, the default
tiling and the tiling the shipped table names (a short run on top of an earlier sweep).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_sweep import (L2_BYTES, NUM_SMS, Sweep, copy_bandwidth, fastest, fastest_over, merged_table,  # noqa: E402
                        second_stage)

# (experts, top_k, hidden, moe_intermediate) from each checkpoint's config.json
MODELS = {
    "moonlight": (64, 6, 2048, 1408),  # moonshotai/Moonlight-16B-A3B (DeepSeek-V3 body)
    "glm45_air": (128, 8, 4096, 1408),  # zai-org/GLM-4.5-Air-FP8
    "qwen3_next": (512, 10, 2048, 512),  # Qwen/Qwen3-Next-80B-A3B-Instruct
}
TINY_MODELS = {"tiny": (8, 2, 64, 32)}
WIN = 1.05  # a tiling enters the table where it is this much faster than XLA and the default


@dataclasses.dataclass(frozen=True)
class Case:
    """One grouped call: group sizes of the sorted rows, the weight [G, K, parts, N]."""

    sizes: tuple
    k: int
    parts: int  # 2: gate and up side by side (swiglu), 1: down
    n: int
    scale_k: int = 0  # fp8 experts: the square scale block's side (DeepSeek-V3's 128); 0: bf16
    padding: int = 0  # rows past the groups (a step's padding rows, routed to no expert)

    @property
    def scale_block(self) -> tuple[int, int] | None:
        return (self.scale_k, self.scale_k) if self.scale_k else None

    def fp8_arguments(self, scale_inv) -> dict:
        """The grouped calls' fp8 arguments: the experts K-major, as the engine holds them
        on one device (jaxmtp.models.linear.with_fp8_matmul)."""
        return {"scale_inv": scale_inv, "scale_block": self.scale_block, "k_major": True}

    @property
    def rows(self) -> int:
        return sum(self.sizes) + self.padding

    @property
    def touched_bytes(self) -> int:
        return sum(1 for s in self.sizes if s) * self.k * self.parts * self.n * (1 if self.scale_k else 2)


def first_stage(case: Case, tiny: bool) -> list:
    """block_m around the rows per touched group at 4 warps (8 too for tiles of 128 x 128
    or more) and the most stages shared memory holds: weight streams (block_m 16) over
    block_n x block_k x every split of K up to 4 programs a multiprocessor; MMA tiles
    (64, 128) over block_n x block_k."""
    from jaxmtp.kernels.grouped_matmul import GroupedMatmulConfig

    per_group = max(1, case.rows // max(1, sum(1 for s in case.sizes if s)))
    block_ms = [16] if per_group <= 8 else [16, 32] if per_group <= 24 else [32, 64] if per_group <= 64 else [64, 128]
    configs = []
    for block_m in block_ms:
        stream = block_m <= 32
        blocks = sum(-(-s // block_m) for s in case.sizes)
        for block_n in (16,) if tiny else (32, 64, 128, 256) if stream else (64, 128, 256):
            for block_k in (16, 32) if tiny else (64, 128, 256) if stream else (32, 64, 128):
                if case.k % block_k or case.n % block_n or (case.scale_k and case.scale_k % block_k):
                    continue
                steps = case.k // block_k
                stage_bytes = 2 * block_k * (block_m + case.parts * block_n)
                stages = min(4, (200 << 10) // stage_bytes)
                if stages < 2:
                    continue
                # two warpgroups for a 128 x 128 tile or larger (Hopper's MMA takes 64 rows a
                # warpgroup): the second stage only reaches 8 warps around a 4-warp winner
                warps = (4, 8) if block_m * block_n >= 128 * 128 else (4,)
                for split in [d for d in range(1, 17) if steps % d == 0] if stream else [1]:
                    configs.extend(GroupedMatmulConfig(block_m, block_n, block_k, w, stages, split) for w in warps)
                    if blocks * (case.n // block_n) * split >= 4 * NUM_SMS:
                        break
    return configs


WGMMA_MIN_ROWS_PER_GROUP = 64  # one warpgroup's wgmma tile: fewer rows a group would be mostly padding


def wgmma_stage(case: Case, tiny: bool) -> list:
    """The Hopper kernel's tilings (kernels/grouped_wgmma.py) for experts whose groups
    average a wgmma tile of rows or more: 64 rows (one warpgroup) or 128 (two), 64 to
    256 columns (as many as its accumulators' registers allow), 3 or 4 K steps in flight
    (bf16: steps of 64; fp8: of the 128-wide scale block)."""
    from jaxmtp.kernels.grouped_wgmma import GroupedWgmmaConfig, fits

    touched = max(1, sum(1 for s in case.sizes if s))
    if tiny or case.scale_k not in (0, 128) or sum(case.sizes) // touched < WGMMA_MIN_ROWS_PER_GROUP:
        return []
    configs = [GroupedWgmmaConfig(block_m, block_n, case.scale_k or 64, steps) for block_m in (64, 128)
               for block_n in (64, 128, 256) for steps in (3, 4)]
    return [c for c in configs if fits(case.k, case.n, c, swiglu=case.parts == 2, scaled=bool(case.scale_k))]


class GroupedSweep(Sweep):
    """gemm_sweep's compile, check and trace timing over grouped calls."""

    name = "grouped_sweep"

    def max_rel_error(self, config) -> float:
        """The Hopper kernel on fp8 experts rounds the rows to e4m3 (relative 2**-4 at
        most, 2**-4 / sqrt(3) rms over a binade), which the output's relative error
        follows: 5e-2 leaves the rms room (fp8_sweep's bound for the same math)."""
        from jaxmtp.kernels.grouped_wgmma import GroupedWgmmaConfig

        return 5e-2 if self.args.fp8 and isinstance(config, GroupedWgmmaConfig) else super().max_rel_error(config)

    def program(self, config, case: Case):
        from jaxmtp.kernels import grouped_matmul as gm
        from jaxmtp.kernels.grouped_wgmma import GroupedWgmmaConfig, grouped_wgmma

        jax, jnp = self.jax, self.jnp

        def one(x, w):
            sizes = jnp.asarray(case.sizes, jnp.int32)
            w, scales = (w[0], case.fp8_arguments(w[1])) if case.scale_k else (w, {})
            if config is None:  # the engine's path off the kernel: XLA's ragged_dot
                reference = gm.grouped_swiglu_reference if case.parts == 2 else gm.grouped_matmul_reference
                return reference(x, w, sizes, **scales)
            if isinstance(config, GroupedWgmmaConfig):
                return grouped_wgmma(x, w, sizes, scale_inv=scales.get("scale_inv"), config=config,
                                     swiglu=case.parts == 2)
            fn = gm.grouped_swiglu_kernel if case.parts == 2 else gm.grouped_matmul_kernel
            return fn(x, w, sizes, **scales, config=config, interpret=self.tiny)

        return jax.jit(lambda x, *ws: [one(x, w) for w in ws])

    def inputs_of(self, case: Case, seed: int):
        jax, jnp = self.jax, self.jnp
        copies = max(1, min(8, -(-2 * L2_BYTES // case.touched_bytes)))
        keys = jax.random.split(jax.random.key(seed), copies + 1)
        shape = (len(case.sizes), case.k, case.parts, case.n) if case.parts == 2 else (len(case.sizes), case.k, case.n)
        weights = [jax.random.normal(key, shape, jnp.float32) / case.k**0.5 for key in keys[1:]]
        if case.scale_k:  # (fp8 experts, their scales) pairs
            from fp8_sweep import quantize

            block = (1, case.scale_k) + ((1,) if case.parts == 2 else ()) + (case.scale_k,)
            weights = [(jnp.moveaxis(q, 1, -1), scale) for q, scale in (quantize(w, block) for w in weights)]
        else:
            weights = [w.astype(self.dtype) for w in weights]
        x = jax.random.normal(keys[0], (case.rows, case.k), jnp.float32).astype(self.dtype)
        return x, weights

    def reference(self, case: Case, x, weight):
        """float32 products (swiglu: the activation of them) of the first weight copy
        (fp8: dequantized)."""
        from jaxmtp.kernels import grouped_matmul as gm

        jnp = self.jnp
        sizes = jnp.asarray(case.sizes, jnp.int32)
        weight, scales = (weight[0], case.fp8_arguments(weight[1])) if case.scale_k else (weight.astype(jnp.float32), {})
        reference = gm.grouped_swiglu_reference if case.parts == 2 else gm.grouped_matmul_reference
        return reference(x.astype(jnp.float32), weight, sizes, **scales)

    def run_case(self, model: str, kernel: str, tokens: int, case: Case, seed: int, tilings=None) -> None:
        """XLA, the default tiling and the first stage's (or `tilings`, the same list for
        every case of a mix, with no second stage), then the second stage's."""
        from jaxmtp.kernels.grouped_matmul import default_config

        x, weights = self.inputs_of(case, seed)
        reference = self.reference(case, x, weights[0])
        flops = 2 * sum(case.sizes) * case.k * case.parts * case.n
        floor_us = max(case.touched_bytes / self.results["copy_bytes_per_s"],
                       flops / self.results["matmul_flops_per_s"]) * 1e6
        default = default_config(case.rows, len(case.sizes), case.k, case.parts * case.n, case.parts == 2,
                                 case.scale_block)
        candidates = [self.table_tiling(case)] if self.args.hopper_only else tilings or first_stage(case, self.tiny)
        configs = [None, default] + [c for c in candidates if c not in (default, None)]
        rows = self.measure(configs, case, x, weights, reference, floor_us)
        tried = {c for c in configs if c is not None}
        refine = [] if tilings or self.args.hopper_only else second_stage(fastest(rows, 3, type(default)), tried)
        if refine and self.budget_left() > 60 and not self.tiny:
            rows.extend(self.measure(refine, case, x, weights, reference, floor_us))
        hopper = wgmma_stage(case, self.tiny)
        if hopper and self.budget_left() > 60:
            rows.extend({**r, "path": "wgmma"} for r in self.measure(hopper, case, x, weights, reference, floor_us))
        rows[1]["default"] = True
        entry = {"model": model, "kernel": kernel, "tokens": tokens, "rows": case.rows, "padding": case.padding,
                 "groups": len(case.sizes),
                 "touched": sum(1 for s in case.sizes if s), "k": case.k, "n": case.n, "scale_k": case.scale_k,
                 "floor_us": floor_us,
                 "variants": rows}
        self.results["cases"].append(entry)
        self.save()
        self.print_case(entry)

    @staticmethod
    def table_tiling(case: Case):
        """The grouped_matmul tiling the shipped table gives this case (None where it names
        XLA or the Hopper kernel, which the run times anyway)."""
        from jaxmtp.kernels.grouped_matmul import GroupedMatmulConfig, grouped_tiling

        tiling = grouped_tiling(case.rows, len(case.sizes), case.k, case.parts * case.n, case.parts == 2,
                                case.scale_block)
        return tiling if isinstance(tiling, GroupedMatmulConfig) else None

    def print_case(self, entry: dict) -> None:
        rows = entry["variants"]
        ok = [r for r in rows if r.get("ok") and r.get("us")]
        xla = next((r for r in rows if r["config"] is None and r.get("us")), None)
        default = next((r for r in rows if r.get("default") and r.get("us")), None)
        best = min((r for r in ok if r["config"]), key=lambda r: r["us"], default=None)

        def fmt(r):
            return "-" if r is None else f"{r['us']:7.1f} us ({entry['floor_us'] / r['us']:.2f} of floor)"

        tiling = "" if best is None else " ".join(f"{k}={v}" for k, v in best["config"].items())
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {entry['model']:10} {entry['kernel']:6} T={entry['tokens']:<5} "
              f"xla {fmt(xla)}  default {fmt(default)}  best {fmt(best)}  {tiling}", flush=True)


def matmul_rate(sweep: Sweep) -> float:
    """bf16 FLOP/s of XLA's dot at 8192^3, from the kernels' time in a trace."""
    jax, jnp = sweep.jax, sweep.jnp
    n = 256 if sweep.tiny else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    program = jax.jit(lambda a: a @ a)
    jax.block_until_ready(program(a))
    if sweep.tiny:
        return 1e12
    from profile_step import trace_events

    events = trace_events(lambda: program(a), 10)
    return 2 * n**3 * 10 / (sum(e["us"] for e in events) / 1e6)


def routed_sizes(experts: int, top_k: int, tokens: int, seed: int) -> tuple:
    """Rows per expert of `tokens` tokens each routed to top_k distinct experts at random."""
    import numpy as np

    rng = np.random.default_rng(seed)
    chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return tuple(int(c) for c in np.bincount(chosen.reshape(-1), minlength=experts))


def table(results: dict) -> dict:
    """{"G,K,N,swiglu": {bucket: tiling, {"wgmma": fields} or "xla"}}: per row bucket,
    over the cases that measured it (a --step-tokens mix, or one case), the tiling
    (grouped_matmul's, or the Hopper kernel's) fastest over all of them where it beat XLA
    and the default by WIN, "xla" where XLA beat it by WIN (the default elsewhere)."""
    from jaxmtp.kernels.tiling_table import row_bucket

    def marked(row):  # the Hopper kernel's fields told apart from grouped_matmul's
        return {**row, "config": {"kernel": "wgmma", **row["config"]}} if row.get("path") == "wgmma" else row

    buckets: dict = {}  # (key, bucket) -> every case's variants
    for case in results["cases"]:
        swiglu = case["kernel"] == "swiglu"
        key = f"{case['groups']},{case['k']},{case['n'] * (2 if swiglu else 1)},{int(swiglu)}"
        key += f",{case['scale_k']}" if case.get("scale_k") else ""
        buckets.setdefault((key, str(row_bucket(case["rows"]))), []).append([marked(r) for r in case["variants"]])
    out: dict = {}
    for (key, bucket), cases in buckets.items():
        best, best_us, xla = fastest_over(cases)
        default = sum(next((r["us"] for r in rows if r.get("default") and r.get("us")), math.inf) for rows in cases)
        if xla * WIN < best_us:
            out.setdefault(key, {})[bucket] = "xla"
        elif best_us * WIN < min(xla, default):
            out.setdefault(key, {})[bucket] = {"wgmma": list(best[1:])} if best[0] == "wgmma" else list(best)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="moonlight,glm45_air", help="of: " + ", ".join(MODELS))
    parser.add_argument("--tokens", default="1,8,32,128,512,2048,8192", help="token counts, in the order to run them")
    parser.add_argument("--kernels", default="swiglu,down")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret mode, a tiny shape")
    parser.add_argument("--fp8", action="store_true", help="fp8 experts with 128 x 128 block scales "
                        "(DeepSeek-V3's format; their table keys end in the block's 128)")
    parser.add_argument("--update", default=None, help="a table file (kernels/grouped_tilings.json) whose buckets "
                        "this run's replace, the rest kept, written as grouped_tilings.json")
    parser.add_argument("--hopper-only", action="store_true",
                        help="no Triton tiling stages: XLA, the default tiling and the shipped table's against the "
                             "Hopper kernel's tilings (a table run on top of an earlier sweep)")
    parser.add_argument("--step-tokens", type=int, default=0,
                        help="each --tokens count as the real tokens of a step of this many rows (the rest "
                             "padding, routed to no expert, as a decode step's bucket pads), every count timed "
                             "at the same tilings: the table's bucket takes the one fastest over the mix")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.step_tokens and max(token_counts) > args.step_tokens:
        raise SystemExit(f"--tokens {max(token_counts)} is more than --step-tokens {args.step_tokens}")
    sweep = GroupedSweep(args)
    scale_k = (16 if args.tiny else 128) if args.fp8 else 0
    sweep.results["cases"] = []
    sweep.results["copy_bytes_per_s"] = copy_bandwidth(sweep)
    sweep.results["matmul_flops_per_s"] = matmul_rate(sweep)
    print(f"copy {sweep.results['copy_bytes_per_s'] / 1e12:.3f} TB/s, bf16 matmul "
          f"{sweep.results['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    models = TINY_MODELS if args.tiny else {m: MODELS[m] for m in args.models.split(",")}
    kernels = args.kernels.split(",")

    def case_of(model: str, kernel: str, tokens: int) -> Case:
        experts, top_k, hidden, inter = models[model]
        sizes = routed_sizes(experts, top_k, tokens, seed=tokens)
        padding = (args.step_tokens - tokens) * top_k if args.step_tokens else 0
        return Case(sizes, hidden, 2, inter, scale_k, padding) if kernel == "swiglu" else \
            Case(sizes, inter, 1, hidden, scale_k, padding)

    # a step-tokens mix's tilings: every count's first stage, in order, once
    mix_tilings = {(model, kernel): list(dict.fromkeys(
        c for t in token_counts for c in first_stage(case_of(model, kernel, t), args.tiny)))
        for model in models for kernel in kernels} if args.step_tokens else {}
    for tokens in token_counts:
        for model in models:
            for kernel in kernels:
                if sweep.budget_left() < 40:
                    sweep.results.setdefault("skipped_over_budget", []).append(f"{model} {kernel} T={tokens}")
                    continue
                sweep.run_case(model, kernel, tokens, case_of(model, kernel, tokens), seed=tokens,
                               tilings=mix_tilings.get((model, kernel)))
    sweep.results["elapsed_s"] = time.perf_counter() - sweep.t0
    sweep.results["table"] = table(sweep.results)
    sweep.save()
    tilings = merged_table(args.update, sweep.results["table"])
    (sweep.out / "grouped_tilings.json").write_text(json.dumps(tilings, indent=1))
    print("table", json.dumps(sweep.results["table"]), flush=True)


if __name__ == "__main__":
    main()
