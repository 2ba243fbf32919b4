"""MTP checkpoint layouts (MiMo and DeepSeek naming) against an independent NumPy reference.

Tiny checkpoints are written by hand (safetensors + config.json) with random norms and
biases, so a mixed-up norm, a swapped concat order or the wrong pre/post-final-norm
hidden state changes the draft logits. The reference below is float64 NumPy and shares
no code with jaxmtp.models.model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxmtp import LLM, SamplingParams
from tolerances import assert_within, logits_bound, reordered_model_bound

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 32, 4, 2, 8, 48, 61, 2
EPS, THETA = 1e-6, 10000.0
AGREE_EPS = 0.02  # how far the "agreeing" checkpoints are from an exact bigram model

# name -> (model_type, MTP tensor layout, ships shared_head.head)
LAYOUTS = {
    "mimo": ("mimo", "mimo", False),
    "deepseek-own-head": ("llama", "deepseek", True),
    "deepseek-shared-head": ("llama", "deepseek", False),
}


# ----- hand-built checkpoints -----------------------------------------------------------


def _block_tensors(rng, prefix: str, bias: bool) -> dict[str, np.ndarray]:
    """One decoder block in Hugging Face naming ([out, in] matrices)."""

    def mat(n_out, n_in):
        return rng.normal(0.0, 1.0 / math.sqrt(n_in), (n_out, n_in))

    def norm():
        return 1.0 + 0.3 * rng.normal(size=HIDDEN)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {
        f"{prefix}.input_layernorm.weight": norm(),
        f"{prefix}.self_attn.q_proj.weight": mat(q, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": mat(kv, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": mat(kv, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": mat(HIDDEN, q),
        f"{prefix}.post_attention_layernorm.weight": norm(),
        f"{prefix}.mlp.gate_proj.weight": mat(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": mat(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": mat(HIDDEN, INTER),
    }
    if bias:
        t[f"{prefix}.self_attn.q_proj.bias"] = 0.3 * rng.normal(size=q)
        t[f"{prefix}.self_attn.k_proj.bias"] = 0.3 * rng.normal(size=kv)
        t[f"{prefix}.self_attn.v_proj.bias"] = 0.3 * rng.normal(size=kv)
    return t


def _module_prefix(mtp_layout: str, n: int) -> str:
    """Tensor name prefix of MTP module n (0-based) in a layout."""
    return f"model.mtp_layers.{n}" if mtp_layout == "mimo" else f"model.layers.{LAYERS + n}"


def make_checkpoint(
    path: Path, layout: str, rng: np.random.Generator, config_extra: dict | None = None, agree: bool = False,
    num_modules: int = 1,
) -> Path:
    """agree=True: a main model that is nearly a bigram model (attention and MLP outputs
    scaled down) and MTP modules that nearly pass the token's embedding through to the
    main head, so drafts are mostly accepted. Otherwise everything is random."""
    model_type, mtp_layout, own_head = LAYOUTS[layout]
    bias = model_type == "mimo"

    def norm():
        return 1.0 + 0.3 * rng.normal(size=HIDDEN)

    t = {
        "model.embed_tokens.weight": rng.normal(size=(VOCAB, HIDDEN)),
        "model.norm.weight": norm(),
        "lm_head.weight": rng.normal(0.0, 1.0 / math.sqrt(HIDDEN), (VOCAB, HIDDEN)),  # untied
    }
    for i in range(LAYERS):
        t.update(_block_tensors(rng, f"model.layers.{i}", bias))
        if agree:
            t[f"model.layers.{i}.self_attn.o_proj.weight"] *= AGREE_EPS
            t[f"model.layers.{i}.mlp.down_proj.weight"] *= AGREE_EPS
    for n in range(num_modules):
        p = _module_prefix(mtp_layout, n)
        proj = rng.normal(0.0, 1.0 / math.sqrt(2 * HIDDEN), (HIDDEN, 2 * HIDDEN))
        if mtp_layout == "mimo":
            t[f"{p}.token_layernorm.weight"] = norm()
            t[f"{p}.hidden_layernorm.weight"] = norm()
            t[f"{p}.input_proj.weight"] = proj  # over concat(hidden, embedding)
            t[f"{p}.final_layernorm.weight"] = norm()
        else:
            t[f"{p}.enorm.weight"] = norm()
            t[f"{p}.hnorm.weight"] = norm()
            t[f"{p}.eh_proj.weight"] = proj  # over concat(embedding, hidden)
            t[f"{p}.shared_head.norm.weight"] = norm()
            if own_head:
                t[f"{p}.shared_head.head.weight"] = rng.normal(0.0, 1.0 / math.sqrt(HIDDEN), (VOCAB, HIDDEN))
        t.update(_block_tensors(rng, p, bias))
        if agree:  # module n+1 at position i passes token i+n+1 on: the bigram predicts token i+n+2
            t[f"{p}.self_attn.o_proj.weight"] *= AGREE_EPS
            t[f"{p}.mlp.down_proj.weight"] *= AGREE_EPS
            eye, small = np.eye(HIDDEN), AGREE_EPS * proj[:, :HIDDEN]
            t[f"{p}.{'input_proj' if mtp_layout == 'mimo' else 'eh_proj'}.weight"] = (
                np.concatenate([small, eye] if mtp_layout == "mimo" else [eye, small], axis=1)
            )
            t[f"{p}.{'token_layernorm' if mtp_layout == 'mimo' else 'enorm'}.weight"] = np.ones(HIDDEN)
            t[f"{p}.{'final_layernorm' if mtp_layout == 'mimo' else 'shared_head.norm'}.weight"] = t["model.norm.weight"]
            if own_head:
                t[f"{p}.shared_head.head.weight"] = t["lm_head.weight"]

    config = {
        "model_type": model_type,
        "architectures": ["MiMoForCausalLM" if model_type == "mimo" else "LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 128,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": num_modules,
        "torch_dtype": "float32",
    }
    if model_type == "mimo":
        config["use_sliding_window"] = False
    else:
        config["attention_bias"] = False
    config.update(config_extra or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# ----- independent float64 reference ------------------------------------------------------


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _rope(x, positions):
    inv_freq = 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, D]
    half = HEAD_DIM // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def _block(w, p, x):
    """Pre-norm Llama/Qwen2 block with causal GQA attention over all rows of x. Returns
    the output and the block's K (after RoPE) and V rows [n, KV_HEADS, HEAD_DIM]."""
    n = x.shape[0]
    h = _rms(x, w[f"{p}.input_layernorm.weight"])
    q = h @ w[f"{p}.self_attn.q_proj.weight"].T
    k = h @ w[f"{p}.self_attn.k_proj.weight"].T
    v = h @ w[f"{p}.self_attn.v_proj.weight"].T
    if f"{p}.self_attn.q_proj.bias" in w:
        q = q + w[f"{p}.self_attn.q_proj.bias"]
        k = k + w[f"{p}.self_attn.k_proj.bias"]
        v = v + w[f"{p}.self_attn.v_proj.bias"]
    pos = np.arange(n)
    q = _rope(q.reshape(n, HEADS, HEAD_DIM), pos)
    k = _rope(k.reshape(n, KV_HEADS, HEAD_DIM), pos)
    v = v.reshape(n, KV_HEADS, HEAD_DIM)
    group = HEADS // KV_HEADS
    kq, vq = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # q head j reads kv head j // group
    scores = np.einsum("thd,shd->hts", q, kq) / math.sqrt(HEAD_DIM)
    scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, vq).reshape(n, HEADS * HEAD_DIM)
    x = x + out @ w[f"{p}.self_attn.o_proj.weight"].T
    h = _rms(x, w[f"{p}.post_attention_layernorm.weight"])
    gate = h @ w[f"{p}.mlp.gate_proj.weight"].T
    up = h @ w[f"{p}.mlp.up_proj.weight"].T
    return x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"{p}.mlp.down_proj.weight"].T, k, v


def _reference_run(folder: Path, layout: str, ids, chain, modules: int, swap_order: bool, flip_norm: bool):
    """Main logits [L, V], and per module n = 1..modules its (draft logits, K, V) over its rows."""
    w = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    _, mtp_layout, own_head = LAYOUTS[layout]
    ids = np.asarray(ids)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        x, _, _ = _block(w, f"model.layers.{i}", x)
    pre, post = x, _rms(x, w["model.norm.weight"])
    main_logits = post @ w["lm_head.weight"].T

    if mtp_layout == "mimo":
        token_norm, hidden_norm, proj, final = "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"
        hidden_first, after_norm = True, False
    else:
        token_norm, hidden_norm, proj, final = "enorm", "hnorm", "eh_proj", "shared_head.norm"
        hidden_first, after_norm = False, True
    hidden_first ^= swap_order
    after_norm ^= flip_norm

    def module_input(p, hidden, tokens):
        e = _rms(w["model.embed_tokens.weight"][tokens], w[f"{p}.{token_norm}.weight"])
        h = _rms(hidden, w[f"{p}.{hidden_norm}.weight"])
        return np.concatenate([h, e] if hidden_first else [e, h], axis=-1) @ w[f"{p}.{proj}.weight"].T

    out, per_module = post if after_norm else pre, []
    for n in range(1, modules + 1):
        p = _module_prefix(mtp_layout, n - 1)
        rows = module_input(p, out[: len(ids) - n], ids[n:])  # row i reads token i+n
        out, k, v = _block(w, p, rows)
        if n == modules:
            for token in chain:  # causal: earlier rows' outputs do not change
                rows = np.concatenate([rows, module_input(p, out[-1:], np.asarray([token]))])
                out, k, v = _block(w, p, rows)
        own = mtp_layout == "deepseek" and own_head
        head = w[f"{p}.shared_head.head.weight"] if own else w["lm_head.weight"]
        per_module.append((_rms(out, w[f"{p}.{final}.weight"]) @ head.T, k, v))
    return main_logits, per_module


def reference(
    folder: Path, layout: str, ids: list[int], chain: list[int] = (), *, modules=1, swap_order=False, flip_norm=False
):
    """(main logits [L, V], draft logits of module `modules` [L-modules+len(chain), V]) in float64.

    Module 1's row i < L-1 reads (h_i, token_{i+1}) and predicts token_{i+2}; module n's
    row i reads module n-1's output at row i (before its final norm) and token_{i+n}, and
    predicts token_{i+n+1}, for every i with i+n < L. Each chained row then reads the last
    module's own output of the row before and the next chain token, one position further
    on. swap_order and flip_norm deliberately get the layout wrong, to show the comparison
    can fail."""
    main_logits, per_module = _reference_run(folder, layout, ids, chain, modules, swap_order, flip_norm)
    return main_logits, per_module[-1][0]


def reference_draft_kv(folder: Path, layout: str, ids: list[int], chain: list[int], modules: int) -> list:
    """Per module n = 1..modules, its K and V rows [2, L-n (+ len(chain) for the last), KV_HEADS, HEAD_DIM]."""
    _, per_module = _reference_run(folder, layout, ids, chain, modules, False, False)
    return [np.stack([k, v]) for _, k, v in per_module]


def build(tmp_path: Path, layout: str, rng, agree: bool = False, num_modules: int = 1, **config_extra) -> Path:
    return make_checkpoint(tmp_path / layout, layout, rng, config_extra, agree, num_modules)


# ----- the engine's own functions ---------------------------------------------------------


def engine_draft_logits(engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Main and draft logits at every prompt position through the engine's paged path:
    model.forward, mtp.main_hidden_for_mtp, mtp.module_forward (the module's KV in cache
    layer cfg.num_layers), mtp.module_logits."""
    import jax.numpy as jnp

    from jaxmtp.models import model
    from jaxmtp.worker import mtp
    from jaxmtp.worker.batch import BatchShape, build_batch
    from jaxmtp.engine.scheduler import ScheduledRows
    from jaxmtp.engine.sequence import Sequence

    cfg, params, cache = engine.model_config, engine.params, engine.cache
    assert len(cache.k) == cfg.num_layers + 1
    ops = model.layer_ops(cfg, "reference")
    pages = engine.allocator.allocate(math.ceil(len(ids) / engine.page_size))
    try:
        seq = Sequence("score", list(ids), SamplingParams(), 0, 0, frozenset(), pages=pages)
        batch = build_batch(
            [ScheduledRows(seq, 0, list(ids), 0, True)], BatchShape(len(ids), 1),
            engine.max_pages_per_seq, engine.page_size, cache.num_slots, 0,
        )
        hidden, cache = model.forward(params, cfg, batch, cache, ops)
        main = model.logits(params.head(), params.final_norm, cfg, hidden)
        prev = mtp.main_hidden_for_mtp(params, cfg, hidden)
        next_ids = jnp.concatenate([batch.input_ids[1:], batch.input_ids[:1]])  # last row unused
        layer = cfg.num_layers
        module = params.mtp[0]
        x, _, _ = mtp.module_forward(
            module, params.embed, cfg, prev, next_ids, batch, cache.k[layer], cache.v[layer], ops
        )
        draft = mtp.module_logits(params, module, cfg, x)
    finally:
        engine.allocator.free(pages)
    return np.asarray(main), np.asarray(draft)[:-1]


def _prompt(rng, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


# ----- tests ------------------------------------------------------------------------------


def test_hand_built_config_selects_the_layout(tmp_path, rng):
    from jaxmtp.models.registry import load_config

    expected = {"mimo": ("mimo", True), "deepseek-own-head": ("deepseek", False)}
    for layout, (mtp_layout, bias) in expected.items():
        cfg = load_config(build(tmp_path, layout, rng))
        assert (cfg.mtp_layout, cfg.num_mtp_modules, cfg.qkv_bias) == (mtp_layout, 1, bias)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_draft_logits_match_numpy_reference(tmp_path, rng, layout):
    folder = build(tmp_path, layout, rng)
    llm = LLM(folder, num_speculative_tokens=1, max_num_seqs=2, max_num_batched_tokens=64)
    params = llm.engine.params
    assert (params.mtp[0].lm_head is not None) == LAYOUTS[layout][2]

    ids = _prompt(rng, 21)  # two KV pages of 16
    main, draft = engine_draft_logits(llm.engine, ids)
    ref_main, ref_draft = reference(folder, layout, ids)
    assert draft.shape == ref_draft.shape == (len(ids) - 1, VOCAB)
    # float32 against float64: LAYERS layers (and the module), sums of at most
    # max(INTER, 2 HIDDEN) terms (the module's projection of the concatenation)
    assert_within(main, ref_main, logits_bound(ref_main, LAYERS, max(INTER, 2 * HIDDEN)), "main")
    assert_within(draft, ref_draft, logits_bound(ref_draft, LAYERS + 1, max(INTER, 2 * HIDDEN)), "draft")

    # The comparison has teeth: a wrong concat order or the wrong pre/post-final-norm
    # hidden state moves the draft logits far beyond the tolerance.
    scale = np.abs(ref_draft).max()
    for wrong in (dict(swap_order=True), dict(flip_norm=True), dict(swap_order=True, flip_norm=True)):
        _, bad = reference(folder, layout, ids, **wrong)
        assert np.abs(draft - bad).max() > 0.05 * scale, wrong


def _is_argmax(logits: np.ndarray, token: int, num_layers: int) -> bool:
    """token is the largest of these float64 logits, or as close to it as float32 logits
    of num_layers decoder layers may lie (twice logits_bound: either may move)."""
    return bool(logits[token] >= logits.max() - 2 * logits_bound(logits, num_layers, max(INTER, 2 * HIDDEN)))


@pytest.mark.parametrize("agree", [False, True], ids=["random", "agreeing"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_speculative_greedy_equals_plain_greedy(tmp_path, rng, layout, agree):
    """Greedy with 2 MTP drafts emits exactly the tokens of greedy without speculation.
    Random weights: nearly every draft is rejected; agreeing weights: most are
    accepted, so both verify paths (reject, accept + bonus token) run."""
    folder = build(tmp_path, layout, rng, agree=agree)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [_prompt(rng, 4), _prompt(rng, 3)]
    plain = [o.outputs[0].token_ids for o in LLM(folder).generate(prompts, greedy, use_tqdm=False)]
    spec_llm = LLM(folder, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=64)
    engine, first_step = spec_llm.engine, []
    engine_step = engine.step

    def step():  # keep the first step's read-back output
        outputs = engine_step()
        if not first_step and engine.last_step_output is not None:
            first_step.append(engine.last_step_output)
        return outputs

    engine.step = step
    spec = spec_llm.generate(prompts, greedy, use_tqdm=False)

    # The first step prefills both prompts, samples token L of each and drafts from
    # (h_{L-1}, token L), then chains the module once on its own output.
    out = first_step[0]
    for i, (prompt, tokens) in enumerate(zip(prompts, plain)):
        sampled, drafts = int(out.tokens[i, 0]), [int(t) for t in out.drafts[i]]
        assert sampled == tokens[0]
        _, ref_draft = reference(folder, layout, prompt + [sampled], chain=drafts[:1])
        assert _is_argmax(ref_draft[-2], drafts[0], LAYERS + 1), (drafts, ref_draft[-2].argmax())
        assert _is_argmax(ref_draft[-1], drafts[1], LAYERS + 2), (drafts, ref_draft[-1].argmax())
    for tokens, o in zip(plain, spec):
        assert len(tokens) == 12
        assert o.outputs[0].token_ids == tokens
        stats = o.spec_stats
        assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
    if agree:  # typically 80-100 % accepted; near-ties in the bigram can cost a few
        accepted, drafted = (sum(o.spec_stats[key] for o in spec) for key in ("accepted", "drafted"))
        assert accepted >= drafted // 4, [o.spec_stats for o in spec]


def prefill_drafts(folder: Path, prompt: list[int], k: int, chunk: int | None):
    """Prefill one prompt in chunks of `chunk` (None: whole) on the engine and read, before
    any later step, the sampled token, the first k drafts and each MTP layer's K/V
    [2, rows, KV_HEADS, HEAD_DIM] at positions 0.. (the last drafting module's layer
    also at the chained positions after the prompt)."""
    llm = LLM(folder, num_speculative_tokens=k, prefill_chunk_size=chunk, max_num_seqs=1,
              max_num_batched_tokens=32, async_scheduling=False)
    engine = llm.engine
    engine.add_request("probe", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seq = None
    while seq is None or not seq.output_token_ids:
        engine.step()
        seq = engine.requests["probe"].seqs[0]
    m = engine.num_draft_modules
    kv = []
    for n in range(1, m + 1):
        rows = len(prompt) + (k - m if n == m else 0)
        slots = [seq.pages[i // engine.page_size] * engine.page_size + i % engine.page_size for i in range(rows)]
        kv.append(np.stack([np.asarray(x[LAYERS + n - 1]).reshape(-1, KV_HEADS, HEAD_DIM)[slots]
                            for x in (engine.cache.k, engine.cache.v)]))
    return seq.output_token_ids[0], list(seq.drafts), kv


@pytest.mark.parametrize("num_modules", [2, 3])
@pytest.mark.parametrize("layout", ["mimo", "deepseek-own-head"])
def test_n_modules_draft_as_the_numpy_reference_for_any_chunk_size(tmp_path, rng, layout, num_modules):
    """With N modules, depth j drafts with module j at the prompt's last position, on
    module j-1's output and draft j-1 (depth N+1 chains module N one position on); every
    module's draft KV at every prompt position matches the reference run over the prompt,
    the sampled token and the drafts, whatever the prefill chunk size."""
    folder = build(tmp_path, layout, rng, num_modules=num_modules)
    prompt = _prompt(rng, 21)  # two KV pages of 16
    for k in (num_modules, num_modules + 1):
        for chunk in (1, 3, None):
            sampled, drafts, kv = prefill_drafts(folder, prompt, k, chunk)
            known = prompt + [sampled] + drafts[: num_modules - 1]  # module j reads the token j ahead
            for j in range(1, num_modules + 1):
                _, logits = reference(folder, layout, known[: len(prompt) + j], modules=j)
                assert _is_argmax(logits[-1], drafts[j - 1], LAYERS + j), (k, chunk, j, drafts, logits[-1].argmax())
            chain = drafts[num_modules - 1 : k - 1]
            if chain:
                _, logits = reference(folder, layout, known, chain, modules=num_modules)
                assert _is_argmax(logits[-1], drafts[-1], LAYERS + num_modules + len(chain)), (k, chunk, drafts,
                                                                                     logits[-1].argmax())
            ref_kv = reference_draft_kv(folder, layout, known, chain, num_modules)
            for j, (got, want) in enumerate(zip(kv, ref_kv), 1):
                bound = reordered_model_bound(float(np.abs(want).max()), LAYERS + j, max(INTER, 2 * HIDDEN))
                assert_within(got, want[:, : got.shape[1]], bound, f"k={k} chunk={chunk} module {j}")


@pytest.mark.parametrize(
    "layout, missing",
    [
        ("mimo", "model.mtp_layers.0.input_proj.weight"),
        ("mimo", "model.mtp_layers.0.hidden_layernorm.weight"),
        ("deepseek-own-head", f"model.layers.{LAYERS}.eh_proj.weight"),
        ("deepseek-own-head", f"model.layers.{LAYERS}.shared_head.norm.weight"),
        ("deepseek-own-head", f"model.layers.{LAYERS}.self_attn.q_proj.weight"),
    ],
)
def test_missing_mtp_tensor_is_named(tmp_path, rng, layout, missing):
    folder = build(tmp_path, layout, rng)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[missing]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(repr(missing))):
        LLM(folder, num_speculative_tokens=1, max_num_seqs=2, max_num_batched_tokens=64)


def test_layout_override_reads_the_other_naming(tmp_path, rng):
    """jaxmtp_mtp_layout="deepseek" on a MiMo checkpoint looks for DeepSeek names."""
    folder = build(tmp_path, "mimo", rng, jaxmtp_mtp_layout="deepseek")
    with pytest.raises(ValueError, match=rf"model\.layers\.{LAYERS}\."):
        LLM(folder, num_speculative_tokens=1, max_num_seqs=2, max_num_batched_tokens=64)


def test_unknown_layout_name_is_rejected_at_load(tmp_path, rng):
    folder = build(tmp_path, "deepseek-own-head", rng, jaxmtp_mtp_layout="DeepSeek")
    with pytest.raises(ValueError, match="jaxmtp_mtp_layout 'DeepSeek'"):
        LLM(folder, num_speculative_tokens=1, max_num_seqs=2, max_num_batched_tokens=64)
