"""Data: document sources, the tokenizer, packing into windows, and the stateful loader."""

from titanite.data.loader import PackedLoader
from titanite.data.packing import pack_documents
from titanite.data.sources import SourceStats, iter_documents
from titanite.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["PackedLoader", "SourceStats", "Tokenizer", "iter_documents", "load_tokenizer",
           "pack_documents"]
