"""Training material for a draft head, gathered offline from what this machine has installed.

A head must draft what the target writes for users: chat answers about code, summaries, math,
translation and writing, and plain code and prose.  Nothing here is downloaded; the default material is

- **Python functions** with docstrings from the installed packages' sources (``sys.path``'s site-packages),
  whole source chunks as plain text, and code-completion / explain-this-code prompts built from them;
- **documentation**: the installed packages' descriptions (``*.dist-info/METADATA``, most are their
  READMEs), ``/usr/share/doc`` text files and manual pages (``/usr/share/man``, troff stripped to text),
  as plain text and as summarize / answer-from-the-document / translate prompts;
- **prompts written here** (math word problems with drawn numbers, writing tasks over a list of topics,
  questions that ask for an explanation, a comparison or a fix, writing in another language), whose
  answers the target itself generates (``specdec.training.train`` runs the generation in batches);
- **follow-ups** to some of them (``FollowUp``): a second user turn after the target's answer (a chat
  that goes on), or a new prompt that quotes the answer (what the target wrote in another language, to
  be translated into English).  Their answers are the target's too.

The user's own prompts (``read_prompts``, `train-drafter --prompts`: what their users ask, in the
OpenAI chat format their server logs hold) are answered by the target first: a head learns best what it
drafts, and the built-in prompts are only a guess at it (measured: a head agreeing 0.52 with the target
on the templates' held-out answers agreed 0.30 on other users' prompts).

Every choice is drawn from a seeded generator, so the same machine and seed give the same material.
``Material.describe`` records what was used (the manifest's "data").  Prompts are the user's turn of a
chat; the caller applies the target's chat template.
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import re
import site
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError
from specdec.prompt_files import looks_like_jsonl, parse_jsonl, unescape_line
from specdec.request import CHAT_ROLES, message_text

MAX_FILE_BYTES = 200_000  # larger source/doc files are skipped (generated tables, vendored bundles)
CHUNK_CHARS = 1800  # a plain-text chunk: about 400-500 tokens

LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese", "Russian")
WRITING = (
    "a short story about {topic}", "a friendly email to a colleague about {topic}", "a poem about {topic}",
    "a blog post introduction about {topic}", "a product description for {topic}",
    "a short speech about {topic}", "a list of tips about {topic}", "a dialogue between two friends about {topic}",
    "a persuasive paragraph about {topic}", "a news-style report about {topic}",
)
TOPICS = (
    "learning to cook", "a rainy day in the city", "the first day at a new job", "a lighthouse keeper",
    "saving money", "a trip to the mountains", "an old library", "remote work", "a robot that paints",
    "the history of bicycles", "growing tomatoes", "a lost dog finding its way home", "climate change",
    "a chess tournament", "the night sky", "a small bakery", "moving to another country", "time management",
    "a friendly dragon", "the ocean", "public transport", "a science fair", "healthy sleep", "a winter festival",
    "open-source software", "a family reunion", "learning a new language", "a busy airport", "coffee",
    "an unexpected friendship", "electric cars", "a mountain village", "video games", "a museum at night",
)
CODE_TASKS = (
    "Complete the following Python function.\n\n```python\n{code}\n```",
    "Explain what this Python function does, step by step.\n\n```python\n{code}\n```",
    "Write unit tests with pytest for this function.\n\n```python\n{code}\n```",
    "Review this code and suggest improvements.\n\n```python\n{code}\n```",
)
DOC_TASKS = (
    "Summarize the following text in a few sentences.\n\n{doc}",
    "{doc}\n\nWhat is the main point of the text above? Answer briefly.",
    "Read the document and answer the question.\n\nDocument:\n{doc}\n\nQuestion: what does it describe, and who is it for?",
    "Write three bullet points that capture the key ideas of this text:\n\n{doc}",
    "Translate the following text into {language}:\n\n{sentences}",
)
MATH = (
    "A shop sells pencils for ${a} each and notebooks for ${b} each. Sam buys {c} pencils and {d} notebooks. "
    "How much does Sam pay in total?",
    "A train travels {a} km in {b} hours. At the same speed, how far does it travel in {c} hours?",
    "Maria has {a} apples. She gives {b} to her friend and buys {c} more. How many apples does she have now?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
    "A class has {a} students. {b} percent of them walk to school. How many students walk to school?",
    "Solve for x: {a}x + {b} = {c}.",
    "A recipe needs {a} grams of flour for {b} cookies. How much flour is needed for {c} cookies?",
    "Tom saves ${a} every week. How many weeks does he need to save ${c}?",
    "What is the sum of all integers from 1 to {c}? Explain your reasoning.",
    "A tank holds {c} liters and is filled at {a} liters per minute. How long does it take to fill it?",
)
# Questions a user asks a chat model: an explanation of a subject, a comparison, a fix for a problem.
SUBJECTS = (
    "compound interest", "how vaccines train the immune system", "photosynthesis", "the greenhouse effect",
    "how a refrigerator keeps food cold", "public-key cryptography", "how DNS resolves a domain name",
    "garbage collection in programming languages", "the causes of the First World War", "supply and demand",
    "how noise-cancelling headphones work", "the placebo effect", "black holes", "how credit scores are computed",
    "plate tectonics", "how a CPU cache works", "the Roman Republic's fall", "how GPS finds your position",
    "recursion", "the water cycle", "how antibiotics work and why resistance appears", "the stock market",
    "how airplanes stay in the air", "machine learning overfitting", "the theory of evolution", "how tides work",
    "database transactions and isolation levels", "the difference between weather and climate",
    "how a mortgage works", "the Pythagorean theorem", "how sleep affects memory", "how solar panels make electricity",
    "what a REST API is", "the French Revolution", "how yeast makes bread rise", "containers and virtual machines",
    "how the heart pumps blood", "Big-O notation", "how elections with ranked-choice voting are counted",
    "how batteries store energy", "why the ocean is salty", "how a hash table works", "the scientific method",
)
QUESTION_TASKS = (
    "Explain {subject} in simple terms.", "What should I know about {subject}? Keep it short and concrete.",
    "Can you explain {subject} to someone with no background in it?",
    "What are the most common misconceptions about {subject}?",
    "I'm trying to understand {subject}. What are the key ideas, and is there a good analogy?",
    "Walk me through {subject} with a concrete example.",
)
COMPARISONS = (
    ("a list", "a tuple in Python"), ("renting", "buying a home"), ("TCP", "UDP"), ("a virus", "a bacterium"),
    ("stocks", "bonds"), ("SQL", "NoSQL databases"), ("weather", "climate"), ("a debit card", "a credit card"),
    ("machine learning", "traditional programming"), ("baking soda", "baking powder"), ("HTTP", "HTTPS"),
    ("an LLC", "a sole proprietorship"), ("RAM", "storage"), ("aerobic", "anaerobic exercise"),
    ("a compiler", "an interpreter"), ("mean", "median"), ("a Roth IRA", "a traditional IRA"),
    ("unit tests", "integration tests"), ("an index fund", "a hedge fund"), ("concurrency", "parallelism"),
)
COMPARISON_TASKS = (
    "What is the difference between {a} and {b}?",
    "When should I choose {a} over {b}, and why?",
    "{A} or {b}: what are the trade-offs?",
)
PROBLEMS = (
    "houseplants keep getting yellow leaves", "laptop gets very hot and the fan is loud", "bread does not rise",
    "Python script is much slower than I expected", "Wi-Fi keeps dropping every few minutes",
    "tomato seedlings are tall and thin", "code works locally but fails in CI", "cat stopped using its litter box",
    "phone battery drains in half a day", "git push is rejected with 'non-fast-forward'",
    "sleep is poor although I go to bed early",
    "web page takes ten seconds to load", "running times are not improving after three months of training",
    "SQL query got slow after the table grew", "dishwasher leaves white spots on glasses",
)
PROBLEM_TASKS = (
    "My {problem}. What are the most likely causes, and how do I fix each of them?",
    "Help! My {problem}. What should I check first?",
)
# A second user turn after the target's answer: the chat goes on.
FOLLOW_UP_TURNS = (
    "Thanks! Can you give me a concrete example?", "Can you make that shorter?", "Why is that? I don't fully follow.",
    "What would you change if I were a complete beginner?", "Can you put the main points in a table?",
    "What are the risks or downsides?", "Great. What should I do next?", "Can you rewrite it in a friendlier, more casual tone?",
    "That helps. What is a common mistake people make here?", "OK. How would that change if I had less time or money?",
)
# A new prompt quoting what the target wrote in another language.
TO_ENGLISH = (
    "Translate into English:\n\n{answer}", "Can you translate this into English? Keep the tone.\n\n{answer}",
    "Please translate the following text to English:\n\n{answer}", "Translate to English, please:\n\n{answer}",
)


@dataclass(frozen=True)
class FollowUp:
    """What comes after the target's answer to a prompt: another user turn of the same chat, or, where
    `text` holds "{answer}", a new one-turn prompt that quotes the answer."""

    text: str

    def messages(self, prompt: str, answer: str) -> list[tuple[str, str]]:
        """The (role, content) turns of the follow-up conversation, a user turn last."""
        if "{answer}" in self.text:
            return [("user", self.text.replace("{answer}", answer))]
        return [("user", prompt), ("assistant", answer), ("user", self.text)]


@dataclass
class Material:
    """Plain texts (documents, source chunks) and chat prompts (user turns) for one training run."""

    texts: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    chats: list[list[tuple[str, str]]] = field(default_factory=list)  # the user's own prompts: (role, content) turns
    sources: dict[str, int] = field(default_factory=dict)  # where the texts came from -> how many
    follow_ups: dict[int, FollowUp] = field(default_factory=dict)  # index in prompts -> what follows its answer

    def describe(self) -> list[str]:
        """What was used, one line each (the manifest's "data")."""
        return [f"{name}: {count}" for name, count in sorted(self.sources.items())] + [
            f"prompts: {len(self.prompts)} (answers generated by the target), "
            f"{len(self.follow_ups)} of them followed up"]


def site_packages() -> list[Path]:
    """The directories installed packages live in."""
    places = list(site.getsitepackages()) + [site.getusersitepackages()]
    places += [p for p in sys.path if p.endswith("site-packages")]
    return sorted({Path(p) for p in places if Path(p).is_dir()})


def _read(path: Path) -> str:
    """A text file's contents ('' when unreadable, binary or too large); .gz files decompressed."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return ""
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return ""


_TROFF_FONT = re.compile(r"\\f[BIRPC0-9]|\\f\(..|\\f\[[^]]*\]")
_TROFF_ESCAPE = re.compile(r"\\(\(..|\[[^]]*\]|[-e&|^/,%:~ 0])")


def strip_troff(source: str) -> str:
    """A manual page's troff source as plain text (requests dropped, fonts and escapes removed)."""
    lines = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"")) or line.strip() == ".":
            continue  # a comment or an empty request
        if line.strip() in (".PP", ".LP", ".P", ".sp", ".br", ".TP", ".IP"):
            lines.append("")
            continue
        if line.startswith((".SH", ".SS")):
            lines += ["", line.split(None, 1)[1].strip('"') if len(line.split(None, 1)) > 1 else "", ""]
            continue
        if line.startswith((".B ", ".I ", ".BR ", ".IR ", ".BI ", ".IB ", ".RB ", ".RI ")):
            line = " ".join(part.strip('"') for part in line.split()[1:])
        elif line.startswith("."):
            continue
        line = _TROFF_ESCAPE.sub(lambda m: "-" if m.group(1) == "-" else " " if m.group(1) == " " else "",
                                 _TROFF_FONT.sub("", line))
        lines.append(line)
    paragraphs = re.split(r"\n\s*\n", "\n".join(lines))  # troff breaks lines anywhere: reflow them
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Text cut at paragraph (else line) boundaries into pieces of about `size` characters."""
    out, current = [], ""
    for paragraph in re.split(r"\n\s*\n", text):
        if current and len(current) + len(paragraph) > size:
            out.append(current.strip())
            current = ""
        current += paragraph[: 2 * size] + "\n\n"
    if current.strip():
        out.append(current.strip())
    return [c for c in out if len(c) > 200]


def functions(source: str) -> list[str]:
    """The source of each top-level or method function of a Python file that has a docstring."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) \
                and node.end_lineno is not None and 4 <= node.end_lineno - node.lineno <= 40:
            body = lines[node.lineno - 1: node.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            found.append("\n".join(line[indent:] for line in body))
    return found


def _sample(rng: random.Random, items: list[Path], count: int) -> list[Path]:
    return rng.sample(items, min(count, len(items)))


def python_files(roots: Iterable[Path]) -> list[Path]:
    """Python sources of installed packages (tests and vendored copies left out), sorted."""
    files = []
    for root in roots:
        for path in root.glob("*/**/*.py"):
            parts = set(path.parts)
            if not parts & {"tests", "test", "_vendor", "vendored", "testing"}:
                files.append(path)
    return sorted(files)


def doc_files(roots: Iterable[Path]) -> list[Path]:
    """Package descriptions (METADATA) and the system's documentation texts, sorted."""
    files = [m for root in roots for m in root.glob("*.dist-info/METADATA")]
    share = Path("/usr/share/doc")
    if share.is_dir():
        files += [p for p in share.glob("*/*") if p.name.lower().startswith(("readme", "news", "faq"))
                  and p.suffix in ("", ".md", ".txt", ".gz", ".rst")]
    return sorted(files)


def man_pages() -> list[Path]:
    man = Path("/usr/share/man")
    return sorted(man.glob("man[1-8]/*.gz")) if man.is_dir() else []


def _metadata_text(text: str) -> str:
    """A METADATA file's long description (after the headers)."""
    return text.split("\n\n", 1)[1] if "\n\n" in text else ""


def _sentences(text: str, rng: random.Random, count: int) -> str:
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 30 < len(s.strip()) < 300
             and not re.search(r"[`{}<>|=_#*\\]", s)]
    if not found:
        return ""
    start = rng.randrange(len(found))
    return " ".join(found[start: start + count])


def gather(seed: int = 0, files: int = 400, extra: Iterable[str | Path] = (), builtin: bool = True,
           prompt_files: Iterable[str | Path] = ()) -> Material:
    """The material of one run: `files` sampled sources of each kind (when `builtin`) plus every file in
    `extra` (the user's --text paths: files or directories of text) as plain text, and the chat prompts
    of `prompt_files` (the user's --prompts files, read_prompts) in `chats`."""
    rng = random.Random(seed)
    material = Material()
    for path in prompt_files:
        chats = read_prompts(path)
        material.chats += chats
        material.sources[f"--prompts {path}"] = len(chats)
    for path in _expand(extra):
        text = _read(path)
        material.texts += chunks(text)
        material.sources[f"--text {path}"] = 1
    if not builtin:
        return material
    roots = site_packages()
    codes, docs = [], []
    for path in _sample(rng, python_files(roots), files):
        source = _read(path)
        codes += functions(source)
        material.texts += chunks(source)[:2]
    for path in _sample(rng, doc_files(roots), files):
        text = _read(path)
        docs += chunks(_metadata_text(text) if path.name == "METADATA" else text, 1200)[:3]
    for path in _sample(rng, man_pages(), files // 2):
        docs += chunks(strip_troff(_read(path)), 1200)[:2]
    material.texts += docs
    material.sources.update({"python sources (installed packages)": len(codes),
                             "documents (package descriptions, /usr/share/doc, manual pages)": len(docs)})
    material.prompts, material.follow_ups = prompts(rng, codes, docs)
    return material


Turn = tuple[str, str]  # (role, content)


def read_prompts(path: str | Path) -> list[list[Turn]]:
    """The chat prompts in one --prompts file, each a list of (role, content) turns ending with the user's.

    ``.jsonl``: one JSON value a line, ``.json``: a list of them; a value is a string (one user turn),
    ``{"prompt": str}``, ``{"messages": [{"role": ..., "content": ...}, ...]}`` (an OpenAI chat request or
    log record: system, user and assistant turns, the last the user's; a content may be a list of text
    parts), or a `specdec bench` prompt record (``{"turns": [...]}``, Spec-Bench's format, with optional
    ``"replies"``: read as the bench reads it).  Any other file: every non-empty line is one user turn,
    with the bench's escapes (``\\n``, ``\\t``, ``\\\\``), so one file serves both commands.  Bad input
    raises a SpecdecError naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"--prompts {path}: cannot read it ({e.__class__.__name__})") from None
    lines = text.splitlines()
    if looks_like_jsonl(lines):  # a bench prompt file ({"turns": [...]} records): read as the bench reads it
        return [list(prompt.messages) for prompt in parse_jsonl(lines, name=f"--prompts {path}")] or _none(path)
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"--prompts {path}: not JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(values, list):
            raise SpecdecError(f"--prompts {path}: a .json file holds a list of prompts")
        items = [(f"{path} item {i + 1}", v) for i, v in enumerate(values)]
    elif path.suffix == ".jsonl":
        items = []
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    items.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise SpecdecError(f"--prompts {path}:{number}: not JSON ({e.msg})") from None
    else:
        items = [(f"{path}:{n}", unescape_line(line)) for n, line in enumerate(lines, 1) if line.strip()]
    return [_chat(where, value) for where, value in items] or _none(path)


def _none(path: Path) -> list[list[Turn]]:
    raise SpecdecError(f"--prompts {path}: no prompts in it")


def _chat(where: str, value: Any) -> list[Turn]:
    """One prompt value (see read_prompts) as (role, content) turns."""
    if isinstance(value, str):
        value = {"prompt": value}
    if isinstance(value, dict) and isinstance(value.get("prompt"), str):
        if not value["prompt"].strip():
            raise SpecdecError(f"--prompts {where}: an empty prompt")
        return [("user", value["prompt"])]
    if isinstance(value, dict) and isinstance(value.get("messages"), list) and value["messages"]:
        turns = []
        for message in value["messages"]:
            content = message_text(message.get("content")) if isinstance(message, dict) else None
            if content is None or message.get("role") not in CHAT_ROLES:
                raise SpecdecError(f"--prompts {where}: a message is {{\"role\": {'|'.join(CHAT_ROLES)}, \"content\": text}}")
            turns.append((message["role"], content))
        if turns[-1][0] != "user":
            raise SpecdecError(f"--prompts {where}: the last message must be the user's (the target answers it)")
        if not turns[-1][1].strip():
            raise SpecdecError(f"--prompts {where}: an empty prompt (the last user message has no text)")
        return turns
    raise SpecdecError(f"--prompts {where}: a prompt is a string, {{\"prompt\": text}} or {{\"messages\": [...]}}")


def _expand(paths: Iterable[str | Path]) -> Iterator[Path]:
    for item in paths:
        path = Path(item)
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file())
        else:
            yield path


def math_prompt(rng: random.Random) -> str:
    return rng.choice(MATH).format(a=rng.randint(2, 60), b=rng.randint(2, 40), c=rng.randint(50, 400),
                                   d=rng.randint(2, 12))


def question(rng: random.Random) -> str:
    """A user's question: an explanation of a subject, a comparison, or a fix for a problem."""
    kind = rng.random()
    if kind < 0.5:
        return rng.choice(QUESTION_TASKS).format(subject=rng.choice(SUBJECTS))
    if kind < 0.75:
        a, b = rng.choice(COMPARISONS)
        return rng.choice(COMPARISON_TASKS).format(a=a, A=a[0].upper() + a[1:], b=b)
    return rng.choice(PROBLEM_TASKS).format(problem=rng.choice(PROBLEMS))


def prompts(rng: random.Random, codes: list[str], docs: list[str],
            per_kind: int | None = None) -> tuple[list[str], dict[int, FollowUp]]:
    """Chat prompts over the material, shuffled, and the follow-ups of some (by index): for every n code
    and n document prompts, n questions (a third followed by a second turn), n/2 math problems, n/2
    writing tasks (a quarter followed up), and n/4 writing tasks in another language, each followed by
    a prompt to translate the target's text into English."""
    n = per_kind or max(len(codes), len(docs)) // 2 or 40
    items: list[tuple[str, FollowUp | None]] = [
        (rng.choice(CODE_TASKS).format(code=rng.choice(codes)), None) for _ in range(n if codes else 0)]
    for _ in range(n if docs else 0):
        doc = rng.choice(docs)
        task = rng.choice(DOC_TASKS)
        sentences = _sentences(doc, rng, 3)
        if "{sentences}" in task and not sentences:
            continue
        items.append((task.format(doc=doc, language=rng.choice(LANGUAGES), sentences=sentences), None))

    def turn(share: float) -> FollowUp | None:  # a second user turn after `share` of the answers
        return FollowUp(rng.choice(FOLLOW_UP_TURNS)) if rng.random() < share else None

    items += [(question(rng), turn(1 / 3)) for _ in range(n)]
    items += [(math_prompt(rng), None) for _ in range(n // 2)]
    items += [("Write " + rng.choice(WRITING).format(topic=rng.choice(TOPICS)) + ".", turn(1 / 4)) for _ in range(n // 2)]
    items += [(f"In {rng.choice(LANGUAGES)}, write {rng.choice(WRITING).format(topic=rng.choice(TOPICS))}.",
               FollowUp(rng.choice(TO_ENGLISH))) for _ in range(n // 4)]
    rng.shuffle(items)
    return [p for p, _ in items], {i: f for i, (_, f) in enumerate(items) if f is not None}
