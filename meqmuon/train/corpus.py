"""Document sources: the built-in offline corpus, local text/JSON shards, and English C4 (streamed).

Built-in corpus
    Text every CPython installation carries: the values of ``pydoc_data.topics.topics`` (the
    language-reference sections ``help()`` shows, sorted by key) followed by the docstrings of a fixed,
    sorted list of standard-library modules (:data:`STDLIB_MODULES`), their public classes and
    functions, and the public methods of those classes. One docstring is one document, prefixed by
    the object's qualified name. Docstrings are normalised with ``inspect.cleandoc``, documents shorter
    than :data:`MIN_DOC_CHARS` characters are dropped, duplicates are dropped (first occurrence
    wins) and documents whose text contains a memory address (``at 0x``) are dropped so that
    nothing depends on the process. Modules that fail to import are skipped. Everything is sorted,
    so the corpus is identical across runs of the same Python build; the Python version is part of
    every cache key (:func:`builtin_corpus_key`).

Train/validation split
    Deterministic at the document level: a document goes to validation when the first 8 bytes of
    the SHA-256 of its UTF-8 text, read as an integer, modulo 10000 fall below
    ``val_fraction * 10000`` (5 % by default). It depends on the text alone, never on order or on
    Python's salted ``hash``.

Local files (``--data PATH...``)
    ``*.jsonl`` / ``*.json`` and their ``.gz`` versions hold one JSON object per line with a
    ``"text"`` field (the C4 shard format); ``*.txt`` (or ``.txt.gz``) files are split into
    documents on blank lines (one or more empty lines end a document), which also covers
    one-document-per-file. Directories are expanded recursively in sorted order. Bad input (a line
    that is not JSON or has no ``"text"`` string, text that is not UTF-8, a corrupt ``.gz``) raises
    ``ValueError`` naming the file and line (:func:`iter_file_documents`).

C4
    allenai/c4's English files (``en/c4-train.NNNNN-of-01024.json.gz``,
    ``en/c4-validation.NNNNN-of-00008.json.gz``) read by :class:`C4Documents` from a list of file
    names and an opener: :func:`open_hub` streams them from the hub (``--data c4``, needs network),
    :func:`open_local` reads a local copy (``--data DIR`` when every file has C4's names,
    :func:`c4_split`). One reader, so the tests exercise the hub path's shard order, rank split and
    shuffle buffer offline.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import inspect
import itertools
import json
import re
import subprocess
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "CORPUS_VERSION",
    "MIN_DOC_CHARS",
    "STDLIB_MODULES",
    "builtin_corpus_key",
    "builtin_documents",
    "is_validation",
    "split_documents",
    "expand_paths",
    "iter_file_documents",
    "local_documents",
    "C4_FILE",
    "open_local",
    "open_hub",
    "c4_split",
    "c4_hub_files",
    "C4Documents",
]

#: Bump when the way the built-in corpus is assembled changes (invalidates caches).
CORPUS_VERSION = 1
#: Documents shorter than this (characters) are dropped: one-line docstrings add little text.
MIN_DOC_CHARS = 60

# Fixed, sorted list of standard-library modules (and the pure-Python twins of C modules) whose import
# has no side effects worth worrying about: no GUI (tkinter, turtle, idlelib), no "this"/"antigravity",
# no test packages, no lib2to3 (pickles its grammar), no readline (may write terminal escapes), no
# distutils (setuptools replaces it, so its text would depend on the environment). Platform-specific
# ones (e.g. asyncio.windows_events) simply fail to import and are skipped.
STDLIB_MODULES: tuple[str, ...] = tuple(sorted({
    "_collections_abc", "_compression", "_markupbase", "_pydecimal", "_pyio", "_strptime",
    "_threading_local", "abc", "aifc", "argparse", "array", "ast", "asynchat", "asyncio",
    "asyncio.base_events", "asyncio.base_futures", "asyncio.base_subprocess", "asyncio.base_tasks",
    "asyncio.constants", "asyncio.coroutines", "asyncio.events", "asyncio.exceptions",
    "asyncio.format_helpers", "asyncio.futures", "asyncio.locks", "asyncio.log", "asyncio.mixins",
    "asyncio.proactor_events", "asyncio.protocols", "asyncio.queues", "asyncio.runners",
    "asyncio.selector_events", "asyncio.sslproto", "asyncio.staggered", "asyncio.streams",
    "asyncio.subprocess", "asyncio.taskgroups", "asyncio.tasks", "asyncio.threads",
    "asyncio.timeouts", "asyncio.transports", "asyncio.trsock", "asyncio.unix_events",
    "asyncio.windows_events", "asyncio.windows_utils", "asyncore", "atexit", "audioop", "base64",
    "bdb", "binascii", "bisect", "builtins", "bz2", "cProfile", "calendar", "cgi", "cgitb", "chunk",
    "cmath", "cmd", "code", "codecs", "codeop", "collections", "collections.abc", "colorsys",
    "compileall", "concurrent", "concurrent.futures", "concurrent.futures.process",
    "concurrent.futures.thread", "configparser", "contextlib", "contextvars", "copy", "copyreg",
    "crypt", "csv", "ctypes", "ctypes.macholib", "ctypes.macholib.dyld", "ctypes.macholib.dylib",
    "ctypes.macholib.framework", "ctypes.util", "ctypes.wintypes", "curses", "curses.ascii",
    "curses.has_key", "curses.panel", "curses.textpad", "dataclasses", "datetime", "dbm",
    "dbm.dumb", "dbm.gnu", "dbm.ndbm", "decimal", "difflib", "dis", "doctest", "email",
    "email.base64mime", "email.charset", "email.contentmanager", "email.encoders", "email.errors",
    "email.feedparser", "email.generator", "email.header", "email.headerregistry",
    "email.iterators", "email.message", "email.mime", "email.mime.application", "email.mime.audio",
    "email.mime.base", "email.mime.image", "email.mime.message", "email.mime.multipart",
    "email.mime.nonmultipart", "email.mime.text", "email.parser", "email.policy",
    "email.quoprimime", "email.utils", "enum", "errno", "faulthandler", "fcntl", "filecmp",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "gc", "genericpath", "getopt",
    "getpass", "gettext", "glob", "graphlib", "grp", "gzip", "hashlib", "heapq", "hmac", "html",
    "html.entities", "html.parser", "http", "http.client", "http.cookiejar", "http.cookies",
    "http.server", "imaplib", "imghdr", "imp", "importlib", "importlib.abc", "importlib.machinery",
    "importlib.metadata", "importlib.readers", "importlib.resources", "importlib.resources.abc",
    "importlib.resources.readers", "importlib.resources.simple", "importlib.simple",
    "importlib.util", "inspect", "io", "ipaddress", "itertools", "json", "json.decoder",
    "json.encoder", "json.scanner", "json.tool", "keyword", "linecache", "locale", "logging",
    "logging.config", "logging.handlers", "lzma", "mailbox", "mailcap", "marshal", "math",
    "mimetypes", "mmap", "modulefinder", "multiprocessing", "multiprocessing.connection",
    "multiprocessing.context", "multiprocessing.dummy", "multiprocessing.dummy.connection",
    "multiprocessing.forkserver", "multiprocessing.heap", "multiprocessing.managers",
    "multiprocessing.pool", "multiprocessing.popen_fork", "multiprocessing.popen_forkserver",
    "multiprocessing.popen_spawn_posix", "multiprocessing.popen_spawn_win32",
    "multiprocessing.process", "multiprocessing.queues", "multiprocessing.reduction",
    "multiprocessing.resource_sharer", "multiprocessing.resource_tracker",
    "multiprocessing.shared_memory", "multiprocessing.sharedctypes", "multiprocessing.spawn",
    "multiprocessing.synchronize", "multiprocessing.util", "netrc", "nis", "nntplib", "ntpath",
    "nturl2path", "numbers", "opcode", "operator", "optparse", "os", "ossaudiodev", "pathlib",
    "pdb", "pickle", "pickletools", "pipes", "pkgutil", "platform", "plistlib", "poplib", "posix",
    "posixpath", "pprint", "profile", "pstats", "pty", "pwd", "py_compile", "pyclbr", "pydoc",
    "pyexpat", "queue", "quopri", "random", "re", "reprlib", "resource", "runpy", "sched",
    "secrets", "select", "selectors", "shelve", "shlex", "shutil", "signal", "smtpd", "smtplib",
    "sndhdr", "socket", "socketserver", "spwd", "sqlite3", "sqlite3.dbapi2", "sqlite3.dump",
    "sre_compile", "sre_constants", "sre_parse", "ssl", "stat", "statistics", "string",
    "stringprep", "struct", "subprocess", "sunau", "symtable", "sys", "sysconfig", "syslog",
    "tabnanny", "tarfile", "telnetlib", "tempfile", "termios", "textwrap", "threading", "time",
    "timeit", "token", "tokenize", "tomllib", "trace", "traceback", "tracemalloc", "tty", "types",
    "typing", "unicodedata", "unittest", "unittest.async_case", "unittest.case", "unittest.loader",
    "unittest.main", "unittest.mock", "unittest.result", "unittest.runner", "unittest.signals",
    "unittest.suite", "unittest.util", "urllib", "urllib.error", "urllib.parse", "urllib.request",
    "urllib.response", "urllib.robotparser", "uu", "uuid", "warnings", "wave", "weakref", "wsgiref",
    "wsgiref.handlers", "wsgiref.headers", "wsgiref.simple_server", "wsgiref.types", "wsgiref.util",
    "wsgiref.validate", "xdrlib", "xml", "xml.dom", "xml.dom.NodeFilter", "xml.dom.domreg",
    "xml.dom.expatbuilder", "xml.dom.minicompat", "xml.dom.minidom", "xml.dom.pulldom",
    "xml.dom.xmlbuilder", "xml.etree", "xml.etree.ElementInclude", "xml.etree.ElementPath",
    "xml.etree.ElementTree", "xml.etree.cElementTree", "xml.parsers", "xml.parsers.expat",
    "xml.sax", "xml.sax.expatreader", "xml.sax.handler", "xml.sax.saxutils", "xml.sax.xmlreader",
    "xmlrpc", "xmlrpc.client", "xmlrpc.server", "zipapp", "zipfile", "zipimport", "zlib", "zoneinfo",
}))


def builtin_corpus_key() -> str:
    """Cache key of the built-in corpus: corpus version + exact Python implementation and version."""
    impl = sys.implementation.name
    ver = ".".join(str(x) for x in sys.version_info[:3])
    return f"builtin-v{CORPUS_VERSION}-{impl}{ver}"


def _member_names(module) -> list[str]:
    # Every global except dunders: helper classes outside __all__ and documented _private helpers
    # are prose too (public-only gives ~1.6 MB); re-exports are filtered out by the caller.
    return sorted(n for n in vars(module) if isinstance(n, str) and not n.startswith("__"))


def _is_documented_method(attr: str) -> bool:
    # Dunder docstrings are boilerplate ("Return self==value."), except constructors.
    return not (attr.startswith("__") and attr.endswith("__")) or attr == "__init__"


def _doc_of(obj) -> str | None:
    # obj.__doc__ (not inspect.getdoc) so inherited docstrings do not repeat under every subclass.
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else None


def _module_documents(modname: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) pairs of one module, in sorted order."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated modules warn on import
            module = importlib.import_module(modname)
    except Exception:  # noqa: BLE001 - any import failure: skip the module
        return
    yield modname, _doc_of(module) or ""
    for name in _member_names(module):
        obj = getattr(module, name, None)
        is_cls = inspect.isclass(obj)
        if not (is_cls or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        # Only objects defined here (or in the module's C twin, e.g. _socket for socket): re-exports
        # would otherwise repeat under every importer.
        owner = getattr(obj, "__module__", None)
        if isinstance(owner, str) and owner != modname and owner.lstrip("_") != modname:
            continue
        yield f"{modname}.{name}", _doc_of(obj) or ""
        if is_cls:
            for attr in sorted(a for a in vars(obj) if _is_documented_method(a)):
                member = vars(obj)[attr]
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if callable(member) or isinstance(member, property):
                    yield f"{modname}.{name}.{attr}", _doc_of(member) or ""


def builtin_documents() -> list[str]:
    """The built-in corpus as a list of documents (deterministic for a given Python build).

    Collected in a fresh ``python -I -S`` subprocess: in the calling process, third-party packages
    patch the standard library (transformers adds methods to ``logging.Logger``, typing_extensions
    swaps ``typing`` helpers) and earlier imports change module attributes, so the text would depend
    on what was imported before. ``-S`` also keeps ``.pth`` hooks (e.g. setuptools') out.
    """
    global _CACHED
    if _CACHED is None:
        code = Path(__file__).read_text(encoding="utf-8") + (
            "\nimport json as _j, sys as _s\n_s.stdout.write(_j.dumps(_collect_documents()))\n"
        )
        # The module imports only the standard library, so its source runs without site-packages.
        out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, check=True,
                             env={"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8"})
        _CACHED = json.loads(out.stdout)
    return list(_CACHED)


_CACHED: list[str] | None = None


def _collect_documents() -> list[str]:
    """Assemble the corpus in this process (see :func:`builtin_documents` for why not directly)."""
    import pydoc_data.topics

    docs: list[str] = []
    seen: set[str] = set()

    def add(title: str, body: str) -> None:
        body = body.strip()
        if len(body) < MIN_DOC_CHARS or body in seen or " at 0x" in body:
            return
        seen.add(body)
        docs.append(f"{title}\n\n{body}")

    topics = pydoc_data.topics.topics
    for key in sorted(topics):
        add(key, topics[key])
    for modname in STDLIB_MODULES:
        for title, body in _module_documents(modname):
            add(title, body)
    return docs


def _bucket(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 10000


def is_validation(text: str, val_fraction: float = 0.05) -> bool:
    """Whether a document belongs to the held-out split (stable hash of its text)."""
    return _bucket(text) < round(val_fraction * 10000)


def split_documents(docs: Iterable[str], val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """Split documents into (train, validation), preserving order within each split."""
    train, val = [], []
    for d in docs:
        (val if is_validation(d, val_fraction) else train).append(d)
    return train, val


_SUFFIXES = (".jsonl", ".json", ".txt")
#: File names of allenai/c4 (``en/c4-train.00000-of-01024.json.gz``, ``en/c4-validation.00000-of-00008.json.gz``).
C4_FILE = re.compile(r"^c4-(train|validation)\.\d{5}-of-\d{5}\.json(\.gz)?$")
#: Documents per shuffle block of the C4 stream (GaLore's shuffle buffer size).
C4_SHUFFLE_BUFFER = 10_000
#: The hub copy of C4 English: repository and file counts per split.
C4_HUB_REPO = "allenai/c4"
C4_HUB_FILES = {"train": 1024, "validation": 8}

#: Opens a file name (a local path or a hub path) as a binary stream; see :func:`iter_file_documents`.
Opener = Callable[[str], BinaryIO]


def _kind(path: Path | str) -> str | None:
    name = Path(path).name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    return next((s for s in _SUFFIXES if name.endswith(s)), None)


def expand_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Resolve files and directories (recursively, sorted) into the list of readable data files.

    Raises ``ValueError`` naming the path when it does not exist or a directory holds no data file.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            raise ValueError(f"data path does not exist: {path}")
        if path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and _kind(f))
            if not found:
                raise ValueError(f"no .jsonl/.json/.txt(.gz) files under data directory: {path}")
            files.extend(found)
        elif _kind(path) is None:
            raise ValueError(f"unsupported data file (want .jsonl, .json, .txt, optionally .gz): {path}")
        else:
            files.append(path)
    return files


def open_local(name: str) -> BinaryIO:
    """The :data:`Opener` of local files."""
    return open(name, "rb")


def _line_number(name: str, opener: Opener, start: int, local: int) -> int:
    """1-based line number of the ``local``-th line from byte ``start``, a line start (for errors only)."""
    if start == 0:
        return local
    with opener(name) as f:
        before = f.read(start).count(b"\n")
    return before + local


def iter_file_documents(path: Path | str, opener: Opener | None = None, *, start: int = 0,
                        end: int | None = None) -> Iterator[str]:
    """Documents of one data file (see the module docstring for the formats).

    ``opener`` reads the file (default: the local file system; C4 from the hub passes its own).
    ``start``/``end`` restrict an uncompressed ``.jsonl``/``.json`` file to the lines that begin in
    that byte range, so that one large file can be read by several processes (``meqmuon prepare``).
    Bad input raises ``ValueError`` naming the file and, for a line, its number: a line that is not
    JSON or has no ``"text"`` string, text that is not UTF-8, a corrupt or truncated ``.gz``.
    """
    name = str(path)
    opener = opener or open_local
    kind = _kind(name)
    gz = name.lower().endswith(".gz")
    if (start or end is not None) and (gz or kind == ".txt"):
        raise ValueError(f"{name}: byte ranges need an uncompressed .jsonl/.json file")
    lineno = 0
    try:
        with opener(name) as raw:
            f = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
            pos = 0
            if start:
                f.seek(start - 1)
                pos = start - 1 + len(f.readline())  # the rest of the line that began before start
            first = pos  # byte offset of the first line read
            if kind == ".txt":
                block: list[str] = []
                for lineno, line in enumerate(f, 1):  # noqa: B007 - the error handler reads lineno
                    text = line.decode("utf-8")
                    if text.strip():
                        block.append(text.rstrip("\r\n"))
                    elif block:
                        yield "\n".join(block)
                        block = []
                if block:
                    yield "\n".join(block)
                return
            for lineno, line in enumerate(f, 1):
                if end is not None:
                    if pos >= end:
                        break
                    pos += len(line)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                    where = _line_number(name, opener, first, lineno)
                    msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                    raise ValueError(f"{name}:{where}: not a JSON line ({msg})") from None
                text = obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    where = _line_number(name, opener, first, lineno)
                    raise ValueError(f"{name}:{where}: expected a JSON object with a 'text' string field") from None
                if text.strip():
                    yield text
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}:{lineno}: not UTF-8 text ({e.reason})") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{name}: corrupt or truncated gzip file ({e})") from None


def local_documents(paths: str | Path | Iterable[str | Path]) -> tuple[list[Path], list[str]]:
    """(files, documents) of local data paths; ``ValueError`` naming a path that holds no text."""
    files = expand_paths(paths)
    docs: list[str] = []
    for f in files:
        n = len(docs)
        docs.extend(iter_file_documents(f))
        if len(docs) == n:
            raise ValueError(f"data file holds no text: {f}")
    return files, docs


def c4_split(files: Sequence[str | Path]) -> dict[str, list[str]] | None:
    """``{"train": [...], "validation": [...]}`` (sorted) when every file has one of C4's names
    (:data:`C4_FILE`, e.g. a local copy of allenai/c4's ``en/`` folder) and at least one is a train
    file; ``None`` otherwise (plain local data).

    Raises ``ValueError`` when there are C4 train files but no validation file.
    """
    found: dict[str, list[str]] = {"train": [], "validation": []}
    for f in files:
        m = C4_FILE.match(Path(f).name)
        if m is None:
            return None
        found[m.group(1)].append(str(f))
    if not found["train"]:
        return None
    if not found["validation"]:
        raise ValueError(f"C4 data ({found['train'][0]} ...) has c4-train.* files but no c4-validation.* file")
    return {k: sorted(v) for k, v in found.items()}


def c4_hub_files(split: str) -> list[str]:
    """The file names of C4 English's ``split`` in the hub repository, in order."""
    n = C4_HUB_FILES[split]
    return [f"en/c4-{split}.{i:05d}-of-{n:05d}.json.gz" for i in range(n)]


def open_hub(name: str) -> BinaryIO:
    """The :data:`Opener` of C4 on the hub: ``name`` is a path inside :data:`C4_HUB_REPO`."""
    try:
        from huggingface_hub import HfFileSystem

        from meqmuon.train.hub import quiet_retries

        with quiet_retries():  # its retry warnings would bury the one-line error below
            return HfFileSystem().open(f"datasets/{C4_HUB_REPO}/{name}", "rb")
    except Exception as e:  # noqa: BLE001 - network, auth, missing package: one clear line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(f"cannot read {C4_HUB_REPO}/{name} from the Hugging Face hub: "
                           f"{type(e).__name__}: {first}") from None


class C4Documents:
    """The C4 train documents one rank reads, from the hub or a local copy through the same code.

    Order of epoch ``e`` (all from ``numpy.random.default_rng``):

    * shard order: the sorted ``files`` permuted with seed ``[seed, e]`` (the same on every rank);
    * rank split: rank ``r`` of ``W`` reads files ``r, r + W, r + 2W, ...`` of that order, whole and
      disjoint from the other ranks' (C4's 1024 train files give 128 per rank on 8 GPUs);
    * shuffle buffer: the rank's documents, in file order, are cut into blocks of ``shuffle_buffer``
      documents and each block is emitted permuted with seed ``[seed, e, r, block]``.

    A block shuffle rather than the reservoir buffer of ``datasets``: the state (epoch, block, where
    the block starts, documents of it emitted) is a few integers, and resuming re-reads at most one
    block, so a resumed run sees exactly the documents an uninterrupted one would.
    """

    def __init__(self, files: Sequence[str], opener: Opener = open_local, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle_buffer: int = C4_SHUFFLE_BUFFER):
        if not files:
            raise ValueError("C4 source has no train files")
        if world_size > len(files):
            raise ValueError(f"{world_size} ranks but only {len(files)} C4 train files: every rank needs one")
        self.files = sorted(files)
        self.opener = opener
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer = max(1, shuffle_buffer)
        self._state = self._start(0)

    @staticmethod
    def _start(epoch: int) -> dict[str, int]:
        return {"epoch": epoch, "block": 0, "file": 0, "doc": 0, "taken": 0}

    def rank_files(self, epoch: int) -> list[str]:
        """This rank's files in epoch ``epoch``, in reading order."""
        import numpy as np  # not at module level: the built-in corpus runs this file without site-packages

        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
        return [self.files[i] for i in order[self.rank :: self.world_size]]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning."""
        self._state = self._start(epoch)

    def state_dict(self) -> dict[str, int]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._state = {k: int(state[k]) for k in ("epoch", "block", "file", "doc", "taken")}

    def _docs_from(self, files: list[str], file: int, doc: int) -> Iterator[tuple[str, int, int]]:
        """``(text, file, doc)`` from position (file, doc) on, where (file, doc) is the position
        *after* that document."""
        for fi in range(file, len(files)):
            it = iter_file_documents(files[fi], self.opener)
            skip = doc if fi == file else 0
            for _ in itertools.islice(it, skip):
                pass
            n = skip
            for text in it:
                n += 1
                yield text, fi, n

    def __iter__(self) -> Iterator[str]:
        import numpy as np

        st = self._state
        epoch = st["epoch"]
        files = self.rank_files(epoch)
        while True:
            block: list[str] = []
            after = (st["file"], st["doc"])
            for text, fi, n in itertools.islice(self._docs_from(files, st["file"], st["doc"]), self.shuffle_buffer):
                block.append(text)
                after = (fi, n)
            if not block:
                return
            perm = np.random.default_rng([self.seed, epoch, self.rank, st["block"]]).permutation(len(block))
            for j in range(st["taken"], len(block)):
                # The state is updated before the yield, so it always names the next document to emit.
                if j + 1 < len(block):
                    st["taken"] = j + 1
                else:  # block done: the state points at the next block
                    st.update(block=st["block"] + 1, file=after[0], doc=after[1], taken=0)
                yield block[perm[j]]
