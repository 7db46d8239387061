#!lua
--[[ repoint: point an idempotency key at the newest run of its group (reconcile).

A compare-and-set: the pointer is written only if it still holds what the
caller read, so a start that moved the key meanwhile is never overwritten.

KEYS[1]  key pointer                     realm:{wf}:key:<key>
KEYS[2]  runs of this key (zset)         realm:{wf}:keyruns:<key>
KEYS[3]  run hash to point at            realm:{wf}:run:<id>

ARGV[1] run id the pointer held when read ('' = no pointer)   ARGV[2] run id to point at

Reply: {outcome}
  written   the pointer now names ARGV[2], with its phase, step and fingerprint;
            it expires with the run if the run has ended, never if it is live
  moved     the pointer no longer holds ARGV[1]: left as it is
  gone      the run to point at has expired meanwhile: nothing written
]]

local pointer, keyruns, run_key = KEYS[1], KEYS[2], KEYS[3]
local expected, run_id = ARGV[1], ARGV[2]

local held = redis.call('HGET', pointer, 'run') or ''
if held ~= expected then
  return {'moved'}
end
local run = redis.call('HMGET', run_key, 'phase', 'step', 'fp')
if not run[1] then
  return {'gone'}
end
redis.call('DEL', pointer)
redis.call('HSET', pointer, 'run', run_id, 'phase', run[1], 'step', run[2] or '',
  'fp', run[3] or '')
local ttl = redis.call('PTTL', run_key)
if ttl > 0 then
  redis.call('PEXPIRE', pointer, ttl)
  redis.call('PEXPIRE', keyruns, ttl)
else
  redis.call('PERSIST', keyruns)
end
return {'written'}
