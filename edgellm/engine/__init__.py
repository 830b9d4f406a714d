"""The engine: a GGUF file in, logits out. The reader, the KV cache and its storage types, the transformer ops,
the architectures (models/) and their CUDA forward passes (cuda/), the memory checks, the per-step profiler and
the prefix bookkeeping that keeps reused cache rows exact."""
