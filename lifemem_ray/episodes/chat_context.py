"""Where the memory's context goes in a chat: the one rule the RL-stack adapters share.

An adapter recalls the memory for a task and gets a fenced block of text
(:func:`lifemem_ray.lab.agent_prompts.memory_context`); the policy sees a chat (OpenAI-style
messages). The block goes either into the system message (one system message, first: the
form every chat template accepts) or before the first user message's text (the memory first,
then the task, as :class:`~lifemem_ray.episodes.memory_wrapper.MemoryWrapper` puts it before the
first observation). The chat given is never changed: a copy comes back.

Example::

    >>> with_context([{"role": "user", "content": "6*7?"}], "CTX", "user")
    [{'role': 'user', 'content': 'CTX\\n\\n6*7?'}]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError

__all__ = ["CONTEXT_PLACES", "last_message", "message_text", "with_context"]

CONTEXT_PLACES = ("system", "user")  # where with_context puts the memory's context


def message_text(message: Mapping[str, Any] | None) -> str:
    """A chat message's text: its string content, or its text parts joined by newlines; ""
    for a missing message or content."""
    content = (message or {}).get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return "" if content is None else str(content)


def last_message(chat: Sequence[Mapping[str, Any]], role: str) -> Mapping[str, Any] | None:
    """The last message of ``chat`` with ``role`` (None when there is none)."""
    return next((m for m in reversed(chat) if m.get("role") == role), None)


def with_context(chat: Sequence[Mapping[str, Any]], context: str, place: str) -> list[dict[str, Any]]:
    """A copy of ``chat`` with ``context`` in it (``place`` is one of :data:`CONTEXT_PLACES`).

    ``system``: after the text of the chat's first message when it is a system message (as a
    last text part when its content is a list of parts), else as a new first system message:
    one system message, first, either way. ``user``: before the text of the first user
    message (as a first text part when its content is a list of parts), else as a new user
    message at the end. An empty ``context`` gives the chat's copy unchanged."""
    if place not in CONTEXT_PLACES:
        raise InvalidArgumentError(f"place must be one of {CONTEXT_PLACES}, got {place!r}", where="with_context")
    out = [dict(message) for message in chat]
    if not context:
        return out
    if place == "system":
        first = out[0] if out else {}
        if first.get("role") != "system":
            out.insert(0, {"role": "system", "content": context})
        elif isinstance(first.get("content"), (list, tuple)):  # text parts: one more, last
            out[0] = {**first, "content": [*first["content"], {"type": "text", "text": context}]}
        else:
            text = message_text(first)
            out[0] = {**first, "content": f"{text}\n\n{context}" if text.strip() else context}
        return out
    for n, message in enumerate(out):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            out[n] = {**message, "content": [{"type": "text", "text": context}, *content]}
        else:
            text = message_text(message)
            out[n] = {**message, "content": f"{context}\n\n{text}" if text.strip() else context}
        return out
    return [*out, {"role": "user", "content": context}]
