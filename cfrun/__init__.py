"""cfrun: fault tolerance for unmodified PyTorch training scripts.

``cfrun train.py --epochs 90`` runs the script under torchrun, checkpoints it right after
optimizer steps (CheckFreq, FAST'21) and resumes it exactly after a crash. See README.md.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
