"""Ray clusters as device inventories: what `--devices ray:auto` and `ray://HOST:PORT` mean.

The cluster's live nodes become nodes of a multi-node inventory: the head node is `node0`
(the engine's frontend runs beside the driver), the others follow in Ray's node-id order,
each with its GPUs (`cuda:0`, ... of that node, sized from the accelerator type Ray reports)
or, on a node without GPUs, its CPU (sized from Ray's `memory` resource). Every device keeps
its node's Ray id, which the Ray transport pins actors to. Ray is an optional extra
(`pip install omniflow[ray]`); nothing here is imported without a cluster spec.
"""

from __future__ import annotations

from dataclasses import replace

from omniflow.devices import ACCELERATORS, Device, parse_devices
from omniflow.errors import DeviceSpecError

HEAD_RESOURCE = "node:__internal_head__"
ACCELERATOR_PREFIX = "accelerator_type:"


def import_ray():
    try:
        import ray
    except ImportError:
        raise DeviceSpecError(
            "a Ray cluster needs Ray: pip install 'omniflow[ray]' (or give the nodes, "
            "e.g. node0=2xH200,node1=2xH200)"
        ) from None
    return ray


def ray_address(spec: str) -> str:
    """`ray:auto` -> `auto`; `ray://HOST:PORT` stays as Ray's client address."""
    if spec == "ray:auto":
        return "auto"
    if spec.startswith("ray://") and len(spec) > len("ray://"):
        return spec
    raise DeviceSpecError(f"unknown cluster '{spec}'; write ray:auto or ray://HOST:PORT")


def connect(spec: str):
    """The `ray` module, connected to the cluster `spec` names (already connected: as is)."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=ray_address(spec), include_dashboard=False, logging_level="ERROR")
        except (ConnectionError, RuntimeError) as err:
            raise DeviceSpecError(f"cannot reach the Ray cluster '{spec}': {err}") from None
    return ray


def ray_devices(spec: str) -> list[Device]:
    """The devices of the Ray cluster `spec` (see the module's docstring)."""
    return cluster_devices(connect(spec).nodes())


def cluster_devices(nodes: list[dict]) -> list[Device]:
    """Devices from Ray's node table (`ray.nodes()`), live nodes only."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise DeviceSpecError("the Ray cluster has no live nodes")
    alive.sort(key=lambda n: (HEAD_RESOURCE not in n["Resources"], n["NodeID"]))
    devices: list[Device] = []
    for index, node in enumerate(alive):
        name = f"node{index}"
        for device in parse_devices(f"{name}={_node_entry(name, node['Resources'])}"):
            devices.append(replace(device, node_id=node["NodeID"]))
    return devices


def _node_entry(name: str, resources: dict) -> str:
    gpus = int(resources.get("GPU", 0))
    if gpus == 0:
        return f"cpu={max(resources.get('memory', 0), 1 << 30) / (1 << 30):.3f}GiB"
    models = [k[len(ACCELERATOR_PREFIX) :] for k in resources if k.startswith(ACCELERATOR_PREFIX)]
    model = next((m.upper() for m in models if m.upper() in ACCELERATORS), None)
    if model is None:
        raise DeviceSpecError(
            f"Ray reports {gpus} GPU(s) of type {models[0] if models else 'unknown'} on {name}; "
            f"give the inventory yourself, e.g. {name}=cuda:0=80GiB,..."
        )
    return f"{gpus}x{model}"
