"""`--devices` inventories: what parses, what is refused (in one line, saying what to write
instead), and the bounds that keep a slip from building millions of devices."""

import time

import pytest

from omniflow.devices import (
    MAX_DEVICES,
    MAX_GPU_INDEX,
    MAX_GPUS_PER_ENTRY,
    MAX_MEMORY,
    GiB,
    parse_devices,
    parse_size,
)
from omniflow.errors import DeviceSpecError


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("cpu", ["cpu"]),
        ("2xH200", ["cuda:0", "cuda:1"]),
        ("2 x h100", ["cuda:0", "cuda:1"]),
        ("cuda:0=80GiB,cuda:1=40GiB", ["cuda:0", "cuda:1"]),
        ("cuda:3=8GiB,cuda=8GiB", ["cuda:3", "cuda:4"]),
        ("1xA100,cpu=16GiB", ["cuda:0", "cpu"]),
    ],
)
def test_inventories_parse(spec, names):
    assert [d.name for d in parse_devices(spec)] == names


def test_sizes_and_models_set_memory():
    small, big = parse_devices("cuda:0=40GiB,cuda:1=1.5TB")
    assert small.memory == 40 * GiB and big.memory == int(1.5e12)
    assert parse_devices("1xH200=100GiB")[0].memory == 100 * GiB


def test_the_largest_inventory_parses():
    spec = ",".join([f"{MAX_GPUS_PER_ENTRY}xH200"] * (MAX_DEVICES // MAX_GPUS_PER_ENTRY))
    devices = parse_devices(spec)
    assert len(devices) == MAX_DEVICES and devices[-1].name == f"cuda:{MAX_GPU_INDEX}"


# (spec, what the one-line message must say)
REFUSED = [
    ("", "no devices given; write e.g. cpu"),
    ("  ", "no devices given"),
    ("cpu,,cuda:0=8GiB", "empty entry"),
    ("0xH200", "the number of GPUs must be at least 1; write e.g. 1xH200"),
    ("-2xH200", "the number of GPUs must be at least 1"),
    (f"{MAX_GPUS_PER_ENTRY + 1}xH200", f"at most {MAX_GPUS_PER_ENTRY} GPUs; write e.g. 8xH200"),
    ("1000000xH200", f"at most {MAX_GPUS_PER_ENTRY} GPUs"),
    ("100000000xH200", f"at most {MAX_GPUS_PER_ENTRY} GPUs"),
    ("9" * 5000 + "xH200", f"at most {MAX_GPUS_PER_ENTRY} GPUs"),  # int() refuses 5000 digits
    (",".join(["64xH200"] * 17), f"more than {MAX_DEVICES} devices; list at most {MAX_DEVICES}"),
    ("cuda:99999999", f"GPU indexes run from 0 to {MAX_GPU_INDEX}"),
    ("cuda:" + "9" * 5000, f"GPU indexes run from 0 to {MAX_GPU_INDEX}"),
    (f"cuda:{MAX_GPU_INDEX}=8GiB,1xH200", f"GPU indexes run from 0 to {MAX_GPU_INDEX}"),
    ("3xTPU", "unknown accelerator 'TPU'; known: H200"),
    ("tpu:0", "unknown device 'tpu:0'; use cpu, cuda:N, NxMODEL"),
    ("cpu,cpu", "cpu is listed twice"),
    ("2xH200,cuda:1=8GiB", "cuda:1 is listed twice"),
    ("cuda:0", "memory of cuda:0 is unknown"),
    ("cuda:0=", "cannot read memory size ''"),
    ("cuda:0=1.2.3GiB", "cannot read memory size"),
    ("cuda:0=nan", "cannot read memory size 'nan'; write e.g. 80GiB"),
    ("cuda:0=inf", "cannot read memory size"),
    ("cuda:0=1e300GiB", "cannot read memory size"),
    ("cuda:0=" + "9" * 400 + "GiB", "is out of range; write 1MiB to 64TiB"),  # float() gives inf
    ("cuda:0=100TiB", "is out of range"),
    ("cuda:0=0GiB", "is out of range"),
    ("cpu=0.5MiB", "is out of range"),
]


@pytest.mark.parametrize(("spec", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_bad_inventories_are_refused_at_once_in_one_line(spec, message):
    start = time.perf_counter()
    with pytest.raises(DeviceSpecError) as caught:
        parse_devices(spec)
    assert time.perf_counter() - start < 1.0  # `1000000xH200` used to run for minutes
    text = str(caught.value)
    assert message in text and "\n" not in text and len(text) < 200


def test_the_memory_bounds_are_inclusive():
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("64TiB") == MAX_MEMORY


def test_multi_node_inventories_name_devices_by_node():
    devices = parse_devices("node0=2xH200,node1=1xH100,node1=cpu=64GiB")
    assert [d.name for d in devices] == [
        "node0/cuda:0",
        "node0/cuda:1",
        "node1/cuda:0",
        "node1/cpu",
    ]
    assert [d.node for d in devices] == ["node0", "node0", "node1", "node1"]
    assert [d.is_gpu for d in devices] == [True, True, True, False]
    assert devices[2].memory == parse_devices("1xH100")[0].memory  # each node numbers its GPUs


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("node0=2xH200,cpu", "mixes entries with and without a node"),
        ("node0=2xH200,node0=cuda:1=80GiB", "node0/cuda:1 is listed twice"),
        ("node0=", "'node0=' names no device; write e.g. node0=2xH200"),
    ],
)
def test_multi_node_inventories_refuse_mistakes(spec, message):
    with pytest.raises(DeviceSpecError, match=message):
        parse_devices(spec)
