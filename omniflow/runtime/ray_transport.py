"""Executors as Ray actors: `RayTransport`, the process transport with Ray starting the
executors on the cluster's nodes.

Everything but the start is the process transport's: the same typed control messages over
zmq (the engine's ROUTER on TCP instead of a Unix socket, since executors may be on other
nodes), the same link phase (Hello, Connect, Linked) and the same restart. Each executor
program runs in one actor, `ExecutorActor.serve`, pinned to the Ray node its devices were
placed on (`NodeAffinitySchedulingStrategy`, hard) and reserving one CPU and its GPUs. The
actor sees every GPU of its node (Ray is told not to narrow `CUDA_VISIBLE_DEVICES`) so the
plan's `cuda:N` is the node's `cuda:N`, and its device and shm rings with executors of its
own node work as in one host; edges between nodes are net rings (net_ring.py).

Faults: `serve` returns only at shutdown, so a finished `serve` call is a dead executor --
killed, its node gone, or its program failed. The engine checks every tick, fails the
requests in flight with an error naming the executor and its node, and `restart` starts a
replacement actor on the same node and re-links every channel that touched it; the dead
actor is killed for good first (no Ray-side restart races ours).
"""

from __future__ import annotations

import os
import sys

from omniflow.cluster import cluster_devices, connect, import_ray
from omniflow.devices import local_name, node_of
from omniflow.plan import DevicePlan
from omniflow.runtime import control
from omniflow.runtime.link import node_address
from omniflow.runtime.shm_ring import cleanup_stale_segments
from omniflow.runtime.transport import (
    EngineError,
    ProcessTransport,
    _torch_threads,
    host_executors,
)

# How long an actor may take to leave after Shutdown before it is killed.
CLOSE_TIMEOUT_S = 10.0


class ExecutorActor:
    """One executor program in a Ray actor (made a Ray remote class on first use, so that
    importing this module needs no Ray)."""

    def __init__(self, config: dict):
        self.config = config

    def pid(self) -> int:
        return os.getpid()

    def serve(self) -> None:
        from omniflow.runtime.executor import ZmqControl, dump_stacks_on_usr1, serve, start_loop

        dump_stacks_on_usr1()  # (the actor's log: on a remote node too)
        # What a killed executor of this node left: its replacement is started here.
        cleanup_stale_segments()

        end = ZmqControl(self.config["control"], self.config["name"], None)
        try:
            serve(start_loop(self.config, end), end)
        finally:
            end.close()


_remote_actor = None


def _actor_class():
    global _remote_actor
    if _remote_actor is None:
        _remote_actor = import_ray().remote(ExecutorActor)
    return _remote_actor


class RayTransport(ProcessTransport):
    """Executors as Ray actors on the nodes the plan placed them on (see the module)."""

    def __init__(self, *args, **kwargs):
        self.ray = connect("ray:auto")
        super().__init__(*args, **kwargs)
        self.actors: dict = {}
        self.runs: dict = {}  # executor -> its serve() call
        self.actor_pids: dict[str, int] = {}
        self.node_ids = self._node_ids()

    def bind_control(self) -> str:
        port = self.router.bind_to_random_port(f"tcp://{node_address()}")
        return f"tcp://{node_address()}:{port}"

    def _node_ids(self) -> dict[str, str]:
        """Each node of the plan -> its Ray node id: from the plan (`ray:auto` plans carry
        them), else by name from the live cluster (a plan compiled for `node0=...`)."""
        ids = {node_of(d.name): d.node_id for d in self.plan.devices if d.node_id}
        if not ids:
            live = cluster_devices(self.ray.nodes())
            ids = {d.node: d.node_id for d in live}
        return ids

    def node(self, name: str) -> str:
        devices = self.plan.program(name).devices
        return node_of(devices[0]) if devices else "node0"

    def describe(self, name: str) -> str:
        node = self.node(name)
        return f"{super().describe(name)} on {node} (Ray node {self.node_ids.get(node, '?')[:12]})"

    def spawn(self, name: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        old = self.actors.pop(name, None)
        if old is not None:
            self.ray.kill(old, no_restart=True)
        node = self.node(name)
        if node not in self.node_ids:
            raise EngineError(
                f"{super().describe(name)} is placed on {node}, which the Ray cluster does not "
                f"have (its nodes: {', '.join(sorted(self.node_ids))}); compile with --devices ray:auto"
            )
        alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
        if self.node_ids[node] not in alive:
            raise EngineError(
                f"{self.describe(name)} cannot be restarted: {node} has left the Ray cluster; "
                "compile again for the nodes that remain (--devices ray:auto)"
            )
        gpus = [d for d in self.plan.program(name).devices if local_name(d).startswith("cuda")]
        config = {
            "name": name,
            "program": self.plan.program(name).to_json(),
            "control": self.address,
            "backends": self.backends,
            "torch_threads": _torch_threads(),
            "host_executors": host_executors(self.plan, name),
            "request_stats": self.request_stats,
            "load": self.load,
            "sys_path": sys.path,  # executor.take_engine_path
        }
        actor = (
            _actor_class()
            .options(
                num_cpus=1,
                num_gpus=len(gpus),
                max_restarts=0,
                max_concurrency=2,  # serve() runs for good; pid() must answer beside it
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_ids[node], soft=False),
                runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            )
            .remote(config)
        )
        self.actors[name] = actor
        self.runs[name] = actor.serve.remote()

    def send_start(self, executor: str, message: control.Start) -> None:
        self.send(executor, message)  # no start queue across nodes

    @property
    def pids(self) -> dict[str, int]:
        """The actors' process ids (asked once per actor)."""
        for name, actor in self.actors.items():
            if name not in self.actor_pids and not self.ended(name):
                self.actor_pids[name] = self.ray.get(actor.pid.remote(), timeout=30)
        return {name: self.actor_pids[name] for name in self.actors if name in self.actor_pids}

    def ended(self, name: str) -> bool:
        run = self.runs.get(name)
        if run is None:
            return False
        ready, _ = self.ray.wait([run], timeout=0)
        return bool(ready)

    def _how(self, name: str) -> str:
        try:
            self.ray.get(self.runs[name], timeout=1)
        except self.ray.exceptions.RayActorError as err:
            return f"its Ray actor died: {str(err).splitlines()[0]}"
        except Exception as err:  # noqa: BLE001 (whatever the program raised)
            return (
                f"it failed: {type(err).__name__}: {str(err).splitlines()[-1] if str(err) else ''}"
            )
        return "it exited"

    def dead(self) -> dict[str, str]:
        if not self.runs:
            return {}
        ready, _ = self.ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)
        done = {ref.hex() for ref in ready}
        return {name: self._how(name) for name, run in self.runs.items() if run.hex() in done}

    def restart(self, names: set[str]) -> None:
        for name in names:
            self.actor_pids.pop(name, None)
        super().restart(names)

    def log_tail(self, name: str, lines: int = 15) -> str:
        return ""  # an actor's output is in Ray's logs (ray logs actor --id ...)

    def startup_failure(self, name: str) -> str:
        return f"{self.describe(name)} could not start: {self._how(name)}"

    def close(self) -> None:
        runs = list(self.runs.values())
        if runs:
            self.ray.wait(runs, num_returns=len(runs), timeout=CLOSE_TIMEOUT_S)
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)
        self.release()


def ray_plan(devices: list[DevicePlan]) -> bool:
    """Whether a plan was compiled for a Ray cluster (its devices carry Ray node ids)."""
    return any(d.node_id for d in devices)
