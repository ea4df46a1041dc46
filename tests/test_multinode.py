"""Several Ray nodes on one machine: placement, a node dying, recovery from a snapshot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_node_loss_is_reported_and_a_snapshot_brings_the_memory_back(tmp_path):
    script = Path(__file__).with_name("multinode_scenario.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900)
    line = next((out for out in proc.stdout.splitlines() if out.startswith("REPORT ")), None)
    assert line, f"scenario failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(line[len("REPORT ") :])
    assert report["shards_on_distinct_workers"], report["shard_nodes"]
    assert report["before"] == 400
    # The error reaches the client clearly: it names the shard and says it is unavailable.
    assert report["errors"][0].startswith("add: shard 1") and "unavailable" in report["errors"][0]
    assert report["errors"][1].startswith("retrieve:")
    # The memory comes back from the last snapshot.
    assert report["after"] == 400 and report["verify_ok"]
    assert report["retrieve_after"]
    # The original store reopens although a shard's node is gone: its files are still here.
    assert report["reopened_on_workers"], report["reopened_nodes"]
    assert report["reopened"] >= 400 and report["reopened_verify_ok"]
    assert report["reopened_retrieve"] == report["retrieve_after"]
