"""train-mtp: the loss falls, interrupted training resumes exactly, and the exported
head runs in the engine with output equal to running without it and drafts the engine
accepts on held-out prompts (a head trained against the wrong targets, e.g. one token
early, scores well on its own evaluation but its drafts are rarely accepted)."""

from __future__ import annotations

import jax
import numpy as np

from conftest import STORIES
from jaxmtp import LLM, SamplingParams
from jaxmtp.train import HELD_OUT_NAMES, HELD_OUT_OPENINGS, TrainConfig, Trainer, pad_sequences, self_distillation_corpus, story_prompts

CONFIG = TrainConfig(steps=30, batch_size=4, seq_len=40, depths=2, learning_rate=3e-3, warmup_steps=2,
                     eval_every=15, checkpoint_every=15)


def corpus(llm):
    sequences = self_distillation_corpus(llm, ["Once upon a time", "Tom had a"], 4, 40, seed=0)
    return pad_sequences(sequences, CONFIG.seq_len)


def test_train_resume_and_export(tmp_path):
    llm = LLM(STORIES, max_num_seqs=8, max_num_batched_tokens=128)
    tokens, lengths = corpus(llm)
    trainer = Trainer(llm.engine.params, llm.engine.model_config, CONFIG)
    state, history = trainer.fit(tokens, lengths, tokens[:2], lengths[:2], checkpoint_dir=tmp_path / "straight",
                                 progress=False)
    assert history["loss"][-1] < 0.8 * history["loss"][0]
    assert len(history["eval_accuracy"]) == 2

    # stop after 10 steps, then resume in a fresh trainer: the same params as the straight run
    half = Trainer(llm.engine.params, llm.engine.model_config, CONFIG)
    half.fit(tokens, lengths, tokens[:2], lengths[:2], checkpoint_dir=tmp_path / "resumed", progress=False, stop_at=10)
    resumed_trainer = Trainer(llm.engine.params, llm.engine.model_config, CONFIG)
    resumed, _ = resumed_trainer.fit(tokens, lengths, tokens[:2], lengths[:2], checkpoint_dir=tmp_path / "resumed",
                                     progress=False)
    for a, b in zip(jax.tree.leaves(state.module), jax.tree.leaves(resumed.module)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    out = trainer.export(state.module, tmp_path / "ckpt", STORIES)
    spec = LLM(out, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=32)
    plain = LLM(out, max_num_seqs=2, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = story_prompts(HELD_OUT_NAMES[:2], HELD_OUT_OPENINGS[:2])
    a = spec.generate(prompts, params, use_tqdm=False)
    b = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # Held-out acceptance of the first draft: this run's head is accepted 26 times in 125;
    # trained one token early (targets tokens[i + d] in place of tokens[i + d + 1]) 12 in
    # 144 (everything here is seeded and greedy: the numbers are the same every run).
    drafted = sum(o.spec_stats["num_steps"] for o in a)
    accepted_first = sum(o.spec_stats["accepted_per_position"][0] for o in a)
    assert accepted_first / drafted > 0.12, (accepted_first, drafted)


def test_hybrid_base_model_trains_and_exports(tmp_path):
    """A Qwen3-Next base (linear attention with its recurrent state, gated attention,
    experts): the trainer's frozen main model gives transformers' logits for a batch of
    sequences (each from a zero state; the MTP layer's loss runs on it, as for the other
    families), a few steps of train_base lower the base's own loss, and an exported MTP
    layer (started from the checkpoint's block) drafts in the engine."""
    import jax.numpy as jnp
    import torch

    from conftest import fresh_rng
    from jaxmtp.loading.loader import load_params
    from jaxmtp.models.registry import load_config
    from jaxmtp.train import depth_logits, train_base
    from test_hybrid_models import make_hybrid

    rng = fresh_rng()
    folder, model = make_hybrid(tmp_path / "next", "qwen3_next", rng)
    cfg = load_config(folder)
    params = load_params(folder, cfg)
    tokens, lengths = pad_sequences([rng.integers(3, 128, 24).tolist() for _ in range(3)], 24)
    config = TrainConfig(steps=6, batch_size=3, seq_len=24, depths=1, warmup_steps=1, learning_rate=1e-2)
    trainer = Trainer(params, cfg, config, page_size=4)
    logits_of = jax.jit(depth_logits, static_argnums=(2, 4, 5))  # compiled: eager runs op by op, slower
    _, teacher = logits_of(trainer.params, trainer.init_state().module, trainer.cfg, jnp.asarray(tokens), 1, 4)
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    # teacher[0][:, i] is the main model's logits at i + 1 (the token depth 1 predicts)
    got = np.asarray(teacher[0])[:, :-1]
    np.testing.assert_allclose(got, want[:, 1:], rtol=0, atol=1e-4 * np.abs(want).max())
    # the base itself: a few steps on the same three sequences lower its loss on them
    trained, losses = train_base(params, cfg, tokens, lengths, config, page_size=4, progress=False)
    assert losses[-1] < 0.85 * losses[0], losses
    assert trained.mtp is params.mtp  # the MTP module is not the base's to train
    out = trainer.export(trainer.init_state().module, tmp_path / "ckpt", folder)
    llm = LLM(out, num_speculative_tokens=1, max_num_seqs=2, max_num_batched_tokens=32, page_size=4, max_model_len=56)
    spec = llm.generate([row[:10].tolist() for row in tokens[:2]],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 and o.spec_stats["drafted"] > 0 for o in spec)
