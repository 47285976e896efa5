"""What `specdec serve --replicas` asks of Ray Serve, worked out without Ray (so it checks fast and
tests anywhere): the replica count or autoscaling range, the deployment's options, and the models
each replica loads.

How the server's options map onto Ray Serve's (specdec.serve.ray deploys them):

- ``--replicas N``: ``num_replicas = N``; ``--replicas MIN-MAX``: autoscaling between them
  (``autoscaling_config``: ``min_replicas``, ``max_replicas``, ``target_ongoing_requests`` =
  ``--max-batch``).
- ``--max-batch B``: ``max_ongoing_requests = B``.  A replica takes only the requests it decodes at
  once; the rest wait in Serve's queue and go to the first replica with room, so no request waits
  behind a busy replica while another is free.
- ``--max-queue Q``: ``max_queued_requests = Q``, Serve's queue in front of the replicas, per
  proxy (one per node); past it Serve answers 503.
- ``--replica-cpus C``: ``ray_actor_options = {"num_cpus": C}``, the CPUs Ray reserves for each
  replica (and so how many fit on a node); each replica's torch threads default to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from specdec.engine_config import EngineConfig
from specdec.errors import SpecdecError

INSTALL_HINT = "pip install 'specdec[ray]'"
REQUIRED = ("ray",)


def missing_extra() -> list[str]:
    """The modules of the `ray` extra that are not installed (ray.serve comes with ray[serve])."""
    import importlib.util

    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if not missing:
        try:
            import ray.serve  # noqa: F401  - ray without its serve part (`pip install ray`)
        except ImportError:
            missing.append("ray.serve")
    return missing


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas: a fixed count (low == high) or an autoscaling range; and their CPUs."""

    low: int
    high: int
    cpus: float = 1.0  # Ray CPUs reserved per replica

    @property
    def fixed(self) -> bool:
        return self.low == self.high

    def describe(self) -> str:
        return f"{self.low} replica{'s' * (self.low != 1)}" if self.fixed else f"{self.low} to {self.high} replicas"


def parse_replicas(text: str, cpus: float = 1.0) -> ReplicaPlan:
    """'N' (a fixed count) or 'MIN-MAX' (autoscaling); a SpecdecError for anything else."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if match is None:
        raise SpecdecError(f"--replicas takes a count N or a range MIN-MAX (e.g. 2 or 1-4), got '{text}'")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if low < 1:
        raise SpecdecError(f"--replicas must be >= 1 (a replica loads its models at start-up), got '{text}'")
    if high < low:
        raise SpecdecError(f"--replicas {text}: the maximum is below the minimum")
    if not cpus > 0:
        raise SpecdecError(f"--replica-cpus must be > 0, got {cpus}")
    return ReplicaPlan(low, high, cpus)


def deployment_options(plan: ReplicaPlan, max_batch: int, max_queue: int) -> dict[str, Any]:
    """Ray Serve's deployment options for `plan`, a replica decoding up to `max_batch` requests."""
    options: dict[str, Any] = {
        "max_ongoing_requests": max_batch,
        "max_queued_requests": max_queue,
        "ray_actor_options": {"num_cpus": plan.cpus},
    }
    if plan.fixed:
        options["num_replicas"] = plan.low
    else:
        options["autoscaling_config"] = {"min_replicas": plan.low, "initial_replicas": plan.low,
                                         "max_replicas": plan.high, "target_ongoing_requests": max_batch}
    return options


# The models a replica loads, by name (what `specdec serve` takes): sent to every replica, which loads them
# itself (Engine.from_config; on its own node: names resolve there, zoo models come from that node's cache or
# PyPI).  The serve command's model options, declared once (specdec.engine_config).
EngineSpec = EngineConfig


def check_fits(plan: ReplicaPlan, cpus: int) -> None:
    """A SpecdecError when `plan`'s replicas (all of them, up to its maximum) cannot all be placed on
    `cpus` CPUs: Serve would leave the rest waiting for CPUs that never come."""
    need = plan.high * plan.cpus
    if need > cpus:
        raise SpecdecError(
            f"{plan.high} replicas of {plan.cpus:g} CPU each need {need:g} CPUs, and this machine has {cpus}: "
            f"lower --replicas or --replica-cpus (e.g. --replica-cpus {cpus / plan.high:g}), or deploy on a "
            "bigger Ray cluster with --ray-address")
