"""kvtier's exceptions: one base class, so that a caller can catch everything kvtier raises.

Setup errors (a bad config, an unwritable directory) are ``ValueError``/``TypeError`` as well,
so that ``except ValueError`` keeps working; errors of the I/O path (a tier that is full, a
daemon that is down, a lease that was lost) are turned into cache misses by the store and the
daemon client and reach a caller only through the low-level APIs that document them.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every exception kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, of the wrong type or out of range (the message names
    the field)."""


class TierFullError(KVTierError):
    """The tier has no room for the entry now; evict something and try again."""


class TierUnavailableError(TierFullError):
    """A remote tier's server is down or unreachable: nothing can be written now, and evicting
    would not help (a TierFullError, so that callers that only know "no room now" back off)."""


class EntryPinnedError(KVTierError):
    """The entry is pinned by a reader and cannot be deleted now."""


class EntryExistsError(KVTierError, ValueError):
    """The key is already stored or being written (by this process or another)."""


class DaemonUnavailable(KVTierError):
    """The store daemon cannot be reached, refused this client, or answered an error; the
    client serves the request as a cache miss."""


class LeaseLost(DaemonUnavailable):
    """A lease (pins or reservations held through the daemon) ended before its holder ended it:
    the connection broke, timed out, or the daemon restarted. What was read under it is not to
    be trusted and what was written is not stored."""
