"""The LAPS scheduler: latency model, short and long pools, the asyncio dispatcher.

Public API: `Dispatcher`, `SchedulerConfig`, `WindowConfig`, `LatencyModel`, `DeviceSpec`
(see dispatcher.py for how the server drives it).
"""

from laps_jax.scheduler.dispatcher import Dispatcher  # noqa: F401
from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel  # noqa: F401
from laps_jax.scheduler.policy import SchedulerConfig  # noqa: F401
from laps_jax.scheduler.window import WindowConfig  # noqa: F401
