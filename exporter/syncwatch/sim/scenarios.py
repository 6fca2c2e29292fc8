"""Named scenarios: the calibrated healthy cluster plus one injected effect each.

Parameters are relative to ``compute_seconds`` (1 s by default; the demo's ``--step-time``), so a
scenario looks the same at any speed. What each one shows:

| scenario    | injected effect (defaults)                                   | visible as |
| ----------- | ------------------------------------------------------------ | ---------- |
| healthy     | none: 1.5 % jitter, rare stalls, nodes²-scaled congestion    | slack spread over all ranks |
| straggler   | rank ``STRAGGLER_RANK`` 8 % slower from step 20               | that rank arrives last almost every step |
| oscillation | compute x 1.1 on odd steps, x 0.9 on even                    | lag-1 autocorrelation near -1 (a congestion episode weakens it: docs/simulator.md) |
| congestion  | every 100 steps a 20-step episode, collective x 4 (besides   | sync time and step time inflated in episodes |
|             | healthy's random 1-step episodes)                            |            |
| thermal     | per-node sinusoid, 6 % amplitude, 300-step period            | last arrivals move from node to node |
| restarts    | checkpoint every 50 steps; fail after 130 and 290 steps      | attempts 0,1,2; steps go back; re-run steps |

``scaling`` is not a live scenario: it is the model-only CV sweep (``model.scaling_sweep``).
"""

from __future__ import annotations

import threading

from .driver import Driver, GroundTruth
from .model import Params

SCENARIOS = ("healthy", "straggler", "oscillation", "congestion", "thermal", "restarts")
DEFAULT_STEPS = {"healthy": 300, "straggler": 300, "oscillation": 200, "congestion": 400,
                 "thermal": 600, "restarts": 400}


def straggler_rank(world_size: int) -> int:
    """The straggler scenario's slow rank: global rank 5, or the last rank of a smaller world.

    Rank 5 is node 0's local rank 5 with 6 ranks a node or more, else on a later node (node 1's
    local rank 1 at 4 a node)."""
    return min(5, world_size - 1)


def scenario_params(name: str, nodes: int = 4, ranks_per_node: int = 8, **overrides) -> Params:
    """The ``Params`` of scenario ``name``; ``overrides`` replace any field."""
    base = Params(nodes=nodes, ranks_per_node=ranks_per_node)  # checked before the world is used
    effects = {
        "healthy": {},
        "straggler": dict(straggler_rank=straggler_rank(base.world_size), straggler_slowdown=0.08,
                          straggler_from_step=20),
        "oscillation": dict(oscillation=0.10),
        "congestion": dict(congestion_every=100, scheduled_congestion_steps=20,
                           scheduled_congestion_factor=4.0),
        "thermal": dict(thermal_amplitude=0.06, thermal_period_steps=300),
        "restarts": dict(checkpoint_every=50, checkpoint_seconds=0.5, fail_after=(130, 290),
                         restart_seconds=10.0),
    }
    if name not in effects:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return base.with_(**{**effects[name], **overrides})


def run_scenario(name: str, nodes: int = 4, ranks_per_node: int = 8, steps: int | None = None, *,
                 targets: list[dict] | None = None, sockets: list[str] | None = None,
                 fast: bool = True, seed: int = 0, job: str | None = None,
                 params: dict | None = None, **driver_options) -> GroundTruth:
    """Run scenario ``name`` to completion and return its ground truth.

    Send to ``sockets`` (one Unix socket path per node) or ``targets`` (one ``{"socket": path}`` or
    ``{"udp": "host:port"}`` per node); neither = model only. ``steps`` defaults to the scenario's
    ``DEFAULT_STEPS``; ``params`` overrides model parameters; ``driver_options`` go to ``Driver``
    (``start_wall``, ``exchange_every``, ``heartbeat_every``, ``time_scale``, ...).
    """
    if sockets is not None:
        targets = [{"socket": s} for s in sockets]
    p = scenario_params(name, nodes, ranks_per_node, **(params or {}))
    driver = Driver(p, seed, targets=targets, job=job or f"sim-{name}", fast=fast, **driver_options)
    return driver.run(steps or DEFAULT_STEPS[name])


class ScenarioThread(threading.Thread):
    """Runs a scenario in real time in a background thread until ``stop()`` (or ``steps``).

    ``thread.truth`` is the live ground truth (read it for summaries while it runs).
    """

    def __init__(self, name: str, targets: list[dict] | None, nodes: int = 4, ranks_per_node: int = 8,
                 *, steps: int = 0, seed: int = 0, job: str | None = None, fast: bool = False,
                 params: dict | None = None, **driver_options):
        super().__init__(name=f"syncwatch-sim-{name}", daemon=True)
        p = scenario_params(name, nodes, ranks_per_node, **(params or {}))
        driver_options.setdefault("keep_steps", False)
        self.driver = Driver(p, seed, targets=targets, job=job or f"sim-{name}", fast=fast,
                             **driver_options)
        self.steps = steps
        self._stop_event = threading.Event()
        self.error: BaseException | None = None

    @property
    def truth(self) -> GroundTruth:
        return self.driver.truth

    def run(self) -> None:
        try:
            self.driver.run(self.steps, stop=self._stop_event)
        except BaseException as e:  # reported by the owner; a daemon thread must not die silently
            self.error = e

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the run and wait for it; also safe before ``start()`` (an interrupted start-up)."""
        self._stop_event.set()
        if self.ident is not None:  # started: join() of a thread never started raises
            self.join(timeout)
