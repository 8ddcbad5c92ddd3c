"""What the connector's scheduler half tells its worker halves each step (vLLM pickles it to
every worker process): plain lists of which chunks go into or out of which vLLM blocks, and which
blocks each scheduled request computes, so a worker can tell KV computed over blocks that never
arrived from KV it may save."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.core.keys import ChunkKey


@dataclass
class Transfer:
    """Chunks ``first_chunk, first_chunk + 1...`` of one request (``keys``) and the request's
    blocks from its first (``block_ids``, as many as the chunks cover). The last key is a
    partial chunk of ``tail_blocks`` blocks when that is not 0."""

    req_id: str
    keys: list[ChunkKey]
    first_chunk: int
    block_ids: list[int]
    skip_blocks: int = 0
    """Loads: blocks vLLM already holds itself (its prefix cache); not overwritten, not counted."""
    tail_blocks: int = 0
    background: bool = False
    """Loads: between steps, reported through ``get_finished`` (vLLM's async loading)."""
    vote: int = 0
    """Saves and finishes of an engine of several ranks: the ballot every rank votes on before
    any commits (:mod:`.votes`); 0 with one rank (committed at once)."""

    def blocks(self, j: int, per_chunk: int) -> range:
        """Indices into ``block_ids`` of the blocks of ``keys[j]``."""
        start = (self.first_chunk + j) * per_chunk
        n = self.tail_blocks if self.tail_blocks and j == len(self.keys) - 1 else per_chunk
        return range(start, start + n)

    def lacking(self, j: int, per_chunk: int) -> list[int]:
        """Indices into ``block_ids`` of the blocks of ``keys[j]`` that vLLM lacks (past
        ``skip_blocks``): what a load of that chunk fills."""
        return [i for i in self.blocks(j, per_chunk) if i >= self.skip_blocks]

    def lacking_ids(self, chunks: range, per_chunk: int) -> list[int]:
        """The block ids a load of ``keys[j]`` for each ``j`` in ``chunks`` fills. A load with no
        keys (one vLLM asked for that kvtier could not name) owes every block past
        ``skip_blocks``."""
        if not self.keys:
            return self.block_ids[self.skip_blocks :]
        return [self.block_ids[i] for j in chunks for i in self.lacking(j, per_chunk)]

    def all_blocks(self, per_chunk: int) -> list[int]:
        """The block ids of every chunk of the transfer."""
        return [self.block_ids[i] for j in range(len(self.keys)) for i in self.blocks(j, per_chunk)]


@dataclass
class Write:
    """A scheduled request computes the KV of tokens ``start..end`` this step, attending to
    every block in ``block_ids`` (its blocks up to ``end``).

    ``blocks`` may be the request's own block list, shared and not copied (a step costs no
    work in proportion to the context): the scheduler only ever appends to it, so its first
    ``nblocks`` stay what they were when the step was planned."""

    req_id: str
    blocks: list[int]
    start: int
    end: int
    nblocks: int | None = None
    """How many of ``blocks`` are the request's up to ``end`` (None: all of them)."""

    @property
    def block_ids(self) -> list[int]:
        """The request's blocks up to ``end`` (a copy, or with ``nblocks`` None ``blocks``
        itself; read only when a block is suspect)."""
        return self.blocks if self.nblocks is None else self.blocks[: self.nblocks]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    """Chunks to copy into vLLM's blocks before this step's forward pass reads them."""
    saves: list[Transfer] = field(default_factory=list)
    """Chunks whose KV this step's forward pass completes: saved layer by layer."""
    finishes: list[Transfer] = field(default_factory=list)
    """Chunks of finished requests (their blocks kept until saved): saved in the background,
    the request reported through ``get_finished`` when done."""
    writes: list[Write] = field(default_factory=list)
    verdicts: dict[int, bool] = field(default_factory=dict)
    """Ballot -> whether every rank voted to commit it (:mod:`.votes`): each rank then commits
    (True) or abandons (False) what it holds for it."""


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler half after a step (vLLM aggregates every rank's --
    each tensor- and pipeline-parallel rank -- and hands the result to
    ``update_connector_output``)."""

    unsaved: dict[str, int] = field(default_factory=dict)
    """Request -> the first chunk of a save this step planned but did not store (the daemon
    did not answer in time, or another writer was writing a chunk of it): the scheduler plans
    it again (the request's blocks still hold it)."""
    votes: dict[int, tuple[int, bool]] = field(default_factory=dict)
    """Ballot -> (ranks that voted, whether all of them voted to commit)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMeta:
        out = dict(self.unsaved)
        for rid, first in getattr(other, "unsaved", {}).items():
            out[rid] = min(first, out.get(rid, first))
        votes = dict(self.votes)
        for ballot, (n, ok) in getattr(other, "votes", {}).items():
            had_n, had_ok = votes.get(ballot, (0, True))
            votes[ballot] = (had_n + n, had_ok and ok)
        return KVTierWorkerMeta(out, votes)
