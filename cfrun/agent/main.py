"""``python -m cfrun.agent``: the persist agent's command line (the supervisor starts it).

Parses the flags, lowers the process's CPU and I/O priority, builds the peer tier and level-2
store when asked, creates the job's private slot directory when none is given, and serves
(:class:`cfrun.agent.server.PersistAgent`) until SIGTERM, which drains the queue. Exit codes:
0 after SIGTERM, 3 when another process holds the address.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from pathlib import Path

from cfrun.agent.server import PersistAgent
from cfrun.contract import settings as E
from cfrun.contract import slots
from cfrun.contract.jobdir import JobDir
from cfrun.contract.jobkey import ensure_job_key
from cfrun.contract.manifest import ManifestKeys

logger = logging.getLogger("cfrun.agent")


def _lower_priority() -> None:
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except Exception:
        pass


def main(argv: list[str] | None = None) -> None:
    """``python -m cfrun.agent --job-dir DIR --keep N``; SIGTERM drains the queue and exits."""
    p = argparse.ArgumentParser(prog="cfrun.agent")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--no-odirect", action="store_true")
    p.add_argument("--peer", default=None, help="HOST:PORT of a `cfrun peer`")
    p.add_argument("--peer-token-file", default=None)
    p.add_argument("--peer-streams", type=int, default=4)
    p.add_argument("--peer-job", default=None)
    p.add_argument("--per-job-key", action="store_true",
                   help="seal under the job dir's job.key (--job-key-file), not the peer token")
    p.add_argument("--persist-to", default=os.environ.get(E.PERSIST_TO),
                   help=f"level-2 directory or URL to resume from (default: ${E.PERSIST_TO}; "
                        "the supervisor passes it there: a URL may hold a password)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--local-world-size", type=int, default=None)
    p.add_argument("--address", default=os.environ.get(E.AGENT_ADDRESS),
                   help=f"abstract socket name (default: ${E.AGENT_ADDRESS}, else random; the "
                        "supervisor passes it there, out of every user's sight)")
    p.add_argument("--slot-dir", default=None, help="the job's private slot directory "
                   "(default: a new one, removed at exit)")
    p.add_argument("--world-size", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[cfrun agent] %(message)s")
    _lower_priority()
    jd = JobDir(Path(args.job_dir))
    job = args.peer_job or jd.root.name
    peer = None
    if args.peer:
        from cfrun.agent.peerpath import job_seal_keys
        from cfrun.agent.peertier import PeerTier
        from cfrun.peer.protocol import parse_address, read_token

        token = read_token(args.peer_token_file, option="--peer-token-file")
        peer = PeerTier(parse_address(args.peer, option="--peer"), token, job,
                        streams=args.peer_streams, emit=jd.emit_event,
                        seal_keys=job_seal_keys(jd.root, job, token=token,
                                                per_job_key=args.per_job_key))
    level2 = None
    if args.persist_to:
        from cfrun.storage.tiers import open_storage

        level2 = open_storage(args.persist_to)
    # the job dir's checkpoints carry a MAC under its own job.key (made with the job dir)
    manifest_keys = ManifestKeys.of_job_key(ensure_job_key(jd.root))
    own_slot_dir = None if args.slot_dir else slots.create_dir(jd.root)
    agent = PersistAgent(Path(args.job_dir), keep=args.keep, use_odirect=not args.no_odirect,
                         peer=peer, level2=level2, job=job, nnodes=args.nnodes,
                         node_rank=args.node_rank, local_world_size=args.local_world_size,
                         address=args.address, world_size=args.world_size,
                         slot_dir=Path(args.slot_dir) if args.slot_dir else own_slot_dir,
                         manifest_keys=manifest_keys)
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to cfrun, which stops us
    try:
        agent.serve()
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        logger.warning("cfrun agent: another process holds the address %s; not serving",
                       agent.address)
        sys.exit(3)
    finally:
        if own_slot_dir is not None:
            slots.remove_dir(own_slot_dir)
    sys.exit(0)


if __name__ == "__main__":
    main()
