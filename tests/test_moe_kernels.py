"""The MoE router, the grouped matmul and MLA attention against float64 NumPy
references; random inputs fresh per test, the seed in every failure message."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fresh_rng
from jaxmtp.models.config import MoEConfig
from jaxmtp.models.mla import mla_attention_fn
from jaxmtp.models.moe import route, routed_experts
from jaxmtp.kernels.grouped_matmul import grouped_matmul_reference
from jaxmtp.kernels.mla_reference import mla_absorbed_attention_reference, mla_expanded_attention_reference
from test_kernels import make_case
from tolerances import NONLINEAR_ROUNDING, U32, assert_within, attention_float64, gamma, swiglu_relative


def seeded():
    seed = int(fresh_rng().integers(1 << 31))
    return np.random.default_rng(seed), seed


def moe_config(num_experts=16, k=4, n_group=4, topk_group=2, norm=True, scale=2.5) -> MoEConfig:
    return MoEConfig(num_experts=num_experts, num_experts_per_tok=k, num_shared_experts=1, moe_intermediate_size=8,
                     first_k_dense_replace=0, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale,
                     norm_topk_prob=norm)


def route_float64(x, router, bias, cfg: MoEConfig):
    """noaux_tc routing one row at a time in float64; ties to the lower index. Also
    says per row whether a near-tie (closer than float32 can resolve, not exact) at a
    selection boundary makes the float32 choice ambiguous."""
    x, router, bias = (np.asarray(a, np.float64) for a in (x, router, bias))
    scores = 1 / (1 + np.exp(-(x @ router)))
    choice = scores + bias
    # how far float32 may move a row's choice values: a score's dot product by gamma_H
    # |x| . |w| (a quarter of it through the sigmoid) and the sigmoid's rounding, the
    # bias's addition by u; a group's value, a sum of two, twice that. Two values closer
    # than twice their error may come out in either order.
    error = gamma(x.shape[1]) * (np.abs(x) @ np.abs(router)).max(axis=1) / 4 + NONLINEAR_ROUNDING + U32 * (
        1 + np.abs(bias).max())
    per_group = cfg.num_experts // cfg.n_group
    experts, weights, ambiguous = [], [], []
    for row_scores, row_choice, row_error in zip(scores, choice, error):
        groups = row_choice.reshape(cfg.n_group, per_group)
        group_scores = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
        group_order = sorted(range(cfg.n_group), key=lambda g: (-group_scores[g], g))
        kept = group_order[: cfg.topk_group]
        candidates = [e for e in range(cfg.num_experts) if e // per_group in kept]
        order = sorted(candidates, key=lambda e: (-row_choice[e], e))
        chosen = order[: cfg.num_experts_per_tok]
        w = row_scores[chosen]
        if cfg.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        experts.append(chosen)
        weights.append(w * cfg.routed_scaling_factor)

        def near_tie(values, i, error):
            return i < len(values) and 0 < abs(values[i - 1] - values[i]) < 2 * error

        sorted_groups = sorted(group_scores, reverse=True)
        sorted_choice = [row_choice[e] for e in order]
        ambiguous.append(near_tie(sorted_groups, cfg.topk_group, 2 * row_error)
                         or near_tie(sorted_choice, cfg.num_experts_per_tok, row_error))
    return np.array(experts), np.array(weights), np.array(ambiguous)


def by_expert(experts, weights):
    """Each row's {expert: weight}: the order of a row's k experts carries no meaning."""
    return [dict(zip(e.tolist(), w.tolist())) for e, w in zip(np.asarray(experts), np.asarray(weights))]


def check_routing(x, router, bias, cfg, seed):
    got = route(jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    experts, weights, ambiguous = route_float64(x, router, bias, cfg)
    assert ambiguous.mean() < 0.1, f"seed={seed}: too many near-ties to test"
    got_rows, want_rows = by_expert(got.experts, got.weights), by_expert(experts, weights)
    # a score sigmoid(x . w_e): the dot's error, gamma_H |x| . |w_e|, at most a quarter of it
    # through the sigmoid, plus the sigmoid's own rounding; the weights, scores over their
    # sum (k terms) times the scale, carry twice the scores' relative error and gamma_k + 2u
    magnitude = gamma(x.shape[1]) * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(router, np.float64))) / 4
    for row in np.flatnonzero(~ambiguous):
        assert got_rows[row].keys() == want_rows[row].keys(), f"seed={seed} row {row}: {got_rows[row]} != {want_rows[row]}"
        chosen = list(want_rows[row])
        score = 1 / (1 + np.exp(-(np.asarray(x[row], np.float64) @ np.asarray(router, np.float64)[:, chosen])))
        relative = float((magnitude[row, chosen] / score).max()) + NONLINEAR_ROUNDING
        want = np.array(list(want_rows[row].values()))
        assert_within([got_rows[row][e] for e in chosen], want, want * (2 * relative + gamma(len(chosen)) + 2 * U32),
                      f"seed={seed} row {row}")


@pytest.mark.parametrize("shape", [dict(), dict(n_group=1, topk_group=1, k=6, norm=False, scale=1.0),
                                   dict(num_experts=16, n_group=8, topk_group=3, k=5)])
def test_router_matches_float64_reference(shape):
    rng, seed = seeded()
    cfg = moe_config(**shape)
    x = rng.standard_normal((64, 24)).astype(np.float32)
    router = (0.5 * rng.standard_normal((24, cfg.num_experts))).astype(np.float32)
    # the correction bias large enough to change choices, not only weights
    bias = (0.3 * rng.standard_normal(cfg.num_experts)).astype(np.float32)
    check_routing(x, router, bias, cfg, seed)
    # the bias really picks: without it some rows choose other experts
    plain = route(jnp.asarray(x), jnp.asarray(router), jnp.zeros(cfg.num_experts), cfg)
    biased = route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg)
    assert (np.sort(plain.experts) != np.sort(biased.experts)).any(), f"seed={seed}"


def test_router_ties_and_groups():
    """Exact ties go to the lower index, between groups and between experts; only the
    kept groups' experts are chosen even when a dropped group holds better ones."""
    rng, seed = seeded()
    cfg = moe_config(num_experts=16, k=3, n_group=4, topk_group=2)
    x = rng.standard_normal((32, 12)).astype(np.float32)
    column = (0.5 * rng.standard_normal((12, 4))).astype(np.float32)
    # groups 1 and 3 copy group 0: all three tie; group 2 is its own
    router = np.concatenate([column, column, (0.5 * rng.standard_normal((12, 4))).astype(np.float32), column], axis=1)
    bias = np.zeros(16, np.float32)
    check_routing(x, router, bias, cfg, seed)
    got = route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg)
    assert not np.isin(np.asarray(got.experts), np.arange(12, 16)).any(), f"seed={seed}: group 3 loses every tie"
    # one group far ahead in the biased score, with a single strong expert: the
    # second group kept is picked by the sum of its best two
    bias = np.zeros(16, np.float32)
    bias[[0, 5, 6]] = [5.0, 1.0, 1.0]
    experts = np.asarray(route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), cfg).experts)
    assert (np.sort(experts, axis=1)[:, :1] == 0).all(), f"seed={seed}"
    assert np.isin(experts, [0, 1, 2, 3, 4, 5, 6, 7]).all(), f"seed={seed}: only groups 0 and 1 are kept"
    check_routing(x, router, bias, cfg, seed)


def grouped_matmul_float64(lhs, rhs, group_sizes):
    """Each group's rows times its matrix in float64, and one float32 evaluation's
    rounding bound (gamma_K |lhs| @ |rhs|)."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, magnitude = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = lhs[start : start + size] @ rhs[g]
        magnitude[start : start + size] = np.abs(lhs[start : start + size]) @ np.abs(rhs[g])
        start += size
    return out, gamma(lhs.shape[1]) * magnitude


def experts_float64(x, experts, weights, gate_up, down):
    """Each row's k experts one by one in float64 (SwiGLU of gate and up, then down,
    weighted), one float32 evaluation's rounding bound: the SwiGLU's
    (tolerances.swiglu_relative, sums of H), the down projection's sums of I and the k
    weighted terms' sum, over the magnitude M = sum_e |w_e| sum_j |g_j| |u_j| |down_j|;
    and M."""
    x, weights, gate_up, down = (np.asarray(a, np.float64) for a in (x, weights, gate_up, down))
    t, h = x.shape
    inter = down.shape[1]
    out, magnitude = np.zeros((t, h)), np.zeros((t, h))
    for row in range(t):
        for e, w in zip(np.asarray(experts)[row], weights[row]):
            gu = x[row] @ gate_up[e].reshape(h, 2 * inter)
            gate, up = gu[:inter], gu[inter:]
            out[row] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
            abs_gu = np.abs(x[row]) @ np.abs(gate_up[e]).reshape(h, 2 * inter)
            magnitude[row] += abs(w) * ((abs_gu[:inter] * abs_gu[inter:]) @ np.abs(down[e]))
    k = np.asarray(experts).shape[1]
    return out, (swiglu_relative(h) + gamma(inter) + gamma(k)) * magnitude, magnitude


@pytest.mark.parametrize("loads", ["ragged", "empty-experts", "one-expert-takes-all", "padding-rows"])
def test_grouped_matmul_on_ragged_loads(loads):
    rng, seed = seeded()
    groups, rows = 6, 40
    if loads == "ragged":
        sizes = rng.multinomial(rows, np.ones(groups) / groups)
    elif loads == "empty-experts":
        sizes = np.zeros(groups, int)
        sizes[[1, 4]] = rng.multinomial(rows, [0.5, 0.5])
    elif loads == "one-expert-takes-all":
        sizes = np.zeros(groups, int)
        sizes[groups - 1] = rows
    else:
        sizes = rng.multinomial(rows - 7, np.ones(groups) / groups)  # 7 rows owned by no group
    lhs = rng.standard_normal((rows, 16)).astype(np.float32)
    rhs = rng.standard_normal((groups, 16, 12)).astype(np.float32)
    out = np.asarray(grouped_matmul_reference(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes, jnp.int32)))
    assert_within(out, *grouped_matmul_float64(lhs, rhs, sizes), f"seed={seed}")


def test_routed_experts_match_a_per_token_loop():
    """The sort-by-expert dispatch and the sum back onto rows, against each row's k
    experts computed one by one in float64."""
    rng, seed = seeded()
    t, h, inter, num_experts, k = 20, 12, 8, 6, 3
    x = rng.standard_normal((t, h)).astype(np.float32)
    gate_up = (0.5 * rng.standard_normal((num_experts, h, 2, inter))).astype(np.float32)
    down = (0.5 * rng.standard_normal((num_experts, inter, h))).astype(np.float32)
    experts = np.stack([rng.choice(num_experts - 1, size=k, replace=False) for _ in range(t)])  # expert 5 unused
    weights = rng.random((t, k)).astype(np.float32)
    from jaxmtp.models.moe import Routing

    got = routed_experts(jnp.asarray(x), Routing(jnp.asarray(experts, jnp.int32), jnp.asarray(weights)),
                         jnp.asarray(gate_up), jnp.asarray(down))
    want, bound, _ = experts_float64(x, experts, weights, gate_up, down)
    assert_within(got, want, bound, f"seed={seed}")


@pytest.mark.parametrize("num_devices", [2, 3])
def test_experts_held_apart_add_up_to_all_experts(num_devices):
    """Expert parallelism's split, on one device: each device's routed_experts over the
    experts it holds (from first_expert; the pairs of others weigh nothing) sums to
    all experts' output, also when a device's experts get no row or every row."""
    from jaxmtp.models.moe import Routing

    rng, seed = seeded()
    t, h, inter, num_experts, k = 20, 12, 8, 6, 3
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    gate_up = jnp.asarray(0.5 * rng.standard_normal((num_experts, h, 2, inter)), jnp.float32)
    down = jnp.asarray(0.5 * rng.standard_normal((num_experts, inter, h)), jnp.float32)
    experts = np.stack([rng.choice(num_experts - 2, size=k, replace=False) for _ in range(t)])  # the last two unused
    experts[:, 0] = 0  # every row goes to expert 0
    routing = Routing(jnp.asarray(experts, jnp.int32), jnp.asarray(rng.random((t, k)), jnp.float32))
    whole = np.asarray(routed_experts(x, routing, gate_up, down))
    held = num_experts // num_devices
    parts = [routed_experts(x, routing, gate_up[s * held:(s + 1) * held], down[s * held:(s + 1) * held], s * held)
             for s in range(num_devices)]
    # each part and the whole round their own sums (twice one evaluation's bound), and
    # the parts' float32 sum adds gamma_devices of their magnitude
    _, bound, magnitude = experts_float64(x, experts, routing.weights, gate_up, down)
    assert_within(np.sum(parts, axis=0), whole, 2 * bound + gamma(num_devices) * magnitude, f"seed={seed}")
    if num_devices == 3:  # the last device holds experts 4 and 5, which no row goes to
        assert not np.asarray(parts[-1]).any()


def test_padding_rows_reach_no_routed_expert(monkeypatch):
    """moe_ffn's rows from num_rows on (a step's padding: a batch-1 decode step has 7)
    go to no routed expert, so the grouped calls read no expert for them: they come out
    as the shared expert alone, and the rows before as without num_rows."""
    import jaxmtp.models.moe as moe
    from jaxmtp.models.layers import gated_mlp

    rng, seed = seeded()
    t, h, num_rows, cfg = 8, 12, 3, moe_config()
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    params = moe.MoEParams(*(jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32) for shape in (
        (h, e), (e,), (e, h, 2, inter), (e, inter, h), (h, 2, inter), (inter, h))))
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    seen, routed = [], moe.routed_experts
    monkeypatch.setattr(moe, "routed_experts", lambda x, routing, *a, **kw: seen.append(routing.experts) or routed(
        x, routing, *a, **kw))
    whole, padded = moe.moe_ffn(params, cfg, x), moe.moe_ffn(params, cfg, x, num_rows=num_rows)
    assert (np.asarray(seen[-1])[num_rows:] == -1).all(), f"seed={seed}"  # held by no device
    shared = gated_mlp(x, params.shared_gate_up, params.shared_down)
    np.testing.assert_array_equal(np.asarray(padded)[num_rows:], np.asarray(shared)[num_rows:], f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(padded)[:num_rows], np.asarray(whole)[:num_rows], f"seed={seed}")


# ----- MLA attention ----------------------------------------------------------------------

R, DR, DN, DV, HEADS = 12, 6, 8, 10, 4


def mla_case(rng, seqs, page_size=4):
    """Latent and rope pages from test_kernels.make_case (one kv head of R + Dr dims,
    slots nobody may attend poisoned with NaN and 1e30), fresh queries and weights."""
    _, kv, _, kv_lens, page_table, query_start = make_case(
        rng, seqs, num_q_heads=1, num_kv_heads=1, head_dim=R + DR, page_size=page_size, dtype=jnp.float32
    )
    num_rows = int(query_start[-1]) + 3
    q_nope = jnp.asarray(rng.standard_normal((num_rows, HEADS, DN)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((num_rows, HEADS, DR)), jnp.float32)
    w_uk = jnp.asarray(0.4 * rng.standard_normal((R, HEADS, DN)), jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((R, HEADS, DV)), jnp.float32)
    return q_nope, q_rope, kv[..., :R], kv[..., R:], kv_lens, page_table, query_start, w_uk, w_uv


def mla_float64(q_nope, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, w_uv, sm_scale):
    """MLA in float64 (the absorbed query over the latent, then W_UV; the expanded form
    is the same sums in another order), and the rounding bound of one float32
    evaluation of either form: the logits' sums are over R (through W_UK) and Dn, then
    Dr; the output's over R (through W_UV) after the attention's bound."""
    q_nope, q_rope, latent_pages, rope_pages, w_uk, w_uv = (
        np.asarray(a, np.float64) for a in (q_nope, q_rope, latent_pages, rope_pages, w_uk, w_uv)
    )
    q = np.concatenate([np.einsum("thd,rhd->thr", q_nope, w_uk), q_rope], axis=-1)
    q_magnitude = np.concatenate([np.einsum("thd,rhd->thr", np.abs(q_nope), np.abs(w_uk)), np.abs(q_rope)], axis=-1)
    rank, reduction = latent_pages.shape[-1], latent_pages.shape[-1] + q_nope.shape[-1] + q_rope.shape[-1]
    latent, bound, magnitude = attention_float64(
        q, np.concatenate([latent_pages, rope_pages], axis=-1), latent_pages, kv_lens, page_table, query_start,
        sm_scale=sm_scale, q_magnitude=q_magnitude, reduction=reduction,
    )
    out = np.einsum("thr,rhv->thv", latent, w_uv)
    return out, np.einsum("thr,rhv->thv", bound + gamma(rank) * magnitude, np.abs(w_uv))


SEQS = [(1, 9), (3, 3), (0, 0), (5, 11), (1, 1), (2, 14)]  # (q rows, kv_len); (0, 0) pads


def test_mla_forms_match_float64_reference():
    """Both forms on the same rows: absorbed (then W_UV) and expanded equal the float64
    per-token expansion; unowned rows are exactly 0; poisoned slots never leak."""
    rng, seed = seeded()
    args = mla_case(rng, SEQS)
    q_nope, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, w_uv = args
    scale = 0.3
    want, bound = mla_float64(*args, scale)
    cache_args = (latent_pages, rope_pages, kv_lens, page_table, query_start)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)
    absorbed = jnp.einsum("thr,rhv->thv", mla_absorbed_attention_reference(q_latent, q_rope, *cache_args, sm_scale=scale), w_uv)
    expanded = mla_expanded_attention_reference(q_nope, q_rope, *cache_args, w_uk, w_uv, sm_scale=scale)
    owned = np.arange(q_nope.shape[0]) < int(query_start[-1])
    for name, got in (("absorbed", absorbed), ("expanded", expanded)):
        got = np.asarray(got)
        assert not np.isnan(got).any(), f"seed={seed} {name}: NaN"
        assert (got[~owned] == 0).all(), f"seed={seed} {name}: unowned rows"
        assert_within(got, want, bound, f"seed={seed} {name}")


def test_mla_entry_point_writes_the_latent_and_picks_the_form_per_row():
    """The entry point writes each new row's latent and rope key into its slot, then
    attends; sequences with at most decode_rows rows take the absorbed form: with the
    absorbed reference broken (scaled by 2), exactly those rows change."""
    rng, seed = seeded()
    q_nope, q_rope, latent_pages, rope_pages, kv_lens, page_table, query_start, w_uk, w_uv = mla_case(rng, SEQS)
    num_rows, page_size = q_nope.shape[0], latent_pages.shape[1]
    latent = jnp.asarray(rng.standard_normal((num_rows, R)), jnp.float32)
    rope_key = jnp.asarray(rng.standard_normal((num_rows, DR)), jnp.float32)
    slots = np.full(num_rows, latent_pages.shape[0] * page_size, np.int32) + np.arange(num_rows)  # dropped
    for s, (nq, kv_len) in enumerate(SEQS):
        for j in range(nq):
            pos = kv_len - nq + j
            slots[int(query_start[s]) + j] = int(page_table[s, pos // page_size]) * page_size + pos % page_size
    attend = functools.partial(mla_attention_fn("reference", decode_rows=2), sm_scale=0.3, rope_interleave=False)
    # tables that leave the rope part as it is (cos 1, sin 0): q_rope is the rotated query
    no_rotation = jnp.ones((num_rows, DR // 2), jnp.float32), jnp.zeros((num_rows, DR // 2), jnp.float32)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    out, new_latent, new_rope = attend(q, *no_rotation, latent, rope_key, latent_pages, rope_pages, jnp.asarray(slots),
                                       kv_lens, page_table, query_start, w_uk, w_uv)
    written = slots < latent_pages.shape[0] * page_size
    np.testing.assert_array_equal(np.asarray(new_latent).reshape(-1, R)[slots[written]], np.asarray(latent)[written])
    np.testing.assert_array_equal(np.asarray(new_rope).reshape(-1, DR)[slots[written]], np.asarray(rope_key)[written])
    want, bound = mla_float64(q_nope, q_rope, new_latent, new_rope, kv_lens, page_table, query_start, w_uk, w_uv, 0.3)
    assert_within(out, want, bound, f"seed={seed}")

    import jaxmtp.kernels.mla_reference as ref
    import jaxmtp.models.mla as mla

    original = mla.mla_absorbed_attention_reference
    mla.mla_absorbed_attention_reference = lambda *a, **kw: 2 * original(*a, **kw)
    try:
        broken, _, _ = attend(q, *no_rotation, latent, rope_key, latent_pages, rope_pages, jnp.asarray(slots),
                              kv_lens, page_table, query_start, w_uk, w_uv)
    finally:
        mla.mla_absorbed_attention_reference = original
    assert ref.mla_absorbed_attention_reference is original
    rows = np.diff(np.asarray(query_start))
    seq_of_row = np.searchsorted(np.asarray(query_start)[1:], np.arange(num_rows), side="right")
    decode = np.zeros(num_rows, bool)
    decode[: int(query_start[-1])] = rows[seq_of_row[: int(query_start[-1])]] <= 2
    changed = np.abs(np.asarray(broken) - np.asarray(out)).max(axis=(1, 2)) > 0
    np.testing.assert_array_equal(changed, decode, err_msg=f"seed={seed}")


def test_a_decode_steps_bound_on_its_rows_picks_the_expert_paths(monkeypatch):
    """moe_ffn's max_rows (a decode-only step's requests times their rows) is what the
    paired-or-sorted choice and the grouped calls' tiling read, in pairs: a batch-1
    step's 8 rows of 4 experts are 4 real pairs, not 32; without it, every row counts."""
    import jaxmtp.models.moe as moe

    rng, seed = seeded()
    t, h, cfg = 8, 12, moe_config()
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    params = moe.MoEParams(*(jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32) for shape in (
        (h, e), (e,), (e, h, 2, inter), (e, inter, h), (h, 2, inter), (inter, h))))
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    by_pair, tiled = [], []
    monkeypatch.setattr(moe, "expert_path", lambda pairs, *a: by_pair.append(pairs) or "sorted")
    from jaxmtp.kernels import grouped_matmul as gm

    # both grouped calls ask for their tiling; None: the reference runs them (the CPU's choice)
    monkeypatch.setattr(gm, "_tiling", lambda *a, real_rows=None, **kw: tiled.append(real_rows))
    bounded = moe.moe_ffn(params, cfg, x, num_rows=1, max_rows=1)
    whole = moe.moe_ffn(params, cfg, x, num_rows=1)
    assert by_pair == [4, 32] and tiled == [4, 4, 32, 32], f"seed={seed}"
    np.testing.assert_array_equal(np.asarray(bounded), np.asarray(whole), f"seed={seed}")
