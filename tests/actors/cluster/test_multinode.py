"""Several Ray nodes on one machine: placement, a node dying, recovery from a snapshot, and a
node lost for good with a durable address (the shard rebuilt from its log)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def scenario_report(script: str, tmp_path: Path) -> dict:
    """Run a scenario script (it owns its own Ray cluster) and return the JSON it reports."""
    path = Path(__file__).resolve().parents[2] / "support" / script
    proc = subprocess.run([sys.executable, str(path), str(tmp_path)], capture_output=True, text=True, timeout=900)
    line = next((out for out in proc.stdout.splitlines() if out.startswith("REPORT ")), None)
    assert line, f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[len("REPORT ") :])


def test_node_loss_is_reported_and_a_snapshot_brings_the_memory_back(tmp_path):
    report = scenario_report("multinode_scenario.py", tmp_path)
    assert report["shards_on_distinct_workers"], report["shard_nodes"]
    assert report["before"] == 400
    # The error reaches the client clearly: it names the shard and says it is unavailable.
    assert report["errors"][0].startswith("add: shard 1") and "unavailable" in report["errors"][0]
    assert report["errors"][1].startswith("retrieve:")
    # The memory comes back from the last snapshot.
    # With its disk back, the lost shard starts again on a live shard node, with its data.
    assert report["came_back"]["trajectories"] == 400 and report["came_back_s"] < 120
    assert (
        report["came_back"]["node"] in report["shard_nodes"] and report["came_back"]["node"] != report["shard_nodes"][1]
    )
    assert report["after"] == 400 and report["verify_ok"]
    assert report["retrieve_after"]
    # The original store reopens although a shard's node is gone: its files are still here.
    assert report["reopened_on_workers"], report["reopened_nodes"]
    assert report["reopened"] >= 400 and report["reopened_verify_ok"]
    assert report["reopened_retrieve"] == report["retrieve_after"] == report["came_back"]["retrieve"]


def test_a_node_lost_for_good_loses_nothing_acknowledged_with_a_durable_address(tmp_path):
    report = scenario_report("durable_scenario.py", tmp_path)
    assert report["before"] == 400
    assert all(not c["skipped"] for c in report["checkpoints"])  # 100 adds came after the checkpoints
    # Bounded: callers were told to retry while the shard was rebuilt, then it served again.
    assert report["serving_again_s"] < 120 and report["error_count"] >= 1, report
    assert report["moved_to_spare"], report["status"]
    # Nothing acknowledged lost or doubled; the same retrieval answers as before the loss.
    assert report["after"] == 400 and report["held_once"] == 400 and report["same_content"]
    assert report["same_answers"] and report["verify_ok"]
    rebuilt = report["status"][1]
    assert rebuilt["health"] == "up" and rebuilt["durable"]["behind_log"] == 0
    assert rebuilt["durable"]["entries_after_checkpoint"] >= 1  # replayed from the log, not only the checkpoint
    assert [h["action"] for h in report["keeper"]["shards"][1]["history"]] == ["rebuild"]
    assert report["adds_after"] == ["added"] * 20
    # From the durable address alone (every shard's checkpoint and log), onto three shards.
    assert report["resharded"] == {"shards": 3, "trajectories": 420, "verify_ok": True, "same_answers": True}
