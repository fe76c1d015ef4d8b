"""A script that never imports torch: cfrun's hook must not import it either."""
import subprocess
import sys

print("torch imported:", "torch" in sys.modules)
print("cfrun.rank imported:", "cfrun.rank" in sys.modules)
child = subprocess.run(
    [sys.executable, "-c", "import sys; print('child cfrun.rank imported:', "
     "'cfrun.rank' in sys.modules, 'torch' in sys.modules)"],
    capture_output=True, text=True, check=True)
print(child.stdout.strip())
