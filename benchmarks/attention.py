"""GPU benchmark (needs one NVIDIA GPU; written for an H200): ragged paged attention.

    python benchmarks/attention.py [--out DIR] [--sweep] [--budget-s 480]

One run, a few minutes:
  1. checks the compiled kernel against the jnp reference on the GPU (bf16 and f32,
     decode / verify / prefill / mixed, window, soft cap, GQA 1..8, pages 16 and 64);
  2. measures the floors in the same run: device copy bandwidth (jnp copy, and a
     torch copy where torch is installed) and the bf16 8192^3 matmul rate;
  3. times decode, verify (k+1 rows) and prefill chunks, each against JAX's stock
     Pallas kernels on the same inputs (jax.experimental.pallas.ops.gpu.paged_attention
     for decode, ...ops.gpu.attention.mha for prefill); a peer that fails is 'n/a';
  4. with --sweep, also times a few tilings of the kernel (for picking defaults).
Writes <date>_<device>.json and .md under --out (default docs/kernels_results) and
prints the table last. Times are medians of several runs after warm-up; each timed
program runs the kernel R times on different q and page tables (pages drawn from a
pool larger than the L2 cache), so host dispatch is amortised and the cache is cold.
"""

from __future__ import annotations

import os

# Allocate on demand: the largest case needs ~35 GB, and torch measures a copy too.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import datetime
import json
import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxmtp.kernels import (  # noqa: E402
    KernelConfig,
    default_config,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from timing import median_time  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
START = time.monotonic()


def elapsed() -> float:
    return time.monotonic() - START


# ---------------------------------------------------------------- floors


def measure_floors() -> dict:
    floors = {}
    x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)  # 2 GiB
    nbytes = 2 * x.nbytes  # read + write
    copy = jax.jit(lambda a: a.copy())
    floors["jnp_copy_tb_s"] = nbytes / median_time(copy, x, runs=10) / 1e12
    scale = jax.jit(lambda a: a * 2)
    floors["jnp_elementwise_tb_s"] = nbytes / median_time(scale, x, runs=10) / 1e12
    del x
    try:
        import torch

        t = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(t)
        for _ in range(3):
            out.copy_(t)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            out.copy_(t)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        floors["torch_copy_tb_s"] = 2 * t.numel() * 2 / float(np.median(times)) / 1e12
        del t, out
        torch.cuda.empty_cache()
    except Exception as e:  # torch is optional here
        floors["torch_copy_tb_s"] = None
        print(f"torch copy: n/a ({type(e).__name__}: {e})")
    # The floor for bandwidth: the fastest copy measured (read + write bytes).
    floors["copy_tb_s"] = max(v for k, v in floors.items() if k.endswith("copy_tb_s") and v)
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    floors["matmul_bf16_tflop_s"] = 2 * n**3 / median_time(matmul, a, b, runs=10) / 1e12
    return floors


# ---------------------------------------------------------------- inputs


@dataclasses.dataclass
class Batch:
    """R repetitions of one workload over one shared page pool."""

    q: jax.Array  # [R, T, Hq, D]
    k_pages: jax.Array  # [pool_pages, page_size, Hkv, D]
    v_pages: jax.Array
    kv_lens: jax.Array  # [B]
    page_tables: jax.Array  # [R, B, P]
    query_start: jax.Array  # [B + 1]
    kv_bytes: int  # K and V bytes one repetition must read
    flops: float  # causal attention FLOPs of one repetition


def make_batch(rng, rows_per_seq, kv_lens, page_size, dtype=jnp.bfloat16, reps=None,
               num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    kv_lens = np.asarray(kv_lens, np.int32)
    rows_per_seq = np.asarray(rows_per_seq, np.int32)
    num_seqs = len(kv_lens)
    pages_per_seq = int(math.ceil(kv_lens.max() / page_size))
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = int(kv_lens.sum()) * num_kv_heads * head_dim * 2 * itemsize
    if reps is None:  # enough work per timed program to hide dispatch
        reps = int(np.clip(math.ceil(0.5e9 / kv_bytes), 3, 16))
    # Page sets: enough that consecutive repetitions do not find their pages in L2.
    sets = int(min(reps, max(1, math.ceil(256e6 / kv_bytes))))
    pool_pages = num_seqs * pages_per_seq * sets
    key = jax.random.key(int(rng.integers(1 << 30)))
    kk, kv, kq = jax.random.split(key, 3)
    shape = (pool_pages, page_size, num_kv_heads, head_dim)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    query_start = np.concatenate([[0], np.cumsum(rows_per_seq)]).astype(np.int32)
    num_rows = int(query_start[-1])
    q = jax.random.normal(kq, (reps, num_rows, num_q_heads, head_dim), dtype)
    tables = []
    for r in range(reps):
        base = (r % sets) * num_seqs * pages_per_seq
        tables.append(base + rng.permutation(num_seqs * pages_per_seq).reshape(num_seqs, pages_per_seq))
    positions_seen = sum(
        int(n) * int(L) - int(n) * (int(n) - 1) // 2 for n, L in zip(rows_per_seq, kv_lens)
    )
    flops = 4.0 * head_dim * num_q_heads * positions_seen
    return Batch(q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(np.stack(tables), jnp.int32),
                 jnp.asarray(query_start), kv_bytes, flops)


def time_ours(batch: Batch, config: KernelConfig | None = None) -> float:
    def program(q, k, v, kv_lens, tables, query_start):
        return [
            ragged_paged_attention(q[r], k, v, kv_lens, tables[r], query_start, config=config)
            for r in range(q.shape[0])
        ]

    b = batch
    return median_time(jax.jit(program), b.q, b.k_pages, b.v_pages, b.kv_lens, b.page_tables,
                       b.query_start) / b.q.shape[0]


def time_stock_paged(batch: Batch) -> tuple[float | None, str]:
    """Best of a few tilings of JAX's stock paged attention (decode only)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as stock

    k_t = jnp.transpose(batch.k_pages, (2, 0, 1, 3))  # [Hkv, pages, page_size, D]
    v_t = jnp.transpose(batch.v_pages, (2, 0, 1, 3))
    pages_per_seq = batch.page_tables.shape[-1]
    best, notes = None, []
    for pages_per_block, k_splits in ((8, 16), (4, 16)):
        k_splits = min(k_splits, pages_per_seq)
        if pages_per_seq % k_splits:
            continue
        try:
            def program(q, k, v, tables, lens, ppb=pages_per_block, ks=k_splits):
                return [
                    stock.paged_attention(q[r], k, v, tables[r], lens,
                                          pages_per_compute_block=ppb, k_splits=ks)
                    for r in range(q.shape[0])
                ]

            t = median_time(jax.jit(program), batch.q, k_t, v_t, batch.page_tables,
                            batch.kv_lens) / batch.q.shape[0]
            if best is None or t < best:
                best = t
        except Exception as e:
            notes.append(f"{type(e).__name__}: {str(e)[:120]}")
    del k_t, v_t
    return best, "; ".join(sorted(set(notes)))


def time_stock_mha(chunk: int, context: int, rng) -> tuple[float | None, str]:
    """JAX's stock Pallas flash attention, contiguous K/V with heads repeated (no GQA).

    It has no causal offset: chunk == context runs causal (same FLOPs as ours);
    a chunk at the end of a longer context runs non-causal over the whole context.
    """
    from jax.experimental.pallas.ops.gpu import attention as stock

    causal = chunk == context
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, chunk, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(kk, (1, context, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(kv, (1, context, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    try:
        run = jax.jit(lambda q, k, v: stock.mha(q, k, v, None, sm_scale=HEAD_DIM**-0.5, causal=causal))
        return median_time(run, q, k, v), "causal" if causal else "non-causal"
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:120]}"


# ---------------------------------------------------------------- GPU check


def check_on_gpu(rng) -> list[dict]:
    """Compiled kernel vs reference, random lengths, NaN-poisoned unattended slots."""
    cases = [
        # name, rows per seq, kv lens, page size, heads (q, kv, d), dtype, options, config
        ("decode", [1] * 16, rng.integers(1, 3000, 16), 16, (32, 8, 128), jnp.bfloat16, {}, None),
        ("decode f32", [1] * 16, rng.integers(1, 3000, 16), 16, (32, 8, 128), jnp.float32, {}, None),
        ("verify k+1=3", [3] * 8, rng.integers(3, 2000, 8), 16, (32, 8, 128), jnp.bfloat16, {}, None),
        ("mixed", [1, 5, 200, 64, 0, 130, 2], [700, 100, 900, 64, 0, 2000, 33], 16, (32, 8, 128),
         jnp.bfloat16, {}, None),
        ("mixed f32", [1, 5, 200, 64, 0, 130, 2], [700, 100, 900, 64, 0, 2000, 33], 16, (32, 8, 128),
         jnp.float32, {}, None),
        ("mixed window+cap", [1, 5, 200, 64, 0, 130], [700, 100, 900, 64, 0, 2000], 16, (32, 8, 128),
         jnp.bfloat16, {"sliding_window": 300, "soft_cap": 30.0}, None),
        ("prefill 512 page 64 d64 mha", [512], [1500], 64, (8, 8, 64), jnp.bfloat16, {}, None),
        ("verify gqa8 page 64", [4] * 8, rng.integers(4, 3000, 8), 64, (32, 4, 128), jnp.bfloat16, {}, None),
        ("decode forced splits", [1] * 4, rng.integers(100, 5000, 4), 16, (32, 8, 128), jnp.bfloat16, {},
         KernelConfig(block_q=4, block_kv=32, num_splits=7, num_warps=4, num_stages=3)),
        ("prefill tile 64", [300, 77], [1200, 77], 16, (32, 8, 128), jnp.bfloat16, {},
         KernelConfig(block_q=16, block_kv=64, num_splits=1, num_warps=4, num_stages=2)),
    ]
    results = []
    for name, rows, lens, page_size, (hq, hkv, d), dtype, options, config in cases:
        try:
            b = make_batch(rng, rows, lens, page_size, dtype, reps=1, num_q_heads=hq,
                           num_kv_heads=hkv, head_dim=d)
            pad = 5  # rows owned by nobody
            q = jnp.concatenate([b.q[0], jnp.ones((pad, hq, d), dtype)])
            table = b.page_tables[0]
            lens_np = np.asarray(b.kv_lens)
            # Poison every slot no row may attend: past kv_len and unused pages.
            used = np.zeros((b.k_pages.shape[0], page_size), bool)
            tables_np = np.asarray(table)
            for s, L in enumerate(lens_np):
                for t in range(0, int(L), page_size):
                    used[tables_np[s, t // page_size], : min(page_size, int(L) - t)] = True
            mask = jnp.asarray(used)[:, :, None, None]
            k = jnp.where(mask, b.k_pages, jnp.nan)
            v = jnp.where(mask, b.v_pages, jnp.nan)
            args = (q, k, v, b.kv_lens, table, b.query_start)
            out = ragged_paged_attention(*args, config=config, **options)
            ref = ragged_paged_attention_reference(*args, **options)
            out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
            owned = int(np.asarray(b.query_start)[-1])
            error = np.linalg.norm(out[:owned] - ref[:owned]) / np.linalg.norm(ref[:owned])
            finite = bool(np.isfinite(out).all())
            padding_zero = bool((out[owned:] == 0).all())
            tolerance = 1e-4 if dtype == jnp.float32 else 1e-2
            ok = bool(finite and padding_zero and error < tolerance)
            results.append({"case": name, "dtype": jnp.dtype(dtype).name, "rel_error": float(error),
                            "finite": finite, "padding_zero": padding_zero, "ok": ok})
        except Exception as e:
            results.append({"case": name, "dtype": jnp.dtype(dtype).name, "ok": False,
                            "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print("check", results[-1])
    return results


# ---------------------------------------------------------------- benchmark


def run_decode(rng, floors, results, budget_s, kind, rows, batch, context, page_size):
    if elapsed() > budget_s:
        results.append({"kind": kind, "batch": batch, "context": context, "page": page_size,
                        "skipped": "time budget"})
        return
    try:
        b = make_batch(rng, [rows] * batch, [context] * batch, page_size)
        t = time_ours(b)
        row = {"kind": kind, "batch": batch, "context": context, "page": page_size, "rows": rows,
               "us": t * 1e6, "gb_s": b.kv_bytes / t / 1e9,
               "of_copy": b.kv_bytes / t / 1e12 / floors["copy_tb_s"],
               "config": dataclasses.asdict(default_config(rows * batch, batch, 4, NUM_KV_HEADS,
                                                           context, HEAD_DIM))}
        if rows == 1:
            stock_t, note = time_stock_paged(b)
            row["stock_us"] = stock_t * 1e6 if stock_t else None
            row["vs_stock"] = stock_t / t if stock_t else None
            row["stock_note"] = note
        del b
    except Exception as e:
        row = {"kind": kind, "batch": batch, "context": context, "page": page_size,
               "error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(row)
    results.append(row)


def run_prefill(rng, floors, results, budget_s, chunk, context):
    if elapsed() > budget_s:
        results.append({"kind": "prefill", "chunk": chunk, "context": context, "skipped": "time budget"})
        return
    try:
        b = make_batch(rng, [chunk], [context], 16, reps=3)
        t = time_ours(b)
        row = {"kind": "prefill", "chunk": chunk, "context": context, "page": 16, "us": t * 1e6,
               "tflop_s": b.flops / t / 1e12,
               "of_matmul": b.flops / t / 1e12 / floors["matmul_bf16_tflop_s"]}
        stock_t, note = time_stock_mha(chunk, context, rng)
        row["stock_us"] = stock_t * 1e6 if stock_t else None
        row["vs_stock"] = stock_t / t if stock_t else None
        row["stock_note"] = note
        del b
    except Exception as e:
        row = {"kind": "prefill", "chunk": chunk, "context": context,
               "error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(row)
    results.append(row)


def sweep(rng, floors) -> list[dict]:
    """A few tilings on one decode, one verify and one prefill workload."""
    out = []
    # (block_q, block_kv, num_stages, num_warps, num_splits or None for the default)
    workloads = [
        ("decode B32 ctx4096", [1] * 32, [4096] * 32, [(4, 128, 3, 4, 1), (4, 128, 3, 4, 2)]),
        ("prefill 2048 ctx16384", [2048], [16384], [(64, 64, 3, 8, None), (32, 128, 3, 8, None)]),
    ]
    for name, rows, lens, tilings in workloads:
        b = make_batch(rng, rows, lens, 16, reps=3 if len(rows) == 1 else None)
        base = default_config(sum(rows), len(rows), 4, NUM_KV_HEADS, max(lens), HEAD_DIM)
        for block_q, block_kv, stages, warps, splits in tilings:
            config = dataclasses.replace(base, block_q=block_q, block_kv=block_kv,
                                         num_stages=stages, num_warps=warps,
                                         num_splits=splits or base.num_splits)
            try:
                t = time_ours(b, config)
                row = {"workload": name, **dataclasses.asdict(config), "us": t * 1e6,
                       "gb_s": b.kv_bytes / t / 1e9, "tflop_s": b.flops / t / 1e12}
            except Exception as e:
                row = {"workload": name, **dataclasses.asdict(config),
                       "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print("sweep", row)
            out.append(row)
        del b
    return out


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def markdown(meta, floors, checks, results, sweep_rows) -> str:
    lines = [f"# Ragged paged attention on {meta['device']}", "",
             f"date {meta['date']}, jax {meta['jax']}, command `{meta['command']}`", "",
             "Floors measured in this run: "
             f"jnp copy {fmt(floors['jnp_copy_tb_s'], '.2f')} TB/s, "
             f"jnp elementwise {fmt(floors['jnp_elementwise_tb_s'], '.2f')} TB/s, "
             f"torch copy {fmt(floors.get('torch_copy_tb_s'), '.2f')} TB/s (read+write), "
             f"bf16 8192^3 matmul {fmt(floors['matmul_bf16_tflop_s'], '.0f')} TFLOP/s.", "",
             "GPU correctness (compiled kernel vs reference): " + ", ".join(
                 f"{c['case']} {c['dtype']} {'ok' if c['ok'] else 'FAIL'}"
                 + (f" ({c['rel_error']:.1e})" if "rel_error" in c else "") for c in checks), "",
             "Decode and verify: Hq=32, Hkv=8, D=128, bf16; GB/s over K+V bytes read; "
             "'of copy' = that over the copy floor (fastest copy above); 'stock' = best of 2 tilings of "
             "jax.experimental.pallas.ops.gpu.paged_attention (x = its time / ours).", "",
             "| kind | batch | context | page | us | GB/s | of copy | stock us | x stock |",
             "|---|---|---|---|---|---|---|---|---|"]
    decode_us = {(r["batch"], r["context"], r["page"]): r["us"] for r in results
                 if r.get("kind") == "decode" and "us" in r}
    for r in results:
        if r["kind"] == "prefill":
            continue
        if "us" not in r:
            lines.append(f"| {r['kind']} | {r['batch']} | {r['context']} | {r['page']} | "
                         f"{r.get('skipped') or r.get('error', '')[:60]} | | | | |")
            continue
        kind = r["kind"]
        base = decode_us.get((r["batch"], r["context"], r["page"]))
        if kind != "decode" and base:
            kind += f" ({r['us'] / base:.2f}x decode)"
        lines.append(f"| {kind} | {r['batch']} | {r['context']} | {r['page']} | {r['us']:.1f} | "
                     f"{r['gb_s']:.0f} | {r['of_copy']:.0%} | {fmt(r.get('stock_us'), '.1f')} | "
                     f"{fmt(r.get('vs_stock'), '.2f')} |")
    lines += ["", "Prefill chunk (B=1, Hq=32, Hkv=8, D=128, bf16, page 16), causal FLOPs; 'stock' = "
              "jax.experimental.pallas.ops.gpu.attention.mha on contiguous K/V with heads repeated "
              "(causal when chunk == context, else non-causal over the whole context: it has no "
              "causal offset).", "",
              "| chunk | context | us | TFLOP/s | of matmul | stock us | x stock | stock mode |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] != "prefill":
            continue
        if "us" not in r:
            lines.append(f"| {r['chunk']} | {r['context']} | "
                         f"{r.get('skipped') or r.get('error', '')[:60]} | | | | | |")
            continue
        lines.append(f"| {r['chunk']} | {r['context']} | {r['us']:.1f} | {r['tflop_s']:.0f} | "
                     f"{r['of_matmul']:.0%} | {fmt(r.get('stock_us'), '.1f')} | "
                     f"{fmt(r.get('vs_stock'), '.2f')} | {r.get('stock_note', '')} |")
    if sweep_rows:
        lines += ["", "Tiling sweep:", "", "| workload | block_q | block_kv | splits | warps | stages | us | "
                  "GB/s | TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sweep_rows:
            lines.append(f"| {r['workload']} | {r['block_q']} | {r['block_kv']} | {r['num_splits']} | "
                         f"{r['num_warps']} | {r['num_stages']} | {fmt(r.get('us'), '.1f')} | "
                         f"{fmt(r.get('gb_s'), '.0f')} | {fmt(r.get('tflop_s'), '.0f')} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "kernels_results"))
    parser.add_argument("--sweep", action="store_true", help="also time a few tilings")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="skip the remaining cases after this many seconds")
    args = parser.parse_args()
    rng = np.random.default_rng()
    device = jax.devices()[0]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device.device_kind, "jax": jax.__version__,
            "command": "python " + " ".join(sys.argv)}
    try:
        meta["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        meta["nvidia_smi"] = None
    print(meta)

    checks = check_on_gpu(rng)
    floors = measure_floors()
    print("floors", floors)
    sweep_rows = sweep(rng, floors) if args.sweep else []

    results = []
    # The cases the targets speak of first, so that a tight --budget-s keeps them.
    targets = [(16, b, c) for b in (8, 32, 128) for c in (4096, 32768)]
    for page_size, batch, context in targets:
        run_decode(rng, floors, results, args.budget_s, "decode", 1, batch, context, page_size)
    for batch, context in ((8, 4096), (8, 32768), (32, 4096), (32, 32768)):
        run_decode(rng, floors, results, args.budget_s, "verify k+1=2", 2, batch, context, 16)
    for chunk, context in ((4096, 4096), (2048, 2048), (512, 2048), (2048, 16384), (512, 16384)):
        run_prefill(rng, floors, results, args.budget_s, chunk, context)
    extras = [(16, 1, c) for c in (512, 4096, 32768)] + [(16, b, 512) for b in (8, 32, 128)]
    extras += [(64, b, c) for b in (8, 32) for c in (4096, 32768)]
    for page_size, batch, context in extras:
        run_decode(rng, floors, results, args.budget_s, "decode", 1, batch, context, page_size)
    for batch, context in ((8, 4096), (8, 32768), (32, 4096), (32, 32768)):
        run_decode(rng, floors, results, args.budget_s, "verify k+1=4", 4, batch, context, 16)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['date'][:10]}_{device.device_kind.replace(' ', '_')}"
    report = markdown(meta, floors, checks, results, sweep_rows)
    (out_dir / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "floors": floors, "checks": checks, "results": results, "sweep": sweep_rows},
        indent=1))
    (out_dir / f"{stem}.md").write_text(report)
    print(f"\nelapsed {elapsed():.0f} s; wrote {out_dir / stem}.json/.md\n")
    print(report)


if __name__ == "__main__":
    main()
