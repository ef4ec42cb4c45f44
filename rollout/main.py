"""A rollout node as a process: `python -m streamrl.rollout.main --config FILE --trajectory-addr tcp://HOST:PORT`.

Checks the learner's trajectory socket is reachable before loading the model (an unreachable
address fails within `transport.send_timeout_s`, naming it), then runs `RolloutNode` until the
source ends, `max_groups` groups are done, or SIGTERM/SIGINT (in-flight groups get a grace period,
the rest are abandoned and reported). Exit status: 0 done, 1 transport failure, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from streamrl.engine.config import Config, ConfigError, load
from streamrl.engine.models import ModelLoadError
from streamrl.engine.transport import TrajectorySender, TransportError
from streamrl.rollout.sources import PromptSourceError

log = logging.getLogger("streamrl.rollout")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


async def _run(cfg: Config, sender: TrajectorySender, node_id: str, max_groups: int | None):
    from streamrl.engine.models import default_tiny_model, load_tokenizer
    from streamrl.rewards import build_scorer
    from streamrl.rollout.engine import build_engine
    from streamrl.rollout.node import RolloutNode
    from streamrl.rollout.sources import PromptSource

    tokenizer = load_tokenizer(cfg.model.path or str(default_tiny_model()), cfg.model.trust_remote_code)
    source = PromptSource(cfg.data, tokenizer, seed=cfg.run.seed)
    scorer = build_scorer(cfg.reward)
    engine = build_engine(cfg, resolve_device(cfg.run.device))
    node = RolloutNode(cfg, node_id, engine, source, scorer, sender, tokenizer)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, node.stop, signal.Signals(sig).name)
    try:
        stats = await node.run(max_groups)
    finally:
        await engine.close()
        scorer.close()
    log.info(
        "node %s done: %s; prompts skipped: %d overlong, %d malformed",
        node_id,
        stats,
        source.skipped_overlong,
        source.skipped_malformed,
    )
    return stats


def main(cfg: Config, trajectory_addr: str, node_id: str | None = None, max_groups: int | None = None) -> int:
    """Run one rollout node streaming to `trajectory_addr`; returns the process exit status."""
    node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
    t = cfg.transport
    try:
        with TrajectorySender(trajectory_addr, node_id, t.hwm, t.send_timeout_s) as sender:
            sender.wait_connected(t.send_timeout_s)
            asyncio.run(_run(cfg, sender, node_id, max_groups))
    except TransportError as e:
        log.error("%s", e)
        return 1
    except (ConfigError, ValueError, PromptSourceError, ModelLoadError) as e:
        log.error("bad input: %s", e)
        return 2
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m streamrl.rollout.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="TOML config file (defaults when omitted)")
    parser.add_argument("--trajectory-addr", required=True, help="the learner's trajectory socket, tcp://HOST:PORT")
    parser.add_argument("--node-id", help="unique node name (default: host-pid)")
    parser.add_argument("--max-groups", type=int, help="stop after this many prompt groups")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override")
    return parser.parse_args(argv)


def cli(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(args.config, args.set)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    return main(cfg, args.trajectory_addr, args.node_id, args.max_groups)


if __name__ == "__main__":
    sys.exit(cli())
