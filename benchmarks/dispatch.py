"""The host's cost of dispatching a compiled step, against the number of arrays it takes.

A step program takes every weight and cache array as its own argument (an 8B Llama's
step about 330: ten a layer, weights and cache), and JAX's dispatch handles
each argument on the host (its type, sharding, layout, donation). Constrained steps and
batch-1 MoE steps wait on that dispatch (docs/benchmarks: 2.4-3.3 ms a call on the
H200's host), so this measures:
- leaves: a compiled program over N small donated arrays (replicated on a one-device
  mesh, as the engine places them) that only bumps a counter, calls queued back to back:
  the host's microseconds a call, and an argument;
- engine: benchmarks/e2e.py's tiny model (or its Llama-3-8B shape) with L layers, its decode steps' dispatch
  (ModelRunner._run) per step as generate runs them, its last step replayed with the
  device idle at each call, and a bare program over the step's own arrays (its
  arguments' share of the dispatch; the rest is launching the step's executable).

    python benchmarks/dispatch.py [--leaves 16,64,256,512] [--layers 2,8,32] [--model tiny|llama3_8b]
                                  [--steps 48] [--out DIR]

Run it with and without XLA_FLAGS=--xla_gpu_enable_command_buffer= to see what the
GPU's command buffers take off (or add) to the launch. Writes dispatch.json and
dispatch.md (date, device, JAX version, XLA_FLAGS) under $OUT or --out."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import LLAMA3_8B, TINY, Bench  # noqa: E402
from structured import SCHEMA  # noqa: E402
from timing import add_dense_tilings_option, apply_dense_tilings, runner_phases  # noqa: E402


def leaves_row(count: int, calls: int) -> dict:
    """us a call of a program over `count` donated [64, 64] arrays, calls queued."""
    import jax
    import jax.numpy as jnp

    from jaxmtp.worker.sharding import make_mesh, replicated

    placed = replicated(make_mesh(1))
    arrays = [jax.device_put(jnp.full((64, 64), i, jnp.float32), placed) for i in range(count)]
    counter = jax.device_put(jnp.int32(0), placed)
    program = jax.jit(lambda arrays, counter: (arrays, counter + 1), donate_argnums=0).lower(arrays, counter).compile()
    for _ in range(3):
        arrays, counter = program(arrays, counter)
    jax.block_until_ready(counter)
    start = time.perf_counter()
    for _ in range(calls):
        arrays, counter = program(arrays, counter)
    dispatched = time.perf_counter() - start
    jax.block_until_ready(counter)
    us = 1e6 * dispatched / calls
    return {"arguments": count + 1, "dispatch_us": us, "us_per_argument": us / (count + 1)}


MODELS = {"tiny": TINY, "llama3_8b": LLAMA3_8B}


def engine_row(model: str, layers: int, steps: int, sampling: str = "0:1") -> dict:
    """`model` (dummy weights) with `layers` layers: its decode steps' dispatch per step.
    sampling: "temperature:top_p" of the requests (greedy 0:1 and sampled steps are
    programs of different shapes), or "json": greedy requests under structured.py's JSON
    schema, whose steps run as two programs (forward, then finish with the masks), each
    timed apart."""
    import jax
    import numpy as np

    from jaxmtp import LLM, SamplingParams
    from jaxmtp.worker.sharding import put_replicated

    config = {**MODELS[model], "num_hidden_layers": layers}
    folder = Bench.model_folder(config)
    llm = LLM(folder, load_format="dummy", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
              num_pages=None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"] - 2, size=16).tolist() for _ in range(8)]
    if sampling == "json":
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, structured_outputs={"json": SCHEMA})
    else:
        temperature, top_p = map(float, sampling.split(":"))
        params = SamplingParams(max_tokens=steps, temperature=temperature, top_p=top_p, seed=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles
    before = llm.engine.stats.steps
    with runner_phases(llm.engine) as phases:
        llm.generate(prompts, params, use_tqdm=False)
    done = llm.engine.stats.steps - before
    runner, record = llm.engine.runner, llm.engine.last_step
    arguments = len(jax.tree.leaves((runner.step_params, *runner.step_state())))
    # the last step replayed with the device idle at each call: no step before it computes
    # (a masked step: its forward's dispatch, and its finish's once the forward is done)
    masks = None if record.token_bitmask is None else put_replicated(record.token_bitmask, runner.mesh)
    idle = {"_run": 0.0, "_finish": 0.0}
    for _ in range(steps):
        jax.block_until_ready(runner.step_state())
        start = time.perf_counter()
        runner._run(record.args)
        idle["_run"] += time.perf_counter() - start
        if masks is not None:
            jax.block_until_ready(runner.step_state())
            start = time.perf_counter()
            runner._finish(masks)
            idle["_finish"] += time.perf_counter() - start
    jax.block_until_ready(runner.step_state())
    dispatch_ms = 1e3 * phases["_run"] / done
    return {"model": model, "layers": layers, "sampling": sampling, "arguments": arguments, "dispatch_ms": dispatch_ms,
            "us_per_argument": 1e3 * dispatch_ms / arguments, "idle_dispatch_ms": 1e3 * idle["_run"] / steps,
            "finish_dispatch_ms": 1e3 * phases["_finish"] / done, "idle_finish_ms": 1e3 * idle["_finish"] / steps,
            "arguments_alone_ms": arguments_alone(runner, steps), "step_ms": 1e3 * phases["whole"] / done}


def arguments_alone(runner, calls: int) -> float:
    """ms a call of a bare program over the step's own arrays, placed and donated as the
    step takes them (the weights read, the carried state donated and handed back): what
    the step's dispatch spends on its arguments, apart from its executable's launch."""
    import jax

    from jaxmtp.worker.step import STEP_STATE

    counter = jax.numpy.int32(0)
    program = jax.jit(lambda params, state, counter: (state, counter + 1),
                      donate_argnums=1).lower(runner.step_params, runner.step_state(), counter).compile()
    state, spent = runner.step_state(), 0.0
    for _ in range(calls):
        start = time.perf_counter()
        state, counter = program(runner.step_params, state, counter)
        spent += time.perf_counter() - start
    jax.block_until_ready(counter)
    for name, array in zip(STEP_STATE, state):  # the step's state, handed back
        setattr(runner, name, array)
    return 1e3 * spent / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", default="16,64,256,512", help="argument counts of the bare program (default: 16,64,256,512)")
    parser.add_argument("--layers", default="2,8,32", help="the model's layer counts (default: 2,8,32)")
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny", help="the engine rows' model (default: tiny)")
    parser.add_argument("--sampling", default="0:1",
                        help="the engine rows' requests, comma-separated: temperature:top_p, or json (greedy under a "
                             "JSON schema: two programs a step) (default: 0:1, greedy)")
    parser.add_argument("--steps", type=int, default=48, help="decode steps (and bare calls x 4) timed (default: 48)")
    parser.add_argument("--out", default=".", help="output folder when $OUT is unset (default: .)")
    add_dense_tilings_option(parser)
    args = parser.parse_args()
    import jax

    apply_dense_tilings(args.dense_tilings)

    results = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "dense_tilings": args.dense_tilings,
               "leaves": [leaves_row(int(n), 4 * args.steps) for n in args.leaves.split(",") if n],
               "engine": [engine_row(args.model, int(n), args.steps, sampling)
                          for n in args.layers.split(",") if n for sampling in args.sampling.split(",")]}
    out = Path(os.environ.get("OUT", args.out))
    out.mkdir(parents=True, exist_ok=True)
    (out / "dispatch.json").write_text(json.dumps(results, indent=1))
    lines = [f"{results['date']}, {results['device']}, JAX {results['jax']}, XLA_FLAGS={results['xla_flags']!r}, dense tilings "
             f"{results['dense_tilings']}", "",
             "| program | arguments | dispatch us a call | us an argument | idle device: us a call "
             "| its arguments alone: us a call | a masked step's finish: us a call, idle device |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| bare | {r['arguments']} | {r['dispatch_us']:.0f} | {r['us_per_argument']:.2f} | | | |"
              for r in results["leaves"]]
    lines += [f"| {r['model']}, {r['layers']} layers, sampling {r['sampling']} (step {r['step_ms']:.2f} ms) | {r['arguments']} | "
              f"{1e3 * r['dispatch_ms']:.0f} | {r['us_per_argument']:.2f} | {1e3 * r['idle_dispatch_ms']:.0f} | "
              f"{1e3 * r['arguments_alone_ms']:.0f} | "
              + (f"{1e3 * r['finish_dispatch_ms']:.0f}, {1e3 * r['idle_finish_ms']:.0f} |" if r["finish_dispatch_ms"] else "|")
              for r in results["engine"]]
    (out / "dispatch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
