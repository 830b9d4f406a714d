"""The tokenizers of the two real models against llama.cpp's own output (tests/fixtures/<model>.json, recorded with
llama-cpp-python 0.3.36): SmolLM2 is byte-level BPE (pre=smollm), Gemma 3 is SentencePiece-style with 262,144
tokens, byte fallback and user-defined whitespace/HTML tokens."""
import codecs

import pytest

from conftest import GEMMA, SMOLLM2, load_reference
from edgellm.engine import gguf
from edgellm.errors import TokenizerError
from edgellm.tokenizer import Tokenizer

STREAM_TEXTS = ["多线程推理加速", "emoji 🙂 and symbols ©®™", "naïve café 🙂🙂 多"]


def _build(path):
    with gguf.open(path) as f:
        return Tokenizer.from_metadata(f.metadata)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return _build(smollm2_path)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return _build(gemma_path)


@pytest.fixture(params=[SMOLLM2, GEMMA])
def model(request, smollm2, gemma):
    """(tokenizer, llama.cpp reference json) for each real model."""
    tok = smollm2 if request.param == SMOLLM2 else gemma
    return tok, load_reference(request.param)[0]


@pytest.mark.parametrize("parse_special", [False, True])
def test_tokenize_matches_llama_cpp(model, parse_special):
    tok, ref = model
    key = "ids_parse_special_true" if parse_special else "ids_parse_special_false"
    for case in ref["tokenize"]:
        assert tok.encode(case["text"], add_special=True, parse_special=parse_special) == case[key], case["text"]


def test_greedy_prompts_match_llama_cpp(model):
    tok, ref = model
    for case in ref["greedy"]:
        assert tok.encode(case["prompt"], add_special=True, parse_special=True) == case["prompt_ids"], case["prompt"]


def test_decode_of_generated_ids_matches_llama_cpp_text(model):
    tok, ref = model
    for case in ref["greedy"]:
        assert tok.decode(case["greedy_ids"]) == case["greedy_text"]


def test_round_trip(model):
    tok, ref = model
    for case in ref["tokenize"]:
        text = case["text"]
        assert tok.decode(tok.encode(text)) == text
        # control tokens vanish from decode by default and come back with special=True
        ids = tok.encode(text, add_special=False, parse_special=True)
        assert tok.decode(ids, special=True) == text


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_byte_assembly(model, text):
    tok, _ = model
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")   # strict: any bad byte order would raise
    streamed = "".join(decoder.decode(tok.token_to_bytes(i)) for i in tok.encode(text, add_special=False))
    assert streamed + decoder.decode(b"", final=True) == text


def test_bpe_splits_characters_across_tokens(smollm2):
    # the streaming test above only proves something if some token carries part of a character
    pieces = [smollm2.token_to_bytes(i) for i in smollm2.encode("多线程推理加速")]
    assert any(_invalid_utf8(p) for p in pieces)
    assert b"".join(pieces).decode("utf-8") == "多线程推理加速"


def _invalid_utf8(data):
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_gemma_byte_fallback_for_characters_outside_the_vocabulary(gemma):
    rare = "\U0001D1E8"   # a musical symbol with no piece in Gemma's vocabulary
    ids = gemma.encode(rare, add_special=False)
    assert [gemma.token_text(i) for i in ids] == [f"<0x{b:02X}>" for b in rare.encode("utf-8")]
    assert gemma.decode(ids) == rare


def test_special_ids_and_end_of_generation(smollm2, gemma):
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.add_bos, smollm2.n_vocab) == (1, 2, False, 49152)
    # EOG as llama.cpp decides: <|endoftext|>, <|im_end|> (= EOS) and the FIM repo token <reponame>
    assert smollm2.eog_ids == {0, 2, 4}
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos, gemma.n_vocab) == (2, 1, True, 262144)
    assert gemma.is_eog(1) and gemma.is_eog(gemma.encode("<end_of_turn>", add_special=False, parse_special=True)[0])
    assert gemma.eot_id == 106 and not gemma.is_eog(2) and not gemma.is_eog(107)


def test_control_tokens_render_empty_unless_special(smollm2, gemma):
    assert smollm2.token_to_bytes(2) == b"" and smollm2.token_to_bytes(2, special=True) == b"<|im_end|>"
    assert gemma.decode([2, 9259, 1902, 106]) == "Hello world"
    assert gemma.decode([2, 9259, 1902, 106], special=True) == "<bos>Hello world<end_of_turn>"
    assert gemma.token_to_bytes(107) == b"\n"       # user-defined tokens always render


def test_out_of_range_ids_raise(smollm2):
    with pytest.raises(TokenizerError):
        smollm2.decode([smollm2.n_vocab])
    with pytest.raises(TokenizerError):
        smollm2.token_to_bytes(-1)


def test_spm_word_cuts_do_not_change_the_merges(gemma):
    # SPMModel cuts text at "c▁" junctions no vocabulary token spans; merging the whole fragment at once must agree
    ref = load_reference(GEMMA)[0]
    texts = [case["text"] for case in ref["tokenize"]] + [
        "x > </div> and >▁</ mixed  spacing,\tpunctuation... 'quotes' \"double\" 12,345.67 naïve 多线程 🙂"]
    for text in texts:
        fragment = text.replace(" ", "\u2581")
        assert gemma._model.encode(fragment) == gemma._model._encode_word(fragment), text
