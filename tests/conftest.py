import os
import sys

# Tests import the shared helpers in this folder (tests/equivalence.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))
