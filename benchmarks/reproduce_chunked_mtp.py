"""Reproduction: MTP acceptance under chunked prefill, the fix against the pre-fix behaviour.

CPU, a few minutes:  python benchmarks/reproduce_chunked_mtp.py [--family qwen3_next|deepseek_v3]

On held-out long prompts (200-450 tokens of sampled, not greedy, text) it runs greedy
MTP decoding with k in {1, 2} for every prefill_chunk_size in {8, 16, 32, 64, 128, 256,
whole} under mtp_boundary="next_chunk" (the fix) and "sampled" (the pre-fix behaviour),
and reports per-position acceptance, mean acceptance length, how many requests match
the unchunked run exactly, the draft-KV difference at chunk boundaries, and how often
the first draft after prefill changes. Writes docs/reproductions/chunked-prefill-mtp.md,
a JSON of the raw numbers and a PNG plot, and prints the table last. --family: the same
for a tiny model of that family trained here first (benchmarks/tiny_mtp_models.py: a
Qwen3-Next-shaped hybrid, or a DeepSeek-V3-shaped MoE), files suffixed with its name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from jaxmtp import LLM, SamplingParams
from jaxmtp.train import HELD_OUT_NAMES, HELD_OUT_OPENINGS, story_prompts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
CHUNKS = [8, 16, 32, 64, 128, 256, None]
MODES = ["next_chunk", "sampled"]


def held_out_prompts(llm: LLM, count: int, seed: int) -> list[list[int]]:
    """Sampled stories from held-out openings, cut to 200-450 tokens; a third of them
    end one token after a multiple of 8 (so after a boundary of every chunk size that
    divides their length), where the first draft reads the boundary row directly."""
    rng = np.random.default_rng(seed)
    openings = story_prompts(HELD_OUT_NAMES, HELD_OUT_OPENINGS)
    texts = [openings[i % len(openings)] for i in range(count)]
    params = [SamplingParams(max_tokens=460, temperature=1.0, seed=seed + i, ignore_eos=True) for i in range(count)]
    outs = llm.generate(texts, params, use_tqdm=False)
    prompts = []
    for i, out in enumerate(outs):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        length = int(rng.integers(200, 451))
        if i % 3 == 0:
            length = 8 * int(rng.integers(25, 56)) + 1
        prompts.append(ids[:length])
    return prompts


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy decoding of all prompts; per request the tokens, spec stats, first drafts
    and the draft KV at every prompt position (read when the prefill emits)."""
    engine = llm.engine
    layer = engine.model_config.num_kv_layers
    records = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        records[str(i)] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                records[out.request_id].update(tokens=out.outputs[0].token_ids, spec=out.spec_stats)
        for rows in engine.last_schedule:
            seq, record = rows.seq, records[rows.seq.request_id]
            if rows.has_output and "first_drafts" not in record and seq.output_token_ids:
                pos = np.arange(len(seq.prompt_token_ids))
                slots = np.asarray(seq.pages)[pos // engine.page_size] * engine.page_size + pos % engine.page_size
                k_pages = np.asarray(engine.cache.k[layer])
                record["first_drafts"] = list(seq.drafts)
                record["draft_k"] = k_pages.reshape(-1, *k_pages.shape[2:])[slots]
    return [records[str(i)] for i in range(len(prompts))]


def row_diff(result: dict, baseline: dict) -> np.ndarray:
    """Per prompt position, the largest difference of the draft KV (K's heads, or MLA's
    latent) between a run and the baseline."""
    diff = np.abs(result["draft_k"] - baseline["draft_k"])
    return diff.reshape(len(diff), -1).max(axis=1)


def summarise(results: list[dict], baseline: list[dict], chunk: int | None, prompts) -> dict:
    k = len(baseline[0]["first_drafts"])
    per_position = np.zeros(k)
    steps = accepted = 0
    for r in results:
        spec = r["spec"]
        per_position += np.asarray(spec["accepted_per_position"] + [0] * (k - len(spec["accepted_per_position"])))
        steps += spec["num_steps"]
        accepted += spec["accepted"]
    boundary_diffs, boundary_rows, boundary_mismatch = [], 0, 0
    for r, b, prompt in zip(results, baseline, prompts):
        diff = row_diff(r, b)
        if chunk is not None:
            rows = np.arange(chunk - 1, len(prompt) - 1, chunk)
            boundary_rows += len(rows)
            boundary_diffs.extend(diff[rows].tolist())
            boundary_mismatch += int((diff[rows] > 1e-5).sum())
    return {
        "chunk": chunk,
        "acceptance_per_position": (per_position / steps).tolist(),
        "mean_acceptance_length": 1 + accepted / steps,
        "requests_equal_to_unchunked": sum(
            r["spec"] == b["spec"] and r["first_drafts"] == b["first_drafts"] and r["tokens"] == b["tokens"]
            for r, b in zip(results, baseline)
        ),
        "outputs_equal_to_unchunked": sum(r["tokens"] == b["tokens"] for r, b in zip(results, baseline)),
        "first_draft_changed": sum(r["first_drafts"][0] != b["first_drafts"][0] for r, b in zip(results, baseline)),
        "boundary_rows": boundary_rows,
        "boundary_rows_with_different_draft_kv": boundary_mismatch,
        "max_draft_kv_diff_at_boundaries": max(boundary_diffs, default=0.0),
        "max_draft_kv_diff_elsewhere": max(
            float(np.delete(row_diff(r, b), np.arange(chunk - 1, len(p) - 1, chunk) if chunk else []).max(initial=0.0))
            for r, b, p in zip(results, baseline, prompts)
        ),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, k in zip(axes, sorted({r["k"] for r in rows})):
        for mode, style in zip(MODES, ("-o", "--s")):
            sel = [r for r in rows if r["k"] == k and r["mode"] == mode]
            labels = [str(r["chunk"] or "whole") for r in sel]
            ax.plot(labels, [r["mean_acceptance_length"] for r in sel], style, label=mode)
        ax.set_title(f"k = {k}")
        ax.set_xlabel("prefill_chunk_size")
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_ylabel("mean acceptance length")
    axes[0].legend(title="mtp_boundary")
    fig.suptitle("MTP under chunked prefill: the fix (next_chunk) vs the pre-fix behaviour (sampled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "checkpoints" / "stories260K-mtp"))
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--out", default=str(ROOT / "docs" / "reproductions"))
    parser.add_argument("--family", choices=("qwen3_next", "deepseek_v3"),
                        help="a tiny model of this family trained first (in place of --model)")
    args = parser.parse_args()
    suffix = ""
    if args.family is not None:
        from tiny_mtp_models import make_trained_model

        args.model, suffix = str(make_trained_model(args.family, Path(tempfile.mkdtemp()) / args.family)), f"-{args.family}"
    engine_args = dict(page_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    prompts = held_out_prompts(LLM(args.model, **engine_args), args.num_prompts, args.seed)
    rows = []
    for k in (1, 2):
        baseline = run(LLM(args.model, num_speculative_tokens=k, **engine_args), prompts, args.max_tokens)
        for mode in MODES:
            for chunk in CHUNKS:
                llm = LLM(args.model, num_speculative_tokens=k, prefill_chunk_size=chunk, mtp_boundary=mode, **engine_args)
                summary = summarise(run(llm, prompts, args.max_tokens), baseline, chunk, prompts)
                rows.append({"k": k, "mode": mode, **summary})
                print(f"k={k} {mode:10s} chunk={chunk or 'whole':>5} mean acceptance length "
                      f"{summary['mean_acceptance_length']:.3f}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": f"CPU ({platform.machine()}, {jax.device_count()} JAX device)",
        "jax": jax.__version__,
        "model": args.family and f"tiny {args.family}, trained by benchmarks/tiny_mtp_models.py" or Path(args.model).name,
        "prompts": len(prompts),
        "prompt_lengths": [len(p) for p in prompts],
        "max_tokens": args.max_tokens,
        "command": "python benchmarks/reproduce_chunked_mtp.py" + (f" --family {args.family}" if args.family else ""),
    }
    (out / f"chunked-prefill-mtp{suffix}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, out / f"chunked-prefill-mtp{suffix}.png")
    table = format_table(rows)
    (out / f"chunked-prefill-mtp{suffix}-table.md").write_text(table + "\n")
    print(f"\n{meta['date']}, {meta['device']}, jax {meta['jax']}, {meta['model']}, "
          f"{meta['prompts']} held-out prompts of {min(meta['prompt_lengths'])}-{max(meta['prompt_lengths'])} tokens, "
          f"{args.max_tokens} greedy tokens each\n")
    print(table)


def format_table(rows: list[dict]) -> str:
    lines = [
        "| k | mtp_boundary | chunk | acceptance per position | mean acc. length | requests = unchunked "
        "| first draft changed | boundary rows with other draft KV | max draft-KV diff at boundaries |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['k']} | {r['mode']} | {r['chunk'] or 'whole'} | "
            f"{', '.join(f'{a:.3f}' for a in r['acceptance_per_position'])} | {r['mean_acceptance_length']:.3f} | "
            f"{r['requests_equal_to_unchunked']} | {r['first_draft_changed']} | "
            f"{r['boundary_rows_with_different_draft_kv']}/{r['boundary_rows']} | {r['max_draft_kv_diff_at_boundaries']:.3g} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
