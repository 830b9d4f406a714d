"""The real models against llama.cpp's recorded outputs (tests/fixtures/<model>.npz / .json), and Gemma's
sliding-window layers against the numpy reference on a prompt longer than the window.

Our kernels compute what llama.cpp's x86 build computes, rounding for rounding (edgellm.engine.ops, quant.matmul_kquant;
op by op in test_ops_llama_exact.py), so on the checked hosts (tests/exact_host.py) the teacher-forced logits equal llama.cpp's bit for bit and the
greedy continuations are identical. The looser checks (top-1 share, near-ties, log-prob tolerance) stay as the
contract on hosts whose C library rounds cos/sin/tanh differently.
"""

import numpy as np
import pytest
from conftest import GEMMA, load_reference
from exact_host import EXACT_HOST, EXACT_HOST_REASON

import edgellm.engine.gguf
from edgellm.engine.models import build_model
from edgellm.engine.reference import ReferenceModel

# A position is a near-tie when llama.cpp scores our choice within this many logits of its own top-1.
NEAR_TIE_LOGITS = 0.5
# Of the positions that are not near-ties, at least this share must have llama.cpp's top-1 token.
TOP1_AGREEMENT = 0.99
# Of all positions, this share must have llama.cpp's top-1 (issues 3 and 4: 99%). How far a small model's top-1
# moves with any change of rounding, measured on llama.cpp itself (tools/llama_cpp_self_agreement.py): its own run
# with an f32 KV cache agrees with its default (f16 KV) run at 98.4% (SmolLM2) and 96.1% (Gemma) of positions,
# its flash-attention run at 98.4% / 97.8%: only llama.cpp's rounding, bit for bit, gets to 99%.
TOP1_ALL_POSITIONS = {"smollm2-135m": 0.99, "gemma-3-270m": 0.99}
# |our log-prob - llama.cpp's| over llama.cpp's top-40 tokens at every teacher-forced position (llama.cpp's own
# f32-KV run against its default: mean 0.12 / 0.16, max 0.94 / 1.51).
LOGPROB_MEAN_TOL = 0.25
LOGPROB_MAX_TOL = 2.5
# Fast path (quantized kernels) vs float64 reference on the same weights, Gemma's last positions.
LONG_PROMPT_NMSE = 5e-3
GREEDY_TOKENS = 48
LONG_PROMPT = 600  # > Gemma's 512-token window
N_CTX = 1024

@pytest.fixture(scope="module")
def model_for():
    """model_for(name, path, n_batch) -> (GGUF file, model), built once per module and closed at its end."""
    built = {}

    def get(name, path, n_batch=512):
        if (name, n_batch) not in built:
            f = edgellm.engine.gguf.open(path)
            built[name, n_batch] = (f, build_model(f, n_ctx=N_CTX, n_threads=2, n_batch=n_batch))
        return built[name, n_batch]

    yield get
    for f, _ in built.values():
        f.close()


def log_softmax(logits):
    top = logits.max(axis=-1, keepdims=True)
    return logits - (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))


def stop_ids(metadata):
    return {metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata}


def test_teacher_forced_logits_match_llama_cpp(real_model, model_for):
    name, path = real_model
    _, model = model_for(name, path)
    _, npz = load_reference(name)
    agree, decisive, decisive_agree, diffs = 0, 0, 0, []
    for p in range(4):
        ids = npz[f"p{p}_ids"]
        top_ids, top_logits = npz[f"p{p}_topk_ids"], npz[f"p{p}_topk_logits"]
        model.reset()
        logits = model.forward(ids, all_logits=True)
        ours = log_softmax(logits)
        theirs = top_logits - npz[f"p{p}_logsumexp"][:, None]
        diffs.append(np.abs(np.take_along_axis(ours, top_ids, axis=1) - theirs))
        our_top1 = logits.argmax(axis=1)
        for pos, token in enumerate(our_top1):
            same = token == top_ids[pos, 0]
            agree += same
            if not same:  # llama.cpp must itself rate our choice close to its own
                assert token in top_ids[pos], f"p{p} position {pos}: our top-1 {token} not in llama.cpp's top-40"
                gap = top_logits[pos, 0] - top_logits[pos, list(top_ids[pos]).index(token)]
                assert gap < NEAR_TIE_LOGITS, f"p{p} position {pos}: llama.cpp prefers {top_ids[pos, 0]} by {gap:.3f}"
            if top_logits[pos, 0] - top_logits[pos, 1] >= NEAR_TIE_LOGITS:
                decisive += 1
                decisive_agree += same
    diffs = np.concatenate(diffs)
    n_positions = diffs.shape[0]
    print(f"{name}: top-1 {agree}/{n_positions}, decisive {decisive_agree}/{decisive}, "
          f"log-prob |diff| mean {diffs.mean():.4f} max {diffs.max():.4f}")
    assert decisive_agree >= TOP1_AGREEMENT * decisive
    assert agree >= TOP1_ALL_POSITIONS[name] * n_positions
    assert diffs.mean() < LOGPROB_MEAN_TOL
    assert diffs.max() < LOGPROB_MAX_TOL


@pytest.mark.skipif(not EXACT_HOST, reason=EXACT_HOST_REASON)
def test_teacher_forced_logits_are_llama_cpp_bits(real_model, model_for):
    """Every position's top-40 logits equal llama.cpp's exactly (float32 bits), over all four sequences."""
    name, path = real_model
    _, model = model_for(name, path)
    _, npz = load_reference(name)
    for p in range(4):
        model.reset()
        logits = model.forward(npz[f"p{p}_ids"], all_logits=True)
        ours = np.take_along_axis(logits, npz[f"p{p}_topk_ids"], axis=1)
        differ = np.argwhere(ours != npz[f"p{p}_topk_logits"])
        assert differ.size == 0, f"{name} p{p}: {len(differ)} logits differ, first at position {differ[0][0]}"


def test_greedy_continuation_matches_llama_cpp(real_model, model_for):
    name, path = real_model
    f, model = model_for(name, path)
    js, npz = load_reference(name)
    stops = stop_ids(f.metadata)
    for p, case in enumerate(js["greedy"]):
        model.reset()
        logits = model.forward(case["prompt_ids"])
        generated = []
        for _ in range(GREEDY_TOKENS):
            token = int(logits[0].argmax())
            generated.append(token)
            if token in stops:
                break
            logits = model.forward([token])
        expected = case["greedy_ids"]
        if generated == expected:
            continue
        assert not EXACT_HOST, f"{name} p{p}: greedy continuation differs from llama.cpp's"
        # They differ: where they first do, llama.cpp's own logits must be a near-tie between the two tokens.
        first = next(i for i, (a, b) in enumerate(zip(generated, expected)) if a != b)
        pos = len(case["prompt_ids"]) - 1 + first
        top_ids, top_logits = list(npz[f"p{p}_topk_ids"][pos]), npz[f"p{p}_topk_logits"][pos]
        assert generated[first] in top_ids, f"p{p} step {first}: {generated[first]} not in llama.cpp's top-40"
        gap = top_logits[0] - top_logits[top_ids.index(generated[first])]
        print(f"{name} p{p}: greedy differs at step {first} ({generated[first]} vs {expected[first]}), "
              f"llama.cpp gap {gap:.3f}")
        assert gap < NEAR_TIE_LOGITS


def _long_prompt(npz):
    ids = np.concatenate([npz[f"p{p}_ids"][1:] for p in range(4)])  # without the BOS each one starts with
    return np.concatenate([npz["p0_ids"][:1], np.resize(ids, LONG_PROMPT - 1)]).astype(np.int32)


def test_gemma_long_prompt_matches_reference(gemma_path, model_for):
    """600 tokens through 512-token windows, prefilled in batches of 64 so the ring (575 slots) wraps, then
    decoded one token at a time: the last positions must match the reference's full recomputation."""
    f, model = model_for(GEMMA, gemma_path, n_batch=64)
    _, npz = load_reference(GEMMA)
    ids = _long_prompt(npz)
    n_decode = 6
    model.reset()
    prefill_last = model.forward(ids[:-n_decode], all_logits=True)[-2:]
    decoded = [model.forward(ids[i: i + 1])[0].copy() for i in range(len(ids) - n_decode, len(ids))]
    assert model.cache.capacities[0] < LONG_PROMPT  # the sliding layers' ring really wrapped
    want = ReferenceModel(f).logits(ids, last_n=n_decode + 2)
    got = np.concatenate([prefill_last, np.stack(decoded)])
    error = float(np.sum((got - want) ** 2) / np.sum(want.astype(np.float64) ** 2))
    print(f"gemma {LONG_PROMPT}-token prompt: NMSE vs reference {error:.2e}")
    assert error < LONG_PROMPT_NMSE
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
