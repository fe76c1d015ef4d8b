"""Prints its arguments as one JSON line, ``ARGV [...]``, in one write: torchrun runs ranks
with ``python -u``, where ``print`` writes the text and its newline apart, so two ranks'
lines could interleave on the shared stdout."""
import json
import sys

sys.stdout.write("ARGV " + json.dumps(sys.argv[1:]) + "\n")
sys.stdout.flush()
