-- Which command of a script this ACL user may not run. Redis checks a
-- script's commands as it calls them, and a refusal after the script's
-- first write would leave that write done: so the store asks this once per
-- script and client, before the script first runs (Store.ensure_allowed).
--
-- KEYS[1] a key the script names (EVALSHA itself checks the user's keys)
-- ARGV[1..] the names of the commands the script calls
-- returns the first command refused, or "" when none is (and on Redis
--         before 7, which has no redis.acl_check_cmd to ask)
if not redis.acl_check_cmd then return '' end
for i = 1, #ARGV do
  if not redis.acl_check_cmd(ARGV[i], KEYS[1]) then return ARGV[i] end
end
return ''
