"""The secret a prefill/decode split shares: only the router (and whoever holds the secret) can
open a leg, send a hand-off or release an offer.

A leg names a transfer server to pull from and pins pages for `--pd-timeout`; one that anybody
on the machine could send would let them exhaust the split (issue: forged hand-offs took every
pull thread). So every leg and `POST /pd/release` carries `X-Laps-PD-Secret`, compared in
constant time before any thread or page is spent.

Where the secret comes from, in order: a file (`--pd-secret-file`, read once at start), the
environment variable `LAPS_PD_SECRET` (how `serve_cluster.py` hands a generated one to the
instances and the router it starts), else the API key (serve.py's `--api-key`, the router's
`--instance-api-key`). With none of them a prefill or decode instance, and a router with
`--prefill`/`--decode`, refuse to start: an open split is never the default. Not a flag value:
a command line is visible to every user of the machine (`ps`).
"""

from __future__ import annotations

import hmac
import os

ENV = "LAPS_PD_SECRET"
HEADER = "X-Laps-PD-Secret"
MIN_LEN = 16


def resolve(secret_file: str | None, api_key: str | None) -> str:
    """The split's secret; raises ValueError (a message for the user) when there is none."""
    if secret_file:
        try:
            with open(secret_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--pd-secret-file {secret_file}: {e}") from None
        source = f"--pd-secret-file {secret_file}"
    elif os.environ.get(ENV):
        secret, source = os.environ[ENV].strip(), ENV
    elif api_key:
        return api_key
    else:
        raise ValueError(
            f"a prefill/decode split needs a secret shared by the router and its instances: "
            f"set {ENV} (e.g. export {ENV}=$(python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))')) or --pd-secret-file PATH, the same for "
            f"every process of the split (or give them an API key)")
    if len(secret) < MIN_LEN:
        raise ValueError(f"the split's secret ({source}) is shorter than {MIN_LEN} characters")
    return secret


def matches(header: str | None, secret: str) -> bool:
    """Constant-time check of a request's `X-Laps-PD-Secret` (any bytes: never raises)."""
    if not header:
        return False
    got = header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, secret.encode("utf-8"))


__all__ = ["ENV", "HEADER", "matches", "resolve"]
