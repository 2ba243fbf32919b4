"""Where a decode step's device time goes: a JAX profiler trace of the jitted step,
replayed back to back, summarised per GPU kernel (one H200, about two minutes).

    python benchmarks/profile_step.py [--k 0,1] [--batch 1] [--context 512] [--out DIR] [--tiny]

Uses the Llama-3-8B-shaped dummy model of benchmarks/e2e.py (--tiny: its tiny model on
the CPU, a smoke test whose table lists no GPU kernels). Writes profile.json
(top kernels per configuration: total microseconds per step and calls per step) and
prints the tables.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def kernel_table(trace_dir: Path, steps: int, top: int = 30) -> list[dict]:
    """Sum the device events of a perfetto trace by (timeline, name): kernels on the
    stream timelines, and XLA ops / modules on theirs."""
    path = next(trace_dir.rglob("perfetto_trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            key = (threads.get((e["pid"], e.get("tid")), "?")[:24], e["name"][:100])
            total[key] += e.get("dur", 0)
            calls[key] += 1
    return [{"timeline": line, "name": name, "us_per_step": us / steps, "calls_per_step": calls[(line, name)] / steps}
            for (line, name), us in total.most_common(top)]


def profile_kernels(step, steps: int) -> list[dict]:
    """kernel_table of a profiler trace over `steps` calls of step() (see
    timing.replay_time for what step is)."""
    import jax

    trace = Path(tempfile.mkdtemp())
    jax.profiler.start_trace(str(trace), create_perfetto_trace=True)
    for _ in range(steps):
        out = step()
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    return kernel_table(trace, steps)


def main() -> None:
    import jax

    from e2e import LLAMA3_8B, TINY, last_step_replay
    from timing import replay_time
    from jaxmtp import LLM, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--k", default="0,1")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny model")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    config = TINY if args.tiny else LLAMA3_8B
    Path(folder, "config.json").write_text(json.dumps(config))
    rng = __import__("numpy").random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"], size=args.context).tolist() for _ in range(args.batch)]
    report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "batch": args.batch,
              "context": args.context, "configs": {}}
    for k in map(int, args.k.split(",")):
        batched = max(512, args.batch * (k + 1))
        # every request still decodes when the last one has prefilled: the replayed step holds the whole batch
        max_tokens = 64 + -(-args.batch * args.context // batched)
        llm = LLM(folder, load_format="dummy", max_model_len=4096, max_num_seqs=args.batch,
                  num_pages=args.batch * -(-(args.context + max_tokens + 16) // 16) + 64,
                  max_num_batched_tokens=batched, num_speculative_tokens=k)
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        # step until the last step read back decoded every request: that step is replayed
        while not engine.requests or not all(
            len(seq.output_token_ids) >= 2 for r in engine.requests.values() for seq in r.seqs
        ):
            engine.step()
        replay = last_step_replay(engine)
        step_ms = replay_time(replay, args.steps) * 1e3
        table = profile_kernels(replay, args.steps)
        report["configs"][f"k={k}"] = {"replayed_step_ms": step_ms, "kernels": table}
        print(f"\nk={k}: replayed step {step_ms:.3f} ms; device time per step by kernel:")
        for row in table:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.1f}  [{row['timeline']}] {row['name']}")
        report["configs"][f"k={k}"]["replayed_step_requests"] = len(engine.last_schedule)
        del llm, engine
    Path(args.out, "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
