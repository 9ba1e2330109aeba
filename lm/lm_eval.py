"""lm-evaluation-harness adapter: zero-shot tasks (MoSA App. F, Table 3) on train_lm.py checkpoints.

    python -m lm.lm_eval --ckpt runs/quickstart/checkpoints/last.ckpt --tasks lambada_openai,piqa \\
        [--include-path my_tasks/] [--limit 100] [--batch-size 8] [--output results.json]

Registers model "sparse-heads" with lm-eval's model registry (args: ckpt=PATH). Requests are scored by lm/scoring.py, the scorer of lm/evaluate.py:
- loglikelihood: context + continuation, the continuation scored from at most seq_len tokens of history:
  in one window when it fits (context truncated on the left), otherwise in chunks of seq_len/2 tokens,
  each seeing at least seq_len/2 tokens of history, so a continuation longer than the window is scored
  completely. Inputs shorter than seq_len run at
  their own length (App. F's k = max(floor(T/ρ), 2) for heads that select k tokens). Non-causal heads
  are scored leak-free (every prediction from its own prefix).
- loglikelihood_rolling: [EOS] + text in disjoint seq_len windows (lm-eval's rolling windows).
- generate_until: greedy or sampled decoding with the KV cache (lm/generate.py) where every head supports
  it, else recomputing the prefix; prompt and generation stay within seq_len: the context keeps its last
  seq_len - min(max_gen_toks, seq_len/2) tokens (at least half the window, however large max_gen_toks), the
  generation stops at max_gen_toks or the end of the window, and a warning counts the requests so cut; the
  text is cut at the first stop string. Requests with equal context length run as a batch.
Windows are batched (--batch-size) as lm/scoring.py allows (padded only where that is exact). Tokenisation is data_prep's (via lm/hf_tokenizer.py's
rules): EOS is the end-of-document token and the prefix for an empty context.
Each task's documents are looked up in the checkpoint's training data (lm/training_overlap.py; the text of a
document's requests, prompts and continuations, as one text): the results say per task how many are in it.
"""
from __future__ import annotations

import functools
import json
import math
import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from data_prep import tokenizer as sp_codec
from data_prep.cli import OneLineParser
from data_prep.hub import NETWORK_HINT, first_line, is_network_error
from lm.cli import check_output, exit_without_eval_extra

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:
    if __name__ != "__main__":
        raise
    exit_without_eval_extra("lm.lm_eval", "lm-evaluation-harness", err)

from lm.generate import decodable, generate, sample
from lm.loading import TOKENIZER_HELP, load_for_generation
from lm.sanity import warn
from lm.scoring import progress_bar, score
from lm.training_overlap import TRAIN_DATA_HELP, check_train_data, training_overlap

MODEL_NAME = "sparse-heads"


def batch_size_arg(value: int | str) -> int:
    """lm-eval's batch_size: an integer >= 1, or auto / auto:N (no search for the largest batch here: 8)."""
    text = str(value)
    if text == "auto" or text.startswith("auto:"):
        return 8
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"batch size must be an integer >= 1 or auto, got {value!r}")
    return int(text)


@register_model(MODEL_NAME)
class SparseHeadsLM(TemplateLM):
    """lm-eval model over a train_lm.py checkpoint (module docstring)."""

    def __init__(self, ckpt: str, tokenizer: str | None = None, batch_size: int | str = 8,
                 leak_free: str = "auto", device: str = "cpu", **kwargs: Any) -> None:
        super().__init__()
        model, self.sp, self.run = load_for_generation(ckpt, tokenizer)
        self.scored_texts: dict[tuple[str, int], set[str]] = defaultdict(set)  # (task, doc id) -> its requests' texts
        self.model = model.to(device)
        self.seq_len = model.cfg.seq_len
        self.batch_size = batch_size_arg(batch_size)
        modes = {"on": True, "true": True, "off": False, "false": False, "auto": not model.causal}
        if str(leak_free).lower() not in modes:  # (lm-eval's model_args parser turns leak_free=true into True)
            raise ValueError(f"leak_free must be auto, on or off, got {leak_free!r}")
        self.leak_free = modes[str(leak_free).lower()]
        self.decodable = decodable(model)  # generate_until: KV-cached decoding, else the prefix recomputed

    @property
    def eot_token_id(self) -> int:
        return sp_codec.EOS_ID

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return sp_codec.encode_text(self.sp, string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.sp.decode(list(tokens))

    def _score(self, sequences: list[list[int]], firsts: list[int], strides: list[int], disable_tqdm: bool):
        bar = progress_bar(desc="windows", disable=disable_tqdm)
        try:
            return score(self.model, sequences, firsts, self.seq_len, strides, self.batch_size, self.leak_free,
                         progress=bar, vocab=self.sp.get_piece_size())
        finally:
            bar.close()

    def _record(self, requests: list[Any]) -> None:
        """Remember every request's text by (task, document), for `training_data`."""
        for req in requests:
            self.scored_texts[(str(req.task_name), int(req.doc_id or 0))].add(
                "".join(a for a in req.args if isinstance(a, str)))

    def training_data(self, train_data: str | None = None) -> dict[str, Any]:
        """lm/training_overlap.py's report over the documents scored so far, and per task how many of its
        documents are in the checkpoint's training data (None: not checked)."""
        keys = sorted(self.scored_texts)
        overlap = training_overlap(self.run, ["\n".join(sorted(self.scored_texts[k])) for k in keys], train_data)
        tasks: dict[str, dict[str, Any]] = {}
        for i, (task, _) in enumerate(keys):
            entry = tasks.setdefault(task, {"documents": 0, "documents_in_training_data": 0})
            entry["documents"] += 1
            found = overlap.found(i)
            entry["documents_in_training_data"] = None if found is None else entry["documents_in_training_data"] + found
        return {**overlap.report(len(keys)), "tasks": tasks}

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._record(requests)
        with bars_on_terminal_only():  # lm-eval's own tokenising bar only on a terminal; ours as progress_bar
            return super().loglikelihood(requests, disable_tqdm)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether every continuation token is the argmax)."""
        # a whitespace-only context is empty once lm-eval has moved its whitespace onto the continuation: EOS is then
        # the prefix, as for an empty context
        contexts = [list(ctx) or [self.eot_token_id] for _, ctx, _ in requests]
        seqs = [ctx + list(cont) for ctx, (_, _, cont) in zip(contexts, requests)]
        firsts = [len(ctx) for ctx in contexts]
        if cut := sum(len(seq) > self.seq_len + 1 for seq in seqs):  # T inputs predict T + 1 tokens: more are cut
            warn(f"loglikelihood: {cut} of {len(requests)} requests are longer than the {self.seq_len + 1} tokens of "
                 f"one window (seq_len {self.seq_len}): their continuations are scored from at most {self.seq_len} "
                 "tokens of history, the rest of the context cut on the left")
        strides = [len(cont) if 0 < len(cont) <= self.seq_len else max(1, self.seq_len // 2) for _, _, cont in requests]
        scores = self._score(seqs, firsts, strides, disable_tqdm)
        return [(-float(s.nll.sum()), bool(s.greedy.all())) for s in scores]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        self._record(requests)
        seqs = [[self.eot_token_id, *self.tok_encode(req.args[0])] for req in requests]
        scores = self._score(seqs, [1] * len(seqs), [self.seq_len] * len(seqs), disable_tqdm)
        return [-float(s.nll.sum()) for s in scores]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        self._record(requests)
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, list[int]]]] = defaultdict(list)
        cut_context = cut_generation = 0
        for i, req in enumerate(requests):
            context, kw = req.args
            wanted = int(kw.get("max_gen_toks", 256))
            if wanted < 1:
                raise ValueError(f"generate_until: max_gen_toks must be >= 1, got {wanted}")
            encoded = self.tok_encode(context)
            ctx = encoded[-(self.seq_len - min(wanted, self.seq_len // 2)):] or [self.eot_token_id]
            max_new = min(wanted, self.seq_len - len(ctx))
            cut_context, cut_generation = cut_context + (len(ctx) < len(encoded)), cut_generation + (max_new < wanted)
            do_sample = bool(kw.get("do_sample", False))  # sampling at temperature 1 unless told otherwise
            settings = (max_new, do_sample, float(kw.get("temperature", 1.0 if do_sample else 0.0)))
            groups[(len(ctx), settings)].append((i, ctx))
        if cut_context or cut_generation:
            warn(f"generate_until: within the model's seq_len {self.seq_len}, {cut_context} of {len(requests)} "
                 f"contexts were cut on the left and {cut_generation} generations were cut short of max_gen_toks")
        for (_, (max_new, do_sample, temperature)), members in progress_bar(groups.items(), disable_tqdm):
            temp = temperature if do_sample else 0.0
            for b in range(0, len(members), self.batch_size):
                batch = members[b : b + self.batch_size]
                prompt = torch.tensor([ctx for _, ctx in batch], device=next(self.model.parameters()).device)
                out = self._generate(prompt, max_new, temp)
                for (i, ctx), row in zip(batch, out.tolist()):
                    results[i] = self._cut(row[len(ctx):], requests[i].args[1].get("until", []))
        return results  # type: ignore[return-value]

    def _generate(self, prompt: torch.Tensor, max_new: int, temperature: float) -> torch.Tensor:
        if self.decodable:
            return generate(self.model, prompt, max_new, temperature, stop_id=self.eot_token_id,
                            vocab=self.sp.get_piece_size())
        tokens = prompt  # heads that cannot decode incrementally: recompute the prefix at every step
        with torch.no_grad():
            for _ in range(max_new):
                nxt = sample(self.model(tokens)[:, -1], temperature, vocab=self.sp.get_piece_size())
                tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        return tokens

    def _cut(self, generated: list[int], until: str | list[str]) -> str:
        if self.eot_token_id in generated:
            generated = generated[: generated.index(self.eot_token_id)]
        text = self.tok_decode(generated)
        for stop in [until] if isinstance(until, str) else until:
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text


def _check_task_files(include_path: Path) -> None:
    """Every task YAML under include_path must parse (lm-eval would skip a broken one with a log line)."""
    import yaml

    class Loader(yaml.SafeLoader):  # lm-eval's `!function module.name` tags
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    files = [include_path] if include_path.is_file() else sorted(include_path.rglob("*.yaml"))
    for path in files:
        try:
            values = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            where = getattr(err, "problem_mark", None)
            raise ValueError(f"task file {path} does not parse{f' (line {where.line + 1})' if where else ''}: "
                             f"{getattr(err, 'problem', None) or type(err).__name__}") from None
        if not isinstance(values, dict) or not ("task" in values or "group" in values):
            raise ValueError(f"task file {path} is not an lm-eval task config (no `task:` or `group:` key)")


def run(ckpt: str, tasks: list[str], include_path: str | None = None, limit: float | None = None,
        batch_size: int = 8, num_fewshot: int | None = None, leak_free: str = "auto",
        tokenizer: str | None = None, train_data: str | None = None) -> dict[str, Any]:
    """lm-eval's simple_evaluate on our checkpoint, with `training_data`: which task documents are in the
    checkpoint's training data (`train_data`: default the directory it recorded); ValueError (one line) for
    bad input."""
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"--limit must be > 0 (documents per task, or a fraction of them below 1), got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    manager = task_manager(tasks, include_path)
    model = SparseHeadsLM(ckpt, tokenizer=tokenizer, batch_size=batch_size, leak_free=leak_free)
    check_train_data(model.run, train_data)  # before the evaluation, not after it
    results = evaluate_tasks(model, tasks, manager, limit, num_fewshot)
    results["training_data"] = model.training_data(train_data)
    return results


def training_data_lines(report: dict[str, Any]) -> list[str]:
    """A line per task on its documents in the training data (a warning when some are), or one note line
    saying why they were not checked."""
    if report["checked_against"] is None:
        return [f"note: task documents not checked against the training data: {report['not_checked_because']}"]
    how = report["ngrams_not_checked_because"] or "exact text and sampled word sequences"
    lines = []
    for task, entry in sorted(report["tasks"].items()):
        n, found = entry["documents"], entry["documents_in_training_data"]
        lines.append(f"warning: {task}: {found} of {n} documents are in the checkpoint's training data "
                     f"({report['checked_against']}); its score is not held-out" if found else
                     f"{task}: 0 of {n} documents are in the checkpoint's training data ({report['checked_against']}; {how})")
    return lines


def evaluate_tasks(model: Any, tasks: list[str], manager: Any, limit: float | None = None,
                   num_fewshot: int | None = None) -> dict[str, Any]:
    """simple_evaluate of any lm-eval model object (ours, or a baseline) on `tasks`."""
    from lm_eval import simple_evaluate

    try:
        with bars_on_terminal_only():
            results = simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    except Exception as err:  # a task's dataset that cannot be read: one line; anything else stays a traceback
        if is_network_error(err):
            raise ValueError(f"a task's dataset could not be downloaded ({first_line(err)}); {NETWORK_HINT}, or "
                             "evaluate on local task files (--include-path)") from None
        if isinstance(err, FileNotFoundError):
            raise ValueError(f"a task's data file is missing ({first_line(err)}); check its task YAML's data_files "
                             "(bench.eval_quickstart writes absolute paths: rerun it after moving the files)") from None
        raise
    if results is None:
        raise ValueError("lm-eval returned no results")
    return results


def _disabled(bar: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """bar(*args, **kwargs) with disable=True, whatever the caller passed."""
    return bar(*args, **{**kwargs, "disable": True})


@contextmanager
def bars_on_terminal_only() -> Iterator[None]:
    """Within: datasets' "Generating split" bars and lm-eval's own bars (Task.build_all_requests' request building,
    TemplateLM.loglikelihood's tokenising, which a baseline model such as bench.eval_quickstart's unigram runs) are
    drawn only when stderr is a terminal, like ours (lm.scoring.progress_bar), so log files get no bar frames.
    datasets has a switch; lm-eval's modules call their `tqdm` with none (or with disable=False: TemplateLM's
    default), so that name is rebound meanwhile to one that is always disabled."""
    if sys.stderr.isatty():
        yield
        return
    import datasets
    from lm_eval.api import model, task

    shown = datasets.is_progress_bar_enabled()
    bars = {module: module.tqdm for module in (model, task) if hasattr(module, "tqdm")}
    datasets.disable_progress_bars()
    for module, bar in bars.items():
        module.tqdm = functools.partial(_disabled, bar)
    try:
        yield
    finally:
        for module, bar in bars.items():
            module.tqdm = bar
        if shown:
            datasets.enable_progress_bars()


def task_manager(tasks: list[str], include_path: str | None = None) -> Any:
    """lm-eval's TaskManager with the task YAMLs under include_path, after checking that each parses
    and that every task name is known; ValueError (one line) otherwise. When include_path holds every
    requested task, lm-eval's ~15k built-in task configs are not indexed (that takes ~15 s of CPU)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).exists():
            raise ValueError(f"--include-path {include_path}: no such file or directory")
        _check_task_files(Path(include_path))
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: not in lm-eval's registry"
                         f"{' or ' + include_path if include_path else ''} (a task file that failed to load?)")
    return manager


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m lm.lm_eval",
                       description="Zero-shot tasks with lm-evaluation-harness on a train_lm.py checkpoint.")
    ap.add_argument("--ckpt", required=True, help="checkpoint written by train_lm.py")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    ap.add_argument("--include-path", default=None, help="directory (or file) of extra task YAMLs")
    ap.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows or generations per forward pass (default 8)")
    ap.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    ap.add_argument("--leak-free", default="auto", choices=("auto", "on", "off"),
                    help="auto: on iff some head is not causal")
    ap.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    ap.add_argument("--train-data", default=None, help=TRAIN_DATA_HELP)
    ap.add_argument("--output", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    try:
        batch_size_arg(args.batch_size)  # before the task index and the checkpoint load
        check_output("--output", args.output, {"--ckpt": args.ckpt, "--tokenizer": args.tokenizer})
        results = run(args.ckpt, [t for t in args.tasks.split(",") if t], args.include_path, args.limit,
                      args.batch_size, args.num_fewshot, args.leak_free, args.tokenizer, args.train_data)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    print("\n".join(training_data_lines(results["training_data"])), file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps({k: results[k] for k in ("results", "versions", "n-shot", "config",
                                                                          "training_data")
                                                 if k in results}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
