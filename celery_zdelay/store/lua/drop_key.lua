-- Forget a key's owner that a producer found forged: its entry's signed
-- message does not carry the key (zdelay_signing_key). Only if the owner
-- is still the one checked, so an owner written meanwhile stays.
--
-- KEYS[1] marks hash    (see _marks.lua)
-- ARGV[1] key
-- ARGV[2] the owner value checked
-- returns 1 when it was dropped, else 0
local marks, key, checked = KEYS[1], ARGV[1], ARGV[2]
zdelay_expect(marks, 'hash')
if redis.call('HGET', marks, 'k:' .. key) ~= checked then return 0 end
zdelay_t_key_free(marks, 'k:' .. key)
return 1
