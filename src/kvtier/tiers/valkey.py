"""Remote tier on Valkey (standalone or cluster), shared by every kvtier process that uses the
same servers and ``prefix``.

A chunk is two keys in one slot, ``{p:h}:h`` (its header, :mod:`kvtier.tiers.remote` format) and
``{p:h}:d`` (its payload), ``p`` being the prefix and ``h`` the chunk key in hex: chunks spread
over a cluster, a write sends the caller's bytes without copying them behind a header, and a
ranged read fetches header and range atomically (one script). The index, the budget and the
reservations are keys under the ``{p}`` hash tag, changed only by the scripts of
:mod:`kvtier.tiers.valkey_lua`, atomically also in a cluster: ``keys`` (oldest first),
``contains``, ``entry_bytes``, ``used`` and the capacity budget are the same for all processes.
The index is a sorted set by write sequence: ``oldest(n)``, what the uploader evicts when the
tier is full, is one ``ZRANGE 0 n-1`` (``keys`` reads it all).

Chunks put with a ``fmt`` through a tier with a ``codec`` are stored as the codec's frames
(:mod:`kvtier.tiers.remote`, version 2 objects); ``entry_bytes`` and the index keep their raw
size, the budget is charged what they take.

Lifecycle: ``reserve`` runs a script that refuses a key already committed or being written and
charges the budget (TierFullError when it does not fit); the buffer it returns is local.
``commit`` writes header and payload, then a script publishes the chunk in the index; an entry
is invisible until then. ``put`` on a standalone server does all of it in one round trip, and
``put_many`` does a batch of puts in one round trip (the next upload goes out while the server
takes one); ``get_many_into`` reads a batch with one pipeline.
Reservations expire after ``reservation_ttl_s`` (a writer that died); the next writer returns
their charge and deletes what they wrote. Deletes remove the bytes first, then the index entry:
a crash in between leaves an index entry whose read misses and drops it. Pins are per process:
another process can delete a chunk pinned here (a read in flight keeps the verified bytes it
fetched).
"""

from __future__ import annotations

from kvtier.tiers.remote_config import ValkeyTierConfig
from kvtier.tiers.valkey_reads import ValkeyReads
from kvtier.tiers.valkey_writes import ValkeyWrites

__all__ = ["ValkeyTier", "ValkeyTierConfig"]


class ValkeyTier(ValkeyWrites, ValkeyReads):
    """Chunks in Valkey; see the module docstring for the layout and what is shared."""

    name = "valkey"
