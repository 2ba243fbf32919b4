"""Gated DeltaNet's recurrence on one GPU (an H200, one call of a few minutes): XLA's jnp
forms (jaxmtp/models/gated_delta.py) against the Pallas kernels (kernels/gated_delta.py)
over a grid of tilings, at the linear-attention shape of Qwen3-Next / Qwen3.5, per batch
shape. Writes the tilings that win into the table the engine reads at trace time.

    python benchmarks/gated_delta.py [--models qwen3_next] [--batches 1,8,32,128]
        [--rows 1,2,4] [--prefill 512,2048,8192] [--prefill-seqs 1,32] [--budget-s 480]
        [--tp 1,2,4] [--kernels] [--out DIR] [--tiny]

Two forms, one layer's call each:
- rows: the recurrent form of decode (1 row a request) and MTP verification (k + 1
  rows, keeping k + 1 states), B requests, each continuing from its own slot of a state
  table large enough that the L2 cache holds none of the states a call reads. Floor: the
  states read (B) and the tail states written (B x rows), float32, over the copy
  bandwidth measured in the same process.
- chunks: a prefill step of T rows, all one request's, in a batch of S request slots
  (the others empty, as the engine's steps are shaped); the whole chunked form is timed
  (its first phase is XLA's in both), the table keyed by its chunk count. Floor: the
  bytes the scan over chunks reads and writes (the chunk terms, its outputs, the states).
Every variant is checked against XLA's float32 form on the same inputs (largest error
over the largest value; the forms agree to float32 rounding, so 1e-4 flags a wrong
result). Writes gated_delta.json (every variant) and gated_delta_paths.json (in
kernels/gated_delta_paths.json's form: the fastest tiling where it beat XLA's form by 5%,
else "xla"); copy the latter into kernels/ to use it. --tiny: a CPU smoke test
(interpret mode, tiny heads).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_sweep import L2_BYTES, checked_kernel, copy_bandwidth, device_times, fastest_over  # noqa: E402

# (Hk, Hv, dk, dv) of the linear-attention layers, from each checkpoint's config.json
MODELS = {
    "qwen3_next": (16, 32, 128, 128),  # Qwen/Qwen3-Next-80B-A3B-Instruct; Qwen3.5-35B-A3B's are the same
}
TINY_MODELS = {"tiny": (2, 4, 16, 16)}
WIN = 1.05  # a tiling enters the table where it is this much faster than XLA's form
F32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Case:
    form: str  # "rows" or "chunks"
    requests: int  # request slots in the batch (B)
    rows: int  # rows per request (rows form) or the one request's rows (chunks form)

    @property
    def label(self) -> str:
        return f"{self.form} B={self.requests} rows={self.rows}"


def tilings(form: str, dv: int, tiny: bool) -> list:
    from jaxmtp.kernels.gated_delta import DeltaKernelConfig

    if tiny:
        return [DeltaKernelConfig(8, 4, 1)]
    if form == "rows":  # no matrix products: narrow column blocks, few warps
        grid = itertools.product((8, 16, 32, 64), (1, 2, 4, 8), (1,))
    else:
        grid = itertools.product((16, 32, 64), (4, 8), (1, 2))
    return [DeltaKernelConfig(*t) for t in grid if t[0] <= dv]


def bucket_choice(cases: list[list[dict]]):
    """The table entry of cases that share a bucket (each case's variants, XLA's first):
    the tiling fastest over all of them together, where it beats XLA's form over all of
    them by WIN, else "xla"."""
    best, best_us, xla = fastest_over(cases)
    return list(best) if best is not None and best_us * WIN < xla else "xla"


def fastest_kernel(rows: list[dict]) -> dict | None:
    return min((r for r in rows if checked_kernel(r)), key=lambda r: r["us"], default=None)


class Bench:
    def __init__(self, args):
        import jax
        import jax.numpy as jnp

        self.args, self.jax, self.jnp, self.tiny = args, jax, jnp, args.tiny
        self.t0 = time.perf_counter()
        self.out = Path(os.environ.get("OUT", args.out))
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/gated_delta.py "
                        + " ".join(sys.argv[1:]), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                        "copy_bytes_per_s": copy_bandwidth(types.SimpleNamespace(jax=jax, jnp=jnp, tiny=args.tiny)),
                        "cases": {}}
        self.table = {}
        self.bucket_cases = {}  # (table key, bucket) -> every case's variants entered there

    def budget_left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        (self.out / "gated_delta.json").write_text(json.dumps(self.results, indent=1))
        table = {"_note": f"benchmarks/gated_delta.py on {self.results['device']}, {self.results['date']}, "
                          f"jax {self.results['jax']}"} | self.table
        (self.out / "gated_delta_paths.json").write_text(json.dumps(table, indent=1))

    # ----- inputs ---------------------------------------------------------------------

    def inputs(self, shape, case: Case):
        """Random rule inputs for the case (q and k already normalised and spread over the
        value heads for the rows form, raw for the chunked one), the state table and a
        few slot assignments that together cover more states than the L2 cache holds."""
        jax, jnp = self.jax, self.jnp
        hk, hv, dk, dv = shape
        state_bytes = hv * dk * dv * F32_BYTES
        slots_needed = max(case.requests, -(-2 * L2_BYTES // state_bytes))
        copies = -(-slots_needed // case.requests)
        keys = iter(jax.random.split(jax.random.key(case.requests * 1000 + case.rows), 8))
        num_rows = case.requests * case.rows if case.form == "rows" else case.rows
        heads = hv if case.form == "rows" else hk
        q, k = (jax.random.normal(next(keys), (num_rows, heads, dk), jnp.float32) for _ in range(2))
        if case.form == "rows":
            q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
        v = jax.random.normal(next(keys), (num_rows, hv, dv), jnp.float32)
        g = -jax.random.uniform(next(keys), (num_rows, hv), jnp.float32, 0.01, 0.5)
        beta = jax.random.uniform(next(keys), (num_rows, hv), jnp.float32, 0.1, 0.9)
        table = 0.1 * jax.random.normal(next(keys), (copies * case.requests, hv, dk, dv), jnp.float32)
        if case.form == "rows":
            query_start = jnp.arange(case.requests + 1, dtype=jnp.int32) * case.rows
        else:  # one request with every row, the other slots empty
            query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.full(case.requests, case.rows, jnp.int32)])
        slot_sets = [jnp.arange(case.requests, dtype=jnp.int32) + c * case.requests for c in range(copies)]
        fresh = jnp.zeros(case.requests, bool)
        return (q, k, v, g, beta), table, query_start, slot_sets, fresh

    def floor_us(self, shape, case: Case, chunk: int) -> float:
        hk, hv, dk, dv = shape
        state = hv * dk * dv * F32_BYTES
        if case.form == "rows":
            moved = case.requests * state * (1 + case.rows)
        else:  # u, w, q, k_to_end, the outputs ([rows, Hv, d] each), attn [rows, Hv, C], two states
            chunks = -(-case.rows // chunk)
            moved = chunks * chunk * hv * (dv + 3 * dk + dv + chunk) * F32_BYTES + 2 * state
        return moved / self.results["copy_bytes_per_s"] * 1e6

    # ----- one case -------------------------------------------------------------------

    def programs(self, case: Case, chunk: int, configs: list):
        """name -> jitted program of (inputs, table, query_start, slots, fresh): XLA's
        form ("xla") and the kernel at each tiling."""
        import functools

        from jaxmtp.kernels import gated_delta as kernels
        from jaxmtp.models import gated_delta as gd

        interpret = self.tiny
        if case.form == "rows":
            def make(config):
                form = gd.scan_rows if config is None else functools.partial(
                    kernels.scan_rows_kernel, interpret=interpret, config=config)
                return lambda x, table, qs, slots, fresh: form(*x, table, qs, slots, fresh, case.rows)
        else:
            def make(config):
                form = gd.scan_chunks if config is None else functools.partial(
                    kernels.scan_chunks_kernel, interpret=interpret, config=config)
                return lambda x, table, qs, slots, fresh: gd.gated_delta_chunked(*x, table, qs, slots, fresh, chunk,
                                                                                 form)
        return {"xla" if c is None else c: self.jax.jit(make(c)) for c in [None, *configs]}

    def run(self, model: str, shape, case: Case, chunk: int) -> None:
        jax, jnp = self.jax, self.jnp
        x, table, query_start, slot_sets, fresh = self.inputs(shape, case)
        floor = self.floor_us(shape, case, chunk)
        rows, calls = [], {}
        reference = scale = None  # XLA's outputs, the first program's
        for name, program in self.programs(case, chunk, tilings(case.form, shape[3], self.tiny)).items():
            row = {"config": None if name == "xla" else dataclasses.asdict(name)}
            try:
                out = jax.block_until_ready(program(x, table, query_start, slot_sets[0], fresh))
                if reference is None:
                    reference, scale = out, max(float(jnp.abs(r).max()) for r in out)
                row["rel_err"] = max(float(jnp.abs(o - r).max()) for o, r in zip(out, reference)) / scale
                row["ok"] = bool(row["rel_err"] < 1e-4)
                turn = itertools.cycle(slot_sets)
                calls[len(rows)] = lambda program=program, turn=turn: program(x, table, query_start, next(turn), fresh)
            except Exception as e:  # a tiling Triton cannot fit (shared memory, registers)
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
        times = device_times(calls, 3 if self.tiny else 10, 1, self.tiny)
        for index, (us, kernels, wall_us) in ((i, t) for i, t in times.items() if i != "trace_error"):
            rows[index].update(us=us, kernels_per_call=kernels, wall_us=wall_us,
                               floor_fraction=None if us is None else floor / us)
        if self.args.kernels and not self.tiny:  # where the time goes: XLA's form and the fastest kernel's
            from profile_step import profile_kernels

            best = fastest_kernel(rows)
            for index in {0, rows.index(best) if best else 0}:
                if index in calls:
                    rows[index]["kernels"] = profile_kernels(calls[index], 3)[:12]
                    print(f"  {'xla' if index == 0 else 'kernel'}: " + "; ".join(
                        f"{k['name'][:60]} {k['us_per_step']:.1f} us x{k['calls_per_step']:.0f}"
                        for k in rows[index]["kernels"][:8]), flush=True)
        self.results["cases"].setdefault(model, {})[case.label] = {"floor_us": floor, "variants": rows}
        self.enter(shape, case, chunk, rows)
        self.save()
        self.print_case(model, case, rows, floor)

    def enter(self, shape, case: Case, chunk: int, rows: list[dict]) -> None:
        """The case's table entry, under the bucket the engine looks up (requests for the
        rows form; the chunk count, as gated_delta.chunk_count sizes it, for chunks).
        Cases that share a bucket (decode and verify rows of the same batch) share one
        entry: the tiling fastest over all of them together, where it beats XLA's form
        over all of them."""
        from jaxmtp.kernels.gated_delta import FORMS
        from jaxmtp.kernels.tiling_table import row_bucket
        from jaxmtp.models.gated_delta import chunk_count

        size = case.requests if case.form == "rows" else chunk_count(case.rows, case.requests, chunk)
        key = ",".join(str(v) for v in (FORMS.index(case.form), *shape[1:]))
        bucket = str(row_bucket(size))
        shared = self.bucket_cases.setdefault((key, bucket), [])
        shared.append(rows)
        self.table.setdefault(key, {})[bucket] = bucket_choice(shared)

    def print_case(self, model: str, case: Case, rows: list[dict], floor: float) -> None:
        def fmt(r):
            return "-" if not r or r.get("us") is None else f"{r['us']:8.1f} us ({floor / r['us']:.2f} of floor)"

        best = fastest_kernel(rows)
        timed = sum(1 for r in rows if checked_kernel(r))
        failed = sum(1 for r in rows if "error" in r or not r.get("ok", True))
        tiling = "" if best is None else " ".join(f"{k}={v}" for k, v in best["config"].items())
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {model} {case.label:24} xla {fmt(rows[0])}  "
              f"kernel {fmt(best)}  {tiling}  ({timed} timed, {failed} failed)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3_next")
    parser.add_argument("--batches", default="1,8,32,128", help="requests of the rows form")
    parser.add_argument("--rows", default="1,2,4", help="rows per request of the rows form (decode, k = 1, k = 3)")
    parser.add_argument("--prefill", default="512,2048,8192", help="prefill rows of the chunks form")
    parser.add_argument("--prefill-seqs", default="1,32", help="request slots of the chunks form's batch")
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tp", default="1", help="tensor-parallel sizes: one device's share of the heads each")
    parser.add_argument("--kernels", action="store_true",
                        help="per case, the GPU kernels of XLA's form and of the fastest tiling (a profiler trace)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret mode, tiny heads")
    args = parser.parse_args()
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    models = TINY_MODELS if args.tiny else {m: MODELS[m] for m in args.models.split(",")}
    # under tensor parallelism each device runs the kernels on its share of the heads
    # (jaxmtp.models.delta_rule.shard_over_value_heads) and the engine looks the table up with it
    models = {(m if tp == 1 else f"{m} tp{tp}"): (hk // tp, hv // tp, dk, dv)
              for m, (hk, hv, dk, dv) in models.items() for tp in ints(args.tp) if hk % tp == 0}
    chunk = 16 if args.tiny else 64  # jaxmtp.models.gated_delta.CHUNK; the tiny run's rows are few
    cases = [Case("rows", b, r) for r in ints(args.rows) for b in ints(args.batches)]
    cases += [Case("chunks", s, t) for t in ints(args.prefill) for s in ints(args.prefill_seqs)]
    bench = Bench(args)
    for model, shape in models.items():
        for case in cases:
            if bench.budget_left() < 30:
                print(f"budget spent: {case.label} and after not run", flush=True)
                break
            bench.run(model, shape, case, chunk)
    bench.save()


if __name__ == "__main__":
    main()
