"""The step's parameters with their small arrays in one buffer per dtype.

The host hands a compiled program every array as an argument of its own, at every call
(about 3 us an argument on the H200's host: docs/benchmarks/README.md, "what a step's
dispatch is made of"), and a decoder layer's norms and the router's bias are a third of
a Moonlight-shaped layer's arguments for a few kilobytes. The runner hands
the step (and a masked step's forward program) those arrays concatenated by dtype; the
program slices them back out, static slices that XLA folds into the fusions and GEMMs
that read them. Only arrays whole on every device are packed (a sharded one keeps its
own sharding)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# the parameters small enough to pack, by field name: the norms' weights and biases,
# each read by XLA's own fusions, which slice the buffer in place. Not the router: a
# GEMM's operand, for which XLA copies the slice out first (a kernel a layer in the
# step compiled for the H200, benchmarks/step_kernels.py), as it does for a Pallas
# kernel's (the routing kernel's router_bias, 256 bytes a layer, which XLA's routing
# reads in place)
PACKED_FIELDS = frozenset({
    "input_norm", "post_norm", "final_norm", "q_norm", "k_norm", "kv_a_norm", "q_a_norm", "token_norm",
    "hidden_norm", "q_bias", "k_bias", "v_bias", "o_bias", "gate_up_bias", "down_bias", "router_bias",
    "shared_gate",
})
MAX_PACKED_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where each leaf of a params tree lies: in buffer b at offset o with its shape, or
    the i-th of the arrays handed as they are. Static: part of the step's StepConfig."""

    treedef: jax.tree_util.PyTreeDef
    places: tuple[tuple[int, int, tuple[int, ...]] | int, ...]  # per leaf: (b, o, shape), or i
    dtypes: tuple[str, ...]  # each buffer's

    @staticmethod
    def of(params) -> ParamLayout:
        paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        dtypes, sizes, places, kept = [], [], [], 0
        for path, leaf in paths:
            name = getattr(path[-1], "name", None)
            if name in PACKED_FIELDS and leaf.nbytes <= MAX_PACKED_BYTES and leaf.sharding.is_fully_replicated:
                dtype = jnp.dtype(leaf.dtype).name
                if dtype not in dtypes:
                    dtypes.append(dtype)
                    sizes.append(0)
                b = dtypes.index(dtype)
                places.append((b, sizes[b], tuple(leaf.shape)))
                sizes[b] += math.prod(leaf.shape)
            else:
                places.append(kept)
                kept += 1
        return ParamLayout(treedef, tuple(places), tuple(dtypes))

    def pack(self, params) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """(the buffers, the arrays handed as they are) of params, a tree of this layout;
        the buffers placed as their arrays are (whole on every device)."""
        leaves = self.treedef.flatten_up_to(params)
        parts = [[x for x, p in zip(leaves, self.places) if isinstance(p, tuple) and p[0] == b]
                 for b in range(len(self.dtypes))]
        buffers = tuple(jax.jit(lambda *xs: jnp.concatenate([x.reshape(-1) for x in xs]),
                                out_shardings=_whole(xs[0].sharding))(*xs) for xs in parts)
        return buffers, tuple(x for x, p in zip(leaves, self.places) if not isinstance(p, tuple))

    def unpack(self, packed: tuple) -> object:
        """The params tree back, inside the traced program."""
        buffers, rest = packed
        leaves = [rest[p] if not isinstance(p, tuple) else
                  jax.lax.slice(buffers[p[0]], (p[1],), (p[1] + math.prod(p[2]),)).reshape(p[2])
                  for p in self.places]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _whole(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """A buffer's sharding: whole on the devices of one of its arrays' (of any rank)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding
