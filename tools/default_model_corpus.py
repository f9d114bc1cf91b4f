"""Corpus for the embedded default model (see docs/default-model.md).

The corpus has to exist offline on any machine, so it is taken from the Python
interpreter's own standard library (``Lib/``), which every CPython install
ships under the PSF License. A fixed list of module names (not a directory
walk) defines it, so the same files are picked on every CPython 3.11 / 3.12
install; the file contents still differ between interpreter versions, which is
why the training pipeline records each file's SHA-256 and why the GPU run reads
a token stream built once on one machine rather than rebuilding it there.

Three kinds of documents come out of it:

* ``source``: a Python file, verbatim, behind a one-line ``# file:`` header;
* ``docs``: the prose reference topics in ``pydoc_data/topics.py`` (the text
  that ``help('topic')`` prints), evaluated with ``ast.literal_eval`` so the
  model sees prose rather than a wall of escaped string literals;
* ``chat``: short conversations in the Qwen3.5 ChatML layout, built from the
  docstrings of the same files (question about a function or class, answer =
  the docstring's first paragraph). They teach the model the chat framing and,
  above all, to end an assistant turn with ``<|im_end|>``, which an inference
  engine's default model needs for generation to stop on EOS.

Everything here is pure standard library and deterministic given ``seed``.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Single-file modules and packages present in both CPython 3.11 and 3.12. The
# "dead batteries" removed in 3.13 (PEP 594), distutils/lib2to3, platform data
# tables (encodings), GUI code (tkinter, idlelib, turtledemo) and generated
# build data (_sysconfigdata_*) are left out on purpose.
# fmt: off
MODULES: tuple[str, ...] = (
    "__future__", "_collections_abc", "_compression", "_markupbase", "_py_abc",
    "_pydecimal", "_pyio", "_strptime", "_threading_local", "_weakrefset",
    "abc", "argparse", "ast", "asyncio", "base64", "bdb", "bisect", "bz2",
    "cProfile", "calendar", "cmd", "code", "codecs", "codeop", "collections",
    "colorsys", "compileall", "concurrent", "configparser", "contextlib",
    "contextvars", "copy", "copyreg", "csv", "ctypes", "dataclasses",
    "datetime", "dbm", "decimal", "difflib", "dis", "doctest", "email",
    "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "genericpath", "getopt", "getpass", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http",
    "imaplib", "importlib", "inspect", "io", "ipaddress", "json", "keyword",
    "linecache", "locale", "logging", "lzma", "mailbox", "mimetypes",
    "modulefinder", "multiprocessing", "netrc", "ntpath", "numbers",
    "opcode", "operator", "optparse", "os", "pathlib", "pdb", "pickle",
    "pickletools", "pkgutil", "platform", "plistlib", "poplib", "posixpath",
    "pprint", "profile", "pstats", "pty", "py_compile", "pyclbr", "pydoc",
    "pydoc_data", "queue", "quopri", "random", "re", "reprlib",
    "rlcompleter", "runpy", "sched", "secrets", "selectors", "shelve",
    "shlex", "shutil", "signal", "site", "smtplib", "socket",
    "socketserver", "sqlite3", "ssl", "stat", "statistics", "string",
    "stringprep", "struct", "subprocess", "symtable", "sysconfig",
    "tabnanny", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "token", "tokenize", "tomllib", "trace", "traceback", "tracemalloc",
    "tty", "types", "typing", "unittest", "urllib", "uuid", "warnings",
    "wave", "weakref", "webbrowser", "wsgiref", "xml", "xmlrpc", "zipapp",
    "zipfile", "zipimport", "zoneinfo",
)
# fmt: on

# Modules whose files are held out of tokenizer and model training and used
# only for evaluation: varied in style (numeric code, text handling, data
# structures, a small package) and about 4% of the corpus.
HELDOUT_MODULES: tuple[str, ...] = (
    "colorsys",
    "fractions",
    "graphlib",
    "json",
    "queue",
    "sched",
    "statistics",
    "textwrap",
)

# Package sub-folders that are test suites or helper data, not library code.
_SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__"}

# pydoc's prose topics: evaluated, not read as source (see module docstring).
TOPICS_FILE = "pydoc_data/topics.py"

# The Qwen3.5 chat framing (ChatML). Kept as literal strings here so the corpus
# does not depend on a Jinja renderer; the committed chat template renders the
# same layout for a finished conversation.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant who knows the Python standard library.",
    "Answer questions about Python briefly.",
)
_FUNC_QUESTIONS = (
    "What does `{q}` do?",
    "Explain `{q}` from the `{m}` module.",
    "What is the purpose of the function `{q}`?",
    "How do I use `{q}`?",
    "Describe `{name}` in `{m}`.",
)
_CLASS_QUESTIONS = (
    "What is the class `{q}`?",
    "Explain the `{name}` class of the `{m}` module.",
    "What is `{q}` used for?",
    "Describe `{q}`.",
)
_REASONING = (
    "The user asks about `{q}`. It is defined in the `{m}` module, so I can summarise its docstring.",
    "`{name}` lives in `{m}`. Let me recall what its documentation says.",
    "This is a question about the Python standard library: `{q}`.",
)


@dataclass(frozen=True)
class CorpusFile:
    rel: str  # path relative to Lib/, with forward slashes
    module: str  # the entry of MODULES it came from
    sha256: str
    size: int
    heldout: bool


@dataclass(frozen=True)
class Document:
    kind: str  # "source", "docs" or "chat"
    rel: str  # the file it came from
    heldout: bool
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_files(lib: Path, name: str) -> list[Path]:
    single = lib / f"{name}.py"
    if single.is_file():
        return [single]
    pkg = lib / name
    if not (pkg / "__init__.py").is_file():
        # Fail loudly: a silently missing module would change the corpus.
        raise FileNotFoundError(f"stdlib module {name!r} not found under {lib}")
    out = []
    for p in pkg.rglob("*.py"):
        if not _SKIP_DIRS.intersection(p.relative_to(lib).parts[:-1]):
            out.append(p)
    return out


def list_files(lib: Path | None = None, modules: tuple[str, ...] = MODULES) -> list[CorpusFile]:
    """The corpus files, sorted by path so the order never depends on the file system."""
    lib = lib or stdlib_dir()
    held = set(HELDOUT_MODULES)
    files = []
    for name in modules:
        for p in _module_files(lib, name):
            data = p.read_bytes()
            files.append(
                CorpusFile(
                    rel=p.relative_to(lib).as_posix(),
                    module=name,
                    sha256=hashlib.sha256(data).hexdigest(),
                    size=len(data),
                    heldout=name in held,
                )
            )
    files.sort(key=lambda f: f.rel)
    return files


def _read_text(lib: Path, rel: str) -> str:
    # Decode as UTF-8 (every stdlib file is) and normalise line endings so a
    # Windows checkout gives the same text.
    return (lib / rel).read_bytes().decode("utf-8").replace("\r\n", "\n")


def _topics_documents(text: str, rel: str, heldout: bool) -> list[Document]:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            topics = ast.literal_eval(node.value)
            return [Document("docs", rel, heldout, topics[key].strip() + "\n") for key in sorted(topics)]
    raise ValueError(f"{rel}: no 'topics' dictionary found")


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _first_paragraph(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n", 1)[0].strip()
    return " ".join(line.strip() for line in para.splitlines())


def _docstring_entries(text: str, rel: str) -> list[tuple[str, str, str, str]]:
    """(kind, qualified name, short name, answer) for documented public defs."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{node.name}"
                doc = ast.get_docstring(node, clean=False)
                if doc and not node.name.startswith("_"):
                    para = _first_paragraph(doc)
                    # Very short docstrings ("Return x.") teach little; very
                    # long first paragraphs blow up the example length.
                    if 40 <= len(para) <= 700:
                        if isinstance(node, ast.ClassDef):
                            out.append(("class", qual, node.name, para))
                        else:
                            sig = f"{node.name}({ast.unparse(node.args)})"
                            out.append(("function", qual, node.name, f"{para}\n\nSignature: `{sig}`"))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, qual + ".")

    visit(tree.body, "")
    return out


def _chat_document(rng: random.Random, mod: str, kind: str, qual: str, name: str, answer: str) -> str:
    q = f"{mod}.{qual}" if mod else qual
    fields = {"q": q, "m": mod, "name": name}
    questions = _CLASS_QUESTIONS if kind == "class" else _FUNC_QUESTIONS
    parts = []
    if rng.random() < 0.3:
        parts.append(f"{IM_START}system\n{rng.choice(_SYSTEM_PROMPTS)}{IM_END}\n")
    parts.append(f"{IM_START}user\n{rng.choice(questions).format(**fields)}{IM_END}\n")
    # Qwen3.5 renders the final assistant turn with its reasoning block; an
    # empty block is what enable_thinking=False produces.
    reasoning = rng.choice(_REASONING).format(**fields) if rng.random() < 0.5 else ""
    think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else "<think>\n\n</think>\n\n"
    parts.append(f"{IM_START}assistant\n{think}{answer}{IM_END}\n")
    return "".join(parts)


def build_documents(files: list[CorpusFile], lib: Path | None = None, seed: int = 0) -> list[Document]:
    """All documents, in file order; the caller shuffles with its own seed."""
    lib = lib or stdlib_dir()
    rng = random.Random(seed)
    docs: list[Document] = []
    for f in files:
        text = _read_text(lib, f.rel)
        if hashlib.sha256((lib / f.rel).read_bytes()).hexdigest() != f.sha256:
            raise RuntimeError(f"{f.rel} changed since it was listed")
        if f.rel == TOPICS_FILE:
            docs.extend(_topics_documents(text, f.rel, f.heldout))
            continue
        docs.append(Document("source", f.rel, f.heldout, f"# file: Lib/{f.rel}\n{text}"))
        mod = _module_name(f.rel)
        for kind, qual, name, answer in _docstring_entries(text, f.rel):
            docs.append(
                Document("chat", f.rel, f.heldout, _chat_document(rng, mod, kind, qual, name, answer))
            )
    return docs


if __name__ == "__main__":
    # Print the file list and sizes: handy for checking the corpus on a new interpreter.
    fs = list_files()
    ds = build_documents(fs)
    for f in fs:
        print(f"{'H' if f.heldout else 'T'} {f.size:8d} {f.sha256[:12]} {f.rel}")
    for kind in ("source", "docs", "chat"):
        for held in (False, True):
            sel = [d for d in ds if d.kind == kind and d.heldout == held]
            print(kind, "heldout" if held else "train", len(sel), sum(len(d.text) for d in sel))
