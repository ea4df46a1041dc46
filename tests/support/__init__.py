"""What the tests share that is not a test: harnesses, stubs, servers and scripts.

Imported as ``support.<module>`` (the root ``tests/conftest.py`` puts ``tests/`` on the import path;
so do the benchmarks that use them). The scenario scripts (``multinode_scenario.py``,
``durable_scenario.py``) also run as scripts by their path, next to ``scenario_cluster.py``.
"""
