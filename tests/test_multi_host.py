"""The engine over two processes on jax.distributed, on this one CPU box: each process
has 2 forced CPU devices (gloo collectives, the coordinator on 127.0.0.1), and the
engine's tensor-parallel mesh spans all 4. Its outputs are one process's with 4
devices: greedy and seeded tokens, logprobs, prompt logprobs, MTP drafts accepted,
logits-processing rows, prefix-cache hits; `jaxmtp serve` over the two processes
answers as that process does. A node that dies ends the other within a bounded time,
and nodes whose engines differ refuse to start.

The processes are this file run as a script (see the bottom), as in
tests/test_tensor_parallel.py: XLA_FLAGS must be set before JAX starts.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "checkpoints" / "stories260K-mtp"  # orbax; 8 heads, 4 kv heads, ffn 172: TP=4 divides them
STORIES = ROOT / "checkpoints" / "stories260K"  # the same base model in safetensors
NODE_TIMEOUT = 8  # seconds without a heartbeat before a node counts as dead
DEAD_NODE_BOUND = NODE_TIMEOUT + 40  # what a test waits for the survivor to exit (heartbeat + slack)
ENGINE = dict(tensor_parallel_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128, num_speculative_tokens=2,
              enable_prefix_caching=True)
TEXT_PROMPT = "Once upon a time"
MAX_TOKENS = 16


# ----- the processes ----------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[1], [1] + rng.integers(3, 512, size=36).tolist()]


def scenario(**nodes) -> dict:
    """One engine: a greedy batch, a seeded sampled request with logits processing
    (its LogitsState row is written on the device) and prompt logprobs, a constrained
    request (its steps' masks are a message of their own), then two requests one after
    the other that reuse the pages of the batch's 37-token prompt."""
    from jaxmtp import LLM, SamplingParams
    from jaxmtp.engine.structured_outputs import StructuredOutputsParams

    llm = LLM(MODEL, **ENGINE, **nodes)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=40, seed=3, ignore_eos=True, logprobs=3,
                             presence_penalty=0.5, logit_bias={300: 2.0}, allowed_token_ids=list(range(3, 512, 2)),
                             prompt_logprobs=1)
    short, shared = _prompts()
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}( [a-z]{2,6}){3}"))
    outs = llm.generate([short, shared, [1, 403, 29, 11], [1, 403]], [greedy, greedy, sampled, constrained],
                        use_tqdm=False)
    # the first reuses two pages whole; the second diverges right after them, so the
    # second page's last draft row is recomputed in a copy of it (copy-on-write)
    outs += [llm.generate([prompt], greedy, use_tqdm=False)[0] for prompt in (shared + [5, 9], shared[:32] + [7])]
    text = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]
    stats = llm.engine.stats
    report = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[next(iter(e.values())).logprob for e in o.outputs[0].logprobs] for o in outs],
        "top_ids": [list(e) for e in outs[2].outputs[0].logprobs],
        "prompt_logprobs": [next(iter(e.values())).logprob for e in outs[2].prompt_logprobs[1:]],
        "accepted_per_position": [o.spec_stats["accepted_per_position"] for o in outs],
        "prefix_hits": stats.prefix_cache.hits,
        "text": text.outputs[0].text,
        "steps": stats.steps,
    }
    peers = llm.engine.runner.peers
    if peers is not None:
        report["channel"] = vars(peers.stats)
    else:
        report["collectives"] = collectives(llm.engine.runner)
    return report


def collectives(runner) -> dict:
    """The cross-device collectives of the compiled decode step (2 requests, greedy),
    from its HLO: per kind, how many and the bytes of their results."""
    from jaxmtp.worker.batch import BatchShape

    sizes = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1}
    found: dict[str, list[int]] = {}
    for line in runner.lower_step(BatchShape(8, 2)).compile().as_text().splitlines():
        for kind in ("all-reduce", "all-gather", "all-to-all", "collective-permute"):
            if f" {kind}(" in line or f" {kind}-start(" in line:
                dtype, dims = line.split("=", 1)[1].strip().split("[", 1)
                count = int(np.prod([int(d) for d in dims.split("]")[0].split(",") if d]))
                found.setdefault(kind, [0, 0])
                found[kind][0] += 1
                found[kind][1] += count * sizes.get(dtype.strip("( "), 4)
    return {kind: {"count": n, "bytes": b} for kind, (n, b) in found.items()}


def node_options(rank: int, port: int) -> dict:
    return dict(num_nodes=2, node_rank=rank, coordinator=f"127.0.0.1:{port}", node_timeout=NODE_TIMEOUT)


def main(argv: list[str]) -> None:
    role = argv[0]
    if role == "reference":
        print(json.dumps(scenario()))
    elif role == "node":
        print(json.dumps(scenario(**node_options(int(argv[1]), int(argv[2])))))
    elif role in ("idle", "mismatch"):
        # stories260K from safetensors, rank 0 generating its first greedy tokens, then
        # waiting; "mismatch": rank 1's options differ from rank 0's
        from jaxmtp import LLM, SamplingParams

        rank = int(argv[1])
        seqs = 4 if role == "mismatch" and rank == 1 else 2
        llm = LLM(STORIES, **{**ENGINE, "max_num_seqs": seqs, "num_speculative_tokens": 0},
                  **node_options(rank, int(argv[2])))
        out = llm.generate([[1]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        print(json.dumps(out[0].outputs[0].token_ids), flush=True)
        print("ready", flush=True)
        time.sleep(600)


# ----- running them ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    from conftest import CPU_XLA_FLAGS

    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {CPU_XLA_FLAGS}",
        "JAX_PLATFORMS": "cpu",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "PYTHONPATH": str(ROOT),  # this checkout's jaxmtp, whatever is installed
    }


def _no_core_dumps():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a node JAX ends aborts


def _start(args: list[str], log: Path, devices: int = 2) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *args], env=_env(devices), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=_no_core_dumps)


def _report(log: Path) -> dict:
    return json.loads(log.read_text().strip().splitlines()[-1])


def _wait_for(ready, log: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _wait_for_exit(proc: subprocess.Popen, timeout: float) -> None:
    """The process exits within timeout seconds, or the test fails (and it is killed)."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the surviving node still ran {timeout} s after the other died")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process with 4 devices."""
    log = tmp_path_factory.mktemp("reference") / "out.log"
    proc = _start([__file__, "reference"], log, devices=4)
    assert proc.wait(600) == 0, log.read_text()[-4000:]
    return _report(log)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict:
    folder, port = tmp_path_factory.mktemp("two-nodes"), _free_port()
    procs = [_start([__file__, "node", str(rank), str(port)], folder / f"node{rank}.log") for rank in (0, 1)]
    codes = [proc.wait(600) for proc in procs]
    logs = [(folder / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], "\n----\n".join(log[-4000:] for log in logs)
    return {"report": _report(folder / "node0.log"), "worker_log": logs[1]}


def test_two_processes_give_one_processes_outputs(reference, two_nodes):
    from conftest import stories_logprob_bound_of
    from tolerances import assert_within

    run = two_nodes["report"]
    assert run["tokens"] == reference["tokens"]
    assert run["top_ids"] == reference["top_ids"]
    # gloo's all-reduce order changes float32 rounding only: two evaluations, each within
    # stories_logprob_bound of the exact logprobs
    short, shared = _prompts()
    prompts = [short, shared, [1, 403, 29, 11], [1, 403], shared + [5, 9], shared[:32] + [7]]
    bound = 2 * stories_logprob_bound_of([p + t[:-1] for p, t in zip(prompts, reference["tokens"])])
    for a, b in zip(run["logprobs"] + [run["prompt_logprobs"]], reference["logprobs"] + [reference["prompt_logprobs"]]):
        assert_within(a, b, bound)
    assert run["text"] == reference["text"]


def test_mtp_drafts_and_prefix_cache_hits_are_one_processes(reference, two_nodes):
    run = two_nodes["report"]
    assert run["accepted_per_position"] == reference["accepted_per_position"]
    assert sum(map(sum, run["accepted_per_position"])) > 0  # the drafts are accepted at times
    assert run["prefix_hits"] == reference["prefix_hits"] >= 63  # the last two requests reused two pages


def test_rank_0_sends_one_message_a_step_and_a_stop(two_nodes):
    """Every step's device work (and nothing per token beyond it) crosses in one message,
    and a masked step's bitmasks in a second; rank 1 prints nothing but exits 0 once
    told to stop."""
    run = two_nodes["report"]
    channel = run["channel"]
    assert channel["step_messages"] == run["steps"]
    assert channel["mask_messages"] > 0  # the constrained request's steps
    # the stop goes at exit, after the report
    assert channel["messages"] == channel["step_messages"] + channel["mask_messages"]
    assert 0 < channel["step_bytes"] / channel["step_messages"] < 4096, channel
    assert "Traceback" not in two_nodes["worker_log"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`jaxmtp serve` as two nodes (rank 1 serves no HTTP)."""
    folder, port, http = tmp_path_factory.mktemp("serve"), _free_port(), _free_port()
    options = ["--max-num-seqs", "2", "--max-num-batched-tokens", "8", "--max-model-len", "128", "--tensor-parallel-size", "4",
               "--num-nodes", "2", "--coordinator", f"127.0.0.1:{port}", "--node-timeout", str(NODE_TIMEOUT),
               "--port", str(http), "--compilation-cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"]]
    procs = [_start(["-m", "jaxmtp.cli", "serve", str(MODEL), *options, "--node-rank", str(rank)],
                     folder / f"node{rank}.log") for rank in (0, 1)]
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_for(lambda: _healthy(url), folder / "node0.log", procs[0])
        yield {"url": url, "procs": procs, "logs": [folder / f"node{r}.log" for r in (0, 1)]}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_serve_over_two_processes_answers_as_one_process(served, reference):
    import httpx

    body = dict(prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    answer = httpx.post(served["url"] + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == reference["text"]
    assert served["procs"][1].poll() is None and "Uvicorn" not in served["logs"][1].read_text()  # rank 1: no HTTP


def test_a_dead_worker_ends_the_server_within_the_node_timeout(served):
    """Rank 1 sent SIGTERM ends at once (JAX's preemption service would swallow it);
    JAX's coordination service then misses its heartbeats, and rank 0 (the server, here
    idle) exits with an error."""
    worker, server = served["procs"][1], served["procs"][0]
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 128 + signal.SIGTERM
    assert "node 1: SIGTERM: ending this process, and with it every node" in served["logs"][1].read_text()
    _wait_for_exit(server, DEAD_NODE_BOUND)
    assert server.returncode != 0
    log = served["logs"][0].read_text()
    assert "stopped sending heartbeats" in log, log[-3000:]


def test_a_dead_rank_0_ends_the_other_nodes(tmp_path):
    """After stories260K, read from safetensors shard by shard, gave its golden greedy
    tokens over the two processes."""
    from conftest import golden_ids

    port = _free_port()
    procs = [_start([__file__, "idle", str(rank), str(port)], tmp_path / f"node{rank}.log") for rank in (0, 1)]
    try:
        log = tmp_path / "node0.log"
        _wait_for(lambda: "ready" in log.read_text(), log, procs[0])  # rank 1 is following: it said it was ready
        tokens = [line for line in log.read_text().splitlines() if line.startswith("[")][-1]
        assert json.loads(tokens) == golden_ids()[:8]
        procs[0].send_signal(signal.SIGKILL)
        _wait_for_exit(procs[1], DEAD_NODE_BOUND)
        worker_log = (tmp_path / "node1.log").read_text()
        assert procs[1].returncode != 0, worker_log[-3000:]
        # JAX's error polling ends it, or first its wait for the next message fails
        assert "Terminating process because the JAX distributed service detected fatal errors" in worker_log \
            or "node 1 failed: ending this process" in worker_log, worker_log[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_nodes_whose_engines_differ_refuse_to_start(tmp_path):
    port = _free_port()
    procs = [_start([__file__, "mismatch", str(rank), str(port)], tmp_path / f"node{rank}.log") for rank in (0, 1)]
    try:
        codes = [proc.wait(300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert codes[0] != 0 and codes[1] != 0, logs
    assert "ValueError: node 1 cannot run this engine: option max_num_seqs is 4, rank 0's 2" in logs[0], logs[0][-3000:]


# ----- without processes ------------------------------------------------------------------------


def test_node_options_are_checked_before_anything_runs():
    from jaxmtp.engine.engine_config import EngineConfig

    for kwargs, message in (
        (dict(num_nodes=2), "needs coordinator as HOST:PORT"),
        (dict(num_nodes=2, coordinator="host"), "needs coordinator as HOST:PORT"),
        (dict(num_nodes=2, node_rank=2, coordinator="h:1"), "node_rank must be in 0..num_nodes-1 = 0..1"),
        (dict(node_rank=1), "node_rank must be in 0..num_nodes-1 = 0..0"),
        (dict(coordinator="h:1"), "coordinator is for num_nodes > 1"),
        (dict(num_nodes=0), "num_nodes must be >= 1"),
        (dict(num_nodes=2, coordinator="h:1", node_timeout=0), "node_timeout must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**kwargs)


def test_step_messages_carry_every_input_exactly():
    from jaxmtp.worker import distributed
    from jaxmtp.worker.batch import BatchShape
    from jaxmtp.worker.step_records import StepInputs

    rng = np.random.default_rng(0)
    inputs = StepInputs(
        [(rng.integers(0, 9, 8, dtype=np.int32), rng.integers(0, 9, 8, dtype=np.int32)) for _ in range(2)],
        (rng.integers(0, 9, 4, dtype=np.int32), rng.integers(0, 9, 4, dtype=np.int32)),
        (rng.integers(0, 9, 4, dtype=np.int32), rng.integers(0, 9, 4, dtype=np.int32)),
        np.array([3, 16], np.int32), {"bias": rng.normal(size=(2, 5)).astype(np.float32),
                                      "token_flags": rng.integers(0, 3, (2, 5), dtype=np.int8)},
        rng.integers(-9, 9, 40, dtype=np.int32), rng.normal(size=12).astype(np.float32),
        BatchShape(8, 2, greedy=False, pages_per_seq=4, prompt_logprobs=True),
    )
    kind, meta, arrays = distributed.decode(distributed.step_message(inputs))
    back = distributed.step_inputs(meta, arrays)
    assert kind == "step" and back.shape == inputs.shape
    for a, b in zip(back.page_copies + [back.state_restores, back.state_saves],
                    inputs.page_copies + [inputs.state_restores, inputs.state_saves], strict=True):
        np.testing.assert_array_equal(a, b)
    for name in ("state_slots", "ints", "floats"):
        got, want = getattr(back, name), getattr(inputs, name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert back.state_rows.keys() == inputs.state_rows.keys()
    for name, row in inputs.state_rows.items():
        assert back.state_rows[name].dtype == row.dtype
        np.testing.assert_array_equal(back.state_rows[name], row)
    copies_only = distributed.step_inputs(*distributed.decode(distributed.step_message(StepInputs([])))[1:])
    assert copies_only == StepInputs([])


if __name__ == "__main__":
    main(sys.argv[1:])
