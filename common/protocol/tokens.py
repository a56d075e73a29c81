"""Worker tokens: the secrets a worker gets at join and shows in every later request.

A token is an HMAC of the worker id under a key, so it is checked without a shared table and
no connection can act for another worker. The coordinator's key signs the tokens it checks
(membership, tasks, data); a key derived from it (``derive("store")``) signs the tokens the
parameter stores check (pulls, and per-task push tokens). Shards get only the derived key:
a shard can neither forge a token the coordinator accepts nor recover the coordinator's key.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

from common.errors import ErrorCode, ProtocolError

TOKEN_CHARS = 32
SIGNED_KEPT = 4096  # tokens remembered: every request checks one, so none is signed twice


def new_key() -> str:
    """A fresh random key (hex)."""
    return secrets.token_hex(32)


class TokenBook:
    """Issues and checks worker tokens under one key.

    Args:
        key: the key (hex).
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._key = bytes.fromhex(key)
        self._keyed = hmac.new(self._key, digestmod=hashlib.sha256)  # copied per token
        self._sign = functools.lru_cache(SIGNED_KEPT)(self._hmac)

    def _hmac(self, text: str) -> str:
        mac = self._keyed.copy()
        mac.update(text.encode())
        return mac.hexdigest()[:TOKEN_CHARS]

    def derive(self, purpose: str) -> TokenBook:
        """A book under a key derived from this one for ``purpose``; its holder cannot
        recover this book's key."""
        derived = hmac.new(self._key, f"derive:{purpose}".encode(), hashlib.sha256).hexdigest()
        return TokenBook(derived)

    def token(self, worker_id: int) -> str:
        """The token of ``worker_id``."""
        return self._sign(f"worker:{worker_id}")

    def push_token(self, worker_id: int, task_id: int) -> str:
        """The token that lets ``worker_id`` push gradient chunks for ``task_id``."""
        return self._sign(f"push:{worker_id}:{task_id}")

    def check(self, worker_id: int, token: str) -> None:
        """Accept ``token`` only if it is ``worker_id``'s.

        Raises:
            ProtocolError: UNKNOWN_WORKER otherwise.
        """
        if not _same(self.token(worker_id), token):
            raise ProtocolError(
                ErrorCode.UNKNOWN_WORKER, f"worker id {worker_id} with a wrong token; join first"
            )

    def check_push(self, worker_id: int, task_id: int, token: str) -> None:
        """Accept ``token`` only if task ``task_id`` was given to ``worker_id``.

        Raises:
            ProtocolError: WRONG_TASK otherwise.
        """
        if not _same(self.push_token(worker_id, task_id), token):
            raise ProtocolError(
                ErrorCode.WRONG_TASK, f"task {task_id} was not given to worker {worker_id}"
            )


def _same(expected: str, given: str) -> bool:
    return given.isascii() and hmac.compare_digest(expected, given)
