import sys

print("about to fail", flush=True)
sys.exit(7)
