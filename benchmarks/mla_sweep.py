"""The MLA decode and verify kernel's tilings on one GPU (an H200, one call of a few
minutes): per (rows a sequence, context, batch), the absorbed kernel
(kernels/mla_attention.py) over a grid of tilings beside XLA's absorbed form, and the
table the engine reads at trace time (kernels/mla_paths.json: the fastest tiling per
shape, or "xla" where XLA's form beat every one).

    python benchmarks/mla_sweep.py [--heads 16] [--batches 1,4,16,...] [--contexts 1024,...]
        [--rows 1,2,4] [--verify-batches 1,32,128] [--verify-contexts 1024,4096]
        [--table kernels/mla_paths.json] [--budget-s 500] [--out DIR] [--tiny]

A case is `batch` sequences of `rows` query rows (1: decode, k + 1: MTP verify) over
`context` cached tokens each, Moonlight-16B-A3B's latent (512 + 64, bf16, page 16, its
16 heads by default: DeepSeek-V3's 128 heads over tensor parallelism of 8 are 16 a
device too), its pages shuffled over a pool larger than L2. The first stage times the
splits of the context (flash decoding) from 1 to 128 at default_config's tile; the
second the other tiles (8 warps, 32-token steps with 3 and 4 stages) at the best
splits. Each variant's output is checked against the default tiling's (a float32
accumulation of the same bf16 products: equal within bf16 rounding of the output,
relative error < 1e-2). Times are the kernels' device time (one profiler trace, every
variant of a case in it, benchmarks/gemm_sweep.device_times); XLA's form is timed where
its float32 gather of every row's context stays under 2 GB an input set (at the larger
shapes it took 7-11x the kernel's time: docs/benchmarks/README.md, 2026-12-04 MLA).
Writes mla_sweep.json (every variant) and mla_paths.json under --out, saved after every
case, so a run cut short keeps what it measured (with --table, that table's entries
with this run's over them); --tiny: a CPU smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_sweep import Sweep, device_times, merged_table  # noqa: E402
from moe import TINY, Shapes, mla_inputs, mla_program  # noqa: E402

SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
# first-stage grids of at least a quarter of the SMs and at most 8 programs each
GRID_RANGE = (0.25, 8)
# second-stage tiles (block_kv, num_warps, num_stages), at the best splits and, for
# 32-token steps with 3 stages, twice those splits (8 warps at 32 tokens never won at 4k and
# 16k contexts, 2026-12-04)
TILES = ((64, 8, 2), (32, 4, 3), (32, 4, 4))
XLA_MAX_BYTES = 2e9
MAX_REL_ERROR = 1e-2


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class MLASweep(Sweep):
    name = "mla_sweep"

    def __init__(self, args):
        super().__init__(args)
        self.shapes = TINY if args.tiny else dataclasses.replace(Shapes(), heads=args.heads)
        self.results["cases"] = []
        self.paths = {}
        if args.table:
            self.results["table_before"] = json.loads(Path(args.table).read_text()).get("_note", args.table)

    def save(self) -> None:
        super().save()
        note = (f"{self.results['command']} on {self.results['device']}, {self.results['date']}, jax "
                f"{self.results['jax']}: (heads, R, Dr, decode rows, context bucket) -> {{batch bucket: [block_q, "
                f"block_h, block_kv, num_splits, num_warps, num_stages] or \"xla\"}}")
        if "table_before" in self.results:
            note += f"; over the table of {self.results['table_before']}"
        table = merged_table(self.args.table, self.paths) | {"_note": note}
        (self.out / "mla_paths.json").write_text(json.dumps(table, indent=1))

    def time_variants(self, case, rows: int, configs: list, reference, with_xla: bool) -> dict:
        """label -> {config, us (device), wall_us, ok, error}; each variant compiled,
        checked against `reference` (the default tiling's output), then all timed in
        one trace."""
        import numpy as np

        rows_out, calls = {}, {}
        for config in configs:
            label = str(dataclasses.astuple(config))
            try:
                call = mla_program(case, rows, config=config, interpret=self.args.tiny)
                out = np.asarray(call()[0], np.float32)
                error = float(np.linalg.norm(out - reference) / max(np.linalg.norm(reference), 1e-30))
                rows_out[label] = {"config": dataclasses.asdict(config), "rel_error": error,
                                   "ok": error < MAX_REL_ERROR}
                calls[label] = call
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile is recorded
                rows_out[label] = {"config": dataclasses.asdict(config), "ok": False, "error": repr(e)[:160]}
        if with_xla:
            calls["xla"] = mla_program(case, rows, xla=True)
            rows_out["xla"] = {"config": None, "ok": True}
        reps = len(case["tables"])
        times = device_times(calls, 5, reps, self.args.tiny)
        if "trace_error" in times:
            self.results.setdefault("trace_errors", []).append(times.pop("trace_error"))
        for label, (us, kernels, wall_us) in times.items():
            rows_out[label] |= {"us": us if us is not None else wall_us, "kernels": kernels, "wall_us": wall_us}
        return rows_out

    def run_case(self, batch: int, rows: int, context: int) -> None:
        import numpy as np

        from jaxmtp.kernels.mla_attention import default_config
        from jaxmtp.kernels.triton_common import NUM_SMS, cdiv
        from jaxmtp.kernels.tiling_table import row_bucket

        s = self.shapes
        rng = np.random.default_rng(batch * 1_000_003 + rows * 7919 + context)
        reps = int(np.clip(5e8 // (batch * context * (s.rank + s.rope) * 2), 2, 6))
        case = mla_inputs(rng, s, [rows] * batch, [context] * batch, reps)
        base = default_config(batch * rows, batch, s.heads, rows, context)
        reference = np.asarray(mla_program(case, rows, config=base, interpret=self.args.tiny)()[0], np.float32)
        kv_steps = cdiv(context, base.block_kv)
        programs = batch * cdiv(s.heads, base.block_h)  # a split's
        first = [dataclasses.replace(base, num_splits=n) for n in SPLITS if n <= kv_steps
                 and GRID_RANGE[0] <= programs * n / NUM_SMS <= GRID_RANGE[1] or n == 1]
        first += [] if base in first else [base]
        xla = batch * rows * context * (s.rank + s.rope) * 4 <= XLA_MAX_BYTES
        variants = self.time_variants(case, rows, first, reference, xla)
        best = min((v for v in variants.values() if v["ok"] and v["config"]), key=lambda v: v["us"])
        splits = best["config"]["num_splits"]
        second = []
        for block_kv, warps, stages in TILES:
            for n in (splits, 2 * splits) if (block_kv, stages) == (32, 3) else (splits,):
                if n <= cdiv(context, block_kv):
                    second.append(dataclasses.replace(base, block_kv=block_kv, num_splits=n, num_warps=warps,
                                                      num_stages=stages))
        variants |= self.time_variants(case, rows, second, reference, False)
        kernel = [v for v in variants.values() if v["ok"] and v["config"]]
        best = min(kernel, key=lambda v: v["us"])
        entry = "xla" if xla and variants["xla"]["us"] < best["us"] else list(best["config"].values())
        key = ",".join(map(str, (s.heads, s.rank, s.rope, rows, row_bucket(context))))
        self.paths.setdefault(key, {})[str(row_bucket(batch))] = entry
        default_us = variants[str(dataclasses.astuple(base))]["us"]
        self.results["cases"].append({"batch": batch, "rows": rows, "context": context, "bytes": case["bytes"],
                                      "default": dataclasses.astuple(base), "best": entry,
                                      "best_us": best["us"], "default_us": default_us, "variants": variants})
        print(f"[{time.perf_counter() - self.t0:5.0f}s] b{batch} r{rows} c{context}: default {default_us:.1f} us, "
              f"best {best['us']:.1f} us {entry}, {case['bytes'] / best['us'] / 1e3:.0f} GB/s"
              + (f", xla {variants['xla']['us']:.1f} us" if xla else ""), flush=True)
        del case
        gc.collect()
        self.save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batches", default="1,32,128,4,16,64,256")
    parser.add_argument("--contexts", default="4096,16384,1024,65536")
    parser.add_argument("--rows", default="2,4", help="verify rows a sequence (k + 1), after the decode cases")
    parser.add_argument("--verify-batches", default="1,32,128")
    parser.add_argument("--verify-contexts", default="1024,4096")
    parser.add_argument("--table", help="a table measured before, whose entries this run's join or replace")
    parser.add_argument("--budget-s", type=float, default=500)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret mode, tiny shapes")
    args = parser.parse_args()
    if args.tiny:
        args.batches, args.contexts, args.verify_batches, args.verify_contexts = "2", "40", "2", "40"
    sweep = MLASweep(args)
    cases = [(b, 1, c) for c in parse_ints(args.contexts) for b in parse_ints(args.batches)]
    cases += [(b, r, c) for r in parse_ints(args.rows) for c in parse_ints(args.verify_contexts)
              for b in parse_ints(args.verify_batches)]
    for batch, rows, context in cases:
        if batch * context * sweep.shapes.rank >= 2**31:  # past the kernel's int32 offsets
            sweep.results.setdefault("past_int32", []).append(f"b{batch} r{rows} c{context}")
            continue
        if sweep.budget_left() < 30:
            sweep.results.setdefault("skipped_over_budget", []).append(f"b{batch} r{rows} c{context}")
            continue
        sweep.run_case(batch, rows, context)
    sweep.save()


if __name__ == "__main__":
    main()
