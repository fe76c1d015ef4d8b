"""``cfrun verify`` inside a rank: a digest per step, the stop step, and the chosen kills.

Active only in the runs of ``cfrun verify`` (:attr:`RankSettings.verify`); a normal run builds
nothing of it. Training thread, called from the optimizer step hook
(:meth:`cfrun.rank.boundary.Boundary.on_optimizer_step`) and the checkpoint boundary:

* after every counted optimizer step, one :class:`cfrun.contract.verify.StepDigest` line (the
  stepping optimizer's parameters and the global RNGs) goes to
  ``verify/digests-rank-R.jsonl``, so that ``cfrun verify`` can name the first step where two
  runs differ (:func:`step_digest`);
* the stop step: given (:attr:`RankSettings.verify_stop_step`), or chosen by rank 0 from the
  training loader's first epoch (:func:`auto_stop_step`) and shared through
  ``verify/stop_step.json``. The ranks stop there the way a preemption stops them
  (:meth:`cfrun.rank.preemption.Preemption.stop_for_verify`): a final committed checkpoint, then
  the script ends with exit code 0;
* the kills (:attr:`RankSettings.verify_kills`): a real ``SIGKILL`` of this rank by itself,
  right after an optimizer step (:data:`AFTER_STEP`) or while the checkpoint it just handed to
  the persist agent is being written (:data:`DURING_PERSIST`).

:func:`observe` is the plain run's observer (``--against-plain``): the same digests from a
global optimizer step hook, in a process without cfrun's runtime, ending the process at the
stop step.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from cfrun.contract import coordination as co
from cfrun.contract import verify as V
from cfrun.contract.fsio import atomic_write_json
from cfrun.contract.jobdir import JobDir
from cfrun.rank import log
from cfrun.rank.log import say
from cfrun.rank.settings import RankSettings

AFTER_STEP = 0
"""Kill moment: right after the optimizer step, before the rest of the iteration (the
checkpoint due at this step is not taken)."""
DURING_PERSIST = 1
"""Kill moment: at the step's boundary, once the checkpoint taken there was handed to the
persist agent and before it is committed (the agent commits it: the resume starts there)."""
AUTO_STEPS = 200
"""The stop step chosen when the training loop has no loader with a length."""
DEFAULT_INTERVAL = 10
"""Steps between checkpoints in a verify run without ``--interval``."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def auto_stop_step(epoch_end: int | None, interval: int, step: int) -> int:
    """The stop step rank 0 chooses: ``epoch_end + 2 * interval`` once the first epoch of a
    training loader with a length ended at ``epoch_end`` (so the verify crosses an epoch
    boundary and takes checkpoints on both sides of it), at least two steps after ``step``;
    :data:`AUTO_STEPS` without one."""
    if epoch_end is None:
        return max(AUTO_STEPS, step + 2)
    return max(epoch_end + 2 * interval, step + 2)


def _tensor_digest(h: Any, t: torch.Tensor) -> None:
    """Feed ``t``'s bits into ``h`` (CPU: its bytes; CUDA: two integer sums of its bits, made
    on the device, so only 16 bytes cross the bus)."""
    t = t.detach()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel() == 0:
        return
    flat = t.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    if bits.is_cuda:
        wide = bits.to(torch.int64)
        sums = torch.stack([wide.sum(), (wide * wide).sum(), wide[::2].sum()])
        h.update(sums.cpu().numpy().tobytes())
    else:
        h.update(bits.contiguous().numpy().tobytes())


def params_digest(opt: torch.optim.Optimizer) -> str:
    """A 64-bit digest (hex) of ``opt``'s parameters, every group, in order."""
    h = xxhash.xxh3_64()
    for group in opt.param_groups:
        for p in group["params"]:
            _tensor_digest(h, p)
    return h.hexdigest()


def rng_digests() -> dict[str, str]:
    """A digest (hex) of each global RNG state this process uses: ``torch``, ``cuda`` (when
    initialized), ``python`` (``random``), ``numpy`` (when imported)."""
    out = {"torch": xxhash.xxh3_64_hexdigest(torch.get_rng_state().numpy().tobytes()),
           "python": xxhash.xxh3_64_hexdigest(repr(random.getstate()).encode())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        h = xxhash.xxh3_64()
        for state in torch.cuda.get_rng_state_all():
            h.update(state.numpy().tobytes())
        out["cuda"] = h.hexdigest()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = xxhash.xxh3_64_hexdigest(
            keys.tobytes() + repr((kind, pos, has_gauss, gauss)).encode())
    return out


def step_digest(opt: torch.optim.Optimizer, step: int, attempt: int) -> V.StepDigest:
    """The record of step ``step``: ``opt`` made it (its parameters right after it)."""
    return V.StepDigest(step=step, attempt=attempt, params=params_digest(opt), rng=rng_digests())


def _append(fd: int, line: bytes) -> None:
    try:
        os.write(fd, line)
    except OSError:
        pass  # a verify run on a full disk: the comparison then says the digests are missing


def _open_digests(job_root: Any, rank: int) -> int:
    path = V.digests_path(job_root, rank)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o600)


def kill_self(what: str) -> None:
    """SIGKILL this rank for a planned kill (:func:`cfrun.rank.log.kill_self`)."""
    log.kill_self(f"cfrun verify: SIGKILL {what}")


class Verify:
    """One rank's part of a verify run (see the module doc). Training thread.

    Raises:
        OSError: the digest file cannot be created (the runtime then starts unprotected, and
            ``cfrun verify`` reports missing digests).
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir) -> None:
        self.s = settings
        self.jobdir = jobdir
        self.stop_step: int | None = settings.verify_stop_step
        """The step every rank stops at; None until rank 0 chose it."""
        mine = [k for k in settings.verify_kills if k[1] == settings.attempt
                and k[2] == settings.rank]
        self._after_step = {k[0] for k in mine if k[3] == AFTER_STEP}
        self._in_persist = {k[0] for k in mine if k[3] == DURING_PERSIST}
        self._fd = _open_digests(jobdir.root, settings.rank)
        self._interval = settings.interval or DEFAULT_INTERVAL
        self._first_epoch: int | None = None
        self._epoch_ends: list[int] = []
        self._last_epoch: int | None = None
        self._loader_name: str | None = None
        self._loader_len: int | None = None
        self._looked_up = False

    def on_step(self, opt: torch.optim.Optimizer, step: int,
                train_iter: Callable[[], Any] | None, mode: str | None) -> None:
        """Right after optimizer step ``step`` was counted: its digest, the stop step, and a
        kill at this step (:data:`AFTER_STEP`), in that order."""
        _append(self._fd, step_digest(opt, step, self.s.attempt).to_line())
        it = train_iter() if train_iter is not None else None
        if self.s.rank == 0:
            self._watch_epochs(step, it, mode)
        elif self.stop_step is None:
            chosen = co.read(V.stop_step_path(self.jobdir.root), co.StopStep)
            if chosen is not None:
                self.stop_step = chosen.step
        if step in self._after_step:
            kill_self(f"after step {step} (attempt {self.s.attempt}, rank {self.s.rank})")

    def kill_in_persist(self, step: int) -> bool:
        """True when this rank is to be killed while the checkpoint of ``step`` persists (the
        boundary then takes it without deferring, and calls :meth:`kill_after_handoff`)."""
        return step in self._in_persist

    def kill_after_handoff(self, handed_off: threading.Event, step: int) -> None:
        """SIGKILL this rank as soon as the persist agent has the checkpoint of ``step``."""
        handed_off.wait(60.0)
        kill_self(f"while checkpoint step {step} persists (attempt {self.s.attempt}, "
                  f"rank {self.s.rank})")

    def _watch_epochs(self, step: int, it: Any, mode: str | None) -> None:
        """Rank 0: note where the training loader's epochs end and, in the first attempt
        without a given stop step, choose it (:func:`auto_stop_step`)."""
        changed = False
        epoch = getattr(it, "_cfrun_iter_index", None) if it is not None else None
        if not self._looked_up and it is not None:
            self._looked_up = True
            loader = getattr(it, "_cfrun_loader", None)
            try:
                self._loader_len = len(loader) if loader is not None else None
            except TypeError:
                self._loader_len = None
            self._loader_name = _name_of(loader, self.s.script)
            changed = True
        if epoch is not None:
            if self._last_epoch is not None and epoch != self._last_epoch:
                self._epoch_ends.append(step - 1)
                changed = True
            self._last_epoch = epoch
        if self.stop_step is None:
            sized = mode == "loader" and self._loader_len is not None
            if not sized or self._epoch_ends:
                self.stop_step = auto_stop_step(self._epoch_ends[0] if sized else None,
                                                self._interval, step)
                try:
                    co.write(V.stop_step_path(self.jobdir.root), co.StopStep(self.stop_step))
                except OSError as e:
                    say(f"WARNING: cfrun verify: cannot write the stop step ({e})")
                changed = True
        if changed:
            self.write_info()

    def write_info(self) -> None:
        """Rank 0: ``verify/info.json`` as it stands (best effort)."""
        if self.s.rank != 0:
            return
        info = V.RunInfo(stop_step=self.stop_step, epoch_ends=tuple(self._epoch_ends),
                         loader=self._loader_name, loader_len=self._loader_len,
                         interval=self._interval)
        try:
            atomic_write_json(V.info_path(self.jobdir.root), info.to_json())
        except OSError as e:
            say(f"WARNING: cfrun verify: cannot write {V.info_path(self.jobdir.root)} ({e})")


def _name_of(obj: Any, script: str) -> str | None:
    """The name of a variable of the script's frames (locals, then module globals) that holds
    ``obj``, or None."""
    if obj is None:
        return None
    from cfrun.rank import frames as F

    for f in F.script_frames(sys._getframe(1), script):
        for scope in (f.f_locals, f.f_globals):
            for name, value in scope.items():
                if value is obj and not name.startswith("_"):
                    return name
    return None


# ------------------------------------------------------------------ the plain run's observer


def observe(config_json: str) -> None:
    """The plain run's observer (``cfrun verify --against-plain``), installed by
    ``hooks/sitecustomize.py`` when ``CFRUN_VERIFY_OBSERVE`` is set and cfrun's runtime is not:
    one global optimizer step post-hook (``torch.optim.optimizer.
    register_optimizer_step_post_hook``) that counts steps as cfrun does (the highest step
    count of any optimizer), appends the same :class:`~cfrun.contract.verify.StepDigest` per
    step (it reads the parameters and RNG states, changes nothing) to
    ``digests-rank-R.jsonl`` in the directory ``dir``, and ends the script with exit code 0
    (``SystemExit``, as cfrun's own stop does: ``finally`` blocks run, the code after the loop
    does not) right after the digest of step ``stop_step``; a rank of an initialized process
    group leaves with ``os._exit(0)`` instead, as the interpreter's teardown of a live group
    can abort it. ``config_json``: ``{"dir":
    ..., "stop_step": N}``.

    Raises:
        ValueError: a malformed configuration.
    """
    from pathlib import Path

    from torch.optim.optimizer import register_optimizer_step_post_hook

    doc = json.loads(config_json)
    out_dir, stop_step = Path(doc["dir"]), int(doc["stop_step"])
    rank = int(os.environ.get("RANK", "0"))
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(out_dir / f"digests-rank-{rank:05d}.jsonl",
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    counts: dict[int, int] = {}
    done = [0]

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        count = counts.get(id(opt), 0) + 1
        counts[id(opt)] = count
        if count <= done[0]:
            return
        done[0] = count
        _append(fd, step_digest(opt, count, 0).to_line())
        if count >= stop_step:  # as cfrun's own stop: the script's tail does not run
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                # a live process group torn down by the interpreter's exit can abort the rank
                # (gloo: "terminate called without an active exception", exit -6); the
                # digests are written, so leave without the teardown
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(0)
            raise SystemExit(0)

    register_optimizer_step_post_hook(hook)
