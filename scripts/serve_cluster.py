#!/usr/bin/env python
"""serve.py instances on a Ray cluster behind the length-aware router; see `--help`."""

import sys

from laps_jax.cluster.cluster_cli import main

if __name__ == "__main__":
    sys.exit(main())
