"""Exact MTP with the MoE MTP layer (DeepSeek-V3 naming: a full MLA + MoE decoder layer
at model.layers.{L}): the layer against a float64 transformers reference, greedy
speculation equal to plain decoding, chunk invariance of the draft latent, first drafts
and acceptance (and the sampled-boundary ablation breaking it), prefix-cache hits and
preemption."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from conftest import assert_no_leaks, greedy, prompt_logits, token_ids, until_prefill_emits
from jaxmtp import LLM
from test_moe_models import make_moe_model
from tolerances import assert_within, logprob_bound, reordered_model_bound

PAGE = 8
CHUNKS = [1, 3, PAGE - 1, PAGE, PAGE + 1, None]  # None: the whole prompt in one chunk
L = 2  # main layers: 0 dense, 1 experts; the MTP layer (index 2) has experts too
# one engine shape for every test (their steps share compiled programs): a pool of 24
# pages holds the chunk and greedy tests' requests, and makes the preemption test's preempt
# short contexts: the CPU attention reads a row's whole page table
ENGINE = dict(page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=16, num_pages=24, max_model_len=128)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny DeepSeek-V3 (q_lora, YaRN, groups and bias) with its MTP layer."""
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "deepseek-mtp", "deepseek-qlora-yarn")


def make_mtp_checkpoint(folder, family: str, seed: int = 20261201, max_shard_size="50GB", **overrides):
    """A tiny model of one family with one MTP layer, saved as the real checkpoints
    (DeepSeek-V3, GLM-4.5) ship it: the decoder layer at model.layers.{L} with enorm,
    hnorm, eh_proj, shared_head.norm, and copies of embed_tokens and the LM head (in a
    shard of their own, listed in model.safetensors.index.json, when the body is
    sharded). overrides change the config (make_moe_model). Returns the folder, a
    float64 transformers model of L + 1 layers whose last layer is the MTP layer's
    decoder block, and the MTP-only tensors.

    So that drafts are often accepted (else per-position acceptance is all zeros and
    its invariance says nothing), every layer writes only a small update into the
    residual (o_proj and down_proj scaled by 0.05): the main model is then close to a
    bigram model, and the MTP layer, reading mostly the next token's embedding
    (eh_proj near [I, 0]) and ending in the main model's final norm, predicts the token
    after it much as the main model will."""
    folder, hf = make_moe_model(folder, family, seed, num_layers=L + 1, max_shard_size=max_shard_size, **overrides)
    with torch.no_grad():
        for name, w in hf.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                w.mul_(0.05)
    tensors = {}
    for shard in sorted(folder.glob("model*.safetensors")):
        stored = load_file(shard)
        stored = {name: w * np.float32(0.05) if "o_proj" in name or "down_proj" in name else w for name, w in stored.items()}
        save_file(stored, str(shard), metadata={"format": "pt"})
        tensors.update(stored)
    rng = np.random.default_rng(seed)
    h = hf.config.hidden_size
    p = f"model.layers.{L}"
    extra = {
        f"{p}.enorm.weight": 1 + 0.05 * rng.standard_normal(h),
        f"{p}.hnorm.weight": 1 + 0.3 * rng.standard_normal(h),
        f"{p}.eh_proj.weight": np.concatenate([np.eye(h), np.zeros((h, h))], axis=1) + 0.02 * rng.standard_normal((h, 2 * h)),
        f"{p}.shared_head.norm.weight": tensors["model.norm.weight"] * (1 + 0.05 * rng.standard_normal(h)),
    }
    extra = {name: w.astype(np.float32) for name, w in extra.items()}
    copies = {f"{p}.shared_head.head.weight": tensors["lm_head.weight"],
              f"{p}.embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        save_file({**extra, **copies}, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
        listing = json.loads(index.read_text())
        listing["weight_map"].update({name: "model-mtp.safetensors" for name in {**extra, **copies}})
        index.write_text(json.dumps(listing))
    else:
        save_file({**tensors, **extra, **copies}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(config))
    hf.set_experts_implementation("eager")  # the grouped-mm default has no float64
    hf = hf.double().eval()
    hf.model.config.num_hidden_layers = L  # the main model's forward stops before the MTP layer
    return folder, hf, {name: torch.tensor(w, dtype=torch.float64) for name, w in extra.items()}


@pytest.fixture(scope="module")
def plain(mtp_model):
    return LLM(mtp_model[0], **ENGINE)


def make_llm(folder, **kwargs) -> LLM:
    return LLM(folder, **{**ENGINE, **kwargs})


def random_prompts(rng, lengths):
    return [[1] + rng.integers(3, 97, size=n - 1).tolist() for n in lengths]


def draft_cache_rows(engine, pages, length) -> np.ndarray:
    """The MTP layer's latent and rope key at positions 0..length-1: [length, R + Dr]."""
    slots = np.array([pages[i // PAGE] * PAGE + i % PAGE for i in range(length)])
    layer = engine.model_config.num_layers
    latent, rope = (np.asarray(x[layer]).reshape(-1, x[layer].shape[-1])[slots] for x in (engine.cache.k, engine.cache.v))
    return np.concatenate([latent, rope], axis=1)


def latent_bound(ref_rows) -> float:
    """How far the MTP layer's draft latent may move between two chunkings or cache hits
    (tolerances.reordered_model_bound): L main layers and the MTP layer, sums of at most
    64 terms (the models' widths, eh_proj's 2 x 32 the widest, and these contexts)."""
    return reordered_model_bound(float(np.abs(ref_rows).max()), L + 1, 64)


def prefill_state(llm: LLM, prompt):
    """Run one request until its prefill emits: (draft latent rows, first drafts,
    the sampled token), then drop it."""
    engine = llm.engine
    seq = until_prefill_emits(engine, prompt)
    state = draft_cache_rows(engine, seq.pages, len(prompt)), list(seq.drafts), seq.output_token_ids[0]
    engine.abort_request("probe")
    engine.step()
    return state


def mtp_reference(hf, extra, prompt, sampled):
    """The MTP module over the prompt in float64 (transformers' layers): the latent its
    attention writes at every position and the first draft at the last row."""
    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps)

    p = f"model.layers.{L}"
    n = len(prompt)
    latents = []
    layer = hf.model.layers[L]
    hook = layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, i, out: latents.append(out))
    try:
        with torch.no_grad():
            hidden = hf.model(torch.tensor([prompt])).last_hidden_state  # after the final norm
            embed = hf.model.embed_tokens(torch.tensor([prompt[1:] + [sampled]]))
            x = torch.cat([rms(embed, extra[f"{p}.enorm.weight"]), rms(hidden, extra[f"{p}.hnorm.weight"])], -1)
            x = x @ extra[f"{p}.eh_proj.weight"].T
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            latents.clear()
            out = layer(x, attention_mask=mask, position_ids=positions,
                        position_embeddings=hf.model.rotary_emb(x, positions))
            logits = rms(out, extra[f"{p}.shared_head.norm.weight"]) @ hf.lm_head.weight.T
    finally:
        hook.remove()
    return latents[0][0].numpy(), int(logits[0, -1].argmax())


def test_mtp_layer_matches_the_float64_reference(mtp_model, rng):
    """The draft latent at every prompt position and the first draft, whole and in
    chunks of 3; the layer's copies of the embedding and head are not loaded."""
    folder, hf, extra = mtp_model
    prompt = random_prompts(rng, [27])[0]
    for chunk in (None, 3):
        llm = make_llm(folder, num_speculative_tokens=1, prefill_chunk_size=chunk)
        assert llm.engine.params.mtp[0].lm_head is None
        rows, drafts, sampled = prefill_state(llm, prompt)
        latent, draft = mtp_reference(hf, extra, prompt, sampled)
        assert_within(rows[:, : latent.shape[1]], latent, latent_bound(latent), f"chunk={chunk}")  # float32 vs float64
        assert drafts == [draft], f"chunk={chunk} prompt={prompt}"


# k = 1 drafts once; k = 2 chains the one MTP layer (every test here drafts with k = 1 or
# 2, so that their steps share compiled programs)
@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_mtp_equals_without(mtp_model, plain, rng, k):
    """Chunks of 3 (the whole prompt in one chunk: the chunk-invariance test's reference)."""
    prompts = random_prompts(rng, [3, 30, 17])
    expected = token_ids(plain.generate(prompts, greedy(24), use_tqdm=False))
    llm = make_llm(mtp_model[0], num_speculative_tokens=k, prefill_chunk_size=3)
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    assert token_ids(outs) == expected, f"k={k} prompts={prompts}"
    accepted = np.sum([o.spec_stats["accepted_per_position"] for o in outs], axis=0)
    assert accepted[0] > 0, accepted  # verification accepts drafts, not only rejects them
    assert_no_leaks(llm)


def acceptance_per_position(llm, prompts):
    return [o.spec_stats["accepted_per_position"] for o in llm.generate(prompts, greedy(40), use_tqdm=False)]


def test_chunk_invariance_and_the_sampled_ablation_breaks_it(mtp_model, rng):
    folder = mtp_model[0]
    k = 2
    prompts = random_prompts(rng, [30, 21])
    reference = make_llm(folder, num_speculative_tokens=k)
    ref_states = [prefill_state(reference, p) for p in prompts]
    ref_accept = acceptance_per_position(reference, prompts)
    for chunk in CHUNKS[:-1]:
        llm = make_llm(folder, num_speculative_tokens=k, prefill_chunk_size=chunk)
        for (ref_rows, ref_first, _), prompt in zip(ref_states, prompts):
            rows, first, _ = prefill_state(llm, prompt)
            assert_within(rows, ref_rows, latent_bound(ref_rows), f"chunk={chunk}")
            assert first == ref_first, f"chunk={chunk}"
        assert acceptance_per_position(llm, prompts) == ref_accept, f"chunk={chunk}"

    # the pre-fix behaviour writes the sampled token's draft latent at the last row of
    # every non-final chunk where the sample is not the next prompt token
    ablation = make_llm(folder, num_speculative_tokens=k, prefill_chunk_size=3, mtp_boundary="sampled")
    differs = 0
    for (ref_rows, _, _), prompt in zip(ref_states, prompts):
        rows, _, _ = prefill_state(ablation, prompt)
        row_differs = np.abs(rows - ref_rows).max(axis=1) > latent_bound(ref_rows)
        assert set(np.flatnonzero(row_differs)) <= set(range(2, len(prompt) - 1, 3))
        differs += row_differs.sum()
    assert differs > 0, "the ablation never differed: the test cannot tell the fix from the bug"


def run_alone(llm, prompt, max_tokens):
    """One greedy request to the end: its output and its draft rows right after prefill."""
    engine = llm.engine
    engine.add_request("alone", prompt, greedy(max_tokens))
    rows, out = None, None
    while out is None:
        out = next((o for o in engine.step() if o.finished), None)
        seq = engine.requests["alone"].seqs[0] if "alone" in engine.requests else None
        if rows is None and seq is not None and seq.output_token_ids:
            rows = draft_cache_rows(engine, seq.pages, len(prompt)), list(seq.drafts)
    return out, rows


def test_prefix_cache_hit_gives_the_no_cache_drafts(mtp_model, rng):
    """A second prompt diverging from the first exactly at a page's end: with the cache,
    its draft latent at every position, first drafts, tokens and acceptance equal the
    no-cache run's; the stale-page ablation changes the page's last draft row."""
    folder = mtp_model[0]
    first = random_prompts(rng, [34])[0]
    shared = 3 * PAGE
    second = first[:shared] + [(first[shared] + 1 - 3) % 94 + 3] + random_prompts(rng, [9])[0][1:]
    no_cache = make_llm(folder, num_speculative_tokens=2)
    ref_out, (ref_rows, ref_first) = run_alone(no_cache, second, 24)
    for mode in ("exact", "stale"):
        llm = make_llm(folder, num_speculative_tokens=2, enable_prefix_caching=True, prefix_cache_boundary=mode)
        run_alone(llm, first, 24)
        out, (rows, drafts) = run_alone(llm, second, 24)
        assert llm.engine.stats.prefix_cache.hits > 0
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids, mode
        row_differs = np.abs(rows - ref_rows).max(axis=1) > latent_bound(ref_rows)
        if mode == "stale":
            assert np.flatnonzero(row_differs).tolist() == [shared - 1], "the test cannot tell the fix from the bug"
        else:
            assert_within(rows, ref_rows, latent_bound(ref_rows), mode)
            assert drafts == ref_first
            assert out.spec_stats["accepted_per_position"] == ref_out.spec_stats["accepted_per_position"]
        assert_no_leaks(llm)


def test_greedy_with_mtp_equals_without_under_preemption(mtp_model, plain, rng):
    prompts = random_prompts(rng, [30, 25, 20, 28])
    expected = token_ids(plain.generate(prompts, greedy(48), use_tqdm=False))
    llm = make_llm(mtp_model[0], num_speculative_tokens=2, prefill_chunk_size=7)
    assert token_ids(llm.generate(prompts, greedy(48), use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_glm_mtp_layer_drafts_exactly(tmp_path, mtp_model, rng):
    """GLM-4.5's MTP layer (GQA with partial rotary, q/k norm, biases; experts) in the
    same naming: greedy speculation equals plain decoding, and first drafts and
    acceptance do not depend on the chunk size."""
    folder = make_mtp_checkpoint(tmp_path / "glm-mtp", "glm4-moe")[0]
    prompts = random_prompts(rng, [19, 26])
    expected = token_ids(make_llm(folder).generate(prompts, greedy(24), use_tqdm=False))
    states, accepted = [], []
    for chunk in (3, None):
        llm = make_llm(folder, num_speculative_tokens=2, prefill_chunk_size=chunk)
        assert llm.engine.params.mtp[0].lm_head is None
        states.append([prefill_state(llm, p)[1] for p in prompts])
        outs = llm.generate(prompts, greedy(24), use_tqdm=False)
        assert token_ids(outs) == expected, f"chunk={chunk} prompts={prompts}"
        accepted.append([o.spec_stats["accepted_per_position"] for o in outs])
    assert states[0] == states[1] and accepted[0] == accepted[1], (states, accepted)
    assert np.sum(accepted[0]) > 0, accepted


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(mtp_model, rng):
    """A seeded request samples the same tokens, with the same log-probabilities,
    alone and beside others: the experts' grouped matmul mixes the rows of every
    request, and none may leak into another."""
    from jaxmtp import SamplingParams

    llm = make_llm(mtp_model[0], num_speculative_tokens=2, prefill_chunk_size=7)
    prompts = random_prompts(rng, [23, 11, 30])
    seed = int(rng.integers(1 << 30))
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=seed + i, ignore_eos=True, logprobs=0)
              for i in range(3)]

    def tokens_and_logprobs(outs):
        return [(o.outputs[0].token_ids, [next(iter(e.values())).logprob for e in o.outputs[0].logprobs]) for o in outs]

    together = tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
    alone = [tokens_and_logprobs(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
    for prompt, (tokens, logprobs), (alone_tokens, alone_logprobs) in zip(prompts, together, alone):
        assert tokens == alone_tokens, f"seed={seed}"
        # two float32 evaluations in batches of other shapes, each within logprob_bound
        # (L layers; sums of at most 64 terms, as latent_bound says)
        bound = 2 * logprob_bound(prompt_logits(llm.engine, prompt + tokens[:-1]), L, 64)
        assert_within(logprobs, alone_logprobs, bound, f"seed={seed}")
    assert_no_leaks(llm)
