"""The persist agent: one long-lived process per node that makes snapshots durable (phase 2).

Started by the supervisor, it outlives restarts of the ranks (DeepFreeze §IV-A's separate
backend process, like VELOC), so a snapshot a rank finished just before it crashed is still
persisted and committed. Ranks copy their state into a shared-memory slot (``snapshot.py``) and
send one message per checkpoint: step, slot path, byte count and the shard's JSON tree. The agent
writes the slot's bytes to ``rank-NNNNN.bin`` straight from the shared mapping (no unpickling,
no re-serialization: ACUTE's Check-Pack), computes the xxh3-64 checksum, fsyncs, and once every
rank's shard of that step is durable it commits the step (manifest last, atomic rename, directory
fsync, retention) and answers each rank ``persisted``.

It runs at low CPU and I/O priority (it competes with training on small machines) and writes in
large aligned chunks, with ``O_DIRECT`` where the file system allows it, so the page cache is not
filled with checkpoint bytes.

Messages (``cfrun.ipc``):

* ``{"op": "hello", "rank": r}`` -> ``{"op": "ready"}`` once every earlier persist of the queue is
  done (a restarted rank waits for it before it looks for checkpoints or reuses its slot);
* ``{"op": "persist", "step", "rank", "world_size", "slot", "nbytes", "doc", "t_trigger_unix_s"}``
  -> ``{"op": "persisted", "step", "ok", "persist_s", "pgt_s", "bytes", "error"}``.

Run as ``python -m cfrun.agent --job-dir DIR --keep N``.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import queue
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import xxhash

from cfrun import ipc
from cfrun.checkpoint import FileEntry, commit, remove_staging, shard_names, staging_dir
from cfrun.format import dumps_json
from cfrun.jobdir import JobDir

logger = logging.getLogger("cfrun.agent")

WRITE_CHUNK_BYTES = 16 << 20
"""Bytes per ``write()``: large and 4 KiB-aligned (a multiple of any O_DIRECT block size)."""

ENV_TEST_KILL_AT = "CFRUN_TEST_AGENT_KILL_AT"
"""Testing aid: the agent SIGKILLs itself half-way through writing the first step >= this one
(once per job dir)."""


ENV_TEST_SLOW_S = "CFRUN_TEST_AGENT_SLOW_S"
"""Testing aid: the agent sleeps this long before each commit (a slow disk)."""


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


class PersistAgent:
    """Serves one job dir's ranks on this node. Thread-safe; call :meth:`serve`."""

    def __init__(self, job_dir: Path, *, keep: int, use_odirect: bool = True) -> None:
        self.jobdir = JobDir(job_dir)
        self.keep = keep
        self.use_odirect = use_odirect
        self.jobs: queue.Queue[tuple[str, socket.socket, dict[str, Any]] | None] = queue.Queue()
        self.pending: dict[int, dict[int, tuple[list[FileEntry], socket.socket, dict[str, Any]]]] = {}
        self.stopping = threading.Event()
        self.last_committed = -1

    # ------------------------------------------------------------------ connections

    def serve(self) -> None:
        """Listen, read messages on per-connection threads, write on one writer thread."""
        remove_staging(self.jobdir.checkpoints)  # this agent is now the only writer
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(ipc.agent_address(self.jobdir.root))
        srv.listen(64)
        srv.settimeout(0.2)
        writer = threading.Thread(target=self._writer, name="cfrun-persist", daemon=True)
        writer.start()
        self.jobdir.emit_event("agent_start", pid=os.getpid())
        while not self.stopping.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(target=self._reader, args=(conn,), daemon=True).start()
        srv.close()
        self.jobs.put(None)  # drain what was queued, then stop
        writer.join()

    def _reader(self, conn: socket.socket) -> None:
        try:
            while True:
                msg = ipc.recv(conn)
                op = msg.get("op")
                if op in ("hello", "persist"):
                    self.jobs.put((op, conn, msg))
                else:
                    logger.warning("cfrun agent: unknown message %r", op)
        except (ConnectionError, OSError):
            pass

    @staticmethod
    def _reply(conn: socket.socket, msg: dict[str, Any]) -> None:
        try:
            ipc.send(conn, msg)
        except OSError:
            pass  # the rank is gone; the checkpoint still counts

    # ------------------------------------------------------------------ writing

    def _writer(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            op, conn, msg = job
            if op == "hello":
                self._reply(conn, {"op": "ready", "last_committed": self.last_committed})
                continue
            try:
                self._persist(conn, msg)
            except Exception as e:  # one bad checkpoint must not stop the agent
                logger.warning("cfrun agent: persist of step %s failed: %r", msg.get("step"), e)
                self.jobdir.emit_event("persist_failed", step=msg.get("step"),
                                       rank=msg.get("rank"), error=repr(e))
                self._reply(conn, {"op": "persisted", "step": msg.get("step"), "ok": False,
                                   "error": repr(e)})

    def _persist(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        step, rank, world_size = int(msg["step"]), int(msg["rank"]), int(msg["world_size"])
        t0 = time.time()
        staging = staging_dir(self.jobdir.checkpoints, step)
        staging.mkdir(parents=True, exist_ok=True)
        bin_name, json_name = shard_names(rank)
        bin_entry = self._write_slot(staging / bin_name, Path(msg["slot"]), int(msg["nbytes"]),
                                     step)
        json_entry = self._write_bytes(staging / json_name, dumps_json(msg["doc"]))
        shard = self.pending.setdefault(step, {})
        shard[rank] = ([bin_entry, json_entry], conn, msg)
        if len(shard) < world_size:
            return
        slow_s = float(os.environ.get(ENV_TEST_SLOW_S, "0") or 0)
        if slow_s:
            time.sleep(slow_s)
        files = [f for r in sorted(shard) for f in shard[r][0]]
        meta = msg["doc"].get("meta", {})
        commit(self.jobdir.checkpoints, step, files, world_size=world_size,
               meta={k: meta.get(k) for k in ("step", "mode", "epoch", "batches", "not_exact")},
               keep=self.keep)
        t1 = time.time()
        self.last_committed = max(self.last_committed, step)
        del self.pending[step]
        for old in [s for s in self.pending if s < step]:  # a rank died before its snapshot
            del self.pending[old]
            remove_dir = staging_dir(self.jobdir.checkpoints, old)
            import shutil

            shutil.rmtree(remove_dir, ignore_errors=True)
        nbytes = sum(f.nbytes for f in files)
        t_trigger = min(float(m.get("t_trigger_unix_s", t0)) for _, _, m in shard.values())
        reply = {"op": "persisted", "step": step, "ok": True, "bytes": nbytes,
                 "persist_s": round(t1 - t0, 6), "pgt_s": round(t1 - t_trigger, 6),
                 "bandwidth_bytes_per_s": round(nbytes / max(t1 - t0, 1e-9))}
        self.jobdir.emit_event("commit", step=step, bytes=nbytes, persist_s=reply["persist_s"],
                               pgt_s=reply["pgt_s"])
        for _, c, _ in shard.values():
            self._reply(c, reply)

    def _open(self, path: Path) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.use_odirect and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError:
                pass
        return os.open(path, flags, 0o644), False

    def _write_slot(self, path: Path, slot: Path, nbytes: int, step: int) -> FileEntry:
        """Write ``nbytes`` of the shared-memory slot to ``path``, fsynced, with its checksum."""
        kill_at = os.environ.get(ENV_TEST_KILL_AT)
        marker = self.jobdir.root / ".agent-kill-done"
        kill = kill_at is not None and step >= int(kill_at) and not marker.exists()
        with open(slot, "rb") as f, mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            try:
                digest = xxhash.xxh3_64_hexdigest(view)
                fd, direct = self._open(path)
                try:
                    chunk = WRITE_CHUNK_BYTES
                    if kill:
                        chunk = max(4096, nbytes // 2 // 4096 * 4096)  # die half-way through
                    for start in range(0, nbytes, chunk):
                        if kill and start > 0:
                            marker.touch()
                            os.kill(os.getpid(), signal.SIGKILL)
                        piece = view[start:start + chunk]
                        if direct and len(piece) % 4096:
                            os.close(fd)  # the unaligned tail goes through the page cache
                            fd, direct = os.open(path, os.O_WRONLY), False
                            os.lseek(fd, start, os.SEEK_SET)
                        while piece:
                            piece = piece[os.write(fd, piece):]
                        piece.release()
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                piece = None
                view.release()
        return FileEntry(path.name, nbytes, digest)

    @staticmethod
    def _write_bytes(path: Path, data: bytes) -> FileEntry:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return FileEntry(path.name, len(data), xxhash.xxh3_64_hexdigest(data))


def main(argv: list[str] | None = None) -> None:
    """``python -m cfrun.agent --job-dir DIR --keep N``; SIGTERM drains the queue and exits."""
    p = argparse.ArgumentParser(prog="cfrun.agent")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--no-odirect", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[cfrun agent] %(message)s")
    _lower_priority()
    agent = PersistAgent(Path(args.job_dir), keep=args.keep, use_odirect=not args.no_odirect)
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to cfrun, which stops us
    agent.serve()
    sys.exit(0)


if __name__ == "__main__":
    main()
