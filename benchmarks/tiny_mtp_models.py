"""Tiny models of the MTP families, trained here on the CPU for the reproductions: a
Qwen3-Next-shaped hybrid (gated DeltaNet linear attention, gated full attention, experts
with a gated shared expert, one MTP layer) and a DeepSeek-V3-shaped MoE (MLA, experts,
one MTP module), both on stories260K's tokenizer and its stories.

Random weights write text no MTP module can learn to draft (a random model's next token
is a hash of its context: an MTP layer trained on such a base's text reached 3% top-1),
so the base is trained first: jaxmtp.train.train_base on
stories that checkpoints/stories260K writes itself; then its MTP module with
jaxmtp.train.Trainer on stories the trained base writes itself (greedy and sampled), as
for stories260K-mtp. A few minutes each on 2 CPU cores.

    python benchmarks/tiny_mtp_models.py qwen3_next /tmp/tiny-qwen3-next
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STORIES = ROOT / "checkpoints" / "stories260K"
SHARED = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 1024,
          "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu"}
CONFIGS = {
    "qwen3_next": {
        **SHARED, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
        "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "attention_bias": False, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
    },
    "deepseek_v3": {
        **SHARED, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "q_lora_rank": None,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    },
}
ENGINE = dict(page_size=16, max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=1024)


def stories(llm, prompts: list[str], samples: int, max_tokens: int, seed: int) -> tuple:
    """(tokens, lengths) of stories the model writes itself (jaxmtp.train's corpus)."""
    from jaxmtp.train import pad_sequences, self_distillation_corpus

    return pad_sequences(self_distillation_corpus(llm, prompts, samples, max_tokens, seed), max_tokens + 16)


def make_trained_model(family: str, out: Path, base_steps: int = 300, mtp_steps: int = 300, seed: int = 0) -> Path:
    """The family's tiny base trained on stories260K's stories, plus its MTP module
    trained on the base's own, as an engine checkpoint in out; returns out."""
    from jaxmtp import LLM
    from jaxmtp.loading.loader import load_params, save_checkpoint
    from jaxmtp.models.registry import load_config
    from jaxmtp.train import TRAIN_NAMES, TRAIN_OPENINGS, TrainConfig, Trainer, story_prompts, train_base

    prompts = story_prompts(TRAIN_NAMES, TRAIN_OPENINGS)
    tokens, lengths = stories(LLM(STORIES, **{**ENGINE, "max_model_len": 512}), prompts, 4, 240, seed)
    work = Path(tempfile.mkdtemp())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, work / name)
    (work / "config.json").write_text(json.dumps(CONFIGS[family]))
    cfg = load_config(work)
    params = load_params(work, cfg, load_format="dummy", seed=seed)
    config = TrainConfig(steps=base_steps, batch_size=16, seq_len=tokens.shape[1], learning_rate=3e-3,
                         warmup_steps=50, seed=seed)
    params, losses = train_base(params, cfg, tokens, lengths, config)
    print(f"{family}: base loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.3f} over {base_steps} steps", flush=True)
    base = save_checkpoint(work / "base", params, cfg, work)
    corpus, corpus_lengths = stories(LLM(base, **ENGINE), prompts, 8, 240, seed + 1)
    mtp = TrainConfig(steps=mtp_steps, batch_size=16, seq_len=corpus.shape[1], depths=2, soft_targets=True,
                      warmup_steps=50, eval_every=mtp_steps, checkpoint_every=mtp_steps, seed=seed)
    trainer = Trainer(params, cfg, mtp)
    held_out = max(1, len(corpus) // 10)
    state, history = trainer.fit(corpus[held_out:], corpus_lengths[held_out:], corpus[:held_out],
                                 corpus_lengths[:held_out])
    print(f"{family}: MTP held-out top-1 per depth {history['eval_accuracy'][-1]}", flush=True)
    trainer.export(state.module, out, work)
    shutil.rmtree(work)
    return out


if __name__ == "__main__":
    print(make_trained_model(sys.argv[1], Path(sys.argv[2])))
