#!lua flags=no-writes
--[[ list_deliveries: one page of the delivery log, newest first, filtered.

KEYS[1]  index of verified deliveries   realm:{deliveries:log}:index
KEYS[2]  index of refused deliveries    realm:{deliveries:log}:refused

ARGV[1]  the records' key base (a record is the hash <base><id>)
ARGV[2]  cursor: the id the previous page ended at ('' = from the newest). Ids sort by
         time and never repeat, so the cursor names a position: deliveries recorded
         while a caller pages come before it and never shift a later page.
ARGV[3]  the oldest id to include ('' = no bound): --since
ARGV[4]  page size
ARGV[5]  how many ids one call may examine (bounded work under a filter)
ARGV[6]  path ('' = any)
ARGV[7]  status: '202', or a class '4xx' ('' = any)
ARGV[8]  outcome: a trigger outcome at least one trigger had ('' = any)

Both indexes are read and merged newest first, under any filter: a refused delivery's
triggers have outcomes too ('unverified').

Reply: {next cursor ('' = no more), summary JSON, ...}. A page may be short (or
empty) with a next cursor when the filter matched little of what was examined.
]]

local base = ARGV[1]
local hi = (ARGV[2] == '') and '+' or ('(' .. ARGV[2])
local lo = (ARGV[3] == '') and '-' or ('[' .. ARGV[3])
local limit, examine = tonumber(ARGV[4]), tonumber(ARGV[5])
local path, status, outcome = ARGV[6], ARGV[7], ARGV[8]

local function ids(index)
  return redis.call('ZRANGE', index, hi, lo, 'BYLEX', 'REV', 'LIMIT', 0, examine)
end
local a = ids(KEYS[1])
local b = ids(KEYS[2])

local function status_matches(s)
  if status == '' then return true end
  if string.sub(status, 2) == 'xx' then return string.sub(s, 1, 1) == string.sub(status, 1, 1) end
  return s == status
end

local out = {''}
local ia, ib, examined, last = 1, 1, 0, nil
while examined < examine and (ia <= #a or ib <= #b) do
  local id
  if ib > #b or (ia <= #a and a[ia] > b[ib]) then
    id = a[ia]; ia = ia + 1
  else
    id = b[ib]; ib = ib + 1
  end
  examined = examined + 1
  last = id
  local f = redis.call('HMGET', base .. id, 'p', 's', 'o', 'sum')
  if f[4] and (path == '' or f[1] == path) and status_matches(f[2])
      and (outcome == '' or string.find(f[3], ',' .. outcome .. ',', 1, true)) then
    out[#out + 1] = f[4]
    if #out - 1 == limit then
      -- A full page: a cursor only if something is left to read.
      if ia <= #a or ib <= #b or #a == examine or #b == examine then out[1] = id end
      return out
    end
  end
end
-- Stopped short of a full page: more may follow if ids are left unexamined, or if
-- either index gave all that was asked of it.
if last and (ia <= #a or ib <= #b or #a == examine or #b == examine) then out[1] = last end
return out
