"""Tensor parallelism: one model sharded over the devices of one host, one process per device.

The engine (scheduler, tiers, registry, sampling) runs once, in the driver, which is also rank 0;
ranks 1..N-1 are worker processes that run their shard of every forward. See
docs/architecture.md, "Tensor parallelism".

- :mod:`.group`: the process group, each rank's device, and the ``loramux::all_reduce`` op.
- :mod:`.sharding`: column/row sharding of a Hugging Face model's layers by a declared mapping.
- :mod:`.workers`: the driver's handle on its workers (start, send, wait, liveness, shutdown).
- :mod:`.worker`: the worker process's loop.
"""
