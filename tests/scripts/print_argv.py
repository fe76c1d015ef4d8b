import json
import sys

print("ARGV " + json.dumps(sys.argv[1:]))
