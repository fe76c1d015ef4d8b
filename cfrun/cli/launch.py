"""The launch options of the job commands (``cfrun run``, ``profile``, ``verify``): torchrun's
rendezvous spellings, and the cluster options that neither a flag nor a ``CFRUN_*`` variable
set taken from the launcher's environment (torchrun's ``PET_*``, then SLURM)."""

from __future__ import annotations

import os
from typing import Any

from cfrun.cli.logs import log
from cfrun.contract.errors import BadInputError


def torchrun_rendezvous(standalone: bool, nnodes: str, backend: str, endpoint: str | None,
                        master_addr: str | None, master_port: str | None) -> str | None:
    """The rendezvous endpoint from torchrun's spellings: ``--rdzv-endpoint`` as given, else
    ``--master-addr:--master-port`` (port 29500 by default, torchrun's) where several nodes
    meet; on one node cfrun's ``--standalone`` rendezvous picks its own port and these are
    no-ops.

    Raises:
        BadInputError: ``--standalone`` with several nodes, or a backend other than c10d or
            static.
    """
    if backend.strip().lower() not in ("c10d", "static"):
        raise BadInputError(f"--rdzv-backend {backend!r} is not supported; give c10d or static "
                            "(cfrun runs torchrun's c10d rendezvous), or drop it")
    if standalone and nnodes.partition(":")[0].strip() not in ("", "1"):
        raise BadInputError(f"--standalone runs one node, but --nnodes is {nnodes!r}; drop "
                            "--standalone, or --nnodes")
    if endpoint or not master_addr:
        return endpoint
    return f"{master_addr}:{master_port or 29500}"


def one_node_launch(nproc_per_node: str, standalone: bool, rdzv_backend: str,
                    master_addr: str | None, master_port: str | None) -> str:
    """The launch options of ``cfrun profile`` and ``cfrun verify`` (one node), checked as
    ``cfrun SCRIPT`` checks them: torchrun's rendezvous spellings (no-ops on one node, accepted
    so a torchrun command line pastes) and ``--nproc-per-node auto|gpu`` resolved. Returns
    the ranks per node.

    Raises:
        BadInputError: as :func:`torchrun_rendezvous` and
            :func:`cfrun.contract.cluster.resolve_nproc_per_node`.
    """
    from cfrun.contract.cluster import resolve_nproc_per_node

    torchrun_rendezvous(standalone, "1", rdzv_backend, None, master_addr, master_port)
    say_unused_on_one_node(1, master_addr=master_addr, master_port=master_port)
    return resolve_nproc_per_node(nproc_per_node)


def say_unused_on_one_node(nnodes: int | str, **given: str | None) -> None:
    """One INFO line naming the rendezvous options given (``master_addr``, ``master_port``,
    ``rdzv_endpoint``: torchrun's spellings, accepted so a torchrun line pastes) that a job on
    one node (``nnodes`` 1, as :func:`cfrun.contract.cluster.fixed_nnodes` gives it) does not
    use: its rendezvous takes a free port on this machine at each attempt (torchrun's
    ``--standalone``; cfrun's local launcher), so jobs stacked on one machine never collide on
    a port. Nothing where ``nnodes`` > 1 or none was given."""
    unused = [f"--{name.replace('_', '-')} {value}" for name, value in given.items() if value]
    if str(nnodes).strip() == "1" and unused:
        log.info("cfrun: %s not used on one node: each attempt's rendezvous takes a free port "
                 "on this machine", " and ".join(unused))


def _cluster_defaults(ctx: Any, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with each option that neither a flag nor its ``CFRUN_*`` variable set taken
    from the launcher's environment (:func:`cfrun.contract.cluster.cluster_defaults`: torchrun's
    ``PET_*``, then SLURM); one INFO line says what was taken and from where."""
    from cfrun.contract.cluster import cluster_defaults

    found = cluster_defaults(os.environ)
    out = dict(given)
    taken = []
    for option in given:
        source = ctx.get_parameter_source(option)
        if source is not None and getattr(source, "name", "") != "DEFAULT":
            continue
        default = found.get(option)
        if default is not None:
            out[option] = default[0]
            taken.append(f"{option.replace('_', '-')} {default[0]} ({default[1]})")
    if taken:
        log.info("cfrun: from the environment: %s", ", ".join(taken))
    return out


def run_cluster(ctx: Any, *, standalone: bool, rdzv_backend: str, master_addr: str | None,
                master_port: str | None, nnodes: str, node_rank: str, rdzv_endpoint: str | None,
                rdzv_id: str | None, nproc_per_node: str, max_restarts: str,
                local_addr: str | None) -> dict[str, Any]:
    """``cfrun run``'s cluster options, resolved: the rendezvous endpoint from torchrun's
    spellings (:func:`torchrun_rendezvous`), the options left at their defaults taken from the
    launcher's environment (:func:`_cluster_defaults`), ``--nnodes`` fixed and
    ``--nproc-per-node auto|gpu`` resolved. Returns ``nnodes``, ``node_rank``,
    ``rdzv_endpoint``, ``rdzv_id``, ``nproc_per_node``, ``max_restarts`` and ``local_addr``
    (the keywords of :func:`cfrun.cli.runconfig.build_config`).

    Raises:
        BadInputError: as :func:`torchrun_rendezvous`,
            :func:`cfrun.contract.cluster.fixed_nnodes` and
            :func:`cfrun.contract.cluster.resolve_nproc_per_node`.
    """
    endpoint_given = rdzv_endpoint
    rdzv_endpoint = torchrun_rendezvous(standalone, nnodes, rdzv_backend, rdzv_endpoint,
                                        master_addr, master_port)
    given = {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": rdzv_endpoint,
             "rdzv_id": rdzv_id, "nproc_per_node": nproc_per_node, "max_restarts": max_restarts,
             "local_addr": local_addr}
    taken = _cluster_defaults(ctx, given)
    from cfrun.contract.cluster import fixed_nnodes, resolve_nproc_per_node

    taken["nnodes"] = fixed_nnodes(taken["nnodes"])
    taken["nproc_per_node"] = resolve_nproc_per_node(taken["nproc_per_node"])
    say_unused_on_one_node(taken["nnodes"], master_addr=master_addr, master_port=master_port,
                           rdzv_endpoint=endpoint_given)
    return taken
