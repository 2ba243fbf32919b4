"""End-to-end GPU benchmark (one NVIDIA H200; each group of scenarios fits a call of a
few minutes).

    python benchmarks/e2e.py --scenarios peer,b1,mtp --tag a     # call a
    python benchmarks/e2e.py --scenarios batch,mtp32,prefill,online --tag b
    python benchmarks/e2e.py --tiny                             # CPU smoke test, tiny model

A Llama-3-8B-shaped bfloat16 model with random weights and a random one-module MTP
head (load_format="dummy": only a config.json, weights made on the device) against
floors measured in the same run (device-to-device copy bandwidth, bf16 matmul rate)
and against transformers on the same GPU. Scenarios run in the order given and are
skipped when the time budget is spent; each result is written as soon as it exists.
Prints a table last; saves JSON and markdown with date, device and JAX version.

Scenario groups: peer (transformers), checks (GPU correctness), b1 (batch-1 decode,
async and sync scheduling, the jitted step alone, HLO cache copies), mtp (k = 1, 2, 3
at batch 1), mtp32 (k = 1, 3 at batch 32; --mtp32-batches for others), batch (batch 8/32/128 at context 1024 and
4096), prefill (8k prompt, chunks 512 and 2048), online (Poisson arrivals), startup
(cold and warm start with the persistent compilation cache).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# the largest batches' KV caches need more than JAX's default 75% of the device's memory
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 9216,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "num_nextn_predict_layers": 1,
}
# DeepSeek-V3's quantization_config (its checkpoints' config.json)
FP8_BLOCK_SCALED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
TINY = {**LLAMA3_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
        "max_position_embeddings": 512}  # the CPU smoke test's page tables: 32 pages, not 512


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Workload sizes: the real ones, or a small copy for the CPU smoke test."""

    prompt: int = 512
    new_tokens: int = 256
    batch_new_tokens: int = 32
    batches: tuple = (1, 32, 128, 256)
    contexts: tuple = (1024, 4096)
    prefill_prompt: int = 8192
    prefill_chunks: tuple = (512, 2048)
    max_batched: int = 2048
    online_requests: int = 48
    online_rate: float = 8.0  # requests per second
    online_prompt: tuple = (128, 1024)
    online_output: tuple = (32, 256)
    online_seqs: int = 16
    online_batched: int = 512


TINY_SIZES = Sizes(prompt=40, new_tokens=24, batch_new_tokens=8, batches=(1, 4), contexts=(32, 64),
                   prefill_prompt=256, prefill_chunks=(32, 128), max_batched=256, online_requests=8,
                   online_rate=20.0, online_prompt=(8, 48), online_output=(4, 16), online_seqs=4, online_batched=64)

PEER_SCRIPT = r"""
import json, sys, time, torch, transformers
cfg = transformers.LlamaConfig(**{k: v for k, v in json.loads(sys.argv[1]).items()
                                  if k not in ("architectures", "model_type", "torch_dtype", "num_nextn_predict_layers")})
budget = float(sys.argv[2])
start = time.perf_counter()
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
results = {}
def run(batch, prompt_len, new, cache):
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if cache: kw["cache_implementation"] = cache
    model.generate(ids, **kw)  # the same call first: a static cache compiles for its shapes
    torch.cuda.synchronize(); t = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t)
# (name, batch, cache, new tokens). transformers 5 compiles the static-cache decode
# forward with torch.compile inside generate; run() warms up with the identical call so
# compilation stays out of the timed one. argv[3], when given, picks entries by name.
plan = [("b1_dynamic", 1, None, 64), ("b32_dynamic", 32, None, 32), ("b32_static", 32, "static", 32),
        ("b1_static", 1, "static", 64)]
chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else [entry[0] for entry in plan]
for name, batch, cache, new in plan:
    if name not in chosen:
        continue
    if time.perf_counter() - start > budget / 2:
        results[name] = "not run: over budget"
        continue
    try:
        results[name] = run(batch, 512, new, cache)
    except Exception as e:
        results[name] = repr(e)[:200]
    print(name, results[name], flush=True)
print("PEER_JSON " + json.dumps(results))
"""


def measure_floors(tiny: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from timing import median_time, replay_time

    n = 512 if tiny else 8192
    x = jnp.asarray(np.random.default_rng().standard_normal((1 << (20 if tiny else 28),), np.float32))
    x = x.astype(jnp.bfloat16)
    copy = jax.jit(lambda a: a * 1)  # elementwise read + write, what JAX can do
    jax_copy = 2 * x.nbytes / replay_time(lambda: copy(x), 10)  # calls queued: no dispatch in the figure
    a = jnp.asarray(np.random.default_rng().standard_normal((n, n), np.float32)).astype(jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    return {"jax_copy_bytes_per_s": jax_copy, "matmul_flops_per_s": 2 * n**3 / median_time(mm, a, a, warmup=1, runs=10)}


def torch_copy_bandwidth():
    out = subprocess.run([sys.executable, "-c", (
        "import torch,time\n"
        "x=torch.randn(1<<29,device='cuda',dtype=torch.bfloat16);y=torch.empty_like(x)\n"
        "[y.copy_(x) for _ in range(3)];torch.cuda.synchronize();t=time.perf_counter()\n"
        "[y.copy_(x) for _ in range(20)];torch.cuda.synchronize()\n"
        "print(2*x.numel()*2*20/(time.perf_counter()-t))")], capture_output=True, text=True, timeout=120)
    return float(out.stdout.strip().splitlines()[-1])


def weight_bytes(params, embed_excluded=True):
    import jax

    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - (params.embed.nbytes if embed_excluded else 0)


def set_async(llm, overlap: bool) -> None:
    """Switch the engine between async and sync scheduling (same compiled step)."""
    llm.engine.config = dataclasses.replace(llm.engine.config, async_scheduling=overlap)


def timed_steps(spent, step_walls: list[float]) -> dict[str, float]:
    """Milliseconds a timed step: runner_phases' split of `spent` and the steps' median and
    slowest wall times."""
    import numpy as np

    from timing import compiled_calls, host_work

    per_step = 1e3 / len(step_walls)
    return {"dispatch_ms": compiled_calls(spent) * per_step, "read_back_ms": spent["read"] * per_step,
            "host_work_ms": host_work(spent) * per_step, "median_ms": float(np.median(step_walls)) * 1e3,
            "slowest_ms": max(step_walls) * 1e3}


def phases_note(replayed: dict) -> str:
    t = replayed["timed_steps"]
    return (f"a step: dispatch {t['dispatch_ms']:.2f}, read-back {t['read_back_ms']:.2f}, host {t['host_work_ms']:.2f} ms; "
            f"median {t['median_ms']:.2f}, slowest {t['slowest_ms']:.1f} ms")


def run_decode(llm, prompts, new_tokens, oracle=None, overlap=True, replayed=None):
    """Greedy decode; returns (seconds per decode step, output tokens per second,
    tokens, outputs). The clock runs over pure decode steps of the full batch: from the
    second step after every request has its first token (the first may compile its
    shape) until the first request finishes (after that the batch shrinks and new
    bucket shapes would compile inside the measurement). oracle: the tokens of an
    earlier plain run, one list per prompt, which replace the MTP module's drafts inside
    the step (engine.oracle_tokens), with async or sync scheduling as the plain runs.
    replayed: a dict that gets "device_step_s", the last timed (full-batch) step replayed
    alone, taken when the clock stops (later steps have fewer requests), and "timed_steps":
    the timed steps' host phases in ms a step (the compiled calls' dispatch, the read-back,
    which waits for the device, and the host's own work) and their median and slowest
    wall time, which tell a steady host cost from a one-off stall."""
    import jax

    from timing import runner_phases

    from jaxmtp import SamplingParams
    from jaxmtp.engine.sampling_params import RequestOutputKind

    engine = llm.engine
    set_async(llm, overlap)
    for i, p in enumerate(prompts):
        # greedy ignores the seed; it names the request's row of the oracle table. One
        # output when a request finishes, as LLM.generate asks for: a cumulative output
        # every step copies each request's tokens so far, work that neither generate nor
        # the server's deltas do (benchmarks/host.py measures both kinds)
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, seed=i,
                                                      stop=STOP_STRINGS, output_kind=RequestOutputKind.FINAL_ONLY))
    engine.oracle_tokens = oracle

    outputs = {}

    def produced():  # output tokens so far, finished requests included
        running = sum(len(s.output_token_ids) for r in engine.requests.values() for s in r.seqs)
        return running + sum(len(o.outputs[0].token_ids) for o in outputs.values())

    start = elapsed = None
    decode_steps_seen = tokens_at_start = tokens_timed = steps = 0
    step_walls, spent_at_start = [], {}
    with runner_phases(engine) as spent:
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            finished = [out for out in engine.step() if out.finished]
            for out in finished:
                outputs[out.request_id] = out
            if start is not None and elapsed is None:
                steps += 1
                step_walls.append(time.perf_counter() - step_start)
                if finished:
                    elapsed = time.perf_counter() - start
                    tokens_timed = produced() - tokens_at_start
                    if replayed is not None:
                        spent = collections.Counter(spent)
                        spent.subtract(spent_at_start)
                        spent["whole"] = elapsed
                        replayed["timed_steps"] = timed_steps(spent, step_walls)
                        replayed["device_step_s"] = device_step_time(engine, 20)
            elif start is None and len(engine.requests) == len(prompts) and all(
                s.output_token_ids for r in engine.requests.values() for s in r.seqs
            ):
                decode_steps_seen += 1
                if decode_steps_seen == 2:
                    jax.block_until_ready(engine.cache.k[0])
                    start = time.perf_counter()
                    spent_at_start = dict(spent)
                    tokens_at_start = produced()
    engine.oracle_tokens = None
    set_async(llm, True)
    ordered = [outputs[f"r{i}"] for i in range(len(prompts))]
    tokens = [o.outputs[0].token_ids for o in ordered]
    if elapsed is None:  # a warm-up run too short to reach full-batch decode steps
        return None, None, tokens, ordered
    return elapsed / steps, tokens_timed / elapsed, tokens, ordered


def last_step_replay(engine):
    """A function that runs the engine's last read-back step again on its batch (the
    cache donated and kept) and returns the tokens to wait on: timing.replay_time's step."""
    def replay():
        return engine.runner.replay(engine.last_step).tokens

    return replay


def device_step_time(engine, repeats: int = 50) -> float:
    """The engine's last decode step replayed back to back (queued, one wait at the end):
    device time without the host's scheduling, batch building and read-back."""
    from timing import replay_time

    return replay_time(last_step_replay(engine), repeats, warmup=5)


def robust_greedy_weights(params):
    """The dummy weights changed so that the greedy path no longer depends on the step's
    shape: each layer's output projections scaled by 1e-3 and the LM head tied to the
    embedding, so the last token's embedding dominates the final hidden state and its
    argmax (it repeats the last prompt token) wins by a wide margin. Random bf16 weights
    put near-ties everywhere, and a verify step (batch x (k+1) rows) rounds differently
    from a plain one (batch rows), so a plain run's tokens would not be the oracle for
    the spec run. A step costs the same whatever the weights' values; the MTP module is
    left random. Expert layers have their routed and shared experts' down projections
    scaled instead of the dense one. An fp8 weight has its scales scaled."""
    from jaxmtp.models.params import Fp8Weight

    def small(w):
        if isinstance(w, Fp8Weight):
            return dataclasses.replace(w, scale_inv=w.scale_inv * 1e-3)
        return None if w is None else w * 1e-3

    def scaled(layer):
        if layer.moe is None:
            return dataclasses.replace(layer, o_proj=small(layer.o_proj), down_proj=small(layer.down_proj))
        moe = dataclasses.replace(layer.moe, experts_down=small(layer.moe.experts_down),
                                  shared_down=small(layer.moe.shared_down))
        return dataclasses.replace(layer, o_proj=small(layer.o_proj), moe=moe)

    return dataclasses.replace(params, layers=[scaled(layer) for layer in params.layers], lm_head=params.embed.T)


# Stop strings every decode request carries, so that checking them is part of the host's
# work; random enough never to match the dummy model's output.
STOP_STRINGS = ["\n\nQ7#zv", "</answer-xk>"]


def write_bpe_tokenizer(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer.json with vocab_size tokens (a real tokenizer's decode
    and detokenisation cost, as Llama 3's 128k vocabulary has): the 256 byte tokens,
    then merges of two random earlier tokens up to 12 characters, then two specials."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokens, merges, rng = list(vocab), [], random.Random(seed)
    while len(vocab) < vocab_size - 2:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if len(a) + len(b) <= 12 and a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            tokens.append(a + b)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(str(folder / "tokenizer.json"))


class Bench:
    """One run: the results, the budget, the model folder and one engine alive at a time."""

    def __init__(self, args, results, t0):
        import numpy as np

        self.args, self.results, self.t0 = args, results, t0
        sizes = TINY_SIZES if args.tiny else Sizes()
        chosen = {k: v for k, v in (("batches", args.batches), ("contexts", args.contexts)) if v}
        self.sizes = dataclasses.replace(sizes, **chosen)
        self.rng = np.random.default_rng(0)
        self.out_dir = Path(os.environ.get("OUT", args.out))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.current = {}
        self.use_quantization("none")

    def use_quantization(self, quantization: str) -> None:
        """The model of the scenarios that follow: its linear weights in the model's dtype
        (none) or in DeepSeek's block-scaled fp8 (fp8, whose rows are named "fp8: ...")."""
        self.quantization = quantization
        self.config = TINY if self.args.tiny else LLAMA3_8B
        if quantization == "fp8":
            self.config = {**self.config, "quantization_config": FP8_BLOCK_SCALED}
        self.folder = self.model_folder(self.config)
        self.memo = {}  # figures one scenario leaves for another (plain tokens/s, ...)

    @staticmethod
    def model_folder(config: dict, tokenizer: str | None = None) -> str:
        """A folder of the config and a tokenizer: the given tokenizer.json (a real
        model's), else write_bpe_tokenizer's of the config's vocabulary size."""
        folder = tempfile.mkdtemp()
        Path(folder, "config.json").write_text(json.dumps(config))
        if tokenizer is None:
            write_bpe_tokenizer(Path(folder), config["vocab_size"])
        else:
            shutil.copyfile(tokenizer, Path(folder, "tokenizer.json"))
        return folder

    def save(self):
        (self.out_dir / f"e2e{self.args.tag}.json").write_text(json.dumps(self.results, indent=1))

    def row(self, name, value, unit, floor=None, peer=None, target="", note=""):
        name = name if self.quantization == "none" else f"{self.quantization}: {name}"
        self.results["rows"].append({"scenario": name, "value": value, "unit": unit, "floor_ratio": floor,
                                     "peer_ratio": peer, "target": target, "note": note})
        print(f"[{time.perf_counter() - self.t0:6.0f}s] {name}: {value:.4g} {unit} floor={floor} peer={peer} "
              f"{target} {note}", flush=True)
        self.save()

    def budget_left(self):
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def engine(self, robust: bool = False, folder: str | None = None, **kwargs):
        """An engine on the dummy model (of folder, default the benchmark's); robust:
        with robust_greedy_weights."""
        from jaxmtp import LLM
        from jaxmtp.models.registry import load_config

        self.current.clear()
        gc.collect()
        kwargs.setdefault("num_pages", 2400 if not self.args.tiny else 400)
        folder = folder or self.folder
        context = load_config(folder).max_position_embeddings
        llm = LLM(folder, load_format="dummy", max_model_len=context - 200, **kwargs)
        if robust:
            llm.engine.runner.replace_params(robust_greedy_weights(llm.engine.params))
        self.current["llm"] = llm
        return llm

    def prompts(self, n, length):
        # random token prompts, drawn here: jaxmtp.bench pulls in the server, and the GPU
        # image has no fastapi
        return [self.rng.integers(3, self.config["vocab_size"], size=length).tolist() for _ in range(n)]

    def floor_s(self, batch, context):
        """Memory floor of one decode step: weights plus the batch's KV, at the copy rate."""
        cfg = self.config
        kv_token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
        return (self.results["weight_bytes"] + kv_token_bytes * batch * context) / self.results["bandwidth"]


# ----- scenarios ------------------------------------------------------------------------


def scenario_b1(bench: Bench) -> None:
    s = bench.sizes
    # robust weights: the plain run's tokens are the MTP runs' oracle (scenario_mtp)
    plain = bench.engine(robust=True, max_num_seqs=1, max_num_batched_tokens=s.prompt)
    prompt = bench.prompts(1, s.prompt)
    t = time.perf_counter()
    run_decode(plain, prompt, 8)
    bench.results["b1_first_run_with_compiles_s"] = time.perf_counter() - t
    timed = {}
    step_s, _, tokens, _ = run_decode(plain, prompt, s.new_tokens, replayed=timed)
    floor = bench.floor_s(1, s.prompt + s.new_tokens // 2)
    peer = bench.results["peer"].get("b1_dynamic")
    bench.row(f"b1 decode (prompt {s.prompt}, {s.new_tokens} tokens), async scheduling", step_s * 1e3,
              "ms/token", floor / step_s, peer=ratio(1 / step_s, peer),
              target=">= 0.85 of floor; >= 10x transformers dynamic cache",
              note="; ".join(filter(None, [versus("transformers static cache (torch.compile)", 1 / step_s,
                                                  bench.results["peer"].get("b1_static")), phases_note(timed)])))
    sync_s, _, sync_tokens, _ = run_decode(plain, prompt, s.new_tokens, overlap=False)
    bench.row("b1 decode, sync scheduling (read each step before the next)", sync_s * 1e3, "ms/token",
              floor / sync_s, note=f"same tokens as async: {sync_tokens == tokens}")
    device_s = device_step_time(plain.engine)
    bench.row("b1 decode, jitted step alone (replayed)", device_s * 1e3, "ms/token", floor / device_s,
              note=f"host share of the async step {100 * (1 - device_s / step_s):.0f}%")
    bench.memo["b1"] = {"step_s": step_s, "tokens": tokens, "prompt": prompt}
    bench.results["hlo_cache_copies_b1_plain"] = len(plain.engine.runner.cache_copies(plain.engine.runner.buckets.shape_for(1, 1)))


def scenario_mtp(bench: Bench) -> None:
    """MTP at batch 1: the random head (acceptance ~0: pure overhead, async scheduling)
    and oracle drafts (acceptance 1: the ceiling), both with async scheduling as the
    plain run they are compared with. The engine code path is the same; only the draft
    tokens differ. Weights: robust_greedy_weights, as the plain b1 run's (random bf16
    weights let a k=3 run's greedy path part from the plain one's at a near-tie, which
    then is no oracle: 2026-12-03, docs/benchmarks/2026-12-03_H200_issue30.md)."""
    s = bench.sizes
    if "b1" not in bench.memo:
        scenario_b1(bench)
    base = bench.memo["b1"]
    for k in bench.args.mtp_k:
        if bench.budget_left() < 60:
            break
        spec = bench.engine(robust=True, max_num_seqs=1, max_num_batched_tokens=s.prompt, num_speculative_tokens=k)
        run_decode(spec, base["prompt"], 8)
        replayed, o_replayed = {}, {}
        step_s, _, toks, outs = run_decode(spec, base["prompt"], s.new_tokens, replayed=replayed)
        acc = outs[0].spec_stats["mean_acceptance_length"]
        target = "<= 1.15x a plain step" if k == 1 else ""
        bench.row(f"b1 MTP k={k} random head: step time / plain step", step_s / base["step_s"], "x",
                  target=target, note=f"acceptance length {acc:.2f}; {step_s * 1e3:.2f} ms/step (replayed alone "
                  f"{replayed['device_step_s'] * 1e3:.2f}); tokens/s {acc / step_s * base['step_s']:.2f}x plain; "
                  f"output equal to plain: {toks == base['tokens']}; {phases_note(replayed)}")
        if k == 2 and bench.results.get("hlo_cache_copies_b1_k2") is None:
            bench.results["hlo_cache_copies_b1_k2"] = len(spec.engine.runner.cache_copies(spec.engine.runner.buckets.shape_for(3, 1)))
        step_s, tps, toks, outs = run_decode(spec, base["prompt"], s.new_tokens, oracle=base["tokens"],
                                             replayed=o_replayed)
        acc = outs[0].spec_stats["mean_acceptance_length"]
        target = {1: ">= 1.85x", 3: ">= 3.0x"}.get(k, "")
        bench.row(f"b1 MTP k={k} oracle drafts: tokens/s / plain tokens/s (both async)",
                  acc / step_s * base["step_s"], "x", target=target,
                  note=f"acceptance length {acc:.2f}; {step_s * 1e3:.2f} ms/step (replayed alone "
                       f"{o_replayed['device_step_s'] * 1e3:.2f}); output equal to plain: {toks == base['tokens']}; "
                       f"{phases_note(o_replayed)}")


def scenario_mtp32(bench: Bench) -> None:
    """Plain, MTP random head and MTP oracle drafts at batch 32 (prompt 512; --mtp32-batches
    adds others): the random head's drafts are all rejected and the oracle's all accepted,
    so the two steps show whether the acceptance pattern costs anything. Every figure is
    against the plain engine of the same batch in this run, async scheduling throughout,
    with each full-batch step also replayed alone (device time). The batch-32 plain row is
    also compared with transformers' static cache. Weights: see robust_greedy_weights
    (the same step cost, a greedy path the oracle can follow)."""
    s = bench.sizes
    for batch in bench.args.mtp32_batches or [s.batches[1]]:
        if bench.budget_left() < 90:
            break
        prompts = bench.prompts(batch, s.prompt)
        # enough that the first request, at k + 1 tokens a step once drafts are accepted,
        # outlasts the prefill of the last one (the clock runs over full-batch steps only)
        prefill_steps = -(-batch * s.prompt // s.max_batched)
        new = s.batch_new_tokens * 2 + (max(bench.args.mtp32_k) + 1) * prefill_steps
        # nothing is preempted: every request's prompt, output and lookahead pages
        common = dict(max_num_seqs=batch, max_num_batched_tokens=s.max_batched,
                      num_pages=max(2400, batch * -(-(s.prompt + new + 32) // 16) + 64))
        plain = bench.engine(robust=True, **common)
        run_decode(plain, prompts, 8)
        replayed = {}
        step_s, tps, tokens, _ = run_decode(plain, prompts, new, replayed=replayed)
        plain_device_s = replayed["device_step_s"]
        sync_s, sync_tps, _, _ = run_decode(plain, prompts, new, overlap=False)
        peer = bench.results["peer"] if batch == 32 else {}
        bench.row(f"b{batch} decode (prompt {s.prompt}), async", tps, "tokens/s",
                  bench.floor_s(batch, s.prompt + new // 2) / step_s, peer=ratio(tps, peer.get("b32_static")),
                  target=">= 0.75 of floor; >= 2.5x transformers static cache" if batch == 32 else "",
                  note="; ".join(filter(None, [f"{step_s * 1e3:.2f} ms/step (replayed alone {plain_device_s * 1e3:.2f}); "
                                               f"sync {sync_tps:.0f} tokens/s",
                                               versus("transformers dynamic cache", tps, peer.get("b32_dynamic"))])))
        for k in bench.args.mtp32_k:
            if bench.budget_left() < 90:
                break
            mtp32_rows(bench, batch, k, prompts, new, common, step_s, tps, plain_device_s, tokens)


# The issue-30 targets against the plain step of the same run, by (batch, k).
MTP32_TARGETS = {"random": {(32, 1): "<= 1.12x", (32, 3): "<= 1.25x"},
                 "oracle": {(32, 1): ">= 1.8x", (32, 3): ">= 3.3x", (128, 1): ">= 1.6x"}}


def mtp32_rows(bench: Bench, batch, k, prompts, new, common, step_s, tps, plain_device_s, tokens) -> None:
    """One MTP engine's rows for scenario_mtp32: the random head's step and the oracle's
    tokens/s over the plain engine's, and the all-accepted step over the all-rejected one."""
    spec = bench.engine(robust=True, num_speculative_tokens=k, **common)
    run_decode(spec, prompts, 8)
    replayed = {}
    r_step, r_tps, _, outs = run_decode(spec, prompts, new, replayed=replayed)
    acc = sum(o.spec_stats["mean_acceptance_length"] for o in outs) / len(outs)
    bench.row(f"b{batch} MTP k={k} random head: step time / plain step", r_step / step_s, "x",
              target=MTP32_TARGETS["random"].get((batch, k), ""),
              note=f"acceptance length {acc:.2f}; {r_step * 1e3:.2f} ms/step vs {step_s * 1e3:.2f}; replayed alone "
                   f"{replayed['device_step_s'] * 1e3:.2f} vs {plain_device_s * 1e3:.2f} ms "
                   f"({replayed['device_step_s'] / plain_device_s:.3f}x); tokens/s {r_tps / tps:.3f}x plain; "
                   f"{phases_note(replayed)}")
    o_replayed = {}
    o_step, o_tps, o_tokens, outs = run_decode(spec, prompts, new, oracle=tokens, replayed=o_replayed)
    acc = sum(o.spec_stats["mean_acceptance_length"] for o in outs) / len(outs)
    bench.row(f"b{batch} MTP k={k} oracle drafts: tokens/s / plain (both async)", o_tps / tps, "x",
              target=MTP32_TARGETS["oracle"].get((batch, k), ""),
              note=f"acceptance length {acc:.2f}; {o_step * 1e3:.2f} ms/step (replayed alone "
                   f"{o_replayed['device_step_s'] * 1e3:.2f}); output equal: {o_tokens == tokens}; {phases_note(o_replayed)}")
    bench.row(f"b{batch} MTP k={k}: all-accepted step / all-rejected step", o_step / r_step, "x", target="<= 1.0",
              note=f"replayed alone: {o_replayed['device_step_s'] / replayed['device_step_s']:.3f}x")


def scenario_batch(bench: Bench) -> None:
    s = bench.sizes

    def new_tokens(batch, context):  # enough to outlast the prefill of the last request
        return s.batch_new_tokens + -(-batch * context // s.max_batched)

    def pages_for(batch, context):
        return batch * (context + new_tokens(batch, context) + 16) // 16 + 64

    cfg = bench.config
    page_bytes = 16 * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    free = (bench.results.get("device_bytes_limit") or float("inf")) * 0.85 - bench.results["weight_bytes"]
    fits = {(b, c): pages_for(b, c) * page_bytes < free for b in s.batches for c in s.contexts}
    pages = max(pages_for(b, c) for (b, c), ok in fits.items() if ok)
    most = max(b for (b, _), ok in fits.items() if ok)
    llm = bench.engine(max_num_seqs=most, max_num_batched_tokens=s.max_batched, num_pages=pages)
    for context in s.contexts:
        for batch in s.batches:
            if bench.budget_left() < 40:
                return
            if not fits[batch, context]:
                bench.results.setdefault("not_run", []).append(
                    f"b{batch} context {context}: its KV cache ({pages_for(batch, context) * page_bytes / 1e9:.0f} GB) "
                    "and the weights do not fit in the device's memory")
                continue
            prompts = bench.prompts(batch, context)
            replayed = {}
            step_s, tps, _, _ = run_decode(llm, prompts, new_tokens(batch, context), replayed=replayed)
            floor = bench.floor_s(batch, context + new_tokens(batch, context) // 2)
            target = ">= 0.75 of floor" if batch == 32 else ""
            if batch == 128 and context == 1024:
                target = ">= 0.80 of floor"
            device_s = replayed["device_step_s"]
            bench.row(f"b{batch} decode, context {context}", tps, "tokens/s", floor / step_s, target=target,
                      note=f"{step_s * 1e3:.2f} ms/step; the step replayed alone {device_s * 1e3:.2f} ms "
                           f"({floor / device_s:.2f} of floor)")
            bench.row(f"b{batch} context {context}: async step / the same step replayed alone", step_s / device_s,
                      "x", target="<= 1.10", note="with a 128k-vocabulary tokenizer and stop strings")


def scenario_longctx(bench: Bench) -> None:
    """The same batch-32 decode with max_model_len 131072 (Llama 3.1's config, llama3 RoPE
    scaling) and with the benchmark's 9216: the page table follows the live context."""
    s = bench.sizes
    batch, context = (32, 1024) if not bench.args.tiny else (4, 32)
    long_config = {**bench.config, "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    steps = {}
    for name, folder in (("9216", bench.folder), ("131072", bench.model_folder(long_config))):
        if bench.budget_left() < 40:
            return
        new = s.batch_new_tokens + -(-batch * context // s.max_batched)
        llm = bench.engine(folder=folder, max_num_seqs=batch, max_num_batched_tokens=s.max_batched,
                           num_pages=batch * (context + new + 32) // 16 + 64)
        replayed = {}
        steps[name], _, _, _ = run_decode(llm, bench.prompts(batch, context), new, replayed=replayed)
        bench.row(f"b{batch} decode, context {context}, max_model_len {name}", steps[name] * 1e3, "ms/step",
                  note=f"replayed alone {replayed['device_step_s'] * 1e3:.2f} ms; table widths "
                       f"{llm.engine.runner.buckets.table_widths}")
    bench.row(f"b{batch} context {context}: step at max_model_len 131072 / at 9216", steps["131072"] / steps["9216"],
              "x", target="<= 1.05")


def scenario_prefill(bench: Bench) -> None:
    from jaxmtp import SamplingParams

    s = bench.sizes
    cfg = bench.config
    prompt = bench.prompts(1, s.prefill_prompt)
    n, layers, hidden = s.prefill_prompt, cfg["num_hidden_layers"], cfg["hidden_size"]
    # matmul FLOPs of every non-embedding weight per token, plus causal attention
    flops = 2 * bench.results["weight_bytes"] / 2 * n + 4 * layers * n * n / 2 * hidden
    for chunk in s.prefill_chunks:
        if bench.budget_left() < 40:
            return
        llm = bench.engine(max_num_seqs=1, max_num_batched_tokens=chunk, prefill_chunk_size=chunk,
                           num_pages=n // 16 + 64)
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate(prompt, greedy, use_tqdm=False)
        t = time.perf_counter()
        llm.generate(prompt, greedy, use_tqdm=False)
        ttft = time.perf_counter() - t
        bench.row(f"prefill {n} tokens, chunk {chunk}: TTFT", ttft * 1e3, "ms",
                  flops / bench.results["matmul_flops_per_s"] / ttft, note="share of the FLOP floor")


ONLINE_BUDGET_S = 240


def scenario_online(bench: Bench) -> None:
    """Poisson arrivals of requests with fixed-seed prompt and output lengths; the
    engine's shapes are compiled first (8 at a time). The loop and the TTFT / TPOT /
    ITL figures are `jaxmtp bench`'s (jaxmtp/bench): ITL is the gap between outputs,
    and the tokens of one MTP step are one output."""
    import numpy as np

    from jaxmtp import SamplingParams
    from jaxmtp.bench.offline import run_requests
    from jaxmtp.bench.stats import summarize

    s = bench.sizes
    # its warm-up compiles every shape (about 130 s cold on the H200), then about a minute of traffic
    if not bench.args.tiny and bench.budget_left() < ONLINE_BUDGET_S:
        bench.results.setdefault("skipped_over_budget", []).append("online")
        return
    llm = bench.engine(max_num_seqs=s.online_seqs, max_num_batched_tokens=s.online_batched,
                       num_pages=s.online_seqs * (s.online_prompt[1] + s.online_output[1]) // 16 + 64)
    engine = llm.engine
    t = time.perf_counter()
    shapes = engine.warmup(num_threads=8)
    bench.results["online_warmup"] = {"shapes": shapes, "seconds": time.perf_counter() - t}
    rng = np.random.default_rng(1)
    n = s.online_requests
    arrivals = np.cumsum(rng.exponential(1 / s.online_rate, size=n))
    prompt_lens = rng.integers(*s.online_prompt, size=n)
    output_lens = rng.integers(*s.online_output, size=n)
    prompts = [bench.prompts(1, int(length))[0] for length in prompt_lens]
    params = [SamplingParams(max_tokens=int(length), temperature=0.0, ignore_eos=True) for length in output_lens]
    times, total = run_requests(engine, prompts, params, arrivals)
    summary = summarize(times, total)
    bench.results["online"] = {
        "requests": n, "rate_per_s": s.online_rate, "duration_s": total,
        "output_tokens_per_s": summary["output_tokens_per_s"], "requests_per_s": summary["requests_per_s"],
        **{key: {p: summary[key][p] for p in ("p50", "p90", "p99")} for key in ("ttft_ms", "tpot_ms", "itl_ms")},
        "prompt_lengths": list(s.online_prompt), "output_lengths": list(s.online_output),
        "max_num_seqs": s.online_seqs,
    }
    o = bench.results["online"]
    bench.row(f"online: Poisson {s.online_rate}/s, {n} requests: output tokens/s", o["output_tokens_per_s"],
              "tokens/s", note=f"TTFT ms {fmt(o['ttft_ms'])}; TPOT ms {fmt(o['tpot_ms'])}; ITL ms {fmt(o['itl_ms'])}")


def scenario_startup(bench: Bench) -> None:
    """Engine start (load + warm-up of its shapes) in a fresh process: cold with an
    empty persistent compilation cache, then warm from it."""
    script = (
        "import sys, time, jax\n"
        "jax.config.update('jax_compilation_cache_dir', sys.argv[2])\n"
        "t = time.perf_counter()\n"
        "from jaxmtp import LLM\n"
        "llm = LLM(sys.argv[1], load_format='dummy', max_num_seqs=1, max_num_batched_tokens=32, num_pages=256,"
        " max_model_len=2048)\n"
        "shapes = llm.engine.warmup()\n"
        "print('STARTUP', time.perf_counter() - t, shapes)\n"
    )
    cache = tempfile.mkdtemp()
    for kind in ("cold", "warm"):
        if bench.budget_left() < 60:
            return
        out = subprocess.run([sys.executable, "-c", script, bench.folder, cache], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"})
        line = [x for x in out.stdout.splitlines() if x.startswith("STARTUP")]
        if not line:
            bench.results[f"startup_{kind}_error"] = out.stderr[-1500:]
            return
        seconds, shapes = float(line[0].split()[1]), int(line[0].split()[2])
        bench.row(f"start-up, {kind} compilation cache ({shapes} shapes)", seconds, "s")


SCENARIOS = {"b1": scenario_b1, "longctx": scenario_longctx, "mtp": scenario_mtp, "mtp32": scenario_mtp32, "batch": scenario_batch,
             "prefill": scenario_prefill, "online": scenario_online, "startup": scenario_startup}


def fmt(p: dict) -> str:
    return "/".join(f"{v:.1f}" for v in p.values()) + " (p50/p90/p99)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--scenarios", default="peer,b1,mtp",
                        help="comma list of: peer, checks, " + ", ".join(SCENARIOS))
    parser.add_argument("--tag", default="", help="suffix of the output files (e2e<tag>.json/.md)")
    parser.add_argument("--peer-runs", default=None, help="comma list of the peer's runs (default: all)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model and workload")
    parser.add_argument("--batches", type=lambda x: tuple(int(b) for b in x.split(",")), default=None,
                        help="batch sizes of the batch scenario (default: 1,32,128,256)")
    parser.add_argument("--contexts", type=lambda x: tuple(int(c) for c in x.split(",")), default=None,
                        help="contexts of the batch scenario (default: 1024,4096)")
    parser.add_argument("--mtp-k", type=lambda x: [int(k) for k in x.split(",")], default=[1, 2, 3],
                        help="speculative tokens of the mtp scenario's runs (default: 1,2,3)")
    parser.add_argument("--mtp32-k", type=lambda x: [int(k) for k in x.split(",")], default=[1, 3],
                        help="speculative tokens to measure at batch 32")
    parser.add_argument("--mtp32-batches", type=lambda x: [int(b) for b in x.split(",")], default=None,
                        help="batch sizes of the mtp32 scenario (default: 32)")
    parser.add_argument("--quantization", type=quantizations, default=["none"],
                        help="comma list of none and fp8 (the model's linear weights in DeepSeek's block-scaled "
                             "fp8), each running every scenario; both: fp8's speed-up rows too (default: none)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    chosen = [x for x in args.scenarios.split(",") if x]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "command": "python benchmarks/e2e.py " + " ".join(sys.argv[1:]), "rows": []}
    peer_budget = args.budget_s if chosen == ["peer"] else args.budget_s / 3
    results["peer"] = run_peer(peer_budget, args.peer_runs) if "peer" in chosen and not args.tiny else {}
    results["torch_copy_bytes_per_s"] = None if args.tiny else torch_copy_bandwidth()
    print("peer", results["peer"], "torch copy", results["torch_copy_bytes_per_s"], flush=True)

    import jax

    # shapes compiled by one scenario are loaded, not compiled, by the next
    jax.config.update("jax_compilation_cache_dir", str(ROOT / ".xla_cache"))
    results["device"] = jax.devices()[0].device_kind
    results["device_bytes_limit"] = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    results["jax"], results["xla_flags"] = jax.__version__, os.environ.get("XLA_FLAGS", "")
    results.update(measure_floors(args.tiny))
    results["bandwidth"] = results["torch_copy_bytes_per_s"] or results["jax_copy_bytes_per_s"]
    bench = Bench(args, results, t0)
    if "checks" in chosen:
        gpu_checks(results)
    from jaxmtp.loading.loader import load_params  # noqa: F401  (import before timing)

    for quantization in args.quantization:
        bench.use_quantization(quantization)
        probe = bench.engine(max_num_seqs=1, max_num_batched_tokens=8)
        results["weight_bytes"] = weight_bytes(probe.engine.params)
        results.setdefault("weight_bytes_by_quantization", {})[quantization] = results["weight_bytes"]
        for name in chosen:
            if name in SCENARIOS and bench.budget_left() > 30:
                SCENARIOS[name](bench)
            elif name in SCENARIOS:
                results.setdefault("skipped_over_budget", []).append(f"{name} ({quantization})")
    bench.quantization = "none"
    if len(args.quantization) > 1:
        speedup_rows(bench)
    bench.save()
    (bench.out_dir / f"e2e{args.tag}.md").write_text(markdown(results))
    print_table(results)


def quantizations(value: str) -> list[str]:
    chosen = value.split(",")
    if not chosen or set(chosen) - {"none", "fp8"} or len(set(chosen)) < len(chosen):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma list of none and fp8, each once")
    return chosen


# units where a smaller value is faster, and where a larger one is
TIMES, RATES = {"ms/token", "ms/step", "ms", "s"}, {"tokens/s"}


def speedup_rows(bench: Bench) -> None:
    """fp8's speed-up over the model's dtype on every row the two runs share: the time of
    the dtype over fp8's, or fp8's rate over the dtype's."""
    plain = {r["scenario"]: r for r in bench.results["rows"] if not r["scenario"].startswith("fp8: ")}
    for r in [r for r in bench.results["rows"] if r["scenario"].startswith("fp8: ")]:
        base = plain.get(r["scenario"][5:])
        if base is None or base["unit"] != r["unit"] or r["unit"] not in TIMES | RATES or not r["value"]:
            continue
        speedup = base["value"] / r["value"] if r["unit"] in TIMES else r["value"] / base["value"]
        bench.row(f"fp8 speed-up over bf16: {base['scenario']}", speedup, "x",
                  note=f"bf16 {base['value']:.4g} {base['unit']}, fp8 {r['value']:.4g}")


def run_peer(budget_s: float, only: str | None = None) -> dict:
    """transformers on the same GPU; only: a comma list of PEER_SCRIPT's plan names."""
    peer = subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, json.dumps(LLAMA3_8B), str(budget_s)] + ([only] if only else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        peer_out, _ = peer.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        peer.kill()
        peer_out, _ = peer.communicate()
    peer_json = [line for line in peer_out.splitlines() if line.startswith("PEER_JSON ")]
    if peer_json:
        return json.loads(peer_json[-1][10:])
    partial = dict(line.split(" ", 1) for line in peer_out.splitlines() if line.startswith("b"))
    return {k: float(v) if v.replace(".", "", 1).isdigit() else v for k, v in partial.items()} | {
        "error": peer_out[-1500:]}


def greedy_runs(config: dict, prompts, engines: dict) -> dict:
    """{name: outputs} of greedy runs (32 tokens, logprobs) of a dummy-weight model of
    `config`, one per engines[name] (LLM options)."""
    from jaxmtp import LLM, SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(config))
        return {name: LLM(folder, load_format="dummy", max_num_seqs=4, max_num_batched_tokens=256,
                          prefill_chunk_size=100, **options).generate(prompts, params, use_tqdm=False)
                for name, options in engines.items()}


def agreement(ours, theirs) -> dict:
    """Greedy paths of a random model part at near-ties: the tokens equal up to the first
    difference, and the largest difference of a token's logprob on the shared prefix."""
    agree, diffs = [], []
    for a, b in zip(ours, theirs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        agree.append(n)
        diffs += [abs(next(iter(a.outputs[0].logprobs[i].values())).logprob
                      - next(iter(b.outputs[0].logprobs[i].values())).logprob)
                  for i in range(min(n + 1, len(ta)))]
    return {"tokens_equal_before_first_difference": agree, "of": len(ours[0].outputs[0].token_ids),
            "max_logprob_diff_on_shared_prefix": float(max(diffs))}


def gpu_checks(results) -> None:
    """The stories260K golden output; a small bf16 model on the Pallas kernels against
    the reference path (MTP k=2, chunked prefill); two layers of the 8B shape in fp8 (the
    shapes kernels/fp8_tilings.json measured, so the table's fp8 paths run) against the
    reference path, and MTP k=2 against plain decoding on those paths."""
    import numpy as np

    from jaxmtp import LLM, SamplingParams

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import STORIES, golden_ids

    stories = LLM(STORIES, max_num_seqs=1, max_num_batched_tokens=64)
    got = stories.generate([[1]], SamplingParams(max_tokens=200, temperature=0.0), use_tqdm=False)[0].outputs[0].token_ids
    results["stories_golden_on_gpu"] = got == golden_ids()
    prompts = [np.random.default_rng(i).integers(3, 4096, size=n).tolist() for i, n in enumerate((37, 300, 5))]
    small = {**LLAMA3_8B, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
             "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096}
    backends = {backend: {"attention_backend": backend, "num_speculative_tokens": 2} for backend in ("pallas", "reference")}
    runs = greedy_runs(small, prompts, backends)
    results["bf16_pallas_vs_reference"] = agreement(runs["pallas"], runs["reference"])
    fp8 = {**LLAMA3_8B, "num_hidden_layers": 2, "vocab_size": 4096, "quantization_config": FP8_BLOCK_SCALED}
    runs = greedy_runs(fp8, prompts, {**backends, "pallas_plain": {"attention_backend": "pallas"}})
    results["fp8_pallas_vs_reference"] = agreement(runs["pallas"], runs["reference"])
    results["fp8_pallas_mtp_k2_vs_plain"] = agreement(runs["pallas"], runs["pallas_plain"])
    print("correctness", {k: results[k] for k in ("stories_golden_on_gpu", "bf16_pallas_vs_reference",
                                                  "fp8_pallas_vs_reference", "fp8_pallas_mtp_k2_vs_plain")},
          flush=True)


def ratio(ours, peer):
    return round(ours / peer, 3) if isinstance(peer, (int, float)) and peer else None


def versus(label: str, ours, peer) -> str:
    """'vs <label> <ratio>x', or nothing where the peer did not run."""
    r = ratio(ours, peer)
    return "" if r is None else f"vs {label} {r}x"


def markdown(results) -> str:
    bw = results.get("bandwidth") or 0
    head = (f"# End-to-end benchmark\n\n{results['date']}, {results.get('device')}, jax {results.get('jax')}; "
            f"copy bandwidth {bw / 1e12:.2f} TB/s (torch d2d, same run), "
            f"bf16 matmul {results.get('matmul_flops_per_s', 0) / 1e12:.0f} TFLOP/s (JAX, same run); "
            f"command: `{results['command']}`\n\n")
    lines = ["| scenario | value | unit | share of floor | ratio to peer | target | note |",
             "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        share = f"{r['floor_ratio']:.3f}" if r["floor_ratio"] is not None else ""
        lines.append(f"| {r['scenario']} | {r['value']:.4g} | {r['unit']} | {share} | {r['peer_ratio'] or ''} | "
                     f"{r['target']} | {r['note']} |")
    keys = [k for k in results if k.startswith(("hlo_", "online", "b1_first", "startup", "skipped", "stories",
                                                "bf16"))]
    extra = (f"\n\nPeer (transformers, same GPU, random weights, greedy, prompt 512, 64 new tokens at batch 1 "
             f"and 32 at batch 32 ; static cache compiled by generate itself, tokens/s): "
             f"{results.get('peer')}\n\n" + "\n".join(f"- {k}: {results[k]}" for k in keys) + "\n")
    return head + "\n".join(lines) + extra


def print_table(results) -> None:
    print("\n" + markdown(results))


if __name__ == "__main__":
    main()
