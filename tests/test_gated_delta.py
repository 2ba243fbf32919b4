"""Gated DeltaNet's jnp reference (jaxmtp/models/gated_delta.py) over ragged batches:
against a float64 NumPy evaluation written per request and row, against transformers'
torch forms, across chunk boundaries of a split request, through MTP-style commits of
the first rows, and with padding rows and requests that must change nothing.

Tolerances (tests/tolerances.py's style). The conv: a sum of K products then SiLU is
within (SILU_SLOPE gamma_K + NONLINEAR_ROUNDING) sum_j |w_j x_j| of the exact value.
The delta rule: one row changes each value column S[:, j] of a head's state by
S <- e^g (I - beta k k^T) S + beta k v_j, and with ||k|| < 1 (l2-normalised with an
epsilon) and 0 < beta < 1 that map is nonexpansive in the 2-norm, so the rounding errors
of the rows add up without growing. Each row's own are those of a few stages (the decay's
exp and product, the read k^T S, the delta, the outer product, and the float32
l2-normalised k's effect on all of them), each within gamma of its sum's length
(dk, and C more in the chunked form's intra-chunk products and forward substitution) plus
NONLINEAR_ROUNDING of the scale M: the largest state column's 2-norm or |v| the float64
evaluation meets in the request. After n rows the state lies within n eps M, an output
(q^T S, ||q|| <= 1) within (n + 1) eps M, eps = DELTA_STAGES (gamma(dk + C) +
NONLINEAR_ROUNDING). The chunked form's one assumption: its UT transform amplifies no
error beyond the scale M (as reordered_model_bound assumes of a layer). A dropped decay or
a wrong gate is off by about M."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fresh_rng
from tolerances import NONLINEAR_ROUNDING, SILU_SLOPE, assert_within, gamma

from jaxmtp.kernels import gated_delta as kg
from jaxmtp.models import delta_rule as dr
from jaxmtp.models import gated_delta as gd
from jaxmtp.worker.recurrent import RecurrentState, committed, write_tails
from jaxmtp.worker.recurrent import commit as commit_versions

HK, HV, DK, DV, KERNEL = 2, 4, 8, 8, 4
CHANNELS = 2 * HK * DK + HV * DV  # the conv runs over q|k|v
NUM_SLOTS = 10  # rows of the state tables
CHUNK = 8
DELTA_STAGES = 8

conv = jax.jit(gd.causal_conv1d)
conv_tail = jax.jit(gd.conv_tail, static_argnames="keep")
recurrent = jax.jit(gd.gated_delta_recurrent, static_argnames=("keep", "over_rows"))
chunked = jax.jit(gd.gated_delta_chunked, static_argnames=("chunk", "across_chunks"))
# the Pallas kernels (kernels/gated_delta.py) in interpret mode, each head's state
# columns split over two programs
SPLIT_COLUMNS = kg.DeltaKernelConfig(block_dv=DV // 2, num_warps=4, num_stages=1)
KERNELS = dr.DeltaRule(functools.partial(kg.scan_rows_kernel, interpret=True, config=SPLIT_COLUMNS),
                       functools.partial(kg.scan_chunks_kernel, interpret=True, config=SPLIT_COLUMNS))




def commit(table, tail, slots, num_rejected, has_rows) -> np.ndarray:
    """The committed table once the engine's step has written each request's tail of
    versions [B, keep, ...] (recurrent.write_tails, as jaxmtp/models/hybrid.py does) and
    verification has kept all but its last num_rejected rows (recurrent.commit): what a
    slot holds next step."""
    table, has_rows, slots = jnp.asarray(table), jnp.asarray(has_rows), jnp.asarray(slots)
    versions = jnp.broadcast_to(table[:, None], (table.shape[0], tail.shape[1]) + table.shape[1:])
    written = write_tails(versions, jnp.asarray(tail), slots, has_rows)
    state = commit_versions(RecurrentState([written], [written]), slots, jnp.asarray(num_rejected), has_rows)
    return np.asarray(committed(state.conv[0]))


def conv_after(x, conv_table, query_start, slots, fresh, commit_len) -> np.ndarray:
    """The conv table once each request has committed its first commit_len rows: the
    windows after each of its rows (conv_tail, keep enough for the longest request and
    its old window) committed as the engine commits them."""
    lengths = np.diff(np.asarray(query_start))
    tails = conv_tail(x, conv_table, query_start, slots, fresh, int(lengths.max()) + 1)
    return commit(conv_table, tails, slots, lengths - np.asarray(commit_len), lengths > 0)


class Layout(NamedTuple):
    query_start: np.ndarray  # [B+1]
    slots: np.ndarray  # [B]
    fresh: np.ndarray  # [B]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.query_start)

    def rows(self, b: int) -> range:
        return range(self.query_start[b], self.query_start[b + 1])


def layout(rng, lengths, fresh=None) -> Layout:
    """Requests of these lengths back to back (0: a padding request; the first one's slot
    is the first request's, any other's a slot of its own), distinct slots otherwise,
    fresh at random unless given."""
    lengths = np.asarray(lengths)
    slots = rng.permutation(NUM_SLOTS)[: len(lengths)].astype(np.int32)
    slots[np.flatnonzero(lengths == 0)[:1]] = slots[0]
    fresh = rng.random(len(lengths)) < 0.5 if fresh is None else np.asarray(fresh)
    return Layout(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), slots, fresh)


def tables(rng, lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Random conv and recurrent state tables; NaN in fresh requests' rows (never read)."""
    conv_table = rng.normal(size=(NUM_SLOTS, KERNEL - 1, CHANNELS)).astype(np.float32)
    state = rng.normal(size=(NUM_SLOTS, HV, DK, DV)).astype(np.float32)
    for b in np.flatnonzero(lay.fresh & (lay.lengths > 0)):
        conv_table[lay.slots[b]] = state[lay.slots[b]] = np.nan
    return conv_table, state


def delta_inputs(rng, num_rows: int, valid_rows: int) -> tuple[np.ndarray, ...]:
    """q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] (float32); decays well away from 1
    so that a missing one shows; padding rows hold large garbage."""
    q, k = (rng.normal(size=(num_rows, HK, DK)) for _ in range(2))
    v = rng.normal(size=(num_rows, HV, DV))
    g = -rng.uniform(0.05, 1.0, size=(num_rows, HV))
    beta = rng.uniform(0.1, 0.9, size=(num_rows, HV))
    for x in (q, k, v, g, beta):
        x[valid_rows:] = 1e3 * rng.normal(size=x[valid_rows:].shape)
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


def l2norm_float64(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + gd.L2NORM_EPS)


def conv_float64(x, weight, conv_table, lay: Layout):
    """Per request: its stored window (zeros when fresh), then its rows; each row's
    output from the K inputs ending at it. Returns y [T, C] (zeros off requests), the
    bound on a float32 evaluation's error [T, C], and per request its inputs in order
    [K-1 + n, C] (its window after j rows: entries j to j+K-2)."""
    x, weight = np.float64(x), np.float64(weight)
    y, bound, histories = np.zeros_like(x), np.zeros_like(x), []
    for b in range(len(lay.slots)):
        stored = np.zeros((KERNEL - 1, CHANNELS)) if lay.fresh[b] else np.float64(conv_table[lay.slots[b]])
        history = np.concatenate([stored, x[lay.rows(b)]])
        for j, t in enumerate(lay.rows(b)):
            window = history[j : j + KERNEL]  # [K, C], oldest first
            pre = (window * weight.T).sum(0)
            y[t] = pre / (1 + np.exp(-pre))
            bound[t] = (SILU_SLOPE * gamma(KERNEL) + NONLINEAR_ROUNDING) * (np.abs(window) * np.abs(weight.T)).sum(0)
        histories.append(history)
    return y, bound, histories


def delta_float64(q, k, v, g, beta, state, lay: Layout, chunk: int = 0):
    """The gated delta rule per request, row by row. Returns the outputs [T, Hv, dv]
    (zeros off requests), the bound on a float32 evaluation's outputs [T, 1, 1] (chunk:
    its chunk length, 0 for the recurrent form), and per request its states [n+1, Hv,
    dk, dv] (the starting one, then after each row) and their bound [B]."""
    q, k, v, g, beta = (np.float64(x) for x in (q, k, v, g, beta))
    q = np.repeat(l2norm_float64(q), HV // HK, axis=1) / math.sqrt(DK)
    k = np.repeat(l2norm_float64(k), HV // HK, axis=1)
    eps = DELTA_STAGES * (gamma(DK + chunk) + NONLINEAR_ROUNDING)
    out, out_bound, histories, state_bound = np.zeros(v.shape), np.zeros((len(v), 1, 1)), [], []
    for b in range(len(lay.slots)):
        s = np.zeros((HV, DK, DV)) if lay.fresh[b] else np.float64(state[lay.slots[b]])
        history = [s]
        for t in lay.rows(b):
            s = s * np.exp(g[t])[:, None, None]
            delta = (v[t] - np.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hk,hkv->hv", q[t], s)
            history.append(s)
        history = np.stack(history)
        scale = max(np.sqrt((history**2).sum(axis=2)).max(), np.abs(v[lay.rows(b)]).max(initial=0.0))
        n = lay.lengths[b]
        out_bound[lay.rows(b)] = (n + 1) * eps * scale
        histories.append(history)
        state_bound.append(n * eps * scale)
    return out, out_bound, histories, np.array(state_bound)


def run_delta(form: str, inputs, state, lay: Layout, keep: int = 1, chunk: int = CHUNK,
              rule: dr.DeltaRule = dr.DeltaRule()):
    """o and, per request, its state after its last row ([B, Hv, dk, dv]); with the
    recurrent form also its tail. rule: the jnp forms, or KERNELS."""
    args = (*inputs, state, lay.query_start, lay.slots, lay.fresh)
    if form == "chunked":
        o, final = chunked(*args, chunk=chunk, across_chunks=rule.across_chunks)
        return np.asarray(o), np.asarray(final), None
    o, tail = recurrent(*args, keep=keep, over_rows=rule.over_rows)
    return np.asarray(o), np.asarray(tail[:, -1]), np.asarray(tail)


def assert_close(got, want, bound, what: str):
    """assert_within, and NaN exactly where the float64 evaluation has it (assert_within
    lets a NaN pass, and the tables hold NaN where nothing may read them)."""
    np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(want), err_msg=f"{what}: NaN")
    assert_within(got, want, bound, what)


def assert_others_unchanged(new, old, lay: Layout, what: str):
    """Table rows no request with rows owns are bitwise as they were."""
    others = np.setdiff1d(np.arange(NUM_SLOTS), lay.slots[lay.lengths > 0])
    np.testing.assert_array_equal(np.asarray(new)[others], old[others], err_msg=what)


RAGGED = [1, 3, 0, 7, 8, 9, 17, 0]  # two padding requests, one between others
RAGGED_ROWS = 56  # 45 rows of requests, 11 of padding


def test_conv_matches_float64():
    rng = fresh_rng()
    lay = layout(rng, RAGGED)
    conv_table, _ = tables(rng, lay)
    x = rng.normal(size=(RAGGED_ROWS, CHANNELS)).astype(np.float32)
    x[lay.query_start[-1]:] = 1e3
    weight = rng.normal(size=(CHANNELS, KERNEL)).astype(np.float32)
    want, bound, histories = conv_float64(x, weight, conv_table, lay)
    assert_close(conv(x, weight, conv_table, *lay), want, bound, "causal_conv1d")

    commit_len = np.array([rng.integers(0, n + 1) for n in lay.lengths], np.int32)
    commit_len[3], commit_len[6] = 0, lay.lengths[6]  # the old window; all rows
    new_table = conv_after(x, conv_table, *lay, commit_len)
    for b in np.flatnonzero(lay.lengths):
        j = commit_len[b]
        np.testing.assert_array_equal(new_table[lay.slots[b]], histories[b][j : j + KERNEL - 1], err_msg=f"request {b}")
    assert_others_unchanged(new_table, conv_table, lay, "conv_tail, write_tails and commit")


@pytest.mark.parametrize("rule", [dr.DeltaRule(), KERNELS], ids=["jnp", "kernels"])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_delta_rule_matches_float64(form, rule):
    """Ragged requests with padding requests and rows, fresh ones whose table rows hold
    NaN, and tails longer than some requests (which then start with the starting state):
    the jnp forms and the kernels (interpret mode)."""
    rng = fresh_rng()
    lay = layout(rng, RAGGED)
    _, state = tables(rng, lay)
    inputs = delta_inputs(rng, RAGGED_ROWS, lay.query_start[-1])
    want, out_bound, histories, state_bound = delta_float64(*inputs, state, lay, CHUNK if form == "chunked" else 0)
    keep = 4
    o, final, tail = run_delta(form, inputs, state, lay, keep=keep, rule=rule)
    assert_close(o, want, out_bound, f"{form} outputs")
    # a request without rows: its starting state (bound 0)
    assert_close(final, np.stack([h[-1] for h in histories]), state_bound[:, None, None, None], f"{form} final states")
    real = np.flatnonzero(lay.lengths)
    if form == "recurrent":  # tail[b, i]: the state after row n - keep + i, the starting one before the first
        for b in range(len(lay.slots)):
            n = lay.lengths[b]
            want_tail = histories[b][[max(n - keep + i + 1, 0) for i in range(keep)]]
            assert_close(tail[b], want_tail, state_bound[b], f"tail of request {b}")
        rejected = np.array([rng.integers(0, keep) for _ in lay.slots], np.int32)
        new_state = commit(state, tail, lay.slots, rejected, lay.lengths > 0)
        for b in real:
            assert_close(new_state[lay.slots[b]], histories[b][max(lay.lengths[b] - rejected[b], 0)],
                         state_bound[b], f"committed state of request {b}")
        assert_others_unchanged(new_state, state, lay, "write_tails and commit")


def test_matches_transformers():
    """One continuing request of 37 rows (not a multiple of either chunk length) against
    transformers' chunked (16-row chunks) and recurrent torch forms, float32: two float32
    evaluations, so twice the bound. Also the gates against Qwen3NextGatedDeltaNet.forward's
    formula."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    rng = fresh_rng()
    n = 37
    lay = layout(rng, [n], fresh=[False])
    _, state = tables(rng, lay)
    a, b = (rng.normal(size=(40, HV)).astype(np.float32) for _ in range(2))
    a_log, dt_bias = np.log(rng.uniform(0.5, 4, HV)).astype(np.float32), rng.normal(size=HV).astype(np.float32)
    g, beta = (np.asarray(x) for x in gd.gates(a, b, a_log, dt_bias))
    hf_g = -torch.tensor(a_log).exp() * torch.nn.functional.softplus(torch.tensor(a) + torch.tensor(dt_bias))
    assert_close(g, hf_g.numpy(), 2 * 3 * NONLINEAR_ROUNDING * np.abs(g), "g")
    assert_close(beta, torch.tensor(b).sigmoid().numpy(), 2 * NONLINEAR_ROUNDING, "beta")

    q, k, v, _, _ = delta_inputs(rng, 40, n)
    _, out_bound, _, state_bound = delta_float64(q, k, v, g, beta, state, lay, chunk=16)
    o, final, _ = run_delta("chunked", (q, k, v, g, beta), state, lay)
    torch_args = [torch.tensor(x[None, :n]) for x in (q, k, v, g, beta)]
    initial = torch.tensor(state[lay.slots[:1]])
    for name, rule in (("chunk", hf.torch_chunk_gated_delta_rule), ("recurrent", hf.torch_recurrent_gated_delta_rule)):
        kwargs = {"chunk_size": 16} if name == "chunk" else {}
        hf_o, hf_state = rule(*torch_args, initial_state=initial, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, **kwargs)
        assert_close(o[:n], hf_o[0].numpy(), 2 * out_bound[:n], f"outputs against transformers' {name} form")
        assert_close(final[0], hf_state[0].numpy(), 2 * state_bound[0], f"state against transformers' {name} form")


@pytest.mark.parametrize("split", [1, CHUNK - 1, CHUNK, CHUNK + 1, 13, 19])
def test_split_request_continues(split):
    """A request's 20 rows in two calls, the states carried through the tables (chunked
    prefill), give one call's outputs and final states: the conv, the chunked and the
    recurrent forms."""
    rng = fresh_rng()
    n, num_rows = 20, 24
    lay = layout(rng, [n], fresh=[True])
    conv_table, state = tables(rng, lay)
    x = rng.normal(size=(num_rows, CHANNELS)).astype(np.float32)
    weight = rng.normal(size=(CHANNELS, KERNEL)).astype(np.float32)
    inputs = delta_inputs(rng, num_rows, n)
    _, out_bound, _, state_bound = delta_float64(*inputs, state, lay, CHUNK)
    _, conv_bound, _ = conv_float64(x, weight, conv_table, lay)
    whole_y = np.asarray(conv(x, weight, conv_table, *lay))

    # the request's slot; each part's rows first (np.roll), the rest of the rows its padding
    parts = [(0, lay._replace(query_start=np.array([0, split], np.int32))),
             (split, lay._replace(query_start=np.array([0, n - split], np.int32), fresh=np.array([False])))]
    conv_outputs = []
    for lo, part in parts:
        part_x = np.roll(x, -lo, axis=0)
        conv_outputs.append(np.asarray(conv(part_x, weight, conv_table, *part))[: part.lengths[0]])
        conv_table = np.asarray(conv_after(part_x, conv_table, *part, part.lengths))
    assert_close(np.concatenate(conv_outputs), whole_y[:n], 2 * conv_bound[:n], f"conv outputs split at {split}")
    for form in ("chunked", "recurrent"):
        whole_o, whole_final, _ = run_delta(form, inputs, state, lay)
        table, outputs = state, []
        for lo, part in parts:
            o, final, _ = run_delta(form, tuple(np.roll(a, -lo, axis=0) for a in inputs), table, part)
            outputs.append(o[: part.lengths[0]])
            table = np.asarray(commit(table, final[:, None], part.slots, np.zeros(1, np.int32), part.lengths > 0))
        assert_close(np.concatenate(outputs), whole_o[:n], 2 * out_bound[:n], f"{form} outputs split at {split}")
        assert_close(table[lay.slots[0]], whole_final[0], 2 * state_bound[0], f"{form} state split at {split}")


def test_commit_matches_a_run_over_the_kept_rows():
    """MTP verification: requests of k+1 = 4 rows (fewer for some) keep their first j
    rows (at least one). Committing the recurrent form's tail, and the conv window after
    commit_len = j rows, gives the tables a run over only those j rows leaves."""
    rng = fresh_rng()
    keep, num_rows = 4, 24
    lengths = np.array([4, 4, 2, 1, 4, 0, 3])
    lay = layout(rng, lengths)
    conv_table, state = tables(rng, lay)
    inputs = delta_inputs(rng, num_rows, lay.query_start[-1])
    x = rng.normal(size=(num_rows, CHANNELS)).astype(np.float32)
    kept = np.array([rng.integers(1, n + 1) if n else 0 for n in lengths], np.int32)

    _, tail = recurrent(*inputs, state, *lay, keep=keep)
    committed = np.asarray(commit(state, tail, lay.slots, lengths - kept, lengths > 0))
    committed_conv = np.asarray(conv_after(x, conv_table, *lay, kept))

    short = lay._replace(query_start=np.concatenate([[0], np.cumsum(kept)]).astype(np.int32))
    source = np.concatenate([np.arange(lay.query_start[b], lay.query_start[b] + kept[b]) for b in range(len(kept))])
    source = np.concatenate([source, np.arange(len(source), num_rows)])  # then padding rows
    _, final, _ = run_delta("recurrent", tuple(a[source] for a in inputs), state, short)
    want = np.asarray(commit(state, final[:, None], short.slots, np.zeros(len(kept), np.int32), kept > 0))
    _, _, _, state_bound = delta_float64(*inputs, state, lay)
    for b in np.flatnonzero(lengths):
        assert_close(committed[lay.slots[b]], want[lay.slots[b]], 2 * state_bound[b], f"committed state {b}")
    np.testing.assert_array_equal(committed_conv, np.asarray(conv_after(x[source], conv_table, *short, kept)))


def test_padding_changes_nothing():
    """Other garbage in the padding rows changes no output bit and no table row;
    padding rows' outputs are zeros; padding requests (one's slot a real request's,
    another's unused) write nothing, whatever else they hold."""
    rng = fresh_rng()
    lay = layout(rng, RAGGED)
    conv_table, state = tables(rng, lay)
    inputs = delta_inputs(rng, RAGGED_ROWS, lay.query_start[-1])
    x = rng.normal(size=(RAGGED_ROWS, CHANNELS)).astype(np.float32)
    weight = rng.normal(size=(CHANNELS, KERNEL)).astype(np.float32)
    pad = slice(lay.query_start[-1], None)
    other_inputs = tuple(a.copy() for a in inputs)
    other_x = x.copy()
    for a in (*other_inputs, other_x):
        a[pad] = -a[pad] * 7
    commit_len = lay.lengths.astype(np.int32)
    rejected = np.zeros(len(lay.slots), np.int32)

    def results(inputs, x):
        o_r, _, tail = run_delta("recurrent", inputs, state, lay, keep=4)
        o_c, final, _ = run_delta("chunked", inputs, state, lay)
        return {
            "conv": np.asarray(conv(x, weight, conv_table, *lay)), "recurrent": o_r, "chunked": o_c,
            "conv_table": np.asarray(conv_after(x, conv_table, *lay, commit_len)),
            "recurrent_table": np.asarray(commit(state, tail, lay.slots, rejected, lay.lengths > 0)),
            "chunked_table": np.asarray(commit(state, final[:, None], lay.slots, rejected, lay.lengths > 0)),
        }

    first, second = results(inputs, x), results(other_inputs, other_x)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    for name in ("conv", "recurrent", "chunked"):
        assert not first[name][pad].any(), name
    assert_others_unchanged(first["conv_table"], conv_table, lay, "conv table")
    for name in ("recurrent_table", "chunked_table"):
        assert_others_unchanged(first[name], state, lay, name)


def test_bfloat16_inputs():
    """bfloat16 inputs and a bfloat16 conv table compute as their float32 values do;
    the outputs are float32 and the table keeps its dtype."""
    rng = fresh_rng()
    lay = layout(rng, [5, 9, 0])
    conv_table, state = tables(rng, lay)
    x = rng.normal(size=(16, CHANNELS)).astype(jax.numpy.bfloat16)
    weight = rng.normal(size=(CHANNELS, KERNEL)).astype(jax.numpy.bfloat16)
    conv_table = conv_table.astype(jax.numpy.bfloat16)
    inputs = tuple(a.astype(jax.numpy.bfloat16) for a in delta_inputs(rng, 16, lay.query_start[-1]))
    upcast = tuple(a.astype(np.float32) for a in inputs)
    _, conv_bound, _ = conv_float64(x.astype(np.float32), weight.astype(np.float32), conv_table.astype(np.float32), lay)
    _, out_bound, _, _ = delta_float64(*upcast, state, lay, CHUNK)

    y = conv(x, weight, conv_table, *lay)
    assert y.dtype == np.float32
    want_y = conv(x.astype(np.float32), weight.astype(np.float32), conv_table.astype(np.float32), *lay)
    assert_close(y, np.asarray(want_y), 2 * conv_bound, "conv of bfloat16")
    new_table = conv_after(x, conv_table, *lay, lay.lengths)
    assert new_table.dtype == conv_table.dtype
    want_table = conv_after(x.astype(np.float32), conv_table.astype(np.float32), *lay, lay.lengths)
    np.testing.assert_array_equal(np.asarray(new_table, np.float32), np.asarray(want_table))
    o, _, _ = run_delta("chunked", inputs, state, lay)
    assert o.dtype == np.float32
    assert_close(o, run_delta("chunked", upcast, state, lay)[0], 2 * out_bound, "chunked form of bfloat16")
