"""A request's chunk keys as the scheduler half computes them: its token ids, chained with what
else makes its KV (its ``cache_salt``, LoRA adapter and images, and the cache epoch)."""

from __future__ import annotations

from kvtier.core.keys import ROOT_KEY, ChunkKey, chunk_tokens_of, image_extras, tail_key
from kvtier.core.request_extras import request_head, tagged
from kvtier.engines.vllm.request_state import _Tracked


class RequestKeys:
    """:class:`~.scheduler.SchedulerSide`'s keys (a mixin: its state is the scheduler half's,
    set up in ``SchedulerSide.__init__``)."""

    def _extra(self, request, span: tuple[int, int] | None = None) -> dict[int, bytes] | None:  # type: ignore[no-untyped-def]
        """What besides token ids makes a request's KV, as vLLM's own block hashes have it,
        chained into the keys: its ``cache_salt`` and LoRA adapter (name and path; into the first
        chunk's key, so into every key) and the content hash of each image (into the chunks its
        placeholder tokens lie in; with ``span``, only of the images within those tokens -- a
        partial chunk's). Each field is length-prefixed, so no two sets of them read alike."""
        extras: dict[int, bytes] = {}
        lora = getattr(request, "lora_request", None)
        head = request_head(salt=getattr(request, "cache_salt", None), epoch=self.epoch,
                            lora=None if lora is None else (str(getattr(lora, "lora_name", lora)),
                                                            str(getattr(lora, "lora_path", ""))))
        if head:
            extras[0] = head
        spans = []
        for f in getattr(request, "mm_features", None) or ():
            lo, hi = f.mm_position.offset, f.mm_position.offset + f.mm_position.length
            if span is not None:
                lo, hi = max(lo, span[0]), min(hi, span[1])
            if lo < hi:
                spans.append((lo, hi, tagged(b"image", f.identifier).hex()))
        for i, more in image_extras(spans, self.chunk).items():
            extras[i] = extras.get(i, b"") + more
        return extras or None

    def _full_keys(self, request, tokens: list[int]) -> list[ChunkKey]:  # type: ignore[no-untyped-def]
        return chunk_tokens_of(tokens, self.client.namespace(), self.chunk, self._extra(request)).keys

    def _tail_key(self, request, keys: list[ChunkKey], tokens: list[int], chunk: int, blocks: int) -> ChunkKey:  # type: ignore[no-untyped-def]
        parent = keys[chunk - 1] if chunk else ROOT_KEY
        start = chunk * self.chunk
        extra = (self._extra(request, (start, start + blocks * self.block_size)) or {}).get(chunk)
        return tail_key(parent, self.client.namespace(), tokens[start : start + blocks * self.block_size], extra)

    def _keys_of(self, tr: _Tracked, chunks: int) -> list[ChunkKey]:
        """The keys of the request's first ``chunks`` chunks -- only ever of tokens whose KV is
        computed (a token sampled but not yet computed may still be replaced)."""
        if len(tr.keys) < chunks:
            tokens = list(tr.request.all_token_ids)  # type: ignore[attr-defined]
            tr.keys = self._full_keys(tr.request, tokens[: chunks * self.chunk])
        return tr.keys[:chunks]
