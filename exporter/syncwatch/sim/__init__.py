"""Simulated synchronous training cluster: the demo's data source and the tests' ground truth.

Modules: ``model`` (the pure, seeded model and the CV scaling sweep), ``driver`` (sends what each
simulated rank would send, through the real protocol and sender, to one daemon per node),
``scenarios`` (named scenarios, ``run_scenario``, ``ScenarioThread``), ``demo`` (``syncwatch demo``).

For tests and tools::

    from syncwatch.sim import run_scenario, ScenarioThread
    truth = run_scenario("straggler", nodes=4, ranks_per_node=8, steps=300,
                         sockets=[daemon.socket_path for daemon in daemons],  # one per node
                         start_wall=1_700_000_000.0)      # fast: virtual clock, nothing dropped
    truth.reported[rank]          # the Cumulative the rank's last record carried
    truth.slack_seconds[rank], truth.last_arrivals[rank], truth.cv(100), truth.steps[i].skew

    thread = ScenarioThread("congestion", [{"socket": p} for p in paths], nodes=2,
                            params={"compute_seconds": 0.1})      # real time, until .stop()

See docs/simulator.md for the model, its calibration and the scenarios.
"""

from .driver import Driver, GroundTruth
from .model import Model, Params, scaling_sweep
from .scenarios import SCENARIOS, ScenarioThread, run_scenario, scenario_params

__all__ = ["Driver", "GroundTruth", "Model", "Params", "scaling_sweep", "SCENARIOS",
           "ScenarioThread", "run_scenario", "scenario_params"]
