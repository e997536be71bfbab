"""The former name of specjax/shipped.py (the drafters specjax ships, and their asset format).

heads.py and methods/__init__.py still import this name, and both are being changed elsewhere;
when they import specjax.shipped, this file goes.
"""

from specjax.shipped import *  # noqa: F401,F403
