"""Process-wide settings (include/expertqmm/settings.h). Each has an EXPERTQMM_* environment variable,
read once; a setter here overrides it for the process."""
from __future__ import annotations

from typing import Dict, List

from . import _core

set_expert_tiles = _core.set_expert_tiles
expert_tiles = _core.expert_tiles
set_decode_layer = _core.set_decode_layer
decode_layer = _core.decode_layer
set_wgmma = _core.set_wgmma
wgmma = _core.wgmma
set_wgmma_width = _core.set_wgmma_width
wgmma_width = _core.wgmma_width
set_deterministic = _core.set_deterministic
deterministic = _core.deterministic
set_product_mode = _core.set_product_mode
product_mode = _core.product_mode
# Any setting by its variable (those without a setter above too: EXPERTQMM_DENSE_CUBLAS, ...).
set_setting = _core.set_setting


def table() -> List[Dict[str, str]]:
    """Every EXPERTQMM_* variable: dicts of variable, values, current (after overrides) and what."""
    return _core.settings_table()
