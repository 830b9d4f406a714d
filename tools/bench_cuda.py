"""Prompt processing (pp) and token generation (tg) speed of the CUDA path, with the share of the GPU's memory
bandwidth that decoding reaches. For GPU hosts (pip install 'edgellm[cuda]'); elsewhere it says why it cannot run.

    python tools/bench_cuda.py                          # both catalog models, pp 512, tg 128
    python tools/bench_cuda.py --models /path/model.gguf --n-prompt 256 --n-gen 64

Bandwidth is measured in the same run with a device-to-device copy (bytes read + bytes written per second).
A decode step must read every weight once (the embedding only as the tied output projection) plus the K and V
of every cached position: that byte count times tokens/s over the copy bandwidth is the share reported.
Random token ids are used: speed does not depend on the text.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgellm.engine.cuda import check_device, simulator_enabled  # noqa: E402

DEFAULT_MODELS = ("smollm2-135m", "gemma-3-270m")
COPY_BYTES = 1 << 30  # large enough that the copy runs at full speed
COPY_REPEATS = 10


def copy_bandwidth() -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of COPY_REPEATS."""
    from numba import cuda
    src = cuda.device_array(COPY_BYTES // 4, dtype=np.float32)
    dst = cuda.device_array_like(src)
    dst.copy_to_device(src)  # warm up
    best = float("inf")
    for _ in range(COPY_REPEATS):
        start, end = cuda.event(), cuda.event()
        start.record()
        dst.copy_to_device(src)
        end.record()
        end.synchronize()
        best = min(best, cuda.event_elapsed_time(start, end) / 1e3)
    del src, dst
    return 2 * COPY_BYTES / best


def decode_bytes(model, n_past: int) -> int:
    """Bytes one decode step at position n_past must read: the weights and the visible K/V."""
    from edgellm.engine.cuda.weights import DeviceMatrix
    total = 0
    for name, w in model.weights.items():
        if isinstance(w, DeviceMatrix):
            total += w.nbytes if (name != "token_embd.weight" or model.output is w) else w.row_bytes
        elif w is not None:
            total += w.size * 4
    cfg = model.config
    for capacity in model.cache.capacities:
        total += 2 * min(capacity, n_past + 1) * cfg.n_head_kv * cfg.head_dim * 4
    return total


def bench_model(source: str, n_prompt: int, n_gen: int, n_ctx: int, bandwidth: float) -> dict:
    import edgellm.engine.gguf
    from edgellm.store import catalog
    from edgellm.engine.cuda import build_cuda_model
    path = source if Path(source).exists() else catalog.pull(source)
    with edgellm.engine.gguf.open(path) as f:
        t0 = time.perf_counter()
        model = build_cuda_model(f, n_ctx=n_ctx)
        load_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, model.n_vocab, n_prompt).astype(np.int32)
        # compile every kernel specialisation (prompt and decode shapes) before timing
        model.forward(prompt[:min(16, n_prompt)])
        model.forward(prompt[:1])
        model.reset()
        t0 = time.perf_counter()
        logits = model.forward(prompt)  # returns after the logits are on the host: the GPU is done
        pp_s = time.perf_counter() - t0
        token = int(np.argmax(logits[0]))
        t0 = time.perf_counter()
        for _ in range(n_gen):
            token = int(np.argmax(model.forward(np.array([token], dtype=np.int32))[0]))
        tg_s = time.perf_counter() - t0
        tg_tps = n_gen / tg_s
        mid_position = n_prompt + n_gen // 2
        return {
            "model": Path(path).name, "load_s": load_s, "pp_tps": n_prompt / pp_s, "tg_tps": tg_tps,
            "bytes_per_token": decode_bytes(model, mid_position),
            "bandwidth_share": decode_bytes(model, mid_position) * tg_tps / bandwidth,
        }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="catalog names or .gguf paths")
    parser.add_argument("--n-prompt", type=int, default=512, help="prompt tokens for pp (default 512)")
    parser.add_argument("--n-gen", type=int, default=128, help="generated tokens for tg (default 128)")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context size (default 2048)")
    args = parser.parse_args(argv)
    ok, reason = check_device()
    if not ok or simulator_enabled():
        why = reason if not ok else "the CUDA simulator is enabled (NUMBA_ENABLE_CUDASIM=1); unset it"
        print(f"bench_cuda: no usable GPU here, nothing measured: {why}", file=sys.stderr)
        return 2
    print(f"device: {reason}")
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s (read + write)")
    print(f"{'model':<38} {'load s':>7} {'pp t/s':>9} {'tg t/s':>8} {'MB/token':>9} {'BW share':>9}")
    for source in args.models:
        r = bench_model(source, args.n_prompt, args.n_gen, args.n_ctx, bandwidth)
        print(f"{r['model']:<38} {r['load_s']:>7.2f} {r['pp_tps']:>9.1f} {r['tg_tps']:>8.1f} "
              f"{r['bytes_per_token'] / 1e6:>9.1f} {r['bandwidth_share']:>8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
