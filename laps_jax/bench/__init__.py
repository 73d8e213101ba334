"""The comparison harness: compare_modes' in-process replays of mixed, laps and laps-spatial,
their reports, scheduler variants, the CPU meter and the open-loop / session replayers; and the
validation of a real compare_modes run against the simulator (validate, sim_replay, cells,
lane_timings, validate_command: `scripts/simulate.py validate`).

An experiment beside the serving path, never imported by it: it may import the scheduler, the
engine, the models, the simulator (its executors for --simulate, its instances for validation)
and the workload readers. The simulator never imports it.
"""
