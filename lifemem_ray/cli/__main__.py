"""``python -m lifemem_ray.cli``: the ``lifemem-ray`` command."""

from lifemem_ray.cli import main

raise SystemExit(main())
