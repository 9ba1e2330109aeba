"""data_prep: Gutenberg cleaning, C4 and hub readers, shard round trip, split determinism, resume, bad input."""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tqdm import tqdm

from data_prep import DataError, c4, doc_hashes, gutenberg, shards, tokenizer
from data_prep.documents import Skips
from data_prep.hub import stream_rows
from data_prep.prepare import main, prepare
from data_prep.sources import open_source
from data_prep.split import Splitter

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(progress=False, threads=1)

LICENCE = "*** START: FULL LICENSE ***\nTHE FULL PROJECT GUTENBERG LICENSE\nPLEASE READ THIS BEFORE YOU DISTRIBUTE\n"


def pg_book(body: str, start: str = "*** START OF THIS PROJECT GUTENBERG EBOOK A TALE ***",
            end: str = "*** END OF THIS PROJECT GUTENBERG EBOOK A TALE ***") -> str:
    header = "The Project Gutenberg EBook of A Tale, by Someone\n\nTitle: A Tale\nCharacter set encoding: UTF-8\n\n"
    trailer = "\n\nEnd of the Project Gutenberg EBook of A Tale, by\nSomeone\n\n"
    return f"{header}{start}\n\n\n{body}{trailer}{end}\n\n{LICENCE}"


def documents_of(out: Path, split: str) -> list[str]:
    """Decode every shard of a split back into document texts."""
    index = json.loads((out / "index.json").read_text())
    sp = tokenizer.load((out / "tokenizer.model").read_bytes())
    docs = []
    for shard in index["splits"][split]["shards"]:
        tokens = np.fromfile(out / shard["file"], dtype=np.uint16)
        assert len(tokens) == shard["tokens"] and tokens[-1] == index["eos_id"]
        assert (tokens == index["eos_id"]).sum() == shard["documents"]
        docs += tokenizer.decode(sp, tokens)
    return docs


def words(seed: int, n: int) -> str:
    """Deterministic English-like text (lines of words from Python's own docs)."""
    from pydoc_data.topics import topics

    vocab = " ".join(topics.values()).split()[:5000]
    rng = np.random.default_rng(seed)
    return "\n".join(" ".join(rng.choice(vocab, size=12)) for _ in range(n))


def write_texts(directory: Path, texts: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / name).write_text(text, encoding="utf-8")
    return directory


# ---------------------------------------------------------------- Gutenberg cleaning


@pytest.mark.parametrize("start, end", [
    ("*** START OF THIS PROJECT GUTENBERG EBOOK A TALE ***", "*** END OF THIS PROJECT GUTENBERG EBOOK A TALE ***"),
    ("***START OF THE PROJECT GUTENBERG EBOOK A TALE***", "***END OF THE PROJECT GUTENBERG EBOOK A TALE***"),
    ("*** START OF THIS PROJECT GUTENBERG EBOOK A VERY LONG\nTALE ***",  # title wrapped onto a second line
     "*** END OF THIS PROJECT GUTENBERG EBOOK A TALE ***"),
])
def test_strip_gutenberg_markers(start: str, end: str) -> None:
    body = "CHAPTER I\n\n  It was a dark night; *** the end *** was near.\nEnd of chapter."
    stripped, missing = gutenberg.strip_gutenberg(pg_book(body, start, end))
    assert missing == () and stripped == body


def test_strip_gutenberg_keeps_unmarked_text_and_uses_last_start() -> None:
    assert gutenberg.strip_gutenberg("Plain text.\nNo markers.\n") == ("Plain text.\nNo markers.", ("START", "END"))
    twice = pg_book("The body.", start="*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nNotes\n"
                                        "*** START OF THIS PROJECT GUTENBERG EBOOK X ***")
    assert gutenberg.strip_gutenberg(twice)[0] == "The body."


def test_strip_gutenberg_cuts_only_a_closing_end_of_line() -> None:
    """"End of the Project Gutenberg EBook of ..." closes a book in its last lines (the last 1,000 characters); the
    same words at the start of a line earlier in the book are the book's own text."""
    early = "CHAPTER I\n\nEnd of the Project Gutenberg, the narrator said, was near.\n\n" + words(3, 60)
    assert len(early) > 1000 + 60
    assert gutenberg.strip_gutenberg(pg_book(early)) == (early, ())  # the closing line cut, the early one kept
    unclosed = (f"*** START OF THIS PROJECT GUTENBERG EBOOK A TALE ***\n\n{early}\n\n"
                "*** END OF THIS PROJECT GUTENBERG EBOOK A TALE ***\n")
    assert gutenberg.strip_gutenberg(unclosed) == (early, ())  # a book without the closing line is kept whole


@pytest.mark.parametrize("credit", [
    "Produced by Judith Boss.  HTML version by Al Haines.",
    "Transcribed from the 1897 Service & Paton edition by David Price, email\nccx074@pglaf.org",
    "This etext was created by Judith Boss, of Omaha, Nebraska, from the\nGarden City Publishing Company",
    "Special thanks are due to Sharon Partridge for extensive\nproofreading and correction of this etext.",
    "*****\nTHIS EBOOK WAS ONE OF PROJECT GUTENBERG'S EARLY FILES PRODUCED AT A\nTIME WHEN PROOFING METHODS",
])
def test_strip_gutenberg_drops_a_first_paragraph_that_is_pg_production_credit(credit: str) -> None:
    """PG's production credit opens most books (82 of the 94 in shared/data): not the book, and the same template
    in every one. Only that first paragraph goes; a book's own first paragraph stays, and text without PG markers
    passes through unchanged."""
    body = "THE TALE\n\nby Someone\n\nProduced by the author in 1850, the tale is an etext of its time."
    assert gutenberg.strip_gutenberg(pg_book(f"{credit}\n\n\n\n{body}")) == (body, ())
    assert gutenberg.strip_gutenberg(pg_book(body)) == (body, ())
    assert gutenberg.strip_gutenberg(f"{credit}\n\n{body}")[0] == f"{credit}\n\n{body}"
    unbroken = f"{credit}\n" + "A book without a blank line. " * 50  # the credit's paragraph is the whole book
    assert gutenberg.strip_gutenberg(pg_book(unbroken))[0] == unbroken.rstrip()


def test_strip_gutenberg_real_books(shared_data: Path) -> None:
    skips = Skips()
    names = ["pg1080_a_modest_proposal.txt.gz", "pg148_the_autobiography_of_benjamin_franklin.txt.gz"]
    books = {d.id: d.text for d in gutenberg.file_documents([shared_data / "gutenberg" / f for f in names], names,
                                                            skips)}
    proposal = books["pg1080_a_modest_proposal"]
    assert proposal.startswith("A MODEST PROPOSAL\n\nFor preventing the children")  # "Produced by ..." dropped
    assert proposal.endswith("the youngest being nine years old, and my wife past\nchild-bearing.")
    franklin = books["pg148_the_autobiography_of_benjamin_franklin"]  # START marker wrapped over two lines, twice
    assert franklin.startswith("THE AUTOBIOGRAPHY OF BENJAMIN FRANKLIN\n\nThe Harvard Classics")
    for text in books.values():
        assert "\r" not in text and "PROJECT GUTENBERG" not in text and "FULL LICENSE" not in text
    assert not skips.files


def test_line_endings_normalised(tmp_path: Path) -> None:
    raw = pg_book("one\ntwo\n\nthree\rfour").replace("\n", "\r\n").encode()
    (tmp_path / "b.txt").write_bytes(raw)
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(raw))
    files = sorted(tmp_path.iterdir())
    docs = list(gutenberg.file_documents(files, [p.name for p in files], Skips()))
    assert [d.text for d in docs] == ["one\ntwo\n\nthree\nfour"] * 2
    assert [d.id for d in docs] == ["b", "c"]


@pytest.mark.parametrize("kept, missing, gone", [
    (pg_book("The body.", start=""), "START", "LICENSE"),  # header kept, licence stripped
    (pg_book("The body.", end=""), "END", "EBook of A Tale, by Someone"),  # header stripped
])
def test_one_missing_marker_is_warned(kept: str, missing: str, gone: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    """A book with only one of the START/END markers is kept, with a warning naming the missing one."""
    path = write_texts(tmp_path / "a", {"x.txt": kept}) / "x.txt"
    skips = Skips()
    [doc] = gutenberg.file_documents([path], ["a/x.txt"], skips)
    assert doc.text.endswith("The body.") and gone not in doc.text
    assert skips.counts == {f"gutenberg_files_without_{missing.lower()}_marker": 1}
    assert f"warning: a/x.txt: no Project Gutenberg {missing} marker; kept everything" in capsys.readouterr().err


def test_a_book_with_nothing_between_its_markers_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A book whose START and END markers enclose only blank lines (and the closing "End of the Project Gutenberg
    EBook" line) is no document: a file skipped as "empty", warned once although both passes read it; the other
    books are prepared."""
    books = {"a.txt": pg_book(words(1, 30)), "b.txt": pg_book(words(2, 30)), "blank.txt": pg_book("\n  \n\t\n")}
    out = tmp_path / "out"
    index = prepare("gutenberg", str(write_texts(tmp_path / "src", books)), out, vocab_size=400, val_fraction=0.5,
                    **QUIET)
    assert index["skipped"]["skipped_files_by_reason"] == {"empty": 1}
    assert sorted(documents_of(out, "train") + documents_of(out, "val")) == sorted([words(1, 30), words(2, 30)])
    assert capsys.readouterr().err.count(
        "warning: skipped blank.txt: empty (nothing between the Project Gutenberg markers)\n") == 1


def test_book_ids_are_relative_paths(tmp_path: Path) -> None:
    """Books with the same file name in different folders (the Author/Title.txt layout) are different
    documents; in a flat folder, and for a single file, the id stays the file name without suffix."""
    write_texts(tmp_path / "src" / "x", {"Poems.txt": pg_book(words(1, 30))})
    write_texts(tmp_path / "src" / "y", {"Poems.txt": pg_book(words(2, 30))})
    index = prepare("gutenberg", str(tmp_path / "src"), tmp_path / "out", vocab_size=400, val_fraction=0.5, **QUIET)
    assert sorted(documents_of(tmp_path / "out", "train") + documents_of(tmp_path / "out", "val")) == \
        sorted([words(1, 30), words(2, 30)])
    assert set(index["forced_split"]) <= {"x/Poems", "y/Poems"}
    single = open_source("gutenberg", str(tmp_path / "src" / "x" / "Poems.txt"))
    assert [d.id for d in single.read(Skips())] == ["Poems"]
    flat = write_texts(tmp_path / "flat", {"pg1_a.txt": pg_book("A."), "pg2_b.txt": "B."})
    assert [d.id for d in open_source("gutenberg", str(flat)).read(Skips())] == ["pg1_a", "pg2_b"]


# ---------------------------------------------------------------- C4 and the hub route


def test_c4_local_reader_real_file(shared_data: Path) -> None:
    path = shared_data / "c4" / "c4-train.00000-of-01024.first1000.json.gz"
    skips = Skips()
    docs = list(c4.file_documents([path], skips))
    assert len(docs) == 1000 and not skips.counts and not skips.files
    assert docs[0].text.startswith("Beginners BBQ Class Taking Place in Missoula!")
    assert len({d.id for d in docs}) == 1000


def test_a_c4_documents_id_is_the_hash_of_its_normalised_text() -> None:
    """A text with Windows or old-Mac line endings is the same document as its "\\n" copy: one id (so one split,
    and one document to the exact-copy and decontamination checks), the SHA-1 of the text as it is tokenised."""
    rows = [{"text": "One line.\r\nTwo lines.\rThree."}, {"text": "One line.\nTwo lines.\nThree."}]
    crlf, lf = c4.row_documents(rows, Skips())
    assert crlf.text == lf.text == rows[1]["text"]
    assert crlf.id == lf.id == "sha1:" + hashlib.sha1(rows[1]["text"].encode()).hexdigest()


def test_hub_route_on_local_json_gz(shared_data: Path, tmp_path: Path) -> None:
    """The streaming code (datasets.load_dataset(..., streaming=True) -> row_documents) on a local file
    in the allenai/c4 format gives exactly the local reader's documents, and prepares end to end."""
    path = shared_data / "c4" / "c4-en.llamafactory-demo.textonly.json.gz"
    streamed = list(c4.row_documents(stream_rows("json", None, "train", data_files=str(path)), Skips()))
    local = list(c4.file_documents([path], Skips()))
    assert len(streamed) == 300 and streamed == local
    index = prepare("c4-hub", "json", tmp_path / "hub", data_files=str(path), vocab_size=800, max_docs=120,
                    val_fraction=0.1, **QUIET)
    assert index["sources"] == [f"json:train data_files={path}"]
    assert sorted(documents_of(tmp_path / "hub", "train") + documents_of(tmp_path / "hub", "val")) == \
        sorted(d.text for d in local[:120])


def test_c4_hub_route_on_a_local_copy_in_the_allenai_layout(shared_data: Path, tmp_path: Path) -> None:
    """datasets.load_dataset(DIR, "en", streaming=True) on a copy laid out as allenai/c4 (a README's configs, en/
    shards): --hub-config en reaches it (without it, a --src other than allenai/c4 got no config and failed) and gives
    the local reader's documents."""
    import shutil

    mirror = tmp_path / "c4"
    (mirror / "en").mkdir(parents=True)
    shard = shared_data / "c4" / "c4-train.00000-of-01024.first1000.json.gz"
    shutil.copy(shard, mirror / "en" / "c4-train.00000-of-01024.json.gz")
    (mirror / "README.md").write_text("---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n"
                                      "    path: en/c4-train.*.json.gz\n---\n")
    streamed = list(open_source("c4-hub", str(mirror), hub_config="en").read(Skips()))
    assert len(streamed) == 1000 and streamed == list(c4.file_documents([shard], Skips()))
    index = prepare("c4-hub", str(mirror), tmp_path / "out", hub_config="en", vocab_size=800, max_docs=60,
                    val_fraction=0.1, **QUIET)
    assert index["sources"] == [f"{mirror}/en:train"]


def test_gutenberg_hub_route_on_local_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """gutenberg-hub rows ({"id", "text"} with PG header/footer and CRLF) are stripped like local books; an empty
    text is an empty document, a book with nothing between its markers is skipped as "empty" (named by its row id),
    and a row without a "text" field (null in the streamed table) is counted as a row without text and warned
    about, as C4's are."""
    bodies = {str(i): words(300 + i, 25) for i in range(8)}
    rows = [{"id": i, "text": pg_book(body).replace("\n", "\r\n")} for i, body in bodies.items()]
    rows += [{"id": "x", "text": ""}, {"id": "blank", "text": pg_book("\n\n")}, {"id": "y"}]
    skips = Skips()
    assert list(gutenberg.row_documents(rows, skips)) == [(f"pg-hub:{i}", b) for i, b in bodies.items()]
    assert skips.counts == {"empty_documents": 1, "rows_without_text": 1} and skips.files == {"row blank": "empty"}
    assert 'warning: rows: 1 row(s) without a string "text" field, first at row 11 (skipped)' in capsys.readouterr().err
    (tmp_path / "books.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    index = prepare("gutenberg-hub", "json", tmp_path / "out", data_files=str(tmp_path / "books.jsonl"),
                    hub_split="train", vocab_size=500, val_fraction=0.2, **QUIET)
    docs = documents_of(tmp_path / "out", "train") + documents_of(tmp_path / "out", "val")
    assert sorted(docs) == sorted(bodies.values())
    assert index["skipped"]["empty_documents"] == 1 and index["skipped"]["rows_without_text"] == 1
    assert index["skipped"]["skipped_files_by_reason"] == {"empty": 1}


def test_hub_revision_pins_the_stream_and_is_recorded(shared_data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """--hub-revision reaches datasets.load_dataset(revision=...), names the source and joins the settings (another
    revision is another preparation); hub-only options with a local source are refused in one line."""
    import datasets

    seen, load = [], datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: seen.append(kw["revision"]) or load(*a, **kw))
    path = str(shared_data / "c4" / "c4-en.llamafactory-demo.textonly.json.gz")
    kw = dict(data_files=path, vocab_size=800, max_docs=60, val_fraction=0.1, **QUIET)
    index = prepare("c4-hub", "json", tmp_path / "out", hub_revision="v1", **kw)
    assert set(seen) == {"v1"} and index["sources"] == [f"json@v1:train data_files={path}"]
    with pytest.raises(DataError, match="other settings"):
        prepare("c4-hub", "json", tmp_path / "out", hub_revision="v2", **kw)
    assert prepare("c4-hub", "json", tmp_path / "out", **kw, overwrite=True)["sources"] == [f"json:train data_files={path}"]
    assert seen[-1] is None
    with pytest.raises(DataError, match=r"^--hub-split, --hub-revision: only for hub sources \(c4-hub, gutenberg-hub\), "
                                        r"not --source c4$"):
        prepare("c4", str(shared_data / "c4"), tmp_path / "local", hub_split="train", hub_revision="v1", **QUIET)
    with pytest.raises(DataError, match=r"^--src does not apply to --source builtin"):
        prepare("builtin", "/nonexistent", tmp_path / "builtin", **QUIET)  # was accepted and recorded


def test_hub_unreachable_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (OfflineModeIsEnabled)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"^streaming allenai/c4/en split 'train' failed \(ConnectionError: "
                                        r"Couldn't reach 'allenai/c4' on the Hub \(OfflineModeIsEnabled\)\); "
                                        r"check the network and HF_DATASETS_OFFLINE/HF_HUB_OFFLINE$"):
        prepare("c4-hub", None, tmp_path / "out", **QUIET)
    with pytest.raises(DataError, match=r"^streaming manu/project_gutenberg split 'en' failed"):  # its defaults
        prepare("gutenberg-hub", None, tmp_path / "out", **QUIET)


def test_a_network_error_is_found_however_it_was_chained() -> None:
    """The hint blames the network when a connection error is anywhere in the chain: raised `from` it
    (__cause__), or raised while handling it (__context__, as libraries wrapping it without `from` leave it)."""
    from data_prep.hub import is_network_error

    def chained(explicit: bool) -> Exception:
        try:
            try:
                raise ConnectionError("reset by peer")
            except ConnectionError as inner:
                if explicit:
                    raise ValueError("load failed") from inner
                raise ValueError("load failed")
        except ValueError as err:
            return err

    assert is_network_error(chained(True)) and is_network_error(chained(False))
    assert not is_network_error(ValueError("a bad row")) and not is_network_error(FileNotFoundError("x.json"))


def test_hub_errors_blame_the_network_only_when_it_is_one(tmp_path: Path) -> None:
    """A missing data file or an unparsable row is not a network problem: no network/offline hint."""
    with pytest.raises(DataError, match=r"^streaming json split 'train' failed \(FileNotFoundError: .*\); "
                                        r"check the dataset id \(--src\), --hub-split, --hub-revision and --data-files$"):
        prepare("c4-hub", "json", tmp_path / "out", data_files=str(tmp_path / "missing.jsonl"), **QUIET)
    (tmp_path / "a.jsonl").write_text('{"text": "lone \\ud83d surrogate"}\n')
    with pytest.raises(DataError, match=r"^streaming json split 'train' failed \(ArrowInvalid: [^;]*$"):
        prepare("c4-hub", "json", tmp_path / "out", data_files=str(tmp_path / "a.jsonl"), **QUIET)


# ---------------------------------------------------------------- shards, split, resume


def test_a_shard_closes_as_soon_as_it_reaches_shard_tokens(tmp_path: Path) -> None:
    """Whole documents per shard: a shard is written when its documents reach shard_tokens (3 + 2 = 5 of 5), the
    rest waits for the next one or the final flush; each written shard is recorded, then on_shard() is called."""
    state: dict = {"shards": [], "documents": 0}
    recorded: list[int] = []
    writer = shards.SplitWriter(tmp_path, "train", 5, state, lambda: recorded.append(len(state["shards"])))
    writer.add(np.array([1, 2, 3], dtype=np.uint16))
    assert state["shards"] == [] and recorded == []
    writer.add(np.array([4, 5], dtype=np.uint16))
    assert [(s["file"], s["tokens"], s["documents"]) for s in state["shards"]] == [("train_00000.bin", 5, 2)]
    writer.add(np.array([6], dtype=np.uint16))
    writer.flush()
    assert [(s["tokens"], s["documents"]) for s in state["shards"]] == [(5, 2), (1, 1)] and state["documents"] == 3
    assert recorded == [1, 2]
    assert np.fromfile(tmp_path / "train_00000.bin", dtype="<u2").tolist() == [1, 2, 3, 4, 5]


def test_round_trip_and_eos(tmp_path: Path) -> None:
    texts = {f"d{i:02d}.txt": words(i, 30) for i in range(12)}
    texts["odd.txt"] = "  indented\tline with  double  spaces\n\n\nüñíçødé — “quotes” 中文 ∑\x00\nend  "
    texts["crlf.txt"] = "windows\r\nline endings\r\n"
    texts["meta.txt"] = "\u2581SentencePiece\u2581s space\u2581\u2581symbol as text \u2581\nnot a space"  # was decoded as " "
    src = write_texts(tmp_path / "src", texts)
    index = prepare("text", str(src), tmp_path / "out", vocab_size=600, val_fraction=0.2, shard_tokens=500, **QUIET)
    expected = {t.replace("\r\n", "\n") for t in texts.values()}
    train, val = documents_of(tmp_path / "out", "train"), documents_of(tmp_path / "out", "val")
    assert sorted(train + val) == sorted(expected)
    assert index["vocab_size"] == 600 and index["eos_id"] == tokenizer.EOS_ID
    for split, docs in (("train", train), ("val", val)):
        assert index["splits"][split]["documents"] == len(docs) > 0
        assert index["splits"][split]["tokens"] == sum(s["tokens"] for s in index["splits"][split]["shards"])
    assert len(index["splits"]["train"]["shards"]) > 1
    recorded = np.fromfile(tmp_path / "out" / index["train_documents"], dtype="<u8")
    assert recorded.tolist() == sorted({doc_hashes.text_hash(t) for t in train}) and index["val_copies_of_train"] == 0
    sequences = np.fromfile(tmp_path / "out" / index["train_ngrams"]["file"], dtype="<u8")
    assert sequences.tolist() == sorted({int(h) for t in train for h in doc_hashes.ngram_hashes(t)}) and len(sequences)
    assert index["train_ngrams"] == {"file": "train_ngrams.u64", "words": 13, "keep_one_in": 16}
    assert index["val_ngram_share"] == 0.0
    assert index["tokenizer_sha256"] == hashlib.sha256((tmp_path / "out/tokenizer.model").read_bytes()).hexdigest()


def test_split_is_by_document_hash_independent_of_order_and_max_docs(tmp_path: Path) -> None:
    rows = [{"text": words(100 + i, 3), "timestamp": None, "url": None} for i in range(60)]
    for name, order in (("fwd", rows), ("rev", rows[::-1])):
        (tmp_path / name).mkdir()
        with gzip.open(tmp_path / name / "c4.json.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in order)
    kw = dict(vocab_size=500, val_fraction=0.25, **QUIET)
    prepare("c4", str(tmp_path / "fwd"), tmp_path / "all", **kw)
    prepare("c4", str(tmp_path / "rev"), tmp_path / "rev_out", **kw)
    prepare("c4", str(tmp_path / "fwd"), tmp_path / "first30", max_docs=30, **kw)
    val_all, val_rev = set(documents_of(tmp_path / "all", "val")), set(documents_of(tmp_path / "rev_out", "val"))
    val_30 = set(documents_of(tmp_path / "first30", "val"))
    # the rule written out (data_prep/split.py): validation iff the id's 8-byte blake2b ("split"), as a fraction of
    # 2^64, is below --val-fraction; about a quarter of the 60 (15, a binomial's 3 sigma either side: 4 .. 26)
    def to_val(doc_id: str) -> bool:
        digest = hashlib.blake2b(doc_id.encode(), digest_size=8, person=b"split").digest()
        return int.from_bytes(digest, "big") < 0.25 * 2**64

    expected = {r["text"] for r in rows if to_val(c4.text_id(r["text"]))}
    assert val_all == val_rev == expected and 4 <= len(expected) <= 26
    assert val_30 == expected & {r["text"] for r in rows[:30]} and val_30


def test_validation_copies_of_training_documents_are_counted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The same text under two names that hash to different splits makes validation optimistic: warned, counted."""
    names = [f"d{i:02d}.txt" for i in range(40)]
    train_name = next(n for n in names if Splitter(0.2).by_hash(n) == "train")
    val_names = [n for n in names if Splitter(0.2).by_hash(n) == "val"][:2]
    texts = {n: words(i, 20) for i, n in enumerate(names[:12])}
    texts.update({val_names[0]: texts[train_name], val_names[1]: texts[train_name]})
    index = prepare("text", str(write_texts(tmp_path / "src", texts)), tmp_path / "out", vocab_size=500,
                    val_fraction=0.2, **QUIET)
    assert index["val_copies_of_train"] == 2
    assert "warning: 2 validation document(s) are exact copies of training documents" in capsys.readouterr().err
    sampled = [len(doc_hashes.ngram_hashes(t)) for n, t in texts.items() if Splitter(0.2).by_hash(n) == "val"]
    assert index["val_ngram_share"] == 2 * len(doc_hashes.ngram_hashes(texts[train_name])) / sum(sampled) < 1


def test_validation_excerpts_of_training_documents_are_measured(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A validation document holding a paragraph of a training document is no exact copy, but the share of the
    validation split's sampled 13-word sequences found in training says so, and a share of 1% or more is warned."""
    names = [f"d{i:02d}.txt" for i in range(40)]
    train_name = next(n for n in names if Splitter(0.2).by_hash(n) == "train")
    val_name = next(n for n in names if Splitter(0.2).by_hash(n) == "val")
    texts = {n: words(i, 20) for i, n in enumerate(names[:12])}
    texts[val_name] = words(99, 20) + "\n" + "\n".join(texts[train_name].splitlines()[5:15])
    index = prepare("text", str(write_texts(tmp_path / "src", texts)), tmp_path / "out", vocab_size=500,
                    val_fraction=0.2, **QUIET)
    assert index["val_copies_of_train"] == 0 and 0.01 <= index["val_ngram_share"] < 1
    assert (f"warning: {index['val_ngram_share']:.1%} of the validation split's sampled 13-word sequences occur in the "
            "training split") in capsys.readouterr().err


def test_exclude_overlap_cuts_out_shared_text_as_gpt3_did(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--exclude-overlap (data_prep/decontaminate.py): in documents of either split, each 13 consecutive words of
    an excluded text (any case and punctuation) are cut out with 200 characters either side, pieces under 200
    characters go, a document cut into more than 10 pieces goes whole; 12 shared words are not enough; both are
    counted; the exclusion is part of the settings; excluded texts come as .txt or JSON lines; bad ones are one
    line."""
    names = [f"d{i:02d}.txt" for i in range(40)]
    val_name = next(n for n in names if Splitter(0.2).by_hash(n) == "val")
    texts = {n: words(i, 10) for i, n in enumerate(names[:12])}
    held_out = " ".join(f"held{i}" for i in range(400))  # plain words: a quote of n of them is n words
    first = held_out.split()
    before, after = words(100, 8), words(101, 8)  # over 400 characters each
    quote = " ".join(first[20:80]).upper() + ", and"  # 60 words: 48 overlapping sequences, one window
    texts["quotes.txt"] = f"{before}\n{quote}\n{after}"
    texts[val_name] = words(501, 1) + "\n" + " ".join(first[100:113])  # a validation document: nothing left
    texts["scattered.txt"] = "\n".join(words(200 + k, 8) + "\n" + " ".join(first[120 + 13 * k:133 + 13 * k])
                                       for k in range(11)) + "\n" + words(300, 8)  # 12 pieces
    texts["quotes12.txt"] = texts["d01.txt"] + "\n" + " ".join(first[300:312])
    src = write_texts(tmp_path / "src", texts)
    excluded = write_texts(tmp_path / "eval", {"held_out.txt": held_out})
    index = prepare("text", str(src), tmp_path / "out", vocab_size=500, val_fraction=0.2,
                    exclude_overlap=[str(excluded)], **QUIET)
    kept = documents_of(tmp_path / "out", "train") + documents_of(tmp_path / "out", "val")
    start, end = texts["quotes.txt"].index(quote), texts["quotes.txt"].index(quote) + len(quote) - len(", and")
    pieces = [texts["quotes.txt"][:start - 200], texts["quotes.txt"][end + 200:]]
    assert sorted(kept) == sorted([t for n, t in texts.items() if n not in ("quotes.txt", val_name, "scattered.txt")]
                                  + pieces)
    assert all(len(p) >= 200 for p in pieces)
    assert index["skipped"]["documents_cut_around_excluded_texts"] == 1
    assert index["skipped"]["documents_overlapping_excluded_texts"] == 2
    assert index["settings"]["exclude_overlap"]["paths"] == [str(excluded.resolve())]
    err = capsys.readouterr().err
    assert "out of 1 documents; left out 2 documents sharing them (cut into more than 10 pieces" in err

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": held_out}) + "\n")
    again = prepare("text", str(src), tmp_path / "out_jsonl", vocab_size=500, val_fraction=0.2,
                    exclude_overlap=[str(rows)], **QUIET)
    assert again["skipped"]["documents_overlapping_excluded_texts"] == 2
    assert again["skipped"]["documents_cut_around_excluded_texts"] == 1
    assert again["settings"]["exclude_overlap"]["sha256"] == index["settings"]["exclude_overlap"]["sha256"]
    with pytest.raises(DataError, match="holds a preparation with other settings .*exclude_overlap"):
        prepare("text", str(src), tmp_path / "out", vocab_size=500, val_fraction=0.2, **QUIET)
    (tmp_path / "short.txt").write_text("twelve words are not enough to make one sequence of thirteen here")
    (tmp_path / "empty.txt").write_text("")
    for path, message in ((tmp_path / "nowhere", "--exclude-overlap: .*nowhere: no such file or directory"),
                          (tmp_path / "short.txt", "--exclude-overlap .*short.txt: no text of 13 words or more"),
                          (tmp_path / "empty.txt", "--exclude-overlap: empty.txt: empty; nothing was prepared")):
        with pytest.raises(DataError, match=message):
            prepare("text", str(src), tmp_path / "bad", vocab_size=500, exclude_overlap=[str(path)], **QUIET)


QUOTE = " ".join(f"q{i}" for i in range(13))  # one 13-word sequence


def shares_quote(text: str) -> np.ndarray:
    """Which of `text`'s 13-word sequences (sequence_hashes order) are QUOTE: decontaminate.pieces' `shared`."""
    from data_prep.doc_hashes import contains, sequence_hashes

    return contains(np.unique(sequence_hashes(QUOTE)), sequence_hashes(text))


@pytest.mark.parametrize("quotes", [9, 10])
def test_a_document_cut_into_more_than_10_pieces_goes_whole(quotes: int) -> None:
    """decontaminate.pieces: n quotes 500 characters apart make n + 1 pieces; 10 are kept (each of 500 - 2 * 200
    = 100 characters, so discarded as short, but the two ends), 11 drop the document."""
    from data_prep import decontaminate

    filler = "x" * 499  # one word, 500 characters with the newline
    text = "\n".join([filler] + [f"{QUOTE}\n{filler}" for _ in range(quotes)])
    shared = shares_quote(text)
    assert shared.sum() == quotes
    kept = decontaminate.pieces(text, shared)
    assert kept == ([] if quotes + 1 > decontaminate.MAX_PIECES else [filler[:300], filler[-300:]])


@pytest.mark.parametrize("filler", [399, 398])
def test_pieces_of_200_characters_are_kept(filler: int) -> None:
    """decontaminate.pieces keeps a piece of MIN_PIECE = 200 characters or more: one quote with `filler` + 1
    characters either side leaves two pieces of filler + 1 - 200 characters (200 kept, 199 discarded)."""
    from data_prep import decontaminate

    text = "\n".join(["x" * filler, QUOTE, "y" * filler])
    kept = decontaminate.pieces(text, shares_quote(text))
    assert kept == ([] if filler == 398 else ["x" * 200, "y" * 200])


def test_word_spans_are_offsets_in_the_original_text_after_a_dotted_capital_i() -> None:
    """'İ' (U+0130) lower-cases to two characters ('i' and a combining dot, no word character): words are found in
    the lower-cased text, and word_spans maps their offsets back, so every span, also after such characters, is its
    word in the original text, and decontaminate.pieces cuts a quote out where it stands in the original text."""
    from data_prep import decontaminate
    from data_prep.doc_hashes import word_spans

    text = "İİ İSTANBUL, Ankara; and İzmir."
    assert len(text.lower()) == len(text) + 4
    spans = word_spans(text).tolist()
    assert [text[a:b] for a, b in spans] == ["İ", "İ", "İ", "STANBUL", "Ankara", "and", "İ", "zmir"]
    filler = "İ" * 300  # 300 one-letter words, 600 characters once lower-cased
    text = "\n".join([filler, "x" * 299, QUOTE, "y" * 399])
    assert decontaminate.pieces(text, shares_quote(text)) == [f"{filler}\n{'x' * 100}", "y" * 200]


def test_max_docs_counts_source_documents_before_the_cut() -> None:
    """--max-docs 2 of [a book cut into two pieces, b, c] keeps both pieces and b (prepare applies Corpus.first
    before decontaminate.without_overlap)."""
    from data_prep import decontaminate
    from data_prep.documents import Corpus, Document, Skips

    quote = " ".join(f"q{i}" for i in range(13))
    book = Document("a", f"{'x' * 499}\n{quote}\n{'y' * 499}")
    corpus = Corpus("text", ["a", "b", "c"], lambda skips: iter([book, Document("b", "bee"), Document("c", "sea")]))
    cut = decontaminate.without_overlap(corpus.first(2), np.unique(doc_hashes.sequence_hashes(quote)))
    skips = Skips()
    assert list(cut.read(skips)) == [Document("a", "x" * 300), Document("a", "y" * 300), Document("b", "bee")]
    assert skips.counts == {decontaminate.CUT: 1}


def test_sequence_hashes_are_the_documented_rolling_hash_with_splitmix64s_finaliser() -> None:
    """train_ngrams.u64 outlives the code that wrote it: the hash of a 13-word sequence, written out here from the
    module doc in Python integers (blake2b-64 of each lower-cased word, h = h * 0x9E3779B97F4A7C15 + w mod 2^64,
    then splitmix64's finaliser), must not drift, or earlier preparations stop matching."""
    import hashlib

    from data_prep.doc_hashes import sequence_hashes

    def expected(words: list[str]) -> int:
        h, mask = 0, 2**64 - 1
        for word in words:
            w = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8, person=b"word").digest(), "little")
            h = (h * 0x9E3779B97F4A7C15 + w) & mask
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            h = ((h ^ (h >> shift)) * mult) & mask
        return h ^ (h >> 31)

    words = [f"w{i}" for i in range(15)]
    got = sequence_hashes("  ".join(words).upper() + "!")  # lower-cased \w+ words: 3 sequences of 13
    assert got.tolist() == [expected(words[i : i + 13]) for i in range(3)]


def test_ngram_hashes_are_a_content_defined_sample_of_word_sequences() -> None:
    """Sequences are of lower-cased \\w+ words (case and punctuation do not matter); one in KEEP_ONE_IN is kept,
    and a sequence is kept or not by its own words, so an excerpt's sample is part of the whole text's."""
    lines = np.random.default_rng(3).permutation(4800).reshape(400, 12)
    text = "\n".join(" ".join(f"w{i}" for i in line) for line in lines)
    every = doc_hashes.ngram_hashes(text, keep_one_in=1)
    assert len(every) == 4800 - 12  # distinct words, distinct sequences
    sample = doc_hashes.ngram_hashes(text)
    assert set(sample.tolist()) == {h for h in every.tolist() if h % doc_hashes.KEEP_ONE_IN == 0}
    assert 0.5 < len(sample) * doc_hashes.KEEP_ONE_IN / len(every) < 1.5
    excerpt = " ".join(text.split()[1000:1600])
    assert set(doc_hashes.ngram_hashes(excerpt).tolist()) <= set(sample.tolist())
    assert len(doc_hashes.ngram_hashes(excerpt)) > 0
    shouted = text.upper().replace(" ", ", ")
    assert np.array_equal(doc_hashes.ngram_hashes(shouted), sample)
    twice = doc_hashes.ngram_hashes(text + "\n" + text)  # a repeated passage: its sequences once, sorted
    assert np.array_equal(twice, np.unique(twice)) and set(twice.tolist()) >= set(sample.tolist())
    assert len(twice) < 2 * len(sample)
    assert len(doc_hashes.ngram_hashes("twelve words " * 6, keep_one_in=1)) == 0  # fewer than 13 words
    other = doc_hashes.ngram_hashes(text.replace("w1", "v1"))  # every sequence holding a word w1... changed
    assert 0 < np.isin(other, sample).sum() < len(sample)


def test_tiny_corpus_forces_one_validation_document() -> None:
    splitter = Splitter(0.01)
    ids = [f"doc{i}" for i in range(5) if Splitter(0.01).by_hash(f"doc{i}") == "train"]
    for doc_id in ids:
        splitter.observe(doc_id)
    splitter.finalize()
    assert [splitter(d) for d in ids].count("val") == 1 and len(splitter.forced) == 1
    lone = Splitter(0.5)
    lone.observe("only")
    with pytest.raises(DataError, match="at least 2 distinct documents for a train/validation split; found 1$"):
        lone.finalize()
    copies = Splitter(0.5)
    for _ in range(5):
        copies.observe("same text")
    with pytest.raises(DataError, match=r"at least 2 distinct documents .*; found 5, all with one id \(the same text, "
                                        r"or the pieces --exclude-overlap cut from one document\)$"):
        copies.finalize()


def test_a_refused_first_preparation_leaves_no_empty_out_directory(tmp_path: Path) -> None:
    """One document is too few for a train/validation split: refused in one line, and the --out directory the
    preparation created is gone again; an --out that existed before stays."""
    src = write_texts(tmp_path / "src", {"only.txt": words(0, 40)})
    for out, existed in ((tmp_path / "new", False), (tmp_path / "old", True)):
        if existed:
            out.mkdir()
        with pytest.raises(DataError, match="at least 2 distinct documents"):
            prepare("text", str(src), out, vocab_size=500, **QUIET)
        assert out.is_dir() == existed


def test_an_out_holding_other_files_is_refused_and_foreign_files_are_never_deleted(tmp_path: Path) -> None:
    """An --out that holds no preparation but other files (a shard-like train_backup.bin among them, or only a
    tokenizer.model: a preparation records its own first) is refused in one line, every file untouched; files added
    to a prepared --out survive a rerun with --overwrite and new settings."""
    src = write_texts(tmp_path / "src", {f"d{i:02d}.txt": words(i, 40) for i in range(12)})
    other = tmp_path / "other"
    other.mkdir()
    for name in ("train_backup.bin", "val_old.bin", "tokenizer.model", "notes.txt"):
        (other / name).write_bytes(name.encode())
    with pytest.raises(DataError, match=r"^--out .*other holds files that are no preparation's \(notes.txt, "
                                        r"tokenizer.model, train_backup.bin, ...\); choose an empty or new directory$"):
        prepare("text", str(src), other, vocab_size=500, val_fraction=0.2, **QUIET)
    assert sorted((p.name, p.read_bytes()) for p in other.iterdir()) == sorted(
        (n, n.encode()) for n in ("train_backup.bin", "val_old.bin", "tokenizer.model", "notes.txt"))
    for name in ("train_backup.bin", "val_old.bin", "notes.txt"):
        (other / name).unlink()
    with pytest.raises(DataError, match=r"^--out .*other holds files that are no preparation's \(tokenizer.model\)"):
        prepare("text", str(src), other, vocab_size=500, val_fraction=0.2, **QUIET)
    assert (other / "tokenizer.model").read_bytes() == b"tokenizer.model"
    out = tmp_path / "out"
    prepare("text", str(src), out, vocab_size=500, val_fraction=0.2, **QUIET)
    (out / "train_backup.bin").write_bytes(b"mine")
    index = prepare("text", str(src), out, vocab_size=520, val_fraction=0.2, overwrite=True, **QUIET)
    assert index["vocab_size"] == 520 and (out / "train_backup.bin").read_bytes() == b"mine"


def test_resume_skips_finished_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_texts(tmp_path / "src", {f"d{i:02d}.txt": words(i, 40) for i in range(16)})
    kw = dict(vocab_size=500, val_fraction=0.2, shard_tokens=800, **QUIET)
    reference = prepare("text", str(src), tmp_path / "ref", **kw)
    n_shards = sum(len(reference["splits"][s]["shards"]) for s in ("train", "val"))
    assert n_shards >= 5

    real_write, written = shards.write_shard, []

    def write_then_maybe_die(path: Path, tokens: np.ndarray) -> str:
        if die_after is not None and len(written) == die_after:
            raise KeyboardInterrupt
        digest = real_write(path, tokens)
        written.append(path.name)
        return digest

    monkeypatch.setattr(shards, "write_shard", write_then_maybe_die)
    die_after = 3
    with pytest.raises(KeyboardInterrupt):
        prepare("text", str(src), tmp_path / "out", **kw)
    first = {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in written}
    assert not (tmp_path / "out/index.json").exists() and len(first) == 3

    killed_write = tmp_path / "out" / ".train_00003.bin.tmp999"  # what kill -9 in atomic_write leaves (no finally)
    killed_write.write_bytes(b"\0" * 600)
    die_after, written = None, []
    resumed = prepare("text", str(src), tmp_path / "out", **kw)
    assert not killed_write.exists()
    assert len(written) == n_shards - 3 and not set(written) & set(first)  # only the missing shards were written
    assert {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in first} == first
    assert resumed == reference
    for name in [s["file"] for split in ("train", "val") for s in reference["splits"][split]["shards"]] + \
            [reference["train_documents"]]:  # the documents of shards finished before the kill are recorded too
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()

    written = []
    assert prepare("text", str(src), tmp_path / "out", **kw) == reference and written == []  # finished: no work
    with pytest.raises(DataError, match=r"other settings \(vocab_size: 500 -> 400\); pass --overwrite"):
        prepare("text", str(src), tmp_path / "out", **{**kw, "vocab_size": 400})
    assert prepare("text", str(src), tmp_path / "out", overwrite=True, **{**kw, "vocab_size": 400})["vocab_size"] == 400


def test_batches_sent_mid_stream_give_the_same_preparation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents are tokenised in batches sent as soon as they reach ENCODE_BATCH_CHARS characters (4M: a single
    batch in the other tests): batches of two or three documents, across shards of one or two documents (so batches
    straddle shard ends), give byte for byte the output directory of a single batch."""
    src = write_texts(tmp_path / "src", {f"d{i:02d}.txt": words(i, 2 + i % 5) for i in range(30)})
    kw = dict(vocab_size=500, val_fraction=0.2, shard_tokens=150, **QUIET)
    batches: list[list[int]] = []
    encode = tokenizer.encode_documents

    def spy(sp: object, texts: list[str], threads: int) -> list[np.ndarray]:
        batches.append([len(t) for t in texts])
        return encode(sp, texts, threads)

    monkeypatch.setattr(tokenizer, "encode_documents", spy)
    prepare("text", str(src), tmp_path / "one", **kw)
    assert len(batches) == 1
    batches.clear()
    monkeypatch.setattr("data_prep.prepare.ENCODE_BATCH_CHARS", 700)
    index = prepare("text", str(src), tmp_path / "many", **kw)
    *sent, last = batches
    assert all(sum(b) >= 700 > sum(b[:-1]) for b in sent) and sum(last) < 700  # each sent once it reaches 700
    assert sum(map(len, batches)) == 30 and len(sent) >= 10
    assert sum(len(index["splits"][split]["shards"]) for split in ("train", "val")) > len(batches)
    one = {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()}
    assert {p.name: p.read_bytes() for p in (tmp_path / "many").iterdir()} == one and "index.json" in one


def test_shards_of_an_earlier_preparation_that_the_new_one_does_not_list_are_removed(tmp_path: Path) -> None:
    """A preparation whose index.json is gone is prepared afresh over its files: with larger shards there are fewer
    of them, and the earlier run's train_/val_ shards beyond them are removed at the end, so that --out holds
    exactly a fresh preparation's shards (files of other names stay)."""
    src = write_texts(tmp_path / "src", {f"d{i:02d}.txt": words(i, 40) for i in range(12)})
    kw = dict(vocab_size=500, val_fraction=0.2, **QUIET)
    out = tmp_path / "out"
    small = prepare("text", str(src), out, shard_tokens=800, **kw)
    assert len(small["splits"]["train"]["shards"]) >= 3 and len(small["splits"]["val"]["shards"]) >= 2
    (out / "index.json").unlink()
    (out / "notes_00001.bin").write_bytes(b"mine")
    large = prepare("text", str(src), out, shard_tokens=100_000, **kw)
    assert [len(large["splits"][split]["shards"]) for split in ("train", "val")] == [1, 1]
    fresh = tmp_path / "fresh"
    assert prepare("text", str(src), fresh, shard_tokens=100_000, **kw) == large
    assert sorted(p.name for p in out.glob("*.bin")) == ["notes_00001.bin", "train_00000.bin", "val_00000.bin"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "notes_00001.bin"} == \
        {p.name: p.read_bytes() for p in fresh.iterdir()}


@pytest.mark.parametrize("name", ["index.json", "progress.json"])
def test_an_unreadable_record_is_a_preparation_with_unknown_settings(name: str, tmp_path: Path) -> None:
    """An index.json or progress.json that holds no JSON object (cut short by a full disk, say, or a list) makes --out
    hold a preparation of unknown settings: a rerun stops with one line saying so and asking for --overwrite, which
    then prepares it afresh."""
    src = write_texts(tmp_path / "src", {f"d{i:02d}.txt": words(i, 40) for i in range(6)})
    kw = dict(vocab_size=500, val_fraction=0.2, **QUIET)
    out = tmp_path / "out"
    index = prepare("text", str(src), out, **kw)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    for unreadable in ('{"settings": {"source": "te', "[]"):
        (out / name).write_text(unreadable)
        with pytest.raises(DataError, match=rf"^--out {re.escape(str(out))} holds a preparation with an unreadable "
                                            rf"{name} \(no settings in it\); pass --overwrite to replace it, or choose "
                                            r"another --out$"):
            prepare("text", str(src), out, **kw)
    assert prepare("text", str(src), out, overwrite=True, **kw) == index
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


def test_builtin_source(tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    from data_prep.builtin import sections
    from data_prep.doc_hashes import sequence_hashes

    out = tmp_path / "builtin"
    index = prepare("builtin", None, out, vocab_size=2000, val_fraction=0.05, **QUIET)
    train, val = documents_of(out, "train"), documents_of(out, "val")
    # every topic with text, except those that are sections of a larger topic (their text is in it)
    kept = [t for name, t in topics.items() if t.strip() and name not in sections(topics)]
    assert sorted(train + val) == sorted(kept) and len(kept) < len([t for t in topics.values() if t.strip()])
    assert index["sources"] == ["pydoc_data.topics"] and index["splits"]["train"]["tokens"] > 50_000
    # no validation topic shares a 13-word sequence with training (the sections used to: "try" of "compound")
    seen = set().union(*(sequence_hashes(t).tolist() for t in train))
    assert val and not any(set(sequence_hashes(t).tolist()) & seen for t in val)
    assert "compound" in topics and "try" in topics and "try" in sections(topics)


def test_a_utf8_byte_order_mark_is_not_text(tmp_path: Path) -> None:
    """A file saved with a UTF-8 BOM (common from Windows editors) reads without it, plain or gzipped."""
    from data_prep.local_files import read_text

    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello\nworld")
    (tmp_path / "bom.txt.gz").write_bytes(gzip.compress(b"\xef\xbb\xbfhello"))
    assert read_text(tmp_path / "bom.txt", Skips()) == "hello\nworld"
    assert read_text(tmp_path / "bom.txt.gz", Skips()) == "hello"


def test_the_tokenizer_sample_cuts_long_lines() -> None:
    """A C4 paragraph can be one line of many kilobytes (SentencePiece skips very long sentences): the sample keeps
    its first MAX_LINE_CHARS characters."""
    from data_prep.sample import MAX_LINE_CHARS, LineSampler

    sampler = LineSampler(100_000)
    sampler.add("d", "short line\n" + "x" * (3 * MAX_LINE_CHARS))
    assert sorted(map(len, sampler.lines())) == [len("short line"), MAX_LINE_CHARS]
    blank = LineSampler(100)
    blank.add("d", "a\n   \n\t\n\nb")  # lines of whitespace only are no sample text
    assert sorted(blank.lines()) == ["a", "b"]


def test_the_tokenizer_sample_is_the_lowest_key_lines_whatever_the_order() -> None:
    """Bottom-k sampling: with lines of one length, a full sample holds exactly the max_chars // length lines of
    lowest key (those `lines()` lists first when every line fits), whatever the order lines and documents come in;
    a line that arrives when the sample is full and has a higher key than every line in it is not taken."""
    from data_prep.sample import LineSampler

    lines = [f"line {i:03d}" for i in range(200)]  # 8 characters each
    everything = LineSampler(10**6)
    everything.add("all", "\n".join(lines))
    by_key = everything.lines()
    assert sorted(by_key) == lines
    for order in (by_key, by_key[::-1], *(np.random.default_rng(seed).permutation(lines).tolist() for seed in (0, 1))):
        sampler = LineSampler(30 * 8 + 7)
        for start in range(0, 200, 20):  # ten documents of 20 lines
            sampler.add(f"doc{start}", "\n".join(order[start:start + 20]))
        assert sampler.lines() == by_key[:30] and sampler.chars == 30 * 8


def test_decoding_no_tokens_gives_no_documents() -> None:
    """tokenizer.decode splits a token sequence into documents at EOS: none in an empty sequence, one empty document
    in a lone EOS, an unfinished one after the last EOS."""
    sp = tokenizer.load(tokenizer.train(words(1, 60).splitlines(), 400, threads=1))
    tokens = tokenizer.encode_documents(sp, ["one doc", "two"], threads=1)
    assert tokenizer.decode(sp, []) == [] and tokenizer.decode(sp, np.zeros(0, np.uint16)) == []
    assert tokenizer.decode(sp, [tokenizer.EOS_ID]) == [""]
    assert tokenizer.decode(sp, np.concatenate([tokens[0], tokens[1][:-1]])) == ["one doc", "two"]


def test_builtin_sections_are_topics_inside_a_larger_one_and_a_short_topic_is_none() -> None:
    """pydoc topics whose every 13-word sequence is in a larger topic are sections of it (left out, their text is
    there); a topic too short to hold one sequence is not a section of everything."""
    from data_prep.builtin import sections

    long = " ".join(f"word{i}" for i in range(40))
    part = " ".join(f"word{i}" for i in range(5, 25))
    assert sections({"whole": long, "part": part, "short": "too short a text", "other": "a b c " * 10}) == {"part"}


# ---------------------------------------------------------------- bad input: one line, exit code 2


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    code = main([*args, "--no-progress", "--threads", "1"])
    err = capsys.readouterr().err.strip()
    return code, err


def test_cli_writes_no_progress_frames_to_a_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Without --no-progress but with stderr not a terminal (a log file, here pytest's capture), no tqdm frames:
    only the summary line."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"d{i}.txt").write_text(words(i, 40), encoding="utf-8")
    assert main(["--source", "text", "--src", str(src), "--out", str(tmp_path / "o"), "--vocab-size", "400",
                 "--val-fraction", "0.3", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "%|" not in captured.err and "\r" not in captured.err and "prepared" in captured.out + captured.err


def test_missing_path_and_no_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = run_cli(capsys, "--source", "gutenberg", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert code == 2 and err == f"error: {tmp_path / 'nope'}: no such file or directory"
    (tmp_path / "notes.md").write_text("not a book")
    code, err = run_cli(capsys, "--source", "c4", "--src", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 2 and "\n" not in err
    assert err.startswith(f"error: {tmp_path}: no C4 JSON-lines files (*.json.gz")


def test_cli_subprocess_prints_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "data_prep.prepare", "--source", "text", "--src", str(tmp_path / "x"),
                           "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'x'}: no such file or directory"]


def test_empty_and_undecodable_files_are_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = write_texts(tmp_path / "src", {f"d{i}.txt": words(i, 20) for i in range(6)})
    (src / "blank.txt").write_text("  \n\n")
    (src / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (src / "broken.txt.gz").write_bytes(b"\x1f\x8b not really gzip")
    (src / "utf16.txt").write_bytes(words(7, 20).encode("utf-16-le"))  # no BOM: valid UTF-8, every other byte NUL
    index = prepare("text", str(src), tmp_path / "out", vocab_size=500, val_fraction=0.3, **QUIET)
    assert index["skipped"]["skipped_files"] == 4
    assert index["skipped"]["skipped_files_by_reason"] == {"empty": 1, "undecodable": 2, "unreadable": 1}
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 6
    err = capsys.readouterr().err
    assert "warning: skipped latin1.txt: undecodable (not UTF-8: byte 3)" in err
    assert "warning: skipped utf16.txt: undecodable (50% NUL characters: UTF-16 without a BOM, or binary)" in err
    assert err.count("warning: skipped blank.txt: empty") == 1  # once, although both passes read it


def test_nothing_usable_left(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    code, err = run_cli(capsys, "--source", "text", "--src", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 2
    assert err.splitlines()[-1] == "error: no usable documents in bad.txt, empty.txt (2 inputs; skipped files: " \
                                   "1 empty, 1 undecodable)"


def test_vocab_too_large_and_too_small(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = write_texts(tmp_path / "src", {"a.txt": "the quick brown fox\n" * 20, "b.txt": "jumps over a lazy dog\n" * 20})
    args = ("--source", "text", "--src", str(src), "--out", str(tmp_path / "o"), "--vocab-size")
    code, err = run_cli(capsys, *args, "5000")
    assert code == 2 and "\n" not in err
    assert err.startswith("error: --vocab-size 5000 is too large for this corpus: its tokenizer sample (")
    assert err.endswith("pieces; lower --vocab-size or give more text (documents, --sample-chars)")
    code, err = run_cli(capsys, *args, "260")
    assert code == 2 and err.startswith("error: --vocab-size 260 is too small: this corpus needs at least ")
    code, err = run_cli(capsys, *args, "70000")
    assert code == 2 and err == ("error: --vocab-size must be in 259..65536 (3 special and 256 byte pieces at least; "
                                 "tokens are stored as uint16), got 70000")
    tokenizer.check_vocab_size(65536)  # ids 0 .. 65535 fit uint16: the largest allowed, as model.vocab_size allows
    tokenizer.check_vocab_size(259)
    for bad in (65537, 258, 1, 0):  # below 259 SentencePiece itself failed with an internal error
        with pytest.raises(DataError, match=f"^--vocab-size must be in 259..65536 .*, got {bad}$"):
            tokenizer.check_vocab_size(bad)


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_must_be_positive(threads: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = write_texts(tmp_path / "src", {"a.txt": words(1, 20), "b.txt": words(2, 20)})
    code = main(["--source", "text", "--src", str(src), "--out", str(tmp_path / "o"), "--no-progress",
                 "--threads", threads])
    assert code == 2 and capsys.readouterr().err.strip() == f"error: --threads must be a positive integer, got {threads}"


@pytest.mark.parametrize("fraction", ["0", "1", "1.5", "-0.1"])
def test_val_fraction_must_be_inside_0_1(fraction: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--val-fraction outside the open interval (0, 1): one line, exit 2, nothing written."""
    src = write_texts(tmp_path / "src", {"a.txt": words(1, 20), "b.txt": words(2, 20)})
    code, err = run_cli(capsys, "--source", "text", "--src", str(src), "--out", str(tmp_path / "o"),
                        "--vocab-size", "400", "--val-fraction", fraction)
    assert code == 2 and err == f"error: --val-fraction must be in (0, 1), got {float(fraction)}"
    assert not (tmp_path / "o").exists()


def test_out_that_is_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--out naming an existing file: one line, exit 2, the file untouched."""
    src = write_texts(tmp_path / "src", {"a.txt": words(1, 20), "b.txt": words(2, 20)})
    (tmp_path / "o").write_text("my notes")
    code, err = run_cli(capsys, "--source", "text", "--src", str(src), "--out", str(tmp_path / "o"),
                        "--vocab-size", "400")
    assert code == 2 and err == f"error: --out {tmp_path / 'o'} exists and is not a directory"
    assert (tmp_path / "o").read_text() == "my notes"


def test_an_unknown_source_or_a_local_one_without_src_is_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """prepare() with a --source name the CLI's choices would refuse, and a local source without --src (through the
    CLI): one line naming the choices / what --src must be, nothing written."""
    with pytest.raises(DataError, match=r"^--source 'wiki': choose one of gutenberg, c4, text, builtin, c4-hub, "
                                        r"gutenberg-hub$"):
        prepare("wiki", str(tmp_path), tmp_path / "o", **QUIET)
    for source in ("gutenberg", "c4", "text"):
        code, err = run_cli(capsys, "--source", source, "--out", str(tmp_path / "o"))
        assert code == 2 and err == f"error: --source {source} needs --src DIR (a directory of input files)"
    assert not (tmp_path / "o").exists()


def test_empty_tokenizer_sample_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = write_texts(tmp_path / "src", {"a.txt": words(1, 20), "b.txt": words(2, 20)})
    code, err = run_cli(capsys, "--source", "text", "--src", str(src), "--out", str(tmp_path / "o"),
                        "--sample-chars", "1")
    assert code == 2 and err == ("error: the tokenizer sample is empty (no training line fits in --sample-chars); "
                                 "raise --sample-chars or lower --val-fraction")


def test_document_forced_into_train_feeds_the_tokenizer(tmp_path: Path) -> None:
    """With --val-fraction 0.99 both documents hash to validation; the one forced into train is sampled."""
    texts = {"a.txt": words(1, 20), "b.txt": words(2, 20)}
    assert all(Splitter(0.99).by_hash(name) == "val" for name in texts)
    src = write_texts(tmp_path / "src", texts)
    index = prepare("text", str(src), tmp_path / "out", vocab_size=400, val_fraction=0.99, **QUIET)
    [(forced, split)] = index["forced_split"].items()
    assert split == "train" and documents_of(tmp_path / "out", "train") == [texts[forced]]
    assert documents_of(tmp_path / "out", "val") == [t for name, t in texts.items() if name != forced]


def test_the_tokenizer_is_trained_on_training_documents_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer sample (every line fits in --sample-chars here) is exactly the lines of the documents in the
    training split: a validation document's text never shapes the vocabulary its loss is measured in."""
    texts = {f"d{i:02d}.txt": words(i, 6) for i in range(12)}
    val = {n for n in texts if Splitter(0.25).by_hash(n) == "val"}
    assert val and len(val) < len(texts)
    seen: list[list[str]] = []
    real = tokenizer.train
    monkeypatch.setattr(tokenizer, "train", lambda lines, *a, **k: seen.append(list(lines)) or real(lines, *a, **k))
    prepare("text", str(write_texts(tmp_path / "src", texts)), tmp_path / "out", vocab_size=500, val_fraction=0.25,
            **QUIET)
    [sample] = seen
    assert sorted(sample) == sorted(line for n, t in texts.items() if n not in val for line in t.split("\n"))


def test_tokenizer_bytes_do_not_depend_on_threads(tmp_path: Path) -> None:
    src = write_texts(tmp_path / "src", {f"d{i}.txt": words(i, 30) for i in range(6)})
    kw = dict(vocab_size=500, val_fraction=0.2, progress=False)
    one = prepare("text", str(src), tmp_path / "t1", threads=1, **kw)
    two = prepare("text", str(src), tmp_path / "t2", threads=2, **kw)
    assert (tmp_path / "t1/tokenizer.model").read_bytes() == (tmp_path / "t2/tokenizer.model").read_bytes()
    assert one == two


def test_input_hashing_has_a_progress_bar_and_its_own_time(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = write_texts(tmp_path / "src", {f"d{i}.txt": words(i, 30) for i in range(4)})
    size = sum(p.stat().st_size for p in src.iterdir())
    prepare("text", str(src), tmp_path / "out", vocab_size=400, val_fraction=0.3, threads=1, progress=True)
    out, err = capsys.readouterr()
    total = tqdm.format_sizeof(size, divisor=1024)  # the bar counts the bytes of every input file
    assert re.search(rf"\rhash: 100%\|[^\r\n]*\| {re.escape(total)}/{re.escape(total)} \[", err)
    assert re.search(r"s \(hash [\d.]+s, scan [\d.]+s, tokenizer [\d.]+s, tokenise [\d.]+s\)$", out.strip())
    prepare("text", str(src), tmp_path / "quiet", vocab_size=400, val_fraction=0.3, **QUIET)
    assert "hash" not in capsys.readouterr().err


def test_broken_json_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = [json.dumps({"text": words(200 + i, 3), "timestamp": None, "url": None}) for i in range(30)]
    lines = (good[:5] + ["", "  \t "] + good[5:10] + ['{"text": "unterminated', "not json at all", "[1, 2]"] + good[10:]
             + [json.dumps({"url": "x"})])  # blank and whitespace-only lines are no rows, not broken ones
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.json.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    (tmp_path / "src" / "b.json").write_text("garbage\n{broken\n")
    index = prepare("c4", str(tmp_path / "src"), tmp_path / "out", vocab_size=500, val_fraction=0.2, **QUIET)
    assert index["skipped"]["broken_json_lines"] == 5 and index["skipped"]["rows_without_text"] == 1
    assert index["skipped"]["skipped_files_by_reason"] == {"no valid JSON lines": 1}
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 30
    err = capsys.readouterr().err
    assert "warning: a.json.gz: 3 broken JSON line(s), first at line 13 (skipped)" in err
    # a row without "text" (a misnamed field?) is reported too, once although both passes read it
    assert err.count('warning: a.json.gz: 1 row(s) without a string "text" field, first at line 36 (skipped)') == 1


def test_an_unreadable_c4_file_is_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A .json.gz that is no gzip stream, and one cut off before its first complete row, are skipped as "unreadable"
    (not truncated files: nothing was kept), each warned once with the error although both passes read it; the
    other files are prepared."""
    rows = [words(500 + i, 3) for i in range(20)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in rows).encode()))
    (src / "b.json.gz").write_bytes(b"not gzip at all\n")
    (src / "c.json.gz").write_bytes(gzip.compress((json.dumps({"text": words(9, 40)}) + "\n").encode())[:200])
    out = tmp_path / "out"
    index = prepare("c4", str(src), out, vocab_size=500, val_fraction=0.2, **QUIET)
    assert index["skipped"] == {"skipped_files": 2, "skipped_files_by_reason": {"unreadable": 2}}
    assert sorted(documents_of(out, "train") + documents_of(out, "val")) == sorted(rows)
    err = capsys.readouterr().err
    assert err.count("warning: skipped b.json.gz: unreadable (BadGzipFile: Not a gzipped file") == 1
    assert err.count("warning: skipped c.json.gz: unreadable (EOFError: Compressed file ended before the "
                     "end-of-stream marker was reached)\n") == 1


def test_max_docs_reports_the_problems_of_the_part_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--max-docs stops in the middle of a file: its broken lines and rows without text up to there are still
    counted and warned about (the readers reported them only at the end of a file, which they never reached)."""
    good = [json.dumps({"text": words(300 + i, 3)}) for i in range(40)]
    lines = good[:5] + ["{broken", "not json", json.dumps({"content": "x"})] + good[5:]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text("\n".join(lines) + "\n")
    index = prepare("c4", str(tmp_path / "src"), tmp_path / "out", max_docs=20, vocab_size=400, val_fraction=0.2,
                    **QUIET)
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 20
    assert index["skipped"]["broken_json_lines"] == 2 and index["skipped"]["rows_without_text"] == 1
    err = capsys.readouterr().err
    assert err.count("warning: a.jsonl: 2 broken JSON line(s), first at line 6 (skipped)") == 1
    assert err.count('warning: a.jsonl: 1 row(s) without a string "text" field, first at line 8 (skipped)') == 1


def test_strict_reading_reports_the_first_problem_in_line_order(tmp_path: Path) -> None:
    """Inputs read whole (StrictSkips: evaluation text, texts to exclude) stop at the first problem of a file: a
    broken line 2 is reported before a row without text at line 4 (it used to be the other way round, as broken
    lines were only reported at the end of the file)."""
    from data_prep.documents import StrictSkips

    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{broken\n{"text": "also fine"}\n{"url": "no text"}\n')
    with pytest.raises(DataError, match=r"^a\.jsonl: broken JSON line 2; nothing was done$"):
        list(c4.numbered_documents(c4.file_rows(path, StrictSkips()), StrictSkips(), "a.jsonl: line"))
    path.write_text('{"text": "fine"}\n{"url": "no text"}\n{broken\n')
    with pytest.raises(DataError, match=r'^a\.jsonl: line 2 has no string "text" field; nothing was done$'):
        list(c4.numbered_documents(c4.file_rows(path, StrictSkips()), StrictSkips(), "a.jsonl: line"))


def test_unencodable_text_is_a_broken_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Valid JSON whose "text" has an escaped lone surrogate cannot be UTF-8 encoded: skipped and counted."""
    good = [json.dumps({"text": words(400 + i, 3)}) for i in range(8)]
    lines = good[:3] + ['{"text": "hello \\ud83d world"}', '{"text": "x \\udc00"}'] + good[3:]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text("\n".join(lines) + "\n")
    index = prepare("c4", str(tmp_path / "src"), tmp_path / "out", vocab_size=400, val_fraction=0.2, **QUIET)
    assert index["skipped"]["broken_json_lines"] == 2
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 8
    err = capsys.readouterr().err
    assert err.count("warning: a.jsonl: 2 broken JSON line(s), first at line 4 (skipped)") == 1


def test_no_usable_documents_names_the_skipped_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [json.dumps({"content": f"row {i}"}) for i in range(100)] + ['{"text": "  "}', "{broken"]
    (tmp_path / "a.jsonl").write_text("\n".join(rows) + "\n")
    code, err = run_cli(capsys, "--source", "c4", "--src", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 2 and err.splitlines()[-1] == (
        'error: no usable documents in a.jsonl (1 inputs; skipped files: none; 1 broken JSON lines; '
        '1 empty documents; 100 rows without a string "text" field)')


def test_rerun_checks_inputs_and_redoes_damaged_shards(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """index.json records every input (size, SHA-256) and every shard's SHA-256. A rerun after an input was
    edited, removed or added is refused with one line; a finished shard damaged since (other bytes of the same
    size, cut short, deleted) is redone with the shards after it in its split, warned with what was wrong, giving
    the same bytes as before."""
    src = write_texts(tmp_path / "src", {f"d{i:02d}.txt": words(i, 40) for i in range(12)})
    kw = dict(vocab_size=500, val_fraction=0.2, shard_tokens=800, **QUIET)
    out = tmp_path / "out"
    index = prepare("text", str(src), out, **kw)
    assert set(index["inputs"]) == {f"d{i:02d}.txt" for i in range(12)}
    assert index["inputs"]["d00.txt"]["sha256"] == hashlib.sha256((src / "d00.txt").read_bytes()).hexdigest()
    shards_ = index["splits"]["train"]["shards"]
    assert len(shards_) >= 3 and all(s["sha256"] == hashlib.sha256((out / s["file"]).read_bytes()).hexdigest()
                                     for s in shards_)
    before = {s["file"]: (out / s["file"]).read_bytes() for s in shards_}

    damaged, size = out / shards_[1]["file"], 2 * shards_[1]["tokens"]
    for tamper, problem in ((lambda: damaged.write_bytes(bytes(size)), "SHA-256 mismatch"),
                            (lambda: damaged.write_bytes(before[damaged.name][:-2]),
                             f"{size - 2} bytes, expected {size}"),
                            (damaged.unlink, "missing")):
        tamper()
        capsys.readouterr()
        assert prepare("text", str(src), out, **kw) == index
        assert f"{damaged.name}: {problem}; redoing it and the train shards after it" in capsys.readouterr().err
        assert {s["file"]: (out / s["file"]).read_bytes() for s in shards_} == before

    # the tokenizer every shard depends on, and the hash files the index names, are checked too: replaced by
    # another preparation's tokenizer or missing, the rerun stops; with --overwrite it prepares the same bytes
    other = prepare("text", str(src), tmp_path / "other", **{**kw, "vocab_size": 400})
    assert other["tokenizer_sha256"] != index["tokenizer_sha256"]
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    swapped = (tmp_path / "other" / "tokenizer.model").read_bytes()
    for tamper, problem in ((lambda: (out / "tokenizer.model").write_bytes(swapped),
                             "tokenizer.model is not the one its shards were made with"),
                            (lambda: (out / "tokenizer.model").unlink(), "tokenizer.model is missing"),
                            (lambda: (out / "train_ngrams.u64").unlink(), "train_ngrams.u64 is missing")):
        tamper()
        with pytest.raises(DataError, match=f"^--out {out} holds a preparation whose {problem}.*; pass --overwrite "
                                            "to prepare it again$"):
            prepare("text", str(src), out, **kw)
        assert prepare("text", str(src), out, overwrite=True, **kw) == index
        assert {p.name: p.read_bytes() for p in out.iterdir()} == files

    (src / "d03.txt").unlink()
    edited = (src / "d04.txt").read_bytes()
    (src / "d04.txt").write_bytes(edited[:-1] + (b"y" if edited.endswith(b"x") else b"x"))  # same size: SHA-256 sees it
    (src / "new.txt").write_text(words(98, 40))
    with pytest.raises(DataError, match=r"^--out .* other inputs \(1 added \(new\.txt\), 1 removed \(d03\.txt\), "
                                        r"1 changed \(d04\.txt\)\); pass --overwrite"):
        prepare("text", str(src), out, **kw)
    assert set(prepare("text", str(src), out, overwrite=True, **kw)["inputs"]) == \
        {f"d{i:02d}.txt" for i in range(12) if i != 3} | {"new.txt"}


def test_max_docs_hashes_only_the_files_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-docs 30 of three C4 files of 20 rows reads a.jsonl and b.jsonl only: index.json records the size of all
    three and the SHA-256 of those two (a large local C4 was hashed whole for its first documents). A rerun hashes
    just those two; it is refused when a read file is edited (same size) or an unread one resized, not when an
    unread one is edited in place. Without --max-docs every file is read and hashed."""
    from data_prep import manifest

    src = tmp_path / "src"
    src.mkdir()
    for n, name in enumerate("abc"):
        (src / f"{name}.jsonl").write_text("".join(json.dumps({"text": words(20 * n + i, 30)}) + "\n"
                                                   for i in range(20)))
    hashed: list[str] = []  # the input files hashed (not the shards)
    real = manifest.sha256_file

    def recording(path: Path, *args) -> str:
        if path.parent == src:
            hashed.append(path.name)
        return real(path, *args)

    monkeypatch.setattr(manifest, "sha256_file", recording)
    kw = dict(max_docs=30, vocab_size=500, val_fraction=0.2, **QUIET)
    out = tmp_path / "out"
    index = prepare("c4", str(src), out, **kw)
    sha = {name: hashlib.sha256((src / name).read_bytes()).hexdigest() for name in ("a.jsonl", "b.jsonl")}
    assert index["inputs"] == {"a.jsonl": {"bytes": (src / "a.jsonl").stat().st_size, "sha256": sha["a.jsonl"]},
                               "b.jsonl": {"bytes": (src / "b.jsonl").stat().st_size, "sha256": sha["b.jsonl"]},
                               "c.jsonl": {"bytes": (src / "c.jsonl").stat().st_size}}
    assert sorted(hashed) == ["a.jsonl", "b.jsonl"]
    hashed.clear()
    assert prepare("c4", str(src), out, **kw) == index
    assert sorted(hashed) == ["a.jsonl", "b.jsonl"]
    hashed.clear()  # a run killed between writing index.json and removing progress.json left both: hashed once
    (out / "progress.json").write_text((out / "index.json").read_text())
    assert prepare("c4", str(src), out, **kw) == index
    assert sorted(hashed) == ["a.jsonl", "b.jsonl"]

    def flip_last_letter(path: Path) -> None:  # of the file's last document; same size: only the SHA-256 sees it
        *rows, last = path.read_text().splitlines(keepends=True)
        text = json.loads(last)["text"]
        size = path.stat().st_size
        path.write_text("".join(rows) + json.dumps({"text": text[:-1] + "yz"[text[-1] == "y"]}) + "\n")
        assert path.stat().st_size == size

    flip_last_letter(src / "c.jsonl")
    assert prepare("c4", str(src), out, **kw) == index  # not read: the same preparation
    flip_last_letter(src / "b.jsonl")
    with pytest.raises(DataError, match=r"other inputs \(1 changed \(b\.jsonl\)\); pass --overwrite"):
        prepare("c4", str(src), out, **kw)
    index = prepare("c4", str(src), out, overwrite=True, **kw)
    with open(src / "c.jsonl", "a") as f:
        f.write(json.dumps({"text": words(99, 30)}) + "\n")
    with pytest.raises(DataError, match=r"other inputs \(1 changed \(c\.jsonl\)\); pass --overwrite"):
        prepare("c4", str(src), out, **kw)
    hashed.clear()
    full = prepare("c4", str(src), tmp_path / "full", **{**kw, "max_docs": None})
    assert sorted(hashed) == ["a.jsonl", "b.jsonl", "c.jsonl"] and all("sha256" in v for v in full["inputs"].values())


def test_out_inside_src_is_not_read_as_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--out inside --src (C4 reads *.json, so the preparation's own index.json matched): a rerun finds the same
    inputs and the same preparation, with and without --overwrite."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": words(i, 30)}) + "\n" for i in range(20)))
    kw = dict(vocab_size=500, val_fraction=0.2, **QUIET)
    index = prepare("c4", str(src), src / "prepared", **kw)
    assert list(index["inputs"]) == ["a.jsonl"]
    assert prepare("c4", str(src), src / "prepared", **kw) == index
    assert prepare("c4", str(src), src / "prepared", overwrite=True, **kw) == index
    assert "warning" not in capsys.readouterr().err


def test_c4_checkout_with_both_splits_warns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--src at an allenai/c4 checkout (en/c4-train.*, en/c4-validation.*): one warning that the official
    validation documents join the corpus; one split's folder alone: silent."""
    from data_prep.sources import open_source

    for split in ("train", "validation"):
        (tmp_path / "en").mkdir(exist_ok=True)
        (tmp_path / "en" / f"c4-{split}.00000-of-00008.json.gz").write_bytes(
            gzip.compress((json.dumps({"text": words(7, 20)}) + "\n").encode()))
    open_source("c4", str(tmp_path))
    assert capsys.readouterr().err == ("warning: --src holds allenai/c4's train and validation files: both are read "
                                       "as one corpus and split by document hash, so the official validation "
                                       "documents are trained on; point --src at one split's folder\n")
    (tmp_path / "en" / "c4-validation.00000-of-00008.json.gz").unlink()
    open_source("c4", str(tmp_path))
    assert capsys.readouterr().err == ""


def test_hub_route_hashes_local_data_files(tmp_path: Path) -> None:
    """--data-files on disk are inputs like a local source's files: a rerun after one was replaced is refused (it said
    'already prepared', and a resumed run mixed shards of both versions)."""
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": words(i, 30)}) + "\n" for i in range(20)))
    kw = dict(data_files=str(path), vocab_size=500, val_fraction=0.2, **QUIET)
    index = prepare("c4-hub", "json", tmp_path / "out", **kw)
    assert index["inputs"] == {str(path): {"bytes": path.stat().st_size,
                                           "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}
    path.write_text("".join(json.dumps({"text": words(i, 30)}) + "\n" for i in range(20, 40)))
    with pytest.raises(DataError, match=rf"^--out .* holds a preparation with other inputs \(1 changed \({re.escape(str(path))}\)\)"):
        prepare("c4-hub", "json", tmp_path / "out", **kw)


def test_verify_reads_every_byte_and_names_each_problem(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """data_prep.verify: exit 0 on an intact preparation; 1 with one line per problem (a shard's bytes changed at
    the same size, which training's size check cannot see; a shard cut short; a tokenizer swapped; a hash file
    gone, or changed: against its recorded SHA-256, or without one its layout; a split's token total that its shards
    do not sum to); 2 with one line for a directory that holds no finished preparation, or an index of another
    format or structure (a shard entry naming a file outside the directory, tokens that are no integer). A shard
    whose index entry has no SHA-256 is warned about, its size still checked."""
    from data_prep.verify import main as verify

    src = write_texts(tmp_path / "src", {f"d{i:02d}.txt": words(i, 40) for i in range(8)})
    out = tmp_path / "out"
    index = prepare("text", str(src), out, vocab_size=500, val_fraction=0.2, shard_tokens=800, **QUIET)
    train, val = index["splits"]["train"]["shards"], index["splits"]["val"]["shards"]
    tokens = sum(s["tokens"] for s in train + val)
    capsys.readouterr()
    assert verify([str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out == (f"{out}: intact ({len(train) + len(val)} shards, {tokens:,} tokens; tokenizer "
                                       "and hash files as index.json records)\n")

    first, last = out / train[0]["file"], out / val[-1]["file"]
    first.write_bytes(bytes(2 * train[0]["tokens"]))  # same size, other bytes
    last.write_bytes(last.read_bytes()[:-2])
    (out / "tokenizer.model").write_bytes(b"another")
    (out / "train_documents.u64").unlink()
    ngrams = out / "train_ngrams.u64"
    ngrams.write_bytes(ngrams.read_bytes()[8:])  # one hash fewer: a valid layout, caught by its SHA-256
    assert verify([str(out)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "damaged: tokenizer.model is not the one its shards were made with (SHA-256 differs from index.json's)",
        "damaged: train_documents.u64 is missing",
        "damaged: train_ngrams.u64: SHA-256 mismatch",
        f"damaged: {first.name}: SHA-256 mismatch",
        f"damaged: {last.name}: {2 * val[-1]['tokens'] - 2} bytes, expected {2 * val[-1]['tokens']}",
        f"{out}: 5 problem(s); copy the damaged files again from where it was prepared, or rerun its data_prep.prepare "
        "command there (it redoes damaged shards; a damaged tokenizer or hash file with --overwrite)"]
    (out / "tokenizer.model").unlink()
    assert verify([str(out)]) == 1
    assert "damaged: tokenizer.model is missing" in capsys.readouterr().err

    prepare("text", str(src), out, vocab_size=500, val_fraction=0.2, shard_tokens=800, overwrite=True, **QUIET)
    capsys.readouterr()
    unhashed = json.loads((out / "index.json").read_text())
    del unhashed["splits"]["train"]["shards"][0]["sha256"]
    del unhashed["hash_files_sha256"]  # as before 2026-11-30: the hash files' layout is checked instead
    (out / "index.json").write_text(json.dumps(unhashed))
    first.write_bytes(bytes(2 * train[0]["tokens"]))  # unseen without its hash: only the size is checked
    assert verify([str(out)]) == 0
    assert capsys.readouterr().err == (f"warning: 1 shard(s) have no SHA-256 in the index ({first.name}): "
                                       "only their sizes are checked\n")
    hashes = (out / "train_documents.u64").read_bytes()
    for damage, problem in ((hashes[:-3], f"{len(hashes) - 3} bytes, not a whole number of 8-byte hashes"),
                            (hashes[8:] + hashes[:8], "its hashes are not sorted and distinct")):
        (out / "train_documents.u64").write_bytes(damage)
        assert verify([str(out)]) == 1
        assert f"damaged: train_documents.u64: {problem}\n" in capsys.readouterr().err
    (out / "train_documents.u64").write_bytes(hashes)
    recorded = unhashed["splits"]["val"]["tokens"]
    (out / "index.json").write_text(json.dumps({**unhashed, "splits": {
        "train": unhashed["splits"]["train"], "val": {**unhashed["splits"]["val"], "tokens": recorded + 1}}}))
    assert verify([str(out)]) == 1
    assert f"damaged: index.json: the val split records {recorded + 1} tokens, its shards {recorded}\n" in \
        capsys.readouterr().err
    for entry, shown in (({"file": "../../../etc/hostname", "tokens": 5}, "file '../../../etc/hostname'"),
                         ({"file": first.name, "tokens": "abc"}, "tokens 'abc'")):
        (out / "index.json").write_text(json.dumps({**unhashed, "splits": {
            "train": {**unhashed["splits"]["train"], "shards": [entry]}, "val": unhashed["splits"]["val"]}}))
        assert verify([str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {out / 'index.json'} is not a valid index (train: a shard entry's ") and shown in err

    (out / "index.json").write_text(json.dumps({**unhashed, "format": "data_prep/9"}))  # (its token totals agree)
    assert verify([str(out)]) == 2
    assert capsys.readouterr().err == (f"error: {out / 'index.json'} is format 'data_prep/9' with 'uint16' tokens; "
                                       "this version reads data_prep/1 to data_prep/2 with uint16 tokens\n")
    for directory, message in ((src, f"{src} holds no index.json: not a finished preparation"),
                               (tmp_path / "none", f"{tmp_path / 'none'} is not a directory")):
        assert verify([str(directory)]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
    (out / "index.json").write_text("{")
    assert verify([str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {out / 'index.json'} is not a valid index (JSONDecodeError")
