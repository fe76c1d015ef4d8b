"""Compare two checkpoints of one step bit for bit, and name each difference in the user's terms.

``cfrun verify`` (:mod:`cfrun.cli.verify`) loads the checkpoint at the stop step of its
uninterrupted run and of its killed run with the loader a resume uses
(:func:`cfrun.codec.checkpoint.load_shard`: verified, no pickle) and asks :func:`differences`
for every entry that differs. Entries are named as the user knows them: ``model0.fc.weight``,
``optimizer0.state[3].momentum_buffer``, ``scheduler0.last_epoch``, ``RNG numpy``,
``loader position of train_loader``, ``script variable best_acc``, and, for Lightning's
``Trainer.fit``, ``Lightning fit loop ...`` and ``Lightning callback state <state_key>.<field>``
(the adapter's JSON, parsed). They come in the order in
which a difference is most likely a cause rather than a consequence: the data position and the
RNGs (what a step draws), the script's own variables, the schedulers and scalers, then the
optimizers and the models (which follow from all of these).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cfrun.codec.dtensor import LocalShard
from cfrun.contract.verify import LIGHTNING_CALLBACK, LIGHTNING_FILES

_RNG_NAMES = {"torch": "RNG torch", "random": "RNG python random", "numpy": "RNG numpy",
              "cuda": "RNG cuda"}
_MAX_DETAIL = 160


@dataclass(frozen=True)
class Difference:
    """One entry that differs: its name in the user's terms and what differs (``detail``)."""

    entry: str
    detail: str
    rng: str | None = None
    """The global RNG (``torch``, ``cuda``, ``random``, ``numpy``) whose state this entry is
    (the global one, or the copy a loader's epoch was drawn from), else None."""

    def to_json(self) -> dict[str, str]:
        return {"entry": self.entry, "detail": self.detail}


def rng_kind(path: tuple[Any, ...]) -> str | None:
    """The global RNG whose state the entry at ``path`` holds: ``rng.<kind>`` or the copy in
    the loader position's ``epoch_rng``; None otherwise (DataLoader workers' RNGs are seeded
    by torch from the global torch RNG, never from the process's entropy)."""
    if path[:1] == ("rng",) and len(path) > 1:
        return str(path[1])
    if path[:2] == ("data", "epoch_rng"):
        for p in path[2:]:
            if p in _RNG_NAMES:
                return str(p)
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_DETAIL else text[:_MAX_DETAIL - 3] + "..."


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _leaf_detail(a: Any, b: Any) -> str | None:
    """None when ``a`` and ``b`` are the same bits, else what differs."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        ua = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        ub = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if torch.equal(ua, ub):
            return None
        if a.is_floating_point() and a.numel():
            diff = (a.detach().cpu().double() - b.detach().cpu().double()).abs()
            count = int((a.cpu() != b.cpu()).sum())
            return (f"{count} of {a.numel()} values differ, largest by "
                    f"{float(diff.nan_to_num(nan=math.inf).max()):.3g}")
        return f"{int((a.cpu() != b.cpu()).sum())} of {a.numel()} values differ"
    np_type = type(a).__module__ == "numpy" or type(b).__module__ == "numpy"
    if np_type:
        same = type(a) is type(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None) \
            and getattr(a, "shape", None) == getattr(b, "shape", None) \
            and bytes(memoryview(a.tobytes() if hasattr(a, "tobytes") else a)) == \
            bytes(memoryview(b.tobytes() if hasattr(b, "tobytes") else b))
        return None if same else "the values differ"
    if isinstance(a, float) and isinstance(b, float):
        return None if _float_bits(a) == _float_bits(b) else f"{a!r} vs {b!r}"
    if type(a) is not type(b):
        return f"{_short(a)} vs {_short(b)}"
    return None if a == b else f"{_short(a)} vs {_short(b)}"


def _decoded(value: Any, path: tuple[Any, ...]) -> Any:
    """``value`` as a tree: the Lightning adapter's JSON documents in the loader position
    (``data.lightning.fit_loop``, ``.callbacks``, ``.files``: one string each) are parsed, so
    that each loop, callback and directory is an entry of its own; anything else as is."""
    if path[:2] == ("data", "lightning") and len(path) == 3 and isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _walk(a: Any, b: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Every differing leaf below ``path``: ``(path, detail)``. A DTensor's stored shard
    (:class:`cfrun.codec.dtensor.LocalShard`) is its placement and its local tensor."""
    a, b = _decoded(a, path), _decoded(b, path)
    if isinstance(a, LocalShard) and isinstance(b, LocalShard):
        if a.meta != b.meta:
            yield path, f"placed {_short(a.meta)} vs {_short(b.meta)}"
            return
        a, b = a.local, b.local
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in b:
                yield path + (key,), "only in the uninterrupted run"
            elif key not in a:
                yield path + (key,), "only in the killed run"
            else:
                yield from _walk(a[key], b[key], path + (key,))
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield path, f"{len(a)} vs {len(b)} items"
            return
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _walk(x, y, path + (i,))
        return
    detail = _leaf_detail(a, b)
    if detail is not None:
        yield path, detail


def _dotted(parts: tuple[Any, ...]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def entry_name(path: tuple[Any, ...], loader: str, frames: dict[int, str]) -> str:
    """The user's name of the checkpoint entry at ``path`` (keys from the tree's root).

    ``loader``: the script's name of the training loader; ``frames``: the function name of
    each recorded script frame, by its index in ``script``."""
    head, rest = path[0], path[1:]
    if head == "modules" and rest:
        return f"model{rest[0]}" + ("." + _dotted(rest[1:2]) if rest[1:] else "")
    if head == "optimizers" and rest:
        tail = rest[1:]
        if len(tail) >= 3 and tail[0] == "state":
            return f"optimizer{rest[0]}.state[{tail[1]}].{_dotted(tail[2:3])}"
        return f"optimizer{rest[0]}" + ("." + _dotted(tail[:3]) if tail else "")
    if head == "opt_steps":
        return f"optimizer{rest[0]} step count" if rest else "optimizer step counts"
    if head in ("schedulers", "scalers") and rest:
        return f"{head[:-1]}{rest[0]}" + ("." + _dotted(rest[1:2]) if rest[1:] else "")
    if head == "rng":
        return _RNG_NAMES.get(rest[0], f"RNG {rest[0]}") if rest else "RNG states"
    if head == "data":
        if rest and rest[0] == "worker_rng":
            return (f"RNG of DataLoader worker {rest[1]} of {loader}" if len(rest) > 1
                    else f"RNG of the DataLoader workers of {loader}")
        if rest and rest[0] == "epoch_rng":
            kind = rng_kind(path)
            rng = _RNG_NAMES[kind] if kind is not None else "RNG"
            return f"{rng} that {loader}'s epoch was drawn from"
        if rest and rest[0] == "lightning" and len(rest) > 1:
            return _lightning_entry(rest[1], rest[2:4])
        return f"loader position of {loader}"
    if head == "script":
        if len(rest) >= 3 and rest[1] == "values":
            where = frames.get(rest[0], "")
            name = f"script variable {rest[2]}"
            return name if where in ("", "<module>") else f"{name} (in {where}())"
        return "script variables"
    return _dotted(path)


def _lightning_entry(field: str, key: tuple[Any, ...]) -> str:
    """The name of an entry of the Lightning adapter's record (:mod:`cfrun.rank.adapters.
    lightning`): ``field`` is ``fit_loop``, ``callbacks`` or ``files``, ``key`` its first keys
    (a loop's progress; a callback's ``state_key`` and the state's field)."""
    where = str(key[0]) if key else ""
    if field == "callbacks":
        return f"{LIGHTNING_CALLBACK}{where}" + (f".{key[1]}" if len(key) > 1 else "")
    if field == "files":
        return f"{LIGHTNING_FILES}of {where}" if where else LIGHTNING_FILES.rstrip()
    return f"Lightning fit loop {where}".rstrip()


_ORDER = ("data", "rng", "script", "schedulers", "scalers", "opt_steps", "optimizers",
          "modules")
"""The order in which entries are compared: likely causes first (see the module doc)."""


def differences(a: dict[str, Any], b: dict[str, Any], *, loader: str | None = None
                ) -> list[Difference]:
    """Every entry of checkpoint state ``b`` (killed run) that is not bit-identical to ``a``
    (uninterrupted run), in :data:`_ORDER`, one per entry (its first differing leaf), named
    by :func:`entry_name`. States are :func:`cfrun.codec.checkpoint.load_shard`'s trees."""
    loader_name = loader or "the training loader"
    frames = {}
    for i, rec in enumerate(a.get("script") or []):
        code = rec.get("code") if isinstance(rec, dict) else None
        if isinstance(code, (list, tuple)) and len(code) >= 2:
            frames[i] = str(code[1])
    out: list[Difference] = []
    seen: set[str] = set()
    keys = [k for k in _ORDER if k in a or k in b]
    keys += sorted(k for k in set(a) | set(b) if k not in _ORDER and k != "model_bytes")
    for key in keys:
        for path, detail in _walk(a.get(key), b.get(key), (key,)):
            name = entry_name(path, loader_name, frames)
            if name not in seen:
                seen.add(name)
                out.append(Difference(name, detail, rng_kind(path)))
    return out


def _leaves(a: Any, path: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    if path[:1] == ("script",) and path[2:3] == ("code",):
        return  # which frame: not an entry
    a = _decoded(a, path)
    if isinstance(a, dict):
        for key, value in a.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(a, (list, tuple)):
        for i, value in enumerate(a):
            yield from _leaves(value, path + (i,))
    else:
        yield path


def entry_names(a: dict[str, Any], *, loader: str | None = None) -> list[str]:
    """The names (:func:`entry_name`) of every entry of checkpoint state ``a``, each once, in
    :data:`_ORDER` (what a comparison covers)."""
    frames = {i: str(rec["code"][1]) for i, rec in enumerate(a.get("script") or [])
              if isinstance(rec, dict) and isinstance(rec.get("code"), (list, tuple))
              and len(rec["code"]) >= 2}
    out: dict[str, None] = {}
    for key in [k for k in _ORDER if k in a]:
        for path in _leaves(a[key], (key,)):
            out[entry_name(path, loader or "the training loader", frames)] = None
    return list(out)
