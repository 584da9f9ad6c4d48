"""Is the Hugging Face hub reachable? One quick check before the hub library is asked for anything.

Without it, an offline machine waits about a minute while ``huggingface_hub`` retries each request
five times (1, 2, 4, 8, 8 s) and logs two warning lines per retry, before the one-line error that says
the hub cannot be reached (issue 46: every bad input is one line). :func:`require_hub` answers in at
most :data:`TIMEOUT_S` seconds instead: ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) means no,
otherwise a TCP connection to the endpoint's host and port (``HF_ENDPOINT``, default
``https://huggingface.co``) must open. :func:`quiet_retries` silences the retry warnings of the hub
library's loggers around one call, not globally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

__all__ = ["HubUnreachable", "TIMEOUT_S", "OFFLINE_HINT", "endpoint", "unreachable", "require_hub", "quiet_retries"]

#: Seconds the reachability check waits (name resolution and TCP connect together).
TIMEOUT_S = 3.0
#: What to do instead, appended to a "cannot reach the hub" error by default.
OFFLINE_HINT = ("offline: use --data builtin or --data pysrc, a tokenizer directory (--tokenizer DIR, "
                "save_pretrained files), or a local C4 copy or prepared directory (see docs/training.md)")
#: The loggers of ``huggingface_hub`` that print "'...' thrown while requesting ..." / "Retrying in ...".
RETRY_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.hf_api")


class HubUnreachable(RuntimeError):
    """The hub is needed and cannot be reached; the message is one line that says what to do instead."""


def endpoint() -> str:
    """The hub URL the hub library uses: ``$HF_ENDPOINT``, else ``https://huggingface.co``."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _offline_env() -> bool:
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def unreachable(timeout: float = TIMEOUT_S) -> str | None:
    """Why the hub cannot be reached (one short phrase), or ``None`` when a TCP connection to it opens.

    The connection runs in a daemon thread joined for ``timeout`` seconds, because name resolution
    (``getaddrinfo``) has no timeout of its own."""
    if _offline_env():
        return "HF_HUB_OFFLINE is set"
    url = endpoint()
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return f"HF_ENDPOINT {url!r} names no host"
    port = parts.port or (80 if parts.scheme == "http" else 443)
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(f"{url} is unreachable: {type(e).__name__}: {e}")

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout)
    return result[0] if result else f"{url} did not answer within {timeout:g} s"


def require_hub(what: str, instead: str = OFFLINE_HINT) -> None:
    """Raise :class:`HubUnreachable` (one line) at once when the hub cannot be reached; ``what`` names the
    thing that needs it (e.g. ``"cannot load tokenizer 't5-base': not in the Hugging Face cache and"``),
    ``instead`` what to do offline."""
    why = unreachable()
    if why is not None:
        raise HubUnreachable(f"{what} the Hugging Face hub cannot be reached ({why}); {instead}")


@contextlib.contextmanager
def quiet_retries() -> Iterator[None]:
    """Silence the hub library's retry warnings within the block (the error that follows says it all)."""
    loggers = [logging.getLogger(name) for name in RETRY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
