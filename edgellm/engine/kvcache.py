"""The KV cache: every layer's K and V in one preallocated block, with the position each slot holds.

Layer il owns capacity[il] slots; position p lives in slot p % capacity[il]. A full-attention layer gets
capacity n_ctx (so the slot is the position); a sliding-window layer gets a ring just big enough for the window
plus one batch of new tokens, because a batch's earliest query still needs keys from window - 1 positions back
while its latest keys are being written, rounded up to a multiple of 32 so slots keep their positions' lanes.
Slot positions (-1 = empty) are what the attention mask reads.

Values are stored as f32, f16 or q8_0 (edgellm.engine.kvtypes); all layers' values and scales are views into one byte
block allocated once (an anonymous mapping: the OS maps zeroed 4 KB pages in as the cache fills, so an unused
context costs no RSS; numpy's own big arrays ask for 2 MB pages, which the first token would map for every layer).

When the context is full, `shift` makes room as llama.cpp's context shift does (StreamingLLM's attention sinks):
the first n_keep positions stay, the next n_discard are dropped, and every later key is rotated back by
n_discard positions and moved to its new slot, so positions stay contiguous and RoPE distances stay right. The
alternative, unrotated keys rotated at attention time by their slot position, would add a rotation of every
cached key to every decode step; the shift instead costs one pass over the cache per n_discard tokens.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from edgellm.engine import kvtypes, ops, prefix
from edgellm.errors import ModelError
from edgellm.quant.aligned import CACHE_LINE

EMPTY_SLOT = -1
_ALIGN = CACHE_LINE  # each layer's arrays start on a cache line


@dataclass(frozen=True)
class LayerKV:
    """Views into the shared block for one layer."""

    k: np.ndarray  # [n_head_kv, capacity, head_dim] values (float32, float16 bits, or int8)
    v: np.ndarray  # [n_head_kv, capacity, head_dim]
    k_scale: np.ndarray  # [n_head_kv, capacity, head_dim / 32] float32 for q8_0, else [0, 0, 0]
    v_scale: np.ndarray
    slot_pos: np.ndarray  # [capacity] int32: the position held by each slot, EMPTY_SLOT if none
    window: int  # 0: full attention; else a query at p sees keys p - window < kp <= p


# A ring's capacity is a multiple of this, so that a slot's index modulo the attention kernels' lane counts (8
# and 32) is its position's: llama.cpp's cache gives position p cell p, and which lane and which 8-cell group of
# the softmax sum a key falls in decides how its terms round. Windows shorter than this (no released model has
# one; the tests' tiny models do, to wrap their rings within a few tokens) keep the unrounded ring.
RING_ALIGN = 32


def ring_capacity(n_ctx: int, window: int, n_batch: int) -> int:
    """Slots a layer needs: everything for full attention, else the window plus one batch (rounded up to
    RING_ALIGN)."""
    if window <= 0:
        return n_ctx
    slots = window + n_batch - 1
    if window >= RING_ALIGN:
        slots = -(-slots // RING_ALIGN) * RING_ALIGN
    return min(n_ctx, slots)


def slot_bytes(n_head_kv: int, head_dim: int, kv_type) -> int:
    """Bytes one slot of one layer takes: K and V rows of every KV head, plus its int32 position."""
    return 2 * n_head_kv * kvtypes.row_bytes(kvtypes.kv_type(kv_type), head_dim) + 4


def cache_bytes(n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int, kv_type=None) -> int:
    """What KVCache(...) allocates (before alignment padding, < 64 bytes an array)."""
    slots = sum(ring_capacity(n_ctx, int(w), n_batch) for w in windows)
    return slots * slot_bytes(n_head_kv, head_dim, kv_type)


def _zeroed_block(size: int) -> np.ndarray:
    """size zero bytes, writable, page-aligned, resident only where written (see the module docstring)."""
    if size == 0 or not hasattr(mmap, "MAP_PRIVATE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(size, dtype=np.uint8)  # Windows: numpy's zeros (committed as written there too)
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)


class _Carver:
    """Hands out aligned typed views of one byte block."""

    def __init__(self, block: np.ndarray):
        self.block, self.offset = block, 0

    def take(self, dtype, shape) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start = -(-self.offset // _ALIGN) * _ALIGN
        self.offset = start + nbytes
        return self.block[start:start + nbytes].view(dtype).reshape(shape)

    @staticmethod
    def size(requests) -> int:
        offset = 0
        for dtype, shape in requests:
            offset = -(-offset // _ALIGN) * _ALIGN + int(np.prod(shape)) * np.dtype(dtype).itemsize
        return offset


class KVCache:
    def __init__(self, n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int, kv_type=None, block=None):
        """windows: per layer, 0 for full attention or the sliding window length. block: a uint8 array of
        planned_nbytes(...) bytes to lay the cache out in (KVPool's share), instead of allocating one."""
        if n_ctx <= 0:
            raise ModelError(f"n_ctx must be positive, got {n_ctx}")
        self.kv_type = kvtypes.kv_type(kv_type)
        kvtypes.check_head_dim(self.kv_type, head_dim)
        self.n_ctx, self.n_head_kv, self.head_dim = n_ctx, n_head_kv, head_dim
        self.capacities = tuple(ring_capacity(n_ctx, w, n_batch) for w in windows)
        requests = self._requests(self.capacities, n_head_kv, head_dim, self.kv_type)
        size = _Carver.size(requests)
        if block is None:
            block = _zeroed_block(size)  # the one allocation
        elif block.dtype != np.uint8 or block.ndim != 1 or block.size != size:
            raise ModelError(f"a KV cache of this layout needs a uint8 block of {size} bytes")
        self._block = block
        carver = _Carver(self._block)
        n_layer = len(self.capacities)
        slot_positions = [carver.take(*request) for request in requests[:n_layer]]
        requests = requests[n_layer:]
        self.layers = []
        for slot_pos, window in zip(slot_positions, windows):
            k, v, k_scale, v_scale = (carver.take(*request) for request in requests[:4])
            requests = requests[4:]
            slot_pos[:] = EMPTY_SLOT
            self.layers.append(LayerKV(k, v, k_scale, v_scale, slot_pos, int(window)))
        self.n_past = 0  # positions [0, n_past) have been written
        self.pool, self.pool_index = None, -1  # a KVPool's cache: the pool and this cache's index in it
        self.n_shifted = 0  # positions dropped by context shifts so far (the cache's positions lag by this)
        self.shift_log: list[tuple[int, int]] = []  # (n_keep, n_discard) of every shift since the last reset

    @staticmethod
    def _requests(capacities, n_head_kv, head_dim, kvt):
        """(dtype, shape) of every array, in block order: every layer's slot positions, then per layer K, V,
        K scales, V scales. The slot positions are the only part written at allocation (EMPTY_SLOT); kept
        together at the front, they touch a page or two, and the rest of the zeroed block stays unmapped until
        the cache fills (numpy asks for huge pages on big arrays: slot positions between the layers' values
        would map a 2 MB page per layer, the whole cache at allocation)."""
        n_scales = head_dim // kvt.block if kvt.block else 0
        requests = [(np.int32, (capacity,)) for capacity in capacities]
        for capacity in capacities:
            values = (kvt.dtype, (n_head_kv, capacity, head_dim))
            scales = (np.float32, (n_head_kv, capacity, n_scales) if n_scales else (0, 0, 0))
            requests += [values, values, scales, scales]
        return requests

    @classmethod
    def planned_nbytes(cls, n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type=None) -> int:
        """The block size KVCache(...) with these arguments allocates, without allocating it."""
        capacities = [ring_capacity(n_ctx, w, n_batch) for w in windows]
        return _Carver.size(cls._requests(capacities, n_head_kv, head_dim, kvtypes.kv_type(kv_type)))

    @property
    def nbytes(self) -> int:
        return self._block.nbytes

    def bytes_per_token(self) -> int:
        """Bytes of K and V one more token of context adds (full-attention layers only: rings are fixed)."""
        row = kvtypes.row_bytes(self.kv_type, self.head_dim)
        return sum(2 * self.n_head_kv * row for kv in self.layers if kv.window == 0)

    def reset(self) -> None:
        for layer in self.layers:
            layer.slot_pos.fill(EMPTY_SLOT)
        self.n_past = 0
        self.n_shifted = 0
        self.shift_log = []

    def truncate(self, n_past: int) -> None:
        """Keep positions [0, n_past) only: later slots are marked empty, nothing is copied. A window ring's slot that
        a dropped position overwrote held a position older than the window, which no later query reads."""
        if not 0 <= n_past <= self.n_past:
            raise ModelError(f"cannot truncate {self.n_past} cached positions to {n_past}")
        for layer in self.layers:
            layer.slot_pos[layer.slot_pos >= n_past] = EMPTY_SLOT
        self.n_past = n_past

    # -- context shift ---------------------------------------------------------------------------------------
    def shift(self, n_keep: int, n_discard: int, layer_rope) -> None:
        """Drop positions [n_keep, n_keep + n_discard); later positions move down by n_discard, their keys
        rotated back by n_discard. layer_rope(il) -> (inv_freq float32 [n_rot/2], neox: bool)."""
        if not (0 <= n_keep and 0 < n_discard and n_keep + n_discard <= self.n_past):
            raise ModelError(f"cannot shift: n_keep {n_keep} + n_discard {n_discard} exceed the {self.n_past} "
                             "cached positions")
        for il, layer in enumerate(self.layers):
            capacity = layer.slot_pos.shape[0]
            held = np.flatnonzero(layer.slot_pos != EMPTY_SLOT)
            pos = layer.slot_pos[held].astype(np.int64)
            keep = (pos < n_keep) | (pos >= n_keep + n_discard)
            moved = keep & (pos >= n_keep + n_discard)
            old_slots, new_pos = held[keep], np.where(moved[keep], pos[keep] - n_discard, pos[keep])
            new_slots = new_pos % capacity
            # decode what stays, rotate the moved keys back, and write everything to its new slot
            k = kvtypes.decode_ref(layer.k[:, old_slots], _scales(layer.k_scale, old_slots), self.kv_type)
            v_vals, v_scales = layer.v[:, old_slots].copy(), _scales(layer.v_scale, old_slots).copy()
            inv_freq, neox = layer_rope(il)
            rotate = moved[keep]
            if rotate.any():
                shifted = k[:, rotate].transpose(1, 0, 2)  # [n, H_kv, hd]
                back = np.full(shifted.shape[0], -n_discard, dtype=np.int64)
                k[:, rotate] = ops.rope_ref(shifted, back, inv_freq, neox).transpose(1, 0, 2)
            k_vals, k_scales = kvtypes.encode_ref(k, self.kv_type)
            layer.slot_pos[:] = EMPTY_SLOT
            layer.k[:, new_slots], layer.v[:, new_slots] = k_vals, v_vals
            if self.kv_type.block:
                layer.k_scale[:, new_slots], layer.v_scale[:, new_slots] = k_scales, v_scales
            layer.slot_pos[new_slots] = new_pos
        self.n_past -= n_discard
        self.n_shifted += n_discard
        self.shift_log.append((n_keep, n_discard))

    def copy_prefix(self, src: "KVCache", n: int) -> bool:
        """Hold src's positions [0, n) and nothing else (another slot's cache of the same layout). False, this cache
        unchanged, where src cannot give them: another layout, a shifted cache, or a window ring that already
        overwrote a position the next query, at n, must see."""
        if (src.capacities != self.capacities or src.kv_type.name != self.kv_type.name or src.n_head_kv != self.n_head_kv
                or src.head_dim != self.head_dim or not 0 < n <= src.n_past or src.n_shifted):
            return False
        if not prefix.next_query_sees(src.layers, n):
            return False
        self.reset()
        for dst, layer in zip(self.layers, src.layers):
            held = np.flatnonzero((layer.slot_pos != EMPTY_SLOT) & (layer.slot_pos < n))
            dst.k[:, held], dst.v[:, held] = layer.k[:, held], layer.v[:, held]
            if self.kv_type.block:
                dst.k_scale[:, held], dst.v_scale[:, held] = layer.k_scale[:, held], layer.v_scale[:, held]
            dst.slot_pos[held] = layer.slot_pos[held]
        self.n_past = n
        return True

    # -- state -----------------------------------------------------------------------------------------------
    def export_state(self) -> dict:
        """The occupied slots of every layer (values, scales, positions) and n_past: a copy, sized by use."""
        state = {"n_past": self.n_past, "n_shifted": self.n_shifted, "kv_type": self.kv_type.name,
                 "capacities": self.capacities, "layers": []}
        for layer in self.layers:
            held = np.flatnonzero(layer.slot_pos != EMPTY_SLOT)
            state["layers"].append((held, layer.slot_pos[held].copy(), layer.k[:, held].copy(),
                                    layer.v[:, held].copy(), _scales(layer.k_scale, held).copy(),
                                    _scales(layer.v_scale, held).copy()))
        return state

    def import_state(self, state: dict) -> None:
        """Replace the cache's contents with an export_state() snapshot; a snapshot that does not fit this cache
        exactly is refused before anything changes."""
        self.check_state(state)
        self.reset()
        for layer, (held, pos, k, v, k_scale, v_scale) in zip(self.layers, state["layers"]):
            layer.k[:, held], layer.v[:, held] = k, v
            if self.kv_type.block:
                layer.k_scale[:, held], layer.v_scale[:, held] = k_scale, v_scale
            layer.slot_pos[held] = pos
        self.n_past, self.n_shifted = int(state["n_past"]), int(state["n_shifted"])
        self.shift_log = []

    def check_state(self, state: dict) -> None:
        """ModelError unless `state` is a snapshot this cache could have exported: same layout, every layer's slots
        in range and distinct, each holding the position p % capacity says, below n_past, with values and scales
        of this cache's shapes and dtypes. A state file is untrusted input: this is what stands between it and
        fancy-indexed writes (a negative slot wraps, zip() drops missing layers)."""
        def refuse(why):
            raise ModelError(f"state does not fit this cache: {why}")

        if state.get("kv_type") != self.kv_type.name or tuple(state.get("capacities", ())) != self.capacities:
            raise ModelError(f"state of a {state.get('kv_type')} cache with slots {tuple(state.get('capacities', ()))} "
                             f"does not fit this {self.kv_type.name} cache with slots {self.capacities}")
        n_past, n_shifted = state.get("n_past"), state.get("n_shifted")
        for name, value in (("n_past", n_past), ("n_shifted", n_shifted)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                refuse(f"{name} must be a non-negative integer, got {value!r}")
        if n_past > self.n_ctx:
            refuse(f"n_past {n_past} exceeds n_ctx {self.n_ctx}")
        layers = state.get("layers")
        if not isinstance(layers, (list, tuple)) or len(layers) != len(self.layers):
            refuse(f"{len(layers) if isinstance(layers, (list, tuple)) else 'no'} layers, this cache has "
                   f"{len(self.layers)}")
        for il, (layer, saved) in enumerate(zip(self.layers, layers)):
            if len(saved) != 6 or not all(isinstance(a, np.ndarray) for a in saved):
                refuse(f"layer {il} is not six arrays")
            held, pos, k, v, k_scale, v_scale = saved
            capacity = layer.slot_pos.shape[0]
            if held.ndim != 1 or held.dtype.kind not in "iu" or pos.shape != held.shape or pos.dtype.kind not in "iu":
                refuse(f"layer {il}: slots and positions must be equal-length integer vectors")
            if held.size:
                if held.min() < 0 or held.max() >= capacity or np.unique(held).size != held.size:
                    refuse(f"layer {il}: slots must be distinct and in [0, {capacity})")
                if pos.min() < 0 or pos.max() >= n_past:
                    refuse(f"layer {il}: positions must lie in [0, n_past={n_past})")
                if np.any(pos.astype(np.int64) % capacity != held):
                    refuse(f"layer {il}: a position is not in the slot its ring puts it in")
            n = held.size
            for name, a, like in (("k", k, layer.k), ("v", v, layer.v)):
                if a.dtype != like.dtype or a.shape != (like.shape[0], n, like.shape[2]):
                    refuse(f"layer {il}: {name} is {a.dtype}{list(a.shape)}, expected "
                           f"{like.dtype}{[like.shape[0], n, like.shape[2]]}")
            if self.kv_type.block:
                for name, a, like in (("k_scale", k_scale, layer.k_scale), ("v_scale", v_scale, layer.v_scale)):
                    if a.dtype != like.dtype or a.shape != (like.shape[0], n, like.shape[2]):
                        refuse(f"layer {il}: {name} is {a.dtype}{list(a.shape)}, expected "
                               f"{like.dtype}{[like.shape[0], n, like.shape[2]]}")


def _scales(scales: np.ndarray, slots: np.ndarray) -> np.ndarray:
    return scales[:, slots] if scales.size else np.zeros((scales.shape[0], slots.size, 0), np.float32)


class KVPool:
    """n_seq KV caches of one layout carved from one allocation: batched decoding's memory (one cache per
    sequence slot, each a ring that shifts on its own). Nothing is allocated per token or per sequence."""

    def __init__(self, n_seq: int, n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int, kv_type=None):
        if n_seq <= 0:
            raise ModelError(f"a KV pool needs at least one sequence, got {n_seq}")
        self.seq_nbytes = KVCache.planned_nbytes(n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type)
        self.seq_nbytes += -self.seq_nbytes % _ALIGN  # each sequence's share starts on a cache line
        self._block = _zeroed_block(n_seq * self.seq_nbytes)
        size = KVCache.planned_nbytes(n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type)
        self.caches = [KVCache(n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type,
                               block=self._block[i * self.seq_nbytes: i * self.seq_nbytes + size])
                       for i in range(n_seq)]
        for i, cache in enumerate(self.caches):
            cache.pool, cache.pool_index = self, i
        # Per layer, every sequence's arrays as one view with a leading sequence axis (the caches share one
        # layout, seq_nbytes apart), so one kernel call serves all the sequences of a decode step.
        self.stacked = [LayerKV(*(self._stack(a) for a in (kv.k, kv.v, kv.k_scale, kv.v_scale, kv.slot_pos)),
                                kv.window) for kv in self.caches[0].layers]

    def _stack(self, a: np.ndarray) -> np.ndarray:
        if a.size == 0:
            return np.zeros((len(self.caches),) + a.shape, a.dtype)
        return np.lib.stride_tricks.as_strided(a, (len(self.caches),) + a.shape, (self.seq_nbytes,) + a.strides)

    @staticmethod
    def planned_nbytes(n_seq, n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type=None) -> int:
        one = KVCache.planned_nbytes(n_ctx, n_head_kv, head_dim, windows, n_batch, kv_type)
        return n_seq * (one + -one % _ALIGN)

    @property
    def nbytes(self) -> int:
        return self._block.nbytes
