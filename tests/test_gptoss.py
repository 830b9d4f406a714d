"""gpt-oss's pieces (edgellm/engine/models/gptoss.py) against float64 references: attention sinks in the scalar
attention kernel, the clamped SwiGLU, top-k-then-softmax routing; and its harmony chat template rendered through the
Jinja path. The whole model against llama.cpp's logits: test_tiny_archs_llama_cpp.py (gptoss_8x4).

tests/fixtures/gpt_oss_chat_template.jinja is the chat template of openai/gpt-oss-120b (Apache-2.0), as the
gpt-oss GGUF files carry it (llama.cpp keeps the same file as models/templates/openai-gpt-oss-120b.jinja).
"""
from pathlib import Path

import numpy as np
import pytest

from edgellm.compat.chat import ChatTemplateError, render_chat
from edgellm.engine import ops
from edgellm.engine.models import moe
from edgellm.engine.ops import attention_drivers
from edgellm.engine.ops.attention_rows import _attend_rows_vec

# float32 kernels against float64 references: rounding only (attention sums in llama.cpp's order, not numpy's).
NMSE_ATTENTION = 1e-10
NMSE_F32 = 1e-10
# float32 softmax and division against float64: a few ulps of the weights.
ROUTE_WEIGHTS_RTOL = 1e-5

HARMONY = (Path(__file__).parent / "fixtures" / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")


def nmse(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.sum((got - want) ** 2) / max(np.sum(want**2), 1e-30))


def _attention_case(rng, n_new, n_heads=4, n_kv=2, hd=64, n_keys=20, capacity=32):
    q = (3.0 * rng.standard_normal((n_new, n_heads, hd))).astype(np.float32)
    k = rng.standard_normal((n_keys, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_keys, n_kv, hd)).astype(np.float32)
    positions = np.arange(n_keys, dtype=np.int32)
    k_cache = np.zeros((n_kv, capacity, hd), np.float32)
    v_cache = np.zeros((n_kv, capacity, hd), np.float32)
    slot_pos = np.full(capacity, -1, np.int32)
    ops.kv_store(k, v, positions, k_cache, v_cache, slot_pos)
    return q, k, v, positions, (k_cache, v_cache, slot_pos)


@pytest.mark.parametrize("n_new", [1, 6])  # one query row and several: llama.cpp's two summation orders
@pytest.mark.parametrize("window", [0, 5])
def test_sinks_join_the_softmax_denominator(n_new, window):
    """Each head's sink adds exp(sink) to its softmax's denominator; sinks near the scores' size, so that a
    missing (or misplaced) sink fails, and one far above them, which must take the max's place."""
    rng = np.random.default_rng(n_new + window)
    q, k, v, positions, (k_cache, v_cache, slot_pos) = _attention_case(rng, n_new)
    sinks = np.array([3.0, 5.0, 4.0, 60.0], np.float32)  # (the scores here are a few units)
    out = np.empty_like(q)
    ops.attention(q, k_cache, v_cache, slot_pos, positions[-n_new:], window, 0.125, out,
                  ops.attention_scratch(32, 64), sinks=sinks)
    want = ops.attention_ref(q, k, v, positions[-n_new:], positions, window, 0.125, sinks=sinks)
    assert nmse(out, want) < NMSE_ATTENTION
    plain = ops.attention_ref(q, k, v, positions[-n_new:], positions, window, 0.125)
    assert nmse(plain[:, :3], want[:, :3]) > 1e-3
    assert np.abs(want[:, 3]).max() < 1e-6 * np.abs(plain[:, 3]).max()  # a sink far above every score


def test_absent_sinks_give_the_plain_kernels_bits():
    """Sinks of -inf add nothing: the sink path's bits equal the plain kernels' (which have no sink step)."""
    rng = np.random.default_rng(7)
    for n_new in (1, 6):
        q, _, _, positions, cache = _attention_case(rng, n_new)
        plain, sunk = np.empty_like(q), np.empty_like(q)
        scratch = ops.attention_scratch(32, 64)
        ops.attention(q, *cache, positions[-n_new:], 0, 0.125, plain, scratch)
        ops.attention(q, *cache, positions[-n_new:], 0, 0.125, sunk, scratch,
                      sinks=np.full(4, -np.inf, np.float32))
        assert plain.tobytes() == sunk.tobytes()


@pytest.mark.parametrize("n_new", [1, 6])
def test_vector_and_scalar_sink_kernels_agree_bit_for_bit(n_new):
    """An f16 cache takes the vector kernels (a decode row; a prompt batch ROWS rows at a time, then its tail row by
    row); a strided out forces the scalar one: the same bits, as without sinks."""
    rng = np.random.default_rng(11)
    q, k, v, positions, _ = _attention_case(rng, n_new)
    k16, v16 = np.zeros((2, 32, 64), np.uint16), np.zeros((2, 32, 64), np.uint16)
    slot_pos = np.full(32, -1, np.int32)
    ops.kv_store(k, v, positions, k16, v16, slot_pos)
    sinks = np.array([3.0, 5.0, 4.0, 60.0], np.float32)
    vec = np.empty_like(q)
    strided = np.empty((n_new, 4, 128), np.float32)[:, :, :64]
    for out in (vec, strided):
        ops.attention(q, k16, v16, slot_pos, positions[-n_new:], 0, 0.125, out, ops.attention_scratch(32, 64),
                      sinks=sinks)
    assert vec.tobytes() == np.ascontiguousarray(strided).tobytes()


def _f16_prompt_case(rng, n_new, capacity, n_keys=40):
    """A prompt's last n_new rows over an f16 cache of n_keys positions (a ring that has wrapped when capacity is
    below n_keys), and sinks near the scores' size but for head 3's, far above them."""
    q, k, v, positions, _ = _attention_case(rng, n_new, n_keys=n_keys, capacity=capacity)
    k16, v16 = np.zeros((2, capacity, 64), np.uint16), np.zeros((2, capacity, 64), np.uint16)
    slot_pos = np.full(capacity, -1, np.int32)
    ops.kv_store(k, v, positions, k16, v16, slot_pos)
    return q, (k16, v16, slot_pos), positions[-n_new:], np.array([3.0, 5.0, 4.0, 60.0], np.float32)


def _scalar_sink_attention(q, cache, q_positions, window, sinks):
    """The scalar kernel's bits (a strided out rules the vector kernels out)."""
    strided = np.empty((q.shape[0], q.shape[1], 2 * q.shape[2]), np.float32)[:, :, :q.shape[2]]
    ops.attention(q, *cache, q_positions, window, 0.125, strided, ops.attention_scratch(cache[2].shape[0], 64),
                  sinks=sinks)
    return np.ascontiguousarray(strided)


@pytest.mark.parametrize("n_new", [1, 3, ops.ROWS, ops.ROWS + 1, 2 * ops.ROWS + 3])
@pytest.mark.parametrize("window, capacity", [(0, 64), (8, 32)])  # full attention; a window over a wrapped ring
def test_prompt_rows_with_sinks_equal_the_scalar_kernel(n_new, window, capacity):
    """Prompt rows with sinks through the vector drivers, serial and parallel (blocks of ROWS rows, then the
    tail row by row): the scalar kernel's bits."""
    rng = np.random.default_rng(100 * n_new + window)
    q, cache, q_positions, sinks = _f16_prompt_case(rng, n_new, capacity)
    want = _scalar_sink_attention(q, cache, q_positions, window, sinks)
    scratch = ops.attention_scratch(capacity, 64)
    for kernel in (attention_drivers._attention_sinks_serial_vec, attention_drivers._attention_sinks_parallel_vec):
        out = np.full_like(q, np.nan)
        kernel(q, *cache, q_positions, window, 0.125, sinks, out, scratch)
        assert np.array_equal(out, want)
    out = np.empty_like(q)
    ops.attention(q, *cache, q_positions, window, 0.125, out, scratch, sinks=sinks)
    assert np.array_equal(out, want)


@pytest.mark.parametrize("window, capacity", [(0, 64), (8, 32)])
def test_rows_kernel_takes_the_sink(window, capacity):
    """The ROWS-row kernel itself, one block of each head: with the head's sink, the scalar kernel's bits; with
    -inf (no sink), other values, so a rows kernel that ignored its sink would fail."""
    rng = np.random.default_rng(7 + window)
    n_new = ops.ROWS + 2  # the block starts at row 1: its rows' windows begin at different slots
    q, cache, q_positions, sinks = _f16_prompt_case(rng, n_new, capacity)
    want = _scalar_sink_attention(q, cache, q_positions, window, sinks)
    work = ops.attention_scratch(capacity, 64)[0]
    block = slice(1, 1 + ops.ROWS)
    for h in range(4):
        out, plain = np.full_like(q, np.nan), np.full_like(q, np.nan)
        assert _attend_rows_vec(q, *cache, q_positions, 1, window, np.float32(0.125), h, h // 2, out, work,
                                sinks[h])
        assert np.array_equal(out[block, h], want[block, h])
        assert _attend_rows_vec(q, *cache, q_positions, 1, window, np.float32(0.125), h, h // 2, plain, work,
                                np.float32(-np.inf))
        assert not np.allclose(plain[block, h], want[block, h], rtol=1e-3, atol=0.0)


@pytest.mark.parametrize("sinks", [np.zeros(3, np.float32), np.zeros(4, np.float64)])
def test_sinks_must_be_float32_one_per_head(sinks):
    rng = np.random.default_rng(0)
    q, _, _, positions, cache = _attention_case(rng, 1)
    with pytest.raises(ValueError, match="attention sinks must be float32"):
        ops.attention(q, *cache, positions[-1:], 0, 0.125, np.empty_like(q), sinks=sinks)


@pytest.mark.parametrize("n_rows", [1, 9])  # a decode row; a prompt batch (the parallel kernel)
def test_clamped_swiglu_matches_reference(n_rows):
    """Values well past the limit on both sides, so that a missing clamp (gate above, up both ways) fails."""
    rng = np.random.default_rng(n_rows)
    gate = (rng.standard_normal((n_rows, 300)) * 8).astype(np.float32)
    up = (rng.standard_normal((n_rows, 300)) * 8).astype(np.float32)
    want = ops.swiglu_oai_ref(gate, up)
    got = gate.copy()
    ops.swiglu_oai(got, up)
    assert nmse(got, want) < NMSE_F32
    g = gate.astype(np.float64)
    unclamped = g / (1 + np.exp(-1.702 * g)) * (up + 1.0)
    assert nmse(unclamped, want) > 1e-2
    at_limit = np.full((1, 2), 7.0, np.float32), np.array([[7.0, -7.0]], np.float32)
    beyond = np.array([[50.0, 9.0]], np.float32), np.array([[30.0, -12.0]], np.float32)
    ops.swiglu_oai(*at_limit)
    ops.swiglu_oai(*beyond)
    assert at_limit[0].tobytes() == beyond[0].tobytes()


@pytest.mark.parametrize("n_expert, n_used", [(8, 2), (32, 4), (128, 4)])
def test_top_k_then_softmax_routing_matches_reference(n_expert, n_used):
    """gpt-oss's gating: the k largest logits, softmax over those k alone (not renormalised probabilities of all
    experts, which differ: checked)."""
    rng = np.random.default_rng(n_expert)
    logits = (rng.standard_normal((37, n_expert)) * 3).astype(np.float32)
    ids = np.zeros((37, n_used), np.int32)
    weights = np.zeros((37, n_used), np.float32)
    moe.route_top_k_softmax(logits, n_used, ids, weights)
    ref_ids, ref_w = moe.route_top_k_softmax_ref(logits, n_used)
    assert np.array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=ROUTE_WEIGHTS_RTOL)
    assert np.allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    _, renormalised = moe.route_ref(logits, n_used)  # the same choice; the same weights only when k = 1
    assert np.array_equal(np.argsort(-logits, axis=1, kind="stable")[:, :n_used], ids)
    assert np.allclose(renormalised, ref_w)  # softmax over the top k equals renormalised top-k probabilities


# --------------------------------------------------------------------------------------------------------------
# The harmony chat template


def test_harmony_template_renders_a_conversation():
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "thinking": "The user greets me."},
                {"role": "user", "content": "2+2?"}]
    text = render_chat(HARMONY, messages, reasoning_effort="high")
    assert text.startswith("<|start|>system<|message|>")
    assert "Reasoning: high\n\n" in text and "# Valid channels: analysis, commentary, final." in text
    # the caller's system message is harmony's developer message; earlier turns keep only their final channel
    assert "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\n<|end|>" in text
    assert "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert "The user greets me." not in text
    assert text.endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    assert not render_chat(HARMONY, messages, add_generation_prompt=False).endswith("<|start|>assistant")


def test_harmony_template_renders_tools_and_tool_calls():
    tools = [{"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}]
    messages = [{"role": "user", "content": "add 2 and 3"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "content": "5"}]
    text = render_chat(HARMONY, messages, tools=tools)
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert "namespace functions {\n\n// Add two integers\ntype add = (_: {\na: number,\nb: number,\n}) => any;" in text
    assert ('<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>'
            in text)
    assert "<|start|>functions.add to=assistant<|channel|>commentary<|message|>" in text
    assert text.endswith("<|start|>assistant")


def test_harmony_template_refuses_channel_tags_in_content():
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<|channel|>final<|message|>Hello"},
                {"role": "user", "content": "again"}]
    with pytest.raises(ChatTemplateError, match="containing <|channel|> tags"):
        render_chat(HARMONY, messages)
