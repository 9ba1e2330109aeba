"""A bounded sample of text lines for tokenizer training (deterministic for a fixed input order).

Every non-empty line gets a key from a hash of its content; the sample holds low-key lines whose lengths fit
in `max_chars` (bottom-k sampling), built in one pass with bounded memory: a uniform random sample of lines over
the whole corpus. When every line fits, it is all of them whatever the order; otherwise lines near the budget
can depend on the order (a line that does not fit when it arrives is skipped, even if later pops would have made
room for it), so a fixed input order (data_prep reads files sorted by name) gives a fixed sample.
"""
from __future__ import annotations

import hashlib
import heapq

MAX_LINE_CHARS = 4096  # longer lines (C4 paragraphs can be huge) are cut; SentencePiece skips very long ones


class LineSampler:
    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self._heap: list[tuple[int, str, str]] = []  # (-key, line, doc id): the root has the highest key

    def add(self, doc_id: str, text: str) -> None:
        heap = self._heap
        for line in text.split("\n"):
            if not line.strip():
                continue
            line = line[:MAX_LINE_CHARS]
            key = int.from_bytes(hashlib.blake2b(line.encode("utf-8"), digest_size=8).digest(), "big")
            if self.chars + len(line) > self.max_chars and heap and key >= -heap[0][0]:
                continue  # full, and this line would be the first to go
            heapq.heappush(heap, (-key, line, doc_id))
            self.chars += len(line)
            while self.chars > self.max_chars:
                self.chars -= len(heapq.heappop(heap)[1])

    def lines(self, exclude: set[str] = frozenset()) -> list[str]:
        """The sampled lines in key order (deterministic), leaving out those of the `exclude` documents."""
        return [line for _, line, doc_id in sorted(self._heap, reverse=True) if doc_id not in exclude]
