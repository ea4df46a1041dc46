"""Seeded synthetic trajectories with ground-truth workflow labels.

For demos, tests and load benchmarks: twelve environments modelled on the
paper's (household, science lab, shop, wiki QA, SQL, retail and airline
support, API tools, web forms, web navigation, data QA, fact checking), each
with a few workflows. A trajectory's ``metadata["workflow"]`` is its label,
so cluster purity can be measured. Observations are padded towards the lengths
seen in the real data (``length_scale`` shrinks them for speed).

:func:`text_vectors` makes retrieval vectors directly (no embedding model) for
million-scale loads: a bag of fixed random word directions, so similar texts
get similar vectors. :func:`label_vectors` makes vectors from labels alone.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.model import Outcome, Step, Trajectory

__all__ = ["ENVIRONMENTS", "Workflow", "generate", "label_vectors", "text_vectors", "workflow_labels"]


@dataclass(frozen=True)
class Workflow:
    name: str
    goals: tuple[str, ...]
    # (thought, action, observation) templates; a step whose action starts with "*" repeats 1-3 times
    steps: tuple[tuple[str, str, str], ...]


_SLOTS: dict[str, tuple[str, ...]] = {
    "obj": ("mug", "apple", "book", "key chain", "pencil", "towel", "bowl", "cd", "tomato", "watch", "vase", "plate"),
    "place": (
        "countertop",
        "shelf",
        "drawer",
        "desk",
        "cabinet",
        "dining table",
        "sofa",
        "side table",
        "bed",
        "dresser",
    ),
    "appliance": ("microwave", "fridge", "sink basin", "stove burner"),
    "lamp": ("desk lamp", "floor lamp"),
    "substance": ("water", "ice", "chocolate", "orange juice", "wax", "soap"),
    "plant": ("apple tree", "pea plant", "orange seed", "lily"),
    "room": ("kitchen", "workshop", "greenhouse", "living room", "bathroom", "hallway"),
    "product": (
        "usb flash drive",
        "running shoes",
        "wireless earbuds",
        "coffee grinder",
        "yoga mat",
        "desk lamp",
        "phone case",
        "backpack",
    ),
    "attr": ("32 gb", "size 7.5", "black", "waterproof", "stainless steel", "pack of 2", "large", "blue"),
    "price": ("20.00", "35.00", "50.00", "80.00", "120.00"),
    "entity": (
        "Gargoyles",
        "Ada Lovelace",
        "Mount Kenya",
        "The Hobbit",
        "Lake Baikal",
        "Nikola Tesla",
        "Ottoman Empire",
        "Miles Davis",
    ),
    "entity2": (
        "Saturn V",
        "Grace Hopper",
        "K2",
        "Dune",
        "Lake Superior",
        "Marie Curie",
        "Roman Republic",
        "John Coltrane",
    ),
    "table": ("orders", "employees", "transactions", "inventory", "customers", "shipments"),
    "column": ("quantity", "salary", "price", "status", "region", "created_at"),
    "value": ("100", "2023-01-01", "'outgoing'", "'active'", "42", "'north'"),
    "name": ("Juan Rossi", "Mia Chen", "Omar Haddad", "Lena Novak", "Ravi Iyer", "Sara Ito"),
    "order": ("#W7602708", "#W1234567", "#W5550123", "#W9081726", "#W3141592"),
    "flight": ("HAT123", "HAT456", "HAT789", "HAT042"),
    "city": ("Boston", "Denver", "Seattle", "Miami", "Chicago", "Austin"),
    "api": ("hospital", "weather", "calendar", "stock", "translation", "alarm"),
    "field": ("username", "email", "date", "comment", "search box", "city"),
    "site": ("enterprise", "united", "amazon", "yelp", "ikea", "nba"),
    "date": ("2016-03-21", "2017-08-02", "2018-11-15", "2019-05-30", "2020-01-06"),
    "claim": ("was born in 1815", "is the highest mountain in Africa", "was published in 1937", "is the deepest lake"),
}

_PAD = (
    "You also see a number of other objects and receptacles that are not relevant to the goal. "
    "The environment lists every visible item with its state and location in turn. "
)


def _w(name: str, goals: list[str], steps: list[tuple[str, str, str]]) -> Workflow:
    return Workflow(name, tuple(goals), tuple(steps))


ENVIRONMENTS: dict[str, tuple[Workflow, ...]] = {
    "household": (
        _w(
            "pick_and_place",
            ["put a {obj} in the {place}.", "place a {obj} on the {place}."],
            [
                ("I need to find a {obj} first.", "*go to {place}", "On the {place}, you see a {obj} and a cloth."),
                ("", "take {obj} from {place}", "You pick up the {obj} from the {place}."),
                ("Now bring it to the target.", "go to {place}", "You arrive at the {place}."),
                ("", "move {obj} to {place}", "You move the {obj} to the {place}."),
            ],
        ),
        _w(
            "pick_heat_then_place",
            ["heat some {obj} and put it in the {place}."],
            [
                ("", "*go to {place}", "On the {place}, you see a {obj}."),
                ("", "take {obj} from {place}", "You pick up the {obj}."),
                ("It must be heated.", "go to microwave", "The microwave is closed."),
                ("", "heat {obj} with microwave", "You heat the {obj} using the microwave."),
                ("", "go to {place}", "You arrive at the {place}."),
                ("", "move {obj} to {place}", "You move the {obj} to the {place}."),
            ],
        ),
        _w(
            "pick_clean_then_place",
            ["clean some {obj} and put it in the {place}."],
            [
                ("", "*go to {place}", "On the {place}, you see a {obj}."),
                ("", "take {obj} from {place}", "You pick up the {obj}."),
                ("", "go to sinkbasin", "On the sinkbasin, you see nothing."),
                ("", "clean {obj} with sinkbasin", "You clean the {obj} using the sinkbasin."),
                ("", "go to {place}", "You arrive at the {place}."),
                ("", "move {obj} to {place}", "You move the {obj} to the {place}."),
            ],
        ),
        _w(
            "look_at_obj_in_light",
            ["look at the {obj} under the {lamp}.", "examine the {obj} with the {lamp}."],
            [
                ("", "*go to {place}", "On the {place}, you see a {obj}."),
                ("", "take {obj} from {place}", "You pick up the {obj}."),
                ("", "go to {lamp}", "On the side table, you see a {lamp}."),
                ("", "use {lamp}", "You turn on the {lamp}."),
            ],
        ),
    ),
    "science": (
        _w(
            "boil",
            ["Your task is to boil {substance}. First, focus on the substance."],
            [
                ("", "look around", "This room is called the hallway. You see doors to the {room}."),
                ("", "open door to kitchen", "The door is now open."),
                ("", "go to kitchen", "You move to the kitchen."),
                ("", "focus on {substance}", "You focus on the {substance}."),
                ("", "move {substance} to pot", "You move the {substance} to the pot."),
                ("", "activate stove", "The stove is now activated."),
                ("", "*wait1", "You decide to wait for 1 iterations."),
                ("", "examine {substance}", "a substance called steam"),
            ],
        ),
        _w(
            "measure_temperature",
            ["Your task is to measure the temperature of {substance} with a thermometer."],
            [
                ("", "look around", "This room is called the {room}."),
                ("", "pick up thermometer", "You move the thermometer to the inventory."),
                ("", "focus on {substance}", "You focus on the {substance}."),
                ("", "use thermometer on {substance}", "the thermometer measures a temperature of 21 degrees celsius"),
                ("", "move {substance} to blue box", "You move the {substance} to the blue box."),
            ],
        ),
        _w(
            "grow_plant",
            ["Your task is to grow a {plant}. First, focus on a seed."],
            [
                ("", "look around", "This room is called the greenhouse."),
                ("", "focus on {plant} seed", "You focus on the seed."),
                ("", "move {plant} seed to flower pot", "You move the seed to the flower pot."),
                ("", "water flower pot", "The soil is now wet."),
                ("", "*wait", "You decide to wait for 10 iterations."),
                ("", "look at flower pot", "a {plant} in the adult stage"),
            ],
        ),
    ),
    "shop": (
        _w(
            "buy_with_options",
            ["i need a {product} that is {attr}, and price lower than {price} dollars"],
            [
                (
                    "",
                    "search[{product} {attr}]",
                    "[Back to Search] Page 1 (Total results: 50) [B0845XPB49] {product} ${price}",
                ),
                ("", "click[B0845XPB49]", "[Back to Search] [< Prev] size [{attr}] color [black] [Buy Now]"),
                ("", "*click[{attr}]", "You have clicked {attr}."),
                ("", "click[Buy Now]", "Thank you for shopping with us!"),
            ],
        ),
        _w(
            "browse_then_buy",
            ["find me a {product}, {attr}, under {price} dollars"],
            [
                (
                    "",
                    "search[{product}]",
                    "[Back to Search] Page 1 (Total results: 50) [Next >] [B07XF97YZX] {product}",
                ),
                ("", "click[Next >]", "Page 2 (Total results: 50) [B09BMXX8BX] {product} {attr}"),
                ("", "click[B09BMXX8BX]", "[Back to Search] [< Prev] {product} {attr} [Buy Now]"),
                ("", "click[< Prev]", "Page 2 (Total results: 50)"),
                ("", "click[B09BMXX8BX]", "{product} {attr} Price: ${price} [Buy Now]"),
                ("", "click[Buy Now]", "Thank you for shopping with us!"),
            ],
        ),
    ),
    "wiki_qa": (
        _w(
            "bridge",
            [
                "What city is associated with the creator of {entity}?",
                "Which country was the founder of {entity} born in?",
            ],
            [
                (
                    "I need to search {entity} first.",
                    "Search[{entity}]",
                    "{entity} is a subject with a long history and many associated people.",
                ),
                ("I should look up the founder.", "Lookup[founder]", "(Result 1 / 1) The founder was born in {city}."),
                ("Now search the founder.", "Search[{entity2}]", "{entity2} was a figure associated with {city}."),
                ("", "Finish[{city}]", "Answer is correct."),
            ],
        ),
        _w(
            "comparison",
            ["Which is older, {entity} or {entity2}?", "Were {entity} and {entity2} from the same country?"],
            [
                ("Search the first.", "Search[{entity}]", "{entity} dates from the nineteenth century."),
                ("Search the second.", "Search[{entity2}]", "{entity2} dates from the twentieth century."),
                ("Compare the two.", "Finish[{entity}]", "Answer is correct."),
            ],
        ),
    ),
    "sql": (
        _w(
            "select_answer",
            [
                "What is the total {column} in {table} where {column} is above {value}?",
                "List the {column} of {table} grouped by region.",
            ],
            [
                (
                    "I will query the table.",
                    "Action: Operation\n```sql\nSELECT SUM({column}) FROM {table} WHERE {column} > {value};\n```",
                    "[(1250,)]",
                ),
                ("The result answers the question.", "Action: Answer\nFinal Answer: [1250]", ""),
            ],
        ),
        _w(
            "update_rows",
            [
                "Set the {column} of {table} rows to {value} where status is stale.",
                "Delete rows from {table} with {column} below {value}.",
            ],
            [
                (
                    "Check what will change.",
                    "Action: Operation\n```sql\nSELECT * FROM {table} WHERE {column} < {value};\n```",
                    "[(1, 'a'), (2, 'b')]",
                ),
                (
                    "Now update.",
                    "Action: Operation\n```sql\nUPDATE {table} SET {column} = {value} WHERE {column} < {value};\n```",
                    "[]",
                ),
                ("", "Action: Answer\nFinal Answer: none", ""),
            ],
        ),
    ),
    "retail": (
        _w(
            "cancel_order",
            ["My name is {name}. Cancel order {order} because it is no longer needed."],
            [
                (
                    "",
                    'Action:\n{{"name": "find_user_id_by_name_zip", "arguments": {{"name": "{name}"}}}}',
                    "API output: user_4821",
                ),
                (
                    "",
                    'Action:\n{{"name": "get_order_details", "arguments": {{"order_id": "{order}"}}}}',
                    "API output: status pending",
                ),
                (
                    "",
                    'Action:\n{{"name": "cancel_pending_order", "arguments": {{"order_id": "{order}", "reason": "no longer needed"}}}}',
                    "API output: cancelled",
                ),
                ("", "Your order {order} has been cancelled.", "Thanks!"),
            ],
        ),
        _w(
            "return_item",
            ["I am {name} and I want to return the {product} from order {order}."],
            [
                (
                    "",
                    'Action:\n{{"name": "find_user_id_by_email", "arguments": {{"email": "x@example.com"}}}}',
                    "API output: user_77",
                ),
                (
                    "",
                    'Action:\n{{"name": "get_order_details", "arguments": {{"order_id": "{order}"}}}}',
                    "API output: delivered",
                ),
                (
                    "",
                    'Action:\n{{"name": "return_delivered_order_items", "arguments": {{"order_id": "{order}"}}}}',
                    "API output: return requested",
                ),
                ("", "The return for your {product} is requested.", "Great, thank you."),
            ],
        ),
        _w(
            "exchange_item",
            ["Hi, {name} here; exchange the {product} in {order} for a {attr} one."],
            [
                (
                    "",
                    'Action:\n{{"name": "find_user_id_by_name_zip", "arguments": {{"name": "{name}"}}}}',
                    "API output: user_90",
                ),
                (
                    "",
                    'Action:\n{{"name": "get_product_details", "arguments": {{"product_id": "1234"}}}}',
                    "API output: variants",
                ),
                (
                    "",
                    'Action:\n{{"name": "exchange_delivered_order_items", "arguments": {{"order_id": "{order}"}}}}',
                    "API output: exchanged",
                ),
                ("", "Your exchange is confirmed.", "Thanks."),
            ],
        ),
    ),
    "airline": (
        _w(
            "book_flight",
            ["I'm {name}; book a one-way flight from {city} on {date}."],
            [
                (
                    "",
                    'Action:\n{{"name": "get_user_details", "arguments": {{"user_id": "u1"}}}}',
                    "API output: member gold",
                ),
                (
                    "",
                    'Action:\n{{"name": "search_direct_flight", "arguments": {{"origin": "{city}"}}}}',
                    "API output: {flight}",
                ),
                (
                    "",
                    'Action:\n{{"name": "book_reservation", "arguments": {{"flight": "{flight}"}}}}',
                    "API output: booked",
                ),
                ("", "Your flight {flight} is booked.", "Thanks."),
            ],
        ),
        _w(
            "cancel_reservation",
            ["{name} here, cancel my reservation on flight {flight}."],
            [
                (
                    "",
                    'Action:\n{{"name": "get_reservation_details", "arguments": {{"reservation_id": "R1"}}}}',
                    "API output: {flight}",
                ),
                (
                    "",
                    'Action:\n{{"name": "cancel_reservation", "arguments": {{"reservation_id": "R1"}}}}',
                    "API output: cancelled",
                ),
                ("", "The reservation is cancelled and refunded.", "Thank you."),
            ],
        ),
    ),
    "api_tools": (
        _w(
            "search_then_call",
            ["Find the {api} information for {city} tomorrow.", "I need the {api} details near {city}."],
            [
                (
                    "",
                    "[ToolSearcher(keywords='{api} information')]",
                    "API: get_{api} | Description: returns {api} data | Input: location",
                ),
                ("", "[Get{api}(location='{city}')]", "{{'data': 'result for {city}'}}"),
                ("", "[Finish()]", ""),
            ],
        ),
        _w(
            "two_tool_chain",
            ["Book a {api} appointment after checking availability in {city}."],
            [
                ("", "[ToolSearcher(keywords='{api} availability')]", "API: check_{api} | Description: availability"),
                ("", "[Check{api}(city='{city}')]", "{{'slots': ['10:00']}}"),
                ("", "[ToolSearcher(keywords='book {api}')]", "API: book_{api} | Description: booking"),
                ("", "[Book{api}(time='10:00')]", "{{'status': 'ok'}}"),
                ("", "[Finish()]", ""),
            ],
        ),
    ),
    "web_forms": (
        _w(
            "fill_and_submit",
            ['Enter the {field} "{city}" and submit the form.', "Type {name} into the {field} field and press submit."],
            [
                (
                    "",
                    '```agent.click_xpath("//*[@id=\'{field}\']")\nagent.type("{city}")\nagent.click_xpath("//button[text()=\'Submit\']")```',
                    "Done.",
                ),
            ],
        ),
        _w(
            "select_date",
            ["Select {date} as the date and submit."],
            [
                ("", "```agent.click_xpath(\"//*[@id='datepicker']\")```", "A calendar opened."),
                (
                    "",
                    "```agent.click_xpath(\"//a[text()='15']\")\nagent.click_xpath(\"//button[@id='submit']\")```",
                    "Done.",
                ),
            ],
        ),
    ),
    "web_nav": (
        _w(
            "search_and_filter",
            ["Website: {site}\nTask: Find a {product} in {city} for {date}."],
            [
                (
                    "",
                    "Action: `TYPE [198] [{city}]`",
                    "Observation: `<html> <li id=13927 option> {city} </li> </html>`",
                ),
                ("", "Action: `CLICK [13927]`", "Observation: `<html> <input id=77 date/> </html>`"),
                ("", "Action: `SELECT [77] [{date}]`", "Observation: `<html> <button id=5 search/> </html>`"),
                ("", "Action: `CLICK [5]`", "Observation: `<html> results </html>`"),
            ],
        ),
        _w(
            "browse_menu",
            ["Website: {site}\nTask: Open the {product} section and view deals."],
            [
                ("", "*Action: `CLICK [2456]`", "Observation: `<html> <nav> menu </nav> </html>`"),
                ("", "Action: `CLICK [5582]`", "Observation: `<html> deals </html>`"),
            ],
        ),
    ),
    "data_qa": (
        _w(
            "sql_interpreter",
            ["What was the opening price of coffee on {date}?", "What was the closing price of coffee on {date}?"],
            [
                ("Load the database first.", "LoadDB[coffee]", "We have successfully loaded the coffee database."),
                (
                    "Query the price.",
                    "SQLInterpreter[SELECT Open FROM coffee_data WHERE Date = '{date}';]",
                    "Open: 123.5",
                ),
                ("", "Finish[123.5]", "Answer is CORRECT"),
            ],
        ),
        _w(
            "filter_getvalue",
            ["What was the highest price of coffee on {date}?", "What was the volume of coffee traded on {date}?"],
            [
                ("", "LoadDB[coffee]", "We have successfully loaded the coffee database."),
                ("", "FilterDB[Date={date}]", "We have successfully filtered the data (1 row)."),
                ("", "GetValue[High]", "130.2"),
                ("", "Finish[130.2]", "Answer is CORRECT"),
            ],
        ),
        _w(
            "filter_calculate",
            ["What was the price change of coffee on {date}?"],
            [
                ("", "LoadDB[coffee]", "We have successfully loaded the coffee database."),
                ("", "FilterDB[Date={date}]", "We have successfully filtered the data (1 row)."),
                ("", "GetValue[Open, Close]", "Open: 120.1, Close: 124.3"),
                ("", "Calculate[124.3-120.1]", "4.2"),
                ("", "Finish[4.2]", "Answer is CORRECT"),
            ],
        ),
    ),
    "fact_check": (
        _w(
            "verify_claim",
            ["Claim: {entity} {claim}. Is it supported, refuted, or not enough info?"],
            [
                ("Search the subject.", "Search[{entity}]", "{entity} is described in several sources."),
                ("Check the detail.", "Lookup[{claim}]", "(Result 1 / 1) ... {claim} ..."),
                ("", "Finish[SUPPORTS]", "Episode finished."),
            ],
        ),
    ),
}


def workflow_labels() -> list[str]:
    return [f"{env}/{wf.name}" for env, wfs in ENVIRONMENTS.items() for wf in wfs]


def _fill(template: str, slots: dict[str, str]) -> str:
    return template.format(**slots) if "{" in template else template


def generate(
    n: int,
    *,
    seed: int = 0,
    envs: list[str] | None = None,
    length_scale: float = 1.0,
    failure_rate: float = 0.15,
    id_prefix: str = "syn",
) -> Iterator[Trajectory]:
    """``n`` trajectories, round-robin over environments, deterministic for a seed."""
    rng = random.Random(seed)
    names = envs or list(ENVIRONMENTS)
    for env in names:
        if env not in ENVIRONMENTS:
            raise InvalidArgumentError(
                f"unknown synthetic environment {env!r}; known: {', '.join(ENVIRONMENTS)}", where="envs"
            )
    for i in range(n):
        env = names[i % len(names)]
        wf = rng.choice(ENVIRONMENTS[env])
        slots = {k: rng.choice(v) for k, v in _SLOTS.items()}
        # Ids, dates and amounts vary per task, as in real logs, so goals are rarely identical.
        slots["order"] = f"#W{rng.randint(1_000_000, 9_999_999)}"
        slots["flight"] = f"HAT{rng.randint(1, 999):03d}"
        slots["date"] = f"20{rng.randint(10, 24)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        slots["price"] = f"{rng.randint(5, 300)}.00"
        slots["value"] = rng.choice(
            (str(rng.randint(1, 500)), f"'{rng.choice(_SLOTS['city']).lower()}'", slots["date"])
        )
        task = _fill(rng.choice(wf.goals), slots)
        steps: list[Step] = []
        success = rng.random() >= failure_rate
        pad = _PAD * max(0, int(rng.expovariate(1.0) * 3 * length_scale))
        for thought, action, observation in wf.steps:
            repeat = rng.randint(1, 3) if action.startswith("*") else 1
            action = action.lstrip("*")
            for _ in range(repeat):
                steps.append(
                    Step(
                        action=_fill(action, slots),
                        thought=_fill(thought, slots),
                        observation=_fill(observation, slots) + (" " + pad if pad else ""),
                    )
                )
        if not success:
            # A failed run stalls: it repeats an early step and stops before the last one.
            steps = [*steps[:-1], steps[0], steps[0]] if len(steps) > 1 else steps
        yield Trajectory(
            env=env,
            task=task,
            steps=tuple(steps),
            outcome=Outcome(success=success, reward=1.0 if success else 0.0),
            id=f"{id_prefix}-{seed}-{i}",
            metadata={"workflow": f"{env}/{wf.name}"},
        )


_WORD = re.compile(r"[a-z0-9]+")


@lru_cache(maxsize=1 << 16)
def _word_vector(word: str, dim: int, seed: int) -> np.ndarray:
    digest = hashlib.blake2b(f"{seed}:{word}".encode(), digest_size=8).digest()
    vec = np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(dim).astype(np.float32)
    return vec / np.linalg.norm(vec)


def text_vectors(texts: list[str], dim: int = 384, *, seed: int = 0) -> np.ndarray:
    """Unit vectors without an embedding model: a sum of fixed random word directions.

    Like a sentence embedding, texts that share words are close and paraphrases of
    one template cluster tightly, so nearest-neighbour structure (and IVF recall)
    behaves like real data; it is deterministic and fast (no model).
    """
    out = np.empty((len(texts), dim), dtype=np.float32)
    for i, text in enumerate(texts):
        words = _WORD.findall(text.lower()) or ["<empty>"]
        vec = np.sum([_word_vector(w, dim, seed) for w in words], axis=0)
        out[i] = vec / np.linalg.norm(vec)
    return out


def label_vectors(
    labels: list[str], tasks_seed: list[int], dim: int = 384, *, noise: float = 0.35, seed: int = 0
) -> np.ndarray:
    """Unit retrieval vectors without an embedding model: label direction + task direction + noise."""
    rng = np.random.default_rng(seed)
    uniq = sorted(set(labels))
    centres = rng.standard_normal((len(uniq), dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    env_names = sorted({label.split("/")[0] for label in uniq})
    env_centres = rng.standard_normal((len(env_names), dim)).astype(np.float32)
    env_centres /= np.linalg.norm(env_centres, axis=1, keepdims=True)
    row = np.array([uniq.index(label) for label in labels])
    env_row = np.array([env_names.index(label.split("/")[0]) for label in labels])
    task_rng = np.random.default_rng(np.asarray(tasks_seed, dtype=np.int64) + seed)
    vecs = (
        0.8 * env_centres[env_row]
        + 0.6 * centres[row]
        + noise * task_rng.standard_normal((len(labels), dim)).astype(np.float32) / np.sqrt(dim) * 4
    )
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    return vecs.astype(np.float32)
