"""Server-side bookkeeping of :mod:`kvtier.tiers.valkey`: Lua scripts that change the index,
the budget and the reservations atomically. Keys (``p`` = prefix, ``h`` = chunk key in hex):

- ``{p}:idx``   sorted set of committed chunks, score = write sequence (``{p}:seq``, INCR)
- ``{p}:meta``  hash h -> "<nbytes> <bytes charged>" of committed chunks
- ``{p}:used``  bytes charged to committed and reserved chunks
- ``{p}:resv``  sorted set of open reservations, score = deadline in ms (server clock)
- ``{p}:resvb`` hash h -> "<bytes charged> <reservation token>"

All of them carry the ``{p}`` hash tag, so each script runs on one slot, also in a cluster.
"""

import functools
import hashlib

from valkey.exceptions import NoScriptError


@functools.cache
def sha(script: str) -> str:
    """The name EVALSHA knows ``script`` by."""
    return hashlib.sha1(script.encode()).hexdigest()  # Valkey names scripts by SHA-1


def run(client, script: str, keys: list[str], args: list[object]):
    """Run a script by its hash; the server keeps it after the first EVAL."""
    try:
        return client.evalsha(sha(script), len(keys), *keys, *args)
    except NoScriptError:  # a server that never saw it, or restarted
        return client.eval(script, len(keys), *keys, *args)

# TIME may come before writes: scripts replicate their effects (the only mode of Valkey 7+).
# Shared head of RESERVE and PUT: KEYS[1..4] = used, resv, resvb, meta; ARGV[1..3] = hex, charge,
# capacity. Releases expired reservations (their writers died; the client deletes their bytes),
# then refuses a chunk that is committed or being written (-1) or does not fit (-2).
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local swept = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, m in ipairs(swept) do
  local v = redis.call('HGET', KEYS[3], m)
  if v then redis.call('DECRBY', KEYS[1], tonumber(string.match(v, '^(%d+)'))) end
  redis.call('HDEL', KEYS[3], m)
  redis.call('ZREM', KEYS[2], m)
end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 or redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return {-1, swept}
end
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return {-2, swept, tostring(used)} end
"""
RESERVE = _ADMIT + """
redis.call('INCRBY', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2] .. ' ' .. ARGV[5])
return {1, swept}
"""
# Standalone servers only (its keys span hash tags): a whole put in one step. KEYS[5..9] = idx,
# seq, the uploaded payload (a temporary name, expiring), the final header and payload names;
# ARGV[4] = nbytes, ARGV[5] = the header. Refused: the upload is dropped. -3: it is not there.
PUT = """
local function drop() redis.call('DEL', KEYS[7]) end
if redis.call('EXISTS', KEYS[7]) ~= 1 then return {-3, {}} end
""" + _ADMIT.replace("return {-1, swept}", "drop() return {-1, swept}").replace(
    "return {-2, swept, tostring(used)}", "drop() return {-2, swept, tostring(used)}") + """
redis.call('RENAME', KEYS[7], KEYS[9])
redis.call('PERSIST', KEYS[9])
redis.call('SET', KEYS[8], ARGV[5])
redis.call('INCRBY', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[5], redis.call('INCR', KEYS[6]), ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4] .. ' ' .. ARGV[2])
return {1, swept}
"""
# Shared head of PUBLISH and RELEASE: KEYS[1..2] = resv, resvb; ARGV[1..2] = hex, token. Ends
# the caller's own open reservation (0 if it has none: expired, or another writer's).
_END_RESERVATION = """
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not v then return 0 end
local charge, token = string.match(v, '^(%d+) (%S+)$')
if token ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
"""
PUBLISH = _END_RESERVATION + """
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[5]), ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3] .. ' ' .. charge)
return 1
"""
RELEASE = _END_RESERVATION + """
redis.call('DECRBY', KEYS[3], charge)
return 1
"""
UNINDEX = """
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not v then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[3], string.match(v, ' (%d+)$'))
return 1
"""
READ_RANGE = "return {redis.call('GET', KEYS[1]), redis.call('GETRANGE', KEYS[2], ARGV[1], ARGV[2])}"
