-- ARGV: prefix, node, reason, now. A node leaving, or one that is gone resolved by another
-- process: its samples not yet received are dropped with `reason`.
local b = books(ARGV[1])
local resolved = resolve_node(b, ARGV[2], 'drop', ARGV[3], ARGV[4])
flush(b)
return resolved
