"""Bad input through the real entry points (subprocess): a non-zero exit status and one clear line.

One table, CASES: (id, argv, exit status, regex the error line must match). `{name}` in argv is replaced
by a file of the `files` fixture. Exit status 2 is bad input: stderr is exactly that one line.
Exit status 3 is a diverged run (lm/nonfinite.py): its error line is the last line of stderr.
Add a row for every new entry point and every new check.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydoc_data.topics import topics

from data_prep.prepare import prepare
from tests.conftest import EVAL_EXTRA, child_env, tiny_config
from tests.synthetic import run_overrides, write_prepared

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(ROOT / "train_lm.py"), "--config", "{empty_yaml}", "{run}"]
GENERATE = [sys.executable, "-m", "lm.generate", "--prompt", "the cat"]
EVALUATE = [sys.executable, "-m", "lm.evaluate", "--ckpt", "{dense_ckpt}", "--input", "{texts}/a.txt"]
ISOFLOP = [sys.executable, "-m", "flops.isoflop", "--size", "tiny"]
RATIO_DATA = [sys.executable, "-m", "lm.ratio_data", "--ckpt", "{compressed_ckpt}", "--data", "{tmp}", "--out",
              "{tmp}/ratio_data.pt"]
MOSA = "model.heads=[{type: dense, count: 2}, {type: mosa, count: 2, options: %s}]"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")

CASES = [
    # train_lm.py: config (item 8/9 of issue 16)
    ("yaml-list", [sys.executable, str(ROOT / "train_lm.py"), "--config", "{list_yaml}"], 2,
     r"top level must be a mapping"),
    ("option-type", [*TRAIN, MOSA % "{sparsity: abc}"], 2, r"mosa.*option sparsity must be an int, got 'abc'"),
    ("option-float-for-int", [*TRAIN, MOSA % "{sparsity: 2.5}"], 2, r"option sparsity must be an int, got 2\.5"),
    ("option-bool", [*TRAIN, MOSA % "{keep_first: maybe}"], 2, r"option keep_first must be a bool, got 'maybe'"),
    ("sparsity-above-seq-len", [*TRAIN, MOSA % "{sparsity: 64}"], 2, r"model\.heads: mosa: options\.sparsity = 64 > model\.seq_len 32"),
    ("unknown-option", [*TRAIN, MOSA % "{rho: 4}"], 2, r"unknown option\(s\) rho"),
    pytest.param("accelerator-gpu", [*TRAIN, "trainer.accelerator=gpu"], 2,
                 r"trainer\.accelerator=gpu .* 0 CUDA GPU", marks=NO_GPU, id="accelerator-gpu"),
    ("accelerator-mps", [*TRAIN, "trainer.accelerator=mps"], 2,
     r"^error: trainer\.accelerator=mps is not supported: validation and some heads compute in float64, which MPS "
     r"lacks; use trainer\.accelerator=cpu$"),
    ("accelerator-name", [*TRAIN, "trainer.accelerator=tpu9"], 2, r"trainer\.accelerator must be one of"),
    ("num-workers", [*TRAIN, "data.num_workers=-1"], 2, r"data\.num_workers must be >= 0, got -1"),
    ("num-nodes", [*TRAIN, "trainer.num_nodes=0"], 2, r"trainer\.num_nodes must be a finite number > 0, got 0"),
    ("max-bad-steps", [*TRAIN, "trainer.max_bad_steps=-1"], 2, r"trainer\.max_bad_steps must be >= 0"),
    # train_lm.py: data and checkpoints
    ("data-path-is-a-file", [*TRAIN, "data.path={readme}"], 2,
     r"data\.path: \S*README\.md is not a directory; prepare one with: python -m data_prep\.prepare --source gutenberg\|c4"),
    ("token-out-of-range", [*TRAIN, "data.path={bad_tokens}"], 2,
     r"train_00000\.bin holds token id 70 >= model\.vocab_size 64"),
    ("resume-empty", [*TRAIN, "--resume-from", "{empty_ckpt}"], 2, r"--resume-from: checkpoint .*empty\.ckpt is empty"),
    ("resume-garbled", [*TRAIN, "--resume-from", "{garbled_ckpt}"], 2, r"garbled\.ckpt is truncated or not a torch file"),
    ("resume-from-missing", [*TRAIN, "--resume-from", "{tmp}/none.ckpt"], 2,
     r"^error: --resume-from: checkpoint \S+/none\.ckpt not found$"),
    ("huge-model", [*TRAIN, "model.d_model=1000000", "model.head_dim=8"], 2,
     r"^error: model: \S+B parameters need [\d,]+ GiB for their fp32 weights alone, more than this machine's [\d,]+ GiB "
     r"of memory$"),
    ("overflowing-model", [*TRAIN, "model.d_model=1000000000", "model.head_dim=8"], 2,
     r"^error: model: a weight matrix alone has more than 2\*\*63 bytes; this machine has [\d,]+ GiB of memory$"),
    ("compression-config", [*TRAIN, "compression.layer=1"], 2,
     r"compression: .* train_lm\.py does not train; use python -m lm\.compressed_training --config CONFIG"),
    # lm.compressed_training (overrides on both sides of an option reach the config check)
    ("compressed-plain-config", [sys.executable, "-m", "lm.compressed_training", "--config", "{empty_yaml}",
                                 "trainer.log_every=2", "--overwrite", "trainer.val_every=2"], 2,
     r"compression: the config has no compression section; train a plain model with python train_lm\.py"),
    ("diverges", [*TRAIN, "optim.lr=1e6", "optim.grad_clip=1e9", "optim.warmup_steps=0", "trainer.val_every=100"], 3,
     r"non-finite training at step 2: loss nan, first non-finite gradient in model\.\S+; stopped; "
     r"no checkpoint written yet"),
    ("compressed-diverges", [sys.executable, "-m", "lm.compressed_training", "--config", "{empty_yaml}", "{run}",
                             "compression.layer=1", "compression.prefix_len=16", "optim.lr=1e6", "optim.grad_clip=1e9",
                             "optim.warmup_steps=0", "trainer.val_every=100"], 3, r"^error: non-finite training at step \d+"),
    # lm.generate
    ("generate-routing", [*GENERATE, "--ckpt", "{routing_ckpt}"], 2,
     r"routing: assignment 'topk' is not causal and cannot be decoded incrementally"),
    ("generate-huge", [*GENERATE, "--ckpt", "{dense_ckpt}", "--max-new-tokens", "100000000000"], 2,
     r"need a \d+\.\d GiB KV cache, more than the .* free memory"),
    ("generate-nan-temperature", [*GENERATE, "--ckpt", "{dense_ckpt}", "--temperature", "nan"], 2,
     r"--temperature must be finite and >= 0, got nan$"),
    ("generate-max-new-tokens-zero", [*GENERATE, "--ckpt", "{dense_ckpt}", "--max-new-tokens", "0"], 2,
     r"^error: --max-new-tokens must be >= 1, got 0$"),
    ("generate-empty-prompt", [*GENERATE, "--ckpt", "{dense_ckpt}", "--prompt", ""], 2,
     r"^error: --prompt encodes to no tokens$"),
    ("generate-top-p", [*GENERATE, "--ckpt", "{dense_ckpt}", "--top-p", "1.5"], 2, r"--top-p must be in \(0, 1\], got 1\.5$"),
    ("generate-prompt-not-utf8", [*GENERATE, "--ckpt", "{dense_ckpt}", "--prompt", "caf\udce9"], 2,  # bytes c a f 0xe9
     r"--prompt is not valid UTF-8 \(byte 0xe9 at character 3\)$"),
    ("generate-compressed", [*GENERATE, "--ckpt", "{compressed_ckpt}"], 2,
     r"^error: \S*compressed\.ckpt is a compressed model's checkpoint \(lm\.compressed_training\): evaluate it with "
     r"python -m lm\.compressed_evaluate, sample from it with python -m lm\.compressed_generate$"),
    ("evaluate-compressed", [*EVALUATE, "--ckpt", "{compressed_ckpt}"], 2, r"compressed\.ckpt is a compressed model's checkpoint"),
    ("generate-empty-ckpt", [*GENERATE, "--ckpt", "{empty_ckpt}"], 2, r"empty\.ckpt is empty"),
    ("generate-ckpt-directory", [*GENERATE, "--ckpt", "{tmp}"], 2,  # was "not found"
     r"^error: checkpoint \S+ is a directory, not a file \(a run's checkpoints are checkpoints/step<N>\.ckpt"),
    ("generate-tokenizer-not-sentencepiece", [*GENERATE, "--ckpt", "{dense_ckpt}", "--tokenizer", "{readme}"], 2,
     r"^error: tokenizer \S*README\.md is not a SentencePiece model$"),
    # lm.consolidate (its success and an incomplete directory: tests/test_deepspeed.py)
    ("consolidate-a-file", [sys.executable, "-m", "lm.consolidate", "{dense_ckpt}", "{tmp}/one.ckpt"], 2,
     r"^error: \S*\.ckpt is not a DeepSpeed checkpoint directory \(no 'latest' file in it\)$"),
    ("consolidate-out-directory", [sys.executable, "-m", "lm.consolidate", "{tmp}", "{tmp}"], 2,
     r"^error: OUT \S+ is a directory; give a file name$"),
    # lm.evaluate / lm.export_hf
    ("evaluate-tokenizer-not-sentencepiece", [*EVALUATE, "--tokenizer", "{readme}"], 2,
     r"tokenizer \S*README\.md is not a SentencePiece model"),
    ("evaluate-context-zero", [*EVALUATE, "--context", "0"], 2, r"--context must be in 1\.\.64 .*, got 0"),
    ("evaluate-batch-size-zero", [*EVALUATE, "--batch-size", "0"], 2,
     r"^error: --batch-size and --max-docs must be >= 1$"),
    ("evaluate-max-docs-zero", [*EVALUATE, "--max-docs", "0"], 2, r"^error: --batch-size and --max-docs must be >= 1$"),
    ("evaluate-split-of-a-file", [*EVALUATE, "--split", "train"], 2,
     r"--split applies to prepared directories only; --input \S*a\.txt is read as --format text"),
    ("evaluate-c4-format-of-text", [*EVALUATE, "--format", "c4"], 2, r"^error: \S*a\.txt: no C4 JSON-lines files"),
    ("export-tokenizer-not-sentencepiece", [sys.executable, "-m", "lm.export_hf", "--ckpt", "{dense_ckpt}", "--out",
                                            "{tmp}/hf", "--tokenizer", "{readme}"], 2,
     r"tokenizer \S*README\.md is not a SentencePiece model"),
    # lm.ratio_data / lm.lm_eval
    ("ratio-data-ratio-zero", [*RATIO_DATA, "--ratios", "0,0.5"], 2,
     r"^error: --ratios must be in \(0, 1\], got 0,0\.5$"),
    ("ratio-data-ratio-above-one", [*RATIO_DATA, "--ratios", "0.5,1.5"], 2,
     r"^error: --ratios must be in \(0, 1\], got 0\.5,1\.5$"),
    ("ratio-data-ratio-not-a-number", [*RATIO_DATA, "--ratios", "0.5,abc"], 2,
     r"^error: --ratios expects comma-separated numbers, got '0\.5,abc'$"),
    pytest.param("lm-eval-include-path-missing", [sys.executable, "-m", "lm.lm_eval", "--ckpt", "{dense_ckpt}",
                                                  "--tasks", "lambada", "--include-path", "{tmp}/no_tasks"], 2,
                 r"^error: --include-path \S+/no_tasks: no such file or directory$", marks=EVAL_EXTRA,
                 id="lm-eval-include-path-missing"),
    # without a package of the eval extra (here: its import refused), as lm-eval on the GPU image
    *((f"{entry.replace('.', '-')}-without-{module}",
       [sys.executable, "-c", f"import runpy, sys; sys.modules['{module}'] = None; "
                              f"runpy.run_module('{entry}', run_name='__main__')", "--ckpt", "{dense_ckpt}"], 2,
       rf"^error: {re.escape(entry)} needs {package}, from the eval extra \(pip install -e '\.\[eval\]'\): "
       rf"\S.*\b{module}\b") for entry, module, package in (("lm.lm_eval", "lm_eval", "lm-evaluation-harness"),
                                                            ("bench.eval_quickstart", "lm_eval", "lm-evaluation-harness"),
                                                            ("lm.export_hf", "transformers", "transformers"))),
    # flops.isoflop / flops.sweep
    ("isoflop-option-type", [*ISOFLOP, "--head", "local", "--option", "window=abc"], 2,
     r"option window must be an int, got 'abc'"),
    ("isoflop-option-unknown", [*ISOFLOP, "--head", "mosa", "--option", "foo=1"], 2, r"unknown option\(s\) foo"),
    ("isoflop-option-bool", [*ISOFLOP, "--head", "mosa", "--option", "keep_first=maybe"], 2,
     r"option keep_first must be a bool"),
    ("isoflop-option-conflict", [*ISOFLOP, "--head", "mosa", "--sparsity", "8", "--option", "sparsity=4"], 2,
     r"sparsity 8 conflicts with option sparsity=4"),
    ("isoflop-option-twice", [*ISOFLOP, "--head", "mosa", "--option", "selection=threshold", "--option",
                              "selection=expert_choice"], 2, r"--option selection given twice"),
    ("isoflop-no-room", [*ISOFLOP, "--head", "mosa", "--sparsity", "2", "--dense-heads", "9"], 2,
     r"not even one mosa head fits .* next to 9 dense heads"),
    ("sweep-no-room", [sys.executable, "-m", "flops.sweep", "--heads", "mosa", "--sparsity", "1,2", "--dense-heads", "9",
                       "--out", "{tmp}/sweep"], 2, r"not even one mosa head fits"),
    ("sweep-option-unused", [sys.executable, "-m", "flops.sweep", "--heads", "mosa", "--sparsity", "4", "--option",
                             "fixed.sparsity=2", "--out", "{tmp}/sweep"], 2, r"--option for fixed, which is not in --heads mosa"),
    # flops.run_sweep / flops.aggregate on damaged files
    ("run-sweep-damaged-sweep-json", [sys.executable, "-m", "flops.run_sweep", "{damaged_sweep}"], 2,
     r"sweep\.json is damaged \(JSONDecodeError"),
    ("run-sweep-damaged-status-json", [sys.executable, "-m", "flops.run_sweep", "{damaged_status}"], 2,
     r"status\.json is damaged"),
    ("aggregate-damaged-metrics-json", [sys.executable, "-m", "flops.aggregate", "{damaged_metrics}"], 2,
     r"metrics\.json is damaged"),
    # data_prep.prepare
    ("prepare-missing-src", [sys.executable, "-m", "data_prep.prepare", "--source", "gutenberg", "--src", "{tmp}/none",
                             "--out", "{tmp}/prep"], 2, r"error: \S*none: no such file or directory"),
    ("prepare-changed-inputs", [sys.executable, "-m", "data_prep.prepare", "--source", "text", "--src", "{texts}",
                                "--out", "{prepared}", "--vocab-size", "400", "--no-progress"], 2,
     r"holds a preparation with other inputs \(1 removed \(b\.txt\)\); pass --overwrite"),
    ("prepare-out-under-a-file", [sys.executable, "-m", "data_prep.prepare", "--source", "text", "--src", "{texts}",
                                  "--out", "{texts}/a.txt/prep", "--vocab-size", "400", "--no-progress"], 2,
     r"error: --out \S*a\.txt/prep: cannot create it \(Not a directory\)$"),
]


def _tokenizer(directory: Path) -> None:
    import sentencepiece as spm

    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(10)) for i in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(directory / "tokenizer"),
                                   vocab_size=40, model_type="bpe", minloglevel=2)


def _checkpoint(path: Path, data: Path, heads: list[dict], **compression: int) -> Path:
    from omegaconf import OmegaConf

    from lm.config import CompressionConfig
    from lm.model import build_model

    cfg = tiny_config(heads, vocab_size=40)
    cfg.data.path = str(data)
    cfg.compression = CompressionConfig(**compression) if compression else None
    state = {f"model.{k}": v for k, v in build_model(cfg.model).state_dict().items()}
    torch.save({"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "state_dict": state}, path)
    return path


def _sweep(directory: Path, points: list[dict], **files: str) -> Path:
    directory.mkdir()
    (directory / "sweep.json").write_text(json.dumps({"size": "micro", "points": points}))
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli")
    data = write_prepared(tmp / "data", train_tokens=4000, val_tokens=1000)
    bad = write_prepared(tmp / "bad_tokens", train_tokens=4000, val_tokens=1000)
    tokens = np.fromfile(bad / "train_00000.bin", dtype=np.uint16)
    tokens[100] = 70  # >= vocab_size 64: a damaged shard or another tokenizer's
    tokens.tofile(bad / "train_00000.bin")
    _tokenizer(tmp)
    texts = tmp / "texts"
    texts.mkdir()
    for name, topic in (("a.txt", "class"), ("b.txt", "for"), ("c.txt", "try")):  # real English, offline
        (texts / name).write_text(topics[topic])
    prepare("text", str(texts), tmp / "prepared", vocab_size=400, progress=False, threads=1)
    (texts / "b.txt").unlink()  # the input folder changed after preparation
    (tmp / "list.yaml").write_text("- model\n- data\n")
    (tmp / "empty.yaml").write_text("{}\n")
    (tmp / "empty.ckpt").write_bytes(b"")
    (tmp / "garbled.ckpt").write_bytes(b"\x00garbage" * 100)
    out_dir = str(tmp / "point")
    Path(out_dir).mkdir()
    (Path(out_dir) / "metrics.json").write_text('{"step": 3, "val_')  # cut short mid-write
    point = {"name": "mosa_s4", "head": "mosa", "causal": True, "out_dir": out_dir, "config": str(tmp / "none.yaml")}
    return {
        "tmp": str(tmp), "texts": str(texts), "readme": str(ROOT / "README.md"), "prepared": str(tmp / "prepared"), "list_yaml": str(tmp / "list.yaml"), "empty_yaml": str(tmp / "empty.yaml"),
        "run": json.dumps([*run_overrides(data, tmp / "run", max_steps=4, val_every=4, log_every=4), "optim.warmup_steps=1"]), "bad_tokens": str(bad),
        "empty_ckpt": str(tmp / "empty.ckpt"), "garbled_ckpt": str(tmp / "garbled.ckpt"),
        "dense_ckpt": str(_checkpoint(tmp / "dense.ckpt", tmp, [{"type": "dense", "count": 2}])),
        "routing_ckpt": str(_checkpoint(tmp / "routing.ckpt", tmp, [{"type": "routing", "count": 2,
                                                                      "options": {"sparsity": 4, "assignment": "topk"}}])),
        "compressed_ckpt": str(_checkpoint(tmp / "compressed.ckpt", tmp, [{"type": "dense", "count": 2}], layer=1,
                                           prefix_len=16)),
        "damaged_sweep": str(_sweep(tmp / "sw1", [], **{"sweep.json": '{"points": [{"name": '})),
        "damaged_status": str(_sweep(tmp / "sw2", [point], **{"status.json": "\x00\x00"})),
        "damaged_metrics": str(_sweep(tmp / "sw3", [point])),
    }


def expand(argv: list[str], files: dict[str, str], case: str) -> list[str]:
    """Fill in the fixture's files; `{run}` becomes the tiny-run overrides (tests/synthetic.py), with a
    run directory of the case's own (a run directory holds one run: lm/run_dir.py)."""
    out: list[str] = []
    for arg in argv:
        if arg == "{run}":
            out.extend(json.loads(files["run"]))
            out.append(f"trainer.out_dir={Path(files['tmp']) / 'runs' / case}")
        else:
            out.append(arg.format(**files) if "{" in arg and not arg.startswith("model.") else arg)
    return out


@pytest.mark.parametrize("case,argv,status,message", [c if hasattr(c, "marks") else pytest.param(*c, id=c[0])
                                                      for c in CASES])
def test_bad_input_gives_one_line(files: dict[str, str], case: str, argv: list[str], status: int,
                                  message: str) -> None:
    env = child_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(expand(argv, files, case), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == status, f"{case}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if status == 2:
        assert len(lines) == 1, f"{case}: more than one line on stderr:\n{proc.stderr[-3000:]}"
    assert lines[-1].startswith("error: ") and re.search(message, lines[-1]), lines[-1]
