"""Multiple-choice task files: one example per JSON line, ``{"context", "choices", "gold"}``.

A task is scored in the ranked-choice form (OLMES "RC"): every choice is a continuation of the
context and the model's log-likelihoods rank them (``titan_core.components.ranked_choice``).
Files are read from any fsspec URL, optionally compressed (``.gz``, ``.zst``, …); a bad line is
one ``DataError`` naming the file and the line. lm-evaluation-harness data in its native fields
(``hellaswag``, ``arc``, ``piqa``, ``openbookqa``) is read by ``read_harness_task``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

from titan_core import storage
from titan_core.errors import DataError, storage_errors


@dataclass(frozen=True)
class ChoiceExample:
    """One question: the context, its candidate continuations and the index of the right one."""

    context: str
    choices: tuple[str, ...]
    gold: int

    def to_json(self) -> str:
        """The example as one JSON line (no newline), as ``read_choice_task`` reads it."""
        row = {"context": self.context, "choices": list(self.choices), "gold": self.gold}
        return json.dumps(row, ensure_ascii=False)


def _lines(url: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of a UTF-8 text file at ``url``."""
    with storage_errors(url, DataError), fsspec.open(url, "rb", compression="infer") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{url} line {number}: not UTF-8 text") from None
            if line.strip():
                yield number, line


def parse_choice_example(row: Any, where: str) -> ChoiceExample:
    """A ``ChoiceExample`` from a parsed JSON row; a DataError prefixed with ``where`` else."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("context", "choices", "gold"):
        if key not in row:
            raise DataError(f"{where}: missing key {key!r} (expected context, choices, gold)")
    context, choices, gold = row["context"], row["choices"], row["gold"]
    if not isinstance(context, str):
        raise DataError(f"{where}: 'context' is {type(context).__name__}, expected a string")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise DataError(f"{where}: 'choices' must be a list of strings")
    if not choices:
        raise DataError(f"{where}: 'choices' is empty, expected at least one choice")
    if not all(c.strip() for c in choices):
        raise DataError(f"{where}: a choice is empty or blank")
    if isinstance(gold, bool) or not isinstance(gold, int):
        raise DataError(f"{where}: 'gold' is {type(gold).__name__}, expected an int index")
    if not 0 <= gold < len(choices):
        raise DataError(
            f"{where}: gold index {gold} out of range for {len(choices)} choices "
            f"(0..{len(choices) - 1})"
        )
    return ChoiceExample(context, tuple(choices), gold)


def read_choice_task(url: str) -> list[ChoiceExample]:
    """Every example of a task file (JSON lines; blank lines skipped); DataError when the file
    is missing, empty or has a bad line (``<url> line <n>: …``)."""
    examples = []
    for number, line in _lines(url):
        where = f"{url} line {number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
        examples.append(parse_choice_example(row, where))
    if not examples:
        raise DataError(f"{url}: no examples (expected JSON lines of context, choices, gold)")
    return examples


def write_choice_task(url: str, examples: Iterable[ChoiceExample]) -> bytes:
    """Write ``examples`` as a task file (whole or not at all); returns the bytes written."""
    data = "".join(e.to_json() + "\n" for e in examples).encode()
    storage.write_bytes(url, data)
    return data


# --------------------------------------------------------------- lm-evaluation-harness data
# Each mapping turns one row of a task's own data into (context, choices, gold) as lm-eval's
# task YAML does (its doc_to_text / doc_to_choice / doc_to_target), so that scores compare.


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(row: dict[str, Any]) -> tuple[str, list[str], int]:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _hellaswag_text(row["activity_label"] + ": " + ctx)
    return query, [_hellaswag_text(e) for e in row["endings"]], int(row["label"])


def _lettered(row: dict[str, Any], question: str, answer: str) -> tuple[str, list[str], int]:
    choices = row["choices"]
    gold = str(row[answer]).strip()
    if gold not in choices["label"]:
        raise ValueError(f"{answer} {gold!r} is not among the labels {choices['label']}")
    return question, list(choices["text"]), list(choices["label"]).index(gold)


def _arc(row: dict[str, Any]) -> tuple[str, list[str], int]:
    return _lettered(row, f"Question: {row['question']}\nAnswer:", "answerKey")


def _openbookqa(row: dict[str, Any]) -> tuple[str, list[str], int]:
    return _lettered(row, row["question_stem"], "answerKey")


def _piqa(row: dict[str, Any]) -> tuple[str, list[str], int]:
    return f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"])


HARNESS_FORMATS: dict[str, Callable[[dict[str, Any]], tuple[str, list[str], int]]] = {
    "hellaswag": _hellaswag,
    "arc": _arc,  # arc_easy and arc_challenge (allenai/ai2_arc)
    "piqa": _piqa,
    "openbookqa": _openbookqa,
}


def _harness_rows(url: str) -> Iterator[tuple[str, Any]]:
    """(where, row) of a JSON-lines file, or of a folder written by ``datasets``'
    ``save_to_disk`` (read locally, never from the Hub)."""
    if storage.exists(storage.join(url, "dataset_info.json")):
        import datasets

        with storage_errors(url, DataError):
            rows = datasets.load_from_disk(url)
        yield from ((f"{url} row {i}", row) for i, row in enumerate(rows, 1))
        return
    for number, line in _lines(url):
        try:
            yield f"{url} line {number}", json.loads(line)
        except ValueError as e:
            raise DataError(
                f"{url} line {number}: bad JSON ({e.msg} at column {e.colno})"
            ) from None


def read_harness_task(url: str, fmt: str) -> list[ChoiceExample]:
    """A task from lm-eval's own data on local storage (JSON lines, or a ``save_to_disk``
    folder of one split), mapped by ``HARNESS_FORMATS[fmt]``."""
    if fmt not in HARNESS_FORMATS:
        raise DataError(f"{url}: unknown task format {fmt!r} (known: {', '.join(HARNESS_FORMATS)})")
    examples = []
    for where, row in _harness_rows(url):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        try:
            context, choices, gold = HARNESS_FORMATS[fmt](row)
        except KeyError as e:
            raise DataError(f"{where}: missing key {e.args[0]!r} for the {fmt} format") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise DataError(f"{where}: not a {fmt} row ({e})") from None
        row = {"context": context, "choices": choices, "gold": gold}
        examples.append(parse_choice_example(row, where))
    if not examples:
        raise DataError(f"{url}: no examples")
    return examples
