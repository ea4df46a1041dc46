"""The multi-host tests: a package, so that its ``conftest`` is ``multihost.conftest`` and never
takes the name ``conftest`` that the other test modules import their helpers from."""
