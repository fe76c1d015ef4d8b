"""Leaves orphaned grandchildren that exit; under PID 1 cfrun they must be reaped (no zombie)."""
import os
import subprocess
import sys
import time

import torch  # noqa: F401

for _ in range(3):
    subprocess.Popen(["sh", "-c", "sleep 0.2 &"]).wait()  # sh exits, its sleep is orphaned
time.sleep(1.5)
zombies = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z":
            zombies.append(pid)
print("pid of cfrun's parent view:", os.getppid(), "zombies:", zombies, flush=True)
sys.exit(1 if zombies else 0)
