"""The sections of how a run's parts reach each other: the ledger (`[ledger]`: Redis, admission and staleness),
the sample stream (`[transport]`: ZeroMQ between nodes and the learner) and the weight push (`[weights]`)."""

from __future__ import annotations

from typing import Annotated, Literal

from streamrl.engine.config.base import _doc, _Section


class LedgerConfig(_Section):
    url: Annotated[
        str,
        _doc(
            "Redis URL (redis://, rediss:// with TLS, password in the URL). "
            "Empty: an embedded server in the run folder."
        ),
    ] = ""
    max_staleness: Annotated[int, _doc("Oldest policy lag (versions) a trained sample may have.", ge=0)] = 1
    heartbeat_ttl_s: Annotated[float, _doc("A node silent this long is lost.", gt=0.0)] = 15.0
    on_node_lost: Annotated[Literal["drop", "readmit"], _doc("What becomes of a lost node's in-flight samples.")] = (
        "drop"
    )
    connect_retries: Annotated[int, _doc("Connection attempts (with backoff) before failing.", ge=1)] = 5
    retry_s: Annotated[
        float,
        _doc(
            "How long a ledger call keeps retrying (with backoff) while Redis cannot be reached, "
            "e.g. a server restarting from its append-only file; then the role stops with an error "
            "naming the server.",
            gt=0.0,
            le=300.0,
        ),
    ] = 30.0
    allow_plaintext: Annotated[
        bool,
        _doc(
            "Allow a redis:// (no TLS) url beyond loopback: its password and every record then cross the "
            "network in clear. Leave false and use rediss:// unless the network is the run's alone."
        ),
    ] = False

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained sample's oldest token may lag the policy that trains it; the one
        bound every staleness check reads, in both modes.

        `Ledger.drop_stale`, when the learner takes a group for a step, guarantees it: it judges against
        the version that trains the group. The others only save work: the admission script (its run meta,
        written by `Ledger.init_run`) refuses a group the queue ahead would make stale, and
        `Ledger.receive` drops what arrives stale already. In sync mode the admission takes only the
        learner's newest weights, one step's groups at a time, so only a group a step left behind can
        reach the bound."""
        return self.max_staleness

    def admitted_groups(self, groups_per_step: int, mode: str) -> int:
        """The most groups the ledger lets every node together hold at once (its admission capacity, which
        `Ledger.init_run` records and engine/placement.py sizes vLLM nodes by): one step's groups in sync
        mode, else `staleness_bound + 1` steps' (auto: what no preflight resolved runs async)."""
        return groups_per_step if mode == "sync" else (self.staleness_bound + 1) * groups_per_step


class TransportConfig(_Section):
    host: Annotated[
        str, _doc("Address the learner's control and trajectory sockets bind; beyond loopback needs curve.")
    ] = "127.0.0.1"
    curve: Annotated[
        bool,
        _doc(
            "Encrypt and authenticate the control and trajectory sockets with ZMQ CURVE: only nodes whose "
            "key the learner allows can connect, and only they get the ledger's credentials. On by default "
            "(`streamrl run` makes the run's keys); off, any local process can connect and nodes need "
            "ledger.url themselves. Required when transport.host or weights.store_host is beyond loopback."
        ),
    ] = True
    keys: Annotated[
        str,
        _doc(
            "Folder of CURVE keys made by `streamrl keys DIR`: the learner reads server.key_secret and "
            "authorized/*.key, a node server.key and node.key_secret. Empty with curve on: RUN/keys, made "
            "by the learner (every role on one host)."
        ),
    ] = ""
    trajectory_port: Annotated[int, _doc("Trajectory PULL port; 0 picks a free one.", ge=0, le=65535)] = 0
    control_port: Annotated[
        int, _doc("Control (register, weights-ready, stop) port; 0 picks a free one.", ge=0, le=65535)
    ] = 0
    hwm: Annotated[int, _doc("Messages queued per socket before a sender blocks (backpressure).", ge=1)] = 1000
    send_timeout_s: Annotated[float, _doc("A send blocked this long fails, naming the peer.", gt=0.0)] = 60.0
    recv_timeout_s: Annotated[float, _doc("A control reply slower than this fails, naming the peer.", gt=0.0)] = 30.0
    max_frame_mb: Annotated[
        float,
        _doc(
            "Largest message a socket accepts, in MiB (ZMQ drops the connection of a peer that sends "
            "a bigger one before reading it); a node refuses to send one. A trajectory of 500k tokens "
            "is about 12 MiB.",
            gt=0.0,
        ),
    ] = 16.0
    fault_log_interval_s: Annotated[
        float,
        _doc(
            "Undecodable frames, duplicates and gaps are counted per sender and logged as one summary "
            "line per sender at most this often.",
            gt=0.0,
        ),
    ] = 60.0


class WeightsConfig(_Section):
    backend: Annotated[
        Literal["auto", "gloo", "nccl"],
        _doc(
            "auto: each node's path from where it runs (CUDA IPC on the learner's GPU, shared memory on its "
            "machine's CPU, else an NCCL or gloo broadcast); gloo or nccl: that broadcast for every node."
        ),
    ] = "auto"
    bucket_mb: Annotated[float, _doc("Flat bucket size in MiB.", gt=0.0)] = 256.0
    timeout_s: Annotated[
        float, _doc("Deadline of each phase (rendezvous, layout, bucket, apply); a node past it is evicted.", gt=0.0)
    ] = 60.0
    store_host: Annotated[
        str,
        _doc(
            "Address learner rank 0's weight rendezvous (TCPStore) binds and nodes reach it at; loopback "
            "unless nodes run on other hosts (then transport.curve must be on).",
            min_length=1,
        ),
    ] = "127.0.0.1"
    fetch_after: Annotated[
        int, _doc("Nodes on the learner's machine with a weights link each (a thread, a store); later ones "
                  "share one thread and store that tell them each version to copy (learner/shared_fetch.py)", ge=0)
    ] = 8  # fmt: skip
    relay_fanout: Annotated[
        int, _doc("Nodes on a broadcast path (gloo, NCCL) the learner sends each version itself; every later one "
                  "gets it relayed by a node that has it, at most this many children a node "
                  "(learner/relay_tree.py); each node in the tree holds one more copy of the weights (on its GPU "
                  "on NCCL, counted in its memory plan). 0 (off): a link from the learner to every node; 8 for a "
                  "pool of nodes on other hosts past ~32", ge=0, le=64)
    ] = 0  # fmt: skip
