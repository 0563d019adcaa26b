"""Device placement for planner states: per-host usage counts, the three DAPPLE policies, canonical keys."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import compress
from operator import add

from fxpipe.core.cluster import Cluster

POLICIES = ("fresh", "append", "append-near", "scatter")

# Clusters up to this many devices let a stage take any replica count; larger ones use host-aligned
# counts (powers of two inside a host, powers of two of whole hosts, and their complements).
EXACT_REPLICA_LIMIT = 8
ALIGNED_ABOVE_DEVICES = 16


@dataclass(frozen=True)
class Usage:
    """How many devices of every host are taken, in host order.

    Devices fill each host from its lowest index, so the counts alone name the concrete devices:
    taking ``k`` more on host ``h`` means devices ``h * per_host + used[h] .. + k - 1``. Hosts are
    interchangeable and so are devices inside a host, hence :meth:`key` (the sorted counts) is the
    canonical form two states are merged on.
    """

    used: tuple[int, ...]
    per_host: int
    num_free: int

    @staticmethod
    def empty(cluster: Cluster) -> Usage:
        return Usage((0,) * cluster.num_hosts, cluster.devices_per_host, cluster.num_devices)

    def key(self) -> tuple[int, ...]:
        return tuple(sorted(self.used))

    def take(self, counts: tuple[int, ...]) -> tuple[Usage, tuple[int, ...]]:
        """Take ``counts[h]`` more devices on every host; returns the new usage and the devices (sorted)."""
        assert len(counts) == len(self.used), "a take vector needs one count per host"
        devices: list[int] = []
        for host in compress(range(len(counts)), counts):  # C-speed skip of the many hosts that take nothing
            have, extra = self.used[host], counts[host]
            assert have + extra <= self.per_host, "placement took more devices than a host has"
            start = host * self.per_host + have
            devices.extend(range(start, start + extra))
        used = tuple(map(add, self.used, counts))
        return Usage(used, self.per_host, self.num_free - len(devices)), tuple(devices)

    def take_all(self) -> tuple[Usage, tuple[int, ...]]:
        return self.take(tuple(self.per_host - have for have in self.used))


def _fill(usage: Usage, hosts: list[int], num_devices: int, whole: bool, group: int = 1) -> tuple[int, ...] | None:
    """Take devices host by host from ``hosts``; ``whole`` requires hosts to be completely free; ``group``: take
    whole groups of that many devices per host (a tensor-parallel group stays inside one host)."""
    counts = [0] * len(usage.used)
    remaining = num_devices
    for host in hosts:
        if remaining == 0:
            break
        free = usage.per_host - usage.used[host]
        if whole and free != usage.per_host:
            continue
        taken = min(free - free % group, remaining)
        counts[host] = taken
        remaining -= taken
    return tuple(counts) if remaining == 0 else None


def fresh_first(usage: Usage, num_devices: int, group: int = 1) -> tuple[int, ...] | None:
    """Only completely unused hosts, so a stage's allreduce stays inside as few hosts as possible."""
    hosts = [h for h, have in enumerate(usage.used) if have == 0]
    return _fill(usage, hosts, num_devices, True, group)


def append_first(usage: Usage, num_devices: int, near: frozenset[int] = frozenset(), group: int = 1
                 ) -> tuple[int, ...] | None:
    """Partly used hosts first (fullest first, less fragmentation), then fresh hosts for the rest.

    With ``near`` (the previous stage's hosts) those partly used hosts come first, so the transfer
    from the previous stage stays inside a host; this variant is tried in addition to the plain one.
    """
    partial = sorted((h for h, have in enumerate(usage.used) if 0 < have < usage.per_host),
                     key=lambda h: (h not in near, -usage.used[h], h))
    if not partial:
        return None
    fresh = [h for h, have in enumerate(usage.used) if have == 0]
    return _fill(usage, partial + fresh, num_devices, False, group)


def scatter_first(usage: Usage, num_devices: int, group: int = 1) -> tuple[int, ...] | None:
    """One free device (or ``group`` of them) per host, round robin, until the stage has enough (many NICs in
    parallel)."""
    if num_devices < 2 * group or len(usage.used) < 2:
        return None
    counts = [0] * len(usage.used)
    remaining = num_devices
    while remaining:
        progressed = False
        for host, have in enumerate(usage.used):
            if remaining and have + counts[host] + group <= usage.per_host:
                counts[host] += group
                remaining -= group
                progressed = True
        if not progressed:
            return None
    return tuple(counts)


def _one_host(usage: Usage, num_devices: int, partial: bool) -> tuple[int, ...] | None:
    """All devices on one host: the fullest partly used host that has room, or the first fresh one."""
    used, room = usage.used, usage.per_host - num_devices  # a host fits the stage when it has used <= room
    if partial:  # the fullest such host, lowest index among equals
        fullest = max((have for have in used if 0 < have <= room), default=0)
        if fullest == 0:
            return None
        host = used.index(fullest)
    elif room < 0 or 0 not in used:
        return None
    else:
        host = used.index(0)
    counts = [0] * len(used)
    counts[host] = num_devices
    return tuple(counts)


def placements(usage: Usage, num_devices: int, near: frozenset[int] = frozenset(), group: int = 1
               ) -> Iterator[tuple[int, ...]]:
    """Distinct per-host take vectors for a new stage of ``num_devices`` devices, one per policy
    (append-first twice: fullest hosts first, and the previous stage's hosts ``near`` first); ``group``: each
    host takes whole groups of that many (the stage's tensor-parallel groups, ``num_devices`` a multiple of it),
    so no group spans hosts (the search relies on it and does not check each vector)."""
    if usage.per_host > 1 and len(usage.used) * usage.per_host > ALIGNED_ABOVE_DEVICES:
        # host-aligned: whole fresh hosts for multi-host stages; one host (partly used or fresh) otherwise.
        # These options are never duplicates (a partly used host and a fresh one differ in their use before),
        # so the canonical key, a sort over every host, is skipped: it was half of a 2,048-host row's planning.
        if num_devices % usage.per_host == 0:
            aligned: tuple[tuple[int, ...] | None, ...] = (fresh_first(usage, num_devices, group),)
        else:
            aligned = (_one_host(usage, num_devices, partial=True), _one_host(usage, num_devices, partial=False))
        yield from (counts for counts in aligned if counts is not None)
        return
    options = (fresh_first(usage, num_devices, group), append_first(usage, num_devices, group=group),
               append_first(usage, num_devices, near, group) if near else None,
               scatter_first(usage, num_devices, group))
    seen: set[tuple[tuple[int, int, bool], ...]] = set()
    for counts in options:
        if counts is None:
            continue
        # Hosts with equal usage are interchangeable (apart from hosting the previous stage): the same
        # multiset of (used before, taken, near) is a duplicate.
        canonical = tuple(sorted((u, c, h in near) for h, (u, c) in enumerate(zip(usage.used, counts, strict=True))))
        if canonical in seen:
            continue
        seen.add(canonical)
        yield counts


def host_aligned(cluster: Cluster) -> bool:
    """Large clusters only place stages on host-aligned device sets (see :func:`replica_choices`)."""
    return cluster.num_devices > ALIGNED_ABOVE_DEVICES and cluster.devices_per_host > 1


def replica_choices(cluster: Cluster, num_free: int, max_rows: int) -> list[int]:
    """Replica counts a new stage may take from ``num_free`` free devices (each replica needs a row).

    Small clusters try every count. Medium ones try powers of two up to a host, powers of two of
    whole hosts, and the complements ``num_free - c`` so the stage left behind is aligned too (how
    "15:1" on 2 x 8 devices is reached). Large clusters (:func:`host_aligned`) try only powers of two
    inside a host and powers of two of whole hosts (plus all free whole hosts), which keeps every
    state a few partly used hosts plus whole hosts.
    """
    limit = min(num_free, max_rows)
    if cluster.num_devices <= EXACT_REPLICA_LIMIT:
        return list(range(1, limit + 1))
    per_host = cluster.devices_per_host
    aligned = {2**i for i in range(per_host.bit_length()) if 2**i <= per_host} | {per_host}
    aligned |= {2**i * per_host for i in range(cluster.num_hosts.bit_length()) if 2**i <= cluster.num_hosts}
    if host_aligned(cluster):
        choices = aligned | {num_free // per_host * per_host}
    else:
        choices = aligned | {num_free - c for c in aligned} | {num_free}
    return sorted(c for c in choices if 1 <= c <= limit)
