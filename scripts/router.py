#!/usr/bin/env python
"""One OpenAI endpoint in front of several serve.py instances; see `--help`."""

import sys

from laps_jax.cluster.router_cli import main

if __name__ == "__main__":
    sys.exit(main())
