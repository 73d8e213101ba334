#!/usr/bin/env python
"""OpenAI-compatible server; see `python scripts/serve.py --help`."""

import sys

from laps_jax.server.run import main

if __name__ == "__main__":
    sys.exit(main())
