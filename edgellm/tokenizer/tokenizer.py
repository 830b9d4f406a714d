"""`Tokenizer`: text <-> token ids, matching llama.cpp's llama_tokenize and llama_token_to_piece.

Encoding: special tokens are split out first (user-defined ones always, control ones with parse_special), then each
text fragment goes through the model (BPE or SPM) and BOS/EOS are added as the vocabulary says.
Decoding: each token's bytes (token_to_bytes) are joined and the whole is decoded as UTF-8 once, so characters split
across tokens come out whole.
"""
import re

from ..errors import TokenizerError
from .bpe import BPEModel
from .spm import SPACE, SPMModel
from .unicode_classes import UNICODE_TO_BYTE
from .vocab import ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Vocab, string_array

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    def __init__(self, vocab: Vocab, model):
        self.vocab = vocab
        self._model = model
        self._is_spm = vocab.model == "llama"
        self._pieces = {}        # token id -> bytes with special=False, filled on first use

    @classmethod
    def from_metadata(cls, metadata) -> "Tokenizer":
        """Build from GGUF metadata (dict-like: `tokenizer.ggml.*` keys)."""
        vocab = Vocab(metadata)
        if vocab.model == "gpt2":
            merges = string_array(metadata, "tokenizer.ggml.merges")
            if merges is None:
                raise TokenizerError("BPE tokenizer without tokenizer.ggml.merges")
            return cls(vocab, BPEModel(vocab, merges))
        return cls(vocab, SPMModel(vocab))

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self):
        return self.vocab.bos_id

    @property
    def eos_id(self):
        return self.vocab.eos_id

    @property
    def eot_id(self):
        return self.vocab.eot_id

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def eog_ids(self) -> frozenset:
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        """End of generation: EOS, EOT and the tokens llama.cpp recognises by text (<|im_end|>, <end_of_turn>...)."""
        return token_id in self.vocab.eog_ids

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF file (e.g. 'Ġworld', '▁world', '<0x0A>')."""
        self._check_id(token_id)
        return self.vocab.tokens[token_id]

    # -- encode ------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if not text.isascii():
            surrogate = _LONE_SURROGATE.search(text)
            if surrogate:    # e.g. undecodable bytes carried through surrogateescape: not text, not UTF-8-encodable
                raise TokenizerError(f"text has a lone surrogate {surrogate.group()!r} at index {surrogate.start()}; "
                                     "it is not valid Unicode (decode bytes with errors='replace' first)")
        vocab = self.vocab
        out = [vocab.bos_id] if add_special and vocab.add_bos else []
        fragments = vocab.special_matcher(parse_special).split(text) if text else []
        prev_special = True      # SPM: a space prefix goes before the first fragment and after each special token
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self._is_spm:
                if vocab.add_space_prefix and prev_special:
                    frag = " " + frag
                out += self._model.encode(frag.replace(" ", SPACE))
                prev_special = False
            else:
                out += self._model.encode(frag)
        if add_special and vocab.add_eos:
            out.append(vocab.eos_id)
        return out

    # -- decode ------------------------------------------------------------------------------------------------
    def _check_id(self, token_id):
        if not 0 <= token_id < self.vocab.n_vocab:
            raise TokenizerError(f"token id {token_id} is out of range [0, {self.vocab.n_vocab})")

    def token_to_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes a token stands for (llama_token_to_piece). Control tokens give b'' unless special=True;
        a byte token <0xNN> gives that one byte, which may be part of a multi-byte character."""
        piece = self._pieces.get(token_id)
        if piece is not None and not special:
            return piece
        self._check_id(token_id)
        attr = int(self.vocab.attrs[token_id])
        text = self.vocab.tokens[token_id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            piece = text.encode("utf-8") if special else b""
        elif attr & ATTR_USER_DEFINED:
            piece = text.encode("utf-8")
        elif attr & ATTR_NORMAL:
            piece = text.replace(SPACE, " ").encode("utf-8") if self._is_spm else _gpt2_text_to_bytes(text)
        elif attr & ATTR_BYTE:
            piece = _byte_token_value(token_id, text)
        else:                    # unused / undefined tokens render as nothing, as in llama.cpp
            piece = b""
        if not special or not attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            self._pieces[token_id] = piece
        return piece

    def decode(self, ids, special: bool = False) -> str:
        """Text of a token sequence; control tokens (BOS, EOS, <end_of_turn>...) are omitted unless special=True.
        For vocabularies that add a space prefix (Llama-2 style SPM), the leading space encode() put before the
        text is removed again, as llama-cpp-python's detokenize does after BOS. Vocabularies without a space
        prefix (SmolLM2, Gemma 3) keep every byte, so decode(encode(s)) == s."""
        data = b"".join([self.token_to_bytes(int(i), special) for i in ids])
        if self.vocab.add_space_prefix and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def __repr__(self):
        kind = "SPM" if self._is_spm else f"BPE(pre={self.vocab.pre!r})"
        return f"Tokenizer({kind}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


def _byte_token_value(token_id: int, text: str) -> bytes:
    # a byte token reads <0xNN>; anything else there means corrupt metadata, refused rather than mis-decoded
    try:
        value = int(text[3:5], 16)
        if 0 <= value < 256:
            return bytes([value])
    except ValueError:
        pass
    raise TokenizerError(f"token {token_id} is typed as a byte token but its text {text!r} is not <0xNN>")


def _gpt2_text_to_bytes(text: str) -> bytes:
    # llama_decode_text: each char maps back to one byte; a char outside the map is spelled out, as llama.cpp does
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + b"]"
    return bytes(out)
