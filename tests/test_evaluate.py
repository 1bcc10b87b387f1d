"""`titan eval`: metrics against a plain loop, bits per byte on a known text, greedy decoding by
hand, the report, torchrun parity, lm-eval offline, and bad input rejected in one line."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import fsspec
import pytest
import tomli_w
import torch
from helpers import TINY
from hf_helpers import export_hf_folder
from storage_faults import Disk, files_under, one_line, titan
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_core.checkpoint.manager import COMMIT_MARKER
from titan_core.cli.evaluate import main as eval_main
from titan_core.cli.evaluate import parse_eval_args
from titan_core.config.schema import apply_values
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.evaluate import (
    compute_metrics,
    count_text_bytes,
    evaluate_checkpoint,
    generate_samples,
    token_byte_lengths,
)
from titan_core.evaluate.harness import local_copy
from titan_core.models import get_flavor, get_model_spec
from titan_core.resolve import parse_args
from titan_core.train import run

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 64  # llama3_debugmodel_tiny's training.seq_len
ONE_BATCH = {"evaluate.batches": 1, "evaluate.prompts": []}
# dcp_to_torch_save, used to load weights independently of titan's loader, warns in one process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Path:
    """A 4-step tiny run: full checkpoint at step 2, model-only (last save) at step 4."""
    dump = tmp_path_factory.mktemp("eval_run")
    argv = [*TINY, "--job.dump_folder", str(dump), "--training.steps", "4"]
    argv += ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    argv += ["--checkpoint.last_save_model_only", "--validation.no_enable"]
    run(parse_args([*argv, "--metrics.cpu_peak_tflops", "1"]))
    return dump


@pytest.fixture(scope="module")
def tokenizer(assets: Path) -> Tokenizer:
    return Tokenizer(str(default_tokenizer_path()))


def _titan_model(step_dir: Path, vocab: int) -> nn.Module:
    """The tiny model loaded through torch.save conversion, not through titan's loader."""
    args = get_flavor("llama3", "debugmodel_tiny")
    args.vocab_size = vocab
    model = get_model_spec("llama3").model_cls(args)
    dcp_to_torch_save(str(step_dir), str(step_dir.parent / f"{step_dir.name}.pt"))
    state = torch.load(step_dir.parent / f"{step_dir.name}.pt")["model"]
    model.load_state_dict(state)
    return model.eval()


def _chunks(tokenizer: Tokenizer, jsonl: Path) -> torch.Tensor:
    """Every packed (seq_len + 1)-token chunk of a jsonl file's documents (the tail dropped)."""
    stream: list[int] = []
    for line in jsonl.read_text().splitlines():
        stream += tokenizer.encode(json.loads(line)["text"], bos=True, eos=True)
    size = SEQ_LEN + 1
    return torch.tensor(stream[: len(stream) // size * size]).view(-1, size)  # (n, seq + 1)


def test_metrics_match_a_plain_loop(run_dir: Path, tmp_path: Path, tokenizer: Tokenizer) -> None:
    # A whole (small) split of validation documents, in batches of 16 with a partial last one,
    # so that loss must weight by token, not by batch.
    rows = (default_tokenizer_path().parents[1] / "corpus/validation/part-0000.jsonl").read_text()
    (tmp_path / "val.jsonl").write_text("".join(rows.splitlines(keepends=True)[:12]))
    overrides = ["--validation.dataset", str(tmp_path / "val.jsonl")]
    overrides += ["--validation.local_batch_size", "16", "--evaluate.batches", "0"]
    overrides += ["--evaluate.prompts"]  # an empty list: no samples
    report = evaluate_checkpoint(str(run_dir / "checkpoint"), config_argv=overrides)
    assert report["step"] == 4 and report["checkpoint"].endswith("step-4")  # newest complete
    model = _titan_model(run_dir / "checkpoint" / "step-4", tokenizer.n_words)
    chunks = _chunks(tokenizer, tmp_path / "val.jsonl")
    with torch.no_grad():
        logp = torch.log_softmax(model(chunks[:, :-1]).double(), dim=-1)  # (n, seq, vocab)
    nats = -logp.gather(2, chunks[:, 1:, None]).sum().item()
    specials = set(tokenizer.special_tokens.values())
    text_ids = [t for t in chunks[:, 1:].flatten().tolist() if t not in specials]
    num_bytes = len(tokenizer.model.decode_bytes(text_ids))
    m = report["metrics"]
    assert len(chunks) % 16 and m["num_batches"] == math.ceil(len(chunks) / 16)
    assert m["num_tokens"] == chunks[:, 1:].numel() and m["num_bytes"] == num_bytes
    assert m["loss"] == pytest.approx(nats / m["num_tokens"], rel=1e-6)
    assert m["bits_per_byte"] == pytest.approx(nats / math.log(2) / num_bytes, rel=1e-6)
    assert m["perplexity"] == pytest.approx(math.exp(m["loss"]), rel=1e-12)
    # Default output: the run root, next to checkpoint/ and config.toml.
    saved = json.loads((run_dir / "eval" / "report.json").read_text())
    assert saved["metrics"] == m and saved["model"]["flavor"] == "debugmodel_tiny"
    assert "| bits per byte |" in (run_dir / "eval" / "report.md").read_text()


class _Uniform(nn.Module):
    """Zero logits: every token costs exactly ln(vocab) nats."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, self.vocab)


def test_bits_per_byte_on_a_known_text(tokenizer: Tokenizer) -> None:
    text = "Héllo, wörld — 漢字 ✓\nTo be, or not to be: that is the question."
    ids = torch.tensor(tokenizer.encode(text, bos=True, eos=True))
    labels = ids[1:]  # the eos label is scored but stands for no text
    table = token_byte_lengths(tokenizer)
    assert count_text_bytes(labels, table) == len(text.encode("utf-8")) == 72
    batches = [(ids[None, :-1], labels[None])]
    m = compute_metrics(_Uniform(tokenizer.n_words), batches, table, device=torch.device("cpu"))
    vocab, num_tokens = tokenizer.n_words, labels.numel()
    assert m.num_tokens == num_tokens and m.num_bytes == 72 and m.num_batches == 1
    assert m.loss == pytest.approx(math.log(vocab), rel=1e-6)
    assert m.perplexity == pytest.approx(vocab, rel=1e-6)
    assert m.bits_per_byte == pytest.approx(num_tokens * math.log2(vocab) / 72, rel=1e-6)


class _Counter(nn.Module):
    """Predicts last token + 1, and eos once the sequence is ``eos_at`` long."""

    def __init__(self, vocab: int, eos_id: int, eos_at: int) -> None:
        super().__init__()
        self.vocab, self.eos_id, self.eos_at = vocab, eos_id, eos_at

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, self.vocab)
        nxt = self.eos_id if tokens.shape[1] >= self.eos_at else int(tokens[0, -1]) % 100 + 1
        logits[:, -1, nxt] = 1.0
        return logits


def _text_bytes(tokenizer: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tokenizer.model.decode_single_token_bytes(i) for i in ids)


def _shows_as_text(tokenizer: Tokenizer, new: list[int], candidate: int) -> bool:
    """By hand: eos, or an ordinary token after which the completion's bytes are UTF-8 (its
    last character may be unfinished)."""
    if candidate == tokenizer.eos_id:
        return True
    if candidate in tokenizer.special_tokens.values():
        return False
    try:
        _text_bytes(tokenizer, [*new, candidate]).decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"
    return True


def test_greedy_generation_is_argmax_by_hand(run_dir: Path, tokenizer: Tokenizer) -> None:
    """The best-scored id that shows as text, eos stopping; an unfinished last character is
    dropped. The tiny model's own argmax is often a special token or a stray byte."""
    model = _titan_model(run_dir / "checkpoint" / "step-4", tokenizer.n_words)
    cpu, prompts = torch.device("cpu"), ["The Python language", "To be"]
    kwargs = {"max_new_tokens": 12, "max_seq_len": 2048, "device": cpu}
    first = generate_samples(model, tokenizer, prompts, **kwargs)
    assert first == generate_samples(model, tokenizer, prompts, **kwargs)  # deterministic
    for sample, prompt in zip(first, prompts):
        ids = tokenizer.encode(prompt, bos=True, eos=False)
        new: list[int] = []
        with torch.no_grad():
            while len(new) < 12:
                logits = model(torch.tensor([ids + new]))[0, -1, : tokenizer.n_words]
                order = torch.argsort(logits, descending=True, stable=True).tolist()
                nxt = next(i for i in order if _shows_as_text(tokenizer, new, i))
                if nxt == tokenizer.eos_id:
                    break
                new.append(nxt)
        while new:  # an unfinished last character is dropped
            try:
                _text_bytes(tokenizer, new).decode("utf-8")
                break
            except UnicodeDecodeError:
                new.pop()
        assert sample.new_tokens == new and sample.completion == tokenizer.decode(new)
        assert sample.prompt_tokens == len(ids) and "\ufffd" not in sample.completion
    # Stops: eos (not included), then the RoPE table's length.
    counter = _Counter(tokenizer.n_words, tokenizer.eos_id, eos_at=6)
    (stopped,) = generate_samples(counter, tokenizer, ["a"], **kwargs)
    assert stopped.stop_reason == "eos" and len(stopped.new_tokens) == 6 - 2
    (short,) = generate_samples(counter, tokenizer, ["a"], **{**kwargs, "max_seq_len": 4})
    assert short.stop_reason == "max_seq_len" and len(short.new_tokens) == 4 - 2


class _Padded(nn.Module):
    """A model whose vocabulary is padded past the tokenizer's: the padded rows score highest,
    then ``favourite``."""

    def __init__(self, n_words: int, favourite: int) -> None:
        super().__init__()
        self.n_words, self.favourite = n_words, favourite

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, self.n_words + 64)
        logits[..., self.n_words :] = 10.0  # rows no text maps to
        logits[..., self.favourite] = 5.0
        return logits


def test_a_padded_vocabulary_samples_only_ids_the_tokenizer_has(tokenizer: Tokenizer) -> None:
    """A vocabulary padded to a round size (model.vocab_size) has rows no token maps to: a
    sample never picks them (it was a KeyError in tiktoken's decode)."""
    model = _Padded(tokenizer.n_words, favourite=42)
    kwargs = {"max_new_tokens": 3, "max_seq_len": 64, "device": torch.device("cpu")}
    (sample,) = generate_samples(model, tokenizer, ["a"], **kwargs)
    assert sample.new_tokens == [42, 42, 42] and sample.completion == tokenizer.decode([42] * 3)


class _Prefers(nn.Module):
    """Scores ids in a fixed order of preference (the first highest), whatever the input."""

    def __init__(self, vocab: int, order: list[int]) -> None:
        super().__init__()
        self.vocab, self.order = vocab, order

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, self.vocab)
        for rank, i in enumerate(self.order):
            logits[..., i] = len(self.order) - rank
        return logits


def test_samples_are_text_never_special_tokens_or_broken_characters(tokenizer: Tokenizer) -> None:
    """A model that prefers a reserved token, bos and a stray UTF-8 continuation byte: the
    sample takes the best id that shows as text at each point, so the two bytes of "é" come in
    order and a third token starting another character, cut off by max_new_tokens, is dropped.
    Eos stays allowed: it stops."""
    byte = {b: tokenizer.model.encode_single_token(bytes([b])) for b in (0xC3, 0xA9)}
    reserved = tokenizer.special_tokens["<|reserved_special_token_7|>"]
    kwargs = {"max_new_tokens": 3, "max_seq_len": 64, "device": torch.device("cpu")}
    order = [reserved, tokenizer.bos_id, byte[0xA9], byte[0xC3]]
    (sample,) = generate_samples(_Prefers(tokenizer.n_words, order), tokenizer, ["a"], **kwargs)
    assert sample.new_tokens == [byte[0xC3], byte[0xA9]] and sample.completion == "é"
    assert sample.stop_reason == "max_new_tokens"
    order = [reserved, tokenizer.bos_id, byte[0xA9], tokenizer.eos_id]
    (sample,) = generate_samples(_Prefers(tokenizer.n_words, order), tokenizer, ["a"], **kwargs)
    assert sample.new_tokens == [] and sample.stop_reason == "eos"


def test_a_full_or_read_only_output_is_one_line_and_leaves_nothing(
    run_dir: Path, tmp_path: Path, disk: Disk, read_only: tuple[Path, str]
) -> None:
    """Read-only: refused before the checkpoint is scored. A disk with room for the first report
    file but not the second: one line naming the file, and neither report nor folder stays."""
    step = str(run_dir / "checkpoint" / "step-4")
    folder, words = read_only
    line = one_line(
        titan("eval", "--checkpoint", step, "--output", str(folder / "ev"), cwd=tmp_path)
    )
    assert line == f"error: --output: {folder / 'ev'}: {words}"
    full = disk("64k", free=4096)  # one page: report.json fits, report.md does not
    proc = titan("eval", "--checkpoint", step, "--output", str(full / "ev"), cwd=tmp_path)
    assert one_line(proc) == f"error: {full}/ev/eval/report.md: no space left on device"
    assert files_under(full) == []
    empty = disk("64k", free=0)  # not even the write check's probe fits
    proc = titan("eval", "--checkpoint", step, "--output", str(empty / "ev"), cwd=tmp_path)
    assert one_line(proc) == f"error: --output: {empty / 'ev'}: no space left on device"
    assert files_under(empty) == []


def test_cli_writes_report_with_overrides(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--checkpoint", str(run_dir / "checkpoint" / "step-2"), "--output", str(out)]
    argv += ["--prompts", "Hello", "--max-new-tokens", "5", "--max-batches", "3"]
    assert eval_main([*argv, "--validation.local_batch_size", "2"]) == 0
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["step"] == 2 and report["checkpoint"] == str(run_dir / "checkpoint" / "step-2")
    assert report["model"]["name"] == "llama3" and report["model"]["num_params"] > 0
    assert set(report["metrics"]) >= {"loss", "perplexity", "bits_per_byte", "num_bytes"}
    assert report["metrics"]["num_batches"] == 3 and report["metrics"]["num_tokens"] == 3 * 2 * 64
    assert report["config"]["local_batch_size"] == 2 and report["config"]["world_size"] == 1
    assert set(report["timing"]) >= {"load_s", "eval_s", "tokens_per_s", "generate_s", "total_s"}
    (sample,) = report["samples"]
    assert sample["prompt"] == "Hello" and len(sample["new_tokens"]) <= 5
    md = (out / "eval" / "report.md").read_text()
    assert "# Evaluation of step 2" in md and "**Hello**" in md


def test_evaluate_section_drives_eval(run_dir: Path, tmp_path: Path) -> None:
    """[evaluate] in the job's config decides batches, prompts and sample length; --evaluate.x
    overrides it; the pipeline's evaluate stage reads the same keys (plus overrides)."""
    from titan_core.pipeline.stages.evaluation import evaluate_stage
    from titan_core.resolve import resolve_job

    saved = tomllib.loads((run_dir / "config.toml").read_text())
    assert saved["evaluate"]["batches"] == 20  # training saved the section with the run
    saved["evaluate"] |= {"batches": 2, "prompts": ["To be, or not"], "max_new_tokens": 3}
    job = tmp_path / "job.toml"
    job.write_text(tomli_w.dumps(saved))
    argv = ["--checkpoint", str(run_dir / "checkpoint"), "--config-file", str(job)]
    assert eval_main([*argv, "--output", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "eval" / "report.json").read_text())
    assert report["metrics"]["num_batches"] == 2 and report["config"]["max_batches"] == 2
    (sample,) = report["samples"]  # a comma inside a prompt stays in it (TOML list)
    assert sample["prompt"] == "To be, or not" and len(sample["new_tokens"]) <= 3
    assert eval_main([*argv, "--output", str(tmp_path / "b"), "--evaluate.batches", "1"]) == 0
    report = json.loads((tmp_path / "b" / "eval" / "report.json").read_text())
    assert report["metrics"]["num_batches"] == 1 and len(report["samples"]) == 1
    result = evaluate_stage(str(run_dir / "checkpoint"), resolve_job("", str(job)),
                            str(tmp_path / "c"), overrides={"evaluate.prompts": []})  # fmt: skip
    report = json.loads(Path(result.report_url).read_text())
    assert report["metrics"]["num_batches"] == 2 and report["samples"] == []


def test_storage_urls_and_explicit_config(run_dir: Path, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    fs.put(str(run_dir / "config.toml"), "/evalrun/config.toml")
    fs.put(str(run_dir / "checkpoint" / "step-4"), "/evalrun/checkpoint/step-4", recursive=True)
    report = evaluate_checkpoint("memory://evalrun/checkpoint", values=ONE_BATCH)
    saved = json.loads(fs.cat("/evalrun/eval/report.json"))
    assert saved["step"] == 4 and saved["metrics"] == report["metrics"]
    fs.rm("/evalrun", recursive=True)
    # The harness reads a URL export through a local copy.
    fs.pipe("/hfx/config.json", b"{}")
    fs.pipe("/hfx/sub/tokenizer.json", b"{}")
    local = Path(local_copy("memory://hfx", str(tmp_path)))
    assert (local / "config.json").exists() and (local / "sub" / "tokenizer.json").exists()
    fs.rm("/hfx", recursive=True)
    # Without the run's config.toml, --module/--config (or --config-file) say what to build.
    bare = tmp_path / "bare" / "ckpt" / "step-4"
    shutil.copytree(run_dir / "checkpoint" / "step-4", bare)
    marker = json.loads((bare / COMMIT_MARKER).read_text())
    del marker["model"]  # as written before markers described the model (test_model_protocol)
    (bare / COMMIT_MARKER).write_text(json.dumps(marker))
    args = ["--checkpoint", str(bare), "--max-batches", "1", "--prompts"]
    assert eval_main(args) == 2
    assert eval_main([*args, *TINY]) == 0
    assert json.loads((tmp_path / "bare" / "eval" / "report.json").read_text())["step"] == 4
    # A run folder stands for its checkpoint/ folder.
    assert evaluate_checkpoint(str(run_dir), values=ONE_BATCH)["step"] == 4


@pytest.mark.multiprocess
def test_torchrun_two_ranks_equal_one(run_dir: Path, tmp_path: Path) -> None:
    ckpt = str(run_dir / "checkpoint")
    common = ["--prompts", "To be", "--max-new-tokens", "6", "--max-batches", "5"]  # odd: 3+2
    assert eval_main(["--checkpoint", ckpt, "--output", str(tmp_path / "one"), *common]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
         "-m", "titan_core.cli", "eval", "--checkpoint", ckpt,
         "--output", str(tmp_path / "two"), *common],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Applied FSDP" in proc.stdout
    one = json.loads((tmp_path / "one" / "eval" / "report.json").read_text())
    two = json.loads((tmp_path / "two" / "eval" / "report.json").read_text())
    assert two["config"]["world_size"] == 2
    for key in ("num_tokens", "num_bytes", "num_batches"):
        assert two["metrics"][key] == one["metrics"][key]
    for key in ("loss", "perplexity", "bits_per_byte"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-6)
    assert two["samples"] == one["samples"]


def _incomplete(run_dir: Path, tmp_path: Path) -> str:
    step = tmp_path / "run" / "checkpoint" / "step-2"
    shutil.copytree(run_dir / "checkpoint" / "step-2", step)
    (step / COMMIT_MARKER).unlink()  # as if the save had been interrupted
    shutil.copy(run_dir / "config.toml", tmp_path / "run" / "config.toml")
    return str(step)


@pytest.mark.parametrize(
    "case, extra, expected",
    [
        ("missing", [], "--checkpoint: not found"),
        ("incomplete", [], "is incomplete (no .titan_complete"),
        ("no_steps", [], "holds no complete step-N checkpoint"),
        ("run", ["--model.n_layers", "1"], "has the extra tensor layers.1"),
        ("run", ["--max-batches", "-1"], "evaluate.batches: expected an int >= 0"),
        ("run", ["--evaluate.batches", "-1"], "evaluate.batches: expected an int >= 0"),
        ("run", ["--evaluate.max_new_tokens", "-2"], "evaluate.max_new_tokens: expected >= 0"),
        ("run", ["--evaluate.lm_eval_tasks", "t"], "evaluate.lm_eval_task_dir: expected a"),
        ("run", ["--max-batches", "2", "--evaluate.batches", "3"], "--max-batches: an alias of"),
        ("run", ["--hf-folder", "hf"], "--hf-folder: lm-eval runs only with evaluate.lm_eval"),
        ("run", ["--training.bogus", "1"], "unknown option --training.bogus"),
        ("run", ["--max-batches"], "--max-batches: expected a value (an int)"),
        ("run", ["--validation.dataset", "SMALL"], "fewer than training.seq_len + 1 = 65 tokens"),
    ],
)
def test_bad_input_is_one_line(
    case: str,
    extra: list[str],
    expected: str,
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    checkpoint = {
        "missing": str(tmp_path / "nope" / "step-3"),
        "incomplete": _incomplete(run_dir, tmp_path) if case == "incomplete" else "",
        "no_steps": str(tmp_path),
        "run": str(run_dir / "checkpoint"),
    }[case]
    (tmp_path / "small.jsonl").write_text('{"text": "too short to fill one sequence"}\n')
    extra = [str(tmp_path / "small.jsonl") if e == "SMALL" else e for e in extra]
    out = tmp_path / "out"
    assert eval_main(["--checkpoint", checkpoint, "--output", str(out), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not out.exists()


def test_flavor_mismatch_subprocess_is_one_line(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "titan_core.cli", "eval", "--checkpoint",
         str(run_dir / "checkpoint"), "--output", str(out), "--model.flavor", "debugmodel"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit model.flavor 'debugmodel'" in lines[0], lines
    assert "tok_embeddings.weight is (2304, 64) in the checkpoint, (2304, 256) in" in lines[0]
    assert not out.exists()


def test_lm_eval_inputs_checked_first(
    run_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from titan_core.evaluate import harness

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "t.yaml").write_text("task: t\n")
    argv = ["--checkpoint", str(run_dir / "checkpoint"), "--output", str(tmp_path / "out")]
    argv += ["--lm-eval-task-dir", str(tmp_path / "tasks"), "--lm-eval-tasks", "t"]
    monkeypatch.setattr(harness, "is_available", lambda: True)
    assert eval_main([*argv, "--hf-folder", str(tmp_path / "no_export")]) == 2
    assert "--hf-folder: no Hugging Face export (config.json)" in capsys.readouterr().err
    monkeypatch.setattr(harness, "is_available", lambda: False)
    assert eval_main(argv) == 2
    assert "lm-eval is not installed" in capsys.readouterr().err
    assert eval_main([*argv[:4], "--lm-eval-tasks", "t"]) == 2
    assert "evaluate.lm_eval_task_dir: expected a local folder" in capsys.readouterr().err
    # The config keys switch lm-eval on as the flags do.
    keys = ["--evaluate.lm_eval_tasks", "t", "--evaluate.lm_eval_task_dir", str(tmp_path / "t")]
    assert eval_main([*argv[:4], *keys]) == 2
    assert "evaluate.lm_eval_tasks: lm-eval is not installed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


_DOCS = ["To be, or not to be, that is the question.", "A list comprehension makes a list."]
_CHOICES = [("To be, or not to", [" be", " cat"]), ("The Python", [" zebra", " language"])]


def _logprob(model: nn.Module, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1])[0].double(), dim=-1)
    targets = ids[0, len(context) :]
    return logp[len(context) - 1 :].gather(1, targets[:, None]).sum().item()


def test_lm_eval_offline_on_hf_export(run_dir: Path, tmp_path: Path, tokenizer: Tokenizer) -> None:
    import lm_eval  # noqa: F401  (the `eval` extra, installed by `make test`: never skipped)

    model = _titan_model(run_dir / "checkpoint" / "step-4", tokenizer.n_words)
    export_hf_folder(model, tokenizer, run_dir / "hf")  # the default --hf-folder: <run>/hf
    tasks = tmp_path / "tasks"
    (tasks / "data").mkdir(parents=True)
    doc = (ROOT / "docs" / "evaluation.md").read_text()  # the documented task files, verbatim
    for name, text in re.findall(r"```yaml\n# (\S+\.yaml):.*?\n(.*?)```", doc, re.S):
        (tasks / name).write_text(text)
    rows = [json.dumps({"text": d}) for d in _DOCS]
    (tasks / "data" / "bpb.jsonl").write_text("\n".join(rows) + "\n")
    rows = [json.dumps({"context": c, "choices": ch, "label": 0}) for c, ch in _CHOICES]
    (tasks / "data" / "choice.jsonl").write_text("\n".join(rows) + "\n")
    argv = ["--checkpoint", str(run_dir / "checkpoint"), "--output", str(tmp_path / "out")]
    argv += ["--max-batches", "1", "--prompts", "--lm-eval-task-dir", str(tasks)]
    assert eval_main([*argv, "--lm-eval-tasks", "my_bpb", "my_choice"]) == 0
    results = json.loads((tmp_path / "out" / "eval" / "report.json").read_text())["lm_eval"]
    # By hand with the titan model. lm-eval encodes with the tokenizer's bos, so a document's
    # rolling loglikelihood scores [bos] + text after its own bos prefix token; bytes are the
    # documents' UTF-8 bytes. A choice is scored after [bos] + context.
    bos = [tokenizer.bos_id]
    nats = -sum(_logprob(model, bos, bos + tokenizer.encode(d, bos=False, eos=False))
                for d in _DOCS)  # fmt: skip
    bpb = nats / math.log(2) / sum(len(d.encode()) for d in _DOCS)
    assert results["results"]["my_bpb"]["bits_per_byte"] == pytest.approx(bpb, rel=1e-4)
    correct = []
    for context, choices in _CHOICES:
        ctx = tokenizer.encode(context, bos=True, eos=False)
        scores = [_logprob(model, ctx, tokenizer.encode(c, bos=False, eos=False)) for c in choices]
        correct.append(float(scores[0] > scores[1]))
    assert results["results"]["my_choice"]["acc"] == pytest.approx(sum(correct) / len(correct))
    assert results["n_samples"] == {"my_bpb": 2, "my_choice": 2}


def test_documented_commands_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("my_job.toml").write_text("[validation]\nlocal_batch_size = 16\n")
    doc = (ROOT / "docs" / "evaluation.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", doc, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("  #")[0])
            for head in (["titan", "eval"], ["titan_core.cli", "eval"]):
                starts = [i for i in range(len(words)) if words[i : i + len(head)] == head]
                if starts:
                    commands.append(words[starts[0] + len(head) :])
    assert len(commands) >= 10
    for argv in commands:
        ns, config_argv, values = parse_eval_args(argv)
        assert ns.checkpoint
        if "--module" not in config_argv:  # the run's config.toml stands in for the registry
            config_argv = [*TINY, *config_argv]
        apply_values(parse_args(config_argv), values)
