"""What the tests share, one module per subject; tests import from here, never from each other or
from conftest.py."""
