"""A real local HTTP server speaking the OpenAI chat-completions protocol (stdlib only).

Tests and benchmarks drive the LLM code through real sockets, the real
``openai`` client and real failure modes (timeouts, 429 with Retry-After, 5xx,
dropped connections, malformed answers) without a model::

    with OpenAIStub([Reply.json({"description": "..."}), Reply.error(500)]) as stub:
        config.base_url = stub.base_url          # http://127.0.0.1:PORT/v1
        ...
        stub.requests[0]["messages"]              # what was sent

Replies come from, in order: the scripted queue (``script`` / :meth:`push`),
then ``responder(request_json)`` (returning None defers), then, when
``sensible=True``, :func:`sensible_reply`, which answers every lifemem
operation validly from the machine-readable markers in the prompt (benchmarks
use it with ``latency_s`` to stand in for a real server). With nothing left it
answers HTTP 500 "stub: no reply scripted".
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["OpenAIStub", "Reply", "sensible_reply", "serve"]


@dataclass
class Reply:
    """One response. ``content`` is the assistant message; ``body`` (raw) overrides it."""

    content: str | None = None
    status: int = 200
    body: bytes | str | dict | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # sleep before answering (a timeout when > the client's)
    drop: bool = False  # close the connection without answering
    usage: bool | tuple[int, int] = True  # False: no usage; (prompt, completion): these counts
    finish_reason: str = "stop"

    @classmethod
    def text(cls, content: str, **kw: Any) -> Reply:
        return cls(content=content, **kw)

    @classmethod
    def json(cls, value: Any, **kw: Any) -> Reply:
        return cls(content=json.dumps(value), **kw)

    @classmethod
    def error(
        cls,
        status: int,
        message: str = "",
        *,
        retry_after: float | str | None = None,
        param: str | None = None,
        code: str | None = None,
        **kw: Any,
    ) -> Reply:
        headers = dict(kw.pop("headers", {}))
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
        body = {"error": {"message": message or f"stub error {status}", "type": kind, "param": param, "code": code}}
        return cls(status=status, body=body, headers=headers, **kw)

    @classmethod
    def malformed(cls, **kw: Any) -> Reply:
        """Content that is not JSON: a truncated object followed by chatter."""
        return cls(content='Sure! {"assignments": [{"item": 0, "decision": "jo', **kw)

    @classmethod
    def dropped(cls, **kw: Any) -> Reply:
        return cls(drop=True, **kw)

    @classmethod
    def slow(cls, delay_s: float, content: Any = None, **kw: Any) -> Reply:
        text = content if content is None or isinstance(content, str) else json.dumps(content)
        return cls(content=text, delay_s=delay_s, **kw)


Script = Reply | str | dict | Callable[[dict], Reply | str | dict | None]


def _as_reply(item: Any, request: dict) -> Reply | None:
    if callable(item) and not isinstance(item, Reply):
        item = item(request)
    if item is None or isinstance(item, Reply):
        return item
    if isinstance(item, str):
        return Reply(content=item)
    if isinstance(item, dict):
        return Reply.json(item)
    raise TypeError(f"OpenAIStub: a scripted reply must be Reply, str, dict or callable, got {type(item).__name__}")


class OpenAIStub:
    """The server. Start/stop with ``with``, or :meth:`start` / :meth:`stop`."""

    def __init__(
        self,
        script: Iterable[Script] = (),
        responder: Callable[[dict], Reply | str | dict | None] | None = None,
        *,
        sensible: bool = False,
        latency_s: float = 0.0,
        model: str = "stub-model",
    ) -> None:
        self._queue: list[Script] = list(script)
        self.responder = responder
        self.sensible = sensible
        self.latency_s = latency_s  # added to every chat call
        self.model = model
        self.requests: list[dict] = []  # JSON bodies of chat-completion calls, in arrival order
        self.headers: list[dict[str, str]] = []  # their HTTP headers
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- scripting ---------------------------------------------------------------------

    def push(self, *replies: Script) -> None:
        with self._lock:
            self._queue.extend(replies)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("OpenAIStub: not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def _next_reply(self, request: dict) -> Reply:
        with self._lock:
            item = self._queue.pop(0) if self._queue else None
        reply = _as_reply(item, request) if item is not None else None
        if reply is None and self.responder is not None:
            reply = _as_reply(self.responder, request)
        if reply is None and self.sensible:
            reply = sensible_reply(request)
        return reply or Reply.error(500, "stub: no reply scripted")

    # -- lifetime ----------------------------------------------------------------------

    def start(self) -> OpenAIStub:
        if self._server is not None:
            return self
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.stub = self  # type: ignore[attr-defined]
        self._server = server
        self._stopping.clear()
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="openai-stub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._stopping.set()  # wakes handlers sleeping on a delay
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> OpenAIStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- answering ---------------------------------------------------------------------

    def _completion(self, request: dict, reply: Reply) -> dict:
        content = reply.content or ""
        out: dict[str, Any] = {
            "id": f"chatcmpl-stub-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(request.get("model", self.model)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": reply.finish_reason,
                    "logprobs": None,
                }
            ],
        }
        if reply.usage is not False:
            if isinstance(reply.usage, tuple):
                prompt_tokens, completion_tokens = reply.usage
            else:
                chars = sum(len(str(m.get("content", ""))) for m in request.get("messages", []))
                prompt_tokens, completion_tokens = chars // 4 + 1, len(content) // 4 + 1
            out["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
        return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
    server_version = "OpenAIStub/1"

    @property
    def stub(self) -> OpenAIStub:
        return self.server.stub  # type: ignore[attr-defined]

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without NODELAY, Nagle + delayed ACK add ~40 ms a call.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes | str | dict, headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            self.close_connection = True

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            self._send(
                200,
                {
                    "object": "list",
                    "data": [{"id": self.stub.model, "object": "model", "created": 0, "owned_by": "stub"}],
                },
            )
        else:
            self._send(404, Reply.error(404, f"no route {self.path}").body)  # type: ignore[arg-type]

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, Reply.error(404, f"no route {self.path}").body)  # type: ignore[arg-type]
            return
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            self._send(400, Reply.error(400, "body is not JSON").body)  # type: ignore[arg-type]
            return
        stub = self.stub
        with stub._lock:
            stub.requests.append(request)
            stub.headers.append({k.lower(): v for k, v in self.headers.items()})
            stub.in_flight += 1
            stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
        try:
            reply = stub._next_reply(request)
            delay = stub.latency_s + reply.delay_s
            if delay > 0 and stub._stopping.wait(delay):
                reply = Reply(drop=True)
            if reply.drop:
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            if reply.body is not None:
                self._send(reply.status, reply.body, reply.headers)
            elif reply.status != 200:
                self._send(reply.status, Reply.error(reply.status).body, reply.headers)  # type: ignore[arg-type]
            else:
                self._send(200, stub._completion(request, reply), reply.headers)
        finally:
            with stub._lock:
                stub.in_flight -= 1


# --------------------------------------------------------------------------- sensible answers

_OP = re.compile(r"^Operation: (\w+)", re.MULTILINE)
_ITEM = re.compile(r'<item key="(-?\d+)" allowed_cluster_ids="(\[[^"\]]*\])">')
_TRAJ = re.compile(r'<trajectory key="(\d+)" env="([^"]*)">')
_MAX_GROUPS = re.compile(r"into (?:between 2 and )?(\d+) finer workflows")


def sensible_reply(request: dict) -> Reply:
    """A valid answer to any lifemem prompt: join the first allowed cluster (else open a
    new one), group by environment, and fixed generic descriptions and skills."""
    user = "\n".join(str(m.get("content", "")) for m in request.get("messages", []) if m.get("role") == "user")
    match = _OP.search(user)
    op = match.group(1) if match else ""
    if op == "assign":
        answers = []
        for key, ids in _ITEM.findall(user):
            allowed = json.loads(ids)
            if allowed:
                answers.append({"item": int(key), "decision": "join", "cluster_id": allowed[0]})
            else:
                answers.append(
                    {
                        "item": int(key),
                        "decision": "new",
                        "new_group": f"group-{key}",
                        "description": "Carry out the task with a newly seen sequence of steps.",
                    }
                )
        return Reply.json({"assignments": answers})
    if op in ("partition", "split"):
        members = [(int(k), env) for k, env in _TRAJ.findall(user)]
        by_env: dict[str, list[int]] = {}
        for key, env in members:
            by_env.setdefault(env, []).append(key)
        groups = list(by_env.values())
        if op == "split":
            found = _MAX_GROUPS.search(user)
            max_groups = int(found.group(1)) if found else 2
            if len(groups) < 2:  # one environment: halve it
                keys = [k for k, _ in members]
                groups = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
            while len(groups) > max_groups:
                groups[-2].extend(groups.pop())
        return Reply.json(
            {
                "groups": [
                    {"items": g, "description": f"Complete tasks that follow workflow number {i + 1}."}
                    for i, g in enumerate(groups)
                ]
            }
        )
    if op == "describe":
        return Reply.json({"description": "Locate the relevant object, act on it, then verify the result."})
    if op == "distil":
        return Reply.json(
            {
                "skill": "- Read the goal and list its constraints.\n- Plan the steps before acting.\n"
                "- Check each result against the goal before finishing."
            }
        )
    return Reply.error(400, f"stub: cannot answer operation {op!r}")


def serve(*args: Any, **kwargs: Any) -> Iterator[OpenAIStub]:
    """A started stub for the duration of a pytest fixture: ``stub = pytest.fixture(serve)``
    or ``yield from serve(sensible=True)`` inside a fixture."""
    with OpenAIStub(*args, **kwargs) as stub:
        yield stub
