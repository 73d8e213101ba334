"""The comparison harness: compare_modes' in-process replays of mixed, laps and laps-spatial,
their reports, scheduler variants, the CPU meter and the open-loop / session replayers.

An experiment beside the serving path, never imported by it: it may import the scheduler, the
engine, the models, the simulator's executors and the workload readers.
"""
