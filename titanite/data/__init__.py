"""Data: document sources, the tokenizer, the token store, packing into windows, and the stateful loader."""

from titanite.data.loader import PackedLoader
from titanite.data.packing import pack
from titanite.data.sources import SourceStats, iter_documents
from titanite.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["PackedLoader", "SourceStats", "Tokenizer", "iter_documents", "load_tokenizer",
           "pack"]
