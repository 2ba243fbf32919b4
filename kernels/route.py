"""The router's choice for a few rows and their (row, expert) pairs sorted by expert, in
one Pallas kernel lowered through Triton: what the routed-expert layer's grouped calls
take (kernels/grouped_matmul.py), from the router's float32 logits.

In a decode step the routing is tiny (8 rows of 64-256 experts) but XLA runs it as
about seven kernels of 1-2 us each (the scores and their bias, the top-k, the weights
and their normalisation, an argsort of the pairs, their rows, a bincount of the
groups): at batch 1 on the H200 a few hundred microseconds of a Moonlight-shaped step.
One program does it all here:
- each of the P = T*k pairs (row-major: pair p is row p // k's (p % k)-th choice) holds
  its row's scores over the experts, [P, E], and k rounds of argmax take every row's
  choices in order (ties to the lower expert, as lax.top_k), each pair keeping the
  round of its own rank: no gather across registers;
- the pairs are sorted by expert with a counting sort (each pair's place is the number
  of pairs before it in (expert, pair) order: [P, P] comparisons, hence MAX_PAIRS), and
  each stores its row and weight at its place;
- where the shared experts are held as the first groups (jaxmtp.models.expert_layout),
  their pairs (every real row, weight 1) take the first places, in order.

Same contract as jaxmtp.models.moe's jnp path (route, without_rows_from, sort_pairs),
integer outputs equal, weights within float32 rounding; every memory access an explicit
gather or scatter, so interpret mode runs it on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmtp.kernels.tiling_table import read_tilings, row_bucket
from jaxmtp.kernels.triton_common import TritonCompilerParams, next_power_of_2

MAX_PAIRS = 64  # one program holds the pairs' [P, P] comparisons and [P, E] scores

# route_paths.json, as benchmarks/route_sweep.py writes it: (experts, k) -> {pairs
# bucket: "kernel" where it beat XLA's routing and sort, or "xla"}; shapes and buckets
# it has not measured route through XLA.
ROUTE_PATHS = read_tilings("route_paths.json", None)


def routes_in_kernel(num_pairs: int, num_experts: int, k: int, grouped: bool) -> bool:
    """Whether a step's routing takes the kernel: on GPUs, without group-limited
    routing (DeepSeek-V3's n_group > topk_group), for at most MAX_PAIRS pairs, where the
    table measured it faster."""
    if jax.default_backend() != "gpu" or grouped or num_pairs > MAX_PAIRS:
        return False
    return ROUTE_PATHS.get((num_experts, k), {}).get(row_bucket(num_pairs)) == "kernel"


def _kernel(scalars_ref, logits_ref, bias_ref, sizes_ref, rows_ref, weights_ref, *, num_pairs: int, k: int,
            shared: int, sigmoid: bool, norm_topk_prob: bool, scaling: float):
    num_tokens, num_experts = logits_ref.shape
    num_held = sizes_ref.shape[0]
    num_rows, first_expert = scalars_ref[0], scalars_ref[1]
    shared_real = shared * num_rows  # the shared experts' pairs, first: group j holds rows 0 .. num_rows - 1
    pair = jnp.arange(next_power_of_2(num_pairs), dtype=jnp.int32)
    expert = jnp.arange(next_power_of_2(num_experts), dtype=jnp.int32)
    token, rank = lax.div(pair, k), lax.rem(pair, k)
    pair_ok = pair < num_pairs
    ok = pair_ok[:, None] & (expert[None, :] < num_experts)
    logits = plgpu.load(logits_ref.at[jnp.minimum(token, num_tokens - 1)[:, None], expert[None, :]], mask=ok,
                        other=-jnp.inf)
    if sigmoid:  # noaux_tc: the bias steers the choice, not the weights
        scores = 1.0 / (1.0 + jnp.exp(-logits))
        bias = plgpu.load(bias_ref.at[expert], mask=expert < num_experts, other=0.0)
        choice = jnp.where(ok, scores + bias[None, :], -jnp.inf)
    else:  # softmax over every expert
        exp = jnp.where(ok, jnp.exp(logits - jnp.max(logits, axis=1)[:, None]), 0.0)
        scores = exp / jnp.maximum(jnp.sum(exp, axis=1), 1e-30)[:, None]
        choice = jnp.where(ok, scores, -jnp.inf)

    chosen = jnp.zeros_like(pair)
    weight = jnp.zeros(pair.shape, jnp.float32)
    total = jnp.zeros(pair.shape, jnp.float32)
    for j in range(k):  # round j: every row's (j+1)-th expert
        best = jnp.argmax(choice, axis=1).astype(jnp.int32)
        hit = expert[None, :] == best[:, None]
        score = jnp.sum(jnp.where(hit, scores, 0.0), axis=1)
        chosen = jnp.where(rank == j, best, chosen)
        weight = jnp.where(rank == j, score, weight)
        total += score
        choice = jnp.where(hit, -jnp.inf, choice)
    if norm_topk_prob:
        weight = weight / (total + 1e-20)
    weight = weight * scaling

    # the experts held here (expert parallel: first_expert on) after the shared groups,
    # the rest and every padding row's pairs after them, as group num_held
    local = chosen - first_expert + shared
    held = pair_ok & (token < num_rows) & (local >= shared) & (local < num_held)
    local = jnp.where(held, local, num_held)
    before = (local[None, :] < local[:, None]) | ((local[None, :] == local[:, None]) & (pair[None, :] < pair[:, None]))
    place = shared_real + jnp.sum((before & pair_ok[None, :]).astype(jnp.int32), axis=1)
    plgpu.store(rows_ref.at[place], token, mask=pair_ok)
    plgpu.store(weights_ref.at[place], weight, mask=pair_ok)
    group = jnp.arange(next_power_of_2(num_held), dtype=jnp.int32)
    sizes = jnp.sum(((local[None, :] == group[:, None]) & pair_ok[None, :]).astype(jnp.int32), axis=1)
    sizes = jnp.where(group < shared, num_rows, sizes)
    plgpu.store(sizes_ref.at[group], sizes, mask=group < num_held)
    if shared:  # pair j * T + r: row r of shared group j, past every routed pair where r is padding
        slot = jnp.arange(next_power_of_2(shared * num_tokens), dtype=jnp.int32)
        j, r = lax.div(slot, num_tokens), lax.rem(slot, num_tokens)
        padding_place = shared_real + num_pairs + j * (num_tokens - num_rows) + r - num_rows
        place = jnp.where(r < num_rows, j * num_rows + r, padding_place)
        slot_ok = slot < shared * num_tokens
        plgpu.store(rows_ref.at[place], r, mask=slot_ok)
        plgpu.store(weights_ref.at[place], jnp.ones(slot.shape, jnp.float32), mask=slot_ok)


@functools.partial(jax.jit, static_argnames=("k", "num_held", "shared", "sigmoid", "norm_topk_prob", "scaling",
                                             "interpret"))
def route_and_sort(logits: jax.Array, bias: jax.Array | None, num_rows: jax.Array | int,
                   first_expert: jax.Array | int, *, k: int, num_held: int, sigmoid: bool, norm_topk_prob: bool,
                   scaling: float, shared: int = 0, interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [T, E] float32 -> (group_sizes [num_held], rows [T*(shared + k)], weights
    [T*(shared + k)]): groups 0 .. shared - 1 (the shared experts held as groups,
    jaxmtp.models.expert_layout) each rows 0 .. num_rows - 1 with weight 1; then the
    pairs of rows below num_rows routed to experts first_expert .. + num_held - shared -
    1, as groups shared on, sorted by expert (stably), each pair's row and weight at its
    place; the other pairs (held elsewhere, or of padding rows) after them."""
    num_tokens, num_experts = logits.shape
    num_pairs = num_tokens * k
    if num_pairs > MAX_PAIRS:
        raise ValueError(f"the routing kernel sorts at most {MAX_PAIRS} pairs, got {num_tokens} rows x {k}")
    if bias is None:
        bias = jnp.zeros((num_experts,), jnp.float32)
    scalars = jnp.stack([jnp.asarray(num_rows, jnp.int32), jnp.asarray(first_expert, jnp.int32)])
    kernel = functools.partial(_kernel, num_pairs=num_pairs, k=k, shared=shared, sigmoid=sigmoid,
                               norm_topk_prob=norm_topk_prob, scaling=float(scaling))
    all_pairs = num_tokens * shared + num_pairs
    return pl.pallas_call(
        kernel,
        grid=(1,),
        out_shape=[jax.ShapeDtypeStruct((num_held,), jnp.int32), jax.ShapeDtypeStruct((all_pairs,), jnp.int32),
                   jax.ShapeDtypeStruct((all_pairs,), jnp.float32)],
        compiler_params=TritonCompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="route_and_sort",
    )(scalars, logits.astype(jnp.float32), bias.astype(jnp.float32))
