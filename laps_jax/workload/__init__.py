"""Workloads: the Azure, Mooncake and session trace readers behind one loader (``load``, with
the trace flags every script shares), the one closed-loop session driver (``driver``: the caller
supplies the submit function), the LMSYS-like multi-turn generator and the HTTP replay client.

Beside the serving path, never imported by it: it imports nothing else of laps_jax.
"""
