#!lua flags=no-writes
--[[ list_deliveries: one page of the delivery log, newest first, filtered.

KEYS[1..] the records (hashes) to examine, newest first: the caller read their ids
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

Reply: {how many of KEYS were examined, summary JSON, ...}. It stops at a full page;
the caller makes the cursor (the id of the last record examined) from the count.
]]

local limit = tonumber(ARGV[1])
local path, status, outcome = ARGV[2], ARGV[3], ARGV[4]

local function status_matches(s)
  if status == '' then return true end
  if string.sub(status, 2) == 'xx' then return string.sub(s, 1, 1) == string.sub(status, 1, 1) end
  return s == status
end

local out = {0}
for i = 1, #KEYS do
  local f = redis.call('HMGET', KEYS[i], 'p', 's', 'o', 'sum')
  if f[4] and (path == '' or f[1] == path) and status_matches(f[2])
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
