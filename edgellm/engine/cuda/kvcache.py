"""The KV cache in GPU memory, sized and laid out like edgellm.engine.kvcache.KVCache (same ring capacities, so a
sliding-window layer holds window + n_batch - 1 slots, not n_ctx).

Slot positions live twice: on the device, where the attention mask reads them and the rope kernel writes them,
and as a host mirror (`LayerKV.slot_pos`) that the API's prefix reuse reads and edits. The host's edits only
ever mark slots holding positions >= n as empty when rewinding to n; the device copy need not follow, because
such a stale position is either overwritten by the next batch before attention runs or lies after every query
of that batch, which the causal mask already hides. reset() empties both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from edgellm.errors import ModelError
from edgellm.engine.kvcache import EMPTY_SLOT, ring_capacity


@dataclass(frozen=True)
class DeviceLayerKV:
    k: object  # device f32 [n_head_kv, capacity, head_dim]
    v: object  # device f32 [n_head_kv, capacity, head_dim]
    slot_pos: np.ndarray  # host int32 [capacity]: mirror of slot_pos_device (read and edited by the API)
    slot_pos_device: object  # device int32 [capacity]: the position each slot holds, EMPTY_SLOT if none
    window: int  # 0: full attention; else a query at p sees keys p - window < kp <= p


class DeviceKVCache:
    def __init__(self, n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int):
        if n_ctx <= 0:
            raise ModelError(f"n_ctx must be positive, got {n_ctx}")
        self.n_ctx = n_ctx
        self.capacities = tuple(ring_capacity(n_ctx, w, n_batch) for w in windows)
        per_slot = n_head_kv * head_dim
        total_slots = sum(self.capacities)
        self._block = cuda.device_array(2 * total_slots * per_slot, dtype=np.float32)  # [K0 V0 K1 V1 ...]
        self._positions = np.full(total_slots, EMPTY_SLOT, dtype=np.int32)
        self._positions_device = cuda.to_device(self._positions)
        self.layers = []
        slot_offset = 0
        for capacity, window in zip(self.capacities, windows):
            start, size = 2 * slot_offset * per_slot, capacity * per_slot
            k = self._block[start: start + size].reshape(n_head_kv, capacity, head_dim)
            v = self._block[start + size: start + 2 * size].reshape(n_head_kv, capacity, head_dim)
            end = slot_offset + capacity
            self.layers.append(DeviceLayerKV(k, v, self._positions[slot_offset:end],
                                             self._positions_device[slot_offset:end], int(window)))
            slot_offset = end
        self.n_past = 0

    @property
    def nbytes(self) -> int:
        """Device bytes: K and V plus the slot positions."""
        return self._block.size * 4 + self._positions.nbytes

    def reset(self) -> None:
        self._positions.fill(EMPTY_SLOT)
        self._positions_device.copy_to_device(self._positions)
        self.n_past = 0

    def record(self, positions: np.ndarray) -> None:
        """Mirror on the host what the rope kernel writes on the device for these positions."""
        for layer in self.layers:
            layer.slot_pos[positions % layer.slot_pos.shape[0]] = positions


def kv_cache_nbytes(n_ctx: int, n_head_kv: int, head_dim: int, windows, n_batch: int) -> int:
    """What DeviceKVCache would allocate, for the memory check before anything is uploaded."""
    slots = sum(ring_capacity(n_ctx, w, n_batch) for w in windows)
    return slots * (2 * n_head_kv * head_dim * 4 + 4)
