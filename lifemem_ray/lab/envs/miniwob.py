"""MiniWoB++: small synthetic web tasks in headless Chromium, driven through a text action language.

One instance holds one Chromium (+ chromedriver) started on first use and reused across
task kinds (a page load per kind switch), so a step costs a few script calls, not a
browser start. The package's gymnasium environment is built around screenshots and
numeric element refs; an LLM agent needs text, so this adapter talks to the page's own
``core`` JavaScript API (the one the package's Selenium instance uses) directly:

* observation: the visible DOM elements, one per line, clickable ones with ``[ref]``;
* actions: ``click [ref]``, ``type [ref] "text"`` (replaces the field's value),
  ``press <key>`` (Enter, Tab, Backspace, ...).

Episodes run without MiniWoB's 10-second timer (an LLM is slower than that); the reward
is the task's raw reward (1 solved, -1 wrong, partial in between for some tasks).
Chromium's temporary folders go under a private ``TMPDIR`` that ``close()`` deletes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, EnvUnavailable, StepResult, Task, TaskError

__all__ = ["DEFAULT_TASK_NAMES", "GOLD_TASKS", "MiniWobEnv", "parse_action", "render_dom"]

INSTALL = "pip install miniwob  (and the browser: apt-get install -y chromium chromium-driver)"
APT = "apt-get install -y chromium chromium-driver"

DEFAULT_TASK_NAMES: tuple[str, ...] = (
    "click-button",
    "click-link",
    "enter-text",
    "click-checkboxes",
    "focus-text",
    "click-option",
    "click-dialog",
    "login-user",
)
_SPLITS = ("train", "test")
_NO_TIMEOUT_MS = 24 * 3600 * 1000  # MiniWoB ends an episode after 10 s by default
_INTERACTIVE = {"button", "a", "label", "select", "option", "textarea", "li"}
_TEXT_INPUTS = {
    "input_text",
    "input_password",
    "input_email",
    "input_number",
    "input_search",
    "input_tel",
    "input_url",
    "textarea",
}
_KEYS = {
    "enter": "\ue007",
    "tab": "\ue004",
    "backspace": "\ue003",
    "escape": "\ue00c",
    "space": " ",
    "delete": "\ue017",
    "arrowup": "\ue013",
    "arrowdown": "\ue015",
    "arrowleft": "\ue012",
    "arrowright": "\ue014",
    "home": "\ue011",
    "end": "\ue010",
}
_MAX_TEXT = 200
_ACTION_HELP = 'Actions: click [ref] | type [ref] "text" | press <key> (Enter, Tab, Backspace, Escape, Space, Delete, arrows, Home, End).'
_ACTION_RE = re.compile(r"^\s*(click|type|press)\b\s*(.*)$", re.IGNORECASE | re.DOTALL)
_REF_RE = re.compile(r"^\[?\s*(\d+)\s*\]?(?:\s+(.*))?$", re.DOTALL)


def parse_action(action: str) -> tuple[str, int | None, str] | str:
    """``(verb, ref, text)`` for a well-formed action, else the error message to show the agent."""
    if not isinstance(action, str) or not action.strip():
        return f"Invalid action: empty. {_ACTION_HELP}"
    m = _ACTION_RE.match(action.strip())
    if not m:
        return f"Invalid action {action.strip()[:80]!r}. {_ACTION_HELP}"
    verb, rest = m.group(1).lower(), m.group(2).strip()
    if verb == "press":
        key = rest.strip("[]\"' ").lower().replace("_", "")
        if key not in _KEYS and not (len(rest) == 1 and rest.isprintable()):
            return f"Invalid action: unknown key {rest[:20]!r}. {_ACTION_HELP}"
        return verb, None, rest if len(rest) == 1 else key
    r = _REF_RE.match(rest)
    if not r:
        return f"Invalid action {action.strip()[:80]!r}: {verb} needs an element ref like [4]. {_ACTION_HELP}"
    ref, text = int(r.group(1)), (r.group(2) or "")
    if verb == "click":
        if text.strip():
            return f"Invalid action {action.strip()[:80]!r}: click takes only a ref. {_ACTION_HELP}"
        return verb, ref, ""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    if len(text) > _MAX_TEXT or "\n" in text:
        return f"Invalid action: the text to type must be one line of at most {_MAX_TEXT} characters."
    return verb, ref, text


def _quote(text: str) -> str:
    return '"' + text + '"'


def _own_text(node: dict[str, Any]) -> str:
    """An element's text, or its descendants' text for containers like <label>."""
    if node.get("text"):
        return " ".join(str(node["text"]).split())
    parts = [_own_text(child) for child in node.get("children", ())]
    return " ".join(p for p in parts if p)


def render_dom(root: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """Lines for the visible elements (``[ref] tag "text" value=...``) and the clickable ones.

    Layout containers (div, p, form ...) are left out unless they carry text of their own;
    text fragments show without refs (they cannot be clicked by ref).
    """
    lines: list[str] = []
    elements: list[dict[str, Any]] = []

    def visit(node: dict[str, Any], label: str) -> None:
        tag = str(node.get("tag", "")).lower()
        ref = int(node.get("ref", 0))
        children = node.get("children", ())
        if tag == "t":
            if not label:  # a label's text shows with its checkbox/radio
                lines.append(f"text {_quote(_own_text(node))}")
            return
        is_input = tag.startswith("input_") or tag == "textarea"
        text = _own_text(node) if (not children or tag in _INTERACTIVE) else ""
        if is_input or tag in _INTERACTIVE or (not children and text):
            parts = [f"[{ref}]", tag]
            if tag.startswith("input_") and tag[6:] in ("checkbox", "radio"):
                parts.append("(checked)" if node.get("value") else "(unchecked)")
                if label:
                    parts.append(_quote(label))
            elif is_input:
                parts.append(f"value={_quote(str(node.get('value') or ''))}")
            elif text:
                parts.append(_quote(text))
            if node.get("focused"):
                parts.append("(focused)")
            # A <label> around a checkbox shows as the checkbox's text, not as an element of its own.
            if tag != "label" or not any(str(c.get("tag", "")).lower().startswith("input_") for c in children):
                lines.append(" ".join(parts))
                elements.append(
                    {
                        "ref": ref,
                        "tag": tag,
                        "text": label if (label and is_input) else text,
                        "id": node.get("id") or "",
                    }
                )
        own_label = ""
        if tag == "label":
            own_label = " ".join(_own_text(c) for c in children if str(c.get("tag", "")).lower() == "t")
        if tag in _INTERACTIVE and tag != "label":
            return  # its inside (icons, text fragments) is part of the element shown
        for child in children:
            visit(child, own_label or label)

    visit(root, "")
    return lines, elements


# -- gold: derived from the utterance's fields and the first DOM ------------------------------


def _find(elements: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    return next((e for e in elements if pred(e)), None)


def _norm(text: str) -> str:
    return " ".join(text.split()).strip().lower()


def _submit(elements: list[dict[str, Any]], label: str = "submit") -> dict[str, Any] | None:
    return _find(elements, lambda e: e["tag"] == "button" and _norm(e["text"]) == label)


def _gold_click_text(tag: str | None) -> Callable[[dict[str, str], list[dict[str, Any]]], list[str] | None]:
    def gold(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
        target = fields.get("target")
        hit = target is not None and _find(elements, lambda e: (tag is None or e["tag"] == tag) and e["text"] == target)
        return [f"click [{hit['ref']}]"] if hit else None

    return gold


def _gold_select(kind: str) -> Callable[[dict[str, str], list[dict[str, Any]]], list[str] | None]:
    def gold(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
        targets = [v for k, v in fields.items() if k.startswith("target")]
        actions = []
        for target in targets:
            box = next((e for e in elements if e["tag"] == f"input_{kind}" and e["text"] == target), None)
            if box is None:
                return None
            actions.append(f"click [{box['ref']}]")
        submit = _submit(elements)
        return [*actions, f"click [{submit['ref']}]"] if submit else None

    return gold


def _gold_enter_text(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
    box, submit = _find(elements, lambda e: e["tag"] in _TEXT_INPUTS), _submit(elements)
    if box is None or submit is None or "target" not in fields:
        return None
    return [f"type [{box['ref']}] {_quote(fields['target'])}", f"click [{submit['ref']}]"]


def _gold_enter_password(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
    boxes, submit = [e for e in elements if e["tag"] == "input_password"], _submit(elements)
    if len(boxes) != 2 or submit is None or "target" not in fields:
        return None
    return [f"type [{b['ref']}] {_quote(fields['target'])}" for b in boxes] + [f"click [{submit['ref']}]"]


def _gold_login(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
    user = _find(elements, lambda e: e["id"] == "username")
    password = _find(elements, lambda e: e["id"] == "password")
    login = _submit(elements, "login")
    if not (user and password and login) or "username" not in fields or "password" not in fields:
        return None
    return [
        f"type [{user['ref']}] {_quote(fields['username'])}",
        f"type [{password['ref']}] {_quote(fields['password'])}",
        f"click [{login['ref']}]",
    ]


def _gold_focus(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
    box = _find(elements, lambda e: e["tag"] in _TEXT_INPUTS)
    return [f"click [{box['ref']}]"] if box else None


def _gold_only_button(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
    buttons = [e for e in elements if e["tag"] == "button"]
    return [f"click [{buttons[0]['ref']}]"] if len(buttons) == 1 else None


def _gold_tab(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
    tab = _find(elements, lambda e: e["tag"] == "a" and e["text"] == f"Tab #{fields.get('target')}")
    return [f"click [{tab['ref']}]"] if tab else None


def _gold_sequence(fields: dict[str, str], elements: list[dict[str, Any]]) -> list[str] | None:
    one = _find(elements, lambda e: e["tag"] == "button" and e["text"] == "ONE")
    two = _find(elements, lambda e: e["tag"] == "button" and e["text"] == "TWO")
    return [f"click [{one['ref']}]", f"click [{two['ref']}]"] if one and two else None


# Task kind -> a solver over (utterance fields, clickable elements of the first page).
GOLD_TASKS: dict[str, Callable[[dict[str, str], list[dict[str, Any]]], list[str] | None]] = {
    "click-test": _gold_only_button,
    "click-dialog": _gold_only_button,
    "click-button": _gold_click_text("button"),
    "click-link": _gold_click_text("span"),
    "click-tab": _gold_tab,
    "click-button-sequence": _gold_sequence,
    "click-checkboxes": _gold_select("checkbox"),
    "click-option": _gold_select("radio"),
    "enter-text": _gold_enter_text,
    "enter-password": _gold_enter_password,
    "login-user": _gold_login,
    "focus-text": _gold_focus,
}


def _children_pids(pid: int) -> list[int]:
    """All descendants of ``pid`` (from /proc; Linux)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class MiniWobEnv(Environment):
    """MiniWoB++ task kinds x seeds; environment name ``miniwob``.

    Tasks: for each kind, one per seed in ``seeds_train`` / ``seeds_test`` (disjoint), the
    page in MiniWoB's "train"/"test" data mode; the instruction is the page's utterance.
    ``info["valid_actions"]``: a click per clickable element, and for text fields a type
    action per value quoted in the utterance. Success: the episode ended with reward > 0.
    Gold actions for the kinds in ``GOLD_TASKS``, read off the first page.
    """

    name = "miniwob"

    def __init__(
        self,
        task_names: list[str] | None = None,
        seeds_train: Sequence[int] = tuple(range(10)),
        seeds_test: Sequence[int] = tuple(range(10_000, 10_005)),
        headless: bool = True,
        max_steps: int = 10,
        *,
        js_heap_mb: int = 128,
    ) -> None:
        try:
            import miniwob  # noqa: F401  (lazy: this module imports without the package)
            import selenium  # noqa: F401
        except ImportError as exc:
            raise EnvUnavailable(f"miniwob: a package is missing ({exc}); install it with: {INSTALL}") from None
        from miniwob.selenium_instance import HTML_DIR

        self._html_dir = HTML_DIR / "miniwob"
        names = list(DEFAULT_TASK_NAMES) if task_names is None else list(task_names)
        if not names:
            raise InvalidArgumentError("task_names must not be empty", where="MiniWobEnv")
        for n in names:
            if not isinstance(n, str) or n.startswith("flight.") or not (self._html_dir / f"{n}.html").is_file():
                raise InvalidArgumentError(
                    f"unknown task {n!r}: no {self._html_dir}/{n}.html (flight.* tasks are not supported)",
                    where="MiniWobEnv",
                )
        seeds = {}
        for what, values in (("seeds_train", seeds_train), ("seeds_test", seeds_test)):
            values = list(values)
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in values) or len(set(values)) != len(
                values
            ):
                raise InvalidArgumentError(
                    f"{what} must be distinct ints >= 0, got {values[:10]!r}", where="MiniWobEnv"
                )
            seeds[what] = values
        if set(seeds["seeds_train"]) & set(seeds["seeds_test"]):
            raise InvalidArgumentError(
                f"seeds_train and seeds_test overlap: {sorted(set(seeds['seeds_train']) & set(seeds['seeds_test']))[:10]}",
                where="MiniWobEnv",
            )
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise InvalidArgumentError(f"max_steps must be an int >= 1, got {max_steps!r}", where="MiniWobEnv")
        self.chrome_binary, self.chromedriver = self._find_browser()
        self.task_names = list(dict.fromkeys(names))
        self.seeds = {"train": seeds["seeds_train"], "test": seeds["seeds_test"]}
        self.headless = headless
        self.max_steps = max_steps
        self.js_heap_mb = js_heap_mb
        self._driver: Any = None
        self._service_pid: int | None = None
        self._tmpdir: str | None = None
        self._page: str | None = None
        self._instructions: dict[tuple[str, str, int], str] = {}
        self._gold: dict[tuple[str, str, int], list[str] | None] = {}
        self._task: Task | None = None
        self._history: list[str] = []
        self._done = True
        self._elements: list[dict[str, Any]] = []
        self._fields: list[tuple[str, str]] = []
        self._generation = 0  # counts episode starts, so a running episode knows when to replay
        self._episode_generation = 0

    @staticmethod
    def _find_browser() -> tuple[str, str]:
        binary = os.environ.get("MINIWOB_CHROME_BINARY") or next(
            (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None
        )
        driver = os.environ.get("MINIWOB_CHROMEDRIVER") or shutil.which("chromedriver")
        if not binary or not os.access(binary, os.X_OK):
            raise EnvUnavailable(
                f"miniwob: no Chromium ({binary or 'chromium not on $PATH'}; MINIWOB_CHROME_BINARY); install it with: {APT}"
            )
        if not driver or not os.access(driver, os.X_OK):
            raise EnvUnavailable(
                f"miniwob: no chromedriver ({driver or 'not on $PATH'}; MINIWOB_CHROMEDRIVER); install it with: {APT}"
            )
        return binary, driver

    # -- process --------------------------------------------------------------------------

    @property
    def browser_pids(self) -> list[int]:
        """chromedriver and its Chromium processes while they run (for tests and monitoring)."""
        if self._service_pid is None or not _alive(self._service_pid):
            return []
        return [self._service_pid] + [p for p in _children_pids(self._service_pid) if _alive(p)]

    def _browser(self) -> Any:
        """The running browser; starts chromedriver + Chromium on first use."""
        if self._driver is None:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service

            self._tmpdir = tempfile.mkdtemp(prefix="lifemem-miniwob-")
            options = webdriver.ChromeOptions()
            options.binary_location = self.chrome_binary
            flags = [
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--user-data-dir={self._tmpdir}/profile",
                "--window-size=500,400",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--mute-audio",
                "--disable-default-apps",
                "--renderer-process-limit=1",
                f"--js-flags=--max-old-space-size={int(self.js_heap_mb)}",
                "--disable-features=Translate,MediaRouter,OptimizationHints,site-per-process",
            ]
            if self.headless:
                flags.append("--headless=new")
            for flag in flags:
                options.add_argument(flag)
            # Chromium puts its org.chromium.Chromium.* folders under TMPDIR: ours, deleted by close().
            service = Service(self.chromedriver, env={**os.environ, "TMPDIR": self._tmpdir})
            try:
                self._driver = webdriver.Chrome(service=service, options=options)
            except Exception as exc:
                proc = getattr(service, "process", None)
                self._service_pid = proc.pid if proc is not None else None
                self._shutdown(None)
                raise EnvUnavailable(
                    f"miniwob: cannot start Chromium {self.chrome_binary} via {self.chromedriver} ({type(exc).__name__}: {str(exc)[:300]}); install: {APT}"
                ) from exc
            self._service_pid = service.process.pid
            # A headless page is never "focused", so focus events would not fire (focus-text,
            # enter-text's blur checks); emulating focus makes it behave like a visible window.
            self._driver.execute_cdp_cmd("Emulation.setFocusEmulationEnabled", {"enabled": True})
            self._driver.set_script_timeout(10)
            self._driver.set_page_load_timeout(20)
            self._page = None
        return self._driver

    def close(self) -> None:
        """Quit Chromium and chromedriver, kill what lingers, delete their temp folders; safe to call twice."""
        driver, self._driver = self._driver, None
        self._page = None
        self._task = None
        self._done = True
        self._shutdown(driver)

    def _shutdown(self, driver: Any) -> None:
        pids = self.browser_pids
        if driver is not None:
            try:
                driver.quit()
            except Exception:  # noqa: BLE001, S110  (a dead browser: its processes are killed below)
                pass
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._service_pid = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110  (interpreter shutdown: nothing left to report to)
            pass

    # -- page -----------------------------------------------------------------------------

    def _js(self, script: str) -> Any:
        return self._browser().execute_script(script)

    def _start_episode(self, subdomain: str, mode: str, seed: int) -> str:
        """Open the task page (if another kind is open), start a seeded episode; its utterance."""
        driver = self._browser()
        if self._page != subdomain:
            from selenium.webdriver.common.by import By
            from selenium.webdriver.support import expected_conditions as EC
            from selenium.webdriver.support.wait import WebDriverWait

            self._page = None
            driver.get((self._html_dir / f"{subdomain}.html").as_uri())
            WebDriverWait(driver, 10).until(EC.presence_of_element_located((By.ID, "sync-task-cover")))
            self._page = subdomain
        self._generation += 1
        self._js(
            "core.endEpisode(0); if (document.activeElement) { document.activeElement.blur(); }"
            f" Math.seedrandom({int(seed)}); core.setDataMode({mode!r});"
            f" core.EPISODE_MAX_TIME = {_NO_TIMEOUT_MS}; core.startEpisodeReal();"
        )
        for _ in range(40):  # some tasks build their page asynchronously
            if self._js("return WOB_TASK_READY;"):
                break
            time.sleep(0.05)
        else:
            raise EnvStateError(f"task page {subdomain} (seed {seed}) did not get ready in 2 s", where="miniwob")
        return str(self._js("return core.getUtterance();"))

    def _observe(self) -> str:
        lines, self._elements = render_dom(self._js("return core.getDOMInfo();"))
        return "\n".join(lines)

    def _metadata(self) -> dict[str, Any]:
        return self._js(
            'return {"done": WOB_DONE_GLOBAL, "raw_reward": WOB_RAW_REWARD_GLOBAL, "reason": WOB_REWARD_REASON};'
        )

    def _valid_actions(self) -> list[str]:
        actions = [f"click [{e['ref']}]" for e in self._elements]
        values = list(dict.fromkeys(v for _, v in self._fields if v))
        for e in self._elements:
            if e["tag"] in _TEXT_INPUTS:
                actions.extend(f"type [{e['ref']}] {_quote(v)}" for v in values)
        return actions

    # -- tasks ----------------------------------------------------------------------------

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The split's tasks shuffled by ``seed`` (ids ``<kind>-<split>-<seed>``); instructions are read off the page (cached)."""
        if split not in _SPLITS:
            raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}", where="miniwob")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidArgumentError(f"limit must be an int >= 0 or None, got {limit!r}", where="miniwob")
        keys = [(name, split, s) for name in self.task_names for s in self.seeds[split]]
        random.Random(seed).shuffle(keys)
        if limit is not None:
            keys = keys[:limit]
        try:
            for key in sorted(k for k in keys if k not in self._instructions):  # grouped by page
                self._instructions[key] = self._start_episode(*key)
        finally:
            self._restore()
        return [
            Task(
                env=self.name,
                id=f"{name}-{sp}-{s}",
                instruction=self._instructions[(name, sp, s)],
                split=sp,
                payload={"subdomain": name, "seed": s, "data_mode": sp},
                metadata={"task_type": name, "seed": s},
            )
            for name, sp, s in keys
        ]

    # -- episodes -------------------------------------------------------------------------

    def _check(self, task: Task) -> tuple[str, str, int]:
        if not isinstance(task, Task):
            raise TaskError(f"expected a Task, got {type(task).__name__}", where="miniwob")
        if task.env != self.name:
            raise TaskError(f"task {task.id!r} belongs to environment {task.env!r}", where="miniwob")
        p = task.payload
        name, seed, mode = p.get("subdomain"), p.get("seed"), p.get("data_mode", task.split)
        if (
            not isinstance(name, str)
            or name.startswith("flight.")
            or "/" in name
            or not (self._html_dir / f"{name}.html").is_file()
        ):
            raise TaskError(f"task {task.id!r} payload.subdomain {name!r} is not a MiniWoB task page", where="miniwob")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise TaskError(f"task {task.id!r} payload.seed must be an int >= 0, got {seed!r}", where="miniwob")
        if mode not in _SPLITS:
            raise TaskError(f"task {task.id!r} payload.data_mode must be train/test, got {mode!r}", where="miniwob")
        return name, mode, seed

    def _begin(self, key: tuple[str, str, int]) -> tuple[str, str]:
        from miniwob.fields import get_field_extractor

        utterance = self._start_episode(*key)
        self._fields = list(get_field_extractor(key[0])(utterance))
        return utterance, self._observe()

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start the task's seeded episode; the observation is the page's elements."""
        key = self._check(task)
        self._task = None
        utterance, observation = self._begin(key)
        if task.instruction and utterance != task.instruction:
            raise TaskError(
                f"task {task.id!r} says {task.instruction!r} but the page generated {utterance!r} (another miniwob version?)",
                where="miniwob",
            )
        self._task = task
        self._episode_generation = self._generation
        self._history = []
        self._done = False
        return observation, {"instruction": utterance, "valid_actions": self._valid_actions(), "success": None}

    def step(self, action: str) -> StepResult:
        """Apply one text action; a malformed one or an unknown ref gets a message and counts as a step."""
        if self._task is None or self._driver is None:
            raise EnvStateError("step() before reset()", where="miniwob")
        if self._done:
            return StepResult(
                "The episode is over; call reset() for a new task.",
                0.0,
                True,
                {"instruction": self._task.instruction, "valid_actions": [], "success": None},
            )
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        self._history.append(action)
        error = self._apply(action)
        meta = self._metadata()
        done = bool(meta.get("done"))
        reward = float(meta.get("raw_reward") or 0.0) if done else 0.0
        if done:
            observation = f"The episode ended: reward {reward:g}" + (
                f" ({meta['reason']})." if meta.get("reason") else "."
            )
        else:
            observation = self._observe()
            if error:
                observation = f"{error}\n{observation}"
        hit_limit = not done and len(self._history) >= self.max_steps
        self._done = done or hit_limit
        info: dict[str, Any] = {
            "instruction": self._task.instruction,
            "valid_actions": [] if self._done else self._valid_actions(),
            "success": (reward > 0) if self._done else None,
        }
        return StepResult(observation, reward, self._done, info)

    def _apply(self, action: str) -> str | None:
        """Perform the action on the page; an error message for the agent, or None."""
        parsed = parse_action(action)
        if isinstance(parsed, str):
            return parsed
        verb, ref, text = parsed
        from selenium.webdriver.common.action_chains import ActionChains

        if verb == "press":
            ActionChains(self._driver, duration=0).send_keys(_KEYS.get(text, text)).perform()
            return None
        element = next((e for e in self._elements if e["ref"] == ref), None)
        if element is None or ref is None:  # ref is None for press only, handled above
            return f"Invalid action: there is no clickable element [{ref}] on the page."
        if verb == "type" and element["tag"] not in _TEXT_INPUTS:
            return f"Invalid action: [{ref}] is a {element['tag']}, not a text field."
        result = self._js(f"return core.elementClick({int(ref)});")
        if result is not True:
            return f"Clicking [{ref}] failed: {result}"
        if verb == "type":
            self._js(f"var e = core.previousDOMInfo[{int(ref)}]; if (e) {{ e.value = ''; }}")
            if text:
                ActionChains(self._driver, duration=0).send_keys(text).perform()
        return None

    def _restore(self) -> None:
        """Replay the running episode after the page was used for something else."""
        if self._task is not None and not self._done and self._generation != self._episode_generation:
            self._begin(self._check(self._task))
            for action in self._history:
                self._apply(action)
                self._observe()  # refs of later actions refer to the page as it was then
            self._episode_generation = self._generation

    def gold_actions(self, task: Task) -> list[str] | None:
        """A solution read off the task's first page (kinds in GOLD_TASKS), else None."""
        key = self._check(task)
        solver = GOLD_TASKS.get(key[0])
        if solver is None:
            return None
        if key not in self._gold:
            try:
                self._begin(key)
                gold = solver(dict(self._fields), self._elements)
            finally:
                self._restore()
            self._gold[key] = gold
        gold = self._gold[key]
        return list(gold) if gold is not None else None
