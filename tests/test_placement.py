"""Placement policies against a plain re-statement of them: take vectors, whole tensor-parallel groups per host."""

from __future__ import annotations

import random

import pytest

from fxpipe.passes.partition.placement import Usage, placements


def plain_one_host(used: tuple[int, ...], per_host: int, num_devices: int, partial: bool) -> tuple[int, ...] | None:
    """The fullest partly used host with room (lowest index among equals), or the first fresh host."""
    hosts = [h for h, have in enumerate(used) if (0 < have if partial else have == 0) and per_host - have >= num_devices]
    if not hosts:
        return None
    host = min(hosts, key=lambda h: (-used[h], h))
    return tuple(num_devices if h == host else 0 for h in range(len(used)))


def plain_take(used: tuple[int, ...], per_host: int, counts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    devices = [h * per_host + used[h] + i for h, extra in enumerate(counts) for i in range(extra)]
    return tuple(u + c for u, c in zip(used, counts, strict=True)), tuple(devices)


def random_usage(rng: random.Random, num_hosts: int, per_host: int) -> Usage:
    used = tuple(rng.choice((0, 0, 0, per_host, rng.randrange(per_host + 1))) for _ in range(num_hosts))
    return Usage(used, per_host, num_hosts * per_host - sum(used))


@pytest.mark.parametrize("num_hosts,per_host", [(2, 8), (4, 4), (64, 8), (300, 8)])
def test_placements_take_whole_groups_and_match_the_plain_policies(num_hosts: int, per_host: int) -> None:
    rng = random.Random(num_hosts * 31 + per_host)
    aligned = num_hosts * per_host > 16
    checked = 0
    for _ in range(200):
        usage = random_usage(rng, num_hosts, per_host)
        group = rng.choice([g for g in (1, 2, 4, 8) if g <= per_host])
        num_devices = group * rng.randint(1, max(1, min(usage.num_free, 3 * per_host) // group))
        near = frozenset(rng.sample(range(num_hosts), min(2, num_hosts)))
        found = list(placements(usage, num_devices, near, group))
        for counts in found:
            assert sum(counts) == num_devices
            assert all(count % group == 0 for count in counts), (usage, num_devices, group, counts)
            assert all(have + count <= per_host for have, count in zip(usage.used, counts, strict=True))
            assert usage.take(counts)[0].used == plain_take(usage.used, per_host, counts)[0]
            assert usage.take(counts)[1] == plain_take(usage.used, per_host, counts)[1]
            assert usage.take(counts)[0].num_free == usage.num_free - num_devices
            checked += 1
        canonical = [tuple(sorted((u, c, h in near) for h, (u, c) in enumerate(zip(usage.used, counts, strict=True))))
                     for counts in found]
        assert len(set(canonical)) == len(canonical), "placements yielded an equivalent vector twice"
        if aligned and num_devices % per_host:
            expected = [v for v in (plain_one_host(usage.used, per_host, num_devices, True),
                                    plain_one_host(usage.used, per_host, num_devices, False)) if v is not None]
            assert found == expected
    assert checked > 100
