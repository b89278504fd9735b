"""A1111's built-in Lora extension kept in effect while sd-accel runs the UNet.

That extension merges networks into the weights lazily: lora_patches.LoraPatches replaces the forward of
torch.nn.Linear, Conv2d, GroupNorm, LayerNorm and MultiheadAttention with one that first calls
networks.network_apply_weights(layer), which restores the layer's backup and adds the wanted networks' deltas in
place whenever networks.loaded_networks differs from what the layer last got. The torch path replays CUDA graphs
and runs fused kernels that read the weights without calling those forwards, so a network chosen (or reweighted)
after the first capture never reached them. Here the adapter calls network_apply_weights itself, on every such
layer, when the wanted networks change; the weights change in place, where the graphs and packed weights read them.

A1111 is never imported: its `networks` module is looked up in sys.modules (A1111 puts the extension's folder on
sys.path, so the extension's scripts import it under that name), and this module loads without A1111.
"""

from __future__ import annotations

import sys
from operator import attrgetter
from types import ModuleType

import torch
from torch import nn

# The layer types whose forward lora_patches.LoraPatches routes through network_apply_weights.
PATCHED_TYPES = (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.LayerNorm, nn.MultiheadAttention)

# network_apply_weights' `wanted_names`: these attributes of each loaded network, in this order. A layer is
# patched again when its network_current_names differs from that tuple, so ours must be the same to agree on when.
KEY_FIELDS = ("name", "te_multiplier", "unet_multiplier", "dyn_dim")
_network_key = attrgetter(*KEY_FIELDS)


def lora_extension() -> ModuleType | None:
    """A1111's Lora `networks` module when it is loaded and has what is used here; else None (no Lora extension,
    or one that applies networks another way, such as Forge's)."""
    networks = sys.modules.get("networks")
    if (networks is None or not isinstance(getattr(networks, "loaded_networks", None), list)
            or not callable(getattr(networks, "network_apply_weights", None))):
        return None
    return networks


def wanted_networks(networks: ModuleType) -> tuple:
    """What network_apply_weights calls `wanted_names`: the networks to merge now, with their multipliers."""
    return tuple(map(_network_key, networks.loaded_networks))


def apply_networks(unet: nn.Module, networks: ModuleType) -> None:
    """network_apply_weights on every patched layer of unet: each either already holds the wanted networks or gets
    its backup back plus their deltas, in place."""
    # Its restore (network_restore_weights_from_backup) copies into the Parameters outside any no_grad of its own.
    with torch.no_grad():
        for layer in unet.modules():
            if isinstance(layer, PATCHED_TYPES):
                networks.network_apply_weights(layer)


class LoraSync:
    """Keeps one UNet's weights holding the networks A1111 wants, for engines that do not call the layers' forwards.

    Lives as long as the adapter's engine: A1111 makes a new SdUnet (so a new LoraSync) around every weight load.
    """

    def __init__(self) -> None:
        # Unknown at first: the built-in UNet may have merged networks into these layers before sd-accel was chosen.
        self.applied: tuple | None = None

    def sync(self, unet: nn.Module, functional: bool) -> bool:
        """Bring unet's weights to the networks wanted now. False when the call must run on the plain model instead:
        `functional` is A1111's lora_functional option, whose networks are computed inside the layers' forwards.

        An unchanged step costs one small tuple built and compared; the layers are walked only when it changes.
        """
        networks = lora_extension()
        if networks is None:
            return True
        wanted = wanted_networks(networks)
        if functional and wanted:
            # network_forward (the functional mode) also restores each layer it runs from backup and forgets what
            # was merged, so what we applied is unknown once the plain model has run.
            self.applied = None
            return False
        if wanted != self.applied:
            apply_networks(unet, networks)
            self.applied = wanted
        return True

