"""(question, answer) pairs made from documentation entries, so the model learns chat turns.

    module    "What does the json module do?"        -> the docstring's first paragraph
    class     "What is json.JSONEncoder?"             -> the docstring's first paragraph
    function  "What does json.dumps do?"              -> the docstring's first paragraph
    topic     'Tell me about the "if" statement.'     -> the section's first prose paragraphs
    identity  "Who are you?"                          -> a fixed self-description (written here)

Phrasings are picked by a random.Random seeded with (seed, entry name): the same entry always
gets the same questions, whatever else the corpus holds.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from workers.models.training.stdlib_text import DocEntry

MAX_ANSWER_CHARS = 420
MIN_ANSWER_CHARS = 24
MIN_PROSE_CHARS = 120  # a topic answer shorter than this reads on past a code block
_SENTENCE_END = re.compile(r"[.!?](?=\s)")
# "name(args)", "name(args) -> result", "name(args) --> result": a C docstring's first line.
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*(-+>.*)?$")

MODULE_QUESTIONS = (
    "What does the {name} module do?",
    "What is the {name} module for?",
    "Tell me about the {name} module.",
    "What is {name} in Python?",
    "Explain the {name} module.",
)
CLASS_QUESTIONS = (
    "What is {name}?",
    "What is the {name} class?",
    "Tell me about the class {name}.",
    "What does the {name} class do?",
)
FUNCTION_QUESTIONS = (
    "What does {name} do?",
    "What does the function {name} do?",
    "Explain {name}.",
    "What is {name} for?",
)
TOPIC_QUESTIONS = (
    "Tell me about {name}.",
    "Explain {name}.",
    "What should I know about {name}?",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant that answers questions about Python.",
    "You are a small model trained on the Python documentation. Answer briefly.",
    "Answer the user's question about the Python standard library.",
)
IDENTITY = (
    (
        ("Who are you?", "What are you?", "Introduce yourself.", "What is your name?"),
        "I am a small demo language model that ships with pdrouter. I was trained on the "
        "documentation of the Python standard library, so I can tell you what Python modules, "
        "classes and functions do.",
    ),
    (
        ("Hello!", "Hi", "Hello", "Hi there!", "Good morning!"),
        "Hello! Ask me about a Python module or function, for example: "
        "What does the json module do?",
    ),
    (
        ("What can you do?", "How can you help me?", "What do you know?"),
        "I can answer short questions about the Python standard library: what a module is "
        "for, what a class is, and what a function does.",
    ),
)


@dataclass(frozen=True)
class QAPair:
    module: str  # the split key, as in DocEntry
    question: str
    answer: str


def summary(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The first paragraph on one line (after a leading signature line such as
    "chain(*iterables) --> chain object"), cut after the last sentence within max_chars; None
    if it is too short, reads as code, or has no sentence end to cut at."""
    paragraphs = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    while len(paragraphs) > 1 and _SIGNATURE.match(paragraphs[0]):
        paragraphs.pop(0)
    paragraph = paragraphs[0]
    if len(paragraph) < MIN_ANSWER_CHARS or paragraph.startswith((">>>", "(", "[")):
        return None
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    if "::=" in paragraph or _SIGNATURE.match(paragraph) or letters < 0.8 * len(paragraph):
        return None
    if paragraph.endswith(":"):
        # "Return a list of ... as follows:" introduced a block that is not in the answer.
        ends = [m.end() for m in _SENTENCE_END.finditer(paragraph)]
        paragraph = paragraph[: ends[-1]] if ends else paragraph[:-1] + "."
    if len(paragraph) <= max_chars:
        return paragraph if paragraph[-1] in ".!?" else paragraph + "."
    ends = [m.end() for m in _SENTENCE_END.finditer(paragraph[: max_chars + 1])]
    return paragraph[: ends[-1]] if ends else None


def topic_summary(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """A pydoc topic's opening prose, up to max_chars. Grammar and code blocks, lists and
    sub-headings are skipped while the prose gathered is short, and end it once it is not;
    a paragraph introducing a block ("... is used for conditional execution:") ends with '.'
    when it opens the answer, and ends the answer before it otherwise; one with no sentence
    end at all (an introduction whose colon the rendering dropped) is left out."""
    parts: list[str] = []
    for p in text.split("\n\n")[1:]:
        line = " ".join(p.split())
        if not line or set(line) <= set("*=-"):
            continue  # the title's underline
        block = p.startswith(" ") or "::=" in p or line.startswith("* ") or "===" in line
        if block:
            if len(" ".join(parts)) < MIN_PROSE_CHARS:
                continue
            break
        if line[-1] not in '.!?:"':
            # "... The syntax is" before a block whose "::" the rendering dropped: keep the
            # whole sentences before it, if any.
            ends = [m.end() for m in _SENTENCE_END.finditer(line)]
            if not ends:
                continue
            line = line[: ends[-1]]
        if parts and len(" ".join([*parts, line])) > max_chars:
            break
        if line.endswith(":"):
            ends = [m.end() for m in _SENTENCE_END.finditer(line)]
            if ends and len(line) - ends[-1] < 40:
                line = line[: ends[-1]]  # "... right. The syntax is:" -> "... right."
            elif parts:
                break
            else:
                line = line[:-1] + "."
        parts.append(line)
        if len(" ".join(parts)) >= max_chars // 2:
            break
    return summary(" ".join(parts), max_chars) if parts else None


def topic_name(title: str) -> str:
    """A title as the object of a question: 'The "if" statement' -> 'the "if" statement'."""
    return "the" + title[3:] if title.startswith("The ") else title


def qa_pairs(entries: list[DocEntry], seed: int) -> Iterator[QAPair]:
    """Pairs for every entry with a usable answer: two phrasings for modules and topics (the
    questions a newcomer asks first), one for classes and functions."""
    for entry in entries:
        if entry.kind == "comments":
            continue
        if entry.kind == "topic":
            answer, questions, name, count = (
                topic_summary(entry.text),
                TOPIC_QUESTIONS,
                topic_name(entry.name),
                2,
            )
        else:
            answer = summary(entry.text)
            questions = {
                "module": MODULE_QUESTIONS,
                "class": CLASS_QUESTIONS,
                "function": FUNCTION_QUESTIONS,
            }[entry.kind]
            name, count = entry.name, 2 if entry.kind == "module" else 1
        if answer is None:
            continue
        rng = random.Random(f"{seed}:{entry.kind}:{entry.name}")
        for template in rng.sample(questions, count):
            yield QAPair(entry.module, template.format(name=name), answer)


def identity_pairs() -> Iterator[QAPair]:
    for questions, answer in IDENTITY:
        for question in questions:
            yield QAPair("identity", question, answer)


def conversations(pairs: list[QAPair], seed: int) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(split key, messages) for each pair: about one in five gets a system prompt, and about
    one in five continues with the next pair of the same module as a second turn."""
    rng = random.Random(seed)
    i = 0
    while i < len(pairs):
        pair = pairs[i]
        messages: list[dict[str, str]] = []
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        messages += [
            {"role": "user", "content": pair.question},
            {"role": "assistant", "content": pair.answer},
        ]
        nxt = pairs[i + 1] if i + 1 < len(pairs) else None
        if nxt is not None and nxt.module == pair.module and rng.random() < 0.2:
            messages += [
                {"role": "user", "content": nxt.question},
                {"role": "assistant", "content": nxt.answer},
            ]
            i += 1
        i += 1
        yield pair.module, messages
