"""The ledger's Lua scripts: each runs atomically inside Redis, so no two writers interleave.

Keys are built inside the scripts from the run prefix (ARGV[1]), so these assume one Redis
server, not a cluster. Every script is safe to run twice with the same arguments (a client that
retries after a dropped connection must not take a second credit or train a sample twice), and
every writing script answers a repeat exactly as it answered the first call: `exactly_once` keeps
the reply under the call's own key (KEYS[1], one per call) for `REPLY_TTL_S`. Without that, a
retried `TRANSITION` whose first reply was lost would report its samples as refused (they moved
the first time), and the learner would never train them.

Key layout under the prefix `streamrl:{run}:`:
  meta            hash   capacity, max_staleness, groups_per_step, finished (time the run ended)
  version         string current policy version
  versions        hash   version -> JSON {"step", "time"}
  rollbacks       list   JSON {"from", "to", "samples", "time"} per roll_back
  learner         hash   incarnation, control_addr, trajectory_addr, time (the learner now serving the run)
  inflight        string groups holding a credit (taken, not every sample resolved)
  held            string credits the learner holds for the places of groups it gave up, until their steps end
  counts          hash   total, admitted, generated, received, trained, dropped, dropped:<reason>
  lag             hash   staleness (versions) at training -> samples
  s:<sample_id>   hash   node, group, state, v_adm, v, vmin, v_trn, t_adm, t_gen, t_rcv, t_end
  g:<group_id>    hash   node, n, open (samples not yet resolved), prompt, t
  ng:<node_id>    set    groups of the node holding a credit
  adm / admseq    zset   groups holding a credit, by admission order (the learner trains them in it)
  server          hash   run_id, since: the Redis server the reaper last saw, and when (a restart pauses it)
  tv:<version>    set    samples trained by that policy version (what a roll-back undoes)
  nodes / lost    set    nodes seen alive / nodes reaped or gone
  alive:<node_id> string heartbeat, expires after the TTL
  orphans         list   groups of lost nodes waiting for another node (on_node_lost = readmit)
  rq:<call id>    string a writing call's reply, kept REPLY_TTL_S for its retries
"""

from importlib import resources

REPLY_TTL_S = 600  # longer than any retry (ledger.retry_s is at most 300 s)


def exactly_once(body: str) -> str:
    """`body` as a script whose reply is kept under KEYS[1]: a repeat of the call returns it unchanged.

    Error replies are not kept (a repeat re-checks). The reply goes through cjson, so it must be
    an integer or a flat array of integers and strings, which every ledger reply is.
    """
    return (
        "local kept = redis.call('GET', KEYS[1])\n"
        "if kept then return cjson.decode(kept) end\n"
        "local function body()\n" + body + "\nend\n"
        "local out = body()\n"
        "if type(out) == 'table' and out.err then return out end\n"
        f"redis.call('SET', KEYS[1], cjson.encode(out), 'EX', {REPLY_TTL_S})\n"
        "return out\n"
    )


# The bodies are package files (lua/NAME.lua); a script is its helpers pasted in front of its body.
_HELPERS = {
    "TAKE_CREDIT": (),
    "TRANSITION": ("resolve",),
    "REAP": ("resolve", "resolve_node"),
    "LEAVE": ("resolve", "resolve_node"),
    "CLAIM_ORPHAN": (),
    "PUBLISH_VERSION": (),
    "ROLL_BACK": ("resolve", "groups_in_flight"),
    "DROP_RECEIVED": ("resolve", "groups_in_flight"),
    "IN_FLIGHT": ("groups_in_flight",),
}
_LUA = resources.files(__package__) / "lua"


def _load(name: str) -> str:
    parts = [*_HELPERS[name], name.lower()]
    return "".join((_LUA / f"{part}.lua").read_text() for part in parts)


TAKE_CREDIT = _load("TAKE_CREDIT")
TRANSITION = _load("TRANSITION")
REAP = _load("REAP")
LEAVE = _load("LEAVE")
CLAIM_ORPHAN = _load("CLAIM_ORPHAN")
PUBLISH_VERSION = _load("PUBLISH_VERSION")
ROLL_BACK = _load("ROLL_BACK")
DROP_RECEIVED = _load("DROP_RECEIVED")
IN_FLIGHT = _load("IN_FLIGHT")
