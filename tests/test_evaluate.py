"""Held-out evaluation (lm/scoring.py, lm/evaluate.py): sliding windows against plain forward passes,
bits per byte, App. F's k for short inputs, leak-free scoring of non-causal heads, every input format
and bad input. Tolerance for scores vs direct forward passes: max-abs 1e-5 nats (fp32; measured 0)."""
from __future__ import annotations

import gzip
import json
import os
import math
import shutil
from pathlib import Path

import pytest
import torch

from eval_setup import english, prepared_corpus, save_checkpoint
from lm.evaluate import main
from lm.leakfree import leak_free_logits
from lm.scoring import score

TOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_corpus(tmp_path_factory.mktemp("corpus"))


def nll_of(model, inputs: list[int], targets: list[int]) -> list[float]:
    with torch.no_grad():
        logp = model(torch.tensor([inputs])).log_softmax(-1)[0]
    return [-logp[i, t].item() for i, t in enumerate(targets)]


@pytest.mark.parametrize("n, first", [(60, 1), (53, 5), (20, 1)])
def test_sliding_window_matches_direct_forward(corpus: Path, tmp_path: Path, n: int, first: int) -> None:
    _, model = save_checkpoint(tmp_path, corpus, seq_len=24)
    x = torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    # stride = context: disjoint windows; the last one ends at n and keeps only the new targets
    disjoint = score(model, [x], [first], 24, 24)[0].nll.tolist()
    ref, s = [], first
    e = min(n, max(25, first + 24))
    while s < n:
        lo = max(0, e - 1 - 24)
        ref += nll_of(model, x[lo : e - 1], x[lo + 1 : e])[s - lo - 1 :]
        s, e = e, min(n, e + 24)
    assert len(disjoint) == n - first and max(abs(a - b) for a, b in zip(disjoint, ref)) <= TOL
    # stride 1: every target after the first window sees exactly `context` tokens of history
    full = score(model, [x], [first], 24, 1, batch_size=5)[0]
    head = nll_of(model, x[: min(n, 25) - 1], x[1 : min(n, 25)])  # the first window, from the start
    ref1 = [nll_of(model, x[i - 24 : i], x[i - 23 : i + 1])[-1] if i > 24 else head[i - 1] for i in range(first, n)]
    assert max(abs(a - b) for a, b in zip(full.nll.tolist(), ref1)) <= TOL
    assert full.window_pos[-1].item() == min(n - 1, 24) - 1
    # batching several sequences gives each the numbers it gets alone
    both = score(model, [x[:13], x], [1, first], 24, 24, batch_size=4)
    assert torch.allclose(both[1].nll, torch.tensor(disjoint, dtype=torch.float64), atol=TOL)
    assert max(abs(a - b) for a, b in zip(both[0].nll.tolist(), nll_of(model, x[:12], x[1:13]))) <= TOL


def test_scoring_progress_in_a_log_is_lines(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr not a terminal (a log; here capsys): scoring that outlasts PROGRESS_LINE_SECONDS (here 0) writes whole
    lines, windows done of the total with their rate, no carriage-return frames (the bar was off: hours of leak-free
    scoring left a log empty); work shorter than it (the default 30 s) writes nothing."""
    import lm.scoring
    from lm.evaluate import TokenDoc, evaluate_documents

    _, model = save_checkpoint(tmp_path, corpus, seq_len=24)
    docs = [TokenDoc(f"d{i}", list(range(1, 61 + i)), "x" * 100) for i in range(3)]  # 3 windows each
    capsys.readouterr()
    evaluate_documents(model, docs, 24, 24, leak_free=False, batch_size=2)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(lm.scoring, "PROGRESS_LINE_SECONDS", 0.0)
    evaluate_documents(model, docs, 24, 24, leak_free=False, batch_size=2)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and err.endswith("\n") and len(lines) >= 2, err
    assert lines[-1].startswith("windows: 100%") and "9/9 [" in lines[-1] and "win/s]" in lines[-1], lines


def test_short_inputs_use_app_f_k_and_are_never_padded(corpus: Path, tmp_path: Path) -> None:
    """A 10-token input to expert-choice MoSA (ρ = 4) selects k = max(floor(9/4), 2) = 2 tokens of its 9
    inputs (no padding to seq_len), in a batch with longer windows too."""
    _, model = save_checkpoint(tmp_path, corpus, mix="mosa_expert_choice", seq_len=32)
    x = torch.randint(0, 400, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    alone = score(model, [x], [1], 32, 32)[0].nll
    mosa = [g for g in model.head_groups() if g.type_name == "mosa"]
    assert all(abs(g.stats["selected_frac"] - 2 / 9) < 1e-6 for g in mosa)
    long = torch.randint(0, 400, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    mixed = score(model, [long, x], [1, 1], 32, 16)[1].nll
    direct = torch.tensor(nll_of(model, x[:-1], x[1:]), dtype=torch.float64)
    assert torch.allclose(alone, direct, atol=TOL) and torch.allclose(mixed, direct, atol=TOL)


def test_leak_free_scoring_recomputes_each_prefix(corpus: Path, tmp_path: Path) -> None:
    _, model = save_checkpoint(tmp_path, corpus, mix="mosa_expert_choice", seq_len=24)
    x = torch.randint(0, 400, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    lf = score(model, [x], [1], 24, 24, leak_free=True)[0].nll
    tf = score(model, [x], [1], 24, 24)[0].nll
    logits = leak_free_logits(model, torch.tensor([x[:24]]))
    ref = -logits.log_softmax(-1)[0].gather(-1, torch.tensor(x[1:25])[:, None])[:, 0].double()
    assert torch.allclose(lf[:24], ref, atol=TOL)
    assert (lf - tf).abs().max() > 1e-3  # expert choice leaks: the teacher-forced numbers differ


def run(capsys, *args: str) -> tuple[int, dict | None, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, json.loads(out.out) if rc == 0 and out.out.strip() else None, out.err


def test_cli_formats_agree_and_bits_per_byte(corpus: Path, tmp_path: Path, capsys) -> None:
    ckpt, model = save_checkpoint(tmp_path, corpus, seq_len=32)
    text = english(99, 8)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "c4.json.gz", "wt") as f:
        f.write(json.dumps({"text": text, "url": "u"}) + "\n\n")  # (a blank line is no document; a broken one an error)
    pg = f"header\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n{text}\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\n"
    (tmp_path / "pg").mkdir()
    (tmp_path / "pg" / "book.txt").write_text(pg, encoding="utf-8")
    totals = []
    for src, fmt in [(tmp_path / "one.txt", "auto"), (tmp_path / "c4.json.gz", "auto"), (tmp_path / "pg", "gutenberg")]:
        rc, res, err = run(capsys, "--ckpt", str(ckpt), "--input", str(src), "--format", fmt, "--stride", "8")
        assert rc == 0, err
        totals.append(res["total"])
    assert all(t == totals[0] for t in totals)  # the same document whichever way it comes in
    t = totals[0]
    assert t["bytes"] == len(text.encode()) and math.isclose(t["bpb"], t["loss"] * t["tokens"] / (math.log(2) * t["bytes"]))
    assert math.isclose(t["ppl"], math.exp(t["loss"]))
    # the scored tokens are the document's tokenisation (as data_prep does it) plus its closing EOS
    from data_prep.tokenizer import encode_documents
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(corpus / "tokenizer.model"))
    tokens = [1, *encode_documents(sp, [text], 1)[0].tolist()]  # EOS as the first prefix
    assert t["tokens"] == len(tokens) - 1
    # the total is lm/scoring.py's sliding-window score at the --stride asked for (tests/test_scoring's windows)
    from lm.scoring import score

    for stride in (None, 8, 32):  # None: the default, context // 2
        given = () if stride is None else ("--stride", str(stride))
        rc, res, err = run(capsys, "--ckpt", str(ckpt), "--input", str(tmp_path / "one.txt"), *given)
        assert rc == 0, err
        scored = score(model, [tokens], [1], 32, stride or 16)[0]
        assert res["total"]["loss"] == pytest.approx(scored.nll.mean().item(), rel=1e-6)
        # the mean loss of the targets scored at each window position (None where none is)
        by_pos = [scored.nll[scored.window_pos == p].mean().item() if (scored.window_pos == p).any() else None
                  for p in range(32)]
        assert res["loss_by_position"] == pytest.approx(by_pos, rel=1e-6)
        totals.append(res["total"])
    assert len(tokens) > 40 and totals[-1]["loss"] != totals[-2]["loss"]  # the stride matters on this document


def test_cli_prepared_split_per_document_and_curve(corpus: Path, tmp_path: Path, capsys) -> None:
    ckpt, model = save_checkpoint(tmp_path, corpus, seq_len=32)
    curve, out = tmp_path / "curve.png", tmp_path / "r.json"
    rc, _, err = run(capsys, "--ckpt", str(ckpt), "--input", str(corpus), "--stride", "16", "--curve", str(curve), "--out", str(out))
    assert rc == 0, err
    res = json.loads(out.read_text())
    index = json.loads((corpus / "index.json").read_text())
    assert len(res["documents"]) == index["splits"]["val"]["documents"]
    assert sum(d["tokens"] for d in res["documents"]) == res["total"]["tokens"] == index["splits"]["val"]["tokens"]
    nll = sum(d["loss"] * d["tokens"] for d in res["documents"])
    assert math.isclose(nll / res["total"]["tokens"], res["total"]["loss"], rel_tol=1e-9)
    assert len(res["loss_by_position"]) == 32 and curve.stat().st_size > 1000 and curve.read_bytes()[:4] == b"\x89PNG"
    assert res["leak_free"] is False and res["causal"] is True


def test_an_empty_prepared_document_is_skipped(corpus: Path, tmp_path: Path) -> None:
    """Two EOS in a row in a prepared split (an empty document: 0 bytes, whose bits per byte divided by zero) are
    skipped; the other documents read as before."""
    import shutil

    import numpy as np
    import sentencepiece as spm

    from lm.errors import DataError
    from lm.evaluate import _prepared_documents

    copy = tmp_path / "copy"
    shutil.copytree(corpus, copy)
    index = json.loads((copy / "index.json").read_text())
    shard = index["splits"]["val"]["shards"][0]
    tokens = np.fromfile(copy / shard["file"], dtype=np.uint16)
    eos = int(index["eos_id"])
    np.concatenate([[eos], tokens]).astype(np.uint16).tofile(copy / shard["file"])  # an empty first document
    shard["tokens"] += 1
    index["splits"]["val"]["tokens"] += 1
    (copy / "index.json").write_text(json.dumps(index))
    sp = spm.SentencePieceProcessor(model_file=str(corpus / "tokenizer.model"))
    before, after = _prepared_documents(corpus, "val", sp, None), _prepared_documents(copy, "val", sp, None)
    assert [d.text for d in after] == [d.text for d in before] and all(d.text for d in after)
    # --max-docs counts the documents scored (the empty one counted, and --max-docs 1 scored none: a traceback)
    assert [d.text for d in _prepared_documents(copy, "val", sp, 2)] == [d.text for d in before[:2]]
    np.full(len(tokens) + 1, eos, dtype=np.uint16).tofile(copy / shard["file"])  # nothing but empty documents
    with pytest.raises(DataError, match=f"^--input {copy}: split 'val' holds only empty documents$"):
        _prepared_documents(copy, "val", sp, None)


def test_leak_free_auto_is_on_for_a_non_causal_checkpoint(corpus: Path, tmp_path: Path, capsys) -> None:
    """--leak-free auto (the default) scores a non-causal checkpoint (MoSA expert choice) leak-free: the totals of
    --leak-free on, not those of teacher forcing."""
    ckpt, model = save_checkpoint(tmp_path, corpus, mix="mosa_expert_choice", seq_len=24)
    assert not model.causal
    (tmp_path / "one.txt").write_text(english(99, 4), encoding="utf-8")
    results = {}
    for mode in ("auto", "on", "off"):
        capsys.readouterr()
        assert main(["--ckpt", str(ckpt), "--input", str(tmp_path / "one.txt"), "--stride", "12", "--leak-free", mode]) == 0
        results[mode] = json.loads(capsys.readouterr().out)
    assert results["auto"]["leak_free"] is True and results["auto"]["total"] == results["on"]["total"]
    assert results["auto"]["total"] != results["off"]["total"]


def test_cli_bad_input_is_one_line(corpus: Path, tmp_path: Path, capsys) -> None:
    ckpt, _ = save_checkpoint(tmp_path, corpus)
    state = torch.load(ckpt, weights_only=False)
    state["config"]["model"]["d_model"] = 48
    torch.save(state, tmp_path / "other.ckpt")
    (tmp_path / "trunc.ckpt").write_bytes(ckpt.read_bytes()[:4000])
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "ok.txt").write_text("hello there\n")
    (tmp_path / "utf16.txt").write_bytes("hello there\n".encode("utf-16-le"))  # no BOM: valid UTF-8, half NULs
    lines = [json.dumps({"text": f"document {i}"}) + "\n" for i in range(200)]
    rows = "".join(lines).encode()
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(rows)[:-40])  # a download cut short
    (tmp_path / "broken.jsonl").write_text("".join(lines[:4]) + "{not json\n" + "".join(lines[4:]))
    # blank lines count as lines: the error names the file's line, not the row's ordinal (201)
    (tmp_path / "notext.jsonl").write_bytes(b"\n" + rows + b'\n{"content": "no text field"}\n')
    (tmp_path / "blank.jsonl").write_text('{"text": "  \\n"}\n{"text": ""}\n')  # rows, but no text to score
    other = prepared_corpus(tmp_path / "other_corpus_root")  # same text, but its own tokenizer training run
    (other / "tokenizer.model").write_bytes((other / "tokenizer.model").read_bytes())
    index = json.loads((other / "index.json").read_text())
    index["tokenizer_sha256"] = "0" * 64
    (other / "index.json").write_text(json.dumps(index))
    damaged, newer = tmp_path / "damaged", tmp_path / "newer"
    shutil.copytree(corpus, damaged)
    shutil.copytree(corpus, newer)
    (newer / "index.json").write_text(json.dumps({**json.loads((corpus / "index.json").read_text()),
                                                  "format": "data_prep/99"}))
    (damaged / "val_00000.bin").unlink()
    ok = str(tmp_path / "ok.txt")
    cases = [
        (["--ckpt", str(tmp_path / "missing.ckpt"), "--input", ok], "checkpoint not found"),
        (["--ckpt", str(tmp_path / "trunc.ckpt"), "--input", ok], "truncated or not a torch file"),
        (["--ckpt", str(tmp_path / "other.ckpt"), "--input", ok], "do not fit its model config"),
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "bad.txt")], "bad.txt: undecodable"),
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "empty.txt")], "empty.txt: empty"),
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "utf16.txt")], "utf16.txt: undecodable (50% NUL characters"),
        # text left out of an input is an error, not a warning: the scores would be of part of it
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "cut.json.gz")], "cut.json.gz: EOFError: "),
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "broken.jsonl")],
         "broken.jsonl: broken JSON line 5; nothing was evaluated"),
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "notext.jsonl")],
         'notext.jsonl: line 203 has no string "text" field; nothing was evaluated'),
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "blank.jsonl")],
         f"--input {tmp_path / 'blank.jsonl'}: no documents with text"),
        (["--ckpt", str(ckpt), "--input", str(tmp_path / "nothing")], "no such file"),
        (["--ckpt", str(ckpt), "--input", str(other)], "another tokenizer"),
        (["--ckpt", str(ckpt), "--input", ok, "--stride", "100"], "--stride must be in"),
        (["--ckpt", str(ckpt), "--input", ok, "--stride", "0"], "--stride must be in 1..48 (--context), got 0"),
        (["--ckpt", str(ckpt), "--input", ok, "--context", "0"], "--context must be in 1..48 (the model's seq_len), got 0"),
        (["--ckpt", str(ckpt), "--input", ok, "--split", "train"],
         f"--split applies to prepared directories only; --input {ok} is read as --format text"),
        (["--ckpt", str(ckpt), "--input", ok, "--format", "c4"], f"error: {ok}: no C4 JSON-lines files"),
        (["--ckpt", str(ckpt), "--input", ok, "--tokenizer", str(tmp_path / "ok.txt")],
         f"tokenizer {ok} is not a SentencePiece model"),
        # output paths are checked before the scoring, not after it
        (["--ckpt", str(ckpt), "--input", ok, "--out", str(tmp_path / "nodir" / "x.json")],
         f"--out {tmp_path / 'nodir' / 'x.json'}: directory {tmp_path / 'nodir'} does not exist"),
        (["--ckpt", str(ckpt), "--input", ok, "--curve", str(tmp_path)], f"--curve {tmp_path} is a directory"),
        (["--ckpt", str(ckpt), "--input", ok, "--curve", str(tmp_path / "c.txt")],
         f"--curve {tmp_path / 'c.txt'}: the plot is a PNG; give a file name ending in .png"),
        (["--ckpt", str(ckpt), "--input", str(tmp_path), "--format", "prepared"],
         f"--input {tmp_path}: not a prepared directory (no index.json"),
        (["--ckpt", str(ckpt), "--input", str(damaged)], f"--input: shard {damaged / 'val_00000.bin'} listed in index.json is missing"),
        (["--ckpt", str(ckpt), "--input", str(other), "--split", "nope"], "index.json has no usable split 'nope'"),
        (["--ckpt", str(ckpt), "--input", str(newer)], f"--input {newer / 'index.json'} is format 'data_prep/99' with "
                                                       "'uint16' tokens; this version reads data_prep/1 to data_prep/2"),
    ]
    # an output that is an input (or a hard link of one, as last.ckpt is of its step file) would be destroyed
    os.link(ckpt, tmp_path / "linked.ckpt")
    cases += [
        (["--ckpt", str(ckpt), "--input", ok, "--out", str(tmp_path / "linked.ckpt")],
         f"--out {tmp_path / 'linked.ckpt'} is --ckpt {ckpt}: writing it would destroy that input; give another file"),
        (["--ckpt", str(ckpt), "--input", ok, "--out", ok], f"--out {ok} is --input {ok}: writing it would destroy"),
    ]
    before = ckpt.read_bytes()
    for args, message in cases:
        rc, _, err = run(capsys, *args)
        assert rc == 2 and message in err and err.count("\n") == 1, (args, err)
    assert ckpt.read_bytes() == before and (tmp_path / "ok.txt").read_text() == "hello there\n"


def test_cli_refuses_another_tokenizer_than_the_checkpoints(corpus: Path, tmp_path: Path, capsys) -> None:
    """--tokenizer must be the checkpoint's own (its SHA-256): another one scores garbage without a sign."""
    from data_prep.tokenizer import train

    ckpt, _ = save_checkpoint(tmp_path, corpus, seq_len=32)
    (tmp_path / "ok.txt").write_text(english(3, 4), encoding="utf-8")
    (tmp_path / "other.model").write_bytes(train(english(5, 200).splitlines(), 360, threads=1))
    (tmp_path / "copy.model").write_bytes((corpus / "tokenizer.model").read_bytes())
    rc, _, err = run(capsys, "--ckpt", str(ckpt), "--input", str(tmp_path / "ok.txt"), "--tokenizer",
                     str(tmp_path / "other.model"))
    assert rc == 2 and err.count("\n") == 1
    assert f"tokenizer {tmp_path / 'other.model'} is not the one {ckpt} was trained with (SHA-256" in err, err
    rc, own, err = run(capsys, "--ckpt", str(ckpt), "--input", str(tmp_path / "ok.txt"), "--tokenizer",
                       str(tmp_path / "copy.model"))
    assert rc == 0, err
    assert own["total"] == run(capsys, "--ckpt", str(ckpt), "--input", str(tmp_path / "ok.txt"))[1]["total"]


def test_cli_writes_no_progress_frames_to_a_log(corpus: Path, tmp_path: Path, capsys) -> None:
    """stderr that is not a terminal (a log file; here capsys) gets the summary and training-data lines only, no
    bar frames."""
    ckpt, _ = save_checkpoint(tmp_path, corpus, seq_len=32)
    rc, _, err = run(capsys, "--ckpt", str(ckpt), "--input", str(corpus), "--stride", "4")
    lines = err.splitlines()
    assert rc == 0 and "\r" not in err and len(lines) == 2 and " documents, " in lines[0], err
    assert lines[1].startswith("0 of 2 documents are in the checkpoint's training data"), err


def test_cli_scores_a_model_with_a_padded_vocabulary(corpus: Path, tmp_path: Path, capsys) -> None:
    """model.vocab_size above the tokenizer's pieces (as training allows) loads and scores."""
    ckpt, model = save_checkpoint(tmp_path, corpus, seq_len=32, vocab_size=512)
    rc, res, err = run(capsys, "--ckpt", str(ckpt), "--input", str(corpus), "--stride", "16")
    assert rc == 0 and model.cfg.vocab_size == 512 and res["total"]["tokens"] > 0, err


def test_greedy_is_the_argmax_over_the_tokenizers_ids() -> None:
    """With a padded vocabulary, `greedy` (lm-eval's is_greedy) compares the target with the argmax over the
    tokenizer's ids only: a padded id the model happens to rank first can never be generated."""

    class Toy(torch.nn.Module):
        causal = True

        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # id 5 (padding) first, id 0 second
            logits = torch.zeros(*tokens.shape, 6)
            logits[..., 5], logits[..., 0] = 3.0, 2.0
            return logits + self.w

    sequence = [0, 0, 0, 0]
    (padded,), (pieces,) = (score(Toy(), [sequence], [1], 4, 4, vocab=v) for v in (None, 5))
    assert not padded.greedy.any() and pieces.greedy.all()
    assert torch.equal(padded.nll, pieces.nll)  # the likelihood is the model's, over its whole vocabulary


def test_a_document_counts_as_training_text_from_one_percent_of_its_sampled_sequences() -> None:
    """doc_hashes.SHARE_IN_TRAINING = 1%: 1 of 100 sampled sequences found marks a document, 0 does not, nor does a
    document with none sampled; an exact copy is marked whatever its sequences; unchecked is None."""
    from lm.training_overlap import Overlap

    overlap = Overlap("d", "", exact=[False, False, False, True], ngrams=[(100, 1), (100, 0), (0, 0), (0, 0)])
    assert [overlap.found(i) for i in range(4)] == [True, False, False, True]
    report = overlap.report(4)  # the JSON's totals count both kinds: the excerpt (document 0) and the exact copy
    assert report["documents_in_training_data"] == 2 and report["sampled_ngrams"] == 200
    assert report["share_of_ngrams_in_training_data"] == 1 / 200
    assert Overlap(None, "no data").found(0) is None


def test_cli_marks_documents_of_the_training_data(corpus: Path, tmp_path: Path, capsys) -> None:
    """A document whose text is in the checkpoint's training split is marked and warned about, whichever way it
    comes in (its source file, the prepared split), and so is an edited copy or an excerpt of one (by its sampled
    13-word sequences); a held-out one is not; data that is missing, changed or prepared without document records
    is said to be unchecked, never reported clean, and data without sequence records is checked on exact text."""
    import shutil

    from data_prep.split import Splitter

    ckpt, _ = save_checkpoint(tmp_path, corpus, seq_len=32)
    src = corpus.parent / "src"
    split = {p.name: Splitter(0.25)(p.name) for p in sorted(src.iterdir())}
    train_doc = src / next(n for n, s in split.items() if s == "train")
    val_doc = src / next(n for n, s in split.items() if s == "val")
    words = train_doc.read_text().split()
    (tmp_path / "edited.txt").write_text(train_doc.read_text() + ".", encoding="utf-8")
    (tmp_path / "excerpt.txt").write_text(" ".join(words[100:250]), encoding="utf-8")
    (tmp_path / "mixed.txt").write_text(val_doc.read_text() + "\n" + " ".join(words[:120]), encoding="utf-8")

    def check(*args: str) -> tuple[dict, str]:
        rc, res, err = run(capsys, "--ckpt", str(ckpt), "--stride", "16", *args)
        assert rc == 0, err
        return res, err.splitlines()[-1]

    res, line = check("--input", str(train_doc))
    doc = res["documents"][0]
    assert doc["in_training_data"] is True and doc["exact_training_document"] is True
    assert doc["sampled_ngrams"] == doc["sampled_ngrams_in_training_data"] > 0
    assert res["training_data"] == {"checked_against": str(corpus.resolve()), "not_checked_because": None,
                                    "ngrams_not_checked_because": None, "ngram_words": 13,
                                    "documents_in_training_data": 1, "sampled_ngrams": doc["sampled_ngrams"],
                                    "share_of_ngrams_in_training_data": 1.0}
    assert line.startswith(f"warning: 1 of 1 documents are in the checkpoint's training data ({corpus.resolve()}): "
                           f"{train_doc.name} (exact copy); their perplexity is not held-out"), line
    for near in ("edited.txt", "excerpt.txt"):  # not the exact text, but all its sampled sequences are training text
        res, line = check("--input", str(tmp_path / near))
        doc = res["documents"][0]
        assert doc["in_training_data"] is True and doc["exact_training_document"] is False
        n = doc["sampled_ngrams"]
        assert doc["sampled_ngrams_in_training_data"] == n > 0
        assert f"{near} ({n} of its {n} sampled 13-word sequences); their perplexity is not held-out" in line, line
    res, line = check("--input", str(tmp_path / "mixed.txt"))  # a held-out text with 120 training words appended
    doc = res["documents"][0]
    assert doc["in_training_data"] is True and 0 < doc["sampled_ngrams_in_training_data"] < doc["sampled_ngrams"]
    res, line = check("--input", str(val_doc))
    doc = res["documents"][0]
    assert doc["in_training_data"] is False and doc["sampled_ngrams_in_training_data"] == 0 < doc["sampled_ngrams"]
    assert line.startswith("0 of 1 documents are in") and line.endswith("exact text and sampled word sequences)"), line
    res, line = check("--input", str(src))
    assert [d["in_training_data"] for d in res["documents"]] == [split[d["id"]] == "train" for d in res["documents"]]
    assert f"warning: {list(split.values()).count('train')} of 12 documents" in line
    for name, found in (("train", True), ("val", False)):
        res, _ = check("--input", str(corpus), "--split", name)
        assert {d["in_training_data"] for d in res["documents"]} == {found}

    moved = tmp_path / "moved"
    shutil.copytree(corpus, moved)
    res, _ = check("--input", str(train_doc), "--train-data", str(moved))
    assert res["documents"][0]["in_training_data"] is True
    (moved / "train_ngrams.u64").unlink()  # prepared before sequences were recorded: exact text only
    res, line = check("--input", str(tmp_path / "excerpt.txt"), "--train-data", str(moved))
    assert res["documents"][0]["in_training_data"] is False and res["documents"][0]["sampled_ngrams"] is None
    assert line.endswith(f"{moved} was prepared before data_prep recorded word sequences: exact text only)"), line
    assert res["training_data"]["ngrams_not_checked_because"] is not None
    (moved / "train_documents.u64").unlink()
    changed = tmp_path / "changed"
    shutil.copytree(corpus, changed)
    (changed / "index.json").write_text((changed / "index.json").read_text() + " ")
    res, line = check("--input", str(train_doc), "--train-data", str(moved))
    assert res["documents"][0]["in_training_data"] is None and res["training_data"]["checked_against"] is None
    assert line == f"note: not checked against the training data: {moved} was prepared before data_prep recorded " \
                   "its training documents", line
    for where, why in ((tmp_path / "nowhere", "is not a prepared directory here"),  # given by hand: an error, before
                       (changed, "is not the data the checkpoint trained on (its fingerprint differs)")):  # any scoring
        rc, res, err = run(capsys, "--ckpt", str(ckpt), "--input", str(train_doc), "--train-data", str(where))
        assert rc == 2 and err == f"error: --train-data: {where} {why}\n", err


def test_a_diverged_models_perplexity_is_inf_not_a_crash() -> None:
    """A summed loss past exp's range (a diverged checkpoint) reports ppl = inf, as lm/perplexity.py states."""
    from lm.evaluate import summarize

    s = summarize(8000.0, 10, 5)
    assert s["loss"] == 800.0 and s["ppl"] == math.inf and s["bpb"] == pytest.approx(8000.0 / (math.log(2) * 5))
    assert summarize(20.0, 10, 5)["ppl"] == pytest.approx(math.exp(2.0), rel=1e-15)


def test_max_docs_scores_the_first_documents_of_any_input(corpus: Path, tmp_path: Path, capsys) -> None:
    """--max-docs N scores exactly the first N documents, as the whole input scores them: for JSON lines and for a
    prepared split."""
    ckpt, _ = save_checkpoint(tmp_path, corpus, seq_len=32)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": english(50 + i, 3)}) + "\n" for i in range(5)))
    for src in ([str(tmp_path / "docs.jsonl")], [str(corpus), "--split", "train"]):
        whole = run(capsys, "--ckpt", str(ckpt), "--input", *src)[1]["documents"]
        assert len(whole) > 2
        rc, first, err = run(capsys, "--ckpt", str(ckpt), "--input", *src, "--max-docs", "2")
        assert rc == 0, err
        assert first["documents"] == whole[:2]
        assert first["total"]["tokens"] == sum(d["tokens"] for d in whole[:2])


def test_an_empty_prepared_split_is_one_line(corpus: Path, tmp_path: Path, capsys) -> None:
    """A prepared directory whose split has no shard: nothing to score, said in one line."""
    import shutil

    ckpt, _ = save_checkpoint(tmp_path, corpus, seq_len=32)
    empty = tmp_path / "empty_split"
    shutil.copytree(corpus, empty)
    index = json.loads((empty / "index.json").read_text())
    index["splits"]["val"].update(shards=[], tokens=0, documents=0)
    (empty / "index.json").write_text(json.dumps(index))
    rc, _, err = run(capsys, "--ckpt", str(ckpt), "--input", str(empty))
    assert rc == 2 and err == f"error: --input {empty}: split 'val' is empty\n"


def test_without_usable_recorded_training_data_the_check_is_a_note(corpus: Path, tmp_path: Path, capsys) -> None:
    """No --train-data, and the checkpoint's recorded training directory is gone, or none is recorded: the scores
    come out, with a note that the documents were not checked (never a clean report) and how to check them."""
    ckpt, _ = save_checkpoint(tmp_path, corpus, seq_len=32)
    state = torch.load(ckpt, weights_only=False)
    doc = corpus.parent / "src" / "doc00.txt"
    for data_path, why in ((str(tmp_path / "gone"), f"{tmp_path / 'gone'} is not a prepared directory here"),
                           (None, "the checkpoint records no training data directory")):
        state["run"]["data_path"] = data_path
        torch.save(state, tmp_path / "moved.ckpt")
        rc, res, err = run(capsys, "--ckpt", str(tmp_path / "moved.ckpt"), "--input", str(doc))
        assert rc == 0, err
        assert res["documents"][0]["in_training_data"] is None and res["training_data"]["checked_against"] is None
        assert err.splitlines()[-1] == f"note: not checked against the training data: {why} (pass --train-data DIR)"
