"""Embeddings of texts: each input runs from an empty KV cache of its own, and its tokens' output-normed hidden
states (what llama.cpp's embeddings read, its result_norm) are pooled into one vector: their mean (llama-server's
`--pooling mean`), the last token's, or none (a vector per token); then L2-normalised unless asked not to
(llama-server's default). A cache of the input's own size, so the caller's conversation in the model's cache stays.
"""
from __future__ import annotations

import base64
import numbers

import numpy as np

from edgellm.engine.kvcache import KVCache
from edgellm.errors import EdgeLLMError, PromptError

POOLINGS = ("mean", "last", "none")


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise EdgeLLMError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def input_ids(model, inputs) -> tuple[list, bool]:
    """(token ids per input, whether one input was given) for OpenAI's `input`: a text, a list of texts, a list of
    token ids, or a list of such lists; each checked non-empty and within the context."""
    single = isinstance(inputs, (str, bytes)) or (isinstance(inputs, (list, tuple)) and len(inputs) > 0
                                                  and all(_is_id(t) for t in inputs))
    items = [inputs] if single else inputs
    if not isinstance(items, (list, tuple)) or len(items) == 0:
        raise PromptError("input must be a text, a list of texts, a list of token ids or a list of such lists, "
                          "and not empty")
    ids = []
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            item = item.decode("utf-8")
        if isinstance(item, str):
            tokens = model.tokenize(item, add_special=True) if item else []
        elif isinstance(item, (list, tuple)) and all(_is_id(t) for t in item):
            tokens = [int(t) for t in item]
            bad = [t for t in tokens if not 0 <= t < model.n_vocab]
            if bad:
                raise PromptError(f"input[{i}] has token id {bad[0]}, outside the vocabulary [0, {model.n_vocab})")
        else:
            raise PromptError(f"input[{i}] must be a text or a list of token ids, got {type(item).__name__}")
        if not tokens:
            raise PromptError(f"input[{i}] is empty")
        if len(tokens) > model.n_ctx:
            raise PromptError(f"input[{i}] has {len(tokens)} tokens, more than the context of {model.n_ctx}")
        ids.append(tokens)
    return ids, single


def base64_vector(v: np.ndarray) -> str:
    """OpenAI's encoding_format "base64": the vector's little-endian float32 bytes, base64."""
    return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")


def _is_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def embed_ids(fm, ids_list, pooling: str = "mean", normalize: bool = True) -> list:
    """A float32 vector per input ([n_tokens, n_embd] with pooling "none"). fm: the forward model (it needs
    forward_embeddings: the CPU engine's)."""
    check_pooling(pooling)
    if not hasattr(fm, "forward_embeddings"):
        raise EdgeLLMError("this model's engine computes no embeddings (the CPU engine does)")
    cfg, step = fm.config, fm.n_batch
    out = []
    for ids in ids_list:
        cache = KVCache(len(ids), cfg.n_head_kv, cfg.head_dim, cfg.layer_windows(), step, fm.kv_type)
        tokens = np.asarray(ids, dtype=np.int32)
        # a call per n_batch batch (forward()'s batches): another thread's forward passes, a server's decode steps,
        # run between them
        rows = [fm.forward_embeddings(tokens[b0:b0 + step], cache) for b0 in range(0, len(tokens), step)]
        out.append(pooled(np.concatenate(rows), pooling, normalize))
    return out


def pooled(rows: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """rows [n_tokens, n_embd] pooled (in float64) and L2-normalised where asked."""
    if pooling == "mean":
        v = rows.astype(np.float64).mean(axis=0)
    elif pooling == "last":
        v = rows[-1].astype(np.float64)
    else:
        v = rows.astype(np.float64)
    if normalize:
        norm = np.sqrt((v * v).sum(axis=-1, keepdims=True))
        v = v / np.where(norm > 0, norm, 1.0)
    return v.astype(np.float32)


def embedding_response(vectors, model_name: str, n_tokens: int, base64_encoded: bool = False) -> dict:
    """OpenAI's CreateEmbeddingResponse (llama-cpp-python's create_embedding shape): each vector a list of floats,
    or OpenAI's encoding_format "base64"."""
    encode = base64_vector if base64_encoded else np.ndarray.tolist
    return {"object": "list",
            "data": [{"object": "embedding", "embedding": encode(v), "index": i} for i, v in enumerate(vectors)],
            "model": model_name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
