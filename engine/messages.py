"""Every wire message of streamrl, and their typed msgpack codecs.

Two streams cross the network:
- the trajectory stream (rollout PUSH -> learner PULL): `Trajectory`, one per completion, followed by a
  second ZMQ frame, its signature under the node's secret (`engine/auth.py`);
- the control channel (rollout DEALER <-> learner ROUTER): the `Control` union below.

Structs are `array_like` (compact: field order is the schema) and `gc=False` (they hold no
cycles). Decoding is always typed; a frame that does not decode, or decodes into something that
breaks an invariant, raises `DecodeError` and nothing else, so callers count it and move on.
No pickle anywhere.
"""

from __future__ import annotations

from typing import Any

import msgspec


class DecodeError(Exception):
    """A frame that is not a valid message of the expected type. Count it, drop it, carry on."""


class _Wire(msgspec.Struct, array_like=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    pass


class Timings(_Wire):
    """Wall-clock seconds (time.time()) of a sample's life on the rollout node."""

    submitted: float = 0.0  # request handed to the engine
    finished: float = 0.0  # last token generated
    rewarded: float = 0.0  # reward computed, about to be sent


class Trajectory(_Wire):
    """One completion with everything the learner needs, as token ids (never re-tokenized text)."""

    sample_id: str  # globally unique; the ledger's key
    group_id: str  # samples of one prompt share it; advantages are relative within a group
    node_id: str
    seq: int  # per-node message number, contiguous from 0: the learner detects gaps and duplicates
    prompt_ids: list[int]
    completion_ids: list[int]
    behavior_logprobs: list[float]  # log mu(token) under the sampling policy, one per completion token
    reward: float | None  # None: the reward failed; the learner drops the sample as reward_error
    policy_version: int  # version of the weights that sampled the first completion token
    token_versions: list[int] = []  # per completion token, only when the weights changed mid-sample
    finish_reason: str = "length"  # "stop" (eos/stop token), "length" (max_tokens); episodes: see rollout/envs
    group_size: int = 1  # how many samples the group has in all
    timings: Timings = msgspec.field(default_factory=Timings)
    # Multi-turn episodes (rollout/envs): 1 on tokens the model sampled, 0 on tokens the environment
    # added (observations, chat-template turn markers); the completion starts with the model's first
    # turn. Empty: every completion token is the model's (single-turn frames are unchanged).
    # On a 0 token behavior_logprobs is 0.0 and token_versions repeats the model token before it, so
    # min_version is the oldest model token's; the learner must leave 0 tokens out of the loss, the
    # importance ratios and every token count (they are context only, like the prompt).
    loss_mask: list[int] = []
    # Multi-turn episodes: model turns (0: a single-turn sample), and the tool calls the episode made, of
    # them failed (the tool raised, was unknown or the call malformed) and timed out (env.tool_timeout_s).
    turns: int = 0
    tool_calls: int = 0
    tool_failed: int = 0
    tool_timeouts: int = 0
    # Why `reward` is None: the failing reward and its first error, e.g. "my.py:f: ValueError: ..." (the
    # learner stops a run whose reward fails on nearly every sample, naming it).
    reward_error: str = ""

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.behavior_logprobs) != n:
            raise ValueError(f"{len(self.behavior_logprobs)} behavior_logprobs for {n} completion tokens")
        if self.token_versions and len(self.token_versions) != n:
            raise ValueError(f"{len(self.token_versions)} token_versions for {n} completion tokens")
        if self.loss_mask and (len(self.loss_mask) != n or not set(self.loss_mask) <= {0, 1} or self.loss_mask[0] != 1):
            raise ValueError(
                f"loss_mask must hold one 0 or 1 per completion token ({n}, got {len(self.loss_mask)}) "
                "and start with a model token (1)"
            )
        if not self.prompt_ids:
            raise ValueError("empty prompt_ids")
        if self.seq < 0 or self.policy_version < 0 or self.group_size < 1:
            raise ValueError("seq, policy_version must be >= 0 and group_size >= 1")

    @property
    def min_version(self) -> int:
        """The oldest policy version any token of this sample came from (what staleness is measured on)."""
        return min(self.token_versions) if self.token_versions else self.policy_version

    @property
    def model_tokens(self) -> int:
        """Completion tokens the model sampled: what the loss is over and what token counts count."""
        return sum(self.loss_mask) if self.loss_mask else len(self.completion_ids)

    @property
    def max_version(self) -> int:
        """The newest policy version any token of this sample came from."""
        return max(self.token_versions) if self.token_versions else self.policy_version


# ---- control channel -------------------------------------------------------------------------


class Register(_Wire, tag="register"):
    """Node -> learner: a node joins. Answered by `Welcome`."""

    node_id: str
    host: str  # where the node runs (for logs and eviction messages)
    device: str = "cpu"
    backend: str = "vllm"
    # Where exactly, so the learner can pick the weights' path (engine/weights/paths.py): same machine and
    # same GPU as learner rank 0 means memory shared between the two processes, anything else a collective.
    boot_id: str = ""  # the kernel's boot id: one machine, beyond a hostname that containers may share
    gpu_uuid: str = ""  # the GPU's UUID when device is CUDA: one GPU, whatever CUDA_VISIBLE_DEVICES numbers it
    relays: bool = False  # its receiver runs in this process, so it can forward each version to other nodes


class Welcome(_Wire, tag="welcome"):
    """Learner -> node: accepted; where the trajectory stream and the ledger are. It carries credentials
    (the ledger's password in `redis_url`, the node's `secret`), so it is only ever sent over CURVE or
    loopback."""

    node_id: str
    trajectory_addr: str
    redis_url: str
    run_name: str
    policy_version: int
    secret: bytes = b""  # this node's alone: it signs every trajectory frame the node sends (engine/auth.py)
    weights_path: str = ""  # how its weights come (engine/weights/paths.py); shm, cuda_ipc: the learner's device


class Heartbeat(_Wire, tag="heartbeat"):
    """Node -> learner: alive, and how far it got."""

    node_id: str
    policy_version: int
    in_flight: int = 0
    tokens_generated: int = 0
    generate_s: float = 0.0  # seconds the engine spent generating since the node started
    idle_s: float = 0.0  # seconds it had nothing to generate
    swap_s: float = 0.0  # seconds generation was paused to swap weights in
    peak_gib: float = 0.0  # the node process's peak CUDA memory allocated through torch (0 on CPU)


class TensorSpec(_Wire):
    name: str  # HF checkpoint name, as `reload_weights` expects
    shape: list[int]
    offset: int  # element offset inside its bucket
    numel: int


class BucketSpec(_Wire):
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16"
    numel: int
    tensors: list[TensorSpec]


class SharedBucket(_Wire):
    """Where one packed bucket lies in memory the learner shares with a node of its machine.

    `key` names the buffer for the node's cache of opened buffers (each is opened once, and a new key
    means a new buffer). Shared memory: `path` is a file the node maps (`/proc/<learner pid>/fd/<fd>` of
    a memfd). CUDA IPC: `cuda` is torch's `_share_cuda_()` of the buffer's storage (device, handle, size,
    offset, ref counter handle, ref counter offset, event handle, event sync required)."""

    key: str
    path: str = ""
    cuda: tuple[int, bytes, int, int, bytes, int, bytes, bool] | None = None


class AdapterSpec(_Wire):
    """A LoRA adapter's shape (engine/lora.py): a push that carries one holds its A and B tensors alone,
    under PEFT's saved names, and the node serves the version as its own adapter."""

    rank: int
    alpha: float
    target_modules: list[str]  # resolved module names (q_proj, ...), never 'all-linear'

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.target_modules:
            raise ValueError(f"adapter rank {self.rank} with targets {self.target_modules}: rank >= 1 and targets")


class WeightsReady(_Wire, tag="weights_ready"):
    """Learner -> node: a new policy is packed; receive it (a collective, or a copy from shared memory)."""

    version: int
    store_host: str  # TCPStore rendezvous of this node's weight group (shared paths: where the copy is confirmed)
    store_port: int
    group_prefix: str  # unique per transfer group, so a failed group is never reused
    world_size: int  # learner rank 0 + the node's receivers
    timeout_s: float
    buckets: list[BucketSpec]
    # "gloo" (CPU buffers) or "nccl" (buffers on the receiver's GPU): a broadcast; "shm" (CPU) or "cuda_ipc"
    # (the learner's GPU): the node copies each bucket from `shared`
    backend: str = "gloo"
    shared: list[SharedBucket] = []  # one per bucket, on the shared paths
    packed_event: bytes = b""  # cuda_ipc: IPC handle of an event that completes once the buckets are packed
    adapter: AdapterSpec | None = None  # LoRA: the buckets hold this adapter of `version`, not the full weights

    def __post_init__(self) -> None:
        if self.backend in ("shm", "cuda_ipc") and len(self.shared) != len(self.buckets):
            raise ValueError(f"{len(self.shared)} shared buffers for {len(self.buckets)} buckets ({self.backend})")


class WeightsApplied(_Wire, tag="weights_applied"):
    """Node -> learner: the weights of `version` are live in the engine."""

    node_id: str
    version: int
    seconds: float  # receive + apply time on the node
    error: str = ""  # non-empty: the transfer failed on the node, with why


class RelayTo(_Wire, tag="relay_to"):
    """Learner -> node: forward each version you receive to these nodes (all of them; [] stops relaying).
    `versions[i]` is what `children[i]` holds already: it is sent only newer ones."""

    children: list[str]
    versions: list[int]

    def __post_init__(self) -> None:
        if len(self.children) != len(self.versions):
            raise ValueError(f"{len(self.children)} children for {len(self.versions)} versions")


class Relayed(_Wire, tag="relayed"):
    """Node -> learner: this node's layout for `child` (its own store and group); the learner hands it on."""

    node_id: str
    child: str
    ready: WeightsReady


class Stop(_Wire, tag="stop"):
    """Either way: stop. From the learner: the run is over or the node was evicted."""

    reason: str


class Goodbye(_Wire, tag="goodbye"):
    """Node -> learner: leaving cleanly (its in-flight samples are already resolved in the ledger)."""

    node_id: str
    reason: str


class Probe(_Wire, tag="probe"):
    """Learner -> node: nothing to do. Sent only to learn whether the node's connection is still open: the
    learner's ROUTER fails a send to a peer whose connection closed (a killed process), at once."""


Control = Register | Welcome | Heartbeat | WeightsReady | WeightsApplied | Stop | Goodbye | Probe | RelayTo | Relayed


# ---- codecs ----------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_trajectory_decoder = msgspec.msgpack.Decoder(Trajectory)
_control_decoder = msgspec.msgpack.Decoder(Control)


def encode(message: Trajectory | Control) -> bytes:
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview):
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError, MemoryError) as e:
        raise DecodeError(f"{type(e).__name__}: {e}") from None


def decode_trajectory(frame: bytes | memoryview) -> Trajectory:
    return _decode(_trajectory_decoder, frame)


def decode_control(frame: bytes | memoryview) -> Control:
    return _decode(_control_decoder, frame)


# ---- reward pool (rollout process <-> its own reward worker processes, over a local pipe) ----


class RewardCall(_Wire, tag="reward_call"):
    """Parent -> reward worker: call function `fn_index` of the worker's spec list on one batch."""

    call_id: int
    fn_index: int
    prompts: list[str]
    completions: list[str]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]  # TRL style: one list per dataset column, one value per sample


class RewardResult(_Wire, tag="reward_result"):
    """Reward worker -> parent: one value per sample (None where the reward failed)."""

    call_id: int
    values: list[float | None]
    errors: int = 0  # samples whose reward raised or returned a non-finite / non-number value
    traceback: str = ""  # the first failure's traceback in this call
    fell_back: bool = False  # the batch call raised and each sample was scored alone (rewards/call.py)


class RewardReady(_Wire, tag="reward_ready"):
    """Reward worker -> parent: functions loaded, ready for calls (or `error` says why not)."""

    pid: int
    error: str = ""


class RewardStop(_Wire, tag="reward_stop"):
    """Parent -> reward worker: exit."""


RewardToWorker = RewardCall | RewardStop
RewardFromWorker = RewardReady | RewardResult


# ---- tool pool (rollout process <-> its own tool worker processes, over a local pipe) ----------


class ToolSchema(_Wire):
    """A tool as the chat template shows it to the model (OpenAI function format, `tools=` of the template)."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object


class ToolReady(_Wire, tag="tool_ready"):
    """Tool worker -> parent: tools loaded (their schemas), or `error` says why not."""

    pid: int
    tools: list[ToolSchema] = []
    error: str = ""


class ToolCall(_Wire, tag="tool_call"):
    """Parent -> tool worker: call tool `name` with keyword `arguments` (parsed from the model's tool call)."""

    call_id: int
    name: str
    arguments: dict[str, Any]


class ToolResult(_Wire, tag="tool_result"):
    """Tool worker -> parent: the tool's output as text, or `error` (the exception, for the model to read)."""

    call_id: int
    output: str = ""
    error: str = ""


class ToolStop(_Wire, tag="tool_stop"):
    """Parent -> tool worker: exit."""


ToolToWorker = ToolCall | ToolStop
ToolFromWorker = ToolReady | ToolResult
