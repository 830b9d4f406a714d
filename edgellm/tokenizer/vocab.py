"""The vocabulary as llama.cpp loads it from GGUF metadata (llama_vocab::impl::load in src/llama-vocab.cpp).

Sections: token attributes; special-token ids and flags with llama.cpp's per-model-type defaults; the
end-of-generation set, found by token text as llama.cpp does; special-token partitioning of input text.
"""
import re

import numpy as np

from ..errors import TokenizerError
from edgellm.engine.gguf import LazyStrings, Metadata
from .strings import StringTable, TextIndex

# token attributes: llama.h's llama_token_attr bits
ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL = 0, 1 << 0, 1 << 1, 1 << 2
ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = 1 << 3, 1 << 4, 1 << 5
# GGUF tokenizer.ggml.token_type values 0..6 -> attribute (0 undefined, 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte); anything else is undefined
_TYPE_TO_ATTR = np.array([ATTR_UNDEFINED, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED,
                          ATTR_UNUSED, ATTR_BYTE], dtype=np.int32)

# Token texts llama.cpp takes as EOT when no eot id is given (first present wins here; llama.cpp's
# hash-map order is unspecified), and the texts that always end generation.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_EOG_TEXTS = {  # FIM pad/repo/file-separator tokens are also EOG in llama.cpp
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: made user-defined


def _meta_int(metadata, key):
    value = metadata.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # an array, a string, NaN...: corrupt metadata
        raise TokenizerError(f"{key} must be an integer, got {type(value).__name__} {str(value)[:40]}") from None


def _meta_flag(metadata, key):
    value = metadata.get(key)
    if value is None or isinstance(value, (bool, int, np.bool_, np.integer)):
        return value
    raise TokenizerError(f"{key} must be a boolean, got {type(value).__name__} {str(value)[:40]}")


def _meta_numbers(metadata, key):
    """A 1-D numeric array (scores, token types) or None; anything else is corrupt metadata."""
    value = metadata.get(key)
    if value is None:
        return None
    array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if array is None or array.ndim != 1 or array.dtype.kind not in "biuf":
        raise TokenizerError(f"{key} must be an array of numbers, got {type(value).__name__} {str(value)[:40]}")
    return array


def string_array(metadata, key, name_empty: bool = False):
    """The string array at `key` as a sequence of str, or None when absent. From a GGUF file it is a StringTable over
    the file's map, read without decoding the array, so no str per entry is ever kept (Metadata.lazy: reading
    metadata[key] would turn it into a list for good); from a plain dict, the list or tuple it holds.
    name_empty: read empty entries as "[EMPTY_i]", as llama.cpp renames empty vocabulary texts."""
    value = metadata.lazy(key) if isinstance(metadata, Metadata) else metadata.get(key)
    if value is None:
        return None
    if isinstance(value, LazyStrings):
        return StringTable(value.buffer, value.offsets, LazyStrings.PREFIX, name_empty=name_empty, what=key)
    if not isinstance(value, (list, tuple)):
        raise TokenizerError(f"{key} must be an array of strings, got {type(value).__name__} {str(value)[:40]}")
    bad = next((i for i, t in enumerate(value) if not isinstance(t, str)), None)
    if bad is not None:
        raise TokenizerError(f"{key} must be an array of strings, got {type(value[bad]).__name__} at index {bad}")
    if name_empty and "" in value:
        value = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(value)]
    return value


class Vocab:
    """Token texts, ids, scores and attributes, the special ids and the add-BOS/EOS/space flags.

    tokens (id -> text) and token_to_id (text -> id) read like a list and a dict. For a GGUF file they are a
    StringTable and a TextIndex (edgellm/tokenizer/strings.py): the texts stay in the file's map."""

    def __init__(self, metadata):
        model = metadata.get("tokenizer.ggml.model")
        if not isinstance(model, str) or model not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported tokenizer model {model!r} (supported: 'gpt2' BPE, 'llama' SPM)")
        self.model = model
        self.pre = metadata.get("tokenizer.ggml.pre")
        if self.pre is None:
            self.pre = ""
        elif not isinstance(self.pre, str):
            raise TokenizerError(f"tokenizer.ggml.pre must be a string, got {type(self.pre).__name__}")
        tokens = string_array(metadata, "tokenizer.ggml.tokens", name_empty=True)
        if tokens is None or not len(tokens):
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens (a non-empty array of strings)")
        self.tokens = tokens
        self.n_vocab = n = len(tokens)
        self.token_to_id = TextIndex(tokens, unique=True, what="tokenizer.ggml.tokens")

        scores = _meta_numbers(metadata, "tokenizer.ggml.scores")
        types = _meta_numbers(metadata, "tokenizer.ggml.token_type")
        for key, array in (("scores", scores), ("token_type", types)):
            if array is not None and len(array) < n:
                raise TokenizerError(f"tokenizer.ggml.{key} has {len(array)} entries for {n} tokens")
        self.scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, np.float32)[:n]
        if types is None:
            self.attrs = np.full(n, ATTR_NORMAL, np.int32)
        else:
            types = np.asarray(types, np.int64)[:n]
            known = (types >= 0) & (types < len(_TYPE_TO_ATTR))
            self.attrs = np.full(n, ATTR_UNDEFINED, np.int32)
            self.attrs[known] = _TYPE_TO_ATTR[types[known]]

        self._read_flags_and_ids(metadata)
        self._find_end_of_generation(metadata)
        for text in _ALWAYS_RENDERED:
            if text in self.token_to_id:
                self.attrs[self.token_to_id[text]] = ATTR_USER_DEFINED

    # -- special ids and flags ---------------------------------------------------------------------------------
    def _read_flags_and_ids(self, metadata):
        if self.model == "llama":                  # SPM defaults
            bos, eos, unk = 1, 2, 0
            self.add_bos, self.add_space_prefix = True, True
        else:                                      # BPE defaults; some pre-tokenizers add BOS by default
            from .pretokenize import pre_type_settings
            bos, eos, unk = 11, 11, None
            self.add_bos, self.add_space_prefix = pre_type_settings(self.pre)[2], False
        self.add_eos = False
        ids = {}
        for name, default in (("bos", bos), ("eos", eos), ("unknown", unk), ("eot", None), ("eom", None),
                              ("padding", None)):
            if default is not None and default >= self.n_vocab:
                default = None
            value = _meta_int(metadata, f"tokenizer.ggml.{name}_token_id")
            ids[name] = value if value is not None and 0 <= value < self.n_vocab else default
        self.bos_id, self.eos_id, self.unk_id = ids["bos"], ids["eos"], ids["unknown"]
        self.eot_id, self.eom_id, self.pad_id = ids["eot"], ids["eom"], ids["padding"]
        for attr, key in (("add_bos", "add_bos_token"), ("add_eos", "add_eos_token"),
                          ("add_space_prefix", "add_space_prefix")):
            value = _meta_flag(metadata, f"tokenizer.ggml.{key}")
            if value is not None:
                setattr(self, attr, bool(value))
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but there is no BOS token id")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true but there is no EOS token id")

    def _find_end_of_generation(self, metadata):
        lookup = self.token_to_id.get

        def first_present(texts):
            return next((lookup(t) for t in texts if lookup(t) is not None), None)

        def mark_control(token_id):  # llama.cpp overrides control-looking tokens to control type
            self.attrs[token_id] |= ATTR_CONTROL

        if self.eot_id is None:
            self.eot_id = first_present(_EOT_TEXTS)
            if self.eot_id is not None:
                mark_control(self.eot_id)
        if self.eom_id is None:
            self.eom_id = first_present(_EOM_TEXTS)
            if self.eom_id is not None:
                mark_control(self.eom_id)
        eog = set()
        for kind, texts in _FIM_EOG_TEXTS.items():
            token_id = _meta_int(metadata, f"tokenizer.ggml.fim_{kind}_token_id")
            if token_id is None or not 0 <= token_id < self.n_vocab:
                token_id = first_present(texts)
                if token_id is not None:
                    mark_control(token_id)
            if token_id is not None:
                eog.add(token_id)
        for text in _EOG_TEXTS:
            token_id = lookup(text)
            if token_id is not None:
                eog.add(token_id)
                mark_control(token_id)
        eog.update(t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None)
        texts = {self.tokens[t]: t for t in eog}
        # gpt-oss / solar-open: <|end|> is not an end of generation when <|return|>/<|call|> exist
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            self.attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:  # gemma4: </s> is an ordinary token
            eog.discard(texts["</s>"])
            self.attrs[texts["</s>"]] = ATTR_NORMAL
        self.eog_ids = frozenset(eog)

    # -- special-token partitioning ----------------------------------------------------------------------------
    def special_matcher(self, parse_special: bool) -> "SpecialTokenMatcher":
        key = "_matcher_all" if parse_special else "_matcher_user"
        matcher = getattr(self, key, None)
        if matcher is None:
            mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN if parse_special else ATTR_USER_DEFINED
            # llama.cpp ignores control/unknown tokens when not parsing specials, but user-defined ones always match
            ids = np.nonzero(self.attrs & mask)[0].tolist()
            if not parse_special:
                ids = [i for i in ids if not self.attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]
            matcher = SpecialTokenMatcher([(i, self.tokens[i]) for i in ids])
            setattr(self, key, matcher)
        return matcher


class SpecialTokenMatcher:
    """llama.cpp's tokenizer_st_partition: special tokens, longest (in bytes) first, each splitting every
    remaining text fragment at all its non-overlapping occurrences.

    Done in one pass over the text rather than one per token: a trie-shaped regex finds, at each position, the
    longest special token starting there; the shorter ones starting there are that token's special prefixes. The
    occurrences are then claimed in priority order, each one only if it lies wholly in still-unclaimed text and
    after the last claimed occurrence of the same token, which is exactly what the fragment-by-fragment split did."""

    def __init__(self, specials):
        ordered = sorted(((i, t) for i, t in specials if t), key=lambda it: (-len(it[1].encode("utf-8")), it[0]))
        self._priority = {token_id: rank for rank, (token_id, _) in enumerate(ordered)}
        self._id_of = {}
        for token_id, text in ordered:
            self._id_of.setdefault(text, token_id)  # a duplicate text: the first by priority claims every match
        texts = set(self._id_of)
        # every special that is a proper prefix of another, found by walking the other's prefixes
        self._prefixes = {t: [t[:k] for k in range(len(t) - 1, 0, -1) if t[:k] in texts] for t in texts}
        self._text = {i: t for t, i in self._id_of.items()}
        self._regex = _longest_match_regex(texts) if texts else None

    def split(self, text: str) -> list:
        """Text fragments (str) and special token ids (int), in order."""
        if self._regex is None:
            return [text]
        starts = {}  # token id -> its (possibly overlapping) start positions, ascending
        for m in self._regex.finditer(text):
            longest = m.group(1)
            for t in (longest, *self._prefixes[longest]):
                starts.setdefault(self._id_of[t], []).append(m.start())
        if not starts:
            return [text]
        claimed = bytearray(len(text))
        spans = []
        for token_id in sorted(starts, key=self._priority.__getitem__):
            length = len(self._text[token_id])
            last_end = 0
            for s in starts[token_id]:
                e = s + length
                if s < last_end or claimed.find(1, s, e) != -1:
                    continue
                claimed[s:e] = b"\x01" * length
                last_end = e
                spans.append((s, e, token_id))
        spans.sort()
        out, pos = [], 0
        for s, e, token_id in spans:
            if s > pos:
                out.append(text[pos:s])
            out.append(token_id)
            pos = e
        if pos < len(text):
            out.append(text[pos:])
        return out


def _trie_pattern(texts) -> str:
    """A regex matching the longest of `texts` at a position, shaped as their prefix trie so the regex engine
    follows one branch per character instead of trying every alternative."""
    root = {}
    for t in texts:
        node = root
        for ch in t:
            node = node.setdefault(ch, {})
        node[""] = {}  # end marker

    def pattern(node):
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "(?:" + body + ")?" if "" in node else body  # a token ends here: prefer the longer one

    return pattern(root)


def _longest_match_regex(texts):
    """A zero-width regex whose group 1 is the longest special token starting at each position."""
    try:
        return re.compile("(?=(" + _trie_pattern(texts) + "))", re.DOTALL)
    except (RecursionError, re.error):
        # prefix chains too deep for the trie's nested groups: a flat longest-first alternation, slower per
        # position but the same matches
        flat = "|".join(re.escape(t) for t in sorted(texts, key=lambda t: (-len(t), t)))
        return re.compile("(?=(" + flat + "))", re.DOTALL)
