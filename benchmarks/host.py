"""Host work per engine step and per streamed token, on the CPU (no GPU needed).

Two measurements with a 2-layer, 64-wide Llama model (dummy weights) and the
stories260K tokenizer, so detokenisation and stop strings are part of the work:

  step: --batch greedy requests (8) decoding; the host's time per step is the step's
        wall time minus the time it waits for the device (ModelRunner.read), async
        scheduling on; once with a cumulative output every step (engine.step's default
        kind) and once with one output when a request finishes (LLM.generate's).
  stream: one request streamed for 7000 tokens; the mean time per token of the last
        500 against that of tokens 100-600 (flat when host work per token is O(1)).

--mtp-k K runs the step measurements with MTP speculative decoding instead (the model
gets a random MTP module) and oracle drafts: the tokens of a plain greedy run of the same
requests replace the module's drafts on the device (engine.oracle_tokens), so every draft
is accepted and each request emits K + 1 tokens a step (the host's heaviest decode step).

Postprocessing: the engine thread's CPU time in LLMEngine._postprocess, less the read-back
(applying the read steps to their sequences and making the outputs).

--repo PATH runs the same workload on another checkout of jaxmtp (an older commit, as
the peer of the same run); a checkout older than jaxmtp/worker/step_records.py is
measured by its step's wall time and cumulative outputs only.

    python benchmarks/host.py                      # writes docs/benchmarks/host.{json,md}
    python benchmarks/host.py --repo /tmp/old --tag _before
    python benchmarks/host.py --batch 128 --mtp-k 1 --tag _mtp
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from timing import runner_phases

ROOT = Path(__file__).resolve().parent.parent

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


def model_folder(tmp: Path, with_mtp: bool = False) -> Path:
    """The tiny model's folder; with_mtp: its config declares one MTP module (dummy
    weights give it a random one)."""
    folder = tmp / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_nextn_predict_layers": 1} if with_mtp else TINY_LLAMA))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "checkpoints" / "stories260K" / name, folder / name)
    return folder


def prompt(i: int) -> list[int]:
    return [1, 10 + i, 20 + i]


def request_params(sampling_params, i: int):
    """Request i's SamplingParams: its seed names its row of the oracle table
    (step.oracle_drafts; greedy decoding ignores the seed otherwise)."""
    return dataclasses.replace(sampling_params, seed=i)


def oracle_table(llm, sampling_params, num_requests: int) -> list[list[int]]:
    """Each request's greedy output, row i request i's: the oracle drafts."""
    outs = llm.generate([prompt(i) for i in range(num_requests)],
                        [request_params(sampling_params, i) for i in range(num_requests)], use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def measure_steps(llm, sampling_params, num_requests: int, num_steps: int, split_wait: bool, oracle=None) -> dict:
    """oracle: the table of oracle drafts (an MTP engine), or None."""
    engine = llm.engine
    engine.oracle_tokens = oracle
    for i in range(num_requests):
        engine.add_request(f"s{i}", prompt(i), request_params(sampling_params, i))
    for _ in range(20):  # prefill and the first decode steps (they may compile)
        engine.step()
    tokens_before = engine.stats.generation_tokens
    start, start_cpu = time.perf_counter(), time.thread_time()
    with (runner_phases(engine) if split_wait else contextlib.nullcontext()) as spent, \
            (postprocess_cpu(engine) if split_wait else contextlib.nullcontext()) as cpu_in:
        for _ in range(num_steps):
            engine.step()
    wall = (time.perf_counter() - start) / num_steps
    cpu = (time.thread_time() - start_cpu) / num_steps
    tokens = engine.stats.generation_tokens - tokens_before  # read (postprocessed) in the timed steps
    while engine.has_unfinished_requests():
        engine.step()
    # tokens each request emitted a step (k + 1 with every oracle draft accepted)
    result = {"step_ms": wall * 1e3, "tokens_per_request_step": tokens / (num_steps * num_requests),
              # the CPU time of the engine's thread: the host's own work, less what the device's
              # threads, sharing the CPU with it, slow it down (what wall time minus waiting counts)
              "host_cpu_ms": cpu * 1e3}
    if split_wait:  # the read-back is mostly waiting for the device; the rest is the host's
        wait = spent["read"] / num_steps
        result["device_wait_ms"] = wait * 1e3
        result["host_ms"] = (wall - wait) * 1e3
        # of the CPU time: applying the read steps to their sequences and making the outputs
        result["postprocess_cpu_ms"] = (cpu_in["_postprocess"] - cpu_in["read"]) / num_steps * 1e3
    return result


@contextlib.contextmanager
def postprocess_cpu(engine):
    """The engine thread's CPU seconds in LLMEngine._postprocess and, within it, in
    ModelRunner.read (the read-back) while the block runs."""
    spent, wrapped = collections.Counter(), []

    def timed(owner, name: str):
        method = getattr(owner, name)  # (runner_phases' wrapper, when it is active)

        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - start

        wrapped.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, wrapper)  # an instance attribute over the method; undone below

    timed(engine, "_postprocess")
    timed(engine.runner, "read")
    try:
        yield spent
    finally:
        for owner, name, before in wrapped:
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def measure_stream(llm, sampling_params, delta: bool) -> dict:
    times = []  # when each token arrived
    for out in llm.stream([1, 403, 407], sampling_params):
        now = time.perf_counter()
        count = len(out.outputs[0].token_ids)
        times.extend([now] * (count if delta else count - len(times)))
    per_token = [b - a for a, b in zip(times, times[1:])]
    early = sum(per_token[100:600]) / 500
    late = sum(per_token[-500:]) / 500
    return {"tokens": len(times), "early_ms": early * 1e3, "late_ms": late * 1e3, "late_over_early": late / early}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", default=None, help="another checkout of jaxmtp to run the same workload on")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--stream-tokens", type=int, default=7000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together in the step measurements")
    parser.add_argument("--mtp-k", type=int, default=0, help="MTP draft tokens a step, oracle drafts (0: plain decoding)")
    args = parser.parse_args()
    repo = Path(args.repo).resolve() if args.repo else ROOT
    # a checkout older than the runner's step records (--repo) is measured by its step's wall time
    # and cumulative outputs only
    full = (repo / "jaxmtp" / "worker" / "step_records.py").is_file()
    sys.path.insert(0, str(repo))
    import jax

    from jaxmtp import LLM, SamplingParams

    k = args.mtp_k
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), with_mtp=k > 0)
        # room for the step measurements' outputs, k + 1 tokens a step
        context = max(args.stream_tokens, (k + 1) * (args.steps + 30) + k) + 16

        def engine(num_speculative_tokens=0):
            # one engine per measurement: pages a measurement touched first are faster
            # to read again (the host's memory), which would favour the stream's start
            # every request's k + 1 rows in each step
            return LLM(folder, load_format="dummy", max_num_seqs=args.batch,
                       max_num_batched_tokens=max(64, (num_speculative_tokens + 1) * args.batch),
                       max_model_len=context, num_pages=args.batch * context // 16 + 64,
                       num_speculative_tokens=num_speculative_tokens)

        # k + 1 tokens a step: the requests decode through the timed steps and 30 more
        decode = SamplingParams(max_tokens=(k + 1) * (args.steps + 30), temperature=0.0, ignore_eos=True,
                                stop=["Once upon a midnight"])
        # the oracle: k tokens further than the measured requests, so that their last drafts lie in it
        oracle = oracle_table(engine(k), dataclasses.replace(decode, max_tokens=decode.max_tokens + k),
                              args.batch) if k else None
        steps = measure_steps(engine(k), decode, args.batch, args.steps, split_wait=full, oracle=oracle)
        if full:  # one output when a request finishes (LLM.generate's kind), the same steps
            from jaxmtp.engine.sampling_params import RequestOutputKind

            final_only = dataclasses.replace(decode, output_kind=RequestOutputKind.FINAL_ONLY)
            steps["final_only"] = measure_steps(engine(k), final_only, args.batch, args.steps, split_wait=True,
                                                oracle=oracle)
        stream_params = SamplingParams(max_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True,
                                       stop=["Once upon a midnight"])
        delta = full
        if delta:
            stream_params.output_kind = RequestOutputKind.DELTA
        stream = measure_stream(engine(), stream_params, delta)
    results = {
        "date": datetime.date.today().isoformat(), "jax": jax.__version__, "device": platform.processor() or "cpu",
        "backend": jax.default_backend(), "repo": str(repo), "mtp_k": k, "step": steps, "stream": stream,
        "targets": {"host_ms": "<= 2", "late_over_early": "<= 1.2"},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    decoding = f" with MTP k={k}, oracle drafts ({steps['tokens_per_request_step']:.2f} tokens a step each)" if k else ""
    (out / f"host{args.tag}.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Host work per step and per token ({results['date']}, {results['backend']}, jax {results['jax']})",
        "", f"Checkout: {repo.name}; `python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`", "",
        "| measure | value | target |", "|---|---|---|",
        f"| step wall time, {args.batch} requests decoding{decoding}, a cumulative output each step | "
        f"{steps['step_ms']:.2f} ms | |",
    ]
    if "host_ms" in steps:
        lines.append(f"| of which host (wall minus waiting for the device) | {steps['host_ms']:.2f} ms | <= 2 ms |")
        lines.append(f"| the engine thread's CPU time; of which postprocessing | {steps['host_cpu_ms']:.2f} ms; "
                     f"{steps['postprocess_cpu_ms']:.2f} ms | |")
        final_only = steps["final_only"]
        lines.append(f"| the same, one output when a request finishes (LLM.generate's): step, of which host; CPU; "
                     f"of which postprocessing | {final_only['step_ms']:.2f} ms, {final_only['host_ms']:.2f} ms; "
                     f"{final_only['host_cpu_ms']:.2f} ms; {final_only['postprocess_cpu_ms']:.2f} ms | |")
    lines += [
        f"| stream, ms per token at tokens 100-600 | {stream['early_ms']:.3f} | |",
        f"| stream, ms per token over the last 500 of {stream['tokens']} | {stream['late_ms']:.3f} | |",
        f"| late / early | {stream['late_over_early']:.2f} | <= 1.2 |",
    ]
    (out / f"host{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
