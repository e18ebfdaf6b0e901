"""Where a checkpoint keeps its text model: a text-only causal LM (`model.*`, `lm_head.*`) or a
multimodal one, as the published Qwen3.5 checkpoints are (`Qwen3_5ForConditionalGeneration`):
the text model under `model.language_model.*` beside a vision tower (`model.visual.*`) and
multi-token-prediction weights (`mtp.*`).

Both backends name the text model's tensors in the text-only layout. A reader of a multimodal
folder shows them under those names; the other tensors are carried through, untouched, into an
export of the same layout, so the export loads as the source's class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TEXT_PREFIX = "model."
MULTIMODAL_TEXT_PREFIX = "model.language_model."
HEAD_PREFIX = "lm_head."


@dataclass(frozen=True)
class Layout:
    """The prefix under which the text model's `model.*` tensors are stored on disk."""

    text_prefix: str = TEXT_PREFIX

    @property
    def multimodal(self) -> bool:
        return self.text_prefix != TEXT_PREFIX

    def to_disk(self, key: str) -> str:
        """A text-model key (`model.layers.0...`, `lm_head.weight`) -> its key on disk."""
        if key.startswith(TEXT_PREFIX):
            return self.text_prefix + key[len(TEXT_PREFIX):]
        return key

    def from_disk(self, key: str) -> str | None:
        """A key on disk -> the text model's name for it, or None for a tensor outside the
        text model (a vision tower, MTP heads), which text training does not touch."""
        if key.startswith(self.text_prefix):
            return TEXT_PREFIX + key[len(self.text_prefix):]
        if key.startswith(HEAD_PREFIX):
            return key
        return None if self.multimodal else key


def layout_of(keys: Iterable[str]) -> Layout:
    """The layout a folder's tensor keys show: multimodal when any lies under
    `model.language_model.`."""
    if any(k.startswith(MULTIMODAL_TEXT_PREFIX) for k in keys):
        return Layout(MULTIMODAL_TEXT_PREFIX)
    return Layout()
