"""A rollout node for the weight-transfer tests: vLLM AsyncLLM with the receiver extension.

Driven by the test (the learner) over a socket given as an inherited fd, in msgpack frames:
`{"op": "weights", "ready": <WeightsReady bytes>}` -> `{"applied": <WeightsApplied bytes>}`,
`{"op": "logprobs", "seqs": [[ids]]}` -> `{"logprobs": [[per token after the first]], "version"}`,
`{"op": "generate", "prompt": [ids], "n", "max_tokens"}` -> `{"tokens": [[ids]], "version"}`,
`{"op": "start_long", "prompt", "max_tokens"}` (returns with the request in flight), `{"op": "finish_long"}`,
`{"op": "stop"}`. It announces itself with a `Register` frame once its engine is up, and refuses
to generate before its first weights arrived (a node generates only with the learner's weights).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid
from multiprocessing.connection import Connection

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import msgspec  # noqa: E402

from streamrl.engine import messages  # noqa: E402
from streamrl.engine.messages import Register, WeightsApplied  # noqa: E402


def make_engine(model: str):
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamrl.engine.workers.lifeline import children_die_with_me
    from streamrl.rollout.backends.vllm_worker import WORKER_EXTENSION

    children_die_with_me()  # as VLLMBackend does: a killed node must not leave its engine core behind
    args = AsyncEngineArgs(
        model=model,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=256,
        seed=0,
        worker_extension_cls=WORKER_EXTENSION,
    )
    return AsyncLLM.from_engine_args(args)


class FakeNode:
    """Stands in for `RolloutNode` (rollout/node.py): an AsyncLLM with the product's weight receiver, driven over
    the test's socketpair (generate, stage-and-swap a version, logprobs) instead of the ledger and the learner's
    sockets."""

    def __init__(self, engine, node_id: str):
        self.engine, self.node_id, self.version = engine, node_id, -1  # -1: no learner weights yet
        self.long_tokens: list[int] = []  # the streaming request of start_long, as it grows
        self.long_task, self.tokens_at_apply = None, -1

    async def run_one(self, prompt_ids: list[int], params) -> object:
        from vllm.inputs import TokensPrompt

        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, uuid.uuid4().hex):
            final = out
        return final

    async def weights(self, req: dict) -> dict:
        from streamrl.rollout.backends.vllm_worker import stage_and_swap_async_llm

        ready = messages.decode_control(req["ready"])
        start = time.perf_counter()
        try:
            await stage_and_swap_async_llm(self.engine, ready)
            self.version = ready.version
            self.tokens_at_apply = len(self.long_tokens)
            reply = WeightsApplied(node_id=self.node_id, version=self.version, seconds=time.perf_counter() - start)
        except Exception as e:
            reply = WeightsApplied(node_id=self.node_id, version=ready.version, seconds=0.0, error=str(e))
        return {"applied": messages.encode(reply)}

    async def logprobs(self, req: dict) -> dict:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outs = await asyncio.gather(*(self.run_one(seq, params) for seq in req["seqs"]))
        lps = [
            [pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], seq[1:])]
            for out, seq in zip(outs, req["seqs"])
        ]
        return {"logprobs": lps, "version": self.version}

    async def generate(self, req: dict) -> dict:
        from vllm import SamplingParams

        if self.version < 0:
            return {"error": "no weights from the learner yet"}
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=1.0, ignore_eos=True)
        outs = await asyncio.gather(*(self.run_one(req["prompt"], params) for _ in range(req["n"])))
        return {"tokens": [list(out.outputs[0].token_ids) for out in outs], "version": self.version}

    async def start_long(self, req: dict) -> dict:
        """Start one long request and return once its first tokens streamed in (it stays in flight)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=req["max_tokens"], temperature=1.0, ignore_eos=True)
        first = asyncio.Event()

        async def stream():
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=req["prompt"]), params, uuid.uuid4().hex
            ):
                self.long_tokens[:] = out.outputs[0].token_ids
                first.set()

        self.long_tokens, self.tokens_at_apply = [], -1
        self.long_task = asyncio.ensure_future(stream())
        await first.wait()
        return {"streamed": len(self.long_tokens)}

    async def finish_long(self, req: dict) -> dict:
        await self.long_task
        return {"tokens": list(self.long_tokens), "tokens_at_apply": self.tokens_at_apply}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--fd", type=int, required=True)
    opts = parser.parse_args()
    conn = Connection(opts.fd)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start():
        return make_engine(opts.model)

    node = FakeNode(asyncio.run_coroutine_threadsafe(start(), loop).result(), opts.node_id)
    conn.send_bytes(messages.encode(Register(node_id=opts.node_id, host="127.0.0.1")))
    while True:
        req = msgspec.msgpack.decode(conn.recv_bytes())
        if req["op"] == "stop":
            break
        handler = getattr(node, req["op"])
        conn.send_bytes(msgspec.msgpack.encode(asyncio.run_coroutine_threadsafe(handler(req), loop).result()))
    node.engine.shutdown()
    os._exit(0)  # skip interpreter teardown of vLLM's and gloo's threads


if __name__ == "__main__":
    main()
