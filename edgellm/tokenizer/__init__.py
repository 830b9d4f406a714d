"""Tokenizers exact with llama.cpp: byte-level BPE (`gpt2`) and SentencePiece-style BPE (`llama`) from GGUF metadata."""
from .tokenizer import Tokenizer

__all__ = ["Tokenizer"]
