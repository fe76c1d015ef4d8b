"""Runs until the file named in argv[1] exists (for lock tests)."""
import os
import sys
import time

import torch  # noqa: F401  (a rank that imports torch, like a real one)

open(sys.argv[2], "w").close()  # tell the test we are running
deadline = time.time() + 120
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.05)
print("done waiting")
