"""Worker names in the router service: a configured worker ``NAME`` (``--worker
NAME=URL``) and its engines' sources on the bus, ``NAME/dp<rank>`` (or bare ``NAME``)."""

from __future__ import annotations

import re
from typing import Final

RANK: Final = re.compile(r"/dp(\d+)$")
"""A source's data-parallel rank: ``RANK.sub("", source)`` is its configured worker."""
