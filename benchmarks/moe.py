"""MoE and MLA on one NVIDIA H200: the grouped-matmul and MLA attention kernels alone, and a
Moonlight-16B-A3B-shaped DeepSeek-V3 model end to end, against floors measured in the
same run (device copy bandwidth, bf16 matmul rate) and against torch on the same GPU.

    python benchmarks/moe.py --tag _a                          # everything
    python benchmarks/moe.py --parts checks,experts,mla --sweep  # kernels, with tilings
    python benchmarks/moe.py --parts e2e --models glm45_air_fp8  # one model end to end
    python benchmarks/moe.py --tiny                            # CPU smoke test

Parts, in this order: checks (the compiled kernels against their references on the
GPU), experts (the routed-expert layer at 1..8192 tokens and its gate/up projection
alone: ours, XLA's ragged_dot, JAX's Mosaic GPU ragged dot, torch._grouped_mm), mla
(the absorbed kernel over the latent cache: decode and verify at batch 1/32/128 and
context 1k/4k/16k, and an 8k prompt's first and last 2048-row prefill chunks, against
F.scaled_dot_product_attention over expanded K/V), e2e (per --models, the
Moonlight-shaped model and a GLM-4.5-Air-FP8-shaped one, from their config.json, with
dummy weights: batch-1 and batch-32 decode against their bytes floors, MTP k=1 with
oracle drafts, an 8k prompt's time to first token in 2048-token chunks against its FLOP
floor). Each timed program runs its kernel on several input sets (the weights
and pages together larger than L2), so dispatch is amortised and the cache cold.
Writes moe<tag>.json and .md under --out (default docs/benchmarks, file names dated) and
prints the table last; the experts part also writes expert_paths.json (the routed-expert
layer by pairs or sorted, per shape and pairs bucket): copy it to kernels/. The mla part
times the decode path the engine takes (kernels/mla_paths.json, which
benchmarks/mla_sweep.py writes), and the prefill chunks in both forms, absorbed and split
(kernels/mla_prefill.py, its prefix absorbed or expanded), writing mla_prefill_paths.json
(copy it to kernels/); --tiny runs the kernels in interpret mode on a tiny model.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch measures alongside

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import subprocess
import sys
import tempfile
import types
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
warnings.filterwarnings("ignore", category=DeprecationWarning)

MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
    "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446,
    "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "max_position_embeddings": 8192, "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "num_nextn_predict_layers": 1,
}
# zai-org/GLM-4.5-Air-FP8's config.json: GQA 96/8 heads of 128, half the head rotary,
# 128 experts top-8 plus a shared one, fp8 weights in 128 x 128 blocks
GLM_45_AIR_FP8 = json.loads((ROOT / "benchmarks" / "configs" / "GLM-4.5-Air-FP8.json").read_text())
TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512,
              "max_position_embeddings": 512}
# the end-to-end models: name -> (config.json, its tiny version for --tiny)
MODELS = {
    "moonlight": (MOONLIGHT, {**MOONLIGHT, **TINY_SIZES, "num_key_value_heads": 4, "kv_lora_rank": 32,
                              "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}),
    "glm45_air_fp8": (GLM_45_AIR_FP8, {**GLM_45_AIR_FP8, **TINY_SIZES, "num_key_value_heads": 2, "head_dim": 16,
                                       "eos_token_id": 2, "pad_token_id": 0,
                                       "quantization_config": {**GLM_45_AIR_FP8["quantization_config"],
                                                               "weight_block_size": [32, 16]}}),
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    experts: int = 64
    top_k: int = 6
    hidden: int = 2048
    inter: int = 1408
    expert_tokens: tuple = (1, 8, 32, 64, 256, 2048, 8192)
    step_rows: int = 8  # the engine's smallest token bucket (worker.batch.BucketPlan): a batch-1 decode step's rows
    gate_up_tokens: tuple = (1, 32, 256, 2048)
    paired_max_tokens: int = 64  # the layer by pairs (no sort) is timed against the sorted one up to here
    heads: int = 16
    rank: int = 512
    rope: int = 64
    nope: int = 128  # qk_nope_head_dim
    v_head: int = 128  # v_head_dim
    mla_batches: tuple = (1, 32, 128)
    mla_contexts: tuple = (1024, 4096, 16384)
    mla_prefill: tuple = ((2048, 2048), (2048, 8192))  # (chunk rows, context): an 8k prompt's first and last chunks
    page_size: int = 16
    prompt: int = 512
    new_tokens: int = 64
    batch: int = 32
    batch_prompt: int = 256
    batch_new_tokens: int = 24
    prefill_prompt: int = 8192  # the e2e part's long prompt (at most the model's context less one)
    prefill_chunk: int = 2048  # its chunks


TINY = Shapes(experts=8, top_k=2, hidden=32, inter=16, expert_tokens=(1, 8), gate_up_tokens=(8,), heads=4, rank=32,
              rope=16, nope=16, v_head=16, mla_batches=(2,), mla_contexts=(40,), mla_prefill=((12, 40),), page_size=8,
              prompt=24, new_tokens=8, batch=3, batch_prompt=16, batch_new_tokens=6, prefill_prompt=40,
              prefill_chunk=16)

PEER_SCRIPT = r"""
import json, sys, time, torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
spec = json.loads(sys.argv[1]); out = {}
def timed(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps): fn()
        end.record(); torch.cuda.synchronize(); times.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(times)[2]
E, K, H, I = spec["experts"], spec["top_k"], spec["hidden"], spec["inter"]
g = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
down = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
def gmm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)
def layer(x, experts, weights):
    flat = experts.flatten(); order = torch.argsort(flat, stable=True); row = order // K
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    up = gmm(x[row], gate_up, offs)
    act = F.silu(up[:, :I]) * up[:, I:]
    y = gmm(act, down, offs).float() * weights.flatten()[order][:, None]
    return torch.zeros(x.shape[0], H, device="cuda").index_add_(0, row, y).to(x.dtype)
for t in spec["expert_tokens"] + [-t for t in spec["gate_up_tokens"]]:
    n = abs(t)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    experts = torch.rand(n, E, device="cuda").topk(K, dim=1).indices
    weights = torch.rand(n, K, device="cuda")
    try:
        if t > 0:
            out[f"layer_{n}"] = timed(lambda: layer(x, experts, weights))
        else:
            flat = experts.flatten(); order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
            xs = x[order // K]
            out[f"gate_up_{n}"] = timed(lambda: gmm(xs, gate_up, offs))
    except Exception as e:
        out[f"{'layer' if t > 0 else 'gate_up'}_{n}"] = repr(e)[:300]
    print(t, out.get(f"layer_{n}") if t > 0 else out.get(f"gate_up_{n}"), flush=True)
del gate_up, down
Hq, Dn, Dr, Dv = spec["heads"], 128, spec["rope"], 128
for b, ctx, rows, prefill in spec["mla"]:
    try:
        q = torch.randn(b, Hq, rows, Dn + Dr, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, Hq, ctx, Dn + Dr, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, Hq, ctx, Dv, device="cuda", dtype=torch.bfloat16)
        mask = causal_lower_right(rows, ctx) if prefill else None  # a prefill chunk ends the context
        out[f"mla_{b}_{ctx}_{rows}"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps=10)
        del q, k, v
    except Exception as e:
        out[f"mla_{b}_{ctx}_{rows}"] = repr(e)[:300]
    torch.cuda.empty_cache()
print("PEER_JSON " + json.dumps(out))
"""


def run_peer(shapes: Shapes, mla_cases, budget_s=150) -> dict:
    spec = {**dataclasses.asdict(shapes), "mla": mla_cases}
    proc = subprocess.run([sys.executable, "-c", PEER_SCRIPT, json.dumps(spec)], capture_output=True, text=True,
                          timeout=budget_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEER_JSON ")]
    return json.loads(lines[-1][10:]) if lines else {"error": (proc.stdout + proc.stderr)[-1500:]}


def programs_over(fn, shared, reps):
    """Device seconds per call of fn(*shared, *rep) over the list of per-repetition
    inputs, all repetitions in one jitted program, the program's calls queued back to back
    (a wait per call would add the host's dispatch and wake-up to a layer of a few tens of
    microseconds; the engine runs it inside a step's program). Median of three replays."""
    import jax
    import numpy as np
    from timing import replay_time

    program = jax.jit(lambda shared, reps: [fn(*shared, *r) for r in reps])
    return float(np.median([replay_time(lambda: program(shared, reps), 10) for _ in range(3)])) / len(reps)


class Run:
    """The results, the floors and the budget of one run."""

    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.shapes = TINY if args.tiny else Shapes()
        self.out_dir = Path(os.environ.get("OUT", args.out))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                        "command": "python benchmarks/moe.py " + " ".join(sys.argv[1:]), "rows": [], "sweep": []}

    def budget_left(self):
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def save(self):
        (self.out_dir / f"moe{self.args.tag}.json").write_text(json.dumps(self.results, indent=1))

    def row(self, part, name, seconds, floor_s=None, peer_s=None, target="", note="", unit="us"):
        """One timed row: its share of the floor (floor time / time) and its speed over
        the peer's (peer time / time)."""
        value = seconds * 1e6 if unit == "us" else seconds
        peer = peer_s if isinstance(peer_s, (int, float)) else None
        row = {"part": part, "scenario": name, "value": value, "unit": unit,
               "floor_ratio": None if floor_s is None else floor_s / seconds,
               "peer_ratio": None if peer is None else peer / seconds, "target": target, "note": note}
        self.results["rows"].append(row)
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {part} {name}: {value:.4g} {unit} floor={row['floor_ratio']} "
              f"peer={row['peer_ratio']} {note}", flush=True)
        self.save()

    def bytes_s(self, nbytes):
        return nbytes / self.results["bandwidth"]

    def flops_s(self, flops):
        return flops / self.results["matmul_flops_per_s"]

    def write_paths(self, filename: str, part: str, paths: dict) -> None:
        """A path table in the form kernels/<filename> is read in, with its provenance."""
        note = f"benchmarks/moe.py --parts {part} on {self.results['device']}, {self.results['date']}, " \
               f"jax {self.results['jax']}"
        (self.out_dir / filename).write_text(json.dumps({"_note": note} | paths, indent=1))


# ----- checks ----------------------------------------------------------------------------


def relative_error(out, ref):
    import numpy as np

    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def hopper_check(loads: str, rows, gate_up, down, sizes, want_act, want_out) -> dict:
    """kernels/grouped_wgmma.py on the sorted rows, bf16 experts and fp8 ones (K-major,
    128 x 128 blocks), against the bf16 references: fp8 rounds the rows and weights to
    e4m3 (relative 2**-4 at most each), so its error is reported, not bounded here."""
    import numpy as np

    from jaxmtp.kernels.grouped_wgmma import GroupedWgmmaConfig, grouped_wgmma

    config = GroupedWgmmaConfig(128, 128, 64, 3)
    act = grouped_wgmma(rows, gate_up, sizes, config=config, swiglu=True)
    out = grouped_wgmma(act, down, sizes, config=config)
    (gate_up8, down8), _ = fp8_experts(gate_up, down, 128)
    fp8_config = GroupedWgmmaConfig(128, 64, 128, 3)
    act8 = grouped_wgmma(rows, gate_up8.weight, sizes, scale_inv=gate_up8.scale_inv, config=fp8_config, swiglu=True)
    out8 = grouped_wgmma(act8, down8.weight, sizes, scale_inv=down8.scale_inv, config=fp8_config)
    real = int(sizes.sum())
    return {"kernel": "hopper grouped swiglu + matmul (bf16; fp8 error beside)", "case": loads,
            "rel_err": max(relative_error(act[:real], want_act[:real]), relative_error(out[:real], want_out[:real])),
            "fp8_rel_err": max(relative_error(act8[:real], want_act[:real]),
                               relative_error(out8[:real], want_out[:real])),
            "finite": all(bool(np.isfinite(np.asarray(o, np.float32)).all()) for o in (out, out8)),
            "padding_rows_zero": bool((np.asarray(out, np.float32)[real:] == 0).all())}


def part_checks(run: Run):
    """The compiled kernels against their references on random bf16 inputs: ragged,
    empty experts, one expert taking every row, padding rows; MLA decode and verify over
    shuffled pages with a prefill sequence in the batch (whose rows must come out 0), and
    a prefill chunk beside decode rows (which must come out 0)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxmtp.kernels import grouped_matmul as gm
    from jaxmtp.kernels.mla_attention import mla_absorbed_attention
    from jaxmtp.kernels.mla_prefill import OwnRowsConfig
    from jaxmtp.kernels.mla_reference import mla_absorbed_attention_reference
    from jaxmtp.models.layers import rotate

    rng, s, interpret = np.random.default_rng(1), run.shapes, run.args.tiny
    checks = []
    for loads in ("ragged", "empty-experts", "one-expert", "padding"):
        rows = 6 * 300 if not run.args.tiny else 40
        sizes = rng.multinomial(rows, np.ones(s.experts) / s.experts)
        if loads == "empty-experts":
            sizes = np.zeros(s.experts, int)
            sizes[[1, s.experts - 2]] = rng.multinomial(rows, [0.3, 0.7])
        elif loads == "one-expert":
            sizes = np.zeros(s.experts, int)
            sizes[s.experts // 2] = rows
        elif loads == "padding":
            sizes = rng.multinomial(rows - 37, np.ones(s.experts) / s.experts)
        x = jnp.asarray(rng.standard_normal((rows // 2, s.hidden)), jnp.bfloat16)
        order = jnp.asarray(rng.integers(0, rows // 2, rows), jnp.int32)
        gate_up = jnp.asarray(0.05 * rng.standard_normal((s.experts, s.hidden, 2, s.inter)), jnp.bfloat16)
        down = jnp.asarray(0.05 * rng.standard_normal((s.experts, s.inter, s.hidden)), jnp.bfloat16)
        sizes = jnp.asarray(sizes, jnp.int32)
        act = gm.grouped_swiglu_kernel(x, gate_up, sizes, order, interpret=interpret)
        want = gm.grouped_swiglu_reference(x, gate_up, sizes, order)
        out = gm.grouped_matmul_kernel(act, down, sizes, interpret=interpret)
        want_out = gm.grouped_matmul_reference(act, down, sizes)
        pad_zero = bool((np.asarray(out, np.float32)[int(sizes.sum()):] == 0).all())
        checks.append({"kernel": "grouped swiglu + matmul", "case": loads,
                       "rel_err": max(relative_error(act, want), relative_error(out, want_out)),
                       "finite": bool(np.isfinite(np.asarray(out, np.float32)).all()), "padding_rows_zero": pad_zero})
        if not run.args.tiny:  # Mosaic GPU's interpreter would take minutes at these shapes
            checks.append(hopper_check(loads, x[order], gate_up, down, sizes, want, want_out))
    for rows_per_seq in (1, 2):
        case = mla_inputs(rng, s, [rows_per_seq] * 5 + [7], [300, 17, 1000, 64, 1, 500], reps=1)
        args = mla_args(case)
        out = np.asarray(mla_absorbed_attention(*args, sm_scale=0.1, decode_rows=rows_per_seq, interpret=interpret),
                         np.float32)
        ref = np.asarray(mla_absorbed_attention_reference(*args, sm_scale=0.1), np.float32)
        decode = 5 * rows_per_seq
        checks.append({"kernel": "mla decode", "case": f"{rows_per_seq} rows/seq + a 7-row prefill",
                       "rel_err": relative_error(out[:decode], ref[:decode]),
                       "finite": bool(np.isfinite(out).all()), "padding_rows_zero": bool((out[decode:] == 0).all())})
        # as the engine calls it: the query's rope part rotated in the kernel, from the whole
        # projection (a nope part of 128 before it), against the reference on the query
        # rotated first
        q_latent, q_pe, *cache = args
        angles = rng.uniform(0, 2 * np.pi, (q_pe.shape[0], q_pe.shape[-1] // 2))
        tables = tuple(jnp.asarray(f(angles), jnp.bfloat16) for f in (np.cos, np.sin))
        q_whole = jnp.concatenate([jnp.zeros((*q_pe.shape[:2], 128), q_pe.dtype), q_pe], axis=-1)
        out = np.asarray(mla_absorbed_attention(q_latent, q_whole, *cache, sm_scale=0.1, decode_rows=rows_per_seq,
                                                interpret=interpret, rope_tables=tables, rope_interleave=True),
                         np.float32)
        ref = np.asarray(mla_absorbed_attention_reference(q_latent, rotate(q_pe, *tables, True), *cache, sm_scale=0.1),
                         np.float32)
        checks.append({"kernel": "mla decode, rope in the kernel", "case": f"{rows_per_seq} rows/seq + a 7-row prefill",
                       "rel_err": relative_error(out[:decode], ref[:decode]),
                       "finite": bool(np.isfinite(out).all()), "padding_rows_zero": bool((out[decode:] == 0).all())})
    chunk, context = (s.mla_prefill[0][0] // 4, s.mla_prefill[0][1] // 2) if not run.args.tiny else s.mla_prefill[0]
    case = mla_inputs(rng, s, [1, chunk, 2, 1], [300, context, 64, 1], reps=1)
    args = mla_args(case)
    out = np.asarray(mla_absorbed_attention(*args, sm_scale=0.1, decode_rows=2, prefill=True, interpret=interpret),
                     np.float32)
    ref = np.asarray(mla_absorbed_attention_reference(*args, sm_scale=0.1), np.float32)
    rows = slice(1, 1 + chunk)
    others = np.delete(out, np.arange(1, 1 + chunk), axis=0)
    checks.append({"kernel": "mla prefill", "case": f"a {chunk}-row chunk at context {context} beside decode rows",
                   "rel_err": relative_error(out[rows], ref[rows]), "finite": bool(np.isfinite(out).all()),
                   "padding_rows_zero": bool((others == 0).all())})
    split = split_inputs(rng, s, case)
    q_latent = jnp.einsum("thd,rhd->thr", split["q_nope"], split["w_uk"])
    ref = np.asarray(jnp.einsum("thr,rhv->thv", mla_absorbed_attention_reference(q_latent, *args[1:], sm_scale=0.1),
                                split["w_uv"]), np.float32)
    # the prefix absorbed, and expanded in two passes
    for prefix, config in (("absorbed", OwnRowsConfig()), ("expanded", OwnRowsConfig(prefix_window=context // 2))):
        out = np.asarray(split_call(case, split, config=config, interpret=interpret, decode_rows=2), np.float32)
        others = np.delete(out, np.arange(1, 1 + chunk), axis=0)
        checks.append({"kernel": f"mla prefill, split form, prefix {prefix}", "case": f"a {chunk}-row chunk at "
                       f"context {context} beside decode rows", "rel_err": relative_error(out[rows], ref[rows]),
                       "finite": bool(np.isfinite(out).all()), "padding_rows_zero": bool((others == 0).all())})
    x, routing, _ = expert_inputs(rng, s, 300 if not run.args.tiny else 9, 1)
    from jaxmtp.models.moe import Routing, routed_experts

    kernels = dict(expert_swiglu=functools.partial(gm.grouped_swiglu_kernel, interpret=interpret),
                   expert_matmul=functools.partial(gm.grouped_matmul_kernel, interpret=interpret))
    references = dict(expert_swiglu=gm.grouped_swiglu_reference, expert_matmul=gm.grouped_matmul_reference)
    got, want = (routed_experts(x[0], Routing(*routing[0]), gate_up, down, **fns) for fns in (kernels, references))
    checks.append({"kernel": "routed experts layer", "case": "random routing", "rel_err": relative_error(got, want),
                   "finite": bool(np.isfinite(np.asarray(got, np.float32)).all()), "padding_rows_zero": True})
    run.results["checks"] = checks
    print("checks", checks, flush=True)
    run.save()
    engine_check(run)


def engine_check(run: Run):
    """A small DeepSeek-V3 engine (MLA, experts, one MTP layer, k=1), greedy, bf16, with
    the MLA kernel (decode and prefill rows) and with the jnp reference (the MoE kernel
    in both, on the GPU): tokens up to the first difference, and the logprobs of the
    shared prefix."""
    import numpy as np

    from jaxmtp import LLM, SamplingParams

    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(json.dumps(MODELS["moonlight"][1]))
    prompts = [np.random.default_rng(i).integers(3, 500, size=n).tolist() for i, n in enumerate((37, 90, 5))]
    runs = {}
    for backend in ("pallas_interpret" if run.args.tiny else "pallas", "reference"):
        llm = LLM(folder, load_format="dummy", attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=64,
                  num_speculative_tokens=1, num_pages=200)
        runs[backend] = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                             logprobs=0), use_tqdm=False)
        del llm
    agree, diffs = [], []
    for a, b in zip(*runs.values()):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        agree.append(n)
        # the sampled token's logprob at each step (logprobs=0: the only entry)
        diffs += [abs(a.outputs[0].logprobs[i][ta[i]].logprob - b.outputs[0].logprobs[i][tb[i]].logprob)
                  for i in range(min(n + 1, len(ta)))]
    run.results["engine_mla_kernel_vs_reference"] = {"tokens_equal_before_first_difference": agree, "of": 16,
                                                     "max_logprob_diff_on_shared_prefix": float(max(diffs))}
    print("engine check", run.results["engine_mla_kernel_vs_reference"], flush=True)
    run.save()


# ----- expert layer ----------------------------------------------------------------------


def expert_inputs(rng, s: Shapes, tokens: int, reps: int):
    import jax.numpy as jnp
    import numpy as np

    x = [jnp.asarray(rng.standard_normal((tokens, s.hidden)), jnp.bfloat16) for _ in range(reps)]
    experts = [np.argsort(rng.random((tokens, s.experts)), axis=1)[:, : s.top_k] for _ in range(reps)]
    touched = float(np.mean([len(np.unique(e)) for e in experts]))
    routing = [(jnp.asarray(e, jnp.int32), jnp.asarray(rng.random((tokens, s.top_k)), jnp.float32)) for e in experts]
    return x, routing, touched


def fp8_experts(gate_up, down, block: int) -> tuple[tuple, tuple]:
    """gate_up [E, H, 2, I] and down [E, I, H] quantized once as DeepSeek-V3's fp8 experts
    (jaxmtp.models.params.Fp8Weight, block x block scales), in two layouts: K-major, as
    the engine holds them on one device, and as loaded, as expert parallelism holds them."""
    import jax.numpy as jnp
    from fp8_sweep import quantize

    from jaxmtp.models.params import Fp8Weight

    loaded = []
    for w, b in zip((gate_up, down), ((1, block, 1, block), (1, block, block))):
        loaded.append(Fp8Weight(*quantize(w.astype(jnp.float32), b), b))
    k_major = tuple(dataclasses.replace(w, weight=jnp.moveaxis(w.weight, 1, -1), k_major=True) for w in loaded)
    return k_major, tuple(loaded)


def part_experts(run: Run):
    import jax.numpy as jnp
    import numpy as np

    from jaxmtp.kernels import grouped_matmul as gm
    from jaxmtp.kernels.tiling_table import row_bucket
    from jaxmtp.models.moe import Routing, dequantized, routed_experts, routed_experts_by_pair

    s, rng, interpret = run.shapes, np.random.default_rng(2), run.args.tiny
    peer = run.results["peer"]
    key_w = np.random.default_rng(3)
    gate_up = jnp.asarray(0.02 * key_w.standard_normal((s.experts, s.hidden, 2, s.inter)), jnp.bfloat16)
    down = jnp.asarray(0.02 * key_w.standard_normal((s.experts, s.inter, s.hidden)), jnp.bfloat16)
    expert_bytes = 3 * s.hidden * s.inter * 2

    def kernel(fn):
        return lambda *a, **kw: fn(*a, **kw, interpret=True)

    # the engine's entry points (the measured table's tilings) on the GPU, the kernels
    # interpreted on the CPU
    swiglu, matmul = ((kernel(gm.grouped_swiglu_kernel), kernel(gm.grouped_matmul_kernel)) if interpret
                      else (gm.grouped_swiglu, gm.grouped_matmul))

    def ours(gu, dn, x, routing):
        return routed_experts(x, Routing(*routing), gu, dn, expert_swiglu=swiglu, expert_matmul=matmul)

    def xla(gu, dn, x, routing):
        return routed_experts(x, Routing(*routing), gu, dn, expert_swiglu=gm.grouped_swiglu_reference,
                              expert_matmul=gm.grouped_matmul_reference)

    pair_kernels = dict(pair_swiglu=kernel(gm.paired_swiglu_kernel), pair_matmul=kernel(gm.paired_matmul_kernel)) \
        if interpret else {}

    def by_pair(gu, dn, x, routing):
        return routed_experts_by_pair(x, Routing(*routing), gu, dn, **pair_kernels)

    def dequantized_first(gu, dn, x, routing):  # moe_ffn's "dequantized" form, in every call
        return ours(dequantized(gu, jnp.bfloat16), dequantized(dn, jnp.bfloat16), x, routing)

    paths = {}  # expert_paths.json: the layer's fastest form (grouped_matmul.expert_path), per pairs bucket
    scale_k = 16 if run.args.tiny else 128
    fp8, fp8_loaded = fp8_experts(gate_up, down, scale_k) if run.args.fp8 else (None, None)

    def choose_form(forms: dict, weights, inputs, name, floor, scale_k=None):
        """forms: {form: seconds} timed so far; the paired form timed too up to
        paired_max_tokens; the fastest goes into the table."""
        if tokens <= s.paired_max_tokens:
            forms["paired"] = programs_over(by_pair, weights, inputs)
            run.row("experts", f"{name} by pairs, {tokens} tokens", forms["paired"], floor,
                    note=f"the sorted layer {forms['sorted'] * 1e6:.0f} us ({forms['sorted'] / forms['paired']:.2f}x "
                         f"this)")
        key = ",".join(map(str, (s.experts, s.hidden, s.inter) + ((scale_k,) if scale_k else ())))
        paths.setdefault(key, {})[str(row_bucket(tokens * s.top_k))] = min(forms, key=forms.get)

    for tokens in s.expert_tokens:
        if run.budget_left() < 60:
            run.results.setdefault("skipped_over_budget", []).append(f"experts {tokens}")
            continue
        reps = int(np.clip(2e8 // max(1, tokens * s.top_k * s.hidden * s.inter * 6), 2, 4))
        x, routing, touched = expert_inputs(rng, s, tokens, reps)
        nbytes = touched * expert_bytes + 2 * tokens * s.hidden * 2
        flops = 2 * tokens * s.top_k * 3 * s.hidden * s.inter
        floor = max(run.bytes_s(nbytes), run.flops_s(flops))
        t_ours = programs_over(ours, (gate_up, down), list(zip(x, routing)))
        t_xla = programs_over(xla, (gate_up, down), list(zip(x, routing)))
        target = "<= 1.3x bytes floor" if tokens <= 32 else (">= 50% of matmul rate" if tokens >= 2048 else "")
        run.row("experts", f"expert layer, {tokens} tokens", t_ours, floor, peer.get(f"layer_{tokens}"), target,
                note=f"{touched:.1f} experts touched, {nbytes / 1e6:.0f} MB, {flops / t_ours / 1e12:.0f} TFLOP/s, "
                     f"{nbytes / t_ours / 1e12:.2f} TB/s; XLA ragged_dot {t_xla * 1e6:.0f} us "
                     f"({t_xla / t_ours:.1f}x ours); torch {fmt_peer(peer.get(f'layer_{tokens}'))}")
        choose_form({"sorted": t_ours}, (gate_up, down), list(zip(x, routing)), "expert layer", floor)
        if run.args.fp8:  # the same layer with its experts in fp8 (128 x 128 block scales)
            t_fp8 = programs_over(ours, fp8, list(zip(x, routing)))
            t_loaded = programs_over(ours, fp8_loaded, list(zip(x, routing)))
            fp8_bytes = nbytes - touched * expert_bytes / 2
            fp8_floor = max(run.bytes_s(fp8_bytes), run.flops_s(flops))
            run.row("experts", f"fp8 expert layer, {tokens} tokens", t_fp8, fp8_floor,
                    note=f"{fp8_bytes / t_fp8 / 1e12:.2f} TB/s; the bf16 layer's time / fp8's {t_ours / t_fp8:.2f}; "
                         f"held as loaded ([K, N], expert parallelism's layout) {t_loaded * 1e6:.0f} us "
                         f"({t_loaded / t_fp8:.2f}x K-major)")
            # each call's own copy of the weights as arguments: XLA would dequantize shared ones once
            t_dequantized = programs_over(dequantized_first, (), [(*fp8, *rep) for rep in zip(x, routing)])
            run.row("experts", f"fp8 expert layer dequantized first, {tokens} tokens", t_dequantized, fp8_floor,
                    note=f"the experts dequantized to bf16 in the program, then the bf16 layer; the fp8 layer "
                         f"{t_fp8 * 1e6:.0f} us ({t_fp8 / t_dequantized:.2f}x this), the bf16 layer's time / this "
                         f"{t_ours / t_dequantized:.2f}")
            choose_form({"sorted": t_fp8, "dequantized": t_dequantized}, fp8, list(zip(x, routing)),
                        "fp8 expert layer", fp8_floor, scale_k)
        if run.args.sweep and tokens in SWEEP_TOKENS:
            sweep_tiling(run, tokens, x[0], routing[0], gate_up, down)

    if run.budget_left() >= 60:  # the engine's batch-1 decode step: one real row, the rest padding (expert -1)
        rows = s.step_rows
        x, routing, _ = expert_inputs(rng, s, rows, 2)
        padded = [(Routing(*r).without_rows_from(1).experts, r[1]) for r in routing]
        nbytes = s.top_k * expert_bytes + 2 * s.hidden * 2
        t_step = programs_over(ours, (gate_up, down), list(zip(x, padded)))
        run.row("experts", f"expert layer, 1 token in a step of {rows} rows", t_step, run.bytes_s(nbytes),
                note=f"the other {rows - 1} rows padding, routed to no expert; {nbytes / t_step / 1e12:.2f} TB/s")
    run.write_paths("expert_paths.json", "experts", paths)

    for tokens in s.gate_up_tokens:  # the gate/up projection alone, as the issue measured it
        if run.budget_left() < 45:
            continue
        x, routing, touched = expert_inputs(rng, s, tokens, 4)
        sorted_inputs = [sorted_rows(xi, r, s.experts) for xi, r in zip(x, routing)]
        nbytes = touched * 2 * s.hidden * s.inter * 2
        floor = max(run.bytes_s(nbytes), run.flops_s(2 * tokens * s.top_k * s.hidden * 2 * s.inter))
        t_ours = programs_over(lambda gu, xs, sz: swiglu(xs, gu, sz), (gate_up,), sorted_inputs)
        flat = gate_up.reshape(s.experts, s.hidden, 2 * s.inter)
        t_xla = programs_over(lambda w, xs, sz: gm.grouped_matmul_reference(xs, w, sz), (flat,), sorted_inputs)
        t_mgpu = time_mosaic_ragged_dot(flat, sorted_inputs) if not run.args.tiny else None
        run.row("experts", f"gate/up + SiLU-and-multiply alone, {tokens} tokens", t_ours, floor,
                peer.get(f"gate_up_{tokens}"),
                note=f"XLA ragged_dot (no activation) {t_xla * 1e6:.0f} us; JAX Mosaic GPU ragged_dot "
                     f"{'n/a' if t_mgpu is None else f'{t_mgpu * 1e6:.0f} us'}; torch._grouped_mm "
                     f"{fmt_peer(peer.get(f'gate_up_{tokens}'))}")


def fmt_peer(value):
    return f"{value * 1e6:.0f} us" if isinstance(value, (int, float)) else f"n/a ({str(value)[:80]})"


def sorted_rows(x, routing, num_experts):
    import jax.numpy as jnp

    experts = routing[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return x[order // experts.shape[1]], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def time_mosaic_ragged_dot(flat_gate_up, sorted_inputs):
    """JAX's own Mosaic GPU kernel (wgmma, TMA), the tiling the issue measured."""
    try:
        from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot

        def call(w, xs, sz):
            return ragged_dot(xs, w, group_sizes=sz, block_m=64, block_n=256, block_k=64, max_concurrent_steps=4,
                              grid_block_n=1)

        return programs_over(call, (flat_gate_up,), sorted_inputs)
    except Exception as e:  # noqa: BLE001 - a peer that fails is n/a, with its reason printed
        print("mosaic ragged_dot:", repr(e)[:300], flush=True)
        return None


SWEEP = {  # (block_m, block_n, block_k, num_warps, num_stages[, split_k])
    # split_k: more programs streaming the few experts a decode step touches (a tiling
    # whose K runs do not divide a projection's K is recorded as failing for it)
    "decode": [(16, 64, 128, 4, 4), (16, 16, 256, 4, 4), (16, 128, 64, 4, 4), (16, 32, 128, 4, 4, 4),
               (16, 64, 64, 4, 4, 2), (16, 32, 64, 4, 4, 2)],
    "middle": [(32, 64, 128, 4, 4), (64, 64, 64, 4, 4), (16, 64, 128, 4, 4)],
    "prefill": [(128, 128, 64, 8, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)],
}
SWEEP_TOKENS = (1, 256, 2048)
SWEEP_DOWN_TOKENS = (1, 2048)


def sweep_tiling(run: Run, tokens, x, routing, gate_up, down):
    """Each kernel alone over a few tilings, on one input set, against the default."""
    from jaxmtp.kernels import grouped_matmul as gm

    s = run.shapes
    xs, sizes = sorted_rows(x, routing, s.experts)
    interpret = run.args.tiny
    act = gm.grouped_swiglu_kernel(xs, gate_up, sizes, interpret=interpret)
    kind = "decode" if tokens <= 32 else ("middle" if tokens <= 256 else "prefill")
    kernels = [("swiglu", gm.grouped_swiglu_kernel, xs, gate_up)]
    if tokens in SWEEP_DOWN_TOKENS:
        kernels.append(("down", gm.grouped_matmul_kernel, act, down))
    for name, fn, lhs, rhs in kernels:
        times = {}
        # the default first and again last: the first timing of a sweep ran slow once
        for label, tiling in [("default", None)] + [(str(t), t) for t in SWEEP[kind]] + [("default again", None)]:
            config = None if tiling is None else gm.GroupedMatmulConfig(*tiling)
            try:
                def call(w, a, sz, c=config):
                    return fn(a, w, sz, config=c, interpret=interpret)

                times[label] = programs_over(call, (rhs,), [(lhs, sizes)]) * 1e6
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile is recorded
                times[label] = repr(e)[:120]
        default = gm.default_config(lhs.shape[0], s.experts, rhs.shape[1], rhs.shape[-1], name == "swiglu")
        run.results["sweep"].append({"kernel": name, "tokens": tokens, "default": dataclasses.astuple(default),
                                     "us": times})
        print("sweep", name, tokens, times, flush=True)


# ----- MLA attention ---------------------------------------------------------------------


def mla_inputs(rng, s: Shapes, rows_per_seq, kv_lens, reps):
    """Latent and rope pages of a pool larger than L2, one shuffled page table a rep."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    pages_per_seq = math.ceil(max(kv_lens) / s.page_size)
    num_seqs = len(kv_lens)
    token_bytes = (s.rank + s.rope) * 2
    sets = int(min(reps, max(1, math.ceil(256e6 / (sum(kv_lens) * token_bytes)))))
    pool = num_seqs * pages_per_seq * sets
    k1, k2, k3, k4 = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    query_start = np.concatenate([[0], np.cumsum(rows_per_seq)]).astype(np.int32)
    rows = int(query_start[-1])
    tables = [(r % sets) * num_seqs * pages_per_seq + rng.permutation(num_seqs * pages_per_seq).reshape(num_seqs, -1)
              for r in range(reps)]
    return {
        "latent": jax.random.normal(k1, (pool, s.page_size, 1, s.rank), jnp.bfloat16),
        "rope": jax.random.normal(k2, (pool, s.page_size, 1, s.rope), jnp.bfloat16),
        "q_latent": [jax.random.normal(jax.random.fold_in(k3, r), (rows, s.heads, s.rank), jnp.bfloat16) * 0.05
                     for r in range(reps)],
        "q_rope": [jax.random.normal(jax.random.fold_in(k4, r), (rows, s.heads, s.rope), jnp.bfloat16) * 0.05
                   for r in range(reps)],
        "tables": [jnp.asarray(t, jnp.int32) for t in tables],
        "kv_lens": jnp.asarray(kv_lens, jnp.int32), "query_start": jnp.asarray(query_start),
        "bytes": sum(kv_lens) * token_bytes,
    }


def mla_args(case) -> tuple:
    """The kernel's (and its reference's) arguments on a case's first input set."""
    return (case["q_latent"][0], case["q_rope"][0], case["latent"], case["rope"], case["kv_lens"], case["tables"][0],
            case["query_start"])


def mla_program(case, rows_per_seq: int, prefill: bool = False, config=None, xla: bool = False,
                interpret: bool = False):
    """A zero-argument call running the kernel at `config` (or with `xla` XLA's absorbed
    form, the jnp reference the engine runs off GPUs) over every input set of the case in
    one jitted program."""
    import jax

    from jaxmtp.kernels.mla_attention import mla_absorbed_attention
    from jaxmtp.kernels.mla_reference import mla_absorbed_attention_reference

    def call(latent, rope, kv_lens, query_start, q_latent, q_rope, table):
        args = (q_latent, q_rope, latent, rope, kv_lens, table, query_start)
        if xla:
            return mla_absorbed_attention_reference(*args, sm_scale=0.1)
        return mla_absorbed_attention(*args, sm_scale=0.1, decode_rows=1 if prefill else rows_per_seq,
                                      prefill=prefill, interpret=interpret, config=config)

    shared = (case["latent"], case["rope"], case["kv_lens"], case["query_start"])
    reps = list(zip(case["q_latent"], case["q_rope"], case["tables"]))
    program = jax.jit(lambda shared, reps: [call(*shared, *r) for r in reps])
    return lambda: program(shared, reps)


def time_mla(run: Run, case, rows_per_seq, prefill=False, config=None, xla=False) -> tuple[float, float]:
    """(device, wall) seconds per call of mla_program's calls: the kernels' time in a
    profiler trace, and the replayed program's wall time (which at small shapes is the
    host's dispatch of the program, not the device's work)."""
    from gemm_sweep import device_times

    program = mla_program(case, rows_per_seq, prefill, config, xla, run.args.tiny)
    device_us, _, wall_us = device_times({"mla": program}, 10, len(case["tables"]), run.args.tiny)["mla"]
    return (wall_us if device_us is None else device_us) / 1e6, wall_us / 1e6


def split_inputs(rng, s: Shapes, case) -> dict:
    """The split form's inputs beyond the case's (kernels/mla_prefill.py): the nope part of
    the queries, W_UK and W_UV, and the step's own latent and rope rows as the case's
    first page table holds them (each sequence's last rows)."""
    import jax.numpy as jnp
    import numpy as np

    query_start, kv_lens = np.asarray(case["query_start"]), np.asarray(case["kv_lens"])
    rows = np.arange(int(query_start[-1]))
    seq = np.searchsorted(query_start[1:], rows, side="right")
    position = kv_lens[seq] - (query_start[seq + 1] - rows)
    slot = jnp.asarray(case["tables"][0])[seq, position // s.page_size] * s.page_size + position % s.page_size

    def normal(shape, scale):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.bfloat16)

    return {"q_nope": normal((len(rows), s.heads, s.nope), 1.0),
            "w_uk": normal((s.rank, s.heads, s.nope), 0.05 / s.rank ** 0.5),
            "w_uv": normal((s.rank, s.heads, s.v_head), 1 / s.rank ** 0.5),
            "own_latent": case["latent"].reshape(-1, s.rank)[slot], "own_rope": case["rope"].reshape(-1, s.rope)[slot]}


def split_call(case, split: dict, rep: int = 0, config=None, interpret: bool = False, decode_rows: int = 1):
    """The split-form prefill (mla_split_prefill) on the case's input set `rep`."""
    from jaxmtp.kernels.mla_prefill import mla_split_prefill

    return mla_split_prefill(split["q_nope"], case["q_rope"][rep], split["own_latent"], split["own_rope"],
                             case["latent"], case["rope"], case["kv_lens"], case["tables"][rep], case["query_start"],
                             split["w_uk"], split["w_uv"], sm_scale=0.1, decode_rows=decode_rows, interpret=interpret,
                             config=config)


def time_split(run: Run, case, split: dict, config=None) -> float:
    """Seconds per call of the split form over every input set of the case (the own rows
    are the first set's: their values do not change the work): its device time, or the
    calls' queued wall time where that is longer. A prefix expanded in passes loops a
    number of times the device computes, and XLA:GPU reads such a loop's condition on the
    host, which then waits for the device at each pass: the wall time has those waits."""
    import jax

    from gemm_sweep import device_times

    reps = len(case["tables"])
    program = jax.jit(lambda case, split: [split_call(case, split, r, config, run.args.tiny) for r in range(reps)])
    device_us, _, wall_us = device_times({"split": lambda: program(case, split)}, 10, reps, run.args.tiny)["split"]
    return max(device_us or 0.0, wall_us) / 1e6


# the most prefix tokens the split form expands a pass: 16k tokens of DeepSeek-V3's 128
# heads' keys and values are 1 GB
PREFIX_WINDOW_MAX = 16384
# own-rows tilings of the split form (block_q, block_kv, num_warps, num_stages), beside the default
SPLIT_SWEEP = [(128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 3), (32, 64, 4, 2), (128, 64, 4, 2)]


# prefill tilings (block_q, block_h, block_kv, num_warps, num_stages), beside default_config's
MLA_PREFILL_SWEEP = [(4, 16, 32, 8, 2), (1, 16, 64, 4, 3), (2, 16, 32, 4, 3), (4, 8, 64, 4, 2), (8, 8, 32, 8, 2)]


def prefill_flops(s: Shapes, chunk: int, context: int) -> tuple[float, float]:
    """A prefill chunk's attention FLOPs (its rows see context - chunk cached tokens and
    their own causal run): in the absorbed form the kernel computes (R + Dr scores, R
    values a head), and in the expanded form (Dn + Dr, Dv), the least any form needs."""
    seen = chunk * (context - chunk) + chunk * (chunk + 1) / 2
    return (2 * seen * s.heads * (2 * s.rank + s.rope), 2 * seen * s.heads * (s.nope + s.rope + s.v_head))


# XLA's absorbed form gathers every row's context in float32: timed where that stays
# below this many bytes an input set
XLA_FORM_MAX_BYTES = 16e9


def part_mla(run: Run, cases):
    """The kernel's rows at the engine's tiling for each shape (kernels/mla_paths.json's
    entry, else default_config; benchmarks/mla_sweep.py measures that table), XLA's
    absorbed form beside each decode row, and with --sweep a few prefill tilings. Each
    row's value is the kernels' device time; the note gives the replayed wall time."""
    import numpy as np

    from jaxmtp.kernels.mla_attention import MLAKernelConfig, default_config, measured_decode_path

    s, rng, peer = run.shapes, np.random.default_rng(4), run.results["peer"]
    prefill_paths = {}  # mla_prefill_paths.json: the split form's best tiling or "absorbed"
    for batch, context, rows, prefill in cases:
        if run.budget_left() < 45:
            run.results.setdefault("skipped_over_budget", []).append(f"mla {batch}x{context}x{rows}")
            continue
        reps = 2 if prefill else int(np.clip(5e8 // (batch * context * (s.rank + s.rope) * 2), 2, 6))
        case = mla_inputs(rng, s, [rows] * batch, [context] * batch, reps)
        base = default_config(batch * rows, batch, s.heads, 1 if prefill else rows, context, prefill)
        measured = None if prefill else measured_decode_path(s.heads, s.rank, s.rope, rows, batch, context)
        config = measured if isinstance(measured, MLAKernelConfig) else base
        seconds, wall = time_mla(run, case, rows, prefill, config, xla=measured == "xla")
        p = peer.get(f"mla_{batch}_{context}_{rows}")
        tiling = "XLA's absorbed form" if measured == "xla" else f"tiling {dataclasses.astuple(config)}" + (
            " (measured table)" if measured else " (default)")
        if prefill:
            absorbed, expanded = prefill_flops(s, rows, context)
            target = ">= 50% of the matmul rate" if context == 8192 else ""
            run.row("mla", f"MLA prefill, a {rows}-row chunk at context {context}", seconds, run.flops_s(expanded), p,
                    target, note=f"{absorbed / seconds / 1e12:.0f} TFLOP/s in the absorbed form (floor: the expanded "
                                 f"form's FLOPs); wall {wall * 1e6:.0f} us; torch SDPA over expanded K/V {fmt_peer(p)}")
            split_prefill_row(run, case, rows, context, seconds, target, prefill_paths)
        else:
            kind = "decode" if rows == 1 else f"verify k+1={rows}"
            target = ">= 75% of copy" if batch >= 32 and context >= 4096 else ""
            run.row("mla", f"MLA {kind}, batch {batch}, context {context}", seconds, run.bytes_s(case["bytes"]), p,
                    target, note=f"{case['bytes'] / seconds / 1e9:.0f} GB/s over the latent cache, {tiling}; wall "
                                 f"{wall * 1e6:.0f} us; torch SDPA over expanded K/V {fmt_peer(p)}")
            if batch * rows * context * (s.rank + s.rope) * 4 <= XLA_FORM_MAX_BYTES and measured != "xla":
                xla_s, xla_wall = time_mla(run, case, rows, xla=True)
                run.row("mla", f"XLA absorbed form, {kind}, batch {batch}, context {context}", xla_s,
                        run.bytes_s(case["bytes"]), note=f"the engine's path {seconds / xla_s:.2f}x its time; wall "
                                                         f"{xla_wall * 1e6:.0f} us")
            if rows == 1 and batch > 1 and context == s.mla_contexts[min(1, len(s.mla_contexts) - 1)]:
                # the same decode call in a step that also holds a prefill chunk's rows
                chunk = s.mla_prefill[0][0]
                mixed = mla_inputs(rng, s, [1] * batch + [chunk], [context] * (batch + 1), reps)
                mixed_s, mixed_wall = time_mla(run, mixed, 1, config=config)
                run.row("mla", f"MLA decode beside a {chunk}-row prefill chunk, batch {batch}, context {context}",
                        mixed_s, run.bytes_s(case["bytes"]),
                        note=f"the decode call of a step of {batch + chunk} rows, {tiling}: {mixed_s / seconds:.2f}x "
                             f"its time in a decode step; wall {mixed_wall * 1e6:.0f} us")
                del mixed
        if run.args.sweep and prefill and context == max(c for _, c in s.mla_prefill):
            times = {str(dataclasses.astuple(base)): seconds * 1e6}
            for q, h, kv, w, st in MLA_PREFILL_SWEEP:
                swept = MLAKernelConfig(q, h, kv, base.num_splits, w, st)
                try:
                    times[str(dataclasses.astuple(swept))] = time_mla(run, case, rows, True, swept)[0] * 1e6
                except Exception as e:  # noqa: BLE001 - a tiling that does not compile is recorded
                    times[str(dataclasses.astuple(swept))] = repr(e)[:120]
            run.results["sweep"].append({"kernel": "mla prefill", "batch": batch, "context": context, "rows": rows,
                                         "us": times})
            print("sweep mla prefill", batch, context, rows, times, flush=True)
        del case
        gc.collect()
    if prefill_paths:
        run.write_paths("mla_prefill_paths.json", "mla", prefill_paths)


def split_prefill_row(run: Run, case, rows: int, context: int, absorbed_s: float, target: str, paths: dict) -> None:
    """The split form (kernels/mla_prefill.py) on a prefill case at the default own-rows
    tiling with the prefix absorbed and expanded, and with --sweep at SPLIT_SWEEP's
    tilings expanded too; its table entry in `paths`: the fastest tiling and prefix
    window, or "absorbed" where the absorbed call (absorbed_s) beat them all."""
    import numpy as np

    from jaxmtp.kernels.mla_prefill import OwnRowsConfig
    from jaxmtp.kernels.tiling_table import row_bucket

    s = run.shapes
    split = split_inputs(np.random.default_rng(rows + context), s, case)
    # the prefix absorbed, or expanded in one pass (a window of the context bucket, up to
    # PREFIX_WINDOW_MAX tokens), at the default tiling; with --sweep the others expanded
    window = min(row_bucket(context), PREFIX_WINDOW_MAX)
    configs = [OwnRowsConfig(), OwnRowsConfig(prefix_window=window)] + (
        [OwnRowsConfig(*t, prefix_window=window) for t in SPLIT_SWEEP] if run.args.sweep else [])
    times = {}
    for config in configs:
        try:
            times[config] = time_split(run, case, split, config)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is recorded
            run.results["sweep"].append({"kernel": "mla split prefill", "context": context, "rows": rows,
                                         "tiling": dataclasses.astuple(config), "error": repr(e)[:160]})
    if not times:
        return
    best = min(times, key=times.get)
    prefix_absorbed = f"{times[configs[0]] * 1e6:.0f} us" if configs[0] in times else "no build"
    _, expanded = prefill_flops(s, rows, context)
    run.row("mla", f"MLA prefill, split form, a {rows}-row chunk at context {context}", times[best],
            run.flops_s(expanded), target=target,
            note=f"tiling and prefix window {dataclasses.astuple(best)} of {len(times)} (window 0: the prefix "
                 f"absorbed, {prefix_absorbed} at the default tiling); the absorbed call "
                 f"{absorbed_s / times[best]:.2f}x its time; {expanded / times[best] / 1e12:.0f} TFLOP/s")
    run.results["sweep"].append({"kernel": "mla split prefill", "context": context, "rows": rows,
                                 "us": {str(dataclasses.astuple(c)): t * 1e6 for c, t in times.items()}})
    key = ",".join(map(str, (s.heads, s.rank, s.rope, s.nope, s.v_head, row_bucket(context))))
    entry = "absorbed" if absorbed_s <= times[best] else list(dataclasses.astuple(best))
    paths.setdefault(key, {})[str(row_bucket(rows))] = entry


def mla_cases(s: Shapes, only: str = ""):
    """(batch, context, rows a sequence, prefill) for the kernel and its torch peer; `only`:
    those named "BxCxR" in its comma list (R: a prefill chunk's rows)."""
    cases = [(b, c, 1, False) for b in s.mla_batches for c in s.mla_contexts]
    cases.append((s.mla_batches[min(1, len(s.mla_batches) - 1)], s.mla_contexts[0], 2, False))
    cases += [(1, context, chunk, True) for chunk, context in s.mla_prefill]
    names = set(filter(None, only.split(",")))
    return [case for case in cases if not names or f"{case[0]}x{case[1]}x{case[2]}" in names]


# ----- end to end ------------------------------------------------------------------------


def tree_bytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def tree_size(tree) -> int:
    import jax

    return sum(x.size for x in jax.tree.leaves(tree))


def active_part(layers, moe, picked: float, measure) -> float:
    """measure(layers) (tree_bytes or tree_size) less the routed experts outside `picked`
    of each MoE layer's (routed experts held with the shared experts as their first
    groups, or apart)."""
    if moe is None:
        return measure(layers)
    routed = sum(measure((layer.moe.experts_gate_up, layer.moe.experts_down)) * moe.num_experts
                 / (moe.num_experts + layer.moe.shared_in_experts) for layer in layers if layer.moe is not None)
    return measure(layers) - routed + routed * picked / moe.num_experts


def step_bytes(params, cfg, batch: int, context: int, rows: int = 1) -> float:
    """A decode step's fewest bytes: every weight (fp8 ones with their scales) but the
    embedding, the MTP modules and the routed experts no row picks (expected distinct
    picks of batch * rows rows under uniform routing), plus the batch's cache (MLA's
    latent, or GQA's K and V). rows 2: an MTP k=1 step, whose draft pass also reads the
    first MTP module (its experts picked by the same rows) and the LM head once more."""
    moe = cfg.moe
    picked = moe.num_experts * (1 - (1 - moe.num_experts_per_tok / moe.num_experts) ** (batch * rows))
    head = 0 if params.lm_head is None else params.lm_head.nbytes
    total = active_part(params.layers, moe, picked, tree_bytes) + params.final_norm.nbytes + head
    if rows > 1:
        module = params.mtp[0]
        total += (active_part([module.block], moe, picked, tree_bytes)
                  + tree_bytes(dataclasses.replace(module, block=None, lm_head=None)) + head)
    per_token = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) if cfg.mla is not None \
        else 2 * cfg.num_kv_heads * cfg.head_dim
    return total + cfg.num_layers * context * per_token * 2 * batch


def model_prefill_flops(params, cfg, tokens: int) -> float:
    """A prompt's fewest FLOPs: each token through every weight it needs (the decoder
    layers' weights less the routed experts it does not pick: top-k of them), the LM head
    for the last token alone, and causal attention in the expanded form (q.k over the nope
    and rope dims, p.v over the value dim, each head)."""
    top_k = 0 if cfg.moe is None else cfg.moe.num_experts_per_tok
    active = active_part(params.layers, cfg.moe, top_k, tree_size)
    qk, v = (cfg.mla.qk_head_dim, cfg.mla.v_head_dim) if cfg.mla is not None else (cfg.head_dim, cfg.head_dim)
    attention = 2 * cfg.num_heads * (qk + v) * tokens * (tokens + 1) / 2 * cfg.num_layers
    return 2 * tokens * active + 2 * tree_size(params.head()) + attention


def shape_floors(model: str, tiny: bool) -> dict:
    """A model's batch-1 plain and MTP k=1 steps' bytes (step_bytes) from its shapes alone,
    no weights made and no device: at these floors an MTP step with every draft accepted
    gives 2 * plain / MTP the plain step's tokens/s, the most the e2e part's MTP row can
    reach as both steps near them."""
    import jax

    from jaxmtp.models.params import random_params
    from jaxmtp.models.registry import load_config

    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(json.dumps(MODELS[model][1 if tiny else 0]))
    cfg = load_config(folder)
    shapes = jax.eval_shape(lambda key: random_params(cfg, key, 1), jax.random.key(0))
    sized = jax.tree.map(lambda x: types.SimpleNamespace(nbytes=x.size * x.dtype.itemsize), shapes)
    s = TINY if tiny else Shapes()
    context = s.prompt + s.new_tokens // 2
    plain, mtp = step_bytes(sized, cfg, 1, context), step_bytes(sized, cfg, 1, context, rows=2)
    return {"model": model, "context": context, "plain_bytes": plain, "mtp_k1_bytes": mtp,
            "mtp_k1_over_plain_at_floors": 2 * plain / mtp}


def part_e2e(run: Run):
    for name in run.args.models.split(","):
        if run.budget_left() <= 90:
            run.results.setdefault("skipped_over_budget", []).append(f"e2e {name}")
            continue
        model_e2e(run, name)


def model_e2e(run: Run, model: str):
    """One model with dummy weights: batch-1 and batch-32 decode against their bytes
    floors, MTP k=1 with oracle drafts over plain; its rows are named after it."""
    import numpy as np
    from e2e import device_step_time, phases_note, robust_greedy_weights, run_decode, write_bpe_tokenizer

    from jaxmtp import LLM

    s, config = run.shapes, MODELS[model][1 if run.args.tiny else 0]
    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(json.dumps(config))
    write_bpe_tokenizer(Path(folder), config["vocab_size"])
    rng = np.random.default_rng(5)

    def engine(**kwargs):
        gc.collect()
        llm = LLM(folder, load_format="dummy", **{"max_model_len": min(1024, config["max_position_embeddings"] - 64),
                                                  "num_pages": 400 if run.args.tiny else 1200, **kwargs})
        # one greedy path that the oracle can follow (e2e.robust_greedy_weights)
        llm.engine.runner.replace_params(robust_greedy_weights(llm.engine.params))
        return llm

    def prompts(n, length):
        return [rng.integers(3, config["vocab_size"] - 1, size=length).tolist() for _ in range(n)]

    plain = engine(max_num_seqs=1, max_num_batched_tokens=s.prompt)
    cfg, params = plain.engine.model_config, plain.engine.params
    contexts = {1: s.prompt + s.new_tokens // 2, s.batch: s.batch_prompt + s.batch_new_tokens // 2}
    floors = {b: run.bytes_s(step_bytes(params, cfg, b, context)) for b, context in contexts.items()}
    del params
    prompt = prompts(1, s.prompt)
    t = time.perf_counter()
    run_decode(plain, prompt, 4)
    run.results[f"e2e_{model}_b1_first_run_with_compiles_s"] = time.perf_counter() - t
    step_s, _, tokens, _ = run_decode(plain, prompt, s.new_tokens)
    floor = floors[1]
    device_s = device_step_time(plain.engine, 20)
    run.row("e2e", f"{model} b1 decode (prompt {s.prompt}), async scheduling", step_s * 1e3, floor * 1e3, unit="ms/token",
            target=">= 50% of bytes floor", note=f"bytes floor {floor * 1e3:.2f} ms; jitted step alone "
                                                 f"{device_s * 1e3:.2f} ms ({floor / device_s:.2f} of floor)")
    del plain
    skipped = run.results.setdefault("skipped_over_budget", [])
    if run.budget_left() <= 90:
        skipped.append(f"e2e {model} b1 MTP k=1")
    else:
        spec = engine(max_num_seqs=1, max_num_batched_tokens=s.prompt, num_speculative_tokens=1)
        spec_floor = run.bytes_s(step_bytes(spec.engine.params, cfg, 1, contexts[1], rows=2))
        run_decode(spec, prompt, 4)
        replayed = {}
        spec_s, _, spec_tokens, outs = run_decode(spec, prompt, s.new_tokens, oracle=tokens, replayed=replayed)
        acc = outs[0].spec_stats["mean_acceptance_length"]
        run.row("e2e", f"{model} b1 MTP k=1 oracle drafts: tokens/s over plain", acc * step_s / spec_s, unit="x",
                target=">= 1.8x", note=f"acceptance length {acc:.2f}; at both steps' bytes floors "
                                      f"{acc * floor / spec_floor:.2f}x (floor {spec_floor * 1e3:.2f} ms a step: the "
                                      f"experts of 2 rows, the MTP module, the head again); "
                                      f"{spec_s * 1e3:.2f} ms/step (jitted step alone "
                                      f"{replayed['device_step_s'] * 1e3:.2f} ms; {phases_note(replayed)}); output "
                                      f"equal to plain: {spec_tokens == tokens}")
        del spec
    if run.budget_left() <= 90:
        skipped.append(f"e2e {model} b{s.batch} decode")
    else:
        batched = engine(max_num_seqs=s.batch, max_num_batched_tokens=max(512, s.batch_prompt) if not run.args.tiny
                         else 64)
        step_s, tps, _, _ = run_decode(batched, prompts(s.batch, s.batch_prompt), s.batch_new_tokens)
        if step_s is not None:
            floor = floors[s.batch]
            run.row("e2e", f"{model} b{s.batch} decode (prompt {s.batch_prompt}), async scheduling", step_s * 1e3,
                    floor * 1e3, unit="ms/step", target=">= 75% of bytes floor" if model == "moonlight" else "",
                    note=f"{tps:.0f} tokens/s; bytes floor {floor * 1e3:.2f} ms")
        del batched
    if run.budget_left() <= 90:
        skipped.append(f"e2e {model} prefill")
    else:
        prefill_ttft(run, model, engine, prompts, config)
    gc.collect()


def prefill_ttft(run: Run, model: str, engine, prompts, config: dict) -> None:
    """One long prompt's time to its first token (Shapes.prefill_prompt tokens, at most
    the model's context less one, in chunks of Shapes.prefill_chunk), the second of two
    runs (the first compiles), against its FLOP floor (model_prefill_flops)."""
    from jaxmtp import SamplingParams

    s = run.shapes
    n = min(s.prefill_prompt, config["max_position_embeddings"] - 1)
    llm = engine(max_num_seqs=1, max_num_batched_tokens=s.prefill_chunk, prefill_chunk_size=s.prefill_chunk,
                 max_model_len=n + 1)
    prompt, first = prompts(1, n), SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompt, first, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompt, first, use_tqdm=False)
    ttft = time.perf_counter() - t
    flops = model_prefill_flops(llm.engine.params, llm.engine.model_config, n)
    run.row("e2e", f"{model} prefill {n} tokens, chunk {s.prefill_chunk}: TTFT", ttft * 1e3, run.flops_s(flops) * 1e3,
            unit="ms", target="report", note=f"FLOP floor {flops / 1e9:.4g} GFLOP (matmuls at their active weights, "
                                             f"causal attention in the expanded form)")
    del llm


# ----- report ----------------------------------------------------------------------------


def markdown(results) -> str:
    bw, mm = results.get("bandwidth") or 0, results.get("matmul_flops_per_s") or 0
    head = (f"# MoE and MLA benchmark\n\n{results['date']}, {results.get('device')}, jax {results.get('jax')}; "
            f"copy bandwidth {bw / 1e12:.2f} TB/s ({results.get('bandwidth_source')}, same run), bf16 matmul "
            f"{mm / 1e12:.0f} TFLOP/s (JAX 8192^3, same run); command: `{results['command']}`\n\n"
            "share of floor: floor time / time (the floor: bytes at the copy bandwidth or FLOPs at the matmul rate, "
            "the larger); x torch: torch's time / ours.\n\n")
    lines = ["| part | scenario | value | unit | share of floor | x torch | target | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        share = "" if r["floor_ratio"] is None else f"{r['floor_ratio']:.3f}"
        peer = "" if r["peer_ratio"] is None else f"{r['peer_ratio']:.2f}"
        lines.append(f"| {r['part']} | {r['scenario']} | {r['value']:.4g} | {r['unit']} | {share} | {peer} | "
                     f"{r['target']} | {r['note']} |")
    checks = "".join(f"- {c['kernel']}, {c['case']}: relative error {c['rel_err']:.2e}, finite {c['finite']}, "
                     f"padding rows 0 {c['padding_rows_zero']}\n" for c in results.get("checks", []))
    sweep = "".join(f"- {json.dumps(entry)}\n" for entry in results.get("sweep", []))
    extra = {k: v for k, v in results.items() if k.startswith(("e2e_", "engine_", "skipped", "failed"))}
    return (head + "\n".join(lines) + ("\n\nGPU checks against the references:\n\n" + checks if checks else "")
            + ("\n\nTilings swept (us):\n\n" + sweep if sweep else "")
            + "".join(f"\n- {k}: {v}" for k, v in extra.items()) + "\n")


PARTS = {"checks": part_checks, "experts": part_experts,
         "mla": lambda run: part_mla(run, mla_cases(run.shapes, run.args.mla_cases)), "e2e": part_e2e}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--parts", default="checks,experts,mla,e2e", help="comma list of: " + ", ".join(PARTS))
    parser.add_argument("--tag", default="", help="suffix of the output files (moe<tag>.json/.md)")
    parser.add_argument("--mla-cases", default="", help="mla part: only these BxCxR cases (comma list)")
    parser.add_argument("--sweep", action="store_true", help="also time a few tilings of each kernel")
    parser.add_argument("--fp8", action="store_true", help="experts part: also the layer with fp8 experts")
    parser.add_argument("--no-peer", action="store_true", help="skip torch")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: interpret-mode kernels, a tiny model")
    parser.add_argument("--models", default="moonlight,glm45_air_fp8", help="e2e part: comma list of: "
                        + ", ".join(MODELS))
    parser.add_argument("--floors-only", action="store_true", help="no device work: each model's batch-1 plain and "
                        "MTP k=1 steps' bytes floors from its shapes, and their tokens/s ratio (moe_floors.json)")
    args = parser.parse_args()
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.floors_only:
        floors = [shape_floors(model, args.tiny) for model in args.models.split(",")]
        print(json.dumps(floors, indent=1))
        out = Path(os.environ.get("OUT", args.out))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"moe_floors{args.tag}.json").write_text(json.dumps(
            {"command": "python benchmarks/moe.py " + " ".join(sys.argv[1:]), "floors": floors}, indent=1))
        return
    run = Run(args)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {list(PARTS)}")
    use_torch = not (args.tiny or args.no_peer)
    wants_peer = use_torch and {"experts", "mla"} & set(parts)
    run.results["peer"] = run_peer(run.shapes, mla_cases(run.shapes)) if wants_peer else {}
    print("peer", run.results["peer"], flush=True)

    import jax
    from e2e import measure_floors, torch_copy_bandwidth

    run.results["device"], run.results["jax"] = jax.devices()[0].device_kind, jax.__version__
    run.results["xla_flags"] = os.environ.get("XLA_FLAGS", "")  # runs differ by it (command buffer types)
    # the floor's bandwidth from torch's copy wherever torch runs (--no-peer skips torch's
    # kernels, not the floor)
    torch_copy = torch_copy_bandwidth() if not args.tiny and jax.default_backend() == "gpu" else None
    run.results.update(measure_floors(args.tiny))
    run.results["torch_copy_bytes_per_s"] = torch_copy
    run.results["bandwidth"] = torch_copy or run.results["jax_copy_bytes_per_s"]
    run.results["bandwidth_source"] = "torch device copy" if torch_copy else "jnp copy"
    for name in parts:
        if run.budget_left() < 30:
            run.results.setdefault("skipped_over_budget", []).append(name)
            continue
        try:
            PARTS[name](run)
        except Exception as e:  # noqa: BLE001 - one part's failure is recorded; the others still run
            import traceback

            traceback.print_exc()
            run.results.setdefault("failed_parts", {})[name] = repr(e)[:500]
    run.save()
    (run.out_dir / f"moe{args.tag}.md").write_text(markdown(run.results))
    print("\n" + markdown(run.results))


if __name__ == "__main__":
    main()
