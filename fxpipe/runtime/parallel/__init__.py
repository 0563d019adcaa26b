"""The runtime's parallel room: splitting work inside a replica group: sharded (ZeRO) stages and tensor-parallel groups."""
