"""Where a decode step's time goes: a JAX profiler trace of the jitted step, replayed
back to back, summarised per GPU kernel and per part of the step (one H200, a few
minutes), and the host's time per async engine step by phase.

    python benchmarks/profile_step.py [--k 0,1,3] [--batch 1,32,128] [--context 1024]
        [--no-command-buffer] [--dense-tilings measured|none] [--hlo] [--out DIR] [--tiny]

Uses the Llama-3-8B-shaped dummy model of benchmarks/e2e.py (--model moonlight: the
Moonlight-16B-A3B one of benchmarks/moe.py; --tiny: its tiny model on
the CPU, a smoke test whose tables list no GPU kernels). The parts are the step's named
scopes (jaxmtp.worker.step.STEP_PARTS: batch_in, main_forward, verify, draft, carry_out;
the draft split into its decoder layers, its LM heads and the rest): each kernel is
charged to the part its HLO instruction's metadata names, which the trace tells only
without CUDA graphs: on the GPU the part table needs --no-command-buffer (XLA then
launches each kernel itself; the replayed step at batch 32 is within 1% of the
default's, the host's dispatch is not). A part's share is of the kernels' summed time;
the replayed step is that sum plus launch gaps. The host phases
are wall time per engine.step() with async scheduling (the compiled call's dispatch, the
read-back, which waits for the device, and the rest: scheduling, batch building,
postprocessing). --no-command-buffer runs XLA without CUDA graphs (each kernel its own
launch). Writes profile.json (per configuration: the replayed step, its kernels, parts
and host phases) and prints the tables.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DRAFT_PARTS = ("draft_layer", "draft_head")  # the named scopes inside the draft pass (jaxmtp/worker/mtp.py)
# Kernels launched from a CUDA graph (XLA's command buffers, the default) carry the
# graph's instruction, not their own, and XLA compiles identical fusions (every layer's)
# as one kernel, so neither names a kernel's part.
PARTS_NEED = "run with --no-command-buffer (kernels in CUDA graphs do not name their instruction)"


def trace_events(step, steps: int) -> list[dict]:
    """The device events [{timeline, name, hlo_op, ts, us}] (ts: start, microseconds) of
    a profiler trace over `steps` calls of step() (timing.replay_time says what step is): kernels on the GPU's
    stream timelines (on the CPU, in a --tiny run: the thunks XLA ran)."""
    import jax

    trace = Path(tempfile.mkdtemp())
    jax.profiler.start_trace(str(trace), create_perfetto_trace=True)
    for _ in range(steps):
        out = step()
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    path = next(trace.rglob("perfetto_trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    found = []
    for e in events:
        if e.get("ph") != "X" or (gpu_pids and e.get("pid") not in gpu_pids):
            continue
        line = threads.get((e["pid"], e.get("tid")), "?")
        if gpu_pids and not line.startswith("Stream"):
            continue  # the XLA Ops / Modules timelines repeat the streams' kernels
        hlo_op = e.get("args", {}).get("hlo_op")
        if not gpu_pids and (hlo_op is None or e["name"].startswith("end: ")):
            continue  # the CPU's: its thunks alone, not the Python and executor spans around them
        found.append({"timeline": line[:24], "name": e["name"], "hlo_op": hlo_op, "ts": e.get("ts", 0),
                      "us": e.get("dur", 0)})
    return found


def kernel_table(events: list[dict], steps: int, top: int = 30) -> list[dict]:
    """The events summed by (timeline, name): microseconds and calls per step."""
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        key = (e["timeline"], e["name"][:100])
        total[key] += e["us"]
        calls[key] += 1
    return [{"timeline": line, "name": name, "us_per_step": us / steps, "calls_per_step": calls[(line, name)] / steps}
            for (line, name), us in total.most_common(top)]


def profile_kernels(step, steps: int) -> list[dict]:
    """kernel_table of a trace over `steps` calls of step()."""
    return kernel_table(trace_events(step, steps), steps)


def instruction_parts(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the part of the step it computes ("draft/draft_head",
    "main_forward", ...; "other" where no scope names it), from the op_name metadata of
    the optimised module: an instruction's own, else (a fusion, a call) the scopes of the
    instructions in the computations it calls, the most common one."""
    from jaxmtp.worker.step import STEP_PARTS

    def part_of(op_name: str) -> str | None:
        path = op_name.split("/")
        top = next((p for p in path if p in STEP_PARTS), None)
        sub = next((p for p in path if p in DRAFT_PARTS), None)
        return None if top is None else f"{top}/{sub}" if sub else top

    own, calls, in_computation = {}, {}, collections.defaultdict(list)
    computation = None
    for line in hlo_text.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            continue
        name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not name or computation is None:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        part = part_of(op_name.group(1)) if op_name else None
        own[name.group(1)] = part
        calls[name.group(1)] = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
        if part:
            in_computation[computation].append(part)

    def resolved(instruction: str) -> str:
        if own.get(instruction):
            return own[instruction]
        inner = collections.Counter(p for c in calls.get(instruction, ()) for p in in_computation.get(c, ()))
        return inner.most_common(1)[0][0] if inner else "other"

    return {name: resolved(name) for name in own}


def part_table(events: list[dict], parts: dict[str, str], steps: int) -> list[dict]:
    """The events summed by the part of the step their HLO instruction computes (its
    name from the event, or the kernel's name, which XLA derives from the instruction's:
    '.' and '-' as '_'), with each part's share of the summed kernel time."""
    by_kernel_name = {re.sub(r"[.\-]", "_", name): part for name, part in parts.items()}
    total = collections.Counter()
    for e in events:
        op = e["hlo_op"]
        total[parts.get(op) if op in parts else by_kernel_name.get(e["name"], "other")] += e["us"]
    summed = sum(total.values()) or 1.0
    return [{"part": part, "us_per_step": us / steps, "share": us / summed} for part, us in sorted(total.items())]


def host_phases(engine, steps: int) -> dict[str, float]:
    """Milliseconds per engine.step() with async scheduling, over `steps` steps: the
    whole step, the compiled call (its dispatch), the read-back of the step before
    (mostly waiting for the device) and the host's own work, the rest."""
    from timing import compiled_calls, host_work, runner_phases

    with runner_phases(engine) as spent:
        for _ in range(steps):
            engine.step()
    per_step = lambda s: 1e3 * s / steps  # noqa: E731
    return {"step_ms": per_step(spent["whole"]), "compiled_call_ms": per_step(compiled_calls(spent)),
            "read_back_ms": per_step(spent["read"]), "host_work_ms": per_step(host_work(spent))}


def profile_config(folder: str, vocab_size: int, batch: int, context: int, k: int, steps: int,
                   hlo_path: Path | None = None, with_parts: bool = True) -> dict:
    """One engine of `batch` requests decoding at about `context` tokens with k drafts:
    its last step replayed (time, kernels, parts), then host phases of further steps;
    hlo_path: where to write the replayed program's optimised HLO, gzipped; with_parts:
    whether the trace's kernels name their instructions (PARTS_NEED)."""
    import numpy as np

    from e2e import last_step_replay
    from timing import replay_time
    from jaxmtp import LLM, SamplingParams
    from jaxmtp.engine.sampling_params import RequestOutputKind

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab_size, size=context).tolist() for _ in range(batch)]
    batched = max(2048, batch * (k + 1))
    host_steps = 20
    # every request still decodes when the last one has prefilled, and through the host phases
    max_tokens = 64 + host_steps * (k + 1) + -(-batch * context // batched)
    positions = json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"]
    llm = LLM(folder, load_format="dummy", max_model_len=min(4096, positions), max_num_seqs=batch,
              num_pages=batch * -(-(context + max_tokens + 16) // 16) + 64,
              max_num_batched_tokens=batched, num_speculative_tokens=k)
    engine = llm.engine
    # one output when a request finishes, as LLM.generate asks (no per-step output copies
    # in the host's phases)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    # step until the last step read back decoded every request: that step is replayed
    while not engine.requests or not all(
        len(seq.output_token_ids) >= 2 for r in engine.requests.values() for seq in r.seqs
    ):
        engine.step()
    replay = last_step_replay(engine)
    step_ms = replay_time(replay, steps) * 1e3
    events = trace_events(replay, steps)
    hlo = "\n".join(program.as_text() for program in engine.runner.programs.program(engine.last_step.args[3]))
    if hlo_path is not None:
        hlo_path.write_bytes(gzip.compress(hlo.encode()))
    result = {"replayed_step_ms": step_ms, "replayed_step_requests": len(engine.last_schedule),
              "kernels": kernel_table(events, steps),
              "parts": part_table(events, instruction_parts(hlo), steps) if with_parts else None,
              "host": host_phases(engine, host_steps)}
    del llm, engine
    return result


def print_config(name: str, result: dict) -> None:
    print(f"\n{name}: replayed step {result['replayed_step_ms']:.3f} ms; device time per step by kernel:")
    for row in result["kernels"]:
        print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.1f}  [{row['timeline']}] {row['name']}")
    if result["parts"] is None:
        print(f"{name}: by part: {PARTS_NEED}")
    else:
        kernels_ms = sum(p["us_per_step"] for p in result["parts"]) / 1e3
        print(f"{name}: by part (kernels {kernels_ms:.3f} ms of the {result['replayed_step_ms']:.3f} ms step):")
    for p in result["parts"] or ():
        print(f"  {p['part']:<20} {p['us_per_step']:9.1f} us  {100 * p['share']:5.1f}%")
    print(f"{name}: host per async step " + ", ".join(f"{key} {value:.2f}" for key, value in result["host"].items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", default="0,1")
    parser.add_argument("--batch", default="1", help="comma list of batch sizes")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-command-buffer", action="store_true", help="XLA without CUDA graphs")
    parser.add_argument("--hlo", action="store_true", help="also write each program's optimised HLO (hlo_*.txt.gz)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny model")
    parser.add_argument("--model", choices=("llama3_8b", "moonlight"), default="llama3_8b",
                        help="the dummy model: e2e.py's Llama-3-8B shape or moe.py's Moonlight-16B-A3B")
    from timing import add_dense_tilings_option, apply_dense_tilings

    add_dense_tilings_option(parser)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.no_command_buffer:  # before JAX starts its backend
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    import jax

    apply_dense_tilings(args.dense_tilings)

    from e2e import LLAMA3_8B, TINY
    from moe import MODELS

    folder = tempfile.mkdtemp()
    config = TINY if args.tiny else {"llama3_8b": LLAMA3_8B, "moonlight": MODELS["moonlight"][0]}[args.model]
    Path(folder, "config.json").write_text(json.dumps(config))
    report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "model": args.model,
              "context": args.context,
              "command_buffer": not args.no_command_buffer, "dense_tilings": args.dense_tilings, "configs": {}}
    for batch in map(int, args.batch.split(",")):
        for k in map(int, args.k.split(",")):
            name = f"b={batch} k={k}"
            hlo_path = Path(args.out, f"hlo_b{batch}_k{k}.txt.gz") if args.hlo else None
            with_parts = args.no_command_buffer or jax.default_backend() != "gpu"
            report["configs"][name] = profile_config(folder, config["vocab_size"], batch, args.context, k, args.steps,
                                                     hlo_path, with_parts)
            print_config(name, report["configs"][name])
            Path(args.out, "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
