"""cost's window: chunks the queued requests need wait outside its heap; the victim must be the one a plain scan picks."""

import heapq
import random

import pytest

from kvtier.core.policies.cost import FRESH, CostPolicy


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


class ScanCost(CostPolicy):
    """The victim as a scan of the heap, setting needed chunks aside (the rule, plainly)."""

    def victim(self, evictable):
        heap, resident, window = self._heap, self._resident, self._window
        self._pressed = True
        aside, found, needed = [], None, []
        while heap:
            entry = heapq.heappop(heap)
            key = entry[3]
            if resident.get(key) != entry[0]:
                continue
            aside.append(entry)
            if not evictable(key):
                continue
            need = window.next_need(key)
            if need is None:
                found = key
                if entry[0] != FRESH:
                    self._inflation = max(self._inflation, entry[0])
                break
            needed.append((need, key))
        if found is None and needed:
            _, found = max(needed, key=lambda n: n[0])
        for entry in aside:
            heapq.heappush(heap, entry)
        return found


@pytest.mark.parametrize("seed", range(8))
def test_cost_holds_needed_chunks_aside_and_picks_the_victim_a_scan_picks(seed):
    rng = random.Random(seed)
    fast, scan = CostPolicy(), ScanCost()
    fast.FAR_SLACK = 0  # rebuild the farthest-needed heap as soon as stale entries pile up
    held, pinned = [], set()
    queued = served = 0
    for _ in range(4000):
        op = rng.random()
        both = (fast, scan)
        if op < 0.25:
            key, position = k(rng.randrange(60)), rng.randrange(4)
            for p in both:
                p.insert(key, position)
            if key not in held:
                held.append(key)
        elif op < 0.45 and held:
            keys = rng.sample(held, rng.randint(1, min(6, len(held))))
            use = rng.choice([None, served])
            for p in both:
                p.touch(keys, use=use)
        elif op < 0.55 and held:
            key = held.pop(rng.randrange(len(held)))
            pinned.discard(key)
            for p in both:
                p.remove(key)
        elif op < 0.7:
            queued += 1
            seq = queued if rng.random() < 0.8 else rng.randint(1, queued)
            keys = [k(rng.randrange(70)) for _ in range(rng.randint(1, 5))]
            for p in both:
                p.hint(seq, keys)
        elif op < 0.78:
            served = rng.randint(served + 1, max(served, queued) + 2)
            for p in both:
                p.begin(served, now=0.0)
        elif op < 0.85 and held:
            pinned ^= {rng.choice(held)}
        elif op < 0.87:  # the structure: held chunks are resident and needed, _far stays bounded
            for key in fast._held:
                assert key in fast._resident and fast._window.next_need(key) is not None
            assert len(fast._far) <= 4 * len(fast._held) + 6  # one begin's pushes past a trim
        else:
            ok = (frozenset(held) - pinned).__contains__
            a, b = fast.victim(ok), scan.victim(ok)
            assert a == b
            if a is not None and rng.random() < 0.7:
                held.remove(a)
                pinned.discard(a)
                for p in both:
                    p.remove(a)
    while held:
        a, b = fast.victim(lambda key: True), scan.victim(lambda key: True)
        assert a == b and a is not None
        held.remove(a)
        for p in (fast, scan):
            p.remove(a)
