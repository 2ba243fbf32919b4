"""GEMMs of few rows on one GPU (an H200, one call of a few minutes): XLA's dot, the
engine's `linear` before issue 30, against the weight-streaming Pallas kernel
(kernels/fp8_matmul.py, `dense_matmul`) over a grid of tilings, at the Llama-3-8B
projections in bfloat16.

    python benchmarks/gemm_sweep.py [--m 1,2,4,8,32,64,128,256] [--shapes q_o,kv,...]
        [--budget-s 480] [--out DIR] [--tiny]

Per shape and row count M: each variant is compiled (the kernels in parallel threads,
XLA's dots one at a time: their autotuning times candidates on the GPU), checked
against a float32 matmul of the same inputs on the device (relative Frobenius error),
then timed in a profiler trace: the summed duration of its kernels (a split-K sum
included) per matmul, over calls that cycle through enough weight copies that the L2
cache (60 MB) holds none of them, as every layer's own weights in the engine. The
copy bandwidth is measured the same way in the same process (a read and a write of
1 GiB), and each time is also given as the weight bytes' floor over it (bytes /
bandwidth / time: 1 is the floor). Tilings are searched in two stages: block_n x
block_k x split_k at 4 warps and 4 stages, then warps and stages around the best
three. M = 1, 2, 4 (the same 16-row tile as 8) time M = 8's best three.
Writes gemm_sweep.json (every variant) and prints, per shape and M, XLA and the best
kernel. --tiny: a CPU smoke test of the script (interpret mode, tiny shapes, no trace).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (K, P, N) of the Llama-3-8B projections in the layout linear() gets them; q_o is
# q_proj and o_proj, kv each of k_proj and v_proj; qkv is q, k and v as XLA merges them
SHAPES = {
    "q_o": (4096, 1, 4096), "kv": (4096, 1, 1024), "qkv": (4096, 1, 6144),
    "gate_up": (4096, 2, 14336), "down": (14336, 1, 4096), "lm_head": (4096, 1, 128256),
}
TINY_SHAPES = {"q_o": (64, 1, 96), "gate_up": (48, 2, 40)}
L2_BYTES = 60 << 20
SMEM_BYTES = 200 << 10  # of the 228 KB a multiprocessor has, what the tiles' stages may take
NUM_SMS = 132
GAP_US = 2000  # idle time between two variants' kernels in the trace (the host sleeps longer)


def tile_stages(config) -> int:
    """The most pipeline stages (up to 4) whose x and weight tiles fit in shared memory."""
    stage = 2 * config.block_k * (config.block_m + config.block_n)
    return min(4, SMEM_BYTES // stage)


def first_stage(m: int, k: int, parts: int, n: int, tiny: bool) -> list:
    """block_m x block_n x block_k x split_k at 4 warps: every split up to the first that
    gives 4 programs per multiprocessor."""
    from jaxmtp.kernels.fp8_matmul import MatmulConfig

    block_ms = {16: [16], 32: [32], 64: [64], 128: [64, 128], 256: [128, 256]}[max(16, 1 << (m - 1).bit_length())]
    configs = []
    for block_m in block_ms:
        for block_n in (32, 64, 128) if not tiny else (32,):
            for block_k in (128, 256) if not tiny else (16, 32):
                steps = -(-k // block_k)
                for split in (1, 2, 4, 8, 16):
                    programs = -(-m // block_m) * parts * -(-n // block_n) * split
                    if steps % split:
                        continue
                    config = MatmulConfig(block_m, block_n, 4, 4, block_k=block_k, split_k=split)
                    stages = tile_stages(config)
                    if stages >= 2:
                        configs.append(dataclasses.replace(config, num_stages=stages))
                    if programs >= 4 * NUM_SMS:
                        break
    return configs


def second_stage(best: list, tried: set) -> list:
    """Warps 4 and 8 and stages 3 to 5 (what shared memory allows) around each of best."""
    configs = []
    for config in best:
        for warps in (4, 8):
            for stages in range(3, min(5, tile_stages(dataclasses.replace(config, num_stages=5))) + 1):
                candidate = dataclasses.replace(config, num_warps=warps, num_stages=stages)
                if candidate not in tried and candidate not in configs:
                    configs.append(candidate)
    return configs


def weight_copies(shape, dtype) -> int:
    """Copies of a weight to cycle through so that the L2 cache holds none of them."""
    k, parts, n = shape
    return max(1, min(8, -(-2 * L2_BYTES // (k * parts * n * dtype.itemsize))))


class Sweep:
    name = "gemm_sweep"  # of the script and of the JSON file it writes

    def __init__(self, args):
        import jax
        import jax.numpy as jnp

        self.args, self.jax, self.jnp = args, jax, jnp
        self.t0 = time.perf_counter()
        self.tiny = args.tiny
        self.dtype = jnp.bfloat16
        self.results = {"date": time.strftime("%Y-%m-%d"), "command": f"python benchmarks/{self.name}.py "
                        + " ".join(sys.argv[1:]), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                        "shapes": {}}
        self.inputs = {}  # label -> (shape, x, weight copies)
        self.out = Path(os.environ.get("OUT", args.out))
        self.out.mkdir(parents=True, exist_ok=True)

    def max_rel_error(self, config) -> float:
        """A variant's largest relative error against the float32 reference: bfloat16
        outputs are ~1e-3 off from their one rounding."""
        return 1e-2

    def budget_left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        (self.out / f"{self.name}.json").write_text(json.dumps(self.results, indent=1))

    # ----- variants --------------------------------------------------------------------

    def program(self, config, shape):
        """A jitted function of (x, *weights) -> one output per weight: XLA's dot as
        linear() computes it (config None) or the kernel with config."""
        from jaxmtp.kernels.fp8_matmul import dense_matmul

        jax = self.jax
        k, parts, n = shape
        dims = (((1,), (0,)), ((), ()))

        def one(x, w):
            if config is None:
                engine_w = w.reshape(k, n) if parts == 1 else w  # [K, N], or gate and up [K, 2, I]
                return jax.lax.dot_general(x, engine_w, dims).reshape(x.shape[0], parts, n)
            return dense_matmul(x, w, config=config, interpret=self.tiny)

        return jax.jit(lambda x, *ws: [one(x, w) for w in ws])

    def compile_all(self, configs, shape, x, weights) -> dict:
        """config -> compiled program or the error that stopped it; XLA's (None) first,
        alone, then the kernels in parallel threads."""
        def build(config):
            try:
                return self.program(config, shape).lower(x, *weights).compile()
            except Exception as e:  # a tiling Triton cannot fit (shared memory, registers)
                return f"{type(e).__name__}: {str(e)[:300]}"

        compiled = {None: build(None)} if None in configs else {}
        kernels = [c for c in configs if c is not None]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
            compiled.update(zip(kernels, pool.map(build, kernels)))
        # what failed in a thread is built again alone, so that a failure is the tiling's
        compiled.update({c: build(c) for c in kernels if isinstance(compiled[c], str)})
        return compiled

    def check(self, program, x, weights, reference) -> float:
        """Relative Frobenius error of the first output against the float32 reference."""
        jnp = self.jnp
        out = program(x, *weights)[0].astype(jnp.float32)
        return float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))

    def time_all(self, programs: dict, x, weights) -> dict:
        """name -> (kernel microseconds per matmul, kernels per matmul, wall microseconds
        per matmul) for each program (device_times)."""
        calls = {name: functools.partial(program, x, *weights) for name, program in programs.items()}
        return device_times(calls, 3 if self.tiny else 10, len(weights), self.tiny)

    # ----- one shape -------------------------------------------------------------------

    def add_shape(self, label: str, shape, max_m: int) -> None:
        """Random x and weight copies of one shape, kept on the device for every M."""
        jax, jnp = self.jax, self.jnp
        k, parts, n = shape
        keys = jax.random.split(jax.random.key(zlib.crc32(label.encode())), weight_copies(shape, jnp.dtype(self.dtype)) + 1)
        weights = [(jax.random.normal(key, shape, jnp.float32) / k**0.5).astype(self.dtype) for key in keys[1:]]
        x = jax.random.normal(keys[0], (max_m, k), jnp.float32).astype(self.dtype)
        floor_us = k * parts * n * jnp.dtype(self.dtype).itemsize / self.results["copy_bytes_per_s"] * 1e6
        self.inputs[label] = (shape, x, weights)
        self.results["shapes"][label] = {"k": k, "parts": parts, "n": n, "weight_copies": len(weights),
                                         "floor_us": floor_us, "by_m": {}}

    def run(self, label: str, m: int, small: bool) -> None:
        """XLA and the kernel's tilings at M rows of one shape; small: the tilings are
        M = 8's three fastest (the same 16-row tile), else the two-stage search."""
        from jaxmtp.kernels.fp8_matmul import MatmulConfig, dense_matmul_reference

        shape, x_all, weights = self.inputs[label]
        entry = self.results["shapes"][label]
        x = x_all[:m]
        reference = dense_matmul_reference(x, weights[0], out_dtype=self.jnp.float32)
        rows = entry["by_m"].setdefault(str(m), [])
        measure = functools.partial(self.measure, shape=shape, x=x, weights=weights, reference=reference,
                                    floor_us=entry["floor_us"])
        if small:
            rows.extend(measure([None] + fastest(entry["by_m"].get("8", []), 3)))
        else:
            rows.extend(measure([None] + first_stage(m, *shape, self.tiny)))
            refine = second_stage(fastest(rows, 3), {MatmulConfig(**r["config"]) for r in rows if r["config"]})
            if refine and self.budget_left() > 60:
                rows.extend(measure(refine))
        self.save()
        self.print_best(label, m, rows, entry["floor_us"])

    def measure(self, configs, shape, x, weights, reference, floor_us) -> list[dict]:
        compiled = self.compile_all(configs, shape, x, weights)
        rows, programs = [], {}
        for config, program in compiled.items():
            row = {"config": None if config is None else dataclasses.asdict(config)}
            try:
                if isinstance(program, str):
                    raise RuntimeError(program)
                row["rel_err"] = self.check(program, x, weights, reference)
                row["ok"] = bool(row["rel_err"] < self.max_rel_error(config))
                programs[len(rows)] = program
            except Exception as e:  # a compile error, or a launch Triton could not fit
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
        times = self.time_all(programs, x, weights)
        for index, (us, kernels, wall_us) in ((i, t) for i, t in times.items() if i != "trace_error"):
            rows[index].update(us=us, kernels_per_matmul=kernels, wall_us=wall_us,
                               floor_fraction=None if us is None else floor_us / us)
        if "trace_error" in times:
            self.results.setdefault("trace_errors", []).append(times["trace_error"])
        return rows

    def print_best(self, label: str, m: int, rows: list[dict], floor_us: float) -> None:
        xla = next((r for r in rows if r["config"] is None), {})
        kernels = [r for r in rows if r["config"] and r.get("ok") and r.get("us")]
        best = min(kernels, key=lambda r: r["us"], default=None)
        failed = sum(1 for r in rows if "error" in r or not r.get("ok", True))

        def fmt(r):
            return "-" if not r or r.get("us") is None else f"{r['us']:7.1f} us ({floor_us / r['us']:.2f} of floor)"

        tiling = "" if best is None else " ".join(f"{k}={v}" for k, v in best["config"].items())
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {label:8} M={m:<4} xla {fmt(xla)}  kernel {fmt(best)}  "
              f"{tiling}  ({len(kernels)} timed, {failed} failed)", flush=True)


def merged_table(earlier: str | None, measured: dict) -> dict:
    """A table file measured before (None: none) with this run's buckets over its own, its
    other buckets and its notes kept (a sweep in several device calls)."""
    table = json.loads(Path(earlier).read_text()) if earlier else {}
    for key, buckets in measured.items():
        table.setdefault(key, {}).update(buckets)
    return table


def checked_kernel(row: dict) -> bool:
    """A kernel variant that agreed with the reference and was timed."""
    return bool(row["config"]) and row.get("ok", False) and row.get("us") is not None


def fastest(rows: list[dict], count: int, config_class=None) -> list:
    """The configs (config_class: the dense kernel's MatmulConfig unless given) of the
    `count` fastest correct kernel rows."""
    from jaxmtp.kernels.fp8_matmul import MatmulConfig

    timed = sorted((r for r in rows if checked_kernel(r)), key=lambda r: r["us"])
    return [(config_class or MatmulConfig)(**r["config"]) for r in timed[:count]]


def fastest_over(cases: list[list[dict]]) -> tuple[tuple | None, float, float]:
    """Over cases that share a table bucket (each its variant rows, XLA's with config
    None): the tiling (its config's values) with the least time summed over all of them,
    among those checked and timed in every one (None if none was), that sum, and XLA's."""
    xla = sum(next((r.get("us") for r in rows if r["config"] is None), None) or math.inf for rows in cases)
    timed = [{tuple(r["config"].values()): r["us"] for r in rows if checked_kernel(r)} for rows in cases]
    common = set.intersection(*(set(t) for t in timed))
    best = min(common, key=lambda c: sum(t[c] for t in timed), default=None)
    return best, math.inf if best is None else sum(t[best] for t in timed), xla


def device_times(calls: dict, repeats: int, per_call: int, tiny: bool) -> dict:
    """name -> (kernel microseconds per unit, kernels per unit, wall microseconds per
    unit) for each zero-argument call (a unit: one of the per_call it does), run
    `repeats` times back to back; kernel times from one profiler trace in which the
    variants are told apart by the idle gaps between them (tiny, on the CPU: no trace,
    the wall time stands in, for the smoke tests)."""
    import jax

    if not calls:  # every variant failed its compile or check
        return {}
    wall = {}
    for name, call in calls.items():
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(repeats):
                out = call()
            jax.block_until_ready(out)
            best = min(best, time.perf_counter() - t)
        wall[name] = best / (repeats * per_call) * 1e6
    if tiny:
        return {name: (us, None, us) for name, us in wall.items()}
    from profile_step import trace_events

    def run_each():
        for call in calls.values():
            for _ in range(repeats):
                out = call()
            jax.block_until_ready(out)
            time.sleep(4 * GAP_US / 1e6)
        return out

    groups = idle_separated(trace_events(run_each, 1), len(calls))
    if groups is None:
        return {name: (None, None, us) for name, us in wall.items()} | {
            "trace_error": f"the trace's kernels do not part into {len(calls)} variants at idle gaps of "
                           f"more than {GAP_US} us"}
    units = repeats * per_call
    return {name: (sum(e["us"] for e in group) / units, len(group) / units, wall[name])
            for name, group in zip(calls, groups)}


def idle_separated(events: list[dict], count: int) -> list[list[dict]] | None:
    """The trace's kernels in `count` runs, parted at the count - 1 longest idle gaps
    (the host sleeps between variants; a stall of the host inside one variant's run
    leaves a shorter gap, which a fixed threshold took for a boundary); None where there
    are too few kernels or a parting gap is not longer than GAP_US."""
    events = sorted(events, key=lambda e: e["ts"])
    gaps, end = [], None
    for i, e in enumerate(events):
        if end is not None:
            gaps.append((e["ts"] - end, i))
        end = max(end or 0, e["ts"] + e["us"])
    parting = sorted(gaps, reverse=True)[:count - 1]
    if len(events) < count or any(gap <= GAP_US for gap, _ in parting):
        return None
    bounds = [0, *sorted(i for _, i in parting), len(events)]
    return [events[a:b] for a, b in zip(bounds, bounds[1:])]


def copy_bandwidth(sweep: Sweep) -> float:
    """Bytes read plus written per second by XLA's elementwise a + 1 over 1 GiB of
    bfloat16, from the kernels' time in a trace (as the GEMMs are timed)."""
    jax, jnp = sweep.jax, sweep.jnp
    a = jnp.ones((1 << (12 if sweep.tiny else 29),), jnp.bfloat16)
    program = jax.jit(lambda a: a + 1)
    jax.block_until_ready(program(a))
    if sweep.tiny:
        return 1e9
    from profile_step import trace_events

    calls = 20

    def run():
        for _ in range(calls):
            out = program(a)
        return out

    events = trace_events(run, 1)
    return 2 * a.nbytes * calls / (sum(e["us"] for e in events) / 1e6)


def sweep_parser(m: str, shapes: str, known: dict) -> argparse.ArgumentParser:
    """A sweep's command line: --m and --shapes (defaults m and shapes, of known),
    --budget-s, --out and --tiny."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default=m, help="row counts, in the order to run them")
    parser.add_argument("--shapes", default=shapes, help="of: " + ", ".join(known))
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret mode, tiny shapes")
    return parser


def main() -> None:
    args = sweep_parser("64,32,128,8,2,4,1,256", "q_o,kv,qkv,down,gate_up,lm_head", SHAPES).parse_args()
    sweep = Sweep(args)
    sweep.results["copy_bytes_per_s"] = copy_bandwidth(sweep)
    print(f"copy bandwidth {sweep.results['copy_bytes_per_s'] / 1e12:.3f} TB/s", flush=True)
    sweep_shapes(sweep, TINY_SHAPES if args.tiny else SHAPES,
                 lambda label, m, ms: sweep.run(label, m, small=m < 8 and 8 in ms[:ms.index(m)]))


def sweep_shapes(sweep: Sweep, shapes: dict, run_one) -> None:
    """run_one(label, m, ms) for each of --shapes at each of --m, M outer (the first row
    counts first, whatever the budget leaves out); the elapsed time saved."""
    labels = [label for label in sweep.args.shapes.split(",") if label in shapes]
    ms = [int(m) for m in sweep.args.m.split(",")]
    for label in labels:
        sweep.add_shape(label, shapes[label], max(ms))
    for m in ms:
        for label in labels:
            if sweep.budget_left() < 30:
                sweep.results.setdefault("skipped_over_budget", []).append(f"{label} M={m}")
                continue
            run_one(label, m, ms)
    sweep.results["elapsed_s"] = time.perf_counter() - sweep.t0
    sweep.save()


if __name__ == "__main__":
    main()
