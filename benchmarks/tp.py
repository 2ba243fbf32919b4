"""Tensor parallelism on two GPUs (nvidia-h200-x2; one call of at most about 6 minutes).

    python benchmarks/tp.py [--out DIR] [--budget-s 320]
    python benchmarks/tp.py --tiny     # CPU, 2 forced devices, a tiny model: checks that it runs

The Llama-3-8B-shaped bfloat16 model of benchmarks/e2e.py (random weights made on the
devices, load_format="dummy") at TP=1 and TP=2, each size in its own process so that each
starts with clean GPU memory:

- batch-1 decode (prompt 512, 128 new tokens): ms/token over steady decode steps (the
  engine step, and the jitted step alone, replayed, without host work);
- batch-32 decode (32 prompts of 512, prefilled in one step, 64 new tokens): tokens/s
  over full-batch decode steps;
- the collectives' share of a decode step. Method: the collectives of the compiled step
  are read from its HLO (op, shape, count), each distinct one is timed alone on the same
  mesh as a chain of 64 dependent copies inside one jitted call (less the same chain
  without the collective), and count x time is divided by the step time. This is what the
  collectives cost when nothing overlaps them, as in a TP decode step, where each one
  sits on the critical path;
- correctness: stories260K (float32) greedy equals its 200 golden ids at each size; a small
  float32 model through the Pallas kernel with MTP (k=2) and chunked prefill gives the same
  tokens at TP=2 as at TP=1; for the bf16 8B model, the number of greedy tokens TP=2 shares
  with TP=1 before a near-tie parts them (all-reduce order changes bf16 rounding);
- if the budget still holds it, batch-1 decode at TP=2 with the embedding and LM head
  replicated instead of split over the vocabulary (a third process, as the sharding
  rules are read when the step is traced): what splitting the vocabulary is worth.

Scenarios skip when the --budget-s left cannot hold them. Writes <date>_<gpu>_tp.json and
.md under --out (default: $OUT if set, else docs/benchmarks/) and prints the table last.
NCCL's NVLink multicast stays off (the device README: it can take the host's GPUs down).
"""

from __future__ import annotations

import os

# before anything can load NCCL (also inherited by the worker processes)
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import e2e  # noqa: E402  (its 8B config and decode timing helpers; it puts ROOT on sys.path)
from timing import median_time  # noqa: E402

TP_SIZES = (1, 2)
VOCAB_REPLICATED = "2-vocab-replicated"  # the runs' key of TP=2 with embedding and LM head whole
# What each size runs; --tiny shrinks the models and the lengths, not the code path.
# small_f32: the exactness check's model (the Pallas kernel on the GPU: head_dim 64).
FULL = dict(config=e2e.LLAMA3_8B, prompt_len=512, b1_new_tokens=128, batch=32, batch_new_tokens=64, num_pages=2400,
            small_f32={**e2e.LLAMA3_8B, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
                       "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096,
                       "torch_dtype": "float32"})
TINY = dict(config=e2e.TINY, prompt_len=32, b1_new_tokens=16, batch=32, batch_new_tokens=8, num_pages=256,
            small_f32={**e2e.TINY, "torch_dtype": "float32"})
COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")
ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


# ----- one tensor-parallel size, in its own process ---------------------------------------


def worker(tp: int, budget_s: float, tiny: bool, vocab_replicated: bool) -> None:
    """One size's scenarios. vocab_replicated: batch-1 decode only, with the embedding and
    LM head whole on every device (the rules' other choice for the vocabulary), set
    before anything is traced: jit reuses a step's trace, and the rules are read then."""
    import jax

    from jaxmtp import LLM
    from jaxmtp.worker import sharding

    t0 = time.perf_counter()
    scale = TINY if tiny else FULL
    result = {"tp": tp, "device": jax.devices()[0].device_kind, "devices_present": len(jax.devices()),
              "jax": jax.__version__, "vocab_replicated": vocab_replicated, "skipped": []}
    if vocab_replicated:
        sharding.LOGICAL_RULES["vocab"] = None

    def emit(note):  # every result so far, as soon as it exists: a later crash keeps them
        name = f"tp={tp}" + (" vocab replicated" if vocab_replicated else "")
        print(f"[{name} {time.perf_counter() - t0:5.0f}s] {note}", file=sys.stderr, flush=True)
        print("TP_JSON " + json.dumps(result), flush=True)

    def left():
        return budget_s - (time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(scale["config"]))
        max_model_len = min(1024, scale["config"]["max_position_embeddings"])
        engine = functools.partial(LLM, folder, load_format="dummy", tensor_parallel_size=tp, max_model_len=max_model_len,
                                   num_pages=scale["num_pages"])
        batch_1(result, engine, scale, emit)
        gc.collect()  # one engine's weights and cache on the devices at a time
        if not vocab_replicated:
            if left() > 30:
                correctness(result, tp, scale["small_f32"])
                emit("correctness")
            else:
                result["skipped"].append("correctness")
            if left() > 45:
                batch_32(result, engine, scale, emit)
            else:
                result["skipped"].append("b32")
    emit("done")


def batch_1(result, engine, scale, emit) -> None:
    import jax
    import numpy as np

    t = time.perf_counter()
    llm = engine(max_num_seqs=1, max_num_batched_tokens=scale["prompt_len"])
    result["b1_load_dummy_s"] = time.perf_counter() - t
    params = llm.engine.params
    result["weight_bytes"] = e2e.weight_bytes(params)
    # what one device reads per decode step (the embedding table is only gathered from)
    result["b1_weight_bytes_per_device"] = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(params)) - \
        params.embed.addressable_shards[0].data.nbytes
    vocab = scale["config"]["vocab_size"]
    prompt = [np.random.default_rng(0).integers(3, vocab - 1, size=scale["prompt_len"]).tolist()]
    t = time.perf_counter()
    e2e.run_decode(llm, prompt, 8)
    result["b1_first_run_compile_s"] = time.perf_counter() - t
    step_s, _, tokens, _ = e2e.run_decode(llm, prompt, scale["b1_new_tokens"])
    result["b1_ms_per_token"] = step_s * 1e3
    result["b1_device_ms_per_token"] = e2e.device_step_time(llm.engine) * 1e3
    result["b1_tokens"] = tokens[0]
    emit(f"b1 {step_s * 1e3:.2f} ms/token, step alone {result['b1_device_ms_per_token']:.2f}")
    if llm.engine.runner.mesh.size > 1:
        result["b1_collectives"] = collectives(llm.engine, num_seqs=1)
        emit(f"b1 collectives {summary(result['b1_collectives'])}")


def batch_32(result, engine, scale, emit) -> None:
    import numpy as np

    # every prompt prefilled in one step: two step shapes to compile (that step and the
    # full-batch decode), where a smaller step budget would compile one per batch bucket
    # as decoding requests join the prefill steps
    tokens = scale["batch"] * scale["prompt_len"]
    llm = engine(max_num_seqs=scale["batch"], max_num_batched_tokens=tokens, prefill_chunk_size=tokens)
    rng = np.random.default_rng(1)
    vocab = scale["config"]["vocab_size"]
    prompts = [rng.integers(3, vocab - 1, size=scale["prompt_len"]).tolist() for _ in range(scale["batch"])]
    step_s, tps, _, _ = e2e.run_decode(llm, prompts, scale["batch_new_tokens"])
    result["b32_tokens_per_s"] = tps
    result["b32_step_ms"] = step_s * 1e3
    emit(f"b32 {tps:.0f} tokens/s")
    if llm.engine.runner.mesh.size > 1:
        result["b32_collectives"] = collectives(llm.engine, num_seqs=scale["batch"])
        emit(f"b32 collectives {summary(result['b32_collectives'])}")


def collectives(engine, num_seqs: int) -> list[dict]:
    """The collectives in the compiled decode step of num_seqs requests (the shape the
    timed window ran, so compiling it again is a cache hit), each with its count and its
    time measured alone."""
    shape = engine.runner.buckets.shape_for(num_seqs, num_seqs)  # one row per request
    hlo = engine.runner.lower_step(shape).compile().as_text()
    found = {}
    for line in hlo.splitlines():
        match = COLLECTIVE.search(line)
        if not match:
            continue
        arrays = ARRAY.findall(match.group(1))
        if match.group(2) == "all-gather":
            arrays = arrays[-1:]  # an async start's tuple ends with the gathered result
        dims = re.search(r"dimensions=\{(\d+)\}", line)
        key = (match.group(2), tuple((dtype, dims_) for dtype, dims_ in arrays), int(dims.group(1)) if dims else 0)
        found[key] = found.get(key, 0) + 1
    out = []
    for (op, arrays, dim), count in sorted(found.items()):
        entry = {"op": op, "arrays": [f"{d}[{s}]" for d, s in arrays], "count": count}
        if op in ("all-reduce", "all-gather") and len(arrays) == 1:
            dtype, dims_ = arrays[0]
            shape = tuple(int(x) for x in dims_.split(",") if x)
            entry["us_each"] = time_collective(engine.runner.mesh, op, shape, dtype, dim) * 1e6
        out.append(entry)
    return out


def time_collective(mesh, op: str, shape: tuple, dtype: str, dim: int, chain: int = 64) -> float:
    """Seconds one collective takes on its own: a chain of `chain` dependent copies in one
    jitted call, less the same chain without it. Each link adds the device's index so
    that XLA cannot prove the value replicated and fold the chain away, behind an
    optimization barrier so that the chain without collectives is not fused into one
    kernel (then each difference would also count a kernel launch)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.shape["tp"]
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32, "s32": jnp.int32}.get(dtype, jnp.float32)
    local = list(shape)
    if op == "all-gather":
        local[dim] //= n

    def link(x, with_collective):
        me = jax.lax.axis_index("tp")
        if with_collective and op == "all-reduce":
            x = jax.lax.psum(x, "tp")
        elif with_collective:
            x = jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(x, "tp", axis=dim, tiled=True), me * local[dim], local[dim], dim)
        return jax.lax.optimization_barrier(x + me.astype(x.dtype))

    def chained(with_collective):
        def body(x):
            for _ in range(chain):
                x = link(x, with_collective)
            return x

        spec = PartitionSpec("tp")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

    values = jax.random.normal(jax.random.key(0), (n * local[0], *local[1:])).astype(dtype)
    x = jax.device_put(values, NamedSharding(mesh, PartitionSpec("tp")))
    times = {with_collective: median_time(chained(with_collective), x, warmup=1, runs=10) for with_collective in (True, False)}
    return max(0.0, times[True] - times[False]) / chain


def summary(collectives: list[dict]) -> str:
    return ", ".join(f"{c['count']}x {c['op']} {c['arrays']} {c.get('us_each', float('nan')):.1f} us" for c in collectives)


def correctness(result, tp, small_config) -> None:
    import numpy as np

    from jaxmtp import LLM, SamplingParams
    from jaxmtp.models.attention import resolve_backend

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import STORIES, golden_ids

    stories = LLM(STORIES, tensor_parallel_size=tp, max_num_seqs=1, max_num_batched_tokens=64)
    got = stories.generate([[1]], SamplingParams(max_tokens=200, temperature=0.0), use_tqdm=False)[0].outputs[0].token_ids
    result["stories_golden"] = got == golden_ids()
    with tempfile.TemporaryDirectory() as small:
        Path(small, "config.json").write_text(json.dumps(small_config))
        llm = LLM(small, load_format="dummy", tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=256,
                  prefill_chunk_size=100, num_speculative_tokens=2)
        result["small_f32_attention"] = resolve_backend("auto", small_config["head_dim"])
        vocab = small_config["vocab_size"]
        prompts = [np.random.default_rng(i).integers(3, vocab, size=n).tolist() for i, n in enumerate((37, 300, 5))]
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
        result["small_f32_tokens"] = [o.outputs[0].token_ids for o in outs]


# ----- the parent: both sizes, then the table -----------------------------------------------


def run_worker(tp: int, budget_s: float, tiny: bool, vocab_replicated: bool = False) -> dict:
    env = dict(os.environ)
    if tiny:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, __file__, "--worker", str(tp), "--budget-s", str(budget_s)]
    command += ["--tiny"] * tiny + ["--vocab-replicated"] * vocab_replicated
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, timeout=budget_s + 30)
        stdout, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as err:  # its output so far is bytes, whatever text= says
        stdout, code = (err.stdout or b"").decode(), "timeout"
    lines = [line for line in stdout.splitlines() if line.startswith("TP_JSON ")]
    result = json.loads(lines[-1][8:]) if lines else {"tp": tp}
    if code != 0:
        result["error"] = f"worker exit {code} (its stderr is above)"
    return result


def compare(runs: dict) -> dict:
    one, two = runs.get("1", {}), runs.get("2", {})
    checks = {"stories_golden": {tp: r["stories_golden"] for tp, r in runs.items() if "stories_golden" in r}}
    if "small_f32_tokens" in one and "small_f32_tokens" in two:
        checks["small_f32_tp2_equals_tp1"] = one["small_f32_tokens"] == two["small_f32_tokens"]
        checks["small_f32_attention"] = two.get("small_f32_attention")
    if "b1_tokens" in one and "b1_tokens" in two:
        a, b = one["b1_tokens"], two["b1_tokens"]
        checks["bf16_b1_tokens_shared_before_first_difference"] = next(
            (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        checks["bf16_b1_tokens_of"] = len(a)
    return checks


def collective_share(collectives, step_ms):
    if not collectives or not step_ms:
        return None
    total_us = sum(c["count"] * c.get("us_each", 0.0) for c in collectives)
    return total_us / 1e3 / step_ms


def markdown(results) -> str:
    runs, scale = results["runs"], results["scale"]
    one, two, whole_vocab = runs.get("1", {}), runs.get("2", {}), runs.get(VOCAB_REPLICATED, {})
    bandwidth = results.get("torch_copy_bytes_per_s")
    device = two.get("device") or one.get("device")
    head = (f"# Tensor parallelism: TP=1 vs TP=2\n\n{results['date']}, {two.get('devices_present', '?')} x {device}, "
            f"jax {two.get('jax') or one.get('jax')}; command: `{results['command']}`"
            + (f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s (torch d2d, same run)" if bandwidth else "")
            + ("; **--tiny: CPU smoke run, not a measurement**" if results["tiny"] else "") + "\n\n"
            "Model: Llama-3-8B shape, bfloat16, random weights made on the devices. Speed-up = TP=1 time / TP=2 time.\n\n")

    def value(run, key, fmt="{:.2f}"):
        return fmt.format(run[key]) if key in run else "-"

    def ratio_between(slower, faster, key):
        return f"{slower[key] / faster[key]:.2f}x" if key in slower and key in faster else "-"

    def ratio(key, inverse=False):
        if key not in one or key not in two:
            return "-"
        return f"{(one[key] / two[key]) if not inverse else (two[key] / one[key]):.2f}x"

    def floor(run, key):
        # batch-1 decode reads every weight once per token: (weights per GPU) / bandwidth
        if not bandwidth or key not in run:
            return ""
        return f" ({run['b1_weight_bytes_per_device'] / bandwidth * 1e3 / run[key]:.0%} of floor)"

    lines = [
        "| scenario | TP=1 | TP=2 | speed-up | target |",
        "|---|---|---|---|---|",
        f"| batch-1 decode, engine step (prompt {scale['prompt_len']}, {scale['b1_new_tokens']} tokens), ms/token | {value(one, 'b1_ms_per_token')}{floor(one, 'b1_ms_per_token')} "
        f"| {value(two, 'b1_ms_per_token')}{floor(two, 'b1_ms_per_token')} | {ratio('b1_ms_per_token')} | >= 1.6x |",
        f"| batch-1 decode, jitted step alone (replayed), ms/token | {value(one, 'b1_device_ms_per_token')}{floor(one, 'b1_device_ms_per_token')} "
        f"| {value(two, 'b1_device_ms_per_token')}{floor(two, 'b1_device_ms_per_token')} | {ratio('b1_device_ms_per_token')} | |",
        f"| batch-1 decode, TP=2 with embedding and LM head replicated: engine step / step alone, ms/token | "
        f"| {value(whole_vocab, 'b1_ms_per_token')} / {value(whole_vocab, 'b1_device_ms_per_token')} "
        f"| vocab split is {ratio_between(whole_vocab, two, 'b1_ms_per_token')} / "
        f"{ratio_between(whole_vocab, two, 'b1_device_ms_per_token')} faster | |",
        f"| batch-{scale['batch']} decode (prompt {scale['prompt_len']}, {scale['batch_new_tokens']} tokens), tokens/s | {value(one, 'b32_tokens_per_s', '{:.0f}')} "
        f"| {value(two, 'b32_tokens_per_s', '{:.0f}')} | {ratio('b32_tokens_per_s', inverse=True)} | |",
    ]
    for label, coll, step_keys in (("batch-1", "b1_collectives", ("b1_device_ms_per_token", "b1_ms_per_token")),
                                   ("batch-32", "b32_collectives", ("b32_step_ms",))):
        shares = [collective_share(two.get(coll), two.get(k)) for k in step_keys]
        if any(s is not None for s in shares):
            text = " / ".join(f"{s:.0%}" for s in shares if s is not None)
            which = "of the step alone / of the engine step" if len(step_keys) == 2 else "of the engine step"
            lines.append(f"| collectives' share of a TP=2 {label} decode step ({which}) | | {text} | | |")
    body = "\n".join(lines)
    details = ["", "", "Collectives per TP=2 decode step (from the compiled HLO; each timed alone, see the script's docstring):", ""]
    for label, run, coll in (("batch 1", two, "b1_collectives"), ("batch 32", two, "b32_collectives"),
                             ("batch 1, vocab replicated", whole_vocab, "b1_collectives")):
        if run.get(coll):
            details.append(f"- {label}: {summary(run[coll])}")
    details += ["", f"Correctness: {json.dumps(results.get('checks'))}", "",
                f"Weights read per GPU and decode step (all but the embedding table): "
                f"TP=1 {one.get('b1_weight_bytes_per_device', 0) / 1e9:.3g} GB, TP=2 {two.get('b1_weight_bytes_per_device', 0) / 1e9:.3g} GB. "
                f"Compile of the first run: TP=1 {one.get('b1_first_run_compile_s', 0):.0f} s, TP=2 {two.get('b1_first_run_compile_s', 0):.0f} s."]
    skipped = {tp: r.get("skipped") or r.get("error") for tp, r in runs.items() if r.get("skipped") or r.get("error")}
    if skipped or results.get("not_run"):
        details.append(f"\nSkipped or failed: {skipped} {results.get('not_run', '')}")
    return head + body + "\n".join(details) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "docs" / "benchmarks")))
    parser.add_argument("--budget-s", type=float, default=320)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 forced devices, a tiny model")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab-replicated", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.budget_s, args.tiny, args.vocab_replicated)
        return
    t0 = time.perf_counter()
    now = datetime.datetime.now(datetime.timezone.utc)
    scale = TINY if args.tiny else FULL
    results = {"date": now.isoformat(timespec="minutes"), "tiny": args.tiny,
               "scale": {k: v for k, v in scale.items() if not isinstance(v, dict)},
               "command": "python benchmarks/tp.py " + " ".join(sys.argv[1:]), "runs": {}}
    if not args.tiny:
        results["torch_copy_bytes_per_s"] = e2e.torch_copy_bandwidth()
    for i, tp in enumerate(TP_SIZES):
        left = args.budget_s - (time.perf_counter() - t0)
        if left < 60:
            results["not_run"] = f"TP={tp}: {left:.0f} s of budget left"
            break
        # an even share of what is left, so that TP=1 cannot take TP=2's time
        results["runs"][str(tp)] = run_worker(tp, left / (len(TP_SIZES) - i), args.tiny)
    left = args.budget_s - (time.perf_counter() - t0)
    if left >= 60:  # what splitting the vocabulary is worth, if the budget still holds it
        results["runs"][VOCAB_REPLICATED] = run_worker(2, left, args.tiny, vocab_replicated=True)
    else:
        results["not_run"] = results.get("not_run", "") + f" TP=2 vocab replicated: {left:.0f} s of budget left"
    results["checks"] = compare(results["runs"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = next((r["device"] for r in results["runs"].values() if "device" in r), "unknown")
    stem = f"{now.date()}_{re.sub(r'[^A-Za-z0-9]+', '_', device)}_tp" + ("_tiny" if args.tiny else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / f"{stem}.md").write_text(table)
    print(f"wrote {out / stem}.json and .md", file=sys.stderr)
    print("\n" + table)


if __name__ == "__main__":
    main()
