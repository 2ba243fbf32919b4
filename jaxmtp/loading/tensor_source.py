"""A safetensors folder's tensors as the engine reads them: a reference to each
parameter (its name, the engine's shape, transpose, stacking) from which each device
reads only its own block, when the parameter is placed.

fp8 tensors are read from the file's bytes (numpy has no float8 dtype to name, so
safetensors' numpy reader cannot return them) as ml_dtypes' float8_e4m3fn, which
JAX places as it is: 1 byte a weight on the device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxmtp.models.params import FP8, Fp8Weight
from jaxmtp.models.quantization import Fp8BlockConfig

STORED_FP8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """One parameter as a checkpoint stores it, read from disk only when placed.
    shape is the engine's ([in, out] for matrices); Hugging Face stores matrices
    [out, in] (transpose: the stored axes reversed); start offsets a block of each
    engine-side axis (the MTP input projection is one stored [2H, H] matrix for two
    parameters; a head's columns of a projection that packs several); fixed picks one
    index of stored axes, which the engine's array leaves out (an expert of a fused
    [E, out, in] tensor, conv1d's axis of 1); add is added after the cast to the
    engine's dtype (a zero-centred norm's weight: 1 + w)."""

    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    start: tuple[int, ...] = ()  # per engine axis; missing ones 0
    fixed: tuple[tuple[int, int], ...] = ()  # (stored axis, index) pairs
    dtype: str | None = None  # None: the model's dtype (the MoE router stays float32)
    add: float = 0.0


@dataclasses.dataclass(frozen=True)
class StackedRef:
    """Tensors the checkpoint stores apart and the engine keeps as one, stacked on
    `axis` (gate and up on axis 1: LayerParams.gate_up_proj; experts on axis 0:
    MoEParams.experts_gate_up, whose parts are stacked gate and up themselves)."""

    parts: tuple[TensorRef | StackedRef, ...]
    axis: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        return first[: self.axis] + (len(self.parts),) + first[self.axis :]

    @property
    def dtype(self) -> str | None:
        return self.parts[0].dtype


@dataclasses.dataclass(frozen=True)
class ConcatRef:
    """Blocks of stored tensors the engine keeps side by side along an existing `axis`
    (a projection's columns regrouped: Qwen3.5's q, k, v and z of one key head)."""

    parts: tuple[TensorRef | StackedRef | ConcatRef, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        return first[: self.axis] + (sum(part.shape[self.axis] for part in self.parts),) + first[self.axis + 1 :]

    @property
    def dtype(self) -> str | None:
        return self.parts[0].dtype


@dataclasses.dataclass(frozen=True)
class AbsorbedRef:
    """MLA's kv_b_proj as the engine keeps it (MLAParams.kv_b_proj: [Dn + Dv, Hq, R]),
    from the stored [Hq*(Dn + Dv), R] rows, head by head; a float8_e4m3fn one with its
    weight_scale_inv (blocks of `block` stored rows x columns) dequantized as it is read."""

    weight: TensorRef  # as stored: [Hq*(Dn + Dv), R]
    heads: int
    scale: TensorRef | None = None  # as stored: [ceil(rows / block[0]), ceil(R / block[1])]
    block: tuple[int, int] = (1, 1)
    dtype = None  # the model's dtype

    @property
    def shape(self) -> tuple[int, ...]:
        rows, rank = self.weight.shape
        return rows // self.heads, self.heads, rank


def slice_ref(ref: TensorRef | Fp8Weight, axis: int, lo: int, hi: int) -> TensorRef | Fp8Weight:
    """ref's block lo..hi along engine axis `axis`; an fp8 weight's with its scales,
    where the block is whole scale blocks (else a ValueError naming the tensor)."""
    if isinstance(ref, Fp8Weight):
        size = ref.block[axis]
        if lo % size or (hi % size and hi != ref.shape[axis]):
            raise ValueError(f"{ref.weight.name}: regrouping its [{lo}, {hi}) along axis {axis} cuts its fp8 scale "
                             f"blocks of {size} (not implemented)")
        scale = slice_ref(ref.scale_inv, axis, lo // size, -(-hi // size))
        return Fp8Weight(slice_ref(ref.weight, axis, lo, hi), scale, ref.block)
    start = list(ref.start) + [0] * (len(ref.shape) - len(ref.start))
    start[axis] += lo
    return dataclasses.replace(ref, shape=ref.shape[:axis] + (hi - lo,) + ref.shape[axis + 1 :], start=tuple(start))


def concat_refs(parts: tuple, axis: int) -> ConcatRef | Fp8Weight:
    """Parts side by side along `axis`; fp8 parts as one fp8 weight whose weights and
    scales are concatenated alike (slice_ref has cut them at scale blocks)."""
    if not any(isinstance(p, Fp8Weight) for p in parts):
        return ConcatRef(parts, axis)
    return Fp8Weight(ConcatRef(tuple(p.weight for p in parts), axis), ConcatRef(tuple(p.scale_inv for p in parts), axis),
                     parts[0].block)


def stack_refs(parts: tuple, axis: int) -> StackedRef | Fp8Weight:
    """Parts stacked on `axis`; fp8 parts as one fp8 weight whose weights and scales are
    stacked alike (every index of the new axis has scales of its own)."""
    if not any(isinstance(part, Fp8Weight) for part in parts):
        return StackedRef(parts, axis)
    first = parts[0]
    return Fp8Weight(StackedRef(tuple(part.weight for part in parts), axis),
                     StackedRef(tuple(part.scale_inv for part in parts), axis),
                     first.block[:axis] + (1,) + first.block[axis:])


class TensorSource:
    """Every tensor of a safetensors folder (single file or sharded index), opened lazily."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [single.name]
        else:
            raise FileNotFoundError(
                f"model folder {model_dir!s} has neither model.safetensors nor model.safetensors.index.json"
            )
        self.model_dir = model_dir
        self.file_of = {}
        self.handles = {}
        self.headers = {}  # file -> (its data's offset, its JSON header), for fp8 tensors
        for name in files:
            if not (model_dir / name).is_file():
                raise FileNotFoundError(f"shard {name} listed in the index is missing from {model_dir!s}")
            # numpy: blocks are read to host memory, each then sent to its own device
            handle = safe_open(str(model_dir / name), framework="numpy")
            self.handles[name] = handle
            for key in handle.keys():
                self.file_of[key] = name

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def stored_dtype(self, name: str) -> str:
        return self.handles[self.file_of[name]].get_slice(name).get_dtype()

    def ref(self, name: str, transpose: bool = False, rows: tuple[int, int] | None = None,
            fixed: tuple[tuple[int, int], ...] = (), dtype: str | None = None, add: float = 0.0) -> TensorRef:
        """The tensor `name` (TensorRef says what transpose, fixed and add do); rows,
        a block of the engine-side rows."""
        if name not in self.file_of:
            raise ValueError(f"checkpoint in {self.model_dir!s} is missing tensor {name!r}")
        if self.stored_dtype(name) == STORED_FP8 and dtype != FP8.dtype.name:
            raise ValueError(f"{name} is stored as float8_e4m3fn where the engine keeps the model's dtype: "
                             "dequantizing it while loading is not implemented")
        stored = self.handles[self.file_of[name]].get_slice(name).get_shape()
        kept = tuple(n for axis, n in enumerate(stored) if axis not in dict(fixed))
        ref = TensorRef(name, kept[::-1] if transpose else kept, transpose, fixed=fixed, dtype=dtype, add=add)
        return ref if rows is None else slice_ref(ref, 0, *rows)

    def weight_ref(self, module: str, quantization: Fp8BlockConfig | None) -> TensorRef | Fp8Weight:
        """A linear layer's `{module}.weight` as the engine keeps it ([in, out]); in a
        quantized checkpoint, float8_e4m3fn with its block scales `weight_scale_inv`."""
        name = f"{module}.weight"
        if quantization is None:
            return self.ref(name, transpose=True)
        scale_name = f"{module}.weight_scale_inv"
        if name in self and (self.stored_dtype(name) != STORED_FP8 or scale_name not in self):
            raise ValueError(f"{name} is stored as {self.stored_dtype(name)}{'' if scale_name in self else ' without a weight_scale_inv'}: "
                             "a checkpoint with an fp8 quantization_config stores every linear weight as F8_E4M3 "
                             "with its weight_scale_inv (other layouts are not implemented)")
        weight = self.ref(name, transpose=True, dtype=FP8.dtype.name)
        scale = self.ref(scale_name, transpose=True, dtype="float32")
        block = (quantization.block_in, quantization.block_out)
        blocks = tuple(-(-n // b) for n, b in zip(weight.shape, block))
        if scale.shape != blocks:
            raise ValueError(f"{scale_name} has shape {scale.shape[::-1]}; blocks of {list(block[::-1])} over "
                             f"{name}'s {list(weight.shape[::-1])} need {list(blocks[::-1])}")
        return Fp8Weight(weight, scale, block)

    def absorbed_ref(self, module: str, heads: int, quantization: Fp8BlockConfig | None) -> AbsorbedRef:
        """MLA's `{module}.weight` (kv_b_proj) as AbsorbedRef reads it."""
        name = f"{module}.weight"
        if name not in self or self.stored_dtype(name) != STORED_FP8:
            return AbsorbedRef(self.ref(name), heads)  # a missing tensor: ref's error
        if quantization is None or f"{module}.weight_scale_inv" not in self:
            raise ValueError(f"{name} is stored as F8_E4M3 without an fp8 quantization_config and its weight_scale_inv")
        return AbsorbedRef(self.ref(name, dtype=FP8.dtype.name),
                           heads, self.ref(f"{module}.weight_scale_inv", dtype="float32"),
                           (quantization.block_out, quantization.block_in))

    def read(self, ref: TensorRef | StackedRef | ConcatRef | AbsorbedRef, index: tuple[slice, ...],
             dtype) -> np.ndarray:
        """The block `index` (slices over ref.shape, as jax.make_array_from_callback
        asks for one device's shard) of a tensor, read from disk."""
        if isinstance(ref, AbsorbedRef):
            return self._read_absorbed(ref, index, dtype)
        if isinstance(ref, StackedRef):
            which, rest = index[ref.axis], index[: ref.axis] + index[ref.axis + 1 :]
            return np.stack([self.read(p, rest, dtype) for p in ref.parts[which]], axis=ref.axis)
        bounds = [(s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index, ref.shape)]
        if isinstance(ref, ConcatRef):
            return self._read_concat(ref, index, bounds[ref.axis], dtype)
        bounds = [(lo + offset, hi + offset) for (lo, hi), offset in zip(bounds, ref.start + (0,) * len(bounds))]
        stored = [slice(lo, hi) for lo, hi in (bounds[::-1] if ref.transpose else bounds)]
        for axis, i in sorted(ref.fixed):
            stored.insert(axis, slice(i, i + 1))
        if self.stored_dtype(ref.name) == STORED_FP8:
            block = self._fp8_tensor(ref.name)[tuple(stored)]
        else:
            block = self.handles[self.file_of[ref.name]].get_slice(ref.name)[tuple(stored)]
        block = np.squeeze(block, axis=tuple(axis for axis, _ in ref.fixed))
        block = (block.T if ref.transpose else block).astype(dtype)
        return block + np.asarray(ref.add, dtype) if ref.add else block

    def _read_absorbed(self, ref: AbsorbedRef, index: tuple[slice, ...], dtype) -> np.ndarray:
        """AbsorbedRef's block: the stored rows of its heads and columns, dequantized
        where fp8, regrouped [D, heads, columns]."""
        (d0, d1), (h0, h1), (r0, r1) = ((s.start or 0, n if s.stop is None else s.stop)
                                        for s, n in zip(index, ref.shape))
        per_head = ref.shape[0]
        rows, cols = slice(h0 * per_head, h1 * per_head), slice(r0, r1)
        block = self.read(ref.weight, (rows, cols), np.float32)
        if ref.scale is not None:  # each element times its block's scale
            (bo, bi), (o0, o1) = ref.block, (rows.start, rows.stop)
            scale = self.read(ref.scale, (slice(o0 // bo, -(-o1 // bo)), slice(r0 // bi, -(-r1 // bi))), np.float32)
            scale = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)
            block = block * scale[o0 % bo : o0 % bo + o1 - o0, r0 % bi : r0 % bi + r1 - r0]
        return block.reshape(h1 - h0, per_head, r1 - r0)[:, d0:d1].transpose(1, 0, 2).astype(dtype)

    def _read_concat(self, ref: ConcatRef, index: tuple[slice, ...], bounds: tuple[int, int], dtype) -> np.ndarray:
        """The parts of a ConcatRef that the block lo..hi of its axis overlaps, each read
        for its own share of it."""
        blocks, offset = [], 0
        for p in ref.parts:
            lo, hi = max(bounds[0] - offset, 0), min(bounds[1] - offset, p.shape[ref.axis])
            if lo < hi:
                blocks.append(self.read(p, index[: ref.axis] + (slice(lo, hi),) + index[ref.axis + 1 :], dtype))
            offset += p.shape[ref.axis]
        return np.concatenate(blocks, axis=ref.axis)

    def _fp8_tensor(self, name: str) -> np.ndarray:
        """A float8_e4m3fn tensor as a read-only view of its file's bytes. A safetensors
        file is an 8-byte little-endian header size, the JSON header (each tensor's
        dtype, shape and data offsets), then the data."""
        file = self.file_of[name]
        if file not in self.headers:
            with open(self.model_dir / file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self.headers[file] = (8 + size, json.loads(f.read(size)))
        data_offset, header = self.headers[file]
        begin, end = header[name]["data_offsets"]
        data = np.memmap(self.model_dir / file, np.uint8, mode="r", offset=data_offset + begin, shape=(end - begin,))
        return data.view(FP8).reshape(header[name]["shape"])
