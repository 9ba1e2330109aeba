"""SentencePiece BPE tokenizer (MoSA App. H: SentencePiece sub-word units, vocabulary 8000).

Lossless by construction, so decode(encode(text)) == text and bits-per-byte figures are honest:
identity normalisation (no NFKC, whitespace kept as is), no dummy prefix, byte fallback for
characters outside the learned vocabulary. Ids: 0 <unk> (never produced, thanks to byte fallback),
1 </s> = end of document, 2 "\\n" (a user-defined piece; lines are encoded separately and joined with
it), 3..258 the 256 byte pieces, then the learned merges. A literal U+2581 "▁" (SentencePiece's own space
symbol, which it would encode as a space) is written as its three UTF-8 byte pieces.
"""
from __future__ import annotations

import io
import re
from typing import Sequence

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from data_prep.errors import DataError

MODEL_TYPE = "bpe"
UNK_ID, EOS_ID, NEWLINE_ID = 0, 1, 2
MAX_VOCAB = 2**16  # ids must fit in uint16 shards
MIN_VOCAB = 3 + 256  # the special pieces and the byte pieces (a corpus needs its characters on top)
MAX_SENTENCE_BYTES = 1 << 15
META = "\u2581"  # SentencePiece's space symbol: encoded as is, a literal one would decode as " "
META_BYTE_IDS = [3 + byte for byte in META.encode("utf-8")]  # its byte pieces <0xE2> <0x96> <0x81>
SAVED_THREADS = 1  # trainer_spec.num_threads in every saved model, so its bytes do not depend on --threads


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(f"--vocab-size must be in {MIN_VOCAB}..{MAX_VOCAB} (3 special and 256 byte pieces at least; "
                        f"tokens are stored as uint16), got {vocab_size}")


def train(lines: Sequence[str], vocab_size: int, threads: int) -> bytes:
    """Train on `lines` and return the serialized model (the same bytes for any `threads`);
    an empty sample and vocabulary problems become one DataError line."""
    check_vocab_size(vocab_size)
    chars = sum(map(len, lines))
    if not lines:
        raise DataError("the tokenizer sample is empty (no training line fits in --sample-chars); "
                        "raise --sample-chars or lower --val-fraction")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=MODEL_TYPE,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
            unk_id=UNK_ID, eos_id=EOS_ID, bos_id=-1, pad_id=-1, user_defined_symbols=["\n"],
            max_sentence_length=MAX_SENTENCE_BYTES, num_threads=threads, minloglevel=2,
        )
    except RuntimeError as err:
        raise _vocab_error(str(err), vocab_size, chars) from None
    return _without_thread_count(model.getvalue())


def _without_thread_count(model: bytes) -> bytes:
    """The model with trainer_spec.num_threads set to SAVED_THREADS (training itself does not depend on it)."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(model)
    proto.trainer_spec.num_threads = SAVED_THREADS
    return proto.SerializeToString()


def _vocab_error(message: str, vocab_size: int, chars: int) -> DataError:
    if m := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message):
        return DataError(
            f"--vocab-size {vocab_size} is too large for this corpus: its tokenizer sample ({chars:,} characters) "
            f"supports at most {m.group(1)} pieces; lower --vocab-size or give more text (documents, --sample-chars)")
    if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
        return DataError(
            f"--vocab-size {vocab_size} is too small: this corpus needs at least {m.group(1)} pieces "
            "(special and byte pieces plus its characters)")
    return DataError(f"SentencePiece training failed: {message.strip().splitlines()[0]}")


def load(model: bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor(model_proto=model)
    assert sp.eos_id() == EOS_ID and sp.piece_to_id("\n") == NEWLINE_ID, "unexpected special-piece layout"
    return sp


def encode_documents(sp: spm.SentencePieceProcessor, texts: Sequence[str], threads: int) -> list[np.ndarray]:
    """uint16 tokens of each text, lines joined by NEWLINE_ID, followed by EOS_ID; a literal META inside a line
    as META_BYTE_IDS (the line is encoded in the pieces between them)."""
    segments = [[line.split(META) for line in text.split("\n")] for text in texts]  # text -> line -> segments
    ids = iter(sp.encode([seg for lines in segments for line in lines for seg in line], num_threads=threads))
    out = []
    for lines in segments:
        tokens: list[int] = []
        for line in lines:
            tokens.extend(next(ids))
            for _ in line[1:]:
                tokens.extend(META_BYTE_IDS)
                tokens.extend(next(ids))
            tokens.append(NEWLINE_ID)
        tokens[-1] = EOS_ID  # the last line has no newline after it: the document ends
        out.append(np.array(tokens, dtype=np.uint16))
    return out


def encode_text(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """One text's tokens as training encoded it (`encode_documents`), without the closing EOS_ID: a prompt, a
    context or continuation of an evaluation task, what a transformers tokenizer returns."""
    return encode_documents(sp, [text], threads=1)[0][:-1].tolist()


def decode(sp: spm.SentencePieceProcessor, tokens: Sequence[int] | np.ndarray) -> list[str]:
    """The documents in a token sequence (split at EOS_ID; a trailing unfinished document is included)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) == 0:
        return []
    ends = np.flatnonzero(tokens == EOS_ID)
    bounds = zip(np.concatenate([[0], ends + 1]), np.concatenate([ends, [len(tokens)]]))
    docs = [sp.decode(tokens[a:b].tolist()) for a, b in bounds]
    return docs[:-1] if tokens[-1] == EOS_ID else docs  # nothing follows a final EOS
