"""Multiple-choice tasks as ranked choices: the task file reader's one-line errors, scoring
against a plain per-request loop and a Hugging Face export, batching and sharding, left
truncation, few-shot prompts, and the bundled tasks' deterministic build."""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
from pathlib import Path

import fsspec
import pytest
import torch
from hf_helpers import export_hf_folder
from safetensors.torch import save_file

from titan_core.components.ranked_choice import (
    CONTINUATION_DELIMITER,
    SHOT_SEPARATOR,
    ChoiceRequests,
    build_requests,
    choice_metrics,
    draw_shots,
    few_shot_prefix,
    plan_batches,
    score_choice_task,
    score_requests,
    shard_batches,
)
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.data.assets import bundled_tasks_dir
from titan_core.data.bundled_tasks import NUM_CHOICES, NUM_SHOTS, NUM_TEST, build_bundled_tasks
from titan_core.data.choice_tasks import (
    ChoiceExample,
    read_choice_task,
    read_harness_task,
    write_choice_task,
)
from titan_core.errors import ConfigError, DataError
from titan_core.models import get_flavor, get_model_spec

CPU = torch.device("cpu")
TASKS = ("next_sentence", "line_closing")


@pytest.fixture(scope="module")
def tokenizer(assets: Path) -> Tokenizer:
    return Tokenizer(str(default_tokenizer_path()))


@pytest.fixture(scope="module")
def model(tokenizer: Tokenizer) -> torch.nn.Module:
    """The tiny debug Llama, initialized as the trainer does, from a fixed seed."""
    args = get_flavor("llama3", "debugmodel_tiny")
    args.vocab_size = tokenizer.n_words
    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_model_spec("llama3").model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


def _task(name: str, split: str = "test") -> list[ChoiceExample]:
    return read_choice_task(str(bundled_tasks_dir() / name / f"{split}.jsonl"))


def _plain_loglikelihoods(model: torch.nn.Module, task: ChoiceRequests) -> list[float]:
    """Every request alone, its whole log_softmax in float64: the reference."""
    out = []
    with torch.no_grad():
        for r in task.requests:
            ids = torch.tensor([r.tokens])
            logp = torch.log_softmax(model(ids[:, :-1])[0].double(), dim=-1)  # (seq, vocab)
            start = len(r.tokens) - 1 - r.num_scored
            targets = ids[0, -r.num_scored :, None]
            out.append(logp[start:].gather(1, targets).sum().item())
    return out


def _rel(ours: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, ref, strict=True))


# --- the task file format ------------------------------------------------------------------

GOOD = {"context": "To be, or not to", "choices": ["be", "cat"], "gold": 0}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"context": "a", "choices": ["b"', "line 2: bad JSON (Expecting"),
        (json.dumps({**GOOD, "gold": 2}), "line 2: gold index 2 out of range for 2 choices"),
        (json.dumps({**GOOD, "gold": -1}), "line 2: gold index -1 out of range"),
        (json.dumps({**GOOD, "choices": []}), "line 2: 'choices' is empty"),
        (json.dumps({"context": "a", "gold": 0}), "line 2: missing key 'choices'"),
        (json.dumps({**GOOD, "gold": "0"}), "line 2: 'gold' is str, expected an int"),
        (json.dumps({**GOOD, "gold": True}), "line 2: 'gold' is bool, expected an int"),
        (json.dumps({**GOOD, "choices": "be"}), "line 2: 'choices' must be a list of strings"),
        (json.dumps({**GOOD, "choices": ["be", " "]}), "line 2: a choice is empty or blank"),
        (json.dumps([GOOD]), "line 2: expected a JSON object, got list"),
    ],
)
def test_a_bad_line_is_one_error_naming_the_file_and_line(
    tmp_path: Path, line: str, expected: str
) -> None:
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(DataError) as e:
        read_choice_task(str(path))
    message = str(e.value)
    assert message.startswith(f"{path} {expected}") and "\n" not in message, message


def test_missing_or_empty_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        read_choice_task(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no examples"):
        read_choice_task(str(tmp_path / "empty.jsonl"))


def test_task_files_round_trip_on_any_url(tmp_path: Path) -> None:
    examples = [ChoiceExample("Héllo", ("wörld", "x\ny"), 1), ChoiceExample("a", ("b",), 0)]
    write_choice_task("memory://tasks/t.jsonl", examples)
    assert read_choice_task("memory://tasks/t.jsonl") == examples
    with fsspec.open("memory://tasks/t.jsonl", "rb") as f:
        (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(f.read()))
    assert read_choice_task(str(tmp_path / "t.jsonl.gz")) == examples  # compression inferred
    with pytest.raises(DataError, match=r"^memory://tasks/x.jsonl: file not found"):
        read_choice_task("memory://tasks/x.jsonl")


def test_harness_rows_map_to_examples(tmp_path: Path) -> None:
    """lm-eval's own data: hellaswag (preprocessed as its YAML does), arc, piqa."""
    hellaswag = {
        "activity_label": "Removing ice from car",
        "ctx_a": "Then, the man writes over the snow covering the window of a car.",
        "ctx_b": "then",
        "endings": ["a [title] b", "c", "d", "e"],
        "label": "3",
    }
    choices = {"text": ["ice", "steam"], "label": ["A", "B"]}
    arc = {"question": "Which is a gas?", "choices": choices, "answerKey": "B"}
    piqa = {"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0}
    for name, row in (("hellaswag", hellaswag), ("arc", arc), ("piqa", piqa)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    (ex,) = read_harness_task(str(tmp_path / "hellaswag.jsonl"), "hellaswag")
    assert ex.context == (
        "Removing ice from car: Then, the man writes over the snow covering the window of a "
        "car. Then"
    )
    assert ex.choices == ("a. b", "c", "d", "e") and ex.gold == 3
    (ex,) = read_harness_task(str(tmp_path / "arc.jsonl"), "arc")
    assert ex == ChoiceExample("Question: Which is a gas?\nAnswer:", ("ice", "steam"), 1)
    (ex,) = read_harness_task(str(tmp_path / "piqa.jsonl"), "piqa")
    assert ex.choices == ("twist the lid", "eat the lid") and ex.gold == 0
    with pytest.raises(DataError, match=r"arc\.jsonl line 1: missing key 'goal' for the piqa"):
        read_harness_task(str(tmp_path / "arc.jsonl"), "piqa")
    with pytest.raises(DataError, match=r"unknown task format 'mmlu' \(known: hellaswag"):
        read_harness_task(str(tmp_path / "arc.jsonl"), "mmlu")


def test_harness_reads_a_saved_datasets_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    choices = {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}
    rows = [{"question": f"Q{i}?", "choices": choices, "answerKey": "3"} for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "arc"))
    examples = read_harness_task(str(tmp_path / "arc"), "arc")
    assert [e.gold for e in examples] == [2, 2, 2] and examples[1].context.startswith(
        "Question: Q1?"
    )


# --- scoring -------------------------------------------------------------------------------


def test_scoring_equals_a_plain_loop_and_metrics_by_hand(
    model: torch.nn.Module, tokenizer: Tokenizer
) -> None:
    examples = _task("next_sentence")[:10] + _task("line_closing")[:10]
    task = build_requests("mixed", examples, tokenizer, max_seq_len=2048)
    assert len(task.requests) == 20 * NUM_CHOICES and task.num_truncated == 0
    metrics = score_choice_task(model, task, batch_size=7, device=CPU)  # a partial last batch
    ours = [ll for per_example in metrics.loglikelihoods for ll in per_example]
    ref = _plain_loglikelihoods(model, task)
    assert _rel(ours, ref) <= 1e-6
    # The metrics by hand from the reference.
    hits = {"acc": 0, "acc_per_token": 0, "acc_per_char": 0}
    nats = nbytes = 0.0
    for i, example in enumerate(examples):
        reqs = task.requests[4 * i : 4 * i + 4]
        lls = ref[4 * i : 4 * i + 4]
        texts = [CONTINUATION_DELIMITER + c for c in example.choices]
        assert [r.num_chars for r in reqs] == [len(t) for t in texts]
        tokens = [len(tokenizer.encode(t, bos=False, eos=False)) for t in texts]
        hits["acc"] += max(range(4), key=lambda c: lls[c]) == example.gold
        hits["acc_per_token"] += max(range(4), key=lambda c: lls[c] / tokens[c]) == example.gold
        hits["acc_per_char"] += max(range(4), key=lambda c: lls[c] / len(texts[c])) == example.gold
        nats -= lls[example.gold]
        nbytes += len(texts[example.gold].encode())
    assert metrics.num_examples == 20
    for key, count in hits.items():
        assert getattr(metrics, key) == count / 20, key
    assert metrics.bits_per_byte == pytest.approx(nats / math.log(2) / nbytes, rel=1e-6)
    assert set(metrics.summary()) == {*hits, "bits_per_byte", "num_examples", "num_truncated"}


def test_batched_equals_unbatched_and_shards_add_up(
    model: torch.nn.Module, tokenizer: Tokenizer
) -> None:
    task = build_requests("t", _task("line_closing")[:12], tokenizer, max_seq_len=2048)
    alone = shard_batches(plan_batches(task.requests, 1), 0, 1)
    one = score_requests(model, task.requests, alone, device=CPU)
    plan = plan_batches(task.requests, 5)
    order = [i for batch in plan for i in batch]
    assert plan == plan_batches(task.requests, 5) and sorted(order) == list(range(48))
    lengths = [len(task.requests[i].tokens) for i in order]
    assert lengths == sorted(lengths, reverse=True)  # longest first
    batched = score_requests(model, task.requests, shard_batches(plan, 0, 1), device=CPU)
    assert _rel(batched.tolist(), one.tolist()) <= 1e-6
    # Three data-parallel ranks: the same number of forwards each, every request scored once,
    # and the sum (what an all-reduce gives) is the single process's tensor.
    shards = [shard_batches(plan, rank, 3) for rank in range(3)]
    assert {len(s) for s in shards} == {math.ceil(len(plan) / 3)}
    scored = [i for s in shards for batch, counts in s if counts for i in batch]
    assert sorted(scored) == list(range(48))
    total = sum(score_requests(model, task.requests, s, device=CPU) for s in shards)
    assert torch.equal(total, batched)
    assert choice_metrics(task, total) == choice_metrics(task, batched)


def test_packed_batches_fit_the_token_budget_and_score_the_same(
    model: torch.nn.Module, tokenizer: Tokenizer
) -> None:
    """``max_tokens`` packs short requests into fewer forwards (multiples of batch_size rows,
    rows x width within the budget, never fewer than batch_size rows): same scores."""
    from titan_core.components.evaluators import subset_examples
    from titan_core.config.job import parse_evaluators

    (entry,) = parse_evaluators(["lc=task:line_closing?examples=10&seed=7"])
    assert entry.option("examples", 0) == 10
    with pytest.raises(ConfigError, match="examples >= 1"):
        parse_evaluators(["lc=task:line_closing?examples=0"])
    examples = _task("line_closing")
    subset = subset_examples(examples, 10, 7)
    assert subset == subset_examples(examples, 10, 7) != subset_examples(examples, 10, 8)
    assert subset == [e for e in examples if e in subset] and len(subset) == 10  # file order
    assert subset_examples(examples, 0, 7) == examples == subset_examples(examples, 999, 7)
    task = build_requests("t", subset, tokenizer, max_seq_len=2048)
    plan = plan_batches(task.requests, 2)
    packed = plan_batches(task.requests, 2, max_tokens=200)
    assert sorted(i for b in packed for i in b) == list(range(40)) and len(packed) < len(plan)
    for batch in packed[:-1]:
        width = max(len(task.requests[i].tokens) - 1 for i in batch)
        assert len(batch) % 2 == 0 and (len(batch) == 2 or len(batch) * width <= 200)
    one = score_requests(model, task.requests, shard_batches(plan, 0, 1), device=CPU)
    two = score_requests(model, task.requests, shard_batches(packed, 0, 1), device=CPU)
    assert _rel(two.tolist(), one.tolist()) <= 1e-6


def test_long_contexts_are_cut_from_the_left_and_counted(
    model: torch.nn.Module, tokenizer: Tokenizer
) -> None:
    examples = _task("next_sentence")[:8]
    full = build_requests("t", examples, tokenizer, max_seq_len=2048)
    short = build_requests("t", examples, tokenizer, max_seq_len=80)
    longest = max(len(r.tokens) for r in full.requests)
    assert longest > 81  # else nothing to cut
    cut = {r.example for r in full.requests if len(r.tokens) > 81}
    assert 0 < short.num_truncated == len(cut) < len(examples)
    for a, b in zip(full.requests, short.requests, strict=True):
        assert len(b.tokens) <= 81 and b.tokens == a.tokens[len(a.tokens) - len(b.tokens) :]
        assert b.num_dropped == len(a.tokens) - len(b.tokens) and b.num_scored == a.num_scored
    metrics = score_choice_task(model, short, batch_size=8, device=CPU)
    assert metrics.num_examples == 8 and metrics.num_truncated == len(cut)
    scores = [x for per_example in metrics.loglikelihoods for x in per_example]
    assert _rel(scores, _plain_loglikelihoods(model, short)) <= 1e-6
    huge = [ChoiceExample("a", ("word " * 100,), 0)]
    with pytest.raises(
        DataError, match=r"^t: example 0 choice 0 is \d+ tokens; at most max_seq_len 80"
    ):
        build_requests("t", huge, tokenizer, max_seq_len=80)


def test_few_shot_prompts_are_seeded_and_drawn_from_the_other_split(
    tokenizer: Tokenizer,
) -> None:
    examples, shots = _task("line_closing")[:3], _task("line_closing", "shots")
    drawn = draw_shots(shots, 3, seed=7)
    assert drawn == draw_shots(shots, 3, seed=7) and drawn != draw_shots(shots, 3, seed=8)
    assert all(s in shots for s in drawn) and len(set(drawn)) == 3
    prefix = few_shot_prefix(drawn)
    shot_texts = [s.context + " " + s.choices[s.gold] + SHOT_SEPARATOR for s in drawn]
    assert prefix == "".join(shot_texts)
    few = {"max_seq_len": 2048, "shots": shots, "num_shots": 3, "seed": 7}
    task = build_requests("t", examples, tokenizer, **few)
    assert task == build_requests("t", examples, tokenizer, **few)
    for r in task.requests:
        example = examples[r.example]
        context = tokenizer.encode(prefix + example.context, bos=True, eos=False)
        choice = tokenizer.encode(" " + example.choices[r.choice], bos=False, eos=False)
        assert r.tokens == (*context, *choice)
    zero = build_requests("t", examples, tokenizer, max_seq_len=2048)
    first = tokenizer.encode(examples[0].context, bos=False, eos=False)[0]
    assert zero.requests[0].tokens[:2] == (tokenizer.bos_id, first)  # no prefix at 0 shots
    with pytest.raises(ConfigError, match="is also an example to score"):
        build_requests("t", examples, tokenizer, max_seq_len=2048, shots=examples, num_shots=2)
    with pytest.raises(ConfigError, match=rf"num_shots: expected 0..{NUM_SHOTS} .*got 21"):
        draw_shots(shots, 21)


# --- the bundled tasks ---------------------------------------------------------------------


def _validation_docs(assets: Path) -> list[str]:
    path = assets / "corpus" / "validation" / "part-0000.jsonl"
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_bundled_tasks_build_deterministically(assets: Path, tmp_path: Path) -> None:
    docs = _validation_docs(assets)
    first = build_bundled_tasks(docs, tmp_path / "a")
    assert first == build_bundled_tasks(docs, tmp_path / "b")
    # What the assets step built is this very build.
    built = json.loads((assets / "choice_tasks" / "manifest.json").read_text())["by_task"]
    assert built == first and sorted(first) == sorted(TASKS)
    for name in TASKS:
        for split, count in (("test", NUM_TEST), ("shots", NUM_SHOTS)):
            data = (tmp_path / "a" / name / f"{split}.jsonl").read_bytes()
            assert data == (tmp_path / "b" / name / f"{split}.jsonl").read_bytes()
            examples = read_choice_task(str(tmp_path / "a" / name / f"{split}.jsonl"))
            assert len(examples) == count == first[name][split]["examples"]
            for e in examples:
                assert len(set(e.choices)) == len(e.choices) == NUM_CHOICES
                assert 0 <= e.gold < NUM_CHOICES
            if split == "test":  # the right answer is not always in one place
                golds = [e.gold for e in examples]
                assert min(golds.count(g) for g in range(NUM_CHOICES)) > count / 8
        test = {e.context for e in _task(name)}
        assert not test & {e.context for e in _task(name, "shots")}


def test_bundled_answers_come_from_validation_text(assets: Path) -> None:
    """The true answers are validation text: a line's second half sits in a validation
    document; the corpus's train and validation documents are disjoint (test_data)."""
    docs = _validation_docs(assets)
    for e in _task("line_closing"):
        head = e.context.rsplit("\n", 1)[-1]
        assert any(f"{head} {e.choices[e.gold]}" in d for d in docs)
    joined = [" ".join(d.split()) for d in docs]
    for e in _task("next_sentence"):
        assert any(f"{e.context} {e.choices[e.gold]}" in d for d in joined)


def test_an_untrained_model_is_near_chance(model: torch.nn.Module, tokenizer: Tokenizer) -> None:
    for name in TASKS:
        task = build_requests(name, _task(name), tokenizer, max_seq_len=2048)
        metrics = score_choice_task(model, task, batch_size=32, device=CPU)
        assert metrics.num_examples == NUM_TEST and metrics.num_truncated == 0
        for acc in (metrics.acc, metrics.acc_per_token, metrics.acc_per_char):
            assert 0.1 < acc < 0.45, (name, metrics.summary())
        # ~log2(vocab) bits per token over ~4 bytes per token
        assert 1.0 < metrics.bits_per_byte < 6.0


# --- parity with Hugging Face --------------------------------------------------------------


def _family_model(family: str, vocab: int) -> torch.nn.Module:
    """A family's tiny debug model, initialized as the trainer does, from a fixed seed
    (DeepSeek-V3 without its MTP block, which ``transformers`` does not hold)."""
    args = get_flavor(family, "debugmodel_tiny")
    args.vocab_size = vocab
    if hasattr(args, "mtp_layers"):
        args.mtp_layers = 0
    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_model_spec(family).model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "deepseek_v3"])
def test_hf_export_scores_the_same(
    family: str, model: torch.nn.Module, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """A task scored by the engine and by ``transformers`` loading the exported folder: the
    same log-likelihood of every choice (<= 1e-5 relative, fp32), so the same accuracies."""
    import transformers

    if family == "llama3":
        export_hf_folder(model, tokenizer, tmp_path / "hf")
    else:
        model = _family_model(family, tokenizer.n_words)
        spec = get_model_spec(family)
        config = dict(spec.hf.to_hf_config(model.model_args))
        config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        config.save_pretrained(tmp_path / "hf")  # + the tensors as the converter names them
        tensors = spec.hf.to_hf(model.state_dict(), model.model_args)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, tmp_path / "hf" / "model.safetensors"
        )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", local_files_only=True, dtype=torch.float32
    ).eval()
    examples = _task("next_sentence")[:6] + _task("line_closing")[:6]
    shots = _task("next_sentence", "shots")
    task = build_requests("t", examples, tokenizer, max_seq_len=2048, shots=shots, num_shots=2)
    ours = score_choice_task(model, task, batch_size=5, device=CPU)
    theirs = score_choice_task(lambda ids: hf(ids).logits, task, batch_size=5, device=CPU)
    flat = [[x for e in m.loglikelihoods for x in e] for m in (ours, theirs)]
    assert _rel(flat[0], flat[1]) <= 1e-5
    assert ours.summary()["acc"] == theirs.summary()["acc"]
    assert ours.summary()["acc_per_char"] == theirs.summary()["acc_per_char"]


def test_documented_example_runs(model: torch.nn.Module, capsys: pytest.CaptureFixture) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text()
    (block,) = re.findall(r"```python\n(# ranked choice.*?)```", doc, re.S)
    exec(block, {"model": model, "torch": torch})
    assert "'num_examples': 300, 'num_truncated': 0" in capsys.readouterr().out


def test_assets_built_before_the_tasks_gain_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_core.data import assets as assets_mod

    # Fast sources (no stdlib scan, no download): a small validation split, fewer examples.
    monkeypatch.setattr(assets_mod, "stdlib_docstring_docs", lambda: [])
    monkeypatch.setattr(assets_mod, "shakespeare_docs", lambda workdir: [])
    root = assets_mod.ensure_assets(tmp_path / "assets")
    manifest = (root / "choice_tasks" / "manifest.json").read_text()
    shutil.rmtree(root / "choice_tasks")  # as built before the tasks existed
    done = (root / "DONE").stat().st_mtime_ns
    assert assets_mod.ensure_assets(root) == root
    assert (root / "DONE").stat().st_mtime_ns == done  # no corpus rebuild
    assert (root / "choice_tasks" / "manifest.json").read_text() == manifest
    for name in TASKS:
        assert read_choice_task(str(root / "choice_tasks" / name / "test.jsonl"))
    assert sorted(p.name for p in root.iterdir()) == ["DONE", "choice_tasks", "corpus", "tokenizer"]
