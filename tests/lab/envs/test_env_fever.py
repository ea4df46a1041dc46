"""FeverEnv: constructed FEVER-style claims over a HotpotQA corpus (the shared file, or a tiny one written here)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.lab.agents import make_agent
from lifemem_ray.lab.envs import EnvUnavailable, Task, TaskError, make_env
from lifemem_ray.lab.envs.base import EnvStateError
from lifemem_ray.lab.envs.fever.claims import build_claims, validate_claim, validate_claims
from lifemem_ray.lab.envs.fever.env import MAX_ACTION_CHARS, FeverEnv, _lookups, parse_label
from lifemem_ray.lab.envs.fever.facts import LABELS, NEI, REFUTES, SUPPORTS, Claim, claim_sentence, find_facts
from lifemem_ray.lab.envs.wiki_tools import Corpus, WikiBrowser
from lifemem_ray.lab.episode import run_episode
from lifemem_ray.llm.llm_config import LLMConfig

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[4] / "shared"))
HOTPOT = SHARED / "data" / "hotpotqa" / "distractor-dev-100.jsonl"

PAGES = {
    "Acme Widgets": [
        "Acme Widgets is an American maker of widgets founded in 1950.",
        "It sells widgets in 40 countries.",
        "Its logo is blue.",
    ],
    "Jane Roe (inventor)": [
        "Jane Roe (born 1921) is a British inventor of glass tools.",
        "She founded the Glass Museum in Springfield in 1962.",
    ],
    "Springfield Zoo": ["The Springfield Zoo opened on March 3, 1931.", "The zoo houses 300 animals."],
    "Beta Gadgets": ["Beta Gadgets is a Canadian maker of gadgets.", "Beta Gadgets was founded in 1988 in Toronto."],
    "Gamma Records": ["Gamma Records is a French record label founded in 1977.", "Its first album sold well."],
    "Delta Band": ["Delta Band is an Irish rock band formed in 1999.", "The band has toured with many others."],
    "Omega Tower": ["Omega Tower was completed in 1974 in Oslo.", "The tower is made of steel and glass."],
    "Kappa (film)": ["Kappa is a 2004 Italian comedy film.", "It was directed by Luca Rossi."],
    "Sigma Choir": ["The Sigma Choir is a Welsh male voice choir founded in 1926.", "It sings in chapels."],
    "Tau Bridge": ["Tau Bridge is a stone bridge built in 1842 over the river Tau.", "Carts may cross it."],
}
TINY = [
    {
        "id": f"q{n}",
        "question": f"What is {title}?",
        "answer": "x",
        "type": "bridge",
        "level": "easy",
        "supporting_facts": [[title, 0]],
        "context": [[title, sentences]],
    }
    for n, (title, sentences) in enumerate(PAGES.items())
]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def tiny(tmp_path):
    env = FeverEnv(corpus_path=str(_write(tmp_path / "tiny.jsonl", TINY)), n_train=3, n_test=3)
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def fever():
    if not HOTPOT.is_file():
        pytest.skip(f"shared HotpotQA sample not found at {HOTPOT}")
    env = FeverEnv(corpus_path=str(HOTPOT))
    try:
        yield env
    finally:
        env.close()


def _play(env: FeverEnv, task: Task, actions: list[str]):
    env.reset(task)
    r = None
    for action in actions:
        r = env.step(action)
        if r.done:
            break
    return r


# --------------------------------------------------------------------------- construction rules


def test_facts_skip_the_subject_approximations_and_names():
    kinds = [(f.kind, f.text) for f in find_facts("Jane Roe (born 1921) is a British inventor of glass tools.")]
    assert kinds == [("year", "1921"), ("demonym", "British")]
    assert find_facts("The zoo houses about 300 animals.") == []  # approximate
    assert find_facts("He is a South Korean actor with an English name.") == []  # part of a name; a language
    assert [f.text for f in find_facts("It opened on March 3, 1931.")] == ["March", "1931"]  # the day follows a month
    assert find_facts("The 1952 Idaho team won.", subject="1952 Idaho team") == []  # inside the subject's name
    assert [f.text for f in find_facts("The band sold 4,000 records in 1999-2000.")] == ["4,000"]  # a range is no year


def test_claim_sentences_name_their_subject():
    acme = PAGES["Acme Widgets"]
    assert claim_sentence("Acme Widgets", acme, 0) == acme[0]
    assert claim_sentence("Acme Widgets", acme, 1) == "Acme Widgets sells widgets in 40 countries."  # It -> subject
    assert claim_sentence("Acme Widgets", acme, 2) is None  # no fact
    jane = PAGES["Jane Roe (inventor)"]
    assert claim_sentence("Jane Roe (inventor)", jane, 1) == "Jane Roe founded the Glass Museum in Springfield in 1962."
    assert (
        claim_sentence("Kappa (film)", ["Kappa (born 1950) is a dog.", "It won 3 prizes."], 1) is None
    )  # It: a person
    assert claim_sentence("Kappa (film)", ["Kappa is a 2004 film.", "He won 3 prizes."], 1) is None  # He: not one
    assert claim_sentence("Tau", ["Tau is a bridge.", "A", "It was built in 1842."], 2) is None  # not right after
    cut = claim_sentence("Delta Band", ["Delta Band is an Irish rock band formed in 1999, which toured widely."], 0)
    assert cut == "Delta Band is an Irish rock band formed in 1999."  # a trailing clause cut


def test_labels_of_aliases():
    assert parse_label("supports") == SUPPORTS and parse_label(" Refuted. ") == REFUTES
    assert parse_label("not enough information") == NEI and parse_label("NOT ENOUGH INFO") == NEI
    assert parse_label("maybe") is None and parse_label("") is None


def test_tiny_claims_balanced_checked_and_disjoint(tiny):
    source = Corpus.load(Path(tiny.corpus_path)).pages
    claims = tiny.claims
    assert validate_claims(claims, source) == []
    for split in ("train", "test"):
        assert sorted(c.label for c in claims.split(split)) == sorted(LABELS)
    train_src = {c.source_title for c in claims.split("train")}
    assert train_src.isdisjoint({c.source_title for c in claims.split("test")})
    for c in claims.claims:
        sentence = source[c.source_title][c.sentence_index]
        if c.label == SUPPORTS:
            assert c.text == claim_sentence(c.source_title, source[c.source_title], c.sentence_index)
        elif c.label == REFUTES:
            assert c.original in sentence and c.changed not in " ".join(source[c.source_title])
            assert c.text != sentence and c.changed in c.text
        elif c.construction == "withheld-page":
            assert c.source_title not in tiny.corpus.pages
        else:
            assert sentence not in tiny.corpus.pages[c.source_title]
    again = build_claims(source, n_train=3, n_test=3, seed=0)
    assert [c.id for c in again.claims] == [c.id for c in claims.claims]


def test_validation_catches_wrong_claims():
    def without(
        title: str, index: int | None = None, extra: dict[str, list[str]] | None = None
    ) -> dict[str, list[str]]:
        pages = {t: [x for i, x in enumerate(s) if t != title or index not in (None, i)] for t, s in PAGES.items()}
        return {t: s for t, s in pages.items() if t != title or index is not None} | (extra or {})

    def problems(claim: Claim, served: dict[str, list[str]]) -> str:
        return " / ".join(validate_claim(claim, PAGES, served))

    sup = Claim("c1", "test", SUPPORTS, PAGES["Acme Widgets"][0], "Acme Widgets", 0, "Acme Widgets", "sentence")
    assert problems(sup, PAGES) == ""
    assert "not its claim sentence" in problems(dataclasses.replace(sup, text="Acme Widgets is a maker."), PAGES)
    assert problems(dataclasses.replace(sup, label=REFUTES), PAGES)  # nothing changed
    assert "not served" in problems(sup, without("Acme Widgets", 0))

    text = "Jane Roe (born {}) is a British inventor of glass tools."
    ref = Claim("c2", "test", REFUTES, text.format(1925), "Jane Roe (inventor)", 0, "Jane Roe", "year", "1921", "1925")
    assert problems(ref, PAGES) == ""
    held = dataclasses.replace(ref, text=text.format(1962), changed="1962")
    assert "source paragraph holds '1962'" in problems(held, PAGES)
    assert "about 'Jane Roe'" in problems(ref, PAGES | {"Museum": ["Jane Roe was born in 1925 in York."]})

    tower = PAGES["Omega Tower"][0]
    page = Claim("c3", "test", NEI, tower, "Omega Tower", 0, "Omega Tower", "withheld-page")
    assert problems(page, without("Omega Tower")) == ""
    assert "source page is served" in problems(page, PAGES)
    assert "has ['1974']" in problems(page, without("Omega Tower", extra={"Leak": ["Omega Tower opened in 1974."]}))
    assert "repeats most" in problems(
        page, without("Omega Tower", extra={"Leak": ["It was completed in 1974 in Oslo."]})
    )
    assert "subject's name" in problems(page, without("Omega Tower", extra={"Omega Tower (novel)": ["A book."]}))
    museum = "Jane Roe founded the Glass Museum in Springfield in 1962."
    one = Claim("c4", "test", NEI, museum, "Jane Roe (inventor)", 1, "Jane Roe", "withheld-sentence")
    assert problems(one, without("Jane Roe (inventor)", 1)) == ""
    assert "not served without its sentence" in problems(one, PAGES)
    assert problems(dataclasses.replace(one, label="MAYBE"), without("Jane Roe (inventor)", 1)) != ""


# --------------------------------------------------------------------------- the environment


def test_tiny_gold_succeeds_and_wrong_labels_fail(tiny):
    for task in tiny.tasks("train") + tiny.tasks("test"):
        assert task.env == "fever" and task.payload["claim"] in task.instruction
        assert task.metadata["task_type"] == task.payload["label"] and task.metadata["source_title"]
        obs, info = tiny.reset(task)
        assert task.payload["claim"] in obs and info["valid_actions"] is None
        gold = tiny.gold_actions(task)
        r = _play(tiny, task, gold)
        assert r.done and r.reward == 1.0 and r.info["success"] is True, task.id
        for label in LABELS:
            if label != task.payload["label"]:
                r = _play(tiny, task, [f"Finish[{label}]"])
                assert r.done and r.reward == 0.0 and r.info["success"] is False
        tiny.reset(task)
        found = tiny.step(gold[0]).info["page"]  # the Search: the source page, or none withheld
        assert (found == task.metadata["source_title"]) is (task.metadata["construction"] != "withheld-page")


def test_tiny_invalid_actions_are_observed(tiny, tmp_path):
    task = tiny.tasks("test")[0]
    env = FeverEnv(corpus_path=tiny.corpus_path, n_train=3, n_test=3, max_steps=4)
    env.reset(task)
    r = env.step("I think it is true")
    assert r.observation.startswith("Invalid action") and not r.done and r.reward == 0.0
    r = env.step("Finish[probably]")
    assert r.observation.startswith("Invalid answer") and not r.done
    r = env.step("Search[" + "x" * MAX_ACTION_CHARS + "]")
    assert r.observation.startswith(f"Invalid action: longer than {MAX_ACTION_CHARS}") and not r.done
    r = env.step(None)  # type: ignore[arg-type]
    assert r.done and r.info["success"] is False and "Step limit (4)" in r.observation
    with pytest.raises(EnvStateError, match="reset"):
        env.step("Finish[SUPPORTS]")
    env.reset(task)
    r = env.step(f"Thought: checked.\nAction 3: Finish[{task.payload['label'].lower()}]")
    assert r.done and r.info["success"] is True
    with pytest.raises(TaskError):
        env.reset(Task(env="websearch", id="x", instruction="q"))
    with pytest.raises(TaskError, match="label"):
        env.reset(Task(env="fever", id="x", instruction="q", payload={"claim": "c"}))
    with pytest.raises(EnvStateError):
        FeverEnv(corpus_path=tiny.corpus_path, n_train=3, n_test=3).step("Search[x]")


def test_tiny_options_and_missing_corpus(tiny, tmp_path, monkeypatch):
    assert tiny.tasks("train", limit=2) == tiny.tasks("train")[:2]
    assert sorted(t.id for t in tiny.tasks("test", seed=5)) == sorted(t.id for t in tiny.tasks("test"))
    for bad in (
        {"n_train": -1},
        {"n_test": 1.5},
        {"max_steps": 0},
        {"seed": "a"},
        {"n_train": 10_001},
        {"max_steps": 1001},
    ):
        with pytest.raises(InvalidArgumentError):
            FeverEnv(corpus_path=tiny.corpus_path, **bad)
    with pytest.raises(InvalidArgumentError, match="split"):
        tiny.tasks("dev")
    with pytest.raises(EnvUnavailable, match=r"FeverEnv.*does not exist"):
        FeverEnv(corpus_path=str(tmp_path / "none.jsonl"))
    monkeypatch.setenv("LIFEMEM_HOTPOTQA", str(tmp_path / "none.jsonl"))
    with pytest.raises(EnvUnavailable, match="LIFEMEM_HOTPOTQA"):
        FeverEnv()
    few = _write(tmp_path / "few.jsonl", TINY[:1])
    with pytest.raises(TaskError, match=r"no (train|test) claim"):
        FeverEnv(corpus_path=str(few), n_train=3, n_test=3)


def test_gold_lookup_reaches_a_late_sentence():
    def reached(sentences: list[str], index: int) -> str:
        browser = WikiBrowser(Corpus([], {"Page": sentences}))
        browser.search("Page")
        return [browser.lookup(a[len("Lookup[") : -1]) for a in _lookups(sentences, index)][-1]

    sentences = [f"Sentence {i} of the page is about widgets." for i in range(6)] + ["It was built in 1842."]
    assert len(_lookups(sentences, 6)) == 1  # a word no earlier sentence has
    assert reached(sentences, 6) == "(Result 1 / 1) It was built in 1842."
    again = ["The widget shop.", "The widget shop."]
    assert len(_lookups(again, 1)) == 2  # every word occurs before: the Lookup is repeated
    assert reached(again, 1) == "(Result 2 / 2) The widget shop."


class _LLM:
    """A stand-in for the ReAct agent's LLM client: answers from a list, keeps the prompts."""

    def __init__(self, actions: list[str]) -> None:
        self.actions = list(actions)
        self.prompts: list[Any] = []

    def request(self, prompt: Any, model: str, check: Any) -> Any:
        self.prompts.append(prompt)
        step, errors = check({"thought": "checking the claim", "action": self.actions.pop(0)})
        assert not errors, errors
        return step

    def usage(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_react_agent_acts_freely_and_sees_the_labels(tiny):
    task = next(t for t in tiny.tasks("test") if t.payload["label"] == REFUTES)
    evidence = PAGES[task.metadata["source_title"]][0]
    client = _LLM([f"Search[{task.payload['search']}]", "Lookup[zzz]", "Finish[refuted]"])
    config = LLMConfig(backend="openai", base_url="http://127.0.0.1:9/v1", model="m")
    result = run_episode(tiny, make_agent("react", llm_config=config, client=client), task, trajectory_id="react")
    assert result.success and result.steps == 3  # free-form actions: no list of valid actions to keep to
    first, after_search = (p.messages[1]["content"] for p in client.prompts[:2])
    assert task.payload["claim"] in first and "NOT ENOUGH INFO" in first and "Valid actions" not in first
    assert evidence not in first and evidence in after_search  # the page text reaches the agent once searched
    assert "NOT ENOUGH INFO" in client.prompts[2].messages[1]["content"]  # the labels stay in the task


def test_registry_builds_it(tmp_path):
    env = make_env("fever", corpus_path=str(_write(tmp_path / "tiny.jsonl", TINY)), n_train=3, n_test=3)
    try:
        assert isinstance(env, FeverEnv) and env.tasks("test")
    finally:
        env.close()


# --------------------------------------------------------------------------- the shared corpus


def test_shared_claims_balanced_disjoint_and_checked(fever):
    train, test = fever.tasks("train"), fever.tasks("test")
    assert len(train) == 200 and len(test) == 100
    for tasks in (train, test):
        counts = collections.Counter(t.metadata["task_type"] for t in tasks)
        assert set(counts) == set(LABELS) and max(counts.values()) - min(counts.values()) <= 1
        assert sorted(collections.Counter(t.metadata["task_type"] for t in tasks[:30]).values()) == [10, 10, 10]
    assert {t.metadata["source_title"] for t in train}.isdisjoint(t.metadata["source_title"] for t in test)
    assert len({t.id for t in train + test}) == 300
    assert validate_claims(fever.claims, Corpus.load(HOTPOT).pages) == []
    assert [t.id for t in FeverEnv(corpus_path=str(HOTPOT)).tasks("test")] == [t.id for t in test]
    assert [t.id for t in FeverEnv(corpus_path=str(HOTPOT), seed=1).tasks("test")] != [t.id for t in test]
    kinds = collections.Counter(t.metadata["construction"] for t in train + test)
    assert min(kinds[k] for k in ("year", "demonym", "month", "number", "withheld-page", "withheld-sentence")) >= 5


def test_shared_gold_succeeds_on_every_task(fever):
    for task in fever.tasks("train") + fever.tasks("test"):
        fever.reset(task)
        for action in fever.gold_actions(task):
            r = fever.step(action)
            if action.startswith("Search[") and task.metadata["construction"] != "withheld-page":
                assert r.info["page"] == task.metadata["source_title"], task.id
        assert r.done and r.info["success"] is True, task.id


def test_shared_random_and_constant_answers_mostly_fail(fever):
    test = fever.tasks("test")
    wins = sum(run_episode(fever, make_agent("random"), t, trajectory_id=f"r/{t.id}").success for t in test)
    assert wins / len(test) < 0.5
    for tasks in (fever.tasks("train"), test):
        for label in LABELS:
            rate = sum(_play(fever, t, [f"Finish[{label}]"]).info["success"] for t in tasks) / len(tasks)
            assert rate < 0.4, label  # no label wins by being guessed always
