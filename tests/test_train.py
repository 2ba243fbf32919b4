"""train-mtp: the loss falls, interrupted training resumes exactly, and the exported
head runs in the engine with output equal to running without it."""

from __future__ import annotations

import jax
import numpy as np

from conftest import STORIES
from jaxmtp import LLM, SamplingParams
from jaxmtp.train import TrainConfig, Trainer, pad_sequences, self_distillation_corpus

CONFIG = TrainConfig(steps=12, batch_size=4, seq_len=40, depths=2, learning_rate=3e-3, warmup_steps=2,
                     eval_every=6, checkpoint_every=6)


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

    # stop after 5 steps, then resume in a fresh trainer: the same params as the straight run
    half = Trainer(llm.engine.params, llm.engine.model_config, CONFIG)
    half.fit(tokens, lengths, tokens[:2], lengths[:2], checkpoint_dir=tmp_path / "resumed", progress=False, stop_at=5)
    resumed_trainer = Trainer(llm.engine.params, llm.engine.model_config, CONFIG)
    resumed, _ = resumed_trainer.fit(tokens, lengths, tokens[:2], lengths[:2], checkpoint_dir=tmp_path / "resumed",
                                     progress=False)
    for a, b in zip(jax.tree.leaves(state.module), jax.tree.leaves(resumed.module)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    out = trainer.export(state.module, tmp_path / "ckpt", STORIES)
    spec = LLM(out, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=32)
    plain = LLM(out, max_num_seqs=2, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    a = spec.generate("Lily saw a", params, use_tqdm=False)[0]
    b = plain.generate("Lily saw a", params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.spec_stats["drafted"] > 0
