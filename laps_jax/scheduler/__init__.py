"""The LAPS scheduler: latency model, short and long pools, the asyncio dispatcher.

Public API: `Dispatcher`, `SchedulerConfig`, `WindowConfig`, `LatencyModel`, `DeviceSpec`
(see dispatcher.py for how the server drives it).

The serving core, JAX-free: it speaks to a `StepExecutor` and plans in `engine.buckets` shapes.
May import the engine's plain-Python modules (and the engine itself only lazily, to run one)
and the top-level config; never the server, the models, or bench, sim and workload.
"""

from laps_jax.scheduler.dispatcher import Dispatcher  # noqa: F401
from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel  # noqa: F401
from laps_jax.scheduler.policy import SchedulerConfig  # noqa: F401
from laps_jax.scheduler.window import WindowConfig  # noqa: F401
