"""The SentencePiece tokenizer of a checkpoint as a `transformers` tokenizer (lm/export_hf.py).

Encodes exactly as data_prep does (data_prep/tokenizer.py: lines encoded separately, joined by the
newline piece; no EOS appended, `eos_token` is the end-of-document piece) and decodes losslessly.
"""
from __future__ import annotations

from typing import Any

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

from data_prep import tokenizer as sp_codec


class SparseHeadsTokenizer(SentencePieceBackend):
    """`tokenizer.model` of a prepared corpus, wrapped for AutoTokenizer."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs: Any) -> None:
        kwargs.setdefault("eos_token", "</s>")
        kwargs.setdefault("unk_token", "<unk>")
        kwargs.setdefault("add_bos_token", False)
        kwargs.setdefault("add_eos_token", False)
        kwargs.setdefault("split_special_tokens", True)  # a literal "</s>" / "<unk>" in the text is text, as in data_prep
        super().__init__(vocab_file=vocab_file, **kwargs)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self.sp_model.id_to_piece(i) for i in sp_codec.encode_text(self.sp_model, text)]

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        return self.sp_model.decode(ids)
