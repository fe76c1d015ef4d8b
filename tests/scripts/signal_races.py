"""Drive cfrun's Supervisor with a fake torchrun to hit two signal races (tests only).

argv: JOB_DIR CASE, CASE one of:
  during_spawn       SIGTERM arrives after torchrun was started but before spawn returns it;
  during_stop_agent  SIGTERM arrives while a finished job's supervisor stops the persist agent.
Prints one JSON line: {"rc": exit code or "raised NAME", "child": pid, "agent": pid}.
"""
import json
import os
import signal
import subprocess
import sys

from cfrun.contract.config import RunConfig
from cfrun.supervisor.core import Supervisor

job, case = sys.argv[1], sys.argv[2]
open("x.py", "a").close()  # the supervisor hashes the script (the job's identity)
cfg = RunConfig(script="x.py", script_args=[], job_dir=job, cwd=os.getcwd(), grace_s=5.0)
pids = {}


def spawn_fn(argv, env, cwd, **stdio):
    if case == "during_spawn":
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
        pids["child"] = p.pid
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here: this never returns
        return p
    return subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)


sup = Supervisor(cfg, spawn_fn=spawn_fn)
if case == "during_stop_agent":
    stop_agent = sup._stop_agent

    def signalled_stop_agent(*args, **kwargs):
        pids["agent"] = sup.agent.pid if sup.agent is not None else None
        os.kill(os.getpid(), signal.SIGTERM)
        return stop_agent(*args, **kwargs)

    sup._stop_agent = signalled_stop_agent
try:
    rc = sup.run()
except BaseException as e:  # what escaped the supervisor
    rc = f"raised {type(e).__name__}"
print(json.dumps({"rc": rc, **pids}), flush=True)
