"""cfrun's hook, on the PYTHONPATH of rank processes only (see cfrun.supervisor.launcher).

Activates cfrun's runtime in torchrun's worker processes and nowhere else: only where the
supervisor set CFRUN_RANK_SETTINGS (cfrun.rank.settings), not in torchrun's own agent (no RANK;
with --launcher python there is no agent: the script's process, without RANK, is the rank),
not in DataLoader workers or other subprocesses of a rank (they inherit
CFRUN_HOOK_OWNER_PID, which names their parent). Imports nothing heavy: the runtime installs
itself only once the script imports torch. Then it runs the sitecustomize that this one shadows,
if any. It never raises.
"""

import os
import sys


def _cfrun_observe():
    """cfrun verify --against-plain: the plain run's observer (cfrun.rank.verify.observe), in
    the script's own process only, installed once the script imports torch."""
    env = os.environ
    config = env["CFRUN_VERIFY_OBSERVE"]
    if ("RANK" not in env or "LOCAL_RANK" not in env) and '"launcher": "python"' not in config:
        return  # torchrun's agent
    owner = env.get("CFRUN_HOOK_OWNER_PID")
    if owner and owner != str(os.getpid()):
        return
    env["CFRUN_HOOK_OWNER_PID"] = str(os.getpid())
    try:
        from cfrun.rank.install import when_torch_imported

        def start():
            from cfrun.rank.verify import observe

            observe(config)

        when_torch_imported(start)
    except Exception as e:
        sys.stderr.write(f"[cfrun] WARNING: cfrun verify's observer failed ({e!r})\n")


def _cfrun_activate():
    env = os.environ
    if "CFRUN_RANK_SETTINGS" not in env:
        if "CFRUN_VERIFY_OBSERVE" in env:
            _cfrun_observe()
        return
    # torchrun's ranks have RANK; --launcher python's one process is the rank itself
    if ("RANK" not in env or "LOCAL_RANK" not in env) and \
            '"launcher": "python"' not in env["CFRUN_RANK_SETTINGS"]:
        return
    owner = env.get("CFRUN_HOOK_OWNER_PID")
    if owner and owner != str(os.getpid()):
        return
    env["CFRUN_HOOK_OWNER_PID"] = str(os.getpid())
    try:
        from cfrun.rank.install import arm

        arm()
    except Exception as e:
        sys.stderr.write(f"[cfrun] WARNING: cfrun's hook failed ({e!r}); this job runs "
                         "UNPROTECTED: no checkpoints, no resume\n")


def _cfrun_chain():
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        sys.modules.pop("sitecustomize", None)
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError:
        if me is not None:
            sys.modules["sitecustomize"] = me
    except Exception as e:
        sys.stderr.write(f"[cfrun] WARNING: your sitecustomize raised {e!r}\n")
    finally:
        sys.path[:] = saved


try:
    _cfrun_activate()
finally:
    _cfrun_chain()
