"""Remote tier on Mooncake Store (``mooncake.store.MooncakeDistributedStore``, TCP or RDMA).

One chunk is one Mooncake object ``<prefix>:<key hex>`` in the :mod:`kvtier.tiers.remote` format.

What is shared and what is per process:

- Shared, in Mooncake: the objects. ``contains``, ``get``, ``entry_bytes`` and ``delete`` ask the
  master, so every process sees the chunks every other one committed. ``reserve`` opens a Mooncake
  put session (its PutStart): the object is invisible to all until ``commit`` ends the session,
  and a second writer of the same key is refused. The master discards sessions of writers that
  died.
- Per process: ``keys`` and ``used``/``capacity``. Mooncake lists objects in no order and keeps no
  counter that several clients can update atomically, so each tier object lists the chunks *it*
  committed (oldest first) and charges them to its own budget: give each process its share of
  the pool as ``capacity_bytes``. The pool's own limit shows as TierFullError from ``reserve``.
  ``oldest(n)`` (what the uploader evicts when the budget is spent) is the head of that list.
  Mooncake evicts objects by itself when the pool passes its high watermark; such a chunk becomes
  a miss and leaves this process's list on its next read.
- The bytes live in the memory of whoever mounts segments: ``global_segment_bytes`` of this
  process (gone when it exits) or a standalone ``mooncake_client``, which keeps data alive after
  a writer exits. With the default of 0 this process mounts nothing.

Every Mooncake call runs on a worker thread and is abandoned after ``timeout_s`` (Mooncake's own
RPC and transfer timeouts are 30 s). An abandoned call may still touch its buffers later, so
``get`` reads into staging buffers the tier owns (given back to the pool only once the call has
ended) and copies out after verification. ``get_many_into`` (how the store promotes chunks; also
``get_into``, a batch of one) reads the payloads of a batch straight into the callers' buffers
in one batched transfer and verifies them there, saving that copy; an abandoned one hands its
future to the caller, who keeps the buffers until it is done. Chunks stored through a codec
(``put_many`` with ``fmts`` on a tier with a ``codec``: the codec's frames, a smaller object)
are read whole into staging instead, a batch at a time, and decoded into the callers' buffers.
``put_many`` (and ``put``, a batch of one) opens the put sessions of a batch with one RPC,
sends the objects in growing groups while the caller's thread checksums the next group
(:class:`~kvtier.tiers.mooncake_calls.Relay`), and ends them with one RPC. Large writes send from the caller's tensor (a late read of it is harmless: a changed byte
fails its checksum). An abandoned write may still complete: the chunk is then in the pool but
not in this process's list.
"""

from __future__ import annotations

from kvtier.tiers.mooncake_reads import MooncakeReads
from kvtier.tiers.mooncake_writes import MooncakeWrites
from kvtier.tiers.remote_config import MooncakeTierConfig

__all__ = ["MooncakeTier", "MooncakeTierConfig"]


class MooncakeTier(MooncakeWrites, MooncakeReads):
    """Chunks in Mooncake Store; see the module docstring for what is shared."""

    name = "mooncake"
