"""The CUDA path: the same models on an NVIDIA GPU, through numba-cuda (the optional `edgellm[cuda]` extra).

    device.py        check_device / resolve_device: is a GPU usable, and what is missing when not
    quant_kernels.py matrix products and embedding rows straight from the GGUF blocks
    op_kernels.py    RMSNorm, RoPE + KV store, attention over the device KV cache, gated activations
    weights.py       DeviceMatrix (a weight on the device) and the kernel launch helpers
    kvcache.py       the KV cache in device memory
    models.py        llama-family and Gemma 3 forward passes on the device
    ptx_check.py     compile every kernel to PTX without a GPU

Importing this package does not import numba.cuda; only build_cuda_model and check_device do.
"""

from __future__ import annotations

from edgellm.engine.cuda.device import DEVICE_CHOICES, check_device, resolve_device, simulator_enabled
from edgellm.errors import DeviceError, ModelError


def build_cuda_model(gguf_file, n_ctx: int | None = None, n_batch: int | None = None, kv_type=None, **_cpu_only):
    """The model of gguf_file on the GPU, with the CPU models' interface (forward, reset, n_past, n_vocab,
    n_ctx). DeviceError when no GPU is usable; options that only concern the CPU (n_threads) are ignored. The
    KV cache is f32: kv_type may be None or "f32"."""
    from edgellm.engine.kvtypes import kv_type as parse_kv_type  # kernels: slow to import, loaded with a model
    kvt = parse_kv_type(kv_type)  # ValueError for an unknown name, before anything is built
    if kv_type is not None and kvt.name != "f32":
        raise ValueError(f"the CUDA model stores its KV cache in f32; kv_type {kvt.name!r} is CPU-only")
    resolve_device("cuda")
    # numba-cuda (an optional extra) and the CPU models' numba kernels load here, once a GPU is known usable
    from edgellm.engine.cuda.models import CUDA_MODELS
    from edgellm.engine.models import get_architecture
    from edgellm.engine.models.base import DEFAULT_N_BATCH
    arch = get_architecture(gguf_file.metadata.get("general.architecture", "<missing>"))
    if arch.name not in CUDA_MODELS:
        raise ModelError(f"architecture {arch.name!r} has no CUDA forward pass yet; "
                         f"supported on CUDA: {', '.join(sorted(CUDA_MODELS))}")
    config = arch.config_class.from_gguf(gguf_file)
    if getattr(config, "experts", None) is not None and config.experts.n_expert:
        raise ModelError(f"{arch.name} files with experts (a mixture of experts) have no CUDA forward pass yet; "
                         "they run on the CPU")
    scaling = config.rope_scaling
    if scaling.ext_factor:  # the device rope has no YaRN blend
        raise ModelError(f"rope scaling {scaling.kind!r} is CPU-only; the CUDA path computes plain and linear rope "
                         "(with per-pair factors and an attn_factor)")
    try:
        return CUDA_MODELS[arch.name](gguf_file, config, n_ctx or config.n_ctx_train, n_batch or DEFAULT_N_BATCH)
    except _cuda_driver_errors() as err:  # e.g. the GPU is taken, or ran out of memory mid-upload
        raise DeviceError(f"CUDA failed while loading the model: {err}") from err


def _cuda_driver_errors() -> tuple:
    try:
        # numba-cuda: an optional extra, imported only on the GPU path
        from numba.cuda.cudadrv.error import CudaDriverError, CudaSupportError
    except ImportError:  # the simulator has neither
        return ()
    return CudaDriverError, CudaSupportError


__all__ = ["DEVICE_CHOICES", "build_cuda_model", "check_device", "resolve_device", "simulator_enabled"]
