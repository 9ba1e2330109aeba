"""Hugging Face export (lm/export_hf.py): AutoModelForCausalLM / AutoTokenizer load the directory offline with
trust_remote_code, the logits equal ours (max-abs <= 1e-5, fp32; measured 0), greedy `generate` equals
lm/generate.py's greedy decoding, the tokenizer encodes as data_prep does, and bad input is one line."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the eval extra (pip install -e '.[eval]') is not installed")

from eval_setup import english, prepared_corpus, save_checkpoint  # noqa: E402
from lm.export_hf import main  # noqa: E402
from lm.generate import generate  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("mix", ["dense", "mosa"])
def test_exported_model_matches_ours(corpus: Path, tmp_path: Path, mix: str, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, ours = save_checkpoint(tmp_path, corpus, mix=mix, seq_len=40)
    out = tmp_path / "hf"
    assert main(["--ckpt", str(ckpt), "--out", str(out)]) == 0, capsys.readouterr().err
    assert "\r" not in capsys.readouterr().err  # no progress-bar frames when stderr is not a terminal (a log)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.model",
                                              "tokenizer_config.json", "modeling_sparse_heads.py"}
    assert "class " not in (out / "modeling_sparse_heads.py").read_text()  # imports this package, copies nothing
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    x = torch.randint(0, ours.cfg.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max().item() <= 1e-5
        loss = hf(x, labels=x).loss
        assert torch.equal(hf(x, attention_mask=torch.ones_like(x)).logits, hf(x).logits)  # no padding: accepted
        with pytest.raises(ValueError, match="padded inputs are not supported"):  # the heads have no padding mask
            hf(x, attention_mask=torch.ones_like(x).index_fill(1, torch.tensor([36]), 0))
        ref = torch.nn.functional.cross_entropy(ours(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        assert abs(loss.item() - ref.item()) <= 1e-5
    if mix == "mosa":  # loaded in bf16 (built under that default dtype): the threshold stays the checkpoint's fp32
        half = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).eval()
        taus = {n: b for n, b in half.named_buffers() if n.endswith(".tau")}
        assert taus and all(b.dtype == torch.float32 for b in taus.values())
        assert all(torch.equal(b, ours.get_buffer(n.removeprefix("lm."))) for n, b in taus.items())
        with torch.no_grad():
            assert torch.equal(half(x).logits.float(), copy.deepcopy(ours).to(torch.bfloat16)(x).float())

    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    import sentencepiece as spm
    from data_prep.tokenizer import encode_documents

    sp = spm.SentencePieceProcessor(model_file=str(corpus / "tokenizer.model"))
    for text in (english(7, 3) + "\n  indented, and caf\u00e9", "the end.</s> <unk> x"):  # special pieces' text is text
        ids = tok(text).input_ids
        assert ids == encode_documents(sp, [text], 1)[0][:-1].tolist() and tok.decode(ids) == text
    assert tok.eos_token_id == 1
    special = [tok.unk_token_id, tok.eos_token_id]
    assert "\u2047" in tok.decode(ids + special)  # SentencePiece shows <unk> as " ⁇ " (</s> decodes to "")
    assert tok.decode(special + ids + special, skip_special_tokens=True) == tok.decode(ids)

    prompt = torch.tensor([ids[:12]])
    new = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(new, generate(ours, prompt, 8, temperature=0))


def test_non_causal_export_scores_leak_free(corpus: Path, tmp_path: Path, capsys) -> None:
    """MoSA expert choice (not causal): in eval mode the exported model's logits at t come from tokens[:, :t+1]
    (changing later tokens leaves them, and the `labels` loss is lm/leakfree.py's), in training mode they are the
    published teacher-forced ones, and greedy `generate` (last position only) recomputes the prefix as ours does;
    `output_loading_info=True` returns (model, info) as transformers does."""
    from transformers import AutoModelForCausalLM

    from lm.leakfree import leak_free_logits

    ckpt, ours = save_checkpoint(tmp_path, corpus, mix="mosa_expert_choice", seq_len=40)
    out = tmp_path / "hf"
    assert not ours.causal and main(["--ckpt", str(ckpt), "--out", str(out)]) == 0, capsys.readouterr().err
    hf, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and torch.equal(hf.lm.blocks[0].attn.groups[0].rope.inv_freq,
                                                    ours.blocks[0].attn.groups[0].rope.inv_freq)
    x = torch.randint(0, ours.cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(2))
    changed = x.clone()
    changed[:, 15:] = (x[:, 15:] + 1) % ours.cfg.vocab_size
    with torch.no_grad():
        hf.eval()
        logits = hf(x).logits
        assert (logits - leak_free_logits(ours, x)).abs().max().item() <= 1e-5
        assert torch.equal(hf(changed).logits[:, :15], logits[:, :15])
        assert (ours(changed)[:, :15] - ours(x)[:, :15]).abs().max() > 1e-3  # the teacher-forced pass leaks
        ref = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        assert abs(hf(x, labels=x).loss.item() - ref.item()) <= 1e-6
        hf.train()
        assert (hf(x).logits - ours.train()(x)).abs().max().item() <= 1e-5
        hf.eval(), ours.eval()
        tokens = x[:1, :10]
        for _ in range(6):
            tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(hf.generate(x[:1, :10], max_new_tokens=6, do_sample=False, eos_token_id=None), tokens)


def test_padded_vocabulary_exports_and_never_generates_an_undecodable_id(corpus: Path, tmp_path: Path, capsys) -> None:
    """model.vocab_size above the tokenizer's pieces: config.json keeps the model's vocabulary (the weights'
    shape), generation_config.json suppresses the ids the tokenizer lacks, so `generate` equals lm/generate.py
    restricted to the tokenizer's ids and its output decodes."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, ours = save_checkpoint(tmp_path, corpus, seq_len=40, vocab_size=1024)
    out = tmp_path / "hf"
    assert main(["--ckpt", str(ckpt), "--out", str(out)]) == 0, capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    pieces = len(tok)
    prompt = torch.tensor([tok(english(3, 1)).input_ids[:8]])
    with torch.no_grad():  # make the padded ids win the first greedy step, so that suppressing them must matter
        logits = ours(prompt)[0, -1]
        top = int(logits[:pieces].argmax())
        assert logits[top] > 0
        ours.lm_head.weight[pieces:] = 2 * ours.lm_head.weight[top]
    saved = torch.load(ckpt, weights_only=False)
    saved["state_dict"]["model.lm_head.weight"] = ours.lm_head.weight.detach().clone()
    torch.save(saved, ckpt)
    out = tmp_path / "hf_rigged"
    assert main(["--ckpt", str(ckpt), "--out", str(out)]) == 0, capsys.readouterr().err
    assert pieces < 1024 and json.loads((out / "config.json").read_text())["vocab_size"] == 1024
    assert json.loads((out / "generation_config.json").read_text())["suppress_tokens"] == list(range(pieces, 1024))
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    new = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(new, generate(ours, prompt, 12, temperature=0, vocab=pieces))
    assert int(generate(ours, prompt, 1, temperature=0)[0, -1]) >= pieces  # unrestricted, a padded id is chosen
    sampled = hf.generate(prompt, max_new_tokens=30, do_sample=True, eos_token_id=None)
    assert int(sampled.max()) < pieces and isinstance(tok.decode(sampled[0]), str)


def test_export_bad_input_is_one_line(corpus: Path, tmp_path: Path, capsys) -> None:
    ckpt, _ = save_checkpoint(tmp_path, corpus)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "trunc.ckpt").write_bytes(ckpt.read_bytes()[:2000])
    cases = [(["--ckpt", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "a")], "checkpoint not found"),
             (["--ckpt", str(tmp_path / "trunc.ckpt"), "--out", str(tmp_path / "b")], "truncated or not a torch file"),
             (["--ckpt", str(ckpt), "--out", str(tmp_path / "full")], "not an empty directory"),
             (["--ckpt", str(ckpt), "--out", str(tmp_path / "full" / "x" / "y")], "Not a directory"),
             (["--ckpt", str(ckpt), "--out", str(tmp_path / "c"), "--tokenizer", str(tmp_path / "full" / "x")],
              "x is not a SentencePiece model")]
    for args, message in cases:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not any((tmp_path / name).exists() for name in "abc")


def test_export_into_an_existing_empty_directory(corpus: Path, tmp_path: Path) -> None:
    """--out may name an empty directory (made beforehand, e.g. a mount point's folder): the export fills it and
    leaves no temporary directory beside it."""
    ckpt, _ = save_checkpoint(tmp_path, corpus)
    (tmp_path / "hf").mkdir()
    assert main(["--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and "tokenizer.model" in files
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", ckpt.name])
