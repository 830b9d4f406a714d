"""Constrained decoding with both real models: JSON Schemas (tests/fixtures/json_schemas, validated with
jsonschema), llama.cpp's sample GBNF grammars (tests/fixtures/gbnf, checked with llguidance's matcher), regex and
choice; how the mask composes with stream, stop, logprobs, logit_bias, generate_batch and prefix reuse; and the
errors a bad schema or grammar gives before any token."""
import json
import re
import threading

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")

import edgellm  # noqa: E402
from edgellm.generation import constrain  # noqa: E402
from edgellm.generation.constrain import (JSON_BOUNDS, ConstraintSpec, LlamaGrammar,  # noqa: E402
                                          SequenceConstraint, accepts, allowed_ids, apply_bitmask, best_allowed,
                                          best_allowed_ref, bounded_schema, llg_tokenizer, masked_scores,
                                          text_accepted)
from edgellm.errors import GrammarError  # noqa: E402
from conftest import FIXTURES, GEMMA, SMOLLM2  # noqa: E402

SCHEMAS = json.loads((FIXTURES / "json_schemas" / "schemas.json").read_text())["schemas"]
# Less than the longest reply some schemas allow when a model fills every field to its maxLength digit by digit
# (Gemma spells numbers a digit a token): those replies end complete on the closing path
SCHEMA_MAX_TOKENS = 160


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=512)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return edgellm.load(gemma_path, n_ctx=512)


def _prompt(m, subject):
    return m.chat_prompt_ids([{"role": "user", "content": f"Give me {subject} as JSON."}])


def _check_schema_outputs(m, schemas):
    failures = []
    for entry in schemas:
        done = m.complete(_prompt(m, entry["subject"]), SCHEMA_MAX_TOKENS, json_schema=entry["schema"])
        try:
            value = json.loads(done.text)
            jsonschema.validate(value, entry["schema"], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            failures.append((entry["name"], done.finish_reason, done.text[:200], str(e)[:200]))
            continue
        assert done.finish_reason == "stop" and done.stop_reason == "constraint", entry["name"]
    assert not failures, failures


def test_fixture_set_is_large_and_varied():
    assert len(SCHEMAS) >= 50
    text = json.dumps([e["schema"] for e in SCHEMAS])
    for feature in ('"$ref"', '"anyOf"', '"oneOf"', '"allOf"', '"enum"', '"pattern"', '"maxItems"', '"minItems"',
                    '"format": "email"', '"format": "date-time"', '"format": "uuid"', '"format": "ipv4"',
                    '"prefixItems"', '"const"', '"$defs"'):
        assert feature in text, feature
    for entry in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(entry["schema"])


def test_every_schema_output_validates_smollm2(smol):
    _check_schema_outputs(smol, SCHEMAS)


def test_every_schema_output_validates_gemma(gemma):
    _check_schema_outputs(gemma, SCHEMAS)


# -- GBNF ------------------------------------------------------------------------------------------------------

GBNF_PROMPTS = {  # few-shot where the models need it to finish a sentence within the token budget
    "json": 'cat: {"name": "Tom", "age": 3}\ndog: {"name": "Rex", "age": 5}\nbird:',
    "arithmetic": "Equations:\n1 + 2 = 3\n4 * 5 = 20\n",
    "list": "A shopping list:\n",
    "chess": "A chess game in PGN:\n",
}


def _arithmetic_regex(depth=3):
    ws = r"[ \t\n]*"
    term = rf"(?:[a-z][a-z0-9_]*{ws}|[0-9]+{ws})"
    for _ in range(depth):  # parentheses nested up to depth levels
        expr = rf"{term}(?:[-+*/]{term})*"
        term = rf"(?:[a-z][a-z0-9_]*{ws}|[0-9]+{ws}|\({ws}{expr}\){ws})"
    expr = rf"{term}(?:[-+*/]{term})*"
    return rf"(?:{expr}={ws}{term}\n)+"


_CHESS_MOVE = r"(?:(?:[a-h]x)?[a-h][1-8](?:=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(?:-O)?)[+#]?"
# The sample grammars' languages written as Python regexes, with GBNF's semantics (llama.cpp matches character
# by character): an independent check of what llguidance enforced
GBNF_LANGUAGES = {
    "arithmetic": _arithmetic_regex(),
    "list": r"(?:- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+",
    "chess": rf"1\. {_CHESS_MOVE} {_CHESS_MOVE}\n(?:[1-9][0-9]?\. {_CHESS_MOVE} {_CHESS_MOVE}\n)+",
}


@pytest.mark.parametrize("name", sorted(GBNF_PROMPTS))
@pytest.mark.parametrize("which", [SMOLLM2, GEMMA])
def test_llama_cpp_sample_grammars(name, which, request):
    m = request.getfixturevalue("smol" if which == SMOLLM2 else "gemma")
    source = (FIXTURES / "gbnf" / f"{name}.gbnf").read_text()
    spec = ConstraintSpec.gbnf(source)
    done = m.complete(GBNF_PROMPTS[name], 48, grammar=LlamaGrammar.from_string(source))
    assert done.tokens
    # every generated token is accepted by a fresh matcher of the same grammar
    import llguidance
    matcher = llguidance.LLMatcher(llg_tokenizer(m.tokenizer), spec.grammar, log_level=0)
    assert matcher.consume_tokens(done.tokens), matcher.get_error()
    if name == "json":  # root ::= object completes: the reply ends there, and is JSON
        assert done.stop_reason == "constraint" and accepts(spec, m.tokenizer, done.tokens)
        assert isinstance(json.loads(done.text), dict)
        return
    # the repeated grammars (item+, lines+) run to max_tokens: the reply up to its last whole line is a sentence
    language = re.compile(GBNF_LANGUAGES[name])
    lines = done.text[:done.text.rindex("\n") + 1]
    assert language.fullmatch(lines), lines
    assert not language.fullmatch(lines + "?")  # the check can fail


# -- regex, choice and composition with the rest of the decode loop ---------------------------------------------

def test_regex_and_choice(smol, gemma):
    for m in (smol, gemma):
        done = m.complete("My phone number is", 20, regex=r"\(\d{3}\) \d{3}-\d{4}")
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", done.text) and done.finish_reason == "stop"
        done = m.complete(_prompt(m, "the answer to 'is the sky blue?' (yes or no)"), 10, choice=["yes", "no"])
        assert done.text in ("yes", "no") and done.stop_reason == "constraint"


def test_mask_comes_before_the_samplers_and_logit_bias(smol):
    prompt = _prompt(smol, "yes or no")
    first = smol.complete(prompt, 5, choice=["yes", "no"]).text
    other = "no" if first == "yes" else "yes"
    # every token that could start the first answer ("y", "ye", "yes" ...), so only the other one is left
    banned = {t: -100.0 for t in range(smol.n_vocab)
              if (b := smol.tokenizer.token_to_bytes(t)) and first.encode().startswith(b)}
    assert smol.complete(prompt, 5, choice=["yes", "no"], logit_bias=banned).text == other
    # sampling with every filter on still only draws allowed tokens
    for seed in range(5):
        text = smol.complete(prompt, 5, choice=["yes", "no", "maybe"], temperature=1.5, top_k=5, top_p=0.9,
                             min_p=0.01, repeat_penalty=1.3, seed=seed).text
        assert text in ("yes", "no", "maybe")


def test_composes_with_stream_stop_logprobs_batch_and_prefix_reuse(smol):
    schema = SCHEMAS[0]["schema"]
    prompt = _prompt(smol, SCHEMAS[0]["subject"])
    done = smol.complete(prompt, 80, json_schema=schema, logprobs=2)
    jsonschema.validate(json.loads(done.text), schema)
    assert len(done.token_info) == len(done.tokens) and all(i.logprob is not None for i in done.token_info)
    assert "".join(smol.stream(prompt, 80, json_schema=schema)) == done.text
    again = smol.complete(prompt, 80, json_schema=schema)  # the cache holds this prompt: reused, same answer
    assert again.text == done.text
    # a stop string still ends the reply first
    cut = smol.complete(prompt, 80, json_schema=schema, stop=['"id"'])
    assert cut.stop_reason == "stop_string" and cut.text == done.text[:done.text.index('"id"')]
    # a batch: each sequence its own matcher, each the tokens it gives alone
    other = _prompt(smol, SCHEMAS[1]["subject"])
    alone = smol.complete(other, 80, json_schema=schema).text
    assert smol.generate_batch([prompt, other], 80, json_schema=schema) == [done.text, alone]


def test_json_object_modes(smol):
    msgs = [{"role": "user", "content": "Give me a JSON object describing a dog."}]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "legs": {"type": "integer"}}, "required": ["name", "legs"]}
    closed = {**schema, "additionalProperties": False}
    for fmt in ({"type": "json_object", "schema": closed},
                {"type": "json_schema", "json_schema": {"name": "dog", "schema": schema, "strict": True}}):
        r = smol.create_chat_completion(msgs, response_format=fmt, max_tokens=60, temperature=0)
        value = json.loads(r["choices"][0]["message"]["content"])
        jsonschema.validate(value, schema)
        assert r["choices"][0]["finish_reason"] == "stop"
        assert set(value) <= {"name", "legs"}  # strict closes the object as additionalProperties false does
    r = smol.create_chat_completion(msgs, response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    text = r["choices"][0]["message"]["content"]
    assert text.startswith("{") and (r["choices"][0]["finish_reason"] == "length" or isinstance(json.loads(text), dict))


def test_tokenizers_byte_for_byte(smol, gemma):
    """The llguidance tokenizer spells every ordinary token as edgellm does, byte tokens included."""
    for m in (smol, gemma):
        lltok = llg_tokenizer(m.tokenizer)
        assert lltok.vocab_size == m.n_vocab
        ids = np.random.default_rng(0).choice(m.n_vocab, 2000, replace=False)
        for i in ids.tolist():
            if not lltok.is_special_token(i):
                assert lltok.decode_bytes([i]) == m.tokenizer.token_to_bytes(i), i
    # (<0xFF> is the one exception: a byte never in UTF-8, which llguidance reads as its special-token marker)
    byte_tokens = [gemma.tokenizer.vocab.token_to_id[f"<0x{b:02X}>"] for b in (0x0A, 0xE2, 0x80)]
    assert [llg_tokenizer(gemma.tokenizer).decode_bytes([t]) for t in byte_tokens] == [b"\n", b"\xe2", b"\x80"]


def _looping_reply(m, schema, budget, closing=True):
    """Decode under the schema with scores that favour '1', then 'a', then '}' everywhere: a model stuck
    repeating itself, the way small models fill strings and numbers."""
    sc = SequenceConstraint(ConstraintSpec.json_schema(schema), m.tokenizer, m.n_vocab)
    scores = np.zeros(m.n_vocab, dtype=np.float32)
    scores[[m.tokenize(t)[0] for t in ("1", "a", "}")]] = [5, 4, 3]
    out = []
    for i in range(budget):
        left = budget - i if closing else None
        token = int(np.argmax(sc.mask(scores, left)))
        token = sc.vet(token, budget - i) if closing else token
        if m.tokenizer.is_eog(token):
            break
        out.append(token)
        sc.advance(token)
        if sc.complete:
            break
    return m.detokenize(out), sc


def test_closing_path_completes_json_within_max_tokens(smol):
    by_name = {e["name"]: e["schema"] for e in SCHEMAS}
    rescued = 0
    for name in ("github_commit", "recursive_tree", "docker_compose_service", "recipe", "cron_job"):
        schema = by_name[name]
        text, sc = _looping_reply(smol, schema, 100)
        jsonschema.validate(json.loads(text), schema)
        cut, _ = _looping_reply(smol, schema, 100, closing=False)
        try:
            json.loads(cut)
        except json.JSONDecodeError:  # without the closing path the reply is cut mid-value; with it, whole
            assert sc.closing, name
            rescued += 1
    assert rescued >= 3
    # a budget below the shortest completion: the model keeps its own choices (nothing is forced in vain)
    text, sc = _looping_reply(smol, by_name["github_commit"], 20)
    assert not sc.closing


def test_next_mask_is_computed_on_the_mask_thread_with_the_same_tokens(smol, monkeypatch):
    """advance() starts the next mask on the mask thread (it overlaps the forward pass); the reply is token for
    token the one computed inline, closing path included."""
    schema = {e["name"]: e["schema"] for e in SCHEMAS}["recipe"]
    threads = []
    compute = constrain._compute_into

    def recording(matcher, words):
        threads.append(threading.current_thread().name)
        compute(matcher, words)

    monkeypatch.setattr(constrain, "_compute_into", recording)
    monkeypatch.setattr(constrain, "_MASK_THREAD", False)
    inline, _ = _looping_reply(smol, schema, 60)
    assert threads == []
    monkeypatch.setattr(constrain, "_MASK_THREAD", True)
    threaded, sc = _looping_reply(smol, schema, 60)
    assert threaded == inline and sc.closing
    assert len(threads) >= 10 and all(name.startswith("edgellm-mask") for name in threads)


def test_mask_kernels_match_the_plain_reference():
    """apply_bitmask and best_allowed (both of its forms: a few allowed words, most words) against a per-token
    reading of the bitmask and their numpy references."""
    rng = np.random.default_rng(0)
    for n_vocab, density in ((262_144, 0.001), (262_144, 0.9), (49_152, 0.02), (49_152, 1.0), (100, 0.5)):
        words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        allowed = np.flatnonzero(rng.random(n_vocab) < density)
        np.bitwise_or.at(words.view(np.uint32), allowed // 32, (np.uint32(1) << (allowed % 32).astype(np.uint32)))
        scores = rng.standard_normal(n_vocab).astype(np.float32)
        reference = np.full(n_vocab, -np.inf, dtype=np.float32)
        reference[allowed] = scores[allowed]
        np.testing.assert_array_equal(allowed_ids(words, n_vocab), allowed)
        np.testing.assert_array_equal(masked_scores(words, scores), reference)
        out = np.full(n_vocab, 7.0, dtype=np.float32)
        assert apply_bitmask(words, scores, out) == allowed.size
        np.testing.assert_array_equal(out, reference)
        priority = rng.integers(0, 4, n_vocab).astype(np.float64)  # many ties: the lowest id must win
        order = np.argsort(-priority, kind="stable").astype(np.int32)
        best = best_allowed(words, priority, order)
        assert best == best_allowed_ref(words, priority) == allowed[np.argmax(priority[allowed])]
    empty = np.zeros(4, dtype=np.int32)
    assert masked_scores(empty, np.zeros(100, dtype=np.float32)) is None
    assert apply_bitmask(empty, np.zeros(100, dtype=np.float32), np.zeros(100, dtype=np.float32)) == 0
    assert best_allowed(empty, np.zeros(100), np.arange(100, dtype=np.int32)) == -1


def test_default_bounds_apply_only_where_the_schema_is_silent(smol):
    tok = smol.tokenizer
    spec = ConstraintSpec.json_schema({"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "x": {"type": "number"},
        "a": {"type": "array", "items": {"type": "integer", "maximum": 3}}}, "required": ["s", "i", "x", "a"]})
    ok = '{"s": "%s", "i": %s, "x": %s, "a": [%s]}'
    assert text_accepted(spec, tok, ok % ("a" * 128, "9" * 15, "-1.123456", ", ".join(["1"] * 32)))
    for bad in (("a" * 129, "1", "1", "1"), ("a", "1" + "0" * 15, "1", "1"), ("a", "1", "1.1234567", "1"),
                ("a", "1", "1e5", "1"), ("a", "1", "1", ", ".join(["1"] * 33))):
        assert not text_accepted(spec, tok, ok % bad), bad
    # the schema's own limits win, and a bound that conflicts with the schema is dropped
    own = ConstraintSpec.json_schema({"type": "string", "maxLength": 1000})
    assert text_accepted(own, tok, '"%s"' % ("a" * 1000))
    tiny = ConstraintSpec.json_schema({"type": "number", "minimum": 1e-9, "maximum": 2e-9})
    assert text_accepted(tiny, tok, "0.0000000015")
    saved = dict(JSON_BOUNDS)
    try:  # lifted for every schema
        JSON_BOUNDS["max_string_length"] = None
        assert text_accepted(ConstraintSpec.json_schema({"type": "string"}), tok, '"%s"' % ("a" * 500))
    finally:
        JSON_BOUNDS.update(saved)
    # enum, const and what sits under "not" are left as they are
    assert bounded_schema({"enum": ["x" * 300]}) == {"enum": ["x" * 300]}
    assert bounded_schema({"not": {"type": "string"}}) == {"not": {"type": "string"}}


# -- errors before any token ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"json_schema": {"type": "strin"}}, "json_schema cannot be enforced.*strin"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format type 'xml'"),
    ({"grammar": "root ::= missing"}, "grammar is not a valid GBNF grammar.*missing"),
    ({"grammar": 42}, "grammar must be"),
    ({"regex": "(unclosed"}, "regex cannot be enforced"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "at most one of"),
])
def test_invalid_constraints_raise_before_generating(smol, kwargs, match):
    before = smol.last_completion
    with pytest.raises(GrammarError, match=match):
        smol.complete("hello", 5, **kwargs)
    with pytest.raises(GrammarError, match=match):
        smol.create_completion("hello", max_tokens=5, **kwargs)
    assert smol.last_completion is before
