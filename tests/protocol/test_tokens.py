"""Worker tokens: HMACs under the book's key, checked in constant time."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from common.errors import ErrorCode, ProtocolError
from common.protocol.tokens import TOKEN_CHARS, TokenBook, new_key


def _hmac(key: str, text: str) -> str:
    return hmac.new(bytes.fromhex(key), text.encode(), hashlib.sha256).hexdigest()[:TOKEN_CHARS]


def test_tokens_are_hmacs_of_what_they_grant_under_the_key() -> None:
    key = new_key()
    book = TokenBook(key)
    for worker_id, task_id in ((1, 1), (1, 2), (7, 1), (1, 2)):
        assert book.token(worker_id) == _hmac(key, f"worker:{worker_id}")
        assert book.push_token(worker_id, task_id) == _hmac(key, f"push:{worker_id}:{task_id}")
    derived = book.derive("store")
    assert derived.key == hmac.new(bytes.fromhex(key), b"derive:store", "sha256").hexdigest()
    assert derived.push_token(1, 1) == _hmac(derived.key, "push:1:1") != book.push_token(1, 1)


def test_a_token_is_accepted_only_for_what_it_was_issued_for() -> None:
    book, other = TokenBook(new_key()), TokenBook(new_key())
    book.check(3, book.token(3))
    book.check_push(3, 9, book.push_token(3, 9))
    for worker_id, token in ((4, book.token(3)), (3, other.token(3)), (3, "é" * TOKEN_CHARS)):
        with pytest.raises(ProtocolError) as caught:
            book.check(worker_id, token)
        assert caught.value.code == ErrorCode.UNKNOWN_WORKER
    for worker_id, task_id in ((3, 10), (4, 9)):
        with pytest.raises(ProtocolError) as caught:
            book.check_push(worker_id, task_id, book.push_token(3, 9))
        assert caught.value.code == ErrorCode.WRONG_TASK
