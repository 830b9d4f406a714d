"""Embeddings on both real models: each token's output-normed hidden state equals llama.cpp's (its AVX2 build,
pooling "none": tests/fixtures/embeddings_llama_cpp.json, tools/record_embeddings_llama_cpp.py) bit for bit, the
mean-pooled vector agrees with llama.cpp's within float rounding, Model.embed / create_embedding take OpenAI's input
shapes and leave the model's cache as it was, and the server's /v1/embeddings answers the official `openai` client
with the Python API's vectors while a stream decodes beside it."""
import base64
import hashlib
import json
import os
import threading

import numpy as np
import pytest

import edgellm
from edgellm.errors import EdgeLLMError, PromptError
from edgellm.generation.embeddings import embed_ids
from exact_host import EXACT_HOST, EXACT_HOST_REASON

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "embeddings_llama_cpp.json")
MEAN_RTOL = 1e-5  # llama.cpp pools with a float32 matrix product, edgellm in float64: the same rows, summed apart


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def model(request, smollm2_path, gemma_path):
    path = smollm2_path if request.param == "smollm2" else gemma_path
    return edgellm.load(path, n_ctx=512, n_threads=2), os.path.basename(path)


def recorded(name):
    with open(FIXTURE) as f:
        return next(m for m in json.load(f)["models"] if m["model"] == name)


@pytest.mark.skipif(not EXACT_HOST, reason=EXACT_HOST_REASON)
def test_every_token_row_is_llama_cpps(model):
    m, name = model
    for p in recorded(name)["prompts"]:
        ids = m.tokenize(p["prompt"])
        assert ids == p["ids"]
        rows = embed_ids(m.model, [ids], "none", normalize=False)[0]
        assert [hashlib.sha256(r.tobytes()).hexdigest() for r in rows] == p["row_sha256"]
        mean = embed_ids(m.model, [ids], "mean", normalize=False)[0]
        np.testing.assert_allclose(mean, np.array(p["mean"], np.float32), rtol=MEAN_RTOL,
                                   atol=MEAN_RTOL * float(np.abs(p["mean"]).max()))


def test_pooling_and_normalising(model):
    m, _ = model
    ids = m.tokenize("A lighthouse keeper trims the lamp at dusk.")
    rows = embed_ids(m.model, [ids], "none", normalize=False)[0]
    assert rows.shape == (len(ids), m.model.config.n_embd) and np.isfinite(rows).all()
    mean = np.array(m.embed(ids, normalize=False))
    np.testing.assert_allclose(mean, rows.astype(np.float64).mean(axis=0), rtol=1e-6, atol=1e-6)
    unit = np.array(m.embed(ids))
    np.testing.assert_allclose(unit, mean / np.linalg.norm(mean), rtol=1e-6, atol=1e-7)
    assert np.array(m.embed(ids, pooling="last", normalize=False)).tolist() == rows[-1].tolist()
    assert np.array(m.embed(ids, pooling="none", normalize=False)).shape == rows.shape
    # a text and its token ids give the same vector; texts that mean alike are nearer than unrelated ones
    text = "The cat sat on the mat."
    assert m.embed(text) == m.embed(m.tokenize(text))
    a, b, c = (np.array(v) for v in m.embed([text, "A cat was sitting on a mat.", "Interest rates rose in May."]))
    assert a @ b > a @ c


def test_embedding_leaves_the_conversation_in_the_cache(model):
    m, _ = model
    prompt = "Once upon a time, in a lighthouse by the sea, there lived a keeper who"

    def turns(embed_between: bool):
        m.reset()
        first = m.complete(prompt, max_tokens=8, temperature=0)
        if embed_between:
            m.embed(["an unrelated text to embed", "and another"])
        second = m.complete(prompt + first.text, max_tokens=4, temperature=0)
        return second.tokens, m.timings.reused_tokens
    plain, with_embedding = turns(False), turns(True)
    assert with_embedding == plain and plain[1] >= len(m.tokenize(prompt)) // 2


def test_create_embedding_shape_and_bad_inputs(model):
    m, _ = model
    r = m.create_embedding(["hello", "world"], model="mine")
    assert r["object"] == "list" and r["model"] == "mine" and [d["index"] for d in r["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == m.model.config.n_embd for d in r["data"])
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] == sum(len(m.tokenize(t)) for t in
                                                                            ("hello", "world"))
    for bad in ("", [], [""], [[]], [1.5], {"text": "x"}, list(range(600)), [m.n_vocab], [[3, -1]]):
        with pytest.raises(PromptError):
            m.embed(bad)
    with pytest.raises(EdgeLLMError, match="pooling"):
        m.embed("x", pooling="max")


def test_server_embeddings_beside_a_stream(smollm2_path):
    openai = pytest.importorskip("openai")
    from edgellm.server import BackgroundServer, create_app

    m = edgellm.load(smollm2_path, n_ctx=512, n_threads=2)
    texts = ["The cat sat on the mat.", "Interest rates rose in May."]
    want = m.embed(texts)
    alone = m.complete("Once upon a time", max_tokens=48, temperature=0).text
    with BackgroundServer(create_app(m, model_name="smollm2")) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        streamed = []

        def stream():
            for ch in c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=48,
                                           temperature=0, stream=True):
                streamed.append(ch.choices[0].text if ch.choices else "")
        t = threading.Thread(target=stream)
        t.start()
        got = [c.embeddings.create(model="smollm2", input=texts, encoding_format="float") for _ in range(3)]
        t.join(timeout=120)
        assert "".join(streamed) == alone  # the embeddings' forward passes left the stream's bits alone
        for r in got:
            assert [d.embedding for d in r.data] == want and r.usage.prompt_tokens == sum(
                len(m.tokenize(x)) for x in texts)
        r = c.embeddings.create(model="smollm2", input=texts[0], encoding_format="base64")
        vec = np.frombuffer(base64.b64decode(r.data[0].embedding), dtype="<f4")
        assert vec.tolist() == want[0]
        r = c.embeddings.create(model="smollm2", input=[m.tokenize(texts[1])])  # the client's default: base64
        assert np.asarray(r.data[0].embedding, np.float32).tolist() == want[1]
        for kwargs, param in (({"input": "x", "dimensions": 7}, "dimensions"),
                              ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                              ({"input": [""]}, "input"), ({"input": ["x"] * 2049}, "input")):
            with pytest.raises(openai.BadRequestError) as info:
                c.embeddings.create(model="smollm2", **kwargs)
            assert info.value.body["param"] == param


@pytest.mark.parametrize("arch", ["gemma2", "granite", "olmo2", "smollm3", "qwen3moe_8x2", "gptoss_8x4"])
def test_every_architecture_embeds_what_its_logits_read(tmp_path, smollm2_path, arch):
    """The other architectures' heads (softcaps, logit scales, experts): each row's embedding, through the output
    matrix (dequantized, float32), ranks the vocabulary as the model's own logits do (its head's caps and scales
    keep the order): the rows are the states the logits are computed from."""
    from helpers_tiny_archs import TINY_ARCHS, prompt_tokens, write_tiny_arch

    path = str(tmp_path / f"{arch}.gguf")
    write_tiny_arch(path, TINY_ARCHS[arch], smollm2_path)
    m = edgellm.load(path, n_ctx=128, n_threads=2)
    ids = prompt_tokens(TINY_ARCHS[arch], 24).tolist()
    rows = embed_ids(m.model, [ids], "none", normalize=False)[0]
    logits = m.logits(ids)
    product = rows @ m.model.output.dequantize().T
    assert (product.argmax(axis=1) == logits.argmax(axis=1)).mean() >= 0.9
