"""The scenarios the test layers share: functions each rank of a multi-process launch runs (importable by name
from the worker processes), one-process references, and the scripts `accelerate launch` starts."""
