"""Held-out evaluation of the quickstart model next to a unigram baseline, in one run.

    python -m bench.eval_quickstart [--ckpt runs/quickstart/checkpoints/last.ckpt] [--shared ../shared/data] \\
        [--items 300] [--out bench/results/eval_quickstart.md]

1. Perplexity and bits per byte (lm/evaluate.py: context 256 = seq_len, stride 128) on (a) three Gutenberg
   books the quickstart never saw, not even its tokenizer (it uses the first 14 books by file name), and
   (b) the quickstart's own validation split (two books held out by document hash).
2. Two local zero-shot tasks in lm-eval's YAML format, built from the three unseen books and run through
   lm/lm_eval.py: a cloze task (LAMBADA-style: 60 words of running text, predict the next word, accuracy =
   greedy match of all its tokens) and a 4-way multiple-choice task (HellaSwag-style: 40 words of text, pick
   the true next 12 words among 3 spans from elsewhere in the same books; acc and length-normalised acc_norm).
The baseline is a unigram model of the quickstart's training tokens (add-one smoothed), scored by the same
code paths (lm-eval for the tasks; the same documents and token counts for perplexity).
"""
from __future__ import annotations

import json
import platform
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flops.cli import command_line, hardware, output_file, positive_int, script_parser
from lm.cli import exit_without_eval_extra

try:
    from lm_eval.api.model import TemplateLM
except ImportError as err:
    if __name__ != "__main__":
        raise
    exit_without_eval_extra("bench.eval_quickstart", "lm-evaluation-harness", err)

from lm.data import TokenStream
from lm.evaluate import TokenDoc, evaluate_documents, read_documents, summarize
from lm.checkpoint import read_checkpoint
from lm.loading import load_for_generation
from lm.lm_eval import SparseHeadsLM, evaluate_tasks, task_manager
from lm.training_overlap import training_overlap

ROOT = Path(__file__).resolve().parents[1]
UNSEEN = ("pg35_the_time_machine", "pg43_the_strange_case_of_dr_jekyll_and_mr_hyde", "pg46_a_christmas_carol")
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{context}}}}"
{target}
metric_list:
{metrics}
"""
ACC = "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"


class UnigramLM(TemplateLM):
    """log p(token) from training-token counts, ignoring the context: the floor any LM must beat."""

    def __init__(self, lm: SparseHeadsLM, counts: np.ndarray) -> None:
        super().__init__()
        self.lm = lm
        self.logp = np.log((counts + 1) / (counts.sum() + len(counts)))
        self.top = int(self.logp.argmax())

    @property
    def eot_token_id(self) -> int:
        return self.lm.eot_token_id

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return self.lm.tok_encode(string)

    def nll(self, tokens: list[int]) -> float:
        return -float(self.logp[tokens].sum())

    def _loglikelihood_tokens(self, requests, **kwargs: Any) -> list[tuple[float, bool]]:
        return [(-self.nll(cont), all(t == self.top for t in cont)) for _, _, cont in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [-self.nll(self.tok_encode(r.args[0])) for r in requests]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("the unigram baseline does not generate")


def build_tasks(texts: list[str], out: Path, items: int, seed: int = 0) -> list[str]:
    """Cloze and multiple-choice JSONL + lm-eval YAML from running text; returns the task names."""
    rng = random.Random(seed)
    words = [w for t in texts for w in re.sub(r"\s+", " ", t).split(" ") if w]
    cloze, mc = [], []
    while len(cloze) < items:
        i = rng.randrange(60, len(words) - 1)
        if re.fullmatch(r"[A-Za-z]{3,}", words[i]):  # a plain word, not punctuation-attached
            cloze.append({"context": " ".join(words[i - 60 : i]), "target": " " + words[i]})
    while len(mc) < items:
        i = rng.randrange(40, len(words) - 12)
        spans = [" " + " ".join(words[i : i + 12])]
        while len(spans) < 4:
            j = rng.randrange(0, len(words) - 12)
            if abs(j - i) > 100:
                spans.append(" " + " ".join(words[j : j + 12]))
        order = list(range(4))
        rng.shuffle(order)
        mc.append({"context": " ".join(words[i - 40 : i]), "choices": [spans[k] for k in order], "label": order.index(0)})
    out.mkdir(parents=True, exist_ok=True)
    specs = {
        "quickstart_cloze": (cloze, "loglikelihood", 'doc_to_target: "{{target}}"',
                             ACC + "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"),
        "quickstart_mc": (mc, "multiple_choice", 'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"',
                          ACC + "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"),
    }
    for name, (rows, output_type, target, metrics) in specs.items():
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data.resolve(), output_type=output_type,
                                                           target=target, metrics=metrics.rstrip("\n")))
    return list(specs)


def unigram_summary(uni: UnigramLM, docs: list[TokenDoc]) -> dict[str, float]:
    return summarize(sum(uni.nll(d.tokens[1:]) for d in docs), sum(len(d.tokens) - 1 for d in docs),
                     sum(d.nbytes for d in docs))


def main(argv: list[str] | None = None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--ckpt", default=str(ROOT / "runs/quickstart/checkpoints/last.ckpt"), help="quickstart checkpoint")
    ap.add_argument("--shared", default=str(ROOT.parent / "shared/data"), help="directory holding gutenberg/")
    ap.add_argument("--items", type=positive_int, default=300, help="documents per zero-shot task")
    ap.add_argument("--work", default=str(ROOT / "runs/eval_quickstart"), help="task files and JSON go here")
    ap.add_argument("--out", type=output_file, default=str(ROOT / "bench/results/eval_quickstart.md"), help="write the markdown report here")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(0)
    books = [Path(args.shared) / "gutenberg" / f"{name}.txt.gz" for name in UNSEEN]
    try:
        model, sp, run = load_for_generation(args.ckpt)
        saved = read_checkpoint(args.ckpt)  # memory-mapped: the run's data path and step, not the weights again
        data_dir = Path(saved["config"]["data"]["path"])
        if not (data_dir / "index.json").is_file():
            raise ValueError(f"{data_dir}: the checkpoint's training data (data.path) is not a prepared directory here")
        missing = [str(b) for b in books if not b.is_file()]
        if missing:
            raise ValueError(f"--shared {args.shared}: unseen book(s) not found: {', '.join(missing)}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = model.cfg
    T = cfg.seq_len
    index = json.loads((data_dir / "index.json").read_text())
    train = TokenStream(data_dir, "train", index["splits"]["train"]["shards"], cfg.vocab_size)
    counts = np.bincount(train.read(0, len(train)), minlength=cfg.vocab_size).astype(np.float64)
    ours = SparseHeadsLM(args.ckpt, batch_size=16)
    uni = UnigramLM(ours, counts)

    work = Path(args.work)
    unseen_dir = work / "unseen_books"
    unseen_dir.mkdir(parents=True, exist_ok=True)
    for b in books:
        (unseen_dir / b.name).write_bytes(b.read_bytes())
    rows = []
    for label, src, fmt in [("3 unseen Gutenberg books", unseen_dir, "gutenberg"),
                            ("quickstart validation split (2 books)", data_dir, "prepared")]:
        docs = read_documents(src, fmt, sp)
        res = evaluate_documents(model, docs, T, T // 2, leak_free=not model.causal, batch_size=16)
        (work / f"perplexity_{fmt}.json").write_text(json.dumps(res, indent=1))
        overlap = training_overlap(run, [d.text for d in docs])
        found = overlap.report(len(docs))["documents_in_training_data"]
        found = "not checked" if found is None else found
        rows.append((label, res["total"], unigram_summary(uni, docs), [d["id"] for d in res["documents"]], found))
    from data_prep.documents import Skips
    from data_prep.sources import open_source

    texts = [d.text for d in open_source("gutenberg", str(unseen_dir)).read(Skips())]
    tasks = build_tasks(texts, work / "tasks", args.items)
    manager = task_manager(tasks, str(work / "tasks"))
    scores = {name: evaluate_tasks(lm, tasks, manager)["results"] for name, lm in [("quickstart", ours), ("unigram", uni)]}
    minutes = (time.perf_counter() - start) / 60

    lines = [
        "# Held-out evaluation of the quickstart model (CPU)",
        "",
        f"Command: `{command_line(['-m', 'bench.eval_quickstart'], argv)}` ({minutes:.1f} min on {hardware()}, "
        f"{torch.get_num_threads()} thread(s); torch {torch.__version__}, lm-eval {_version('lm_eval')}, "
        f"Python {platform.python_version()}, {platform.platform()}).",
        f"Checkpoint: `{_rel(Path(args.ckpt))}` ({training_config(Path(args.ckpt))}: "
        f"{cfg.mix_text()} heads, {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"T = {T}, vocab {cfg.vocab_size}, {model.num_params() / 1e6:.2f}M parameters, "
        f"step {saved.get('global_step', '?')}).",
        "Baseline: unigram distribution of the quickstart's training tokens (add-one smoothed), same tokens and code paths.",
        "",
        f"## Perplexity and bits per byte (lm.evaluate, context {T}, stride {T // 2})",
        "",
        "| text | documents | in training data | tokens | bytes | quickstart ppl | quickstart bits/byte | unigram ppl "
        "| unigram bits/byte |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, t, u, ids, found in rows:
        lines.append(f"| {label} | {len(ids)} | {found} | {t['tokens']:,} | {t['bytes']:,} | {t['ppl']:.2f} | {t['bpb']:.4f} | "
                     f"{u['ppl']:.2f} | {u['bpb']:.4f} |")
    lines += ["", f"Unseen books: {', '.join(UNSEEN)} (`--format gutenberg`, header and licence stripped). "
              "Every token of each book is predicted, including its closing end-of-document token.", "",
              f"## Zero-shot tasks (lm-eval {_version('lm_eval')}, local YAML tasks, {args.items} items each, 0-shot)", "",
              "| task | metric | quickstart | unigram | chance |", "|---|---|---:|---:|---:|"]
    in_training = ours.training_data()
    chance = {"quickstart_cloze": 0.0, "quickstart_mc": 0.25}
    for task in tasks:
        for metric in ("acc,none", "acc_norm,none", "perplexity,none"):
            if metric in scores["quickstart"][task]:
                q, u = scores["quickstart"][task][metric], scores["unigram"][task][metric]
                ch = f"{chance[task]:.2f}" if metric.startswith("acc") else ""
                lines.append(f"| {task} | {metric.split(',')[0]} | {q:.4f} | {u:.4f} | {ch} |")
    lines += ["", "quickstart_cloze: 60 words of running text from the unseen books, predict the next word (a plain "
              "word of 3+ letters); acc = every token of ' word' is the greedy prediction (LAMBADA's metric); "
              "perplexity over the target words. quickstart_mc: 40 words of text, choose the true next 12 words "
              "among 4 (3 from elsewhere in the same books); acc by summed log-likelihood, acc_norm per byte.",
              f"Task files (regenerated by the command): `{_rel(work / 'tasks')}`.", "",
              "In the training data (lm/training_overlap.py: exact text, or 1% or more of a document's sampled 13-word "
              "sequences found in the checkpoint's training text): "
              + ("; ".join(f"{task} {e['documents_in_training_data']} of {e['documents']} documents"
                           for task, e in sorted(in_training["tasks"].items()))
                 if in_training["checked_against"] else f"not checked ({in_training['not_checked_because']})") + ".", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def training_config(ckpt: Path) -> str:
    """The config file named by the training command of checkpoint `ckpt`, as its run directory (<out_dir>/checkpoints/
    holds the checkpoint) recorded it in run.json (lm/run_dir.py)."""
    try:
        command = json.loads((ckpt.resolve().parent.parent / "run.json").read_text())["command"]
    except (OSError, ValueError, KeyError):  # no run directory around the checkpoint, or a record without it
        command = []
    given = [arg.split("=", 1)[1] for arg in command if arg.startswith("--config=")]
    given += [value for flag, value in zip(command, command[1:]) if flag == "--config"]
    return given[0] if given else "config file not recorded"


def _rel(path: Path) -> str:
    """`path` relative to the repository root where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package.replace("_", "-"))


if __name__ == "__main__":
    sys.exit(main())
