"""The measured tiling tables that benchmarks/ sweeps write next to the kernels (JSON),
read once at import: {"d0,d1,...": {row bucket: [tiling fields], {a kernel's name: [its
tiling's fields]}, or the name of a path that beat every tiling}}; keys that start with
"_" are notes."""

from __future__ import annotations

import json
from pathlib import Path


def read_tilings(filename: str, config_class, kernels: dict | None = None) -> dict:
    """{tuple of ints: {row bucket: config_class(*fields), kernels[name](*fields) for an
    entry {name: fields}, or a path's name}}."""
    table = json.loads((Path(__file__).parent / filename).read_text())

    def entry(c):
        if isinstance(c, str):
            return c
        if isinstance(c, dict):
            (name, fields), = c.items()
            return kernels[name](*fields)
        return config_class(*c)

    return {tuple(int(v) for v in key.split(",")): {int(b): entry(c) for b, c in buckets.items()}
            for key, buckets in table.items() if not key.startswith("_")}


def row_bucket(num_rows: int) -> int:
    """A table's row bucket: the rows rounded up to a power of 2."""
    return 1 << max(0, num_rows - 1).bit_length()


def nearest_bucket(buckets, size: int) -> int | None:
    """The measured bucket nearest size's (in powers of 2; the smaller on a tie), or None
    where there is none."""
    bucket = row_bucket(size)
    return min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b), default=None)


def nearest_context_entry(table: dict, shape: tuple, context: int) -> dict:
    """table's entry for shape + (context bucket,), at the measured context bucket nearest
    context's, or {} where the shape has none."""
    nearest = nearest_bucket([key[-1] for key in table if key[:-1] == shape], context)
    return {} if nearest is None else table[shape + (nearest,)]


def bucket_at_or_above(buckets, num_rows: int) -> int | None:
    """The smallest of a table entry's measured row buckets at or above num_rows' bucket,
    or None past them all."""
    return min((b for b in buckets if b >= row_bucket(num_rows)), default=None)


def groups_entry(table: dict, key: tuple) -> dict:
    """table's entry for key = (groups, *shape), or, where it has none, the entry of the
    same shape measured at the nearest groups count: a MoE layer holding its shared
    experts as groups (jaxmtp.models.expert_layout) has a few more groups than the routed
    experts that the sweeps measure, and a groups count changes the grid's empty blocks
    only, not what a tile reads."""
    if key in table:
        return table[key]
    near = [other for other in table if other[1:] == key[1:]]
    return table[min(near, key=lambda other: abs(other[0] - key[0]))] if near else {}
