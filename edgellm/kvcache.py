"""The KV cache: every layer's K and V in one preallocated block, with the position each slot holds.

Layer il owns capacity[il] slots; position p lives in slot p % capacity[il]. A full-attention layer gets
capacity n_ctx (so the slot is the position); a sliding-window layer gets a ring just big enough for the window
plus one batch of new tokens, because a batch's earliest query still needs keys from window - 1 positions back
while its latest keys are being written. Slot positions (-1 = empty) are what the attention mask reads, so a
later ring with attention sinks, or a cache that drops old tokens, only changes which slots hold what.
"""

from dataclasses import dataclass

import numpy as np

from edgellm.errors import ModelError

EMPTY_SLOT = -1


@dataclass(frozen=True)
class LayerKV:
    """Views into the shared block for one layer."""

    k: np.ndarray  # [n_head_kv, capacity, head_dim]
    v: np.ndarray  # [n_head_kv, capacity, head_dim]
    slot_pos: np.ndarray  # [capacity] int32: the position held by each slot, EMPTY_SLOT if none
    window: int  # 0: full attention; else a query at p sees keys p - window < kp <= p


def ring_capacity(n_ctx: int, window: int, n_batch: int) -> int:
    """Slots a layer needs: everything for full attention, else the window plus one batch."""
    if window <= 0:
        return n_ctx
    return min(n_ctx, window + n_batch - 1)


class KVCache:
    def __init__(self, n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int, dtype=np.float32):
        """windows: per layer, 0 for full attention or the sliding window length."""
        if n_ctx <= 0:
            raise ModelError(f"n_ctx must be positive, got {n_ctx}")
        self.n_ctx = n_ctx
        self.capacities = tuple(ring_capacity(n_ctx, w, n_batch) for w in windows)
        per_slot = n_head_kv * head_dim
        total_slots = sum(self.capacities)
        self._block = np.zeros(2 * total_slots * per_slot, dtype=dtype)  # [K0 V0 K1 V1 ...], one allocation
        self._positions = np.full(total_slots, EMPTY_SLOT, dtype=np.int32)
        self.layers = []
        slot_offset = 0
        for capacity, window in zip(self.capacities, windows):
            start = 2 * slot_offset * per_slot
            size = capacity * per_slot
            k = self._block[start: start + size].reshape(n_head_kv, capacity, head_dim)
            v = self._block[start + size: start + 2 * size].reshape(n_head_kv, capacity, head_dim)
            slot_pos = self._positions[slot_offset: slot_offset + capacity]
            self.layers.append(LayerKV(k, v, slot_pos, int(window)))
            slot_offset += capacity
        self.n_past = 0  # positions [0, n_past) have been written

    @property
    def nbytes(self) -> int:
        return self._block.nbytes + self._positions.nbytes

    def reset(self) -> None:
        self._positions.fill(EMPTY_SLOT)
        self.n_past = 0
