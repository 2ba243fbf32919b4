"""Block-scaled fp8 GEMMs on one GPU (an H200, one call of a few minutes): per weight
shape and row count, the fp8 Pallas kernel (kernels/fp8_matmul.py) over a grid of
tilings against XLA's dot of the weight dequantized to bfloat16 (the other path the
engine has) and against XLA's dot of a bfloat16 weight of the same shape (what fp8 must
beat), at the Llama-3-8B projections with DeepSeek-V3's 128 x 128 scale blocks, each fp8
path reading the weight K-major ([P, N, K]) as the engine holds it for them. Writes the
per-shape choice into the table the engine reads at trace time.

    python benchmarks/fp8_sweep.py [--m 1,2,4,8,16,32,64,128,256,2048] [--shapes q_o,kv,...]
        [--budget-s 480] [--out DIR] [--update kernels/fp8_tilings.json] [--tiny]

Compiling, checking (relative Frobenius error against the float32 matmul of the
dequantized weight) and timing (kernel time in a profiler trace, weights cycling
through copies that the L2 cache cannot hold) are benchmarks/gemm_sweep.py's. The fp8
kernel steps K by the scale block, so its tilings are block_m x block_n x split_k at 4
warps, then warps and stages around the best three. Writes fp8_sweep.json (every
variant, each row's floor fraction over the fp8 weight and scale bytes) and
fp8_tilings.json ({"K,P,N,block_k,block_n": {row bucket: tiling or "dequantize"}}: the
faster of the best tiling and the dequantized dot; --update: merged into a table measured
before, this run's buckets replacing the same ones there). --tiny: a CPU smoke test.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_sweep import (  # noqa: E402
    NUM_SMS, SHAPES, SMEM_BYTES, Sweep, copy_bandwidth, fastest, merged_table, second_stage, sweep_parser, sweep_shapes,
    weight_copies,
)

FP8_SHAPES = {label: SHAPES[label] for label in ("q_o", "kv", "qkv", "gate_up", "down")}
TINY_SHAPES = {"q_o": (64, 1, 96), "gate_up": (48, 2, 40)}
BLOCK = (128, 128)
TINY_BLOCK = (16, 32)


def fp8_stages(config, block_k: int) -> int:
    """The most pipeline stages (up to 4) whose x tile (bf16, or fp8 with x_fp8) and fp8
    weight tile fit."""
    x_bytes = 1 if config.x_fp8 else 2
    return min(4, SMEM_BYTES // (block_k * (x_bytes * config.block_m + config.block_n)))


def first_stage(m: int, k: int, parts: int, n: int, block_k: int, tiny: bool) -> list:
    """block_m x block_n x every split of K up to the first giving 4 programs per
    multiprocessor, at 4 warps and the most stages shared memory holds: MMA tiles of
    16 rows or more, each also with x quantized to fp8 (x_fp8), and below 16 rows also
    the vector units' products (their float32 accumulator, block_m x block_k x block_n,
    kept to what registers hold)."""
    from jaxmtp.kernels.fp8_matmul import MMA_ROWS, MatmulConfig
    from jaxmtp.kernels.tiling_table import row_bucket

    bucket = row_bucket(m)
    block_ms = [bucket] if bucket < MMA_ROWS else []
    block_ms += [min(max(bucket, MMA_ROWS), 64)] if bucket <= 64 else [64, 128]
    steps = -(-k // block_k)
    configs = []
    for block_m in block_ms:
        for block_n in (32,) if tiny else (32, 64, 128, 256):
            if block_m < MMA_ROWS and block_m * block_n > 256:
                continue
            for split in [d for d in range(1, 17) if steps % d == 0]:
                for x_fp8 in (False, True) if block_m >= MMA_ROWS else (False,):
                    warps = 8 if block_m * block_n >= 128 * 128 else 4  # a 128 x 128 float32 tile: 128 registers a thread
                    config = MatmulConfig(block_m, block_n, warps, 4, block_k=block_k, split_k=split, x_fp8=x_fp8)
                    stages = fp8_stages(config, block_k)
                    if stages >= 2:
                        configs.append(dataclasses.replace(config, num_stages=stages))
                if -(-m // block_m) * parts * -(-n // block_n) * split >= 4 * NUM_SMS:
                    break
    return configs


WGMMA_MIN_ROWS = 64  # one warpgroup's wgmma tile: fewer rows would be mostly padding


def wgmma_stage(m: int, k: int, n: int, block: tuple[int, int], tiny: bool) -> list:
    """The Hopper kernel's tilings (kernels/fp8_wgmma.py) where the weight fits it: 64
    rows (one warpgroup) or 128 (two, from 128 rows), 64 or 128 columns, 2 to 4 K steps
    in flight."""
    from jaxmtp.kernels.fp8_wgmma import WgmmaConfig, fits

    if tiny or m < WGMMA_MIN_ROWS:
        return []
    configs = [WgmmaConfig(block_m, block_n, steps) for block_m in (64, 128) if block_m <= m
               for block_n in (64, 128) for steps in (2, 3, 4)]
    return [c for c in configs if fits(k, n, block, c)]


def quantize(w, block: tuple[int, ...]):
    """w in float32 as float8_e4m3fn with one float32 scale per block (block[i]: its size
    along axis i; the block's largest magnitude maps to e4m3's 448), DeepSeek-V3's
    format: ([K, P, N] with (bk, 1, bn); experts [G, K, (2,) N] with (1, bk, (1,) bn))."""
    import jax.numpy as jnp

    from jaxmtp.kernels.fp8_matmul import dequantize_blocks

    padded = jnp.pad(jnp.abs(w), [(0, -n % b) for n, b in zip(w.shape, block)])
    split = [d for n, b in zip(padded.shape, block) for d in (n // b, b)]
    amax = padded.reshape(split).max(axis=tuple(range(1, len(split), 2)))
    scale = jnp.maximum(amax, 1e-12) / 448.0
    return (w / dequantize_blocks(jnp.ones_like(w), scale, block)).astype(jnp.float8_e4m3fn), scale


class Fp8Sweep(Sweep):
    """gemm_sweep's compile, check and trace timing over fp8 weights: a variant's weights
    are (fp8 weight, scales) pairs, or bfloat16 arrays for the bf16 baseline."""

    name = "fp8_sweep"

    def max_rel_error(self, config) -> float:
        """fp8 x (x_fp8 tiles, the Hopper kernel) rounds x to e4m3 (relative 2**-4 at
        most, 2**-4 / sqrt(3) rms over a binade), which the output's relative error
        follows: 5e-2 leaves the rms room."""
        from jaxmtp.kernels.fp8_wgmma import WgmmaConfig

        fp8_x = isinstance(config, WgmmaConfig) or (config is not None and config.x_fp8)
        return 5e-2 if fp8_x else super().max_rel_error(config)

    def program(self, config, shape):
        from jaxmtp.kernels.fp8_matmul import fp8_matmul, fp8_matmul_dequantized

        jax = self.jax
        k, parts, n = shape
        block_k, block_n = self.block

        def one(x, w):
            # each weight copy gets its own x, as each layer's linear does: XLA would
            # otherwise quantize the shared x once for every copy (the wgmma rows)
            x, w = jax.lax.optimization_barrier((x, w))
            if not isinstance(w, tuple):  # the bf16 baseline: XLA's dot as linear() computes it
                engine_w = w.reshape(k, n) if parts == 1 else w
                return jax.lax.dot_general(x, engine_w, (((1,), (0,)), ((), ()))).reshape(x.shape[0], parts, n)
            blocks = dict(block_k=block_k, block_n=block_n, k_major=True)
            if config is None:
                return fp8_matmul_dequantized(x, *w, **blocks)
            return fp8_matmul(x, *w, **blocks, config=config, interpret=self.tiny)

        return jax.jit(lambda x, *ws: [one(x, w) for w in ws])

    def add_shape(self, label: str, shape, max_m: int) -> None:
        """Random x, fp8 weight copies and bf16 weight copies of one shape."""
        jax, jnp = self.jax, self.jnp
        k, parts, n = shape
        copies = weight_copies(shape, jnp.dtype(jnp.float8_e4m3fn))
        keys = jax.random.split(jax.random.key(zlib.crc32(label.encode())), 2 * copies + 1)
        normal = [jax.random.normal(key, shape, jnp.float32) / k**0.5 for key in keys[1:]]
        fp8 = [quantize(w, (self.block[0], 1, self.block[1])) for w in normal[:copies]]  # [K, P, N]
        bf16 = [w.astype(jnp.bfloat16) for w in normal[copies:copies + weight_copies(shape, jnp.dtype(jnp.bfloat16))]]
        x = jax.random.normal(keys[0], (max_m, k), jnp.float32).astype(jnp.bfloat16)
        fp8_bytes = k * parts * n + fp8[0][1].size * 4
        bandwidth = self.results["copy_bytes_per_s"]
        k_major = [(q.transpose(1, 2, 0), scale) for q, scale in fp8]  # the engine's layout, [P, N, K]
        self.inputs[label] = (shape, x, k_major, bf16)
        self.references[label] = fp8[0]
        self.results["shapes"][label] = {"k": k, "parts": parts, "n": n, "block": list(self.block),
                                         "floor_us": fp8_bytes / bandwidth * 1e6,
                                         "bf16_floor_us": 2 * k * parts * n / bandwidth * 1e6, "by_m": {}}

    def run(self, label: str, m: int) -> None:
        from jaxmtp.kernels.fp8_matmul import MatmulConfig, dense_matmul_reference, fp8_matmul_reference

        shape, x_all, fp8, bf16 = self.inputs[label]
        entry = self.results["shapes"][label]
        x = x_all[:m]
        f32 = self.jnp.float32
        block_k, block_n = self.block
        reference = fp8_matmul_reference(x, *self.references[label], block_k=block_k, block_n=block_n, out_dtype=f32)
        rows = self.measure([None] + first_stage(m, *shape, block_k, self.tiny), shape, x, fp8, reference,
                            entry["floor_us"])
        rows[0]["path"] = "dequantize"
        refine = second_stage(fastest(rows, 3), {MatmulConfig(**r["config"]) for r in rows if r["config"]})
        refine = [c for c in refine if c.num_stages <= fp8_stages(c, block_k)]
        if refine and self.budget_left() > 60 and not self.tiny:
            rows.extend(self.measure(refine, shape, x, fp8, reference, entry["floor_us"]))
        hopper = wgmma_stage(m, shape[0], shape[2], self.block, self.tiny)
        if hopper:
            rows.extend({**r, "path": "wgmma"} for r in self.measure(hopper, shape, x, fp8, reference,
                                                                      entry["floor_us"]))
        baseline = self.measure([None], shape, x, bf16, dense_matmul_reference(x, bf16[0], out_dtype=f32),
                                entry["floor_us"])
        rows.append({**baseline[0], "path": "bf16"})
        entry["by_m"][str(m)] = rows
        self.save()
        self.print_case(label, m, rows, entry["floor_us"])

    def print_case(self, label: str, m: int, rows: list[dict], floor_us: float) -> None:
        by_path = {r.get("path"): r for r in rows if r.get("path")}
        kernels = [r for r in rows if r["config"] and r.get("ok") and r.get("us")]

        def fmt(r):
            return "-" if not r or r.get("us") is None else f"{r['us']:7.1f} us ({floor_us / r['us']:.2f})"

        line = f"[{time.perf_counter() - self.t0:5.0f}s] {label:8} M={m:<5} bf16 {fmt(by_path.get('bf16'))}  " \
               f"dequantize {fmt(by_path.get('dequantize'))}"
        kinds = {"kernel": lambda r: "path" not in r and not r["config"]["x_fp8"],
                 "fp8 x": lambda r: "path" not in r and r["config"]["x_fp8"], "wgmma": lambda r: "path" in r}
        for name, kind in kinds.items():
            best = min((r for r in kernels if kind(r)), key=lambda r: r["us"], default=None)
            if best is not None:
                tiling = " ".join(f"{k}={v}" for k, v in best["config"].items() if k != "x_fp8")
                line += f"  {name} {fmt(best)} err {best['rel_err']:.1e} [{tiling}]"
        print(line, flush=True)


def table(results: dict) -> dict:
    """{"K,P,N,block_k,block_n": {row bucket: the best tiling's fields ({"wgmma":
    fields} for the Hopper kernel's), or "dequantize" where the dequantized dot was
    faster}}; a bucket measured more than once keeps its larger row count's choice."""
    from jaxmtp.kernels.tiling_table import row_bucket

    out: dict = {}
    for entry in results["shapes"].values():
        key = ",".join(str(v) for v in (entry["k"], entry["parts"], entry["n"], *entry["block"]))
        for m, rows in sorted(entry["by_m"].items(), key=lambda item: int(item[0])):
            timed = [r for r in rows if r.get("us") and r.get("ok") and r.get("path") != "bf16"]
            if not timed:
                continue
            best = min(timed, key=lambda r: r["us"])
            c = best["config"]
            if c is None:
                choice = "dequantize"
            elif best.get("path") == "wgmma":
                choice = {"wgmma": [c["block_m"], c["block_n"], c["max_concurrent_steps"]]}
            else:
                choice = [c["block_m"], c["block_n"], c["num_warps"], c["num_stages"], c["block_k"], c["split_k"],
                          c["x_fp8"]]
            out.setdefault(key, {})[str(row_bucket(int(m)))] = choice
    return out


def main() -> None:
    parser = sweep_parser("1,2,4,8,16,32,64,128,256,2048", "down,gate_up,q_o,kv,qkv", FP8_SHAPES)
    parser.add_argument("--update", default=None, help="a table file (kernels/fp8_tilings.json) whose buckets this "
                        "run's replace, the rest kept, written as fp8_tilings.json (a sweep in several calls)")
    args = parser.parse_args()
    sweep = Fp8Sweep(args)
    sweep.references = {}  # label -> the first weight copy [K, P, N] and its scales
    sweep.block = TINY_BLOCK if args.tiny else BLOCK
    sweep.results["block"] = list(sweep.block)
    sweep.results["copy_bytes_per_s"] = copy_bandwidth(sweep)
    print(f"copy bandwidth {sweep.results['copy_bytes_per_s'] / 1e12:.3f} TB/s", flush=True)
    sweep_shapes(sweep, TINY_SHAPES if args.tiny else FP8_SHAPES, lambda label, m, ms: sweep.run(label, m))
    sweep.results["table"] = table(sweep.results)
    sweep.save()
    tilings = merged_table(args.update, sweep.results["table"])
    (sweep.out / "fp8_tilings.json").write_text(json.dumps(tilings, indent=1))
    print("table", json.dumps(sweep.results["table"]), flush=True)


if __name__ == "__main__":
    main()
