#!lua flags=no-writes
--[[ list_deliveries: one page of the delivery log, newest first, filtered.

KEYS[1..] the records (strings; hashes from an earlier version) to examine, newest first: the caller read their ids
          from both indexes (realm:{deliveries:log}:index and :refused) below its
          cursor and above its --since bound, merged, at most as many as one call may
          examine (bounded work under a filter)    realm:{deliveries:log}:d:<id>

ARGV[1]  page size
ARGV[2]  path ('' = any)
ARGV[3]  status: '202', or a class '4xx' ('' = any)
ARGV[4]  outcome: a trigger outcome at least one trigger had ('' = any)

Every key is in KEYS, none is built here. A record gone since its id was read
(expired, trimmed) is skipped. Both indexes are read, under any filter: a refused
delivery's triggers have outcomes too ('unverified').

A record's head line gives the lengths of its path, status, outcomes and summary,
which follow it (gateway/deliveries/records.py pack_record): the first HEAD bytes of
a record hold them, unless its summary is long (many triggers), when it is read again
as far as they go. The compressed rest is never read here.

Reply: {how many of KEYS were examined, summary JSON, ...}. It stops at a full page;
the caller makes the cursor (the id of the last record examined) from the count.
]]

local HEAD = 1024

-- {path, status, outcomes, summary} of a record, or nil if it is gone.
local function fields(key)
  local got = redis.pcall('GETRANGE', key, 0, HEAD - 1)
  if type(got) == 'table' and got.err then
    if not string.find(got.err, 'WRONGTYPE', 1, true) then
      error(got)
    end
    return redis.call('HMGET', key, 'p', 's', 'o', 'sum')
  end
  if got == '' then
    return nil
  end
  local p, s, o, m = string.match(got, '^r1 (%d+) (%d+) (%d+) (%d+) %d+\n')
  if not p then
    return nil
  end
  local at = string.find(got, '\n', 1, true) + 1
  local lengths = {tonumber(p), tonumber(s), tonumber(o), tonumber(m)}
  local stop = at - 1 + lengths[1] + lengths[2] + lengths[3] + lengths[4]
  if stop > HEAD then
    got = redis.call('GETRANGE', key, 0, stop - 1)
  end
  local out = {}
  for i = 1, 4 do
    out[i] = string.sub(got, at, at + lengths[i] - 1)
    at = at + lengths[i]
  end
  return out
end

local limit = tonumber(ARGV[1])
local path, status, outcome = ARGV[2], ARGV[3], ARGV[4]

local function status_matches(s)
  if status == '' then return true end
  if string.sub(status, 2) == 'xx' then return string.sub(s, 1, 1) == string.sub(status, 1, 1) end
  return s == status
end

local out = {0}
for i = 1, #KEYS do
  local f = fields(KEYS[i])
  if f and f[4] and (path == '' or f[1] == path) and status_matches(f[2])
      and (outcome == '' or string.find(f[3], ',' .. outcome .. ',', 1, true)) then
    out[#out + 1] = f[4]
    if #out - 1 == limit then
      out[1] = i
      return out
    end
  end
end
out[1] = #KEYS
return out
