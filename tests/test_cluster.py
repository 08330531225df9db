"""Ray clusters as inventories: Ray's node table -> nodes and devices (no Ray needed;
`ray:auto` against a real local cluster is in tests/runtime/test_ray.py)."""

import pytest

from omniflow.cluster import cluster_devices, ray_address
from omniflow.compiler import load_graph
from omniflow.devices import parse_devices
from omniflow.errors import DeviceSpecError
from omniflow.lower import lower
from omniflow.passes.pipeline import Target, run_passes
from tests.passes.helpers import GRAPHS


def _node(node_id: str, head: bool = False, **resources) -> dict:
    extra = {"node:__internal_head__": 1.0} if head else {}
    return {"NodeID": node_id, "Alive": True, "Resources": {**resources, **extra}}


def test_the_head_node_comes_first_and_gpus_are_sized_by_their_type():
    nodes = [
        _node("b", GPU=2.0, **{"accelerator_type:H200": 1.0}),
        {**_node("dead", GPU=8.0), "Alive": False},
        _node("z", head=True, GPU=1.0, **{"accelerator_type:H100": 1.0}),
        _node("a", CPU=4.0, memory=float(32 << 30)),
    ]
    devices = cluster_devices(nodes)
    assert [(d.name, d.node_id) for d in devices] == [
        ("node0/cuda:0", "z"),
        ("node1/cpu", "a"),
        ("node2/cuda:0", "b"),
        ("node2/cuda:1", "b"),
    ]
    assert devices[0].memory == parse_devices("1xH100")[0].memory
    assert devices[1].memory == 32 << 30


def test_gpus_of_a_type_omniflow_does_not_know_must_be_listed():
    with pytest.raises(DeviceSpecError, match="give the inventory yourself, e.g. node0=cuda:0"):
        cluster_devices([_node("x", head=True, GPU=1.0, **{"accelerator_type:T4": 1.0})])


@pytest.mark.parametrize("spec", ["ray:", "ray:x", "ray://"])
def test_cluster_specs_are_checked(spec):
    with pytest.raises(DeviceSpecError, match="write ray:auto or ray://HOST:PORT"):
        ray_address(spec)


def test_the_plan_keeps_each_devices_node_id():
    devices = cluster_devices([_node("h", head=True, CPU=2.0, memory=float(64 << 30))])
    plan = lower(run_passes(load_graph(GRAPHS / "tts.omni"), Target(tuple(devices))))
    assert plan.devices[0].name == "node0/cpu" and plan.devices[0].node_id == "h"
