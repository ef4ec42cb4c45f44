"""Weight bucket layout: which tensors go in which flat bucket, packing and unpacking.

Pure tensor code (no process groups) so it is tested on its own; `engine/weights/collective.py` moves the
buckets. A bucket holds tensors of one dtype, at most `bucket_bytes`, each at an element offset.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from streamrl.engine.messages import BucketSpec, TensorSpec

# ---- layout -----------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bucket dtype {name!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
    return dtype


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], bucket_bytes: int
) -> list[BucketSpec]:
    """Flat buckets of one dtype each, at most `bucket_bytes` (a larger tensor gets a bucket of its own).

    Tensors keep their order inside a dtype; a bucket is listed when it is opened, so the first
    bucket holds the first tensors. A tied duplicate (lm_head.weight sharing embed_tokens) travels
    once: its spec points at the first name's offset. It is still listed, because vLLM 0.32's
    `reload_weights` computes wrong logits when a tied lm_head.weight is left out (measured).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes = {bucket_bytes}: must be > 0 (set weights.bucket_mb > 0)")
    buckets: list[BucketSpec] = []
    open_bucket: dict[torch.dtype, BucketSpec] = {}
    placed: dict[tuple, tuple[BucketSpec, int]] = {}
    names: set[str] = set()
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    for name, t in items:
        if name in names:
            raise ValueError(f"tensor name {name!r} appears twice in the state dict")
        names.add(name)
        numel, key = t.numel(), _storage_key(t)
        if key in placed:
            bucket, offset = placed[key]
            bucket.tensors.append(TensorSpec(name=name, shape=list(t.shape), offset=offset, numel=numel))
            continue
        bucket = open_bucket.get(t.dtype)
        if bucket is None or (bucket.numel + numel) * t.element_size() > bucket_bytes and bucket.tensors:
            bucket = BucketSpec(dtype=dtype_name(t.dtype), numel=0, tensors=[])
            open_bucket[t.dtype] = bucket
            buckets.append(bucket)
        placed[key] = (bucket, bucket.numel)
        bucket.tensors.append(TensorSpec(name=name, shape=list(t.shape), offset=bucket.numel, numel=numel))
        bucket.numel += numel
    return buckets


def pack_bucket(
    spec: BucketSpec,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """One flat tensor (`out` when given) holding the bucket's tensors at their offsets.

    check=False skips the per-tensor shape and dtype checks: for a layout planned from these very
    tensors and checked once already (the learner packs the same ~300 tensors every step, and the
    checks cost more host time than the copy they guard)."""
    flat = torch.empty(spec.numel, dtype=torch_dtype(spec.dtype), device=device) if out is None else out
    if check:
        primaries, end = [], 0
        for ts in spec.tensors:
            t = tensors.get(ts.name)
            if t is None or list(t.shape) != ts.shape or t.dtype != flat.dtype:
                got = "missing" if t is None else f"{dtype_name(t.dtype)}{list(t.shape)}"
                raise ValueError(f"tensor {ts.name!r} is {got}; the layout says {spec.dtype}{ts.shape}")
            if ts.offset == end:  # a tied alias points back at an earlier offset: its bytes are already in
                primaries.append(t.detach().reshape(-1))
                end += ts.numel
        if end != spec.numel:
            raise ValueError(f"bucket layout is not contiguous: tensors cover {end} of {spec.numel} elements")
    else:
        primaries = [tensors[name].view(-1) for name in _primary_names(spec)]
    if all(t.device == flat.device for t in primaries):
        torch.cat(primaries, out=flat)  # one batched kernel instead of a copy per tensor (~290 in a 0.5B)
    else:
        offset = 0
        for t in primaries:
            flat[offset : offset + t.numel()].copy_(t, non_blocking=True)
            offset += t.numel()
    return flat


def _primary_names(spec: BucketSpec) -> list[str]:
    """The bucket's tensors that own their bytes, in order (a tied alias points back at an earlier offset)."""
    names, end = [], 0
    for ts in spec.tensors:
        if ts.offset == end:
            names.append(ts.name)
            end += ts.numel
    return names


def unpack_bucket(spec: BucketSpec, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into `flat`, named and shaped by the layout (no copy)."""
    if flat.numel() != spec.numel:
        raise ValueError(f"bucket holds {flat.numel()} elements; the layout says {spec.numel}")
    for ts in spec.tensors:
        yield ts.name, flat[ts.offset : ts.offset + ts.numel].view(ts.shape)


class BufferPool:
    """Flat buffers kept between transfers: a fresh 1 GB CPU buffer costs its page faults on every
    transfer (measured: 5x a raw broadcast on CPU without reuse). A buffer is reused by the next
    transfer of the same layout, so views into it are valid until then. `allocate(numel, dtype)` makes
    the CPU buffers (`ipc.shared_empty`: in memory other processes can map); CUDA ones are plain."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._allocate = allocate

    def take(self, index: int, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            buf = self._buffers.get(index)
            if buf is None or buf.dtype != dtype or buf.numel() != numel or buf.device != device:
                if self._allocate is not None and device.type == "cpu":
                    buf = self._buffers[index] = self._allocate(numel, dtype)
                else:
                    buf = self._buffers[index] = torch.empty(numel, dtype=dtype, device=device)
            return buf

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


class PackedBuckets:
    """Buckets packed once on first use and shared by every node's sender thread."""

    def __init__(
        self,
        specs: list[BucketSpec],
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str,
        pool: BufferPool | None = None,
        check: bool = True,
    ):
        self.specs, self._tensors, self.device = specs, tensors, torch.device(device)
        self.pool, self._check = pool, check  # pool: the buffers, reused by a later version's packing
        self._flat: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.specs)

    def get(self, index: int) -> torch.Tensor:
        with self._lock:
            if index not in self._flat:
                spec = self.specs[index]
                out = (
                    None
                    if self.pool is None
                    else self.pool.take(index, torch_dtype(spec.dtype), spec.numel, self.device)
                )
                self._flat[index] = pack_bucket(spec, self._tensors, self.device, out, self._check)
            return self._flat[index]

    @classmethod
    def of_flats(cls, specs: list[BucketSpec], flats: list[torch.Tensor]) -> PackedBuckets:
        """Buckets packed already (a relay's copy of a version it received): `get(i)` is `flats[i]`."""
        packed = cls(specs, {}, flats[0].device if flats else "cpu")
        packed._flat = dict(enumerate(flats))
        return packed
