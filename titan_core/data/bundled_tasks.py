"""Multiple-choice tasks built from the bundled corpus's validation documents, offline.

Two tasks, each a ``test.jsonl`` of ``NUM_TEST`` examples and a ``shots.jsonl`` of
``NUM_SHOTS`` few-shot examples from other documents (every fifth validation document), in the
format of ``titan_core.data.choice_tasks``. Built from validation text only, so that no example
was seen in training; deterministic (fixed seeds, sorted inputs).

- ``next_sentence``: a passage (up to three sentences, whitespace collapsed) and four
  candidates for the sentence that follows it: the true one and three sentences of similar
  length from other documents. Measures whether the model follows a passage's thread.
- ``line_closing``: the up-to-three lines before a line and that line's first half (cut at the
  space nearest its middle), and four candidate second halves: the true one and three halves
  of similar length from other documents' lines. Measures local syntax and vocabulary, in
  verse, prose and reference text alike.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from titan_core.data.choice_tasks import ChoiceExample, write_choice_task
from titan_core.logging import logger

TASKS_VERSION = 1
SEED = 1234
NUM_TEST = 300
NUM_SHOTS = 20
NUM_CHOICES = 4
NEAREST = 30  # distractors are drawn from the candidates this close in length to the answer
SHOTS_EVERY = 5  # validation document i gives shots when i % SHOTS_EVERY == 0, else tests
DESCRIPTIONS = {
    "next_sentence": "the true next sentence of a passage among 3 from other documents",
    "line_closing": "the true second half of a line among 3 from other lines",
}

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z])")

# A candidate: (document index, context, answer).
Candidate = tuple[int, str, str]


def _is_sentence(text: str) -> bool:
    return (
        25 <= len(text) <= 200
        and len(text.split()) >= 4
        and text[-1] in ".!?"
        and (text.lstrip("\"'([")[:1].isupper() and any(c.islower() for c in text))
    )


def next_sentence_candidates(docs: Sequence[str]) -> list[Candidate]:
    """Every (document, up to three preceding sentences, sentence) whose sentence and context
    are prose (25-200 characters, four words or more)."""
    out = []
    for d, doc in enumerate(docs):
        sentences = _SENTENCE_END.split(re.sub(r"\s+", " ", doc).strip())
        for i in range(1, len(sentences)):
            context = " ".join(sentences[max(0, i - 3) : i])
            if _is_sentence(sentences[i]) and len(context) >= 40:
                out.append((d, context, sentences[i]))
    return out


def _line_split(line: str) -> tuple[str, str] | None:
    """(first half, second half) of a prose line at the space nearest its middle, or None."""
    body = line.strip()
    if not 30 <= len(body) <= 120 or len(body.split()) < 5 or not re.search(r"[a-z]{3}", body):
        return None
    indent = len(line) - len(line.lstrip())
    middle = indent + len(body) // 2
    spaces = [m.start() for m in re.finditer(" ", line) if m.start() > indent]
    cut = min(spaces, key=lambda s: (abs(s - middle), s))
    head, tail = line[:cut], line[cut + 1 :]
    return (head, tail) if len(tail) >= 10 and tail[:1].strip() else None


def line_closing_candidates(docs: Sequence[str]) -> list[Candidate]:
    """Every (document, up to three previous lines + the line's first half, second half)."""
    out = []
    for d, doc in enumerate(docs):
        lines = [line.rstrip() for line in doc.split("\n")]
        for i, line in enumerate(lines):
            halves = _line_split(line)
            if halves is not None:
                before = "\n".join(lines[max(0, i - 3) : i])
                out.append((d, f"{before}\n{halves[0]}" if before else halves[0], halves[1]))
    return out


def _examples(candidates: list[Candidate], count: int, rng: random.Random) -> list[ChoiceExample]:
    """``count`` candidates drawn by ``rng``, each with NUM_CHOICES - 1 distractors: answers of
    other documents among the NEAREST closest in length; the choices in a random order."""
    by_length = sorted(range(len(candidates)), key=lambda i: (len(candidates[i][2]), i))
    lengths = [len(candidates[i][2]) for i in by_length]
    examples: list[ChoiceExample] = []
    for pick in rng.sample(range(len(candidates)), len(candidates)):
        if len(examples) == count:
            break
        doc, context, answer = candidates[pick]
        at = bisect.bisect_left(lengths, len(answer))
        pool: list[str] = []
        for window in (4 * NEAREST, len(candidates)):  # the whole list when the window is short
            near = by_length[max(0, at - window) : at + window]
            near = [i for i in near if candidates[i][0] != doc and candidates[i][2] != answer]
            near.sort(key=lambda i: (abs(len(candidates[i][2]) - len(answer)), i))
            pool = list(dict.fromkeys(candidates[i][2] for i in near))[:NEAREST]
            if len(pool) >= NUM_CHOICES - 1:
                break
        if len(pool) < NUM_CHOICES - 1:  # a tiny corpus: too few other documents
            continue
        choices = [answer, *rng.sample(pool, NUM_CHOICES - 1)]
        rng.shuffle(choices)
        examples.append(ChoiceExample(context, tuple(choices), choices.index(answer)))
    return examples


BUILDERS: dict[str, Callable[[Sequence[str]], list[Candidate]]] = {
    "next_sentence": next_sentence_candidates,
    "line_closing": line_closing_candidates,
}


def build_bundled_tasks(validation_docs: Sequence[str], out: Path) -> dict[str, object]:
    """Write ``<out>/<task>/{test,shots}.jsonl`` for every task of BUILDERS from the
    validation documents; returns their manifest entry (counts and sha256 per file)."""
    splits = {
        "shots": [d for i, d in enumerate(validation_docs) if i % SHOTS_EVERY == 0],
        "test": [d for i, d in enumerate(validation_docs) if i % SHOTS_EVERY != 0],
    }
    counts = {"shots": NUM_SHOTS, "test": NUM_TEST}
    manifest: dict[str, object] = {}
    for name, build in BUILDERS.items():
        entry: dict[str, object] = {"description": DESCRIPTIONS[name]}
        for split, docs in splits.items():
            rng = random.Random(f"{SEED}:{name}:{split}")
            examples = _examples(build(docs), counts[split], rng)
            if len(examples) < counts[split]:
                logger.warning(
                    "bundled task %s/%s: %d examples of %d (a small validation split)",
                    name,
                    split,
                    len(examples),
                    counts[split],
                )
            data = write_choice_task(str(out / name / f"{split}.jsonl"), examples)
            entry[split] = {"examples": len(examples), "sha256": hashlib.sha256(data).hexdigest()}
        manifest[name] = entry
    return manifest
