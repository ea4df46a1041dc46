"""The sharded memory on Ray: shard and coordinator actors, batching, routing, the client, deployment."""
