"""The one rule for where the memory's context goes in a chat (lifemem_ray/lab/chat_context.py),
shared by the verl and SkyRL adapters."""

from __future__ import annotations

import pytest

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.episodes.chat_context import last_message, message_text, with_context

SYSTEM = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "6*7?"}]
BARE = [{"role": "user", "content": "6*7?"}]


def test_system_place_joins_the_first_system_message_or_makes_one():
    assert with_context(SYSTEM, "CTX", "system")[0] == {"role": "system", "content": "Solve it.\n\nCTX"}
    assert with_context(BARE, "CTX", "system") == [{"role": "system", "content": "CTX"}, *BARE]
    blank = [{"role": "system", "content": "  "}, *BARE]
    assert with_context(blank, "CTX", "system")[0] == {"role": "system", "content": "CTX"}
    assert with_context([], "CTX", "system") == [{"role": "system", "content": "CTX"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Solve it."}]}, *BARE]
    assert with_context(parts, "CTX", "system") == [
        {"role": "system", "content": [{"type": "text", "text": "Solve it."}, {"type": "text", "text": "CTX"}]},
        *BARE,
    ]


def test_user_place_goes_before_the_first_user_text():
    two_users = [*BARE, {"role": "assistant", "content": "42"}, {"role": "user", "content": "and 6*8?"}]
    out = with_context(two_users, "CTX", "user")
    assert out[0] == {"role": "user", "content": "CTX\n\n6*7?"} and out[2:] == two_users[2:]
    parts = [{"role": "user", "content": [{"type": "text", "text": "6*7?"}]}]
    assert with_context(parts, "CTX", "user")[0]["content"] == [
        {"type": "text", "text": "CTX"},
        {"type": "text", "text": "6*7?"},
    ]
    assert with_context([{"role": "system", "content": "S"}], "CTX", "user")[-1] == {"role": "user", "content": "CTX"}


def test_the_chat_given_is_never_changed_and_empty_context_is_a_copy():
    before = [dict(m) for m in SYSTEM]
    for place in ("system", "user"):
        with_context(SYSTEM, "CTX", place)
    assert before == SYSTEM
    same = with_context(BARE, "", "user")
    assert same == BARE and same is not BARE


def test_a_place_that_is_not_known_is_refused():
    with pytest.raises(InvalidArgumentError, match="assistant"):
        with_context(BARE, "CTX", "assistant")


def test_message_text_and_last_message():
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}],
    }
    assert message_text(parts) == "a\nb" and message_text(None) == "" and message_text({"content": None}) == ""
    assert message_text({"content": 7}) == "7"
    chat = [*SYSTEM, {"role": "assistant", "content": "x"}, {"role": "user", "content": "last"}]
    assert last_message(chat, "user") == {"role": "user", "content": "last"} and last_message(BARE, "tool") is None
