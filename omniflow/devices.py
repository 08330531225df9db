"""Device inventories: what `--devices` means, and each device's memory and speed.

`cpu`, `cuda:0,cuda:1`, `2xH200`, `cuda:0=80GiB,cuda:1=40GiB`, `cpu=16GiB` all parse to a
list of `Device`s. Speeds are nominal datasheet figures; the compiler uses them only to
compare stages' costs and to size chunks, never as promises.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from omniflow.errors import DeviceSpecError

GiB = 1 << 30


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

    @property
    def is_gpu(self) -> bool:
        return self.name.startswith("cuda")

    def __str__(self) -> str:
        return self.name


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text)
    if not m:
        raise DeviceSpecError(f"cannot read memory size '{text}'; write e.g. 80GiB or 512MiB")
    scale = {"GiB": GiB, "GB": 10**9, "MiB": 1 << 20, "MB": 10**6, "TiB": 1 << 40, "TB": 10**12}
    return int(float(m.group(1)) * scale[m.group(2) or "GiB"])


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


def parse_devices(spec: str) -> list[Device]:
    """Parse a `--devices` string into devices, GPUs numbered in the order given."""
    devices: list[Device] = []
    gpu_index = 0
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise DeviceSpecError(f"empty entry in device list '{spec}'")
        name, _, size = part.partition("=")
        memory = parse_size(size) if size else None
        count_model = re.fullmatch(r"(\d+)\s*x\s*([A-Za-z0-9-]+)", name)
        if count_model:
            count, model = int(count_model.group(1)), count_model.group(2).upper()
            if model not in ACCELERATORS:
                raise DeviceSpecError(
                    f"unknown accelerator '{count_model.group(2)}'; known: {', '.join(ACCELERATORS)}"
                )
            for _ in range(count):
                devices.append(_gpu(gpu_index, model, memory))
                gpu_index += 1
        elif name == "cpu":
            devices.append(_cpu(memory))
        elif m := re.fullmatch(r"cuda(?::(\d+))?", name):
            index = int(m.group(1)) if m.group(1) else gpu_index
            devices.append((None if memory else _detected_gpu(index)) or _gpu(index, None, memory))
            gpu_index = index + 1
        else:
            raise DeviceSpecError(
                f"unknown device '{name}'; use cpu, cuda:N, NxMODEL (e.g. 2xH200), optionally =SIZE"
            )
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise DeviceSpecError(f"a device is listed twice in '{spec}'")
    return devices
