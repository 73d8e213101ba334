"""Workloads: the Azure, Mooncake and session trace readers, the LMSYS-like multi-turn generator
and the HTTP replay client.

Beside the serving path, never imported by it: it imports nothing else of laps_jax.
"""
