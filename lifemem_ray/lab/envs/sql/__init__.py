"""SQL tasks on SQLite in the LifelongAgentBench protocol, generated from a seed.

LifelongAgentBench's database tasks need MySQL and a download; this adapter
generates the same kind of tasks (one or two small tables, a question, a gold SQL)
deterministically, so a worker can run thousands of episodes offline on the
standard library's ``sqlite3`` (a fresh in-memory database per ``reset``).

Actions (free text; the first recognised form wins):

* ``Action: Operation`` followed by a fenced block (`````sql ... `````): the first
  block's statement is executed; the observation is the rows as a Python list of
  tuples (``[(1, 'Ann')]``, ``[]`` for INSERT/UPDATE/DELETE) or ``Error: ...``.
* ``Action: Answer`` followed by ``Final Answer: <value>``: ends the episode.
* Shortened single-line forms: ``Operation: <sql>`` and ``Answer: <value>`` (also a
  bare ``Final Answer: <value>``).

Judging, as LifelongAgentBench does: a query task succeeds when the answer equals
the gold query's result (numbers rounded to 2 decimals, strings case- and
space-normalised, rows compared as a multiset unless the question asks for an
order; a lone value, a list of values or a list of tuples are all accepted); a
modification task (INSERT/UPDATE/DELETE) succeeds when, at the answer, every table
equals its state after the gold SQL (the answer text itself is ignored). Running
out of steps without an answer is a failure.

Statements that reach outside the in-memory database (ATTACH/DETACH, VACUUM,
PRAGMA other than read-only introspection, ``load_extension``) are refused with an
observation saying so; runaway queries are interrupted.
"""

from lifemem_ray.lab.envs.sql.database import normalise_rows, parse_action
from lifemem_ray.lab.envs.sql.env import SqlEnv
from lifemem_ray.lab.envs.sql.tasks import TASK_TYPES, generate_task

__all__ = ["TASK_TYPES", "SqlEnv", "generate_task", "normalise_rows", "parse_action"]
