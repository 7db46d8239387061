#!lua flags=allow-oom
--[[ ingress: may one more delivery to a webhook path come in now? (GCRA)

KEYS[1]  the path's theoretical arrival time (a string: server time in µs)
                                          realm:ingress:{/hooks/github}
ARGV[1]  the emission interval in µs: the period over the rate's count, rounded up
ARGV[2]  burst: how many deliveries may arrive at once

Reply: 0, admitted and counted; else the µs until one more would be (nothing written).

The generic cell rate algorithm keeps one number per path: the time at which the
path would be idle again had every admitted delivery come at the steady rate. A
delivery is admitted while that time is less than burst intervals ahead of now, and
moves it one interval on. So a full burst passes at once, then one delivery per
interval, and a refused one costs nothing. Time is the server's (TIME), so every
gateway process, whatever its clock, counts against the same line. The key expires
when the path is idle again: an absent key is a full burst.

allow-oom: the key is one small string per limited path and is rewritten in place;
a Redis at maxmemory is exactly when a flood must still be held back, and refusing
the call would only let it through (the caller fails open).
]]

local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local _, now = server_time()

local tat = tonumber(redis.call('GET', KEYS[1]) or '') or now
if tat < now then
  tat = now
end
local next_tat = tat + interval
local allowed_at = next_tat - burst * interval
if now < allowed_at then
  return allowed_at - now
end
-- '%.0f': tostring would write a µs time (16 digits) in 14 significant ones.
redis.call('SET', KEYS[1], string.format('%.0f', next_tat),
           'PX', math.ceil((next_tat - now) / 1000))
return 0
