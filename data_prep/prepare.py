"""Prepare a corpus for training: clean text -> SentencePiece BPE -> uint16 token shards + index.json.

    python -m data_prep.prepare --source gutenberg --src ../shared/data/gutenberg --out data/gutenberg

Output directory:
    tokenizer.model         SentencePiece model (data_prep/tokenizer.py: ids, losslessness)
    train_00000.bin, ...    flat little-endian uint16 tokens; every document is followed by EOS
    val_00000.bin, ...
    train_documents.u64     hashes of the training documents' texts (data_prep/doc_hashes.py)
    train_ngrams.u64        sampled hashes of the training text's 13-word sequences (the same)
    index.json              {"vocab_size", "eos_id", "newline_id", "tokenizer": "tokenizer.model",
                             "tokenizer_sha256", "source", "sources": [file names or hub ids], "settings",
                             "inputs": {file name: {"bytes", "sha256" (if read)}},
                             "splits": {"train"|"val": {"tokens", "documents",
                                        "shards": [{"file", "tokens", "documents", "sha256"}]}},
                             "train_documents": "train_documents.u64", "val_copies_of_train": n,
                             "hash_files_sha256": {file name: sha256},
                             "train_ngrams": {"file", "words", "keep_one_in"}, "val_ngram_share": x,
                             "forced_split": {doc id: split}, "skipped": {...counts}}
Two passes over the documents: a scan (count, choose the split, sample lines for the tokenizer),
then tokenisation. The train/val split is by document (data_prep/split.py). `--exclude-overlap` cuts out of
every document, in both passes, the text it shares with the given texts (data_prep/decontaminate.py).

Resuming: `progress.json` records the settings, the inputs (name and size of every local file, SHA-256 of
every one read),
the tokenizer hash and every finished shard (with its SHA-256); a rerun with the same settings and
inputs reuses the tokenizer and skips finished shards (their documents are read but not tokenised),
and a rerun after completion does nothing. Every rerun re-checks the finished shards: a damaged one
and those after it in its split are redone (data_prep/manifest.py); a finished preparation whose tokenizer
differs from the one its index records, or is missing, or that lacks a hash file, stops with one line
(`--overwrite` prepares it again). A rerun with different settings
or changed inputs stops with one line naming the differences; `--overwrite` starts fresh.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from data_prep import decontaminate, doc_hashes, tokenizer
from data_prep.cli import OneLineParser
from data_prep.cores import usable_cores
from data_prep.documents import Corpus, Document, Skips
from data_prep.errors import DataError, progress_bar, warn
from data_prep.manifest import as_recorded, input_changes, input_manifest, intact_prefix
from data_prep.sample import LineSampler
from data_prep.atomic import atomic_write, is_temp, remove_temp_files
from data_prep.shards import DTYPE, FORMAT, SHARD_NAME, SplitWriter, write_json
from data_prep.sources import LOCAL, SOURCES, open_source
from data_prep.split import Splitter

SPLITS = ("train", "val")
INDEX, PROGRESS, TOKENIZER = "index.json", "progress.json", "tokenizer.model"
ENCODE_BATCH_CHARS = 4_000_000  # documents are tokenised in batches of about this many characters


def _settings(corpus: Corpus, src: str | None, hub_split: str | None, data_files: Any, vocab_size: int,
              max_docs: int | None, val_fraction: float, shard_tokens: int, sample_chars: int) -> dict:
    """Everything that determines the output; a resumed run must match it exactly."""
    local = src is not None and corpus.kind in LOCAL
    return {
        "format": FORMAT, "source": corpus.kind, "src": str(Path(src).expanduser().resolve()) if local else src,
        "hub_split": hub_split, "data_files": data_files, "vocab_size": vocab_size,
        "tokenizer_type": tokenizer.MODEL_TYPE, "max_docs": max_docs, "val_fraction": val_fraction,
        "shard_tokens": shard_tokens, "sample_chars": sample_chars,
    }


def _read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None if there is no such file, {} if it holds no JSON object (unreadable)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _differences(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


def _ours(path: Path) -> bool:
    """Whether `path` has a name a preparation writes (the records, the tokenizer, shards, temporary files)."""
    return path.is_file() and (path.name in (INDEX, PROGRESS, TOKENIZER, doc_hashes.FILE, doc_hashes.NGRAM_FILE)
                               or bool(SHARD_NAME.match(path.name)) or is_temp(path))


def _remove_outputs(out: Path) -> None:
    """Delete what an earlier preparation wrote to `out` (only our own file names), its records last: interrupted
    half-way, what is left is still recognised as a preparation's (a lone tokenizer.model would not be)."""
    for path in sorted(out.iterdir(), key=lambda p: p.name in (INDEX, PROGRESS)):
        if _ours(path):
            path.unlink()


def _input_names(corpus: Corpus) -> list[str]:
    """The names of `corpus.files` in index.json's inputs."""
    return corpus.input_names or corpus.sources


def _previous_run(out: Path, settings: dict, corpus: Corpus, overwrite: bool,
                  progress_bars: bool) -> tuple[dict | None, dict | None]:
    """(finished index, progress) of an earlier run with the same settings and inputs, its damaged shards
    dropped from the progress (data_prep/manifest.py); see the module doc."""
    index, progress = _read_json(out / INDEX), _read_json(out / PROGRESS)
    hashed: dict[frozenset, dict] = {}  # the inputs now, by the names a record hashed (both records: hashed once)

    def inputs_now(recorded: dict[str, dict]) -> dict:
        key = frozenset(name for name, entry in recorded.items() if "sha256" in entry)
        if key not in hashed:
            hashed[key] = as_recorded(corpus.files, _input_names(corpus), recorded, progress_bars)
        return hashed[key]

    for name, found in ((INDEX, index), (PROGRESS, progress)):
        if found is None:
            continue
        if not isinstance(found.get("settings"), dict):
            problem = f"an unreadable {name} (no settings in it)"
        elif found["settings"] != settings:
            problem = f"other settings ({_differences(found['settings'], settings)})"
        elif isinstance(found.get("inputs"), dict) and found["inputs"] != (  # not recorded by older versions
                now := inputs_now(found["inputs"])):
            problem = f"other inputs ({input_changes(found['inputs'], now)})"
        else:
            continue
        if not overwrite:
            raise DataError(f"--out {out} holds a preparation with {problem}; "
                            "pass --overwrite to replace it, or choose another --out")
        _remove_outputs(out)
        return None, None
    if index is not None and (problems := incomplete(out, index)):
        if not overwrite:  # every shard depends on the tokenizer: redoing it means redoing everything
            raise DataError(f"--out {out} holds a preparation whose {' and whose '.join(problems)}; "
                            "pass --overwrite to prepare it again")
        _remove_outputs(out)
        return None, None
    if index is not None:
        progress = {"settings": settings, "inputs": index.get("inputs"), "tokenizer_sha256": index["tokenizer_sha256"],
                    "splits": {sp: {"shards": index["splits"][sp]["shards"], "documents": index["splits"][sp]["documents"]}
                               for sp in SPLITS}}
    if progress is None:
        return None, None
    damaged = False
    for split in SPLITS:
        intact, note = intact_prefix(out, progress["splits"][split]["shards"])
        if note is not None:
            warn(f"{note}; redoing it and the {split} shards after it")
            progress["splits"][split] = {"shards": intact, "documents": sum(s["documents"] for s in intact)}
            damaged = True
    if index is not None and not damaged:
        return index, None
    if index is not None:  # from here on an interrupted redo resumes like any interrupted run
        write_json(out / PROGRESS, progress)
        (out / INDEX).unlink()
    return None, progress


def _tokenizer_matches(model: Path, sha256: str | None) -> bool:
    """Whether the tokenizer file `model` exists and is the one whose SHA-256 a progress/index file recorded."""
    return model.is_file() and hashlib.sha256(model.read_bytes()).hexdigest() == sha256


def hash_file_names(index: dict) -> list[str]:
    """The training text's hash files a finished preparation's index names (none in an index that predates them)."""
    return [name for name in (index.get("train_documents"), (index.get("train_ngrams") or {}).get("file")) if name]


def incomplete(out: Path, index: dict) -> list[str]:
    """What a finished preparation in `out` lacks besides its shards (checked by intact_prefix): its tokenizer (the
    one its shards were made with) and the training text's hash files its index names; empty if nothing."""
    model, found = out / TOKENIZER, []
    if not model.is_file():
        found.append(f"{TOKENIZER} is missing")
    elif not _tokenizer_matches(model, index.get("tokenizer_sha256")):
        found.append(f"{TOKENIZER} is not the one its shards were made with (SHA-256 differs from index.json's)")
    found += [f"{name} is missing" for name in hash_file_names(index) if not (out / name).is_file()]
    return found


def _documents(corpus: Corpus, skips: Skips, desc: str, total: int | None, progress: bool) -> Iterator[Document]:
    return progress_bar(corpus.read(skips), desc=desc, total=total, unit="doc", progress=progress)


def _scan(corpus: Corpus, splitter: Splitter, sampler: LineSampler | None, progress: bool) -> tuple[int, Skips]:
    """Pass 1: see every document id (for the split) and sample training lines for the tokenizer
    (including the document forced into train when every document hashes to validation)."""
    skips = Skips()
    n, forced_train = 0, None
    for doc in _documents(corpus, skips, "scan", corpus.size_hint, progress):
        n += 1
        splitter.observe(doc.id)
        if sampler is None:
            continue
        if splitter.by_hash(doc.id) == "train":
            sampler.add(doc.id, doc.text)
        elif splitter.would_force_train(doc.id):
            forced_train = doc
    if n == 0:
        summary = ", ".join(f"{v} {k}" for k, v in skips.summary()["skipped_files_by_reason"].items())
        raise DataError(f"no usable documents in {', '.join(corpus.sources[:3])}{' ...' * (len(corpus.sources) > 3)} "
                        f"({len(corpus.sources)} inputs; skipped files: {summary or 'none'}{skips.describe_counts()})")
    splitter.finalize()
    if forced_train is not None and splitter.forced.get(forced_train.id) == "train":
        sampler.add(forced_train.id, forced_train.text)
    return n, skips


def _train_tokenizer(out: Path, settings: dict, inputs: dict, sampler: LineSampler, splitter: Splitter,
                     threads: int) -> dict:
    """Train on the sampled training lines, start a fresh progress record and save tokenizer.model, in that order:
    a tokenizer.model is never in --out without a record of it (a lone one is another program's, see _output_dir)."""
    lines = sampler.lines(exclude={d for d, split in splitter.forced.items() if split == "val"})
    model = tokenizer.train(lines, settings["vocab_size"], threads)
    state = {"settings": settings, "inputs": inputs, "tokenizer_sha256": hashlib.sha256(model).hexdigest(),
             "splits": {split: {"shards": [], "documents": 0} for split in SPLITS}}
    write_json(out / PROGRESS, state)
    atomic_write(out / TOKENIZER, lambda f: f.write(model))
    return state


def _tokenise(corpus: Corpus, out: Path, state: dict, splitter: Splitter, scan_skips: Skips, n_docs: int,
              threads: int, progress: bool) -> tuple[Skips, doc_hashes.SplitHashes]:
    """Pass 2: tokenise documents in batches into the split writers, skipping finished shards; hash every
    document's text (those in finished shards too)."""
    sp = tokenizer.load((out / TOKENIZER).read_bytes())
    writers = {split: SplitWriter(out, split, state["settings"]["shard_tokens"], state["splits"][split],
                                  on_shard=lambda: write_json(out / PROGRESS, state)) for split in SPLITS}
    skips = scan_skips.new_pass()  # counted afresh; warnings already shown are not repeated
    batch: list[tuple[SplitWriter, str]] = []
    hashes = doc_hashes.SplitHashes()

    def encode_batch() -> None:
        encoded = tokenizer.encode_documents(sp, [text for _, text in batch], threads)
        for (writer, _), tokens in zip(batch, encoded):
            writer.add(tokens)
        batch.clear()

    batch_chars = 0
    for doc in _documents(corpus, skips, "tokenise", n_docs, progress):
        split = splitter(doc.id)
        hashes.add(split, doc.text)
        writer = writers[split]
        if writer.wants():
            batch.append((writer, doc.text))
            batch_chars += len(doc.text)
            if batch_chars >= ENCODE_BATCH_CHARS:
                encode_batch()
                batch_chars = 0
    encode_batch()
    for writer in writers.values():
        writer.flush()
    return skips, hashes


def _finish(out: Path, corpus: Corpus, state: dict, splitter: Splitter, skips: Skips,
            hashes: doc_hashes.SplitHashes) -> dict:
    """Write the training text's records (data_prep/doc_hashes.py) and index.json, drop progress.json and any
    shard file the index does not list."""
    records = hashes.write(out)
    if records["val_copies_of_train"]:
        warn(f"{records['val_copies_of_train']} validation document(s) are exact copies of training documents: "
             "the validation loss is optimistic by their share")
    if (records["val_ngram_share"] or 0) >= doc_hashes.SHARE_IN_TRAINING:
        warn(f"{records['val_ngram_share']:.1%} of the validation split's sampled 13-word sequences occur in the "
             "training split (near-copies, excerpts, boilerplate): the validation loss is optimistic")
    vocab_size = tokenizer.load((out / TOKENIZER).read_bytes()).vocab_size()
    index = {
        "format": FORMAT, "vocab_size": vocab_size, "eos_id": tokenizer.EOS_ID,
        "newline_id": tokenizer.NEWLINE_ID, "dtype": DTYPE, "tokenizer": TOKENIZER,
        "tokenizer_type": tokenizer.MODEL_TYPE, "tokenizer_sha256": state["tokenizer_sha256"],
        "source": corpus.kind, "sources": corpus.sources, "settings": state["settings"], "inputs": state["inputs"],
        "splits": {split: {"tokens": sum(s["tokens"] for s in state["splits"][split]["shards"]),
                           "documents": state["splits"][split]["documents"],
                           "shards": state["splits"][split]["shards"]} for split in SPLITS},
        **records,
        "forced_split": splitter.forced, "skipped": skips.summary(),
    }
    write_json(out / INDEX, index)
    (out / PROGRESS).unlink()
    listed = {s["file"] for split in SPLITS for s in index["splits"][split]["shards"]}
    for stale in out.iterdir():
        if SHARD_NAME.match(stale.name) and stale.name not in listed:
            stale.unlink()
    return index


def prepare(
    source: str, src: str | None, out: str | Path, *, vocab_size: int = 8000, max_docs: int | None = None,
    val_fraction: float = 0.01, shard_tokens: int = 50_000_000, sample_chars: int = 20_000_000,
    hub_split: str | None = None, data_files: str | list[str] | None = None, overwrite: bool = False,
    threads: int | None = None, progress: bool = True, exclude_overlap: list[str] | None = None,
    hub_config: str | None = None, hub_revision: str | None = None,
) -> dict:
    """Prepare `source` into `out` (see the module doc) and return the index; DataError on bad input.
    `exclude_overlap`: files or directories of texts whose 13-word sequences are cut out of every document
    (data_prep/decontaminate.py)."""
    for name, value in (("--max-docs", max_docs), ("--shard-tokens", shard_tokens), ("--sample-chars", sample_chars),
                        ("--threads", threads)):
        if value is not None and value < 1:
            raise DataError(f"{name} must be a positive integer, got {value}")
    tokenizer.check_vocab_size(vocab_size)
    splitter = Splitter(val_fraction)
    if threads is None:
        threads = min(4, usable_cores())
    clock, times = time.perf_counter(), {}
    corpus = open_source(source, src, hub_split, data_files, hub_config, exclude=Path(out),  # --out may be in --src
                         hub_revision=hub_revision)
    settings = _settings(corpus, src, hub_split, data_files, vocab_size, max_docs, val_fraction, shard_tokens,
                         sample_chars)
    for key, value in (("hub_config", hub_config), ("hub_revision", hub_revision)):
        if value is not None:  # recorded only when given, so that earlier preparations keep their settings
            settings[key] = value
    corpus = corpus.first(max_docs)  # source documents: before the decontamination cuts them into pieces
    if exclude_overlap:  # recorded only when given, so that earlier preparations keep their settings
        sequences = decontaminate.excluded_sequences(exclude_overlap)
        settings["exclude_overlap"] = decontaminate.settings(exclude_overlap, sequences)
        corpus = decontaminate.without_overlap(corpus, sequences)
    out = Path(out)
    with _output_dir(out):
        for path in remove_temp_files(out):  # a shard or record whose writer was killed (kill -9 skips its cleanup)
            warn(f"removed {path}, left by an interrupted write")
        done, state = _previous_run(out, settings, corpus, overwrite, progress)
        if done is not None:
            print(f"{out} is already prepared with these settings; nothing to do")
            return done
        times["hash"], clock = time.perf_counter() - clock, time.perf_counter()  # inputs and finished shards

        model_file = out / TOKENIZER
        reuse = state is not None and _tokenizer_matches(model_file, state.get("tokenizer_sha256"))
        sampler = None if reuse else LineSampler(sample_chars)
        n_docs, scan_skips = _scan(corpus, splitter, sampler, progress)
        if report := decontaminate.report(scan_skips):
            warn(report)
        times["scan"], clock = time.perf_counter() - clock, time.perf_counter()
        inputs = state.get("inputs") if state is not None else None  # checked by _previous_run
        if inputs is None:  # a fresh run (or one recorded before inputs were): hash the files the scan read
            inputs = input_manifest(corpus.files, _input_names(corpus), corpus.opened, progress)
            times["hash"] += time.perf_counter() - clock
            clock = time.perf_counter()
        if reuse:
            state["inputs"] = inputs
        else:
            state = _train_tokenizer(out, settings, inputs, sampler, splitter, threads)
        times["tokenizer"], clock = time.perf_counter() - clock, time.perf_counter()
        skips, hashes = _tokenise(corpus, out, state, splitter, scan_skips, n_docs, threads, progress)
        index = _finish(out, corpus, state, splitter, skips, hashes)
        times["tokenise"] = time.perf_counter() - clock
        _report(out, index, times)
        return index


@contextmanager
def _output_dir(out: Path) -> Iterator[None]:
    """Create --out (a one-line DataError where it cannot be); a DataError that stops a first preparation before
    anything is written there removes the empty directory again (a refused command leaves nothing behind)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory")
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if names and not ({INDEX, PROGRESS} & names or any(map(SHARD_NAME.match, names))):  # no earlier preparation
        # a tokenizer.model without a record of ours is another one (ours is written after progress.json)
        foreign = sorted(name for name in names if not _ours(out / name) or name == TOKENIZER)
        if foreign:  # never delete or replace what another program keeps there (train_*.bin names included)
            raise DataError(f"--out {out} holds files that are no preparation's ({', '.join(foreign[:3])}"
                            f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file on the way, no permission, a read-only file system
        raise DataError(f"--out {out}: cannot create it ({err.strerror or err})") from None
    try:
        yield
    except DataError:
        if created and not any(out.iterdir()):
            out.rmdir()
        raise


def _report(out: Path, index: dict, times: dict[str, float]) -> None:
    train, val = index["splits"]["train"], index["splits"]["val"]
    skipped = index["skipped"]["skipped_files"]
    print(f"prepared {out}: train {train['tokens']:,} tokens / {train['documents']:,} docs "
          f"({len(train['shards'])} shards), val {val['tokens']:,} tokens / {val['documents']:,} docs, "
          f"vocab {index['vocab_size']}" + (f", {skipped} files skipped" if skipped else "") +
          f"; {sum(times.values()):.1f}s (" + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()) + ")")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m data_prep.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, choices=SOURCES,
                        help="gutenberg/text: dir of .txt[.gz]; c4: dir of *.json.gz JSON lines; builtin: Python's "
                             "own docs (offline); c4-hub / gutenberg-hub: stream with `datasets`")
    parser.add_argument("--src", help="input directory or file; for hub sources a dataset id "
                                      "(default allenai/c4 'en' / manu/project_gutenberg)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=8000, help="SentencePiece vocabulary (default 8000)")
    parser.add_argument("--max-docs", type=int, help="use only the first N usable documents")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="share of documents in validation")
    parser.add_argument("--shard-tokens", type=int, default=50_000_000, help="close a shard at this many tokens")
    parser.add_argument("--sample-chars", type=int, default=20_000_000,
                        help="characters of training text sampled for the tokenizer (default 20M)")
    parser.add_argument("--hub-split", help="hub split (default: train for c4-hub, en for gutenberg-hub)")
    parser.add_argument("--hub-config", help="hub dataset config (default: 'en' for allenai/c4; give it for a "
                                             "mirror or a local copy in that layout, e.g. --src DIR --hub-config en)")
    parser.add_argument("--hub-revision", help="hub sources: the dataset repository's commit sha, branch or tag to "
                                               "stream (default: its newest), recorded with the settings")
    parser.add_argument("--data-files", nargs="+", help="hub sources: data_files for datasets.load_dataset "
                                                        "(e.g. --src json --data-files URL_OR_GLOB ...)")
    parser.add_argument("--threads", type=int, help="tokenizer threads, >= 1 (default: min(4, CPUs)); "
                                                     "the output does not depend on it")
    parser.add_argument("--exclude-overlap", nargs="+", metavar="PATH",
                        help="cut out of every document the 13-word sequences it shares with these texts, 200 "
                             "characters either side, as GPT-3 did (.txt[.gz] or JSON lines with a 'text' field; "
                             "files or directories): decontamination for evaluation")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier preparation with other settings")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (there are none either when stderr is not a terminal, e.g. a log file)")
    args = parser.parse_args(argv)
    try:
        prepare(args.source, args.src, args.out, vocab_size=args.vocab_size, max_docs=args.max_docs,
                val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, sample_chars=args.sample_chars,
                hub_split=args.hub_split, data_files=args.data_files, overwrite=args.overwrite,
                threads=args.threads, progress=not args.no_progress and sys.stderr.isatty(),
                exclude_overlap=args.exclude_overlap,
                hub_config=args.hub_config, hub_revision=args.hub_revision)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume (finished shards are kept)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
