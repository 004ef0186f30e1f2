"""Host offload's price (``training.offload``): the host memory the offloaded state takes,
the device memory it frees, and the bytes and seconds per step on the host link, for each
way to update offloaded optimizer state. ``training.setup`` takes the cheaper update.

Per device, with ``P`` the fp32 bytes of its parameters (as the step places them) and ``G``
those of its gradients (the optimizer's placement; AdamW's two moments are ``2G``):

- offloaded parameters cross the link down for the step and, after a device update, back
  up: ``2P`` (``P`` when the update runs on the host, where they are already);
- offloaded optimizer state, ``stream``: the moments down and back up, ``4G``, the update
  on the device (its HBM traffic is negligible beside the link's);
- ``host``: the gradients down (``G``) and, unless the parameters live on the host, the
  parameters down and the new ones up (``2P``); the update reads parameters, gradients and
  both moments and writes three (``7G`` of host-memory traffic) at the host's bandwidth.

With the catalogue's PCIe 5 (64 GB/s a direction) and ``HOST_MEMORY_BANDWIDTH``,
``stream`` costs ``4G/64`` and ``host`` ``3G/64 + 7G/100`` (parameters on the device): the
link is not slow enough, next to host memory, for the host update to win; it wins where the
link is much slower than host memory (host bandwidth above ``7 × link``).

    >>> from triax.models import config
    >>> from triax.costs.workload import Layout, Workload
    >>> w = Workload.of(config.get("tiny"), train=True, dtype="fp32", batch=8, seq=16)
    >>> c = offload_cost(w, Layout(data=8), ("optimizer",), "stream")
    >>> c.link_bytes == 2 * (c.host_bytes - COUNTERS)   # the moments down and up
    True
    >>> cheaper_update(w, Layout(data=8), ("optimizer",))
    'stream'

The planner's memory (``costs.memory.estimate``) moves the state a layout offloads
(``Layout.offload``) to its ``host`` term, ``host_bytes`` here, and its step time adds
``planned_cost``'s seconds on the device's host link (``planner.evaluate``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from triax.choices import OFFLOAD_UPDATES
from triax.costs.hardware import LINKS, Device, Link
from triax.costs.param_layout import local_param_elements
from triax.costs.workload import ADAM_MOMENTS, FP32, Layout, Workload
from triax.units import GB

# Stated: the host memory bandwidth an elementwise optimizer update achieves on a GPU node's
# host cores (a two-socket DDR5 server peaks near 2 × 300 GB/s; threads doing a fused AdamW
# reach a fraction of it).
HOST_MEMORY_BANDWIDTH = 100 * GB
HOST_LINK = "pcie5"        # the host link of the catalogue's H100/H200 (``Device.pcie``)
ADAM_TOUCHES = 7           # fp32 arrays an AdamW update reads (p, g, m, v) and writes (p, m, v)
COUNTERS = 8               # AdamW's two int32 step counts (its moments' and its schedule's)


@dataclass(frozen=True)
class OffloadCost:
    """Per device: the state's bytes in host memory (``host_bytes``, what leaves the
    device's), the bytes crossing the host link per step (both directions) and the time."""

    targets: tuple[str, ...]
    update: str
    host_bytes: float
    link_bytes: float
    link_s: float
    host_s: float

    @property
    def seconds(self) -> float:
        """Time per step the offload adds, unhidden (transfers are not overlapped)."""
        return self.link_s + self.host_s


def offload_cost(w: Workload, lay: Layout, targets: tuple[str, ...], update: str,
                 link: Optional[Link] = None,
                 host_bandwidth: float = HOST_MEMORY_BANDWIDTH) -> OffloadCost:
    """The price of offloading ``targets`` with the optimizer update at ``update``."""
    if update not in OFFLOAD_UPDATES:
        raise ValueError(f"offload update {update!r}: choose one of {OFFLOAD_UPDATES}")
    link = link or LINKS[HOST_LINK]
    P = local_param_elements(w, lay) * FP32
    G = local_param_elements(w, lay, optimizer=True) * FP32
    host_update = "optimizer" in targets and update == "host"
    host = link_bytes = host_s = 0.0
    if "params" in targets:
        host += P
        link_bytes += P if host_update else 2 * P
    if "optimizer" in targets:
        host += ADAM_MOMENTS * G + COUNTERS
        if host_update:
            link_bytes += G + (0 if "params" in targets else 2 * P)
            host_s = ADAM_TOUCHES * G / host_bandwidth
        else:
            link_bytes += 2 * ADAM_MOMENTS * G
    return OffloadCost(tuple(targets), update, host, link_bytes,
                       link_bytes / link.bandwidth, host_s)


def cheaper_update(w: Workload, lay: Layout, targets: tuple[str, ...],
                   link: Optional[Link] = None,
                   host_bandwidth: float = HOST_MEMORY_BANDWIDTH) -> str:
    """The optimizer update (stream | host) that ``offload_cost`` prices lower (stream on a
    tie, and without offloaded optimizer state, where the two are one)."""
    costs = {u: offload_cost(w, lay, targets, u, link, host_bandwidth).seconds
             for u in OFFLOAD_UPDATES}
    return min(OFFLOAD_UPDATES, key=lambda u: (costs[u], OFFLOAD_UPDATES.index(u)))


def offload_reason(w: Workload) -> Optional[str]:
    """Why the planner does not price host offload for ``w`` (None: it does): the prices
    above are full fine-tuning's train state."""
    if not w.train:
        return "host offload is of the train state: plan it with --train"
    if w.lora is not None:
        return ("host offload is priced for full fine-tuning's state, not LoRA's (a frozen "
                "base and the adapters' moments)")
    return None


def host_link(device: Device) -> Link:
    """The link between ``device`` and its host: the catalogue's ``Device.pcie`` (a link a
    ``--hardware`` file adds that is not built in: ``HOST_LINK``)."""
    return LINKS.get(device.pcie, LINKS[HOST_LINK])


def planned_cost(w: Workload, lay: Layout, link: Optional[Link] = None) -> OffloadCost:
    """The price of ``lay.offload`` with the update ``cheaper_update`` picks on ``link``
    (what ``training.setup`` runs; the catalogue's host link by default)."""
    why = offload_reason(w)
    if why:
        raise ValueError(f"--offload {','.join(lay.offload)}: {why}")
    return offload_cost(w, lay, lay.offload, cheaper_update(w, lay, lay.offload, link), link)
