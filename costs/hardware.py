"""Hardware catalogue: device kinds, links and clusters (nodes × GPUs per node).

Figures are vendor datasheet numbers: dense (not 2:4 sparse) tensor-core FLOP/s, HBM
bandwidth, and per-GPU one-direction link bandwidth. Memory is in decimal GB (1e9 bytes),
the conservative reading of "80 GB".

    >>> from triax.costs import hardware
    >>> c = hardware.cluster("h100-80gb", gpus_per_node=8, nodes=2)
    >>> c.devices, c.intra.name, c.inter.name
    (16, 'nvlink4', 'ib-400')

Users add devices, links and clusters in a TOML file (see ``load_catalog``)::

    [links.roce-200]
    gbps = 25            # GB/s per GPU, one direction
    [devices.my-gpu]
    memory_gb = 32
    bf16_tflops = 200
    fp32_tflops = 50
    fp8_tflops = 400     # optional: float8 units (--precision fp8's projections)
    hbm_gbps = 1000
    form_factor = "pcie"  # sxm | oam | pcie
    pcie = "pcie4"
    [clusters.lab]
    gpu = "my-gpu"
    gpus_per_node = 4
    nodes = 2
    inter = "roce-200"
"""
from __future__ import annotations

import dataclasses
import enum
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from triax.units import GB   # device memory and link bandwidth are decimal

TFLOPS = 1e12


class FormFactor(enum.Enum):
    SXM = "sxm"    # NVLink/NVSwitch baseboard
    OAM = "oam"    # AMD Infinity Fabric baseboard
    PCIE = "pcie"  # add-in card: GPUs talk over PCIe


@dataclass(frozen=True)
class Link:
    """A link class, by its per-GPU one-direction bandwidth and a per-message latency."""

    name: str
    bandwidth: float          # bytes/s per GPU, one direction
    latency: float = 5e-6     # seconds per collective step
    description: str = ""


@dataclass(frozen=True)
class Device:
    """One accelerator kind."""

    name: str
    memory: float             # bytes
    flops_bf16: float         # dense bf16/fp16 tensor FLOP/s
    flops_fp32: float         # fp32 FLOP/s
    hbm_bandwidth: float      # bytes/s
    form_factor: FormFactor
    fabric: Optional[str] = None   # intra-node link name for SXM/OAM parts
    pcie: str = "pcie5"            # host/peer link name for PCIe parts
    flops_fp8: float = 0.0         # dense float8 tensor FLOP/s; 0: no float8 units (bf16's)

    def peak_flops(self, dtype: str) -> float:
        """The rate of a step's matmuls in ``dtype`` (fp8's run in bf16 but its block
        projections: ``float8_flops``)."""
        return self.flops_fp32 if dtype == "fp32" else self.flops_bf16

    @property
    def float8_flops(self) -> float:
        """The rate of ``--precision fp8``'s float8 projections: the float8 units', or bf16's
        where the part has none (XLA then computes them in a wider type)."""
        return self.flops_fp8 or self.flops_bf16

    @property
    def default_intra(self) -> str:
        """SXM/OAM boards use their fabric; PCIe cards talk over PCIe."""
        return self.fabric if self.form_factor is not FormFactor.PCIE and self.fabric \
            else self.pcie


LINKS: dict[str, Link] = {l.name: l for l in (
    Link("nvlink3", 600 * GB / 2, 3e-6, "A100 NVLink3/NVSwitch, 600 GB/s bidirectional"),
    Link("nvlink4", 900 * GB / 2, 3e-6, "H100/H200 NVLink4/NVSwitch, 900 GB/s bidirectional"),
    Link("nvlink5", 1800 * GB / 2, 3e-6, "B200 NVLink5, 1.8 TB/s bidirectional"),
    Link("infinity-fabric", 896 * GB / 2, 3e-6, "MI300X Infinity Fabric, 896 GB/s peer"),
    Link("pcie4", 32 * GB, 8e-6, "PCIe Gen4 x16, ~32 GB/s"),
    Link("pcie5", 64 * GB, 8e-6, "PCIe Gen5 x16, ~64 GB/s"),
    Link("ib-400", 400 / 8 * GB, 10e-6, "InfiniBand NDR 400 Gb/s per GPU"),
    Link("ib-200", 200 / 8 * GB, 10e-6, "InfiniBand HDR 200 Gb/s per GPU"),
    Link("eth-100", 100 / 8 * GB, 20e-6, "100 Gb/s Ethernet per GPU"),
)}

_S, _O, _P = FormFactor.SXM, FormFactor.OAM, FormFactor.PCIE
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100-80gb", 80 * GB, 989 * TFLOPS, 67 * TFLOPS, 3350 * GB, _S, "nvlink4", "pcie5",
           1979 * TFLOPS),
    Device("h100-pcie", 80 * GB, 756 * TFLOPS, 51 * TFLOPS, 2000 * GB, _P, None, "pcie5",
           1513 * TFLOPS),
    Device("h200", 141 * GB, 989 * TFLOPS, 67 * TFLOPS, 4800 * GB, _S, "nvlink4", "pcie5",
           1979 * TFLOPS),
    Device("a100-40gb", 40 * GB, 312 * TFLOPS, 19.5 * TFLOPS, 1555 * GB, _S, "nvlink3", "pcie4"),
    Device("a100-80gb", 80 * GB, 312 * TFLOPS, 19.5 * TFLOPS, 2039 * GB, _S, "nvlink3", "pcie4"),
    Device("b200-192gb", 192 * GB, 2250 * TFLOPS, 75 * TFLOPS, 8000 * GB, _S, "nvlink5", "pcie5",
           4500 * TFLOPS),
    Device("rtx4090", 24 * GB, 165 * TFLOPS, 82.6 * TFLOPS, 1008 * GB, _P, None, "pcie4",
           330 * TFLOPS),
    Device("l40s", 48 * GB, 362 * TFLOPS, 91.6 * TFLOPS, 864 * GB, _P, None, "pcie4",
           733 * TFLOPS),
    Device("mi300x", 192 * GB, 1307 * TFLOPS, 163.4 * TFLOPS, 5300 * GB, _O,
           "infinity-fabric", "pcie5", 2615 * TFLOPS),
)}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``gpus_per_node`` devices of one kind, with intra- and inter-node links."""

    device: Device
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link

    @property
    def devices(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        return (f"{self.nodes} node(s) × {self.gpus_per_node} {self.device.name} "
                f"({self.intra.name} within a node, {self.inter.name} between nodes)")


@dataclass(frozen=True)
class Catalog:
    """Devices, links and named clusters; the built-ins plus whatever a TOML file adds."""

    devices: Mapping[str, Device] = field(default_factory=lambda: dict(DEVICES))
    links: Mapping[str, Link] = field(default_factory=lambda: dict(LINKS))
    clusters: Mapping[str, Cluster] = field(default_factory=dict)

    def device(self, name: str) -> Device:
        if name not in self.devices:
            raise ValueError(f"unknown GPU {name!r}; choose one of: {', '.join(self.devices)} "
                             f"(or add it in a --hardware TOML file)")
        return self.devices[name]

    def link(self, name: str) -> Link:
        if name not in self.links:
            raise ValueError(f"unknown link {name!r}; choose one of: {', '.join(self.links)}")
        return self.links[name]

    def cluster(self, gpu: str, gpus_per_node: int, nodes: int, intra: Optional[str] = None,
                inter: Optional[str] = None) -> Cluster:
        dev = self.device(gpu)
        if gpus_per_node < 1 or nodes < 1:
            raise ValueError(f"--gpus-per-node and --nodes must be ≥ 1, got {gpus_per_node} "
                             f"and {nodes}")
        return Cluster(dev, gpus_per_node, nodes, self.link(intra or dev.default_intra),
                       self.link(inter or "ib-400"))


def parse_gpu(text: str, catalog: Optional[Catalog] = None) -> tuple[tuple[Device, int], ...]:
    """``"h100-80gb:8,a100-80gb:8"`` → ``((Device h100-80gb, 8), (Device a100-80gb, 8))``: a
    mixed cluster's groups (kind, count), in order; an unknown kind or a bad count names the
    catalogue's kinds.

        >>> [(d.name, n) for d, n in parse_gpu("h100-80gb:8,a100-80gb:8")]
        [('h100-80gb', 8), ('a100-80gb', 8)]
    """
    cat = catalog or Catalog()
    groups = []
    for part in str(text).split(","):
        name, sep, count = part.strip().partition(":")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--gpu {text!r}: give KIND:COUNT groups, comma-separated, e.g. "
                             f"h100-80gb:8,a100-80gb:8 (COUNT ≥ 1); kinds: "
                             f"{', '.join(cat.devices)}")
        groups.append((cat.device(name.strip()), int(count)))
    return tuple(groups)


def present(catalog: Catalog, kind: str, entry: Optional[str], reference: str, per_node: int,
            nodes: int, memory: float) -> tuple[Cluster, str]:
    """The devices a process sees (``kind``, ``per_node`` on each of ``nodes``) as a cluster
    of ``memory`` bytes each, and a sentence on the time model: the catalogue ``entry``'s
    speeds, or with none the ``reference`` device's, which then only rank the plans."""
    dev = catalog.device(entry or reference)
    dev = dataclasses.replace(dev, name=f"{kind} (this machine)", memory=float(memory))
    note = (f"step times modelled with {entry}'s catalogue speeds" if entry else
            f"{kind} timings are not modelled ({kind} is not in the catalogue): step times "
            f"and links are the {reference}'s, so they only rank the plans")
    return Catalog(devices={dev.name: dev}, links=catalog.links).cluster(
        dev.name, per_node, nodes), note


def cluster(gpu: str, gpus_per_node: int = 8, nodes: int = 1, intra: Optional[str] = None,
            inter: Optional[str] = None, catalog: Optional[Catalog] = None) -> Cluster:
    """A cluster of a catalogued device; links default from the form factor and IB-400."""
    return (catalog or Catalog()).cluster(gpu, gpus_per_node, nodes, intra, inter)


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The built-in catalogue extended by a TOML file of ``links``, ``devices``, ``clusters``."""
    if path is None:
        return Catalog()
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"hardware file {path}: invalid TOML ({e})") from None
    links, devices = dict(LINKS), dict(DEVICES)
    try:
        for name, d in data.get("links", {}).items():
            links[name] = Link(name, float(d["gbps"]) * GB, float(d.get("latency_us", 10)) * 1e-6,
                               d.get("description", ""))
        for name, d in data.get("devices", {}).items():
            devices[name] = Device(
                name, float(d["memory_gb"]) * GB, float(d["bf16_tflops"]) * TFLOPS,
                float(d["fp32_tflops"]) * TFLOPS, float(d["hbm_gbps"]) * GB,
                FormFactor(d.get("form_factor", "pcie")), d.get("fabric"), d.get("pcie", "pcie5"),
                float(d.get("fp8_tflops", 0)) * TFLOPS)
    except KeyError as e:
        raise ValueError(f"hardware file {path}: missing field {e.args[0]!r}") from None
    cat = Catalog(devices, links)
    clusters = {name: cat.cluster(d["gpu"], int(d["gpus_per_node"]), int(d["nodes"]),
                                  d.get("intra"), d.get("inter"))
                for name, d in data.get("clusters", {}).items()}
    return Catalog(devices, links, clusters)
