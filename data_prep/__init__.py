"""Text corpora -> SentencePiece tokenizer + flat uint16 token shards + index.json.

CLI: `python -m data_prep.prepare --source gutenberg --src DIR --out DIR` (see data_prep/prepare.py);
from Python: `from data_prep.prepare import prepare`. Bad input raises `data_prep.DataError` (one line).
"""
from data_prep.errors import DataError

__all__ = ["DataError"]
