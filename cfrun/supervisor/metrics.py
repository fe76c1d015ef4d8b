"""Prometheus metrics of a job, from its job dir (``prometheus_client``).

:class:`JobMetrics` is a ``prometheus_client`` collector: each ``collect()`` reads what was
appended to ``events.jsonl`` since the last one (the events are the job's record; nothing else is
kept in memory than counts and histogram buckets), the ranks' heartbeats and ``config.json``, and
yields:

============================================  ================================================
``cfrun_current_step``                        the highest step any rank reached (heartbeats)
``cfrun_newest_committed_step``               the newest committed checkpoint's step
``cfrun_checkpoints_total``                   checkpoints taken (``checkpoint`` events)
``cfrun_checkpoints_failed_total``            steps the agent could not persist
``cfrun_checkpoints_skipped_total``           steps skipped for lack of disk space
``cfrun_checkpoint_stall_seconds``            histogram: training time lost per checkpoint
``cfrun_checkpoint_pgt_seconds``              histogram: trigger to committed (CheckFreq's PGT)
``cfrun_persisted_bytes_total``               bytes committed
``cfrun_restarts_total{cause}``               restarts by cause: ``killed``, ``exit``,
                                              ``hang``, ``oom``, ``hardware``
``cfrun_attempts_total``                      attempts started
``cfrun_overhead_ratio``                      checkpoint stall over the training wall time so far
``cfrun_overhead_budget_ratio``               the ``--overhead`` budget
``cfrun_ettr_ratio``                          goodput: productive training time / wall time
``cfrun_lost_seconds{cause}``                 wall time lost: ``startup``, ``restart``,
                                              ``recompute``, ``stall``, ``profiling``
``cfrun_peer_up``                             1 while the peer tier answers, 0 when it does not
                                              (absent without ``--peer``)
``cfrun_gpu_memory_used_bytes{gpu,uuid}``     NVML, per visible GPU (absent without NVML);
                                              also ``_total_bytes`` and
                                              ``cfrun_gpu_utilization_ratio``
============================================  ================================================

The supervisor writes them to ``<job_dir>/metrics.prom`` (the textfile collector format of
node_exporter) every few seconds, and serves them at ``--metrics HOST:PORT`` (``/metrics`` only,
no authentication, a bounded pool: :func:`serve`);
``cfrun status JOBDIR --metrics`` prints them for any job dir. Torch-free.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cfrun.contract import coordination
from cfrun.contract.events import OVERHEAD_DEFINITION, overhead_seconds
from cfrun.contract.fsio import read_regular, write_atomic
from cfrun.contract.goodput import goodput
from cfrun.contract.gpus import samples
from cfrun.contract.jobdir import JobDir

STALL_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
PGT_BUCKETS_S = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
MAX_EVENTS_READ_BYTES = 64 << 20
"""At most this much of ``events.jsonl`` is read per scrape (a huge backlog is read in parts)."""
MAX_CONFIG_BYTES = 16 << 20
"""The largest ``config.json`` read for the overhead budget."""


def restart_cause(cause: str) -> str:
    """A ``failure`` event's cause as a label of few values: ``hang``, ``hardware`` (a GPU
    fault NVML reported), ``oom``, ``killed`` (by a signal) or ``exit`` (a non-zero exit
    code)."""
    if cause.startswith("hang"):
        return "hang"
    if cause.startswith("GPU hardware fault"):
        return "hardware"
    if cause.startswith("out of memory"):
        return "oom"
    return "killed" if "killed by" in cause else "exit"


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def buckets(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, float(total)))
        return out


class JobMetrics:
    """A ``prometheus_client`` collector of one job dir's metrics (module docstring).

    Any process may construct one (the supervisor, ``cfrun status``); ``collect()`` is called
    by ``prometheus_client`` (from its HTTP thread too: calls are serialized by the caller or
    harmless, as each reads files and updates counts under the GIL). ``live``: the job runs
    (the supervisor's own collector): a running attempt's overhead counts to now; None: the
    job dir's lock says (``cfrun status --metrics``).
    """

    def __init__(self, job_dir: str | Path, *, live: bool | None = None) -> None:
        self.live = live
        self.jobdir = JobDir(job_dir)
        self._offset = 0
        self._partial = b""
        self.checkpoints = 0
        self.failed_steps: set[Any] = set()
        self.skipped_steps: set[Any] = set()
        self.stall = _Histogram(STALL_BUCKETS_S)
        self.pgt = _Histogram(PGT_BUCKETS_S)
        self.persisted_bytes = 0
        self.newest_committed: int | None = None
        self.restarts: dict[str, int] = {}
        self.attempts = 0
        self._timeline: list[dict[str, Any]] = []  # what overhead_seconds and goodput read
        self._last_t: float | None = None
        self.peer_up: int | None = None

    def _read_new_events(self) -> None:
        path = self.jobdir.events_path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:  # a FIFO or device is never read (nor waited on)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            data = os.pread(fd, MAX_EVENTS_READ_BYTES, self._offset)
        finally:
            os.close(fd)
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next scrape
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._apply(event)

    def _apply(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        if isinstance(e.get("t_unix_s"), int | float):
            self._last_t = float(e["t_unix_s"])
        if kind in ("checkpoint", "attempt_start", "attempt_end", "state", "first_step",
                    "resumed", "failure", "profile"):  # what overhead_seconds and goodput read
            self._timeline.append({k: e.get(k) for k in (
                "event", "t_unix_s", "stall_s", "duration_s", "attempt", "step", "state",
                "rank", "excess_s")})
        if kind == "checkpoint":
            self.checkpoints += 1
            if isinstance(e.get("stall_s"), int | float):
                self.stall.observe(float(e["stall_s"]))
        elif kind == "commit":
            step = e.get("step")
            if isinstance(step, int):
                self.newest_committed = max(step, self.newest_committed or step)
            if isinstance(e.get("bytes"), int):
                self.persisted_bytes += e["bytes"]
            if isinstance(e.get("pgt_s"), int | float):
                self.pgt.observe(float(e["pgt_s"]))
        elif kind == "persist_failed":
            self.failed_steps.add(e.get("step"))
        elif kind == "checkpoint_skipped":
            self.skipped_steps.add(e.get("step"))
        elif kind == "failure":
            label = restart_cause(str(e.get("cause", "")))
            self.restarts[label] = self.restarts.get(label, 0) + 1
        elif kind == "attempt_start":
            self.attempts += 1
        elif kind in ("protected", "peer_reconnected", "durable"):
            self.peer_up = 1
        elif kind == "peer_unavailable":
            self.peer_up = 0

    def _budget(self) -> float | None:
        try:
            data = json.loads(read_regular(self.jobdir.config_path, max_bytes=MAX_CONFIG_BYTES))
            return float(data["overhead"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def collect(self) -> Iterator[Any]:
        """The metric families (``prometheus_client`` calls this on every scrape)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        self._read_new_events()
        step = coordination.newest_heartbeat_step(self.jobdir.root)
        if step is not None:
            yield GaugeMetricFamily("cfrun_current_step", "Highest optimizer step a rank reached",
                                    value=step)
        if self.newest_committed is not None:
            yield GaugeMetricFamily("cfrun_newest_committed_step",
                                    "Step of the newest committed checkpoint",
                                    value=self.newest_committed)
        yield CounterMetricFamily("cfrun_checkpoints", "Checkpoints taken",
                                  value=self.checkpoints)
        yield CounterMetricFamily("cfrun_checkpoints_failed", "Checkpoints the agent could not "
                                  "persist", value=len(self.failed_steps))
        yield CounterMetricFamily("cfrun_checkpoints_skipped", "Checkpoints skipped for lack of "
                                  "disk space", value=len(self.skipped_steps))
        yield HistogramMetricFamily("cfrun_checkpoint_stall_seconds", "Training time lost per "
                                    "checkpoint", buckets=self.stall.buckets(),
                                    sum_value=self.stall.sum)
        yield HistogramMetricFamily("cfrun_checkpoint_pgt_seconds", "Trigger to committed per "
                                    "checkpoint (PGT)", buckets=self.pgt.buckets(),
                                    sum_value=self.pgt.sum)
        yield CounterMetricFamily("cfrun_persisted_bytes", "Bytes of committed checkpoints",
                                  value=self.persisted_bytes)
        restarts = CounterMetricFamily("cfrun_restarts", "Restarts by cause", labels=["cause"])
        for cause in ("killed", "exit", "hang", "oom", "hardware"):
            restarts.add_metric([cause], self.restarts.get(cause, 0))
        yield restarts
        yield CounterMetricFamily("cfrun_attempts", "Attempts started", value=self.attempts)
        stall_s, wall_s = overhead_seconds(
            self._timeline, now_unix_s=time.time() if (self.jobdir.is_locked() if self.live is None
                                                        else self.live) else self._last_t)
        if wall_s > 0:
            yield GaugeMetricFamily("cfrun_overhead_ratio", OVERHEAD_DEFINITION[:1].upper()
                                    + OVERHEAD_DEFINITION[1:], value=stall_s / wall_s)
        good = goodput(self._timeline, now_unix_s=time.time() if (
            self.jobdir.is_locked() if self.live is None else self.live) else self._last_t)
        if good is not None and good["ettr"] is not None:
            yield GaugeMetricFamily("cfrun_ettr_ratio", "Effective training time ratio: "
                                    "productive training time / wall time (goodput)",
                                    value=good["ettr"])
            lost = GaugeMetricFamily("cfrun_lost_seconds", "Wall time lost, by cause",
                                     labels=["cause"])
            for cause, seconds in good["lost_s"].items():
                lost.add_metric([cause], seconds)
            yield lost
        budget = self._budget()
        if budget is not None:
            yield GaugeMetricFamily("cfrun_overhead_budget_ratio", "The --overhead budget",
                                    value=budget)
        if self.peer_up is not None:
            yield GaugeMetricFamily("cfrun_peer_up", "1 while the peer tier answers",
                                    value=self.peer_up)
        gpus = samples()
        if gpus:
            used = GaugeMetricFamily("cfrun_gpu_memory_used_bytes", "GPU memory in use (NVML)",
                                     labels=["gpu", "uuid"])
            total = GaugeMetricFamily("cfrun_gpu_memory_total_bytes", "GPU memory (NVML)",
                                      labels=["gpu", "uuid"])
            util = GaugeMetricFamily("cfrun_gpu_utilization_ratio", "GPU utilisation (NVML)",
                                     labels=["gpu", "uuid"])
            for g in gpus:
                labels = [str(g.index), g.uuid]
                used.add_metric(labels, g.memory_used_bytes)
                total.add_metric(labels, g.memory_total_bytes)
                util.add_metric(labels, g.utilization_pct / 100.0)
            yield from (used, total, util)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(self)
        return generate_latest(registry)

    def write_textfile(self) -> None:
        """Atomically replace ``<job_dir>/metrics.prom`` (0600) with :meth:`exposition`, best
        effort: a full or read-only disk skips this write."""
        try:
            write_atomic(self.jobdir.root / METRICS_FILE, [self.exposition()], sync_dir=False)
        except OSError:
            pass


METRICS_FILE = "metrics.prom"


MAX_SCRAPES = 4
"""Requests served at once; a connection over the cap is closed at once (no thread, no queue)."""
REQUEST_DEADLINE_S = 5.0
"""A request's whole life, from accept to the last byte sent: a client that sends its request
one byte at a time is cut off then (``prometheus_client``'s server kept a thread per idle
connection forever: 400 half-requests held 400 threads; issue 24, item 6)."""


class _MetricsHandler(BaseHTTPRequestHandler):
    """``GET``/``HEAD /metrics`` only (404 for any other path, 405 for other methods)."""

    server: _MetricsServer
    timeout = REQUEST_DEADLINE_S  # per socket operation; the deadline bounds the whole

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._reply(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._reply(head=True)

    def _reply(self, *, head: bool) -> None:
        if urlsplit(self.path).path != "/metrics":
            self.send_error(404, "only /metrics is served")
            return
        body = self.server.metrics.exposition()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # scrapes are not the console's business


class _MetricsServer(HTTPServer):
    """An HTTP server with at most :data:`MAX_SCRAPES` requests in flight, each in a pool
    thread and cut off :data:`REQUEST_DEADLINE_S` after its accept."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connects is accepted and closed

    def __init__(self, address: tuple[str, int], metrics: JobMetrics) -> None:
        self.metrics = metrics
        self.slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self.pool = ThreadPoolExecutor(MAX_SCRAPES, thread_name_prefix="cfrun-metrics")
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _MetricsHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: closed, nothing held
            return
        self.pool.submit(self._work, request, client_address)

    def _work(self, request: socket.socket, client_address: Any) -> None:
        cut = threading.Timer(REQUEST_DEADLINE_S, _cut_off, args=(request,))
        cut.daemon = True
        cut.start()
        try:
            self.finish_request(request, client_address)
        except Exception:
            pass  # a client that went away or was cut off
        finally:
            cut.cancel()
            self.shutdown_request(request)
            self.slots.release()

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False)


def _cut_off(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns at once
    except OSError:
        pass


def serve(metrics: JobMetrics, address: str) -> tuple[Any, int]:
    """Serve ``metrics`` at ``http://HOST:PORT/metrics`` from a daemon thread; no other path.
    There is no authentication: anyone who reaches the address reads the job's metrics (bind
    127.0.0.1, or a pod IP behind a NetworkPolicy). At most :data:`MAX_SCRAPES` requests are
    served at once, each within :data:`REQUEST_DEADLINE_S`. Returns (server, bound port);
    ``server.shutdown()`` stops it.

    Raises:
        BadInputError: a malformed address.
        OSError: the address cannot be bound.
    """
    from cfrun.peer.protocol import parse_address

    host, port = parse_address(address, option="--metrics")
    server = _MetricsServer((host, port), metrics)
    threading.Thread(target=server.serve_forever, name="cfrun-metrics-accept",
                     daemon=True).start()
    return server, server.server_address[1]
