"""lm-evaluation-harness adapter (lm/lm_eval.py), offline: log-likelihoods against our own forward pass
(max-abs 1e-4 nats on sums of fp32 log-probs; measured ~1e-6), continuations that cross the context
window, greedy generation against lm/generate.py, two local tasks in lm-eval's YAML format (multiple
choice, cloze) whose accuracies equal those computed from forward passes, and bad task files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="the eval extra (pip install -e '.[eval]') is not installed")

from eval_setup import english, prepared_corpus, save_checkpoint  # noqa: E402
from lm.generate import generate  # noqa: E402
from lm.lm_eval import SparseHeadsLM, main, run  # noqa: E402

TOL = 1e-4
T = 32

MC_YAML = """task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
CLOZE_YAML = """task: local_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + word}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    data = prepared_corpus(root)
    ckpt, model = save_checkpoint(root, data, mix="mosa", seq_len=T)
    return root, ckpt, model, SparseHeadsLM(str(ckpt), batch_size=3)


def logprob(model, tokens: list[int], first: int) -> float:
    """log p(tokens[first:] | tokens[:first]) from one forward pass (len(tokens) <= T + 1)."""
    with torch.no_grad():
        logp = model(torch.tensor([tokens[:-1]])).log_softmax(-1)[0]
    return sum(logp[i - 1, tokens[i]].item() for i in range(first, len(tokens)))


def test_is_greedy_means_every_continuation_token_is_the_argmax(setup) -> None:
    """lm-eval's second value: True only when each continuation token is the model's argmax after the tokens
    before it; a continuation whose last token is not (the first ones are) is False."""
    _, _, model, lm = setup
    context = lm.tok_encode(english(1, 10))[:12]
    greedy = list(context)
    with torch.no_grad():
        for _ in range(3):
            greedy.append(int(model(torch.tensor([greedy])).argmax(-1)[0, -1]))
        logits = model(torch.tensor([greedy[:-1]]))[0, -1]
    off = int(logits.argsort(descending=True)[1])  # the second most likely last token
    requests = [(("", ""), context, greedy[len(context):]), (("", ""), context, [*greedy[len(context):-1], off])]
    (ll_greedy, is_greedy), (ll_off, is_off) = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert is_greedy and not is_off
    assert abs(ll_greedy - logprob(model, greedy, len(context))) <= TOL
    assert abs(ll_off - logprob(model, [*greedy[:-1], off], len(context))) <= TOL


def test_loglikelihood_matches_forward_pass(setup) -> None:
    from lm_eval.api.instance import Instance

    _, _, model, lm = setup
    words = english(1, 40).split()
    cases = [(" ".join(words[:5]), " " + words[5]),  # short: runs at its own length
             (" ".join(words[:60]), " " + " ".join(words[60:63])),  # crosses the window: context cut on the left
             ("", " ".join(words[:4])),  # empty context: EOS is the prefix
             (" ".join(words[:3]), " " + " ".join(words[3:80]))]  # continuation longer than the window
    got = lm.loglikelihood([Instance("loglikelihood", {}, c, i) for i, c in enumerate(cases)], disable_tqdm=True)
    for (ctx, cont), (ll, _) in zip(cases, got):
        c = lm.tok_encode(ctx) if ctx else [1]
        x = lm.tok_encode(ctx + cont)
        x = c + x[len(c):] if ctx else [1] + lm.tok_encode(cont)
        n, first = len(x), len(c)
        if n - first <= T:  # one window ending at the last token
            lo = max(0, n - 1 - T)
            ref = logprob(model, x[lo:], first - lo)
        else:  # the first window from the start, then chunks of T/2 targets, each window ending at its chunk's end
            ref, s, e = 0.0, first, max(T + 1, first + T // 2)
            while s < n:
                lo = max(0, e - 1 - T)
                ref += logprob(model, x[lo:e], s - lo)
                s, e = e, min(n, e + T // 2)
        assert abs(ll - ref) <= TOL, (ctx[:20], cont[:20], ll, ref)
    # a whitespace-only context: lm-eval moves its whitespace onto the continuation, leaving no context tokens; it is
    # scored with EOS as the prefix, like an empty context (it used to stop the whole evaluation)
    blank, empty = lm.loglikelihood([Instance("loglikelihood", {}, c, i) for i, c in
                                     enumerate([("\n", " " + words[0]), ("", "\n " + words[0])])], disable_tqdm=True)
    assert blank == empty
    # rolling: [EOS] + text in disjoint windows of T
    text = english(2, 12)
    x = [1] + lm.tok_encode(text)
    ref = sum(logprob(model, x[max(0, e - 1 - T) : e], s - max(0, e - 1 - T))
              for s, e in [(1, T + 1), *((a, min(len(x), a + T)) for a in range(T + 1, len(x), T))])
    assert len(x) > 2 * T
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert abs(rolled - ref) <= TOL


def test_leak_free_auto_is_on_for_a_non_causal_checkpoint(setup, tmp_path: Path) -> None:
    """leak_free="auto" (the default) scores a non-causal checkpoint leak-free: as "on", not as "off"."""
    from lm_eval.api.instance import Instance

    root = setup[0]
    ckpt, model = save_checkpoint(tmp_path, root / "data", mix="mosa_expert_choice", seq_len=T)  # prepared_corpus(root)
    assert not model.causal
    words = english(3, 20).split()
    request = [Instance("loglikelihood", {}, (" ".join(words[:20]), " " + " ".join(words[20:26])), 0)]
    scores = {mode: SparseHeadsLM(str(ckpt), leak_free=mode).loglikelihood(request, disable_tqdm=True)[0][0]
              for mode in ("auto", "on", "off")}
    assert SparseHeadsLM(str(ckpt)).leak_free is True
    assert scores["auto"] == scores["on"] != scores["off"]


def test_generate_until_matches_greedy_decoding(setup) -> None:
    from lm_eval.api.instance import Instance

    _, _, model, lm = setup
    prompts = [english(3, 1), english(4, 1), english(5, 2)]
    reqs = [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 6}), i) for i, p in enumerate(prompts)]
    out = lm.generate_until(reqs, disable_tqdm=True)
    greedy = []
    for p, text in zip(prompts, out):
        ids = lm.tok_encode(p)[-(T - 6):]
        ref = generate(model, torch.tensor([ids]), 6, temperature=0, stop_id=1)[0, len(ids):].tolist()
        greedy.append(lm.tok_decode(ref[: ref.index(1)] if 1 in ref else ref))
        assert text == greedy[-1].split("\n\n")[0]
    # a stop string that does occur: the text before it, without it (lm-eval's contract)
    full = greedy[0]
    stop = full.strip()[2:4]
    assert len(stop) == 2 and stop in full
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompts[0], {"until": [stop], "max_gen_toks": 6}), 0)],
                                disable_tqdm=True)
    assert text == full[: full.index(stop)]


def test_generate_until_samples_at_the_requests_temperature(setup) -> None:
    """do_sample with a temperature draws as lm/generate.py does at that temperature from the same RNG state (not
    greedily), at temperature 1 when the request gives none; without do_sample the temperature is ignored (greedy)."""
    from lm_eval.api.instance import Instance

    _, _, model, lm = setup
    prompt = " ".join(english(3, 1).split()[:3])
    ids = lm.tok_encode(prompt)

    def request(**kw: object) -> str:
        torch.manual_seed(7)
        return lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 8, **kw}), 0)],
                                 disable_tqdm=True)[0]

    def reference(temperature: float) -> str:
        torch.manual_seed(7)
        out = generate(model, torch.tensor([ids]), 8, temperature=temperature, stop_id=1,
                       vocab=lm.sp.get_piece_size())[0, len(ids):].tolist()
        return lm.tok_decode(out[: out.index(1)] if 1 in out else out)

    sampled = request(do_sample=True, temperature=3.0)
    assert sampled == reference(3.0) != reference(0.0)
    assert request(do_sample=False, temperature=3.0) == request() == reference(0.0)
    # do_sample without a temperature samples at temperature 1 (it decoded greedily: do_sample did nothing)
    assert request(do_sample=True) == reference(1.0) != reference(0.0)


def test_generate_until_keeps_half_the_window_for_the_prompt(setup, capsys) -> None:
    """lm-eval's default max_gen_toks (256) above seq_len: the context keeps its last seq_len/2 tokens (it kept
    one token before), the generation fills the rest of the window, and one warning counts both cuts; a short
    prompt with a small max_gen_toks is cut by neither."""
    from lm_eval.api.instance import Instance

    _, _, model, lm = setup
    prompt = english(6, 3)
    ids = lm.tok_encode(prompt)
    assert len(ids) > T
    capsys.readouterr()
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": []}), 0)], disable_tqdm=True)
    kept = ids[-(T // 2):]
    ref = generate(model, torch.tensor([kept]), T - len(kept), temperature=0, stop_id=1)[0, len(kept):].tolist()
    assert text == lm.tok_decode(ref[: ref.index(1)] if 1 in ref else ref)
    assert capsys.readouterr().err.splitlines() == [
        f"warning: generate_until: within the model's seq_len {T}, 1 of 1 contexts were cut on the left and 1 "
        "generations were cut short of max_gen_toks"]
    short = " ".join(english(3, 1).split()[:3])
    assert len(lm.tok_encode(short)) <= T - 4
    lm.generate_until([Instance("generate_until", {}, (short, {"until": [], "max_gen_toks": 4}), 0)], disable_tqdm=True)
    assert capsys.readouterr().err == ""


def test_model_args_as_lm_eval_parses_them(setup) -> None:
    """lm-eval's --model_args parser gives leak_free=true as a bool and batch_size as auto:N: both accepted; bad
    values are one-line ValueErrors naming the argument."""
    _, ckpt, _, _ = setup
    lm = SparseHeadsLM.create_from_arg_string(f"ckpt={ckpt},leak_free=false", {"batch_size": "auto:4"})
    assert lm.leak_free is False and lm.batch_size == 8
    assert SparseHeadsLM.create_from_arg_string(f"ckpt={ckpt},leak_free=True,batch_size=2").leak_free is True
    for args, message in [(dict(leak_free="maybe"), "leak_free must be auto, on or off, got 'maybe'"),
                          (dict(batch_size=0), "batch size must be an integer >= 1 or auto, got 0"),
                          (dict(batch_size="big"), "batch size must be an integer >= 1 or auto, got 'big'")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            SparseHeadsLM(str(ckpt), **args)


# KV-cached decoding / prefix recomputed (not causal; causal but without a cache)
@pytest.mark.parametrize("mix", ["dense", "mosa_expert_choice", "routing"])
def test_padded_vocabulary_generates_only_the_tokenizers_ids(setup, tmp_path: Path, mix: str) -> None:
    """model.vocab_size above the tokenizer's pieces (as training allows): the checkpoint loads and
    generation, greedy or sampled, never produces an id the tokenizer cannot decode."""
    from lm_eval.api.instance import Instance

    root = setup[0]
    ckpt, _ = save_checkpoint(tmp_path, root / "data", mix=mix, seq_len=T, vocab_size=1024)
    lm = SparseHeadsLM(str(ckpt))
    pieces = lm.sp.get_piece_size()
    prompt = torch.tensor([lm.tok_encode(english(3, 1))[:8]] * 2)
    for temperature in (0.0, 3.0):
        assert int(lm._generate(prompt, 12, temperature).max()) < pieces < 1024
    reqs = [Instance("generate_until", {}, (english(4, 1), {"until": [], "max_gen_toks": 8, "do_sample": True,
                                                              "temperature": 3.0}), 0)]
    assert isinstance(lm.generate_until(reqs, disable_tqdm=True)[0], str)


def test_progress_bars_stay_out_of_logs(setup, capsys) -> None:
    """stderr that is not a terminal (a log file; here capsys) gets no progress-bar frames."""
    from lm_eval.api.instance import Instance

    lm = setup[3]
    capsys.readouterr()
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (english(2, 12),), 0)])
    short = " ".join(english(4, 1).split()[:5])  # within the window: no warning that its context was cut
    lm.loglikelihood([Instance("loglikelihood", {}, (short, " word"), 0)])  # lm-eval's tokenising bar too
    lm.generate_until([Instance("generate_until", {}, (english(3, 1), {"until": [], "max_gen_toks": 2}), 0)])
    assert capsys.readouterr().err == ""


def _write_tasks(root: Path) -> Path:
    words = english(9, 60).split()
    mc, cloze = [], []
    for i in range(8):
        ctx = " ".join(words[10 * i : 10 * i + 7])
        choices = [" ".join(words[10 * i + 7 : 10 * i + 9]), " ".join(words[300 + i : 302 + i]), words[500 + i]]
        mc.append({"context": ctx, "choices": [" " + c for c in choices], "label": 0})
        cloze.append({"context": ctx, "word": words[10 * i + 7]})
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    for name, rows, yaml_text in [("mc", mc, MC_YAML), ("cloze", cloze, CLOZE_YAML)]:
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(yaml_text.format(data=tasks / f"{name}.jsonl"))
    return tasks


def test_local_tasks_accuracy_equals_forward_pass(setup) -> None:
    root, ckpt, model, lm = setup
    tasks = _write_tasks(root)
    res = run(str(ckpt), ["local_mc", "local_cloze"], include_path=str(tasks), batch_size=4)["results"]
    mc = [json.loads(line) for line in (tasks / "mc.jsonl").read_text().splitlines()]
    right = 0
    for doc in mc:
        c = lm.tok_encode(doc["context"])
        lls = [logprob(model, c + lm.tok_encode(doc["context"] + ch)[len(c):], len(c)) for ch in doc["choices"]]
        right += max(range(len(lls)), key=lls.__getitem__) == doc["label"]
    assert res["local_mc"]["acc,none"] == pytest.approx(right / len(mc))
    cloze = [json.loads(line) for line in (tasks / "cloze.jsonl").read_text().splitlines()]
    hits = 0
    for doc in cloze:
        c = lm.tok_encode(doc["context"])
        x = c + lm.tok_encode(doc["context"] + " " + doc["word"])[len(c):]
        with torch.no_grad():
            pred = model(torch.tensor([x[:-1]]))[0].argmax(-1)
        hits += all(pred[i - 1].item() == x[i] for i in range(len(c), len(x)))
    assert res["local_cloze"]["acc,none"] == pytest.approx(hits / len(cloze))
    assert res["local_cloze"]["perplexity,none"] > 1


def test_task_documents_from_the_training_data_are_counted(setup, tmp_path: Path, capsys) -> None:
    """A task whose documents quote the checkpoint's training text is reported per task (lm/training_overlap.py),
    with a warning line; one of fresh text is reported clean; moved data is said to be unchecked."""
    from data_prep.split import Splitter

    root, ckpt, _, _ = setup
    src = root / "src"
    train_doc = next(p for p in sorted(src.iterdir()) if Splitter(0.25)(p.name) == "train")
    quoted, fresh = train_doc.read_text().split(), english(77, 60).split()
    rows = [{"context": " ".join(words[40 * i : 40 * i + 150]), "word": words[40 * i + 150]}
            for words in (quoted, fresh) for i in range(3)]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, part in (("quoted", rows[:3]), ("fresh", rows[3:])):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        (tasks / f"{name}.yaml").write_text(CLOZE_YAML.replace("local_cloze", name).format(data=tasks / f"{name}.jsonl"))
    out = tmp_path / "res.json"
    assert main(["--ckpt", str(ckpt), "--tasks", "quoted,fresh", "--include-path", str(tasks), "--output", str(out)]) == 0
    report = json.loads(out.read_text())["training_data"]
    assert report["tasks"] == {"quoted": {"documents": 3, "documents_in_training_data": 3},
                               "fresh": {"documents": 3, "documents_in_training_data": 0}}
    assert report["checked_against"] == str((root / "data").resolve()) and report["sampled_ngrams"] > 0
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith(f"fresh: 0 of 3 documents are in the checkpoint's training data ({root / 'data'}; "), err
    assert err[-1].startswith("warning: quoted: 3 of 3 documents are in the checkpoint's training data"), err
    assert main(["--ckpt", str(ckpt), "--tasks", "quoted", "--include-path", str(tasks), "--limit", "1",
                 "--train-data", str(tmp_path / "nowhere")]) == 2  # given by hand: refused before the evaluation
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: --train-data: {tmp_path / 'nowhere'} is not a "
                                                        "prepared directory here")


def test_cli_runs_and_bad_input_is_one_line(setup, tmp_path: Path, capsys) -> None:
    root, ckpt, _, _ = setup
    tasks = _write_tasks(tmp_path)
    out = tmp_path / "res.json"
    assert main(["--ckpt", str(ckpt), "--tasks", "local_mc", "--include-path", str(tasks), "--limit", "3",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr()
    assert "local_mc" in printed.out and "local_mc" in json.loads(out.read_text())["results"]
    # stderr is not a terminal here: no bar frames from datasets (a new data file: its split is generated) or
    # lm-eval (building the requests), only the warning that some prompts are longer than the model's window
    # (seq_len 32 here) and the training-data line
    lines = printed.err.splitlines()
    assert lines[0] == ("warning: loglikelihood: 3 of 9 requests are longer than the 33 tokens of one window (seq_len "
                        "32): their continuations are scored from at most 32 tokens of history, the rest of the context "
                        "cut on the left")
    assert lines[1:] and lines[1:] == [line for line in lines[1:] if line.startswith("local_mc: ")]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.yaml").write_text("task: x\ndoc_to_text: [unclosed\n")
    cases = [(["--ckpt", str(ckpt), "--tasks", "local_mc", "--include-path", str(broken)], "does not parse"),
             (["--ckpt", str(root / "missing.ckpt"), "--tasks", "local_mc", "--include-path", str(tasks)], "checkpoint not found"),
             (["--ckpt", str(ckpt), "--tasks", "local_mc", "--include-path", str(tasks), "--output",
               str(tmp_path / "nodir" / "r.json")], "--output " + str(tmp_path / "nodir" / "r.json") + ": directory"),
             (["--ckpt", str(ckpt), "--tasks", "local_mc", "--include-path", str(tasks), "--output", str(ckpt)],
              f"--output {ckpt} is --ckpt {ckpt}: writing it would destroy that input"),
             *[(["--ckpt", str(ckpt), "--tasks", "local_mc", "--include-path", str(tasks), "--limit", value],
                f"--limit must be > 0 (documents per task, or a fraction of them below 1), got {float(value)}")
               for value in ("0", "-2", "nan")],
             (["--ckpt", str(ckpt), "--tasks", "local_mc", "--include-path", str(tasks), "--num-fewshot", "-1"],
              "--num-fewshot must be >= 0, got -1")]
    for args, message in cases:
        assert_one_line_error(main(args), capsys, message)


def test_a_task_dataset_that_cannot_be_read_is_one_line(setup, tmp_path: Path, capsys) -> None:
    """A local task whose data file is gone (bench.eval_quickstart writes absolute paths, so moving the files does
    that), and a task whose dataset is on the hub while offline: one line each, exit status 2 (they were
    tracebacks of 50-60 lines)."""
    import os
    import subprocess
    import sys

    _, ckpt, _, _ = setup
    tasks = _write_tasks(tmp_path)
    (tasks / "mc.jsonl").unlink()
    assert_one_line_error(main(["--ckpt", str(ckpt), "--tasks", "local_mc", "--include-path", str(tasks)]), capsys,
                          "a task's data file is missing (FileNotFoundError: ")
    hub = tmp_path / "hub"
    hub.mkdir()
    local_files = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    assert local_files in MC_YAML
    (hub / "hub.yaml").write_text(MC_YAML.replace("local_mc", "hub_mc").replace(
        local_files, "dataset_path: sparse-heads-lm/no-such-dataset\n").format())
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # read when datasets is imported
    done = subprocess.run([sys.executable, "-m", "lm.lm_eval", "--ckpt", str(ckpt), "--tasks", "hub_mc",
                           "--include-path", str(hub)], capture_output=True, text=True, env=offline, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert err[0].startswith("error: a task's dataset could not be downloaded (") and "HF_HUB_OFFLINE" in err[0]


def assert_one_line_error(rc: int, capsys, message: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_unknown_task_is_one_line(setup, tmp_path: Path, capsys) -> None:
    """Indexes lm-eval's ~15k built-in task configs (~15 s of CPU) before saying the name is unknown."""
    _, ckpt, _, _ = setup
    tasks = _write_tasks(tmp_path)
    assert_one_line_error(main(["--ckpt", str(ckpt), "--tasks", "local_mc,no_such_task", "--include-path", str(tasks)]),
                          capsys, "unknown task(s) no_such_task")


def test_a_generation_ends_at_its_first_end_of_text_token(setup) -> None:
    """generate_until's text stops at the first EOT token (the path of heads that cannot decode incrementally runs on
    past it), and the stop strings then cut what is left."""
    _, _, _, lm = setup
    first, second = lm.tok_encode("the old house"), lm.tok_encode("stood on the hill")
    generated = [*first, lm.eot_token_id, *second, lm.eot_token_id]
    assert lm._cut(generated, []) == lm.tok_decode(first) == "the old house"
    assert lm._cut(generated, ["hill"]) == "the old house"
    assert lm._cut(generated, "old") == "the "
    assert lm._cut(second, "hill") == "stood on the "


def test_generate_until_refuses_a_generation_of_no_tokens(setup) -> None:
    """max_gen_toks 0 in a task's generation_kwargs: one line naming it, not an empty generation scored as an
    answer."""
    from lm_eval.api.instance import Instance

    _, _, _, lm = setup
    request = Instance("generate_until", {}, ("the old house", {"until": [], "max_gen_toks": 0}), 0)
    with pytest.raises(ValueError, match=r"^generate_until: max_gen_toks must be >= 1, got 0$"):
        lm.generate_until([request], disable_tqdm=True)


def test_an_unchecked_training_data_report_is_one_note_line() -> None:
    """When the task documents could not be checked against the training data, the report is one note saying why,
    never a per-task 'none in the training data'."""
    from lm.lm_eval import training_data_lines

    report = {"checked_against": None, "not_checked_because": "the checkpoint records no training data directory",
              "ngrams_not_checked_because": None, "tasks": {"local_mc": {"documents": 4, "documents_in_training_data": 0}}}
    assert training_data_lines(report) == ["note: task documents not checked against the training data: the "
                                           "checkpoint records no training data directory"]
