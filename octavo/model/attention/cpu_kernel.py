"""The CPU paged-decode kernel (csrc/paged_decode.cpp), compiled once per machine on first use.

It is built with torch's C++ extension tooling into ``$OCTAVO_CACHE/torch_extensions`` (a minute
the first time, instant later). Where it cannot be built (no compiler), octavo falls back to the
pure-torch backend and says so once.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from typing import Any

from octavo.model.loader import cache_dir

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@cache
def load_paged_decode() -> Any | None:
    """The compiled module, or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        build = cache_dir() / "torch_extensions"
        build.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(build))
        return load(
            name="octavo_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means "use the torch backend"
        logger.warning("CPU paged-decode kernel unavailable (%s); using the torch backend", e)
        return None
