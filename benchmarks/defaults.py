"""A new user's first minute: Meta's Llama-3.1-8B config.json (131072-token context,
llama3 RoPE) with dummy weights, every engine option at its default, in a fresh
process. Measures the time to construct LLM(folder, load_format="dummy"), the KV pool
it sized (pages, tokens, GiB, and what sized it), the time to the first generated token
of one request, and the process's peak memory.

    python benchmarks/defaults.py             # the real config
    python benchmarks/defaults.py --tiny      # a small model with the same context, CPU

Writes JSON and markdown (date, device, JAX version) under $OUT or --out."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Meta's meta-llama/Llama-3.1-8B-Instruct config.json, as published
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
TINY = {**LLAMA31_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024, "bos_token_id": 1, "eos_token_id": 2}

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import jax
from jaxmtp import LLM, SamplingParams
t_import = time.perf_counter()
llm = LLM(sys.argv[1], load_format="dummy")
t_ready = time.perf_counter()
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
t_token = time.perf_counter()
pool = llm.engine.runner.kv_pool
cfg = llm.engine.config
print("RESULT", json.dumps({
    "import_s": t_import - t0, "construct_s": t_ready - t_import, "first_token_s": t_token - t_ready,
    "total_s": t_token - t0, "num_pages": pool.num_pages, "page_size": cfg.page_size,
    "pool_tokens": pool.num_pages * cfg.page_size, "pool_gib": pool.gib,
    "sized_by": "kv_cache_memory_bytes" if jax.devices()[0].platform == "cpu" else "gpu_memory_utilization",
    "max_model_len": llm.engine.max_model_len, "max_num_seqs": cfg.max_num_seqs,
    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small model with the real context (default: off)")
    parser.add_argument("--out", default="docs/benchmarks", help="output folder when $OUT is unset (default: docs/benchmarks)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(json.dumps(TINY if args.tiny else LLAMA31_8B))
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}  # every default
    child = subprocess.run([sys.executable, "-c", CHILD, folder], capture_output=True, text=True, cwd=ROOT, env=env)
    line = [x for x in child.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        sys.exit(f"the engine did not start:\n{child.stderr[-3000:]}")
    result = json.loads(line[0][len("RESULT "):])
    result["date"] = datetime.date.today().isoformat()
    result["model"] = "tiny, 131072 context" if args.tiny else "Llama-3.1-8B config, dummy weights"
    result["log"] = [x for x in child.stderr.splitlines() if "KV cache" in x]
    out = Path(os.environ.get("OUT", args.out))
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['date']}_{result['device'].replace(' ', '-')}_defaults{'_tiny' if args.tiny else ''}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    rows = [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in result.items() if k != "log"]
    (out / f"{stem}.md").write_text("| figure | value |\n|---|---|\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
