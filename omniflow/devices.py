"""Device inventories: what `--devices` means, and each device's memory and speed.

`cpu`, `cuda:0,cuda:1`, `2xH200`, `cuda:0=80GiB,cuda:1=40GiB`, `cpu=16GiB` all parse to a
list of `Device`s; so do multi-node inventories (`node0=2xH200,node1=2xH200`, devices named
`node0/cuda:0`, ...) and Ray clusters (`ray:auto`, `ray://HOST:PORT`, read by cluster.py). Speeds are nominal datasheet figures; the compiler uses them only to
compare stages' costs and to size chunks, never as promises.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from omniflow.errors import DeviceSpecError

GiB = 1 << 30

# Between a node's name and a device's name on it, in a multi-node inventory's device names.
NODE_SEP = "/"

# Bounds on an inventory, so that a slip such as `1000000xH200` fails at once instead of
# building a million devices; far above any host, and the largest clusters omniflow serves.
MAX_GPUS_PER_ENTRY = 64  # the N of one `NxMODEL` entry: 1 to this
MAX_DEVICES = 1024  # all entries together
MAX_GPU_INDEX = MAX_DEVICES - 1  # the N of `cuda:N`
# A device's `=SIZE`: less than a MiB holds no stage; more than 64 TiB is no one host's memory.
MIN_MEMORY = 1 << 20
MAX_MEMORY = 64 << 40


@dataclass(frozen=True)
class Accelerator:
    memory: int  # bytes usable by programs
    flops: float  # dense bf16 FLOP/s
    bandwidth: float  # memory bytes/s


ACCELERATORS: dict[str, Accelerator] = {
    "H200": Accelerator(int(139.8 * GiB), 989e12, 4.8e12),
    "H100": Accelerator(int(79.6 * GiB), 989e12, 3.35e12),
    "A100": Accelerator(int(79.2 * GiB), 312e12, 2.0e12),
    "A100-40G": Accelerator(int(39.4 * GiB), 312e12, 1.55e12),
    "L40S": Accelerator(int(44.4 * GiB), 362e12, 0.86e12),
    "L4": Accelerator(int(22.0 * GiB), 121e12, 0.3e12),
    "A10": Accelerator(int(22.0 * GiB), 125e12, 0.6e12),
}
# A CPU core: a few tens of GFLOP/s in bf16/fp32 matmul, shared DRAM bandwidth.
CPU_FLOPS_PER_CORE = 50e9
CPU_BANDWIDTH = 20e9


@dataclass(frozen=True)
class Device:
    name: str  # "cpu" or "cuda:N"
    memory: int
    flops: float
    bandwidth: float
    model: str = ""
    node_id: str = ""  # the node's id in the cluster manager (Ray), where one manages it

    @property
    def is_gpu(self) -> bool:
        return local_name(self.name).startswith("cuda")

    @property
    def node(self) -> str:
        return node_of(self.name)

    def __str__(self) -> str:
        return self.name


def node_of(name: str) -> str:
    """The node a device name is on: `node1/cuda:0` -> `node1`; "" for a one-host name."""
    return name.rpartition(NODE_SEP)[0]


def local_name(name: str) -> str:
    """A device's name on its own node, as torch spells it: `node1/cuda:0` -> `cuda:0`."""
    return name.rpartition(NODE_SEP)[2]


def human_bytes(n: int) -> str:
    """Bytes as one reads them: `737.5 KiB`, `132.8 GiB` (parse_size's inverse, rounded)."""
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """`80GiB`, `512MiB`, `1.5TB` or a bare number of GiB, in bytes (MIN_MEMORY to MAX_MEMORY)."""
    m = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text)
    if not m:
        raise DeviceSpecError(
            f"cannot read memory size '{_shown(text)}'; write e.g. 80GiB or 512MiB"
        )
    scale = {"GiB": GiB, "GB": 10**9, "MiB": 1 << 20, "MB": 10**6, "TiB": 1 << 40, "TB": 10**12}
    size = float(m.group(1)) * scale[m.group(2) or "GiB"]  # hundreds of digits give inf
    if not MIN_MEMORY <= size <= MAX_MEMORY:
        raise DeviceSpecError(
            f"memory size '{_shown(text)}' is out of range; write {MIN_MEMORY >> 20}MiB to "
            f"{MAX_MEMORY >> 40}TiB, e.g. 80GiB"
        )
    return int(size)


def _shown(text: str) -> str:
    """`text` cut to a length an error message can quote, on one line."""
    short = text if len(text) <= 40 else f"{text[:37]}..."
    return short.encode("unicode_escape").decode("ascii")


def _capped_int(text: str, cap: int) -> int:
    """int(text), except that a number with more digits than `cap` is cap + 1 (or -cap - 1):
    one thousands of digits long, which int() refuses, is never converted."""
    if len(text.lstrip("+-").lstrip("0")) > len(str(cap)):
        return -cap - 1 if text.startswith("-") else cap + 1
    return int(text)


def _cpu(memory: int | None) -> Device:
    cores = os.cpu_count() or 1
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("cpu", memory or total, cores * CPU_FLOPS_PER_CORE, CPU_BANDWIDTH, "cpu")


def _gpu(index: int, model: str | None, memory: int | None) -> Device:
    acc = ACCELERATORS.get(model or "")
    if acc is None and memory is None:
        known = ", ".join(ACCELERATORS)
        raise DeviceSpecError(
            f"memory of cuda:{index} is unknown; give it (cuda:{index}=80GiB) or a model (2xH200; known: {known})"
        )
    acc = acc or Accelerator(memory, ACCELERATORS["H100"].flops, ACCELERATORS["H100"].bandwidth)
    return Device(f"cuda:{index}", memory or acc.memory, acc.flops, acc.bandwidth, model or "")


def _detected_gpu(index: int) -> Device | None:
    """The real size of cuda:N when this process can see it (never imports torch itself)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(index)
    model = next((m for m in ACCELERATORS if m in props.name), None)
    return _gpu(index, model, props.total_memory)


def this_machine() -> str:
    """This machine's inventory as `--devices` spells it: its CUDA devices where torch sees
    any (`cuda:0,cuda:1`, sized by _detected_gpu), else `cpu`."""
    if not (Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi")):
        return "cpu"  # no NVIDIA driver: spare the seconds importing torch takes
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return ",".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))


def parse_devices(spec: str) -> list[Device]:
    """Parse a `--devices` string into devices, GPUs numbered in the order given (per node).

    One host: `cpu`, `2xH200`, `cuda:0=80GiB,cuda:1=40GiB`. Several nodes: each entry
    prefixed with its node's name, `node0=2xH200,node1=2xH200` (devices `node0/cuda:0`, ...).
    A Ray cluster: `ray:auto` (the one this machine belongs to) or `ray://HOST:PORT`, its
    nodes and GPUs read from Ray (cluster.py)."""
    if not spec.strip():
        raise DeviceSpecError("no devices given; write e.g. cpu, 2xH200 or cuda:0=80GiB")
    if spec.strip().startswith("ray:"):
        from omniflow.cluster import ray_devices

        return ray_devices(spec.strip())
    inventory = _Inventory(spec)
    for entry in spec.split(","):
        inventory.add(entry.strip())
    return inventory.devices


# A node's name in a multi-node inventory: a word that names no device kind.
_NODE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def _node_prefix(entry: str) -> tuple[str, str]:
    """(node, the device entry) for `node1=2xH200`; ("", entry) for a one-host entry."""
    name, has_rest, rest = (part.strip() for part in entry.partition("="))
    if has_rest and _NODE_NAME.fullmatch(name) and not re.fullmatch(r"cpu|cuda.*", name):
        return name, rest
    return "", entry


class _Inventory:
    """The devices parsed so far, and per node the index the next GPU without one gets."""

    def __init__(self, spec: str):
        self.spec = spec
        self.devices: list[Device] = []
        self.names: set[str] = set()
        self.next_gpus: dict[str, int] = {}
        self.node = ""

    @property
    def next_gpu(self) -> int:
        return self.next_gpus.get(self.node, 0)

    @next_gpu.setter
    def next_gpu(self, index: int) -> None:
        self.next_gpus[self.node] = index

    def add(self, entry: str) -> None:
        if not entry:
            raise DeviceSpecError(
                f"empty entry in device list '{_shown(self.spec)}'; separate entries with one comma"
            )
        self.node, entry = _node_prefix(entry)
        if self.node and not entry:
            raise DeviceSpecError(
                f"'{_shown(self.node)}=' names no device; write e.g. {_shown(self.node)}=2xH200"
            )
        if self.next_gpus and (self.node == "") != ("" in self.next_gpus):
            raise DeviceSpecError(
                f"'{_shown(self.spec)}' mixes entries with and without a node; give every "
                "entry its node (node0=2xH200,node1=2xH200) or none"
            )
        self.next_gpus.setdefault(self.node, 0)
        name, has_size, size = (part.strip() for part in entry.partition("="))
        memory = parse_size(size) if has_size else None
        if m := re.fullmatch(r"([+-]?\d+)\s*x\s*([A-Za-z0-9-]+)", name):
            self._add_accelerators(entry, m.group(1), m.group(2), memory)
        elif name == "cpu":
            self._append(_cpu(memory))
        elif m := re.fullmatch(r"cuda(?::(\d+))?", name):
            index = _capped_int(m.group(1), MAX_GPU_INDEX) if m.group(1) else self.next_gpu
            self._add_gpu(entry, index, None, memory)
        else:
            raise DeviceSpecError(
                f"unknown device '{_shown(name)}'; use cpu, cuda:N, NxMODEL (e.g. 2xH200), optionally =SIZE"
            )

    def _add_accelerators(
        self, entry: str, count_text: str, model_text: str, memory: int | None
    ) -> None:
        model = model_text.upper()
        if model not in ACCELERATORS:
            raise DeviceSpecError(
                f"unknown accelerator '{_shown(model_text)}'; known: {', '.join(ACCELERATORS)}"
            )
        count = _capped_int(count_text, MAX_GPUS_PER_ENTRY)
        if count < 1:
            raise DeviceSpecError(
                f"'{_shown(entry)}': the number of GPUs must be at least 1; write e.g. 1x{model}"
            )
        if count > MAX_GPUS_PER_ENTRY:
            raise DeviceSpecError(
                f"'{_shown(entry)}': one entry gives at most {MAX_GPUS_PER_ENTRY} GPUs; write e.g. 8x{model}"
            )
        self._check_room(count)
        for _ in range(count):
            self._add_gpu(entry, self.next_gpu, model, memory)

    def _add_gpu(self, entry: str, index: int, model: str | None, memory: int | None) -> None:
        if index > MAX_GPU_INDEX:
            raise DeviceSpecError(
                f"'{_shown(entry)}': GPU indexes run from 0 to {MAX_GPU_INDEX}; number GPUs from cuda:0"
            )
        detected = None if model or memory or self.node else _detected_gpu(index)
        self._append(detected or _gpu(index, model, memory))
        self.next_gpu = index + 1

    def _append(self, device: Device) -> None:
        if self.node:
            device = replace(device, name=f"{self.node}{NODE_SEP}{device.name}")
        if device.name in self.names:
            raise DeviceSpecError(
                f"{device.name} is listed twice in '{_shown(self.spec)}'; list each device once"
            )
        self._check_room(1)
        self.devices.append(device)
        self.names.add(device.name)

    def _check_room(self, count: int) -> None:
        if len(self.devices) + count > MAX_DEVICES:
            raise DeviceSpecError(
                f"'{_shown(self.spec)}' lists more than {MAX_DEVICES} devices; list at most {MAX_DEVICES}"
            )
