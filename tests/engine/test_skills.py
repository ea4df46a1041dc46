"""Workflow clustering mechanics and offline skills on small generated sets (no quality figures)."""

from __future__ import annotations

import random

import numpy as np
from support.common import unit

from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.clustering.policy import OfflinePolicy, skill_step_texts
from lifemem_ray.engine.clustering.skills import distil_procedure, mine_procedure
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig

SUBSTANCES = [
    "water",
    "milk",
    "orange juice",
    "apple juice",
    "oil",
    "soda",
    "tea",
    "vinegar",
    "honey",
    "syrup",
    "broth",
    "cream",
]
OBJECTS = ["apple", "mug", "soapbar", "spatula", "knife", "book", "pen", "cloth", "bowl", "plate", "egg", "key"]
PRODUCTS = ["usb drive", "red mug", "desk lamp", "yoga mat", "phone case", "rain jacket", "tea kettle", "wool socks"]


def measure(i: int, ok: bool = True) -> Trajectory:
    x = SUBSTANCES[i % len(SUBSTANCES)]
    steps = [
        "teleport to kitchen",
        "pick up thermometer",
        f"focus on {x}",
        f"use thermometer on {x}",
        f"move {x} to red box",
    ]
    if not ok:
        steps[2] = "focus on door"
    return Trajectory(
        env="lab",
        task=f"Your task is to measure the temperature of {x}, then move it to the red box.",
        steps=tuple(Step(action=a) for a in steps),
        outcome=Outcome(success=ok),
        id=f"measure-{i}-{ok}",
    )


def place(i: int) -> Trajectory:
    x = OBJECTS[i % len(OBJECTS)]
    steps = [
        f"go to countertop {i % 3 + 1}",
        f"take {x} {i % 4 + 1} from countertop {i % 3 + 1}",
        "go to shelf 1",
        f"put {x} {i % 4 + 1} in/on shelf 1",
    ]
    return Trajectory(
        env="lab",
        task=f"put a {x} on the shelf.",
        steps=tuple(Step(action=a) for a in steps),
        outcome=Outcome(success=True),
        id=f"place-{i}",
    )


def shop(i: int) -> Trajectory:
    x = PRODUCTS[i % len(PRODUCTS)]
    steps = [f"search[{x}]", f"click[B0{i:03d}XYZ]", "click[Buy Now]"]
    return Trajectory(
        env="lab",
        task=f"i want a {x} under {10 + i} dollars",
        steps=tuple(Step(action=a) for a in steps),
        outcome=Outcome(success=True),
        id=f"shop-{i}",
    )


def goal_vectors(trajs: list[Trajectory], seed: int = 0) -> np.ndarray:
    """Goal vectors as one environment's goals are (any two at a cosine of about 0.5), with no
    signal of the workflow: only the actions can tell the groups apart."""
    rng = np.random.default_rng(seed)
    shared = np.random.default_rng(99).standard_normal(384)
    return unit(shared + rng.standard_normal((len(trajs), 384)))


def test_three_clearly_different_workflows_end_in_three_clusters(tmp_path):
    trajs = [f(i) for i in range(12) for f in (measure, place, shop)]
    random.Random(1).shuffle(trajs)
    with Memory.open(tmp_path / "m", MemoryConfig()) as memory:
        memory.add_many(trajs, goal_vectors(trajs))
        clusters = memory.clusters()
        groups = [{tid.split("-")[0] for tid in memory.members(c.id)} for c in clusters]
        assert memory.verify()["ok"]
    assert len(clusters) == 3 and sorted(len(g) for g in groups) == [1, 1, 1], groups


def test_a_split_fires_when_n_exceeds_L_and_R_is_below_tau(tmp_path):
    config = MemoryConfig().replace(
        {"policy.join_threshold": 0.0, "policy.density_ratio": 0.0, "evolution.split_min_size": 20}
    )
    trajs = [f(i) for i in range(12) for f in (measure, place)]  # 24 > L, two workflows forced into one cluster
    with Memory.open(tmp_path / "m", config) as memory:
        memory.add_many(trajs[:20], goal_vectors(trajs[:20]))
        assert memory.stats()["splits"] == 0 and len(memory.clusters()) == 1  # n = 20 is not > L
        memory.add_many(trajs[20:], goal_vectors(trajs[20:], seed=1))
        stats = memory.stats()
        clusters = memory.clusters()
        groups = [{tid.split("-")[0] for tid in memory.members(c.id)} for c in clusters]
        assert memory.verify()["ok"]
    assert stats["splits"] == 1 and stats["splits_refused"] == 0
    assert sorted(len(g) for g in groups) == [1, 1] and all(c.born == "split" for c in clusters)


def test_no_split_while_R_reaches_tau_and_one_vector_is_nothing_to_split_on(tmp_path):
    same = [
        Trajectory(env="lab", task="say hi", steps=(Step(action="look around"),), id=f"same-{i}") for i in range(30)
    ]
    config = MemoryConfig().replace(
        {"policy.join_threshold": 0.0, "policy.density_ratio": 0.0, "evolution.split_min_size": 20}
    )
    with Memory.open(tmp_path / "a", config) as memory:
        memory.add_many(same, unit(np.ones((30, 384))))
        stats = memory.stats()
        assert len(memory.clusters()) == 1
    assert stats["splits"] == stats["splits_refused"] == 0  # R = 1 >= tau: the rule does not fire
    policy = OfflinePolicy()
    assert policy.split(np.ones((30, 8)) / np.sqrt(8), tau=0.95, min_size=20, max_parts=6, seed=0) is None
    two = np.vstack([np.eye(8)[:1].repeat(15, 0), np.eye(8)[1:2].repeat(15, 0)])
    assert sorted(np.bincount(policy.split(two, tau=0.95, min_size=20, max_parts=6, seed=0)).tolist()) == [15, 15]


def test_the_skill_lists_the_procedure_in_order_with_roles():
    members = [measure(i) for i in range(8)] + [measure(8, ok=False), measure(9, ok=False)]
    skill = distil_procedure(members)
    steps = skill_step_texts(skill)
    assert steps == [
        "teleport to kitchen",
        "pick up thermometer",
        "focus on the object named in the goal",
        "use thermometer on the object named in the goal",
        "move the object named in the goal to red box",
    ], skill
    assert "8 of 10 runs succeeded; usually 5 actions" in skill
    assert "Successful runs end with: use thermometer on the object named in the goal, then move" in skill
    assert "Usual failure: 2 of 2 failed runs left the procedure with: focus on door" in skill


def test_navigation_procedures_name_places_and_repeat_steps():
    p = mine_procedure([place(i) for i in range(9)])
    assert [s.text for s in p.steps] == [
        "go to countertop",
        "take the object named in the goal from countertop",
        "go to shelf",
        "put the object named in the goal in/on shelf",
    ]
    assert [s.category for s in p.steps] == ["NAVIGATE", "MANIPULATE", "NAVIGATE", "MANIPULATE"]


def test_fragments_of_one_workflow_merge_when_merging_is_on(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.standard_normal(384)
    trajs = [measure(i) for i in range(11)]
    vecs = unit(base + 0.1 * rng.standard_normal((11, 384)))
    apart = MemoryConfig().replace(
        {"policy.join_threshold": 1.0, "policy.density_ratio": 0.0}
    )  # nothing ever joins: 10 fragments
    with Memory.open(tmp_path / "m", apart) as memory:
        memory.add_many(trajs[:10], vecs[:10])
        assert len(memory.clusters()) == 10 and memory.stats()["merges"] == 0
    merging = apart.replace({"evolution.merge_ratio": 0.9})
    with Memory.open(tmp_path / "m", merging) as memory:
        memory.add_many(trajs[10:], vecs[10:])
        clusters = memory.clusters()
        stats = memory.stats()
        assert memory.verify()["ok"]
        assert memory.cluster_of(trajs[0].id) == clusters[0].id  # decisions naming a merged cluster resolve to its heir
    assert len(clusters) == 1 and clusters[0].count == 11 and stats["merges"] == 10


def test_clusters_of_different_workflows_do_not_merge(tmp_path):
    trajs = [f(i) for i in range(8) for f in (measure, place)]
    with Memory.open(tmp_path / "m", MemoryConfig().replace({"evolution.merge_ratio": 0.9})) as memory:
        memory.add_many(trajs, goal_vectors(trajs))
        groups = [{tid.split("-")[0] for tid in memory.members(c.id)} for c in memory.clusters()]
    assert all(len(g) == 1 for g in groups) and len(groups) >= 2


def test_env_contrast_stops_a_cluster_as_diffuse_as_its_environment_from_taking_everything(tmp_path):
    """Two workflows, goals alike and a join threshold every item passes: one cluster. With
    ``policy.env_contrast`` a trajectory must resemble a cluster more than the environment's
    trajectories resemble each other, and no cluster mixes the two workflows (after the first
    few: two members are too few to know how alike the environment's trajectories are)."""
    trajs = [measure(i) for i in range(12, 16)] + [f(i) for i in range(12) for f in (measure, place)]
    vecs = goal_vectors(trajs)
    lax = MemoryConfig().replace({"policy.join_threshold": 0.0, "policy.density_ratio": 0.0})
    with Memory.open(tmp_path / "lax", lax) as memory:
        memory.add_many(trajs, vecs)
        assert len(memory.clusters()) == 1
    with Memory.open(tmp_path / "contrast", lax.replace({"policy.env_contrast": 0.3})) as memory:
        memory.add_many(trajs, vecs)
        groups = [{tid.split("-")[0] for tid in memory.members(c.id)} for c in memory.clusters()]
    assert len(groups) >= 2 and all(len(g) == 1 for g in groups), groups


def test_env_contrast_threshold_and_scope_sums():
    from lifemem_ray.engine.clustering.clusters import new_cluster_record
    from lifemem_ray.engine.clustering.evolution import CandidateArrays, scope_sums
    from lifemem_ray.engine.memory_config import PolicyConfig

    policy = OfflinePolicy(PolicyConfig(join_threshold=0.6, density_ratio=0.7, env_contrast=0.2))
    # A cluster of 10 with R = 0.7 in an environment of 100 with R = 0.7 (text and workflow alike).
    cluster_norm, env_norm = 0.7 * 10, 0.7 * 100
    rho_env = (env_norm**2 - 100) / (100 * 99)
    got = policy.threshold(10, cluster_norm, cluster_norm, (100, env_norm, env_norm))
    assert abs(got - (rho_env + 0.2 * (1 - rho_env)) / 0.7) < 1e-9 and got > 0.6
    assert policy.threshold(10, cluster_norm, cluster_norm, None) == 0.6  # no environment known: as before
    assert policy.threshold(10, cluster_norm, cluster_norm, (1, 1.0, 1.0)) == 0.6  # one member says nothing
    off = OfflinePolicy(PolicyConfig(join_threshold=0.6, density_ratio=0.7, env_contrast=0.0))
    assert off.threshold(10, cluster_norm, cluster_norm, (100, env_norm, env_norm)) == 0.6

    def record(cid, envs, count):
        r = new_cluster_record(cid, 4, 3, "new", 0.0)
        r.count, r.envs = count, envs
        r.tsum, r.wsum = np.full(4, float(count)), np.full(3, float(count))
        return r

    tomb = record(4, {"a": 5}, 5)
    tomb.split_into = [1]
    clusters = [
        record(1, {"a": 2}, 2),
        record(2, {"a": 3}, 3),
        record(3, {"a": 1, "b": 1}, 2),
        tomb,
        record(5, {"b": 4}, 4),
    ]
    sums = scope_sums(clusters, {"a"})
    assert set(sums) == {"a"} and sums["a"].count == 5 and sums["a"].tsum.tolist() == [5.0] * 4
    empty = np.zeros((1, 0))

    def part(scopes):
        return CandidateArrays(
            empty.astype(np.int64),
            empty.astype(np.float32),
            empty.astype(np.int64),
            empty.astype(np.float32),
            {},
            scopes,
        )

    merged = CandidateArrays.merge(
        [part(scope_sums(clusters[:1], {"a"})), part(scope_sums(clusters[1:], {"a", "b"}))], 4, 4
    )
    assert merged.scopes["a"].count == 5 and merged.scopes["b"].count == 4


def test_a_silhouette_split_cuts_along_the_groups_and_refuses_noise():
    policy = OfflinePolicy()
    rng = np.random.default_rng(0)
    axes = np.eye(16)[:3]
    groups = np.vstack(
        [
            axes[0] + 0.05 * rng.standard_normal((40, 16)),
            axes[1] + 0.05 * rng.standard_normal((15, 16)),
            axes[2] + 0.05 * rng.standard_normal((5, 16)),
        ]
    )
    groups = unit(groups)
    labels = policy.split(groups, tau=0.95, min_size=20, max_parts=6, seed=0, cut="silhouette")
    assert sorted(np.bincount(labels).tolist()) == [5, 15, 40]  # the groups as they are, uneven
    by_size = policy.split(groups, tau=0.95, min_size=20, max_parts=6, seed=0, cut="size")
    assert by_size is not None and max(np.bincount(by_size)) <= 40
    noise = unit(np.ones(16) + 0.35 * rng.standard_normal((80, 16)))  # one diffuse group: R < tau, nothing to cut along
    assert float(np.linalg.norm(noise.mean(axis=0))) < 0.95
    assert policy.split(noise, tau=0.95, min_size=20, max_parts=6, seed=0, cut="silhouette") is None
    assert policy.split(noise, tau=0.95, min_size=20, max_parts=6, seed=0, cut="size") is not None


def test_mean_silhouette_matches_its_definition_on_a_sample():
    from lifemem_ray.engine.clustering.policy import mean_silhouette

    rng = np.random.default_rng(1)
    x = unit(rng.standard_normal((30, 8))).astype(np.float64)
    labels = np.repeat([0, 1, 2], 10)
    labels[0] = 3  # a member alone scores 0
    d = 1.0 - x @ x.T
    expected = []
    for i in range(30):
        own = labels == labels[i]
        if own.sum() == 1:
            expected.append(0.0)
            continue
        a = d[i, own & (np.arange(30) != i)].mean()
        b = min(d[i, labels == j].mean() for j in set(labels.tolist()) if j != labels[i])
        expected.append((b - a) / max(a, b))
    assert abs(mean_silhouette(x, labels) - float(np.mean(expected))) < 1e-6
    assert -1.0 <= mean_silhouette(x, labels, sample=12, seed=3) <= 1.0


def test_a_split_refused_for_want_of_structure_is_counted_and_keeps_the_members(tmp_path):
    rng = random.Random(0)
    verbs = [f"verb{chr(97 + i)}{chr(97 + j)}" for i in range(8) for j in range(8)]
    trajs = [
        Trajectory(
            env="lab",
            task="do something",
            id=f"noise-{i}",
            outcome=Outcome(success=True),
            steps=tuple(Step(action=f"{rng.choice(verbs)} thing") for _ in range(3)),
        )
        for i in range(60)
    ]
    config = MemoryConfig().replace(
        {
            "policy.join_threshold": 0.0,
            "policy.density_ratio": 0.0,
            "evolution.split_min_size": 20,
            "evolution.split_cut": "silhouette",
        }
    )
    with Memory.open(tmp_path / "m", config) as memory:
        memory.add_many(trajs, goal_vectors(trajs))
        stats = memory.stats()
        clusters = memory.clusters()
        assert memory.verify()["ok"]
    assert len(clusters) == 1 and clusters[0].count == 60 and clusters[0].mrl < 0.95  # the rule holds ...
    assert stats["splits"] == 0 and stats["splits_refused"] >= 1  # ... and the refusal is counted
